"""LoRA: low-rank adapters on the UNet's attention projections (optionally the text encoder(s)), with peft.

The base model stays frozen (in half precision under mixed precision); only the adapters train, in fp32 (bf16
with training.full_half_weights).
Outputs: the LoRA in diffusers/peft format (``pipe.load_lora_weights``) and in kohya format (A1111, ComfyUI),
beside what every run writes (``trainer/loop.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from sdplan import registry

from .. import ds_masters, export, runtime
from ..checkpoint import unwrap
from ..loop import Ema, Recipe


class LoRA(Recipe):
    method = "lora"

    def setup(self) -> None:
        import torch

        self.place_models()
        torch.manual_seed(self.cfg.training.seed)  # every process starts from the same adapters
        # exactly the modules lora.target_modules names, in any order; null: the family's default (the UNet's
        # attention, SD3.5's / FLUX.1's diffusers example targets): what the planner charged
        targets = registry.lora_targets(self.comps.family, self.cfg.lora.target_modules)
        lcfg = dataclasses.replace(self.cfg.lora, target_modules=list(targets))
        self.trained = runtime.add_lora_adapters(
            self.unet,
            self.text_encoders,
            lcfg,
            self.cfg.training.train_text_encoder,
            dtype=runtime.trained_dtype(self.cfg, self.accelerator),
        )
        if self.base_summary is not None:  # a quantized frozen base (model.base_precision fp8 / nf4)
            from ..quantize import keep_out_of_ddp

            keep_out_of_ddp(self.unet)
        if self.swapped_blocks:  # memory.blocks_to_swap: their frozen weights come in per forward pass
            from ..blockswap import BlockSwap

            self.block_swap = BlockSwap(self.unet, self.swapped_blocks, self.device)

    def param_groups(self) -> list[dict[str, Any]]:
        unet = [p for p in self.unet.parameters() if p.requires_grad]
        tes = [p for te in self.text_encoders for p in te.parameters() if p.requires_grad]
        return self.lr_groups(unet, tes if self.cfg.training.train_text_encoder else None)

    def export(self, out_dir: Path, metadata: dict[str, Any], ema: Ema | None) -> list[Path]:
        with ds_masters.masters_in(self):  # DeepSpeed: the adapters' fp32 masters, not its bf16 / fp16 copy
            return self._export(out_dir, metadata)

    def _export(self, out_dir: Path, metadata: dict[str, Any]) -> list[Path]:
        if self.adapter is not None:
            from .. import flow_export

            return flow_export.save_flow_lora(
                out_dir,
                transformer=unwrap(self.unet),
                family=self.comps.family,
                rank=self.cfg.lora.rank,
                alpha=self.cfg.lora.alpha,
                metadata=metadata,
                name=self.cfg.output.name,
                kohya=self.cfg.output.save_kohya,
                run=self.run_info(),
            )
        train_te = self.cfg.training.train_text_encoder
        return export.save_lora(
            out_dir,
            unet=unwrap(self.unet),
            text_encoders=[unwrap(te) for te in self.text_encoders] if train_te else [],
            family=self.comps.family,
            rank=self.cfg.lora.rank,
            alpha=self.cfg.lora.alpha,
            metadata=metadata,
            name=self.cfg.output.name,
            kohya=self.cfg.output.save_kohya,
            run=self.run_info(),
        )

    def run_info(self) -> dict[str, Any]:
        """The run's facts for kohya's ``ss_*`` keys (``export.run_info``): step plan, dataset, start."""
        return export.run_info(
            step_plan=self.plan,
            dataset=export.dataset_info(
                self.dataset.items,
                self.cfg.data.path,
                bucket_rows=self.dataset.bucket_table() if self.cfg.data.buckets else None,
            ),
            started_at=self.started_at,
            session_id=self.session_id,
        )
