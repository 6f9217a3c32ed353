"""Count the parameters of each model family from the configs shipped in profiles/models/.

Builds every family's UNet or transformer (SD3.5: SD3Transformer2DModel, FLUX.1: FluxTransformer2DModel),
text encoder(s) (CLIP, OpenCLIP bigG, T5-XXL encoder) and VAE with the real diffusers / transformers
constructors on the meta device (accelerate's ``init_empty_weights``): no weights are allocated
or downloaded, and the counts are exact. Prints them, checks them against the figures published in
the field notes and by the model publishers and against the ``params:`` line of each YAML, and exits
non-zero on a mismatch.

    python scripts/count_params.py            # print and check
    python scripts/count_params.py --write    # also rewrite the params: line of each YAML
    python scripts/count_params.py sdxl       # only some families
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from sdplan import registry

MODELS_DIR = Path(__file__).resolve().parents[1] / "profiles" / "models"
FAMILIES = registry.FAMILIES  # every family with a profile in profiles/models

# Published figures (../shared/reference/field-notes.md, section 2). A family's computed counts
# must equal these; counts with no published figure are only recorded.
PUBLISHED: dict[str, dict[str, Any]] = {
    "sd15": {"unet": 859_520_964, "text_encoders": [123_060_480], "vae": 83_653_863},
    "sdxl": {"unet": 2_567_463_684, "text_encoders_total": 817_720_320, "vae": 83_653_863},
    # SD 2.x: the VAE is SD1's architecture; the field notes give no UNet / text-encoder figure.
    "sd21": {"vae": 83_653_863},
}

# Figures published for the transformer families: (value, tolerance = half a unit of the last digit given,
# source). An exact figure (a bf16 weight index's byte total / 2) gets tolerance 0. Published transformer sizes
# include SD3's positional table, a persistent buffer (pos_embed.pos_embed): compared as params + buffers.
CLIP_L_TEXT = 123_060_480  # field notes, section 2 (CLIPTextModel)
CLIP_L_WITH_PROJECTION = CLIP_L_TEXT + 768 * 768  # derived: SD3 loads CLIP-L with its 768 x 768 projection
CLIP_G_WITH_PROJECTION = 694_659_840  # derived in the field notes: SDXL's text encoders minus CLIP-L
ISSUE = "issue 14 brief"
T5_XXL_ENCODER = (4.76e9, 0.005e9, f"T5-XXL encoder ~4.76B ({ISSUE})")
VAE_16CH = (84e6, 0.5e6, f"16-channel VAE ~84M ({ISSUE})")
PUBLISHED_APPROX: dict[str, dict[str, Any]] = {
    "sd35-medium": {
        "transformer": (2.5e9, 0.05e9, f"SD3.5 Medium MMDiT-X ~2.5B ({ISSUE})"),
        "text_encoders": [CLIP_L_WITH_PROJECTION, CLIP_G_WITH_PROJECTION, T5_XXL_ENCODER],
        "vae": VAE_16CH,
    },
    "sd35-large": {
        # ~8.1B (issue 14 brief); exact: the Large Turbo transformer weight index
        # (huggingface.co/adamo1139/stable-diffusion-3.5-large-turbo-ungated, transformer/
        # diffusion_pytorch_model.safetensors.index.json, a copy of the gated repo) totals 16,292,561,536 bytes
        "transformer": (16_292_561_536 // 2, 0, "SD3.5 Large Turbo bf16 weight index total_size / 2"),
        "text_encoders": [CLIP_L_WITH_PROJECTION, CLIP_G_WITH_PROJECTION, T5_XXL_ENCODER],
        "vae": VAE_16CH,
    },
    "flux-dev": {
        "transformer": (12e9, 0.5e9, f"FLUX.1 transformer ~12B ({ISSUE})"),
        "text_encoders": [CLIP_L_TEXT, T5_XXL_ENCODER],
        "vae": VAE_16CH,
    },
    "flux-schnell": {
        "transformer": (12e9, 0.5e9, f"FLUX.1 transformer ~12B ({ISSUE})"),
        "text_encoders": [CLIP_L_TEXT, T5_XXL_ENCODER],
        "vae": VAE_16CH,
    },
}

TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")
TRANSFORMER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel")
PARAMS_LINE = re.compile(r"^params:.*$", re.MULTILINE)
BUFFERS_LINE = re.compile(r"^buffers:.*$", re.MULTILINE)


def load_family(family: str, models_dir: Path = MODELS_DIR) -> dict[str, Any]:
    path = models_dir / f"{family}.yaml"
    with path.open() as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


def denoiser_key(spec: dict[str, Any]) -> str:
    """ "transformer" for the SD3.5 / FLUX.1 families, "unet" for the SD1/SD2/SDXL ones."""
    return "transformer" if "transformer" in spec else "unet"


def build_text_encoder(entry: dict[str, Any]) -> Any:
    """One text encoder from its profile entry (call inside ``init_empty_weights``, then ``tie_weights()``
    outside it: T5's encoder.embed_tokens is tied to ``shared`` as from_pretrained does, which does not happen
    under init_empty_weights, and the 32128 x 4096 embedding would count twice)."""
    import transformers

    if entry["class"] not in TEXT_ENCODER_CLASSES:
        raise ValueError(f"text encoder class {entry['class']!r} not in {TEXT_ENCODER_CLASSES}")
    config_class = (
        transformers.T5Config if entry["class"] == "T5EncoderModel" else transformers.CLIPTextConfig
    )
    return getattr(transformers, entry["class"])(config_class(**entry["config"]))


def build_transformer(entry: dict[str, Any]) -> Any:
    """An SD3 / FLUX transformer from its profile entry (call inside ``init_empty_weights``)."""
    import diffusers

    if entry["class"] not in TRANSFORMER_CLASSES:
        raise ValueError(f"transformer class {entry['class']!r} not in {TRANSFORMER_CLASSES}")
    return getattr(diffusers, entry["class"]).from_config(dict(entry["config"]))


def build(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the family's networks on the meta device: {"unet" or "transformer", "text_encoders": [...], "vae"}."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity_error()
    key = denoiser_key(spec)
    # the transformers' persistent buffers (SD3's 384^2 x 1536 positional table) go on meta too
    with init_empty_weights(include_buffers=key == "transformer"):
        if key == "unet":
            denoiser = UNet2DConditionModel.from_config(spec["unet"])
        else:
            denoiser = build_transformer(spec["transformer"])
    with init_empty_weights():
        encoders = [build_text_encoder(te) for te in spec["text_encoders"]]
        vae = AutoencoderKL.from_config(spec["vae"])
    for encoder in encoders:
        encoder.tie_weights()
    return {key: denoiser, "text_encoders": encoders, "vae": vae}


def numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def persistent_buffer_numel(module: Any) -> int:
    """Elements of the persistent buffers (saved in the checkpoint, held in memory like frozen weights):
    SD3's fixed positional-embedding table (pos_embed.pos_embed, 192^2 or 384^2 positions x width)."""
    total = 0
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                total += buf.numel()
    return total


