"""Step arithmetic: how many optimizer steps a run takes, shared by the planner, the launcher and the trainer.

With N processes each epoch is split N ways: every process draws ``ceil(images / (batch x N))`` micro-batches
and takes one optimizer step per ``grad_accum`` of them, so the images trained equal the one-process run's.
``training.max_steps`` and ``training.lr_warmup_steps`` are one-process counts (as the planner writes them):
with N processes both are divided by N, rounded up. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Steps:
    images_per_epoch: int  # images x repeats
    epochs: int
    batches_per_epoch: int  # micro-batches each process draws per epoch
    steps_per_epoch: int  # optimizer steps per epoch (each process)
    total_steps: int  # optimizer steps of the whole run (each process)
    images_per_step: int  # micro-batch x accumulation x processes
    images_seen: int
    one_gpu_total_steps: int  # the same run on one process
    lr_warmup_steps: int  # per process
    num_processes: int = 1

    def summary(self) -> dict[str, int]:
        """The counts `sdplan train` prints and records (run metadata)."""
        keys = (
            "images_per_epoch",
            "epochs",
            "steps_per_epoch",
            "total_steps",
            "images_per_step",
            "images_seen",
        )
        return {k: getattr(self, k) for k in keys}


def plan_steps(
    *,
    images_per_epoch: int,
    batch_size: int,
    grad_accum: int = 1,
    num_processes: int = 1,
    epochs: int = 1,
    max_steps: int | None = None,
    warmup_steps: int = 0,
    batches_per_epoch: int | None = None,
) -> Steps:
    """The run's steps. ``batches_per_epoch``: each process's real dataloader length when known (aspect
    buckets can make it differ from ``ceil(images / (batch x processes))``, the default)."""
    if batches_per_epoch is None:
        batches_per_epoch = math.ceil(images_per_epoch / (batch_size * num_processes))
    spe = max(1, math.ceil(batches_per_epoch / grad_accum))
    per_step = batch_size * grad_accum * num_processes
    if max_steps:
        total = max(1, math.ceil(max_steps / num_processes))
        epochs = math.ceil(total / spe)
        images_seen = total * per_step
        one = max_steps
    else:
        total = epochs * spe
        images_seen = epochs * images_per_epoch
        one = max(1, math.ceil(images_per_epoch / (batch_size * grad_accum))) * epochs
    return Steps(
        images_per_epoch=images_per_epoch,
        epochs=epochs,
        batches_per_epoch=batches_per_epoch,
        steps_per_epoch=spe,
        total_steps=total,
        images_per_step=per_step,
        images_seen=images_seen,
        one_gpu_total_steps=one,
        lr_warmup_steps=min(total, math.ceil(warmup_steps / num_processes)),
        num_processes=num_processes,
    )
