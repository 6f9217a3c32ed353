"""What every recipe shares: the Accelerator, optimizer and schedule, step arithmetic, prompt encoding, the
noise/loss maths, the progress bar, stop signals, failure reports and run_summary.json.

Recipes stay readable by calling these small functions in their own loop; nothing here owns the loop.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdplan.errors import SdplanError

# Exit codes the launcher (`sdplan train`) acts on.
EXIT_INTERRUPTED = 130
EXIT_OOM = 75


class TrainingInterrupted(SdplanError):
    """SIGINT/SIGTERM: the current step finished and a checkpoint was written."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, step: int, checkpoint: Path | None):
        self.step = step
        self.checkpoint = checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step had finished)"
        super().__init__(
            f"interrupted at step {step}; {where}",
            fix="continue with --resume latest" if checkpoint else None,
        )


class OutOfMemoryStop(SdplanError):
    """CUDA ran out of memory; ``{out}/oom.json`` says where, so the launcher can retry smaller."""

    exit_code = EXIT_OOM

    def __init__(self, step: int, report: Path, message: str):
        self.step = step
        self.report = report
        super().__init__(
            f"out of GPU memory at step {step} ({message.splitlines()[0] if message else 'OOM'}); "
            f"details in {report}",
            fix="lower training.batch_size (raise training.grad_accum to keep the effective batch), "
            "or turn on memory.gradient_checkpointing",
        )


class NonFiniteLoss(SdplanError):
    """The loss became NaN or inf; training stopped before the update that would have spread it."""

    exit_code = 1


# -- environment --------------------------------------------------------------------------------------


def use_cpu(cfg) -> bool:
    """CPU when ``training.device`` is cpu, or auto without CUDA; cuda without CUDA is an error."""
    import torch

    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        from sdplan.errors import NoGPUError

        raise NoGPUError(
            "training.device is cuda but torch sees no CUDA GPU",
            fix="check the driver (sdplan doctor), or set training.device=cpu",
        )
    return cfg.training.device == "cpu" or not torch.cuda.is_available()


def mixed_precision_for(cfg, cpu: bool) -> str:
    """accelerate's mixed_precision value. fp16 autocast is a GPU feature: on CPU it trains in fp32."""
    p = cfg.training.precision
    if p == "fp32":
        return "no"
    if p == "fp16" and cpu:
        return "no"
    return p


def make_accelerator(cfg, out_dir: Path):
    """An Accelerator for this config: precision, grad accumulation, CPU when asked or without CUDA.

    ``rng_types=[]``: the data order comes from our epoch-seeded samplers and the noise from per-step seeds,
    so accelerate need not synchronise generators (that would make resume depend on its internals).
    The LR scheduler is stepped by the recipe once per optimizer step (not prepared), so its total and
    warmup steps are the multi-process ones that ``plan_steps`` computes.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cpu = use_cpu(cfg)
    kwargs: dict[str, Any] = {}
    ds = cfg.distributed.deepspeed
    launched_with_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if ds is not None and not launched_with_ds:
        try:
            import deepspeed  # noqa: F401
            from accelerate.utils import DeepSpeedPlugin
        except ImportError as e:
            raise SdplanError(
                "distributed.deepspeed is set but DeepSpeed is not installed",
                fix="pip install 'sdplan[deepspeed]' or remove distributed.deepspeed",
            ) from e
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=ds.zero_stage,
            offload_optimizer_device="cpu" if ds.offload_optimizer else "none",
            gradient_accumulation_steps=cfg.training.grad_accum,
            gradient_clipping=cfg.training.max_grad_norm or None,
        )
    from accelerate.utils import DistributedDataParallelKwargs

    # Gradients as views into DDP's all-reduce buckets: no second copy of the gradients (the planner counts
    # none; kohya's --ddp_gradient_as_bucket_view). SDXL conditions on the first encoder's penultimate
    # layer: its last layer (and any adapter there) gets no gradient, which DDP must be told about.
    kwargs["kwargs_handlers"] = [
        DistributedDataParallelKwargs(
            gradient_as_bucket_view=True, find_unused_parameters=cfg.training.train_text_encoder
        )
    ]
    if cpu and cfg.training.precision == "fp16" and os.environ.get("RANK", "0") == "0":
        print("training.precision fp16 needs a GPU; training in fp32 on the CPU", flush=True)
    if ds is not None or launched_with_ds:
        # accelerate ignores DeepSpeed when cpu=True; on a CPU-only machine DeepSpeed runs on its CPU
        # accelerator (DS_ACCELERATOR=cpu), which the launcher sets.
        cpu = False
    return Accelerator(
        mixed_precision=mixed_precision_for(cfg, cpu),
        gradient_accumulation_steps=cfg.training.grad_accum,
        cpu=cpu,
        rng_types=[],
        step_scheduler_with_optimizer=False,
        project_config=ProjectConfiguration(
            project_dir=str(out_dir), logging_dir=str(Path(out_dir) / "logs")
        ),
        **kwargs,
    )


def check_deepspeed(accelerator, trained: dict) -> None:
    """accelerate's DeepSpeed integration trains one model: say so before prepare() fails obscurely."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED and len(trained) > 1:
        raise SdplanError(
            f"DeepSpeed trains one model, this run trains {len(trained)} ({', '.join(trained)})",
            fix="set training.train_text_encoder=false (textual inversion on SDXL: without DeepSpeed), "
            "or remove distributed.deepspeed",
        )


