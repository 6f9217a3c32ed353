"""Step arithmetic: how many optimizer steps a run takes, shared by the planner, the launcher and the trainer.

With N processes each epoch is split N ways: every process draws ``ceil(images / (batch x N))`` micro-batches
and takes one optimizer step per ``grad_accum`` of them, so the images trained equal the one-process run's
(where the epoch's batches do not divide by N, its last round repeats a few of its first: :func:`repeated_batches`).
``training.max_steps`` and ``training.lr_warmup_steps`` are one-process counts (as the planner writes them):
with N processes both are divided by N, rounded up. A checkpoint resumed with other settings (another process
count, micro-batch or accumulation) continues at its images, in this run's steps: :func:`moved_position`.
Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdplan.trainer.dataset_scan import count_of


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
    grad_accum: int = 1
    bucket_samples: tuple[int, ...] = ()  # the samples of each aspect bucket; () without buckets (one)

    @property
    def batch_size(self) -> int:
        """The micro-batch."""
        return self.images_per_step // (self.grad_accum * self.num_processes)

    def short_images(self, batch_size: int | None = None) -> int:
        """The images an epoch's short batches lack at ``batch_size`` (this run's by default): each aspect
        bucket's last batch is short of full where its samples do not divide by it (without buckets, the
        epoch's last)."""
        batch = batch_size or self.batch_size
        return sum(-n % batch for n in self.bucket_samples or (self.images_per_epoch,))

    @property
    def largest_batch(self) -> int:
        """The largest micro-batch the trainer forms (:func:`largest_batch`): the micro-batch, or fewer where an
        epoch (each aspect bucket) holds fewer samples."""
        return largest_batch(self.batch_size, self.images_per_epoch, self.bucket_samples)

    @property
    def images_seen_min(self) -> int:
        """The fewest images the run sees: ``images_seen`` but where ``training.max_steps`` ends it inside an
        epoch that has short batches. The sampler shuffles an epoch's short batches in among its full ones
        (trainer/buckets.py), so the batches a cut epoch's steps draw hold ``images_seen``'s full batches at
        most, and fewer where short ones fall among them: the plan says "up to" (:meth:`images_seen_text`)."""
        full, rest = divmod(self.total_steps, self.steps_per_epoch)
        if not rest:
            return self.images_seen
        drawn = rest * self.grad_accum * self.num_processes  # fewer than the epoch's batches: none repeats
        part = max(drawn, drawn * self.batch_size - self.short_images())
        return full * self.images_per_epoch + min(part, self.images_per_epoch)

    def images_seen_text(self, noun: str = "image") -> str:
        """``images_seen`` as the plan states it: "up to N images" where the run can see fewer."""
        n = count_of(self.images_seen, noun) if noun else str(self.images_seen)
        return n if self.images_seen_min == self.images_seen else f"up to {n}"

    @property
    def micro_batches(self) -> int:
        """The micro-batches each process draws in the whole run: ``total_steps x grad_accum`` less the missing
        micro-batches of each epoch's last, partial accumulation (20 images at batch 8 and accumulation 4 are
        3 micro-batches an epoch, in one optimizer step, not 4)."""
        full_epochs, rest = divmod(self.total_steps, self.steps_per_epoch)
        return full_epochs * self.batches_per_epoch + min(rest * self.grad_accum, self.batches_per_epoch)

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


def bucketed_batches(
    bucket_samples: tuple[int, ...] | list[int], batch_size: int, num_processes: int = 1
) -> int:
    """Each process's micro-batches an epoch over aspect buckets (``bucket_samples``: the samples in each,
    :func:`sdplan.trainer.buckets.bucket_samples`): a batch holds one bucket's samples, each bucket's last one
    short, and the batches are dealt out over the processes (BucketBatchSampler's length). One bucket gives
    ``ceil(images / (batch x processes))``, as without buckets."""
    return math.ceil(sum(math.ceil(n / batch_size) for n in bucket_samples) / num_processes)


def largest_batch(
    batch_size: int, images_per_epoch: int, bucket_samples: tuple[int, ...] | list[int] = ()
) -> int:
    """The largest micro-batch the trainer forms at ``batch_size``: a batch holds one aspect bucket's samples
    (``bucket_samples``; without buckets, one bucket of the epoch's ``images_per_epoch``), so none holds more
    than the largest bucket: 20 images at batch 64 are one batch of 20 (BucketBatchSampler). On several
    processes the batches are dealt out whole, so each process's largest is this too. Memory and time are
    sized at it."""
    return max(1, min(batch_size, max(bucket_samples or (images_per_epoch,))))


