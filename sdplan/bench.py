"""`sdplan bench`: measure training memory and speed on this machine, and teach the planner.

For each (method, model, resolution) asked, :func:`run_bench` builds the full-size networks from the configs in
``profiles/models/`` with random weights (nothing is downloaded), sets them up as the trainer's recipes do
through the trainer's own recipe objects (``sdplan.trainer.recipes``: what trains, in which dtype, the loss),
and runs short warmed-up loops of the trainer's own optimizer step (``sdplan.trainer.loop``: Accelerator and
mixed precision, gradient checkpointing, optimizer, gradient accumulation and clipping). Each loop is one *probe point* at one
micro-batch size; the largest batch that fits is searched by doubling from 1, then bisecting between the last
batch that fitted and the first that did not. An out-of-memory error at a probe point is a measurement (it
bounds the search), not a crash.

:func:`select_requests` says what to measure: what was asked, or by default every method on sd15 and sdxl that
has no measured point for this GPU yet, each with the settings the planner would choose for this GPU.

Every probe point is written to the local profile store (``sdplan.profiles.local_dir()``, or ``store_dir``;
the demo's default is the store's ``demo/`` folder, which the planner does not read) as soon as it is measured, in the planner's method-point schema (``<store>/methods/<method>.yaml``), so Ctrl-C
keeps everything measured so far. Provenance (GPU, driver, torch, CUDA/ROCm, date, what was measured) goes
into each point's ``source`` and ``note``.

What is recorded:

- on a GPU: peak VRAM as ``torch.cuda.max_memory_allocated`` (``outcome.peak_vram_gib``: what the planner
  predicts) and ``max_memory_reserved`` (in the note), and micro-batch iterations per second (``it_s``); after
  the search, the trainer's final sample grid beside the training state (``outcome.sample_grid_peak_gib`` on
  the largest point that fitted: :func:`sample_grid_peak`), which plans at those settings state;
- with ``demo=True`` (``sdplan bench --demo``): the same code on a tiny model from ``sdplan.trainer.tiny``
  (SD 1.x-shaped, or SD3.5/FLUX.1-shaped with ``--model``) on the CPU, for trying it and for the tests.
  There is no VRAM there: memory is the process's peak resident-set growth over the bench's starting point,
  recorded as ``outcome.ram_gib`` and labelled as such, never as VRAM.

A DeepSpeed request (the planner's choice, or pinned: ``distributed.deepspeed.zero_stage=2``) is measured as
planned, each probed batch in a process of its own (:func:`sdplan.bench_harness.probe_in_process`: DeepSpeed's
engine fixes the micro-batch when it is prepared, and its process group lives as long as the process); no sample
grid is measured there.

SD3.5 and FLUX.1 (``--model sd35-medium`` ... ``flux-dev``): the transformer, CLIP/T5 encoders and VAE are
built from ``profiles/models/<family>.yaml`` and stepped through the same recipes and the flow-matching
objective (``sdplan.trainer.flow``). While the planner does not plan a family, a named one is measured in
the leanest configuration people run (:func:`flow_request`: bf16 base, gradient checkpointing, cached
latents and text-encoder outputs).

Test hook (``sdplan.trainer.faults``, read once per bench): ``SDPLAN_BENCH_OOM_ABOVE_BATCH=N`` makes every
probe point with a batch larger than N raise ``torch.OutOfMemoryError`` inside the training step (after the
forward pass, as a real OOM would), so the batch search's handling of OOM can be tested without a GPU. Points
it produces say so in their source.

The training harness and the probe point are :mod:`sdplan.bench_harness`; the one store writer is
:func:`sdplan.profiles.write_points`. Why one module of ~1,000 lines: it is the one command's sequence (what to
measure, the machine's provenance, the batch search, how a search ended, the bench point -> profile point
record, export/import of measurements for sharing), each a small function tested alone; splitting it would
scatter that sequence without removing any code.

torch, diffusers and the trainer are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from sdplan import __version__
from sdplan.bench_harness import (
    DEMO_MODELS_ERROR,
    DEMO_MODELS_FIX,
    Harness,
    free_memory,
    probe_in_process,
    probe_point,
    rss_bytes,
    weights_oom_point,
)
from sdplan.errors import ConfigError, NoGPUError, UsageError
from sdplan.extras import install_hint
from sdplan.probe.software import importable
from sdplan.profiles import EXPORT_KIND
from sdplan.registry import BASE_PRECISIONS, FAMILIES, FLOW_FAMILIES, FLOW_METHODS, METHODS, PLANNED_FAMILIES
from sdplan.settings import DEFAULT_LORA_RANK, Settings, describe
from sdplan.trainer import faults
from sdplan.trainer.dataset_scan import count_of

OOM_HOOK_ENV = faults.BENCH_OOM_ABOVE_BATCH_ENV  # the test hook (sdplan.trainer.faults)
GiB = 2**30
DEFAULT_FAMILIES = ("sd15", "sdxl")  # what `sdplan bench` measures when no --model is given
DEMO_RESOLUTION = 64  # sdplan.trainer.tiny.TINY_RESOLUTION
MEASURED_PREFIX = "measured: sdplan bench"


# -- what to measure ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One configuration to measure; the batch size is what the bench searches."""

    method: str
    model: str  # family: sd15 | sd21 | sdxl | sd35-medium | sd35-large | flux-dev | flux-schnell
    resolution: int
    precision: str = "fp16"  # fp32 | fp16 | bf16
    gradient_checkpointing: bool = True
    optimizer: str = "adamw"
    cache_latents: bool = True
    train_text_encoder: bool = False
    cache_text_encoder_outputs: bool = False  # frozen text encoders only: they leave the GPU
    lora_rank: int | None = None  # LoRA only
    base_precision: str = (
        "bf16"  # SD3.5 / FLUX.1 LoRA: the frozen base stored at fp8 / nf4 (trainer/quantize.py)
    )
    # DeepSpeed ZeRO in this one process ({"zero_stage", "offload_optimizer"}, as Settings has it): each probe
    # point runs in a process of its own (:func:`sdplan.bench_harness.probe_in_process`)
    deepspeed: dict | None = None
    settings_from: str = "default"  # "planner" | "default" | "demo": where the settings came from

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"unknown method {self.method!r}", fix=f"use one of {', '.join(METHODS)}")
        if self.model not in FAMILIES:
            raise UsageError(f"unknown model {self.model!r}", fix=f"use one of {', '.join(FAMILIES)}")
        if self.resolution < 64 or self.resolution % 8:
            raise UsageError(f"resolution {self.resolution}: must be >= 64 and a multiple of 8")
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise UsageError(f"precision {self.precision!r}: must be fp32, fp16 or bf16")
        if self.optimizer not in ("adamw", "adamw8bit", "adafactor"):
            raise UsageError(f"optimizer {self.optimizer!r}: must be adamw, adamw8bit or adafactor")
        if self.cache_text_encoder_outputs and (
            self.train_text_encoder or self.method == "textual-inversion"
        ):
            raise UsageError("text-encoder outputs can be cached only while the text encoders are frozen")
        if self.base_precision not in BASE_PRECISIONS:
            raise UsageError(
                f"base precision {self.base_precision!r}: must be one of {', '.join(BASE_PRECISIONS)}"
            )
        if self.base_precision != "bf16" and (self.method != "lora" or self.model not in FLOW_FAMILIES):
            raise UsageError(
                f"model.base_precision={self.base_precision}: a quantized frozen base is for SD3.5 / FLUX.1 LoRA "
                f"only, not {self.method} {self.model}",
                fix="leave model.base_precision out",
            )
        if self.deepspeed is not None:
            # checked by the trainer's own config rules, in its words: the stage (1 or 2), the keys, and what
            # does not combine with DeepSpeed (8-bit AdamW, text-encoder training ...); the stored dict is the
            # validated one, its defaults filled
            from sdplan import config as C

            data = C.merge(C.default_config(), request_settings(self, 1).to_config())
            ds = C.validate(data, source="the bench's settings").distributed.deepspeed
            object.__setattr__(self, "deepspeed", asdict(ds))
        if self.method == "lora" and self.lora_rank is None:
            object.__setattr__(self, "lora_rank", DEFAULT_LORA_RANK)
        if self.method != "lora":
            object.__setattr__(self, "lora_rank", None)

    @property
    def settings(self) -> str:
        return describe(request_settings(self, 1), batch=False, short=True)

    @property
    def label(self) -> str:
        return f"{self.method} {self.model} {self.resolution}px ({self.settings})"