def weight_dtype(accelerator):
    """dtype for frozen weights: half precision under fp16/bf16 mixed precision, else fp32."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def add_lora_adapters(unet, text_encoders, lcfg, train_text_encoder: bool) -> dict:
    """peft LoRA adapters on the UNet and, when asked, on each text encoder. The adapters train in fp32
    whatever the base weights are. Returns ``{name: model}`` of what trains (``unet``, ``text_encoder_i``)."""
    from peft import LoraConfig

    def adapter(targets):
        return LoraConfig(
            r=lcfg.rank,
            lora_alpha=lcfg.alpha,
            lora_dropout=lcfg.dropout,
            init_lora_weights="gaussian",
            target_modules=targets,
        )

    unet.add_adapter(adapter(lcfg.target_modules))
    trained = {"unet": unet}
    if train_text_encoder:
        for i, te in enumerate(text_encoders):
            te.add_adapter(adapter(lcfg.text_encoder_target_modules))
            trained[f"text_encoder_{i}"] = te
    for m in trained.values():
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return trained


def trained_dtype(cfg, accelerator):
    """dtype of the weights a full-weight recipe trains: fp32 master weights under mixed precision, or bf16
    with ``training.full_half_weights`` (kohya --full_bf16: half the weight and gradient memory)."""
    import torch

    if cfg.training.full_half_weights and accelerator.mixed_precision == "bf16":
        return torch.bfloat16
    return torch.float32


def vae_dtype(accelerator):
    """The SD/SDXL VAE overflows to NaN in fp16: keep it in fp32 then (bf16 is safe)."""
    import torch

    return torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32


def place(model, device, dtype) -> None:
    """Move ``model`` to ``device`` and cast it to ``dtype`` only when it is in another one (diffusers warns
    on every dtype cast, even a no-op)."""
    model.to(device)
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    if current != dtype:
        model.to(dtype=dtype)


def use_sdpa(*models) -> None:
    """PyTorch scaled-dot-product attention (flash / memory-efficient kernels on GPU)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    for m in models:
        if hasattr(m, "set_attn_processor"):
            m.set_attn_processor(AttnProcessor2_0())


def enable_gradient_checkpointing(*models) -> None:
    """Recompute activations in the backward pass: diffusers models and transformers text encoders (the
    non-reentrant variant, so adapters inside frozen layers still get gradients)."""
    for m in models:
        m = getattr(m, "module", m)  # DDP-wrapped
        if hasattr(m, "enable_gradient_checkpointing"):  # diffusers
            m.enable_gradient_checkpointing()
        elif hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older transformers
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(getattr(m, "config", None), "use_cache"):
            m.config.use_cache = False


def seed_step(seed: int, process_index: int, step: int):
    """Seed everything random in one optimizer step from (seed, process, step) and return the generator
    for noise, timesteps and VAE sampling. A resumed run redraws exactly what the uninterrupted one drew,
    and each process draws its own noise."""
    import torch

    value = (seed * 1_000_003 + process_index * 7919 + step) % (2**63 - 1)
    torch.manual_seed(value)  # dropout and anything else on the global generator
    return torch.Generator("cpu").manual_seed(value)


