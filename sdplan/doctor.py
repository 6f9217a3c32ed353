"""`sdplan doctor`'s human report: rich tables from a snapshot, then a verdict per method x model family.

Data and rendering are apart: the ``*_rows`` functions turn a snapshot into plain strings (tests and other
front ends use them), :func:`render` only lays them out. The verdict is pluggable: any function
``(snapshot) -> list[Verdict]`` (a Verdict is the tuple ``(method, family, status, note)``). Until the
planner exists :func:`threshold_verdicts` answers from VRAM thresholds; switching to the planner is the one
line ``verdicts = threshold_verdicts`` in ``sdplan/commands/doctor.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sdplan.machine import GPU, Snapshot
from sdplan.probe.snapshot import sorted_findings

METHODS = ("lora", "dreambooth", "finetune", "textual-inversion")
FAMILIES = ("sd15", "sd21", "sdxl")
STATUSES = ("ok", "tight", "no", "unknown")


class Verdict(NamedTuple):
    method: str
    family: str
    status: str  # "ok" | "tight" | "no" | "unknown"
    note: str


VerdictFn = Callable[[Snapshot], Sequence[tuple[str, str, str, str]]]

# (fits with memory savers, comfortable) in nominal GB of one GPU's memory, for 1 image per step at the
# family's native resolution (512 / 768 / 1024). Sources: field notes section 1 "Published memory figures".
VRAM_THRESHOLDS_GB: dict[tuple[str, str], tuple[float, float]] = {
    # diffusers LoRA docs: SD1.5 LoRA fp16 fits an 11 GB RTX 2080 Ti; 6 GB with gradient checkpointing.
    ("lora", "sd15"): (6, 8),
    ("lora", "sd21"): (8, 12),  # derived: 768 px has 2.25x the latent pixels of 512 px
    ("lora", "sdxl"): (12, 16),  # diffusers README_sdxl: DreamBooth LoRA SDXL < 16 GB (GC, 8-bit Adam)
    # diffusers dreambooth README: 12 GB with GC + 8-bit Adam + xformers; 16 GB with GC + 8-bit Adam.
    ("dreambooth", "sd15"): (12, 16),
    ("dreambooth", "sd21"): (16, 24),  # derived from sd15 at 768 px; kohya: SD2.x full fp16 < 12 GB
    ("dreambooth", "sdxl"): (24, 40),  # kohya train_SDXL: UNet-only fits 24 GB (Adafactor, cached TE/latents)
    # lunar-diffusion: 16 GB only with DeepSpeed offload; diffusers text_to_image: fits 24 GB (GC, EMA).
    ("finetune", "sd15"): (16, 24),
    ("finetune", "sd21"): (16, 24),
    ("finetune", "sdxl"): (24, 48),  # kohya train_SDXL + PR 1259: 24 GB with Adafactor/fused backward
    # textual inversion trains one embedding; the frozen UNet still runs forward and backward.
    ("textual-inversion", "sd15"): (6, 8),
    ("textual-inversion", "sd21"): (8, 12),
    ("textual-inversion", "sdxl"): (12, 16),
}
# What "tight" takes: the memory savers the sources above used at the lower figure.
TIGHT_SAVERS = {
    "lora": "gradient checkpointing",
    "textual-inversion": "gradient checkpointing",
    "dreambooth": "gradient checkpointing, 8-bit Adam, cached latents",
    "finetune": "gradient checkpointing, 8-bit Adam, cached latents",
}
# Cards are sold by nominal GB; the driver reports a little less (Tesla T4 "16 GB": 15.0 GiB).
NOMINAL_SLACK = 0.93


def nominal_gb(memory_bytes: int) -> float:
    return memory_bytes / 2**30 / NOMINAL_SLACK


def threshold_verdicts(snapshot: Snapshot) -> list[Verdict]:
    """Verdict from the memory of the best single GPU (data parallelism does not add memory per model)."""
    best = max(snapshot.usable_gpus, key=lambda g: g.memory_total_bytes or 0, default=None)
    out: list[Verdict] = []
    for method in METHODS:
        for family in FAMILIES:
            low, comfortable = VRAM_THRESHOLDS_GB[(method, family)]
            if best is None or not best.memory_total_bytes:
                out.append(Verdict(method, family, "no", "no usable GPU"))
                continue
            have = nominal_gb(best.memory_total_bytes)
            shown = f"{best.memory_total_bytes / 2**30:.0f} GiB"
            if have >= comfortable:
                out.append(Verdict(method, family, "ok", f"fits {shown}"))
            elif have >= low:
                out.append(Verdict(method, family, "tight", f"{shown}: with {TIGHT_SAVERS[method]}"))
            else:
                out.append(Verdict(method, family, "no", f"needs a >= {low:g} GB GPU, best has {shown}"))
    return out


def planner_verdicts(snapshot: Snapshot) -> list[Verdict]:
    """Verdict from the planner: the fastest one-GPU plan at the family's native resolution.

    ok: fits without DeepSpeed offload; tight: only with offload (3-4x slower); no: does not fit.
    """
    from sdplan.planner import Request, hardware_from_snapshot, plan
    from sdplan.profiles import load_profiles

    profiles = load_profiles()
    no_gpu = not snapshot.usable_gpus
    hardware = hardware_from_snapshot(snapshot, profiles)
    out: list[Verdict] = []
    for method in METHODS:
        for family in FAMILIES:
            result = plan(hardware, profiles, Request(method=method, model=family, max_gpus=1, epochs=1))
            s = result.plan
            if not result.feasible or s is None or result.memory is None:
                need = (result.needs or {}).get("min_vram_bytes")
                what = f"needs a {need / 2**30:.0f} GiB GPU" if need else "does not fit"
                out.append(Verdict(method, family, "no", f"no usable GPU; {what}" if no_gpu else what))
                continue
            savers = [s.precision, f"batch {s.batch}"]
            if s.gradient_checkpointing:
                savers.append("GC")
            if s.optimizer != "adamw":
                savers.append(s.optimizer)
            if s.offload:
                savers.append("offload")
            note = f"{', '.join(savers)}; {result.memory.peak / 2**30:.1f} GiB"
            out.append(Verdict(method, family, "tight" if s.offload else "ok", note))
    return out


# -- data: snapshot -> rows of strings -------------------------------------------------------------------

NA = "n/a"


def _gib(n: int | None) -> str:
    return NA if n is None else f"{n / 2**30:.1f} GiB"


def _yes_no(v: bool | None) -> str:
    return NA if v is None else ("yes" if v else "no")


def _text(v: object) -> str:
    return NA if v is None else str(v)


def host_rows(s: Snapshot) -> list[tuple[str, str]]:
    h = s.host
    cpu = _text(h.cpu_model) + (f" ({h.cpu_cores} CPUs)" if h.cpu_cores else "")
    return [
        ("OS", _text(h.os)),
        ("kernel", _text(h.kernel)),
        ("CPU", cpu),
        ("RAM", f"{_gib(h.ram_total_bytes)} total, {_gib(h.ram_available_bytes)} available"),
        ("disk free", _gib(h.disk_free_bytes)),
        ("/dev/shm", _gib(h.shm_bytes)),
    ]


GPU_COLUMNS = ("#", "name", "memory", "arch", "bf16", "fp16", "PCIe", "power", "driver")


def gpu_rows(s: Snapshot) -> list[tuple[str, ...]]:
    return [_gpu_row(g) for g in s.gpus]


def _gpu_row(g: GPU) -> tuple[str, ...]:
    if g.memory_total_bytes is None:
        memory = NA
    else:
        free = f" ({_gib(g.memory_free_bytes)} free)" if g.memory_free_bytes is not None else ""
        memory = _gib(g.memory_total_bytes) + free
    arch = f"cc {g.compute_capability}" if g.compute_capability else (g.gfx_arch or NA)
    pcie = f"gen{g.pcie_gen or '?'} x{g.pcie_width or '?'}" if g.pcie_gen or g.pcie_width else NA
    power = f"{g.power_limit_watts:g} W" if g.power_limit_watts is not None else NA
    return (
        str(g.index),
        f"{g.vendor}: {g.name or NA}",
        memory,
        arch,
        _yes_no(g.bf16),
        _yes_no(g.fp16),
        pcie,
        power,
        _text(g.driver_version),
    )


def link_rows(s: Snapshot) -> list[tuple[str, str, str, str]]:
    return [(str(lk.a), str(lk.b), lk.type, _yes_no(lk.p2p)) for lk in s.links]


def stack_rows(s: Snapshot) -> list[tuple[str, str]]:
    sw = s.software
    torch = NA if sw.torch is None else f"{sw.torch} ({sw.torch_build or 'unknown build'})"
    rows = [
        ("python", _text(sw.python)),
        ("torch", torch),
        ("CUDA runtime (torch)", _text(sw.cuda_runtime)),
        ("CUDA driver supports", _text(sw.cuda_driver)),
        ("HIP runtime (torch)", _text(sw.hip_runtime)),
        ("ROCm", _text(sw.rocm)),
    ]
    rows += [(name, version or "not installed") for name, version in sw.packages.items()]
    rows += [(f"${key}", value) for key, value in s.env.items() if value is not None]
    return rows


def finding_rows(s: Snapshot) -> list[tuple[str, str, str, str]]:
    return [(f.severity, f.code, f.message, f.fix) for f in sorted_findings(s.findings)]


def verdict_grid(verdicts: Sequence[tuple[str, str, str, str]]) -> dict[str, dict[str, tuple[str, str]]]:
    """{method: {family: (status, note)}} from a verdict list; unknown pairs are left out."""
    grid: dict[str, dict[str, tuple[str, str]]] = {}
    for method, family, status, note in verdicts:
        grid.setdefault(method, {})[family] = (status, note)
    return grid


# -- render ----------------------------------------------------------------------------------------------

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_STATUS_STYLE = {"ok": "green", "tight": "yellow", "no": "red", "unknown": "dim"}


def render(snapshot: Snapshot, console: Console, verdicts: VerdictFn = threshold_verdicts) -> None:
    """Print the report: host, GPUs, links, stack, findings, then the verdict grid."""
    console.print(_kv_table("Host", host_rows(snapshot)))

    gpus = gpu_rows(snapshot)
    if gpus:
        table = Table(title="GPUs", title_justify="left")
        for column in GPU_COLUMNS:
            table.add_column(column, overflow="fold")
        for row in gpus:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)
    else:
        console.print("[bold]GPUs[/]: none found")

    links = link_rows(snapshot)
    if links:
        table = Table(title="Links", title_justify="left")
        for column in ("GPU", "GPU", "type", "P2P"):
            table.add_column(column)
        for row in links:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)

    console.print(_kv_table("Stack", stack_rows(snapshot)))

    rows = finding_rows(snapshot)
    if rows:
        table = Table(title="Findings", title_justify="left")
        table.add_column("severity")
        table.add_column("code")
        table.add_column("finding", overflow="fold")
        table.add_column("fix", overflow="fold")
        for severity, code, message, fix in rows:
            style = _SEVERITY_STYLE.get(severity, "")
            table.add_row(f"[{style}]{severity}[/]", code, escape(message), escape(fix))
        console.print(table)
    else:
        console.print("[bold]Findings[/]: none [green]ok[/]")

    grid = verdict_grid(list(verdicts(snapshot)))
    table = Table(title="Verdict (planner: fastest one-GPU plan at native resolution)", title_justify="left")
    table.add_column("method")
    for family in FAMILIES:
        table.add_column(family, overflow="fold")
    for method in METHODS:
        cells = []
        for family in FAMILIES:
            status, note = grid.get(method, {}).get(family, ("unknown", ""))
            style = _STATUS_STYLE.get(status, "")
            cells.append(f"[{style}]{escape(status)}[/]" + (f"\n[dim]{escape(note)}[/]" if note else ""))
        table.add_row(method, *cells)
    console.print(table)


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    return table
