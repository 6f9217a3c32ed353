#!/usr/bin/env python
"""Predicted vs published/measured for every profile point, and the wall time of `sdplan recommend`.

Prints one row per figure (memory peak, host RAM, it/s, multi-GPU ratios) with its error, the median and
maximum absolute error, every "fits in X GB" check, and the recommend wall time (which must stay well under
1 s with no torch import). Run: ``python benchmarks/planner_accuracy.py [--json]``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from sdplan import planner as P
from sdplan.profiles import GiB, load_profiles


def rows(profiles=None) -> tuple[list[dict], list[dict]]:
    """(numeric comparisons, fits checks) for every point and multi-GPU observation."""
    prof = profiles or load_profiles()
    cal = P.calibrate(prof)
    numeric, checks = [], []
    for p in prof.points:
        s = P.setup_from_point(p)
        m = P.memory(prof, s)
        o = p.outcome
        if o.get("peak_vram_gib"):
            numeric.append(_row(p.id, "peak VRAM GiB", m.peak / GiB, o["peak_vram_gib"], p.source))
        if o.get("ram_gib"):
            numeric.append(_row(p.id, "host RAM GiB", m.ram / GiB, o["ram_gib"], p.source))
        if o.get("it_s"):
            spec = prof.gpu_or_none(p.gpu)
            st = P.step_seconds(prof, s, spec, cal)
            numeric.append(_row(p.id, f"it/s on {spec.name}", 1.0 / st, o["it_s"], p.source))
        if o.get("max_vram_gib"):
            checks.append(
                {
                    "id": p.id,
                    "claim": f"fits in {o['max_vram_gib']} GB",
                    "predicted_gib": round(m.peak / GiB, 2),
                    "ok": m.peak / GiB <= o["max_vram_gib"],
                }
            )
        if o.get("exceeds_vram_gib"):
            checks.append(
                {
                    "id": p.id,
                    "claim": f"does not fit in {o['exceeds_vram_gib']} GB",
                    "predicted_gib": round(m.peak / GiB, 2),
                    "ok": m.peak / GiB > o["exceeds_vram_gib"],
                }
            )
    for mg in prof.multi_gpu:
        spec = prof.gpu_or_none(mg.gpu)
        s1 = P.Setup(
            method=mg.method,
            model=mg.model,
            resolution=mg.resolution,
            precision=mg.precision,
            gradient_checkpointing=mg.options.gradient_checkpointing,
            optimizer=mg.options.optimizer,
            cache_latents=mg.options.cache_latents,
            lora_rank=mg.options.lora_rank or 16,
            full_half_weights=mg.options.full_half_weights,
        )
        link = P._link_gbs_for(spec, mg.interconnect)
        t1 = P.step_seconds(prof, s1, spec, cal)
        tn = P.step_seconds(prof, replace(s1, num_gpus=mg.num_gpus), spec, cal, link_gbs=link)
        if mg.outcome.get("iteration_time_ratio"):
            numeric.append(
                _row(mg.id, "iteration time ratio", tn / t1, mg.outcome["iteration_time_ratio"], mg.source)
            )
        if mg.outcome.get("run_time_ratio"):
            numeric.append(
                _row(
                    mg.id,
                    "run time ratio (normalised)",
                    tn / t1 / mg.num_gpus,
                    mg.outcome["run_time_ratio"],
                    mg.source,
                )
            )
    return numeric, checks


def _row(pid: str, what: str, predicted: float, published: float, source: str) -> dict:
    return {
        "id": pid,
        "quantity": what,
        "predicted": round(predicted, 3),
        "published": published,
        "error_pct": round(100.0 * (predicted - published) / published, 1),
        "source": source,
    }


def recommend_wall_time(runs: int = 3) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "sdplan.cli",
        "recommend",
        "--method",
        "lora",
        "--hardware",
        "2x RTX 4090",
        "--json",
    ]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    probe = (
        "import sys; from sdplan.cli import app\n"
        "try:\n app(['recommend','--method','dreambooth','--hardware','RTX 4090','--json'], standalone_mode=False)\n"
        "except SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return {
        "median_s": round(statistics.median(times), 3),
        "runs": [round(t, 3) for t in times],
        "torch_imported": out.strip().splitlines()[-1] == "True",
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    numeric, checks = rows()
    errors = [abs(r["error_pct"]) for r in numeric]
    wall = recommend_wall_time()
    summary = {
        "median_abs_error_pct": round(statistics.median(errors), 1) if errors else None,
        "max_abs_error_pct": round(max(errors), 1) if errors else None,
        "fits_checks_passed": f"{sum(c['ok'] for c in checks)}/{len(checks)}",
        "recommend_wall_time": wall,
    }
    if "--json" in argv:
        print(json.dumps({"figures": numeric, "checks": checks, "summary": summary}, indent=2))
        return 0
    print(f"{'point':38s} {'quantity':30s} {'predicted':>10s} {'published':>10s} {'error':>8s}")
    for r in numeric:
        print(
            f"{r['id']:38s} {r['quantity']:30s} {r['predicted']:10.3f} {r['published']:10.3f} {r['error_pct']:+7.1f}%"
        )
    print()
    for c in checks:
        print(
            f"{'ok ' if c['ok'] else 'NO '} {c['id']:38s} {c['claim']:28s} predicted {c['predicted_gib']:.2f} GiB"
        )
    print()
    print(f"median |error| {summary['median_abs_error_pct']}%, max |error| {summary['max_abs_error_pct']}%")
    print(f"fits checks: {summary['fits_checks_passed']}")
    print(
        f"sdplan recommend wall time: median {wall['median_s']} s over {len(wall['runs'])} runs; torch imported: {wall['torch_imported']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
