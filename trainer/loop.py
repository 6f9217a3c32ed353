"""The one training loop. Every method runs through :func:`train`; what differs is a :class:`Recipe`.

The loop owns the contract every method shares: inputs checked before anything heavy loads, the Accelerator
(device, precision, DeepSpeed/DDP), gradient checkpointing, optimizer, data loader, step arithmetic and LR
schedule, the latent and text-encoder caches, gradient accumulation, per-step seeds, the NaN/inf stop, the
SIGINT/SIGTERM checkpoint, the out-of-memory report, rolling/kept checkpoints and exact resume, EMA, samples,
the progress bar, TensorBoard, loss history and plot, and ``run_summary.json``.

Nothing trained is lost to the export: before the first step the recipe's real export runs once into a
temporary folder (then deleted), so a broken export, an unwritable folder or a disk too small for the outputs
fails in the first seconds; at the end the final step is checkpointed before the export (with checkpoints
off: when the export fails), and a failed export says which checkpoint holds the trained state (``--resume``
it: the run goes straight to the export). ``output.save_every_n_epochs`` / ``save_every_n_steps`` write the
method's outputs during training, named kohya's way, each with a sample grid (the step's every-N grid copied
where it has one), listed in ``run_summary.json``.

A recipe says what its method is: the models it builds and how they are placed, the trainable parameter
groups, the loss of a batch, what a checkpoint holds, and what it exports. The denoiser call and the objective
are pieces of the recipe base (:meth:`Recipe.predict`, ``objective.DiffusionObjective``), so a family with
another network or objective (a transformer with flow matching) swaps those, not the loop.

Why one module of ~650 lines: it is the one training loop every recipe shares (the contract the recipes fill in,
set-up, the step, the stops, checkpoints, outputs), read top to bottom; the pieces it calls live in their own
modules (runtime, checkpoint, stops, outputs, quantize, blockswap).

``sdplan bench`` builds the same recipes (:meth:`Recipe.dtypes`, :meth:`Recipe.setup`, :meth:`prepare`) and
steps them with :func:`optimizer_step`, so a bench number is the trainer's number.
"""

from __future__ import annotations

import dataclasses
import random
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from sdplan.config import TrainConfig
from sdplan.errors import SdplanError, UsageError
from sdplan.registry import FLOW_FAMILIES
from sdplan.registry import method as method_of
from sdplan.settings import FAMILY_SETTING, checkpoint_settings
from sdplan.steps import intermediate_steps, plan_steps

from . import (
    blockswap,
    conditioning,
    data,
    ds_masters,
    export,
    faults,
    flow,
    latents,
    models,
    objective,
    outputs,
    progress,
    quantize,
    runtime,
    stops,
)
from . import checkpoint as ckpt_lib
from .dataset_scan import count_of
from .source_check import check_source


