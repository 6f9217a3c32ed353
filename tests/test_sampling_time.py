"""The time a run spends sampling images besides training (DreamBooth's missing class images, sample grids):
fitted on profiles/sampling.yaml, checked on benchmarks/validation/sampling/, planned into the run's time."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from load_script import load_script
from PIL import Image
from typer.testing import CliRunner

from sdplan import config as C
from sdplan import planner as P
from sdplan.cli import app
from sdplan.errors import ConfigError
from sdplan.profiles import clear_cache, load_profiles, load_sampling
from sdplan.steps import intermediate_steps

ROOT = Path(__file__).resolve().parents[1]
accuracy = load_script("benchmarks/planner_accuracy.py", "planner_accuracy_sampling")


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def test_the_sampling_profile_names_catalog_gpus_and_a_source_for_every_speed(prof):
    assert len(prof.sampling) >= 10
    names = {g.name for g in prof.gpus}
    for p in prof.sampling:
        assert p.gpu in names and "torch2.0" in p.source and p.it_per_s > 0, p.id
    # classifier-free guidance: the denoiser runs at twice the images
    assert P.denoiser_batch(3, True) == 6 and P.denoiser_batch(3, False) == 3
    assert all(p.guidance for p in prof.sampling)  # the docs' pipeline call guides at 7.5


def test_a_sampling_file_with_an_unknown_gpu_or_a_duplicate_id_is_refused(tmp_path, prof):
    point = (
        "  - {id: a, gpu: %s, family: sd15, resolution: 512, images: 1, guidance: true, precision: fp16, "
        "it_per_s: 10, source: s}\n"
    )
    path = tmp_path / "sampling.yaml"
    path.write_text("schema_version: 1\npoints:\n" + point % "'RTX 4090'" + point % "'RTX 9999'")
    with pytest.raises(ConfigError) as e:
        load_sampling(path, prof.gpus)
    assert "duplicate 'a'" in str(e.value) and "'RTX 9999' is not a catalog name" in str(e.value)


def test_the_fit_recovers_the_efficiency_and_floor_it_was_made_with():
    """Steps made from a known floor, a shared efficiency and one architecture's own: the fit finds them (to its
    grid's 3%), and leaves an architecture with one bandwidth-bound step on the one fitted on all."""
    floor, shared, own = 0.03, 0.1, 0.2
    rows = []
    for i, (arch, eff) in enumerate((("a", shared), ("b", shared), ("c", own))):
        for n in (2, 8, 32):
            bandwidth = 0.001 * n * (1 + i)  # n=2 of a and b floor-bound
            seconds = max(floor, bandwidth / eff)
            rows.append(P.SamplingRow(f"{arch}{n}", arch, arch, bandwidth * 0.2, bandwidth, seconds))
    rows.append(P.SamplingRow("d2", "d", "d", 0.0, 0.05, 0.05 / shared))  # one step: no efficiency of its own
    fit = P.fit_sampling(rows)
    assert fit.floor_s == pytest.approx(floor)
    by = dict(fit.by_arch)
    assert by["a"] == pytest.approx(shared, rel=0.03) and by["c"] == pytest.approx(own, rel=0.03)
    assert "d" not in by and shared < fit.efficiency < own  # d takes the one fitted on every GPU's steps
    assert all(fit.predicted(r) == pytest.approx(r.seconds, rel=0.03) for r in rows[:-1])
    assert P.fit_sampling([]).efficiency is None


def test_guidance_runs_the_unet_twice_a_step_but_not_flux(prof):
    """Classifier-free guidance (the UNet families at the trainer's 7.5, SD3.5 too) doubles the denoiser's batch;
    FLUX.1's guidance is an embedding, whatever the scale; a scale of 1 turns it off."""
    assert P.uses_guidance("sdxl", None) and P.uses_guidance("sd35-medium", None)
    assert not P.uses_guidance("sdxl", 1.0)
    assert not P.uses_guidance("flux-dev", 7.5) and not P.uses_guidance("flux-dev", None)
    cal = P.calibrate(prof)
    t4 = prof.find_gpu("T4")  # SDXL at 1024 on a T4: bandwidth-bound, the floor far under the step
    s = P.Settings(method="lora", model="sdxl", resolution=1024, precision="fp16")
    step = P.denoise_step_seconds(prof, "sdxl", 128 * 128, "fp16", 2, t4, cal)
    assert step > cal.sampling.floor_s
    off, on = (P.image_seconds(prof, s, t4, cal, 20, g) for g in (1.0, None))
    assert on - off == pytest.approx(20 * step / 2, rel=0.01)  # the steps at twice the batch (+ a text pass)
    assert P.image_seconds(prof, s, t4, cal, 40, None) - on == pytest.approx(
        20 * step
    )  # sampling_steps counts
    assert P.image_seconds(prof, s, None, cal, 20, None) is None  # no GPU: the time is not known


