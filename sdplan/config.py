"""The trainer config, `sdplan.yaml`: one schema shared by `recommend --out`, `train` and the trainer.

YAML holds the values, `key=value` overrides on the command line win, and validation reports every error
at once with its key path (``training.batch_size: must be >= 1``). Pure Python: no torch here.
"""

from __future__ import annotations

import copy
import errno
import functools
import math
import os
import re
import shlex
from collections.abc import Collection
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from sdplan.errors import ConfigError, UsageError
from sdplan.registry import (
    BASE_PRECISIONS,
    FAMILIES,
    FLOW_FAMILIES,
    METHOD_LIST,
    METHODS,
    OPTIMIZERS,
    PRECISIONS,
    legacy_lora_targets,
)
from sdplan.registry import family as registry_family
from sdplan.registry import method as registry_method

SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
)
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_EPOCHS = 10  # `train` and `recommend` alike
MIN_RESOLUTION, MAX_RESOLUTION = 64, 4096
RESOLUTION_RULE = f"must be between {MIN_RESOLUTION} and {MAX_RESOLUTION} pixels and a multiple of 8"


def resolution_ok(pixels: int) -> bool:
    """The VAE downsamples 8x: a side must be a multiple of 8; past 4096 px no SD model trains sensibly."""
    return MIN_RESOLUTION <= pixels <= MAX_RESOLUTION and pixels % 8 == 0


PIXELS_PER_TOKEN = 16  # SD3.5 / FLUX.1: the transformer takes 2x2 patches of the 8x VAE latent


def flow_resolution_problem(pixels: int, family: str | None, *, buckets: bool = False) -> str | None:
    """Why an SD3.5 / FLUX.1 transformer cannot train at ``pixels`` (a side not a multiple of
    :data:`PIXELS_PER_TOKEN`; aspect buckets round their sides themselves), or None. One rule for `recommend`,
    the config and the trainer, which refused a resolution the plan had accepted."""
    if family not in FLOW_FAMILIES or buckets or pixels % PIXELS_PER_TOKEN == 0:
        return None
    lower = pixels - pixels % PIXELS_PER_TOKEN
    return (
        f"data.resolution {pixels} for {family}: the transformer takes 2x2 patches of the 8x VAE latent, so a side "
        f"must be a multiple of {PIXELS_PER_TOKEN} pixels (set it to {lower} or {lower + PIXELS_PER_TOKEN})"
    )


@dataclass
class ModelConfig:
    path: str = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # diffusers folder, hub id, .safetensors/.ckpt
    family: str | None = None  # sd15 | sd21 | sdxl; None: detected from the model
    revision: str | None = None
    variant: str | None = None
    config_dir: str | None = None  # single-file model: a local diffusers folder with its component configs
    # storage of the frozen transformer's block Linear weights (SD3.5 / FLUX.1 LoRA): bf16 | fp8 | nf4. The
    # planner may choose fp8 / nf4; the trainer stores them as trainer/quantize.py says (where the machine can)
    base_precision: str = "bf16"


@dataclass
class MetadataConfig:
    """Options for datasets described by one .json per image (tags, score, relative path)."""

    skip_tags: list[str] = field(default_factory=list)
    remove_tags: list[str] = field(default_factory=list)
    replace: dict[str, str] = field(default_factory=dict)  # substring replacements in tags, e.g. {":": "="}
    shuffle_tags: float = 0.0  # probability of shuffling the tag order of a caption
    min_score: float | None = None
    score_bonus: dict[str, float] = field(default_factory=dict)  # tag -> added to score
    score_buckets: list[float] = field(default_factory=list)  # thresholds -> "score_N" tags
    keep_tags: int = 0  # the first N tags stay in place when tags are shuffled


@dataclass
class DataConfig:
    path: str = "./dataset"
    resolution: int = 512
    center_crop: bool = True
    random_flip: float = 0.0
    # the share of samples trained on the empty caption (kohya caption_dropout_rate): the model learns the
    # subject or style without its trigger words too; classifier-free guidance's unconditional branch
    caption_dropout: float = 0.0
    caption_extension: str = ".txt"
    default_caption: str | None = None  # missing caption: this, else the instance prompt, else ""
    repeats: int = 1  # flat folders; kohya `N_name` folders carry their own
    metadata: MetadataConfig | None = None
    num_workers: int = 0
    buckets: bool = False  # aspect-ratio buckets by pixel budget at `resolution`
    bucket_step: int = 64  # bucket sides are multiples of this (32 allowed for sdxl)
    bucket_min_size: int | None = None
    bucket_max_size: int | None = None


# the text encoders' embedding layers (CLIP's token / position embeddings, T5's shared table and its relative
# attention bias): peft adapts an Embedding, but no LoRA file other tools read holds one
EMBEDDING_MODULES = frozenset(
    {
        "token_embedding",
        "position_embedding",
        "embeddings",
        "shared",
        "embed_tokens",
        "relative_attention_bias",
    }
)


# UNet modules outside kohya sd-scripts' LoRA module classes (networks/lora.py LoRANetwork: Transformer2DModel,
# and with conv layers ResnetBlock2D, Downsample2D, Upsample2D): its loader makes no LoRA module for them and
# drops their keys without a word (load_state_dict with strict=False). ComfyUI and A1111 read them.
KOHYA_UNREAD_UNET = frozenset(
    {"conv_in", "conv_out", "time_embedding", "add_embedding", "linear_1", "linear_2"}
)
# OpenCLIP's attention (SD 2.x's text encoder, SDXL's second) is one nn.MultiheadAttention in A1111, which adds a
# LoRA to it only where q_proj, k_proj, v_proj and out_proj all have one (extensions-builtin/Lora/networks.py
# network_apply_weights); fewer are skipped there
A1111_MHA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    # the modules the adapters go on (peft suffixes: a module whose name is one, or ends with "." + one), in any
    # order (kept sorted); null: the family's default (sdplan.registry.LORA_TARGETS: the UNet's attention
    # projections, SD3.5's / FLUX.1's diffusers example targets). A file sdplan wrote before null meant that, with
    # the list [to_k, to_q, to_v, to_out.0] in that order (the default it wrote then), reads as null, as it
    # trained (read_config_file)
    target_modules: list[str] | None = None
    text_encoder_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "out_proj"]
    )


@dataclass
class DreamBoothConfig:
    instance_prompt: str = "a photo of sks person"
    class_prompt: str | None = None
    class_data: str | None = None  # folder of class images; generated with the base model when short
    num_class_images: int = 100
    prior_loss_weight: float = 1.0
    with_prior_preservation: bool = False


@dataclass
class TextualInversionConfig:
    token: str = "<sks>"
    init_token: str = "person"
    num_vectors: int = 1


@dataclass
class TrainingConfig:
    batch_size: int = 1
    grad_accum: int = 1
    precision: str = "fp16"
    learning_rate: float | None = None  # None: the method's (sdplan.registry.Method.learning_rate)
    text_encoder_learning_rate: float | None = None
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    epochs: int = DEFAULT_EPOCHS
    max_steps: int | None = None  # when set, overrides epochs
    seed: int = 42
    train_text_encoder: bool = False
    full_half_weights: bool = False  # trained weights in bf16 too, no fp32 master copy (kohya --full_bf16)
    max_grad_norm: float = 1.0
    noise_offset: float = 0.0
    # Min-SNR loss weighting (Hang et al. 2023; kohya --min_snr_gamma, diffusers --snr_gamma): each sample's loss
    # weighs min(SNR, gamma) / SNR (v-prediction: / (SNR + 1)); 5 is the paper's. null: off. SD 1.x/2.x/SDXL
    min_snr_gamma: float | None = None
    device: str = "auto"


