"""The `sdplan` console script: thin typed Typer commands, registered here.

Each command lives in ``sdplan/commands/<name>.py`` and imports its heavy modules (torch, diffusers) inside
the function, so `sdplan --help`, `doctor` and `recommend` start fast. Library errors (``SdplanError``) are
turned into one line and an exit code by ``sdplan.commands._common.cli_errors``.
"""

from __future__ import annotations

import typer

from sdplan import __version__
from sdplan.commands import bench, doctor, profiles, recommend, train

app = typer.Typer(
    name="sdplan",
    help="Plan and run Stable Diffusion fine-tuning from measurements: what fits on this machine, "
    "with which settings, how fast.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"sdplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    from sdplan.terminal import print_undecodable_names

    print_undecodable_names()


app.command("doctor")(doctor.doctor)
app.command("recommend")(recommend.recommend)
app.command(
    "train",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    options_metavar="[OPTIONS] [KEY=VALUE]...",  # the extra arguments: key=value settings (ctx.args)
)(train.train)
app.command("bench")(bench.bench)
app.add_typer(profiles.profiles_app, name="profiles")


def _is(e: BaseException, click_class: str) -> bool:
    """Whether ``e`` is click's ``click_class`` (by name: typer may vendor its own copy of click)."""
    return any(c.__name__ == click_class for c in type(e).__mro__)


def main() -> None:
    import sys

    from sdplan.quiet import quiet_library_notes
    from sdplan.terminal import guard_terminal_output

    guard_terminal_output()  # a closed terminal must not turn the next line printed into a traceback
    quiet_library_notes()  # bitsandbytes' and DeepSpeed's import-time notes (the demo and bench import them)
    try:
        code = app(prog_name="sdplan", standalone_mode=False)
    except Exception as e:
        if _is(e, "ClickException"):
            # A mistyped option or value (click's own checks: a missing option, a number out of range, an
            # unknown flag) is one line like sdplan's own errors, not a usage block and a boxed panel.
            if not _is(e, "NoArgsIsHelpError"):  # bare `sdplan`: the help is already printed
                ctx = getattr(e, "ctx", None)
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                print(f"error: {e.format_message()}{hint}", file=sys.stderr)
            sys.exit(e.exit_code)
        if _is(e, "Abort"):  # Ctrl-C or end of input at a prompt
            print("aborted", file=sys.stderr)
            sys.exit(1)
        raise
    from sdplan.procexit import exit_process

    exit_process(code if type(code) is int else 0)  # after a demo build: no 1-2 s interpreter teardown


if __name__ == "__main__":
    main()
