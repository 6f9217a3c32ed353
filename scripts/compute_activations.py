#!/usr/bin/env python
"""Compute the activation memory of SD training from the real graph, without a GPU: profiles/activations.yaml.

For each model family (sd15, sd21, sdxl) the full-size UNet is built on the meta device (accelerate's
``init_empty_weights``) from the diffusers config shipped in ``profiles/models/<family>.yaml``. One train-mode
forward runs under ``torch.autograd.graph.saved_tensors_hooks``; the bytes of every tensor autograd saves for
backward are summed, each storage once, skipping parameters (they are counted as weights by the planner).

Variants per family:

- attention backend: ``efficient`` (flash / memory-efficient SDPA, what CUDA and ROCm CDNA/RDNA3 run: the real
  ``aten._scaled_dot_product_flash_attention`` op is called on meta, so autograd saves exactly q, k, v, out and
  the log-sum-exp) or ``math`` (``torch.nn.attention.SDPBackend.MATH``: the full attention matrix is saved);
- gradient checkpointing off / on. With it on, diffusers' ``_gradient_checkpointing_func`` is replaced by one that
  does what non-reentrant checkpointing keeps: the segment's inputs are held until backward, the tensors saved
  inside the segment are not (they are recomputed; the largest segment gives ``recompute_peak``);
- trained part: the whole UNet (``unet``: DreamBooth, fine-tune) or only the attention projections (``attn``:
  LoRA adapters on to_q/k/v/out; textual inversion and text-encoder training need the gradient through the
  same layers), since frozen layers save less (a frozen Linear keeps no input for a weight gradient);
- compute dtype bf16 (fp16 has the same sizes) and fp32.

Each variant is measured at several resolutions and two batch sizes and fitted as
``bytes(batch, L) = batch * (linear * L + quadratic * L**2 + per_sample) + fixed`` with ``L`` the latent pixels
(H/8 x W/8). ``quadratic`` is zero for the efficient backend. The trained text encoders (77 tokens) are measured
the same way (bytes per sample, no resolution term).

Transformer families (SD3.5 Medium / Large, FLUX.1 [dev] / [schnell]; ``compute_transformer_family``): the
full-size transformer is built the same way and fed what the pipelines feed it (SD3: 16-channel latents patched
2x2 inside, 77 CLIP + T5 tokens of 4096 features, pooled 2048; FLUX: latents packed 2x2 into (H/16)(W/16) tokens of
64 channels, T5 tokens, pooled CLIP-L 768, position ids, guidance for [dev]), bf16 with flash attention, gradient
checkpointing off / on (diffusers checkpoints each block), the whole transformer or only its LoRA targets trained,
at 512 / 768 / 1024 px and batch 2 at 1024. FLOPs per sample: torch.utils.flop_counter over a meta forward and a
whole training step (forward + backward), fitted over resolutions; with checkpointing the step adds one forward
(checked against diffusers' own checkpointing at 1024 px). Held bytes of each text encoder at its max length too.

Why one script of ~1,150 lines: every number it writes (activations, FLOPs, traffic, sampling peaks, LoRA target
sets, for the UNet and the transformer families) comes from the same meta-device builds and saved-tensor hooks,
and the shipped file must be reproducible by one command (a test checks it).

Run: ``python scripts/compute_activations.py [--models-dir profiles/models] [--out profiles/activations.yaml]``.
Needs torch, diffusers, transformers and accelerate; downloads nothing. sdplan itself only reads the YAML.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sdplan import registry

FAMILY_RESOLUTIONS = {
    "sd15": (256, 384, 512, 640, 768),
    "sd21": (384, 512, 640, 768),
    "sdxl": (512, 768, 1024),
}
DTYPES = ("bf16", "fp32")
BACKENDS = ("efficient", "math")
# What requires grad: the whole UNet (DreamBooth, fine-tune), or only the attention projections (LoRA adapts
# to_q/k/v/out; textual inversion and text-encoder training need the gradient through the same layers).
TRAINED = ("unet", "attn")


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class SavedCounter:
    """Sums the bytes of tensors autograd saves, each storage once, skipping the given parameter storages."""

    def __init__(self, skip_keys: set[int]):
        self.skip = skip_keys
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # keeps the saved tensors alive, so storage identities are never reused
        self.largest = 0

    @staticmethod
    def key(t) -> int:
        # Meta tensors have no data pointer; the StorageImpl address identifies the storage (views share it).
        return t.untyped_storage()._cdata

    @staticmethod
    def nbytes(t) -> int:
        try:
            return int(t.untyped_storage().nbytes())
        except (RuntimeError, NotImplementedError):  # pragma: no cover - fallback for exotic tensors
            base = t._base if t._base is not None else t
            return base.numel() * base.element_size()

    def add(self, t) -> None:
        k = self.key(t)
        if k in self.skip or k in self.seen:
            return
        n = self.nbytes(t)
        self.seen[k] = n
        self.largest = max(self.largest, n)
        self.keep.append(t)

    def pack(self, t):
        self.add(t)
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@contextlib.contextmanager
def attention_backend(backend: str, dtype_name: str, calls: dict | None = None):
    """``efficient``: route F.scaled_dot_product_attention through the real flash / mem-efficient aten op."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend == "math":
        with sdpa_kernel(SDPBackend.MATH):
            yield
        return
    original = F.scaled_dot_product_attention

    def efficient(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if calls is not None:
            calls["n"] = calls.get("n", 0) + 1
        if dtype_name == "fp32" or attn_mask is not None:
            # flash has no fp32 kernel; memory-efficient attention does (and takes a mask). Same saved set.
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]

    F.scaled_dot_product_attention = efficient
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def build_unet(unet_config: dict, dtype_name: str):
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(dict(unet_config))
    unet.to(_torch_dtype(dtype_name))
    unet.train()
    return unet