class Recipe:
    """One training method. The loop calls, in order: :meth:`dtypes` (class-level), :meth:`setup`,
    :meth:`checkpointed_models`, :meth:`param_groups`, :meth:`text_captions` / :meth:`latent_datasets` (the
    caches), :meth:`loss` per micro-batch, :meth:`after_optimizer_step`, and :meth:`export` at the end."""

    method = ""
    trains_unet = False  # full UNet weights (fp32 masters, or bf16 with training.full_half_weights)

    def __init__(self, cfg: TrainConfig, accelerator, comps, dataset=None):
        self.cfg, self.accelerator, self.comps, self.dataset = cfg, accelerator, comps, dataset
        self.device = accelerator.device
        self.wdtype = runtime.weight_dtype(accelerator)
        self.unet, self.vae, self.text_encoders = comps.unet, comps.vae, list(comps.text_encoders)
        self.trained: dict[str, Any] = {}  # name -> model whose parameters train (what DDP wraps)
        self.objective = objective.DiffusionObjective(
            comps.noise_scheduler, cfg.training.noise_offset, cfg.training.min_snr_gamma
        )
        self.adapter = comps.adapter  # SD3.5/FLUX: their objective and denoiser call (trainer/flow.py)
        if self.adapter is not None:
            self.adapter.check(cfg)
            self.objective = self.adapter.objective(comps.noise_scheduler)
        quantize.check_run(cfg, comps.family, self.device)  # model.base_precision fp8 / nf4: can this run?
        self.base_summary: dict[str, Any] | None = None  # what quantize_base stored (a quantized base)
        swap_problem = blockswap.support_problem(
            cfg.memory.blocks_to_swap,
            family=comps.family,
            method=cfg.method,
            gradient_checkpointing=cfg.memory.gradient_checkpointing,
            processes=accelerator.num_processes,
            deepspeed=cfg.distributed.deepspeed is not None,
        )
        if swap_problem:
            raise UsageError(swap_problem)
        self.swapped_blocks: list[str] = []  # memory.blocks_to_swap: the blocks kept in host RAM
        self.block_swap = None  # their hooks (blockswap.BlockSwap), set by the LoRA recipe
        self.latents = latents.Latents(self.vae, self.device)  # the loop adds the cache
        self.text_cache = None
        self.bench_captions: set[str] | None = None  # sdplan bench's, cached as a run's are (no dataset)
        self.latent_dtype = self.wdtype  # latents and conditioning in the frozen UNet's dtype
        self.cond_dtype = self.wdtype
        self.plan = None  # the loop's sdplan.steps.Steps, once the data loader is prepared
        # seconds sampling in setup (DreamBooth's class images, on the main process): the loop adds them to its
        # state (run_summary's sampling_seconds; the main process's is the one written)
        self.sampling_seconds = 0.0
        self.started_at = time.time()  # wall-clock start and a random run id (kohya's ss_training_started_at,
        self.session_id = random.randint(0, 2**32)  # ss_session_id)

    # -- what a method defines -------------------------------------------------------------------------

    @classmethod
    def resolve_config(cls, cfg: TrainConfig) -> TrainConfig:
        """Defaults that depend on the run (DreamBooth's class-image folder); checked before models load."""
        return cfg

    @classmethod
    def dtypes(cls, cfg: TrainConfig, accelerator) -> dict[str, Any]:
        """The dtype each model lives in while training: ``unet``, ``text_encoder``, ``vae``."""
        import torch

        wdtype = runtime.weight_dtype(accelerator)
        te_trains = cls.trains_unet and cfg.training.train_text_encoder
        return {
            "unet": runtime.trained_dtype(cfg, accelerator) if cls.trains_unet else wdtype,
            "text_encoder": torch.float32 if te_trains else wdtype,
            "vae": runtime.vae_dtype(accelerator),
        }

    def setup(self) -> None:
        """Freeze, place and make trainable what the method trains; fill ``self.trained``."""
        raise NotImplementedError

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups, each with its ``lr``."""
        raise NotImplementedError

    def checkpointed_models(self) -> list:
        """The models whose activations are recomputed with memory.gradient_checkpointing."""
        return list(self.trained.values())

    def loss(self, batch: dict, generator, micro: int):
        """The loss of one micro-batch (``micro``: its index in the epoch on this process)."""
        pred, target = self.predict(batch, generator)
        return self.objective.loss(pred, target)

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step (before the LR scheduler's)."""

    def text_captions(self, epochs: int) -> set[str] | None:
        """Every caption the run conditions on, for the text-encoder cache; None when a text encoder trains."""
        if self.cfg.training.train_text_encoder:
            return None
        return conditioning.epoch_captions(self.dataset, epochs)

    def cached_captions(self, epochs: int | None = None) -> set[str] | None:
        """Every caption the text cache holds over ``epochs`` (None: :meth:`caption_epochs`) with
        memory.cache_text_encoder_outputs: the run's (:meth:`text_captions`) and, for SD3.5 / FLUX.1, whose grids
        sample from the cache, the grids' prompts; None where nothing is cached (the option off, a text encoder
        training); without a dataset (sdplan bench) :attr:`bench_captions`."""
        if not self.cfg.memory.cache_text_encoder_outputs:
            return None
        if self.dataset is None:  # sdplan bench: the caption it steps and samples with (bench_harness)
            captions, prompts = self.bench_captions, sorted(self.bench_captions or ())
        else:
            captions = self.text_captions(self.caption_epochs() if epochs is None else epochs)
            prompts = list(self.cfg.sampling.prompts) + [self.sample_prompt()]
        if captions is not None and self.comps.family in FLOW_FAMILIES:
            negative = self.cfg.sampling.negative_prompt
            captions = captions | flow.sampling_captions(self.comps.family, prompts, negative)
        return captions

    def caption_epochs(self) -> int:
        """The epochs whose captions the text cache holds before the data loader exists (they differ only with
        data.shuffle_tags): training.epochs, or the epochs training.max_steps takes at this dataset's length
        (aspect buckets make the loader longer, so fewer epochs: these cover the run; the loop encodes any
        caption they lack all the same)."""
        tcfg = self.cfg.training
        return (
            plan_steps(  # the loader's length by the steps' own default: ceil(images / (batch x processes))
                images_per_epoch=len(self.dataset),
                batch_size=tcfg.batch_size,
                grad_accum=tcfg.grad_accum,
                epochs=tcfg.epochs,
                max_steps=tcfg.max_steps,
                num_processes=self.accelerator.num_processes,
            ).epochs
        )

    def latent_datasets(self) -> list:
        return [self.dataset]

    def checkpoint_weights(self) -> dict[str, Any]:
        return ckpt_lib.trainable_state_dict(self.trained)

    def load_checkpoint_weights(self, state: dict[str, Any]) -> None:
        ckpt_lib.load_trainable_state_dict(self.trained, state)

    def sample_prompt(self) -> str:
        """The prompt of the sample grids when ``sampling.prompts`` is empty: the first image's caption, its tags in
        their own order (shuffled ones changed the prompt from grid to grid, which then showed no progress)."""
        return self.dataset.caption_for(self.dataset.items[0], 0, shuffle=False)

    def export(self, out_dir: Path, metadata: dict[str, Any], ema: Ema | None) -> list[Path]:
        """Write the method's outputs into ``out_dir``, named after ``cfg.output.name``."""
        raise NotImplementedError

    @contextmanager
    def output_name(self, name: str):
        """:meth:`export` names its files ``name`` inside the block (intermediate outputs)."""
        cfg = self.cfg
        self.cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, name=name))
        try:
            yield
        finally:
            self.cfg = cfg

    # -- shared pieces ---------------------------------------------------------------------------------

    def ema_model(self):
        """The model EMA averages (``ema.enabled``), or None when this method keeps no EMA."""
        return self.unet if self.cfg.ema.enabled and method_of(self.cfg.method).ema else None

    def predict(self, batch: dict, generator, *, latents=None):
        """(prediction, target) of the denoiser on one batch: latents, noised by the objective, conditioned on
        the captions. The model adapter of SD 1.x/2.x/SDXL (a UNet, epsilon or v-prediction); the transformer
        families' is ``self.adapter`` (``flow.FlowAdapter``: rectified flow, weighted targets)."""
        if self.adapter is not None:
            return self.adapter.predict(self, batch, generator, latents=latents)
        if latents is None:
            latents = self.latents(batch, generator)
        if self.latent_dtype is not None:
            latents = latents.to(self.latent_dtype)
        noisy, timesteps, target = self.objective.corrupt(latents, generator)
        embeds, added = conditioning.unet_conditioning(
            self.comps, batch, self.text_encoders, self.device, self.cond_dtype, self.text_cache
        )
        pred = self.unet(noisy, timesteps, embeds, added_cond_kwargs=added, return_dict=False)[0]
        return self.objective.weigh(pred, target, timesteps)

    def place_models(self) -> None:
        """Freeze every model and put it on the device in its training dtype (:meth:`dtypes`); ``setup`` then
        makes trainable what the method trains."""
        dtypes = self.dtypes(self.cfg, self.accelerator)
        for m in (self.unet, self.vae, *self.text_encoders):
            if m is not None:
                m.requires_grad_(False)
        if self.vae is not None:
            runtime.place(self.vae, self.device, dtypes["vae"])
        # an fp8 base stores the encoders' Linear weights in fp8 on the CPU, then moves them as stored (no dtype):
        # cast on the GPU, T5-XXL was first there whole in bf16 (9 GiB, where the planner counts 4.5)
        fp8 = self.cfg.model.base_precision == "fp8" and bool(self.text_encoders)
        for te in self.text_encoders:
            runtime.place(te, "cpu" if fp8 else self.device, dtypes["text_encoder"])
        if fp8:
            quantize.store_text_encoders_fp8(self.text_encoders, dtypes["text_encoder"])
            for te in self.text_encoders:
                te.to(self.device)
        # memory.cache_text_encoder_outputs: the captions are encoded before the denoiser comes to the GPU, and the
        # encoders leave it, so their peak is not on top of the denoiser's (kohya moves its UNet to the CPU for
        # it; SimpleTuner encodes before it loads the transformer): T5-XXL's 9 GiB beside a FLUX.1 base
        # was more than a 12 GB card. The loop encodes what this pass could not know (:meth:`cached_captions`).
        captions = self.cached_captions()
        if captions is not None:
            self.text_cache = conditioning.make_text_cache(
                self.accelerator, self.cfg, self.comps, self.text_encoders, captions, self.device
            )
            latents.offload(*self.text_encoders)
        self.place_denoiser(dtypes["unet"])

    def place_denoiser(self, dtype) -> None:
        """The UNet / transformer on the device in ``dtype``. SD3.5/FLUX LoRA: with ``model.base_precision`` fp8
        / nf4 its block Linear weights are stored quantized, layer by layer (``quantize``); the blocks of
        ``memory.blocks_to_swap`` stay in host RAM (``blockswap``; the LoRA recipe adds their hooks)."""
        base = self.cfg.model.base_precision
        swapped = blockswap.swap_names(self.unet, self.comps.family, self.cfg.memory.blocks_to_swap)
        with blockswap.set_aside(self.unet, swapped) as host_blocks:
            if base != "bf16":
                self.base_summary = quantize.quantize_base(self.unet, base, self.device, dtype)
            else:
                runtime.place(self.unet, self.device, dtype)
        for block in host_blocks:
            if base != "bf16":
                more = quantize.quantize_base(
                    block, base, "cpu", dtype, names=quantize.block_linears(block, ("",))
                )
                self.base_summary = {k: v + more[k] for k, v in self.base_summary.items()}
            else:
                runtime.place(block, "cpu", dtype)
        self.swapped_blocks = swapped
        if base != "bf16":
            progress.say(self.accelerator, quantize.describe(base, self.base_summary))

    def train_text_encoders(self) -> dict[str, Any]:
        """Make every text encoder trainable in fp32 (full-weight methods with training.train_text_encoder)."""
        import torch

        out = {}
        for i, te in enumerate(self.text_encoders):
            te.requires_grad_(True)
            runtime.place(te, self.device, torch.float32)
            out[f"text_encoder_{i}"] = te
        return out

    def lr_groups(self, main_params, te_params) -> list[dict[str, Any]]:
        """The main parameters at training.learning_rate; the text encoders' (if any) at their own rate."""
        t = self.cfg.training
        groups = [{"params": list(main_params), "lr": t.learning_rate}]
        if te_params:
            groups.append({"params": list(te_params), "lr": t.text_encoder_learning_rate or t.learning_rate})
        return groups


