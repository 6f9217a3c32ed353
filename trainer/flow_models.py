"""Loading SD3.5 (StableDiffusion3Pipeline) and FLUX.1 (FluxPipeline) diffusers folders or hub ids.

The transformer takes the loop's denoiser slot (``Components.unet``: what the recipes adapt, checkpoint and
sample with); the text encoders and tokenizers are in the pipeline's order (SD3.5: CLIP-L, CLIP-G, T5; FLUX:
CLIP-L, T5), the T5 tokenizer cut at the family's ``t5_max_length``. ``Components.adapter`` carries the
family's objective and denoiser call (``flow.FlowAdapter``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdplan import registry

from .models import Components, ModelLoadError, load_dtype_kw

PIPELINES = {"StableDiffusion3Pipeline": "mmdit", "FluxPipeline": "flux"}


# The text encoders and VAE an all-in-one SD3 / SD3.5 / FLUX.1 file holds beside its transformer (ComfyUI's
# checkpoint save, Stability's sd3_medium_incl_clips*.safetensors), by the keys diffusers 0.42 finds them by
# (loaders/single_file_utils.py: CHECKPOINT_KEY_NAMES "clip_sd3" and "open_clip_sd3", is_t5_in_single_file,
# LDM_VAE_KEYS): label, key prefix, the key that marks it.
FILE_PARTS = {
    "clip_l": (
        "CLIP-L",
        "text_encoders.clip_l.transformer.",
        "text_model.embeddings.position_embedding.weight",
    ),
    "clip_g": (
        "CLIP-G",
        "text_encoders.clip_g.transformer.",
        "text_model.embeddings.position_embedding.weight",
    ),
    "t5": ("T5", "text_encoders.t5xxl.transformer.", "shared.weight"),
    "vae": ("VAE", "first_stage_model.", "decoder.conv_out.weight"),
    "vae_flux": ("VAE", "vae.", "decoder.conv_out.weight"),
}


_QUANT_ENDS = ("scaled_fp8", "scale_weight", "comfy_quant", "SCB")  # ComfyUI scaled fp8, bitsandbytes 8-bit


def file_parts(keys, arch: str) -> dict[str, tuple[str, str, bool]]:
    """The components besides the transformer a single SD3.5 (``arch`` "mmdit") or FLUX.1 ("flux") file holds,
    as subfolder -> (label, key prefix, quantized): ``text_encoder`` for CLIP-L, ``text_encoder_2`` for CLIP-G
    (SD3.5) or T5 (FLUX.1), ``text_encoder_3`` for SD3.5's T5, ``vae``. ``quantized``: its weights carry
    ComfyUI's scaled-fp8 or bitsandbytes' markers (Comfy-Org's ``*_fp8_scaled`` files' T5), which diffusers'
    reader does not apply: such a part is model.config_dir's."""
    have = set(keys)
    subs = {"clip_l": "text_encoder", "t5": "text_encoder_3" if arch == "mmdit" else "text_encoder_2"}
    if arch == "mmdit":
        subs["clip_g"] = "text_encoder_2"
    subs["vae"] = subs["vae_flux"] = "vae"
    found: dict[str, tuple[str, str, bool]] = {}
    for name, sub in subs.items():
        label, prefix, marker = FILE_PARTS[name]
        if sub not in found and prefix + marker in have:
            quantized = any(
                k.startswith(prefix) and (k.rsplit(".", 1)[-1] in _QUANT_ENDS or ".bitsandbytes__" in k)
                for k in have
            )
            found[sub] = (label, prefix, quantized)
    return dict(sorted(found.items()))


