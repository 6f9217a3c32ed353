"""Nothing lost, nothing misleading (issue 13, launcher side): --force deletes only what sdplan wrote, paths and
install hints print as they are, a dry run touches nothing, the trainer imports the installed sdplan whatever
the working folder holds, one run per folder at a time, and the trainer dies with sdplan."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import digest, fake_diffusers_folder, make_images, one_line_error
from limits import scaled, wait_until
from typer.testing import CliRunner

from sdplan import runfolder
from sdplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
MACHINES = ROOT / "tests" / "fixtures" / "machines"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


# -- item 2: --force deletes only what the manifest proves sdplan wrote ----------------------------------------


def test_force_never_deletes_a_users_checkpoints_folder(tmp_path):
    proj = tmp_path / "proj"
    (proj / "checkpoints").mkdir(parents=True)
    (proj / "checkpoints" / "my_model.safetensors").write_bytes(b"the user's model")
    user = digest(proj)
    r = cli("recommend", "--method", "lora", "--machine", str(MACHINES / "rx6700xt.json"), "--out", str(proj))
    assert r.exit_code == 0, r.output
    assert runfolder.owned(proj) == {"sdplan.yaml", "accelerate.yaml", "plan.png"}
    r = cli("train", "--config", str(proj / "sdplan.yaml"), "--out", str(proj), "--force", "--device", "cpu")
    one_line_error(r, 3, "checkpoints", "did not write")
    after = digest(proj)
    assert {k: after[k] for k in user} == user


def test_force_removes_only_manifest_entries(tmp_path):
    from sdplan.launcher import clear_run_outputs

    out = tmp_path / "run"
    (out / "checkpoints" / "step-8").mkdir(parents=True)
    (out / "checkpoints" / "step-8" / "w.bin").write_bytes(b"x")
    (out / "run_summary.json").write_text("{}")
    (out / "oom.json").write_text("{}")
    runfolder.record(out, ["checkpoints", "run_summary.json"])  # oom.json: not provably sdplan's
    clear_run_outputs(out)
    assert sorted(runfolder.entries(out)) == ["oom.json"]


def test_force_clears_the_last_runs_grids_intermediate_weights_and_final_outputs(tmp_path):
    """--force starts a run over: the old run's intermediate weights and step grids sat among the new run's (old
    steps 3 and 6 beside new 4 and 8). What the trainer names so goes; the latent cache, the class images, the
    run files, what the manifest does not list, and a user's files inside sdplan's folders stay (a first version
    deleted samples/ and logs/ whole, notes and all, and logs/ though the run had made none)."""
    import json

    from sdplan.launcher import clear_run_outputs

    out = tmp_path / "run"
    for rel in (
        "intermediate/inter-step00000003/w.safetensors", "intermediate/inter-000002/w.safetensors",
        "samples/step-000003.png", "samples/final.png", "logs/run/events.out.tfevents.1.host",
        "cache/latents.pt", "class_images/0.png", "loss.png", "loss_history.json",
        "pytorch_lora_weights.safetensors", "run.kohya.safetensors", "sdplan.yaml", "mine.safetensors",
    ):  # fmt: skip
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"x")
    finals = ["pytorch_lora_weights.safetensors", "run.kohya.safetensors", "samples/final.png", "loss.png"]
    outputs = [str(out / f) for f in (*finals, "loss_history.json", "sdplan.yaml", "../elsewhere.bin")]
    (out / "run_summary.json").write_text(json.dumps({"outputs": outputs}))
    runfolder.record(out, [*[n for n in runfolder.entries(out) if n != "mine.safetensors"], "ema"])
    clear_run_outputs(out)
    assert sorted(runfolder.entries(out)) == ["cache", "class_images", "mine.safetensors", "sdplan.yaml"]

    # a user's files inside the folders sdplan writes in stay, and so do the folders holding them
    for rel in (
        "samples/step-000004.png",
        "samples/mine.txt",
        "logs/my_notes.txt",
        "intermediate/keep/x.bin",
    ):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"x")
    runfolder.record(out, ["samples", "logs", "intermediate"])
    clear_run_outputs(out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name[0] != ".") == [
        "cache/latents.pt", "class_images/0.png", "intermediate/keep/x.bin", "logs/my_notes.txt",
        "mine.safetensors", "samples/mine.txt", "sdplan.yaml",
    ]  # fmt: skip


def test_force_after_an_interrupted_extension_removes_the_earlier_finishs_outputs(tmp_path):
    """A finished run resumed with --epochs 3 and interrupted: run_summary.json went at the start, so the
    16-step LoRA, loss.png and loss_history.json sat there unlisted, and a later --force left them beside the
    new run's files. Their names now go into run_summary.previous.json at the start, which --force reads; a
    session that finishes keeps there only what its own summary does not list."""
    import json

    from sdplan.launcher import (
        PREVIOUS_SUMMARY_FILE,
        TRAINER_ENTRIES,
        clear_run_outputs,
        drop_previous_summary,
        set_aside_summary,
    )

    out = tmp_path / "run"
    out.mkdir()
    finals = ["pytorch_lora_weights.safetensors", "run.kohya.safetensors", "loss.png", "loss_history.json"]
    for f in finals:
        (out / f).write_bytes(b"x")
    (out / "run_summary.json").write_text(
        json.dumps({"steps": 16, "outputs": [str(out / f) for f in finals]})
    )
    runfolder.record(out, [*runfolder.entries(out), *TRAINER_ENTRIES])
    set_aside_summary(out)  # the extension starts ... and is interrupted
    assert not (out / "run_summary.json").exists()
    assert json.loads((out / PREVIOUS_SUMMARY_FILE).read_text())["steps"] == 16
    clear_run_outputs(out)  # --force
    assert runfolder.entries(out) == []

    for f in finals:  # a session that finishes under another output name: the old kohya file stays listed
        (out / f).write_bytes(b"x")
    (out / "run_summary.json").write_text(json.dumps({"outputs": [str(out / f) for f in finals]}))
    set_aside_summary(out)
    (out / "new.kohya.safetensors").write_bytes(b"x")
    now = [str(out / f) for f in (*finals[:1], "new.kohya.safetensors", *finals[2:])]
    (out / "run_summary.json").write_text(json.dumps({"outputs": now}))
    drop_previous_summary(out)
    assert json.loads((out / PREVIOUS_SUMMARY_FILE).read_text())["outputs"] == [finals[1]]
    (out / finals[1]).unlink()
    drop_previous_summary(out)
    assert not (out / PREVIOUS_SUMMARY_FILE).exists()


def test_force_in_a_copied_run_folder_removes_the_copys_outputs_not_the_originals(tmp_path):
    """Summaries listed absolute paths: in a copy of a run folder (cp -a run copy) --force skipped them, as
    outside the folder, and left the copy's old weights. The trainer lists them relative to the run folder now,
    with the folder it wrote in; an absolute path under that folder (a summary written before) maps into the
    copy. The summary shown at the end still names them where they are."""
    import json
    import shutil

    from sdplan.trainer.outputs import write_run_summary

    from sdplan.launcher import TRAINER_ENTRIES, clear_run_outputs, render_summary, set_aside_summary

    out = tmp_path / "run"
    out.mkdir()
    finals = ["pytorch_lora_weights.safetensors", "run.kohya.safetensors", "loss.png", "loss_history.json"]
    for f in (*finals, "new.kohya.safetensors"):
        (out / f).write_bytes(b"x")
    summary = write_run_summary(
        out, method="lora", steps=16, epochs=2, images_seen=32, num_processes=1, final_loss=0.1,
        wall_seconds=1.0, peak_memory_bytes=0, outputs=[out / f for f in finals],
    )  # fmt: skip
    assert summary["outputs"] == finals and summary["folder"] == str(out.resolve())
    assert f"  {out.resolve() / finals[0]}" in render_summary(summary)
    runfolder.record(out, [*runfolder.entries(out), *TRAINER_ENTRIES])
    set_aside_summary(out)  # an extension that was interrupted: the list is in run_summary.previous.json
    absolute = {"folder": str(out.resolve()), "outputs": [str(out.resolve() / "new.kohya.safetensors")]}
    (out / "run_summary.json").write_text(json.dumps(absolute))  # as summaries listed them before
    before = runfolder.entries(out)

    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)
    clear_run_outputs(copy)  # sdplan train --force --out copy
    assert runfolder.entries(copy) == []
    assert runfolder.entries(out) == before and all((out / f).read_bytes() == b"x" for f in finals)


def test_force_removes_the_trial_export_a_killed_run_left(tmp_path):
    """A SIGKILL of sdplan and the trainer during the trial export left ``.export-check-<pid>`` (a whole model
    copy for a full fine-tune), in no manifest: --force was refused ("holds files sdplan did not write") and
    --resume had no checkpoint, a dead end. sdplan wrote it: --force now goes on and removes it; a name that
    is not a pid stays the user's."""
    from sdplan.errors import OutputExistsError
    from sdplan.launcher import TRAINER_ENTRIES, check_out_dir, clear_run_outputs

    out = tmp_path / "run"
    out.mkdir()
    (out / "sdplan.yaml").write_text("method: lora\n")
    runfolder.record(out, ["sdplan.yaml", *TRAINER_ENTRIES])
    (out / ".export-check-29512").mkdir()
    (out / ".export-check-29512" / "model.safetensors").write_bytes(b"x")
    assert check_out_dir(out, force=True) == "run"
    clear_run_outputs(out)
    assert runfolder.entries(out) == ["sdplan.yaml"]
    from sdplan.trainer.outputs import remove_stale_export_checks

    (out / ".export-check-12").mkdir()  # a trainer killed alone: the next start (--resume too) removes it
    remove_stale_export_checks(out)
    assert runfolder.entries(out) == ["sdplan.yaml"]
    (out / ".export-check-mine").mkdir()
    with pytest.raises(OutputExistsError, match="did not write"):
        check_out_dir(out, force=True)


