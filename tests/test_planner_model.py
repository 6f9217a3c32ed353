"""The planner's memory and time mechanisms (issue 10, item 3): each fix checked against first principles."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import yaml
from conftest import sdxl_sharded

from sdplan import planner as P
from sdplan.profiles import GiB, clear_cache, load_profiles  # noqa: F401
from sdplan.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def _compute_activations():
    """scripts/compute_activations.py as a module (the meta-device builds the profiles come from)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compute_activations
    finally:
        sys.path.pop(0)
    return compute_activations


def _lora(**kw) -> Settings:
    base = dict(method="lora", model="sd15", resolution=512, precision="bf16", lora_rank=32)
    return Settings(**{**base, **kw})


# -- LoRA targets ------------------------------------------------------------------------------------------


def test_lora_target_sets_from_module_names():
    assert P.lora_target_set(_lora()) == "attn"
    assert P.lora_target_set(_lora(lora_targets=P.LORA_TARGETS_ATTN)) == "attn"
    assert P.lora_target_set(_lora(lora_targets=P.LORA_TARGETS_KOHYA)) == "attn_ff"
    assert P.lora_target_set(_lora(lora_targets=P.LORA_TARGETS_LOCON)) == "attn_ff_conv"


def test_kohya_lora_dim128_is_the_known_151_mb_file(prof):
    # kohya's SD1.x LoRA at network_dim 128 (UNet Transformer2DModel linears + CLIPAttention/CLIPMLP) is the
    # widely seen ~151 MB fp16 file: 75,497,472 parameters, from the layer shapes alone
    s = _lora(lora_rank=128, lora_targets=P.LORA_TARGETS_KOHYA, train_text_encoder=True)
    assert P.lora_params(prof, s) == 75_497_472
    # the attention-only count is what the config-based formula gives
    attn = _lora(lora_rank=16)
    assert P.lora_params(prof, attn) == prof.model("sd15").lora_params(16)


def test_more_lora_targets_cost_more_memory(prof):
    peaks = [
        P.memory(prof, _lora(lora_targets=t, model="sdxl", resolution=1024)).peak
        for t in (P.LORA_TARGETS_ATTN, P.LORA_TARGETS_KOHYA, P.LORA_TARGETS_LOCON)
    ]
    assert peaks[0] < peaks[1] < peaks[2]
    trained = [
        P.memory(prof, _lora(lora_targets=t, model="sdxl", resolution=1024)).trainable_params
        for t in (P.LORA_TARGETS_ATTN, P.LORA_TARGETS_KOHYA, P.LORA_TARGETS_LOCON)
    ]
    assert trained == [32 * n for n in (1_451_520, 2_659_840, 3_074_240)]


@pytest.mark.slow
@pytest.mark.parametrize("targets", ["LORA_TARGETS_ATTN", "LORA_TARGETS_KOHYA", "LORA_TARGETS_LOCON"])
def test_lora_params_equal_peft_on_meta(prof, targets):
    """The per-rank counts in activations.yaml equal peft's own LoRA on the real UNet (meta device)."""
    pytest.importorskip("peft")
    pytest.importorskip("diffusers")
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    cfg = yaml.safe_load((ROOT / "profiles" / "models" / "sd15.yaml").read_text())["unet"]
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(dict(cfg))
    unet.add_adapter(LoraConfig(r=4, target_modules=list(getattr(P, targets))))
    counted = sum(p.numel() for n, p in unet.named_parameters() if "lora_" in n)
    assert P.lora_params(prof, _lora(lora_rank=4, lora_targets=getattr(P, targets))) == counted


@pytest.mark.slow
def test_compute_activations_counts_match_the_profile(prof):
    """The script's per-rank counts are what profiles/activations.yaml holds (re-run it when this fails)."""
    pytest.importorskip("diffusers")
    ca = _compute_activations()
    model = yaml.safe_load((ROOT / "profiles" / "models" / "sd15.yaml").read_text())
    assert ca.lora_params_per_rank(model) == prof.activations.lora_params_per_rank("sd15")


# -- gradients freed between steps vs autocast's half copies ------------------------------------------------


# DreamBooth of SD 1.5 with its text encoder; a keyword changes a field.
_db_te = partial(
    Settings,
    method="dreambooth",
    model="sd15",
    resolution=512,
    precision="fp16",
    gradient_checkpointing=True,
    optimizer="adamw8bit",
    train_text_encoder=True,
)


def test_freed_gradients_do_not_coexist_with_autocast_copies(prof):
    """zero_grad(set_to_none=True): the fp32 gradients (4 B/param) exist only from the backward on, the half
    copies autocast caches (2 B/param) only until the forward ends: the peak holds the larger, not both."""
    kept = P.memory(prof, _db_te(set_grads_to_none=False))
    freed = P.memory(prof, _db_te(set_grads_to_none=True))
    t = freed.trainable_params
    assert kept.peak - freed.peak >= 0.9 * min(2 * t, 4 * t) * (1 + P.ALLOCATOR_OVERHEAD) - 1
    # diffusers PR 2039: SD1.5 DreamBooth + text encoder, GC, 8-bit Adam, fp16 runs on a 12 GB RTX 3060
    assert freed.peak < 12 * GiB
    # the freed gradients still bound the peak from below: weights + optimizer + gradients
    assert freed.peak > freed.weights + freed.optimizer + freed.gradients


def test_peak_grows_with_batch_under_checkpointing(prof):
    """The last recomputed segment sits beside the full gradients: larger batches still cost memory."""
    assert P.memory(prof, _db_te(batch=4)).peak > P.memory(prof, _db_te(batch=1)).peak