def set_trained(unet, trained: str) -> None:
    if trained in LORA_TARGET_SETS:
        set_lora_trained(unet, trained)
        return
    for name, p in unet.named_parameters():
        p.requires_grad_(trained == "unet" or (".attn" in name and ".to_" in name))


def adafactor_state_bytes(model) -> int:
    """Adafactor (factored second moment, no first moment: kohya/transformers defaults) state in fp32 bytes.

    Tensors with >= 2 dims keep a row and a column statistic over their last two dims; others a full copy.
    """
    import math

    total = 0
    for p in model.parameters():
        shape = tuple(p.shape)
        if len(shape) >= 2:
            total += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
        else:
            total += p.numel()
    return 4 * total


def unet_meta_inputs(model: dict, *, batch: int, side: int, dtype) -> tuple[tuple, dict]:
    """(args, kwargs) of a UNet forward as the pipeline calls it, as meta tensors: latents (batch, C, side, side),
    timesteps, the text encoders' hidden states, and SDXL's pooled embeddings + time ids."""
    import torch

    cfg = model["unet"]
    meta = {"device": "meta", "dtype": dtype}
    kwargs: dict[str, Any] = {}
    if cfg.get("addition_embed_type") == "text_time":
        pooled = int(cfg["projection_class_embeddings_input_dim"]) - 6 * int(cfg["addition_time_embed_dim"])
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.empty(batch, pooled, **meta),
            "time_ids": torch.empty(batch, 6, **meta),
        }
    args = (
        torch.empty(batch, int(cfg.get("in_channels", 4)), side, side, **meta),
        torch.zeros(batch, device="meta", dtype=torch.long),
        torch.empty(
            batch, int(model.get("tokenizer_max_length", 77)), int(cfg["cross_attention_dim"]), **meta
        ),
    )
    return args, kwargs


def measure_unet(
    unet,
    model: dict,
    *,
    batch: int,
    resolution: int,
    dtype_name: str,
    backend: str,
    gc: bool,
    trained: str = "unet",
):
    """One train-mode forward on meta; returns (held_bytes, recompute_peak_bytes)."""
    import torch

    set_trained(unet, trained)

    dtype = _torch_dtype(dtype_name)
    scale = int(model.get("vae_scale_factor", 8))
    side = resolution // scale
    params = {p.untyped_storage()._cdata for p in unet.parameters()}
    held = SavedCounter(params)
    peak = {"recompute": 0}

    def checkpoint(module, *args):
        # Non-reentrant checkpointing keeps the segment's inputs for the recomputation and nothing inside it.
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                held.add(a)
        inner = SavedCounter(params)
        with inner.hooks():
            out = module(*args)
        peak["recompute"] = max(peak["recompute"], inner.total)
        return out

    if gc:
        unet.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    else:
        unet.disable_gradient_checkpointing()

    args, kwargs = unet_meta_inputs(model, batch=batch, side=side, dtype=dtype)
    with attention_backend(backend, dtype_name), held.hooks():
        unet(*args, return_dict=False, **kwargs)
    return held.total, peak["recompute"]


def measure_text_encoder(entry: dict, *, batch: int, dtype_name: str, tokens: int) -> int:
    import torch
    import transformers
    from accelerate import init_empty_weights

    cls = getattr(transformers, entry["class"])
    config = transformers.CLIPTextConfig(**entry["config"])
    with init_empty_weights():
        model = cls(config)
    model.to(_torch_dtype(dtype_name)).train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    held = SavedCounter(params)
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    with attention_backend("efficient", dtype_name), held.hooks():
        model(input_ids=ids)
    return held.total


def text_encoder_adafactor_bytes(entry: dict) -> int:
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = getattr(transformers, entry["class"])(transformers.CLIPTextConfig(**entry["config"]))
    return adafactor_state_bytes(model)


def measure_flops(model: dict, unet, resolutions: tuple[int, ...]) -> dict:
    """Forward FLOPs (torch.utils.flop_counter on meta): UNet and VAE encoder per sample vs latent pixels,
    text encoders per prompt. The planner scales step time from these."""
    import torch
    import transformers
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    scale = int(model.get("vae_scale_factor", 8))
    meta = {"device": "meta", "dtype": torch.bfloat16}

    def count(fn) -> int:
        fc = FlopCounterMode(display=False)
        with fc, torch.no_grad(), attention_backend("efficient", "bf16"):
            fn()
        return int(fc.get_total_flops())

    with init_empty_weights():
        vae = AutoencoderKL.from_config(dict(model["vae"]))
    vae.to(torch.bfloat16)
    unet_pts, vae_pts = [], []
    for res in resolutions:
        side = res // scale
        args, kwargs = unet_meta_inputs(model, batch=1, side=side, dtype=meta["dtype"])
        unet_pts.append((1, side * side, count(lambda a=args, k=kwargs: unet(*a, **k))))
        image = torch.empty(1, 3, res, res, **meta)
        vae_pts.append((1, side * side, count(lambda x=image: vae.encode(x))))
    te = 0
    tokens = int(model.get("tokenizer_max_length", 77))
    for entry in model.get("text_encoders", []):
        with init_empty_weights():
            enc = getattr(transformers, entry["class"])(transformers.CLIPTextConfig(**entry["config"]))
        enc.to(torch.bfloat16)
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        te += count(lambda m=enc, i=ids: m(input_ids=i))
    unet_coef, _ = fit(unet_pts, quadratic=True, with_fixed=False)
    vae_coef, _ = fit(vae_pts, quadratic=True, with_fixed=False)
    return {"unet_forward": unet_coef, "vae_encode": vae_coef, "text_encoders_forward": te}


