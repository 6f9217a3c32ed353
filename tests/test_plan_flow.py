"""The planner on SD3.5 / FLUX.1 LoRA (issue 14): a frozen transformer base at bf16 / fp8 / nf4, text-encoder
outputs cached or resident, block-level gradient checkpointing; the card size decides which."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import make_images

from sdplan import planner as P
from sdplan import registry
from sdplan.errors import UsageError
from sdplan.machine import Snapshot
from sdplan.profiles import load_profiles
from sdplan.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MACHINES = Path(__file__).parent / "fixtures" / "machines"
GiB = 2**30


# The peak-VRAM uncertainty band these choices were written against (profiles/uncertainty.yaml before the issue-10
# memory fixes). The band is the validation set's 10th-90th percentile and moves with every fix there; several of
# the table's choices sit within a fraction of a percent of its upper end (SD3.5 Large LoRA on an RTX 4090 with
# resident fp8 encoders: 18.5 GiB x 1.30 = 23.9 of 24 GiB), so the table pins it and tests the card-size logic.
TABLE_PEAK_VRAM_BAND = (0.947, 1.392)


@pytest.fixture(scope="module")
def prof():
    p = load_profiles()
    band = TABLE_PEAK_VRAM_BAND  # for every kind of network (the transformer families have their own since)
    return replace(p, uncertainty=replace(p.uncertainty, peak_vram=band, peak_vram_transformer=band))


def _flux_fp8_lora() -> Settings:
    """FLUX.1 [dev] LoRA at 1024 px on an fp8 base: checkpointing, latents and text-encoder outputs cached."""
    return Settings(
        method="lora",
        model="flux-dev",
        resolution=1024,
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=True,
        base_precision="fp8",
    )


def _plan(prof, gpu: str, family: str, resolution: int | None = None, **kw):
    hw = P.hardware_from_catalog(prof.find_gpu(gpu))
    return P.plan(hw, prof, P.Request(method="lora", model=family, resolution=resolution, **kw))


# card -> what people run there (/work/staging/README.md summary; kohya / diffusers / SimpleTuner docs), as the
# planner must choose it: (gpu, family, resolution, base precision, TE outputs cached, checkpointing, blocks
# swapped: None = some). Block swap keeps the result, a quantized base does not (a 2-5% handicap); but
# dequantising costs ~0.1 s per FLUX.1 step (measured on an H100, 2026-11-27: not the x1.3 once guessed), far
# less than the PCIe copies of a bf16 base's swapped blocks or checkpointing's recomputed forward, so where the
# bf16 base needs either, a quantized one is clearly faster and chosen (as kohya's docs do: fp8 + swap).
TABLE = [
    # kohya 8 GB: fp8 + --blocks_to_swap 28+. nf4 keeps T5 in bf16 (9 GiB), more than the card in the pass that
    # encodes the captions before training; the fp8 base stores it in fp8 (4.5 GiB), as kohya's --fp8_base does
    ("RTX 3070", "flux-dev", 1024, "fp8", True, True, None),
    ("RTX 3060 12GB", "flux-dev", 1024, "fp8", True, True, None),  # kohya 12 GB: swap 16 (with fp8)
    ("RTX 4090", "flux-dev", 1024, "fp8", True, True, 0),  # kohya 24 GB: fp8 base, cached TE, GC, no swap
    ("RTX A6000", "flux-dev", 1024, "bf16", True, True, 0),  # 48 GB: the bf16 base fits
    ("A100 SXM4 80GB", "flux-dev", 512, "bf16", True, False, 0),  # 80 GB: bf16 base, no GC at 512 px
    # the same network as [dev], 7% fewer FLOPs: nf4 at batch 4 (499 s) edges out fp8 at batch 1 (519 s)
    ("RTX 4090", "flux-schnell", 1024, "nf4", True, True, 0),
    # 2.2B, but its three text encoders in bf16 (10.4 GiB) are past 92% of the card in the caption pass: fp8
    ("RTX 3060 12GB", "sd35-medium", 1024, "fp8", True, True, 0),
    # ai-toolkit runs an 8-bit base on 24 GB: fp8 at batch 4 (316 s) beats bf16 with 16 blocks swapped (337 s)
    ("RTX 4090", "sd35-large", 1024, "fp8", True, True, 0),
    # 80 GB: bf16 base, no checkpointing; batch 2 with the text-encoder outputs cached (measured on an H100:
    # 50.2 GiB allocated) is faster than batch 1 with the encoders resident
    ("A100 SXM4 80GB", "sd35-large", 1024, "bf16", True, False, 0),
]


@pytest.mark.parametrize(("gpu", "family", "res", "base", "te_cached", "gc", "swap"), TABLE)
def test_card_size_decides_base_precision_caching_and_checkpointing(
    prof, gpu, family, res, base, te_cached, gc, swap
):
    r = _plan(prof, gpu, family, res)
    assert r.feasible, r.reasons
    s = r.plan
    assert (s.base_precision, s.cache_text_encoder_outputs, s.gradient_checkpointing) == (base, te_cached, gc)
    assert s.blocks_to_swap > 0 if swap is None else s.blocks_to_swap == swap
    assert s.cache_latents  # the VAE off the GPU and out of every step
    assert r.memory.peak <= P.HEADROOM * prof.find_gpu(gpu).memory_bytes
    text = "\n".join(r.reasons)
    assert f"base precision {base}" in text
    if base != "bf16":
        assert "stops before launch and says what is missing" in text and "dequantising it adds" in text
    if s.blocks_to_swap:
        assert "--blocks_to_swap" in text and "the bundled trainer swaps them" in text


def test_a_faster_plan_passed_over_for_the_handicaps_is_named(prof):
    """FLUX.1 LoRA on 16 GB: an fp8 base with blocks swapped, said to be "the fastest whole run that fits", where
    an nf4 plan was faster and fit too; passed over for the small handicaps a quantized base and an 8-bit optimizer
    count (_key), which the reason did not say. Where nothing faster was passed over it says nothing more."""
    res = _plan(prof, "RTX 4060 Ti 16GB", "flux-dev")
    (why,) = [r for r in res.reasons if "the fastest whole run that fits" in r]
    said = re.search(r"counting a small handicap .*: with (.*) each image takes (\d+)% less time", why)
    assert said, why
    named = said.group(1)  # every setting it differs from the plan in, as keys
    assert "model.base_precision=nf4" in named and res.plan.base_precision != "nf4"
    assert int(said.group(2)) > 0
    # under training.max_steps a plan that trains fewer images is not "faster" (it compares per image seen)
    capped = _plan(prof, "RTX 4060 Ti 16GB", "flux-dev", images=20, pins=(("max_steps", 500),))
    assert not re.search(r"each image takes (\d\d)% less", " ".join(capped.reasons))
    plain = _plan(prof, "A100 SXM4 80GB", "sd15")
    assert not any("counting a small handicap" in r for r in plain.reasons)


def test_without_block_swap_small_cards_need_a_quantized_base(prof):
    """kohya's rungs before block swap existed (and SimpleTuner's): nf4 / fp8 on 12-16 GB; 8 GB does not fit.
    SD3.5 Large's three encoders in bf16 (nf4 keeps them so) are past 92% of 12 GB in the caption pass: fp8."""
    no_swap = (("blocks_to_swap", 0),)
    assert _plan(prof, "RTX 3060 12GB", "flux-dev", 1024, pins=no_swap).plan.base_precision == "nf4"
    assert _plan(prof, "RTX 4060 Ti 16GB", "flux-dev", 1024, pins=no_swap).plan.base_precision == "nf4"
    assert not _plan(prof, "RTX 3070", "flux-dev", 1024, pins=no_swap).feasible
    assert _plan(prof, "RTX 3060 12GB", "sd35-large", 1024, pins=no_swap).plan.base_precision == "fp8"