@dataclass(frozen=True)
class Machine:
    """Where the bench runs, for provenance and for the points' ``gpu`` field."""

    kind: str  # "cuda" | "cpu"
    name: str  # the GPU name as the driver reports it, or "CPU" for the demo
    memory_total_bytes: int | None
    driver: str | None = None
    torch: str | None = None
    cuda: str | None = None
    hip: str | None = None
    cpu_model: str | None = None

    @property
    def provenance(self) -> str:
        parts = [self.name if self.kind == "cuda" else f"CPU {self.cpu_model or '(unknown model)'}"]
        if self.driver:
            parts.append(f"driver {self.driver}")
        parts.append(f"torch {self.torch}")
        if self.cuda:
            parts.append(f"CUDA {self.cuda}")
        if self.hip:
            parts.append(f"HIP {self.hip}")
        return ", ".join(parts)


@dataclass(frozen=True)
class BenchPoint:
    """One probe point: a request at one micro-batch size, and what happened."""

    request: BenchRequest
    batch: int
    fits: bool
    it_s: float | None = None  # micro-batch iterations per second (timed steps only)
    peak_allocated_bytes: int | None = None  # torch.cuda.max_memory_allocated
    peak_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved
    peak_rss_delta_bytes: int | None = None  # CPU runs: peak resident set over the bench's start
    # on a GPU, the largest fitting point: the trainer's final sample grid after the search (allocated peak)
    sample_grid_peak_bytes: int | None = None
    steps: int = 0  # timed steps
    warmup_steps: int = 0
    simulated_oom: bool = False
    error: str | None = None  # first line of the OOM message
    point_id: str = ""
    store_file: Path | None = None
    demo: bool = False
    date: str = ""

    @property
    def memory_bytes(self) -> int | None:
        return (
            self.peak_allocated_bytes if self.peak_allocated_bytes is not None else self.peak_rss_delta_bytes
        )

    @property
    def memory_label(self) -> str:
        if self.peak_allocated_bytes is not None:
            return "peak VRAM (max_memory_allocated)"
        return "peak RSS delta (CPU)"


@dataclass
class BenchResult:
    """All probe points of one request and the largest batch that fitted (0: not even batch 1)."""

    request: BenchRequest
    points: list[BenchPoint] = field(default_factory=list)
    max_batch: int = 0
    bounded_by: str = (
        ""  # "oom" (a larger batch ran out of memory) | "cap" (the search's limit) | "interrupted"
    )
    batch_cap: int = 0

    @property
    def best(self) -> BenchPoint | None:
        fitting = [p for p in self.points if p.fits and p.batch == self.max_batch]
        return fitting[-1] if fitting else None


@dataclass(frozen=True)
class Effort:
    """How long each probe point runs and how far the search goes."""

    warmup_steps: int
    timed_steps: int  # at least this many timed steps ...
    max_batch: int
    min_timed_seconds: float = 0.0  # ... and on until this much time has passed (short GPU steps are noisy)
    max_timed_steps: int = 100


# A 3-step window on an H100 (0.2 s steps) gave it/s off by up to 2x (batch 4 slower than batch 8 per step):
# time each step on its own and report the median over at least a couple of seconds.
FULL = Effort(warmup_steps=2, timed_steps=6, max_batch=64, min_timed_seconds=4.0)
QUICK = Effort(warmup_steps=1, timed_steps=3, max_batch=16, min_timed_seconds=1.5)
DEMO = Effort(warmup_steps=1, timed_steps=2, max_batch=4)


# -- the batch search -----------------------------------------------------------------------------------


