"""Aspect-ratio buckets: train on whole images of any shape instead of square center crops.

The buckets are every ``(width, height)`` with sides a multiple of ``step`` whose area stays within the
pixel budget of the training resolution (``resolution**2``), for widths from ``min_size`` to ``max_size``
(the tallest height that fits each width, and the same shapes turned), as kohya's sd-scripts make them.
Each image goes to the bucket whose aspect ratio is nearest to its own (compared as ``log(w/h)``, so
2:1 and 1:2 are equally far from 1:1; ties go to the larger bucket); the dataset then scales it to cover
the bucket and crops the rest. A batch is drawn from one bucket only, so its tensors stack.

``step`` is 64 by default: SD 1.x/2.x UNets downsample the 8x latent three times, so sides must be
multiples of 64 pixels. SDXL downsamples twice, so 32 is allowed there (``min_step("sdxl")``).

Pure Python (no torch): :class:`BucketBatchSampler` is a plain iterable of index lists, which is what
``torch.utils.data.DataLoader(batch_sampler=...)`` takes.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any


def min_step(family: str | None) -> int:
    """Smallest bucket side step the model family allows: 32 for SDXL, 64 for SD 1.x / 2.x."""
    return 32 if family == "sdxl" else 64


def make_buckets(
    resolution: int,
    *,
    step: int = 64,
    min_size: int | None = None,
    max_size: int | None = None,
) -> list[tuple[int, int]]:
    """Bucket shapes ``(width, height)`` with ``width * height <= resolution**2``, sorted by aspect ratio.

    ``min_size``/``max_size`` bound each side (defaults: ``resolution // 2`` and ``resolution * 2``, rounded
    to the step). The square bucket (``resolution`` rounded down to the step) is always there.
    """
    # the settings' checks, with the fix, are sdplan.config.bucket_problems': these only guard other callers
    if step < 32 or step % 32:
        raise ValueError(f"bucket step must be a multiple of 32 (64 for SD 1.x/2.x), got {step}")
    if resolution < step:
        raise ValueError(f"resolution {resolution} is smaller than the bucket step {step}")
    max_area = resolution * resolution
    lo, hi = side_range(resolution, step=step, min_size=min_size, max_size=max_size)
    if hi < lo:
        raise ValueError(f"bucket max_size {max_size} is below min_size {min_size}")
    side = _round_down(resolution, step)
    shapes = {(side, side)}
    for w in range(lo, hi + 1, step):
        h = min(hi, _round_down(max_area // w, step))
        if h < lo:
            continue
        shapes.add((w, h))
        shapes.add((h, w))
    return sorted(shapes, key=lambda s: (s[0] / s[1], s[0] * s[1]))


def side_range(
    resolution: int, *, step: int = 64, min_size: int | None = None, max_size: int | None = None
) -> tuple[int, int]:
    """(the shortest, the longest) bucket side :func:`make_buckets` allows: ``min_size`` and ``max_size``
    (defaults: ``resolution // 2`` and ``resolution * 2``) rounded down to the step, the shortest at least one
    step. The first above the second: the settings make no bucket besides the square."""
    lo = max(step, _round_down(min_size if min_size is not None else resolution // 2, step))
    hi = _round_down(max_size if max_size is not None else resolution * 2, step)
    return lo, hi


def _round_down(x: int, step: int) -> int:
    return (int(x) // step) * step


def nearest_bucket(size: tuple[int, int], buckets: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest to ``size`` = (width, height)."""
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"image size must be positive, got {w}x{h}")
    ar = math.log(w / h)
    return min(
        range(len(buckets)),
        key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - ar), -buckets[i][0] * buckets[i][1]),
    )


def assign_buckets(sizes: Sequence[tuple[int, int]], buckets: Sequence[tuple[int, int]]) -> list[int]:
    """Bucket index for each (width, height)."""
    cache: dict[tuple[int, int], int] = {}
    out = []
    for s in sizes:
        s = (int(s[0]), int(s[1]))
        if s not in cache:
            cache[s] = nearest_bucket(s, buckets)
        out.append(cache[s])
    return out


def config_buckets(data: Any, resolution: int | None = None) -> list[tuple[int, int]]:
    """The bucket shapes an sdplan.yaml ``data`` section makes (``bucket_step``, ``bucket_min_size``,
    ``bucket_max_size``; one the schema lacks: its default) at ``resolution`` (default: ``data.resolution``):
    the one recipe for the trainer's dataset and the step counts of `recommend` and `train`."""
    step = getattr(data, "bucket_step", None)
    return make_buckets(
        resolution or data.resolution,
        step=64 if step is None else int(step),
        min_size=getattr(data, "bucket_min_size", None),
        max_size=getattr(data, "bucket_max_size", None),
    )


