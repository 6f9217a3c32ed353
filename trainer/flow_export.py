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
    model the MMDiT's model_type (``sd3_model_type``). ModelSpec as the UNet families' file has it
    (``export._modelspec``), with kohya's architecture id (``modelspec_architecture``)."""
    if arch == "flux":
        module, version = "networks.lora_flux", "flux1"
    else:
        module, version = "networks.lora_sd3", sd3_model_type(config)
    from .export import _kohya_metadata as training_keys
    from .export import _modelspec

    return {
        # the training's keys (learning rate, steps, dataset, tag frequency, ...), as the UNet families' file
        **training_keys(metadata, family, rank, alpha, name, run=run, module=module, version=version),
        **_modelspec(family, metadata, name, lora=True, transformer_config=config),
    }


def sd3_model_type(config: dict[str, Any]) -> str:
    """kohya sd-scripts' model_type of an SD3 MMDiT: ``"5-large"`` with qk-norm and no MMDiT-X attn2,
    ``"5-medium"`` with both, ``"medium"`` (SD3 Medium) with neither. It is ``ss_base_model_version`` and,
    after ``stable-diffusion-3-``, the ModelSpec architecture (``modelspec_architecture``)."""
    # kohya-ss/sd-scripts library/sd3_utils.py analyze_state_dict_state (main 48d368f = sd3 3265f2e), l. 40
    # `qk_norm = "rms" if ...ln_k.weight in state_dict`, l. 53-60 `if qk_norm is not None: model_type =
    # "5-large" if not x_block_self_attn_layers else "5-medium"; else: model_type = "medium"`
    if config.get("qk_norm"):
        return "5-medium" if config.get("dual_attention_layers") else "5-large"
    return "medium"


def modelspec_architecture(family: str, config: dict[str, Any] | None = None) -> str:
    """ModelSpec architecture id (without ``/lora``) as kohya sd-scripts writes it. ``config``: the
    transformer's (SD3 Medium and SD3.5 Medium share the family); without it, the family's own model."""
    # kohya-ss/sd-scripts library/sai_model_spec.py (main 48d368f = sd3 3265f2e): l. 74 `ARCH_SD3_M =
    # "stable-diffusion-3"`, l. 76-77 `ARCH_FLUX_1_DEV = "flux-1-dev"`, `ARCH_FLUX_1_SCHNELL = "flux-1-schnell"`,
    # determine_architecture l. 203 `arch = ARCH_SD3_M + "-" + model_config["sd3"]` (sd3_train_network.py
    # l. 399 passes sd3=mmdit.model_type; flux_train_network.py l. 441 flux="schnell"/"dev"), l. 239 `/lora`;
    # spec version l. 40 / l. 115 "1.0.1" (export._modelspec writes it)
    if registry.family(family).arch == "flux":
        return _MODELSPEC[family]
    return "stable-diffusion-3-" + (sd3_model_type(config) if config is not None else _SD3_MODEL_TYPE[family])


_MODELSPEC = {"flux-dev": "flux-1-dev", "flux-schnell": "flux-1-schnell"}
_SD3_MODEL_TYPE = {"sd35-medium": "5-medium", "sd35-large": "5-large"}
