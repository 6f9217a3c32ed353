"""AMD backend: amdsmi (the Python bindings of ROCm's libamd_smi.so).

The import itself is guarded: amdsmi not installed, or installed without libamd_smi.so (its wrapper then
prints to stdout and fails with KeyError), means no AMD GPUs. A note is added only when the kernel shows an
AMD GPU (/dev/kfd, or a PCI display controller with vendor 0x1002). One query wrapper (:func:`_query`) runs
every amdsmi call; a failing call gives ``None`` for that one field.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdplan.machine import GPU, Finding, Link
from sdplan.probe.host import PCI_VENDOR_AMD, pci_display_vendors

IOLINK_TYPE_XGMI = 2  # AMDSMI_IOLINK_TYPE_XGMI (1 is PCIe)


@dataclass(frozen=True)
class AmdReading:
    gpus: tuple[GPU, ...] = ()
    links: tuple[Link, ...] = ()
    rocm: str | None = None
    notes: tuple[Finding, ...] = ()


def probe(
    index_start: int = 0,
    *,
    sys_root: str = "/sys",
    dev_root: str = "/dev",
    rocm_root: str | None = None,
) -> AmdReading:
    """Read every AMD GPU amdsmi sees. GPU indexes start at ``index_start``."""
    rocm_root = rocm_root or os.environ.get("ROCM_PATH") or "/opt/rocm"
    amdsmi, error = _import_amdsmi()
    if amdsmi is None:
        notes = (_note_missing(error),) if amd_gpu_evidence(sys_root, dev_root) else ()
        return AmdReading(rocm=rocm_version_file(rocm_root), notes=notes)
    try:
        flags = amdsmi.AmdSmiInitFlags
        amdsmi.amdsmi_init(getattr(flags, "INIT_AMD_GPUS", None) or flags.AMD_GPUS)
    except Exception as e:  # AmdSmiLibraryException (driver not loaded, no permission) or a broken binding
        notes = (_note_init_failed(e),) if amd_gpu_evidence(sys_root, dev_root) else ()
        return AmdReading(rocm=rocm_version_file(rocm_root), notes=notes)
    try:
        reading = _read(amdsmi, index_start)
        rocm = rocm_version_string(_query(amdsmi, "amdsmi_get_rocm_version"))  # ROCm 6.4+ bindings
    finally:
        _query(amdsmi, "amdsmi_shut_down")
    return AmdReading(
        gpus=reading.gpus,
        links=reading.links,
        rocm=rocm or rocm_version_file(rocm_root),
        notes=reading.notes,
    )


def _import_amdsmi() -> tuple[Any, BaseException | None]:
    try:
        # amdsmi's wrapper prints "Unable to find amdsmi library ..." to stdout when libamd_smi.so is
        # missing; keep that out of `sdplan doctor --json`.
        with contextlib.redirect_stdout(io.StringIO()):
            import amdsmi
    except Exception as e:  # ImportError, or KeyError/OSError from a missing libamd_smi.so
        return None, e
    return amdsmi, None


def _read(amdsmi: Any, index_start: int) -> AmdReading:
    handles = _query(amdsmi, _renamed(amdsmi, "handles")) or []
    gpus = tuple(_read_gpu(amdsmi, h, index_start + i) for i, h in enumerate(handles))
    nodes = [_kfd_node(amdsmi, h) for h in handles]
    hip = hip_indexes(nodes)
    gpus = tuple(replace(g, hip_index=i, kfd_node=n) for g, i, n in zip(gpus, hip, nodes, strict=True))
    links: list[Link] = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            info = _query(amdsmi, "amdsmi_topo_get_link_type", handles[a], handles[b])
            kind = info.get("type") if isinstance(info, dict) else None
            p2p = _query(amdsmi, "amdsmi_is_P2P_accessible", handles[a], handles[b])
            links.append(
                Link(
                    a=index_start + a,
                    b=index_start + b,
                    type="xgmi" if _int(kind) == IOLINK_TYPE_XGMI else "pcie",
                    p2p=bool(p2p) if p2p is not None else None,
                )
            )
    return AmdReading(gpus=gpus, links=tuple(links))


def _read_gpu(amdsmi: Any, h: Any, index: int) -> GPU:
    asic = _query(amdsmi, _renamed(amdsmi, "asic"), h) or {}
    arch = parse_gfx_arch(asic.get("target_graphics_version"))  # newer bindings only: older ones give no arch
    vram = getattr(getattr(amdsmi, "AmdSmiMemoryType", None), "VRAM", None)
    total = _int(_query(amdsmi, _renamed(amdsmi, "memory_total"), h, vram))
    used = _int(_query(amdsmi, _renamed(amdsmi, "memory_usage"), h, vram))
    if total is None:  # older libraries: MB figures
        usage = _query(amdsmi, _renamed(amdsmi, "vram_usage"), h) or {}
        total_mb, used_mb = _int(usage.get("vram_total")), _int(usage.get("vram_used"))
        total = total_mb * 2**20 if total_mb else None
        used = used_mb * 2**20 if used_mb is not None else None
    pcie = _query(amdsmi, "amdsmi_get_pcie_info", h) or {}
    static = pcie.get("pcie_static", {}) if isinstance(pcie, dict) else {}
    power = _query(amdsmi, "amdsmi_get_power_cap_info", h) or {}
    power_uw = _int(power.get("power_cap"))
    driver = _query(amdsmi, "amdsmi_get_gpu_driver_info", h) or {}  # ROCm 6.0+; older: the version string
    driver_version = driver.get("driver_version") if isinstance(driver, dict) else None
    return GPU(
        index=index,
        vendor="amd",
        name=_text(asic.get("market_name")),
        uuid=_text(_query(amdsmi, _renamed(amdsmi, "uuid"), h)),
        memory_total_bytes=total or None,
        memory_free_bytes=total - used if total and used is not None and used <= total else None,
        compute_capability=None,
        gfx_arch=arch,
        bf16=amd_bf16(arch),
        fp16=amd_fp16(arch),
        pcie_gen=_int(static.get("pcie_interface_version")) or None,
        # the link's maximum only: the current width (pcie_metric) is the link's state, not its capability
        pcie_width=_int(static.get("max_pcie_width")) or None,
        power_limit_watts=round(power_uw / 1_000_000, 1) if power_uw else None,
        driver_version=_text(driver_version or _query(amdsmi, _renamed(amdsmi, "driver_version"), h)),
    )


def _kfd_node(amdsmi: Any, h: Any) -> int | None:
    """The GPU's KFD topology node id (``amdsmi_get_gpu_kfd_info``; older bindings lack it); None where not read."""
    info = _query(amdsmi, "amdsmi_get_gpu_kfd_info", h)
    return _int(info.get("node_id")) if isinstance(info, dict) else None