def repeated_batches(
    images_per_epoch: int,
    batch_size: int,
    num_processes: int,
    bucket_samples: tuple[int, ...] | list[int] = (),
) -> int:
    """The batches each epoch trains twice on ``num_processes`` processes: accelerate gives every process as
    many batches (``even_batches``) by dealing the epoch's first batches again in its last round when the
    epoch's batches (``bucket_samples``: per aspect bucket, each bucket's last one short) do not divide by the
    processes. 0 on one process."""
    if num_processes <= 1:
        return 0
    if bucket_samples:
        total = sum(math.ceil(n / batch_size) for n in bucket_samples)
    else:
        total = math.ceil(images_per_epoch / batch_size)
    return math.ceil(total / num_processes) * num_processes - total


def repeated_batches_text(repeats: int, batch_size: int, epochs: int | None = None) -> str:
    """What :func:`repeated_batches` means for a run, in the words `recommend` and `train` both print:
    ``epochs`` given (a run by epochs), the images that adds over the run. ``batch_size``: the batch the trainer
    forms (:func:`largest_batch`: one image at batch 2 is a batch of one, dealt again as one)."""
    first = "its first batch" if repeats == 1 else f"its first {repeats} batches"
    more = f", about {count_of(repeats * batch_size * epochs, 'image')} more in all" if epochs else ""
    return (
        f"accelerate gives every process a batch by training {first} again (up to "
        f"{count_of(repeats * batch_size, 'image')} twice an epoch{more})"
    )


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
    bucket_samples: tuple[int, ...] = (),
) -> Steps:
    """The run's steps. ``bucket_samples``: with aspect buckets, each bucket's samples (each bucket ends in a
    short batch). ``batches_per_epoch``: each process's real dataloader length when known (by default
    :func:`bucketed_batches`: ``ceil(images / (batch x processes))`` without buckets)."""
    bucket_samples = tuple(bucket_samples) if len(bucket_samples) > 1 else ()  # one bucket: the plain count
    if batches_per_epoch is None:
        batches_per_epoch = bucketed_batches(bucket_samples or (images_per_epoch,), batch_size, num_processes)
    spe = max(1, math.ceil(batches_per_epoch / grad_accum))
    per_step = batch_size * grad_accum * num_processes
    if max_steps:
        total = max(1, math.ceil(max_steps / num_processes))
        epochs = math.ceil(total / spe)
        full_epochs, rest = divmod(total, spe)  # an epoch's last step takes what is left of it
        # the most: full batches (Steps.images_seen_min, where a cut epoch's short batches can fall)
        images_seen = full_epochs * images_per_epoch + min(rest * per_step, images_per_epoch)
        one = max_steps
    else:
        total = epochs * spe
        images_seen = epochs * images_per_epoch
        # one process, the same arithmetic: its buckets' batches (each bucket's last one short), all its own
        one_batches = bucketed_batches(bucket_samples or (images_per_epoch,), batch_size)
        one = max(1, math.ceil(one_batches / grad_accum)) * epochs
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
        grad_accum=grad_accum,
        bucket_samples=bucket_samples,
    )


@dataclass(frozen=True)
class Position:
    """Where a run stands: optimizer steps taken (each process), the epoch, and the micro-batches each
    process has drawn in that epoch. ``first_step``: the micro-batches of the first step from there where it is
    short of the accumulation (a resume that ends inside this epoch: :func:`moved_position`); 0: a whole one."""

    step: int
    epoch: int
    batches_in_epoch: int
    first_step: int = 0


