"""A stand-in for the ``amdsmi`` Python package that answers from a machine fixture (snapshot JSON).

It keeps the real API's names, signatures, enums, exception classes and return shapes (dicts with the
real keys, "N/A" where the library writes it), so sdplan's real amdsmi backend runs against it unchanged:

- ``amdsmi_init(flag)`` insists on an ``AmdSmiInitFlags`` member and every processor function on a handle it
  issued (``AmdSmiParameterException`` otherwise), as the real type checks do;
- calls before ``amdsmi_init`` raise ``AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)``; a fixture field that
  is null raises ``AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)`` (or reads "N/A" where the real
  library returns that instead of failing);
- ``target_graphics_version`` is rendered the way rocm_smi renders KFD's gfx_target_version in decimal
  (``gfx_form="decimal"``: gfx90a -> "gfx9010", gfx1100 -> "gfx11000"), or as the plain name
  (``gfx_form="name"``), so the backend's parser is exercised on both;
- ``amdsmi_get_rocm_version()`` returns ``(True, "6.2.4")`` as current amdsmi does.

Use :func:`install` (monkeypatch ``sys.modules["amdsmi"]``) or :func:`make_module`.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34

_STATUS_TEXT = {
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR - Initialization error",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
}


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8
    INIT_AMD_APUS = 3


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiIoLinkType(IntEnum):
    UNDEFINED = 0
    PCIEXPRESS = 1
    XGMI = 2
    NUMIOLINKTYPES = 3
    SIZE = 0xFFFFFFFF


class AmdSmiException(Exception):
    """Base smi exception class."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int):
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _STATUS_TEXT.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self) -> str:
        return self.err_info

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, receivedValue: Any, expectedType: Any, msg: str | None = None):
        super().__init__(msg)
        self.err_code = None
        self.actualType = type(receivedValue)
        self.expectedType = expectedType
        self.err_msg = (
            msg or f"Invalid parameter:\nActual type: {self.actualType}\nExpected type: {expectedType}"
        )

    def __str__(self) -> str:
        return self.err_msg


class amdsmi_processor_handle:
    """Opaque handle type (a ctypes void pointer in the real wrapper)."""

    def __init__(self, position: int):
        self.position = position


def kfd_decimal(arch: str) -> str:
    """gfx name -> the decimal string rocm_smi builds from KFD's gfx_target_version (a lossy rendering)."""
    digits = arch[3:]
    major = int(digits[:-2])
    minor, step = int(digits[-2], 16), int(digits[-1], 16)
    if minor == 0:
        return f"gfx{major * 1000 + step}"
    return f"gfx{major * 100 + minor * 10 + step}"


