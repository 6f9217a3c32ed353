"""Tiny Stable Diffusion models built in code: the CPU demo and the tests train these in seconds.

Same classes and wiring as the real SD 1.x / SDXL pipelines (UNet2DConditionModel, CLIP text encoder(s),
AutoencoderKL with an 8x VAE, a CLIPTokenizer), just narrow and shallow, so every code path the trainer
takes on a real model runs here. No download: the tokenizer's vocabulary is generated.
"""

from __future__ import annotations

import json
from pathlib import Path

# Resolution the tiny models are meant for: 64 px images -> 8x8 latents (VAE scale 8, as in SD).
TINY_RESOLUTION = 64


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte maps to a printable unicode character."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_tokenizer_files(folder: str | Path, words: tuple[str, ...] = ()) -> Path:
    """Write vocab.json + merges.txt for a small CLIP BPE tokenizer: all byte characters, plus merges
    that make each of ``words`` one token. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for c in chars:
        vocab.setdefault(c + "</w>", len(vocab))
    merges: list[str] = []
    for word in words:
        # Merge left to right: "c a t</w>" -> "ca t</w>" -> "cat</w>".
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            a, b = pieces[0], pieces[1]
            merge = f"{a} {b}"
            if merge not in merges:
                merges.append(merge)
            vocab.setdefault(a + b, len(vocab))
            pieces = [a + b] + pieces[2:]
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + ("\n" if merges else ""))
    return folder


DEMO_WORDS = (
    "a",
    "photo",
    "of",
    "sks",
    "person",
    "dog",
    "cat",
    "red",
    "blue",
    "green",
    "square",
    "circle",
    "on",
)


def tiny_tokenizer(folder: str | Path, max_length: int = 77):
    from transformers import CLIPTokenizer

    write_tokenizer_files(folder, DEMO_WORDS)
    # from_pretrained reads vocab.json + merges.txt in transformers 4.x and 5.x alike.
    return CLIPTokenizer.from_pretrained(str(folder), model_max_length=max_length, pad_token="<|endoftext|>")


def _text_config(vocab_size: int, hidden: int = 32, projection_dim: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=77,
        projection_dim=projection_dim,
        hidden_act="quick_gelu",
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )


def tiny_clip(tokenizer, hidden: int = 32, projection_dim: int | None = None):
    """A tiny CLIP text encoder for ``tokenizer``: ``CLIPTextModel``, or ``CLIPTextModelWithProjection`` (the
    pooled output projected to ``projection_dim``) where a projection is asked for."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if projection_dim is None:
        return CLIPTextModel(_text_config(len(tokenizer), hidden=hidden))
    return CLIPTextModelWithProjection(
        _text_config(len(tokenizer), hidden=hidden, projection_dim=projection_dim)
    )


def tiny_vae(latent_channels: int = 4, **flow_options):
    """A tiny AutoencoderKL; four blocks: a scale factor of 8, as in the real SD VAE. ``flow_options`` are the
    SD3/FLUX VAE's extra settings (see ``tiny_vae16``)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=TINY_RESOLUTION,
        **flow_options,
    )


def tiny_unet(**wiring):
    """A tiny SD UNet2DConditionModel for 8x8 latents (4 channels, two levels 32 and 64 wide); ``wiring`` is
    what the families differ in: block types, cross-attention width, heads, added conditioning."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=TINY_RESOLUTION // 8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        norm_num_groups=32,
        **wiring,
    )


def tiny_sd15_components(tokenizer_dir: str | Path, seed: int = 0) -> dict:
    """Components of a tiny SD 1.x-shaped pipeline (random weights, seeded)."""
    import torch
    from diffusers import DDPMScheduler

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(tokenizer_dir)
    unet = tiny_unet(
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
    )
    text_encoder = tiny_clip(tokenizer)
    return {
        "unet": unet,
        "vae": tiny_vae(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": _scheduler(DDPMScheduler, clip_sample=False),  # SD 1.5's value: no clipping
    }


def tiny_sdxl_components(tokenizer_dir: str | Path, seed: int = 0) -> dict:
    """Components of a tiny SDXL-shaped pipeline: two text encoders, pooled embeddings, time ids."""
    import torch
    from diffusers import EulerDiscreteScheduler

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(Path(tokenizer_dir) / "tokenizer")
    tokenizer_2 = tiny_tokenizer(Path(tokenizer_dir) / "tokenizer_2")
    text_encoder = tiny_clip(tokenizer, hidden=32)
    # The second encoder is wider than the first, as in SDXL (768 vs 1280): diffusers' single-file loader
    # tells the two apart by width.
    text_encoder_2 = tiny_clip(tokenizer_2, hidden=48, projection_dim=32)
    addition_time_embed_dim = 8
    unet = tiny_unet(
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2),
        cross_attention_dim=80,  # the two encoders' hidden states, concatenated (32 + 48)
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + 32,  # time ids + pooled text
    )
    return {
        "unet": unet,
        "vae": tiny_vae(),
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": _scheduler(EulerDiscreteScheduler),
    }


def _scheduler(cls, **extra):
    """The SD 1.x / SDXL schedule; ``steps_offset=1`` as their released configs (with 0, diffusers' pipelines
    warn on load that the config is outdated, and rewrite it)."""
    return cls(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        **extra,
    )


# -- SD3.5 and FLUX.1: rectified-flow transformers, a 16-channel VAE, CLIP-L (+ CLIP-G) and T5 ------------------


