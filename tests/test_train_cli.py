"""`sdplan train` at the CLI edge: bad input is one clear line and a non-zero exit, before any model loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import digest, fake_diffusers_folder, make_images, one_line_error
from limits import scaled
from typer.testing import CliRunner

from sdplan import runfolder
from sdplan.cli import app

runner = CliRunner()


def invoke(*args: str, cwd: Path | None = None):
    old = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return runner.invoke(app, ["train", *args])
    finally:
        os.chdir(old)


@pytest.fixture
def fake_model(tmp_path) -> Path:
    """A folder that passes the cheap model check (model_index.json + unet config), with no weights: any
    attempt to load it would fail, so a test passing with it proves nothing was loaded."""
    return fake_diffusers_folder(tmp_path / "model")


def write_config(path: Path, **sections) -> Path:
    data: dict = {"method": "lora"}
    for key, value in sections.items():
        data[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


# -- bad input: one line each --------------------------------------------------------------------------------


def test_config_with_unknown_key_fails_first(tmp_path):
    """The config is checked before the dataset (which is missing too) and before anything else."""
    cfg = write_config(
        tmp_path / "c.yaml", training={"batch_sise": 2}, data={"path": str(tmp_path / "missing")}
    )
    line = one_line_error(
        invoke("--config", str(cfg), "--out", str(tmp_path / "o")), 2, "training.batch_sise"
    )
    assert "unknown key" in line and "did you mean training.batch_size" in line
    assert not (tmp_path / "o").exists()


def test_config_with_wrong_type(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", training={"batch_size": "two"})
    one_line_error(invoke("--config", str(cfg)), 2, "training.batch_size: must be an integer")


def test_missing_config_file(tmp_path):
    one_line_error(invoke("--config", str(tmp_path / "nope.yaml")), 2, "file not found")


def test_bad_override(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds")
    one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(ds), "training.learning_rat=1e-4"),
        2,
        "training.learning_rat: unknown key",
    )


def test_missing_dataset(tmp_path, fake_model):
    one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(tmp_path / "nope"), "--out", str(tmp_path / "o")),
        2,
        "does not exist",
    )


def test_empty_dataset(tmp_path, fake_model):
    (tmp_path / "ds").mkdir()
    one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(tmp_path / "ds")), 2, "no readable images"
    )


def test_only_unreadable_images(tmp_path, fake_model):
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "a.png").write_bytes(b"not a png at all")
    (ds / "b.jpg").write_bytes(b"\xff\xd8\xff garbage")
    line = one_line_error(invoke("--model", str(fake_model), "--dataset", str(ds)), 2, "no readable images")
    assert "2 skipped" in line


def test_missing_model_path(tmp_path):
    ds = make_images(tmp_path / "ds")
    one_line_error(
        invoke("--model", str(tmp_path / "models" / "sd15"), "--dataset", str(ds)),
        2,
        "no such file or folder",
    )


@pytest.mark.parametrize(
    ("typed", "hub"),
    [("sdxl", "stabilityai/stable-diffusion-xl-base-1.0"), ("flux", "black-forest-labs/FLUX.1-dev")],
)
def test_a_family_name_as_the_model_says_its_hub_id(tmp_path, typed, hub):
    """`sdplan recommend --model sdxl` takes a family; `sdplan train --model sdxl` needs weights. It said
    "no such file or folder"; it now names the family's hub id to give instead, and writes nothing."""
    ds = make_images(tmp_path / "ds")
    line = one_line_error(
        invoke("--model", typed, "--dataset", str(ds), "--out", str(tmp_path / "o")), 2, hub
    )
    assert "family, not a model" in line
    assert not (tmp_path / "o").exists()
    (tmp_path / typed).mkdir()  # a local folder of that name is the model: its own check speaks
    line = one_line_error(invoke("--model", typed, "--dataset", str(ds), cwd=tmp_path), 2, typed)
    assert "family, not a model" not in line


def test_a_wrong_dataset_and_a_wrong_model_are_one_line_with_both(tmp_path):
    """Both inputs are checked before either error is shown: a user with an empty folder and a mistyped model
    fixes both in one go instead of meeting the second on the next run."""
    (tmp_path / "ds").mkdir()
    line = one_line_error(
        invoke("--model", str(tmp_path / "models" / "sd15"), "--dataset", str(tmp_path / "ds")),
        2,
        "no readable images",
    )
    assert "no such file or folder" in line and "the dataset and the model" in line
    assert not (tmp_path / "sdplan.yaml").exists()


def test_model_and_dataset_are_required_without_config(tmp_path):
    one_line_error(invoke("--method", "lora"), 2, "--model and --dataset missing")