def search_largest_batch(fits: Callable[[int], bool], *, max_batch: int) -> tuple[int, str]:
    """Largest batch in [1, max_batch] for which ``fits(batch)`` is true: doubling from 1 until a batch does
    not fit (or the cap), then bisecting between the last batch that fitted and the first that did not.

    Assumes memory grows with the batch (a batch that does not fit bounds every larger one). Returns
    ``(largest, bounded_by)``: largest is 0 when batch 1 does not fit; bounded_by is "oom" when a larger
    batch was seen not to fit, "cap" when the search stopped at ``max_batch``.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    lo, hi = 0, None
    b = 1
    while True:
        if fits(b):
            lo = b
            if b >= max_batch:
                return lo, "cap"
            b = min(b * 2, max_batch)
        else:
            hi = b
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, "oom"


# -- the store: method files in the planner's schema -----------------------------------------------------


def store_root(store_dir: str | Path | None = None, *, demo: bool = False, verb: str = "write") -> Path:
    """Where points go: ``store_dir``, else the local profile store the planner reads; the demo's default is
    its ``demo/`` subfolder, which the planner does not read (tiny-model CPU points teach it nothing)."""
    from sdplan import profiles

    root = Path(store_dir).expanduser() if store_dir is not None else None
    if root is None:
        root = profiles.local_dir() / "demo" if demo else profiles.local_dir()
    return profiles.check_store(root, verb)  # a file there (or above it): one line, for every command


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def point_id(machine: Machine, req: BenchRequest, batch: int, *, demo: bool) -> str:
    parts = [
        "bench",
        _slug(machine.name),
        req.method,
        req.model + ("-tiny" if demo else ""),
        str(req.resolution),
    ]
    parts += [req.precision, "gc" if req.gradient_checkpointing else "nogc", req.optimizer]
    if req.cache_latents:
        parts.append("cl")
    if req.cache_text_encoder_outputs:
        parts.append("cte")
    if req.train_text_encoder:
        parts.append("te")
    if req.lora_rank:
        parts.append(f"r{req.lora_rank}")
    if req.base_precision != "bf16":
        parts.append(req.base_precision)
    if req.deepspeed:
        parts.append(f"zero{req.deepspeed['zero_stage']}")
        parts.append("offload" if req.deepspeed["offload_optimizer"] else "sharded")
    parts.append(f"b{batch}")
    return "-".join(parts)


def request_settings(req: BenchRequest, batch: int) -> Settings:
    """The settings a bench request measures at one micro-batch (one process, no accumulation)."""
    return Settings(
        method=req.method,
        model=req.model,
        resolution=req.resolution,
        batch=batch,
        precision=req.precision,
        gradient_checkpointing=req.gradient_checkpointing,
        optimizer=req.optimizer,
        cache_latents=req.cache_latents,
        cache_text_encoder_outputs=req.cache_text_encoder_outputs,
        train_text_encoder=req.train_text_encoder,
        lora_rank=req.lora_rank,
        base_precision=req.base_precision,
        deepspeed=req.deepspeed,
        set_grads_to_none=True,
    )


def bench_request(s: Settings, settings_from: str) -> BenchRequest:
    """What the bench measures for these settings (it searches the batch itself)."""
    return BenchRequest(
        method=s.method,
        model=s.model,
        resolution=s.resolution,
        precision=s.precision,
        gradient_checkpointing=s.gradient_checkpointing,
        optimizer=s.optimizer,
        cache_latents=s.cache_latents,
        train_text_encoder=s.train_text_encoder,
        cache_text_encoder_outputs=s.cache_text_encoder_outputs,
        lora_rank=s.lora_rank,
        base_precision=s.base_precision,
        deepspeed=s.deepspeed,
        settings_from=settings_from,
    )


def point_record(point: BenchPoint, machine: Machine) -> dict[str, Any]:
    """The point as the planner's method-point schema has it (``profiles/methods/*.yaml``)."""
    from sdplan import profiles

    req = point.request
    outcome: dict[str, Any] = {"fits": point.fits}
    if point.fits:
        if point.peak_allocated_bytes is not None:
            outcome["peak_vram_gib"] = round(point.peak_allocated_bytes / GiB, 3)
        elif point.peak_rss_delta_bytes and round(point.peak_rss_delta_bytes / GiB, 4) > 0:
            outcome["ram_gib"] = round(point.peak_rss_delta_bytes / GiB, 4)
        if point.it_s:
            outcome["it_s"] = round(point.it_s, 3)
        if point.sample_grid_peak_bytes is not None:
            outcome["sample_grid_peak_gib"] = round(point.sample_grid_peak_bytes / GiB, 3)

    what = (
        "random-weight full-size networks from profiles/models"
        if not point.demo
        else (f"the tiny {req.model}-shaped demo model (sdplan.trainer.tiny), NOT a full-size {req.model}")
    )
    source = (
        f"{MEASURED_PREFIX}{' --demo' if point.demo else ''} {__version__} on {machine.provenance}, "
        f"{point.date}; {what}"
    )
    if point.simulated_oom:
        source += f"; out of memory SIMULATED by the test hook {OOM_HOOK_ENV}"
    settings = f"settings from {req.settings_from}; {point.warmup_steps} warm-up + {point.steps} timed steps (median step time)"
    if not point.fits:
        note = f"out of memory at batch {point.batch}: {point.error or 'OutOfMemoryError'}; {settings}"
    elif point.peak_allocated_bytes is not None:
        note = (
            f"peak_vram_gib = torch.cuda.max_memory_allocated; max_memory_reserved "
            f"{point.peak_reserved_bytes / GiB:.3f} GiB; {settings}"
        )
        if point.sample_grid_peak_bytes is not None:
            note += (
                "; sample_grid_peak_gib: the trainer's final sample grid (one image, 2 denoising steps) after "
                "the batch search, torch.cuda.max_memory_allocated"
            )
    else:
        note = f"CPU run: ram_gib is the peak resident-set growth of the process (not VRAM); {settings}"
    return profiles.point_record(
        request_settings(req, point.batch),
        id=point.point_id,
        gpu=machine.name,
        gpu_memory_bytes=machine.memory_total_bytes,
        outcome=outcome,
        source=source,
        model_name=f"sdplan bench: {'tiny demo model' if point.demo else 'random weights'} ({req.model})",
        note=note,
    )


_HEADER = """\
# Measured on this machine by `sdplan bench` (sdplan.bench): one point per probe (method, model,
# resolution, settings, micro-batch). The planner prefers these over calibrated and published figures.
# Re-measuring replaces a point with the same id. Share them with `sdplan profiles export FILE`.
"""


def _read_method_file(path: Path, method: str) -> dict[str, Any]:
    from sdplan import profiles

    if not path.is_file():
        return {"schema_version": profiles.SCHEMA_VERSION, "method": method, "points": []}
    profiles.load_methods(path, origin="local")  # refuses to extend a file the planner would reject
    data = profiles.read_yaml(path)
    if data.get("method") != method:
        raise ConfigError(str(path), [f"method: expected {method!r}, got {data.get('method')!r}"])
    return data


def write_points(store_dir: str | Path | None, method: str, records: Iterable[dict[str, Any]]) -> Path:
    """Add (or replace, by id) points in ``<store>/methods/<method>.yaml`` (:func:`profiles.write_points`)."""
    from sdplan import profiles

    return profiles.write_points(store_root(store_dir), method, list(records), header=_HEADER)


# -- the machine and the settings -----------------------------------------------------------------------


