#!/usr/bin/env python
"""How fast DeepSpeed's CPU Adam updates parameters on this host: the optimizer step DeepSpeed ZeRO-2 with
optimizer offload runs on the CPU once per optimizer step (planner.CPU_ADAM_PARAMS_PER_S; `sdplan bench --host`
measures it too, and the planner uses that for this host).

One flat fp32 parameter of --params elements with a gradient, DeepSpeedCPUAdam (AdamW mode, AVX kernels); one
untimed step allocates the moments, then the median of --steps timed steps. For comparison, torch's AdamW
(foreach) on the same tensor: DeepSpeed documents its CPU Adam at 5-7x torch's.

    DS_ACCELERATOR=cpu python benchmarks/cpu_adam_rate.py [--params 2e8] [--threads N]

Needs `pip install 'deepspeed>=0.15'` (the CPU Adam extension is compiled on first use).
"""

from __future__ import annotations

import argparse
import os

from sdplan.bench_harness import cpu_adam_rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=2e8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    ds = cpu_adam_rate(n, args.steps, "deepspeed")
    pt = cpu_adam_rate(n, args.steps, "torch")
    print(f"{n / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPU(s):")
    print(f"  DeepSpeedCPUAdam       {ds / 1e9:.2f} G params/s")
    print(f"  torch AdamW (foreach)  {pt / 1e9:.2f} G params/s  (DeepSpeed {ds / pt:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