def file_parts_note(found: dict[str, tuple[str, str, bool]], arch: str) -> str:
    """The line saying which components a single SD3.5 / FLUX.1 file gives and which model.config_dir does."""
    order = ["text_encoder", "text_encoder_2"] + (["text_encoder_3"] if arch == "mmdit" else []) + ["vae"]
    labels = {"text_encoder": "CLIP-L", "vae": "VAE"} | (
        {"text_encoder_2": "CLIP-G", "text_encoder_3": "T5"} if arch == "mmdit" else {"text_encoder_2": "T5"}
    )
    mine = [labels[s] for s in order if s in found and not found[s][2]]
    quantized = [labels[s] for s in order if s in found and found[s][2]]
    theirs = [labels[s] for s in order if s not in found]
    if not mine and not quantized:
        return "model: the file holds the transformer only: its text encoders and VAE are model.config_dir's"
    carried = (
        "the exported model/ folder carries them; the exported single file is the transformer alone, as "
        "ComfyUI's Load Diffusion Model node and BFL's release hold it"
        if arch == "flux"
        else "the exported model carries them"
    )
    said = (
        f"model: the file's own {', '.join(mine)} (an all-in-one file: they load from it and {carried})"
        if mine
        else "model: the file's transformer"
    )
    if quantized:
        said += (
            f"; {', '.join(quantized)} from model.config_dir (the file's {'is' if len(quantized) == 1 else 'are'} "
            "quantized, which diffusers does not read)"
        )
    if theirs:
        said += f"; {', '.join(theirs)} from model.config_dir (the file holds none)"
    return said + "; configs and tokenizers from model.config_dir"


def detect_flow_family(index: dict[str, Any], transformer_config: dict[str, Any]) -> str | None:
    """The transformer family of a diffusers folder from its model_index.json and transformer config; None
    when it is not one. SD3.5 Medium is the MMDiT-X (dual attention layers); Large has qk-norm and none; SD3
    Medium (neither) plans as SD3.5 Medium, its size. FLUX.1 [dev] has a guidance embedder, [schnell] none."""
    arch = PIPELINES.get(index.get("_class_name", ""))
    if arch == "flux":
        return "flux-dev" if transformer_config.get("guidance_embeds") else "flux-schnell"
    if arch == "mmdit":
        if transformer_config.get("dual_attention_layers") or not transformer_config.get("qk_norm"):
            return "sd35-medium"
        return "sd35-large"
    return None


def flow_family_of_folder(root: str | Path) -> str | None:
    """detect_flow_family for a local diffusers folder (config files only, no weights); None otherwise."""
    root = Path(root)
    try:
        index = json.loads((root / "model_index.json").read_text())
        if index.get("_class_name") not in PIPELINES:
            return None
        config = json.loads((root / "transformer" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return detect_flow_family(index, config)


@dataclass
class FlowComponents(Components):
    """Components of a transformer family; ``unet`` holds the transformer."""

    @property
    def prediction_type(self) -> str:
        return "flow_matching"  # velocity (noise - x0) on the rectified-flow path

    def inference_scheduler(self):
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)

    def pipeline(self, *, unet=None, text_encoders=None):
        from diffusers import FluxPipeline, StableDiffusion3Pipeline

        transformer = unet if unet is not None else self.unet
        tes = text_encoders if text_encoders is not None else self.text_encoders
        if registry.family(self.family).arch == "flux":
            return FluxPipeline(
                scheduler=self.inference_scheduler(),
                vae=self.vae,
                text_encoder=tes[0],
                tokenizer=self.tokenizers[0],
                text_encoder_2=tes[1],
                tokenizer_2=self.tokenizers[1],
                transformer=transformer,
            )
        return StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=self.inference_scheduler(),
            vae=self.vae,
            text_encoder=tes[0],
            tokenizer=self.tokenizers[0],
            text_encoder_2=tes[1],
            tokenizer_2=self.tokenizers[1],
            text_encoder_3=tes[2],
            tokenizer_3=self.tokenizers[2],
        )


def _check(found: str, wanted: str | None, where: str) -> str:
    """The family to train as: the transformer config's (:func:`.source_check.check_family`: a
    ``model.family`` of another network, or of the other variant of this one, is refused)."""
    from .source_check import check_family

    return check_family(found, wanted, where) or found


