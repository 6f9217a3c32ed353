"""`sdplan bench`: measure training memory and speed on this GPU and teach the planner (sdplan.bench)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from sdplan import registry
from sdplan.commands._common import cli_errors, console, err_console, reject_repeated_settings
from sdplan.extras import install_hint
from sdplan.trainer.dataset_scan import count_of


@cli_errors
def bench(
    method: Annotated[
        list[str] | None,
        typer.Option(
            "--method",
            "-m",
            metavar="M",
            help=f"{registry.one_of(registry.METHODS)} (repeat for several). "
            "Default: every method the planner has no measurement for on this GPU.",
        ),
    ] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            metavar="F",
            help=f"{registry.one_of(registry.FAMILIES)} (repeat for several). Default: sd15 and sdxl.",
        ),
    ] = None,
    resolution: Annotated[
        int | None,
        typer.Option(
            "--resolution", metavar="N", help="Image side in pixels. Default: the model's native one."
        ),
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Fewer timed steps and batches up to 16 (default: up to 64).")
    ] = False,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help="Run the same code on a tiny model (SD 1.x-, SDXL-, SD3.5- or FLUX.1-shaped) on the CPU (6-25 s measured on two cores; to try it). "
            "Its points are labelled as demo measurements and go to the store's demo/ folder, which the "
            "planner does not read (unless --store says otherwise).",
        ),
    ] = False,
    store: Annotated[
        Path | None,
        typer.Option(
            "--store",
            metavar="DIR",
            help="Profile store to write to. Default: $SDPLAN_PROFILE_DIR, else $XDG_DATA_HOME/sdplan/profiles.",
        ),
    ] = None,
    host: Annotated[
        bool,
        typer.Option(
            "--host",
            help="Measure this host's CPU instead: DeepSpeed's CPU Adam rate, which sets the time of DeepSpeed "
            "optimizer offload, saved for the planner's plans on this machine (no GPU needed; needs "
            f"`{install_hint('deepspeed')}`).",
        ),
    ] = False,
    settings: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="Pin what is measured, as `sdplan train` takes it (memory.gradient_checkpointing=false "
            "training.precision=bf16 memory.optimizer=adamw8bit memory.cache_text_encoder_outputs=false "
            "lora.rank=32 model.base_precision=fp8 distributed.deepspeed.zero_stage=2); the rest is the planner's "
            "choice. The bench searches the batch (under DeepSpeed, each batch in a process of its own).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Measure peak memory and it/s of real training steps on this GPU, search the largest batch that fits,
    and save the results where the planner reads them (`sdplan recommend` then says basis: measured).

    Full-size networks with random weights (nothing is downloaded) run a short warmed-up loop through the
    bundled trainer's code with the settings the planner would choose. An out-of-memory error at a probe
    point bounds the batch search; it is recorded, not fatal. Each point is saved as soon as it is measured:
    Ctrl-C keeps them.
    """
    from sdplan import bench as lib
    from sdplan import profiles

    if host:
        _bench_host(store, clash=bool(method or model or resolution or demo or quick or settings))
        return
    reject_repeated_settings(settings)
    pins = tuple(settings or ())
    # a typo first: it is wrong on any machine
    lib.check_selection(method, model, resolution, demo=demo, pins=pins)
    lib.resolve_device("auto", demo=demo)  # no GPU: say so before probing and planning
    selection = lib.select_requests(method, model, resolution, demo=demo, store_dir=store, pins=pins)
    root = lib.store_root(store, demo=demo)
    for line in selection.skipped:
        console().print(f"skip {line}", style="dim", markup=False)
    if selection.uncatalogued:
        console().print(f"note: {selection.uncatalogued}", markup=False)
    if not selection.requests:
        console().print(
            f"Nothing to measure: every default case has a measured point for {selection.gpu} already. "
            "Name --method/--model/--resolution to measure again.",
            markup=False,
        )
        return
    profiles.ensure_store(root)  # an unwritable --store is one line now, not after the first measurement
    where = "the CPU, tiny demo model" if demo else (selection.gpu or "this GPU")
    console().print(
        f"Measuring {count_of(len(selection.requests), 'configuration')} on {where}; "
        f"results go to {root}/methods/",
        markup=False,
    )

    points: list[Any] = []
    effort = lib.DEMO if demo else (lib.QUICK if quick else lib.FULL)
    progress, task = _progress(len(selection.requests))
    current: dict[str, Any] = {"req": None, "done": 0}

    def on_status(req: Any, text: str) -> None:
        if req is not current["req"]:
            if current["req"] is not None:
                current["done"] += 1
            progress.console.print(
                f"[bold]{escape(req.label)}[/] [dim](settings from {escape(str(req.settings_from))})[/]"
            )
        current["req"] = req
        progress.update(task, completed=current["done"], description=f"{req.label}: {text}")
        if not progress.console.is_terminal:  # no live bar in a log or a pipe: say each phase on a line
            progress.console.print(f"  ... {text}", markup=False, style="dim")

    def on_result(point: Any) -> None:
        points.append(point)
        progress.console.print(f"  {_point_line(point)}", markup=False)

    interrupted = False
    progress.start()
    try:
        lib.run_bench(
            selection.requests,
            quick=quick,
            store_dir=root,
            device="auto",
            on_result=on_result,
            on_status=on_status,
            demo=demo,
            effort=effort,
        )
        progress.update(task, completed=len(selection.requests), description="done")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.stop()

    console().print(results_table(selection.requests, points, cap=effort.max_batch, interrupted=interrupted))
    files = sorted({str(p.store_file) for p in points if p.store_file})
    if points:
        console().print(f"{count_of(len(points), 'point')} saved to {', '.join(files)}", markup=False)
    if demo:
        console().print(
            "[dim]demo: a tiny model on the CPU; memory is the process's resident-set growth, not VRAM. "
            "On a GPU, `sdplan bench` measures the full-size models.[/]"
        )
    elif points and not interrupted and selection.uncatalogued:
        console().print(f"The planner does not use these yet: {selection.uncatalogued}", markup=False)
    elif points and not interrupted and root.resolve() == profiles.local_dir().resolve():
        console().print(
            "The planner uses these now: `sdplan recommend` reports estimate.basis measured for them, and scaled "
            "for settings near them on this GPU."
        )
    elif points and not interrupted:  # --store elsewhere: the planner reads only its own store
        console().print(
            f"The planner reads {profiles.local_dir()}, not {root}: to use these points, "
            f"`sdplan profiles export FILE --store {shlex.quote(str(root))}` then `sdplan profiles import FILE`, "
            f"or set SDPLAN_PROFILE_DIR={shlex.quote(str(root))}.",
            markup=False,
        )
    if interrupted:
        kept = "is" if len(points) == 1 else "are"
        err_console().print(
            f"[yellow]the {count_of(len(points), 'point')} measured before Ctrl-C {kept} kept[/]"
        )
        raise KeyboardInterrupt


