#!/usr/bin/env python
"""How right the planner is: in-sample (the profile points it is calibrated on) and out-of-sample (the
independent validation set in benchmarks/validation/), reported separately.

- in-sample: every published/measured point in profiles/methods (peak VRAM, host RAM, it/s, "fits in X GB"
  claims, multi-GPU ratios), as the planner sees them;
- leave-one-source-out: the calibration refitted (``planner.calibrate``) without each source's points, then
  that source's speed figures predicted with it (the memory constants are module constants, not refitted);
- sdplan bench points, each left out: its speed as a plan states it without that point (measured, scaled by the
  nearest other bench point on that GPU, or the model), by basis (the scaled basis' range comes from these);
- out-of-sample: every point in benchmarks/validation/*.yaml evaluated at its stated configuration (not the
  planner's choice): peak VRAM, it/s and the fit verdict (predicted peak within the card's memory vs the
  reported fit / out-of-memory). Points the planner cannot express are counted with the reason.

Why one script of ~800 lines: most of it is the translation of each published report's stated settings into a
planner request (with the source's own words for every assumption), which must sit beside the comparison it
feeds; in-sample, leave-one-source-out and out-of-sample share it.

Run: ``python benchmarks/planner_accuracy.py [--json] [--no-timing]``. Only the shipped profiles are used
(a local profile store would change the calibration).
"""

# No `from __future__ import annotations`: tests load this file by path, and dataclasses with string
# annotations need the module registered in sys.modules.
import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdplan import planner as P
from sdplan.profiles import METHODS, F, GiB, GPUSpec, Profiles, _check, load_profiles, read_yaml
from sdplan.settings import Settings

VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
NO_LOCAL_STORE = Path(__file__).resolve().parent / "validation" / "no-local-store"  # never created

# -- the adapter: the only place that calls sdplan.planner --------------------------------------------------

PLANNED_OPTIMIZERS = P.registry.MODELLED_OPTIMIZERS
PLANNER_ATTENTION = {
    "xformers": "efficient",
    "sdpa": "efficient",
    "flash": "efficient",
    "efficient": "efficient",
    "none": "math",
}


# the validation schema's LoRA target names -> the peft target modules the planner reads (sdplan.planner)
PLANNER_LORA_TARGETS = {
    "attn": P.LORA_TARGETS_ATTN,
    "attn+ff": P.LORA_TARGETS_KOHYA,
    "attn+ff+conv": P.LORA_TARGETS_LOCON,
}


# the validation schema's family names -> the planner's. "flux": FLUX.1 [dev] (what every validation source
# trains; [schnell] has the same network without the guidance embedder), unless the point's `variant` says
# otherwise; "sd35" needs the variant (Medium or Large).
PLANNER_FAMILY = {"sd15": "sd15", "sd21": "sd21", "sdxl": "sdxl", "flux": "flux-dev"}
# a point's `variant` names the model within a validation family: sd35 medium / large, flux dev / schnell
VARIANTS = {"sd35": ("medium", "large"), "flux": ("dev", "schnell")}
# a validation point's `unmodelled` notes the planner now models (issue 14): -> the Settings field and value
MODELLED_NOTES = {
    "fp8 base weights (fp8_base)": ("base_precision", "fp8"),
    # bitsandbytes nf4 (what the planner's nf4 base and the bundled trainer's are; SimpleTuner's two spellings)
    "nf4 base weights (nf4-bnb)": ("base_precision", "nf4"),
    "nf4 base weights (bnb-nf4)": ("base_precision", "nf4"),
    # SimpleTuner's fp8wo-torchao: torchao float8 weight-only (the weight stored in fp8, the matmul in bf16), as
    # the planner's fp8 base (kohya --fp8_base, the bundled trainer's Fp8Linear)
    "fp8 weight-only base (fp8wo-torchao)": ("base_precision", "fp8"),
}
KOHYA_DEFAULT_LORA_RANK = 4  # kohya-ss/sd-scripts networks/lora*.py create_network: network_dim None -> 4


@dataclass(frozen=True)
class Prediction:
    peak_vram_bytes: float | None = None  # the plan's: the larger of the step's and the caption pass's
    # the training step's, what a tool's measured peak is compared with (the tools encode their cached captions
    # apart from the steps, as sdplan's trainer does before the denoiser is placed); the caption pass's
    step_peak_bytes: float | None = None
    text_cache_peak_bytes: float = 0.0
    allocated_bytes: float | None = (
        None  # the step's peak torch allocation (no CUDA context, no fragmentation)
    )
    host_ram_bytes: float | None = None
    it_per_s: float | None = None
    # as a plan states it: a measured speed on this GPU near the settings scales the model (basis "scaled")
    planned_it_per_s: float | None = None
    planned_basis: str | None = None
    not_expressible: tuple[str, ...] = ()  # why the planner cannot express these settings (nothing predicted)
    no_speed: str | None = None  # why no speed was predicted (GPU not named / not in the catalog)


_CALIBRATIONS: dict[int, tuple[Profiles, Any]] = {}


def _family_and_rank(point: "Point") -> tuple[str, bool, int | None]:
    family = PLANNER_FAMILY.get(point.family, point.family)
    if point.variant:
        family = f"{point.family}-{point.variant}"
    flow = family in P.registry.FLOW_FAMILIES
    rank = point.lora_rank
    if flow and rank is None and "kohya" in point.tool.lower():
        rank = KOHYA_DEFAULT_LORA_RANK  # the tool's default (the point does not state one)
    return family, flow, rank


def settings_for(point: "Point") -> Settings:
    """The planner's settings for a point's own configuration."""
    family, flow, rank = _family_and_rank(point)
    changes = dict(MODELLED_NOTES[n] for n in point.unmodelled if n in MODELLED_NOTES)
    targets = PLANNER_LORA_TARGETS.get(point.lora_targets) if point.method == "lora" else None
    if flow and point.lora_targets != "attn":
        targets = None  # the family's default set (attention + feed-forward of every block)
    return Settings(
        method=point.method,
        model=family,
        resolution=point.resolution,
        batch=point.batch,
        grad_accum=point.grad_accum,
        precision=point.precision,
        gradient_checkpointing=point.gradient_checkpointing,
        optimizer=point.optimizer,
        cache_latents=point.cache_latents,
        cache_text_encoder_outputs=point.cache_text_encoder_outputs,
        train_text_encoder=point.train_text_encoder,
        attention=PLANNER_ATTENTION[point.attention],
        deepspeed=point.deepspeed,
        ema=point.ema,
        lora_rank=rank or 16,
        lora_targets=targets,
        # kohya's regularization images are drawn into the same micro-batch (train_batch_size counts them; the
        # steps double instead); diffusers' prior preservation concatenates a class batch to each batch
        prior_preservation=point.prior_preservation and "kohya" not in point.tool.lower(),
        fused_backward=point.fused_backward,
        full_half_weights=point.full_half_weights,
        set_grads_to_none=point.set_grads_to_none,
        num_gpus=point.num_gpus,
        base_precision=changes.get("base_precision", point.base_precision),
        blocks_to_swap=point.blocks_to_swap,
    )