def test_the_vae_decodes_in_the_trainers_dtype_at_its_convolution_rate(prof):
    """fp16 training decodes in fp32 (trainer/runtime.py vae_dtype), bf16 in bf16; fp32 convolutions run as TF32
    on Ampere and later (cuDNN's default), at the fp32 rate before."""
    a100, v100 = prof.find_gpu("A100 SXM 80GB"), prof.find_gpu("V100 PCIe 16GB")
    assert P.decode_tflops(a100, "fp32") == a100.matmul_tflops("fp16") / 2
    assert P.decode_tflops(v100, "fp32") == v100.matmul_tflops("fp32") < v100.matmul_tflops("fp16") / 2
    cal = P.calibrate(prof)
    kw = dict(images=1, steps=20, guided=True)
    half = P.pipeline_seconds(prof, "sd15", 4096, "fp16", v100, cal, vae_precision="fp16", **kw)
    full = P.pipeline_seconds(prof, "sd15", 4096, "fp16", v100, cal, vae_precision="fp32", **kw)
    flops = prof.activations.vae_decode_flops("sd15", 4096) / cal.efficiency_for(v100) / 1e12
    want = flops / v100.matmul_tflops("fp32") - flops / v100.matmul_tflops("fp16")
    assert full - half == pytest.approx(want)
    s16 = P.Settings(method="lora", model="sd15", resolution=512, precision="fp16")
    assert P.image_seconds(prof, s16, v100, cal, 20, None) == pytest.approx(full)


def test_a_batch_is_one_prompt_encoding_and_a_decode_per_image(prof):
    """The validation's end-to-end times and a plan's images are one composition (pipeline_seconds): a batch of
    4 takes 4 decodes and the prompt's two text passes once."""
    cal, gpu = P.calibrate(prof), prof.find_gpu("RTX 4090")
    kw = dict(steps=30, guided=True, vae_precision="fp16")
    one, four = (P.pipeline_seconds(prof, "sd15", 4096, "fp16", gpu, cal, images=n, **kw) for n in (1, 4))
    step1, step4 = (P.denoise_step_seconds(prof, "sd15", 4096, "fp16", n, gpu, cal) for n in (2, 8))
    rate = gpu.matmul_tflops("fp16") * 1e12 * cal.efficiency_for(gpu)
    decode = prof.activations.vae_decode_flops("sd15", 4096) / rate
    assert four - 30 * step4 == pytest.approx(one - 30 * step1 + 3 * decode)
    point = dict(gpu="RTX 4090", family="sd15", width=512, height=512, images=4, guidance=True)
    point.update(precision="fp16", attention="efficient", timing="end-to-end", steps=30)
    assert accuracy.predict_sampling_it_s(prof, cal, point) == pytest.approx(30 / four)


