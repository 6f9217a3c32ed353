"""The bench's training harness: one request's recipe, built from random full-size (or tiny demo) networks
and stepped by the trainer's own loop pieces (``sdplan.trainer.loop``), and one timed probe point of it.

:mod:`sdplan.bench` decides what to measure, searches the batch and stores the points; this module measures.
torch, diffusers and the trainer are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdplan.errors import SdplanError, UsageError
from sdplan.extras import install_hint
from sdplan.trainer.faults import BENCH_OOM_ABOVE_BATCH_ENV

if TYPE_CHECKING:
    from collections.abc import Callable

    from sdplan.bench import BenchRequest, Effort

MAX_SKIPPED_STEPS = 24  # fp16 warm-up steps the gradient scaler may skip before the optimizer state exists


# -- memory meters --------------------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmRSS not in /proc/self/status")


class PeakRSS:
    """Peak resident set size of this process during a block. Linux resets the high-water mark when "5" is
    written to /proc/self/clear_refs (then VmHWM is the peak since); where that is refused, a thread samples
    VmRSS every 2 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm = False

    def __enter__(self) -> PeakRSS:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._hwm = True
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self.peak = rss_bytes()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        if self._hwm:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
        self.peak = max(self.peak, rss_bytes())


# -- the training harness: the recipes' setup and step, on random full-size (or tiny) networks ------------


def _synthetic_config(req: BenchRequest, device: str):
    from sdplan.config import TrainConfig
    from sdplan.registry import method

    cfg = TrainConfig()
    cfg.method = req.method
    cfg.training.learning_rate = method(req.method).learning_rate  # as validate() fills it
    cfg.model.family = req.model
    cfg.data.resolution = req.resolution
    cfg.training.precision = req.precision
    cfg.training.train_text_encoder = req.train_text_encoder
    cfg.training.device = device
    cfg.memory.gradient_checkpointing = req.gradient_checkpointing
    cfg.memory.optimizer = req.optimizer
    cfg.memory.cache_latents = req.cache_latents
    cfg.memory.cache_text_encoder_outputs = req.cache_text_encoder_outputs
    cfg.memory.set_grads_to_none = True
    cfg.model.base_precision = req.base_precision
    if req.lora_rank:
        cfg.lora.rank = req.lora_rank
        cfg.lora.alpha = float(req.lora_rank)
    return cfg


def _noise_scheduler(family: str):
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction" if family == "sd21" else "epsilon",
        # the released configs' values: the sample grid's scheduler is built from this config, and with
        # diffusers' defaults (0, True) its pipeline printed a FutureWarning on the user's terminal
        steps_offset=1,
        clip_sample=False,
    )


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_components(
    family: str,
    *,
    demo: bool,
    workdir: Path,
    device: str,
    dtypes: dict[str, Any] | None = None,
    with_vae: bool = True,
    denoiser_device: str | None = None,
    encoder_device: str | None = None,
):
    """``sdplan.trainer.models.Components`` with random weights: the full-size networks built from the
    configs in profiles/models, or the tiny demo model. The tokenizer is the tiny generated CLIP BPE one (its
    ids are valid for any CLIP vocabulary; nothing is downloaded).

    Full-size networks are created directly on ``device`` in their training dtype (``dtypes``: "unet",
    "text_encoder", "vae"; default fp32), so that building never needs more memory than training holds
    (an SDXL UNet is 10 GB in fp32, 5 GB in half precision). ``with_vae=False`` (cached latents) builds no VAE.
    ``denoiser_device`` / ``encoder_device``: where the UNet or transformer / the text encoders are built
    instead (the CPU: a base the recipe quantizes; cached text-encoder outputs, which the recipe encodes before
    it places the denoiser, as a run loads them there: trainer/loop.py Recipe.place_models).
    """
    import torch

    from sdplan.registry import FLOW_FAMILIES
    from sdplan.trainer import tiny
    from sdplan.trainer.models import Components

    if family in FLOW_FAMILIES:
        return _flow_components(
            family,
            demo=demo,
            workdir=workdir,
            device=device,
            dtypes=dtypes,
            with_vae=with_vae,
            denoiser_device=denoiser_device or device,
            encoder_device=encoder_device or device,
        )
    if demo:
        if family not in ("sd15", "sdxl"):
            raise UsageError(DEMO_MODELS_ERROR, fix=DEMO_MODELS_FIX)
        if family == "sd15":
            parts = tiny.tiny_sd15_components(workdir / "tokenizer")
        else:
            parts = tiny.tiny_sdxl_components(workdir / "tokenizers")
        second = ("_2",) if family == "sdxl" else ()
        return Components(
            family=family,
            unet=parts["unet"],
            vae=parts["vae"] if with_vae else None,
            text_encoders=[parts[f"text_encoder{i}"] for i in ("", *second)],
            tokenizers=[parts[f"tokenizer{i}"] for i in ("", *second)],
            noise_scheduler=parts["scheduler"],
            source="sdplan.trainer.tiny",
        )
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from sdplan import profiles

    dtypes = dtypes or {}
    spec = profiles.load_model(profiles.shipped_dir() / "models" / f"{family}.yaml")
    classes = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}
    torch.manual_seed(0)
    with torch.device(denoiser_device or device), _default_dtype(dtypes.get("unet", torch.float32)):
        unet = UNet2DConditionModel.from_config(dict(spec.unet))
    with torch.device(encoder_device or device), _default_dtype(dtypes.get("text_encoder", torch.float32)):
        encoders = [classes[te["class"]](CLIPTextConfig(**te["config"])) for te in spec.text_encoders]
    with torch.device(device):
        vae = None
        if with_vae:
            with _default_dtype(dtypes.get("vae", torch.float32)):
                vae = AutoencoderKL.from_config(dict(spec.vae))
    max_len = spec.tokenizer_max_length
    tokenizers = [
        tiny.tiny_tokenizer(workdir / f"tokenizer_{i}", max_length=max_len) for i in range(len(encoders))
    ]
    return Components(
        family=family,
        unet=unet,
        vae=vae,
        text_encoders=encoders,
        tokenizers=tokenizers,
        noise_scheduler=_noise_scheduler(family),
        source=f"profiles/models/{family}.yaml (random weights)",
    )


