"""SD3.5 / FLUX.1 transformers as one file in the original layout, and single-file bases read back.

Out: :func:`transformer_to_original` is the inverse of diffusers' ``convert_sd3_transformer_checkpoint_to_diffusers``
and ``convert_flux_transformer_checkpoint_to_diffusers`` (``loaders/single_file_utils.py``, diffusers 0.42): the
diffusers transformer's weights under the names of Stability's MMDiT (``joint_blocks.N.x_block.attn.qkv``, ...)
and Black Forest Labs' Flux (``double_blocks.N.img_attn.qkv``, ``single_blocks.N.linear1``, ...): q/k/v fused
again, FLUX's single-block q/k/v/mlp projections fused into ``linear1``, and the shift/scale halves of the
final adaptive norms (and SD3's last context block) put back in the original order. ``export.save_full``
writes it: for FLUX.1 the transformer only, under BFL's bare names, as ``flux1-dev.safetensors`` is released
(BFL's ``load_flow_model``, ``FluxTransformer2DModel.from_single_file``, ComfyUI's diffusion-model loader and
kohya read it; the text encoders and VAE stay in the diffusers folder beside it); for SD3.5 the whole pipeline
under ``model.diffusion_model.`` and the other prefixes of Stability's files (:func:`sd3_pipeline_to_original`,
``StableDiffusion3Pipeline.from_single_file`` and ComfyUI's checkpoint loader read it).

In: :func:`load_flow_single_file` builds the components of a flow family around a transformer read from one
file (``model.path=*.safetensors``) with the other components and every config from ``model.config_dir`` (a
diffusers folder of the same family; nothing is downloaded; its own transformer weights are not read). An
all-in-one file (its own CLIP-L, CLIP-G, T5 and VAE beside the transformer) gives those too, read as diffusers'
pipeline ``from_single_file`` reads them (CLIP-L's projection is then the identity); the folder gives the parts
the file lacks or holds quantized, and every config and tokenizer.
Note: diffusers 0.42's FLUX converter assumes the released width (3072, MLP ratio 4), so a FLUX single file
loads only at that width (every FLUX.1 checkpoint); SD3/SD3.5 files of any width load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdplan import registry
from sdplan.errors import SdplanError, UsageError


def _swap_halves(t):
    """[a; b] -> [b; a] along dim 0 (diffusers' scale/shift order <-> the original shift/scale)."""
    import torch

    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _fuse(sd: dict, names: list[str], suffix: str):
    import torch

    return torch.cat([sd.pop(f"{n}.{suffix}") for n in names], dim=0)


def sd3_to_original(state_dict: dict, config: Any) -> dict:
    """An SD3Transformer2DModel state dict in Stability's MMDiT names (keys without a prefix)."""
    sd = dict(state_dict)
    num_layers = int(_get(config, "num_layers"))
    out = {
        "pos_embed": sd.pop("pos_embed.pos_embed"),
        "x_embedder.proj.weight": sd.pop("pos_embed.proj.weight"),
        "x_embedder.proj.bias": sd.pop("pos_embed.proj.bias"),
    }
    renames = {
        "t_embedder.mlp.0": "time_text_embed.timestep_embedder.linear_1",
        "t_embedder.mlp.2": "time_text_embed.timestep_embedder.linear_2",
        "y_embedder.mlp.0": "time_text_embed.text_embedder.linear_1",
        "y_embedder.mlp.2": "time_text_embed.text_embedder.linear_2",
        "context_embedder": "context_embedder",
        "final_layer.linear": "proj_out",
    }
    for new, old in renames.items():
        for p in ("weight", "bias"):
            out[f"{new}.{p}"] = sd.pop(f"{old}.{p}")
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = _swap_halves(sd.pop(f"norm_out.linear.{p}"))
    for i in range(num_layers):
        d, o = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        last = i == num_layers - 1
        for p in ("weight", "bias"):
            out[f"{o}x_block.attn.qkv.{p}"] = _fuse(
                sd, [f"{d}attn.to_q", f"{d}attn.to_k", f"{d}attn.to_v"], p
            )
            out[f"{o}context_block.attn.qkv.{p}"] = _fuse(
                sd, [f"{d}attn.add_q_proj", f"{d}attn.add_k_proj", f"{d}attn.add_v_proj"], p
            )
            out[f"{o}x_block.attn.proj.{p}"] = sd.pop(f"{d}attn.to_out.0.{p}")
            out[f"{o}x_block.adaLN_modulation.1.{p}"] = sd.pop(f"{d}norm1.linear.{p}")
            ctx_mod = sd.pop(f"{d}norm1_context.linear.{p}")
            out[f"{o}context_block.adaLN_modulation.1.{p}"] = _swap_halves(ctx_mod) if last else ctx_mod
            out[f"{o}x_block.mlp.fc1.{p}"] = sd.pop(f"{d}ff.net.0.proj.{p}")
            out[f"{o}x_block.mlp.fc2.{p}"] = sd.pop(f"{d}ff.net.2.{p}")
            if not last:  # the last block's context stream ends after its modulation ("pre only")
                out[f"{o}context_block.attn.proj.{p}"] = sd.pop(f"{d}attn.to_add_out.{p}")
                out[f"{o}context_block.mlp.fc1.{p}"] = sd.pop(f"{d}ff_context.net.0.proj.{p}")
                out[f"{o}context_block.mlp.fc2.{p}"] = sd.pop(f"{d}ff_context.net.2.{p}")
            if f"{d}attn2.to_q.{p}" in sd:  # MMDiT-X (SD3.5 Medium): the second image self-attention
                out[f"{o}x_block.attn2.qkv.{p}"] = _fuse(
                    sd, [f"{d}attn2.to_q", f"{d}attn2.to_k", f"{d}attn2.to_v"], p
                )
                out[f"{o}x_block.attn2.proj.{p}"] = sd.pop(f"{d}attn2.to_out.0.{p}")
        for mine, theirs in (("norm_q", "x_block.attn.ln_q"), ("norm_k", "x_block.attn.ln_k")):
            if f"{d}attn.{mine}.weight" in sd:  # qk RMS-norm (SD3.5)
                out[f"{o}{theirs}.weight"] = sd.pop(f"{d}attn.{mine}.weight")
        for mine, theirs in (
            ("attn.norm_added_q", "context_block.attn.ln_q"),
            ("attn.norm_added_k", "context_block.attn.ln_k"),
            ("attn2.norm_q", "x_block.attn2.ln_q"),
            ("attn2.norm_k", "x_block.attn2.ln_k"),
        ):
            if f"{d}{mine}.weight" in sd:
                out[f"{o}{theirs}.weight"] = sd.pop(f"{d}{mine}.weight")
    _check_consumed(sd, "SD3")
    return out


def flux_to_original(state_dict: dict, config: Any) -> dict:
    """A FluxTransformer2DModel state dict in Black Forest Labs' Flux names (keys without a prefix)."""
    sd = dict(state_dict)
    out: dict = {}
    renames = {
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
        "txt_in": "context_embedder",
        "img_in": "x_embedder",
        "final_layer.linear": "proj_out",
    }
    if _get(config, "guidance_embeds"):
        renames["guidance_in.in_layer"] = "time_text_embed.guidance_embedder.linear_1"
        renames["guidance_in.out_layer"] = "time_text_embed.guidance_embedder.linear_2"
    for new, old in renames.items():
        for p in ("weight", "bias"):
            out[f"{new}.{p}"] = sd.pop(f"{old}.{p}")
    for p in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{p}"] = _swap_halves(sd.pop(f"norm_out.linear.{p}"))
    for i in range(int(_get(config, "num_layers"))):
        d, o = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{o}img_mod.lin.{p}"] = sd.pop(f"{d}norm1.linear.{p}")
            out[f"{o}txt_mod.lin.{p}"] = sd.pop(f"{d}norm1_context.linear.{p}")
            out[f"{o}img_attn.qkv.{p}"] = _fuse(sd, [f"{d}attn.to_q", f"{d}attn.to_k", f"{d}attn.to_v"], p)
            out[f"{o}txt_attn.qkv.{p}"] = _fuse(
                sd, [f"{d}attn.add_q_proj", f"{d}attn.add_k_proj", f"{d}attn.add_v_proj"], p
            )
            out[f"{o}img_mlp.0.{p}"] = sd.pop(f"{d}ff.net.0.proj.{p}")
            out[f"{o}img_mlp.2.{p}"] = sd.pop(f"{d}ff.net.2.{p}")
            out[f"{o}txt_mlp.0.{p}"] = sd.pop(f"{d}ff_context.net.0.proj.{p}")
            out[f"{o}txt_mlp.2.{p}"] = sd.pop(f"{d}ff_context.net.2.{p}")
            out[f"{o}img_attn.proj.{p}"] = sd.pop(f"{d}attn.to_out.0.{p}")
            out[f"{o}txt_attn.proj.{p}"] = sd.pop(f"{d}attn.to_add_out.{p}")
        out[f"{o}img_attn.norm.query_norm.scale"] = sd.pop(f"{d}attn.norm_q.weight")
        out[f"{o}img_attn.norm.key_norm.scale"] = sd.pop(f"{d}attn.norm_k.weight")
        out[f"{o}txt_attn.norm.query_norm.scale"] = sd.pop(f"{d}attn.norm_added_q.weight")
        out[f"{o}txt_attn.norm.key_norm.scale"] = sd.pop(f"{d}attn.norm_added_k.weight")
    for i in range(int(_get(config, "num_single_layers"))):
        d, o = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for p in ("weight", "bias"):
            out[f"{o}modulation.lin.{p}"] = sd.pop(f"{d}norm.linear.{p}")
            out[f"{o}linear1.{p}"] = _fuse(
                sd, [f"{d}attn.to_q", f"{d}attn.to_k", f"{d}attn.to_v", f"{d}proj_mlp"], p
            )
            out[f"{o}linear2.{p}"] = sd.pop(f"{d}proj_out.{p}")
        out[f"{o}norm.query_norm.scale"] = sd.pop(f"{d}attn.norm_q.weight")
        out[f"{o}norm.key_norm.scale"] = sd.pop(f"{d}attn.norm_k.weight")
    _check_consumed(sd, "FLUX")
    return out


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _check_consumed(sd: dict, what: str) -> None:
    if sd:
        from .export import ExportError

        left = ", ".join(sorted(sd)[:4])
        raise ExportError(
            f"{what} transformer weights with no original-layout name: {left} ({len(sd)} in all)"
        )


def transformer_to_original(transformer, family: str) -> dict:
    """The diffusers transformer of ``family`` in the original layout (see the module doc)."""
    sd = transformer.state_dict()
    if registry.family(family).arch == "flux":
        return flux_to_original(sd, transformer.config)
    return sd3_to_original(sd, transformer.config)


# -- a single-file transformer as the base model ----------------------------------------------------------


FLUX_WIDTH = 3072  # diffusers 0.42 convert_flux_transformer_checkpoint_to_diffusers: inner_dim = 3072


def is_flow_transformer_file(path: str | Path) -> bool:
    """Whether a .safetensors holds an MMDiT or Flux transformer (its header's key names; diffusers' own
    markers: ``joint_blocks.`` / ``double_blocks.``, with or without ``model.diffusion_model.``)."""
    from .models import is_safetensors_name

    if not is_safetensors_name(path):
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception:  # not a safetensors file: the UNet loader says what is wrong
        return False
    strip = "model.diffusion_model."
    keys = [k[len(strip) :] if k.startswith(strip) else k for k in keys]
    return any(k.startswith(("joint_blocks.", "double_blocks.")) for k in keys)


def load_flow_single_file(
    location: str, family: str | None, config_dir: str | None, dtypes=None, scratch: str | Path | None = None
):
    """FlowComponents with the transformer read from ``location`` (diffusers ``from_single_file`` with the
    transformer config of ``config_dir``), its own VAE and text encoders where it holds them
    (:func:`_load_file_parts`), and the rest, the tokenizers and the scheduler of ``config_dir``."""
    import json

    from .flow_models import PIPELINES, load_flow_components
    from .models import ModelLoadError, diffusers_readable, load_dtype_kw

    if not config_dir:
        from .source_check import _needs_config_dir

        raise _needs_config_dir(location, family)
    root = Path(config_dir)
    try:
        index = json.loads((root / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"model.config_dir {config_dir}: no readable model_index.json ({e})") from e
    if index.get("_class_name") not in PIPELINES:
        raise UsageError(
            f"model.config_dir {config_dir}: a {index.get('_class_name')} folder, not SD3.5 or FLUX.1",
            fix="point it at a StableDiffusion3Pipeline or FluxPipeline folder",
        )
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    flux = PIPELINES[index["_class_name"]] == "flux"
    cls = FluxTransformer2DModel if flux else SD3Transformer2DModel
    if flux:
        cfg = cls.load_config(str(root), subfolder="transformer")
        width = int(cfg.get("num_attention_heads", 24)) * int(cfg.get("attention_head_dim", 128))
        if width != FLUX_WIDTH:
            raise UsageError(
                f"model.path {location}: diffusers reads FLUX single files only at the released width "
                f"({FLUX_WIDTH}); {config_dir} describes a {width}-wide transformer",
                fix="give the diffusers folder as model.path instead of a single file",
            )
    # the folder's transformer config only: its weights (if any) are never read; x.sft, x.SAFETENSORS: under a
    # name diffusers reads as safetensors (a link in ``scratch``, the run's folder, while it loads)
    try:
        with diffusers_readable(location, scratch) as readable:
            transformer = cls.from_single_file(
                readable,
                config=str(root),
                subfolder="transformer",
                local_files_only=True,
                **load_dtype_kw(dtypes, "unet"),
            )
    except SdplanError:
        raise
    except Exception as e:  # a file of another network or width
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(
            f"could not load {location} as the transformer of {config_dir}: {first}",
            fix="give a transformer checkpoint of the same model as model.config_dir",
        ) from e
    arch = PIPELINES[index["_class_name"]]
    parts = _load_file_parts(location, arch, root, dtypes)
    comps = load_flow_components(
        str(root), index, family, {}, {}, transformer=transformer, dtypes=dtypes, parts=parts
    )
    comps.source = location
    return comps


def _load_file_parts(location: str, arch: str, root: Path, dtypes) -> dict[str, Any]:
    """The text encoders and VAE an all-in-one file holds (:func:`.flow_models.file_parts`), read from it with
    ``root``'s configs, as diffusers' ``StableDiffusion3Pipeline`` / ``FluxPipeline.from_single_file`` reads them
    (``create_diffusers_clip_model_from_ldm``: CLIP-L's projection is the identity there, as ComfyUI uses its
    pooled output unprojected; ``create_diffusers_t5_model_from_checkpoint``; the VAE by
    ``AutoencoderKL.from_single_file``), by subfolder. The user gave this model: its own encoders and VAE train
    with it and are exported, not model.config_dir's."""
    from safetensors import safe_open

    from .flow_models import file_parts
    from .models import ModelLoadError, load_dtype_kw

    with safe_open(location, framework="pt") as f:
        keys = list(f.keys())
        found = {
            sub: (label, prefix)
            for sub, (label, prefix, quantized) in file_parts(keys, arch).items()
            if not quantized
        }
        tensors = {
            sub: {k: f.get_tensor(k) for k in keys if k.startswith(prefix)}
            for sub, (_, prefix) in found.items()
        }
    if not found:
        return {}
    import torch
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import (
        create_diffusers_clip_model_from_ldm,
        create_diffusers_t5_model_from_checkpoint,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    # as from_pretrained loads a folder's: the training dtype, else float32 (not the file's fp16 / fp8)
    te_dtype = (dtypes or {}).get("text_encoder") or torch.float32
    vae_kw = load_dtype_kw(dtypes, "vae") or {"torch_dtype": torch.float32}
    loaded: dict[str, Any] = {}
    for sub, (label, prefix) in found.items():
        checkpoint = tensors.pop(sub)
        tied = prefix + "encoder.embed_tokens.weight"
        if label == "T5" and tied not in checkpoint and prefix + "shared.weight" in checkpoint:
            # T5 ties its encoder's token embedding to shared.weight, and ComfyUI's T5 (comfy/text_encoders/
            # t5.py) has shared alone, so its checkpoint saves hold no encoder.embed_tokens.weight; diffusers'
            # reader then leaves that embedding unset. A copy of shared, as sdplan's export writes both
            checkpoint[tied] = checkpoint[prefix + "shared.weight"].clone()
        try:
            if sub == "vae":
                model = AutoencoderKL.from_single_file(
                    checkpoint,
                    config=str(root),
                    subfolder="vae",
                    local_files_only=True,
                    **vae_kw,
                )
            elif label == "T5":
                model = create_diffusers_t5_model_from_checkpoint(
                    T5EncoderModel, checkpoint, subfolder=sub, config=str(root), torch_dtype=te_dtype,
                    local_files_only=True,
                )  # fmt: skip
            else:
                cls = CLIPTextModel if arch == "flux" else CLIPTextModelWithProjection
                model = create_diffusers_clip_model_from_ldm(
                    cls,
                    checkpoint,
                    subfolder=sub,
                    config=str(root),
                    torch_dtype=te_dtype,
                    local_files_only=True,
                )
        except Exception as e:  # another network's encoder, or a width model.config_dir does not describe
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ModelLoadError(
                f"model.path {location}: could not load its own {label} with model.config_dir's {sub} config: {first}",
                fix="point model.config_dir at the diffusers folder of the file's own model",
            ) from e
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:  # diffusers loads what the file names and leaves the rest unset
            raise ModelLoadError(
                f"model.path {location}: its {label} lacks {len(missing)} of the weights model.config_dir's "
                f"{sub} config has ({missing[0]})",
                fix="point model.config_dir at the diffusers folder of the file's own model",
            )
        loaded[sub] = model
    return loaded


# -- the whole SD3.5 pipeline in one file -----------------------------------------------------------------


def sd3_pipeline_to_original(pipeline) -> dict:
    """A StableDiffusion3Pipeline as one checkpoint in Stability's all-in-one layout (what
    ``StableDiffusion3Pipeline.from_single_file`` and ComfyUI's checkpoint loader read): the MMDiT under
    ``model.diffusion_model.``, the VAE in the ldm names under ``first_stage_model.``, and CLIP-L, CLIP-G and
    T5 in their transformers names under ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.`` (diffusers
    0.42 ``single_file_utils``: ``is_clip_sd3_model``, ``is_open_clip_sd3_model``, ``is_t5_in_single_file``;
    as Stability's ``sd3_medium_incl_clips_t5xxlfp16.safetensors``). diffusers' loader sets CLIP-L's
    ``text_projection`` to the identity when it reads such a file; the file carries the trained one."""
    from .checkpoint import unwrap
    from .export import _text_model_keys, vae_to_original

    transformer, vae = unwrap(pipeline.transformer), unwrap(pipeline.vae)
    out = {
        f"model.diffusion_model.{k}": v
        for k, v in transformer_to_original(transformer, "sd35-medium").items()
    }
    out.update(
        {f"first_stage_model.{k}": v for k, v in vae_to_original(vae.state_dict(), vae.config).items()}
    )
    for name, attr in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")):
        te = {
            k: v
            for k, v in unwrap(getattr(pipeline, attr)).state_dict().items()
            if not k.endswith("position_ids")
        }
        out.update({f"text_encoders.{name}.transformer.{k}": v for k, v in _text_model_keys(te).items()})
    t5 = dict(unwrap(pipeline.text_encoder_3).state_dict())
    if "encoder.embed_tokens.weight" in t5:  # tied to shared.weight: its own copy on disk, since diffusers
        t5["encoder.embed_tokens.weight"] = t5["encoder.embed_tokens.weight"].clone()  # loads it untied
    out.update({f"text_encoders.t5xxl.transformer.{k}": v for k, v in t5.items()})
    return out
