"""The one wording of every "install the optional package" hint.

sdplan is not on the package index, so ``pip install 'sdplan[bnb]'`` fails outside a clone; the hints name the
package itself, which installs into whichever environment runs sdplan (in a clone, ``pip install -e '.[bnb]'``
does the same). The requirements are pyproject.toml's optional dependencies (a test keeps them equal).
"""

from __future__ import annotations

# extra name -> what pyproject.toml's [project.optional-dependencies] lists for it
EXTRAS = {
    "amd": "amdsmi",
    "deepspeed": "deepspeed>=0.15",
    "bnb": "bitsandbytes>=0.46",
    "tensorboard": "tensorboard>=2.15",
}


def install_hint(extra: str, upgrade: bool = False) -> str:
    """``pip install 'bitsandbytes>=0.46'`` for the extra ``bnb`` (``-U`` where an old version is installed)."""
    return f"pip install {'-U ' if upgrade else ''}'{EXTRAS[extra]}'"