def test_resume_without_checkpoint(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds")
    run = tmp_path / "run"
    run.mkdir()
    write_config(run / "sdplan.yaml", model={"path": str(fake_model)}, data={"path": str(ds)})
    one_line_error(invoke("--resume", "--out", str(run)), 2, "no checkpoint")


def test_resume_needs_a_run_folder(tmp_path):
    # --out defaults to ./output for a new run, not with --resume: the line says so, and how to name that one
    one_line_error(invoke("--resume"), 2, "--out has no default with --resume", "--out ./output")
    (tmp_path / "r").mkdir()
    one_line_error(invoke("--resume", "--out", str(tmp_path / "r")), 2, "not an sdplan run")


# -- the --out rule ----------------------------------------------------------------------------------------------


def test_out_with_user_files_is_refused(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):
        one_line_error(
            invoke(
                "--model", str(fake_model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", *extra
            ),
            3,
            "not an sdplan run",
        )
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_out_with_a_run_needs_force_or_resume(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds")
    out = tmp_path / "out"
    runfolder.write_files(
        out, {"sdplan.yaml": "method: lora\n", "run_summary.json": "{}"}
    )  # as a run writes them
    one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(ds), "--out", str(out), "--device", "cpu"),
        3,
        "holds an sdplan run that saved no checkpoint",  # so --resume, which would be refused, is not offered
        "--force",
    )


def test_a_users_folder_with_sdplan_yaml_and_checkpoints_is_not_called_a_run(tmp_path, fake_model):
    """--out holding the user's own sdplan.yaml and a checkpoints/ folder (no manifest) was "an sdplan run that
    saved no checkpoint (start it over with --force ...)", and with --force "holds files sdplan did not write":
    the fix the first line gave, the second refused. Both say it is not an sdplan run; nothing is changed."""
    ds = make_images(tmp_path / "ds")
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "x").write_text("mine")
    (out / "sdplan.yaml").write_text("precious\n")
    before = digest(out)
    for extra in ([], ["--force"]):
        one_line_error(
            invoke(
                "--model",
                str(fake_model),
                "--dataset",
                str(ds),
                "--out",
                str(out),
                "--device",
                "cpu",
                "-y",
                *extra,
            ),
            3,
            "already holds files (checkpoints, sdplan.yaml) and is not an sdplan run",
        )
    assert digest(out) == before


def test_config_of_a_run_that_trained_says_how_to_change_its_settings(tmp_path, fake_model, monkeypatch):
    """README: `train --config runs/me/sdplan.yaml key=value` after runs/me trained said only "holds an sdplan
    run"; a setting of a run is changed with --resume (or the run started over with --force)."""
    from sdplan.trainer import checkpoint

    from sdplan import runfolder

    ds = make_images(tmp_path / "ds")
    run = tmp_path / "run"
    config = {"method": "lora", "model": {"path": str(fake_model)}, "data": {"path": str(ds)}}
    config["output"] = {"dir": str(run)}
    runfolder.write_files(run, {"sdplan.yaml": yaml.safe_dump(config), "run_summary.json": "{}"})
    monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda out: run / "checkpoints" / "x")
    one_line_error(
        invoke("--config", str(run / "sdplan.yaml"), "--device", "cpu", "training.learning_rate=5e-5"),
        3,
        "--config trains a plan folder or starts a new run",
        f"sdplan train --resume --out {run} key=value",
        "add --force",
    )


def test_a_setting_a_flag_also_sets_must_agree_with_it_and_output_dir_is_out(tmp_path, fake_model):
    """`--epochs 5 training.epochs=20` trained 20 without a word (recommend refuses the pair); `output.dir=DIR`
    was checked by the --out rule as the config's folder while the run wrote to DIR, a run of someone else's."""
    ds = make_images(tmp_path / "ds")
    base = ("--model", str(fake_model), "--dataset", str(ds), "--device", "cpu", "--dry-run")
    one_line_error(
        invoke(*base, "--out", str(tmp_path / "o"), "--epochs", "5", "training.epochs=20"),
        2,
        "--epochs 5 and training.epochs=20 disagree",
    )
    one_line_error(invoke(*base, "--out", str(tmp_path / "o"), f"output.dir={tmp_path / 'p'}"), 2, "disagree")
    r = invoke(
        *base,
        "--out",
        str(tmp_path / "o"),
        "--epochs",
        "5",
        "training.epochs=5",
        "output.dir=o",
        cwd=tmp_path,
    )
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    run.mkdir()
    runfolder.write_files(run, {"sdplan.yaml": "method: lora\n", "run_summary.json": "{}"})
    one_line_error(invoke(*base, f"output.dir={run}"), 3, f"--out {run} holds an sdplan run")
    r = invoke(*base, f"output.dir={tmp_path / 'new'}")
    assert r.exit_code == 0 and f"output: {tmp_path / 'new'}" in r.output, r.output


