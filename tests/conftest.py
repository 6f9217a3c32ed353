"""Shared test fixtures: tiny models saved once per session, generated images, fixture machines."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import hub_cache
import pytest

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

    from sdplan.config import TrainConfig

FIXTURES = Path(__file__).parent / "fixtures"
MACHINES = FIXTURES / "machines"


def sdxl_sharded():
    """SDXL's full fine-tune at 1024 px under ZeRO-2 without offload, as the H100 measured it (2026-11-27): the
    settings the DeepSpeed memory tests of test_planner_invariants and test_planner_model vary."""
    from sdplan.settings import SHARDED, Settings

    return Settings(
        method="finetune",
        model="sdxl",
        resolution=1024,
        precision="bf16",
        gradient_checkpointing=True,
        cache_latents=True,
        deepspeed=dict(SHARDED),
    )


# Nothing in the tests may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# ... and none reads the developer's cache: a hub cache of its own, holding the configs of the hub ids that
# profiles/models lists (what `sdplan train` keeps of a hub model it checked; tests/hub_cache.py)
_HUB_CACHE = Path(tempfile.mkdtemp(prefix="sdplan-tests-hub-"))
atexit.register(shutil.rmtree, _HUB_CACHE, ignore_errors=True)
os.environ["HF_HUB_CACHE"] = str(_HUB_CACHE)
# ... nor writes the developer's sdplan cache (sdplan.profiles.cache_dir): the seeding below parses the profiles
# already; the session_cache fixture moves the cache to the session's temp folder once the session starts
_COLLECTION_CACHE = Path(tempfile.mkdtemp(prefix="sdplan-tests-cache-"))
atexit.register(shutil.rmtree, _COLLECTION_CACHE, ignore_errors=True)
os.environ["SDPLAN_CACHE_DIR"] = str(_COLLECTION_CACHE)
hub_cache.seed(_HUB_CACHE)
# huggingface_hub reads these once, at its import: now, so that no test's own setting of them sticks for the
# tests after it (a test changes its cache with monkeypatch.setattr(constants, "HF_HUB_CACHE", ...))
import huggingface_hub.constants  # noqa: E402,F401

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
# Likewise a suite started under nohup inherits SIGHUP ignored: sdplan rightly leaves a hangup alone then, and the
# hangup tests (which set nohup themselves where they mean it) would see nothing stop. They get the default back.
if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


# The modules whose tests each run for 10-50 s (several processes, DeepSpeed), collected first. pytest-xdist's
# worksteal hands each worker a contiguous half of the collection and lets an idle worker take the other's pending
# tests: with the long ones first, what is left at the end is short, and neither worker waits long for the other.
# (In file order they came near the end: the last DeepSpeed run kept one worker busy after the other was done.)
LONG_FIRST = ("test_resume_deepspeed.py", "test_resume_multi.py", "test_trainer.py", "test_demo.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(
        key=lambda item: first.get(item.path.name, len(first))
    )  # stable: whole modules, their own order


@pytest.fixture(autouse=True)
def _isolated_profile_store(tmp_path_factory, monkeypatch):
    """Local measurements go to a per-test folder, never the developer's real profile store."""
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path_factory.mktemp("profile-store")))


def fresh_profile_store(monkeypatch, tmp_path: Path) -> Path:
    """Point the local profile store at an empty ``tmp_path/store`` and drop the loaded-profile cache; returns
    the store's folder."""
    from sdplan import profiles

    root = tmp_path / "store"
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(root))
    profiles.clear_cache(shipped=False)
    return root


def recommend_in_a_process(*args: str) -> str:
    """`sdplan recommend ARGS` in a process of its own (from the repository's root); its stdout without the
    last line, which says whether torch was imported: it must not be (`sdplan recommend` never imports it)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom sdplan.cli import app\n"
        "try:\n    app(['recommend', *sys.argv[1:]], standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip().endswith("TORCH False"), out.stdout + out.stderr
    return out.stdout[: out.stdout.rindex("TORCH")]


def one_line_error(result, code: int, *needles: str) -> str:
    """A CLI result that failed the house way: exit ``code``, exactly one ``error:`` line on stderr holding
    each of ``needles``, no traceback; returns the line."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the sha256 of its bytes."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


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


