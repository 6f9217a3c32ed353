"""Trained outputs in the formats people load, each recording the run's config and plan in its metadata.

- LoRA: ``pytorch_lora_weights.safetensors`` (diffusers/peft; ``pipe.load_lora_weights(out_dir)``) and
  ``{name}.kohya.safetensors`` (kohya names, ``.lora_down``/``.lora_up``/``.alpha`` with the real alpha, ``ss_*``
  metadata) for AUTOMATIC1111, ComfyUI and kohya sd-scripts.
- DreamBooth / full fine-tune: a diffusers folder (``save_pretrained``) and one ``{name}.safetensors`` in the
  original (ldm/sgm) single-file checkpoint layout.
- Textual inversion: ``learned_embeds.safetensors`` (``pipe.load_textual_inversion``; SDXL: ``clip_l``/``clip_g``).

Reading single-file checkpoints (the other direction) is ``single_file.py``.

The heavy lifting is diffusers/peft: ``get_peft_model_state_dict``, ``convert_state_dict_to_diffusers``,
``convert_state_dict_to_kohya``, ``save_lora_weights``, ``from_single_file``. Two things diffusers has no
function for are ours and table-driven below: diffusers -> original module paths for the UNet/VAE (the single
file, and SDXL kohya names) and HF CLIP -> OpenCLIP for SD 2.x / SDXL's second text encoder.

Kohya UNet names (why SD 1.x/2.x and SDXL differ): kohya sd-scripts names a LoRA after the module path of the
UNet it trains. Its SD 1.x/2.x UNet has the diffusers layout (``lora_unet_down_blocks_0_attentions_0_...``); its
SDXL UNet has the original sgm layout (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``; sd-scripts
``networks/lora.py`` even detects SDXL by ``input_blocks`` in the names). We write the same. Both UIs load both:
ComfyUI ``comfy/lora.py`` ``model_lora_keys_unet`` maps ``lora_unet_`` + the ``diffusion_model`` path and the
diffusers path (via ``unet_to_diffusers``); A1111 ``extensions-builtin/Lora/networks.py`` converts diffusers names
with ``convert_diffusers_name_to_compvis`` (hard-coded to the SD 1.x block arithmetic, e.g. its up-sampler rule)
and, failing that, replaces ``lora_unet`` by ``diffusion_model``, which is exact for sgm names. So sgm names for
SDXL are the ones that need no guessing in either UI. Text encoders: ``lora_te_`` for SD 1.x/2.x, ``lora_te1_``/
``lora_te2_`` for SDXL, HF CLIP module paths (``lora_te1_text_model_encoder_layers_0_self_attn_q_proj``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from sdplan.errors import SdplanError, UsageError

FAMILIES = ("sd15", "sd21", "sdxl")
DIFFUSERS_LORA_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
EMBEDDING_NAME = "learned_embeds.safetensors"  # diffusers' TEXT_INVERSION_NAME_SAFE
METADATA_JSON = "sdplan.json"  # beside a diffusers folder's model_index.json

# kohya sd-scripts ss_base_model_version (library/model_util.py, library/sdxl_model_util.py)
BASE_MODEL_VERSION = {"sd15": "sd_v1", "sd21": "sd_v2", "sdxl": "sdxl_base_v1-0"}


class ExportError(SdplanError):
    """A model that cannot be written in the asked format."""


# -- metadata -------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value


def output_metadata(metadata: dict[str, Any] | None, family: str) -> dict[str, str]:
    """The string metadata every output carries: ``sdplan_config`` and ``sdplan_plan`` (JSON), the family,
    the sdplan version, and every other key of ``metadata`` (non-strings as JSON; names without a
    ``sdplan_``/``ss_``/``modelspec.`` prefix get ``sdplan_``).

    ``metadata`` keys with a meaning: ``config`` (a TrainConfig or its dict), ``plan`` (defaults to the
    config's ``plan``), ``comment`` (kohya ``ss_training_comment``), ``prediction_type`` (the scheduler's;
    SD 2.x v-prediction is ``sd_v2_v`` for kohya), ``steps``, ``epoch`` (kohya ``ss_steps``/``ss_epoch``).
    """
    from sdplan import __version__

    md = dict(metadata or {})
    config = _plain(md.pop("config", None))
    plan = md.pop("plan", None)
    if plan is None and isinstance(config, dict):
        plan = config.get("plan")
    out = {
        "sdplan_version": __version__,
        "sdplan_family": family,
        "sdplan_config": json.dumps(config, sort_keys=True, default=str),
        "sdplan_plan": json.dumps(_plain(plan), sort_keys=True, default=str),
    }
    for key, value in md.items():
        name = key if key.startswith(("sdplan_", "ss_", "modelspec.")) else f"sdplan_{key}"
        out[name] = (
            value if isinstance(value, str) else json.dumps(_plain(value), sort_keys=True, default=str)
        )
    return out


def _kohya_metadata(
    metadata: dict[str, Any] | None, family: str, rank: int, alpha: float, name: str
) -> dict[str, str]:
    """kohya sd-scripts ``ss_*`` keys (train_network.py writes every value with str()), from the config."""
    md = dict(metadata or {})
    config = _plain(md.get("config")) or {}
    get = lambda section, key, default=None: (config.get(section) or {}).get(key, default)  # noqa: E731
    version = BASE_MODEL_VERSION[family]
    if family == "sd21" and md.get("prediction_type") == "v_prediction":
        version = "sd_v2_v"
    resolution = md.get("resolution") or get("data", "resolution")
    method = config.get("method", "lora")
    ss: dict[str, Any] = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": rank,
        "ss_network_alpha": float(alpha),
        "ss_base_model_version": version,
        "ss_v2": family == "sd21",
        "ss_resolution": (resolution, resolution) if isinstance(resolution, int) else resolution,
        "ss_training_comment": md.get("comment") or f"trained with sdplan ({method})",
        "ss_output_name": name,
    }
    if config:
        training, memory = config.get("training") or {}, config.get("memory") or {}
        ss.update(
            {
                "ss_sd_model_name": Path(str(get("model", "path", ""))).name,
                "ss_learning_rate": training.get("learning_rate"),
                "ss_unet_lr": training.get("learning_rate"),
                "ss_text_encoder_lr": training.get("text_encoder_learning_rate")
                or training.get("learning_rate"),
                "ss_lr_scheduler": training.get("lr_scheduler"),
                "ss_lr_warmup_steps": training.get("lr_warmup_steps"),
                "ss_max_train_steps": training.get("max_steps"),
                "ss_num_epochs": training.get("epochs"),
                "ss_gradient_accumulation_steps": training.get("grad_accum"),
                "ss_mixed_precision": {"fp32": "no"}.get(
                    training.get("precision"), training.get("precision")
                ),
                "ss_seed": training.get("seed"),
                "ss_max_grad_norm": training.get("max_grad_norm"),
                "ss_noise_offset": training.get("noise_offset"),
                "ss_network_dropout": get("lora", "dropout"),
                "ss_optimizer": memory.get("optimizer"),
                "ss_gradient_checkpointing": memory.get("gradient_checkpointing"),
                "ss_cache_latents": memory.get("cache_latents"),
            }
        )
    if md.get("steps") is not None:
        ss["ss_steps"] = md["steps"]
    if md.get("epoch") is not None:  # kohya counts whole epochs; a partial one stays a fraction
        epoch = float(md["epoch"])
        ss["ss_epoch"] = int(epoch) if epoch.is_integer() else round(epoch, 3)
    return {k: str(v) for k, v in ss.items() if v is not None and v != ""}


def _modelspec(family: str, metadata: dict[str, Any] | None, name: str, *, lora: bool) -> dict[str, str]:
    """Stability's model spec 1.0 keys (kohya sd-scripts library/sai_model_spec.py writes them too)."""
    if family == "sd21":
        v = (metadata or {}).get("prediction_type") == "v_prediction"
        arch = "stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512"
    else:
        arch = {"sd15": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base"}[family]
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": arch + ("/lora" if lora else ""),
        "modelspec.title": name,
    }


