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

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from sdplan import planner as P
from sdplan import registry
from sdplan.profiles import GiB, clear_cache, load_profiles
from sdplan.settings import Settings

FAMILIES = tuple(f.name for f in registry.FAMILY_LIST)
UNET_FAMILIES = tuple(f for f in FAMILIES if not P.flow_family(f))
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


def _violations(prof, family: str, leaner: Callable[[Settings], Settings | None]) -> list[str]:
    """Settings where ``leaner(s)`` (a configuration that should need no more memory) predicts a higher peak."""
    out, compared = [], 0
    for s, before in _space(prof, family):
        other = leaner(s)
        if other is None or other == s:
            continue
        compared += 1
        after = P.memory(prof, other).peak
        if after > before + SLACK:
            changed = {k: (getattr(s, k), getattr(other, k)) for k in Settings.__dataclass_fields__}
            changed = {k: v for k, v in changed.items() if v[0] != v[1]}
            out.append(
                f"{s.method} {s.model} {P._describe(s)}: {changed} raises the peak "
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
    # (trainer/quantize.py, planner.frozen_text_encoder_bytes), so with them resident nf4 can need more than fp8
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
    bad = _violations(prof, family, SAVERS[saver])
    assert not bad, f"{len(bad)} configurations, e.g. {bad[:3]}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_larger_batch_never_lowers_the_predicted_peak(prof, family):
    bad = []
    for s, before in _space(prof, family):
        bigger = replace(s, batch=s.batch * 2)
        after = P.memory(prof, bigger).peak
        if after < before - SLACK:
            bad.append(f"{P._describe(s)}: batch x2 {before / GiB:.3f} -> {after / GiB:.3f} GiB")
    assert not bad, f"{len(bad)} configurations, e.g. {bad[:3]}"