# -- modules that train tiny models in this process -----------------------------------------------------------

# The SD3.5 and FLUX.1 families, spelled out here (test_sd3_flux checks the registry lists the same ones).
FLOW = ("sd35-medium", "sd35-large", "flux-dev", "flux-schnell")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models train ~5x faster on one thread than on two contended ones."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reset_accelerator() -> None:
    """accelerate keeps one AcceleratorState per process (a real run is one process per run); tests that
    train in-process with another precision need it cleared."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerator_state():
    """A cleared accelerate state before and after the test (:func:`reset_accelerator`): before too, since a
    test that is not marked may have left one behind (an in-process bench keeps its plan's precision; an fp32
    run after one on the same worker failed with "AcceleratorState has already been initialized", depending
    on how the workers split the suite)."""
    reset_accelerator()
    yield
    reset_accelerator()


# `pytestmark = trains_in_process` in a module that trains in-process: one torch thread for the module, a fresh
# accelerate state after each test.
trains_in_process = pytest.mark.usefixtures("one_torch_thread", "fresh_accelerator_state")


def tiny_train_config(
    model: Path,
    data: Path,
    out: Path,
    *overrides: str,
    method: str = "lora",
    family: str | None = None,
    name: str | None = None,
    learning_rate: float = 1e-3,
    max_steps: int = 2,
    lora: bool = True,
) -> TrainConfig:
    """A validated config for a tiny model on the CPU: 64 px, batch 2, fp32, no checkpoints, 2-step sampling; a
    rank-4 LoRA section unless ``lora`` is False; ``family``/``name`` set only where given; ``overrides`` as on
    the command line."""
    from sdplan import config

    base = {
        "method": method,
        "model": {"path": str(model)} if family is None else {"path": str(model), "family": family},
        "data": {"path": str(data), "resolution": 64},
        "training": {
            "batch_size": 2,
            "precision": "fp32",
            "learning_rate": learning_rate,
            "max_steps": max_steps,
            "device": "cpu",
        },
    }
    if lora:
        base["lora"] = {"rank": 4, "alpha": 8}
    base["output"] = {"dir": str(out)} if name is None else {"dir": str(out), "name": name}
    base["checkpoints"] = {"every_steps": 0}
    base["sampling"] = {"num_inference_steps": 2, "guidance_scale": 1.0}
    return config.validate(config.apply_overrides(base, list(overrides)))


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """sdplan's cache (sdplan.profiles.cache_dir: the parsed profiles, the demo's tiny models) in this session's
    temp folder, shared by the xdist workers and the processes they start: the first demo of each family builds
    its model, the rest copy it; the user's ~/.cache is not touched."""
    from sdplan.profiles import CACHE_ENV

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "sdplan-cache"
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)
    yield root
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


def built_once(tmp_path_factory, name: str, done: str, build: Callable[[Path], None]) -> Path:
    """The folder ``name`` that ``build(folder)`` fills, built once per test session: under pytest-xdist the
    workers share it through a lock in the session's temp folder (the first builds it, the others wait for it).
    ``done``: the file, relative to the folder, a finished build leaves; without it (a build that failed
    before) the folder is built again."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{root}.lock"):
        if not (root / done).is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
    return root


def train_two_processes(config: Path, cwd: Path, *args: str):
    """``torchrun --standalone --nproc_per_node 2 -m sdplan.trainer --config CONFIG [ARGS]`` on the CPU (gloo),
    one thread per process; asserts it exited 0."""
    import subprocess
    import sys

    from limits import scaled

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, "-m", "sdplan.trainer", "--config", str(config), *args],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out: Path) -> list[float]:
    """The per-step losses a run wrote (loss_history.json)."""
    import json

    return json.loads((out / "loss_history.json").read_text())["losses"]


def assert_same_run(straight: Path, resumed: Path) -> None:
    """A resumed run equals the uninterrupted one: the same losses, the same LoRA weights bit for bit."""
    import torch
    from safetensors.torch import load_file

    assert losses(resumed) == losses(straight)
    a = load_file(str(straight / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_position(out: Path) -> tuple[int, int, int]:
    """A finished run's (processes, steps, images seen), from its run_summary.json."""
    s = json.loads((out / "run_summary.json").read_text())
    return s["num_processes"], s["steps"], s["images_seen"]