def test_the_run_samples_its_missing_class_images_and_each_grid(prof):
    steps = P.plan(
        P.hardware_from_catalog(prof.find_gpu("RTX 4090")), prof, P.Request(method="lora", model="sd15")
    ).steps
    req = P.Request(
        method="dreambooth",
        prior_preservation=True,
        class_images=100,
        class_images_to_generate=40,
        sample_prompts=4,
        sample_every_steps=10,
    )
    # every 10 steps but the last (the final grid shows its weights: trainer/loop.py)
    assert P.sampled_images(req, steps) == (40, 4, (steps.total_steps - 1) // 10 * 4, 0)
    no_prior = P.Request(method="dreambooth", class_images=100, class_images_to_generate=40)
    assert P.sampled_images(no_prior, steps) == (0, 1, 0, 0)  # the final grid of one caption
    # a grid at each intermediate save, with prompts (trainer/loop.py), at the saves the loop makes
    saves = P.Request(method="lora", sample_prompts=3, save_every_epochs=2, save_every_steps=7)
    at = intermediate_steps(
        total_steps=steps.total_steps, steps_per_epoch=steps.steps_per_epoch, every_epochs=2, every_steps=7
    )
    assert at and P.sampled_images(saves, steps) == (0, 3, 0, 3 * len(at))
    # no prompts: each save's grid shows a caption, as the final grid does (trainer/loop.py save_intermediate)
    at2 = intermediate_steps(
        total_steps=steps.total_steps, steps_per_epoch=steps.steps_per_epoch, every_epochs=2, every_steps=0
    )
    assert P.sampled_images(P.Request(method="lora", save_every_epochs=2), steps).at_saves == len(at2)


def _png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8)).save(path)


def test_planned_sampling_counts_the_class_folder_as_the_trainer_does(tmp_path):
    cfg = C.TrainConfig(method="dreambooth")
    cfg.dreambooth.with_prior_preservation = True
    cfg.dreambooth.num_class_images = 5
    cfg.output.dir = str(tmp_path / "out")
    assert C.planned_sampling(cfg)["class_images_to_generate"] == 5  # output/class_images: not there yet
    for i in range(3):
        _png(tmp_path / "out" / "class_images" / f"c{i}.png")
    assert C.planned_sampling(cfg)["class_images_to_generate"] == 2
    cfg.dreambooth.class_data = str(tmp_path / "mine")
    for i in range(7):
        _png(tmp_path / "mine" / f"c{i}.png")
    cfg.sampling.prompts, cfg.sampling.every_steps, cfg.sampling.num_inference_steps = ["a", "b"], 25, 30
    cfg.output.save_every_n_epochs = 3
    assert C.planned_sampling(cfg) == {
        "class_images_to_generate": 0,
        "sample_prompts": 2,
        "sample_every_steps": 25,
        "sampling_steps": 30,
        "guidance_scale": None,
        "save_every_epochs": 3,
        "save_every_steps": 0,
    }
    # a file, a folder the trainer cannot read (bad metadata), an unknown ~user: planned as all generated (the
    # trainer says what is wrong)
    _png(tmp_path / "a-file.png")
    (tmp_path / "bad-json").mkdir()
    (tmp_path / "bad-json" / "meta.json").write_text("{not json")
    for broken in (tmp_path / "a-file.png", tmp_path / "bad-json", "~nosuchuser-sdplan/x"):
        cfg.dreambooth.class_data = str(broken)
        assert C.planned_sampling(cfg)["class_images_to_generate"] == 5, broken
    cfg.dreambooth.with_prior_preservation = False
    assert C.planned_sampling(cfg)["class_images_to_generate"] == 0


def test_a_dreambooth_plan_charges_its_class_images_to_the_run_and_says_so(prof):
    hw = P.hardware_from_catalog(prof.find_gpu("RTX 3060 12GB"))
    base = dict(method="dreambooth", model="sd15", prior_preservation=True, class_images=100)
    none = P.plan(hw, prof, P.Request(**base, class_images_to_generate=0))
    some = P.plan(hw, prof, P.Request(**base, class_images_to_generate=100))
    assert none.plan == some.plan
    one = P.image_seconds(prof, some.plan, prof.find_gpu("RTX 3060 12GB"), P.calibrate(prof), 20, None)
    assert some.sampling_seconds - none.sampling_seconds == pytest.approx(100 * one)
    assert some.seconds - none.seconds == pytest.approx(100 * one)
    lo, hi = prof.uncertainty.sampling_seconds
    grown = [b - a for a, b in zip(none.seconds_range, some.seconds_range, strict=True)]
    assert grown == pytest.approx([100 * one * lo, 100 * one * hi])
    assert any("sampling: 100 class images the class folder lacks" in r for r in some.reasons)
    assert not any(r.startswith("sampling:") for r in none.reasons)  # the final grid alone: too small to name
    assert P.result_dict(some)["estimate"]["sampling_seconds"] == round(some.sampling_seconds, 1)


