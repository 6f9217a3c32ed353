"""The planner reproduces the published figures and makes the right choices on the fixture machines."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
from load_script import load_script

from sdplan import planner as P
from sdplan import registry
from sdplan.machine import Snapshot
from sdplan.profiles import clear_cache, load_profiles
from sdplan.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MACHINES = ROOT / "tests" / "fixtures" / "machines"
FIXTURES = ("2x_rtx4090_pcie", "8x_h100_sxm", "w6800", "rx6700xt", "rtx3060_12gb", "t4", "cpu_only")

accuracy = load_script("benchmarks/planner_accuracy.py", "planner_accuracy")


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def _snap(name: str) -> Snapshot:
    return Snapshot.load(MACHINES / f"{name}.json")


def test_every_published_number_within_15_percent(prof):
    """Memory, host RAM and multi-GPU ratios within 15% (25% for a peak whose kind its source leaves unstated:
    a monitor's, the allocator's reserved or allocated figure; the B200 one is 20% over the prediction). The
    speeds are the residuals of one roofline (two constants fitted on five speeds from five sources, tools and
    GPU generations), not a per-GPU lookup: they stay within 40% (a per-family fit reproduced each to 0% and
    missed by 53% leaving a source out)."""
    numeric, _ = accuracy.rows(prof)
    assert len(numeric) >= 8
    unfitted = {p.id for p in prof.points if not p.fit_speed}  # sdplan bench's H100 points: see below
    speed = [r for r in numeric if r["quantity"].startswith("it/s")]
    numeric = [r for r in numeric if not (r in speed and r["id"] in unfitted)]
    speed = [r for r in speed if r["id"] not in unfitted]
    flow = {p.id for p in prof.points if p.model in registry.FLOW_FAMILIES}
    # UNet speeds: one roofline over five published speeds (40%); SD3.5 / FLUX.1 speeds: one efficiency over four
    # user-level points (0.64-1.13 of the rated rate) whose settings are partly assumed and whose
    # quantized-base factors are uncalibrated (the plan's reasons say so): 35%; memory: 15%
    unstated = {p.id for p in prof.points if "vram kind unstated" in (p.note or "")}
    bad = [
        f"{r['id']} {r['quantity']}: {r['predicted']} vs {r['published']}"
        for r in numeric
        if abs(r["error_pct"])
        > ((35 if r["id"] in flow else 40) if r in speed else (25 if r["id"] in unstated else 15))
    ]
    assert not bad, bad
    assert len(speed) >= 5
    assert sorted(abs(r["error_pct"]) for r in speed)[len(speed) // 2] <= 35


def test_multi_gpu_ratios_are_predicted_as_a_plan_predicts_them(prof):
    """The benchmark's multi-GPU rows took the model's step with the geomean link efficiency, a path plans no
    longer take on these GPUs (a plan takes a matching observation's own rate: _observed_multi_gpu), and its
    leave-one-source-out 0.5% was the fallback constant, not a refit, since Puget is the only multi-GPU source
    (review h102, item 8)."""
    rows = [r for r in accuracy.in_sample(prof)["figures"] if r["quantity"].startswith("multi-GPU")]
    assert len(rows) == 6
    for r in rows:
        assert r["rate"] == r["id"], r  # the observation's own rate, as a plan on 2x RTX 4090 takes it
        if r["quantity"] == "multi-GPU iteration time ratio":
            assert abs(r["error_pct"]) < 0.5, r
    loso = accuracy.leave_one_source_out(prof)
    multi = [r for r in loso["figures"] if r["quantity"].startswith("multi-GPU")]
    assert multi and all(r["rate"] == "fallback" for r in multi)
    assert loso["summary"]["multi_gpu_ratio_fallback"] == len(multi)
    assert "fallback link efficiency 0.05, a constant, not a fit" in accuracy._fallback_text(loso["summary"])


def test_launch_bound_h100_steps_are_predicted_from_the_measured_floor(prof):
    """sdplan bench on an H100: at batch 1-4 the step time hardly grows with the batch (the host launching
    kernels sets it), where the roofline alone predicted up to 3x faster (16.3 it/s for an SD1.5 DreamBooth
    step measured at 5.5). Those points stay out of the roofline's fit; the floor they measure bounds it. With
    checkpointing the floor is its own (2026-11-27): SDXL's batch 1 (0.81 it/s) measured slower than its batch 2
    (1.01 it/s), the noise of one launch-bound bench run, so it is 26% off its floor."""
    numeric, _ = accuracy.rows(prof)
    rows = {
        r["id"]: r
        for r in numeric
        if r["quantity"].startswith("it/s")
        and r["id"].startswith("bench-nvidia-h100")
        and r["id"].endswith("-b1")
        and ("-sd15-" in r["id"] or "-sdxl-" in r["id"])  # the UNet families' (test_plan_flow: the others')
    }
    assert len(rows) >= 4
    assert all(abs(r["error_pct"]) <= (30 if "-gc-" in i else 20) for i, r in rows.items()), rows


def test_a_floor_measured_one_way_serves_the_other_times_the_measured_checkpointing_ratio(prof):
    """SDXL full training was measured on an H100 without checkpointing only. Checkpointing recomputes the
    forward, launching its kernels again: the pairs measured both ways (FLUX.1 at 512 px, SD3.5 Medium, SD1.5
    and SDXL LoRA) took 1.08-1.71x as long at their floors. A checkpointed SDXL DreamBooth step is floored at
    the unchecked one times their geometric mean, not at the unchecked one, and the plan says so."""
    cal = P.calibrate(prof)
    ratio = P._checkpointing_floor_ratio(cal.step_floors)
    assert 1.3 < ratio < 1.6
    unchecked = Settings(method="dreambooth", model="sdxl", resolution=1024, gradient_checkpointing=False)
    checked = replace(unchecked, gradient_checkpointing=True)
    sec, origin = cal.step_floor(checked)
    assert sec == pytest.approx(cal.step_floor_s(unchecked) * ratio)
    assert "measured without gradient checkpointing, x1." in origin
    # a family measured both ways keeps its own two floors
    lora = Settings(method="lora", model="sdxl", resolution=1024, gradient_checkpointing=True)
    assert cal.step_floor_s(lora) / cal.step_floor_s(replace(lora, gradient_checkpointing=False)) > 1.6


def test_every_fits_in_x_gb_statement_predicted_to_fit(prof):
    _, checks = accuracy.rows(prof)
    fits = [c for c in checks if c["claim"].startswith("fits")]
    assert len(fits) >= 12
    # Known in-sample misses, both on the safe side (the planner says "does not fit", the run fitted); they
    # count since a point's plain `fits: true` on a known card became a claim (2026-11-26):
    known = {
        # fp16 DreamBooth + checkpointing + AdamW on a 16 GB T4: predicted 17.6 GiB
        "shivamreadme-t4-db-fp16-b1-ga1-gc-adamw",
        # sdplan bench on an H100, the largest batch that fitted: SDXL LoRA batch 9, 77.1 GiB allocated
        # predicted (72.3 measured) plus the allocator and CUDA-context allowance = 82.3 GiB against 79.2; SDXL
        # full Adafactor batch 6, 74.5 predicted (66.3 measured) -> 79.6 GiB
        "bench-nvidia-h100-80gb-hbm3-lora-sdxl-1024-bf16-nogc-adamw-cl-r16-b9",
        "bench-nvidia-h100-80gb-hbm3-dreambooth-sdxl-1024-bf16-nogc-adafactor-cl-b6",
        "bench-nvidia-h100-80gb-hbm3-finetune-sdxl-1024-bf16-nogc-adafactor-cl-b6",
        # FLUX.1 LoRA at 512 px without checkpointing, batch 6: 82.6 GiB predicted (76.9 allocated measured)
        "bench-nvidia-h100-80gb-hbm3-lora-flux-dev-512-bf16-nogc-adamw-cl-cte-r16-b6",
    }
    assert all(c["ok"] for c in fits if c["id"] not in known), [c for c in fits if not c["ok"]]


def test_memory_terms_follow_the_arithmetic(prof):
    sd15 = prof.model("sd15")
    base = Settings(method="finetune", model="sd15", resolution=512, precision="bf16", cache_latents=True)
    m = P.memory(prof, base)
    assert m.trainable_params == sd15.params_unet
    assert m.weights == 4 * sd15.params_unet and m.gradients == 4 * sd15.params_unet
    assert m.optimizer == 8 * sd15.params_unet  # AdamW: two fp32 moments
    assert (
        P.memory(prof, Settings(**{**base.__dict__, "optimizer": "adamw8bit"})).optimizer
        == 2 * sd15.params_unet
    )
    ada = P.memory(prof, Settings(**{**base.__dict__, "optimizer": "adafactor"})).optimizer
    assert 0 < ada < 4 * sd15.params_unet  # factored second moment: a fraction of AdamW's 8 B
    gc = P.memory(prof, Settings(**{**base.__dict__, "gradient_checkpointing": True}))
    assert gc.activations < m.activations / 3
    b4 = P.memory(prof, Settings(**{**base.__dict__, "batch": 4}))
    assert b4.activations == pytest.approx(4 * m.activations, rel=0.02)
    math_attn = P.memory(prof, Settings(**{**base.__dict__, "attention": "math", "resolution": 768}))
    eff_attn = P.memory(prof, Settings(**{**base.__dict__, "resolution": 768}))
    assert math_attn.activations > 2 * eff_attn.activations
    offload = P.memory(
        prof, Settings(**{**base.__dict__, "deepspeed": {"zero_stage": 2, "offload_optimizer": True}})
    )
    assert offload.optimizer == 0 and offload.ram >= sd15.params_unet * 16 * 1.5


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("method", P.METHODS)
@pytest.mark.parametrize("model", ["sd15", "sdxl"])
def test_fixture_machines(prof, name, method, model):
    snap = _snap(name)
    req = P.Request(method=method, model=model, images=13, repeats=40, epochs=2)
    res = P.plan(snap, prof, req)
    d = P.result_dict(res)
    if not snap.usable_gpus:
        assert d["feasible"] is False and d["plan"] is None
        assert d["needs"]["min_vram_bytes"] > 0 and d["needs"]["suggested_hardware"]
        return
    if not d["feasible"]:
        assert d["needs"]["suggested_hardware"]
        for gpu in d["needs"]["suggested_hardware"]:
            assert prof.find_gpu(gpu).memory_bytes >= d["needs"]["min_vram_bytes"]
        return
    plan, est, steps = d["plan"], d["estimate"], d["steps"]
    vram = min(g.memory_total_bytes for g in snap.usable_gpus)
    assert est["peak_vram_bytes"] <= 0.92 * vram
    # hardware truth for precision: no bf16 on T4 / RDNA2
    expected = "bf16" if all(g.bf16 for g in snap.usable_gpus) else "fp16"
    assert plan["precision"] == expected
    if snap.usable_gpus[0].vendor == "amd":
        assert plan["optimizer"] != "adamw8bit"
    if plan["deepspeed"] and plan["deepspeed"]["offload_optimizer"]:
        assert plan["optimizer"] == "adamw"
        # offload only when nothing without it fits (within the likely peak's upper end, when the plan does)
        cands = P._candidates(res.request, prof, res.hardware, P.calibrate(prof), res.request.resolution)
        safe = est["within_upper_bound"]
        assert not any((c.safe if safe else c.fits) and not c.setup.offload for c in cands)
    elif plan["deepspeed"]:  # ZeRO-2 splitting the optimizer state: only over several GPUs
        assert plan["optimizer"] == "adamw" and plan["num_gpus"] > 1
    # step arithmetic: images seen equal the one-GPU plan whatever the GPU count
    assert steps["images_seen"] == 13 * 40 * 2
    n, b, ga = plan["num_gpus"], plan["batch_size"], plan["grad_accum"]
    assert steps["steps_per_epoch"] == math.ceil(13 * 40 / (b * ga * n))
    assert steps["total_steps"] == steps["steps_per_epoch"] * 2
    if n > 1:
        assert est["speedup_vs_one_gpu"] > 1.05
        assert any("normalised" in r for r in d["reasons"])
    assert len(d["reasons"]) >= 6


def test_lora_on_2x4090_uses_both_gpus_dreambooth_one(prof):
    snap = _snap("2x_rtx4090_pcie")
    lora = P.plan(
        snap, prof, P.Request(method="lora", model="sdxl", resolution=1024, images=13, repeats=40, epochs=1)
    )
    db = P.plan(snap, prof, P.Request(method="dreambooth", model="sd15", images=13, repeats=40, epochs=1))
    assert lora.plan.num_gpus == 2 and lora.speedup_vs_one_gpu > 1.05
    assert db.plan.num_gpus == 1


def test_nvlink_scales_full_unet_methods(prof):
    # the same DreamBooth request that stays on one PCIe RTX 4090 spreads over NVLink H100s
    snap = _snap("8x_h100_sxm")
    res = P.plan(snap, prof, P.Request(method="dreambooth", model="sdxl", images=64, repeats=10, epochs=2))
    assert res.plan.num_gpus > 1 and res.hardware.link == "nvlink"


def test_t4_gets_fp16_and_cpu_only_gets_suggestions(prof):
    t4 = P.plan(_snap("t4"), prof, P.Request(method="lora"))
    assert t4.plan.precision == "fp16"
    cpu = P.result_dict(P.plan(_snap("cpu_only"), prof, P.Request(method="dreambooth")))
    assert cpu["feasible"] is False and cpu["estimate"] is None
    assert cpu["needs"]["suggested_hardware"]


@pytest.mark.parametrize("name", ["GTX 1650", "GTX 1660", "GTX 1660 Super", "GTX 1660 Ti"])
def test_a_gtx_16_card_trains_in_fp32_and_a_pinned_fp16_carries_the_nan_note(prof, name):
    """fp16 mixed precision gives NaN losses on the GTX 16 cards (kohya-ss/sd-scripts#293, bmaltais/kohya_ss#722,
    #1951; A1111 and InvokeAI run them without autocast): the planner plans fp32 there and says why; a pinned
    fp16 is planned, with the note. Their fp32 runs at their CUDA-core rate (no tensor cores), not a quarter of
    it. Where nothing fits in fp32, the reasons say what fits in fp16."""
    spec = prof.find_gpu(name)
    assert not spec.fp16_trains and spec.tflops("fp32") == spec.fp16_tflops
    req = P.Request(method="lora", model="sd15")
    res = P.plan(P.hardware_from_catalog(spec), prof, req)
    if spec.memory_gib < 6:  # 4 GB: nothing fits in fp32; the reasons say what fp16 would fit, and the risk
        assert not res.feasible and "(fp32, batch 1," in res.reasons[-2]
        assert res.reasons[-1].startswith("in fp16 it fits (fp16, ") and "gives NaN losses" in res.reasons[-1]
    else:
        assert res.feasible and res.plan.precision == "fp32"
        why = next(r for r in res.reasons if r.startswith("precision "))
        assert why.startswith(
            "precision fp32 (no mixed precision): fp16 mixed precision gives NaN losses"
        ) and ("kohya-ss/sd-scripts issue 293" in why and "training.precision=fp16" in why)
    bf16 = P.pin_conflicts(replace(req, pins=(("precision", "bf16"),)), P.hardware_from_catalog(spec))
    assert bf16 == [f"training.precision=bf16: {name} has no bf16 in hardware (use training.precision=fp32)"]
    pinned = P.plan(P.hardware_from_catalog(spec), prof, replace(req, pins=(("precision", "fp16"),)))
    assert pinned.feasible and pinned.plan.precision == "fp16"
    assert any(
        r.startswith("precision fp16: pinned; note: fp16 mixed precision gives NaN") for r in pinned.reasons
    )


def test_a_gtx_16_plan_that_may_not_fit_in_fp32_names_the_fp16_plan_that_fits(prof):
    """SD 1.5 LoRA on a GTX 1660 Ti: fp32 (fp16 gives NaN losses there) fits only with its likely upper end over
    the card ("may not fit"), and the warning said no configuration fits within it, while training.precision=fp16
    fits comfortably. The precision stays fp32; the reasons name the fp16 plan, the pin, and the risk."""
    hw = P.hardware_from_catalog(prof.find_gpu("GTX 1660 Ti"))
    req = P.Request(method="lora", model="sd15")
    res = P.plan(hw, prof, req)
    assert res.feasible and res.plan.precision == "fp32" and not res.within_upper_bound
    fp16 = P.plan(hw, prof, replace(req, pins=(("precision", "fp16"),)))
    assert fp16.feasible and fp16.within_upper_bound
    said = next(r for r in res.reasons if r.startswith("in fp16 it fits"))
    assert f"{fp16.memory.peak / 2**30:.1f} GiB" in said and "training.precision=fp16" in said
    assert "NaN losses" in said
    assert not any("no configuration fits within the upper end" in r for r in res.reasons)
    # where fp32 fits within its range, nothing is said
    ok = P.plan(hw, prof, replace(req, pins=(("precision", "fp32"),)))
    assert not any(r.startswith("in fp16 it fits") for r in ok.reasons)


def test_the_cards_said_to_fit_a_gtx_16_request_are_those_that_fit_it_in_their_own_precision(prof):
    """SDXL LoRA on a GTX 1660 Super needs 16 GiB in the fp32 it trains in there, 8.5 in fp16 mixed precision:
    "would fit" names the cards on which it fits as each trains (a 10 GB RTX 3080), not only cards of 16 GiB and
    more; "needs at least" keeps this card's figure, with the other beside it."""
    req = P.Request(method="lora", model="sdxl")
    res = P.plan(P.hardware_from_catalog(prof.find_gpu("GTX 1660 Super")), prof, req)
    need, mixed = res.needs["min_vram_bytes"], res.needs["min_vram_bytes_mixed_precision"]
    assert not res.feasible and mixed is not None and mixed < need
    assert mixed == P.min_vram_needed(req, prof, precision="fp16")
    suggested = res.needs["suggested_hardware"]
    assert any(prof.find_gpu(n).memory_bytes < need for n in suggested), suggested
    for name in suggested:
        own = P.plan(P.hardware_from_catalog(prof.find_gpu(name)), prof, req)
        assert own.feasible and own.within_upper_bound, name
    flux_ft = P.Request(method="finetune", model="flux-dev")
    t4 = P.plan(P.hardware_from_catalog(prof.find_gpu("T4")), prof, flux_ft)
    assert not t4.feasible and t4.needs["min_vram_bytes_mixed_precision"] is None


def test_the_catalogs_fp16_trains_agrees_with_the_gtx_16_name_rule(prof):
    """The catalog's fp16_trains: false and AUTOMATIC1111's name rule (sdplan.machine.fp16_gives_nan, for probed
    cards the catalog lacks and for doctor's finding) name the same cards."""
    from sdplan.machine import fp16_gives_nan

    by_rule = {g.name for g in prof.gpus if any(fp16_gives_nan(a, g.arch) for a in g.aliases)}
    assert (
        by_rule
        == {g.name for g in prof.gpus if not g.fp16_trains}
        == {
            "GTX 1650",
            "GTX 1660",
            "GTX 1660 Super",
            "GTX 1660 Ti",
        }
    )


def test_fp16_stays_where_it_trains_and_the_probed_gtx_16_name_is_the_catalogs(prof):
    """Turing cards with tensor cores (RTX 2060, T4) keep fp16; a probed GTX 16 (its NVML name) is planned as its
    catalog entry says, also beside another GPU, and one the catalog lacks by AUTOMATIC1111's rule (compute
    capability 7.5, a name starting "NVIDIA GeForce GTX 16"); an A100's fp32 is still a quarter of its fp16
    rate."""
    for name in ("RTX 2060 6GB", "T4", "GTX 1080 Ti"):
        res = P.plan(
            P.hardware_from_catalog(prof.find_gpu(name)), prof, P.Request(method="lora", model="sd15")
        )
        assert res.plan.precision == "fp16", name
    a100 = prof.find_gpu("A100 SXM4 80GB")
    assert a100.fp16_trains and a100.tflops("fp32") == a100.fp16_tflops / 4
    from test_planner_mixed import RTX2080TI, machine

    gtx = {**RTX2080TI, "name": "NVIDIA GeForce GTX 1660 SUPER", "memory_total_bytes": 6442450944}
    one = P.plan(machine(gtx), prof, P.Request(method="lora", model="sd15"))
    assert one.hardware.gpus[0].spec.name == "GTX 1660 Super" and one.plan.precision == "fp32"
    laptop = {
        **gtx,
        "name": "NVIDIA GeForce GTX 1650 Ti",
        "memory_total_bytes": 4 * 2**30,
    }  # not in the catalog
    alone = P.plan(machine(laptop), prof, P.Request(method="lora", model="sd15"))
    assert alone.hardware.gpus[0].spec is None and not P.fp16_trains(alone.hardware.gpus[0])
    assert not P.fp16_trains(replace(alone.hardware.gpus[0], name="NVIDIA GeForce GTX 1630"))
    assert P.fp16_trains(replace(alone.hardware.gpus[0], name="NVIDIA GeForce RTX 2050"))  # not a GTX 16
    assert P.fp16_trains(replace(alone.hardware.gpus[0], arch="6.1", name="NVIDIA GeForce GTX 1650 Ti"))
    both = P.plan(
        machine(RTX2080TI, gtx), prof, P.Request(method="lora", model="sd15", pins=(("num_gpus", 2),))
    )
    assert both.plan.precision == "fp32"
    assert P.precision_for(P.hardware_from_catalog(prof.find_gpu("RTX 2080 Ti")).gpus) == "fp16"


def test_infeasible_catalog_gpu_says_what_would_fit(prof):
    hw = P.hardware_from_catalog(prof.find_gpu("RTX 2060 6GB"))
    res = P.plan(hw, prof, P.Request(method="finetune", model="sdxl"))
    assert not res.feasible
    need = res.needs["min_vram_bytes"]
    assert need > hw.gpus[0].memory_bytes / 0.92
    assert res.needs["suggested_hardware"]
    assert all(prof.find_gpu(n).memory_bytes >= need for n in res.needs["suggested_hardware"])


def test_a_local_measurement_is_used_as_measured(prof, tmp_path, monkeypatch):
    store = tmp_path / "store" / "methods"
    store.mkdir(parents=True)
    (store / "lora.yaml").write_text(
        "schema_version: 1\nmethod: lora\npoints:\n"
        "  - {id: my-4090, model: sd15, resolution: 512, batch: 1, grad_accum: 1, precision: bf16, gpu: RTX 4090,\n"
        "     num_gpus: 1, options: {gradient_checkpointing: false, optimizer: adamw, cache_latents: true,\n"
        "     train_text_encoder: false, attention: sdpa, deepspeed: null, ema: null}, outcome: {fits: true, it_s: 11.0},\n"
        "     source: 'measured: sdplan bench'}\n"
    )
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path / "store"))
    clear_cache()
    local = load_profiles()
    hw = P.hardware_from_catalog(local.find_gpu("RTX 4090"))
    s = Settings(method="lora", model="sd15", resolution=512, precision="bf16", cache_latents=True)
    cand = P._evaluate(P.Request(method="lora"), local, hw, P.calibrate(local), s)
    assert cand.basis == "measured" and cand.step_seconds == pytest.approx(1 / 11.0)
    clear_cache()


