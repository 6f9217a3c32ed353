"""Run one training from a TrainConfig: pick the method's recipe and call it.

``train(cfg, resume=None)`` returns the run summary (also in ``{output.dir}/run_summary.json``). It raises
SdplanError subclasses for everything the user can fix: DatasetError / UsageError before any model loads,
``common.TrainingInterrupted`` (exit 130) after SIGINT/SIGTERM with a checkpoint written,
``common.OutOfMemoryStop`` (exit 75) with ``{output.dir}/oom.json``, ``common.NonFiniteLoss`` on a NaN loss.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from sdplan.config import TrainConfig
from sdplan.errors import ConfigError

RECIPES = {
    "lora": "lora",
    "dreambooth": "dreambooth",
    "finetune": "finetune",
    "textual-inversion": "textual_inversion",
}


def recipe(method: str):
    if method not in RECIPES:
        raise ConfigError("config", [f"method: must be one of {', '.join(RECIPES)}, got {method!r}"])
    return importlib.import_module(f"sdplan.trainer.recipes.{RECIPES[method]}")


def train(cfg: TrainConfig, *, resume: str | None = None) -> dict:
    """Train ``cfg.method`` as configured; ``resume``: "latest" or a checkpoint folder (overrides
    ``checkpoints.resume``)."""
    module = recipe(cfg.method)
    if os.environ.get("RANK", "0") == "0":  # an OOM report describes the latest run only
        Path(cfg.output.dir, "oom.json").unlink(missing_ok=True)
    return module.train(cfg, resume=resume)
