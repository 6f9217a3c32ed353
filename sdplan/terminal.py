"""A closed terminal (SIGHUP) stops a run like SIGTERM; what sdplan and the trainer share to survive it.

When the terminal closes, the kernel hangs up its tty: every later write to it fails (EIO). A process that
goes on to write a checkpoint must not die on its next progress line, so on SIGHUP the file descriptors that
were the terminal are pointed at /dev/null. Under ``nohup`` SIGHUP is ignored, and stays ignored: the user
asked the run to outlive the terminal. Torch-free (the launcher and the trainer both use it).
"""

from __future__ import annotations

import contextlib
import os
import signal

HANGUP: int | None = getattr(signal, "SIGHUP", None)  # None on Windows


def hangup_wanted() -> bool:
    """Whether to handle SIGHUP here: the platform has it and it is not ignored (``nohup``)."""
    return HANGUP is not None and signal.getsignal(HANGUP) is not signal.SIG_IGN


def terminal_fds() -> tuple[int, ...]:
    """stdout / stderr where they are a terminal (recorded before a hangup: a hung-up tty is no longer one)."""
    out = []
    for fd in (1, 2):
        with contextlib.suppress(OSError, ValueError):
            if os.isatty(fd):
                out.append(fd)
    return tuple(out)


def detach_from_terminal(fds: tuple[int, ...]) -> None:
    """Point ``fds`` (the terminal's) at /dev/null. Signal-handler safe: system calls only, no buffered IO."""
    if not fds:
        return
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in fds:
                os.dup2(null, fd)
        finally:
            os.close(null)
