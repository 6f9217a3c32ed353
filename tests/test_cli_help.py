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