def load_flow_components(
    location: str,
    index: dict[str, Any],
    family: str | None,
    kw: dict[str, Any],
    wkw: dict[str, Any] | Any,
    transformer: Any = None,
    dtypes: dict[str, Any] | None = None,
    parts: dict[str, Any] | None = None,
) -> FlowComponents:
    """The components of an SD3.5/FLUX folder or hub id (``index``: its model_index.json; ``kw``/``wkw``: the
    revision / revision+variant keywords of from_pretrained; ``wkw`` may be a function of the subfolder, as
    ``models._load_pretrained`` passes: the variant each component's weights come in). ``transformer``: one already loaded (a
    single-file base, ``flow_single_file``); the folder's own is then not read. ``dtypes``: the dtype each
    part loads in (``models.load_components``). ``parts``: the VAE or text encoders already loaded, by subfolder
    (an all-in-one single file's own); the folder's are then not read."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
    )
    from transformers import (
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5EncoderModel,
        T5TokenizerFast,
    )

    weights = wkw if callable(wkw) else (lambda sub: wkw)
    arch = PIPELINES[index["_class_name"]]
    transformer_cls = FluxTransformer2DModel if arch == "flux" else SD3Transformer2DModel
    if transformer is None:
        transformer = transformer_cls.from_pretrained(
            location, subfolder="transformer", **weights("transformer"), **load_dtype_kw(dtypes, "unet")
        )
    found = detect_flow_family(index, dict(transformer.config))
    fam = registry.family(_check(found, family, location))
    parts = parts or {}
    vae = (
        parts["vae"]
        if "vae" in parts
        else AutoencoderKL.from_pretrained(
            location, subfolder="vae", **weights("vae"), **load_dtype_kw(dtypes, "vae")
        )
    )
    te_kw = load_dtype_kw(dtypes, "text_encoder", "transformers")
    if arch == "flux":
        clips = [(CLIPTextModel, "text_encoder", "tokenizer")]
        t5_at = ("text_encoder_2", "tokenizer_2")
    else:
        clips = [
            (CLIPTextModelWithProjection, "text_encoder", "tokenizer"),
            (CLIPTextModelWithProjection, "text_encoder_2", "tokenizer_2"),
        ]
        t5_at = ("text_encoder_3", "tokenizer_3")
    text_encoders, tokenizers = [], []
    for cls, te_dir, tok_dir in clips:
        text_encoders.append(
            parts[te_dir]
            if te_dir in parts
            else cls.from_pretrained(location, subfolder=te_dir, **weights(te_dir), **te_kw)
        )
        tokenizers.append(CLIPTokenizer.from_pretrained(location, subfolder=tok_dir, **kw))
    if index.get(t5_at[0], [None])[0] is None:
        raise ModelLoadError(
            f"{location}: no T5 text encoder ({t5_at[0]} is empty in model_index.json)",
            fix="use the full pipeline folder; training without T5 is not supported",
        )
    text_encoders.append(
        parts[t5_at[0]]
        if t5_at[0] in parts
        else T5EncoderModel.from_pretrained(location, subfolder=t5_at[0], **weights(t5_at[0]), **te_kw)
    )
    t5_tok = T5TokenizerFast.from_pretrained(location, subfolder=t5_at[1], **kw)
    t5_tok.model_max_length = fam.t5_max_length  # conditioning.tokenize pads and cuts at model_max_length
    tokenizers.append(t5_tok)
    scheduler_config = dict(
        FlowMatchEulerDiscreteScheduler.load_config(location, subfolder="scheduler", **kw)
    )
    return FlowComponents(
        family=fam.name,
        unet=transformer,
        vae=vae,
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        noise_scheduler=FlowMatchEulerDiscreteScheduler.from_config(scheduler_config),
        scheduler_config=scheduler_config,
        source=location,
        adapter=_adapter(fam.name),
    )


def _adapter(family: str):
    from .flow import FlowAdapter

    return FlowAdapter(family)
