"""What `sdplan recommend --out DIR` writes is a run that `sdplan train --config DIR/sdplan.yaml` trains as
planned, from any folder: every path in it is absolute (as `sdplan train` writes its own), and a plan that
never saw the dataset trains its epochs over the dataset the run is given, not a step count for an assumed
image count; the command it prints says when a dataset is still needed."""

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


def test_every_path_setting_is_written_as_request_settings_shows_it(tmp_path, monkeypatch):
    """checkpoints.resume=./... and a model.config_dir that does not exist yet stayed relative in the written
    sdplan.yaml and in --json's config while request.settings showed them absolute: trained from another folder,
    the config named another checkpoint (or none)."""
    import json

    fake_diffusers_folder(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    given = ("checkpoints.resume=./old/checkpoints/step-000004", "model.config_dir=./nocfg")
    assert _recommend("model", "--out", "plan", *given).exit_code == 0
    written = _written(tmp_path / "plan")
    want = {
        "checkpoints.resume": str(tmp_path / "old" / "checkpoints" / "step-000004"),
        "model.config_dir": str(tmp_path / "nocfg"),
    }
    assert (written["checkpoints"]["resume"], written["model"]["config_dir"]) == tuple(want.values())
    result = _recommend("model", "--json", *given)
    assert result.exit_code == 0, result.stderr
    d = json.loads(result.stdout)
    assert {k: d["request"]["settings"][k] for k in want} == want
    assert (d["config"]["checkpoints"]["resume"], d["config"]["model"]["config_dir"]) == tuple(want.values())


def test_a_plan_without_the_dataset_trains_its_epochs_over_the_dataset_given(tmp_path):
    """Planned without --dataset (for 20 assumed images: max_steps 50), then trained on 40 images: the run
    trained 50 steps, 5 of its 10 epochs."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 40)
    plan = tmp_path / "plan"
    result = _recommend(model, "--out", str(plan), "training.batch_size=4")
    assert result.exit_code == 0, result.stderr
    training = _written(plan)["training"]
    assert (training["epochs"], training["max_steps"]) == (10, None)
    train = ["train", "--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run"]
    for given in (["--dataset", str(photos)], [f"data.path={photos}"]):
        steps = _steps_line(cli(*train, *given))
        assert "= 10 steps per epoch x 10 epochs = 100 optimizer steps; images seen 400" in steps, steps


def test_images_without_the_dataset_write_epochs_and_a_pinned_max_steps_stays(tmp_path):
    model = fake_diffusers_folder(tmp_path / "model")
    for extra, want in (
        (["--images", "8", "--epochs", "3"], (3, None)),
        (["training.max_steps=7"], (None, 7)),  # the epochs its 7 steps reach, as the plan counts them
        (["--images", "8", "training.max_steps=7"], (None, 7)),
    ):
        plan = tmp_path / "-".join(extra)
        result = _recommend(model, "--out", str(plan), *extra)
        assert result.exit_code == 0, result.stderr
        written = _written(plan)
        training = written["training"]
        epochs = want[0] or written["plan"]["steps"]["epochs"]
        assert (training["epochs"], training["max_steps"]) == (epochs, want[1]), extra
        assert written["plan"]["steps"]["total_steps"] == want[1] or want[1] is None


def test_the_printed_command_asks_for_the_dataset_when_none_was_given(tmp_path, monkeypatch):
    """`recommend --out plan` without --dataset printed `run it with: sdplan train --config plan/sdplan.yaml`,
    which failed with 'dataset folder dataset does not exist'."""
    fake_diffusers_folder(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    result = _recommend("model", "--out", "plan")
    assert result.exit_code == 0, result.stderr
    (line,) = [s for s in result.stderr.splitlines() if s.startswith("run it with: ")]
    assert line.startswith("run it with: sdplan train --config plan/sdplan.yaml --dataset DIR "), line
    assert "data.path=DIR" in line and "needed" in line, line
    header = (tmp_path / "plan" / "sdplan.yaml").read_text().splitlines()[1]
    assert header.startswith(
        f"# run it with: sdplan train --config {tmp_path / 'plan' / 'sdplan.yaml'} --dataset DIR"
    )
    # the command without a dataset still says what is missing, in one line
    result = cli("train", "--config", "plan/sdplan.yaml", "--device", "cpu", "--dry-run")
    assert result.exit_code != 0 and "--dataset" in result.stderr and "Traceback" not in result.stderr


def test_a_planned_step_count_is_one_process_count_on_several_gpus(tmp_path):
    """`recommend --hardware "2x RTX 4090" --dataset --out` wrote each process's 50 steps as training.max_steps,
    a one-process count that `sdplan train` divides by the 2 processes: 25 steps, 5 of the 10 epochs. It
    writes the count that divides back to the plan's 50 (9 images: 5 batches of 1 per process and epoch)."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 9)
    plan = tmp_path / "plan"
    result = cli(
        "recommend", "--method", "lora", "--model", str(model), "--dataset", str(photos),
        "--hardware", "2x RTX 4090", "--out", str(plan), "--json",
        "training.batch_size=1", "distributed.num_processes=2",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    planned = yaml.safe_load(result.stdout)["steps"]
    assert (planned["steps_per_epoch"], planned["total_steps"]) == (5, 50)
    train = ["train", "--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run"]
    steps = _steps_line(cli(*train))
    assert "/ 2 processes = 50 optimizer steps" in steps and "would be" not in steps, steps


def test_a_written_plan_trains_at_its_methods_learning_rate(tmp_path):
    """A DreamBooth plan was written with a LoRA's 1e-4, which `sdplan train` then used on every UNet weight."""
    for method, rate in (("dreambooth", 5e-6), ("finetune", 1e-5), ("lora", 1e-4)):
        out = tmp_path / method
        r = cli(
            "recommend", "--method", method, "--model", "sd15", "--hardware", "H100 SXM", "--out", str(out)
        )
        assert r.exit_code == 0, r.stderr
        assert _written(out)["training"]["learning_rate"] == rate


def test_force_does_not_leave_an_earlier_plans_deepspeed_json(tmp_path):
    """A T4 SDXL fine-tune plan (DeepSpeed offload) replaced by a LoRA plan with --force left deepspeed.json in
    the folder, listed as the run's. One the user edited stays."""
    out = tmp_path / "plan"
    first = ("--method", "finetune", "--model", "sdxl", "--hardware", "T4", "--out", str(out))
    second = ("--method", "lora", "--model", "sd15", "--hardware", "RTX 4090", "--out", str(out), "--force")
    assert cli("recommend", *first).exit_code == 0 and (out / "deepspeed.json").is_file()
    assert cli("recommend", *second).exit_code == 0
    assert not (out / "deepspeed.json").exists()
    assert cli("recommend", *first, "--force").exit_code == 0
    (out / "deepspeed.json").write_text((out / "deepspeed.json").read_text() + " ")  # the user's edit
    assert cli("recommend", *second).exit_code == 0
    assert (out / "deepspeed.json").is_file()