@dataclass
class MemoryConfig:
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    cache_latents: bool = False
    cache_latents_to_disk: bool = False  # under {output.dir}/cache/latents, keyed by image content
    cache_text_encoder_outputs: bool = False  # only while the text encoders are frozen
    set_grads_to_none: bool = True
    # transformer blocks kept in host RAM and swapped in per block (kohya --blocks_to_swap; SD3.5 / FLUX.1). The
    # planner may choose it; the trainer swaps them for LoRA with gradient checkpointing in one process
    blocks_to_swap: int = 0


@dataclass
class EmaConfig:
    enabled: bool = False
    decay: float = 0.9999
    update_every: int = 1  # optimizer steps between EMA updates
    device: str = "cpu"  # "cpu": kept in system RAM (saves VRAM); "gpu": beside the weights


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 2
    offload_optimizer: bool = True


@dataclass
class DistributedConfig:
    num_processes: int = 1
    deepspeed: DeepSpeedConfig | None = None
    # the GPUs this machine's processes run on, as `sdplan doctor` numbers them (NVIDIA in PCI bus order, as
    # nvidia-smi does; then AMD); null: the first ones the framework sees. The planner sets it on a machine whose
    # GPUs differ, and `sdplan train` launches on those GPUs (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)
    gpu_ids: list[int] | None = None


@dataclass
class OutputConfig:
    dir: str = "./output"
    name: str | None = None  # file names of the outputs; None: the run folder's name
    save_kohya: bool = True  # LoRA: also the kohya (A1111/ComfyUI) format
    save_single_file: bool = True  # DreamBooth / fine-tune: also one .safetensors
    # Intermediate outputs (0: off): the method's outputs, in every format, every N epochs / optimizer steps,
    # into intermediate/{name}-{epoch:06d}/ or intermediate/{name}-step{step:08d}/, each with a sample grid.
    save_every_n_epochs: int = 0
    save_every_n_steps: int = 0


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # rolling checkpoint, overwritten
    keep_every_steps: int = 0  # 0: keep none
    resume: str | None = None  # "latest" or a checkpoint folder


@dataclass
class SamplingConfig:
    prompts: list[str] = field(default_factory=list)
    every_steps: int = 0  # 0: only a final grid (at the last step the final grid is the every-N one)
    num_inference_steps: int = 20
    # null: the family's (trainer.sampling.guidance_for): 3.5 for FLUX.1, whose pipeline takes it as the guidance
    # embedding's value (FluxPipeline's and kohya's sample default), 7.5 for the others (classifier-free)
    guidance_scale: float | None = None
    seed: int = 0
    # the grids' negative prompt (kohya's sample prompts take one with --n); null: the pipeline's (none)
    negative_prompt: str | None = None


@dataclass
class LoggingConfig:
    tensorboard: bool = False


