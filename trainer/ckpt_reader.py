"""The tensor names and shapes of a pickled torch checkpoint (``.ckpt``/``.pt``/``.pth``/``.bin``), read with
the standard library only: no torch, nothing in the pickle executed (and no tensor data, but the one tensor
:func:`read_ckpt_tensor` is asked for).

``torch.save`` (torch >= 1.6) writes a zip archive: ``<archive>/data.pkl`` is the pickled object and each
tensor's bytes are a separate ``<archive>/data/<key>`` entry. In ``data.pkl`` a tensor is a call of
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks,
metadata=None)`` whose ``storage`` is a persistent id ``("storage", <torch.XStorage>, key, location, numel)``
(torch ``serialization.py`` ``_save`` / ``_load``, ``_utils.py``). ``size`` is the shape. A1111
(``modules/sd_models.py`` ``get_state_dict_from_checkpoint``) takes the weights from the top-level
``state_dict`` entry when there is one, else the object itself: so does :func:`read_ckpt_shapes`. One tensor's
elements are its storage's ``data/<key>`` bytes from ``storage_offset`` along ``stride``, in the storage type's
element type, in the byte order ``<archive>/byteorder`` names (:func:`read_ckpt_tensor`).

The unpickler resolves a global only to a stand-in of its own (the tensor rebuild functions, storage types,
``collections.OrderedDict`` and the few builtins torch's ``weights_only`` loader allows, and the inert
:class:`TrainingState` for an old training checkpoint's Lightning callback and numpy scalars); the stand-ins
build plain records, never call into torch or anything the file names. A global that torch's ``weights_only``
loader never allows (``os.system``, a class of another package) is :class:`UnsafeCheckpointError`, the same
refusal the trainer's load (``single_file.read_checkpoint_safely``) would give; a zip archive cut short or
whose data.pkl fails its CRC-32 is :class:`DamagedCheckpointError`; anything else this reader does not model
(a legacy non-zip file, another torch global) is :class:`Unreadable`, and the file is checked when it loads.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

from sdplan.errors import SdplanError

from .models import ModelLoadError

MAX_PICKLE = 64 * 2**20  # a whole SD checkpoint's data.pkl is well under 1 MiB


class UnsafeCheckpointError(SdplanError):
    """A .ckpt whose pickle holds more than tensors and plain containers."""

    exit_code = 2


class DamagedCheckpointError(ModelLoadError):
    """A .ckpt whose bytes are damaged (its zip archive cut short, its ``data.pkl`` failing the archive's
    CRC-32 check): no reader can load it."""

    exit_code = 2


def damaged(where: str | Path, why: str) -> DamagedCheckpointError:
    """The one line for a damaged file (``where``: the name the message gives it)."""
    return DamagedCheckpointError(
        f"{where}: damaged or truncated ({why}; an interrupted download or copy, or a bad disk)",
        fix="download or copy the file again",
    )


class Unreadable(Exception):
    """The reader cannot tell this file's keys without loading it (the message says why, in a few words)."""


class _Storage:
    """A storage type (``torch.HalfStorage``) or a persistent storage reference: nothing is read. A reference
    keeps its ``data/<key>`` entry's name and its storage type's name (``HalfStorage``): what
    :func:`read_ckpt_tensor` reads one tensor's bytes by."""

    def __init__(self, *args, key: str | None = None, dtype: str | None = None, **kwargs) -> None:
        self.key, self.dtype = key, dtype


class _StorageType:
    """``torch.<X>Storage`` as a persistent id names it: its name (the element type)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args, **kwargs) -> _Storage:
        return _Storage()


class _Tensor:
    """What a rebuilt tensor is here: its shape, and where its elements are (storage, offset, stride)."""

    __slots__ = ("shape", "storage", "offset", "stride")

    def __init__(self, shape, storage=None, offset=None, stride=None) -> None:
        if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise Unreadable("a tensor without a valid size")
        self.shape = shape
        self.storage = storage if isinstance(storage, _Storage) else None
        self.offset = offset if isinstance(offset, int) else None
        self.stride = tuple(stride) if isinstance(stride, (tuple, list)) else None


def _rebuild_tensor(storage, storage_offset, size, stride, *rest):
    # _rebuild_tensor(storage, offset, size, stride) and
    # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks, metadata=None)
    return _Tensor(tuple(size) if isinstance(size, (tuple, list)) else size, storage, storage_offset, stride)


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


class TrainingState:
    """An inert stand-in for what an old training checkpoint pickles beside its weights: PyTorch Lightning's
    ``ModelCheckpoint`` callback (the class, as a key of its ``callbacks`` entry) and numpy scalars with their
    dtypes (a ``global_step`` saved as ``numpy.int64``), as the original CompVis SD v1 checkpoints hold them.
    Built from anything, it keeps nothing and runs nothing; only the weights are read."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