def test_a_run_records_what_it_and_the_trainer_write(tmp_path):
    """The real launch path with a stand-in trainer command: every top-level entry it creates is recorded."""
    from sdplan import config as C
    from sdplan.launch import Launch
    from sdplan.launcher import TRAINER_ENTRIES, UI, InputSummary, Prepared, TrainRequest, execute

    out = tmp_path / "run"
    out.mkdir()
    (out / "sdplan.yaml").write_text("method: lora\n")
    runfolder.record(out, ["sdplan.yaml"])
    writer = f"import pathlib; p = pathlib.Path({str(out)!r}); (p / 'mylora.safetensors').write_bytes(b'w')"
    launch = Launch(cmd=[sys.executable, "-c", writer], env={})
    cfg = C.validate({"training": {"device": "cpu"}, "output": {"dir": str(out)}})
    inputs = InputSummary(1, 1, 0, "folder", "sd15", "")
    p = Prepared(cfg=cfg, out=out, inputs=inputs, world=1, steps={})
    execute(p, TrainRequest(), UI(echo=lambda s: None), launch)
    assert {"sdplan.yaml", "mylora.safetensors", *TRAINER_ENTRIES} <= runfolder.owned(out)


# -- item 3: rich markup never eats text ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["out [v2]", "x[/b]", "[bold]y"])
def test_bracketed_out_paths_print_as_they_are(tmp_path, name):
    out = tmp_path / "runs" / name
    r = cli("recommend", "--method", "lora", "--machine", str(MACHINES / "rx6700xt.json"), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    assert str(out / "sdplan.yaml") in r.stderr  # "wrote ..."
    assert (out / "sdplan.yaml").is_file()


def test_install_hints_keep_their_brackets():
    r = cli("recommend", "--method", "dreambooth", "--machine", str(MACHINES / "rx6700xt.json"))
    assert r.exit_code == 0, r.output
    assert "pip install 'deepspeed>=0.15'" in r.stdout


def test_train_echo_is_plain_text(tmp_path):
    """The train UI prints paths and commands verbatim: a dry run into a bracketed folder shows it whole."""
    model = fake_diffusers_folder(tmp_path / "model")
    ds = make_images(tmp_path / "ds", n=2)
    out = tmp_path / "runs" / "x[/b] [v2]"
    r = cli(
        "train",
        "--model",
        str(model),
        "--dataset",
        str(ds),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--dry-run",
    )
    assert r.exit_code == 0, r.output
    assert f"output: {out}" in r.stdout
    assert not out.exists()


def test_error_funnel_escapes_paths(tmp_path):
    r = cli("train", "--config", str(tmp_path / "a[/b]" / "sdplan.yaml"))
    one_line_error(r, 2, "a[/b]")


# -- item 5: --demo --dry-run touches nothing --------------------------------------------------------------------


def test_demo_dry_run_touches_nothing(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "sdplan.yaml").write_text("method: lora\n")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "c.bin").write_bytes(b"ckpt")
    (out / "run_summary.json").write_text("{}")
    runfolder.record(out, ["sdplan.yaml", "checkpoints", "run_summary.json"])
    before = digest(out)
    r = cli("train", "--demo", "--out", str(out), "--force", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "dry run: would run" in r.stdout and "would build a tiny sd15 model" in r.stdout
    assert digest(out) == before
    r = cli("train", "--demo", "--out", str(tmp_path / "new"), "--dry-run")
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "new").exists()


