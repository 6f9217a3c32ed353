"""How long the README's demo (`sdplan train --demo`) takes here: set-up, plan, training and outputs.

Target: under 60 s on an idle 2-core CPU. A benchmark, not a test: a shared machine must not fail the suite.
Usage: python benchmarks/demo_time.py [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 60.0


def time_demo(out: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "sdplan.cli", "train", "--demo", "--out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "SDPLAN_PLAIN_PROGRESS": "1"},
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        walls = [time_demo(Path(tmp) / f"demo{i}") for i in range(args.repeat)]
    best = min(walls)
    print(f"demo wall time: best {best:.1f} s of {len(walls)} (all: {', '.join(f'{w:.1f}' for w in walls)})")
    print(f"target < {TARGET_S:.0f} s on an idle 2-core CPU: {'met' if best < TARGET_S else 'NOT met'}")
    print(f"1-minute load average at the start: {load:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
