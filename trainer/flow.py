"""SD3.5 and FLUX.1: the rectified-flow objective and the transformer families' denoiser call.

What the loop's recipes take from here (``Recipe.adapter``, set from the components) is the two pieces the
UNet families have in ``objective.DiffusionObjective`` and ``Recipe.predict``:

- :class:`FlowMatchingObjective`: a sample on the straight line between the clean latents and Gaussian noise,
  ``x_t = (1 - sigma) * x_0 + sigma * noise``; the network predicts the velocity ``noise - x_0``. The sigma of a
  sample is drawn as diffusers' SD3/FLUX DreamBooth LoRA examples draw it: a density ``u`` over [0, 1]
  (uniform, logit-normal or the SD3 paper's "mode" density), then the training scheduler's sigma at index
  ``u * num_train_timesteps`` (so the scheduler's ``shift`` applies); the loss weight per sample follows the
  same scheme (``sigma_sqrt``: 1/sigma^2, ``cosmap``, else 1).
- :class:`FlowAdapter`: text conditioning (SD3: CLIP-L and CLIP-G penultimate hidden states concatenated,
  zero-padded to the T5 width and joined with the T5 tokens along the sequence, pooled = both CLIPs' projected
  outputs; FLUX: the T5 tokens, pooled = CLIP-L's pooled output), FLUX's 2x2 latent packing with its image
  position ids and zero text ids, the guidance embedding of FLUX.1 [dev], SD3's timestep in [0, 1000] and
  FLUX's in [0, 1], and SD3's preconditioned output (the example's ``--precondition_outputs``: the network's
  velocity turned into a clean-latent estimate, compared with the clean latents).

Per-family defaults are those of the diffusers examples (``train_dreambooth_lora_sd3.py``: logit-normal
sampling, preconditioned outputs, T5 77 tokens there but 256 here as the pipeline and kohya use;
``train_dreambooth_lora_flux.py``: uniform sampling, no weighting, guidance 1 as its README runs it).
The per-sample weight w enters the MSE as ``sqrt(w) * pred`` against ``sqrt(w) * target``, so
``objective.loss(pred, target)`` stays a plain mean squared error (DreamBooth's prior split works unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdplan import registry
from sdplan.config import family_problems
from sdplan.errors import UsageError

from .objective import mse

WEIGHTINGS = ("none", "logit_normal", "mode", "sigma_sqrt", "cosmap")
# What the one loop trains for these families (textual inversion: not for a T5-conditioned model here); the
# registry owns the list, which the planner plans too.
METHODS = registry.FLOW_METHODS


@dataclass(frozen=True)
class FlowSettings:
    """How a family's samples are drawn and weighted, and what the network is asked for."""

    weighting: str = "none"  # timestep density and loss weight: one of WEIGHTINGS
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition: bool = False  # compare x_0 estimates (SD3 example's default) instead of velocities
    guidance_scale: float = 1.0  # FLUX.1 [dev]'s guidance embedding while training

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise UsageError(f"flow weighting {self.weighting!r}", fix=f"one of {', '.join(WEIGHTINGS)}")


# diffusers examples/dreambooth: train_dreambooth_lora_sd3.py (--weighting_scheme logit_normal,
# --precondition_outputs 1) and train_dreambooth_lora_flux.py (--weighting_scheme none; README: --guidance_scale=1).
FAMILY_SETTINGS = {
    "mmdit": FlowSettings(weighting="logit_normal", precondition=True),
    "flux": FlowSettings(weighting="none", guidance_scale=1.0),
}


# -- the objective ----------------------------------------------------------------------------------------


def sample_density(settings: FlowSettings, batch: int, generator):
    """``u`` in [0, 1) per sample (CPU, from ``generator``): uniform, logit-normal (sigmoid of a normal with
    ``logit_mean``/``logit_std``) or the "mode" density of the SD3 paper (``mode_scale``)."""
    import torch

    if settings.weighting == "logit_normal":
        z = torch.randn(batch, generator=generator) * settings.logit_std + settings.logit_mean
        return torch.sigmoid(z)
    u = torch.rand(batch, generator=generator)
    if settings.weighting == "mode":
        return 1 - u - settings.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weight(settings: FlowSettings, sigmas):
    """The per-sample loss weight at ``sigmas``: 1/sigma^2 (sigma_sqrt), the cosine map's 2/(pi(1-2s+2s^2))
    (cosmap), else 1."""
    import torch

    if settings.weighting == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if settings.weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


