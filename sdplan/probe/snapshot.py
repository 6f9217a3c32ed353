"""Read the machine once into a :class:`~sdplan.machine.Snapshot`, and judge it.

:func:`probe` does all the I/O (host, NVML, amdsmi, software) and returns an immutable snapshot with its
findings. :func:`findings` is a pure function of a snapshot (no I/O), so saved snapshots and test fixtures
are judged by exactly the rules a live run uses. Every threshold and hardware fact cites its source
(/work/shared/reference/field-notes.md, "field notes" below).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

from sdplan.machine import GPU, GTX16_FP16_NAN_SOURCES, Finding, Snapshot, fp16_gives_nan
from sdplan.trainer.dataset_scan import count_of

# -- thresholds ----------------------------------------------------------------------------------------
# Field notes section 1 ("How many GPUs do you need"): 16 GB RAM minimum, 32 GB comfortable for training,
# >= 10 GB free on an SSD. RAM is compared in decimal GB: a "16 GB" machine reports ~16.6e9 bytes MemTotal.
RAM_MIN_BYTES = 16 * 10**9
RAM_COMFORT_BYTES = 32 * 10**9
DISK_MIN_BYTES = 10 * 10**9
# GPU memory other processes hold when doctor ran, above which a plan on the whole card may not fit: a desktop's
# display and an idle CUDA context hold well under 2 GiB (the lent H100's fixture: 0.5 GiB).
GPU_IN_USE_MIN_BYTES = 2 * 2**30
GPU_IN_USE_MIN_SHARE = 0.10
# DeepSpeed's ds_report warns below 512 MB of /dev/shm (field notes section 4); DataLoader workers need it.
SHM_MIN_BYTES = 512 * 2**20
# amdgpu recovers from hangs by GPU reset (BACO) from kernel 5.19 (field notes section 1, lunar-diffusion).
AMD_MIN_KERNEL = (5, 19)

# gfx arches the ROCm PyTorch wheels ship kernels for, by the torch release that added them; any other arch
# fails with "invalid device function" (field notes section 3). Sources: pytorch/pytorch#132570 (base set),
# #141667 (gfx1101), #147761 (gfx1102), #148562 (gfx1200/1201), .ci/docker/*/build.sh PYTORCH_ROCM_ARCH
# of the ROCm 6.4 / 7.0 builds (gfx950/1150/1151; dated conservatively to 2.9).
ROCM_WHEEL_ARCHES: tuple[tuple[tuple[int, int], frozenset[str]], ...] = (
    ((0, 0), frozenset({"gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx1030", "gfx1100"})),
    ((2, 6), frozenset({"gfx1101"})),
    ((2, 7), frozenset({"gfx1102", "gfx1200", "gfx1201"})),
    ((2, 9), frozenset({"gfx950", "gfx1150", "gfx1151"})),
)

# HSA_OVERRIDE_GFX_VERSION per unofficial arch: (value, caveat). Field notes section 3; gfx1103 hangs:
# pytorch/pytorch#179653. No wheel has gfx101x kernels, so RDNA1 needs a source build as well.
HSA_OVERRIDES: dict[str, tuple[str, str]] = {
    **{f"gfx103{d}": ("10.3.0", "unofficial, runs as gfx1030") for d in "123456"},
    "gfx1101": ("11.0.0", "runs as gfx1100; results are mixed"),
    "gfx1102": ("11.0.0", "runs as gfx1100; results are mixed"),
    "gfx1103": ("11.0.0", "runs as gfx1100; page faults and hangs are reported"),
    "gfx1010": ("10.1.0", "only with a torch built for gfx1010 (PYTORCH_ROCM_ARCH=gfx1010)"),
    "gfx1011": ("10.1.0", "only with a torch built for gfx1010 (PYTORCH_ROCM_ARCH=gfx1010)"),
    "gfx1012": ("10.1.0", "only with a torch built for gfx1010 (PYTORCH_ROCM_ARCH=gfx1010)"),
}

# The CUDA builds of the torch pip installs now (download.pytorch.org/whl/cuXYZ), to name a matching index.
# Releases 2.12 to 2.14 publish cu126 (legacy: Maxwell to Hopper) and cu130 (stable: Turing to Blackwell), and
# cu132, experimental in 2.12, left out here (PyTorch RELEASE.md "PyTorch CUDA Support Matrix", PR 197555;
# 2.12 dropped cu128: PR 182849, RFC pytorch/pytorch#178665).
TORCH_CUDA_WHEELS = ("12.6", "13.0")
# Older builds, for a driver that runs none of those with the GPUs' kernels, each with the last torch release
# that publishes it, newest release first: cu128 to 2.11, for Blackwell under a CUDA 12.8-12.9 driver (R570/R575;
# pytorch/FBGEMM PR 5976 counted the wheels: "cu128's last version was 2.11"), and cu118 to 2.7, Maxwell to
# Hopper under a CUDA 11 driver (2.7 built cu118, cu126 and cu128; 2.8 dropped cu118: RFC
# pytorch/pytorch#147383).
TORCH_CUDA_LEGACY_WHEELS = (("12.8", "2.11"), ("11.8", "2.7"))
# CUDA minor-version compatibility (NVIDIA "CUDA Compatibility", "Minor Version Compatibility"): a build for CUDA
# X.y runs on any driver of major X at least this version (Linux; Windows: 452.39, 527.41, 580.88), and on every
# newer major; only kernels compiled at run time from PTX need a driver for the build's own X.y. The GPUs' driver
# version is checked where the snapshot records it (the driver's CUDA version says only X.y).
CUDA_MINOR_COMPAT_DRIVERS = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# Blackwell GPUs (compute capability 10.x, 12.x) run only under a driver for CUDA 12.8 or newer (R570)
BLACKWELL_DRIVER_CUDA = (12, 8)

# Every code :func:`findings` can produce. Other codes in a snapshot are probe-time notes (a backend that
# could not load, a container memory limit): facts the rules cannot recompute from the snapshot.
RULE_CODES = frozenset(
    {
        "no_gpu",
        "torch_missing",
        "torch_cpu_build",
        "torch_build_mismatch",
        "torch_arch_unsupported",
        "cuda_driver_too_old",
        "rocm_arch_unsupported",
        "rocm_arch_override",
        "amd_kernel_old",
        "bf16_unavailable",
        "fp16_nan",
        "ram_insufficient",
        "ram_low",
        "ram_cgroup_limit",
        "disk_low",
        "shm_small",
        "mixed_gpus",
        "multi_gpu_slow_link",
        "multi_gpu_pcie_p2p",
        "links_unknown",
        "visible_devices_none",
        "visible_devices_some",
        "mig_enabled",
        "gpu_memory_in_use",
    }
)

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


def probe(path: str | os.PathLike[str] = ".") -> Snapshot:
    """Read this machine once: host, NVIDIA (NVML), AMD (amdsmi), software, env; then add the findings."""
    from sdplan.probe import amd, host, nvidia, software

    host_info = host.probe_host(path)
    nv = nvidia.probe(index_start=0)
    am = amd.probe(index_start=len(nv.gpus))
    snap = Snapshot(
        host=host_info,
        gpus=nv.gpus + am.gpus,
        links=nv.links + am.links,
        software=software.probe_software(cuda_driver=nv.cuda_driver, rocm=am.rocm),
        env=software.probe_env(),
    )
    notes = nv.notes + am.notes + software.requirement_notes()
    return replace(snap, findings=notes + findings(snap))


def refresh(snapshot: Snapshot) -> Snapshot:
    """Re-judge a saved snapshot with today's rules, keeping the probe-time notes it was saved with."""
    notes = tuple(f for f in snapshot.findings if f.code not in RULE_CODES)
    return replace(snapshot, findings=notes + findings(snapshot))


