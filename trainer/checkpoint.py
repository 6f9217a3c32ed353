"""Training checkpoints: rolling, kept, and on interrupt/failure; each written atomically; exact resume.

Layout under ``{output.dir}/checkpoints/``:

- ``rolling-step-000300``: every ``checkpoints.every_steps``; a new one replaces the previous (the old one is
  deleted only after the new one is complete).
- ``step-000500``: every ``checkpoints.keep_every_steps``; never deleted (it replaces the rolling one before it).
  A resume on another process count, micro-batch or accumulation numbers its steps anew, so its step 500 can be
  another point of the run than an earlier session's: a kept (or before-NaN) checkpoint an earlier session
  wrote is never replaced, the new one is ``step-000500-1`` (``-2``, ...), as grids and intermediate outputs are.
- ``interrupt-step-000123``: on SIGINT/SIGTERM or an exception; ``before-nan-step-000041`` when the loss
  turned NaN/inf (the weights from before that step; none at step 1 of a run from the base model: nothing
  was trained). A run that finishes removes the rolling and interrupt
  checkpoints it has passed (:func:`remove_passed`; with checkpoints off nothing else would).

Each is written by ``accelerator.save_state`` into ``checkpoints/.tmp-<name>`` and then renamed: a kill while
writing leaves a ``.tmp-`` folder that is ignored (and cleaned up next time) and the previous checkpoint intact.
``train_state.json`` is written last inside the temp folder, so a folder without it is never used; it lists
every file with its size (``files``) and its sha256 (``sha256``, :func:`file_digest`), so a checkpoint whose
files were cut short later (a copy that stopped, a disk that lost the last writes) or damaged at the same size
(a bad copy, a bad disk: damaged weights trained on into a NaN blamed on the learning rate) is found by
:func:`verify_checkpoint`, and ``--resume latest`` then falls back to the newest complete one and says so. A write that fails (a full disk) removes the temp folder, keeps the
previous checkpoint and is one line: "disk full: N bytes needed at PATH".

Contents: the trainable weights only (``trainable.safetensors``: LoRA, the TI embedding rows or the full UNet /
text encoder, via the save/load hooks below; DeepSpeed keeps its own model files), the optimizer, the LR
scheduler and any registered object (EMA), accelerate's RNG states, and ``train_state.json`` (global step, epoch,
batches consumed in that epoch, images seen, loss history with each step's number and images seen). Together with the epoch-seeded batch order and the
per-step noise seeds (``runtime.seed_step``) this makes a resumed run's losses equal an uninterrupted run's.
A resume with another process count (or micro-batch, or accumulation) continues at the images the checkpoint
had trained, in this run's steps (:func:`resume_position`); a DeepSpeed checkpoint (one ZeRO optimizer shard per
process, which DeepSpeed's engine loads into as many processes only) is then converted to DeepSpeed's universal
checkpoint and loaded from that (:func:`deepspeed_universal_resume`). "Newest" (``--resume latest``, which
checkpoints a new one replaces) means most images seen: a step number counts the steps of the process count
that wrote it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdplan.errors import SdplanError, UsageError
from sdplan.steps import Position, Steps, legacy_epoch_images, moved_position

CHECKPOINTS = "checkpoints"
# accelerate's folder for the DeepSpeed engine's files in a checkpoint (accelerate.utils.MODEL_NAME)
DEEPSPEED_DIR = "pytorch_model"
STATE_FILE = "train_state.json"
WEIGHTS_FILE = "trainable.safetensors"
_NAME = re.compile(r"^(rolling-step|step|interrupt-step|before-nan-step)-(\d+)(?:-\d+)?$")
_REPLACEABLE = ("rolling-step", "interrupt-step")  # a newer rolling or kept checkpoint removes these
# The TrainState fields that are this run's settings, not its progress: a resume keeps the live ones.
_SETTINGS = (
    "batch_size",
    "order_batch_size",
    "grad_accum",
    "num_processes",
    "method",
    "samples_per_epoch",
    "settings",
)
# The TrainState fields that are the history of the run that wrote the checkpoint (its outputs, its skipped grids
# with their paths in its folder, its time): a resume of that run keeps them; a new run started from the checkpoint
# (checkpoints.resume of a checkpoint outside its own checkpoints folder) starts them empty.
_RUN_HISTORY = ("intermediate_outputs", "sample_grid_failures", "wall_seconds", "sampling_seconds")


def start_over(out_dir: str | Path) -> str:
    """What to do when no checkpoint can be resumed from: `sdplan train` starts a run over in its folder with
    --force (without --resume it is refused: the folder holds a run; with no --model/--dataset/--config it reads
    the run's sdplan.yaml); the trainer's own command line drops --resume."""
    return (
        f"start it over: `sdplan train --force --out {shlex.quote(str(out_dir))}` instead of --resume; with the "
        "trainer's own command, drop --resume"
    )


class CheckpointError(SdplanError):
    exit_code = 2


@dataclass
class TrainState:
    """Where the run is. ``batches_in_epoch``: micro-batches each process has consumed in ``epoch`` (at an
    optimizer-step boundary); ``images_in_epoch`` the images behind them on all the processes together (the
    position of a resume with another micro-batch), ``samples_in_epoch`` on this process alone (the checkpoint
    is the first process's: all a checkpoint saved before ``images_in_epoch`` has, None in it)."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    samples_in_epoch: int = 0
    images_in_epoch: int | None = 0
    images_seen: int = 0
    # The loss history, one entry per optimizer step taken: its mean loss, its number in the run that took it
    # and the images seen once it was taken (see :meth:`record_loss`).
    losses: list[float] = field(default_factory=list)
    loss_steps: list[int] = field(default_factory=list)
    loss_images: list[int] = field(default_factory=list)
    # The settings the position depends on; a resume with other values maps the position by images.
    batch_size: int = 1
    grad_accum: int = 1
    num_processes: int = 1
    method: str = ""
    # The batch the sampler cut the epochs at (trainer/buckets.py): the micro-batch, or a multiple of it that
    # a resume at a smaller one kept. Not given (0; a checkpoint saved before it was kept): the micro-batch.
    order_batch_size: int = 0
    # The fingerprint of its epoch's order of images (BucketBatchSampler.order_digest); "" in one saved before.
    epoch_order: str = ""
    # The dataset's samples per epoch (with repeats) the run had; 0 in a checkpoint saved before it was kept.
    samples_per_epoch: int = 0
    # Outputs saved during training so far (output.save_every_n_*): [{"epoch", "step", "files"}].
    intermediate_outputs: list[dict[str, Any]] = field(default_factory=list)
    # Sample grids skipped for an error other than out of memory so far (outputs.samples' records): run_summary's
    # sample_grid_failures, over the run's sessions.
    sample_grid_failures: list[dict[str, Any]] = field(default_factory=list)
    # The run's wall-clock seconds before this session: in a checkpoint, from the run's start to that checkpoint
    # (each earlier session counted up to the checkpoint it left); live, what the resumed checkpoint said.
    wall_seconds: float = 0.0
    # Of those, the seconds spent sampling images besides training (DreamBooth's class images, sample grids):
    # run_summary's sampling_seconds, what the planner's sampling time predicts (planner.sampling_seconds)
    sampling_seconds: float = 0.0
    # The settings the checkpoint's weights and saved state were made with (sdplan.settings.checkpoint_settings):
    # a new run that starts from it (checkpoints.resume) is checked against them; {} in one saved before.
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.order_batch_size = self.order_batch_size or self.batch_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainState:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        state = cls(**known)
        if "images_in_epoch" not in data:  # saved before it was kept: the epoch's images on one process only
            state.images_in_epoch = None
        n = len(state.losses)
        if len(state.loss_steps) != n or len(state.loss_images) != n:
            # A checkpoint written before the history kept its steps and images: its steps were numbered
            # 1..n and its images are spread evenly up to the images it had seen (exact without epoch ends
            # that close a short step, or a resume with other settings before it).
            state.loss_steps = list(range(1, n + 1))
            state.loss_images = [round(state.images_seen * (i + 1) / n) for i in range(n)]
        return state

    def start_epoch(self, epoch: int) -> None:
        """The run is at the start of ``epoch``."""
        self.epoch, self.batches_in_epoch, self.samples_in_epoch, self.images_in_epoch = epoch, 0, 0, 0

    def record_loss(self, step: int, loss: float) -> None:
        """Step ``step`` (this run's number) was taken with mean loss ``loss``; call after ``images_seen``
        counts its images. After a resume with another process count, micro-batch or accumulation the steps
        continue at the step :func:`sdplan.steps.moved_position` gives (this run's steps, so a step number
        can repeat or jump where the settings changed); the images seen always grow, which is what the
        curve's x axis is."""
        self.losses.append(loss)
        self.loss_steps.append(step)
        self.loss_images.append(self.images_seen)

    def loss_history(self) -> dict[str, list]:
        """``loss_history.json``'s content: ``steps``, ``images_seen`` and ``losses``, one entry per step."""
        return {
            "steps": list(self.loss_steps),
            "images_seen": list(self.loss_images),
            "losses": list(self.losses),
        }


def resume_position(
    saved: TrainState, live: TrainState, plan: Steps, epoch_batches: int, order: Any = None
) -> Position | None:
    """Where a run resumed from checkpoint state ``saved`` stands in this run (its settings in ``live``, its
    steps ``plan``, ``epoch_batches`` batches per epoch before they are shared out), when it was saved with
    another process count, micro-batch or accumulation (:func:`sdplan.steps.moved_position`: the images
    done carry over, the steps are this run's); None when the settings are the same (the saved position).
    ``order``: this run's BucketBatchSampler, where known; at another micro-batch in the checkpoint's order of
    images (:func:`kept_order`) it counts the batches the checkpoint's images make whole."""
    if (saved.batch_size, saved.grad_accum, saved.num_processes) == (
        live.batch_size,
        live.grad_accum,
        live.num_processes,
    ):
        return None
    done = epoch_images(saved, plan)[0]
    return moved_position(
        epoch=saved.epoch,
        batches_in_epoch=saved.batches_in_epoch,
        images_in_epoch=done,
        batch_size=saved.batch_size,
        num_processes=saved.num_processes,
        epoch_batches=epoch_batches,
        new=plan,
        done_batches=order.batches_within(done, saved.epoch) if kept_order(saved, order) else None,
    )


def kept_order(saved: TrainState, order: Any) -> bool:
    """Whether sampler ``order`` (a BucketBatchSampler; None: unknown) draws the epochs in the order of images
    checkpoint state ``saved`` was trained in (its order batch, which this run's micro-batch divides:
    trainer/buckets.py), so the images it had trained in its epoch are that epoch's first here too."""
    return order is not None and order.order_batch_size == saved.order_batch_size


def skipped_images(moved: Position, plan: Steps, order: Any = None) -> int:
    """The images of the batches a run resumed at ``moved`` (in ``plan``) skips in its epoch: the epoch's first
    ``batches_in_epoch x processes`` batches, counted by sampler ``order`` (exact where short batches are among
    them), without it as full batches."""
    batches = moved.batches_in_epoch * plan.num_processes
    return order.images_in(batches, moved.epoch) if order is not None else batches * plan.batch_size


def epoch_images(saved: TrainState, plan: Steps) -> tuple[int, int]:
    """(the fewest, the most) images all the processes of checkpoint state ``saved`` had trained in its epoch:
    the same, its ``images_in_epoch``; a range for a multi-process checkpoint saved before that was kept
    (:func:`sdplan.steps.legacy_epoch_images`, the short batches of ``plan``'s dataset at its micro-batch)."""
    if saved.images_in_epoch is not None:
        return saved.images_in_epoch, saved.images_in_epoch
    return legacy_epoch_images(
        own_images=saved.samples_in_epoch,
        batches_in_epoch=saved.batches_in_epoch,
        batch_size=saved.batch_size,
        num_processes=saved.num_processes,
        short_images=plan.short_images(saved.batch_size),
    )


def images_again(saved: TrainState, moved: Position, plan: Steps, order: Any = None) -> int:
    """The images a run resumed at ``moved`` (in ``plan``) trains again, at most: :func:`sdplan.steps.moved_position`
    rounds the checkpoint's images in its epoch down to whole batches of the new run (14 images at batch 4: step
    3, 12 images; 2 again, counted again in ``images_seen``); for a checkpoint that kept one process's images
    (:func:`epoch_images`), also those its count cannot be sure of. ``order``: this run's sampler, which counts
    the skipped batches' images exactly (:func:`skipped_images`)."""
    if moved.epoch != saved.epoch:  # the checkpoint had finished its epoch
        return 0
    return max(0, epoch_images(saved, plan)[1] - skipped_images(moved, plan, order))


def same_numbering(saved: TrainState, moved: Position | None, plan: Steps) -> bool:
    """Whether a run resumed from ``saved`` (at ``moved``, None for the saved position, in ``plan``) numbers its
    steps as every session before it did: the checkpoint's history counts 1, 2, ... with no renumbered resume in
    it, and this one keeps the step, the images per step (batch x accumulation x processes) and the samples per
    epoch (another dataset size puts epoch N's end at other images). Then a step number is one point of the run,
    and what an earlier session saved at that step is this session's too."""
    if saved.loss_steps != list(range(1, len(saved.loss_steps) + 1)):
        return False
    if saved.samples_per_epoch and saved.samples_per_epoch != plan.images_per_epoch:
        return False
    if moved is None:
        return True
    per_step = saved.batch_size * saved.grad_accum * saved.num_processes
    return moved.step == saved.global_step and per_step == plan.images_per_step


def _is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def reshards_deepspeed(accelerator, path: str | Path | None) -> bool:
    """Whether checkpoint ``path`` holds DeepSpeed ZeRO shards of another number of processes than this run's:
    DeepSpeed's engine refuses to load those (``engine.py`` ``_load_zero_checkpoint``: "Automatic adjustment
    of ZeRO's optimizer state partitioning with a new world size is not currently supported"), so they are
    loaded through DeepSpeed's universal checkpoint (:func:`deepspeed_universal_resume`)."""
    if path is None or not _is_deepspeed(accelerator) or not (Path(path) / DEEPSPEED_DIR).is_dir():
        return False
    return read_state(path).num_processes != accelerator.num_processes


def deepspeed_universal_resume(accelerator, path: str | Path | None) -> bool:
    """Before ``accelerator.prepare``: when this run resumes from a DeepSpeed checkpoint of another process count
    (:func:`reshards_deepspeed`), its DeepSpeed config says ``"checkpoint": {"load_universal": true}``, which the
    engine reads when it is built (``runtime/config.py``) and which makes its ``load_checkpoint`` read a
    universal checkpoint (the one :meth:`Checkpointer.load` converts) and spread it over this run's processes.
    Returns whether it does."""
    if not reshards_deepspeed(accelerator, path):
        return False
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return True


def _universal_copy(path: Path, into: Path) -> None:
    """``into``: checkpoint ``path`` with its DeepSpeed shards converted to DeepSpeed's universal checkpoint
    (``deepspeed.checkpoint.ds_to_universal``: each parameter's fp32 weights and Adam moments whole, which the
    engine partitions for any number of processes), and links to its other files (scheduler, EMA, RNG). Its
    output goes to a string, not the run's output. ``inject_missing_state``: a ZeRO-1/2 checkpoint of a model
    without tensor parallelism has no universal-checkpoint info to give (DeepSpeed's converter then asks for
    only its version)."""
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for entry in path.iterdir():
        if entry.name not in (DEEPSPEED_DIR, STATE_FILE):
            os.symlink(entry.resolve(), into / entry.name)
    args = argparse.Namespace(
        input_folder=str(path / DEEPSPEED_DIR),
        output_folder=str(into / DEEPSPEED_DIR),
        num_extract_workers=1,  # in this process: no worker processes beside the training ones
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def checkpoint_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def remove_checkpoints(out_dir: str | Path) -> None:
    """Delete the checkpoints under ``out_dir/checkpoints`` (the folders named as sdplan names them, and its
    ``.tmp-`` folders), then the folder itself when nothing else is left in it: a file the user put there
    stays. Only for a checkpoints folder that sdplan's run-folder manifest says it created."""
    root = checkpoint_root(out_dir)
    if root.is_symlink():
        root.unlink()
        return
    if not root.is_dir():
        return
    for p in root.iterdir():
        if (_NAME.match(p.name) or p.name.startswith(".tmp-")) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    if not any(root.iterdir()):
        root.rmdir()


def remove_passed(out_dir: str | Path, images: int) -> list[Path]:
    """After a run finished with ``images`` seen and wrote its outputs: remove the rolling and interrupt
    checkpoints it has passed (fewer images). With checkpoints off no final checkpoint replaces them (a Ctrl-C
    at step 7 left ``interrupt-step-000007``), and a later ``--resume`` (or an ``--epochs`` extension) took it
    for the newest state, trained steps 8.. again and wrote over the finished outputs. Kept and before-NaN
    checkpoints stay. A checkpoints folder left empty goes too (with checkpoints off, nothing else is in it).
    Returns what was removed (main process only)."""
    removed = []
    for _, kind, path in list_checkpoints(out_dir):
        if kind in _REPLACEABLE and 0 <= images_seen(path) < images:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    root = checkpoint_root(out_dir)
    if removed and root.is_dir() and not root.is_symlink() and not any(root.iterdir()):
        root.rmdir()
    return removed


def removed_line(path: Path) -> str:
    """The line saying that the finish removed checkpoint ``path`` (:func:`remove_passed`), and why."""
    return f"removed {path}: older than the finished outputs; a resume from it would train again"


def read_state(path: str | Path) -> TrainState:
    try:
        return TrainState.from_json(json.loads((Path(path) / STATE_FILE).read_text()))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a complete sdplan checkpoint ({type(e).__name__}: {e})") from e


def images_seen(path: str | Path) -> int:
    """The images checkpoint ``path`` had trained (-1 when its state is unreadable)."""
    try:
        return int(json.loads((Path(path) / STATE_FILE).read_text()).get("images_seen", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, str, Path]]:
    """Checkpoints with a state file as (step, kind, path), oldest first: by images seen, then step. The
    step in a name counts that run's steps, which differ with the process count a run had."""
    root = checkpoint_root(out_dir)
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and (p / STATE_FILE).is_file():
                found.append((images_seen(p), int(m.group(2)), p.stat().st_mtime, m.group(1), p))
    return [(step, kind, p) for _, step, _, kind, p in sorted(found, key=lambda t: t[:3])]


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (most images seen) under ``out_dir/checkpoints``, or None."""
    found = list_checkpoints(out_dir)
    return found[-1][2] if found else None


def verify_checkpoint(path: str | Path) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from (missing or unreadable state, a listed file missing or
    of another size, a weights file whose header does not match its length), or None when it is complete."""
    path = Path(path)
    try:
        data = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"{path}: {STATE_FILE} unreadable: {type(e).__name__}"
    for name, size in (data.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            return f"{path}: {name} is missing"
        if f.stat().st_size != size:
            return f"{path}: {name} has {f.stat().st_size} of its {size} bytes"
    for name, digest in (data.get("sha256") or {}).items():  # absent in a checkpoint saved before it was kept
        f = path / name
        if f.is_file() and file_digest(f) != digest:
            return f"{path}: {name} is damaged, its sha256 differs from the one saved with it"
    weights = path / WEIGHTS_FILE
    if weights.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as e:  # safetensors checks the header against the file's length
            return f"{path}: {WEIGHTS_FILE} is damaged: {type(e).__name__}"
    return None


# Files up to this size are hashed whole (sha256 reads ~1 GB/s on a CPU with SHA extensions, from the page cache:
# a LoRA checkpoint in well under a second); a larger file (a full fine-tune's weights and optimizer state: 10 GB
# for SD 1.x, 30 GB for SDXL, over 100 GB for FLUX.1) by _SAMPLES slices of _SAMPLE_BYTES spread over it, so a
# save and a resume do not read tens of GB once more (it still catches a cut, a zeroed or overwritten region
# that a slice meets, and a file swapped for another of its size).
FULL_HASH_BYTES = 2 << 30
_SAMPLES, _SAMPLE_BYTES = 256, 1 << 20


def file_digest(path: str | Path, size: int | None = None) -> str:
    """The sha256 of file ``path`` (``size`` bytes), whole up to :data:`FULL_HASH_BYTES`; above it of
    ``_SAMPLES`` slices spread evenly from its start to its end, prefixed ``sampled:``."""
    size = Path(path).stat().st_size if size is None else size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
            return h.hexdigest()
        gap = (size - _SAMPLE_BYTES) / (_SAMPLES - 1)
        for i in range(_SAMPLES):
            f.seek(int(i * gap))
            h.update(f.read(_SAMPLE_BYTES))
    return "sampled:" + h.hexdigest()


def resolve_resume(resume: str | Path | None, out_dir: str | Path, say=print) -> Path | None:
    """``latest`` -> the newest complete checkpoint (error when there is none; an incomplete newer one is
    skipped with a note through ``say``); a folder -> that checkpoint (error when it is incomplete)."""
    if resume is None or resume == "":
        return None
    if str(resume) == "latest":
        found = list_checkpoints(out_dir)
        if not found:
            raise UsageError(
                f"--resume latest: no checkpoint in {checkpoint_root(out_dir)}",
                fix="start without --resume, or point --resume at a checkpoint folder",
            )
        skipped = []
        for _, _, path in reversed(found):
            problem = verify_checkpoint(path)
            if problem is None:
                if skipped:
                    say(
                        f"skipped incomplete or damaged checkpoint{'s' if len(skipped) > 1 else ''}: "
                        f"{'; '.join(skipped)}; resuming from {path}"
                    )
                return path
            skipped.append(problem)
        raise CheckpointError(
            f"--resume latest: every checkpoint in {checkpoint_root(out_dir)} is incomplete or damaged: "
            f"{'; '.join(skipped)}",
            fix=start_over(out_dir),
        )
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UsageError(f"--resume {resume}: not a checkpoint folder (no {STATE_FILE})")
    problem = verify_checkpoint(path)
    if problem is not None:
        # the newest complete one, hashing no further than it
        complete = next(
            (p for _, _, p in reversed(list_checkpoints(out_dir)) if verify_checkpoint(p) is None), None
        )
        raise CheckpointError(
            f"--resume {resume}: incomplete or damaged checkpoint: {problem}",
            fix=f"resume from {complete}, the newest complete one" if complete else start_over(out_dir),
        )
    return path


# -- trainable weights ----------------------------------------------------------------------------------


def unwrap(model):
    """The model out of its DDP / DataParallel / DeepSpeed / FSDP container (accelerate's
    ``extract_model_from_parallel``; a torch.compile wrapper goes through it too). A model in none (no
    ``.module``, no ``_orig_mod``) is returned as is without asking accelerate: its
    ``extract_model_from_parallel`` imports DeepSpeed (0.5 s, every CPU run) for an isinstance check, and returns
    such a model unchanged."""
    # torch.compile's wrapper holds the model as a submodule (nn.Module keeps it in _modules, not __dict__)
    if not hasattr(model, "module") and not hasattr(model, "_orig_mod"):
        return model
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def trainable_state_dict(models: dict[str, Any]) -> dict[str, Any]:
    """Parameters that require grad, as ``{"<model name>.<param name>": tensor}`` (CPU copies)."""
    out = {}
    for name, model in models.items():
        for pname, p in unwrap(model).named_parameters():
            if p.requires_grad:
                out[f"{name}.{pname}"] = p.detach().to("cpu").contiguous().clone()
    return out


def load_trainable_state_dict(models: dict[str, Any], state: dict[str, Any]) -> None:
    """Copy ``state`` (from ``trainable_state_dict``) into the models; every trainable parameter must be there
    and nothing else."""
    import torch

    expected = set()
    with torch.no_grad():
        for name, model in models.items():
            for pname, p in unwrap(model).named_parameters():
                if not p.requires_grad:
                    continue
                key = f"{name}.{pname}"
                expected.add(key)
                if key not in state:
                    raise CheckpointError(
                        f"checkpoint lacks trainable weight {key}; was it made by another method?"
                    )
                p.copy_(state[key].to(p.device, p.dtype))
    extra = set(state) - expected
    if extra:
        raise CheckpointError(
            f"checkpoint has {len(extra)} weights this run does not train (e.g. {sorted(extra)[0]}); "
            "was it made with other settings (method, train_text_encoder, lora targets)?"
        )


# -- the checkpointer ----------------------------------------------------------------------------------


class Checkpointer:
    """Writes and reads checkpoints for one run through ``accelerator.save_state``/``load_state``.

    ``get_weights()`` returns the trainable tensors (a flat dict); ``set_weights(dict)`` puts them back. They
    replace accelerate's full model files through its save/load pre-hooks (except under DeepSpeed, whose engine
    saves its own sharded model and optimizer). ``state`` is the live TrainState. ``started``: this session's
    ``time.perf_counter()`` at its start; a checkpoint records the run's wall seconds to it (``wall_seconds``).
    """

    def __init__(
        self,
        accelerator,
        out_dir: str | Path,
        state: TrainState,
        *,
        get_weights: Callable[[], dict[str, Any]],
        set_weights: Callable[[dict[str, Any]], None],
        every_steps: int = 0,
        keep_every_steps: int = 0,
        started: float | None = None,
    ):
        self.accelerator = accelerator
        self.root = checkpoint_root(out_dir)
        self.state = state
        self.get_weights = get_weights
        self.set_weights = set_weights
        self.every_steps = every_steps
        self.keep_every_steps = keep_every_steps
        self.last_saved: Path | None = None
        self.last_saved_step = -1
        self.written: set[str] = set()  # the checkpoints this session wrote (it may replace those)
        self.started = time.perf_counter() if started is None else started
        self._deepspeed = _is_deepspeed(accelerator)
        accelerator.register_save_state_pre_hook(self._save_hook)
        accelerator.register_load_state_pre_hook(self._load_hook)

    # accelerate hooks: our trainable weights instead of whole-model files.
    def _save_hook(self, models, weights, output_dir) -> None:
        from safetensors.torch import save_file

        if self._deepspeed:
            return
        weights.clear()
        if self.accelerator.is_main_process:
            save_file(self.get_weights(), os.path.join(output_dir, WEIGHTS_FILE))

    def _load_hook(self, models, input_dir) -> None:
        from safetensors.torch import load_file

        if self._deepspeed:
            return
        models.clear()
        path = os.path.join(input_dir, WEIGHTS_FILE)
        if not os.path.isfile(path):
            raise CheckpointError(f"{input_dir}: no {WEIGHTS_FILE}")
        self.set_weights(load_file(path))

    # -- saving ----------------------------------------------------------------------------------------

    def due(self, step: int) -> str | None:
        """The kind of checkpoint step ``step`` calls for: "keep", "rolling" or None."""
        if self.keep_every_steps and step % self.keep_every_steps == 0:
            return "keep"
        if self.every_steps and step % self.every_steps == 0:
            return "rolling"
        return None

    def save(self, kind: str) -> Path:
        """Write a checkpoint of the current state (call at an optimizer-step boundary, on every process)."""
        acc = self.accelerator
        step = self.state.global_step
        prefix = {
            "rolling": "rolling-step",
            "keep": "step",
            "interrupt": "interrupt-step",
            "nan": "before-nan-step",
        }[kind]
        name = f"{prefix}-{step:06d}"
        again = 0
        while prefix not in _REPLACEABLE and (self.root / name).exists() and name not in self.written:
            again += 1  # an earlier session's kept checkpoint of this step number: kept beside it
            name = f"{prefix}-{step:06d}-{again}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}"  # same name on every process: they write into one folder
        try:
            self._write(tmp)
        except Exception as e:
            raise self._write_failed(e, tmp) from None
        if acc.is_main_process:
            if final.exists():  # the same step written again (e.g. interrupt right after a rolling save)
                old = self.root / f".tmp-old-{name}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            if kind in ("rolling", "interrupt", "keep"):  # the rolling / interrupt ones it supersedes go
                seen = self.state.images_seen
                for _, k, p in list_checkpoints(self.root.parent):
                    if k in _REPLACEABLE and p != final and images_seen(p) <= seen:
                        shutil.rmtree(p, ignore_errors=True)
        acc.wait_for_everyone()
        self.written.add(name)
        self.last_saved = final
        self.last_saved_step = step
        return final

    def _write(self, tmp: Path) -> None:
        """Everything into ``tmp``; ``train_state.json`` (with every file's size and sha256) last, flushed."""
        acc = self.accelerator
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            files = {
                p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
            }
            digests = {name: file_digest(tmp / name, size) for name, size in files.items()}
            with open(tmp / STATE_FILE, "w") as f:
                wall = self.state.wall_seconds + time.perf_counter() - self.started
                json.dump(
                    {
                        **self.state.to_json(),
                        "wall_seconds": round(wall, 3),
                        "files": files,
                        "sha256": digests,
                    },
                    f,
                    indent=1,
                )
                f.flush()
                os.fsync(f.fileno())

    def _write_failed(self, exc: Exception, tmp: Path) -> Exception:
        """A checkpoint that could not be written: its temp folder goes (the space comes back), the previous
        checkpoint stays; a full disk or a failed write becomes one line saying what is needed where."""
        from .outputs import tree_bytes, write_error

        partial = tree_bytes(tmp)
        if self.accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(self.root.parent)
        needed = max(partial, tree_bytes(previous))
        kept = f"; the previous checkpoint {previous} is kept" if previous else "; no earlier checkpoint"
        err = write_error(exc, self.root, needed_bytes=needed, detail=kept)
        return err if err is not None else exc

    def maybe_save(self) -> Path | None:
        kind = self.due(self.state.global_step)
        return self.save(kind) if kind else None

    # -- loading ---------------------------------------------------------------------------------------

    def load(self, path: str | Path, plan: Steps, epoch_batches: int, order: Any = None) -> TrainState:
        """Restore weights, optimizer, scheduler, registered objects and RNG from ``path``; update and return
        the live TrainState, at :func:`resume_position` in this run's ``plan`` (``order``: this run's sampler,
        its order batch already chosen, ``BucketBatchSampler.keep_order``)."""
        path = Path(path)
        saved = read_state(path)
        if saved.method and self.state.method and saved.method != self.state.method:
            raise CheckpointError(
                f"{path} is a {saved.method} checkpoint; this run trains {self.state.method}"
            )
        problem = deepspeed_change(
            path, saved, self._deepspeed, now=self.state.settings.get("distributed.deepspeed")
        ) or offloaded_optimizer_change(path, saved, self.state.settings.get(OFFLOADED_OPTIMIZER))
        if problem is not None:
            raise problem
        # DeepSpeed shards of another process count: loaded from a universal copy (deepspeed_universal_resume)
        universal = None
        if reshards_deepspeed(self.accelerator, path):
            universal = self.root / f".tmp-universal-{path.name}"
        try:
            if universal is not None:
                if self.accelerator.is_main_process:
                    _universal_copy(path, universal)
                self.accelerator.wait_for_everyone()
            self.accelerator.load_state(str(universal or path))
            if universal is not None:  # every process has read it (a failed load leaves it to the next save)
                self.accelerator.wait_for_everyone()
                if self.accelerator.is_main_process:
                    shutil.rmtree(universal)
        except SdplanError:
            raise
        except Exception as e:  # files of the right size whose bytes are damaged (a bad copy, a bad disk)
            import torch

            if isinstance(e, torch.OutOfMemoryError):
                raise
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({type(e).__name__}: {first})",
                fix="resume with the settings it was saved with; if its files are damaged, move that folder "
                "aside to resume from an older checkpoint, or start again without --resume",
            ) from None
        live = self.state
        own = _same_folder(path.parent, self.root)  # else a new run started from another run's checkpoint
        fresh = TrainState()
        for key, value in saved.to_json().items():
            if key in _SETTINGS:
                continue
            setattr(live, key, value if own or key not in _RUN_HISTORY else getattr(fresh, key))
        at = resume_position(saved, live, plan, epoch_batches, order)
        if at is not None:
            live.global_step, live.epoch, live.batches_in_epoch = at.step, at.epoch, at.batches_in_epoch
            live.samples_in_epoch = at.batches_in_epoch * live.batch_size
            # the images the position skips (in the checkpoint's order: the first of them, exactly), at most
            # what the checkpoint had done
            skipped = skipped_images(at, plan, order)
            live.images_in_epoch = (
                min(skipped, epoch_images(saved, plan)[0]) if at.epoch == saved.epoch else 0
            )
        elif live.images_in_epoch is None:  # saved before it was kept, resumed as saved: the fewest it can be
            live.images_in_epoch = epoch_images(saved, plan)[0]
        # accelerate's micro-batch counter (``Accelerator.step``: ``_do_sync`` closes an optimizer step when it
        # is a multiple of the accumulation, and zeroes it at the data loader's end) comes back from
        # ``load_state`` as it was saved. The position counts this epoch's steps still to take from the resume
        # point (``moved_position``: ceil(micro-batches left / accumulation)), so the counter starts at 0 here:
        # set to the micro-batches done in the epoch, it closed steps at multiples of the accumulation counted
        # from the epoch's start, which differ whenever those are not a multiple of it (4 micro-batches done at
        # accumulation 1, resumed at 3: a step of 2, one more step in the epoch, and the run reached its steps
        # with an image never trained). A checkpoint is taken at a step boundary, so on a resume with its own
        # settings the saved counter was a multiple of the accumulation: 0 closes the same steps. Where the run
        # ends inside the epoch (training.max_steps) its first step is short (``Position.first_step``): the
        # counter starts that far before the accumulation.
        self.accelerator.step = (plan.grad_accum - at.first_step) % plan.grad_accum if at is not None else 0
        self.last_saved = path
        self.last_saved_step = live.global_step
        return live


@dataclass(frozen=True)
class DiskAhead:
    """What the saves still to come need on the disk beyond what is there now (:func:`disk_ahead`)."""

    # the most they hold at once, a checkpoint being written beside the one it replaces included
    need_bytes: int
    fill_step: int | None  # the first step whose save would not fit in the free bytes; None: all fit
    kept: int  # kept checkpoints to come (checkpoints.keep_every_steps), which stay on the disk
    exports: int  # exports to come: intermediate outputs, then the final one


def disk_ahead(
    *,
    after: int,
    total_steps: int,
    every_steps: int,
    keep_every_steps: int,
    checkpoint_bytes: int,
    rolling_on_disk: bool,
    export_steps: list[int],
    export_bytes: int,
    free_bytes: int,
    exports_now: int = 0,
    final_export_bytes: int | None = None,
) -> DiskAhead:
    """The disk the saves after step ``after`` need, walked in the loop's order, from a checkpoint's measured
    size and the trial export's. First the exports due at ``after`` itself (``exports_now``: a resume's save of
    the step it starts at); then at each save step: the intermediate outputs (``export_steps``), then the
    checkpoint: a kept one stays (and removes the rolling one it supersedes), a rolling one is written beside
    the previous rolling one, which then goes; at the last step a checkpoint of the final step (where none is
    due; none with checkpoints off: ``every_steps`` and ``keep_every_steps`` 0), then the final outputs, at
    ``final_export_bytes`` (default ``export_bytes``; less where they replace outputs already there).
    ``rolling_on_disk``: the run's newest checkpoint now is a rolling one."""
    checkpoints = bool(every_steps or keep_every_steps)
    due = set(export_steps) | {total_steps}
    if every_steps:
        due.update(range((after // every_steps + 1) * every_steps, total_steps + 1, every_steps))
    if keep_every_steps:
        due.update(
            range((after // keep_every_steps + 1) * keep_every_steps, total_steps + 1, keep_every_steps)
        )
    exports = set(export_steps)
    final = export_bytes if final_export_bytes is None else final_export_bytes
    used = exports_now * export_bytes
    peak, kept, written = used, 0, exports_now
    fill: int | None = after if used > free_bytes else None
    rolling = rolling_on_disk
    # the last step's saves are still to come where the session's first checkpoint is of the last step
    for step in sorted(s for s in due if after < s <= total_steps or s == after == total_steps):
        held = []  # what the disk holds at each moment of this step's saves
        if step in exports and step > after:
            used += export_bytes
            written += 1
            held.append(used)
        if step == after:
            pass  # its checkpoint is the one measured
        elif keep_every_steps and step % keep_every_steps == 0:
            held.append(used + checkpoint_bytes)
            used += 0 if rolling else checkpoint_bytes  # the superseded rolling one goes
            rolling, kept = False, kept + 1
        elif (every_steps and step % every_steps == 0) or (step == total_steps and checkpoints):
            held.append(used + checkpoint_bytes)  # the previous rolling one goes once this one is written
            used += 0 if rolling else checkpoint_bytes
            rolling = True
        if step == total_steps:
            used += final
            written += 1
            held.append(used)
        peak = max([peak, *held])
        if fill is None and held and max(held) > free_bytes:
            fill = step
    return DiskAhead(need_bytes=peak, fill_step=fill, kept=kept, exports=written)


def disk_warning(
    checkpoint: Path,
    root: Path,
    *,
    step: int,
    total_steps: int,
    every_steps: int,
    keep_every_steps: int,
    export_steps: list[int],
    export_bytes: int,
    exports_now: int = 0,
    final_export_bytes: int | None = None,
) -> str | None:
    """The warning, where the disk of ``root`` (the run's checkpoint folder) cannot take the saves still to come
    at the measured size of ``checkpoint`` (the run's newest, at ``step``; a resumed one may lie elsewhere)
    (:func:`disk_ahead`); None where it can. The run goes on: a save that finds the disk full stops it with
    the previous checkpoint kept, and the user may free space meanwhile."""
    from .dataset_scan import count_of
    from .outputs import free_bytes, tree_bytes

    kind = _NAME.match(checkpoint.name) if checkpoint.resolve().parent == root.resolve() else None
    size, free = tree_bytes(checkpoint), free_bytes(root)
    ahead = disk_ahead(
        after=step,
        total_steps=total_steps,
        every_steps=every_steps,
        keep_every_steps=keep_every_steps,
        checkpoint_bytes=size,
        rolling_on_disk=bool(kind) and kind.group(1) in _REPLACEABLE,
        export_steps=export_steps,
        export_bytes=export_bytes,
        free_bytes=free,
        exports_now=exports_now,
        final_export_bytes=final_export_bytes,
    )
    if ahead.fill_step is None:
        return None
    parts = []
    if ahead.kept:
        parts.append(
            f"{count_of(ahead.kept, 'kept checkpoint')} of {_gb(size)} "
            f"(checkpoints.keep_every_steps={keep_every_steps})"
        )
    if ahead.exports:
        parts.append(f"{count_of(ahead.exports, 'export')} of {_gb(export_bytes)}")
    fix = (
        "free space on that disk, or keep fewer checkpoints (a larger checkpoints.keep_every_steps, 0: none)"
        if ahead.kept
        else "free space on that disk, or save fewer outputs (output.save_every_n_steps / save_every_n_epochs)"
    )
    checkpoints = bool(every_steps or keep_every_steps)
    if checkpoints:
        parts.append("a checkpoint being written beside the last")
    return (
        f"warning: {_gb(free)} free on the disk of {root}, and the saves still to come need up to "
        f"{_gb(ahead.need_bytes)} more ({', '.join(parts)}): the disk fills at step {ahead.fill_step} of "
        f"{total_steps}, where the run stops"
        + (" with its last checkpoint" if checkpoints else "")
        + f". Fix: {fix}"
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


# The optimizer a DeepSpeed optimizer offload ran (train_state.json's settings): torch's AdamW on the CPU, DeepSpeed's
# CPU Adam on a GPU (sdplan.launch deepspeed_config); neither loads the other's state (DeepSpeed's CPU Adam stopped
# at its first step with KeyError 'bias_correction' on torch's). Absent in checkpoints of earlier sdplan versions,
# whose offload always ran DeepSpeed's CPU Adam.
OFFLOADED_OPTIMIZER = "offloaded_optimizer"


def offloaded_optimizer(cfg: Any, device_type: str) -> str | None:
    """What the optimizer offload of ``cfg`` runs on this device: "torch AdamW" (the CPU), "DeepSpeed CPU Adam"
    (a GPU), None without an offload."""
    ds = cfg.distributed.deepspeed
    if ds is None or not ds.offload_optimizer:
        return None
    return "torch AdamW" if device_type == "cpu" else "DeepSpeed CPU Adam"


def offloaded_optimizer_change(path: Path, saved: TrainState, now: str | None) -> CheckpointError | None:
    """Why checkpoint ``path`` cannot be loaded: its offloaded optimizer ran torch's AdamW (a CPU run) and this
    run's runs DeepSpeed's CPU Adam (a GPU run), which cannot read that state. None otherwise: the other way
    round loads (torch's AdamW takes DeepSpeed's CPU Adam state), and a checkpoint of an earlier version
    records nothing (its offload ran DeepSpeed's CPU Adam)."""
    if saved.settings.get(OFFLOADED_OPTIMIZER) != "torch AdamW" or now != "DeepSpeed CPU Adam":
        return None
    return CheckpointError(
        f"checkpoint {path} holds the state of DeepSpeed's offloaded optimizer as torch AdamW ran it (a CPU run) "
        "and this run's offload runs DeepSpeed CPU Adam (a GPU run): its optimizer state cannot be loaded",
        fix="resume it as a CPU run (training.device=cpu), or start a new run",
    )


def deepspeed_change(
    path: Path, saved: TrainState, deepspeed: bool, now: Any = None
) -> CheckpointError | None:
    """Why checkpoint ``path`` (its state ``saved``) cannot be loaded by a run with DeepSpeed on (``deepspeed``)
    or off, where it was saved with the other: DeepSpeed's engine keeps its own model and optimizer files
    (pytorch_model/), a run without it ``trainable.safetensors`` and a torch optimizer. `sdplan train --resume`
    refuses the change before the launch (sdplan.launcher.check_settings); a hand launch (`accelerate launch`,
    ``python -m sdplan.trainer``) came here and failed inside the load ("AssertionError: ", called damaged
    files; "no trainable.safetensors"). From train_state.json's distributed.deepspeed; in a checkpoint saved
    before it recorded it, from its files. ``now``: this run's distributed.deepspeed as recorded; an optimizer
    offload turned on or off is refused too where both are recorded (torch's AdamW state in a checkpoint without
    offload: DeepSpeed's CPU Adam stopped at its first step with KeyError 'bias_correction'). None where the two
    agree."""
    key = "distributed.deepspeed"
    if key in saved.settings:
        was = saved.settings[key]
        saved_with = was is not None
        recorded = f"{key} {json.dumps(was)} in its {STATE_FILE}"
    else:
        saved_with = (path / DEEPSPEED_DIR).is_dir()
        recorded = f"its {DEEPSPEED_DIR}/ folder" if saved_with else f"its {WEIGHTS_FILE}"
        was = None
    if saved_with == deepspeed:
        offloads = [bool((d or {}).get("offload_optimizer", True)) for d in (was, now)]
        if saved_with and was is not None and now is not None and offloads[0] != offloads[1]:
            return CheckpointError(
                f"checkpoint {path} was saved with DeepSpeed's optimizer {'' if offloads[0] else 'not '}offloaded "
                f"({recorded}) and this run {'does not offload' if offloads[0] else 'offloads'} it: its optimizer "
                "state cannot be loaded",
                fix=f"resume with distributed.deepspeed={json.dumps(was)}, as it was saved, or start a new run",
            )
        return None
    if saved_with:
        value = json.dumps(was) if was is not None else "{zero_stage: 2}"
        return CheckpointError(
            f"checkpoint {path} holds the state of DeepSpeed ({recorded}) and this run trains without DeepSpeed: "
            "it cannot be loaded",
            fix=f"resume with distributed.deepspeed={value}, as it was saved and as `sdplan train --resume` "
            "launches it, or start a new run without --resume",
        )
    return CheckpointError(
        f"checkpoint {path} was saved without DeepSpeed ({recorded}) and this run trains with DeepSpeed: it "
        "cannot be loaded",
        fix="resume with distributed.deepspeed=null, as it was saved and as `sdplan train --resume` launches "
        "it, or start a new run without --resume",
    )


def apply_learning_rates(optimizer, lr_scheduler, lrs: list[float], step: int) -> None:
    """After a resume, use this run's configured learning rates (a resume may lower them, e.g. after a NaN)
    at ``step`` of this run's schedule: a checkpoint from another process count reached another step of a
    schedule with other lengths (:func:`resume_position`)."""
    base = getattr(lr_scheduler, "base_lrs", None)
    lambdas = getattr(lr_scheduler, "lr_lambdas", None)
    if base is None or lambdas is None or len(base) != len(lrs):
        return
    if list(base) == list(lrs) and lr_scheduler.last_epoch == step:
        return
    lr_scheduler.base_lrs = list(lrs)
    lr_scheduler.last_epoch = step
    for group, lr, factor in zip(optimizer.param_groups, lrs, lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(step)
    lr_scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
