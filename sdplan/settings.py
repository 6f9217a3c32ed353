"""`Settings`: the one description of a training configuration's knobs.

The planner searches over Settings (and predicts their memory and time), a profile point records one
(``profiles/methods/*.yaml``: top-level batch/precision/... plus ``options``), ``sdplan.yaml`` holds one
(:meth:`Settings.to_config` / :meth:`Settings.from_config`, through the single key map :data:`CONFIG_KEYS`), and
`sdplan bench` measures one. Every translation between those forms lives here. Pure data: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sdplan import config as C
from sdplan.registry import FULL_METHODS, legacy_lora_targets, lora_targets

DEFAULT_LORA_RANK = C.LoraConfig().rank
# the DeepSpeed settings the planner considers: ZeRO-2 with the optimizer on the CPU (any GPU count), and ZeRO-2
# with the optimizer state and gradients split over the GPUs (two or more)
OFFLOAD = {"zero_stage": 2, "offload_optimizer": True}
SHARDED = {"zero_stage": 2, "offload_optimizer": False}
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # reduce / allgather buckets (5e8 elements), written and counted


def trains_half_weights(method: str | None, precision: str | None, full_half_weights: bool | None) -> bool:
    """Whether a run keeps its trained weights and their gradients in half precision, no fp32 master copy: with
    training.full_half_weights, as the trainer applies it (trainer/runtime.py trained_dtype, kohya --full_bf16)
    to the full-weight recipes and a LoRA's matrices; textual inversion's embeddings stay fp32. sdplan's config
    takes it under bf16 only; other tools' --full_fp16 runs (profile points) hold fp16 weights so."""
    return bool(full_half_weights) and precision in ("bf16", "fp16") and method != "textual-inversion"


def deepspeed_reduce_buckets(num_processes: int) -> int:
    """The reduce buckets DeepSpeed ZeRO-1/2 allocates on each GPU during the backward, as sdplan's DeepSpeed
    config (``launch.deepspeed_config``) sets overlap_comm: two with it (several processes: the reduction
    overlaps the backward), one without (one process: nothing to overlap with); deepspeed/runtime/zero/
    stage_1_and_2.py setup_buckets @0.19.8. The config and the planner both read it."""
    return 2 if num_processes > 1 else 1


def zero_label(deepspeed: dict | None) -> str:
    """The ZeRO stage a DeepSpeed setting runs ('ZeRO-1', 'ZeRO-2'; 2 where it names none, as sdplan.launch
    writes it)."""
    return f"ZeRO-{(deepspeed or {}).get('zero_stage', 2)}"


def deepspeed_label(deepspeed: dict | None) -> str | None:
    """What a DeepSpeed setting is called wherever one is shown ('ZeRO-2 offload', 'ZeRO-2'; None: none), from
    the settings', a plan's (--json) or a profile point's ``deepspeed`` entry."""
    if not deepspeed:
        return None
    stage = zero_label(deepspeed)
    return f"{stage} offload" if deepspeed.get("offload_optimizer") else stage


def describe(s: Settings, *, batch: bool = True, gpus: bool | None = None, short: bool = False) -> str:
    """A configuration in words: the one spelling that recommend, the plan's reasons, plan.png, sdplan bench and
    sdplan profiles list settings with. ``short`` for table cells ('GC', 'cached TE outputs'); ``batch`` adds the
    micro-batch and accumulation (off where a table has its own column); ``gpus``: True leads with the process
    count, False leaves it out (a column of its own), None ends the list with it where there is more than one."""
    bits = [f"{s.num_gpus} GPU" + ("s" if s.num_gpus > 1 else "")] if gpus else []
    if gpus and s.gpu_ids:  # a machine whose GPUs differ: which, as `sdplan doctor` numbers them
        bits[0] += f" ({'GPUs' if len(s.gpu_ids) > 1 else 'GPU'} {', '.join(map(str, s.gpu_ids))})"
    bits.append(s.precision)
    if batch:
        bits.append(f"batch {s.batch}" + (f" x GA {s.grad_accum}" if s.grad_accum > 1 else ""))
    if short:
        bits.append("GC" if s.gradient_checkpointing else "no GC")
    else:
        bits.append("gradient checkpointing" if s.gradient_checkpointing else "no checkpointing")
    bits.append(s.optimizer)
    for on, words in (
        (s.cache_latents, "cached latents"),
        (s.cache_text_encoder_outputs, "cached TE outputs" if short else "cached text-encoder outputs"),
        (s.train_text_encoder, "+TE" if short else "text encoder trained"),
        (s.method == "lora" and s.lora_rank is not None, f"rank {s.lora_rank}"),
        (s.base_precision != "bf16", f"{s.base_precision} base"),
        (s.blocks_to_swap, f"{s.blocks_to_swap} blocks swapped"),
        (s.full_half_weights, f"full {s.precision} weights"),
        (s.fused_backward, "fused backward"),
        (s.deepspeed, f"DeepSpeed {deepspeed_label(s.deepspeed)}"),
        (s.ema, f"EMA on {s.ema}"),
        (gpus is None and s.num_gpus > 1, f"{s.num_gpus} GPUs"),
    ):
        if on:
            bits.append(words)
    return ", ".join(bits)