def test_a_pinned_block_swap_past_the_familys_maximum_is_a_conflict_not_a_negative_size(prof):
    """memory.blocks_to_swap=100 for FLUX.1 was planned: its transformer "takes -10.0 GiB on the GPU" and the peak
    fell as the pin grew. Past the family's maximum (two blocks of each list stay) it is a pin conflict naming
    the largest count; the maximum itself plans."""
    for family, most in P.MAX_BLOCKS_TO_SWAP.items():
        res = _plan(prof, "RTX 4090", family, pins=(("blocks_to_swap", most + 1),))
        assert not res.feasible
        assert any(
            f"memory.blocks_to_swap={most + 1}: {family} swaps at most {most} blocks" in r
            and f"(use memory.blocks_to_swap={most} or fewer)" in r
            for r in res.reasons
        ), res.reasons
        ok = _plan(prof, "RTX 4090", family, pins=(("blocks_to_swap", most),))
        assert ok.feasible and ok.plan.blocks_to_swap == most and ok.memory.peak > 0


def test_the_cached_text_encoder_reason_says_shuffling_and_dropout_still_work(prof):
    """It said captions stay fixed ("no caption shuffle or dropout"), and a user's data.caption_dropout pin
    read as void; the trainer encodes each epoch's shuffled tags and the empty caption (epoch_captions)."""
    res = _plan(prof, "RTX 4090", "flux-dev", pins=(("cache_text_encoder_outputs", True),))
    (line,) = [r for r in res.reasons if r.startswith("text-encoder outputs cached")]
    assert "the result is the same (each epoch's shuffled tags and caption dropout's empty caption" in line
    assert "no caption shuffle" not in line


def test_block_swap_moves_the_swapped_blocks_to_host_ram(prof):
    for family, most in P.MAX_BLOCKS_TO_SWAP.items():
        assert P.max_blocks_to_swap(prof.model(family)) == most
    base = _flux_fp8_lora()
    swapped = Settings(**{**base.__dict__, "blocks_to_swap": 16})
    moved = P.swapped_block_bytes(prof.model("flux-dev"), swapped)
    d = 3072
    assert (
        moved == 8 * 36 * d * d + 16 * 15 * d * d
    )  # 8 double blocks (36 d^2 each) + 16 single (15 d^2), 1 byte
    a, b = P.memory(prof, base), P.memory(prof, swapped)
    assert a.frozen - b.frozen == pytest.approx(moved)
    # the pinned copies are made from the loaded weights, which are then freed: the larger phase, not the sum
    assert b.ram == pytest.approx(max(a.ram, P.RAM_PER_PROCESS + moved))
    assert P.pinned_ram_bytes(prof, swapped) == pytest.approx(P.RAM_PER_PROCESS + moved)
    spec = prof.find_gpu("RTX 3060 12GB")
    cal = P.calibrate(prof)
    assert P.step_seconds(prof, swapped, spec, cal) > P.step_seconds(prof, base, spec, cal)


def test_lora_parameters_come_from_the_config_shapes(prof):
    flux = Settings(method="lora", model="flux-dev", resolution=1024, lora_rank=16)
    # 19 double blocks: 8 attention projections d->d, 2 x (ff d->4d, 4d->d); 38 single blocks: to_q/k/v d->d
    d = 3072
    per_rank = 19 * (8 * 2 * d + 4 * (d + 4 * d)) + 38 * 3 * 2 * d
    assert P.flow_lora_params(prof.model("flux-dev"), flux) == 16 * per_rank
    large = Settings(method="lora", model="sd35-large", resolution=1024, lora_rank=4)
    d = (
        38 * 64
    )  # 38 blocks; the last is context_pre_only (no to_add_out); diffusers' SD3 targets: attn.* only
    assert P.flow_lora_params(prof.model("sd35-large"), large) == 4 * (7 * 38 + 37) * 2 * d
    medium = Settings(method="lora", model="sd35-medium", resolution=1024, lora_rank=1)
    d = 24 * 64  # MMDiT-X's attn2 is not matched by the attn.* targets
    assert P.flow_lora_params(prof.model("sd35-medium"), medium) == (7 * 24 + 23) * 2 * d
    assert P.memory(prof, flux).trainable_params == P.flow_lora_params(prof.model("flux-dev"), flux)


