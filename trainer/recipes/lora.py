"""LoRA: low-rank adapters on the UNet's attention projections (optionally the text encoder(s)), with peft.

The base model stays frozen (in half precision under mixed precision); only the adapters train, in fp32.
Outputs: the LoRA in diffusers/peft format (``pipe.load_lora_weights``) and in kohya format (A1111, ComfyUI),
a sample grid, ``loss.png`` and ``run_summary.json``.

Read top to bottom: data (fails before any model loads), model, adapters, optimizer and schedule, the loop
(gradient accumulation, checkpoints, stop on Ctrl-C / SIGTERM / NaN), outputs.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sdplan.config import TrainConfig
from sdplan.errors import SdplanError

from .. import checkpoint as ckpt_lib
from .. import common, data, models


def train(cfg: TrainConfig, *, resume: str | None = None) -> dict:
    t0 = time.perf_counter()
    out_dir = Path(cfg.output.dir)
    tcfg = cfg.training

    # 1. Everything that can be wrong with the inputs, before anything heavy loads.
    source = models.resolve_source(cfg.model.path)
    dataset, scan = data.build_dataset(cfg)
    resume_from = ckpt_lib.resolve_resume(resume or cfg.checkpoints.resume, out_dir)
    accelerator = common.make_accelerator(cfg, out_dir)
    device = accelerator.device
    common.describe_data(accelerator, dataset, scan)

    # 2. The base model, frozen.
    comps = models.load_components(
        cfg.model.path,
        family=cfg.model.family,
        revision=cfg.model.revision,
        variant=cfg.model.variant,
        source=source,
        config_dir=cfg.model.config_dir,
    )
    unet, vae, text_encoders = comps.unet, comps.vae, comps.text_encoders
    for m in (unet, vae, *text_encoders):
        m.requires_grad_(False)
    wdtype = common.weight_dtype(accelerator)
    common.place(unet, device, wdtype)
    common.place(vae, device, common.vae_dtype(accelerator))
    for te in text_encoders:
        common.place(te, device, wdtype)
    common.use_sdpa(unet, vae)

    # 3. Adapters (seeded: every process starts from the same weights).

    torch.manual_seed(tcfg.seed)
    trained = common.add_lora_adapters(unet, text_encoders, cfg.lora, tcfg.train_text_encoder)
    if cfg.memory.gradient_checkpointing:
        common.enable_gradient_checkpointing(*trained.values())

    # 4. Optimizer, data loader, step arithmetic, LR schedule.
    groups = [{"params": [p for p in unet.parameters() if p.requires_grad], "lr": tcfg.learning_rate}]
    if tcfg.train_text_encoder:
        te_params = [p for te in text_encoders for p in te.parameters() if p.requires_grad]
        groups.append({"params": te_params, "lr": tcfg.text_encoder_learning_rate or tcfg.learning_rate})
    optimizer = common.make_optimizer(groups, cfg)
    loader, batches = common.make_loader(dataset, cfg, device)
    common.check_deepspeed(accelerator, trained)
    names = list(trained)
    prepared = accelerator.prepare(*trained.values(), optimizer, loader)
    trained = dict(zip(names, prepared[: len(names)]))
    optimizer, loader = prepared[len(names) :]
    unet = trained["unet"]
    if tcfg.train_text_encoder:
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
    text_cache = None
    if not tcfg.train_text_encoder:
        captions = common.epoch_captions(dataset, plan.epochs)
        text_cache = common.make_text_cache(accelerator, cfg, comps, text_encoders, captions, device)
    common.offload(vae if latent_cache else None, *(text_encoders if text_cache else []))

    # 5. Checkpoints and resume.
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
        get_weights=lambda: ckpt_lib.trainable_state_dict(trained),
        set_weights=lambda sd: ckpt_lib.load_trainable_state_dict(trained, sd),
        every_steps=cfg.checkpoints.every_steps,
        keep_every_steps=cfg.checkpoints.keep_every_steps,
    )
    if resume_from is not None:
        ckpt.load(resume_from)
        ckpt_lib.apply_learning_rates(optimizer, lr_scheduler, [g["lr"] for g in groups])
        common.say(accelerator, f"resumed from {resume_from} at step {state.global_step}")
    common.say(accelerator, common.describe_plan("lora", comps.family, len(dataset), cfg, plan))

    def loss_for(batch, generator):
        latents = common.batch_latents(vae, batch, generator, device, latent_cache).to(wdtype)
        noisy, noise, timesteps = common.noisy_latents(
            comps.noise_scheduler, latents, generator, tcfg.noise_offset
        )
        embeds, added = common.unet_conditioning(comps, batch, text_encoders, device, wdtype, text_cache)
        pred = unet(noisy, timesteps, embeds, added_cond_kwargs=added, return_dict=False)[0]
        return common.mse(pred, common.diffusion_target(comps.noise_scheduler, latents, noise, timesteps))

    # 6. The loop.
    for m in trained.values():
        m.train()
    tb = common.tensorboard(accelerator, cfg)
    progress = common.Progress(accelerator, plan.max_steps, initial=state.global_step, description="lora")
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
                    with accelerator.accumulate(*trained.values()):
                        loss = common.inject_failures(step, tcfg.batch_size, loss_for(batch, generator))
                        accelerator.backward(loss)
                        micro, images = micro + 1, images + len(batch["caption"])
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

    # 7. Outputs.
    peak = common.gather_max(accelerator, common.peak_memory_bytes(accelerator))
    accelerator.wait_for_everyone()
    outputs: list[Path] = []
    if accelerator.is_main_process:
        from .. import export, plots

        epochs_done = round(state.global_step / plan.steps_per_epoch, 3)
        meta = common.output_metadata(
            cfg, steps=state.global_step, epochs=epochs_done, prediction_type=comps.prediction_type
        )
        unet_u = ckpt_lib.unwrap(unet)
        tes_u = [ckpt_lib.unwrap(te) for te in text_encoders] if tcfg.train_text_encoder else []
        outputs += export.save_lora(
            out_dir,
            unet=unet_u,
            text_encoders=tes_u,
            family=comps.family,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            metadata=meta,
            name=cfg.output.name,
            kohya=cfg.output.save_kohya,
        )
        grid = common.samples(
            accelerator, comps, unet, text_encoders, cfg, fallback=dataset.caption_for(dataset.items[0], 0)
        )
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
            epochs=round(state.global_step / plan.steps_per_epoch, 3),
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
