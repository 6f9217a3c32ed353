"""Strict loader for the shipped profiles (GPU catalog, model families, method points, activations).

The YAML files ship inside the package (``profiles/`` in the source tree, ``sdplan/profile_data/`` in a wheel);
a local profile store (``$SDPLAN_PROFILE_DIR``, else ``$XDG_DATA_HOME/sdplan/profiles``) adds measured points
and GPUs when present. Every file is checked against its schema: unknown keys are rejected and every error in
a file is reported at once (:class:`~sdplan.errors.ConfigError`). No torch here; loading is cached.

GPU names are matched exactly after normalisation (``rtx4090``, ``NVIDIA GeForce RTX 3060``, ``H100 SXM``) or
through a catalog alias, never by similarity: an unknown name is a :class:`~sdplan.errors.UsageError` that only
suggests the closest catalog names.

Why one module of ~1,300 lines: it is the one owner of the profile data's format: every file's schema, the typed
records the planner reads, the strict loader, the GPU-name matching over the catalog it loads, the uncertainty
file, and the one writer of the local store (which validates what it writes with the same loader). Schema and
loader change together whenever a field is added; about half of the lines are the schemas themselves.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import math
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sdplan.errors import ConfigError, UsageError
from sdplan.registry import (
    BASE_PRECISIONS,
    FAMILIES,
    FLOW_FAMILIES,
    METHODS,
    OPTIMIZERS,
    PLANNED_FAMILIES,
    PRECISIONS,
    lora_targets,
    not_planned,
)
from sdplan.settings import Settings

SCHEMA_VERSION = 1
# Flow-matching transformer families (registry.FLOW_FAMILIES) have profile data (configs, parameter counts,
# activations) that the planner does not plan yet (issue 14): loaded and validated, kept apart in
# Profiles.unplanned_models.
TRANSFORMER_CLASSES = ("SD3Transformer2DModel", "FluxTransformer2DModel")
TEXT_ENCODER_CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "T5EncoderModel")
ATTENTION = ("efficient", "math")
# activations.yaml: whole UNet trained, or only the attention projections (required); the LoRA target sets
# beyond attention (kohya's Transformer2DModel linears, + LoCon's ResNet convs) where computed
TRAINED = ("unet", "attn")
LORA_TRAINED = ("attn_ff", "attn_ff_conv")
# activations.yaml, transformer families: whole transformer trained, or only the family's LoRA target modules
TRANSFORMER_TRAINED = ("full", "lora")
GiB = 2**30

try:  # libyaml when available: several times faster
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover
    _Loader = yaml.SafeLoader


# -- locations -------------------------------------------------------------------------------------------


def shipped_dir() -> Path:
    """The profiles that ship with sdplan: ``sdplan/profile_data/`` in a wheel, ``profiles/`` in the source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "profile_data", here.parent / "profiles"):
        if (candidate / "models").is_dir() or (candidate / "gpus.yaml").is_file():
            return candidate
    return here.parent / "profiles"


CACHE_ENV = "SDPLAN_CACHE_DIR"


def cache_dir() -> Path:
    """sdplan's cache (parsed profiles, the demo's tiny models): ``$SDPLAN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/sdplan``, else ``~/.cache/sdplan``. Deleting it only costs time."""
    path = _user_dir(CACHE_ENV, "XDG_CACHE_HOME", ".cache")
    if path is None:  # callers keep no cache then
        raise OSError(f"no home folder to keep sdplan's cache in; set ${CACHE_ENV}")
    return path


def local_dir() -> Path:
    """The user's local profile store (measurements made on this machine; ``$SDPLAN_PROFILE_DIR``, else
    ``$XDG_DATA_HOME/sdplan/profiles``, else ``~/.local/share/sdplan/profiles``); may not exist."""
    path = _user_dir("SDPLAN_PROFILE_DIR", "XDG_DATA_HOME", ".local/share", "profiles")
    if path is None:
        raise UsageError(
            "no home folder to find the local profile store in",
            fix="set $SDPLAN_PROFILE_DIR to a folder for sdplan's measurements",
        )
    return path


