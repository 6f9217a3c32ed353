"""A new user's base model, as found (issue: model loading review): a diffusers folder missing a part, a
model of another family or kind, a single file whose prediction type lives beside or inside it, a folder of
fp16 weights only, a hub id already in the cache. Each is what the user meant, or one clear line before the
launch (``source_check.check_source``, run by ``sdplan train`` and again by the trainer)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from math import prod
from pathlib import Path

import pytest
from conftest import MkdirPayload, fake_diffusers_folder, make_images, one_line_error, recommend_in_a_process
from sdplan.trainer.single_file import UnsafeCheckpointError
from sdplan.trainer.source_check import UnsupportedModelError, check_source
from typer.testing import CliRunner

from sdplan.cli import app

runner = CliRunner()


def dry_run(model: Path, tmp_path: Path, *extra: str):
    ds = make_images(tmp_path / "ds", n=2)
    args = ["train", "--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / "o")]
    return runner.invoke(app, [*args, "--device", "cpu", "--dry-run", *extra])


def write_safetensors(path: Path, shapes: dict, metadata: dict | None = None, cut: int = 0) -> Path:
    """A .safetensors file of zero-filled F16 tensors with these shapes (written by hand: no torch);
    ``cut`` bytes short of what its header says."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * prod(shape)
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(max(offset - cut, 0)))
    return path


UNET_IN = "model.diffusion_model.input_blocks.0.0.weight"
VAE = {"first_stage_model.decoder.conv_in.weight": (2,)}
CLIP_L = {"cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": (2,)}
OPEN_CLIP = {"cond_stage_model.model.token_embedding.weight": (2,)}
SDXL_TE = {
    "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": (2,),
    "conditioner.embedders.1.model.token_embedding.weight": (2,),
}


def checkpoint(channels: int = 4, text: dict = CLIP_L, **extra) -> dict:
    """The keys of a whole SD checkpoint (UNet with ``channels`` inputs, VAE, text encoders) plus ``extra``."""
    return {UNET_IN: (2, channels, 1, 1), **VAE, **text, **extra}


# -- diffusers folders -------------------------------------------------------------------------------------------


@pytest.fixture
def sd15_copy(tiny_sd15, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_sd15, tmp_path / "sd15"))


def test_folder_without_tokenizer_is_one_line_before_launch(sd15_copy, tmp_path):
    """It passed the pre-launch check, and the trainer then loaded some other tokenizer (no error at all)."""
    shutil.rmtree(sd15_copy / "tokenizer")
    line = one_line_error(
        dry_run(sd15_copy, tmp_path), 2, "incomplete diffusers folder", "no tokenizer/ folder"
    )
    assert "download the whole model again" in line


def test_loader_refuses_a_folder_without_tokenizer(sd15_copy):
    from sdplan.trainer import models

    shutil.rmtree(sd15_copy / "tokenizer")
    with pytest.raises(UnsupportedModelError, match="no tokenizer/ folder"):
        models.load_components(str(sd15_copy))


def test_folder_with_truncated_weights_is_refused(sd15_copy):
    """An interrupted download: diffusers' 'Unable to load weights' came from the trainer after the launch."""
    weights = sd15_copy / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(UnsupportedModelError, match="unet/diffusion_pytorch_model.safetensors is truncated"):
        check_source(str(sd15_copy))


@pytest.mark.parametrize(
    "family, remove, needle",
    [
        ("sd15", "vae", "no vae/ folder"),
        ("sd15", "scheduler/scheduler_config.json", "no scheduler/scheduler_config.json"),
        ("sd15", "unet/diffusion_pytorch_model.safetensors", "no unet weights"),
        ("sdxl", "tokenizer_2/tokenizer.json", "tokenizer_2/ holds no tokenizer files"),
        ("flux-dev", "text_encoder_2", "no text_encoder_2/ folder"),
    ],
)
def test_incomplete_folder_names_the_missing_part(tmp_path, family, remove, needle):
    root = fake_diffusers_folder(tmp_path / "m", family)
    target = root / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(UnsupportedModelError, match=needle):
        check_source(str(root))


def test_a_sharded_component_missing_a_shard_is_one_line_before_launch(tmp_path):
    """A sharded UNet whose download stopped part-way (its index lists a shard the folder lacks) passed the
    pre-launch check; the trainer then failed loading it. The .safetensors index is what loads: a .bin index
    whose shards were never downloaded beside it is no problem."""
    root = fake_diffusers_folder(tmp_path / "m", "sd15")
    unet = root / "unet"
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    shards = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = {"metadata": {}, "weight_map": {"conv_in.weight": shards[0], "conv_out.weight": shards[1]}}
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    (unet / shards[0]).write_bytes(b"\x02" + bytes(7) + b"{}")
    line = one_line_error(dry_run(root, tmp_path), 2, "an incomplete diffusers folder")
    assert (
        f"unet/ lacks 1 of the 2 shards diffusion_pytorch_model.safetensors.index.json lists ({shards[1]})"
        in line
    )
    (unet / shards[1]).write_bytes(b"\x02" + bytes(7) + b"{}")
    bins = {"conv_in.weight": "diffusion_pytorch_model-00001-of-00001.bin"}
    (unet / "diffusion_pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bins}))
    assert check_source(str(root)).family == "sd15"


def test_a_leftover_bin_index_beside_whole_safetensors_weights_is_not_read(tmp_path):
    """A text encoder of model.safetensors with a pytorch_model.bin.index.json left over (its .bin shards never
    downloaded) was refused as incomplete: the .bin index was checked where no .safetensors index was, though
    transformers' from_pretrained loads model.safetensors first and never reads that index. An index is checked
    only where nothing the loader prefers is there: a .bin index beside neither safetensors weights nor a whole
    pytorch_model.bin still names its missing shards."""
    root = fake_diffusers_folder(tmp_path / "m", "sd15")
    te = root / "text_encoder"
    (te / "diffusion_pytorch_model.safetensors").rename(te / "model.safetensors")  # transformers' name
    bins = {"text_model.embeddings.token_embedding.weight": "pytorch_model-00001-of-00002.bin"}
    (te / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bins}))
    assert check_source(str(root)).family == "sd15"
    (te / "model.safetensors").unlink()
    with pytest.raises(
        UnsupportedModelError, match="text_encoder/ lacks 1 of the 1 shards pytorch_model.bin.index"
    ):
        check_source(str(root))
    (te / "pytorch_model.bin").write_bytes(b"")  # a whole .bin: transformers reads it before the .bin index
    assert check_source(str(root)).family == "sd15"


def test_a_diffusers_components_safetensors_index_is_read_before_a_whole_file(tmp_path):
    """diffusers' ModelMixin.from_pretrained reads a UNet's safetensors index where there is one, a whole file
    beside it or not (save_pretrained leaves a stale one so), and never a .bin index: a folder it cannot load
    was accepted by the check before the launch."""
    root = fake_diffusers_folder(tmp_path / "m", "sd15")
    unet = root / "unet"
    shards = {"conv_in.weight": "diffusion_pytorch_model-00001-of-00002.safetensors"}
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    with pytest.raises(UnsupportedModelError, match="unet/ lacks 1 of the 1 shards diffusion_pytorch_model"):
        check_source(str(root))
    (unet / "diffusion_pytorch_model.safetensors.index.json").unlink()
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    (unet / "diffusion_pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": shards}))
    with pytest.raises(UnsupportedModelError, match="unet/ holds its weights as .bin shards only"):
        check_source(str(root))


@pytest.mark.parametrize(
    "pipeline, needle",
    [
        ("PixArtSigmaPipeline", "a PixArt model"),
        ("KandinskyV22Pipeline", "a Kandinsky model"),
        ("ChromaPipeline", "a Chroma model"),
        ("AltDiffusionPipeline", "an AltDiffusion model"),  # its XLM-R text encoder loaded as a random CLIP
        (
            "LatentConsistencyModelPipeline",
            ": a latent consistency (LCM) model (Latent",
        ),  # was "a a ... model model"
    ],
)
def test_other_family_is_refused_naming_it(tmp_path, pipeline, needle):
    """A PixArt / Kandinsky folder planned and launched as SD 1.x."""
    root = tmp_path / "m"
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    line = one_line_error(dry_run(root, tmp_path), 2, needle, "unsupported family", pipeline)
    assert "SD 1.x / 2.x, SDXL, SD3.5 and FLUX.1" in line


def test_playground_edm_folder_is_refused(tmp_path):
    """Playground v2.5 is an SDXL UNet with an EDM scheduler: trained as plain SDXL (DDPM) it learns the wrong
    objective."""
    root = fake_diffusers_folder(tmp_path / "m", "sdxl")
    (root / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_data": 0.5})
    )
    one_line_error(dry_run(root, tmp_path), 2, "an EDM model", "Playground v2.5")