def _calibration(profiles: Profiles) -> Any:
    """:func:`sdplan.planner.calibrate` of ``profiles``, once per profiles."""
    cached = _CALIBRATIONS.get(id(profiles))
    if cached is None or cached[0] is not profiles:
        cached = _CALIBRATIONS[id(profiles)] = (profiles, P.calibrate(profiles))
    return cached[1]


def predict(profiles: Profiles, point: "Point", *, interconnect: str = "pcie") -> Prediction:
    """Peak VRAM per GPU, host RAM and micro-batch it/s the planner predicts for ``point``'s own settings."""
    reasons = []
    family, flow, rank = _family_and_rank(point)
    if point.family == "sd35" and not point.variant:
        reasons.append("family sd35: Medium or Large not stated")
    elif family not in profiles.models:
        reasons.append(f"family {point.family}: not planned")
    if point.method not in P.METHODS:
        reasons.append(f"method {point.method}: not planned")
    if point.optimizer not in PLANNED_OPTIMIZERS:
        reasons.append(f"optimizer {point.optimizer}: not modelled (only {', '.join(PLANNED_OPTIMIZERS)})")
    if point.method == "lora" and rank is None:
        reasons.append("LoRA rank not stated")
    if (
        family in profiles.models
        and point.method in P.METHODS
        and not P.registry.family(family).plans(point.method)
    ):
        reasons.append(f"method {point.method}: not planned for {family}")
    if flow and point.train_text_encoder:
        reasons.append(f"text-encoder training: not planned for {family}")
    if point.attention not in PLANNER_ATTENTION:
        reasons.append(f"attention {point.attention}: unknown backend")
    reasons += [n for n in point.unmodelled if n not in MODELLED_NOTES]
    if reasons:
        return Prediction(not_expressible=tuple(reasons))
    setup = settings_for(point)
    mem = P.memory(profiles, setup)
    spec = next((g for g in profiles.gpus if g.name == point.gpu), None) if point.gpu else None
    if spec is None:
        why = f"GPU {point.gpu_reported!r} not in the catalog" if point.gpu_reported else "GPU not named"
        return Prediction(
            peak_vram_bytes=mem.peak,
            step_peak_bytes=mem.step_peak,
            text_cache_peak_bytes=mem.text_cache_peak,
            allocated_bytes=mem.step_peak - mem.overhead,
            host_ram_bytes=mem.ram,
            no_speed=why,
        )
    cal = _calibration(profiles)
    link = P._link_gbs_for(spec, interconnect) if point.num_gpus > 1 else None
    step = P.step_seconds(profiles, setup, spec, cal, link_gbs=link)
    planned, basis = P.planned_step_seconds(profiles, setup, spec, cal, link_gbs=link)
    return Prediction(
        peak_vram_bytes=mem.peak,
        step_peak_bytes=mem.step_peak,
        text_cache_peak_bytes=mem.text_cache_peak,
        allocated_bytes=mem.step_peak - mem.overhead,
        host_ram_bytes=mem.ram,
        it_per_s=1.0 / step if step else None,
        planned_it_per_s=1.0 / planned if planned else None,
        planned_basis=basis,
    )


# -- one description of a training configuration and what was observed --------------------------------------


@dataclass(frozen=True)
class Point:
    id: str
    family: str
    method: str
    resolution: int
    batch: int
    grad_accum: int
    precision: str
    gradient_checkpointing: bool
    optimizer: str
    cache_latents: bool
    train_text_encoder: bool
    attention: str
    source: str  # the document (a URL for validation points, the reference text for profile points)
    gpu: str | None = None  # exact catalog name
    gpu_reported: str | None = None
    gpu_memory_gib: float | None = None
    num_gpus: int = 1
    full_half_weights: bool = False
    cache_text_encoder_outputs: bool = False
    lora_rank: int | None = None
    lora_targets: str | None = None
    prior_preservation: bool = False
    ema: str | None = None
    deepspeed: dict | None = None
    fused_backward: bool = False
    tool: str = ""  # the training tool, as the validation point names it
    set_grads_to_none: bool = True  # torch >= 2.0's zero_grad default; torch 1.x kept zeroed gradients
    base_precision: str = "bf16"  # the frozen transformer base's storage (SD3.5 / FLUX.1)
    blocks_to_swap: int = 0  # kohya --blocks_to_swap (profile points only)
    variant: str | None = None  # sd35: medium / large; flux: dev (the default) / schnell
    unmodelled: tuple[str, ...] = ()
    peak_vram_gib: float | None = None
    peak_is_allocated: bool = False  # peak_vram_gib is torch.cuda.max_memory_allocated (sdplan bench points)
    ram_gib: float | None = None
    it_s: float | None = None
    fit_claims: tuple[tuple[float, bool], ...] = ()  # (card memory GiB, fits)
    quote: str = ""
    assumed: tuple[str, ...] = ()


# -- the validation set: schema and loader -------------------------------------------------------------------

VALIDATION_FAMILIES = ("sd15", "sd21", "sdxl", "sd35", "flux")
LORA_TARGETS = ("attn", "attn+ff", "attn+ff+conv")
ATTENTION_NAMES = ("xformers", "sdpa", "flash", "none")


def _one_of(*choices: Any):
    return lambda v: None if v in choices else f"must be one of {', '.join(map(str, choices))}, got {v!r}"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


B = (bool,)
OPT_NUM = (int, float, type(None))
MEASURED_SCHEMA = {
    "peak_vram_gib": F(OPT_NUM, check=_positive),
    "peak_vram_reported": F((str, type(None))),
    # the peak is torch.cuda.max_memory_allocated (no CUDA context, no allocator reserve): compared with the
    # planner's allocated bytes, as the sdplan bench points are
    "peak_vram_is_allocated": F(B, required=False),
    "it_s": F(OPT_NUM, check=_positive),
    "speed_reported": F((str, type(None))),
    "fits": F((bool, type(None))),
}
VALIDATION_POINT_SCHEMA = {
    "id": F((str,)),
    "family": F((str,), check=_one_of(*VALIDATION_FAMILIES)),
    "variant": F((str, type(None)), required=False),
    "method": F((str,), check=_one_of(*METHODS)),
    "tool": F((str,)),
    "gpu": F((str, type(None))),
    "gpu_reported": F((str, type(None))),
    "gpu_in_catalog": F(B),
    "gpu_memory_gib": F(OPT_NUM, check=_positive),
    "num_gpus": F((int,), check=_positive),
    "resolution": F((int,), check=_positive),
    "batch": F((int,), check=_positive),
    "grad_accum": F((int,), check=_positive),
    "precision": F((str,), check=_one_of("fp32", "fp16", "bf16")),
    "full_half_weights": F(B),
    "gradient_checkpointing": F(B),
    "optimizer": F((str,)),
    "cache_latents": F(B),
    "cache_text_encoder_outputs": F(B),
    "train_text_encoder": F(B),
    "lora_rank": F((int, type(None)), check=_positive),
    "lora_targets": F((str, type(None)), check=_one_of(*LORA_TARGETS)),
    "attention": F((str,), check=_one_of(*ATTENTION_NAMES)),
    "prior_preservation": F(B),
    "ema": F((str, type(None)), check=_one_of("gpu", "cpu")),
    "deepspeed": F(
        (dict, type(None)),
        required=False,
        sub={"zero_stage": F((int,), check=_one_of(1, 2, 3)), "offload_optimizer": F(B)},
    ),
    "set_grads_to_none": F(B, required=False),
    "unmodelled": F((list,), required=False, item=F((str,))),
    "measured": F((dict,), sub=MEASURED_SCHEMA),
    "source": F((dict,), sub={"url": F((str,)), "quote": F((str,))}),
    "assumed": F((list,), item=F((str,))),
    "note": F((str,), required=False),
}
VALIDATION_FILE_SCHEMA = {
    "schema_version": F((int,), check=_one_of(1)),
    "points": F((list,), item=F((dict,), sub=VALIDATION_POINT_SCHEMA)),
}


