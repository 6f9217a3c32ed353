"""DeepSpeed's fp32 master weights: where a run starts from and what it exports.

Under ``bf16`` / ``fp16`` DeepSpeed's engine casts the trained model to that dtype when it is built
(``engine._cast_module_mixed_precision``) and only then builds its fp32 master weights from the cast model
(``runtime/zero/stage_1_and_2.py``): the master started from the base rounded to bf16 (5.4e-4 at most on the
tiny SD 1.x UNet, about 7x what a whole run at lr 1e-5 moved it). The model the recipes export is that cast
copy too, so a run saved bf16 weights off the fp32 master it trained (a LoRA by up to 0.3%), where the same
config without DeepSpeed exports fp32.

- :func:`prepare`: ``accelerator.prepare`` with the trained parameters' masters set back to the exact base
  (``deepspeed.utils.safe_set_full_fp32_param``, ZeRO 1/2/3) from an fp32 copy in host RAM taken before the
  engine is built. It costs 4 bytes per trained parameter on each process, from before the engine is built
  (which allocates the offloaded optimizer state, 12 bytes per parameter) until the restore: 3.4 GB for the
  SD 1.x UNet, 10.3 GB for the SDXL UNet, megabytes for LoRA adapters and embeddings; freed at once after.
- :func:`gather` (on every process: a collective) then :func:`masters_in` (the main process, in the export):
  each trained parameter's fp32 master (``deepspeed.utils.safe_get_full_fp32_param``) in place of the cast
  copy while the recipe exports, so the outputs are what the same run without DeepSpeed writes (fp32 trained
  weights: DeepSpeed refuses ``training.full_half_weights``). They are host copies (4 bytes per trained
  parameter, as the fp32 UNet an export without DeepSpeed reads from the GPU), dropped after the export.
- :func:`parameters`: what the EMA averages, the masters too (the engine's bf16 copy kept it within that copy's
  rounding of the weights).

Without DeepSpeed each is a no-op; so are the exports' and the EMA's in fp32 under ZeRO 1/2 (the engine's
step writes its masters into the model, which then holds the same values).
"""

from __future__ import annotations

import contextlib
from typing import Any

from .checkpoint import unwrap


def _deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def _half(accelerator) -> bool:
    """Whether DeepSpeed casts the trained model (its bf16 / fp16 blocks: accelerate's mixed_precision)."""
    return _deepspeed(accelerator) and accelerator.mixed_precision in ("bf16", "fp16")


def _kept_apart(accelerator) -> bool:
    """Whether DeepSpeed's masters hold other values than the model's: a bf16 / fp16 model, or ZeRO-3's
    partitioned one. In fp32 under ZeRO 1/2 the engine's step copies the masters into the model."""
    if not _deepspeed(accelerator):
        return False
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return _half(accelerator) or getattr(plugin, "zero_stage", 0) == 3


def _trained(model) -> list[tuple[str, Any]]:
    return [(name, p) for name, p in unwrap(model).named_parameters() if p.requires_grad]


def prepare(accelerator, trained: dict[str, Any], *rest, **kw):
    """``accelerator.prepare(*trained.values(), *rest, **kw)``; under DeepSpeed in bf16 / fp16, the fp32 master of
    every trained parameter set to its value before the engine cast it (see the module's note)."""
    import torch

    kept: list[dict[str, Any]] = []
    if _half(accelerator):
        kept = [
            {name: p.detach().to("cpu", copy=True) for name, p in _trained(m) if p.dtype == torch.float32}
            for m in trained.values()
        ]
    prepared = accelerator.prepare(*trained.values(), *rest, **kw)
    if kept:
        from deepspeed.utils import safe_set_full_fp32_param

        for model, base in zip(prepared[: len(trained)], kept):
            for name, p in _trained(model):
                if name in base:
                    safe_set_full_fp32_param(p, base.pop(name))
    return prepared


def _master(p, accelerator):
    """Parameter ``p``'s fp32 master (every process calls it: a collective), or None where DeepSpeed keeps none.
    One process of ZeRO 1/2 holds every parameter's whole master: read in place there (with the optimizer
    offloaded, in host RAM), not sent to the GPU and back."""
    from deepspeed.utils import safe_get_full_fp32_param

    mapping = getattr(p, "_hp_mapping", None)  # DeepSpeed's own (tensor_fragment.py): read with care
    numel = getattr(getattr(mapping, "lp_fragment_address", None), "numel", None)
    whole = numel == p.numel() and hasattr(mapping, "get_hp_fragment")
    if accelerator.num_processes == 1 and whole and not hasattr(p, "ds_id"):
        return mapping.get_hp_fragment().view(p.shape)
    return safe_get_full_fp32_param(p)


def parameters(model, accelerator):
    """``model``'s parameters as the EMA averages them: under DeepSpeed each one's fp32 master, one at a time (every
    process calls it: a collective), not the bf16 / fp16 copy the engine computes with (an average of that copy
    stayed within its rounding of the weights, as coarse as what the fp32 masters fix); else the parameters."""
    if not _kept_apart(accelerator):
        yield from model.parameters()
        return
    for p in unwrap(model).parameters():
        master = _master(p, accelerator) if p.requires_grad else None
        yield p if master is None else master


def gather(recipe) -> None:
    """Under DeepSpeed: each trained parameter's fp32 master gathered from the processes' shards (every process
    calls it: a collective), kept on the main process as ``recipe.fp32_masters`` (host copies) for the next
    export (:func:`masters_in`). A no-op otherwise."""
    recipe.fp32_masters = None
    accelerator = recipe.accelerator
    if not _kept_apart(accelerator):
        return
    masters: dict[tuple[str, str], Any] = {}
    for key, model in recipe.trained.items():
        for name, p in _trained(model):
            full = _master(p, accelerator)
            if full is not None and accelerator.is_main_process:
                masters[(key, name)] = full.detach().to("cpu", copy=True)
    recipe.fp32_masters = masters if accelerator.is_main_process else None


@contextlib.contextmanager
def masters_in(recipe):
    """While the block runs (the recipe's export, on the main process): the trained parameters hold the fp32
    masters :func:`gather` took (in host RAM; the model's other tensors stay where they are), then their own
    tensors again; the masters are dropped after. Without them (no DeepSpeed) the models are as they are."""
    masters = getattr(recipe, "fp32_masters", None) or {}
    swapped = []
    try:
        for key, model in recipe.trained.items():
            for name, p in _trained(model):
                master = masters.get((key, name))
                if master is not None:
                    swapped.append((p, p.data))
                    p.data = master
        yield
    finally:
        for p, own in swapped:
            p.data = own
        recipe.fp32_masters = None


def restore_rows(weight, keep, rows, accelerator) -> None:
    """``weight[keep] = rows[keep]`` (textual inversion puts back every embedding row but the new token's after
    each step), in ``weight``'s dtype; under DeepSpeed in its fp32 master too (every process calls it): the
    engine copies the master into the model at each step, so rows put back in its bf16 copy alone came back
    moved by AdamW's weight decay, and the fp32 rows did not go into a bf16 copy at all (RuntimeError: Index put
    requires the source and destination dtypes match)."""
    weight[keep] = rows[keep].to(weight.dtype)
    # in fp32 too: ZeRO 1/2 step their own copy of the weights, then copy it into the model
    if not _deepspeed(accelerator):
        return
    master = _master(weight, accelerator)
    if master is None:
        return
    from deepspeed.utils import safe_set_full_fp32_param

    at = keep.to(master.device)
    master[at] = rows.to(master.device, master.dtype)[at]
    safe_set_full_fp32_param(weight, master)