@pytest.mark.parametrize(
    "family, denoiser, index, needle",
    [
        ("sd15", {"in_channels": 9}, {}, "an inpainting model"),
        ("sd15", {"in_channels": 8}, {}, "an instruct-pix2pix model"),
        ("sdxl", None, {"text_encoder": [None, None], "requires_aesthetics_score": True}, "an SDXL refiner"),
        ("flux-dev", {"in_channels": 384}, {}, "a FLUX.1 Fill"),
        ("flux-dev", {"in_channels": 128}, {"_class_name": "FluxControlPipeline"}, "FLUX.1 Depth / Canny"),
        ("sd21", None, {"_class_name": "StableUnCLIPImg2ImgPipeline"}, "a Stable unCLIP model"),
        (
            "sd21",
            {"class_embed_type": "projection"},
            {},
            "conditioned on class labels .class_embed_type projection",
        ),
    ],
)
def test_variant_models_are_refused(tmp_path, family, denoiser, index, needle):
    """Stable unCLIP (a StableUnCLIP*Pipeline folder, or its class-conditioned UNet under another pipeline
    class) passed and failed in the first step ("class_labels should be provided when doing class
    conditioning")."""
    root = fake_diffusers_folder(tmp_path / "m", family, denoiser=denoiser, index=index)
    with pytest.raises(UnsupportedModelError, match=needle):
        check_source(str(root))


def test_folder_of_fp16_weights_only_loads(sd15_copy):
    """Every hub fp16 branch folder (*.fp16.safetensors only): 'no file named diffusion_pytorch_model.bin'."""
    from sdplan.trainer import models

    for f in sd15_copy.rglob("*.safetensors"):
        f.rename(f.with_name(f.name.replace(".safetensors", ".fp16.safetensors")))
    comps = models.load_components(str(sd15_copy))
    assert comps.family == "sd15"
    assert any("fp16" in n for n in comps.notes), comps.notes


def test_folder_notes_say_family_and_prediction(tmp_path):
    root = fake_diffusers_folder(tmp_path / "m", "sd21")
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({"prediction_type": "v_prediction"}))
    info = check_source(str(root))
    assert (info.family, info.prediction_type) == ("sd21", "v_prediction")
    assert info.notes[0] == "model: diffusers folder: family sd21, prediction v_prediction"


# -- single files: what they are ---------------------------------------------------------------------------------


# files that are no base sdplan trains, refused as .safetensors and as .ckpt alike
OTHER_FILES = [
    (
        checkpoint(
            text={"conditioner.embedders.0.model.token_embedding.weight": (2,)},
            **{"model.diffusion_model.label_emb.0.0.weight": (2, 2560)},
        ),
        "an SDXL refiner",
    ),
    (  # FLUX.2 (diffusers CHECKPOINT_KEY_NAMES["flux2"]): was "a FLUX.1 Depth / Canny (control) model"
        {
            "double_blocks.0.img_attn.qkv.weight": (2,),
            "single_stream_modulation.lin.weight": (2, 2),
            "img_in.weight": (8, 128),
        },
        "single_stream_modulation.lin.weight: its blocks share one modulation",
    ),
    (  # Z-Image / Lumina 2 all in one: "cannot tell SD 1.x, 2.x or SDXL (set model.family)", which then passed
        {
            **VAE,
            "model.diffusion_model.layers.0.adaLN_modulation.0.weight": (2, 2),
            "text_encoders.qwen3_4b.transformer.model.embed_tokens.weight": (2, 2),
        },
        "another family's model: its denoiser",
    ),
    (  # Wan: was "only a UNet ... give the full checkpoint"
        {"model.diffusion_model.head.modulation": (1, 2, 2)},
        "model.diffusion_model.head.modulation",
    ),
]


@pytest.mark.parametrize(
    "shapes, needle",
    [
        (checkpoint(9), "an inpainting model"),
        (checkpoint(8), "an instruct-pix2pix model"),
        *OTHER_FILES,
        (checkpoint(text=SDXL_TE, edm_mean=(1, 4, 1, 1), edm_std=(1, 4, 1, 1)), "Playground v2.5"),
        ({"double_blocks.0.img_attn.qkv.weight": (2,), "img_in.weight": (8, 384)}, "a FLUX.1 Fill"),
        ({"double_blocks.0.img_attn.qkv.weight": (2,), "img_in.weight": (8, 128)}, "FLUX.1 Depth / Canny"),
        ({"emb_params": (2, 768)}, "a textual-inversion embedding"),
        ({"clip_l": (2, 768), "clip_g": (2, 1280)}, "a textual-inversion embedding"),
        ({"lora_unet_down_blocks_0.lora_down.weight": (2, 2)}, "a LoRA"),
        ({"encoder.conv_in.weight": (2,), "decoder.conv_out.weight": (2,)}, "only a VAE"),
        ({UNET_IN: (2, 4, 1, 1)}, "only a UNet"),
        (checkpoint(text=OPEN_CLIP, **{"embedder.model.ln_final.weight": (1024,)}), "a Stable unCLIP model"),
        (  # ComfyUI's scaled fp8 (comfy/utils.py convert_old_quants): weight / scale stored, scale beside it
            checkpoint(
                text=SDXL_TE,
                **{"model.diffusion_model.scaled_fp8": (0,), UNET_IN[:-6] + "scale_weight": (1,)},
            ),
            "a ComfyUI scaled-fp8 checkpoint .model.diffusion_model.scaled_fp8",
        ),
        (  # an SD 1.x / SDXL file is read whole (its text encoders too): a text encoder's marker counts
            checkpoint(**{"cond_stage_model.transformer.scaled_fp8": (0,)}),
            "a ComfyUI scaled-fp8 checkpoint .cond_stage_model.transformer.scaled_fp8",
        ),
        (
            {"double_blocks.0.img_attn.qkv.weight": (2,), "double_blocks.0.img_attn.qkv.scale_weight": (1,)},
            "a ComfyUI scaled-fp8 checkpoint .double_blocks.0.img_attn.qkv.scale_weight",
        ),
        (  # Forge's flux1-dev-bnb-nf4: bitsandbytes' packed 4-bit layers (passed, then failed in diffusers)
            {
                "model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (2, 1),
                "model.diffusion_model.double_blocks.0.img_attn.qkv.weight.absmax": (1,),
                "model.diffusion_model.double_blocks.0.img_attn.qkv.weight.quant_map": (16,),
                "model.diffusion_model.double_blocks.0.img_attn.qkv.weight.quant_state.bitsandbytes__nf4": (
                    9,
                ),
                "model.diffusion_model.img_in.weight": (8, 64),
            },
            "a bitsandbytes NF4 checkpoint .model.diffusion_model.double_blocks.0.img_attn.qkv.weight.quant_state",
        ),
        (  # bitsandbytes' 8-bit layers (Linear8bitLt's row scales) in an SD 1.x file
            checkpoint(**{UNET_IN[:-6] + "SCB": (2,)}),
            "a bitsandbytes 8-bit checkpoint",
        ),
        (  # lodestones' Chroma: FLUX.1 [schnell]'s blocks without their modulation (was read as flux-schnell)
            {
                "double_blocks.0.img_attn.qkv.weight": (2,),
                "img_in.weight": (8, 64),
                "distilled_guidance_layer.in_proj.bias": (2,),
            },
            "a Chroma model .distilled_guidance_layer",
        ),
        (
            {
                "model.diffusion_model.double_blocks.0.img_attn.qkv.weight": (2,),
                "model.diffusion_model.distilled_guidance_layer.in_proj.bias": (2,),
            },
            "a Chroma model",
        ),
        (  # BAAI's AltDiffusion (A1111 reads it by this key): accepted as sd15 / sd21 by its UNet's width
            checkpoint(
                text={"cond_stage_model.roberta.embeddings.word_embeddings.weight": (2, 2)},
                **{
                    "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (
                        320,
                        768,
                    ),
                    "cond_stage_model.transformation.weight": (768, 1024),
                },
            ),
            "an AltDiffusion model .its text encoder is XLM-RoBERTa",
        ),
        ({"conv_in.weight": (2,), "down_blocks.0.resnets.0.conv1.weight": (2,)}, "only a UNet in diffusers"),
        (  # ComfyUI's models/diffusion_models layout (said "holds no Stable Diffusion UNet weights")
            {"input_blocks.0.0.weight": (2, 4, 1, 1), "label_emb.0.0.weight": (2, 2)},
            "only a UNet .a 'diffusion model' file: no model.diffusion_model. prefix",
        ),
        (
            {
                "transformer_blocks.0.attn.to_q.weight": (2, 2),
                "single_transformer_blocks.0.proj_out.weight": (2,),
            },
            "only a FLUX.1 transformer in diffusers layout",
        ),
        (
            {"transformer_blocks.0.attn.to_q.weight": (2, 2), "pos_embed.proj.weight": (2, 2)},
            "only an SD3.5 transformer in diffusers layout",
        ),
    ],
)
def test_single_file_that_is_no_base_model_is_refused(tmp_path, shapes, needle):
    path = write_safetensors(tmp_path / "model.safetensors", shapes)
    with pytest.raises(UnsupportedModelError, match=needle):
        check_source(str(path))


def test_a_gguf_file_says_what_it_is(tmp_path):
    from sdplan.trainer import models

    from sdplan.errors import UsageError

    path = tmp_path / "flux1-dev-Q4_0.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(UsageError, match="a GGUF file .weights quantized for ComfyUI-GGUF / Forge"):
        models.resolve_source(str(path))


