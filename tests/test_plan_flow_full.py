"""The planner on SD3.5 / FLUX.1 full fine-tune and DreamBooth: the whole transformer trains (fp32 master weights
or bf16 ones, an optimizer's state, DeepSpeed offload), with what the bundled trainer runs for these methods only
(no quantized base, no block swap, frozen text encoders); the LoRA plans of these families stay as they were."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import make_images

from sdplan import planner as P
from sdplan import registry
from sdplan.errors import UsageError
from sdplan.profiles import load_profiles
from sdplan.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
MACHINES = Path(__file__).parent / "fixtures" / "machines"
BASELINE = Path(__file__).parent / "fixtures" / "planner" / "flow_lora_baseline.json"
GiB = 2**30
FULL = ("finetune", "dreambooth")


@pytest.fixture(scope="module")
def prof():
    """The shipped profiles with the peak / time uncertainty bands the table was written against (those of
    profiles/uncertainty.yaml when the baseline was computed): the bands move with every validation point, and
    a plan's tier (within the likely peak's upper end or not) moves with them."""
    p = load_profiles()
    bands = json.loads(BASELINE.read_text())["uncertainty"]
    peak, secs = tuple(bands["peak_vram"]), tuple(bands["seconds"])
    return replace(
        p,
        uncertainty=replace(
            p.uncertainty,
            peak_vram=peak,
            seconds=secs,
            peak_vram_transformer=peak,  # the transformer families' own bands came later
            seconds_transformer=secs,
        ),
    )


def _plan(prof, method: str, family: str, gpu: str, **kw):
    hw = P.hardware_from_catalog(prof.find_gpu(gpu))
    prior = method == "dreambooth"
    return P.plan(hw, prof, P.Request(method=method, model=family, prior_preservation=prior, **kw))


# -- the LoRA plans are unchanged -------------------------------------------------------------------------


def _lora_baseline_now(prof, base: dict) -> tuple[dict, dict]:
    """(plans, memory) as the baseline records them, computed now for the baseline's keys."""
    cal = P.calibrate(prof)
    spec = prof.find_gpu("RTX 4090")
    plans = {}
    for key in base["plans"]:
        family, gpu, res = key.split("|")
        r = P.plan(
            P.hardware_from_catalog(prof.find_gpu(gpu)),
            prof,
            P.Request(method="lora", model=family, resolution=int(res)),
        )
        s = r.plan
        plans[key] = s and {
            "settings": [
                s.batch,
                s.gradient_checkpointing,
                s.optimizer,
                s.cache_latents,
                s.cache_text_encoder_outputs,
                s.lora_rank,
                s.base_precision,
                s.blocks_to_swap,
            ],
            "peak_bytes": int(r.memory.peak),
            "seconds": round(r.seconds, 3),
        }
    memory = {}
    for key in base["memory"]:
        family, gc, optimizer, base_precision = key.split("|")
        s = Settings(
            method="lora",
            model=family,
            resolution=1024,
            batch=2,
            gradient_checkpointing=gc == "1",
            cache_latents=True,
            cache_text_encoder_outputs=gc != "1",
            optimizer=optimizer,
            base_precision=base_precision,
        )
        memory[key] = [int(P.memory(prof, s).peak), round(P.step_seconds(prof, s, spec, cal), 6)]
    return plans, memory


def test_the_flow_families_lora_plans_are_unchanged(prof):
    """Every LoRA plan and memory / step-time prediction of the four transformer families, against the values
    computed on main before the full-weight model (tests/fixtures/planner/flow_lora_baseline.json). A deliberate
    change of the model rewrites the baseline: ``SDPLAN_UPDATE_BASELINE="why" pytest tests/test_plan_flow_full.py
    -k unchanged`` records the new values and appends the reason to its ``_source``; the diff shows what moved."""
    base = json.loads(BASELINE.read_text())
    plans, memory = _lora_baseline_now(prof, base)
    why = os.environ.get("SDPLAN_UPDATE_BASELINE")
    if why:
        base.update(plans=plans, memory=memory, _source=f"{base['_source']}; {why}")
        BASELINE.write_text(json.dumps(base, indent=1) + "\n")
    for key, want in base["plans"].items():
        assert plans[key] == want, key
    for key, want in base["memory"].items():
        assert memory[key] == want, key


# -- what the planner chooses on 24 / 48 / 80 GB cards -----------------------------------------------------

