"""Time limits for tests that start subprocesses, scaled to how busy this machine is.

A limit only guards against a hang (a deadlocked 2-process run, a child that ignores a signal); it must never
fail a test because the machine is shared. ``scaled(nominal_s)`` is ``nominal_s`` times
``SDPLAN_TEST_TIME_SCALE`` (default 3) times the load per CPU core (at least 1), measured when it is called:
at load 10 on 2 cores a 300 s limit becomes 4,500 s. ``SDPLAN_TEST_TIME_SCALE=0`` removes the limits (None).
"""

from __future__ import annotations

import os


def load_factor() -> float:
    """The 1-minute load average per CPU core, at least 1 (1 on systems without a load average)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(nominal_s: float) -> float | None:
    """A limit for something that takes well under ``nominal_s`` on an idle machine; None: no limit."""
    scale = float(os.environ.get("SDPLAN_TEST_TIME_SCALE", "3"))
    if scale <= 0:
        return None
    return nominal_s * scale * load_factor()


def wait_until(condition, nominal_s: float, *, poll_s: float = 0.1) -> bool:
    """Poll ``condition()`` until it is true (True) or ``scaled(nominal_s)`` has passed (False)."""
    import time

    limit = scaled(nominal_s)
    start = time.monotonic()
    while not condition():
        if limit is not None and time.monotonic() - start > limit:
            return False
        time.sleep(poll_s)
    return True
