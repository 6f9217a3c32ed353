"""Typer command functions; each module imports only light modules at the top."""