@dataclass
class TrainConfig:
    method: str = "lora"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dreambooth: DreamBoothConfig = field(default_factory=DreamBoothConfig)
    textual_inversion: TextualInversionConfig = field(default_factory=TextualInversionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    plan: dict[str, Any] | None = None  # the plan `sdplan recommend` made; recorded in outputs' metadata

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SEED_RULE = "must be from 0 to 4294967295 (2**32 - 1)"

# Constraints beyond the type: key path -> (check, message).
MAX_LEARNING_RATE = 3e35  # float32's largest value is 3.4e38
_RULES: dict[str, tuple[Any, str]] = {
    "method": (lambda v: v in METHODS, f"must be one of {', '.join(METHODS)}"),
    "model.path": (lambda v: bool(v.strip()), "must not be empty"),
    "model.family": (lambda v: v is None or v in FAMILIES, f"must be one of {', '.join(FAMILIES)} or null"),
    "data.resolution": (resolution_ok, RESOLUTION_RULE),
    "data.random_flip": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "data.caption_dropout": (lambda v: 0 <= v < 1, "must be at least 0 and below 1"),
    "data.repeats": (lambda v: v >= 1, "must be >= 1"),
    "data.num_workers": (lambda v: v >= 0, "must be >= 0"),
    "data.bucket_step": (lambda v: v in (32, 64, 128), "must be 32, 64 or 128"),
    "data.bucket_min_size": (lambda v: v is None or v >= 64, "must be >= 64 or null"),
    "data.bucket_max_size": (lambda v: v is None or v >= 64, "must be >= 64 or null"),
    "data.metadata.keep_tags": (lambda v: v >= 0, "must be >= 0"),
    "ema.decay": (lambda v: 0 < v < 1, "must be between 0 and 1"),
    "ema.update_every": (lambda v: v >= 1, "must be >= 1"),
    "ema.device": (lambda v: v in ("cpu", "gpu"), "must be cpu or gpu"),
    "data.metadata.shuffle_tags": (lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "lora.rank": (lambda v: v >= 1, "must be >= 1"),
    "lora.alpha": (lambda v: v > 0, "must be > 0"),
    "lora.dropout": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "lora.target_modules": (
        lambda v: v is None or (bool(v) and all(t.strip() for t in v)),
        "must name at least one module, or be null (the family's default)",
    ),
    "dreambooth.num_class_images": (lambda v: v >= 0, "must be >= 0"),
    "dreambooth.prior_loss_weight": (lambda v: v >= 0, "must be >= 0"),
    "textual_inversion.num_vectors": (lambda v: v >= 1, "must be >= 1"),
    "textual_inversion.token": (lambda v: bool(v.strip()), "must not be empty"),
    "training.batch_size": (lambda v: v >= 1, "must be >= 1"),
    "training.grad_accum": (lambda v: v >= 1, "must be >= 1"),
    "training.precision": (lambda v: v in PRECISIONS, f"must be one of {', '.join(PRECISIONS)}"),
    # the optimizers scale the rate in float32 (AdamW's first step by 1 / (1 - beta1) = 10; torch: "value cannot
    # be converted to type float without overflow" from 3.4e37): a margin of 1000 under float32's largest value
    "training.learning_rate": (
        lambda v: v is None or 0 < v <= MAX_LEARNING_RATE,
        "must be > 0 and at most 3e35",
    ),
    "training.text_encoder_learning_rate": (
        lambda v: v is None or 0 < v <= MAX_LEARNING_RATE,
        "must be > 0 and at most 3e35",
    ),
    "training.lr_scheduler": (lambda v: v in SCHEDULERS, f"must be one of {', '.join(SCHEDULERS)}"),
    "training.lr_warmup_steps": (lambda v: v >= 0, "must be >= 0"),
    "training.epochs": (lambda v: v >= 1, "must be >= 1"),
    "training.max_steps": (lambda v: v is None or v >= 1, "must be >= 1 or null"),
    "training.max_grad_norm": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite"),
    # a seed every seeder takes: torch.manual_seed (the trainer's; DreamBooth's class images add their count) takes
    # -2**63 to 2**64 - 1, numpy's and accelerate's set_seed (kohya's) 0 to 2**32 - 1
    "training.seed": (lambda v: 0 <= v < 2**32, SEED_RULE),
    "training.noise_offset": (lambda v: 0 <= v < math.inf, "must be >= 0 and finite"),
    "training.min_snr_gamma": (
        lambda v: v is None or 0 < v < math.inf,
        "must be > 0 and finite, or null (off)",
    ),
    "training.device": (lambda v: v in DEVICES, f"must be one of {', '.join(DEVICES)}"),
    "model.base_precision": (
        lambda v: v in BASE_PRECISIONS,
        f"must be one of {', '.join(BASE_PRECISIONS)}",
    ),
    "memory.blocks_to_swap": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "memory.optimizer": (lambda v: v in OPTIMIZERS, f"must be one of {', '.join(OPTIMIZERS)}"),
    "distributed.num_processes": (lambda v: v >= 1, "must be >= 1"),
    "distributed.gpu_ids": (
        lambda v: v is None or (bool(v) and min(v) >= 0 and len(set(v)) == len(v)),
        "must list GPU numbers >= 0, each once (or be null)",
    ),
    "distributed.deepspeed.zero_stage": (lambda v: v in (1, 2), "must be 1 or 2 (ZeRO-3 is not supported)"),
    "output.save_every_n_epochs": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "output.save_every_n_steps": (lambda v: v >= 0, "must be >= 0 (0: off)"),
    "checkpoints.every_steps": (lambda v: v >= 0, "must be >= 0"),
    "checkpoints.keep_every_steps": (lambda v: v >= 0, "must be >= 0"),
    "sampling.every_steps": (lambda v: v >= 0, "must be >= 0"),
    # the models' schedules have 1000 training timesteps, offset by one (steps_offset=1): 1000 inference steps
    # index timestep 1000 and the final grid failed after the whole run
    "sampling.num_inference_steps": (lambda v: 1 <= v <= 999, "must be between 1 and 999 (20-50 is usual)"),
    "sampling.guidance_scale": (lambda v: v is None or v >= 0, "must be >= 0 or null"),
    "sampling.seed": (lambda v: 0 <= v < 2**32, SEED_RULE),
}


def default_config() -> dict[str, Any]:
    """Every key with its default, as plain data."""
    return TrainConfig().to_dict()


def validate(data: Any, source: str = "config") -> TrainConfig:
    """Build a TrainConfig from plain data; raise ConfigError listing every problem with its key path."""
    errors: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError(
            source, ["top level: must be a mapping of sections (model:, data:, training:, ...)"]
        )
    if {"host", "gpus"} <= data.keys() and "method" not in data:  # what `sdplan doctor --save` writes
        raise ConfigError(
            source,
            ["a machine snapshot (sdplan doctor --save), not an sdplan.yaml"],
            fix="plan with it: sdplan recommend --machine FILE; train with an sdplan.yaml (sdplan recommend "
            "--out DIR writes one)",
        )
    cfg = _build(TrainConfig, data, "", errors)
    if cfg is not None:
        _cross_checks(cfg, errors)
        if cfg.training.learning_rate is None and cfg.method in METHODS:
            cfg.training.learning_rate = registry_method(cfg.method).learning_rate
        # a set of modules: sorted, each once (never the old default's order, which a file reads as null:
        # read_config_file)
        if cfg.lora.target_modules is not None:
            cfg.lora.target_modules = sorted(set(cfg.lora.target_modules))
    if errors:
        raise ConfigError(source, errors)
    return cfg


def prior_preservation(cfg: TrainConfig) -> tuple[bool, int]:
    """(whether the run trains with prior preservation, the class images trained alongside its own): DreamBooth's
    dreambooth.with_prior_preservation and dreambooth.num_class_images (the trainer generates the ones its class
    folder lacks). What `sdplan train` and `sdplan recommend` both plan (the planner's Request.prior_preservation
    and class_images)."""
    on = cfg.method == "dreambooth" and cfg.dreambooth.with_prior_preservation
    return on, cfg.dreambooth.num_class_images if on else 0


def planned_sampling(cfg: TrainConfig) -> dict[str, Any]:
    """What a run of ``cfg`` samples besides training, as the planner's Request takes it (planner.sampled_images):
    the class images its class folder lacks (DreamBooth with prior preservation: the trainer generates them
    before the first step, trainer/recipes/dreambooth.py; the folder is dreambooth.class_data, else
    output.dir/class_images; counted from each image's header, where the trainer also decodes them: a damaged
    one counts here and is generated again there), the grids' prompts, sampling.every_steps, the intermediate
    saves (a grid at each, copied where an every-N grid was made), the denoising steps and the
    guidance scale."""
    on, wanted = prior_preservation(cfg)
    missing = 0
    # num_class_images 0: every image of dreambooth.class_data, none generated (`sdplan train` requires them
    # there: require_class_images; recommend plans for a folder that may be on another machine)
    if on and wanted:
        from sdplan.errors import DatasetError
        from sdplan.trainer.dataset_scan import KohyaProjectError, scan

        try:
            folder = Path(expand_user(class_folder(cfg), "dreambooth.class_data"))
            found = (
                len(scan(folder, verify="header", setting="dreambooth.class_data").items)
                if folder.is_dir()
                else 0
            )
        except KohyaProjectError:
            raise  # the folder to name instead: said before any model loads
        except (
            DatasetError,
            UsageError,
            OSError,
        ):  # the trainer says what is wrong with it; planned as generated
            found = 0
        missing = max(0, wanted - found)
    return {
        "class_images_to_generate": missing,
        "sample_prompts": len(cfg.sampling.prompts),
        "sample_every_steps": cfg.sampling.every_steps,
        "sampling_steps": cfg.sampling.num_inference_steps,
        "guidance_scale": cfg.sampling.guidance_scale,
        "save_every_epochs": cfg.output.save_every_n_epochs,
        "save_every_steps": cfg.output.save_every_n_steps,
    }


def require_class_images(cfg: TrainConfig) -> None:
    """dreambooth.num_class_images 0 trains every image of dreambooth.class_data and generates none: a folder
    that holds none is refused here, before any model loads (the trainer said "dataset folder ... does not exist
    (give --dataset (data.path ...))" after loading it)."""
    from sdplan.errors import DatasetError
    from sdplan.trainer.dataset_scan import scan

    folder = Path(expand_user(class_folder(cfg), "dreambooth.class_data"))
    try:
        found = (
            len(scan(folder, verify="header", setting="dreambooth.class_data").items)
            if folder.is_dir()
            else 0
        )
    except DatasetError:
        found = 0
    if not found:
        where = "does not exist" if not folder.exists() else "holds no images"
        raise DatasetError(
            f"dreambooth.num_class_images 0 trains every image of dreambooth.class_data, but {folder} {where}",
            fix="set dreambooth.num_class_images to 1 or more (the base model generates them), or put class "
            "images there",
        )


def ema_refusal(cfg: TrainConfig, total_steps: int) -> tuple[str, str] | None:
    """(what, fix) where the run's EMA would never update: the loop updates it at every ema.update_every-th
    optimizer step (trainer/loop.py), so a run of fewer steps exported the EMA as the base it started from,
    the untrained model, without a word. None where it updates (or no EMA is kept)."""
    from sdplan.trainer.dataset_scan import count_of

    every = cfg.ema.update_every
    if not (cfg.ema.enabled and registry_method(cfg.method).ema) or every <= total_steps:
        return None
    return (
        f"ema.update_every {every}: this run trains {count_of(total_steps, 'optimizer step')}, so its EMA never "
        "updates and the exported EMA weights would be the untrained base model",
        f"set ema.update_every to {total_steps} or less (1: every step), or train more steps",
    )


def family_problems(cfg: TrainConfig, family: str | None) -> list[str]:
    """What ``cfg`` sets that ``family`` cannot train (the config's own model.family, or the family `sdplan
    train` found in the model's files before the launch): an SD3.5 / FLUX.1 resolution off their 16 px grid,
    a DDPM-only setting on their rectified flow."""
    problems = []
    if problem := flow_resolution_problem(cfg.data.resolution, family, buckets=cfg.data.buckets):
        problems.append(problem)
    if family in FLOW_FAMILIES:
        if cfg.training.min_snr_gamma:
            problems.append(
                f"training.min_snr_gamma: a weighting of the DDPM objective's timesteps; {family}'s rectified "
                "flow weighs its own; leave it out (null)"
            )
        if cfg.training.noise_offset:
            problems.append(
                f"training.noise_offset: an offset of the DDPM noise, not part of {family}'s rectified-flow "
                "objective; set it to 0"
            )
        if cfg.sampling.negative_prompt and registry_family(family).distilled_guidance:
            problems.append(
                f"sampling.negative_prompt: {family} samples with its distilled guidance, one pass without a "
                "negative prompt (FluxPipeline reads one only with true_cfg_scale); leave it out (null)"
            )
    return problems


def bucket_problems(data: DataConfig) -> list[str]:
    """Why the aspect-bucket settings make no buckets at ``data.resolution`` (a step above the resolution, a
    shortest side above the longest, given or by default), each with its fix, or []: the rules of
    :func:`sdplan.trainer.buckets.make_buckets`, stated once for a config file, `sdplan train` and `sdplan
    recommend` (the trainer's ValueError was a traceback in train and recommend --dataset)."""
    from sdplan.trainer.buckets import side_range

    res, step = data.resolution, data.bucket_step
    given_min, given_max = data.bucket_min_size, data.bucket_max_size
    if res < step:
        return [
            f"data.bucket_step: {step} is above data.resolution {res} (a bucket side is a whole number of steps); "
            f"set data.bucket_step to 64, or data.resolution to {step} or more"
        ]
    lo, hi = side_range(res, step=step, min_size=given_min, max_size=given_max)
    if hi >= lo:
        return []
    if given_max is not None and given_max < step:
        return [
            f"data.bucket_max_size: {given_max} is below data.bucket_step {step} (a bucket side is a whole number "
            f"of steps); set it to {step} or more"
        ]
    if given_min is not None and given_max is not None:
        return [
            f"data.bucket_min_size: {given_min} is above data.bucket_max_size {given_max}; set data.bucket_min_size "
            f"to {given_max} or less, or data.bucket_max_size to {given_min} or more"
        ]
    if given_min is not None:
        return [
            f"data.bucket_min_size: {given_min} is above the longest bucket side at data.resolution {res} ({hi}: "
            f"twice the resolution, data.bucket_max_size's default); set data.bucket_max_size to {given_min} or "
            f"more, or data.bucket_min_size to {hi} or less"
        ]
    return [
        f"data.bucket_max_size: {given_max} is below the shortest bucket side at data.resolution {res} ({lo}: "
        f"half the resolution, data.bucket_min_size's default); set data.bucket_min_size to {given_max} or less, "
        f"or data.bucket_max_size to {lo} or more"
    ]


def loader_notes(cfg: TrainConfig, family: str | None) -> list[str]:
    """What the tools that read a LoRA file leave out of this config's (SD 1.x, 2.x, SDXL): UNet targets kohya's
    loader drops (:data:`KOHYA_UNREAD_UNET`), and text-encoder attention A1111 skips unless all four projections
    are targets (:data:`A1111_MHA_PROJECTIONS`). Notes, not errors: the diffusers file and ComfyUI keep them."""
    if cfg.method != "lora" or family not in ("sd15", "sd21", "sdxl"):
        return []
    out = []
    unread = [t for t in cfg.lora.target_modules or () if KOHYA_UNREAD_UNET & set(t.strip().split("."))]
    if unread and cfg.output.save_kohya:
        out.append(
            f"lora.target_modules {', '.join(unread)}: kohya sd-scripts' LoRA loader has no module for "
            f"{'this layer' if len(unread) == 1 else 'these layers'} and drops {'its' if len(unread) == 1 else 'their'} "
            "weights without a warning (ComfyUI, A1111 and diffusers read them)"
        )
    if cfg.training.train_text_encoder and family in ("sd21", "sdxl") and cfg.output.save_kohya:
        named = {t.strip().rsplit(".", 1)[-1] for t in cfg.lora.text_encoder_target_modules}
        some = [p for p in A1111_MHA_PROJECTIONS if p in named]
        if some and len(some) < len(A1111_MHA_PROJECTIONS):
            which = "SDXL's second text encoder" if family == "sdxl" else "the text encoder"
            out.append(
                f"lora.text_encoder_target_modules has {', '.join(some)} without "
                f"{', '.join(p for p in A1111_MHA_PROJECTIONS if p not in some)}: A1111 applies LoRA to "
                f"{which}'s attention only with all four, so it skips {'this' if len(some) == 1 else 'these'} "
                "there (ComfyUI, kohya and diffusers read them)"
            )
    return out


def given_problems(cfg: TrainConfig, given: Collection[str] | None = None) -> list[str]:
    """Settings a run would ignore, said where settings are given (`sdplan train`, `sdplan recommend`), not in
    :func:`validate`: a run folder an older sdplan wrote so still resumes (it trained so, as it goes on).
    ``given``: the keys given again on a resume; then only the problems those keys are part of (None: all).
    - training.lr_warmup_steps with the constant scheduler: diffusers' get_scheduler drops num_warmup_steps for
      "constant" (optimization.py), so the run trains at the full rate from the first step; kohya refuses it;
    - training.full_half_weights on textual inversion: the trainer keeps bf16 weights for the full-weight recipes
      and a LoRA's matrices (runtime.trained_dtype, kohya --full_bf16); the embeddings stay fp32."""
    found: list[tuple[tuple[str, ...], str]] = []  # (the keys a problem is of, the problem)
    if cfg.training.lr_warmup_steps and cfg.training.lr_scheduler == "constant":
        found.append(
            (
                ("training.lr_scheduler", "training.lr_warmup_steps"),
                f"training.lr_warmup_steps: {cfg.training.lr_warmup_steps} with training.lr_scheduler constant, "
                "which has no warmup (the full rate from the first step); set "
                "training.lr_scheduler=constant_with_warmup, or training.lr_warmup_steps=0",
            )
        )
    if cfg.training.full_half_weights and cfg.method == "textual-inversion":
        found.append(
            (
                ("training.full_half_weights",),
                "training.full_half_weights: textual-inversion trains its token embeddings in fp32 (no full bf16 "
                "mode); it applies to methods lora, dreambooth and finetune; set it to false",
            )
        )
    return [text for keys, text in found if given is None or set(keys) & set(given)]


# the parts of a ``plan:`` record (what `sdplan recommend --out` writes: planner.result_dict's) that sdplan reads
# back, and the step counts `sdplan train` compares with the run's (launcher.drop_a_stale_plan)
PLAN_RECORD_PARTS = ("plan", "steps", "estimate", "hardware")
PLAN_RECORD_COUNTS = ("epochs", "total_steps", "images_per_epoch")


def plan_record_problems(record: dict[str, Any] | None) -> list[str]:
    """What is malformed in a ``plan:`` record (a hand edit: ``plan: {steps: x}`` was a traceback in `sdplan
    train`), each with the fix, or []."""
    problems = []
    fix = "remove the plan: section (it only records what `sdplan recommend --out` planned)"
    for part in PLAN_RECORD_PARTS:
        value = (record or {}).get(part)
        if value is not None and not isinstance(value, dict):
            problems.append(f"plan.{part}: must be a mapping or null, got {value!r}; {fix}")
    steps = (record or {}).get("steps")
    for count in PLAN_RECORD_COUNTS if isinstance(steps, dict) else ():
        value = steps.get(count)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            problems.append(f"plan.steps.{count}: must be a whole number >= 0 or null, got {value!r}; {fix}")
    return problems


def _cross_checks(cfg: TrainConfig, errors: list[str]) -> None:
    ds = cfg.distributed.deepspeed
    errors += plan_record_problems(cfg.plan)

    # where the trainer reads it (a LoRA training its text encoders): checked again on the model's modules
    # (runtime.add_lora_adapters), here before the models load
    embedding = [
        t for t in cfg.lora.text_encoder_target_modules if t.strip().rsplit(".", 1)[-1] in EMBEDDING_MODULES
    ]
    reads = cfg.method == "lora" and cfg.training.train_text_encoder
    if reads and not all(t.strip() for t in cfg.lora.text_encoder_target_modules or [""]):
        errors.append(
            "lora.text_encoder_target_modules: must name at least one module where the text encoders train "
            "(the default: q_proj, k_proj, v_proj, out_proj)"
        )
    if reads and embedding:
        errors.append(
            f"lora.text_encoder_target_modules: {', '.join(embedding)} is an embedding layer, which no kohya, "
            "A1111 or ComfyUI LoRA file holds (LoRA adapts Linear layers: CLIP's q_proj, k_proj, v_proj, "
            "out_proj, fc1, fc2; T5's q, k, v, o, wi_0, wi_1, wo)"
        )
    # the bucket settings make buckets: checked with the values given (one refused is its default here)
    if cfg.data.buckets and not any(e.startswith(("data.resolution", "data.bucket")) for e in errors):
        errors += bucket_problems(cfg.data)
    if (
        cfg.training.full_half_weights
        and cfg.training.precision != "bf16"
        and cfg.method != "textual-inversion"
    ):
        errors.append("training.full_half_weights: needs training.precision bf16 (fp16 weights underflow)")
    if ds is not None and cfg.training.train_text_encoder:
        errors.append(
            "distributed.deepspeed: DeepSpeed trains one model; set training.train_text_encoder to false "
            "or remove distributed.deepspeed"
        )
    if ds is not None and cfg.method == "textual-inversion" and cfg.model.family == "sdxl":
        errors.append("distributed.deepspeed: textual inversion on SDXL trains two text encoders; remove it")
    if ds is not None and cfg.training.full_half_weights:
        errors.append(
            "training.full_half_weights: DeepSpeed keeps fp32 master weights of its own (ZeRO's optimizer), so "
            "there is no full bf16 training under it; set it to false or remove distributed.deepspeed"
        )
    if ds is not None and cfg.memory.optimizer == "adamw8bit":
        errors.append("memory.optimizer: adamw8bit (bitsandbytes) does not combine with DeepSpeed; use adamw")
    if ds is not None and ds.offload_optimizer and cfg.memory.optimizer == "adafactor":
        # accelerate's prepare hands DeepSpeed its CPU Adam in place of any other optimizer where the optimizer
        # is offloaded (accelerator.py: map_pytorch_optim_to_deepspeed; Adafactor becomes Adam, adamw_mode off,
        # at Adafactor's learning rate): the run would train with another optimizer than the one set
        errors.append(
            "memory.optimizer: adafactor with distributed.deepspeed.offload_optimizer: the offload runs "
            "DeepSpeed's CPU Adam in Adafactor's place (accelerate swaps it in); use adamw, or set "
            "distributed.deepspeed.offload_optimizer=false"
        )
    if (
        cfg.method == "dreambooth"
        and cfg.dreambooth.with_prior_preservation
        and not cfg.dreambooth.class_prompt
    ):
        errors.append("dreambooth.class_prompt: required when with_prior_preservation is true")
    if (
        cfg.method == "dreambooth"
        and cfg.dreambooth.with_prior_preservation
        and cfg.dreambooth.num_class_images == 0
        and not cfg.dreambooth.class_data
    ):
        # 0 means every image of dreambooth.class_data (data.build_class_dataset); with no folder there are none
        errors.append(
            "dreambooth.num_class_images: 0 with with_prior_preservation true and no dreambooth.class_data "
            "leaves no class images to train beside yours; set it to 1 or more (100 is usual), give "
            "dreambooth.class_data a folder of class images, or set with_prior_preservation to false"
        )
    errors += family_problems(cfg, cfg.model.family)
    if cfg.data.caption_dropout and cfg.method == "textual-inversion":
        errors.append(
            "data.caption_dropout: textual inversion learns its token from the captions that hold it; an empty "
            "caption trains nothing; set it to 0"
        )
    # settings of one method given to another: its trainer would ignore them, and the plan charged their memory
    # a switch on that the method never reads (the key=value settings under such a switch: _unread_by too)
    for switch in ("dreambooth.with_prior_preservation", "ema.enabled", "training.train_text_encoder"):
        section, name = switch.split(".")
        if getattr(getattr(cfg, section), name) and (why := _unread_by(cfg.method, switch)):
            errors.append(f"{switch}: {why}; set it to false")
    if cfg.memory.cache_text_encoder_outputs and cfg.training.train_text_encoder:
        errors.append(
            "memory.cache_text_encoder_outputs: cannot cache outputs of a text encoder being trained"
        )
    if cfg.memory.cache_text_encoder_outputs and cfg.method == "textual-inversion":
        errors.append(
            "memory.cache_text_encoder_outputs: textual inversion trains the text embeddings; turn it off"
        )
    if cfg.method == "textual-inversion" and cfg.textual_inversion.token == cfg.textual_inversion.init_token:
        errors.append("textual_inversion.token: must differ from init_token")


# settings that act only while a switch is on: given as key=value with it off, the run would silently do without
# them (ema.device=gpu alone was echoed as "pinned: ema.enabled=false")
SWITCHED_BY = {
    "ema.decay": "ema.enabled",
    "ema.update_every": "ema.enabled",
    "ema.device": "ema.enabled",
    "dreambooth.class_prompt": "dreambooth.with_prior_preservation",
    "dreambooth.class_data": "dreambooth.with_prior_preservation",
    "dreambooth.num_class_images": "dreambooth.with_prior_preservation",
    "dreambooth.prior_loss_weight": "dreambooth.with_prior_preservation",
    "training.text_encoder_learning_rate": "training.train_text_encoder",
    "memory.cache_latents_to_disk": "memory.cache_latents",
}
# a setting given as key=value that turns its switch on as well, unless the switch is given too (kohya
# train_util.verify_training_args: "cache_latents_to_disk is enabled, so cache_latents is also enabled"): the
# planner would otherwise be free to plan without the switch
TURNS_ON = {"memory.cache_latents_to_disk": "memory.cache_latents"}


def implied_settings(overrides) -> list[str]:
    """The key=value settings with the switches they turn on (:data:`TURNS_ON`) added where not given."""
    items = list(overrides)
    given = _given_values(items)
    for key, switch in TURNS_ON.items():
        if given.get(key) is True and switch not in given:
            items.append(f"{switch}=true")
    return items


def _given_values(overrides) -> dict[str, Any]:
    """The sdplan.yaml keys that key=value settings set and their values as YAML reads them (None where it
    cannot), a whole section (``ema={device: gpu}``) as its keys."""
    given: dict[str, Any] = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        key = key.strip()
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = None
        if "." not in key and isinstance(value, dict):
            given.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            given[key] = value
    return given


def switched_setting_problems(cfg: TrainConfig, overrides) -> list[str]:
    """The key=value settings (``overrides``) whose switch (:data:`SWITCHED_BY`) is off in ``cfg``: one problem
    per switch, with the fix, for ``cfg``'s method (where that method never reads them, the fix is to drop
    them). A config file's own values are not: a switch turned off there may keep its settings for later."""
    keys = list(_given_values(overrides))  # a whole section (ema={device: gpu}) as its keys
    off: dict[str, list[str]] = {}
    for key in keys:
        switch = SWITCHED_BY.get(key)
        if switch is not None and not getattr(getattr(cfg, switch.split(".")[0]), switch.split(".")[1]):
            off.setdefault(switch, []).append(key)
    problems = []
    for switch, given in off.items():
        acts, them = ("acts", "it") if len(given) == 1 else ("act", "them")
        unread = _unread_by(cfg.method, switch)
        if unread:
            problems.append(f"{', '.join(given)}: {unread}; drop {them}")
            continue
        state = "is set false" if switch in keys else "is off"
        problems.append(
            f"{', '.join(given)}: {acts} only with {switch}=true, which {state}; add {switch}=true or drop {them}"
        )
    return problems


def _unread_by(method: str, switch: str) -> str | None:
    """Why ``method`` never reads the settings under ``switch``, whatever its value; None when it does."""
    if method not in METHODS:
        return None
    if switch == "ema.enabled" and not registry_method(method).ema:
        keeps = ", ".join(m.name for m in METHOD_LIST if m.ema)
        return f"an EMA of the weights is kept by method {keeps}, not {method}"
    if switch == "dreambooth.with_prior_preservation" and method != "dreambooth":
        return f"only method dreambooth trains with class images, not {method}"
    if switch == "training.train_text_encoder" and method == "textual-inversion":
        return "textual inversion trains only the new token embeddings, at training.learning_rate"
    return None


def method_setting_problems(method: str, keys, *, resume: bool = False) -> list[str]:
    """The key=value settings (their sdplan.yaml ``keys``) that only another method's recipe reads
    (:attr:`sdplan.registry.Method.sections`: lora.* is the LoRA recipe's): ``method`` would train without them,
    so each section given is a problem, with the fix (as ema.enabled is for a method that keeps no EMA). A config
    file's own sections are not: every written sdplan.yaml holds them all. ``resume``: the run's method stays
    (--resume refuses another), so the fix is to drop them, not --method."""
    problems = []
    for m in METHOD_LIST:
        if m.name == method:
            continue
        for section in m.sections:
            given = [k for k in dict.fromkeys(keys) if k == section or k.startswith(section + ".")]
            if given:
                them = "it" if len(given) == 1 else "them"
                fix = (
                    f"--resume continues the run's {method}: drop {them}"
                    if resume
                    else f"drop {them} or use --method {m.name}"
                )
                problems.append(
                    f"{', '.join(given)}: {m.label} settings ({section}.*) apply to --method {m.name} only, "
                    f"not {method}; {fix}"
                )
    return problems


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = get_origin(tp)
    if origin is None:
        if tp is float:
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        if tp is int:
            return isinstance(value, int) and not isinstance(value, bool)
        if tp is type(None):
            return value is None
        return isinstance(value, tp)
    args = get_args(tp)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _type_ok(k, args[0]) and _type_ok(v, args[1]) for k, v in value.items()
        )
    # Union (X | None)
    return any(_type_ok(value, a) for a in args)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is None:
        return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
            tp, getattr(tp, "__name__", str(tp))
        )
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a mapping"
    return " or ".join(_type_name(a) for a in args) + " or null"


