#!/usr/bin/env python
"""Peak GPU memory of sdplan's trainer's sample grid, measured, against the planner's ``sampling_peak``.

The trainer ends every run (and, with ``sampling.every_steps``, stops every so often) with a sample grid: the
VAE and, unless their outputs are cached for SD3.5 / FLUX.1, the text encoders come back to the GPU beside the
training state, and the pipeline denoises and decodes at the training resolution (trainer/outputs.py
``samples``). The planner predicts that peak from meta-device counts (``planner.sampling_peak_bytes`` /
``flow_sampling_peak_bytes``) and says when the final grid would not fit; no GPU had measured it.

Per configuration: the trainer's loop pieces on random full-size networks (``bench_harness.Harness``, as
``sdplan bench`` runs them), two optimizer steps, then the trainer's own sample grid of one prompt with 2
denoising steps (the peak does not grow with them); printed: the training steps' allocated peak and the grid's
(``torch.cuda.max_memory_allocated``, reset between), and the planner's for both (allocated: without the CUDA
context and allocator allowances).

GPU:   python benchmarks/sampling_peak.py [--configs flux-dev:1024,sdxl:1024,sd15:512] [--json]
CPU (the tiny models, to try the code; no allocator figures):   python benchmarks/sampling_peak.py --demo
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 2**30
DEFAULT_CONFIGS = "flux-dev:1024,sdxl:1024,sd15:512"


def request(model: str, resolution: int):
    """LoRA as `sdplan bench` measures each family on a GPU: bf16, checkpointing, cached latents, and cached
    text-encoder outputs for the transformer families (their encoders then stay away from the grid too)."""
    from sdplan import registry
    from sdplan.bench import BenchRequest

    flow = registry.family(model).flow
    return BenchRequest(
        method="lora",
        model=model,
        resolution=resolution,
        precision="bf16",
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=flow,
        lora_rank=16,
    )


def allocated(peak_bytes: float) -> float:
    """A planner peak without its allowances (planner._overhead_bytes inverted)."""
    from sdplan import planner as P

    return (peak_bytes - P.CUDA_CONTEXT_BYTES) / (1 + P.ALLOCATOR_OVERHEAD)


def measure(model: str, resolution: int, batch: int, demo: bool) -> dict:
    import torch

    from sdplan import planner as P
    from sdplan.bench import request_settings, sample_grid_peak
    from sdplan.bench_harness import Harness, free_memory
    from sdplan.profiles import load_profiles

    req = request(model, 64 if demo else resolution)
    cuda = torch.cuda.is_available() and not demo
    row: dict = {"model": model, "resolution": req.resolution, "batch": batch}
    mem = P.memory(load_profiles(), request_settings(req, batch))
    row["predicted_step_gib"] = round(allocated(mem.step_peak) / GiB, 3)
    row["predicted_grid_gib"] = round(allocated(mem.sampling_peak) / GiB, 3)
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(req, device="cuda" if cuda else "cpu", demo=demo, workdir=Path(tmp), keep_vae=True)
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for _ in range(2):
                h.step(batch)
            if cuda:  # the grid's peak as `sdplan bench` measures it
                row["step_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 3)
                row["before_grid_gib"] = round(torch.cuda.memory_allocated() / GiB, 3)
                peak = sample_grid_peak(h, Path(tmp))
                row["grid_written"] = (Path(tmp) / "sample-grid.png").is_file()
                if peak is None:
                    row["error"] = "out of memory in the sample grid"
                else:
                    row["grid_gib"] = round(peak / GiB, 3)
                row["gpu"] = torch.cuda.get_device_name()
            else:
                grid = h.sample_grid(Path(tmp) / "grid.png")
                row["grid_written"] = grid is not None and Path(grid).is_file()
        finally:
            h.close()
            del h
            free_memory()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="MODEL:RESOLUTION,... (LoRA, batch --batch)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--demo", action="store_true", help="the tiny models on the CPU")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for item in args.configs.split(","):
        model, _, res = item.partition(":")
        try:
            row = measure(model, int(res or 1024), args.batch, args.demo)
        except Exception as e:  # one configuration's failure (out of memory included) is a result
            row = {
                "model": model,
                "resolution": res,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
            }
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"{model} at {res}px: {row['error']}", flush=True)
        else:
            measured = (
                f"step {row['step_gib']:.2f}, grid {row['grid_gib']:.2f} GiB"
                if "grid_gib" in row
                else f"grid written: {row['grid_written']} (no allocator figures on the CPU)"
            )
            print(
                f"{model} at {row['resolution']}px batch {row['batch']}: {measured}; planner step "
                f"{row['predicted_step_gib']:.2f}, grid {row['predicted_grid_gib']:.2f} GiB",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
