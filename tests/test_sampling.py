"""Sample grids (tiny SD 1.x / SDXL pipelines on CPU), loss-curve PNGs and the TensorBoard logger."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from PIL import Image
from sdplan.trainer import plots, sampling


def _pipe(folder):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if (folder / "text_encoder_2").exists() else StableDiffusionPipeline
    return cls.from_pretrained(folder)


def _pixels(path):
    with Image.open(path) as im:
        return torch.from_numpy(__import__("numpy").array(im.convert("RGB")))  # a writable copy


def test_sample_grid_sd15_size_seed_and_state(tiny_sd15, tmp_path, capsys):
    pipe = _pipe(tiny_sd15)
    pipe.unet.train()
    prompts = ["a photo of sks dog", "a red square", "a blue circle"]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    capsys.readouterr()  # from_pretrained's own loading bars
    kw = dict(seed=5, steps=2, guidance_scale=3.0, resolution=64, negative_prompt="blurry")
    path = sampling.sample_grid(pipe, prompts, out_path=tmp_path / "samples" / "step_000010.png", **kw)

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (2 * 64, 2 * 64)  # 3 prompts: 2 columns x 2 rows
        info = json.loads(im.text["sdplan_samples"])
    assert info["prompts"] == prompts and info["seed"] == 5 and info["resolution"] == [64, 64]
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG stream is untouched
    assert pipe.unet.training and not pipe.vae.training  # modes restored
    assert "%|" not in capsys.readouterr().err  # no progress bars

    pixels = _pixels(path)
    assert pixels[64:, 64:].sum() == 0  # the 4th cell is empty
    assert not torch.equal(pixels[:64, :64], pixels[:64, 64:128])  # prompts differ
    again = sampling.sample_grid(pipe, prompts, out_path=tmp_path / "again.png", **kw)
    assert torch.equal(_pixels(again), pixels)  # fixed seed: same grid
    other = sampling.sample_grid(pipe, prompts, out_path=tmp_path / "other.png", **{**kw, "seed": 6})
    assert not torch.equal(_pixels(other), pixels)
    assert not list(tmp_path.glob("**/.*.tmp"))


def test_generate_images_reports_each_denoising_step_of_every_prompt(tiny_sd15):
    """The final grid's bar (seconds to minutes on a real model; it had none): ``on_step`` counts the denoising
    steps over all prompts, per step (PNDM, SD 1.x's default, runs steps + 1: clamped), and per image where a
    pipeline does not take ``callback_on_step_end``; the images are the ones made without it."""
    pipe = _pipe(tiny_sd15)
    kw = dict(seed=5, steps=3, guidance_scale=3.0, resolution=64)
    done: list[int] = []
    images = sampling.generate_images(pipe, ["a", "b"], on_step=done.append, **kw)
    assert done == [1, 2, 3, 4, 5, 6]  # each once (PNDM's extra call said no step twice)
    plain = sampling.generate_images(pipe, ["a", "b"], **kw)
    assert all(torch.equal(_pixels_of(x), _pixels_of(y)) for x, y in zip(images, plain, strict=True))

    class NoCallback:  # an older pipeline's __call__
        def __init__(self, inner):
            self.inner = inner

        def set_progress_bar_config(self, **kw):
            self.inner.set_progress_bar_config(**kw)

        def __call__(self, prompt, negative_prompt, num_inference_steps, guidance_scale, height, width,
                     generator, output_type):  # fmt: skip
            return self.inner(prompt, negative_prompt=negative_prompt, num_inference_steps=num_inference_steps,
                              guidance_scale=guidance_scale, height=height, width=width, generator=generator,
                              output_type=output_type)  # fmt: skip

    done.clear()
    sampling.generate_images(NoCallback(pipe), ["a", "b"], on_step=done.append, **kw)
    assert done == [3, 6]


def _pixels_of(image):
    return torch.from_numpy(__import__("numpy").array(image.convert("RGB")))


def test_sample_grid_sdxl_with_labels_under_the_images(tiny_sdxl, tmp_path):
    pipe = _pipe(tiny_sdxl)
    prompts = ["a photo of sks dog", "a green circle on a red square with a long caption"]
    plain = sampling.sample_grid(
        pipe,
        prompts,
        seed=0,
        steps=2,
        guidance_scale=5.0,
        resolution=(64, 32),
        out_path=tmp_path / "a.png",
        cols=2,
    )
    labelled = sampling.sample_grid(
        pipe, prompts, seed=0, steps=2, guidance_scale=5.0, resolution=(64, 32), out_path=tmp_path / "b.png",
        cols=2, labels=True,
    )  # fmt: skip
    for path in (plain, labelled):
        with Image.open(path) as im:
            im.verify()
    with Image.open(plain) as im:
        assert im.size == (2 * 64, 32)  # width x height per cell, one row
    with Image.open(labelled) as im:
        assert im.width == 2 * 64 and im.height > 32  # a label strip under the row
    a, b = _pixels(plain), _pixels(labelled)
    assert torch.equal(a, b[:32]) and int(b[32:].max()) == 255  # the images untouched, the text under them


def test_make_grid_places_each_image():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]
    grid = sampling.make_grid([Image.new("RGB", (10, 8), c) for c in colours], cols=3)
    assert grid.size == (30, 16)
    for i, colour in enumerate(colours):
        assert grid.getpixel(((i % 3) * 10 + 5, (i // 3) * 8 + 4)) == colour
    assert grid.getpixel((25, 12)) == (0, 0, 0)
    with pytest.raises(ValueError, match="cells"):
        sampling.make_grid([Image.new("RGB", (10, 8)), Image.new("RGB", (8, 8))])


def test_ema_is_debiased_and_skips_nan():
    assert plots.ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    smoothed = plots.ema([math.nan, 1.0, math.inf, 3.0], 0.5)
    assert math.isnan(smoothed[0])
    assert smoothed[1] == pytest.approx(1.0) and smoothed[2] == pytest.approx(1.0)
    assert smoothed[3] == pytest.approx((0.5 * 0.5 * 1.0 + 0.5 * 3.0) / 0.75)
    with pytest.raises(ValueError):
        plots.ema([1.0], 1.0)


def test_ema_over_images_seen_averages_the_same_images_before_and_after_a_resume():
    """A history of 1-image steps resumed with 2-image steps: each 2-image step weighs as much as the two
    1-image steps it replaces, so the curve equals the one of a run that kept 1-image steps (the plain EMA
    per step gave the 2-image steps the weight of one). Evenly spaced positions are the plain EMA."""
    a, b, c = 1.0, 0.5, 0.25
    moved = plots.ema([1.0, 1.0, 1.0, 1.0, a, b, c], 0.9, x=[1, 2, 3, 4, 6, 8, 10])
    kept = plots.ema([1.0, 1.0, 1.0, 1.0, a, a, b, b, c, c], 0.9, x=list(range(1, 11)))
    assert moved == pytest.approx(kept[:4] + kept[5::2])
    assert plots.ema([3.0, 1.0, 2.0], 0.8, x=[0, 2, 4]) == pytest.approx(plots.ema([3.0, 1.0, 2.0], 0.8))
    with pytest.raises(ValueError, match="increase"):
        plots.ema([1.0, 2.0], 0.9, x=[2, 2])


def test_loss_curve_png(tmp_path):
    steps = list(range(1, 51))
    losses = [1.0 / s + 0.05 * math.sin(s) for s in steps]
    losses[10] = math.nan  # a NaN step still plots
    lr = [1e-4 * min(1.0, s / 10) for s in steps]
    path = plots.loss_curve(steps, losses, tmp_path / "plots" / "loss.png", lr=lr, title="lora")
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (800, 450)
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 24)) > 10  # something was drawn (colours used)
    assert plots.loss_curve([1], [0.5], tmp_path / "one.png").exists()
    with pytest.raises(ValueError, match="positions"):
        plots.loss_curve([1, 2], [0.5], tmp_path / "bad.png")


def test_tensorboard_logger_writes_scalars_and_images(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid = tmp_path / "grid.png"
    Image.new("RGB", (16, 8), (10, 20, 30)).save(grid)
    with plots.TensorBoardLogger(tmp_path / "tb") as tb:
        assert tb.enabled
        for step in (1, 2):
            tb.log(step, loss=0.5 / step, lr=1e-4, it_per_s=3.0, memory_bytes=2**30, grad_norm=0.1)
        tb.image("samples", grid, 2)
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert {"train/loss", "train/lr", "perf/it_per_s", "perf/memory_gib", "train/grad_norm"} <= set(
        events.Tags()["scalars"]
    )
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([0.5, 0.25])
    assert events.Scalars("perf/memory_gib")[0].value == pytest.approx(1.0)
    image = events.Images("samples")[0]
    assert (image.width, image.height, image.step) == (16, 8, 2)


def test_tensorboard_logger_without_tensorboard_is_a_warned_noop(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.warns(RuntimeWarning, match="tensorboard is not installed"):
        tb = plots.TensorBoardLogger(tmp_path / "tb")
    assert not tb.enabled
    tb.log(1, loss=0.1, lr=1e-4)
    tb.image("samples", Image.new("RGB", (4, 4)), 1)
    tb.close()
    assert not (tmp_path / "tb").exists()
    assert not plots.TensorBoardLogger(tmp_path / "off", enabled=False).enabled


def test_sampling_brings_back_only_the_models_that_left_the_training_device(tmp_path):
    """On one GPU accelerate's device is ``cuda`` without an index while a model there reports ``cuda:0``:
    comparing the two with ``!=`` listed every model as away, so a sample grid during training
    (``sampling.every_steps``) sent the VAE and text encoders to the CPU afterwards and the next step failed
    on tensors on two devices."""
    from sdplan.trainer import outputs, runtime, tiny

    assert runtime.same_device(torch.device("cuda:0"), torch.device("cuda"))
    assert runtime.same_device("cuda", "cuda:0") and runtime.same_device("cuda:1", "cuda:1")
    assert not runtime.same_device("cuda:1", "cuda:0")
    assert not runtime.same_device("cpu", "cuda") and not runtime.same_device("cuda:0", "cpu")

    parts = tiny.tiny_sd15_components(tmp_path / "tokenizer")
    vae, te = parts["vae"], parts["text_encoder"]
    assert outputs.models_away(torch.device("cpu"), vae, te) == []
    assert outputs.models_away(torch.device("meta"), vae, te) == [vae, te]


def test_a_grid_an_earlier_session_wrote_is_kept_beside_the_new_one(tmp_path, monkeypatch):
    """A resume on 2 processes numbers its steps anew: its step 40 (80 images) replaced the 1-process grid of
    step 40 (40 images). A grid file older than this session is kept; this session's own is replaced."""
    import os

    from sdplan.trainer import outputs
    from sdplan.trainer.outputs import grid_path

    # a renumbered session (an exact resume trained in this process before left it True: order-dependent)
    monkeypatch.setattr(outputs, "_SAME_STEPS", False)

    old = tmp_path / "step-000040.png"
    old.write_bytes(b"first session")
    os.utime(old, (1_000_000_000, 1_000_000_000))
    assert grid_path(tmp_path, 40) == tmp_path / "step-000040-1.png"
    (tmp_path / "step-000040-1.png").write_bytes(b"this session")  # written now: replaced next time
    assert grid_path(tmp_path, 40) == tmp_path / "step-000040-1.png"
    assert grid_path(tmp_path, 60) == tmp_path / "step-000060.png"


def test_an_exact_resume_writes_over_a_steps_outputs_only_at_the_point_they_record(tmp_path, monkeypatch):
    """The review's S1 (checkpoint at step 6, 12 images), S2 resumed on 2 processes (renumbered: its step 8 is 32
    images; grid and intermediate outputs written, no checkpoint), S3 resumed from S1's checkpoint with S1's
    settings (the same numbering): its step 8 (16 images) wrote over S2's 32-image grid and LoRA. A grid (PNG
    text) and an intermediate folder (.sdplan-point.json) now record their images seen: written over only at
    the same point, else kept beside (-1); one that records nothing: the numbering decides, as before."""
    import os

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo
    from sdplan.trainer import outputs

    monkeypatch.setattr(outputs, "_SAME_STEPS", True)  # S3: an exact resume

    def grid(name: str, images: int | None) -> None:
        info = PngInfo()
        info.add_text("sdplan_samples", json.dumps({} if images is None else {"images_seen": images}))
        Image.new("RGB", (4, 4)).save(tmp_path / "samples" / name, pnginfo=info)
        os.utime(tmp_path / "samples" / name, (1_000_000_000, 1_000_000_000))  # an earlier session's

    def inter(label: str, images: int) -> None:
        (tmp_path / "intermediate" / label).mkdir(parents=True)
        point = {"step": int(label[-8:]), "images_seen": images}
        (tmp_path / "intermediate" / label / ".sdplan-point.json").write_text(json.dumps(point))
        os.utime(tmp_path / "intermediate" / label, (1_000_000_000, 1_000_000_000))

    (tmp_path / "samples").mkdir()
    grid("step-000008.png", 32)  # S2's
    grid("step-000004.png", 8)  # S1's, the same point as S3's step 4
    grid("step-000002.png", None)  # from before the record
    samples = tmp_path / "samples"
    assert outputs.grid_path(samples, 8, 16) == samples / "step-000008-1.png"
    assert outputs.grid_path(samples, 4, 8) == samples / "step-000004.png"
    assert outputs.grid_path(samples, 2, 4) == samples / "step-000002.png"
    grid("step-000008-1.png", 16)  # an earlier S3-like session's: the same point as this one's
    assert outputs.grid_path(samples, 8, 16) == samples / "step-000008-1.png"

    inter("sn-step00000008", 32)
    inter("sn-step00000004", 8)
    root = tmp_path / "intermediate"
    assert outputs.intermediate_folder(root, "sn-step00000008", 16) == root / "sn-step00000008-1"
    assert outputs.intermediate_folder(root, "sn-step00000004", 8) == root / "sn-step00000004"
    assert (
        outputs.point_of(samples / "step-000008.png") == 32
        and outputs.point_of(root / "sn-step00000004") == 8
    )


def test_a_resume_on_a_dataset_of_another_size_numbers_its_steps_anew():
    """samples_per_epoch changed (images added): epoch N ends at other images, so ``name-00000N`` and step N
    are other points of the run, and the earlier sessions' outputs are kept beside."""
    from sdplan.trainer.checkpoint import TrainState, same_numbering

    from sdplan.steps import plan_steps

    saved = TrainState(global_step=3, loss_steps=[1, 2, 3], samples_per_epoch=16)
    assert same_numbering(saved, None, plan_steps(images_per_epoch=16, batch_size=1))
    assert not same_numbering(saved, None, plan_steps(images_per_epoch=20, batch_size=1))
    assert same_numbering(TrainState(loss_steps=[1]), None, plan_steps(images_per_epoch=20, batch_size=1))


def test_outputs_an_earlier_session_saved_at_a_step_are_kept_beside_the_new_ones(tmp_path, monkeypatch):
    """The same for the outputs saved every N steps (intermediate/{name}-step00000040/): a resume on another
    process count wrote its step 40 over the first session's. `train --force` still knows both for the run's."""
    import os

    from sdplan.trainer import outputs

    monkeypatch.setattr(outputs, "_SAME_STEPS", False)  # as above: a renumbered session

    from sdplan.trainer.outputs import INTERMEDIATE_NAME, intermediate_folder

    old = tmp_path / "run-step00000040"
    old.mkdir()
    os.utime(old, (1_000_000_000, 1_000_000_000))
    assert intermediate_folder(tmp_path, "run-step00000040") == tmp_path / "run-step00000040-1"
    (tmp_path / "run-step00000040-1").mkdir()  # this session's: replaced
    assert intermediate_folder(tmp_path, "run-step00000040") == tmp_path / "run-step00000040-1"
    assert intermediate_folder(tmp_path, "run-000002") == tmp_path / "run-000002"
    assert INTERMEDIATE_NAME.fullmatch("run-step00000040-1") and INTERMEDIATE_NAME.fullmatch("run-000002")


def test_tensorboard_steps_are_the_images_seen(monkeypatch):
    """A resume on another process count or batch numbers its steps on another scale: logged by step, TensorBoard
    drew steps 2 and 3 twice, for two points of the run. The x axis is the images seen, as loss.png's."""
    from sdplan.trainer import progress

    logged = []

    class TB:
        enabled = True

        def log(self, step, **scalars):
            logged.append((step, scalars["loss"]))

    class Bar:
        def rate(self, step):
            return 1.0

    class Sched:
        def get_last_lr(self):
            return [1e-4]

    progress.log_step(TB(), Bar(), 3, 0.5, Sched(), images_seen=24)
    assert logged == [(24, 0.5)]


def test_tensorboard_drops_an_earlier_sessions_points_past_where_the_run_restarts(tmp_path):
    """A resume from an older checkpoint, and the out-of-memory retry from the start, logged their points beside
    those the earlier session logged past that point (two losses at one x, the abandoned attempt's kept): the
    log is taken up with SummaryWriter's purge_step, in the images seen its points are at; the checkpoint's own
    point stays."""
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from conftest import tiny_train_config
    from sdplan.trainer import progress
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = tiny_train_config(
        tmp_path / "model", tmp_path / "data", tmp_path / "out", "logging.tensorboard=true"
    )
    main = SimpleNamespace(is_main_process=True)

    def session(images_seen, points):
        with progress.tensorboard(main, cfg, images_seen) as tb:
            for images, loss in points:
                tb.log(images, loss=loss)

    def logged():
        events = EventAccumulator(str(tmp_path / "out" / "logs")).Reload()
        return [(e.step, round(e.value, 3)) for e in events.Scalars("train/loss")]

    session(0, [(2, 1.0), (4, 0.9), (6, 0.8), (8, 0.7)])  # checkpointed at 4 images, went on to 8
    session(4, [(6, 0.5), (8, 0.4)])  # resumed from that checkpoint
    assert logged() == [(2, 1.0), (4, 0.9), (6, 0.5), (8, 0.4)]
    session(0, [(2, 0.3)])  # the out-of-memory retry, from the start (no checkpoint)
    assert logged() == [(2, 0.3)]


def test_grids_show_the_ema_weights_and_the_training_weights_come_back_exactly(tmp_path):
    """With ema.enabled the grids showed the raw weights, never the averaged ones the ema/ export holds.
    diffusers' train_text_to_image swaps the EMA weights in for its validation images (store / copy_to /
    restore): so do the grids, during training and at the end, and the weights training goes on with are the
    same bits after it, a grid that fails included; the PNG says which weights it shows."""
    import contextlib
    from types import SimpleNamespace

    from conftest import tiny_train_config
    from sdplan.trainer import outputs
    from sdplan.trainer.loop import Ema

    class Tiny(torch.nn.Linear):
        config: dict = {}  # what EMAModel keeps to rebuild the model class

    unet = Tiny(4, 4).to(torch.bfloat16)
    ema = Ema(unet, decay=0.9, device="cpu", every=1)  # ema.device cpu: the averages in host RAM
    for average in ema.model.shadow_params:
        average.fill_(0.25)
    before = [p.detach().clone() for p in unet.parameters()]
    seen, fail = [], []

    class Pipe:
        def set_progress_bar_config(self, **_):
            pass

        def __call__(self, **_):
            seen.append(float(unet.weight.float().mean()))
            if fail:
                raise RuntimeError("a pipeline error")
            return SimpleNamespace(images=[Image.new("RGB", (64, 64))])

    class Vae:
        device = torch.device("cpu")

        def decode(self, z):
            return z

    comps = SimpleNamespace(pipeline=lambda unet, text_encoders: Pipe(), family="sd15", vae=Vae())
    accelerator = SimpleNamespace(
        is_main_process=True,
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
        wait_for_everyone=lambda: None,
    )
    cfg = tiny_train_config(tmp_path / "model", tmp_path / "data", tmp_path / "out")

    grid = outputs.samples(accelerator, comps, unet, [], cfg, fallback="a red square", at_step=3, ema=ema)
    assert seen == [0.25]  # the pipeline ran on the averaged weights
    assert all(torch.equal(a, b) for a, b in zip(before, unet.parameters()))
    with Image.open(grid) as im:
        record = json.loads(im.text["sdplan_samples"])
    assert record["weights"] == "ema" and record["labels"] == ["step 3, EMA weights\na red square"]

    fail.append(True)
    failures: list = []
    assert (
        outputs.samples(accelerator, comps, unet, [], cfg, fallback="x", step=4, ema=ema, failures=failures)
        is None
    )
    assert seen[-1] == 0.25 and failures  # skipped, training goes on: on its own weights
    assert all(torch.equal(a, b) for a, b in zip(before, unet.parameters()))

    fail.clear()
    outputs.samples(accelerator, comps, unet, [], cfg, fallback="x", at_step=5, out_path=tmp_path / "raw.png")
    assert seen[-1] != 0.25  # without an EMA: the weights as they train
    with Image.open(tmp_path / "raw.png") as im:
        assert "weights" not in json.loads(im.text["sdplan_samples"])


def test_loss_png_of_a_one_step_run_shows_its_point_on_whole_number_ticks():
    """A one-step run's loss.png drew a line through one point (nothing visible) on ticks 0.96 ... 1.04 images
    seen: few points are drawn as markers too, and whole-number positions get whole-number ticks."""
    fig = plots.loss_figure([2], [0.5], xlabel="images seen")
    ax = fig.axes[0]
    assert ax.lines[0].get_marker() == "o"
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks) and 2 in ticks
    few = plots.loss_figure([2, 4, 6], [0.5, 0.4, 0.3]).axes[0]
    assert few.lines[0].get_marker() == "o"
    assert all(float(t).is_integer() for t in few.get_xticks())
    many = plots.loss_figure(list(range(1, 101)), [1.0] * 100).axes[0]
    assert many.lines[0].get_marker() in (None, "None", "")  # a long run: the line alone