# -- step arithmetic ----------------------------------------------------------------------------------


def steps_per_epoch(num_items: int, batch_size: int, grad_accum: int, num_processes: int) -> int:
    """Optimizer steps per epoch when each epoch is split ``num_processes`` ways (the planner's formula)."""
    return max(1, math.ceil(num_items / (batch_size * grad_accum * num_processes)))


@dataclass(frozen=True)
class StepPlan:
    num_processes: int
    batches_per_epoch: int  # micro-batches each process draws per epoch
    steps_per_epoch: int  # optimizer steps per epoch (each process)
    max_steps: int  # optimizer steps of the whole run (each process)
    epochs: int
    warmup_steps: int


def plan_steps(
    *,
    batches_per_epoch: int,
    grad_accum: int,
    epochs: int,
    max_steps: int | None,
    warmup_steps: int,
    num_processes: int,
) -> StepPlan:
    """Optimizer steps for this run. ``batches_per_epoch`` is per process (the sharded dataloader's length).

    ``training.max_steps`` and ``training.lr_warmup_steps`` are one-process counts, like the planner's: with N
    processes each step trains N micro-batches, so both are divided by N (rounded up) and the images trained
    stay those of the one-process run.
    """
    spe = max(1, math.ceil(batches_per_epoch / grad_accum))
    if max_steps:
        total = max(1, math.ceil(max_steps / num_processes))
        epochs = math.ceil(total / spe)
    else:
        total = epochs * spe
    warm = min(total, math.ceil(warmup_steps / num_processes))
    return StepPlan(num_processes, batches_per_epoch, spe, total, epochs, warm)


def describe_plan(method: str, family: str, samples: int, cfg, plan: StepPlan) -> str:
    t = cfg.training
    return (
        f"{method} {family}: {samples} samples/epoch, batch {t.batch_size} x accum {t.grad_accum} x "
        f"{plan.num_processes} process(es) -> {plan.steps_per_epoch} steps/epoch, {plan.max_steps} steps "
        f"({plan.epochs} epoch{'s' if plan.epochs != 1 else ''}), warmup {plan.warmup_steps}"
    )


# -- data loading -------------------------------------------------------------------------------------


