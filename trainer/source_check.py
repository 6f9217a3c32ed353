"""What a base model is, read from its files before anything loads (no torch): ``sdplan train`` runs
:func:`check_source` before the launch, the trainer again before it loads the model.

A diffusers folder: its pipeline class, every component it needs (folder, config, weights or tokenizer files),
its UNet / transformer input channels and its scheduler. A single ``.safetensors``: its header (keys,
shapes, metadata; a file shorter than its header says is truncated). A pickled ``.ckpt``: its keys and
shapes from its pickle, read without torch and without running it (:mod:`.ckpt_reader`). Either way the result is the family,
the prediction type where the files say it, the weights variant to load, and notes on what was detected; a
model sdplan cannot train (another family, an inpainting / instruct-pix2pix / refiner / FLUX.1 Fill or
Control model, an EDM model such as Playground v2.5, a LoRA, an embedding, a lone VAE or UNet) is one
:class:`UnsupportedModelError` line naming what it is.

Where the facts come from (public source, read for this): diffusers 0.42 ``loaders/single_file_utils.py``
(``CHECKPOINT_KEY_NAMES``: the refiner's ``conditioner.embedders.0`` without ``.1``, Playground v2.5's
``edm_mean``, inpainting's 9 input channels; SD 2.x files default to v-prediction unless ``global_step`` is
875000); ComfyUI ``comfy/supported_models.py`` (``v_pred`` key: v-prediction, ``ztsnr`` key: zero terminal SNR,
``edm_vpred.sigma_max``: EDM v-prediction; SD 2.x: v-prediction when the std of
``output_blocks.11.1.transformer_blocks.0.norm1.bias`` exceeds 0.09); A1111 ``modules/sd_models_config.py``
(a ``<name>.yaml`` beside the checkpoint is its config; 9 / 8 input channels: inpainting / instruct-pix2pix;
``conditioner.embedders.0`` alone: the SDXL refiner); the SAI model spec as kohya writes it
(``modelspec.prediction_type``: ``v`` or ``epsilon``; ``modelspec.architecture``:
``stable-diffusion-v2-768-v`` / ``-512``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdplan import registry
from sdplan.errors import UsageError

from .ckpt_reader import Unreadable, read_ckpt_shapes, read_ckpt_tensor
from .flow_models import PIPELINES as FLOW_PIPELINES
from .flow_models import detect_flow_family, file_parts, file_parts_note, flow_family_of_folder
from .models import CROSS_WIDTHS, ModelLoadError, cross_attention_width, detect_family, is_safetensors_name

UNET = "model.diffusion_model."
FIX_TRAINABLE = (
    "give a Stable Diffusion 1.x / 2.x / SDXL, SD3.5 or FLUX.1 base model (diffusers folder, hub id or "
    ".safetensors/.ckpt checkpoint)"
)


class UnsupportedModelError(ModelLoadError):
    """The model exists but is not one sdplan trains, or is incomplete: one line saying which."""

    exit_code = 2


@dataclass
class SourceInfo:
    """What :func:`check_source` found. ``prediction_type``: epsilon / v_prediction / flow_matching where the
    files say it, None where the loader's default stands. ``variants``: the weights variant each diffusers
    component loads (``fp16`` where a folder holds only ``*.fp16.*`` weights), ``location``: where to load
    from (a hub id found complete in the local cache: its snapshot folder, with ``cached`` set)."""

    kind: str  # folder | file | hub
    location: str
    family: str | None = None
    prediction_type: str | None = None
    zero_snr: bool = False
    variants: dict[str, str | None] = field(default_factory=dict)
    cached: bool = False
    notes: list[str] = field(default_factory=list)
    unread: str | None = None  # a pickled checkpoint whose keys were not read: why (it is checked at load)
    # an SD3.5 / FLUX.1 single file: which components it gives and which model.config_dir does (one of notes)
    parts_note: str | None = None


def refuse(where: str, what: str, fix: str = FIX_TRAINABLE) -> UnsupportedModelError:
    return UnsupportedModelError(f"model.path {where}: {what}", fix=fix)


# -- diffusers folders ---------------------------------------------------------------------------------------

UNET_PIPELINES = {
    "StableDiffusionPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionXLPipeline",
    "StableDiffusionXLImg2ImgPipeline",
}
UNCLIP = "its UNet is conditioned on a CLIP image embedding at every step, which text-to-image training lacks"
# pipelines of a known model sdplan does not train, by what they are
REFUSED_PIPELINES = {
    "StableDiffusionInpaintPipeline": "an inpainting model (its UNet takes 9 input channels)",
    "StableDiffusionXLInpaintPipeline": "an SDXL inpainting model (its UNet takes 9 input channels)",
    "StableDiffusionInstructPix2PixPipeline": "an instruct-pix2pix model (its UNet takes 8 input channels)",
    "StableDiffusionXLInstructPix2PixPipeline": "an SDXL instruct-pix2pix model (its UNet takes 8 input channels)",
    "FluxFillPipeline": "a FLUX.1 Fill (inpainting) model",
    "FluxControlPipeline": "a FLUX.1 Depth / Canny (control) model",
    "FluxKontextPipeline": "a FLUX.1 Kontext (image editing) model",
    "StableDiffusionUpscalePipeline": "an upscaler",
    "StableDiffusionDepth2ImgPipeline": "a depth-to-image model (its UNet takes 5 input channels)",
    "StableUnCLIPPipeline": f"a Stable unCLIP model ({UNCLIP})",
    "StableUnCLIPImg2ImgPipeline": f"a Stable unCLIP model ({UNCLIP})",
}
TRAINS = "sdplan trains SD 1.x / 2.x, SDXL, SD3.5 and FLUX.1"
# other families, by the start of their pipeline class name
OTHER_FAMILIES = (
    ("PixArt", "PixArt"),
    ("Kandinsky", "Kandinsky"),
    ("StableCascade", "Stable Cascade"),
    ("Wuerstchen", "Würstchen"),
    ("IF", "DeepFloyd IF"),
    ("AuraFlow", "AuraFlow"),
    ("Lumina", "Lumina"),
    ("Sana", "Sana"),
    ("HunyuanDiT", "Hunyuan-DiT"),
    ("Kolors", "Kolors"),
    ("Flux2", "FLUX.2"),
    ("Chroma", "Chroma"),
    ("AltDiffusion", "AltDiffusion"),  # its text encoder is XLM-R: a CLIP text model would load it random
    ("QwenImage", "Qwen-Image"),
    ("HiDream", "HiDream"),
    ("CogView", "CogView"),
    ("LatentConsistency", "a latent consistency (LCM) model"),
)
# the channels a denoiser of each kind takes as a text-to-image base; others are conditioned variants
_IN_CHANNELS = {"unet": 4, "mmdit": 16, "flux": 64}
_CHANNEL_VARIANTS = {
    ("unet", 9): "an inpainting model (its UNet takes 9 input channels: latents, mask, masked image)",
    ("unet", 8): "an instruct-pix2pix model (its UNet takes 8 input channels: latents and the input image)",
    ("unet", 5): "a depth-to-image model (its UNet takes 5 input channels)",
    ("flux", 384): "a FLUX.1 Fill (inpainting) model (its transformer takes 384 input channels)",
    ("flux", 128): "a FLUX.1 Depth / Canny (control) model (its transformer takes 128 input channels)",
}
_WEIGHT_STEMS = ("diffusion_pytorch_model", "model", "pytorch_model")


def _read_json(root: Path, name: str, where: str) -> dict[str, Any]:
    path = root / name
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise refuse(where, f"cannot read {name} ({e.strerror or e})") from None
    except ValueError as e:
        raise refuse(
            where, f"{name} is not valid JSON ({e})", fix="restore the file (download the model again)"
        ) from None
    if not isinstance(data, dict):
        raise refuse(where, f"{name} is not a JSON object", fix="restore the file (download it again)")
    return data


def weight_variants(folder: Path) -> set[str | None]:
    """The variants a component folder's weights come in: None for plain ``model.safetensors`` names,
    ``fp16`` for ``model.fp16.safetensors`` (sharded: ``model.safetensors.index.fp16.json``)."""
    found: set[str | None] = set()
    for f in folder.iterdir() if folder.is_dir() else ():
        name = f.name
        if not name.startswith(_WEIGHT_STEMS):
            continue
        if name.endswith((".safetensors", ".bin")):
            stem = re.sub(r"-\d{5}-of-\d{5}", "", name.rsplit(".", 1)[0])
            parts = stem.split(".")
            found.add(parts[1] if len(parts) == 2 else None)
        elif ".index" in name and name.endswith(".json"):
            parts = name.split(".")  # model.safetensors.index.json | model.safetensors.index.fp16.json
            found.add(parts[3] if len(parts) == 5 else None)
    return found


def _truncated(folder: Path, sub: str, variant: str | None) -> list[str]:
    """The .safetensors weights of ``variant`` in a component folder that are shorter than their header
    says (an interrupted download): their names, as problems."""
    found = []
    for f in sorted(folder.glob("*.safetensors")):
        stem = re.sub(r"-\d{5}-of-\d{5}", "", f.name.rsplit(".", 1)[0]).split(".")
        if (stem[1] if len(stem) == 2 else None) != variant:
            continue
        try:
            read_safetensors_header(f, f"{sub}/{f.name}")
        except UnsupportedModelError as e:
            # "model.path <name>: truncated: ..." -> "<name> is truncated: ..."
            found.append(e.message.replace("model.path ", "", 1).replace(": ", " is ", 1))
    return found


def _missing_shards(folder: Path, sub: str, variant: str | None) -> list[str]:
    """The shards a sharded component's index lists that its folder lacks (an interrupted or partial
    download), as problems, from the index its loader reads. diffusers' ``ModelMixin.from_pretrained`` (the UNet,
    VAE, transformer: ``diffusion_pytorch_model*``) reads the safetensors index of ``variant`` where there is
    one, a whole weights file beside it or not (``save_pretrained`` leaves a stale index beside a whole file
    it wrote later: the load fails on it), then a whole file, and never a .bin index. transformers'
    (the text encoders) takes the whole ``model.safetensors``, else its index, else ``pytorch_model.bin``, else
    its index, so an index beside a whole file of its format or a preferred one is not read."""
    suffix = f".{variant}" if variant else ""
    if any(folder.glob("diffusion_pytorch_model*")):
        index = folder / f"diffusion_pytorch_model.safetensors.index{suffix}.json"
        if index.is_file():
            return _index_shards_absent(folder, sub, index)
        if any(
            (folder / f"diffusion_pytorch_model{suffix}.{ext}").is_file() for ext in ("safetensors", "bin")
        ):
            return []
        if (folder / f"diffusion_pytorch_model.bin.index{suffix}.json").is_file():
            return [f"{sub}/ holds its weights as .bin shards only, which diffusers does not load"]
        return []
    for ext in ("safetensors", "bin"):
        if any((folder / f"{stem}{suffix}.{ext}").is_file() for stem in _WEIGHT_STEMS):
            return []
        index = next(
            (f for stem in _WEIGHT_STEMS if (f := folder / f"{stem}.{ext}.index{suffix}.json").is_file()),
            None,
        )
        if index is not None:
            return _index_shards_absent(folder, sub, index)
    return []


def _index_shards_absent(folder: Path, sub: str, index: Path) -> list[str]:
    """The problem of the shards ``index`` lists that ``folder`` lacks (none: [])."""
    data = _read_json(folder, index.name, f"{sub}/{index.name}")
    names = data.get("weight_map")
    shards = sorted({str(n) for n in names.values()}) if isinstance(names, dict) else []
    missing = [n for n in shards if not (folder / n).is_file()]
    if not missing:
        return []
    return [f"{sub}/ lacks {len(missing)} of the {len(shards)} shards {index.name} lists ({missing[0]})"]


def _tokenizer_lacks(folder: Path) -> tuple[str, str] | None:
    """What a tokenizer folder lacks, as a file name and as said in full (None: nothing): its vocabulary (tokenizer.json, vocab.json + merges.txt, or
    T5's spiece.model), else tokenizer_config.json: without it transformers' CLIPTokenizer has no
    model_max_length (it is 1e30, not 77) and the trainer failed after the launch (OverflowError padding the
    captions to it). diffusers' single-file config download fetches every ``*.json``, so a cache holds it."""
    has = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if not ("tokenizer.json" in has or {"vocab.json", "merges.txt"} <= has or "spiece.model" in has):
        return "vocab.json + merges.txt", "tokenizer files (tokenizer.json, or vocab.json + merges.txt)"
    if "tokenizer_config.json" not in has:
        return "tokenizer_config.json", "tokenizer_config.json (the tokenizer's max length: CLIP's 77)"
    return None


def _config_lacks(folder: Path, kind: str) -> tuple[str, str] | None:
    """What a component folder of ``kind`` (:func:`_components`) lacks of the files that describe it, as a file
    name and as said in full (None: nothing): a tokenizer's (:func:`_tokenizer_lacks`), a scheduler's
    scheduler_config.json, a model's config.json. Its weights are another check (a model's only)."""
    if kind == "tokenizer":
        return _tokenizer_lacks(folder)
    name = "scheduler_config.json" if kind == "scheduler" else "config.json"
    return None if (folder / name).is_file() else (name, name)


def _components(arch: str, sdxl: bool) -> list[tuple[str, str]]:
    """(subfolder, kind) of what a family's folder must hold; kind: model | tokenizer | scheduler."""
    if arch == "unet":
        names = ["unet", "vae", "text_encoder", "tokenizer"] + (
            ["text_encoder_2", "tokenizer_2"] if sdxl else []
        )
    else:
        encoders = 3 if arch == "mmdit" else 2
        names = ["transformer", "vae"]
        for i in range(encoders):
            sfx = "" if i == 0 else f"_{i + 1}"
            names += [f"text_encoder{sfx}", f"tokenizer{sfx}"]
    names.append("scheduler")
    return [
        (n, "tokenizer" if n.startswith("tokenizer") else "scheduler" if n == "scheduler" else "model")
        for n in names
    ]


def check_folder(
    root: Path, where: str, *, family: str | None = None, variant: str | None = None, files: bool = True
) -> SourceInfo:
    """A diffusers folder: a pipeline sdplan trains, complete, with the family, variant and prediction type
    it loads with. ``where``: the name the user gave (for the messages). ``files=False``: ``root`` holds only
    the configs (a hub model's, :func:`check_hub`); its components' files are not looked for."""
    index = _read_json(root, "model_index.json", where)
    cls = str(index.get("_class_name") or "")
    if cls in REFUSED_PIPELINES:
        raise refuse(
            where, f"a {cls} folder: {REFUSED_PIPELINES[cls]}, not a text-to-image base sdplan trains"
        )
    if cls not in UNET_PIPELINES and cls not in FLOW_PIPELINES:
        label = next((lab for pre, lab in OTHER_FAMILIES if cls.startswith(pre)), None)
        if label is not None or not (root / "unet" / "config.json").is_file():
            what = f"a {cls or 'unnamed'} pipeline"
            if label:  # "a latent consistency (LCM) model" is said as it is
                named = (
                    label
                    if label.startswith("a ")
                    else f"{'an' if label[0] in 'AEIOU' else 'a'} {label} model"
                )
                what = f"{named} ({cls}), an unsupported family"
            raise refuse(where, f"{what}; {TRAINS}")
        # another pipeline class over a Stable Diffusion UNet (a community pipeline's folder): its UNet decides

    def named(key: str) -> bool:
        entry = index.get(key)
        return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None

    arch = FLOW_PIPELINES.get(cls, "unet")
    sdxl = arch == "unet" and ("text_encoder_2" in index or cls.startswith("StableDiffusionXL"))
    if sdxl and not named("text_encoder") and named("text_encoder_2"):
        raise refuse(
            where,
            "an SDXL refiner (only the second text encoder; it refines SDXL base images from late "
            "timesteps and is not a base to train)",
            fix="give the SDXL base model (e.g. stabilityai/stable-diffusion-xl-base-1.0)",
        )
    if index.get("requires_aesthetics_score"):
        raise refuse(
            where,
            "an SDXL refiner (it conditions on an aesthetic score), not a base to train",
            fix="give the SDXL base model (e.g. stabilityai/stable-diffusion-xl-base-1.0)",
        )

    denoiser = "unet" if arch == "unet" else "transformer"
    # what it is first (an inpainting or EDM model is refused as that, complete or not)
    has = (root / denoiser / "config.json").is_file()
    dconf = _read_json(root, f"{denoiser}/config.json", where) if has else {}
    channels = dconf.get("in_channels")
    if channels != _IN_CHANNELS[arch] and channels is not None:
        what = _CHANNEL_VARIANTS.get((arch, channels)) or (
            f"a {denoiser} with {channels} input channels (a text-to-image base takes {_IN_CHANNELS[arch]})"
        )
        raise refuse(where, f"{what}, not a text-to-image base sdplan trains")
    # Stable unCLIP's UNet takes class_labels (class_embed_type "projection"): a text-to-image step gives none
    embed = [f"{k} {dconf[k]}" for k in ("class_embed_type", "num_class_embeds") if dconf.get(k)]
    if arch == "unet" and embed:
        raise refuse(
            where,
            f"a UNet conditioned on class labels ({embed[0]}; Stable unCLIP's takes a CLIP image embedding so "
            "at every step), not a text-to-image base sdplan trains",
        )

    has = (root / "scheduler" / "scheduler_config.json").is_file()
    sched = _read_json(root, "scheduler/scheduler_config.json", where) if has else {}
    sname = str(sched.get("_class_name") or "")
    if sname.startswith("EDM"):
        raise refuse(
            where,
            f"an EDM model (its scheduler is {sname}, as Playground v2.5's): it is trained with the EDM "
            "objective and noise schedule, which sdplan's SDXL training does not use",
            fix="train an SDXL base with the DDPM schedule, or a trainer that supports EDM (Playground v2.5)",
        )
    problems: list[str] = []
    variants: dict[str, str | None] = {}
    for sub, kind in _components(arch, sdxl):
        folder = root / sub
        if not named(sub):
            problems.append(f"model_index.json names no {sub}")
        elif not files:
            continue
        elif not folder.is_dir():
            problems.append(f"no {sub}/ folder")
        elif lacks := _config_lacks(folder, kind):
            problems.append(f"{sub}/ holds no {lacks[1]}" if kind == "tokenizer" else f"no {sub}/{lacks[0]}")
        elif kind == "model":
            have = weight_variants(folder)
            if not have:
                problems.append(f"no {sub} weights ({sub}/*.safetensors)")
                continue
            if variant in have:
                variants[sub] = variant
            elif None in have:
                variants[sub] = None
            else:  # only variant files (*.fp16.safetensors): load those
                variants[sub] = "fp16" if "fp16" in have else sorted(v for v in have if v)[0]
            problems += _missing_shards(folder, sub, variants[sub]) + _truncated(folder, sub, variants[sub])
    if problems:
        shown = "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
        raise refuse(
            where,
            f"an incomplete diffusers folder: {shown}",
            fix="download the whole model again (e.g. `hf download <id> --local-dir <folder>`), or give its "
            ".safetensors checkpoint",
        )
    info = SourceInfo("folder", str(root), variants=variants)
    picked = sorted({v for v in variants.values() if v and v != variant})
    if picked:
        info.notes.append(f"weights: the {', '.join(picked)} variant (the folder holds only those files)")
    plain = [sub for sub, v in variants.items() if variant and v is None]
    if plain:  # from_pretrained(variant=) would fail on them: their plain weights load, as saved
        info.notes.append(
            f"weights: model.variant {variant}, but {', '.join(plain)} hold no {variant} files: their plain "
            "weights load instead (as saved, often float32; training.precision sets the training dtype)"
        )

    tiny = False
    if arch == "unet":
        found = detect_family(dconf, 2 if sdxl else 1)
        tiny = cross_attention_width(dconf) not in CROSS_WIDTHS
        # epsilon is the default of a scheduler config that does not say; none read (a hub model's that
        # could not be fetched): the loader's scheduler decides
        info.prediction_type = sched.get("prediction_type") or ("epsilon" if has else None)
        info.zero_snr = bool(sched.get("rescale_betas_zero_snr"))
    else:
        found = detect_flow_family({"_class_name": cls}, dconf)
        info.prediction_type = "flow_matching"
    info.family = check_family(found, family, where, tiny=tiny)
    info.notes.insert(0, describe(info))
    return info


def check_family(found: str | None, wanted: str | None, where: str, *, tiny: bool = False) -> str | None:
    """The family to train as: ``wanted`` (model.family) unless the files say another one. SD 1.x/2.x vs SDXL
    vs SD3.5 vs FLUX.1 are other networks; SD3.5 Medium vs Large and FLUX.1 [dev] vs [schnell] are told apart
    by the transformer's config or the file's keys (the dual attention, qk-norm, the guidance embedder) and a
    mismatch loads the wrong network (FLUX.1 [dev]'s guidance embedder dropped as [schnell]); SD 1.x vs 2.x
    by the UNet's cross-attention width (768 / 1024, :data:`.models.CROSS_WIDTHS`; diffusers and A1111 read it
    so), which trains SD 2.x as SD 1.x (epsilon, 512 px, an sd_v1 export) where model.family says sd15. Only
    ``tiny``: a UNet of none of the released widths (a test model built in code) is sd15 or sd21 as the
    setting says."""
    if wanted is None or found is None or wanted == found:
        return found or wanted
    if tiny and {wanted, found} <= {"sd15", "sd21"}:
        return wanted
    raise UnsupportedModelError(
        f"model.family is {wanted} but {where} is an {found} model",
        fix=f"set model.family: {found} (or leave it out: it is read from the model)",
    )


def describe(info: SourceInfo) -> str:
    """One line on what was detected (the trainer prints it before it loads the model)."""
    bits = [f"family {info.family or 'from the model'}"]
    if info.prediction_type:
        bits.append(
            f"prediction {info.prediction_type}" + (" with zero terminal SNR" if info.zero_snr else "")
        )
    chosen = sorted({v for v in info.variants.values() if v})
    if chosen:
        bits.append(f"variant {', '.join(chosen)}")
    where = {"folder": "diffusers folder", "file": "single file", "hub": "hub model"}[info.kind]
    if info.cached:
        where += " (from the local Hugging Face cache)"
    return f"model: {where}: " + ", ".join(bits)


# -- single files ----------------------------------------------------------------------------------------------

# kohya / sdplan embeddings: emb_params (SD 1.x/2.x), clip_l + clip_g (SDXL); A1111's .pt: string_to_param, ...
_TI_KEYS = {"emb_params", "clip_l", "clip_g", "string_to_param", "string_to_token", "name", "step"}
_TI_KEYS |= {"sd_checkpoint", "sd_checkpoint_name"}
_VAE_PREFIXES = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "first_stage_model.")
_TEXT_PREFIXES = ("cond_stage_model.", "conditioner.", "text_encoders.")
# the text encoders of SD 1.x / 2.x / SDXL files: CLIP (transformers' layout) and OpenCLIP, ldm's and SGM's prefixes
_CLIP_LAYOUTS = ("cond_stage_model.transformer.", "cond_stage_model.model.", "conditioner.embedders.")
_DIFFUSERS_UNET = ("down_blocks.", "mid_block.", "up_blocks.", "conv_in.")
SD2_V_PROBE = UNET + "output_blocks.11.1.transformer_blocks.0.norm1.bias"  # ComfyUI SD20.model_type