def _fake_run(tmp_path, *overrides, pipe=None, **config):
    """(accelerator, comps, cfg) of a run on the CPU whose pipeline makes blank images: the pieces that sample
    without a model."""
    import contextlib
    from types import SimpleNamespace

    from conftest import tiny_train_config

    class Pipe:
        def set_progress_bar_config(self, **_):
            pass

        def __call__(self, width=64, height=64, **_):
            return SimpleNamespace(images=[Image.new("RGB", (width, height))])

    class Vae:
        device = torch.device("cpu")

        def decode(self, z):
            return z

    comps = SimpleNamespace(
        pipeline=lambda **_: pipe or Pipe(), family="sd15", vae=Vae(), text_encoders=[], tokenizers=[]
    )
    accelerator = SimpleNamespace(
        is_main_process=True,
        device=torch.device("cpu"),
        autocast=contextlib.nullcontext,
        wait_for_everyone=lambda: None,
    )
    cfg = tiny_train_config(tmp_path / "model", tmp_path / "data", tmp_path / "out", *overrides, **config)
    return accelerator, comps, cfg


def test_the_class_images_bar_counts_images_and_a_short_plain_bar_prints_few_lines(
    tmp_path, capsys, monkeypatch
):
    """DreamBooth's class images showed 'class images: step 1/3 loss - 7.05 it/s' (no unit given: a training
    step's bar); and plain (non-TTY) progress printed a line per item when the total was under 40, not the ~20
    lines its docstring says."""
    from sdplan.trainer import progress
    from sdplan.trainer.recipes.dreambooth import _generate_class_images

    monkeypatch.setenv("SDPLAN_PLAIN_PROGRESS", "1")
    accelerator, comps, cfg = _fake_run(
        tmp_path,
        "dreambooth.with_prior_preservation=true",
        "dreambooth.class_prompt=a square",
        "dreambooth.num_class_images=3",
        method="dreambooth",
        lora=False,
    )
    _generate_class_images(accelerator, comps, cfg, tmp_path / "class", {(64, 64): 1})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("class images:")]
    assert lines and lines[-1].startswith("class images: image 3/3 ")
    assert not any("step" in line or "loss" in line for line in lines)
    assert len(list((tmp_path / "class").glob("*.png"))) == 3

    bar = progress.Progress(accelerator, 39, description="cache", unit="sample")
    for i in range(1, 40):
        bar.update(i)
    printed = capsys.readouterr().out.splitlines()
    assert 15 <= len(printed) <= 21 and printed[-1].startswith("cache: sample 39/39")


