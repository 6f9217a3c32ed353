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


class DiffusionObjective:
    """The DDPM-style objective of SD 1.x/2.x/SDXL: noise the latents at a random timestep and predict the
    noise (epsilon) or the velocity (v-prediction), as the model's scheduler says. Another objective (flow
    matching, for SD3.5/FLUX) is another class with the same two methods."""

    def __init__(self, noise_scheduler, noise_offset: float = 0.0):
        self.noise_scheduler, self.noise_offset = noise_scheduler, noise_offset

    def corrupt(self, latents, generator):
        """(model input, timesteps, target) for clean ``latents``; randomness from ``generator``."""
        noisy, noise, timesteps = noisy_latents(self.noise_scheduler, latents, generator, self.noise_offset)
        return noisy, timesteps, diffusion_target(self.noise_scheduler, latents, noise, timesteps)

    def loss(self, pred, target, reduction: str = "mean"):
        return mse(pred, target, reduction)
