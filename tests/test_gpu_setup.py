"""benchmarks/gpu_setup.sh (sourced by every benchmarks/gpu_session*.sh): which Python it runs. The README's
`GPU_SESSION_DEMO=1` dry run failed in a clone after `make demo`, its default `python` being the system's, which
has no diffusers (new-user audit, item 11)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_setup.sh"


def _clone(tmp_path: Path, *, venv: bool) -> Path:
    """A clone's layout with a stand-in Python that answers every call (imports, pip) with success."""
    root = tmp_path / "clone"
    (root / "benchmarks").mkdir(parents=True)
    shutil.copy(SETUP, root / "benchmarks" / "gpu_setup.sh")
    if venv:
        py = root / ".venv" / "bin" / "python"
        py.parent.mkdir(parents=True)
        py.write_text("#!/bin/sh\nexit 0\n")
        py.chmod(0o755)
    return root


def _py_chosen(root: Path, **env: str) -> str:
    script = 'source benchmarks/gpu_setup.sh >/dev/null 2>&1; echo "PY=$PY"'
    clean = {k: v for k, v in os.environ.items() if k != "PY"}
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=root,
        env={**clean, "OUT": str(root / "out"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return next(line for line in proc.stdout.splitlines() if line.startswith("PY=")).removeprefix("PY=")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_clones_venv_python_is_the_default(tmp_path):
    root = _clone(tmp_path, venv=True)
    assert _py_chosen(root) == str(root / ".venv" / "bin" / "python")
    stand_in = tmp_path / "mine"
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    assert _py_chosen(root, PY=str(stand_in)) == str(stand_in)  # $PY still wins


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_without_a_venv_it_is_python_as_before(tmp_path):
    root = _clone(tmp_path, venv=False)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "python").chmod(0o755)
    assert _py_chosen(root, PATH=f"{fake_bin}:{os.environ['PATH']}") == "python"