DEMO_MODELS_ERROR = "the demo's tiny models are SD 1.x-, SDXL-, SD3.5- and FLUX.1-shaped"
DEMO_MODELS_FIX = "use --model sd15, sdxl, sd35-medium, sd35-large, flux-dev or flux-schnell with --demo"


def _flow_components(
    family: str,
    *,
    demo: bool,
    workdir: Path,
    device: str,
    dtypes,
    with_vae: bool,
    denoiser_device: str,
    encoder_device: str,
):
    """SD3.5 / FLUX.1 components (``flow_models.FlowComponents``, the transformer in the denoiser slot):
    the tiny models of ``sdplan.trainer.tiny`` for the demo, else the transformer, CLIP/T5 encoders and
    16-channel VAE built from profiles/models/<family>.yaml with random weights on ``device``."""
    import torch

    from sdplan import registry
    from sdplan.trainer import tiny
    from sdplan.trainer.flow import FlowAdapter
    from sdplan.trainer.flow_models import FlowComponents

    arch = registry.family(family).arch
    if demo:
        if arch == "flux":
            parts = tiny.tiny_flux_components(workdir / "tokenizer", guidance=family == "flux-dev")
            tes, toks = ["text_encoder", "text_encoder_2"], ["tokenizer", "tokenizer_2"]
        else:
            parts = tiny.tiny_sd35_components(workdir / "tokenizer", large=family == "sd35-large")
            tes = ["text_encoder", "text_encoder_2", "text_encoder_3"]
            toks = ["tokenizer", "tokenizer_2", "tokenizer_3"]
        scheduler = parts["scheduler"]
        return FlowComponents(
            family=family,
            unet=parts["transformer"],
            vae=parts["vae"] if with_vae else None,
            text_encoders=[parts[t] for t in tes],
            tokenizers=[parts[t] for t in toks],
            noise_scheduler=scheduler,
            scheduler_config=dict(scheduler.config),
            source="sdplan.trainer.tiny",
            adapter=FlowAdapter(family),
        )
    import diffusers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    from sdplan import profiles

    dtypes = dtypes or {}
    spec = profiles.load_model(profiles.shipped_dir() / "models" / f"{family}.yaml")
    classes = {
        "CLIPTextModel": (CLIPTextModel, CLIPTextConfig),
        "CLIPTextModelWithProjection": (CLIPTextModelWithProjection, CLIPTextConfig),
        "T5EncoderModel": (T5EncoderModel, T5Config),
    }
    torch.manual_seed(0)
    with torch.device(denoiser_device), _default_dtype(dtypes.get("unet", torch.float32)):
        transformer = getattr(diffusers, spec.transformer_class).from_config(dict(spec.transformer))
    with torch.device(encoder_device), _default_dtype(dtypes.get("text_encoder", torch.float32)):
        encoders = []
        for te in spec.text_encoders:
            model_cls, config_cls = classes[te["class"]]
            encoders.append(model_cls(config_cls(**te["config"])))
    with torch.device(device):
        vae = None
        if with_vae:
            with _default_dtype(dtypes.get("vae", torch.float32)):
                vae = diffusers.AutoencoderKL.from_config(dict(spec.vae))
    tokenizers = []  # generated tokenizers: their ids are valid for the real vocabularies; nothing downloaded
    for i, te in enumerate(spec.text_encoders):
        if te["class"] == "T5EncoderModel":
            # the family's T5 length, as the trainer cuts it (flow_models.load_flow_components)
            tokenizers.append(tiny.tiny_t5_tokenizer(max_length=registry.family(family).t5_max_length))
        else:
            tokenizers.append(tiny.tiny_tokenizer(workdir / f"tokenizer_{i}", max_length=te["max_length"]))
    scheduler = getattr(diffusers, spec.scheduler["class"]).from_config(dict(spec.scheduler["config"]))
    return FlowComponents(
        family=family,
        unet=transformer,
        vae=vae,
        text_encoders=encoders,
        tokenizers=tokenizers,
        noise_scheduler=scheduler,
        scheduler_config=dict(scheduler.config),
        source=f"profiles/models/{family}.yaml (random weights)",
        adapter=FlowAdapter(family),
    )