def test_an_observed_out_of_memory_changes_the_next_plan(tmp_path):
    """What ran out of memory on this GPU (recorded by `sdplan train`) is never planned again."""
    import datetime

    from sdplan import config as C
    from sdplan.launcher import oom_point, record_point
    from sdplan.planner import Request, hardware_from_catalog, plan
    from sdplan.profiles import load_profiles

    shipped = load_profiles(local=tmp_path / "empty")
    hw = hardware_from_catalog(shipped.find_gpu("RTX 3060 12GB"), 1)
    req = Request(method="lora", model="sd15", images=20, epochs=1)
    first = plan(hw, shipped, req).plan
    assert first is not None

    data = C.default_config()
    data["training"].update(batch_size=first.batch, grad_accum=first.grad_accum, precision=first.precision)
    data["memory"].update(
        gradient_checkpointing=first.gradient_checkpointing,
        optimizer=first.optimizer,
        cache_latents=first.cache_latents,
    )
    cfg = C.validate(data)
    oom = {
        "step": 1,
        "batch_size": first.batch,
        "grad_accum": first.grad_accum,
        "message": "CUDA out of memory",
    }
    point = oom_point(
        cfg,
        oom,
        **(
            where := {
                "family": "sd15",
                "gpu_name": "NVIDIA GeForce RTX 3060",
                "gpu_memory_bytes": 12 * 2**30,
                "when": datetime.datetime(2026, 11, 21),
            }
        ),
    )
    record_point(point, "lora", tmp_path / "store")

    learned = load_profiles(local=tmp_path / "store")
    second = plan(hw, learned, req).plan
    assert second is not None
    same = (first.batch, first.gradient_checkpointing, first.optimizer, first.cache_latents, first.precision)
    assert (
        second.batch,
        second.gradient_checkpointing,
        second.optimizer,
        second.cache_latents,
        second.precision,
    ) != same
    # A larger batch with otherwise the same settings is ruled out too.
    assert not (
        second.batch >= first.batch
        and (second.gradient_checkpointing, second.optimizer, second.cache_latents) == same[1:4]
    )
    # The match is on everything the peak depends on (planner._memory_settings, as for a measured peak): an
    # out-of-memory at LoRA rank 128 says nothing the model does not about rank 16 (it held a rank-16 plan off).
    data["lora"]["rank"] = 128
    record_point(oom_point(C.validate(data), oom, **where), "lora", tmp_path / "rank128")
    assert plan(hw, load_profiles(local=tmp_path / "rank128"), req).plan == first


