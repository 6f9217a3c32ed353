"""A stand-in for nvidia-ml-py's ``pynvml`` module that answers from a machine fixture (snapshot JSON).

It has the real API's names, signatures, error classes and return shapes, so sdplan's real NVML backend
runs against it unchanged:

- ``NVMLError(code)`` builds the subclass for that code (``NVMLError(12)`` is an ``NVMLError_LibraryNotFound``),
  and the subclasses are named as pynvml names them (``NVML_ERROR_NOT_SUPPORTED`` -> ``NVMLError_NotSupported``);
- no NVIDIA GPU in the fixture means no driver: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``;
- calls before ``nvmlInit`` raise ``NVMLError_Uninitialized``; a field that is null in the fixture raises
  ``NVMLError_NotSupported``; a handle the fake did not issue raises ``NVMLError_InvalidArgument``;
- ``nvmlDeviceGetP2PStatus`` rejects a non-int index with ``ctypes.ArgumentError`` as ctypes does, and the
  module keeps nvidia-ml-py 13.615.71's ``NVML_P2P_CAPS_INDEX_READ = (0,)`` tuple, so code that passes that
  constant fails here as it does on a real machine;
- the current PCIe generation reads 1 (an idle GPU downshifts), the maximum reads the fixture's value;
- a GPU on an NVLink pair has ``NVLINK_LINKS`` active links (H100 SXM: 18); other GPUs answer NotSupported;
- MIG: ``nvmlDeviceGetMigMode`` answers from the fixture's ``mig`` (null: NotSupported, as a GPU without MIG
  does); a GPU given slices (``make_module(..., mig={position: [(total, free), ...]})``) is in MIG mode with
  those MIG devices, ``MIG_DEVICES`` (7) at most: ``nvmlDeviceGetMigDeviceHandleByIndex`` raises NotFound past
  the last slice and InvalidArgument past 7, and ``nvmlDeviceGetMemoryInfo`` of a MIG handle is its slice's
  (of the card's handle: the fixture's, NVML's aggregate).

Use :func:`install` (monkeypatch ``sys.modules["pynvml"]``) or :func:`make_module`.
"""

from __future__ import annotations

import ctypes
import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NVML_SUCCESS = 0
_ERROR_CODES = {
    "UNINITIALIZED": 1,
    "INVALID_ARGUMENT": 2,
    "NOT_SUPPORTED": 3,
    "NO_PERMISSION": 4,
    "ALREADY_INITIALIZED": 5,
    "NOT_FOUND": 6,
    "INSUFFICIENT_SIZE": 7,
    "INSUFFICIENT_POWER": 8,
    "DRIVER_NOT_LOADED": 9,
    "TIMEOUT": 10,
    "IRQ_ISSUE": 11,
    "LIBRARY_NOT_FOUND": 12,
    "FUNCTION_NOT_FOUND": 13,
    "CORRUPTED_INFOROM": 14,
    "GPU_IS_LOST": 15,
    "RESET_REQUIRED": 16,
    "OPERATING_SYSTEM": 17,
    "LIB_RM_VERSION_MISMATCH": 18,
    "IN_USE": 19,
    "MEMORY": 20,
    "NO_DATA": 21,
    "UNKNOWN": 999,
}
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_P2P_CAPS_INDEX_READ = (0,)  # as in nvidia-ml-py 13.615.71: a tuple, by a stray comma
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_CAPS_INDEX_ATOMICS = 3
NVML_P2P_CAPS_INDEX_PCI = 4
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1
NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 2
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVLINK_LINKS = 18
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
MIG_DEVICES = 7


class NVMLError(Exception):
    """Base class; ``NVMLError(code)`` returns an instance of the subclass registered for ``code``."""

    _by_code: dict[int, type] = {}

    def __new__(cls, value: int):
        target = NVMLError._by_code.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(target)
        obj.value = value
        return obj

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return (
            {v: k for k, v in _ERROR_CODES.items()}.get(self.value, "Unknown Error").replace("_", " ").title()
        )


def _error_class(name: str, code: int) -> type:
    class_name = "NVMLError_" + "".join(part.capitalize() for part in name.split("_"))

    def new(cls, *args):
        obj = Exception.__new__(cls)
        obj.value = code
        return obj

    def init(self, *args):
        Exception.__init__(self, code)
        self.value = code

    cls = type(class_name, (NVMLError,), {"__new__": new, "__init__": init})
    NVMLError._by_code[code] = cls
    return cls