def describe_machine(device: str) -> Machine:
    """Name, memory, driver and software of the device the bench runs on."""
    import platform

    import torch

    cpu_model = None
    try:
        from sdplan.probe.host import cpu_model as _cpu_model

        cpu_model = _cpu_model()
    except Exception:  # provenance only: never fail a bench on it
        cpu_model = platform.processor() or None
    if device == "cpu":
        return Machine(
            kind="cpu", name="CPU", memory_total_bytes=None, torch=torch.__version__, cpu_model=cpu_model
        )
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    driver = None
    hip = getattr(torch.version, "hip", None)
    try:  # the driver version from NVML (amdsmi on ROCm), as `sdplan doctor` reads it
        from sdplan.probe import amd, nvidia

        reading = amd.probe() if hip else nvidia.probe()
        driver = next((g.driver_version for g in reading.gpus if g.driver_version), None)
    except Exception:  # provenance only
        driver = None
    return Machine(
        kind="cuda",
        name=torch.cuda.get_device_name(index),
        memory_total_bytes=int(props.total_memory),
        driver=driver,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=hip,
        cpu_model=cpu_model,
    )


# the flat fp32 parameter CPU Adam updates in `sdplan bench --host` (0.8 GB with its gradient and moments)
HOST_PARAMS = 50_000_000
HOST_STEPS = 5


def measure_host(store_dir: str | Path | None = None, *, params: int | None = None, steps: int = HOST_STEPS):
    """`sdplan bench --host`: DeepSpeed's CPU Adam rate on this host (the optimizer step ZeRO-2 offload runs on
    the CPU), written to the store's host.yaml, which the planner reads when it plans for this machine.
    Returns (the HostMeasurement, the file)."""
    import importlib.metadata

    import torch

    from sdplan import profiles
    from sdplan.bench_harness import cpu_adam_rate

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the optimizer runs on the CPU whatever GPU is here
    params = params or HOST_PARAMS
    rate = cpu_adam_rate(params, steps)
    cpu = describe_machine("cpu").cpu_model or "unknown CPU"
    threads = torch.get_num_threads()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    host = profiles.HostMeasurement(
        cpu=cpu,
        threads=threads,
        cpu_adam_params_per_s=round(rate, -6),
        source=f"sdplan bench --host {__version__}, DeepSpeedCPUAdam "
        f"(deepspeed {importlib.metadata.version('deepspeed')}), {params / 1e6:.0f}M fp32 parameters, median of "
        f"{steps} steps on {count_of(threads, 'thread')} of {cpu}, {now}",
    )
    return host, profiles.write_host(store_root(store_dir), host)


def resolve_device(device: str, *, demo: bool) -> str:
    """ "cuda" or "cpu". A real bench needs a GPU; the demo runs on the CPU."""
    if demo:
        return "cpu"
    import torch

    if device == "cpu":
        raise UsageError(
            "sdplan bench measures GPU memory and speed; it does not run full-size models on the CPU",
            fix="run `sdplan bench --demo` to try it on the CPU with the tiny model",
        )
    if not torch.cuda.is_available():
        raise NoGPUError(
            "no usable GPU: torch sees no CUDA/ROCm device, so there is nothing to measure",
            fix="run `sdplan doctor` to see why, or `sdplan bench --demo` to try the bench on the CPU",
        )
    return "cuda"


def demo_request(method: str = "lora") -> BenchRequest:
    """The demo's settings: fp32 (fp16 autocast is a GPU feature), no memory savers needed."""
    return BenchRequest(
        method=method,
        model="sd15",
        resolution=DEMO_RESOLUTION,
        precision="fp32",
        gradient_checkpointing=False,
        optimizer="adamw",
        cache_latents=False,
        settings_from="demo",
    )


def _measured_on(profiles_: Any, point: Any, gpu_name: str | None, gpu_memory_bytes: int | None) -> bool:
    """The point was measured on this GPU: the same catalog entry (the memory settles a name several boards
    share), or outside the catalog the same name and memory."""
    from sdplan.profiles import normalise_gpu_name

    if not point.gpu or not gpu_name:
        return False
    here, there = profiles_.gpu_or_none(gpu_name, gpu_memory_bytes), profiles_.point_gpu(point)
    if here is not None or there is not None:
        return here is not None and there is not None and here.name == there.name
    same_memory = (
        point.gpu_memory_gib is None
        or gpu_memory_bytes is None
        or abs(point.gpu_memory_gib * GiB - gpu_memory_bytes) <= 0.05 * gpu_memory_bytes
    )
    return normalise_gpu_name(point.gpu) == normalise_gpu_name(gpu_name) and same_memory


def measured_here(
    profiles_: Any,
    gpu_name: str,
    method: str,
    model: str,
    resolution: int,
    gpu_memory_bytes: int | None = None,
) -> list[Any]:
    """Points measured on this GPU (by `sdplan bench`, here or shipped) for a method, model and resolution."""
    return [
        p
        for p in profiles_.points
        if p.method == method
        and p.model == model
        and p.resolution == resolution
        and p.num_gpus == 1
        and (p.origin == "local" or p.source.startswith(MEASURED_PREFIX))
        and (p.outcome.get("peak_vram_gib") is not None or p.outcome.get("fits") is False)
        and _measured_on(profiles_, p, gpu_name, gpu_memory_bytes)
    ]


def _at_settings(point: Any, req: BenchRequest) -> bool:
    """A measured point is of ``req``'s settings (the batch aside: the bench searches it)."""
    s, o = point.settings, point.options
    return (
        point.precision == req.precision
        and bool(o.gradient_checkpointing) == req.gradient_checkpointing
        and s.optimizer == req.optimizer
        and bool(s.cache_latents) == req.cache_latents
        and bool(s.cache_text_encoder_outputs) == req.cache_text_encoder_outputs
        and bool(s.train_text_encoder) == req.train_text_encoder
        and (req.lora_rank is None or s.lora_rank == req.lora_rank)
        and o.base_precision == req.base_precision
        and bool(o.deepspeed) == bool(req.deepspeed)
    )