def test_out_with_a_plan_says_to_train_the_plan(tmp_path, fake_model):
    """`sdplan recommend --out plan`, then `sdplan train ... --out plan`: it said "holds an sdplan run that saved
    no checkpoint (start it over with --force)", where nothing had trained and --force would replace the plan."""
    ds = make_images(tmp_path / "ds")
    plan = tmp_path / "plan"
    r = runner.invoke(app, ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(plan)])
    assert r.exit_code == 0, r.output
    one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(ds), "--out", str(plan), "--device", "cpu"),
        3,
        f"--out {plan} holds a plan (sdplan recommend --out), not a run",
        f"sdplan train --config {plan / 'sdplan.yaml'}",
    )
    # with a config of another place, and --resume: neither says --force, which replaced the plan
    mine = write_config(tmp_path / "mine.yaml", model={"path": str(fake_model)}, data={"path": str(ds)})
    one_line_error(
        invoke("--config", str(mine), "--out", str(plan), "--device", "cpu"), 3, "holds a plan", "--config"
    )
    one_line_error(
        invoke("--resume", "--out", str(plan), "--device", "cpu"), 2, "holds a plan", "nothing to resume"
    )


def test_a_copied_run_folders_config_does_not_train_into_the_original(tmp_path, fake_model):
    """`cp -r run copy; sdplan train --config copy/sdplan.yaml`: its output.dir still names `run`, so the run
    went there (and --force cleared the original, --resume continued it). Refused, with the --out to give."""
    import shutil

    from sdplan import runfolder

    ds = make_images(tmp_path / "ds")
    run = tmp_path / "run"
    config = {"method": "lora", "model": {"path": str(fake_model)}, "data": {"path": str(ds)}}
    config["output"] = {"dir": str(run)}
    runfolder.write_files(run, {"sdplan.yaml": yaml.safe_dump(config), "run_summary.json": "{}"})
    shutil.copytree(run, tmp_path / "copy")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    copied = str(tmp_path / "copy" / "sdplan.yaml")
    for extra in (["--force", "--dry-run"], ["--resume"], ["--dry-run"]):
        one_line_error(
            invoke("--config", copied, "--device", "cpu", *extra),
            2,
            f"is the sdplan.yaml of the run folder {tmp_path / 'copy'}, but its output.dir is {run}, where the "
            "folder was",
            f"add --out {tmp_path / 'copy'}",
        )
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    # a config of the user's own, kept elsewhere, still trains wherever its output.dir says
    mine = tmp_path / "configs" / "sdplan.yaml"
    mine.parent.mkdir()
    mine.write_text(yaml.safe_dump({**config, "output": {"dir": str(tmp_path / "new")}}))
    r = invoke("--config", str(mine), "--device", "cpu", "--dry-run")
    assert r.exit_code == 0, r.output
    # and so does a plan folder's config whose output.dir names a new folder (`recommend --out plan
    # output.dir=RUN` prints `sdplan train --config plan/sdplan.yaml`, which refused it)
    plan = tmp_path / "plan"
    runfolder.write_files(
        plan, {"sdplan.yaml": yaml.safe_dump({**config, "output": {"dir": str(tmp_path / "r")}})}
    )
    r = invoke("--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run")
    assert r.exit_code == 0 and f"output: {tmp_path / 'r'}" in r.output, r.output
    # once its run has started there, the plan's command (with --resume or --force) still names that run
    runfolder.write_files(tmp_path / "r", {"sdplan.yaml": "method: lora\n", "run_summary.json": "{}"})
    r = invoke("--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run")
    assert r.exit_code == 3 and f"--out {tmp_path / 'r'} holds an sdplan run" in r.output, r.output
    # a run folder moved away: its config names where it was, which no longer exists (a new run started there)
    shutil.move(run, tmp_path / "run2")
    one_line_error(
        invoke("--config", str(tmp_path / "run2" / "sdplan.yaml"), "--device", "cpu", "--dry-run"),
        2,
        f"but its output.dir is {run}, where the folder was",
    )


# -- no GPU ------------------------------------------------------------------------------------------------------


def _has_gpu() -> bool:
    from sdplan.probe.snapshot import probe

    return bool(probe(".").usable_gpus)


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_no_gpu_refusal_before_loading_anything(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds")
    line = one_line_error(
        invoke("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o")),
        4,
        "no usable GPU",
    )
    assert "--device cpu" in line
    assert not (tmp_path / "o").exists()