_ERROR_CLASSES = {name: _error_class(name, code) for name, code in _ERROR_CODES.items()}


class c_nvmlMemory_t:
    """The shape of pynvml's ctypes structure: .total, .free, .used in bytes."""

    def __init__(self, total: int, free: int):
        self.total, self.free, self.used = total, free, total - free


class _Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<fake c_nvmlDevice_t {self.index}>"


class _MigHandle:
    def __init__(self, parent: _Handle, slot: int):
        self.parent, self.slot = parent, slot

    def __repr__(self) -> str:
        return f"<fake MIG c_nvmlDevice_t {self.parent.index}/{self.slot}>"


@dataclass
class FakeNVML:
    """The state behind one fake module: the fixture's NVIDIA GPUs and links, and every call made."""

    gpus: list[dict]
    links: list[dict]
    cuda_driver: str | None
    calls: list[str] = field(default_factory=list)
    init_count: int = 0
    handles: list[_Handle] = field(default_factory=list)
    mig: dict[int, list[tuple[int, int]]] = field(
        default_factory=dict
    )  # GPU position -> its slices' (total, free)

    # -- helpers ------------------------------------------------------------------------------------
    def _raise(self, name: str):
        raise _ERROR_CLASSES[name]()

    def _ready(self, fn: str) -> None:
        self.calls.append(fn)
        if self.init_count <= 0:
            self._raise("UNINITIALIZED")

    def _gpu(self, handle: Any) -> dict:
        if not isinstance(handle, _Handle) or handle not in self.handles:
            self._raise("INVALID_ARGUMENT")
        return self.gpus[handle.index]

    def _field(self, handle: Any, key: str) -> Any:
        value = self._gpu(handle)[key]
        if value is None:
            self._raise("NOT_SUPPORTED")
        return value

    def _link(self, a: int, b: int) -> dict | None:
        ia, ib = self.gpus[a]["index"], self.gpus[b]["index"]
        for link in self.links:
            if {link["a"], link["b"]} == {ia, ib}:
                return link
        return None

    def _on_nvlink(self, position: int) -> bool:
        index = self.gpus[position]["index"]
        return any(lk["type"] == "nvlink" and index in (lk["a"], lk["b"]) for lk in self.links)

    # -- the API ------------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if not self.gpus:
            self._raise("LIBRARY_NOT_FOUND")
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._ready("nvmlShutdown")
        self.init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._ready("nvmlSystemGetDriverVersion")
        return self.gpus[0]["driver_version"] or self._raise("NOT_SUPPORTED")

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._ready("nvmlSystemGetCudaDriverVersion_v2")
        if not self.cuda_driver:
            self._raise("NOT_SUPPORTED")
        major, minor = (int(x) for x in self.cuda_driver.split("."))
        return major * 1000 + minor * 10

    def nvmlDeviceGetCount(self) -> int:
        self._ready("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._ready("nvmlDeviceGetHandleByIndex")
        if not isinstance(index, int) or not 0 <= index < len(self.gpus):
            self._raise("INVALID_ARGUMENT")
        while len(self.handles) <= index:
            self.handles.append(_Handle(len(self.handles)))
        return self.handles[index]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._ready("nvmlDeviceGetName")
        return self._field(handle, "name")

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._ready("nvmlDeviceGetUUID")
        return self._field(handle, "uuid")

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> c_nvmlMemory_t:
        self._ready("nvmlDeviceGetMemoryInfo")
        if isinstance(handle, _MigHandle):
            self._gpu(handle.parent)
            return c_nvmlMemory_t(*self.mig[handle.parent.index][handle.slot])
        total = self._field(handle, "memory_total_bytes")
        free = self._gpu(handle)["memory_free_bytes"]
        return c_nvmlMemory_t(total, total if free is None else free)

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._ready("nvmlDeviceGetCudaComputeCapability")
        major, minor = self._field(handle, "compute_capability").split(".")
        return (int(major), int(minor))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetMaxPcieLinkGeneration")
        return self._field(handle, "pcie_gen")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetCurrPcieLinkGeneration")
        self._field(handle, "pcie_gen")
        return 1  # idle GPUs drop to gen 1

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetMaxPcieLinkWidth")
        return self._field(handle, "pcie_width")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetCurrPcieLinkWidth")
        return self._field(handle, "pcie_width")

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetPowerManagementLimit")
        return int(round(self._field(handle, "power_limit_watts") * 1000))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        self._ready("nvmlDeviceGetEnforcedPowerLimit")
        return int(round(self._field(handle, "power_limit_watts") * 1000))

    def nvmlDeviceGetNvLinkState(self, device: Any, link: int) -> int:
        self._ready("nvmlDeviceGetNvLinkState")
        self._gpu(device)
        if not self._on_nvlink(device.index):
            self._raise("NOT_SUPPORTED")
        if not isinstance(link, int) or not 0 <= link < NVLINK_LINKS:
            self._raise("INVALID_ARGUMENT")
        return NVML_FEATURE_ENABLED

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        self._ready("nvmlDeviceGetMigMode")
        gpu = self._gpu(device)
        if device.index in self.mig:
            return [NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE]
        if gpu.get("mig") is None:
            self._raise("NOT_SUPPORTED")
        mode = NVML_DEVICE_MIG_ENABLE if gpu["mig"] else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        self._ready("nvmlDeviceGetMaxMigDeviceCount")
        gpu = self._gpu(device)
        if device.index not in self.mig and gpu.get("mig") is None:
            self._raise("NOT_SUPPORTED")
        return MIG_DEVICES

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> _MigHandle:
        self._ready("nvmlDeviceGetMigDeviceHandleByIndex")
        self._gpu(device)
        if not isinstance(index, int) or not 0 <= index < MIG_DEVICES:
            self._raise("INVALID_ARGUMENT")
        if index >= len(self.mig.get(device.index, [])):
            self._raise("NOT_FOUND")
        return _MigHandle(device, index)

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> int:
        self._ready("nvmlDeviceIsMigDeviceHandle")
        return int(isinstance(device, _MigHandle))

    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2pIndex: int) -> int:
        self._ready("nvmlDeviceGetP2PStatus")
        if not isinstance(p2pIndex, int):
            raise ctypes.ArgumentError("argument 3: TypeError: wrong type")
        self._gpu(device1)
        self._gpu(device2)
        link = self._link(device1.index, device2.index)
        if p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK:
            return NVML_P2P_STATUS_OK if link and link["type"] == "nvlink" else NVML_P2P_STATUS_NOT_SUPPORTED
        if link is None or link["p2p"] is None:
            self._raise("NOT_SUPPORTED")
        return NVML_P2P_STATUS_OK if link["p2p"] else NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED


