"""What a run leaves besides the trained weights: sample grids, run_summary.json, loss_history.json,
peak memory, and the metadata every exported file records.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from .latents import offload


@contextlib.contextmanager
def sampling_precision(accelerator, vae):
    """Sampling runs under the training autocast (the pipeline mixes fp16/bf16 and fp32 components) but the
    VAE decodes outside it, in its own dtype: the SD/SDXL VAE overflows to NaN in fp16 (kept fp32 then)."""
    import torch

    original = vae.decode

    def decode(z, *args, **kwargs):
        with torch.autocast(accelerator.device.type, enabled=False):
            return original(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode
    try:
        with torch.no_grad(), accelerator.autocast():
            yield
    finally:
        del vae.decode


def samples(
    accelerator, comps, unet, text_encoders, cfg, *, step: int | None = None, fallback: str = "", tb=None
) -> Path | None:
    """A PNG grid from ``sampling.prompts`` (else ``fallback``) with a fixed seed, made on the main process:
    ``samples/step-000100.png`` during training (the other processes wait), ``samples/final.png`` at the end
    (call it on the main process only then). Components moved off the GPU (cached outputs) come back for it."""

    from .checkpoint import unwrap

    prompts = list(cfg.sampling.prompts) or ([fallback] if fallback else [])
    name = f"step-{step:06d}.png" if step is not None else "final.png"
    grid = None
    if prompts and accelerator.is_main_process:
        from . import sampling

        tes = [unwrap(te) for te in text_encoders]
        pipe = comps.pipeline(unet=unwrap(unet), text_encoders=tes)
        away = [m for m in (comps.vae, *tes) if m.device != accelerator.device]
        for m in away:
            m.to(accelerator.device)
        try:
            with sampling_precision(accelerator, comps.vae):
                grid = sampling.sample_grid(
                    pipe,
                    prompts,
                    seed=cfg.sampling.seed,
                    steps=cfg.sampling.num_inference_steps,
                    guidance_scale=cfg.sampling.guidance_scale,
                    resolution=cfg.data.resolution,
                    out_path=Path(cfg.output.dir) / "samples" / name,
                )
        finally:
            offload(*away)
        if tb is not None:
            tb.image("samples", grid, step if step is not None else 0)
    if step is not None:
        accelerator.wait_for_everyone()
    return grid


def write_json_atomic(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def write_run_summary(
    out_dir: Path,
    *,
    method: str,
    steps: int,
    epochs: float,
    images_seen: int,
    num_processes: int,
    final_loss: float | None,
    wall_seconds: float,
    peak_memory_bytes: int,
    outputs: list[Path | str],
) -> dict[str, Any]:
    summary = {
        "method": method,
        "steps": steps,
        "epochs": epochs,
        "images_seen": images_seen,
        "num_processes": num_processes,
        "final_loss": None if final_loss is None or not math.isfinite(final_loss) else final_loss,
        "wall_seconds": round(wall_seconds, 3),
        "peak_memory_bytes": peak_memory_bytes,
        "outputs": [str(p) for p in outputs],
    }
    write_json_atomic(Path(out_dir) / "run_summary.json", summary)
    return summary


def write_loss_history(out_dir: Path, losses: list[float]) -> Path:
    """``loss_history.json``: the mean loss of every optimizer step (1-based), what loss.png draws."""
    return write_json_atomic(
        Path(out_dir) / "loss_history.json", {"steps": list(range(1, len(losses) + 1)), "losses": losses}
    )


def run_metadata(cfg, *, steps: int, epochs: float, prediction_type: str, **extra: Any) -> dict[str, Any]:
    """What every output records (export turns it into string metadata): the config, the plan it came from,
    steps, epochs and the prediction type (kohya's ss_* keys read these)."""
    return {
        "config": cfg,
        "plan": cfg.plan,
        "steps": steps,
        "epoch": epochs,
        "prediction_type": prediction_type,
        **extra,
    }
