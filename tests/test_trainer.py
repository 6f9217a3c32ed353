"""The bundled trainer on tiny models built in code (CPU, seconds each): every method trains and its outputs
load back into a diffusers pipeline; exact resume; SIGINT; broken and empty datasets; OOM and NaN stops;
a 2-process gloo run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    assert_same_resume,
    built_once,
    losses,
    make_images,
    run_position,
    tiny_train_config,
    train_two_processes,
    trains_in_process,
)
from limits import scaled, wait_until
from PIL import Image
from sdplan.trainer import checkpoint, models, run, runtime, stops
from sdplan.trainer.__main__ import main as trainer_main

from sdplan import config
from sdplan.errors import DatasetError, UsageError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


pytestmark = trains_in_process


def write_cfg(cfg: config.TrainConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def pipe_image(pipe, prompt: str = "a photo of sks red square") -> np.ndarray:
    g = torch.Generator("cpu").manual_seed(0)
    out = pipe(
        prompt, num_inference_steps=2, guidance_scale=1.0, height=64, width=64, generator=g, output_type="np"
    )
    return out.images[0]


def sd_pipeline(folder: Path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        str(folder), safety_checker=None, requires_safety_checker=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "flat", n=4)


# -- pure pieces ------------------------------------------------------------------------------------------


def test_a_one_step_run_is_worded_in_the_singular_and_its_fraction_of_an_epoch(tmp_path):
    """A one-step run printed '-> 8 steps/epoch, 1 steps (1 epoch)' while run_summary.json said epochs 0.125,
    and 'done: 1 steps, 1 images seen'."""
    from sdplan.launcher import render_summary

    cfg = tiny_train_config(tmp_path / "model", tmp_path / "data", tmp_path / "out", "training.batch_size=1")

    def line(images, max_steps, epochs=1):
        plan = runtime.plan_steps(
            images_per_epoch=images,
            batches_per_epoch=images,
            batch_size=1,
            grad_accum=1,
            epochs=epochs,
            max_steps=max_steps,
            warmup_steps=0,
            num_processes=1,
        )
        return runtime.describe_plan("lora", "sd15", images, cfg, plan)

    assert "-> 8 steps/epoch, 1 step (0.125 of an epoch)," in line(8, 1)
    assert "-> 8 steps/epoch, 12 steps (1.5 epochs)," in line(8, 12, epochs=2)
    assert "-> 1 step/epoch, 1 step (1 epoch)," in line(1, None)
    assert "-> 4 steps/epoch, 8 steps (2 epochs)," in line(4, None, epochs=2)
    done = render_summary({"steps": 1, "images_seen": 1, "num_processes": 1, "final_loss": 0.5})[0]
    assert done.startswith("done: 1 step, 1 image seen on 1 process, final loss 0.5000")
    assert render_summary({"steps": 4, "images_seen": 8})[0].startswith("done: 4 steps, 8 images seen")


def test_multi_process_step_arithmetic():
    # 8 samples, batch 2, accum 1: 4 steps on one process, 2 on two, 1 on four (each epoch split N ways).
    def plan(n, **kw):
        args = dict(images_per_epoch=8, batch_size=2, grad_accum=1, epochs=3, max_steps=None, warmup_steps=4)
        args.update(kw)
        return runtime.plan_steps(
            batches_per_epoch=-(-args["images_per_epoch"] // (2 * n)), num_processes=n, **args
        )

    assert [plan(n).steps_per_epoch for n in (1, 2, 4)] == [4, 2, 1]
    assert plan(2, images_per_epoch=9, grad_accum=2).steps_per_epoch == 2  # ceil(ceil(9 / 4) / 2)
    one, two = plan(1), plan(2)
    assert (one.total_steps, one.lr_warmup_steps) == (12, 4)
    assert (two.total_steps, two.lr_warmup_steps) == (6, 2)  # the schedule follows the split epoch
    capped = plan(2, epochs=1, max_steps=10, warmup_steps=0)
    assert (capped.total_steps, capped.epochs) == (5, 3)  # max_steps is a one-process count


def test_deepspeed_on_the_cpu_names_gloo_in_a_launched_process_only(monkeypatch, tmp_path):
    """accelerate picks no backend for DeepSpeed on the CPU (each process then counted itself alone): the trainer
    names gloo there, in a process a launcher started; elsewhere (a test process that built a DeepSpeed
    Accelerator keeps ACCELERATE_USE_DEEPSPEED=true) naming it made accelerate read a process group nobody
    started."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert runtime.process_group_backend(cpu=True, launched_with_ds=True) == {}
    cfg = config.validate({"training": {"device": "cpu", "precision": "fp32"}})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert runtime.make_accelerator(cfg, tmp_path).num_processes == 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert runtime.process_group_backend(cpu=True, launched_with_ds=True) == {"backend": "gloo"}
    assert runtime.process_group_backend(cpu=False, launched_with_ds=True) == {}  # CUDA: accelerate's nccl
    assert (
        runtime.process_group_backend(cpu=True, launched_with_ds=False) == {}
    )  # MULTI_CPU: accelerate's gloo


