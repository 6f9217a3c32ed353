"""Issue 10: one setting generator, `key=value` pins in `sdplan recommend`, unknown-speed GPUs, measured
multi-GPU evidence over the all-reduce model."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sdplan import planner as P
from sdplan.cli import app
from sdplan.profiles import clear_cache, load_profiles

ROOT = Path(__file__).resolve().parents[1]
MACHINES = ROOT / "tests" / "fixtures" / "machines"
runner = CliRunner()


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def run(*args: str):
    return runner.invoke(app, ["recommend", *args])


def _plan_for(method: str, model: str, hardware: str, *args: str):
    """`sdplan recommend --method M --model F --hardware H ARGS`."""
    return run("--method", method, "--model", model, "--hardware", hardware, *args)


def _catalog(prof, name: str, count: int = 1) -> P.Hardware:
    return P.hardware_from_catalog(prof.find_gpu(name), count)


# -- one generator ----------------------------------------------------------------------------------------


def test_needs_at_least_is_the_leanest_configuration_of_the_search(prof):
    hw = _catalog(prof, "RTX 2060 6GB")
    req = P.Request(method="finetune", model="sdxl")
    res = P.plan(hw, prof, req)
    assert not res.feasible
    space = list(
        P.settings_space(replace(req, resolution=1024), precision="fp16", attention="efficient", max_gpus=1)
    )
    leanest = min(P.memory(prof, s).peak for s in space)
    assert any(s.full_half_weights for s in space) is False  # fp16 card: no full bf16 weights to try
    # the verdict's rule: the estimate within 92% of the card and the likely peak's upper end within it
    hi = prof.uncertainty.peak_for("sdxl")[0][1]
    assert res.needs["min_vram_bytes"] == math.ceil(max(leanest / P.HEADROOM, leanest * hi))
    assert res.memory.peak == pytest.approx(leanest)
    assert P.min_vram_needed(req, prof, precision="fp16") == res.needs["min_vram_bytes"]
    # on a bf16 card the same figure includes full bf16 weights, as the search does
    bf16 = P.min_vram_needed(req, prof, precision="bf16")
    bf16_space = P.settings_space(replace(req, resolution=1024), precision="bf16", attention="efficient")
    bf16_leanest = min(P.memory(prof, s).peak for s in bf16_space)
    assert bf16 == math.ceil(max(bf16_leanest / P.HEADROOM, bf16_leanest * hi))


def test_needs_at_least_also_says_from_where_a_plan_is_given_that_may_run_out(prof):
    """ "needs at least 8.9 GiB" on a 6 GB card (the fit rule: the estimate within 92% and the likely upper end
    within the card), while a 8 GB GTX 1070 got a plan, flagged "may not fit": the smaller figure, where the
    estimate alone fits, is said beside it (and is not the suggestion list's rule)."""
    res = P.plan(_catalog(prof, "GTX 1060 6GB"), prof, P.Request(method="lora", model="sdxl"))
    need, risky = res.needs["min_vram_bytes"], res.needs["min_vram_bytes_may_run_out"]
    assert not res.feasible and risky < need
    space = P.settings_space(replace(res.request, resolution=1024), precision="fp16", attention="efficient")
    assert risky == min(math.ceil(P.memory(prof, s).peak / P.HEADROOM) for s in space)
    gtx1070 = P.plan(_catalog(prof, "GTX 1070"), prof, P.Request(method="lora", model="sdxl"))
    assert gtx1070.feasible and risky <= gtx1070.hardware.gpus[0].memory_bytes < need


def test_a_pinned_adafactor_is_never_planned_with_the_optimizer_offloaded(prof):
    """accelerate runs DeepSpeed's CPU Adam in place of any optimizer that is offloaded: an Adafactor plan with
    the offload trained with Adam (sdplan.config refuses the pair). Sharded on the GPUs, it stays Adafactor."""
    req = P.Request(method="finetune", model="sdxl", pins=(("optimizer", "adafactor"),))
    space = list(
        P.settings_space(replace(req, resolution=1024), precision="bf16", attention="efficient", max_gpus=2)
    )
    assert all(s.optimizer == "adafactor" for s in space)
    assert not any(s.offload for s in space) and any(s.sharded for s in space)


def test_sdxl_lora_fits_an_8gb_card_with_cached_text_encoder_outputs(prof):
    # kohya-ss/sd-scripts docs/train_SDXL-en.md: SDXL LoRA "can be done with 8GB GPU memory" with cached
    # text-encoder outputs and latents, gradient checkpointing and a low dim
    res = P.plan(_catalog(prof, "RTX 3070"), prof, P.Request(method="lora", model="sdxl"))
    assert res.feasible and res.plan.cache_text_encoder_outputs and res.plan.cache_latents
    assert any("text-encoder outputs cached" in r for r in res.reasons)
    # where it is not needed, captions stay live (no caching by default)
    big = P.plan(_catalog(prof, "H100 SXM"), prof, P.Request(method="lora", model="sd15"))
    assert not big.plan.cache_text_encoder_outputs


def test_a_lower_rank_only_when_the_requested_one_fits_nowhere_and_the_reason_says_so(prof):
    req = P.Request(method="lora", model="sdxl", resolution=1024)
    hw = _catalog(prof, "RTX 3070")
    lean = {
        rank: min(
            P.memory(prof, s).peak
            for s in P.settings_space(
                replace(req, pins=(("lora_rank", rank),)), precision="bf16", attention="efficient"
            )
        )
        for rank in (16, 4)
    }
    assert lean[4] < lean[16]
    vram = int((lean[4] + lean[16]) / 2 / P.HEADROOM)
    gpu = replace(hw.gpus[0], memory_bytes=vram)
    tight = replace(hw, gpus=(gpu,))
    res = P.plan(tight, prof, req)
    assert res.feasible and res.plan.lora_rank < 16
    assert any("instead of the requested 16" in r and "changes the result" in r for r in res.reasons)
    pinned = P.plan(tight, prof, replace(req, pins=(("lora_rank", 16),)))
    assert not pinned.feasible
    # with room to spare the requested rank is kept
    assert P.plan(hw, prof, P.Request(method="lora", model="sd15")).plan.lora_rank == 16


# -- pins -------------------------------------------------------------------------------------------------


def test_pins_are_planned_around_and_reach_json_and_config(tmp_path):
    r = run(
        "--method", "lora", "--hardware", "RTX 4090", "--json",
        "training.batch_size=2", "lora.rank=64", "memory.optimizer=adafactor", "training.learning_rate=5e-5",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (
        d["plan"]["batch_size"] == 2
        and d["plan"]["lora_rank"] == 64
        and d["plan"]["optimizer"] == "adafactor"
    )
    assert d["request"]["pins"] == {
        "training.batch_size": 2,
        "lora.rank": 64,
        "memory.optimizer": "adafactor",
    }
    cfg = d["config"]
    assert cfg["training"]["batch_size"] == 2 and cfg["lora"]["rank"] == 64
    assert cfg["training"]["learning_rate"] == 5e-5  # the number (YAML 1.1 read the 5e-5 given as text)
    assert d["settings"]["batch"] == 2 and d["settings"]["full_half_weights"] is False
    out = tmp_path / "plan"
    w = run(
        "--method",
        "lora",
        "--hardware",
        "RTX 4090",
        "--out",
        str(out),
        "training.batch_size=2",
        "lora.rank=64",
    )
    assert w.exit_code == 0, w.output
    written = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert written["training"]["batch_size"] == 2 and written["lora"]["rank"] == 64


def test_a_pin_that_cannot_fit_says_by_how_much_and_what_to_change(prof):
    req = P.Request(
        method="lora",
        model="sdxl",
        pins=(("batch", 16), ("gradient_checkpointing", False)),
    )
    res = P.plan(_catalog(prof, "RTX 4090"), prof, req)
    assert not res.feasible
    text = " ".join(res.reasons)
    assert "training.batch_size=16" in text and "likely" in text and "RTX 4090 24.0 GiB" in text
    assert "fits when changed" in text and "memory.gradient_checkpointing=true fits" in text
    assert "training.batch_size=" in text.split("fits when changed")[1]
    assert res.needs["min_vram_bytes"] > 24 * 2**30


def test_an_ema_on_the_gpu_that_cannot_fit_is_offered_on_the_cpu_first(prof):
    """An SDXL fine-tune with its EMA pinned on a 12 GB card's GPU: the refusal offered ema.enabled=false, though
    the EMA kept in host RAM fits and keeps what the user asked for."""
    req = P.Request(method="finetune", model="sdxl", pins=(("ema", "gpu"),))
    res = P.plan(_catalog(prof, "RTX 3060 12GB"), prof, req)
    relax = next(r for r in res.reasons if r.startswith("fits when changed: "))
    assert not res.feasible and "ema.enabled=true, ema.device=cpu fits" in relax, relax


def test_two_pins_that_only_fit_when_both_change_say_so(prof):
    """On a 12 GB card neither pin alone can be freed to fit (batch 16 does not fit with checkpointing, nor
    batch 1 without it at 1024 px... both must change): no "what to change" was said at all."""
    req = P.Request(method="lora", model="sdxl", pins=(("batch", 16), ("gradient_checkpointing", False)))
    res = P.plan(_catalog(prof, "RTX 3060 12GB"), prof, req)
    assert not res.feasible
    relax = next(r for r in res.reasons if r.startswith("fits when changed: "))
    assert (
        "memory.gradient_checkpointing=true" in relax
        and "training.batch_size=" in relax
        and "fit together" in relax
    )


@pytest.mark.parametrize(
    "pin, needle",
    [
        ("training.batch_sise=4", "unknown key"),
        ("training.batch_size=four", "must be an integer"),
        ("training.batch_size=0", "must be >= 1"),
        ("memory.optimizer=sgd", "must be one of"),
        ("training.precision=bf16", "no bf16"),
        ("distributed.num_processes=2", "1 usable GPU"),
        ("method=dreambooth", "--method"),
        ("batch", "key=value"),
        ("memory.cache_text_encoder_outputs=true", "cannot cache"),
    ],
)
def test_bad_pins_are_one_clear_line(pin, needle):
    extra = ["training.train_text_encoder=true"] if "cache_text" in pin else []
    r = run("--method", "lora", "--hardware", "T4", pin, *extra)
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


@pytest.mark.parametrize("method", ["dreambooth", "finetune", "textual-inversion"])
def test_a_lora_pin_on_another_method_is_refused_as_train_refuses_it(tmp_path, method):
    """`--method dreambooth lora.rank=64` planned without the rank (no "pinned:" line, no warning) and --out
    wrote it to sdplan.yaml, where the trainer ignores it; ema.enabled=true on a method that keeps no EMA was
    already refused. Both are one line, exit 2, nothing written; `sdplan train` says the same (one rule)."""
    from conftest import fake_diffusers_folder, make_images, one_line_error

    out = tmp_path / "plan"
    said = []
    for pins in (("lora.rank=64",), ("lora.alpha=8", "lora.target_modules=[to_q]")):
        r = _plan_for(method, "sd15", "RTX 4090", *pins, "--out", str(out))
        said.append(one_line_error(r, 2, pins[0].split("=")[0], "lora.*", f"not {method}", "--method lora"))
        assert not out.exists()
    compared = run("--method", method, "--compare", "T4,RTX 4090", "lora.rank=64")
    one_line_error(compared, 2, "lora.rank", "--method lora")
    ema = _plan_for("lora" if method == "finetune" else method, "sd15", "RTX 4090", "ema.enabled=true")
    assert ema.exit_code == 2 and "Traceback" not in ema.output
    ds = make_images(tmp_path / "ds", n=2)
    model = fake_diffusers_folder(tmp_path / "model")
    trained = runner.invoke(
        app,
        ["train", "--method", method, "--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / "run"),
         "--device", "cpu", "--dry-run", "lora.rank=64"],
    )  # fmt: skip
    assert one_line_error(trained, 2, "lora.rank") == said[0]
    # the LoRA method keeps its pin; a textual-inversion setting on a LoRA is the same error
    assert "pinned: lora.rank=64" in _plan_for("lora", "sd15", "RTX 4090", "lora.rank=64").stdout
    one_line_error(
        _plan_for("lora", "sd15", "RTX 4090", "textual_inversion.num_vectors=4"),
        2,
        "textual_inversion.num_vectors",
        "--method textual-inversion",
    )


@pytest.mark.parametrize(
    "method, pins, needle",
    [
        (
            "finetune",
            ("ema.device=gpu",),
            "ema.device: acts only with ema.enabled=true, which is off; add",
        ),
        (
            "finetune",
            ("ema.enabled=false", "ema.decay=0.99", "ema.update_every=4"),
            "ema.decay, ema.update_every: act only with ema.enabled=true, which is set false",
        ),
        ("dreambooth", ("dreambooth.num_class_images=50",), "add dreambooth.with_prior_preservation=true"),
        ("lora", ("training.text_encoder_learning_rate=1e-5",), "add training.train_text_encoder=true"),
        (
            "lora",
            ("memory.cache_latents=false", "memory.cache_latents_to_disk=true"),
            "memory.cache_latents_to_disk: acts only with memory.cache_latents=true, which is set false",
        ),
        (
            "finetune",
            ("ema={device: gpu}",),
            "ema.device: acts only with ema.enabled=true",
        ),  # a whole section
        # a method that never reads them: the fix is to drop them, not to turn on what the method refuses
        ("lora", ("ema.device=cpu",), "ema.device: an EMA of the weights is kept by method"),
        (
            "lora",
            ("dreambooth.class_prompt=dog",),
            "only method dreambooth trains with class images, not lora",
        ),
        (
            "textual-inversion",
            ("training.text_encoder_learning_rate=1e-5",),
            "textual inversion trains only the new token embeddings, at training.learning_rate; drop it",
        ),
    ],
)
def test_a_setting_whose_switch_is_off_is_refused_as_train_refuses_it(tmp_path, method, pins, needle):
    """`ema.device=gpu` alone planned no EMA and said "pinned: ema.enabled=false"; the trainer then kept none.
    A setting that acts only while its switch is on (config.SWITCHED_BY) is one line, exit 2, in recommend and
    train alike; with the switch on it is a pin."""
    from conftest import fake_diffusers_folder, make_images, one_line_error

    said = one_line_error(_plan_for(method, "sd15", "RTX 4090", *pins), 2, needle)
    ds = make_images(tmp_path / "ds", n=2)
    model = fake_diffusers_folder(tmp_path / "model")
    trained = runner.invoke(
        app,
        ["train", "--method", method, "--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / "run"),
         "--device", "cpu", "--dry-run", *pins],
    )  # fmt: skip
    assert one_line_error(trained, 2, needle) == said
    assert not (tmp_path / "run").exists()
    on = "ema.enabled=true" if pins[0].startswith("ema") and method == "finetune" else None
    if on:
        assert (
            "pinned: ema.enabled=true, ema.device=gpu"
            in _plan_for(method, "sd15", "RTX 4090", on, "ema.device=gpu").stdout
        )


def test_latents_cached_to_disk_turn_latent_caching_on():
    """memory.cache_latents_to_disk=true alone turns memory.cache_latents on, as kohya's --cache_latents_to_disk
    does (train_util.verify_training_args), instead of being refused where the planner would cache anyway (or
    dropped where it would not)."""
    r = _plan_for("lora", "sd15", "RTX 4090", "memory.cache_latents_to_disk=true")
    assert r.exit_code == 0 and "pinned: memory.cache_latents=true" in r.stdout, r.output


def test_compare_works_with_pins():
    r = run(
        "--method",
        "lora",
        "--compare",
        "T4,RTX 4090",
        "--json",
        "training.precision=bf16",
        "training.batch_size=4",
    )
    assert r.exit_code == 0, r.output
    t4, rtx = json.loads(r.stdout)
    assert t4["feasible"] is False and any("no bf16" in x for x in t4["reasons"])
    assert rtx["feasible"] and rtx["plan"]["batch_size"] == 4 and rtx["plan"]["precision"] == "bf16"
    human = run("--method", "lora", "--compare", "T4,RTX 4090", "training.precision=bf16")
    assert human.exit_code == 0 and "no bf16" in human.stdout


# -- unknown speed, multi-GPU evidence ------------------------------------------------------------------------


def test_unknown_speed_gpu_picks_the_largest_safe_batch_and_says_unknown(prof):
    hw = _catalog(prof, "RTX 4090")
    gpu = replace(hw.gpus[0], name="NVIDIA Hypothetical X9000", spec=None)
    res = P.plan(replace(hw, gpus=(gpu,), label=gpu.name), prof, P.Request(method="lora", images=40))
    assert res.feasible and res.seconds is None and res.basis == "unknown speed"
    d = P.result_dict(res)
    assert d["estimate"]["basis"] == "unknown speed" and d["estimate"]["seconds_range"] is None
    cands = P._candidates(res.request, prof, res.hardware, P.calibrate(prof), 512)
    safe_no_gc = [c.setup.batch for c in cands if c.safe and not c.setup.gradient_checkpointing]
    assert res.plan.batch == max(safe_no_gc) > 1 and not res.plan.gradient_checkpointing
    assert not any("calibrated" in r for r in res.reasons)


@pytest.mark.parametrize("method", ["dreambooth", "finetune"])
def test_sdxl_full_methods_on_2x4090_pcie_stay_on_one_gpu_as_measured(prof, method):
    # Puget Systems measured DreamBooth and fine-tune at about a third of one GPU's speed on 2x RTX 4090 PCIe
    res = P.plan(_catalog(prof, "RTX 4090", 2), prof, P.Request(method=method, model="sdxl", images=40))
    assert res.plan.num_gpus == 1
    assert any(f"puget-2x4090-{method}" in r for r in res.reasons)
    two = next(c for c in res.alternatives if c.setup.num_gpus == 2)
    assert two.observed_multi_gpu == f"puget-2x4090-{method}"


def test_a_multi_gpu_observation_gives_its_exchange_rate_not_its_step_ratio(prof):
    """Puget's 2x RTX 4090 LoRA ratio (1.23x at batch 1, rank 128) was multiplied onto every 2-GPU step, any
    batch or rank, while 3 and 4 GPUs took the fitted model: 3 GPUs came out 1.68x faster than 2 over the same
    PCIe, and a 4-way exchange cheaper than the 2-way one. Now the observation gives its all-reduce rate to
    every GPU count: more GPUs never make a step cheaper, and the run's gain grows less than linearly."""
    req = P.Request(method="lora", model="sdxl", images=200)
    runs = {n: P.plan(_catalog(prof, "RTX 4090", n), prof, req) for n in (1, 2, 3, 4)}
    steps = {n: r.step_seconds for n, r in runs.items() if r.plan.num_gpus == n}
    assert sorted(steps) == [1, 2, 3, 4] and runs[2].plan.batch == runs[4].plan.batch
    assert all(steps[n] <= steps[n + 1] for n in (1, 2, 3)), steps
    speedups = [runs[1].seconds / runs[n].seconds for n in (1, 2, 3, 4)]
    assert all(a < b < a + 1 for a, b in zip(speedups, speedups[1:], strict=False)), speedups
    two, four = (next(c for c in runs[4].alternatives if c.setup.num_gpus == n) for n in (2, 4))
    assert two.observed_multi_gpu == "puget-2x4090-lora" == four.observed_multi_gpu
    said = next(r for r in runs[4].reasons if r.startswith("4 GPUs: each step"))
    assert (
        "at the rate measured on 2x RTX 4090 over pcie (puget-2x4090-lora" in said
        and "batch 1, rank 128" in said
    )


def test_a_ddp_observation_gives_its_rate_to_ddp_plans_only(prof):
    """Puget's 2x RTX 4090 DreamBooth ratio is DDP (one all-reduce, deepspeed: null); its rate went to ZeRO-2
    plans (reduce-scatter and all-gather) too, which the reasons then called measured (review h102, item 9)."""
    res = P.plan(
        _catalog(prof, "RTX 4090", 6), prof, P.Request(method="dreambooth", model="sdxl", images=200)
    )
    ddp = [c for c in res.alternatives if c.setup.num_gpus > 1 and not c.setup.deepspeed]
    zero = [c for c in res.alternatives if c.setup.deepspeed]
    assert ddp and zero, [c.setup for c in res.alternatives]
    assert all(c.observed_multi_gpu == "puget-2x4090-dreambooth" for c in ddp)
    assert all(c.observed_multi_gpu is None for c in zero)
    for c in zero:
        said = next(r for r in res.reasons if r.startswith(f"{c.setup.num_gpus} GPUs") and "DeepSpeed" in r)
        assert "at the rate measured" not in said, said
    gpus = _catalog(prof, "RTX 4090", 2).gpus
    s = next(c for c in zero).setup
    alike = replace(s, num_gpus=2, deepspeed=None, gpu_ids=None)
    assert P._observed_multi_gpu(prof, replace(s, num_gpus=2, gpu_ids=None), gpus, "pcie") is None
    assert P._observed_multi_gpu(prof, alike, gpus, "pcie").id == "puget-2x4090-dreambooth"


def test_a_rejected_gpu_count_says_a_saving_that_reads_below_the_bar(prof):
    """SD1.5 DreamBooth, 101 images x 2 repeats x 4 epochs, on 2x RTX 3060 12GB: the second GPU saves 4.6% where
    it must save more than 5%, and is not taken; the line said "it saves 5% of the run, where more GPUs must save
    5%". The share is said with the digits that tell it from the bar (as the optimizer reason's gain is)."""
    req = P.Request(method="dreambooth", model="sd15", images=101, repeats=2, epochs=4)
    res = P.plan(_catalog(prof, "RTX 3060 12GB", 2), prof, req)
    assert res.plan.num_gpus == 1
    two = next(c for c in res.alternatives if c.setup.num_gpus == 2)
    gain = P.multi_gpu_gain(two, next(c for c in res.alternatives if c.setup == res.plan), prof)
    assert 0.045 < gain < P.MIN_MULTI_GPU_GAIN
    said = next(r for r in res.reasons if r.startswith("2 GPUs would take"))
    stated = float(re.search(r"it saves ([\d.]+)% of the run, where more GPUs must save 5%", said).group(1))
    assert stated < 5 and stated == pytest.approx(gain * 100, abs=0.05), said


def test_multi_gpu_reasons_say_a_slow_down_as_one_and_compare_steps_only_where_one_gpu_runs_them(prof):
    """ "1.46x faster ... it saves -6% of the run" read as a contradiction; and "each step takes 1.82x as long as on
    one GPU with the same settings" was said of ZeRO-2 settings one GPU cannot hold, beside a run speed measured
    against another one-GPU plan (review h102, item 9)."""
    req = P.Request(method="dreambooth", model="sdxl", images=200)
    four = P.plan(_catalog(prof, "RTX 4090", 4), prof, req)
    said = next(r for r in four.reasons if r.startswith("4 GPUs would take"))
    assert "saves -" not in said and "the run could be 6% slower, where more GPUs must save 5%" in said, said
    six = P.plan(_catalog(prof, "RTX 4090", 6), prof, req)
    n = six.plan.num_gpus
    assert n > 1 and six.plan.deepspeed
    assert P.memory(prof, replace(six.plan, num_gpus=1)).peak > P.HEADROOM * 24 * 2**30 * 0.99
    said = next(r for r in six.reasons if r.startswith(f"{n} GPUs: each step"))
    assert "with the same settings" not in said and "these settings do not fit on one GPU" in said, said
    assert said.endswith("faster than the one-GPU plan"), said
    # LoRA's settings run on one GPU: the step is compared with them
    lora = P.plan(_catalog(prof, "RTX 4090", 4), prof, P.Request(method="lora", model="sdxl", images=200))
    said = next(r for r in lora.reasons if r.startswith("4 GPUs: each step"))
    assert "as long as on one GPU with the same settings" in said and said.endswith("x faster"), said


def test_each_gpu_added_must_clear_the_uncertainty_over_the_fewer_chosen(prof):
    """A 4-GPU run 0.05% faster than the 3-GPU one was chosen for being 10% faster than one GPU: more GPUs are
    now weighed against the fewer GPUs chosen so far."""
    res = P.plan(_catalog(prof, "A100 SXM 80GB", 4), prof, P.Request(method="lora", model="sd15"))
    n = res.plan.num_gpus
    by_n = {}
    for c in res.alternatives:
        by_n.setdefault(c.setup.num_gpus, c)
    chosen = by_n[n]
    for m, c in by_n.items():
        if m > n and c.seconds is not None:
            assert P.multi_gpu_gain(c, chosen, prof) <= P.MIN_MULTI_GPU_GAIN
    assert n < 4
    said = next(r for r in res.reasons if r.startswith("4 GPUs would take"))
    assert (
        f"than {n} GPUs: within the time uncertainty" in said
        or "no faster than" in said
        or (f"as fast as {n} GPUs (1.00x)" in said)
    ), said


def test_modelled_multi_gpu_gain_must_clear_the_time_uncertainty(prof):
    """More GPUs where no observation measured them only when the run stays shorter with the steps' shared
    compute at the low end of the time band (in both runs) and the modelled all-reduce at the high end."""
    hw = _catalog(prof, "RTX 4090", 2)
    for method, model in (("lora", "sd15"), ("dreambooth", "sd15"), ("lora", "flux-dev")):
        res = P.plan(hw, prof, P.Request(method=method, model=model, images=13, repeats=40))
        two = next(c for c in res.alternatives if c.setup.num_gpus == 2)
        one = next(c for c in res.alternatives if c.setup.num_gpus == 1)
        assert two.observed_multi_gpu is None and two.allreduce_seconds > 0 == one.allreduce_seconds
        low, high = prof.uncertainty.seconds_for(model)[0]

        def run(c, allreduce_factor, low=low):  # less the final grid, which no GPU count changes
            compute = c.seconds - c.fixed_seconds - c.allreduce_seconds
            fixed = c.fixed_seconds - c.sampling_once_seconds
            return fixed + compute * low + c.allreduce_seconds * allreduce_factor

        gain = 1 - run(two, high) / run(one, low)
        assert P.multi_gpu_gain(two, one, prof) == pytest.approx(gain)
        assert (res.plan.num_gpus == 2) == (gain > P.MIN_MULTI_GPU_GAIN and two.seconds < one.seconds)
        if res.plan.num_gpus == 1 and two.seconds < one.seconds:
            assert any("within the time uncertainty" in r for r in res.reasons)
        # LoRA's small all-reduce keeps its gain whatever the step's error; a full UNet's 3.2 GiB over PCIe
        # does not
        assert res.plan.num_gpus == (2 if method == "lora" else 1), (method, model, gain)


def test_block_swap_is_planned_in_one_process_with_checkpointing_only(prof):
    """The bundled trainer swaps blocks in one process, with gradient checkpointing (trainer/blockswap.py). A
    FLUX.1 LoRA pinned to two RTX 4090s with a bf16 base was planned with 28 blocks swapped, which the trainer
    then refused: now nothing in the search swaps on several GPUs or without checkpointing, that pin says
    what fits instead, and pinning a swap with two processes is one line."""
    req = P.Request(method="lora", model="flux-dev", resolution=1024)
    space = list(P.settings_space(req, precision="bf16", attention="efficient", max_gpus=2))
    assert any(s.blocks_to_swap for s in space)
    assert not any(s.blocks_to_swap and (s.num_gpus > 1 or not s.gradient_checkpointing) for s in space)
    pinned = replace(req, pins=(("num_gpus", 2), ("base_precision", "bf16")))
    res = P.plan(_catalog(prof, "RTX 4090", 2), prof, pinned)
    assert not res.feasible
    assert any("distributed.num_processes=1 fits" in r for r in res.reasons), res.reasons
    swap = ("distributed.num_processes=2", "memory.blocks_to_swap=10")
    result = _plan_for("lora", "flux-dev", "2x RTX 4090", *swap)
    assert result.exit_code != 0
    assert "the bundled trainer swaps blocks in one process" in result.output


def test_a_full_bf16_pin_plans_bf16_and_is_refused_without_it(prof):
    """training.full_half_weights=true without a precision: the planner picks bf16 (the default config's fp16
    was checked against it, a false "needs training.precision bf16"); a GPU without bf16 says so."""
    result = _plan_for("finetune", "sdxl", "RTX 4090", "training.full_half_weights=true", "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["plan"]
    assert plan["full_half_weights"] is True and plan["precision"] == "bf16"
    result = _plan_for("finetune", "sdxl", "T4", "training.full_half_weights=true")
    assert result.exit_code != 0
    assert "training.full_half_weights=true: needs bf16, which T4 lacks" in result.output


@pytest.mark.parametrize("hardware", ["RTX 3060 12GB", "RTX 4090", "2x RTX 4090", "8x H100 SXM"])
def test_text_encoder_training_is_never_planned_under_deepspeed(prof, tmp_path, hardware):
    """DeepSpeed trains one model: sdplan.config refuses it with the text encoders training. An SDXL fine-tune
    with training.train_text_encoder=true on an RTX 3060 was planned with DeepSpeed offload, and writing its
    sdplan.yaml then failed; now no such plan is made, and every one written validates."""
    out = str(tmp_path / "out")
    result = _plan_for("finetune", "sdxl", hardware, "training.train_text_encoder=true", "--out", out)
    assert "from the plan" not in result.output
    if result.exit_code == 0:
        data = yaml.safe_load((tmp_path / "out" / "sdplan.yaml").read_text())
        assert data["training"]["train_text_encoder"] is True
        assert data["distributed"]["deepspeed"] is None
    else:
        assert "needs at least" in result.output


# what users pin, each alone: the planner must still write a config `sdplan train` accepts
PIN_SETS = (
    (),
    ("training.train_text_encoder=true",),
    ("ema.enabled=true", "ema.device=gpu"),
    ("dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a dog"),
    ("memory.optimizer=adamw8bit",),
    ("memory.optimizer=adafactor",),
    ("memory.gradient_checkpointing=false",),
    ("training.precision=fp16",),
    ("distributed.num_processes=2",),
    ("memory.blocks_to_swap=10",),
)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["sd15", "sdxl", "sd35-medium", "flux-dev"])
def test_every_pinned_plan_writes_a_config_the_trainer_accepts(prof, model):
    """recommend validates the sdplan.yaml it writes as `sdplan train` will (sdplan.config), and a plan that
    does not validate is an error 'sdplan.yaml (from the plan): ...'. Over methods, GPUs and common pins, none:
    DeepSpeed with text-encoder training or with 8-bit AdamW, and block swap on two GPUs, each was one. A
    planned block swap is one the trainer runs (trainer/blockswap.py); a swap pinned on a UNet crashed the
    8x H100 search."""
    from sdplan.trainer.blockswap import support_problem

    from sdplan import recommend as R
    from sdplan.errors import SdplanError

    bad = []
    for method in ("lora", "dreambooth", "finetune", "textual-inversion"):
        for hardware in ("RTX 3060 12GB", "2x RTX 4090", "8x H100 SXM", "T4"):
            for pins in PIN_SETS:
                inp = R.RecommendInputs(
                    method=method, model=model, hardware=hardware, settings=pins, images=200
                )
                try:
                    _, res = R.recommend(inp, prof)
                except SdplanError as e:  # a pin this hardware or method cannot run: one line, fine
                    if "from the plan" in str(e):
                        bad.append(f"{method} on {hardware} with {pins}: {e}")
                    continue
                s = res.plan
                if s is not None and s.blocks_to_swap:
                    why = support_problem(
                        s.blocks_to_swap,
                        family=s.model,
                        method=s.method,
                        gradient_checkpointing=s.gradient_checkpointing,
                        processes=s.num_gpus,
                        deepspeed=s.deepspeed is not None,
                    )
                    if why:
                        bad.append(f"{method} on {hardware} with {pins}: {why}")
    assert not bad, f"{len(bad)}, e.g. {bad[:3]}"


def test_a_pinned_max_steps_is_the_plans_step_count_and_time():
    """`training.max_steps=10` was written to the config (the trainer stops there) while the plan, its time and
    its JSON counted the epochs' 50 steps. With the steps set, the batch is the one fastest per image."""
    r = _plan_for("lora", "sdxl", "RTX 4090", "training.max_steps=10", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["steps"]["total_steps"] == 10 and d["request"]["max_steps"] == 10
    assert any(line.startswith("steps: training.max_steps 10, pinned: 10 steps") for line in d["reasons"])
    batch = d["plan"]["batch_size"]
    same = _plan_for("lora", "sdxl", "RTX 4090", f"training.batch_size={batch}", "--json")
    full = json.loads(same.stdout)
    assert d["estimate"]["seconds"] < full["estimate"]["seconds"]  # 10 steps, not the epochs' steps
    assert full["steps"]["total_steps"] > 10


def test_accumulation_over_an_epochs_partial_batch_is_charged_the_micro_batches_drawn():
    """20 images at batch 8: 3 micro-batches an epoch, with accumulation 4 or without. The plan charged 4 per
    optimizer step with accumulation 4 (320 s against 256 s)."""
    seconds = []
    for extra in ((), ("training.grad_accum=4",)):
        r = _plan_for("lora", "sdxl", "RTX 4090", "training.batch_size=8", *extra, "--json")
        assert r.exit_code == 0, r.output
        seconds.append(json.loads(r.stdout)["estimate"]["seconds"])
    assert seconds[0] == seconds[1]


@pytest.mark.parametrize("model", ["flux-dev", "sd35-medium"])
def test_a_resolution_the_transformer_trainer_refuses_is_refused_by_recommend(model):
    """--resolution 520 planned an SD3.5 / FLUX.1 run whose config `sdplan train` then refused (a side must be
    a multiple of 16 px). Aspect buckets round their own sides."""
    for args in (("--resolution", "520"), ("data.resolution=520",)):
        r = _plan_for("lora", model, "RTX 4090", *args)
        assert r.exit_code == 2 and "multiple of 16 pixels (set it to 512 or 528)" in r.stderr, r.output
    assert _plan_for("lora", model, "RTX 4090", "--resolution", "520", "data.buckets=true").exit_code == 0
    assert _plan_for("lora", "sdxl", "RTX 4090", "--resolution", "520").exit_code == 0  # a UNet: 8 px


def test_the_batch_cap_of_the_distinct_images_is_said_where_it_binds():
    """13 images x 40 repeats on 2 GPUs: batch 4 per GPU, as large as 13 distinct images allow; the reasons
    called it 'the fastest whole run that fits' and blamed the gradient exchange for the GPU count, while a
    pinned batch 8 was faster. Pinned, the cap is not applied and not said."""
    args = ("--images", "13", "--repeats", "40", "distributed.num_processes=2", "--json")
    d = json.loads(_plan_for("dreambooth", "sd15", "8x H100 SXM", *args).stdout)
    (line,) = [r for r in d["reasons"] if r.startswith("batch size ")]
    assert d["plan"]["batch_size"] * 2 * 2 > 13
    assert "would exceed the 13 distinct images" in line and "pin training.batch_size" in line
    d = json.loads(_plan_for("dreambooth", "sd15", "8x H100 SXM", *args, "training.batch_size=8").stdout)
    assert d["plan"]["batch_size"] == 8 and not any("distinct images" in r for r in d["reasons"])


def test_the_batch_cap_on_a_pinned_gpu_count_over_the_images_says_batch_1_exceeds_them():
    """7 images on 8 pinned GPUs: batch 1 x 8 already exceeds the 7 distinct images; the reason said "batch 2 x 8
    GPUs would exceed the 7 distinct images"."""
    args = ("--images", "7", "--epochs", "3", "distributed.num_processes=8", "--json")
    d = json.loads(_plan_for("lora", "sd15", "8x H100 SXM", *args).stdout)
    (line,) = [r for r in d["reasons"] if r.startswith("batch size ")]
    assert d["plan"]["batch_size"] == 1 and "batch 2 x 8 GPUs" not in line, line
    assert "batch 1 x 8 GPUs already exceeds the 7 distinct images" in line, line


def test_deepspeed_sharding_chosen_for_speed_does_not_claim_one_gpu_cannot_hold_the_run():
    """An SD 1.5 fine-tune on 8 H100s takes ZeRO-2 for speed; its reason said one GPU 'cannot hold' what fits
    on one with room (22.9 GiB of 80). It says what else fits; FLUX.1, which needs the split, keeps the claim."""
    d = json.loads(
        _plan_for("finetune", "sd15", "8x H100 SXM", "--images", "20000", "--epochs", "5", "--json").stdout
    )
    (line,) = [r for r in d["reasons"] if r.startswith("DeepSpeed ZeRO-2 over")]
    assert "cannot hold" not in line and "a whole copy on each GPU also fits" in line
    d = json.loads(_plan_for("finetune", "flux-dev", "8x H100 SXM", "--json").stdout)
    (line,) = [r for r in d["reasons"] if r.startswith("DeepSpeed ZeRO-2 over")]
    assert "cannot hold with fp32 master weights" in line


def test_pinning_the_zero_stage_leaves_the_offload_to_the_plan():
    """`distributed.deepspeed.zero_stage=2` pinned offload_optimizer=true too (the section's default): ~1.6 s a
    step of CPU Adam nobody asked for. Given alone, the stage is pinned and the offload is chosen."""
    d = json.loads(
        _plan_for("finetune", "sd15", "8x H100 SXM", "distributed.deepspeed.zero_stage=2", "--json").stdout
    )
    assert d["request"]["pins"] == {"distributed.deepspeed": {"zero_stage": 2}}
    assert d["plan"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": False}  # ZeRO-2 split, no offload
    assert d["config"]["distributed"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": False}
    both = ("distributed.deepspeed.zero_stage=2", "distributed.deepspeed.offload_optimizer=true", "--json")
    d = json.loads(_plan_for("finetune", "sd15", "8x H100 SXM", *both).stdout)
    assert d["plan"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}


def test_aspect_buckets_count_the_steps_the_trainer_takes(tmp_path):
    """`recommend --dataset DIR data.buckets=true` counted 2 steps an epoch for 8 images at batch 4 where the
    trainer, with a batch from one bucket at a time, takes 3: each of the 3 buckets ends in a short batch."""
    from PIL import Image

    sizes = [(512, 512), (512, 768), (768, 512), (512, 1024), (1024, 512), (600, 400), (400, 600), (512, 512)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 20, 60, 90)).save(tmp_path / f"{i}.png")
    args = ("--dataset", str(tmp_path), "--resolution", "256", "training.batch_size=4", "--json")
    plain = json.loads(_plan_for("lora", "sd15", "RTX 4090", *args).stdout)
    bucketed = json.loads(_plan_for("lora", "sd15", "RTX 4090", *args, "data.buckets=true").stdout)
    assert plain["steps"]["steps_per_epoch"] == 2 and bucketed["steps"]["steps_per_epoch"] == 3
    assert any("in 3 aspect buckets (each ends in a short batch)" in r for r in bucketed["reasons"])


def test_recommend_says_the_batches_accelerate_deals_again():
    """README: 'the plan says how many'; recommend said 'images seen 8 either way' where 10 train."""
    args = ("--images", "8", "--epochs", "1", "training.batch_size=2", "--json")
    d = json.loads(_plan_for("lora", "sd15", "8x RTX 4090", *args, "distributed.num_processes=5").stdout)
    # one wording with `train` (steps.repeated_batches_text): 8 images at batch 2 on 5 GPUs, 1 epoch
    assert any(
        "by training its first batch again (up to 2 images twice an epoch, about 2 images more in all)" in r
        for r in d["reasons"]
    ), d["reasons"]
    d = json.loads(_plan_for("lora", "sd15", "8x RTX 4090", *args, "distributed.num_processes=4").stdout)
    assert not any("first batch" in r for r in d["reasons"])


def test_a_dataset_is_counted_with_the_pinned_data_settings(tmp_path):
    """`recommend --dataset` scanned with the defaults: data.metadata.min_score=6 kept every image (the config
    it wrote trained 8 steps of 3 images), data.repeats with buckets counted the buckets' samples once (42
    images seen in 10 steps of 2), an EXIF-rotated JPEG went to the bucket of its stored shape, and
    data.caption_extension=.caption counted the .txt captions."""
    from PIL import Image

    meta = tmp_path / "meta"
    meta.mkdir()
    for i in range(8):
        Image.new("RGB", (64, 64), (i * 30, 0, 0)).save(meta / f"{i}.png")
        (meta / f"{i}.json").write_text(json.dumps({"tags": [f"t{i}"], "score": i + 1}))
    args = ("--resolution", "256", "training.batch_size=1", "--epochs", "1", "--json")
    d = json.loads(
        _plan_for(
            "lora", "sd15", "RTX 4090", "--dataset", str(meta), *args, "data.metadata.min_score=6"
        ).stdout
    )
    assert d["steps"]["images_per_epoch"] == 3 and d["steps"]["total_steps"] == 3

    shapes = tmp_path / "shapes"
    shapes.mkdir()
    for i, size in enumerate([(512, 512), (512, 512), (1024, 256)]):
        Image.new("RGB", size, (0, i * 60, 0)).save(shapes / f"{i}.png")
    rotated = Image.new("RGB", (1024, 256), (0, 0, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6  # stored wide, shown tall
    rotated.save(shapes / "r.jpg", exif=exif)
    (shapes / "0.caption").write_text("a caption")
    (shapes / "1.txt").write_text("another")
    args = (
        "--dataset",
        str(shapes),
        "--resolution",
        "256",
        "training.batch_size=2",
        "--epochs",
        "1",
        "--json",
    )
    d = json.loads(_plan_for("lora", "sd15", "RTX 4090", *args, "data.buckets=true", "data.repeats=3").stdout)
    # 3 buckets (square x2, wide, tall) x 3 repeats: 6 + 3 + 3 samples = 3 + 2 + 2 batches
    assert d["steps"]["images_per_epoch"] == 12 and d["steps"]["steps_per_epoch"] == 7
    d = json.loads(_plan_for("lora", "sd15", "RTX 4090", *args, "data.caption_extension=.caption").stdout)
    assert any("4 images (1 captioned)" in r for r in d["reasons"]), d["reasons"]


def test_needs_at_least_on_a_machine_without_gpu_says_when_host_ram_sets_it(monkeypatch):
    """On a 23.5 GiB host without a GPU, an SDXL DreamBooth 'needs at least 14.8 GiB': the figure this host's
    RAM allows, while `--hardware "RTX 3080 10GB"` plans it with DeepSpeed offload (60 GiB of host RAM). The
    reasons said nothing of the RAM; now they give the figure a larger host has."""
    from sdplan.machine import Snapshot

    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "cpu_only.json")
    monkeypatch.setattr("sdplan.probe.snapshot.probe", lambda *a, **k: snap)
    d = json.loads(run("--method", "dreambooth", "--model", "sdxl", "--json").stdout)
    (line,) = [r for r in d["reasons"] if r.startswith("host RAM: the figure is for this machine's")]
    assert f"{snap.host.ram_total_bytes / 2**30:.1f} GiB" in line and "of GPU memory would do" in line


def test_an_ema_in_host_ram_costs_time_after_each_optimizer_step():
    """A full fine-tune with `ema.enabled=true` (in host RAM by default) took as long as without: the trainer
    copies every trained weight to the host and averages it in on the CPU after each optimizer step (2.6 B
    parameters for SDXL). The plan counts it, says it, and a larger batch amortises it."""
    base = ("--images", "200", "--json")
    plain = json.loads(_plan_for("finetune", "sdxl", "A100 SXM 80GB", *base, "training.batch_size=4").stdout)
    ema = json.loads(
        _plan_for(
            "finetune", "sdxl", "A100 SXM 80GB", *base, "training.batch_size=4", "ema.enabled=true"
        ).stdout
    )
    assert ema["estimate"]["seconds"] > plain["estimate"]["seconds"]
    (line,) = [r for r in ema["reasons"] if r.startswith("EMA in host RAM: ~")]
    assert "after each optimizer step" in line and "modelled, not measured" in line
    rare = ("training.batch_size=4", "ema.enabled=true", "ema.update_every=100")
    sparse = json.loads(_plan_for("finetune", "sdxl", "A100 SXM 80GB", *base, *rare).stdout)
    assert plain["estimate"]["seconds"] < sparse["estimate"]["seconds"] < ema["estimate"]["seconds"]
    assert any("after every 100 optimizer steps (ema.update_every)" in r for r in sparse["reasons"])
    gpu = ("training.batch_size=4", "ema.enabled=true", "ema.device=gpu")
    on_gpu = json.loads(_plan_for("finetune", "sdxl", "A100 SXM 80GB", *base, *gpu).stdout)
    assert not any(r.startswith("EMA in host RAM") for r in on_gpu["reasons"])


@pytest.mark.parametrize(
    ("pins", "shown"),
    [
        (("ema.enabled=true",), {"ema.enabled": True, "ema.device": "cpu"}),
        (("ema.enabled=true", "ema.device=gpu"), {"ema.enabled": True, "ema.device": "gpu"}),
        (("ema.enabled=false",), {"ema.enabled": False}),
    ],
)
def test_a_pinned_ema_is_echoed_as_the_keys_the_user_set(pins, shown):
    """`ema.enabled=true` read "pinned: ema.device=cpu" (and --json's pins {"ema.device": "cpu"}; false was
    {"ema.enabled": null}): the key the user set was missing. Now ema.enabled, with the device it is planned on."""
    d = json.loads(_plan_for("finetune", "sd15", "A100 SXM 80GB", *pins, "--json").stdout)
    assert d["request"]["pins"] == shown
    said = ", ".join(f"{k}={str(v).lower()}" for k, v in shown.items())
    assert f"pinned: {said} (planned around {'it' if len(shown) == 1 else 'them'})" in d["reasons"]


def test_a_pinned_zero_stage_alone_on_one_gpu_takes_the_offload():
    """`zero_stage=1` on one H100 was planned as ZeRO-1 without offload and explained as the state "split over
    the 1": one process has nothing to split it over (the search's own rule, skipped where the stage was pinned),
    so it holds more than without DeepSpeed. The stage alone leaves the offload to the plan, which takes it."""
    d = json.loads(
        _plan_for(
            "finetune",
            "sd35-medium",
            "H100 SXM",
            "--images",
            "30",
            "distributed.deepspeed.zero_stage=1",
            "--json",
        ).stdout
    )
    assert d["plan"]["deepspeed"] == {"zero_stage": 1, "offload_optimizer": True}
    assert not any("split over the 1" in r or "over 1 GPU (" in r for r in d["reasons"])


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_pinned_zero_stage_on_one_gpu_without_offload_is_refused(stage):
    """ZeRO without offload pinned on one GPU: refused in one line naming the three ways out, each of which
    plans."""
    from conftest import one_line_error

    pins = (f"distributed.deepspeed.zero_stage={stage}", "distributed.deepspeed.offload_optimizer=false")
    args = ("--images", "30", *pins)
    one_line_error(
        _plan_for("finetune", "sd35-medium", "H100 SXM", *args),
        2,
        "on one GPU without offload",
        "nothing to split it over",
        "distributed.deepspeed.offload_optimizer=true",
        "2 or more GPUs",
        "drop the distributed.deepspeed settings",
    )
    one_line_error(_plan_for("finetune", "sd35-medium", "2x H100 SXM", *args, "--gpus", "1"), 2, "one GPU")
    stage = pins[0]
    offload = _plan_for(
        "finetune", "sd35-medium", "H100 SXM", "--images", "30", stage,
        "distributed.deepspeed.offload_optimizer=true", "--json",
    )  # fmt: skip
    assert offload.exit_code == 0, offload.stderr
    assert json.loads(offload.stdout)["plan"]["deepspeed"]["offload_optimizer"] is True
    two = _plan_for("finetune", "sd35-medium", "2x H100 SXM", *args, "--json")
    assert two.exit_code == 0, two.stderr
    d = json.loads(two.stdout)
    assert d["plan"]["num_gpus"] == 2 or d["plan"]["deepspeed"]["offload_optimizer"], d["plan"]
    assert not any("over 1 GPU" in r for r in d["reasons"])
    dropped = _plan_for("finetune", "sd35-medium", "H100 SXM", "--images", "30")
    assert dropped.exit_code == 0, dropped.stderr


def test_a_pinned_max_steps_weighs_gpu_counts_per_image():
    """`training.max_steps=100` on 2x RTX 4090: one GPU at batch 8 sees 668 images, two at a smaller batch
    fewer; the reasons said '1.39x faster' and 'images seen either way' of runs that trained different amounts.
    Runs are weighed per image, and the steps line says what max_steps counts."""
    d = json.loads(
        _plan_for("lora", "sd15", "2x RTX 4090", "--images", "20", "training.max_steps=100", "--json").stdout
    )
    assert not any("either way" in r for r in d["reasons"])
    assert any(r.startswith("steps: training.max_steps 100, pinned") for r in d["reasons"])
    d2 = json.loads(
        _plan_for(
            "lora", "sd15", "2x RTX 4090", "--images", "20", "training.max_steps=100",
            "distributed.num_processes=2", "--json",
        ).stdout
    )  # fmt: skip
    (line,) = [r for r in d2["reasons"] if r.startswith("steps: training.max_steps 100")]
    assert "counts one process's steps: 50 on each of the 2 GPUs" in line


def test_a_pinned_max_steps_on_several_gpus_says_what_one_gpu_would_see():
    """`training.max_steps=100 training.batch_size=4` on 2x RTX 4090 over 20 images: 50 steps on each GPU see
    336 images (an epoch is 3 steps a GPU, its last round short), 100 steps on one GPU 400; the line said the
    two runs were the same ('336 images seen, as 100 steps of batch 4 x accumulation 1 on one GPU')."""
    d = json.loads(
        _plan_for(
            "lora", "sd15", "2x RTX 4090", "--images", "20", "training.max_steps=100", "training.batch_size=4",
            "distributed.num_processes=2", "--json",
        ).stdout
    )  # fmt: skip
    (line,) = [r for r in d["reasons"] if r.startswith("steps: training.max_steps 100")]
    assert "336 images seen" in line and "as 100 steps" not in line
    assert "100 steps of batch 4 x accumulation 1 on one GPU would see 400" in line


def test_a_pinned_max_steps_says_the_epochs_its_images_make():
    """7 steps of batch 4 x accumulation 2 over 20 images see 48: two epochs and 8 images of a third, which
    the line called '3 epoch(s) of 20'."""
    d = json.loads(
        _plan_for(
            "lora", "sd15", "RTX 4090", "training.max_steps=7", "training.batch_size=4", "training.grad_accum=2",
            "--json",
        ).stdout
    )  # fmt: skip
    (line,) = [r for r in d["reasons"] if r.startswith("steps: training.max_steps 7")]
    assert "images seen 48 (2 epochs of 20 and 8 of the next)" in line and "epoch(s)" not in line


def test_a_batch_cap_over_a_single_image_says_image():
    """ "batch 1 x 2 GPUs already exceeds the 1 distinct images" (and "batch 2 would exceed the 1 distinct
    images"): one image is an image."""
    d = json.loads(
        _plan_for(
            "lora",
            "sd15",
            "2x RTX 4090",
            "--images",
            "1",
            "--epochs",
            "1",
            "distributed.num_processes=2",
            "--json",
        ).stdout
    )
    text = " ".join(d["reasons"])
    assert "the 1 distinct image," in text and "1 distinct images" not in text, text


# -- a pinned batch past the epoch ---------------------------------------------------------------------------


def test_a_pinned_batch_past_the_epoch_is_sized_at_the_batch_the_trainer_forms(prof):
    """training.batch_size=64 for 20 images: the trainer forms one batch of 20 (BucketBatchSampler), but the plan
    sized 64 (22.0 GiB "may not fit", activations 18.3 GiB, 6.7 s a micro-step). It is the batch-20 run's
    memory and time, and says so; the config keeps the 64 asked for."""
    hw = _catalog(prof, "RTX 4090")
    req = P.Request(method="lora", model="sd15", images=20)
    big = P.plan(hw, prof, replace(req, pins=(("batch", 64),)))
    same = P.plan(hw, prof, replace(req, pins=(("batch", 20),)))
    assert big.plan.batch == 64 and same.plan.batch == 20
    assert big.memory.peak == same.memory.peak and big.peak_range == same.peak_range
    assert big.step_seconds == same.step_seconds and big.seconds == same.seconds
    assert big.memory.peak < 0.5 * hw.gpus[0].memory_bytes and big.steps.largest_batch == 20
    said = "\n".join(big.reasons)
    assert "batch 64 holds at most the epoch's 20 images" in said and "those of batch 20" in said, said
    result = _plan_for("lora", "sd15", "RTX 4090", "--images", "20", "training.batch_size=64")
    assert result.exit_code == 0, result.stderr
    assert "one micro-batch of 20" in result.stdout and "may not fit" not in result.stdout, result.stdout


def test_a_pinned_batch_past_the_epoch_on_two_gpus_is_planned_not_refused(prof):
    """13 images at batch 64 on 2 GPUs: each process trains a batch of 13 (the second deals the first again);
    it was refused as needing 61.1 GiB per GPU. The "needs at least" figure is sized the same way."""
    hw = _catalog(prof, "RTX 4090", 2)
    req = P.Request(method="lora", model="sd15", images=13, pins=(("batch", 64), ("num_gpus", 2)))
    res = P.plan(hw, prof, req)
    assert res.feasible and res.plan.batch == 64 and res.plan.num_gpus == 2
    at13 = P.plan(hw, prof, replace(req, pins=(("batch", 13), ("num_gpus", 2))))
    assert res.memory.peak == at13.memory.peak
    said = "\n".join(res.reasons)
    assert "up to 13 images twice an epoch" in said, said  # the batch dealt again holds 13, not 64
    need = P.min_vram_needed(replace(req, resolution=512), prof, precision="bf16")
    assert need == P.min_vram_needed(
        replace(req, resolution=512, pins=(("batch", 13), ("num_gpus", 2))), prof, precision="bf16"
    )


def test_the_batch_cap_reason_says_what_a_larger_batch_would_do(prof):
    """The search keeps a step's batches within the distinct images; the reason said a larger batch "would hold
    an image twice", which the trainer's sampler does not do without repeats (5 images at batch 4 on 2 GPUs:
    batches of 4 and 1). Said only where it can: the images' repeats in one step."""
    hw = _catalog(prof, "RTX 4090", 2)
    plain = P.plan(hw, prof, P.Request(method="lora", model="sd15", images=5, pins=(("num_gpus", 2),)))
    said = next(r for r in plain.reasons if "no larger batch was tried" in r)
    assert "would exceed the 5 distinct images (pin training.batch_size" in said and "twice" not in said, said
    repeated = P.plan(
        hw, prof, P.Request(method="lora", model="sd15", images=6, repeats=4, pins=(("num_gpus", 2),))
    )
    said = next(r for r in repeated.reasons if "no larger batch was tried" in r)
    assert "a step could hold an image's repeats together" in said, said
