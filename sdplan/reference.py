"""The sdplan.yaml settings reference: every key of :class:`sdplan.config.TrainConfig` with its default, the values
it takes (its type and :data:`sdplan.config._RULES`) and one line on what it does, generated from the settings
type (the README's table is this module's output: ``python -m sdplan.reference --write README.md``).

A key added to the settings type without a line in :data:`MEANINGS` fails :func:`rows` (and the test that the
README's table is this module's output); a default changed in the code changes the table. Pure Python.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, get_type_hints

from sdplan import config as C

# one line per key: what it does (its default and values come from the settings type)
MEANINGS: dict[str, str] = {
    "method": "what trains: a LoRA, DreamBooth (the whole UNet / transformer), a full fine-tune, or a textual "
    "inversion token",
    "model.path": "the base model: a diffusers folder, a hub id, or a single .safetensors / .ckpt file",
    "model.family": "the model's family; null: detected from its files",
    "model.revision": "a hub model's branch, tag or commit",
    "model.variant": "a hub model's weight variant (fp16: its *.fp16.safetensors files)",
    "model.config_dir": "a single-file model: a local diffusers folder (or hub id) with its component configs",
    "model.base_precision": "how the frozen SD3.5 / FLUX.1 transformer's Linear weights are stored (LoRA)",
    "data.path": "the training images: a flat folder, kohya N_name folders, or one .json record per image",
    "data.resolution": "the side (pixels) images are trained at; with data.buckets, the pixel budget",
    "data.center_crop": "crop the center of an image that is not square; false: a random crop",
    "data.random_flip": "the share of samples flipped left-right",
    "data.caption_dropout": "the share of samples trained on the empty caption (kohya caption_dropout_rate)",
    "data.caption_extension": "the caption file beside each image (a.png + a.txt)",
    "data.default_caption": "the caption of an image without one; null: the instance prompt, else empty",
    "data.repeats": "how often each image of a flat folder is seen per epoch (kohya folders carry their own)",
    "data.metadata.skip_tags": "metadata datasets: an image with any of these tags is left out",
    "data.metadata.remove_tags": "metadata datasets: tags dropped from the caption",
    "data.metadata.replace": "metadata datasets: substring replacements in every tag ({':': '='})",
    "data.metadata.shuffle_tags": "metadata datasets: the chance a caption's tags are shuffled",
    "data.metadata.min_score": "metadata datasets: images scoring below it (after bonuses) are left out",
    "data.metadata.score_bonus": "metadata datasets: tag -> added to the image's score",
    "data.metadata.score_buckets": "metadata datasets: thresholds that add a score_N tag",
    "data.metadata.keep_tags": "metadata datasets: the first N tags stay in place when tags are shuffled",
    "data.num_workers": "data loader worker processes (0: in the training process)",
    "data.buckets": "aspect-ratio buckets: images keep their shape at the resolution's pixel budget",
    "data.bucket_step": "bucket sides are multiples of this",
    "data.bucket_min_size": "the shortest bucket side; null: half the resolution",
    "data.bucket_max_size": "the longest bucket side; null: twice the resolution",
    "lora.rank": "the adapters' rank (their size)",
    "lora.alpha": "the adapters' scale is alpha / rank",
    "lora.dropout": "dropout on the adapters' input while training",
    "lora.target_modules": "the modules adapted (peft name suffixes); null: the family's default",
    "lora.text_encoder_target_modules": "the text encoders' modules adapted (with training.train_text_encoder)",
    "dreambooth.instance_prompt": "the caption of an image without one (the subject's token)",
    "dreambooth.class_prompt": "prior preservation: the prompt of the class images",
    "dreambooth.class_data": "prior preservation: the class images' folder; null: class_images/ in the run "
    "folder",
    "dreambooth.num_class_images": "prior preservation: class images trained alongside (generated when the "
    "folder is short); 0: every image of class_data",
    "dreambooth.prior_loss_weight": "prior preservation: the class images' share of the loss",
    "dreambooth.with_prior_preservation": "train class images beside yours, so the class keeps its look",
    "textual_inversion.token": "the new word the embedding is learned for",
    "textual_inversion.init_token": "the word whose embedding the new one starts from",
    "textual_inversion.num_vectors": "embedding vectors the token stands for",
    "training.batch_size": "images per micro-batch, per process",
    "training.grad_accum": "micro-batches per optimizer step",
    "training.precision": "mixed precision of the forward and backward (fp16 needs a GPU)",
    "training.learning_rate": "the learning rate; null: the method's (LoRA 1e-4, DreamBooth 5e-6, fine-tune 1e-5, "
    "textual inversion 1e-4)",
    "training.text_encoder_learning_rate": "the text encoders' rate (with train_text_encoder); null: "
    "learning_rate",
    "training.lr_scheduler": "how the rate changes over the run (diffusers' get_scheduler)",
    "training.lr_warmup_steps": "optimizer steps of linear warmup (not with constant)",
    "training.epochs": "passes over the dataset (with its repeats)",
    "training.max_steps": "optimizer steps of the whole run, over all processes; set: overrides epochs",
    "training.seed": "the seed of the noise, the data order and the initial weights",
    "training.train_text_encoder": "train the text encoders too (LoRA: adapters on them)",
    "training.full_half_weights": "full-weight methods and LoRA: trained weights and gradients in bf16, no fp32 "
    "copy (kohya --full_bf16)",
    "training.max_grad_norm": "gradient clipping norm (0: off)",
    "training.noise_offset": "offset noise (SD 1.x/2.x/SDXL): darker darks and brighter brights",
    "training.min_snr_gamma": "Min-SNR loss weighting (5 is the paper's; SD 1.x/2.x/SDXL); null: off",
    "training.device": "where it trains; auto: the GPUs if any",
    "memory.gradient_checkpointing": "recompute activations in the backward: less memory, ~25% slower",
    "memory.optimizer": "the optimizer (adamw8bit: bitsandbytes, 75% smaller state; adafactor: factored state)",
    "memory.cache_latents": "encode each image once with the VAE, which then leaves the GPU",
    "memory.cache_latents_to_disk": "keep those latents on disk under the run folder (turns caching on)",
    "memory.cache_text_encoder_outputs": "encode each caption once (frozen text encoders only)",
    "memory.set_grads_to_none": "free the gradients between steps instead of zeroing them",
    "memory.blocks_to_swap": "SD3.5 / FLUX.1 LoRA: transformer blocks kept in host RAM, swapped in per block",
    "ema.enabled": "full fine-tune: keep an exponential moving average of the weights, exported beside them",
    "ema.decay": "the average's decay per step",
    "ema.update_every": "optimizer steps between updates of the average",
    "ema.device": "where the average is kept (cpu: system RAM)",
    "distributed.num_processes": "training processes (GPUs), over all machines",
    "distributed.deepspeed.zero_stage": "DeepSpeed ZeRO stage; no deepspeed section: DeepSpeed off",
    "distributed.deepspeed.offload_optimizer": "DeepSpeed: the optimizer state and step on the CPU",
    "distributed.gpu_ids": "the GPUs used, as `sdplan doctor` numbers them; null: the first ones",
    "output.dir": "the run folder",
    "output.name": "the outputs' file names; null: the run folder's name",
    "output.save_kohya": "LoRA: also the kohya format (A1111, ComfyUI)",
    "output.save_single_file": "DreamBooth / fine-tune: also one .safetensors file",
    "output.save_every_n_epochs": "save the outputs every N epochs too (0: off)",
    "output.save_every_n_steps": "save the outputs every N optimizer steps too (0: off)",
    "checkpoints.every_steps": "a rolling checkpoint (to resume from) every N optimizer steps (0: off)",
    "checkpoints.keep_every_steps": "also keep a checkpoint every N steps (0: none kept); at its first checkpoint "
    "the run warns where the disk cannot hold the ones to come",
    "checkpoints.resume": "latest, or a checkpoint folder a new run starts from",
    "sampling.prompts": "prompts of the sample grids; empty: the method's own",
    "sampling.every_steps": "a sample grid every N optimizer steps (0: only the final one)",
    "sampling.num_inference_steps": "denoising steps of each sample",
    "sampling.guidance_scale": "guidance of the samples; null: the family's (FLUX.1 3.5, others 7.5)",
    "sampling.seed": "the samples' seed",
    "sampling.negative_prompt": "the samples' negative prompt (not FLUX.1: its guidance is distilled); null: none",
    "logging.tensorboard": "write TensorBoard logs in the run folder",
    "plan": "written by `sdplan recommend --out`: what it planned (kept in the outputs' metadata)",
}

START, END = (
    "<!-- settings reference: python -m sdplan.reference --write README.md -->",
    "<!-- /settings reference -->",
)


def _leaves(kind: type = C.TrainConfig, prefix: str = "", optional: bool = False):
    """(key, default, type, in an optional section) of every leaf of the settings type, in its order."""
    hints = get_type_hints(kind)
    for f in fields(kind):
        sub = C._dataclass_in(hints[f.name])
        if sub is not None:
            yield from _leaves(
                sub, f"{prefix}{f.name}.", optional or type(None) in getattr(hints[f.name], "__args__", ())
            )
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        yield f"{prefix}{f.name}", default, hints[f.name], optional


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value) if not value or value != value.strip() else value
    if isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def rows() -> list[tuple[str, str, str, str]]:
    """(key, default, accepted values, meaning) of every sdplan.yaml key; KeyError for a key without a meaning."""
    out = []
    for key, default, tp, optional in _leaves():
        rule = C._RULES.get(key)
        accepted = C._type_name(tp)
        if rule:
            accepted = rule[1].replace("must not be empty", "not empty").removeprefix("must be ")
            accepted = accepted.removeprefix("must ")
        shown = _text(default) + (" (section null by default)" if optional else "")
        out.append((key, shown, accepted, MEANINGS[key]))
    return out


def markdown() -> str:
    """The reference as a Markdown table, between the README's markers."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [START, "", "| key | default | values | what it does |", "|---|---|---|---|"]
    lines += [f"| `{k}` | `{cell(d)}` | {cell(a)} | {cell(m)} |" for k, d, a, m in rows()]
    return "\n".join([*lines, "", END])


def readme_block(text: str) -> str | None:
    """The reference block of a README's text (markers included), or None where it has none."""
    if START not in text or END not in text:
        return None
    return text[text.index(START) : text.index(END) + len(END)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] and len(argv) == 2:
        path = Path(argv[1])
        text = path.read_text()
        block = readme_block(text)
        if block is None:
            print(f"{path}: no settings reference block ({START} ... {END})", file=sys.stderr)
            return 2
        path.write_text(text.replace(block, markdown()))
        return 0
    print(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