# -- the one query wrapper and pure helpers --------------------------------------------------------------


def hip_indexes(nodes: list[int | None]) -> list[int | None]:
    """HIP's device numbers from the GPUs' KFD node ids: HIP enumerates GPUs in KFD node order, so a GPU's
    number is its node's rank among the GPUs' nodes (amd-smi: node id minus the smallest GPU node id, the same
    where the ids are consecutive). All None unless every node is known and distinct: a partial map would number
    the rest wrongly."""
    if not nodes or any(n is None for n in nodes) or len(set(nodes)) != len(nodes):
        return [None] * len(nodes)
    order = sorted(nodes)
    return [order.index(n) for n in nodes]


# amdsmi functions ROCm 5.7 renamed, each with its older name (ROCm/amdsmi py-interface/amdsmi_interface.py at
# rocm-5.6.1 and rocm-5.7.0): a 5.5-5.6 binding lists its GPUs with amdsmi_get_device_handles, and read by the
# new names alone they vanished (no_gpu). The driver's version is a string before 6.0's driver info (5.7:
# amdsmi_get_gpu_driver_version). Older asic info has no target_graphics_version: the arch is not available.
_RENAMED = {
    "handles": ("amdsmi_get_processor_handles", "amdsmi_get_device_handles"),
    "asic": ("amdsmi_get_gpu_asic_info", "amdsmi_get_asic_info"),
    "uuid": ("amdsmi_get_gpu_device_uuid", "amdsmi_get_device_uuid"),
    "memory_total": ("amdsmi_get_gpu_memory_total", "amdsmi_dev_get_memory_total"),
    "memory_usage": ("amdsmi_get_gpu_memory_usage", "amdsmi_dev_get_memory_usage"),
    "vram_usage": ("amdsmi_get_gpu_vram_usage", "amdsmi_get_vram_usage"),
    "driver_version": ("amdsmi_get_gpu_driver_version", "amdsmi_get_driver_version"),
}


def _renamed(amdsmi: Any, key: str) -> str:
    """The name this binding gives the function :data:`_RENAMED` calls ``key``: the newest it defines (the newest
    of all where it defines none, which :func:`_query` answers as not available)."""
    names = _RENAMED[key]
    return next((name for name in names if getattr(amdsmi, name, None) is not None), names[0])


