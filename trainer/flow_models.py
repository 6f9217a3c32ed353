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
) -> FlowComponents:
    """The components of an SD3.5/FLUX folder or hub id (``index``: its model_index.json; ``kw``/``wkw``: the
    revision / revision+variant keywords of from_pretrained; ``wkw`` may be a function of the subfolder, as
    ``models._load_pretrained`` passes: the variant each component's weights come in). ``transformer``: one already loaded (a
    single-file base, ``flow_single_file``); the folder's own is then not read. ``dtypes``: the dtype each
    part loads in (``models.load_components``)."""
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
    vae = AutoencoderKL.from_pretrained(
        location, subfolder="vae", **weights("vae"), **load_dtype_kw(dtypes, "vae")
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
        text_encoders.append(cls.from_pretrained(location, subfolder=te_dir, **weights(te_dir), **te_kw))
        tokenizers.append(CLIPTokenizer.from_pretrained(location, subfolder=tok_dir, **kw))
    if index.get(t5_at[0], [None])[0] is None:
        raise ModelLoadError(
            f"{location}: no T5 text encoder ({t5_at[0]} is empty in model_index.json)",
            fix="use the full pipeline folder; training without T5 is not supported",
        )
    text_encoders.append(
        T5EncoderModel.from_pretrained(location, subfolder=t5_at[0], **weights(t5_at[0]), **te_kw)
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
