"""SD3.5 / FLUX.1 LoRA outputs: diffusers format (``pipe.load_lora_weights`` of StableDiffusion3Pipeline /
FluxPipeline), written by the pipeline class's own ``save_lora_weights``, with the run's metadata, and the
kohya sd-scripts / ComfyUI names (:mod:`flow_kohya`). The helpers (metadata, atomic safetensors, peft state
dicts) are ``export``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdplan import registry

from .export import (
    ALPHA_FOLDED,
    ExportError,
    _peft_lora,
    fold_alpha,
    output_metadata,
    output_name,
    save_diffusers_lora,
)


def pipeline_class(family: str):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    return FluxPipeline if registry.family(family).arch == "flux" else StableDiffusion3Pipeline


def save_flow_lora(
    out_dir: str | Path,
    *,
    transformer,
    family: str,
    rank: int,
    alpha: float,
    metadata: dict[str, Any] | None,
    name: str | None = None,
    kohya: bool = True,
    run: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the LoRA ``transformer`` carries as a peft adapter: ``pytorch_lora_weights.safetensors`` and, with
    ``kohya``, ``{name}.kohya.safetensors`` (kohya sd-scripts / ComfyUI names; ``name`` None/empty: the run
    folder's name, ``export.output_name``), with kohya's ``ss_*`` training keys from ``metadata`` and ``run``
    (``export.run_info``) as the SD 1.x / SDXL file has them."""
    if family not in registry.FLOW_FAMILIES:
        raise ExportError(f"{family} is not an SD3.5/FLUX family")
    found = _peft_lora(transformer)
    if found is None:
        raise ExportError("no LoRA adapter found on the transformer", fix="add one with add_adapter")
    state_dict, config = found
    if config.r != rank or float(config.lora_alpha) != float(alpha):
        raise ExportError(
            f"the transformer adapter has rank {config.r}, alpha {config.lora_alpha}; asked to save rank "
            f"{rank}, alpha {alpha}"
        )
    out_dir = Path(out_dir)
    name = output_name(name, out_dir)
    md = output_metadata(metadata, family)
    md.update({"sdplan_lora_rank": str(rank), "sdplan_lora_alpha": str(float(alpha))})
    out_dir.mkdir(parents=True, exist_ok=True)
    folded, adapter_metadata = fold_alpha(state_dict, config, rank, alpha)  # as export.save_lora's
    diffusers_file, _ = save_diffusers_lora(  # with diffusers' format + lora_adapter_metadata
        pipeline_class(family),
        out_dir,
        {**md, "sdplan_lora_alpha_folded": ALPHA_FOLDED},
        transformer_lora_layers=folded,  # peft names, as the diffusers examples save them
        transformer_lora_adapter_metadata=adapter_metadata,
    )
    written = [diffusers_file]
    if kohya:
        from .flow_kohya import save_kohya

        arch = registry.family(family).arch
        written.append(
            save_kohya(
                out_dir / f"{name}.kohya.safetensors",
                arch,
                state_dict,
                transformer_config=dict(transformer.config),
                alpha=alpha,
                metadata={  # not diffusers' lora_adapter_metadata: diffusers' kohya FLUX loader, which folds
                    # alpha/rank itself, handed it to peft, which scaled by it again ((alpha/rank)^2)
                    **md,
                    **_kohya_metadata(
                        arch, dict(transformer.config), rank, alpha, name, family, metadata, run
                    ),
                },
            )
        )
    return written


def _kohya_metadata(
    arch: str,
    config: dict[str, Any],
    rank: int,
    alpha: float,
    name: str,
    family: str,
    metadata: dict[str, Any] | None = None,
    run: dict[str, Any] | None = None,
) -> dict[str, str]:
    """kohya sd-scripts' keys for the LoRA. FLUX (flux_train_network.py): networks.lora_flux, base model
    ``flux1`` (library/flux_utils.MODEL_VERSION_FLUX_V1). SD3 (sd3_train_network.py): networks.lora_sd3, base
    model the MMDiT's model_type (library/sd3_utils: ``5-medium`` with MMDiT-X attn2, ``5-large`` with
    qk-norm and none, ``3-medium`` without either)."""
    if arch == "flux":
        module, version = "networks.lora_flux", "flux1"
    else:
        module = "networks.lora_sd3"
        if config.get("dual_attention_layers"):
            version = "5-medium"
        else:
            version = "5-large" if config.get("qk_norm") else "3-medium"
    from .export import _kohya_metadata as training_keys

    return {
        # the training's keys (learning rate, steps, dataset, tag frequency, ...), as the UNet families' file
        **training_keys(metadata, family, rank, alpha, name, run=run, module=module, version=version),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{_MODELSPEC[family]}/lora",
        "modelspec.title": name,
    }


# Stability's model spec architecture ids (kohya sd-scripts library/sai_model_spec.py).
_MODELSPEC = {
    "flux-dev": "flux-1-dev",
    "flux-schnell": "flux-1-schnell",
    "sd35-medium": "stable-diffusion-v3-medium",
    "sd35-large": "stable-diffusion-v3.5-large",
}