# -- optimizers users pick ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bytes_per_param"),
    [("adamw", 8), ("adamw8bit", 2), ("prodigy", 16), ("dadaptation", 12), ("lion", 4), ("lion8bit", 1)],
)
def test_optimizer_state_bytes_from_their_state_tensors(prof, name, bytes_per_param):
    """fp32 trainable weights: Prodigy keeps s, p0, exp_avg, exp_avg_sq; DAdaptAdam s, exp_avg, exp_avg_sq;
    Lion exp_avg; the 8-bit variants one byte per state tensor."""
    s = Settings(method="finetune", model="sd15", resolution=512, precision="bf16", optimizer=name)
    m = P.memory(prof, s)
    assert m.optimizer == pytest.approx(bytes_per_param * m.trainable_params)


def test_half_weights_halve_the_optimizer_copies(prof):
    base = dict(method="finetune", model="sdxl", resolution=1024, precision="bf16", optimizer="prodigy")
    fp32 = P.memory(prof, Settings(**base)).optimizer
    half = P.memory(prof, Settings(**base, full_half_weights=True)).optimizer
    assert half == pytest.approx(fp32 / 2)


def test_modelled_optimizers_have_a_step_cost_and_are_not_searched():
    from sdplan import registry

    assert set(registry.MODELLED_OPTIMIZERS) <= set(P.OPTIMIZER_STEP_BYTES)
    assert {"prodigy", "lion", "dadaptation"}.isdisjoint(registry.OPTIMIZERS)


# -- speed: measured GEMM rates and the bandwidth-bound bytes ---------------------------------------------


def test_measured_matmul_rate_replaces_the_rating(prof):
    t4 = prof.find_gpu("T4")  # 65 TFLOPS on the datasheet; 42 measured at 70 W
    assert t4.tflops("fp16") == 65.0 and t4.matmul_tflops("fp16") == pytest.approx(42.3)
    assert P.gpu_tflops(t4, "fp16") == pytest.approx(42.3)
    unmeasured = prof.find_gpu("RTX 3090 Ti")
    assert unmeasured.measured_matmul_tflops is None
    assert unmeasured.matmul_tflops("bf16") == unmeasured.tflops("bf16")


def test_bandwidth_bound_bytes_cost_time_on_a_slower_memory(prof):
    from dataclasses import replace

    s = _lora(model="sdxl", resolution=1024, lora_targets=P.LORA_TARGETS_KOHYA, cache_latents=True)
    fast = prof.find_gpu("RTX 4090")
    slow = replace(fast, memory_bandwidth_gbs=fast.memory_bandwidth_gbs / 4)
    cal = P.calibrate(prof)
    moved = P.step_traffic_bytes(prof, s, cal.fixed_samples)  # the samples' bytes and the per-step fixed work
    eff = cal.bandwidth_efficiency
    extra = moved / (slow.memory_bandwidth_gbs * 1e9 * eff) - moved / (fast.memory_bandwidth_gbs * 1e9 * eff)
    # bandwidth-bound on both: the bytes' time (plus the optimizer step's own traffic) is what the slower
    # memory adds
    added = P.step_seconds(prof, s, slow, cal) - P.step_seconds(prof, s, fast, cal)
    assert extra > 0 and extra <= added < 1.1 * extra


def test_checkpointing_costs_the_same_on_both_sides_of_the_roofline(prof):
    """Checkpointing re-runs the forward: one cost, GC_TIME_FACTOR (x1.25), on the bytes as on the matmuls. A
    whole extra forward of bytes charged x1.33, where the T4 DreamBooth pairs in profiles/ measured x1.23 (fp16,
    batch 1: 1.14 it/s without, 0.93 with) and the field notes give 20-30%."""
    plain = P.step_traffic_bytes(prof, _lora())
    gc = P.step_traffic_bytes(prof, _lora(gradient_checkpointing=True))
    assert gc / plain == pytest.approx(P.GC_TIME_FACTOR)
    unet, _ = P.step_flops_parts(prof, _lora())
    unet_gc, _ = P.step_flops_parts(prof, _lora(gradient_checkpointing=True))
    assert unet_gc / unet == pytest.approx(P.GC_TIME_FACTOR)


# -- peaks outside the step: sampling with the training state resident --------------------------------------


def test_sampling_brings_cached_components_back_and_decodes_at_full_size(prof):
    """SDXL LoRA with cached latents and text-encoder outputs: the step leaves the VAE and the text encoders
    off the GPU, the final sample grid brings them back and decodes 1024 px (fp32 VAE under fp16)."""
    s = _lora(
        model="sdxl",
        resolution=1024,
        precision="fp16",
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=True,
    )
    m = P.memory(prof, s)
    model = prof.model("sdxl")
    assert m.sampling_peak > m.peak
    assert m.sampling_peak - m.peak > model.text_encoder_params * 2 + model.params_vae * 4
    assert "sampling_peak" not in m.parts()
    smaller = P.memory(prof, _lora(model="sdxl", resolution=512, precision="fp16", cache_latents=True))
    assert smaller.sampling_peak < m.sampling_peak


@pytest.mark.slow
def test_peak_live_bytes_counts_what_is_alive_at_once():
    pytest.importorskip("torch")
    import torch

    ca = _compute_activations()
    x = torch.empty(1024 * 1024, device="meta")  # 4 MiB, created outside: not counted

    def chain():
        y = x * 2  # 4 MiB
        z = y * 2  # 4 MiB, y still alive
        del y
        w = z * 2  # 4 MiB, y freed: still 8 MiB live
        return w.sum()

    assert ca.peak_live_bytes(chain) == 2 * 4 * 2**20 + 4