def _user_dir(env: str, xdg_var: str, xdg_default: str, *tail: str) -> Path | None:
    """``$env`` as given, else ``$xdg_var/sdplan/*tail``, else ``~/xdg_default/sdplan/*tail``; None where there
    is no home folder (a container's arbitrary user, without $HOME)."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get(xdg_var)
    if xdg:
        return Path(xdg).expanduser().joinpath("sdplan", *tail)
    try:
        home = Path.home()
    except (RuntimeError, KeyError):
        return None
    return home.joinpath(xdg_default, "sdplan", *tail)


# -- schema checking -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class F:
    """One key of a schema: accepted types, whether required, and an optional check returning an error."""

    types: tuple[type, ...]
    required: bool = True
    check: Callable[[Any], str | None] | None = None
    sub: dict[str, F] | None = None  # for mappings (or list items when ``item`` is set)
    item: F | None = None  # for lists


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(v: Any) -> str | None:
    # .inf passed: an infinite peak made every plan "not fit", an infinite memory_gib crashed recommend
    return None if v is None or (_num(v) and 0 < v < math.inf) else "must be > 0 and finite"


def _gib(v: Any) -> str | None:
    # a GPU's memory, read as int(memory_gib * 2**30) bytes: 1.0e+300 overflowed that to inf (a traceback)
    return None if v is None or (_num(v) and 0 < v <= 2**20) else "must be > 0 and at most 1048576 (GiB)"


def _nonneg(v: Any) -> str | None:
    return None if v is None or (_num(v) and v >= 0) else "must be >= 0"


def _one_of(*choices: Any) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in choices else f"must be one of {', '.join(map(str, choices))}, got {v!r}"

    return check


def _type_names(types: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list"}
    names |= {dict: "a mapping", type(None): "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check(data: Any, schema: dict[str, F], where: str, errors: list[str]) -> None:
    if not isinstance(data, dict):
        errors.append(f"{where or 'top level'}: must be a mapping")
        return
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in schema:
            close = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            errors.append(f"{prefix}{key}: unknown key{hint}")
    for key, spec in schema.items():
        if key not in data:
            if spec.required:
                errors.append(f"{prefix}{key}: missing")
            continue
        _check_value(data[key], spec, f"{prefix}{key}", errors)


def _number_as_text(value: Any, types: tuple[type, ...]) -> str:
    """For a number YAML 1.1 read as text (``1e300``: no dot, no exponent sign), how to write it as a number."""
    if float not in types or not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):  # "inf", "nan": not numbers it takes either
        return ""
    try:
        as_number = isinstance(yaml.safe_load(value), (int, float))
    except yaml.YAMLError:  # a tab or form feed beside it: no number to YAML either
        return ""
    if as_number:  # YAML reads it as a number: it was quoted
        return " (it is quoted: write it without the quotes)"
    as_yaml = yaml.safe_dump(number).splitlines()[0]
    return f" (YAML reads {value} as text: write it as {as_yaml})"


def _check_value(value: Any, spec: F, where: str, errors: list[str]) -> None:
    types = spec.types
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok and float in types and _num(value):
        ok = True
    if not ok:
        errors.append(f"{where}: must be {_type_names(types)}, got {value!r}{_number_as_text(value, types)}")
        return
    if value is None:
        return
    if spec.check is not None and (msg := spec.check(value)):
        errors.append(f"{where}: {msg}")
    if spec.sub is not None and isinstance(value, dict):
        _check(value, spec.sub, where, errors)
    if spec.item is not None and isinstance(value, list):
        for i, v in enumerate(value):
            _check_value(v, spec.item, f"{where}[{i}]", errors)


NUM = (int, float)
OPT_NUM = (int, float, type(None))
STR = (str,)

GPU_SCHEMA = {
    "name": F(STR),
    "aliases": F((list,), item=F(STR)),
    "vendor": F(STR, check=_one_of("nvidia", "amd")),
    "memory_gib": F(NUM, check=_gib),
    # the total NVML reports (nvidia-smi's MiB), where ECC (on by default) or the driver keeps it over 1% under
    # memory_gib; its source in `source`
    "memory_total_mib": F(NUM, required=False, check=_positive),
    "arch": F(STR),
    "family": F(STR),
    "bf16": F((bool,)),
    "fp16": F((bool,)),
    "fp16_tflops": F(NUM, check=_positive),
    # the FP32 rate where it is not a quarter of fp16_tflops (no tensor cores: the same CUDA-core rate)
    "fp32_tflops": F(NUM, required=False, check=_positive),
    # false where fp16 mixed precision is reported to give NaN losses in training (the planner then plans fp32);
    # its sources in `source`
    "fp16_trains": F((bool,), required=False),
    "bf16_tflops": F(OPT_NUM, check=_positive),
    "memory_bandwidth_gbs": F(NUM, check=_positive),
    # a measured torch.matmul peak (large square GEMMs, TFLOPS), where one was published; its source in `source`
    "measured_matmul_tflops": F(
        (dict,),
        required=False,
        sub={"fp16": F(NUM, check=_positive), "bf16": F(OPT_NUM, required=False, check=_positive)},
    ),
    "pcie_gen": F((int, type(None)), check=_positive),
    "interconnect": F(
        (dict, type(None)),
        sub={"type": F(STR, check=_one_of("nvlink", "xgmi")), "bandwidth_gbs": F(NUM, check=_positive)},
    ),
    "source": F(STR),
}
GPUS_FILE_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "gpus": F((list,), item=F((dict,), sub=GPU_SCHEMA)),
}
MODEL_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "family": F(STR, check=_one_of(*FAMILIES)),
    "name": F(STR),
    "architecture": F(STR, required=False, check=_one_of("unet", "mmdit", "flux")),
    "native_resolution": F((int,), check=_positive),
    # an epsilon-prediction model of the family trains at this side instead (SD 2.x: the 512 base)
    "epsilon_resolution": F((int,), required=False, check=_positive),
    "latent_channels": F((int,), check=_positive),
    "vae_scale_factor": F((int,), check=_positive),
    "hub_ids": F((list,), item=F(STR)),
    "kohya_base_model_version": F(STR),
    "unet": F((dict,), required=False),  # UNet families
    "transformer": F(  # transformer families (SD3.5, FLUX.1)
        (dict,),
        required=False,
        sub={"class": F(STR, check=_one_of(*TRANSFORMER_CLASSES)), "config": F((dict,))},
    ),
    "text_encoders": F(
        (list,),
        item=F(
            (dict,),
            sub={
                "class": F(STR, check=_one_of(*TEXT_ENCODER_CLASSES)),
                "max_length": F((int,), required=False, check=_positive),
                "config": F((dict,)),
            },
        ),
    ),
    "vae": F((dict,)),
    "scheduler": F((dict,), required=False, sub={"class": F(STR), "config": F((dict,))}),
    "tokenizer_max_length": F((int,), check=_positive),
    "transformer_text_tokens": F((int,), required=False, check=_positive),
    "lora_target_modules": F((list,), required=False, item=F(STR)),
    "params": F(
        (dict,),
        sub={
            "unet": F((int,), required=False, check=_positive),
            "transformer": F((int,), required=False, check=_positive),
            "text_encoders": F((list,), item=F((int,), check=_positive)),
            "vae": F((int,), check=_positive),
        },
    ),
    # persistent buffers of the transformer (SD3's positional table): in the checkpoint and in memory, not trained
    "buffers": F((dict,), required=False, sub={"transformer": F((int,), check=_nonneg)}),
    "sources": F((dict,), required=False),
    "source": F(STR),
}
OPTIONS_SCHEMA = {
    "gradient_checkpointing": F((bool,)),
    "optimizer": F(STR, check=_one_of(*OPTIMIZERS)),
    "cache_latents": F((bool,)),
    "cache_text_encoder_outputs": F((bool,), required=False),
    "train_text_encoder": F((bool,)),
    "attention": F(STR, check=_one_of("xformers", "sdpa", "flash", "math")),
    "deepspeed": F(
        (dict, type(None)),
        sub={"zero_stage": F((int,), check=_one_of(1, 2, 3)), "offload_optimizer": F((bool,))},
    ),
    "ema": F((str, type(None)), check=_one_of("gpu", "cpu")),
    "lora_rank": F((int, type(None)), required=False, check=_positive),
    "prior_preservation": F((bool,), required=False),
    "fused_backward": F((bool,), required=False),
    "full_half_weights": F((bool,), required=False),
    "set_grads_to_none": F((bool,), required=False),
    # the frozen transformer base's storage (SD3.5 / FLUX.1 LoRA); absent: bf16
    "base_precision": F(STR, required=False, check=_one_of(*BASE_PRECISIONS)),
    # kohya --blocks_to_swap: transformer blocks kept in host RAM and swapped in per block (absent: 0)
    "blocks_to_swap": F((int,), required=False, check=_nonneg),
}
OUTCOME_SCHEMA = {
    "fits": F((bool, type(None))),
    "max_vram_gib": F(OPT_NUM, required=False, check=_positive),
    "exceeds_vram_gib": F(OPT_NUM, required=False, check=_positive),
    "peak_vram_gib": F(OPT_NUM, required=False, check=_positive),
    "ram_gib": F(OPT_NUM, required=False, check=_positive),
    "it_s": F(OPT_NUM, required=False, check=_positive),
    # the trainer's final sample grid beside the training state (benchmarks/sampling_peak.py), allocated
    "sample_grid_peak_gib": F(OPT_NUM, required=False, check=_positive),
}
POINT_SCHEMA = {
    "id": F(STR),
    "model": F(STR, check=_one_of(*FAMILIES)),
    "model_name": F(STR, required=False),
    "resolution": F((int,), check=_positive),
    "batch": F((int,), check=_positive),
    "grad_accum": F((int,), check=_positive),
    "precision": F(STR, check=_one_of(*PRECISIONS)),
    "options": F((dict,), sub=OPTIONS_SCHEMA),
    "gpu": F((str, type(None))),
    "gpu_memory_gib": F(OPT_NUM, required=False, check=_gib),
    "num_gpus": F((int,), check=_positive),
    "outcome": F((dict,), sub=OUTCOME_SCHEMA),
    "source": F(STR),
    "note": F(STR, required=False),
    # false: the point is measured evidence (basis "measured", memory, fit verdicts) but stays out of the speed
    # fit, whose form cannot express it (say why in note)
    "fit_speed": F((bool,), required=False),
}
MULTI_GPU_SCHEMA = {
    "id": F(STR),
    "model": F(STR, check=_one_of(*FAMILIES)),
    "resolution": F((int,), check=_positive),
    "precision": F(STR, check=_one_of(*PRECISIONS)),
    "options": F((dict,), sub=OPTIONS_SCHEMA),
    "gpu": F(STR),
    "num_gpus": F((int,), check=lambda v: None if v >= 2 else "must be >= 2"),
    "interconnect": F(STR, check=_one_of("pcie", "nvlink", "xgmi")),
    "outcome": F(
        (dict,),
        sub={
            "iteration_time_ratio": F(OPT_NUM, check=_positive),
            "run_time_ratio": F(OPT_NUM, check=_positive),
        },
    ),
    "source": F(STR),
    "note": F(STR, required=False),
}
METHOD_FILE_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "method": F(STR, check=_one_of(*METHODS)),
    "points": F((list,), item=F((dict,), sub=POINT_SCHEMA)),
    "multi_gpu": F((list,), required=False, item=F((dict,), sub=MULTI_GPU_SCHEMA)),
}
# profiles/sampling.yaml: measured txt2img speeds (planner.calibrate fits the sampling time on them)
SAMPLING_POINT_SCHEMA = {
    "id": F(STR),
    "gpu": F(STR),
    "family": F(STR, check=_one_of(*FAMILIES)),
    "resolution": F((int,), check=_positive),
    "images": F((int,), check=_positive),  # images generated at once (num_images_per_prompt)
    "guidance": F((bool,)),  # classifier-free guidance: the denoiser runs at twice the images
    "precision": F(STR, check=_one_of(*PRECISIONS)),
    "it_per_s": F(NUM, check=_positive),  # denoising steps per second
    "source": F(STR),
}
SAMPLING_FILE_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "points": F((list,), item=F((dict,), sub=SAMPLING_POINT_SCHEMA)),
}
_COEF = F(
    (dict,),
    sub={"linear": F(NUM), "quadratic": F(NUM), "per_sample": F(NUM), "fixed": F(NUM)},
)
ACTIVATIONS_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "source": F(STR),
    "units": F(STR),
    "families": F((dict,)),
}
_UNET_ENTRY = {
    "held": _COEF,
    "fit_max_error": F(NUM),
    "recompute_peak": F((dict,), required=False, sub=_COEF.sub),
}
_TE_ENTRY = {
    "class": F(STR),
    "held": F((dict,)),
}


# -- typed views -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    name: str
    aliases: tuple[str, ...]
    vendor: str
    memory_gib: float
    arch: str
    family: str
    bf16: bool
    fp16: bool
    fp16_tflops: float
    bf16_tflops: float | None
    memory_bandwidth_gbs: float
    pcie_gen: int | None
    interconnect: dict | None
    source: str
    measured_matmul_tflops: dict | None = None
    memory_total_mib: float | None = None
    fp32_tflops: float | None = None
    fp16_trains: bool = True

    @property
    def memory_bytes(self) -> int:
        """The card's memory as a plan for it counts it: what NVML reports on the card where the catalog has it
        (a T4 sold as 16 GB has 15 GiB: ECC keeps 1/16 of its GDDR6), else the marketing size as GiB."""
        if self.memory_total_mib:
            return int(round(self.memory_total_mib * 2**20))
        return int(round(self.memory_gib * GiB))

    def tflops(self, precision: str) -> float:
        """Dense tensor throughput for a precision; fp32 training runs at roughly a quarter of fp16 rate (tensor
        cores), or at ``fp32_tflops`` where the catalog gives it (no tensor cores: the same rate)."""
        if precision == "bf16" and self.bf16_tflops:
            return float(self.bf16_tflops)
        if precision == "fp32":
            return float(self.fp32_tflops) if self.fp32_tflops else float(self.fp16_tflops) / 4.0
        return float(self.fp16_tflops)

    def matmul_tflops(self, precision: str) -> float:
        """What a large GEMM sustains: the measured torch.matmul peak where one was published (a T4 at 70 W
        sustains ~42 of its 65 TFLOPS; GeForce cards exceed their FP32-accumulate rating), else the rating."""
        m = self.measured_matmul_tflops
        if m and precision in ("fp16", "bf16") and m.get(precision):
            return float(m[precision])
        if m and precision == "bf16" and self.bf16 and m.get("fp16"):
            return float(m["fp16"])
        if m and precision == "fp32" and m.get("fp16"):
            return float(m["fp16"]) / 4.0
        return self.tflops(precision)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    name: str
    native_resolution: int
    latent_channels: int
    vae_scale_factor: int
    hub_ids: tuple[str, ...]
    kohya_base_model_version: str
    unet: dict
    text_encoders: tuple[dict, ...]
    vae: dict
    tokenizer_max_length: int
    params_unet: int
    params_text_encoders: tuple[int, ...]
    params_vae: int
    source: str
    # transformer families (SD3.5, FLUX.1); defaults keep the UNet families as they were
    architecture: str = "unet"
    transformer_class: str | None = None
    transformer: dict | None = None
    params_transformer: int | None = None
    buffers_transformer: int = 0  # persistent buffer elements (SD3 pos_embed table), held like frozen weights
    scheduler: dict | None = None
    text_encoder_max_lengths: tuple[int, ...] = ()
    transformer_text_tokens: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    sources: dict | None = None
    epsilon_resolution: int | None = (
        None  # SD 2.x: 2-1-base, epsilon at 512 (the family's 768 is v-prediction)
    )

    def resolution_for(self, prediction_type: str | None) -> int:
        """The side a model of this family trains at when none is given: the native one, or an epsilon
        model's own where the family has one (its files say the prediction type; None: not known)."""
        if prediction_type == "epsilon" and self.epsilon_resolution:
            return self.epsilon_resolution
        return self.native_resolution

    @property
    def denoiser_params(self) -> int:
        """Parameters of the denoising network: the transformer where there is one, else the UNet."""
        return self.params_transformer if self.params_transformer is not None else self.params_unet

    def lora_params(self, rank: int, *, text_encoder: bool = False) -> int:
        """Parameters of a LoRA on the attention projections (to_q/k/v/out.0) of every UNet transformer block.

        Each adapted Linear(in, out) adds rank * (in + out). Self-attention projects C -> C; cross-attention
        maps the text width (``cross_attention_dim``) to C for k and v. Counted from the UNet config.
        """
        cfg = self.unet
        channels = list(cfg["block_out_channels"])
        ctx = int(cfg["cross_attention_dim"])
        layers = cfg.get("transformer_layers_per_block", 1)
        per_block = layers if isinstance(layers, list) else [layers] * len(channels)
        lpb = int(cfg.get("layers_per_block", 2))
        total_blocks = 0

        def attn(c: int) -> int:
            # attn1: q,k,v,out all c->c ; attn2: q c->c, k/v ctx->c, out c->c
            return rank * (4 * 2 * c) + rank * (4 * c + 2 * (ctx + c))

        for i, kind in enumerate(cfg["down_block_types"]):
            if "CrossAttn" in kind:
                total_blocks += lpb * per_block[i] * attn(channels[i])
        mid = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn")
        if mid is None or "CrossAttn" in str(mid):
            total_blocks += per_block[-1] * attn(channels[-1])
        rev = list(reversed(channels))
        rev_layers = list(reversed(per_block))
        for i, kind in enumerate(cfg["up_block_types"]):
            if "CrossAttn" in kind:
                total_blocks += (lpb + 1) * rev_layers[i] * attn(rev[i])
        if text_encoder:
            for te in self.text_encoders:
                h = int(te["config"]["hidden_size"])
                total_blocks += int(te["config"]["num_hidden_layers"]) * rank * 4 * 2 * h
        return total_blocks

    @property
    def text_encoder_params(self) -> int:
        return sum(self.params_text_encoders)