class ValidationError(Exception):
    """A validation file that does not match the schema (README.md in benchmarks/validation/)."""


def load_validation(folder: Path = VALIDATION_DIR, profiles: Profiles | None = None) -> list[Point]:
    """Every point of every ``*.yaml`` in ``folder``, checked against the schema and the GPU catalog."""
    prof = profiles or shipped_profiles()
    catalog = {g.name: g for g in prof.gpus}
    errors: list[str] = []
    points: list[Point] = []
    seen: set[str] = set()
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise ValidationError(f"{folder}: no validation files (*.yaml)")
    for path in files:
        data = read_yaml(path)
        file_errors: list[str] = []
        _check(data, VALIDATION_FILE_SCHEMA, "", file_errors)
        if file_errors:
            errors += [f"{path.name}: {e}" for e in file_errors]
            continue
        for i, d in enumerate(data["points"]):
            where = f"{path.name}: points[{i}] ({d['id']})"
            errors += [f"{where}: {e}" for e in _point_errors(d, catalog)]
            if d["id"] in seen:
                errors.append(f"{where}: duplicate id")
            seen.add(d["id"])
            points.append(_point_from_yaml(d, catalog.get(d["gpu"]) if d["gpu_in_catalog"] else None))
    if errors:
        raise ValidationError("\n".join(errors))
    return points


def _point_errors(d: dict, catalog: dict) -> list[str]:
    errors = []
    m = d["measured"]
    if all(m.get(k) is None for k in ("peak_vram_gib", "it_s", "fits")):
        errors.append("measured: records nothing (peak_vram_gib, it_s or fits)")
    if not d["source"]["url"].startswith(("https://", "http://")):
        errors.append("source.url: must be a URL")
    if not d["source"]["quote"].strip() or len(d["source"]["quote"]) > 300:
        errors.append("source.quote: must be a short exact quote (1-300 characters)")
    variant = d.get("variant")
    if variant is not None and variant not in VARIANTS.get(d["family"], ()):
        allowed = ", ".join(VARIANTS.get(d["family"], ())) or "none"
        errors.append(f"variant: {variant!r} is not a {d['family']} variant ({allowed})")
    if d["gpu_in_catalog"]:
        spec = catalog.get(d["gpu"])
        if spec is None:
            errors.append(f"gpu: {d['gpu']!r} is not a catalog name (profiles/gpus.yaml)")
        elif d["gpu_memory_gib"] != spec.memory_gib:
            errors.append(
                f"gpu_memory_gib: {d['gpu_memory_gib']} differs from the catalog's {spec.memory_gib}"
            )
    elif d["gpu"] is not None:
        errors.append("gpu: must be null when gpu_in_catalog is false (keep the name in gpu_reported)")
    if (d["method"] == "lora") != (d["lora_targets"] is not None):
        errors.append("lora_targets: set for LoRA points only")
    unknown = [
        a for a in d["assumed"] if a not in VALIDATION_POINT_SCHEMA or a in ("id", "source", "measured")
    ]
    if unknown:
        errors.append(f"assumed: not setting names: {', '.join(unknown)}")
    return errors


def _point_from_yaml(d: dict, spec: GPUSpec | None = None) -> Point:
    """``spec``: the catalog GPU the point names, whose memory its fit claim is judged against (what NVML reports
    on the card where the catalog has it: a T4 "16 GB" has 15 GiB), as a plan for that card counts it."""
    m = d["measured"]
    memory_gib = spec.memory_bytes / GiB if spec is not None else d["gpu_memory_gib"]
    claims = ((float(memory_gib), m["fits"]),) if memory_gib and m["fits"] is not None else ()
    return Point(
        id=d["id"],
        family=d["family"],
        method=d["method"],
        resolution=d["resolution"],
        batch=d["batch"],
        grad_accum=d["grad_accum"],
        precision=d["precision"],
        gradient_checkpointing=d["gradient_checkpointing"],
        optimizer=d["optimizer"],
        cache_latents=d["cache_latents"],
        train_text_encoder=d["train_text_encoder"],
        attention=d["attention"],
        source=d["source"]["url"],
        gpu=d["gpu"],
        gpu_reported=d["gpu_reported"],
        gpu_memory_gib=d["gpu_memory_gib"],
        num_gpus=d["num_gpus"],
        full_half_weights=d["full_half_weights"],
        cache_text_encoder_outputs=d["cache_text_encoder_outputs"],
        lora_rank=d["lora_rank"],
        lora_targets=d["lora_targets"],
        prior_preservation=d["prior_preservation"],
        ema=d["ema"],
        deepspeed=d.get("deepspeed"),
        set_grads_to_none=d.get("set_grads_to_none", True),
        tool=d["tool"],
        variant=d.get("variant"),
        unmodelled=tuple(d.get("unmodelled") or ()),
        peak_vram_gib=m["peak_vram_gib"],
        peak_is_allocated=bool(m.get("peak_vram_is_allocated", False)),
        it_s=m["it_s"],
        fit_claims=claims,
        quote=d["source"]["quote"],
        assumed=tuple(d["assumed"]),
    )


# -- the calibration points as Points -------------------------------------------------------------------------


def shipped_profiles() -> Profiles:
    """The shipped profiles only: a local profile store would change the calibration being measured."""
    return load_profiles(local=NO_LOCAL_STORE)


def source_key(source: str) -> str:
    """The document a profile point's source text names: its text up to the first ',', ':' or '('."""
    return re.split(r"[,:(]", source, maxsplit=1)[0].strip()


