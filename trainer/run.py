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
    """method -> its Recipe class (what ``sdplan bench`` builds too), from the one method registry: each
    method's module ``sdplan.trainer.recipes.<recipe>`` defines the class whose ``method`` is its name."""
    import importlib

    from sdplan.registry import METHOD_LIST

    found = {}
    for m in METHOD_LIST:
        module = importlib.import_module(f"{__package__}.recipes.{m.recipe}")
        found[m.name] = next(
            v for v in vars(module).values() if isinstance(v, type) and getattr(v, "method", None) == m.name
        )
    return found


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
