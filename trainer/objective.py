"""The denoising objective: noise and timesteps drawn from the step's generator, the scheduler's
target (epsilon or v-prediction) and the loss.
"""

from __future__ import annotations

from sdplan.errors import SdplanError


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


def min_snr_weights(noise_scheduler, timesteps, gamma: float):
    """Min-SNR-gamma loss weights per sample (Hang et al. 2023, as diffusers' training scripts and kohya's
    apply_snr_weight): min(SNR(t), gamma) / SNR(t) for epsilon, / (SNR(t) + 1) for v-prediction, with
    SNR = alphas_cumprod / (1 - alphas_cumprod). A zero terminal SNR (ztsnr) weighs 0, not 0/0 (NaN) under
    epsilon."""
    import torch

    alphas = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    snr = alphas / (1.0 - alphas).clamp_min(1e-20)
    capped = torch.minimum(snr, torch.full_like(snr, float(gamma)))
    if noise_scheduler.config.prediction_type == "v_prediction":
        return capped / (snr + 1.0)
    return capped / snr.clamp_min(1e-8)


class DiffusionObjective:
    """The DDPM-style objective of SD 1.x/2.x/SDXL: noise the latents at a random timestep and predict the
    noise (epsilon) or the velocity (v-prediction), as the model's scheduler says; with ``min_snr_gamma`` each
    sample's loss weighs its Min-SNR weight. Another objective (flow matching, for SD3.5/FLUX) is another class
    with the same methods."""

    def __init__(self, noise_scheduler, noise_offset: float = 0.0, min_snr_gamma: float | None = None):
        self.noise_scheduler, self.noise_offset = noise_scheduler, noise_offset
        self.min_snr_gamma = min_snr_gamma

    def corrupt(self, latents, generator):
        """(model input, timesteps, target) for clean ``latents``; randomness from ``generator``."""
        noisy, noise, timesteps = noisy_latents(self.noise_scheduler, latents, generator, self.noise_offset)
        return noisy, timesteps, diffusion_target(self.noise_scheduler, latents, noise, timesteps)

    def weigh(self, pred, target, timesteps):
        """(pred, target) each scaled by sqrt(w) per sample, so the MSE is the w-weighted one (w: Min-SNR); as
        they are without ``min_snr_gamma``."""
        if not self.min_snr_gamma:
            return pred, target
        w = min_snr_weights(self.noise_scheduler, timesteps, self.min_snr_gamma).sqrt()
        w = w.view(-1, *([1] * (pred.dim() - 1)))
        return pred.float() * w, target.float() * w

    def loss(self, pred, target, reduction: str = "mean"):
        return mse(pred, target, reduction)