class _SettingsView:
    """A point's settings read as attributes: ``p.batch``, ``p.options.optimizer`` (both from ``p.settings``)."""

    settings: Settings

    method = property(lambda self: self.settings.method)
    model = property(lambda self: self.settings.model)
    resolution = property(lambda self: self.settings.resolution)
    batch = property(lambda self: self.settings.batch)
    grad_accum = property(lambda self: self.settings.grad_accum)
    precision = property(lambda self: self.settings.precision)
    num_gpus = property(lambda self: self.settings.num_gpus)
    options = property(lambda self: self.settings)


@dataclass(frozen=True)
class MethodPoint(_SettingsView):
    """One published or measured configuration and what was observed."""

    id: str
    settings: Settings
    gpu: str | None
    outcome: dict
    source: str
    gpu_memory_gib: float | None = None
    model_name: str | None = None
    note: str | None = None
    origin: str = "shipped"  # "shipped" | "local"
    fit_speed: bool = True  # calibrate() fits the roofline on its it/s (default: shipped points only)

    @property
    def from_bench(self) -> bool:
        """Measured by `sdplan bench` (this machine's store, or shipped from a bench run): sdplan's own trainer
        step, unlike a published figure from another tool."""
        return self.origin == "local" or self.source.startswith("measured: sdplan bench")


@dataclass(frozen=True)
class MultiGPUObservation(_SettingsView):
    id: str
    settings: Settings  # num_gpus: the GPUs of the observation
    gpu: str
    interconnect: str
    outcome: dict
    source: str
    note: str | None = None


@dataclass(frozen=True)
class Activations:
    """Activation bytes per family, computed by scripts/compute_activations.py."""

    source: str
    families: dict

    @staticmethod
    def _eval(coef: dict, batch: int, latent: int) -> float:
        per = coef["linear"] * latent + coef["quadratic"] * latent * latent + coef["per_sample"]
        return batch * per + coef["fixed"]

    def transformer(
        self, family: str, *, gc: bool, batch: int, latent_pixels: int, trained: str = "full"
    ) -> tuple[float, float]:
        """(held bytes, recompute peak bytes) of a transformer family's bf16 training forward, flash attention."""
        entry = self.families[family]["transformer"][f"bf16/efficient/{'gc' if gc else 'no_gc'}/{trained}"]
        held = self._eval(entry["held"], batch, latent_pixels)
        peak = self._eval(entry["recompute_peak"], batch, latent_pixels) if gc else 0.0
        return max(held, 0.0), max(peak, 0.0)

    def unet(
        self,
        family: str,
        *,
        dtype: str,
        attention: str,
        gc: bool,
        batch: int,
        latent_pixels: int,
        trained: str = "unet",
    ) -> tuple[float, float]:
        """(held bytes, recompute peak bytes) of the UNet's training forward; dtype 'fp32' or a half type."""
        dt = "fp32" if dtype == "fp32" else "bf16"
        entry = self.families[family]["unet"][f"{dt}/{attention}/{'gc' if gc else 'no_gc'}/{trained}"]
        held = self._eval(entry["held"], batch, latent_pixels)
        peak = self._eval(entry["recompute_peak"], batch, latent_pixels) if gc else 0.0
        return max(held, 0.0), max(peak, 0.0)

    def lora_params_per_rank(self, family: str) -> dict | None:
        """LoRA parameters per unit of rank per target set ({"unet": {...}, "text_encoders": {...}}), counted
        on meta by scripts/compute_activations.py; None for a family computed without them."""
        return self.families[family].get("lora_params_per_rank")

    def has_unet_entry(self, family: str, *, dtype: str, attention: str, gc: bool, trained: str) -> bool:
        dt = "fp32" if dtype == "fp32" else "bf16"
        return f"{dt}/{attention}/{'gc' if gc else 'no_gc'}/{trained}" in self.families[family]["unet"]

    def adafactor_bytes(self, family: str, *, text_encoders: bool = False) -> int:
        """Adafactor's fp32 state for the whole denoiser (the UNet, or a transformer family's transformer) and,
        with ``text_encoders``, every text encoder."""
        a = self.families[family]["adafactor_state_bytes"]
        denoiser = a["unet"] if "unet" in a else a["transformer"]
        return int(denoiser) + (sum(a["text_encoders"]) if text_encoders else 0)

    def unet_forward_flops(self, family: str, latent_pixels: int) -> float:
        return self._eval(self.families[family]["flops"]["unet_forward"], 1, latent_pixels)

    def unet_forward_traffic_bytes(
        self, family: str, latent_pixels: int, attention: str = "efficient"
    ) -> float | None:
        """Bytes the bandwidth-bound ops of one UNet forward move per sample (None: not computed); the math
        attention path also moves its attention matrices."""
        traffic = self.families[family].get("traffic")
        if not traffic:
            return None
        coef = traffic.get("unet_forward_bytes_math") if attention == "math" else None
        return self._eval(coef or traffic["unet_forward_bytes"], 1, latent_pixels)

    def vae_encode_flops(self, family: str, latent_pixels: int) -> float:
        return self._eval(self.families[family]["flops"]["vae_encode"], 1, latent_pixels)

    def transformer_forward_flops(self, family: str, latent_pixels: int) -> float:
        """FLOPs of one sample's forward through a transformer family's transformer (SD3.5 / FLUX.1)."""
        return self._eval(self.families[family]["flops"]["transformer_forward"], 1, latent_pixels)

    def vae_decode_flops(self, family: str, latent_pixels: int) -> float:
        """FLOPs of one image's VAE decode (0 where not computed: an older activations file)."""
        coef = (self.families[family].get("sampling") or {}).get("vae_decode_flops")
        return self._eval(coef, 1, latent_pixels) if coef else 0.0

    def text_encoder_flops(self, family: str) -> float:
        return float(self.families[family]["flops"]["text_encoders_forward"])

    def text_encoders(self, family: str, *, dtype: str, batch: int) -> float:
        dt = "fp32" if dtype == "fp32" else "bf16"
        total = 0.0
        for te in self.families[family]["text_encoders"]:
            c = te["held"][dt]
            total += batch * c["per_sample"] + c["fixed"]
        return total