def step_history(out: Path) -> tuple[list[int], list[int]]:
    """A run's (step numbers, images seen) per logged optimizer step, from its loss_history.json."""
    h = json.loads((out / "loss_history.json").read_text())
    return h["steps"], h["images_seen"]


def assert_same_resume(ddp: Path, ds: Path) -> None:
    """A DeepSpeed run resumed on another process count is the plain (DDP) run resumed across the same counts:
    the same steps and images seen, the same losses and LoRA weights (to DeepSpeed's CPU Adam against torch's
    AdamW), so the weights and Adam's moments and step carried over."""
    import torch
    from safetensors.torch import load_file

    assert run_position(ds) == run_position(ddp)
    assert step_history(ds) == step_history(ddp)
    assert losses(ds) == pytest.approx(losses(ddp), rel=1e-5)
    a = load_file(str(ddp / "pytorch_lora_weights.safetensors"))
    b = load_file(str(ds / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)


def generate_64px(pipe) -> np.ndarray:
    """The pipeline's images for the demo prompt: 2 steps, 64 px, seed 0, as numpy."""
    import torch

    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a photo of sks red square",
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    )
    return out.images


@pytest.fixture(scope="module")
def tiny_flow(tmp_path_factory) -> dict[str, Path]:
    """family -> a tiny diffusers folder of that family (built once per module)."""
    from sdplan.trainer.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-flow")
    return {f: save_tiny_model(root / f, f) for f in FLOW}


@pytest.fixture(scope="module")
def demo_dataset(tmp_path_factory) -> Path:
    """The demo's captioned dataset, 4 images (built once per module)."""
    from sdplan.demo import make_dataset

    return make_dataset(tmp_path_factory.mktemp("data") / "ds", n=4)


def fake_diffusers_folder(
    root: Path, family: str = "sd15", *, denoiser: dict | None = None, index: dict | None = None
) -> Path:
    """A diffusers folder that passes the pre-launch model check (``source_check.check_source``: every
    component's folder and config, tokenizer files, a weights file) but holds no weights (each weights file is
    a safetensors file of no tensors): loading it fails, so a test passing with it proves nothing was loaded. ``denoiser``: the
    UNet's (or transformer's) config.json; ``index``: keys added to model_index.json."""
    import json

    from sdplan.trainer.source_check import _components

    from sdplan import registry

    arch = registry.family(family).arch
    pipe = {"unet": "StableDiffusionXLPipeline" if family == "sdxl" else "StableDiffusionPipeline",
            "mmdit": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}[arch]  # fmt: skip
    if denoiser is None and arch == "unet":
        denoiser = {"cross_attention_dim": {"sdxl": 2048, "sd21": 1024}.get(family, 768)}
        if family == "sdxl":
            denoiser["addition_embed_type"] = "text_time"
    data: dict = {"_class_name": pipe}
    for sub, kind in _components(arch, family == "sdxl"):
        folder = root / sub
        folder.mkdir(parents=True, exist_ok=True)
        data[sub] = ["diffusers", "X"]
        if kind == "tokenizer":
            (folder / "tokenizer.json").write_text("{}")
            (folder / "tokenizer_config.json").write_text("{}")
        elif kind == "scheduler":  # SD 2.x: stabilityai/stable-diffusion-2-1's, v-prediction (planned at 768)
            sched = {"_class_name": "DDPMScheduler"}
            if family == "sd21":
                sched["prediction_type"] = "v_prediction"
            (folder / "scheduler_config.json").write_text(json.dumps(sched))
        else:
            conf = denoiser if sub in ("unet", "transformer") else {}
            (folder / "config.json").write_text(json.dumps(conf or {}))
            (folder / "diffusion_pytorch_model.safetensors").write_bytes(
                b"\x02" + bytes(7) + b"{}"
            )  # no tensors
    data.update(index or {})
    (root / "model_index.json").write_text(json.dumps(data))
    return root


class MkdirPayload:
    """A pickle that runs code when unpickled: makes the folder ``target`` (a .ckpt that names code must be
    refused before it runs)."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.target),))