def test_quantized_base_bytes_follow_the_storage_formats(prof):
    m = prof.model("flux-dev")
    q = P.flow_quantizable_params(m)
    assert 0.99 * m.denoiser_params < q <= m.denoiser_params  # nearly every weight is a block Linear's
    bf16, fp8, nf4 = (P.base_weight_bytes(m, b) for b in ("bf16", "fp8", "nf4"))
    assert bf16 == pytest.approx(2 * m.denoiser_params)
    assert bf16 - fp8 == pytest.approx(q * 1.0)
    assert fp8 - nf4 == pytest.approx(q * (1.0 - 0.5625))  # 4 bits + one fp32 absmax per 64 weights


def test_fp32_loads_a_transformer_familys_weights_and_activations_in_fp32(prof):
    """training.precision=fp32 on FLUX.1 / SD3.5: the trainer loads every component in fp32 (runtime.weight_dtype)
    and the planner counted 2 bytes a weight: an fp32 FLUX.1-dev (44 GiB of transformer alone) was said to fit
    a 40 GB A100."""
    bf16 = replace(
        _flux_fp8_lora(),
        base_precision="bf16",
        cache_text_encoder_outputs=False,
        cache_latents=False,
        blocks_to_swap=0,
        precision="bf16",
    )
    fp32 = replace(bf16, precision="fp32")
    m16, m32 = P.memory(prof, bf16), P.memory(prof, fp32)
    model = prof.model("flux-dev")
    assert m32.frozen == pytest.approx(2 * m16.frozen)
    assert m32.frozen > 4 * (model.denoiser_params + model.text_encoder_params)
    assert m32.activations == pytest.approx(2 * m16.activations)
    fp8 = replace(fp32, base_precision="fp8")  # the quantized blocks stay 1 byte; the rest is fp32
    q = P.flow_quantizable_params(model)
    assert P.base_weight_bytes(model, "fp8", 4.0) == pytest.approx(q + 4 * (model.denoiser_params - q))
    assert P.memory(prof, fp8).frozen < m32.frozen


def test_memory_parts_move_with_each_knob(prof):
    base = _flux_fp8_lora()
    m = P.memory(prof, base)
    te = P.memory(prof, Settings(**{**base.__dict__, "cache_text_encoder_outputs": False}))
    # kohya's --fp8_base also stores the resident text encoders in fp8 (embeddings in bf16)
    assert te.frozen - m.frozen == pytest.approx(P.frozen_text_encoder_bytes(prof.model("flux-dev"), "fp8"))
    no_gc = P.memory(prof, Settings(**{**base.__dict__, "gradient_checkpointing": False}))
    assert no_gc.activations > 5 * m.activations
    b2 = P.memory(prof, Settings(**{**base.__dict__, "batch": 2}))
    assert b2.activations > 1.8 * m.activations
    # dequantising is a time per block Linear and pass, not FLOPs: the same for fp8 and nf4, none for bf16
    nf4, bf16 = (Settings(**{**base.__dict__, "base_precision": b}) for b in ("nf4", "bf16"))
    assert P.step_flops(prof, nf4) == P.step_flops(prof, base) == P.step_flops(prof, bf16)
    assert P.dequant_seconds(prof, nf4) == P.dequant_seconds(prof, base) > 0 == P.dequant_seconds(prof, bf16)


def test_published_peaks_are_reproduced(prof):
    """The Hugging Face flux-qlora blog's measured pair: nf4 ~9 GB, the 16-bit base ~26 GB at equal settings."""
    pts = {p.id: p for p in prof.points}
    for pid in ("hfblog-flux-qlora-rtx4090-nf4", "hfblog-flux-lora-bf16-base-26gb"):
        p = pts[pid]
        assert P.memory(prof, p.settings).step_peak / GiB == pytest.approx(
            p.outcome["peak_vram_gib"], rel=0.1
        )


def test_pins_and_hardware_rules(prof):
    r = _plan(prof, "RTX 4090", "flux-dev", 1024, pins=(("base_precision", "bf16"), ("blocks_to_swap", 0)))
    assert not r.feasible and "model.base_precision=fp8 fits" in "\n".join(r.reasons)
    r = _plan(prof, "RTX 4090", "sdxl", pins=(("base_precision", "nf4"),))
    assert not r.feasible and any("transformer families" in c for c in r.pin_conflicts)
    amd = P.hardware_from_catalog(prof.find_gpu("RX 7900 XTX"))
    r = P.plan(amd, prof, P.Request(method="lora", model="flux-dev", pins=(("base_precision", "nf4"),)))
    assert not r.feasible and any("NVIDIA CUDA GPUs only" in c for c in r.pin_conflicts)
    r = P.plan(amd, prof, P.Request(method="lora", model="flux-dev"))
    assert r.feasible and r.plan.base_precision in ("bf16", "fp8")  # never nf4 off CUDA


@pytest.mark.parametrize("method", ["textual-inversion"])
def test_other_methods_are_refused_in_one_line(prof, method):
    """Textual inversion is not trained for these families (full fine-tune and DreamBooth are planned:
    tests/test_plan_flow_full.py)."""
    with pytest.raises(UsageError, match="not supported for this family") as e:
        P.plan(
            P.hardware_from_catalog(prof.find_gpu("RTX 4090")),
            prof,
            P.Request(method=method, model="flux-dev"),
        )
    assert "\n" not in str(e.value)


