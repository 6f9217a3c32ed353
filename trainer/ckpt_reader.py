"""The tensor names and shapes of a pickled torch checkpoint (``.ckpt``/``.pt``/``.pth``/``.bin``), read with
the standard library only: no torch, no tensor data, nothing in the pickle executed.

``torch.save`` (torch >= 1.6) writes a zip archive: ``<archive>/data.pkl`` is the pickled object and each
tensor's bytes are a separate ``<archive>/data/<key>`` entry. In ``data.pkl`` a tensor is a call of
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks,
metadata=None)`` whose ``storage`` is a persistent id ``("storage", <torch.XStorage>, key, location, numel)``
(torch ``serialization.py`` ``_save`` / ``_load``, ``_utils.py``). ``size`` is the shape. A1111
(``modules/sd_models.py`` ``get_state_dict_from_checkpoint``) takes the weights from the top-level
``state_dict`` entry when there is one, else the object itself: so does :func:`read_ckpt_shapes`.

The unpickler resolves a global only to a stand-in of its own (the tensor rebuild functions, storage types,
``collections.OrderedDict`` and the few builtins torch's ``weights_only`` loader allows); the stand-ins build
plain records, never call into torch or anything the file names. A global that torch's ``weights_only``
loader never allows (``os.system``, a class of another package) is :class:`UnsafeCheckpointError`, the same
refusal the trainer's load (``single_file.read_checkpoint_safely``) would give; anything else this reader
does not model (a legacy non-zip file, another torch global, a damaged archive) is :class:`Unreadable`, and
the file is checked when it loads.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

from sdplan.errors import SdplanError

MAX_PICKLE = 64 * 2**20  # a whole SD checkpoint's data.pkl is well under 1 MiB


class UnsafeCheckpointError(SdplanError):
    """A .ckpt whose pickle holds more than tensors and plain containers."""

    exit_code = 2


class Unreadable(Exception):
    """The reader cannot tell this file's keys without loading it (the message says why, in a few words)."""


class _Tensor:
    """What a rebuilt tensor is here: its shape."""

    __slots__ = ("shape",)

    def __init__(self, shape) -> None:
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise Unreadable("a tensor without a valid size")
        self.shape = shape


class _Storage:
    """A storage type (``torch.HalfStorage``) or a persistent storage reference: nothing is read."""

    def __init__(self, *args, **kwargs) -> None:
        pass


def _rebuild_tensor(storage, storage_offset, size, stride, *rest):
    # _rebuild_tensor(storage, offset, size, stride) and
    # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks, metadata=None)
    return _Tensor(tuple(size) if isinstance(size, (tuple, list)) else size)


def _rebuild_parameter(data, *rest):
    # _rebuild_parameter(data, requires_grad, backward_hooks[, state])
    if not isinstance(data, _Tensor):
        raise Unreadable("a parameter that is not a tensor")
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # torch._tensor._rebuild_from_type_v2: a tensor subclass or a parameter with attributes; func is one of
    # the stand-ins above (a global the unpickler resolved), args its arguments
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(args, tuple):
        raise Unreadable("a tensor subclass this reader does not model")
    return func(*args)


def _encode(text, encoding="utf-8", errors="strict"):
    # _codecs.encode: how protocol 2 pickles bytes (str -> bytes, nothing else)
    if not isinstance(text, str) or not isinstance(encoding, str):
        raise Unreadable("a malformed bytes value")
    return text.encode(encoding, errors)


def _bytearray(data=b"", *rest):
    # builtins.bytearray: from bytes only (bytearray(n) would allocate n bytes the file asks for)
    if not isinstance(data, (bytes, str)):
        raise Unreadable("a malformed bytearray value")
    return bytearray(data, *rest) if isinstance(data, str) else bytearray(data)


_STAND_INS = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.nn.parameter", "Parameter"): _Storage,  # only ever the new_type of _rebuild_from_type_v2
    ("torch", "Tensor"): _Storage,
    ("torch.storage", "UntypedStorage"): _Storage,
    ("torch.storage", "TypedStorage"): _Storage,
    ("collections", "OrderedDict"): OrderedDict,
    ("_codecs", "encode"): _encode,
    ("builtins", "set"): set,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "complex"): complex,
}
# what torch.load(weights_only=True) can allow (torch _weights_only_unpickler._get_allowed_globals): torch's own
# names, collections' OrderedDict / Counter and these; any other global it refuses
_WEIGHTS_ONLY_OTHERS = {"collections.Counter", "_codecs.encode", "builtins.set", "builtins.bytearray"}
_WEIGHTS_ONLY_OTHERS |= {"builtins.complex", "collections.OrderedDict"}


class _ShapeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _STAND_INS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.endswith("Storage"):  # torch.HalfStorage, torch.FloatStorage, ...
            return _Storage
        if module == "torch" or module.startswith("torch.") or f"{module}.{name}" in _WEIGHTS_ONLY_OTHERS:
            raise Unreadable(f"its pickle names {module}.{name}, which this reader does not model")
        raise UnsafeCheckpointError(
            f"refusing to unpickle it: it holds more than tensors (its pickle names {module}.{name})",
            fix="convert it to .safetensors with a tool you trust, or use the model's .safetensors release",
        )

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and pid and pid[0] == "storage":
            return _Storage()
        raise Unreadable("a persistent reference that is not a storage")


def _data_pkl(path: Path) -> bytes:
    """``<archive>/data.pkl`` of a torch zip checkpoint."""
    if not zipfile.is_zipfile(path):
        raise Unreadable("an old pickle checkpoint, not torch's zip format")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        pkls = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pkls) != 1:
            raise Unreadable("a zip archive without one <archive>/data.pkl")
        if any(n.endswith("/constants.pkl") for n in names):
            raise Unreadable("a TorchScript archive")
        entry = z.getinfo(pkls[0])
        if entry.file_size > MAX_PICKLE:
            raise Unreadable(f"its data.pkl holds {entry.file_size:,} bytes")
        return z.read(entry)


def read_ckpt_shapes(path: str | Path, where: str | None = None) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a torch zip checkpoint's weights (the top-level ``state_dict`` when there is one;
    an entry that is no tensor has shape ``()``). :class:`UnsafeCheckpointError` for a pickle that names code
    (``where``: the name its message gives the file), :class:`Unreadable` for anything else this reader cannot
    tell without loading."""
    path = Path(path)
    try:
        state = _ShapeUnpickler(io.BytesIO(_data_pkl(path))).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where or path}: {e.message}", fix=e.fix) from None
    except Unreadable:
        raise
    except Exception as e:  # damaged archive, malformed pickle, a stand-in given odd arguments
        raise Unreadable(f"its pickle does not parse: {type(e).__name__}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # once, as A1111 (a pickle may
        state = state["state_dict"]  # hold a dict that contains itself)
    if not isinstance(state, dict):
        raise Unreadable(f"its pickle holds a {type(state).__name__}, not a state dict")
    return {k: v.shape if isinstance(v, _Tensor) else () for k, v in state.items() if isinstance(k, str)}