def _build(kind: type, data: Any, prefix: str, errors: list[str]):
    if not isinstance(data, dict):
        errors.append(f"{prefix.rstrip('.')}: must be a mapping")
        return None
    hints = get_type_hints(kind)
    names = {f.name: f for f in fields(kind)}
    unknown = []  # keys with no near name: said together, with the known names once
    for key in data:
        if key not in names:
            close = [n for n in names if n.startswith(str(key)[:3])]
            # the same name in another section: `optimizer=prodigy` is memory.optimizer
            elsewhere = [
                k for k in _leaf_keys() if k.rsplit(".", 1)[-1] == str(key) and k != f"{prefix}{key}"
            ]
            if close or elsewhere:
                errors.append(
                    f"{prefix}{key}: unknown key (did you mean {' or '.join(elsewhere or [prefix + close[0]])}?)"
                )
            else:
                unknown.append(f"{prefix}{key}")
    if unknown:
        keys = "unknown keys" if len(unknown) > 1 else "unknown key"
        errors.append(f"{', '.join(unknown)}: {keys} (known: {', '.join(names)})")
    kwargs: dict[str, Any] = {}
    for name in names:
        path = f"{prefix}{name}"
        tp = hints[name]
        sub = _dataclass_in(tp)
        if name not in data:
            continue  # default applies
        value = _coerce_float(data[name], tp)
        if sub is not None and value is not None:
            built = _build(sub, value, path + ".", errors)
            if built is not None:
                kwargs[name] = built
            continue
        if sub is not None and value is None:
            if type(None) in get_args(tp):
                kwargs[name] = None
            else:
                errors.append(f"{path}: must be a mapping")
            continue
        if not _type_ok(value, tp):
            errors.append(
                _mapping_item_error(path, value, tp) or f"{path}: must be {_type_name(tp)}, got {value!r}"
            )
            continue
        if tp is float or float in get_args(tp):
            value = float(value) if isinstance(value, int) and not isinstance(value, bool) else value
        rule = _RULES.get(path)
        if rule is not None and not rule[0](value):
            errors.append(f"{path}: {rule[1]}, got {value!r}")
            continue
        if (where := _not_finite_at(value, path)) is not None:
            # .inf / 1e400: no setting means it, and --json printed it as Infinity; named where it is, with its
            # value only (a `plan:` record with one printed the whole record on one line)
            errors.append(f"{where[0]}: must be a finite number, got {where[1]!r}")
            continue
        kwargs[name] = value
    try:
        return kind(**kwargs)
    except TypeError as e:  # a required field without default; not expected in this schema
        errors.append(f"{prefix.rstrip('.') or 'config'}: {e}")
        return None