def planner_settings(snapshot: Any, profiles_: Any, method: str, model: str, resolution: int) -> BenchRequest:
    """The settings `sdplan recommend` would choose for one GPU of this machine; the bench searches the batch.

    A DeepSpeed plan is measured as planned, each probe point in a process of its own (DeepSpeed's engine and
    process group live as long as the process); without DeepSpeed installed, or where the planner finds
    nothing that fits, the bench measures the leanest setting without DeepSpeed (gradient checkpointing,
    Adafactor, cached latents): whether that fits is exactly what the planner is unsure of. So does a plan
    with full half-precision weights (kohya --full_bf16): the trainer (and so the harness) runs them, but a
    bench point has no field to record them yet. 8-bit AdamW needs bitsandbytes; without it Adafactor is
    measured instead.
    """
    from sdplan import planner

    res = planner.plan(
        snapshot, profiles_, planner.Request(method=method, model=model, resolution=resolution, max_gpus=1)
    )
    hw = planner.hardware_from_snapshot(snapshot, profiles_)
    precision = planner.precision_for(hw.gpus[:1]) if hw.gpus else "fp16"
    s = res.plan
    no_deepspeed = s is not None and bool(s.deepspeed) and not importable("deepspeed")
    why = "the planner finds nothing that fits"
    if no_deepspeed:
        why = f"the planner's plan uses DeepSpeed, which is not installed: {install_hint('deepspeed')}"
    elif s is not None and s.full_half_weights:
        why = "the planner's plan needs full half-precision weights, which a bench point cannot record yet"
    lean = BenchRequest(
        method=method,
        model=model,
        resolution=resolution,
        precision=precision,
        gradient_checkpointing=True,
        optimizer="adafactor" if method != "textual-inversion" else "adamw",
        cache_latents=True,
        cache_text_encoder_outputs=method != "textual-inversion",
        settings_from=f"leanest without DeepSpeed ({why})",
    )
    if s is None or no_deepspeed or s.full_half_weights:
        return lean
    origin = f"the planner ({str(res.basis).replace('_', ' ')} basis)"
    if s.optimizer == "adamw8bit" and not importable("bitsandbytes"):
        s, origin = (
            replace(s, optimizer="adafactor"),
            origin + "; adafactor for adamw8bit: bitsandbytes is not installed",
        )
    return bench_request(s, origin)


DEMO_FAMILIES = ("sd15", "sdxl", *FLOW_FAMILIES)  # the tiny models of sdplan.trainer.tiny the demo measures


def _family_name(name: str) -> str:
    from sdplan import registry

    try:
        return registry.family(name).name
    except UsageError:
        return name  # select_requests says what is wrong with it


def _check_flow_methods(family: str, methods: list[str]) -> None:
    for m in methods:
        if m not in FLOW_METHODS:
            raise UsageError(
                f"sdplan bench --model {family} --method {m}: the trainer does {', '.join(FLOW_METHODS)} "
                f"for {family}",
                fix="bench --method lora (or finetune, dreambooth)",
            )


def flow_request(method: str, family: str, resolution: int) -> BenchRequest:
    """An SD3.5/FLUX request while the planner does not plan the family: the leanest configuration people
    run (bf16 frozen base, gradient checkpointing, cached latents and text-encoder outputs; LoRA at the
    default rank), so the first point measured is the one most likely to fit."""
    return BenchRequest(
        method=method,
        model=family,
        resolution=resolution,
        precision="bf16",
        gradient_checkpointing=True,
        optimizer="adamw",
        cache_latents=True,
        cache_text_encoder_outputs=True,
        settings_from="default",
    )


@dataclass(frozen=True)
class Selection:
    requests: list[BenchRequest]
    skipped: list[str]  # "lora sd15 512px: measured on this GPU already (3 points)"
    gpu: str | None
    uncatalogued: str | None = None  # why the planner cannot use this GPU's points yet (not in the catalog)


# sdplan.yaml keys a bench request can pin (`sdplan bench ... memory.gradient_checkpointing=false`): what a
# bench point records besides the batch, which the bench searches, and the resolution (--resolution); a key
# names its sub-keys too (distributed.deepspeed.zero_stage)
BENCH_KEYS = (
    "training.precision",
    "training.train_text_encoder",
    "memory.gradient_checkpointing",
    "memory.optimizer",
    "memory.cache_latents",
    "memory.cache_text_encoder_outputs",
    "lora.rank",
    "model.base_precision",
    "distributed.deepspeed",
)


def pin_request(req: BenchRequest, items: tuple[str, ...] | list[str]) -> BenchRequest:
    """``req`` with the ``key=value`` settings pinned over the planner's (or the default) ones, parsed and
    validated as `sdplan train` and `sdplan recommend` take them (:func:`sdplan.recommend.parse_pins`)."""
    if not items:
        return req
    from sdplan.config import override_keys

    keys = override_keys(items)
    other = [k for k in keys if not any(k == b or k.startswith(b + ".") for b in BENCH_KEYS)]
    if other:
        raise UsageError(
            f"sdplan bench cannot pin {', '.join(other)}: a bench point records the precision, "
            "checkpointing, optimizer, caching, text-encoder training, LoRA rank, frozen base's precision "
            "and DeepSpeed",
            fix=f"pin only {', '.join(BENCH_KEYS)} (the bench searches the batch; --resolution sets the size)",
        )
    from sdplan.recommend import parse_pins

    # each a BenchRequest field (BENCH_KEYS); lora.rank pins the LoRA requests of a selection of several methods
    pins, _ = parse_pins(tuple(items), req.method, req.model, shared=True)
    return replace(req, **dict(pins), settings_from=f"{req.settings_from}; pinned {' '.join(items)}")


def check_selection(
    methods: list[str] | None,
    models: list[str] | None,
    resolution: int | None,
    *,
    demo: bool,
    pins: tuple[str, ...] = (),
) -> list[str]:
    """UsageError for a method, model, resolution or pinned setting that cannot be measured (before any GPU
    is looked for); returns the models by their family names."""
    for m in methods or []:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r}", fix=f"use one of {', '.join(METHODS)}")
    models = [_family_name(f) for f in models or []]  # aliases (flux, sd35) to the family's name
    for f in models:
        if f not in FAMILIES:
            raise UsageError(f"unknown model {f!r}", fix=f"use one of {', '.join(FAMILIES)}")
        if f not in PLANNED_FAMILIES and f not in FLOW_FAMILIES:  # no profile to build the network from
            benched = list(dict.fromkeys([*PLANNED_FAMILIES, *FLOW_FAMILIES]))
            raise UsageError(
                f"sdplan bench --model {f}: not yet benched for this family",
                fix=f"bench one of {', '.join(benched)}",
            )
    if resolution is not None and (resolution < 64 or resolution % 8):
        raise UsageError(f"--resolution {resolution}: must be >= 64 and a multiple of 8")
    for f in models or []:
        if f in FLOW_FAMILIES:
            _check_flow_methods(f, methods or ["lora"])
    if demo:
        if any(f not in DEMO_FAMILIES for f in models or []):
            raise UsageError(DEMO_MODELS_ERROR, fix=DEMO_MODELS_FIX)
        if resolution is not None and resolution % 16:
            raise UsageError(f"--resolution {resolution}: the demo's tiny models need a multiple of 16")
    if methods and pins:  # a setting only another method reads is refused, as recommend and train refuse it
        from sdplan import config as C

        # a key no method benched here reads (lora.rank with LoRA among them pins its requests)
        unread = [k for k in C.override_keys(pins) if all(C.method_setting_problems(m, [k]) for m in methods)]
        if unread:
            raise C.ConfigError("key=value settings", C.method_setting_problems(methods[0], unread))
    for method in methods or ["lora"]:  # every pin, parsed for each method named (a typo is wrong anywhere)
        for family in models or ["sd15"]:
            pin_request(BenchRequest(method=method, model=family, resolution=resolution or 512), pins)
    return models


