"""``python -m sdplan ...``: the same as the ``sdplan`` console script (a venv without its bin on PATH)."""

from sdplan.cli import main

main()