def test_the_real_h100_doctor_snapshot_plans_from_the_measured_points(prof):
    """`sdplan doctor --json` on the lent H100 (NVML name 'NVIDIA H100 80GB HBM3', 2026-11-26) is a fixture: the
    name matches the catalog exactly and the plan's speed and peak come from sdplan bench's point at that batch
    (basis "measured": sdplan's own measurement, shipped or made on this machine)."""
    snap = _snap("h100_80gb_hbm3")
    pins = (("batch", 4), ("gradient_checkpointing", False), ("cache_text_encoder_outputs", False))
    res = P.plan(snap, prof, P.Request(method="lora", model="sdxl", pins=pins))
    assert res.feasible and res.basis == "measured"
    point = next(
        p
        for p in prof.points
        if p.id == f"bench-nvidia-h100-80gb-hbm3-lora-sdxl-1024-bf16-nogc-adamw-cl-r16-b{res.plan.batch}"
    )
    assert res.step_seconds == pytest.approx(1.0 / point.outcome["it_s"], rel=0.02)
    allocated = point.outcome["peak_vram_gib"] * 2**30
    assert res.memory.peak == pytest.approx(allocated * (1 + P.ALLOCATOR_OVERHEAD) + P.CUDA_CONTEXT_BYTES)


def test_settings_near_a_bench_point_are_scaled_by_it(prof):
    """Measured evidence near a configuration beats the model: on the H100, SDXL LoRA with checkpointing at
    batch 12 (never measured) is the model's prediction scaled by the nearest sdplan bench point
    (checkpointing, batch 16: 1.51 s a step)."""
    res = P.plan(
        _snap("h100_80gb_hbm3"),
        prof,
        P.Request(method="lora", model="sdxl", pins=(("gradient_checkpointing", True), ("batch", 12))),
    )
    assert res.feasible and res.basis == "scaled" and res.plan.batch == 12
    near = next(p for p in prof.points if p.id.endswith("lora-sdxl-1024-bf16-gc-adamw-cl-r16-b16"))
    expected = (1.0 / near.outcome["it_s"]) * (12 / 16)  # as a user would estimate it
    assert res.step_seconds == pytest.approx(expected, rel=0.15)
    assert any("scaled by how a measured speed" in r for r in res.reasons)
    # a GPU with only published figures from other tools is never scaled by them
    other = P.plan(_snap("rtx3060_12gb"), prof, P.Request(method="lora", model="sd15"))
    assert other.basis != "scaled"