class Harness:
    """One request's recipe (``sdplan.trainer.recipes``), built and prepared by the trainer's own loop pieces
    on random full-size (or tiny) networks; :meth:`step` is one optimizer step of the loop
    (``loop.optimizer_step``) on a synthetic batch."""

    CAPTION = "a photo of sks person"

    def __init__(
        self,
        req: BenchRequest,
        *,
        device: str,
        demo: bool,
        workdir: Path,
        injected=None,
        keep_vae: bool = False,
        deepspeed: dict | None = None,
    ):
        """``keep_vae``: build the VAE with cached latents too, off the GPU as the trainer leaves it once the
        latents are cached, for the sample grid (:meth:`sample_grid`). ``deepspeed``: ``{"zero_stage",
        "offload_optimizer", "micro_batch"}``, the trainer's DeepSpeed in this one process (accelerate's plugin,
        as ``runtime.make_accelerator`` builds it; the process group from RANK / WORLD_SIZE / MASTER_* in the
        environment, set by the caller). DeepSpeed fixes the micro-batch when it is prepared (the trainer's
        data loader gives it): :meth:`step` then runs that batch only."""
        from sdplan.registry import FLOW_FAMILIES
        from sdplan.trainer import faults, flow, latents, loop, run, runtime

        self.req = req
        self.faults = injected or faults.NONE
        self.cfg = cfg = _synthetic_config(req, device)
        if deepspeed is not None:
            from sdplan.config import DeepSpeedConfig

            ds = dict(deepspeed)
            # DeepSpeed's config states the micro-batch, and checks it
            cfg.training.batch_size = int(ds.pop("micro_batch", 1))
            cfg.distributed.deepspeed = DeepSpeedConfig(**ds)
        _reset_accelerate_state()
        self.accelerator = accelerator = runtime.make_accelerator(cfg, workdir)
        self.device = accelerator.device
        recipe_cls = run.recipe(req.method)
        comps = build_components(
            req.model,
            demo=demo,
            workdir=workdir,
            device=str(self.device),
            dtypes=recipe_cls.dtypes(cfg, accelerator),  # built in the dtypes the recipe trains them in
            with_vae=keep_vae or not req.cache_latents,
            # a quantized base: built in host RAM, then stored quantized on the GPU layer by layer by the
            # recipe (quantize.quantize_base), as the trainer loads it: never the whole bf16 base on the GPU
            denoiser_device="cpu" if req.base_precision != "bf16" or req.cache_text_encoder_outputs else None,
            # cached outputs: the encoders and the denoiser in host RAM, as a run loads them, so setup encodes the
            # captions with the encoders alone on the GPU (a bf16 T5 beside a bf16 FLUX.1 was an OOM point a run
            # would not hit) and an fp8 base stores the encoders in fp8 before they reach it
            encoder_device="cpu" if req.cache_text_encoder_outputs else None,
        )
        self.comps = comps
        self.recipe = recipe = recipe_cls(cfg, accelerator, comps)
        if req.cache_text_encoder_outputs:  # encoded in setup before the denoiser is placed, as a run's are
            recipe.bench_captions = {self.CAPTION}
            if (
                comps.family in FLOW_FAMILIES
            ):  # the grid samples from the cache (SD3.5: its empty negative too)
                recipe.bench_captions |= flow.sampling_captions(comps.family, [self.CAPTION])
        groups, optimizer = loop.build(recipe)
        if req.cache_latents:  # cached latents: what the latent cache hands the recipe
            recipe.latents = lambda batch, generator: batch["latents"].to(self.device)
        (self.optimizer,) = loop.prepare(recipe, optimizer)
        # the VAE kept for the sample grid leaves the GPU, as the trainer's does once the latents are cached
        if req.cache_latents and comps.vae is not None:
            latents.offload(comps.vae)
        self.step_index = 0

    @property
    def unet(self):
        return self.recipe.unet

    @property
    def text_encoders(self) -> list:
        return self.recipe.text_encoders

    def _batch(self, batch_size: int, generator) -> dict[str, Any]:
        import torch

        res = self.req.resolution
        batch: dict[str, Any] = {
            "caption": [self.CAPTION] * batch_size,
            "original_size": torch.tensor([(res, res)] * batch_size),
            "crop_top_left": torch.tensor([(0, 0)] * batch_size),
        }
        if self.req.cache_latents:
            from sdplan import registry

            f, channels = 8, 16 if registry.family(self.req.model).flow else 4  # SD3.5/FLUX: 16-channel VAE
            batch["latents"] = torch.randn((batch_size, channels, res // f, res // f), generator=generator)
            batch["pixel_values"] = torch.empty((batch_size, 3, res, res), device="meta")  # shape only
        else:
            batch["pixel_values"] = torch.rand((batch_size, 3, res, res), generator=generator) * 2 - 1
        return batch

    def step(self, batch_size: int) -> float:
        """One optimizer step of the training loop at ``batch_size``; returns the loss."""
        from sdplan.trainer import loop, runtime

        self.step_index += 1
        generator = runtime.seed_step(self.cfg.training.seed, self.accelerator.process_index, self.step_index)

        def on_forward(loss, batch):
            if self.faults.bench_oom(batch_size):
                import torch

                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (simulated by {BENCH_OOM_ABOVE_BATCH_ENV}={self.faults.bench_oom_above_batch} "
                    f"at batch {batch_size})"
                )
            return loss

        batch = self._batch(batch_size, generator)
        loss = loop.optimizer_step(
            self.recipe, self.optimizer, batch, generator, micro=0, on_forward=on_forward
        )
        return float(loss.detach().item())

    def sample_grid(self, out_path: Path, *, steps: int = 2) -> Path | None:
        """The trainer's final sample grid (trainer/outputs.py ``samples``: the VAE and, unless their outputs are
        cached for a transformer family, the text encoders come back beside the training state) of the recipe's
        own prompt at the training resolution, ``steps`` denoising steps (the peak does not grow with them)."""
        from sdplan.trainer import outputs

        self.cfg.sampling.num_inference_steps = steps
        return outputs.samples(
            self.accelerator,
            self.comps,
            self.recipe.unet,
            self.recipe.text_encoders,
            self.cfg,
            fallback=self.CAPTION,  # encoded with the captions where their outputs are cached
            at_step=self.step_index,
            out_path=out_path,
            text_cache=self.recipe.text_cache,
            measuring=True,  # a failed grid raises (bench: "sample grid not measured"), no peak is recorded
        )

    def optimizer_has_state(self) -> bool:
        """True once an optimizer step has really run (its state, e.g. Adam's moments, is allocated). Under
        fp16 the gradient scaler skips the first steps while it lowers its scale: no state yet."""
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return bool(getattr(inner, "state", None))

    def after_oom(self) -> None:
        end_failed_step(self.optimizer, self.accelerator.scaler)
        free_memory()

    def close(self) -> None:
        for name in ("recipe", "optimizer"):
            if hasattr(self, name):
                delattr(self, name)
        with contextlib.suppress(Exception):
            self.accelerator.free_memory()
        free_memory()


def end_failed_step(optimizer, scaler) -> None:
    """After an out-of-memory error anywhere in a step, leave the optimizer and the fp16 gradient scaler
    (``accelerator.scaler``, None without fp16 on a GPU) as a finished step does, for the next probe point.

    The gradients go (``set_to_none``: their memory is freed). A step that failed after its gradients were
    unscaled (in ``clip_grad_norm_``, or in the optimizer step itself, e.g. Adam allocating its state) never
    reached ``scaler.update()``: the scaler still marks this optimizer as unscaled, and the next step's
    ``unscale_`` would raise "unscale_() has already been called on this optimizer since the last update()".
    ``update()`` ends that step as a skipped one (it needs the inf checks the unscale recorded; a step that
    failed before unscaling left nothing to end)."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is None or not scaler.is_enabled():
        return
    states = getattr(scaler, "_per_optimizer_states", {})  # torch has no public "step in progress" query
    if any(state.get("found_inf_per_device") for state in states.values()):
        scaler.update()


def _reset_accelerate_state() -> None:
    """accelerate keeps process-wide state (mixed precision among it): each request sets its own."""
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:  # pragma: no cover - older accelerate: the next Accelerator re-initialises
        pass


def free_memory() -> None:
    """Release what the last model held: Python objects, torch's CUDA cache, and (glibc) freed heap pages,
    so that a CPU run's resident-set baseline is not the previous model's high-water mark."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


# -- one probe point ------------------------------------------------------------------------------------


def timed_steps(step: Callable[[], Any], effort: Effort, *, cuda: bool) -> list[float]:
    """Seconds of each call of ``step`` (synchronised on a GPU): at least ``effort.timed_steps`` of them, and
    more until ``effort.min_timed_seconds`` have passed (at most ``effort.max_timed_steps``)."""
    import torch

    seconds: list[float] = []
    while len(seconds) < effort.timed_steps or (
        sum(seconds) < effort.min_timed_seconds and len(seconds) < effort.max_timed_steps
    ):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return seconds


def oom_line(e: BaseException) -> str:
    """An out-of-memory error's first line, as a bench point records it."""
    return (str(e).strip().splitlines() or ["out of memory"])[0][:300]


def weights_oom_point(batch: int, e: BaseException) -> dict[str, Any]:
    """The probe point at ``batch`` where building the harness ran out of memory: the weights alone do not fit.
    (A dict of strings: called in the except block, it keeps nothing of the traceback's tensors.)"""
    return {"batch": batch, "fits": False, "error": f"out of memory placing the weights: {oom_line(e)}"}


def probe_point(h: Harness, batch: int, effort: Effort, *, cuda: bool, rss_base: int) -> dict[str, Any]:
    """Warm up, then time ``effort.timed_steps`` steps at ``batch``; peak memory over all of them."""
    import torch

    out: dict[str, Any] = {"batch": batch, "warmup_steps": effort.warmup_steps, "steps": effort.timed_steps}
    error: str | None = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    meter = PeakRSS() if not cuda else None
    try:
        if meter is not None:
            meter.__enter__()
        try:
            for _ in range(effort.warmup_steps):
                h.step(batch)
            for _ in range(MAX_SKIPPED_STEPS):  # fp16: the measured window must hold the optimizer state
                if h.optimizer_has_state():
                    break
                h.step(batch)
            step_seconds = timed_steps(lambda: h.step(batch), effort, cuda=cuda)
        finally:
            if meter is not None:
                meter.__exit__(None, None, None)
    except torch.OutOfMemoryError as e:
        error = oom_line(e)
    if error is not None:  # outside the except block: its traceback no longer pins the activations
        h.after_oom()
        out |= {
            "fits": False,
            "error": error,
            "simulated_oom": h.faults.bench_oom(batch),
        }
        return out
    out["fits"] = True
    out["steps"] = len(step_seconds)
    median = statistics.median(step_seconds)
    out["it_s"] = 1.0 / median if median > 0 else None
    if cuda:
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    else:
        out["peak_rss_delta_bytes"] = max(0, meter.peak - rss_base)
    return out


# -- the host: DeepSpeed's CPU Adam ---------------------------------------------------------------------------


def cpu_adam_rate(params: int, steps: int, optimizer: str = "deepspeed") -> float:
    """Parameters one optimizer step updates per second on this host's CPU, median of ``steps`` timed steps
    after one that allocates the moments: DeepSpeed's CPU Adam (AdamW mode: what ZeRO-2 optimizer offload runs
    once per optimizer step), or ``optimizer="torch"``: torch's AdamW (foreach), for comparison. One flat fp32
    parameter of ``params`` elements with a gradient (16 bytes each, with the two moments)."""
    import torch

    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    if optimizer == "deepspeed":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        except ImportError as e:
            raise UsageError(
                "measuring the CPU Adam rate needs DeepSpeed", fix=install_hint("deepspeed")
            ) from e
        opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    else:
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    opt.step()  # allocates the moments
    seconds = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t)
    return params / statistics.median(seconds)


# -- a probe point in a process of its own: DeepSpeed -----------------------------------------------------------

RESULT_PREFIX = "sdplan-bench-probe: "  # the child's one result line on stdout (DeepSpeed logs there too)


def probe_in_process(
    req: BenchRequest, batch: int, effort: Effort, *, device: str, demo: bool
) -> dict[str, Any]:
    """:func:`probe_point` of a DeepSpeed request, in a new process (``python -m sdplan.bench_harness``): DeepSpeed's
    engine fixes the micro-batch when it is prepared, and its process group lives as long as the process, so each
    batch the search tries gets a process of its own, one rank of a one-process world (RANK / WORLD_SIZE /
    MASTER_*, as benchmarks/deepspeed_memory.py measured the H100's points; the CPU through DeepSpeed's CPU
    accelerator). Every probe in it is the process's first: one more warm-up step than ``effort`` (kernels,
    allocator, optimizer state). Returns probe_point's dict; a process that ends without one raises
    :class:`BenchProbeError` with its last line."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys

    from sdplan.launch import one_process_world

    env = {**os.environ, **one_process_world(device == "cpu")}
    job = {
        "request": dataclasses.asdict(req),
        "batch": batch,
        "effort": dataclasses.asdict(dataclasses.replace(effort, warmup_steps=effort.warmup_steps + 1)),
        "device": device,
        "demo": demo,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sdplan.bench_harness", json.dumps(job)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not results:
        lines = [line for line in (proc.stderr + proc.stdout).strip().splitlines() if line.strip()]
        raise BenchProbeError(
            f"the DeepSpeed probe of batch {batch} ended without a result (exit {proc.returncode}): "
            f"{(lines or ['no output'])[-1][:300]}",
            fix="check that `python -c 'import deepspeed'` works here, then run the bench again",
        )
    return json.loads(results[-1][len(RESULT_PREFIX) :])


class BenchProbeError(SdplanError):
    """A probe process that ended without its result (not an out-of-memory: that is a measurement)."""


def _probe_main(job_json: str) -> None:
    """The child of :func:`probe_in_process`: build the request's harness under DeepSpeed at the job's micro-batch,
    run one probe point, print its dict on one :data:`RESULT_PREFIX` line."""
    import json
    import tempfile

    import torch

    from sdplan.bench import BenchRequest, Effort
    from sdplan.trainer import faults

    job = json.loads(job_json)
    req, batch = BenchRequest(**job["request"]), int(job["batch"])
    effort, device = Effort(**job["effort"]), job["device"]
    free_memory()
    rss_base = rss_bytes()
    out = None
    with tempfile.TemporaryDirectory(prefix="sdplan-bench-") as tmp:
        try:
            harness = Harness(
                req,
                device=device,
                demo=job["demo"],
                workdir=Path(tmp),
                injected=faults.Faults.from_env(),
                deepspeed={**req.deepspeed, "micro_batch": batch},
            )
        except torch.OutOfMemoryError as e:
            out = weights_oom_point(batch, e)
        if out is None:
            try:
                out = probe_point(harness, batch, effort, cuda=device == "cuda", rss_base=rss_base)
            finally:
                harness.close()
    print(RESULT_PREFIX + json.dumps(out), flush=True)


if __name__ == "__main__":
    import sys

    _probe_main(sys.argv[1])