@dataclass(frozen=True)
class Uncertainty:
    """How far measurements fall from the planner's predictions out of sample (profiles/uncertainty.yaml,
    written by scripts/uncertainty.py from benchmarks/planner_accuracy.py's validation-set residuals).

    ``peak_vram`` and ``seconds``: (low, high) factors of measured / predicted; a prediction ``x`` is likely
    between ``low * x`` and ``high * x``. The UNet families' (SD 1.x/2.x/SDXL), and the transformer families'
    (SD3.5 / FLUX.1) from their own residuals where the file has them: the planner errs differently on the two
    (``peak_for`` / ``seconds_for`` pick by model)."""

    peak_vram: tuple[float, float] = (1.0, 1.0)
    seconds: tuple[float, float] = (1.0, 1.0)
    source: str = "none"
    n_peak_vram: int = 0
    n_seconds: int = 0
    # a speed scaled by the nearest sdplan bench point on the GPU: from those points, each left out
    seconds_scaled: tuple[float, float] | None = None
    n_seconds_scaled: int = 0
    # a peak scaled by the sdplan bench point on the GPU at the same settings and the nearest batch: likewise
    peak_scaled: tuple[float, float] | None = None
    n_peak_scaled: int = 0
    # the time of the images a run samples (planner.sampling_seconds): the validation set's txt2img speeds
    # (benchmarks/validation/sampling/) against it; None: the model's seconds band serves it
    sampling_seconds: tuple[float, float] | None = None
    n_sampling_seconds: int = 0
    # SD3.5 / FLUX.1 (registry.FLOW_FAMILIES); None: the ones above serve them too
    peak_vram_transformer: tuple[float, float] | None = None
    seconds_transformer: tuple[float, float] | None = None
    n_peak_vram_transformer: int = 0
    n_seconds_transformer: int = 0

    def peak_for(self, model: str) -> tuple[tuple[float, float], int]:
        """(the peak-VRAM band, the residuals behind it) for a plan of ``model``."""
        if model in FLOW_FAMILIES and self.peak_vram_transformer is not None:
            return self.peak_vram_transformer, self.n_peak_vram_transformer
        return self.peak_vram, self.n_peak_vram

    def seconds_for(self, model: str) -> tuple[tuple[float, float], int]:
        """(the step-time band from the validation set, the residuals behind it) for a plan of ``model``."""
        if model in FLOW_FAMILIES and self.seconds_transformer is not None:
            return self.seconds_transformer, self.n_seconds_transformer
        return self.seconds, self.n_seconds


_FACTORS = {
    "low": F(NUM, check=_positive),
    "high": F(NUM, check=_positive),
    "n": F((int,)),
    "median": F(NUM, required=False),
}
UNCERTAINTY_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "source": F(STR),
    "method": F(STR),
    "peak_vram": F((dict,), sub=_FACTORS),
    "seconds": F((dict,), sub=_FACTORS),
    "seconds_scaled": F((dict,), sub=_FACTORS, required=False),
    "peak_scaled": F((dict,), sub=_FACTORS, required=False),
    "sampling_seconds": F((dict,), sub=_FACTORS, required=False),
    # the transformer families' own bands (peak_vram / seconds above: the UNet families')
    "transformer": F(
        (dict,),
        sub={"peak_vram": F((dict,), sub=_FACTORS), "seconds": F((dict,), sub=_FACTORS)},
        required=False,
    ),
}


HOST_FILE = "host.yaml"  # in the local store: this host's own measurements (sdplan bench --host)
HOST_SCHEMA = {
    "schema_version": F((int,), check=_one_of(SCHEMA_VERSION)),
    "cpu": F(STR),
    "threads": F((int,), check=_positive),
    "cpu_adam_params_per_s": F(NUM, check=_positive),
    "source": F(STR),
}


@dataclass(frozen=True)
class HostMeasurement:
    """What `sdplan bench --host` measured on this host: DeepSpeed's CPU Adam rate (parameters updated per
    second), which sets DeepSpeed optimizer offload's time (planner.offload_seconds)."""

    cpu: str
    threads: int
    cpu_adam_params_per_s: float
    source: str


def load_host(path: Path) -> HostMeasurement:
    d = _validated(path, HOST_SCHEMA)
    return HostMeasurement(
        cpu=d["cpu"],
        threads=d["threads"],
        cpu_adam_params_per_s=float(d["cpu_adam_params_per_s"]),
        source=d["source"],
    )


def write_host(store: Path, host: HostMeasurement) -> Path:
    """``{store}/host.yaml``, atomically (a re-measurement replaces it); clears the load cache."""
    data = {
        "schema_version": SCHEMA_VERSION,
        **{k: getattr(host, k) for k in HOST_SCHEMA if k != "schema_version"},
    }
    text = (
        "# this host's measurements, written by `sdplan bench --host`; the planner reads them when it plans\n"
        "# for this machine\n" + yaml.safe_dump(data, sort_keys=False)
    )
    ensure_store(store)
    return _replace_store_file(store, store / HOST_FILE, text, check=load_host)


@dataclass(frozen=True)
class SamplingPoint:
    """One measured txt2img speed (profiles/sampling.yaml): ``images`` generated at once at ``resolution``,
    ``it_per_s`` denoising steps a second; with ``guidance`` the denoiser runs each step at twice the images."""

    id: str
    gpu: str
    family: str
    resolution: int
    images: int
    guidance: bool
    precision: str
    it_per_s: float
    source: str


def load_sampling(path: Path, gpus: tuple[GPUSpec, ...]) -> tuple[SamplingPoint, ...]:
    d = _validated(path, SAMPLING_FILE_SCHEMA)
    points, errors, ids = [], [], set()
    for i, p in enumerate(d["points"]):
        if p["id"] in ids:
            errors.append(f"points[{i}].id: duplicate {p['id']!r}")
        ids.add(p["id"])
        if not any(g.name == p["gpu"] for g in gpus):
            errors.append(f"points[{i}].gpu: {p['gpu']!r} is not a catalog name (profiles/gpus.yaml)")
        points.append(SamplingPoint(**{k: p[k] for k in SAMPLING_POINT_SCHEMA}))
    if errors:
        raise ConfigError(str(path), errors)
    return tuple(points)


def load_uncertainty(path: Path) -> Uncertainty:
    d = _validated(path, UNCERTAINTY_SCHEMA)
    flow = d.get("transformer") or {}
    keys = ("peak_vram", "seconds", "seconds_scaled", "peak_scaled", "sampling_seconds")
    bands = [(k, d[k]) for k in keys if k in d]
    bands += [(f"transformer.{k}", v) for k, v in flow.items()]
    errors = [
        f"{key}: low {band['low']} must be <= 1 <= high {band['high']}"
        for key, band in bands
        if not band["low"] <= 1.0 <= band["high"]
    ]
    if errors:
        raise ConfigError(str(path), errors)

    def band(entry: dict | None) -> tuple[float, float] | None:
        return (float(entry["low"]), float(entry["high"])) if entry and entry["n"] else None

    return Uncertainty(
        peak_vram_transformer=band(flow.get("peak_vram")),
        seconds_transformer=band(flow.get("seconds")),
        n_peak_vram_transformer=flow["peak_vram"]["n"] if flow else 0,
        n_seconds_transformer=flow["seconds"]["n"] if flow else 0,
        seconds_scaled=band(d.get("seconds_scaled")),
        n_seconds_scaled=d["seconds_scaled"]["n"] if "seconds_scaled" in d else 0,
        sampling_seconds=band(d.get("sampling_seconds")),
        n_sampling_seconds=d["sampling_seconds"]["n"] if "sampling_seconds" in d else 0,
        peak_scaled=band(d.get("peak_scaled")),
        n_peak_scaled=d["peak_scaled"]["n"] if "peak_scaled" in d else 0,
        peak_vram=(float(d["peak_vram"]["low"]), float(d["peak_vram"]["high"])),
        seconds=(float(d["seconds"]["low"]), float(d["seconds"]["high"])),
        source=d["source"],
        n_peak_vram=d["peak_vram"]["n"],
        n_seconds=d["seconds"]["n"],
    )


