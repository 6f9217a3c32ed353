"""``python -m sdplan.distrun MODULE ARGS...``: torchrun (``torch.distributed.run``) or ``accelerate launch``
(``accelerate.commands.launch``) run in this process, ending as sdplan's commands end.

Both turn a Ctrl-C, SIGTERM or a closed terminal into a 30-line traceback (``SignalException: Process N got
signal: 2``) and exit 1, and a worker that failed into another traceback (``ChildFailedError``) under the
worker's own one-line error. Here a stop signal ends with ``128 + signal`` (130 for Ctrl-C: what sdplan reports
as interrupted) and a failed worker with its exit code, after one line only where the worker could not say
anything itself (killed by a signal). torch.distributed.elastic's own log lines ("Received 2 death signal,
shutting down workers", the OMP_NUM_THREADS banner) are left out unless ``LOGLEVEL`` asks for them.
"""

from __future__ import annotations

import os
import signal
import sys

MODULES = ("torch.distributed.run", "accelerate.commands.launch")


def _killed_line(failures: dict) -> str | None:
    """One line for a worker killed by a signal (it printed nothing); None when one exited with an error of its
    own (it said why, and the launcher then stopped the others with SIGTERM). A worker killed by SIGKILL (the
    kernel's out-of-memory killer, a ``kill -9``) is the cause even where another then failed on its own (the
    other ranks' collectives fail on the lost peer: "Connection closed by peer")."""
    killed = [(rank, f) for rank, f in sorted(failures.items()) if f.exitcode == -signal.SIGKILL]
    if not killed and any(f.exitcode > 0 for f in failures.values()):
        return None
    for rank, failure in killed or sorted(failures.items()):
        if failure.exitcode < 0:
            name = (
                signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else ""
            )
            why = (
                " (the kernel's out-of-memory killer does this when host RAM runs out)"
                if name == "SIGKILL"
                else ""
            )
            return f"error: training process {rank} was killed by {name or -failure.exitcode}{why}"
    return None


def _exit_code(failures: dict) -> int:
    codes = [f.exitcode for _, f in sorted(failures.items())]
    if -signal.SIGKILL in codes:  # the cause (see _killed_line)
        return 128 + signal.SIGKILL
    positive = [c for c in codes if c > 0]
    if positive:
        return positive[0]
    negative = [c for c in codes if c < 0]
    return 128 - negative[0] if negative else 1


def _signal_in_chain(error: BaseException, signal_exception: type) -> int | None:
    """The signal behind ``error`` where a stop signal raised while other code ran: torch's metrics wrapper
    (``elastic/metrics/api.py``) hit by the signal before its ``start = time.time()`` finished raises
    ``UnboundLocalError`` from its ``finally``, with the ``SignalException`` only as the context (seen in CI)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, signal_exception):
            return int(error.sigval)
        error = error.__cause__ or error.__context__
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in MODULES:
        print(f"usage: python -m sdplan.distrun {{{','.join(MODULES)}}} ARGS...", file=sys.stderr)
        return 2
    module, args = argv[0], argv[1:]
    quiet = "LOGLEVEL" not in os.environ
    if quiet:  # read when torch.distributed.elastic makes its loggers
        os.environ["LOGLEVEL"] = "CRITICAL"
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if module == "torch.distributed.run":
        from torch.distributed.run import main as run
    else:
        from accelerate.commands.launch import main as run
    import subprocess

    import torch.distributed.run  # noqa: F401  (accelerate imports it late: its loggers are made now)

    if quiet:  # the loggers made with logging.getLogger (no LOGLEVEL) inherit this
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        del os.environ["LOGLEVEL"]  # not passed on to the workers
    sys.argv = [module, *args]
    try:
        run()
    except SignalException as e:
        return 128 + int(e.sigval)
    except KeyboardInterrupt:  # accelerate's one-process launcher has no signal handler of its own
        return 128 + signal.SIGINT
    except subprocess.CalledProcessError as e:  # ... and reports its child's failure so
        return e.returncode if e.returncode > 0 else 128 - e.returncode
    except ChildFailedError as e:
        line = _killed_line(e.failures)
        if line and not os.environ.get("SDPLAN_LAUNCHED"):  # else `sdplan train` says it, in its one line
            print(line, file=sys.stderr, flush=True)
        return _exit_code(e.failures)
    except Exception as e:
        sigval = _signal_in_chain(e, SignalException)
        if sigval is None:
            raise
        return 128 + sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
