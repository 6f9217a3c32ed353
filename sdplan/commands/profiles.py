"""`sdplan profiles`: what the planner knows (shipped profiles and this machine's measurements), with sources;
`sdplan profiles export FILE` shares the local measurements."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from sdplan.commands._common import cli_errors, console
from sdplan.settings import describe
from sdplan.trainer.dataset_scan import count_of

profiles_app = typer.Typer(
    help="What the planner knows, with sources: shipped profiles and this machine's measurements.",
    no_args_is_help=False,
    add_completion=False,
    rich_markup_mode="rich",
)

_STORE = typer.Option(
    "--store",
    metavar="DIR",
    help="Local profile store. Default: $SDPLAN_PROFILE_DIR, else $XDG_DATA_HOME/sdplan/profiles.",
)


@profiles_app.callback(invoke_without_command=True)
@cli_errors
def profiles(
    ctx: typer.Context,
    gpus: Annotated[bool, typer.Option("--gpus", help="Also list the GPU catalog.")] = False,
    full: Annotated[bool, typer.Option("--full", help="Show sources in full (not shortened).")] = False,
    store: Annotated[Path | None, _STORE] = None,
) -> None:
    """List the profile files, every method point (published or measured here) and where each comes from."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = {"store": store}  # `profiles --store DIR export|import`: the subcommand's store (_store)
        return
    from sdplan import profiles as lib
    from sdplan.bench import store_root

    shipped = lib.shipped_dir()
    local = store_root(
        store, verb="read"
    )  # a file there is refused, as by bench and profiles export / import
    known = lib.load_profiles(shipped, local)
    console().print(sources_table(known, shipped, local))
    console().print(points_table(known, full=full))
    if gpus:
        console().print(gpus_table(known, full=full))
    n_local = sum(1 for p in known.points if p.origin == "local")
    where = f"{local}" + ("" if local.is_dir() else " (does not exist yet)")
    console().print(
        f"{len(known.gpus)} GPUs, {len(known.models)} model families, {len(known.points)} method points "
        f"({n_local} measured here). Local store: {where}.",
        markup=False,
    )
    if not n_local:
        console().print(
            "[dim]Measure this GPU with `sdplan bench`; the planner then prefers those numbers.[/]"
        )
    if not gpus:
        console().print("[dim]`sdplan profiles --gpus` lists the GPU catalog.[/]")


def _store(ctx: typer.Context, store: Path | None) -> Path | None:
    """The store a subcommand uses: its own --store, else the group's (``sdplan profiles --store DIR export``
    was silently the default store). Two different ones are refused."""
    group = (ctx.obj or {}).get("store") if isinstance(ctx.obj, dict) else None
    if store is not None and group is not None and Path(store) != Path(group):
        from sdplan.errors import UsageError

        raise UsageError(
            f"--store given twice ({group} before {ctx.info_name}, {store} after it)", fix="give it once"
        )
    return store if store is not None else group


@profiles_app.command("export")
@cli_errors
def export(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(metavar="FILE", help="YAML file to write.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite FILE if it exists.")] = False,
    store: Annotated[Path | None, _STORE] = None,
) -> None:
    """Write this machine's measurements (from `sdplan bench`) as one YAML file to share, or to contribute to
    sdplan's shipped profiles. Demo points and simulated out-of-memory points are left out."""
    from sdplan.bench import export_measurements

    path, count, left_out = export_measurements(file, store_dir=_store(ctx, store), force=force)
    skipped = f" ({count_of(left_out, 'demo/simulated point')} left out)" if left_out else ""
    console().print(f"wrote {count_of(count, 'measured point')} to {path}{skipped}", markup=False)