def tiny_t5_tokenizer(max_length: int = 256):
    """A T5 tokenizer built offline: a Unigram vocabulary of the demo words (SentencePiece's ``▁`` word marker)
    plus single letters, so any caption tokenizes; ``</s>`` closes every sequence as in T5. Built with the
    tokenizers library (what T5's tokenizer.json holds), so transformers 4.x, whose T5TokenizerFast takes no
    ``vocab`` of its own, builds the same one as 5.x."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in DEMO_WORDS]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789\u2581"]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    space = {"replacement": "\u2581", "prepend_scheme": "always", "split": True}
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(**space)]
    )
    tok.decoder = decoders.Metaspace(**space)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_ids=0,
        model_max_length=max_length,
    )


def tiny_t5(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=d_model,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",  # T5 v1.1, as T5-XXL
            is_encoder_decoder=False,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


def tiny_vae16(scaling_factor: float, shift_factor: float):
    """A 16-channel AutoencoderKL as SD3/FLUX's (no quant convs, a shift and a scale), scale factor 8."""
    return tiny_vae(
        16,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def tiny_sd35_components(tokenizer_dir: str | Path, seed: int = 0, *, large: bool = False) -> dict:
    """Components of a tiny StableDiffusion3Pipeline: CLIP-L and CLIP-G (with projection; pooled outputs
    concatenated), T5, an MMDiT with qk RMS-norm (Medium: MMDiT-X dual attention in the first block; Large:
    none), a 16-channel VAE and the flow-matching scheduler with shift 3 (the SD3.5 configs' values)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(Path(tokenizer_dir) / "tokenizer")
    tokenizer_2 = tiny_tokenizer(Path(tokenizer_dir) / "tokenizer_2")
    tokenizer_3 = tiny_t5_tokenizer()
    # CLIP-L 32 + CLIP-G 48 wide (real: 768 + 1280): hidden states concatenated (80) and zero-padded to the T5
    # width (96; real 4096), then joined with the T5 tokens along the sequence.
    text_encoder = tiny_clip(tokenizer, hidden=32, projection_dim=32)
    text_encoder_2 = tiny_clip(tokenizer_2, hidden=48, projection_dim=48)
    text_encoder_3 = tiny_t5(len(tokenizer_3), d_model=96)
    transformer = SD3Transformer2DModel(
        sample_size=TINY_RESOLUTION // 8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=96,
        caption_projection_dim=32,
        pooled_projection_dim=80,  # the two CLIPs' pooled (projected) outputs, concatenated
        pos_embed_max_size=64,  # up to 1024 px (64 latent patches a side)
        dual_attention_layers=() if large else (0,),
        qk_norm="rms_norm",
    )
    return {
        "transformer": transformer,
        "vae": tiny_vae16(scaling_factor=1.5305, shift_factor=0.0609),
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "text_encoder_3": text_encoder_3,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "tokenizer_3": tokenizer_3,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }


def tiny_flux_components(tokenizer_dir: str | Path, seed: int = 0, *, guidance: bool = True) -> dict:
    """Components of a tiny FluxPipeline: CLIP-L (its pooled output only), T5 (the token sequence), a Flux
    transformer with one double- and one single-stream block on 2x2-packed latents (64 channels), a guidance
    embedder for [dev] (``guidance``; [schnell] has none), a 16-channel VAE and the [dev]/[schnell] scheduler."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(Path(tokenizer_dir) / "tokenizer")
    tokenizer_2 = tiny_t5_tokenizer(max_length=512 if guidance else 256)
    text_encoder = tiny_clip(tokenizer, hidden=32)
    text_encoder_2 = tiny_t5(len(tokenizer_2), d_model=48)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels x 2 x 2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=48,  # T5 width
        pooled_projection_dim=32,  # CLIP-L width (its pooled output)
        guidance_embeds=guidance,
        axes_dims_rope=(2, 2, 4),  # sums to the head dim, as (16, 56, 56) does to 128
    )
    shift = {"shift": 3.0, "use_dynamic_shifting": True} if guidance else {"shift": 1.0}
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        **shift,
    )
    return {
        "transformer": transformer,
        "vae": tiny_vae16(scaling_factor=0.3611, shift_factor=0.1159),
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder_2,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "scheduler": scheduler,
    }


TINY_FAMILIES = ("sd15", "sdxl", "sd35-medium", "sd35-large", "flux-dev", "flux-schnell")


def save_tiny_model(folder: str | Path, family: str = "sd15", seed: int = 0) -> Path:
    """Build a tiny pipeline and save it as a diffusers folder (loads with from_pretrained)."""
    import tempfile

    from diffusers import (
        FluxPipeline,
        StableDiffusion3Pipeline,
        StableDiffusionPipeline,
        StableDiffusionXLPipeline,
    )

    from .export import folder_for_transformers4

    folder = Path(folder)
    with tempfile.TemporaryDirectory() as tmp:
        if family in ("sd35-medium", "sd35-large"):
            pipe = StableDiffusion3Pipeline(
                **tiny_sd35_components(tmp, seed=seed, large=family == "sd35-large")
            )
        elif family in ("flux-dev", "flux-schnell"):
            pipe = FluxPipeline(**tiny_flux_components(tmp, seed=seed, guidance=family == "flux-dev"))
        elif family == "sdxl":
            pipe = StableDiffusionXLPipeline(**tiny_sdxl_components(tmp, seed=seed))
        elif family == "sd15":
            pipe = StableDiffusionPipeline(
                **tiny_sd15_components(tmp, seed=seed),
                safety_checker=None,
                feature_extractor=None,
                requires_safety_checker=False,
            )
        else:
            raise ValueError(f"tiny models exist for {', '.join(TINY_FAMILIES)}, not {family!r}")
        pipe.save_pretrained(folder, safe_serialization=True)
    folder_for_transformers4(folder)  # the demo's base model loads on transformers 4.x too, as outputs do
    return folder
