"""CPU threads for CPU training: physical cores this process may use, split between the processes.

OpenMP's default (one busy-waiting thread per logical CPU) collapses when anything else runs: on a 2-core
machine the demo took ~5x longer. So CPU runs get ``OMP_NUM_THREADS`` = physical cores in this process's
affinity mask / processes (at least 1) and ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep instead of
spinning), unless the user set them. Linux reads the topology from sysfs; elsewhere the CPU count is used.
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity mask)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None) -> int:
    """Physical cores among ``cpus`` (default: the usable ones): hyper-threads of one core count once."""
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(
                (topo / "physical_package_id").read_text().strip()
                + ":"
                + (topo / "core_id").read_text().strip()
            )
        except OSError:
            cores.add(f"cpu{cpu}")  # no topology: count the logical CPU
    return max(1, len(cores))


def threads_per_process(processes: int = 1, cores: int | None = None) -> int:
    """Threads for each of ``processes`` CPU training processes: never more than the cores they may use."""
    cores = physical_cores() if cores is None else cores
    return max(1, cores // max(1, processes))


def thread_env(processes: int = 1, cores: int | None = None) -> dict[str, str]:
    """The environment a CPU run gets (the launcher keeps a user's own setting of either variable)."""
    return {"OMP_NUM_THREADS": str(threads_per_process(processes, cores)), "OMP_WAIT_POLICY": "PASSIVE"}
