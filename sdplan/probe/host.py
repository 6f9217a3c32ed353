"""Host probe: OS, kernel, CPU, RAM, disk and /dev/shm, read from the kernel's own files.

Every reader returns ``None`` when its source is missing or unreadable: never a fake 0, never an exception.
Paths are parameters so tests can point them at fixture files.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from sdplan.machine import Host

# PCI vendor ids as the kernel writes them in /sys/bus/pci/devices/*/vendor.
PCI_VENDOR_NVIDIA = "0x10de"
PCI_VENDOR_AMD = "0x1002"


def probe_host(
    path: str | os.PathLike[str] = ".",
    *,
    proc: str = "/proc",
    shm: str = "/dev/shm",
    cgroup_root: str = "/sys/fs/cgroup",
) -> Host:
    """Read the host once. ``path`` is where training output will go: its file system's free space counts."""
    meminfo = read_meminfo_bytes(Path(proc) / "meminfo")
    return Host(
        os=os_name(),
        kernel=_safe(platform.release) or None,
        cpu_model=cpu_model(Path(proc) / "cpuinfo"),
        cpu_cores=usable_cpus(),
        ram_total_bytes=meminfo.get("MemTotal"),
        ram_available_bytes=meminfo.get("MemAvailable"),
        ram_limit_bytes=cgroup_memory_limit_bytes(cgroup_root, str(Path(proc) / "self" / "cgroup")),
        disk_free_bytes=disk_free_bytes(path),
        shm_bytes=fs_size_bytes(shm),
    )


# -- single readers ---------------------------------------------------------------------------------


def read_meminfo_bytes(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` as bytes per key (the file says kB, which the kernel means as KiB)."""
    out: dict[str, int] = {}
    try:
        text = Path(meminfo).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
        out[key.strip()] = int(parts[0]) * scale
    return out


def os_name() -> str | None:
    try:
        info = platform.freedesktop_os_release()
    except (OSError, AttributeError):
        info = {}
    pretty = info.get("PRETTY_NAME") or " ".join(x for x in (info.get("NAME"), info.get("VERSION_ID")) if x)
    if pretty:
        return pretty
    system = _safe(platform.system)
    return system or None


def cpu_model(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> str | None:
    """The first 'model name' (x86) or 'Model'/'Hardware'/'cpu' line (ARM, POWER) of /proc/cpuinfo."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        text = ""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if sep and value and key in ("model name", "Model", "Hardware", "cpu") and key not in found:
            found[key] = value
    for key in ("model name", "Model", "Hardware", "cpu"):
        if key in found:
            return found[key]
    return _safe(platform.processor) or None


def usable_cpus() -> int | None:
    """Logical CPUs this process may run on (respects taskset/cgroup cpusets), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def disk_free_bytes(path: str | os.PathLike[str] = ".") -> int | None:
    """Bytes an unprivileged user can still write on the file system holding ``path`` (or its nearest parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fs_size_bytes(path: str | os.PathLike[str]) -> int | None:
    """Total size of the file system mounted at ``path`` (for /dev/shm: its tmpfs size)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def cgroup_memory_limit_bytes(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> int | None:
    """The memory limit that binds this process: the smallest cgroup v2 ``memory.max`` or v1
    ``memory.limit_in_bytes`` of its own cgroup and every ancestor; None where no limit is set or none can be read.

    ``self_cgroup`` (/proc/self/cgroup) names the process's cgroup per hierarchy: ``0::/path`` (v2, mounted at
    ``root``) and ``N:memory:/path`` (v1, the memory controller mounted at ``root/memory``; in a hybrid layout
    both lines exist and v1 holds the memory controller). Without a cgroup namespace the path is the host's
    (``/docker/<id>``) while the container sees its own cgroup at the mount's root, so the mount's root counts
    too. A limit set on a parent (a Slurm job above its step, a systemd slice above its service) binds its
    children, whose own file says ``max``: the smallest limit on the way up is the one that binds."""
    v2: list[str] = []
    v1: list[str] = []
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            v2.append(rel)
        elif "memory" in controllers.split(","):
            v1.append(rel)
    candidates: list[Path] = []
    for rels, base, name in (
        (v2, Path(root), "memory.max"),
        (v1, Path(root) / "memory", "memory.limit_in_bytes"),
    ):
        for rel in rels or ["/"]:
            candidates += [d / name for d in _cgroup_dirs(base, rel)]
    limits = [n for n in (_limit_file(f) for f in dict.fromkeys(candidates)) if n is not None]
    return min(limits) if limits else None


def _cgroup_dirs(base: Path, rel: str) -> list[Path]:
    """``base/rel`` and each of its parents up to ``base`` itself."""
    parts = [p for p in rel.strip().split("/") if p and p not in (".", "..")]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _limit_file(file: Path) -> int | None:
    """A cgroup limit file's value in bytes; None for "max" (v2), ~2**63 (v1's "no limit"), or unreadable."""
    try:
        text = file.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text.isdigit() and 0 < int(text) < 2**60:
        return int(text)
    return None


def pci_display_vendors(sys_root: str = "/sys") -> set[str]:
    """PCI vendor ids ("0x10de", "0x1002") of display controllers (class 0x03xxxx) the kernel sees."""
    vendors: set[str] = set()
    devices = Path(sys_root) / "bus" / "pci" / "devices"
    try:
        entries = list(devices.iterdir())
    except OSError:
        return vendors
    for dev in entries:
        try:
            if not (dev / "class").read_text().strip().startswith("0x03"):
                continue
            vendors.add((dev / "vendor").read_text().strip().lower())
        except OSError:
            continue
    return vendors


def _safe(fn) -> str:
    try:
        return fn()
    except Exception:  # platform helpers shell out on some systems; any failure means "not available"
        return ""