def _solve(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares via normal equations (tiny systems); exact for consistent data."""
    import numpy as np

    a = np.array(rows, dtype=float)
    y = np.array(ys, dtype=float)
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [float(v) for v in sol]


def fit(
    points: list[tuple[int, int, int]], quadratic: bool, with_fixed: bool = True
) -> tuple[dict[str, float], float]:
    """points: (batch, latent_pixels, bytes) -> coefficients and the largest relative residual."""
    rows, ys = [], []
    for b, lat, y in points:
        row = [b * lat, b, 1.0] if with_fixed else [b * lat, b]
        if quadratic:
            row.insert(1, b * lat * lat)
        rows.append(row)
        ys.append(float(y))
    sol = _solve(rows, ys)
    if not with_fixed:
        sol.append(0.0)
    if quadratic:
        lin, quad, per, fixed = sol
    else:
        (lin, per, fixed), quad = sol, 0.0
    worst = 0.0
    for b, lat, y in points:
        pred = b * (lin * lat + quad * lat * lat + per) + fixed
        worst = max(worst, abs(pred - y) / max(y, 1))
    coef = {
        "linear": round(lin, 4),
        "quadratic": round(quad, 8),
        "per_sample": round(per),
        "fixed": round(fixed),
    }
    return coef, worst


def measured_entry(
    measure, model: dict, resolutions: tuple[int, ...], *, gc: bool, quadratic: bool, error_digits: int = 4
) -> tuple[dict, list[tuple[int, int, int, int, float]]]:
    """One activations.yaml entry: ``measure(batch, resolution) -> (held, recompute peak)`` at batch 1 over
    ``resolutions`` and at batch 2 at the native resolution, then fitted (the recompute peak only with gradient
    checkpointing). Returns (entry, measurements as (batch, resolution, held, peak, seconds))."""
    scale = int(model.get("vae_scale_factor", 8))
    native = int(model["native_resolution"])
    held_pts, peak_pts, measured = [], [], []
    for batch, res in [(1, r) for r in resolutions] + [(2, native)]:
        t0 = time.perf_counter()
        held, peak = measure(batch, res)
        lat = (res // scale) ** 2
        held_pts.append((batch, lat, held))
        peak_pts.append((batch, lat, peak))
        measured.append((batch, res, held, peak, time.perf_counter() - t0))
    held_coef, held_err = fit(held_pts, quadratic=quadratic)
    entry = {"held": held_coef, "fit_max_error": round(held_err, error_digits)}
    if gc:
        entry["recompute_peak"], _ = fit(peak_pts, quadratic=quadratic)
    return entry, measured


def unet_entry(
    unet, model: dict, resolutions: tuple[int, ...], *, dtype_name: str, backend: str, gc: bool, trained
) -> tuple[str, dict, list[tuple[int, int, int, int, float]]]:
    """(key, entry, measurements) of activations.yaml for one (dtype, attention backend, checkpointing, trained
    part) of the UNet (:func:`measured_entry`; plain attention's matrix makes the fit quadratic)."""

    def measure(batch: int, res: int) -> tuple[int, int]:
        return measure_unet(
            unet,
            model,
            batch=batch,
            resolution=res,
            dtype_name=dtype_name,
            backend=backend,
            gc=gc,
            trained=trained,
        )

    entry, measured = measured_entry(measure, model, resolutions, gc=gc, quadratic=backend == "math")
    return f"{dtype_name}/{backend}/{'gc' if gc else 'no_gc'}/{trained}", entry, measured


def compute_family(model: dict, resolutions: tuple[int, ...], log) -> dict:
    out: dict[str, Any] = {"unet": {}, "text_encoders": [], "measured": []}
    for dtype_name in DTYPES:
        unet = build_unet(model["unet"], dtype_name)
        for backend, gc, trained in itertools.product(BACKENDS, (False, True), TRAINED):
            key, entry, measured = unet_entry(
                unet, model, resolutions, dtype_name=dtype_name, backend=backend, gc=gc, trained=trained
            )
            for batch, res, held, peak, seconds in measured:
                out["measured"].append(
                    {
                        "dtype": dtype_name,
                        "attention": backend,
                        "gradient_checkpointing": gc,
                        "trained": trained,
                        "batch": batch,
                        "resolution": res,
                        "held_bytes": held,
                        "recompute_peak_bytes": peak,
                    }
                )
                log(
                    f"  {model['family']} {dtype_name} {backend:9s} {trained:4s} gc={gc!s:5s} b={batch} {res:5d}: "
                    f"held {held / 2**30:7.3f} GiB, recompute peak {peak / 2**30:6.3f} GiB ({seconds:.2f}s)"
                )
            out["unet"][key] = entry
        if dtype_name == "fp32":
            out["adafactor_state_bytes"] = {"unet": adafactor_state_bytes(unet), "text_encoders": []}
        else:
            out["flops"] = measure_flops(model, unet, resolutions)
            log(f"  {model['family']} flops: {out['flops']}")
        del unet
    tokens = int(model.get("tokenizer_max_length", 77))
    for entry in model.get("text_encoders", []):
        per = {}
        for dtype_name in DTYPES:
            one = measure_text_encoder(entry, batch=1, dtype_name=dtype_name, tokens=tokens)
            two = measure_text_encoder(entry, batch=2, dtype_name=dtype_name, tokens=tokens)
            per[dtype_name] = {"per_sample": two - one, "fixed": 2 * one - two}
        out["text_encoders"].append({"class": entry["class"], "held": per})
        out["adafactor_state_bytes"]["text_encoders"].append(text_encoder_adafactor_bytes(entry))
        log(
            f"  {model['family']} text encoder {entry['class']}: {per['bf16']['per_sample'] / 2**20:.1f} MiB/sample bf16"
        )
    return out


# -- transformer families (SD3.5, FLUX.1) ------------------------------------------------------------------

TRANSFORMER_RESOLUTIONS = (512, 768, 1024)
TRANSFORMER_FLOP_RESOLUTIONS = (512, 768, 1024)
# What requires grad: the whole transformer (full fine-tune, DreamBooth) or only the family's LoRA target modules
# (diffusers' DreamBooth LoRA defaults, listed in the profile). A LoRA adapter on a frozen Linear keeps the
# Linear's input for its A matrix's gradient, exactly what the Linear itself keeps when its weight requires grad;
# the rank-r intermediate (r x tokens) is left out.
TRANSFORMER_TRAINED = ("full", "lora")
TRANSFORMER_FAMILIES = registry.FLOW_FAMILIES


def _scripts_import(name: str):
    import importlib

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def build_transformer(model: dict):
    """The family's transformer on the meta device, bf16, train mode."""
    import torch
    from accelerate import init_empty_weights
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    count_params = _scripts_import("count_params")
    with init_empty_weights(include_buffers=True):  # SD3's positional table too: nothing allocated
        net = count_params.build_transformer(model["transformer"])
    net.to(torch.bfloat16)
    net.train()
    return net


def _matches(name: str, targets: tuple[str, ...]) -> bool:
    """peft's rule for a target_modules entry: the module's full name equals it or ends with '.' + it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def set_trained_transformer(net, trained: str, targets: tuple[str, ...]) -> int:
    """Mark what requires grad; returns the number of LoRA-targeted Linear modules (0 for 'full')."""
    import torch

    if trained == "full":
        net.requires_grad_(True)
        return 0
    net.requires_grad_(False)
    hit = 0
    for name, module in net.named_modules():
        if isinstance(module, torch.nn.Linear) and _matches(name, targets):
            module.weight.requires_grad_(True)
            hit += 1
    if not hit:
        raise ValueError(f"no Linear module matches the LoRA targets {targets}")
    return hit


def transformer_inputs(model: dict, *, batch: int, resolution: int) -> dict:
    """The keyword arguments the family's pipeline passes to its transformer, as meta tensors.

    SD3: latents (B, 16, H/8, W/8) patched 2x2 inside; text = CLIP (77) + T5 tokens of 4096 features; pooled 2048.
    FLUX: latents packed 2x2 outside -> (B, H/16 * W/16, 64) tokens; text = T5 tokens; pooled CLIP-L 768; position
    ids per image / text token; guidance (dev only)."""
    import torch

    cfg = model["transformer"]["config"]
    meta = {"device": "meta", "dtype": torch.bfloat16}
    side = resolution // int(model["vae_scale_factor"])
    tokens = int(model["transformer_text_tokens"])
    text = torch.empty(batch, tokens, int(cfg["joint_attention_dim"]), **meta)
    pooled = torch.empty(batch, int(cfg["pooled_projection_dim"]), **meta)
    timestep = torch.empty(batch, **meta)
    if model["transformer"]["class"] == "SD3Transformer2DModel":
        latents = torch.empty(batch, int(cfg["in_channels"]), side, side, **meta)
        return {
            "hidden_states": latents,
            "encoder_hidden_states": text,
            "pooled_projections": pooled,
            "timestep": timestep,
            "return_dict": False,
        }
    image_tokens = (side // 2) * (side // 2)
    kwargs = {
        "hidden_states": torch.empty(batch, image_tokens, int(cfg["in_channels"]), **meta),
        "encoder_hidden_states": text,
        "pooled_projections": pooled,
        "timestep": timestep,
        "img_ids": torch.empty(image_tokens, 3, **meta),
        "txt_ids": torch.empty(tokens, 3, **meta),
        "return_dict": False,
    }
    if cfg.get("guidance_embeds"):
        kwargs["guidance"] = torch.empty(batch, **meta)
    return kwargs


def measure_transformer(net, model: dict, *, batch: int, resolution: int, gc: bool, trained: str):
    """One bf16 train-mode forward on meta with flash attention; returns (held_bytes, recompute_peak_bytes).

    With gradient checkpointing (diffusers checkpoints each transformer block) every tensor argument of a block
    is held (non-reentrant checkpointing keeps them for the recomputation), nothing inside it."""
    import torch

    set_trained_transformer(net, trained, tuple(model["lora_target_modules"]))
    params = {p.untyped_storage()._cdata for p in net.parameters()}
    params |= {b.untyped_storage()._cdata for b in net.buffers()}
    held = SavedCounter(params)
    peak = {"recompute": 0}

    def checkpoint(module, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (tuple, list)) else (a,):
                if isinstance(t, torch.Tensor):
                    held.add(t)
        inner = SavedCounter(params)
        with inner.hooks():
            out = module(*args, **kwargs)
        peak["recompute"] = max(peak["recompute"], inner.total)
        return out

    if gc:
        net.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    else:
        net.disable_gradient_checkpointing()
    calls = {"n": 0}
    with attention_backend("efficient", "bf16", calls), held.hooks():
        net(**transformer_inputs(model, batch=batch, resolution=resolution))
    if not calls["n"]:
        raise RuntimeError(
            "the transformer never called scaled_dot_product_attention: the backend patch missed"
        )
    return held.total, peak["recompute"]


def measure_transformer_flops(net, model: dict, resolutions: tuple[int, ...]) -> dict:
    """FLOPs per sample counted by torch.utils.flop_counter on meta (flash attention's own formulas included):
    the forward, and a whole training step (forward + backward) for each trained set, fitted over resolutions.

    With gradient checkpointing a step also recomputes every block's forward: ``*_gc`` = step + forward. That
    identity is checked, not assumed: one step per trained set is counted at the native resolution with
    diffusers' own checkpointing (torch.utils.checkpoint, so the recomputation runs and is counted) and its
    relative difference from the identity goes into ``fit_max_error``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    targets = tuple(model["lora_target_modules"])
    scale = int(model["vae_scale_factor"])

    def count(fn) -> int:
        fc = FlopCounterMode(display=False)
        with fc, attention_backend("efficient", "bf16"):
            fn()
        return int(fc.get_total_flops())

    def forward(res: int) -> None:
        with torch.no_grad():
            net(**transformer_inputs(model, batch=1, resolution=res))

    def step(res: int) -> None:
        out = net(**transformer_inputs(model, batch=1, resolution=res))[0]
        out.float().square().mean().backward()
        for p in net.parameters():
            p.grad = None

    net.disable_gradient_checkpointing()
    points: dict[str, list] = {"forward": [], **{t: [] for t in TRANSFORMER_TRAINED}}
    for res in resolutions:
        lat = (res // scale) ** 2
        points["forward"].append((1, lat, count(lambda r=res: forward(r))))
        for trained in TRANSFORMER_TRAINED:
            set_trained_transformer(net, trained, targets)
            points[trained].append((1, lat, count(lambda r=res: step(r))))
    coefs = {k: fit(v, quadratic=True, with_fixed=False) for k, v in points.items()}
    worst = max(err for _, err in coefs.values())
    fwd = coefs["forward"][0]
    steps = {t: coefs[t][0] for t in TRANSFORMER_TRAINED}
    native = int(model["native_resolution"])
    lat = (native // scale) ** 2
    net.enable_gradient_checkpointing()
    for trained in TRANSFORMER_TRAINED:
        derived = {k: steps[trained][k] + fwd[k] for k in ("linear", "quadratic", "per_sample", "fixed")}
        set_trained_transformer(net, trained, targets)
        measured = count(lambda: step(native))
        predicted = derived["linear"] * lat + derived["quadratic"] * lat * lat + derived["per_sample"]
        worst = max(worst, abs(predicted - measured) / measured)
        steps[f"{trained}_gc"] = derived
    net.disable_gradient_checkpointing()
    return {"transformer_forward": fwd, "transformer_train_step": steps, "fit_max_error": round(worst, 6)}


def measure_any_text_encoder(entry: dict, *, batch: int, tokens: int) -> int:
    """Held bytes of a bf16 train-mode forward of any profile text encoder (CLIP, OpenCLIP, T5) on meta."""
    import torch
    from accelerate import init_empty_weights

    count_params = _scripts_import("count_params")
    with init_empty_weights():
        model = count_params.build_text_encoder(entry)
    model.tie_weights()
    model.to(torch.bfloat16).train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    held = SavedCounter(params)
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    with attention_backend("efficient", "bf16"), held.hooks():
        model(input_ids=ids)
    return held.total


def text_encoder_forward_flops(entry: dict, tokens: int) -> int:
    import torch
    from accelerate import init_empty_weights
    from torch.utils.flop_counter import FlopCounterMode

    count_params = _scripts_import("count_params")
    with init_empty_weights():
        model = count_params.build_text_encoder(entry)
    model.tie_weights()
    model.to(torch.bfloat16)
    fc = FlopCounterMode(display=False)
    with fc, torch.no_grad(), attention_backend("efficient", "bf16"):
        model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="meta"))
    return int(fc.get_total_flops())


def compute_transformer_family(model: dict, log) -> dict:
    """activations.yaml entry of a transformer family (bf16, flash-style attention)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    scale = int(model["vae_scale_factor"])
    out: dict[str, Any] = {"text_tokens": int(model["transformer_text_tokens"]), "transformer": {}}
    measured: list[dict] = []
    net = build_transformer(model)
    for gc, trained in itertools.product((False, True), TRANSFORMER_TRAINED):
        entry, points = measured_entry(
            lambda batch, res, net=net, gc=gc, trained=trained: measure_transformer(
                net, model, batch=batch, resolution=res, gc=gc, trained=trained
            ),
            model,
            TRANSFORMER_RESOLUTIONS,
            gc=gc,
            quadratic=False,
            error_digits=6,
        )
        for batch, res, held, peak, seconds in points:
            measured.append(
                {
                    "gradient_checkpointing": gc,
                    "trained": trained,
                    "batch": batch,
                    "resolution": res,
                    "held_bytes": held,
                    "recompute_peak_bytes": peak,
                }
            )
            log(
                f"  {model['family']} {trained:4s} gc={gc!s:5s} b={batch} {res:5d}: held {held / 2**30:7.3f} GiB, "
                f"recompute peak {peak / 2**30:6.3f} GiB ({seconds:.2f}s)"
            )
        out["transformer"][f"bf16/efficient/{'gc' if gc else 'no_gc'}/{trained}"] = entry
    t0 = time.perf_counter()
    flops = measure_transformer_flops(net, model, TRANSFORMER_FLOP_RESOLUTIONS)
    log(f"  {model['family']} flops ({time.perf_counter() - t0:.1f}s): {flops}")
    adafactor_transformer = adafactor_state_bytes(net)
    del net
    with init_empty_weights():
        vae = AutoencoderKL.from_config(dict(model["vae"]))
    vae.to(torch.bfloat16)
    vae_pts = []
    for res in TRANSFORMER_FLOP_RESOLUTIONS:
        fc = FlopCounterMode(display=False)
        with fc, torch.no_grad(), attention_backend("efficient", "bf16"):
            vae.encode(torch.empty(1, 3, res, res, device="meta", dtype=torch.bfloat16))
        vae_pts.append((1, (res // scale) ** 2, int(fc.get_total_flops())))
    out["text_encoders"] = []
    te_flops = 0
    te_adafactor = []
    for entry in model["text_encoders"]:
        tokens = int(entry["max_length"])
        one = measure_any_text_encoder(entry, batch=1, tokens=tokens)
        two = measure_any_text_encoder(entry, batch=2, tokens=tokens)
        out["text_encoders"].append(
            {"class": entry["class"], "held": {"bf16": {"per_sample": two - one, "fixed": 2 * one - two}}}
        )
        te_flops += text_encoder_forward_flops(entry, tokens)
        count_params = _scripts_import("count_params")
        with init_empty_weights():
            te = count_params.build_text_encoder(entry)
        te.tie_weights()
        te_adafactor.append(adafactor_state_bytes(te))
        log(
            f"  {model['family']} text encoder {entry['class']} ({tokens} tokens): {(two - one) / 2**20:.1f} MiB/sample"
        )
    out["adafactor_state_bytes"] = {"transformer": adafactor_transformer, "text_encoders": te_adafactor}
    out["flops"] = {
        "transformer_forward": flops["transformer_forward"],
        "transformer_train_step": flops["transformer_train_step"],
        "vae_encode": fit(vae_pts, quadratic=True, with_fixed=False)[0],
        "text_encoders_forward": te_flops,
    }
    out["flops_fit_max_error"] = flops["fit_max_error"]
    out["measured"] = measured
    return out


# -- LoRA target sets beyond the attention projections (kohya's defaults, LoCon) ---------------------------
#
# kohya-ss/sd-scripts networks/lora.py adapts every Linear and Conv2d inside a Transformer2DModel
# (UNET_TARGET_REPLACE_MODULE: proj_in, attn1/attn2 to_q/k/v/out.0, ff.net.0.proj, ff.net.2, proj_out) and,
# with conv_dim, those inside ResnetBlock2D / Downsample2D / Upsample2D (UNET_TARGET_REPLACE_MODULE_CONV2D_3X3:
# conv1, conv2, time_emb_proj, conv_shortcut, the resampler convs); text encoders: CLIPAttention + CLIPMLP.
# diffusers' LoRA scripts adapt to_q/k/v/out.0 only (the ``attn`` set above) and q/k/v/out_proj of the text
# encoder. A LoRA on Linear(i, o) adds rank * (i + o) parameters; on Conv2d(i, o, k) rank * (i * k * k + o)
# (down: the layer's kernel, up: 1x1), in peft and in kohya alike.
LORA_TARGET_SETS = {
    "attn_ff": (".attentions.",),
    "attn_ff_conv": (".attentions.", ".resnets.", ".downsamplers.", ".upsamplers."),
}
TEXT_ENCODER_LORA_SETS = {
    "attn": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "attn_mlp": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


def lora_modules(unet, target_set: str):
    """(name, module) of every layer a LoRA of ``target_set`` adapts ('attn', 'attn_ff', 'attn_ff_conv')."""
    import torch

    out = []
    for name, module in unet.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        if target_set == "attn":  # diffusers' default target_modules: to_q, to_k, to_v, to_out.0
            hit = ".attn" in name and name.endswith((".to_q", ".to_k", ".to_v", ".to_out.0"))
        else:
            hit = any(part in f".{name}." for part in LORA_TARGET_SETS[target_set])
        if hit:
            out.append((name, module))
    return out


def set_lora_trained(unet, target_set: str) -> None:
    """Only the adapted layers' weights need a gradient path that saves their inputs (a LoRA's down
    projection saves the same input the frozen layer would for a weight gradient)."""
    for p in unet.parameters():
        p.requires_grad_(False)
    for _, module in lora_modules(unet, target_set):
        module.weight.requires_grad_(True)


def lora_layer_params_per_rank(module) -> int:
    import torch

    if isinstance(module, torch.nn.Conv2d):
        kh, kw = module.kernel_size
        return module.in_channels * kh * kw + module.out_channels
    return module.in_features + module.out_features


def lora_params_per_rank(model: dict) -> dict:
    """LoRA parameters per unit of rank, per UNet target set and per text encoder (counted on meta)."""
    import transformers
    from accelerate import init_empty_weights

    unet = build_unet(model["unet"], "bf16")
    out: dict[str, Any] = {"unet": {}, "text_encoders": {k: [] for k in TEXT_ENCODER_LORA_SETS}}
    for target_set in ("attn", *LORA_TARGET_SETS):
        out["unet"][target_set] = sum(
            lora_layer_params_per_rank(m) for _, m in lora_modules(unet, target_set)
        )
    for entry in model.get("text_encoders", []):
        with init_empty_weights():
            enc = getattr(transformers, entry["class"])(transformers.CLIPTextConfig(**entry["config"]))
        for key, names in TEXT_ENCODER_LORA_SETS.items():
            total = sum(
                lora_layer_params_per_rank(m)
                for name, m in enc.named_modules()
                if name.rsplit(".", 1)[-1] in names and hasattr(m, "in_features")
            )
            out["text_encoders"][key].append(total)
    return out


def compute_lora_targets(model: dict, resolutions: tuple[int, ...], log) -> dict:
    """The UNet activation entries of the LoRA target sets beyond attention, and the per-rank parameter
    counts: merged into a family's entry of activations.yaml."""
    unet_entries: dict[str, Any] = {}
    for dtype_name in DTYPES:
        unet = build_unet(model["unet"], dtype_name)
        for backend, gc, trained in itertools.product(BACKENDS, (False, True), LORA_TARGET_SETS):
            key, entry, _ = unet_entry(
                unet, model, resolutions, dtype_name=dtype_name, backend=backend, gc=gc, trained=trained
            )
            unet_entries[key] = entry
            log(f"  {model['family']} {key}: held {entry['held']}")
        del unet
    counts = lora_params_per_rank(model)
    log(f"  {model['family']} LoRA params per rank: {counts}")
    return {"unet": unet_entries, "lora_params_per_rank": counts}


def merge_lora_targets(family_entry: dict, extra: dict) -> dict:
    family_entry["unet"].update(extra["unet"])
    family_entry["lora_params_per_rank"] = extra["lora_params_per_rank"]
    return family_entry


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=root / "profiles" / "models")
    ap.add_argument("--out", type=Path, default=root / "profiles" / "activations.yaml")
    ap.add_argument(
        "--families",
        default=",".join([*FAMILY_RESOLUTIONS, *TRANSFORMER_FAMILIES]),
        help="comma-separated; the other families already in --out are kept as they are",
    )
    ap.add_argument("--keep-measured", action="store_true", help="also write every raw measurement")
    ap.add_argument(
        "--only-lora-targets",
        action="store_true",
        help="add the LoRA target-set entries (attn_ff, attn_ff_conv) and per-rank counts to the existing --out",
    )
    ap.add_argument(
        "--only-traffic",
        action="store_true",
        help="add the bandwidth-bound bytes of the UNet forward (traffic) to the existing --out",
    )
    ap.add_argument(
        "--only-sampling",
        action="store_true",
        help="add the sampling peaks (UNet inference, VAE decode) to the existing --out",
    )
    args = ap.parse_args(argv)
    if args.only_sampling:
        return update_families(args, "sampling", update_sampling)
    if args.only_lora_targets:
        return update_families(
            args,
            "LoRA target sets",
            lambda entry, model, fam, log: merge_lora_targets(
                entry, compute_lora_targets(model, FAMILY_RESOLUTIONS[fam], log)
            ),
        )
    if args.only_traffic:
        return update_families(args, "traffic", _add_entry("traffic", measure_traffic))

    import diffusers
    import torch

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    families: dict[str, Any] = {}
    if args.out.is_file():
        families = dict((yaml.safe_load(args.out.read_text()) or {}).get("families") or {})
    for fam in args.families.split(","):
        path = args.models_dir / f"{fam}.yaml"
        model = yaml.safe_load(path.read_text())
        log(f"{fam}: {path}")
        if fam in TRANSFORMER_FAMILIES:
            result = compute_transformer_family(model, log)
        else:
            result = compute_family(model, FAMILY_RESOLUTIONS[fam], log)
            merge_lora_targets(result, compute_lora_targets(model, FAMILY_RESOLUTIONS[fam], log))
            result["traffic"] = measure_traffic(model, FAMILY_RESOLUTIONS[fam], log)
        update_sampling(result, model, fam, log)
        if not args.keep_measured:
            result.pop("measured")
        families[fam] = result
    doc = {
        "schema_version": 1,
        "source": (
            f"computed: scripts/compute_activations.py, diffusers {diffusers.__version__}, "
            f"torch {torch.__version__.split('+')[0]}, {_dt.date.today().isoformat()}"
        ),
        "units": "bytes; L = latent pixels (H/8 x W/8); "
        "bytes(batch, L) = batch * (linear*L + quadratic*L^2 + per_sample) + fixed; "
        "flops: FLOPs per sample, same form with batch 1",
        "families": families,
    }
    header = (
        "# Activation memory of SD training, computed on the meta device from the real autograd graph.\n"
        "# Written by scripts/compute_activations.py; do not edit by hand, re-run the script.\n"
    )
    args.out.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=110))
    log(f"wrote {args.out}")
    return 0