def test_recommend_flux_on_a_4090_and_compare_stays_torch_free():
    from conftest import recommend_in_a_process

    d = json.loads(
        recommend_in_a_process("--method", "lora", "--model", "flux-dev", "--hardware", "RTX 4090", "--json")
    )
    assert d["feasible"] and d["plan"]["base_precision"] == "fp8" and d["plan"]["cache_text_encoder_outputs"]
    from typer.testing import CliRunner

    from sdplan.cli import app

    cards = "RTX 3060 12GB,RTX 4060 Ti 16GB,RTX 4090,RTX A6000,A100 SXM4 80GB"
    r = CliRunner().invoke(app, ["recommend", "--method", "lora", "--model", "flux-dev", "--compare", cards])
    assert r.exit_code == 0, r.output
    assert "fp8 base" in r.output and "swap" in r.output


def test_train_refuses_a_quantized_base_before_launch(tmp_path):
    from sdplan.launcher import UI, TrainRequest, run
    from sdplan.machine import Snapshot

    ds = make_images(tmp_path / "ds")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "method": "lora",
                "model": {
                    "path": "black-forest-labs/FLUX.1-dev",
                    "family": "flux-dev",
                    "base_precision": "nf4",
                },
                "data": {"path": str(ds), "resolution": 512},
            }
        )
    )
    snap = Snapshot.load(MACHINES / "2x_rtx4090_pcie.json")
    out = tmp_path / "o"
    req = TrainRequest(config=str(cfg), out=str(out), dry_run=True, snapshot=snap)
    with pytest.raises(UsageError) as e:
        run(req, UI(echo=lambda line: None))
    msg = str(e.value)
    # the machine's bitsandbytes (0.43.3) predates the one the nf4 base needs (tests/test_quantized_base.py); its
    # diffusers (0.31.0) the fp8 base's, so the way out offered is bf16 (fp8 was, and refused for the same reason)
    assert "model.base_precision nf4 needs bitsandbytes >= 0.46 (found 0.43.3)" in msg
    assert msg.endswith("or pin model.base_precision=bf16") and "\n" not in msg, msg
    assert not out.exists()


def test_registry_plans_what_the_flow_trainer_runs_for_the_transformer_families():
    from sdplan.trainer import flow

    for fam in registry.FLOW_FAMILIES:
        f = registry.family(fam)
        assert f.planned and not f.plans("textual-inversion")
        assert all(f.plans(m) for m in flow.METHODS) and set(f.methods) == set(flow.METHODS)
    assert registry.family("sdxl").plans("textual-inversion")


def test_swapped_blocks_must_fit_the_probed_host_ram(prof):
    """Block swap pins the swapped blocks in host RAM (the OS cannot page them out): on a probed machine with
    16 GB of RAM, a plan never pins more than 90% of it, and a plan whose model loading needs more RAM than the
    machine has says so."""
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    # with the packages the quantized bases need (the fixture's diffusers 0.31.0 runs neither: bf16 alone)
    packages = {**snap.software.packages, "diffusers": "0.33.0", "bitsandbytes": "0.46.0"}
    snap = replace(snap, software=replace(snap.software, packages=packages))
    ram = snap.host.ram_total_bytes
    res = P.plan(snap, prof, P.Request(method="lora", model="flux-dev"))
    assert res.feasible and res.plan.blocks_to_swap
    assert P.pinned_ram_bytes(prof, res.plan) <= 0.9 * ram
    assert any(r.startswith("warning: host RAM") for r in res.reasons)
    # a bf16 base swaps the most: on this machine no plan pins it, and the reason names the host RAM; the same
    # card from the catalog (RAM unknown) pins it, so the constraint comes from the probed RAM
    bf16 = P.Request(method="lora", model="flux-dev", pins=(("base_precision", "bf16"),))
    held = P.plan(snap, prof, bf16)
    assert not held.feasible
    assert any(r.startswith("host RAM:") and "more than 90% of this machine's" in r for r in held.reasons)
    free = P.plan(P.hardware_from_catalog(prof.find_gpu("RTX 3060 12GB")), prof, bf16)
    assert free.feasible and P.pinned_ram_bytes(prof, free.plan) > 0.9 * ram
    assert not any(r.startswith("warning: host RAM") for r in free.reasons)


# -- the H100 bench points of the transformer families (2026-11-26) ------------------------------------------


def _h100_flow_points(prof):
    return [p for p in prof.points if p.id.startswith("bench-nvidia-h100") and P.flow_family(p.model)]


def test_flow_activation_factor_reproduces_the_h100_peaks(prof):
    """33 peaks of FLUX.1 / SD3.5 Large / SD3.5 Medium LoRA (checkpointing on and off, 512-1024 px, batch 1-16):
    each model's own factor fitted on them (FLOW_ACTIVATION_FACTORS) puts every one within 8% (x1.5, the UNets'
    factor, over-predicted the large batches by up to 34%; one x1.13 for the three left SD3.5 Large 6% under).
    9 more, FLUX.1 over nf4 and fp8 bases with checkpointing, measured after the factors were fitted (2026-11-27),
    came out within 1.2%; 4 more, SD3.5 Medium without checkpointing at 1024 px batch 1-8 (2026-11-27, after
    SimpleTuner's sweep had suggested the factor without checkpointing was low), within 3.6%."""
    errors = []
    for p in _h100_flow_points(prof):
        if p.outcome.get("fits"):
            m = P.memory(prof, p.settings)
            errors.append((m.step_peak - m.overhead) / (p.outcome["peak_vram_gib"] * 2**30) - 1.0)
    assert len(errors) == 46
    assert max(abs(e) for e in errors) < 0.08