def _bench_host(store: Path | None, *, clash: bool) -> None:
    from sdplan import bench as lib
    from sdplan.errors import UsageError
    from sdplan.trainer import runtime

    if clash:
        raise UsageError(
            "--host measures this host's CPU only",
            fix="run `sdplan bench --host` alone (--store may go with it)",
        )
    note = runtime.deepspeed_cpu_adam_build_note()
    if note:
        console().print(note, markup=False)
    console().print(
        f"Measuring DeepSpeed's CPU Adam on this host ({lib.HOST_PARAMS / 1e6:.0f}M parameters, "
        f"{lib.HOST_STEPS} steps) ...",
        markup=False,
    )
    measured, path = lib.measure_host(store)
    console().print(
        f"CPU Adam: {measured.cpu_adam_params_per_s / 1e9:.2f} G parameters/s on "
        f"{count_of(measured.threads, 'thread')} of {measured.cpu}; saved to {path}: `sdplan recommend` on this "
        "machine uses it for DeepSpeed offload's time",
        markup=False,
    )


def _progress(total: int):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console(),
        transient=True,
    )
    task = progress.add_task("starting", total=total)
    return progress, task


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _point_line(p: Any) -> str:
    if not p.fits:
        hook = " (simulated)" if p.simulated_oom else ""
        return f"batch {p.batch}: out of memory{hook}"
    mem = _gib(p.memory_bytes)
    reserved = f", reserved {_gib(p.peak_reserved_bytes)}" if p.peak_reserved_bytes is not None else ""
    rate = f"{p.it_s:.2f} it/s" if p.it_s else "- it/s"
    return f"batch {p.batch}: fits, {p.memory_label} {mem}{reserved}, {rate}"


def results_table(requests: list[Any], points: list[Any], *, cap: int, interrupted: bool):
    from rich.table import Table

    from sdplan import bench as lib

    rows = lib.summarise(requests, points, cap=cap, interrupted=interrupted)
    cpu = any(p.demo for p in points)  # (a GPU's out-of-memory points have no peak either)
    table = Table(title="sdplan bench", title_justify="left")
    table.add_column("case")
    table.add_column("settings", overflow="fold")
    table.add_column("max batch", justify="right")
    table.add_column("RSS Δ (CPU)" if cpu else "peak VRAM", justify="right")
    table.add_column("it/s", justify="right")
    table.add_column("img/s", justify="right")
    table.add_column("ended by")
    for r in rows:
        req = r["request"]
        table.add_row(
            f"{req.method} {req.model}{' tiny' if cpu else ''} {req.resolution}px",
            req.settings,
            str(r["largest"]) if r["largest"] else "none fits",
            _gib(r["memory"]),
            f"{r['it_s']:.2f}" if r["it_s"] else "-",
            f"{r['images_s']:.2f}" if r["images_s"] else "-",
            r["limit"],
        )
    return table
