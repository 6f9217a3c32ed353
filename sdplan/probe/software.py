"""Software probe: Python, torch's build, package versions and the environment variables that matter.

Nothing here imports torch (or any package it reports): versions come from ``importlib.metadata``, and
torch's build (CUDA / ROCm / CPU) from the text of ``torch/version.py``, which the torch build writes with
literal values. Importing ``torch.version`` would run ``torch/__init__.py`` (seconds, gigabytes of shared
libraries), which `sdplan doctor` must not do.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sdplan.machine import Finding, Software, env_of

# Distribution names (as pip knows them) reported in Software.packages, in display order.
PACKAGES = (
    "diffusers",
    "accelerate",
    "transformers",
    "peft",
    "safetensors",
    "deepspeed",
    "bitsandbytes",
    "xformers",
    "amdsmi",
    "nvidia-ml-py",
)


@dataclass(frozen=True)
class TorchBuild:
    """What torch/version.py says, read as text. ``build`` is "cuda", "rocm", "cpu", or None (no torch)."""

    version: str | None = None
    build: str | None = None
    cuda: str | None = None
    hip: str | None = None


def probe_software(*, cuda_driver: str | None = None, rocm: str | None = None) -> Software:
    """Read the software stack once. ``cuda_driver`` and ``rocm`` come from the GPU backends."""
    torch = torch_build()
    return Software(
        python=platform.python_version(),
        torch=torch.version,
        torch_build=torch.build,
        cuda_runtime=torch.cuda,
        hip_runtime=torch.hip,
        cuda_driver=cuda_driver,
        rocm=rocm,
        packages=package_versions(),
    )


def requirement_notes() -> tuple[Finding, ...]:
    """Findings for the installed packages that do not meet sdplan's own requirements (its package metadata,
    i.e. pyproject.toml): a diffusers or transformers older than the trainer needs fails mid-run with an
    error that names neither. None when sdplan runs from a source tree without being installed."""
    try:
        requires = importlib.metadata.requires("sdplan") or []
    except importlib.metadata.PackageNotFoundError:
        return ()
    return unmet_requirements(requires, dist_version)


# Extras whose packages only the developers use: not the user's problem.
DEV_EXTRAS = ("test",)


def unmet_requirements(requires: list[str], version_of) -> tuple[Finding, ...]:
    """One finding per requirement line (``importlib.metadata.requires`` form) that the versions
    ``version_of(name)`` gives do not meet. A required package that is missing is an error; an optional one
    (an extra: deepspeed, bitsandbytes, ...) counts only when it is installed."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    out: list[Finding] = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        marker = str(req.marker) if req.marker else ""
        optional = "extra" in marker
        if any(f'extra == "{extra}"' in marker for extra in DEV_EXTRAS):
            continue
        if req.marker and not optional and not req.marker.evaluate():
            continue  # e.g. a platform-only requirement
        have = version_of(req.name)
        want = f"{req.name}{req.specifier}"
        if have is None:
            if not optional:
                out.append(
                    Finding(
                        "error", "package_missing", f"{req.name} is not installed", f"pip install '{want}'"
                    )
                )
            continue
        try:
            ok = req.specifier.contains(Version(have), prereleases=True)
        except InvalidVersion:
            continue  # a version packaging cannot read: no verdict rather than a wrong one
        if not ok:
            out.append(
                Finding(
                    "error" if not optional else "warning",
                    "package_unmet",
                    f"{req.name} {have} does not meet sdplan's requirement {want}",
                    f"pip install -U '{want}'",
                )
            )
    return tuple(out)


def probe_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    env = os.environ if environ is None else environ
    return env_of(env)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    return {name: dist_version(name) for name in names}


def importable(module: str) -> bool:
    """Whether ``module`` (deepspeed, bitsandbytes) can be imported here, without importing it."""
    return importlib.util.find_spec(module) is not None


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info (no METADATA) must not stop the report
        return None


def torch_build() -> TorchBuild:
    """torch's version and build flavour without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return TorchBuild()
    version_file = None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "version.py"
        if candidate.is_file():
            version_file = candidate
            break
    values = parse_version_py(version_file.read_text()) if version_file else {}
    version = values.get("__version__") or dist_version("torch")
    cuda, hip = values.get("cuda"), values.get("hip")
    if version_file is None or values.get("xpu"):
        build = None  # no version.py, or an Intel XPU build: neither of the kinds sdplan knows
    elif hip or values.get("rocm"):
        build = "rocm"
    elif cuda:
        build = "cuda"
    else:
        build = "cpu"
    return TorchBuild(version=version, build=build, cuda=cuda, hip=hip)


def parse_version_py(text: str) -> dict[str, str | None]:
    """Top-level literal string/None assignments of a torch/version.py (``cuda: Optional[str] = '12.4'``)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    out: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name) or not isinstance(value, ast.Constant):
            continue
        if value.value is None or isinstance(value.value, str):
            out[target.id] = value.value
    return out
