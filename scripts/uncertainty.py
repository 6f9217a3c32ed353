#!/usr/bin/env python
"""Write profiles/uncertainty.yaml: how far measurements fall from the planner's predictions out of sample.

Runs benchmarks/planner_accuracy.py's out-of-sample evaluation (the validation set in benchmarks/validation/,
never used to fit anything), takes measured / predicted for every peak VRAM and every step time (1 / it/s),
and writes the 10th and 90th percentiles (linear interpolation between order statistics), widened to at
least +-5% (a range narrower than that would claim more than any of these reports measure): ``peak_vram`` and
``seconds`` from the SD 1.x/2.x/SDXL points, ``transformer`` from the SD3.5 / FLUX.1 ones (the planner errs
differently on the two kinds of network). The planner shows every prediction ``x`` as "x (likely low*x -
high*x)" and decides fits on the upper end.

The scaled basis (a plan's speed scaled by the nearest sdplan bench point on its GPU) gets its own time range,
``seconds_scaled``: the same percentiles over the bench speeds, each predicted so with the point itself left
out of the calibration and the evidence (calibration data used out of sample, not the validation set); a peak
scaled by the bench point at the same settings and another batch likewise gets ``peak_scaled``. The time of the
images a run samples (class images, grids) gets ``sampling_seconds``: the txt2img speeds of
benchmarks/validation/sampling/ against the sampling time's prediction.

Run after the planner's model, the profiles or the validation set changes: ``python scripts/uncertainty.py`` (``--check``
only prints). Reads benchmarks/; `sdplan recommend` reads only the YAML this writes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "profiles" / "uncertainty.yaml"
LOW_Q, HIGH_Q = 0.10, 0.90
FLOOR = 0.05  # the range is at least [1 - FLOOR, 1 + FLOOR]


def _accuracy():
    spec = importlib.util.spec_from_file_location(
        "planner_accuracy", ROOT / "benchmarks" / "planner_accuracy.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def factors(ratios: list[float]) -> dict:
    """measured / predicted ratios -> {low, high, n, median}."""
    if not ratios:
        return {"low": 1.0 - FLOOR, "high": 1.0 + FLOOR, "n": 0}
    return {
        "low": round(min(quantile(ratios, LOW_Q), 1.0 - FLOOR), 3),
        "high": round(max(quantile(ratios, HIGH_Q), 1.0 + FLOOR), 3),
        "n": len(ratios),
        "median": round(statistics.median(ratios), 3),
    }


def residuals(figures: list[dict]) -> tuple[list[float], list[float]]:
    """(peak VRAM measured/predicted, step seconds measured/predicted) from planner_accuracy's figure rows."""
    vram = [r["published"] / r["predicted"] for r in figures if r["quantity"] == "peak VRAM GiB"]
    # seconds = 1 / it/s, so measured / predicted seconds = predicted it/s / measured it/s
    secs = [r["predicted"] / r["published"] for r in figures if r["quantity"].startswith("it/s")]
    return vram, secs


