"""`sdplan train --resume` / `--force` on a run folder with checkpoints: settings the checkpoint cannot take are
one line before anything is written or deleted. The trainer is never launched here (run_launch is faked: it
writes the checkpoint a real run would have left)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import fake_diffusers_folder, make_images, one_line_error
from typer.testing import CliRunner

from sdplan.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, ["train", *args])


def fake_checkpoint(out: Path, name: str, *, step: int, images: int, batch: int = 1, world: int = 1) -> Path:
    """A checkpoint folder as the trainer names and states it (no weights: nothing loads it here)."""
    path = out / "checkpoints" / name
    path.mkdir(parents=True)
    state = {
        "global_step": step,
        "epoch": 0,
        "batches_in_epoch": step,
        "samples_in_epoch": step * batch,
        "images_seen": images,
        "batch_size": batch,
        "grad_accum": 1,
        "num_processes": world,
        "method": "lora",
    }
    (path / "train_state.json").write_text(json.dumps(state))
    return path


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A run stopped at step 3 of 8 (8 images, batch 1, 1 epoch) with a kept step-000002 and an interrupt
    checkpoint; ``launches`` records every launch after it."""
    import sdplan.launcher as L

    model = fake_diffusers_folder(tmp_path / "model")
    ds = make_images(tmp_path / "ds", n=8)
    out = tmp_path / "run"

    def first(launch, **kw):
        fake_checkpoint(out, "step-000002", step=2, images=2)
        fake_checkpoint(out, "interrupt-step-000003", step=3, images=3)
        return 130

    monkeypatch.setattr(L, "run_launch", first)
    r = invoke("--model", str(model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes")
    assert r.exit_code == 130, r.output
    launches: list = []

    def later(launch, **kw):
        launches.append(launch)
        return 130

    monkeypatch.setattr(L, "run_launch", later)
    return out, launches


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_resume_with_checkpoints_resume_is_refused_not_ignored(run_folder):
    """`--resume checkpoints.resume=.../step-000002` resumed the newest checkpoint instead, without a word, and
    wrote the key into sdplan.yaml (where a later --force met it)."""
    out, launches = run_folder
    before = (out / "sdplan.yaml").read_text()
    line = one_line_error(
        invoke("--resume", "--out", str(out), f"checkpoints.resume={out}/checkpoints/step-000002"),
        2,
        "--resume continues the run from its newest checkpoint (interrupt-step-000003)",
        "checkpoints.resume=",
    )
    assert "move the newer ones out of" in line
    assert (out / "sdplan.yaml").read_text() == before and not launches


def test_force_with_checkpoints_resume_inside_the_run_deletes_nothing(run_folder):
    """`--force` with a config whose checkpoints.resume named one of the run's checkpoints deleted every
    checkpoint, then failed: `--resume ...: not a checkpoint folder`, a --resume the user never typed."""
    out, launches = run_folder
    config = yaml.safe_load((out / "sdplan.yaml").read_text())
    config["checkpoints"]["resume"] = str(out / "checkpoints" / "step-000002")
    (out / "sdplan.yaml").write_text(yaml.safe_dump(config))  # as an older sdplan wrote it
    line = one_line_error(
        invoke("--config", str(out / "sdplan.yaml"), "--out", str(out), "--force", "--yes"),
        2,
        "--force starts the run",
        "checkpoints.resume names",
    )
    assert "--resume" in line  # offered as what to do, not named as what was given
    assert checkpoints(out) == ["interrupt-step-000003", "step-000002"] and not launches
    # the same as a key=value, and latest
    for value in (str(out / "checkpoints" / "step-000002"), "latest"):
        one_line_error(
            invoke(
                "--config",
                str(out / "sdplan.yaml"),
                "--out",
                str(out),
                "--force",
                f"checkpoints.resume={value}",
            ),
            2,
            "checkpoints.resume",
        )
    assert checkpoints(out) == ["interrupt-step-000003", "step-000002"] and not launches


def test_force_says_what_it_removes(run_folder):
    out, launches = run_folder
    r = invoke("--config", str(out / "sdplan.yaml"), "--out", str(out), "--force", "--yes")
    assert r.exit_code == 130, r.output
    assert "--force: removed 2 checkpoints (step-000002, interrupt-step-000003) from" in r.stdout, r.stdout
    assert not (out / "checkpoints").exists() and len(launches) == 1


def test_a_new_run_from_another_runs_checkpoint_is_checked(run_folder, tmp_path):
    """A new run may start from another run's checkpoint (the trainer honours checkpoints.resume); one that is
    not a checkpoint is one line naming checkpoints.resume, not the trainer's `--resume X`."""
    out, launches = run_folder
    config = str(out / "sdplan.yaml")
    one_line_error(
        invoke("--config", config, "--out", str(tmp_path / "new"), f"checkpoints.resume={tmp_path}"),
        2,
        f"checkpoints.resume {tmp_path}: not a checkpoint folder",
    )
    r = invoke(
        "--config", config, "--out", str(tmp_path / "new"), "--yes",
        f"checkpoints.resume={out}/checkpoints/step-000002",
    )  # fmt: skip
    assert r.exit_code == 130 and len(launches) == 1, r.output


def test_a_new_run_from_another_runs_checkpoint_gets_the_resume_checks(run_folder, tmp_path, monkeypatch):
    """checkpoints.resume=OTHER/checkpoints/step-N without --resume got none of --resume's checks: another
    optimizer gave the trainer's KeyError 'beta1', a checkpoint past the new run's length 'finished' at once
    with its weights, and a relative value named another checkpoint from another folder."""
    out, launches = run_folder
    config = str(out / "sdplan.yaml")
    ckpt = out / "checkpoints" / "step-000002"
    new = tmp_path / "new"
    # the settings of the run it was saved in (a checkpoint that records none: its run's sdplan.yaml)
    one_line_error(
        invoke(
            "--config", config, "--out", str(new), f"checkpoints.resume={ckpt}", "memory.optimizer=adafactor"
        ),
        2,
        f"checkpoints.resume {ckpt}: memory.optimizer is 'adamw' in {out / 'sdplan.yaml'}",
        "checkpoints.resume=null",
    )
    one_line_error(
        invoke("--config", config, "--out", str(new), f"checkpoints.resume={ckpt}", "lora.rank=8"),
        2,
        "lora.rank is 16",
    )
    # the settings its train_state.json records win (the run's sdplan.yaml may have changed since)
    state = json.loads((ckpt / "train_state.json").read_text())
    copied = tmp_path / "copied" / "step-000002"  # copied out of its run folder: no sdplan.yaml beside it
    copied.mkdir(parents=True)
    recorded = {"method": "lora", "memory.optimizer": "adamw8bit", "ema.enabled": False}
    (copied / "train_state.json").write_text(json.dumps({**state, "settings": recorded}))
    one_line_error(
        invoke("--config", config, "--out", str(new), f"checkpoints.resume={copied}"),
        2,
        f"memory.optimizer is 'adamw8bit' in the checkpoint's train_state.json ({copied}), 'adamw' here",
    )
    # past (or at) the new run's length: nothing left to train
    one_line_error(
        invoke("--config", config, "--out", str(new), f"checkpoints.resume={ckpt}", "--max-steps", "2"),
        2,
        f"checkpoints.resume {ckpt} already trained 2 steps (2 images), as many as the 2",
        "nothing left to train",
    )
    assert not launches and not new.exists()
    # stored absolute: a later run from another folder reads the same checkpoint
    monkeypatch.chdir(out)
    r = invoke("--config", config, "--out", str(new), "--yes", "checkpoints.resume=checkpoints/step-000002")
    assert r.exit_code == 130 and len(launches) == 1, r.output
    assert yaml.safe_load((new / "sdplan.yaml").read_text())["checkpoints"]["resume"] == str(ckpt)


def test_the_oom_retry_of_a_run_started_from_a_checkpoint_resumes_it(run_folder, tmp_path, monkeypatch):
    """With no checkpoint of its own yet, the retry of a run from another run's checkpoint said "restarting
    from the start" and was free to switch to 8-bit AdamW / DeepSpeed, whose state the trainer then loaded the
    AdamW checkpoint into."""
    import sdplan.launcher as L

    out, launches = run_folder
    ckpt = out / "checkpoints" / "step-000002"
    new = tmp_path / "new"
    seen: list[bool] = []
    real = L.after_oom

    def after_oom(data, **kw):
        seen.append(kw.get("resumes", False))
        return real(data, **kw)

    def oom(launch, **kw):
        launches.append(launch)
        (new / "oom.json").write_text(json.dumps({"step": 3}))
        return L.EXIT_OOM

    monkeypatch.setattr(L, "after_oom", after_oom)
    monkeypatch.setattr(L, "run_launch", oom)
    monkeypatch.setattr(L, "_record", lambda *a, **k: None)
    r = invoke(
        "--config", str(out / "sdplan.yaml"), "--out", str(new), "--yes", f"checkpoints.resume={ckpt}",
        "training.batch_size=2",
    )  # fmt: skip
    assert f"restarting from {ckpt}, the checkpoint it started from" in r.stdout, r.stdout
    # every retry resumes it (the last call, with no resumes, names a saver only a fresh start could have)
    assert len(seen) > 1 and all(seen[:-1]) and r.exit_code == L.EXIT_OOM, (seen, r.output)
    assert "checkpoints.resume=null" not in r.output or "not tried" in r.output


# -- #5: settings the checkpoint's saved state cannot be loaded with -------------------------------------------


@pytest.mark.parametrize(
    "setting",
    ["memory.optimizer=adafactor", "distributed.deepspeed.zero_stage=2", "training.batch_size=1"],
)
def test_resume_with_a_setting_the_checkpoint_cannot_load_writes_nothing(run_folder, setting):
    """`--resume memory.optimizer=adafactor` on an AdamW checkpoint rewrote sdplan.yaml, then failed with a
    45-line traceback (KeyError 'beta1'), and so did every later plain --resume. DeepSpeed turned on resumes a
    checkpoint without its files. A setting it can load (the micro-batch) still resumes."""
    out, launches = run_folder
    before = (out / "sdplan.yaml").read_text()
    r = invoke("--resume", "--out", str(out), setting)
    if setting.startswith("training."):
        assert r.exit_code == 130 and len(launches) == 1, r.output
        return
    key = setting.split("=")[0].rsplit(".", 1)[0] if "deepspeed" in setting else setting.split("=")[0]
    line = one_line_error(r, 2, f"--resume: {key} is", "cannot be loaded with the second", "--force")
    assert "Traceback" not in line
    assert (out / "sdplan.yaml").read_text() == before and not launches


def test_check_resume_settings_covers_the_optimizer_the_ema_and_deepspeed():
    from sdplan import config as C
    from sdplan.errors import UsageError
    from sdplan.launcher import check_resume_settings

    def cfg(method="finetune", **sections):
        return C.validate({"method": method, "model": {"path": "org/model"}, **sections})

    ema = cfg(ema={"enabled": True})
    with pytest.raises(UsageError, match="ema.enabled is True in the run's sdplan.yaml, False here"):
        check_resume_settings(ema, cfg(ema={"enabled": False}))
    with pytest.raises(UsageError, match="ema.enabled"):
        check_resume_settings(cfg(), ema)
    check_resume_settings(ema, cfg(ema={"enabled": True, "device": "gpu"}))  # where it lives: loads
    with pytest.raises(UsageError, match="memory.optimizer is 'adamw'"):
        check_resume_settings(cfg(), cfg(memory={"optimizer": "adamw8bit"}))
    split = cfg(distributed={"num_processes": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": False}})
    offload = cfg(distributed={"num_processes": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": True}})
    # torch's AdamW state in a split ZeRO checkpoint, which the offloaded CPU Adam cannot load: its first step
    # stopped with KeyError 'bias_correction' (a ZeRO stage changed alone loads)
    with pytest.raises(UsageError, match="distributed.deepspeed is 'on'.*'on, optimizer offloaded'"):
        check_resume_settings(split, offload)
    check_resume_settings(
        split,
        cfg(distributed={"num_processes": 2, "deepspeed": {"zero_stage": 1, "offload_optimizer": False}}),
    )
    with pytest.raises(UsageError, match="distributed.deepspeed is 'on'"):
        check_resume_settings(split, cfg(distributed={"num_processes": 2}))


def test_the_oom_retry_passes_over_savers_its_checkpoint_cannot_be_resumed_with():
    """At a micro-batch of 1 the retry switched to 8-bit AdamW and last turned DeepSpeed on, and resumed the
    checkpoint, whose AdamW state (and no DeepSpeed files) cannot be loaded into either: with a checkpoint to
    resume they are passed over; without one (a fresh start) they are tried."""
    from sdplan.launcher import after_oom

    d = {
        "method": "lora",
        "model": {"path": "org/model"},
        "training": {"batch_size": 1, "grad_accum": 1},
        "memory": {"gradient_checkpointing": True, "cache_latents": True, "cache_text_encoder_outputs": True},
    }
    kw = dict(cuda=True, have_bnb=True, have_deepspeed=True)
    assert "8-bit AdamW" in after_oom(d, **kw).message
    assert after_oom(d, **kw, resumes=True) is None
    d["memory"]["optimizer"] = "adamw8bit"
    assert "DeepSpeed" in after_oom(d, **kw).message
    assert after_oom(d, **kw, resumes=True) is None
    # a plan's ZeRO-2 that splits the optimizer state: offloaded on a fresh start only (its checkpoint holds
    # torch's AdamW state, which DeepSpeed's CPU Adam cannot load: KeyError 'bias_correction')
    d["memory"]["optimizer"] = "adamw"
    d["distributed"] = {"num_processes": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": False}}
    assert "offloaded the split optimizer state" in after_oom(d, **kw).message
    assert after_oom(d, **kw, resumes=True) is None
    # full bf16 weights: not on a resume of an fp32 checkpoint (a state setting)
    ft = {**d, "method": "finetune", "training": {**d["training"], "precision": "bf16"}, "distributed": {}}
    ft["memory"] = {**d["memory"], "optimizer": "adamw8bit"}
    assert "full bf16" in after_oom(ft, **kw).message
    assert after_oom(ft, **kw, resumes=True) is None


# -- #7: a resume shorter than what the checkpoint trained ------------------------------------------------------


def test_resume_shorter_than_the_checkpoint_is_refused(run_folder):
    """`--resume --max-steps 2` on a checkpoint at step 3 'finished' at once: the outputs held 3 steps of
    training, their metadata said 2, and nothing was said."""
    out, launches = run_folder
    before = (out / "sdplan.yaml").read_text()
    for extra in (["--max-steps", "2"], ["training.max_steps=1"]):
        line = one_line_error(
            invoke("--resume", "--out", str(out), *extra),
            2,
            "interrupt-step-000003 already trained 3 steps (3 images)",
            "nothing left to train",
            "--force",
        )
        assert "training.max_steps" in line
    assert (out / "sdplan.yaml").read_text() == before and not launches
    r = invoke("--resume", "--out", str(out), "--max-steps", "3")  # as long as the checkpoint: its outputs
    assert r.exit_code == 130 and len(launches) == 1, r.output
    # its sdplan.yaml now asks for 3 steps, which the checkpoint has trained: a plain --resume has nothing
    # left either (refused as finished), so the fix does not offer it
    line = one_line_error(
        invoke("--resume", "--out", str(out), "--max-steps", "2"), 2, "nothing left to train"
    )
    assert (
        "resume without the shorter" not in line
        and "sdplan.yaml asks for 3 steps, which it has trained" in line
    )
    assert len(launches) == 1


# -- #9: a trainer killed by a signal ------------------------------------------------------------------------


@pytest.mark.parametrize("code", [137, -9])
def test_a_trainer_killed_by_sigkill_names_the_signal_and_its_checkpoint(run_folder, monkeypatch, code):
    """A trainer killed by SIGKILL (the out-of-memory killer) said "failed (exit code 137); its error is above"
    over no error, and not that --resume continues from its checkpoint."""
    import sdplan.launcher as L

    out, launches = run_folder
    # run_launch turns a child's -9 into 137; the fake returns what run_launch would
    monkeypatch.setattr(L, "run_launch", lambda *a, **k: 128 - code if code < 0 else code)
    line = one_line_error(invoke("--resume", "--out", str(out)), 137, "the trainer was killed by SIGKILL")
    assert "out-of-memory killer" in line and "its last checkpoint is interrupt-step-000003" in line
    assert f"sdplan train --resume --out {out}" in line and "error is above" not in line


def test_distrun_names_a_worker_killed_by_sigkill_over_the_peer_it_broke():
    """One worker of 2 killed by SIGKILL: the other failed on the lost peer (gloo's "Connection closed by
    peer", exit 1), and that exit 1 was reported ("its error is above") instead of the kill."""
    from types import SimpleNamespace

    from sdplan import distrun

    failures = {0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=-9)}
    assert "training process 1 was killed by SIGKILL" in distrun._killed_line(failures)
    assert distrun._exit_code(failures) == 137
    assert distrun._killed_line({0: SimpleNamespace(exitcode=1), 1: SimpleNamespace(exitcode=-15)}) is None


# -- #14: flags --resume does not use ---------------------------------------------------------------------------


def test_resume_refuses_another_config_and_the_demo_refuses_another_model(run_folder, tmp_path):
    """`--resume --out RUN --config OTHER.yaml` planned from the run's own config and dropped the file without a
    word; `--demo --model sdxl --resume` finished the sd15 run."""
    out, launches = run_folder
    other = tmp_path / "other.yaml"
    edited = yaml.safe_load((out / "sdplan.yaml").read_text())
    edited["lora"]["rank"] = 8
    other.write_text(yaml.safe_dump(edited))
    one_line_error(
        invoke("--resume", "--out", str(out), "--config", str(other)),
        2,
        f"--config {other} is not used with it: its lora.rank is 8, the run's 16",
    )
    r = invoke("--resume", "--out", str(out), "--config", str(out / "sdplan.yaml"), "--dry-run")  # its own
    assert r.exit_code == 0, r.output
    other.write_text((out / "sdplan.yaml").read_text())  # a copy: the same settings
    r = invoke("--resume", "--out", str(out), "--config", str(other), "--dry-run")
    assert r.exit_code == 0, r.output
    one_line_error(invoke("--demo", "--model", "sdxl", "--resume", "--out", str(out)), 2, "drop --model")
    assert not launches


def test_resume_with_a_config_and_no_out_checks_the_runs_own_sdplan_yaml(run_folder, tmp_path):
    """`--resume --config F` without --out resumed F's output.dir with F compared against itself: an edited
    optimizer passed every resume check, overwrote the run's sdplan.yaml and failed (KeyError 'beta1') on every
    later --resume. F is refused unless it is the run's own sdplan.yaml."""
    out, launches = run_folder
    before = (out / "sdplan.yaml").read_text()
    edited = yaml.safe_load(before)
    edited.setdefault("memory", {})["optimizer"] = "adafactor"
    other = tmp_path / "opt.yaml"
    other.write_text(yaml.safe_dump(edited))
    line = one_line_error(
        invoke("--resume", "--config", str(other), "--epochs", "3", "--yes"),
        2,
        f"--config {other} is not used with it: its memory.optimizer is 'adafactor', the run's 'adamw'",
        f"run in {out}",
    )
    # the suggested command keeps the other flags
    assert f"`sdplan train --resume --out {out} --epochs 3 --yes`" in line, line
    assert (out / "sdplan.yaml").read_text() == before and not launches
    r = invoke("--resume", "--config", str(out / "sdplan.yaml"), "--yes")  # its own: resumes
    assert r.exit_code == 130 and len(launches) == 1, r.output
    # the same settings in another file (the plan's sdplan.yaml that started the run, a copy): resumes the run
    # as --resume --out does, with its flags (ff00640 did; the refusal of any other file refused it too)
    same = tmp_path / "same.yaml"
    same.write_text(before)
    r = invoke("--resume", "--config", str(same), "--epochs", "3", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "x 3 epochs" in r.stdout and f"output: {out}" in r.stdout, r.stdout
    # its own file, through its checks: an optimizer it cannot load is refused as with --out
    one_line_error(
        invoke("--resume", "--config", str(out / "sdplan.yaml"), "memory.optimizer=adafactor"),
        2,
        "--resume: memory.optimizer is",
    )
    assert (out / "sdplan.yaml").read_text() == before and len(launches) == 1


# -- #10 / #18: folders --resume and --demo refused with no way out -----------------------------------------------


def test_a_demo_stopped_before_its_sdplan_yaml_is_rebuilt_not_refused(tmp_path, monkeypatch):
    """Ctrl-C between building the demo's model and dataset and writing sdplan.yaml left a folder of only the
    demo's own entries (its manifest lists them) that --demo, --demo --force and --resume all refused."""
    import sdplan.launcher as L
    from sdplan import runfolder
    from sdplan.demo import DEMO_FILES

    out = tmp_path / "demo"
    (out / "base_model").mkdir(parents=True)
    (out / "base_model" / "model_index.json").write_text("{}")
    (out / "dataset").mkdir()
    (out / DEMO_FILES).write_text(json.dumps({"base_model": ["model_index.json"], "dataset": []}))
    runfolder.record(out, ["base_model", "dataset", DEMO_FILES])
    one_line_error(invoke("--demo", "--resume", "--out", str(out)), 2, "stopped before it started training")
    # plain --resume --out, as every other message says to resume: the same line, not "not an sdplan run"
    line = one_line_error(invoke("--resume", "--out", str(out)), 2, "stopped before it started training")
    assert f"sdplan train --demo --out {out}" in line and "not an sdplan run" not in line
    monkeypatch.setattr(L, "run_launch", lambda *a, **k: 130)
    r = invoke("--demo", "--out", str(out))
    assert r.exit_code == 130, r.output
    assert "removed the model and dataset of a demo stopped before it trained" in r.stdout
    assert (out / "sdplan.yaml").is_file()
    # a file of the user's among them: still refused
    (out / "notes.txt").write_text("mine")
    assert invoke("--demo", "--out", str(out)).exit_code != 0 and (out / "notes.txt").exists()


def test_resume_of_a_run_whose_sdplan_yaml_was_deleted_says_so(run_folder):
    out, launches = run_folder
    (out / "sdplan.yaml").unlink()
    one_line_error(invoke("--resume", "--out", str(out)), 2, "sdplan.yaml of the run", "is missing")


def test_every_checkpoint_incomplete_says_force_not_a_command_that_is_refused(tmp_path):
    """'start without --resume' under `sdplan train` gave '--model and --dataset missing' or 'holds an sdplan
    run (continue it with --resume ...)'."""
    from sdplan.trainer.checkpoint import CheckpointError, resolve_resume

    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000002" / "train_state.json").write_text("{broken")
    with pytest.raises(CheckpointError) as e:
        resolve_resume("latest", tmp_path)
    assert "--force" in e.value.fix


def test_force_instead_of_resume_is_a_command_that_runs(run_folder, tmp_path):
    """Every 'start it over: --force instead of --resume' hint gave a command that failed: `sdplan train --force
    --out DIR` said '--model and --dataset missing'. With no --model/--dataset/--config, --force reads the run's
    own sdplan.yaml, as --resume does; the trainer's hint names the run's folder."""
    from sdplan.trainer.checkpoint import CheckpointError, resolve_resume

    out, launches = run_folder
    line = one_line_error(
        invoke("--resume", "--out", str(out), "--max-steps", "2", "--yes"), 2, "--force instead of --resume"
    )
    assert not launches and "already trained 3 steps" in line
    r = invoke("--force", "--out", str(out), "--max-steps", "2", "--yes")
    assert r.exit_code == 130 and len(launches) == 1, r.output
    assert "--model" not in r.output and not (out / "checkpoints").exists()
    saved = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert saved["training"]["max_steps"] == 2 and saved["output"]["dir"] == str(out)
    # a folder without an sdplan.yaml: still the missing flags
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(invoke("--force", "--out", str(empty)), 2, "--model and --dataset missing")

    (out / "checkpoints" / "step-000002").mkdir(parents=True)
    (out / "checkpoints" / "step-000002" / "train_state.json").write_text("{broken")
    with pytest.raises(CheckpointError) as e:
        resolve_resume("latest", out)
    assert f"`sdplan train --force --out {out}`" in e.value.fix


def test_resume_with_new_settings_on_damaged_checkpoints_changes_nothing(run_folder):
    """`--resume --epochs 3` where every checkpoint is damaged rewrote the run's sdplan.yaml with the new
    settings, then the trainer refused the checkpoints: the run's settings were changed by a resume that never
    ran. The launcher checks the checkpoints as the trainer does before it writes anything."""
    from conftest import digest

    out, launches = run_folder
    for name in ("step-000002", "interrupt-step-000003"):
        state_file = out / "checkpoints" / name / "train_state.json"
        state = json.loads(state_file.read_text())
        state_file.write_text(json.dumps({**state, "files": {"optimizer.bin": 7}}))  # listed, not there
    before = digest(out)
    line = one_line_error(
        invoke("--resume", "--out", str(out), "--epochs", "3", "--yes"), 2, "incomplete or damaged"
    )
    assert "optimizer.bin is missing" in line and f"sdplan train --force --out {out}" in line
    assert digest(out) == before and not launches


def test_resume_with_another_methods_settings_names_the_method_change_and_says_drop(run_folder):
    """`--resume method=textual-inversion lora.rank=4` showed only the lora.* problem, whose fix 'use --method
    lora' --resume refuses, and hid that the method changed. The method change is the error; another method's
    setting alone, with --resume, is to be dropped."""
    out, launches = run_folder
    before = (out / "sdplan.yaml").read_text()
    line = one_line_error(
        invoke("--resume", "--out", str(out), "method=textual-inversion", "lora.rank=4"),
        2,
        "method is 'lora' in the run's sdplan.yaml, 'textual-inversion' here",
    )
    assert "--method lora" not in line
    line = one_line_error(
        invoke("--resume", "--out", str(out), "textual_inversion.token=<x>"), 2, "textual_inversion.token"
    )
    assert "--method" not in line.partition("only")[2] and "drop it" in line, line
    assert (out / "sdplan.yaml").read_text() == before and not launches


def test_a_start_from_a_checkpoint_takes_its_base_model_at_another_path(tmp_path):
    """checkpoints.resume of a checkpoint whose base model sits at another path (moved, copied to another
    machine, a local snapshot of its hub id) was refused ('model.path is ... it was trained with the first'),
    and the fix 'drop the model.path setting' gave the default model. The path is not compared; the settings
    the weights are shaped by are, with a fix naming the value to set; a model of another family is refused."""
    from sdplan import config as C
    from sdplan.errors import UsageError
    from sdplan.launcher import check_start_settings

    ckpt = fake_checkpoint(tmp_path / "old", "rolling-step-000016", step=16, images=16)
    state = json.loads((ckpt / "train_state.json").read_text())
    recorded = {
        "method": "lora",
        "model.path": str(tmp_path / "old" / "base_model"),
        "model.family": "sd15",
        "lora.rank": 4,
        "memory.optimizer": "adamw",
    }
    (ckpt / "train_state.json").write_text(json.dumps({**state, "settings": recorded}))

    def cfg(**lora):
        model = {"path": str(tmp_path / "new" / "base_model")}
        return C.validate({"method": "lora", "model": model, "lora": {"rank": 4, **lora}})

    check_start_settings(cfg(), ckpt, "sd15")
    check_start_settings(cfg(), ckpt)  # family not known yet: the rest is still checked
    with pytest.raises(UsageError) as e:
        check_start_settings(cfg(rank=16), ckpt, "sd15")
    assert "lora.rank is 4 in the checkpoint's train_state.json" in str(e.value)
    assert "set lora.rank=4, the checkpoint's" in e.value.fix and "drop" not in e.value.fix
    with pytest.raises(UsageError, match="trained on a model of the sd15 family") as e:
        check_start_settings(cfg(), ckpt, "sdxl")
    assert "set model.path to a model of the sd15 family" in e.value.fix


def test_a_start_from_a_checkpoint_that_records_no_family_reads_its_base_or_compares_its_path(tmp_path):
    """A checkpoint saved before checkpoints recorded their family (5e72b2e): with model.path no longer
    compared, an SDXL checkpoint started an SD 1.x run and the trainer failed after loading ('lacks trainable
    weight ... made by another method?'). Its recorded base, where it is here, says the family; where it is not,
    the path is compared as before."""
    from conftest import fake_diffusers_folder

    from sdplan import config as C
    from sdplan.errors import UsageError
    from sdplan.launcher import check_start_settings

    ckpt = fake_checkpoint(tmp_path / "old", "rolling-step-000002", step=2, images=2)
    state = json.loads((ckpt / "train_state.json").read_text())
    base = fake_diffusers_folder(tmp_path / "old" / "base_model", "sdxl")
    recorded = {"method": "lora", "model.path": str(base), "lora.rank": 4}
    (ckpt / "train_state.json").write_text(json.dumps({**state, "settings": recorded}))
    cfg = C.validate({"method": "lora", "model": {"path": str(tmp_path / "sd15")}, "lora": {"rank": 4}})
    with pytest.raises(UsageError, match="trained on a model of the sdxl family"):
        check_start_settings(cfg, ckpt, "sd15")
    check_start_settings(cfg, ckpt, "sdxl")  # the same family at another path
    gone = {**recorded, "model.path": str(tmp_path / "moved-away")}
    (ckpt / "train_state.json").write_text(json.dumps({**state, "settings": gone}))
    with pytest.raises(UsageError, match="model.path"):
        check_start_settings(cfg, ckpt, "sd15")


def test_resume_with_the_plan_that_started_the_run_ignores_what_train_wrote_into_it(tmp_path):
    """`recommend --out plan` then `train --config plan/sdplan.yaml --device cpu --out run`, then `train
    --resume --config plan/sdplan.yaml` was refused: 'its training.device is auto, the run's cpu' (and output.dir,
    fp32 on the CPU): what train writes into the run's sdplan.yaml from its flags is not a different config."""
    import yaml

    from sdplan.launcher import config_differs

    plan = {"method": "lora", "model": {"path": "stable-diffusion-v1-5/stable-diffusion-v1-5"}}
    plan |= {"training": {"precision": "fp16"}, "output": {"dir": str(tmp_path / "plan")}}
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "sdplan.yaml").write_text(yaml.safe_dump(plan))
    run = tmp_path / "run"
    run.mkdir()
    written = {**plan, "training": {"precision": "fp32", "device": "cpu"}, "output": {"dir": str(run)}}
    (run / "sdplan.yaml").write_text(yaml.safe_dump(written))
    assert config_differs(tmp_path / "plan" / "sdplan.yaml", run) is None
    other = {**written, "lora": {"rank": 8}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    assert config_differs(tmp_path / "other.yaml", run) == "its lora.rank is 8, the run's 16"


def test_out_of_memory_before_the_first_step_is_not_retried_at_a_smaller_batch(tmp_path, monkeypatch):
    """The trainer's out-of-memory before training (step 0: loading, the caption pass) was retried at a halved
    batch, with checkpointing, 8-bit AdamW and the latent cache, each retry reloading the models. Only the savers
    that change what setup holds are tried; then one line says a smaller batch would not help."""
    import sdplan.launcher as L

    model = fake_diffusers_folder(tmp_path / "model")
    ds = make_images(tmp_path / "ds", n=8)
    out = tmp_path / "run"
    launches: list = []

    def oom(launch, **kw):
        launches.append(launch)
        (out / "oom.json").write_text(json.dumps({"step": 0, "message": "CUDA out of memory"}))
        return L.EXIT_OOM

    monkeypatch.setattr(L, "run_launch", oom)
    monkeypatch.setattr(L, "_record", lambda *a, **k: None)
    r = invoke(
        "--model", str(model), "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes",
        "training.batch_size=4", "memory.cache_text_encoder_outputs=false",
    )  # fmt: skip
    assert r.exit_code == L.EXIT_OOM, r.output
    said = r.stdout + r.stderr
    assert "micro-batch" not in said and "gradient checkpointing" not in said, said
    # the one saver here that changes a LoRA's setup: the encoders off the GPU (DeepSpeed builds no state a LoRA
    # holds there, and is no fix for it)
    assert "turned on text-encoder output caching" in said and "DeepSpeed" not in said
    assert "out of GPU memory before training started" in said and "a smaller batch would not help" in said
    assert len(launches) == 2


def test_the_launchers_checkpoint_step_is_where_the_trainer_places_a_resume_in_the_kept_order(tmp_path):
    """A checkpoint at batch 4 resumed at batch 2 (the out-of-memory retry) keeps its order of images
    (trainer/buckets.py): the trainer counts the batches its images make whole, short ones too. The launcher's
    guards counted images // 2, up to a batch per bucket earlier, and let a resume past the run's end through
    (the trainer then said "step 7 of 6" and trained nothing). Every checkpoint of a bucketed epoch: the same."""
    from PIL import Image
    from sdplan.trainer import checkpoint as ckpt
    from sdplan.trainer.buckets import BucketBatchSampler
    from sdplan.trainer.data import build_dataset
    from sdplan.trainer.runtime import plan_steps

    from sdplan import config as C
    from sdplan.launcher import check_inputs, checkpoint_step

    ds = tmp_path / "ds"
    ds.mkdir()
    for i, size in enumerate([(128, 128)] * 5 + [(128, 384)] * 5 + [(384, 128)] * 5):
        Image.new("RGB", size, (i * 9, 80, 160)).save(ds / f"{i:02d}.png")
    model = fake_diffusers_folder(tmp_path / "model")
    data = C.default_config()
    data["model"]["path"] = str(model)
    data["data"].update({"path": str(ds), "resolution": 128, "buckets": True})
    data["training"].update(
        {"device": "cpu", "batch_size": 2, "grad_accum": 1, "epochs": 2, "max_steps": None}
    )
    cfg = C.validate(data)
    inputs = check_inputs(cfg, dry_run=True)
    dataset, _ = build_dataset(cfg)
    assert inputs.sample_buckets == tuple(dataset.bucket_ids())
    old = BucketBatchSampler(dataset.bucket_ids(), 4, seed=cfg.training.seed)
    new = BucketBatchSampler.for_dataset(dataset, 2, seed=cfg.training.seed)
    plan = plan_steps(
        images_per_epoch=len(dataset),
        batches_per_epoch=len(new),
        batch_size=2,
        grad_accum=1,
        epochs=2,
        max_steps=None,
        warmup_steps=0,
        num_processes=1,
        bucket_samples=new.bucket_samples(),
    )
    live = ckpt.TrainState(batch_size=2, grad_accum=1, num_processes=1)
    new.keep_order(4)
    sizes = [len(b) for b in old.epoch_batches(0)]
    assert any(n < 4 for n in sizes[:-1])  # short batches inside the epoch: where the two counts differed
    for k in range(1, len(sizes)):
        saved = ckpt.TrainState(
            global_step=k,
            epoch=0,
            batches_in_epoch=k,
            images_in_epoch=sum(sizes[:k]),
            images_seen=sum(sizes[:k]),
            batch_size=4,
            grad_accum=1,
            num_processes=1,
            order_batch_size=4,
        )
        folder = tmp_path / f"step-{k:06d}"
        folder.mkdir()
        (folder / ckpt.STATE_FILE).write_text(json.dumps(saved.to_json()))
        trainer = ckpt.resume_position(saved, live, plan, len(new), new)
        assert checkpoint_step(folder, cfg, inputs, 1)[0] == trainer.step, k


def test_the_trainer_refuses_a_checkpoint_of_another_optimizer_offload(tmp_path):
    """A hand launch (`accelerate launch`, `python -m sdplan.trainer`) resuming a ZeRO checkpoint with the optimizer
    offload switched: torch's AdamW state went into DeepSpeed's CPU Adam, whose first step stopped with
    KeyError 'bias_correction'. `sdplan train --resume` refuses it before the launch; the trainer now too."""
    from sdplan.trainer.checkpoint import TrainState, deepspeed_change

    split = {"zero_stage": 2, "offload_optimizer": False}
    saved = TrainState(settings={"distributed.deepspeed": split})
    problem = deepspeed_change(tmp_path, saved, True, now={"zero_stage": 2, "offload_optimizer": True})
    assert problem is not None and "not offloaded" in str(problem)
    assert deepspeed_change(tmp_path, saved, True, now={"zero_stage": 1, "offload_optimizer": False}) is None
    assert deepspeed_change(tmp_path, saved, True) is None  # this run's setting not recorded: not judged
