"""A Hugging Face hub cache holding the configs, and no weights, of every hub id profiles/models lists: what
`sdplan train` keeps of a hub model after its check before the launch (``source_check.check_hub``). The suite
runs offline (conftest.py); with these, a test that names a real hub id plans its family as on a machine that has
asked the hub once. The configs are the profiles' own copies of the hub files."""

from __future__ import annotations

import json
from pathlib import Path

from sdplan.trainer.source_check import _components

from sdplan.profiles import load_profiles

_PIPELINE = {"unet": "StableDiffusionPipeline", "mmdit": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
_SCHEDULER = {  # the hub repos' scheduler/scheduler_config.json, the keys the check reads
    "sd15": {"_class_name": "PNDMScheduler", "prediction_type": "epsilon"},
    "sd21": {"_class_name": "DDIMScheduler", "prediction_type": "v_prediction"},
    "sdxl": {"_class_name": "EulerDiscreteScheduler", "prediction_type": "epsilon"},
}
COMMIT = "c" * 40


def write_repo(cache: Path, repo_id: str, files: dict[str, dict]) -> Path:
    """One hub repo in huggingface_hub's cache layout (refs/main -> snapshots/<commit>/...); returns the
    snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    for name, data in files.items():
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_text(json.dumps(data))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def configs(family: str) -> dict[str, dict]:
    """model_index.json and the denoiser's and scheduler's configs of a family's hub repo."""
    spec = load_profiles().models[family]
    arch = spec.architecture
    sdxl = family == "sdxl"
    index: dict = {"_class_name": "StableDiffusionXLPipeline" if sdxl else _PIPELINE[arch]}
    for sub, _ in _components(arch, sdxl):
        index[sub] = ["diffusers", sub]
    if arch == "unet":
        denoiser = {"unet/config.json": spec.unet}
        scheduler = _SCHEDULER[family]
    else:
        denoiser = {
            "transformer/config.json": {"_class_name": spec.transformer_class, **(spec.transformer or {})}
        }
        sched = spec.scheduler or {}
        scheduler = {"_class_name": sched.get("class"), **sched.get("config", {})}
    return {"model_index.json": index, **denoiser, "scheduler/scheduler_config.json": scheduler}


def seed(cache: Path) -> None:
    for family, spec in load_profiles().models.items():
        for repo_id in spec.hub_ids:
            write_repo(cache, repo_id, configs(family))
