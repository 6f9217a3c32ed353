"""Nothing lost, nothing misleading (issue 13, the trainer's side): a broken export fails before training and a
failed final export leaves a checkpoint of the trained state; a full disk is one line and keeps the previous
checkpoint; a half-written checkpoint is skipped on resume; intermediate outputs every N epochs / steps that
load; sample grids labelled with the step and the prompt. Tiny models on the CPU."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_images, tiny_train_config, trains_in_process
from PIL import Image
from sdplan.trainer import checkpoint, export, outputs, run, sampling
from sdplan.trainer.__main__ import main as trainer_main
from test_trainer import losses, write_cfg

from sdplan.errors import SdplanError

pytestmark = [pytest.mark.train, trains_in_process]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "flat", n=4)


def _no_temp_left(out: Path) -> None:
    assert not list(out.glob(".export-check*")), list(out.iterdir())
    assert not list(checkpoint.checkpoint_root(out).glob(".tmp-*"))


# -- item 1: the export is exercised before training; a failed final export keeps the trained state -------------


def test_a_broken_export_fails_before_any_step(tiny_sd15, images, tmp_path, monkeypatch):
    """The cwd-`sdplan`-folder case: the export's ``from sdplan import __version__`` fails. It must fail at the
    start, not after hours of training."""
    out = tmp_path / "out"

    def broken(*args, **kwargs):
        raise ImportError("cannot import name '__version__' from 'sdplan' (unknown location)")

    monkeypatch.setattr(export, "output_metadata", broken)
    with pytest.raises(SdplanError, match="before training") as err:
        run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=3"))
    assert "__version__" in str(err.value)
    assert not (out / "loss_history.json").exists() and checkpoint.latest_checkpoint(out) is None
    _no_temp_left(out)


def test_too_little_disk_for_the_outputs_fails_before_any_step(tiny_sd15, images, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = shutil.disk_usage
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(outputs.DiskFull, match=r"^disk full: \d+ bytes needed at ") as err:
        run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=3"))
    assert str(out) in str(err.value) and "1000 bytes free" in str(err.value)
    assert not (out / "loss_history.json").exists()
    _no_temp_left(out)


def test_ctrl_c_in_the_trial_export_leaves_no_folder_and_a_stale_one_goes_at_the_next_start(tmp_path):
    """KeyboardInterrupt is no Exception: a Ctrl-C in the trial export left .export-check-<pid> (a whole model
    copy for a fine-tune), which --force and finished runs kept. Now it goes at once; one a killed start left
    goes at the next start (a folder of the user's with another name stays)."""
    out = tmp_path / "out"

    def interrupted(folder: Path):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        outputs.check_export(interrupted, out)
    assert not list(out.glob(".export-check*"))
    stale = out / ".export-check-12345"  # what a SIGKILL in the trial export leaves
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "unet.safetensors").write_bytes(b"x" * 100)
    (out / ".export-check-mine").mkdir()

    def export(folder: Path):
        folder.mkdir(parents=True)
        (folder / "lora.safetensors").write_bytes(b"x" * 10)

    assert outputs.check_export(export, out) == 10
    assert sorted(p.name for p in out.iterdir()) == [".export-check-mine"]


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.EIO, "^writing the outputs failed after training"),
        (errno.ENOSPC, r"^disk full: \d+ bytes needed at "),
    ],
)
def test_a_failed_final_export_leaves_a_checkpoint_and_resume_only_exports(
    code, said, tiny_sd15, images, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15, images, out, "training.max_steps=3"
    )  # checkpoints.every_steps=0: none planned
    real, calls = export.save_lora, []

    def fails_after_training(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:  # the check at the start passes; the final export fails
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "save_lora", fails_after_training)
    with pytest.raises(SdplanError, match=said) as err:
        run.train(cfg)
    assert "trained state is in checkpoint" in str(err.value)
    saved = checkpoint.latest_checkpoint(out)
    assert saved is not None and str(saved) in str(err.value) and "--resume" in str(err.value)
    assert checkpoint.read_state(saved).global_step == 3
    trained = checkpoint.read_state(saved).losses
    monkeypatch.setattr(export, "save_lora", real)
    summary = run.train(cfg, resume="latest")
    assert summary["steps"] == 3 and losses(out) == trained  # nothing trained again
    assert (out / "pytorch_lora_weights.safetensors").is_file() and (
        out / f"{out.name}.kohya.safetensors"
    ).is_file()
    _no_temp_left(out)


def test_the_final_step_is_checkpointed_before_the_export(tiny_sd15, images, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real, seen = export.save_lora, []

    def record(*args, **kwargs):
        seen.append(checkpoint.latest_checkpoint(out))
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "save_lora", record)
    run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=3", "checkpoints.every_steps=2"))
    assert seen[0] is None  # the check at the start
    assert seen[-1] is not None and checkpoint.read_state(seen[-1]).global_step == 3


