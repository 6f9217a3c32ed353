"""Textual inversion: a new token (or ``num_vectors`` of them) whose embedding is the only thing trained.

The token is added to the tokenizer(s), its embedding row(s) start from ``init_token``'s (the mean, when
``init_token`` is several tokens), and after every optimizer step all other rows are put back (as the diffusers
example does), so the model is unchanged except for the new word. Captions without the token get it in front
(no caption: ``a photo of <token>``). SDXL: both text encoders learn an embedding. Output:
``{name}.safetensors`` (``pipe.load_textual_inversion``; named after the run), beside what every run writes (``trainer/loop.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from sdplan.errors import UsageError

from .. import checkpoint as ckpt_lib
from .. import ds_masters, export
from ..loop import Ema, Recipe


class TextualInversion(Recipe):
    method = "textual-inversion"

    @classmethod
    def dtypes(cls, cfg, accelerator) -> dict[str, Any]:
        return {**super().dtypes(cfg, accelerator), "text_encoder": torch.float32}  # the embedding trains

    def setup(self) -> None:
        ti = self.cfg.textual_inversion
        self.place_models()
        self.placeholders = [ti.token] + [f"{ti.token}_{i}" for i in range(1, ti.num_vectors)]
        self.token_ids = [
            _add_tokens(tok, te, self.placeholders, ti.init_token)
            for tok, te in zip(self.comps.tokenizers, self.text_encoders)
        ]
        for i, te in enumerate(self.text_encoders):
            te.get_input_embeddings().weight.requires_grad_(True)
            self.trained[f"text_encoder_{i}"] = te
        # What the other rows must stay: restored after every optimizer step.
        self.original_rows = [te.get_input_embeddings().weight.detach().clone() for te in self.text_encoders]
        self.keep_rows = []
        for ids, rows in zip(self.token_ids, self.original_rows):
            keep = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
            keep[ids] = False
            self.keep_rows.append(keep)

    def checkpointed_models(self) -> list:
        return [self.unet, *self.text_encoders]  # backward runs through the frozen UNet to the embeddings

    def param_groups(self) -> list[dict[str, Any]]:
        return self.lr_groups([te.get_input_embeddings().weight for te in self.text_encoders], None)

    def text_captions(self, epochs: int) -> None:
        return None  # the text encoders train

    def loss(self, batch: dict, generator, micro: int):
        token = self.cfg.textual_inversion.token
        batch = dict(batch, caption=[_with_token(c, token, self.placeholders) for c in batch["caption"]])
        return super().loss(batch, generator, micro)

    def after_optimizer_step(self) -> None:
        with torch.no_grad():  # only the new token's rows may change
            for te, rows, keep in zip(self.text_encoders, self.original_rows, self.keep_rows):
                weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
                ds_masters.restore_rows(weight, keep, rows, self.accelerator)

    def checkpoint_weights(self) -> dict[str, Any]:
        return _rows(self.text_encoders, self.token_ids)

    def load_checkpoint_weights(self, state: dict[str, Any]) -> None:
        _set_rows(self.text_encoders, self.token_ids, state)

    def sample_prompt(self) -> str:
        return f"a photo of {self.cfg.textual_inversion.token}"

    def export(self, out_dir: Path, metadata: dict[str, Any], ema: Ema | None) -> list[Path]:
        with ds_masters.masters_in(self):  # DeepSpeed: the embedding's fp32 master, not its bf16 / fp16 copy
            rows = list(_rows(self.text_encoders, self.token_ids).values())
        embeds = {"clip_l": rows[0], "clip_g": rows[1]} if self.comps.family == "sdxl" else rows[0]
        path = export.save_embedding(
            out_dir,
            token=self.cfg.textual_inversion.token,
            embeds=embeds,
            metadata=metadata,
            name=self.cfg.output.name,
            family=self.comps.family,
        )
        return [path]


def _add_tokens(tokenizer, text_encoder, placeholders: list[str], init_token: str) -> list[int]:
    """Add the placeholder tokens; their embedding rows start as ``init_token``'s (mean of its pieces)."""
    added = tokenizer.add_tokens(placeholders)
    if added != len(placeholders):
        raise UsageError(
            f"textual_inversion.token {placeholders[0]!r} is already in the tokenizer",
            fix="pick a new word, e.g. <my-subject>",
        )
    init_ids = tokenizer.encode(init_token, add_special_tokens=False)
    if not init_ids:
        raise UsageError(f"textual_inversion.init_token {init_token!r} encodes to no token")
    ids = tokenizer.convert_tokens_to_ids(placeholders)
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        weight = text_encoder.get_input_embeddings().weight
        weight[ids] = weight[init_ids].mean(dim=0, keepdim=True)
    return ids


def _with_token(caption: str, token: str, placeholders: list[str]) -> str:
    """The caption with the token (put in front when missing), spelled out as all its vectors."""
    if not caption:
        caption = f"a photo of {token}"
    elif token not in caption:
        caption = f"{token}, {caption}"
    return re.sub(re.escape(token) + r"(?!_\d)", " ".join(placeholders), caption)


def _rows(text_encoders, token_ids) -> dict:
    """The trained rows: ``{"text_encoder_<i>.embeds": [num_vectors, dim]}`` (CPU copies)."""
    out = {}
    for i, (te, ids) in enumerate(zip(text_encoders, token_ids)):
        weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
        out[f"text_encoder_{i}.embeds"] = weight[ids].detach().to("cpu").clone()
    return out


def _set_rows(text_encoders, token_ids, state: dict) -> None:
    with torch.no_grad():
        for i, (te, ids) in enumerate(zip(text_encoders, token_ids)):
            key = f"text_encoder_{i}.embeds"
            if key not in state or state[key].shape[0] != len(ids):
                raise ckpt_lib.CheckpointError(f"checkpoint has no {len(ids)}-vector embedding {key}")
            weight = ckpt_lib.unwrap(te).get_input_embeddings().weight
            weight[ids] = state[key].to(weight.device, weight.dtype)
