"""What `sdplan recommend --out DIR` writes is a run that `sdplan train --config DIR/sdplan.yaml` trains as
planned, from any folder: every path in it is absolute (as `sdplan train` writes its own)."""

from __future__ import annotations

import yaml
from conftest import fake_diffusers_folder, make_images
from typer.testing import CliRunner

from sdplan.cli import app

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def _recommend(model, *args: str):
    return cli("recommend", "--method", "lora", "--model", str(model), "--hardware", "RTX 4090", *args)


def _written(out) -> dict:
    return yaml.safe_load((out / "sdplan.yaml").read_text())


def _steps_line(result) -> str:
    assert result.exit_code == 0, result.stderr
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("steps: ")]
    return line


def test_out_writes_absolute_paths_that_train_from_the_run_folder(tmp_path, monkeypatch):
    """`recommend --dataset sdplan-demo/dataset --out runs/me2` wrote data.path and output.dir as given: `sdplan
    train --config sdplan.yaml` from runs/me2 said 'dataset folder sdplan-demo/dataset does not exist', and with
    data.path pinned trained into runs/me2/runs/me2."""
    fake_diffusers_folder(tmp_path / "model")
    make_images(tmp_path / "photos", 2)
    monkeypatch.chdir(tmp_path)
    result = _recommend("model", "--dataset", "photos", "--out", "runs/me2")
    assert result.exit_code == 0, result.stderr
    run = tmp_path / "runs" / "me2"
    written = _written(run)
    assert written["model"]["path"] == str(tmp_path / "model")
    assert written["data"]["path"] == str(tmp_path / "photos")
    assert written["output"]["dir"] == str(run)
    for where in (run, tmp_path / "elsewhere"):
        where.mkdir(exist_ok=True)
        monkeypatch.chdir(where)
        config = "sdplan.yaml" if where == run else str(run / "sdplan.yaml")
        result = cli("train", "--config", config, "--device", "cpu", "--dry-run")
        assert result.exit_code == 0, result.stderr
        assert f"output: {run}" in result.stdout.splitlines()
    assert not (run / "runs").exists()


def test_pinned_paths_are_written_absolute_too(tmp_path, monkeypatch):
    """data.path=... and model.config_dir=... given as key=value settings are places like --dataset."""
    fake_diffusers_folder(tmp_path / "model")
    make_images(tmp_path / "photos", 2)
    (tmp_path / "configs").mkdir()
    monkeypatch.chdir(tmp_path)
    result = _recommend("model", "--out", "plan", "data.path=photos", "model.config_dir=configs")
    assert result.exit_code == 0, result.stderr
    written = _written(tmp_path / "plan")
    assert written["data"]["path"] == str(tmp_path / "photos")
    assert written["model"]["config_dir"] == str(tmp_path / "configs")
    assert written["output"]["dir"] == str(tmp_path / "plan")
    assert written["training"]["max_steps"] is not None  # the pinned dataset was counted: its steps stand
    assert "run it with: sdplan train --config plan/sdplan.yaml\n" in result.stderr