def _not_finite_at(value: Any, path: str) -> tuple[str, float] | None:
    """(where, the number) of the first float that is infinite or NaN in ``value`` (itself, a list's items
    as path[i], a mapping's values as path.key), or None where there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    items: Any = ()
    if isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    for where, v in items:
        if (found := _not_finite_at(v, where)) is not None:
            return found
    return None


def _mapping_item_error(path: str, value: Any, tp: Any) -> str | None:
    """What is wrong in the mapping ``value`` for the ``dict[K, V]`` setting ``tp`` (a key or a value of
    another type: score_bonus {a: null} said "must be a mapping", which it is), or None where that is not it."""
    if get_origin(tp) is not dict or not isinstance(value, dict):
        return None
    key_type, value_type = get_args(tp)
    for k, v in value.items():
        if not _type_ok(k, key_type):
            return f"{path}: its key {k!r} must be {_type_name(key_type)} (write it in quotes)"
        if not _type_ok(v, value_type):
            return f"{path}.{k}: must be {_type_name(value_type)}, got {v!r}"
    return None


# A number as written in decimal or e-notation: what YAML 1.1 reads as text only for want of a dot (`3e-4`, `1E5`).
# Not Python's wider float() (`1_0e-4` read as 0.001, `infinity`, `nan`): YAML reads those as text too, and
# they are no number a user meant here.
_E_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _number_text(value: Any) -> Any:
    """``value`` as a float where it is text YAML 1.1 left unread (:data:`_E_NUMBER`); else as it is."""
    if isinstance(value, str) and _E_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _coerce_float(value: Any, tp: Any) -> Any:
    """YAML 1.1 reads `1e-4` (no dot) as a string; accept it where a number is expected: a float setting (or
    float | None), and the items of a list of floats or the values of a mapping to floats
    (data.metadata.score_buckets: [1e-4, 0.5])."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is list and args == (float,) and isinstance(value, list):
        return [_number_text(v) for v in value]
    if origin is dict and args[1:] == (float,) and isinstance(value, dict):
        return {k: _number_text(v) for k, v in value.items()}
    if origin not in (list, dict) and (tp is float or float in args):
        return _number_text(value)
    return value