def count_buffers(spec: dict[str, Any]) -> dict[str, int]:
    """Persistent buffer elements of the denoiser, in the shape of the YAML's ``buffers:`` mapping."""
    key = denoiser_key(spec)
    return {key: persistent_buffer_numel(build(spec)[key])}


def count(spec: dict[str, Any]) -> dict[str, Any]:
    """Parameter counts in the shape of the YAML's ``params:`` mapping."""
    nets = build(spec)
    key = denoiser_key(spec)
    return {
        key: numel(nets[key]),
        "text_encoders": [numel(te) for te in nets["text_encoders"]],
        "vae": numel(nets["vae"]),
    }


def check_published(family: str, counts: dict[str, Any], buffers: dict[str, int] | None = None) -> list[str]:
    """Differences between computed counts and the published figures (empty when all agree). Published
    transformer sizes count the persistent buffers too (SD3's positional table is in the checkpoint)."""
    errors = []
    for key, want in PUBLISHED.get(family, {}).items():
        got = sum(counts["text_encoders"]) if key == "text_encoders_total" else counts[key]
        if got != want:
            errors.append(f"{family}: {key} computed {got!r}, field notes say {want!r}")
    for key, want in PUBLISHED_APPROX.get(family, {}).items():
        extra = (buffers or {}).get(key, 0)
        pairs = zip(counts[key], want) if key == "text_encoders" else [(counts[key] + extra, want)]
        for got, fig in pairs:
            value, tol, source = fig if isinstance(fig, tuple) else (fig, 0, "exact")
            if abs(got - value) > tol:
                errors.append(
                    f"{family}: {key} computed {got:,}, published {value:,.0f} +- {tol:,.0f} ({source})"
                )
    return errors