class EpochBatches:
    """The epoch-seeded BucketBatchSampler, shown to accelerate without a ``batch_size`` attribute so that
    its sharding treats batches as lists of any length (bucket batches can be short mid-epoch; with a
    batch_size, accelerate would drop a round whose last batch is short)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def make_loader(dataset, cfg, device):
    """(DataLoader, EpochBatches): batches of ``training.batch_size`` from one bucket each, in an order that
    depends only on (seed, epoch). Pass the loader to ``accelerator.prepare`` to shard it over processes."""
    import torch

    from .buckets import BucketBatchSampler
    from .data import collate

    batches = EpochBatches(
        BucketBatchSampler.for_dataset(dataset, cfg.training.batch_size, seed=cfg.training.seed)
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )
    return loader, batches


# -- optimizer and schedule ---------------------------------------------------------------------------


def make_optimizer(param_groups: list[dict[str, Any]], cfg):
    """AdamW, 8-bit AdamW (bitsandbytes) or Adafactor over ``param_groups`` (each with its own ``lr``)."""
    import torch

    name = cfg.memory.optimizer
    lr = cfg.training.learning_rate
    if name == "adamw":
        return torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise SdplanError(
                "memory.optimizer: adamw8bit needs bitsandbytes, which is not installed",
                fix="pip install 'sdplan[bnb]', or set memory.optimizer=adamw",
            ) from e
        return bnb.optim.AdamW8bit(param_groups, lr=lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(param_groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise SdplanError(f"memory.optimizer: unknown optimizer {name!r}")


def make_lr_scheduler(optimizer, cfg, plan: StepPlan):
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.training.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=plan.warmup_steps,
        num_training_steps=plan.max_steps,
    )


# -- prompts ------------------------------------------------------------------------------------------


def tokenize(tokenizers: list, captions: list[str]) -> list:
    return [
        tok(
            captions,
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        for tok in tokenizers
    ]


def encode_prompts(text_encoders: list, input_ids: list, family: str, device):
    """(prompt_embeds, pooled). SD 1.x/2.x: last hidden state, no pooled. SDXL: both encoders' penultimate
    hidden states concatenated, pooled (projected) output of the second."""
    import torch

    if family != "sdxl":
        return text_encoders[0](input_ids[0].to(device))[0], None
    embeds, pooled = [], None
    for te, ids in zip(text_encoders, input_ids):
        out = te(ids.to(device), output_hidden_states=True)
        pooled = out[0]
        embeds.append(out.hidden_states[-2])
    return torch.cat(embeds, dim=-1), pooled


def add_time_ids(batch: dict, device, dtype):
    """SDXL micro-conditioning per sample: original (h, w), crop (top, left), target (h, w)."""
    import torch

    target = tuple(batch["pixel_values"].shape[-2:])
    rows = []
    for orig, crop in zip(batch["original_size"], batch["crop_top_left"]):
        rows.append([int(orig[0]), int(orig[1]), int(crop[0]), int(crop[1]), int(target[0]), int(target[1])])
    return torch.tensor(rows, device=device, dtype=dtype)


def unet_conditioning(components, batch: dict, text_encoders: list, device, dtype, text_cache=None):
    """encoder_hidden_states and added_cond_kwargs for one batch (from the text cache when there is one)."""
    if text_cache is not None:
        embeds, pooled = text_cache.lookup(list(batch["caption"]), device, dtype)
    else:
        ids = tokenize(components.tokenizers, list(batch["caption"]))
        embeds, pooled = encode_prompts(text_encoders, ids, components.family, device)
    embeds = embeds.to(device, dtype)
    if components.family != "sdxl":
        return embeds, None
    added = {"text_embeds": pooled.to(device, dtype), "time_ids": add_time_ids(batch, device, dtype)}
    return embeds, added


# -- noise, target and loss ---------------------------------------------------------------------------


def encode_latents(vae, pixel_values, generator, cache=None):
    """Pixels in [-1, 1] -> scaled latents, sampled from the VAE posterior with ``generator``.

    With a ``LatentCache`` the posterior (mean and log-variance, ``latent_dist.parameters``) comes from the
    cache and only the sampling happens here, so a cached run draws the same latents as an uncached one.
    """
    import torch
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    with torch.no_grad():
        if cache is not None:
            params = cache.get_or_encode_batch(pixel_values, lambda px: posterior(vae, px))
        else:
            params = posterior(vae, pixel_values)
        latents = DiagonalGaussianDistribution(params).sample(generator=generator)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return (latents - shift) * vae.config.scaling_factor


def vae_scale(vae) -> int:
    """Pixels per latent side: the VAE halves the size in every block but the last (8 for SD)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def posterior(vae, pixel_values):
    """The VAE posterior's parameters [B, 2C, h, w] (what the latent cache stores)."""
    return vae.encode(pixel_values.to(vae.device, vae.dtype)).latent_dist.parameters


class _BatchCache:
    """A LatentCache bound to one collated batch: ``get_or_encode_batch(pixels, fn)`` in ``encode_latents``."""

    def __init__(self, cache, batch: dict):
        self.cache, self.batch = cache, batch

    def get_or_encode_batch(self, pixel_values, encode_fn):
        out = self.cache.get_or_encode_batch(self.batch, encode_fn)
        return out.to(pixel_values.device)


def batch_latents(vae, batch: dict, generator, device, cache=None):
    """Latents of a collated batch, through the latent cache when there is one."""
    pixels = batch["pixel_values"].to(device)
    return encode_latents(vae, pixels, generator, _BatchCache(cache, batch) if cache is not None else None)


def make_latent_cache(cfg, vae, out_dir: Path):
    """A LatentCache when ``memory.cache_latents`` is on: in memory, or on disk under ``{out}/cache/latents``
    with ``memory.cache_latents_to_disk`` (keyed by file content, size, crop, flip and the VAE)."""
    if not cfg.memory.cache_latents:
        return None
    from .data import LatentCache, vae_identity

    disk = cfg.memory.cache_latents_to_disk
    return LatentCache(
        Path(out_dir) / "cache" / "latents" if disk else None, identity=vae_identity(vae, "posterior")
    )


