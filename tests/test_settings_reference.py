"""The README's settings reference is generated from the settings type: every sdplan.yaml key is in it, with the
code's default (the README documented 18 of the 88 keys)."""

from __future__ import annotations

from pathlib import Path

from sdplan import config, reference
from sdplan.settings import get_key

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_key_of_the_settings_type_has_a_line():
    keys = [row[0] for row in reference.rows()]
    assert keys == list(config._leaf_keys())
    assert set(reference.MEANINGS) == set(keys), set(reference.MEANINGS) ^ set(keys)


def test_the_readme_holds_the_generated_reference():
    """A key added, a default or a rule changed without `python -m sdplan.reference --write README.md`."""
    block = reference.readme_block(README.read_text())
    assert block is not None, "README.md has no settings reference block"
    assert block == reference.markdown(), "run: python -m sdplan.reference --write README.md"


def test_the_references_defaults_are_the_codes():
    defaults = config.default_config()
    for key, shown, _, _ in reference.rows():
        if "(section null by default)" in shown:
            assert get_key(defaults, key.rsplit(".", 1)[0]) is None
            continue
        assert shown == reference._text(get_key(defaults, key)), key
    shown = dict((row[0], row[1]) for row in reference.rows())
    assert shown["training.epochs"] == str(config.DEFAULT_EPOCHS) and shown["memory.optimizer"] == "adamw"