def test_math_attention_moves_its_attention_matrices(prof):
    """The math path writes and reads the whole attention matrix (softmax, scaling): bandwidth-bound bytes
    that grow with the square of the latent pixels, so it is slower than the fused kernels on the same GPU."""
    eff = P.step_traffic_bytes(prof, _lora(attention="efficient"))
    math = P.step_traffic_bytes(prof, _lora(attention="math"))
    assert math > 2 * eff
    big = P.step_traffic_bytes(prof, _lora(attention="math", resolution=1024))
    assert big / math > 4  # more than linear in the latent pixels
    gpu, cal = prof.find_gpu("RTX 3090"), P.calibrate(prof)
    assert P.step_seconds(prof, _lora(attention="math"), gpu, cal) > P.step_seconds(prof, _lora(), gpu, cal)


def test_sdxl_lora_on_8gb_says_the_final_grid_does_not_fit(prof):
    """SDXL LoRA on an 8 GB card trains (cached text-encoder outputs, kohya's docs) but the final sample grid
    brings the VAE and text encoders back: the plan still fits (the trainer writes the weights before the grid
    and skips it on out-of-memory) and says the grid does not, in the reasons and in --json."""
    hw = P.hardware_from_catalog(prof.find_gpu("RTX 3070"))
    res = P.plan(hw, prof, P.Request(method="lora", model="sdxl", resolution=1024))
    assert res.feasible and res.memory is not None
    m = res.memory
    assert m.sampling_peak > P.HEADROOM * 8 * GiB >= m.peak
    assert not P.final_grid_fits(m, res.vram_bytes)
    assert any("final sample grid needs" in r and "skips the grid" in r for r in res.reasons)
    est = P.result_dict(res)["estimate"]
    assert est["final_sample_grid_fits"] is False and est["sampling_peak_vram_bytes"] == int(m.sampling_peak)
    # a 24 GB card holds both: no such reason
    big = P.plan(
        P.hardware_from_catalog(prof.find_gpu("RTX 4090")), prof, P.Request(method="lora", model="sdxl")
    )
    assert P.final_grid_fits(big.memory, big.vram_bytes)
    assert not any("final sample grid" in r for r in big.reasons)


def test_breakdown_says_when_the_parts_do_not_add_up(prof):
    """With freed gradients (set_to_none) the gradients and the activations are never alive at once: the parts
    add up to more than the peak, and the line says so; without, the parts are the peak."""
    freed = P.memory(prof, _lora(model="sdxl", resolution=1024, set_grads_to_none=True, lora_rank=128))
    text = P.breakdown_text(freed)
    assert sum(freed.parts().values()) > freed.peak + 0.05 * GiB
    assert "not the step's" in text and "freed" in text
    kept = P.memory(prof, _lora(set_grads_to_none=False, optimizer="adamw8bit"))
    assert abs(sum(kept.parts().values()) - kept.peak) < 0.05 * GiB
    assert "not the step's" not in P.breakdown_text(kept)


def test_bytes_below_a_gib_are_said_in_mib(prof):
    """An SD1.5 LoRA on 8 H100s said "weights 0.0 GiB, gradients 0.0 GiB, ..." and "the 0.0 GiB gradient
    all-reduce per step": parts below 1 GiB are said in MiB, the sums and peaks in GiB as before."""
    # an A100: no bench points, so the model's breakdown is the peak's reason (an H100's is the measured peak)
    hw = P.hardware_from_catalog(prof.find_gpu("A100 SXM4 80GB"), 8)
    req = P.Request(method="lora", model="sd15", images=9, epochs=1, pins=(("num_gpus", 8),))
    res = P.plan(hw, prof, req)
    assert res.peak_basis == "predicted"
    text = " ".join(res.reasons)
    assert not re.search(r"(?<![\d.])0\.0 GiB", text), text
    moved = P.gradient_bytes(prof, res.plan)
    assert moved < GiB and f"the {moved / 2**20:.0f} MiB gradient all-reduce per step" in text, text
    assert f"weights {res.memory.weights / 2**20:.0f} MiB, frozen {res.memory.frozen / GiB:.1f} GiB" in text
    assert P._size(0.5 * 2**20) == "under 1 MiB" and P._size(1.5 * GiB) == "1.5 GiB"


def test_breakdown_does_not_contrast_a_sum_that_rounds_to_the_peak():
    """Parts 0.06 GiB over the peak said "these add up to 11.2 GiB, not the step's 11.2 GiB" (an SDXL LoRA
    pinned to DeepSpeed offload on an RTX 4090)."""
    gib = float(GiB)
    m = P.Memory(
        trainable_params=1,
        weights=0.1 * gib,
        frozen=6.3 * gib,
        gradients=0.1 * gib,
        optimizer=0.2 * gib,
        ema=0.0,
        autocast_copies=0.0,
        activations=3.3 * gib,
        step_transient=0.1 * gib,
        overhead=1.14 * gib,
        peak=11.17 * gib,
        ram=0.0,
    )
    assert 0.05 * gib < sum(m.parts().values()) - m.peak < 0.1 * gib
    assert "not the step's" not in P.breakdown_text(m), P.breakdown_text(m)


# -- speed: the roofline, fitted on profiles/ only -----------------------------------------------------------


