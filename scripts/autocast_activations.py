#!/usr/bin/env python
"""How far the activation bytes in profiles/activations.yaml are from what a mixed-precision training step holds.

``scripts/compute_activations.py`` counts the tensors autograd saves in a forward with bf16 weights and bf16
inputs. The trainer runs under autocast instead (accelerate's ``mixed_precision``; the LoRA matrices and full
methods' master weights are fp32), and the planner multiplies the counted bytes by one constant,
``sdplan.planner.ACTIVATION_FACTOR``, chosen on published UNet peaks. This script measures, on the meta device
(no GPU, nothing allocated), the two things that constant stands for:

- ``autocast``: the saved bytes when CUDA autocast's casting rules apply (matmuls, convolutions and attention
  in bf16; layer_norm, group_norm, softmax, pow, exp, rsqrt, sum and the other ops of autocast's fp32 list in
  fp32, so their outputs and what follows them stay fp32; every Linear casts its fp32 input anew, so q, k and v
  each keep their own bf16 copy). The rules are applied by a TorchFunctionMode: autocast itself has no meta
  dispatch key.
- ``peak``: the peak of live tensor bytes over a whole forward and backward under those rules (parameters,
  inputs and accumulated .grad excluded), with diffusers' own gradient checkpointing when it is on.

Printed per configuration: the bf16 count the planner ships, the autocast count, the peak, and
``implied = peak / shipped``, the factor the planner would need for that configuration before allocator and
CUDA overheads (ACTIVATION_FACTOR is one number for all of them). Figures, not a fit: nothing here changes a
profile.

Run: ``python scripts/autocast_activations.py [--family sd15 --family flux-dev ...] [--resolution N]``.
Needs torch, diffusers, transformers and accelerate; downloads nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compute_activations as ca  # noqa: E402

GiB = 2**30
DEFAULT_FAMILIES = ("sd15", "sdxl", "flux-dev", "sd35-large")


def _cuda_autocast_lists():
    """CUDA autocast's lower-precision and fp32 op lists (torch docs, "Autocast Op Reference"), as the Python
    callables diffusers' modules reach."""
    import torch
    import torch.nn.functional as F

    low = {F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
    low |= {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.baddbmm, torch.mm}
    low |= {torch.addmm, torch.addbmm, torch.einsum, torch.conv2d, F.scaled_dot_product_attention}
    fp32 = {F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm, F.softmax, F.log_softmax}
    fp32 |= {torch.softmax, torch.Tensor.softmax, torch.log_softmax, F.normalize, F.softplus, F.mse_loss}
    fp32 |= {torch.exp, torch.Tensor.exp, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.rsqrt}
    fp32 |= {torch.Tensor.rsqrt, torch.sum, torch.Tensor.sum, torch.cumsum, torch.reciprocal, torch.log}
    return low, fp32


@contextlib.contextmanager
def autocast_rules(low_dtype):
    """CUDA autocast's casts, on any device (meta included)."""
    import torch
    from torch.overrides import TorchFunctionMode

    low, fp32 = _cuda_autocast_lists()

    def cast(value, dtype):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v, dtype) for v in value)
        return value

    class Rules(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            dtype = low_dtype if func in low else torch.float32 if func in fp32 else None
            if dtype is not None:
                args = tuple(cast(a, dtype) for a in args)
                kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    with Rules():
        yield


class LiveBytes:
    """Peak bytes of tensors alive at once, each storage once, skipping the given storages and the bytes already
    accumulated into .grad (the planner counts gradients apart from activations)."""

    def __init__(self, skip: set[int]):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.skip, self.now, self.peak, self.grads = skip, 0, 0, 0
        self.storages: dict[int, list[int]] = {}
        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter.record(out)
                return out

        self.mode = Mode()

    def release(self, key: int) -> None:
        entry = self.storages.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.now -= entry[1]
                del self.storages[key]

    def record(self, out) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage()._cdata
            if key in self.skip:
                continue
            if key not in self.storages:
                self.storages[key] = [0, int(t.untyped_storage().nbytes())]
                self.now += self.storages[key][1]
                self.peak = max(self.peak, self.now - self.grads)
            self.storages[key][0] += 1
            weakref.finalize(t, self.release, key)

    def add_grad(self, param) -> None:
        self.grads += int(param.grad.untyped_storage().nbytes())


def _load_model(family: str) -> dict:
    model = yaml.safe_load((ROOT / "profiles" / "models" / f"{family}.yaml").read_text())
    model["family"] = family
    return model


def _build(model: dict, trained: str):
    """(network, forward kwargs maker, set-trained function) for a UNet or transformer family."""
    import torch

    if "transformer" in model:
        net = ca.build_transformer(model)
        targets = tuple(model["lora_target_modules"])
        mode = "lora" if trained == "lora" else "full"

        def inputs(batch, res):
            return (), ca.transformer_inputs(model, batch=batch, resolution=res)

        return net, inputs, lambda: ca.set_trained_transformer(net, mode, targets)
    net = ca.build_unet(model["unet"], "bf16")
    mode = "attn" if trained == "lora" else "unet"

    def inputs(batch, res):
        args, kwargs = ca.unet_meta_inputs(
            model, batch=batch, side=res // int(model.get("vae_scale_factor", 8)), dtype=torch.bfloat16
        )
        return args, {**kwargs, "return_dict": False}

    return net, inputs, lambda: ca.set_trained(net, mode)


def saved_bytes(model: dict, *, resolution: int, gc: bool, trained: str, autocast: bool) -> int:
    """What compute_activations.py ships (autocast False) or the same count under autocast's rules: the held
    bytes (with checkpointing: the blocks' inputs) plus the largest block's recomputation."""
    import torch

    rules = autocast_rules(torch.bfloat16) if autocast else contextlib.nullcontext()
    if "transformer" in model:
        net = ca.build_transformer(model)
        with rules:
            held, peak = ca.measure_transformer(
                net,
                model,
                batch=1,
                resolution=resolution,
                gc=gc,
                trained="lora" if trained == "lora" else "full",
            )
    else:
        net = ca.build_unet(model["unet"], "bf16")
        with rules:
            held, peak = ca.measure_unet(
                net,
                model,
                batch=1,
                resolution=resolution,
                dtype_name="bf16",
                backend="efficient",
                gc=gc,
                trained="attn" if trained == "lora" else "unet",
            )
    return held + peak


def peak_bytes(model: dict, *, resolution: int, gc: bool, trained: str) -> int:
    """Peak live bytes over one forward and backward under autocast's rules, diffusers' checkpointing on or off."""
    import torch

    net, inputs, set_trained = _build(model, trained)
    set_trained()
    if gc:
        # diffusers' checkpointing (non-reentrant torch.utils.checkpoint); the recomputation runs inside the
        # backward, outside this thread's function modes, so it re-enters autocast's rules as autocast does
        def checkpoint(block, *args, **kwargs):
            def recomputable(*a, **k):
                with autocast_rules(torch.bfloat16):
                    return block(*a, **k)

            return torch.utils.checkpoint.checkpoint(recomputable, *args, use_reentrant=False, **kwargs)

        net.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    else:
        net.disable_gradient_checkpointing()
    skip = {p.untyped_storage()._cdata for p in net.parameters()}
    skip |= {b.untyped_storage()._cdata for b in net.buffers()}
    args, kwargs = inputs(1, resolution)
    skip |= {t.untyped_storage()._cdata for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    meter = LiveBytes(skip)
    for p in net.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(meter.add_grad)
    with autocast_rules(torch.bfloat16), ca.attention_backend("efficient", "bf16"), meter.mode:
        out = net(*args, **kwargs)[0]
        out.float().pow(2).mean().backward()
    return meter.peak


def measure(family: str, *, resolution: int | None, gc: bool, trained: str) -> dict:
    model = _load_model(family)
    res = resolution or int(model["native_resolution"])
    shipped = saved_bytes(model, resolution=res, gc=gc, trained=trained, autocast=False)
    autocast = saved_bytes(model, resolution=res, gc=gc, trained=trained, autocast=True)
    peak = peak_bytes(model, resolution=res, gc=gc, trained=trained)
    return {
        "family": family,
        "resolution": res,
        "gradient_checkpointing": gc,
        "trained": trained,
        "shipped_bytes": shipped,
        "autocast_bytes": autocast,
        "peak_bytes": peak,
        "implied_factor": peak / shipped,
    }


def render(rows: list[dict]) -> str:
    from sdplan.planner import ACTIVATION_FACTOR

    lines = [
        f"{'family':11s} {'px':>5s} {'gc':3s} {'trained':7s} {'shipped GiB':>11s} {'autocast':>9s} {'peak':>9s} "
        f"{'implied':>8s}  (planner: x{ACTIVATION_FACTOR} of shipped)"
    ]
    for r in rows:
        lines.append(
            f"{r['family']:11s} {r['resolution']:5d} {'on' if r['gradient_checkpointing'] else 'off':3s} "
            f"{r['trained']:7s} {r['shipped_bytes'] / GiB:11.3f} {r['autocast_bytes'] / GiB:9.3f} "
            f"{r['peak_bytes'] / GiB:9.3f} {r['implied_factor']:7.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", help=f"default: {', '.join(DEFAULT_FAMILIES)}")
    parser.add_argument("--resolution", type=int, help="default: each family's native resolution")
    parser.add_argument("--trained", choices=("lora", "full"), action="append", help="default: lora and full")
    args = parser.parse_args(argv)
    rows = []
    for family in args.family or DEFAULT_FAMILIES:
        for trained in args.trained or ("lora", "full"):
            for gc in (False, True):
                rows.append(measure(family, resolution=args.resolution, gc=gc, trained=trained))
                print(render(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