def prepare(recipe: Recipe, optimizer, *extra):
    """``accelerator.prepare`` the trained models, the optimizer and ``extra`` (the data loader); the recipe's
    models are rebound to what was prepared (DDP wrappers). Returns (optimizer, *extra)."""
    names = list(recipe.trained)
    runtime.check_deepspeed(recipe.accelerator, recipe.trained)
    ds = recipe.cfg.distributed.deepspeed
    if ds is not None and ds.offload_optimizer and recipe.accelerator.device.type != "cpu":
        note = runtime.deepspeed_cpu_adam_build_note()  # CPU runs keep torch's AdamW (sdplan.launch)
        if note:
            progress.say(recipe.accelerator, note)
    kw = {}
    if recipe.block_swap is not None:  # placed already; moving it whole would bring the swapped blocks in
        kw["device_placement"] = [name != "unet" for name in names] + [True] * (1 + len(extra))
    prepared = ds_masters.prepare(recipe.accelerator, recipe.trained, optimizer, *extra, **kw)
    recipe.trained = dict(zip(names, prepared[: len(names)]))
    recipe.unet = recipe.trained.get("unet", recipe.unet)
    recipe.text_encoders = [
        recipe.trained.get(f"text_encoder_{i}", te) for i, te in enumerate(recipe.text_encoders)
    ]
    for m in recipe.trained.values():
        m.train()
    return prepared[len(names) :]


def build(recipe: Recipe) -> tuple[list[dict[str, Any]], Any]:
    """The recipe's models set up for training: placed, trainable, checkpointed; returns (groups, optimizer)."""
    recipe.setup()
    runtime.avoid_faulty_attention_kernels()
    runtime.use_sdpa(recipe.unet, *([recipe.vae] if recipe.vae is not None else []))
    if recipe.cfg.memory.gradient_checkpointing:
        runtime.enable_gradient_checkpointing(*recipe.checkpointed_models())
    groups = recipe.param_groups()
    return groups, runtime.make_optimizer(groups, recipe.cfg)


def optimizer_step(
    recipe: Recipe, optimizer, batch: dict, generator, *, micro: int, on_forward=None, on_boundary=None
):
    """One micro-batch under gradient accumulation: loss, backward and, at an accumulation boundary, gradient
    clipping and the optimizer step. ``on_forward(loss, batch) -> loss`` runs between the forward and the
    backward pass; ``on_boundary(grad_norm)`` before the optimizer step (the loop's NaN and stop decisions;
    ``grad_norm``: the clipped gradients' total norm before clipping, None when nothing was clipped)."""
    accelerator, cfg = recipe.accelerator, recipe.cfg
    with accelerator.accumulate(*recipe.trained.values()):
        loss = recipe.loss(batch, generator, micro)
        if on_forward is not None:
            loss = on_forward(loss, batch)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            grad_norm = None
            if cfg.training.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(_params(optimizer), cfg.training.max_grad_norm)
            if on_boundary is not None:
                on_boundary(grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=cfg.memory.set_grads_to_none)
        if accelerator.sync_gradients:
            recipe.after_optimizer_step()
    return loss


def _params(optimizer) -> list:
    inner = getattr(optimizer, "optimizer", optimizer)
    return [p for g in inner.param_groups for p in g["params"]]