@dataclass(frozen=True)
class Profiles:
    gpus: tuple[GPUSpec, ...]
    models: dict[str, ModelSpec]
    points: tuple[MethodPoint, ...]
    multi_gpu: tuple[MultiGPUObservation, ...]
    activations: Activations
    sources: tuple[str, ...] = field(default=())
    # families with profile data but no planner support yet (FLOW_FAMILIES); not offered to recommend
    unplanned_models: dict[str, ModelSpec] = field(default_factory=dict)
    uncertainty: Uncertainty = field(default_factory=Uncertainty)
    host: HostMeasurement | None = None  # this host's own measurements (the local store's host.yaml)
    # measured txt2img speeds (profiles/sampling.yaml): the time of the images a run samples
    sampling: tuple[SamplingPoint, ...] = ()
    # gpu_or_none's answers for this catalog: a plan asks for its points' GPUs some 10^5 times (not an input:
    # dataclasses.replace starts an empty one)
    _gpu_lookups: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _points_by_gpu: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    # the planner's per-settings lookups over these points (planner._near_point), asked thousands of times a plan
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def model(self, family: str) -> ModelSpec:
        if family not in self.models and family in FAMILIES:
            raise not_planned(family)
        if family not in self.models:
            raise UsageError(f"unknown model {family!r}", fix=f"use one of {', '.join(sorted(self.models))}")
        return self.models[family]

    def find_gpu(self, name: str, memory_bytes: int | None = None) -> GPUSpec:
        """Exact catalog lookup (case, spaces, vendor words and punctuation do not matter; see match_gpu)."""
        return find_gpu(self.gpus, name, memory_bytes)

    def match_gpu(self, name: str, memory_bytes: int | None = None, count: int = 1) -> GPUMatch:
        """find_gpu, plus the assumption made when a short name was planned as one of its form factors."""
        return match_gpu(self.gpus, name, memory_bytes, count)

    def gpu_or_none(self, name: str | None, memory_bytes: int | None = None) -> GPUSpec | None:
        if not name:
            return None
        key = (name, memory_bytes)
        if key not in self._gpu_lookups:
            try:
                self._gpu_lookups[key] = find_gpu(self.gpus, name, memory_bytes)
            except UsageError:
                self._gpu_lookups[key] = None
        return self._gpu_lookups[key]

    def points_on(self, gpu_name: str) -> tuple[MethodPoint, ...]:
        """The points measured on the catalog GPU ``gpu_name`` (point_gpu), in file order."""
        if not self._points_by_gpu:
            by: dict[str, list[MethodPoint]] = {}
            for p in self.points:
                spec = self.point_gpu(p)
                if spec is not None:
                    by.setdefault(spec.name, []).append(p)
            self._points_by_gpu.update((name, tuple(pts)) for name, pts in by.items())
        return self._points_by_gpu.get(gpu_name, ())

    def point_gpu(self, point: MethodPoint) -> GPUSpec | None:
        """The catalog GPU a point was measured on: its recorded memory settles a name several boards share
        (a probed "NVIDIA GeForce RTX 3080" is the 10 GB or the 12 GB card)."""
        memory = int(point.gpu_memory_gib * GiB) if point.gpu_memory_gib else None
        return self.gpu_or_none(point.gpu, memory)


# -- GPU name matching -----------------------------------------------------------------------------------
#
# Exact, never fuzzy: a name matches a catalog entry when its normalised form equals the normalised name or one
# of the aliases in profiles/gpus.yaml. Near misses are only suggestions in the error. Three rules settle a name
# that several entries share (NVML reports "NVIDIA GeForce RTX 3080" for the 10 GB and 12 GB cards; users type
# "V100 16GB" or "A100 80GB" without the form factor):
# 1. a probed card's memory (``memory_bytes``) picks the entry within MEMORY_TOLERANCE of it, nearest first; a
#    probed card whose memory matches no entry of its name is a variant the catalog lacks: not matched;
# 2. a memory size in the name ("V100 16GB", "A100 PCIe 80GB") keeps the entries of exactly that size;
# 3. what is left must be form-factor variants (PCIe / SXM) of one GPU that plan alike: same memory and
#    precisions, throughput and bandwidth within FORM_FACTOR_TOLERANCE, and (for several GPUs) the same
#    GPU-to-GPU link. Then the slowest is planned and the match says so (``GPUMatch.assumption``); otherwise
#    the name is ambiguous and the error lists the entries.

_NOISE = (
    "nvidia",
    "geforce",
    "tesla",
    "amd",
    "radeon",
    "graphics",
    "instinct",
    "generation",
    "founders",
    "edition",
    "gpu",
)

MEMORY_TOLERANCE = (
    0.10  # probed memory vs the marketing size: ECC and driver reserve take up to ~7% (T4: 15 GiB)
)
# throughput / bandwidth gap below which two form factors are planned alike: under the planner's own speed
# uncertainty (issue 10 targets a 20% median speed error)
FORM_FACTOR_TOLERANCE = 0.15
_MEMORY = re.compile(r"mem(\d+)gb")


@dataclass(frozen=True)
class GPUMatch:
    spec: GPUSpec
    assumption: str | None = None  # set when a short name was planned as one of its form-factor variants


@functools.lru_cache(maxsize=4096)
def normalise_gpu_name(name: str) -> str:
    s = name.lower()
    s = re.sub(r"\(.*?\)", " ", s)
    for word in _NOISE:
        s = re.sub(rf"\b{word}\b", " ", s)
    s = s.replace("sxm5", "sxm").replace("sxm4", "sxm").replace("sxm2", "sxm")
    s = re.sub(r"(\d+)\s*gb\b", r" mem\1gb ", s)  # "80GB" kept apart from "H100": "h100mem80gb"
    s = re.sub(r"[^a-z0-9]+", "", s)
    return s


def find_gpu(
    gpus: tuple[GPUSpec, ...], name: str, memory_bytes: int | None = None, count: int = 1
) -> GPUSpec:
    """The catalog GPU for a user- or driver-given name (see match_gpu)."""
    return match_gpu(gpus, name, memory_bytes, count).spec


def match_gpu(
    gpus: tuple[GPUSpec, ...], name: str, memory_bytes: int | None = None, count: int = 1
) -> GPUMatch:
    """The catalog entry a name denotes, exactly (normalised name or alias); ``memory_bytes`` (a probed card's
    VRAM) settles names several entries share; ``count`` GPUs (link matters when > 1). Raises UsageError for an
    unknown or ambiguous name, with suggestions; never returns a near miss."""
    query = normalise_gpu_name(name)
    if not query:
        raise UsageError(f"empty GPU name {name!r}", fix="name a GPU, e.g. 'RTX 4090' or '2x H100 SXM'")
    index, stripped = _index(gpus)
    found = _unique(index.get(query, []))
    if not found and _MEMORY.search(query):
        size = int(_MEMORY.search(query).group(1))
        same = _unique(stripped.get(_MEMORY.sub("", query), []))
        found = [g for g in same if abs(g.memory_gib - size) < 1]
    if not found:
        raise UsageError(f"unknown GPU {name!r}", fix=_unknown_fix(query, index, stripped))
    if memory_bytes is not None:
        near = _by_memory(found, memory_bytes)
        if not near:
            sizes = ", ".join(f"{g.name} {g.memory_gib:g} GiB" for g in found)
            raise UsageError(
                f"GPU {name!r} with {memory_bytes / GiB:.1f} GiB is not in the catalog (it has {sizes})",
                fix=_add_gpu(),
            )
        found = near
    if len(found) == 1:
        return GPUMatch(found[0])
    return _form_factor(name, found, count)


def _add_gpu() -> str:
    """How to plan for a GPU the catalog lacks, naming the local store's gpus.yaml as this shell has it (it named
    $SDPLAN_PROFILE_DIR, which is usually unset: the store is then under $XDG_DATA_HOME or ~/.local/share)."""
    try:
        where = f"the local profile store's {local_dir() / 'gpus.yaml'}"
    except UsageError:  # no home folder
        where = "gpus.yaml in the local profile store ($SDPLAN_PROFILE_DIR)"
    return (  # the shipped catalog by its full path: "profiles/gpus.yaml" meant nothing from the user's folder
        f"add it to {where} (or to sdplan's own {shipped_dir() / 'gpus.yaml'}), or use --machine with a "
        "`sdplan doctor --json` snapshot"
    )


def _unknown_fix(query: str, index: dict[str, list[GPUSpec]], stripped: dict[str, list[GPUSpec]]) -> str:
    """'did you mean: ...? add it ...'. A known name with a size it does not come in ("RTX 4090 48GB"): first the
    names that extend it in that size ("RTX 4070 Ti 16GB": RTX 4070 Ti SUPER), then its own sizes; else the
    catalog names nearest the spelling."""
    first: list[GPUSpec] = []
    if size := _MEMORY.search(query):
        gib, stem = int(size.group(1)), _MEMORY.sub("", query)
        longer = [g for k, gs in stripped.items() if k.startswith(stem) and k != stem for g in gs]
        first = [g for g in longer if abs(g.memory_gib - gib) < 1] + list(stripped.get(stem, []))
    keys = [k for k in index if query in k or k in query] + difflib.get_close_matches(
        query, list(index), n=6, cutoff=0.6
    )
    keys.sort(key=lambda k: -difflib.SequenceMatcher(None, query, k).ratio())
    names = list(
        dict.fromkeys(
            [
                *(g.name if "gb" in g.name.lower() else f"{g.name} ({g.memory_gib:g} GiB)" for g in first),
                *(g.name for k in keys for g in index[k]),
            ]
        )
    )
    hint = f"did you mean: {', '.join(names[:4])}? " if names else ""
    return f"{hint}{_add_gpu()}"


def _form_factor(name: str, found: list[GPUSpec], count: int) -> GPUMatch:
    """Several entries of one name: form-factor variants that plan alike -> the slowest, with the assumption."""
    options = ", ".join(sorted(g.name for g in found))
    ambiguous = UsageError(f"GPU name {name!r} matches several catalog GPUs", fix=f"name one: {options}")
    first = found[0]
    alike = all(
        g.memory_gib == first.memory_gib
        and g.vendor == first.vendor
        and g.arch == first.arch
        and (g.bf16, g.fp16) == (first.bf16, first.fp16)
        for g in found
    )
    if not alike:
        raise ambiguous
    for key in (lambda g: g.fp16_tflops, lambda g: g.bf16_tflops or 0.0, lambda g: g.memory_bandwidth_gbs):
        values = [key(g) for g in found]
        if max(values) and 1 - min(values) / max(values) > FORM_FACTOR_TOLERANCE:
            raise ambiguous
    if count > 1 and len({_link(g) for g in found}) > 1:
        links = ", ".join(f"{g.name}: {_link(g)}" for g in sorted(found, key=lambda g: g.name))
        raise UsageError(
            f"GPU name {name!r} matches GPUs with different GPU-to-GPU links ({links}), "
            f"which decides a {count}-GPU plan",
            fix=f"name one: {options}",
        )
    spec = min(found, key=lambda g: (g.fp16_tflops, g.memory_bandwidth_gbs, g.name))
    others = ", ".join(sorted(g.name for g in found if g is not spec))
    return GPUMatch(
        spec,
        assumption=(
            f"GPU {name!r} is {spec.name} or {others}: planned as {spec.name}, the slower (they differ by "
            f"under {FORM_FACTOR_TOLERANCE:.0%} in throughput and bandwidth); name the exact one to plan for it"
        ),
    )