def precompute_latents(accelerator, cache, vae, datasets: list, epochs: int) -> None:
    """Encode every sample of every epoch (random crops/flips differ per epoch) before training, so the VAE
    can leave the GPU. On disk the main process encodes and the others then read."""
    if cache is None:
        return
    import torch

    def encode(px):
        with torch.no_grad():
            return posterior(vae, px).float()

    def fill() -> int:
        return sum(cache.precompute(ds, encode, epochs=range(epochs)) for ds in datasets)

    if cache.dir is None:  # in memory: each process fills its own
        encoded = fill()
    else:  # on disk: the main process encodes, the others then find the files
        encoded = fill() if accelerator.is_main_process else 0
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            fill()
    say(accelerator, f"latent cache: {encoded} encoded, {len(cache)} cached")


class TextCache:
    """Text-encoder outputs per caption (CPU), for runs whose text encoders are frozen: computed once before
    training for every caption the epochs will use, so the encoders can leave the GPU."""

    def __init__(self):
        self.embeds: dict[str, Any] = {}

    def precompute(self, comps, text_encoders, captions, device, batch_size: int = 16) -> int:
        import torch

        todo = sorted(set(captions) - set(self.embeds))
        with torch.no_grad():
            for i in range(0, len(todo), batch_size):
                chunk = todo[i : i + batch_size]
                embeds, pooled = encode_prompts(
                    text_encoders, tokenize(comps.tokenizers, chunk), comps.family, device
                )
                for j, caption in enumerate(chunk):
                    self.embeds[caption] = (
                        embeds[j].to("cpu"),
                        pooled[j].to("cpu") if pooled is not None else None,
                    )
        return len(todo)

    def lookup(self, captions: list[str], device, dtype):
        import torch

        missing = [c for c in captions if c not in self.embeds]
        if missing:
            raise KeyError(f"caption not in the text cache: {missing[0]!r}")
        embeds = torch.stack([self.embeds[c][0] for c in captions]).to(device, dtype)
        first = self.embeds[captions[0]][1]
        pooled = (
            None if first is None else torch.stack([self.embeds[c][1] for c in captions]).to(device, dtype)
        )
        return embeds, pooled


def epoch_captions(dataset, epochs: int) -> set[str]:
    """Every caption ``dataset`` yields over ``epochs`` epochs (tag shuffling varies them per epoch)."""
    captions: set[str] = set()
    keep = dataset.epoch
    try:
        for epoch in range(epochs if getattr(dataset, "shuffle_tags", 0) else 1):
            dataset.set_epoch(epoch)
            for index in range(len(dataset)):
                item = dataset.items[dataset._index[index]]
                captions.add(dataset.caption_for(item, index))
    finally:
        dataset.set_epoch(keep)
    return captions


def make_text_cache(accelerator, cfg, comps, text_encoders, captions, device) -> TextCache | None:
    """Cache text-encoder outputs when ``memory.cache_text_encoder_outputs`` is on (the config refuses it for
    runs that train a text encoder; callers pass only frozen ones)."""
    if not cfg.memory.cache_text_encoder_outputs:
        return None
    cache = TextCache()
    n = cache.precompute(comps, text_encoders, captions, device)
    say(accelerator, f"text cache: {n} captions encoded")
    return cache


def offload(*models) -> None:
    """Move models off the GPU (to system RAM) once their outputs are cached."""
    import torch

    for m in models:
        if m is not None:
            m.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def noisy_latents(noise_scheduler, latents, generator, noise_offset: float = 0.0):
    """(noisy_latents, noise, timesteps): noise and timesteps drawn on CPU from ``generator``."""
    import torch

    b = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if noise_offset:
        noise = noise + noise_offset * torch.randn((b, latents.shape[1], 1, 1), generator=generator)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (b,), generator=generator)
    noise = noise.to(latents.device, latents.dtype)
    timesteps = timesteps.to(latents.device)
    return noise_scheduler.add_noise(latents, noise, timesteps), noise, timesteps


def diffusion_target(noise_scheduler, latents, noise, timesteps):
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    raise SdplanError(f"unsupported prediction_type {kind!r} in the model's scheduler config")


def mse(pred, target, reduction: str = "mean"):
    import torch.nn.functional as F

    return F.mse_loss(pred.float(), target.float(), reduction=reduction)