def test_recommend_out_counts_the_class_folder_of_the_run_it_writes(tmp_path, monkeypatch):
    """--out DIR: the run trains into DIR, so its class images are DIR/class_images, not ./output's."""
    monkeypatch.chdir(tmp_path)
    for i in range(100):
        _png(tmp_path / "output" / "class_images" / f"c{i}.png")
    args = ["recommend", "--method", "dreambooth", "--model", "sd15", "--hardware", "RTX 3060 12GB"]
    args += ["--json", "dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a dog"]
    here = CliRunner().invoke(app, args)
    there = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert here.exit_code == 0 and there.exit_code == 0, here.output + there.output
    assert not any("class folder lacks" in line for line in json.loads(here.stdout)["reasons"])
    lines = json.loads(there.stdout)["reasons"]
    assert any("100 class images the class folder lacks" in line for line in lines)


def test_recommend_counts_the_class_folder_it_is_given(tmp_path):
    folder = tmp_path / "dogs"
    for i in range(4):
        _png(folder / f"d{i}.png")
    runner = CliRunner()
    common = [
        "recommend",
        "--method",
        "dreambooth",
        "--model",
        "sd15",
        "--hardware",
        "RTX 3060 12GB",
        "--json",
    ]
    pins = ["dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a dog"]
    out = {}
    for n in (4, 104):
        r = runner.invoke(
            app, [*common, *pins, f"dreambooth.class_data={folder}", f"dreambooth.num_class_images={n}"]
        )
        assert r.exit_code == 0, r.output
        out[n] = json.loads(r.stdout)
    assert out[4]["estimate"]["sampling_seconds"] < out[104]["estimate"]["sampling_seconds"]
    assert any("100 class images the class folder lacks" in line for line in out[104]["reasons"])
    assert not any("class folder lacks" in line for line in out[4]["reasons"])


def test_the_sampling_validation_shares_no_document_with_the_calibration(prof):
    points = accuracy.load_sampling_validation()
    assert len(points) >= 20 and len({p["url"].split("#")[0] for p in points}) >= 6
    assert not any("torch2.0" in p["url"] for p in points)
    # the calibration's one document (profiles/sampling.yaml's header and every point's source)
    calibration = (ROOT / "profiles" / "sampling.yaml").read_text()
    assert "docs/source/en/optimization/torch2.0.mdx" in calibration
    assert all("torch2.0" in p.source for p in prof.sampling)


def test_planner_accuracy_reports_the_sampling_figures(prof):
    result = accuracy.sampling_out_of_sample(prof, accuracy.load_sampling_validation())
    summary = result["summary"]
    assert summary["all"]["n"] == len(result["figures"]) >= 20
    assert all(math.isfinite(r["error_pct"]) for r in result["figures"])
    assert {x["id"] for x in result["excluded"]} >= {
        "lambda-a10-sd14-b1-naive",
        "stablefast-h100-sd15-vanilla",
    }
    fit = accuracy.sampling_fit(prof)
    assert fit["summary"]["in_sample"]["n"] == fit["summary"]["each_gpu_left_out"]["n"] == len(prof.sampling)


def test_compare_says_its_times_include_the_class_images():
    args = ["recommend", "--method", "dreambooth", "--model", "sd15", "--compare", "RTX 3060 12GB,RTX 4090"]
    r = CliRunner().invoke(
        app, [*args, "dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a dog"]
    )
    assert r.exit_code == 0, r.output
    assert "; each includes 100 class images generated first" in " ".join(r.output.split())


def test_the_run_summary_says_how_much_of_its_time_was_sampling():
    """The trainer records the seconds it spent sampling (class images, grids) in run_summary.json: what the
    plan's sampling time predicts, and what `sdplan train` says at the end."""
    from sdplan.launcher import render_summary

    summary = {
        "steps": 10,
        "images_seen": 40,
        "num_processes": 1,
        "wall_seconds": 300.0,
        "sampling_seconds": 181.2,
    }
    assert (
        render_summary(summary)[0]
        == "done: 10 steps, 40 images seen on 1 process, 300.0 s (sampling 181.2 s of it)"
    )
    summary["sampling_seconds"] = 0.2  # a tiny model's grid: not worth a word
    assert render_summary(summary)[0].endswith(", 300.0 s")
    del summary["sampling_seconds"]  # a summary written before it was recorded
    assert render_summary(summary)[0].endswith(", 300.0 s")