def _link(g: GPUSpec) -> str:
    if not g.interconnect:
        return "PCIe"
    return f"{g.interconnect['type']} {g.interconnect['bandwidth_gbs']:g} GB/s"


_INDEX: dict[int, tuple[tuple[GPUSpec, ...], dict[str, list[GPUSpec]], dict[str, list[GPUSpec]]]] = {}


def _index(gpus: tuple[GPUSpec, ...]) -> tuple[dict[str, list[GPUSpec]], dict[str, list[GPUSpec]]]:
    """Normalised name/alias -> entries, and the same keys without their memory size (cached per catalog)."""
    hit = _INDEX.get(id(gpus))
    if hit is not None and hit[0] is gpus:
        return hit[1], hit[2]
    index: dict[str, list[GPUSpec]] = {}
    stripped: dict[str, list[GPUSpec]] = {}
    for g in gpus:
        keys = {normalise_gpu_name(n) for n in (g.name, *g.aliases)}
        for key in keys:
            index.setdefault(key, []).append(g)
        for key in {_MEMORY.sub("", k) for k in keys}:
            stripped.setdefault(key, []).append(g)
    _INDEX[id(gpus)] = (gpus, index, stripped)
    return index, stripped


def _by_memory(gpus: list[GPUSpec], memory_bytes: int) -> list[GPUSpec]:
    """The entries whose memory is within MEMORY_TOLERANCE of a probed card's, the nearest ones."""
    near = [g for g in gpus if abs(g.memory_bytes - memory_bytes) <= MEMORY_TOLERANCE * g.memory_bytes]
    if not near:
        return []
    best = min(abs(g.memory_bytes - memory_bytes) for g in near)
    return [g for g in near if abs(g.memory_bytes - memory_bytes) == best]


def _unique(gpus: list[GPUSpec]) -> list[GPUSpec]:
    seen: dict[str, GPUSpec] = {}
    for g in gpus:
        seen.setdefault(g.name, g)
    return list(seen.values())


# -- loading ---------------------------------------------------------------------------------------------


def _parsed_cache(path: Path) -> Path:
    """The cache entry of a YAML file's parsed data: one per file (a changed file replaces its entry)."""
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return cache_dir() / "yaml" / f"{name}.pickle"


