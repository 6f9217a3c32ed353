"""SD3.5 / FLUX.1 LoRA outputs: diffusers format (``pipe.load_lora_weights`` of StableDiffusion3Pipeline /
FluxPipeline), written by the pipeline class's own ``save_lora_weights``, with the run's metadata.

Kohya / ComfyUI names for FLUX are :mod:`flow_kohya`. The helpers (metadata, atomic safetensors, peft state
dicts) are ``export``'s.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from sdplan import registry

from .export import (
    DIFFUSERS_LORA_NAME,
    ExportError,
    _peft_lora,
    _save_safetensors,
    _tmp_name,
    output_metadata,
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
    name: str = "sdplan",
    kohya: bool = True,
) -> list[Path]:
    """Write the LoRA ``transformer`` carries as a peft adapter: ``pytorch_lora_weights.safetensors`` and, for
    FLUX with ``kohya``, ``{name}.kohya.safetensors`` (kohya sd-scripts / ComfyUI names)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

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
    md = output_metadata(metadata, family)
    md.update({"sdplan_lora_rank": str(rank), "sdplan_lora_alpha": str(float(alpha))})
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(out_dir / "lora")
    try:
        pipeline_class(family).save_lora_weights(
            save_directory=str(tmp),
            transformer_lora_layers=state_dict,  # peft names, as the diffusers examples save them
            transformer_lora_adapter_metadata=config.to_dict(),
            safe_serialization=True,
        )
        with safe_open(str(tmp / DIFFUSERS_LORA_NAME), framework="pt") as f:
            md = {**(f.metadata() or {}), **md}  # keep diffusers' format + lora_adapter_metadata
        written = [
            _save_safetensors(load_file(str(tmp / DIFFUSERS_LORA_NAME)), out_dir / DIFFUSERS_LORA_NAME, md)
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if kohya and registry.family(family).arch == "flux":
        from .flow_kohya import save_flux_kohya

        written.append(
            save_flux_kohya(
                out_dir / f"{name}.kohya.safetensors",
                state_dict,
                transformer_config=dict(transformer.config),
                alpha=alpha,
                metadata={**md, **_kohya_flux_metadata(rank, alpha, name, family)},
            )
        )
    return written


def _kohya_flux_metadata(rank: int, alpha: float, name: str, family: str) -> dict[str, str]:
    """kohya sd-scripts' keys for a FLUX LoRA (flux_train_network.py: networks.lora_flux, ``flux1``)."""
    return {
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(float(alpha)),
        "ss_base_model_version": "flux1",
        "ss_output_name": name,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{family.replace('-', '-1-')}/lora",
        "modelspec.title": name,
    }
