"""Resuming a DeepSpeed ZeRO-2 checkpoint (optimizer state offloaded) with another process count, launched as
`sdplan train` launches it on DeepSpeed's CPU accelerator: 1 process -> 2 here (2 -> 1: the 2-process DeepSpeed run
of tests/test_trainer.py resumes on 1). The resumed run is the same run as the DDP resume across the same process
counts (tests/test_resume_multi.py): the position (steps, images seen), the losses and the LoRA weights, so the
weights and Adam's moments and step carried over."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import (
    assert_same_resume,
    losses,
    make_images,
    run_position,
    step_history,
    tiny_train_config,
    train_two_processes,
    trains_in_process,
)
from limits import scaled
from sdplan.trainer import checkpoint, run

# extended: `make test-all` runs it, `make test` (CI) does not: test_trainer.py's DeepSpeed run resumes 2 -> 1 through
# the same universal checkpoint; this one adds the other direction and a decaying schedule with warmup
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.train, trains_in_process]

# 8 images x 2 epochs = 16, batch 2: 4 steps/epoch on one process, 2 on two. A decaying rate: DeepSpeed's load
# wrote the checkpoint's decayed rate into the groups the resume read its configured rates from (5x too low).
# With warmup: a group's rate is the schedule's step-0 value (0), which the resume took as the configured rate.
OPTS = (
    "training.max_steps=null",
    "training.epochs=2",
    "training.lr_scheduler=linear",
    "training.lr_warmup_steps=2",
)
DEEPSPEED = ("distributed.deepspeed.zero_stage=2", "distributed.deepspeed.offload_optimizer=true")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "flat", n=8)


def config_file(model: Path, data: Path, out: Path, *extra: str) -> Path:
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(tiny_train_config(model, data, out, *OPTS, *extra).to_dict()))
    return path


def deepspeed_run(model: Path, data: Path, out: Path, processes: int, *args: str, extra=()) -> str:
    """A DeepSpeed run of ``processes`` CPU processes as `sdplan train` launches it; its stdout."""
    pytest.importorskip("deepspeed")
    from sdplan.launch import build_launch, free_port
    from sdplan.launcher import write_run_files

    cfg = tiny_train_config(
        model, data, out, *OPTS, *DEEPSPEED, f"distributed.num_processes={processes}", *extra
    )
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    # a fresh port each time: accelerate launch's own fallback races with a launch beside it
    ln = build_launch(
        cfg, path, out, cpu_processes=processes, cpu_cores=processes, main_process_port=free_port()
    )
    write_run_files(out, cfg, ln, "test")
    proc = subprocess.run(
        ln.cmd + list(args),
        env={**os.environ, **ln.env},
        cwd=out.parent,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # library notes of no news (sdplan.quiet): torch's deprecation of the all-gather ZeRO calls each step (about
    # once per step and process), DeepSpeed's tensor-parallel note as a ZeRO checkpoint loads
    said = proc.stdout + proc.stderr
    assert "all_gather_into_tensor" not in said and "MPU is not provided" not in said, said[-3000:]
    return proc.stdout


def test_one_deepspeed_process_resumed_on_two(tiny_sd15, images, tmp_path):
    """A 1-process ZeRO-2 run trains as the plain run does; its checkpoint after step 2 (4 of 16 images)
    resumed on 2 processes: step 1 of the 2-process run's 4, the other 12 images trained, as the DDP checkpoint
    resumes."""
    first = tmp_path / "first"
    deepspeed_run(tiny_sd15, images, first, 1, extra=("checkpoints.keep_every_steps=2",))
    kept = checkpoint.checkpoint_root(first) / "step-000002"
    assert checkpoint.read_state(kept).images_seen == 4

    two = tmp_path / "two"
    out = deepspeed_run(tiny_sd15, images, two, 2, "--resume", str(kept))
    assert "DeepSpeed's universal checkpoint" in out and "resumed from" in out
    assert run_position(two) == (2, 4, 16)
    assert step_history(two) == ([1, 2, 2, 3, 4], [2, 4, 8, 12, 16])
    assert losses(two)[:2] == losses(first)[:2]

    ddp_first, ddp_two = tmp_path / "ddp-first", tmp_path / "ddp-two"
    run.train(tiny_train_config(tiny_sd15, images, ddp_first, *OPTS, "checkpoints.keep_every_steps=2"))
    # one DeepSpeed process (optimizer state offloaded, stepped by DeepSpeed's CPU Adam) trains as the plain run
    assert losses(first) == pytest.approx(losses(ddp_first), rel=1e-5)
    ddp_kept = checkpoint.checkpoint_root(ddp_first) / "step-000002"
    train_two_processes(config_file(tiny_sd15, images, ddp_two), tmp_path, "--resume", str(ddp_kept))
    assert_same_resume(ddp_two, two)