_NEUTRAL = {
    "schema_version": 1,
    "method": "none",
    "peak_vram": {"low": 1.0, "high": 1.0, "n": 0},
    "seconds": {"low": 1.0, "high": 1.0, "n": 0},
}


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compute() -> dict:
    if not OUT.is_file():  # the profile loader needs one; the first run starts from "no uncertainty"
        OUT.write_text(
            yaml.safe_dump({**_NEUTRAL, "source": "bootstrap: replaced by scripts/uncertainty.py"})
        )
    acc = _accuracy()
    prof = acc.shipped_profiles()
    points = acc.load_validation(acc.VALIDATION_DIR, prof)
    oos = acc.out_of_sample(prof, points)
    # the transformer families (SD3.5 / FLUX.1) get their own bands: the planner errs differently on them
    flow = {p.id for p in points if acc._family_and_rank(p)[1]}
    vram, secs = residuals([r for r in oos["figures"] if r["id"] not in flow])
    vram_flow, secs_flow = residuals([r for r in oos["figures"] if r["id"] in flow])
    bench = acc.bench_leave_one_out(prof)
    scaled = [r["predicted"] / r["published"] for r in bench["figures"] if r["basis"] == "scaled"]
    peaks = acc.bench_peak_leave_one_out(prof)
    peak_scaled = [r["published"] / r["predicted"] for r in peaks["figures"] if r["basis"] == "scaled"]
    # seconds = 1 / it/s: measured / predicted seconds = predicted it/s / measured it/s
    sampling_points = acc.load_sampling_validation()
    sampling_oos = acc.sampling_out_of_sample(prof, sampling_points)
    sampling = [r["predicted"] / r["published"] for r in sampling_oos["figures"]]
    date = datetime.date.today().isoformat()
    return {
        "schema_version": 1,
        "source": (
            f"computed: scripts/uncertainty.py from the out-of-sample residuals of benchmarks/planner_accuracy.py "
            f"(benchmarks/validation/, {oos['summary']['points']} points, {oos['summary']['sources']} sources); "
            f"seconds_scaled from the {len(scaled)} sdplan bench speeds in profiles/ that a plan scales when "
            f"each is left out; peak_scaled from the {len(peak_scaled)} sdplan bench peaks that a plan scales from "
            f"another batch when each is left out; sampling_seconds from the {len(sampling)} txt2img speeds of "
            f"benchmarks/validation/sampling/ ({len({r['source'].split('#')[0] for r in sampling_oos['figures']})} "
            f"pages); commit {_commit()}, {date}"
        ),
        "method": (
            f"measured / predicted; low and high are the {int(LOW_Q * 100)}th and {int(HIGH_Q * 100)}th "
            f"percentiles, at least +-{int(FLOOR * 100)}%"
        ),
        "peak_vram": factors(vram),
        "seconds": factors(secs),
        "transformer": {"peak_vram": factors(vram_flow), "seconds": factors(secs_flow)},
        # a plan whose speed is the model scaled by the nearest sdplan bench point on its GPU (basis "scaled"):
        # each bench speed predicted so without itself (planner_accuracy.bench_leave_one_out)
        "seconds_scaled": factors(scaled),
        # a plan whose peak is the model scaled by the bench point on its GPU at the same settings and the
        # nearest other batch: each bench peak predicted so without itself (bench_peak_leave_one_out)
        "peak_scaled": factors(peak_scaled),
        # the time of the images a run samples (planner.sampling_seconds): the validation set's txt2img speeds
        # (planner_accuracy.sampling_out_of_sample)
        "sampling_seconds": factors(sampling),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print, write nothing")
    ap.add_argument("--out", type=Path, default=OUT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    data = compute()
    text = (
        "# How far measurements fall from the planner's predictions, out of sample.\n"
        "# Written by scripts/uncertainty.py; do not edit by hand, re-run the script.\n"
        + yaml.safe_dump(data, sort_keys=False, width=110)
    )
    if args.check:
        print(text, end="")
        return 0
    args.out.write_text(text)
    pv, sc = data["peak_vram"], data["seconds"]
    tpv, tsc = data["transformer"]["peak_vram"], data["transformer"]["seconds"]
    print(
        f"wrote {args.out}: SD 1.x/2.x/SDXL peak VRAM x{pv['low']}-{pv['high']} (n={pv['n']}), "
        f"time x{sc['low']}-{sc['high']} (n={sc['n']}); SD3.5 / FLUX.1 peak VRAM x{tpv['low']}-{tpv['high']} "
        f"(n={tpv['n']}), time x{tsc['low']}-{tsc['high']} (n={tsc['n']}); scaled by a bench point "
        f"x{data['seconds_scaled']['low']}-{data['seconds_scaled']['high']} (n={data['seconds_scaled']['n']}); "
        f"peak scaled from another batch x{data['peak_scaled']['low']}-{data['peak_scaled']['high']} "
        f"(n={data['peak_scaled']['n']}); sampling x{data['sampling_seconds']['low']}-"
        f"{data['sampling_seconds']['high']} (n={data['sampling_seconds']['n']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