# the globals TrainingState stands in for: ComfyUI (comfy/utils.py) and A1111 (modules/safe.py) allow these
# (ComfyUI as torch safe globals) so that such checkpoints load; their values are never needed here
_NUMPY_DTYPES = ("Bool", "Float16", "Float32", "Float64", "Int8", "Int16", "Int32", "Int64")
_NUMPY_DTYPES += ("UInt8", "UInt16", "UInt32", "UInt64")
TRAINING_STATE_GLOBALS = (
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"),
    ("numpy.core.multiarray", "scalar"),  # numpy 1.x pickles
    ("numpy._core.multiarray", "scalar"),  # numpy 2
    ("numpy", "dtype"),
    *(("numpy.dtypes", f"{name}DType") for name in _NUMPY_DTYPES),
)

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
    **{name: TrainingState for name in TRAINING_STATE_GLOBALS},
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
            return _StorageType(name)
        if module == "torch" or module.startswith("torch.") or f"{module}.{name}" in _WEIGHTS_ONLY_OTHERS:
            raise Unreadable(f"its pickle names {module}.{name}, which this reader does not model")
        raise UnsafeCheckpointError(
            f"refusing to unpickle it: it holds more than tensors (its pickle names {module}.{name})",
            fix="convert it to .safetensors with a tool you trust, or use the model's .safetensors release",
        )

    def persistent_load(self, pid):
        # ("storage", storage type, key, location, numel): torch serialization.py _save's persistent_id
        if isinstance(pid, tuple) and pid and pid[0] == "storage":
            kind = pid[1] if len(pid) > 1 else None
            key = pid[2] if len(pid) > 2 else None
            return _Storage(key=str(key), dtype=kind.name if isinstance(kind, _StorageType) else None)
        raise Unreadable("a persistent reference that is not a storage")


def _data_pkl(path: Path, where: str | Path | None = None) -> bytes:
    """``<archive>/data.pkl`` of a torch zip checkpoint, read whole, so the archive's CRC-32 of it is checked
    (torch's reader checks none: a flipped byte fails in its unpickler, as a UnicodeDecodeError or worse).
    A zip cut short or whose data.pkl fails that check is :class:`DamagedCheckpointError`."""
    if not zipfile.is_zipfile(path):
        with path.open("rb") as f:
            if f.read(4) == b"PK\x03\x04":  # a zip's first entry, but no central directory at its end
                raise damaged(where or path, "a zip archive whose end is missing")
        raise Unreadable("an old pickle checkpoint, not torch's zip format")
    try:
        with zipfile.ZipFile(path) as z:
            name = _data_pkl_name(z)
            if any(n.endswith("/constants.pkl") for n in z.namelist()):
                raise Unreadable("a TorchScript archive")
            entry = z.getinfo(name)
            if entry.file_size > MAX_PICKLE:
                raise Unreadable(f"its data.pkl holds {entry.file_size:,} bytes")
            if (
                entry.CRC == 0
            ):  # none written (torch.serialization.set_crc32_options(False)): nothing to check
                entry.CRC = None
            return z.read(entry)
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # "Bad CRC-32 for file 'archive/data.pkl'"
        raise damaged(where or path, f"its zip archive: {e}") from None


