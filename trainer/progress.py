"""What the user sees while training: the progress bar (or plain lines), main-process messages, the data
summary, and TensorBoard.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from .runtime import peak_memory_bytes


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Step, loss, it/s, ETA (and GPU memory on CUDA) on the main process. A rich bar on a terminal; plain
    lines (about ``lines`` per run, and the last step) when stdout is not a TTY; nothing on other processes."""

    def __init__(
        self,
        accelerator,
        total: int,
        initial: int = 0,
        description: str = "train",
        unit: str = "step",
        lines: int = 20,
    ):
        """``unit``: what is counted ("step"; "sample" for caching, "image" for DreamBooth's class images: no
        loss to show). ``lines``: at most about how many plain lines a whole run prints (a short one prints one
        per step)."""
        import torch

        self.enabled = accelerator.is_main_process
        self.total = total
        self.initial = initial
        self.unit = unit
        self.cuda = accelerator.device.type == "cuda" and torch.cuda.is_available()
        self.tty = sys.stdout.isatty() and os.environ.get("SDPLAN_PLAIN_PROGRESS") is None
        self.every = max(1, math.ceil(total / lines))  # total // lines printed each of 39 steps
        self.description = description
        self.start = time.perf_counter()
        self._bar = None
        if self.enabled and self.tty:
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            loss = [TextColumn("loss {task.fields[loss]}")] if unit == "step" else []
            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn(f"{unit} {{task.completed}}/{{task.total}}"),
                *loss,
                TextColumn("{task.fields[rate]} it/s"),
                TextColumn("ETA {task.fields[eta]}"),
                TextColumn("{task.fields[mem]}"),
                transient=False,
            )
            self._task = self._bar.add_task(
                description, total=total, completed=initial, loss="-", rate="-", eta="-", mem=""
            )
            self._bar.start()

    def _mem(self) -> str:
        if not self.cuda:
            return ""
        import torch

        return f"GPU {torch.cuda.memory_allocated() / 2**30:.1f}/{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"

    def rate(self, step: int) -> float:
        """Steps per second since this run (or resume) started."""
        elapsed = time.perf_counter() - self.start
        return (step - self.initial) / elapsed if elapsed > 0 else 0.0

    def update(self, step: int, loss: float | None = None) -> None:
        if not self.enabled:
            return
        rate = self.rate(step)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        fields = {
            "loss": "-" if loss is None else f"{loss:.4f}",
            "rate": f"{rate:.2f}",
            "eta": _fmt_eta(eta),
            "mem": self._mem(),
        }
        if self._bar is not None:
            self._bar.update(self._task, completed=step, **fields)
        elif step % self.every == 0 or step == self.total or step == self.initial + 1:
            mem = f" {fields['mem']}" if fields["mem"] else ""
            loss_text = f" loss {fields['loss']}" if loss is not None else ""
            print(
                f"{self.description}: {self.unit} {step}/{self.total}{loss_text} {fields['rate']} it/s "
                f"ETA {fields['eta']}{mem}",
                flush=True,
            )

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def say(accelerator, message: str) -> None:
    """Print on the main process only."""
    if accelerator is None or accelerator.is_main_process:
        print(message, flush=True)


def describe_data(accelerator, dataset, scan, label: str = "data") -> None:
    """The scan summary (with skipped files and why) and, with buckets, the bucket table."""
    say(accelerator, f"{label} {scan.summary()}")
    if getattr(dataset, "buckets", None):
        from .buckets import format_bucket_table

        say(accelerator, "aspect-ratio buckets:\n" + format_bucket_table(dataset.bucket_table()))


def tensorboard(accelerator, cfg, images_seen: int = 0):
    """TensorBoard logs under ``{out}/logs`` when ``logging.tensorboard`` (main process only), taken up where the
    run restarts: at ``images_seen``, the unit its points are logged in (:func:`log_step`). The points an earlier
    session logged past it (trained past the checkpoint resumed, or by the attempt the out-of-memory retry
    abandoned, from 0) are purged; its own point at ``images_seen`` (the checkpoint's step) stays."""
    from .plots import TensorBoardLogger

    return TensorBoardLogger(
        Path(cfg.output.dir) / "logs",
        enabled=cfg.logging.tensorboard and accelerator.is_main_process,
        purge_step=images_seen + 1,
    )


def log_step(tb, progress, step: int, loss: float, lr_scheduler, images_seen: int) -> None:
    """One step's loss, learning rate, it/s and memory to TensorBoard, at the images the run has seen (as
    loss.png's x axis): a resume with another batch or process count numbers its steps on another scale, and
    logged by step its points fell back over the earlier session's (steps 2 and 3 twice) or jumped ahead."""
    if tb is None or not tb.enabled:
        return
    tb.log(
        images_seen,
        loss=loss,
        lr=lr_scheduler.get_last_lr()[0],
        it_per_s=progress.rate(step),
        memory_bytes=peak_memory_bytes(),
    )