# -- memory traffic of the bandwidth-bound ops (the roofline's byte term) -------------------------------------
#
# At the batch sizes of SD training many kernels (normalisations, activations, residual adds, casts, the
# attention's reshapes) move more bytes than they compute: their time is bytes / memory bandwidth, not FLOPs /
# TFLOPS. Counted on meta with a TorchDispatchMode: every op except the compute-bound ones (matmuls,
# convolutions, fused attention: their FLOPs are measure_flops') adds the bytes of its tensor inputs and
# outputs; views move nothing.
COMPUTE_BOUND_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product",
    "linear",
    "matmul",
)
VIEW_OPS = (
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "expand",
    "slice",
    "select",
    "t",
    "detach",
    "unsqueeze",
    "squeeze",
    "split",
    "chunk",
    "alias",
    "as_strided",
    "unbind",
    "lift_fresh",
    "empty",
    "zeros",
)


def count_traffic(fn) -> int:
    """Bytes read + written by the bandwidth-bound ops ``fn`` dispatches (meta tensors)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Traffic(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0].lstrip("_") if hasattr(func, "__name__") else str(func)
            base = func._schema.name.split("::")[-1] if hasattr(func, "_schema") else name
            if not base.startswith(COMPUTE_BOUND_OPS) and base not in VIEW_OPS:
                flat, _ = tree_flatten((args, kwargs or {}, out))
                Traffic.total += sum(
                    t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor)
                )
            return out

    with Traffic(), torch.no_grad():
        fn()
    return Traffic.total


def measure_traffic(model: dict, resolutions: tuple[int, ...], log) -> dict:
    """UNet forward bytes of the bandwidth-bound ops per sample vs latent pixels (bf16), with the efficient
    attention kernels and with the math path (which writes and reads the whole attention matrix: its softmax,
    scaling and copies are bandwidth-bound, a quadratic term)."""
    import torch

    unet = build_unet(model["unet"], "bf16")
    unet.eval()
    scale = int(model.get("vae_scale_factor", 8))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    pts: dict[str, list[tuple[int, int, int]]] = {"efficient": [], "math": []}
    for res in resolutions:
        side = res // scale
        args, kwargs = unet_meta_inputs(model, batch=1, side=side, dtype=meta["dtype"])
        for backend in pts:
            with attention_backend(backend, "bf16"):
                pts[backend].append((1, side * side, count_traffic(lambda a=args, k=kwargs: unet(*a, **k))))
    coef, err = fit(pts["efficient"], quadratic=False, with_fixed=False)
    math_coef, math_err = fit(pts["math"], quadratic=True, with_fixed=False)
    log(f"  {model['family']} UNet forward bandwidth-bound bytes: {coef} (fit error {err:.4f})")
    log(f"  {model['family']} ... with math attention: {math_coef} (fit error {math_err:.4f})")
    return {"unet_forward_bytes": coef, "unet_forward_bytes_math": math_coef}


# -- peaks outside the training step: sampling (UNet inference, VAE decode) ---------------------------------
#
# sdplan's trainer samples a grid at the end of training (and every sampling.every_steps) with the training
# state resident. Its transient is the largest of the UNet's no-grad forward (classifier-free guidance: batch 2)
# and the VAE decode at full resolution. Measured as the peak of live tensor bytes on meta: a TorchDispatchMode
# adds every new output storage and a finalizer on each tensor returns the bytes when the last one dies.


def peak_live_bytes(fn) -> int:
    """The peak bytes of tensors ``fn`` creates and holds at once (no grad, meta tensors; its inputs excluded)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    live = {"now": 0, "peak": 0}
    storages: dict[int, list[int]] = {}  # storage key -> [live tensor objects, bytes]

    def release(key: int) -> None:
        entry = storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            live["now"] -= entry[1]
            del storages[key]

    class Live(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor):
                    continue
                key = t.untyped_storage()._cdata
                if key not in storages:
                    storages[key] = [0, int(t.untyped_storage().nbytes())]
                    live["now"] += storages[key][1]
                    live["peak"] = max(live["peak"], live["now"])
                storages[key][0] += 1
                weakref.finalize(t, release, key)
            return out

    with Live(), torch.no_grad():
        result = fn()
    del result
    return live["peak"]