# -- test hooks -----------------------------------------------------------------------------------------


def inject_failures(step: int, batch_size: int, loss):
    """TEST HOOKS, read from the environment (no effect unless set):

    - ``SDPLAN_INJECT_OOM_AT_STEP=N``: raise ``torch.OutOfMemoryError`` in optimizer step N (1-based) when
      ``training.batch_size > 1``, so the launcher's retry with a smaller micro-batch can be tested on CPU.
    - ``SDPLAN_INJECT_NAN_AT_STEP=N``: make the loss NaN in optimizer step N.
    """
    import torch

    oom = os.environ.get("SDPLAN_INJECT_OOM_AT_STEP")
    if oom and int(oom) == step and batch_size > 1:
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by SDPLAN_INJECT_OOM_AT_STEP={oom})")
    nan = os.environ.get("SDPLAN_INJECT_NAN_AT_STEP")
    if nan and int(nan) == step:
        return loss * float("nan")
    return loss


# -- per-step statistics across processes -------------------------------------------------------------


def reduce_step_stats(accelerator, loss_sum, micro_batches: int, images: int, stop: bool):
    """One all-reduce per optimizer step: mean loss over processes, images trained by all, any stop request
    and any non-finite loss (so every process takes the same decision)."""
    import torch

    loss_sum = loss_sum.detach().float().reshape(())
    finite = bool(torch.isfinite(loss_sum))
    t = torch.tensor(
        [loss_sum.item() if finite else 0.0, micro_batches, images, float(stop), float(not finite)],
        dtype=torch.float64,
        device=accelerator.device,
    )
    if accelerator.num_processes > 1:
        t = accelerator.reduce(t, reduction="sum")
    loss_sum_all, micro_all, images_all, stop_all, bad_all = t.tolist()
    mean_loss = loss_sum_all / max(micro_all, 1) if bad_all == 0 else float("nan")
    return mean_loss, int(images_all), stop_all > 0, bad_all > 0


def nonfinite_error(step: int, cfg, checkpoint: Path | None) -> NonFiniteLoss:
    p = cfg.training.precision
    if p == "fp16":
        cause = "fp16 overflow (activations or the loss exceed the fp16 range)"
        fix = "train with training.precision=bf16 (Ampere or newer) or fp32, or lower training.learning_rate"
    else:
        cause = "diverging weights (learning rate too high) or a bad batch"
        fix = f"lower training.learning_rate (now {cfg.training.learning_rate:g}) or add warmup"
    where = f"; weights from before it in {checkpoint}" if checkpoint else ""
    return NonFiniteLoss(f"loss became NaN/inf at step {step}: likely {cause}{where}", fix=fix)


def stop_on_nan(ckpt, params, step: int, cfg) -> NonFiniteLoss:
    """At a NaN/inf loss, before the optimizer step: checkpoint the weights from before this step (when they
    are still finite; else point at the last checkpoint) and return the error to raise."""
    import torch

    path = None
    if all(bool(torch.isfinite(p).all()) for p in params):
        path = ckpt.save("nan")
    elif ckpt.last_saved is not None:
        path = ckpt.last_saved
    return nonfinite_error(step, cfg, path)


def checkpoint_on_error(accelerator, ckpt, state) -> None:
    """Best effort on an unexpected exception: checkpoint the last finished step. One process only: with
    several, the others may be inside a collective and a save would hang."""
    if accelerator.num_processes != 1 or state.global_step == 0 or ckpt.last_saved_step == state.global_step:
        return
    try:
        path = ckpt.save("interrupt")
        print(f"checkpoint written after the error: {path}", flush=True)
    except Exception as e:  # the original error matters more
        print(f"could not write a checkpoint after the error: {e}", flush=True)