def test_the_sampling_line_names_each_cause_with_its_own_count(prof):
    hw = P.hardware_from_catalog(prof.find_gpu("RTX 4090"))
    every = P.plan(
        hw, prof, P.Request(method="lora", model="sdxl", images=40, max_steps=50, sample_every_steps=7)
    )
    line = next(r for r in every.reasons if r.startswith("sampling:"))
    grids = sum(1 for step in range(1, every.steps.total_steps) if step % 7 == 0)  # as trainer/loop.py
    assert f"{grids} grid images ({grids} grids of 1 image, one every 7 steps)" in line, line
    # a grid at each save, with prompts, named by the setting that saves during the run (not one past its end)
    saves = P.Request(
        method="lora", model="sdxl", images=40, sample_prompts=2, save_every_epochs=999, save_every_steps=5
    )
    res = P.plan(hw, prof, saves)
    line = next(r for r in res.reasons if r.startswith("sampling:"))
    n = sum(1 for step in range(1, res.steps.total_steps) if step % 5 == 0)  # the loop's saves before the end
    assert (
        f"{2 * n} grid images ({n} grids of 2 images, at the saves of output.save_every_n_steps=5)," in line
    )
    assert "epochs" not in line, line
    # no prompts: the saves' grids show a caption, as the trainer draws them (they were left out)
    caption = P.plan(hw, prof, replace(saves, sample_prompts=0))
    line = next(r for r in caption.reasons if r.startswith("sampling:"))
    assert f"{n} grid images ({n} grids of 1 image, at the saves of output.save_every_n_steps=5)," in line
    line = next(
        r
        for r in P.plan(hw, prof, replace(saves, sample_prompts=0, sample_every_steps=5)).reasons
        if r.startswith("sampling:")
    )
    assert f"one every 5 steps; {n} saves at those steps copy them)" in line, line
    # a save on a step with an every-N grid copies that grid: counted once, and the line says so
    both = replace(saves, sample_every_steps=5, save_every_epochs=0)
    res = P.plan(hw, prof, both)
    line = next(r for r in res.reasons if r.startswith("sampling:"))
    assert (
        f"{2 * n} grid images ({n} grids of 2 images, one every 5 steps; {n} saves at those steps copy them)"
        in (line)
    )
    assert "at the saves" not in line and P.sampled_images(both, res.steps).at_saves == 0
    # the saves named are those that sample: epoch saves on every-N steps only copy
    first = P.plan(hw, prof, replace(saves, save_every_steps=0, save_every_epochs=0)).steps
    epoch = first.steps_per_epoch
    mixed = replace(saves, sample_every_steps=epoch, save_every_epochs=1, save_every_steps=epoch * 2 + 1)
    res = P.plan(hw, prof, mixed)
    assert res.steps.steps_per_epoch == epoch and res.steps.total_steps > 2 * epoch + 1
    line = next(r for r in res.reasons if r.startswith("sampling:"))
    assert "at the saves of output.save_every_n_steps=" in line and "save_every_n_epochs" not in line, line
    # one save on an every-N step copies "it"
    one = replace(
        saves, sample_every_steps=res.steps.total_steps - 1, save_every_epochs=0, save_every_steps=0
    )
    one = replace(one, save_every_steps=res.steps.total_steps - 1)
    line = next(r for r in P.plan(hw, prof, one).reasons if r.startswith("sampling:"))
    assert "1 save at those steps copies it)" in line, line


