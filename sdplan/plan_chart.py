"""The plan as a picture (``plan.png``, written by ``sdplan recommend --out`` beside the config): where the
predicted peak memory goes, how it compares with the card, and how peak and run time move with the batch.

:func:`chart_data` computes everything from the planner's result (pure); :func:`render_png` draws it
(matplotlib's Agg canvas, no pyplot state, no torch)."""

from __future__ import annotations

import io
from typing import Any

from sdplan import planner
from sdplan.settings import describe

GiB = 2**30
FILE_NAME = "plan.png"
MIN_PART_GIB = 0.05  # smaller parts are left out of the bar (they would not show)

# Memory's parts, in the order they are stacked, with the words the plan's reasons use
PART_LABELS = {
    "weights": "trained weights",
    "frozen": "frozen weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "ema": "EMA copy",
    "autocast_copies": "autocast copies",
    "activations": "activations",
    "step_transient": "step temporaries",
    "overhead": "GPU runtime context + allocator",
}

# How each of the planner's verdicts on a batch is drawn (matplotlib plot keywords) and what the legend says of it
VERDICT_MARKS: dict[str, tuple[dict[str, Any], str]] = {
    planner.FITS: ({"marker": "o", "color": "C0"}, "fits (likely range under the card)"),
    planner.MAY_RUN_OUT: (
        {"marker": "^", "color": "gold", "markeredgecolor": "black", "markersize": 10},
        "may run out of memory (likely range over the card)",
    ),
    planner.DOES_NOT_FIT: (
        {"marker": "x", "color": "red", "markersize": 9, "markeredgewidth": 2},
        "does not fit",
    ),
}


def chart_data(res: planner.Result, profiles: Any) -> dict[str, Any]:
    """What plan.png shows, in GiB and minutes: the plan's memory parts, its stated peak and likely range,
    the card's memory and the plan's limit on it, and the plan's settings at other batch sizes
    (:func:`sdplan.planner.batch_sweep`). Each batch carries the planner's own verdict on it
    (:attr:`sdplan.planner.Candidate.verdict`), the plan too (its batch's)."""
    if res.plan is None or res.memory is None:
        raise ValueError("no plan to draw")
    s, m = res.plan, res.memory
    parts = [(PART_LABELS[k], v / GiB) for k, v in m.parts().items() if v >= MIN_PART_GIB * GiB]
    card = (res.vram_bytes or 0) / GiB
    sweep = [
        {
            "batch": c.setup.batch,
            "peak": c.memory.peak / GiB,
            "low": c.peak_range[0] / GiB,
            "high": c.peak_range[1] / GiB,
            "minutes": c.seconds / 60 if c.seconds is not None else None,
            "verdict": c.verdict,
            # the search's rule: a global batch holds no more than the distinct images (unless the batch is
            # pinned): such a batch was not a candidate, whatever its peak and time
            "tried": res.request.pinned("batch")
            or c.setup.batch == 1
            or c.setup.batch * c.setup.num_gpus <= res.request.images,
        }
        for c in planner.batch_sweep(res, profiles)
    ]
    # the GPUs the plan runs on (not GPU 0 where the machine's differ)
    used = planner.plan_gpus(res.hardware, s)
    return {
        "title": f"{s.method} {s.model} at {s.resolution}px on {planner.gpus_label(used) if used else 'this machine'}: "
        + describe(s, gpus=False, short=True),
        "parts": parts,
        "peak": m.peak / GiB,
        # the caption pass before training, where it is the plan's peak (the bars are the step's parts)
        "caption_pass": m.text_cache_peak / GiB if m.text_cache_peak > m.step_peak else None,
        "peak_range": (res.peak_range[0] / GiB, res.peak_range[1] / GiB) if res.peak_range else None,
        "peak_basis": res.peak_basis,
        "card": card,
        "limit": card * planner.HEADROOM,
        # the dashed line is the estimate's limit only: the likely range's is the card itself (planner.vram_required)
        "limit_label": f"the estimate's limit ({int(planner.HEADROOM * 100)}%; the likely range's is the card)",
        "batch": s.batch,
        "verdict": next(r["verdict"] for r in sweep if r["batch"] == s.batch),
        "minutes": res.seconds / 60 if res.seconds is not None else None,
        "sweep": sweep,
    }


