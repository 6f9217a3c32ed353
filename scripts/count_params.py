"""Count the parameters of each model family from the configs shipped in profiles/models/.

Builds every family's UNet, text encoder(s) and VAE with the real diffusers / transformers
constructors on the meta device (accelerate's ``init_empty_weights``): no weights are allocated
or downloaded, and the counts are exact. Prints them, checks them against the figures published in
the field notes and against the ``params:`` line of each YAML, and exits non-zero on a mismatch.

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

MODELS_DIR = Path(__file__).resolve().parents[1] / "profiles" / "models"
FAMILIES = ("sd15", "sd21", "sdxl")

# Published figures (../shared/reference/field-notes.md, section 2). A family's computed counts
# must equal these; counts with no published figure are only recorded.
PUBLISHED: dict[str, dict[str, Any]] = {
    "sd15": {"unet": 859_520_964, "text_encoders": [123_060_480], "vae": 83_653_863},
    "sdxl": {"unet": 2_567_463_684, "text_encoders_total": 817_720_320, "vae": 83_653_863},
    # SD 2.x: the VAE is SD1's architecture; the field notes give no UNet / text-encoder figure.
    "sd21": {"vae": 83_653_863},
}

TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection")
PARAMS_LINE = re.compile(r"^params:.*$", re.MULTILINE)


def load_family(family: str, models_dir: Path = MODELS_DIR) -> dict[str, Any]:
    path = models_dir / f"{family}.yaml"
    with path.open() as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


def build(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the family's networks on the meta device: {"unet", "text_encoders": [...], "vae"}."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    classes = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(spec["unet"])
        encoders = []
        for i, te in enumerate(spec["text_encoders"]):
            if te["class"] not in classes:
                raise ValueError(f"text_encoders[{i}].class: {te['class']!r} not in {TEXT_ENCODER_CLASSES}")
            encoders.append(classes[te["class"]](CLIPTextConfig(**te["config"])))
        vae = AutoencoderKL.from_config(spec["vae"])
    return {"unet": unet, "text_encoders": encoders, "vae": vae}


def numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def count(spec: dict[str, Any]) -> dict[str, Any]:
    """Parameter counts in the shape of the YAML's ``params:`` mapping."""
    nets = build(spec)
    return {
        "unet": numel(nets["unet"]),
        "text_encoders": [numel(te) for te in nets["text_encoders"]],
        "vae": numel(nets["vae"]),
    }


def check_published(family: str, counts: dict[str, Any]) -> list[str]:
    """Differences between computed counts and the field-notes figures (empty when all agree)."""
    errors = []
    for key, want in PUBLISHED.get(family, {}).items():
        got = sum(counts["text_encoders"]) if key == "text_encoders_total" else counts[key]
        if got != want:
            errors.append(f"{family}: {key} computed {got!r}, field notes say {want!r}")
    return errors


def check_recorded(family: str, spec: dict[str, Any], counts: dict[str, Any]) -> list[str]:
    recorded = spec.get("params")
    if recorded != counts:
        return [f"{family}: params: in the YAML is {recorded!r}, computed {counts!r}"]
    return []


def format_params(counts: dict[str, Any]) -> str:
    encoders = ", ".join(str(n) for n in counts["text_encoders"])
    return f"params: {{unet: {counts['unet']}, text_encoders: [{encoders}], vae: {counts['vae']}}}"


def write_params(path: Path, counts: dict[str, Any]) -> bool:
    """Rewrite the single-line ``params:`` entry in place (comments kept). True when changed."""
    text = path.read_text()
    line = format_params(counts)
    if PARAMS_LINE.search(text):
        new = PARAMS_LINE.sub(line, text, count=1)
    else:
        new = text.rstrip("\n") + "\n" + line + "\n"
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
        total = counts["unet"] + sum(counts["text_encoders"]) + counts["vae"]
        encoders = " + ".join(f"{n:,}" for n in counts["text_encoders"])
        print(
            f"{family:5}  unet {counts['unet']:>13,}  text encoders {encoders}"
            f"  vae {counts['vae']:,}  total {total:,}"
        )
        failures += check_published(family, counts)
        if args.write:
            if write_params(args.models_dir / f"{family}.yaml", counts):
                print(f"       wrote params: to {args.models_dir / f'{family}.yaml'}")
        else:
            failures += check_recorded(family, spec, counts)
    for line in failures:
        print(f"MISMATCH {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