def test_hopper_gets_the_flow_efficiency_its_bench_points_measured(prof):
    cal = P.calibrate(prof)
    hopper = dict(cal.flow_by_family)["hopper"]
    assert 0.3 < hopper < 0.42  # of the measured GEMM rate; the published consumer-card points give ~0.8
    assert cal.flow_efficiency_for(prof.find_gpu("H200")) == hopper  # same architecture, no point of its own
    assert cal.flow_efficiency_for(prof.find_gpu("RTX 4090")) == cal.flow_efficiency
    # FLUX.1 [schnell] on an H100 (no point of its own) is [dev]'s network without the guidance embedder: its
    # plan is [dev]'s measured speed scaled by the model (T5 256 tokens against 512: 7% fewer FLOPs at 1024 px)
    dev = next(
        p for p in _h100_flow_points(prof) if p.id.endswith("flux-dev-1024-bf16-gc-adamw-cl-cte-r16-b4")
    )
    schnell = replace(dev.settings, model="flux-schnell")
    seconds, basis = P.planned_step_seconds(prof, schnell, prof.find_gpu("H100 SXM"), cal)
    assert basis == "scaled"
    assert 1.0 < 1.0 / seconds / dev.outcome["it_s"] < 1.1
    # its efficiency and launch-bound floor are [dev]'s
    assert cal.flow_efficiency_for(prof.find_gpu("H200"), "flux-schnell") == cal.flow_efficiency_for(
        prof.find_gpu("H200"), "flux-dev"
    )
    assert cal.step_floor_s(schnell) == cal.step_floor_s(dev.settings)


def test_a_model_measured_on_an_architecture_gets_its_own_efficiency_there(prof):
    """SD3.5 Medium's smaller matrices keep an H100 less busy than FLUX.1's: one Hopper efficiency for the three
    models put Medium's speeds 31-126% too fast. A model with BENCH_MIN_POINTS bench speeds on an architecture
    gets its own efficiency there (an H200, which has no point, uses the H100's); a model without keeps the
    architecture's, and another architecture the published one (times the model's H100 ratio to FLUX.1)."""
    import math

    cal = P.calibrate(prof)
    own = dict(cal.flow_by_model)
    hopper = dict(cal.flow_by_family)["hopper"]
    medium, dev = own[("hopper", "sd35-medium")], own[("hopper", "flux-dev")]
    assert medium < 0.8 * hopper < hopper < dev
    h200, h100 = prof.find_gpu("H200"), prof.find_gpu("H100 SXM")
    assert cal.flow_efficiency_for(h200, "sd35-medium") == medium
    assert cal.flow_efficiency_for(h200) == hopper  # no model named: the architecture's
    assert cal.flow_efficiency_for(h200, "flux-schnell") == dev  # [dev]'s network (registry speed_as)
    ratio = cal.flow_model_ratio("sd35-medium")[0]  # elsewhere the published one, times Medium's H100 ratio
    assert cal.flow_efficiency_for(prof.find_gpu("RTX 4090"), "sd35-medium") == cal.flow_efficiency * ratio
    # the model alone (as for an H200, which has no bench point) against Medium's H100 speeds: batch 2-16 within
    # a factor 1.2 either way (they were 1.31-1.52x too fast); batch 1, launch-bound, still 1.53x (2.26x before);
    # without checkpointing (measured 2026-11-27) batch 1-8
    points = {
        (p.settings.gradient_checkpointing, p.batch): p
        for p in _h100_flow_points(prof)
        if p.model == "sd35-medium" and p.outcome.get("it_s")
    }
    assert sorted(points) == [(False, 1), (False, 2), (False, 4), (False, 8)] + [
        (True, b) for b in (1, 2, 4, 8, 16)
    ]
    for (_, batch), p in points.items():
        ratio = 1.0 / P.step_seconds(prof, p.settings, h100, cal) / p.outcome["it_s"]
        assert abs(math.log(ratio)) < math.log(1.2 if batch > 1 else 1.6), (p.id, ratio)
    # a plan says whose efficiency it used
    res = P.plan(P.hardware_from_catalog(h200), prof, P.Request(method="lora", model="sd35-medium"))
    assert res.basis == "weakly_calibrated"
    assert f"at {medium * 100:.0f}% efficiency" in "\n".join(res.reasons)
    assert "Hopper GPUs (Stable Diffusion 3.5 Medium LoRA)" in "\n".join(res.reasons)


def test_no_flow_step_is_predicted_faster_than_the_launch_bound_floor_measured_for_its_model(prof):
    """FLUX.1 LoRA at 512 px on an H100 took 0.45 s a step at batch 1 and 0.43 s at batch 2: the host launching
    kernels, not the GPU, sets such a step. The UNets' floor did not cover the transformer families, and the
    unsloth B200 point (FLUX.1 nf4 LoRA, 512 px, batch 1: 1.81 it/s) was predicted at 12.2 it/s (+571%). No GPU,
    whatever its rating, runs a FLUX.1 LoRA step faster than that measured floor; the plan says where it is."""
    cal = P.calibrate(prof)
    flux = Settings(method="lora", model="flux-dev", resolution=512, gradient_checkpointing=False)
    floor = cal.step_floor_s(flux)
    assert floor == pytest.approx(1.0 / 2.238, rel=0.01)
    # checkpointing launches the forward's kernels twice: its own floor where one was measured (2.072 it/s;
    # SD3.5 Medium 2.463 with, 3.696 without, 2026-11-27)
    assert cal.step_floor_s(replace(flux, gradient_checkpointing=True)) == pytest.approx(
        1.0 / 2.072, rel=0.01
    )
    medium = replace(flux, model="sd35-medium")
    assert cal.step_floor_s(medium) == pytest.approx(1.0 / 3.696, rel=0.01)
    assert cal.step_floor_s(replace(medium, gradient_checkpointing=True)) == pytest.approx(
        1.0 / 2.463, rel=0.01
    )
    unsloth = next(p for p in prof.points if p.id == "unsloth6839-b200-flux-nf4-512-r16")
    b200 = prof.find_gpu("B200")
    predicted = 1.0 / P.step_seconds(prof, unsloth.settings, b200, cal)
    assert abs(predicted / unsloth.outcome["it_s"] - 1.0) < 0.2  # +14.5% (its step has checkpointing)
    res = _plan(prof, "B200", "flux-dev", 512, pins=(("batch", 1),))
    assert res.step_seconds >= floor
    assert any("launch-bound: no micro-step faster than 0.45 s" in r for r in res.reasons)
    assert res.basis == "calibrated"  # the floor is a measurement, not the uncalibrated efficiency


