#!/usr/bin/env python
"""How far the planner's predictions are from what `sdplan bench` measured, before and after it learns them.

For every point `sdplan bench` wrote to a profile store (demo and simulated points excluded):

- memory: the planner's predicted allocated bytes (its peak minus the CUDA context / allocator overhead it adds,
  i.e. what ``torch.cuda.max_memory_allocated`` sees) against the measured peak, and the predicted total peak;
  an out-of-memory point checks that the planner does not predict a fit;
- speed, "before": it/s predicted from the shipped profiles only (calibrated, as the planner was before this
  machine was measured); "loo": leave-one-out, calibrated on the shipped profiles plus every OTHER bench point
  (how well measurements of this GPU predict a configuration not measured); "after": what `sdplan recommend`
  uses once the point is in the store (the measured it/s itself, basis measured).

Then the median and maximum absolute error of each column.

    python benchmarks/bench_vs_planner.py [--store DIR] [--json]

Without GPU points in the store (this needs `sdplan bench` on a GPU) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from sdplan import planner as P
from sdplan.bench import MEASURED_PREFIX, OOM_HOOK_ENV
from sdplan.profiles import GiB, load_profiles, local_dir


def _err(pred: float | None, meas: float | None) -> float | None:
    if pred is None or not meas:
        return None
    return 100.0 * (pred - meas) / meas


def bench_points(profiles) -> list:
    return [
        p
        for p in profiles.points
        if p.origin == "local"
        and p.source.startswith(MEASURED_PREFIX)
        and not p.source.startswith(f"{MEASURED_PREFIX} --demo")
        and OOM_HOOK_ENV not in p.source
        and profiles.point_gpu(p) is not None
    ]


def rows(store: Path) -> list[dict]:
    shipped_only = load_profiles(local=store / "__none__")
    with_store = load_profiles(local=store)
    mine = bench_points(with_store)
    cal_before = P.calibrate(shipped_only)
    out = []
    for p in mine:
        spec = with_store.point_gpu(p)
        s = P.setup_from_point(p)
        mem = P.memory(with_store, s)
        allocated = mem.step_peak - mem.overhead
        row = {
            "id": p.id,
            "gpu": spec.name,
            "fits": p.outcome.get("fits"),
            "measured_gib": p.outcome.get("peak_vram_gib"),
            "predicted_alloc_gib": allocated / GiB,
            "predicted_peak_gib": mem.peak / GiB,
            "vram_gib": spec.memory_gib,
        }
        row["memory_err_pct"] = _err(row["predicted_alloc_gib"], row["measured_gib"])
        if p.outcome.get("fits") is False:
            row["oom_predicted"] = mem.peak > spec.memory_bytes
        it_s = p.outcome.get("it_s")
        if it_s:
            before = P.step_seconds(shipped_only, s, spec, cal_before)
            others = replace(with_store, points=tuple(q for q in with_store.points if q.id != p.id))
            # as a plan would state it had this point not been measured: scaled by the nearest other bench point
            loo, _ = P.planned_step_seconds(others, s, spec, P.calibrate(others))
            row |= {
                "measured_it_s": it_s,
                "before_it_s": 1.0 / before if before else None,
                "loo_it_s": 1.0 / loo if loo else None,
                "after_it_s": it_s,
            }
            row["before_err_pct"] = _err(row["before_it_s"], it_s)
            row["loo_err_pct"] = _err(row["loo_it_s"], it_s)
            row["after_err_pct"] = 0.0
        out.append(row)
    return out


def _stats(values: list[float | None]) -> str:
    vals = [abs(v) for v in values if v is not None]
    if not vals:
        return "-"
    return f"median {statistics.median(vals):.1f}%, max {max(vals):.1f}% (n={len(vals)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, default=None, help="profile store (default: the local one)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    store = (args.store or local_dir()).expanduser()
    table = rows(store)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    if not table:
        print(f"no GPU points from `sdplan bench` in {store}: run `sdplan bench` on a GPU first")
        return 0
    head = f"{'point':64} {'meas GiB':>8} {'pred':>6} {'err%':>6}  {'it/s':>6} {'before':>7} {'loo':>7}"
    print(head)
    for r in table:
        mem = f"{r['measured_gib']:8.2f}" if r["measured_gib"] else "     OOM"
        err = f"{r['memory_err_pct']:+6.1f}" if r["memory_err_pct"] is not None else "     -"
        if r.get("fits") is False:
            err = " ok" if r.get("oom_predicted") else " MISS"
        speed = ""
        if r.get("measured_it_s"):
            b = r["before_err_pct"]
            loo = r["loo_err_pct"]
            speed = (
                f"{r['measured_it_s']:6.2f} {b:+6.1f}% {loo:+6.1f}%"
                if b is not None and loo is not None
                else f"{r['measured_it_s']:6.2f}"
            )
        print(f"{r['id'][:64]:64} {mem} {r['predicted_alloc_gib']:6.2f} {err}  {speed}")
    print()
    print("peak allocated, predicted vs measured:", _stats([r["memory_err_pct"] for r in table]))
    print("it/s before (shipped profiles only):  ", _stats([r.get("before_err_pct") for r in table]))
    print("it/s leave-one-out (other bench points):", _stats([r.get("loo_err_pct") for r in table]))
    print("it/s after (the point is in the store): 0% by construction (basis measured)")
    misses = [r["id"] for r in table if r.get("fits") is False and not r.get("oom_predicted")]
    if misses:
        print(f"OOM points the planner predicted to fit: {', '.join(misses)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
