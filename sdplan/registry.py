"""The training methods and model families sdplan knows: the one list every layer reads.

The config schema, the profile loader, the planner, `recommend`, `train`, `doctor` and `bench` take their
names from here. Adding a family is one :class:`Family` entry here, plus its profile
(``profiles/models/<name>.yaml`` and its activations) and its trainer support; adding a method is one
:class:`Method` entry, plus its recipe (``sdplan.trainer.recipes.<recipe>``) and its profile
(``profiles/methods/<name>.yaml``). Pure data: no torch, no I/O (``sdplan recommend`` imports it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from sdplan.errors import UsageError


@dataclass(frozen=True)
class Method:
    name: str  # as in sdplan.yaml's `method`, the CLI's --method and profiles/methods/<name>.yaml
    label: str
    trains: str  # "unet": every UNet weight | "adapter": LoRA matrices | "embeddings": new token vectors
    recipe: str  # the trainer module sdplan.trainer.recipes.<recipe>
    aliases: tuple[str, ...] = ()

    @property
    def full_weights(self) -> bool:
        """Trains the whole UNet (its weights, gradients and optimizer state dominate memory)."""
        return self.trains == "unet"

    @property
    def optimizers(self) -> tuple[str, ...]:
        """The optimizers the planner considers (textual inversion's few vectors: plain AdamW)."""
        return ("adamw",) if self.trains == "embeddings" else OPTIMIZERS


@dataclass(frozen=True)
class Family:
    name: str  # as in sdplan.yaml's `model.family`, the CLI's --model and profiles/models/<name>.yaml
    label: str
    text_encoders: int  # CLIP text encoders (SDXL: two)
    name_hints: tuple[str, ...] = ()  # substrings of a hub id that name this family (checked in order)
    aliases: tuple[str, ...] = ()


OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")  # what the trainer runs and the planner searches over
# what the planner's memory and time model can predict (users' picks in kohya / OneTrainer / SimpleTuner);
# never chosen by the search, since they change the training dynamics: sdplan.planner.OPTIMIZER_STATE
MODELLED_OPTIMIZERS = (*OPTIMIZERS, "prodigy", "dadaptation", "lion", "lion8bit")
PRECISIONS = ("fp32", "fp16", "bf16")

METHOD_LIST = (
    Method("lora", "LoRA", trains="adapter", recipe="lora"),
    Method("dreambooth", "DreamBooth", trains="unet", recipe="dreambooth"),
    Method("finetune", "full fine-tune", trains="unet", recipe="finetune", aliases=("fine-tune",)),
    Method(
        "textual-inversion",
        "textual inversion",
        trains="embeddings",
        recipe="textual_inversion",
        aliases=("ti",),
    ),
)
FAMILY_LIST = (
    Family("sd15", "Stable Diffusion 1.x", text_encoders=1, aliases=("sd1", "sd1.5")),
    Family(
        "sd21",
        "Stable Diffusion 2.x",
        text_encoders=1,
        name_hints=("2-1", "2.1", "sd21", "2-base", "v2"),
        aliases=("sd2", "sd2.1"),
    ),
    Family("sdxl", "Stable Diffusion XL", text_encoders=2, name_hints=("xl",)),
)

METHODS = tuple(m.name for m in METHOD_LIST)
FAMILIES = tuple(f.name for f in FAMILY_LIST)
FULL_METHODS = tuple(m.name for m in METHOD_LIST if m.full_weights)
RECIPES = {m.name: m.recipe for m in METHOD_LIST}
DEFAULT_FAMILY = "sd15"  # a hub id whose name names no family


def method(name: str) -> Method:
    """The method called ``name`` (or one of its aliases); UsageError naming the closest otherwise."""
    return _lookup("method", name, METHOD_LIST)


def family(name: str) -> Family:
    """The family called ``name`` (or one of its aliases); UsageError naming the closest otherwise."""
    return _lookup("model", name, FAMILY_LIST)


def _lookup(kind: str, name: str, entries):
    for e in entries:
        if name == e.name or name in e.aliases:
            return e
    names = [e.name for e in entries]
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(f"unknown {kind} {name!r}", fix=f"{hint}one of: {', '.join(names)}")


def guess_family(model: str) -> str:
    """A hub id's family from its name, when its config cannot be read offline."""
    name = model.lower()
    for fam in sorted(FAMILY_LIST, key=lambda f: f.name != "sdxl"):  # "xl" before sd21's looser hints
        if any(h in name for h in fam.name_hints):
            return fam.name
    return DEFAULT_FAMILY
