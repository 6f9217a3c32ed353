"""`sdplan train --demo` end to end on the CPU, and the runs built on it: several processes, out-of-memory
recovery, Ctrl-C and --resume, DeepSpeed ZeRO-2 offload. Real processes, the console script's code path."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import built_once, digest
from limits import scaled

pytestmark = pytest.mark.train


def sdplan(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "sdplan.cli", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        env=full_env,
    )


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One `sdplan train --demo` (read, never written, by the tests): under pytest-xdist the workers of this
    session share it, the first runs it and another waits for it (each worker ran its own: ~20 s)."""

    def build(root: Path) -> None:
        proc = sdplan(
            "train", "--demo", "--out", str(root / "sdplan-demo")
        )  # its time: benchmarks/demo_time.py
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (root / "process.json").write_text(
            json.dumps({"args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr})
        )

    root = built_once(tmp_path_factory, "demo-run", "process.json", build)
    out, said = root / "sdplan-demo", root / "process.json"
    kept = json.loads(said.read_text())
    return out, subprocess.CompletedProcess(kept["args"], 0, kept["stdout"], kept["stderr"])


def test_demo_writes_every_output(demo):
    out, proc = demo
    assert (out / "base_model" / "model_index.json").is_file()
    assert len(list((out / "dataset").glob("*.png"))) == 8
    assert len(list((out / "dataset").glob("*.txt"))) == 8
    cfg = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert cfg["training"]["device"] == "cpu" and cfg["method"] == "lora"
    assert cfg["plan"]["steps"]["total_steps"] == 16
    s = summary(out)
    assert s["method"] == "lora"
    assert s["steps"] == 16 and s["images_seen"] == 32 and s["num_processes"] == 1
    assert isinstance(s["final_loss"], float) and s["final_loss"] == s["final_loss"]  # finite, not NaN
    for path in s["outputs"]:
        assert (out / path).is_file(), path
    # The plan is shown, with the real step arithmetic, and the summary at the end.
    assert (
        "16 images (with repeats) / 2 per step = 8 steps per epoch x 2 epochs = 16 optimizer steps"
        in proc.stdout
    )
    assert "done: 16 steps, 32 images seen" in proc.stdout
    assert proc.stdout.count("done: ") == 1  # sdplan's summary; the trainer does not print its own as well
    # DeepSpeed (installed by `make test`) says it fell back to the CPU on each import without a GPU: twice
    # on stdout (the model build, then the trainer), a "[WARNING]" a newcomer takes for a problem.
    assert "Setting accelerator to CPU" not in proc.stdout and "[WARNING]" not in proc.stdout
    # A tiny random model: the demo says it shows the pipeline, not learning (issue 13).
    assert "shows that the pipeline works end to end" in proc.stdout and "not that it learns" in proc.stdout


def test_demo_lora_files_and_sample_grid(demo):
    from PIL import Image
    from safetensors import safe_open

    out, proc = demo
    kohya = [p for p in out.glob("*.safetensors") if "kohya" in p.name]
    assert len(kohya) == 1
    with safe_open(str(kohya[0]), "pt") as f:
        keys = list(f.keys())
        meta = f.metadata()
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    assert any(k.endswith(".lora_down.weight") for k in keys) and any(k.endswith(".alpha") for k in keys)
    assert meta["ss_network_dim"] == "4"
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (a safetensors handle, not a dict)
    assert any(k.startswith("unet.") for k in names)
    grid = Image.open(out / "samples" / "final.png")
    # 4 prompts at 64 px, 2 x 2, each labelled in a strip under it
    assert grid.format == "PNG" and grid.width == 128 and 128 < grid.height < 256
    # The final grid shows its progress (it had none: minutes on a real model): 4 prompts x 6 steps.
    assert "sampling the final grid: 4 prompts x 6 steps" in proc.stdout
    assert "final sample grid: denoising step 24/24" in proc.stdout
    assert Image.open(out / "loss.png").format == "PNG"


def test_demo_refuses_to_overwrite_without_force(demo, tmp_path):
    out, _ = demo
    proc = sdplan("train", "--demo", "--out", str(out), "--dry-run")
    assert proc.returncode == 3 and "--force" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_force_keeps_files_the_user_put_in_its_dataset_and_model(demo, tmp_path):
    """--force rebuilt the demo's base_model/ and dataset/ by deleting both whole: an image and a note the user
    had added there were gone. Refused now, before anything is deleted; the demo's own files say which."""
    import shutil

    out = tmp_path / "sdplan-demo"
    shutil.copytree(demo[0], out, symlinks=True)
    made = json.loads((out / ".sdplan-demo-files.json").read_text())
    assert "unet/config.json" in made["base_model"] and "00_red_square.txt" in made["dataset"], made
    (out / "dataset" / "mine.png").write_bytes(b"not really a png")
    (out / "base_model" / "notes.txt").write_text("mine")
    proc = sdplan("train", "--demo", "--out", str(out), "--force")
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stderr
    assert "holds files the demo did not make (notes.txt)" in proc.stderr, proc.stderr
    (out / "base_model" / "notes.txt").unlink()
    proc = sdplan("train", "--demo", "--out", str(out), "--force", "--dry-run")
    assert proc.returncode == 3 and "(mine.png)" in proc.stderr, proc.stderr
    assert (out / "dataset" / "mine.png").read_bytes() == b"not really a png"
    samples = sorted(p.name for p in (out / "samples").iterdir())
    assert samples == sorted(p.name for p in (demo[0] / "samples").iterdir())  # nothing of the run cleared


def test_the_demos_flags_count_when_it_resumes_and_when_it_starts(demo, tmp_path):
    """`--demo --resume --dry-run` runs nothing (it trained steps 17-48 and rewrote the weights: the resume
    dropped every flag but the overrides), and a new demo takes --epochs and --resolution (they were ignored)."""
    out, _ = demo
    before = digest(out)
    proc = sdplan("train", "--demo", "--resume", "--out", str(out), "--dry-run", "training.max_steps=48")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dry run: would run" in proc.stdout and "--resume latest" in proc.stdout
    assert digest(out) == before
    new = tmp_path / "new"
    proc = sdplan("train", "--demo", "--out", str(new), "--dry-run", "--epochs", "3", "--resolution", "128")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "8 steps per epoch x 3 epochs = 24 optimizer steps" in proc.stdout
    assert "resolution 128" in proc.stdout and not new.exists()


@pytest.mark.slow
def test_two_processes_see_the_same_images(demo, tmp_path):
    out1, _ = demo
    out2 = tmp_path / "two"
    proc = sdplan("train", "--demo", "--out", str(out2), "--num-processes", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch.distributed.run --standalone --nproc_per_node 2" in proc.stdout
    one, two = summary(out1), summary(out2)
    assert two["num_processes"] == 2
    assert two["images_seen"] == one["images_seen"] == 32
    assert two["steps"] == one["steps"] // 2


def _demo_with_oom_at_step_10(tmp_path: Path, store: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The demo with an out-of-memory injected at step 10 and ``store`` as the local profile store, where the
    injected out-of-memory is recorded (SDPLAN_RECORD_INJECTED: a plain injected run records nothing)."""
    out = tmp_path / "oom"
    env = {"SDPLAN_INJECT_OOM_AT_STEP": "10", "SDPLAN_PROFILE_DIR": str(store), "SDPLAN_RECORD_INJECTED": "1"}
    return out, sdplan("train", "--demo", "--out", str(out), env=env)


def test_out_of_memory_is_retried_smaller_and_recorded(tmp_path):
    store = tmp_path / "store"
    out, proc = _demo_with_oom_at_step_10(tmp_path, store)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "micro-batch 2 -> 1, gradient accumulation 1 -> 2" in proc.stdout
    assert "restarting from the last checkpoint" in proc.stdout  # the rolling checkpoint of step 8
    cfg = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert (cfg["training"]["batch_size"], cfg["training"]["grad_accum"]) == (1, 2)
    s = summary(out)
    assert s["steps"] == 16 and s["images_seen"] == 32  # the same run, smaller micro-batches
    assert not (out / "oom.json").exists()
    points = yaml.safe_load((store / "methods" / "observed-lora.yaml").read_text())["points"]
    assert [(p["batch"], p["grad_accum"], p["outcome"]["fits"]) for p in points] == [
        (2, 1, False),
        (1, 2, True),
    ]
    assert "out of memory at step 10" in points[0]["source"]


def test_a_profile_store_that_cannot_be_written_does_not_stop_the_out_of_memory_retry(tmp_path):
    """Recording the observation is bookkeeping: with the store unwritable (a file in its place) the retry goes
    on and the run finishes; sdplan says what it could not record."""
    store = tmp_path / "store"
    store.write_text("not a folder")
    out, proc = _demo_with_oom_at_step_10(tmp_path, store)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "warning: not recorded in the local profile store" in proc.stdout + proc.stderr
    assert summary(out)["steps"] == 16
    assert store.read_text() == "not a folder"


@pytest.mark.slow
def test_ctrl_c_leaves_a_checkpoint_and_resume_finishes_the_same_run(demo, tmp_path):
    out = tmp_path / "int"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdplan.cli", "train", "--demo", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "step 5/16" in line:
            proc.send_signal(signal.SIGINT)  # as Ctrl-C would, to sdplan only: it forwards to the trainer
            break
    rest, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 130, "".join(seen) + rest
    assert "sdplan train --resume --out" in rest
    # The interrupt checkpoint: interrupt-step-N, or the rolling checkpoint when the stop lands on its step.
    said = re.search(r"interrupted at step (\d+); checkpoint (\S+)", rest)
    assert said, rest
    assert Path(said.group(2)).parent == out / "checkpoints" and Path(said.group(2)).is_dir()
    assert Path(said.group(2)).name.startswith(("interrupt-step-", "rolling-step-"))

    before = json.loads((Path(said.group(2)) / "train_state.json").read_text())["wall_seconds"]
    assert before > 0
    resumed = sdplan("train", "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    one = summary(demo[0])
    s = summary(out)
    assert (s["steps"], s["images_seen"]) == (16, 32)
    assert s["final_loss"] == pytest.approx(one["final_loss"], rel=1e-6)  # the same run as never interrupted
    assert s["wall_seconds"] > before  # the whole run's time, not the resumed session's alone


@pytest.mark.slow
def test_closing_the_terminal_leaves_a_checkpoint_and_resume_finishes_the_same_run(demo, tmp_path):
    """Issue 13 item 4: the demo runs on a pseudo-terminal; at step 5 the terminal is closed (hung up) and
    sdplan gets SIGHUP. The trainer stops like on SIGTERM: a checkpoint, exit 130, nothing written to the dead
    terminal can fail it; --resume then finishes the same run. (It used to train on unseen, or die; and in 1 of 2
    runs the trainer's next progress line hit the closed terminal before the SIGHUP came and it died with no
    checkpoint: an EIO is now the hangup, see test_hangup.py.)"""
    import pty

    out = tmp_path / "hup"
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdplan.cli", "train", "--demo", "--out", str(out)],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env={**os.environ, "SDPLAN_PLAIN_PROGRESS": "1"},
    )
    os.close(secondary)
    seen = b""
    try:
        while b"step 5/16" not in seen:
            chunk = os.read(primary, 4096)
            assert chunk, seen.decode(errors="replace")[-3000:]
            seen += chunk
    finally:
        os.close(primary)  # the terminal window closes
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=scaled(120)) == 130
    checkpoints = [p.name for p in (out / "checkpoints").iterdir() if p.is_dir()]
    assert any(n.startswith(("interrupt-step-", "rolling-step-")) for n in checkpoints), checkpoints
    assert not (out / "run_summary.json").exists()  # stopped, not run to the end unseen

    resumed = sdplan("train", "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    s = summary(out)
    assert (s["steps"], s["images_seen"]) == (16, 32)
    assert s["final_loss"] == pytest.approx(summary(demo[0])["final_loss"], rel=1e-6)


def _train_with_deepspeed(
    tmp_path, deepspeed: dict, precision: str, max_steps: int, method: str | None = None, **sections: dict
):
    """`sdplan train --device cpu` of the tiny SD 1.x demo under DeepSpeed; asserts it exited 0, returns
    (the process, the run folder)."""
    from sdplan.trainer.tiny import save_tiny_model

    from sdplan.demo import demo_config, make_dataset

    root = tmp_path / "ds"
    save_tiny_model(root / "base_model", "sd15")
    make_dataset(root / "dataset")
    data = demo_config(root, max_steps=max_steps)
    if method is not None and method != data["method"]:
        data["method"] = method
        data.pop("lora", None)
    data["distributed"]["deepspeed"] = deepspeed
    data["training"]["precision"] = precision
    for name, values in sections.items():  # more settings, by section
        data.setdefault(name, {}).update(values)
    data["sampling"]["prompts"] = data["sampling"]["prompts"][:1]
    (tmp_path / "ds.yaml").write_text(yaml.safe_dump(data))
    out = root / "run"
    proc = sdplan(
        "train",
        "--config",
        str(tmp_path / "ds.yaml"),
        "--out",
        str(out),
        "--device",
        "cpu",
        timeout=600,
        env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "torch-extensions")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


@pytest.mark.slow
def test_deepspeed_zero2_offload_on_cpu(tmp_path):
    pytest.importorskip("deepspeed")
    # fp16, the default: trains in fp32 on the CPU (DeepSpeed refused fp16)
    proc, out = _train_with_deepspeed(tmp_path, {"zero_stage": 2, "offload_optimizer": True}, "fp16", 4)
    assert "DS_ACCELERATOR=cpu" in proc.stdout and "accelerate.commands.launch" in proc.stdout
    # DeepSpeed's bare print once its shared-memory op is built, between the trainer's lines
    assert "built successfully" not in proc.stdout and "Setting accelerator" not in proc.stdout, proc.stdout
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert acc["distributed_type"] == "DEEPSPEED"
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(out / "deepspeed.json")
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["train_batch_size"] == 2 * 1 * 1
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # the offloaded optimizer is torch's AdamW on the CPU: DeepSpeed compiled no CPU Adam op (minutes of C++)
    assert ds["zero_force_ds_cpu_optimizer"] is False
    assert not (tmp_path / "torch-extensions").exists() and "CPU Adam op" not in proc.stdout
    # and its checkpoint says so: a GPU run, whose offload runs DeepSpeed's CPU Adam, cannot load that state
    from sdplan.trainer import checkpoint

    saved = checkpoint.read_state(checkpoint.latest_checkpoint(out))
    assert saved.settings[checkpoint.OFFLOADED_OPTIMIZER] == "torch AdamW"
    assert summary(out)["steps"] == 4


@pytest.mark.slow
def test_deepspeed_full_finetune_in_bf16_on_cpu(tmp_path):
    """DeepSpeed runs its own bf16: its engine casts the trained UNet to bf16 and accelerate's autocast is off,
    so the recipe hands the UNet bf16 latents and conditioning (fp32 ones stopped the first step). ZeRO-2 with
    the optimizer offloaded (two processes: test_trainer's test_deepspeed_zero2_cpu_offload_in_two_processes_is_one_run);
    without it, on one process, it is refused: nothing to split the state over (test_plan_config).

    Its outputs are the fp32 master weights, as the same run without DeepSpeed exports: they were the engine's
    bf16 copy (the UNet, the single file, and the EMA, copied into a bf16 copy of the UNet), and the master
    started from the base rounded to bf16 (5.4e-4 off it at most, more than a run's update at lr 1e-5). At a
    learning rate too small to move a weight by 1e-9, every output is the base."""
    pytest.importorskip("deepspeed")
    import torch
    from safetensors.torch import load_file

    _, out = _train_with_deepspeed(
        tmp_path,
        {"zero_stage": 2, "offload_optimizer": True},
        "bf16",
        2,
        method="finetune",
        training={"learning_rate": 1e-12},
        ema={"enabled": True, "decay": 0.5},
        output={"save_single_file": True},
    )
    ds = json.loads((out / "deepspeed.json").read_text())
    assert ds["bf16"] == {"enabled": True}
    assert "offload_optimizer" in ds["zero_optimization"]
    assert summary(out)["steps"] == 2 and math.isfinite(summary(out)["final_loss"])

    name = "diffusion_pytorch_model.safetensors"
    base = load_file(out.parent / "base_model" / "unet" / name)
    single = load_file(out / f"{out.name}.safetensors")
    for unet in (load_file(out / "model" / "unet" / name), load_file(out / "ema" / "model" / "unet" / name)):
        assert {t.dtype for t in unet.values()} == {torch.float32}
        assert max((unet[k] - base[k]).abs().max().item() for k in base) < 1e-9
    trained = [t for k, t in single.items() if k.startswith("model.diffusion_model.")]
    assert len(trained) == len(base) and {t.dtype for t in trained} == {torch.float32}


@pytest.mark.slow
def test_deepspeed_launch_gives_the_trainer_a_deepspeed_accelerator(tmp_path):
    """The written accelerate.yaml + deepspeed.json, launched exactly as `sdplan train` launches, give the
    trainer's own Accelerator the DeepSpeed plugin with ZeRO-2 and CPU optimizer offload."""
    pytest.importorskip("deepspeed")
    from sdplan.config import validate
    from sdplan.launch import build_launch, free_port
    from sdplan.launcher import write_run_files

    cfg = validate(
        {
            "training": {"device": "cpu", "precision": "fp32", "batch_size": 2, "grad_accum": 2},
            "distributed": {"deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
            "output": {"dir": str(tmp_path)},
        }
    )
    launch = build_launch(cfg, tmp_path / "sdplan.yaml", tmp_path, main_process_port=free_port())
    write_run_files(tmp_path, cfg, launch, "test")
    probe = tmp_path / "probe_accelerator.py"
    probe.write_text(
        "import sys\n"
        "from sdplan import config\n"
        "from sdplan.trainer import runtime\n"
        "cfg = config.load(sys.argv[sys.argv.index('--config') + 1])\n"
        "acc = runtime.make_accelerator(cfg, cfg.output.dir)\n"
        "ds = acc.state.deepspeed_plugin\n"
        "print('TYPE', acc.distributed_type.value, ds and ds.zero_stage,\n"
        "      ds and ds.deepspeed_config['zero_optimization']['offload_optimizer']['device'])\n"
    )
    i = launch.cmd.index("-m", 3)  # the trainer module after the launcher's own args
    cmd = [*launch.cmd[:i], str(probe), *launch.cmd[i + 2 :]]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=scaled(600), env={**os.environ, **launch.env}
    )
    assert "TYPE DEEPSPEED 2 cpu" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_sdxl_demo_with_text_encoders_writes_te1_te2_kohya_names_and_logs(tmp_path):
    """`--demo --model sdxl`: the same outputs as the SD 1.x demo, from a two-encoder model; with the text
    encoders training, the kohya file names both (lora_te1_ / lora_te2_); TensorBoard logs land in logs/."""
    from safetensors import safe_open

    out = tmp_path / "sdxl-demo"
    proc = sdplan(
        "train",
        "--demo",
        "--model",
        "sdxl",
        "--out",
        str(out),
        "--max-steps",
        "2",  # of its 16: every output checked below comes from any run of a step or more
        "training.train_text_encoder=true",
        "logging.tensorboard=true",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = summary(out)
    assert s["method"] == "lora" and s["steps"] > 0 and s["images_seen"] > 0
    (kohya,) = out.glob("*.kohya.safetensors")
    with safe_open(str(kohya), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert any(k.startswith("lora_unet_") for k in keys)
    assert any(k.startswith("lora_te1_") for k in keys) and any(k.startswith("lora_te2_") for k in keys)
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "loss.png").is_file() and list((out / "samples").glob("*.png"))
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((out / "logs").rglob("events.out.tfevents.*"))


def test_a_second_demo_copies_the_tiny_model_the_first_built(tmp_path, monkeypatch):
    """Building the tiny model imports diffusers and transformers in `sdplan train` itself (~5 s of a demo's
    ~18): a demo keeps the model it built (sdplan.demo.tiny_model_cache) and the next copies it, file for file
    what a build writes. A cache that cannot be written costs nothing but the time: the model is built."""
    from sdplan import demo, profiles

    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "cache"))
    assert demo._build_tiny_model(tmp_path / "first", "sd15") is None  # built, and kept
    kept = demo.tiny_model_cache("sd15")
    assert kept.is_dir() and kept.parent.parent == tmp_path / "cache"
    assert demo._build_tiny_model(tmp_path / "second", "sd15") == kept
    built = digest(tmp_path / "first")
    assert built and digest(tmp_path / "second") == built

    # a kept model damaged since (a truncated weights file) is built again, not copied into every later demo
    weights = next((kept / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    assert demo._build_tiny_model(tmp_path / "fourth", "sd15") is None
    assert digest(tmp_path / "fourth") == built and digest(kept) == built

    (tmp_path / "not-a-folder").write_text("a file where the cache would go")
    monkeypatch.setenv(profiles.CACHE_ENV, str(tmp_path / "not-a-folder"))
    assert demo._build_tiny_model(tmp_path / "third", "sd15") is None
    assert (tmp_path / "third" / "model_index.json").is_file()


def test_the_demo_samples_flux_at_its_own_guidance(tmp_path):
    """The demo's config pinned sampling.guidance_scale 5.0 for FLUX.1 too, whose guidance embedding samples at
    3.5 (FluxPipeline's and kohya's default): null there, the family's own."""
    from sdplan.trainer.sampling import guidance_for

    from sdplan.demo import demo_config

    flux = demo_config(tmp_path, family="flux-dev")["sampling"]["guidance_scale"]
    assert flux is None and guidance_for(flux, "flux-dev") == 3.5
    assert demo_config(tmp_path, family="sd15")["sampling"]["guidance_scale"] == 5.0