@profiles_app.command("import")
@cli_errors
def import_(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(metavar="FILE", help="A file written by `sdplan profiles export`.")],
    store: Annotated[Path | None, _STORE] = None,
) -> None:
    """Add the measurements of an export file (from `sdplan profiles export` on another machine) to the local
    store, which the planner reads: a point already there (same id) is replaced, so importing twice adds
    nothing. Demo points and simulated out-of-memory points are left out, as export leaves them out."""
    from sdplan.bench import import_measurements

    root, added, left_out = import_measurements(file, store_dir=_store(ctx, store))
    counts = ", ".join(f"{n} {method}" for method, n in added.items())
    skipped = f" ({count_of(left_out, 'demo/simulated point')} left out)" if left_out else ""
    console().print(
        f"imported {count_of(sum(added.values()), 'point')} ({counts}) into {root}{skipped}", markup=False
    )


# -- tables ---------------------------------------------------------------------------------------------


def _plain(*cells: str) -> list:
    """Table cells as plain text: names and sources are data, not rich markup ("FLUX.1 [dev]" printed as
    "FLUX.1 ", its "[dev]" taken for a style tag)."""
    from rich.text import Text

    return [Text(c) for c in cells]


def _rel(path: Path, *roots: Path) -> str:
    for root in roots:
        try:
            return str(path.resolve().relative_to(root.resolve()))
        except ValueError:
            continue
    return str(path)


def _origin(path: Path, local: Path) -> str:
    try:
        path.resolve().relative_to(local.expanduser().resolve())
        return "local"
    except ValueError:
        return "shipped"


def sources_table(known: Any, shipped: Path, local: Path):
    from rich.table import Table

    table = Table(title="Profile files", title_justify="left")
    table.add_column("origin")
    table.add_column("file")
    table.add_column("holds", overflow="fold")
    for src in known.sources:
        path = Path(src)
        origin = _origin(path, local)
        rel = _rel(path, local.expanduser(), shipped) if origin == "local" else _rel(path, shipped)
        table.add_row(*_plain(origin, rel, _holds(known, path, origin)))
    return table


def _holds(known: Any, path: Path, origin: str) -> str:
    name = path.name
    if name == "gpus.yaml":
        vendors: dict[str, int] = {}
        for g in known.gpus:
            vendors[g.vendor] = vendors.get(g.vendor, 0) + 1
        split = ", ".join(f"{v} {n}" for v, n in sorted(vendors.items()))
        return f"GPU catalog: {len(known.gpus)} GPUs ({split})"
    if path.parent.name == "models":
        m = known.models.get(path.stem)
        if m is not None:
            total = m.denoiser_params + m.text_encoder_params + m.params_vae
            denoiser = "UNet" if m.architecture == "unet" else "transformer"
            return (
                f"{m.name}: {m.native_resolution} px, {total / 1e9:.2f}B parameters "
                f"({denoiser} {m.denoiser_params / 1e6:.0f}M)"
            )
    if path.parent.name == "methods":
        pts = [p for p in known.points if p.method == path.stem and p.origin == origin]
        multi = [m for m in known.multi_gpu if m.method == path.stem] if origin == "shipped" else []
        gpus = sorted({p.gpu for p in pts if p.gpu})
        text = f"{path.stem}: {count_of(len(pts), 'point')}"
        if multi:
            text += f", {count_of(len(multi), 'multi-GPU observation')}"
        if origin == "local" and gpus:
            text += f" measured on {', '.join(gpus)}"
        return text
    if name == "activations.yaml":
        return f"activation and FLOP coefficients per family ({known.activations.source})"
    if name == "host.yaml" and known.host is not None:
        h = known.host
        return f"this host: CPU Adam {h.cpu_adam_params_per_s / 1e9:.2f} G parameters/s ({h.source})"
    return ""


def _kind(p: Any) -> str:
    from sdplan.bench import MEASURED_PREFIX, OOM_HOOK_ENV

    if p.source.startswith(f"{MEASURED_PREFIX} --demo"):
        return "demo (CPU, tiny model)"
    if OOM_HOOK_ENV in p.source:
        return "simulated OOM (test hook)"
    if p.origin == "local":
        return "measured here"
    if p.outcome.get("it_s") or p.outcome.get("peak_vram_gib"):
        return "published measurement"
    return "published fit"


