"""Every command's --help: exit 0, and its description reflowed into paragraphs (not cut at the docstring's line
breaks, which made `sdplan bench --help` read as ragged half-lines)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from sdplan.cli import app


@pytest.mark.parametrize("command", ["doctor", "recommend", "train", "bench", "profiles"])
def test_help_reflows_each_paragraph(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    doc = app.registered_commands
    callback = next(
        (c.callback for c in doc if (c.name or c.callback.__name__) == command),
        None,
    )
    if callback is None:  # a sub-app (profiles)
        assert "Usage: sdplan profiles" in result.output
        return
    for paragraph in callback.__doc__.split("\n\n")[:2]:
        words = " ".join(paragraph.split()).replace("`", "")
        line = next((ln for ln in result.output.splitlines() if words[:30] in ln), "")
        assert words.split()[-1] in line, (words, result.output)  # the whole paragraph on one wide line


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["recommend", "--model", "sdxl"], ["Missing option '--method'", "sdplan recommend --help"]),
        (["train", "--epochs", "0"], ["'--epochs'", "sdplan train --help"]),
        (["train", "--resolution", "abc"], ["'--resolution'"]),
        (["train", "--bogus"], ["No such option: --bogus"]),
        (["profiles", "bogus"], ["No such command 'bogus'"]),
    ],
)
def test_click_usage_errors_are_one_line_too(args, needles):
    """Errors that click finds before sdplan's code runs (a missing option, a value out of range, an unknown
    flag or command) come out of the console script as one line and exit 2, like sdplan's own errors."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from conftest import one_line_error

    proc = subprocess.run([sys.executable, "-m", "sdplan.cli", *args], capture_output=True, text=True)
    one_line_error(
        SimpleNamespace(exit_code=proc.returncode, stdout=proc.stdout, stderr=proc.stderr), 2, *needles
    )


def test_bare_sdplan_prints_the_help():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "sdplan.cli"], capture_output=True, text=True)
    assert "Usage: sdplan" in proc.stdout + proc.stderr and "error:" not in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["recommend", "bench"])
def test_help_names_every_family_and_method(command):
    """The --model / --method help comes from the registry: `recommend --help` said "sd15, sd21 or sdxl" while
    SD3.5 and FLUX.1 were planned."""
    from sdplan import registry

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    families = registry.PLANNED_FAMILIES if command == "recommend" else registry.FAMILIES
    for name in (*families, *registry.METHODS):
        assert name in result.output, (name, result.output)


@pytest.mark.parametrize("command", ["recommend", "train", "bench"])
def test_usage_shows_the_key_value_settings(command):
    """`sdplan train --help` read `Usage: sdplan train [OPTIONS]`, though key=value settings are its main way in
    (recommend and bench showed them)."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    usage = next(line for line in result.output.splitlines() if "Usage:" in line)
    assert "KEY=VALUE" in usage, usage
