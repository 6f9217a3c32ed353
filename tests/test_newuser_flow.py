"""A new user following the README end to end: `recommend --out DIR` then the command it prints, a model given
by the hub id the planner itself writes, a file that is not a checkpoint at all, what `sdplan profiles` says
about the transformer families."""

from __future__ import annotations

import yaml
from conftest import fake_diffusers_folder, make_images
from typer.testing import CliRunner

from sdplan.cli import app

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def test_the_printed_train_command_trains_into_the_recommend_out_folder(tmp_path, monkeypatch):
    """`recommend --out runs/me` wrote output.dir ./output: the `sdplan train --config runs/me/sdplan.yaml` it
    prints trained into ./output of whatever folder it ran from, and README's `train --resume --out runs/me`
    then found no checkpoint. The dataset was the relative path as typed, so the file broke from another
    folder."""
    model = fake_diffusers_folder(tmp_path / "model")
    make_images(tmp_path / "photos", 2)
    monkeypatch.chdir(tmp_path)
    result = cli(
        "recommend", "--method", "lora", "--model", str(model), "--dataset", "photos",
        "--hardware", "RTX 4090", "--out", "runs/me",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "run it with: sdplan train --config runs/me/sdplan.yaml" in result.stderr
    written = yaml.safe_load((tmp_path / "runs" / "me" / "sdplan.yaml").read_text())
    assert written["output"]["dir"] == str(tmp_path / "runs" / "me")
    assert written["data"]["path"] == str(tmp_path / "photos")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    result = cli(
        "train", "--config", str(tmp_path / "runs" / "me" / "sdplan.yaml"), "--device", "cpu", "--dry-run"
    )
    assert result.exit_code == 0, result.stderr
    assert f"output: {tmp_path / 'runs' / 'me'}" in result.stdout.splitlines()
    assert not (elsewhere / "output").exists()