def test_an_architecture_without_its_own_flow_speed_borrows_the_one_measured_nearest_its_gemm_rate(prof):
    """The published SD3.5 / FLUX.1 efficiency (0.85) comes from GPUs of 44-167 TFLOPS; an H100 (786) measured
    0.41 for FLUX.1. A B200 (2250 TFLOPS, no flow speed of its own) took the published one and planned FLUX.1 at
    2.2x an H100's efficiency on 2.9x its rate. It now takes the H100's, per model, and says it is borrowed;
    the cards near the published GPUs keep the published fit."""
    cal = P.calibrate(prof)
    hopper_flux = dict(cal.flow_by_model)[("hopper", "flux-dev")]
    b200 = prof.find_gpu("B200")
    assert cal.flow_source(b200) == ("hopper", True)
    assert cal.flow_efficiency_for(b200, "flux-dev") == hopper_flux
    for near in ("RTX 4090", "RTX 5090", "A100 SXM 80GB", "L40S"):
        assert cal.flow_source(prof.find_gpu(near)) == (None, False), near
        assert cal.flow_efficiency_for(prof.find_gpu(near), "flux-dev") == cal.flow_efficiency
    # a B200 plans FLUX.1 at 1024 px no faster per FLOP than the H100 measured it
    h100 = prof.find_gpu("H100 SXM")
    dev = next(
        p for p in _h100_flow_points(prof) if p.id.endswith("flux-dev-1024-bf16-gc-adamw-cl-cte-r16-b4")
    )
    ratio = P.step_seconds(prof, dev.settings, h100, cal) / P.step_seconds(prof, dev.settings, b200, cal)
    assert ratio < 1.05 * b200.matmul_tflops("bf16") / h100.matmul_tflops("bf16")
    res = _plan(prof, "B200", "flux-dev", 1024)
    assert res.basis == "weakly_calibrated"
    assert any("borrowed: EXTRAPOLATED" in r for r in res.reasons)


def test_the_hopper_flow_efficiencies_are_fitted_where_the_step_grows_with_the_batch(prof):
    """FLUX.1 LoRA on the H100 ran at 0.41-0.43 of the GEMM rate at batches 4-16 and SD3.5 Medium at 0.26-0.27,
    but their launch-bound batch-1 steps read as 0.14-0.22: a geometric mean over every point put FLUX.1 at
    0.38 and Medium at 0.23, so the model alone was 10-15% slow where the GPU is busy. The floor explains those
    steps, so the fit leaves them to it."""
    import math

    cal = P.calibrate(prof)
    own = dict(cal.flow_by_model)
    h100 = prof.find_gpu("H100 SXM")
    for model in ("flux-dev", "sd35-medium"):
        busy = [
            p for p in _h100_flow_points(prof) if p.model == model and p.batch >= 4 and p.outcome.get("it_s")
        ]
        effs = [P._flow_point_efficiency(prof, p) for p in busy]
        assert abs(own[("hopper", model)] / math.exp(sum(map(math.log, effs)) / len(effs)) - 1) < 0.05, model
        for p in busy:  # the model alone, where the GPU is busy: within 8%
            ratio = 1.0 / P.step_seconds(prof, p.settings, h100, cal) / p.outcome["it_s"]
            assert abs(ratio - 1) < 0.08, (p.id, ratio)


def test_a_plan_at_measured_settings_takes_the_measured_peak_and_speed(prof):
    """FLUX.1 LoRA at 512 px on an H100: bf16 batch 4 without checkpointing was measured at 58.8 GiB allocated.
    The model's peak for it (62 GiB) with the validation band's upper end went over the card, and the plan
    quantized the base to fp8 to fit what had run in bf16."""
    r = _plan(prof, "H100 SXM", "flux-dev", 512)
    s = r.plan
    assert (s.base_precision, s.batch, s.gradient_checkpointing, s.cache_text_encoder_outputs) == (
        "bf16",
        4,
        False,
        True,
    )
    point = "bench-nvidia-h100-80gb-hbm3-lora-flux-dev-512-bf16-nogc-adamw-cl-cte-r16-b4"
    allocated = 58.846 * 2**30
    assert r.memory.peak == pytest.approx(allocated * (1 + P.ALLOCATOR_OVERHEAD) + P.CUDA_CONTEXT_BYTES)
    assert r.peak_range == pytest.approx((r.memory.peak * 0.95, r.memory.peak * 1.05))
    assert r.basis == "measured" and r.step_seconds == pytest.approx(1 / 1.418)
    assert any(point in line and "measured by sdplan bench" in line for line in r.reasons)
    assert P.result_dict(r)["estimate"]["peak_vram_basis"] == "measured"
    assert (
        P.result_dict(_plan(prof, "H100 SXM", "flux-dev", 768))["estimate"]["peak_vram_basis"] == "predicted"
    )
    # the text encoders on the GPU are other settings: FLUX.1 at 1024 px, checkpointing, batch 1 was measured
    # at 1.10 it/s with their outputs cached and 0.97 with them resident
    spec = prof.find_gpu("H100 SXM")
    cal = P.calibrate(prof)
    cached = next(
        p for p in _h100_flow_points(prof) if p.id.endswith("flux-dev-1024-bf16-gc-adamw-cl-cte-r16-b1")
    )
    resident = replace(cached.settings, cache_text_encoder_outputs=False)
    assert P.planned_step_seconds(prof, resident, spec, cal)[0] == pytest.approx(1 / 0.972)
    assert P.planned_step_seconds(prof, cached.settings, spec, cal)[0] == pytest.approx(1 / 1.101)