class Ema:
    """diffusers' EMAModel over a model's parameters, on ``device`` ("cpu": system RAM, no VRAM), updated
    every ``every`` optimizer steps with decay ``decay ** every`` (the same averaging horizon in steps).

    The average is kept in fp32 whatever the weights train in (what the planner counts): with bf16 weights
    (``training.full_half_weights``) a bf16 average moves by ``(1 - decay) * (weight - average)`` per update,
    far below bf16's resolution (1/256 of the value), and would stay where it started."""

    def __init__(self, model, decay: float, device, every: int):
        import torch
        from diffusers.training_utils import EMAModel

        self.decay, self.every, self.device = decay, every, torch.device(device)
        self.model = EMAModel([], decay=decay**every, model_cls=type(model), model_config=model.config)
        # One fp32 copy per parameter, made here: EMAModel clones what it is given, so handing it converted
        # copies held two copies of the whole model at once (bf16 weights: 4x their size in fp32 on the GPU).
        self.model.shadow_params = [
            p.detach().to(device=self.device, dtype=torch.float32, copy=True) for p in model.parameters()
        ]

    @classmethod
    def for_config(cls, cfg, model, device) -> Ema | None:
        import torch

        e = cfg.ema
        if model is None or not e.enabled:
            return None
        return cls(model, e.decay, torch.device("cpu") if e.device == "cpu" else device, e.update_every)

    def step(self, parameters) -> None:
        """One EMA update with EMAModel's decay schedule (``get_decay``), one parameter at a time: EMAModel.step
        takes a list, so the fp32 / host-RAM copies it needs here (bf16 weights, an EMA in host RAM) would all
        exist at once: a whole fp32 model (10 GB for SDXL, 48 GB for FLUX.1) beside the training state."""
        import torch

        ema = self.model
        ema.optimization_step += 1
        decay = ema.get_decay(ema.optimization_step)
        ema.cur_decay_value = decay
        with torch.no_grad():
            for average, p in zip(ema.shadow_params, parameters):
                average.lerp_(p.detach().to(average.device, average.dtype), 1.0 - decay)

    def copy_to(self, model) -> None:
        self.model.copy_to(model.parameters())

    @contextmanager
    def weights_in(self, model):
        """The averaged weights in ``model`` inside the block (the sample grids show them, as the ``ema/``
        export), its own weights put back exactly after, whatever ends the block: diffusers' train_text_to_image
        swaps them so around its validation images (``ema_unet.store`` / ``copy_to`` / ``restore``). The
        training weights wait in host RAM, as EMAModel.store keeps them; the averages come to the model's device
        one parameter at a time (an EMA kept on the CPU is not copied to the GPU whole)."""
        import torch

        params = list(model.parameters())
        kept = [p.detach().to("cpu", copy=True) for p in params]  # their own dtype: restored bit for bit
        try:
            with torch.no_grad():
                for average, p in zip(self.model.shadow_params, params):
                    p.copy_(average)  # across devices and dtypes
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(kept, params):
                    p.copy_(saved)


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


def base_models(recipe: Recipe) -> list[tuple[str, Any]]:
    """The models a run starts from, labelled as the folders of a diffusers model ("unet", "text_encoder_2")."""
    denoiser = (
        "unet"
        if "unet" in type(getattr(recipe.unet, "module", recipe.unet)).__name__.lower()
        else "transformer"
    )
    encoders = [
        ("text_encoder" if i == 0 else f"text_encoder_{i + 1}", te)
        for i, te in enumerate(recipe.text_encoders)
    ]
    return [(denoiser, recipe.unet), *encoders, ("vae", recipe.vae)]


class _Step:
    """The optimizer step in progress on this process: its seed, micro-batches, images and summed loss; at
    the accumulation boundary, the statistics of all processes and the NaN/inf stop."""

    def __init__(self, number: int, accelerator, cfg, injected, stop, ckpt, params, base=None):
        import torch

        self.number, self.accelerator, self.cfg = number, accelerator, cfg
        self.injected, self.stop, self.ckpt, self.params = injected, stop, ckpt, params
        # a run from the base model (not resumed): its step 1 comes before any update; ``base``, its models as
        # (label, module) pairs, where a NaN/inf weight is looked for. Not under DeepSpeed: its engine steps inside
        # accelerator.backward, before this check, so a trained weight could already hold what the data made
        self.base = base
        self.untrained = number == 1 and base is not None and cfg.distributed.deepspeed is None
        self.generator = runtime.seed_step(cfg.training.seed, accelerator.process_index, number)
        self.micro, self.images, self.loss_sum = 0, 0, torch.zeros((), device=accelerator.device)
        self.mean_loss, self.images_all, self.stop_now = float("nan"), 0, False

    def forward(self, loss, batch: dict):
        loss = self.injected.after_forward(self.number, self.cfg.training.batch_size, loss)
        self.micro, self.images = self.micro + 1, self.images + len(batch["caption"])
        self.loss_sum = self.loss_sum + loss.detach()
        return loss

    def boundary(self, grad_norm=None) -> None:
        self.mean_loss, self.images_all, self.stop_now, bad = reduce_step_stats(
            self.accelerator, self.loss_sum, self.micro, self.images, self.stop.requested is not None
        )
        if bad:
            raise stops.stop_on_nan(
                self.ckpt,
                self.params,
                self.number,
                self.cfg,
                untrained=self.untrained,
                models=self.base or (),
            )
        # A finite loss with non-finite gradients (a faulty backward kernel): the update would spread them into
        # every weight and the next step's loss would be NaN. Under fp16 the gradient scaler skips such steps
        # itself; the norm is the same on every process (the gradients are already all-reduced).
        import torch

        scaler = getattr(self.accelerator, "scaler", None)
        if grad_norm is not None and scaler is None and not bool(torch.isfinite(torch.as_tensor(grad_norm))):
            raise stops.stop_on_nan(
                self.ckpt,
                self.params,
                self.number,
                self.cfg,
                gradients=True,
                untrained=self.untrained,
                models=self.base or (),
            )