def read_yaml(path: Path) -> Any:
    """A YAML file's data. Parsing the profiles takes ~0.1 s (PyYAML builds every node in Python), a tenth of a
    plan, so each file's data is kept in :func:`cache_dir` under the SHA-256 of its bytes and used only while
    the file has exactly those bytes; a cache that cannot be read or written is passed over."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read ({e.strerror or e})"]) from None
    digest = hashlib.sha256(raw).digest()
    try:
        entry: Path | None = _parsed_cache(path)
    except OSError:  # nowhere to keep a cache
        entry = None
    if entry is not None:
        try:
            with entry.open("rb") as f:
                kept_digest, data = pickle.load(f)
            if kept_digest == digest:
                return data
        except Exception:  # none yet, another version's or a torn write: parse the file
            pass
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {e.start})"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(path), [f"{where}not valid YAML ({problem})"]) from None
    if entry is not None:
        _keep_parsed(entry, digest, data)
    return data


def _keep_parsed(entry: Path, digest: bytes, data: Any) -> None:
    """Keep a file's parsed ``data`` under the digest of its bytes, or nothing where the cache cannot be
    written."""
    try:  # written whole, then renamed over the entry: a reader never sees half of one
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump((digest, data), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass


def _validated(path: Path, schema: dict[str, F]) -> dict:
    data = read_yaml(path)
    errors: list[str] = []
    _check(data, schema, "", errors)
    if errors:
        raise ConfigError(str(path), errors)
    return data


def load_gpus(path: Path) -> tuple[GPUSpec, ...]:
    data = _validated(path, GPUS_FILE_SCHEMA)
    out, errors = [], []
    names: set[str] = set()
    for i, g in enumerate(data["gpus"]):
        if g["name"] in names:
            errors.append(f"gpus[{i}].name: duplicate {g['name']!r}")
        names.add(g["name"])
        if g["bf16"] and g["bf16_tflops"] is None:
            errors.append(f"gpus[{i}].bf16_tflops: required when bf16 is true")
        out.append(
            GPUSpec(
                name=g["name"],
                aliases=tuple(g["aliases"]),
                vendor=g["vendor"],
                memory_gib=float(g["memory_gib"]),
                arch=str(g["arch"]),
                family=g["family"],
                bf16=g["bf16"],
                fp16=g["fp16"],
                fp16_tflops=float(g["fp16_tflops"]),
                bf16_tflops=None if g["bf16_tflops"] is None else float(g["bf16_tflops"]),
                memory_bandwidth_gbs=float(g["memory_bandwidth_gbs"]),
                pcie_gen=g["pcie_gen"],
                interconnect=g["interconnect"],
                source=g["source"],
                measured_matmul_tflops=g.get("measured_matmul_tflops"),
                memory_total_mib=g.get("memory_total_mib"),
                fp32_tflops=g.get("fp32_tflops"),
                fp16_trains=g.get("fp16_trains", True),
            )
        )
    if errors:
        raise ConfigError(str(path), errors)
    return tuple(out)


def load_model(path: Path) -> ModelSpec:
    d = _validated(path, MODEL_SCHEMA)
    errors = []
    if len(d["params"]["text_encoders"]) != len(d["text_encoders"]):
        errors.append("params.text_encoders: one count per text encoder")
    denoiser = "transformer" if d["family"] in FLOW_FAMILIES else "unet"
    other = "unet" if denoiser == "transformer" else "transformer"
    for key in (denoiser,):
        if key not in d:
            errors.append(f"{key}: missing")
        if key not in d["params"]:
            errors.append(f"params.{key}: missing")
    for key in (other,):
        if key in d:
            errors.append(f"{key}: not used by the {d['family']} family (it has a {denoiser})")
        if key in d["params"]:
            errors.append(f"params.{key}: not used by the {d['family']} family")
    if denoiser == "unet":
        for key in ("block_out_channels", "down_block_types", "up_block_types", "cross_attention_dim"):
            if key not in d.get("unet", {}):
                errors.append(f"unet.{key}: missing")
    else:
        for key in ("scheduler", "transformer_text_tokens", "lora_target_modules", "buffers", "sources"):
            if key not in d:
                errors.append(f"{key}: missing")
        # the targets the parameter counts were computed for (scripts/compute_activations.py): those the planner
        # charges and the trainer trains where lora.target_modules is null (sdplan.registry.LORA_TARGETS)
        want = lora_targets(d["family"], None)
        if "lora_target_modules" in d and set(d["lora_target_modules"]) != set(want):
            errors.append(
                f"lora_target_modules: must be the family's default LoRA targets, {', '.join(want)}"
            )
        for i, te in enumerate(d["text_encoders"]):
            if "max_length" not in te:
                errors.append(f"text_encoders[{i}].max_length: missing")
    if path.stem != d["family"]:
        errors.append(f"family: {d['family']!r} does not match the file name {path.name}")
    if errors:
        raise ConfigError(str(path), errors)
    transformer = d.get("transformer")
    return ModelSpec(
        family=d["family"],
        name=d["name"],
        native_resolution=d["native_resolution"],
        epsilon_resolution=d.get("epsilon_resolution"),
        latent_channels=d["latent_channels"],
        vae_scale_factor=d["vae_scale_factor"],
        hub_ids=tuple(d["hub_ids"]),
        kohya_base_model_version=d["kohya_base_model_version"],
        unet=d.get("unet", {}),
        text_encoders=tuple(d["text_encoders"]),
        vae=d["vae"],
        tokenizer_max_length=d["tokenizer_max_length"],
        params_unet=d["params"].get("unet", 0),
        params_text_encoders=tuple(d["params"]["text_encoders"]),
        params_vae=d["params"]["vae"],
        source=d["source"],
        architecture=d.get("architecture", "unet"),
        transformer_class=transformer["class"] if transformer else None,
        transformer=transformer["config"] if transformer else None,
        params_transformer=d["params"].get("transformer"),
        buffers_transformer=(d.get("buffers") or {}).get("transformer", 0),
        scheduler=d.get("scheduler"),
        text_encoder_max_lengths=tuple(te["max_length"] for te in d["text_encoders"] if "max_length" in te),
        transformer_text_tokens=d.get("transformer_text_tokens"),
        lora_target_modules=tuple(d.get("lora_target_modules", ())),
        sources=d.get("sources"),
    )


# the `kind:` of a `sdplan profiles export` file (several method files under methods:), never a method file
EXPORT_KIND = "sdplan-measurements"


def load_methods(path: Path, origin: str = "shipped") -> tuple[list[MethodPoint], list[MultiGPUObservation]]:
    head = read_yaml(path)
    if isinstance(head, dict) and head.get("kind") == EXPORT_KIND:
        raise ConfigError(
            str(path),
            ["a `sdplan profiles export` file (several methods' points), not one method's file"],
            fix=f"move it out of the store and add its points with `sdplan profiles import {path.name}`",
        )
    d = _validated(path, METHOD_FILE_SCHEMA)
    method = d["method"]
    points = []
    errors = []
    ids: set[str] = set()
    for i, p in enumerate(d["points"]):
        if p["id"] in ids:
            errors.append(f"points[{i}].id: duplicate {p['id']!r}")
        ids.add(p["id"])
        out = p["outcome"]
        if not any(out.get(k) is not None for k in ("fits", "peak_vram_gib", "it_s", "ram_gib")):
            errors.append(f"points[{i}].outcome: records nothing (fits, peak_vram_gib, it_s or ram_gib)")
        if p["gpu"] is None and p.get("gpu_memory_gib") is None and out.get("it_s") is not None:
            errors.append(f"points[{i}]: a speed (it_s) needs the gpu it was measured on")
        points.append(
            MethodPoint(
                id=p["id"],
                settings=Settings.from_profile(method, p),
                gpu=p["gpu"],
                outcome=dict(out),
                source=p["source"],
                gpu_memory_gib=p.get("gpu_memory_gib"),
                model_name=p.get("model_name"),
                note=p.get("note"),
                origin=origin,
                # this machine's own `sdplan bench` points are evidence for its GPU (exact matches, the floor,
                # the scaled basis), not a refit of the roofline every other GPU's prediction rests on
                fit_speed=p.get("fit_speed", origin != "local"),
            )
        )
    multi = [
        MultiGPUObservation(
            id=m["id"],
            settings=Settings.from_profile(method, m),
            gpu=m["gpu"],
            interconnect=m["interconnect"],
            outcome=dict(m["outcome"]),
            source=m["source"],
            note=m.get("note"),
        )
        for m in d.get("multi_gpu", []) or []
    ]
    if errors:
        raise ConfigError(str(path), errors)
    return points, multi


def load_activations(path: Path) -> Activations:
    d = _validated(path, ACTIVATIONS_SCHEMA)
    errors: list[str] = []
    family_schema = {
        "unet": F((dict,)),
        "text_encoders": F((list,)),
        "adafactor_state_bytes": F(
            (dict,), sub={"unet": F((int,)), "text_encoders": F((list,), item=F((int,)))}
        ),
        "flops": F(
            (dict,),
            sub={"unet_forward": _COEF, "vae_encode": _COEF, "text_encoders_forward": F((int,))},
        ),
        "measured": F((list,), required=False),
        "traffic": F(
            (dict,),
            required=False,
            sub={
                "unet_forward_bytes": _COEF,
                "unet_forward_bytes_math": F((dict,), required=False, sub=_COEF.sub),
            },
        ),
        "sampling": _SAMPLING_PEAKS,
        "lora_params_per_rank": F(
            (dict,),
            required=False,
            sub={
                "unet": F((dict,), sub={t: F((int,)) for t in ("attn", *LORA_TRAINED)}),
                "text_encoders": F((dict,), sub={"attn": F((list,)), "attn_mlp": F((list,))}),
            },
        ),
    }
    optional = {
        f"{dt}/{a}/{g}/{t}"
        for dt in ("bf16", "fp32")
        for a in ATTENTION
        for g in ("gc", "no_gc")
        for t in LORA_TRAINED
    }
    expected = {
        f"{dt}/{a}/{g}/{t}"
        for dt in ("bf16", "fp32")
        for a in ATTENTION
        for g in ("gc", "no_gc")
        for t in TRAINED
    }
    for fam, entry in d["families"].items():
        where = f"families.{fam}"
        if fam in FLOW_FAMILIES:
            _check_transformer_activations(entry, where, errors)
            continue
        _check(entry, family_schema, where, errors)
        if not isinstance(entry, dict) or not isinstance(entry.get("unet"), dict):
            continue
        _check_denoiser_entries(
            entry,
            "unet",
            expected,
            optional,
            "<bf16|fp32>/<efficient|math>/<gc|no_gc>/<unet|attn|attn_ff|attn_ff_conv>",
            where,
            errors,
        )
    if errors:
        raise ConfigError(str(path), errors)
    return Activations(source=d["source"], families=d["families"])


# -- the local store: the one writer of measured and observed points --------------------------------------


def point_record(
    settings: Settings,
    *,
    id: str,
    gpu: str | None,
    outcome: dict[str, Any],
    source: str,
    gpu_memory_bytes: int | None = None,
    model_name: str | None = None,
    note: str | None = None,
) -> dict[str, Any]:
    """One point as ``profiles/methods/<method>.yaml`` holds it (POINT_SCHEMA), for :func:`write_points`."""
    fields_ = settings.profile_fields()
    record: dict[str, Any] = {"id": id, "model": fields_.pop("model")}
    if model_name:
        record["model_name"] = model_name
    num_gpus = fields_.pop("num_gpus")
    record |= fields_
    record["gpu"] = gpu
    if gpu_memory_bytes:
        record["gpu_memory_gib"] = round(gpu_memory_bytes / GiB, 2)
    record |= {"num_gpus": num_gpus, "outcome": outcome, "source": source}
    if note:
        record["note"] = note
    return record


def ensure_store(store: Path) -> Path:
    """Create ``{store}/methods`` where points are written (a UsageError naming the store when that cannot be
    done: a file in the way, a read-only disk), so that a command can find out before it measures anything."""
    methods = store / "methods"
    try:
        methods.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable_store(store, e) from None
    if not os.access(methods, os.W_OK):
        raise _unwritable_store(store, PermissionError("permission denied"))
    return methods


def _unwritable_store(store: Path, e: OSError) -> UsageError:
    return UsageError(
        f"cannot write the profile store {store}: {e.strerror or e}",
        fix="pass --store DIR with a folder you can write, or set SDPLAN_PROFILE_DIR to one",
    )


def write_points(
    store: Path,
    method: str,
    records: list[dict[str, Any]],
    *,
    header: str,
    file_name: str | None = None,
    replace: bool = True,
) -> Path:
    """Add points to ``{store}/methods/{file_name or method}.yaml``, atomically; returns the file.

    ``replace``: a point whose id is already there replaces it (a re-measurement) where it is of the same board
    (``gpu_memory_gib``: the RTX 3060 8GB and 12GB share the name a bench point's id is made of, and importing
    one's points replaced the other's own); otherwise the new one gets a fresh id (another observation). A file
    the loader rejects is refused, never written over, and what is written is validated before it replaces the
    file. Clears the load cache so the planner sees it.
    """
    path = store / "methods" / f"{file_name or method}.yaml"
    data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "method": method, "points": []}
    if path.is_file():
        load_methods(path, origin="local")  # raises ConfigError for a file the planner would reject
        data = read_yaml(path)
        if data.get("method") != method:
            raise ConfigError(str(path), [f"method: expected {method!r}, got {data.get('method')!r}"])
    points = list(data.get("points") or [])
    index = {p.get("id"): i for i, p in enumerate(points)}
    for rec in records:
        if rec["id"] in index and not _same_board(points[index[rec["id"]]], rec):
            # another board's point holds the id: this one's own id names its memory, or that it records none
            # (so importing it again replaces it, not another copy)
            memory_gib = rec.get("gpu_memory_gib")
            rec = {**rec, "id": f"{rec['id']}-{memory_gib:g}gb" if memory_gib else f"{rec['id']}-nomem"}
        if rec["id"] in index and replace and _same_board(points[index[rec["id"]]], rec):
            points[index[rec["id"]]] = rec
            continue
        while rec["id"] in index:
            rec = {**rec, "id": rec["id"] + "-x"}
        index[rec["id"]] = len(points)
        points.append(rec)
    data["points"] = points
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)
    ensure_store(store)
    return _replace_store_file(store, path, text, check=lambda tmp: load_methods(tmp, origin="local"))


def _same_board(stored: dict[str, Any], new: dict[str, Any]) -> bool:
    """A new point record is of the stored one's board: the same memory, or the stored one does not say (a point
    from before it was kept: a re-measurement replaces it). A new one that does not say is not (it replaced a
    user's own measurement of a known board)."""
    ms, mn = stored.get("gpu_memory_gib"), new.get("gpu_memory_gib")
    return ms is None or ms == mn


def _replace_store_file(store: Path, path: Path, text: str, *, check: Callable[[Path], Any]) -> Path:
    """Write ``text`` to ``path`` in the local store atomically: a temporary file beside it, read back with
    ``check`` (the loader: a ConfigError leaves the old file), then renamed over it; clears the load cache so
    the planner sees it. An unwritable store is a UsageError naming it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _unwritable_store(store, e) from None
    try:
        check(tmp)
    except ConfigError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    _load_cached.cache_clear()  # the store changed, not the shipped profiles: the next load reads the store again
    return path


# the trainer's sample grid (planner.sampling_peak_bytes / flow_sampling_peak_bytes): the denoiser's inference
# forward (the UNet's, or a transformer's under the same key) and the VAE decode, per dtype
_SAMPLING_PEAKS = F(
    (dict,),
    required=False,
    sub={
        "unet_inference_peak": _COEF,
        "vae_decode_peak": F((dict,), sub={"bf16": _COEF, "fp32": _COEF}),
        "vae_decode_flops": F(_COEF.types, required=False, sub=_COEF.sub),
    },
)

_TRANSFORMER_ACTIVATIONS_SCHEMA = {
    "transformer": F((dict,)),
    "text_tokens": F((int,), check=_positive),
    "text_encoders": F((list,)),
    "adafactor_state_bytes": F(
        (dict,), sub={"transformer": F((int,)), "text_encoders": F((list,), item=F((int,)))}
    ),
    "flops": F(
        (dict,),
        sub={
            "transformer_forward": _COEF,
            "transformer_train_step": F(
                (dict,), sub={k: _COEF for k in ("full", "lora", "full_gc", "lora_gc")}
            ),
            "vae_encode": _COEF,
            "text_encoders_forward": F((int,)),
        },
    ),
    "flops_fit_max_error": F(NUM, required=False),
    "measured": F((list,), required=False),
    "sampling": _SAMPLING_PEAKS,
}


def _check_transformer_activations(entry: Any, where: str, errors: list[str]) -> None:
    """A transformer family's activations: bf16, flash-style attention, with / without gradient checkpointing,
    the whole transformer or only its LoRA targets trained."""
    _check(entry, _TRANSFORMER_ACTIVATIONS_SCHEMA, where, errors)
    if not isinstance(entry, dict) or not isinstance(entry.get("transformer"), dict):
        return
    expected = {f"bf16/efficient/{g}/{t}" for g in ("gc", "no_gc") for t in TRANSFORMER_TRAINED}
    _check_denoiser_entries(
        entry, "transformer", expected, set(), "bf16/efficient/<gc|no_gc>/<full|lora>", where, errors
    )


def _check_denoiser_entries(
    entry: dict, part: str, expected: set[str], optional: set[str], form: str, where: str, errors: list[str]
) -> None:
    """A family's per-configuration activation entries under ``entry[part]`` (the UNet's or the transformer's):
    known keys only, each a coefficient entry (with its recompute peak under gradient checkpointing), none of
    ``expected`` missing; and the text encoders' entries."""
    for key, value in entry[part].items():
        if key not in expected and key not in optional:
            errors.append(f"{where}.{part}.{key}: expected {form}")
            continue
        _check(value, _UNET_ENTRY, f"{where}.{part}.{key}", errors)
        if "/gc/" in key and isinstance(value, dict) and "recompute_peak" not in value:
            errors.append(f"{where}.{part}.{key}.recompute_peak: missing")
    for i, te in enumerate(entry.get("text_encoders") or []):
        _check(te, _TE_ENTRY, f"{where}.text_encoders[{i}]", errors)
    missing = expected - set(entry[part])
    if missing:
        errors.append(f"{where}.{part}: missing {', '.join(sorted(missing))}")


@dataclass(frozen=True)
class _Shipped:
    """The profiles that ship with sdplan, read and checked (the part of :func:`load_profiles` that no write to
    the local store changes)."""

    gpus: tuple[GPUSpec, ...]
    models: dict[str, ModelSpec]  # the planned families'
    unplanned_models: dict[str, ModelSpec]
    points: tuple[MethodPoint, ...]
    multi_gpu: tuple[MultiGPUObservation, ...]
    activations: Activations
    uncertainty: Uncertainty
    sources: tuple[str, ...]
    sampling: tuple[SamplingPoint, ...]


@functools.lru_cache(maxsize=4)
def _load_shipped(shipped: str) -> _Shipped:
    root = Path(shipped)
    sources: list[str] = []
    gpus_path = root / "gpus.yaml"
    if not gpus_path.is_file():
        raise ConfigError(str(gpus_path), ["missing: the GPU catalog ships with sdplan (reinstall it)"])
    gpus = list(load_gpus(gpus_path))
    sources.append(str(gpus_path))
    models = {}
    for p in sorted((root / "models").glob("*.yaml")):
        m = load_model(p)
        models[m.family] = m
        sources.append(str(p))
    points: list[MethodPoint] = []
    multi: list[MultiGPUObservation] = []
    for p in sorted((root / "methods").glob("*.yaml")):
        pts, mg = load_methods(p)
        points += pts
        multi += mg
        sources.append(str(p))
    act_path = root / "activations.yaml"
    activations = load_activations(act_path)
    sources.append(str(act_path))
    unc_path = root / "uncertainty.yaml"
    if not unc_path.is_file():
        raise ConfigError(str(unc_path), ["missing: run scripts/uncertainty.py (it ships with sdplan)"])
    uncertainty = load_uncertainty(unc_path)
    sources.append(str(unc_path))
    sampling_path = root / "sampling.yaml"
    if not sampling_path.is_file():
        raise ConfigError(
            str(sampling_path), ["missing: the measured sampling speeds ship with sdplan (reinstall it)"]
        )
    sampling = load_sampling(sampling_path, tuple(gpus))
    sources.append(str(sampling_path))
    missing = [f for f in PLANNED_FAMILIES if f not in models]  # a family not yet planned needs no profile
    if missing:
        raise ConfigError(str(root / "models"), [f"{f}.yaml: missing" for f in missing])
    for fam in [*PLANNED_FAMILIES, *(f for f in FLOW_FAMILIES if f in models)]:
        if fam not in activations.families:
            raise ConfigError(
                str(act_path), [f"families.{fam}: missing (run scripts/compute_activations.py)"]
            )
    unplanned = {f: models.pop(f) for f in FLOW_FAMILIES if f in models and f not in PLANNED_FAMILIES}
    return _Shipped(
        gpus=tuple(gpus),
        models=models,
        unplanned_models=unplanned,
        points=tuple(points),
        multi_gpu=tuple(multi),
        activations=activations,
        uncertainty=uncertainty,
        sources=tuple(sources),
        sampling=sampling,
    )


def _profiles(ship: _Shipped, gpus, points, multi, sources, host) -> Profiles:
    return Profiles(
        gpus=tuple(gpus),
        unplanned_models=dict(ship.unplanned_models),
        models=dict(ship.models),
        points=tuple(points),
        multi_gpu=tuple(multi),
        activations=ship.activations,
        sources=tuple(sources),
        uncertainty=ship.uncertainty,
        host=host,
        sampling=ship.sampling,
    )


@functools.lru_cache(maxsize=2)
def _shipped_only(shipped: str) -> Profiles:
    """The shipped profiles with nothing from a local store: one object per folder, so every empty store (a
    new user's; each test's) shares what the planner keeps in ``Profiles.memo`` (its calibration, step times),
    which depends on the profiles alone."""
    ship = _load_shipped(shipped)
    return _profiles(ship, ship.gpus, ship.points, ship.multi_gpu, ship.sources, None)


@functools.lru_cache(maxsize=8)
def _load_cached(shipped: str, local: str) -> Profiles:
    ship = _load_shipped(shipped)  # read once: a write to the local store re-reads the store alone
    gpus, points = list(ship.gpus), list(ship.points)
    multi, sources = list(ship.multi_gpu), list(ship.sources)

    lroot = Path(local)
    host = None
    if lroot.is_dir():
        try:
            if (lroot / HOST_FILE).is_file():
                host = load_host(lroot / HOST_FILE)
                sources.append(str(lroot / HOST_FILE))
            lg = lroot / "gpus.yaml"
            if lg.is_file():
                extra = load_gpus(lg)
                names = {g.name for g in extra}
                gpus = [g for g in gpus if g.name not in names] + list(extra)
                sources.append(str(lg))
            for p in sorted((lroot / "methods").glob("*.yaml")):
                pts, mg = load_methods(p, origin="local")
                points += pts
                multi += mg
                sources.append(str(p))
        except ConfigError as e:  # a hand-edited file of the user's own store stops every command: say whose
            raise ConfigError(
                e.source,
                e.errors,
                fix=f"it is in your local profile store {lroot} ($SDPLAN_PROFILE_DIR; sdplan bench writes "
                "there): "
                + (
                    e.fix  # an export file saved into the store: import it
                    if e.fix and "profiles import" in e.fix
                    else "fix the file, or move it out of the store"
                ),
            ) from None
    if len(sources) == len(ship.sources):  # the store added nothing
        return _shipped_only(shipped)
    return _profiles(ship, gpus, points, multi, sources, host)


def check_store(root: Path, verb: str = "read") -> Path:
    """``root``, or one clear UsageError where it, or the nearest folder above it that exists, is a file (a
    store there could be neither read nor written; silently skipped, its measurements would be missed), or a
    link that loops (``profiles`` crashed on it, the planner skipped it)."""
    from sdplan.config import link_loops

    if link_loops(root):  # a link to a folder not made yet is fine: sdplan bench makes it
        raise UsageError(
            f"cannot {verb} the profile store {root}: it is a symbolic link that loops",
            fix="pass --store DIR with a folder, or set SDPLAN_PROFILE_DIR to one",
        )
    for p in (root, *root.parents):
        if p.exists():
            if not p.is_dir():
                raise UsageError(
                    f"cannot {verb} the profile store {root}: {p} is a file, not a folder",
                    fix="pass --store DIR with a folder, or set SDPLAN_PROFILE_DIR to one",
                )
            break
    return root


def load_profiles(shipped: str | Path | None = None, local: str | Path | None = None) -> Profiles:
    """All profiles: the shipped ones plus the local store (cached per pair of folders)."""
    s = Path(shipped) if shipped is not None else shipped_dir()
    loc = check_store((Path(local) if local is not None else local_dir()).expanduser())
    return _load_cached(str(s.resolve()), str(loc))


def clear_cache(*, shipped: bool = True) -> None:
    """Forget what was loaded: the next :func:`load_profiles` reads the local store again, and the shipped
    profiles too unless ``shipped=False`` (they change only when edited, as scripts/uncertainty.py does)."""
    _load_cached.cache_clear()
    if shipped:
        _shipped_only.cache_clear()
        _load_shipped.cache_clear()