@dataclass
class FakeAmdSmi:
    gpus: list[dict]
    links: list[dict]
    rocm: str | None
    gfx_form: str = "decimal"
    calls: list[str] = field(default_factory=list)
    initialized: bool = False
    handles: list[amdsmi_processor_handle] = field(default_factory=list)

    def _ready(self, fn: str) -> None:
        self.calls.append(fn)
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)

    def _gpu(self, handle: Any) -> dict:
        if not isinstance(handle, amdsmi_processor_handle) or handle not in self.handles:
            raise AmdSmiParameterException(handle, amdsmi_processor_handle)
        return self.gpus[handle.position]

    def _field(self, handle: Any, key: str) -> Any:
        value = self._gpu(handle)[key]
        if value is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return value

    def _link(self, src: Any, dst: Any) -> dict | None:
        a, b = self._gpu(src)["index"], self._gpu(dst)["index"]
        return next((lk for lk in self.links if {lk["a"], lk["b"]} == {a, b}), None)

    # -- the API ------------------------------------------------------------------------------------
    def amdsmi_init(self, flag: Any = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self.calls.append("amdsmi_init")
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag, AmdSmiInitFlags)
        if not self.gpus:
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        self._ready("amdsmi_shut_down")
        self.initialized = False

    def amdsmi_get_processor_handles(self) -> list[amdsmi_processor_handle]:
        self._ready("amdsmi_get_processor_handles")
        if not self.handles:
            self.handles = [amdsmi_processor_handle(i) for i in range(len(self.gpus))]
        return list(self.handles)

    def amdsmi_get_gpu_asic_info(self, processor_handle: Any) -> dict[str, Any]:
        self._ready("amdsmi_get_gpu_asic_info")
        gpu = self._gpu(processor_handle)
        arch = gpu["gfx_arch"]
        return {
            "market_name": gpu["name"] or "N/A",
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x73a3",
            "rev_id": "0x00",
            "asic_serial": "0x0000000000000000",
            "oam_id": "N/A",
            "num_compute_units": 60,
            "target_graphics_version": (kfd_decimal(arch) if self.gfx_form == "decimal" else arch)
            if arch
            else "gfx18446744073709551615",
        }

    def amdsmi_get_gpu_kfd_info(self, processor_handle: Any) -> dict[str, int]:
        """KFD node ids in HIP's order from the fixture's ``hip_index`` (node 0 is the CPU); NOT_SUPPORTED where
        the fixture has none, as older bindings lack the call."""
        self._ready("amdsmi_get_gpu_kfd_info")
        hip = self._gpu(processor_handle).get("hip_index")
        if hip is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return {"kfd_id": 20000 + hip, "node_id": hip + 1, "current_partition_id": 0}

    def amdsmi_get_gpu_device_uuid(self, processor_handle: Any) -> str:
        self._ready("amdsmi_get_gpu_device_uuid")
        return self._field(processor_handle, "uuid")

    def amdsmi_get_gpu_memory_total(self, processor_handle: Any, mem_type: Any) -> int:
        self._ready("amdsmi_get_gpu_memory_total")
        if not isinstance(mem_type, AmdSmiMemoryType):
            raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
        if mem_type != AmdSmiMemoryType.VRAM:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return self._field(processor_handle, "memory_total_bytes")

    def amdsmi_get_gpu_memory_usage(self, processor_handle: Any, mem_type: Any) -> int:
        self._ready("amdsmi_get_gpu_memory_usage")
        if not isinstance(mem_type, AmdSmiMemoryType):
            raise AmdSmiParameterException(mem_type, AmdSmiMemoryType)
        total = self._field(processor_handle, "memory_total_bytes")
        return total - self._field(processor_handle, "memory_free_bytes")

    def amdsmi_get_gpu_vram_usage(self, processor_handle: Any) -> dict[str, int]:
        self._ready("amdsmi_get_gpu_vram_usage")
        total = self._field(processor_handle, "memory_total_bytes")
        free = self._gpu(processor_handle)["memory_free_bytes"] or total
        return {"vram_total": total // 2**20, "vram_used": (total - free) // 2**20}

    def amdsmi_get_gpu_driver_info(self, processor_handle: Any) -> dict[str, str]:
        self._ready("amdsmi_get_gpu_driver_info")
        version = self._field(processor_handle, "driver_version")
        return {"driver_name": "amdgpu", "driver_version": version, "driver_date": "2015/01/01 00:00"}

    def amdsmi_get_pcie_info(self, processor_handle: Any) -> dict[str, Any]:
        self._ready("amdsmi_get_pcie_info")
        gpu = self._gpu(processor_handle)
        gen, width = gpu["pcie_gen"], gpu["pcie_width"]
        speed = {3: 8000, 4: 16000, 5: 32000}.get(gen, "N/A")
        return {
            "pcie_static": {
                "max_pcie_width": width if width is not None else "N/A",
                "max_pcie_speed": speed,
                "pcie_interface_version": gen if gen is not None else "N/A",
                "slot_type": "PCIE",
            },
            "pcie_metric": {
                "pcie_width": width if width is not None else "N/A",
                "pcie_speed": 2500,  # idle link speed
                "pcie_bandwidth": "N/A",
                "pcie_replay_count": 0,
                "pcie_l0_to_recovery_count": 0,
                "pcie_replay_roll_over_count": 0,
                "pcie_nak_sent_count": 0,
                "pcie_nak_received_count": 0,
                "pcie_lc_perf_other_end_recovery_count": "N/A",
            },
        }

    def amdsmi_get_power_cap_info(self, processor_handle: Any, sensor_ind: int = 0) -> dict[str, int]:
        self._ready("amdsmi_get_power_cap_info")
        microwatts = int(round(self._field(processor_handle, "power_limit_watts") * 1_000_000))
        return {
            "power_cap": microwatts,
            "default_power_cap": microwatts,
            "dpm_cap": 0,
            "min_power_cap": 0,
            "max_power_cap": microwatts,
        }

    def amdsmi_topo_get_link_type(
        self, processor_handle_src: Any, processor_handle_dst: Any
    ) -> dict[str, int]:
        self._ready("amdsmi_topo_get_link_type")
        link = self._link(processor_handle_src, processor_handle_dst)
        if link is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        xgmi = link["type"] == "xgmi"
        return {
            "hops": 1 if xgmi else 2,
            "type": AmdSmiIoLinkType.XGMI if xgmi else AmdSmiIoLinkType.PCIEXPRESS,
        }

    def amdsmi_is_P2P_accessible(self, processor_handle_src: Any, processor_handle_dst: Any) -> bool:
        self._ready("amdsmi_is_P2P_accessible")
        link = self._link(processor_handle_src, processor_handle_dst)
        if link is None or link["p2p"] is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return bool(link["p2p"])

    def amdsmi_get_rocm_version(self) -> tuple[bool, str]:
        self.calls.append("amdsmi_get_rocm_version")
        if not self.rocm:
            return (False, "Could not load librocm-core.so")
        return (True, self.rocm)


_API = [name for name in vars(FakeAmdSmi) if name.startswith("amdsmi_")]


def make_module(
    machine: dict | str | Path, *, gfx_form: str = "decimal"
) -> tuple[types.ModuleType, FakeAmdSmi]:
    """A module named ``amdsmi`` answering from a machine fixture (its AMD GPUs), and its state."""
    data = machine if isinstance(machine, dict) else json.loads(Path(machine).read_text())
    gpus = [g for g in data.get("gpus", []) if g["vendor"] == "amd"]
    state = FakeAmdSmi(
        gpus=gpus, links=list(data.get("links", [])), rocm=data["software"].get("rocm"), gfx_form=gfx_form
    )
    module = types.ModuleType("amdsmi")
    module.__file__ = __file__
    for name in (
        "AmdSmiInitFlags",
        "AmdSmiMemoryType",
        "AmdSmiIoLinkType",
        "AmdSmiException",
        "AmdSmiLibraryException",
        "AmdSmiParameterException",
    ):
        setattr(module, name, globals()[name])
    for name in _API:
        setattr(module, name, getattr(state, name))
    return module, state


def install(monkeypatch: Any, machine: dict | str | Path, *, gfx_form: str = "decimal") -> FakeAmdSmi:
    module, state = make_module(machine, gfx_form=gfx_form)
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    return state