def findings(snapshot: Snapshot) -> tuple[Finding, ...]:
    """All rule findings for a snapshot. Pure: no I/O, same answer for a live machine and a saved one."""
    out: list[Finding] = []
    for rule in (
        _gpu_rules,
        _visible_rules,
        _mig_rules,
        _busy_rules,
        _torch_rules,
        _amd_rules,
        _precision_rules,
        _host_rules,
        _multi_gpu_rules,
    ):
        out.extend(rule(snapshot))
    return tuple(out)


def sorted_findings(items: tuple[Finding, ...]) -> list[Finding]:
    return sorted(items, key=lambda f: SEVERITY_ORDER.get(f.severity, 3))


# -- rules -----------------------------------------------------------------------------------------------


def _gpu_rules(s: Snapshot) -> list[Finding]:
    if trained_gpus(s):
        return []
    drives = build_vendor(s)
    if (
        s.usable_gpus and drives is not None
    ):  # usable GPUs of the other vendor only: the build's own unreadable
        theirs = [g for g in s.gpus if g.vendor == drives]
        message = (
            f"{count_of(len(theirs), drives.upper() + ' GPU')} found but "
            f"{'its' if len(theirs) == 1 else 'their'} memory could not be read: torch {s.software.torch} (a "
            f"{'CUDA' if drives == 'nvidia' else 'ROCm'} build) has no usable GPU here ({_names(s.usable_gpus)} is not "
            f"{drives.upper()}: it does not drive {'it' if len(s.usable_gpus) == 1 else 'them'})"
        )
    elif s.gpus:
        their = "its" if len(s.gpus) == 1 else "their"
        message = f"{count_of(len(s.gpus), 'GPU')} found but {their} memory could not be read: no usable GPU"
    else:
        message = "no usable GPU found (NVIDIA through NVML, AMD through amdsmi)"
    if s.gpus or s.software.cuda_driver:  # a driver answered: installing one is not the fix
        first = "see the other findings for what NVML or amdsmi said, and `nvidia-smi` / `amd-smi list`"
    else:
        first = "install the GPU driver (NVIDIA: `nvidia-smi` must work; AMD: ROCm + `pip install amdsmi`)"
    return [
        Finding(
            "error",
            "no_gpu",
            message,
            first + ", "
            "or plan for another machine: `sdplan recommend --machine FILE` with its `sdplan doctor --save FILE`, "
            'or for a GPU by name with `sdplan recommend --hardware "RTX 4090"`',
        )
    ]


@dataclass(frozen=True)
class Visible:
    """What a run here sees of one vendor's GPUs under ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES``."""

    setting: str  # "CUDA_VISIBLE_DEVICES=0,1", as a person would type it
    gpus: tuple[GPU, ...]  # the GPUs it shows that doctor can name
    unnamed: int = 0  # devices it shows that doctor cannot name (a MIG device; an index in CUDA's own order)
    stopped_at: str | None = None  # the first id that names no GPU: CUDA ignores it and every id after it
    fastest_first: bool = False  # indexes count in CUDA's fastest-first order, not doctor's
    repeated: str | None = None  # an id naming a device listed before it: CUDA then shows none
    ended_by_repeat: bool = (
        False  # stopped_at names a GPU listed before it (ROCR_VISIBLE_DEVICES: it ends the list)
    )


def visible_gpus(s: Snapshot, vendor: str) -> Visible | None:
    """What a process started with this snapshot's environment sees of ``vendor``'s usable GPUs; None where no
    variable restricts them. CUDA reads ``CUDA_VISIBLE_DEVICES`` as a comma list of indexes (in
    ``CUDA_DEVICE_ORDER``: PCI bus order with ``PCI_BUS_ID``, else fastest first), ``GPU-`` UUIDs (a unique
    prefix will do) or ``MIG-`` device UUIDs, and stops at the first id that names no device (``-1``, an index
    past the last GPU), so ``""`` and ``-1`` show none. ROCm: ``ROCR_VISIBLE_DEVICES`` filters first, set at
    all (empty too: ROCR-Runtime core/inc/flag.h, filter_visible_gpus_ = IsEnvVarSet), then HIP reads
    ``HIP_VISIBLE_DEVICES`` where it is not empty, else ``CUDA_VISIBLE_DEVICES`` (ROCclr rocdevice.cpp), on the
    GPUs left; HIP takes an empty value as unset."""
    if not any(g.vendor == vendor for g in s.usable_gpus):
        return None
    # CUDA numbers every GPU, the ones doctor could not read too
    gpus = sorted((g for g in s.gpus if g.vendor == vendor), key=lambda g: g.index)
    cuda = s.env.get("CUDA_VISIBLE_DEVICES")
    if vendor == "nvidia":
        if cuda is None:
            return None
        pci = (s.env.get("CUDA_DEVICE_ORDER") or "").strip().upper() == "PCI_BUS_ID"
        alike = len({g.name for g in gpus}) == 1
        shown = cuda if cuda.strip() else '""'  # " " showed as "CUDA_VISIBLE_DEVICES=  is set"
        return _apply_visible(f"CUDA_VISIBLE_DEVICES={shown}", cuda, gpus, fastest_first=not (pci or alike))
    rocr = s.env.get("ROCR_VISIBLE_DEVICES")
    hip = (s.env.get("HIP_VISIBLE_DEVICES") or "").strip()
    cuda = (cuda or "").strip()
    steps = [("ROCR_VISIBLE_DEVICES", rocr.strip())] if rocr is not None else []
    if hip:
        steps.append(("HIP_VISIBLE_DEVICES", hip))
    elif cuda:
        steps.append(("CUDA_VISIBLE_DEVICES", cuda))
    if not steps:
        return None
    if all(g.hip_index is not None for g in gpus):
        gpus = sorted(gpus, key=lambda g: g.hip_index)
    seen = Visible(setting="", gpus=tuple(gpus))
    settings = []
    for name, value in steps:
        step = _apply_visible(
            f"{name}={value or chr(34) * 2}",
            value,
            list(seen.gpus),
            fastest_first=False,
            repeat_ends=name == "ROCR_VISIBLE_DEVICES",
        )
        first = seen if seen.stopped_at else step  # the first list that stopped is the one said
        seen = replace(step, stopped_at=first.stopped_at, ended_by_repeat=first.ended_by_repeat)
        settings.append(step.setting)
    return replace(seen, setting=" ".join(settings))


