"""Full fine-tune: train every UNet weight (optionally the text encoder(s)) on captioned images.

SD3.5 and FLUX.1 train their whole transformer the same way (it sits in the denoiser slot; the family
adapter, ``trainer/flow.py``, supplies the flow-matching objective; their text encoders stay frozen). Their
outputs: the diffusers folder (StableDiffusion3Pipeline / FluxPipeline) and a single file holding the
transformer in the original layout (``trainer/flow_single_file.py``).

The UNet trains in fp32 master weights under mixed precision, or in bf16 with ``training.full_half_weights``.
Optional EMA of the UNet weights (the ``ema`` config section: ``enabled``, ``decay``, ``device`` cpu | gpu,
``update_every``; kept by the loop), saved beside the weights (``ema/``). Outputs: a diffusers folder and a
single-file ``.safetensors``, beside what every run writes (``trainer/loop.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import ds_masters, export, runtime
from ..checkpoint import unwrap
from ..loop import Ema, Recipe


class Finetune(Recipe):
    method = "finetune"
    trains_unet = True

    def setup(self) -> None:
        import torch

        self.place_models()
        self.unet.requires_grad_(True)
        self.trained = {"unet": self.unet}
        if self.cfg.training.train_text_encoder:
            self.trained |= self.train_text_encoders()
        if self.cfg.distributed.deepspeed is not None and self.wdtype != torch.float32:
            # DeepSpeed runs its own half precision: its engine casts the trained model to fp16 / bf16 (fp32
            # masters in the optimizer) and accelerate leaves autocast off, so the inputs come in that dtype
            self.latent_dtype = self.cond_dtype = self.wdtype
        else:
            self.latent_dtype, self.cond_dtype = None, torch.float32  # under autocast, as the trained weights

    def param_groups(self) -> list[dict[str, Any]]:
        tes = [p for te in self.text_encoders for p in te.parameters()]
        return self.lr_groups(self.unet.parameters(), tes if self.cfg.training.train_text_encoder else None)

    def save_pipeline(self, out_dir: Path, unet, metadata: dict[str, Any], name: str) -> list[Path]:
        pipe = self.comps.pipeline(unet=unet, text_encoders=[unwrap(te) for te in self.text_encoders])
        return export.save_full(
            out_dir,
            pipeline=pipe,
            family=self.comps.family,
            metadata=metadata,
            single_file=self.cfg.output.save_single_file,
            name=name,
        )

    def export(self, out_dir: Path, metadata: dict[str, Any], ema: Ema | None) -> list[Path]:
        import torch

        with ds_masters.masters_in(self):  # DeepSpeed: its fp32 masters, not its bf16 / fp16 copy
            written = self.save_pipeline(out_dir, unwrap(self.unet), metadata, self.cfg.output.name)
        if ema is not None:
            # not a second UNet on the GPU; in fp32, as the average is kept (a bf16 copy, DeepSpeed's or
            # training.full_half_weights', rounded it)
            ema_unet = runtime.host_copy(unwrap(self.unet), dtype=torch.float32)
            ema.copy_to(ema_unet)
            meta = {**metadata, "ema_decay": ema.decay, "ema_update_every": ema.every}
            written += self.save_pipeline(
                out_dir / "ema", ema_unet, meta, export.output_name(self.cfg.output.name, out_dir) + "-ema"
            )
        return written