_API = [name for name in vars(FakeNVML) if name.startswith("nvml")]


def make_module(
    machine: dict | str | Path, *, mig: dict[int, list[tuple[int, int]]] | None = None
) -> tuple[types.ModuleType, FakeNVML]:
    """A module named ``pynvml`` answering from a machine fixture (its NVIDIA GPUs), and its state; ``mig``: the
    GPUs (by position among the NVIDIA ones) in MIG mode, with their MIG slices' (total, free) bytes."""
    data = machine if isinstance(machine, dict) else json.loads(Path(machine).read_text())
    gpus = [g for g in data.get("gpus", []) if g["vendor"] == "nvidia"]
    state = FakeNVML(
        gpus=gpus,
        links=list(data.get("links", [])),
        cuda_driver=data["software"].get("cuda_driver"),
        mig=dict(mig or {}),
    )
    module = types.ModuleType("pynvml")
    module.__file__ = __file__
    for name, value in globals().items():
        if name.startswith("NVML_") or name == "NVMLError" or name == "c_nvmlMemory_t":
            setattr(module, name, value)
    for name, code in _ERROR_CODES.items():
        setattr(module, f"NVML_ERROR_{name}", code)
    for cls in _ERROR_CLASSES.values():
        setattr(module, cls.__name__, cls)
    for name in _API:
        setattr(module, name, getattr(state, name))
    return module, state


def install(
    monkeypatch: Any, machine: dict | str | Path, *, mig: dict[int, list[tuple[int, int]]] | None = None
) -> FakeNVML:
    module, state = make_module(machine, mig=mig)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", module)
    return state