# (method, family, card, what fits): "fp32" = fp32 master weights, no offload; "bf16" = only bf16 weights and
# gradients (training.full_half_weights) with a lean optimizer (8-bit AdamW or Adafactor), no offload;
# "offload" = only with DeepSpeed ZeRO-2 optimizer offload; "no" = nothing. DreamBooth with prior preservation.
# FLUX.1 [dev] (11.9B) holds 4 bytes a parameter in bf16 weights + gradients alone (44 GiB): no 24 / 48 GB card
# without offload, as SimpleTuner's README lists it ("A100-80G (Full tune with DeepSpeed)").
TABLE = [
    ("finetune", "sd35-medium", "RTX 4090", "bf16"),
    ("finetune", "sd35-medium", "RTX A6000", "fp32"),
    ("finetune", "sd35-medium", "H100 SXM", "fp32"),
    ("finetune", "sd35-large", "RTX 4090", "offload"),
    ("finetune", "sd35-large", "RTX A6000", "bf16"),
    ("finetune", "sd35-large", "H100 SXM", "bf16"),
    ("finetune", "flux-dev", "RTX 4090", "no"),
    ("finetune", "flux-dev", "RTX A6000", "offload"),
    ("finetune", "flux-dev", "H100 SXM", "bf16"),
    ("dreambooth", "sd35-medium", "RTX 4090", "bf16"),
    ("dreambooth", "sd35-medium", "RTX A6000", "fp32"),
    ("dreambooth", "sd35-medium", "H100 SXM", "fp32"),
    # with offload at batch 2 (21.7 GiB, flagged: its likely range's upper end is over the card) since one
    # process counts DeepSpeed's one reduce bucket, not two
    ("dreambooth", "sd35-large", "RTX 4090", "offload"),
    ("dreambooth", "sd35-large", "RTX A6000", "bf16"),
    ("dreambooth", "sd35-large", "H100 SXM", "bf16"),
    ("dreambooth", "flux-dev", "RTX 4090", "no"),
    ("dreambooth", "flux-dev", "RTX A6000", "offload"),
    ("dreambooth", "flux-dev", "H100 SXM", "bf16"),
]


@pytest.mark.parametrize(("method", "family", "gpu", "fits"), TABLE)
def test_full_methods_on_24_48_80_gb_cards(prof, method, family, gpu, fits):
    r = _plan(prof, method, family, gpu)
    if fits == "no":
        assert not r.feasible and r.needs["min_vram_bytes"] > prof.find_gpu(gpu).memory_bytes
        return
    s = r.plan
    assert r.feasible and s.method == method and r.memory.peak <= P.HEADROOM * prof.find_gpu(gpu).memory_bytes
    assert r.memory.trainable_params == prof.model(family).denoiser_params  # the whole transformer
    assert (
        s.base_precision == "bf16" and s.blocks_to_swap == 0 and not s.train_text_encoder
    )  # LoRA-only knobs
    assert s.prior_preservation == (method == "dreambooth")
    assert s.offload == (fits == "offload")
    if fits == "fp32":
        assert not s.full_half_weights
    if fits == "bf16":
        assert s.full_half_weights and s.optimizer in ("adamw8bit", "adafactor")
    assert "the whole" in "\n".join(r.reasons) and r.basis == "weakly_calibrated" and r.seconds > 0


def test_the_memory_breakdown_adds_up(prof):
    """Each part from the parameter count and its bytes; the peak is the largest phase of the step plus the
    overhead (gradients freed after every step never meet the forward's activations)."""
    n = prof.model("sd35-large").denoiser_params
    for half, optimizer, state_bytes in (
        (False, "adamw", 8.0),
        (True, "adamw", 4.0),
        (True, "adamw8bit", 2.0),
        (False, "adamw8bit", 2.0),
    ):
        s = Settings(
            method="finetune",
            model="sd35-large",
            resolution=1024,
            batch=2,
            optimizer=optimizer,
            full_half_weights=half,
            cache_latents=True,
            cache_text_encoder_outputs=True,
        )
        m = P.memory(prof, s)
        tb = 2 if half else 4
        assert m.weights == m.gradients == n * tb
        assert m.optimizer == pytest.approx(n * state_bytes)
        assert m.autocast_copies == (0 if half else n * 2)  # bf16 copies of the fp32 masters
        assert m.step_transient == (n * tb if optimizer == "adamw" else 0)  # foreach AdamW's temporary
        allocated = (
            m.weights
            + m.frozen
            + m.optimizer
            + m.ema
            + max(m.activations + m.autocast_copies, m.gradients + m.step_transient)
        )
        assert m.peak == pytest.approx(allocated + m.overhead)
        assert m.overhead == pytest.approx(P.CUDA_CONTEXT_BYTES + P.ALLOCATOR_OVERHEAD * allocated)
    # Adafactor's state: the factored moment of the real shapes, fp32 whatever the weights (a few MB for 8B)
    s = replace(s, optimizer="adafactor", full_half_weights=True)
    assert P.memory(prof, s).optimizer == prof.activations.adafactor_bytes("sd35-large") < 0.01 * n
    # the text encoders and the VAE leave the GPU when their outputs are cached, as for LoRA
    resident = replace(s, cache_latents=False, cache_text_encoder_outputs=False)
    assert P.memory(prof, resident).frozen - P.memory(prof, s).frozen == pytest.approx(
        2.0 * (prof.model("sd35-large").text_encoder_params + prof.model("sd35-large").params_vae)
    )
    # an EMA copy on the GPU is fp32; DreamBooth's prior preservation doubles the activations
    assert P.memory(prof, replace(s, ema="gpu")).ema == 4.0 * n
    db = replace(s, method="dreambooth", prior_preservation=True)
    assert P.memory(prof, db).activations == pytest.approx(2 * P.memory(prof, s).activations, rel=0.02)