@functools.cache
def _leaf_keys() -> tuple[str, ...]:
    """Every dotted key of sdplan.yaml that holds a value (``memory.optimizer``, ``data.metadata.keep_tags``)."""
    out: list[str] = []

    def walk(kind: type, prefix: str) -> None:
        hints = get_type_hints(kind)
        for f in fields(kind):
            sub = _dataclass_in(hints[f.name])
            if sub is not None:
                walk(sub, f"{prefix}{f.name}.")
            else:
                out.append(f"{prefix}{f.name}")

    walk(TrainConfig, "")
    return tuple(out)


def _dataclass_in(tp: Any) -> type | None:
    if is_dataclass(tp):
        return tp
    for a in get_args(tp):
        if is_dataclass(a):
            return a
    return None


# -- overrides and files --------------------------------------------------------------------------------


def override_keys(overrides) -> list[str]:
    """The sdplan.yaml keys that `key.path=value` overrides set, in their order, read as :func:`apply_overrides`
    reads them."""
    return [item.partition("=")[0].strip() for item in overrides]


def given_settings(overrides) -> dict[str, str]:
    """The `key=value` settings as key -> the value as typed (the last of a key given twice), keys read as
    :func:`override_keys` reads them."""
    return dict(zip(override_keys(overrides), (item.partition("=")[2] for item in overrides), strict=True))