def build_vendor(snapshot: Snapshot) -> str | None:
    """The GPU vendor the machine's torch build drives (``cuda``: nvidia, ``rocm``: amd); None when unknown."""
    build = getattr(getattr(snapshot, "software", None), "torch_build", None)
    return {"cuda": "nvidia", "rocm": "amd"}.get(build or "")


def trained_vendor(s: Snapshot) -> str | None:
    """The GPU vendor a run here trains on: the one the torch build drives (``cuda``: NVIDIA) where the machine
    has GPUs of it, usable or not (a CUDA build never uses a laptop's AMD iGPU, even where NVML cannot read the
    NVIDIA GPU); else, the build unknown, CPU-only, not installed or for a vendor the machine lacks, the vendor
    whose usable GPUs (those a run sees, :func:`shown_gpus`) have the most memory, the one a GPU build would be
    installed for (an NVIDIA dGPU, not the iGPU beside it). None without a usable GPU."""
    drives = build_vendor(s)
    if drives is not None and any(g.vendor == drives for g in s.gpus):
        return drives
    shown = shown_gpus(s)
    pool = shown[0] if shown is not None else s.usable_gpus
    memory: dict[str, int] = {}
    for g in pool:
        memory[g.vendor] = memory.get(g.vendor, 0) + (g.memory_total_bytes or 0)
    # where one vendor's driver stack is here (a CUDA driver, ROCm), its GPUs: an iGPU's memory is a carve-out
    # of the host's RAM, set in the BIOS (a 780M can report 16 GiB beside an 8 GiB RTX 4060 Laptop GPU)
    stacks = {v for v, have in (("nvidia", s.software.cuda_driver), ("amd", s.software.rocm)) if have}
    if len(stacks & set(memory)) == 1:
        return next(iter(stacks & set(memory)))
    discrete = {g.vendor for g in pool if not (g.vendor == "amd" and g.gfx_arch in APU_ARCHES)}
    if len(discrete) == 1:  # both stacks (or neither): not a laptop APU's carve-out over a discrete GPU
        return next(iter(discrete))
    return max(memory, key=lambda vendor: memory[vendor]) if memory else None


# AMD's integrated GPUs (APUs: Renoir/Cezanne gfx90c, Rembrandt gfx1035, Raphael gfx1036, Phoenix gfx1103, Strix
# Point gfx1150 / gfx1152; LLVM AMDGPU processor table): their memory is a BIOS carve-out of the host's RAM
APU_ARCHES = frozenset({"gfx90c", "gfx1035", "gfx1036", "gfx1103", "gfx1150", "gfx1152"})


def trained_gpus(s: Snapshot) -> tuple[GPU, ...]:
    """The usable GPUs a run here trains on: those of :func:`trained_vendor` (none where the torch build drives
    GPUs whose memory could not be read), as the planner plans them (planner.hardware_from_snapshot) and `sdplan
    train` requires them (launcher.require_gpu). Of those, the ones the user's CUDA_VISIBLE_DEVICES (HIP_ /
    ROCR_) shows where it restricts them (:func:`shown_gpus`): a hidden GPU is no part of a run here, its arch,
    bf16 or links no problem of it."""
    shown = shown_gpus(s)
    pool = shown[0] if shown is not None else s.usable_gpus
    vendor = trained_vendor(s)
    return tuple(g for g in pool if g.vendor == vendor)


def shown_gpus(s: Snapshot) -> tuple[tuple[GPU, ...], str] | None:
    """The usable GPUs a run started here sees, and the setting that shows them (``CUDA_VISIBLE_DEVICES=1``),
    where a visibility variable restricts them and doctor can name every GPU it shows; None where none does.
    A vendor's GPUs all count where its variable shows none of them (a GPU run here is refused: `sdplan train`)
    or shows a device doctor cannot name (a MIG device, an index in CUDA's fastest-first order); doctor says
    which (:func:`_visible_rules`)."""
    usable = s.usable_gpus
    out: list[GPU] = []
    said: list[str] = []
    for vendor in dict.fromkeys(g.vendor for g in usable):
        v = visible_gpus(s, vendor)
        if v is None or v.unnamed or not v.gpus:
            out += [g for g in usable if g.vendor == vendor]
            continue
        out += [g for g in v.gpus if g in usable]
        said.append(v.setting)
    return (tuple(out), " ".join(said)) if said else None


