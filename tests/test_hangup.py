"""Issue 13 item 4: closing the terminal (SIGHUP) stops a run like SIGTERM: sdplan forwards it to the
trainer's process group, the trainer stops after the step and checkpoints, and neither dies writing to the
hung-up terminal. Under nohup (SIGHUP ignored) the run goes on. Real processes on the CPU."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import textwrap

import pytest
from limits import scaled

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")

# A stand-in trainer: the real StopSignals, a "step" loop until a stop is asked, then a burst of progress
# lines (the checkpoint's messages) and the interrupt exit code. It records what it got in ``marker``.
TRAINER = """
import os, sys, time, pathlib
from sdplan.trainer.stops import StopSignals
marker = pathlib.Path({marker!r})
with StopSignals() as stop:
    print("ready", flush=True)
    while stop.requested is None:
        time.sleep(0.02)
    lines = 0
    for i in range(200):
        print("progress line", i, flush=True)
        lines += 1
marker.write_text(f"{{stop.requested}} {{lines}}")
sys.exit(130)
"""


def _launcher(child: str) -> str:
    return textwrap.dedent(
        f"""
        import sys
        from sdplan.launch import Launch, run_launch
        code = run_launch(Launch(cmd=[sys.executable, "-c", {child!r}], env={{}}))
        print("sdplan: the trainer exited", code, flush=True)  # onto a hung-up terminal: must not fail
        sys.exit(code)
        """
    )


def _read_line(fd: int, needle: bytes) -> bytes:
    """Read the terminal until a whole line holding ``needle`` has come: print() may write a line's text and
    its newline in two writes, and a terminal closed between them fails the unguarded newline with EIO."""
    seen = b""
    while needle not in seen or b"\n" not in seen.split(needle, 1)[1]:
        chunk = os.read(fd, 1024)
        assert chunk, seen
        seen += chunk
    return seen


def test_closing_the_terminal_stops_the_trainer_like_sigterm(tmp_path):
    """sdplan and the trainer write to a pseudo-terminal; it is closed (hung up) and sdplan gets SIGHUP, as
    when the user closes the terminal window. The trainer gets SIGHUP, stops, writes its messages (to
    /dev/null now) and exits 130; sdplan reports 130 too. Before, SIGHUP killed sdplan outright."""
    marker = tmp_path / "trainer-stopped"
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", _launcher(textwrap.dedent(TRAINER.format(marker=str(marker))))],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
    )
    os.close(secondary)
    try:
        _read_line(primary, b"ready")
    finally:
        os.close(primary)  # the terminal is gone: writes to it fail with EIO from now on
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=scaled(60)) == 130
    assert marker.read_text() == "SIGHUP 200"  # stopped by the hangup, and every line after it written


# A trainer that keeps printing progress each "step" (as the real one does) with its output guarded.
CHATTY_TRAINER = """
import sys, time, pathlib
from sdplan.terminal import guard_terminal_output
from sdplan.trainer.stops import StopSignals
guard_terminal_output()
marker = pathlib.Path({marker!r})
with StopSignals() as stop:
    print("ready", flush=True)
    while stop.requested is None:
        print("step", flush=True)
        time.sleep(0.02)