def _sdxl_lora_seconds(prof, gpu: str) -> float:
    s = _lora(
        model="sdxl", resolution=1024, precision="bf16", cache_latents=True, lora_targets=P.LORA_TARGETS_KOHYA
    )
    return P.step_seconds(prof, s, prof.find_gpu(gpu), P.calibrate(prof))


def test_4090_is_not_twice_a_3090_ti_for_sdxl_training(prof):
    """Users report an RTX 4090 about 1.2x an RTX 3090 Ti for SD training (twice the tensor throughput, the same
    1008 GB/s): the step is bandwidth-bound at these batch sizes. The 3060 (360 GB/s) and the T4 (320 GB/s)
    follow their bandwidth, not their tensor rating (6.5x and 4x below the 4090's)."""
    t4090, t3090ti = _sdxl_lora_seconds(prof, "RTX 4090"), _sdxl_lora_seconds(prof, "RTX 3090 Ti")
    assert 1.0 <= t3090ti / t4090 <= 1.3
    r3060 = _sdxl_lora_seconds(prof, "RTX 3060 12GB") / t4090
    assert 2.0 <= r3060 <= 3.2  # bandwidth ratio 2.8; the matmul ratio would be 6.5
    rt4 = _sdxl_lora_seconds(prof, "T4") / t4090
    assert 2.2 <= rt4 <= 3.5  # bandwidth ratio 3.15


def test_matmul_bound_where_bandwidth_is_plentiful(prof):
    """The roofline's other side: on a GPU with plenty of bandwidth and little tensor throughput the matmul time
    sets the step (fp32 runs at a quarter of the half-precision rate)."""
    from dataclasses import replace

    s = _lora(
        model="sdxl", resolution=1024, precision="bf16", cache_latents=True, cache_text_encoder_outputs=True
    )
    gpu = prof.find_gpu("RTX 4090")
    cal = P.calibrate(prof)
    starved = replace(
        gpu, measured_matmul_tflops={"fp16": 2.0, "bf16": 2.0}, bf16_tflops=2.0, fp16_tflops=2.0
    )
    unet, _ = P.step_flops_parts(prof, s)
    assert P.step_compute_seconds(prof, s, starved, cal) == pytest.approx(unet / 2e12)
    assert P.step_compute_seconds(prof, s, gpu, cal) == pytest.approx(
        P.step_traffic_seconds(prof, s, gpu, cal)
    )


def test_encoders_that_run_every_step_are_not_hidden_by_the_roofline(prof):
    """The VAE encode (latents not cached) adds its own time: only the UNet's bytes are counted."""
    gpu = prof.find_gpu("RTX 4090")
    cal = P.calibrate(prof)
    cached = _lora(model="sdxl", resolution=1024, cache_latents=True, cache_text_encoder_outputs=True)
    uncached = _lora(model="sdxl", resolution=1024, cache_latents=False, cache_text_encoder_outputs=True)
    assert P.step_seconds(prof, uncached, gpu, cal) > P.step_seconds(prof, cached, gpu, cal) * 1.02


def test_step_overhead_is_recovered_from_speeds_across_batch_sizes(prof):
    """Speeds made with a known per-step overhead and bandwidth efficiency give both back; a set at one batch
    size cannot separate them and keeps the prior."""
    from types import SimpleNamespace

    gpu = prof.find_gpu("RTX 3090")
    rows = []
    for batch in (1, 2, 4, 8):
        s = _lora(model="sd15", resolution=512, batch=batch, cache_latents=True)
        seconds = P.step_traffic_bytes(prof, s) / (gpu.memory_bandwidth_gbs * 1e9 * 0.05) + 0.2
        rows.append((SimpleNamespace(id=f"b{batch}"), gpu, s, seconds))
    assert P._fit_step_overhead(prof, rows) == pytest.approx(0.2, abs=0.011)
    assert P._fit_step_overhead(prof, rows[:1]) == P.STEP_OVERHEAD_S


def test_fixed_work_in_samples_is_recovered_from_speeds_across_batch_sizes(prof):
    """Speeds made with a known per-step fixed work (in samples of traffic) give it back with no overhead; one
    batch size keeps the priors; the fitted work makes a bigger batch cheaper per sample."""
    from types import SimpleNamespace

    gpu = prof.find_gpu("RTX 4090")
    rows = []
    for batch in (1, 2, 4, 8):
        s = _lora(model="sdxl", resolution=1024, batch=batch, cache_latents=True)
        seconds = P.step_traffic_bytes(prof, s, 1.5) / (gpu.memory_bandwidth_gbs * 1e9 * 0.05)
        rows.append((SimpleNamespace(id=f"b{batch}"), gpu, s, seconds))
    assert P._fit_step_fixed_cost(prof, rows) == pytest.approx((0.0, 1.5))
    assert P._fit_step_fixed_cost(prof, rows[:1]) == (P.STEP_OVERHEAD_S, 0.0)
    cal = replace(P.calibrate(prof), fixed_samples=1.5)
    one = P.step_traffic_seconds(prof, rows[0][2], gpu, cal)
    eight = P.step_traffic_seconds(prof, rows[3][2], gpu, cal)
    assert eight / 8 < one * 0.5  # (8 + 1.5) / 8 against (1 + 1.5) per sample


def test_calibration_uses_profile_speeds_only(prof):
    cal = P.calibrate(prof)
    ids = {i for i, _ in cal.bandwidth_points}
    speeds = {p.id: p for p in prof.points if p.outcome.get("it_s") and p.num_gpus == 1 and p.fit_speed}
    # the UNet families' roofline on theirs, the transformer families' own efficiency on theirs
    assert ids == {i for i, p in speeds.items() if p.model not in P.registry.FLOW_FAMILIES}
    assert {i for i, _ in cal.flow_points} == {
        i for i, p in speeds.items() if p.model in P.registry.FLOW_FAMILIES
    }
    assert len(ids) >= 5


