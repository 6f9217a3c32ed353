"""Training curves and logs: a loss-curve PNG (matplotlib, Agg, no pyplot state) and a thin TensorBoard
logger that turns into a no-op, with one warning, when tensorboard is not installed."""

from __future__ import annotations

import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Any

from sdplan.extras import install_hint


def ema(values: list[float], smoothing: float = 0.9, x: list[float] | None = None) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing (the first points are not pulled to 0).
    NaN/inf values are skipped (the average carries over); before the first finite value the result is NaN.

    ``x``: where each value lies (increasing; the images seen at each step). ``smoothing`` is then the decay
    over the usual gap between values (the median; the lower one of an even count) and a value ``k`` times
    as far from the previous one decays the average ``smoothing ** k``: a history whose steps cover more
    images after a resume is averaged over the same images, not the same number of steps. Evenly spaced
    ``x`` is the plain average."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    gaps = [1.0] * len(values)  # the first value's gap does not matter: the debiased average starts there
    if x is not None:
        if len(x) != len(values):
            raise ValueError(f"{len(x)} positions for {len(values)} values")
        between = [float(b) - float(a) for a, b in zip(x, x[1:])]
        if any(not g > 0 for g in between):
            raise ValueError("positions must increase")
        usual = sorted(between)[(len(between) - 1) // 2] if between else 1.0
        gaps = [1.0] + [g / usual for g in between]
    out, last, weight = [], 0.0, 0.0
    for v, gap in zip(values, gaps):
        v = float(v)
        if math.isfinite(v):
            decay = smoothing**gap
            last = decay * last + (1 - decay) * v
            weight = decay * weight + (1 - decay)
        out.append(last / weight if weight > 0 else math.nan)
    return out


def loss_curve(
    x: list[float],
    losses: list[float],
    out_path: str | Path,
    lr: list[float] | None = None,
    *,
    smoothing: float = 0.9,
    title: str | None = None,
    xlabel: str = "step",
) -> Path:
    """PNG of the raw loss (thin), its smoothed EMA (thick, :func:`ema` over the x positions) and, when
    given, the learning rate on a second axis. ``x``: the position of each loss (increasing), named
    ``xlabel`` (the trainer draws against the images seen). Written atomically."""
    fig = loss_figure(x, losses, lr, smoothing=smoothing, title=title, xlabel=xlabel)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


FEW_POINTS = 30  # up to this many losses each gets a marker: a line through one point draws nothing


def loss_figure(
    x: list[float],
    losses: list[float],
    lr: list[float] | None = None,
    *,
    smoothing: float = 0.9,
    title: str | None = None,
    xlabel: str = "step",
):
    """The matplotlib Figure :func:`loss_curve` saves. Up to :data:`FEW_POINTS` losses are drawn as markers
    too (a one-step run's loss.png showed no point at all); positions that are whole numbers (steps, images
    seen) get whole-number ticks (one point had ticks 0.96 ... 1.04 images seen)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    x, losses = list(x), [float(v) for v in losses]
    if len(x) != len(losses):
        raise ValueError(f"{len(x)} positions for {len(losses)} losses")
    if lr is not None and len(lr) != len(x):
        raise ValueError(f"{len(lr)} learning rates for {len(x)} positions")
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    few = {"marker": "o", "markersize": 4} if len(x) <= FEW_POINTS else {}
    ax.plot(
        x,
        losses,
        color="tab:blue",
        alpha=0.35 if len(x) > FEW_POINTS else 0.6,
        linewidth=1,
        label="loss",
        **few,
    )
    smooth = ema(losses, smoothing, x=x)
    ax.plot(x, smooth, color="tab:blue", linewidth=2, label=f"loss (EMA {smoothing})")
    if x and all(float(v).is_integer() for v in x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(set(x)) == 1:  # one position: a range of whole numbers around it, not +-4%
            ax.set_xlim(float(x[0]) - 1, float(x[0]) + 1)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if lr is not None:
        ax2 = ax.twinx()
        ax2.plot(x, [float(v) for v in lr], color="tab:orange", linewidth=1, label="learning rate")
        ax2.set_ylabel("learning rate")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        h2, n2 = ax2.get_legend_handles_labels()
        handles, names = handles + h2, names + n2
    ax.legend(handles, names, loc="upper right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


class TensorBoardLogger:
    """``torch.utils.tensorboard.SummaryWriter`` for the few things a run logs: loss, learning rate, it/s,
    memory and sample images. Without tensorboard installed (``pip install 'tensorboard>=2.15'``) every
    method does nothing and one RuntimeWarning says why; ``enabled`` tells which.

    ``purge_step``: where this session of the run takes up the log (in the steps it logs at: the trainer's
    images seen). TensorBoard hides the points of the log's earlier files at it or past it (SummaryWriter's
    purge_step): what a session trained past its resumed checkpoint, or an attempt the out-of-memory retry
    abandoned, is not shown beside the points trained again (two losses at one x)."""

    def __init__(self, log_dir: str | Path, enabled: bool = True, purge_step: int | None = None):
        self.log_dir = Path(log_dir)
        self._writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            warnings.warn(
                f"TensorBoard logging is off: tensorboard is not installed ({e}); "
                f"install it with: {install_hint('tensorboard')}",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None and value is not None:
            self._writer.add_scalar(tag, float(value), step)

    def log(
        self,
        step: int,
        *,
        loss: float | None = None,
        lr: float | None = None,
        it_per_s: float | None = None,
        memory_bytes: int | None = None,
        **scalars: float,
    ) -> None:
        """One training step's numbers: ``train/loss``, ``train/lr``, ``perf/it_per_s``, ``perf/memory_gib``
        and any ``name=value`` as ``train/name``."""
        self.scalar("train/loss", loss, step)
        self.scalar("train/lr", lr, step)
        self.scalar("perf/it_per_s", it_per_s, step)
        if memory_bytes is not None:
            self.scalar("perf/memory_gib", memory_bytes / 2**30, step)
        for name, value in scalars.items():
            self.scalar(name if "/" in name else f"train/{name}", value, step)

    def image(self, tag: str, image: Any, step: int) -> None:
        """A PIL image, an HWC uint8 array or the path of an image file (e.g. a sample grid PNG)."""
        if self._writer is None:
            return
        import numpy as np
        from PIL import Image

        if isinstance(image, (str, Path)):
            with Image.open(image) as im:
                image = im.convert("RGB")
        if isinstance(image, Image.Image):
            image = np.asarray(image.convert("RGB"))
        self._writer.add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
