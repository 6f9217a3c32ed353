"""A closed terminal (SIGHUP) stops a run like SIGTERM; what sdplan and the trainer share to survive it.

When the terminal closes, the kernel hangs up its tty: every later write to it fails (EIO). A process that
goes on to write a checkpoint must not die on its next progress line, so on SIGHUP the file descriptors that
were the terminal are pointed at /dev/null. Under ``nohup`` SIGHUP is ignored, and stays ignored: the user
asked the run to outlive the terminal.

The hangup and the SIGHUP are not one event: a process that writes to the closed terminal before its SIGHUP
arrives (the trainer runs in its own session and only gets the signal sdplan forwards) gets EIO. So both
processes write through ``HangupSafeStream``: an EIO is the hangup, seen first. Torch-free (the launcher and the trainer both use it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from typing import Any, TextIO

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


class HangupSafeStream:
    """``sys.stdout`` / ``sys.stderr`` over a terminal, surviving the terminal's hangup.

    A write or flush that fails with EIO (the terminal hung up) points the terminal's descriptors at /dev/null,
    runs the SIGHUP handler this process has installed (the trainer's stop request, sdplan's forwarding; none:
    detach only) and retries, so the text goes nowhere instead of raising. Everything else is the stream's.
    """

    def __init__(self, stream: TextIO, fds: tuple[int, ...]):
        self._stream = stream
        self._fds = fds

    def _hung_up(self) -> None:
        detach_from_terminal(self._fds)
        if HANGUP is None:  # pragma: no cover - Windows has no hangup
            return
        handler = signal.getsignal(HANGUP)
        if callable(handler):
            handler(HANGUP, None)
        elif handler is signal.SIG_DFL:
            # No one here acts on a hangup now (before training, after it): the SIGHUP that follows this EIO
            # is the same event and must not kill the process halfway through what it is finishing.
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(HANGUP, signal.SIG_IGN)

    def _retrying(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            self._hung_up()
            return call(*args)

    def write(self, text: str) -> int:
        return self._retrying(self._stream.write, text)

    def flush(self) -> None:
        self._retrying(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_terminal_output() -> None:
    """Put ``HangupSafeStream`` over ``sys.stdout`` / ``sys.stderr`` where they are this terminal (once)."""
    fds = terminal_fds()
    if not fds:
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, HangupSafeStream):
            continue
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if stream.fileno() in fds:
                setattr(sys, name, HangupSafeStream(stream, fds))


def print_undecodable_names() -> None:
    """Let ``sys.stdout`` / ``sys.stderr`` print a path Python could not decode: a Latin-1 file name reads as a
    lone surrogate ("caf\\udce9"), which a UTF-8 stream refuses (UnicodeEncodeError, a traceback in place of
    the line). It prints as that escape's text instead."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            utf8 = str(getattr(stream, "encoding", "")).lower().replace("-", "") == "utf8"
            # surrogateescape over UTF-8 (Python's C locale) prints the real bytes; over ASCII it fails on any
            # other character, which backslashreplace writes as its escape
            if not (utf8 and getattr(stream, "errors", None) == "surrogateescape"):
                stream.reconfigure(errors="backslashreplace")
