"""Why a training run stops early, and what it leaves behind: the exit codes the launcher acts on,
the errors for an interrupt (SIGINT/SIGTERM/SIGHUP), an out-of-memory and a NaN/inf loss, the signal handler, the
oom.json report and the best-effort checkpoint after an unexpected error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sdplan.errors import EXIT_INTERRUPTED, EXIT_OOM, SdplanError
from sdplan.terminal import HANGUP, detach_from_terminal, hangup_wanted, terminal_fds

from .outputs import write_json_atomic


class TrainingInterrupted(SdplanError):
    """SIGINT/SIGTERM/SIGHUP: the current step finished and a checkpoint was written."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, step: int, checkpoint: Path | None):
        self.step = step
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        again = "--resume latest"  # the trainer's own command line; under `sdplan train`, its command
        if checkpoint and os.environ.get("SDPLAN_LAUNCHED"):
            again = f"`sdplan train --resume --out {Path(checkpoint).parent.parent}`"
        super().__init__(
            f"interrupted at step {step}; {where}",
            fix=f"continue with {again}" if checkpoint else None,
        )


class OutOfMemoryStop(SdplanError):
    """CUDA ran out of memory; ``{out}/oom.json`` says where, so the launcher can retry smaller."""

    exit_code = EXIT_OOM

    def __init__(self, step: int, report: Path, message: str):
        self.step = step
        self.report = report
        super().__init__(
            f"out of GPU memory at step {step} ({message.splitlines()[0] if message else 'OOM'}); "
            f"details in {report}",
            fix="lower training.batch_size (raise training.grad_accum to keep the effective batch), "
            "or turn on memory.gradient_checkpointing",
        )


class NonFiniteLoss(SdplanError):
    """The loss became NaN or inf; training stopped before the update that would have spread it."""

    exit_code = 1


def nonfinite_error(
    step: int,
    cfg,
    checkpoint: Path | None,
    *,
    gradients: bool = False,
    device: tuple[str | None, str | None] = (None, None),
    untrained: bool = False,
    bad_weight: str | None = None,
) -> NonFiniteLoss:
    """The error for a NaN/inf at ``step``; ``device``: the CUDA device's (name, compute capability), which names
    a GTX 16 card's fp16 NaN (sdplan.machine.fp16_gives_nan) as the likely cause. ``untrained``: no weight was
    updated yet (step 1 of a run from the base model): the learning rate cannot be the cause, the base model's
    weights (``bad_weight``: one that holds NaN/inf, "unet conv_in.weight") or the data can."""
    from sdplan.machine import GTX16_FP16_NAN_SOURCES, fp16_gives_nan

    p = cfg.training.precision
    where = f"; weights from before it in {checkpoint}" if checkpoint else ""
    model, images = cfg.model.path, cfg.data.path
    check = (
        f"check the base model file {model}: a damaged download or conversion holds NaN/inf weights, get it "
        f"again; and the images in {images}: one may be damaged, open them or train on half to find it"
    )
    if untrained and bad_weight:
        return NonFiniteLoss(
            f"{'gradients' if gradients else 'loss'} became NaN/inf at step {step}, before any update: the base "
            f"model's weight {bad_weight} holds NaN/inf (model.path {model})",
            fix="the model file is damaged or was converted wrongly: download or convert it again, or train "
            "another model",
        )
    at = f"step {step}, before any update" if untrained else f"step {step}"
    if gradients:  # the loss was finite: the backward pass made them
        kernel = (
            f"gradients became NaN/inf at {at}{',' if untrained else ''} while the loss was finite: likely a GPU "
            "kernel in the backward pass "
            "(on Hopper GPUs PyTorch's cuDNN attention has given non-finite gradients at some shapes; sdplan turns "
            "it off, see trainer/runtime.py)"
        )
        if untrained:
            return NonFiniteLoss(
                f"{kernel} or bad data",
                fix=f"train with training.precision=fp32; if it comes back, {check}, and report it with the "
                "run's sdplan.yaml",
            )
        return NonFiniteLoss(
            f"{kernel} or diverging weights{where}",
            fix=f"resume from that checkpoint with a lower training.learning_rate (now "
            f"{cfg.training.learning_rate:g}); if it comes back at once, train with training.precision=fp32 "
            "and report it with the run's sdplan.yaml",
        )
    if p == "fp16" and fp16_gives_nan(*device):
        cause = f"fp16 mixed precision on {device[0]}: it gives NaN losses on GTX 16 cards ({GTX16_FP16_NAN_SOURCES})"
        fix = "train with training.precision=fp32 (what sdplan plans on GTX 16 cards)"
    elif p == "fp16" and untrained:
        cause = (
            "fp16 overflow (activations or the loss exceed the fp16 range), or bad base model weights or data"
        )
        fix = f"train with training.precision=bf16 (Ampere or newer) or fp32; if it comes back, {check}"
    elif p == "fp16":
        cause = "fp16 overflow (activations or the loss exceed the fp16 range)"
        fix = "train with training.precision=bf16 (Ampere or newer) or fp32, or lower training.learning_rate"
    elif untrained:
        return NonFiniteLoss(
            f"loss became NaN/inf at {at}, so not from the learning rate: the base model's weights or the "
            "data are bad",
            fix=check,
        )
    else:
        cause = "diverging weights (learning rate too high) or a bad batch"
        fix = f"lower training.learning_rate (now {cfg.training.learning_rate:g}) or add warmup"
    return NonFiniteLoss(f"loss became NaN/inf at {at}: likely {cause}{where}", fix=fix)


