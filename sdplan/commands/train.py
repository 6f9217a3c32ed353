"""`sdplan train`: probe, plan, confirm, write sdplan.yaml and launch the bundled trainer; `--demo` for a tiny
model on the CPU. Thin: the work is in ``sdplan.launcher`` and ``sdplan.demo`` (imported inside the function so
`sdplan --help` stays fast)."""

from __future__ import annotations

import sys
from enum import Enum
from typing import Annotated

import typer

from sdplan import registry
from sdplan.commands._common import (
    cli_errors,
    console,
    expand_home,
    reject_empty,
    reject_repeated_settings,
)


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


@cli_errors
def train(
    ctx: typer.Context,
    method: Annotated[
        str | None,
        typer.Option(
            metavar="METHOD",
            help=f"What to train: {registry.one_of(registry.METHODS)} (default lora).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            metavar="PATH_OR_ID",
            help="Base model: a diffusers folder, a .safetensors/.ckpt file or a hub id "
            "(with --demo: the tiny model's family: sd15, sdxl, sd35, flux, ...).",
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            metavar="DIR", help="Training images: flat with .txt captions, kohya N_name, or metadata."
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            metavar="DIR",
            help="Run folder (default ./output; ./sdplan-demo with --demo). A folder holding files is refused "
            "unless it is an sdplan run and --resume or --force is given.",
        ),
    ] = None,
    resolution: Annotated[int | None, typer.Option(min=64, help="Training resolution in pixels.")] = None,
    epochs: Annotated[
        int | None,
        typer.Option(min=1, help="Passes over the dataset (with its repeats; default 10, the demo's 2)."),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(min=1, help="Use this many GPUs on this machine (default: the planner decides)."),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            metavar="FILE", help="Train exactly this sdplan.yaml (after validation) instead of planning."
        ),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Start without asking for confirmation.")] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Start an existing sdplan run in --out over (with its own sdplan.yaml when no "
            "--model/--dataset/--config is given).",
        ),
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Continue the run in --out from its newest checkpoint (config read from there)."
        ),
    ] = False,
    demo: Annotated[
        bool,
        typer.Option(
            "--demo",
            help="Train a LoRA on a tiny model built in code and a generated dataset, on the CPU (<1 min).",
        ),
    ] = False,
    device: Annotated[
        Device | None,
        typer.Option(help="cpu: train on the CPU even without a GPU (slow).", show_default=False),
    ] = None,
    num_processes: Annotated[
        int | None,
        typer.Option(
            min=1, help="CPU only: run N real processes with gloo (torchrun; with DeepSpeed, its launch)."
        ),
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option(min=1, help="Stop after N optimizer steps (one-process count).")
    ] = None,
    num_machines: Annotated[int, typer.Option(min=1, help="Machines in a multi-node run.")] = 1,
    machine_rank: Annotated[int, typer.Option(min=0, help="This machine's rank (0 = the main process).")] = 0,
    main_process_ip: Annotated[
        str | None, typer.Option(metavar="IP", help="Address of machine 0 (several machines).")
    ] = None,
    main_process_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Port on machine 0 (several machines; default 29500). One machine: a free port.",
        ),
    ] = None,
    no_plan: Annotated[
        bool,
        typer.Option(
            "--no-plan",
            help="Do not plan: train the defaults with your key=value settings exactly as given, with no check "
            "that they fit (by default the planner plans around them and refuses settings that cannot fit).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Validate, plan and print the launch command; write and run nothing."),
    ] = False,
) -> None:
    """Probe, plan (as `sdplan recommend`), confirm, write sdplan.yaml and launch the trainer.

    Extra arguments are key=value settings of sdplan.yaml (training.batch_size=8 training.learning_rate=5e-5):
    they win, and the planner plans everything else around them (as `sdplan recommend` does with pins).
    """
    from sdplan.config import implied_settings
    from sdplan.launcher import UI, TrainRequest, check_stack

    reject_empty(model=model, dataset=dataset, out=out, config=config)
    model, dataset, out, config = (expand_home(v) for v in (model, dataset, out, config))
    reject_repeated_settings(ctx.args)
    check_stack()  # once, before the demo or the run writes anything

    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    ui = UI(
        echo=lambda line: console().print(line, soft_wrap=True, markup=False),
        confirm=(lambda q: typer.confirm(q, default=True)) if interactive else None,
    )
    req = TrainRequest(
        method=registry.method(method).name if method else None,  # a typo: "did you mean", as recommend
        model=model,
        dataset=dataset,
        out=out,
        resolution=resolution,
        epochs=epochs,
        gpus=gpus,
        config=config,
        overrides=implied_settings(ctx.args),
        yes=yes,
        force=force,
        resume=resume,
        device=device.value if device else None,
        num_processes=num_processes,
        max_steps=max_steps,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=main_process_ip,
        main_process_port=main_process_port,
        dry_run=dry_run,
        demo=demo,
        no_plan=no_plan,
    )
    if demo:
        from sdplan.demo import run_demo

        summary = run_demo(req, ui)
    else:
        from sdplan.launcher import run

        summary = run(req, ui)
    if summary:
        from sdplan.launcher import render_summary

        for line in render_summary(summary):
            console().print(line, soft_wrap=True, markup=False)