class FlowMatchingObjective:
    """Rectified flow on the training scheduler's sigma table (a FlowMatchEulerDiscreteScheduler: its
    ``shift`` is in the table; dynamic shifting, FLUX.1 [dev]'s inference-time resolution shift, is not, as in
    the diffusers examples)."""

    def __init__(self, noise_scheduler, settings: FlowSettings):
        import torch

        self.settings = settings
        self.num_train_timesteps = int(noise_scheduler.config.num_train_timesteps)
        self.sigmas = noise_scheduler.sigmas.detach().to("cpu", torch.float32).clone()
        self.timesteps = noise_scheduler.timesteps.detach().to("cpu", torch.float32).clone()
        if len(self.timesteps) != self.num_train_timesteps:
            raise UsageError(
                f"the training scheduler has {len(self.timesteps)} timesteps, not num_train_timesteps "
                f"{self.num_train_timesteps} (was set_timesteps called on it?)"
            )

    def corrupt(self, latents, generator):
        """(noisy latents, timesteps in [0, 1000], sigmas [B], noise): randomness on CPU from ``generator``."""
        import torch

        b = latents.shape[0]
        noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
        u = sample_density(self.settings, b, generator)
        index = (u * self.num_train_timesteps).long().clamp(0, self.num_train_timesteps - 1)
        sigmas, timesteps = self.sigmas[index], self.timesteps[index]
        s = sigmas.view(b, *([1] * (latents.ndim - 1))).to(latents.device, torch.float32)
        noise = noise.to(latents.device)
        noisy = ((1.0 - s) * latents.float() + s * noise).to(latents.dtype)
        return noisy, timesteps.to(latents.device), sigmas.to(latents.device), noise

    def prediction_and_target(self, pred, latents, noisy, sigmas, noise):
        """(weighted prediction, weighted target) for the network's velocity ``pred`` (see the module doc)."""
        b = latents.shape[0]
        s = sigmas.view(b, *([1] * (latents.ndim - 1))).float()
        pred = pred.float()
        if self.settings.precondition:
            pred, target = noisy.float() - s * pred, latents.float()
        else:
            target = noise.float() - latents.float()
        w = loss_weight(self.settings, sigmas.float()).sqrt().view_as(s)
        return pred * w, target * w

    def loss(self, pred, target, reduction: str = "mean"):
        return mse(pred, target, reduction)


# -- FLUX latents -----------------------------------------------------------------------------------------


