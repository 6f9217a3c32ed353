"""`sdplan doctor`'s human report: rich tables from a snapshot, then a verdict per method x model family.

Data and rendering are apart: the ``*_rows`` functions turn a snapshot into plain strings (tests and other
front ends use them), :func:`render` only lays them out. The verdict is pluggable: any function
``(snapshot) -> list[Verdict]`` (a Verdict is the tuple ``(method, family, status, note)``);
:func:`planner_verdicts` asks the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sdplan import registry
from sdplan.errors import SdplanError
from sdplan.machine import GPU, Snapshot
from sdplan.probe.snapshot import sorted_findings, trained_gpus
from sdplan.registry import METHODS, PLANNED_FAMILIES
from sdplan.settings import deepspeed_label
from sdplan.trainer.dataset_scan import count_of


class Verdict(NamedTuple):
    method: str
    family: str
    status: str  # "ok" | "tight" | "no" | "unknown" | "n/a" (the planner does not plan this method here)
    note: str


VerdictFn = Callable[[Snapshot], Sequence[tuple[str, str, str, str]]]


def planner_verdicts(snapshot: Snapshot) -> list[Verdict]:
    """Verdict from the planner: the plan `sdplan recommend --method M --model F --gpus 1` makes for this snapshot
    (its request, from recommend's own defaults: 20 images, 10 epochs, the default config's sampling and class
    images), the fastest one-GPU plan at the family's native resolution (on a machine whose GPUs differ, on the
    GPU that suits it best, named in the note).

    ok: fits without DeepSpeed offload; tight: only with offload (the optimizer on the CPU), or loading the models
    takes more host RAM than the machine has (it may swap heavily or be killed by the OS: recommend's warning;
    the planner refuses only RAM held for the whole run, offload's and block swap's), or the likely peak's upper
    end is over the card (recommend's "may not fit"); no: does not fit.
    """
    from sdplan.planner import hardware_from_snapshot, loading_ram_short, mixed_gpus, plan, plan_gpus
    from sdplan.profiles import load_profiles
    from sdplan.recommend import RecommendInputs, build_request

    profiles = load_profiles()
    hardware = hardware_from_snapshot(snapshot, profiles)
    mixed = mixed_gpus(hardware)
    out: list[Verdict] = []
    for method in METHODS:
        for family in PLANNED_FAMILIES:  # a family not yet planned has no verdict
            if not registry.family(family).plans(method):
                out.append(Verdict(method, family, NA, "not for this family"))
                continue
            try:
                request, _ = build_request(RecommendInputs(method=method, model=family, gpus=1), profiles)
                result = plan(hardware, profiles, request)
            except SdplanError as e:  # a request the planner refuses: a cell, not a traceback
                out.append(
                    Verdict(method, family, NA, str(e).splitlines()[0] if str(e) else type(e).__name__)
                )
                continue
            s = result.plan
            if not result.feasible or s is None or result.memory is None:
                need = (result.needs or {}).get("min_vram_bytes")
                # one decimal, as recommend says it: rounded to whole GiB, 12.4 read "needs a 12 GiB GPU" on a 12 GiB card
                what = (
                    f"needs a {need / 2**30:.1f} GiB GPU"
                    if need
                    else "measured out of memory on this GPU"
                    if (result.needs or {}).get("observed_oom")
                    else "does not fit"
                )
                if mixed_need := (result.needs or {}).get("min_vram_bytes_mixed_precision"):  # GTX 16: fp32
                    what += f" in fp32 ({mixed_need / 2**30:.1f} GiB in fp16)"
                if installs := (result.needs or {}).get("fits_after_install"):  # as recommend's headline
                    fix = installs[0]
                    what += f"; fits after `{fix['install']}` (an {fix['base_precision']} base)"
                # no "no usable GPU" here: the table's title says it once
                out.append(Verdict(method, family, "no", what))
                continue
            savers = [s.precision, f"batch {s.batch}"]
            if s.gradient_checkpointing:
                savers.append("GC")
            if s.optimizer != "adamw":
                savers.append(s.optimizer)
            if s.deepspeed:
                savers.append(
                    deepspeed_label(s.deepspeed) + (f" over {s.num_gpus} GPUs" if s.sharded else "")
                )
            if s.base_precision != "bf16":
                savers.append(f"{s.base_precision} base")
            if s.cache_text_encoder_outputs:
                savers.append("cached TE")
            if s.blocks_to_swap:
                savers.append(f"swap {s.blocks_to_swap} blocks")
            note = f"{', '.join(savers)}; {result.memory.peak / 2**30:.1f} GiB"
            short_ram = loading_ram_short(result.memory, hardware.ram_usable_bytes)
            if short_ram:
                note += (
                    f"; loading takes {_gib(int(result.memory.ram))} of host RAM, "
                    f"{_gib(hardware.ram_usable_bytes)} here: may swap"
                )
            risky = result.within_upper_bound is False  # recommend's "may not fit"
            if risky and result.peak_range is not None and result.vram_bytes:
                note += (
                    f"; may not fit: likely up to {result.peak_range[1] / 2**30:.1f} GiB of "
                    f"{result.vram_bytes / 2**30:.1f}"
                )
            if mixed:  # which of the GPUs that differ
                note += f" on GPU {plan_gpus(hardware, s)[0].index}"
            out.append(Verdict(method, family, "tight" if (s.offload or short_ram or risky) else "ok", note))
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
        (
            "RAM",
            f"{_gib(h.ram_total_bytes)} total, {_gib(h.ram_available_bytes)} available"
            + (f", {_gib(h.ram_limit_bytes)} cgroup limit" if h.ram_limit_bytes is not None else ""),
        ),
        ("disk free", _gib(h.disk_free_bytes)),
        ("/dev/shm", _gib(h.shm_bytes)),
    ]


GPU_COLUMNS = ("#", "name", "memory", "arch", "bf16", "fp16", "PCIe", "power", "driver")


def gpu_rows(s: Snapshot) -> list[tuple[str, ...]]:
    return [_gpu_row(g) for g in s.gpus]


def _gpu_row(g: GPU) -> tuple[str, ...]:
    if g.memory_total_bytes is None:
        memory = NA + (
            f" (MIG mode: {count_of(g.mig_slices, 'slice')}, memory not readable)"
            if g.mig and g.mig_slices
            else " (MIG mode, no slice readable)"
            if g.mig
            else ""
        )
    else:
        free = f" ({_gib(g.memory_free_bytes)} free)" if g.memory_free_bytes is not None else ""
        memory = _gib(g.memory_total_bytes) + free
        if g.mig:  # the largest MIG slice's, the most a process can use
            memory += f" (MIG: largest of {count_of(g.mig_slices, 'slice') if g.mig_slices else '? slices'})"
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
_STATUS_STYLE = {"ok": "green", "tight": "yellow", "no": "red", "unknown": "dim", "n/a": "dim"}


def render(
    snapshot: Snapshot, console: Console, verdicts: VerdictFn = planner_verdicts
) -> list[tuple[str, str, str, str]] | None:
    """Print the report: host, GPUs, links, stack, findings, then the verdict grid. Returns the verdicts shown
    (None where they are not available), for the command's exit code (:func:`nothing_ok`)."""
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

    try:
        shown = list(verdicts(snapshot))
    except SdplanError as e:  # its profiles unreadable (a broken local store): said, not an exit
        console.print(f"[bold]Verdict[/]: not available: {escape(str(e))}")
        return None
    grid = verdict_grid(shown)
    title = "Verdict (planner: fastest one-GPU plan at native resolution)"
    if not trained_gpus(snapshot):  # the GPUs the planner plans: none of another vendor's than torch drives
        # with this host's RAM: DeepSpeed's CPU offload, which lowers what a full fine-tune needs of the GPU,
        # keeps the optimizer there (a FLUX.1 DreamBooth needs a 52.7 GiB GPU beside 23.5 GiB of RAM)
        title = (
            "Verdict: no usable GPU here; the smallest GPU each would need beside this machine's "
            f"{_gib(snapshot.host.ram_usable_bytes)} of RAM (planner, native resolution)"
        )
    # a row per family, a column per method: four columns of notes fit an 80-column terminal, where eight
    # family columns broke words ("support / ed") and cut the methods' names
    table = Table(title=title, title_justify="left")
    table.add_column("model")
    for method in METHODS:
        table.add_column(method.replace("-", " "), overflow="fold")
    for family in PLANNED_FAMILIES:
        cells = []
        for method in METHODS:
            status, note = grid.get(method, {}).get(family, ("unknown", ""))
            style = _STATUS_STYLE.get(status, "")
            cells.append(f"[{style}]{escape(status)}[/]" + (f"\n[dim]{escape(note)}[/]" if note else ""))
        table.add_row(family, *cells)
    console.print(table)
    return shown


def nothing_ok(snapshot: Snapshot, verdicts: Sequence[tuple[str, str, str, str]] | None) -> str | None:
    """The line `sdplan doctor` exits 1 with where the machine has GPUs a run trains on but no verdict is ok:
    every method and model only with offload, swapping while it loads, at risk of running out, or not at all (a
    machine without such a GPU is the no_gpu finding's error); None otherwise, and where the verdicts are not
    known."""
    if not trained_gpus(snapshot) or not verdicts or any(status == "ok" for _, _, status, _ in verdicts):
        return None
    return (
        "no method and model is ok on this machine: every verdict is tight or no, and each says what it needs "
        "(a larger GPU, or the host RAM loading takes): see Verdict"
    )


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    return table
