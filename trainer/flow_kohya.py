"""FLUX.1 LoRA in kohya sd-scripts names (``networks.lora_flux``), which ComfyUI loads too.

kohya names a FLUX LoRA after Black Forest Labs' module paths with ``lora_unet_`` in front and dots as
underscores: ``lora_unet_double_blocks_{i}_{img|txt}_{attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin}`` and
``lora_unet_single_blocks_{i}_{linear1|linear2|modulation_lin}``, each with ``.lora_down.weight``,
``.lora_up.weight`` and a scalar ``.alpha`` (scale alpha / rows of lora_down). ComfyUI ``comfy/lora.py``
``model_lora_keys_unet`` maps ``lora_unet_`` + every ``diffusion_model`` weight path of the BFL model with dots
as underscores, so the same names load there. (Sources: kohya-ss/sd-scripts networks/lora_flux.py and
networks/convert_flux_lora.py's key table; comfyanonymous/ComfyUI comfy/lora.py.)

BFL fuses what diffusers keeps apart: a double block's q, k, v in one ``qkv`` linear (image: ``attn.to_q/k/v``;
text: ``attn.add_q/k/v_proj``), a single block's q, k, v and MLP input in ``linear1``. A fused LoRA is exact:
``lora_down`` stacks the parts' down matrices (rank parts x r) and ``lora_up`` is block-diagonal (each part's
up matrix in its own rows and rank columns; rows of parts without an adapter stay zero), and alpha is
multiplied by the number of stacked parts so alpha / rank is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .export import ExportError, _save_safetensors

# diffusers module (in a transformer block) -> BFL module, one to one.
_DOUBLE_SINGLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
}
# BFL fused module -> the diffusers modules stacked in it, in row order.
_DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation.lin"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def bfl_module_names(transformer_config: dict[str, Any]) -> set[str]:
    """Every linear module path of the BFL FLUX model a LoRA can target, for a diffusers transformer config."""
    names = set()
    for i in range(transformer_config["num_layers"]):
        for m in [*_DOUBLE_SINGLE.values(), *_DOUBLE_FUSED]:
            names.add(f"double_blocks.{i}.{m}")
    for i in range(transformer_config["num_single_layers"]):
        for m in [*_SINGLE_SINGLE.values(), *_SINGLE_FUSED]:
            names.add(f"single_blocks.{i}.{m}")
    return names


def kohya_name(bfl_module: str) -> str:
    return "lora_unet_" + bfl_module.replace(".", "_")


def _part_rows(transformer_config: dict[str, Any], module: str) -> int:
    """Output rows of one diffusers part of a fused BFL linear."""
    inner = transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
    return 4 * inner if module == "proj_mlp" else inner  # FluxSingleTransformerBlock mlp_ratio 4


def flux_kohya_state_dict(
    peft_state_dict: dict[str, Any], transformer_config: dict[str, Any], alpha: float
) -> dict[str, Any]:
    """kohya tensors for a peft state dict of a FluxTransformer2DModel (``...lora_A.weight``/``lora_B``
    keys, no adapter name). Every LoRA module must have a kohya name (ExportError otherwise)."""
    import torch

    lora: dict[str, dict[str, Any]] = {}  # diffusers module path -> {"A": down, "B": up}
    for key, value in peft_state_dict.items():
        for tag in ("A", "B"):
            suffix = f".lora_{tag}.weight"
            if key.endswith(suffix):
                lora.setdefault(key[: -len(suffix)], {})[tag] = value
                break
        else:
            raise ExportError(f"{key}: not a LoRA weight kohya FLUX files can hold")
    out: dict[str, Any] = {}
    used: set[str] = set()

    def single(diffusers_path: str, bfl: str) -> None:
        if diffusers_path in lora:
            ab = lora[diffusers_path]
            out[kohya_name(bfl) + ".lora_down.weight"] = ab["A"]
            out[kohya_name(bfl) + ".lora_up.weight"] = ab["B"]
            out[kohya_name(bfl) + ".alpha"] = torch.tensor(float(alpha))
            used.add(diffusers_path)

    def fused(prefix: str, parts: tuple[str, ...], bfl: str) -> None:
        present = [p for p in parts if f"{prefix}.{p}" in lora]
        if not present:
            return
        downs = [lora[f"{prefix}.{p}"]["A"] for p in present]
        rank = downs[0].shape[0]
        rows = [_part_rows(transformer_config, p) for p in parts]
        up = torch.zeros(sum(rows), rank * len(present), dtype=downs[0].dtype)
        col, row = 0, 0
        for p, n in zip(parts, rows):
            if p in present:
                b = lora[f"{prefix}.{p}"]["B"]
                if b.shape[0] != n:
                    raise ExportError(f"{prefix}.{p}: {b.shape[0]} output rows, expected {n}")
                up[row : row + n, col : col + rank] = b
                col += rank
                used.add(f"{prefix}.{p}")
            row += n
        out[kohya_name(bfl) + ".lora_down.weight"] = torch.cat(downs, dim=0)
        out[kohya_name(bfl) + ".lora_up.weight"] = up
        out[kohya_name(bfl) + ".alpha"] = torch.tensor(float(alpha) * len(present))

    for i in range(transformer_config["num_layers"]):
        prefix = f"transformer_blocks.{i}"
        for d, b in _DOUBLE_SINGLE.items():
            single(f"{prefix}.{d}", f"double_blocks.{i}.{b}")
        for b, parts in _DOUBLE_FUSED.items():
            fused(prefix, parts, f"double_blocks.{i}.{b}")
    for i in range(transformer_config["num_single_layers"]):
        prefix = f"single_transformer_blocks.{i}"
        for d, b in _SINGLE_SINGLE.items():
            single(f"{prefix}.{d}", f"single_blocks.{i}.{b}")
        for b, parts in _SINGLE_FUSED.items():
            fused(prefix, parts, f"single_blocks.{i}.{b}")
    unmapped = sorted(set(lora) - used)
    if unmapped:
        raise ExportError(
            f"LoRA on {unmapped[0]} (and {len(unmapped) - 1} more) has no kohya FLUX name",
            fix="train the default FLUX targets, or set output.save_kohya: false",
        )
    return out


def save_flux_kohya(
    path: Path, peft_state_dict: dict[str, Any], *, transformer_config: dict[str, Any], alpha: float, metadata
) -> Path:
    return _save_safetensors(
        flux_kohya_state_dict(peft_state_dict, transformer_config, alpha), path, metadata
    )
