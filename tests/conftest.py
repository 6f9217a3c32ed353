"""Shared test fixtures: tiny models saved once per session, generated images, fixture machines."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MACHINES = FIXTURES / "machines"

# Nothing in the tests may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# `make test` runs the suite on 2 pytest-xdist workers. Each worker, and every trainer a test starts, gets one CPU
# thread unless the caller chose: two workers whose children each take every core oversubscribe a 2-core machine
# (a 28 s DeepSpeed run took 238 s beside the other worker).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every process
# the tests start: the Ctrl-C tests would see nothing stop. A handler here makes children start with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _isolated_profile_store(tmp_path_factory, monkeypatch):
    """Local measurements go to a per-test folder, never the developer's real profile store."""
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path_factory.mktemp("profile-store")))


@pytest.fixture(scope="session")
def tiny_sd15(tmp_path_factory) -> Path:
    """A tiny SD 1.x-shaped diffusers folder (random weights, built in code)."""
    from sdplan.trainer.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "sd15", "sd15")


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory) -> Path:
    """A tiny SDXL-shaped diffusers folder (two text encoders)."""
    from sdplan.trainer.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "sdxl", "sdxl")


def make_images(
    folder: Path, n: int = 4, size: int = 64, caption: str | None = "a photo of sks red square"
) -> Path:
    """Write ``n`` distinct coloured PNGs (and captions) into ``folder``."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img = Image.new("RGB", (size, size), (40 * i % 256, 90, 200 - 30 * i % 200))
        ImageDraw.Draw(img).rectangle(
            [size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=(220, 30 + 40 * i, 40)
        )
        img.save(folder / f"img{i:03d}.png")
        if caption is not None:
            (folder / f"img{i:03d}.txt").write_text(caption)
    return folder


@pytest.fixture
def image_folder(tmp_path) -> Path:
    return make_images(tmp_path / "dataset")