def test_a1111_embedding_pt_given_as_the_model_says_so(tmp_path):
    """An A1111 .pt embedding: 'cannot tell SD 1.x, 2.x or SDXL from its keys (set model.family)'."""
    import torch
    from sdplan.trainer import models

    path = tmp_path / "my-style.pt"
    emb = {"string_to_token": {"*": 265}, "string_to_param": {"*": torch.zeros(1, 8)}, "name": "x", "step": 9}
    torch.save({**emb, "sd_checkpoint": "abc", "sd_checkpoint_name": "v1-5"}, path)
    with pytest.raises(UnsupportedModelError, match="a textual-inversion embedding"):
        models.load_components(str(path))


def test_truncated_safetensors_is_one_line_before_launch(tmp_path):
    path = write_safetensors(tmp_path / "model.safetensors", checkpoint(), cut=4)
    one_line_error(dry_run(path, tmp_path), 2, "truncated", "download or copy the file again")


def test_sd2_in_sgm_layout_is_sd2_not_an_sdxl_refiner(tmp_path):
    """SD 2.1 Turbo's file: its OpenCLIP under conditioner.embedders.0.model. (A1111 sd_models.py
    checkpoint_dict_replacements_sd2_turbo; ComfyUI SD20 "SD2 in sgm format"; diffusers loads it) was refused as
    an SDXL refiner, even with model.family=sd21. The refiner's UNet has label_emb; SD 2.x's has not."""
    shapes = checkpoint(text={"conditioner.embedders.0.model.ln_final.weight": (1024,)})
    path = write_safetensors(tmp_path / "sd_turbo.safetensors", shapes)
    assert check_source(str(path)).family == "sd21"
    assert check_source(str(path), family="sd21").family == "sd21"


def test_a_whole_checkpoint_passes_with_its_family(tmp_path):
    path = write_safetensors(tmp_path / "m.safetensors", checkpoint(text=SDXL_TE))
    assert check_source(str(path)).family == "sdxl"


TO_K = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"


def test_sd15_or_sd21_is_the_cross_attention_width_of_a_released_model(tmp_path):
    """recommend --out writes model.family; trained with model.path=an SD 2.x file, model.family: sd15 won
    (sd15 vs sd21 was "the setting's call"): planned at 512, loaded as SD 1.x (epsilon), exported as sd_v1.
    diffusers reads SD 2.x from the UNet's to_k width (1024), A1111 from the OpenCLIP encoder; a model.family
    that says otherwise is one line. A test model of another width stays the setting's call."""
    from sdplan.trainer import models

    sd21 = write_safetensors(tmp_path / "v2-1.safetensors", checkpoint(text=OPEN_CLIP, **{TO_K: (320, 1024)}))
    assert check_source(str(sd21)).family == "sd21"
    with pytest.raises(UnsupportedModelError, match="model.family is sd15 but .* an sd21 model"):
        check_source(str(sd21), family="sd15")
    one_line_error(dry_run(sd21, tmp_path, "model.family=sd15"), 2, "model.family is sd15", "sd21 model")
    odd = write_safetensors(tmp_path / "odd.safetensors", checkpoint(text=CLIP_L, **{TO_K: (320, 1024)}))
    assert check_source(str(odd)).family == "sd21"  # the width, as diffusers reads it
    sd15 = write_safetensors(tmp_path / "v1-5.safetensors", checkpoint(**{TO_K: (320, 768)}))
    with pytest.raises(UnsupportedModelError, match="model.family is sd21 but .* an sd15 model"):
        check_source(str(sd15), family="sd21")
    tiny = write_safetensors(tmp_path / "tiny.safetensors", checkpoint(text=OPEN_CLIP, **{TO_K: (32, 32)}))
    assert check_source(str(tiny), family="sd15").family == "sd15"

    # a folder: its UNet config's width (and the loaded UNet's, at load)
    folder = fake_diffusers_folder(tmp_path / "sd2", "sd21")
    with pytest.raises(UnsupportedModelError, match="model.family is sd15 but"):
        check_source(str(folder), family="sd15")
    narrow = fake_diffusers_folder(tmp_path / "narrow", "sd15", denoiser={"cross_attention_dim": 32})
    assert check_source(str(narrow), family="sd21").family == "sd21"
    with pytest.raises(UnsupportedModelError, match="model.family is sd21 but"):
        models._check_family("sd15", "sd21", "m", {"cross_attention_dim": 768})
    assert models._check_family("sd15", "sd21", "m", {"cross_attention_dim": 32}) == "sd21"
    # a config_dir of the other released family
    sd15_dir = fake_diffusers_folder(tmp_path / "sd15", "sd15")
    with pytest.raises(UnsupportedModelError, match="is an sd15 folder but .* is an sd21 checkpoint"):
        check_source(str(sd21), config_dir=str(sd15_dir))


# -- single files: pickled .ckpt, read without torch ---------------------------------------------------------------


def write_ckpt(path: Path, shapes: dict, *, nested: bool = True, **extra) -> Path:
    """A real torch.save .ckpt of zero tensors with these shapes: A1111's {"state_dict": {...}} (or flat)."""
    import torch

    state = {k: torch.zeros(shape, dtype=torch.float16) for k, shape in shapes.items()}
    torch.save({"state_dict": state, "global_step": 1, **extra} if nested else state, path)
    return path


@pytest.mark.parametrize(
    "text, nested, family",
    [(CLIP_L, True, "sd15"), (OPEN_CLIP, False, "sd21"), (SDXL_TE, True, "sdxl")],
)
def test_ckpt_family_is_read_before_anything_loads(tmp_path, text, nested, family):
    """A .ckpt's family was 'from the model' until the trainer had loaded it whole."""
    info = check_source(str(write_ckpt(tmp_path / "m.ckpt", checkpoint(text=text), nested=nested)))
    assert (info.family, info.notes[0]) == (family, f"model: single file: family {family}")