def stop_on_nan(
    ckpt, params, step: int, cfg, *, gradients: bool = False, untrained: bool = False, models=()
) -> NonFiniteLoss:
    """At a NaN/inf loss, before the optimizer step: checkpoint the weights from before this step (when they
    are still finite; else point at the last checkpoint) and return the error to raise. ``untrained``: no
    update was made yet (step 1 from the base model): no checkpoint (it would hold the weights the run started
    from, and --resume would pick it up); ``models`` ((label, module) pairs) are searched for a weight that
    holds NaN/inf, to name it."""
    import torch

    path = None
    if untrained:
        pass
    elif all(bool(torch.isfinite(p).all()) for p in params):
        path = ckpt.save("nan")
    elif ckpt.last_saved is not None:
        path = ckpt.last_saved
    device = (None, None)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = (torch.cuda.get_device_name(), f"{major}.{minor}")
    bad = nonfinite_weight(models) if untrained else None
    return nonfinite_error(
        step, cfg, path, gradients=gradients, device=device, untrained=untrained, bad_weight=bad
    )


def nonfinite_weight(models) -> str | None:
    """The first weight holding NaN/inf among ``models`` ((label, module) pairs) as "label name", or None (a
    check that fails, a weight it cannot read: None, the error on its way matters more)."""
    import torch

    try:
        for label, module in models:
            if module is None:
                continue
            for name, p in module.named_parameters():
                if p.numel() and p.is_floating_point() and not bool(torch.isfinite(p).all()):
                    return f"{label} {name.removeprefix('module.')}"
    except Exception:
        return None
    return None


def checkpoint_on_error(accelerator, ckpt, state) -> None:
    """Best effort on an unexpected exception: checkpoint the last finished step. One process only: with
    several, the others may be inside a collective and a save would hang."""
    if accelerator.num_processes != 1 or state.global_step == 0 or ckpt.last_saved_step == state.global_step:
        return
    try:
        path = ckpt.save("interrupt")
        print(f"checkpoint written after the error: {path}", flush=True)
    except Exception as e:  # the original error matters more
        print(f"could not write a checkpoint after the error: {e}", flush=True)


def write_oom_report(out_dir: Path, *, step: int, cfg, message: str) -> Path:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report = {
        "step": step,
        "batch_size": cfg.training.batch_size,
        "grad_accum": cfg.training.grad_accum,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing,
        "message": message.strip().splitlines()[0] if message.strip() else "CUDA out of memory",
    }
    return write_json_atomic(Path(out_dir) / "oom.json", report)


class StopSignals:
    """SIGINT / SIGTERM / SIGHUP ask the loop to stop after the current step (it then writes a checkpoint).

    SIGHUP is a closed terminal: stdout/stderr that were that terminal are pointed at /dev/null first, so the
    progress lines and the checkpoint after it cannot fail on the hung-up terminal. Under ``nohup`` (SIGHUP
    ignored) it stays ignored.

    A second SIGINT raises KeyboardInterrupt at once, unless it comes within a second of the first (a
    launcher such as torchrun forwards the Ctrl-C its process group already delivered). Handlers are installed
    only in the main thread and the previous ones come back on exit.
    """

    def __init__(self):
        self.requested: str | None = None
        self._first = 0.0
        self._previous: dict[int, Any] = {}
        self._terminal: tuple[int, ...] = ()

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum == HANGUP:
            detach_from_terminal(self._terminal)
        if self.requested is not None:
            if signum == signal.SIGINT and now - self._first > 1.0:
                raise KeyboardInterrupt
            return
        self.requested, self._first = name, now
        if os.environ.get("RANK", "0") == "0":
            # os.write: no buffered-IO reentrancy when the signal lands inside a print.
            note = f"\n{name}: stopping after this step and writing a checkpoint (Ctrl-C again to abort)\n"
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), note.encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._terminal = terminal_fds()
            handled = [signal.SIGINT, signal.SIGTERM] + ([HANGUP] if hangup_wanted() else [])
            for s in handled:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