def read_ckpt_shapes(path: str | Path, where: str | None = None) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of a torch zip checkpoint's weights (the top-level ``state_dict`` when there is one;
    an entry that is no tensor has shape ``()``). :class:`UnsafeCheckpointError` for a pickle that names code
    (``where``: the name its message gives the file), :class:`Unreadable` for anything else this reader cannot
    tell without loading."""
    state = _read_state(Path(path), where)
    return {k: v.shape if isinstance(v, _Tensor) else () for k, v in state.items() if isinstance(k, str)}


# storage type -> (the element type as safetensors names it, bytes per element)
_ELEMENTS = {"HalfStorage": ("F16", 2), "FloatStorage": ("F32", 4), "BFloat16Storage": ("BF16", 2)}
_ELEMENTS["DoubleStorage"] = ("F64", 8)
MAX_GATHER = 2**20  # elements of a non-contiguous tensor read one by one


def read_ckpt_tensor(path: str | Path, key: str) -> tuple[str, bytes] | None:
    """One floating-point tensor of a torch zip checkpoint without torch: (its element type as safetensors
    names it, ``F16`` / ``BF16`` / ``F32`` / ``F64``; its elements' little-endian bytes in row-major order),
    read from its storage's ``<archive>/data/<key>`` entry at the tensor's offset and strides. None where the
    file lacks the key, holds another element type, or cannot be read so (a big-endian save, a damaged
    archive, a pickle this reader does not model)."""
    path = Path(path)
    try:
        t = _read_state(path).get(key)
        if not isinstance(t, _Tensor) or t.storage is None or t.offset is None or t.stride is None:
            return None
        code, size = _ELEMENTS.get(t.storage.dtype or "", (None, 0))
        if code is None or len(t.stride) != len(t.shape):
            return None
        numel = 1
        for n in t.shape:
            numel *= n
        with zipfile.ZipFile(path) as z:
            archive = _data_pkl_name(z).rsplit("/", 1)[0]
            order = f"{archive}/byteorder"
            if order in z.namelist() and z.read(order).strip() != b"little":
                return None
            entry = z.getinfo(f"{archive}/data/{t.storage.key}")
            row_major, step = [], 1
            for n in reversed(t.shape):
                row_major.insert(0, step)
                step *= n
            if all(a == b for a, b, n in zip(t.stride, row_major, t.shape) if n > 1):  # contiguous
                first, last = t.offset, t.offset + numel
                if last * size > entry.file_size:
                    return None
                with z.open(entry) as f:
                    f.seek(first * size)
                    return code, f.read(numel * size)
            if numel > MAX_GATHER:
                return None
            data = z.read(entry)
            index = [t.offset]
            for n, st in zip(t.shape, t.stride):
                index = [i + j * st for i in index for j in range(n)]
            if any(i < 0 or (i + 1) * size > len(data) for i in index):
                return None
            return code, b"".join(data[i * size : (i + 1) * size] for i in index)
    except (Unreadable, UnsafeCheckpointError, DamagedCheckpointError, OSError, KeyError, ValueError):
        return None
    except zipfile.BadZipFile:  # a data/<key> entry of a damaged archive
        return None


def check_intact(path: str | Path) -> None:
    """:class:`DamagedCheckpointError` where a torch zip checkpoint's ``data.pkl`` fails its CRC-32 check (what
    the trainer's torch load checks first: torch reads it unchecked). Anything else is torch's to read."""
    path = Path(path)
    if zipfile.is_zipfile(path):
        with contextlib.suppress(Unreadable):
            _data_pkl(path)


def _data_pkl_name(z: zipfile.ZipFile) -> str:
    pkls = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
    if len(pkls) != 1:
        raise Unreadable("a zip archive without one <archive>/data.pkl")
    return pkls[0]


def _read_state(path: Path, where: str | None = None) -> dict:
    """The checkpoint's state dict of :class:`_Tensor` records (read_ckpt_shapes' errors)."""
    try:
        state = _ShapeUnpickler(io.BytesIO(_data_pkl(path, where))).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(f"{where or path}: {e.message}", fix=e.fix) from None
    except (Unreadable, DamagedCheckpointError):
        raise
    except Exception as e:  # damaged archive, malformed pickle, a stand-in given odd arguments
        raise Unreadable(f"its pickle does not parse: {type(e).__name__}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):  # once, as A1111 (a pickle may
        state = state["state_dict"]  # hold a dict that contains itself)
    if not isinstance(state, dict):
        raise Unreadable(f"its pickle holds a {type(state).__name__}, not a state dict")
    return state
