#!/usr/bin/env python
"""Peak GPU memory of diffusers' FLUX.1 LoRA example's training step, written out bare: does that step hold
more than sdplan's model of a step predicts, and which of its choices does it?

Why: four of the validation set's SD3.5 / FLUX.1 verdict misses are runs of diffusers'
``examples/dreambooth/train_dreambooth_lora_flux.py`` out of memory on 40-80 GB cards, and the calibration
point diffusers10994 read 78.2 GiB allocated at 512 px, batch 2, no checkpointing, where the planner predicts
53.7 GiB with the script's text encoders resident. sdplan's own trainer measured 31.9 GiB at batch 1 on an
H100 (predicted 33.6): the planner models sdplan's step well, so the difference is in that script's step.

The step, from the script at diffusers b8215b1c (read, not copied):

- transformer, VAE and both text encoders in bf16 on the GPU; the encoders stay there for the whole run
  (``del text_encoder_one, text_encoder_two`` leaves the list ``text_encoders`` holding them);
- LoRA rank 4 (``init_lora_weights="gaussian"``, alpha = rank, no dropout) on the script's default targets
  (``lora_target_modules`` of profiles/models/flux-dev.yaml), its parameters cast to fp32
  (``cast_training_params``);
- ``accelerate.Accelerator(mixed_precision="bf16")``: ``prepare`` runs the forward under autocast;
- the instance prompt encoded once: prompt embeddings of batch 1 against a latent batch of N;
- latents from the VAE every step (no ``--cache_latents``), 2x2-packed; no gradient checkpointing;
- flow-matching loss in fp32, ``accelerator.backward``, AdamW on the LoRA parameters, ``zero_grad``.

Variants (``--variants``), each changing one thing:

- ``script``: as above;
- ``matched``: the prompt embeddings repeated to the latent batch (as per-image captions give);
- ``bf16-lora``: LoRA parameters left in bf16 (not cast to fp32);
- ``no-autocast``: bf16 LoRA parameters and no autocast (``mixed_precision="no"``): the arithmetic sdplan's
  meta-device count of activations assumes.

Printed (``--json``: one object per variant and batch): the bytes allocated before the first step (weights,
encoders, VAE), ``torch.cuda.max_memory_allocated`` over the steps, and their difference (the step's own
peak); on any device, the bytes autograd saved for the first step's backward (each storage once, weights
excluded: what sdplan's meta count of activations counts). ``--snapshot DIR`` writes a CUDA memory snapshot (``torch.cuda.memory._dump_snapshot``) of each run,
for https://pytorch.org/memory_viz.

On the CPU (2026-11-27), full-width slices (--depth 1,1 / 2,1 / 1,2, 512 px, batch 1) scaled to FLUX.1's 19 + 38
blocks: the script's step saves 9.24 GiB per image for the backward under the CPU's autocast, 9.90 GiB with
LayerNorm in fp32 as CUDA's autocast runs it (--cuda-layer-norm), against 8.04 GiB for bf16 LoRA without autocast
(the same as sdplan's meta-device count): +23% at most, where diffusers issue 10994 implies ~2.7x.

On the lent H100 (2026-11-27, torch 2.11.0+cu130, diffusers 0.42.1, cuDNN attention off: its backward faulted
with "illegal memory access" here), 512 px, peak over steps 2-3 (GiB, torch.cuda.max_memory_allocated):

    variant       batch 1: peak (step)    batch 2: step    saved for the backward per image
    script        40.69 (9.17)            18.10            8.90
    matched       40.69 (9.17)            18.10            8.90
    bf16-lora     40.44 (8.91)            18.04            8.71-8.88
    no-autocast   38.71 (7.19)            14.66            7.04-7.21
    resident (transformer, T5-XXL, CLIP-L, VAE in bf16): 31.51

So the script's step at batch 2 peaks at 31.5 + 18.1 = 49.6 GiB, where the planner predicts 50.1 GiB allocated
(40.3 against 40.7 at batch 1): the step is modelled, and the 78.2 GiB of diffusers issue 10994 came from
something else in that run. These two are calibration points in profiles/methods/lora.yaml
(flux-script-step-h100-512-b1/-b2).

GPU:   python benchmarks/flux_script_memory.py --batches 1,2 --resolution 512 --json [--snapshot $OUT/snap]
CPU (the tiny FLUX.1-shaped model, to try the code; no memory figures):   python benchmarks/flux_script_memory.py --demo
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compute_activations import SavedCounter  # noqa: E402  (scripts/, beside this folder)
from sdplan.trainer.runtime import avoid_faulty_attention_kernels  # noqa: E402

VARIANTS = ("script", "matched", "bf16-lora", "no-autocast")
GiB = 2**30


def _components(demo: bool, workdir: Path, device: str):
    """The FLUX.1 [dev] transformer, CLIP-L, T5-XXL and VAE in bf16 with random weights (profiles/models), or
    the tiny demo model."""
    import torch
    from diffusers.utils import logging as dlogging

    from sdplan.bench_harness import build_components

    dlogging.set_verbosity_error()  # the tiny demo model is cast to bf16 after building
    bf16 = torch.bfloat16
    comps = build_components(
        "flux-dev",
        demo=demo,
        workdir=workdir,
        device=device,
        dtypes={"unet": bf16, "text_encoder": bf16, "vae": bf16},
    )
    for m in (comps.unet, comps.vae, *comps.text_encoders):
        m.to(device, bf16).requires_grad_(False)
    return comps


def _prompt(comps, device: str):
    """One prompt's CLIP pooled output and T5 sequence (random token ids: the weights are random too)."""
    import torch

    clip, t5 = comps.text_encoders
    ids_clip = torch.randint(
        0, clip.config.vocab_size, (1, comps.tokenizers[0].model_max_length), device=device
    )
    ids_t5 = torch.randint(0, t5.config.vocab_size, (1, comps.tokenizers[1].model_max_length), device=device)
    with torch.no_grad():
        pooled = clip(ids_clip).pooler_output
        embeds = t5(ids_t5)[0]
    return embeds, pooled