def profile_points(prof: Profiles) -> list[Point]:
    out = []
    for p in prof.points:
        o, spec = p.options, prof.point_gpu(p)
        claims = []
        if p.outcome.get("max_vram_gib"):
            claims.append((float(p.outcome["max_vram_gib"]), True))
        if p.outcome.get("exceeds_vram_gib"):
            claims.append((float(p.outcome["exceeds_vram_gib"]), False))
        memory_gib = p.gpu_memory_gib or (spec.memory_bytes / GiB if spec else None)
        if not claims and p.outcome.get("fits") is not None and memory_gib:  # e.g. sdplan bench's verdicts
            claims.append((float(memory_gib), bool(p.outcome["fits"])))
        out.append(
            Point(
                id=p.id,
                family=p.model,
                method=p.method,
                resolution=p.resolution,
                batch=p.batch,
                grad_accum=p.grad_accum,
                precision=p.precision,
                gradient_checkpointing=o.gradient_checkpointing,
                optimizer=o.optimizer,
                cache_latents=o.cache_latents,
                train_text_encoder=o.train_text_encoder,
                attention="none" if o.attention == "math" else o.attention,
                source=p.source,
                gpu=spec.name if spec else None,
                gpu_reported=p.gpu,
                gpu_memory_gib=spec.memory_gib if spec else p.gpu_memory_gib,
                num_gpus=p.num_gpus,
                full_half_weights=o.full_half_weights,
                cache_text_encoder_outputs=o.cache_text_encoder_outputs,
                lora_rank=(o.lora_rank or 16) if p.method == "lora" else None,
                lora_targets="attn" if p.method == "lora" else None,
                prior_preservation=o.prior_preservation,
                ema=o.ema,
                deepspeed=o.deepspeed,
                fused_backward=o.fused_backward,
                set_grads_to_none=o.set_grads_to_none,
                base_precision=o.base_precision,
                blocks_to_swap=o.blocks_to_swap,
                peak_vram_gib=p.outcome.get("peak_vram_gib"),
                peak_is_allocated="max_memory_allocated" in (p.note or ""),
                ram_gib=p.outcome.get("ram_gib"),
                it_s=p.outcome.get("it_s"),
                fit_claims=tuple(claims),
            )
        )
    return out


@dataclass(frozen=True)
class MultiGPU:
    id: str
    point: Point  # one-GPU configuration
    num_gpus: int
    interconnect: str
    iteration_time_ratio: float | None
    run_time_ratio: float | None
    source: str


def multi_gpu_observations(prof: Profiles) -> list[MultiGPU]:
    out = []
    for m in prof.multi_gpu:
        o, spec = m.options, prof.gpu_or_none(m.gpu)
        one = Point(
            id=m.id,
            family=m.model,
            method=m.method,
            resolution=m.resolution,
            batch=1,
            grad_accum=1,
            precision=m.precision,
            gradient_checkpointing=o.gradient_checkpointing,
            optimizer=o.optimizer,
            cache_latents=o.cache_latents,
            train_text_encoder=o.train_text_encoder,
            attention="none" if o.attention == "math" else o.attention,
            source=m.source,
            gpu=spec.name if spec else None,
            gpu_reported=m.gpu,
            full_half_weights=o.full_half_weights,
            lora_rank=(o.lora_rank or 16) if m.method == "lora" else None,
            lora_targets="attn" if m.method == "lora" else None,
        )
        out.append(
            MultiGPU(
                id=m.id,
                point=one,
                num_gpus=m.num_gpus,
                interconnect=m.interconnect,
                iteration_time_ratio=m.outcome.get("iteration_time_ratio"),
                run_time_ratio=m.outcome.get("run_time_ratio"),
                source=m.source,
            )
        )
    return out


# -- comparisons -----------------------------------------------------------------------------------------------


def _row(pid: str, quantity: str, predicted: float, published: float, source: str) -> dict:
    return {
        "id": pid,
        "quantity": quantity,
        "predicted": round(predicted, 3),
        "published": published,
        "error_pct": round(100.0 * (predicted - published) / published, 1),
        "source": source,
    }


def point_rows(prof: Profiles, pt: Point) -> tuple[list[dict], list[dict], Prediction]:
    """(numeric rows, fit-verdict rows, prediction) for one point at its own settings."""
    pred = predict(prof, pt)
    numeric, verdicts = [], []
    if pred.not_expressible:
        return numeric, verdicts, pred
    peak_gib = pred.peak_vram_bytes / GiB
    if pt.peak_vram_gib:  # a measured peak is of the training steps
        compared = (pred.allocated_bytes if pt.peak_is_allocated else pred.step_peak_bytes) / GiB
        numeric.append(_row(pt.id, "peak VRAM GiB", compared, pt.peak_vram_gib, pt.source))
    if pt.ram_gib:
        numeric.append(_row(pt.id, "host RAM GiB", pred.host_ram_bytes / GiB, pt.ram_gib, pt.source))
    if pt.it_s and pred.it_per_s:
        numeric.append(_row(pt.id, f"it/s on {pt.gpu}", pred.it_per_s, pt.it_s, pt.source))
    low, high = prof.uncertainty.peak_for(_family_and_rank(pt)[0])[0]
    likely = P.peak_range_of(
        pred.step_peak_bytes / GiB, pred.text_cache_peak_bytes / GiB, (low, high), (low, high)
    )
    for memory_gib, fits in pt.fit_claims:
        predicted_fits = peak_gib <= memory_gib
        verdicts.append(
            {
                "id": pt.id,
                "claim": f"{'fits' if fits else 'does not fit'} in {memory_gib:.4g} GiB",
                "predicted_gib": round(peak_gib, 2),
                "predicted_fits": predicted_fits,
                "reported_fits": fits,
                "agree": predicted_fits == fits,
                # the card's memory inside the likely peak range: `recommend` flags such a plan ("may run out
                # of memory") instead of stating a verdict
                "within_range": likely[0] <= memory_gib < likely[1],
                "source": pt.source,
            }
        )
    return numeric, verdicts, pred


def multi_gpu_rows(prof: Profiles, mg: MultiGPU) -> list[dict]:
    """The observation's step-time ratio (N GPUs / one) as a plan predicts it: the N-GPU step as
    :func:`sdplan.planner._evaluate` times it (the all-reduce at the rate of a matching observation,
    :func:`sdplan.planner._observed_multi_gpu`, else the fitted one), over the one-GPU step its reasons divide
    by (:func:`sdplan.planner.planned_step_seconds`). Each row says where its rate came from (``rate``): an
    observation's id, "fitted" (the geomean of the observations ``prof`` holds) or "fallback" (none: the
    constant :data:`sdplan.planner.LINK_EFFICIENCY_FALLBACK`)."""
    one = predict(prof, mg.point)
    if not one.it_per_s:
        return []
    spec = next(g for g in prof.gpus if g.name == mg.point.gpu)
    cal = _calibration(prof)
    alone = settings_for(mg.point)
    many = replace(alone, num_gpus=mg.num_gpus)
    gpus = P.hardware_from_catalog(spec, mg.num_gpus).gpus
    observed = P._observed_multi_gpu(prof, many, gpus, mg.interconnect)
    link = P._link_gbs_for(spec, mg.interconnect)
    t_many, _ = P.planned_step_seconds(prof, many, spec, P._with_link_rate(cal, observed), link_gbs=link)
    t_one, _ = P.planned_step_seconds(prof, alone, spec, cal)
    if not t_many or not t_one:
        return []
    ratio = t_many / t_one  # iteration time with N GPUs / with one
    rate = observed.id if observed is not None else "fitted" if cal.link_points else "fallback"
    rows = []
    if mg.iteration_time_ratio:
        rows.append(_row(mg.id, "multi-GPU iteration time ratio", ratio, mg.iteration_time_ratio, mg.source))
    if mg.run_time_ratio:
        rows.append(
            _row(mg.id, "multi-GPU run time ratio", ratio / mg.num_gpus, mg.run_time_ratio, mg.source)
        )
    return [dict(r, rate=rate) for r in rows]