def _query(amdsmi: Any, name: str, *args: Any) -> Any:
    """Run the amdsmi function ``name``; any failure (AmdSmiLibraryException NOT_SUPPORTED, ...), or a binding
    without the function (older ROCm releases lack some), means None."""
    fn = getattr(amdsmi, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:
        return None


def _int(value: Any) -> int | None:
    """amdsmi writes "N/A" for values it cannot read; only real integers count."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return None


def _text(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value if value and value != "N/A" else None


_GFX_RE = re.compile(r"^(?:gfx)?([0-9a-f]+)(?::.*)?$")


def parse_gfx_arch(value: Any) -> str | None:
    """A gfx target as LLVM names it ("gfx90a", "gfx1030") from the forms amdsmi and KFD give.

    - "gfx90a", "gfx1030", "gfx942:sramecc+:xnack-", "90a", 1030: already the name;
    - KFD's gfx_target_version (major*10000 + minor*100 + stepping): 90010 -> gfx90a, 100300 -> gfx1030;
    - amdsmi's decimal rendering of it (rocm_smi ``rsmi_get_gfx_target_version``), which loses the hex
      stepping and, for minor 0, multiplies the major by 10: "gfx9010" -> gfx90a, "gfx9008" -> gfx908,
      "gfx11000" -> gfx1100, "gfx11001" -> gfx1101.
    """
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip().lower()
    match = _GFX_RE.match(text)
    if not match:
        return None
    digits = match.group(1)
    if not digits.isdigit():
        return f"gfx{digits}"  # has a hex stepping: already the LLVM name
    n = int(digits)
    if len(digits) == 6 or (len(digits) == 5 and digits[0] == "9"):  # KFD gfx_target_version
        major, minor, step = n // 10000, (n // 100) % 100, n % 100
        return f"gfx{major}{minor:x}{step:x}"
    if len(digits) == 5 and digits[0] == "1":  # amdsmi decimal, minor 0: major*1000 + stepping
        major, step = n // 1000, n % 1000
        return f"gfx{major}0{step:x}"
    if len(digits) == 4 and digits[0] == "9":  # amdsmi decimal for gfx9 minor 0: 9000 + stepping
        return f"gfx90{n - 9000:x}" if 9000 <= n < 9016 else None
    if len(digits) in (3, 4):
        return f"gfx{digits}"
    return None


def amd_bf16(arch: str | None) -> bool | None:
    """Hardware bf16 by gfx arch (ROCm HIP docs, hardware_features; field notes section 3): RDNA1/RDNA2
    (gfx101x/gfx103x) no; RDNA3/3.5 (gfx11xx) and RDNA4 (gfx12xx) yes; CDNA1-4 (gfx908/90a/94x/950) yes;
    GCN/Vega (gfx8xx, gfx900/906/90c) no. torch on ROCm says "supported" for every arch: do not ask it."""
    if not arch or not arch.startswith("gfx"):
        return None
    family = arch[3:]
    if arch in ("gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"):
        return True
    if family.startswith(("11", "12")) and len(family) == 4:
        return True
    if family.startswith("10") and len(family) == 4:
        return False
    if len(family) == 3 and family[0] in "89":
        return False
    return None


def amd_fp16(arch: str | None) -> bool | None:
    """fp16 arithmetic: every GCN3+ / RDNA / CDNA arch (gfx8xx onward)."""
    if not arch or not arch.startswith("gfx"):
        return None
    family = arch[3:]
    if (len(family) == 3 and family[0] in "89") or (len(family) == 4 and family[:2] in ("10", "11", "12")):
        return True
    return None


def rocm_version_string(value: Any) -> str | None:
    """amdsmi_get_rocm_version() returns (True, "6.3.1") in current amdsmi; accept a plain string too."""
    if isinstance(value, tuple) and len(value) == 2:
        ok, text = value
        return _clean_version(text) if ok else None
    return _clean_version(value)


def rocm_version_file(rocm_root: str = "/opt/rocm") -> str | None:
    """ROCm's installed version from <ROCM_PATH>/.info/version ("6.2.4-120" -> "6.2.4")."""
    try:
        return _clean_version((Path(rocm_root) / ".info" / "version").read_text())
    except OSError:
        return None


def _clean_version(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    match = re.match(r"\s*(\d+(?:\.\d+){0,2})", value)
    return match.group(1) if match else None


def amd_gpu_evidence(sys_root: str = "/sys", dev_root: str = "/dev") -> bool:
    return (Path(dev_root) / "kfd").exists() or PCI_VENDOR_AMD in pci_display_vendors(sys_root)


def _note_missing(error: BaseException | None) -> Finding:
    why = (
        "not installed"
        if isinstance(error, ModuleNotFoundError)
        else f"not loadable ({type(error).__name__})"
    )
    return Finding(
        "info",
        "amdsmi_missing",
        f"an AMD GPU is present but amdsmi is {why}: sdplan cannot read it",
        "install ROCm (it provides libamd_smi.so), then `pip install amdsmi==<your ROCm version>`",
    )


def _note_init_failed(e: BaseException) -> Finding:
    return Finding(
        "warning",
        "amdsmi_init_failed",
        f"an AMD GPU is present but amdsmi could not start: {e}".replace("\n", " "),
        "check that the amdgpu driver is loaded and your user is in the 'render' and 'video' groups",
    )