def test_ckpt_v_prediction_from_the_yaml_beside_it(tmp_path):
    path = write_ckpt(tmp_path / "768-v.ckpt", checkpoint(text=OPEN_CLIP))
    (tmp_path / "768-v.yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    assert check_source(str(path)).prediction_type == "v_prediction"


@pytest.mark.parametrize(
    "shapes, needle",
    [
        (checkpoint(9), "an inpainting model"),
        *OTHER_FILES,
        ({"lora_unet_down_blocks_0.lora_down.weight": (2, 2), "lora_te_x.alpha": ()}, "a LoRA"),
    ],
)
def test_ckpt_that_is_no_base_model_is_refused_before_launch(tmp_path, shapes, needle):
    path = write_ckpt(tmp_path / "m.ckpt", shapes, nested=False)
    one_line_error(dry_run(path, tmp_path), 2, needle)


def test_recommend_plans_a_ckpt_as_its_family_without_torch(tmp_path):
    path = write_ckpt(tmp_path / "xl.ckpt", checkpoint(text=SDXL_TE))
    out = recommend_in_a_process("--method", "lora", "--model", str(path), "--hardware", "RTX 4090")
    assert "a single file of the sdxl family" in out, out


def test_ckpt_whose_pickle_names_code_is_refused_without_running_it(tmp_path):
    import torch

    marker = tmp_path / "pwned"
    path = write_ckpt(tmp_path / "evil.ckpt", checkpoint(), extra=MkdirPayload(marker))
    line = one_line_error(
        runner.invoke(app, ["recommend", "--method", "lora", "--model", str(path)]), 2, "refusing to unpickle"
    )
    assert "mkdir" in line and not marker.exists()
    one_line_error(dry_run(path, tmp_path), 2, "refusing to unpickle")
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.exists()


def test_an_old_pickle_naming_code_is_refused_naming_it_without_torchs_advice(tmp_path):
    """A legacy (non-zip) .ckpt is read only by torch at load: its refusal carried torch's whole message,
    advice to re-run with weights_only=False (which runs the payload) included."""
    import torch

    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    state = {k: torch.zeros(s) for k, s in checkpoint().items()}
    torch.save({"state_dict": state, "x": MkdirPayload(marker)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(
        UnsafeCheckpointError, match=r"more than tensors \(its pickle names \w+\.mkdir\)"
    ) as e:
        check_source(str(path), deep=True)
    assert "weights_only" not in str(e.value) and not marker.exists()


def test_a_truncated_ckpt_is_said_to_be_truncated(tmp_path):
    """A .ckpt cut short (an interrupted download): the torch-free reader called a torch zip without its central
    directory "an old pickle checkpoint", and the trainer's load raised torch's RuntimeError / EOFError."""
    import torch
    from sdplan.trainer.models import ModelLoadError

    whole = write_ckpt(tmp_path / "whole.ckpt", checkpoint())
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="damaged or truncated .a zip archive whose end is missing"):
        check_source(str(cut))  # no torch: a zip without its end is no checkpoint any reader loads
    legacy = tmp_path / "legacy.ckpt"
    torch.save(
        {k: torch.zeros(s) for k, s in checkpoint().items()}, legacy, _use_new_zipfile_serialization=False
    )
    old, head = tmp_path / "old-cut.ckpt", tmp_path / "old-head.ckpt"
    old.write_bytes(legacy.read_bytes()[:-5])  # its last storage short
    head.write_bytes(legacy.read_bytes()[:40])  # its pickle cut
    for path in (old, head):
        with pytest.raises(ModelLoadError, match="damaged or truncated, torch cannot read it") as e:
            check_source(str(path), deep=True)
        assert e.value.fix == "download or copy the file again" and "\n" not in str(e.value)
    # and `sdplan train`'s check before anything loads, which called the cut zip "neither a zip archive nor a
    # pickle"
    one_line_error(
        dry_run(cut, tmp_path), 2, "a zip archive cut short or damaged", "download or copy it again"
    )


def test_a_ckpt_with_a_damaged_byte_is_said_to_be_damaged(tmp_path):
    """A zip .ckpt with one flipped byte in its data.pkl (a bad copy or disk): the torch-free reader said "its
    pickle does not parse: BadZipFile" and `sdplan train` asked for model.family; given one, the trainer's torch
    load (which checks no CRC) raised a UnicodeDecodeError traceback. The archive's CRC-32 of data.pkl says it
    is damaged: one line, before the launch and in the trainer's load."""
    import zipfile

    from sdplan.trainer.models import ModelLoadError
    from sdplan.trainer.single_file import read_checkpoint_safely

    whole = write_ckpt(tmp_path / "whole.ckpt", checkpoint())
    with zipfile.ZipFile(whole) as z:
        entry = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    raw = bytearray(whole.read_bytes())
    raw[entry.header_offset + 30 + len(entry.filename) + len(entry.extra) + 20] ^= 0xFF
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(raw))
    for deep in (False, True):
        with pytest.raises(ModelLoadError, match="damaged or truncated .its zip archive: Bad CRC-32") as e:
            check_source(str(bad), deep=deep)
        assert e.value.fix == "download or copy the file again"
    with pytest.raises(ModelLoadError, match="damaged or truncated") as e:
        read_checkpoint_safely(bad)  # the trainer's load of a file given as a .ckpt
    line = one_line_error(
        dry_run(bad, tmp_path), 2, "damaged or truncated", "download or copy the file again"
    )
    assert "model.family" not in line
    line = one_line_error(
        dry_run(bad, tmp_path, "model.family=sd15"), 2, "damaged or truncated", "Bad CRC-32"
    )


def test_a_ckpt_saved_without_checksums_is_not_damaged(tmp_path):
    """torch.serialization.set_crc32_options(False) saves every CRC-32 as 0 (some frameworks set it for the
    whole process): such a file was refused as "Bad CRC-32", though torch loads it. A CRC of 0 is none."""
    import torch
    from sdplan.trainer.single_file import read_checkpoint_safely

    torch.serialization.set_crc32_options(False)
    try:
        path = write_ckpt(tmp_path / "m.ckpt", checkpoint(text=CLIP_L))
    finally:
        torch.serialization.set_crc32_options(True)
    assert check_source(str(path)).family == "sd15"
    assert "model.diffusion_model.input_blocks.0.0.weight" in read_checkpoint_safely(path)


def test_an_old_training_checkpoint_with_lightnings_callback_and_a_numpy_step_loads(
    single_sd15, tiny_sd15, tmp_path, monkeypatch
):
    """sd-v1-4.ckpt style: PyTorch Lightning's ModelCheckpoint class under "callbacks" and a numpy int64
    global_step beside the weights. Refused as "holds more than tensors" by both readers; ComfyUI and A1111
    allow exactly these. They stand in as an inert TrainingState: the weights read (torch-free, with torch,
    and by diffusers' own weights_only read), nothing of theirs runs, and torch's safe globals are as before."""
    import sys
    import types

    import numpy as np
    import torch
    from safetensors.torch import load_file
    from sdplan.trainer.single_file import load_single_file_model, read_checkpoint_safely

    module = types.ModuleType("pytorch_lightning.callbacks.model_checkpoint")
    ModelCheckpoint = type("ModelCheckpoint", (), {"__module__": module.__name__})  # no Lightning here
    module.ModelCheckpoint = ModelCheckpoint
    for name in ("pytorch_lightning", "pytorch_lightning.callbacks"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    path = tmp_path / "sd-v1-4.ckpt"
    state = load_file(str(single_sd15))
    callbacks = {ModelCheckpoint: {"best_model_score": None}}
    torch.save({"state_dict": state, "global_step": np.int64(470000), "callbacks": callbacks}, path)
    monkeypatch.delitem(sys.modules, module.__name__)

    assert check_source(str(path)).family == "sd15"  # torch-free
    before = set(torch.serialization.get_safe_globals())
    assert set(read_checkpoint_safely(path)) == set(state)
    pipe = load_single_file_model(path, "sd15", config_dir=tiny_sd15)
    assert torch.equal(pipe.vae.decoder.conv_out.weight, state["first_stage_model.decoder.conv_out.weight"])
    assert set(torch.serialization.get_safe_globals()) == before


def _zip_ckpt(path: Path, data_pkl: bytes) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/version", "3\n")
    return path


def _call(module: str, name: str, arg: bytes) -> bytes:
    """A protocol-2 pickle of ``module.name(arg)`` (GLOBAL, one argument, REDUCE)."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + arg + b"\x85R."


@pytest.mark.parametrize(
    "data_pkl, unread",
    [
        (b"\x80\x02garbage", "its pickle does not parse"),
        (_call("torch._utils", "_rebuild_qtensor", b"N"), "names torch._utils._rebuild_qtensor"),
        (_call("builtins", "bytearray", b"J\x00\x00\x00\x7f"), "a malformed bytearray"),  # 2 GB, never made
        (b"\x80\x02]q\x00.", "holds a list, not a state dict"),
    ],
)
def test_ckpt_the_reader_cannot_read_is_left_to_the_load(tmp_path, data_pkl, unread):
    info = check_source(str(_zip_ckpt(tmp_path / "odd.ckpt", data_pkl)))
    assert info.family is None and unread in info.unread


def test_ckpt_naming_any_other_global_is_refused(tmp_path):
    path = _zip_ckpt(tmp_path / "evil.ckpt", _call("builtins", "eval", b"X\x03\x00\x00\x001+1"))
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle it.*names builtins.eval"):
        check_source(str(path))


def test_old_pickle_ckpt_is_read_when_it_loads(tmp_path):
    """torch's pre-1.6 format (no zip) is not read here: one line says so; the trainer loads it (deep)."""
    import torch

    path = tmp_path / "old.ckpt"
    torch.save(
        {"state_dict": {k: torch.zeros(s) for k, s in checkpoint().items()}},
        path,
        _use_new_zipfile_serialization=False,
    )
    one_line_error(
        runner.invoke(app, ["recommend", "--method", "lora", "--model", str(path)]),
        2,
        "an old pickle checkpoint, not torch's zip",
    )
    assert check_source(str(path), deep=True).family == "sd15"


# -- single files: the prediction type ---------------------------------------------------------------------------


SILENT_YAML = "model:\n  params:\n    linear_start: 0.00085\n"  # v1-inference.yaml: no parameterization
# A1111 configs/sd_xl_v.yaml: v-prediction is the SGM denoiser's scaling (no parameterization key)
SGM_YAML = """model:
  target: sgm.models.diffusion.DiffusionEngine
  params:
    denoiser_config:
      target: sgm.modules.diffusionmodules.denoiser.DiscreteDenoiser
      params:
        scaling_config:
          target: sgm.modules.diffusionmodules.denoiser_scaling.{}
"""


@pytest.mark.parametrize(
    "extra, metadata, yaml_text, want",
    [
        ({}, None, 'model:\n  params:\n    parameterization: "v"\n', "v_prediction"),
        ({}, None, SGM_YAML.format("VScaling"), "v_prediction"),
        ({"v_pred": (0,)}, None, SGM_YAML.format("EpsScaling"), "epsilon"),
        ({"v_pred": (0,)}, None, SILENT_YAML, "v_prediction"),
        ({}, {"modelspec.prediction_type": "v"}, SILENT_YAML, "v_prediction"),
        ({}, None, SILENT_YAML, "epsilon"),
        ({"v_pred": (0,)}, None, None, "v_prediction"),
        ({}, {"modelspec.prediction_type": "v"}, None, "v_prediction"),
        ({}, {"modelspec.architecture": "stable-diffusion-v2-768-v"}, None, "v_prediction"),
        ({}, {"modelspec.architecture": "stable-diffusion-v2-512"}, None, "epsilon"),
        ({}, None, None, None),
    ],
)
def test_prediction_type_of_a_single_file(tmp_path, extra, metadata, yaml_text, want):
    """A1111 reads a <name>.yaml beside the checkpoint (it wins where it states the parameterization: ldm's
    parameterization, or SGM's VScaling / EpsScaling), ComfyUI a v_pred key, kohya / the SAI spec write
    modelspec.prediction_type and the SD2 768-v architecture; a yaml that states none is ldm's default eps only
    where the file says nothing (an SGM v-prediction yaml, and a silent one, turned a v_pred file epsilon)."""
    path = write_safetensors(tmp_path / "m.safetensors", checkpoint(text=OPEN_CLIP, **extra), metadata)
    if yaml_text:
        (tmp_path / "m.yaml").write_text(yaml_text)
    assert check_source(str(path)).prediction_type == want


def test_ztsnr_key_means_zero_terminal_snr(tmp_path):
    path = write_safetensors(tmp_path / "m.safetensors", checkpoint(text=SDXL_TE, v_pred=(0,), ztsnr=(0,)))
    info = check_source(str(path))
    assert (info.prediction_type, info.zero_snr) == ("v_prediction", True)


def test_sd2_weights_test_follows_comfyui():
    import torch
    from sdplan.trainer.source_check import sd2_v_from_weights

    assert sd2_v_from_weights(torch.linspace(-1, 1, 320)) and not sd2_v_from_weights(torch.zeros(320) + 0.01)


@pytest.fixture(scope="module")
def single_sd15(tiny_sd15, tmp_path_factory) -> Path:
    from diffusers import StableDiffusionPipeline
    from sdplan.trainer import export

    pipe = StableDiffusionPipeline.from_pretrained(
        str(tiny_sd15), safety_checker=None, requires_safety_checker=False
    )
    out = tmp_path_factory.mktemp("single")
    return export.save_full(out, pipeline=pipe, family="sd15", metadata=None)[-1]


def test_v_prediction_file_trains_as_v(single_sd15, tiny_sd15, tmp_path):
    """A v-prediction SDXL merge (NoobAI-style v_pred / ztsnr keys) trained as epsilon: the config folder's or
    diffusers' default scheduler won over what the file says."""
    from safetensors.torch import load_file, save_file
    from sdplan.trainer import models

    state = load_file(str(single_sd15))
    import torch

    state["v_pred"], state["ztsnr"] = torch.zeros(0), torch.zeros(0)
    vfile = tmp_path / "vpred.safetensors"
    save_file(state, str(vfile))
    comps = models.load_components(str(vfile), config_dir=str(tiny_sd15))
    assert comps.prediction_type == "v_prediction"
    assert comps.noise_scheduler.config.rescale_betas_zero_snr
    assert any("v_pred key and ztsnr key" in n for n in comps.notes), comps.notes


def test_v_prediction_file_trains_as_v_where_the_config_leaves_the_keys_out(single_sd15, tiny_sd15, tmp_path):
    """The real SD 1.5 scheduler_config.json has no prediction_type and no rescale_betas_zero_snr: a loaded
    config lists such keys in _use_default_values, which from_config drops, so the file's v_pred and ztsnr keys
    were printed as read and then lost: the run trained and sampled as epsilon."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from sdplan.trainer import models

    config_dir = tmp_path / "config"
    shutil.copytree(tiny_sd15, config_dir)
    sched = config_dir / "scheduler" / "scheduler_config.json"
    cfg = json.loads(sched.read_text())
    for key in ("prediction_type", "rescale_betas_zero_snr", "timestep_spacing"):
        cfg.pop(key, None)
    # SD 1.5's own sampler, which has no zero-terminal-SNR option: the grids sampled from SNR 0.0047
    cfg.update(_class_name="PNDMScheduler", skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)
    sched.write_text(json.dumps(cfg))
    index = json.loads((config_dir / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "PNDMScheduler"]
    (config_dir / "model_index.json").write_text(json.dumps(index))
    state = load_file(str(single_sd15))
    state["v_pred"], state["ztsnr"] = torch.zeros(0), torch.zeros(0)
    vfile = tmp_path / "vpred.safetensors"
    save_file(state, str(vfile))
    comps = models.load_components(str(vfile), config_dir=str(config_dir))
    for scheduler in (comps.noise_scheduler, comps.inference_scheduler()):
        assert scheduler.config.prediction_type == "v_prediction", type(scheduler).__name__
        # zero terminal SNR: 2**-24, not 0.0047
        assert float(scheduler.alphas_cumprod[-1]) < 1e-6, type(scheduler).__name__
    assert type(comps.inference_scheduler()).__name__ == "DDIMScheduler"
    assert comps.inference_scheduler().config.timestep_spacing == "trailing"
    assert "samples with DDIMScheduler: PNDMScheduler has no zero terminal SNR" in comps.notes


def test_a_v_prediction_model_saves_comfyuis_v_pred_and_ztsnr_keys(tiny_sd15, tmp_path):
    """A fine-tune of a v-prediction, zero-terminal-SNR base (NoobAI-XL V-Pred style): its single file had only
    modelspec.prediction_type, which ComfyUI's SDXL loader never reads (comfy/supported_models.py
    SDXL.model_type: the v_pred and ztsnr keys), so ComfyUI sampled it as epsilon; sdplan read it back without
    zero terminal SNR. An epsilon model gets neither key."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from safetensors import safe_open
    from sdplan.trainer import export

    pipe = StableDiffusionPipeline.from_pretrained(
        str(tiny_sd15), safety_checker=None, requires_safety_checker=False
    )
    eps = export.save_full(tmp_path / "eps", pipeline=pipe, family="sd15", metadata=None)[-1]
    pipe.scheduler = DDPMScheduler.from_config(
        pipe.scheduler.config, prediction_type="v_prediction", rescale_betas_zero_snr=True
    )
    vfile = export.save_full(tmp_path / "v", pipeline=pipe, family="sd15", metadata=None)[-1]
    with safe_open(str(vfile), "pt") as f:
        assert {"v_pred", "ztsnr"} <= set(f.keys()) and f.get_tensor("v_pred").numel() == 0
    with safe_open(str(eps), "pt") as f:
        assert not {"v_pred", "ztsnr"} & set(f.keys())
    info = check_source(str(vfile))
    assert (info.prediction_type, info.zero_snr) == ("v_prediction", True)


def test_yaml_beside_the_file_sets_v_prediction(single_sd15, tiny_sd15, tmp_path):
    from sdplan.trainer import models

    vfile = Path(shutil.copy(single_sd15, tmp_path / "m.safetensors"))
    (tmp_path / "m.yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    comps = models.load_components(str(vfile), config_dir=str(tiny_sd15))
    assert comps.prediction_type == "v_prediction"
    assert comps.notes[0].startswith("model: single file: family sd15, prediction v_prediction")


# -- config_dir -----------------------------------------------------------------------------------------------


def test_config_dir_null_in_yaml_is_no_config_dir(single_sd15, tmp_path):
    from sdplan import config

    cfg = config.validate({"method": "lora", "model": {"path": str(single_sd15), "config_dir": None}})
    assert cfg.model.config_dir is None
    assert check_source(cfg.model.path, config_dir=cfg.model.config_dir).family == "sd15"


def test_config_dir_of_another_family_is_refused(tmp_path):
    path = write_safetensors(tmp_path / "xl.safetensors", checkpoint(text=SDXL_TE))
    sd15 = fake_diffusers_folder(tmp_path / "sd15", "sd15")
    one_line_error(
        dry_run(path, tmp_path, f"model.config_dir={sd15}"),
        2,
        "model.config_dir",
        "sd15 folder",
        "sdxl checkpoint",
    )


def test_config_dir_with_tilde_is_expanded(single_sd15, tiny_sd15, tmp_path, monkeypatch):
    """'config_dir: ~/models/sd15' reached diffusers as the hub id '~/models/sd15' (HFValidationError)."""
    from sdplan.trainer import models

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_sd15, tmp_path / "configs")
    assert models.load_components(str(single_sd15), config_dir="~/configs").family == "sd15"


# -- an SD 1.x file whose CLIP keys lack text_model. ------------------------------------------------------------


def old_clip_file(single_sd15: Path, path: Path) -> Path:
    """``single_sd15`` with its CLIP text encoder in the layout of some 2022 SD 1.x files:
    ``cond_stage_model.transformer.embeddings.*`` (no ``text_model.``) and a saved float ``position_ids``."""
    import torch
    from safetensors.torch import load_file, save_file

    old = "cond_stage_model.transformer."
    state = {k.replace(old + "text_model.", old): v for k, v in load_file(str(single_sd15)).items()}
    state[old + "embeddings.position_ids"] = torch.arange(77, dtype=torch.float32)[None]
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save({"state_dict": state, "global_step": 470000}, path)
    return path


@pytest.mark.parametrize(
    ("suffix", "configs"), [(".safetensors", "dir"), (".ckpt", "dir"), (".safetensors", "hub")]
)
def test_an_sd15_file_whose_clip_keys_lack_text_model_loads_its_text_encoder(
    single_sd15, tiny_sd15, tmp_path, monkeypatch, suffix, configs
):
    """An SD 1.x file whose CLIP keys lack ``text_model.`` (A1111 and ComfyUI rename them and load it) passed
    the check as sd15, then failed in the trainer with diffusers' "Failed to load CLIPTextModel. Weights for
    this component appear to be missing in the checkpoint". Its text encoder is the file's own, with the
    configs of model.config_dir or, without it, of the hub repo diffusers reads for SD 1.x (here a cache
    holding the tiny model's configs, read offline)."""
    import torch
    from huggingface_hub import constants
    from sdplan.trainer import models
    from sdplan.trainer.source_check import SINGLE_FILE_CONFIGS
    from transformers import CLIPTextModel

    path = old_clip_file(single_sd15, tmp_path / f"old{suffix}")
    assert check_source(str(path)).family == "sd15"
    config_dir = str(tiny_sd15)
    if configs == "hub":
        config_dir, cache = None, tmp_path / "hub"
        snapshot = cache / ("models--" + SINGLE_FILE_CONFIGS["sd15"].replace("/", "--")) / "snapshots" / "c"
        shutil.copytree(tiny_sd15, snapshot, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
        (snapshot.parent.parent / "refs").mkdir()
        (snapshot.parent.parent / "refs" / "main").write_text("c")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    comps = models.load_components(str(path), config_dir=config_dir)
    want = CLIPTextModel.from_pretrained(str(tiny_sd15 / "text_encoder"))
    got = comps.text_encoders[0]
    assert comps.family == "sd15" and got.dtype == comps.unet.dtype == torch.float32
    assert got.state_dict().keys() == want.state_dict().keys()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in got.state_dict().items())
    ids = comps.tokenizers[0]("a photo of a cat", padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(got(ids.input_ids)[0], want(ids.input_ids)[0])


@pytest.mark.train
@pytest.mark.usefixtures("one_torch_thread", "fresh_accelerator_state")
def test_an_sd15_file_whose_clip_keys_lack_text_model_trains_its_text_encoder(
    single_sd15, tiny_sd15, tmp_path
):
    from conftest import tiny_train_config
    from sdplan.trainer import run

    path = old_clip_file(single_sd15, tmp_path / "old.safetensors")
    ds = make_images(tmp_path / "ds", n=2)
    cfg = tiny_train_config(
        path, ds, tmp_path / "o", "training.max_steps=1", "training.train_text_encoder=true"
    )
    cfg.model.config_dir = str(tiny_sd15)
    assert run.train(cfg)["steps"] == 1


# -- a hub id in the local cache -----------------------------------------------------------------------------------


@pytest.fixture
def counting_hub(monkeypatch):
    """A local address standing in for the hub: it counts the connections and closes each at once."""
    from huggingface_hub import constants

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    seen = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            seen.append(1)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield seen
    server.close()


def test_cached_hub_id_loads_without_the_network(tiny_sd15, tmp_path, monkeypatch, counting_hub):
    """A hub id whose files are all in the cache: it loaded through the hub client, which asked the network
    first for each part (196 s of retries without one)."""
    from huggingface_hub import constants
    from sdplan.trainer import models

    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny-sd"
    shutil.copytree(tiny_sd15, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    comps = models.load_components("someorg/tiny-sd")
    assert comps.family == "sd15" and comps.source == "someorg/tiny-sd"
    assert "from the local Hugging Face cache" in comps.notes[0]
    assert counting_hub == []


def test_ckpt_whose_state_dict_contains_itself_is_read_once(tmp_path):
    """A pickle can build a dict that holds itself under "state_dict": unwrapped once, as A1111 does (a loop
    unwrapping until no "state_dict" is left never ended)."""
    import pickle

    d: dict = {}
    d["state_dict"] = d
    with pytest.raises(UnsupportedModelError, match="holds no Stable Diffusion UNet weights"):
        check_source(str(_zip_ckpt(tmp_path / "loop.ckpt", pickle.dumps(d, protocol=2))))


# -- a hub id the local cache does not hold: its configs asked for before the launch -------------------------------


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A local server answering as the hub does for the files of ``repos`` (repo id -> {path: JSON}), in an
    empty cache; yields (repos, the paths asked for)."""
    import hashlib
    import http.server
    import re
    import urllib.parse

    import hub_cache
    from huggingface_hub import constants

    repos: dict[str, dict[str, dict]] = {}
    asked: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bool):
            path = urllib.parse.unquote(self.path.split("?")[0])
            asked.append(path)
            m = re.match(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$", path)
            files = repos.get(m.group(1)) if m else None
            data = json.dumps(files[m.group(2)]).encode() if files and m.group(2) in files else None
            if data is None:
                self.send_response(404 if files else 401)
                self.send_header("X-Error-Code", "EntryNotFound" if files else "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("X-Repo-Commit", hub_cache.COMMIT)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    yield repos, asked
    server.shutdown()
    server.server_close()


def test_an_uncached_hub_model_sdplan_cannot_train_is_refused_before_anything_downloads(tmp_path, fake_hub):
    """An inpainting model given by hub id: its configs said so only in a local folder; from the hub the
    trainer was launched, the run folder written, and the UNet's weights downloaded before anything failed."""
    import hub_cache

    repos, asked = fake_hub
    files = hub_cache.configs("sd15")
    files["model_index.json"]["_class_name"] = "StableDiffusionInpaintPipeline"
    files["unet/config.json"] = {**files["unet/config.json"], "in_channels": 9}
    repos["someorg/sd-inpainting"] = files
    ds = make_images(tmp_path / "ds", n=2)
    out = tmp_path / "o"
    args = ["--model", "someorg/sd-inpainting", "--dataset", str(ds), "--out", str(out), "--device", "cpu"]
    r = runner.invoke(app, ["train", *args, "--yes"])
    one_line_error(r, 2, "model.path someorg/sd-inpainting", "an inpainting model")
    assert not out.exists()
    assert asked and all(p.endswith(".json") for p in asked), asked  # configs only, no weights


def test_an_uncached_hub_model_is_planned_as_the_family_its_configs_say(tmp_path, fake_hub):
    """A hub id whose name does not say its family was planned as SD 1.5 (the guess from its name) whatever
    it was; an SDXL model is planned as SDXL, and a model.family that disagrees is one line."""
    import hub_cache

    repos, _ = fake_hub
    repos["someorg/my-model"] = hub_cache.configs("sdxl")
    r = dry_run("someorg/my-model", tmp_path)
    assert r.exit_code == 0, r.output
    assert "lora on sdxl (someorg/my-model)" in r.output
    r = dry_run("someorg/my-model", tmp_path, "model.family=sd15")
    one_line_error(r, 2, "model.family is sd15", "an sdxl model")


def test_an_uncached_hub_id_the_hub_does_not_know_is_one_line_before_the_launch(tmp_path, fake_hub):
    ds = make_images(tmp_path / "ds", n=2)
    out = tmp_path / "o"
    args = ["--model", "someorg/typo", "--dataset", str(ds), "--out", str(out), "--device", "cpu", "--yes"]
    r = runner.invoke(app, ["train", *args])
    one_line_error(r, 2, "someorg/typo", "not found on the hub")
    assert not out.exists()


def test_recommend_plans_an_uncached_hub_model_as_the_family_its_configs_say(fake_hub):
    """`recommend --model <hub id>` said "cannot tell its family here" for any hub id the cache did not hold
    and profiles/models does not list."""
    import hub_cache

    repos, asked = fake_hub
    repos["someorg/my-model"] = hub_cache.configs("sdxl")
    r = runner.invoke(
        app, ["recommend", "--method", "lora", "--model", "someorg/my-model", "--hardware", "RTX 4090"]
    )
    assert r.exit_code == 0, r.output
    assert "a hub id of the sdxl family (planned as sdxl)" in " ".join(r.output.split())
    assert asked and all(p.endswith(".json") for p in asked), asked


def test_a_single_file_without_config_dir_offline_says_to_set_config_dir(single_sd15, tmp_path, monkeypatch):
    """diffusers fetches a single file's component configs and tokenizers from the hub: offline (or with no
    network) the trainer said only "could not load model file ...: Cannot find an appropriate cached snapshot
    folder ...", with no way on; model.config_dir is that way."""
    from huggingface_hub import constants
    from sdplan.trainer import models

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(models.ModelLoadError) as e:
        models.load_components(str(single_sd15))
    assert "come from the Hugging Face hub, and it cannot be reached here" in str(e.value)
    assert "set model.config_dir to a local diffusers folder of the same family" in str(e.value)


def test_a_dry_run_plans_an_uncached_hub_id_offline_and_says_it_was_not_checked(tmp_path, monkeypatch):
    """Offline, a dry run (plan and print, nothing run) planned a hub id from its name before the hub check;
    it must still (a run is refused: it could not load the model)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    r = dry_run("someorg/my-xl-model", tmp_path)
    assert r.exit_code == 0, r.output
    assert "lora on sdxl (someorg/my-xl-model)" in r.output
    assert "model: not checked (HF_HUB_OFFLINE is set): planned as the family its name suggests" in r.output
    args = (
        f"--model someorg/my-xl-model --dataset {tmp_path / 'ds'} --out {tmp_path / 'o'} --device cpu --yes"
    )
    one_line_error(runner.invoke(app, ["train", *args.split()]), 2, "HF_HUB_OFFLINE is set")
    assert not (tmp_path / "o").exists()


def test_a_dry_run_does_not_plan_a_model_whose_family_nothing_says_as_the_default_family(
    tmp_path, monkeypatch
):
    """A hub id with no family in its name, offline, and a legacy (not zip) .ckpt whose keys cannot be read
    without loading it were planned as SD 1.x at 512 ("planned as the family its name suggests"), whatever
    they were; recommend refused both. One line asking for model.family; given, it is what is planned."""
    import pickle

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    legacy = tmp_path / "realvis_legacy.ckpt"
    legacy.write_bytes(pickle.dumps({"state_dict": {}}, protocol=2))
    for model, why in (
        ("someone/my-model", "a hub id the hub cannot be asked about here (HF_HUB_OFFLINE is set)"),
        (legacy, "a pickled checkpoint whose keys cannot be read without loading it"),
    ):
        one_line_error(
            dry_run(model, tmp_path), 2, f"model {model}: cannot tell its family here ({why}", "model.family="
        )
        r = dry_run(model, tmp_path, "model.family=sdxl")
        assert r.exit_code == 0 and f"lora on sdxl ({model})" in r.output, r.output
    assert (
        "planned as model.family says" in r.output
        or "planned as model.family says" in dry_run("someone/my-model", tmp_path, "model.family=sdxl").output
    )


def test_a_hub_id_whose_configs_alone_are_cached_is_refused_where_the_hub_cannot_be_reached(tmp_path):
    """What the check before a launch keeps of a hub model is its configs: offline (or without a network) a
    second `sdplan train` passed its check from them, and the trainer then failed on the weights ("does not
    appear to have a file named diffusion_pytorch_model.bin", without naming the cause; ~65 s of retries
    without a network). The suite runs offline, with such a cache of the listed hub ids (tests/hub_cache.py)."""
    hub_id = "stable-diffusion-v1-5/stable-diffusion-v1-5"
    info = check_source(hub_id, hub=True)  # its configs say what it is: recommend plans it from them
    assert (info.family, info.cached) == ("sd15", False)
    args = [
        "--model",
        hub_id,
        "--dataset",
        str(make_images(tmp_path / "ds", n=2)),
        "--out",
        str(tmp_path / "o"),
    ]
    one_line_error(
        runner.invoke(app, ["train", *args, "--device", "cpu", "--yes"]),
        2,
        "the local cache lacks its weights and HF_HUB_OFFLINE is set",
    )
    assert not (tmp_path / "o").exists()
    r = runner.invoke(app, ["train", *args, "--device", "cpu", "--dry-run"])
    assert r.exit_code == 0 and "lora on sd15" in r.output, r.output
    assert (
        "note: the local cache lacks the model's weights, and the hub cannot be reached (HF_HUB_OFFLINE"
        in r.output
    )


def test_the_sd2_probe_reads_fp8_weights(tmp_path):
    """An fp8 SD 2.x file (F8_E4M3 / F8_E5M2): the probe read no std, so a 512 epsilon base was planned at 768
    while the trainer's own probe (torch) trained it as epsilon. numpy has no fp8: a table of each byte's value,
    checked against torch's."""
    import torch
    from safetensors.torch import save_file
    from sdplan.trainer.source_check import SD2_V_PROBE, tensor_std

    weights = torch.randn(320) * 0.2
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        save_file({SD2_V_PROBE: weights.to(dtype)}, tmp_path / "probe.safetensors")
        want = float(weights.to(dtype).float().std(unbiased=False))
        assert tensor_std(tmp_path / "probe.safetensors", SD2_V_PROBE) == pytest.approx(want, rel=1e-6)


def test_an_sd2_single_files_prediction_type_is_read_from_its_weights_without_torch(tmp_path):
    """An SD 2.x .safetensors with no .yaml beside it and no metadata (v2-1_512-ema-pruned.safetensors): the
    trainer told epsilon from v-prediction by ComfyUI's test on its weights, recommend (headers only) could
    not, and planned the 512 base at 768. The probe tensor is now read from its bytes with numpy."""
    import numpy as np
    from sdplan.trainer.source_check import SD2_V_PROBE

    path = write_safetensors(
        tmp_path / "v2-1_512.safetensors", checkpoint(text=OPEN_CLIP, **{SD2_V_PROBE: (320,)})
    )
    info = check_source(str(path))
    assert (info.family, info.prediction_type) == ("sd21", "epsilon")  # zeros: std 0
    assert "prediction type epsilon from its weights (ComfyUI's SD 2.x test)" in info.notes
    n = int.from_bytes(path.read_bytes()[:8], "little")
    start, _ = json.loads(path.read_bytes()[8 : 8 + n])[SD2_V_PROBE]["data_offsets"]
    with path.open("r+b") as f:
        f.seek(8 + n + start)
        f.write(np.linspace(-1, 1, 320).astype("<f2").tobytes())  # a 768-v model's spread
    assert check_source(str(path)).prediction_type == "v_prediction"


def test_an_sd2_ckpts_prediction_type_is_read_from_its_weights_without_torch(tmp_path):
    """v2-1_512-ema-pruned.ckpt (no .yaml, no metadata): the .safetensors probe ran only on .safetensors, so
    recommend and train planned the epsilon 512 base at 768 while the trainer (torch) trained it as epsilon.
    The probe tensor is now read from the zip's data/<key> entry, at its offset and strides, in any float
    dtype (here as a slice of a larger storage, and strided)."""

    import torch
    from sdplan.trainer.ckpt_reader import read_ckpt_tensor
    from sdplan.trainer.source_check import SD2_V_PROBE, tensor_std

    state = {k: torch.zeros(s, dtype=torch.float16) for k, s in checkpoint(text=OPEN_CLIP).items()}
    eps = tmp_path / "v2-1_512-ema-pruned.ckpt"
    torch.save({"state_dict": {**state, SD2_V_PROBE: torch.full((320,), 0.01)}, "global_step": 1}, eps)
    v = tmp_path / "v2-1_768-ema-pruned.ckpt"
    spread = torch.linspace(-1, 1, 640, dtype=torch.bfloat16)
    torch.save({"state_dict": {**state, SD2_V_PROBE: spread[320:]}}, v)  # offset 320 in a shared storage
    assert (check_source(str(eps)).prediction_type, check_source(str(v)).prediction_type) == (
        "epsilon",
        "v_prediction",
    )
    assert "prediction type epsilon from its weights (ComfyUI's SD 2.x test)" in check_source(str(eps)).notes
    assert tensor_std(v, SD2_V_PROBE) == pytest.approx(float(spread[320:].float().std(unbiased=False)))
    strided = tmp_path / "strided.ckpt"
    base = torch.randn(320, 3, dtype=torch.float32)
    torch.save({"state_dict": {SD2_V_PROBE: base[:, 1]}}, strided)
    dtype, raw = read_ckpt_tensor(strided, SD2_V_PROBE)
    assert dtype == "F32" and raw == base[:, 1].contiguous().numpy().tobytes()
    assert read_ckpt_tensor(strided, "missing") is None

    out = recommend_in_a_process("--method", "lora", "--model", str(eps), "--hardware", "RTX 4090")
    assert "lora sd21 at 512px" in out, out


def test_a_single_file_whose_configs_are_not_cached_says_so_at_recommend_and_before_the_launch(
    tmp_path, monkeypatch
):
    """`recommend --model ./x.safetensors --out DIR` wrote model.config_dir: null without a word, though the
    file's component configs come from the hub at its load; offline, `train` then failed in the trainer about 11 s
    after the launch. Where the local cache lacks them, recommend warns, and train says so in one line before the
    launch when the hub cannot be asked (the suite runs offline); a dry run, which asks no hub, warns."""
    from sdplan.trainer import source_check

    model = write_safetensors(tmp_path / "x.safetensors", checkpoint())
    repo = source_check.SINGLE_FILE_CONFIGS["sd15"]
    monkeypatch.setattr(source_check, "cached_snapshot", lambda repo_id, revision=None: None)
    line = source_check.single_file_configs("file", "sd15", None)
    assert repo in line and "model.config_dir" in line
    assert source_check.single_file_configs("file", "sd15", str(tmp_path)) is None  # config_dir given
    assert source_check.single_file_configs("folder", "sd15", None) is None

    out = runner.invoke(
        app,
        [
            "recommend",
            "--method",
            "lora",
            "--model",
            str(model),
            "--hardware",
            "RTX 4090",
            "--out",
            str(tmp_path / "r"),
        ],
    )
    assert out.exit_code == 0, out.output
    assert (
        f"warning: a single file's component configs and tokenizers come from the Hugging Face hub ({repo})"
        in (" ".join(out.output.split()))
    )
    assert "warning:" in dry_run(model, tmp_path).output
    message = _offline_train_refusal(model, tmp_path, "2")
    assert (
        message.startswith(f"error: model.path {model}: ")
        and repo in message
        and "model.config_dir" in message
    )


def _offline_train_refusal(model, tmp_path, suffix: str = "") -> str:
    """`sdplan train` of the single file ``model`` on the CPU, offline: its one-line refusal."""
    ds = make_images(tmp_path / f"ds{suffix}", n=2)
    args = ["train", "--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / f"o{suffix}"), "--device", "cpu"]  # fmt: skip
    return one_line_error(
        runner.invoke(app, args), 2, "and the hub cannot be reached (HF_HUB_OFFLINE is set)"
    )


def test_a_partial_hub_config_cache_is_not_a_single_files_configs(tmp_path, monkeypatch):
    """The cache `sdplan train`'s own hub check leaves (model_index.json, the UNet's and the scheduler's configs:
    a --dry-run or a "no" at the prompt writes it, and the suite's cache is one) passed for a single file's configs:
    the run launched and failed offline in the trainer on a CLIP shape mismatch (transformers built a default
    512-wide CLIP config for the text encoder it lacks). All the files from_single_file reads are required, else
    the empty cache's line: a warning at recommend and a dry run, one line before the launch offline."""
    from hub_cache import configs, write_repo
    from huggingface_hub import constants
    from sdplan.trainer import source_check
    from sdplan.trainer.models import ModelLoadError

    model = write_safetensors(tmp_path / "x.safetensors", checkpoint())
    repo = source_check.SINGLE_FILE_CONFIGS["sd15"]
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    snap = write_repo(cache, repo, configs("sd15"))  # what check_hub keeps
    assert source_check.cached_snapshot(repo) == snap
    line = source_check.single_file_configs("file", "sd15", None)
    assert "the local cache does not hold them all (no vae/config.json and 2 more)" in line, line
    with pytest.raises(ModelLoadError, match="the hub cannot be reached"):
        source_check.single_file_configs("file", "sd15", None, ask=True)
    message = _offline_train_refusal(model, tmp_path)
    assert message.startswith(f"error: model.path {model}: ") and "does not hold them all" in message
    assert "does not hold them all" in dry_run(model, tmp_path).output
    out = runner.invoke(
        app, ["recommend", "--method", "lora", "--model", str(model), "--hardware", "RTX 4090"]
    )
    assert out.exit_code == 0 and "does not hold them all" in " ".join(out.output.split()), out.output

    for sub in ("text_encoder", "vae"):  # the rest of what from_single_file fetches: then it is cached
        (snap / sub).mkdir()
        (snap / sub / "config.json").write_text("{}")
    for name in ("vocab.json", "merges.txt"):
        (snap / "tokenizer" / name).parent.mkdir(exist_ok=True)
        (snap / "tokenizer" / name).write_text("{}")
    # without it CLIPTokenizer's model_max_length is 1e30: OverflowError in the trainer after the launch
    line = source_check.single_file_configs("file", "sd15", None)
    assert "(no tokenizer/tokenizer_config.json)" in line, line
    (snap / "tokenizer" / "tokenizer_config.json").write_text("{}")
    assert source_check.single_file_configs("file", "sd15", None, ask=True) is None
    sdxl = write_repo(cache, source_check.SINGLE_FILE_CONFIGS["sdxl"], configs("sdxl"))
    assert "no vae/config.json and 4 more" in source_check.single_file_configs("file", "sdxl", None)
    assert sdxl.is_dir()


@pytest.mark.parametrize("name", ["x.sft", "X.SAFETENSORS"])
def test_a_safetensors_file_named_sft_or_in_upper_case_passes_the_check_before_the_launch(tmp_path, name):
    """.sft (Black Forest Labs' FLUX.1 suffix, ComfyUI's load_torch_file reads it) was "not a model file"; both
    are read as safetensors, by their header (a .sft that is none is one line)."""
    model = write_safetensors(tmp_path / name, checkpoint())
    out = dry_run(model, tmp_path)
    assert out.exit_code == 0, out.output
    assert out.output.startswith(f"lora on sd15 ({model})"), out.output
    junk = tmp_path / "junk.sft"
    junk.write_bytes(b"not safetensors at all")
    one_line_error(dry_run(junk, tmp_path), 2, f"model.path {junk}: not a safetensors file (no valid header)")


def test_a_sft_files_link_lies_in_the_run_folder_and_outlives_no_load(tmp_path):
    """A .sft / X.SAFETENSORS file reaches diffusers through a link named .safetensors. Its folder was
    /tmp/sdplan-model-*, removed at exit: a trainer stopped with SIGTERM while it loaded (no exit handler runs)
    left it there. The link lies in the run's own folder (``.sdplan-load-<pid>``), is removed once the load is
    done, and one a stopped load left is removed by the next load there."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile

    from sdplan.trainer.models import LINK_FOLDER, diffusers_readable

    model = write_safetensors(tmp_path / "m.sft", checkpoint())
    run = tmp_path / "run"
    before = set(Path(tempfile.gettempdir()).glob("sdplan-model-*"))
    code = (
        "import sys, time\n"
        "from sdplan.trainer.models import diffusers_readable\n"
        "with diffusers_readable(sys.argv[1], sys.argv[2]) as name:\n"
        "    print(name, flush=True)\n"
        "    time.sleep(60)\n"
    )
    loading = subprocess.Popen(
        [sys.executable, "-c", code, str(model), str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        link = Path(loading.stdout.readline().strip())
        assert link == run / f"{LINK_FOLDER}{loading.pid}" / "m.safetensors" and link.resolve() == model
    finally:
        loading.send_signal(signal.SIGTERM)
        loading.wait(timeout=30)
    assert loading.returncode == -signal.SIGTERM
    assert link.parent.is_dir()  # left in the run's folder, not in /tmp
    assert set(Path(tempfile.gettempdir()).glob("sdplan-model-*")) == before
    with diffusers_readable(model, run) as name:
        assert Path(name) == run / f"{LINK_FOLDER}{os.getpid()}" / "m.safetensors"
        assert not link.parent.exists()  # its process is gone
    assert not list(run.glob(LINK_FOLDER + "*"))
    with pytest.raises(RuntimeError), diffusers_readable(model) as name:  # no run folder: a temporary one
        assert Path(name).is_symlink()
        raise RuntimeError
    assert not Path(name).parent.exists()
    with diffusers_readable(tmp_path / "plain.safetensors", run) as name:
        assert name == str(tmp_path / "plain.safetensors")


def test_a_hub_id_as_model_config_dir_is_one_line_naming_it_as_typed(tmp_path, monkeypatch):
    """model.config_dir me/tiny15 was made a folder under the current one and refused as "model.config_dir
    /cwd/me/tiny15: not a diffusers folder", a path the user never typed. It takes a local folder: said so, with
    the value as given (kept so where it reads as a hub id and no such folder exists); a missing folder says so."""
    monkeypatch.chdir(tmp_path)
    model = write_safetensors(tmp_path / "x.safetensors", checkpoint())
    line = one_line_error(dry_run(model, tmp_path, "model.config_dir=me/tiny15"), 2)
    assert line.startswith("error: model.config_dir me/tiny15: no such folder ("), line
    assert "if me/tiny15 is a hub id: model.config_dir takes a local folder" in line
    assert "hf download me/tiny15 --local-dir DIR" in line and str(tmp_path) not in line
    line = one_line_error(dry_run(model, tmp_path, "model.config_dir=./nope"), 2)
    assert line.startswith(f"error: model.config_dir {tmp_path / 'nope'}: no such folder"), (
        line
    )  # a path: absolute
    assert "hub id" not in line
    with pytest.raises(Exception, match="me/tiny15: no such folder"):
        check_source(str(model), config_dir="me/tiny15")
    # a mistyped relative folder reads as a hub id too: what is wrong first, the hub id second
    line = one_line_error(dry_run(model, tmp_path, "model.config_dir=configs/nope"), 2)
    assert line.startswith("error: model.config_dir configs/nope: no such folder (point it at"), line
    assert line.index("no such folder") < line.index("hub id")


def test_a_config_dir_or_folder_without_tokenizer_config_json_is_one_line_before_the_launch(tmp_path):
    """A model.config_dir whose tokenizer/ held vocab.json and merges.txt but no tokenizer_config.json passed the
    check: CLIPTokenizer then has no model_max_length (1e30) and the trainer failed after the launch
    (OverflowError padding the captions). Every config and tokenizer a single file loads with is looked for in
    model.config_dir, as in a hub cache; a diffusers folder given as model.path lacking it is refused too."""
    model = write_safetensors(tmp_path / "x.safetensors", checkpoint())
    folder = fake_diffusers_folder(tmp_path / "cfg", "sd15")
    assert dry_run(model, tmp_path, f"model.config_dir={folder}").exit_code == 0
    (folder / "tokenizer" / "tokenizer_config.json").unlink()
    (folder / "vae" / "config.json").unlink()
    line = one_line_error(dry_run(model, tmp_path, f"model.config_dir={folder}"), 2)
    assert line.startswith(
        f"error: model.config_dir {folder}: lacks vae/config.json and 1 more, which {model} loads with ("
    ), line
    assert "hf download stable-diffusion-v1-5/stable-diffusion-v1-5 --include '*.json'" in line
    (folder / "vae" / "config.json").write_text("{}")
    line = one_line_error(dry_run(model, tmp_path, f"model.config_dir={folder}"), 2)
    assert f"{folder}: lacks tokenizer/tokenizer_config.json, which" in line, line
    with pytest.raises(UnsupportedModelError, match=r"tokenizer/ holds no tokenizer_config.json \(the tok"):
        check_source(str(folder))


def test_a_variant_a_folder_lacks_is_said_to_load_its_plain_weights(sd15_copy):
    """model.variant=fp16 on a folder without fp16 files loaded its plain (float32) weights without a word."""
    assert not any(n.startswith("weights:") for n in check_source(str(sd15_copy)).notes)
    notes = check_source(str(sd15_copy), variant="fp16").notes
    assert (
        "weights: model.variant fp16, but unet, vae, text_encoder hold no fp16 files: their plain weights load "
        "instead (as saved, often float32; training.precision sets the training dtype)"
    ) in notes, notes
    for f in (sd15_copy / "unet").glob("diffusion_pytorch_model.safetensors"):
        f.rename(f.with_name("diffusion_pytorch_model.fp16.safetensors"))
    notes = check_source(str(sd15_copy), variant="fp16").notes
    assert any(n.startswith("weights: model.variant fp16, but vae, text_encoder hold") for n in notes), notes


def test_the_single_file_config_repos_are_diffusers_own():
    """SINGLE_FILE_CONFIGS names the repos diffusers' from_single_file fetches for SD 1.x, 2.x and SDXL files."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS as paths
    from sdplan.trainer.source_check import SINGLE_FILE_CONFIGS

    types = {"sd15": "v1", "sd21": "v2", "sdxl": "xl_base"}
    assert {f: paths[t]["pretrained_model_name_or_path"] for f, t in types.items()} == SINGLE_FILE_CONFIGS