@dataclass(frozen=True)
class Settings:
    """One concrete training configuration: what the planner chooses, a profile point records, sdplan.yaml holds."""

    method: str
    model: str  # the family (sdplan.registry.FAMILIES)
    resolution: int
    batch: int = 1  # micro-batch per process
    grad_accum: int = 1
    precision: str = "bf16"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    cache_latents: bool = False
    cache_text_encoder_outputs: bool = False
    train_text_encoder: bool = False
    attention: str = "efficient"  # "efficient" (flash / memory-efficient SDPA) | "math"
    deepspeed: dict | None = None  # {"zero_stage", "offload_optimizer"}
    ema: str | None = None  # None | "gpu" | "cpu"
    # optimizer steps between EMA updates (ema.update_every): an EMA in host RAM costs time at each
    ema_every: int = 1
    lora_rank: int | None = None  # LoRA only (None elsewhere; LoRA's default 16)
    lora_alpha: float | None = None  # LoRA only; None: the config's default
    lora_dropout: float | None = None  # LoRA only (lora.dropout; None elsewhere, 0.0 LoRA's default)
    # LoRA only: lora.target_modules, sorted, each once; None: the family's default (sdplan.registry.lora_targets),
    # which a list naming just those modules is too
    lora_targets: tuple[str, ...] | None = None
    prior_preservation: bool = False
    fused_backward: bool = False
    full_half_weights: bool = False  # trained weights and gradients in bf16 too (kohya --full_bf16)
    set_grads_to_none: bool = True
    num_gpus: int = 1
    base_precision: str = "bf16"  # frozen transformer base storage (SD3.5 / FLUX.1): bf16 | fp8 | nf4
    blocks_to_swap: int = (
        0  # transformer blocks held in host RAM, swapped in per block (kohya; SD3.5 / FLUX.1)
    )
    # the GPUs the processes run on, as `sdplan doctor` numbers them (planner.plan_gpus); None: the first
    # num_gpus (alike GPUs). Set where the machine's GPUs differ
    gpu_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        lora = self.method == "lora"
        if lora and self.lora_rank is None:
            object.__setattr__(self, "lora_rank", DEFAULT_LORA_RANK)
        if lora and self.lora_dropout is None:
            object.__setattr__(self, "lora_dropout", 0.0)
        if not lora:
            for name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"):
                object.__setattr__(self, name, None)
        if self.lora_targets is not None:
            targets = lora_targets(self.model, self.lora_targets)
            default = set(lora_targets(self.model, None))
            object.__setattr__(self, "lora_targets", None if set(targets) == default else targets)
        if self.gpu_ids is not None:
            object.__setattr__(self, "gpu_ids", tuple(self.gpu_ids))

    @property
    def offload(self) -> bool:
        return bool(self.deepspeed and self.deepspeed.get("offload_optimizer"))

    @property
    def half_weights(self) -> bool:
        """Whether the trained weights and their gradients are half precision (:func:`trains_half_weights`)."""
        return trains_half_weights(self.method, self.precision, self.full_half_weights)

    @property
    def sharded(self) -> bool:
        """DeepSpeed without offload: the optimizer state (and, ZeRO-2, the gradients) split over the GPUs."""
        return bool(self.deepspeed) and not self.offload

    @property
    def full_weights(self) -> bool:
        return self.method in FULL_METHODS

    # -- sdplan.yaml ------------------------------------------------------------------------------------

    def to_config(self, *, num_machines: int = 1) -> dict[str, Any]:
        """These settings as sdplan.yaml sections, to merge over a config (flags and overrides go on top).

        ``num_machines``: the config's ``distributed.num_processes`` counts every machine's processes."""
        out: dict[str, Any] = {}
        for name, key in CONFIG_KEYS.items():
            value = getattr(self, name)
            if name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets") and value is None:
                continue
            if name == "num_gpus":
                value *= num_machines
            elif name == "deepspeed":
                value = dict(value) if value else None
            elif name in ("lora_targets", "gpu_ids"):
                value = list(value) if value is not None else None
            _put(out, key, value)
        _put(out, "ema.enabled", self.ema is not None)
        if self.ema is not None:
            _put(out, "ema.device", self.ema)
        return out

    @classmethod
    def from_config(cls, cfg: Any, **changes: Any) -> Settings:
        """From an sdplan.yaml (a validated ``TrainConfig`` or its plain data; absent keys: the defaults).
        ``changes`` replace fields (the model family, when the config leaves it to detection)."""
        data = C.merge(C.default_config(), cfg if isinstance(cfg, dict) else cfg.to_dict())
        kwargs: dict[str, Any] = {name: get_key(data, key) for name, key in CONFIG_KEYS.items()}
        ema = data.get("ema") or {}
        kwargs["ema"] = ema.get("device", "cpu") if ema.get("enabled") else None
        kwargs["deepspeed"] = dict(kwargs["deepspeed"]) if kwargs["deepspeed"] else None
        return cls(**{**kwargs, **changes})

    # -- profile points (profiles/methods/*.yaml) ----------------------------------------------------------

    def profile_fields(self) -> dict[str, Any]:
        """A profile point's settings: its top-level keys and ``options`` (profiles.POINT_SCHEMA)."""
        options: dict[str, Any] = {name: getattr(self, name) for name in PROFILE_OPTIONS}
        options["attention"] = "math" if self.attention == "math" else "sdpa"
        options["deepspeed"] = dict(self.deepspeed) if self.deepspeed else None
        if self.lora_rank is not None:
            options["lora_rank"] = self.lora_rank
        return {
            "model": self.model,
            "resolution": self.resolution,
            "batch": self.batch,
            "grad_accum": self.grad_accum,
            "precision": self.precision,
            "options": options,
            "num_gpus": self.num_gpus,
        }

    @classmethod
    def from_profile(cls, method: str, entry: dict[str, Any]) -> Settings:
        """From a validated profile point (or multi-GPU observation) of ``method``."""
        o = entry["options"]
        return cls(
            method=method,
            model=entry["model"],
            resolution=entry["resolution"],
            batch=entry.get("batch", 1),
            grad_accum=entry.get("grad_accum", 1),
            precision=entry["precision"],
            attention="math" if o["attention"] == "math" else "efficient",
            deepspeed=dict(o["deepspeed"]) if o["deepspeed"] else None,
            num_gpus=entry.get("num_gpus", 1),
            **{name: o[name] for name in PROFILE_OPTIONS if name in o and name != "deepspeed"},
            **({"lora_rank": o["lora_rank"]} if o.get("lora_rank") else {}),
        )