def _stats(rows: list[dict]) -> dict:
    errors = [abs(r["error_pct"]) for r in rows]
    return {
        "n": len(errors),
        "median_abs_error_pct": round(statistics.median(errors), 1) if errors else None,
        "max_abs_error_pct": round(max(errors), 1) if errors else None,
    }


def _agreement(verdicts: list[dict]) -> dict:
    """Agreement of the point prediction's verdict with the reports, and apart from it the verdicts whose
    likely peak range lies wholly on one side of the card's memory (where `recommend` states a verdict without
    a "may run out of memory" flag). The range comes from profiles/uncertainty.yaml, itself computed from the
    validation set's measured peaks, so the second figure is not independent of the validation set."""
    agree = sum(v["agree"] for v in verdicts)
    clear = [v for v in verdicts if not v["within_range"]]
    clear_agree = sum(v["agree"] for v in clear)
    return {
        "agree": agree,
        "total": len(verdicts),
        "agreement_pct": round(100.0 * agree / len(verdicts), 1) if verdicts else None,
        "outside_range_agree": clear_agree,
        "outside_range_total": len(clear),
        "outside_range_agreement_pct": round(100.0 * clear_agree / len(clear), 1) if clear else None,
        "within_range": len(verdicts) - len(clear),
    }


def _by(rows: list[dict], prefix: str) -> list[dict]:
    return [r for r in rows if r["quantity"].startswith(prefix)]


def in_sample(prof: Profiles) -> dict:
    numeric, verdicts = [], []
    for pt in profile_points(prof):
        n, v, _ = point_rows(prof, pt)
        numeric += n
        verdicts += v
    for mg in multi_gpu_observations(prof):
        numeric += multi_gpu_rows(prof, mg)
    return {
        "figures": numeric,
        "fit_verdicts": verdicts,
        "summary": {
            "peak_vram": _stats(_by(numeric, "peak VRAM")),
            "host_ram": _stats(_by(numeric, "host RAM")),
            "speed": _stats(_by(numeric, "it/s")),
            "multi_gpu_ratio": _stats(_by(numeric, "multi-GPU")),
            # predicted at the observation's own measured rate, as a plan on that GPU takes it (a check that a
            # plan reproduces what it was fitted on, not a prediction)
            "multi_gpu_ratio_own_rate": sum(r.get("rate") == r["id"] for r in _by(numeric, "multi-GPU")),
            "fit_verdict": _agreement(verdicts),
        },
    }


def rows(profiles: Profiles | None = None) -> tuple[list[dict], list[dict]]:
    """In-sample (numeric comparisons, "fits in X GB" checks) for every profile point and multi-GPU run."""
    result = in_sample(profiles or shipped_profiles())
    checks = [
        {"id": v["id"], "claim": v["claim"], "predicted_gib": v["predicted_gib"], "ok": v["agree"]}
        for v in result["fit_verdicts"]
    ]
    return result["figures"], checks


def _measured_here(row: dict) -> bool:
    """A profile point this project measured (sdplan bench, benchmarks/deepspeed_memory.py), not published."""
    return row["source"].startswith("measured:")


def leave_one_source_out(prof: Profiles) -> dict:
    """Each calibration source's figures predicted by a calibration fitted without that source."""
    points, observations = profile_points(prof), multi_gpu_observations(prof)
    keys = sorted({source_key(p.source) for p in points} | {source_key(m.source) for m in observations})
    rows: list[dict] = []
    for key in keys:
        without = replace(
            prof,
            points=tuple(p for p in prof.points if source_key(p.source) != key),
            multi_gpu=tuple(m for m in prof.multi_gpu if source_key(m.source) != key),
        )
        for pt in points:
            if source_key(pt.source) == key:
                rows += [
                    dict(r, left_out=key)
                    for r in point_rows(without, pt)[0]
                    if r["quantity"].startswith("it/s")
                ]
        for mg in observations:
            if source_key(mg.source) == key:
                rows += [dict(r, left_out=key) for r in multi_gpu_rows(without, mg)]
    speeds = _by(rows, "it/s")
    return {
        "sources": keys,
        "figures": rows,
        "summary": {
            "speed": _stats(speeds),
            # the published speeds, each source left out in turn; this project's own measurements (the H100
            # sessions' sdplan bench and DeepSpeed points) share one source key, so they are left out together
            # and predicted from the consumer cards alone: one figure for both said neither
            "speed_published": _stats([r for r in speeds if not _measured_here(r)]),
            "speed_measured_here": _stats([r for r in speeds if _measured_here(r)]),
            "multi_gpu_ratio": _stats(_by(rows, "multi-GPU")),
            # the multi-GPU ratios whose source was the only one with a multi-GPU observation: left out, no
            # rate is fitted and calibrate() falls back to a constant, which the figure then tests
            "multi_gpu_ratio_fallback": sum(r.get("rate") == "fallback" for r in _by(rows, "multi-GPU")),
        },
        "note": (
            "calibrate() fits only the speed efficiencies and the link efficiency; the memory constants are "
            "module constants of sdplan.planner, so peak VRAM is unchanged by leaving a source out"
        ),
    }


def _stats_by_basis(rows: list[dict]) -> dict:
    """``_stats`` of the rows of each basis (measured, scaled, ...) a plan states them on."""
    return {
        basis: _stats([r for r in rows if r["basis"] == basis])
        for basis in sorted({r["basis"] for r in rows})
    }


def bench_leave_one_out(prof: Profiles) -> dict:
    """Each sdplan bench speed predicted as a plan states it (``planner.planned_step_seconds``: the measured
    point, else the model scaled by the nearest other bench point on that GPU, else the model) by profiles
    without that point (calibration and evidence). The rows whose basis is "scaled" are how far a scaled plan
    falls from a measurement: scripts/uncertainty.py writes their spread as the scaled basis' range."""
    rows = []
    for p in prof.points:
        it_s, gpu = p.outcome.get("it_s"), prof.point_gpu(p)
        if not (p.from_bench and it_s and gpu is not None and p.num_gpus == 1):
            continue
        without = replace(prof, points=tuple(q for q in prof.points if q.id != p.id))
        seconds, basis = P.planned_step_seconds(without, p.settings, gpu, P.calibrate(without))
        if seconds:
            rows.append(dict(_row(p.id, f"it/s on {gpu.name}", 1.0 / seconds, it_s, p.source), basis=basis))
    return {"figures": rows, "summary": _stats_by_basis(rows)}


