"""One self-contained training recipe per method."""