def test_flow_plans_near_a_bench_point_are_scaled_by_it(prof):
    """FLUX.1 LoRA at 768 px on an H100 (not measured): the model scaled by the nearest measured point."""
    spec = prof.find_gpu("H100 SXM")
    s = Settings(
        method="lora",
        model="flux-dev",
        resolution=768,
        batch=2,
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=True,
    )
    seconds, basis = P.planned_step_seconds(prof, s, spec, P.calibrate(prof))
    assert basis == "scaled"
    # between the measured 512 px (1.77 it/s) and 1024 px (0.58 it/s) steps at batch 2
    assert 0.58 < 1.0 / seconds < 1.77


def test_the_dequantisation_time_reproduces_the_measured_pairs(prof):
    """fp8 and nf4 cost a time per block Linear and pass (one constant, fitted on 6 same-GPU H100 pairs): the two
    batch-1 pairs, where it shows above the step's noise, come out within 20% (17% and 12% under), and a plan's reason states it."""
    s = P.Settings(method="lora", model="flux-dev", resolution=1024, batch=1, base_precision="fp8")
    fp8 = P.dequant_seconds(prof, replace(s, gradient_checkpointing=False))
    assert fp8 == pytest.approx(1 / 1.395 - 1 / 1.573, rel=0.2)  # bench points, H100, 2026-11-26
    nf4 = P.dequant_seconds(prof, replace(s, gradient_checkpointing=True, base_precision="nf4"))
    assert nf4 == pytest.approx(1 / 0.977 - 1 / 1.101, rel=0.2)  # 2026-11-27; checkpointing: 3 passes
    # held out: fp8 with checkpointing, measured after the constant was fitted (not refitted on it), against
    # bf16 at the same settings: every batch within 3%
    h100 = {p.id: p for p in _h100_flow_points(prof)}
    bf16_id = "bench-nvidia-h100-80gb-hbm3-lora-flux-dev-1024-bf16-gc-adamw-cl-cte-r16-b{}"
    for batch in (1, 2, 4, 8):
        fp8_point = h100[bf16_id.format(batch).replace("-r16-b", "-r16-fp8-b")]
        bf16_step = 1.0 / h100[bf16_id.format(batch)].outcome["it_s"]
        predicted = bf16_step + P.dequant_seconds(prof, fp8_point.settings)
        assert predicted == pytest.approx(1.0 / fp8_point.outcome["it_s"], rel=0.03)
    r = _plan(prof, "RTX 4090", "flux-dev", 1024, pins=(("base_precision", "fp8"),))
    assert "dequantising it adds ~0.10 s per step (494 block Linears x 3 passes" in "\n".join(r.reasons)


def test_a_quantized_base_says_what_the_bf16_base_would_cost(prof):
    """A quantized base changes the result: where the bf16 base also fits (with swap or checkpointing), the
    reason names the plan pinning it would give and how much longer that takes (on a 4090: blocks swapped)."""
    r = _plan(prof, "RTX 4090", "flux-dev", 1024)
    q = _plan(prof, "RTX 4090", "flux-dev", 1024, pins=(("base_precision", "bf16"),))
    assert r.plan.base_precision != "bf16" and q.feasible
    (base,) = [x for x in r.reasons if x.startswith("base precision")]
    assert (
        f"the bf16-base plan it would choose instead ({P.describe(q.plan)}) takes {q.seconds / r.seconds:.2f}x"
        in base
    )
    assert "pin model.base_precision=bf16" in base


def test_a_quantized_base_taken_for_the_caption_pass_says_so(prof):
    """SD3.5 Medium LoRA on an RTX 3060 12GB takes the fp8 base, and the reason said "the bf16 base (4.6 GiB)
    does not fit beside the rest"; pinned to bf16, what does not fit is the pass that encodes the captions
    before training: the text encoders in bf16 (T5-XXL's ~9 GiB) and the VAE, which the fp8 base stores in fp8."""
    r = _plan(prof, "RTX 3060 12GB", "sd35-medium", 1024, images=15, repeats=5)
    assert r.plan.base_precision == "fp8" and r.plan.cache_text_encoder_outputs
    (base,) = [x for x in r.reasons if x.startswith("base precision")]
    assert "does not fit beside the rest" not in base and "the caption pass does not fit" in base, base
    bf16 = P.memory(prof, replace(r.plan, base_precision="bf16"))
    assert f"take {bf16.text_cache_peak / GiB:.1f} GiB, over 92% of 12.0 GiB" in base, base
    q = _plan(
        prof, "RTX 3060 12GB", "sd35-medium", 1024, images=15, repeats=5, pins=(("base_precision", "bf16"),)
    )
    assert not q.feasible


@pytest.mark.parametrize("model", ["flux-dev", "sd35-large"])
def test_the_grid_of_a_transformer_family_brings_back_the_vae_not_the_text_encoders(prof, model):
    """The trainer samples SD3.5 / FLUX.1 grids from the cached text-encoder outputs (trainer/flow.py), so the
    grid's peak is the training state, the VAE back where latents were cached, and the larger of the
    transformer's inference forward and the VAE decode (activations.yaml sampling, computed on meta)."""
    base = replace(_flux_fp8_lora(), model=model)
    cached = P.memory(prof, base)
    resident = P.memory(prof, replace(base, cache_text_encoder_outputs=False))
    spec = prof.model(model)
    encoders = P.frozen_text_encoder_bytes(spec, "fp8")
    # the encoders count in the grid only where they never left the GPU (allocator allowance aside)
    assert resident.sampling_peak - cached.sampling_peak == pytest.approx(
        encoders * (1 + P.ALLOCATOR_OVERHEAD), rel=1e-6
    )
    assert cached.sampling_peak > cached.weights + cached.frozen + cached.optimizer
    # the bf16 VAE counts once in the grid: back on the GPU for the decode (latents cached), or never gone
    vae_resident = P.memory(prof, replace(base, cache_latents=False))
    assert vae_resident.frozen - cached.frozen == spec.params_vae * 2
    assert cached.sampling_peak == pytest.approx(vae_resident.sampling_peak, rel=1e-9)
    # FLUX.1 LoRA over an fp8 base on a 16 GB card: the step fits and so does the grid (T4 stayed away)
    hw = P.hardware_from_catalog(prof.find_gpu("RTX 4060 Ti 16GB"))
    res = P.plan(hw, prof, P.Request(method="lora", model="flux-dev", resolution=1024))
    assert res.feasible and res.memory.sampling_peak > 0 and P.final_grid_fits(res.memory, res.vram_bytes)
    assert not any("final sample grid" in r for r in res.reasons)