marker.write_text(f"{{stop.requested}}")
print("checkpoint written", flush=True)
sys.exit(130)
"""


def test_a_write_to_the_closed_terminal_is_the_hangup_even_before_any_sighup(tmp_path):
    """The terminal closes and no SIGHUP comes (or comes late): the trainer's next progress line gets EIO.
    That EIO is the hangup: the trainer stops like on SIGHUP (checkpoint, exit 130) instead of dying on a
    traceback with nothing saved, and sdplan's own lines after it go to /dev/null. (The end-to-end demo on a
    pseudo-terminal lost its checkpoint this way in 1 of 2 runs.)"""
    marker = tmp_path / "trainer-stopped"
    launcher = "from sdplan.terminal import guard_terminal_output\nguard_terminal_output()\n" + _launcher(
        textwrap.dedent(CHATTY_TRAINER.format(marker=str(marker)))
    )
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher], stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary
    )
    os.close(secondary)
    try:
        _read_line(primary, b"ready")
    finally:
        os.close(primary)  # hung up; no signal is sent
    assert proc.wait(timeout=scaled(60)) == 130
    assert marker.read_text() == "SIGHUP"


def test_hangup_safe_stream_passes_other_errors_through():
    import errno
    import io

    from sdplan.terminal import HangupSafeStream

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "no space")

    stream = HangupSafeStream(Full(), fds=())
    with pytest.raises(OSError, match="no space"):
        stream.write("x")
    assert stream.getvalue() == ""  # the rest is the wrapped stream's


def test_run_launch_forwards_sighup_to_the_trainer_group(tmp_path):
    """Without a terminal (a pipe): SIGHUP to sdplan reaches the trainer as SIGHUP, which stops it."""
    marker = tmp_path / "trainer-stopped"
    proc = subprocess.Popen(
        [sys.executable, "-c", _launcher(textwrap.dedent(TRAINER.format(marker=str(marker))))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGHUP)
    rest, _ = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 130, rest
    assert marker.read_text() == "SIGHUP 200"
    assert "sdplan: the trainer exited 130" in rest


def test_under_nohup_a_hangup_stops_nothing(tmp_path):
    """SIGHUP ignored (nohup): sdplan does not take it over, the trainer inherits it ignored; the run goes on
    until it is stopped on purpose (here SIGTERM, which arrives as the interrupt the trainer expects)."""
    marker = tmp_path / "trainer-stopped"
    proc = subprocess.Popen(
        [sys.executable, "-c", _launcher(textwrap.dedent(TRAINER.format(marker=str(marker))))],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGTERM)  # handled after the hangup (pending signals run in number order)
    rest, _ = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 130, rest
    assert marker.read_text() == "SIGINT 200"  # SIGTERM to sdplan arrives as the first, gentle, signal


def test_stop_signals_treat_sighup_as_a_stop_and_restore_the_handler():
    from sdplan.trainer.stops import StopSignals

    before = signal.getsignal(signal.SIGHUP)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested == "SIGHUP"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert stop.requested == "SIGHUP"
    assert signal.getsignal(signal.SIGHUP) is before


def test_stop_signals_leave_an_ignored_sighup_ignored():
    from sdplan.trainer.stops import StopSignals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            assert stop.requested is None
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_detach_from_terminal_points_the_fds_at_dev_null(tmp_path):
    """After a hangup the terminal's descriptors write into /dev/null (the real terminal is untouched)."""
    code = textwrap.dedent(
        """
        import os
        from sdplan.terminal import detach_from_terminal, terminal_fds
        fds = terminal_fds()
        assert fds == (1, 2), fds
        detach_from_terminal(fds)
        os.write(1, b"after\\n")
        assert os.path.samestat(os.fstat(1), os.stat(os.devnull))
        assert os.path.samestat(os.fstat(2), os.stat(os.devnull))
        open(os.environ["MARKER"], "w").write("ok")
        """
    )
    marker = tmp_path / "ok"
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=secondary,
        stderr=secondary,
        env={**os.environ, "MARKER": str(marker)},
    )
    os.close(secondary)
    assert proc.wait(timeout=scaled(60)) == 0
    os.close(primary)
    assert marker.read_text() == "ok"


# A stand-in trainer that takes a long step: the real StopSignals; a second Ctrl-C must abort it mid-step.
SLOW_STEP = """
import sys, time
from sdplan.trainer.stops import StopSignals
with StopSignals() as stop:
    print("ready", flush=True)
    try:
        while stop.requested is None:
            time.sleep(0.02)
        print("stopping after this step", flush=True)
        time.sleep(60)  # the step that finishes before the checkpoint
    except KeyboardInterrupt:
        print("aborted", flush=True)
        sys.exit(1)
sys.exit(130)
"""


def test_a_second_ctrl_c_aborts_the_trainer_as_it_says(tmp_path):
    """The trainer says "Ctrl-C again to abort", but sdplan forwarded the second Ctrl-C as SIGTERM, which it
    takes as the same stop request: the step ran to its end, and only a third Ctrl-C (SIGKILL) stopped it."""
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", _launcher(textwrap.dedent(SLOW_STEP))], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping after this step"
    time.sleep(1.2)  # the trainer ignores a second signal within 1 s of the first (one key press, twice)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=scaled(30))
    assert "aborted" in rest, rest
