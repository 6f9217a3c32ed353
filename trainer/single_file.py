"""Single-file checkpoints in: a ``.safetensors``/``.ckpt`` (A1111/ComfyUI/kohya layout) into a diffusers
pipeline through diffusers ``from_single_file``, never unpickling code, and the model family read from its keys.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sdplan.errors import UsageError

from .ckpt_reader import TRAINING_STATE_GLOBALS, TrainingState, UnsafeCheckpointError, check_intact
from .export import FAMILIES
from .models import PICKLE_SUFFIXES, SINGLE_FILE_SUFFIXES


@contextmanager
def training_state_allowed():
    """``torch.load(weights_only=True)`` (here and diffusers' own read of the file) with the inert
    :class:`.ckpt_reader.TrainingState` standing in for an old training checkpoint's Lightning callback and
    numpy scalars (ComfyUI ``comfy/utils.py`` allows the same with ``add_safe_globals``)."""
    import torch

    allowed = [(TrainingState, f"{module}.{name}") for module, name in TRAINING_STATE_GLOBALS]
    with torch.serialization.safe_globals(allowed):
        yield


def read_checkpoint_safely(path: str | Path) -> dict:
    """A pickled checkpoint read with ``torch.load(weights_only=True)``: tensors and plain containers only
    (and :func:`training_state_allowed`'s inert stand-ins); anything else (code, arbitrary classes) is refused
    before it runs."""
    import pickle
    import re
    import struct
    import zipfile

    import torch

    check_intact(path)  # a data.pkl that fails its CRC-32: torch's unpickler reads it unchecked
    try:
        # Zip-format checkpoints (torch >= 1.6) are memory-mapped: reading the keys costs no RAM.
        with training_state_allowed():
            state = torch.load(
                str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(str(path))
            )
    except pickle.UnpicklingError as e:
        cut = re.search(r"GLOBAL \S*\.(\s|$)", str(e))  # a global name cut off after its module's dot
        if "Unsupported operand" in str(e) or cut:  # not pickle opcodes: garbage or a cut-off file
            raise _damaged(path, "not a pickle where one should be") from e
        raise UnsafeCheckpointError(
            f"{path}: refusing to unpickle it: it holds more than tensors ({_refused(str(e))})",
            fix="convert it to .safetensors with a tool you trust, or use the model's .safetensors release",
        ) from e
    except (EOFError, IndexError, struct.error) as e:  # a legacy pickle cut short, as its opcodes read it
        raise _damaged(path, "it ends early") from e
    except UnicodeDecodeError as e:  # a string opcode over damaged bytes (a legacy pickle's flipped byte)
        raise _damaged(path, "its pickle does not parse") from e
    except RuntimeError as e:  # torch's zip reader: no central directory, a short data entry
        first = (str(e).strip().splitlines() or [""])[0]
        if not any(w in first for w in ("PytorchStreamReader", "unexpected EOF", "corrupted")):
            raise
        raise _damaged(path, first.split(". ")[0]) from e
    while isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise UsageError(f"{path}: not a checkpoint (a {type(state).__name__}, not a state dict)")
    return state


def _damaged(path: str | Path, why: str):
    from .models import ModelLoadError

    return ModelLoadError(
        f"{path}: damaged or truncated, torch cannot read it ({why})", fix="download or copy the file again"
    )


def _refused(message: str) -> str:
    """What torch's weights_only unpickler refused, in the words :mod:`.ckpt_reader` uses ("its pickle names
    posix.system"), without torch's advice around it (to re-run with weights_only=False, which would run it)."""
    import re

    named = re.search(r"GLOBAL (\S+)", message)
    if named:
        return f"its pickle names {named.group(1)}"
    skip = ("Weights only load failed", "Check the documentation", "Please file an issue")
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line.startswith(skip)]
    return lines[0] if lines else "more than tensors and plain containers"


def detect_single_file_family(path: str | Path) -> str | None:
    """sd15 / sd21 / sdxl from a single file's key names (a .safetensors header only; a .ckpt read safely)."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    else:
        keys = list(read_checkpoint_safely(path))
    from .source_check import family_from_keys

    return family_from_keys(keys)


def load_single_file_model(
    path: str | Path, family: str | None = None, config_dir: str | Path | None = None, *, torch_dtype=None
):
    """A single-file checkpoint as a diffusers pipeline (StableDiffusionPipeline or StableDiffusionXLPipeline)
    via diffusers ``from_single_file``.

    ``.safetensors`` holds no code. A ``.ckpt``/``.pt`` is first read with ``torch.load(weights_only=True)``
    (``read_checkpoint_safely``): a pickle with anything but tensors raises UnsafeCheckpointError and nothing in
    it runs. diffusers' own reader (``models/model_loading_utils.load_state_dict``) also passes
    ``weights_only=True`` to ``torch.load`` (diffusers 0.42), so the second read is safe as well.

    ``config_dir``: a local diffusers folder whose component configs (and tokenizers) describe the checkpoint;
    with it nothing is downloaded (``config=..., local_files_only=True``). Without it diffusers fetches the
    default configs for the detected model type from the Hub (configs only, no weights).
    """
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in SINGLE_FILE_SUFFIXES:
        raise UsageError(f"{path}: a single-file model is .safetensors or .ckpt, not {suffix or 'no suffix'}")
    if suffix in PICKLE_SUFFIXES:
        read_checkpoint_safely(path)  # refuses code before diffusers reads the file
    family = family or detect_single_file_family(path)
    if family is None:
        raise UsageError(f"{path}: cannot tell SD 1.x, 2.x or SDXL from its keys", fix="set model.family")
    if family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r}", fix=f"use one of {', '.join(FAMILIES)}")
    kwargs: dict[str, Any] = {}
    if config_dir is not None:
        kwargs.update(config=str(config_dir), local_files_only=True)
    if torch_dtype is not None:
        kwargs["torch_dtype"] = torch_dtype
    with training_state_allowed():  # diffusers reads a .ckpt again, with weights_only
        if family == "sdxl":
            pipe = StableDiffusionXLPipeline.from_single_file(str(path), **kwargs)
        else:
            pipe = StableDiffusionPipeline.from_single_file(
                str(path),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
                **kwargs,
            )
    pipe.set_progress_bar_config(disable=True)
    return pipe
