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
from .models import PICKLE_SUFFIXES, SINGLE_FILE_SUFFIXES, diffusers_readable, is_safetensors_name


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
    if is_safetensors_name(path):
        return _family(_safetensors_keys(path))
    return _family(read_checkpoint_safely(path))


def _safetensors_keys(path: str | Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _family(keys) -> str | None:
    from .source_check import family_from_keys

    return family_from_keys(keys)


# The CLIP text encoder of some 2022 SD 1.x files, without ``text_model.`` (A1111 ``modules/sd_models.py``
# ``checkpoint_dict_replacements_sd1``: ``cond_stage_model.transformer.embeddings.`` ->
# ``cond_stage_model.transformer.text_model.embeddings.``, the same for ``encoder.`` and ``final_layer_norm.``).
OLD_CLIP_PREFIX = "cond_stage_model.transformer."
OLD_CLIP_PARTS = tuple(OLD_CLIP_PREFIX + part for part in ("embeddings.", "encoder.", "final_layer_norm."))


def has_old_clip_keys(keys) -> bool:
    """Whether an SD 1.x file's CLIP keys lack ``text_model.``. A1111 (``checkpoint_dict_replacements_sd1``)
    and ComfyUI (``comfy/supported_models.py`` ``SD15.process_clip_state_dict``) rename them and load the file;
    diffusers' ``from_single_file`` finds no CLIP model in it (``single_file_utils.is_clip_model`` asks for
    ``cond_stage_model.transformer.text_model.embeddings.position_embedding.weight``) and fails with "Weights
    for this component appear to be missing in the checkpoint"."""
    keys = list(keys)
    new = OLD_CLIP_PREFIX + "text_model."
    return any(k.startswith(OLD_CLIP_PARTS) for k in keys) and not any(k.startswith(new) for k in keys)


def _old_clip_text_encoder(path: Path, state: dict | None, config_dir, torch_dtype):
    """The CLIPTextModel of an SD 1.x file in the old CLIP layout, built from its ``cond_stage_model.transformer.*``
    tensors alone (a .safetensors reads just those; ``state``: the .ckpt already read safely), to pass to
    ``from_single_file``. Its config is the one diffusers would use: ``config_dir``'s ``text_encoder``, else the
    SD 1.x default repo's (diffusers ``DIFFUSERS_DEFAULT_PIPELINE_PATHS["v1"]``, from the hub cache, with
    HF_HUB_OFFLINE honoured). The load is strict, less the keys of buffers the model does not save
    (``position_ids``: transformers drops them too, ``_adjust_missing_and_unexpected_keys``); the dtype is
    ``torch_dtype``, else float32, as diffusers gives (``load_model_dict_into_meta``)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import CLIPTextConfig, CLIPTextModel

    from .source_check import SINGLE_FILE_CONFIGS

    where = str(config_dir) if config_dir is not None else SINGLE_FILE_CONFIGS["sd15"]
    config = CLIPTextConfig.from_pretrained(
        where, subfolder="text_encoder", local_files_only=config_dir is not None
    )
    copy = state is not None  # a .ckpt's tensors are copied: the model never holds its memory map
    if state is None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            state = {k: f.get_tensor(k) for k in set(f.keys()) if k.startswith(OLD_CLIP_PREFIX)}
    with init_empty_weights():  # as diffusers create_diffusers_clip_model_from_ldm: no random init, no memory
        model = CLIPTextModel(config)
    text_model = getattr(model, "text_model", model)  # transformers >= 5.6 flattened CLIPTextModel
    unsaved = {name for name, _ in text_model.named_buffers()} - set(text_model.state_dict())
    dtype = torch_dtype or torch.float32
    tensors = {
        k.removeprefix(OLD_CLIP_PREFIX): v.to(dtype, copy=copy)
        for k, v in state.items()
        if k.startswith(OLD_CLIP_PREFIX) and k.removeprefix(OLD_CLIP_PREFIX) not in unsaved
    }
    text_model.load_state_dict(tensors, strict=True, assign=True)
    return model.eval()


def load_single_file_model(
    path: str | Path,
    family: str | None = None,
    config_dir: str | Path | None = None,
    *,
    torch_dtype=None,
    scratch: str | Path | None = None,
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

    An SD 1.x file whose CLIP keys lack ``text_model.`` (:func:`has_old_clip_keys`) gets its text encoder
    built here (:func:`_old_clip_text_encoder`): diffusers would find none in it.
    """
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"model file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix not in SINGLE_FILE_SUFFIXES:
        raise UsageError(f"{path}: a single-file model is .safetensors or .ckpt, not {suffix or 'no suffix'}")
    # a .ckpt is read first: code is refused before diffusers reads the file
    state = read_checkpoint_safely(path) if suffix in PICKLE_SUFFIXES else None
    keys = list(state) if state is not None else _safetensors_keys(path)
    family = family or _family(keys)
    if family is None:
        raise UsageError(f"{path}: cannot tell SD 1.x, 2.x or SDXL from its keys", fix="set model.family")
    if family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r}", fix=f"use one of {', '.join(FAMILIES)}")
    kwargs: dict[str, Any] = {}
    if config_dir is not None:
        kwargs.update(config=str(config_dir), local_files_only=True)
    if torch_dtype is not None:
        kwargs["torch_dtype"] = torch_dtype
    if family == "sd15" and has_old_clip_keys(keys):  # diffusers would find no text encoder in the file
        kwargs["text_encoder"] = _old_clip_text_encoder(path, state, config_dir, torch_dtype)
    del state  # diffusers reads the file again
    # x.SAFETENSORS, x.sft: under a name diffusers reads as safetensors (a link in ``scratch``, the run's folder)
    # diffusers reads a .ckpt again, with weights_only
    with diffusers_readable(path, scratch) as readable, training_state_allowed():
        if family == "sdxl":
            pipe = StableDiffusionXLPipeline.from_single_file(readable, **kwargs)
        else:
            pipe = StableDiffusionPipeline.from_single_file(
                readable,
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
                **kwargs,
            )
    pipe.set_progress_bar_config(disable=True)
    return pipe