def _shallow(depth: tuple[int, int], device: str):
    """--depth: FLUX.1 [dev]'s transformer at full width with ``depth`` (double, single) blocks, in bf16 with
    random weights, and a random prompt of the real shapes (T5 512 x 4096, CLIP pooled 768): no encoders or
    VAE, so that it runs on a CPU; per-block bytes scale to the 19 + 38 blocks."""
    import diffusers
    import torch

    from sdplan import profiles

    spec = profiles.load_model(profiles.shipped_dir() / "models" / "flux-dev.yaml")
    config = dict(spec.transformer) | {"num_layers": depth[0], "num_single_layers": depth[1]}
    torch.manual_seed(0)
    with torch.device(device):
        net = diffusers.FluxTransformer2DModel.from_config(config).to(torch.bfloat16).requires_grad_(False)
        embeds = torch.randn(
            1, spec.transformer_text_tokens, config["joint_attention_dim"], dtype=torch.bfloat16
        )
        pooled = torch.randn(1, config["pooled_projection_dim"], dtype=torch.bfloat16)
    return net, embeds, pooled


def sdpa_backend(name: str | None):
    """--sdpa: attention on one scaled_dot_product_attention backend (torch.nn.attention.sdpa_kernel)."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]
    return sdpa_kernel(backend)


@contextlib.contextmanager
def cuda_layer_norm_policy():
    """On the CPU, LayerNorm as CUDA's autocast runs it: in fp32, returning fp32 (aten/src/ATen/autocast_mode.cpp
    lists layer_norm among the CUDA fp32 ops; the CPU's autocast leaves it in bf16). For --depth runs on a CPU
    that should count what a GPU would save."""
    import torch
    import torch.nn.functional as F

    original = F.layer_norm

    def layer_norm(x, *args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):
            return original(x, *args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return original(x.float(), *args, **kwargs)

    F.layer_norm = layer_norm
    try:
        yield
    finally:
        F.layer_norm = original


def run(
    variant: str,
    batch: int,
    resolution: int,
    steps: int,
    demo: bool,
    snapshot: Path | None,
    depth: tuple[int, int] | None = None,
    count: bool = True,
    sdpa: str | None = None,
    cudnn: bool = False,
) -> dict:
    import torch
    from accelerate import Accelerator
    from diffusers import FluxPipeline
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    from sdplan import profiles
    from sdplan.bench_harness import _reset_accelerate_state

    _reset_accelerate_state()  # each run sets its own mixed precision
    cuda = torch.cuda.is_available() and not demo
    device = "cuda" if cuda else "cpu"
    if not cudnn:
        # torch 2.11 prefers cuDNN attention on Hopper; on the lent H100 its backward faulted in this step
        # ("illegal memory access" in mha_graph.execute, 2026-11-27): off, as sdplan's trainer runs (and as the
        # torch 2.4-2.10 that the reports ran on chose flash / memory-efficient attention)
        avoid_faulty_attention_kernels()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if depth is None:
        with tempfile.TemporaryDirectory() as tmp:
            comps = _components(demo, Path(tmp), device)
        transformer, vae = comps.unet, comps.vae
        embeds, pooled = _prompt(comps, device)
        vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
    else:
        comps = vae = None
        transformer, embeds, pooled = _shallow(depth, device)
        vae_scale = 8
    targets = profiles.load_model(profiles.shipped_dir() / "models" / "flux-dev.yaml").lora_target_modules
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=list(targets))
    )
    if variant in ("script", "matched"):
        cast_training_params(transformer, dtype=torch.float32)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    accelerator = Accelerator(mixed_precision="no" if variant == "no-autocast" else "bf16", cpu=not cuda)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    if variant == "matched":
        embeds, pooled = embeds.repeat(batch, 1, 1), pooled.repeat(batch, 1)
    text_ids = torch.zeros(embeds.shape[1], 3, device=device, dtype=torch.bfloat16)
    channels = transformer.config.in_channels // 4
    guidance = torch.ones(batch, device=device) if transformer.config.guidance_embeds else None
    resident = torch.cuda.memory_allocated() if cuda else None
    if cuda and snapshot is not None:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    # the first step's saved tensors, each storage once, weights excluded: the meta-device count's own counter
    saved = SavedCounter({p.untyped_storage()._cdata for p in transformer.parameters()})

    def forward():
        if vae is not None:  # the script encodes every step (no --cache_latents)
            pixels = torch.randn(batch, 3, resolution, resolution, device=device, dtype=torch.bfloat16)
            dist = vae.encode(pixels).latent_dist
            latents = (dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
        else:
            side = resolution // vae_scale
            latents = torch.randn(batch, channels, side, side, device=device, dtype=torch.bfloat16)
        b, c, h, w = latents.shape
        noise = torch.randn_like(latents)
        sigmas = torch.rand(b, device=device)
        noisy = (1 - sigmas.view(-1, 1, 1, 1)) * latents + sigmas.view(-1, 1, 1, 1) * noise
        packed = FluxPipeline._pack_latents(noisy.to(torch.bfloat16), b, c, h, w)
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, torch.bfloat16)
        pred = transformer(
            hidden_states=packed,
            timestep=sigmas,  # the script passes timesteps / 1000, i.e. the sigmas
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        pred = FluxPipeline._unpack_latents(pred, resolution, resolution, vae_scale)
        return ((pred.float() - (noise - latents).float()) ** 2).mean()

    first_peak = None
    for step in range(steps):
        with saved.hooks() if step == 0 and count else contextlib.nullcontext(), sdpa_backend(sdpa):
            loss = forward()
            accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0 and cuda and steps > 1:
            # the counter kept step 0's saved tensors alive through its backward: the peak is the later steps'
            saved.keep.clear()
            loss = None
            first_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
    out = {
        "variant": variant,
        "batch": batch,
        "resolution": resolution,
        "steps": steps,
        "device": device,
        "saved_for_backward_bytes": saved.total if count else None,
        "saved_for_backward_gib": round(saved.total / GiB, 4) if count else None,
    }
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out |= {
            "resident_gib": round(resident / GiB, 3),
            "peak_allocated_gib": round(peak / GiB, 3),
            "step_gib": round((peak - resident) / GiB, 3),
            "first_step_peak_gib": None if first_peak is None else round(first_peak / GiB, 3),
            "gpu": torch.cuda.get_device_name(),
        }
        if snapshot is not None:
            snapshot.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(snapshot / f"{variant}-b{batch}-{resolution}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
    # free them before the next run: forward holds cells, and with fp32 LoRA parameters something keeps the
    # transformer in a reference cycle (on the H100 a batch-2 run after a batch-1 one found 22 GiB more resident)
    transformer = vae = comps = optimizer = accelerator = params = saved = loss = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--demo", action="store_true", help="the tiny FLUX.1-shaped model on the CPU")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--depth",
        default=None,
        help="D,S: full width, D double and S single blocks, no encoders or VAE (a CPU-sized slice)",
    )
    ap.add_argument(
        "--cuda-layer-norm",
        action="store_true",
        help="on the CPU, run LayerNorm in fp32 under autocast, as CUDA's autocast does",
    )
    ap.add_argument("--snapshot", type=Path, default=None, help="write a CUDA memory snapshot per run here")
    ap.add_argument(
        "--cudnn",
        action="store_true",
        help="leave PyTorch's cuDNN attention on (its backward faulted in this step on an H100, torch 2.11)",
    )
    ap.add_argument("--no-count", action="store_true", help="no saved-tensor hooks (no count of saved bytes)")
    ap.add_argument(
        "--sdpa",
        default=None,
        choices=("flash", "efficient", "cudnn", "math"),
        help="run attention on this scaled_dot_product_attention backend only",
    )
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        print(f"error: unknown variant(s) {', '.join(unknown)} (use {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    depth = tuple(int(x) for x in args.depth.split(",")) if args.depth else None
    resolution = 64 if args.demo and depth is None else args.resolution
    for variant in variants:
        for batch in (int(b) for b in args.batches.split(",")):
            policy = cuda_layer_norm_policy() if args.cuda_layer_norm else contextlib.nullcontext()
            try:
                with policy:
                    row = run(
                        variant,
                        batch,
                        resolution,
                        args.steps,
                        args.demo,
                        args.snapshot,
                        depth,
                        count=not args.no_count,
                        sdpa=args.sdpa,
                        cudnn=args.cudnn,
                    )
                if args.sdpa:
                    row["sdpa"] = args.sdpa
            except Exception as e:  # out of memory on a GPU is a result, not a crash
                import torch

                if not isinstance(e, torch.OutOfMemoryError):
                    raise
                row = {
                    "variant": variant,
                    "batch": batch,
                    "resolution": resolution,
                    "oom": str(e).splitlines()[0],
                }
                torch.cuda.empty_cache()
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                fig = (
                    f"resident {row['resident_gib']:.2f} GiB, peak {row['peak_allocated_gib']:.2f} GiB "
                    f"(step {row['step_gib']:.2f} GiB)"
                    if "peak_allocated_gib" in row
                    else row.get("oom", "no allocator figures on the CPU")
                )
                if row.get("saved_for_backward_gib") is not None:
                    fig += f"; saved for the backward {row['saved_for_backward_gib']:.4f} GiB"
                print(f"{variant:12s} batch {batch} at {resolution}px: {fig}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
