"""Invariants of the planner a user relies on, stated over many (GPU x family x method x settings) plans.

Each memory-saving knob never raises the predicted peak VRAM (turning gradient checkpointing on, a smaller LoRA
rank, cached latents or text-encoder outputs, more swapped blocks, a leaner frozen base, full bf16 weights, an
8-bit optimizer); a larger batch never lowers it; a card with more memory never gets "does not fit" where a
smaller one (else the same) fits; and "needs at least X GiB of GPU memory" is only ever computed from plans this
host can run (host RAM enough for DeepSpeed's offloaded optimizer or the swapped blocks), agrees with the
leanest configuration the reason names, and says so when the host RAM is what blocks the plan.

The memory sweeps call only :func:`planner.memory` (microseconds each), over every configuration the search
enumerates (:func:`planner.settings_space`) for one and two GPUs, in the precisions and attention paths the
catalog's GPUs get (bf16 / fp16 / fp32; the math attention path of RDNA1/2)."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import sdxl_sharded

from sdplan import planner as P
from sdplan import registry
from sdplan.profiles import GiB, clear_cache, load_profiles
from sdplan.settings import OFFLOAD, SHARDED, Settings

FAMILIES = tuple(f.name for f in registry.FAMILY_LIST)
UNET_FAMILIES = tuple(f for f in FAMILIES if not P.flow_family(f))
MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"
SLACK = 1.0  # bytes: a float sum's rounding, nothing more


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def _methods(family: str) -> list[str]:
    return [m for m in P.METHODS if registry.family(family).plans(m)]


_SPACES: dict[str, list[tuple[Settings, float]]] = {}


def _space(prof, family: str) -> list[tuple[Settings, float]]:
    """(configuration, predicted peak) for every configuration the search enumerates for this family, each
    method, in the precisions and attention paths the catalog's GPUs get (the transformer families' memory is
    the same in fp16 and bf16), with and without the pins that add memory (a trained text encoder, DreamBooth's
    prior preservation), at the native resolution on one and two GPUs and at half of it on one."""
    if family not in _SPACES:
        _SPACES[family] = [(s, P.memory(prof, s).peak) for s in _enumerate(prof, family)]
    return _SPACES[family]


def _enumerate(prof, family: str) -> Iterator[Settings]:
    native = prof.model(family).native_resolution
    flow = P.flow_family(family)
    combos = (
        [("bf16", "efficient")] if flow else [("bf16", "efficient"), ("fp32", "efficient"), ("fp16", "math")]
    )
    for method in _methods(family):
        pin_sets: list[tuple] = [()]
        if not flow and method != "textual-inversion":
            pin_sets.append((("train_text_encoder", True),))
        if method == "dreambooth":
            pin_sets.append((("prior_preservation", True),))
        for resolution, gpus in ((native, 2), (native // 2, 1)):
            for pins in pin_sets:
                req = P.Request(method=method, model=family, resolution=resolution, images=100, pins=pins)
                for precision, attention in combos:
                    yield from P.settings_space(req, precision=precision, attention=attention, max_gpus=gpus)


def _violations(
    prof, family: str, leaner: Callable[[Settings], Settings | None], peak: str = "peak"
) -> list[str]:
    """Settings where ``leaner(s)`` (a configuration that should need no more memory) predicts a higher peak
    (``peak``: the Memory field compared, the plan's or the step's)."""
    out, compared = [], 0
    for s, before in _space(prof, family):
        other = leaner(s)
        if other is None or other == s:
            continue
        compared += 1
        if peak != "peak":
            before = getattr(P.memory(prof, s), peak)
        after = getattr(P.memory(prof, other), peak)
        if after > before + SLACK:
            changed = {k: (getattr(s, k), getattr(other, k)) for k in Settings.__dataclass_fields__}
            changed = {k: v for k, v in changed.items() if v[0] != v[1]}
            out.append(
                f"{s.method} {s.model} {P.describe(s)}: {changed} raises the peak "
                f"{before / GiB:.3f} -> {after / GiB:.3f} GiB"
            )
    assert compared > 100, f"only {compared} configurations to compare"
    return out


# -- each memory saver never raises the predicted peak --------------------------------------------------------

SAVERS: dict[str, Callable[[Settings], Settings | None]] = {
    "gradient checkpointing on": lambda s: replace(s, gradient_checkpointing=True),
    "latents cached": lambda s: replace(s, cache_latents=True),
    "text-encoder outputs cached": lambda s: (
        None
        if s.train_text_encoder or s.method == "textual-inversion"
        else replace(s, cache_text_encoder_outputs=True)
    ),
    "a smaller LoRA rank": lambda s: replace(s, lora_rank=s.lora_rank // 2) if s.lora_rank else None,
    "an 8-bit optimizer instead of AdamW": lambda s: (
        replace(s, optimizer="adamw8bit")
        if s.optimizer == "adamw" and s.method != "textual-inversion"
        else None
    ),
    "full bf16 weights": lambda s: (
        replace(s, full_half_weights=True)
        if s.full_weights and s.precision == "bf16" and not s.offload
        else None
    ),
    "more blocks swapped": lambda s: (
        replace(s, blocks_to_swap=min(s.blocks_to_swap + 8, P.MAX_BLOCKS_TO_SWAP[s.model]))
        if P.flow_family(s.model) and s.method == "lora"
        else None
    ),
    # with the text encoders off the GPU: an nf4 base keeps them in bf16 where fp8 stores them in fp8 too
    # (trainer/quantize.py, planner.frozen_text_encoder_bytes), so with them resident nf4 can need more than fp8,
    # and so can the pass that encodes the captions before training (compared on the step's peak)
    "a leaner frozen base (bf16 -> fp8 -> nf4)": lambda s: (
        replace(s, base_precision={"bf16": "fp8", "fp8": "nf4"}[s.base_precision])
        if P.flow_family(s.model)
        and s.method == "lora"
        and s.base_precision != "nf4"
        and s.cache_text_encoder_outputs
        else None
    ),
}


FLOW_ONLY = ("more blocks swapped", "a leaner frozen base (bf16 -> fp8 -> nf4)")


@pytest.mark.parametrize(
    "family,saver",
    [(f, saver) for f in FAMILIES for saver in SAVERS if P.flow_family(f) or saver not in FLOW_ONLY],
)
def test_a_memory_saver_never_raises_the_predicted_peak(prof, family, saver):
    peak = "step_peak" if saver == "a leaner frozen base (bf16 -> fp8 -> nf4)" else "peak"
    bad = _violations(prof, family, SAVERS[saver], peak)
    assert not bad, f"{len(bad)} configurations, e.g. {bad[:3]}"


# -- more work never lowers it ----------------------------------------------------------------------------------

HEAVIER: dict[str, Callable[[Settings], Settings | None]] = {
    "a larger batch": lambda s: replace(s, batch=s.batch * 2),
    "a higher resolution": lambda s: replace(s, resolution=s.resolution + 256),
    "the text encoder trained too": lambda s: (
        replace(s, train_text_encoder=True)
        if not P.flow_family(s.model)
        and s.method != "textual-inversion"
        and not s.train_text_encoder
        and not s.cache_text_encoder_outputs
        else None
    ),
    "prior preservation": lambda s: replace(s, prior_preservation=True) if s.method == "dreambooth" else None,
    "an EMA copy on the GPU": lambda s: replace(s, ema="gpu") if s.full_weights else None,
    "gradient accumulation": lambda s: replace(s, grad_accum=2),
    "gradients kept between steps": lambda s: replace(s, set_grads_to_none=False),
}


@pytest.mark.parametrize("change", HEAVIER)
def test_more_work_never_lowers_the_predicted_peak(prof, change):
    """Over every family, each fifth configuration of the search (the savers above take them all)."""
    bad, compared = [], 0
    for family in FAMILIES:
        for s, before in _space(prof, family)[::5]:
            heavier = HEAVIER[change](s)
            if heavier is None or heavier == s:
                continue
            compared += 1
            after = P.memory(prof, heavier).peak
            if after < before - SLACK:
                bad.append(
                    f"{s.method} {family} {P.describe(s)}: {before / GiB:.3f} -> {after / GiB:.3f} GiB"
                )
    assert compared > 100
    assert not bad, f"{len(bad)} configurations, e.g. {bad[:3]}"


def test_deepspeed_offload_keeps_fp32_weights_on_the_gpu_in_fp32(prof):
    """deepspeed.json enables neither fp16 nor bf16 for training.precision=fp32 (sdplan.launch): the GPU holds the
    weights and the reduce / allgather buckets in fp32, twice the half-precision bytes (they were counted at 2 B
    whatever the precision, so training the text encoder too lowered an fp32 offload plan's peak)."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS

    for family, method in (("sd15", "finetune"), ("flux-dev", "finetune")):
        s = Settings(method=method, model=family, resolution=512, deepspeed=dict(OFFLOAD), precision="fp32")
        m, half = P.memory(prof, s), P.memory(prof, replace(s, precision="fp16"))
        assert m.weights == 4.0 * m.trainable_params == 2 * half.weights
        assert m.gradients == DEEPSPEED_BUCKET_ELEMENTS * 4.0 == 2 * half.gradients  # one process: one bucket


def test_deepspeed_offload_time_is_a_cpu_optimizer_step_and_pcie_copies(prof):
    """Offload's time was a x3.5 factor on the whole micro-step (a 2022 "3-4x slower" report), which made an
    accumulated SDXL fine-tune on a 4090 (SimpleTuner, validation) 11x too slow: the CPU optimizer step comes
    once per optimizer step, not per micro-step. Now: each micro-step the gradients cross PCIe; once per
    optimizer step CPU Adam (planner.CPU_ADAM_PARAMS_PER_S, measured by benchmarks/cpu_adam_rate.py) runs over
    the trained parameters and the weights come back. The GPU runs no optimizer step of its own."""
    cal = P.calibrate(prof)
    gpu = prof.find_gpu("RTX 4090")
    s = Settings(
        method="finetune",
        model="sdxl",
        resolution=1024,
        batch=8,
        gradient_checkpointing=True,
        cache_latents=True,
        deepspeed=dict(OFFLOAD),
        precision="bf16",
    )
    plain = replace(s, deepspeed=None)
    trained = P.trainable_params(prof.model("sdxl"), s, prof)
    link = P.PCIE_GBS[gpu.pcie_gen] * 1e9 * P.PCIE_EFFICIENCY
    expected = 2 * trained / link + (trained / P.CPU_ADAM_PARAMS_PER_S + 2 * trained / link)
    assert P.offload_seconds(prof, s, gpu) == pytest.approx(expected)
    assert P.optimizer_step_seconds(prof, s, gpu) == 0.0 < P.optimizer_step_seconds(prof, plain, gpu)
    added = P.step_seconds(prof, s, gpu, cal) - P.step_seconds(prof, plain, gpu, cal)
    assert added == pytest.approx(expected - P.optimizer_step_seconds(prof, plain, gpu))
    # accumulating 4 micro-steps spreads the CPU step: the added time per micro-step shrinks toward the copy
    ga4 = replace(s, grad_accum=4)
    assert P.offload_seconds(prof, ga4, gpu) == pytest.approx(
        2 * trained / link + (trained / P.CPU_ADAM_PARAMS_PER_S + 2 * trained / link) / 4
    )
    # SD 1.x full training at batch 1 on a 16 GB V100 (PCIe 3): ~3x the step, as the 2022 report's "3-4x"
    sd15 = Settings(
        method="finetune", model="sd15", resolution=512, precision="fp16", deepspeed=dict(OFFLOAD)
    )
    v100 = prof.find_gpu("V100 16GB")
    ratio = P.step_seconds(prof, sd15, v100, cal) / P.step_seconds(
        prof, replace(sd15, deepspeed=None), v100, cal
    )
    assert 2.5 < ratio < 4.0
    # the plan says what offload adds
    res = P.plan(
        P.hardware_from_catalog(gpu),
        prof,
        P.Request(method="finetune", model="sdxl", pins=(("deepspeed", dict(OFFLOAD)),)),
    )
    assert any("CPU Adam over 2.57 B parameters" in r for r in res.reasons), res.reasons


def test_deepspeed_zero2_splits_master_weights_state_and_gradients_over_the_gpus(prof):
    """ZeRO-2 without offload, per GPU: the half weights whole (2 B per parameter), the fp32 master weights and
    AdamW's two moments split N ways (12/N), the kept half gradients split too (2/N) beside the two reduce
    buckets, and at the step the fp32 gradient partition (4/N) and foreach AdamW's temporary (4/N). At the step
    that is DeepSpeed's own estimate, 2 + 18/N (stage_1_and_2.py estimate_zero2_model_states_mem_needs), and a
    CPU census of a two-process run gave 2 + 4/N, + 2/N after the backward, 2 + 12/N after the step."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS

    buckets = 2 * DEEPSPEED_BUCKET_ELEMENTS * 2.0
    for family in ("sdxl", "flux-dev"):
        for n in (2, 8):
            s = Settings(
                method="finetune",
                model=family,
                resolution=1024,
                precision="bf16",
                gradient_checkpointing=True,
                cache_latents=True,
                deepspeed=dict(SHARDED),
                num_gpus=n,
            )
            m = P.memory(prof, s)
            t = m.trainable_params
            assert m.weights == pytest.approx(2 * t)
            assert m.optimizer == pytest.approx(12 * t / n)
            assert m.gradients == pytest.approx(2 * t / n + buckets)
            assert m.step_transient == pytest.approx(8 * t / n)
            assert m.autocast_copies == 0.0
            # plain data parallelism holds fp32 weights, gradients, AdamW state and a bucket copy on every GPU
            assert m.peak < P.memory(prof, replace(s, deepspeed=None)).peak
    # ZeRO-2 moves half gradients (reduce-scatter each micro-step) and half weights (all-gather each step):
    # with accumulation it reduces every micro-step, where DDP all-reduces fp32 gradients once per step
    cal = P.calibrate(prof)
    s = Settings(
        method="finetune", model="sdxl", resolution=1024, deepspeed=dict(SHARDED), num_gpus=4, grad_accum=4
    )
    full = P.allreduce_seconds(prof, s, 64.0, cal)
    assert P.comm_seconds(prof, s, 64.0, cal) == pytest.approx(full / 2 + full / 8)
    ddp = replace(s, deepspeed=None)
    assert P.comm_seconds(prof, ddp, 64.0, cal) == pytest.approx(
        P.allreduce_seconds(prof, ddp, 64.0, cal) / 4
    )
    assert P.gradient_bytes(prof, ddp) == 2 * P.gradient_bytes(prof, s)


def test_ddp_gradients_are_the_buckets_one_copy_kept_between_steps(prof):
    """The trainer sets gradient_as_bucket_view=True: DDP's gradients are views into its all-reduce buckets, one
    copy, allocated for good (set_to_none frees nothing of it). The planner counted a second copy beside the
    buckets (DDP's default): benchmarks/multi_gpu_census.py measured 1.21 gradient-sizes after the backward
    with bucket views, 2.21 without."""
    for family in ("sd15", "sdxl", "flux-dev"):
        one = Settings(
            method="finetune",
            model=family,
            resolution=512,
            precision="bf16",
            gradient_checkpointing=True,
            cache_latents=True,
            cache_text_encoder_outputs=True,
        )
        two = replace(one, num_gpus=2)
        m1, m2 = P.memory(prof, one), P.memory(prof, two)
        assert m2.gradients == m1.gradients  # no second copy
        g = m1.gradients
        resident = m1.weights + m1.frozen + m1.optimizer + m1.ema
        forward = m1.activations + m1.autocast_copies
        assert m2.step_peak - m2.overhead == pytest.approx(resident + g + max(forward, m1.step_transient))
        assert m2.peak >= m1.peak  # the buckets stay through the next forward


def test_fp32_master_weights_over_several_gpus_beat_full_bf16_on_one(prof):
    """A FLUX.1 fine-tune on 8x H100 was planned on one GPU with bf16 weights and Adafactor: more GPUs could only
    offload the optimizer to the CPU (DDP gives every GPU a whole copy), "1.07-4.15x faster, but only with a
    less preferred setting". ZeRO-2 splitting the fp32 master weights and AdamW state fits from 7 GPUs; the
    plan takes them, and one GPU stays as it was."""
    h100 = prof.find_gpu("H100 SXM")
    req = P.Request(method="finetune", model="flux-dev", images=1000)
    res = P.plan(P.hardware_from_catalog(h100, count=8), prof, req)
    s = res.plan
    assert s.sharded and s.num_gpus == 8 and s.optimizer == "adamw" and not s.full_half_weights
    assert res.memory.peak <= h100.memory_bytes * P.HEADROOM
    assert any(r.startswith("DeepSpeed ZeRO-2 over 8 GPUs") for r in res.reasons), res.reasons
    assert not any("less preferred" in r for r in res.reasons)
    one = P.plan(P.hardware_from_catalog(h100), prof, req).plan
    assert one.num_gpus == 1 and one.deepspeed is None and one.full_half_weights
    # nothing to split over on one GPU: the search does not offer it there
    space = P.settings_space(
        replace(req, resolution=1024), precision="bf16", attention="efficient", max_gpus=1
    )
    assert not any(x.sharded for x in space)


# -- plans: more GPU memory never loses a plan; "needs at least" comes from what the host can run -------------


def _hardware(prof, gpu: str, *, vram_gib: float | None = None, ram_gib: float | None = None) -> P.Hardware:
    """A catalog GPU, with its memory replaced (else the same GPU) and a host RAM (None: not known)."""
    hw = P.hardware_from_catalog(prof.find_gpu(gpu))
    if vram_gib is not None:
        hw = replace(hw, gpus=tuple(replace(g, memory_bytes=int(vram_gib * GiB)) for g in hw.gpus))
    return replace(hw, ram_usable_bytes=None if ram_gib is None else int(ram_gib * GiB))


def _host_holds(prof, s: Settings, m: P.Memory) -> float:
    """What a configuration keeps in host RAM for the whole run: DeepSpeed's offloaded optimizer (the memory
    model's host RAM), block swap's pinned copies; nothing that must stay put otherwise."""
    held = m.ram if s.offload else 0.0
    return max(held, P.pinned_ram_bytes(prof, s)) if s.blocks_to_swap else held


def _leanest_runnable(prof, hw: P.Hardware, req: P.Request) -> tuple[list[Settings], P.Memory] | None:
    """The configurations of the search that need the smallest card (:func:`_required`) among those this host's
    RAM can hold."""
    gpu = hw.gpus[0]
    req = replace(req, resolution=req.resolution or prof.model(req.model).native_resolution)
    space = P.settings_space(
        req,
        precision=P.precision_for(hw.gpus),
        attention=P.attention_backend(gpu),
        nvidia=gpu.vendor == "nvidia",
        max_gpus=hw.count,
    )
    best = None
    for s in space:
        m = P.memory(prof, s)
        if hw.ram_usable_bytes and _host_holds(prof, s, m) > 0.9 * hw.ram_usable_bytes:
            continue
        need = _required(prof, req.model, m)
        if best is None or need < best[2] - SLACK:
            best = ([s], m, need)
        elif need <= best[2] + SLACK:
            best[0].append(s)
    return None if best is None else best[:2]


def _required(prof, model: str, m: P.Memory) -> int:
    """The card a predicted peak fits without the "may not fit" flag: the estimate within 92% of it and the
    likely peak's upper end within it (planner.peak_range_of: the validation set's band on the step's peak and on
    the caption pass's, the larger at each end)."""
    band = prof.uncertainty.peak_for(model)[0]
    upper = P.peak_range_of(m.step_peak, m.text_cache_peak, band, band)[1]
    return math.ceil(max(m.peak / P.HEADROOM, upper))


def _check_needs(prof, hw: P.Hardware, req: P.Request, res: P.Result) -> None:
    """An infeasible plan's "needs at least" is the leanest configuration this host can run, that configuration
    is the one the reason names, and it really is over the card's limit."""
    lean = _leanest_runnable(prof, hw, req)
    assert lean is not None
    leanest, mem = lean
    peak = mem.peak
    need = res.needs["min_vram_bytes"]
    assert need == _required(prof, req.model, mem), (req, hw.gpus[0].name, need / GiB, peak / GiB)
    assert res.memory.peak == pytest.approx(peak)
    assert peak > P.HEADROOM * hw.gpus[0].memory_bytes  # "more than its 92% limit" is true
    said = next(r for r in res.reasons if r.startswith("nothing fits"))
    assert f"at least {need / GiB:.1f} GiB of GPU memory" in said
    assert any(f"({P.describe(s)})" in said for s in leanest), said


VRAM_GIB = (6, 10, 16, 24, 48)


@pytest.mark.parametrize(
    "gpu,ram_gib", [("RTX 4090", None), ("T4", 32), ("RX 6700 XT", 16), ("RX 7700 XT", 64)]
)
def test_more_gpu_memory_never_loses_a_plan_and_each_does_not_fit_names_a_real_need(prof, gpu, ram_gib):
    """The same GPU (vendor, bf16, attention path) with more memory: once a plan fits, it fits on every larger
    card; each "does not fit" on the way names a need the card really lacks."""
    for family in ("sd15", "sdxl", "flux-dev"):
        for method in _methods(family):
            req = P.Request(method=method, model=family)
            fitted_at = None
            for gib in VRAM_GIB:
                hw = _hardware(prof, gpu, vram_gib=gib, ram_gib=ram_gib)
                res = P.plan(hw, prof, req)
                assert res.feasible or fitted_at is None, (
                    f"{method} {family}: fits {gpu} with {fitted_at} GiB, not with {gib} GiB: {res.reasons}"
                )
                if res.feasible:
                    fitted_at = gib
                else:
                    _check_needs(prof, hw, req, res)


@pytest.mark.parametrize(
    "gpu,family,method,ram_gib,fits_this_gpu",
    [
        ("RTX 3060 12GB", "sdxl", "finetune", 16, True),  # DeepSpeed offload fits the card, not the host RAM
        ("RTX 3070", "sdxl", "dreambooth", 32, False),  # offload is leaner, but not lean enough for 8 GB
        # offload: 20.7 GiB (likely 19.7-25.8) is under 92% of the 24 GiB card, its upper end over the card
        ("RTX 3090", "sd35-large", "finetune", 64, False),
        ("RTX 3060 12GB", "flux-dev", "finetune", 64, False),
        ("GTX 1060 6GB", "sd15", "dreambooth", 16, True),
        # block swap's pinned copies do not fit the host RAM, and the caption pass (T5 in fp8, 6.1 GiB) is
        # past 92% of the 6 GB card besides
        ("GTX 1060 6GB", "flux-dev", "lora", 8, False),
    ],
)
def test_needs_at_least_comes_from_configurations_the_host_ram_can_hold(
    prof, gpu, family, method, ram_gib, fits_this_gpu
):
    hw = _hardware(prof, gpu, ram_gib=ram_gib)
    req = P.Request(method=method, model=family)
    res = P.plan(hw, prof, req)
    assert not res.feasible
    _check_needs(prof, hw, req, res)
    # the leaner configuration only more host RAM allows is named, with the RAM it needs
    host = [r for r in res.reasons if r.startswith("host RAM: a leaner configuration")]
    assert host and "of host RAM" in host[0] and f"this machine's {ram_gib:.1f} GiB" in host[0], res.reasons
    assert ("(which this GPU has)" in host[0]) is fits_this_gpu, host[0]
    # with that host RAM the same GPU runs it
    big = P.plan(_hardware(prof, gpu, ram_gib=512), prof, req)
    assert (big.feasible and big.within_upper_bound) is fits_this_gpu, big.reasons
    assert not fits_this_gpu or big.plan.offload or big.plan.blocks_to_swap


def test_host_ram_too_small_for_every_configuration_says_so_without_a_gpu_memory_figure(prof):
    hw = _hardware(prof, "RTX 3060 12GB", ram_gib=8)
    req = P.Request(method="finetune", model="sd15", pins=(("deepspeed", dict(OFFLOAD)),))
    res = P.plan(hw, prof, req)
    assert not res.feasible and res.needs is None
    said = next(r for r in res.reasons if r.startswith("nothing fits"))
    assert "host RAM is the blocker" in said and "this machine's 8.0 GiB" in said, said
    assert any(r.startswith("fits when changed: distributed.deepspeed=null") for r in res.reasons)
    # with the host RAM it names, the pinned offload fits
    held = float(said.split("(at least ")[1].split(" GiB of host RAM")[0])
    assert P.plan(_hardware(prof, "RTX 3060 12GB", ram_gib=held + 0.1), prof, req).feasible


def test_without_a_gpu_needs_at_least_comes_from_what_the_host_ram_can_hold(prof):
    req = P.Request(method="finetune", model="sdxl")
    space = [  # any GPU: one with bf16 runs every configuration (full bf16 weights too)
        (s, P.memory(prof, s))
        for s in P.settings_space(replace(req, resolution=1024), precision="bf16", attention="efficient")
    ]
    for ram_gib, offload_runs in ((16, False), (1024, True)):
        limit = 0.9 * ram_gib * GiB
        runnable = [(s, m) for s, m in space if _host_holds(prof, s, m) <= limit]
        assert any(s.offload for s, _ in runnable) is offload_runs
        res = P.plan(P.Hardware(source="probe", gpus=(), ram_usable_bytes=int(ram_gib * GiB)), prof, req)
        need = res.needs["min_vram_bytes"]
        assert need == min(_required(prof, req.model, m) for _, m in runnable)
        (said,) = [r for r in res.reasons if r.startswith("no usable GPU on this machine")]
        assert f"needs at least {need / GiB:.1f} GiB of GPU memory" in said


@pytest.mark.parametrize(
    "gpu,family,method,ram_gib",
    [
        ("RTX 3060 12GB", "sdxl", "finetune", 32),  # needs full bf16 weights: no V100 (it has no bf16)
        ("GTX 1060 6GB", "sd15", "dreambooth", 16),
        ("RX 6700 XT", "flux-dev", "lora", 8),
        ("RTX 3070", "sd35-large", "dreambooth", None),
    ],
)
def test_every_gpu_the_plan_says_would_fit_does(prof, gpu, family, method, ram_gib):
    req = P.Request(method=method, model=family)
    res = P.plan(_hardware(prof, gpu, ram_gib=ram_gib), prof, req)
    assert not res.feasible
    suggested = res.needs["suggested_hardware"]
    assert suggested
    for name in suggested:  # and fits without the "may not fit" flag
        own = P.plan(_hardware(prof, name, ram_gib=ram_gib), prof, req)
        assert own.feasible and own.within_upper_bound, (name, suggested)


# -- "needs at least", the cards that would fit and the verdict are one rule (planner.vram_required) ---------

# (the card too small, family, method): a sample of the sweep over families x methods x catalog GPUs in which a
# suggested card's own plan was flagged "may not fit" (FLUX.1 fine-tune on a 4090 suggested the 32 GB RTX 5090)
WOULD_FIT_TABLE = [
    ("RTX 4090", "flux-dev", "finetune"),
    ("GTX 1650", "sdxl", "lora"),
    ("RTX 2060 6GB", "sdxl", "finetune"),
    ("T4", "flux-dev", "finetune"),  # fp16 only, with bench points of its own
    ("RX 6700 XT", "sd35-large", "dreambooth"),  # no 8-bit AdamW or nf4 off NVIDIA
]


@pytest.mark.parametrize("gpu,family,method", WOULD_FIT_TABLE)
def test_a_card_said_to_fit_gets_a_plan_without_the_may_not_fit_flag(prof, gpu, family, method):
    req = P.Request(method=method, model=family)
    res = P.plan(_hardware(prof, gpu), prof, req)
    assert not res.feasible
    need, suggested = res.needs["min_vram_bytes"], res.needs["suggested_hardware"]
    # a GTX 16 card's need is in the fp32 it trains in; the cards said to fit train in fp16 or bf16
    floor = res.needs["min_vram_bytes_mixed_precision"] or need
    assert suggested
    for name in suggested:
        own = P.plan(_hardware(prof, name), prof, req)
        assert own.feasible and own.within_upper_bound, (name, need / GiB, own.peak_range)
        assert prof.find_gpu(name).memory_bytes >= floor
        assert P.vram_required(own.memory.peak, own.peak_range) <= own.vram_bytes


@pytest.mark.parametrize(
    "gpu,family,method", [("RTX 3060 8GB", "sdxl", "dreambooth"), ("RTX 4090", "flux-dev", "finetune")]
)
def test_needs_at_least_is_the_smallest_card_the_verdict_accepts(prof, gpu, family, method):
    """The same GPU with exactly the memory "needs at least" names fits without the flag; a byte less does not
    (the figure was the estimate / 92%, on which the likely range's upper end was over the card)."""
    req = P.Request(method=method, model=family)
    need = P.plan(_hardware(prof, gpu), prof, req).needs["min_vram_bytes"]
    at = P.plan(_hardware(prof, gpu, vram_gib=need / GiB), prof, req)
    assert at.vram_bytes == need and at.feasible and at.within_upper_bound, at.peak_range
    below = P.plan(_hardware(prof, gpu, vram_gib=(need - 1) / GiB), prof, req)
    assert below.vram_bytes == need - 1 and not (below.feasible and below.within_upper_bound)


def test_recommend_on_a_machine_names_the_host_ram_it_lacks():
    """A 12 GB card in a 16 GB machine (fixture): SDXL fine-tune needs more than the card with what the host can
    run (it said 'needs at least 9.5 GiB', from an offload plan needing 60 GiB of host RAM); a pinned offload the
    host RAM cannot hold says so instead of 'needs at least - of GPU memory'."""
    from typer.testing import CliRunner

    from sdplan.cli import app

    machine = str(MACHINES / "rtx3060_12gb.json")
    runner = CliRunner()
    out = runner.invoke(
        app, ["recommend", "--method", "finetune", "--model", "sdxl", "--machine", machine]
    ).output
    need = re.search(r"does not fit: needs at least ([\d.]+) GiB of GPU memory", out)
    assert need and float(need.group(1)) > 12, out
    assert "host RAM: a leaner configuration" in out and "60.4 GiB in host RAM" in out
    pin = "distributed.deepspeed={zero_stage: 2, offload_optimizer: true}"
    out = runner.invoke(
        app, ["recommend", "--method", "finetune", "--model", "sd15", "--machine", machine, pin]
    ).output
    assert "does not fit: this machine's host RAM is too small for it" in out, out
    assert "host RAM is the blocker" in out and "needs at least -" not in out


def test_without_a_gpu_needs_at_least_is_the_smallest_card_any_gpu_could_run_it_on(prof):
    """No GPU here: FLUX.1 fine-tune was said to need 103.8 GiB (fp16 mixed precision, no full bf16 weights),
    while an 80 GB H100 plans it with full bf16 weights. The figure is now the bf16 card's, with the one
    without bf16 beside it, and the smallest suggested card runs it."""
    req = P.Request(method="finetune", model="flux-dev")
    res = P.plan(P.Hardware(source="probe", gpus=(), ram_usable_bytes=int(24 * GiB)), prof, req)
    need = res.needs["min_vram_bytes"]
    without = P.min_vram_needed(req, prof, precision="fp16", ram_usable_bytes=int(24 * GiB))
    assert need == P.min_vram_needed(req, prof, precision="bf16", ram_usable_bytes=int(24 * GiB)) < without
    assert (
        f"needs at least {need / GiB:.1f} GiB of GPU memory on a GPU with bf16 ({without / GiB:.1f} GiB without)"
        in next(r for r in res.reasons if r.startswith("no usable GPU on this machine"))
    )
    assert P.plan(_hardware(prof, "H100 SXM", ram_gib=24), prof, req).feasible


def test_deepspeed_buckets_follow_the_config_overlap(prof):
    """One process reduces with no one: sdplan's DeepSpeed config leaves overlap_comm off there and the planner
    counts the one reduce bucket DeepSpeed then allocates; several processes overlap, with a second bucket."""
    from sdplan.config import DeepSpeedConfig, TrainConfig
    from sdplan.launch import deepspeed_config
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS

    for n in (1, 2, 4):
        cfg = TrainConfig()
        cfg.distributed.deepspeed = DeepSpeedConfig(zero_stage=2, offload_optimizer=True)
        cfg.distributed.num_processes = n
        overlap = deepspeed_config(cfg)["zero_optimization"]["overlap_comm"]
        s = Settings(method="finetune", model="sd15", resolution=512, deepspeed=dict(OFFLOAD), num_gpus=n)
        buckets = P.memory(prof, s).gradients / (DEEPSPEED_BUCKET_ELEMENTS * 2.0)
        assert (overlap, buckets) == ((False, 1.0) if n == 1 else (True, 2.0))


def test_deepspeed_activations_have_no_autocast_share(prof):
    """Under DeepSpeed accelerate runs no autocast: a UNet's activations take DEEPSPEED_ACTIVATION_FACTOR of the
    saved bytes, not ACTIVATION_FACTOR (fitted under autocast), so its peak grows more slowly with the batch."""
    base = Settings(
        method="finetune", model="sdxl", resolution=1024, precision="bf16", gradient_checkpointing=True
    )
    for ds in (None, dict(OFFLOAD)):
        s = replace(base, deepspeed=ds)
        one, eight = P.memory(prof, s), P.memory(prof, replace(s, batch=8))
        grown = eight.activations - one.activations
        if ds is None:
            plain = grown
        else:
            assert grown / plain == pytest.approx(
                P.DEEPSPEED_ACTIVATION_FACTOR / P.ACTIVATION_FACTOR, rel=0.02
            )


SDXL_SHARDED = sdxl_sharded()


def test_deepspeed_without_offload_peaks_at_the_step_without_the_half_gradients(prof):
    """Measured (H100, one process, SDXL ZeRO-2 at batch 1 and 4): the peak is the resident bytes + the step's
    temporaries, the half gradients and buckets already let go; counting them too put it 12% high."""
    s = SDXL_SHARDED
    for batch in (1, 4):
        m = P.memory(prof, replace(s, batch=batch))
        resident = m.weights + m.frozen + m.optimizer
        assert m.step_peak - m.overhead == pytest.approx(resident + m.step_transient)


def test_deepspeed_sharded_step_counts_the_flattening_of_the_half_gradients(prof):
    """DeepSpeed's step() turns the kept half gradient partition into a flat copy and that into the fp32
    partition before it frees either (deepspeed/runtime/zero/stage_1_and_2.py step @0.19.8): 2 + 2 + 4 bytes per
    parameter of the partition, what foreach AdamW's step (fp32 partition + its temporary) also takes. An
    optimizer without foreach's temporary (Lion, pinned) was counted at 4 bytes: 9.6 GiB short for SDXL."""
    s = SDXL_SHARDED
    for n in (1, 2, 4):
        for optimizer in ("adamw", "lion"):
            m = P.memory(prof, replace(s, optimizer=optimizer, num_gpus=n))
            assert m.step_transient == pytest.approx(8.0 * m.trainable_params / n)
            resident = m.weights + m.frozen + m.optimizer
            assert m.step_peak - m.overhead >= resident + m.step_transient - 1


def test_deepspeed_sharded_accumulation_holds_the_partition_not_the_buckets(prof):
    """DeepSpeed frees its reduce buckets at the end of every backward (_release_ipg_buffers) and keeps the
    gradient partition: with accumulation the next forward runs beside the partition alone, the next backward
    beside it and its own partition buffer and buckets (stage_1_and_2.py independent_gradient_partition_epilogue
    @0.19.8)."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS

    s = Settings(method="finetune", model="sdxl", resolution=1024, deepspeed=dict(SHARDED), grad_accum=2)
    bucket = DEEPSPEED_BUCKET_ELEMENTS * 2.0  # one process: one bf16 bucket
    kept = 10e9
    grads = kept + bucket
    step = 1e9
    # the forward beside the kept partition
    assert P.step_allocated_bytes(
        s, resident=0.0, grads=grads, buckets=0.0, forward=30e9, step=step, recompute_tail=1e9
    ) == pytest.approx(30e9 + kept)
    # the backward beside the kept partition, a new one and the bucket
    assert P.step_allocated_bytes(
        s, resident=0.0, grads=grads, buckets=0.0, forward=5e9, step=step, recompute_tail=1e9
    ) == pytest.approx(grads + kept + 1e9)
    one = replace(s, grad_accum=1)  # nothing held between steps
    assert P.step_allocated_bytes(
        one, resident=0.0, grads=grads, buckets=0.0, forward=5e9, step=step, recompute_tail=1e9
    ) == pytest.approx(grads + 1e9)


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "sharded"])
def test_a_zero1_plan_says_zero1_not_zero2(prof, offload):
    """A plan pinned to ZeRO-1 (deepspeed.json stage 1) explained itself as "DeepSpeed ZeRO-2 with optimizer
    offload" / "DeepSpeed ZeRO-2 over 1 GPUs" and its GPU-count reasons as "(DeepSpeed ZeRO-2)"."""
    ds = {"zero_stage": 1, "offload_optimizer": offload}
    req = P.Request(method="finetune", model="sd15", images=100, pins=(("deepspeed", ds),))
    gpu = prof.find_gpu("H100 SXM" if not offload else "RTX 4090")
    res = P.plan(P.hardware_from_catalog(gpu, count=2), prof, req)
    assert res.plan.deepspeed == ds
    text = "\n".join(res.reasons)
    assert "ZeRO-1" in text and "ZeRO-2" not in text, text
    assert "1 GPUs" not in text, text


def test_a_zero2_plan_without_offload_takes_no_speed_or_peak_from_an_offload_run(prof):
    """SDXL ZeRO-2 without offload on an H100 at the settings measured both ways (2026-11-27: 2.11 s a step
    with offload, CPU Adam; 1.02 s without): the plan took the offload run's 0.47 it/s "from a published speed
    with these settings", since matching knew DeepSpeed but not offload; peaks and recorded out-of-memory
    errors, matched the same way, would have crossed over too (10 GiB offloaded against 54 sharded). Planned on
    two H100s (ZeRO without offload on one GPU is refused: pin_conflicts), each from its own one-GPU speed."""
    req = P.Request(
        method="finetune",
        model="sdxl",
        images=100,
        pins=(
            ("batch", 4),
            ("gradient_checkpointing", True),
            ("optimizer", "adamw"),
            ("cache_latents", True),
            ("cache_text_encoder_outputs", False),
            ("num_gpus", 2),
        ),
    )
    h100 = P.hardware_from_catalog(prof.find_gpu("H100 SXM"), 2)
    its = {}
    for name, ds in (("sharded", SHARDED), ("offload", OFFLOAD)):
        res = P.plan(h100, prof, replace(req, pins=(*req.pins, ("deepspeed", dict(ds)))))
        assert res.plan.deepspeed == ds
        its[name] = P.result_dict(res)["estimate"]["it_per_s"]
    # the measured 1.02 s a step, plus the gradient exchange the second GPU adds
    assert 0.85 < its["sharded"] < 1 / 1.02, its
    assert its["offload"] == pytest.approx(1 / 2.111, rel=0.01), its
    s = Settings(method="finetune", model="sdxl", resolution=1024, precision="bf16", deepspeed=dict(SHARDED))
    assert P._memory_settings(s) != P._memory_settings(replace(s, deepspeed=dict(OFFLOAD)))


def test_pinned_full_bf16_weights_never_plan_deepspeed(prof):
    """Pinned full bf16 weights on a card too small for them without DeepSpeed: the search took DeepSpeed
    offload beside them (a config sdplan.config now refuses: DeepSpeed keeps fp32 master weights of its own)."""
    req = P.Request(
        method="finetune", model="sdxl", resolution=1024, images=100, pins=(("full_half_weights", True),)
    )
    space = list(P.settings_space(req, precision="bf16", attention="efficient", max_gpus=2))
    assert space and all(s.full_half_weights for s in space)
    assert not any(s.deepspeed for s in space)


def test_a_lora_under_sharded_deepspeed_holds_its_partition_without_the_buckets(prof):
    """A LoRA pinned to ZeRO-2 without offload is planned with DeepSpeed's states too (its reduce buckets among
    its gradients), so with accumulation the kept partition between micro-steps is its gradients less those
    buckets, as for a full method."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS

    s = Settings(
        method="lora", model="sdxl", resolution=1024, deepspeed=dict(SHARDED), num_gpus=2, grad_accum=2
    )
    m = P.memory(prof, s)
    buckets = 2 * DEEPSPEED_BUCKET_ELEMENTS * 2.0
    assert m.gradients > buckets
    kept = m.gradients - buckets
    forward = P.step_allocated_bytes(
        s, resident=0.0, grads=m.gradients, buckets=0.0, forward=100e9, step=0.0, recompute_tail=0.0
    )
    assert forward == pytest.approx(100e9 + kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_count_shortcut_gives_what_the_count_itself_computes(prof, family):
    """The search sizes a configuration once for every count of 2+ GPUs without DeepSpeed and times its step once
    for every count (planner._memory_on, _step_times_on): for each count the same Memory and step times, to the
    bit, as computing them for that count (every 4th configuration the search enumerates, on 3 and 8 GPUs,
    with no link rate and a PCIe link's)."""
    spec = prof.gpu_or_none("H100 SXM")
    cal = P.calibrate(prof)
    for s in itertools.islice(_enumerate(prof, family), 0, None, 4):
        for n in (3, 8):
            on_n = replace(s, num_gpus=n)
            assert P._memory_on(prof, on_n) == P._memory(prof, on_n), P.describe(on_n)
            for link_gbs in (None, 32.0):
                assert P._step_times_on(prof, on_n, spec, cal, link_gbs) == P._compute_step_times(
                    prof, on_n, spec, cal, link_gbs
                ), P.describe(on_n)


SEARCHES = (  # (method, family, GPU, count): large searches, chosen counts of 1 and more, lowered ranks, DeepSpeed
    ("lora", "flux-dev", "H100 SXM", 8),
    ("lora", "sdxl", "RTX 3060 12GB", 1),
    ("lora", "sdxl", "RTX 4090", 2),
    ("dreambooth", "sdxl", "RTX 4090", 2),
    ("finetune", "sd35-large", "A100 80GB PCIe", 4),
    ("textual-inversion", "sd15", "T4", 1),
    ("lora", "sd15", "mixed", 3),
)


@pytest.mark.parametrize(("method", "family", "gpu", "count"), SEARCHES)
def test_the_search_skips_only_what_no_count_would_choose(prof, method, family, gpu, count):
    """planner._search skips a GPU count's tiers that lose by the tier alone: each count's best and the chosen
    count's fitting candidates (what the reasons weigh) are those of the whole search, to the bit; and it skips."""
    from test_planner_mixed import RTX3060, RTX3090, RTX4090, machine

    if gpu == "mixed":
        hw = P.hardware_from_snapshot(machine(RTX3060, RTX4090, RTX3090), prof)
    else:
        hw = P.hardware_from_catalog(prof.find_gpu(gpu), count)
    req = P.Request(method=method, model=family)
    resolution = prof.model(family).native_resolution
    cal = P.calibrate_for(prof, hw)
    every = P._candidates(req, prof, hw, cal, resolution)
    whole = [c for c in every if c.fits]
    cands, on_count = P._search(req, prof, hw, cal, resolution)
    best, best_by_n = P._choose(whole, prof)
    assert P._choose([c for c in cands if c.fits], prof) == (best, best_by_n)
    for n in best_by_n:
        assert on_count(n) == [c for c in whole if c.setup.num_gpus == n]
    if method == "lora":
        assert len(cands) < len(every)