def bench_peak_leave_one_out(prof: Profiles) -> dict:
    """Each sdplan bench peak (torch's allocated peak) predicted as a plan states it, by profiles without that
    point: the model scaled by the bench point on that GPU at the same settings and the nearest other batch
    (``planner.peak_evidence`` / ``evidenced_allocated_bytes``, basis "scaled"), else the model ("predicted").
    scripts/uncertainty.py writes the scaled rows' spread as the scaled peak's range."""
    rows = []
    for p in prof.points:
        peak, gpu = p.outcome.get("peak_vram_gib"), prof.point_gpu(p)
        if not (p.from_bench and peak and gpu is not None and p.num_gpus == 1 and p.outcome.get("fits")):
            continue
        without = replace(prof, points=tuple(q for q in prof.points if q.id != p.id))
        mem = P.memory(without, p.settings)
        evidence = P.peak_evidence(without, p.settings, gpu)
        if evidence is None:
            allocated, basis = mem.step_peak - mem.overhead, "predicted"
        else:
            allocated, basis = P.evidenced_allocated_bytes(without, p.settings, mem, evidence[0]), evidence[1]
        rows.append(dict(_row(p.id, "peak VRAM GiB", allocated / GiB, float(peak), p.source), basis=basis))
    return {"figures": rows, "summary": _stats_by_basis(rows)}


def sampling_fit(prof: Profiles) -> dict:
    """The txt2img speeds of profiles/sampling.yaml (what the planner charges for class images and sample
    grids): in sample (the fit on all of them) and out of sample, each GPU's speeds predicted by the fit on the
    other GPUs' (``planner.fit_sampling``). The sampling time's range comes from the validation set instead
    (:func:`sampling_out_of_sample`, scripts/uncertainty.py)."""
    rows = P.sampling_rows(prof)
    fit = P.fit_sampling(rows)
    fitted, left_out = [], []
    for r in rows:
        fitted.append(_row(r.id, f"it/s on {r.gpu}", 1.0 / fit.predicted(r), 1.0 / r.seconds, "fit"))
    for gpu in sorted({r.gpu for r in rows}):
        without = P.fit_sampling([r for r in rows if r.gpu != gpu])
        for r in rows:
            if r.gpu == gpu:
                left_out.append(
                    _row(r.id, f"it/s on {r.gpu}", 1.0 / without.predicted(r), 1.0 / r.seconds, gpu)
                )
    return {
        "efficiency": fit.efficiency,
        "by_architecture": dict(fit.by_arch),
        "floor_s": fit.floor_s,
        "in_sample": fitted,
        "each_gpu_left_out": left_out,
        "summary": {"in_sample": _stats(fitted), "each_gpu_left_out": _stats(left_out)},
    }


SAMPLING_VALIDATION_DIR = VALIDATION_DIR / "sampling"
SAMPLING_KEYS = {
    "id",
    "gpu",
    "gpu_as_reported",
    "family",
    "width",
    "height",
    "images",
    "guidance",
    "precision",
    "attention",
    "it_per_s",
    "timing",
    "url",
    "quote",
    "assumed",
}  # required; also steps (end-to-end timings), software, derivation, model_note, excluded


def load_sampling_validation(folder: Path = SAMPLING_VALIDATION_DIR) -> list[dict]:
    """The txt2img speeds of ``folder``/*.yaml (the sampling time's out-of-sample check), checked: every key
    there, a catalog GPU where not excluded, an end-to-end timing with its steps."""
    optional = {"steps", "software", "derivation", "model_note", "excluded"}
    catalog = {g.name for g in shipped_profiles().gpus}
    points, errors, seen = [], [], set()
    for path in sorted(folder.glob("*.yaml")):
        for i, d in enumerate(read_yaml(path)["points"]):
            where = f"{path.name}: points[{i}] ({d.get('id')})"
            missing, unknown = SAMPLING_KEYS - set(d), set(d) - SAMPLING_KEYS - optional
            errors += [f"{where}: missing {k}" for k in sorted(missing)]
            errors += [f"{where}: unknown key {k}" for k in sorted(unknown)]
            if d.get("id") in seen:
                errors.append(f"{where}: duplicate id")
            seen.add(d.get("id"))
            if not d.get("excluded") and d.get("timing") == "end-to-end" and not d.get("steps"):
                errors.append(f"{where}: an end-to-end timing needs its steps")
            if d.get("timing") not in ("denoise", "end-to-end", "forward"):
                errors.append(f"{where}: timing must be denoise, end-to-end or forward")
            if not d.get("excluded") and d.get("gpu") not in catalog:
                errors.append(f"{where}: gpu {d.get('gpu')!r} is not a catalog name (profiles/gpus.yaml)")
            points.append(d)
    if errors:
        raise ValidationError("\n".join(errors))
    return points


def predict_sampling_it_s(prof: Profiles, cal: Any, d: dict) -> float | None:
    """A txt2img speed as the planner's sampling time predicts it: one denoising step
    (``planner.denoise_step_seconds``) for the denoising loop alone or one denoiser forward, the whole pipeline
    call (``planner.pipeline_seconds``, as a plan's images: the prompt's encoding, the steps, each image's VAE
    decode, fp32 for SDXL's fp16 VAE, which diffusers upcasts) over its steps for an end-to-end time."""
    spec = prof.find_gpu(d["gpu"])
    latent = P.latent_size(prof, d["family"], d["width"], d["height"])
    attention = "math" if d["attention"] == "math" else "efficient"
    if d["timing"] != "end-to-end":
        batch = P.denoiser_batch(d["images"], d["guidance"])
        step = P.denoise_step_seconds(prof, d["family"], latent, d["precision"], batch, spec, cal, attention)
        return 1.0 / step if step else None
    vae = "fp32" if d["family"] == "sdxl" and d["precision"] == "fp16" else d["precision"]
    total = P.pipeline_seconds(
        prof,
        d["family"],
        latent,
        d["precision"],
        spec,
        cal,
        images=d["images"],
        steps=d["steps"],
        guided=d["guidance"],
        vae_precision=vae,
        attention=attention,
    )
    return d["steps"] / total if total else None


def sampling_out_of_sample(prof: Profiles, points: list[dict]) -> dict:
    """The validation set's txt2img speeds against the sampling time's prediction (nothing fitted on them)."""
    cal = P.calibrate(prof)
    rows, excluded = [], []
    for d in points:
        if d.get("excluded"):
            excluded.append({"id": d["id"], "reason": d["excluded"]})
            continue
        it_s = predict_sampling_it_s(prof, cal, d)
        if it_s is None:
            excluded.append({"id": d["id"], "reason": "no prediction (no byte count or GPU rate)"})
            continue
        row = _row(d["id"], f"it/s on {d['gpu']} ({d['timing']})", it_s, d["it_per_s"], d["url"])
        rows.append(dict(row, family=d["family"]))
    unet = [r for r in rows if not P.flow_family(r["family"])]
    flow = [r for r in rows if P.flow_family(r["family"])]
    return {
        "figures": rows,
        "excluded": excluded,
        "summary": {"all": _stats(rows), "unet": _stats(unet), "transformer": _stats(flow)},
    }