def test_a_sample_prompt_past_the_text_encoders_tokens_is_said_and_labelled_as_read(tmp_path):
    """A sample prompt past CLIP's 77 tokens was cut without a word, and its grid label kept the prompt's end:
    the part CLIP had dropped. It is said once, as long captions are, and the label shows what was read: its
    start, an ellipsis where it was cut."""
    from sdplan.trainer import outputs
    from sdplan.trainer.conditioning import long_captions_note, read_part
    from sdplan.trainer.loop import _long_prompts
    from sdplan.trainer.tiny import tiny_tokenizer

    tok = tiny_tokenizer(tmp_path / "tok")
    long = "a photo of a red dog " * 20 + "at the end a blue square"
    read = read_part(tok, long)
    assert read.endswith(sampling.ELLIPSIS) and read.startswith("a photo of a red dog")
    words = read.removesuffix(sampling.ELLIPSIS).split(" ")
    assert (
        len(tok(" ".join(words))["input_ids"])
        <= 77
        < len(tok(" ".join(long.split(" ")[: len(words) + 1]))["input_ids"])
    )
    assert read_part(tok, "a photo of a dog") == "a photo of a dog"
    tags = read_part(tok, "red," * 200)  # no space to cut at: the characters read
    assert tags.startswith("red,red,") and tags.endswith(sampling.ELLIPSIS) and len(tags) < 400

    note = long_captions_note(tok, [long, "a dog"], "CLIP", "sample prompt", prompts=True)
    assert note.startswith("1 sample prompt runs past the 77 tokens CLIP reads") and "labels show" in note
    accelerator, comps, cfg = _fake_run(tmp_path, f"sampling.prompts=[{long!r}, 'a dog']")
    comps.tokenizers = [tok]
    assert _long_prompts(cfg.sampling.prompts, comps) == long_captions_note(
        tok, cfg.sampling.prompts, "CLIP", "sample prompt", prompts=True
    )
    grid = outputs.samples(accelerator, comps, None, [], cfg, at_step=3, out_path=tmp_path / "g.png")
    with Image.open(grid) as im:
        record = json.loads(im.text["sdplan_samples"])
    assert record["prompts"] == [long, "a dog"]  # sampled as given (the pipeline cuts it where CLIP stops)
    assert record["labels"] == [f"step 3\n{read}", "step 3\na dog"]

    from PIL import ImageDraw

    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    font = sampling._font(11, read)
    lines = sampling._wrap(draw, font, f"step 3\n{read}", 60, 3)
    assert lines[0] == "step 3" and lines[1].startswith("a photo") and lines[-1].endswith(sampling.ELLIPSIS)
    assert "square" not in " ".join(lines)