def _apply_visible(
    setting: str, value: str, gpus: list[GPU], *, fastest_first: bool, repeat_ends: bool = False
) -> Visible:
    """``repeat_ends``: an id listed twice ends the list, the ones before it shown (ROCR_VISIBLE_DEVICES:
    ROCR-Runtime amd_filter_device.cpp, "such indices are interpreted as terminators"); otherwise, as CUDA, it
    shows none."""
    shown: list[GPU] = []
    unnamed = 0
    by_speed: set[int] = set()  # indexes in CUDA's fastest-first order
    migs: set[str] = set()
    stopped = None
    for raw in value.split(",") if value.strip() else [value]:
        token = raw.strip()
        match: GPU | None = None
        if re.fullmatch(r"\d+", token) and int(token) < len(gpus):
            if fastest_first:
                if int(token) in by_speed:  # CUDA (as torch _parse_visible_devices): a repeat shows none
                    return Visible(setting, (), repeated=token)
                by_speed.add(int(token))
                continue
            match = gpus[int(token)]
        elif token.upper().startswith("MIG-"):
            if token.upper() in migs:  # as a GPU listed twice: none
                return Visible(setting, (), repeated=token)
            migs.add(token.upper())
            unnamed += 1
            continue
        elif token.upper().startswith("GPU-") and len(token) > 4:
            found = [g for g in gpus if g.uuid and g.uuid.lower().startswith(token.lower())]
            if len(found) == 1:
                match = found[0]
            elif not found and any(g.uuid is None for g in gpus):
                unnamed += 1  # may be a GPU whose UUID NVML did not give
                continue
        if match is None:
            stopped = token or '""'
            break
        if match in shown and repeat_ends:
            return Visible(setting, tuple(shown), unnamed, token, ended_by_repeat=True)
        if match in shown:  # CUDA (as torch _transform_uuid_to_ordinals): a device listed twice shows none
            return Visible(setting, (), repeated=token)
        shown.append(match)
    if len(by_speed) == len(gpus):  # every GPU, in some order
        shown, by_speed = list(gpus), set()
    return Visible(setting, tuple(shown), unnamed + len(by_speed), stopped, bool(by_speed))


def _visible_rules(s: Snapshot) -> list[Finding]:
    out: list[Finding] = []
    # a vendor no run here uses (an iGPU beside a CUDA build's GPUs): nothing to say
    trained = trained_vendor(s)
    for vendor in ("nvidia", "amd"):
        if trained is not None and vendor != trained:
            continue
        v = visible_gpus(s, vendor)
        if v is None:
            continue
        usable = [g for g in s.usable_gpus if g.vendor == vendor]
        what = f"{count_of(len(usable), vendor.upper() + ' GPU')} doctor found"
        ignored = (
            f" ({v.repeated} names a GPU listed before it: CUDA then shows none)"
            if v.repeated
            else f" ({v.stopped_at} is listed again: ROCm ends the list there)"
            if v.ended_by_repeat
            else " (an empty list)"
            if v.stopped_at == '""'
            else f" ({v.stopped_at} names no GPU: CUDA ignores it and every id after it)"
            if v.stopped_at
            else ""
        )
        if not v.gpus and not v.unnamed:
            out.append(
                Finding(
                    "error",
                    "visible_devices_none",
                    f"{v.setting} hides all {what}{ignored}: torch sees no GPU, so a run started here cannot "
                    "train on one and the verdicts below do not apply to it",
                    f"unset {v.setting.split('=')[0]} (or list the GPUs to train on: "
                    + " ".join(
                        f"{k}={x}" for k, x in s.visible_devices([usable[0].index], by_uuid=False).items()
                    )
                    + ")",
                )
            )
            continue
        hidden = [g for g in usable if g not in v.gpus]
        if v.unnamed:
            kind = "MIG device" if "MIG-" in v.setting.upper() else "GPU"
            order = (
                " (CUDA numbers GPUs fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so doctor cannot tell "
                "which)"
                if v.fastest_first
                else ""
            )
            named = f" ({_gpu_list(v.gpus)} and {count_of(v.unnamed, 'other device')})" if v.gpus else ""
            out.append(
                Finding(
                    "warning",
                    "visible_devices_some",
                    f"{v.setting} shows the run {count_of(len(v.gpus) + v.unnamed, kind)}{named} of the "
                    f"{what}{order}{ignored}: doctor's plans count the GPUs it found, not what the run sees",
                    "set CUDA_DEVICE_ORDER=PCI_BUS_ID and name GPUs by doctor's numbers or UUIDs, or unset "
                    f"{v.setting.split('=')[0]}",
                )
            )
        elif hidden or v.stopped_at:
            out.append(
                Finding(
                    "info",
                    "visible_devices_some",
                    f"{v.setting} shows the run only {_gpu_list(v.gpus)} of the {what}{ignored}; "
                    f"it hides {_gpu_list(hidden)}: the verdicts below, `sdplan recommend` and `sdplan train` "
                    "plan only the GPUs it shows",
                    f"unset {v.setting.split('=')[0]} to plan and train on every GPU",
                )
                if hidden
                else Finding(
                    "info",
                    "visible_devices_some",
                    f"{v.setting} shows the run every GPU doctor found{ignored}",
                    "drop the ids that name no GPU",
                )
            )
    return out


def _gpu_list(gpus: list[GPU] | tuple[GPU, ...]) -> str:
    return ", ".join(f"GPU {g.index} ({g.name or 'unnamed'})" for g in gpus)


def _mig_rules(s: Snapshot) -> list[Finding]:
    """A GPU in MIG mode: CUDA sees its MIG slices, never the whole card, and a process uses one slice."""
    out: list[Finding] = []
    for g in s.gpus:
        if not g.mig:
            continue
        off = (
            f"or train on the whole card: disable MIG with `sudo nvidia-smi -i {g.index} -mig 0` "
            "(no process may use the GPU; some need a GPU reset)"
        )
        name = f"GPU {g.index} ({g.name or 'NVIDIA GPU'})"
        if g.memory_total_bytes:
            slices = count_of(g.mig_slices or 1, "MIG slice")
            out.append(
                Finding(
                    "warning",
                    "mig_enabled",
                    f"{name} is in MIG mode: CUDA sees its {slices}, not the whole card, and a process "
                    f"trains on one slice; plans use the largest slice's {_gib(g.memory_total_bytes)}",
                    "pick the slice to train on with CUDA_VISIBLE_DEVICES=MIG-<uuid> (`nvidia-smi -L` lists "
                    "them), " + off,
                )
            )
        elif g.mig_slices:  # the slices exist; NVML's error reading them is the probe's gpu_unreadable note
            out.append(
                Finding(
                    "warning",
                    "mig_enabled",
                    f"{name} is in MIG mode with {count_of(g.mig_slices, 'MIG slice')}, but "
                    f"{'its' if g.mig_slices == 1 else 'their'} memory could not be read (gpu_unreadable gives "
                    "NVML's error): it is left out of the plans",
                    f"`nvidia-smi mig -lgi -i {g.index}` lists the slices' profiles, whose names end in their "
                    "memory; pick the slice to train on with CUDA_VISIBLE_DEVICES=MIG-<uuid> (`nvidia-smi -L`), "
                    + off,
                )
            )
        else:
            out.append(
                Finding(
                    "error",
                    "mig_enabled",
                    f"{name} is in MIG mode but has no MIG slice this process can read: CUDA sees no device "
                    "on it",
                    "create a GPU instance with its compute instance (`sudo nvidia-smi mig -cgi <profile> -C`; "
                    "`nvidia-smi mig -lgip` lists the profiles), " + off,
                )
            )
    return out