def pack_latents(latents):
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C]: each 2x2 patch one token (channels, then the patch's rows/cols)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens, height: int, width: int):
    """The inverse of :func:`pack_latents` for latents of ``height`` x ``width``."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def image_ids(height: int, width: int, device, dtype):
    """FLUX's position ids of the packed tokens: (0, row, column) per 2x2 patch, [(H/2)(W/2), 3]."""
    import torch

    rows = torch.arange(height // 2).view(-1, 1).expand(height // 2, width // 2)
    cols = torch.arange(width // 2).view(1, -1).expand(height // 2, width // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(device, dtype)


# -- text conditioning ------------------------------------------------------------------------------------


def encode_prompts(text_encoders: list, input_ids: list, family: str, device):
    """(prompt_embeds, pooled) of a transformer family from its tokenized captions (one id tensor per encoder,
    in the pipeline's order): see the module doc."""
    import torch
    import torch.nn.functional as F

    arch = registry.family(family).arch
    if arch == "flux":
        clip, t5 = text_encoders
        pooled = clip(input_ids[0].to(device), output_hidden_states=False).pooler_output
        return t5(input_ids[1].to(device))[0], pooled
    hidden, pooled = [], []
    for te, ids in zip(text_encoders[:2], input_ids[:2]):
        out = te(ids.to(device), output_hidden_states=True)
        pooled.append(out[0])  # CLIPTextModelWithProjection: text_embeds
        hidden.append(out.hidden_states[-2])
    t5 = text_encoders[2](input_ids[2].to(device))[0]
    clip = torch.cat(hidden, dim=-1)
    clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5.to(clip.dtype)], dim=-2), torch.cat(pooled, dim=-1)


# -- sampling from cached text-encoder outputs ------------------------------------------------------------
# With memory.cache_text_encoder_outputs the encoders leave the GPU once the captions are encoded. A sample
# grid that brought them back would put T5-XXL (~9 GiB in bf16) beside the training state: on the cards such
# a plan is for, the grid would not fit. So the grid's prompts are encoded with the captions, and the pipeline
# gets their embeddings (the same encode_prompts output the transformer trains on; the pipeline's own
# encode_prompt gives the same tensors: tests/test_sd3_flux.py).


def sampling_captions(family: str, prompts: list[str], negative: str | None = None) -> set[str]:
    """What the text cache must hold to sample ``prompts`` from it: the prompts, and for SD3.5 (classifier-free
    guidance) the negative prompt (sampling.negative_prompt; the pipeline's default: "")."""
    return set(prompts) | (set() if registry.family(family).distilled_guidance else {negative or ""})


def cached_conditioning(family: str, cache, device):
    """``conditioning(prompt, negative)`` for ``sampling.generate_images``: the pipeline's embedding arguments
    from the text cache (FLUX.1: prompt and pooled embeddings; SD3.5: the negative prompt's too)."""
    flux = registry.family(family).arch == "flux"

    def conditioning(prompt: str, negative: str | None) -> dict:
        embeds, pooled = cache.lookup([prompt], device, None)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if not flux:
            negative_embeds, negative_pooled = cache.lookup([negative or ""], device, None)
            out.update(negative_prompt_embeds=negative_embeds, negative_pooled_prompt_embeds=negative_pooled)
        return out

    return conditioning


# -- the adapter the recipes use --------------------------------------------------------------------------


class FlowAdapter:
    """The denoiser call and objective of one transformer family (``Components.adapter``)."""

    def __init__(self, family: str, settings: FlowSettings | None = None):
        self.family = registry.family(family)
        if not self.family.flow:
            raise ValueError(f"{family} is not a rectified-flow family")
        self.settings = settings or FAMILY_SETTINGS[self.family.arch]

    def check(self, cfg) -> None:
        """What this trainer does not do for these families yet: one clear error before the models load."""
        if cfg.method not in METHODS:
            raise UsageError(
                f"{cfg.method} for {self.family.name}: the SD3.5/FLUX trainer does {', '.join(METHODS)}",
                fix="use method: lora, finetune or dreambooth",
            )
        # the config checked these where it names the family; a family found in the model's files is checked
        # by sdplan train before the launch, and here for a config run as it is (python -m sdplan.trainer)
        if problems := family_problems(cfg, self.family.name):
            raise UsageError(problems[0])
        if cfg.training.train_text_encoder:
            raise UsageError(
                f"training.train_text_encoder for {self.family.name}: not supported (the transformer trains; "
                "the CLIP/T5 encoders stay frozen)",
                fix="set training.train_text_encoder: false",
            )

    def objective(self, noise_scheduler) -> FlowMatchingObjective:
        return FlowMatchingObjective(noise_scheduler, self.settings)

    def conditioning(self, recipe, batch: dict):
        """(prompt_embeds, pooled) of a batch, from the text cache when there is one."""
        from .conditioning import tokenize

        captions = list(batch["caption"])
        if recipe.text_cache is not None:
            return recipe.text_cache.lookup(captions, recipe.device, recipe.cond_dtype)
        ids = tokenize(recipe.comps.tokenizers, captions)
        embeds, pooled = encode_prompts(recipe.text_encoders, ids, self.family.name, recipe.device)
        return embeds.to(recipe.cond_dtype), pooled.to(recipe.cond_dtype)

    def predict(self, recipe, batch: dict, generator, *, latents=None):
        """(prediction, target) on one batch, weighted as the objective says (see the module doc)."""
        import torch

        if latents is None:
            latents = recipe.latents(batch, generator)
        if recipe.latent_dtype is not None:
            latents = latents.to(recipe.latent_dtype)
        objective = recipe.objective
        noisy, timesteps, sigmas, noise = objective.corrupt(latents, generator)
        embeds, pooled = self.conditioning(recipe, batch)
        model = recipe.unet  # the transformer (the loop's denoiser slot)
        dtype = noisy.dtype
        if self.family.arch == "flux":
            b, _, h, w = noisy.shape
            config = getattr(model, "module", model).config
            guidance = (
                torch.full((b,), self.settings.guidance_scale, device=noisy.device, dtype=torch.float32)
                if config.guidance_embeds
                else None
            )
            out = model(
                hidden_states=pack_latents(noisy),
                timestep=timesteps / 1000,  # float32, as the diffusers example passes it
                guidance=guidance,
                pooled_projections=pooled.to(dtype),
                encoder_hidden_states=embeds.to(dtype),
                txt_ids=torch.zeros(embeds.shape[1], 3, device=noisy.device, dtype=dtype),
                img_ids=image_ids(h, w, noisy.device, dtype),
                return_dict=False,
            )[0]
            pred = unpack_latents(out, h, w)
        else:
            pred = model(
                hidden_states=noisy,
                timestep=timesteps,
                encoder_hidden_states=embeds.to(dtype),
                pooled_projections=pooled.to(dtype),
                return_dict=False,
            )[0]
        return objective.prediction_and_target(pred, latents, noisy, sigmas, noise)


def adapter_for(family: str | None) -> FlowAdapter | None:
    """The adapter of a transformer family; None for the UNet families."""
    if family is None or family not in registry.FLOW_FAMILIES:
        return None
    return FlowAdapter(family)