def select_requests(
    methods: list[str] | None = None,
    models: list[str] | None = None,
    resolution: int | None = None,
    *,
    demo: bool = False,
    store_dir: str | Path | None = None,
    snapshot: Any = None,
    gpu_name: str | None = None,
    pins: tuple[str, ...] = (),
) -> Selection:
    """What to measure. Named methods/models are measured as asked. With neither named, every method on the
    default families (sd15, sdxl) at their native resolution that has no measured point for this GPU yet,
    i.e. what the planner is least sure of here. Settings are the planner's choice for this GPU (the
    demo: fp32 on the CPU, tiny model), with ``pins`` (``key=value``, :data:`BENCH_KEYS`) over them."""
    models = check_selection(methods, models, resolution, demo=demo, pins=pins)
    if demo:
        reqs = [
            pin_request(replace(demo_request(m), model=f, resolution=resolution or DEMO_RESOLUTION), pins)
            for f in models or ["sd15"]
            for m in methods or ["lora"]
        ]
        return Selection(requests=reqs, skipped=[], gpu=None)

    from sdplan import profiles

    profiles_ = profiles.load_profiles(local=store_root(store_dir))
    if (
        snapshot is None
    ):  # this machine: plan for the GPU torch will run on (CUDA_VISIBLE_DEVICES may reorder)
        import torch

        from sdplan.probe.snapshot import probe

        snapshot = probe(".")
        if gpu_name is None and torch.cuda.is_available():
            gpu_name = torch.cuda.get_device_name(torch.cuda.current_device())
    gpu_name = gpu_name or next((g.name for g in snapshot.usable_gpus if g.name), None)
    if snapshot.usable_gpus and gpu_name:  # plan for the GPU the bench runs on, alone
        gpu = next((g for g in snapshot.usable_gpus if g.name == gpu_name), snapshot.usable_gpus[0])
        snapshot = replace(snapshot, gpus=(gpu,), links=())
    gpu_memory_bytes = next((g.memory_total_bytes for g in snapshot.usable_gpus if g.name == gpu_name), None)
    explicit = bool(methods or models or pins)
    requests, skipped = [], []
    for family in models or list(DEFAULT_FAMILIES):
        spec = profiles_.unplanned_models.get(family) or profiles_.model(family)  # profile, planned or not
        res = resolution or spec.native_resolution
        if family in FLOW_FAMILIES:  # the leanest LoRA setting: the bench cannot run quantized bases or block
            requests += [
                flow_request(m, family, res) for m in methods or ["lora"]
            ]  # swap the planner may pick
            continue
        for method in methods or list(METHODS):
            if snapshot.usable_gpus:
                req = planner_settings(snapshot, profiles_, method, family, res)
            else:
                req = BenchRequest(method=method, model=family, resolution=res, settings_from="default")
            if not explicit and gpu_name:
                # measured at the settings the planner would choose (another pinned bench's points, or an out of
                # memory `sdplan train` recorded, left the planner's own settings unmeasured)
                have = [
                    p
                    for p in measured_here(profiles_, gpu_name, method, family, res, gpu_memory_bytes)
                    if not p.id.startswith("observed-") and _at_settings(p, req)
                ]
                if have:
                    skipped.append(
                        f"{method} {family} {res}px: {count_of(len(have), 'point')} measured on {gpu_name} "
                        "already at the planner's settings"
                    )
                    continue
            requests.append(req)
    uncatalogued = None
    if gpu_name and snapshot.usable_gpus and profiles_.gpu_or_none(gpu_name, gpu_memory_bytes) is None:
        # the planner finds a GPU's points by its catalog entry (Profiles.points_on): none, none are read
        uncatalogued = (
            f"{gpu_name} is not in sdplan's GPU catalog: the planner plans it by its memory alone and reads no "
            f"point measured on it until it is there (add it to {profiles.local_dir() / 'gpus.yaml'}, as the "
            f"entries of {profiles.shipped_dir() / 'gpus.yaml'} are written)"
        )
    return Selection(
        requests=[pin_request(r, pins) for r in requests],
        skipped=skipped,
        gpu=gpu_name,
        uncatalogued=uncatalogued,
    )


# -- the bench ------------------------------------------------------------------------------------------


def run_bench(
    requests: Iterable[BenchRequest],
    *,
    quick: bool = False,
    store_dir: str | Path | None = None,
    device: str = "auto",
    on_result: Callable[[BenchPoint], None] | None = None,
    demo: bool = False,
    on_status: Callable[[BenchRequest, str], None] | None = None,
    effort: Effort | None = None,
) -> list[BenchResult]:
    """Measure each request: search the largest micro-batch that fits, timing every probe point.

    Every point is written to the store (``store_dir``, default the local profile store) as soon as it is
    measured, then passed to ``on_result``. ``on_status(request, text)`` says what is being done (building
    the model, probing batch N). ``demo`` runs the tiny model on the CPU. ``KeyboardInterrupt`` propagates
    after the current model is released; everything measured before it is already in the store.
    """
    requests = list(requests)
    dev = resolve_device(device, demo=demo)
    if effort is None:
        effort = DEMO if demo else (QUICK if quick else FULL)
    injected = (
        faults.Faults.from_env()
    )  # test hooks, read once: a malformed value fails before anything heavy
    machine = describe_machine(dev)
    root = store_root(store_dir, demo=demo)
    for method in sorted(
        {r.method for r in requests}
    ):  # a store file we could not extend: fail before measuring
        _read_method_file(root / "methods" / f"{method}.yaml", method)
    results: list[BenchResult] = []

    def status(req: BenchRequest, text: str) -> None:
        if on_status is not None:
            on_status(req, text)

    for req in requests:
        if demo and req.model not in DEMO_FAMILIES:
            raise UsageError(DEMO_MODELS_ERROR, fix=DEMO_MODELS_FIX)
        result = BenchResult(request=req, batch_cap=effort.max_batch)
        results.append(result)
        status(req, "building the model")
        try:
            _measure(
                result,
                dev=dev,
                demo=demo,
                effort=effort,
                machine=machine,
                root=root,
                status=status,
                on_result=on_result,
                injected=injected,
            )
        except KeyboardInterrupt:
            result.bounded_by = "interrupted"
            result.max_batch = max((p.batch for p in result.points if p.fits), default=0)
            raise
    return results