def _busy_rules(s: Snapshot) -> list[Finding]:
    """GPUs whose memory other processes held when doctor ran: plans count the whole card."""
    out: list[Finding] = []
    for g in trained_gpus(s):
        if g.memory_free_bytes is None or g.memory_total_bytes is None:
            continue
        used = g.memory_total_bytes - g.memory_free_bytes
        if used > max(GPU_IN_USE_MIN_BYTES, GPU_IN_USE_MIN_SHARE * g.memory_total_bytes):
            out.append(
                Finding(
                    "warning",
                    "gpu_memory_in_use",
                    f"GPU {g.index} ({g.name or 'unnamed'}) had {_gib(g.memory_free_bytes)} free of "
                    f"{_gib(g.memory_total_bytes)}: other processes hold {_gib(used)}, and plans count the "
                    "whole card, so a run started beside them may run out of memory",
                    "stop the processes holding it (`nvidia-smi` / `amd-smi process` lists them) or train on "
                    "another GPU",
                )
            )
    return out


def _torch_rules(s: Snapshot) -> list[Finding]:
    sw = s.software
    vendors = {g.vendor for g in s.usable_gpus}
    out: list[Finding] = []
    if sw.torch is None:
        out.append(
            Finding(
                "warning",
                "torch_missing",
                "torch is not installed: sdplan can plan here but not train",
                _torch_fix(s, reinstall=False),
            )
        )
        return out
    if sw.torch_build == "cpu" and vendors:
        out.append(
            Finding(
                "error",
                "torch_cpu_build",
                f"torch {sw.torch} is a CPU-only build on a machine with "
                f"{' and '.join(v.upper() for v in sorted(vendors))} GPUs",
                _torch_fix(s),
            )
        )
    drives = build_vendor(s)
    # a build for a vendor the machine has no GPU of (one whose memory is unreadable is the no_gpu error's)
    if drives is not None and vendors and not any(g.vendor == drives for g in s.gpus):
        have, want = ("CUDA", "ROCm") if sw.torch_build == "cuda" else ("ROCm", "CUDA")
        out.append(
            Finding(
                "error",
                "torch_build_mismatch",
                f"torch {sw.torch} is a {have} build but this machine's GPUs need {want}",
                _torch_fix(s),
            )
        )
    if sw.torch_build == "cuda":
        lacking: dict[str, list[GPU]] = {}
        for g in trained_gpus(s):
            why = (
                torch_cuda_lacks(g.compute_capability, sw.torch, sw.cuda_runtime)
                if g.vendor == "nvidia"
                else None
            )
            if why:
                lacking.setdefault(why, []).append(g)
        for why, gpus in lacking.items():
            out.append(
                Finding(
                    "error",
                    "torch_arch_unsupported",
                    f"torch {sw.torch} has no CUDA kernels for {_names(gpus)} (compute capability "
                    f"{gpus[0].compute_capability}): {why}; CUDA fails with 'no kernel image is available'",
                    _torch_fix(s),
                )
            )
    if sw.torch_build == "cuda" and "nvidia" in vendors:
        runtime, driver = version_tuple(sw.cuda_runtime), version_tuple(sw.cuda_driver)
        if runtime and driver and runtime > driver:
            major = cuda_build_runs(s, sw.cuda_runtime) is False  # CUDA will not start
            install = _torch_install(s)
            out.append(
                Finding(
                    "error" if major else "warning",
                    "cuda_driver_too_old",
                    f"torch is built for CUDA {sw.cuda_runtime} but the driver supports CUDA {sw.cuda_driver} at most"
                    + (
                        ": CUDA will not start"
                        if major
                        else " (runs under CUDA minor-version compatibility; kernels needing PTX JIT can fail)"
                    ),
                    f"update the NVIDIA driver to one for CUDA {runtime[0]} ({_driver_for(runtime[0])}), or pip "
                    f"install --force-reinstall {install}"
                    if major and install
                    else _torch_fix(s)
                    if major
                    # this torch runs: another one is no fix, a driver for its CUDA is (for PTX JIT kernels)
                    else f"nothing to do unless a kernel fails to load; then update the NVIDIA driver to one for "
                    f"CUDA {sw.cuda_runtime} or newer (keep this torch)",
                )
            )
    return out