def test_a_model_the_published_speeds_never_measured_carries_its_bench_ratio(prof):
    """The published transformer-family speeds are all FLUX.1 [dev]; on the H100 sdplan bench measured SD3.5
    Medium and Large at lower efficiencies than FLUX.1. A GPU without bench data takes the published efficiency
    times that ratio for them (EXTRAPOLATED), FLUX.1 the published one as it is."""
    cal = P.calibrate(prof)
    assert cal.flow_published_models == ("flux-dev",)
    by_model = dict(cal.flow_by_model)
    l40s = prof.find_gpu("L40S")
    assert cal.flow_source(l40s) == (None, False)  # nearer the consumer cards' GEMM rates than the H100's
    assert cal.flow_model_ratio("flux-dev") == cal.flow_model_ratio("flux-schnell") == (1.0, None)
    assert cal.flow_efficiency_for(l40s, "flux-dev") == pytest.approx(cal.flow_efficiency)
    for model in ("sd35-medium", "sd35-large"):
        ratio, arch = cal.flow_model_ratio(model)
        assert arch == "hopper" and ratio == pytest.approx(
            by_model[("hopper", model)] / by_model[("hopper", "flux-dev")]
        )
        assert ratio < 1
        assert cal.flow_efficiency_for(l40s, model) == pytest.approx(cal.flow_efficiency * ratio)
        # the H100 keeps the model's own
        assert cal.flow_efficiency_for(prof.find_gpu("H100 SXM"), model) == by_model[("hopper", model)]
    res = _plan(prof, "L40S", "sd35-medium")
    assert any(
        "x0.6" in r and "measured by sdplan bench on Hopper GPUs (EXTRAPOLATED" in r for r in res.reasons
    )


def test_encoding_every_step_adds_to_the_launch_bound_floor(prof):
    """The transformer families' floors were measured with latents and text-encoder outputs cached: a VAE or
    T5 encode every step comes on top of the floor, not under it (under it, not caching looked free on a
    launch-bound card and the planner chose it)."""
    cal, gpu = P.calibrate(prof), prof.find_gpu("RTX 4090")
    cached = replace(_flux_fp8_lora(), model="sd35-medium", resolution=512, base_precision="bf16")
    floor = cal.step_floor_s(cached)
    floored, model_alone = P._step_times(prof, cached, gpu, cal)
    assert floored == pytest.approx(floor) and model_alone < floor  # launch-bound
    tflops = gpu.matmul_tflops("bf16") * 1e12 * cal.flow_efficiency_for(gpu, "sd35-medium")
    for change in ({"cache_latents": False}, {"cache_text_encoder_outputs": False}):
        encoding = replace(cached, **change)
        extra = (P.step_flops_flow(prof, encoding) - P.step_flops_flow(prof, cached)) / tflops
        assert extra > 0
        assert P.step_seconds(prof, encoding, gpu, cal) == pytest.approx(floor + extra)


def test_the_sample_grid_peak_matches_the_grids_measured_on_an_h100(prof):
    """benchmarks/sampling_peak.py measured the trainer's final sample grid after two steps of three bench points'
    settings on an H100 (sample_grid_peak_gib). With the meta count of the VAE decode alone the planner was
    3.7-11.9% under all three; the decode holds VAE_DECODE_FACTOR (x1.633, their mean) times that count. Each
    grid's allocated peak is now within 4%."""
    measured = [p for p in prof.points if p.outcome.get("sample_grid_peak_gib")]
    assert {p.model for p in measured} == {"sd15", "sdxl", "flux-dev"}
    for p in measured:
        m = P.memory(prof, p.settings)
        allocated = (m.sampling_peak - P.CUDA_CONTEXT_BYTES) / (1 + P.ALLOCATOR_OVERHEAD)
        assert allocated / 2**30 == pytest.approx(p.outcome["sample_grid_peak_gib"], rel=0.04), p.id


def test_train_says_the_time_basis_in_words_as_recommend_does(prof):
    """sdplan train's plan line said '(weakly_calibrated)', the JSON's word; recommend says 'weakly calibrated'."""
    from sdplan.launcher import describe_plan

    line = "\n".join(describe_plan(P.result_dict(_plan(prof, "RTX 4090", "flux-dev"))))
    assert "(weakly calibrated)" in line and "weakly_calibrated" not in line


@pytest.mark.parametrize(
    ("gpu", "pins", "stored", "gib"),
    [
        ("P40", (), "fp16", 4.6),  # no bf16 in hardware: the run's weights are fp16
        ("B200", (("precision", "fp32"), ("base_precision", "bf16")), "fp32", 9.2),
    ],
)
def test_an_unquantized_base_is_said_in_the_runs_weight_dtype(prof, gpu, pins, stored, gib):
    """model.base_precision=bf16 means "not quantized": the trainer stores the base in the run's weight dtype
    (trainer/runtime.py weight_dtype), and the breakdown counted it so, while the reason said a 4.6 GiB bf16 base."""
    r = _plan(prof, gpu, "sd35-medium", 1024, pins=pins)
    (base,) = [x for x in r.reasons if x.startswith("base precision")]
    assert f"base precision bf16 (not quantized: stored in {stored}, the run's weight dtype)" in base, base
    assert f"transformer takes {gib} GiB on the GPU" in base, base
