"""Run one training from a TrainConfig: the method's recipe through the one loop (``loop.train``).

``train(cfg, resume=None)`` returns the run summary (also in ``{output.dir}/run_summary.json``). It raises
SdplanError subclasses for everything the user can fix: DatasetError / UsageError before any model loads,
``stops.TrainingInterrupted`` (exit 130) after SIGINT/SIGTERM with a checkpoint written,
``stops.OutOfMemoryStop`` (exit 75) with ``{output.dir}/oom.json``, ``stops.NonFiniteLoss`` on a NaN loss.
"""

from __future__ import annotations

import os
from pathlib import Path

from sdplan.config import TrainConfig
from sdplan.errors import ConfigError


def recipes() -> dict[str, type]:
    """method -> its Recipe class (what ``sdplan bench`` builds too)."""
    from .recipes.dreambooth import DreamBooth
    from .recipes.finetune import Finetune
    from .recipes.lora import LoRA
    from .recipes.textual_inversion import TextualInversion

    return {r.method: r for r in (LoRA, DreamBooth, Finetune, TextualInversion)}


def recipe(method: str) -> type:
    known = recipes()
    if method not in known:
        raise ConfigError("config", [f"method: must be one of {', '.join(known)}, got {method!r}"])
    return known[method]


def train(cfg: TrainConfig, *, resume: str | None = None) -> dict:
    """Train ``cfg.method`` as configured; ``resume``: "latest" or a checkpoint folder (overrides
    ``checkpoints.resume``)."""
    from . import loop

    recipe_cls = recipe(cfg.method)
    if os.environ.get("RANK", "0") == "0":  # an OOM report describes the latest run only
        Path(cfg.output.dir, "oom.json").unlink(missing_ok=True)
    return loop.train(cfg, recipe_cls, resume=resume)