def _amd_rules(s: Snapshot) -> list[Finding]:
    amd_gpus = [g for g in s.gpus if g.vendor == "amd"]
    if not amd_gpus or (s.usable_gpus and not any(g.vendor == "amd" for g in trained_gpus(s))):
        return []  # a CUDA build beside NVIDIA GPUs never runs ROCm kernels on them
    if s.usable_gpus:  # the ones a run sees (a GPU HIP_VISIBLE_DEVICES hides is no part of it)
        amd_gpus = [g for g in trained_gpus(s) if g.vendor == "amd"]
    out: list[Finding] = []
    official = rocm_wheel_arches(s.software.torch)
    lacking = rocm_lacking(s, amd_gpus)
    runs = [
        g for g in amd_gpus if g not in lacking
    ]  # GPUs the wheels have kernels for, or an override covers
    for arch in sorted({g.gfx_arch for g in amd_gpus if g.gfx_arch and g.gfx_arch not in official}):
        advice = HSA_OVERRIDES.get(arch)
        if covered := [g for g in amd_gpus if g.gfx_arch == arch and g not in lacking]:
            out.append(
                Finding(
                    "info",
                    "rocm_arch_override",
                    f"{_names(covered)} ({arch}) is outside the ROCm torch wheels' arches; "
                    f"{gfx_override(s, covered[0])} is set",
                    f"if kernels crash, check the override: {advice[0]} is the usual value for {arch}"
                    if advice
                    else "if kernels crash, build torch with PYTORCH_ROCM_ARCH=" + arch,
                )
            )
        if not (lack := [g for g in lacking if g.gfx_arch == arch]):
            continue
        names = _names(lack)
        fix = (
            # the variable overrides every GPU (libhsakmt reads it for each node): the others would run as it
            "train on the others: "
            + " ".join(
                f"{k}={v}" for k, v in s.visible_devices([g.index for g in runs], by_uuid=False).items()
            )
            if runs
            else f"export HSA_OVERRIDE_GFX_VERSION={advice[0]} ({advice[1]})"
            if advice
            else f"no known override: build torch from source with PYTORCH_ROCM_ARCH={arch}"
        )
        out.append(
            Finding(
                "warning" if runs else "error",  # a run on the others works (the planner takes those)
                "rocm_arch_unsupported",
                f"{names} ({arch}) is outside the arches ROCm torch wheels ship kernels for: "
                "torch fails with 'invalid device function'",
                fix,
            )
        )
    kernel = version_tuple(s.host.kernel)
    if kernel and kernel[:2] < AMD_MIN_KERNEL:
        out.append(
            Finding(
                "warning",
                "amd_kernel_old",
                f"kernel {s.host.kernel} is older than 5.19: amdgpu cannot reset a hung GPU (BACO), "
                "a hang needs a reboot",
                "upgrade to a kernel >= 5.19 (e.g. the distribution's HWE kernel)",
            )
        )
    return out


def _precision_rules(s: Snapshot) -> list[Finding]:
    no_bf16 = [g for g in trained_gpus(s) if g.bf16 is False]
    nan = [g for g in no_bf16 if g.vendor == "nvidia" and fp16_gives_nan(g.name, g.compute_capability)]
    fp16 = [g for g in no_bf16 if g not in nan]
    out = []
    if fp16:
        out.append(
            Finding(
                "warning",
                "bf16_unavailable",
                f"{_names(fp16)} has no hardware bf16 "
                "(NVIDIA needs compute capability >= 8.0; AMD needs RDNA3+ or CDNA)",
                "train with fp16 mixed precision (accelerate: mixed_precision fp16)",
            )
        )
    if nan:
        out.append(
            Finding(
                "warning",
                "fp16_nan",
                f"{_names(nan)} has no hardware bf16, and fp16 mixed precision gives NaN losses in training on "
                f"GTX 16 cards ({GTX16_FP16_NAN_SOURCES})",
                "train in fp32 (accelerate: mixed_precision no; sdplan plans it there), which holds more memory",
            )
        )
    return out


def _host_rules(s: Snapshot) -> list[Finding]:
    h = s.host
    out: list[Finding] = []
    ram = h.ram_usable_bytes  # the cgroup limit where it is below MemTotal: what a run may use
    limited = h.ram_limit_bytes is not None and (
        h.ram_total_bytes is None or h.ram_limit_bytes < h.ram_total_bytes
    )
    what = (
        f"{_gib(ram)} RAM (this process's cgroup memory limit"
        + (f"; the host has {_gib(h.ram_total_bytes)})" if h.ram_total_bytes is not None else ")")
        if limited and ram is not None
        else f"{_gib(ram)} RAM"
        if ram is not None
        else ""
    )
    raise_limit = "raise the container's or job's memory limit (docker run --memory ..., Slurm --mem ...) or "
    if ram is not None and ram < RAM_MIN_BYTES:
        # a warning, not an error: the planner checks each plan's host RAM (SD 1.5 LoRA loads in ~5 GiB), and the
        # verdicts show it per method and model; this rule cannot plan (it is pure, the profiles are files), so
        # where no verdict is ok the doctor command exits 1 on them (sdplan.doctor.nothing_ok)
        out.append(
            Finding(
                "warning",
                "ram_insufficient",
                f"{what}: under the 16 GB the larger models need to load without swapping; the verdicts below "
                "check each plan's host RAM against it (tight: loading may swap; no: what the run holds in RAM "
                "does not fit)",
                (raise_limit if limited else "")
                + "use a machine with >= 16 GB RAM (32 GB is comfortable); here, train only what the verdicts "
                "below call ok (where none is, none trains here)",
            )
        )
    elif ram is not None and ram < RAM_COMFORT_BYTES:
        out.append(
            Finding(
                "warning",
                "ram_low",
                f"{what}: enough to train, tight for model loading and optimizer offload",
                (raise_limit if limited else "")
                + "close other programs while training; 32 GB RAM is comfortable; avoid DeepSpeed CPU offload",
            )
        )
    elif limited and ram is not None:
        out.append(
            Finding(
                "info",
                "ram_cgroup_limit",
                f"a cgroup memory limit lets this process use {_gib(ram)} of the host's "
                f"{_gib(h.ram_total_bytes) if h.ram_total_bytes is not None else 'unknown'} RAM: "
                "plans are checked against the limit",
                raise_limit.removesuffix(" or ") + " if a plan needs more",
            )
        )
    if h.disk_free_bytes is not None and h.disk_free_bytes < DISK_MIN_BYTES:
        out.append(
            Finding(
                "warning",
                "disk_low",
                f"{_gib(h.disk_free_bytes)} free on the output disk: models and checkpoints need >= 10 GB",
                "free space, or point the output (and HF_HOME) at a disk with >= 10 GB free",
            )
        )
    if h.shm_bytes is not None and h.shm_bytes < SHM_MIN_BYTES:
        out.append(
            Finding(
                "warning",
                "shm_small",
                f"/dev/shm is {h.shm_bytes / 2**20:.0f} MiB: DataLoader workers and NCCL need more",
                "in Docker, run with --shm-size=8g (or --ipc=host)",
            )
        )
    return out


def _multi_gpu_rules(s: Snapshot) -> list[Finding]:
    """Each vendor's GPUs apart: one torch build drives a run, so an NVIDIA and an AMD GPU never train together
    (neither a mix of GPUs nor a pair whose link matters); only the vendor the build drives where it is known."""
    out: list[Finding] = []
    trained = runnable_gpus(s)  # a GPU the ROCm wheels have no kernels for beside others: its own finding
    for vendor in dict.fromkeys(g.vendor for g in trained):
        out += _vendor_multi_gpu_rules(s, tuple(g for g in trained if g.vendor == vendor))
    return out