def test_dry_run_on_cpu_writes_nothing(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds", n=6)
    out = tmp_path / "o"
    r = invoke(
        "--model", str(fake_model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--dry-run",
        "--epochs", "2", "training.batch_size=2", "--num-processes", "2",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert "torch.distributed.run --standalone --nproc_per_node 2 -m sdplan.trainer" in r.stdout
    # 6 images / (2 per process x 2 processes) = 2 steps per epoch (rounded up), 2 epochs.
    assert "2 steps per epoch x 2 epochs = 4 optimizer steps; images seen 12" in r.stdout
    assert not out.exists()


def test_a_dry_run_says_which_batches_the_processes_repeat(tmp_path, fake_model):
    """8 images at batch 2 on 5 processes: 'images seen 8', and the run trained 10 (accelerate deals the epoch's
    first batch again so every process has one); the plan now says so."""
    ds = make_images(tmp_path / "ds", n=8)
    args = ("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu")
    r = invoke(*args, "--dry-run", "--num-processes", "5", "--epochs", "1", "training.batch_size=2")
    assert r.exit_code == 0, r.stderr
    assert (
        "by training its first batch again (up to 2 images twice an epoch, about 2 images more in all)"
        in (r.stdout)
    )
    r = invoke(*args, "--dry-run", "--num-processes", "2", "training.batch_size=2")  # 4 batches, 2 each
    assert r.exit_code == 0 and "first batch" not in r.stdout
    # a max_steps run that stops before the epoch's last round repeats nothing
    r = invoke(*args, "--dry-run", "--num-processes", "3", "--max-steps", "1", "training.batch_size=1")
    assert r.exit_code == 0 and "first batch" not in r.stdout


def test_two_machines_print_each_node_command(tmp_path, fake_model):
    """A config for one machine with 2 GPUs, run on 2 machines: 4 processes, and the exact command for each
    node. Planned against a saved snapshot of a 2x RTX 4090 machine (this one has no GPU)."""
    from sdplan.launcher import UI, TrainRequest, run
    from sdplan.machine import Snapshot

    ds = make_images(tmp_path / "ds")
    cfg = write_config(
        tmp_path / "c.yaml",
        model={"path": str(fake_model)},
        data={"path": str(ds)},
        distributed={"num_processes": 2},
        training={"batch_size": 2, "precision": "bf16"},
    )
    lines: list[str] = []
    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "2x_rtx4090_pcie.json")
    req = TrainRequest(
        config=str(cfg),
        out=str(tmp_path / "o"),
        num_machines=2,
        machine_rank=0,
        main_process_ip="10.0.0.1",
        dry_run=True,
        snapshot=snap,
    )
    run(req, UI(echo=lines.append))
    text = "\n".join(lines)
    acc_file = tmp_path / "o" / "accelerate.yaml"
    for rank in (0, 1):
        assert (
            f"node {rank}: accelerate launch --config_file {acc_file} --machine_rank {rank} "
            f"-m sdplan.trainer --config {tmp_path / 'o' / 'sdplan.yaml'}"
        ) in text
    # 2 GPUs on each of 2 machines: 4 processes split every epoch.
    assert "x 4 processes = 8 images per optimizer step" in text


# -- nothing heavy is imported on the way to an input error ---------------------------------------------------


@pytest.mark.parametrize("case", ["bad_key", "missing_dataset", "unreadable", "missing_model", "no_gpu"])
def test_input_errors_load_no_model_code(tmp_path, case):
    """In a fresh interpreter: the error comes with torch, diffusers and transformers never imported."""
    ds = make_images(tmp_path / "ds", n=2)
    model = fake_diffusers_folder(tmp_path / "model")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.png").write_bytes(b"junk")
    args = {
        "bad_key": ["--model", str(model), "--dataset", str(ds), "memory.gradient_checkpoint=true"],
        "missing_dataset": ["--model", str(model), "--dataset", str(tmp_path / "none")],
        "unreadable": ["--model", str(model), "--dataset", str(bad)],
        "missing_model": ["--model", str(tmp_path / "none"), "--dataset", str(ds)],
        "no_gpu": ["--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / "o")],
    }[case]
    if case == "no_gpu" and _has_gpu():
        pytest.skip("this machine has a GPU")
    code = textwrap.dedent(
        """
        import sys
        from sdplan.cli import app
        try:
            app(sys.argv[1:], prog_name="sdplan")
        except SystemExit as e:
            code = e.code
        heavy = [m for m in ("torch", "diffusers", "transformers", "accelerate") if m in sys.modules]
        print("HEAVY=" + ",".join(heavy))
        sys.exit(code)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", *args],
        capture_output=True,
        text=True,
        timeout=scaled(60),
        cwd=tmp_path,
    )
    assert proc.returncode in (2, 4), proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "HEAVY=\n" in proc.stdout or proc.stdout.strip().endswith("HEAVY="), proc.stdout


def test_a_mistyped_method_is_answered_as_recommend_answers_it(tmp_path):
    """`train --method lroa` said "Invalid value for '--method': Value error, 'lroa' is not one of ..." where
    `recommend` says "did you mean lora?"; and train took none of the methods' aliases (ti, fine-tune)."""
    one_line_error(
        invoke("--method", "lroa", "--out", str(tmp_path / "o")),
        2,
        "unknown method 'lroa'",
        "did you mean lora?",
    )
    r = invoke(
        "--method",
        "ti",
        "--model",
        "nowhere/x",
        "--dataset",
        str(tmp_path / "none"),
        "--out",
        str(tmp_path / "o"),
    )
    assert r.exit_code == 2 and "unknown method" not in r.stderr and "dataset folder" in r.stderr, r.stderr


def test_sd14_is_the_sd15_family():
    """SD 1.4 is in the SD 1.x family (its profile says so): `--model sd14` was answered "did you mean sd21"."""
    from sdplan import registry

    assert registry.family("sd14").name == "sd15" and registry.family("sd1.4").name == "sd15"


def test_a_method_the_family_has_not_is_refused_before_anything_is_written(tmp_path):
    """Textual inversion on FLUX.1: `recommend` refused it at once; `train --device cpu` wrote the run folder,
    launched and loaded the model before the trainer said so (a new user's report)."""
    import hub_cache

    model = fake_diffusers_folder(
        tmp_path / "flux", "flux-dev", denoiser=hub_cache.configs("flux-dev")["transformer/config.json"]
    )
    ds = make_images(tmp_path / "ds")
    out = tmp_path / "o"
    r = invoke(
        *f"--method textual-inversion --model {model} --dataset {ds} --out {out} --device cpu --yes".split()
    )
    one_line_error(r, 2, "textual-inversion on flux-dev", "not supported for this family")
    assert not out.exists()


def test_deepspeed_in_several_cpu_processes_launches_one_world(tmp_path, fake_model):
    """DeepSpeed in 2 CPU processes: accelerate's DeepSpeed launch of 2 processes on DeepSpeed's CPU accelerator,
    one thread each, the run's steps split over both (it was refused: each process trained the whole run alone,
    then they hung at the first checkpoint; the trainer now names accelerate the gloo backend)."""
    ds = make_images(tmp_path / "ds", n=6)
    out = tmp_path / "o"
    args = f"--model {fake_model} --dataset {ds} --out {out} --device cpu --num-processes 2 --dry-run".split()
    r = invoke(*args, "--epochs", "2", "training.batch_size=2", "distributed.deepspeed.zero_stage=2")
    assert r.exit_code == 0, r.stderr
    assert "DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 " in r.stdout
    assert "accelerate.commands.launch --config_file" in r.stdout
    assert "2 steps per epoch x 2 epochs = 4 optimizer steps; images seen 12" in r.stdout
    assert not out.exists()


def test_demo_refuses_a_bad_setting_before_building_anything(tmp_path):
    """`sdplan train --demo --out X distributed.deepspeed.zero_stage=3` built the tiny model and dataset in X,
    then refused the setting; the corrected command was then refused too: "X already holds files (base_model,
    dataset) and is not an sdplan run". The settings are checked first, and X stays untouched."""
    out = tmp_path / "demo"
    one_line_error(
        invoke("--demo", "--out", str(out), "-y", "distributed.deepspeed.zero_stage=3"),
        2,
        "distributed.deepspeed.zero_stage: must be 1 or 2",
    )
    assert not out.exists()
    # the demo's own --device cpu was said to disagree with the user's setting, as if they had given it
    one_line_error(invoke("--demo", "--out", str(out), "training.device=cuda"), 2, "--demo trains on the CPU")
    assert not out.exists()


@pytest.mark.parametrize("listed", ["[]", "[1, 2]", '{"dataset": [["x"]], "base_model": []}', "{"])
def test_a_demo_file_list_that_cannot_be_read_refuses_force(tmp_path, listed):
    """A .sdplan-demo-files.json holding `[]` was an AttributeError traceback on --force, and passed over, the
    user's files in the demo's dataset/ were deleted: it tells nothing, so --force is refused."""
    from sdplan.demo import DEMO_FILES, _check_inputs_are_the_demos
    from sdplan.errors import OutputExistsError

    (tmp_path / DEMO_FILES).write_text(listed)
    with pytest.raises(OutputExistsError, match="the list of the files the demo made there, cannot be read"):
        _check_inputs_are_the_demos(tmp_path)


@pytest.mark.parametrize(
    ("stage", "offload", "shown"),
    [
        (2, "false", "memory savers: DeepSpeed ZeRO-2 (optimizer state split over 2 processes)"),
        (1, "true", "memory savers: DeepSpeed ZeRO-1 optimizer offload"),
    ],
)
def test_train_says_which_deepspeed_it_runs(tmp_path, stage, offload, shown):
    """The run's summary named DeepSpeed only with offload, and as ZeRO-2 whatever the stage: ZeRO-2 splitting
    the optimizer state over the processes said "memory savers: none needed"."""
    result = invoke(
        "--demo",
        "--out",
        str(tmp_path / "demo"),
        "--dry-run",
        "--num-processes",
        "2",
        f"distributed.deepspeed.zero_stage={stage}",
        f"distributed.deepspeed.offload_optimizer={offload}",
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    assert shown in result.stdout, result.stdout


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("code", [130, -2])
def test_an_interrupted_run_says_whether_there_is_a_checkpoint_to_resume_from(
    tmp_path, fake_model, monkeypatch, code, checkpoint
):
    """Ctrl-C while the trainer was still starting said "the trainer saved a checkpoint (continue with
    --resume)", and --resume then found none. A trainer killed by the signal before Python handled it (exit -2)
    is interrupted too, not "failed (exit code -2)"."""
    import sdplan.launcher as L

    out = tmp_path / "o"

    def launched(*args, **kwargs):
        if checkpoint:
            saved = out / "checkpoints" / "interrupt-step-3"
            saved.mkdir(parents=True)
            (saved / "train_state.json").write_text('{"step": 3}')
        return code

    monkeypatch.setattr(L, "run_launch", launched)
    ds = make_images(tmp_path / "ds", n=4)
    r = invoke(
        "--model", str(fake_model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes"
    )
    line = one_line_error(r, 130)
    if checkpoint:
        assert "its last checkpoint is interrupt-step-3" in line and "sdplan train --resume --out" in line
    else:
        assert "before its first checkpoint: there is nothing to resume from" in line
        assert "the same command with --force" in line and "--resume" not in line


def test_relative_paths_of_a_config_file_and_of_key_value_settings_are_written_absolute(
    tmp_path, monkeypatch
):
    """A run's sdplan.yaml named `ds` and `model` as the config file gave them, so `--resume` from another folder
    looked for another dataset and took the model for a hub id."""
    import sdplan.launcher as L

    monkeypatch.setattr(L, "run_launch", lambda *a, **k: 130)  # written, then stopped before a checkpoint
    fake_diffusers_folder(tmp_path / "model")
    make_images(tmp_path / "ds", n=4)
    write_config(
        tmp_path / "mine.yaml",
        method="dreambooth",
        model={"path": "model"},
        data={"path": "ds"},
        training={"device": "cpu"},
        dreambooth={"with_prior_preservation": True, "class_prompt": "a photo of a person"},
    )
    r = invoke("--config", "mine.yaml", "--out", "o", "--yes", "dreambooth.class_data=class", cwd=tmp_path)
    assert r.exit_code == 130, r.output
    cfg = yaml.safe_load((tmp_path / "o" / "sdplan.yaml").read_text())
    assert cfg["model"]["path"] == str((tmp_path / "model").resolve())
    assert cfg["data"]["path"] == str((tmp_path / "ds").resolve())
    assert cfg["dreambooth"]["class_data"] == str((tmp_path / "class").resolve())
    assert cfg["output"]["dir"] == str((tmp_path / "o").resolve())


def test_with_aspect_buckets_the_printed_steps_are_the_trainers(tmp_path, fake_model):
    """`sdplan train data.buckets=true`: 8 images of 3 aspect buckets at batch 4 printed '2 steps per epoch';
    the trainer, a batch from one bucket at a time, took 3."""
    from PIL import Image

    ds = tmp_path / "ds"
    ds.mkdir()
    sizes = [(512, 512), (512, 768), (768, 512), (512, 1024), (1024, 512), (600, 400), (400, 600), (512, 512)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 20, 60, 90)).save(ds / f"{i}.png")
    args = ("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu")
    r = invoke(*args, "--resolution", "256", "--dry-run", "training.batch_size=4", "data.buckets=true")
    assert r.exit_code == 0, r.stderr
    assert "in 3 aspect buckets (each ends in a short batch) / 4 per step = 3 steps per epoch" in r.stdout
    # by max_steps: full batches are the most its steps see ("= 8 images" for 2 steps that see fewer)
    r = invoke(
        *args,
        "--resolution",
        "256",
        "--dry-run",
        "--max-steps",
        "2",
        "training.batch_size=4",
        "data.buckets=true",
    )
    assert r.exit_code == 0 and "= 2 optimizer steps = up to 8 images" in r.stdout, r.stdout
    r = invoke(
        *args,
        "--resolution",
        "256",
        "--dry-run",
        "--max-steps",
        "3",
        "training.batch_size=4",
        "data.buckets=true",
    )
    assert r.exit_code == 0 and "= 3 optimizer steps = 8 images" in r.stdout, r.stdout  # one whole epoch


def test_a_run_written_with_a_relative_model_path_resumes_from_its_folder(tmp_path, monkeypatch):
    """A run written before paths were made absolute names its model `demo/base_model`; --resume from the same
    folder compared that with the absolute path it now reads and refused: 'model.path is ... here; its
    checkpoints were trained with the first'. A model changed for real is still refused."""
    from sdplan import config as C
    from sdplan.errors import UsageError
    from sdplan.launcher import check_resume_settings

    monkeypatch.chdir(tmp_path)
    fake_diffusers_folder(tmp_path / "demo" / "base_model")
    fake_diffusers_folder(tmp_path / "other")
    saved = C.validate({"method": "lora", "model": {"path": "demo/base_model"}})
    now = C.validate(C.absolute_paths(saved.to_dict()))
    check_resume_settings(saved, now)
    with pytest.raises(UsageError, match="--resume: model.path is"):
        check_resume_settings(
            saved, C.validate({"method": "lora", "model": {"path": str(tmp_path / "other")}})
        )


def test_a_cpu_run_of_an_fp16_config_says_fp32_in_its_sdplan_yaml(tmp_path, monkeypatch, fake_model):
    """`--device cpu` with the default fp16: the trainer trains in fp32 (fp16 autocast is a GPU feature), but the
    run's sdplan.yaml said `precision: fp16`. It says fp32, and the output says why."""
    import sdplan.launcher as L

    monkeypatch.setattr(L, "run_launch", lambda *a, **k: 130)  # written, then stopped before a checkpoint
    ds = make_images(tmp_path / "ds", n=4)
    out = tmp_path / "o"
    r = invoke(
        "--model", str(fake_model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes",
        "training.precision=fp16",
    )  # fmt: skip
    assert r.exit_code == 130, r.output
    assert yaml.safe_load((out / "sdplan.yaml").read_text())["training"]["precision"] == "fp32"
    assert "fp16 needs a GPU; this CPU run trains (and its sdplan.yaml says) fp32" in r.stdout
    assert "precision fp32; resolution" in r.stdout
    # fp16 by default (not asked for): the plan line's fp32 says it, with no note about a setting never given
    r = invoke(
        "--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o2"), "--device", "cpu", "--yes"
    )  # fmt: skip
    assert r.exit_code == 130 and "precision fp32; resolution" in r.stdout and "needs a GPU" not in r.stdout


def test_a_ddpm_setting_on_a_flux_folder_is_refused_before_the_launch(tmp_path):
    """training.min_snr_gamma (or a resolution off the 16 px grid) on a FLUX.1 diffusers folder given as a path:
    the config has no model.family, so only the trainer refused it, after loading the model (minutes on a real
    one). The family the model's files say is checked before anything is written."""
    model = fake_diffusers_folder(tmp_path / "flux", "flux-dev")
    ds = make_images(tmp_path / "ds", n=2)
    out = tmp_path / "o"
    args = ("--model", str(model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes")
    line = one_line_error(invoke(*args, "--resolution", "64", "training.min_snr_gamma=5"), 2)
    assert "training.min_snr_gamma" in line and "rectified flow weighs its own" in line
    line = one_line_error(invoke(*args, "--resolution", "72"), 2)
    assert "a side must be a multiple of 16 pixels" in line
    assert not out.exists()


def test_the_printed_plan_names_every_memory_saver_the_config_sets(tmp_path, fake_model):
    """A FLUX.1 plan's cached text-encoder outputs and fp8 base, an SDXL plan's full bf16 weights: in
    sdplan.yaml, but the printed 'memory savers' left them out."""
    ds = make_images(tmp_path / "ds", n=2)
    args = ("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu")
    r = invoke(
        *args, "--dry-run", "memory.cache_text_encoder_outputs=true", "training.precision=bf16",
        "training.full_half_weights=true", "method=finetune",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("memory savers:")]
    assert "cached text-encoder outputs" in line and "full bf16 weights (no fp32 copy)" in line, line


def test_train_plans_an_sd2_epsilon_base_at_512(tmp_path):
    """sdplan train planned an SD 2.x epsilon model (2-1-base) at the family's 768, as recommend did."""
    import dataclasses
    import json

    from sdplan.launcher import UI, TrainRequest, run
    from sdplan.machine import Snapshot

    model = fake_diffusers_folder(tmp_path / "sd2base", "sd21")
    sched = model / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({"_class_name": "DDPMScheduler", "prediction_type": "epsilon"}))
    ds = make_images(tmp_path / "ds")
    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "2x_rtx4090_pcie.json")
    lines: list[str] = []
    req = TrainRequest(
        model=str(model), dataset=str(ds), out=str(tmp_path / "o"), dry_run=True, snapshot=snap
    )
    run(req, UI(echo=lines.append))
    assert "resolution 512" in "\n".join(lines)
    sched.write_text(json.dumps({"_class_name": "DDPMScheduler", "prediction_type": "v_prediction"}))
    lines.clear()
    run(dataclasses.replace(req, out=str(tmp_path / "o2")), UI(echo=lines.append))
    assert "resolution 768" in "\n".join(lines)


def test_small_images_are_measured_against_the_resolution_the_plan_trains_at(tmp_path):
    """An SDXL plan trains at 1024 px; its small-images note said "scaled up ... to the 512 px training
    resolution" (the config's default, before the plan chose)."""
    from conftest import MACHINES

    from sdplan.launcher import UI, TrainRequest, prepare
    from sdplan.probe.snapshot import Snapshot

    ds = make_images(tmp_path / "ds", n=2)
    sdxl = fake_diffusers_folder(tmp_path / "sdxl", "sdxl")
    snap = Snapshot.load(MACHINES / "h100_80gb_hbm3.json")  # a CUDA build of torch: the plan is made
    for resolution, said in ((None, 1024), (512, 512)):
        req = TrainRequest(
            model=str(sdxl),
            dataset=str(ds),
            out=str(tmp_path / "o"),
            dry_run=True,
            snapshot=snap,
            resolution=resolution,
        )
        p = prepare(req, UI(echo=lambda s: None))
        assert p.cfg.data.resolution == said
        assert f"to the {said} px training resolution" in p.inputs.scan_summary, p.inputs.scan_summary
    # on the CPU (no plan) the config's resolution trains, and is the one said
    r = invoke(
        "--model",
        str(sdxl),
        "--dataset",
        str(ds),
        "--out",
        str(tmp_path / "o"),
        "--device",
        "cpu",
        "--dry-run",
    )
    assert (
        r.exit_code == 0 and "to the 512 px training resolution" in r.output and "resolution 512" in r.output
    )


def test_bucketed_steps_are_counted_at_the_resolution_the_plan_trains_at(tmp_path):
    """data.buckets=true on an SDXL plan (1024 px): the step count came from buckets at the config's default
    512 px, which group these 17 images otherwise: 6 steps per epoch said, 5 trained. The count said is the
    trainer's own: its dataset's buckets through its batch sampler."""
    from conftest import MACHINES
    from PIL import Image
    from sdplan.trainer.buckets import BucketBatchSampler
    from sdplan.trainer.data import build_dataset

    from sdplan.launcher import UI, TrainRequest, describe, prepare
    from sdplan.probe.snapshot import Snapshot

    ds = tmp_path / "ds"
    ds.mkdir()
    shapes = (
        [(1200, 800)] * 5 + [(800, 1200)] * 3 + [(1600, 900)] * 4 + [(1000, 1000)] * 2 + [(1400, 1000)] * 3
    )
    for i, (w, h) in enumerate(shapes):  # the audit's aspect ratios, a tenth the size
        Image.new("RGB", (w // 10, h // 10), (10 * i, 90, 40)).save(ds / f"img{i:02d}.png")
    sdxl = fake_diffusers_folder(tmp_path / "sdxl", "sdxl")
    snap = Snapshot.load(MACHINES / "h100_80gb_hbm3.json")
    req = TrainRequest(
        model=str(sdxl),
        dataset=str(ds),
        out=str(tmp_path / "o"),
        dry_run=True,
        snapshot=snap,
        overrides=["data.buckets=true", "training.batch_size=4", "training.grad_accum=1"],
    )
    p = prepare(req, UI(echo=lambda s: None))
    assert (p.cfg.data.resolution, p.cfg.training.batch_size, p.world) == (1024, 4, 1)
    dataset, _ = build_dataset(p.cfg, verify=False)
    trained = len(BucketBatchSampler.for_dataset(dataset, p.cfg.training.batch_size))
    assert trained == 5 and p.steps["steps_per_epoch"] == trained
    (line,) = [s for s in describe(p.cfg, p.steps, p.world, p.inputs) if s.startswith("steps: ")]
    assert f"/ 4 per step = {trained} steps per epoch" in line, line


@pytest.mark.parametrize("odd", ["🙂", os.fsdecode(b"caf\xe9"), "\x7f"], ids=["emoji", "latin-1", "del"])
def test_paths_with_odd_characters_are_written_as_they_are(tmp_path, monkeypatch, odd):
    """An emoji in --model, --dataset or --out: the generated overrides quoted the paths with json.dumps, which
    writes 🙂 as a surrogate pair that YAML reads as two lone surrogates: a UnicodeEncodeError traceback, or
    "model.path /…/model\\ud83d\\ude42: no such file or folder" for a folder that exists. Without JSON's
    escapes a Latin-1 file name (a lone surrogate as Python reads it) or a DEL was refused by YAML and the path
    kept its quotes: "dataset folder /…/"/…/ds_caf\\udce9" does not exist"."""
    import sdplan.launcher as L

    monkeypatch.setattr(L, "run_launch", lambda *a, **k: 130)  # written, then stopped before a checkpoint
    model = fake_diffusers_folder(tmp_path / f"model{odd}")
    data = make_images(tmp_path / f"ds {odd}", n=2)
    out = tmp_path / f"out{odd}"
    r = invoke("--model", str(model), "--dataset", str(data), "--out", str(out), "--device", "cpu", "-y")
    assert r.exit_code == 130, r.output
    cfg = yaml.safe_load((out / "sdplan.yaml").read_text(encoding="utf-8"))
    assert (cfg["model"]["path"], cfg["data"]["path"], cfg["output"]["dir"]) == (
        str(model.resolve()),
        str(data.resolve()),
        str(out.resolve()),
    )