def render_png(data: dict[str, Any]) -> bytes:
    """plan.png's bytes: the memory breakdown (left) and peak / run time against the batch (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    fig.suptitle(data["title"], fontsize=11)

    # left: the parts stacked in one bar, the stated peak with its likely range, the card and the limit
    start = 0.0
    colors = [f"C{i}" for i in range(10)]
    for i, (label, gib) in enumerate(data["parts"]):
        left.barh(0, gib, left=start, height=0.5, color=colors[i % 10], label=f"{label} {gib:.1f}")
        start += gib
    peak = data["peak"]
    if data["peak_range"]:
        low, high = data["peak_range"]
        left.errorbar(
            peak, 0.45, xerr=[[peak - low], [high - peak]], fmt="kv", capsize=6, label="peak, likely range"
        )
    else:
        left.plot(peak, 0.45, "kv", label="peak")
    if data["card"]:
        left.axvline(data["card"], color="red", linewidth=2, label=f"card {data['card']:.1f}")
        left.axvline(data["limit"], color="red", linestyle="--", linewidth=1, label=data["limit_label"])
    left.set_yticks([])
    left.set_ylim(-0.6, 0.8)
    left.set_xlabel("GiB per GPU")
    rng = f" (likely {data['peak_range'][0]:.1f}-{data['peak_range'][1]:.1f})" if data["peak_range"] else ""
    title = f"{data['peak_basis']} peak {peak:.1f} GiB{rng}"
    if data.get("caption_pass"):  # the bars are the step's; the peak is the pass before training
        title += (
            f"\nthe step's parts add up to {start:.1f}; the peak is the caption pass before training "
            "(text encoders and VAE on the GPU)"
        )
    elif data["peak_basis"] != "predicted":  # the bars are the model's parts; the peak is sdplan bench's
        title += f"\nthe model's parts add up to {start:.1f}; the peak is from sdplan bench"
    elif start > 1.05 * peak:  # the parts are not all alive at once: the peak is the largest phase
        title += f"\nthe parts add up to {start:.1f}: not all are alive at once"
    if data["verdict"] != planner.FITS:  # as the plan's reasons warn
        title += f"\n{data['verdict']}: the likely range's upper end is over the card"
    left.set_title(title, fontsize=10)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=2)  # below: never on a bar
    left.grid(True, axis="x", alpha=0.3)

    # right: peak (likely range shaded) and whole-run time against the batch
    sweep = data["sweep"]
    xs = [r["batch"] for r in sweep]
    right.fill_between(xs, [r["low"] for r in sweep], [r["high"] for r in sweep], color="C0", alpha=0.2)
    right.plot(xs, [r["peak"] for r in sweep], "-", color="C0", label="peak VRAM (likely range shaded)")
    for verdict, (style, label) in VERDICT_MARKS.items():  # each batch as the planner judges it
        rows = [r for r in sweep if r["verdict"] == verdict and r.get("tried", True)]
        if rows:
            right.plot(
                [r["batch"] for r in rows], [r["peak"] for r in rows], linestyle="", label=label, **style
            )
    untried = [r for r in sweep if not r.get("tried", True)]
    if untried:  # faster-looking, but over the distinct images: the search did not take it (its reasons say)
        right.plot(
            [r["batch"] for r in untried],
            [r["peak"] for r in untried],
            linestyle="",
            marker="o",
            markerfacecolor="white",
            color="grey",
            label="not tried: more images a step than the distinct images",
        )
    if data["card"]:
        right.axhline(data["card"], color="red", linewidth=2)
        right.axhline(data["limit"], color="red", linestyle="--", linewidth=1)
    right.axvline(data["batch"], color="grey", linestyle=":", label=f"plan: batch {data['batch']}")
    right.set_xscale("log", base=2)
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlabel("batch size")
    right.set_ylabel("GiB per GPU")
    right.grid(True, alpha=0.3)
    handles, names = right.get_legend_handles_labels()
    timed = [(r["batch"], r["minutes"]) for r in sweep if r["minutes"] is not None]
    if timed:
        twin = right.twinx()
        twin.plot(*zip(*timed), "s--", color="C1", label="whole run (min)")
        twin.set_ylabel("whole run, minutes")
        twin.set_ylim(0, 1.15 * max(t for _, t in timed))
        h2, n2 = twin.get_legend_handles_labels()
        handles, names = handles + h2, names + n2
    right.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=2)
    right.set_title("the plan's settings at other batch sizes", fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.93, top=0.85, bottom=0.3, wspace=0.25)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", pad_inches=0.2)  # the legends whole, below the axes
    return buf.getvalue()
