"""Images to latents: the VAE posterior, sampling it with the step's generator, and the latent cache
(in memory or on disk) filled before training so the VAE can leave the GPU.
"""

from __future__ import annotations

from pathlib import Path

from .progress import say


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

    from .progress import Progress

    # a VAE pass over every sample of every epoch takes minutes on a real dataset: show it (main process)
    progress = Progress(
        accelerator, sum(len(ds) for ds in datasets) * epochs, description="caching latents", unit="sample"
    )
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress.update(done)

    def fill() -> int:
        return sum(cache.precompute(ds, encode, epochs=range(epochs), on_sample=tick) for ds in datasets)

    try:
        if cache.dir is None:  # in memory: each process fills its own
            encoded = fill()
        else:  # on disk: the main process encodes, the others then find the files
            encoded = fill() if accelerator.is_main_process else 0
            accelerator.wait_for_everyone()
            if not accelerator.is_main_process:
                fill()
    finally:
        progress.close()
    say(accelerator, f"latent cache: {encoded} encoded, {len(cache)} cached")


def offload(*models) -> None:
    """Move models off the GPU (to system RAM) once their outputs are cached."""
    import torch

    for m in models:
        if m is not None:
            m.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Latents:
    """Where a recipe gets a batch's latents: the VAE's posterior, through the latent cache when there is one
    (``sdplan bench`` hands synthetic latents instead)."""

    def __init__(self, vae, device, cache=None):
        self.vae, self.device, self.cache = vae, device, cache

    def __call__(self, batch: dict, generator):
        return batch_latents(self.vae, batch, generator, self.device, self.cache)