def test_sampling_negative_prompt_reaches_the_pipeline_and_the_grid_record(tmp_path):
    """sampling.negative_prompt: the grids had no negative prompt (kohya's sample prompts take one with --n; the
    key was refused as unknown), though sampling.sample_grid takes one. FLUX.1 samples without one: refused."""
    from types import SimpleNamespace

    from sdplan.trainer import flow, outputs

    from sdplan import config

    seen = []

    class Pipe:
        def set_progress_bar_config(self, **_):
            pass

        def __call__(self, width=64, height=64, negative_prompt=None, **_):
            seen.append(negative_prompt)
            return SimpleNamespace(images=[Image.new("RGB", (width, height))])

    accelerator, comps, cfg = _fake_run(
        tmp_path, "sampling.prompts=[a dog]", "sampling.negative_prompt=blurry, lowres", pipe=Pipe()
    )
    grid = outputs.samples(accelerator, comps, None, [], cfg, out_path=tmp_path / "g.png")
    with Image.open(grid) as im:
        assert json.loads(im.text["sdplan_samples"])["negative_prompt"] == "blurry, lowres"
    assert seen == ["blurry, lowres"]
    assert flow.sampling_captions("sd35-medium", ["a dog"], "blurry") == {"a dog", "blurry"}
    flux = config.validate({"sampling": {"negative_prompt": "blurry"}})
    assert config.family_problems(flux, "flux-dev")[0].startswith("sampling.negative_prompt: flux-dev")
    assert config.family_problems(flux, "sd35-medium") == []