def test_full_half_weights_and_a_lean_optimizer_make_the_big_ones_fit(prof):
    """SD3.5 Large on a 48 GB card: fp32 masters do not fit, nor bf16 weights with AdamW's full state; bf16
    weights with 8-bit AdamW or Adafactor do, without offload."""
    no_offload = (("deepspeed", None),)
    r = _plan(prof, "finetune", "sd35-large", "RTX A6000", pins=(*no_offload, ("full_half_weights", False)))
    assert not r.feasible
    r = _plan(prof, "finetune", "sd35-large", "RTX A6000", pins=(*no_offload, ("optimizer", "adamw")))
    assert not r.feasible
    r = _plan(prof, "finetune", "sd35-large", "RTX A6000", pins=no_offload)
    assert r.feasible and r.plan.full_half_weights and r.plan.optimizer in ("adamw8bit", "adafactor")
    text = "\n".join(r.reasons)
    assert "full bf16 weights and gradients" in text and "nothing with fp32 master weights fits" in text
    # the precision line does not claim fp32 master weights for a plan without them
    assert "fp32 master weights)" not in text and "(bf16 weights and gradients, see below)" in text


def test_a_card_too_small_gets_one_needs_at_least_line(prof):
    r = _plan(prof, "finetune", "flux-dev", "RTX 4090")
    assert not r.feasible
    need = r.needs["min_vram_bytes"]
    request = replace(r.request, resolution=None)
    assert need == P.min_vram_needed(request, prof, precision="bf16")  # the same setting generator
    line = next(x for x in r.reasons if x.startswith("nothing fits"))
    assert "\n" not in line and f"at least {need / GiB:.1f} GiB" in line
    assert P.FLOW_FULL_NOT_IN_TRAINER in r.reasons  # why kohya's 24 GB recipe is not ours
    assert all(prof.find_gpu(g).memory_bytes >= need for g in r.needs["suggested_hardware"])


def test_full_methods_never_plan_a_quantized_base_or_block_swap(prof):
    for method in FULL:
        space = P.settings_space(
            P.Request(method=method, model="flux-dev", resolution=512),
            precision="bf16",
            attention="efficient",
        )
        assert {(s.base_precision, s.blocks_to_swap) for s in space} == {("bf16", 0)}
    r = _plan(prof, "finetune", "flux-dev", "H100 SXM", pins=(("base_precision", "fp8"),))
    assert not r.feasible and "only LoRA trains over a quantized frozen base" in r.pin_conflicts[0]
    r = _plan(prof, "dreambooth", "sd35-large", "H100 SXM", pins=(("blocks_to_swap", 8),))
    assert not r.feasible and "swaps blocks for LoRA only" in r.pin_conflicts[0]


def test_the_whole_transformer_line_names_the_plans_precision(prof):
    """SD3.5 Medium fine-tune on a T4 trains in fp16 (no bf16 in hardware) with DeepSpeed offload; the line said
    'weights 4.2 GiB in bf16 on the GPU'."""
    res = _plan(prof, "finetune", "sd35-medium", "T4", images=15, repeats=5)
    assert res.plan.precision == "fp16" and res.plan.offload
    (line,) = [r for r in res.reasons if r.startswith("the whole sd35-medium transformer trains")]
    assert f"weights {res.memory.weights / GiB:.1f} GiB in fp16 on the GPU" in line and "bf16" not in line


def test_text_encoder_training_and_textual_inversion_stay_refused(prof):
    r = _plan(prof, "finetune", "sd35-medium", "H100 SXM", pins=(("train_text_encoder", True),))
    assert not r.feasible and "encoders stay frozen" in r.pin_conflicts[0] and "\n" not in r.pin_conflicts[0]
    for family in registry.FLOW_FAMILIES:
        with pytest.raises(UsageError, match="not supported for this family") as e:
            _plan(prof, "textual-inversion", family, "H100 SXM")
        assert "\n" not in str(e.value)
        assert registry.family(family).plans("finetune") and registry.family(family).plans("dreambooth")