def test_a_finished_run_removes_the_interrupt_checkpoint_it_passed(tiny_sd15, images, tmp_path, capsys):
    """Checkpoints off, interrupted after step 1 (interrupt-step-000001, 2 images), resumed to the end: the
    interrupt checkpoint stayed, so a later --resume (or --epochs extension) restarted from step 1, retrained
    what was done and wrote over the finished outputs. The finished run now removes it."""
    out = tmp_path / "out"
    run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=1", "checkpoints.every_steps=1"))
    root = checkpoint.checkpoint_root(out)
    (root / "rolling-step-000001").rename(root / "interrupt-step-000001")  # what a Ctrl-C at step 1 leaves
    run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=3"), resume="latest")
    assert json.loads((out / "run_summary.json").read_text())["steps"] == 3
    assert checkpoint.list_checkpoints(out) == []
    assert (
        f"removed {root / 'interrupt-step-000001'}: older than the finished outputs; a resume from it would "
        "train again" in capsys.readouterr().out
    )


# -- item 6: disk full, half-written checkpoints --------------------------------------------------------------


def test_disk_full_while_checkpointing_is_one_line_and_keeps_the_previous(
    tiny_sd15, images, tmp_path, monkeypatch, capsys
):
    import safetensors.torch
    from sdplan.trainer import plots

    out = tmp_path / "out"
    path = write_cfg(
        tiny_train_config(
            tiny_sd15,
            images,
            out,
            "training.max_steps=6",
            "checkpoints.every_steps=2",
            "logging.tensorboard=true",
        ),
        tmp_path / "c.yaml",
    )
    real, calls = safetensors.torch.save_file, []
    real_close = plots.TensorBoardLogger.close

    def close(tb):  # the same full disk flushing the TensorBoard log: it must not replace the one line
        real_close(tb)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots.TensorBoardLogger, "close", close)

    def full_disk(tensors, filename, *args, **kwargs):
        if checkpoint.CHECKPOINTS in Path(filename).parts:
            calls.append(filename)
            if len(calls) == 2:
                Path(filename).write_bytes(b"\0" * 100)  # part of the file made it
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    capsys.readouterr()
    assert trainer_main(["--config", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: disk full: ") and "Traceback" not in err and len(err.splitlines()) == 1
    assert f"bytes needed at {checkpoint.checkpoint_root(out)}" in err
    kept = checkpoint.latest_checkpoint(out)
    assert kept is not None and kept.name == "rolling-step-000002" and str(kept) in err
    assert checkpoint.verify_checkpoint(kept) is None
    _no_temp_left(out)


def test_a_torch_write_failure_on_a_full_disk_is_named_disk_full(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk as ``unexpected pos``; with too little free space it is a
    full disk, otherwise a write failure naming the path (never the bare RuntimeError)."""
    e = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4800 vs 4736")
    real = shutil.disk_usage
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: real(p)._replace(free=10))
    full = outputs.write_error(e, tmp_path, needed_bytes=5000)
    assert isinstance(full, outputs.DiskFull) and str(full).startswith(
        f"disk full: 5000 bytes needed at {tmp_path}"
    )
    monkeypatch.setattr(outputs.shutil, "disk_usage", real)
    other = outputs.write_error(e, tmp_path, needed_bytes=5000)
    assert isinstance(other, SdplanError) and not isinstance(other, outputs.DiskFull)
    assert str(tmp_path) in str(other) and "unexpected pos" in str(other)
    assert outputs.write_error(ValueError("not a write"), tmp_path, needed_bytes=1) is None


def test_resume_skips_a_half_written_checkpoint_and_says_so(tiny_sd15, images, tmp_path, capsys):
    out = tmp_path / "out"
    run.train(
        tiny_train_config(tiny_sd15, images, out, "training.max_steps=4", "checkpoints.keep_every_steps=2")
    )
    root = checkpoint.checkpoint_root(out)
    first = losses(out)
    half = root / "step-000004" / checkpoint.WEIGHTS_FILE
    half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])
    assert "step-000004" in (checkpoint.verify_checkpoint(root / "step-000004") or "")
    assert checkpoint.verify_checkpoint(root / "step-000002") is None
    capsys.readouterr()
    summary = run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=5"), resume="latest")
    said = capsys.readouterr().out
    assert "step-000004" in said and "incomplete" in said and str(root / "step-000002") in said
    assert summary["steps"] == 5 and losses(out)[:2] == first[:2]
    # Named explicitly, the damaged one is an error that points at the complete one.
    with pytest.raises(SdplanError, match="incomplete") as err:
        checkpoint.resolve_resume(str(root / "step-000004"), out)
    assert "step-000005" in str(err.value) or "step-000002" in str(err.value)


# -- item 10: intermediate outputs ---------------------------------------------------------------------------


def test_lora_every_epoch_loads_and_is_listed(tiny_sd15, images, tmp_path):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        images,
        out,
        "training.max_steps=null",
        "training.epochs=3",  # 4 images, batch 2: 2 steps per epoch
        "output.save_every_n_epochs=1",
        "output.name=shapes",
        "sampling.prompts=[a photo of sks red square]",
        "training.learning_rate=5e-2",
    )
    summary = run.train(cfg)
    listed = summary["intermediate_outputs"]
    assert [(x["epoch"], x["step"]) for x in listed] == [(1, 2), (2, 4)]  # epoch 3 is the final output
    for x in listed:
        folder = out / "intermediate" / f"shapes-{x['epoch']:06d}"
        files = {Path(f) for f in x["files"]}
        assert all(f.parent == folder and f.is_file() for f in files)
        kohya = files - {folder / "pytorch_lora_weights.safetensors", folder / "samples.png"}
        assert len(files) == 3 and len(kohya) == 1  # diffusers, kohya (named by epoch), grid
        assert kohya.pop().name.startswith(f"shapes-{x['epoch']:06d}")
        with Image.open(folder / "samples.png") as im:
            assert im.width == 64 and 64 < im.height < 128  # the image, its label strip under it
            assert json.loads(im.text["sdplan_samples"])["labels"] == [
                f"step {x['step']}\na photo of sks red square"
            ]
    epoch1 = load_file(str(out / "intermediate" / "shapes-000001" / "pytorch_lora_weights.safetensors"))
    final = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert epoch1.keys() == final.keys() and any(not torch.equal(epoch1[k], final[k]) for k in final)
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd15), safety_checker=None)
    pipe.load_lora_weights(str(out / "intermediate" / "shapes-000001"))  # a diffusers user loads it as is
    assert json.loads((out / "run_summary.json").read_text())["intermediate_outputs"] == listed
    with Image.open(out / "samples" / "final.png") as im:
        assert json.loads(im.text["sdplan_samples"])["labels"] == ["step 6\na photo of sks red square"]


def test_an_exact_resume_writes_the_outputs_of_a_step_again_under_their_names(
    tiny_sd15, images, tmp_path, monkeypatch
):
    """A run that saved outputs and a grid at step 4 after its checkpoint at step 3, then crashed, resumed with
    the same settings: step 4 is the same point of the run, yet it was saved again as run-step00000004-1 and
    step-000004-1.png (the suffix is for renumbered resumes), and the first became an orphan. Now they are
    written over; a resume on another batch size still keeps them beside (sampling tests)."""
    monkeypatch.setattr(outputs, "_SAME_STEPS", False)  # the resume sets it: back to the default after
    out = tmp_path / "out"
    opts = (
        "training.max_steps=5",
        "output.save_every_n_steps=2",
        "sampling.every_steps=2",
        "output.name=run",
    )
    run.train(tiny_train_config(tiny_sd15, images, out, *opts, "checkpoints.keep_every_steps=3"))
    kept = checkpoint.checkpoint_root(out) / "step-000003"
    summary = run.train(tiny_train_config(tiny_sd15, images, out, *opts), resume=str(kept))
    assert sorted(p.name for p in (out / "intermediate").iterdir()) == [
        "run-step00000002",
        "run-step00000004",
    ]
    assert sorted(p.name for p in (out / "samples").iterdir()) == [
        "final.png",
        "step-000002.png",
        "step-000004.png",
    ]
    assert [o["step"] for o in summary["intermediate_outputs"]] == [2, 4]


def test_a_run_extended_on_resume_saves_the_step_it_resumes_at(tiny_sd15, images, tmp_path, monkeypatch):
    """`--resume --epochs 3` of a finished 2-epoch run with output.save_every_n_epochs=1 kept no epoch 2: the loop
    saves the steps after the one it starts at, and the final outputs of epoch 2 were written over by epoch 3's.
    Now the step it resumes at, due a save, is saved first from the weights just loaded."""
    from safetensors.torch import load_file

    monkeypatch.setattr(outputs, "_SAME_STEPS", False)  # the resume sets it: back to the default after
    out = tmp_path / "out"
    opts = (
        "training.max_steps=null",
        "output.save_every_n_epochs=1",  # 4 images, batch 2: 2 steps per epoch
        "output.name=shapes",
        "checkpoints.every_steps=2",
        "training.learning_rate=5e-2",
    )
    run.train(tiny_train_config(tiny_sd15, images, out, *opts, "training.epochs=2"))
    epoch2 = load_file(str(out / "pytorch_lora_weights.safetensors"))
    with Image.open(out / "samples" / "final.png") as im:
        final_grid = im.tobytes()
    ckpt = str(checkpoint.latest_checkpoint(out))
    extended = tiny_train_config(tiny_sd15, images, out, *opts, "training.epochs=3")

    # a save that fails (or is cut off) is not taken as done by the next resume: the checkpoint's record is
    real_save, tried = export.save_lora, []

    def failing(folder, *a, **k):  # the pre-loop save's export, not the check before training
        if outputs.INTERMEDIATE in Path(folder).parts:
            tried.append(folder)
            raise OSError(5, "Input/output error")
        return real_save(folder, *a, **k)

    monkeypatch.setattr(export, "save_lora", failing)
    with pytest.raises(SdplanError):
        run.train(extended, resume=ckpt)
    assert tried  # it failed where meant to
    monkeypatch.setattr(export, "save_lora", real_save)

    made = []
    real_grid = sampling.sample_grid
    monkeypatch.setattr(sampling, "sample_grid", lambda *a, **k: made.append(1) or real_grid(*a, **k))
    summary = run.train(extended, resume=ckpt)
    assert sorted(p.name for p in (out / "intermediate").iterdir()) == ["shapes-000001", "shapes-000002"]
    assert [(o["epoch"], o["step"]) for o in summary["intermediate_outputs"]] == [(1, 2), (2, 4)]
    saved = load_file(str(out / "intermediate" / "shapes-000002" / "pytorch_lora_weights.safetensors"))
    assert saved.keys() == epoch2.keys() and all(torch.equal(saved[k], epoch2[k]) for k in saved)
    final = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert any(not torch.equal(final[k], epoch2[k]) for k in final)  # epoch 3 trained on
    # the epoch-2 grid is the earlier session's final grid, copied: only this session's final grid is sampled
    assert len(made) == 1
    with Image.open(out / "intermediate" / "shapes-000002" / "samples.png") as im:
        assert im.tobytes() == final_grid


# a save at every step and a grid every other one, over 4 steps (the grids tests count what is sampled)
SAVES_EVERY_STEP_GRIDS_EVERY_OTHER = (
    "training.max_steps=4",
    "output.save_every_n_steps=1",
    "sampling.every_steps=2",
    "output.name=run",
)


def _counted_grids(monkeypatch) -> list[str]:
    """The grids sampled from now on, by their first label line ("step 2"), as sampling.sample_grid makes them."""
    made: list[str] = []
    real = sampling.sample_grid

    def counted(pipe, prompts, **kw):
        made.append(kw["labels"][0].split("\n")[0])
        return real(pipe, prompts, **kw)

    monkeypatch.setattr(sampling, "sample_grid", counted)
    return made


def test_a_grid_is_sampled_once_at_a_step_that_saves_and_never_twice_at_the_last(
    tiny_sd15, images, tmp_path, monkeypatch
):
    """sampling.every_steps and output.save_every_n_steps on the same step sampled the same grid (prompts, seed,
    weights) twice, once for samples/ and once for the save's folder, and the last step's every-N grid was the
    final grid again: minutes a grid on SD3.5 / FLUX.1. The save now copies the step's grid, and the last step's
    is the final grid's copy (planner.sampled_images counts them so); TensorBoard shows each grid once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sdplan import planner
    from sdplan.steps import plan_steps

    made = _counted_grids(monkeypatch)
    out = tmp_path / "out"
    opts = SAVES_EVERY_STEP_GRIDS_EVERY_OTHER
    opts += ("sampling.prompts=[a red square]", "logging.tensorboard=true")
    run.train(tiny_train_config(tiny_sd15, images, out, *opts))
    assert made == ["step 1", "step 2", "step 3", "step 4"]  # saves at 1-3 (2 copied), the final grid at 4
    samples = out / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["final.png", "step-000002.png", "step-000004.png"]
    assert (samples / "step-000004.png").read_bytes() == (samples / "final.png").read_bytes()
    copied = out / "intermediate" / "run-step00000002" / "samples.png"
    assert copied.read_bytes() == (samples / "step-000002.png").read_bytes()
    assert (out / "intermediate" / "run-step00000003" / "samples.png").is_file()
    events = EventAccumulator(str(out / "logs")).Reload()
    # each grid sampled once, 4 by the final grid (the log closed before it did), no copy again; at the images
    # seen (batch 2: steps 1-4 are 2, 4, 6, 8), as the loss's points
    assert [e.step for e in events.Images("samples")] == [2, 4, 6, 8]
    req = planner.Request(method="lora", sample_prompts=1, sample_every_steps=2, save_every_steps=1)
    counts = planner.sampled_images(req, plan_steps(images_per_epoch=4, batch_size=2, max_steps=4))
    assert counts.during + counts.final == len(made)


def test_saves_get_the_caption_grid_without_prompts_as_every_n_and_final_grids_do(
    tiny_sd15, images, tmp_path, monkeypatch
):
    """With sampling.prompts empty (the default: the grids show a caption) the every-N and final grids were
    drawn but the intermediate saves got no samples.png: save_intermediate looked at sampling.prompts, not at
    whether a grid is made. Each save has its grid (copied at an every-N step), and the planner counts them."""
    from sdplan import planner
    from sdplan.steps import plan_steps

    made = _counted_grids(monkeypatch)
    out = tmp_path / "out"
    opts = SAVES_EVERY_STEP_GRIDS_EVERY_OTHER
    run.train(tiny_train_config(tiny_sd15, images, out, *opts))
    assert made == ["step 1", "step 2", "step 3", "step 4"]  # saves at 1-3 (2 copied), the final grid at 4
    samples = out / "samples"
    for step in (1, 2, 3):
        assert (out / "intermediate" / f"run-step{step:08d}" / "samples.png").is_file(), step
    copied = out / "intermediate" / "run-step00000002" / "samples.png"
    assert copied.read_bytes() == (samples / "step-000002.png").read_bytes()
    req = planner.Request(method="lora", sample_prompts=0, sample_every_steps=2, save_every_steps=1)
    counts = planner.sampled_images(req, plan_steps(images_per_epoch=4, batch_size=2, max_steps=4))
    assert counts.during + counts.final == len(made)


def test_a_failed_grid_copy_is_a_skipped_grid_and_a_full_disk_stops_the_run(tmp_path, capsys):
    """Copying a grid where it is due again: a failure other than a full disk is one line, as a failed
    sampling is (the run goes on); a full disk is the run's one-line DiskFull; nothing half-written stays."""
    grid = tmp_path / "grid.png"
    Image.new("RGB", (4, 4)).save(grid)
    accelerator = type("A", (), {"is_main_process": True})()
    target = tmp_path / "saved" / "samples.png"
    assert outputs.copy_grid(accelerator, grid, target) == target and target.read_bytes() == grid.read_bytes()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder is wanted")
    assert outputs.copy_grid(accelerator, grid, blocked / "samples.png") is None
    assert "skipped the copy of sample grid" in capsys.readouterr().out

    def full(src, dst):
        Path(dst).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(outputs.shutil, "copyfile", full)
        with pytest.raises(outputs.DiskFull):
            outputs.copy_grid(accelerator, grid, tmp_path / "full" / "samples.png")
    assert not list((tmp_path / "full").iterdir())


@pytest.mark.parametrize("method", ["textual-inversion", "finetune"])
def test_other_methods_every_n_steps(method, tiny_sd15, images, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        images,
        out,
        f"method={method}",
        "textual_inversion.token=<obj>",
        "textual_inversion.init_token=square",
        "training.max_steps=3",
        "output.save_every_n_steps=2",
        "output.name=obj",
    )
    summary = run.train(cfg)
    (only,) = summary["intermediate_outputs"]
    folder = out / "intermediate" / "obj-step00000002"
    assert only["step"] == 2 and only["epoch"] == 1.0
    files = [Path(f) for f in only["files"]]  # no sampling prompts: a grid of a caption, as the final one
    assert all(f.parent == folder and f.exists() for f in files)
    assert folder / "samples.png" in files
    if method == "finetune":
        from diffusers import UNet2DConditionModel

        assert sorted(f.name for f in files) == ["model", "obj-step00000002.safetensors", "samples.png"]
        UNet2DConditionModel.from_pretrained(str(folder / "model"), subfolder="unet")
    else:
        from diffusers import StableDiffusionPipeline

        (embedding,) = [f for f in files if f.name != "samples.png"]
        pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd15), safety_checker=None)
        export.load_embedding(pipe, embedding, "<obj>")


def test_no_intermediate_outputs_unless_asked(tiny_sd15, images, tmp_path):
    out = tmp_path / "out"
    summary = run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=2"))
    assert summary["intermediate_outputs"] == [] and not (out / "intermediate").exists()


# -- item 11: labelled grids ---------------------------------------------------------------------------------


def test_grid_labels_sit_under_the_images_and_show_where_prompts_differ():
    """At 64 px the label drawn over the image ("step 16 / a photo of...") covered 40% of it and cut the prompt
    where the demo's four differ ("red square", "blue circle"). The labels now sit in a strip under each image,
    at a readable size, and a prompt too long for its lines keeps its end."""
    from PIL import ImageDraw

    cells = [Image.new("RGB", (64, 64), (90, 90, 90)) for _ in range(2)]
    labels = ["step 16\na photo of sks red square", "step 16\na photo of sks blue circle"]
    plain = sampling.make_grid(cells, cols=2)
    labelled = sampling.make_grid(cells, cols=2, labels=labels)
    assert plain.size == (128, 64) and labelled.width == 128 and 64 + 3 * 11 <= labelled.height < 128
    a, b = (torch.from_numpy(__import__("numpy").array(g)) for g in (plain, labelled))
    assert torch.equal(a, b[:64])  # the images untouched
    assert int(b[64:].max()) == 255  # the text, under them
    font = sampling._font(11, "".join(labels))
    draw = ImageDraw.Draw(labelled)
    for label in labels:
        lines = sampling._wrap(draw, font, label, 60, 3)
        assert lines[0] == "step 16" and len(lines) == 3, lines
        assert lines[1].startswith(sampling.ELLIPSIS) and " ".join(lines).endswith(label.split("sks ")[1])
        assert all(draw.textlength(line, font=font) <= 60 for line in lines)
    # a prompt that fits keeps all of it; the lines above a cut prompt keep their start
    assert sampling._wrap(draw, font, "step 2\nsks dog", 60, 3) == ["step 2", "sks dog"]
    wide = sampling._wrap(draw, font, "step_1234567890123\nsks dog", 60, 3)
    assert wide[0].startswith("step_1") and wide[0].endswith(sampling.ELLIPSIS) and wide[1:] == ["sks dog"]


def test_grid_labels_take_a_font_that_has_their_characters():
    """PIL's own font has 113 glyphs: an accent, Cyrillic or Chinese in a prompt drew as a box. The labels take
    DejaVu Sans (it ships with matplotlib) where it has every character, else an installed font that has them
    (here one more of matplotlib's own: STIX has U+1D81, DejaVu Sans does not), else DejaVu Sans."""

    def needed(text):
        return frozenset(ord(c) for c in text if not c.isspace())

    for text in ("a photo of sks dog", "une photo de café crème", "фото кота", "αβγ"):
        assert sampling._font(20, text).getname()[0] == "DejaVu Sans"
        assert needed(text) <= sampling._charmap(sampling._font_paths(needed(text))[0])
    rare = "a \u1d81"
    path = sampling._font_paths(needed(rare))[0]
    assert needed(rare) <= sampling._charmap(path) and sampling._font(20, rare).getname()[0] != "DejaVu Sans"
    nowhere = "\U0010fffd"  # a private-use character no font has: DejaVu Sans, a box, no error
    assert sampling._font(20, nowhere).getname()[0] == "DejaVu Sans"
    cells = [Image.new("RGB", (64, 64), (90, 90, 90)) for _ in range(2)]
    assert sampling.make_grid(cells, cols=2, labels=["猫 café", nowhere]).width == 128


def test_each_grid_label_takes_a_font_that_has_its_own_characters(monkeypatch):
    """One font was chosen for all the labels of a grid: a character no font has in one label (here a private-use
    one; an emoji on a machine with a CJK font) sent every label to DejaVu Sans, and a label another installed
    font draws (here STIX's U+1D81; Chinese with Noto Sans CJK) became boxes. Each label takes its own."""
    used = []
    font_of = sampling._font

    def spy(size, text=""):
        font = font_of(size, text)
        used.append((text.removesuffix(sampling.ELLIPSIS), font.getname()[0]))
        return font

    monkeypatch.setattr(sampling, "_font", spy)
    rare, nowhere = "step 2\na \u1d81", "step 2\n\U0010fffd"
    cells = [Image.new("RGB", (64, 64), (90, 90, 90)) for _ in range(2)]
    assert sampling.make_grid(cells, cols=2, labels=[rare, nowhere]).width == 128
    fonts = dict(used)
    assert fonts[nowhere] == "DejaVu Sans" and fonts[rare] != "DejaVu Sans", used


def test_a_label_font_that_cannot_be_opened_gives_way_to_the_next(monkeypatch, tmp_path):
    """A listed font FreeType cannot open at the size (a colour-emoji font has one size only): the next one."""
    broken = tmp_path / "emoji.ttf"
    broken.write_bytes(b"not a font")
    dejavu = sampling._font_paths(frozenset(map(ord, "a")))[0]
    monkeypatch.setattr(sampling, "_font_paths", lambda codepoints: (str(broken), dejavu))
    assert sampling._font(20, "a \U0001f431").getname()[0] == "DejaVu Sans"


def test_a_survivor_of_a_lost_peer_prints_one_line_not_a_traceback(monkeypatch, capsys):
    """A process killed mid-run (the kernel's out-of-memory killer) left the others' collective raising gloo's
    RuntimeError ("Connection closed by peer"): each survivor printed a 30-line traceback. Now rank 0 says it in
    one line and every survivor exits 1; any other RuntimeError, or one outside a multi-process run, still
    raises."""
    import torch
    from sdplan.trainer import run

    from sdplan import config

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:59602. This is typically caused by a remote worker crashing."
    )
    raised: list[BaseException] = []

    def train(cfg, resume=None):
        raise raised[-1]

    monkeypatch.setattr(config, "load", lambda *a, **k: config.TrainConfig())
    monkeypatch.setattr(run, "train", train)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    raised.append(RuntimeError(gloo))
    capsys.readouterr()
    assert trainer_main(["--config", "x.yaml"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: another process of this run stopped, or the network between them failed (Connection closed by "
        "peer [127.0.0.1]:59602); this one stopped too"
    ], err
    monkeypatch.setenv("RANK", "1")
    assert trainer_main(["--config", "x.yaml"]) == 1 and not capsys.readouterr().err  # rank 0 says it
    if hasattr(torch.distributed, "DistBackendError"):  # NCCL's: its peer's exit, not a set-up error
        raised.append(  # as NCCL words it (NVIDIA/nccl issues 2076, 1141; pytorch issue 111187)
            torch.distributed.DistBackendError(
                "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there "
                "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
                "network error or a remote process exiting prematurely."
            )
        )
        monkeypatch.setenv("RANK", "0")
        capsys.readouterr()
        assert trainer_main(["--config", "x.yaml"]) == 1
        line = capsys.readouterr().err.strip()
        assert "(NCCL: remote process exited or there was a network error)" in line and "\n" not in line, line
        raised.append(torch.distributed.DistBackendError("NCCL error: unhandled cuda error"))
        with pytest.raises(torch.distributed.DistBackendError, match="unhandled cuda error"):
            trainer_main(["--config", "x.yaml"])
    raised.append(RuntimeError("shape mismatch"))  # a real bug: its traceback
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer_main(["--config", "x.yaml"])
    monkeypatch.setenv("WORLD_SIZE", "1")
    raised.append(RuntimeError(gloo))  # one process: not a lost peer
    with pytest.raises(RuntimeError, match="Connection closed"):
        trainer_main(["--config", "x.yaml"])


# -- the disk the saves to come need ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, expected",
    [
        # kept every 100 steps, rolling every 50, a rolling checkpoint of step 50 on the disk: each kept one
        # supersedes the rolling one before it; the peak is the last kept one being written (3 kept before it,
        # 10 bytes each), then the final export (1 byte)
        (dict(keep=100, every=50, free=10**6), (40, None, 4, 1)),
        (dict(keep=100, every=50, free=25), (40, 300, 4, 1)),  # 3 kept beside the 4th's write: 30 > 25
        # rolling only: one beside the other while it is written; the final outputs after it
        (dict(keep=0, every=50, free=10**6), (10, None, 0, 1)),
        (dict(keep=0, every=50, free=9), (10, 100, 0, 1)),
        # checkpoints off (a resume from another run's checkpoint): intermediate outputs every 100 steps (3
        # before the last, 4 bytes each), no checkpoint, then the final outputs (12 + 4)
        (dict(keep=0, every=0, free=10**6, exports=[100, 200, 300], export=4), (16, None, 0, 4)),
        (dict(keep=0, every=0, free=13, exports=[100, 200, 300], export=4), (16, 400, 0, 4)),
        # a resume's save of the step it starts at comes first; a run extended on resume replaces its final
        # outputs (net: nothing)
        (dict(keep=0, every=50, free=10**6, now=1, export=4), (14, None, 0, 2)),
        (dict(keep=0, every=50, free=3, now=1, export=4), (14, 50, 0, 2)),
        (dict(keep=0, every=50, free=10**6, final=0), (10, None, 0, 1)),
    ],
)
def test_disk_ahead_walks_the_saves_to_come(case, expected):
    """The saves after step 50 of 400, in the loop's order: a kept checkpoint stays, a rolling one replaces the
    one before it once written, the final step gets a checkpoint and the final outputs."""
    ahead = checkpoint.disk_ahead(
        after=50,
        total_steps=400,
        every_steps=case["every"],
        keep_every_steps=case["keep"],
        checkpoint_bytes=10,
        rolling_on_disk=True,
        export_steps=case.get("exports", []),
        export_bytes=case.get("export", 1),
        free_bytes=case["free"],
        exports_now=case.get("now", 0),
        final_export_bytes=case.get("final"),
    )
    assert (ahead.need_bytes, ahead.fill_step, ahead.kept, ahead.exports) == expected


def test_a_first_checkpoint_at_the_last_step_leaves_the_final_outputs_to_come():
    ahead = checkpoint.disk_ahead(
        after=400,
        total_steps=400,
        every_steps=400,
        keep_every_steps=0,
        checkpoint_bytes=10,
        rolling_on_disk=True,
        export_steps=[],
        export_bytes=4,
        free_bytes=3,
    )
    assert (ahead.need_bytes, ahead.fill_step, ahead.kept, ahead.exports) == (4, 400, 0, 1)


def test_a_run_whose_kept_checkpoints_will_fill_the_disk_says_so_at_its_first(
    tiny_sd15, images, tmp_path, monkeypatch, capsys
):
    """checkpoints.keep_every_steps keeps every checkpoint: a full fine-tune's are tens of GB each, and the run
    that fills the disk stops hours in. At its first checkpoint (its size measured) the run says at which step
    the disk fills and what to change, and trains on."""
    out = tmp_path / "out"
    real_free = outputs.free_bytes
    first: list[int] = []

    def free(path):  # the checkpoints' disk: room for one more checkpoint, not two
        root = checkpoint.checkpoint_root(out)
        if Path(path) != root:
            return real_free(path)
        if not first:
            first.append(outputs.tree_bytes(checkpoint.latest_checkpoint(out)))
        return int(first[0] * 1.5)

    monkeypatch.setattr(outputs, "free_bytes", free)
    opts = ("training.max_steps=4", "checkpoints.every_steps=0", "checkpoints.keep_every_steps=1")
    summary = run.train(tiny_train_config(tiny_sd15, images, out, *opts))
    assert summary["steps"] == 4
    said = capsys.readouterr().out
    assert said.count("warning:") == 1, said
    line = next(x for x in said.splitlines() if x.startswith("warning:"))
    assert "3 kept checkpoints of" in line and "(checkpoints.keep_every_steps=1)" in line
    assert "the disk fills at step 3 of 4" in line and "keep fewer checkpoints" in line


def test_a_run_with_room_for_its_saves_says_nothing_of_the_disk(tiny_sd15, images, tmp_path, capsys):
    out = tmp_path / "out"
    opts = ("training.max_steps=2", "checkpoints.every_steps=1")
    run.train(tiny_train_config(tiny_sd15, images, out, *opts))
    assert "warning:" not in capsys.readouterr().out


def test_a_resume_measures_the_disk_of_the_runs_checkpoints_not_of_the_one_it_starts_from(
    tiny_sd15, images, tmp_path, monkeypatch, capsys
):
    """A resume from a checkpoint copied elsewhere (another disk) is checked at once, against the free space where
    this run's checkpoints go."""
    out = tmp_path / "out"
    opts = ("checkpoints.every_steps=0", "checkpoints.keep_every_steps=1")
    run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=2", *opts))
    elsewhere = tmp_path / "copied" / "step-000002"
    shutil.copytree(checkpoint.latest_checkpoint(out), elsewhere)
    size = outputs.tree_bytes(elsewhere)
    real_free = outputs.free_bytes
    asked = []

    def free(path):
        asked.append(Path(path))
        return int(size * 1.5) if Path(path) == checkpoint.checkpoint_root(out) else real_free(path)

    monkeypatch.setattr(outputs, "free_bytes", free)
    capsys.readouterr()
    run.train(tiny_train_config(tiny_sd15, images, out, "training.max_steps=4", *opts), resume=str(elsewhere))
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert len(lines) == 1 and f"on the disk of {checkpoint.checkpoint_root(out)}" in lines[0], lines
    assert "2 kept checkpoints of" in lines[0] and "the disk fills at step 4 of 4" in lines[0]
    assert elsewhere.parent not in asked


def test_a_cpu_runs_offloaded_optimizer_state_is_refused_by_a_gpu_run_in_one_line(tmp_path):
    """A CPU run's DeepSpeed offload runs torch's AdamW (sdplan.launch); a GPU run's runs DeepSpeed's CPU Adam,
    which stopped at its first step with KeyError 'bias_correction' on that state. The other way round loads, and
    a checkpoint of an earlier version (nothing recorded: DeepSpeed's CPU Adam) is not refused."""
    cpu = checkpoint.TrainState(settings={checkpoint.OFFLOADED_OPTIMIZER: "torch AdamW"})
    gpu = checkpoint.TrainState(settings={checkpoint.OFFLOADED_OPTIMIZER: "DeepSpeed CPU Adam"})
    err = checkpoint.offloaded_optimizer_change(tmp_path, cpu, "DeepSpeed CPU Adam")
    assert err is not None and "cannot be loaded" in str(err) and "training.device=cpu" in str(err.fix)
    assert checkpoint.offloaded_optimizer_change(tmp_path, gpu, "torch AdamW") is None
    assert (
        checkpoint.offloaded_optimizer_change(tmp_path, checkpoint.TrainState(), "DeepSpeed CPU Adam") is None
    )
    assert (
        checkpoint.offloaded_optimizer_change(tmp_path, cpu, None) is None
    )  # no offload now: DeepSpeed's check