# -- samples ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def sampling_precision(accelerator, vae):
    """Sampling runs under the training autocast (the pipeline mixes fp16/bf16 and fp32 components) but the
    VAE decodes outside it, in its own dtype: the SD/SDXL VAE overflows to NaN in fp16 (kept fp32 then)."""
    import torch

    original = vae.decode

    def decode(z, *args, **kwargs):
        with torch.autocast(accelerator.device.type, enabled=False):
            return original(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode
    try:
        with torch.no_grad(), accelerator.autocast():
            yield
    finally:
        del vae.decode


def samples(
    accelerator, comps, unet, text_encoders, cfg, *, step: int | None = None, fallback: str = "", tb=None
) -> Path | None:
    """A PNG grid from ``sampling.prompts`` (else ``fallback``) with a fixed seed, made on the main process:
    ``samples/step-000100.png`` during training (the other processes wait), ``samples/final.png`` at the end
    (call it on the main process only then). Components moved off the GPU (cached outputs) come back for it."""

    from .checkpoint import unwrap

    prompts = list(cfg.sampling.prompts) or ([fallback] if fallback else [])
    name = f"step-{step:06d}.png" if step is not None else "final.png"
    grid = None
    if prompts and accelerator.is_main_process:
        from . import sampling

        tes = [unwrap(te) for te in text_encoders]
        pipe = comps.pipeline(unet=unwrap(unet), text_encoders=tes)
        away = [m for m in (comps.vae, *tes) if m.device != accelerator.device]
        for m in away:
            m.to(accelerator.device)
        try:
            with sampling_precision(accelerator, comps.vae):
                grid = sampling.sample_grid(
                    pipe,
                    prompts,
                    seed=cfg.sampling.seed,
                    steps=cfg.sampling.num_inference_steps,
                    guidance_scale=cfg.sampling.guidance_scale,
                    resolution=cfg.data.resolution,
                    out_path=Path(cfg.output.dir) / "samples" / name,
                )
        finally:
            offload(*away)
        if tb is not None:
            tb.image("samples", grid, step if step is not None else 0)
    if step is not None:
        accelerator.wait_for_everyone()
    return grid


def tensorboard(accelerator, cfg):
    """TensorBoard logs under ``{out}/logs`` when ``logging.tensorboard`` (main process only)."""
    from .plots import TensorBoardLogger

    return TensorBoardLogger(
        Path(cfg.output.dir) / "logs", enabled=cfg.logging.tensorboard and accelerator.is_main_process
    )


def log_step(tb, progress, step: int, loss: float, lr_scheduler) -> None:
    """One step's loss, learning rate, it/s and memory to TensorBoard."""
    if tb is None or not tb.enabled:
        return
    tb.log(
        step,
        loss=loss,
        lr=lr_scheduler.get_last_lr()[0],
        it_per_s=progress.rate(step),
        memory_bytes=peak_memory_bytes(),
    )


def describe_data(accelerator, dataset, scan, label: str = "data") -> None:
    """The scan summary (with skipped files and why) and, with buckets, the bucket table."""
    say(accelerator, f"{label} {scan.summary()}")
    if getattr(dataset, "buckets", None):
        from .buckets import format_bucket_table

        say(accelerator, "aspect-ratio buckets:\n" + format_bucket_table(dataset.bucket_table()))


# -- memory -------------------------------------------------------------------------------------------


def peak_memory_bytes(accelerator=None) -> int:
    """Peak GPU memory allocated by torch on CUDA; else this process's peak resident set size."""
    import torch

    if torch.cuda.is_available() and (accelerator is None or accelerator.device.type == "cuda"):
        return int(torch.cuda.max_memory_allocated())
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def write_oom_report(out_dir: Path, *, step: int, cfg, message: str) -> Path:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report = {
        "step": step,
        "batch_size": cfg.training.batch_size,
        "grad_accum": cfg.training.grad_accum,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing,
        "message": message.strip().splitlines()[0] if message.strip() else "CUDA out of memory",
    }
    return write_json_atomic(Path(out_dir) / "oom.json", report)


def write_json_atomic(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_run_summary(
    out_dir: Path,
    *,
    method: str,
    steps: int,
    epochs: float,
    images_seen: int,
    num_processes: int,
    final_loss: float | None,
    wall_seconds: float,
    peak_memory_bytes: int,
    outputs: list[Path | str],
) -> dict[str, Any]:
    summary = {
        "method": method,
        "steps": steps,
        "epochs": epochs,
        "images_seen": images_seen,
        "num_processes": num_processes,
        "final_loss": None if final_loss is None or not math.isfinite(final_loss) else final_loss,
        "wall_seconds": round(wall_seconds, 3),
        "peak_memory_bytes": peak_memory_bytes,
        "outputs": [str(p) for p in outputs],
    }
    write_json_atomic(Path(out_dir) / "run_summary.json", summary)
    return summary


def write_loss_history(out_dir: Path, losses: list[float]) -> Path:
    """``loss_history.json``: the mean loss of every optimizer step (1-based), what loss.png draws."""
    return write_json_atomic(
        Path(out_dir) / "loss_history.json", {"steps": list(range(1, len(losses) + 1)), "losses": losses}
    )


def gather_max(accelerator, value: int) -> int:
    import torch

    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return int(accelerator.reduce(t, reduction="max").item())


def output_metadata(cfg, *, steps: int, epochs: float, prediction_type: str, **extra: Any) -> dict[str, Any]:
    """What every output records (export turns it into string metadata): the config, the plan it came from,
    steps, epochs and the prediction type (kohya's ss_* keys read these)."""
    return {
        "config": cfg,
        "plan": cfg.plan,
        "steps": steps,
        "epoch": epochs,
        "prediction_type": prediction_type,
        **extra,
    }


# -- stop signals -------------------------------------------------------------------------------------


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop after the current step (it then writes a checkpoint).

    A second SIGINT raises KeyboardInterrupt at once, unless it comes within a second of the first (a
    launcher such as torchrun forwards the Ctrl-C its process group already delivered). Handlers are installed
    only in the main thread and the previous ones come back on exit.
    """

    def __init__(self):
        self.requested: str | None = None
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested is not None:
            if signum == signal.SIGINT and now - self._first > 1.0:
                raise KeyboardInterrupt
            return
        self.requested, self._first = name, now
        if os.environ.get("RANK", "0") == "0":
            # os.write: no buffered-IO reentrancy when the signal lands inside a print.
            note = f"\n{name}: stopping after this step and writing a checkpoint (Ctrl-C again to abort)\n"
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), note.encode())

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


# -- progress -----------------------------------------------------------------------------------------


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Step, loss, it/s, ETA (and GPU memory on CUDA) on the main process. A rich bar on a terminal; plain
    lines (about 20 per run, and the last step) when stdout is not a TTY; nothing on other processes."""

    def __init__(self, accelerator, total: int, initial: int = 0, description: str = "train"):
        import torch

        self.enabled = accelerator.is_main_process
        self.total = total
        self.initial = initial
        self.cuda = accelerator.device.type == "cuda" and torch.cuda.is_available()
        self.tty = sys.stdout.isatty() and os.environ.get("SDPLAN_PLAIN_PROGRESS") is None
        self.every = max(1, total // 20)
        self.description = description
        self.start = time.perf_counter()
        self._bar = None
        if self.enabled and self.tty:
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("step {task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} it/s"),
                TextColumn("ETA {task.fields[eta]}"),
                TextColumn("{task.fields[mem]}"),
                transient=False,
            )
            self._task = self._bar.add_task(
                description, total=total, completed=initial, loss="-", rate="-", eta="-", mem=""
            )
            self._bar.start()

    def _mem(self) -> str:
        if not self.cuda:
            return ""
        import torch

        return f"GPU {torch.cuda.memory_allocated() / 2**30:.1f}/{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"

    def rate(self, step: int) -> float:
        """Steps per second since this run (or resume) started."""
        elapsed = time.perf_counter() - self.start
        return (step - self.initial) / elapsed if elapsed > 0 else 0.0

    def update(self, step: int, loss: float | None = None) -> None:
        if not self.enabled:
            return
        rate = self.rate(step)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        fields = {
            "loss": "-" if loss is None else f"{loss:.4f}",
            "rate": f"{rate:.2f}",
            "eta": _fmt_eta(eta),
            "mem": self._mem(),
        }
        if self._bar is not None:
            self._bar.update(self._task, completed=step, **fields)
        elif step % self.every == 0 or step == self.total or step == self.initial + 1:
            mem = f" {fields['mem']}" if fields["mem"] else ""
            loss_text = f" loss {fields['loss']}" if loss is not None else ""
            print(
                f"{self.description}: step {step}/{self.total}{loss_text} {fields['rate']} it/s "
                f"ETA {fields['eta']}{mem}",
                flush=True,
            )

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def say(accelerator, message: str) -> None:
    """Print on the main process only."""
    if accelerator is None or accelerator.is_main_process:
        print(message, flush=True)