def check_recorded(
    family: str, spec: dict[str, Any], counts: dict[str, Any], buffers: dict[str, int] | None = None
) -> list[str]:
    errors = []
    recorded = spec.get("params")
    if recorded != counts:
        errors.append(f"{family}: params: in the YAML is {recorded!r}, computed {counts!r}")
    if buffers and spec.get("buffers") != buffers:
        errors.append(f"{family}: buffers: in the YAML is {spec.get('buffers')!r}, computed {buffers!r}")
    return errors


def format_params(counts: dict[str, Any]) -> str:
    encoders = ", ".join(str(n) for n in counts["text_encoders"])
    key = "transformer" if "transformer" in counts else "unet"
    return f"params: {{{key}: {counts[key]}, text_encoders: [{encoders}], vae: {counts['vae']}}}"


def format_buffers(buffers: dict[str, int]) -> str:
    return "buffers: {" + ", ".join(f"{k}: {v}" for k, v in buffers.items()) + "}"


def write_params(path: Path, counts: dict[str, Any], buffers: dict[str, int] | None = None) -> bool:
    """Rewrite the single-line ``params:`` (and ``buffers:``) entries in place (comments kept). True when changed."""
    text = path.read_text()
    line = format_params(counts)
    if PARAMS_LINE.search(text):
        new = PARAMS_LINE.sub(line, text, count=1)
    else:
        new = text.rstrip("\n") + "\n" + line + "\n"
    if buffers:
        bline = format_buffers(buffers)
        if BUFFERS_LINE.search(new):
            new = BUFFERS_LINE.sub(bline, new, count=1)
        else:
            new = PARAMS_LINE.sub(lambda m: m.group(0) + "\n" + bline, new, count=1)
    if new != text:
        path.write_text(new)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES), help="default: all")
    parser.add_argument("--write", action="store_true", help="rewrite params: in each YAML")
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    args = parser.parse_args(argv)

    failures: list[str] = []
    for family in args.families:
        spec = load_family(family, args.models_dir)
        counts = count(spec)
        buffers = count_buffers(spec) if denoiser_key(spec) == "transformer" else None
        key = denoiser_key(spec)
        total = counts[key] + sum(counts["text_encoders"]) + counts["vae"]
        encoders = " + ".join(f"{n:,}" for n in counts["text_encoders"])
        print(
            f"{family:12}  {key} {counts[key]:>14,}  text encoders {encoders}"
            f"  vae {counts['vae']:,}  total {total:,}"
        )
        if buffers:
            print(f"{'':12}  persistent buffers {buffers}")
        failures += check_published(family, counts, buffers)
        if args.write:
            if write_params(args.models_dir / f"{family}.yaml", counts, buffers):
                print(f"       wrote params: to {args.models_dir / f'{family}.yaml'}")
        else:
            failures += check_recorded(family, spec, counts, buffers)
    for line in failures:
        print(f"MISMATCH {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