def test_review_fixes_of_the_grid_prompts_and_wording(tmp_path):
    """A CJK or emoji prompt under 77 characters can run past CLIP's 77 tokens (byte-level BPE: up to 4 tokens a
    character), so only ASCII skips the tokenizer; a tag caption's grid prompt keeps its tags' own order (shuffled
    tags changed it from grid to grid); a part of an epoch is never said as a whole one."""
    from conftest import make_images
    from sdplan.trainer.conditioning import _shorter_than_tokens
    from sdplan.trainer.data import CaptionedImages
    from sdplan.trainer.dataset_scan import Item
    from sdplan.trainer.runtime import epochs_text

    assert _shorter_than_tokens("a photo of a dog", 77) and not _shorter_than_tokens("一只红色的正方形", 77)
    (image, *_) = sorted(make_images(tmp_path / "d", n=1).glob("*.png"))
    ds = CaptionedImages([Item(image, tags=("sks", "red", "square", "white"))], shuffle_tags=1.0, keep_tags=1)
    plain = set()
    for epoch in range(6):
        ds.set_epoch(epoch)
        plain.add(ds.caption_for(ds.items[0], 0, shuffle=False))
    assert plain == {"sks, red, square, white"}
    assert [epochs_text(x) for x in (1 / 2500, 2999 / 3000, 2.0004, 0.125)] == [
        "0.0004 of an epoch",
        "0.999667 of an epoch",
        "2.0004 epochs",
        "0.125 of an epoch",
    ]