def train(cfg: TrainConfig, recipe_cls: type[Recipe], *, resume: str | None = None) -> dict:
    """Train ``cfg`` with ``recipe_cls``; returns the run summary (empty on processes other than the main)."""
    import torch

    t0 = time.perf_counter()
    outputs.mark_session_start()  # the grids an earlier session wrote are kept (outputs.grid_path)
    injected = faults.Faults.from_env()
    out_dir = Path(cfg.output.dir)
    tcfg = cfg.training

    # 1. Everything that can be wrong with the inputs, before anything heavy loads.
    models.resolve_source(cfg.model.path)
    dataset, scan = data.build_dataset(cfg)
    model_info = check_source(  # what the model is, from its files (one line for one sdplan cannot train)
        cfg.model.path,
        family=cfg.model.family,
        variant=cfg.model.variant,
        config_dir=cfg.model.config_dir,
        revision=cfg.model.revision,
        deep=True,
        hub=True,
    )
    cfg = recipe_cls.resolve_config(cfg)
    notes: list[str] = []
    resume_from = ckpt_lib.resolve_resume(resume or cfg.checkpoints.resume, out_dir, say=notes.append)
    accelerator = runtime.make_accelerator(cfg, out_dir)
    if ckpt_lib.deepspeed_universal_resume(accelerator, resume_from):  # before prepare() builds the engine
        notes.append(
            f"{resume_from}: DeepSpeed optimizer shards of another process count; loading them through "
            "DeepSpeed's universal checkpoint"
        )
    device = accelerator.device
    for note in notes:
        progress.say(accelerator, note)
    progress.describe_data(accelerator, dataset, scan)

    # 2. The model, the trainable parameters, the optimizer, the data.
    comps = models.load_components(
        cfg.model.path,
        family=cfg.model.family,
        revision=cfg.model.revision,
        variant=cfg.model.variant,
        config_dir=cfg.model.config_dir,
        dtypes=recipe_cls.dtypes(cfg, accelerator),  # loaded as they train: no fp32 copy of a bf16 model
        info=model_info,
        scratch=out_dir,  # a .sft file's link while it loads: in the run's folder, not /tmp
    )
    for note in comps.notes:  # what was detected: family, prediction type, weights variant
        progress.say(accelerator, note)
    recipe = recipe_cls(cfg, accelerator, comps, dataset)
    if accelerator.is_main_process and (note := _long_captions(dataset, comps)):  # after TI's token is added
        progress.say(accelerator, f"note: {note}")
    if accelerator.is_main_process and (note := _long_prompts(cfg.sampling.prompts, comps)):
        progress.say(accelerator, f"note: {note}")
    groups, optimizer = build(recipe)
    ema = Ema.for_config(cfg, recipe.ema_model(), device)
    loader, batches = runtime.make_loader(dataset, cfg, device)
    optimizer, loader = prepare(recipe, optimizer, loader)
    plan = runtime.plan_steps(
        images_per_epoch=len(dataset),
        batches_per_epoch=len(loader),
        batch_size=tcfg.batch_size,
        grad_accum=tcfg.grad_accum,
        epochs=tcfg.epochs,
        max_steps=tcfg.max_steps,
        warmup_steps=tcfg.lr_warmup_steps,
        num_processes=accelerator.num_processes,
        bucket_samples=batches.sampler.bucket_samples(),
    )
    recipe.plan = plan
    lr_scheduler = runtime.make_lr_scheduler(optimizer, cfg, plan)
    accelerator.register_for_checkpointing(lr_scheduler)
    if ema is not None:
        accelerator.register_for_checkpointing(ema.model)
    params = [p for g in groups for p in g["params"]]

    # Where a resumed run stands, in this run's steps (a checkpoint from another process count, micro-batch
    # or accumulation continues at the images it had trained).
    state = ckpt_lib.TrainState(
        batch_size=tcfg.batch_size,
        grad_accum=tcfg.grad_accum,
        num_processes=accelerator.num_processes,
        method=cfg.method,
        samples_per_epoch=len(dataset),
        settings={
            **checkpoint_settings(cfg.to_dict()),
            FAMILY_SETTING: comps.family,
            ckpt_lib.OFFLOADED_OPTIMIZER: ckpt_lib.offloaded_optimizer(cfg, accelerator.device.type),
        },
    )
    start_step = 0
    if resume_from is not None:
        saved = ckpt_lib.read_state(resume_from)
        # the checkpoint's order of images where this micro-batch divides its order batch (trainer/buckets.py):
        # then the images it had trained in its epoch are the first of that epoch here too
        batches.sampler.keep_order(saved.order_batch_size)
        state.order_batch_size = batches.sampler.order_batch_size
        moved = ckpt_lib.resume_position(saved, state, plan, len(batches), batches.sampler)
        start_step = moved.step if moved is not None else saved.global_step
        outputs.same_steps_as_before(ckpt_lib.same_numbering(saved, moved, plan))
        inside = (moved.epoch == saved.epoch) if moved is not None else saved.batches_in_epoch < len(loader)
        reordered = (
            saved.epoch_order
            and saved.batches_in_epoch
            and inside
            and ckpt_lib.kept_order(saved, batches.sampler)
            and saved.samples_per_epoch == len(dataset)
            and batches.sampler.order_digest(saved.epoch) != saved.epoch_order
        )
        if reordered:  # another seed, or buckets turned on or off: the images skipped are not those trained
            progress.say(
                accelerator,
                f"note: epoch {saved.epoch + 1} is drawn in another order than {resume_from} was trained in "
                "(training.seed or data.buckets changed): the rest of it trains some of its images twice and "
                "others not at all (the next epochs are whole)",
            )
        if saved.samples_per_epoch and saved.samples_per_epoch != len(dataset):
            progress.say(
                accelerator,
                f"note: the dataset has {len(dataset)} samples per epoch; {resume_from} was saved with "
                f"{saved.samples_per_epoch}: the resumed epoch's order is this dataset's, so some of its images "
                "train twice in it and others not at all (the next epochs are whole)",
            )
        if moved is not None:
            again = ckpt_lib.images_again(saved, moved, plan, batches.sampler)
            least, most = ckpt_lib.epoch_images(saved, plan)
            trained_again = (
                f"{count_of(again, 'image')} of its epoch {'is' if again == 1 else 'are'} trained again"
            )
            counted = "it counts" if again == 1 else "they count"
            rounded = "the position rounds down to whole batches of this run"
            # the sampler cuts an epoch into batches of its order batch, then shuffles them (trainer/buckets.py):
            # at a micro-batch that does not divide the checkpoint's order batch (a larger one, or 4 -> 3) the
            # epoch's order differs, so the batches skipped are not the images the checkpoint trained (up to 8
            # of 40 images left out of that epoch); a position rounded down to the epoch's start trains the
            # epoch's images again, all. One that divides it keeps the order: what it skips was trained.
            if (
                not ckpt_lib.kept_order(saved, batches.sampler)
                and moved.epoch == saved.epoch
                and moved.batches_in_epoch > 0
            ):
                detail = (
                    f" (the micro-batch changed inside epoch {saved.epoch + 1} to one that does not divide the "
                    f"batch {saved.order_batch_size} its order was cut at: the rest of that epoch is drawn in "
                    f"batch {tcfg.batch_size}'s order, so some of its images train twice in it and about as many "
                    "not at all; the epochs after it are whole)"
                )
            elif again and least == most:
                detail = f" ({trained_again}: {rounded}; {counted} again in the images seen)"
            elif again:
                detail = (
                    f" (up to {trained_again}: {rounded}, and this checkpoint, from an earlier sdplan, kept only "
                    f"its first process's images of the epoch: its processes trained {least} to {most}, and it "
                    f"counts {least}, leaving none out; {counted} again in the images seen)"
                )
            else:
                detail = ""
            progress.say(
                accelerator,
                f"{resume_from}: saved by {count_of(saved.num_processes, 'process', 'processes')} (batch "
                f"{saved.batch_size} x accum {saved.grad_accum}) after {saved.images_seen} images; on "
                f"{count_of(accelerator.num_processes, 'process', 'processes')} (batch {tcfg.batch_size} x "
                f"accum {tcfg.grad_accum}) that is step {moved.step} of {plan.total_steps}{detail}",
            )

    # The export, once, before anything is trained: what fails there fails now, not after the training.
    # the saves from the step a resume starts at on: that step's own (resume_save_at), the loop's after it
    saves_at = intermediate_steps(
        total_steps=plan.total_steps,
        steps_per_epoch=plan.steps_per_epoch,
        every_epochs=cfg.output.save_every_n_epochs,
        every_steps=cfg.output.save_every_n_steps,
        after=start_step - 1,
    )
    resume_save = (start_step, saves_at.pop(start_step)) if start_step in saves_at else None
    export_bytes = 0
    ds_masters.gather(recipe)  # every process: DeepSpeed's fp32 masters for the export (a collective)
    if accelerator.is_main_process:
        meta0 = outputs.run_metadata(
            cfg,
            steps=0,
            epochs=0,
            prediction_type=comps.prediction_type,
            mixed_precision=accelerator.mixed_precision,
        )
        export_bytes = outputs.check_export(
            lambda folder: recipe.export(folder, meta0, ema),
            out_dir,
            saves=1 + len(saves_at) + (resume_save is not None),
        )
    accelerator.wait_for_everyone()

    # 3. Cached VAE outputs: computed once, then the VAE leaves the GPU (the frozen text encoders' outputs were
    # cached in setup, Recipe.place_models: only captions that pass could not know are encoded here).
    latent_cache = latents.make_latent_cache(cfg, recipe.vae, out_dir)
    latents.precompute_latents(accelerator, latent_cache, recipe.vae, recipe.latent_datasets(), plan.epochs)
    recipe.latents = latents.Latents(recipe.vae, device, latent_cache)
    # encoded in setup (Recipe.place_models), but for a later epoch's that pass could not know
    captions = recipe.cached_captions(plan.epochs)
    if captions is not None and (recipe.text_cache is None or recipe.text_cache.missing(captions)):
        away = outputs.models_away(device, *recipe.text_encoders)
        for m in away:
            m.to(device)
        recipe.text_cache = conditioning.make_text_cache(
            accelerator, cfg, comps, recipe.text_encoders, captions, device, cache=recipe.text_cache
        )
    latents.offload(
        recipe.vae if latent_cache else None, *(recipe.text_encoders if recipe.text_cache else [])
    )

    # 4. Checkpoints and resume.
    ckpt = ckpt_lib.Checkpointer(
        accelerator,
        out_dir,
        state,
        get_weights=recipe.checkpoint_weights,
        set_weights=recipe.load_checkpoint_weights,
        every_steps=cfg.checkpoints.every_steps,
        keep_every_steps=cfg.checkpoints.keep_every_steps,
        started=t0,
    )
    if resume_from is not None:
        # this run's rates, as its schedule took them at its start (a group's "lr" is the schedule's value at step
        # 0 there, 0 under warmup), read before the load: DeepSpeed's load writes the checkpoint's (its schedule's
        # decayed rates, and another process count's) into the optimizer's group dicts
        configured = list(lr_scheduler.base_lrs)
        ckpt.load(resume_from, plan, len(batches), batches.sampler)
        if ema is not None:
            ema.model.to(ema.device, torch.float32)  # loaded on the CPU (fp32: see Ema)
        ckpt_lib.apply_learning_rates(optimizer, lr_scheduler, configured, state.global_step)
        progress.say(accelerator, f"resumed from {resume_from} at step {state.global_step}")

    def check_disk(checkpoint: Path, say, *, exports_now: int = 0) -> None:
        """The disk's room for the saves still to come, at the run's newest checkpoint's measured size: a warning
        (main process) where they do not fit; the run goes on. ``exports_now``: a resume's save of its own step,
        still to come. The final outputs of a run extended on resume replace those there (net: nothing)."""
        if accelerator.is_main_process:
            note = ckpt_lib.disk_warning(
                Path(checkpoint),
                ckpt.root,
                step=state.global_step,
                total_steps=plan.total_steps,
                every_steps=cfg.checkpoints.every_steps,
                keep_every_steps=cfg.checkpoints.keep_every_steps,
                export_steps=[s for s in saves_at if s > state.global_step],
                export_bytes=export_bytes,
                exports_now=exports_now,
                final_export_bytes=0 if (out_dir / "run_summary.json").is_file() else None,
            )
            if note:
                say(note)

    if resume_from is not None:
        check_disk(
            resume_from,
            lambda line: progress.say(accelerator, line),
            exports_now=int(resume_save is not None),
        )
    repeated = 0  # the batches an epoch's last round deals again, where the run reaches it
    if accelerator.num_processes > 1 and plan.total_steps >= plan.steps_per_epoch:
        repeated = len(loader) * accelerator.num_processes - len(batches)
    progress.say(
        accelerator,
        runtime.describe_plan(cfg.method, comps.family, len(dataset), cfg, plan, max(0, repeated)),
    )

    if ema is not None and accelerator.is_main_process:
        progress.say(
            accelerator,
            f"note: the sample grids show the EMA weights (ema.enabled, decay {ema.decay}), as the ema/ export; "
            "the training weights are put back after each grid",
        )

    # 5. The loop (the peak recorded from here: the training's, not the setup's caption pass or loading).
    runtime.reset_peak_memory()
    tb = progress.tensorboard(accelerator, cfg, state.images_seen)  # past it: an earlier session's points
    bar = progress.Progress(accelerator, plan.total_steps, initial=state.global_step, description=cfg.method)

    state.sampling_seconds += recipe.sampling_seconds  # this session's class images (setup)

    def sample(step=None, fallback="", **kw):
        started = time.perf_counter()
        try:
            return outputs.samples(
                accelerator,
                comps,
                recipe.unet,
                recipe.text_encoders,
                cfg,
                step=step,
                fallback=fallback,
                tb=tb,
                injected=injected,
                text_cache=recipe.text_cache,
                failures=state.sample_grid_failures,  # carried by the checkpoints: over the run's sessions
                images=state.images_seen,  # the point of the run the grid shows (outputs.grid_path)
                ema=ema,  # ema.enabled: the grids show the averaged weights, as diffusers' validation images
                **kw,
            )
        finally:  # the run's sampling time (run_summary's sampling_seconds), a grid that failed too
            state.sampling_seconds += time.perf_counter() - started

    def save_intermediate(step: int, epoch: int | None, step_grid: Path | None, sampled: bool) -> None:
        """The outputs at ``step`` (every process calls; the main one writes) into intermediate/<name>/.
        ``sampled``: the loop made this step's grid (sampling.every_steps; ``step_grid`` its file on the main
        process, None elsewhere or where it failed): the same prompts, seed and weights, so it is copied, not
        sampled a second time."""
        label = outputs.intermediate_name(
            export.output_name(cfg.output.name, out_dir), epoch=epoch, step=step
        )
        folder = outputs.intermediate_folder(out_dir / outputs.INTERMEDIATE, label, state.images_seen)
        label = folder.name
        files: list[Path] = []
        reached = epoch if epoch is not None else runtime.epochs_value(step / plan.steps_per_epoch)
        ds_masters.gather(recipe)  # every process: DeepSpeed's fp32 masters for the export (a collective)
        if accelerator.is_main_process:
            with outputs.write_errors(folder, needed_bytes=export_bytes):
                outputs.record_point(folder, step=step, images=state.images_seen)
            meta = outputs.run_metadata(
                cfg,
                steps=step,
                epochs=reached,
                prediction_type=comps.prediction_type,
                mixed_precision=accelerator.mixed_precision,
            )
            with outputs.write_errors(folder, needed_bytes=export_bytes), recipe.output_name(label):
                files += recipe.export(folder, meta, ema)
        grid = None
        fallback = recipe.sample_prompt()  # no sampling.prompts: a caption, as the every-N and final grids
        if (cfg.sampling.prompts or fallback) and not sampled:
            grid = sample(step, fallback=fallback, out_path=folder / "samples.png")
        elif step_grid is not None:
            grid = outputs.copy_grid(accelerator, step_grid, folder / "samples.png")
        files += [grid] if grid else []
        accelerator.wait_for_everyone()
        state.intermediate_outputs.append(
            {
                "epoch": reached,
                "step": step,
                "images_seen": state.images_seen,
                "files": [str(f) for f in files],
            }
        )
        progress.say(accelerator, f"saved the outputs of step {step} in {folder}")

    def resume_save_at(step: int, epoch: int | None) -> None:
        """A resume at a step due a save (the earlier session ended there: its final outputs, or a
        training.max_steps stop, of a run now extended): that step's outputs, from the weights just loaded, unless
        the run's record (the checkpoint's, the same on every process; kept only for a save that finished) has
        them. The grid the earlier session made at that point (its every-N or final grid) is copied: the main
        process looks, and tells the others, which then sample nothing either."""
        if any(
            o.get("images_seen") == state.images_seen if "images_seen" in o else o["step"] == step
            for o in state.intermediate_outputs
        ):
            return
        found: list[str | None] = [None]
        if accelerator.is_main_process:
            samples_dir = Path(cfg.output.dir) / "samples"
            for grid in (outputs.grid_path(samples_dir, step, state.images_seen), samples_dir / "final.png"):
                if grid.is_file() and outputs.point_of(grid) == state.images_seen:
                    found[0] = str(grid)
                    break
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(found)
        earlier = Path(found[0]) if found[0] is not None and accelerator.is_main_process else None
        save_intermediate(step, epoch, earlier, found[0] is not None)

    finished = False  # the loop ran to its end: the TensorBoard log stays open for the final grid
    said_grids = False  # the every-N grids' line, printed at the first
    disk_checked = resume_from is not None  # checked at the resumed checkpoint, or at this session's first
    base = None if resume_from is not None else base_models(recipe)  # where a step-1 NaN can come from
    try:
        with stops.StopSignals() as stop:
            if resume_save is not None:
                resume_save_at(*resume_save)
            while state.global_step < plan.total_steps:
                if state.batches_in_epoch >= len(loader):  # the checkpoint was taken at an epoch's end
                    state.start_epoch(state.epoch + 1)
                dataset.set_epoch(state.epoch)
                batches.set_epoch(state.epoch)
                loader.set_epoch(state.epoch)
                state.epoch_order = batches.sampler.order_digest(state.epoch)  # checkpoints record it
                epoch_loader = accelerator.skip_first_batches(loader, state.batches_in_epoch)
                current = None
                for batch in epoch_loader:
                    if current is None:
                        current = _Step(
                            state.global_step + 1, accelerator, cfg, injected, stop, ckpt, params, base
                        )
                    optimizer_step(
                        recipe,
                        optimizer,
                        batch,
                        current.generator,
                        micro=state.batches_in_epoch + current.micro,
                        on_forward=current.forward,
                        on_boundary=current.boundary,
                    )
                    if not accelerator.sync_gradients:
                        continue
                    step, mean_loss = current.number, current.mean_loss
                    lr_scheduler.step()
                    if ema is not None and step % ema.every == 0:
                        ema.step(ds_masters.parameters(recipe.trained["unet"], accelerator))
                    state.global_step = step
                    state.batches_in_epoch += current.micro
                    state.samples_in_epoch += current.images
                    state.images_in_epoch += current.images_all  # all processes' (the checkpoint is rank 0's)
                    state.images_seen += current.images_all
                    state.record_loss(step, mean_loss)
                    stop_now, current = current.stop_now, None
                    bar.update(step, mean_loss)
                    progress.log_step(tb, bar, step, mean_loss, lr_scheduler, state.images_seen)
                    # a grid every N steps (no prompts: a caption, as at the end); at the last step the final
                    # grid shows the same weights, so none is made twice
                    every = cfg.sampling.every_steps
                    sampled = bool(every) and step % every == 0 and step < plan.total_steps
                    if sampled and not said_grids:  # the bar stands still while it samples: said once
                        said_grids = True
                        bar.print(
                            f"sampling a grid every {count_of(every, 'step')} into {out_dir / 'samples'} "
                            f"({count_of(len(cfg.sampling.prompts) or 1, 'prompt')} x "
                            f"{count_of(cfg.sampling.num_inference_steps, 'denoising step')}): training pauses "
                            "meanwhile"
                        )
                    step_grid = sample(step, fallback=recipe.sample_prompt()) if sampled else None
                    if step in saves_at:
                        save_intermediate(step, saves_at[step], step_grid, sampled)
                    saved = ckpt.maybe_save()
                    if saved is not None and not disk_checked:  # the first this session: its size is known
                        disk_checked = True
                        check_disk(saved, bar.print)
                    if stop_now:
                        path = ckpt.last_saved if ckpt.last_saved_step == step else ckpt.save("interrupt")
                        raise stops.TrainingInterrupted(step, path)
                    if step >= plan.total_steps:
                        break
                else:
                    state.start_epoch(state.epoch + 1)
        finished = True
    except torch.OutOfMemoryError as e:
        report = stops.write_oom_report(out_dir, step=state.global_step + 1, cfg=cfg, message=str(e))
        raise stops.OutOfMemoryStop(state.global_step + 1, report, str(e)) from None
    except (SdplanError, KeyboardInterrupt):
        raise
    except Exception:
        stops.checkpoint_on_error(accelerator, ckpt, state)
        raise
    finally:
        bar.close()
        if finished:  # closed after the final grid, which it shows too (a flush that fails: the close says)
            with suppress(OSError):
                tb.flush()
        else:  # an error is on its way: closing the log quietly (a full disk flushing it must not replace it)
            with suppress(Exception):
                tb.close()

    # 6. Outputs, after a checkpoint of the final step (with checkpoints off: when the export fails).
    try:  # the TensorBoard log is closed however the outputs end (a failed export too)
        peak = runtime.gather_max(accelerator, runtime.peak_memory_bytes(accelerator))
        accelerator.wait_for_everyone()
        checkpoints_on = bool(cfg.checkpoints.every_steps or cfg.checkpoints.keep_every_steps)
        if checkpoints_on and ckpt.last_saved_step != state.global_step:  # seconds to minutes, said
            progress.say(accelerator, f"writing the checkpoint of the final step {state.global_step}")
        final_ckpt = _checkpoint_final(ckpt, state, accelerator) if checkpoints_on else None
        written: list[Path] = []
        epochs_done = runtime.epochs_value(state.global_step / plan.steps_per_epoch)
        ds_masters.gather(recipe)  # every process: DeepSpeed's fp32 masters for the export (a collective)
        if accelerator.is_main_process:
            from . import plots

            meta = outputs.run_metadata(
                cfg,
                steps=state.global_step,
                epochs=epochs_done,
                prediction_type=comps.prediction_type,
                mixed_precision=accelerator.mixed_precision,
            )
            progress.say(  # a full model's export (and its EMA copy) takes minutes: said before it starts
                accelerator,
                f"writing the trained weights into {out_dir}"
                + (" (and the EMA weights into ema/)" if ema else ""),
            )
            try:
                written += recipe.export(out_dir, meta, ema)
            except Exception as e:
                if final_ckpt is None and accelerator.num_processes == 1:
                    final_ckpt = _checkpoint_final(ckpt, state, accelerator)
                raise outputs.export_error(
                    e, out_dir, needed_bytes=export_bytes, checkpoint=final_ckpt
                ) from None
            with outputs.write_errors(out_dir):  # the weights are out; a full disk now is still one line
                n_prompts = len(cfg.sampling.prompts) or 1
                progress.say(  # seconds to minutes on a real model: outputs.samples shows a bar
                    accelerator,
                    f"sampling the final grid: {count_of(n_prompts, 'prompt')} x "
                    f"{count_of(cfg.sampling.num_inference_steps, 'step')}",
                )
                try:
                    grid = sample(fallback=recipe.sample_prompt(), at_step=state.global_step)
                except (
                    torch.OutOfMemoryError
                ):  # a preview: the weights are written, the run is not lost for it
                    grid = None
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                    progress.say(
                        accelerator,
                        "skipped the final sample grid: it ran out of GPU memory (the VAE and text encoders come "
                        f"back beside the training state); the trained weights are in {out_dir}",
                    )
                written += [grid] if grid else []
                every = cfg.sampling.every_steps
                if (
                    grid and every and state.global_step % every == 0
                ):  # the loop left the last step's grid to it
                    samples_dir = Path(cfg.output.dir) / "samples"
                    outputs.copy_grid(
                        accelerator,
                        grid,
                        outputs.grid_path(samples_dir, state.global_step, state.images_seen),
                    )
                history = state.loss_history()  # x axis: images seen (steps change scale on a moved resume)
                written.append(
                    plots.loss_curve(
                        history["images_seen"], history["losses"], out_dir / "loss.png", xlabel="images seen"
                    )
                )
                written.append(outputs.write_loss_history(out_dir, history))
    except BaseException:  # closed quietly: a full disk flushing the log must not hide the error that stopped
        with suppress(Exception):  # the outputs (DiskFull is one line; an OSError is a traceback)
            tb.close()
        raise
    try:  # the outputs are written: a log that cannot be flushed (a full disk) is said, not the run's end
        tb.close()
    except OSError as e:
        progress.say(accelerator, f"the TensorBoard log in {out_dir / 'logs'} could not be closed: {e}")
    accelerator.wait_for_everyone()
    summary = (
        _write_summary(
            out_dir,
            method=cfg.method,
            steps=state.global_step,
            epochs=epochs_done,
            images_seen=state.images_seen,
            num_processes=accelerator.num_processes,
            final_loss=state.losses[-1] if state.losses else None,
            wall_seconds=state.wall_seconds + time.perf_counter() - t0,  # over the run's sessions
            peak_memory_bytes=peak,
            outputs=written,
            intermediate_outputs=state.intermediate_outputs,
            sample_grid_failures=state.sample_grid_failures,
            sampling_seconds=state.sampling_seconds,
        )
        if accelerator.is_main_process
        else {}
    )
    if accelerator.is_main_process:  # the run is finished: a checkpoint from before its end must not resume
        for path in ckpt_lib.remove_passed(out_dir, state.images_seen):
            progress.say(accelerator, ckpt_lib.removed_line(path))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def _long_captions(dataset, comps) -> str:
    """The captions the text encoder that reads the most (T5 for SD3.5 / FLUX.1, CLIP otherwise) cuts."""
    reader = conditioning.reading_tokenizer(comps)
    if reader is None:
        return ""
    captions = [dataset.caption_for(item, i) for i, item in enumerate(dataset.items)]
    return conditioning.long_captions_note(reader[0], captions, reader[1])


def _long_prompts(prompts: list[str], comps) -> str:
    """The sample prompts (``sampling.prompts``) that text encoder cuts: said once, as the captions are (a
    prompt was cut without a word, and its grid label showed the end it had dropped)."""
    reader = conditioning.reading_tokenizer(comps)
    if reader is None or not prompts:
        return ""
    return conditioning.long_captions_note(reader[0], list(prompts), reader[1], "sample prompt", prompts=True)


def _checkpoint_final(ckpt, state, accelerator) -> Path | None:
    """A checkpoint of the final step (the one there already, or a new rolling one); None when it cannot be
    written (said on the main process: the export is still tried)."""
    if ckpt.last_saved is not None and ckpt.last_saved_step == state.global_step:
        return ckpt.last_saved
    try:
        return ckpt.save("rolling")
    except Exception as e:  # the outputs may still fit; the export says what is lost if not
        progress.say(accelerator, f"could not checkpoint the final step: {e}")
        return None


def _write_summary(out_dir: Path, **fields) -> dict:
    with outputs.write_errors(out_dir):
        return outputs.write_run_summary(out_dir, **fields)
