"""What every command shares: the consoles and the one place errors become exit codes."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from sdplan.errors import SdplanError, UsageError

F = TypeVar("F", bound=Callable[..., Any])


def console() -> Console:
    """The stdout console, built per use: rich reads COLUMNS, NO_COLOR and the terminal when a Console is made,
    so a module-level one would keep whatever the first import saw (a test's width leaked into the next)."""
    return Console(highlight=False)


def err_console() -> Console:
    """The stderr console, built per use (see console)."""
    return Console(stderr=True, highlight=False)


def cli_errors(fn: F) -> F:
    """Turn a library error into one clear line on stderr and its exit code; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SdplanError as e:
            if not e.reported:
                err_console().print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console().print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def reject_empty(**flags: str | None) -> None:
    """UsageError for a path flag given as an empty string (an unset shell variable, ``--out "$RUN"``): left
    alone it would mean the current folder or the default one."""
    for name, value in flags.items():
        if value is not None and not value.strip():
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} is empty", fix=f"give {flag} a value, or leave it out")


def reject_repeated_settings(settings: list[str] | None) -> None:
    """UsageError for a ``key=value`` key given twice with different values (``training.batch_size=4 ...
    training.batch_size=8``): the last would win without a word. Malformed items are left to the config's
    own check."""
    seen: dict[str, str] = {}
    for item in settings or ():
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            continue
        if key in seen and seen[key] != value:
            raise UsageError(f"{key} given twice ({key}={seen[key]}, then {key}={value})", fix="give it once")
        seen[key] = value


def expand_home(value: str | None) -> str | None:
    """``~/runs`` as the shell would have made it: ``--out=~/runs`` and quoted paths reach sdplan with the
    ``~`` (left alone, a folder named ``~`` appeared in the current one; ``rm -rf ~`` then deletes home)."""
    return os.path.expanduser(value) if value else value