def count_flops(fn) -> int:
    """FLOPs of ``fn`` (torch.utils.flop_counter on meta), without gradients."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    fc = FlopCounterMode(display=False)
    with fc, torch.no_grad():
        fn()
    return int(fc.get_total_flops())


def measure_sampling(model: dict, resolutions: tuple[int, ...], log) -> dict:
    """Per-sample peaks of the denoiser's inference forward (bf16) and the VAE decode (bf16 and fp32: the SD VAE
    decodes in fp32 under fp16), fitted against latent pixels, and the decode's FLOPs. The UNet at batch 2 (classifier-free guidance);
    a transformer at batch 2 where its pipeline guides with a negative prompt (SD3.5), else 1 (FLUX.1 is
    guidance-distilled). A transformer family's text encoders do not come back for a grid (trainer/flow.py
    cached_conditioning), so they are not part of it."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    scale = int(model.get("vae_scale_factor", 8))
    if "transformer" in model:  # SD3.5 / FLUX.1
        net = build_transformer(model)
        net.requires_grad_(False)
        batch = 1 if model["transformer"]["class"] == "FluxTransformer2DModel" else 2

        def forward(res: int):
            kwargs = transformer_inputs(model, batch=batch, resolution=res)
            return lambda: net(**kwargs)

    else:
        net = build_unet(model["unet"], "bf16")

        def forward(res: int):
            args, kwargs = unet_meta_inputs(model, batch=2, side=res // scale, dtype=torch.bfloat16)
            return lambda: net(*args, **kwargs)

    net.eval()
    with init_empty_weights():
        vae = AutoencoderKL.from_config(dict(model["vae"]))
    vae.eval()
    net_pts: list[tuple[int, int, int]] = []
    vae_pts: dict[str, list[tuple[int, int, int]]] = {"bf16": [], "fp32": []}
    decode_flops: list[tuple[int, int, int]] = []
    for res in resolutions:
        side = res // scale
        z = torch.empty(
            1, int(model.get("latent_channels", 4)), side, side, device="meta", dtype=torch.bfloat16
        )
        vae.to(torch.bfloat16)
        decode_flops.append((1, side * side, count_flops(lambda x=z: vae.decode(x))))
        with attention_backend("efficient", "bf16"):
            net_pts.append((1, side * side, peak_live_bytes(forward(res))))
        for dtype_name in ("bf16", "fp32"):
            vae.to(_torch_dtype(dtype_name))
            z = torch.empty(1, int(model.get("latent_channels", 4)), side, side, device="meta")
            z = z.to(_torch_dtype(dtype_name))
            with attention_backend("efficient", dtype_name):
                vae_pts[dtype_name].append((1, side * side, peak_live_bytes(lambda x=z: vae.decode(x))))
    out = {"unet_inference_peak": fit(net_pts, quadratic=False, with_fixed=False)[0]}
    out["vae_decode_peak"] = {k: fit(v, quadratic=False, with_fixed=False)[0] for k, v in vae_pts.items()}
    # the decode's FLOPs per sample (the time a sampled image's decode takes: planner.image_seconds)
    out["vae_decode_flops"] = fit(decode_flops, quadratic=True, with_fixed=False)[0]
    log(f"  {model['family']} sampling peaks: {out}")
    return out


def _add_entry(key: str, measure):
    """An updater that sets a family's ``key`` entry to ``measure(model, resolutions, log)``."""

    def update(entry: dict, model: dict, fam: str, log) -> None:
        entry[key] = measure(model, FAMILY_RESOLUTIONS[fam], log)

    return update


def update_sampling(entry: dict, model: dict, fam: str, log) -> None:
    """--only-sampling: a family's peaks at its resolutions (measure_sampling)."""
    flow = fam in TRANSFORMER_FAMILIES
    entry["sampling"] = measure_sampling(
        model, TRANSFORMER_RESOLUTIONS if flow else FAMILY_RESOLUTIONS[fam], log
    )


def update_families(args, what: str, update) -> int:
    """Re-measure one part of each family's entry in an existing activations file (its other entries kept):
    ``update(entry, model, family, log)`` changes the entry in place; the file's source says what was added."""
    text = args.out.read_text()
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
    doc = yaml.safe_load(text)
    for fam in args.families.split(","):
        model = yaml.safe_load((args.models_dir / f"{fam}.yaml").read_text())
        print(f"{fam}: {what}", file=sys.stderr, flush=True)
        update(doc["families"][fam], model, fam, lambda m: print(m, file=sys.stderr, flush=True))
    flag = "--only-" + what.lower().replace(" ", "-").replace("-sets", "s")
    if f"{what} added" not in doc["source"]:
        doc["source"] += f"; {what} added by {flag}"
    args.out.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=110))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
