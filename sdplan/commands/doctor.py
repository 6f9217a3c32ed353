"""`sdplan doctor`: read this machine (or a saved snapshot) and report it, with findings and a verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sdplan.commands._common import cli_errors, console, err_console, expand_home, reject_empty


@cli_errors
def doctor(
    json_: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the snapshot as JSON (the schema of --save files) and nothing else."
        ),
    ] = False,
    save: Annotated[
        str | None,
        typer.Option(
            "--save", metavar="FILE", help="Also write the snapshot to FILE, to plan on another machine."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --save overwrite an existing FILE.")] = False,
    machine: Annotated[
        str | None,
        typer.Option(
            "--machine",
            metavar="FILE",
            help="Report a snapshot saved with --save instead of reading this machine.",
        ),
    ] = None,
) -> None:
    """Check this machine for Stable Diffusion training: GPUs, links, software stack, findings, verdict.

    Exits 1 when a finding about this machine is an error, or when no verdict is ok (every method and model
    only with offload, swapping, at risk or not at all), so `sdplan doctor && sdplan train ...` stops on a
    machine that cannot train; --json, --save and --machine exit 0: they make or read a snapshot, whose
    findings carry their severity.
    """
    from sdplan.doctor import nothing_ok, planner_verdicts, render
    from sdplan.errors import OutputExistsError, UsageError
    from sdplan.machine import Snapshot
    from sdplan.probe.snapshot import probe, refresh

    verdicts = planner_verdicts
    reject_empty(save=save, machine=machine)
    save, machine = expand_home(save), expand_home(machine)

    snapshot = refresh(Snapshot.load(machine)) if machine is not None else probe(".")

    if save is not None:
        save = Path(save)
        if save.is_dir():  # --force cannot help: the snapshot is one file
            raise UsageError(
                f"--save {save} is a folder", fix=f"give a file, e.g. --save {save / 'machine.json'}"
            )
        from sdplan import runfolder

        # a run's own file (its settings, bookkeeping, checkpoints), --force or not
        run = runfolder.run_file(save)
        if run is not None and (save.exists() or save.is_symlink()):
            raise OutputExistsError(
                f"{save} is a file of the sdplan run in {run}", fix="--save the snapshot to another file"
            )
        if save.exists() and not force:
            raise OutputExistsError(f"{save} already exists", fix="pass --force to overwrite it")
        try:
            snapshot.save(save)
        except OSError as e:
            raise UsageError(
                f"cannot write {save}: {e.strerror or e}", fix="--save a file in a folder you can write"
            ) from None
        err_console().print(f"saved machine snapshot to {save}", markup=False, soft_wrap=True)

    if json_:
        typer.echo(snapshot.to_json())
        return
    shown = render(snapshot, console(), verdicts)
    if save is not None or machine is not None:
        return
    errors = [f.code for f in snapshot.findings if f.severity == "error"]
    if errors:
        err_console().print(
            f"doctor found {len(errors)} error{'s' if len(errors) > 1 else ''} ({', '.join(errors)}): see Findings",
            markup=False,
            soft_wrap=True,
        )
    # low RAM or a small GPU is no finding's error (the rules cannot plan): the verdicts say what loads here
    untrainable = nothing_ok(snapshot, shown)
    if untrainable:
        err_console().print(untrainable, markup=False, soft_wrap=True)
    if errors or untrainable:
        raise typer.Exit(1)