def read_safetensors_header(path: Path, where: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A .safetensors file's tensor shapes and metadata from its header (no torch); a file shorter than the
    header says (an interrupted download or copy) is refused here, before anything reads it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, 256 * 2**20):
            raise refuse(where, "not a safetensors file (no valid header)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise refuse(where, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise refuse(where, "not a safetensors file")
    metadata = header.pop("__metadata__", None) or {}
    shapes: dict[str, tuple[int, ...]] = {}
    end = 0
    for name, t in header.items():
        if isinstance(t, dict):
            shapes[name] = tuple(t.get("shape") or ())
            end = max(end, int((t.get("data_offsets") or [0, 0])[1]))
    if 8 + n + end > size:
        raise refuse(
            where,
            f"truncated: its header describes {8 + n + end:,} bytes but the file holds {size:,} (an "
            "interrupted download or copy)",
            fix="download or copy the file again",
        )
    return shapes, {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def _unet_cross_width(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The cross-attention width of a checkpoint's UNet: the input width of its cross attention's key
    projection (diffusers ``infer_diffusers_model_type`` reads
    ``input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight``'s last dimension: 1024 is SD 2.x); None when
    it has none."""
    found = sorted(k for k in shapes if k.startswith(UNET) and k.endswith(".attn2.to_k.weight"))
    shape = shapes[found[0]] if found else ()
    return shape[-1] if len(shape) == 2 else None


def family_from_keys(keys) -> str | None:
    """sd15 / sd21 / sdxl from a checkpoint's key names (the text encoders' prefixes)."""
    keys = list(keys)
    if any(k.startswith("conditioner.embedders.1.") for k in keys):
        return "sdxl"
    if any(k.startswith(("cond_stage_model.model.", "conditioner.embedders.0.model.")) for k in keys):
        return "sd21"
    if any(k.startswith("cond_stage_model.transformer.") for k in keys):
        return "sd15"
    return None


# FLUX.2's shared modulation (diffusers CHECKPOINT_KEY_NAMES["flux2"], tested before FLUX.1's): its blocks are
# named as FLUX.1's, and its transformer takes 128 channels as a text-to-image base
_FLUX2_KEYS = ("single_stream_modulation.", "double_stream_modulation_img.", "double_stream_modulation_txt.")


def flow_family_from_keys(plain) -> str | None:
    """sd35-medium / sd35-large / flux-dev / flux-schnell from an SD3.5 / FLUX.1 transformer's original-layout
    key names (without ``model.diffusion_model.``); None for any other network. The keys stand for the
    transformer config :func:`.flow_models.detect_flow_family` reads in a folder: ``guidance_in.*`` is the
    guidance embedder of FLUX.1 [dev] ([schnell] has none: diffusers ``infer_diffusers_model_type``),
    ``x_block.attn2.*`` the dual attention of SD3.5 Medium (MMDiT-X), ``x_block.attn.ln_q`` the qk-norm of
    SD3.5 (Large has it and no attn2; SD3 Medium neither). On the released files this is diffusers' reading
    too (``joint_blocks.37.*``: Large; the 1536-wide blocks: SD3 or 3.5 Medium by ``pos_embed``), and it holds
    at any width and depth, so a merged or tiny model is read the same way."""
    keys = list(plain)
    if any(k.startswith(_FLUX2_KEYS) for k in keys):
        return None  # FLUX.2: double blocks too, modulated once for all blocks (classify_state refuses it)
    if any(k.startswith("double_blocks.") for k in keys):
        config = {"guidance_embeds": any(k.startswith("guidance_in.") for k in keys)}
        return detect_flow_family({"_class_name": "FluxPipeline"}, config)
    if any(k.startswith("joint_blocks.") for k in keys):
        blocks = [k for k in keys if k.startswith("joint_blocks.")]
        config = {
            "dual_attention_layers": any(".x_block.attn2." in k for k in blocks),
            "qk_norm": any(".x_block.attn.ln_q." in k for k in blocks),
        }
        return detect_flow_family({"_class_name": "StableDiffusion3Pipeline"}, config)
    return None


_NOT_THE_TRANSFORMER = _TEXT_PREFIXES + ("first_stage_model.",)


def _scaled_markers(keys: set[str], metadata: dict[str, str], flow: bool) -> list[str]:
    """The ComfyUI scaled-fp8 markers (``scaled_fp8``, ``scale_weight``, ``comfy_quant`` keys; the layers
    ``_quantization_metadata`` lists) of the weights sdplan loads from the file. An SD 1.x / 2.x / SDXL file is
    read whole (``from_single_file`` builds its text encoders and VAE from it too): every marker counts. From an
    SD3.5 / FLUX.1 file the text encoders and VAE are read only where they carry no such marker (a quantized
    one comes from model.config_dir: :func:`.flow_models.file_parts`), so a text encoder's own marker
    (``text_encoders.t5xxl.transformer.scaled_fp8``, as in Comfy-Org's ``*_t5xxlfp8scaled`` files; ComfyUI
    ``sd3_clip.t5_xxl_detect`` reads it per encoder) does not count."""
    ends = ("scaled_fp8", "scale_weight", "comfy_quant")
    found = [k for k in sorted(keys) if k.rsplit(".", 1)[-1] in ends]
    quant = metadata.get("_quantization_metadata")
    if quant is not None:
        try:
            layers = json.loads(quant).get("layers")
        except (ValueError, AttributeError):
            layers = None
        # unreadable: assume it covers the transformer (it names layers ComfyUI dequantizes)
        names = sorted(layers) if isinstance(layers, dict) else ["model.diffusion_model"]
        found += [f"_quantization_metadata of {n}" for n in names]
    if flow:
        found = [
            k
            for k in found
            if not k.removeprefix("_quantization_metadata of ").startswith(_NOT_THE_TRANSFORMER)
        ]
    return found


def _bnb_markers(keys: set[str], flow: bool) -> list[str]:
    """bitsandbytes' quantized-layer keys (``<layer>.weight.quant_state.bitsandbytes__nf4`` / ``__fp4`` beside
    ``weight.absmax`` and ``weight.quant_map`` of a 4-bit layer, as in Forge's ``flux1-dev-bnb-nf4``; ``<layer>.SCB``
    of an 8-bit one: bitsandbytes ``QuantState.as_dict(packed=True)``, ``Linear8bitLt``) among the weights sdplan
    loads from the file, read as :func:`_scaled_markers` reads ComfyUI's."""
    found = [k for k in sorted(keys) if ".bitsandbytes__" in k or k.endswith(".SCB")]
    if flow:
        found = [k for k in found if not k.startswith(_NOT_THE_TRANSFORMER)]
    return found


def classify_state(
    shapes: dict[str, tuple[int, ...]],
    metadata: dict[str, str],
    path: Path,
    where: str,
    *,
    family: str | None = None,
) -> SourceInfo:
    """What a single checkpoint is, from its tensor names and shapes, its metadata and a ``<name>.yaml``
    beside it: a base sdplan trains (family, prediction type) or an :class:`UnsupportedModelError`."""
    keys = set(shapes)
    if not keys:
        raise refuse(where, "holds no tensors")
    if keys <= _TI_KEYS or all(k.startswith("string_to_param") or k in _TI_KEYS for k in keys):
        raise refuse(
            where,
            "a textual-inversion embedding (it adds a word to a base model; it is not one)",
            fix="give the base model it was trained for as model.path (the embedding is loaded at inference)",
        )
    if any("lora" in k.lower() or k.startswith(("lycoris_", "hada_")) for k in keys):
        raise refuse(
            where,
            "a LoRA, which is applied to a base model, not trained from",
            fix="give the base model it was trained for as model.path",
        )
    plain = {k[len(UNET) :] if k.startswith(UNET) else k: v for k, v in shapes.items()}
    flow = flow_family_from_keys(plain)
    if any(k.startswith(_FLUX2_KEYS) for k in plain):
        raise refuse(
            where,
            f"a FLUX.2 model ({next(k for k in sorted(plain) if k.startswith(_FLUX2_KEYS))}: its blocks share "
            f"one modulation), an unsupported family; {TRAINS}",
        )
    if any(k.startswith("distilled_guidance_layer.") for k in plain):
        # diffusers CHECKPOINT_KEY_NAMES["chroma"], tested before "flux": FLUX.1 [schnell]'s blocks without their
        # per-block modulation, which this approximator computes (read as FLUX.1 it misses those weights)
        raise refuse(
            where,
            "a Chroma model (distilled_guidance_layer.*: FLUX.1 blocks modulated by a distilled guidance "
            f"network, not FLUX.1's own), an unsupported family; {TRAINS}",
        )
    scaled = _scaled_markers(keys, metadata, flow is not None)
    if scaled:
        # ComfyUI (comfy/utils.py convert_old_quants): each weight is stored as fp8 of weight / scale, its
        # scale beside it; diffusers reads the fp8 values as the weights
        marker = next((k for k in scaled if k.endswith("scaled_fp8")), scaled[0])
        raise refuse(
            where,
            f"a ComfyUI scaled-fp8 checkpoint ({marker}: its weights are stored divided by per-layer scales, "
            "which only ComfyUI applies; trained from, they are the wrong weights)",
            fix="give the unscaled checkpoint, the model's bf16 / fp16 release; for SD3.5 / FLUX.1, "
            "model.base_precision=fp8 stores it in fp8 for training",
        )
    packed = _bnb_markers(keys, flow is not None)
    if packed:
        # diffusers' single-file converters copy each tensor as it is: a 4-bit layer's packed uint8 bytes (half
        # the weight's elements, shape (n, 1)) do not load as its weight, and no converter reads quant_state
        kind = "8-bit" if packed[0].endswith(".SCB") else packed[0].rsplit("bitsandbytes__", 1)[-1].upper()
        raise refuse(
            where,
            f"a bitsandbytes {kind} checkpoint ({packed[0]}: its weights are stored packed, with per-block "
            "scales that only the bitsandbytes loaders of Forge and ComfyUI unpack)",
            fix="give the model's bf16 / fp16 release; for SD3.5 / FLUX.1, model.base_precision=nf4 stores it "
            "in NF4 for training",
        )
    if flow is not None:
        channels = (plain.get("img_in.weight") or (0, 0))[-1]
        what = _CHANNEL_VARIANTS.get(("flux", channels))
        if what is not None:
            raise refuse(where, f"{what}, not a text-to-image base sdplan trains")
        info = SourceInfo("file", str(path), prediction_type="flow_matching")
        info.family = check_family(flow, family, where)
        return info
    has_unet = any(k.startswith(UNET) for k in keys)
    blocks = tuple(UNET + b for b in ("input_blocks.", "middle_block.", "output_blocks."))
    if has_unet and not any(k.startswith(blocks) for k in keys):
        # Lumina 2 / Z-Image (layers.*), Wan (head.modulation), Hunyuan-DiT (blocks.*) ... under the same prefix:
        # read as an SD checkpoint, "set model.family" let it pass and fail in the trainer
        denoiser = min(k for k in keys if k.startswith(UNET))
        raise refuse(
            where,
            f"another family's model: its denoiser ({denoiser}) is no Stable Diffusion UNet, SD3.5 or FLUX.1 "
            f"transformer; {TRAINS}",
        )
    if not has_unet:
        fix = FIX_TRAINABLE
        if all(k.startswith(_VAE_PREFIXES) for k in keys):
            what = "only a VAE (no UNet or text encoder)"
        elif any(k.startswith(_DIFFUSERS_UNET) for k in keys):
            what = "only a UNet in diffusers layout (no VAE or text encoder)"
        elif all(k.startswith(_TEXT_PREFIXES + ("text_model.", "transformer.")) for k in keys):
            what = "only a text encoder"
        elif any(k.startswith(("input_blocks.", "middle_block.", "output_blocks.")) for k in keys):
            # ComfyUI's models/diffusion_models files: the UNet's own keys, without model.diffusion_model.
            what = "only a UNet (a 'diffusion model' file: no model.diffusion_model. prefix, VAE or text encoders)"
            fix = "give the full checkpoint (UNet, VAE and text encoders in one file) or the diffusers folder"
        elif any(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in keys):
            flux = any(k.startswith(("single_transformer_blocks.", "x_embedder.")) for k in keys)
            what = (
                f"only {'a FLUX.1' if flux else 'an SD3.5'} transformer in diffusers layout "
                "(transformer_blocks.*: a diffusers folder's transformer/ weights)"
            )
            fix = (
                "give the diffusers folder it belongs to as model.path, or the transformer in its original layout "
                f"({'double_blocks' if flux else 'joint_blocks'}.*) with model.config_dir"
            )
        else:
            what = "holds no Stable Diffusion UNet weights (model.diffusion_model.*)"
        raise refuse(where, what if what.startswith("holds") else f"{what}, not a whole model", fix=fix)
    missing = [
        part
        for part, prefixes in (("VAE", ("first_stage_model.",)), ("text encoder", _TEXT_PREFIXES))
        if not any(k.startswith(prefixes) for k in keys)
    ]
    if missing:
        what = (
            "only a UNet (a 'diffusion model' file without the VAE and text encoders)"
            if len(missing) == 2
            else f"a checkpoint without its {missing[0]}"
        )
        raise refuse(
            where,
            f"{what}, not a whole model",
            fix="give the full checkpoint (UNet, VAE and text encoders in one file) or the diffusers folder",
        )
    channels = (shapes.get(UNET + "input_blocks.0.0.weight") or (0, 4))[1]
    if channels != 4:
        what = _CHANNEL_VARIANTS.get(("unet", channels)) or f"a UNet with {channels} input channels"
        raise refuse(where, f"{what}, not a text-to-image base sdplan trains")
    if (
        any(k.startswith("conditioner.embedders.0.model.") for k in keys)
        and not any(k.startswith("conditioner.embedders.1.") for k in keys)
        and any(k.startswith(UNET + "label_emb.") for k in keys)
    ):
        # the refiner's UNet takes its size and aesthetic-score embedding (label_emb: ComfyUI model_detection's
        # adm_in_channels 2560); one OpenCLIP encoder without it is SD 2.x in SGM layout (SD 2.1 Turbo: A1111
        # sd_models.py checkpoint_dict_replacements_sd2_turbo, ComfyUI SD20 "SD2 in sgm format")
        raise refuse(
            where,
            "an SDXL refiner (one OpenCLIP text encoder; it refines SDXL base images from late timesteps "
            "and is not a base to train)",
            fix="give the SDXL base checkpoint",
        )
    if any(k.startswith(("embedder.model.", "noise_augmentor.")) for k in keys):
        raise refuse(where, f"a Stable unCLIP model (embedder.model.* is its CLIP image encoder; {UNCLIP})")
    if "edm_mean" in keys or "edm_vpred.sigma_max" in keys:
        what = "Playground v2.5's" if "edm_mean" in keys else "an EDM v-prediction model's (edm_vpred.*)"
        raise refuse(
            where,
            f"an EDM model ({what} keys): it is trained with the EDM objective and noise schedule, which "
            "sdplan's SDXL training does not use",
            fix="train an SDXL base with the DDPM schedule, or a trainer that supports EDM",
        )
    if any(k.startswith("cond_stage_model.roberta.") for k in keys):
        # A1111 sd_models_config.guess_model_config_from_state_dict: AltDiffusion (m9 / m18 on an SD 1.x / 2.x
        # UNet); diffusers' single-file loader builds a CLIP text encoder, which it has not
        raise refuse(
            where,
            "an AltDiffusion model (its text encoder is XLM-RoBERTa, cond_stage_model.roberta.*, not CLIP), an "
            f"unsupported family; {TRAINS}",
        )
    found = family_from_keys(keys)
    width = _unet_cross_width(shapes)
    clip = found is not None or any(k.startswith(_CLIP_LAYOUTS) for k in keys)
    if clip and found in (None, "sd15", "sd21") and CROSS_WIDTHS.get(width) in ("sd15", "sd21"):
        # diffusers: SD 2.x when the UNet's to_k is 1024 wide; only over a CLIP / OpenCLIP text encoder (another
        # one's projection can give any width: AltDiffusion's XLM-RoBERTa)
        found = CROSS_WIDTHS[width]
    tiny = width not in CROSS_WIDTHS
    info = SourceInfo("file", str(path), family=check_family(found, family, where, tiny=tiny))
    if info.family is None:
        raise refuse(where, "cannot tell SD 1.x, 2.x or SDXL from its keys", fix="set model.family")
    info.prediction_type, reason = _prediction(keys, metadata, path)
    if info.prediction_type is None and info.family == "sd21":
        std = tensor_std(path, SD2_V_PROBE)  # ComfyUI's SD 2.x test, on the file's bytes
        if std is not None:
            info.prediction_type = "v_prediction" if std > SD2_V_STD else "epsilon"
            reason = "its weights (ComfyUI's SD 2.x test)"
    info.zero_snr = "ztsnr" in keys and info.prediction_type == "v_prediction"
    if reason:
        info.notes.append(f"prediction type {info.prediction_type} from {reason}")
    return info


def _prediction(keys: set[str], metadata: dict[str, str], path: Path) -> tuple[str | None, str]:
    """The prediction type a checkpoint says, and where it says it: the A1111 config beside it first where it
    states one (what A1111 uses), then ComfyUI's ``v_pred`` marker, then the SAI model spec, then a config
    beside it that states none (ldm's default, eps). (None, "") when none says."""
    yaml_path = path.with_suffix(".yaml")
    stated, how = _yaml_prediction(yaml_path) if yaml_path.is_file() else (None, "")
    if stated is not None and how:
        return stated, f"{yaml_path.name} ({how})"
    if "v_pred" in keys:
        return "v_prediction", "its v_pred key" + (" and ztsnr key" if "ztsnr" in keys else "")
    spec = metadata.get("modelspec.prediction_type", "").strip().lower()
    if spec in ("v", "v_prediction", "v-prediction"):
        return "v_prediction", "its metadata (modelspec.prediction_type)"
    if spec in ("epsilon", "eps"):
        return "epsilon", "its metadata (modelspec.prediction_type)"
    arch = metadata.get("modelspec.architecture", "")
    if arch.startswith("stable-diffusion-v2-768-v"):
        return "v_prediction", "its metadata (modelspec.architecture)"
    if arch.startswith("stable-diffusion-v2-512"):
        return "epsilon", "its metadata (modelspec.architecture)"
    if stated is not None:
        return stated, f"{yaml_path.name} (no parameterization: the default, eps)"
    return None, ""


def _yaml_prediction(yaml_path: Path) -> tuple[str | None, str]:
    """What an A1111 config says of the prediction type, and how: an ldm config's
    ``model.params.parameterization`` ("v" or "eps"), an SGM config's (SDXL) denoiser scaling
    (``denoiser_config.params.scaling_config.target``: ``VScaling`` is v-prediction, ``EpsScaling`` epsilon, as
    A1111 ``sd_models_xl.extend_sdxl`` sets ``parameterization``). A config that states neither:
    ("epsilon", ""), ldm's and A1111's default where nothing else says; (None, "") for no readable config."""
    import yaml

    try:
        conf = yaml.safe_load(yaml_path.read_text(encoding="utf-8-sig"))
        params = conf["model"]["params"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None, ""
    if not isinstance(params, dict):
        return None, ""
    if params.get("parameterization") is not None:
        v = str(params["parameterization"]).strip().lower() == "v"
        return ("v_prediction" if v else "epsilon"), "parameterization"
    scaling = params.get("denoiser_config")
    for key in ("params", "scaling_config", "target"):
        scaling = scaling.get(key) if isinstance(scaling, dict) else None
    name = str(scaling or "").rsplit(".", 1)[-1]
    if name in ("VScaling", "EpsScaling"):
        return ("v_prediction" if name == "VScaling" else "epsilon"), f"scaling_config {name}"
    return "epsilon", ""


def tensor_std(path: Path, key: str) -> float | None:
    """The standard deviation of one float tensor of a checkpoint, read from its bytes with numpy (no torch):
    a .safetensors's at its header's offsets, a torch zip .ckpt's from its ``data/<key>`` entry
    (:func:`.ckpt_reader.read_ckpt_tensor`); F32, F16, BF16 (and F64 in a .ckpt). None where the file lacks
    it, stores another dtype or cannot be read so."""
    import numpy as np

    if not is_safetensors_name(path):
        found = read_ckpt_tensor(path, key)
        if found is None:
            return None
        dtype, raw = found
    else:
        try:
            with path.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                entry = json.loads(f.read(n)).get(key)
                if not isinstance(entry, dict):
                    return None
                start, end = entry["data_offsets"]
                f.seek(8 + n + int(start))
                raw = f.read(int(end) - int(start))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        dtype = entry.get("dtype")
    if dtype == "BF16":  # numpy has no bfloat16: its 16 bits are a float32's high half
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype in ("F32", "F16", "F64"):
        values = np.frombuffer(raw, dtype={"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype])
    elif dtype in _FP8:  # numpy has no fp8: each byte's value from a table (an fp8 checkpoint, kept so)
        values = _fp8_values(*_FP8[dtype])[np.frombuffer(raw, dtype=np.uint8)]
    else:
        return None
    std = float(np.asarray(values, dtype=np.float64).std()) if values.size else None
    return std if std is not None and math.isfinite(std) else None


# safetensors' fp8 dtypes: (exponent bits, mantissa bits, exponent bias); E4M3 is torch's float8_e4m3fn (no
# infinities, its all-ones pattern NaN), E5M2 float8_e5m2 (IEEE-like)
_FP8 = {"F8_E4M3": (4, 3, 7), "F8_E5M2": (5, 2, 15)}


def _fp8_values(exp_bits: int, man_bits: int, bias: int):
    """The 256 values of an fp8 format, by byte."""
    import numpy as np

    b = np.arange(256)
    exp, man = (b >> man_bits) & ((1 << exp_bits) - 1), (b & ((1 << man_bits) - 1)) / (1 << man_bits)
    value = np.where(exp == 0, man * 2.0 ** (1 - bias), (1 + man) * 2.0 ** (exp - bias))
    top = exp == (1 << exp_bits) - 1
    special = top & (man == man.max()) if exp_bits == 4 else top  # E4M3: NaN; E5M2: inf and NaN
    return np.where(special, np.nan, np.where(b & 0x80, -value, value))


def sd2_v_from_weights(norm_bias) -> bool:
    """ComfyUI's test for an SD 2.x checkpoint without a config: v-prediction when the std of the last output
    block's first norm bias exceeds 0.09 (``SD20.model_type``)."""
    return float(norm_bias.float().std(unbiased=False)) > SD2_V_STD


SD2_V_STD = 0.09  # ComfyUI supported_models.SD20.model_type: the probe's std above it is v-prediction


def check_file(
    path: Path, where: str, *, family: str | None = None, config_dir: str | None = None, deep: bool = False
) -> SourceInfo:
    """A single checkpoint, classified from its tensor names and shapes without torch: a .safetensors's from
    its header, a pickled .ckpt's from its pickle (:mod:`.ckpt_reader`, nothing in it runs). A .ckpt that
    reader cannot read (an old non-zip pickle, a torch global it does not model) is classified only with
    ``deep`` (the trainer, loading it with torch ``weights_only``); otherwise ``unread`` says why.
    ``config_dir`` must be a diffusers folder of the same network kind."""
    if config_dir is None and family is not None and registry.family(family).flow:
        raise _needs_config_dir(where, family)
    shapes: dict[str, tuple[int, ...]] = {}
    if is_safetensors_name(path):  # .sft too: its header says whether it is one
        shapes, metadata = read_safetensors_header(path, where)
        info = classify_state(shapes, metadata, path, where, family=family)
    else:
        try:
            shapes = read_ckpt_shapes(path, f"model.path {where}")
        except Unreadable as e:
            if not deep:
                info = SourceInfo("file", str(path), family=family, unread=str(e))
                info.notes.append(
                    f"its keys cannot be read without loading it: {e}; it is checked when it loads"
                )
            else:  # the trainer: load it (torch, weights_only) and classify what it holds
                from .single_file import read_checkpoint_safely

                state = read_checkpoint_safely(path)
                shapes = {k: tuple(getattr(v, "shape", ())) for k, v in state.items() if isinstance(k, str)}
                info = classify_state(shapes, {}, path, where, family=family)
        else:
            info = classify_state(shapes, {}, path, where, family=family)
    flow = info.prediction_type == "flow_matching"
    if config_dir is not None:
        from sdplan.config import expand_user

        cdir = Path(expand_user(config_dir, "model.config_dir"))
        cwhere = f"model.config_dir {config_dir}"
        if not cdir.exists():
            from .models import looks_like_hub_id

            fix = "point it at the diffusers folder of the checkpoint's model"
            if looks_like_hub_id(config_dir):  # configs/nope (a mistyped folder) reads as one as well
                # diffusers' from_single_file(config=) would take a hub id: sdplan takes a local folder only
                raise UsageError(
                    f"{cwhere}: no such folder",
                    fix=f"{fix}; if {config_dir} is a hub id: model.config_dir takes a local folder "
                    f"(`hf download {config_dir} --local-dir DIR`, then model.config_dir=DIR)",
                )
            raise UsageError(f"{cwhere}: no such folder", fix=fix)
        if not (cdir / "model_index.json").is_file():
            raise UnsupportedModelError(
                f"{cwhere}: not a diffusers folder (no model_index.json)",
                fix="point it at the diffusers folder of the checkpoint's model, or leave it out",
            )
        index = _read_json(cdir, "model_index.json", cwhere)
        cls = str(index.get("_class_name") or "")
        if flow and cls not in FLOW_PIPELINES:
            raise UnsupportedModelError(
                f"{cwhere}: a {cls or 'unnamed'} folder, but {where} is an SD3.5 / FLUX.1 transformer",
                fix="point it at a StableDiffusion3Pipeline or FluxPipeline folder of the same model",
            )
        theirs = flow_family_of_folder(cdir) if flow else None
        if theirs is not None and info.family is not None and theirs != info.family:
            # its transformer config is the one the file loads with: another one drops or misses weights
            raise UnsupportedModelError(
                f"{cwhere} is a {theirs} folder but {where} is a {info.family} transformer",
                fix=f"point model.config_dir at a {info.family} diffusers folder: the file loads with its configs",
            )
        tfile = cdir / "transformer" / "config.json"
        if flow and shapes and tfile.is_file():
            differs = _mmdit_mismatch(shapes, _read_json(cdir, "transformer/config.json", cwhere))
            if differs:  # SD3 Medium vs SD3.5 Medium: one family label, two networks
                raise UnsupportedModelError(
                    f"{cwhere} does not describe {where}'s transformer: {differs}",
                    fix="point model.config_dir at the diffusers folder of the file's own model (SD3 Medium: "
                    "stabilityai/stable-diffusion-3-medium-diffusers; SD3.5 Medium: "
                    "stabilityai/stable-diffusion-3.5-medium)",
                )
        parts: dict[str, tuple[str, str, bool]] = {}
        if flow and info.family is not None:  # an all-in-one file: its own text encoders and VAE load
            arch = registry.family(info.family).arch
            parts = file_parts(shapes, arch)
            _check_file_parts(shapes, parts, cdir, where, cwhere)
            info.parts_note = file_parts_note(parts, arch)
            info.notes.append(info.parts_note)
        if not flow and cls not in UNET_PIPELINES:
            raise UnsupportedModelError(
                f"{cwhere}: a {cls or 'unnamed'} folder, but {where} is an SD 1.x / 2.x / SDXL checkpoint",
                fix="point it at a diffusers folder of the same family as the checkpoint",
            )
        if not flow and info.family is not None:
            ufile = cdir / "unet" / "config.json"
            if ufile.is_file():
                uconf = _read_json(cdir, "unet/config.json", cwhere)
                theirs = detect_family(uconf, 2 if "text_encoder_2" in index else 1)
                tiny = cross_attention_width(uconf) not in CROSS_WIDTHS
                if theirs != info.family and not (tiny and {theirs, info.family} <= {"sd15", "sd21"}):
                    raise UnsupportedModelError(
                        f"{cwhere} is an {theirs} folder but {where} is an {info.family} checkpoint",
                        fix="point model.config_dir at a diffusers folder of the same family, or leave it out",
                    )
        _check_config_dir_files(cdir, index, parts if flow else None, info.family, where, cwhere)
    elif flow:
        raise _needs_config_dir(where, info.family)
    info.notes.insert(0, describe(info))
    return info


def _check_config_dir_files(
    cdir: Path,
    index: dict[str, Any],
    parts: dict[str, tuple[str, str, bool]] | None,
    family: str | None,
    where: str,
    cwhere: str,
) -> None:
    """What a single file loads from model.config_dir is there: every component's config, the tokenizers (with
    their tokenizer_config.json) and the scheduler's config, as diffusers' ``from_single_file(config=)`` reads
    them; for an SD3.5 / FLUX.1 file (``parts``: the text encoders and VAE it holds,
    :func:`.flow_models.file_parts`) also the weights of each one it lacks or holds quantized, which load from
    the folder. A configs-only folder passed and the trainer failed after the launch (OSError: no file named
    diffusion_pytorch_model.bin; OverflowError for a tokenizer without its max length)."""
    cls = str(index.get("_class_name") or "")
    arch = FLOW_PIPELINES.get(cls, "unet")
    hub = _hub_id(family)
    get = f"`hf download {hub or '<its hub id>'} --include '*.json' '*.txt' '*.model' --local-dir DIR`"
    lacks = _single_file_configs_lacking(cdir, arch == "unet" and "text_encoder_2" in index, arch)
    if lacks:
        more = f" and {len(lacks) - 1} more" if len(lacks) > 1 else ""
        raise UnsupportedModelError(
            f"{cwhere}: lacks {lacks[0]}{more}, which {where} loads with",
            fix=f"point it at the complete diffusers folder of the file's model (its configs alone: {get})",
        )
    if parts is None:
        return
    labels = {"text_encoder": "CLIP-L", "vae": "VAE"} | (
        {"text_encoder_2": "T5"} if arch == "flux" else {"text_encoder_2": "CLIP-G", "text_encoder_3": "T5"}
    )
    absent: list[tuple[str, str]] = []
    for sub, kind in _components(arch, False):
        if kind != "model" or sub == "transformer" or (sub in parts and not parts[sub][2]):
            continue
        folder = cdir / sub
        why = "the file's is quantized, which diffusers does not read" if sub in parts else "none in the file"
        if None not in weight_variants(folder):  # loaded without a variant: plain names only
            absent.append((sub, f"{labels[sub]} ({sub}/: {why})"))
            continue
        problems = _missing_shards(folder, sub, None) + _truncated(folder, sub, None)
        if problems:
            raise UnsupportedModelError(
                f"{cwhere}: {problems[0]}, and {where}'s {labels[sub]} loads from it ({why})",
                fix="download that part of the folder again",
            )
    if absent:
        subs = " ".join(f"'{sub}/*'" for sub, _ in absent)
        raise UnsupportedModelError(
            f"{cwhere}: holds no weights for the parts {where} does not give: "
            + ", ".join(said for _, said in absent),
            fix=f"download them into it (`hf download {hub or '<its hub id>'} --include {subs} --local-dir "
            f"{cdir}`), or give a single file that holds them",
        )


def _hub_id(family: str | None) -> str | None:
    """The hub id of a family's base model (profiles/models), for a fix's `hf download`."""
    from sdplan.profiles import load_profiles

    model = load_profiles().models.get(family or "")
    return model.hub_ids[0] if model is not None and model.hub_ids else None


def _check_file_parts(
    shapes: dict[str, tuple[int, ...]],
    parts: dict[str, tuple[str, str, bool]],
    cdir: Path,
    where: str,
    cwhere: str,
) -> None:
    """An all-in-one file's text encoders and VAE load with model.config_dir's configs: an encoder of another
    width (CLIP's token embedding against ``hidden_size``, T5's against ``d_model``) or a VAE of other latent
    channels (its encoder's ``conv_out``, mean and variance, against ``latent_channels``) is one line here, not
    a shape error in the trainer after the transformer loaded; so is an encoder of another depth (its layers
    in the file against ``num_hidden_layers`` / ``num_layers``): diffusers skips the keys of the layers a
    shallower config lacks, so a deeper encoder was cut short silently."""
    for sub, (label, prefix, quantized) in parts.items():
        conf_file = cdir / sub / "config.json"
        if quantized or not conf_file.is_file():
            continue
        conf = _read_json(cdir, f"{sub}/config.json", cwhere)
        if sub == "vae":
            have = (shapes.get(f"{prefix}encoder.conv_out.weight") or (0,))[0] // 2
            checks = [(have, conf.get("latent_channels"), f"has {have} latent channels,")]
        else:
            t5 = label == "T5"
            embed = prefix + ("shared.weight" if t5 else "text_model.embeddings.token_embedding.weight")
            width = (shapes.get(embed) or (0, 0))[-1]
            block = prefix + ("encoder.block." if t5 else "text_model.encoder.layers.")
            depth = len({k[len(block) :].split(".")[0] for k in shapes if k.startswith(block)})
            checks = [
                (width, conf.get("d_model" if t5 else "hidden_size"), f"is {width} wide,"),
                (depth, conf.get("num_layers" if t5 else "num_hidden_layers"), f"has {depth} layers,"),
            ]
        for have, want, said in checks:
            if have and want and have != want:
                raise UnsupportedModelError(
                    f"{cwhere} does not describe {where}'s own {label}: the file's {said} "
                    f"{sub}/config.json says {want}",
                    fix="point model.config_dir at the diffusers folder of the file's own model",
                )


def _mmdit_mismatch(shapes: dict[str, tuple[int, ...]], config: dict[str, Any]) -> str | None:
    """How an SD3 / SD3.5 transformer file differs from the transformer config it would load with (None: it
    does not, or it is no MMDiT): which blocks have the dual attention (``x_block.attn2``) against
    ``dual_attention_layers``, the qk-norm (``x_block.attn.ln_q``) against ``qk_norm``, the positions of
    ``pos_embed`` against ``pos_embed_max_size`` squared (diffusers' defaults where the config leaves them out).
    SD3 Medium and SD3.5 Medium are both planned as sd35-medium, but are other networks: diffusers tells them
    apart by ``pos_embed`` (36864 vs 147456 positions), the 3.5 file adds qk-norm and 13 dual-attention blocks."""
    plain = {k[len(UNET) :] if k.startswith(UNET) else k: v for k, v in shapes.items()}
    blocks = [k for k in plain if k.startswith("joint_blocks.")]
    if not blocks:
        return None
    dual = sorted(
        {int(k.split(".")[1]) for k in blocks if ".x_block.attn2." in k and k.split(".")[1].isdigit()}
    )
    theirs = sorted(int(i) for i in config.get("dual_attention_layers") or ())
    if dual != theirs:
        return (
            f"the file has dual attention (x_block.attn2) in {len(dual)} blocks, the folder's transformer config "
            f"in {len(theirs)} (dual_attention_layers)"
        )
    qk = any(".x_block.attn.ln_q." in k for k in blocks)
    if qk != (config.get("qk_norm") is not None):
        return (
            f"the file {'has' if qk else 'has no'} qk-norm (x_block.attn.ln_q), the folder's transformer config "
            f"{'has none' if qk else 'has it'} (qk_norm)"
        )
    pos = plain.get("pos_embed") or ()
    size = int(config.get("pos_embed_max_size") or 96)  # SD3Transformer2DModel's default
    if len(pos) == 3 and pos[1] != size * size:
        return (
            f"the file's pos_embed holds {pos[1]:,} positions, the folder's transformer config {size * size:,} "
            f"(pos_embed_max_size {size})"
        )
    return None


def _needs_config_dir(where: str, family: str | None) -> UsageError:
    """The line for an SD3.5 / FLUX.1 single file without model.config_dir: the folder gives its configs and
    tokenizers, and the weights of whatever the file does not hold (a transformer-only file: its text encoders
    and VAE; an all-in-one file: none, its own load)."""
    hub = _hub_id(family) or "stabilityai/stable-diffusion-3.5-medium"
    return UsageError(
        f"model.path {where}: a single {family or 'SD3.5/FLUX.1'} file needs model.config_dir",
        fix="set model.config_dir to a local diffusers folder of the same model: its configs and tokenizers load "
        "with the file, and so do its text encoders and VAE where the file holds none (a transformer-only "
        "file); for an all-in-one file its configs alone do "
        f"(`hf download {hub} --include '*.json' '*.txt' '*.model' --local-dir DIR`)",
    )


# -- any source ------------------------------------------------------------------------------------------------


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local Hugging Face cache's snapshot folder of a hub model, without the network; None when the
    cache does not hold it."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or no usable cache
        return None
    folder = Path(folder)
    return folder if (folder / "model_index.json").is_file() else None


# The hub model whose component configs and tokenizers diffusers' ``from_single_file`` fetches for a single file
# of each family sdplan trains from one, where no model.config_dir is given (diffusers'
# ``DIFFUSERS_DEFAULT_PIPELINE_PATHS`` for its model types "v1", "v2" and "xl_base"; inpainting, refiner and EDM
# files are refused before). SD3.5 / FLUX.1 single files need model.config_dir (``check_file``).
SINGLE_FILE_CONFIGS = {
    "sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5",
    "sd21": "stabilityai/stable-diffusion-2-1",
    "sdxl": "stabilityai/stable-diffusion-xl-base-1.0",
}


def single_file_configs(
    kind: str, family: str | None, config_dir: str | None, *, ask: bool = False, where: str = ""
) -> str | None:
    """For a single file (``kind`` "file") of ``family`` without ``config_dir``, whose component configs come from
    the hub at its load: None where the local cache holds them (or there is nothing to fetch); else the line
    saying they are not here (``recommend`` warns with it). ``ask``: the hub is asked once, quickly
    (:func:`.models.ask_hub`), and a hub that cannot be reached is the one-line error (``sdplan train`` before
    its launch; the trainer failed there about 11 s after it), a hub that answers is None. ``where``: the
    model.path the error names."""
    repo = SINGLE_FILE_CONFIGS.get(family or "") if kind == "file" and config_dir is None else None
    if repo is None:
        return None
    snap = cached_snapshot(repo)
    lacks = _single_file_configs_lacking(snap, family == "sdxl") if snap is not None else None
    if snap is not None and not lacks:
        return None
    line = (
        f"a single file's component configs and tokenizers come from the Hugging Face hub ({repo}) at its "
        "first load, and the local cache does not hold them"
        + (f" all (no {lacks[0]}{f' and {len(lacks) - 1} more' if len(lacks) > 1 else ''})" if lacks else "")
    )
    fix = (
        "set model.config_dir to a local diffusers folder of the same family (then nothing is downloaded), "
        "or run once with network access"
    )
    if not ask:
        return f"{line}: set model.config_dir or train with network access once"
    from .models import HubUnreachable, ModelLoadError, ask_hub

    try:
        ask_hub(repo, "model_index.json", None, cache="the local cache does not hold it")
    except HubUnreachable as e:
        at = f"model.path {where}: " if where else ""
        raise ModelLoadError(f"{at}{line}, and the hub cannot be reached ({e.why})", fix=fix) from None
    return None


def _single_file_configs_lacking(snap: Path, sdxl: bool, arch: str = "unet") -> list[str]:
    """What of the files diffusers' ``from_single_file`` reads from a family's default repo (its
    ``_download_diffusers_model_config_from_hub``: every ``*.json``, ``*.txt`` and ``*.model``; the text encoders',
    VAE's and UNet's configs, the tokenizers and their tokenizer_config.json, the scheduler's config) its cached
    snapshot ``snap``, or a model.config_dir, lacks. A cache holding only model_index.json, the UNet's and the
    scheduler's configs (what :func:`check_hub` keeps of a hub model it checked) is not enough: offline,
    transformers then builds a default 512-wide CLIP config and the load fails on a shape mismatch."""
    return [
        f"{sub}/{lacks[0]}"
        for sub, kind in _components(arch, sdxl)
        if (lacks := _config_lacks(snap / sub, kind))
    ]


def check_hub(
    repo_id: str, where: str, *, family: str | None, variant: str | None, revision: str | None
) -> SourceInfo:
    """A hub model the local cache does not hold whole, checked as a folder is from its configs alone:
    model_index.json, its UNet's or transformer's config and its scheduler's (a few KB, kept in the cache,
    where the load finds them), not its weights. So an inpainting model, a refiner, another family or a
    model.family that does not match is one line before gigabytes download, and the plan knows the family
    of a hub id whose name does not say it. The hub's answer (gated, not found, no network, offline) is one
    line too (:func:`.models.hub_file`)."""
    from .models import hub_file

    index_file = hub_file(repo_id, "model_index.json", revision)
    assert index_file is not None
    index = _read_json(index_file.parent, "model_index.json", where)
    denoiser = "transformer" if index.get("_class_name") in FLOW_PIPELINES else "unet"
    for name in (f"{denoiser}/config.json", "scheduler/scheduler_config.json"):
        hub_file(repo_id, name, revision, optional=True)
    info = check_folder(index_file.parent, where, family=family, variant=variant, files=False)
    info.kind, info.location = "hub", repo_id
    info.notes[0] = describe(info)
    return info


def check_source(
    path: str,
    *,
    family: str | None = None,
    variant: str | None = None,
    config_dir: str | None = None,
    revision: str | None = None,
    deep: bool = False,
    hub: bool = False,
) -> SourceInfo:
    """Everything that can be told about ``model.path`` from its files, before anything loads: one clear
    :class:`UnsupportedModelError` (or ``UsageError`` for a missing path) otherwise. A hub id is checked where
    the local cache holds it whole (then ``location`` is its snapshot folder and it loads from there, with no
    network); otherwise from its configs on the hub with ``hub`` (:func:`check_hub`: ``sdplan train`` and the
    trainer, which download it anyway, and ``recommend`` for a family it cannot tell offline), else not. ``deep``: also load a pickled checkpoint the torch-free
    reader cannot read (torch; the trainer does, ``sdplan train`` before the launch does not)."""
    from .models import resolve_source

    source = resolve_source(path)
    if source.kind == "folder":
        return check_folder(Path(source.location), path, family=family, variant=variant)
    if source.kind == "file":
        return check_file(Path(source.location), path, family=family, config_dir=config_dir, deep=deep)
    snap = cached_snapshot(source.location, revision)
    if snap is not None:
        try:
            info = check_folder(snap, path, family=family, variant=variant)
        except UnsupportedModelError as e:
            if "incomplete diffusers folder" not in str(e):
                raise
        else:  # whole in the cache: load it from there
            info.kind, info.cached = "hub", True
            info.notes[0] = describe(info)
            return info
    if hub:
        return check_hub(source.location, path, family=family, variant=variant, revision=revision)
    return SourceInfo("hub", source.location, family=family)