def _vendor_multi_gpu_rules(s: Snapshot, gpus: tuple[GPU, ...]) -> list[Finding]:
    if len(gpus) < 2:
        return []
    out: list[Finding] = []
    names = {g.name for g in gpus}
    if len(names) > 1 or len({g.memory_total_bytes for g in gpus}) > 1:
        out.append(
            Finding(
                "warning",
                "mixed_gpus",
                f"mixed GPUs ({_names(gpus)}): data-parallel training runs at the pace of the slowest "
                "and fits only what the smallest holds",
                _restrict_fix(s, gpus),
            )
        )
    indexes = {g.index for g in gpus}
    pairs = {(min(lk.a, lk.b), max(lk.a, lk.b)): lk for lk in s.links if lk.a in indexes and lk.b in indexes}
    wanted = [(a.index, b.index) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    missing = [p for p in wanted if p not in pairs]
    slow = [pairs[p] for p in wanted if p in pairs and pairs[p].type == "pcie" and pairs[p].p2p is not True]
    p2p_only = [pairs[p] for p in wanted if p in pairs and pairs[p].type == "pcie" and pairs[p].p2p is True]
    if slow:
        shown = ", ".join(
            f"{lk.a}-{lk.b} (P2P {'off' if lk.p2p is False else 'unknown'})" for lk in slow[:6]
        ) + (" ..." if len(slow) > 6 else "")
        out.append(
            Finding(
                "warning",
                "multi_gpu_slow_link",
                f"GPU pairs without NVLink/XGMI or P2P: {shown}; gradients cross PCIe every step, "
                "so multi-GPU DreamBooth and fine-tuning are slower than one GPU",
                "use several GPUs for LoRA only; run DreamBooth/fine-tune on one GPU "
                "(or separate runs per GPU)",
            )
        )
    elif p2p_only:
        out.append(
            Finding(
                "info",
                "multi_gpu_pcie_p2p",
                "GPUs talk over PCIe P2P without NVLink/XGMI: LoRA scales, full-model methods gain little",
                "prefer LoRA for multi-GPU runs; measure before splitting DreamBooth/fine-tune over GPUs",
            )
        )
    if missing:
        out.append(
            Finding(
                "info",
                "links_unknown",
                f"the interconnect of {count_of(len(missing), 'GPU pair')} could not be read",
                "run `nvidia-smi topo -m` (NVIDIA) or `amd-smi topology` (AMD) to see it",
            )
        )
    return out


# -- helpers (pure) --------------------------------------------------------------------------------------


def rocm_wheel_arches(torch_version: str | None) -> frozenset[str]:
    """Arches the ROCm wheels of this torch version ship kernels for (the newest set if torch is unknown)."""
    version = version_tuple(torch_version)
    arches: set[str] = set()
    for since, added in ROCM_WHEEL_ARCHES:
        if version is None or version[:2] >= since:
            arches |= added
    return frozenset(arches)


def gfx_override(s: Snapshot, g: GPU | None = None) -> str:
    """The ROCm arch overrides that cover GPU ``g`` (``HSA_OVERRIDE_GFX_VERSION=10.3.0``, and ROCm's per-GPU
    ``HSA_OVERRIDE_GFX_VERSION_<n>``, which libhsakmt's topology.c reads for KFD node n before the global one), as
    settings, '' where none does; ``g`` None: every one set. A per-GPU override covers the GPU on its KFD node
    (:attr:`GPU.kfd_node`), and any GPU whose node was not read (older amdsmi)."""
    out = []
    for key, value in s.env.items():
        if not (key.startswith("HSA_OVERRIDE_GFX_VERSION") and value):
            continue
        node = key.rsplit("_", 1)[1]
        if g is None or not node.isdigit() or g.kfd_node is None or g.kfd_node == int(node):
            out.append(f"{key}={value}")
    return " ".join(out)


def rocm_lacking(s: Snapshot, gpus: tuple[GPU, ...] | list[GPU]) -> tuple[GPU, ...]:
    """Of ``gpus``, the AMD ones whose arch the ROCm torch wheels of this torch version ship no kernels for
    (:func:`rocm_wheel_arches`; 'invalid device function' at the first call) and no arch override covers
    (:func:`gfx_override`)."""
    official = rocm_wheel_arches(s.software.torch)
    return tuple(
        g
        for g in gpus
        if g.vendor == "amd" and g.gfx_arch and g.gfx_arch not in official and not gfx_override(s, g)
    )


def runnable_gpus(s: Snapshot) -> tuple[GPU, ...]:
    """The GPUs a run here trains on (:func:`trained_gpus`) less those the ROCm wheels have no kernels for, where
    others remain (:func:`rocm_lacking`: doctor's fix hides them, the planner leaves them out); all of them
    where every one lacks kernels (doctor and `sdplan train` say what to set)."""
    trained = trained_gpus(s)
    lack = rocm_lacking(s, trained)
    return tuple(g for g in trained if g not in lack) if len(lack) < len(trained) else trained


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """(major, minor[, patch]) at the start of a version string ("12.4", "0.47.0.dev0", "6.8.0-45-generic");
    None when absent or unreadable."""
    if not text:
        return None
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        return None
    return tuple(int(x) for x in match.groups() if x is not None)


def torch_cuda_lacks(
    compute_capability: str | None, torch_version: str | None, cuda: str | None
) -> str | None:
    """Why PyTorch's wheels for this torch and CUDA version hold no kernels for a GPU of this compute capability,
    in words (None: they hold them, or it cannot be told). Four published facts:
    - CUDA 13 compiles nothing below compute capability 7.5 (NVIDIA, "Navigating GPU Architecture Support: A
      Guide for NVIDIA CUDA Developers": Maxwell, Pascal and Volta lose offline compilation in CUDA 13.0);
    - Blackwell (10.x, 12.x) needs CUDA 12.8 or newer, the first toolkit that compiles for it (PyTorch's cu126
      build list ends at 9.0 without PTX: .ci/manywheel/build_cuda.sh);
    - PyTorch 2.8's CUDA 12.8 / 12.9 wheels dropped Maxwell and Pascal (2.8.0 release notes, dev-discuss
      "Maxwell and Pascal architecture support removed in CUDA 12.8 and 12.9 builds"; cu126 keeps them);
    - PyTorch 2.11's CUDA 12.8 wheels dropped Volta (dev-discuss "Dropping Volta support from CUDA-12.8
      binaries for release 2.11", RFC pytorch/pytorch#172352, RELEASE.md in PR 175253; cu126 keeps it).
    ``torch_version`` None: the torch pip would install now (2.12 or newer)."""
    cc, runtime, torch = version_tuple(compute_capability), version_tuple(cuda), version_tuple(torch_version)
    if cc is None or runtime is None:
        return None
    if runtime[0] >= 13 and cc < (7, 5):
        return "CUDA 13 compiles nothing below compute capability 7.5 (Maxwell, Pascal and Volta)"
    if runtime[:2] < (12, 8) and cc[0] >= 10:
        return f"Blackwell GPUs need a torch built for CUDA 12.8 or newer, not {cuda}"
    if runtime[:2] in ((12, 8), (12, 9)) and (torch is None or torch[:2] >= (2, 8)) and cc < (7, 0):
        return f"PyTorch's CUDA {cuda} wheels dropped Maxwell and Pascal in torch 2.8"
    if runtime[:2] == (12, 8) and (torch is None or torch[:2] >= (2, 11)) and cc < (7, 5):
        return f"PyTorch's CUDA {cuda} wheels dropped Volta in torch 2.11"
    return None


def _blackwell(g: GPU) -> bool:
    return (version_tuple(g.compute_capability) or (0,))[0] >= 10


def cuda_build_runs(s: Snapshot, cuda: str | None) -> bool | None:
    """Whether a torch built for CUDA ``cuda`` ("12.6") starts under this machine's NVIDIA driver: on a driver for
    that CUDA or newer, or of its major under minor-version compatibility (CUDA_MINOR_COMPAT_DRIVERS); Blackwell
    GPUs only under a driver for CUDA 12.8 or newer. None where the driver's CUDA version is not known."""
    build, driver = version_tuple(cuda), version_tuple(s.software.cuda_driver)
    if build is None or driver is None:
        return None
    nvidia = [g for g in trained_gpus(s) if g.vendor == "nvidia"]
    if driver[:2] < BLACKWELL_DRIVER_CUDA and any(_blackwell(g) for g in nvidia):
        return False
    if build[:2] <= driver[:2]:
        return True
    if build[0] > driver[0]:
        return False
    least = version_tuple(CUDA_MINOR_COMPAT_DRIVERS.get(build[0]))
    versions = [version_tuple(g.driver_version) for g in nvidia]
    return not (least and any(v is not None and v < least for v in versions))


def _driver_for(major: int) -> str:
    """The least driver that runs CUDA ``major``'s builds, in words."""
    least = CUDA_MINOR_COMPAT_DRIVERS.get(major)
    return f"{least} or newer" if least else "the newest"


def _torch_fix(s: Snapshot, *, reinstall: bool = True) -> str:
    """The fix that installs the torch this machine needs (:func:`_torch_install`), or where no build can be
    named, what to do first: the driver to get, or which build to look for."""
    pip = "pip install --force-reinstall" if reinstall else "pip install"
    install = _torch_install(s)
    if install:
        return f"{pip} {install}"
    gpus = trained_gpus(s)
    vendors = {g.vendor for g in gpus}
    if vendors == {"nvidia"} and s.software.cuda_driver:  # this driver runs no build with the GPUs' kernels
        major = int(TORCH_CUDA_WHEELS[0].split(".")[0])  # the oldest CUDA torch builds now
        need = (
            "CUDA 12.8 or newer (570 or newer)"
            if any(_blackwell(g) for g in gpus)
            else f"CUDA {major} ({_driver_for(major)})"
        )
        return f"update the NVIDIA driver to one for {need}, then {pip} torch for it"
    if vendors == {"nvidia"}:
        return (
            f"{pip} torch (a CUDA build for this driver: pytorch.org/get-started/locally gives the command)"
        )
    if vendors == {"amd"}:
        return f"{pip} torch (a ROCm build for this ROCm: pytorch.org/get-started/locally gives the command)"
    return f"{pip} torch (a CUDA build for the NVIDIA GPUs, or a ROCm build for the AMD ones)"


def _torch_install(s: Snapshot) -> str:
    """What `pip install` takes for the torch build this machine needs ('torch --index-url ...'; a quoted older
    release where only that has the GPUs' kernels under this driver), or '' when it cannot be told."""
    gpus = trained_gpus(s)
    vendors = {g.vendor for g in gpus}
    if vendors == {"nvidia"}:
        # the newest CUDA the driver runs (:func:`cuda_build_runs`: under minor-version compatibility too) whose
        # wheels hold every GPU's kernels: a build of the torch pip installs now, else the last release of an
        # older build
        builds = [(c, None) for c in reversed(TORCH_CUDA_WHEELS)] + list(TORCH_CUDA_LEGACY_WHEELS)
        for cuda, last in builds:
            if cuda_build_runs(s, cuda) and not any(
                torch_cuda_lacks(g.compute_capability, last, cuda) for g in gpus
            ):
                url = f"--index-url https://download.pytorch.org/whl/cu{cuda.replace('.', '')}"
                return f"torch {url}" if last is None else f'"torch=={last}.*" {url}'
        return ""
    if vendors == {"amd"}:
        rocm = version_tuple(s.software.rocm)
        if rocm:
            return f"torch --index-url https://download.pytorch.org/whl/rocm{rocm[0]}.{rocm[1]}"
        return ""
    if not vendors:
        return "torch --index-url https://download.pytorch.org/whl/cpu"
    return ""


def _restrict_fix(s: Snapshot, gpus: tuple[GPU, ...]) -> str:
    """Name the largest group of identical GPUs and the variable that restricts training to it."""
    groups: dict[tuple, list[GPU]] = {}
    for g in gpus:
        groups.setdefault((g.vendor, g.name, g.memory_total_bytes), []).append(g)
    best = max(groups.values(), key=lambda group: (len(group), group[0].memory_total_bytes or 0))
    env = s.visible_devices([g.index for g in best], by_uuid=False)  # for a person to type
    return "train on identical GPUs: " + " ".join(f"{k}={v}" for k, v in env.items())


def _names(gpus: list[GPU] | tuple[GPU, ...]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        name = g.name or f"GPU {g.index}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())


def _gib(n: int) -> str:
    """The machine's figure in GiB, as doctor's host table shows it (the thresholds stay in the decimal GB
    machines are sold in)."""
    return f"{n / 2**30:.1f} GiB"