# Settings field -> sdplan.yaml key path (the one map both directions read). Issue 10's `key=value` pins
# name these keys too.
CONFIG_KEYS = {
    "method": "method",
    "model": "model.family",
    "base_precision": "model.base_precision",
    "resolution": "data.resolution",
    "batch": "training.batch_size",
    "grad_accum": "training.grad_accum",
    "precision": "training.precision",
    "train_text_encoder": "training.train_text_encoder",
    "full_half_weights": "training.full_half_weights",
    "gradient_checkpointing": "memory.gradient_checkpointing",
    "optimizer": "memory.optimizer",
    "cache_latents": "memory.cache_latents",
    "cache_text_encoder_outputs": "memory.cache_text_encoder_outputs",
    "set_grads_to_none": "memory.set_grads_to_none",
    "blocks_to_swap": "memory.blocks_to_swap",
    "num_gpus": "distributed.num_processes",
    "gpu_ids": "distributed.gpu_ids",
    "deepspeed": "distributed.deepspeed",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_targets": "lora.target_modules",
    "prior_preservation": "dreambooth.with_prior_preservation",
    "ema_every": "ema.update_every",
}
FIELD_FOR_KEY = {key: name for name, key in CONFIG_KEYS.items()}  # sdplan.yaml key -> Settings field
# Settings fields a profile point keeps under ``options`` (besides attention and lora_rank).
PROFILE_OPTIONS = (
    "gradient_checkpointing",
    "optimizer",
    "cache_latents",
    "cache_text_encoder_outputs",
    "train_text_encoder",
    "deepspeed",
    "ema",
    "prior_preservation",
    "fused_backward",
    "full_half_weights",
    "set_grads_to_none",
    "base_precision",
    "blocks_to_swap",
)
assert {f.name for f in fields(Settings)} == {*CONFIG_KEYS, *PROFILE_OPTIONS, "attention", "ema"} | {
    "method",
    "model",
    "resolution",
    "batch",
    "grad_accum",
    "precision",
    "num_gpus",
}


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def get_key(data: dict[str, Any], key: str) -> Any:
    """The value at a dotted sdplan.yaml key (``lora.rank``) of a config dict; None where it is absent."""
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