# -- item 1: a folder named sdplan in the working folder ---------------------------------------------------------


def test_trainer_ignores_a_sdplan_folder_in_the_working_folder(tmp_path, monkeypatch):
    """The launch runs the real trainer entry in a folder that holds a decoy `sdplan` package: the trainer
    must import the installed sdplan (here it then reports the config's bad key: exit 2, one line)."""
    from sdplan import config as C
    from sdplan.launch import build_launch, run_launch

    decoy = tmp_path / "work" / "sdplan"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy sdplan was imported')\n")
    (decoy / "trainer").mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: lora\ntraining: {batch_sise: 2}\n")
    cfg = C.validate({"training": {"device": "cpu"}})
    launch = build_launch(cfg, bad, tmp_path / "o", cpu_cores=1)
    monkeypatch.chdir(tmp_path / "work")
    out = tmp_path / "log"
    with out.open("w") as f:
        proc = subprocess.run(
            launch.cmd, env={**os.environ, **launch.env}, stdout=f, stderr=subprocess.STDOUT
        )
    log = out.read_text()
    assert proc.returncode == 2, log
    assert "batch_sise" in log and "decoy" not in log and "Traceback" not in log
    assert run_launch(launch) == 2  # the same through the launcher


# -- item 4: one run per folder, and the trainer dies with sdplan ------------------------------------------------


