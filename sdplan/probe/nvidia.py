"""NVIDIA backend: NVML through nvidia-ml-py (module ``pynvml``).

One query wrapper (:func:`_query`) runs every NVML call: a call that fails (NotSupported, NoPermission, an
old driver without the function, ...) gives ``None`` for that one field, never a crash and never a fake 0.
No driver at all (``NVMLError_LibraryNotFound``) means no NVIDIA GPUs; a note is added only when the kernel
shows an NVIDIA display controller, so a machine without one stays quiet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdplan.machine import GPU, Finding, Link
from sdplan.probe.host import PCI_VENDOR_NVIDIA, pci_display_vendors

# nvmlDeviceGetP2PStatus indexes, passed as literals: in nvidia-ml-py 13.615.71 the module constant
# NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (a stray trailing comma), which ctypes rejects.
P2P_INDEX_READ = 0
P2P_INDEX_NVLINK = 2
P2P_STATUS_OK = 0
NVLINK_MAX_LINKS_FALLBACK = 18  # NVML_NVLINK_MAX_LINKS is 18 in old bindings, 36 in new ones
MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE: nvmlDeviceGetMigMode's current mode
# the most MIG devices a GPU has (A100/H100: 7), where nvmlDeviceGetMaxMigDeviceCount fails
MIG_DEVICES_FALLBACK = 7
# the NVML functions whose fields the snapshot records, for the note that names those an old binding lacks
NVML_FIELD_FUNCTIONS = (
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetP2PStatus",
)


@dataclass(frozen=True)
class NvidiaReading:
    gpus: tuple[GPU, ...] = ()
    links: tuple[Link, ...] = ()
    driver_version: str | None = None
    cuda_driver: str | None = None  # highest CUDA version the driver supports, "12.4"
    notes: tuple[Finding, ...] = ()


def probe(index_start: int = 0, *, sys_root: str = "/sys", proc_root: str = "/proc") -> NvidiaReading:
    """Read every NVIDIA GPU NVML sees. GPU indexes start at ``index_start`` (NVML order = PCI bus order)."""
    try:
        import pynvml
    except ImportError:
        return NvidiaReading(notes=_evidence_note(sys_root, proc_root, _note_no_bindings))
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        if driver_loaded(proc_root):  # the kernel module runs; this process cannot see its library
            return NvidiaReading(notes=(_note_library_not_visible(),))
        return NvidiaReading(notes=_evidence_note(sys_root, proc_root, _note_no_driver))
    except pynvml.NVMLError as e:
        return NvidiaReading(notes=(_note_init_failed(e),))
    except Exception as e:  # a broken binding must not stop the report
        return NvidiaReading(notes=(_note_init_failed(e),))
    try:
        return _read(pynvml, index_start)
    finally:
        _query(pynvml, "nvmlShutdown")


def _read(nvml: Any, index_start: int) -> NvidiaReading:
    driver = _query(nvml, "nvmlSystemGetDriverVersion")
    # _v2 reads libnvidia-ml itself; bindings before nvidia-ml-py 11 have only the first (from libcuda)
    cuda_driver = cuda_version_string(
        _query(nvml, "nvmlSystemGetCudaDriverVersion_v2") or _query(nvml, "nvmlSystemGetCudaDriverVersion")
    )
    count, error = _call(nvml, "nvmlDeviceGetCount")
    if error is not None or not isinstance(count, int):
        return NvidiaReading(
            driver_version=driver, cuda_driver=cuda_driver, notes=(_note_count_failed(driver, error),)
        )
    gpus: list[GPU] = []
    handles: list[Any] = []
    notes: list[Finding] = []
    missing = [name for name in NVML_FIELD_FUNCTIONS if getattr(nvml, name, None) is None]
    for i in range(count):
        handle, error = _call(nvml, "nvmlDeviceGetHandleByIndex", i)
        if handle is None:
            gpus.append(GPU(index=index_start + i, vendor="nvidia", driver_version=driver))
            notes.append(_note_unreadable(index_start + i, i, None, "NVML cannot open it", error))
        else:
            gpu, error = _read_gpu(nvml, handle, index_start + i, driver)
            gpus.append(gpu)
            if gpu.memory_total_bytes is None and gpu.mig and gpu.mig_slices:  # NVML's error: only here
                slices = "MIG slice's" if gpu.mig_slices == 1 else "MIG slices'"
                what = f"NVML cannot read its {slices} memory"
                notes.append(_note_unreadable(gpu.index, i, gpu.name, what, error, mig=True))
            elif gpu.memory_total_bytes is None and not gpu.mig:  # MIG without a slice: a rule says so
                notes.append(_note_unreadable(gpu.index, i, gpu.name, "NVML cannot read its memory", error))
        handles.append(handle)
    names = [g.name or "" for g in gpus]
    lost = _old_bindings_lose(
        nvml, missing, cuda_driver_read=cuda_driver is not None, count=count, names=names
    )
    if lost:
        notes.insert(0, _note_old_bindings(nvml, missing, lost))
    return NvidiaReading(
        gpus=tuple(gpus),
        links=tuple(_read_links(nvml, handles, index_start)),
        driver_version=driver,
        cuda_driver=cuda_driver,
        notes=tuple(notes),
    )


def _read_gpu(nvml: Any, h: Any, index: int, driver: str | None) -> tuple[GPU, BaseException | None]:
    """The GPU, and the error NVML gave for its memory (None where it was read). In MIG mode the card's memory
    is the sum of its slices (NVML: "In MIG mode ... the API returns aggregate information"), which no process
    can use at once: the memory recorded is the largest slice's."""
    mode = _query(nvml, "nvmlDeviceGetMigMode", h)
    mig = mode[0] == MIG_ENABLED if isinstance(mode, (list, tuple)) and mode else None
    slices = 0
    if mig:
        memory = None
        slices, memories, memory_error = _mig_memories(nvml, h)
        if memories:
            memory = max(memories, key=lambda m: int(m.total))
    else:
        memory, memory_error = _call(nvml, "nvmlDeviceGetMemoryInfo", h)
    cc = _query(nvml, "nvmlDeviceGetCudaComputeCapability", h)
    cc_tuple = (int(cc[0]), int(cc[1])) if cc is not None else None
    # The link's capability, not its state: GPUs drop to PCIe gen 1 (and narrower) when idle, so where the
    # maximum cannot be read the current value is no stand-in: not available (the planner says what it assumes).
    gen = _query(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)
    width = _query(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
    power_mw = _first(nvml, h, "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetEnforcedPowerLimit")
    gpu = GPU(
        index=index,
        vendor="nvidia",
        name=_query(nvml, "nvmlDeviceGetName", h),
        uuid=_query(nvml, "nvmlDeviceGetUUID", h),
        memory_total_bytes=int(memory.total) if memory is not None else None,
        memory_free_bytes=int(memory.free) if memory is not None else None,
        compute_capability=f"{cc_tuple[0]}.{cc_tuple[1]}" if cc_tuple else None,
        gfx_arch=None,
        bf16=bf16_supported(cc_tuple),
        fp16=fp16_supported(cc_tuple),
        pcie_gen=int(gen) if gen else None,
        pcie_width=int(width) if width else None,
        power_limit_watts=round(power_mw / 1000, 1) if power_mw else None,
        driver_version=driver,
        mig=mig,
        mig_slices=slices if mig else None,
    )
    return gpu, memory_error


def _mig_memories(nvml: Any, h: Any) -> tuple[int, list[Any], BaseException | None]:
    """(how many MIG devices (slices) a GPU in MIG mode has, the memory of each NVML could read, the error of the
    first it could not read)."""
    count = _query(nvml, "nvmlDeviceGetMaxMigDeviceCount", h)
    slices, memories, error = 0, [], None
    for i in range(count if isinstance(count, int) and count > 0 else MIG_DEVICES_FALLBACK):
        # NotFound: no MIG device at this index
        mig = _query(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", h, i)
        if mig is None:
            continue
        slices += 1
        memory, e = _call(nvml, "nvmlDeviceGetMemoryInfo", mig)
        if memory is not None and int(memory.total) > 0:
            memories.append(memory)
        elif error is None:
            error = e
    return slices, memories, error


def _read_links(nvml: Any, handles: list[Any], index_start: int) -> list[Link]:
    active = [_nvlink_active(nvml, h) if h is not None else False for h in handles]
    links: list[Link] = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            ha, hb = handles[a], handles[b]
            if ha is None or hb is None:
                continue
            nvlink = False
            if active[a] and active[b]:
                # Both GPUs have NVLink up; P2P over NVLink tells whether it joins these two (bridge or NVSwitch).
                nvlink = _query(nvml, "nvmlDeviceGetP2PStatus", ha, hb, P2P_INDEX_NVLINK) == P2P_STATUS_OK
            status = _query(nvml, "nvmlDeviceGetP2PStatus", ha, hb, P2P_INDEX_READ)
            links.append(
                Link(
                    a=index_start + a,
                    b=index_start + b,
                    type="nvlink" if nvlink else "pcie",
                    p2p=None if status is None else status == P2P_STATUS_OK,
                )
            )
    return links


def _nvlink_active(nvml: Any, h: Any) -> bool:
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", NVLINK_MAX_LINKS_FALLBACK)
    not_supported = getattr(nvml, "NVMLError_NotSupported", ())
    for link in range(max_links):
        state, error = _call(nvml, "nvmlDeviceGetNvLinkState", h, link)
        if state == enabled:
            return True
        if isinstance(error, MissingFunction) or (not_supported and isinstance(error, not_supported)):
            return False  # this GPU has no NVLink at all, or the binding cannot ask
        # else: this link index does not exist on this GPU (InvalidArgument) or cannot be read
    return False


# -- the one query wrapper and small pure helpers -------------------------------------------------------


class MissingFunction(AttributeError):
    """An NVML function this ``pynvml`` binding does not define (nvidia-ml-py3 7.352 has no MIG, P2P, NVLink or
    compute-capability calls): that field is not available."""

    def __init__(self, name: str):
        super().__init__(f"this pynvml binding has no {name}")
        self.name = name


def _call(nvml: Any, name: str, *args: Any) -> tuple[Any, BaseException | None]:
    """Run the NVML function ``name``: (its value, None), or (None, the error) where it failed or the binding
    lacks it (:class:`MissingFunction`); never raises."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None, MissingFunction(name)
    try:
        value = fn(*args)
    except Exception as e:  # NVMLError, ctypes.ArgumentError, UnicodeDecodeError
        return None, e
    # old bindings (nvidia-ml-py3) return names, UUIDs and versions as bytes
    return (value.decode(errors="replace") if isinstance(value, bytes) else value), None


def _query(nvml: Any, name: str, *args: Any) -> Any:
    """Run one NVML call; any failure means "not available" (None)."""
    return _call(nvml, name, *args)[0]


def nvml_error_text(e: BaseException | None) -> str:
    """An NVML error as a person can look it up: "NVMLError_GpuIsLost: GPU is lost"."""
    if e is None:
        return "no error given"
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text and text != type(e).__name__ else type(e).__name__


def _first(nvml: Any, h: Any, *names: str) -> Any:
    for name in names:
        value = _query(nvml, name, h)
        if value:
            return value
    return None


def cuda_version_string(value: int | None) -> str | None:
    """NVML's CUDA version integer (12040) as "12.4"."""
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{(value % 1000) // 10}"


def bf16_supported(cc: tuple[int, int] | None) -> bool | None:
    """Hardware bf16: compute capability >= 8.0 (Ampere+). Not torch.cuda.is_bf16_supported(), which says
    yes on T4/V100 by counting emulation (field notes section 3)."""
    return None if cc is None else cc >= (8, 0)


def fp16_supported(cc: tuple[int, int] | None) -> bool | None:
    """Native half arithmetic: compute capability >= 5.3."""
    return None if cc is None else cc >= (5, 3)


# -- notes (facts the snapshot has no field for) ---------------------------------------------------------


def driver_loaded(proc_root: str = "/proc") -> bool:
    """Whether the NVIDIA kernel module is loaded: it creates /proc/driver/nvidia, which a container sees too
    (procfs shows the host's drivers) even where it was started without access to the GPUs."""
    try:
        return (Path(proc_root) / "driver" / "nvidia").exists()
    except OSError:
        return False


def _evidence_note(sys_root: str, proc_root: str, make: Any) -> tuple[Finding, ...]:
    """Say something only when the kernel shows an NVIDIA GPU (PCI display controller or a loaded module)."""
    seen = PCI_VENDOR_NVIDIA in pci_display_vendors(sys_root) or driver_loaded(proc_root)
    return (make(),) if seen else ()


def _note_no_bindings() -> Finding:
    return Finding(
        "warning",
        "nvml_bindings_missing",
        "an NVIDIA GPU is present but the NVML bindings (nvidia-ml-py) are not installed",
        "pip install nvidia-ml-py",
    )


# NVIDIA's GPUs with MIG (the MIG user guide's supported GPUs: A30, A100, H100, H200, B200, B300 and their
# variants, RTX PRO 4500 / 5000 / 6000 Blackwell): only there can an old binding miss that a GPU is in MIG mode
MIG_CAPABLE = re.compile(
    r"\b(A30|A100|A800|H100|H800|H200|H20|GH200|B100|B200|GB200|B300|GB300|RTX PRO (?:4500|5000|6000))\b",
    re.IGNORECASE,
)


def _old_bindings_lose(
    nvml: Any, missing: list[str], *, cuda_driver_read: bool, count: int, names: list[str] | None = None
) -> list[str]:
    """What the NVML functions an old binding lacks (``missing``) leave unread here, in words, and where the
    report shows it: only what no older function read instead (the CUDA version from
    nvmlSystemGetCudaDriverVersion, the power limit from the enforced one) and what matters here (links only
    between GPUs)."""
    gone = set(missing)
    lost = []
    if "nvmlSystemGetCudaDriverVersion_v2" in gone and not cuda_driver_read:
        lost.append("the CUDA version the driver supports (n/a under Stack)")
    if "nvmlDeviceGetMemoryInfo" in gone:
        lost.append("the GPUs' memory (n/a: they are left out of the plans)")
    if "nvmlDeviceGetCudaComputeCapability" in gone:
        lost.append(
            "compute capability, and bf16 and fp16 by it (n/a under GPUs; plans take the GPU catalog's)"
        )
    if gone & {"nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"}:
        lost.append("the PCIe link's generation or width (n/a or ? under GPUs)")
    if (
        "nvmlDeviceGetPowerManagementLimit" in gone
        and getattr(nvml, "nvmlDeviceGetEnforcedPowerLimit", None) is None
    ):
        lost.append("the power limit (n/a under GPUs)")
    mig_capable = names is None or any(MIG_CAPABLE.search(n) for n in names)
    if mig_capable and gone & {"nvmlDeviceGetMigMode", "nvmlDeviceGetMigDeviceHandleByIndex"}:
        lost.append(
            "whether a GPU is in MIG mode (A100, H100 and newer data-center cards): its memory is read as the whole "
            "card's, but in MIG mode (`nvidia-smi -q`, 'MIG Mode') a run gets one MIG slice, with a fraction of "
            "the memory and compute planned"
        )
    if count > 1 and gone & {"nvmlDeviceGetNvLinkState", "nvmlDeviceGetP2PStatus"}:
        lost.append(
            "NVLink and P2P between the GPUs (P2P n/a under Links, and every pair read as PCIe: `nvidia-smi topo "
            "-m` shows NVLink)"
        )
    return lost


def _note_old_bindings(nvml: Any, missing: list[str], lost: list[str]) -> Finding:
    where = getattr(nvml, "__file__", None)
    return Finding(
        "warning",
        "nvml_bindings_old",
        f"the NVML bindings (pynvml{f' at {where}' if where else ''}) are too old to have "
        f"{', '.join(missing)}, so doctor cannot read or check {'; '.join(lost)}",
        "pip install -U nvidia-ml-py (first `pip uninstall nvidia-ml-py3` where it is installed: it ships an "
        "old pynvml.py)",
    )


def _note_no_driver() -> Finding:
    return Finding(
        "error",
        "nvidia_driver_missing",
        "an NVIDIA GPU is present but libnvidia-ml.so.1 was not found: the NVIDIA driver is not installed",
        "install the NVIDIA driver (then `nvidia-smi` must list the GPU)",
    )


def _note_count_failed(driver: str | None, e: BaseException | None) -> Finding:
    return Finding(
        "error",
        "nvml_count_failed",
        f"the NVIDIA driver{f' {driver}' if driver else ''} is installed and NVML started, but NVML could not "
        f"count the GPUs ({nvml_error_text(e)}): no NVIDIA GPU can be planned",
        "run `nvidia-smi` to see why: NoPermission means this user cannot open /dev/nvidia* (the video group, "
        "or a container started without --gpus); GpuIsLost or Unknown needs a GPU reset (`nvidia-smi -r`) or a "
        "reboot",
    )


def _note_unreadable(
    index: int, nvml_index: int, name: str | None, what: str, e: BaseException | None, *, mig: bool = False
) -> Finding:
    """``mig``: the card answers, its MIG slices' memory does not (no reset brings that back)."""
    return Finding(
        "warning",
        "gpu_unreadable",
        f"NVIDIA GPU {index}{f' ({name})' if name else ''} is present but {what} ({nvml_error_text(e)}): "
        "it is left out of the plans",
        f"run `nvidia-smi -q -i {nvml_index}` to see why"
        + (
            f", and `nvidia-smi mig -lgi -i {nvml_index}` for its slices' profiles, whose names end in their "
            "memory (NoPermission: this user's access to /dev/nvidia-caps, which MIG devices need, or in a "
            "container the MIG devices passed to it)"
            if mig
            else " (GPU lost or reset required: `nvidia-smi -r` or a reboot; NoPermission: this user's access to "
            "/dev/nvidia*)"
        ),
    )


def _note_library_not_visible() -> Finding:
    return Finding(
        "error",
        "nvidia_library_not_visible",
        "the NVIDIA driver is loaded (/proc/driver/nvidia exists) but its library libnvidia-ml.so.1 is not "
        "visible to this process: a container started without GPU access, or the driver's user-space part is "
        "missing from the library path",
        "start the container with the GPUs: `docker run --gpus all ...` (needs the NVIDIA Container Toolkit; "
        "Podman: --device nvidia.com/gpu=all; Kubernetes: an nvidia.com/gpu resource); on the host itself, "
        "reinstall the driver's user-space libraries (`ldconfig -p | grep libnvidia-ml` must list them)",
    )


def _note_init_failed(e: BaseException) -> Finding:
    return Finding(
        "error",
        "nvml_init_failed",
        f"the NVIDIA driver library is present but NVML failed to start: {e}",
        "run `nvidia-smi`; a driver/library version mismatch or an unloaded driver module needs a reboot",
    )