def _outcome(p: Any) -> str:
    o = p.outcome
    bits = []
    if o.get("fits") is True:
        bits.append(f"fits in {o['max_vram_gib']:g} GiB" if o.get("max_vram_gib") else "fits")
    elif o.get("fits") is False:
        bits.append("out of memory")
    if o.get("peak_vram_gib"):
        bits.append(f"peak {o['peak_vram_gib']:.2f} GiB")
    if o.get("ram_gib"):
        bits.append(f"RAM {o['ram_gib']:g} GiB")
    if o.get("it_s"):
        bits.append(f"{o['it_s']:g} it/s")
    return ", ".join(bits)


def points_table(known: Any, *, full: bool = False):
    """Every method point, a table per kind (measured here, published measurement, ...: its title), four
    columns: the case on its GPU, the settings, the outcome, the source (shortened unless ``full``). One table
    of six columns, the kind and the GPU among them, left the settings and outcomes a few letters wide on an
    80-column terminal."""
    import itertools

    from rich.console import Group
    from rich.table import Table

    order = ["measured here", "published measurement", "published fit"]
    points = sorted(
        known.points,
        key=lambda p: (
            order.index(_kind(p)) if _kind(p) in order else 3,
            _kind(p),
            p.method,
            p.model,
            p.resolution,
            p.batch,
        ),
    )
    tables: list[Table] = []
    for kind, group in itertools.groupby(points, key=_kind):
        # the terminal's width, shared out by ratio above each column's minimum (a narrow terminal wraps the
        # settings at their commas, a wide one keeps them on one line)
        table = Table(title=f"Method points: {kind}", title_justify="left", expand=True)
        table.add_column("case", min_width=16, ratio=2, overflow="fold")
        table.add_column("settings", min_width=18, ratio=3, overflow="fold")
        table.add_column("outcome", min_width=14, ratio=2, overflow="fold")
        table.add_column("source", min_width=12, ratio=3, **_shortened(full))
        for p in group:
            gpu = p.gpu or (f"any {p.gpu_memory_gib:g} GiB" if p.gpu_memory_gib else "-")
            if p.num_gpus > 1:
                gpu = f"{p.num_gpus}x {gpu}"
            table.add_row(
                *_plain(
                    f"{p.method} {p.model} {p.resolution}px b{p.batch}"
                    + (f"x{p.grad_accum}" if p.grad_accum > 1 else "")
                    + f" on {gpu}",
                    describe(p.settings, batch=False, gpus=False, short=True),
                    _outcome(p),
                    p.source,
                )
            )
        tables.append(table)
    return Group(*tables)


def _shortened(full: bool) -> dict:
    """A source cell: one line ending in "…" where it does not fit, or folded whole with ``full``."""
    return {"overflow": "fold"} if full else {"overflow": "ellipsis", "no_wrap": True}


def gpus_table(known: Any, *, full: bool = False):
    """The GPU catalog: fixed columns wide enough for their values (a 40-column source cut the TFLOPS to
    "4.…" on an 80-column terminal), the source in what the terminal leaves (as the points tables share it)."""
    from rich.table import Table

    table = Table(title="GPU catalog", title_justify="left", expand=True)
    columns = (("GPU", "left", 15), ("vendor", "left", 6), ("VRAM", "right", 8), ("arch", "left", 7))
    columns += (("bf16", "left", 4), ("fp16 TFLOPS", "right", 7))
    for col, just, w in columns:
        table.add_column(col, justify=just, width=w, overflow="fold")
    table.add_column("source", min_width=12, ratio=1, **_shortened(full))
    for g in known.gpus:
        table.add_row(
            *_plain(
                g.name,
                g.vendor,
                f"{g.memory_bytes / 2**30:.3g} GiB",  # as planned: the NVML total where the catalog has it
                g.arch,
                "yes" if g.bf16 else "no",
                f"{g.fp16_tflops:g}",
                g.source,
            )
        )
    return table
