"""SD3.5 and FLUX.1 LoRA in kohya sd-scripts names (``networks.lora_sd3`` / ``networks.lora_flux``), which
ComfyUI loads too.

SD3.5: kohya's ``LORA_PREFIX_SD3 = "lora_unet"`` plus the module path of Stability's MMDiT
(``joint_blocks.{i}.{x_block|context_block}.{attn.qkv|attn.proj|mlp.fc1|mlp.fc2|adaLN_modulation.1}``, MMDiT-X
``x_block.attn2.qkv/proj``), dots as underscores (kohya-ss/sd-scripts networks/lora_sd3.py; the diffusers <->
MMDiT table is diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers``).

kohya names a FLUX LoRA after Black Forest Labs' module paths with ``lora_unet_`` in front and dots as
underscores: ``lora_unet_double_blocks_{i}_{img|txt}_{attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin}`` and
``lora_unet_single_blocks_{i}_{linear1|linear2|modulation_lin}``, each with ``.lora_down.weight``,
``.lora_up.weight`` and a scalar ``.alpha`` (scale alpha / rows of lora_down). ComfyUI ``comfy/lora.py``
``model_lora_keys_unet`` maps ``lora_unet_`` + every ``diffusion_model`` weight path of the BFL model with dots
as underscores, so the same names load there. (Sources: kohya-ss/sd-scripts networks/lora_flux.py and
networks/convert_flux_lora.py's key table; comfyanonymous/ComfyUI comfy/lora.py.)

Both originals fuse what diffusers keeps apart: SD3 each block's x / context / attn2 ``qkv``; BFL a double
block's q, k, v in one ``qkv`` linear (image: ``attn.to_q/k/v``; text: ``attn.add_q/k/v_proj``) and a single
block's q, k, v and MLP input in ``linear1``. A fused LoRA is exact:
``lora_down`` stacks the parts' down matrices (rank parts x r) and ``lora_up`` is block-diagonal (each part's
up matrix in its own rows and rank columns; rows of parts without an adapter stay zero), and alpha is
multiplied by the number of stacked parts so alpha / rank is unchanged.

One SD3 module differs in row order too: the last joint block's ``context_block.adaLN_modulation.1`` is (shift,
scale) in the MMDiT and (scale, shift) in diffusers, so its ``lora_up`` has the two halves of its rows swapped
(``_LAST_CONTEXT_MODULATION``). FLUX has no such module among the targets it names: its per-block modulations
keep one order in both layouts and ``norm_out`` (the swapped one) is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .export import ExportError, _kohya_hashes, _save_safetensors

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
# SD3 MMDiT joint block: diffusers -> Stability's module paths.
_JOINT_SINGLE = {
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "attn2.to_out.0": "x_block.attn2.proj",
}
# SD3's last joint block (context "pre only") modulates the context with (shift, scale) in the MMDiT and
# (scale, shift) in diffusers: diffusers' convert_sd3_transformer_checkpoint_to_diffusers swaps the two halves of
# joint_blocks.{last}.context_block.adaLN_modulation.1 (loaders/single_file_utils.py swap_scale_shift), ComfyUI's
# mmdit_to_diffusers maps that one module with swap_scale_shift (comfy/utils.py), flow_single_file swaps it back.
# Its LoRA delta B @ A swaps with B's rows.
_LAST_CONTEXT_MODULATION = "norm1_context.linear"
_JOINT_FUSED = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}


def _blocks(arch: str, config: dict[str, Any]) -> list[tuple[str, str, int, dict, dict]]:
    """(diffusers block list, original block list, count, one-to-one table, fused table) per block kind."""
    if arch == "flux":
        return [
            ("transformer_blocks", "double_blocks", config["num_layers"], _DOUBLE_SINGLE, _DOUBLE_FUSED),
            (
                "single_transformer_blocks",
                "single_blocks",
                config["num_single_layers"],
                _SINGLE_SINGLE,
                _SINGLE_FUSED,
            ),
        ]
    return [("transformer_blocks", "joint_blocks", config["num_layers"], _JOINT_SINGLE, _JOINT_FUSED)]


def original_module_names(arch: str, config: dict[str, Any]) -> set[str]:
    """Every linear module path of the original (BFL FLUX / Stability MMDiT) model a LoRA can target, for a
    diffusers transformer config: what ComfyUI's ``lora_unet_`` keys map to."""
    names = set()
    for _, original, count, one, fused in _blocks(arch, config):
        for i in range(count):
            for m in [*one.values(), *fused]:
                if arch == "mmdit":
                    if "attn2" in m and i not in (config.get("dual_attention_layers") or ()):
                        continue
                    last = i == count - 1  # SD3's last block: context_pre_only (no context attn proj or mlp)
                    if last and m.startswith("context_block") and m not in _CONTEXT_PRE_ONLY:
                        continue
                names.add(f"{original}.{i}.{m}")
    return names


_CONTEXT_PRE_ONLY = ("context_block.attn.qkv", "context_block.adaLN_modulation.1")


def kohya_name(module: str) -> str:
    return "lora_unet_" + module.replace(".", "_")


def _part_rows(transformer_config: dict[str, Any], module: str) -> int:
    """Output rows of one diffusers part of a fused linear (q, k, v: the attention width)."""
    inner = transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
    return 4 * inner if module == "proj_mlp" else inner  # FluxSingleTransformerBlock mlp_ratio 4


def kohya_state_dict(
    arch: str, peft_state_dict: dict[str, Any], transformer_config: dict[str, Any], alpha: float
) -> dict[str, Any]:
    """kohya tensors for a peft state dict of a Flux / SD3 transformer (``...lora_A.weight``/``lora_B``
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

    def single(diffusers_path: str, bfl: str, swap_halves: bool = False) -> None:
        if diffusers_path in lora:
            ab = lora[diffusers_path]
            up = ab["B"]
            if swap_halves:  # output rows (scale, shift) -> (shift, scale); lora_down is the same
                scale, shift = up.chunk(2, dim=0)
                up = torch.cat([shift, scale], dim=0)
            out[kohya_name(bfl) + ".lora_down.weight"] = ab["A"]
            out[kohya_name(bfl) + ".lora_up.weight"] = up
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

    for block, original, count, one, fused_table in _blocks(arch, transformer_config):
        for i in range(count):
            prefix = f"{block}.{i}"
            for d, b in one.items():
                swap = arch == "mmdit" and i == count - 1 and d == _LAST_CONTEXT_MODULATION
                single(f"{prefix}.{d}", f"{original}.{i}.{b}", swap_halves=swap)
            for b, parts in fused_table.items():
                fused(prefix, parts, f"{original}.{i}.{b}")
    unmapped = sorted(set(lora) - used)
    if unmapped:
        raise ExportError(
            f"LoRA on {unmapped[0]} (and {len(unmapped) - 1} more) has no kohya "
            f"{'FLUX.1' if arch == 'flux' else 'SD3'} name",
            fix="train the family's default targets, or set output.save_kohya: false",
        )
    return out


def save_kohya(
    path: Path,
    arch: str,
    peft_state_dict: dict[str, Any],
    *,
    transformer_config: dict[str, Any],
    alpha: float,
    metadata: dict[str, str],
) -> Path:
    tensors = kohya_state_dict(arch, peft_state_dict, transformer_config, alpha)
    # sshs_model_hash / sshs_legacy_hash, as kohya's networks/lora_flux.py and lora_sd3.py write them too
    return _save_safetensors(tensors, path, {**metadata, **_kohya_hashes(tensors, metadata)})
