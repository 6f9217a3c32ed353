"""Ending a process that imported torch without paying for the interpreter's teardown.

Once torch (and diffusers, transformers, bitsandbytes' torch.compile set-up, DeepSpeed) is imported, Python's
own shutdown (clearing tens of thousands of modules' globals and freeing their objects one by one) takes 1-2.5
seconds after the last line is printed: every `sdplan train` (the launcher when it built the demo model, and
the trainer) paid it. :func:`exit_process` does what that shutdown does that anyone can see (the ``atexit``
handlers: logging's flush, multiprocessing's joins, torch's and accelerate's clean-ups; then stdout and stderr
flushed) and ends the process with ``os._exit``. Only at the very end of a process's entry point, and only
when torch was imported (a light command exits as before). Torch-free.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """``sys.exit(code)``, without the interpreter teardown when torch is loaded (see the module docstring).
    Falls back to ``sys.exit`` when torch was not imported, or when another non-daemon thread still runs (the
    normal shutdown waits for it)."""
    code = 0 if code is None else code
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if "torch" not in sys.modules or others or not isinstance(code, int):
        sys.exit(code)
    atexit._run_exitfuncs()  # what Py_FinalizeEx runs first; an exception in one is printed, the rest still run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, detached, a hung-up terminal
            stream.flush()
    os._exit(code & 0xFF)