def _measure(
    result: BenchResult,
    *,
    dev: str,
    demo: bool,
    effort: Effort,
    machine: Machine,
    root: Path,
    status: Callable[[BenchRequest, str], None],
    on_result: Callable[[BenchPoint], None] | None,
    injected: faults.Faults = faults.NONE,
) -> None:
    """Build one request's model, search its batch, write each point as it is measured (under DeepSpeed, each
    batch built and measured in a process of its own)."""
    import torch

    req = result.request
    free_memory()
    rss_base = rss_bytes()
    first = True

    def record(raw: dict[str, Any]) -> BenchPoint:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        point = BenchPoint(request=req, demo=demo, date=date, **raw)
        point = replace(point, point_id=point_id(machine, req, point.batch, demo=demo))
        path = write_points(root, req.method, [point_record(point, machine)])
        point = replace(point, store_file=path)
        result.points.append(point)
        if on_result is not None:
            on_result(point)
        return point

    if req.deepspeed:  # each batch in a process of its own (bench_harness.probe_in_process)

        def fits_alone(batch: int) -> bool:
            status(req, f"batch {batch} (a DeepSpeed process of its own)")
            return record(probe_in_process(req, batch, effort, device=dev, demo=demo)).fits

        result.max_batch, result.bounded_by = search_largest_batch(fits_alone, max_batch=effort.max_batch)
        return
    with tempfile.TemporaryDirectory(prefix="sdplan-bench-") as tmp, _quiet_diffusers():
        no_room = None
        try:
            harness = Harness(req, device=dev, demo=demo, workdir=Path(tmp), injected=injected, keep_vae=True)
        except torch.OutOfMemoryError as e:
            no_room = weights_oom_point(1, e)
        if no_room is not None:  # the weights alone do not fit: batch 1 cannot
            free_memory()
            record(no_room)
            result.max_batch, result.bounded_by = 0, "oom"
            return
        try:

            def fits(batch: int) -> bool:
                nonlocal first
                status(req, f"batch {batch}")
                # the first point also warms up what runs once (kernels, allocator, optimizer state)
                e = replace(effort, warmup_steps=effort.warmup_steps + 1) if first else effort
                first = False
                return record(probe_point(harness, batch, e, cuda=dev == "cuda", rss_base=rss_base)).fits

            result.max_batch, result.bounded_by = search_largest_batch(fits, max_batch=effort.max_batch)
            if dev == "cuda" and any(p.fits for p in result.points):
                status(req, "sample grid")
                try:
                    grid = sample_grid_peak(harness, Path(tmp))
                except Exception as e:  # an addition to the points already written: its failure loses none
                    status(
                        req, f"sample grid not measured ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                    )
                    grid = None
                if grid is not None:
                    record_sample_grid(result, grid, machine=machine, root=root)
        finally:
            harness.close()
    free_memory()


def record_sample_grid(result: BenchResult, grid_bytes: int, *, machine: Machine, root: Path) -> BenchPoint:
    """The request's largest fitting point again, with the sample grid's peak: written over its record (the same
    id) and in ``result.points``."""
    largest = max((p for p in result.points if p.fits), key=lambda p: p.batch)
    updated = replace(largest, sample_grid_peak_bytes=grid_bytes)
    path = write_points(root, result.request.method, [point_record(updated, machine)])
    updated = replace(updated, store_file=path)
    result.points[result.points.index(largest)] = updated
    return updated


def sample_grid_peak(harness: Harness, workdir: Path) -> int | None:
    """The allocated peak of the trainer's final sample grid (``Harness.sample_grid``: the VAE and, unless the
    family samples from cached text-encoder outputs, the text encoders back beside the training state), on a
    GPU; None where it runs out of memory (the trainer then skips the grid and keeps the weights)."""
    import torch

    free_memory()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out_of_memory = False
    try:
        harness.sample_grid(workdir / "sample-grid.png")
    except torch.OutOfMemoryError:
        out_of_memory = True
    if out_of_memory:  # outside the except block: its traceback no longer pins the grid's tensors
        free_memory()
        return None
    return int(torch.cuda.max_memory_allocated())


@contextlib.contextmanager
def _quiet_diffusers():
    """diffusers warns on every ``.to(dtype)`` of a freshly built model; the bench builds several."""
    try:
        from diffusers.utils import logging as dlog
    except ImportError:  # pragma: no cover
        yield
        return
    before = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        yield
    finally:
        dlog.set_verbosity(before)


# -- how each search ended ----------------------------------------------------------------------------


def search_ending(points: list[BenchPoint], *, cap: int, interrupted: bool) -> tuple[BenchPoint | None, str]:
    """How one request's batch search ended, from its points: (the largest batch that fitted, or None; what
    ended the search: "OOM at N", "search cap N", "interrupted", with "(simulated)" for the test hook's OOM)."""
    fit = [p for p in points if p.fits]
    oom = sorted(p.batch for p in points if not p.fits)
    best = max(fit, key=lambda p: p.batch) if fit else None
    largest = best.batch if best else 0
    if oom and oom[0] == largest + 1:
        limit = f"OOM at {oom[0]}"
    elif largest >= cap:
        limit = f"search cap {cap}"
    elif interrupted:
        limit = "interrupted" + (f" (OOM at {oom[0]})" if oom else "")
    else:
        limit = f"OOM at {oom[0]}" if oom else "-"
    if oom and any(p.simulated_oom for p in points if not p.fits):
        limit += " (simulated)"
    return best, limit


def summarise(
    requests: list[BenchRequest], points: list[BenchPoint], *, cap: int, interrupted: bool
) -> list[dict[str, Any]]:
    """One row per request measured (or started): the largest batch that fitted, its memory and speed, and
    what ended the search."""
    rows = []
    for req in requests:
        mine = [p for p in points if p.request == req]
        if not mine:
            continue
        best, limit = search_ending(mine, cap=cap, interrupted=interrupted)
        largest = best.batch if best else 0
        rows.append(
            {
                "request": req,
                "largest": largest,
                "memory": best.memory_bytes if best else None,
                "memory_label": best.memory_label if best else "",
                "it_s": best.it_s if best else None,
                "images_s": best.it_s * best.batch if best and best.it_s else None,
                "limit": limit,
                "points": len(mine),
            }
        )
    return rows


# -- sharing: `sdplan profiles export` --------------------------------------------------------------------


def _is_shareable(point: dict[str, Any]) -> bool:
    """Real measurements only: not the CPU demo, not an OOM simulated by the test hook."""
    source = str(point.get("source", ""))
    return not source.startswith(f"{MEASURED_PREFIX} --demo") and OOM_HOOK_ENV not in source


def _demo_points(n: int) -> str:
    """'1 demo or simulated point is', '3 demo or simulated points are'."""
    return f"{count_of(n, 'demo or simulated point')} {'is' if n == 1 else 'are'}"


def export_measurements(
    dest: str | Path, *, store_dir: str | Path | None = None, force: bool = False
) -> tuple[Path, int, int]:
    """Write the local store's measurements as one YAML file to share (and for the project to ship).

    The file holds, under ``methods:``, one complete method file per method (``schema_version``, ``method``,
    ``points``: the schema of ``profiles/methods/<method>.yaml``), so shipping it is copying those points.
    Demo points and simulated OOMs are left out. Refuses to overwrite ``dest`` unless ``force``.
    Returns (path, points written, points left out).
    """
    from sdplan import profiles, runfolder
    from sdplan.errors import OutputExistsError

    dest = Path(dest).expanduser()
    if dest.is_dir():  # first: --force cannot help
        raise UsageError(f"{dest} is a folder", fix="name a file, e.g. my-gpu.yaml")
    if dest.exists() and not force:
        raise OutputExistsError(f"{dest} already exists", fix="pass --force to overwrite it")
    root = store_root(store_dir, verb="read")
    files = sorted((root / "methods").glob("*.yaml"))
    methods: dict[str, dict[str, Any]] = {}
    left_out = 0
    for path in files:
        profiles.load_methods(path, origin="local")  # strict: never export a file the planner rejects
        data = profiles.read_yaml(path)
        keep = [p for p in data.get("points") or [] if _is_shareable(p)]
        left_out += len(data.get("points") or []) - len(keep)
        if not keep and not data.get("multi_gpu"):
            continue
        # one section per method: a method's bench points (lora.yaml) and what `sdplan train` observed
        # (observed-lora.yaml) both go in it (the second file read replaced the first's points)
        section = methods.setdefault(
            data["method"], {"schema_version": data["schema_version"], "method": data["method"], "points": []}
        )
        # a point in both files once (an export of this store imported back: its observed points went to
        # lora.yaml) is one point, not a duplicate id the export's own check refuses
        ids = {p.get("id") for p in section["points"]}
        section["points"] += [p for p in keep if p.get("id") not in ids]
        if data.get("multi_gpu"):
            section["multi_gpu"] = section.get("multi_gpu", []) + list(data["multi_gpu"])
    count = sum(len(s["points"]) for s in methods.values())
    if not methods:
        extra = f" ({_demo_points(left_out)} never exported)" if left_out else ""
        raise UsageError(
            f"no local measurements to export in {root}{extra}", fix="measure with `sdplan bench`"
        )
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = {
        "schema_version": 1,
        "kind": EXPORT_KIND,
        "exported": now,
        "sdplan_version": __version__,
        "methods": methods,
    }
    header = (
        "# Training measurements exported by `sdplan profiles export` (sdplan bench points; provenance in each\n"
        "# point's source and note). To use them on another machine: `sdplan profiles import THIS_FILE`. Each\n"
        "# entry under methods: is a complete profiles/methods/<method>.yaml body: to ship them in sdplan, append\n"
        "# its points to that file.\n"
    )
    # a missing folder is refused, as by `doctor --save` (a mistyped path made folders where none were wanted)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False, width=120), encoding="utf-8")
        load_export(tmp)  # what is written validates as it will be read, before it takes the name
        os.replace(tmp, dest)
    except OSError as e:
        raise runfolder.cannot_write(dest, e, fix="name a file in a folder you can write to") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return dest, count, left_out


def import_measurements(
    source: str | Path, *, store_dir: str | Path | None = None
) -> tuple[Path, dict[str, int], int]:
    """`sdplan profiles import FILE`: add an export file's points to the local store's method files (a point
    whose id is there already replaces it: importing twice adds nothing). The file is validated whole first,
    and each store file as it is written (a store file the planner rejects is never written over). Its
    multi-GPU observations are not imported (the store's files hold points). Demo points and simulated OOMs
    are left out, as export leaves them out (a file holding nothing else is refused). Returns (store,
    {method: points}, points left out)."""
    from sdplan import profiles

    source = Path(source).expanduser()
    if not source.is_file():
        raise UsageError(
            f"{source}: no such file" if not source.exists() else f"{source} is not a file",
            fix="name a file written by `sdplan profiles export`",
        )
    load_export(source)  # every section as the planner reads it, before anything is written
    root = store_root(store_dir)
    keep: dict[str, list[dict[str, Any]]] = {}
    left_out = 0
    for method, section in profiles.read_yaml(source)["methods"].items():
        points = list(section.get("points") or [])
        shareable = [p for p in points if _is_shareable(p)]
        left_out += len(points) - len(shareable)
        if shareable:
            keep[method] = shareable
    if not keep:
        extra = f" ({_demo_points(left_out)} never imported)" if left_out else ""
        raise UsageError(
            f"{source} holds no measurements to import{extra}",
            fix="import a file written by `sdplan profiles export` on a machine measured with `sdplan bench`",
        )
    added: dict[str, int] = {}
    for method, points in keep.items():
        write_points(root, method, points)
        added[method] = len(points)
    return root, added, left_out


def load_export(path: str | Path) -> dict[str, list[Any]]:
    """Read and validate an export file: {method: [MethodPoint, ...]}, each section checked by the planner's
    strict method-file loader."""
    from sdplan import profiles

    path = Path(path)
    data = profiles.read_yaml(path)
    errors = []
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["top level: must be a mapping"])
    if data.get("kind") != EXPORT_KIND:
        errors.append(f"kind: expected {EXPORT_KIND!r}, got {data.get('kind')!r}")
    if data.get("schema_version") != 1:
        errors.append(f"schema_version: expected 1, got {data.get('schema_version')!r}")
    unknown = set(data) - {"schema_version", "kind", "exported", "sdplan_version", "methods"}
    errors += [f"{k}: unknown key" for k in sorted(unknown)]
    methods = data.get("methods")
    if not isinstance(methods, dict) or not methods:
        errors.append("methods: must be a non-empty mapping of method -> method file")
        methods = {}
    if errors:
        raise ConfigError(str(path), errors)
    out: dict[str, list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sdplan-export-") as tmp:
        for method, section in methods.items():
            if not isinstance(section, dict) or section.get("method") != method:
                raise ConfigError(
                    str(path), [f"methods.{method}: must be a method file whose method is {method!r}"]
                )
            one = Path(tmp) / f"{method}.yaml"
            one.write_text(yaml.safe_dump(section, sort_keys=False), encoding="utf-8")
            try:
                points, _ = profiles.load_methods(one, origin="local")
            except ConfigError as e:
                raise ConfigError(f"{path} methods.{method}", e.errors) from None
            out[method] = points
    return out