def moved_position(
    *,
    epoch: int,
    batches_in_epoch: int,
    images_in_epoch: int,
    batch_size: int,
    num_processes: int,
    epoch_batches: int,
    new: Steps,
    done_batches: int | None = None,
) -> Position:
    """Where a checkpoint saved under other settings stands in a run planned as ``new``.

    The checkpoint was ``batches_in_epoch`` micro-batches of ``batch_size`` into ``epoch`` on each of its
    ``num_processes`` processes (``images_in_epoch`` images on all of them together). The processes take an
    epoch's batches in turn (process i: batches i, i+N, ...), so the first ``batches_in_epoch x num_processes``
    batches of the epoch's order are done. With another micro-batch the batches differ: where the new run keeps
    the checkpoint's order of images (a micro-batch that divides its order batch, trainer/buckets.py) those
    images are the first of its order, and ``done_batches`` counts the new batches wholly among them (exact:
    none left out, a batch that straddles them trains again); otherwise (None) the images done count, rounded
    down to whole batches of the new micro-batch (the order is another: the caller says so). ``epoch_batches``:
    the new run's batches in one epoch, before they are shared out. Each new process skips its share of what is
    done: a count the new processes cannot share evenly is rounded down (up to ``new.num_processes - 1``
    batches train again; none is left out).

    The step is the steps ``new`` still takes to the next place the run must reach, counted back from that
    place's step: the epoch's end, or the run's own end where ``training.max_steps`` puts it inside this epoch
    (``stop``). From the resume point the loop closes a step after ``grad_accum`` micro-batches, and at the
    epoch's end with what is left, so ``ceil(micro-batches to the stop / accumulation)`` steps reach it: a run
    by epochs ends at its last epoch's end, and the learning-rate schedule stands where this run's own schedule
    would. Counted back from the epoch's end alone, a step only partly done counted as taken where the
    micro-batches to it did not divide by the accumulation, and a ``training.max_steps`` end inside the epoch
    came short of the images asked for (3 fewer, or none trained at all after the resume). There the loader's
    end does not close the last step, so the first takes the odd micro-batches (``first_step``, the loop's
    micro-batch counter) and the run ends where an uninterrupted one does. A checkpoint at or past the run's end
    stands at the step the epoch's count gives (``new.total_steps`` or more).
    """
    new_batch = new.batch_size
    if batch_size == new_batch:
        done = batches_in_epoch * num_processes
    elif done_batches is not None:
        done = done_batches
    else:
        done = images_in_epoch // new_batch
    if done >= epoch_batches or (batch_size != new_batch and images_in_epoch >= new.images_per_epoch):
        epoch, done = epoch + 1, 0  # the epoch was finished (its images all trained: its short batches too)
    mine = min(done // new.num_processes, new.batches_per_epoch)
    spe, accum = new.steps_per_epoch, new.grad_accum
    # the micro-batch of this epoch the run must reach: the epoch's end, or the run's end inside it
    stop = min(new.batches_per_epoch, (new.total_steps - epoch * spe) * accum)
    if mine >= stop:  # at or past the run's end
        step = (epoch + 1) * spe - math.ceil((new.batches_per_epoch - mine) / accum)
        return Position(step=step, epoch=epoch, batches_in_epoch=mine)
    step = min(new.total_steps, (epoch + 1) * spe) - math.ceil((stop - mine) / accum)
    first = (stop - mine) % accum if stop < new.batches_per_epoch else 0
    return Position(step=step, epoch=epoch, batches_in_epoch=mine, first_step=first)


def legacy_epoch_images(
    *, own_images: int, batches_in_epoch: int, batch_size: int, num_processes: int, short_images: int
) -> tuple[int, int]:
    """(the fewest, the most) images ``num_processes`` processes can have trained ``batches_in_epoch``
    micro-batches of ``batch_size`` into an epoch where one of them (the first, which writes the checkpoint)
    trained ``own_images``: a checkpoint saved before ``images_in_epoch`` kept all the processes' images
    (``TrainState.samples_in_epoch``, the first process's own). Its own images times the processes overcounted
    where the epoch's short batch was another process's (a resume with another micro-batch skipped an image
    never trained) and undercounted where it was its own. The other processes' batches are full but for the
    epoch's short batches (lacking ``short_images`` in all at ``batch_size``), which may all have been theirs:
    the fewest is what a resume skips (exact on one process, and where the first process had the only short
    batch); the most, what it can train again."""
    others = (num_processes - 1) * batches_in_epoch
    most = own_images + others * batch_size
    least = max(own_images + others, min(most, batches_in_epoch * batch_size * num_processes - short_images))
    return least, most


def intermediate_steps(
    *, total_steps: int, steps_per_epoch: int, every_epochs: int, every_steps: int, after: int = 0
) -> dict[int, int | None]:
    """The optimizer steps after ``after`` (and before the last, which the final outputs cover) where
    outputs are saved: step -> the epoch it ends (an every-N-epochs save) or None (every N steps)."""
    due: dict[int, int | None] = {}
    if every_steps:
        due.update({s: None for s in range(every_steps, total_steps, every_steps)})
    if every_epochs:
        for epoch in range(every_epochs, total_steps // max(steps_per_epoch, 1) + 1, every_epochs):
            due[epoch * steps_per_epoch] = epoch
    return {s: e for s, e in sorted(due.items()) if after < s < total_steps}
