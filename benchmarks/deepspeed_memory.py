#!/usr/bin/env python
"""Peak GPU memory and step time of the trainer's step under DeepSpeed ZeRO (one process), against the planner.

The planner's DeepSpeed memory (``planner.deepspeed_states``: the trained weights in the training dtype on the
GPU, the gradients' reduce buckets, the fp32 master weights and optimizer state on the host with offload or
split over the processes without) has been checked on the CPU only (``benchmarks/multi_gpu_census.py``), and the
validation set's DeepSpeed SDXL fine-tune on an RTX 4090 is its worst peak (+27.8%). This runs the trainer's own
optimizer step (``bench_harness.Harness`` with ``deepspeed=``: accelerate's DeepSpeed plugin as
``runtime.make_accelerator`` builds it) on random full-size networks, in one process (RANK / WORLD_SIZE /
MASTER_* set here), and prints ``torch.cuda.max_memory_allocated`` over two steps after a warm-up, the median
step time, and the planner's allocated peak for the same settings.

GPU:   python benchmarks/deepspeed_memory.py --model sdxl --method finetune --resolution 1024 --batch 8 [--no-offload]
CPU (the tiny models, DS_ACCELERATOR=cpu; no allocator figures):   python benchmarks/deepspeed_memory.py --demo
One configuration per process: DeepSpeed's process group lives as long as the process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 2**30


def measure(
    model: str, method: str, resolution: int, batch: int, offload: bool, demo: bool, steps: int = 3
) -> dict:
    from sdplan.launch import free_port

    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),  # not a fixed port: a run or test beside this one may hold it
        }
    )
    import torch

    from sdplan import planner as P
    from sdplan.bench import BenchRequest, request_settings
    from sdplan.bench_harness import Harness
    from sdplan.profiles import load_profiles

    req = BenchRequest(
        method=method,
        model=model,
        resolution=64 if demo else resolution,
        precision="bf16",
        gradient_checkpointing=True,
        cache_latents=True,
    )
    ds = {"zero_stage": 2, "offload_optimizer": offload}
    s = replace(request_settings(req, batch), deepspeed=ds)
    mem = P.memory(load_profiles(), s)
    row: dict = {
        "model": model,
        "method": method,
        "resolution": req.resolution,
        "batch": batch,
        "deepspeed": ds,
        "predicted_gib": round((mem.step_peak - mem.overhead) / GiB, 3),
        "predicted_parts_gib": {k: round(v / GiB, 3) for k, v in mem.parts().items() if k != "overhead"},
    }
    cuda = torch.cuda.is_available() and not demo
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(
            req,
            device="cuda" if cuda else "cpu",
            demo=demo,
            workdir=Path(tmp),
            deepspeed={**ds, "micro_batch": batch},
        )
        row["optimizer"] = type(getattr(h.optimizer, "optimizer", h.optimizer)).__name__
        h.step(batch)  # warm-up: DeepSpeed's buffers, the optimizer state
        if cuda:
            torch.cuda.synchronize()
            row["resident_gib"] = round(torch.cuda.memory_allocated() / GiB, 3)
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            h.step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        row["step_s"] = round(statistics.median(times), 3)
        if cuda:
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
            row["gpu"] = torch.cuda.get_device_name()
        h.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sdxl")
    ap.add_argument("--method", default="finetune")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-offload", action="store_true", help="ZeRO-2 without CPU optimizer offload")
    ap.add_argument("--demo", action="store_true", help="the tiny model on the CPU (set DS_ACCELERATOR=cpu)")
    args = ap.parse_args(argv)
    try:
        row = measure(args.model, args.method, args.resolution, args.batch, not args.no_offload, args.demo)
    except Exception as e:  # out of memory, or DeepSpeed's CPU Adam failing to build, is a result
        row = {
            "model": args.model,
            "method": args.method,
            "resolution": args.resolution,
            "batch": args.batch,
            "offload": not args.no_offload,
            "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}",
        }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