def setting_place(key: str, raw: Any, what: str) -> str:
    """What a `key=raw` setting (or a flag's value for ``key``) names, to tell whether two say the same: the
    value as :func:`apply_overrides` reads it, a local path made absolute (``what``: the flag or key named where
    it is a link that loops), a hub id as it is."""
    value = setting_value(key, str(raw))
    if key in PATH_KEYS and not (key == "checkpoints.resume" and value in (None, "latest")):
        return _placed(key, str(value), what)
    return str(value)


def _setting_type(key: str) -> Any:
    """The type of the sdplan.yaml setting ``key`` (a dotted path), or None where it names none."""
    kind: Any = TrainConfig
    for part in key.split("."):
        sub = _dataclass_in(kind) if not is_dataclass(kind) else kind
        if sub is None or part not in {f.name for f in fields(sub)}:
            return None
        kind = get_type_hints(sub)[part]
    return kind


def _override_value(key: str, raw: str) -> tuple[Any, str | None]:
    """An override's value, and the problem with it (None: none). Values are YAML (1e-4, true, null, [a, b]),
    but a text setting takes the text as typed (a prompt like `sks dog, masterpiece: 1.2` or `#sks` is no YAML
    mapping or comment), unless it is quoted or null (empty, `null`, `~`: the setting's null, which the
    validation refuses where it takes none). A list is written as one, `[a, b]`."""
    tp = _setting_type(key)
    text = raw.strip()
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    args = set(get_args(tp)) if tp is not None else set()
    if (tp is str or args == {str, type(None)}) and not quoted:
        if text == "" and key in _RULES and type(None) not in args:
            return "", None  # its rule names the choices (training.device=: "must be one of auto, cpu, cuda")
        return (None if text in ("", "null", "~") else text), None
    try:
        value = yaml.safe_load(raw) if text else None
    except yaml.YAMLError:
        return raw, None
    if tp is not None:  # YAML 1.1 reads 3e-4 (no dot) as text: the number it is (in a list of them too)
        value = _coerce_float(value, tp)
    listed = tp == list[str] or list[str] in args  # lora.target_modules: a list or null
    if listed and isinstance(value, str):  # a comma in it may separate items or be part of one
        return (
            value,
            f"{key}: takes a list: write it as {key}='[first, second]' (quote an item that holds ', ')",
        )
    if listed and isinstance(value, list) and not all(isinstance(v, str) for v in value):
        return value, (
            f"{key}: an item is not text as YAML reads it ({next(v for v in value if not isinstance(v, str))!r}); "
            f'quote the items, e.g. {key}=\'["a cat: 1.2", "a dog, b"]\''
        )
    return value, None