def bucket_samples(
    sizes: Sequence[tuple[int, int] | None], repeats: Sequence[int], shapes: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """The samples (images x repeats) in each of the bucket ``shapes`` in use, largest first, as the dataset
    assigns the images (an image whose size is unknown goes where an unreadable one does: as 1x1). The step
    arithmetic needs them: a batch holds one bucket's samples, so each bucket ends in a short batch
    (:func:`sdplan.steps.bucketed_batches`)."""
    return bucket_counts(sample_bucket_ids(sizes, repeats, shapes))


def sample_bucket_ids(
    sizes: Sequence[tuple[int, int] | None], repeats: Sequence[int], shapes: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """Each sample's bucket (each image's, once per repeat), in the dataset's order: what
    trainer/data.py CaptionedImages.bucket_ids gives the BucketBatchSampler."""
    assigned = assign_buckets([s or (1, 1) for s in sizes], shapes)
    return tuple(b for b, r in zip(assigned, repeats) for _ in range(max(1, r)))


def bucket_counts(ids: Sequence[int]) -> tuple[int, ...]:
    """The samples of each bucket in ``ids`` (:func:`sample_bucket_ids`), largest first."""
    counts: dict[int, int] = {}
    for b in ids:
        counts[b] = counts.get(b, 0) + 1
    return tuple(sorted(counts.values(), reverse=True))


def bucket_table(
    buckets: Sequence[tuple[int, int]],
    assignment: Sequence[int],
    repeats: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Rows for printing at start, only the buckets that hold images:
    ``{"bucket": i, "width", "height", "aspect": "3:2"-like float, "images", "samples"}``
    (``samples`` = images x repeats; ``repeats`` per image, default 1)."""
    rows: dict[int, dict[str, Any]] = {}
    for n, b in enumerate(assignment):
        w, h = buckets[b]
        row = rows.setdefault(
            b, {"bucket": b, "width": w, "height": h, "aspect": round(w / h, 3), "images": 0, "samples": 0}
        )
        row["images"] += 1
        row["samples"] += repeats[n] if repeats is not None else 1
    return [rows[b] for b in sorted(rows, key=lambda b: buckets[b][0] / buckets[b][1])]


def format_bucket_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table as plain text, one bucket per line."""
    lines = [f"{'bucket':>9}  {'aspect':>6}  {'images':>6}  {'samples':>7}"]
    for r in rows:
        lines.append(
            f"{r['width']:>4}x{r['height']:<4}  {r['aspect']:>6.3f}  {r['images']:>6}  {r['samples']:>7}"
        )
    return "\n".join(lines)


def _rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


class BucketBatchSampler:
    """Batches of dataset indices, each batch from one bucket; seeded and reshuffled per epoch.

    ``bucket_ids[i]`` is the bucket of dataset index ``i`` (all zeros: plain seeded batching). Per epoch the
    indices of each bucket are shuffled, cut into batches of ``order_batch_size`` (the last one shorter unless
    ``drop_last``), and the batches of all buckets shuffled together; then each of those is split, in order,
    into consecutive batches of ``batch_size`` (the micro-batch, which must divide the order batch; the last
    piece of a short one is shorter). The order depends only on ``(seed, epoch, order_batch_size)``: with the
    order batch the micro-batch (its default, every fresh run) each batch is cut once; at any micro-batch that
    divides it the images come in the same order, so a run resumed inside an epoch at a smaller micro-batch
    (the out-of-memory retry halves it to a divisor) keeps the order batch of the checkpoint and finds the
    images it had trained at the start of the epoch's order (:meth:`batches_within`). Each bucket still makes
    ``ceil(samples / batch_size)`` batches, its last short by ``samples % batch_size``, as the step arithmetic
    counts (:func:`sdplan.steps.bucketed_batches`).

    Distributed (``num_replicas`` > 1): every rank computes the same batch list and takes every
    ``num_replicas``-th batch from ``rank``; all ranks get the same number of batches (with ``drop_last``
    the leftover batches are dropped, otherwise the first batches are repeated to fill the last round), so
    an epoch holds the same images as a one-process run. When this sampler shards, do not let
    ``accelerator.prepare`` shard the DataLoader again; or keep ``num_replicas=1`` and let accelerate do it.

    ``set_epoch(epoch, skip_batches=n)``: the next iteration starts at this rank's batch ``n`` of that epoch
    (resume mid-epoch); ``len()`` always counts the full epoch.
    """

    def __init__(
        self,
        bucket_ids: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        order_batch_size: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.bucket_ids = list(bucket_ids)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self._skip = 0
        self.order_batch_size = batch_size if order_batch_size is None else order_batch_size
        if self.order_batch_size < 1 or self.order_batch_size % batch_size:
            raise ValueError(
                f"order_batch_size {order_batch_size} is not a multiple of the micro-batch {batch_size}"
            )
        if drop_last and self.order_batch_size != batch_size:
            raise ValueError(
                "drop_last cuts the epoch at the micro-batch: it takes no other order_batch_size"
            )
        self._by_bucket: dict[int, list[int]] = {}
        for i, b in enumerate(self.bucket_ids):
            self._by_bucket.setdefault(int(b), []).append(i)

    @classmethod
    def for_dataset(cls, dataset: Any, batch_size: int, **kwargs: Any) -> BucketBatchSampler:
        """From a dataset with ``bucket_ids()`` (CaptionedImages); others get one bucket."""
        ids = dataset.bucket_ids() if hasattr(dataset, "bucket_ids") else [0] * len(dataset)
        return cls(ids, batch_size, **kwargs)

    def keep_order(self, order_batch_size: int) -> bool:
        """A resume of a run whose epochs were cut at ``order_batch_size``: keep cutting them there where the
        micro-batch divides it (the same order of images: the images a checkpoint trained in its epoch are that
        epoch's first here too) and return True; otherwise cut them at the micro-batch (another order)."""
        kept = order_batch_size % self.batch_size == 0 and not (
            self.drop_last and order_batch_size != self.batch_size
        )
        self.order_batch_size = order_batch_size if kept else self.batch_size
        return kept

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch = int(epoch)
        self._skip = max(0, int(skip_batches))

    def bucket_samples(self) -> tuple[int, ...]:
        """The samples of each bucket, largest first (:func:`bucket_samples`, as the step arithmetic takes
        them)."""
        return tuple(sorted((len(ix) for ix in self._by_bucket.values()), reverse=True))

    def _total_batches(self) -> int:
        if self.drop_last:
            return sum(len(ix) // self.batch_size for ix in self._by_bucket.values())
        return sum(math.ceil(len(ix) / self.batch_size) for ix in self._by_bucket.values())

    def __len__(self) -> int:
        total = self._total_batches()
        if self.drop_last:
            return total // self.num_replicas
        return math.ceil(total / self.num_replicas)

    def epoch_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All ranks' batches of one epoch, in order (before sharding)."""
        epoch = self.epoch if epoch is None else epoch
        cut, size = self.order_batch_size, self.batch_size
        batches: list[list[int]] = []
        for b in sorted(self._by_bucket):
            ix = list(self._by_bucket[b])
            if self.shuffle:
                _rng(self.seed, epoch, "bucket", b).shuffle(ix)
            for s in range(0, len(ix), cut):
                chunk = ix[s : s + cut]
                if len(chunk) == cut or not self.drop_last:
                    batches.append(chunk)
        if self.shuffle:
            _rng(self.seed, epoch, "batches").shuffle(batches)
        if cut == size:
            return batches
        return [chunk[s : s + size] for chunk in batches for s in range(0, len(chunk), size)]

    def order_digest(self, epoch: int | None = None) -> str:
        """A fingerprint of an epoch's order of images (its batches flattened: the same at every micro-batch in one
        order batch): a resume drawn in another order (another seed, buckets on or off) is told by it."""
        flat = ",".join(str(i) for batch in self.epoch_batches(epoch) for i in batch)
        return hashlib.sha256(flat.encode()).hexdigest()[:16]

    def batches_within(self, images: int, epoch: int | None = None) -> int:
        """How many of an epoch's first batches (:meth:`epoch_batches`, before sharding) lie wholly within the
        first ``images`` images of its order."""
        n = 0
        for batch in self.epoch_batches(epoch):
            images -= len(batch)
            if images < 0:
                break
            n += 1
        return n

    def images_in(self, batches: int, epoch: int | None = None) -> int:
        """The images of an epoch's first ``batches`` batches (:meth:`epoch_batches`, before sharding)."""
        return sum(len(b) for b in self.epoch_batches(epoch)[: max(0, batches)])

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.epoch_batches()
        per_rank = len(self)
        need = per_rank * self.num_replicas
        if need < len(batches):
            batches = batches[:need]
        elif batches:
            while len(batches) < need:
                batches = batches + batches[: need - len(batches)]
        mine = batches[self.rank :: self.num_replicas]
        skip, self._skip = self._skip, 0
        yield from mine[skip:]