# Settings the trained weights are shaped by: a checkpoint made with one value cannot be resumed with another.
# lora.alpha scales every adapter's output by alpha / rank (peft): another one changes what the trained weights
# do; textual_inversion.token is the word the captions trained the embedding under (init_token only seeds it,
# lora.dropout only regularises: both may change).
WEIGHT_SETTINGS = (
    "method",
    "model.path",
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "lora.text_encoder_target_modules",
    "textual_inversion.token",
    "textual_inversion.num_vectors",
    "training.train_text_encoder",
)
# Settings the checkpoint's saved state is shaped by (accelerate's load_state reads it into the objects this
# run builds): another optimizer has other state (adafactor on an AdamW checkpoint: KeyError 'beta1'; 8-bit
# AdamW's quantized state), an EMA the checkpoint lacks or has is a count of registered objects that differs
# ("Number of custom checkpoints ... does not match"), DeepSpeed keeps its own model and optimizer files, and
# training.full_half_weights stores the trained weights and their optimizer state in bf16 (an fp32 run resumed
# with it was cast to bf16 without a word).
STATE_SETTINGS = ("memory.optimizer", "ema.enabled", "distributed.deepspeed", "training.full_half_weights")
# The key a checkpoint records the family of the model it was trained on under (as the trainer detected it;
# train_state.json's ``settings``): a new run from it on a model of another family is refused.
FAMILY_SETTING = "model.family"


def checkpoint_settings(data: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint saved under the config ``data`` (plain data) records of it (train_state.json's
    ``settings``): each of :data:`WEIGHT_SETTINGS` and :data:`STATE_SETTINGS` by its dotted key, so a run that
    starts from the checkpoint is checked against the settings it was made with, wherever it was copied."""
    return {key: get_key(data, key) for key in (*WEIGHT_SETTINGS, *STATE_SETTINGS)}


def weight_setting(data: dict[str, Any], key: str, family: str | None) -> Any:
    """The value of a :data:`WEIGHT_SETTINGS` key of config data as the trained weights depend on it:
    lora.target_modules as the modules it adapts on ``family`` (sdplan.registry.lora_targets: in any order;
    null, or the old default list a checkpoint or sdplan.yaml of an earlier sdplan holds, the family's default),
    the others as they are."""
    value = get_key(data, key)
    if key == "lora.target_modules" and (value is None or isinstance(value, list)):
        return sorted(lora_targets(family, legacy_lora_targets(value)))
    return value


def settings_data(settings: dict[str, Any]) -> dict[str, Any]:
    """:func:`checkpoint_settings`'s dotted keys as a config dict again."""
    data: dict[str, Any] = {}
    for key, value in settings.items():
        _put(data, key, value)
    return data
