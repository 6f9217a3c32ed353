"""Wall time of `sdplan doctor --json` (target < 3 s) and `sdplan --help` (target < 0.5 s), as a user runs
them (fresh subprocesses), and whether `doctor --json` imports torch (``python -X importtime``).

Not a timed test: run it by hand, ``.venv/bin/python benchmarks/doctor_bench.py [--runs N]``.
Until every command module of ``sdplan.cli`` exists, ``sdplan`` itself cannot start; the doctor timing
then falls back to the doctor command on its own (printed as such) and ``--help`` is reported as unavailable.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGETS_S = {"doctor --json": 3.0, "--help": 0.5}
HEAVY = ("torch", "diffusers", "transformers", "accelerate")

# The doctor command alone, registered the way sdplan.cli registers it.
STANDALONE = (
    "import typer; from sdplan.commands.doctor import doctor; app = typer.Typer(add_completion=False); "
    "app.callback()(lambda: None); app.command('doctor')(doctor); app()"
)


def cli_works() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import sdplan.cli"], capture_output=True, text=True)
    return probe.returncode == 0


def command(args: list[str], standalone: bool) -> list[str]:
    if standalone:
        return [sys.executable, "-c", STANDALONE, *args]
    script = Path(sys.executable).with_name("sdplan")  # the console script users run
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "sdplan.cli", *args]


def python_command(cmd: list[str]) -> list[str]:
    """The same command as `python ...` (the console script is a Python file), for -X importtime."""
    if cmd[0] == sys.executable:
        return cmd
    return [sys.executable, "-m", "sdplan.cli", *cmd[1:]]


def wall(cmd: list[str], runs: int) -> tuple[float, float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd[-3:])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return statistics.median(times), max(times)


def imported_heavy(cmd: list[str]) -> list[str]:
    """Top-level heavy packages that show up in `python -X importtime` for this command."""
    cmd = python_command(cmd)
    done = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], capture_output=True, text=True)
    seen = set()
    for line in done.stderr.splitlines():
        if not line.startswith("import time:"):
            continue
        name = line.rsplit("|", 1)[-1].strip()
        if name.split(".")[0] in HEAVY:
            seen.add(name.split(".")[0])
    return sorted(seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (median and max are shown)")
    args = parser.parse_args()

    full = cli_works()
    ok = True
    rows = []
    doctor_cmd = command(["doctor", "--json"], standalone=not full)
    median, worst = wall(doctor_cmd, args.runs)
    label = "sdplan doctor --json" if full else "doctor --json (command alone: sdplan.cli not importable yet)"
    rows.append((label, median, worst, TARGETS_S["doctor --json"]))
    if full:
        median, worst = wall(command(["--help"], standalone=False), args.runs)
        rows.append(("sdplan --help", median, worst, TARGETS_S["--help"]))
    else:
        print("sdplan --help: not measurable yet (sdplan.cli imports command modules that do not exist)")

    for label, median, worst, target in rows:
        verdict = "ok" if worst < target else "SLOW"
        ok &= worst < target
        print(f"{label:<62} median {median:6.3f} s  max {worst:6.3f} s  target < {target} s  {verdict}")

    heavy = imported_heavy(doctor_cmd)
    print(f"heavy imports during doctor --json: {', '.join(heavy) if heavy else 'none (torch not imported)'}")
    ok &= not heavy
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
