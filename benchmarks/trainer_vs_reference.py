#!/usr/bin/env python
"""What the trainer's training step costs over a bare loop doing the same arithmetic.

Two loops on the same random full-size UNet (SD1.5 or SDXL from profiles/models; nothing is downloaded), LoRA
rank 16 on diffusers' default targets (to_q, to_k, to_v, to_out.0), AdamW, cached latents, the frozen text
encoders run every step, one process:

- ``sdplan``: the step `sdplan bench` times, i.e. the bundled trainer's own loop pieces
  (:class:`sdplan.bench_harness.Harness`: the recipe, accelerate, ``loop.optimizer_step``).
- ``reference``: the loop of diffusers' ``examples/text_to_image/train_text_to_image_lora[_sdxl].py`` written
  out bare: frozen weights in the training dtype, LoRA parameters in fp32, autocast, epsilon MSE, AdamW,
  ``zero_grad(set_to_none=True)``; no accelerate, no logging.

Printed: the median step time of each after warm-up, their ratio (sdplan / reference: 1.00 = no overhead) and,
on a GPU, each loop's peak allocated memory. The issue's target is the trainer within 10% of the reference.

Run on a GPU:   python benchmarks/trainer_vs_reference.py --model sdxl --batch 4 [--profile DIR]
On the CPU (tiny SD1.5- or SDXL-shaped model, fp32, to try it):   python benchmarks/trainer_vs_reference.py --demo
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


PROFILE_DIR: Path | None = None  # --profile: one more step of each loop under torch.profiler, written here


def _timed(step, warmup: int, steps: int, cuda: bool, label: str) -> list[float]:
    """``warmup`` untimed calls of ``step``, then the seconds of each of ``steps`` calls, timed as the bench
    times a probe point (:func:`sdplan.bench_harness.timed_steps`); with --profile, one more step profiled."""
    from sdplan.bench import Effort
    from sdplan.bench_harness import timed_steps

    for _ in range(warmup):
        step()
    seconds = timed_steps(step, Effort(warmup_steps=0, timed_steps=steps, max_batch=1), cuda=cuda)
    if PROFILE_DIR is not None:
        _profile(step, cuda, PROFILE_DIR / f"{label}-profile.txt")
    return seconds


def _profile(step, cuda: bool, path: Path) -> None:
    """Where one step's time goes: the operators by self time and the number of kernels launched (on a GPU)
    and of operators called, for the two loops to be compared line by line."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    kernels = sum(1 for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"aten operators called: {ops}\nGPU kernels: {kernels}\n\n"
        + prof.key_averages().table(sort_by=sort, row_limit=40)
        + (
            "\n\nby host time (where a host-bound step goes):\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
            if cuda
            else ""
        )
    )


