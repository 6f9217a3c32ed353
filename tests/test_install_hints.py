"""Install hints name what installs from anywhere: sdplan is not on the package index, so the old
``pip install 'sdplan[bnb]'`` failed outside the clone's own environment (new-user audit, item 1)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sdplan.extras import EXTRAS, install_hint

ROOT = Path(__file__).resolve().parent.parent


def test_extras_are_pyprojects_optional_dependencies():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name, requirement in EXTRAS.items():
        assert extras[name] == [requirement], name


def test_hints_name_the_package_itself():
    assert install_hint("bnb") == "pip install 'bitsandbytes>=0.46'"
    assert install_hint("bnb", upgrade=True) == "pip install -U 'bitsandbytes>=0.46'"
    assert install_hint("deepspeed") == "pip install 'deepspeed>=0.15'"


def test_no_message_or_readme_says_pip_install_sdplan_extras():
    pattern = re.compile(r"pip install (-U )?['\"]?sdplan\[")
    files = [ROOT / "README.md", *ROOT.glob("sdplan/**/*.py"), *ROOT.glob("trainer/**/*.py")]
    files += [*ROOT.glob("benchmarks/*.py")]
    found = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files
        if f.name != "extras.py"
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_the_nf4_refusal_names_bitsandbytes_itself():
    from sdplan.trainer.quantize import BITSANDBYTES_MIN

    assert EXTRAS["bnb"] == "bitsandbytes>=" + ".".join(map(str, BITSANDBYTES_MIN))