def test_bench_points_predicted_leaving_each_out():
    """Leave each H100 bench point out (calibration and evidence): as a plan states it (the floor, then the
    nearest other bench point scaling the model) the speed errs by a median 6.4%, max 36.8% on the 28 UNet
    points (7.5% with the published bandwidth efficiency, before the Hopper one fitted on the bench points;
    the model with the floor alone then erred by 9.3% / 61.6%). The 27 SD3.5 / FLUX.1 LoRA points (2026-11-26,
    second session): median 2.0%, max 38.1% (SD3.5 Large at batch 1, scaled from batch 2), where the model
    alone errs by 82-274% (their efficiency rests on two published speeds of other GPUs). With the 6 points of
    the fourth session (fp8 FLUX.1, SD3.5 Medium) the 33: median 1.9%, max 49.0% (SD3.5 Medium at batch 1, a
    launch-bound step scaled from batch 2 as if it were not; a fitted fixed time per step helped the model
    alone, 19.9% -> 12.3% median, but made the scaled basis worse, 1.9% -> 6.4%, and was not kept). With the
    launch-bound floor extended to them (fifth session): median 1.8%, max 49.0% (FLUX.1 at 512 px batch 1 from
    -19% / +23% to +8% / -7%; Medium's batch 1 has no floor once it is left out, as it alone measures one).
    With SD3.5 Medium measured without checkpointing too (2026-11-27) and a floor measured one way serving the
    other times the pairs' checkpointing ratio (x1.46): the 84, median 3.5%, max 49.7%; Medium's two batch-1
    floors left out each went from +50% / -33% to within 4%, FLUX.1's at 512 px from +8% / -7% to +50% / -33%
    (its pair differs by 1.08x, less launch-bound than the others)."""
    import statistics

    rows = accuracy.bench_leave_one_out(load_profiles())["figures"]  # what the accuracy report prints
    errors = [abs(r["error_pct"]) / 100 for r in rows if r["id"].startswith("bench-nvidia-h100")]
    assert len(errors) >= 50
    assert statistics.median(errors) <= 0.10 and max(errors) <= 0.50


def test_the_coarse_to_fine_efficiency_search_finds_the_full_scans_value(prof, monkeypatch):
    """calibrate() fits the bench bandwidth efficiency on a 160-value grid by a coarse pass and a fine one
    around its best (36 predictions of the bench series instead of 160): the same value as scanning it all."""
    fast = P.calibrate(prof)
    monkeypatch.setattr(P, "_grid_argmin", lambda grid, f, stride=8: min(grid, key=f))
    full = P.calibrate(prof)
    assert fast.bandwidth_by_family and fast.bandwidth_by_family == full.bandwidth_by_family
    assert fast == full
