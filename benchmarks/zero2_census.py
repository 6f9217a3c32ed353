"""DeepSpeed ZeRO-2 (no offload): the bytes per trained parameter each process holds, counted on the CPU.

Run under two processes (and one, to compare):

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc_per_node 2 benchmarks/zero2_census.py

It builds a bf16 model of plain Linear layers, initialises DeepSpeed ZeRO-2 (overlap_comm, contiguous
gradients, as sdplan.launch writes it) and counts the live tensors' distinct storages after the forward's
start, the backward and the optimizer step, twice. The planner's :func:`sdplan.planner.deepspeed_states` rests
on it: 2 + 4/N bytes per parameter before the first step (half weights, fp32 master partition), + 2/N after the
backward (the kept half gradient partition; the reduce buckets are released), 2 + 12/N after the step (AdamW's
two moments on the partition). What it cannot see on the CPU: the step's fp32 gradient partition (4/N, freed
before the step returns), which DeepSpeed's own estimate counts (2 + 18/N).
"""

from __future__ import annotations

import gc
import json
import os
import warnings

WIDTH, DEPTH, BUCKET = 1024, 16, 1_000_000


def live_bytes() -> int:
    """Bytes of the distinct tensor storages alive now."""
    import torch

    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        storage = o.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def main() -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    params = sum(p.numel() for p in model.parameters())
    world = int(os.environ.get("WORLD_SIZE", 1))
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
        },
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(2, WIDTH, dtype=torch.bfloat16)
    rows = {}
    for i in range(2):
        gc.collect()
        rows[f"step {i} before forward"] = live_bytes()
        engine.backward(engine(x).float().pow(2).mean())
        gc.collect()
        rows[f"step {i} after backward"] = live_bytes()
        engine.step()
        gc.collect()
        rows[f"step {i} after step"] = live_bytes()
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print(f"{params} parameters, {n} process(es); bytes per parameter on each process:")
        for name, b in rows.items():
            print(f"  {name:24s} {b / params:6.3f}")
        print(json.dumps({"params": params, "world": n, **rows}))


if __name__ == "__main__":
    main()