# -- small file helpers ---------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def _umask_permissions(*paths: Path) -> None:
    """safetensors (0.8) creates its files 0600; outputs are meant to be read by a UI that may run as another
    user, so give files the mode a plain ``open()`` would (0666 minus the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            os.chmod(file, 0o666 & ~mask)


def _save_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> Path:
    """safetensors written atomically (temp file then rename): a kill mid-write leaves the old file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        _umask_permissions(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put folder ``tmp`` at ``final``, replacing what was there with a rename, not a copy."""
    old = None
    if final.exists():
        old = _tmp_name(final)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r}", fix=f"use one of {', '.join(FAMILIES)}")


def _unwrap(model):
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


# -- LoRA -----------------------------------------------------------------------------------------------


def _peft_lora(model, adapter: str = "default") -> tuple[dict, Any] | None:
    """(peft state dict, LoraConfig) of a model carrying a peft LoRA adapter; None when it carries none."""
    from peft import get_peft_model_state_dict

    if model is None:
        return None
    model = _unwrap(model)
    configs = getattr(model, "peft_config", None) or {}
    if adapter not in configs:
        return None
    return get_peft_model_state_dict(model, adapter_name=adapter), configs[adapter]


def _text_model_keys(state_dict: dict) -> dict:
    """transformers >= 5.6 flattened CLIPTextModel (no ``text_model.``): put the prefix back so the files carry
    the canonical HF CLIP paths every loader knows (diffusers strips it again for a flattened encoder)."""
    return {
        (k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}"): v
        for k, v in state_dict.items()
    }


def save_lora(
    out_dir: str | Path,
    *,
    unet,
    text_encoders: list,
    family: str,
    rank: int,
    alpha: float,
    metadata: dict[str, Any] | None,
    name: str = "sdplan",
    kohya: bool = True,
) -> list[Path]:
    """Write the LoRA that ``unet`` (and any of ``text_encoders``) carry as peft adapters.

    ``text_encoders``: ``[text_encoder]`` (SD 1.x/2.x) or ``[text_encoder, text_encoder_2]`` (SDXL); entries
    that are None or carry no adapter are skipped. ``rank``/``alpha`` must be those of the adapters (checked).
    Returns ``[out_dir/pytorch_lora_weights.safetensors, out_dir/{name}.kohya.safetensors]`` (the second only
    when ``kohya``).
    """
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
    from safetensors import safe_open
    from safetensors.torch import load_file

    _check_family(family)
    out_dir = Path(out_dir)
    te_names = ["text_encoder", "text_encoder_2"] if family == "sdxl" else ["text_encoder"]
    if len(text_encoders) > len(te_names):
        raise ExportError(f"{family} has {len(te_names)} text encoder(s), got {len(text_encoders)}")

    parts: dict[str, tuple[dict, Any]] = {}
    found = _peft_lora(unet)
    if found is not None:
        parts["unet"] = found
    for te_name, te in zip(te_names, text_encoders):
        found = _peft_lora(te)
        if found is not None:
            parts[te_name] = (_text_model_keys(found[0]), found[1])
    if not parts:
        raise ExportError(
            "no LoRA adapter found on the UNet or the text encoders", fix="add one with add_adapter"
        )
    for part, (_, config) in parts.items():
        if config.r != rank or float(config.lora_alpha) != float(alpha):
            raise ExportError(
                f"the {part} adapter has rank {config.r}, alpha {config.lora_alpha}; asked to save rank {rank}, "
                f"alpha {alpha}"
            )
        if config.rank_pattern or config.alpha_pattern or config.use_dora:
            raise ExportError(f"the {part} adapter uses rank/alpha patterns or DoRA; kohya LoRA has neither")

    # 1. diffusers format, written by diffusers (with the LoraConfig as lora_adapter_metadata).
    pipeline_cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    kwargs = {}
    for part, (state_dict, config) in parts.items():
        kwargs[f"{part}_lora_layers"] = convert_state_dict_to_diffusers(state_dict)
        kwargs[f"{part}_lora_adapter_metadata"] = config.to_dict()
    md = output_metadata(metadata, family)
    md.update({"sdplan_lora_rank": str(rank), "sdplan_lora_alpha": str(float(alpha))})
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(out_dir / "lora")
    try:
        pipeline_cls.save_lora_weights(save_directory=str(tmp), safe_serialization=True, **kwargs)
        with safe_open(str(tmp / DIFFUSERS_LORA_NAME), framework="pt") as f:
            md = {**(f.metadata() or {}), **md}  # keep diffusers' format + lora_adapter_metadata
        written = [
            _save_safetensors(load_file(str(tmp / DIFFUSERS_LORA_NAME)), out_dir / DIFFUSERS_LORA_NAME, md)
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if not kohya:
        return written

    # 2. kohya format: diffusers' PEFT -> kohya conversion (names, lora_down/lora_up), then what it leaves out:
    # SDXL UNet in sgm module paths, `lora_te_` for a single text encoder, and the real alpha (it writes rank).
    peft_sd: dict[str, Any] = {}
    for part, (state_dict, _) in parts.items():
        for key, value in state_dict.items():
            if part == "unet" and family == "sdxl":
                key = unet_key_to_original(key, _unwrap(unet).config)
            peft_sd[f"{part}.{key}"] = value
    kohya_sd = convert_state_dict_to_kohya(peft_sd)
    out: dict[str, Any] = {}
    for key, value in kohya_sd.items():
        if family != "sdxl" and key.startswith("lora_te1_"):
            key = "lora_te_" + key[len("lora_te1_") :]
        if key.endswith(".alpha"):
            value = torch.tensor(float(alpha))
        out[key] = value
    kohya_md = {
        **_kohya_metadata(metadata, family, rank, alpha, name),
        **_modelspec(family, metadata, name, lora=True),
        **output_metadata(metadata, family),
    }
    written.append(_save_safetensors(out, out_dir / f"{name}.kohya.safetensors", kohya_md))
    return written


# -- diffusers -> original (ldm/sgm) layout ----------------------------------------------------------------

# Inner renames of a UNet ResnetBlock2D: diffusers -> ldm ResBlock.
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
# UNet modules outside the down/mid/up blocks.
_UNET_TOP = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "class_embedding.linear_1": "label_emb.0.0",
    "class_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_TOP = {
    "encoder.conv_norm_out": "encoder.norm_out",
    "decoder.conv_norm_out": "decoder.norm_out",
}


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _unet_table(config) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers module prefix -> (ldm module prefix, inner renames) for one UNet2DConditionModel config.

    ldm numbering: input block 0 is conv_in; each down block i contributes ``layers_per_block`` (ResBlock
    [+ SpatialTransformer]) entries and, except the last, a Downsample; each up block contributes
    ``layers_per_block + 1`` entries, the Upsample riding on its last one (slot 2 after an attention, else 1).
    """
    lpb = _get(config, "layers_per_block")
    if not isinstance(lpb, int):
        raise ExportError(f"layers_per_block={lpb!r}: only one int for all blocks has an original layout")
    mid = _get(config, "mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid != "UNetMidBlock2DCrossAttn":
        raise ExportError(f"mid block {mid}: no original single-file layout")
    down = list(_get(config, "down_block_types"))
    up = list(_get(config, "up_block_types"))
    table: dict[str, tuple[str, dict[str, str]]] = {k: (v, {}) for k, v in _UNET_TOP.items()}
    for i in range(len(down)):
        for j in range(lpb):
            n = 1 + i * (lpb + 1) + j
            table[f"down_blocks.{i}.resnets.{j}"] = (f"input_blocks.{n}.0", _UNET_RESNET)
            table[f"down_blocks.{i}.attentions.{j}"] = (f"input_blocks.{n}.1", {})
        if i < len(down) - 1:
            table[f"down_blocks.{i}.downsamplers.0.conv"] = (f"input_blocks.{(i + 1) * (lpb + 1)}.0.op", {})
    table["mid_block.resnets.0"] = ("middle_block.0", _UNET_RESNET)
    table["mid_block.attentions.0"] = ("middle_block.1", {})
    table["mid_block.resnets.1"] = ("middle_block.2", _UNET_RESNET)
    for i, block_type in enumerate(up):
        for j in range(lpb + 1):
            n = i * (lpb + 1) + j
            table[f"up_blocks.{i}.resnets.{j}"] = (f"output_blocks.{n}.0", _UNET_RESNET)
            table[f"up_blocks.{i}.attentions.{j}"] = (f"output_blocks.{n}.1", {})
        if i < len(up) - 1:
            slot = 2 if "CrossAttn" in block_type else 1
            table[f"up_blocks.{i}.upsamplers.0.conv"] = (
                f"output_blocks.{i * (lpb + 1) + lpb}.{slot}.conv",
                {},
            )
    return table


def _vae_table(config) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers AutoencoderKL module prefix -> (ldm prefix, inner renames). Decoder up blocks run in
    reverse order in ldm (``up.{n-1-i}``)."""
    n_down = len(_get(config, "down_block_types"))
    n_up = len(_get(config, "up_block_types"))
    lpb = _get(config, "layers_per_block")
    table: dict[str, tuple[str, dict[str, str]]] = {k: (v, {}) for k, v in _VAE_TOP.items()}
    for side in ("encoder", "decoder"):
        table[f"{side}.mid_block.resnets.0"] = (f"{side}.mid.block_1", _VAE_RESNET)
        table[f"{side}.mid_block.resnets.1"] = (f"{side}.mid.block_2", _VAE_RESNET)
        table[f"{side}.mid_block.attentions.0"] = (f"{side}.mid.attn_1", _VAE_ATTENTION)
    for i in range(n_down):
        for j in range(lpb):
            table[f"encoder.down_blocks.{i}.resnets.{j}"] = (f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        table[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = (f"encoder.down.{i}.downsample.conv", {})
    for i in range(n_up):
        for j in range(lpb + 1):
            table[f"decoder.up_blocks.{i}.resnets.{j}"] = (
                f"decoder.up.{n_up - 1 - i}.block.{j}",
                _VAE_RESNET,
            )
        table[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = (f"decoder.up.{n_up - 1 - i}.upsample.conv", {})
    return table


def _rename(key: str, table: dict[str, tuple[str, dict[str, str]]]) -> str | None:
    """Map one dotted key through a prefix table (longest module prefix wins, then the inner renames of that
    module); None when no prefix matches."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in table:
            target, inner = table[prefix]
            rest = ".".join(parts[cut:])
            for old, new in inner.items():
                if rest == old or rest.startswith(old + "."):
                    rest = new + rest[len(old) :]
                    break
            return f"{target}.{rest}"
    return None


def unet_key_to_original(key: str, config) -> str:
    """A diffusers UNet parameter / module key in the original ldm/sgm layout
    (``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight`` ->
    ``input_blocks.4.1.transformer_blocks.0.attn1.to_q.lora_A.weight`` for SDXL)."""
    new = _rename(key, _unet_table(config))
    if new is None:
        raise ExportError(f"UNet key {key!r} has no place in the original layout")
    return new


def unet_to_original(state_dict: dict, config) -> dict:
    """diffusers UNet2DConditionModel state dict -> ldm ``diffusion_model`` keys (without the prefix)."""
    table = _unet_table(config)
    out, unknown = {}, []
    for key, value in state_dict.items():
        new = _rename(key, table)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise ExportError(f"UNet keys with no place in the original layout: {', '.join(unknown[:5])}")
    return out


def vae_to_original(state_dict: dict, config) -> dict:
    """diffusers AutoencoderKL state dict -> ldm ``first_stage_model`` keys (without the prefix); the mid
    attention's linear q/k/v/proj_out become the 1x1 convolutions of the original."""
    table = _vae_table(config)
    same = {"encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out"}
    same |= {"quant_conv", "post_quant_conv"}
    out, unknown = {}, []
    for key, value in state_dict.items():
        module = key.rsplit(".", 1)[0]
        if module in same:
            out[key] = value
            continue
        new = _rename(key, table)
        if new is None:
            unknown.append(key)
            continue
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]
        out[new] = value
    if unknown:
        raise ExportError(f"VAE keys with no place in the original layout: {', '.join(unknown[:5])}")
    return out


# HF CLIP text transformer -> OpenCLIP (SD 2.x cond_stage_model.model, SDXL conditioner.embedders.1.model).
_OPENCLIP_TOP = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_OPENCLIP_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def clip_to_openclip(state_dict: dict) -> dict:
    """An HF CLIPTextModel(WithProjection) state dict in OpenCLIP names: q/k/v fused into ``attn.in_proj_*``,
    ``text_projection`` as the transposed matrix OpenCLIP multiplies by."""
    import torch

    sd = _text_model_keys({k: v for k, v in state_dict.items() if not k.endswith("position_ids")})
    out: dict[str, Any] = {}
    qkv: dict[tuple[int, str], dict[str, Any]] = {}
    unknown = []
    for key, value in sd.items():
        if key in _OPENCLIP_TOP:
            out[_OPENCLIP_TOP[key]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        elif m := _LAYER.match(key):
            layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((layer, kind), {})[module[-6]] = value
            elif module in _OPENCLIP_LAYER:
                out[f"transformer.resblocks.{layer}.{_OPENCLIP_LAYER[module]}.{kind}"] = value
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    for (layer, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ExportError(f"text encoder layer {layer} lacks one of q/k/v_proj.{kind}")
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
            [parts["q"], parts["k"], parts["v"]]
        )
    if unknown:
        raise ExportError(f"text encoder keys with no OpenCLIP name: {', '.join(unknown[:5])}")
    return out


def pipeline_to_original(pipeline, family: str) -> dict:
    """The whole pipeline as one original-layout state dict (what A1111/ComfyUI/``from_single_file`` read):
    ``model.diffusion_model.*``, ``first_stage_model.*`` and ``cond_stage_model.transformer.*`` (SD 1.x),
    ``cond_stage_model.model.*`` (SD 2.x, OpenCLIP) or ``conditioner.embedders.{0,1}.*`` (SDXL)."""
    _check_family(family)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        model = getattr(pipeline, part, None)
        if model is not None and getattr(_unwrap(model), "peft_config", None):
            raise ExportError(
                f"the pipeline's {part} carries a LoRA adapter", fix="fuse it or save it with save_lora"
            )
    unet, vae = _unwrap(pipeline.unet), _unwrap(pipeline.vae)
    out = {
        f"model.diffusion_model.{k}": v for k, v in unet_to_original(unet.state_dict(), unet.config).items()
    }
    out.update(
        {f"first_stage_model.{k}": v for k, v in vae_to_original(vae.state_dict(), vae.config).items()}
    )
    te = _unwrap(pipeline.text_encoder).state_dict()
    te = {k: v for k, v in te.items() if not k.endswith("position_ids")}
    if family == "sd15":
        out.update({f"cond_stage_model.transformer.{k}": v for k, v in _text_model_keys(te).items()})
    elif family == "sd21":
        out.update({f"cond_stage_model.model.{k}": v for k, v in clip_to_openclip(te).items()})
    else:
        out.update({f"conditioner.embedders.0.transformer.{k}": v for k, v in _text_model_keys(te).items()})
        te2 = _unwrap(pipeline.text_encoder_2).state_dict()
        out.update({f"conditioner.embedders.1.model.{k}": v for k, v in clip_to_openclip(te2).items()})
    return out


def save_full(
    out_dir: str | Path,
    *,
    pipeline,
    family: str,
    metadata: dict[str, Any] | None,
    single_file: bool = True,
    name: str = "sdplan",
    dtype=None,
) -> list[Path]:
    """A diffusers folder ``out_dir/model`` (``save_pretrained``, plus ``sdplan.json`` with the config and
    plan) and, when ``single_file``, ``out_dir/{name}.safetensors`` in the original layout. ``dtype`` (e.g.
    torch.float16) casts the single file's floating tensors; None keeps the pipeline's."""
    _check_family(family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = output_metadata(metadata, family)
    tensors = pipeline_to_original(pipeline, family) if single_file else None  # checks before writing

    folder = out_dir / "model"
    tmp = _tmp_name(folder)
    try:
        pipeline.save_pretrained(str(tmp), safe_serialization=True)
        record = {k: (json.loads(v) if k in ("sdplan_config", "sdplan_plan") else v) for k, v in md.items()}
        (tmp / METADATA_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _umask_permissions(tmp)
        _replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    written = [folder]
    if tensors is not None:
        if dtype is not None:
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        md = {**md, **_modelspec(family, metadata, name, lora=False), "format": "pt"}
        written.append(_save_safetensors(tensors, out_dir / f"{name}.safetensors", md))
    return written


# -- textual inversion ----------------------------------------------------------------------------------


def save_embedding(
    out_dir: str | Path,
    *,
    token: str,
    embeds,
    metadata: dict[str, Any] | None,
    name: str = "sdplan",
    family: str | None = None,
) -> Path:
    """``out_dir/learned_embeds.safetensors``.

    SD 1.x/2.x: ``embeds`` is a ``[n, dim]`` tensor, saved as ``{token: embeds}`` (diffusers format: one key,
    the token; A1111 and ComfyUI read a one-tensor file too). SDXL: ``embeds`` is ``{"clip_l": [n, 768],
    "clip_g": [n, 1280]}`` (the A1111/ComfyUI SDXL layout), loaded per encoder (see ``load_embedding``).
    """
    import torch

    if isinstance(embeds, dict):
        if set(embeds) != {"clip_l", "clip_g"}:
            raise ExportError(f"SDXL embeddings need clip_l and clip_g, got {sorted(embeds)}")
        tensors = {k: v.detach().float().cpu().reshape(-1, v.shape[-1]) for k, v in embeds.items()}
        if tensors["clip_l"].shape[0] != tensors["clip_g"].shape[0]:
            raise ExportError("clip_l and clip_g hold different numbers of vectors")
        family = family or "sdxl"
    elif isinstance(embeds, torch.Tensor):
        tensors = {token: embeds.detach().float().cpu().reshape(-1, embeds.shape[-1])}
        family = family or "sd15"
    else:
        raise ExportError(f"embeds must be a tensor or a clip_l/clip_g dict, not {type(embeds).__name__}")
    md = output_metadata(metadata, family)
    md.update(
        {
            "sdplan_token": token,
            "sdplan_name": name,
            "sdplan_num_vectors": str(next(iter(tensors.values())).shape[0]),
        }
    )
    return _save_safetensors(tensors, Path(out_dir) / EMBEDDING_NAME, md)


def load_embedding(pipeline, path: str | Path, token: str) -> None:
    """Load a ``save_embedding`` file into a pipeline with ``pipe.load_textual_inversion`` (both encoders for
    SDXL)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / EMBEDDING_NAME
    state = load_file(str(path))
    if "clip_l" in state and "clip_g" in state:
        pipeline.load_textual_inversion(
            state["clip_l"], token=token, text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer
        )
        pipeline.load_textual_inversion(
            state["clip_g"], token=token, text_encoder=pipeline.text_encoder_2, tokenizer=pipeline.tokenizer_2
        )
    else:
        pipeline.load_textual_inversion(str(path), token=token)