def out_of_sample(prof: Profiles, points: list[Point]) -> dict:
    numeric, verdicts, per_point, planned = [], [], [], []
    not_expressible: list[dict] = []
    no_speed = 0
    for pt in points:
        n, v, pred = point_rows(prof, pt)
        numeric += n
        verdicts += v
        if pt.it_s and pred.planned_it_per_s and not pred.not_expressible:
            planned.append(
                _row(
                    pt.id,
                    f"it/s as planned ({pred.planned_basis})",
                    pred.planned_it_per_s,
                    pt.it_s,
                    pt.source,
                )
            )
        if pred.not_expressible:
            not_expressible.append({"id": pt.id, "reasons": list(pred.not_expressible), "source": pt.source})
        elif pt.it_s and pred.no_speed:
            no_speed += 1
        per_point.append(
            {
                "id": pt.id,
                "family": pt.family,
                "method": pt.method,
                "gpu": pt.gpu or pt.gpu_reported,
                "predicted_peak_vram_gib": round(pred.peak_vram_bytes / GiB, 2)
                if pred.peak_vram_bytes
                else None,
                "measured_peak_vram_gib": pt.peak_vram_gib,
                "predicted_it_s": round(pred.it_per_s, 3) if pred.it_per_s else None,
                "measured_it_s": pt.it_s,
                "reported_fits": pt.fit_claims[0][1] if pt.fit_claims else None,
                "not_expressible": list(pred.not_expressible),
                "no_speed": pred.no_speed if pt.it_s else None,
                "assumed": list(pt.assumed),
                "source": pt.source,
            }
        )
    reasons = Counter(_reason_kind(r) for ne in not_expressible for r in ne["reasons"])
    return {
        "points": per_point,
        "figures": numeric,
        "fit_verdicts": verdicts,
        "planned_speeds": planned,
        "not_expressible": not_expressible,
        "summary": {
            "speed_as_planned": _stats(planned),
            "speed_scaled_by_a_near_point": sum("(scaled)" in r["quantity"] for r in planned),
            "points": len(points),
            "sources": len({pt.source for pt in points}),
            "peak_vram": _stats(_by(numeric, "peak VRAM")),
            "speed": _stats(_by(numeric, "it/s")),
            "fit_verdict": _agreement(verdicts),
            "not_expressible": {
                "count": len(not_expressible),
                "reasons": dict(sorted(reasons.items())),  # a point can have several
            },
            "speed_without_catalog_gpu": no_speed,
        },
    }


def _reason_kind(reason: str) -> str:
    for kind in ("family", "method", "optimizer", "LoRA on", "LoRA rank", "attention"):
        if reason.startswith(kind):
            return kind.replace(" on", " targets")
    return "unmodelled feature"


def recommend_wall_time(runs: int = 3) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "sdplan.cli",
        "recommend",
        "--method",
        "lora",
        "--hardware",
        "2x RTX 4090",
        "--json",
    ]

    def timed(command: list[str]) -> list[float]:
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            out.append(time.perf_counter() - t0)
        return out

    # on the same machine: the SD 1.5 default, a FLUX.1 plan, FLUX.1 on 8 GPUs (the largest search a catalog
    # machine gives: every configuration on 1 to 8 GPUs), import torch
    times = timed(cmd)
    flux = timed([*cmd, "--model", "flux-dev"])
    flux8 = timed([*cmd[:-2], "8x H100 SXM", "--json", "--model", "flux-dev"])
    torch_s = timed([sys.executable, "-c", "import torch"])
    probe = (
        "import sys; from sdplan.cli import app\n"
        "try:\n app(['recommend','--method','dreambooth','--hardware','RTX 4090','--json'], standalone_mode=False)\n"
        "except SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return {
        "median_s": round(statistics.median(times), 3),
        "runs": [round(t, 3) for t in times],
        "flux_median_s": round(statistics.median(flux), 3),
        "flux_8_gpus_median_s": round(statistics.median(flux8), 3),
        "import_torch_median_s": round(statistics.median(torch_s), 3),
        "torch_imported": out.strip().splitlines()[-1] == "True",
    }


def report(timing: bool = True, folder: Path = VALIDATION_DIR) -> dict:
    prof = shipped_profiles()
    result = {
        "in_sample": in_sample(prof),
        "leave_one_source_out": leave_one_source_out(prof),
        "bench_leave_one_out": bench_leave_one_out(prof),
        "bench_peak_leave_one_out": bench_peak_leave_one_out(prof),
        "out_of_sample": out_of_sample(prof, load_validation(folder, prof)),
        "sampling": sampling_fit(prof),
        "sampling_out_of_sample": sampling_out_of_sample(prof, load_sampling_validation(folder / "sampling")),
    }
    if timing:
        result["recommend_wall_time"] = recommend_wall_time()
    return result


# -- rendering -----------------------------------------------------------------------------------------------


def _fmt(s: dict) -> str:
    if not s["n"]:
        return "n=0"
    return f"median {s['median_abs_error_pct']}%, max {s['max_abs_error_pct']}% (n={s['n']})"


def _fmt_agree(a: dict) -> str:
    return f"{a['agree']}/{a['total']} ({a['agreement_pct']}%)" if a["total"] else "0/0"


def _fmt_clear(a: dict) -> str:
    if not a["total"]:
        return "0/0"
    return (
        f"{a['outside_range_agree']}/{a['outside_range_total']} ({a['outside_range_agreement_pct']}%), "
        f"{a['within_range']} flagged"
    )


def _fallback_text(summary: dict) -> str:
    """Where leaving a source out left no multi-GPU observation to fit a rate on, that those ratios test the
    fallback constant, not a refit."""
    n, total = summary.get("multi_gpu_ratio_fallback", 0), summary["multi_gpu_ratio"]["n"]
    if not n:
        return ""
    which = "all" if n == total else f"{n} of {total}"
    return (
        f" ({which} with no other source's multi-GPU observation to refit on: the fallback link efficiency "
        f"{P.LINK_EFFICIENCY_FALLBACK:g}, a constant, not a fit)"
    )


def _figure_line(r: dict, extra: str = "") -> str:
    """One predicted-against-measured row of the report."""
    return (
        f"{r['id']:44s} {r['quantity']:32s} {r['predicted']:10.3f} {r['published']:10.3f} {r['error_pct']:+7.1f}%"
        + extra
    )


