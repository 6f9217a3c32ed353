"""A script of this repository (benchmarks/, scripts/) loaded as a module, for the tests that call its
functions (they are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str) -> ModuleType:
    """``relative`` (e.g. ``benchmarks/planner_accuracy.py``) under the repository root, as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