def setting_value(key: str, raw: str) -> Any:
    """The value a `key=raw` setting gives ``key``, as :func:`apply_overrides` reads it."""
    value, problem = _override_value(key, raw)
    if problem:
        raise ConfigError("key=value settings", [problem])
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.path=value` overrides (:func:`_override_value`); returns a copy."""
    out = copy.deepcopy(data)
    errors: list[str] = []
    split: list[
        str
    ] = []  # the first key=value the shell split at its spaces, with the words that followed it
    after_setting: list[str] | None = None
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append(f"{item!r}: an override is key=value, e.g. training.batch_size=2")
            if after_setting is not None:
                after_setting.append(item)
                if not split:
                    split = after_setting
            continue
        after_setting = [item]
        value, problem = _override_value(key, raw)
        if problem:
            errors.append(problem)
            continue
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                errors.append(f"{key}: {part} is not a section")
                break
            node = node[part]
        else:
            node[parts[-1]] = value
    if errors:
        fix = None
        if split:  # `key=sks dog, masterpiece` unquoted: the words after the first space arrive on their own
            fix = f"a value with spaces must be quoted, as one argument: {_shell_quoted(' '.join(split))}"
        raise ConfigError("overrides", errors, fix=fix)
    return out


def _shell_quoted(text: str) -> str:
    """``text`` as one shell argument, in double quotes where that keeps it as typed ("key=sks dog, x")."""
    return f'"{text}"' if not any(c in text for c in '"$`\\!') else shlex.quote(text)


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``top`` over ``base`` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def link_loops(path: Path) -> bool:
    """Whether ``path`` is, or is under, a symbolic link that loops (``ln -s lp lp``): Path.resolve() raised
    RuntimeError on it (a traceback), and exists() says it is not there. A link to what is not made yet is not."""
    try:
        path.resolve(strict=True)
    except FileNotFoundError:
        return False
    except RuntimeError:  # Python < 3.13
        return True
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def expand_user(path: str | Path, what: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded; a user this machine does not have is one UsageError
    naming ``what`` (Path.expanduser raised RuntimeError; left as it is, ``~typo/run`` became a folder named
    ``~typo`` here, as a shell leaves it)."""
    text = str(path)
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        seps = os.sep + (os.altsep or "")
        user = re.split(f"[{re.escape(seps)}]", text[1:], maxsplit=1)[0]
        if not user:
            raise UsageError(f"{what} {text}: no home folder to put for ~ (HOME is not set)", fix="set HOME")
        raise UsageError(
            f"{what} {text}: this machine has no user '{user}' for its ~{user}",
            fix="give the path without ~, or ~/... for your own home folder",
        )
    return expanded


def class_folder(cfg: TrainConfig) -> str:
    """The folder of DreamBooth's class images: dreambooth.class_data, else output.dir/class_images (where the
    trainer generates the ones it lacks)."""
    return cfg.dreambooth.class_data or str(Path(cfg.output.dir) / "class_images")


def absolute(path: str | Path, what: str) -> Path:
    """``path`` with ~ expanded (:func:`expand_user`), made absolute through its links, as a run's sdplan.yaml names
    it; a symbolic link that loops is one UsageError naming ``what`` (--out, data.path, ...)."""
    p = Path(expand_user(path, what))
    if link_loops(p):
        where = "is" if p.is_symlink() else "is under"
        raise UsageError(
            f"{what} {p} {where} a symbolic link that loops",
            fix=f"remove the link, or give {what} another path",
        )
    return p.resolve()


def absolute_if_local(path: str) -> str:
    """``path`` absolute where it names a local file or folder; as it is otherwise (a hub id)."""
    p = Path(os.path.expanduser(path))
    return str(p.resolve()) if p.exists() else path


# The settings that name local files or folders (model.path: where it is one, else a hub id).
PATH_KEYS = (
    "model.path",
    "model.config_dir",
    "data.path",
    "dreambooth.class_data",
    "output.dir",
    "checkpoints.resume",  # the checkpoint a new run starts from ("latest": the run's own newest, as it is)
)


def _placed(key: str, value: str, what: str | None = None) -> str:
    """A path setting's value made absolute; model.path as it is where no such local path exists (a hub id), and
    model.config_dir where it reads as a hub id and no such folder exists: the one line refusing it there names
    it as the user gave it, not as a folder under the current one that they never typed."""
    if key == "model.path":
        return absolute_if_local(value)
    if key == "model.config_dir" and not Path(os.path.expanduser(value)).exists():
        from sdplan.trainer.models import looks_like_hub_id

        if looks_like_hub_id(value):
            return value
    return str(absolute(value, what or key))


def absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the paths of :data:`PATH_KEYS` absolute, as the current folder reads them: a run's
    sdplan.yaml then names the same files from wherever it is resumed (a relative name there was looked up from
    the new folder: another dataset, or the model on the hub). Values of the wrong type stay for validation."""
    out = copy.deepcopy(data)
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        node = out.get(section)
        if not isinstance(node, dict) or not isinstance(node.get(name), str) or not node[name].strip():
            continue
        if key == "checkpoints.resume" and node[name].strip() == "latest":
            continue
        node[name] = _placed(key, node[name])
    return out


def require_file(path: Path) -> None:
    """ConfigError unless ``path`` is a file: a run folder given as --config points at its sdplan.yaml."""
    if path.is_dir():
        hint = f" (give {path / 'sdplan.yaml'})" if (path / "sdplan.yaml").is_file() else ""
        raise ConfigError(str(path), [f"a folder, not a config file{hint}"])
    if not path.is_file():
        raise ConfigError(str(path), ["file not found (write one with `sdplan recommend --out DIR`)"])


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last one silently: a second
    ``training:`` section would drop every setting of the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [k for k, _ in node.value]
        if not any(k.tag == "tag:yaml.org,2002:merge" for k in keys):  # `<<:` merges may override on purpose
            seen: set[Any] = set()
            for key_node in keys:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} given twice (keep one)", key_node.start_mark
                        )
                    seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: Path) -> Any:
    """A user's config file as data (keys given twice refused); ConfigError when missing or not YAML."""
    require_file(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(str(path), [yaml_problem(e)]) from None
    return old_default_read(data)


def _pinned_targets_sorted(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with a pinned lora.target_modules sorted, each once, as :func:`validate` keeps it: a file sdplan
    writes never holds the old default's order, which :func:`old_default_read` reads as null."""
    lora = data.get("lora")
    targets = lora.get("target_modules") if isinstance(lora, dict) else None
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        data = {**data, "lora": {**lora, "target_modules": sorted(set(targets))}}
    return data


def old_default_read(data: Any) -> Any:
    """Config data as written: lora.target_modules [to_k, to_q, to_v, to_out.0], in that order, is null (the
    family's default), the default every sdplan.yaml held before null meant it, and what it trained there on
    every family (an SD3.5 / FLUX.1 LoRA their LORA_TARGETS); sdplan now writes a pinned list sorted
    (:func:`validate`), never in that order. A key=value setting is read as it is (a pin of those four)."""
    lora = data.get("lora") if isinstance(data, dict) else None
    if isinstance(lora, dict) and "target_modules" in lora:
        targets = legacy_lora_targets(lora["target_modules"])
        if targets is not lora["target_modules"]:
            data = {**data, "lora": {**lora, "target_modules": targets}}
    return data


def load(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read sdplan.yaml, apply overrides, validate (every error at once)."""
    p = Path(path)
    data = read_config_file(p) or {}
    if isinstance(data, dict) and overrides:
        data = apply_overrides(data, overrides)
    return validate(data, source=str(p))


def yaml_problem(e: Exception) -> str:
    """A YAML (or read) error as one phrase with the line and column where the parser stopped."""
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.YAMLError) and mark is not None:
        what = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"not valid YAML ({first})"


def to_yaml(data: dict[str, Any] | TrainConfig, header: str | None = None) -> str:
    if isinstance(data, TrainConfig):
        data = data.to_dict()
    data = _pinned_targets_sorted(data)
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True)
    if header:
        # a comment cannot escape: a character YAML does not allow in a file (a lone surrogate, as Python reads a
        # Latin-1 file name; DEL; other controls) is written as its escape's text, not left to make the file
        # unreadable (YAML's reader refuses the whole stream) or fail its UTF-8 encoding
        header = _NOT_YAML_PRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), header)
        body = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body
    return body


# the characters YAML 1.1 allows in a stream (PyYAML's reader.NON_PRINTABLE, and line breaks): anything else
_NOT_YAML_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, but a text holding a character it mishandles is double-quoted: it writes NEL (U+0085)
    raw in a single-quoted scalar, which reads back as a space (a path with one then named another folder)."""


def _represent_text(dumper: yaml.SafeDumper, text: str):
    style = '"' if _NOT_YAML_PRINTABLE.search(text) or "\x85" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_text)


def yaml_quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar that reads back as the same string: what JSON escapes for YAML
    does not (json.dumps writes a character beyond the BMP as a surrogate pair, which YAML reads as two lone
    surrogates; with ensure_ascii off it leaves a lone surrogate, NEL or DEL raw, which YAML refuses or folds)."""
    quoted = yaml.safe_dump(text, default_style='"', allow_unicode=True, width=math.inf)
    return quoted.removesuffix("\n...\n").rstrip("\n")
