"""`sdplan recommend`: the fastest training plan that fits this machine (or catalog GPUs), and why."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sdplan import registry
from sdplan.commands._common import (
    cli_errors,
    console,
    err_console,
    expand_home,
    reject_empty,
    reject_repeated_settings,
)

EXIT_NOTHING_FITS = 1


@cli_errors
def recommend(
    method: Annotated[
        str, typer.Option("--method", help=f"What to train: {registry.one_of(registry.METHODS)}.")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            metavar="FAMILY_OR_PATH",
            help=f"Model family: {registry.one_of(registry.PLANNED_FAMILIES)}; or the model as `sdplan train` "
            "takes it (a diffusers folder, a .safetensors/.ckpt file or a hub id): its files say its family, and "
            f"--out writes it as model.path. [default: {registry.DEFAULT_FAMILY}]",
        ),
    ] = None,
    resolution: Annotated[
        int | None,
        typer.Option("--resolution", help="Training resolution in pixels (default: the family's native)."),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            metavar="DIR",
            help="Count images and repeats from DIR (kohya `N_name` folders, flat image+caption files, "
            "metadata.jsonl / metadata.csv or kohya meta_cap.json).",
        ),
    ] = None,
    images: Annotated[
        int | None, typer.Option("--images", help="Number of training images (instead of --dataset).")
    ] = None,
    repeats: Annotated[int | None, typer.Option("--repeats", help="Repeats of each image per epoch.")] = None,
    epochs: Annotated[int | None, typer.Option("--epochs", help="Epochs to train (default 10).")] = None,
    hardware: Annotated[
        str | None,
        typer.Option(
            "--hardware", help="Plan for catalog GPUs, e.g. '2x RTX 4090' (default: probe this machine)."
        ),
    ] = None,
    machine: Annotated[
        str | None,
        typer.Option(
            "--machine", metavar="FILE", help="Plan for a snapshot saved with `sdplan doctor --save`."
        ),
    ] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Use at most N of the GPUs.")] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            "--compare",
            help="Comma-separated hardware options to compare, e.g. 'RTX 3060 12GB,RTX 4090,2x RTX 4090,H100 SXM'.",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", metavar="DIR", help="Write sdplan.yaml, accelerate.yaml (and deepspeed.json) to DIR."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --out overwrite existing files.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print the plan as JSON and nothing else.")] = False,
    settings: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="Pin sdplan.yaml settings as `sdplan train` takes them (training.batch_size=4 lora.rank=64 "
            "memory.gradient_checkpointing=false); everything else is planned around them.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Recommend the fastest Stable Diffusion training plan that fits, with a reason for each choice."""
    import json
    import shlex

    from sdplan.config import implied_settings
    from sdplan.profiles import load_profiles
    from sdplan.recommend import (
        RecommendInputs,
        dataset_counted,
        model_source,
        no_gpu_hint,
        render,
        render_compare,
        run_command,
        write_outputs,
    )
    from sdplan.recommend import compare as run_compare
    from sdplan.recommend import recommend as run

    reject_empty(dataset=dataset, machine=machine, out=out)
    dataset, machine, out = expand_home(dataset), expand_home(machine), expand_home(out)
    reject_repeated_settings(settings)
    profiles = load_profiles()
    inp = RecommendInputs(
        method=method,
        model=model,
        resolution=resolution,
        dataset=dataset,
        images=images,
        repeats=repeats,
        epochs=epochs,
        hardware=hardware,
        machine=machine,
        gpus=gpus,
        settings=tuple(implied_settings(settings or ())),
        out=out,
    )
    inp = model_source(inp, profiles)  # --model PATH_OR_ID: its family, and model.path for the written config
    if compare is not None:
        from sdplan.errors import UsageError

        # Flags that --compare would ignore (a plan for other hardware, no files where the user asked for them;
        # each option names its own GPU count)
        given = [
            f
            for f, v in (("--hardware", hardware), ("--machine", machine), ("--out", out), ("--gpus", gpus))
            if v is not None
        ]
        if given:
            raise UsageError(
                f"--compare does not combine with {' or '.join(given)}",
                fix="compare first, then run `sdplan recommend --hardware NAME --out DIR` for the one you pick; an "
                "option names its GPU count ('2x RTX 4090')",
            )
        options = [c.strip() for c in compare.split(",") if c.strip()]
        if not options:
            raise UsageError(
                "--compare needs at least one hardware option", fix="e.g. --compare 'RTX 4090,2x RTX 4090'"
            )
        rows = run_compare(inp, profiles, options)
        if json_:
            typer.echo(json.dumps([d for _, d, _ in rows], indent=2))
        else:
            render_compare(rows, console())
        return
    d, res = run(inp, profiles)
    if out is not None and res.plan is not None:
        written, copies = write_outputs(
            out, res, profiles, dataset=inp.dataset, force=force, overrides=inp.settings
        )
        err_console().print("wrote " + ", ".join(str(p) for p in written), markup=False, soft_wrap=True)
        from sdplan import runfolder

        for copy in copies:
            err_console().print(runfolder.kept_line(copy), markup=False, soft_wrap=True)
        config_file = shlex.quote(str(Path(out) / "sdplan.yaml"))
        given = dataset_counted(inp.dataset, inp.settings)
        err_console().print(
            f"run it with: {run_command(config_file, dataset_given=given)}", markup=False, soft_wrap=True
        )
    elif out is not None:
        why = "this machine has no GPU" if no_gpu_hint(d, res) else "no configuration fits this hardware"
        err_console().print(f"nothing written: {why}", markup=False)
    if json_:
        typer.echo(json.dumps(d, indent=2))
    else:
        render(d, res, console())
    if not d["feasible"]:
        raise typer.Exit(
            EXIT_NOTHING_FITS
        )  # the plan (and what would fit) is printed; scripts see the failure