def test_the_multi_gpu_lines_name_the_one_off_sampling_that_is_there(prof):
    """The class images and final grid are sampled on the first process alone, whatever the GPU count: the gain
    leaves them out, and the line gives the speed-up without them beside the whole run's, in the words of what
    the run has. Under a pinned max_steps the runs see other images: one GPU's training time is scaled to the
    plan's images (a class image's fixed seconds spread per image made a run 4% slower by the clock 1.83x)."""

    def speedups(res) -> tuple[float, float]:
        """(whole run, without the one-off sampling) as the plan computes them: checked against independent
        one-GPU runs in test_vs_one_gpu_under_pinned_steps_is_one_gpu_training_the_plans_images."""
        one = next(c for c in res.alternatives if c.setup.num_gpus == 1)
        best = next(c for c in res.alternatives if c.setup == res.plan)
        return P.speedup(best, one), P.speedup(best, one, with_once=False)

    pin = (("num_gpus", 2),)
    prompts = P.Request(
        method="lora", model="sd15", images=50, sample_prompts=8, sampling_steps=150, pins=pin
    )
    res = P.plan(P.hardware_from_catalog(prof.find_gpu("RTX 4090"), 2), prof, prompts)
    line = next(r for r in res.reasons if r.startswith("2 GPUs: each step"))
    whole, rest = speedups(res)
    assert f"once steps are normalised the run is {P.speed_ratio_text(whole)}" in line, line
    assert f"({P.speed_ratio_text(rest)} without the final grid, which is sampled" in line, line
    assert "class images" not in " ".join(res.reasons)
    h100s = P.hardware_from_catalog(prof.find_gpu("H100 SXM"), 2)
    for steps in (None, 30):
        dogs = P.Request(
            method="dreambooth",
            model="sdxl",
            prior_preservation=True,
            class_images=1000,
            class_images_to_generate=1000,
            max_steps=steps,
            pins=pin,
        )
        res = P.plan(h100s, prof, dogs)
        one = next(c for c in res.alternatives if c.setup.num_gpus == 1)
        assert (one.steps.images_seen != res.steps.images_seen) == (steps is not None)  # what the case tests
        line = next(r for r in res.reasons if r.startswith("2 GPUs: each step"))
        whole, rest = speedups(res)
        head = "for the images it sees, the run is" if steps else "once steps are normalised the run is"
        assert f"{head} {P.speed_ratio_text(whole)}" in line, line
        assert res.speedup_vs_one_gpu == pytest.approx(whole)
        want = f"({P.speed_ratio_text(rest)} without the class images and final grid, which are sampled"
        assert want in line, line


@pytest.mark.parametrize(
    "method, model, gpu, n, images, class_images",
    [("lora", "sd15", "H100 SXM", 8, 40, 0), ("dreambooth", "sdxl", "H100 SXM", 2, 40, 1000)],
)
def test_vs_one_gpu_under_pinned_steps_is_one_gpu_training_the_plans_images(
    prof, method, model, gpu, n, images, class_images
):
    """A pinned training.max_steps makes each GPU count see its own images. "vs one GPU" is one GPU training
    the plan's images, checked against that run planned on its own (its batch, max_steps for about as many
    images): fixed seconds (start-up, latent caching, class images) spread per image said 4.36x slower for a
    run 1.01x faster by the clock (LoRA on 8x H100), 1.83x slower for one about as fast (1000 class images)."""
    prior = dict(prior_preservation=True, class_images=class_images, class_images_to_generate=class_images)
    extra = prior if class_images else {}
    base = dict(method=method, model=model, images=images, max_steps=30, **extra)
    res = P.plan(
        P.hardware_from_catalog(prof.find_gpu(gpu), n), prof, P.Request(**base, pins=(("num_gpus", n),))
    )
    one = next(c for c in res.alternatives if c.setup.num_gpus == 1)
    assert one.steps.images_seen != res.steps.images_seen  # what the case tests
    steps = round(one.steps.total_steps * res.steps.images_seen / one.steps.images_seen)  # epochs end short
    pins = (("num_gpus", 1), ("batch", one.setup.batch), ("grad_accum", one.setup.grad_accum))
    alone = P.plan(
        P.hardware_from_catalog(prof.find_gpu(gpu)),
        prof,
        P.Request(**{**base, "max_steps": steps}, pins=pins),
    )
    assert alone.steps.images_seen == pytest.approx(res.steps.images_seen, rel=0.05)
    assert res.speedup_vs_one_gpu == pytest.approx(alone.seconds / res.seconds, rel=0.05)