def test_full_weight_gradients_cost_time(prof):
    """Full fine-tune adds every weight's gradient to the backward (counted on meta): more FLOPs than a LoRA's
    at the same settings, and DreamBooth's prior preservation doubles the transformer's samples."""
    spec, cal = prof.find_gpu("H100 SXM"), P.calibrate(prof)
    lora = Settings(
        method="lora", model="flux-dev", resolution=1024, cache_latents=True, cache_text_encoder_outputs=True
    )
    full = replace(lora, method="finetune")
    coef = prof.activations.families["flux-dev"]["flops"]["transformer_train_step"]
    latent = (1024 // 8) ** 2
    ratio = prof.activations._eval(coef["full"], 1, latent) / prof.activations._eval(coef["lora"], 1, latent)
    assert P.step_flops(prof, full) / P.step_flops(prof, lora) == pytest.approx(ratio) and ratio > 1.1
    db = replace(full, method="dreambooth", prior_preservation=True)
    assert P.step_flops(prof, db) == pytest.approx(2 * P.step_flops(prof, full))
    assert P.step_seconds(prof, full, spec, cal) > P.step_seconds(prof, lora, spec, cal)
    gc = replace(full, gradient_checkpointing=True)
    assert P.step_flops(prof, gc) > P.step_flops(prof, full)  # the recomputed forward


# -- the commands --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "method", "family", "status"),
    [
        ("8x_h100_sxm", "finetune", "flux-dev", "ok"),
        ("8x_h100_sxm", "dreambooth", "sd35-large", "ok"),
        ("2x_rtx4090_pcie", "finetune", "sd35-medium", "ok"),
        ("2x_rtx4090_pcie", "finetune", "flux-dev", "no"),
        ("2x_rtx4090_pcie", "textual-inversion", "flux-dev", "n/a"),
    ],
)
def test_doctor_shows_the_full_methods_of_the_flow_families(machine, method, family, status):
    from sdplan.doctor import planner_verdicts
    from sdplan.machine import Snapshot

    grid = {
        (m, f): (s, note) for m, f, s, note in planner_verdicts(Snapshot.load(MACHINES / f"{machine}.json"))
    }
    got, note = grid[(method, family)]
    assert got == status, note
    if status == "ok":
        assert "GiB" in note


def test_recommend_dreambooth_sd35_medium_prints_the_plan_without_torch():
    from conftest import recommend_in_a_process

    out = recommend_in_a_process("--method", "dreambooth", "--model", "sd35-medium", "--hardware", "RTX 4090")
    text = " ".join(out.split())
    assert "dreambooth sd35-medium at 1024px on RTX 4090" in text
    assert "full bf16" in text and "peak VRAM" in text and "needs at least" not in text
    assert "the whole sd35-medium transformer trains" in text


def test_train_plans_dreambooth_on_a_tiny_flow_folder(tmp_path, tiny_flow):
    """`sdplan train --method dreambooth --model <an SD3.5 folder>`: the family comes from the folder, the
    planner plans the full method on the machine, and the config it writes trains the whole transformer."""
    import dataclasses

    import yaml

    from sdplan.launcher import UI, TrainRequest, command_line, launch_for, prepare, write_run_files
    from sdplan.machine import Snapshot

    snap = Snapshot.load(MACHINES / "2x_rtx4090_pcie.json")
    snap = dataclasses.replace(snap, software=dataclasses.replace(snap.software, torch_build="cuda"))
    req = TrainRequest(
        method="dreambooth",
        model=str(tiny_flow["sd35-medium"]),
        dataset=str(make_images(tmp_path / "ds", n=8)),
        out=str(tmp_path / "run"),
        epochs=2,
        gpus=1,
        snapshot=snap,
        yes=True,
        overrides=["dreambooth.instance_prompt=a photo of sks dog"],
    )
    p = prepare(req, UI(echo=lambda line: None))
    assert p.plan is not None and p.cfg.model.family == "sd35-medium"
    write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out))
    data = yaml.safe_load((p.out / "sdplan.yaml").read_text())
    chosen = Settings.from_config(data)
    assert chosen.method == "dreambooth" and chosen.model == "sd35-medium"
    assert chosen.base_precision == "bf16" and chosen.blocks_to_swap == 0
    assert data["plan"]["plan"]["full_half_weights"] == chosen.full_half_weights
    assert data["plan"]["estimate"]["peak_vram_bytes"] <= 24 * GiB