def test_hopper_unet_speeds_get_the_bandwidth_efficiency_their_bench_points_measured(prof):
    """38 sdplan bench speeds of SD1.5 / SDXL on an H100 (10 with checkpointing, 2026-11-27): each left out in turn and predicted by a calibration
    fitted without it. The one published bandwidth efficiency (consumer cards) predicted the large batches up to
    2.6x too slow (it/s -62%); the Hopper efficiency fitted on the other bench points brings the worst to 37%
    (SDXL fine-tune at batch 6) and the median from 9.3% to 6.4%."""
    points = [p for p in prof.points if p.from_bench and p.outcome.get("it_s") and not P.flow_family(p.model)]
    assert len(points) == 38
    fitted, published = [], []
    for p in points:
        without = replace(prof, points=tuple(q for q in prof.points if q is not p))
        cal = P.calibrate(without)
        assert "hopper" in dict(cal.bandwidth_by_family)
        gpu = prof.point_gpu(p)
        for cal_, errors in ((cal, fitted), (replace(cal, bandwidth_by_family=()), published)):
            seconds = P.step_seconds(without, P.setup_from_point(p), gpu, cal_)
            errors.append(abs(1.0 / (seconds * p.outcome["it_s"]) - 1.0))
    median = sorted(fitted)[len(fitted) // 2]
    assert max(published) > 0.6 and max(fitted) < 0.4
    assert median < sorted(published)[len(published) // 2]
    cal = P.calibrate(prof)
    hopper = dict(cal.bandwidth_by_family)["hopper"]
    assert hopper > 1.5 * cal.bandwidth_efficiency
    assert cal.bandwidth_efficiency_for(prof.find_gpu("H200")) == hopper  # the same architecture
    assert cal.bandwidth_efficiency_for(prof.find_gpu("RTX 4090")) == cal.bandwidth_efficiency
    # fewer than BENCH_MIN_POINTS bench speeds on an architecture leave it on the published efficiency
    few = [p for p in prof.points if p not in points[P.BENCH_MIN_POINTS - 1 :]]
    assert "hopper" not in dict(P.calibrate(replace(prof, points=tuple(few))).bandwidth_by_family)


def test_a_vae_encode_every_step_adds_to_a_launch_bound_step(prof):
    """The H100's launch-bound floor was measured with cached latents. Under the floor, the model put the VAE
    encode of uncached latents inside it (free), and a plan for SDXL LoRA at batch 4 stopped caching latents:
    the floor's own measurement cached them."""
    cal = P.calibrate(prof)
    gpu = prof.find_gpu("H100 SXM")
    s = _lora(model="sdxl", resolution=1024, batch=4, gradient_checkpointing=False, cache_latents=True)
    cached = P.step_seconds(prof, s, gpu, cal)
    assert cached == pytest.approx(cal.step_floor_s(s))  # launch-bound
    vae = P.step_compute_seconds(prof, replace(s, cache_latents=False), gpu, cal) - P.step_compute_seconds(
        prof, s, gpu, cal
    )
    assert vae > 0.005
    assert P.step_seconds(prof, replace(s, cache_latents=False), gpu, cal) == pytest.approx(cached + vae)


# -- issue 10 (planner v2): defects found on the worst out-of-sample errors --------------------------------


# A rank-4 FLUX.1 [dev] LoRA at 1024 px, bf16, checkpointing; a keyword changes a field.
_flux = partial(
    Settings,
    method="lora",
    model="flux-dev",
    resolution=1024,
    precision="bf16",
    lora_rank=4,
    gradient_checkpointing=True,
)


@pytest.mark.parametrize(
    ("base", "te_bytes"),
    [
        # (request's frozen base, bytes of the resident text encoders: CLIP-L 123,060,480 + T5-XXL 4,762,310,656)
        ("bf16", 2 * (123_060_480 + 4_762_310_656)),
        ("nf4", 2 * (123_060_480 + 4_762_310_656)),
        # kohya --fp8_base: every weight 1 byte, embeddings back in bf16: CLIP (49408 + 77) x 768, T5 32128 x 4096
        ("fp8", (123_060_480 + 4_762_310_656) + (49_408 + 77) * 768 + 32_128 * 4096),
    ],
)
def test_fp8_base_stores_the_uncached_text_encoders_in_fp8(prof, base, te_bytes):
    model = prof.model("flux-dev")
    assert P.frozen_text_encoder_bytes(model, base) == te_bytes
    cached = P.memory(prof, _flux(base_precision=base, cache_text_encoder_outputs=True))
    resident = P.memory(prof, _flux(base_precision=base, cache_text_encoder_outputs=False))
    assert resident.frozen - cached.frozen == pytest.approx(te_bytes)


@pytest.mark.parametrize(
    ("settings", "copies"),
    [
        # (request, bytes autocast caches: the bf16 copy of each fp32 trained weight)
        (dict(method="lora", lora_rank=32), 2),
        (dict(method="dreambooth"), 2),
        (dict(method="dreambooth", full_half_weights=True), 0),  # already half: no cast
        (dict(method="lora", lora_rank=32, full_half_weights=True), 0),  # kohya --full_bf16 on a network
        (dict(method="textual-inversion", full_half_weights=True), 0),
        (dict(method="lora", lora_rank=32, precision="fp32"), 0),  # no autocast
        (dict(method="textual-inversion"), 0),  # an embedding lookup is not an autocast op
    ],
)
def test_autocast_caches_half_copies_of_fp32_trained_weights(prof, settings, copies):
    s = Settings(**{**dict(model="sd15", resolution=512, precision="bf16"), **settings})
    m = P.memory(prof, s)
    assert m.autocast_copies == pytest.approx(copies * m.trainable_params)


def test_flux_lora_autocast_copies(prof):
    m = P.memory(prof, _flux())
    assert m.autocast_copies == pytest.approx(2.0 * m.trainable_params)


@pytest.mark.parametrize(
    ("family", "target_set", "token_layers"),
    [
        # adapted-layer output tokens of one sample at the family's native resolution (conv_shortcut and
        # time_emb_proj aside), equal to forward hooks on scripts/compute_activations.py lora_modules() of the
        # diffusers UNet built on the meta device (diffusers 0.42)
        ("sd15", "attn", 164_128),
        ("sd15", "attn_ff", 271_904),
        ("sd15", "attn_ff_conv", 333_280),
        ("sdxl", "attn", 625_180),
        ("sdxl", "attn_ff", 883_228),
        ("sdxl", "attn_ff_conv", 1_127_964),
    ],
)
def test_lora_rank_intermediate_tokens_match_the_layers(prof, family, target_set, token_layers):
    model = prof.model(family)
    per_pixel, per_sample = P.lora_rank_tokens(model, target_set)
    assert per_pixel * (model.native_resolution // model.vae_scale_factor) ** 2 + per_sample == token_layers


@pytest.mark.parametrize(
    ("settings", "expected_bytes"),
    [
        # (request, bytes of the saved rank-r intermediates: batch x token-layers x rank x element size)
        (dict(lora_rank=256), 883_228 * 256 * 2),
        (dict(lora_rank=256, batch=2), 2 * 883_228 * 256 * 2),
        (dict(lora_rank=32, precision="fp32"), 883_228 * 32 * 4),
        (dict(lora_rank=256, gradient_checkpointing=True), 0),  # nothing held inside a checkpointed segment
    ],
)
def test_lora_rank_intermediates_are_saved_activations(prof, settings, expected_bytes):
    base = dict(model="sdxl", resolution=1024, precision="bf16", lora_targets=P.LORA_TARGETS_KOHYA)
    s = _lora(**{**base, **settings})
    assert P.lora_rank_activation_bytes(prof, s) == pytest.approx(expected_bytes)
    low = P.memory(prof, replace(s, lora_rank=1))
    grown = P.memory(prof, s).activations - low.activations
    assert grown == pytest.approx(P.ACTIVATION_FACTOR * (expected_bytes - expected_bytes / s.lora_rank))


# -- lora.dropout: each adapted layer's dropped input and its mask ----------------------------------------


@pytest.mark.parametrize(
    ("family", "resolution", "target_set", "measured_mib"),
    [
        # peft LoRA rank 16, dropout 0.1 against 0, bf16, batch 1, no checkpointing: the saved tensors' bytes
        # (scripts/compute_activations.py's SavedCounter) on the diffusers UNet built on the meta device
        # (diffusers 0.42, peft 0.21, 2026-12-08); sd15 "attn" is measured again below
        ("sd15", 512, "attn", 216.3),
        ("sd15", 512, "attn_ff", 417.1),
        ("sdxl", 1024, "attn", 2026.8),
        # the transformers with their default targets (sdplan.registry.LORA_TARGETS)
        ("sd35-medium", 1024, None, 1827.6),
        ("flux-dev", 512, None, 3735.0),
        ("flux-dev", 1024, None, 11205.0),
    ],
)
def test_lora_dropout_counts_a_copy_and_a_mask_of_each_adapted_input(
    prof, family, resolution, target_set, measured_mib
):
    model = prof.model(family)
    if target_set is None:
        s = _lora(model=family, resolution=resolution, lora_dropout=0.1)
        elements = P.flow_lora_input_elements(model, s, (resolution // 8) ** 2)
    else:
        per_pixel, per_sample = P.lora_input_elements(model, target_set)
        elements = per_pixel * (resolution // 8) ** 2 + per_sample
    counted = elements * (2 + P.LORA_DROPOUT_MASK_BYTES) / 2**20
    assert counted == pytest.approx(measured_mib, rel=0.10)


def test_lora_dropout_is_saved_activations_without_checkpointing(prof):
    s = _lora(model="sd15", resolution=512, precision="bf16", lora_dropout=0.1)
    dropped = P.lora_dropout_bytes(prof, s)
    assert dropped / 2**20 == pytest.approx(203.7, abs=0.1)
    grown = P.memory(prof, s).activations - P.memory(prof, replace(s, lora_dropout=0.0)).activations
    assert grown == pytest.approx(P.ACTIVATION_FACTOR * dropped)
    assert P.lora_dropout_bytes(prof, replace(s, batch=2)) == pytest.approx(2 * dropped)
    for none in (
        replace(s, lora_dropout=0.0),
        replace(s, gradient_checkpointing=True),  # saved inside a segment, recomputed
        _lora(model="flux-dev", resolution=512, lora_dropout=0.1, gradient_checkpointing=True),
    ):
        assert P.lora_dropout_bytes(prof, none) == 0.0
    flux = _lora(model="flux-dev", resolution=512, lora_dropout=0.1)
    grown = P.memory(prof, flux).activations - P.memory(prof, replace(flux, lora_dropout=0.0)).activations
    assert grown == pytest.approx(P.FLOW_ACTIVATION_FACTORS["flux-dev"] * P.lora_dropout_bytes(prof, flux))
    assert Settings(method="dreambooth", model="sd15", resolution=512, lora_dropout=0.1).lora_dropout is None


@pytest.mark.slow
def test_lora_dropout_bytes_are_what_peft_saves_on_the_meta_device(prof):
    """The count against a live measurement: SD 1.5's UNet on the meta device with peft's LoRA on the attention
    projections, dropout 0.1 against 0."""
    pytest.importorskip("peft")
    ca = _compute_activations()
    from peft import LoraConfig

    model = yaml.safe_load((ROOT / "profiles" / "models" / "sd15.yaml").read_text())
    saved = {}
    for p in (0.0, 0.1):
        unet = ca.build_unet(model["unet"], "bf16")
        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        unet.add_adapter(LoraConfig(r=16, lora_alpha=16, target_modules=targets, lora_dropout=p))
        for name, w in unet.named_parameters():
            w.requires_grad_("lora_" in name)
        counter = ca.SavedCounter({w.untyped_storage()._cdata for w in unet.parameters()})
        args, kw = ca.unet_meta_inputs(model, batch=1, side=64, dtype=ca._torch_dtype("bf16"))
        with ca.attention_backend("efficient", "bf16"), counter.hooks():
            unet(*args, return_dict=False, **kw)
        saved[p] = counter.total
    counted = P.lora_dropout_bytes(
        prof, _lora(model="sd15", resolution=512, precision="bf16", lora_dropout=0.1)
    )
    assert counted == pytest.approx(saved[0.1] - saved[0.0], rel=0.10)


# -- the math attention path's matrix gradients inside a recomputed segment ---------------------------------


# (settings, bytes of one saved attention matrix in the largest recomputed segment): heads x tokens^2 x 4 B (the
# matrix is fp32: fp32 compute, or torch's math SDPA upcasting half inputs) x samples, 64 x 64 latent tokens
_matrix_cases = [
    # SD1.5 (8 heads at 64x64), fp32 DreamBooth, prior preservation doubles the samples
    (
        dict(method="dreambooth", precision="fp32", optimizer="adamw8bit", prior_preservation=True),
        2 * 8 * 4096**2 * 4,
    ),
    # SD1.5 LoRA in bf16, one sample
    (dict(method="lora", precision="bf16", lora_rank=16), 8 * 4096**2 * 4),
    # SD2.x: 5 heads at 64x64
    (dict(method="dreambooth", model="sd21", precision="fp16"), 5 * 4096**2 * 4),
]


@pytest.mark.parametrize("kw, matrix_bytes", _matrix_cases)
def test_recomputed_math_attention_holds_the_matrix_and_its_two_gradients(prof, kw, matrix_bytes):
    base = dict(model="sd15", resolution=512, gradient_checkpointing=True, attention="math")
    s = Settings(**{**base, **kw})
    trained = "unet" if s.method == "dreambooth" else "attn"
    batch = s.batch * (2 if s.prior_preservation else 1)
    got = P.recomputed_attention_matrix_bytes(prof, s, trained, batch=batch, latent_pixels=4096)
    assert got == pytest.approx(matrix_bytes)
    # the peak counts the matrix three times (itself, dP, dS) where the flat factor gave it 1.5 times
    m = P.memory(prof, s)
    assert P.ATTENTION_MATRIX_COPIES_IN_BACKWARD == 3
    held, recompute = prof.activations.unet(
        s.model,
        dtype=s.precision,
        attention="math",
        gc=True,
        batch=batch,
        latent_pixels=4096,
        trained=trained,
    )
    lora = P.lora_rank_activation_bytes(prof, s)
    expected = P.ACTIVATION_FACTOR * (held + recompute - matrix_bytes + lora) + 3 * matrix_bytes
    assert m.activations == pytest.approx(expected)


def test_attention_matrix_gradients_only_with_checkpointing_and_the_math_path(prof):
    s = Settings(
        method="dreambooth", model="sd15", resolution=512, precision="fp32", gradient_checkpointing=True
    )
    for other in (
        replace(s, attention="efficient"),
        replace(s, attention="math", gradient_checkpointing=False),
    ):
        assert P.recomputed_attention_matrix_bytes(prof, other, "unet", batch=1, latent_pixels=4096) == 0.0
    # with the math path the recomputed segment's peak grows by 1.5 matrices over the flat factor
    math = P.memory(prof, replace(s, attention="math"))
    assert (
        math.activations
        > P.ACTIVATION_FACTOR
        * sum(
            prof.activations.unet(
                "sd15", dtype="fp32", attention="math", gc=True, batch=1, latent_pixels=4096
            )
        )
        + 1.4 * 8 * 4096**2 * 4
    )


# -- textual inversion: the original embedding rows and the frozen encoder's half copies ------------------------

# (family, bytes autocast's per-Linear half casts of the frozen fp32 text encoders hold for the backward):
# every weight but the token + position embeddings (CLIP-L 123,060,480 params, (49408 + 77) x 768 embeddings;
# OpenCLIP-H 340,387,840, (49408 + 77) x 1024; SDXL both CLIP-L and OpenCLIP-bigG 694,659,840, (49408 + 77) x 1280)
_ti_cases = [
    ("sd15", 2 * (123_060_480 - 49_485 * 768)),
    ("sd21", 2 * (340_387_840 - 49_485 * 1024)),
    ("sdxl", 2 * (123_060_480 - 49_485 * 768) + 2 * (694_659_840 - 49_485 * 1280)),
]


@pytest.mark.parametrize("family, half_copies", _ti_cases)
def test_textual_inversion_holds_original_rows_and_half_copies_of_the_frozen_encoder(
    prof, family, half_copies
):
    model = prof.model(family)
    assert P.ti_frozen_half_copies_bytes(model) == half_copies
    s = Settings(method="textual-inversion", model=family, resolution=512, precision="fp16")
    m = P.memory(prof, s)
    t = m.trainable_params
    # the fp32 text encoders around the trained embeddings, plus the fp32 copy of the embedding matrix
    unet_vae = (model.params_unet + model.params_vae) * 2
    assert m.frozen == pytest.approx(unet_vae + (model.text_encoder_params - t) * 4 + t * 4)
    # saved for the backward beside the activations, once whatever the batch (not autocast's cached copies)
    assert m.autocast_copies == 0
    two = P.memory(prof, replace(s, batch=2))
    per_sample = two.activations - m.activations
    assert m.activations - per_sample == pytest.approx(half_copies, rel=0.05)
    # fp32 (no autocast): no half copies, the original rows are still kept
    m32 = P.memory(prof, replace(s, precision="fp32"))
    assert m32.frozen == pytest.approx(
        (model.params_unet + model.params_vae) * 4 + model.text_encoder_params * 4
    )


@pytest.mark.parametrize("model", ["sd15", "sdxl", "flux-dev"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_a_lora_pinned_to_deepspeed_counts_its_buckets_and_offload(prof, model, gpus):
    """A LoRA pinned to DeepSpeed ZeRO-2 offload was planned as if without DeepSpeed: its optimizer state on the
    GPU, autocast's copies, and none of the reduce buckets DeepSpeed allocates whatever the parameter count
    (0.93 GiB of bf16 each: one in one process, two with overlap_comm across several)."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS, OFFLOAD, SHARDED

    res = 1024 if model != "sd15" else 512
    plain = _lora(model=model, resolution=res, gradient_checkpointing=True, cache_latents=True, num_gpus=gpus)
    bucket = DEEPSPEED_BUCKET_ELEMENTS * 2.0
    off = P.memory(prof, replace(plain, deepspeed=dict(OFFLOAD)))
    assert off.optimizer == 0.0 and off.autocast_copies == 0.0 and off.step_transient == 0.0
    assert off.gradients == pytest.approx(bucket * (2 if gpus > 1 else 1))
    assert off.ram >= P.memory(prof, plain).ram
    split = P.memory(prof, replace(plain, deepspeed=dict(SHARDED)))
    assert split.gradients >= bucket and split.optimizer > 0.0 and split.autocast_copies == 0.0


def test_textual_inversion_pinned_to_deepspeed_counts_its_bucket_and_offload(prof):
    """The same for textual inversion (DeepSpeed wraps its text encoder): a bucket, no optimizer on the GPU."""
    from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS, OFFLOAD

    s = Settings(
        method="textual-inversion", model="sd15", resolution=512, precision="bf16", cache_latents=True
    )
    off = P.memory(prof, replace(s, deepspeed=dict(OFFLOAD)))
    assert off.optimizer == 0.0 and off.autocast_copies == 0.0
    assert off.gradients == pytest.approx(DEEPSPEED_BUCKET_ELEMENTS * 2.0)


def test_a_sharded_deepspeed_breakdown_says_deepspeed_frees_the_gradients(prof):
    """ZeRO-2 without offload: the parts add up to more than the peak because DeepSpeed lets go of its half
    gradients and buckets before the step (step_allocated_bytes), not because of set_to_none, as it said."""
    from sdplan.settings import SHARDED

    s = Settings(
        method="finetune",
        model="sdxl",
        resolution=1024,
        precision="bf16",
        batch=4,
        gradient_checkpointing=True,
        cache_latents=True,
        deepspeed=dict(SHARDED),
    )
    m = P.memory(prof, s)
    text = P.breakdown_text(m, s)
    assert "not the step's" in text and "DeepSpeed lets go of its half gradients" in text
    assert "set_to_none" not in text
    assert "set_to_none" in P.breakdown_text(m)  # no settings: as before


@pytest.mark.parametrize("method", ["finetune", "lora"])
def test_the_sample_grid_under_deepspeed_has_no_autocast_copies(prof, method):
    """accelerate's autocast() does nothing under DeepSpeed (native_amp off): the grid's peak under ZeRO-2
    without offload counted autocast's half copies of the trained weights all the same (4.8 GiB for SDXL),
    where the step (_assemble) and the offloaded grid did not."""
    s = replace(sdxl_sharded(), method=method, num_gpus=2)
    t = 2_567_463_684 if method == "finetune" else 23_000_000
    with_ds = P.sampling_peak_bytes(prof, s, resident=10 * GiB, trained=t, trained_bytes=4)
    without = P.sampling_peak_bytes(
        prof, replace(s, deepspeed=None), resident=10 * GiB, trained=t, trained_bytes=4
    )
    assert without - with_ds >= t * 2.0 * 0.99


def test_ddp_on_many_gpus_counts_the_ema_grids_host_copy_once(prof):
    """_memory_on sizes N > 2 DDP processes from 2: it scaled the EMA grid's host copy (the main process's alone)
    N / 2 times, 28.7 GiB too much on 8 GPUs."""
    from sdplan.settings import Settings

    for ema in ("cpu", None):
        s = Settings(method="finetune", model="sdxl", resolution=1024, precision="bf16", ema=ema, num_gpus=8)
        assert P.memory(prof, s).ram == pytest.approx(P._memory(prof, s).ram)