def test_deepspeed_without_the_launcher_is_configured_for_the_process_it_runs_in(monkeypatch, tmp_path):
    """A DeepSpeed config run without `accelerate launch` (sdplan bench's harness, a hand run of the trainer) is
    one process on the device it resolved: accelerate's plugin keeps a given train_batch_size and fp16 block as
    they are (DeepSpeedPlugin.fill_match replaces only "auto", accelerate 1.15), and DeepSpeed asserts
    train_batch_size == micro batch x accumulation x its world size (deepspeed/runtime/config.py _batch_assertion
    @0.19.8). Built from distributed.num_processes (4) it said 24 where one process makes 6, with a second reduce
    bucket (overlap_comm) and fp16 enabled where device auto fell back to the CPU."""
    pytest.importorskip("deepspeed")
    import accelerate

    seen: dict = {}

    class Recorded:
        num_processes = 1
        device = torch.device("cpu")

        def __init__(self, **kwargs):
            seen.update(kwargs)
            self.state = types.SimpleNamespace(deepspeed_plugin=kwargs.get("deepspeed_plugin"))

    monkeypatch.setattr(accelerate, "Accelerator", Recorded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    # set empty (restored after the test), unset to the trainer: it sets a one-process rendezvous in os.environ
    rendezvous = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in (*rendezvous, "DS_ACCELERATOR"):
        monkeypatch.setenv(name, "")
    cfg = config.validate(
        {
            "training": {"batch_size": 2, "grad_accum": 3, "precision": "fp16"},
            "distributed": {"num_processes": 4, "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
        }
    )
    runtime.make_accelerator(cfg, tmp_path)
    ds = seen["deepspeed_plugin"].deepspeed_config
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (
        6,
        2,
        3,
    )
    assert ds["zero_optimization"]["overlap_comm"] is False  # one process: one reduce bucket
    assert (
        not ds["fp16"]["enabled"] and seen["mixed_precision"] == "no"
    )  # the CPU: fp32, as without DeepSpeed
    assert cfg.distributed.num_processes == 4 and cfg.training.device == "auto"  # the config itself unchanged
    # DeepSpeed's rendezvous of one process (without it DeepSpeed looked for MPI: ModuleNotFoundError mpi4py)
    assert [os.environ[n] for n in rendezvous[:5]] == ["0", "0", "1", "1", "127.0.0.1"]
    assert int(os.environ["MASTER_PORT"]) > 0 and os.environ["DS_ACCELERATOR"] == "cpu"


def test_family_detection_and_sources(tmp_path, tiny_sd15):
    assert models.detect_family({"cross_attention_dim": 768}) == "sd15"
    assert models.detect_family({"cross_attention_dim": 1024}) == "sd21"
    assert models.detect_family({"cross_attention_dim": 2048, "addition_embed_type": "text_time"}) == "sdxl"
    assert models.resolve_source(str(tiny_sd15)).kind == "folder"
    assert models.resolve_source("stabilityai/stable-diffusion-xl-base-1.0").kind == "hub"
    for bad in ("./no/such/model", str(tmp_path / "missing.safetensors"), "no-slash-and-missing"):
        with pytest.raises(UsageError, match="no such file or folder"):
            models.resolve_source(bad)
    with pytest.raises(UsageError, match="not a diffusers model"):
        models.resolve_source(str(tmp_path))


def test_load_components(tiny_sd15, tiny_sdxl):
    c = models.load_components(str(tiny_sd15))
    assert (c.family, len(c.text_encoders), len(c.tokenizers)) == ("sd15", 1, 1)
    assert type(c.noise_scheduler).__name__ == "DDPMScheduler"
    x = models.load_components(str(tiny_sdxl))
    assert (x.family, len(x.text_encoders)) == ("sdxl", 2)
    with pytest.raises(models.ModelLoadError, match="sdxl"):
        models.load_components(str(tiny_sd15), family="sdxl")


def test_components_load_in_the_dtype_they_train_in(tiny_sd15, tmp_path):
    """diffusers (and transformers 4.x) load in fp32 unless told: host RAM then held an fp32 copy of every
    half-precision part before it was cast (48 GB for a FLUX.1 transformer instead of 24). Each part loads in
    the dtype the recipe trains it in, for a folder and for a single file."""
    from sdplan.trainer import export
    from sdplan.trainer.tiny import save_tiny_model

    assert models.load_components(str(tiny_sd15)).unet.dtype == torch.float32  # the libraries' default
    want = {"unet": torch.bfloat16, "vae": torch.float32, "text_encoder": torch.bfloat16}
    c = models.load_components(str(tiny_sd15), dtypes=want)
    assert (c.unet.dtype, c.vae.dtype) == (torch.bfloat16, torch.float32)
    assert [te.dtype for te in c.text_encoders] == [torch.bfloat16]

    flux = save_tiny_model(tmp_path / "flux", "flux-dev")
    f = models.load_components(str(flux), dtypes=want)
    assert (f.unet.dtype, f.vae.dtype) == (torch.bfloat16, torch.float32)
    assert [te.dtype for te in f.text_encoders] == [torch.bfloat16, torch.bfloat16]  # CLIP-L and T5

    single = export.save_full(
        tmp_path / "exported", pipeline=sd_pipeline(tiny_sd15), family="sd15", metadata=None
    )[-1]
    half = dict.fromkeys(want, torch.bfloat16)
    s = models.load_components(str(single), config_dir=str(tiny_sd15), dtypes=half)
    assert {s.unet.dtype, s.vae.dtype, *(te.dtype for te in s.text_encoders)} == {torch.bfloat16}


def test_latest_checkpoint_ignores_incomplete(tmp_path):
    root = checkpoint.checkpoint_root(tmp_path)
    for name in ("rolling-step-000004", "step-000002", ".tmp-rolling-step-000006", "step-000008"):
        (root / name).mkdir(parents=True)
    for name in ("rolling-step-000004", "step-000002"):
        (root / name / checkpoint.STATE_FILE).write_text("{}")
    # step-000008 has no train_state.json (never completed); .tmp- folders are writes in progress.
    assert checkpoint.latest_checkpoint(tmp_path) == root / "rolling-step-000004"
    assert checkpoint.resolve_resume("latest", tmp_path) == root / "rolling-step-000004"
    with pytest.raises(UsageError, match="no checkpoint"):
        checkpoint.resolve_resume("latest", tmp_path / "other")


# -- methods ------------------------------------------------------------------------------------------------


@pytest.mark.train
def test_lora_trains_outputs_load_and_change_the_pipeline(tiny_sd15, dataset, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15, dataset, out, "training.train_text_encoder=true", "training.learning_rate=5e-2"
    )
    summary = run.train(cfg)
    assert summary == json.loads((out / "run_summary.json").read_text())
    assert set(summary) == {
        "method",
        "steps",
        "epochs",
        "images_seen",
        "num_processes",
        "final_loss",
        "wall_seconds",
        "sampling_seconds",  # of wall_seconds: the final grid here (what the planner's sampling time predicts)
        "peak_memory_bytes",
        "folder",
        "outputs",
        "intermediate_outputs",
    }
    assert (summary["method"], summary["steps"], summary["images_seen"], summary["num_processes"]) == (
        "lora",
        2,
        4,
        1,
    )
    assert summary["peak_memory_bytes"] > 0 and summary["final_loss"] > 0
    assert 0 < summary["sampling_seconds"] < summary["wall_seconds"]
    assert summary["folder"] == str(out.resolve())
    assert all(not Path(p).is_absolute() and (out / p).exists() for p in summary["outputs"])  # a copy's own
    assert Image.open(out / "loss.png").format == "PNG"
    width, height = Image.open(out / "samples" / "final.png").size
    assert width == 64 and 64 < height < 128  # the image, then its label strip under it

    from safetensors import safe_open

    with safe_open(str(out / f"{out.name}.kohya.safetensors"), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert any(k.startswith("lora_unet_") and k.endswith(".lora_down.weight") for k in keys)
    assert any(k.startswith("lora_te_") for k in keys)
    assert (meta["ss_network_dim"], float(meta["ss_network_alpha"])) == ("4", 8.0)
    assert json.loads(meta["sdplan_config"])["method"] == "lora"
    assert meta["sdplan_mixed_precision"] == "no" == meta["ss_mixed_precision"]  # what it trained in

    pipe = sd_pipeline(tiny_sd15)
    before = pipe_image(pipe)
    pipe.load_lora_weights(str(out))
    assert np.abs(pipe_image(pipe) - before).max() > 1e-3


@pytest.mark.train
def test_loss_on_a_repeated_batch_goes_down(tiny_sd15, tmp_path):
    data = make_images(tmp_path / "one", n=1)
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        data,
        out,
        "data.repeats=8",
        "training.batch_size=1",
        "training.max_steps=24",
        "training.learning_rate=1e-2",
    )
    run.train(cfg)
    history = losses(out)
    assert sum(history[-6:]) < sum(history[:6])

    def fixed_loss(pipe) -> float:
        """Noise-prediction error on the training image at fixed timesteps and noise."""
        g = torch.Generator().manual_seed(123)
        px = np.asarray(Image.open(data / "img000.png").convert("RGB"), dtype=np.float32) / 127.5 - 1
        with torch.no_grad():
            lat = pipe.vae.encode(torch.from_numpy(px).permute(2, 0, 1)[None]).latent_dist.mean
            lat = lat * pipe.vae.config.scaling_factor
            ids = pipe.tokenizer(
                ["a photo of sks red square"],
                padding="max_length",
                max_length=pipe.tokenizer.model_max_length,
                return_tensors="pt",
            ).input_ids
            emb = pipe.text_encoder(ids)[0]
            total = 0.0
            for t in (50, 200, 400, 600, 800, 950):
                noise, tt = torch.randn(lat.shape, generator=g), torch.tensor([t])
                pred = pipe.unet(pipe.scheduler.add_noise(lat, noise, tt), tt, emb).sample
                total += torch.nn.functional.mse_loss(pred, noise).item()
        return total / 6

    pipe = sd_pipeline(tiny_sd15)
    before = fixed_loss(pipe)
    pipe.load_lora_weights(str(out))
    assert fixed_loss(pipe) < 0.95 * before


@pytest.mark.train
def test_dreambooth_grids_sample_what_the_run_trains_on(tmp_path):
    """With no sampling.prompts, DreamBooth's grids sampled dreambooth.instance_prompt ('a photo of sks person' by
    default) even where the instance images are captioned and train on their captions: as the other methods, the
    first image's caption (the instance prompt where it has none)."""
    from sdplan.trainer.data import build_dataset
    from sdplan.trainer.recipes.dreambooth import DreamBooth

    def prompt(folder):
        cfg = tiny_train_config(tmp_path / "model", folder, tmp_path / "out", method="dreambooth", lora=False)
        recipe = DreamBooth.__new__(DreamBooth)  # the sampling prompt needs only the config and the data
        recipe.cfg, recipe.dataset = cfg, build_dataset(cfg)[0]
        return recipe.sample_prompt()

    assert prompt(make_images(tmp_path / "captioned", n=2, caption="a red square on blue")) == (
        "a red square on blue"
    )
    assert prompt(make_images(tmp_path / "bare", n=2, caption=None)) == "a photo of sks person"


def test_dreambooth_with_prior_preservation(tiny_sd15, dataset, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        dataset,
        out,
        "method=dreambooth",
        "dreambooth.with_prior_preservation=true",
        "dreambooth.class_prompt=a photo of a square",
        "dreambooth.num_class_images=3",
        "training.learning_rate=1e-3",
    )
    summary = run.train(cfg)
    assert len(list((out / "class_images").glob("*.png"))) == 3  # generated by the base model
    assert summary["images_seen"] == 4  # instance images; the class images ride along
    assert (out / "model" / "model_index.json").is_file() and (out / f"{out.name}.safetensors").is_file()
    trained = sd_pipeline(out / "model")
    assert np.abs(pipe_image(trained) - pipe_image(sd_pipeline(tiny_sd15))).max() > 1e-3
    # A second run finds the class images there and generates none.
    mtimes = {p: p.stat().st_mtime for p in (out / "class_images").glob("*.png")}
    run.train(
        tiny_train_config(
            tiny_sd15,
            dataset,
            tmp_path / "again",
            "method=dreambooth",
            "dreambooth.with_prior_preservation=true",
            "dreambooth.class_prompt=a photo of a square",
            "dreambooth.num_class_images=3",
            f"dreambooth.class_data={out / 'class_images'}",
            "training.max_steps=1",
        )
    )
    assert {p: p.stat().st_mtime for p in (out / "class_images").glob("*.png")} == mtimes
    # A kohya class folder (reg/1_square) reads its N_name folders only: the images it lacks are generated into
    # 1_square, not beside it (there they were skipped, and generated again every run).
    import shutil

    reg = tmp_path / "reg"
    (reg / "1_square").mkdir(parents=True)
    shutil.copy(next((out / "class_images").glob("*.png")), reg / "1_square" / "mine.png")

    def kohya_run(name: str) -> None:
        run.train(
            tiny_train_config(
                tiny_sd15,
                dataset,
                tmp_path / name,
                "method=dreambooth",
                "dreambooth.with_prior_preservation=true",
                "dreambooth.class_prompt=a photo of a square",
                "dreambooth.num_class_images=3",
                f"dreambooth.class_data={reg}",
                "training.max_steps=1",
            )
        )

    (reg / "0_old").mkdir()  # a folder of 0 repeats, which the scan skips, sorts first: not the target
    kohya_run("kohya")
    assert sorted(p.name for p in reg.rglob("*.png")) == ["class-00001.png", "class-00002.png", "mine.png"]
    assert {p.parent.name for p in reg.rglob("*.png")} == {"1_square"}
    assert (reg / "1_square" / "class-00001.txt").read_text() == "a photo of a square\n"
    kohya_run("kohya-again")
    assert len(list(reg.rglob("*.png"))) == 3


@pytest.mark.train
def test_finetune_with_ema_in_ram(tiny_sd15, dataset, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        dataset,
        out,
        "method=finetune",
        "training.max_steps=4",
        "checkpoints.every_steps=2",
        "ema.enabled=true",
        "ema.decay=0.5",
        "ema.device=cpu",
        "ema.update_every=2",
        "sampling.every_steps=2",
    )
    run.train(cfg)
    for grid in (out / "samples" / "step-000002.png", out / "samples" / "final.png"):
        with Image.open(grid) as im:  # the grids show the averaged weights (the raw ones trained on)
            assert json.loads(im.text["sdplan_samples"])["weights"] == "ema"
    from diffusers import UNet2DConditionModel

    raw = UNet2DConditionModel.from_pretrained(str(out / "model"), subfolder="unet")
    ema = UNet2DConditionModel.from_pretrained(str(out / "ema" / "model"), subfolder="unet")
    base = UNet2DConditionModel.from_pretrained(str(tiny_sd15), subfolder="unet")
    w = "conv_in.weight"
    raw_w, ema_w, base_w = (m.state_dict()[w] for m in (raw, ema, base))
    assert not torch.equal(raw_w, base_w) and not torch.equal(ema_w, raw_w) and not torch.equal(ema_w, base_w)
    assert (out / "ema" / f"{out.name}-ema.safetensors").is_file()
    assert "custom_checkpoint_1.pkl" in os.listdir(checkpoint.latest_checkpoint(out))  # the EMA, checkpointed


@pytest.mark.train
@pytest.mark.parametrize("method", ["finetune", "lora"])
def test_full_bf16_weights(tiny_sd15, dataset, tmp_path, method):
    """training.full_half_weights (the planner's fallback before offload): the UNet trains in bf16; a LoRA's
    matrices too (kohya --full_bf16 casts the network: the planner charged it so, and the trainer had kept
    them in fp32)."""
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        dataset,
        out,
        f"method={method}",
        "training.precision=bf16",
        "training.full_half_weights=true",
        "checkpoints.every_steps=1",
    )
    summary = run.train(cfg)
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in losses(out))
    from safetensors import safe_open

    if method == "lora":
        with safe_open(str(checkpoint.latest_checkpoint(out) / "trainable.safetensors"), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys() if "lora" in k}  # noqa: SIM118 == {torch.bfloat16}
        return
    with safe_open(str(out / "model" / "unet" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        assert f.get_tensor("conv_in.weight").dtype == torch.bfloat16


@pytest.mark.train
# the planner searches Adafactor for textual inversion too (registry.Method.optimizers): the trainer runs it
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_textual_inversion_learns_only_the_new_token(tiny_sd15, dataset, tmp_path, optimizer):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15,
        dataset,
        out,
        "method=textual-inversion",
        "textual_inversion.token=<obj>",
        "textual_inversion.init_token=square",
        "training.learning_rate=5e-2",
        f"memory.optimizer={optimizer}",
    )
    run.train(cfg)
    from sdplan.trainer import export

    pipe = sd_pipeline(tiny_sd15)
    init = pipe_image(pipe, "a photo of square")
    export.load_embedding(pipe, out, "<obj>")
    te = pipe.text_encoder.get_input_embeddings().weight
    tok = pipe.tokenizer
    learned = te[tok.convert_tokens_to_ids("<obj>")]
    assert not torch.allclose(learned, te[tok.encode("square", add_special_tokens=False)[0]])
    assert np.abs(pipe_image(pipe, "a photo of <obj>") - init).max() > 1e-3


@pytest.mark.train
@pytest.mark.parametrize("method", ["lora", "dreambooth", "finetune", "textual-inversion"])
# the LoRA export asks peft for no embedding layers: with its "auto" it looked for the base model's config.json
# (on the Hub for a hub id, at the end of the run) and warned for a diffusers folder
@pytest.mark.filterwarnings("error:Could not find a config file:UserWarning")
def test_sdxl_every_method(method, tiny_sdxl, dataset, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sdxl,
        dataset,
        out,
        f"method={method}",
        "training.max_steps=1",
        # textual inversion trains the new embeddings of both encoders, never the encoders (the config refuses it)
        *(("training.train_text_encoder=true",) if method != "textual-inversion" else ()),
        *(  # prior preservation is DreamBooth's (the config refuses it elsewhere)
            (
                "dreambooth.class_prompt=a square",
                "dreambooth.with_prior_preservation=true",
                "dreambooth.num_class_images=1",
            )
            if method == "dreambooth"
            else ()
        ),
    )
    summary = run.train(cfg)
    assert summary["steps"] == 1 and np.isfinite(summary["final_loss"])
    if method == "lora":
        from safetensors import safe_open

        with safe_open(str(out / f"{out.name}.kohya.safetensors"), framework="pt") as f:
            keys, meta = list(f.keys()), f.metadata()
        assert any(k.startswith("lora_te1_") for k in keys) and any(k.startswith("lora_te2_") for k in keys)
        assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    if method == "textual-inversion":
        from safetensors.torch import load_file
        from sdplan.trainer import export

        embedding = out / f"{export.output_name(cfg.output.name, out)}.safetensors"  # named after the run
        assert set(load_file(str(embedding))) == {"clip_l", "clip_g"}


# -- resume, interrupts, failures -----------------------------------------------------------------------------


@pytest.mark.train
def test_resume_equals_uninterrupted_exactly(tiny_sd15, dataset, tmp_path, capsys):
    """6 steps straight vs. 3 steps + resume 3, mid-epoch, with accumulation, warmup+cosine, LoRA dropout,
    random flips and crops: identical losses and identical weights."""
    opts = (
        "training.batch_size=1",
        "training.grad_accum=2",
        "training.max_steps=6",
        "training.lr_scheduler=cosine",
        "training.lr_warmup_steps=2",
        "lora.dropout=0.1",
        "data.random_flip=0.5",
        "data.center_crop=false",
        "training.noise_offset=0.05",
    )
    straight = tmp_path / "straight"
    run.train(tiny_train_config(tiny_sd15, dataset, straight, *opts, "checkpoints.keep_every_steps=3"))
    kept = checkpoint.checkpoint_root(straight) / "step-000003"
    assert checkpoint.read_state(kept).batches_in_epoch == 2  # mid-epoch: 4 batches per epoch
    # the settings it was made with, which a new run from it (checkpoints.resume) is checked against
    recorded = checkpoint.read_state(kept).settings
    assert recorded["method"] == "lora" and recorded["memory.optimizer"] == "adamw", recorded
    assert recorded["distributed.deepspeed"] is None and isinstance(recorded["lora.rank"], int), recorded
    resumed = tmp_path / "resumed"
    run.train(tiny_train_config(tiny_sd15, dataset, resumed, *opts), resume=str(kept))
    assert losses(resumed) == losses(straight)
    from safetensors.torch import load_file

    a = load_file(str(straight / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "drawn in another order" not in capsys.readouterr().out
    # resumed with another seed: the rest of that epoch comes in another order, which it says (it did not)
    run.train(
        tiny_train_config(tiny_sd15, dataset, tmp_path / "reseeded", *opts, "training.seed=7"),
        resume=str(kept),
    )
    assert "note: epoch 2 is drawn in another order" in capsys.readouterr().out


@pytest.mark.train
def test_sigint_leaves_a_resumable_checkpoint(tiny_sd15, dataset, tmp_path):
    out = tmp_path / "out"
    cfg = tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=400", "checkpoints.every_steps=2")
    path = write_cfg(cfg, tmp_path / "sdplan.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", SDPLAN_PLAIN_PROGRESS="1")
    proc = subprocess.Popen(
        [PY, "-m", "sdplan.trainer", "--config", str(path)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: checkpoint.latest_checkpoint(out) is not None or proc.poll() is not None, 90, poll_s=0.2
    )
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=scaled(60))
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted at step" in stderr and "--resume latest" in stderr
    latest = checkpoint.latest_checkpoint(out)
    state = checkpoint.read_state(latest)
    assert 2 <= state.global_step < 400 and len(state.losses) == state.global_step
    assert not list(checkpoint.checkpoint_root(out).glob(".tmp-*"))
    # Resume to two steps past the interrupt: equal to an uninterrupted run of that length.
    n = state.global_step + 2
    summary = run.train(
        tiny_train_config(tiny_sd15, dataset, out, f"training.max_steps={n}"), resume="latest"
    )
    assert summary["steps"] == n
    straight = tmp_path / "straight"
    run.train(tiny_train_config(tiny_sd15, dataset, straight, f"training.max_steps={n}"))
    assert losses(out) == losses(straight)


@pytest.mark.train
def test_corrupt_images_are_skipped(tiny_sd15, tmp_path, capsys):
    data = make_images(tmp_path / "data", n=2)
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    (data / "empty.jpg").write_bytes(b"")
    summary = run.train(tiny_train_config(tiny_sd15, data, tmp_path / "out", "training.max_steps=1"))
    assert summary["images_seen"] == 2
    printed = capsys.readouterr().out
    assert "2 skipped" in printed and "broken.png" in printed


def test_empty_dataset_is_a_clear_error_before_the_model_loads(tmp_path, capsys):
    # A "model" folder that would fail to load: the dataset error must come first.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    cfg = tiny_train_config(model, tmp_path / "empty", tmp_path / "out")
    with pytest.raises(DatasetError, match="no readable images"):
        run.train(cfg)
    assert trainer_main(["--config", str(write_cfg(cfg, tmp_path / "c.yaml"))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no readable images") and "Traceback" not in err
    assert trainer_main(["--config", str(tmp_path / "c.yaml"), "model.path=./nope"]) == 2
    assert "no such file or folder" in capsys.readouterr().err


@pytest.mark.train
def test_injected_oom_writes_a_report_and_exits_75(tiny_sd15, dataset, tmp_path, monkeypatch):
    out = tmp_path / "out"
    path = write_cfg(tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=3"), tmp_path / "c.yaml")
    monkeypatch.setenv("SDPLAN_INJECT_OOM_AT_STEP", "2")
    assert trainer_main(["--config", str(path), "memory.gradient_checkpointing=true"]) == 75
    report = json.loads((out / "oom.json").read_text())
    assert report["step"] == 2 and report["batch_size"] == 2 and report["grad_accum"] == 1
    assert report["gradient_checkpointing"] is True and "out of memory" in report["message"]
    # The launcher's retry: half the micro-batch, twice the accumulation -> no OOM (the hook needs batch > 1).
    assert trainer_main(["--config", str(path), "training.batch_size=1", "training.grad_accum=2"]) == 0
    assert not (out / "oom.json").exists()


@pytest.mark.train
def test_out_of_memory_in_a_sample_grid_during_training_skips_the_grid(
    tiny_sd15, dataset, tmp_path, monkeypatch, capsys
):
    """A grid during training needs the VAE and text encoders back beside the training state; out of GPU
    memory there stopped the run as a training OOM (exit 75), and the launcher retried a smaller batch, which
    does not shrink the grid's need, and recorded this batch as not fitting. The grid is skipped instead."""
    out = tmp_path / "out"
    monkeypatch.setenv("SDPLAN_INJECT_SAMPLE_OOM_AT_STEP", "2")
    cfg = tiny_train_config(
        tiny_sd15,
        dataset,
        out,
        "training.max_steps=3",
        "sampling.every_steps=1",
        "sampling.prompts=[a red square]",
    )
    summary = run.train(cfg)
    assert summary["steps"] == 3 and not (out / "oom.json").exists()
    grids = sorted(p.name for p in (out / "samples").glob("step-*.png"))
    assert grids == ["step-000001.png", "step-000003.png"]  # step 3's: the final grid's copy
    assert "skipped the sample grid of step 2: out of GPU memory" in capsys.readouterr().out


@pytest.mark.train
def test_grids_during_training_without_prompts_show_a_caption_as_the_final_grid_does(
    tiny_sd15, dataset, tmp_path, capsys
):
    """sampling.every_steps with no sampling.prompts (the default outside the demo) made no grid at all, and
    said nothing; the final grid already fell back to a caption. The long phases say what they do: the text
    cache has a bar (it was said only once done), the every-N grids a line (the bar stood still), and the final
    checkpoint and the export a line each (nothing was printed between the last step and the final grid)."""
    out = tmp_path / "out"
    run.train(
        tiny_train_config(
            tiny_sd15,
            dataset,
            out,
            "training.max_steps=3",
            "sampling.every_steps=1",
            "checkpoints.every_steps=5",
            "memory.cache_text_encoder_outputs=true",
        )
    )
    grids = sorted(p.name for p in (out / "samples").glob("*.png"))
    # step 3's: the final grid's copy
    assert grids == ["final.png", "step-000001.png", "step-000002.png", "step-000003.png"]
    printed = capsys.readouterr().out
    assert "caching text encoder outputs: caption 1/1 " in printed
    assert printed.count("sampling a grid every 1 step into ") == 1
    last_step = printed.index("lora: step 3/3")
    final = printed.index("sampling the final grid")
    assert last_step < printed.index("writing the checkpoint of the final step 3") < final
    assert last_step < printed.index(f"writing the trained weights into {out}") < final


@pytest.mark.train
def test_nan_loss_stops_with_a_checkpoint_from_before(tiny_sd15, dataset, tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("SDPLAN_INJECT_NAN_AT_STEP", "3")
    with pytest.raises(stops.NonFiniteLoss, match="step 3") as err:
        run.train(tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=5"))
    assert "learning_rate" in str(err.value)
    saved = checkpoint.checkpoint_root(out) / "before-nan-step-000002"
    assert str(saved) in str(err.value) and checkpoint.read_state(saved).global_step == 2
    monkeypatch.delenv("SDPLAN_INJECT_NAN_AT_STEP")
    summary = run.train(tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=5"), resume=str(saved))
    assert summary["steps"] == 5 and np.isfinite(summary["final_loss"])


@pytest.mark.train
def test_nan_loss_at_step_1_blames_the_model_or_data_and_saves_no_checkpoint(tiny_sd15, dataset, tmp_path):
    """A NaN/inf loss at step 1, before any update, was blamed on the learning rate ('diverging weights') and
    saved a step-0 before-nan checkpoint of the untrained weights that --resume then picked up. Nothing was
    updated: the base model's weights (one NaN here) or an image are bad; no checkpoint is saved."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan-model"
    shutil.copytree(tiny_sd15, model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors["conv_in.weight"] = torch.full_like(tensors["conv_in.weight"], float("nan"))
    save_file(tensors, weights)
    out = tmp_path / "out"
    with pytest.raises(stops.NonFiniteLoss, match="step 1") as err:
        run.train(tiny_train_config(model, dataset, out, "training.max_steps=3"))
    text = str(err.value)
    assert "learning rate too high" not in text and "learning_rate" not in text, text
    assert "before any update" in text and "unet conv_in.weight" in text and str(model) in text, text
    assert checkpoint.list_checkpoints(out) == []

    # the weights finite, the data or the first forward pass bad: both named
    error = stops.nonfinite_error(1, tiny_train_config(tiny_sd15, dataset, out), None, untrained=True)
    text = str(error)
    assert "before any update, so not from the learning rate" in text and "learning_rate" not in text, text
    assert str(tiny_sd15) in error.fix and str(dataset) in error.fix and error.fix.count("(") == 0

    # under DeepSpeed the engine steps inside accelerator.backward, before the check: not "before any update"
    from types import SimpleNamespace

    from sdplan.trainer.loop import _Step

    accelerator = SimpleNamespace(process_index=0, device="cpu")
    for extra, untrained in (((), True), (("distributed.deepspeed.zero_stage=2",), False)):
        cfg = tiny_train_config(tiny_sd15, dataset, out, *extra)
        assert _Step(1, accelerator, cfg, None, None, None, [], base=[]).untrained is untrained
        assert not _Step(2, accelerator, cfg, None, None, None, [], base=[]).untrained


@pytest.mark.train
def test_gradient_checkpointing_gives_the_same_losses(tiny_sd15, dataset, tmp_path):
    opts = ("training.max_steps=3", "training.train_text_encoder=true", "training.learning_rate=1e-2")
    run.train(tiny_train_config(tiny_sd15, dataset, tmp_path / "plain", *opts))
    run.train(
        tiny_train_config(tiny_sd15, dataset, tmp_path / "gc", *opts, "memory.gradient_checkpointing=true")
    )
    assert losses(tmp_path / "gc") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    assert losses(tmp_path / "gc")[2] != losses(tmp_path / "gc")[0]


@pytest.mark.train
def test_cached_latents_and_text_give_the_uncached_losses(tiny_sd15, dataset, tmp_path, capsys):
    opts = (
        "training.max_steps=3",
        "training.batch_size=1",
        "data.random_flip=0.5",
        "sampling.every_steps=2",
        "sampling.prompts=[a red square, a blue circle]",
    )
    run.train(tiny_train_config(tiny_sd15, dataset, tmp_path / "plain", *opts))
    cached = tiny_train_config(
        tiny_sd15,
        dataset,
        tmp_path / "cached",
        *opts,
        "memory.cache_latents=true",
        "memory.cache_text_encoder_outputs=true",
    )
    cached.memory.cache_latents_to_disk = True  # not in the schema yet; read with a default (memory)
    run.train(cached)
    printed = capsys.readouterr().out
    assert "latent cache: 4 encoded" in printed and "text cache: 1 captions encoded" in printed
    assert losses(tmp_path / "cached") == pytest.approx(losses(tmp_path / "plain"), rel=1e-4)
    assert list((tmp_path / "cached" / "cache" / "latents").glob("*/*.safetensors"))
    grid = Image.open(tmp_path / "cached" / "samples" / "step-000002.png")
    assert grid.width == 128 and 64 < grid.height < 128  # two prompts side by side, labels under them
    # A second run with the same images and VAE encodes nothing.
    run.train(cached)
    assert "latent cache: 0 encoded" in capsys.readouterr().out


@pytest.mark.train
def test_the_text_cache_is_encoded_before_the_denoiser_comes_to_the_gpu(
    tiny_sd15, dataset, tmp_path, monkeypatch, capsys
):
    """memory.cache_text_encoder_outputs encoded the captions with the denoiser already on the GPU: T5-XXL's
    9 GiB on top of a FLUX.1 base, more than a 12 GB card holds, before the first step. The encoders now run
    before the denoiser is placed and leave the GPU; captions a later epoch adds beyond what setup counted
    (Recipe.caption_epochs) are topped up by the loop, and nothing is encoded twice."""
    from sdplan.trainer import conditioning, loop

    order: list = []
    place, precompute, captions = loop.Recipe.place_denoiser, conditioning.TextCache.precompute, None
    captions = loop.Recipe.text_captions

    def placed(self, dtype):
        order.append("denoiser")
        return place(self, dtype)

    def encoded(self, comps, text_encoders, wanted, device, **kw):
        order.append(("encode", len(self.missing(wanted))))
        return precompute(self, comps, text_encoders, wanted, device, **kw)

    monkeypatch.setattr(loop.Recipe, "place_denoiser", placed)
    monkeypatch.setattr(conditioning.TextCache, "precompute", encoded)
    # each epoch one more caption; setup knows of one epoch only
    monkeypatch.setattr(
        loop.Recipe,
        "text_captions",
        lambda self, epochs: captions(self, epochs) | {f"e{e}" for e in range(epochs)},
    )
    monkeypatch.setattr(loop.Recipe, "caption_epochs", lambda self: 1)
    opts = ("training.max_steps=null", "training.epochs=3", "memory.cache_text_encoder_outputs=true")
    summary = run.train(tiny_train_config(tiny_sd15, dataset, tmp_path / "out", *opts))
    assert summary["steps"] > 0
    assert order == [("encode", 2), "denoiser", ("encode", 2)], order  # the caption and e0; then e1, e2
    printed = capsys.readouterr().out
    assert "text cache: 2 captions encoded" in printed and "text cache: 2 more captions encoded" in printed


@pytest.mark.train
def test_aspect_ratio_buckets(tiny_sd15, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate([(256, 96), (240, 100), (96, 256), (100, 240)]):
        Image.new("RGB", size, (60 * i, 120, 200)).save(data / f"img{i}.png")
    cfg = tiny_train_config(
        tiny_sd15, data, tmp_path / "out", "data.resolution=128", "training.max_steps=2", "data.buckets=true"
    )
    summary = run.train(cfg)
    assert summary["images_seen"] == 4
    table = capsys.readouterr().out
    assert "aspect-ratio buckets" in table and " 192x64 " in table and "  64x192" in table


@pytest.mark.train
def test_dreambooth_prior_preservation_with_aspect_buckets(tiny_sd15, tmp_path, capsys):
    """Prior preservation with aspect-ratio buckets: a class batch mixing shapes crashed collate, and a square
    class image beside a wide instance batch was stretched to it (and kept its own size in the SDXL time
    ids). Class images are now generated in the instance buckets' shapes, an instance batch pairs with the
    class images of its bucket, and where its bucket has none they are scaled and cropped to it, not
    stretched (a note says so)."""
    data = tmp_path / "data"
    data.mkdir()
    for i, size in enumerate([(256, 96), (240, 100), (128, 128), (130, 128)]):
        Image.new("RGB", size, (60 * i, 120, 200)).save(data / f"img{i}.png")
    common = ("method=dreambooth", "data.resolution=128", "data.buckets=true", "training.max_steps=2")
    prior = ("dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a photo of a square")
    out = tmp_path / "gen"
    cfg = tiny_train_config(
        tiny_sd15, data, out, *common, *prior, "dreambooth.num_class_images=4", lora=False
    )
    run.train(cfg)
    sizes = sorted(Image.open(p).size for p in (out / "class_images").glob("*.png"))
    assert sizes == [(128, 128), (128, 128), (192, 64), (192, 64)]  # the instance buckets, 2 + 2
    assert "no class image is in the aspect bucket" not in capsys.readouterr().out

    square = tmp_path / "class"  # the user's class images: square only, beside wide instance batches
    square.mkdir()
    for i in range(3):
        Image.new("RGB", (128, 128), (0, 80 * i, 0)).save(square / f"c{i}.png")
    cfg = tiny_train_config(
        tiny_sd15, data, tmp_path / "mine", *common, *prior, "dreambooth.num_class_images=3",
        f"dreambooth.class_data={square}", "memory.cache_latents=true", lora=False,
    )  # fmt: skip
    summary = run.train(cfg)
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert "no class image is in the aspect bucket 192x64" in capsys.readouterr().out


def test_a_sample_at_another_shape_is_cropped_not_stretched(tmp_path):
    """DreamBooth's class image beside an instance batch of another bucket: scaled to cover the shape and
    cropped (its aspect kept), with its real size and crop for the SDXL time ids."""
    from sdplan.trainer.data import CaptionedImages, Item

    Image.new("RGB", (128, 128), (10, 20, 30)).save(tmp_path / "c.png")
    ds = CaptionedImages(
        [Item(tmp_path / "c.png", "a dog", None, 1, None, (128, 128))],
        resolution=128,
        center_crop=True,
        random_flip=0.0,
        buckets=[(128, 128), (192, 64)],
    )
    own, wide = ds[0], ds.sample_at(0, (64, 192))
    assert tuple(own["pixel_values"].shape) == (3, 128, 128) and own["crop_top_left"] == (0, 0)
    assert tuple(wide["pixel_values"].shape) == (3, 64, 192)
    assert wide["original_size"] == (128, 128) and wide["target_size"] == (64, 192)
    assert wide["crop_top_left"] == (64, 0)  # 128 -> 192 x 192, the middle 64 rows
    assert wide["cache_key"] != own["cache_key"]


@pytest.fixture(scope="module")
def two_process_run(tiny_sd15, dataset, tmp_path_factory) -> Path:
    """One 2-process gloo run (torchrun) of 2 epochs, no DeepSpeed: its output folder. Read, never written, by
    test_two_processes_see_the_same_images_as_one and, as its baseline, by
    test_deepspeed_zero2_cpu_offload_in_two_processes_is_one_run (each launched its own: ~10 s apiece). Under
    pytest-xdist the workers of this session share it: the first launches it, another waits for it (the tiny
    model and dataset are seeded, the same in every worker)."""

    def build(root: Path) -> None:
        cfg = tiny_train_config(
            tiny_sd15,
            dataset,
            root / "two",
            "training.max_steps=null",
            "training.epochs=2",
            "checkpoints.keep_every_steps=1",  # step 1: resumed on 1 process beside DeepSpeed's
        )
        train_two_processes(write_cfg(cfg, root / "c.yaml"), root)

    return built_once(tmp_path_factory, "two-processes-run", "two/run_summary.json", build) / "two"


@pytest.mark.slow
@pytest.mark.train
def test_two_processes_see_the_same_images_as_one(tiny_sd15, dataset, tmp_path, two_process_run):
    two = json.loads((two_process_run / "run_summary.json").read_text())
    one = run.train(
        tiny_train_config(
            tiny_sd15, dataset, tmp_path / "one", "training.max_steps=null", "training.epochs=2"
        )
    )
    assert (two["num_processes"], one["num_processes"]) == (2, 1)
    assert two["images_seen"] == one["images_seen"] == 8
    assert (two["steps"], one["steps"]) == (2, 4)  # each epoch split two ways


def _without_a_launcher() -> dict[str, str]:
    """This environment without what a launcher gives its processes (a hand run of the trainer)."""
    gone = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in gone and not k.startswith("ACCELERATE_")}


@pytest.mark.slow
@pytest.mark.train
def test_deepspeed_by_hand_in_bf16_exports_its_fp32_masters_and_refuses_what_it_cannot_load(
    tiny_sd15, dataset, tmp_path
):
    """`python -m sdplan.trainer --config` of a DeepSpeed config, no launcher: one process (DeepSpeed looked for
    MPI: ModuleNotFoundError mpi4py). In bf16 its LoRA file is the fp32 master weights, as without DeepSpeed (it
    was the engine's bf16 copy, up to 0.3% off them). A checkpoint of DeepSpeed resumed without it, and one of a
    run without it resumed with it, are refused in one line (they failed inside the load: "AssertionError: ",
    blamed on damaged files; "no trainable.safetensors"). A deepspeed.json whose accumulation is not
    sdplan.yaml's (a stale file launched by hand) is refused before training (accelerate trained with its value:
    announced 2 epochs, trained 4)."""
    pytest.importorskip("deepspeed")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from sdplan.launch import build_launch, free_port
    from sdplan.launcher import write_run_files

    ds = ("distributed.deepspeed.zero_stage=2", "distributed.deepspeed.offload_optimizer=true")
    keep = "checkpoints.keep_every_steps=2"
    out = tmp_path / "ds"
    cfg = tiny_train_config(tiny_sd15, dataset, out, *ds, "training.precision=bf16", keep)
    path = write_cfg(cfg, tmp_path / "ds.yaml")

    def trainer(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PY, "-m", "sdplan.trainer", *args],
            env=_without_a_launcher(),
            capture_output=True,
            text=True,
            timeout=scaled(300),
        )

    proc = trainer("--config", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = checkpoint.checkpoint_root(out) / "step-000002"
    master = get_fp32_state_dict_from_zero_checkpoint(str(kept / "pytorch_model"), tag=".")
    lora = load_file(out / "pytorch_lora_weights.safetensors")
    assert {t.dtype for t in lora.values()} == {torch.float32}
    master = {k.replace(".default", ""): t for k, t in master.items() if "lora_" in k}
    assert len(lora) == len(master) > 0
    scale = cfg.lora.alpha / cfg.lora.rank  # folded into lora_B (export.save_lora): 2, exact in fp32
    for key, t in lora.items():
        assert torch.equal(t, master[key.removeprefix("unet.")] * (scale if "lora_B" in key else 1)), key

    plain = tiny_train_config(tiny_sd15, dataset, tmp_path / "plain", keep)
    with pytest.raises(checkpoint.CheckpointError, match="holds the state of DeepSpeed") as err:
        run.train(plain, resume=str(kept))
    assert "distributed.deepspeed=" in err.value.fix
    run.train(plain)
    again = write_cfg(tiny_train_config(tiny_sd15, dataset, tmp_path / "ds2", *ds), tmp_path / "ds2.yaml")
    proc = trainer(
        "--config",
        str(again),
        "--resume",
        str(checkpoint.checkpoint_root(tmp_path / "plain") / "step-000002"),
    )
    assert proc.returncode != 0 and "was saved without DeepSpeed" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

    stale = tmp_path / "stale"
    cfg = tiny_train_config(tiny_sd15, dataset, stale, *ds, "training.grad_accum=2")
    ln = build_launch(cfg, write_cfg(cfg, tmp_path / "stale.yaml"), stale, main_process_port=free_port())
    write_run_files(stale, cfg, ln, "test")
    written = json.loads((stale / "deepspeed.json").read_text())
    (stale / "deepspeed.json").write_text(
        json.dumps({**written, "gradient_accumulation_steps": 1, "train_batch_size": 2})
    )
    proc = subprocess.run(
        ln.cmd, env={**os.environ, **ln.env}, capture_output=True, text=True, timeout=scaled(300)
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    said = proc.stdout + proc.stderr
    assert f"{stale / 'deepspeed.json'} has gradient_accumulation_steps 1 but" in said, said[-3000:]
    assert "training.grad_accum 2" in said and "Traceback" not in said, said[-3000:]
    assert not (stale / "loss_history.json").exists()


@pytest.mark.slow
@pytest.mark.train
def test_deepspeed_zero2_cpu_offload_in_two_processes_is_one_run(
    tiny_sd15, dataset, tmp_path, two_process_run
):
    """DeepSpeed ZeRO-2 with the optimizer offloaded, in 2 CPU processes launched as `sdplan train` launches
    them: one world that splits the run (each process used to count itself alone, train the whole run, then
    hang at the first checkpoint), the losses of the 2-process gloo run without DeepSpeed, one optimizer shard
    per process in the checkpoint, a resume from it that equals the uninterrupted run, and one on 1 process
    (DeepSpeed's universal checkpoint) that equals the DDP checkpoint resumed on 1 process (1 -> 2:
    tests/test_resume_deepspeed.py)."""
    pytest.importorskip("deepspeed")
    from sdplan.launch import build_launch, free_port
    from sdplan.launcher import write_run_files

    two = ("training.max_steps=null", "training.epochs=2", "distributed.num_processes=2")
    # the 2-process gloo run without DeepSpeed (the same 2 epochs; distributed.num_processes is read by the
    # launcher and, in the trainer, by DeepSpeed's config and the exports' metadata only: torchrun gives that run
    # its 2 processes)
    ddp = two_process_run

    out = tmp_path / "ds"
    ds = ("distributed.deepspeed.zero_stage=2", "distributed.deepspeed.offload_optimizer=true")
    cfg = tiny_train_config(tiny_sd15, dataset, out, *two, *ds, "checkpoints.keep_every_steps=1")
    path = write_cfg(cfg, tmp_path / "ds.yaml")

    def launch(*resume: str) -> subprocess.CompletedProcess:
        # a fresh port each time: accelerate launch's own fallback races with a launch beside it
        ln = build_launch(cfg, path, out, cpu_processes=2, cpu_cores=2, main_process_port=free_port())
        write_run_files(out, cfg, ln, "test")
        cmd = ln.cmd + list(resume)
        run_env = {**os.environ, **ln.env}
        proc = subprocess.run(
            cmd, env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=scaled(300)
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    proc = launch()
    assert "x 2 processes -> 1 step/epoch, 2 steps" in proc.stdout, proc.stdout
    summary = json.loads((out / "run_summary.json").read_text())
    assert (summary["num_processes"], summary["steps"], summary["images_seen"]) == (2, 2, 8)
    straight = losses(out)
    assert straight == pytest.approx(losses(ddp), rel=1e-5)
    kept = checkpoint.checkpoint_root(out) / "step-000001"
    shards = sorted(p.name for p in (kept / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]

    (out / "loss_history.json").unlink()
    proc = launch("--resume", str(kept))
    assert "resumed from" in proc.stdout
    assert losses(out) == pytest.approx(straight, rel=1e-5)

    # the 2 processes' shards resumed on 1 process: step 2 of the 1-process run's 4 (4 of 8 images done)
    one = tmp_path / "ds-one"
    one_cfg = tiny_train_config(tiny_sd15, dataset, one, *two[:2], *ds)
    one_path = write_cfg(one_cfg, tmp_path / "ds-one.yaml")
    ln = build_launch(one_cfg, one_path, one, cpu_processes=1, cpu_cores=1, main_process_port=free_port())
    write_run_files(one, one_cfg, ln, "test")
    proc = subprocess.run(
        [*ln.cmd, "--resume", str(kept)],
        env={**os.environ, **ln.env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DeepSpeed's universal checkpoint" in proc.stdout and "resumed from" in proc.stdout
    assert run_position(one) == (1, 4, 8)
    ddp_one = tmp_path / "ddp-one"
    run.train(
        tiny_train_config(tiny_sd15, dataset, ddp_one, *two[:2]),
        resume=str(checkpoint.checkpoint_root(ddp) / "step-000001"),
    )
    assert_same_resume(ddp_one, one)


@pytest.mark.train
def test_trains_from_a_single_file_model(tiny_sd15, dataset, tmp_path, capsys):
    from sdplan.trainer import export

    pipe = sd_pipeline(tiny_sd15)
    single = export.save_full(tmp_path / "exported", pipeline=pipe, family="sd15", metadata=None)[-1]
    assert single.suffix == ".safetensors"
    comps = models.load_components(str(single), config_dir=str(tiny_sd15))
    assert comps.family == "sd15"
    assert all(
        torch.equal(a, b) for a, b in zip(comps.unet.state_dict().values(), pipe.unet.state_dict().values())
    )
    cfg = tiny_train_config(single, dataset, tmp_path / "out", "training.max_steps=1")
    cfg.model.config_dir = str(tiny_sd15)  # not in the schema yet: read with a default (None: hub configs)
    assert run.train(cfg)["steps"] == 1
    # the trainer says what it detected (the file's own metadata: sdplan's export writes the SAI model spec)
    out = capsys.readouterr().out
    assert "model: single file: family sd15, prediction epsilon" in out, out
    assert "prediction type epsilon from its metadata (modelspec.prediction_type)" in out


@pytest.mark.slow
@pytest.mark.train
def test_two_processes_train_sdxl_text_encoders(tiny_sdxl, dataset, tmp_path):
    """SDXL conditions on text encoder 1's penultimate layer: its last layer gets no gradient, which DDP
    must be told (find_unused_parameters) or the second step fails."""
    cfg = tiny_train_config(
        tiny_sdxl,
        dataset,
        tmp_path / "out",
        "training.max_steps=4",
        "training.batch_size=1",
        "training.train_text_encoder=true",
    )
    path = write_cfg(cfg, tmp_path / "c.yaml")
    train_two_processes(path, tmp_path)
    assert json.loads((tmp_path / "out" / "run_summary.json").read_text())["steps"] == 2


def test_place_never_holds_the_load_dtype_on_the_device():
    """place() casts on the way: no tensor ever lands on the target device in the fp32 it was loaded in (an SDXL
    UNet moved first and cast after needs twice its bf16 size), and the model ends there in the target dtype.
    The meta device stands for the GPU; every tensor op is seen below autograd."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Landed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.on_device: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    self.on_device.append(t.dtype)
            return out

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    with Landed() as seen:
        runtime.place(model, torch.device("meta"), torch.bfloat16)
    assert seen.on_device and set(seen.on_device) == {torch.bfloat16}
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}

    # already in the target dtype: moved only (no dtype argument, no cast)
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with Landed() as seen:
        runtime.place(model, torch.device("meta"), torch.bfloat16)
    assert set(seen.on_device) == {torch.bfloat16}
    assert next(model.parameters()).device.type == "meta"


def test_final_sample_grid_out_of_memory_keeps_the_run(tiny_sd15, dataset, tmp_path, monkeypatch, capsys):
    """The final grid brings the VAE and text encoders back beside the training state (SDXL LoRA on 8 GB with
    cached outputs: ~9.4 GiB where the step needs ~6.8): it runs after the weights are written, so running out
    of memory there skips the grid with one line and the run still succeeds with its outputs."""
    from sdplan.trainer import sampling

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    monkeypatch.setattr(sampling, "sample_grid", out_of_memory)
    out = tmp_path / "out"
    summary = run.train(tiny_train_config(tiny_sd15, dataset, out))
    assert summary["steps"] == 2
    assert not (out / "samples" / "final.png").exists()
    assert (out / f"{out.name}.kohya.safetensors").exists()
    assert all((out / p).exists() for p in summary["outputs"])
    assert "skipped the final sample grid: it ran out of GPU memory" in capsys.readouterr().out


def test_a_sample_grid_that_fails_otherwise_is_skipped_and_the_run_keeps_its_records(
    tiny_sd15, dataset, tmp_path, monkeypatch, capsys
):
    """The demo's FLUX.1 over an nf4 base on an AVX512-BF16 CPU: the final grid raised bitsandbytes' "shape '[96, 0]'
    is invalid" after the weights were written, and the run died with a traceback and without loss.png,
    loss_history.json or run_summary.json. A grid that fails (not for memory, not a full disk) now takes the
    out-of-memory grid's way: skipped with one line naming the error, the traceback in a file beside where the
    grid would be (not on the console), recorded in run_summary.json; training goes on and the run succeeds."""
    from sdplan.trainer import sampling

    from sdplan.launcher import render_summary

    def broken(*args, **kwargs):
        raise RuntimeError("shape '[96, 0]' is invalid for input of size 24\nsecond line")

    monkeypatch.setattr(sampling, "sample_grid", broken)
    out = tmp_path / "out"
    summary = run.train(tiny_train_config(tiny_sd15, dataset, out, "sampling.every_steps=1"))
    assert summary == json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and all((out / p).exists() for p in summary["outputs"])
    assert {"loss.png", "loss_history.json", f"{out.name}.kohya.safetensors"} <= {
        p.name for p in out.iterdir()
    }
    error = "RuntimeError: shape '[96, 0]' is invalid for input of size 24"
    grids = [(1, "step-000001"), (None, "final")]  # step 2, the last, has the final grid only
    assert summary["sample_grid_failures"] == [
        {"step": step, "error": error, "traceback": str(out / "samples" / f"{name}.error.txt")}
        for step, name in grids
    ]
    assert not list((out / "samples").glob("*.png"))
    written = (out / "samples" / "final.error.txt").read_text()
    assert written.startswith("Traceback") and "in broken" in written and "second line" in written
    console = capsys.readouterr()
    assert "Traceback" not in console.out + console.err
    assert f"skipped the sample grid of step 1: it failed ({error}); its traceback is in " in console.out
    assert f"skipped the final sample grid: it failed ({error}); its traceback is in " in console.out
    assert f"skipped the final sample grid: {error} (traceback: {out / 'samples' / 'final.error.txt'})" in (
        render_summary(summary)
    )


def test_a_grid_a_resume_makes_again_drops_its_error_and_the_failures_span_the_sessions(
    tiny_sd15, dataset, tmp_path, monkeypatch
):
    """A grid that failed, made again by a resumed session: its step-N.error.txt stayed beside the good
    step-N.png, and run_summary's sample_grid_failures held only the last session's (an earlier session's
    failure was lost while its .error.txt stayed)."""
    from sdplan.trainer import sampling

    real = sampling.sample_grid
    failing = {1, 2}

    def flaky(pipe, prompts, **kw):
        label = kw["labels"][0].split("\n")[0]
        if label in {f"step {n}" for n in failing}:
            raise RuntimeError(f"broken at {label}")
        return real(pipe, prompts, **kw)

    monkeypatch.setattr(sampling, "sample_grid", flaky)
    out = tmp_path / "out"
    opts = ("training.max_steps=3", "sampling.every_steps=1", "checkpoints.keep_every_steps=1")
    first = run.train(tiny_train_config(tiny_sd15, dataset, out, *opts))
    assert [f["step"] for f in first["sample_grid_failures"]] == [1, 2]
    samples = out / "samples"
    assert (samples / "step-000002.error.txt").is_file() and not (samples / "step-000002.png").exists()
    failing.clear()  # the grids work in the next session, resumed from step 1: step 2's grid is made again
    kept = checkpoint.checkpoint_root(out) / "step-000001"
    again = run.train(tiny_train_config(tiny_sd15, dataset, out, *opts), resume=str(kept))
    assert (samples / "step-000002.png").is_file() and not (samples / "step-000002.error.txt").exists()
    assert (samples / "step-000001.error.txt").is_file()  # not made again: its failure stays on record
    assert [f["step"] for f in again["sample_grid_failures"]] == [1], again.get("sample_grid_failures")


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("HTTPSConnectionPool(host='huggingface.co'): Max retries exceeded"),
        PermissionError(13, "Permission denied"),
        OSError(5, "Input/output error"),
        OSError(28, "No space left on device"),
    ],
    ids=["connection", "permission", "eio", "enospc"],
)
def test_only_a_full_disk_in_the_final_grid_stops_the_run(tiny_sd15, dataset, tmp_path, monkeypatch, error):
    """Every OSError in a grid was re-raised as a failed write (write_error returns WriteFailed for all of
    them): a ConnectionError in the final grid ended the run after its weights, with no loss.png,
    loss_history.json or run_summary.json, blaming a write. Only a full disk stops it."""
    from sdplan.trainer import sampling
    from sdplan.trainer.outputs import DiskFull

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(sampling, "sample_grid", broken)
    out = tmp_path / "out"
    if error.errno == 28:
        from sdplan.trainer import plots

        closed = []
        real_close = plots.TensorBoardLogger.close

        def close(tb):  # the same full disk flushing the log: it must not hide the one-line DiskFull
            closed.append(tb.enabled)
            real_close(tb)
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(plots.TensorBoardLogger, "close", close)
        with pytest.raises(DiskFull):
            run.train(tiny_train_config(tiny_sd15, dataset, out, "logging.tensorboard=true"))
        assert closed == [True]  # the TensorBoard log is closed though the outputs stopped (it was left open)
        return
    summary = run.train(tiny_train_config(tiny_sd15, dataset, out))
    assert summary["steps"] == 2 and (out / "loss.png").exists() and (out / "run_summary.json").exists()
    assert [f["step"] for f in summary["sample_grid_failures"]] == [None]
    assert type(error).__name__ in summary["sample_grid_failures"][0]["error"]
    assert (out / "samples" / "final.error.txt").is_file()


def test_a_tensorboard_log_that_cannot_be_closed_after_the_outputs_is_said_not_the_runs_end(
    tiny_sd15, dataset, tmp_path, monkeypatch, capsys
):
    """Closing the TensorBoard log (its last flush) after every output was written raised a bare OSError on a full
    disk: a traceback, and no run_summary.json. Now a line says so and the run ends as it would."""
    from sdplan.trainer import plots

    def close(tb):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plots.TensorBoardLogger, "close", close)
    out = tmp_path / "out"
    summary = run.train(tiny_train_config(tiny_sd15, dataset, out, "logging.tensorboard=true"))
    assert summary["steps"] == 2 and (out / "run_summary.json").exists()
    assert "the TensorBoard log in" in capsys.readouterr().out


@pytest.mark.train
def test_inf_gradients_with_a_finite_loss_stop_before_the_update(tiny_sd15, dataset, tmp_path, monkeypatch):
    """On an H100 a faulty attention backward made inf gradients while the loss stayed finite: the update
    spread them into every weight and the run stopped one step later, its last checkpoint already NaN.
    Now the step stops before the update, with the weights from before it."""
    import torch

    out = tmp_path / "out"
    monkeypatch.setenv("SDPLAN_INJECT_INF_GRAD_AT_STEP", "2")
    with pytest.raises(stops.NonFiniteLoss, match="gradients became NaN/inf at step 2") as err:
        run.train(
            tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=4", "training.precision=fp32")
        )
    saved = checkpoint.checkpoint_root(out) / "before-nan-step-000001"
    assert str(saved) in str(err.value) and checkpoint.read_state(saved).global_step == 1
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # the trainer turned cuDNN attention off
    monkeypatch.delenv("SDPLAN_INJECT_INF_GRAD_AT_STEP")
    summary = run.train(
        tiny_train_config(tiny_sd15, dataset, out, "training.max_steps=4", "training.precision=fp32"),
        resume=str(saved),
    )
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])


def test_deepspeed_says_when_it_builds_its_cpu_adam_op(tmp_path, monkeypatch):
    """ZeRO-2 optimizer offload compiles DeepSpeed's CPU Adam op on its first run, silently, for a minute or
    two; the trainer says so beforehand unless the op is prebuilt or in torch's extension cache."""
    pytest.importorskip("deepspeed")
    from sdplan.trainer import runtime
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert "building its CPU Adam op" in runtime.deepspeed_cpu_adam_build_note()
    built = Path(_get_build_directory("cpu_adam", verbose=False))
    built.mkdir(parents=True, exist_ok=True)
    (built / "cpu_adam.so").write_bytes(b"")
    assert runtime.deepspeed_cpu_adam_build_note() is None


def test_deepspeed_on_the_cpu_reduces_over_gloo_without_building_its_shared_memory_op():
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce op whenever its communication starts (a
    minute of C++ per new environment); the trainer's CPU runs mark it incompatible, and DeepSpeed's own builder
    then returns no op (it reduces over gloo) without compiling anything."""
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op
    from sdplan.trainer import runtime

    assert get_accelerator().device_name() == "cpu"
    runtime.gloo_for_deepspeed_on_the_cpu()
    assert build_shm_op() is None


def test_deepspeed_asks_py_cpuinfo_once_per_process(monkeypatch):
    """DeepSpeed's op builder and DeepSpeedCPUAdam each ask py-cpuinfo, which runs a new Python each time (a
    second of CPU); after the trainer's ask_py_cpuinfo_once, DeepSpeed's own callers get one answer."""
    pytest.importorskip("deepspeed")
    cpuinfo = pytest.importorskip("cpuinfo")
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from sdplan.trainer import runtime

    asked = []
    monkeypatch.setattr(
        cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"arch": "X86_64", "flags": ["avx2"]}
    )
    runtime.ask_py_cpuinfo_once()
    builder = CPUAdamBuilder()
    assert builder.cpu_arch() == builder.cpu_arch() == "-march=native"
    assert asked == [1]


def test_ctrl_c_while_the_trainer_starts_ends_as_interrupted_not_in_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C while torch and the libraries import (before the steps' own handler) printed a 45-line traceback
    from inside an import; it ends with the interrupted exit code, in one line."""
    from sdplan import config
    from sdplan.launch import LAUNCHED_ENV

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "load", interrupted)
    monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    assert trainer_main(["--config", str(tmp_path / "c.yaml")]) == 130
    assert capsys.readouterr().err.strip() == "error: aborted"


def test_a_misspelt_lora_target_beside_a_right_one_is_refused(tiny_sd15):
    """peft drops a listed target that matches no module as long as another matches: lora.target_modules=[to_q,
    to_kk] trained to_q alone, silently. Each listed name must name a module."""
    from types import SimpleNamespace

    from diffusers import UNet2DConditionModel
    from sdplan.trainer.runtime import add_lora_adapters

    from sdplan.errors import UsageError

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sd15), subfolder="unet")
    lcfg = SimpleNamespace(rank=2, alpha=2, dropout=0.0, target_modules=["to_q", "to_kk"])
    with pytest.raises(
        UsageError, match=r"lora.target_modules: no module of UNet2DConditionModel is named 'to_kk'"
    ):
        add_lora_adapters(unet, [], lcfg, train_text_encoder=False)
    lcfg.target_modules = ["to_q", "attn1"]  # a block, not a layer: peft's ValueError was a traceback
    with pytest.raises(
        UsageError, match=r"'attn1' in UNet2DConditionModel is a Attention, not a layer the LoRA"
    ):
        add_lora_adapters(unet, [], lcfg, train_text_encoder=False)
    lcfg.target_modules = ["to_q", "norm1"]  # a norm: refused before peft touches the model
    with pytest.raises(UsageError, match=r"'norm1' in UNet2DConditionModel is a GroupNorm/LayerNorm, not a"):
        add_lora_adapters(unet, [], lcfg, train_text_encoder=False)
    # an embedding: peft adapts it, but no kohya / A1111 / ComfyUI LoRA file holds one (its kohya keys were left
    # as peft's lora_embedding_A/B, which diffusers' loader refused, and its diffusers file was at rank/alpha x)
    from transformers import CLIPTextModel

    te = CLIPTextModel.from_pretrained(str(tiny_sd15), subfolder="text_encoder")
    lcfg.target_modules, lcfg.text_encoder_target_modules = ["to_q"], ["q_proj", "token_embedding"]
    with pytest.raises(
        UsageError, match=r"'token_embedding' in CLIPTextModel is a Embedding, not a layer the LoRA"
    ):
        add_lora_adapters(
            UNet2DConditionModel.from_pretrained(str(tiny_sd15), subfolder="unet"),
            [te],
            lcfg,
            train_text_encoder=True,
        )
    lcfg.target_modules = ["to_q", "attn1.to_k", "to_out.0"]  # suffixes of module names, as peft matches
    add_lora_adapters(unet, [], lcfg, train_text_encoder=False)
    assert any("attn1.to_k.lora_A" in n for n, _ in unet.named_parameters())


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_weights_are_diffusers_and_kohyas(prediction):
    """training.min_snr_gamma: min(SNR, gamma) / SNR (epsilon) or / (SNR + 1) (v-prediction), with diffusers'
    compute_snr; a zero terminal SNR weighs 0, never NaN."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr
    from sdplan.trainer.objective import min_snr_weights

    sched = DDPMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type=prediction
    )
    t = torch.tensor([0, 10, 250, 500, 999])
    snr = compute_snr(sched, t)
    want = torch.minimum(snr, torch.full_like(snr, 5.0)) / (snr + 1 if prediction == "v_prediction" else snr)
    torch.testing.assert_close(min_snr_weights(sched, t, 5.0), want, rtol=1e-4, atol=1e-6)
    assert min_snr_weights(sched, t, 5.0)[0] < 0.01 and min_snr_weights(sched, t, 5.0)[-1] == pytest.approx(
        1.0 if prediction == "epsilon" else float(snr[-1] / (snr[-1] + 1)), rel=1e-4
    )
    zt = DDPMScheduler(prediction_type=prediction, rescale_betas_zero_snr=True)
    w = min_snr_weights(zt, torch.tensor([999]), 5.0)
    assert w.item() == 0.0  # not NaN (0/0 under epsilon)


@pytest.mark.train
def test_min_snr_gamma_weighs_the_loss_and_is_recorded(tiny_sd15, dataset, tmp_path):
    """The same run with and without Min-SNR: same draws, other losses (each sample's MSE weighed); kohya's
    ss_min_snr_gamma in the LoRA file."""
    from safetensors import safe_open

    plain, weighted = tmp_path / "plain", tmp_path / "snr"
    run.train(tiny_train_config(tiny_sd15, dataset, plain))
    run.train(tiny_train_config(tiny_sd15, dataset, weighted, "training.min_snr_gamma=5"))
    a, b = losses(plain), losses(weighted)
    assert all(math.isfinite(x) for x in b) and a != b
    with safe_open(str(weighted / f"{weighted.name}.kohya.safetensors"), "pt") as f:
        assert f.metadata()["ss_min_snr_gamma"] == "5.0"
    with safe_open(str(plain / f"{plain.name}.kohya.safetensors"), "pt") as f:
        assert "ss_min_snr_gamma" not in f.metadata()


@pytest.mark.train
def test_caption_dropout_trains_through_the_text_cache(tiny_sd15, dataset, tmp_path, capsys):
    """data.caption_dropout with cached text-encoder outputs: the empty caption is encoded with the others (a
    sample that drew it found no cached embedding otherwise); kohya's ss_caption_dropout_rate in the file."""
    from safetensors import safe_open

    out = tmp_path / "out"
    cfg = tiny_train_config(
        tiny_sd15, dataset, out, "data.caption_dropout=0.5", "memory.cache_text_encoder_outputs=true"
    )
    summary = run.train(cfg)
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert "text cache: 2 captions encoded" in capsys.readouterr().out  # the dataset's one caption and ""
    with safe_open(str(out / f"{out.name}.kohya.safetensors"), "pt") as f:
        assert f.metadata()["ss_caption_dropout_rate"] == "0.5"


def test_class_images_top_up_the_buckets_that_are_short():
    """A class folder filled in part (an interrupted generation, the user's own images) was topped up in the
    instance shapes' proportion over the missing images alone: one wide image there and one to make, it made
    another wide one and the square bucket had none."""
    from sdplan.trainer.recipes.dreambooth import generation_shapes

    wide, square = (64, 192), (128, 128)  # (height, width)
    assert generation_shapes({wide: 2, square: 2}, 1, {wide: 1}) == [(128, 128)]
    assert generation_shapes({wide: 2, square: 2}, 4) == [(192, 64), (192, 64), (128, 128), (128, 128)]
    # 50 square images of the user's and 50 to make, the instances 6 wide to 2 square: all 50 wide
    assert generation_shapes({wide: 6, square: 2}, 50, {square: 50}) == [(192, 64)] * 50
    # more buckets short than images to make: one each, not both in the second bucket (the third had none)
    a, b, c = (1, 1), (2, 2), (3, 3)
    assert generation_shapes({a: 5, b: 5, c: 5}, 2, {a: 10}) == [(2, 2), (3, 3)]
    # images in a bucket no instance is in count for nothing
    assert generation_shapes({square: 4}, 3, {(999, 1): 5}) == [(128, 128)] * 3


def test_the_one_process_rendezvous_fills_in_a_partial_set(monkeypatch):
    """DeepSpeed skips its MPI discovery only with all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    LOCAL_RANK: a stray RANK=0 or a cluster's MASTER_ADDR stopped a launcher-less run with the mpi4py traceback;
    then a MASTER_ADDR naming another host beside a port free here waited 3 hours for it. A world of more than
    one process given without its launcher is refused."""
    from sdplan.errors import UsageError

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    # set empty, which the function takes as unset: monkeypatch then removes what it sets after the test (a
    # rendezvous left in os.environ made every later run in this process look distributed)
    for name in (*names, "DS_ACCELERATOR"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MASTER_ADDR", "10.255.255.1")
    runtime.rendezvous_for_one_process(cpu=True)
    assert [os.environ[n] for n in names[:5]] == ["0", "0", "1", "1", "127.0.0.1"]
    for name in names:
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="WORLD_SIZE=2 is set but not RANK"):
        runtime.rendezvous_for_one_process(cpu=True)
