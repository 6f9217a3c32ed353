"""Textual inversion: a new token (or ``num_vectors`` of them) whose embedding is the only thing trained.

The token is added to the tokenizer(s), its embedding row(s) start from ``init_token``'s (the mean, when
``init_token`` is several tokens), and after every optimizer step all other rows are put back (as the diffusers
example does), so the model is unchanged except for the new word. Captions without the token get it in front
(no caption: ``a photo of <token>``). SDXL: both text encoders learn an embedding. Output:
``learned_embeds.safetensors`` (``pipe.load_textual_inversion``), a sample grid, ``loss.png``,
``run_summary.json``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from sdplan.config import TrainConfig
from sdplan.errors import SdplanError, UsageError

from .. import checkpoint as ckpt_lib
from .. import common, data, models


def train(cfg: TrainConfig, *, resume: str | None = None) -> dict:
    t0 = time.perf_counter()
    out_dir = Path(cfg.output.dir)
    tcfg, ti = cfg.training, cfg.textual_inversion

    # 1. Inputs first: a bad model path or an empty dataset fails before anything loads.
    source = models.resolve_source(cfg.model.path)
    dataset, scan = data.build_dataset(cfg)
    resume_from = ckpt_lib.resolve_resume(resume or cfg.checkpoints.resume, out_dir)
    accelerator = common.make_accelerator(cfg, out_dir)
    device = accelerator.device
    common.describe_data(accelerator, dataset, scan)

    # 2. The model, frozen; the new token(s) added to each tokenizer and text encoder.
    comps = models.load_components(
        cfg.model.path,
        family=cfg.model.family,
        revision=cfg.model.revision,
        variant=cfg.model.variant,
        source=source,
        config_dir=cfg.model.config_dir,
    )
    unet, vae, text_encoders = comps.unet, comps.vae, comps.text_encoders
    wdtype = common.weight_dtype(accelerator)
    for m in (unet, vae, *text_encoders):
        m.requires_grad_(False)
    common.place(unet, device, wdtype)
    common.place(vae, device, common.vae_dtype(accelerator))
    placeholders = [ti.token] + [f"{ti.token}_{i}" for i in range(1, ti.num_vectors)]
    token_ids = [
        _add_tokens(tok, te, placeholders, ti.init_token) for tok, te in zip(comps.tokenizers, text_encoders)
    ]
    trained = {}
    for i, te in enumerate(text_encoders):
        common.place(te, device, torch.float32)  # the embedding trains in fp32
        te.get_input_embeddings().weight.requires_grad_(True)
        trained[f"text_encoder_{i}"] = te
    common.use_sdpa(unet, vae)
    if cfg.memory.gradient_checkpointing:
        common.enable_gradient_checkpointing(unet, *text_encoders)
    # What the other rows must stay: restored after every optimizer step.
    original_rows = [te.get_input_embeddings().weight.detach().clone() for te in text_encoders]
    keep_rows = []
    for ids, rows in zip(token_ids, original_rows):
        keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        keep[ids] = False
        keep_rows.append(keep)

    # 3. Optimizer, data loader, step arithmetic, LR schedule.
    groups = [
        {"params": [te.get_input_embeddings().weight for te in text_encoders], "lr": tcfg.learning_rate}
    ]
    optimizer = common.make_optimizer(groups, cfg)
    loader, batches = common.make_loader(dataset, cfg, device)
    common.check_deepspeed(accelerator, trained)
    names = list(trained)
    prepared = accelerator.prepare(*trained.values(), optimizer, loader)
    trained = dict(zip(names, prepared[: len(names)]))
    optimizer, loader = prepared[len(names) :]
    text_encoders = [trained[f"text_encoder_{i}"] for i in range(len(text_encoders))]
    plan = common.plan_steps(
        batches_per_epoch=len(loader),
        grad_accum=tcfg.grad_accum,
        epochs=tcfg.epochs,
        max_steps=tcfg.max_steps,
        warmup_steps=tcfg.lr_warmup_steps,
        num_processes=accelerator.num_processes,
    )
    lr_scheduler = common.make_lr_scheduler(optimizer, cfg, plan)
    accelerator.register_for_checkpointing(lr_scheduler)
    params = [p for g in groups for p in g["params"]]

    # Cached VAE (and frozen text-encoder) outputs: computed once, then those models leave the GPU.
    latent_cache = common.make_latent_cache(cfg, vae, out_dir)
    common.precompute_latents(accelerator, latent_cache, vae, [dataset], plan.epochs)
    text_cache = None  # the text encoders train here
    common.offload(vae if latent_cache else None)

    # 4. Checkpoints and resume.
    state = ckpt_lib.TrainState(
        batch_size=tcfg.batch_size,
        grad_accum=tcfg.grad_accum,
        num_processes=accelerator.num_processes,
        method=cfg.method,
    )
    ckpt = ckpt_lib.Checkpointer(
        accelerator,
        out_dir,
        state,
        get_weights=lambda: _rows(text_encoders, token_ids),
        set_weights=lambda sd: _set_rows(text_encoders, token_ids, sd),
        every_steps=cfg.checkpoints.every_steps,
        keep_every_steps=cfg.checkpoints.keep_every_steps,
    )
    if resume_from is not None:
        ckpt.load(resume_from)
        ckpt_lib.apply_learning_rates(optimizer, lr_scheduler, [g["lr"] for g in groups])
        common.say(accelerator, f"resumed from {resume_from} at step {state.global_step}")
    common.say(accelerator, common.describe_plan("textual-inversion", comps.family, len(dataset), cfg, plan))

    def loss_for(batch, generator):
        batch = dict(batch, caption=[_with_token(c, ti.token, placeholders) for c in batch["caption"]])
        latents = common.batch_latents(vae, batch, generator, device, latent_cache).to(wdtype)
        noisy, noise, timesteps = common.noisy_latents(
            comps.noise_scheduler, latents, generator, tcfg.noise_offset
        )
        embeds, added = common.unet_conditioning(comps, batch, text_encoders, device, wdtype, text_cache)
        pred = unet(noisy, timesteps, embeds, added_cond_kwargs=added, return_dict=False)[0]
        return common.mse(pred, common.diffusion_target(comps.noise_scheduler, latents, noise, timesteps))

    # 5. The loop.
    for m in trained.values():
        m.train()
    tb = common.tensorboard(accelerator, cfg)
    progress = common.Progress(
        accelerator, plan.max_steps, initial=state.global_step, description="textual-inversion"
    )
    try:
        with common.StopSignals() as stop:
            while state.global_step < plan.max_steps:
                if state.batches_in_epoch >= len(loader):  # the checkpoint was taken at an epoch's end
                    state.epoch, state.batches_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                dataset.set_epoch(state.epoch)
                batches.set_epoch(state.epoch)
                loader.set_epoch(state.epoch)
                epoch_loader = accelerator.skip_first_batches(loader, state.batches_in_epoch)
                micro, images, loss_sum, generator = 0, 0, torch.zeros((), device=device), None
                for batch in epoch_loader:
                    step = state.global_step + 1
                    if generator is None:
                        generator = common.seed_step(tcfg.seed, accelerator.process_index, step)
                    n = len(batch["caption"])
                    with accelerator.accumulate(*trained.values()):
                        loss = common.inject_failures(step, tcfg.batch_size, loss_for(batch, generator))
                        accelerator.backward(loss)
                        micro, images = micro + 1, images + n
                        loss_sum = loss_sum + loss.detach()
                        if accelerator.sync_gradients:
                            mean_loss, step_images, stop_now, bad = common.reduce_step_stats(
                                accelerator, loss_sum, micro, images, stop.requested is not None
                            )
                            if bad:
                                raise common.stop_on_nan(ckpt, params, step, cfg)
                            if tcfg.max_grad_norm > 0:
                                accelerator.clip_grad_norm_(params, tcfg.max_grad_norm)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=cfg.memory.set_grads_to_none)
                        if accelerator.sync_gradients:  # only the new token's rows may change
                            with torch.no_grad():
                                for te, rows, keep in zip(text_encoders, original_rows, keep_rows):
                                    weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
                                    weight[keep] = rows[keep]
                    if not accelerator.sync_gradients:
                        continue
                    lr_scheduler.step()
                    state.global_step = step
                    state.batches_in_epoch += micro
                    state.samples_in_epoch += images
                    state.images_seen += step_images
                    state.losses.append(mean_loss)
                    micro, images, loss_sum, generator = 0, 0, torch.zeros((), device=device), None
                    progress.update(step, mean_loss)
                    common.log_step(tb, progress, step, mean_loss, lr_scheduler)
                    if cfg.sampling.every_steps and step % cfg.sampling.every_steps == 0:
                        common.samples(accelerator, comps, unet, text_encoders, cfg, step=step, tb=tb)
                    ckpt.maybe_save()
                    if stop_now:
                        path = ckpt.last_saved if ckpt.last_saved_step == step else ckpt.save("interrupt")
                        raise common.TrainingInterrupted(step, path)
                    if step >= plan.max_steps:
                        break
                else:
                    state.epoch, state.batches_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
    except torch.OutOfMemoryError as e:
        report = common.write_oom_report(out_dir, step=state.global_step + 1, cfg=cfg, message=str(e))
        raise common.OutOfMemoryStop(state.global_step + 1, report, str(e)) from None
    except (SdplanError, KeyboardInterrupt):
        raise
    except Exception:
        common.checkpoint_on_error(accelerator, ckpt, state)
        raise
    finally:
        progress.close()
        tb.close()

    # 6. Outputs: the learned embedding(s).
    peak = common.gather_max(accelerator, common.peak_memory_bytes(accelerator))
    accelerator.wait_for_everyone()
    outputs: list[Path] = []
    epochs_done = round(state.global_step / plan.steps_per_epoch, 3)
    if accelerator.is_main_process:
        from .. import export, plots

        meta = common.output_metadata(
            cfg, steps=state.global_step, epochs=epochs_done, prediction_type=comps.prediction_type
        )
        rows = list(_rows(text_encoders, token_ids).values())
        embeds = {"clip_l": rows[0], "clip_g": rows[1]} if comps.family == "sdxl" else rows[0]
        outputs.append(
            export.save_embedding(
                out_dir,
                token=ti.token,
                embeds=embeds,
                metadata=meta,
                name=cfg.output.name,
                family=comps.family,
            )
        )
        fallback = f"a photo of {ti.token}"
        grid = common.samples(accelerator, comps, unet, text_encoders, cfg, fallback=fallback)
        outputs += [grid] if grid else []
        outputs.append(
            plots.loss_curve(list(range(1, len(state.losses) + 1)), state.losses, out_dir / "loss.png")
        )
        outputs.append(common.write_loss_history(out_dir, state.losses))
    accelerator.wait_for_everyone()
    summary = (
        common.write_run_summary(
            out_dir,
            method=cfg.method,
            steps=state.global_step,
            epochs=epochs_done,
            images_seen=state.images_seen,
            num_processes=accelerator.num_processes,
            final_loss=state.losses[-1] if state.losses else None,
            wall_seconds=time.perf_counter() - t0,
            peak_memory_bytes=peak,
            outputs=outputs,
        )
        if accelerator.is_main_process
        else {}
    )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


def _add_tokens(tokenizer, text_encoder, placeholders: list[str], init_token: str) -> list[int]:
    """Add the placeholder tokens; their embedding rows start as ``init_token``'s (mean of its pieces)."""
    added = tokenizer.add_tokens(placeholders)
    if added != len(placeholders):
        raise UsageError(
            f"textual_inversion.token {placeholders[0]!r} is already in the tokenizer",
            fix="pick a new word, e.g. <my-subject>",
        )
    init_ids = tokenizer.encode(init_token, add_special_tokens=False)
    if not init_ids:
        raise UsageError(f"textual_inversion.init_token {init_token!r} encodes to no token")
    ids = tokenizer.convert_tokens_to_ids(placeholders)
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        weight = text_encoder.get_input_embeddings().weight
        weight[ids] = weight[init_ids].mean(dim=0, keepdim=True)
    return ids


def _with_token(caption: str, token: str, placeholders: list[str]) -> str:
    """The caption with the token (put in front when missing), spelled out as all its vectors."""
    if not caption:
        caption = f"a photo of {token}"
    elif token not in caption:
        caption = f"{token}, {caption}"
    return re.sub(re.escape(token) + r"(?!_\d)", " ".join(placeholders), caption)


def _rows(text_encoders, token_ids) -> dict:
    """The trained rows: ``{"text_encoder_<i>.embeds": [num_vectors, dim]}`` (CPU copies)."""
    out = {}
    for i, (te, ids) in enumerate(zip(text_encoders, token_ids)):
        weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
        out[f"text_encoder_{i}.embeds"] = weight[ids].detach().to("cpu").clone()
    return out


def _set_rows(text_encoders, token_ids, state: dict) -> None:
    with torch.no_grad():
        for i, (te, ids) in enumerate(zip(text_encoders, token_ids)):
            key = f"text_encoder_{i}.embeds"
            if key not in state or state[key].shape[0] != len(ids):
                raise ckpt_lib.CheckpointError(f"checkpoint has no {len(ids)}-vector embedding {key}")
            weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
            weight[ids] = state[key].to(weight.device, weight.dtype)