def test_second_run_into_a_locked_folder_says_who_holds_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        (out / runfolder.LOCK_FILE).write_text(
            json.dumps({"pid": holder.pid, "host": os.uname().nodename, "started": "2026-01-01T00:00:00"})
        )
        with pytest.raises(runfolder.FolderInUse, match=f"pid {holder.pid}"):
            runfolder.RunLock(out).acquire()
        (out / "sdplan.yaml").write_text("method: lora\n")
        one_line_error(cli("train", "--resume", "--out", str(out)), 3, "in use", str(holder.pid))
        # a plan written there with --force replaced the sdplan.yaml the run was started with (before its first
        # checkpoint the manifest names no trained file, so the "holds an sdplan training run" check passed)
        (out / "sdplan.yaml").unlink()
        runfolder.write_files(out, {"sdplan.yaml": "method: lora\n"})
        plan = cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(out), "--force")
        one_line_error(plan, 3, "in use", str(holder.pid))
        assert (out / "sdplan.yaml").read_text() == "method: lora\n"
    finally:
        holder.kill()
        holder.wait()
    # The holder is gone: the stale lock is taken over, and says whose it was.
    lock = runfolder.RunLock(out).acquire()
    assert lock.taken_over and lock.taken_over["pid"] == holder.pid
    assert json.loads((out / runfolder.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / runfolder.LOCK_FILE).exists()


def test_two_runs_into_one_folder_cannot_both_start(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    first = runfolder.RunLock(out).acquire()
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from sdplan.runfolder import RunLock, FolderInUse
        try:
            RunLock(Path({str(out)!r})).acquire()
        except FolderInUse as e:
            print(e); raise SystemExit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 3 and f"sdplan pid {os.getpid()}" in proc.stdout, proc.stdout + proc.stderr
    first.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_trainer_gets_sigterm_when_sdplan_is_killed(tmp_path):
    """kill -9 of the process running run_launch: its child gets SIGTERM from the kernel."""
    marker = tmp_path / "child.pid"
    got = tmp_path / "got-sigterm"
    child = textwrap.dedent(
        f"""
        import os, pathlib, signal, sys, time
        def bye(*a):
            pathlib.Path({str(got)!r}).write_text("yes"); sys.exit(130)
        signal.signal(signal.SIGTERM, bye)
        pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))
        time.sleep(300)
        """
    )
    parent = textwrap.dedent(
        f"""
        import sys
        from sdplan.launch import Launch, run_launch
        run_launch(Launch(cmd=[sys.executable, "-c", {child!r}], env={{}}))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        wait_until(lambda: marker.exists() and marker.read_text(), 60)
        child_pid = int(marker.read_text())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # write_text creates the file before it writes: wait for the text, not the name.
        wait_until(lambda: got.exists() and got.read_text(), 60)
        assert got.read_text() == "yes"
    finally:
        proc.kill()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(child_pid, signal.SIGKILL)


def test_an_out_of_memory_rewrite_drops_sdplans_plan_chart_not_a_users(tmp_path):
    """After an out-of-memory retry rewrites the config, the plan.png drawn for the old one no longer shows what
    runs: sdplan's goes, a user's own file of that name stays."""
    from sdplan.launcher import _drop_stale_plan_chart

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for d in (ours, theirs):
        d.mkdir()
        (d / "plan.png").write_bytes(b"png")
    runfolder.record(ours, ["plan.png"])
    _drop_stale_plan_chart(ours)
    _drop_stale_plan_chart(theirs)
    assert not (ours / "plan.png").exists() and (theirs / "plan.png").read_bytes() == b"png"


def test_force_knows_the_trainers_output_names_by_the_trainers_own_formats():
    from sdplan.trainer.outputs import GRID_NAME, INTERMEDIATE_NAME, grid_name, intermediate_name

    assert all(GRID_NAME.fullmatch(grid_name(step)) for step in (None, 1, 123456, 1234567))
    assert GRID_NAME.fullmatch(grid_name(40, again=2))  # a step an earlier session has a grid of
    assert not GRID_NAME.fullmatch("my-step-1.png")
    assert GRID_NAME.fullmatch("final.error.txt") and GRID_NAME.fullmatch(
        "step-000040-1.error.txt"
    )  # its traceback
    assert not GRID_NAME.fullmatch("final.txt")
    names = [intermediate_name("run", epoch=e, step=s) for e, s in ((3, 30), (None, 40), (None, 99999999))]
    assert all(INTERMEDIATE_NAME.fullmatch(n) for n in names) and not INTERMEDIATE_NAME.fullmatch("keep")
