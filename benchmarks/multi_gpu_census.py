"""What each process of a data-parallel run holds per trained parameter, counted on the CPU (gloo), for the
planner's multi-GPU memory (:func:`sdplan.planner.memory`, :func:`sdplan.planner.deepspeed_states`).

    DS_ACCELERATOR=cpu .venv/bin/torchrun --nproc_per_node 2 benchmarks/multi_gpu_census.py zero2
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/multi_gpu_census.py ddp      # the trainer's DDP
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/multi_gpu_census.py ddp-copy # DDP's default, for contrast

``ddp``: an fp32 model of 100.7M parameters under DistributedDataParallel with gradient_as_bucket_view=True (as
sdplan's trainer sets it), the process's resident-set growth in units of the gradients' bytes after the
backward and after zero_grad(set_to_none=True), twice. The gradients are views into the all-reduce buckets: one
copy, kept between steps (2026-11-27: 1.21 after the backward, 1.22 after zero_grad; DDP's default copies
them, 2.21 and 1.22).

``zero2``: DeepSpeed ZeRO-2. It builds a bf16 model of plain Linear layers, initialises DeepSpeed ZeRO-2 (overlap_comm, contiguous
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
import sys
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


def ddp(view: bool) -> None:
    """Resident-set growth per gradient byte under DDP (large Linear layers: their buffers are mmapped, so
    freeing them returns the pages)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdplan.bench_harness import rss_bytes

    def rss() -> int:
        gc.collect()
        return rss_bytes()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)])
    params = sum(p.numel() for p in model.parameters())
    grad_bytes = 4 * params
    base = rss()
    wrapped = DistributedDataParallel(model, gradient_as_bucket_view=view)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    x = torch.randn(2, 4096)
    rows = {}
    for i in range(2):
        wrapped(x).pow(2).mean().backward()
        rows[f"step {i} after backward"] = (rss() - base) / grad_bytes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows[f"step {i} after zero_grad"] = (rss() - base) / grad_bytes
    if dist.get_rank() == 0:
        print(
            f"DDP, gradient_as_bucket_view={view}, {params} fp32 parameters, {dist.get_world_size()} processes;"
        )
        print("resident-set growth in gradients' bytes:")
        for name, v in rows.items():
            print(f"  {name:24s} {v:6.2f}")


def zero2() -> None:
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


def main(argv: list[str]) -> None:
    mode = argv[0] if argv else "zero2"
    if mode == "zero2":
        zero2()
    elif mode in ("ddp", "ddp-copy"):
        ddp(view=mode == "ddp")
    else:
        raise SystemExit(f"unknown mode {mode!r}: zero2, ddp or ddp-copy")


if __name__ == "__main__":
    main(sys.argv[1:])
