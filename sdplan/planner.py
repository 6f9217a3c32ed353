"""The planner: hardware + profiles + request -> the fastest training plan that fits (pure; no I/O, no torch).

Memory model (bytes per GPU), each term from the model family's real parameter counts and the activation
coefficients computed on the meta device (profiles/activations.yaml):

- trainable weights: fp32 master copies (4 B) under mixed precision, 2 B with fully-half weights; gradients the
  same; optimizer state from each implementation's state tensors (OPTIMIZER_STATE: AdamW 2 copies, Prodigy 4,
  D-Adaptation 3, Lion 1, bitsandbytes 8-bit 1 byte per state), Adafactor the factored second moment computed
  from the real tensor shapes (no first moment: kohya/transformers defaults);
- LoRA: rank x the per-rank parameter count of its target set (attention projections; kohya's
  Transformer2DModel linears; + LoCon's ResNet convs; text-encoder attention or attention + MLP), counted on
  meta from the layer shapes, and that set's saved activations;
- frozen weights: 2 B under fp16/bf16, 4 B in fp32 (the UNet for LoRA / textual inversion, text encoder(s)
  unless their outputs are cached, the VAE unless latents are cached);
- EMA: a fp32 copy of the UNet on the GPU (or in host RAM);
- autocast's half copies of fp32 trainable weights, held from forward to backward;
- activations: the UNet's saved tensors for batch x latent pixels (+ the recomputed segment with gradient
  checkpointing), the trained text encoder's, times a calibrated factor for the backward transient;
- with zero_grad(set_to_none=True) the gradients exist only from the backward on: the peak holds
  max(activations + half copies, gradients + step temporaries or the last recomputed segment), not both;
- the AdamW (foreach) step transient, CUDA context and allocator overhead (calibrated);
- DeepSpeed ZeRO-2/1 with optimizer offload: the weights + reduction buckets on the GPU in the training dtype, and
  P x max(4G, 16) x 1.5 bytes in host RAM (DeepSpeed's own estimator).

Time model (roofline-style sum): the UNet / VAE / text-encoder FLOPs (counted on meta, activations.yaml) over
the GPU's measured torch.matmul rate where one was published (else its dense half-precision rating) times an
efficiency fitted on the published speed points, plus the bytes the bandwidth-bound ops move (counted on meta)
over the memory bandwidth, plus the optimizer step's traffic; gradient checkpointing +25%; DeepSpeed offload: the
gradients' copy to the host each micro-step, CPU Adam and the weights' copy back each optimizer step;
multi-GPU: the gradient all-reduce over the interconnect once per optimizer step, with a link efficiency
fitted on Puget's 2x RTX 4090 observations. A measured point for the same GPU and settings (local profile
store) or a published one is used directly.

Why one module of ~2,100 lines: the memory model, the time model, the calibration and the search share their
constants and are checked together (benchmarks/planner_accuracy.py); the configuration searched over is
:class:`sdplan.settings.Settings`, step counts are :func:`sdplan.steps.plan_steps`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NamedTuple

from sdplan import registry
from sdplan.config import SamplingConfig
from sdplan.errors import UsageError
from sdplan.extras import install_hint
from sdplan.machine import GTX16_FP16_NAN_SOURCES, fp16_gives_nan
from sdplan.probe.snapshot import build_vendor, version_tuple  # doctor's rules judge the GPUs it drives
from sdplan.profiles import GiB, GPUSpec, HostMeasurement, MethodPoint, ModelSpec, Profiles
from sdplan.registry import FULL_METHODS, METHODS
from sdplan.settings import (
    CONFIG_KEYS,
    DEEPSPEED_BUCKET_ELEMENTS,
    OFFLOAD,
    SHARDED,
    Settings,
    deepspeed_reduce_buckets,
    describe,
    zero_label,
)
from sdplan.steps import (
    Steps,
    bucketed_batches,
    intermediate_steps,
    largest_batch,
    plan_steps,
    repeated_batches,
    repeated_batches_text,
)
from sdplan.trainer.blockswap import support_problem as swap_problem  # the trainer's rule (pure, no torch)
from sdplan.trainer.dataset_scan import count_of as count_text
from sdplan.trainer.quantize import (
    NF4_MIN_CC,
    install_needed,  # what a quantized base needs installed (pure, no torch)
)
from sdplan.trainer.quantize import QUANTIZED as QUANTIZED_BASES

# Settings.__post_init__ normalises these fields only (LoRA's, by the method, and gpu_ids to a tuple)
_NORMALISED_FIELDS = frozenset(
    ("method", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "gpu_ids")
)
_SETTINGS_FIELDS = frozenset(f.name for f in fields(Settings))


def _with(s: Settings, **changes: Any) -> Settings:
    """``dataclasses.replace(s, **changes)``, several times faster: a plan's search asks for ~35,000 such
    variants (the one-GPU step, the step with cached latents, ...) and the generic replace, which walks the
    fields and runs ``__init__`` and ``__post_init__`` again, was a fifth of a plan's time. The same object
    results: the other fields are copied as they are, and ``__post_init__`` would leave them so, as it changes
    none of the fields given here (a change to one it normalises goes through ``replace``)."""
    if not changes.keys() <= _SETTINGS_FIELDS or changes.keys() & _NORMALISED_FIELDS:
        return replace(s, **changes)
    new = object.__new__(Settings)
    new.__dict__.update(s.__dict__)
    new.__dict__.update(changes)
    return new


def _settings_key(s: Settings) -> tuple:
    """A hashable stand-in for ``s`` (Settings is not hashable: ``deepspeed`` is a dict), for the memos of pure
    functions of it. The values' types are in it too: 16 and 16.0 compare equal, but a result computed from one
    could be written differently (an int, a float) than one computed from the other."""
    values = tuple(s.__dict__.values())  # in field order: __init__ sets them so, _with copies them so
    if s.deepspeed is not None:  # the one dict (lora_targets and gpu_ids are tuples: __post_init__)
        values = tuple(repr(v) if isinstance(v, dict) else v for v in values)
    return values + tuple(map(type, values))


# bounds each memo below (~830 bytes an entry: ~40 MB each at most): a test session plans thousands of times
# with one Profiles object; one plan asks for up to ~20,000 settings (FLUX.1 on 8 GPUs)
_MEMO_ENTRIES = 50_000


def _memo(table: dict, key: tuple, compute: Callable[[], Any]) -> Any:
    """``table[key]``, computed on first use; the table is emptied when full (the entries are only caches)."""
    if key in table:
        return table[key]
    if len(table) >= _MEMO_ENTRIES:
        table.clear()
    table[key] = value = compute()
    return value


# -- calibration constants (fitted with benchmarks/planner_accuracy.py against profiles/methods) ----------
ACTIVATION_FACTOR = 1.5  # saved tensors -> peak incl. gradient buffers of the backward pass
# the same under DeepSpeed, for the UNets: accelerate runs no autocast there (Accelerator.__init__ leaves
# native_amp False for DistributedType.DEEPSPEED, accelerate 1.15; DeepSpeed trains the half weights itself), so
# the fp32 outputs of autocast's norm and softmax ops, part of ACTIVATION_FACTOR, are not made.
# Least squares over the peaks of sdplan's own ZeRO-2 steps on an H100 (profiles/methods/finetune.yaml, points
# bench-...-zero2-*: SDXL at 512 and 1024 px, batch 1-8, and SD1.5 at 512 px, batch 1-16, with optimizer
# offload, 2026-11-27), where x1.5 put them 13-35% high, growing with the batch
DEEPSPEED_ACTIVATION_FACTOR = 1.05
# the same for the transformer families (SD3.5 / FLUX.1), per model: least squares over the peaks of its H100 bench
# points (profiles/methods/lora.yaml, 2026-11-26; x1.5 over-predicted them by up to 34%, growing with the batch).
# One factor for the three, x1.13 (kept for a model without bench peaks), left SD3.5 Large's 8 peaks 6.1% under
# (median); each its own: FLUX.1 [dev] x1.09 (20 peaks: median 1.0%, max 4.7%), SD3.5 Large x1.28 (8: 1.1%,
# 3.5%), SD3.5 Medium x1.195 (5: 4.4%, 7.4%), as scripts/autocast_activations.py computes on meta (x1.08-1.22,
# by model and checkpointing). FLUX.1 [schnell] takes [dev]'s (registry speed_as: the same network)
FLOW_ACTIVATION_FACTOR = 1.13
FLOW_ACTIVATION_FACTORS = {"flux-dev": 1.09, "sd35-large": 1.28, "sd35-medium": 1.195}
# A sample grid's VAE decode holds this many times the live bytes counted on meta (activations.yaml sampling
# vae_decode_peak): the grid's peak over the bytes allocated before it, less the VAE's weights, over that count,
# measured by benchmarks/sampling_peak.py on an H100 (2026-11-27, the three bench points in profiles/methods/lora.yaml
# with sample_grid_peak_gib): SD1.5 at 512 px x1.635, SDXL at 1024 x1.619, FLUX.1 [dev] at 1024 x1.646; the mean.
# (cuDNN's convolution workspaces and the allocator's rounding at these sizes, which a meta count cannot see.)
VAE_DECODE_FACTOR = 1.633
CUDA_CONTEXT_BYTES = int(0.6 * GiB)  # CUDA context + cuBLAS/cuDNN workspaces, outside torch's allocator
ALLOCATOR_OVERHEAD = 0.06  # caching-allocator fragmentation, fraction of the allocated peak
HEADROOM = 0.92  # a recommended plan's predicted peak stays at or below this share of VRAM
HOST_RAM_SHARE = 0.9  # host RAM a plan holds (offloaded optimizer, pinned blocks) stays within this share
RAM_PER_PROCESS = 3 * GiB  # python + torch + CUDA host allocations + data loading, per process
GC_TIME_FACTOR = 1.25  # gradient checkpointing: ~20-30% slower (field notes 2; invoke-training PR 22)
# DeepSpeed's CPU Adam (DeepSpeedCPUAdam, AVX): fp32 parameters updated per second on the host, measured by
# benchmarks/cpu_adam_rate.py (deepspeed 0.19.8, torch 2.13 CPU, AMD EPYC, 200M parameters, 2026-11-27): 2.10 G
# with one thread, 2.36 G with two (memory-bound: ~28 bytes moved per parameter); torch's AdamW 0.31 G, 6.7x
# slower, as DeepSpeed documents (5-7x)
CPU_ADAM_PARAMS_PER_S = 2.1e9
CPU_ADAM_SOURCE = "measured on a 2-core AMD EPYC VM; `sdplan bench --host` measures this host's"
# python, data loading and kernel launches per micro-step, whatever the batch: the prior; calibrate() fits it
# with the bandwidth efficiency where the published speeds span several batch sizes
STEP_OVERHEAD_S = 0.03
STEP_OVERHEAD_GRID = tuple(i * 0.01 for i in range(0, 61))  # seconds searched by calibrate()
# The UNet's per-step fixed work, in samples' worth of its bandwidth-bound traffic: a micro-step launches one set
# of kernels per layer whatever the batch (launch latency, kernel tails, small batch-1 kernels that leave most of
# the GPU idle, the LoRA wrappers' Python), so its time grows with the layers the model has, not only with the
# samples. A per-step constant cannot carry it (an SD1.5 LoRA step takes 0.3 s, an SDXL one 1.35 s at batch 1);
# a share of one sample's traffic grows with the model and the resolution as the layer count and sizes do.
# calibrate() fits it where the published speeds span several batch sizes; 0 (the old form) otherwise.
FIXED_SAMPLES_GRID = tuple(i * 0.25 for i in range(0, 33))
# Roofline: a micro-step takes the larger of its matmul time at the measured GEMM rate (a ceiling no kernel
# beats) and its bandwidth time: the bytes of the bandwidth-bound ops (norms, activations, residual adds, casts;
# counted on meta by scripts/compute_activations.py --only-traffic) over the spec-sheet memory bandwidth at the
# efficiency calibrate() fits on the published speeds of profiles/methods. Published SD training speeds follow
# memory bandwidth, not tensor throughput: an RTX 4090 (165 dense TFLOPS, 1008 GB/s) trains SDXL about as fast
# as an RTX 3090 Ti (80 TFLOPS, the same 1008 GB/s), and a T4 (70 W, 320 GB/s) never reaches its rating. The
# counted bytes are a floor (layout transposes around cuDNN convs, autocast casts, attention re-reads and kernel
# launches are not counted), so the fitted efficiency is small and carries them. The backward moves about twice
# the forward's bytes (read the saved input and the incoming gradient, write the outgoing one); checkpointing
# costs GC_TIME_FACTOR, as on the matmul side. BANDWIDTH_EFFICIENCY is the prior where calibrate() has no point.
BANDWIDTH_EFFICIENCY = 0.7
BACKWARD_TRAFFIC = 2.0
STARTUP_S = 60.0  # loading the model, building the optimizer, first compilation
# Sampling (the images a run generates besides training: DreamBooth's missing class images, sample grids): a
# denoising step runs the denoiser at the images' batch, twice that with classifier-free guidance, and takes the
# larger of a launch-bound floor and that batch's roofline (the UNet's bytes over the memory bandwidth at
# an efficiency, its FLOPs over the measured GEMM rate). calibrate() fits the efficiency and the floor on
# the measured txt2img speeds of profiles/sampling.yaml (least squares on log time) over these grids; the
# transformer families' step is their forward's FLOPs at their training efficiency (nothing measured to fit).
SAMPLING_EFFICIENCY_GRID = tuple(0.01 * 1.03**i for i in range(160))  # 0.01 .. 1.1, 3% apart
SAMPLING_FLOOR_GRID = tuple(0.0025 * i for i in range(0, 41))  # 0 .. 0.1 s a denoising step
# an architecture's own sampling efficiency from this many steps that are not floor-bound (two batch sizes)
SAMPLING_MIN_POINTS = 2
SAMPLING_SHOWN = 0.1  # the reasons name the final grid's time alone from this share of the run
# the all-reduce's share of the link's nominal rate where no multi-GPU observation measured one (calibrate)
LINK_EFFICIENCY_FALLBACK = 0.05
# use more GPUs only when the run gets at least this much shorter (less its class images and final grid, which
# the first process samples whatever the count: multi_gpu_gain)
MIN_MULTI_GPU_GAIN = 0.05
PCIE_GBS = {1: 4.0, 2: 8.0, 3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}  # x16, one direction
BATCHES = (1, 2, 4, 8, 16)
# Optimizer state per trainable parameter, in copies of the parameter (its dtype) or fixed bytes, from each
# implementation's state initialisation: AdamW exp_avg + exp_avg_sq; Prodigy (konstmish/prodigy) s, p0,
# exp_avg, exp_avg_sq; D-Adaptation Adam (facebookresearch/dadaptation DAdaptAdam) s, exp_avg, exp_avg_sq;
# Lion (lucidrains/lion-pytorch) exp_avg; bitsandbytes 8-bit AdamW 2 x 1 byte and Lion8bit 1 byte (blockwise
# quantised state; the per-block scales are negligible). Adafactor: the factored moment of the real shapes.
OPTIMIZER_STATE = {  # name -> (copies of the parameter, fixed bytes per parameter)
    "adamw": (2, 0.0),
    "adamw8bit": (0, 2.0),
    "prodigy": (4, 0.0),
    "dadaptation": (3, 0.0),
    "lion": (1, 0.0),
    "lion8bit": (0, 1.0),
}
# memory traffic of the optimizer step per trainable param (fp32): read param, grad and every state tensor,
# write param and the states; Prodigy and D-Adaptation make one more pass for their global d estimate
OPTIMIZER_STEP_BYTES = {
    "adamw": 28,
    "adamw8bit": 16,
    "adafactor": 16,
    "prodigy": 52,
    "dadaptation": 44,
    "lion": 20,
    "lion8bit": 14,
}
FOREACH_OPTIMIZERS = ("adamw",)  # torch's foreach implementation: one step-sized temporary per parameter

RDNA_MATH_ATTENTION = ("gfx101", "gfx103")  # RDNA1/2: no flash / memory-efficient SDPA kernels in ROCm torch


# -- inputs ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HWGPU:
    name: str
    memory_bytes: int
    vendor: str
    bf16: bool
    fp16: bool
    arch: str | None = None
    spec: GPUSpec | None = None  # the catalog entry, when the name matches one
    # its number on the machine, as `sdplan doctor` numbers GPUs (catalog hardware: 0, 1, ...)
    index: int | None = None
    uuid: str | None = None  # as the probe read it (NVML: "GPU-..."); None for catalog hardware
    pcie_gen: int | None = None  # the link generation the probe read (catalog hardware: its spec's)

    @functools.cached_property
    def kind(self) -> tuple:
        """What the planner tells GPUs apart by (alike GPUs are interchangeable; memory to 256 MiB, as two cards
        of one model may report a few MiB apart, e.g. one with ECC on). Kept on the object (not a field: equality
        and ``replace`` ignore it): a search asks for it ~100,000 times."""
        memory = round(self.memory_bytes / (256 * 2**20))
        return (
            self.vendor,
            self.name,
            memory,
            self.bf16,
            self.fp16,
            self.arch,
            self.spec.name if self.spec else None,
        )


@dataclass(frozen=True)
class Hardware:
    source: str  # "probe" | "catalog" | "file"
    gpus: tuple[HWGPU, ...]
    ram_usable_bytes: int | None = None
    link: str = "pcie"  # "nvlink" | "xgmi" | "pcie"
    link_gbs: float = PCIE_GBS[4]
    label: str = ""
    # what was assumed about the GPUs (a form factor, an uncatalogued GPU); the plan's reasons start with them
    notes: tuple[str, ...] = ()
    # this host's own measurements (a probe of the machine sdplan runs on; `sdplan bench --host`)
    host: HostMeasurement | None = None
    # a probed machine's link between each pair of its GPUs, (index, index, "nvlink" | "xgmi" | "pcie"): a plan on
    # some of them runs its all-reduce over the links among those (:func:`set_link`); link / link_gbs above are
    # the whole machine's. Catalog hardware has none: all its GPUs are joined alike.
    pair_links: tuple[tuple[int, int, str], ...] = ()
    # a probed machine's GPUs the user's CUDA_VISIBLE_DEVICES (HIP_ / ROCR_) hides from a run here, and that
    # setting: not planned (:func:`hardware_from_snapshot`)
    hidden: tuple[int, ...] = ()
    hidden_by: str = ""
    # a probed machine's GPUs of the trained vendor a run here cannot train on, each (index, why, in words): those
    # the ROCm wheels have no kernels for beside ones they have (probe.snapshot.runnable_gpus): not planned
    left_out: tuple[tuple[int, str], ...] = ()
    # a probed or saved machine's installed packages, (name, version; None: not installed), as its snapshot's
    # software.packages records them (:func:`hardware_from_snapshot`); None: not known (catalog hardware, a snapshot that
    # records none): planned as if whatever a setting needs could be installed
    packages: tuple[tuple[str, str | None], ...] | None = None

    @property
    def count(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class Request:
    method: str
    model: str = "sd15"
    resolution: int | None = None  # None: the family's native resolution
    images: int = 20  # distinct images (the latent cache encodes each once; a batch holds no image twice)
    repeats: int = 1
    epochs: int = 10
    max_gpus: int | None = None  # --gpus: use at most this many
    lora_rank: int = 16
    prior_preservation: bool = False
    class_images: int = 0
    max_steps: int | None = None  # training.max_steps pinned: the run's optimizer steps (one process's count)
    # kohya folders of unequal repeats (10_a, 3_b): each image times its own folder's; None: images x repeats
    images_per_epoch: int | None = None
    # data.buckets: the samples in each aspect bucket (a batch holds one bucket's: each ends in a short batch)
    bucket_samples: tuple[int, ...] = ()
    # what the run samples besides training (sampled_images): the class images its class folder lacks (None:
    # all class_images), the grids' prompts (the final grid, one every sample_every_steps optimizer steps but
    # the last, one at each intermediate save that is not such a step), their denoising steps and guidance
    # scale (None: the family's)
    class_images_to_generate: int | None = None
    sample_prompts: int = 0  # sampling.prompts given (0: each grid shows one caption)
    sample_every_steps: int = 0
    sampling_steps: int = SamplingConfig.num_inference_steps
    guidance_scale: float | None = None
    save_every_epochs: int = 0  # output.save_every_n_epochs / _steps: a grid at each save
    save_every_steps: int = 0
    # settings the user fixed (Settings field -> value, from `key=value` sdplan.yaml pins): planned around
    pins: tuple[tuple[str, Any], ...] = ()
    # how a refusal names the pins where they are a whole config's settings (`sdplan train --config` with
    # changed settings pins every one): listing each of them said nothing; None: listed
    pins_named: str | None = None

    def pinned(self, name: str) -> bool:
        return any(k == name for k, _ in self.pins)

    @property
    def per_epoch(self) -> int:
        """The images an epoch shows: each with its repeats."""
        return self.images_per_epoch or self.images * self.repeats

    def pin(self, name: str, default: Any = None) -> Any:
        return next((v for k, v in self.pins if k == name), default)


@dataclass(frozen=True)
class Memory:
    """Predicted peak bytes per GPU, with its parts, and host RAM."""

    trainable_params: int
    weights: float
    frozen: float
    gradients: float
    optimizer: float
    ema: float
    autocast_copies: float
    activations: float
    step_transient: float
    overhead: float
    peak: float
    ram: float
    # sdplan's trainer samples a grid at the end (and every sampling.every_steps) with the training state
    # resident: that peak, beside the step's (0 when the family has no sampling coefficients)
    sampling_peak: float = 0.0
    # memory.cache_text_encoder_outputs: the trainer's text-cache pass before the denoiser is placed (the text
    # encoders and the VAE alone on the GPU: text_cache_peak_bytes); ``peak`` is the larger of it and the
    # step's, ``step_peak`` the step's alone (with the overhead; sdplan bench's torch.cuda.max_memory_allocated
    # measures it less the overhead)
    text_cache_peak: float = 0.0
    step_peak: float = 0.0

    def parts(self) -> dict[str, int]:
        skip = ("peak", "ram", "trainable_params", "sampling_peak", "text_cache_peak", "step_peak")
        return {k: int(v) for k, v in asdict(self).items() if k not in skip}


# -- memory ----------------------------------------------------------------------------------------------


def _half(precision: str) -> bool:
    return precision in ("fp16", "bf16")


# LoRA target modules (peft names, as in sdplan.yaml's lora.target_modules) -> the target set whose parameter
# counts and activations profiles/activations.yaml holds. diffusers' scripts adapt the attention projections;
# kohya-ss/sd-scripts networks/lora.py adapts every Linear / 1x1 Conv2d in a Transformer2DModel
# (UNET_TARGET_REPLACE_MODULE) and, with conv_dim (LoCon), the ResnetBlock2D / Down- / Upsample2D convs
# (UNET_TARGET_REPLACE_MODULE_CONV2D_3X3); its text-encoder LoRA adapts CLIPAttention and CLIPMLP.
LORA_TARGETS_ATTN = ("to_q", "to_k", "to_v", "to_out.0")
LORA_TARGETS_KOHYA = (*LORA_TARGETS_ATTN, "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2")
LORA_TARGETS_LOCON = (*LORA_TARGETS_KOHYA, "conv1", "conv2", "conv_shortcut", "time_emb_proj", "conv")
_FF_TARGETS = frozenset(LORA_TARGETS_KOHYA) - frozenset(LORA_TARGETS_ATTN)
_CONV_TARGETS = frozenset(LORA_TARGETS_LOCON) - frozenset(LORA_TARGETS_KOHYA)


def lora_target_set(s: Settings) -> str:
    """'attn' (attention projections), 'attn_ff' (+ feed-forward and proj_in/out) or 'attn_ff_conv' (+ the
    ResNet and resampler convs) for a LoRA's target modules; None (the family's default, the UNet's attention
    projections: registry.lora_targets) is 'attn'."""
    targets = set(registry.lora_targets(s.model, s.lora_targets))
    if targets & _CONV_TARGETS:
        return "attn_ff_conv"
    if targets & _FF_TARGETS:
        return "attn_ff"
    return "attn"


def lora_params(profiles: Profiles, s: Settings) -> int:
    """LoRA parameters: rank x the per-rank count of the adapted layers (counted on meta from the real layer
    shapes by scripts/compute_activations.py); the text encoders' attention (diffusers) or attention + MLP
    (kohya, whose UNet set includes the feed-forward layers) when they are trained."""
    model = profiles.model(s.model)
    counts = profiles.activations.lora_params_per_rank(s.model)
    if counts is None:  # a family computed without the counts: the attention projections from its config
        return model.lora_params(s.lora_rank, text_encoder=s.train_text_encoder)
    target = lora_target_set(s)
    per_rank = counts["unet"][target]
    if s.train_text_encoder:
        per_rank += sum(counts["text_encoders"]["attn" if target == "attn" else "attn_mlp"])
    return int(s.lora_rank) * per_rank


def _unet_lora_layers(model: ModelSpec, target_set: str):
    """The adapted layers of a UNet LoRA target set, as (tokens per latent pixel, tokens per sample, input
    features) per group of layers, from the UNet config: a transformer block at level i (latent side halved i
    times) has attn1 q/k/v/out and attn2 q/out at its image tokens and C features, and attn2 k/v at the text
    tokens and the text's features; kohya's set adds ff.net.0.proj (C) / ff.net.2 (4C, GEGLU's inner width) per
    block and proj_in / proj_out (C) per Transformer2DModel; LoCon adds each ResnetBlock2D's conv1 / conv2 and
    the resamplers' convs (output positions; input channels taken as the level's). conv_shortcut and
    time_emb_proj (a few layers, one token) are left out."""
    cfg = model.unet or {}
    channels = [int(c) for c in cfg.get("block_out_channels", ())]
    n = len(channels)
    layers = cfg.get("transformer_layers_per_block", 1)
    per_block = list(layers) if isinstance(layers, list) else [layers] * n
    lpb = int(cfg.get("layers_per_block", 2))
    text = int(model.tokenizer_max_length)  # the encoders' states are concatenated along features (SDXL)
    text_dim = int(cfg.get("cross_attention_dim", 768))
    ff = target_set in ("attn_ff", "attn_ff_conv")
    conv = target_set == "attn_ff_conv"

    def attention(level: int, transformers: int, blocks: int):
        c, tokens = channels[level], 1.0 / 4**level
        yield transformers * blocks * 6 * tokens, 0, c
        if ff:
            yield transformers * blocks * tokens, 0, c
            yield transformers * blocks * tokens, 0, 4 * c
            yield transformers * 2 * tokens, 0, c
        yield 0.0, transformers * blocks * 2 * text, text_dim

    for i, kind in enumerate(cfg.get("down_block_types", ())):
        if "CrossAttn" in kind:
            yield from attention(i, lpb, per_block[i])
        if conv:
            yield lpb * 2 / 4**i + (1 / 4 ** (i + 1) if i < n - 1 else 0.0), 0, channels[i]
    mid = cfg.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid is None or "CrossAttn" in str(mid):
        yield from attention(n - 1, 1, per_block[-1])
    if conv:
        yield 2 * 2 / 4 ** (n - 1), 0, channels[-1]
    for j, kind in enumerate(cfg.get("up_block_types", ())):
        level = n - 1 - j
        if "CrossAttn" in kind:
            yield from attention(level, lpb + 1, list(reversed(per_block))[j])
        if conv:
            yield (lpb + 1) * 2 / 4**level + (1 / 4 ** (level - 1) if level > 0 else 0.0), 0, channels[level]


def lora_rank_tokens(model: ModelSpec, target_set: str) -> tuple[float, int]:
    """(tokens per latent pixel, tokens per sample) summed over the adapted layers of a UNet LoRA target set
    (:func:`_unet_lora_layers`).

    Each adapted layer's up projection saves its input, the down projection's rank-r output (r x tokens), for
    its weight gradient (kohya networks/lora.py and peft both compute ``up(down(x)) * scale``; a scalar multiply
    saves nothing). The meta-device activation entries adapt the layers' weights, not a rank-r pair, so they
    leave this intermediate out (scripts/compute_activations.py)."""
    groups = list(_unet_lora_layers(model, target_set))
    return sum(g[0] for g in groups), sum(g[1] for g in groups)


def lora_rank_activation_bytes(profiles: Profiles, s: Settings) -> float:
    """Bytes of the LoRA's saved rank-r intermediates (:func:`lora_rank_tokens`) at the request's batch; 0 with
    gradient checkpointing (inside a checkpointed segment nothing is held; one segment's share is recomputed)."""
    if s.method != "lora" or s.gradient_checkpointing or flow_family(s.model):
        return 0.0
    model = profiles.model(s.model)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    per_pixel, per_sample = lora_rank_tokens(model, lora_target_set(s))
    batch = s.batch * (2 if s.prior_preservation else 1)
    element = 2.0 if _half(s.precision) else 4.0  # autocast runs the down projection in half precision
    return batch * (per_pixel * latent + per_sample) * int(s.lora_rank) * element


def lora_input_elements(model: ModelSpec, target_set: str) -> tuple[float, int]:
    """(elements per latent pixel, elements per sample) of the adapted layers' inputs, summed over a UNet LoRA
    target set: each layer's tokens x its input features (:func:`_unet_lora_layers`)."""
    groups = list(_unet_lora_layers(model, target_set))
    return sum(g[0] * g[2] for g in groups), sum(g[1] * g[2] for g in groups)


# lora.dropout > 0 (peft's lora_dropout, kohya's network_dropout): each adapted layer's down projection saves
# the dropped copy of its input, and dropout saves its mask (a bool per element), where without dropout the
# layers of one input share it. Measured on the meta device (peft LoRA rank 16, bf16, batch 1, no
# checkpointing, the saved tensors summed as scripts/compute_activations.py sums them): SD 1.5 at 512 px +216
# MiB with the attention set (this count: 204), +417 with kohya's (435); SDXL at 1024 px +2027 (1863); with the
# families' default targets SD3.5 Medium at 1024 px +1828 MiB (1867), FLUX.1 [dev] at 512 px +3735 (3847) and
# at 1024 px +11205 (11543).
LORA_DROPOUT_MASK_BYTES = 1


def lora_dropout_bytes(profiles: Profiles, s: Settings) -> float:
    """Bytes lora.dropout adds to the saved activations: the adapted layers' input elements (the UNets'
    :func:`lora_input_elements`, the transformers' :func:`flow_lora_input_elements`) each as a dropped copy and
    a mask byte; 0 without dropout and with gradient checkpointing (saved inside a segment and recomputed, as
    :func:`lora_rank_activation_bytes`)."""
    if s.method != "lora" or not s.lora_dropout or s.gradient_checkpointing:
        return 0.0
    model = profiles.model(s.model)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    batch = s.batch * (2 if s.prior_preservation else 1)
    if flow_family(s.model):
        return (
            batch
            * flow_lora_input_elements(model, s, latent)
            * (flow_weight_bytes(s) + LORA_DROPOUT_MASK_BYTES)
        )
    per_pixel, per_sample = lora_input_elements(model, lora_target_set(s))
    element = 2.0 if _half(s.precision) else 4.0
    return batch * (per_pixel * latent + per_sample) * (element + LORA_DROPOUT_MASK_BYTES)


# The plain (math) attention path saves the softmax output P = softmax(Q K^T * scale) for the backward, one
# (batch x heads, tokens, tokens) matrix per layer. Backpropagating through it allocates two more matrices of the
# same shape and dtype before P is released: dP = dO @ V^T (the matmul's backward) and dS = P * (dP - sum(dP * P))
# (softmax's backward, which needs P and dP alive), each then scaled into dQ / dK. So while one attention layer
# is differentiated, three such matrices are alive: P and its two gradients (torch autograd formulas for bmm and
# _softmax_backward_data; torch >= 2.5's math SDPA upcasts half inputs and keeps P in fp32, so the gradients are
# fp32 too, the same bytes as the saved P that scripts/compute_activations.py counts).
ATTENTION_MATRIX_COPIES_IN_BACKWARD = 3


def recomputed_attention_matrix_bytes(
    profiles: Profiles, s: Settings, trained_part: str, *, batch: int, latent_pixels: int
) -> float:
    """Bytes of the attention matrix saved inside the largest recomputed segment (the ``quadratic`` term of the
    activation profile's ``recompute_peak``) with gradient checkpointing and the math attention path; 0 otherwise.

    With checkpointing, a segment's saved tensors are small (one transformer block's), and the two gradients of
    its attention matrix (:data:`ATTENTION_MATRIX_COPIES_IN_BACKWARD`) are a large share of the segment's
    backward peak, which ACTIVATION_FACTOR's flat 0.5 x of the saved bytes does not reach: with the math path
    at 512 px in fp32 the SD1.5 matrix alone is 0.5 GiB a sample. Without checkpointing every layer's matrix is
    saved at once and the factor's share of all of them already exceeds one layer's two gradients."""
    if not s.gradient_checkpointing or s.attention != "math":
        return 0.0
    dt = "fp32" if s.precision == "fp32" else "bf16"
    entry = profiles.activations.families[s.model]["unet"].get(f"{dt}/math/gc/{trained_part}")
    if not entry or "recompute_peak" not in entry:
        return 0.0
    return batch * float(entry["recompute_peak"]["quadratic"]) * latent_pixels**2


def ti_original_rows_bytes(trained: int) -> float:
    """The fp32 copy of the trained embedding matrix that textual inversion keeps on the GPU to restore the rows
    of every other token after each optimizer step (same size as the trained matrix)."""
    return trained * 4.0


def ti_frozen_half_copies_bytes(model: ModelSpec) -> float:
    """Half-precision copies of the frozen fp32 text encoders' weights that autocast makes in textual inversion
    and that autograd keeps until the backward reaches each layer.

    Textual inversion keeps the text encoder in fp32 (its embedding matrix trains) and runs it under autocast.
    Its frozen weights do not require grad, so autocast does not cache their half casts (aten autocast_mode.cpp
    cached_cast needs requires_grad and a leaf) but casts them at every Linear; the gradient flows through each
    Linear to the embeddings, so linear's backward needs the weight it multiplied by and autograd saves that
    half copy until the layer's backward: every weight but the embeddings (lookups, not autocast ops) is held
    once more at 2 bytes from the text encoder's forward to the end of the backward. The norms' few weights
    (layer_norm runs in fp32 under autocast) are counted too; they are well under 1% of the encoder."""
    frozen = sum(
        int(p) - text_encoder_embedding_params(te)
        for p, te in zip(model.params_text_encoders, model.text_encoders)
    )
    return 2.0 * frozen


def trainable_params(model: ModelSpec, s: Settings, profiles: Profiles | None = None) -> int:
    if flow_family(s.model):
        return flow_trainable_params(model, s)
    if s.method == "lora":
        if profiles is not None:
            return lora_params(profiles, s)
        return model.lora_params(s.lora_rank, text_encoder=s.train_text_encoder)
    if s.method == "textual-inversion":
        # diffusers' textual inversion trains the whole input-embedding matrix (only new rows change)
        return sum(
            int(te["config"].get("vocab_size", 49408)) * int(te["config"]["hidden_size"])
            for te in model.text_encoders
        )
    return model.params_unet + (model.text_encoder_params if s.train_text_encoder else 0)


def step_allocated_bytes(
    s: Settings,
    *,
    resident: float,
    grads: float,
    buckets: float,
    forward: float,
    step: float,
    recompute_tail: float,
) -> float:
    """The training step's peak allocated bytes, the largest of its phases, for the UNet and the transformer
    families alike. ``resident``: weights, frozen parts, optimizer state (and EMA), there all along; ``grads``:
    the gradients, of which ``buckets`` are DDP's (kept between steps); ``forward``: the forward's peak
    (saved activations and autocast's half copies); ``step``: the optimizer's temporaries; ``recompute_tail``:
    the backward's last segment (recomputed with gradient checkpointing; without it the same segment's saved
    tensors are still held then, so the term is the same either way).

    zero_grad(set_to_none=True) frees the gradients after every step, so they do not coexist with the
    forward's peak: autocast's cache of half weight copies (held until autocast exits at the end of the
    forward, or by the saved tensors until each layer's backward) and the saved activations. Gradients grow
    during the backward while those are freed (the first, high-resolution segment is differentiated last, beside
    nearly all gradients: recomputed with checkpointing, still saved without); the step then adds its
    temporaries. With gradient accumulation the gradients live from the first micro-step's backward to the
    optimizer step, through the next micro-steps' forwards, whatever zero_grad does after the step. DeepSpeed
    offload's buckets are counted beside the forward too (the form DEEPSPEED_ACTIVATION_FACTOR was fitted with),
    though DeepSpeed frees them at the end of every backward (stage_1_and_2.py _release_ipg_buffers @0.19.8:
    the H100's offload steps held 6.43 GiB between steps for SDXL, the bucket not among it). DeepSpeed without
    offload has let go of its half gradients and buckets when the step's temporaries (its fp32 gradient partition and AdamW's) peak: SDXL's ZeRO-2 step in one process on an
    H100 peaked at exactly the resident bytes + ``step`` at batch 1 and 4 (2026-11-27), where adding the
    gradients put it 12% high. Its reduce buckets are freed at the end of every backward, the kept gradient
    partition is not: with gradient accumulation that partition is there through the next micro-steps' forwards
    (without the buckets), and beside the next backward's own partition buffer and buckets
    (deepspeed/runtime/zero/stage_1_and_2.py independent_gradient_partition_epilogue: the new partition is added
    into the kept one, then _release_ipg_buffers drops the buckets and the new buffer, @0.19.8)."""
    if s.deepspeed and not s.offload:
        # the buckets are in ``grads`` (deepspeed_states, any method under DeepSpeed); over the micro-steps the
        # partition alone is held
        held = max(0.0, grads - deepspeed_bucket_bytes(s)) if s.grad_accum > 1 else 0.0
        return resident + max(forward + held, grads + held + recompute_tail, step)
    if s.set_grads_to_none and s.grad_accum == 1 and not s.offload:
        return resident + buckets + max(forward, grads - buckets + max(step, recompute_tail))
    return resident + grads + max(forward, step)


def ddp_bucket_bytes(s: Settings, grads: float) -> float:
    """The part of ``grads`` that DDP's all-reduce buckets hold, allocated for good (zero_grad(set_to_none=True)
    frees nothing of it). sdplan's trainer sets gradient_as_bucket_view=True: the gradients are views into the
    buckets, one copy, not a second one beside them (DDP's default). Measured on the CPU with two processes
    (2026-11-27, benchmarks/multi_gpu_census.py, 100.7M fp32 parameters, resident-set growth in gradient
    bytes): 1.21 after the backward, 1.22 after zero_grad with bucket views; 2.21 and 1.22 without."""
    return grads if (s.num_gpus > 1 and not s.deepspeed) else 0.0


def deepspeed_bucket_bytes(s: Settings) -> float:
    """Bytes of the reduce buckets DeepSpeed allocates on each GPU during the backward (settings.
    deepspeed_reduce_buckets of DEEPSPEED_BUCKET_ELEMENTS, in the training dtype's width)."""
    return (
        deepspeed_reduce_buckets(s.num_gpus)
        * DEEPSPEED_BUCKET_ELEMENTS
        * (2.0 if _half(s.precision) else 4.0)
    )


def deepspeed_states(s: Settings, trained: float, adafactor_state_fp32: float = 0.0) -> dict[str, float]:
    """Bytes each GPU holds under DeepSpeed ZeRO-1/2 (the deepspeed.json sdplan.launch writes) for ``trained``
    parameters (Adafactor's factored state, which depends on the shapes, given in fp32): ``weights`` (the
    parameters in the training dtype, every process a whole copy), ``gradients`` (during the backward: the reduce
    buckets of DEEPSPEED_BUCKET_ELEMENTS, settings.deepspeed_reduce_buckets, and the gradients this process keeps),
    ``optimizer`` (the fp32 master weights and state it updates), ``step`` (the optimizer step's temporaries)
    and ``host`` (the process's share of host RAM the offloaded state takes).

    With optimizer offload the master weights, state and step live on the CPU. Without it they are split over
    the N processes: ZeRO-2 keeps 2 + 18/N bytes per parameter at the step (half weights; of 1/N: half gradients,
    fp32 gradients, fp32 master weights, Adam's two fp32 moments), deepspeed/runtime/zero/stage_1_and_2.py
    estimate_zero2_model_states_mem_needs @0.19.8. Measured on the CPU with two processes (2026-11-27, a 16.8M
    parameter bf16 model, live tensors, benchmarks/multi_gpu_census.py): 2 + 4/N bytes per parameter before the
    first step, + 2/N after the backward (the kept gradient partition), 2 + 12/N after the step. ZeRO-1 keeps
    whole half gradients."""
    pb = 2.0 if _half(s.precision) else 4.0
    n = s.num_gpus
    buckets = deepspeed_bucket_bytes(s)
    if s.offload:  # host RAM: DeepSpeed's estimator with cpu_offload, per process
        host = trained * max(4 * n, 16) * 1.5 / n
        return {"weights": trained * pb, "gradients": buckets, "optimizer": 0.0, "step": 0.0, "host": host}
    stage = (s.deepspeed or {}).get("zero_stage", 2)
    kept = trained * pb / (n if stage >= 2 else 1)
    foreach = trained * 4.0 / n if s.optimizer in FOREACH_OPTIMIZERS else 0.0
    # step() makes a flat copy of the kept half gradient partition (flatten: torch.cat) and of that the fp32
    # partition before it frees either (stage_1_and_2.py step @0.19.8): 2 + 2 + 4 bytes per parameter of the
    # partition (fp32 training: the partition and its flat copy, which .to(float32) keeps: 4 + 4); the optimizer
    # then runs beside the fp32 partition alone
    flatten = trained * 8.0 / n
    if s.optimizer in OPTIMIZER_STATE:
        copies, fixed = OPTIMIZER_STATE[s.optimizer]
        state = trained * (copies * 4.0 + fixed)
    else:
        state = adafactor_state_fp32
    return {
        "weights": trained * pb,
        "gradients": kept + buckets,
        "optimizer": (trained * 4.0 + state) / n,
        # the fp32 gradient partition and foreach AdamW's temporary, or the flattening before it
        "step": max(flatten, trained * 4.0 / n + foreach),
        "host": 0.0,
    }


def memory(profiles: Profiles, s: Settings) -> Memory:
    """The peak of a training step with ``s`` (:class:`Memory`). A pure function of these profiles and ``s``,
    kept in ``profiles.memo`` (which lives and dies with the Profiles object): plans of the same model and
    method on other hardware, or with other pins, size many of the same settings again."""
    table = profiles.memo.setdefault("memory", {})
    return _memo(table, _settings_key(s), lambda: _memory_on(profiles, s))


def _memory_on(profiles: Profiles, s: Settings) -> Memory:
    if s.num_gpus > 2 and not s.deepspeed:
        # DDP on N > 2 GPUs: each process holds what one of 2 holds (DDP's buckets are the one part that depends
        # on the count, and only on whether there are several); the host RAM is N processes', and the EMA grid's
        # copy the main process alone holds (_assemble). Exactly what _memory gives (x2 then /2 is exact in
        # binary floating point): a search on 8 GPUs sized every configuration 7 times over
        two = memory(profiles, _count_free(s, 2))
        once = ema_grid_host_bytes(s, two.weights)
        # replace(two, ram=...) without its walk over the fields (Memory has no __post_init__)
        out = object.__new__(Memory)
        out.__dict__.update(two.__dict__, ram=(two.ram - once) / 2 * s.num_gpus + once)
        return out
    return _memory(profiles, s)


def _count_free(s: Settings, num_gpus: int) -> Settings:
    """``s`` on ``num_gpus`` GPUs, whichever they are (for memos of what does not depend on which)."""
    return _with(s, num_gpus=num_gpus) if s.gpu_ids is None else replace(s, num_gpus=num_gpus, gpu_ids=None)


def _memory(profiles: Profiles, s: Settings) -> Memory:
    if flow_family(s.model):
        return memory_flow(profiles, s)
    model = profiles.model(s.model)
    act = profiles.activations
    half = _half(s.precision)
    wb = 2 if half else 4  # frozen weights
    full = s.method in FULL_METHODS
    tb = 2 if s.half_weights else 4  # trainable weights and their gradients
    t = trainable_params(model, s, profiles)
    batch = s.batch * (2 if s.prior_preservation else 1)
    latent = (s.resolution // model.vae_scale_factor) ** 2

    # frozen weights resident on the GPU
    frozen = 0.0
    if not full:
        frozen += model.params_unet * wb
    te_total = model.text_encoder_params
    if s.method == "textual-inversion":
        frozen += (te_total - t) * 4  # the text encoder stays fp32 around its trained embeddings
        # and a full copy of the embedding matrix, made on the GPU before training, from which the rows of the
        # other tokens are restored after every step (trainer/recipes/textual_inversion.py original_rows;
        # diffusers' examples/textual_inversion.py and InvokeAI 2.3's orig_embeds_params: weight.data.clone())
        frozen += ti_original_rows_bytes(t)
    elif (
        s.method == "lora"
        and s.train_text_encoder
        or not (s.train_text_encoder and full)
        and not s.cache_text_encoder_outputs
    ):
        frozen += te_total * wb
    if not s.cache_latents:
        frozen += model.params_vae * wb

    if s.train_text_encoder and full:
        pass  # counted as trainable
    weights = t * tb
    grads = 0.0 if s.fused_backward else t * tb
    if s.optimizer in OPTIMIZER_STATE:
        copies, fixed = OPTIMIZER_STATE[s.optimizer]
        opt = t * (copies * tb + fixed)
    else:  # adafactor: factored second moment of the real tensor shapes
        full_bytes = act.adafactor_bytes(s.model, text_encoders=s.train_text_encoder and full)
        full_params = model.params_unet + (te_total if (s.train_text_encoder and full) else 0)
        opt = t * (full_bytes / full_params) * (tb / 4)
    ema = model.params_unet * 4.0 if s.ema == "gpu" else 0.0
    # autocast caches the half copy of every fp32 leaf tensor that requires grad for the rest of the autocast
    # region (pytorch aten/src/ATen/autocast_mode.cpp cached_cast: can_try_cache = lower-precision target,
    # float32, requires_grad, is_leaf): the trained weights of a full fine-tune and a LoRA's fp32 matrices alike.
    # Textual inversion's embedding lookup is not an autocast op (no copy; but see ti_frozen_half_copies_bytes).
    autocast = t * 2.0 if (half and tb == 4 and (full or s.method == "lora")) else 0.0

    trained_part = "unet" if full else "attn"
    if s.method == "lora" and act.has_unet_entry(
        s.model,
        dtype=s.precision,
        attention=s.attention,
        gc=s.gradient_checkpointing,
        trained=lora_target_set(s),
    ):
        trained_part = lora_target_set(s)  # the adapted layers' inputs are saved for their LoRA's gradient
    held, recompute = act.unet(
        s.model,
        dtype=s.precision,
        attention=s.attention,
        gc=s.gradient_checkpointing,
        batch=batch,
        latent_pixels=latent,
        trained=trained_part,
    )
    # the recomputed segment's attention matrix is counted exactly (itself and its two gradients), the factor
    # covers the rest (see recomputed_attention_matrix_bytes)
    matrix = recomputed_attention_matrix_bytes(profiles, s, trained_part, batch=batch, latent_pixels=latent)
    factor = DEEPSPEED_ACTIVATION_FACTOR if (s.deepspeed and full) else ACTIVATION_FACTOR
    exact = ATTENTION_MATRIX_COPIES_IN_BACKWARD * matrix - factor * matrix
    lora_extra = lora_rank_activation_bytes(profiles, s) + lora_dropout_bytes(profiles, s)
    activations = factor * (held + recompute + lora_extra) + exact
    # the backward's last segment (the forward's first, high-resolution blocks) beside nearly all gradients:
    # recomputed with checkpointing, its saved tensors still held without, the same bytes either way
    gc_part = trained_part
    if not act.has_unet_entry(s.model, dtype=s.precision, attention=s.attention, gc=True, trained=gc_part):
        gc_part = "unet" if full else "attn"
    _, segment = act.unet(
        s.model,
        dtype=s.precision,
        attention=s.attention,
        gc=True,
        batch=batch,
        latent_pixels=latent,
        trained=gc_part,
    )
    tail_matrix = recomputed_attention_matrix_bytes(
        profiles, _with(s, gradient_checkpointing=True), gc_part, batch=batch, latent_pixels=latent
    )
    tail_exact = (ATTENTION_MATRIX_COPIES_IN_BACKWARD - factor) * tail_matrix
    recompute_tail = factor * segment + tail_exact
    if s.train_text_encoder or s.method == "textual-inversion":
        te_dtype = "fp32" if s.method == "textual-inversion" else s.precision
        activations += factor * act.text_encoders(s.model, dtype=te_dtype, batch=batch)
    if s.method == "textual-inversion" and half:
        # saved for the backward like activations, but weights: once, whatever the batch, no gradient buffers
        activations += ti_frozen_half_copies_bytes(model)

    # host RAM: each part loads in the dtype it trains in (the trainer's models.load_components): the UNet as
    # its trained or frozen weights, the text encoders in fp32 where they train in it, the VAE in bf16 or fp32
    te_bytes = 4 if (s.method == "textual-inversion" or (full and s.train_text_encoder)) else wb
    vae_bytes = 2 if s.precision == "bf16" else 4
    ram = RAM_PER_PROCESS + (tb if full else wb) * model.params_unet + te_bytes * te_total
    ram += vae_bytes * model.params_vae
    step = t * 4.0 if (s.optimizer in FOREACH_OPTIMIZERS and not s.fused_backward) else 0.0
    return _assemble(
        s,
        dict(trainable_params=t, weights=weights, frozen=frozen, gradients=grads, optimizer=opt, ema=ema),
        autocast_copies=autocast,
        activations=activations,
        step_transient=step,
        ram=ram,
        optimizer_fp32=opt * 4.0 / tb,
        ema_host=model.params_unet * 4.0 if s.ema == "cpu" else 0.0,
        recompute_tail=recompute_tail,
        sampling=lambda resident, autocast: sampling_peak_bytes(
            profiles, s, resident=resident - frozen, trained=t, trained_bytes=tb
        ),
        text_cache=text_cache_peak_bytes(profiles, s),
    )


def ema_grid_host_bytes(s: Settings, weights: float) -> float:
    """Host RAM a grid takes with an EMA: it samples the EMA weights, and the trained ones (``weights``: their
    bytes as the GPU holds them) wait in host RAM meanwhile (loop.Ema.weights_in), on the main process alone (it
    draws the grids); counted beside the loading peak, which it may follow. 0 without an EMA."""
    return weights if s.ema else 0.0


def _assemble(
    s: Settings,
    state: dict[str, float],
    *,
    autocast_copies: float,
    activations: float,
    step_transient: float,
    ram: float,
    optimizer_fp32: float,
    ema_host: float,
    recompute_tail: float,
    sampling: Callable[[float, float], float],
    text_cache: float,
) -> Memory:
    """What every family's memory shares once its own parts are known (one process, no DeepSpeed: ``state``, the
    Memory fields trainable_params, weights, frozen, gradients, optimizer and ema; ``ram`` of one process):
    DeepSpeed ZeRO-1/2 in place of the trained weights, gradients, optimizer state and step, any method (the weights in
    the training dtype: half, or fp32 where deepspeed.json enables neither fp16 nor bf16, as DeepSpeed's
    optimizer takes the parameters' dtype; no autocast copies; ``optimizer_fp32``: the optimizer state in fp32
    for it), the host's EMA copy, DDP's buckets, the step's peak phase and the allocator's overhead, and the
    sampling grid's peak: ``sampling(resident, autocast_copies)`` with the state resident between steps;
    ``text_cache``: the text-cache pass's peak (:func:`text_cache_peak_bytes`), the plan's where it is larger."""
    if s.deepspeed:
        # a LoRA or textual inversion under DeepSpeed as well (a pin: the search offers DeepSpeed to the full
        # methods only): its engine takes the trained weights to the training dtype, offloads or splits their
        # fp32 master copy and state, and allocates the same reduce buckets of DEEPSPEED_BUCKET_ELEMENTS however
        # few parameters train (stage_1_and_2.py setup_buckets); without this the plan counted none of them
        ds = deepspeed_states(s, state["trainable_params"], optimizer_fp32)
        state = state | {"weights": ds["weights"], "gradients": ds["gradients"], "optimizer": ds["optimizer"]}
        step_transient, autocast_copies = ds["step"], 0.0
        ram = max(ram, RAM_PER_PROCESS + ds["host"])
    ram += ema_host
    grid_copy = ema_grid_host_bytes(s, state["weights"])
    weights, grads = state["weights"], state["gradients"]
    held = weights + state["frozen"] + state["optimizer"] + state["ema"]
    buckets = ddp_bucket_bytes(s, grads)
    allocated = step_allocated_bytes(
        s,
        resident=held,
        grads=grads,
        buckets=buckets,
        forward=activations + autocast_copies,
        step=step_transient,
        recompute_tail=recompute_tail,
    )
    overhead = _overhead_bytes(allocated)
    resident = held + buckets + _grads_between_steps(s, grads, buckets)
    return Memory(
        **state,
        autocast_copies=autocast_copies,
        activations=activations,
        step_transient=step_transient,
        overhead=overhead,
        peak=max(allocated + overhead, text_cache),
        ram=ram * s.num_gpus + grid_copy,
        sampling_peak=sampling(resident, autocast_copies),
        text_cache_peak=text_cache,
        step_peak=allocated + overhead,
    )


# HF transformers' T5 attention is eager (its relative position bias): each head's L x L scores in the
# encoders' dtype, their float32 softmax and the probabilities back in that dtype, beside the gated
# feed-forward's three L x d_ff tensors; CLIP (SDPA, 77 tokens) is far below. UNCALIBRATED: arithmetic on the
# configs, no measurement; ~165 MB a caption of T5-XXL at 512 tokens.
_ATTENTION_BYTES_PER_SCORE = 2 + 4 + 2
_FF_TENSORS = 3


def stored_text_encoder_bytes(model: ModelSpec, s: Settings) -> float:
    """The frozen text encoders' bytes as the trainer stores them: fp8 under an fp8 base (SD3.5 / FLUX.1:
    :func:`frozen_text_encoder_bytes`), else in the training precision's weight dtype."""
    if flow_family(s.model):
        return frozen_text_encoder_bytes(model, s.base_precision, flow_weight_bytes(s))
    return model.text_encoder_params * (2 if _half(s.precision) else 4)


def text_cache_peak_bytes(profiles: Profiles, s: Settings) -> float:
    """Peak bytes of the trainer's text-cache pass with memory.cache_text_encoder_outputs (trainer/loop.py
    Recipe.place_models): before the denoiser is placed, the VAE and the frozen text encoders on the GPU as
    stored (fp8 under an fp8 base), and the largest encoder's transient for registry.text_cache_batch captions
    (with an fp8 base, beside the bf16 copy of the unit the layerwise hook casts: a T5 feed-forward block's
    Linears together); 0 where nothing is cached. Beside a FLUX.1 base T5-XXL's 9 GiB did not fit a 12 GB card;
    alone, it is what the pass needs: an 8 GB card needs the fp8 base's fp8 T5."""
    if not s.cache_text_encoder_outputs:
        return 0.0
    model = profiles.model(s.model)
    encoders = stored_text_encoder_bytes(model, s)
    upcast = flow_family(s.model) and s.base_precision == "fp8"
    transient = 0.0
    for te in model.text_encoders:
        cfg, length = te["config"], int(te.get("max_length") or model.tokenizer_max_length)
        heads = int(cfg.get("num_heads") or cfg.get("num_attention_heads"))
        ff = int(cfg.get("d_ff") or cfg.get("intermediate_size"))
        width = int(cfg.get("d_model") or cfg.get("hidden_size"))
        one = heads * length**2 * _ATTENTION_BYTES_PER_SCORE + _FF_TENSORS * length * ff * 2
        # T5's feed-forward block is cast as one (gated: wi_0, wi_1, wo); CLIP's Linears one by one
        unit = ((3 if cfg.get("is_gated_act") else 2) if "d_ff" in cfg else 1) * width * ff * 2
        transient = max(transient, registry.text_cache_batch(s.model) * one + (unit if upcast else 0))
    allocated = _vae_bytes(model, s) + encoders + transient
    return allocated + _overhead_bytes(allocated)


def sampling_peak_bytes(
    profiles: Profiles, s: Settings, *, resident: float, trained: int, trained_bytes: int
) -> float:
    """Peak bytes while sdplan's trainer samples (trainer/outputs.py): the resident training state, every
    component back on the GPU (the VAE and text encoders return even when their outputs were cached; the VAE
    in fp32 unless bf16), autocast's half copies of the fp32 trained weights (the pipeline runs inside one
    autocast region, whose cache holds them until it ends), and the larger of the UNet's guided inference
    forward and the VAE decode at the training resolution (both measured on meta). 0 when the family's
    profile has no sampling coefficients."""
    sampling = profiles.activations.families[s.model].get("sampling")
    if not sampling:
        return 0.0
    model = profiles.model(s.model)
    half = _half(s.precision)
    wb = 2 if half else 4
    full = s.method in FULL_METHODS
    comps = 0.0 if full else model.params_unet * wb
    if s.method == "textual-inversion":
        comps += (model.text_encoder_params - trained) * 4 + ti_original_rows_bytes(trained)
    elif not (full and s.train_text_encoder):
        comps += model.text_encoder_params * wb
    comps += _vae_bytes(model, s)
    # none under DeepSpeed, offloaded or not: accelerate's autocast() is a no-op there (native_amp off; DeepSpeed
    # holds the trained weights in the half dtype itself), as _assemble counts for the step
    autocast = trained * 2.0 if (half and trained_bytes == 4 and not s.deepspeed) else 0.0
    allocated = resident + comps + autocast + _grid_transient_bytes(model, s, sampling)
    return allocated + _overhead_bytes(allocated)


def _vae_dtype(s: Settings) -> str:
    """The VAE's dtype in sdplan's trainer (trainer/runtime.py vae_dtype): bf16 under bf16, else fp32."""
    return "bf16" if s.precision == "bf16" else "fp32"


def _vae_bytes(model: ModelSpec, s: Settings) -> float:
    return model.params_vae * (2 if _vae_dtype(s) == "bf16" else 4)


def _grid_transient_bytes(model: ModelSpec, s: Settings, sampling: dict) -> float:
    """A sample grid's largest transient at the training resolution: the denoiser's inference forward or the
    VAE decode (activations.yaml ``sampling``, counted on meta; the decode times VAE_DECODE_FACTOR, measured)."""
    latent = (s.resolution // model.vae_scale_factor) ** 2
    return max(
        _coef_bytes(sampling["unet_inference_peak"], latent),
        VAE_DECODE_FACTOR * _coef_bytes(sampling["vae_decode_peak"][_vae_dtype(s)], latent),
    )


def _overhead_bytes(allocated: float) -> float:
    """What a process holds beyond torch's allocated peak: the CUDA context and the caching allocator's slack."""
    return CUDA_CONTEXT_BYTES + ALLOCATOR_OVERHEAD * allocated


def _grads_between_steps(s: Settings, grads: float, buckets: float) -> float:
    """Gradient bytes still allocated between optimizer steps (while a sample grid runs): none where
    zero_grad(set_to_none=True) frees them, except under DeepSpeed offload, which keeps its buckets."""
    return 0.0 if (s.set_grads_to_none and not s.offload) else grads - buckets


def _coef_bytes(coef: dict, latent_pixels: int) -> float:
    """One sample's bytes from a per-sample coefficient set of activations.yaml."""
    return max(
        0.0, coef["linear"] * latent_pixels + coef["quadratic"] * latent_pixels**2 + coef["per_sample"]
    )


# -- time ------------------------------------------------------------------------------------------------


def _for_family(table: tuple[tuple[str, float], ...], spec: GPUSpec | None, default: float) -> float:
    """The value ``table`` holds for ``spec``'s GPU architecture family, else ``default``."""
    return dict(table).get(spec.family, default) if spec is not None else default


class SamplingRow(NamedTuple):
    """A measured denoising step (profiles/sampling.yaml) as the sampling fit reads it."""

    id: str
    gpu: str
    arch: str  # the GPU's architecture family (GPUSpec.family)
    matmul_s: float  # the denoiser batch's FLOPs over the measured GEMM rate
    bandwidth_s: float  # its bytes over the memory bandwidth at efficiency 1
    seconds: float  # measured: 1 / it/s

    def predicted(self, efficiency: float, floor_s: float) -> float:
        return max(floor_s, self.matmul_s, self.bandwidth_s / efficiency)


class SamplingFit(NamedTuple):
    """Sampling's bandwidth efficiency (one for every GPU, and per architecture where measured) and launch-bound
    floor per denoising step, fitted by :func:`fit_sampling`."""

    efficiency: float | None = None  # None: nothing measured, the time is not known
    floor_s: float = 0.0
    by_arch: tuple[tuple[str, float], ...] = ()

    def efficiency_for(self, spec: GPUSpec | None) -> float | None:
        """The efficiency on ``spec``: its architecture's where measured, else the all-GPU one."""
        return self._of(spec.family if spec is not None else None)

    def _of(self, arch: str | None) -> float | None:
        return dict(self.by_arch).get(arch, self.efficiency) if self.efficiency else None

    def predicted(self, row: SamplingRow) -> float:
        return row.predicted(self._of(row.arch), self.floor_s)


@dataclass(frozen=True)
class Calibration:
    efficiency: float  # achieved / catalog dense half-precision TFLOPS (geometric mean over all points)
    link_efficiency: float  # achieved all-reduce bandwidth / nominal link bandwidth
    efficiency_points: tuple[tuple[str, float], ...] = ()
    link_points: tuple[tuple[str, float], ...] = ()
    by_family: tuple[tuple[str, float], ...] = ()  # GPU architecture family -> efficiency, where measured
    # the roofline's bandwidth term: counted bytes / (spec bandwidth x seconds), per point and fitted
    bandwidth_efficiency: float = BANDWIDTH_EFFICIENCY
    bandwidth_points: tuple[tuple[str, float], ...] = ()
    step_overhead_s: float = STEP_OVERHEAD_S
    fixed_samples: float = 0.0  # the UNet's per-step fixed work, in samples of traffic (FIXED_SAMPLES_GRID)
    # (family, "adapter" | "full", gradient checkpointing) -> the fastest launch-bound micro-step measured for
    # it on any GPU, in seconds (see step_floor_s); the point each comes from
    step_floors: tuple[tuple[tuple[str, str, bool], float, str], ...] = ()

    def step_floor(self, s: Settings) -> tuple[float, str] | None:
        """(seconds, where it comes from) of the floor serving ``s``: measured with its checkpointing setting
        where there is one (recomputing the forward launches its kernels again: FLUX.1 LoRA 0.48 s with, 0.45 s
        without; SD3.5 Medium 0.41 s / 0.27 s; the UNets 1.65-1.71x), else the other setting's times the
        ratio the families measured both ways have (:func:`_checkpointing_floor_ratio`)."""
        kind = _step_floor_kind(s.method)
        floors = self._floors_by_key
        model = speed_family(s.model)
        gc = bool(s.gradient_checkpointing)
        own = floors.get((model, kind, gc))
        other = floors.get((model, kind, not gc))
        if own is not None or other is None:
            return own
        ratio = self._checkpointing_ratio
        sec, pid = other
        return (
            sec * ratio if gc else sec / ratio,
            f"{pid}, measured {'without' if gc else 'with'} gradient checkpointing, "
            f"{'x' if gc else '/'}{ratio:.2f} for it as the models measured both ways",
        )

    @functools.cached_property
    def memo(self) -> dict:
        """Lookups that depend on this calibration only, kept while it lives (one plan's search)."""
        return {}

    @functools.cached_property
    def _floors_by_key(self) -> dict[tuple[str, str, bool], tuple[float, str]]:
        return {k: (sec, pid) for k, sec, pid in self.step_floors}

    @functools.cached_property
    def _checkpointing_ratio(self) -> float:
        return _checkpointing_floor_ratio(self.step_floors)

    def step_floor_s(self, s: Settings) -> float | None:
        """No prediction is faster than the fastest micro-step measured for its family and kind of training.
        On an H100 the step time barely grows with the batch at batch 1-8 (SD1.5 LoRA 0.16-0.17 s, SDXL LoRA
        0.60-0.64 s: the host launching the kernels, not the GPU, sets it), where the roofline predicted up to
        3x faster; a floor from measurements is what the model cannot extrapolate. It depends on the host's
        CPU: one measured on a slower host errs on the slow side."""
        floor = self.step_floor(s)
        return floor[0] if floor else None

    # DeepSpeed's CPU Adam rate (parameters per second) that offload's time uses, and where it comes from: the
    # shipped figure, or this host's own (calibrate_for)
    cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S
    cpu_adam_source: str = CPU_ADAM_SOURCE

    # sampling's bandwidth efficiency and launch-bound floor per denoising step (fit_sampling on
    # profiles/sampling.yaml; an empty fit: no sampling speed measured, the time is not known)
    sampling: SamplingFit = SamplingFit()

    # GPU architecture family -> the UNets' bandwidth efficiency fitted on the sdplan bench speeds measured
    # there (at least BENCH_MIN_POINTS); the published one above elsewhere
    bandwidth_by_family: tuple[tuple[str, float], ...] = ()

    def bandwidth_efficiency_for(self, spec: GPUSpec | None) -> float:
        """The UNets' bandwidth efficiency on ``spec``: fitted on sdplan bench speeds of its architecture where
        there are enough (bandwidth_by_family), else one for every GPU, fitted on published speeds (the
        architectures differ through their measured GEMM ceiling and their memory bandwidth; fitted per
        architecture on one or two published speeds each, leave-one-source-out got worse, 40% median against
        27%). On the H100 (28 points, 2026-11-26) the bench fit is 2x the published one: the global fit
        predicted its large batches up to 2.6x too slow."""
        return _for_family(self.bandwidth_by_family, spec, self.bandwidth_efficiency)

    # the transformer families (SD3.5 / FLUX.1): one efficiency fitted on their own published speeds (big
    # transformers keep the GPU far busier than the UNets at batch 1); None: none published (the UNets' then)
    flow_efficiency: float | None = None
    # the models (speed families) of the published points behind flow_efficiency (all FLUX.1 [dev] today)
    flow_published_models: tuple[str, ...] = ()
    flow_points: tuple[tuple[str, float], ...] = ()
    # GPU architecture family -> the transformer families' efficiency measured there by `sdplan bench` (at
    # least BENCH_MIN_POINTS points); the one above elsewhere
    flow_by_family: tuple[tuple[str, float], ...] = ()
    # (GPU architecture family, model) -> that model's efficiency there, where sdplan bench measured the model at
    # least BENCH_MIN_POINTS times on the architecture: a smaller transformer keeps the GPU less busy
    flow_by_model: tuple[tuple[tuple[str, str], float], ...] = ()
    # the bf16 GEMM rates (TFLOPS) the transformer families' efficiencies were measured at: (architecture of
    # flow_by_family, or None for the published fit, rate), one per GPU
    flow_rates: tuple[tuple[str | None, float], ...] = ()

    def flow_source(self, spec: GPUSpec | None) -> tuple[str | None, bool]:
        """(architecture whose sdplan bench efficiency serves ``spec``, or None for the published one; whether
        it is borrowed from another architecture). An architecture without its own takes the one measured at
        the GEMM rate nearest ``spec``'s (log scale): the published consumer-card fit (44-167 TFLOPS, 0.66-1.13)
        is not stretched to a B200's 2250 TFLOPS when an H100 (786, 0.36) was measured nearer. The efficiency
        falls as the GEMM rate rises: the attention and elementwise work the FLOP count leaves out weigh more."""
        if spec is None:
            return None, False
        if spec.family in dict(self.flow_by_family):
            return spec.family, False
        rate = spec.matmul_tflops("bf16")
        if not self.flow_rates or not rate:
            return None, False
        arch, _ = min(self.flow_rates, key=lambda r: abs(math.log(rate / r[1])))
        return arch, arch is not None

    def flow_efficiency_for(self, spec: GPUSpec | None, model: str | None = None) -> float:
        """The transformer families' FLOP efficiency on ``spec`` for ``model``: that model's own where sdplan
        bench measured it enough on the architecture (flow_by_model), else the architecture's (on the H100,
        2026-11-26: 0.36 of its measured GEMM rate over 33 points of three models, fitted with the launch-bound
        floor (_fit_with_floor; 0.26-0.42 by model where the step grows with the batch); about 0.4 of what
        four published consumer-card and T4 speeds give, as the attention and elementwise work that the FLOP
        count leaves out weigh more where the GEMM rate is this high), else the published one; an architecture
        with none of its own takes the one measured nearest its GEMM rate (flow_source)."""
        arch, _ = self.flow_source(spec)
        if arch is None:
            base = self.flow_efficiency or self.efficiency_for(spec)
            return base * (self.flow_model_ratio(model)[0] if model else 1.0)
        own = dict(self.flow_by_model).get((arch, speed_family(model))) if model else None
        if own is not None:  # on the H100, SD3.5 Medium at 0.26, SD3.5 Large 0.32, FLUX.1 [dev] 0.41
            return own
        return dict(self.flow_by_family)[arch]

    def flow_model_ratio(self, model: str) -> tuple[float, str | None]:
        """(factor, architecture it was measured on) that carries the published efficiency, fitted on other
        models' speeds, over to ``model``: its efficiency against theirs where sdplan bench measured both on
        one architecture (the H100, 2026-11-26: SD3.5 Medium 0.26, Large 0.32, FLUX.1 [dev] 0.41 of its GEMM
        rate; a smaller transformer keeps the GPU less busy), else (1.0, None)."""
        own = speed_family(model)
        published = self.flow_published_models
        if not published or own in published:
            return 1.0, None
        by_model = dict(self.flow_by_model)
        for arch, _ in self.flow_by_family:
            if (arch, own) in by_model and all((arch, m) in by_model for m in published):
                theirs = _geomean([by_model[(arch, m)] for m in published])
                return by_model[(arch, own)] / theirs, arch
        return 1.0, None

    def efficiency_for(self, spec: GPUSpec | None) -> float:
        """The FLOP efficiency (families without byte counts, the encoders that run every step): one
        geometric mean, by_family only where a caller fills it (calibrate() no longer does: with one or two
        speeds per architecture it reproduced each and missed by 53% leaving a source out)."""
        return _for_family(self.by_family, spec, self.efficiency)


def step_flops(profiles: Profiles, s: Settings) -> float:
    """FLOPs of one micro-step of one process (forward + backward + recomputation is handled as time)."""
    if flow_family(s.model):
        return step_flops_flow(profiles, s)
    return sum(step_flops_parts(profiles, s))


def step_flops_parts(profiles: Profiles, s: Settings) -> tuple[float, float]:
    """(UNet, VAE + text encoders) FLOPs of one micro-step of a UNet family: the roofline covers the UNet, whose
    bytes are counted; the encoders that run every step (latents or text-encoder outputs not cached) add their
    FLOPs."""
    act = profiles.activations
    model = profiles.model(s.model)
    batch = s.batch * (2 if s.prior_preservation else 1)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    f_unet = act.unet_forward_flops(s.model, latent) * batch
    unet = f_unet * (3.0 if s.method in FULL_METHODS else 2.0)  # frozen UNet: input gradients only
    if s.gradient_checkpointing:
        unet *= GC_TIME_FACTOR
    other = 0.0
    if not s.cache_latents:
        other += act.vae_encode_flops(s.model, latent) * s.batch
    if not s.cache_text_encoder_outputs:
        te = act.text_encoder_flops(s.model) * batch
        other += te * (3.0 if (s.train_text_encoder or s.method == "textual-inversion") else 1.0)
    return unet, other


def step_traffic_bytes(profiles: Profiles, s: Settings, fixed_samples: float = 0.0) -> float:
    """Bytes the bandwidth-bound ops of the UNet move in one micro-step (0 when not computed for the family);
    fixed_samples adds the per-step fixed work as that many more samples' bytes (Calibration.fixed_samples)."""
    if flow_family(s.model):
        return 0.0  # not computed for the transformer families
    model = profiles.model(s.model)
    batch = s.batch * (2 if s.prior_preservation else 1)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    forward = profiles.activations.unet_forward_traffic_bytes(s.model, latent, s.attention)
    if forward is None:
        return 0.0
    # checkpointing re-runs the forward: GC_TIME_FACTOR of the step, as on the matmul side (one cost for one
    # effect; a whole extra forward of traffic charged +33%, where the T4 DreamBooth pairs of profiles/ measured
    # +23% and the field notes give 20-30%)
    passes = (1.0 + BACKWARD_TRAFFIC) * (GC_TIME_FACTOR if s.gradient_checkpointing else 1.0)
    element = (
        2.0 if s.precision == "fp32" else 1.0
    )  # counted in half precision; fp32 moves 4 bytes an element
    return forward * (batch + fixed_samples) * passes * element


def step_traffic_seconds(
    profiles: Profiles, s: Settings, spec: GPUSpec | None, cal: Calibration | None = None
) -> float:
    """The roofline's bandwidth time of one micro-step (0 when the bytes or the bandwidth are unknown)."""
    if spec is None or not spec.memory_bandwidth_gbs:
        return 0.0
    eff = cal.bandwidth_efficiency_for(spec) if cal is not None else BANDWIDTH_EFFICIENCY
    fixed = cal.fixed_samples if cal is not None else 0.0
    return step_traffic_bytes(profiles, s, fixed) / (spec.memory_bandwidth_gbs * 1e9 * eff)


def step_compute_seconds(profiles: Profiles, s: Settings, spec: GPUSpec, cal: Calibration) -> float:
    """The compute of a micro-step: the UNet's roofline and the encoders run every step
    (:func:`unet_step_parts`)."""
    p = unet_step_parts(profiles, s, spec, cal)
    return p.roofline + p.encoders


class StepParts(NamedTuple):
    """The terms of a UNet family's micro-step on one GPU, as :func:`_compute_step_times` adds them and
    :func:`time_basis_text` states them (one owner for both)."""

    matmul: float  # the UNet's FLOPs over the measured matmul rate
    traffic: float  # the UNet's bandwidth-bound bytes over the fitted bandwidth (0: no byte count)
    roofline: (
        float  # the UNet's time: max(matmul, traffic); with no byte count, its FLOPs at the fitted efficiency
    )
    encoders: float  # VAE encode / text encoders run every step (not cached), FLOPs at the fitted efficiency
    vae: float  # the VAE encode's share of ``encoders`` (it adds above the launch-bound floor)
    optimizer: float  # the optimizer step's own memory traffic (:func:`optimizer_step_seconds`)
    overhead: float  # the fitted per-step overhead
    offload: float  # DeepSpeed's optimizer offload (:func:`offload_seconds`)
    ema: float  # an EMA in host RAM (:func:`ema_seconds`)


def unet_step_parts(profiles: Profiles, s: Settings, spec: GPUSpec, cal: Calibration) -> StepParts:
    """A UNet family's micro-step on ``spec`` term by term: the UNet's roofline, max(matmul time at the
    measured GEMM rate, bandwidth time) (where the family has no byte count, its FLOPs at the efficiency fitted
    on published speeds), the encoders' FLOPs at that efficiency, the optimizer step, the per-step overhead,
    offload and EMA."""
    unet, other = step_flops_parts(profiles, s)
    rate = spec.matmul_tflops(s.precision) * 1e12
    eff = cal.efficiency_for(spec)
    traffic = step_traffic_seconds(profiles, s, spec, cal)
    roofline = max(unet / rate, traffic) if traffic > 0 else unet / (rate * eff)
    encoders = other / (rate * eff)
    vae = 0.0
    if not s.cache_latents:
        vae = encoders - step_flops_parts(profiles, _with(s, cache_latents=True))[1] / (rate * eff)
    return StepParts(
        matmul=unet / rate,
        traffic=traffic,
        roofline=roofline,
        encoders=encoders,
        vae=vae,
        optimizer=optimizer_step_seconds(profiles, s, spec),
        overhead=cal.step_overhead_s,
        offload=offload_seconds(profiles, s, spec, cal.cpu_adam_params_per_s),
        ema=ema_seconds(profiles, s, spec, cal.cpu_adam_params_per_s),
    )


def optimizer_step_seconds(profiles: Profiles, s: Settings, spec: GPUSpec) -> float:
    """The optimizer step's own memory traffic on the GPU, spread over the accumulated micro-steps (none when
    DeepSpeed offloads the optimizer: :func:`offload_seconds`; DeepSpeed without offload updates each process's
    1/N of the parameters)."""
    if s.offload:
        return 0.0
    t = trainable_params(profiles.model(s.model), s, profiles)
    if s.deepspeed:
        t /= s.num_gpus
    opt_bytes = OPTIMIZER_STEP_BYTES.get(s.optimizer, 28)
    return t * opt_bytes / (spec.memory_bandwidth_gbs * 1e9) / s.grad_accum


def gpu_tflops(gpu: HWGPU | GPUSpec | None, precision: str) -> float | None:
    spec = gpu if isinstance(gpu, GPUSpec) else (gpu.spec if gpu is not None else None)
    return spec.matmul_tflops(precision) if spec is not None else None


def step_seconds(
    profiles: Profiles, s: Settings, gpu: HWGPU | GPUSpec, cal: Calibration, *, link_gbs: float | None = None
) -> float | None:
    """Seconds per micro-step of one process, all overheads included; None when the GPU's speed is unknown."""
    times = _step_times(profiles, s, gpu, cal, link_gbs=link_gbs)
    return times[0] if times is not None else None


def _step_times(
    profiles: Profiles, s: Settings, gpu: HWGPU | GPUSpec, cal: Calibration, *, link_gbs: float | None = None
) -> tuple[float, float] | None:
    """(seconds per micro-step, the same without the launch-bound floor): the floor sets the step where the
    two differ (:func:`floor_text`); None when the GPU's speed is unknown.

    A pure function of its arguments (of ``gpu``, only its catalog spec), kept in ``cal.memo``: a search asks
    for the one-GPU step of every multi-GPU candidate again, and plans on other hardware or with other pins
    ask for many of the same. The key holds the profiles and the spec by identity, and the entry keeps both
    alive, so an id is never another object's."""
    spec = gpu if isinstance(gpu, GPUSpec) else gpu.spec
    if s.num_gpus == 1:
        link_gbs = None  # one process exchanges nothing: one entry whatever link the hardware has
    key = ("step_times", id(profiles), id(spec), link_gbs, type(link_gbs), _settings_key(s))
    table = cal.memo.setdefault("step_times", {})
    entry = _memo(table, key, lambda: (profiles, spec, _step_times_on(profiles, s, spec, cal, link_gbs)))
    return entry[2]


def _step_times_on(
    profiles: Profiles, s: Settings, spec: GPUSpec | None, cal: Calibration, link_gbs: float | None
) -> tuple[float, float] | None:
    if s.num_gpus > 1 and not s.deepspeed:
        # without DeepSpeed the count changes only the all-reduce added to one process's step: exactly what
        # _compute_step_times gives, with one step computed for all the counts a search plans
        one = _step_times(profiles, _count_free(s, 1), spec, cal)
        if one is None or not link_gbs:
            return one
        allreduce = comm_seconds(profiles, s, link_gbs, cal)
        return (one[0] + allreduce, one[1] + allreduce)
    return _compute_step_times(profiles, s, spec, cal, link_gbs)


def _compute_step_times(
    profiles: Profiles, s: Settings, spec: GPUSpec | None, cal: Calibration, link_gbs: float | None
) -> tuple[float, float] | None:
    tflops = gpu_tflops(spec, s.precision)
    if not tflops:
        return None
    if flow_family(s.model):  # FLOPs at the efficiency fitted on the families' own speeds (no byte counts)
        eff = cal.flow_efficiency_for(spec, s.model)

        def flops_seconds(x: Settings) -> float:
            return step_flops_flow(profiles, x) / (tflops * 1e12 * eff)

        flops_s = flops_seconds(s)
        compute = flops_s + step_traffic_seconds(profiles, s, spec, cal)
        # the launch-bound floors were measured with latents and text-encoder outputs cached and a bf16 base:
        # encoding them every step adds to the floor, not under it (as the UNets' VAE encode below); so do block
        # swap's PCIe copies (measured without swap) and a quantized base's dequantisation
        encode = flops_s - flops_seconds(_with(s, cache_latents=True, cache_text_encoder_outputs=True))
        base = compute - encode + optimizer_step_seconds(profiles, s, spec) + STEP_OVERHEAD_S
        after = (
            encode
            + swap_seconds(profiles, s, spec)
            + dequant_seconds(profiles, s)
            + offload_seconds(profiles, s, spec, cal.cpu_adam_params_per_s)
            + ema_seconds(profiles, s, spec, cal.cpu_adam_params_per_s)
        )
    else:
        p = unet_step_parts(profiles, s, spec, cal)
        # the launch-bound floor is a step with cached latents: a VAE encode every step adds to it, not under
        # it; the floors were measured without offload or an EMA in host RAM
        base = p.roofline + p.encoders - p.vae + p.optimizer + p.overhead
        after = p.vae + p.offload + p.ema
    times = (max(base, cal.step_floor_s(s) or 0.0) + after, base + after)
    if s.num_gpus > 1 and link_gbs:
        allreduce = comm_seconds(profiles, s, link_gbs, cal)
        times = tuple(t + allreduce for t in times)
    return times


def floor_text(profiles: Profiles, s: Settings, spec: GPUSpec | None, cal: Calibration) -> str | None:
    """Where the launch-bound floor, not the model, sets the step time: the measurement it comes from, in
    words (None where the model's step is slower than the floor)."""
    floor = cal.step_floor(s)
    times = _step_times(profiles, s, spec, cal) if spec is not None and floor is not None else None
    if times is None or times[1] >= times[0]:
        return None
    return (
        f"launch-bound: no micro-step faster than {floor[0]:.2f} s, the fastest measured for {s.model} "
        f"{_step_floor_kind(s.method)} training where a larger batch took hardly longer ({floor[1]}); the model "
        f"alone says {times[1]:.2f} s"
    )


def time_basis_text(
    profiles: Profiles, s: Settings, gpu: HWGPU, cal: Calibration, allreduce: float = 0.0
) -> str:
    """Which roofline term sets the step time on this GPU, and every term the step adds to it
    (:func:`unet_step_parts`, what :func:`_compute_step_times` sums), in words that add up to the step;
    ``allreduce``: the gradient exchange a multi-GPU plan adds to each micro-step."""
    spec = gpu.spec
    if spec is None:
        return "no speed known"
    floored = floor_text(profiles, s, spec, cal)
    if floored is not None:
        return floored
    p = unet_step_parts(profiles, s, spec, cal)
    eff = f"{cal.efficiency_for(spec) * 100:.0f}%"
    if p.traffic <= 0:
        said = (
            f"{p.roofline:.2f} s of FLOPs of the {s.model} UNet at {s.resolution}px over {gpu.name}'s measured "
            f"matmul rate at {eff} efficiency (fitted on published speeds)"
        )
    else:
        bound = "memory bandwidth" if p.traffic >= p.matmul else "matmul throughput"
        said = (
            f"bound by {bound} on {gpu.name} ({spec.memory_bandwidth_gbs:g} GB/s, "
            f"{spec.matmul_tflops(s.precision):g} TFLOPS): {p.traffic:.2f} s of memory traffic vs {p.matmul:.2f} s "
            f"of matmul per micro-step in the UNet (the traffic includes the per-step fixed work of "
            f"{cal.fixed_samples:g} samples)"
        )
    encoded = " and ".join(
        what
        for on, what in (
            (not s.cache_latents, "the VAE encode"),
            (
                not s.cache_text_encoder_outputs,
                "the text encoder" + ("s" if len(profiles.model(s.model).text_encoders) > 1 else ""),
            ),
        )
        if on
    )
    terms = [
        (p.encoders, f"of {encoded} (not cached; FLOPs at the fitted {eff} efficiency)"),
        (p.optimizer, f"of the {s.optimizer} step's memory traffic"),
        (p.overhead, f"per-step overhead (fitted on {len(cal.bandwidth_points)} published speeds)"),
        (p.offload, "of DeepSpeed optimizer offload"),
        (p.ema, "of the EMA in host RAM"),
        (allreduce, "of gradient exchange with the other GPUs"),
    ]
    plus = [f"{x:.2f} s {what}" for x, what in terms if round(x, 2) > 0 or what.startswith("per-step")]
    total = p.roofline + p.encoders + p.optimizer + p.overhead + p.offload + p.ema + allreduce
    return f"{said}, plus {', '.join(plus)}: {total:.2f} s a micro-step" + (
        f"; the bandwidth efficiency ({cal.bandwidth_efficiency_for(spec) * 100:.0f}%) fitted on sdplan bench "
        f"speeds of {spec.family.capitalize()} GPUs"
        if p.traffic > 0 and spec.family in dict(cal.bandwidth_by_family)
        else ""
    )


def gradient_bytes(profiles: Profiles, s: Settings) -> float:
    model = profiles.model(s.model)
    tb = 2 if s.half_weights or (_half(s.precision) and s.deepspeed) else 4
    return trainable_params(model, s, profiles) * tb


def allreduce_seconds(profiles: Profiles, s: Settings, link_gbs: float, cal: Calibration) -> float:
    n = s.num_gpus
    if n <= 1:
        return 0.0
    moved = gradient_bytes(profiles, s) * 2 * (n - 1) / n  # ring all-reduce
    return moved / (link_gbs * 1e9 * cal.link_efficiency)


def comm_seconds(profiles: Profiles, s: Settings, link_gbs: float, cal: Calibration) -> float:
    """The gradient exchange's seconds per micro-step. DDP all-reduces once per optimizer step (no_sync on the
    accumulated micro-steps). DeepSpeed ZeRO-2 moves as much in two halves: each micro-step's backward
    reduce-scatters the gradients into their owners' partitions, and after the optimizer step every process
    all-gathers the updated weights (stage_1_and_2.py: reduce_ipg_grads per micro-step, all_gather_dp_groups
    after step)."""
    full = allreduce_seconds(profiles, s, link_gbs, cal)
    if s.deepspeed:
        return full / 2 + full / 2 / s.grad_accum
    return full / s.grad_accum


def setup_from_point(p: MethodPoint, attention: str | None = None) -> Settings:
    return replace(p.settings, attention=attention) if attention else p.settings


def calibrate(profiles: Profiles) -> Calibration:
    """Fit the compute efficiency on published/measured speeds and the link efficiency on multi-GPU runs."""
    speeds = []
    for p in profiles.points:
        it_s = p.outcome.get("it_s")
        spec = profiles.point_gpu(p)
        # the transformer families' speeds have their own efficiency (_flow_efficiency_points)
        if it_s and p.fit_speed and spec is not None and p.num_gpus == 1 and not flow_family(p.model):
            s = setup_from_point(p)
            speeds.append((p, spec, s, 1.0 / it_s - optimizer_step_seconds(profiles, s, spec)))
    # the FLOP efficiency (families without byte counts, and the encoders that run every step), then the
    # per-step overhead and the UNet's bandwidth efficiency on what the encoders leave of each step
    flop_eff = [
        step_flops(profiles, s) / (spec.matmul_tflops(s.precision) * 1e12) / (seconds - STEP_OVERHEAD_S)
        for _, spec, s, seconds in speeds
        if seconds > STEP_OVERHEAD_S
    ]
    flop_efficiency = _geomean(flop_eff) if flop_eff else 0.1

    def encoders(spec: GPUSpec, s: Settings) -> float:
        return step_flops_parts(profiles, s)[1] / (spec.matmul_tflops(s.precision) * 1e12 * flop_efficiency)

    unet_speeds = [(p, spec, s, seconds - encoders(spec, s)) for p, spec, s, seconds in speeds]
    overhead, fixed = _fit_step_fixed_cost(profiles, unet_speeds)
    eff: list[tuple[str, float, str]] = []
    bw: list[tuple[str, float, str]] = []
    base = Calibration(efficiency=1.0, link_efficiency=1.0, step_overhead_s=overhead, fixed_samples=fixed)
    for p, spec, s, seconds in speeds:
        measured = seconds - overhead
        if measured <= 0:
            continue
        ideal = step_flops(profiles, s) / (spec.matmul_tflops(s.precision) * 1e12)
        eff.append((p.id, ideal / measured, spec.family))
        moved = step_traffic_bytes(profiles, s, fixed)
        unet_measured = measured - encoders(spec, s)
        if moved > 0 and spec.memory_bandwidth_gbs and unet_measured > 0:
            bw.append((p.id, moved / (spec.memory_bandwidth_gbs * 1e9 * unet_measured), spec.family))

    cal = replace(
        base,
        efficiency=_geomean([e for _, e, _ in eff]) if eff else 0.1,
        efficiency_points=tuple((i, e) for i, e, _ in eff),
        bandwidth_efficiency=_geomean([e for _, e, _ in bw]) if bw else BANDWIDTH_EFFICIENCY,
        bandwidth_points=tuple((i, e) for i, e, _ in bw),
    )
    cal = replace(cal, step_floors=_step_floors(profiles))
    cal = replace(cal, bandwidth_by_family=_bench_bandwidth_efficiencies(profiles, cal))
    flow = _flow_efficiency_points(profiles)
    if flow:
        ids = {i for i, _ in flow}
        models = tuple(sorted({speed_family(p.model) for p in profiles.points if p.id in ids}))
        cal = replace(
            cal,
            flow_efficiency=_geomean([e for _, e in flow]),
            flow_points=tuple(flow),
            flow_published_models=models,
        )
    by_family, by_model = _flow_bench_efficiencies(profiles, cal)
    cal = replace(cal, flow_by_family=by_family, flow_by_model=by_model)
    cal = replace(cal, flow_rates=_flow_rates(profiles, cal))
    links: list[tuple[str, float]] = []
    for m in profiles.multi_gpu:
        spec = profiles.gpu_or_none(m.gpu)
        ratio = m.outcome.get("iteration_time_ratio")
        if spec is None or not ratio or ratio <= 1:
            continue
        s = replace(m.settings, num_gpus=1)
        t1 = step_seconds(profiles, s, spec, cal)
        nominal = _link_gbs_for(spec, m.interconnect)
        multi = replace(s, num_gpus=m.num_gpus)
        needed = (ratio - 1.0) * t1  # extra seconds per iteration
        moved = gradient_bytes(profiles, multi) * 2 * (m.num_gpus - 1) / m.num_gpus
        links.append((m.id, moved / (needed * nominal * 1e9)))
    link_eff = _geomean([v for _, v in links]) if links else LINK_EFFICIENCY_FALLBACK
    return replace(
        cal,
        link_efficiency=link_eff,
        link_points=tuple(links),
        sampling=fit_sampling(sampling_rows(profiles)),
    )


@functools.lru_cache(maxsize=64)
def speed_family(model: str) -> str:
    """The family whose measured speeds serve ``model``: the same network under another name
    (``registry.Family.speed_as``: FLUX.1 [schnell] is [dev] without its guidance embedder), else itself."""
    try:
        return registry.family(model).speed_as or model
    except UsageError:
        return model


def calibrate_for(profiles: Profiles, hardware: Hardware) -> Calibration:
    """:func:`calibrate`, with what ``hardware``'s host measured of itself (`sdplan bench --host`: its CPU Adam
    rate) in place of the shipped figure.

    :func:`calibrate` depends on ``profiles`` alone, and every plan asked for it again (a fifth of a plan's
    time): it is kept in ``profiles.memo``, which lives and dies with this Profiles object
    (``dataclasses.replace`` starts an empty one). Safe to share: Profiles and Calibration are frozen, and
    ``Calibration.memo`` holds only lookups that are pure functions of the calibration and these profiles."""
    if "calibration" not in profiles.memo:
        profiles.memo["calibration"] = calibrate(profiles)
    cal = profiles.memo["calibration"]
    if hardware.host is not None:
        cal = replace(
            cal,
            cpu_adam_params_per_s=hardware.host.cpu_adam_params_per_s,
            cpu_adam_source=f"measured on this host by `sdplan bench --host` ({hardware.host.source})",
        )
    return cal


def _step_floor_kind(method: str) -> str:
    return "adapter" if method in ("lora", "textual-inversion") else "full"


FLAT_STEP_RATIO = 1.25  # a step this close to the one at twice the batch or more is launch-bound


def _checkpointing_floor_ratio(floors: tuple[tuple[tuple[str, str, bool], float, str], ...]) -> float:
    """How much longer a launch-bound micro-step is with gradient checkpointing than without: the geometric
    mean over the (family, kind of training) measured both ways (H100, 2026-11-26/27: FLUX.1 LoRA at 512 px
    1.08, SD3.5 Medium 1.50, SD1.5 1.71, SDXL 1.65; the recomputed forward launches its kernels again). 1.0
    where no pair was measured."""
    by_key = {k: sec for k, sec, _ in floors}
    ratios = [
        sec / by_key[(model, kind, False)]
        for (model, kind, gc), sec in by_key.items()
        if gc and (model, kind, False) in by_key
    ]
    return _geomean(ratios) if ratios else 1.0


def _step_floors(profiles: Profiles) -> tuple[tuple[tuple[str, str, bool], float, str], ...]:
    """Per (family, kind of training, checkpointing): the shortest launch-bound micro-step measured. A point
    is launch-bound where the same GPU and settings at twice the batch or more took at most FLAT_STEP_RATIO as
    long (the step did not grow with the work). The shortest step of any point would not do: on a family whose fastest
    measurement is a T4's, that would cap every faster GPU at a T4's speed. The transformer families too (H100,
    2026-11-26: FLUX.1 LoRA 0.45 s at 512 px batch 1, 0.43 s at batch 2; SD3.5 Medium 0.41 s at batch 1, 0.50
    s at batch 2): without it a B200's FLUX.1 step was predicted 7x faster than measured. Where only one
    checkpointing setting was measured (the UNets' full training: without) its floor serves the other too,
    scaled by the checkpointing ratio of the pairs measured (Calibration.step_floor)."""
    series: dict[tuple, list[tuple[int, float, str]]] = {}
    for p in profiles.points:
        it_s = p.outcome.get("it_s")
        if not it_s or p.num_gpus != 1 or p.grad_accum != 1 or not p.gpu or p.settings.blocks_to_swap:
            continue
        if not p.settings.cache_latents:  # step_seconds adds the VAE encode to the floor
            continue
        # DeepSpeed's step is its optimizer's (CPU Adam with offload), not the launches'
        if p.settings.deepspeed:
            continue
        series.setdefault((p.gpu, replace(p.settings, batch=1)), []).append((p.batch, 1.0 / it_s, p.id))
    best: dict[tuple[str, str, bool], tuple[float, str]] = {}
    for (_, settings), pts in series.items():
        for batch, sec, pid in pts:
            if not any(b >= 2 * batch and other <= FLAT_STEP_RATIO * sec for b, other, _ in pts):
                continue
            key = (
                speed_family(settings.model),
                _step_floor_kind(settings.method),
                bool(settings.gradient_checkpointing),
            )
            if key not in best or sec < best[key][0]:
                best[key] = (sec, pid)
    return tuple((k, sec, pid) for k, (sec, pid) in sorted(best.items()))


# sdplan bench speeds that give a GPU architecture its own efficiency (the UNets' bandwidth efficiency, the
# transformer families' FLOP efficiency): fewer would let one noisy series set it
BENCH_MIN_POINTS = 5
BANDWIDTH_EFFICIENCY_GRID = tuple(0.01 * 1.03**i for i in range(160))  # 0.01 .. 1.1, 3% apart


def _grid_argmin(grid: tuple[float, ...], f: Callable[[float], float], stride: int = 8) -> float:
    """The grid value where ``f`` is least: every ``stride``-th value, then every value around the best of those
    (each ``f`` here predicts a whole series of steps: 36 of them instead of 160 for a 3%-step grid). The
    shipped profiles' fits, and every left-out fit benchmarks/planner_accuracy.py makes, equal the full scan's."""
    coarse = min(range(0, len(grid), stride), key=lambda i: f(grid[i]))
    fine = range(max(0, coarse - stride + 1), min(len(grid), coarse + stride))
    return grid[min(fine, key=lambda i: f(grid[i]))]


def _bench_bandwidth_efficiencies(profiles: Profiles, cal: Calibration) -> tuple[tuple[str, float], ...]:
    """Per GPU architecture family with at least BENCH_MIN_POINTS sdplan bench speeds of the UNet families (one
    GPU): the bandwidth efficiency whose whole step prediction (roofline, overhead, launch-bound floor) fits
    them best, least squares on log time. The floor absorbs the flat small batches, so the batches where the
    step grows with the work set it. Fitting it there as for the published speeds (a geometric mean of each
    point's ratio) would read the launch-bound steps as slow memory."""
    by: dict[str, list[tuple[Settings, GPUSpec, float]]] = {}
    for p in profiles.points:
        it_s, spec = p.outcome.get("it_s"), profiles.point_gpu(p)
        if not (p.from_bench and it_s and spec is not None and spec.memory_bandwidth_gbs):
            continue
        # DeepSpeed's step is its optimizer's (CPU Adam with offload), not the GPU's memory traffic
        if p.num_gpus != 1 or flow_family(p.model) or p.settings.deepspeed:
            continue
        by.setdefault(spec.family, []).append((setup_from_point(p), spec, 1.0 / it_s))

    def error(fam: str, rows: list, eff: float) -> float:
        c = replace(cal, bandwidth_by_family=((fam, eff),))
        return sum(math.log(step_seconds(profiles, s, spec, c) / sec) ** 2 for s, spec, sec in rows)

    return tuple(
        (fam, _grid_argmin(BANDWIDTH_EFFICIENCY_GRID, lambda eff, fam=fam, rows=rows: error(fam, rows, eff)))
        for fam, rows in sorted(by.items())
        if len(rows) >= BENCH_MIN_POINTS
    )


def _fit_step_overhead(profiles: Profiles, speeds: list) -> float:
    """The per-micro-step overhead alone (no fixed work in samples): see _fit_step_fixed_cost."""
    return _fit_step_fixed_cost(profiles, speeds, fixed_grid=(0.0,))[0]


def _fit_step_fixed_cost(
    profiles: Profiles, speeds: list, fixed_grid: tuple[float, ...] = FIXED_SAMPLES_GRID
) -> tuple[float, float]:
    """(per-micro-step overhead in seconds, fixed work in samples) that, with the bandwidth efficiency at its
    geometric mean, fit the published speeds best (least squares on log time). Identifiable only where the
    speeds span several batch sizes (neither grows with the batch, the bytes do); the priors
    (STEP_OVERHEAD_S, 0) otherwise. Ties go to the smaller values (the grids are searched upwards)."""
    rows = [
        (
            step_traffic_bytes(profiles, s) / (spec.memory_bandwidth_gbs * 1e9),
            step_traffic_bytes(profiles, s, 1.0) / (spec.memory_bandwidth_gbs * 1e9)
            - step_traffic_bytes(profiles, s) / (spec.memory_bandwidth_gbs * 1e9),
            seconds,
            s.batch,
        )
        for _, spec, s, seconds in speeds
        if spec.memory_bandwidth_gbs and step_traffic_bytes(profiles, s) > 0
    ]
    if len({b for *_, b in rows}) < 2:
        return STEP_OVERHEAD_S, 0.0
    best = (math.inf, STEP_OVERHEAD_S, 0.0)
    for overhead in STEP_OVERHEAD_GRID:
        if any(seconds <= overhead for _, _, seconds, _ in rows):
            break
        for fixed in fixed_grid:
            ideal = [(t + fixed * one, seconds) for t, one, seconds, _ in rows]
            eff = _geomean([i / (seconds - overhead) for i, seconds in ideal])
            err = sum(math.log((i / eff + overhead) / seconds) ** 2 for i, seconds in ideal)
            if err < best[0] - 1e-12:
                best = (err, overhead, fixed)
    return best[1], best[2]


def sampling_rows(profiles: Profiles) -> list[SamplingRow]:
    """The measured denoising steps of profiles/sampling.yaml whose GPU is in the catalog and whose family has
    byte counts (the UNets'): the sampling fit's rows."""
    rows = []
    for p in profiles.sampling:
        spec = profiles.gpu_or_none(p.gpu)
        if spec is None or flow_family(p.family):
            continue
        parts = _denoiser_parts(
            profiles, p.family, latent_size(profiles, p.family, p.resolution), p.precision, spec
        )
        if parts is not None:
            n = denoiser_batch(p.images, p.guidance)
            rows.append(SamplingRow(p.id, p.gpu, spec.family, parts[0] * n, parts[1] * n, 1.0 / p.it_per_s))
    return rows


def fit_sampling(rows: list[SamplingRow]) -> SamplingFit:
    """The efficiency and floor that fit the measured denoising steps best, least squares on log time
    (:meth:`SamplingRow.predicted`); then each architecture's own efficiency where it has at least
    SAMPLING_MIN_POINTS steps that are not floor-bound, and the floor again with those (the UNet's elementwise work runs from cache on
    Ada's 72 MB L2 far more than on Ampere's 6 MB: the RTX 4090 samples 1.9x as fast as the RTX 3090 at the same
    1 TB/s, where the one efficiency put it 1.8x too slow). An empty fit with no rows."""
    if not rows:
        return SamplingFit()

    def error(subset: list[SamplingRow], eff: float, floor: float) -> float:
        return sum(math.log(r.predicted(eff, floor) / r.seconds) ** 2 for r in subset)

    def best_eff(floor: float) -> float:
        return _grid_argmin(SAMPLING_EFFICIENCY_GRID, lambda e: error(rows, e, floor))

    def own_efficiencies(eff: float, floor: float) -> tuple[tuple[str, float], ...]:
        by_arch = []
        for arch in sorted({r.arch for r in rows}):
            own = [r for r in rows if r.arch == arch and r.predicted(eff, 0.0) > floor]
            if len(own) >= SAMPLING_MIN_POINTS:
                by_arch.append(
                    (arch, _grid_argmin(SAMPLING_EFFICIENCY_GRID, lambda e, own=own: error(own, e, floor)))
                )
        return tuple(by_arch)

    def fit_error(fit: SamplingFit) -> float:
        return sum(math.log(fit.predicted(r) / r.seconds) ** 2 for r in rows)

    # coarse to fine over the floors too (the full scan's answer on the shipped profiles, in half the time)
    floor = _grid_argmin(SAMPLING_FLOOR_GRID, lambda f: error(rows, best_eff(f), f), stride=4)
    eff = best_eff(floor)
    by_arch = own_efficiencies(eff, floor)
    # the floor again with each architecture at its own efficiency (one efficiency for all biases it), then the
    # efficiencies at that floor
    floor = _grid_argmin(SAMPLING_FLOOR_GRID, lambda f: fit_error(SamplingFit(eff, f, by_arch)), stride=4)
    eff = best_eff(floor)
    return SamplingFit(eff, floor, own_efficiencies(eff, floor))


def _denoiser_parts(
    profiles: Profiles,
    family: str,
    latent_pixels: int,
    precision: str,
    spec: GPUSpec,
    attention: str = "efficient",
) -> tuple[float, float] | None:
    """(matmul seconds, bandwidth seconds at efficiency 1) of one UNet sample's inference forward on ``spec``
    (None: no byte count or no rates)."""
    act = profiles.activations
    traffic = act.unet_forward_traffic_bytes(family, latent_pixels, attention)
    rate = spec.matmul_tflops(precision)
    if traffic is None or not rate or not spec.memory_bandwidth_gbs:
        return None
    element = 2.0 if precision == "fp32" else 1.0
    return (
        act.unet_forward_flops(family, latent_pixels) / (rate * 1e12),
        traffic * element / (spec.memory_bandwidth_gbs * 1e9),
    )


def denoiser_batch(images: int, guided: bool) -> int:
    """The denoiser's batch for ``images`` generated at once: twice them with classifier-free guidance (the
    unconditional pass beside the conditional one)."""
    return images * (2 if guided else 1)


def uses_guidance(model: str, guidance_scale: float | None) -> bool:
    """Whether sampling ``model`` runs the denoiser twice a step (classifier-free guidance): at the guidance
    scale the trainer samples with (trainer/sampling.py guidance_for: the family's where none is set) above 1,
    and never for FLUX.1, whose guidance is an embedding."""
    from sdplan.trainer.sampling import guidance_for  # torch-free (imports torch only where it samples)

    return registry.family(model).arch != "flux" and guidance_for(guidance_scale, model) > 1.0


def latent_size(profiles: Profiles, model: str, width: int, height: int | None = None) -> int:
    """The latent pixels of a ``width`` x ``height`` (square: ``width``) image of ``model``."""
    scale = profiles.model(model).vae_scale_factor
    return (width // scale) * ((height or width) // scale)


def denoise_step_seconds(
    profiles: Profiles,
    model: str,
    latent_pixels: int,
    precision: str,
    batch: int,
    spec: GPUSpec | None,
    cal: Calibration,
    attention: str = "efficient",
) -> float | None:
    """One denoising step, the denoiser at ``batch`` (twice the images with guidance), on ``spec``: the larger of
    the fitted floor and the batch's roofline (see SAMPLING_EFFICIENCY_GRID); a transformer family's forward
    FLOPs at its training efficiency. None where the GPU's speed or sampling's calibration is unknown."""
    efficiency = cal.sampling.efficiency_for(spec)
    if spec is None or efficiency is None or not spec.matmul_tflops(precision):
        return None
    if flow_family(model):
        flops = profiles.activations.transformer_forward_flops(model, latent_pixels) * batch
        step = flops / (spec.matmul_tflops(precision) * 1e12 * cal.flow_efficiency_for(spec, model))
    else:
        parts = _denoiser_parts(profiles, model, latent_pixels, precision, spec, attention)
        if parts is None:
            return None
        step = batch * max(parts[0], parts[1] / efficiency)
    return max(cal.sampling.floor_s, step)


def decode_tflops(spec: GPUSpec, precision: str) -> float:
    """The VAE decode's convolution rate at ``precision``: fp32 convolutions run as TF32 on NVIDIA's Ampere and
    later (torch.backends.cudnn.allow_tf32 is True by default, and the trainer leaves it), half the fp16 rate;
    otherwise the precision's matmul rate."""
    nvidia = spec.vendor == "nvidia" and spec.arch.replace(".", "").isdigit()
    if precision == "fp32" and nvidia and float(spec.arch) >= 8.0:
        return spec.matmul_tflops("fp16") / 2.0
    return spec.matmul_tflops(precision)


def pipeline_seconds(
    profiles: Profiles,
    model: str,
    latent_pixels: int,
    precision: str,
    spec: GPUSpec | None,
    cal: Calibration,
    *,
    images: int,
    steps: int,
    guided: bool,
    vae_precision: str,
    attention: str = "efficient",
) -> float | None:
    """One pipeline call that generates ``images`` at once: ``steps`` denoising steps at the denoiser batch
    (the images, twice with guidance; :func:`denoise_step_seconds`), the prompt's text-encoder passes (two with
    guidance: the negative prompt too) and each image's VAE decode, FLOPs at the fitted efficiency (the decode
    at ``vae_precision``'s convolution rate, :func:`decode_tflops`). None where the time is unknown."""
    batch = denoiser_batch(images, guided)
    step = denoise_step_seconds(profiles, model, latent_pixels, precision, batch, spec, cal, attention)
    if step is None or spec is None:
        return None
    act = profiles.activations
    eff = cal.efficiency_for(spec)
    decode = (
        act.vae_decode_flops(model, latent_pixels)
        * images
        / (decode_tflops(spec, vae_precision) * 1e12 * eff)
    )
    text = act.text_encoder_flops(model) * (2 if guided else 1) / (spec.matmul_tflops(precision) * 1e12 * eff)
    return steps * step + decode + text


def image_seconds(
    profiles: Profiles,
    s: Settings,
    spec: GPUSpec | None,
    cal: Calibration,
    steps: int,
    guidance: float | None,
) -> float | None:
    """Seconds to sample one image at ``s``'s model, resolution and precision on ``spec`` as the trainer does
    (trainer/sampling.py: one image a call, the VAE in its training dtype: :func:`_vae_dtype`); kept in
    ``cal.memo`` (a search asks it for every candidate). None where the time is unknown."""
    key = ("image_seconds", id(profiles), id(spec), s.model, s.resolution, s.precision, steps, guidance)
    table = cal.memo.setdefault("image_seconds", {})

    def compute() -> tuple:
        seconds = pipeline_seconds(
            profiles,
            s.model,
            latent_size(profiles, s.model, s.resolution),
            s.precision,
            spec,
            cal,
            images=1,
            steps=steps,
            guided=uses_guidance(s.model, guidance),
            vae_precision=_vae_dtype(s),
        )
        return profiles, spec, seconds  # the entry keeps both alive: an id is never another object's

    return _memo(table, key, compute)[2]


def sampling_band(profiles: Profiles, model: str) -> tuple[tuple[float, float], str]:
    """(low, high) factors of the sampling time of ``model`` and where they come from: the validation set's
    txt2img speeds against the sampling prediction (scripts/uncertainty.py); without them, the training time's
    range."""
    unc = profiles.uncertainty
    if unc.sampling_seconds is not None:
        return unc.sampling_seconds, f"the validation set's txt2img speeds, n={unc.n_sampling_seconds}"
    band, n = unc.seconds_for(model)
    return band, f"the training time's validation range, n={n}"


class SampledImages(NamedTuple):
    """The images a run samples besides training (trainer/recipes/dreambooth.py, trainer/loop.py)."""

    classes: int  # DreamBooth's class images the class folder lacks, generated before the first step
    final: int  # the final grid's: each of sampling.prompts, else one caption
    every: int  # the grids' every sampling.every_steps optimizer steps
    at_saves: int  # the grids' at the intermediate saves (output.save_every_n_*)

    @property
    def during(self) -> int:
        """The grids' images during the run."""
        return self.every + self.at_saves

    @property
    def once(self) -> int:
        """The images no setting changes the number of (the class images and the final grid)."""
        return self.classes + self.final


def sampled_images(req: Request, steps: Steps) -> SampledImages:
    """What the trainer samples over a run of ``steps``: the class images its class folder lacks (prior
    preservation), the final grid (each prompt, else a caption), a grid every ``sample_every_steps`` optimizer
    steps (at each step that divides but the last, whose weights the final grid shows), and one at each
    intermediate save (:func:`sdplan.steps.intermediate_steps`, as the loop saves them) where no every-N grid
    was made at its step (the save copies that one). Each grid holds each prompt, else one caption."""
    classes = 0
    if req.prior_preservation:
        classes = req.class_images if req.class_images_to_generate is None else req.class_images_to_generate
    grid = max(1, req.sample_prompts)
    n = req.sample_every_steps if req.sample_every_steps > 0 else 0
    every = (steps.total_steps - 1) // n if n else 0
    saves = intermediate_steps(
        total_steps=steps.total_steps,
        steps_per_epoch=steps.steps_per_epoch,
        every_epochs=req.save_every_epochs,
        every_steps=req.save_every_steps,
    )
    own = [s for s in saves if not n or s % n]
    return SampledImages(max(0, classes), grid, every * grid, len(own) * grid)


def sampling_seconds(
    req: Request, profiles: Profiles, s: Settings, steps: Steps, spec: GPUSpec | None, cal: Calibration
) -> tuple[float, float] | None:
    """(seconds of the images no setting changes the number of, of all) a run spends sampling
    (:func:`sampled_images` x :func:`image_seconds`); None where that time is unknown."""
    one = image_seconds(profiles, s, spec, cal, req.sampling_steps, req.guidance_scale)
    if one is None:
        return None
    images = sampled_images(req, steps)
    return images.once * one, (images.once + images.during) * one


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _link_gbs_for(spec: GPUSpec | None, link: str) -> float:
    if link in ("nvlink", "xgmi") and spec is not None and spec.interconnect:
        return float(spec.interconnect["bandwidth_gbs"])
    gen = spec.pcie_gen if spec is not None and spec.pcie_gen else 4
    return PCIE_GBS.get(gen, 32.0)


# -- hardware --------------------------------------------------------------------------------------------


def attention_backend(gpu: HWGPU) -> str:
    arch = (gpu.arch or (gpu.spec.arch if gpu.spec else "") or "").lower()
    if gpu.vendor == "amd" and (arch.startswith(RDNA_MATH_ATTENTION) or not arch):
        return "math"
    return "efficient"


def hardware_from_catalog(spec: GPUSpec, count: int = 1) -> Hardware:
    gpus = tuple(
        HWGPU(
            name=spec.name,
            memory_bytes=spec.memory_bytes,
            vendor=spec.vendor,
            bf16=spec.bf16,
            fp16=spec.fp16,
            arch=spec.arch,
            spec=spec,
            index=i,
        )
        for i in range(count)
    )
    link = spec.interconnect["type"] if (spec.interconnect and count > 1) else "pcie"
    label = f"{count}x {spec.name}" if count > 1 else spec.name
    return Hardware(source="catalog", gpus=gpus, link=link, link_gbs=_link_gbs_for(spec, link), label=label)


def snapshot_packages(snapshot: Any) -> tuple[tuple[str, str | None], ...] | None:
    """The packages ``snapshot`` records installed (``software.packages``; none recorded: None, not known). Data the
    pure planner reads (:attr:`Hardware.packages`, set by :func:`hardware_from_snapshot`): a quantized base whose
    packages the machine lacks is left out of its plans (:func:`missing_bases`)."""
    software = getattr(snapshot, "software", None)
    packages = dict(getattr(software, "packages", None) or {})
    return tuple(sorted(packages.items())) if packages else None


def base_install(hw: Hardware, base_precision: str) -> tuple[str, str] | None:
    """(what is needed, the pip command) where ``hw``'s recorded packages cannot run a ``base_precision`` frozen
    base (trainer/quantize.py's rule, :func:`sdplan.trainer.quantize.install_needed`); None where they can or are
    not known."""
    if hw.packages is None or base_precision not in QUANTIZED_BASES:
        return None
    have = dict(hw.packages)
    return install_needed(
        base_precision, bitsandbytes=have.get("bitsandbytes"), diffusers=have.get("diffusers")
    )


def missing_bases(hw: Hardware) -> tuple[str, ...]:
    """The quantized frozen bases ``hw``'s recorded packages cannot run (:func:`base_install`): the search leaves
    them out, and the reasons say which would fit after which install (:func:`_after_install`)."""
    return tuple(b for b in QUANTIZED_BASES if base_install(hw, b) is not None)


def hardware_from_snapshot(snapshot: Any, profiles: Profiles, source: str = "probe") -> Hardware:
    """Build from a machine Snapshot (sdplan.machine): usable GPUs, their bf16 truth, links, RAM."""
    from sdplan.probe.snapshot import HSA_OVERRIDES, runnable_gpus, shown_gpus, trained_gpus

    gpus = []
    notes: list[str] = []
    left_out: list[tuple[int, str]] = []
    usable = snapshot.usable_gpus
    hidden: list[Any] = []
    hidden_by = ""
    if getattr(snapshot, "env", None) and (shown := shown_gpus(snapshot)) is not None:
        # what a run started here sees: the user's CUDA_VISIBLE_DEVICES (HIP_ / ROCR_) chose the GPUs
        hidden, hidden_by = [g for g in usable if g not in shown[0]], shown[1]
        if hidden:
            names = [
                ", ".join(f"GPU {g.index} ({g.name or 'unnamed'})" for g in gs) for gs in (shown[0], hidden)
            ]
            notes.append(
                f"{shown[1]} shows only {names[0]}: {names[1]} {'is' if len(hidden) == 1 else 'are'} not "
                "planned (unset it to plan for every GPU)"
            )
        usable = tuple(g for g in usable if g in shown[0])
    # NVIDIA and AMD GPUs: one torch build drives a run, so the plans are for the GPUs doctor judges and `sdplan
    # train` requires (trained_gpus: the build's vendor, else the one with the most memory)
    trained = trained_gpus(snapshot)
    if left := [g for g in usable if g not in trained]:
        build = snapshot.software.torch_build
        drives = build_vendor(snapshot)
        if drives is not None:
            why = f"this machine's torch is a {build} build: it drives the {drives.upper()} GPUs only" + (
                "" if trained else ", whose memory could not be read"
            )
        else:
            what = (
                "torch is not installed"
                if snapshot.software.torch is None
                else "torch is a CPU-only build"
                if build == "cpu"
                else "torch build is not known"
            )
            why = (
                f"this machine's {what}: planned for the {trained[0].vendor.upper()} GPUs, which have the "
                "most memory (a GPU build of torch is for one vendor)"
            )
        notes.append(
            f"{why}, so {', '.join(f'GPU {g.index} ({g.name})' for g in left)} "
            f"{'is' if len(left) == 1 else 'are'} not planned"
        )
    usable = tuple(g for g in usable if g in trained)
    # a GPU the ROCm wheels have no kernels for beside ones they have: the run goes on those (runnable_gpus;
    # doctor's fix hides it); where every GPU lacks them, they are planned, and doctor and `sdplan train` say
    # what to set
    runs = runnable_gpus(snapshot)
    if lack := [g for g in usable if g not in runs]:
        for g in lack:
            override = HSA_OVERRIDES.get(g.gfx_arch)
            left_out.append(
                (
                    g.index,
                    f"its arch {g.gfx_arch} is outside those the ROCm torch wheels ship kernels for"
                    + (
                        f" (HSA_OVERRIDE_GFX_VERSION={override[0]} runs it, and every other GPU, as that arch)"
                        if override
                        else ""
                    ),
                )
            )
        notes.append(
            f"{', '.join(f'GPU {g.index} ({g.name}, {g.gfx_arch})' for g in lack)} "
            f"{'is' if len(lack) == 1 else 'are'} outside the arches the ROCm torch wheels ship kernels for, so not "
            "planned (`sdplan doctor` says how to run it)"
        )
        usable = tuple(g for g in usable if g not in lack)
    for g in usable:
        mig = getattr(g, "mig", None)  # sdplan.machine.GPU.mig: CUDA sees the slices, memory is the largest's
        # a MIG slice's memory is not the card's: the card is looked up by its name alone (NVML's A100 and H100
        # names carry the memory: "NVIDIA A100-SXM4-80GB"), which refuses a name several entries share
        spec = profiles.gpu_or_none(g.name, None if mig else g.memory_total_bytes)
        if spec is None:  # never another GPU's entry: its own memory, and no speed to scale from
            notes.append(
                f"GPU {g.index} ({g.name or 'unnamed'}, {g.memory_total_bytes / GiB:.1f} GiB) is not in the GPU "
                "catalog: planned with its probed memory; its speed is unknown (add it to the catalog; `sdplan "
                "bench` measurements count for it once it is there)"
            )
        if mig:
            notes.append(
                f"GPU {g.index} ({g.name or 'unnamed'}) is in MIG mode: planned with its largest MIG slice's "
                f"{g.memory_total_bytes / GiB:.1f} GiB; a slice has a fraction of the card's compute (its profile's "
                "Ng: N of the card's parts, `nvidia-smi mig -lgi`), and the times are the whole card's, so they "
                "are optimistic"
            )
        bf16 = g.bf16 if g.bf16 is not None else (spec.bf16 if spec else False)
        fp16 = g.fp16 if g.fp16 is not None else True
        gpus.append(
            HWGPU(
                name=g.name or (spec.name if spec else f"GPU {g.index}"),
                memory_bytes=int(g.memory_total_bytes),
                vendor=g.vendor,
                bf16=bool(bf16),
                fp16=bool(fp16),
                arch=g.gfx_arch or g.compute_capability or (spec.arch if spec else None),
                spec=spec,
                index=g.index,
                uuid=g.uuid,
                pcie_gen=g.pcie_gen,
            )
        )
    if snapshot.host.ram_usable_bytes is None:
        notes.append(
            "this machine's RAM is not known (the snapshot does not say it): the host RAM a plan needs is not "
            "checked against it"
        )
    planned = {g.index for g in gpus}
    pair_links = tuple((lk.a, lk.b, lk.type) for lk in snapshot.links if lk.a in planned and lk.b in planned)
    unknown_gen = [g for g in gpus if not g.pcie_gen]
    # the all-reduce runs over PCIe, at the lowest generation among its GPUs (_links_among), only where NVLink /
    # xGMI does not join every pair (an NVSwitch or a full mesh never crosses PCIe): where some pair is not, a
    # set with a GPU whose generation is unread crosses it (that pair and the GPU)
    fast = {frozenset((a, b)) for a, b, kind in pair_links if kind in FAST_LINKS}
    over_pcie = any(frozenset((a.index, b.index)) not in fast for a, b in itertools.combinations(gpus, 2))
    if unknown_gen and over_pcie:
        assumed = {g.spec.pcie_gen if g.spec and g.spec.pcie_gen else None for g in unknown_gen}
        notes.append(
            f"the PCIe generation of {', '.join(f'GPU {g.index}' for g in unknown_gen)} could not be read: "
            "multi-GPU times over PCIe take "
            + (
                f"the catalog's gen {assumed.pop()} for {'it' if len(unknown_gen) == 1 else 'them'}"
                if len(assumed) == 1 and None not in assumed
                else f"the catalog's generation, or gen 4 ({PCIE_GBS[4]:.0f} GB/s) where it has none"
            )
        )
    link, gbs = _links_among(tuple(gpus), pair_links) if len(gpus) > 1 else ("pcie", PCIE_GBS[4])
    return Hardware(
        source=source,
        gpus=tuple(gpus),
        ram_usable_bytes=snapshot.host.ram_usable_bytes,  # a cgroup limit below MemTotal is what a run may use
        link=link,
        link_gbs=gbs,
        label=gpus_label(gpus),
        notes=tuple(notes),
        host=profiles.host if source == "probe" else None,
        pair_links=pair_links,
        hidden=tuple(g.index for g in hidden),
        hidden_by=hidden_by if hidden else "",
        left_out=tuple(left_out),
        packages=snapshot_packages(snapshot),
    )


# -- the links among the GPUs a plan runs on ------------------------------------------------------------------
#
# A ring all-reduce (NCCL / RCCL on a few GPUs) runs at the pace of the slowest hop of its ring. NVLink bridges on
# PCIe cards join pairs (a 4-GPU RTX 3090 rig often has two bridges), NVSwitch boards join every pair: GPUs count
# as NVLink-joined only where a ring over NVLink passes through all of them; otherwise their all-reduce crosses
# PCIe at the slowest of their PCIe links.

FAST_LINKS = ("nvlink", "xgmi")
# NVLink between GPUs whose catalog entry gives no NVLink rate (PCIe cards with a bridge), as the catalog gives
# NVLink (per-GPU total, both directions): RTX 2080 Ti bridge 100 GB/s, RTX 3090 / RTX A6000 112.5 GB/s (NVIDIA
# spec pages, not re-checked); the lower
BRIDGE_GBS = 100.0
# ring search by permutation up to this many GPUs (7! orders); more GPUs count as NVLink-joined only when every
# pair is (an NVSwitch board)
RING_SEARCH_MAX_GPUS = 8


@functools.lru_cache(maxsize=4096)
def _fast_ring(ids: tuple[int, ...], pair_links: tuple[tuple[int, int, str], ...]) -> str | None:
    """The fast link type ("nvlink" / "xgmi") of a ring over such links through every GPU of ``ids``; None
    where the ring must cross PCIe (or the links are unknown)."""
    fast = {frozenset((a, b)): kind for a, b, kind in pair_links if kind in FAST_LINKS}
    pairs = [frozenset(p) for p in itertools.combinations(ids, 2)]
    if all(p in fast for p in pairs):
        return fast[pairs[0]] if pairs else None
    if len(ids) < 4 or len(ids) > RING_SEARCH_MAX_GPUS:  # 2 or 3 GPUs: a ring uses every pair
        return None
    first, rest = ids[0], ids[1:]
    for order in itertools.permutations(rest):
        ring = (first, *order, first)
        hops = [frozenset(h) for h in zip(ring, ring[1:])]
        if all(h in fast for h in hops):
            return fast[hops[0]]
    return None


def _links_among(gpus: tuple[HWGPU, ...], pair_links: tuple[tuple[int, int, str], ...]) -> tuple[str, float]:
    """(link type, GB/s one way) of the all-reduce among ``gpus`` of a probed machine: NVLink / xGMI where a ring
    of it joins them all (at the slowest GPU's catalog rate), else PCIe at the lowest generation among them (a
    GPU's catalog generation where the probe could not read it; gen 4 where neither says)."""
    fast = _fast_ring(tuple(sorted(g.index or 0 for g in gpus)), pair_links)
    specs = [g.spec for g in gpus if g.spec is not None]
    if fast is not None:
        rates = [float(s.interconnect["bandwidth_gbs"]) for s in specs if s.interconnect]
        return fast, min(rates) if rates else BRIDGE_GBS
    # each GPU's probed generation, else its catalog entry's (the probe records no current, idle value)
    gens = [gen for g in gpus if (gen := g.pcie_gen or (g.spec.pcie_gen if g.spec else None))]
    return "pcie", PCIE_GBS.get(min(gens) if gens else 4, 32.0)


def set_link(hw: Hardware, gpus: tuple[HWGPU, ...]) -> tuple[str, float]:
    """(link type, GB/s) of an all-reduce among ``gpus`` of ``hw``: on a probed machine the links among those
    GPUs (:func:`_links_among`); catalog hardware's one link."""
    if hw.source == "catalog" or len(gpus) < 2:
        return hw.link, hw.link_gbs
    return _links_among(tuple(gpus), hw.pair_links)


def _link_rank(link: tuple[str, float]) -> tuple[bool, float]:
    return link[0] in FAST_LINKS, link[1]


def _best_linked(hw: Hardware, chosen: tuple[HWGPU, ...], pool: list[HWGPU] | tuple[HWGPU, ...]):
    """``chosen``, or the set of the same kinds of GPU from ``pool`` whose all-reduce link is fastest
    (:func:`set_link`; the lowest GPU numbers among equals): two of four RTX 3090s that share an NVLink bridge,
    not the first two. Only probed machines with link data and at most RING_SEARCH_MAX_GPUS GPUs are searched."""
    if len(chosen) < 2 or hw.source == "catalog" or not hw.pair_links or len(pool) > RING_SEARCH_MAX_GPUS:
        return chosen
    kinds = Counter(g.kind for g in chosen)
    best, rank = chosen, _link_rank(set_link(hw, chosen))
    for gs in itertools.combinations(sorted(pool, key=lambda g: g.index or 0), len(chosen)):
        if Counter(g.kind for g in gs) != kinds:
            continue
        r = _link_rank(set_link(hw, gs))
        if r > rank or (r == rank and [g.index for g in gs] < [g.index for g in best]):
            best, rank = gs, r
    return best


def gpus_label(gpus: tuple[HWGPU, ...] | list[HWGPU]) -> str:
    """'2x RTX 4090', 'RTX 4090, RTX 3060', 'no GPU'."""
    names = [g.name for g in gpus]
    if len(set(names)) == 1 and len(names) > 1:
        return f"{len(names)}x {names[0]}"
    return ", ".join(names) or "no GPU"


# -- which GPUs a plan runs on -------------------------------------------------------------------------------
#
# Data parallelism runs every process in step: a plan on several GPUs runs at the pace of the slowest of them
# and fits only what the smallest holds, in bf16 only where all have it. On a machine whose GPUs differ the
# search therefore plans each GPU count on chosen GPUs (:func:`gpu_sets`), each configuration at the weakest of
# them (:func:`_evaluate`), and the plan names them (``Settings.gpu_ids``), which `sdplan train` launches on.


def mixed_gpus(hw: Hardware) -> bool:
    """The hardware's GPUs are not all alike."""
    return len({g.kind for g in hw.gpus}) > 1


def _strength(g: HWGPU) -> tuple:
    """What a plan takes from a GPU, each the larger the better: memory, matmul rate, memory bandwidth, bf16 and
    fp16 (an uncatalogued GPU's speed is unknown: 0)."""
    spec = g.spec
    rate = spec.matmul_tflops("fp16") if spec else 0.0
    bandwidth = float(spec.memory_bandwidth_gbs) if spec else 0.0
    return (g.memory_bytes, rate, bandwidth, g.bf16, g.fp16)


def _weakest(gpus: tuple[HWGPU, ...]) -> tuple:
    """A set of GPUs as data parallelism sees it: each of :func:`_strength`'s figures at its weakest GPU."""
    return tuple(min(x) for x in zip(*(_strength(g) for g in gpus), strict=True))


def gpu_sets(hw: Hardware, n: int) -> list[tuple[HWGPU, ...]]:
    """The sets of ``n`` GPUs an ``n``-GPU plan may run on, the best first (most memory, then speed, at their
    weakest GPU). Alike GPUs: the ``n`` whose links are fastest, the lowest numbers among equals
    (:func:`_best_linked`). GPUs that differ: one vendor's (one torch build drives a run), the ``n`` best by each
    of :func:`_strength`'s figures in turn (ties by the rest, then the GPU's number; the best-joined of alike
    ones), less any set that another matches or beats at its weakest GPU on every figure. Whatever order the
    machine lists its GPUs in, the same sets (up to which of alike GPUs)."""
    if n < 1 or n > hw.count:
        return []
    if not mixed_gpus(hw):
        return [_best_linked(hw, hw.gpus[:n], hw.gpus)]
    found: dict[tuple, tuple[HWGPU, ...]] = {}
    for vendor in sorted({g.vendor for g in hw.gpus}):
        group = [g for g in hw.gpus if g.vendor == vendor]
        if len(group) < n:
            continue
        for lead in range(len(_strength(group[0]))):

            def order(g: HWGPU, lead: int = lead) -> tuple:
                st = _strength(g)
                return (
                    tuple(-float(x) for x in st[lead:] + st[:lead]),
                    tuple(map(str, g.kind)),
                    g.index,
                )

            chosen = tuple(sorted(sorted(group, key=order)[:n], key=lambda g: g.index or 0))
            chosen = _best_linked(hw, chosen, group)  # in GPU-number order, as chosen is
            found.setdefault(tuple(g.index for g in chosen), chosen)

    def rank(gs: tuple[HWGPU, ...]) -> tuple:
        # the weakest GPU's figures, then the others' (a set that keeps the better GPUs wins a tie), then numbers
        rest = sorted(tuple(-float(x) for x in _strength(g)) for g in gs)
        return (tuple(-float(x) for x in _weakest(gs)), rest, tuple(g.index or 0 for g in gs))

    kept: list[tuple[HWGPU, ...]] = []
    for gs in sorted(found.values(), key=rank):
        w = _weakest(gs)
        if not any(all(a >= b for a, b in zip(_weakest(k), w, strict=True)) for k in kept):
            kept.append(gs)
    return kept


def named_gpu_ids(hw: Hardware, gpus: tuple[HWGPU, ...]) -> tuple[int, ...] | None:
    """The ``distributed.gpu_ids`` a run on ``gpus`` names: their numbers where the machine's GPUs differ or they
    are not its first ones (a bridged pair), or the machine shows a run GPUs it cannot train on
    (:attr:`Hardware.left_out`: a launch could take one of those first); None for the first ones of alike GPUs,
    which a launch takes anyway."""
    if mixed_gpus(hw) or tuple(gpus) != hw.gpus[: len(gpus)] or hw.left_out:
        return tuple(g.index for g in gpus)
    return None


def plan_gpus(hw: Hardware, s: Settings) -> tuple[HWGPU, ...]:
    """The GPUs the settings ``s`` run on: those ``s.gpu_ids`` names, else the first ``s.num_gpus``."""
    if s.gpu_ids is None:
        return hw.gpus[: s.num_gpus]
    by_index = {g.index: g for g in hw.gpus}
    return tuple(by_index[i] for i in s.gpu_ids if i in by_index)


def _on(hw: Hardware, gpus: tuple[HWGPU, ...]) -> Hardware:
    """``hw`` with only ``gpus``."""
    return replace(hw, gpus=tuple(gpus), label=gpus_label(gpus))


def gpu_text(g: HWGPU) -> str:
    """'GPU 1 (NVIDIA GeForce RTX 3060, 12.0 GiB)'."""
    return f"GPU {g.index} ({g.name}, {g.memory_bytes / GiB:.1f} GiB)"


def _distinct(gpus: tuple[HWGPU, ...]) -> list[HWGPU]:
    """One GPU of each kind, in order."""
    seen: dict[tuple, HWGPU] = {}
    for g in gpus:
        seen.setdefault(g.kind, g)
    return list(seen.values())


def smallest_gpu(gpus: tuple[HWGPU, ...]) -> HWGPU:
    """The GPU whose memory a data-parallel plan on ``gpus`` must fit in."""
    return min(gpus, key=lambda g: (g.memory_bytes, g.index or 0))


# -- the plan --------------------------------------------------------------------------------------------


# The planner's verdict on a configuration, in the words its reasons use (:attr:`Candidate.verdict`)
FITS = "fits"
MAY_RUN_OUT = "may run out of memory"
DOES_NOT_FIT = "does not fit"


@dataclass(frozen=True)
class Candidate:
    setup: Settings
    memory: Memory
    seconds: float | None
    step_seconds: float | None
    steps: Steps
    basis: str
    fits: bool  # the predicted peak is within HEADROOM of the card
    peak_range: tuple[float, float] = (0.0, 0.0)  # likely peak bytes (profiles/uncertainty.yaml)
    seconds_range: tuple[float, float] | None = None
    safe: bool = False  # fits, and the upper end of peak_range is within the card's memory
    observed_multi_gpu: str | None = (
        None  # the multi-GPU observation whose all-reduce rate its exchange takes
    )
    fixed_seconds: float = 0.0  # start-up, latent caching and sampling, in ``seconds``
    # sampling class images and grids (:func:`sampling_seconds`), in fixed_seconds; of those, the images no
    # setting changes the number of (the class images, the final grid)
    sampling_seconds: float | None = 0.0  # None: not known (no sampling speed for this GPU)
    sampling_once_seconds: float = 0.0
    allreduce_seconds: float = 0.0  # the modelled gradient all-reduce over the whole run, in ``seconds``
    peak_measured: str | None = None  # the sdplan bench point on this GPU whose peak the plan states
    # "measured" (at that point's settings), "scaled" (the model times measured / model at its batch), "predicted"
    peak_basis: str = "predicted"
    lowered_rank: bool = False  # a LoRA rank below the requested one (changes the result)
    host_ok: bool = True  # this machine's host RAM holds what the run keeps there (host_ram_needed_bytes)
    # an out of memory measured on its GPU (`sdplan bench`, `sdplan train`) that rules out a configuration the model
    # says fits (:func:`_observed_oom`; None: none, or the model says it does not fit anyway)
    observed_oom: MethodPoint | None = None

    @property
    def verdict(self) -> str:
        """FITS (within the limit, and the likely peak's upper end within the card: the search's first
        preference), MAY_RUN_OUT (within the limit, the upper end over the card: avoided where something else
        fits, flagged where nothing does) or DOES_NOT_FIT."""
        if not self.fits:
            return DOES_NOT_FIT
        return FITS if self.safe else MAY_RUN_OUT


@dataclass(frozen=True)
class Result:
    feasible: bool
    request: Request
    hardware: Hardware
    plan: Settings | None
    steps: Steps
    memory: Memory | None
    seconds: float | None
    step_seconds: float | None
    speedup_vs_one_gpu: float | None
    basis: str | None
    needs: dict | None
    reasons: tuple[str, ...]
    vram_bytes: int | None = None
    alternatives: tuple[Candidate, ...] = field(default=())
    peak_range: tuple[float, float] | None = None
    seconds_range: tuple[float, float] | None = None
    sampling_seconds: float | None = 0.0  # the plan's time sampling class images and grids, in ``seconds``
    within_upper_bound: bool | None = None  # the likely-peak upper bound fits the card (None: no plan)
    pin_conflicts: tuple[str, ...] = ()  # pins this hardware cannot run at all (bf16 without bf16, ...)
    peak_measured: str | None = None  # the sdplan bench point whose measured peak the plan states
    peak_basis: str = "predicted"  # Candidate.peak_basis


SWEEP_MAX_BATCH = 64


def batch_sweep(res: Result, profiles: Profiles) -> tuple[Candidate, ...]:
    """The plan's settings at other batch sizes, evaluated as the search evaluates a candidate (peak, its
    likely range, whole-run time, whether it fits): batch 1, 2, 4, ... up to twice the plan's (at least 4, at
    most SWEEP_MAX_BATCH) and the plan's own, for a picture of where the plan sits (sdplan.plan_chart)."""
    if res.plan is None:
        return ()
    cal = calibrate_for(profiles, res.hardware)
    top = min(SWEEP_MAX_BATCH, max(4, 2 * res.plan.batch))
    batches = sorted({res.plan.batch} | {2**i for i in range(7) if 2**i <= top})
    return tuple(
        _evaluate(res.request, profiles, res.hardware, cal, _with(res.plan, batch=b)) for b in batches
    )


def _sized(req: Request, s: Settings) -> Settings:
    """``s`` at the largest micro-batch the trainer forms for this request (:func:`sdplan.steps.largest_batch`):
    its memory and time are those of that batch. A batch past the epoch's samples (a pinned 64 for 20 images)
    is one batch of the 20, not 64; the plan keeps the batch as set, as the config writes it."""
    batch = largest_batch(s.batch, req.per_epoch, req.bucket_samples)
    return s if batch == s.batch else _with(s, batch=batch)


def _steps(req: Request, batch: int, grad_accum: int, num_gpus: int) -> Steps:
    return _plan_steps(
        req.per_epoch, batch, grad_accum, num_gpus, req.epochs, req.max_steps, req.bucket_samples
    )


@functools.lru_cache(maxsize=4096)
def _plan_steps(
    images_per_epoch: int,
    batch: int,
    grad_accum: int,
    num_gpus: int,
    epochs: int,
    max_steps: int | None,
    bucket_samples: tuple[int, ...],
) -> Steps:
    """plan_steps, once per arguments (Steps is frozen): a search asks again for every configuration."""
    return plan_steps(
        images_per_epoch=images_per_epoch,
        batch_size=batch,
        grad_accum=grad_accum,
        num_processes=num_gpus,
        epochs=epochs,
        max_steps=max_steps,
        bucket_samples=bucket_samples,
    )


def fp16_trains(g: HWGPU) -> bool:
    """Whether fp16 mixed precision trains on ``g`` without NaN losses: its catalog entry's ``fp16_trains``
    (false on the GTX 16 cards); a GPU not in the catalog: its fp16 support, unless it is a GTX 16 by
    AUTOMATIC1111's rule (:func:`sdplan.machine.fp16_gives_nan`: the laptop GTX 1650 Ti, the GTX 1630)."""
    if not g.fp16:
        return False
    if g.spec is not None:
        return g.spec.fp16_trains
    return not (g.vendor == "nvidia" and fp16_gives_nan(g.name, g.arch))


def precision_for(gpus: tuple[HWGPU, ...]) -> str:
    if gpus and all(g.bf16 for g in gpus):
        return "bf16"
    if gpus and all(fp16_trains(g) for g in gpus):
        return "fp16"
    return "fp32"


def _fp16_nan_gpu(gpus) -> HWGPU | None:
    """The first of ``gpus`` that has fp16 but whose fp16 mixed precision gives NaN losses (GTX 16), if any."""
    return next((g for g in gpus if g.fp16 and not fp16_trains(g)), None)


def _fp16_nan_note(g: HWGPU) -> str:
    """Why fp16 mixed precision is not planned on ``g`` (catalog ``fp16_trains: false``), with the sources."""
    return (
        f"fp16 mixed precision gives NaN losses in training on {g.name} (GTX 16 cards: {GTX16_FP16_NAN_SOURCES}; "
        "AUTOMATIC1111 and InvokeAI run them without autocast)"
    )


def _matching_point(profiles: Profiles, s: Settings, gpu: GPUSpec | None) -> MethodPoint | None:
    """A measured (local) or published point for this GPU and these settings, with a speed."""
    if gpu is None:
        return None
    index = _points_index(
        profiles,
        "speed_points_by_speed_settings",
        gpu.name,
        keep=lambda p: bool(p.outcome.get("it_s")) and p.num_gpus == 1,
        key=lambda p: _speed_settings(p.settings),
    )
    best = None
    # the text encoders' forward runs every step where their outputs are not cached (FLUX.1 LoRA on an
    # H100: 0.97 it/s against 1.10 cached); block swap's copies: both in _speed_settings
    for p in index.get(_speed_settings(s), ()):
        if p.method != s.method or p.model != s.model:
            continue
        if best is None or p.origin == "local":
            best = p
    return best


def _near_point(profiles: Profiles, s: Settings, gpu: GPUSpec | None) -> MethodPoint | None:
    """The `sdplan bench` speed point on this very GPU nearest these settings (same family, kind of training,
    precision, DeepSpeed use and optimizer offload; then the same resolution, the closest batch, the same checkpointing and
    method), for :func:`planned_step_seconds` to scale the model's prediction by; None where this GPU has none.
    Only sdplan's own measurements: scaled by published figures from other tools (their attention, data
    loading, logging), 3 of the 4 validation speeds it touched got worse (median 20.1% -> 22.7%)."""
    if gpu is None:
        return None
    memo = (
        "near_point",
        gpu.name,
        s.model,
        s.method,
        s.precision,
        bool(s.deepspeed),
        s.offload,
        s.resolution,
        s.batch,
        s.gradient_checkpointing,
        s.base_precision,
        s.blocks_to_swap,
    )
    if memo not in profiles.memo:
        profiles.memo[memo] = _nearest_bench_point(profiles, s, gpu)
    return profiles.memo[memo]


def _nearest_bench_point(profiles: Profiles, s: Settings, gpu: GPUSpec) -> MethodPoint | None:
    best, best_key = None, None
    for p in profiles.points_on(gpu.name):
        if not p.outcome.get("it_s") or p.num_gpus != 1 or p.grad_accum != 1:
            continue
        if speed_family(p.model) != speed_family(s.model):
            continue
        if not p.from_bench:
            continue
        o = p.options
        if (
            _step_floor_kind(p.method) != _step_floor_kind(s.method)
            or p.precision != s.precision
            or bool(o.deepspeed) != bool(s.deepspeed)
            or p.settings.offload != s.offload  # CPU Adam's step, which the roofline does not carry over
        ):
            continue
        key = (
            p.resolution != s.resolution,
            abs(math.log2(p.batch / s.batch)),
            o.gradient_checkpointing != s.gradient_checkpointing,
            o.base_precision != s.base_precision,
            o.blocks_to_swap != s.blocks_to_swap,
            p.method != s.method,
            p.model != s.model,  # a point of the same network under another name (speed_family) comes last
            p.origin != "local",
        )
        if best_key is None or key < best_key:
            best, best_key = p, key
    return best


# An out of memory measured on a GPU rules out what the model says needs this share of its memory or more: the
# model's own error (the measured band, x0.95-1.05) is wider than what another optimizer or a lower rank saves
# (an 8-bit AdamW plan 19 MiB below an out of memory at 7.34 GiB was recommended, and would run out again)
OOM_MARGIN = 0.95


def _local_ooms(profiles: Profiles, s: Settings, gpu: HWGPU) -> tuple[MethodPoint, ...]:
    """The out-of-memory points measured on this GPU (local store: `sdplan bench`, `sdplan train`) for ``s``'s
    method and family."""
    if gpu.spec is None:
        return ()
    index = _points_index(
        profiles,
        "local_ooms_by_method_and_model",
        gpu.spec.name,
        keep=lambda p: p.origin == "local" and p.outcome.get("fits") is False,
        key=lambda p: (p.method, p.model),
    )
    return tuple(index.get((s.method, s.model), ()))


def _oom_applies(p: MethodPoint, s: Settings) -> bool:
    """Out-of-memory point ``p`` can rule out ``s``: the same DeepSpeed use and optimizer offload."""
    return bool(p.options.deepspeed) == bool(s.deepspeed) and p.settings.offload == s.offload


def _is_the_oom(p: MethodPoint, s: Settings) -> bool:
    """``s`` is the configuration out-of-memory point ``p`` ran, at its batch or a larger one (and its ZeRO stage,
    which splits the state as the GPU count does: ZeRO-2 needs less than a ZeRO-1 that ran out)."""
    stage = (p.settings.deepspeed or {}).get("zero_stage") == (s.deepspeed or {}).get("zero_stage")
    return (
        stage
        and p.batch <= s.batch
        and _memory_settings(replace(p.settings, batch=s.batch)) == _memory_settings(s)
    )


def _observed_oom(profiles: Profiles, s: Settings, gpu: HWGPU) -> MethodPoint | None:
    """An out-of-memory measured on this GPU (:func:`_local_ooms`) that rules ``s`` out: at its batch or a smaller
    one, same settings otherwise, or at settings the model says need no more than ``s`` over :data:`OOM_MARGIN`
    (its own predictions of both, at one resolution): what ran out of memory once will again, whatever the model
    predicts, and so will what needs as much (a refusal's "fits when changed" offered memory.cache_latents=false,
    predicted 8.06 GiB, beside an out of memory at 7.88). Only points of the same DeepSpeed use and optimizer
    offload (the model errs otherwise there); the configuration itself under DeepSpeed only at its GPU count (ZeRO
    splits the state: an out of memory on 2 GPUs refused the plan on 4, at 18.3 GiB a GPU where 2 needed 31.0),
    the model's per-GPU figures at any."""
    peak = None
    for p in _local_ooms(profiles, s, gpu):
        if not _oom_applies(p, s):
            continue
        if _is_the_oom(p, s) and (not s.deepspeed or p.num_gpus == s.num_gpus):
            return p
        if p.resolution != s.resolution:
            continue
        key = ("oom peak", p.id)
        if key not in profiles.memo:
            profiles.memo[key] = memory(profiles, p.settings).peak
        peak = memory(profiles, s).peak if peak is None else peak
        if peak >= OOM_MARGIN * profiles.memo[key]:
            return p
    return None


# -- the one setting generator ----------------------------------------------------------------------------

# Lower LoRA ranks tried (after the requested one) when the user did not pin lora.rank: kohya-ss/sd-scripts
# docs/train_SDXL-en.md, "The LoRA training can be done with 8GB GPU memory ... Use lower dim (4 to 8 for 8GB
# GPU)". A lower rank changes the result (less capacity), so it is used only when the requested rank fits nowhere.
LOWER_LORA_RANKS = (8, 4)
# Cached text-encoder outputs train the same (the trainer encodes each epoch's shuffled tags and caption dropout's
# empty caption: trainer/conditioning.py epoch_captions), but the pass that encodes them before the first step
# is not timed: a small handicap so they are chosen where they make a plan fit or a run clearly faster.
TE_CACHE_HANDICAP = 0.03


def settings_space(
    req: Request,
    *,
    precision: str,
    attention: str,
    nvidia: bool = True,
    max_gpus: int = 1,
    counts: tuple[int, ...] | None = None,
    gpu_ids: tuple[int, ...] | None = None,
    missing: tuple[str, ...] = (),
) -> Iterator[Settings]:
    """Every configuration the planner considers for ``req``: the search, the "needs at least" figure and the
    reasons all enumerate this one generator. A pinned field (``req.pins``) takes only its pinned value.

    Knobs that keep the result (latent / text-encoder-output caching, gradient checkpointing, optimizer
    memory savers, DeepSpeed offload, full bf16 weights) and, for LoRA, lower ranks (which do not; the search
    prefers the requested rank). ``counts``: the GPU counts (default 1 to ``max_gpus``); ``gpu_ids``: the GPUs
    they run on (:func:`plan_gpus`; None: the first ones); ``missing``: the quantized bases the machine's packages
    cannot run (:func:`missing_bases`), left out unless pinned (:func:`pin_conflicts` refuses that)."""
    pins = dict(req.pins)
    gpu_ids = pins.get("gpu_ids", gpu_ids)
    full = req.method in FULL_METHODS
    lora = req.method == "lora"
    resolution = req.resolution
    if resolution is None:
        raise ValueError("settings_space needs the request's resolution")
    precision = pins.get("precision", precision)

    def axis(name: str, values) -> tuple:
        return (pins[name],) if name in pins else tuple(values)

    optimizers = [o for o in registry.method(req.method).optimizers if nvidia or o != "adamw8bit"]
    train_te = pins.get("train_text_encoder", False)
    te_frozen = not train_te and req.method != "textual-inversion"
    ranks = (
        axis("lora_rank", (req.lora_rank, *(r for r in LOWER_LORA_RANKS if r < req.lora_rank)))
        if lora
        else (None,)
    )
    halves = (False, True) if (full and precision == "bf16") else (False,)
    flow = flow_family(req.model)
    # transformer families' LoRA: the frozen base's storage (nf4: bitsandbytes, NVIDIA only) is a dimension; the
    # full methods train the base's own weights (pin_conflicts refuses a quantized base pinned for them)
    bases = (
        axis(
            "base_precision",
            tuple(b for b in ("bf16", "fp8", *(("nf4",) if nvidia else ())) if b not in missing),
        )
        if (flow and lora)
        else ("bf16",)
    )
    swaps = (
        axis(
            "blocks_to_swap",
            (0, *(n for n in SWAP_STEPS if n < MAX_BLOCKS_TO_SWAP[req.model]), MAX_BLOCKS_TO_SWAP[req.model]),
        )
        if (flow and lora)
        else axis("blocks_to_swap", (0,))
    )
    speeds = (None, dict(OFFLOAD), dict(SHARDED)) if full else (None,)
    pinned_ds = pins.get("deepspeed")
    if pinned_ds and "offload_optimizer" not in pinned_ds:  # the stage pinned, offload left to the search
        speeds = tuple({**pinned_ds, "offload_optimizer": offload} for offload in (True, False))
        pins = {k: v for k, v in pins.items() if k != "deepspeed"}
    fixed = {
        name: pins[name]
        for name in ("lora_alpha", "lora_dropout", "lora_targets", "set_grads_to_none", "ema", "ema_every")
        if name in pins and (lora or not name.startswith("lora"))
    }
    for n in axis("num_gpus", counts or range(1, max_gpus + 1)):
        for batch in axis("batch", BATCHES):
            if "batch" not in pins and batch > 1 and batch * n > req.images:
                continue  # a global batch larger than the images would repeat an image within a step
            for accum, gc, cache, te_cache, opt, ds, half_w, rank, base, swap in itertools.product(
                axis("grad_accum", (1,)),
                axis("gradient_checkpointing", (False, True)),
                axis("cache_latents", (True, False)),
                axis("cache_text_encoder_outputs", (False, True) if te_frozen else (False,)),
                axis("optimizer", optimizers),
                axis("deepspeed", speeds),
                axis("full_half_weights", halves),
                ranks,
                bases,
                swaps,
            ):
                if swap and swap_problem(
                    swap,
                    family=req.model,
                    method=req.method,
                    gradient_checkpointing=gc,
                    processes=n,
                    deepspeed=bool(ds),
                ):
                    continue  # a swap the bundled trainer does not run (one process, checkpointing, LoRA)
                if swap and "blocks_to_swap" not in pins and not (cache and te_cache):
                    continue  # block swap only after the cheaper savers (as kohya's docs order them)
                if ds and ((opt != "adamw" and "optimizer" not in pins) or half_w):
                    # 8-bit / Adafactor are not combined with DeepSpeed unless pinned; full bf16 never (DeepSpeed
                    # keeps fp32 master weights of its own: sdplan.config refuses it)
                    continue
                if ds and not ds.get("offload_optimizer") and n == 1:
                    # nothing to split the optimizer state over: more bytes than no DeepSpeed (pinned on one GPU,
                    # offload not on: pin_conflicts refuses it)
                    continue
                if ds and (train_te or opt == "adamw8bit"):
                    # DeepSpeed trains one model, and not with bitsandbytes' optimizer (sdplan.config refuses both)
                    continue
                if ds and ds.get("offload_optimizer") and opt == "adafactor":
                    continue  # the offload runs DeepSpeed's CPU Adam in its place (sdplan.config refuses it)
                yield Settings(
                    method=req.method,
                    model=req.model,
                    resolution=resolution,
                    batch=batch,
                    grad_accum=accum,
                    precision=precision,
                    gradient_checkpointing=gc,
                    optimizer=opt,
                    cache_latents=cache,
                    cache_text_encoder_outputs=te_cache,
                    train_text_encoder=train_te,
                    attention=attention,
                    deepspeed=dict(ds) if ds else None,
                    full_half_weights=half_w,
                    lora_rank=rank if lora else None,
                    prior_preservation=pins.get("prior_preservation", req.prior_preservation),
                    num_gpus=n,
                    base_precision=base,
                    blocks_to_swap=swap,
                    gpu_ids=gpu_ids,
                    **fixed,
                )


def _gpu_choices(req: Request, hw: Hardware) -> list[Hardware]:
    """The GPUs the search plans on, each set as a Hardware: for every GPU count the request allows (fewest
    first), the sets :func:`gpu_sets` offers; the pinned ``distributed.gpu_ids`` alone where given (none where it
    names a GPU the hardware lacks: :func:`pin_conflicts` says so)."""
    ids = req.pin("gpu_ids")
    if ids is not None:
        by_index = {g.index: g for g in hw.gpus}
        return [_on(hw, tuple(by_index[i] for i in ids))] if all(i in by_index for i in ids) else []
    limit = min(hw.count, req.max_gpus or hw.count)
    pinned = req.pin("num_gpus")
    counts = (pinned,) if pinned is not None else range(1, limit + 1)
    return [_on(hw, gs) for n in counts if n <= limit for gs in gpu_sets(hw, n)]


def _attention_for(gpus: tuple[HWGPU, ...]) -> str:
    """The attention every one of ``gpus`` runs (math SDPA where any lacks the efficient kernels)."""
    return "math" if any(attention_backend(g) == "math" for g in gpus) else "efficient"


def _space(req: Request, hw: Hardware) -> list[Settings]:
    """Every configuration of ``req`` on every set of ``hw``'s GPUs it can run on, in the search's order."""
    out: list[Settings] = []
    for on in _gpu_choices(req, hw):
        if pin_conflicts(req, on):  # a pin these GPUs cannot run (bf16 where one lacks it, ...)
            continue
        out += settings_space(
            req,
            precision=precision_for(on.gpus),
            attention=_attention_for(on.gpus),
            nvidia=all(base_precision_allowed("nf4", g) is None for g in on.gpus),  # nf4's kernels there
            counts=(on.count,),
            gpu_ids=named_gpu_ids(hw, on.gpus),
            missing=missing_bases(on),
        )
    return out


def _candidates(req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int):
    """Every candidate of the search, none skipped (what :func:`_search` is checked against)."""
    req = replace(req, resolution=resolution)
    return [_evaluate(req, profiles, hw, cal, s) for s in _space(req, hw)]


def _search(
    req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int
) -> tuple[list[Candidate], Callable[[int], list[Candidate]]]:
    """The search as a plan needs it: (the candidates evaluated, in the search's order, among them each GPU
    count's best that fits by :func:`_preference`; a function giving every fitting candidate on a count, in
    the search's order, for the chosen plan's reasons).

    A count's candidates are evaluated tier by tier of what their settings decide of :func:`_tier` (a lower
    rank than asked, offload, full half weights: :func:`_settings_tier`). Once a tier holds a candidate that
    fits within its likely range (``safe``), every later tier of that count loses to it by :func:`_tier`
    alone, so it is evaluated only if that count is chosen. That skips most of a large search (the lower
    ranks on every further GPU count); where nothing fits, nothing is skipped."""
    req = replace(req, resolution=resolution)
    space = _space(req, hw)
    done: list[Candidate | None] = [None] * len(space)

    def at(i: int) -> Candidate:
        c = done[i]
        if c is None:
            c = done[i] = _evaluate(req, profiles, hw, cal, space[i])
        return c

    tiers = [_settings_tier(s, _lowered_rank(req, s)) for s in space]
    by_count: dict[int, list[int]] = {}
    for i, s in enumerate(space):
        by_count.setdefault(s.num_gpus, []).append(i)
    for idx in by_count.values():
        for tier in sorted({tiers[i] for i in idx}):
            whole_tier = [at(i) for i in idx if tiers[i] == tier]  # all of it: its best may be the count's
            if any(c.safe for c in whole_tier):
                break

    def on_count(n: int) -> list[Candidate]:
        return [c for c in (at(i) for i in by_count.get(n, ())) if c.fits]

    return [c for c in done if c is not None], on_count


def _observed_multi_gpu(profiles: Profiles, s: Settings, gpus: tuple[HWGPU, ...], link: str):
    """A multi-GPU observation near these settings (same GPU, method, family, link and exchange, DDP or
    DeepSpeed; the nearest GPU count): its all-reduce rate wins over the model's, fitted on every observation. What it measured is the extra
    seconds its exchange added to each step (:func:`calibrate`'s ``link_points``); the exchange's size (the
    gradients, not the batch) and its GPU count are the plan's, so a plan at another batch or rank, or on more
    GPUs, gets the same rate, never the observation's ratio of step times (a 1.23x measured at batch 1, rank 128,
    multiplied onto a batch-8 step, made 3 GPUs look 1.68x faster than 2 over the same PCIe). Observations are
    of alike GPUs: none for GPUs that differ."""
    gpu = gpus[0]
    if gpu.spec is None or s.num_gpus < 2 or len(_distinct(gpus)) > 1:
        return None
    link = "nvlink" if link in ("nvlink", "xgmi") else "pcie"
    near = [
        m
        for m in profiles.multi_gpu
        if (spec := profiles.gpu_or_none(m.gpu)) is not None
        and spec.name == gpu.spec.name
        and m.method == s.method
        and m.model == s.model
        and m.interconnect == link
        # like with like: DDP's one all-reduce is not ZeRO's reduce-scatter and all-gather (a DeepSpeed plan
        # takes the rate fitted on every observation, and is not said to be measured)
        and bool(m.settings.deepspeed) == bool(s.deepspeed)
        and m.outcome.get("iteration_time_ratio", 0) > 1
    ]
    return min(near, key=lambda m: (abs(m.num_gpus - s.num_gpus), m.id), default=None)


def _with_link_rate(cal: Calibration, observed: Any) -> Calibration:
    """``cal`` with the all-reduce rate ``observed`` measured (its :func:`calibrate` link point)."""
    if observed is None:
        return cal
    key = ("link rate", observed.id)
    if key not in cal.memo:
        cal.memo[key] = replace(cal, link_efficiency=dict(cal.link_points)[observed.id])
    return cal.memo[key]


def pace_gpu(
    profiles: Profiles, s: Settings, gpus: tuple[HWGPU, ...], cal: Calibration, link_gbs: float | None = None
) -> tuple[HWGPU, float | None, str]:
    """(the GPU that sets the step's pace, its seconds per micro-step, their basis) for ``s`` on ``gpus``: the
    slowest of them by :func:`planned_step_seconds` (data-parallel processes wait for each other every step); a
    GPU of unknown speed makes the step's time unknown."""
    pace: tuple[HWGPU, float | None, str] | None = None
    for g in _distinct(gpus):
        step_s, basis = planned_step_seconds(profiles, s, g.spec, cal, link_gbs=link_gbs)
        if step_s is None:
            return g, None, basis
        if pace is None or step_s > pace[1]:
            pace = (g, step_s, basis)
    assert pace is not None
    return pace


def planned_step_seconds(
    profiles: Profiles, s: Settings, gpu: GPUSpec | None, cal: Calibration, *, link_gbs: float | None = None
) -> tuple[float | None, str]:
    """(seconds per micro-step, basis) as a plan states them: a measured or published speed for this GPU and
    these settings; else the model scaled by the nearest speed measured on this GPU ("scaled"); else the
    model alone ("calibrated"; "weakly_calibrated" for the transformer families, whose efficiency rests on few
    speeds, unless the measured launch-bound floor sets the step)."""
    if gpu is None:
        return None, "unknown speed"
    single = s if s.num_gpus == 1 else _count_free(s, 1)
    point = _matching_point(profiles, single, gpu)
    if point is not None and s.num_gpus == 1:
        return 1.0 / point.outcome["it_s"], ("measured" if point.from_bench else "published")
    times = _step_times(profiles, s, gpu, cal, link_gbs=link_gbs)
    if times is None:
        return None, "unknown speed"
    step_s = times[0]
    if point is not None:  # several GPUs: the speed measured on one with these settings, plus the exchange as
        # modelled (the model's own one-GPU step at the launch-bound floor made a 2-GPU step shorter than one)
        one = step_seconds(profiles, single, gpu, cal)
        return 1.0 / point.outcome["it_s"] + max(0.0, step_s - one), (
            "measured" if point.from_bench else "published"
        )
    near = _near_point(profiles, s, gpu)
    # measured evidence on this GPU near these settings: the model only carries the change
    if near is not None:
        floor = cal.step_floor_s(s) or 0.0
        one = step_s if s.num_gpus == 1 else step_seconds(profiles, _with(s, num_gpus=1), gpu, cal)
        key = ("at near", near.id, gpu.name)
        if key not in cal.memo:  # the same few points serve a search's thousands of candidates
            cal.memo[key] = step_seconds(profiles, _with(near.settings, num_gpus=1), gpu, cal)
        at_near = cal.memo[key]
        # block swap's PCIe copies (transformer families) are modelled apart from the compute the measured
        # ratio corrects: both sides leave them out of the ratio and the plan's own are added back
        swap, swap_near = swap_seconds(profiles, s, gpu), swap_seconds(profiles, near.settings, gpu)
        measured = 1.0 / near.outcome["it_s"] - swap_near
        if one > floor and at_near and measured > 0 and at_near > swap_near and one > swap:
            # at the floor (launch-bound) the floor is itself a measurement
            scaled = max((one - swap) * measured / (at_near - swap_near) + swap, floor)
            return scaled + (step_s - one), "scaled"  # the all-reduce (several GPUs) as modelled
    # the transformer families alone: an efficiency fitted on few speeds; quantized-base and swap costs
    # unfitted; at the launch-bound floor, the floor's measurement sets the step
    floored = times[1] < times[0]
    return step_s, ("weakly_calibrated" if flow_family(s.model) and not floored else "calibrated")


def host_ram_needed_bytes(profiles: Profiles, s: Settings, mem: Memory | None = None) -> float:
    """Host RAM a configuration holds for the whole run, all processes, that the OS cannot page out without
    stalling or killing it: DeepSpeed's offloaded optimizer (fp32 masters and state, :func:`memory`'s ``ram``)
    and block swap's pinned copies (:func:`pinned_ram_bytes`); 0 otherwise (loading beyond the RAM swaps: the
    plan's reasons warn, it is not refused)."""
    need = 0.0
    if s.offload:
        need = (mem or memory(profiles, s)).ram
    if s.blocks_to_swap:
        need = max(need, pinned_ram_bytes(profiles, s))
    return need


def host_ram_ok(
    profiles: Profiles, s: Settings, ram_usable_bytes: int | None, mem: Memory | None = None
) -> bool:
    """Whether a host with ``ram_usable_bytes`` (None: not known, as for catalog hardware) can run ``s``."""
    return (
        not ram_usable_bytes or host_ram_needed_bytes(profiles, s, mem) <= HOST_RAM_SHARE * ram_usable_bytes
    )


def loading_ram_short(mem: Memory, ram_usable_bytes: int | None) -> bool:
    """Whether loading the models for a plan takes more host RAM (``mem.ram``) than the machine has: a warning,
    not a refusal, unlike what :func:`host_ram_ok` checks (held for the whole run): loading beyond the RAM
    swaps, and may be killed by the OS (recommend warns, doctor calls the cell tight)."""
    return bool(ram_usable_bytes) and mem.ram > ram_usable_bytes


def _speed_settings(s: Settings) -> tuple:
    """What a one-GPU step's time depends on, to match a measured or published speed to a plan exactly (the
    optimizer, the LoRA rank and the attention backend move it by a few percent: a point differing only there
    still states the speed)."""
    return (
        s.method,
        s.model,
        s.resolution,
        s.batch,
        s.precision,
        s.gradient_checkpointing,
        s.cache_latents,
        s.cache_text_encoder_outputs,
        s.train_text_encoder,
        bool(s.deepspeed),
        s.offload,  # offload's step is CPU Adam's (an SDXL step on an H100: 2.11 s with it, 1.02 s without)
        s.base_precision,
        s.blocks_to_swap,
    )


def _memory_settings(s: Settings) -> tuple:
    """What a step's peak depends on, to match a measured peak or an observed out-of-memory to a plan."""
    return _speed_settings(s) + (
        s.optimizer,
        s.ema,
        s.lora_rank,
        s.lora_targets,
        s.prior_preservation,
        s.fused_backward,
        s.full_half_weights,
    )


def _bench_points_at(profiles: Profiles, s: Settings, gpu: GPUSpec | None) -> tuple[MethodPoint, ...]:
    """The `sdplan bench` points on this GPU at the settings a peak depends on, any batch, in file order; none
    for several processes. The index is built once per profiles (a plan search asks for every candidate)."""
    if gpu is None or s.num_gpus != 1:
        return ()
    index = _points_index(
        profiles,
        "bench_points_by_memory_settings",
        gpu.name,
        keep=lambda p: p.from_bench,
        key=lambda p: _memory_settings(replace(p.settings, batch=1)),
    )
    return index.get(_memory_settings(_with(s, batch=1)), ())


def _points_index(
    profiles: Profiles,
    name: str,
    gpu: str,
    *,
    keep: Callable[[MethodPoint], bool],
    key: Callable[[MethodPoint], tuple],
) -> dict[tuple, tuple[MethodPoint, ...]]:
    """The points on ``gpu`` that ``keep`` selects, grouped by ``key``, each group in file order. Built once per
    profiles and kept in ``profiles.memo`` under ``name``: a plan's search asks for thousands of candidates, and
    the points do not change."""
    memo = (name, gpu)
    if memo not in profiles.memo:
        index: dict[tuple, list[MethodPoint]] = {}
        for p in profiles.points_on(gpu):
            if keep(p):
                index.setdefault(key(p), []).append(p)
        profiles.memo[memo] = {k: tuple(v) for k, v in index.items()}
    return profiles.memo[memo]


def peak_evidence(profiles: Profiles, s: Settings, gpu: GPUSpec | None) -> tuple[MethodPoint, str] | None:
    """The `sdplan bench` peak on this GPU (one process) that a plan states: the point that measured these very
    settings ("measured"), else one at these settings but another batch, the nearest to this one (on a log scale,
    the larger on a tie; "scaled"); None where this GPU has neither."""
    near = [
        p
        for p in _bench_points_at(profiles, s, gpu)
        if p.outcome.get("fits") and p.outcome.get("peak_vram_gib")
    ]
    exact = next((p for p in near if p.batch == s.batch), None)
    if exact is not None:
        return exact, "measured"
    if not near:
        return None
    return min(near, key=lambda p: (abs(math.log(p.batch / s.batch)), -p.batch)), "scaled"


def measured_grid_point(profiles: Profiles, s: Settings, gpu: GPUSpec | None) -> MethodPoint | None:
    """An `sdplan bench` point on this GPU at these settings (any batch: the grid runs between steps, beside
    the training state without activations) that measured the trainer's final sample grid."""
    return next(
        (p for p in _bench_points_at(profiles, s, gpu) if p.outcome.get("sample_grid_peak_gib")), None
    )


def evidenced_allocated_bytes(profiles: Profiles, s: Settings, mem: Memory, point: MethodPoint) -> float:
    """The allocated peak a plan states from a bench point (peak_evidence): the point's own where it measured
    these settings, else the model's for these settings times measured / model at the point's batch (the
    model's error there carried over: activation bytes grow with the batch as the model has them)."""
    measured = point.outcome["peak_vram_gib"] * GiB
    if point.batch == s.batch:
        return measured
    at_point = memory(profiles, point.settings)
    return (mem.step_peak - mem.overhead) * measured / (at_point.step_peak - at_point.overhead)


MEASURED_BAND = (0.95, 1.05)  # a peak or speed sdplan bench measured on this GPU: the run's own noise


def seconds_band(
    profiles: Profiles, basis: str, model: str, num_gpus: int = 1, *, far: bool = False
) -> tuple[tuple[float, float], str]:
    """(low, high) factors of a plan's step time and where they come from, by the basis of its speed: a speed
    sdplan bench measured at these settings on this GPU, the run's own spread; the model scaled by a bench
    point, the spread of the bench points each predicted so without themselves (``far``: a point at another
    resolution, which that spread does not cover: the H100's speeds scaled so across resolutions, each left
    out, missed by up to 2.3x; widened to the validation set's at each end); else, and on several GPUs (an
    all-reduce as modelled on top of the one-GPU step), the validation set's for ``model``'s kind of network
    (Uncertainty.seconds_for)."""
    unc = profiles.uncertainty
    if basis == "measured" and num_gpus == 1:
        return MEASURED_BAND, "a measurement's own spread"
    band, n = unc.seconds_for(model)
    if basis == "scaled" and num_gpus == 1 and unc.seconds_scaled is not None:
        scaled = unc.seconds_scaled
        said = f"sdplan bench speeds each predicted so without itself, n={unc.n_seconds_scaled}"
        if far:
            widened = (min(scaled[0], band[0]), max(scaled[1], band[1]))
            return (
                widened,
                f"{said}, widened to the validation set's (n={n}): the point is at another resolution",
            )
        return scaled, said
    return band, f"validation set, n={n}"


def scaled_from_afar(profiles: Profiles, s: Settings, gpu: GPUSpec | None, basis: str) -> bool:
    """A speed scaled by a bench point at another resolution than the plan's (:func:`seconds_band`'s ``far``)."""
    point = _near_point(profiles, s, gpu) if basis == "scaled" else None
    return point is not None and point.resolution != s.resolution


def latent_cache_seconds(profiles: Profiles, s: Settings, images: int, gpu: HWGPU, cal: Calibration) -> float:
    """Filling the latent cache: one VAE pass per distinct image, split over the processes. The trainer's cache
    is keyed by the file's content with its size, crop and flip (trainer/data.py LatentCache), so with the
    default centre crop and no flip the repeats of an image and the later epochs all reuse its latents: the
    pass does not grow with repeats or epochs (charging it per repeat made caching look no faster than
    encoding every step)."""
    model = profiles.model(s.model)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    tflops = gpu_tflops(gpu, s.precision) or 1.0
    flops = profiles.activations.vae_encode_flops(s.model, latent) * images / s.num_gpus
    return flops / (tflops * 1e12 * cal.efficiency_for(gpu.spec))


def card_peak(
    profiles: Profiles, s: Settings, gpu: GPUSpec | None
) -> tuple[Memory, tuple[float, float], tuple[MethodPoint, str] | None]:
    """The peak a plan states for ``s`` on ``gpu`` (None: no GPU's evidence, the model alone): its memory, the
    likely range of its peak and the `sdplan bench` evidence behind it (:func:`peak_evidence`)."""
    mem = memory(profiles, s)
    unc_peak = profiles.uncertainty.peak_for(s.model)[0]
    # several processes: a bench point measured one; each of them holds what it did, and what the model has one
    # of several hold more or less (DDP's buckets, ZeRO's split optimizer state) on top, with the model's band
    single = s if s.num_gpus == 1 else _count_free(s, 1)
    evidence = peak_evidence(profiles, single, gpu)
    if evidence is not None:  # measured evidence beats the model: its allocated peak, the same allowances
        one = mem if single is s else memory(profiles, single)
        measured = evidenced_allocated_bytes(profiles, single, one, evidence[0])
        more = (mem.step_peak - mem.overhead) - (one.step_peak - one.overhead)
        scaled_band = profiles.uncertainty.peak_scaled or unc_peak
        band = MEASURED_BAND if evidence[1] == "measured" else scaled_band
        if more >= 0:  # DDP's buckets on top, with the model's band on them
            allocated = measured + more
            low, high = sorted((more * unc_peak[0], more * unc_peak[1]))
            band = ((measured * band[0] + low) / allocated, (measured * band[1] + high) / allocated)
        else:  # ZeRO's split optimizer state: each holds less; the model's ratio, as from another batch
            allocated = measured * (mem.step_peak - mem.overhead) / (one.step_peak - one.overhead)
            band = scaled_band
        overhead = _overhead_bytes(allocated)
        step = allocated + overhead  # the step's (final_grid_fits)
        if step >= mem.text_cache_peak:
            mem = replace(mem, overhead=overhead, step_peak=step, peak=step)
            unc_peak = band
        else:  # the plan's peak is the caption pass's, the model's bytes, not what a bench point measured: the
            evidence = None  # model's step beside it, whose parts the reasons add up (breakdown_text)
    grid = measured_grid_point(profiles, single, gpu)
    if grid is not None:  # the final sample grid as sdplan bench measured it here, the same allowances
        grid_allocated = grid.outcome["sample_grid_peak_gib"] * GiB
        mem = replace(mem, sampling_peak=grid_allocated + _overhead_bytes(grid_allocated))
    model_band = profiles.uncertainty.peak_for(s.model)[0]
    return mem, peak_range_of(mem.step_peak, mem.text_cache_peak, unc_peak, model_band), evidence


def peak_range_of(
    step: float, cache: float, band: tuple[float, float], cache_band: tuple[float, float]
) -> tuple[float, float]:
    """The likely range of a plan's peak: ``band`` (the validation set's, or a measurement's) on the step's peak,
    ``cache_band`` on the caption pass's (``cache``: the model's own band, the validation set's; its transient is
    not calibrated, and a narrower band than the model's made a plan "fit" on the caption pass alone), whichever is
    larger at each end."""
    return max(step * band[0], cache * cache_band[0]), max(step * band[1], cache * cache_band[1])


FIT_RULE_TEXT = f"a plan keeps its estimate under {int(HEADROOM * 100)}% and its likely range within the card"


def fit_share_text(peak: float, vram: float) -> str:
    """A peak's share of the card, with the rule it is judged by."""
    return f"{100 * peak / vram:.0f}% of the card; {FIT_RULE_TEXT}"


def vram_required(peak: float, peak_range: tuple[float, float]) -> int:
    """The fit rule, as the smallest card (bytes) a plan with this peak fits without the "may not fit" flag:
    its predicted peak within HEADROOM of the card and its likely peak's upper end within the card. The
    verdict (:attr:`Candidate.safe`), "needs at least" and the cards suggested all use this."""
    return int(math.ceil(max(peak / HEADROOM, peak_range[1])))


def _evaluate(req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, s: Settings) -> Candidate:
    """``s`` on the GPUs it runs on (:func:`plan_gpus`), at the weakest of them: the smallest memory, the
    slowest step (:func:`pace_gpu`), an out-of-memory observed on any."""
    used = plan_gpus(hw, s)
    sized = _sized(req, s)  # memory and time at the largest micro-batch the trainer forms
    # each GPU's own evidence (a bench point measured on one), the largest peak of them: a mixed rig's plan
    # depended on which GPU was numbered 0
    mem, peak_range, evidence = max(
        (card_peak(profiles, sized, g.spec) for g in _distinct(used)), key=lambda c: (c[1][1], c[0].peak)
    )
    vram = smallest_gpu(used).memory_bytes
    host_ok = host_ram_ok(profiles, sized, hw.ram_usable_bytes, mem)
    fits = mem.peak <= HEADROOM * vram and host_ok
    oom = next((p for g in _distinct(used) if (p := _observed_oom(profiles, sized, g)) is not None), None)
    if not fits:
        oom = None
    fits = fits and oom is None
    steps = _steps(req, s.batch, s.grad_accum, s.num_gpus)
    link, link_gbs = set_link(hw, used)
    observed = _observed_multi_gpu(profiles, sized, used, link)
    link_cal = _with_link_rate(cal, observed)
    gpu, step_s, basis = pace_gpu(profiles, sized, used, link_cal, link_gbs)
    seconds = seconds_range = None
    fixed = allreduce = 0.0
    sampling = sampling_once = 0.0
    known_sampling = False
    if step_s is not None:
        stepping = steps.micro_batches * step_s
        fixed = STARTUP_S
        if s.cache_latents:
            fixed += latent_cache_seconds(profiles, s, req.images, gpu, cal)
        # on the main process while the others wait; at the pace GPU's speed (the weakest: a plan is planned there)
        sampled = sampling_seconds(req, profiles, s, steps, gpu.spec, cal)
        sampling_once, sampling = sampled or (0.0, 0.0)
        known_sampling = sampled is not None
        seconds = fixed + sampling + stepping
        if s.num_gpus > 1 and link_gbs:
            allreduce = steps.micro_batches * comm_seconds(profiles, sized, link_gbs, link_cal)
        # the steps' range by their basis (one GPU: the bench evidence behind it times one GPU; several add an
        # all-reduce as modelled); start-up and caching are the model's (the validation set's range), sampling
        # its own (the validation set's txt2img speeds: sampling_band)
        far = scaled_from_afar(profiles, sized, gpu.spec, basis)
        band = seconds_band(profiles, basis, s.model, s.num_gpus, far=far)[0]
        model_band = profiles.uncertainty.seconds_for(s.model)[0]
        sampling_range = sampling_band(profiles, s.model)[0]
        seconds_range = tuple(
            fixed * model_band[i] + sampling * sampling_range[i] + stepping * band[i] for i in (0, 1)
        )
        fixed += sampling
    return Candidate(
        setup=s,
        memory=mem,
        seconds=seconds,
        step_seconds=step_s,
        steps=steps,
        basis=basis,
        fits=fits,
        host_ok=host_ok,
        peak_range=peak_range,
        seconds_range=seconds_range,
        safe=fits and vram_required(mem.peak, peak_range) <= vram,
        observed_multi_gpu=observed.id if observed is not None else None,
        fixed_seconds=fixed,
        sampling_seconds=sampling if known_sampling else None,
        sampling_once_seconds=sampling_once,
        allreduce_seconds=allreduce,
        peak_measured=evidence[0].id if evidence is not None else None,
        peak_basis=evidence[1] if evidence is not None else "predicted",
        lowered_rank=_lowered_rank(req, s),
        observed_oom=oom,
    )


_OPT_RANK = {"adamw": 0, "adamw8bit": 1, "adafactor": 2}


def _key(c: Candidate) -> tuple:
    """Fastest whole run first; with no speed known (an uncatalogued GPU), the largest batch."""
    s = c.setup
    # a 2% handicap per step away from plain AdamW: bitsandbytes / Adafactor only where they pay
    penalty = (
        1
        + 0.02 * _OPT_RANK[s.optimizer]
        + (TE_CACHE_HANDICAP if s.cache_text_encoder_outputs else 0)
        + BASE_QUANT_HANDICAP[s.base_precision]
    )
    savers = (
        s.gradient_checkpointing,
        _OPT_RANK[s.optimizer],
        s.cache_text_encoder_outputs,
        -(s.lora_rank or 0),
    )
    if c.seconds is None:  # no checkpointing (it surely costs time), then the largest batch
        return (math.inf, s.offload, s.num_gpus, s.gradient_checkpointing, -s.batch * s.grad_accum, *savers)
    # per image seen: the run's time where its images are set (epochs), its pace where its steps are
    # (training.max_steps: a larger batch sees more images in as many steps, not a slower run); less the class
    # images and the final grid, whose number no setting here changes (a cost added to all would dilute the
    # handicaps above); the grids during the run stay (their number follows the steps). It orders the plans of one
    # GPU count; counts are weighed against each other by :func:`speedup` (:func:`_choose`), which under
    # training.max_steps does not spread the start-up over each run's images as this does
    return (_key_seconds(c) * penalty, s.offload, s.num_gpus, s.batch, *savers)


def _key_seconds(c: Candidate) -> float:
    """:func:`_key`'s time: the run less its class images and final grid, per image seen."""
    return (c.seconds - c.sampling_once_seconds) / c.steps.images_seen


def _batch_cap_text(req: Request, s: Settings) -> str:
    """Where the search's rule (a global batch holds no more than the distinct images) kept the batch from
    doubling, that it did, what the doubled batch would do (as the trainer forms its batches:
    :func:`sdplan.steps.largest_batch`, :func:`sdplan.steps.repeated_batches`), and how to go past it."""
    if req.pinned("batch") or s.batch * 2 * s.num_gpus <= req.images:
        return ""
    gpus = f" x {s.num_gpus} GPUs" if s.num_gpus > 1 else ""
    images = count_text(req.images, "distinct image")
    if (
        s.batch * s.num_gpus > req.images
    ):  # batch 1 on more GPUs than images (a pinned count): over it already
        return (
            f"; no larger batch was tried: batch {s.batch}{gpus} already exceeds the {images}, so a step holds "
            "an image twice, and a larger batch would hold more twice (pin training.batch_size to go past it)"
        )
    double = s.batch * 2
    formed = largest_batch(double, req.per_epoch, req.bucket_samples)
    again = repeated_batches(req.per_epoch, double, s.num_gpus, req.bucket_samples)
    would = []
    if formed < double:  # a batch holds no more than the epoch's samples (each aspect bucket's)
        within = "its largest aspect bucket's" if len(req.bucket_samples) > 1 else "the epoch's"
        would.append(f"the trainer forms no batch of more than {within} {formed}")
    if again:
        would.append(
            f"{count_text(again, 'batch', 'batches')} an epoch would train twice to give every GPU one"
        )
    if req.per_epoch > req.images and formed * s.num_gpus > req.images:
        would.append("a step could hold an image's repeats together")
    return (
        f"; no larger batch was tried: batch {double}{gpus} would exceed the {images}"
        + (f": {'; '.join(would)}" if would else "")
        + " (pin training.batch_size to go past it)"
    )


def _unlike(s: Settings, plan: Settings) -> str:
    """``s`` in words, with the settings it differs from the plan in as sdplan.yaml keys: the words leave a
    default out (a bf16 base), so an avoided configuration could read as the plan itself."""
    differ = _differ_text(s, plan)
    return f"{describe(s)}; unlike the plan: {differ}" if differ else describe(s)


def _differ_text(s: Settings, plan: Settings) -> str:
    """The settings ``s`` differs from the plan in, as sdplan.yaml `key=value`s ("" where none)."""
    differ = [f.name for f in fields(s) if getattr(s, f.name) != getattr(plan, f.name)]
    return ", ".join(pin_text(name, getattr(s, name)) for name in differ)


def _which(c: Candidate, best: Candidate) -> str:
    """How an avoided candidate compares with the plan, in words the numbers bear out."""
    if c.seconds is None or best.seconds is None:
        return "a larger"
    return "a faster" if c.seconds < best.seconds else "an otherwise preferred"


def _lowered_rank(req: Request, s: Settings) -> bool:
    """A LoRA rank below the requested one (it changes the result)."""
    return s.method == "lora" and not req.pinned("lora_rank") and s.lora_rank < req.lora_rank


def _settings_tier(s: Settings, lowered_rank: bool) -> tuple[bool, bool, bool]:
    """What the settings alone decide of :func:`_tier` (which lets :func:`_search` skip what loses by them): a
    lower LoRA rank than asked, DeepSpeed offload, full half weights."""
    return (lowered_rank, s.offload, s.full_half_weights)


def _tier(c: Candidate) -> tuple:
    """Preference before speed: within the likely peak's upper end, the requested LoRA rank, no offload (the
    optimizer on the CPU, host RAM held), fp32 master weights."""
    return (not c.safe, *_settings_tier(c.setup, c.lowered_rank))


# Where nothing fits within its likely range, the plans whose upper end is within this share of the lowest are
# the ones most likely to fit (smaller differences are well inside the range's own spread): speed decides
# among them.
OVERRUN_TIE = 0.02


def _most_likely_to_fit(fitting: list[Candidate]) -> list[Candidate]:
    """``fitting`` where one of them is within its likely range (``safe``: :func:`_tier` prefers those);
    else those whose likely peak's upper end (the card it needs, :func:`vram_required`) is within OVERRUN_TIE
    of the lowest: a plan that may run out of memory is the one least likely to."""
    if any(c.safe for c in fitting):
        return fitting
    need = {id(c): vram_required(c.memory.peak, c.peak_range) for c in fitting}
    low = min(need.values())
    return [c for c in fitting if need[id(c)] <= low * (1 + OVERRUN_TIE)]


def _preference(c: Candidate) -> tuple:
    """The order _choose picks plans in: the preferred tier, then the fastest."""
    return (_tier(c), _key(c))


def min_vram_needed(
    req: Request,
    profiles: Profiles,
    precision: str = "fp16",
    attention: str = "efficient",
    nvidia: bool = True,
    ram_usable_bytes: int | None = None,
    gpu: HWGPU | None = None,
) -> int | None:
    """The smallest VRAM (bytes) on which some configuration of this request (:func:`settings_space`, one GPU
    unless pinned) fits by the verdict's rule (:func:`vram_required`: its estimate within HEADROOM, its likely
    peak's upper end within the card), among those a host with ``ram_usable_bytes`` of RAM can run (None: any);
    None when that host can run none of them. With ``gpu``, as a plan on it has them: its `sdplan bench`
    peaks (:func:`card_peak`), and no configuration that ran out of memory on it."""
    if req.resolution is None:
        req = replace(req, resolution=profiles.model(req.model).native_resolution)
    n = pinned_gpu_count(req)
    space = settings_space(
        req, precision=precision, attention=attention, nvidia=nvidia, max_gpus=1, counts=(n,) if n else None
    )
    needs = []
    for s in (_sized(req, s) for s in space):  # at the largest micro-batch the trainer forms, as the search
        mem, peak_range, _ = card_peak(profiles, s, gpu.spec if gpu is not None else None)
        if not host_ram_ok(profiles, s, ram_usable_bytes, mem):
            continue
        if gpu is not None and _observed_oom(profiles, s, gpu) is not None:
            continue
        needs.append(vram_required(mem.peak, peak_range))
    return min(needs) if needs else None


def pinned_gpu_count(req: Request) -> int | None:
    """The GPU count a pin sets: distributed.gpu_ids (as many as it names) or distributed.num_processes; None
    where neither is pinned."""
    ids = req.pin("gpu_ids")
    return len(ids) if ids is not None else req.pin("num_gpus")


def suggest_hardware(
    profiles: Profiles,
    need_bytes: int,
    limit: int = 6,
    *,
    request: Request | None = None,
    ram_usable_bytes: int | None = None,
) -> list[tuple[str, GPUSpec]]:
    """(label, catalog GPU) of the catalog GPUs with at least ``need_bytes`` of VRAM: the smallest that fit
    first, then by speed. With the ``request``, only those on which it fits by the verdict's rule (no "may not fit" flag) in this host RAM: a
    GPU's own leanest configuration (:func:`min_vram_needed`) depends on what it runs (no full bf16 weights
    without bf16, no 8-bit AdamW or nf4 off NVIDIA, the math attention path on RDNA1/2) and on its own
    `sdplan bench` peaks and out-of-memory points, and a pin it cannot run rules it out. A pinned GPU count
    (``distributed.num_processes``) is suggested as that many of each card (``2x RTX 4090``): ``need_bytes`` is
    then per GPU, and one card alone conflicts with the pin. Pinned GPUs (``distributed.gpu_ids``) are as many,
    on a machine that has the GPUs named (``[2, 3]``: ``4x RTX 4090``)."""
    if request is None:
        fit = sorted(
            (g for g in profiles.gpus if g.memory_bytes >= need_bytes),
            key=lambda g: (g.memory_gib, -g.fp16_tflops),
        )
        return [(g.name, g) for g in fit[:limit]]

    # a GPU with sdplan bench peaks of its own for this model and method may need less than ``need_bytes``: it is
    # judged, not dropped
    def measured_here(g: GPUSpec) -> bool:
        return any(
            p.from_bench
            and p.model == request.model
            and p.method == request.method
            and p.outcome.get("peak_vram_gib")
            for p in profiles.points_on(g.name)
        )

    fit = sorted(
        (g for g in profiles.gpus if g.memory_bytes >= need_bytes or measured_here(g)),
        key=lambda g: (g.memory_gib, -g.fp16_tflops),
    )
    needs: dict[tuple, int | None] = {}
    ids = request.pin("gpu_ids")
    count = max(ids) + 1 if ids else pinned_gpu_count(request) or 1

    def need_on(spec: GPUSpec, own: bool) -> int | None:
        hw = hardware_from_catalog(spec, count)
        gpu = hw.gpus[0]
        key = (
            precision_for(hw.gpus),
            attention_backend(gpu),
            base_precision_allowed("nf4", gpu) is None,  # nf4's kernels: NVIDIA, compute capability 6.0+
            spec.name if own else None,
        )
        if key not in needs:
            needs[key] = min_vram_needed(
                request,
                profiles,
                precision=key[0],
                attention=key[1],
                nvidia=key[2],
                ram_usable_bytes=ram_usable_bytes,
                gpu=gpu if own else None,
            )
        return needs[key]

    def runs(spec: GPUSpec) -> bool:
        if pin_conflicts(request, hardware_from_catalog(spec, count)):
            return False
        # a GPU with points of its own (bench peaks, out-of-memory) is judged alone; the rest by what they run
        own = bool(profiles.points_on(spec.name))
        need = need_on(spec, own)
        if need is None or spec.memory_bytes < need:
            return False
        # one with less memory than ``need_bytes``: only where its own points are what make it fit (where what it
        # runs does, as NVIDIA's 8-bit AdamW for an AMD machine's plan, "needs at least" rules it out as before)
        if spec.memory_bytes < need_bytes:
            generic = need_on(spec, False)
            return generic is None or spec.memory_bytes < generic
        return True

    out: list[tuple[str, GPUSpec]] = []
    for g in fit:  # in order, until ``limit`` run it
        if len(out) == limit:
            break
        if runs(g):
            out.append((hardware_from_catalog(g, count).label, g))
    return out


def _gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def _size(x: float) -> str:
    """Bytes in GiB (:func:`_gib`) from 1 GiB, in MiB below it: a LoRA's weights and their all-reduce read
    "0.0 GiB"."""
    if x >= GiB:
        return _gib(x)
    return f"{x / 2**20:.0f} MiB" if x >= 2**20 else "under 1 MiB"


def final_grid_fits(m: Memory, vram_bytes: int) -> bool:
    """Whether the trainer's sample grid (after the weights are written; mid-run with sampling.every_steps)
    fits beside the training state. Fit decisions use the step's peak: the final grid is made after the export
    and its out-of-memory is caught, so it never costs the run (trainer/loop.py)."""
    return m.sampling_peak <= HEADROOM * vram_bytes


def breakdown_text(m: Memory, s: Settings | None = None) -> str:
    """The step's parts in GiB, and, when they do not add up to its peak, why: freed gradients never coexist
    with the forward's activations, the step transient only follows the backward, and the overhead is part of
    the sum; each peak is the largest of the phases, not the sum of everything. ``s``: the settings, for what
    frees the gradients (DeepSpeed without offload lets go of them before its step: step_allocated_bytes)."""
    parts = {k: v for k, v in m.parts().items() if v > 0}
    text = ", ".join(f"{k.replace('_', ' ')} {_size(v)}" for k, v in parts.items())
    total = sum(parts.values())
    step = m.step_peak or m.peak
    if _gib(total) != _gib(step):  # as shown: "add up to 11.2 GiB, not the step's 11.2 GiB" says nothing
        text += (
            f" (these add up to {_gib(total)}, not the step's {_gib(step)}: "
            + (
                "the activations, the gradients ("
                + (
                    "DeepSpeed lets go of its half gradients and buckets before the optimizer step"
                    if s is not None and s.sharded
                    else "freed after every step with set_to_none"
                )
                + ") and the step's temporaries are not all alive at once; the peak is the largest phase"
                if total > step
                else "the parts are each phase's own, and the peak is the largest phase"
            )
            + ")"
        )
    if m.text_cache_peak > step:
        text += (
            f"; the peak is {_gib(m.text_cache_peak)} before training, while the text encoders encode the captions "
            "(memory.cache_text_encoder_outputs: they and the VAE on the GPU, the denoiser not yet)"
        )
    return text


def format_range(value: float, rng: tuple[float, float], unit: str = "GiB") -> str:
    """'15.9 GiB (likely 14.2-18.1)' for bytes; durations with :func:`format_duration`."""
    if unit == "GiB":
        return f"{value / GiB:.1f} GiB (likely {rng[0] / GiB:.1f}-{rng[1] / GiB:.1f})"
    return f"{format_duration(value)} (likely {format_duration(rng[0])} to {format_duration(rng[1])})"


def format_duration(seconds: float) -> str:
    """A duration in words: tenths under a second, seconds under 90, minutes and seconds under 10 minutes (a
    ratio said beside two times must read true of them: 108 s was "2 min"), then minutes, then hours. Taken
    to the tenth first, as the JSON's seconds are, so a time and that figure read back say the same; each
    coarser step rounds that tenth half up (2.5 s is "3 s", as 89.95 and 89.94 are both "1 min 30 s")."""
    if seconds < -0.05:
        raise ValueError(f"a negative duration: {seconds} s")
    tenths = round(max(seconds, 0.0), 1)
    whole = math.floor(tenths + 0.5)
    if tenths < 0.1:
        return "under 0.1 s"
    if tenths < 1:
        return f"{tenths:.1f} s"
    if whole < 90:
        return f"{whole} s"
    if whole < 600:
        minutes, rest = divmod(whole, 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    if whole < 5400:
        return f"{math.floor(tenths / 60 + 0.5)} min"
    return f"{math.floor(tenths / 360 + 0.5) / 10:.1f} h"


def pin_items(name: str, value: Any) -> list[tuple[str, Any]]:
    """A Settings field and value as the sdplan.yaml keys and values a user sets: the EMA field (None or its
    device) is ema.enabled, and ema.device where it is on (the device is planned as given, its default cpu)."""
    if name == "ema":
        return [("ema.enabled", False)] if value is None else [("ema.enabled", True), ("ema.device", value)]
    return [(CONFIG_KEYS.get(name, name), value)]


def pin_text(name: str, value: Any) -> str:
    """A Settings field and value as the sdplan.yaml `key=value` a user types (ema.enabled=true, ema.device=cpu:
    two, :func:`pin_items`)."""
    return ", ".join(f"{key}={_value_text(v)}" for key, v in pin_items(name, value))


def _value_text(value: Any) -> str:
    """A setting's value as typed after `key=`."""
    if isinstance(value, bool):
        v = str(value).lower()
    elif value is None:
        v = "null"
    elif isinstance(value, dict):
        v = (
            "{"
            + ", ".join(f"{k}: {str(x).lower() if isinstance(x, bool) else x}" for k, x in value.items())
            + "}"
        )
    elif isinstance(value, (list, tuple)):
        v = "[" + ", ".join(str(x) for x in value) + "]"
    else:
        v = str(value)
    return v


def zero_alone(stage: int, where: str) -> tuple[str, str]:
    """(what is wrong, the fix) of DeepSpeed ZeRO on one process without offload: a pin the planner refuses
    (:func:`pin_conflicts`), and a config `sdplan train` is given as it is (launcher.prepare)."""
    return (
        f"distributed.deepspeed.zero_stage={stage} on {where} without offload: ZeRO splits the optimizer state over "
        "the processes, and one process has nothing to split it over, so it holds more than without DeepSpeed",
        "set distributed.deepspeed.offload_optimizer=true, train on 2 or more GPUs, or drop the "
        "distributed.deepspeed settings",
    )


def pin_conflicts(req: Request, hw: Hardware) -> list[str]:
    """Pins these GPUs, all of them used, cannot run at all, whatever the memory: each a sentence with the fix
    (naming the GPU that lacks what a pin needs)."""
    out = []
    if not hw.gpus:
        return out
    no_bf16 = next((g for g in hw.gpus if not g.bf16), None)
    no_fp16 = next((g for g in hw.gpus if not g.fp16), None)
    precision = req.pin("precision")
    if precision == "bf16" and no_bf16 is not None:
        # the precision it would plan without the pin: fp32 where fp16 gives NaN losses (GTX 16)
        out.append(
            f"training.precision=bf16: {no_bf16.name} has no bf16 in hardware "
            f"(use training.precision={precision_for(hw.gpus)})"
        )
    if precision == "fp16" and no_fp16 is not None:
        out.append(
            f"training.precision=fp16: {no_fp16.name} reports no fp16 support (use training.precision=fp32)"
        )
    if req.pin("full_half_weights") and precision is None and no_bf16 is not None:
        out.append(
            f"training.full_half_weights=true: needs bf16, which {no_bf16.name} lacks in hardware "
            "(use training.full_half_weights=false)"
        )
    n = req.pin("num_gpus")
    limit = min(hw.count, req.max_gpus or hw.count)
    if n is not None and n > limit:
        out.append(
            f"distributed.num_processes={n}: this hardware has {count_text(limit, 'usable GPU')}"
            + (f" ({hw.hidden_by} hides {count_text(len(hw.hidden), 'other')})" if hw.hidden else "")
            + (
                f" ({count_text(len(hw.left_out), 'other')} cannot train here: see `sdplan doctor`)"
                if hw.left_out
                else ""
            )
            + " (use at most "
            f"{limit})"
        )
    elif n is not None and n > (
        most := max(sum(g.vendor == v for g in hw.gpus) for v in {g.vendor for g in hw.gpus})
    ):
        out.append(
            f"distributed.num_processes={n}: this machine's NVIDIA and AMD GPUs cannot train together (one torch "
            f"build drives a run) (use at most {most})"
        )
    ids = req.pin("gpu_ids")
    if ids is not None:
        by_index = {g.index: g for g in hw.gpus}
        have = ", ".join(str(g.index) for g in hw.gpus)
        if (missing := [i for i in ids if i not in by_index]) and missing[0] in hw.hidden:
            out.append(
                f"distributed.gpu_ids={list(ids)}: GPU {missing[0]} is hidden from the run ({hw.hidden_by} "
                f"is set; it shows GPU{'s' if len(hw.gpus) > 1 else ''} {have}): unset "
                f"{hw.hidden_by.split('=')[0]} to train on it"
            )
        elif missing and (why := dict(hw.left_out).get(missing[0])):
            out.append(
                f"distributed.gpu_ids={list(ids)}: GPU {missing[0]} cannot train here: {why}; list "
                f"GPU{'s' if len(hw.gpus) > 1 else ''} {have} instead"
            )
        elif missing:
            out.append(
                f"distributed.gpu_ids={list(ids)}: this hardware has no GPU {missing[0]} (it has "
                f"GPU{'s' if len(hw.gpus) > 1 else ''} {have}; `sdplan doctor` numbers them)"
            )
        elif len({by_index[i].vendor for i in ids}) > 1:
            out.append(
                f"distributed.gpu_ids={list(ids)}: NVIDIA and AMD GPUs cannot train together (one torch build "
                "drives a run): list one vendor's"
            )
        elif len(ids) > limit:
            out.append(f"distributed.gpu_ids={list(ids)}: more GPUs than the {limit} allowed (--gpus)")
        if n is not None and n != len(ids):
            out.append(
                f"distributed.gpu_ids={list(ids)} lists {count_text(len(ids), 'GPU')} but "
                f"distributed.num_processes={n}: "
                "give as many of each"
            )
    ds = req.pin("deepspeed")
    count = len(ids) if ids is not None else n if n is not None else limit  # the processes a plan can have
    # offload pinned off: on one GPU (a set of one, in a search over a machine's sets) refused; the stage alone
    # pinned leaves offload to the search, which on one GPU takes it
    if ds and ds.get("offload_optimizer") is False and count == 1:
        what, fix = zero_alone(ds.get("zero_stage", 2), "one GPU")
        out.append(f"{what} ({fix})")
    base = req.pin("base_precision")
    if base is not None and base != "bf16" and not flow_family(req.model):
        out.append(
            f"model.base_precision={base}: a quantized frozen base is planned for the transformer families "
            f"({', '.join(registry.FLOW_FAMILIES)}) only (use model.base_precision=bf16)"
        )
    elif base is not None and base != "bf16" and req.method != "lora":
        out.append(
            f"model.base_precision={base}: only LoRA trains over a quantized frozen base; {req.method} trains the "
            "base's own weights (use model.base_precision=bf16)"
        )
    elif base is not None and (
        why := next(filter(None, (base_precision_allowed(base, g) for g in hw.gpus)), None)
    ):
        instead = "fp8 or bf16" if base_install(hw, "fp8") is None else "bf16"
        out.append(f"model.base_precision={base}: {why} (use model.base_precision={instead})")
    elif base is not None and (need := base_install(hw, base)):
        others = [b for b in ("fp8",) if b != base and base_install(hw, b) is None]
        out.append(
            f"model.base_precision={base}: needs {need[0]} on this machine: {need[1]} (or use "
            f"model.base_precision={' or '.join((*others, 'bf16'))})"
        )
    if req.pin("train_text_encoder") and flow_family(req.model):
        out.append(
            f"training.train_text_encoder=true: not supported for {req.model} (the transformer trains; the CLIP/T5 "
            "encoders stay frozen in the bundled trainer) (use training.train_text_encoder=false)"
        )
    swap_why = swap_problem(  # the trainer's own rule; what is not pinned the search chooses to suit it
        req.pin("blocks_to_swap", 0),
        family=req.model,
        method=req.method,
        gradient_checkpointing=req.pin("gradient_checkpointing") is not False,
        processes=req.pin("num_gpus") or 1,
        deepspeed=bool(req.pin("deepspeed")),
    )
    if swap_why:
        out.append(swap_why)
    swap, most = req.pin("blocks_to_swap", 0), MAX_BLOCKS_TO_SWAP.get(req.model)
    if not swap_why and most is not None and swap > most:  # past it the planner's bytes went negative
        out.append(
            f"memory.blocks_to_swap={swap}: {req.model} swaps at most {most} blocks (kohya's limit: two blocks of "
            f"each list stay on the GPU) (use memory.blocks_to_swap={most} or fewer)"
        )
    if req.pin("optimizer") == "adamw8bit" and any(g.vendor != "nvidia" for g in hw.gpus):
        out.append(
            "memory.optimizer=adamw8bit: bitsandbytes runs on NVIDIA GPUs only (use adamw or adafactor)"
        )
    return out


def _infeasible(
    req,
    hw,
    reasons,
    steps,
    *,
    memory=None,
    need=None,
    profiles=None,
    conflicts=(),
    observed_oom=None,
    may_run_out=None,
):
    needs = {"min_vram_bytes": None, "observed_oom": observed_oom} if observed_oom is not None else None
    if need is not None:
        # a GPU that trains in fp32 because its fp16 gives NaN losses (GTX 16): what a GPU that trains in fp16
        # mixed precision needs, from which the cards that would fit are drawn (each by its own precision)
        mixed = None
        if _fp16_nan_gpu(hw.gpus) and not req.pinned("precision"):
            mixed = min_vram_needed(req, profiles, precision="fp16", ram_usable_bytes=hw.ram_usable_bytes)
            mixed = mixed if mixed is not None and mixed < need else None
        suggested = suggest_hardware(
            profiles, mixed or need, request=req, ram_usable_bytes=hw.ram_usable_bytes
        )
        needs = {
            "min_vram_bytes": need,
            # from this much a plan is given, flagged "may not fit": its estimate within HEADROOM of the card, its
            # likely range past it (None where that is the same as min_vram_bytes)
            "min_vram_bytes_may_run_out": may_run_out
            if may_run_out is not None and may_run_out < need
            else None,
            "min_vram_bytes_mixed_precision": mixed,
            "suggested_hardware": [label for label, _ in suggested],
            # those with less memory than that: their own sdplan bench peaks say the run fits them
            "suggested_by_own_peaks": [label for label, g in suggested if g.memory_bytes < (mixed or need)],
        }
    return Result(
        feasible=False,
        request=req,
        hardware=hw,
        plan=None,
        steps=steps,
        memory=memory,
        seconds=None,
        step_seconds=None,
        speedup_vs_one_gpu=None,
        basis=None,
        needs=needs,
        reasons=tuple(reasons),
        vram_bytes=max(g.memory_bytes for g in hw.gpus) if hw.gpus else None,
        pin_conflicts=tuple(conflicts),
    )


def _choose(fitting: list[Candidate], profiles: Profiles) -> tuple[Candidate, dict[int, Candidate]]:
    """The preferred tier (:func:`_tier`), fastest first; more GPUs only from the same tier and when the gain
    over the fewer GPUs chosen so far clears the time uncertainty (:func:`multi_gpu_gain`: each GPU added
    must pay for itself; a 4-GPU run 0.05% faster than 3 is not advised for being 10% faster than one). Where only
    several GPUs reach the preferred tier (DeepSpeed splitting fp32 master weights and AdamW state that one GPU
    cannot hold), the fewest that do, and more only on the same terms.
    Returns the choice and each GPU count's own best (for the reasons)."""
    best_by_n: dict[int, Candidate] = {}
    for c in sorted(_most_likely_to_fit(fitting), key=_preference):
        best_by_n.setdefault(c.setup.num_gpus, c)
    top = min(_tier(c) for c in best_by_n.values())
    eligible = {n: c for n, c in best_by_n.items() if _tier(c) == top}
    one = eligible.get(1)
    best = one or eligible[min(eligible)]
    for n, c in sorted(eligible.items()):
        if n == best.setup.num_gpus or c.seconds is None or best.seconds is None:
            continue
        if multi_gpu_gain(c, best, profiles) > MIN_MULTI_GPU_GAIN and speedup(c, best) > 1:
            best = c
    return best, best_by_n


def _pinned_count_one_gpu(
    req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int
) -> Candidate | None:
    """Where distributed.num_processes pins several GPUs, the one-GPU run the plan is compared with: the one
    :func:`_choose` would take on one GPU with the other pins kept (what ``--gpus N`` compares with); None where
    the count is not pinned above one, distributed.gpu_ids names the GPUs, or nothing fits on one."""
    n = req.pin("num_gpus")
    if n is None or n < 2 or req.pinned("gpu_ids"):
        return None
    alone = replace(req, pins=tuple((k, v) for k, v in req.pins if k != "num_gpus"), max_gpus=1)
    if not any(not pin_conflicts(alone, on) for on in _gpu_choices(alone, hw)):
        return None
    fitting = [c for c in _search(alone, profiles, hw, cal, resolution)[0] if c.fits]
    return _choose(fitting, profiles)[0] if fitting else None


def _gain_reference(one: Candidate | None, best: Candidate) -> Candidate:
    """The run more GPUs are weighed against: the one-GPU run where it has a time, else the current choice."""
    return one if one is not None and one.seconds else best


def multi_gpu_gain(c: Candidate, ref: Candidate, profiles: Profiles) -> float:
    """The share of ``ref``'s run time (one GPU, or fewer GPUs) that ``c`` saves for sure enough to advise it,
    on :func:`speedup`'s basis (``ref`` training ``c``'s images): with the steps' compute at the low end of its
    time band in both runs (the same GPU, batch and model: their error is shared, and faster compute leaves the
    all-reduce a larger share) and the all-reduce at the high end in ``c``, the low end in ``ref`` (it is what
    more GPUs add: PCIe without NVLink made DreamBooth slower on two GPUs than on one), or as predicted where
    its rate was measured on these GPUs (an observation). The run less its class images and final grid: no GPU
    count changes them (the main process samples them), and counted in they made a GPU that halves the steps
    look not worth it while the class folder was empty."""
    low, high = profiles.uncertainty.seconds_for(c.setup.model)[0]

    def run(x: Candidate, allreduce_factor: float) -> float:
        factor = 1.0 if x.observed_multi_gpu else allreduce_factor
        return _run_seconds(x, c.steps.images_seen, with_once=False, compute=low, allreduce=factor)

    return 1 - run(c, high) / run(ref, low)


def _run_seconds(
    x: Candidate, images: int, *, with_once: bool = True, compute: float = 1.0, allreduce: float = 1.0
) -> float:
    """``x``'s run time had it seen ``images`` images at its own pace: its fixed costs as they are (start-up,
    latent caching, the class images and final grid: none follows the images seen) and what follows its steps
    (their compute, the all-reduce, the grids sampled every N steps and at saves) scaled from its images seen.
    ``with_once`` False leaves the class images and final grid out; ``compute`` and ``allreduce`` scale those
    parts of the steps (:func:`multi_gpu_gain`'s time band). The one basis of :func:`speedup`."""
    once = x.sampling_once_seconds
    during = (x.sampling_seconds or 0.0) - once
    fixed = x.fixed_seconds - during - (0.0 if with_once else once)
    compute_s = x.seconds - x.fixed_seconds - x.allreduce_seconds
    follows = during + compute_s * compute + x.allreduce_seconds * allreduce
    return fixed + follows * images / x.steps.images_seen


def speedup(c: Candidate, ref: Candidate, *, with_once: bool = True) -> float:
    """How much faster ``c`` trains what it trains than ``ref`` would (above 1: faster): ``ref``'s fixed costs
    as they are, its steps and the grids during them scaled to ``c``'s images seen, over ``c``'s time
    (:func:`_run_seconds`). The one measure GPU counts are chosen by (:func:`_choose`, :func:`multi_gpu_gain`)
    and every speed ratio the reasons and "vs one GPU" say. Where epochs set the images every run sees the
    same, and it is their times' ratio; a pinned training.max_steps makes each see its own, where seconds per
    image seen (fixed seconds spread over other image counts) read a run about as fast by the clock 1.83x
    slower, and the choice and its reasons were on two bases. ``with_once`` False leaves the class images and
    final grid out of both (no GPU count changes them)."""
    images = c.steps.images_seen
    return _run_seconds(ref, images, with_once=with_once) / _run_seconds(c, images, with_once=with_once)


def run_time_text(c: Candidate, best: Candidate) -> str:
    """``c``'s run time, with the images it sees where they are not the plan's (training.max_steps: another
    global batch sees other images in as many steps, so the two times are of different runs)."""
    if c.steps.images_seen == best.steps.images_seen:
        return format_duration(c.seconds)
    return (
        f"{format_duration(c.seconds)} for {c.steps.images_seen} images seen against the plan's "
        f"{best.steps.images_seen}"
    )


def slower_words(c: Candidate, ref: Candidate) -> str:
    """ "slower", or "slower for its images" where ``c`` sees other images than ``ref``
    (:func:`run_time_text`): :func:`speedup` weighs ``ref`` training ``c``'s images, not the times said."""
    return "slower" if c.steps.images_seen == ref.steps.images_seen else "slower for its images"


def more_gpus_text(c: Candidate, best: Candidate) -> str:
    """Why ``c``, on more GPUs than the plan, is not the plan, in the words of the plan's reasons
    (:func:`_multi_gpu_reasons`), weighed as :func:`_choose` weighs it (:func:`speedup`)."""
    ahead = speedup(c, best)
    if ahead <= 1:
        return slower_words(c, best)
    than = f"{best.setup.num_gpus} GPUs" if best.setup.num_gpus > 1 else "one GPU"
    if _tier(c) > _tier(best):
        return f"{ahead:.2f}x faster than {than}, but only with {_tier_text(c, best)}"
    return f"predicted {ratio_than_text(ahead, than)}: within the time uncertainty"


def plan(hardware: Hardware | Any, profiles: Profiles, request: Request) -> Result:
    """Choose the fastest whole run that fits. ``hardware``: a Hardware, or a machine Snapshot (probe)."""
    if not isinstance(hardware, Hardware):
        hardware = hardware_from_snapshot(hardware, profiles)
    req = request
    if req.method not in METHODS:
        raise ValueError(f"unknown method {req.method!r}")
    model = profiles.model(req.model)
    if not registry.family(req.model).plans(req.method):
        raise registry.not_supported(req.method, req.model)
    resolution = req.resolution or model.native_resolution
    req = replace(req, resolution=resolution)
    cal = calibrate_for(profiles, hardware)
    reasons: list[str] = list(hardware.notes)
    if req.pins and req.pins_named:
        reasons.append(f"pinned: {req.pins_named}, every one (checked for fit)")
    elif req.pins:
        keys = [key for name, value in req.pins for key, _ in pin_items(name, value)]  # ema: one or two keys
        them = "it" if len(keys) == 1 else "them"
        reasons.append(
            "pinned: " + ", ".join(pin_text(k, v) for k, v in req.pins) + f" (planned around {them})"
        )
    one_steps = _steps(req, 1, 1, 1)

    if not hardware.gpus:
        # the smallest GPU any card could run it on: one with bf16 has every configuration (full bf16 weights
        # too); the figure without bf16 is said beside it where it differs (suggest_hardware checks each card)
        ram = hardware.ram_usable_bytes
        need = min_vram_needed(req, profiles, precision="bf16", ram_usable_bytes=ram)
        no_gpu = f"no usable GPU on this machine ({hardware.label or 'none found'}): training {req.method} on {req.model}"
        if need is None:
            reasons.append(
                f"{no_gpu} needs a GPU, and every configuration of it holds more in host RAM than "
                f"{int(HOST_RAM_SHARE * 100)}% of this machine's {_gib(hardware.ram_usable_bytes)}"
            )
        else:
            without = min_vram_needed(req, profiles, precision="fp16", ram_usable_bytes=ram)
            said = f"{no_gpu} needs at least {_gib(need)} of GPU memory"
            if without != need:
                said += f" on a GPU with bf16 ({_gib(without) if without is not None else 'none'} without)"
            reasons.append(said)
        anyhost = min_vram_needed(req, profiles, precision="bf16", ram_usable_bytes=None)
        if anyhost is not None and (need is None or anyhost < need):
            # a leaner configuration (DeepSpeed offload, block swap) that only more host RAM allows
            reasons.append(
                f"host RAM: the figure is for this machine's {_gib(ram)} of RAM; on a host with more (DeepSpeed "
                f"offload or block swap holds the rest there), {_gib(anyhost)} of GPU memory would do "
                "(`--hardware NAME` plans a card with no host RAM limit; `--machine FILE`, a saved machine's)"
            )
        return _infeasible(req, hardware, reasons, one_steps, need=need, profiles=profiles)

    # a pin rules out the GPU sets that cannot run it; it conflicts where none can (said for the first: the best
    # single GPU, or the machine where no set has the pinned GPU count or GPUs)
    choices = _gpu_choices(req, hardware)
    if not any(not pin_conflicts(req, on) for on in choices):
        conflicts = pin_conflicts(req, choices[0] if choices else hardware)
        if conflicts:
            return _infeasible(req, hardware, reasons + conflicts, one_steps, conflicts=conflicts)

    cands, on_count = _search(req, profiles, hardware, cal, resolution)
    fitting = [c for c in cands if c.fits]
    if not fitting:  # the search skipped nothing (_search): every candidate is here to say why
        what = req.pins_named or (
            ", ".join(pin_text(k, v) for k, v in req.pins) if req.pins else "the leanest configuration"
        )
        leanest, need, not_fit = _not_fit_reasons(req, hardware, cands, what, profiles)
        runnable = [c for c in cands if c.host_ok and c.observed_oom is None]
        may_run_out = min((math.ceil(c.memory.peak / HEADROOM) for c in runnable), default=None)
        reasons += not_fit
        installs = _after_install(req, profiles, hardware, cal, resolution)
        reasons += [said for _, said in installs]
        relax = _relaxations(req, profiles, hardware, cal, resolution)
        if relax:
            reasons.append("fits when changed: " + "; or ".join(relax))
        reasons += _fp16_would_fit(req, profiles, hardware, cal, resolution)
        if flow_family(req.model) and req.method in FULL_METHODS:
            reasons.append(FLOW_FULL_NOT_IN_TRAINER)
        refused = _infeasible(
            req,
            hardware,
            reasons,
            one_steps,
            memory=leanest.memory,
            need=need,
            profiles=profiles,
            observed_oom=leanest.observed_oom.id if leanest.observed_oom is not None else None,
            may_run_out=may_run_out,
        )
        if installs:  # the fix on this machine: what to install (recommend's headline says it)
            refused = replace(
                refused, needs={**(refused.needs or {}), "fits_after_install": [fix for fix, _ in installs]}
            )
        return refused

    best, best_by_n = _choose(fitting, profiles)
    fitting = on_count(best.setup.num_gpus)  # what the reasons weigh the plan against: its GPU count, in full
    if 1 not in best_by_n and (pinned_one := _pinned_count_one_gpu(req, profiles, hardware, cal, resolution)):
        best_by_n = {1: pinned_one, **best_by_n}  # compared with, never the plan (the pin stands)
    one = best_by_n.get(1)
    vs_one = speedup(best, one) if (one and one.seconds and best.seconds) else None
    if mixed_gpus(hardware):
        reasons.append(_mixed_text(hardware, best, profiles, cal))
    elif links := _links_text(hardware, best):
        reasons.append(links)
    reasons += _reasons(req, hardware, best, one, best_by_n, fitting, cal, profiles)
    reasons += [said for _, said in _after_install(req, profiles, hardware, cal, resolution, best)]
    used = plan_gpus(hardware, best.setup)
    shaped = (p for g in _distinct(used) for p in _local_ooms(profiles, best.setup, g))
    if ooms := {
        p.id: p for p in shaped if _oom_applies(p, best.setup) and p.resolution == best.setup.resolution
    }:
        first, one_point = next(iter(ooms.values())), len(ooms) == 1
        its = "its" if one_point else "their"
        reasons.append(
            f"measured out of memory on {smallest_gpu(used).name}: {count_text(len(ooms), 'local point')} "
            f"({'' if one_point else 'e.g. '}{first.id}: {describe(first.settings)}) "
            f"{'rules' if one_point else 'rule'} out {its} configuration{'' if one_point else 's'} and what the "
            f"model says needs at least {OOM_MARGIN:.0%} of {its} memory (at {its} resolution)"
        )
    if flow_family(req.model):
        used = plan_gpus(hardware, best.setup)
        reasons += _flow_reasons(
            req,
            best,
            fitting,
            cal,
            profiles,
            pace_gpu(profiles, best.setup, used, cal, set_link(hardware, used)[1])[0].spec,
            smallest_gpu(used).memory_bytes,
        )
    alternatives = tuple(sorted(best_by_n.values(), key=lambda c: c.setup.num_gpus))
    return Result(
        feasible=True,
        request=req,
        hardware=hardware,
        plan=best.setup,
        steps=best.steps,
        memory=best.memory,
        seconds=best.seconds,
        step_seconds=best.step_seconds,
        speedup_vs_one_gpu=vs_one,
        basis=best.basis,
        needs=None,
        reasons=tuple(reasons),
        vram_bytes=smallest_gpu(plan_gpus(hardware, best.setup)).memory_bytes,
        alternatives=alternatives,
        peak_range=best.peak_range,
        seconds_range=best.seconds_range,
        sampling_seconds=best.sampling_seconds,
        within_upper_bound=best.safe,
        peak_measured=best.peak_measured,
        peak_basis=best.peak_basis,
    )


def _required(c: Candidate) -> int:
    """The GPU memory a candidate needs by the verdict's rule (:func:`vram_required`)."""
    return vram_required(c.memory.peak, c.peak_range)


def _not_fit_reasons(
    req: Request, hw: Hardware, cands: list[Candidate], what: str, profiles: Profiles
) -> tuple[Candidate, int | None, list[str]]:
    """Why nothing fits: (the leanest configuration this host can run, the GPU memory it needs, the reasons).

    "needs at least" comes only from configurations the host RAM can hold (:attr:`Candidate.host_ok`); a leaner
    one that only more host RAM would allow (DeepSpeed offload, block swap) is named with the RAM it needs.
    When the host can run none, the host RAM is the blocker: no GPU-memory figure (None)."""
    ram = hw.ram_usable_bytes
    runnable = [c for c in cands if c.host_ok]
    leanest_any = min(cands, key=_required)

    def host_text(c: Candidate) -> str:
        held = host_ram_needed_bytes(profiles, c.setup, c.memory)
        return (
            f"holds {_gib(held)} in host RAM, more than {int(HOST_RAM_SHARE * 100)}% of this machine's {_gib(ram)} "
            f"(at least {_gib(held / HOST_RAM_SHARE)} of host RAM)"
        )

    if not runnable:
        return (
            leanest_any,
            None,
            [
                f"nothing fits: host RAM is the blocker: {what} ({describe(leanest_any.setup)}) "
                + host_text(leanest_any)
                + f"; it needs {format_range(leanest_any.memory.peak, leanest_any.peak_range)} per GPU on "
                + smallest_gpu(plan_gpus(hw, leanest_any.setup)).name
            ],
        )
    leanest = min(runnable, key=_required)
    need = _required(leanest)
    gpu = smallest_gpu(plan_gpus(hw, leanest.setup))
    vram = gpu.memory_bytes
    if (oom := leanest.observed_oom) is not None:  # the model says it fits: a measured out-of-memory says not
        ran = (
            "ran out of GPU memory when measured on"
            if _is_the_oom(oom, leanest.setup)
            else f"needs, by the model, at least {OOM_MARGIN:.0%} of what a configuration that ran out of GPU "
            f"memory needs ({describe(oom.settings)}), measured on"
        )
        return (
            leanest,
            None,
            [
                f"nothing fits: {what} ({describe(leanest.setup)}) {ran} {gpu.name} (at batch {oom.batch}: local "
                f"point {oom.id}), though the model predicts {format_range(leanest.memory.peak, leanest.peak_range)}:"
                " what ran out of memory once will again; every other configuration needs more memory than the "
                "card's, or as much as what ran out"
            ],
        )
    if _required(leanest_any) < need:
        what += " this machine's host RAM allows"
    out = [
        f"nothing fits: {what} ({describe(leanest.setup)}) needs "
        f"{format_range(leanest.memory.peak, leanest.peak_range)} per GPU on {gpu.name} {_gib(vram)}, more than "
        f"its {int(HEADROOM * 100)}% limit ({_gib(HEADROOM * vram)}): at least {_gib(need)} of GPU memory "
        f"({FIT_RULE_TEXT})"
    ]
    if _required(leanest_any) < need:
        c = leanest_any
        gpu_vram = smallest_gpu(plan_gpus(hw, c.setup)).memory_bytes
        on_gpu = "which this GPU has" if _required(c) <= gpu_vram else f"at least {_gib(_required(c))}"
        out.append(
            f"host RAM: a leaner configuration ({describe(c.setup)}) would need only "
            f"{format_range(c.memory.peak, c.peak_range)} of GPU memory ({on_gpu}), but it " + host_text(c)
        )
    return leanest, need, out


# a pinned value, and the value a refusal offers first where the pin does not fit (it keeps what the user asked
# for): the EMA kept in host RAM before no EMA at all
NEARER_PINS: dict[tuple[str, Any], Any] = {("ema", "gpu"): "cpu"}


def _relaxations(
    req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int
) -> list[str]:
    """For each pin, the value that fits when only that pin is freed (the rest stay pinned); where none
    does, the fewest pins that fit when freed together (two pins that only fit when both change)."""
    from itertools import combinations

    names = [name for name, _ in req.pins]
    pinned = dict(req.pins)
    # up to three freed together, then all of them: a planning call each, so not every subset of many pins
    for size in [*range(1, min(len(names), 3) + 1), *([len(names)] if len(names) > 3 else [])]:
        out = []
        for group in combinations(names, size):
            rest = replace(req, pins=tuple(p for p in req.pins if p[0] not in group))
            best = None
            value = pinned[group[0]]  # a DeepSpeed pin is a dict: no nearer value
            nearer = (
                NEARER_PINS.get((group[0], value)) if isinstance(value, (str, int, float, bool)) else None
            )
            if size == 1 and nearer is not None:
                # what keeps the pin's intent first: an EMA on the GPU that does not fit, on the CPU
                best = _best_fitting(
                    replace(rest, pins=(*rest.pins, (group[0], nearer))), profiles, hw, cal, resolution
                )
            best = best or _best_fitting(rest, profiles, hw, cal, resolution)
            if best is not None:
                values = " and ".join(pin_text(name, getattr(best.setup, name)) for name in group)
                out.append(f"{values} {'fits' if size == 1 else 'fit together'} ({describe(best.setup)})")
        if out:
            return out
    return []


def _best_fitting(
    req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int
) -> Candidate | None:
    """The plan :func:`plan` would choose for ``req`` (another pin set of the same request), or None where
    nothing fits: what a relaxed or added pin gives."""
    fitting = [c for c in _search(req, profiles, hw, cal, resolution)[0] if c.fits]
    return _choose(fitting, profiles)[0] if fitting else None


def _after_install(
    req: Request,
    profiles: Profiles,
    hw: Hardware,
    cal: Calibration,
    resolution: int,
    best: Candidate | None = None,
) -> list[tuple[str, str]]:
    """The quantized bases the machine's recorded packages left out of the search (:func:`missing_bases`) that
    would fit after their install: ({"install": the pip command, "base_precision": the base}, a reason naming
    them) each; beside a plan (``best``) only one
    that would be faster, or fit within its likely range where the plan may not. Where nothing fits, the fix."""
    if not (flow_family(req.model) and req.method == "lora"):
        return []
    out = []
    for base in missing_bases(hw):
        pins = (*(p for p in req.pins if p[0] != "base_precision"), ("base_precision", base))
        alt = _best_fitting(replace(req, pins=pins), profiles, replace(hw, packages=None), cal, resolution)
        if alt is None:
            continue
        if best is not None and not (
            (alt.seconds is not None and best.seconds is not None and alt.seconds < best.seconds)
            or (alt.safe and not best.safe)
        ):
            continue
        what, command = base_install(hw, base)
        run = f", {format_duration(alt.seconds)} run" if alt.seconds is not None else ""
        out.append(
            (
                {"install": command, "base_precision": base},
                f"an {base} base would fit ({describe(alt.setup)}: {format_range(alt.memory.peak, alt.peak_range)} "
                f"per GPU{run}) after `{command}`: it needs {what}, so this machine's plans leave it out",
            )
        )
    return out


def _fp16_would_fit(
    req: Request, profiles: Profiles, hw: Hardware, cal: Calibration, resolution: int, *, safe: bool = False
) -> list[str]:
    """Where nothing fits in the fp32 planned for a GPU whose fp16 mixed precision gives NaN losses (GTX 16), what
    fits with training.precision=fp16 pinned, and the risk (one reason; none where fp16 does not fit either).
    ``safe``: where the fp32 plan fits only with its likely peak's upper end over the card ("may not fit"), what
    fits in fp16 within the upper end (none where fp16 does not either)."""
    nan = _fp16_nan_gpu(hw.gpus)
    if nan is None or req.pinned("precision"):
        return []
    best = _best_fitting(replace(req, pins=(*req.pins, ("precision", "fp16"))), profiles, hw, cal, resolution)
    if best is None or (safe and not best.safe):
        return []
    return [
        f"in fp16 it fits{' within the upper end' if safe else ''} ({describe(best.setup)}: "
        f"{format_range(best.memory.peak, best.peak_range)} per GPU"
        + (f", {format_duration(best.seconds)} run" if safe and best.seconds else "")
        + f"); pin training.precision=fp16 to plan it, but {_fp16_nan_note(nan)}"
    ]


def _band_scope(profiles: Profiles, model: str) -> str:
    """Which validation points an uncertainty band of ``model``'s plan comes from, in words."""
    if profiles.uncertainty.peak_vram_transformer is None:
        return "points"
    return "SD3.5 / FLUX.1 points" if flow_family(model) else "SD 1.x/2.x/SDXL points"


def _reasons(req, hw, best, one, best_by_n, fitting, cal, profiles) -> list[str]:
    s, m = best.setup, best.memory
    # what its memory and time were sized at (_evaluate): the largest micro-batch formed
    sized = _sized(req, s)
    used = plan_gpus(hw, s)
    gpu = used[0]  # one GPU: the GPU (bench evidence, the sample grid)
    # several that differ: the one with the least memory, and the slowest (pace_gpu), each named where it limits
    differ = len(_distinct(used)) > 1
    small = smallest_gpu(used)
    pace = pace_gpu(profiles, s, used, cal, set_link(hw, used)[1])[0]
    vram = small.memory_bytes
    less = len({g.memory_bytes for g in used}) > 1
    card = _gib(vram) + (f" ({small.name}'s, the least of the {len(used)})" if less else "")
    pinned = req.pinned
    r = []
    if pinned("precision"):
        nan = _fp16_nan_gpu(used) if s.precision == "fp16" else None
        r.append(f"precision {s.precision}: pinned" + (f"; note: {_fp16_nan_note(nan)}" if nan else ""))
    elif s.precision == "bf16":
        kept = (
            "bf16 weights and gradients, see below"
            if s.full_half_weights
            else "mixed precision, fp32 master weights"
        )
        names = " and ".join(g.name for g in _distinct(used))
        r.append(f"precision bf16: {names} support{'' if differ else 's'} bf16 in hardware ({kept})")
    elif s.precision == "fp16":
        lacking = next((g for g in used if not g.bf16), gpu)
        r.append(
            f"precision fp16: {lacking.name} has no bf16 in hardware (T4/V100/RDNA2 class), so fp16 mixed precision "
            "with loss scaling"
        )
    elif (nan := _fp16_nan_gpu(used)) is not None:
        r.append(
            f"precision fp32 (no mixed precision): {_fp16_nan_note(nan)}; it holds more memory than fp16 would, "
            "and pinning training.precision=fp16 plans that"
        )
    else:
        lacking = next((g for g in used if not g.fp16), gpu)
        r.append(f"precision fp32: {lacking.name} reports no fp16/bf16 support")
    r.append(
        f"attention: {'flash / memory-efficient SDPA' if s.attention == 'efficient' else 'math SDPA (no memory-efficient kernel for this GPU): activations grow with the square of the latent pixels'}"
    )
    same_no_gc = [
        c
        for c in fitting
        if c.setup.num_gpus == s.num_gpus and not c.setup.gradient_checkpointing and not c.setup.offload
    ]
    if pinned("gradient_checkpointing"):
        r.append(f"gradient checkpointing {'on' if s.gradient_checkpointing else 'off'}: pinned")
    elif s.gradient_checkpointing:
        no_gc_safe = [c for c in same_no_gc if c.safe]
        if best.seconds is not None and (no_gc_safe or (same_no_gc and not best.safe)):
            why = "it allows a larger batch that makes the whole run faster despite ~25% more time per sample"
        elif same_no_gc:
            why = "without it nothing fits within the likely peak's upper end (it costs ~25% time)"
        else:
            why = "nothing fits without it (it costs ~25% time)"
        r.append("gradient checkpointing on: " + why)
    else:
        r.append("gradient checkpointing off: the plan fits without it, and it would cost ~25% time")
    if s.method == "lora" and s.lora_dropout:
        dropped = lora_dropout_bytes(profiles, s)
        r.append(
            f"lora.dropout {s.lora_dropout:g}: "
            + (
                f"{_gib(dropped)} more saved activations (a dropped copy and a mask of each adapted layer's "
                "input), counted"
                if dropped
                else "its dropped copies are recomputed with gradient checkpointing"
            )
        )
    why = _adamw_text(best, fitting)
    opt_reason = {
        "adamw": "AdamW (8 bytes of fp32 state per trained parameter) fits",
        "adamw8bit": f"8-bit AdamW (bitsandbytes, ~2 bytes of state per parameter; CUDA only): {why}; "
        f"needs `{install_hint('bnb')}`",
        "adafactor": f"Adafactor (factored second moment, a fraction of AdamW's state): {why}",
    }[s.optimizer]
    r.append(f"optimizer {s.optimizer}: " + ("pinned" if pinned("optimizer") else opt_reason))
    r.append(_latent_cache_text(req, best, fitting))
    if s.cache_text_encoder_outputs:
        te = stored_text_encoder_bytes(profiles.model(s.model), s)
        r.append(
            "text-encoder outputs cached (kohya --cache_text_encoder_outputs): the text encoders run once per "
            f"caption before training and leave the GPU (~{_gib(te)}); the result is the same (each epoch's "
            "shuffled tags and caption dropout's empty caption are encoded too)"
            + (": pinned" if pinned("cache_text_encoder_outputs") else "")
        )
    if best.lowered_rank:
        r.append(
            f"LoRA rank {s.lora_rank} instead of the requested {req.lora_rank}: nothing fits at rank "
            f"{req.lora_rank}; a lower rank changes the result (less capacity; kohya's SDXL notes use 4-8 on "
            "8 GB cards). Pin lora.rank to keep it"
        )
    if s.full_half_weights:
        r.append(
            "full bf16 weights and gradients (no fp32 master copy, kohya --full_bf16): "
            + (
                "pinned"
                if pinned("full_half_weights")
                else "nothing with fp32 master weights fits; tried before DeepSpeed offload, which runs the optimizer "
                "on the CPU"
            )
        )
    elif req.method in FULL_METHODS and s.precision == "bf16" and not pinned("full_half_weights"):
        half = _faster_full_half(best, fitting)
        if half is not None:
            r.append(
                "fp32 master weights kept over speed (a quality preference for full-weight training): full bf16 "
                f"weights and gradients (training.full_half_weights=true, no fp32 master copy) would take "
                f"{format_duration(half.seconds)}, {1 - half.seconds / best.seconds:.0%} less "
                f"({describe(half.setup)}), with lower-precision weights; pin it to plan that"
            )
    if s.ema == "cpu" and pace.spec is not None:
        per_update = ema_update_seconds(profiles, s, pace.spec, cal.cpu_adam_params_per_s)
        every = (
            "each optimizer step"
            if s.ema_every == 1
            else f"every {s.ema_every} optimizer steps (ema.update_every)"
        )
        r.append(
            f"EMA in host RAM: ~{per_update:.2f} s after {every} (each trained weight copied to the host and "
            f"averaged in on the CPU, at {cal.cpu_adam_params_per_s / 1e9:.2f} G parameters/s of CPU Adam scaled "
            "by its memory traffic; modelled, not measured); ema.device=gpu saves it where VRAM allows"
        )
    ds_pin = req.pin("deepspeed")
    offload_pinned = bool(ds_pin) and "offload_optimizer" in ds_pin  # else only the stage was given
    if s.offload:
        added = offload_seconds(profiles, s, pace.spec, cal.cpu_adam_params_per_s) if pace.spec else None
        r.append(
            f"DeepSpeed {zero_label(s.deepspeed)} with optimizer offload to CPU: "
            + (
                "pinned"
                if offload_pinned
                else "the stage pinned, the offload chosen by the plan"
                if ds_pin
                else "nothing without offload fits"
            )
            + (
                f"; it adds ~{added:.2f} s a micro-step (the gradients copied to the host and, once per optimizer "
                f"step, the weights copied back and CPU Adam over {m.trainable_params / 1e9:.2f} B parameters at "
                f"{cal.cpu_adam_params_per_s / 1e9:.2f} G/s: {cal.cpu_adam_source})"
                if added
                else "; the optimizer runs on the CPU"
            )
            + f"; it needs ~{_gib(m.ram)} of host RAM and `{install_hint('deepspeed')}`"
        )
    elif s.sharded:
        whole = min(
            (
                c
                for c in fitting
                if c.setup.deepspeed is None and c.setup.full_half_weights == s.full_half_weights
            ),
            key=_key,
            default=None,
        )
        split = "the fp32 master weights, optimizer state and gradients are split between the GPUs"
        r.append(
            f"DeepSpeed {zero_label(s.deepspeed)} over {s.num_gpus} GPU{'s' if s.num_gpus > 1 else ''}: "
            + (
                "pinned"
                if offload_pinned
                else "the stage pinned, no offload chosen by the plan"
                if ds_pin
                else f"{split}, which one GPU (or plain data parallelism, a whole copy on each) cannot hold with "
                "fp32 master weights"
                if whole is None
                else f"{split}: the fastest plan, though a whole copy on each GPU also fits ({describe(whole.setup)}"
                + (f", {format_duration(whole.seconds)}" if whole.seconds is not None else "")
                + ")"
            )
            + f"; each GPU holds the {_gib(m.weights)} of half weights and {_gib(m.optimizer)} of master weights "
            f"and state; it needs `{install_hint('deepspeed')}`"
        )
    elif req.method in FULL_METHODS and not pinned("deepspeed"):
        r.append(
            "no DeepSpeed offload: a configuration without it fits (offload runs the optimizer on the CPU)"
        )
    if not best.safe:
        # _most_likely_to_fit: the plans within OVERRUN_TIE of the lowest upper end, ordered as plans that fit are
        lowest = min(fitting, key=_required)
        rank = "the requested LoRA rank, then " if req.method == "lora" else ""
        r.append(
            f"batch size {s.batch}, gradient accumulation {s.grad_accum}: the configuration most likely to fit "
            + (
                "(the lowest upper end of the likely peak)"
                if _required(best) <= _required(lowest)
                else f"(its likely peak's upper end, {_gib(best.peak_range[1])}, is within {OVERRUN_TIE:.0%} of the "
                f"lowest, {_gib(lowest.peak_range[1])} with {_differ_text(lowest.setup, s)}: a difference well "
                f"inside the range's spread, so the usual order decides among those: {rank}the fastest, the "
                "optimizer nearest AdamW favoured)"
            )
        )
    elif best.seconds is None:
        r.append(
            f"batch size {s.batch}, gradient accumulation {s.grad_accum}: the largest batch that fits within the "
            "likely peak's upper end"
            + (" without gradient checkpointing" if not s.gradient_checkpointing else "")
            + " (no speed is known for this GPU to compare configurations by)"
        )
    else:
        r.append(
            f"batch size {s.batch}, gradient accumulation {s.grad_accum}: the fastest whole run that fits"
            + _preferred_tier_text(best, fitting)
            + _batch_cap_text(req, s)
            + _handicap_text(best, fitting)
        )
    if sized.batch < s.batch:
        within = (
            f"its largest aspect bucket's {sized.batch} samples"
            if len(req.bucket_samples) > 1
            else f"the epoch's {count_text(sized.batch, 'sample' if req.per_epoch > req.images else 'image')}"
        )
        r.append(
            f"batch {s.batch} holds at most {within}: the trainer forms no larger batch, so the memory and time "
            f"here are those of batch {sized.batch} (the config keeps batch {s.batch}; the same run)"
        )
    unc = profiles.uncertainty
    peak_band, peak_n = unc.peak_for(s.model)
    if best.peak_basis in ("scaled", "measured"):
        point = next(p for p in profiles.points if p.id == best.peak_measured)
        lo, hi = (x / m.peak for x in best.peak_range)
        measured_on = next(
            (g.name for g in _distinct(used) if point in profiles.points_on(g.spec.name)), gpu.name
        )
    if best.peak_basis in ("scaled", "measured") and s.num_gpus > 1:
        each, alone = (
            memory(profiles, sized),
            memory(profiles, _count_free(sized, 1)),
        )  # the model's, as card_peak
        split = each.step_peak - each.overhead < alone.step_peak - alone.overhead  # ZeRO: each holds less
        r.append(
            f"peak {format_range(m.peak, best.peak_range)} per GPU of {card} "
            f"({fit_share_text(m.peak, vram)}): "
            + (
                f"the peak sdplan bench measured in one process on {measured_on} at these settings ({point.id})"
                if best.peak_basis == "measured"
                else f"the model's one-process prediction scaled by how the peak sdplan bench measured on "
                f"{measured_on} at these settings and batch {point.batch} ({point.id}) compares with it"
            )
            + (
                f", times the model's ratio of one of {s.num_gpus} processes to one alone (ZeRO splits the "
                "optimizer state)"
                if split
                else f", with what each of {s.num_gpus} processes holds besides (DDP's gradient buckets) as modelled"
            )
            + f", plus the CUDA context and allocator allowances; the range is x{lo:.3g}-{hi:.3g}"
            + (
                " (sdplan bench peaks each scaled so from another batch)"
                if split or best.peak_basis == "scaled"
                else ": a measurement's own spread on the measured part, the validation set's on the modelled one"
            )
        )
    elif best.peak_basis == "scaled":
        r.append(
            f"peak {format_range(m.peak, best.peak_range)} per GPU of {card} "
            f"({fit_share_text(m.peak, vram)}): the model's prediction scaled by how "
            f"the peak sdplan bench measured on {measured_on} at these settings and batch {point.batch} ({point.id}) "
            f"compares with it, plus the CUDA context and allocator allowances; the range is x{lo:.3g}-{hi:.3g}"
            + (
                f" (sdplan bench peaks each scaled so from another batch, n={unc.n_peak_scaled})"
                if unc.peak_scaled is not None
                else " (the validation set's: no bench peaks to judge scaling by)"
            )
        )
    elif best.peak_basis == "measured":
        r.append(
            f"peak {format_range(m.peak, best.peak_range)} per GPU of {card} "
            f"({fit_share_text(m.peak, vram)}): measured by sdplan bench on "
            f"{measured_on} at these settings ({best.peak_measured}) plus the CUDA context and allocator "
            f"allowances; the range is a measurement's own spread (x{MEASURED_BAND[0]:g}-"
            f"{MEASURED_BAND[1]:g}), not the model's"
        )
    else:
        r.append(
            f"predicted peak {format_range(m.peak, best.peak_range)} per GPU of {card} "
            f"({fit_share_text(m.peak, vram)}): "
            + breakdown_text(m, s)
            + f"; the range is measured / predicted x{peak_band[0]:g}-{peak_band[1]:g} on the "
            f"validation set's {_band_scope(profiles, s.model)} (n={peak_n})"
            + (
                f" on the step's {_gib(m.step_peak)}, and on the caption pass's (the encoders' bytes and an "
                "uncalibrated transient), the larger at each end"
                if m.text_cache_peak > m.step_peak
                else ""
            )
        )
    if loading_ram_short(m, hw.ram_usable_bytes):
        r.append(
            f"warning: host RAM: loading the models for this plan takes ~{_gib(m.ram)} and this machine has "
            f"{_gib(hw.ram_usable_bytes)}: loading may swap heavily or be killed by the OS; add RAM or swap space"
        )
    if not final_grid_fits(m, vram):
        back = "the VAE" if flow_family(s.model) else "the VAE and text encoders"
        grid = measured_grid_point(profiles, _count_free(s, 1) if s.num_gpus > 1 else s, gpu.spec)
        r.append(
            f"the final sample grid needs {_gib(m.sampling_peak)}"
            + (f" (measured by sdplan bench on {gpu.name}: {grid.id})" if grid is not None else "")
            + f" ({back} back on the GPU beside the training "
            f"state), more than {int(HEADROOM * 100)}% of {_gib(vram)}: `sdplan train` writes the trained weights "
            "first and skips the grid if it runs out of memory; grids during the run (sampling.every_steps, "
            "intermediate outputs) are skipped the same way and training goes on"
        )
    if not best.safe:
        # on a GPU planned in fp32 for fp16's NaN losses (GTX 16): whether fp16, pinned, fits within the upper end
        in_fp16 = _fp16_would_fit(req, profiles, hw, cal, req.resolution, safe=True)
        r.append(
            f"warning: the likely peak's upper end ({_gib(best.peak_range[1])}) is over the card's {_gib(vram)}: "
            f"this plan may run out of memory; no {'fp32 ' if in_fp16 else ''}configuration fits within the upper "
            "end (`sdplan train` retries smaller on out-of-memory)"
        )
        r += in_fp16
    else:
        risky = [
            c
            for c in fitting
            if not c.safe
            and c.setup.num_gpus == s.num_gpus
            and c.lowered_rank <= best.lowered_rank  # a lower rank than asked is no alternative to mention
            and _key(c) < _key(best)
        ]
        if risky:
            c = min(risky, key=_key)
            r.append(
                f"avoided {_which(c, best)} configuration ({_unlike(c.setup, best.setup)}): predicted "
                f"{format_range(c.memory.peak, c.peak_range)}, its upper end over the card's {_gib(vram)}"
            )
    st = best.steps

    def seen_text(x: Steps, noun: str = "") -> str:
        # where a max_steps run stops inside an epoch with short batches, full batches are the most it sees
        return x.images_seen_text(noun)

    seen = seen_text(st)
    if s.num_gpus > 1 and req.max_steps:
        alone = _steps(req, s.batch, s.grad_accum, 1)
        on_one = (
            f"{count_text(req.max_steps, 'step')} of batch {s.batch} x accumulation {s.grad_accum} on one GPU"
        )
        r.append(
            f"steps: training.max_steps {req.max_steps}, pinned, counts one process's steps: {st.total_steps} on "
            f"each of the {s.num_gpus} GPUs, {seen_text(st, 'image')} seen"
            + (
                f", as {on_one}"
                if alone.images_seen == st.images_seen
                else f"; {on_one} would see {seen_text(alone)} (an epoch's "
                f"{count_text(st.images_per_epoch, 'image')} {'is' if st.images_per_epoch == 1 else 'are'} "
                f"{count_text(st.steps_per_epoch, 'step')} on each of "
                f"the {s.num_gpus} GPUs, {alone.steps_per_epoch} on one)"
            )
            + "; with the steps set, each GPU count sees its own images: two counts are weighed by their times "
            "for the images the one with more GPUs sees (the other's steps scaled to them, its start-up as it is)"
        )
    elif s.num_gpus > 1:
        if st.bucket_samples:  # each bucket's last batch is short: the batches, not the images, divide
            epoch = (
                f"{count_text(st.images_per_epoch, 'image')} per epoch in {len(st.bucket_samples)} aspect "
                f"buckets = {bucketed_batches(st.bucket_samples, s.batch)} batches of up to {s.batch} (each "
                f"bucket's last one short) / (accumulation {s.grad_accum} x {s.num_gpus} GPUs)"
            )
        else:
            epoch = (
                f"{count_text(st.images_per_epoch, 'image')} per epoch / (batch {s.batch} x accumulation "
                f"{s.grad_accum} x {s.num_gpus} GPUs)"
            )
        r.append(
            f"{s.num_gpus} GPUs: steps normalised so the run trains what was asked: "
            f"{epoch} = {count_text(st.steps_per_epoch, 'step')} per epoch, "
            f"{st.total_steps} in all (one GPU: {st.one_gpu_total_steps}); images seen {st.images_seen} either way"
            + (
                " (the batches dealt again below aside)"
                if repeated_batches(st.images_per_epoch, s.batch, s.num_gpus, req.bucket_samples)
                and st.total_steps >= st.steps_per_epoch
                else ""
            )
            + "; warmup and LR schedule count these steps"
        )
    elif req.max_steps:
        full, part = divmod(st.images_seen, st.images_per_epoch)
        if not part:
            epochs = f"{count_text(full, 'epoch')} of {st.images_per_epoch}"
        elif not full:
            epochs = f"{part} of an epoch's {st.images_per_epoch}"
        else:
            epochs = f"{count_text(full, 'epoch')} of {st.images_per_epoch} and {part} of the next"
        r.append(
            f"steps: training.max_steps {req.max_steps}, pinned: {count_text(st.total_steps, 'step')} of batch "
            f"{s.batch} x accumulation {s.grad_accum}; images seen {seen} ({epochs}); with the steps set, the plan "
            "is the one that trains fastest per image seen"
            + (
                " (another GPU count is weighed by the time for the images the one with more GPUs sees)"
                if hw.count > 1
                else ""
            )
        )
    else:
        n = len(req.bucket_samples)
        buckets = f" in {n} aspect buckets (each ends in a short batch)" if n > 1 else ""
        r.append(
            f"steps: {count_text(st.images_per_epoch, 'image')} per epoch{buckets} / (batch {s.batch} x "
            f"accumulation {s.grad_accum}) = {st.steps_per_epoch} per epoch x {count_text(st.epochs, 'epoch')} = "
            f"{st.total_steps}; images seen {st.images_seen}"
        )
    reaches_last_round = s.num_gpus > 1 and st.total_steps >= st.steps_per_epoch  # max_steps may stop before
    if reaches_last_round and (
        repeats := repeated_batches(st.images_per_epoch, s.batch, s.num_gpus, req.bucket_samples)
    ):
        r.append(
            f"{s.num_gpus} GPUs: an epoch's {count_text(st.images_per_epoch, 'image')} "
            f"{'does' if st.images_per_epoch == 1 else 'do'} not make a batch for every GPU in its "
            f"last round: "
            + repeated_batches_text(repeats, sized.batch, None if req.max_steps else st.epochs)
        )
    if hw.count > 1:
        r += _multi_gpu_reasons(hw, best, one, best_by_n, profiles, cal, pinned("num_gpus"), req)
    if best.seconds is None:
        r.append(f"time: unknown: no catalog throughput or measured speed for {pace.name}")
    else:
        far = scaled_from_afar(profiles, sized, pace.spec, best.basis)
        (low, high), band = seconds_band(profiles, best.basis, s.model, s.num_gpus, far=far)
        likely = f"likely x{low:g}-{high:g} of that ({band})"
        model_band = unc.seconds_for(s.model)[0]
        if (low, high) != model_band:
            likely += f"; start-up and latent caching keep the model's x{model_band[0]:g}-{model_band[1]:g}"
        if differ:
            likely += f"; {pace.name} is the slowest of the {len(used)} GPUs: every step waits for it"
        if best.basis == "calibrated":
            exchange = best.allreduce_seconds / best.steps.micro_batches if best.steps.micro_batches else 0.0
            r.append(f"time: {time_basis_text(profiles, sized, pace, cal, exchange)}; {likely}")
        elif best.basis == "scaled":
            near = _near_point(profiles, sized, pace.spec)  # the point planned_step_seconds scaled by
            r.append(
                f"time: the model's prediction scaled by how a measured speed on {pace.name} compares with it "
                f"({near.id}: {near.method} at batch {near.batch}, {near.resolution}px"
                f"{', checkpointing' if near.options.gradient_checkpointing else ''}); {likely}"
            )
        elif best.basis != "weakly_calibrated":  # the transformer families: _flow_reasons says how
            one_gpu = " on one GPU, the gradient exchange as modelled" if s.num_gpus > 1 else ""
            r.append(
                f"time: from a {best.basis} speed for {pace.name} with these settings{one_gpu}; {likely}"
            )
        r.append(run_time_parts_text(best))
    if req.prior_preservation and req.class_images:
        r.append(f"prior preservation: {req.class_images} class images are trained alongside (batch doubled)")
    images = sampled_images(req, best.steps)
    if (
        best.sampling_seconds
        and best.seconds
        and (images.classes or images.during or best.sampling_seconds >= SAMPLING_SHOWN * best.seconds)
    ):
        r.append(_sampling_text(req, best, profiles))
    return r


def run_time_parts_text(c: Candidate) -> str:
    """What ``c``'s run time is made of: its steps (the all-reduce in them), the start-up allowance, the latent
    cache's pass and the sampling. The start-up's fixed minute was in every time and said nowhere: most of the
    time of a short run."""
    sampling = c.sampling_seconds or 0.0
    caching = c.fixed_seconds - STARTUP_S - sampling
    exchange = (
        f", the gradient all-reduce {format_duration(c.allreduce_seconds)} of it"
        if c.allreduce_seconds >= 0.5
        else ""
    )
    parts = [
        f"{c.steps.micro_batches} micro-batch{'' if c.steps.micro_batches == 1 else 'es'} of "
        f"{c.step_seconds:.2f} s "
        f"({format_duration(c.seconds - c.fixed_seconds)}{exchange})",
        f"a start-up allowance of {format_duration(STARTUP_S)} (loading the models, building the optimizer: not "
        "measured)",
    ]
    if caching >= 0.5:
        parts.append(f"caching the latents {format_duration(caching)}")
    if sampling >= 0.5:
        parts.append(f"sampling {format_duration(sampling)}")
    return f"run time {format_duration(c.seconds)}: " + ", ".join(parts)


def _sampling_text(req: Request, best: Candidate, profiles: Profiles) -> str:
    """What the run samples besides training and how long that takes, with its range and basis."""
    images = sampled_images(req, best.steps)
    what = []
    if images.classes:
        what.append(f"{count_text(images.classes, 'class image')} the class folder lacks (before training)")
    per_grid = count_text(images.final, "image")
    n = req.sample_every_steps

    def saves(every_epochs: int, every_steps: int) -> dict[int, int | None]:  # none past the run's end
        st = best.steps
        return intermediate_steps(
            total_steps=st.total_steps,
            steps_per_epoch=st.steps_per_epoch,
            every_epochs=every_epochs,
            every_steps=every_steps,
        )

    if images.every:
        grids = images.every // images.final
        shared = sum(1 for s in saves(req.save_every_epochs, req.save_every_steps) if s % n == 0)
        copied = (
            f"; {count_text(shared, 'save')} at those steps {'copies it' if shared == 1 else 'copy them'}"
        )
        what.append(
            f"{count_text(images.every, 'grid image')} ({count_text(grids, 'grid')} of {per_grid}, one every "
            f"{n} steps{copied if shared else ''})"
        )
    if images.at_saves:
        keys = [  # the settings whose saves sample a grid of their own
            f"output.save_every_n_{k}={v}"
            for k, v, kw in (
                ("epochs", req.save_every_epochs, {"every_epochs": req.save_every_epochs, "every_steps": 0}),
                ("steps", req.save_every_steps, {"every_epochs": 0, "every_steps": req.save_every_steps}),
            )
            if v and any(not n or s % n for s in saves(**kw))
        ]
        grids = images.at_saves // images.final
        what.append(
            f"{count_text(images.at_saves, 'grid image')} ({count_text(grids, 'grid')} of {per_grid}, at the "
            f"saves of {' and '.join(keys)})"
        )
    what.append(f"the final sample grid ({count_text(images.final, 'image')})")
    band, basis = sampling_band(profiles, best.setup.model)
    seconds = best.sampling_seconds or 0.0
    likely = format_range(seconds, (seconds * band[0], seconds * band[1]), unit="s")
    others = "; on the first process, while the others wait" if best.setup.num_gpus > 1 else ""
    return (
        f"sampling: {', '.join(what)}, {req.sampling_steps} denoising steps an image: {likely} of the run's "
        f"time (x{band[0]:g}-{band[1]:g}: {basis}){others}"
    )


PREFERENCE_COST_SHOWN = 0.02  # a faster plan passed over for fp32 master weights is named from 2% faster


def _faster_full_half(best: Candidate, fitting: list[Candidate]) -> Candidate | None:
    """The fastest plan with full bf16 weights (no fp32 master copy) that the search passed over for ``best``'s
    fp32 master weights (:func:`_tier`) and that is otherwise as preferred (within the upper end, as many GPUs,
    the same rank and offload), where it is at least PREFERENCE_COST_SHOWN faster; else None."""
    if best.setup.full_half_weights or best.seconds is None:
        return None
    half = [
        c
        for c in fitting
        if c.setup.full_half_weights
        and c.safe
        and c.seconds is not None
        and c.seconds < best.seconds * (1 - PREFERENCE_COST_SHOWN)
        and c.setup.num_gpus == best.setup.num_gpus
        and _tier(c)[:3] == _tier(best)[:3]
    ]
    return min(half, key=_key, default=None)


_OPT_NAMES = {"adamw": "AdamW", "adamw8bit": "8-bit AdamW", "adafactor": "Adafactor"}


def _batch_words(s: Settings) -> str:
    """A configuration's batch and checkpointing, the settings an optimizer's memory trades against."""
    accum = f" x {s.grad_accum} accumulated" if s.grad_accum > 1 else ""
    gc = "with" if s.gradient_checkpointing else "without"
    return f"batch {s.batch}{accum} {gc} gradient checkpointing"


def _adamw_text(best: Candidate, fitting: list[Candidate]) -> str:
    """Why ``best`` trains with another optimizer than AdamW, by the AdamW plans on its GPU count: the best of
    its tier (:func:`_tier`), what it takes and how much slower it is (:func:`_key` takes another optimizer only
    where it is faster by more than its handicap); else the best AdamW plan of a less preferred tier and what it
    gives up; else that none fits."""
    s = best.setup
    name = _OPT_NAMES[s.optimizer]
    adamw = [c for c in fitting if c.setup.optimizer == "adamw" and c.setup.num_gpus == s.num_gpus]
    same = [c for c in adamw if _tier(c) == _tier(best)]
    if same and not best.safe:  # nothing within its upper end: the plans most likely to fit are weighed
        likely = {id(c) for c in _most_likely_to_fit(fitting)}
        if not any(id(c) in likely for c in same):
            low = min(same, key=_required)
            least = min(_required(c) for c in fitting)
            return (
                f"no AdamW plan is as likely to fit: the leanest ({_batch_words(low.setup)}) needs "
                f"{_gib(_required(low))} of GPU memory, {name}'s plan {_gib(_required(best))} ({FIT_RULE_TEXT}); "
                "where no configuration fits the card by that rule, the plan is taken from those within "
                f"{OVERRUN_TIE:.0%} of the least need ({_gib(least)}), and pinning memory.optimizer=adamw plans AdamW"
            )
        same = [c for c in same if id(c) in likely]
    if not same:
        if not adamw:
            return "AdamW does not fit"
        other = min(adamw, key=_preference)
        took = f": {format_duration(other.seconds)}" if other.seconds is not None else ""
        return (
            f"AdamW fits only in a less preferred plan, with {_tier_text(other, best)} "
            f"({_batch_words(other.setup)}{took})"
        )
    aw = min(same, key=_key)
    limit = 0.02 * _OPT_RANK[s.optimizer]
    handicap = f"more than {limit * 100:g}% faster"
    if aw.seconds is None or best.seconds is None:
        return (
            f"AdamW fits too ({_batch_words(aw.setup)}), but {name} fits a larger batch "
            f"({_batch_words(s)}), and with the step's speed unknown the larger batch is taken"
        )
    gain = _key_seconds(aw) / _key_seconds(best) - 1  # as _adamw_gain_text says it
    if gain <= 0 or round(gain * 100, percent_digits(gain, limit)) == 0:  # no faster: the handicaps decided
        how = ""
    elif (aw.setup.batch * aw.setup.grad_accum, aw.setup.gradient_checkpointing) == (
        s.batch * s.grad_accum,
        s.gradient_checkpointing,
    ):
        how = ": its smaller state update makes the step faster"
    else:
        how = f": its smaller state lets the plan run {_batch_words(s)}"
    # with training.max_steps the handicap is weighed per image seen (:func:`_key`), and the gain said so
    per = "" if aw.steps.images_seen == best.steps.images_seen else " per image seen"
    # a saver the AdamW plan needs and this one does not: its handicap counts beside the optimizer's (_key)
    cached = aw.setup.cache_text_encoder_outputs and not s.cache_text_encoder_outputs
    also = (
        f"; AdamW's plan also needs cached text-encoder outputs, weighed {TE_CACHE_HANDICAP:.0%} slower "
        "(their encoding pass is not timed)"
        if cached
        else ""
    )
    return (
        f"AdamW fits too ({_batch_words(aw.setup)}{', with cached text-encoder outputs' if cached else ''}: "
        f"{run_time_text(aw, best)}), but {name} "
        f"{_adamw_gain_text(best, aw, limit)} ({format_duration(best.seconds)}{how}); another optimizer than "
        f"AdamW is taken only where it is {handicap}{per}{also}, and pinning memory.optimizer=adamw plans AdamW"
    )


def percent_digits(share: float, limit: float) -> int:
    """The decimals (up to 3) that say ``share`` as a percentage on the side of ``limit`` it lies on: a share a
    rule took as over its limit must not read as equal to it, nor one it rejected (4.04% beside "more than 4%",
    not "4%"; 4.6% beside "must save 5%", not "5%")."""
    digits = 0
    while digits < 3:
        said, bar = round(share * 100, digits), round(limit * 100, digits)
        if share == limit or (said > bar if share > limit else said < bar):
            break
        digits += 1
    return digits


def _adamw_gain_text(best: Candidate, aw: Candidate, limit: float) -> str:
    """How much faster ``best`` trains its images than the AdamW plan ``aw`` would (:func:`speedup`, as the
    multi-GPU lines say it). Where both see the same images (epochs) it is their run times' ratio (:func:`_key`
    weighs them less the class images and final grid), said with the digits that tell it from the handicap
    ``limit`` (4.04%, not "4% faster" beside "more than 4% faster"); with training.max_steps AdamW's other global
    batch sees other images in as many steps (its time, :func:`run_time_text`, is of another run), and AdamW's
    steps are scaled to the plan's images."""
    same = aw.steps.images_seen == best.steps.images_seen
    gain = _key_seconds(aw) / _key_seconds(best) - 1  # the figure the rule compared (_key)
    digits = percent_digits(gain, limit)
    # said where they weigh: DreamBooth's class images (the final grid alone is seconds)
    once = (
        " (less the class images and final grid)" if best.sampling_once_seconds >= 0.05 * best.seconds else ""
    )
    if round(gain * 100, digits) == 0:
        return f"is about as fast{'' if same else ' per image seen'}{once}"
    if same and gain > 0:
        return f"makes the run {gain * 100:.{digits}f}% faster{once}"
    return (
        f"is {abs(gain) * 100:.{digits}f}% {'faster' if gain > 0 else 'slower'}"
        f"{'' if same else ' per image seen'}{once}"
    )


def _preferred_tier_text(best: Candidate, fitting: list[Candidate]) -> str:
    """What "the fastest whole run that fits" is among, where a faster plan within the upper end was passed
    over for a preference (:func:`_tier`): "" where none was."""
    faster = [
        c
        for c in fitting
        if c.safe
        and c.setup.num_gpus == best.setup.num_gpus
        and _tier(c) != _tier(best)
        and c.seconds is not None
        and c.seconds < best.seconds
    ]
    if not faster:
        return ""
    said = []
    if any(c.lowered_rank and not best.lowered_rank for c in faster):
        said.append("at the requested LoRA rank")
    if any(c.setup.offload and not best.setup.offload for c in faster):
        said.append("without DeepSpeed offload")
    if any(c.setup.full_half_weights and not best.setup.full_half_weights for c in faster):
        said.append("with fp32 master weights")
    return " " + " and ".join(said) if said else ""


HANDICAP_SAID = 0.015  # a plan passed over for the handicaps is named where its run is this much shorter


def _handicap_text(best: Candidate, fitting: list[Candidate]) -> str:
    """Where a faster plan of the same preference (:func:`_tier`) was passed over for :func:`_key`'s small
    handicaps (a quantized base, an optimizer further from AdamW, cached text-encoder outputs: each changes the
    result a little or adds a pass), which and by how much, by :func:`_key`'s own measure (per image seen):
    "the fastest whole run" did not say it counted them (FLUX.1 on 16 GB: fp8 with 35 blocks swapped, 1910 s,
    over nf4 without swapping, 1874 s); "" where none was."""
    if best.seconds is None:
        return ""
    faster = [
        c
        for c in fitting
        if c.setup.num_gpus == best.setup.num_gpus
        and _tier(c) == _tier(best)
        and c.seconds is not None
        and _key_seconds(c) < (1 - HANDICAP_SAID) * _key_seconds(best)
    ]
    if not faster:
        return ""
    c = min(faster, key=_key_seconds)
    cs, bs = c.setup, best.setup
    handicapped = (
        BASE_QUANT_HANDICAP[cs.base_precision] > BASE_QUANT_HANDICAP[bs.base_precision]
        or _OPT_RANK[cs.optimizer] > _OPT_RANK[bs.optimizer]
        or (cs.cache_text_encoder_outputs and not bs.cache_text_encoder_outputs)
    )
    if not handicapped:
        return ""
    untimed = (
        " (its caption pass, not timed, not counted)"
        if cs.cache_text_encoder_outputs and not bs.cache_text_encoder_outputs
        else ""
    )
    return (
        f", counting a small handicap for what changes the result or adds a pass (a quantized base 2-5%, 8-bit "
        f"AdamW or Adafactor 2-4%, cached text-encoder outputs {TE_CACHE_HANDICAP:.0%}): with "
        f"{_differ_text(cs, bs)}{untimed} each image takes {100 * (1 - _key_seconds(c) / _key_seconds(best)):.0f}% "
        "less time"
    )


def _latent_cache_text(req: Request, best: Candidate, fitting: list[Candidate]) -> str:
    """Why the latents are cached or not, by the same plan the other way (:func:`latent_cache_seconds`: one
    VAE pass per distinct image; uncached, the VAE encodes every image every step sees)."""
    s = best.setup
    state = "cached" if s.cache_latents else "not cached"
    if req.pinned("cache_latents"):
        return f"latents {state}: pinned"
    flipped = _with(s, cache_latents=not s.cache_latents)
    twin = next((c for c in fitting if c.setup == flipped), None)
    seen = best.steps.images_seen
    each, them = (f"each of the {req.images} images", "them") if req.images != 1 else ("the 1 image", "it")
    once = f"the VAE encodes {each} once" + (
        f" (repeats and epochs reuse the cached latents) instead of all {seen} images the steps see"
        if seen != req.images
        else ""  # each seen once: as many as the steps see
    )
    if s.cache_latents:
        if twin is None:
            how = "without caching this plan does not fit"
        elif twin.seconds is None or best.seconds is None:
            how = "faster"
        elif twin.seconds - best.seconds >= 0.5:
            saved = twin.seconds - best.seconds
            how = f"{format_duration(saved)} faster ({saved / twin.seconds:.0%})"
        elif seen == req.images:
            return (
                f"latents cached: {each} is seen once, so no faster than encoding {them} every step, but the VAE "
                "leaves the GPU (less VRAM; random flips and crops are cached per epoch)"
            )
        else:
            return (
                f"latents cached: {once}: {'saves' if twin.seconds >= best.seconds else 'costs'} under 0.5 s, "
                "but the VAE leaves the GPU (less VRAM; random flips and crops are cached per epoch)"
            )
        return f"latents cached: {once}: {how} (less VRAM; random flips and crops are cached per epoch)"
    if twin is None:
        return "latents not cached: the plan with cached latents does not fit"
    if twin.seconds is None or best.seconds is None:
        return "latents not cached"
    diff = twin.seconds - best.seconds
    if abs(diff) < 0.5:
        if seen == req.images:
            return f"latents not cached: {each} is seen once, so caching would save no time"
        return f"latents not cached: caching would {'cost' if diff >= 0 else 'save'} under 0.5 s ({once})"
    if diff > 0:
        return f"latents not cached: caching would take {format_duration(diff)} longer ({once})"
    return f"latents not cached: caching would be {format_duration(-diff)} faster, but it has {_tier_text(twin, best)}"


def _one_off_sampling_words(req: Request, c: Candidate) -> str:
    """What of ``c``'s sampling no GPU count shortens, in words: "the class images and final grid", or "the
    final grid" where it has no class images to generate."""
    return "the class images and final grid" if sampled_images(req, c.steps).classes else "the final grid"


def _multi_gpu_reasons(
    hw, best, one, best_by_n, profiles, cal, pinned_count: bool, req: Request
) -> list[str]:
    s = best.setup
    mixed = mixed_gpus(hw)
    r = []
    obs = {m.id: m for m in profiles.multi_gpu}
    for n, c in sorted(best_by_n.items()):
        if n == s.num_gpus or c.seconds is None or best.seconds is None:
            continue
        used = plan_gpus(hw, c.setup)
        if n == 1:
            on = f" ({used[0].name})" if mixed else ""
            r.append(
                f"1 GPU{on} would take {run_time_text(c, best)}"
                + (
                    (f", only with {_tier_text(c, best)}" if _tier(c) > _tier(best) else "")
                    + f" (compared with, not planned: {pin_text('num_gpus', s.num_gpus)} is pinned)"
                    if pinned_count
                    else _one_gpu_trade_text(best, c, profiles)
                )
            )
            continue
        m = obs.get(c.observed_multi_gpu) if c.observed_multi_gpu else None
        ref_c = _gain_reference(one, best)
        faster = speedup(c, ref_c)
        # the run it was weighed against (_choose): the fewer GPUs chosen, the plan itself above its count
        than = f"{s.num_gpus} GPUs" if n > s.num_gpus and s.num_gpus > 1 else "one GPU"
        ahead = speedup(c, best) if n > s.num_gpus else faster
        if faster <= 1:
            # slower than the run it is weighed against (one GPU, or the plan's count's share): said so, and,
            # where it would also beat the plan, why the plan is not it
            why = f"{slower_words(c, ref_c)} than {'the 1-GPU run' if ref_c is one else 'the plan'}"
            if speedup(c, best) > 1 and _tier(c) > _tier(best):
                why += f", and only with {_tier_text(c, best)}"
        elif _tier(c) > _tier(best):
            why = f"{faster:.2f}x faster, but only with " + _tier_text(c, best)
        elif n < s.num_gpus:  # the plan weighed against it on the plan's images (_choose), not its own
            # ratio to one GPU, which under training.max_steps is on its own images: "1.89x faster than one GPU,
            # but 8 GPUs are faster still" stood beside the plan's 1.67x
            still = speedup(best, c)
            why = (
                f"{faster:.2f}x faster than one GPU, but {s.num_gpus} GPUs are faster still"
                if c.steps.images_seen == best.steps.images_seen
                else f"{s.num_gpus} GPUs train the plan's images {still:.2f}x as fast"
            )
        elif ahead <= 1:
            why = f"{faster:.2f}x faster than one GPU, but no faster than {s.num_gpus} GPUs"
        else:
            low, high = profiles.uncertainty.seconds_for(c.setup.model)[0]
            gain = multi_gpu_gain(c, best, profiles)
            rate = "as measured" if m is not None else f"at x{high:g}"
            # a negative share saved read "it saves -6% of the run" beside "1.46x faster": said as a slow-down
            # the one-off sampling no GPU count changes is left out of the gain (multi_gpu_gain): named where
            # it is a share of the run worth saying
            run = "the run"
            if c.seconds and c.sampling_once_seconds >= SAMPLING_SHOWN * c.seconds:
                run = f"the run less {_one_off_sampling_words(req, c)}"
            saved = max(gain, 0.0)
            saves = (
                f"{run} could be {-gain * 100:.0f}% slower"
                if gain * 100 <= -0.5
                else f"it saves {saved * 100:.{percent_digits(saved, MIN_MULTI_GPU_GAIN)}f}% of {run}"
            )
            why = (
                f"predicted {ratio_than_text(ahead, than)}: within the time uncertainty (with the steps at "
                f"x{low:g} of the prediction and the all-reduce {rate}, {saves}, where more GPUs must save "
                f"{MIN_MULTI_GPU_GAIN * 100:.0f}%)"
            )
        if len(_distinct(used)) > 1:
            slow = pace_gpu(profiles, c.setup, used, cal, set_link(hw, used)[1])[0]
            why += (
                f"; on GPUs {', '.join(str(g.index) for g in used)} at the pace of {slow.name}, the slowest"
            )
        why += f"; {_comm_text(profiles, c.setup, set_link(hw, used)[0])}{_measured_rate_text(m)}"
        r.append(f"{n} GPUs would take {run_time_text(c, best)} ({why})")
    if s.num_gpus > 1 and one is not None and one.seconds and best.seconds and best.step_seconds:
        used = plan_gpus(hw, s)
        slow = pace_gpu(profiles, s, used, cal, set_link(hw, used)[1])[0]
        # the one-GPU step on the same basis as the plan's (a measured or scaled speed, not the bare model)
        alone = _with(_sized(req, s), num_gpus=1)  # at the micro-batch the plan's step was sized at
        t1, _ = planned_step_seconds(profiles, alone, slow.spec, cal)
        ratio = best.step_seconds / t1 if t1 else float("nan")
        m = obs.get(best.observed_multi_gpu) if best.observed_multi_gpu else None
        src = _comm_text(profiles, s, set_link(hw, used)[0]) + _measured_rate_text(m)
        gpu = slow.name if len(_distinct(used)) > 1 else "GPU"
        if (
            card_peak(profiles, alone, slow.spec)[0].peak <= HEADROOM * slow.memory_bytes
        ):  # bench evidence first
            step = f"each step takes {ratio:.2f}x as long as on one {gpu} with the same settings ({src})"
        else:  # ZeRO-2 splitting what one GPU cannot hold: no one-GPU step of these settings to compare with
            step = f"each step exchanges {src}; these settings do not fit on one {gpu}, so no step of theirs is compared"
        # the run it is weighed against: the one-GPU plan, whose settings may differ (another optimizer)
        than = (
            " than on one GPU"
            if mixed
            else ""
            if _with(one.setup, gpu_ids=s.gpu_ids, num_gpus=s.num_gpus) == s
            else " than the one-GPU plan"
        )
        # the class images and final grid are sampled on the first process alone, whatever the count: where they
        # are a share of the run worth saying, the speed-up without them beside the whole run's (the one the
        # plan is chosen on: _key, multi_gpu_gain)
        once = best.sampling_once_seconds
        rest = ""
        if once >= SAMPLING_SHOWN * best.seconds and one.seconds > one.sampling_once_seconds:
            what = _one_off_sampling_words(req, best)
            verb = "are" if what.startswith("the class") else "is"
            rest = (
                f" ({speed_ratio_text(speedup(best, one, with_once=False))} without {what}, which "
                f"{verb} sampled on the first process alone)"
            )
        same = one.steps.images_seen == best.steps.images_seen
        speed = speed_ratio_text(speedup(best, one))
        if speed.startswith("about as fast"):  # "about as fast (1.00x) as the one-GPU plan"
            than = than.replace(" than ", " as ", 1)
        r.append(
            f"{s.num_gpus} GPUs: {step}; "
            # a pinned step count: the runs see other images (steps x global batch); one GPU's scaled to the plan's
            + ("once steps are normalised the run is " if same else "for the images it sees, the run is ")
            + speed
            + than
            + rest
        )
    return r


def speed_ratio_text(ratio: float) -> str:
    """A run's speed against another's (:func:`speedup`) in words: a ratio under 1 is a slow-down, said as one
    ("1.01x slower", never "0.99x faster")."""
    if round(ratio, 2) == 1:
        return "about as fast (1.00x)"
    return f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower"


def ratio_than_text(ratio: float, than: str) -> str:
    """:func:`speed_ratio_text` against ``than``: "1.23x faster than one GPU", "about as fast as 3 GPUs
    (1.00x)" where it rounds to 1 ("1.00x faster than 3 GPUs" said a gain it does not show)."""
    if round(ratio, 2) == 1:
        return f"about as fast as {than} (1.00x)"
    return f"{speed_ratio_text(ratio)} than {than}"


_TIER_KEPT = (
    (lambda c: not c.safe, "its likely peak within the card"),
    (lambda c: c.lowered_rank, "the requested LoRA rank"),
    (lambda c: c.setup.offload, "the optimizer on the GPU (no DeepSpeed offload)"),
    (lambda c: c.setup.full_half_weights, "fp32 master weights"),
)


def _one_gpu_trade_text(best: Candidate, one: Candidate, profiles: Profiles) -> str:
    """Where a multi-GPU plan was taken for its tier (:func:`_choose`: one GPU reaches only a less preferred
    one, such as full bf16 weights where ZeRO-2 over several splits the fp32 master weights), the trade in
    plain words: what the one-GPU run gives up, its time and host RAM against the plan's, whether the plan is
    any faster, and the pin that takes the one-GPU run. "" where the plan has one GPU or one GPU's tier is
    the plan's (then more GPUs were taken for speed alone, said elsewhere)."""
    s = best.setup
    if s.num_gpus == 1 or _tier(one) <= _tier(best) or one.seconds is None or best.seconds is None:
        return ""
    kept = [words for lacks, words in _TIER_KEPT if lacks(one) and not lacks(best)]
    if one.setup.optimizer != s.optimizer:
        kept.append(_OPT_NAMES[s.optimizer])
    ratio = speedup(best, one)  # as the summary's "vs one GPU"
    speed = (
        "not for speed"
        if multi_gpu_gain(best, one, profiles) <= MIN_MULTI_GPU_GAIN
        else "and for their speed"
    )
    said = speed_ratio_text(ratio)
    than = "as" if said.startswith("about as fast") else "than"  # "about as fast (1.00x) as it"
    return (
        f" with {_gib(one.memory.ram)} of host RAM ({describe(one.setup)}), but only with {_tier_text(one, best)}; "
        f"the {s.num_gpus} GPUs are {said} {than} it and hold {_gib(best.memory.ram)} of host "
        f"RAM: they are taken to keep {' and '.join(kept)}, {speed} ({pin_text('num_gpus', 1)} plans the "
        "one-GPU run)"
    )


def _links_text(hw: Hardware, best: Candidate) -> str | None:
    """Alike GPUs joined unevenly (NVLink bridges on some pairs): which GPUs a multi-GPU plan uses and the link
    its all-reduce runs over (:func:`_best_linked` chose them); None where every pair is joined alike."""
    s = best.setup
    if s.num_gpus < 2 or len({kind for *_, kind in hw.pair_links}) < 2:
        return None
    used = plan_gpus(hw, s)
    fast = ", ".join(f"{a}-{b}" for a, b, kind in hw.pair_links if kind in FAST_LINKS)
    kind = next(kind for *_, kind in hw.pair_links if kind in FAST_LINKS)
    link = set_link(hw, used)[0]
    text = (
        f"this machine's GPUs are joined unevenly ({_LINK_NAMES[kind]} between GPUs {fast}, PCIe otherwise): this "
        f"plan uses GPUs {', '.join(str(g.index) for g in used)}, whose all-reduce runs over {_LINK_NAMES[link]}"
    )
    if s.gpu_ids is not None:
        text += f" (distributed.gpu_ids={list(s.gpu_ids)}: `sdplan train` launches on them)"
    return text


_LINK_NAMES = {"nvlink": "NVLink", "xgmi": "xGMI", "pcie": "PCIe"}


def _mixed_text(hw: Hardware, best: Candidate, profiles: Profiles, cal: Calibration) -> str:
    """A machine whose GPUs differ: which they are, what that means for several, and which the plan uses."""
    s = best.setup
    used = plan_gpus(hw, s)
    listed = "; ".join(
        f"GPU {g.index}: {g.name}, {g.memory_bytes / GiB:.1f} GiB" + ("" if g.bf16 else ", no bf16")
        for g in hw.gpus
    )
    if len(used) == 1:
        which = f"this plan uses {gpu_text(used[0])}"
    else:
        which = f"this plan uses GPUs {', '.join(str(g.index) for g in used)}"
        if len(_distinct(used)) > 1:
            slow = pace_gpu(profiles, s, used, cal, set_link(hw, used)[1])[0]
            small = smallest_gpu(used)
            which += f", at the pace of {slow.name}" + (
                f" and within the {small.memory_bytes / GiB:.1f} GiB of {small.name}"
                if len({g.memory_bytes for g in used}) > 1
                else ""
            )
        else:
            which += f" ({len(used)}x {used[0].name})"
    return (
        f"this machine's GPUs differ ({listed}): a run on several of them runs at the pace of the slowest, fits "
        f"what the one with the least memory holds, and uses bf16 only where all have it; {which} "
        f"(distributed.gpu_ids={[g.index for g in used]}: `sdplan train` launches on {'it' if len(used) == 1 else 'them'})"
    )


def _tier_text(c: Candidate, best: Candidate) -> str:
    """What makes ``c`` less preferred than ``best`` (:func:`_tier`), in words."""
    if not c.safe:
        return "its likely peak's upper end over the card's memory"
    if c.lowered_rank and not best.lowered_rank:
        return "a lower LoRA rank"
    if c.setup.offload and not best.setup.offload:
        return "DeepSpeed optimizer offload (the optimizer on the CPU)"
    return "full bf16 weights (no fp32 master copy)"


def _measured_rate_text(m: Any) -> str:
    """Where an exchange's rate comes from when a multi-GPU observation measured it (else "")."""
    if m is None:
        return ""
    rank = m.settings.lora_rank if m.method == "lora" else None
    at = f"batch {m.batch}" + (f", rank {rank}" if rank else "")
    return (
        f", at the rate measured on {m.num_gpus}x {m.gpu} over {m.interconnect} ({m.id}: each step "
        f"{m.outcome['iteration_time_ratio']:g}x as long as on one GPU at {at})"
    )


def _comm_text(profiles: Profiles, s: Settings, link: str) -> str:
    """What the GPUs exchange each step (:func:`comm_seconds`), in words."""
    moved = _size(gradient_bytes(profiles, s))
    if s.deepspeed:
        return (
            f"the {moved} of gradients reduce-scattered every micro-step and of weights all-gathered every "
            f"optimizer step over {link} (DeepSpeed {zero_label(s.deepspeed)})"
        )
    return f"the {moved} gradient all-reduce per step over {link}"


def _settings_dict(s: Settings) -> dict[str, Any]:
    d = asdict(s)
    d["lora_targets"] = list(s.lora_targets) if s.lora_targets is not None else None
    # the modules the LoRA adapts (lora.target_modules, or the family's default where it is null): what the
    # trainer trains and the plan charges
    d["lora_modules"] = list(registry.lora_targets(s.model, s.lora_targets)) if s.method == "lora" else None
    return d


def _rng(r: tuple[float, float] | None, digits: int | None = None) -> list | None:
    if r is None:
        return None
    return [int(r[0]), int(r[1])] if digits is None else [round(r[0], digits), round(r[1], digits)]


def result_dict(res: Result) -> dict[str, Any]:
    """The exact object `sdplan recommend --json` prints (issue 3; ranges, it/s and settings: issue 10)."""
    req = res.request
    s = res.plan
    plan_d = None
    if s is not None:
        plan_d = {
            "num_gpus": s.num_gpus,
            # the GPUs it runs on (as `sdplan doctor` numbers them) where the machine's differ; None: the first
            "gpu_ids": list(s.gpu_ids) if s.gpu_ids is not None else None,
            "batch_size": s.batch,
            "grad_accum": s.grad_accum,
            "precision": s.precision,
            "gradient_checkpointing": s.gradient_checkpointing,
            "optimizer": s.optimizer,
            "cache_latents": s.cache_latents,
            "cache_text_encoder_outputs": s.cache_text_encoder_outputs,
            "train_text_encoder": s.train_text_encoder,
            "full_half_weights": s.full_half_weights,
            "lora_rank": s.lora_rank,
            "deepspeed": dict(s.deepspeed) if s.deepspeed else None,
            "resolution": s.resolution,
            "base_precision": s.base_precision,
            "blocks_to_swap": s.blocks_to_swap,
        }
    st = res.steps
    estimate = None
    if res.feasible and res.memory is not None:
        estimate = {
            "peak_vram_bytes": int(res.memory.peak),
            "sampling_peak_vram_bytes": int(res.memory.sampling_peak) or None,
            "text_cache_peak_vram_bytes": int(res.memory.text_cache_peak) or None,
            "final_sample_grid_fits": final_grid_fits(res.memory, res.vram_bytes) if res.vram_bytes else None,
            "peak_vram_bytes_range": _rng(res.peak_range),
            # "measured": an sdplan bench point at these settings on this GPU; "scaled": the model times measured /
            # model at another batch of these settings on this GPU; "predicted": the model
            "peak_vram_basis": res.peak_basis,
            "within_upper_bound": res.within_upper_bound,
            "ram_bytes": int(res.memory.ram),
            # the parameters that train (a LoRA: its adapters on settings.lora_modules)
            "trainable_params": int(res.memory.trainable_params),
            "seconds": None if res.seconds is None else round(res.seconds, 1),
            "seconds_range": _rng(res.seconds_range, 1),
            # of ``seconds``: sampling DreamBooth's missing class images and the sample grids
            "sampling_seconds": None if res.sampling_seconds is None else round(res.sampling_seconds, 1),
            "it_per_s": None if not res.step_seconds else round(1.0 / res.step_seconds, 4),
            "speedup_vs_one_gpu": None
            if res.speedup_vs_one_gpu is None
            else round(res.speedup_vs_one_gpu, 3),
            "basis": res.basis,
        }
    return {
        "schema_version": 1,
        "feasible": res.feasible,
        "request": {
            "method": req.method,
            "model": req.model,
            "resolution": req.resolution,
            "images": req.images,
            "repeats": req.repeats,
            "images_per_epoch": req.per_epoch,
            "epochs": req.epochs,
            "max_steps": req.max_steps,
            "pins": {key: _jsonable(v) for name, value in req.pins for key, v in pin_items(name, value)},
        },
        "hardware": {
            "source": res.hardware.source,
            "gpus": [
                {"index": g.index, "name": g.name, "memory_total_bytes": g.memory_bytes}
                for g in res.hardware.gpus
            ],
            "ram_usable_bytes": res.hardware.ram_usable_bytes,
        },
        "plan": plan_d,
        "settings": _settings_dict(s) if s is not None else None,
        "steps": {
            "images_per_epoch": st.images_per_epoch,
            "epochs": st.epochs,
            "steps_per_epoch": st.steps_per_epoch,
            "total_steps": st.total_steps,
            "images_seen": st.images_seen,
        },
        "estimate": estimate,
        "needs": res.needs,
        "reasons": list(res.reasons),
    }


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# -- the transformer families (SD3.5, FLUX.1): LoRA over a frozen base, or the whole transformer ----------
#
# Issue 14 (LoRA). The frozen transformer's Linear weights are stored at the plan's base precision (the rest of
# the base: biases, norms, embeddings, in bf16); LoRA matrices train in fp32 with bf16 autocast; the text encoders
# (CLIP-L, CLIP-G, T5-XXL) stay resident in bf16 unless their outputs are cached (then they leave the GPU:
# kohya --cache_text_encoder_outputs, diffusers' --cache_latents/embedding precompute); activations are the
# transformer's saved tensors with only the LoRA targets trained (profiles/activations.yaml, computed on meta),
# with block-level gradient checkpointing (every transformer block a segment) or without.
#
# Full fine-tune and DreamBooth (trainer/recipes/finetune.py, dreambooth.py over trainer/flow.py) train every
# transformer weight, as the UNet families' full methods do (memory()): fp32 master weights under bf16 autocast
# (runtime.trained_dtype), or bf16 weights and gradients with training.full_half_weights (kohya --full_bf16);
# the optimizer state per optimizer (OPTIMIZER_STATE, Adafactor's factored moment of the real shapes); autocast's
# cached bf16 copies of fp32 weights; the optional EMA; DeepSpeed ZeRO-2 with optimizer offload; the activations
# with the whole transformer trained (the "full" entries of activations.yaml). DreamBooth's prior preservation
# puts the class images in the same call (batch doubled). What the trainer runs for these methods, and so all
# the planner chooses: no quantized base (quantize.support_problem: "only LoRA trains over a quantized frozen
# base") and no block swap (blockswap.support_problem: "the bundled trainer swaps blocks for LoRA only"), the text
# encoders frozen (flow.FlowAdapter.check refuses train_text_encoder).

# Bytes per stored element of a quantized frozen Linear weight.
# - fp8: torch.float8_e4m3fn, 1 byte; kohya --fp8_base and the trainer's Fp8Linear store the weight and upcast
#   it per layer for a bf16 matmul (one per-tensor scale where there is one: negligible). The trainer's backward
#   upcasts the stored weight again, so without checkpointing no upcast copy waits for the backward (kohya's
#   autocast casts and diffusers' layerwise-casting hook keep one per layer: most of a bf16 base, not counted).
# - nf4: bitsandbytes Linear4bit, 4 bits per weight plus one fp32 absmax per block of 64 (the blocksize default
#   of bitsandbytes.functional.quantize_4bit): 0.5 + 4/64 = 0.5625 bytes. QLoRA (Dettmers et al. 2023, section 3,
#   "Double Quantization"): "with a blocksize of 64 ... 32/64 = 0.5 bits per parameter on average" for the
#   constants; double quantization (not bitsandbytes' default) brings them to 0.127 bits.
BASE_PRECISION_BYTES = {"bf16": 2.0, "fp8": 1.0, "nf4": 0.5 + 4.0 / 64.0}
# Dequantising a quantized base costs a fixed time per stored Linear and per pass, whatever the batch: before every
# matmul the stored weight becomes a bf16 copy (fp8: a cast; nf4: bitsandbytes' dequantize kernel), in the
# forward, in the backward (the input gradient needs the weight) and again in the recomputed forward with
# checkpointing. Seconds per Linear per pass: least squares on log step time over the six same-GPU pairs
# measured (sdplan bench, H100 80GB HBM3, 16-core Xeon host, FLUX.1 [dev] LoRA 1024 px, rank 16, cached
# text-encoder outputs; 494 block Linears): fp8 without checkpointing at batch 1 (2026-11-26: bf16 1.573 it/s,
# fp8 1.395) and nf4 with checkpointing at batches 1-16 (2026-11-27: bf16 1.101 / 0.581 / 0.299 / 0.150 /
# 0.075 it/s, nf4 0.977 / 0.574 / 0.296 / 0.151 / 0.075). 68 us puts every pair's step within -2% / +5% (+0.10 s
# per FLUX.1 step with checkpointing: x1.11 at batch 1, hidden by the matmuls beyond). fp8 and nf4 cost the same
# per Linear (0.040 and 0.038 s per pass), though nf4 moves fewer bytes: kernel launches, not memory bandwidth, set
# it on this GPU (a per-byte model fitted on the same pairs scored worse left-one-source-out, 107% vs 65% median).
# Held out (measured after the fit, not refitted on it): fp8 with checkpointing at batches 1-8 on the same H100
# (0.972 / 0.556 / 0.294 / 0.152 it/s), each within 3% of bf16's step plus this time (x1.128, the factor it
# replaced, was 7-13% slow beyond batch 1). Before the trainer's Linear4bit followed autocast
# (trainer/quantize.py) nf4 measured x1.26-1.39 here.
DEQUANT_SECONDS_PER_LINEAR_PASS = 68e-6


def dequant_seconds(profiles: Profiles, s: Settings) -> float:
    """Seconds per micro-step spent dequantising the frozen base's block Linears (0: a bf16 base or a UNet)."""
    if s.base_precision == "bf16" or not flow_family(s.model):
        return 0.0
    return dequant_passes(s) * _block_linear_count(profiles.model(s.model)) * DEQUANT_SECONDS_PER_LINEAR_PASS


def dequant_passes(s: Settings) -> int:
    """Passes over the frozen base's weights per micro-step: forward, backward, + the recomputed forward."""
    return 3 if s.gradient_checkpointing else 2


def _block_linear_count(model: ModelSpec) -> int:
    return _per_model(model, "linear count", lambda: sum(c for _, _, _, c in transformer_linears(model)))


# A quantized base changes the result a little (its forward is the quantized network's): a small handicap so
# it is chosen where it makes a plan fit or clearly faster, not by default.
BASE_QUANT_HANDICAP = {"bf16": 0.0, "fp8": 0.02, "nf4": 0.05}
# bf16 elements of the transformer other than its blocks' Linear weights (biases, norms, embedders, final
# layer) are not quantized; the planner counts those from the config (transformer_linears).
FP8_COMPUTE_MIN_SM = (8, 9)  # fp8 tensor-core matmul (torch._scaled_mm / torchao float8): Ada (8.9), Hopper


def flow_family(family: str) -> bool:
    return family in registry.FLOW_FAMILIES


# (id(model), what) -> (model, the value): per-model arithmetic a plan's search asks thousands of times
_MODEL_MEMO: dict[tuple[int, Any], tuple[ModelSpec, Any]] = {}


def _per_model(model: ModelSpec, what: Any, compute: Callable[[], Any]) -> Any:
    """``compute()`` once per model spec (and ``what``): held while that very spec lives."""
    hit = _MODEL_MEMO.get((id(model), what))
    if hit is not None and hit[0] is model:
        return hit[1]
    value = compute()
    _MODEL_MEMO[(id(model), what)] = (model, value)
    return value


def transformer_linears(model: ModelSpec) -> tuple[tuple[str, int, int, int], ...]:
    """The Linear layers of the transformer's blocks from its config: (module suffix, in, out, count), as named
    by diffusers' FluxTransformer2DModel / SD3Transformer2DModel (what peft's target_modules match)."""
    return _per_model(model, "linears", lambda: tuple(_transformer_linears(model)))


def _transformer_linears(model: ModelSpec) -> list[tuple[str, int, int, int]]:
    cfg = model.transformer or {}
    d = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    out: list[tuple[str, int, int, int]] = []
    if model.architecture == "flux":
        n, ns = int(cfg["num_layers"]), int(cfg["num_single_layers"])
        for name in (
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
        ):
            out.append((name, d, d, n))
        for ff in ("ff", "ff_context"):  # FeedForward(dim, mult 4, gelu-approximate)
            out += [(f"{ff}.net.0.proj", d, 4 * d, n), (f"{ff}.net.2", 4 * d, d, n)]
        out += [("norm1.linear", d, 6 * d, n), ("norm1_context.linear", d, 6 * d, n)]
        # single-stream blocks: fused attention + MLP (no to_out: proj_out takes both)
        out += [(f"single.attn.to_{x}", d, d, ns) for x in ("q", "k", "v")]
        out += [
            ("single.proj_mlp", d, 4 * d, ns),
            ("single.proj_out", 5 * d, d, ns),
            ("single.norm.linear", d, 3 * d, ns),
        ]
        return out
    n = int(cfg["num_layers"])
    dual = len(cfg.get("dual_attention_layers") or ())
    # the last JointTransformerBlock is context_pre_only: no to_add_out, no ff_context
    for name in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"):
        out.append((name, d, d, n))
    for name in ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"):
        out.append((name, d, d, n))
    out.append(("attn.to_add_out", d, d, n - 1))
    out += [("ff.net.0.proj", d, 4 * d, n), ("ff.net.2", 4 * d, d, n)]
    out += [("ff_context.net.0.proj", d, 4 * d, n - 1), ("ff_context.net.2", 4 * d, d, n - 1)]
    out += [("norm1.linear", d, 6 * d, n - dual), ("norm1.linear", d, 9 * d, dual)]
    out += [("norm1_context.linear", d, 6 * d, n - 1), ("norm1_context.linear", d, 2 * d, 1)]
    out += [(f"attn2.to_{x}", d, d, dual) for x in ("q", "k", "v")] + [("attn2.to_out.0", d, d, dual)]
    return out


def _lora_linears(model: ModelSpec, s: Settings) -> tuple[tuple[str, int, int, int], ...]:
    targets = registry.lora_targets(
        s.model, s.lora_targets
    )  # what the trainer adapts (trainer/recipes/lora.py)
    # peft matches a target by the module name's suffix; single-stream blocks' attn.to_q/k/v match attn.to_*
    return _per_model(
        model,
        ("lora", targets),
        lambda: tuple(
            (name, i, o, c)
            for name, i, o, c in transformer_linears(model)
            if any(name == t or name.endswith("." + t) for t in targets)
        ),
    )


def flow_lora_input_elements(model: ModelSpec, s: Settings, latent_pixels: int) -> float:
    """Input elements of one sample summed over a transformer LoRA's adapted Linears (:func:`_lora_linears`):
    each layer's input features x the tokens of its stream: the image's (2x2 latent pixels a token) in a
    double-stream block's attn.to_* and ff.*, the text's (``transformer_text_tokens``) in its attn.add_*,
    to_add_out and ff_context.*, both in a single-stream block's."""
    # 2x2 latent pixels a token: SD3's transformer patches them (patch_size 2), FLUX.1's pipeline packs them
    # before its transformer (patch_size 1, 64 input channels)
    image, text = latent_pixels / 4, int(model.transformer_text_tokens or 0)
    total = 0.0
    for name, features, _, count in _lora_linears(model, s):
        if name.startswith("single."):
            tokens = image + text
        elif "add_" in name or "to_add_out" in name or name.startswith("ff_context."):
            tokens = text
        else:
            tokens = image
        total += count * features * tokens
    return total


def flow_lora_params(model: ModelSpec, s: Settings) -> int:
    """LoRA parameters on a transformer: rank x (in + out) per adapted Linear, from the config's shapes."""
    targets = registry.lora_targets(s.model, s.lora_targets)
    per_rank = _per_model(
        model, ("lora per rank", targets), lambda: sum(c * (i + o) for _, i, o, c in _lora_linears(model, s))
    )
    return int(s.lora_rank) * per_rank


def flow_quantizable_params(model: ModelSpec) -> int:
    """The transformer's block Linear weights (what a quantized base stores at fp8 / nf4)."""
    return _per_model(
        model,
        "quantizable",
        lambda: min(sum(c * i * o for _, i, o, c in transformer_linears(model)), model.denoiser_params),
    )


def flow_weight_bytes(s: Settings) -> float:
    """Bytes of a transformer family's weight that is not quantized, as the trainer loads it (trainer/runtime.py
    weight_dtype): 4 in fp32 (training.precision=fp32: no autocast, every component in fp32), else 2."""
    return 4.0 if s.precision == "fp32" else 2.0


def base_weight_bytes(model: ModelSpec, base_precision: str, weight_bytes: float = 2.0) -> float:
    """The frozen transformer on the GPU: block Linear weights at the base precision (a bf16 base: the weight
    dtype, :func:`flow_weight_bytes`), the rest in the weight dtype."""
    q = flow_quantizable_params(model)
    rest = model.denoiser_params - q + model.buffers_transformer
    stored = weight_bytes if base_precision == "bf16" else BASE_PRECISION_BYTES[base_precision]
    return q * stored + rest * weight_bytes


def text_encoder_embedding_params(te: dict) -> int:
    """The token (and, for CLIP, position) embedding parameters of one text encoder, from its config."""
    cfg = te["config"]
    width = int(cfg.get("hidden_size") or cfg.get("d_model"))
    return (int(cfg["vocab_size"]) + int(cfg.get("max_position_embeddings", 0))) * width


def frozen_text_encoder_bytes(model: ModelSpec, base_precision: str, weight_bytes: float = 2.0) -> float:
    """The frozen text encoders resident on the GPU of a transformer family (outputs not cached).

    fp8 base: kohya-ss/sd-scripts train_network.py sets ``te_weight_dtype = torch.float8_e4m3fn`` under
    ``--fp8_base`` (not ``--fp8_base_unet``) and casts every text encoder on the GPU to it; its
    ``prepare_text_encoder_fp8`` (flux_train_network.py) puts CLIP-L's embeddings and T5's Embedding / T5LayerNorm
    modules back to the bf16 weight dtype (the norms' few weights are not counted). The planner's fp8 base is
    kohya's, and the bundled trainer's (trainer/quantize.py store_text_encoders_fp8), so 1 byte per weight + 1 more per
    embedding weight. bf16 and nf4 (diffusers QLoRA quantizes the transformer only): the weight dtype's bytes
    (:func:`flow_weight_bytes`: 2, 4 in fp32)."""
    if base_precision != "fp8":
        return model.text_encoder_params * weight_bytes
    embeddings = sum(text_encoder_embedding_params(te) for te in model.text_encoders)
    return model.text_encoder_params * 1.0 + embeddings * (weight_bytes - 1.0)


# Why a card that kohya fits can be too small here: kohya-ss/sd-scripts README (sd3 branch), "FLUX.1 fine-tuning":
# "Sample command for FLUX.1 fine-tuning is below. This will work with 24GB VRAM GPUs" with "--fused_backward_pass
# --blocks_to_swap 8 --full_bf16" and Adafactor; "--blocks_to_swap ... must be combined with --fused_backward_pass or
# --blockwise_fused_optimizers". The bundled trainer has neither for the full methods.
FLOW_FULL_NOT_IN_TRAINER = (
    "kohya's flux_train.py / sd3_train.py fit smaller cards with a fused backward pass (the optimizer step inside "
    "the backward, no gradients held) and block swap for full fine-tuning; the bundled trainer has neither for "
    "the full methods (block swap is LoRA-only here): use LoRA, a larger GPU, or kohya's scripts"
)


def flow_trainable_params(model: ModelSpec, s: Settings) -> int:
    """What trains on a transformer family: every transformer weight (full fine-tune, DreamBooth) or the LoRA
    matrices (:func:`flow_lora_params`)."""
    return model.denoiser_params if s.method in FULL_METHODS else flow_lora_params(model, s)


def flow_batch(s: Settings) -> int:
    """Samples per transformer call: DreamBooth's prior preservation adds as many class images to the same call
    (trainer/recipes/dreambooth.py loss), as in the UNet families. The LoRA recipe has no prior term."""
    return s.batch * (2 if (s.prior_preservation and s.method in FULL_METHODS) else 1)


def memory_flow(profiles: Profiles, s: Settings) -> Memory:
    """Peak bytes of training SD3.5 / FLUX.1: a LoRA over a frozen base, or the whole transformer (see the
    section comment). The two share everything but what is frozen and what trains."""
    model = profiles.model(s.model)
    act = profiles.activations
    full = s.method in FULL_METHODS
    t = flow_trainable_params(model, s)
    batch = flow_batch(s)
    latent = (s.resolution // model.vae_scale_factor) ** 2
    # the trained weights, their gradients and the optimizer state: fp32 (a LoRA's matrices; full fine-tune's
    # master weights under autocast), or bf16 with training.full_half_weights (Settings.half_weights)
    tb = 2.0 if s.half_weights else 4.0

    swapped = swapped_block_bytes(model, s)
    # what is not trained or quantized: bf16 (fp16), or fp32 where training.precision=fp32 loads it so (an fp32
    # FLUX.1 base is 44 GiB: planned at 2 bytes, a 40 GB card was said to fit it)
    wb = flow_weight_bytes(s)
    frozen = 0.0 if full else base_weight_bytes(model, s.base_precision, wb) - swapped  # swapped: in host RAM
    if full:  # the transformer's persistent buffers (SD3's positional table) stay beside its trained weights
        frozen += model.buffers_transformer * tb
    if not s.cache_text_encoder_outputs:
        frozen += frozen_text_encoder_bytes(model, s.base_precision, wb)  # resident, used every step
    if not s.cache_latents:
        frozen += _vae_bytes(model, s)
    weights = t * tb
    grads = 0.0 if s.fused_backward else t * tb
    if s.optimizer in OPTIMIZER_STATE:
        copies, fixed = OPTIMIZER_STATE[s.optimizer]
        opt = t * (copies * tb + fixed)
    elif full:  # adafactor: the factored second moment of the transformer's real shapes, in fp32 whatever the
        # weights' dtype (transformers' Adafactor.step upcasts a bf16 gradient to fp32 before making its state)
        opt = float(act.adafactor_bytes(s.model))
    else:  # adafactor: factored second moment of each LoRA matrix (A: rank x in, B: out x rank)
        r = int(s.lora_rank)
        opt = 4.0 * sum(c * (2 * r + i + o) for _, i, o, c in _lora_linears(model, s))
    ema = model.denoiser_params * 4.0 if (full and s.ema == "gpu") else 0.0  # an fp32 copy, as memory()
    held, recompute = act.transformer(
        s.model,
        gc=s.gradient_checkpointing,
        batch=batch,
        latent_pixels=latent,
        trained="full" if full else "lora",
    )
    # the coefficients count bf16 tensors (scripts/compute_activations.py): fp32 saves them at twice the bytes
    family_factor = FLOW_ACTIVATION_FACTORS.get(speed_family(s.model), FLOW_ACTIVATION_FACTOR)
    factor = family_factor * wb / 2.0
    # lora.dropout's copies and masks are counted at their own element sizes
    activations = factor * (held + recompute) + family_factor * lora_dropout_bytes(profiles, s)
    # the backward's last block beside nearly all gradients: recomputed with checkpointing, its saved tensors
    # still held without (memory())
    _, segment = act.transformer(
        s.model, gc=True, batch=batch, latent_pixels=latent, trained="full" if full else "lora"
    )
    recompute_tail = factor * segment
    # torch's foreach AdamW: one step-sized temporary per parameter, in the parameter's dtype
    step = t * tb if (s.optimizer in FOREACH_OPTIMIZERS and not s.fused_backward) else 0.0
    # autocast's cached bf16 copies of the fp32 trained weights (see memory()), held until the forward ends
    autocast = t * 2.0 if (_half(s.precision) and tb == 4.0) else 0.0
    # host RAM: the components load in the dtype they train in (models.load_components): bf16, and the
    # transformer's trained weights in fp32 unless full_half_weights (quantizing on the GPU would first put the
    # bf16 base there: SimpleTuner#1149; the trainer / kohya quantize on the CPU)
    ram = RAM_PER_PROCESS + (tb if full else wb) * model.denoiser_params
    ram += wb * (model.text_encoder_params + model.params_vae)
    # the swapped blocks' pinned host copies are made from the loaded weights, which are then freed: the
    # peak is the larger of the two phases, not their sum
    ram = max(ram, RAM_PER_PROCESS + swapped)
    return _assemble(
        s,
        dict(trainable_params=t, weights=weights, frozen=frozen, gradients=grads, optimizer=opt, ema=ema),
        autocast_copies=autocast,
        activations=activations,
        step_transient=step,
        ram=ram,
        optimizer_fp32=opt,  # Adafactor's state is in fp32 already
        ema_host=model.denoiser_params * 4.0 if (full and s.ema == "cpu") else 0.0,
        recompute_tail=recompute_tail,
        sampling=lambda resident, autocast: flow_sampling_peak_bytes(
            profiles, s, resident=resident, autocast=autocast
        ),
        text_cache=text_cache_peak_bytes(profiles, s),
    )


def flow_sampling_peak_bytes(profiles: Profiles, s: Settings, *, resident: float, autocast: float) -> float:
    """Peak bytes while the trainer samples a grid of a transformer family: the resident training state (the
    frozen base, and the text encoders and VAE where their outputs are not cached), the VAE back on the GPU
    where latents were cached, autocast's copies of the fp32 trained weights (sampling runs in the training
    autocast), and the larger of the transformer's inference forward and the VAE decode at the training
    resolution (measured on meta). Cached text-encoder outputs keep the encoders away: the grid's prompts are
    encoded with the captions (trainer/flow.py cached_conditioning). 0 without sampling coefficients."""
    sampling = profiles.activations.families[s.model].get("sampling")
    if not sampling:
        return 0.0
    model = profiles.model(s.model)
    vae = _vae_bytes(model, s) if s.cache_latents else 0.0
    allocated = resident + vae + autocast + _grid_transient_bytes(model, s, sampling)
    return allocated + _overhead_bytes(allocated)


def step_flops_flow(profiles: Profiles, s: Settings) -> float:
    """FLOPs of one micro-step on a transformer family, counted on meta (activations.yaml): the forward + the
    input-gradient backward, + the weight-gradient backward of every trained Linear (the LoRA targets' for a
    LoRA, every weight for full fine-tune / DreamBooth: ~3x the forward against a LoRA's ~2.4x, like the UNet's
    3x vs 2x), + the recomputed forward with checkpointing, + the VAE / text encoders when not cached. A
    quantized base's dequantisation is a time per Linear, not FLOPs (:func:`dequant_seconds`)."""
    model = profiles.model(s.model)
    fam = profiles.activations.families[s.model]
    latent = (s.resolution // model.vae_scale_factor) ** 2
    batch = flow_batch(s)
    key = ("full" if s.method in FULL_METHODS else "lora") + ("_gc" if s.gradient_checkpointing else "")
    coef = fam["flops"]["transformer_train_step"][key]
    transformer = profiles.activations._eval(coef, batch, latent)
    other = 0.0
    if not s.cache_latents:
        other += profiles.activations.vae_encode_flops(s.model, latent) * s.batch
    if not s.cache_text_encoder_outputs:
        other += profiles.activations.text_encoder_flops(s.model) * batch
    return transformer + other


def _flow_point_efficiency(profiles: Profiles, p: MethodPoint) -> float | None:
    """Achieved / rated throughput of a one-GPU speed of a transformer family (None: not such a point, or one
    under DeepSpeed, whose step is its optimizer's: CPU Adam with offload)."""
    it_s = p.outcome.get("it_s")
    spec = profiles.point_gpu(p)
    if not it_s or spec is None or p.num_gpus != 1 or not flow_family(p.model) or p.settings.blocks_to_swap:
        return None
    if p.settings.deepspeed:
        return None
    ideal = step_flops_flow(profiles, p.settings) / (spec.matmul_tflops(p.settings.precision) * 1e12)
    measured = 1.0 / it_s - STEP_OVERHEAD_S - dequant_seconds(profiles, p.settings)
    return ideal / measured if measured > 0 else None


def _flow_efficiency_points(profiles: Profiles) -> list[tuple[str, float]]:
    """(point id, achieved / rated throughput) of every published one-GPU speed of a transformer family."""
    out = []
    for p in profiles.points:
        e = _flow_point_efficiency(profiles, p) if p.fit_speed else None
        if e is not None:
            out.append((p.id, e))
    return out


def _fit_with_floor(points: list[tuple[float, float, float]]) -> float:
    """The efficiency e whose step max(ideal / e + STEP_OVERHEAD_S, floor) fits the measured steps best, least
    squares on log time, over ``points`` (ideal seconds, measured seconds, floor seconds or 0). A step at the
    launch-bound floor says nothing of e: fitted as each point's own ratio (a geometric mean), the H100's
    launch-bound batch-1 steps pulled FLUX.1's efficiency from 0.42 (its batches 4-16) to 0.38 and SD3.5
    Medium's from 0.27 to 0.23."""

    def error(e: float) -> float:
        return sum(
            math.log(max(ideal / e + STEP_OVERHEAD_S, floor) / measured) ** 2
            for ideal, measured, floor in points
        )

    best = min(BANDWIDTH_EFFICIENCY_GRID, key=error)
    # refine between the grid's neighbours (3% apart) by golden-section search
    lo, hi = best / 1.03, best * 1.03
    g = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if error(a) <= error(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def _flow_bench_efficiencies(
    profiles: Profiles, cal: Calibration | None = None
) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[tuple[str, str], float], ...]]:
    """The transformer families' sdplan bench speeds (fit_speed or not: they stay out of the cross-GPU fit
    above, whose published points they would outnumber) as efficiencies where there are at least
    BENCH_MIN_POINTS: per GPU architecture family, and per (architecture, model), fitted with ``cal``'s
    launch-bound floor (_fit_with_floor). On the H100 one efficiency for the three models put SD3.5 Medium's
    speeds +31% to +126% too fast; leaving each of the 33 points out, the model alone erred by a median 20.2%,
    9.8% with each model's own, 3.9% (max 128%: Medium's batch 1 with only 4 Medium points left, which falls
    back to the architecture's efficiency) fitted with the floor."""
    by: dict[str, list[tuple[float, float, float]]] = {}
    by_model: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for p in profiles.points:
        e = _flow_point_efficiency(profiles, p) if p.from_bench else None
        if e is not None:
            measured = 1.0 / p.outcome["it_s"]
            floor = (cal.step_floor_s(p.settings) if cal is not None else None) or 0.0
            point = ((measured - STEP_OVERHEAD_S) * e, measured, floor)
            family = profiles.point_gpu(p).family
            by.setdefault(family, []).append(point)
            by_model.setdefault((family, speed_family(p.model)), []).append(point)

    def fits(table: dict) -> tuple:
        return tuple(
            (k, _fit_with_floor(pts)) for k, pts in sorted(table.items()) if len(pts) >= BENCH_MIN_POINTS
        )

    return fits(by), fits(by_model)


def _flow_rates(profiles: Profiles, cal: Calibration) -> tuple[tuple[str | None, float], ...]:
    """The bf16 GEMM rate of each GPU behind the transformer families' efficiencies (Calibration.flow_rates):
    the published fit's GPUs (None) and the GPUs of each architecture with a bench efficiency."""
    bench = dict(cal.flow_by_family)
    out: set[tuple[str | None, float]] = set()
    for p in profiles.points:
        spec = profiles.point_gpu(p)
        if spec is None or _flow_point_efficiency(profiles, p) is None:
            continue
        if p.from_bench and spec.family in bench:
            out.add((spec.family, spec.matmul_tflops("bf16")))
        elif p.fit_speed and cal.flow_efficiency:
            out.add((None, spec.matmul_tflops("bf16")))
    return tuple(sorted(out, key=lambda r: r[1]))


# kohya --blocks_to_swap (kohya-ss/sd-scripts library/flux_models.py enable_block_swap): N swaps N // 2
# double-stream and (N - N // 2) x 2 single-stream FLUX blocks, at most 17 / 36 of them (N <= 35); SD3
# (library/sd3_models.py) swaps N joint blocks, at most num_layers - 2. The swapped blocks stay in host RAM and
# each is copied in before its forward and again before its backward (the resident block it replaces goes back):
# 2 x its bytes each way per micro-step over PCIe. UNCALIBRATED: the copies are counted in full (kohya overlaps
# them with compute).
SWAP_STEPS = (
    8,
    16,
    22,
    28,
)  # kohya's README rungs (12 GB: 16, 10 GB: 22, 8 GB: 28), then each family's maximum
# max_blocks_to_swap() of each family's config (tests/test_plan_flow.py checks them)
MAX_BLOCKS_TO_SWAP = {"flux-dev": 35, "flux-schnell": 35, "sd35-large": 36, "sd35-medium": 22}
PCIE_EFFICIENCY = 0.8  # host-to-device copies of pinned memory: ~80% of the x16 link


def max_blocks_to_swap(model: ModelSpec) -> int:
    cfg = model.transformer or {}
    if model.architecture == "flux":  # N // 2 <= double - 2 and (N - N // 2) x 2 <= single - 2
        n = 0
        while (n + 1) // 2 <= int(cfg["num_layers"]) - 2 and (n + 1 - (n + 1) // 2) * 2 <= int(
            cfg["num_single_layers"]
        ) - 2:
            n += 1
        return n
    return int(cfg["num_layers"]) - 2


def swapped_block_bytes(model: ModelSpec, s: Settings) -> float:
    """Bytes of the transformer's Linear weights that block swap keeps in host RAM."""
    n = s.blocks_to_swap
    if not n:
        return 0.0
    linears = transformer_linears(model)
    if model.architecture == "flux":
        double = sum(i * o for name, i, o, _ in linears if not name.startswith("single."))
        single = sum(i * o for name, i, o, _ in linears if name.startswith("single."))
        elements = (n // 2) * double + (n - n // 2) * 2 * single
    else:
        layers = int((model.transformer or {})["num_layers"])
        elements = n * sum(c * i * o for _, i, o, c in linears) / layers
    return elements * BASE_PRECISION_BYTES[s.base_precision]


def pinned_ram_bytes(profiles: Profiles, s: Settings) -> float:
    """Host RAM a block-swap run holds for the whole run, all processes: each process's baseline and its
    swapped blocks' pinned (page-locked) copies, which the OS cannot page out."""
    return (RAM_PER_PROCESS + swapped_block_bytes(profiles.model(s.model), s)) * s.num_gpus


def offload_seconds(
    profiles: Profiles,
    s: Settings,
    spec: GPUSpec | None,
    cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S,
) -> float:
    """Seconds per micro-step that DeepSpeed ZeRO-2's optimizer offload adds (0 without it): each micro-step
    the process's share of the gradients goes to host memory over PCIe (2 bytes a parameter in half precision);
    once per optimizer step the host runs CPU Adam over every trained parameter (the processes of one machine
    share its memory bandwidth, which bounds CPU Adam: not divided by the GPU count) and the updated weights
    come back. The gradient copy can overlap the backward in DeepSpeed (overlap_comm, which sdplan's config sets
    with several processes): counted in full, an upper bound. Replaces a x3.5 factor on the whole step (a 2022 report of "3-4x slower"
    for SD 1.x at batch 1, which this model gives too: ~1.5 s added to a ~0.5 s step), which made a 4090's
    accumulated SDXL fine-tune 11x too slow."""
    if not s.offload or spec is None:
        return 0.0
    trained = trainable_params(profiles.model(s.model), s, profiles)
    link = _host_copy_bytes_per_s(spec)
    copied = trained * (2 if _half(s.precision) else 4) / s.num_gpus
    return copied / link + (trained / cpu_adam_params_per_s + copied / link) / s.grad_accum


# An EMA update's memory traffic over CPU Adam's: the lerp reads the average and the weight and writes the average
# (3 arrays); Adam reads the weight, gradient and two moments and writes three of them (7)
EMA_TO_ADAM_TRAFFIC = 3 / 7


def ema_seconds(
    profiles: Profiles,
    s: Settings,
    spec: GPUSpec | None,
    cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S,
) -> float:
    """Seconds per micro-step an EMA kept in host RAM (``ema.device: cpu``) adds (0 on the GPU or without one):
    after every optimizer step the trainer copies each trained weight to the host (fp32 masters, or the bf16
    weights) over PCIe, one at a time, and the CPU averages it in (trainer/loop.py Ema.step), at CPU Adam's
    measured rate scaled by the traffic (:data:`EMA_TO_ADAM_TRAFFIC`). Modelled, not measured: no published
    step time has a host-RAM EMA. On the GPU the average is a few milliseconds of memory traffic."""
    if s.ema != "cpu" or spec is None:
        return 0.0
    return ema_update_seconds(profiles, s, spec, cpu_adam_params_per_s) / s.grad_accum / s.ema_every


def ema_update_seconds(profiles: Profiles, s: Settings, spec: GPUSpec, cpu_adam_params_per_s: float) -> float:
    """One update of an EMA in host RAM (:func:`ema_seconds`): the trained weights over PCIe, then the CPU's
    average of them."""
    trained = trainable_params(profiles.model(s.model), s, profiles)
    copied = trained * (2 if s.full_half_weights else 4)
    return copied / _host_copy_bytes_per_s(spec) + trained * EMA_TO_ADAM_TRAFFIC / cpu_adam_params_per_s


def _host_copy_bytes_per_s(spec: GPUSpec) -> float:
    """Bytes per second a copy between host memory and this GPU moves: its PCIe link at PCIE_EFFICIENCY."""
    return _link_gbs_for(spec, "pcie") * 1e9 * PCIE_EFFICIENCY


def swap_seconds(profiles: Profiles, s: Settings, spec: GPUSpec | None) -> float:
    """Seconds per micro-step copying swapped blocks in over PCIe (0 without block swap)."""
    if not s.blocks_to_swap or spec is None:
        return 0.0
    moved = 2.0 * swapped_block_bytes(profiles.model(s.model), s)
    return moved / _host_copy_bytes_per_s(spec)


def base_precision_allowed(base_precision: str, gpu: HWGPU) -> str | None:
    """Why this GPU cannot hold a base at ``base_precision`` (None: it can).

    fp8 storage needs only torch's float8 dtypes (torch >= 2.1, any device; the matmul runs in bf16 after an
    upcast); fp8 *compute* would need SM 8.9+ (not planned). nf4 needs bitsandbytes' 4-bit kernels: CUDA
    (bitsandbytes installation docs; its ROCm / other backends are previews), so NVIDIA only here."""
    if base_precision == "nf4" and gpu.vendor != "nvidia":
        return "nf4 (bitsandbytes 4-bit) runs on NVIDIA CUDA GPUs only"
    cc = version_tuple(gpu.arch) if gpu.vendor == "nvidia" else None  # compute capability "8.9"
    if base_precision == "nf4" and cc is not None and cc < NF4_MIN_CC:  # trainer/quantize.py's rule
        return (
            f"nf4 (bitsandbytes 4-bit) needs compute capability {NF4_MIN_CC[0]}.{NF4_MIN_CC[1]}+; {gpu.name} "
            f"has {gpu.arch}"
        )
    return None


def _flow_reasons(
    req: Request,
    best: Candidate,
    fitting: list[Candidate],
    cal: Calibration,
    profiles: Profiles,
    spec: GPUSpec | None,
    vram: int,
) -> list[str]:
    s = best.setup
    model = profiles.model(s.model)
    r = (
        _flow_full_reasons(best)
        if s.method in FULL_METHODS
        else _flow_base_reasons(req, best, fitting, profiles, vram)
    )
    te = _gib(model.text_encoder_params * 2.0)
    if not s.cache_text_encoder_outputs:
        r.append(f"text encoders resident on the GPU in bf16 ({te}, T5-XXL included): they fit")
    if s.method == "lora":
        r.append(
            f"LoRA rank {s.lora_rank} on {len(_lora_linears(model, s))} Linear kinds of the transformer "
            f"({best.memory.trainable_params / 1e6:.1f}M parameters, counted from the config's shapes)"
        )
    if best.basis != "weakly_calibrated":  # a measured speed, or the model scaled by one: said with the time
        return r
    # at the launch-bound floor the basis is "calibrated" (planned_step_seconds): time_basis_text says so
    arch, borrowed = cal.flow_source(spec)
    if arch is not None:
        rate = spec.matmul_tflops("bf16")
        near = max(r_ for a, r_ in cal.flow_rates if a == arch)
        r.append(
            f"time: transformer FLOPs counted on meta over the GPU's throughput at "
            f"{cal.flow_efficiency_for(spec, s.model) * 100:.0f}% efficiency, measured by sdplan bench on "
            f"{arch.capitalize()} GPUs ("
            + (
                profiles.model(speed_family(s.model)).name
                if (arch, speed_family(s.model)) in dict(cal.flow_by_model)
                else "SD3.5 / FLUX.1"
            )
            + " LoRA)"
            + (
                f": none measured on {spec.family.capitalize()} GPUs, so the efficiency measured at the GEMM "
                f"rate nearest {spec.name}'s {rate:g} TFLOPS ({near:g} TFLOPS) is borrowed: EXTRAPOLATED"
                if borrowed
                else ""
            )
            + "; the full methods' weight gradients are UNCALIBRATED"
        )
    elif cal.flow_efficiency:
        pts = ", ".join(i for i, _ in cal.flow_points)
        ratio, on = cal.flow_model_ratio(s.model)
        carried = (
            f", x{ratio:.2f} for {model.name}: its efficiency against "
            f"{', '.join(profiles.model(m).name for m in cal.flow_published_models)}'s measured by sdplan bench "
            f"on {on.capitalize()} GPUs (EXTRAPOLATED to {spec.family.capitalize()})"
            if on is not None
            else ""
        )
        r.append(
            f"time: transformer FLOPs counted on meta over the GPU's throughput at "
            f"{cal.flow_efficiency_for(spec, s.model) * 100:.0f}% efficiency, fitted on {len(cal.flow_points)} "
            f"published SD3.5 / FLUX.1 speeds ({pts}){carried}; weakly calibrated (few points, settings partly "
            "assumed)"
            + (
                ", all of them LoRA: the full methods' weight gradients are counted, not measured"
                if s.method in FULL_METHODS
                else ""
            )
        )
    else:
        r.append(
            "time: transformer FLOPs counted on meta over the GPU's throughput with the UNet families' fitted "
            f"efficiency: UNCALIBRATED for {s.model}"
        )
    return r


def _flow_full_reasons(best: Candidate) -> list[str]:
    """What a full fine-tune / DreamBooth of a transformer family holds, in words."""
    s, m = best.setup, best.memory
    half = s.precision if _half(s.precision) else "fp32"  # DeepSpeed's weights: the training dtype
    where = f"{half} (training.full_half_weights)" if s.full_half_weights else "fp32 master copies"
    if s.offload:
        where = f"{half} on the GPU, fp32 masters and optimizer state in host RAM (DeepSpeed)"
    elif s.sharded:
        where = (
            f"{half} on every GPU, fp32 masters and optimizer state split over the {s.num_gpus} (DeepSpeed)"
        )
    return [
        f"the whole {s.model} transformer trains ({m.trainable_params / 1e9:.2f}B parameters): weights "
        f"{_size(m.weights)} in {where}, gradients {_size(m.gradients)}"
        + (f", {s.optimizer} state {_size(m.optimizer)}" if m.optimizer else "")  # offloaded: in host RAM
        + "; the bundled trainer has no quantized base or block swap for the full methods (LoRA only), and the "
        "text encoders stay frozen"
    ]


def _flow_base_reasons(
    req: Request, best: Candidate, fitting: list[Candidate], profiles: Profiles, vram: int
) -> list[str]:
    """The LoRA's frozen base: its storage precision and block swap, in words (``vram``: the smallest card's
    bytes, which a bf16 base's caption pass is weighed against)."""
    s = best.setup
    model = profiles.model(s.model)
    dequant = dequant_seconds(profiles, s)
    r = []
    # an unquantized base ("bf16") is stored in the run's weight dtype (trainer/runtime.py weight_dtype)
    wb = flow_weight_bytes(s)
    stored_as = "fp32" if wb == 4.0 else "fp16" if s.precision == "fp16" else "bf16"
    bf16_gib = _gib(base_weight_bytes(model, "bf16", wb))
    whole = base_weight_bytes(model, s.base_precision, wb)
    swapped = swapped_block_bytes(model, s) if s.blocks_to_swap else 0
    here = f"{_gib(whole - swapped)} on the GPU" + (
        f" ({_gib(whole)} in all; the swapped blocks wait in host RAM)" if swapped else ""
    )
    if req.pinned("base_precision"):
        why = "pinned"
    elif s.base_precision == "bf16":
        with_swap = f" with {s.blocks_to_swap} blocks swapped" if s.blocks_to_swap else ""
        why = f"the {bf16_gib} {stored_as} base fits{with_swap}, so it is not quantized"
    else:
        bf16_plans = [
            c for c in fitting if c.setup.base_precision == "bf16" and c.setup.num_gpus == s.num_gpus
        ]
        instead = min(bf16_plans, key=_preference, default=None)
        as_bf16 = memory(profiles, _with(s, base_precision="bf16"))
        if instead is None and as_bf16.text_cache_peak > HEADROOM * vram:
            # the bf16 base keeps the text encoders in bf16 for the caption pass too (an fp8 base stores them in
            # fp8: stored_text_encoder_bytes), and that pass, before the transformer is placed, is what overflows
            why = (
                f"the caption pass does not fit with the bf16 base: before training the text encoders in bf16 "
                f"({_gib(stored_text_encoder_bytes(model, _with(s, base_precision='bf16')))}) and the VAE take "
                f"{_gib(as_bf16.text_cache_peak)}, over {int(HEADROOM * 100)}% of {_gib(vram)} (the fp8 base stores "
                f"the text encoders in fp8 for that pass: {_gib(stored_text_encoder_bytes(model, s))})"
            )
        elif instead is None:
            why = f"the bf16 base ({bf16_gib}) does not fit beside the rest"
        elif instead.seconds and best.seconds:
            why = (
                "it allows a faster configuration than the bf16 base: the bf16-base plan it would choose instead "
                f"({describe(instead.setup)}) takes {instead.seconds / best.seconds:.2f}x as long; pin "
                "model.base_precision=bf16 to keep the unquantized base"
            )
        else:
            why = "it allows a faster configuration than the bf16 base"
    r.append(
        f"base precision {s.base_precision}"
        + (
            f" (not quantized: stored in {stored_as}, the run's weight dtype)"
            if s.base_precision == "bf16" and stored_as != "bf16"
            else ""
        )
        + f": the frozen {model.name} transformer takes {here}; {why}"
        + (
            f"; dequantising it adds ~{dequant:.2f} s per step ({_block_linear_count(model)} block Linears x"
            f" {dequant_passes(s)} passes x {DEQUANT_SECONDS_PER_LINEAR_PASS * 1e6:.0f} us, fitted on 6 same-GPU H100 pairs"
            " within -2%/+5%)"
            if dequant
            else ""
        )
    )
    if s.base_precision == "fp8":
        r.append(
            "fp8 base = fp8 storage (torch float8_e4m3fn, kohya --fp8_base), matmuls in bf16: any GPU with "
            "torch >= 2.1; fp8 compute (SM 8.9+) is not assumed"
        )
    if s.base_precision != "bf16":
        r.append(
            f"`sdplan train` stores the {s.base_precision} base with "
            + (
                "bitsandbytes NF4 (NVIDIA GPU)"
                if s.base_precision == "nf4"
                else "torch float8 (diffusers casting)"
            )
            + "; where this machine lacks what that needs it stops before launch and says what is missing"
        )
    if s.blocks_to_swap:
        r.append(
            f"block swap (kohya --blocks_to_swap {s.blocks_to_swap}): "
            + ("pinned" if req.pinned("blocks_to_swap") else "nothing faster fits with fewer blocks swapped")
            + f"; {_gib(swapped_block_bytes(model, s))} of the base stays in host RAM and is copied in twice per "
            "step (UNCALIBRATED time: the copies are counted in full); the bundled trainer swaps them one block "
            "at a time (one process, with gradient checkpointing)"
        )
    return r