def _peak_reset(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()


def _peak_gib(cuda: bool) -> float | None:
    if not cuda:
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def sdplan_step_seconds(req, *, device: str, demo: bool, batch: int, warmup: int, steps: int, workdir: Path):
    from sdplan.bench_harness import Harness, free_memory

    cuda = device == "cuda"
    h = Harness(req, device=device, demo=demo, workdir=workdir)
    try:
        _peak_reset(cuda)
        seconds = _timed(lambda: h.step(batch), warmup, steps, cuda, "sdplan")
        return seconds, _peak_gib(cuda)
    finally:
        h.close()
        free_memory()


def reference_step_seconds(
    req, *, device: str, demo: bool, batch: int, warmup: int, steps: int, workdir: Path
):
    """diffusers' LoRA example loop, bare (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig

    from sdplan.bench_harness import build_components

    cuda = device == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(req.precision, torch.float32)
    comps = build_components(
        req.model,
        demo=demo,
        workdir=workdir,
        device=device,
        dtypes={"unet": dtype, "text_encoder": dtype},
        with_vae=False,
    )
    unet, encoders, tokenizers = (
        comps.unet.to(device),
        [te.to(device) for te in comps.text_encoders],
        comps.tokenizers,
    )
    unet.requires_grad_(False)
    for te in encoders:
        te.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=req.lora_rank,
            lora_alpha=req.lora_rank,
            init_lora_weights="gaussian",
            target_modules=["to_k", "to_q", "to_v", "to_out.0"],
        )
    )
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:  # diffusers' cast_training_params: the trainable LoRA weights in fp32
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    scheduler = comps.noise_scheduler
    sdxl = req.model == "sdxl"
    res = req.resolution
    channels = unet.config.in_channels
    ids = [
        tok(
            ["a photo of sks person"] * batch,
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(device)
        for tok in tokenizers
    ]
    generator = torch.Generator(device="cpu").manual_seed(0)
    autocast = torch.autocast(
        device_type="cuda" if cuda else "cpu", dtype=dtype, enabled=dtype != torch.float32
    )

    def step() -> None:
        latents = torch.randn((batch, channels, res // 8, res // 8), generator=generator).to(device)
        noise = torch.randn(latents.shape, generator=generator).to(device)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator).to(device)
        noisy = scheduler.add_noise(latents, noise, t)
        with torch.no_grad():  # the frozen text encoders, every step
            if sdxl:
                out = [te(i, output_hidden_states=True) for te, i in zip(encoders, ids)]
                hidden = torch.cat([o.hidden_states[-2] for o in out], dim=-1)
                added = {
                    "text_embeds": out[1][0],
                    "time_ids": torch.tensor(
                        [[res, res, 0, 0, res, res]] * batch, device=device, dtype=hidden.dtype
                    ),
                }
            else:
                hidden, added = encoders[0](ids[0])[0], None
        with autocast:
            pred = unet(noisy.to(dtype), t, hidden, added_cond_kwargs=added).sample
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _peak_reset(cuda)
    seconds = _timed(step, warmup, steps, cuda, "reference")
    return seconds, _peak_gib(cuda)  # the models go with this frame: measure() frees them after


def measure(
    model: str, batch: int, *, demo: bool, warmup: int, steps: int, reference_first: bool = False
) -> dict:
    from dataclasses import replace

    import torch

    from sdplan.bench import BenchRequest, _quiet_diffusers, demo_request
    from sdplan.bench_harness import free_memory

    cuda = torch.cuda.is_available() and not demo
    device = "cuda" if cuda else "cpu"
    if demo:
        req = replace(demo_request("lora"), model=model, cache_latents=True)
    else:
        from sdplan import profiles

        spec = profiles.load_model(profiles.shipped_dir() / "models" / f"{model}.yaml")
        req = BenchRequest(
            method="lora",
            model=model,
            resolution=spec.native_resolution,
            precision="bf16" if cuda and torch.cuda.is_bf16_supported() else ("fp16" if cuda else "fp32"),
            gradient_checkpointing=False,
            cache_latents=True,
            lora_rank=16,
        )
    out = {
        "model": req.model,
        "resolution": req.resolution,
        "precision": req.precision,
        "batch": batch,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "timed_steps": steps,
    }
    with tempfile.TemporaryDirectory() as tmp, _quiet_diffusers():
        loops = [("sdplan", sdplan_step_seconds), ("reference", reference_step_seconds)]
        for name, fn in reversed(loops) if reference_first else loops:
            seconds, peak = fn(
                req,
                device=device,
                demo=demo,
                batch=batch,
                warmup=warmup,
                steps=steps,
                workdir=Path(tmp) / name,
            )
            out[name] = {"median_step_s": statistics.median(seconds), "peak_allocated_gib": peak}
            free_memory()
    out["ratio"] = out["sdplan"]["median_step_s"] / out["reference"]["median_step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sd15", choices=("sd15", "sdxl"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--demo", action="store_true", help="the tiny model of --model's shape on the CPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--profile", type=Path, metavar="DIR", help="write each loop's torch.profiler table to DIR"
    )
    ap.add_argument(
        "--reference-first",
        action="store_true",
        help="run the bare loop first (a host-bound step is sensitive to what ran before it)",
    )
    args = ap.parse_args(argv)
    global PROFILE_DIR
    PROFILE_DIR = args.profile
    r = measure(
        args.model,
        args.batch,
        demo=args.demo,
        warmup=args.warmup,
        steps=args.steps,
        reference_first=args.reference_first,
    )
    r["order"] = "reference first" if args.reference_first else "sdplan first"
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['model']} LoRA {r['resolution']}px {r['precision']} batch {r['batch']} on {r['device']}:")
    for name in ("sdplan", "reference"):
        peak = r[name]["peak_allocated_gib"]
        print(
            f"  {name:9s} {r[name]['median_step_s']:.4f} s/step" + (f", peak {peak:.2f} GiB" if peak else "")
        )
    print(f"  sdplan / reference: {r['ratio']:.3f} (target <= 1.10)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