def render(result: dict) -> str:
    lines = []
    for title, part in (
        ("IN-SAMPLE (profile points)", "in_sample"),
        ("OUT-OF-SAMPLE (validation set)", "out_of_sample"),
    ):
        lines += [
            f"== {title}",
            f"{'point':44s} {'quantity':32s} {'predicted':>10s} {'measured':>10s} {'error':>8s}",
        ]
        for r in result[part]["figures"]:
            lines.append(_figure_line(r))
        for v in result[part]["fit_verdicts"]:
            mark = "ok " if v["agree"] else "NO "
            flag = "  (card within the likely range: flagged)" if v["within_range"] else ""
            lines.append(
                f"{mark} {v['id']:44s} {v['claim']:26s} predicted {v['predicted_gib']:.2f} GiB{flag}"
            )
        lines.append("")
    loso = result["leave_one_source_out"]
    lines.append("== LEAVE-ONE-SOURCE-OUT (calibration refitted without the source)")
    for r in loso["figures"]:
        lines.append(_figure_line(r))
    lines += [f"({loso['note']})", ""]
    bench = result["bench_leave_one_out"]
    lines.append(
        "== SDPLAN BENCH POINTS, each left out (calibration and evidence), as a plan states the speed"
    )
    for r in bench["figures"]:
        lines.append(_figure_line(r, f"  {r['basis']}"))
    lines.append("")
    lines.append("== SDPLAN BENCH PEAKS, each left out (evidence), as a plan states the peak")
    for r in result["bench_peak_leave_one_out"]["figures"]:
        lines.append(_figure_line(r, f"  {r['basis']}"))
    lines.append("")
    sampling = result["sampling"]
    lines.append(
        f"== SAMPLING SPEEDS (profiles/sampling.yaml), each GPU left out of the fit (all in: efficiency "
        f"{sampling['efficiency']:.3f}, by architecture "
        + ", ".join(f"{a} {e:.3f}" for a, e in sampling["by_architecture"].items())
        + f"; floor {sampling['floor_s'] * 1000:.1f} ms a step)"
    )
    for r in sampling["each_gpu_left_out"]:
        lines.append(_figure_line(r))
    lines.append("")
    soos = result["sampling_out_of_sample"]
    lines.append(
        "== SAMPLING SPEEDS, validation set (benchmarks/validation/sampling/), nothing fitted on them"
    )
    for r in soos["figures"]:
        lines.append(_figure_line(r))
    for x in soos["excluded"]:
        lines.append(f"{x['id']:44s} excluded: {x['reason']}")
    lines.append("")
    ne = result["out_of_sample"]["not_expressible"]
    lines.append(f"== NOT EXPRESSIBLE by the planner ({len(ne)} validation points)")
    for n in ne:
        lines.append(f"{n['id']:44s} {'; '.join(n['reasons'])}")
    lines.append("")
    ins, oos, ls = result["in_sample"]["summary"], result["out_of_sample"]["summary"], loso["summary"]
    lines += [
        "== SUMMARY                  in-sample                          out-of-sample",
        f"peak VRAM |error|          {_fmt(ins['peak_vram']):34s} {_fmt(oos['peak_vram'])}",
        f"speed (it/s) |error|       {_fmt(ins['speed']):34s} {_fmt(oos['speed'])}",
        f"  as a plan states it      {'':34s} {_fmt(oos['speed_as_planned'])}, "
        f"{oos['speed_scaled_by_a_near_point']} scaled by a speed measured near it on that GPU",
        f"fit verdict agreement      {_fmt_agree(ins['fit_verdict']):34s} {_fmt_agree(oos['fit_verdict'])}",
        f"  range clear of the card  {_fmt_clear(ins['fit_verdict']):34s} {_fmt_clear(oos['fit_verdict'])}",
        f"host RAM |error|           {_fmt(ins['host_ram'])}",
        f"multi-GPU ratios |error|   {_fmt(ins['multi_gpu_ratio'])}, as a plan predicts them: "
        f"{ins['multi_gpu_ratio_own_rate']} at their own observation's measured rate",
        f"leave-one-source-out: published speeds {_fmt(ls['speed_published'])}; this project's H100 "
        f"speeds, left out together as one source: {_fmt(ls['speed_measured_here'])}; all speeds "
        f"{_fmt(ls['speed'])}; multi-GPU ratios {_fmt(ls['multi_gpu_ratio'])}{_fallback_text(ls)}",
        "sdplan bench speeds, each left out: "
        + "; ".join(f"{b} {_fmt(s)}" for b, s in result["bench_leave_one_out"]["summary"].items()),
        "sdplan bench peaks, each left out: "
        + "; ".join(f"{b} {_fmt(s)}" for b, s in result["bench_peak_leave_one_out"]["summary"].items()),
        f"sampling speeds (class images, grids): in-sample {_fmt(sampling['summary']['in_sample'])}; each "
        f"GPU left out {_fmt(sampling['summary']['each_gpu_left_out'])}; validation set: SD 1.x/SDXL "
        f"{_fmt(soos['summary']['unet'])}, SD3.5 / FLUX.1 {_fmt(soos['summary']['transformer'])}",
        f"validation set: {oos['points']} points from {oos['sources']} sources; "
        f"{oos['not_expressible']['count']} not expressible (reasons: {oos['not_expressible']['reasons']}); "
        f"{oos['speed_without_catalog_gpu']} speeds on GPUs not named or not in the catalog",
    ]
    if "recommend_wall_time" in result:
        w = result["recommend_wall_time"]
        lines.append(
            f"sdplan recommend wall time: median {w['median_s']} s over {len(w['runs'])} runs (FLUX.1: "
            f"{w['flux_median_s']} s; FLUX.1 on 8x H100 SXM: {w['flux_8_gpus_median_s']} s; python -c "
            f"'import torch': {w['import_torch_median_s']} s); "
            f"torch imported: {w['torch_imported']}"
        )
    return "\n".join(lines)


def write_chart(result: dict, path: Path) -> Path:
    """Predicted against measured, as a picture: peak VRAM (left) and speed (right), the profile points the
    planner is fitted on (in sample) beside the validation set (out of sample), with the +-10% / +-25% lines of
    the targets. Log scales: the points span 0.2-80 GiB and 0.07-12 it/s."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig = Figure(figsize=(12, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    panels = (("peak VRAM GiB", "peak VRAM, GiB"), ("it/s", "speed, it/s"))
    for i, (prefix, label) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        values: list[float] = []
        for key, name, style in (
            ("in_sample", "in sample (fitted on)", dict(marker="o", color="C0", alpha=0.45, s=18)),
            ("out_of_sample", "out of sample (validation)", dict(marker="D", color="C3", s=30)),
        ):
            rows = [r for r in result[key]["figures"] if r["quantity"].startswith(prefix)]
            values += [v for r in rows for v in (r["published"], r["predicted"]) if v and v > 0]
            if rows:
                med = statistics.median(abs(r["error_pct"]) for r in rows)
                ax.scatter(
                    [r["published"] for r in rows],
                    [r["predicted"] for r in rows],
                    label=f"{name}: n={len(rows)}, median |error| {med:.1f}%",
                    **style,
                )
        lo, hi = (min(values) / 1.3, max(values) * 1.3) if values else (0.1, 10.0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = [lo, hi]
        ax.plot(xs, xs, color="black", linewidth=1)
        for band, dash in ((0.10, ":"), (0.25, "--")):
            for f in (1 - band, 1 + band):
                ax.plot(xs, [x * f for x in xs], color="grey", linestyle=dash, linewidth=0.8)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        for axis in (ax.xaxis, ax.yaxis):  # 0.1, 0.2, 0.5, 1, 2, 5, ... rather than 10^-1
            axis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(f"{label}: lines at +-10% (dotted) and +-25% (dashed)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(True, which="both", alpha=0.2)
    fig.suptitle("sdplan's planner: predicted against measured (benchmarks/planner_accuracy.py)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--no-timing", action="store_true", help="skip timing `sdplan recommend`")
    parser.add_argument(
        "--chart", type=Path, metavar="PNG", help="also draw predicted against measured to this PNG file"
    )
    parser.add_argument("--validation-dir", type=Path, default=VALIDATION_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = report(timing=not args.no_timing, folder=args.validation_dir)
    except ValidationError as e:
        print(f"benchmarks/validation: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else render(result))
    if args.chart is not None:
        print(f"wrote {write_chart(result, args.chart)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
