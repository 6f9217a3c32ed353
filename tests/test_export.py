"""Trained outputs load where people load them: LoRA (diffusers + kohya), single-file checkpoints, embeddings.

Tiny SD 1.x / SDXL pipelines built in code; each test runs in seconds on CPU with nothing downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import MkdirPayload
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sdplan.trainer import export, single_file

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA = 4, 2.0  # alpha != rank: a file that wrote rank as alpha would scale the LoRA wrongly
CONFIG = {
    "method": "lora",
    "model": {"path": "/models/tiny"},
    "data": {"resolution": 64},
    "training": {"learning_rate": 1e-4, "seed": 7, "precision": "fp32"},
    "plan": {"fits": True, "batch_size": 1},
}
META = {"config": CONFIG, "steps": 3}


def _pipe(folder: Path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if (folder / "text_encoder_2").exists() else StableDiffusionPipeline
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, prompt: str = "a photo of sks dog"):
    generator = torch.Generator("cpu").manual_seed(0)
    out = pipe(
        prompt,
        num_inference_steps=2,
        guidance_scale=1.0,
        height=64,
        width=64,
        generator=generator,
        output_type="np",
    )
    return torch.from_numpy(out.images)


def _add_lora(pipe, text_encoders: list, seed: int = 1):
    from peft import LoraConfig

    torch.manual_seed(seed)
    unet_cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_k", "to_q", "to_v", "to_out.0"])
    pipe.unet.add_adapter(unet_cfg)
    te_cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])
    for te in text_encoders:
        te.add_adapter(te_cfg)
    with torch.no_grad():  # peft starts lora_B at zero (a no-op LoRA): make it a real one
        for model in [pipe.unet, *text_encoders]:
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)


def _kohya(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 (safe_open is no dict)


def _check_kohya_file(path: Path, prefixes: tuple[str, ...]) -> dict:
    tensors, md = _kohya(path)
    modules = {k.split(".")[0] for k in tensors}
    assert modules and all(m.startswith(prefixes) for m in modules), sorted(modules)[:5]
    for module in modules:
        down, up = tensors[f"{module}.lora_down.weight"], tensors[f"{module}.lora_up.weight"]
        assert down.shape[0] == RANK and up.shape[1] == RANK
        assert tensors[f"{module}.alpha"].ndim == 0
        assert tensors[f"{module}.alpha"].item() == ALPHA
    assert len(tensors) == 3 * len(modules)
    assert md["ss_network_module"] == "networks.lora"
    assert md["ss_network_dim"] == str(RANK)
    assert float(md["ss_network_alpha"]) == ALPHA
    assert md["ss_resolution"] == "(64, 64)"
    assert md["ss_learning_rate"] == "0.0001"
    assert md["ss_sd_model_name"] == "tiny"
    assert md["ss_steps"] == "3"
    assert "sdplan" in md["ss_training_comment"]
    assert json.loads(md["sdplan_config"]) == CONFIG
    assert json.loads(md["sdplan_plan"]) == CONFIG["plan"]
    return tensors


def _plain_mode() -> int:
    """The mode open() gives a new file (0666 minus the umask): what a UI running as another user can read."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _with_rank_as_alpha(src: Path, dst: Path) -> Path:
    tensors, md = _kohya(src)
    tensors = {k: (torch.tensor(float(RANK)) if k.endswith(".alpha") else v) for k, v in tensors.items()}
    save_file(tensors, str(dst), metadata=md)
    return dst


def test_lora_sd15_loads_back_in_both_formats(tiny_sd15, tmp_path):
    pipe = _pipe(tiny_sd15)
    base = _run(pipe)
    _add_lora(pipe, [pipe.text_encoder])
    trained = _run(pipe)
    assert not torch.allclose(base, trained, atol=1e-3)

    paths = export.save_lora(
        tmp_path / "out", unet=pipe.unet, text_encoders=[pipe.text_encoder], family="sd15",
        rank=RANK, alpha=ALPHA, metadata=META, name="mylora",
    )  # fmt: skip
    assert [p.name for p in paths] == ["pytorch_lora_weights.safetensors", "mylora.kohya.safetensors"]
    assert all(p.stat().st_mode & 0o777 == _plain_mode() for p in paths)  # not safetensors' 0600
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in paths
    )  # no temp left

    with safe_open(str(paths[0]), framework="pt") as f:
        md, keys = f.metadata(), list(f.keys())
    assert json.loads(md["sdplan_config"]) == CONFIG and "lora_adapter_metadata" in md
    assert any(k.startswith("unet.") for k in keys)
    assert any(k.startswith("text_encoder.text_model.encoder.layers.") for k in keys)

    diffusers_pipe = _pipe(tiny_sd15)
    diffusers_pipe.load_lora_weights(str(paths[0].parent))
    torch.testing.assert_close(_run(diffusers_pipe), trained, atol=1e-5, rtol=0)

    tensors = _check_kohya_file(
        paths[1], ("lora_unet_down_blocks_", "lora_unet_mid_block_", "lora_unet_up_blocks_", "lora_te_")
    )
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in tensors
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in tensors
    assert not any(k.startswith("lora_te1_") for k in tensors)
    _, md = _kohya(paths[1])
    assert md["ss_base_model_version"] == "sd_v1" and md["ss_v2"] == "False"

    kohya_pipe = _pipe(tiny_sd15)
    kohya_pipe.load_lora_weights(str(paths[1]))
    torch.testing.assert_close(_run(kohya_pipe), trained, atol=1e-5, rtol=0)

    # The check above can fail: the same file with alpha = rank (what convert_state_dict_to_kohya writes).
    wrong = _pipe(tiny_sd15)
    wrong.load_lora_weights(str(_with_rank_as_alpha(paths[1], tmp_path / "rank_alpha.safetensors")))
    assert not torch.allclose(_run(wrong), trained, atol=1e-3)


def test_lora_sdxl_kohya_uses_sgm_unet_names_and_te1_te2(tiny_sdxl, tmp_path):
    pipe = _pipe(tiny_sdxl)
    base = _run(pipe)
    encoders = [pipe.text_encoder, pipe.text_encoder_2]
    _add_lora(pipe, encoders)
    trained = _run(pipe)
    assert not torch.allclose(base, trained, atol=1e-3)

    paths = export.save_lora(
        tmp_path, unet=pipe.unet, text_encoders=encoders, family="sdxl", rank=RANK, alpha=ALPHA, metadata=META
    )
    tensors = _check_kohya_file(
        paths[1],
        (
            "lora_unet_input_blocks_",
            "lora_unet_middle_block_",
            "lora_unet_output_blocks_",
            "lora_te1_",
            "lora_te2_",
        ),
    )
    # tiny SDXL: layers_per_block 1, the attention blocks in down block 1 / up block 0 (2 transformer layers)
    assert "lora_unet_input_blocks_3_1_transformer_blocks_1_attn2_to_k.lora_up.weight" in tensors
    assert "lora_unet_output_blocks_0_1_transformer_blocks_0_attn1_to_out_0.alpha" in tensors
    assert "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in tensors
    assert "lora_te1_text_model_encoder_layers_1_self_attn_out_proj.lora_down.weight" in tensors
    assert "lora_te2_text_model_encoder_layers_0_self_attn_v_proj.lora_up.weight" in tensors
    _, md = _kohya(paths[1])
    assert md["ss_base_model_version"] == "sdxl_base_v1-0"
    assert md["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"

    for path in paths:  # diffusers reads both files (kohya: via its sgm -> diffusers block mapping)
        loaded = _pipe(tiny_sdxl)
        loaded.load_lora_weights(str(path))
        torch.testing.assert_close(_run(loaded), trained, atol=1e-5, rtol=0)


def test_lora_unet_only_skips_text_encoders_without_adapters(tiny_sd15, tmp_path):
    from peft import LoraConfig

    pipe = _pipe(tiny_sd15)
    pipe.unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q", "to_v"]))
    paths = export.save_lora(
        tmp_path, unet=pipe.unet, text_encoders=[pipe.text_encoder], family="sd15", rank=RANK, alpha=ALPHA,
        metadata=None, kohya=True,
    )  # fmt: skip
    assert all(k.startswith("unet.") for k in load_file(str(paths[0])))
    tensors, md = _kohya(paths[1])
    assert tensors and all(k.startswith("lora_unet_") for k in tensors)
    assert {k.split(".")[0].rsplit("_", 1)[-1] for k in tensors} == {"q", "v"}
    assert json.loads(md["sdplan_config"]) is None


UNET_BEYOND_ATTENTION = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "proj_in",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
]
TE_WITH_MLP = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def _lora_deltas(models: dict) -> dict[str, torch.Tensor]:
    """``component.module.weight`` -> B @ A * alpha/r of every peft LoRA layer in ``models`` (name -> model)."""
    deltas = {}
    for component, model in models.items():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                a = module.lora_A["default"].weight.detach().flatten(1)
                b = module.lora_B["default"].weight.detach().flatten(1)
                weight = module.base_layer.weight
                deltas[f"{component}.{name}.weight"] = (b @ a * module.scaling["default"]).reshape(
                    weight.shape
                )
    return deltas


def _fused_deltas(folder: Path, lora_file: Path) -> dict[str, torch.Tensor]:
    """What ``load_lora_weights`` + ``fuse_lora`` of ``lora_file`` changes in the base model at ``folder``."""
    pipe = _pipe(folder)
    names = [n for n in ("unet", "text_encoder", "text_encoder_2") if getattr(pipe, n, None) is not None]
    before = {f"{n}.{k}": v.clone() for n in names for k, v in getattr(pipe, n).state_dict().items()}
    pipe.load_lora_weights(str(lora_file))
    pipe.fuse_lora(lora_scale=1.0)
    pipe.unload_lora_weights()
    after = {f"{n}.{k}": v for n in names for k, v in getattr(pipe, n).state_dict().items()}
    return {k: after[k] - before[k] for k in before if not torch.equal(after[k], before[k])}


def _adapted(folder: Path, family: str, unet_targets, te_targets, seed: int):
    """A pipe of the tiny model at ``folder`` with random LoRA adapters on its UNet and text encoders (B not 0),
    its encoders, and what each adapter adds to its weight (:func:`_lora_deltas`)."""
    from peft import LoraConfig

    pipe = _pipe(folder)
    encoders = [pipe.text_encoder, pipe.text_encoder_2] if family == "sdxl" else [pipe.text_encoder]
    torch.manual_seed(seed)
    pipe.unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=unet_targets))
    for te in encoders:
        te.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=te_targets))
    with torch.no_grad():
        for model in [pipe.unet, *encoders]:
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5)
    models = {"unet": pipe.unet, "text_encoder": encoders[0]}
    if family == "sdxl":
        models["text_encoder_2"] = encoders[1]
    return pipe, encoders, _lora_deltas(models)


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_lora_beyond_attention_loads_every_module_in_diffusers(family, tiny_sd15, tiny_sdxl, tmp_path):
    """UNet targets beyond the attention projections (proj_in/out, the feed-forward) and text-encoder MLPs: the
    diffusers file once mixed diffusers' old names (``to_q.lora.down``, what ``convert_state_dict_to_diffusers``
    renames) with peft's (``proj_in.lora_A``), and diffusers' loader, which picks the format from the first
    key (loaders/peft.py ``if "lora_A" not in first_key``), dropped the attention LoRA. Both files, loaded and
    fused by diffusers, must change each targeted weight by the trained B @ A * alpha/r, and nothing else."""
    folder = tiny_sdxl if family == "sdxl" else tiny_sd15
    pipe, encoders, expected = _adapted(folder, family, UNET_BEYOND_ATTENTION, TE_WITH_MLP, seed=3)
    assert any(".attn1.to_q." in k for k in expected) and any(".proj_in." in k for k in expected)
    assert any(".mlp.fc1." in k for k in expected) and any(".self_attn.q_proj." in k for k in expected)

    paths = export.save_lora(
        tmp_path, unet=pipe.unet, text_encoders=encoders, family=family, rank=RANK, alpha=ALPHA, metadata=None
    )
    for path in paths:
        got = _fused_deltas(folder, path)
        assert sorted(got) == sorted(expected), (path.name, sorted(set(expected) - set(got))[:4])
        for key, delta in expected.items():
            torch.testing.assert_close(got[key], delta, atol=1e-5, rtol=1e-4, msg=f"{path.name}: {key}")


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_text_encoder_lora_on_the_mlp_only_loads_in_diffusers(family, tiny_sd15, tiny_sdxl, tmp_path):
    """Text-encoder LoRA on fc1/fc2 alone: diffusers' text-encoder loader converts the keys to its own names and
    back to peft's (lora_base._load_lora_into_text_encoder), and its convert_state_dict_to_peft infers the
    format from q/k/v/out_proj keys or lora_linear_layer names: with peft names and no attention projection
    load_lora_weights raised "Could not automatically infer state dict type"."""
    folder = tiny_sdxl if family == "sdxl" else tiny_sd15
    pipe, encoders, expected = _adapted(folder, family, ["to_q", "proj_in"], ["fc1", "fc2"], seed=4)
    paths = export.save_lora(
        tmp_path, unet=pipe.unet, text_encoders=encoders, family=family, rank=RANK, alpha=ALPHA, metadata=None
    )
    got = _fused_deltas(folder, paths[0])
    assert sorted(got) == sorted(expected)
    for key, delta in expected.items():
        torch.testing.assert_close(got[key], delta, atol=1e-5, rtol=1e-4, msg=key)


def test_save_lora_refuses_wrong_alpha_and_missing_adapters(tiny_sd15, tmp_path):
    from peft import LoraConfig

    pipe = _pipe(tiny_sd15)
    with pytest.raises(export.ExportError, match="no LoRA adapter"):
        export.save_lora(
            tmp_path, unet=pipe.unet, text_encoders=[], family="sd15", rank=4, alpha=4, metadata=None
        )
    pipe.unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q"]))
    with pytest.raises(export.ExportError, match="alpha"):
        export.save_lora(
            tmp_path, unet=pipe.unet, text_encoders=[], family="sd15", rank=RANK, alpha=8.0, metadata=None
        )
    assert not list(tmp_path.iterdir())


def _load_profile(family: str) -> dict:
    return yaml.safe_load((ROOT / "profiles" / "models" / f"{family}.yaml").read_text())


def test_sdxl_kohya_names_follow_the_real_sgm_layout():
    """Full-size SDXL UNet config: the module names kohya/ComfyUI/A1111 use for SDXL LoRAs."""
    config = _load_profile("sdxl")["unet"]
    pairs = {
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q": "input_blocks.4.1.transformer_blocks.0.attn1.to_q",
        "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k": "input_blocks.8.1.transformer_blocks.9.attn2.to_k",
        "mid_block.attentions.0.transformer_blocks.3.attn1.to_out.0": "middle_block.1.transformer_blocks.3.attn1.to_out.0",
        "up_blocks.0.attentions.2.transformer_blocks.0.ff.net.2": "output_blocks.2.1.transformer_blocks.0.ff.net.2",
        "up_blocks.1.attentions.0.proj_in": "output_blocks.3.1.proj_in",
        "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
        "down_blocks.0.resnets.1.conv1": "input_blocks.2.0.in_layers.2",
        "down_blocks.1.downsamplers.0.conv": "input_blocks.6.0.op",
        "up_blocks.2.resnets.2.conv_shortcut": "output_blocks.8.0.skip_connection",
    }
    for diffusers_name, sgm_name in pairs.items():
        assert (
            export.unet_key_to_original(f"{diffusers_name}.lora_A.weight", config)
            == f"{sgm_name}.lora_A.weight"
        )


def _meta_models(family: str) -> dict:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    profile = _load_profile(family)
    classes = {"CLIPTextModel": CLIPTextModel, "CLIPTextModelWithProjection": CLIPTextModelWithProjection}
    with torch.device("meta"):
        return {
            "unet": UNet2DConditionModel.from_config(profile["unet"]),
            "vae": AutoencoderKL.from_config(profile["vae"]),
            "text_encoders": [
                classes[te["class"]](CLIPTextConfig(**te["config"])) for te in profile["text_encoders"]
            ],
        }


class _MetaPipe:
    def __init__(self, models: dict):
        self.unet, self.vae = models["unet"], models["vae"]
        self.text_encoder = models["text_encoders"][0]
        self.text_encoder_2 = models["text_encoders"][1] if len(models["text_encoders"]) > 1 else None
        self.scheduler = SimpleNamespace(config={"prediction_type": "epsilon"})


@pytest.mark.parametrize("family", ["sd15", "sd21", "sdxl"])
def test_single_file_layout_of_full_size_models(family):
    """Real-size configs (meta tensors, no memory): the names A1111/ComfyUI look up, and diffusers' own
    original -> diffusers readers give back every diffusers key with its shape."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
        infer_diffusers_model_type,
    )

    models = _meta_models(family)
    sd = export.pipeline_to_original(_MetaPipe(models), family)
    expected = {
        "sd15": [
            "model.diffusion_model.output_blocks.11.0.skip_connection.weight",  # diffusers' v1 marker key
            "model.diffusion_model.output_blocks.2.1.conv.weight",
            "model.diffusion_model.output_blocks.5.2.conv.weight",
            "model.diffusion_model.input_blocks.9.0.op.weight",
            "first_stage_model.decoder.up.3.upsample.conv.weight",
            "cond_stage_model.transformer.text_model.encoder.layers.11.self_attn.q_proj.weight",
        ],
        "sd21": [
            "model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight",
            "cond_stage_model.model.transformer.resblocks.22.attn.in_proj_weight",
            "cond_stage_model.model.token_embedding.weight",
        ],
        "sdxl": [
            "model.diffusion_model.label_emb.0.0.weight",
            "model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn1.to_q.weight",
            "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
            "conditioner.embedders.1.model.transformer.resblocks.31.mlp.c_proj.bias",  # diffusers' xl_base marker
            "conditioner.embedders.1.model.text_projection",
        ],
    }[family]
    missing = [k for k in expected if k not in sd]
    assert not missing, missing
    assert sd["first_stage_model.encoder.mid.attn_1.q.weight"].shape == (512, 512, 1, 1)
    assert infer_diffusers_model_type(sd) == {"sd15": "v1", "sd21": "v2", "sdxl": "xl_base"}[family]

    unet, vae = models["unet"], models["vae"]
    back = convert_ldm_unet_checkpoint(sd, unet.config)
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in unet.state_dict().items()}
    back = convert_ldm_vae_checkpoint(sd, vae.config)
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in vae.state_dict().items()}
    te = models["text_encoders"]
    if family == "sd15":
        back = convert_ldm_clip_checkpoint(sd)
    elif family == "sd21":
        back = convert_open_clip_checkpoint(te[0], sd, prefix="cond_stage_model.model.")
    else:
        back = convert_ldm_clip_checkpoint(sd)
        back2 = convert_open_clip_checkpoint(te[1], sd, prefix="conditioner.embedders.1.model.")
        want2 = {k: v.shape for k, v in te[1].state_dict().items() if not k.endswith("position_ids")}
        assert {k: v.shape for k, v in back2.items()} == want2
    want = {
        k: v.shape for k, v in export._text_model_keys(te[0].state_dict()).items() if "position_ids" not in k
    }
    assert {k: v.shape for k, v in back.items()} == want


def _assert_same_weights(a, b) -> None:
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        ma, mb = getattr(a, name, None), getattr(b, name, None)
        if ma is None:
            assert mb is None
            continue
        sa, sb = ma.state_dict(), mb.state_dict()
        sa = {k: v for k, v in sa.items() if "position_ids" not in k}
        sb = {k: v for k, v in sb.items() if "position_ids" not in k}
        assert sa.keys() == sb.keys(), name
        bad = [k for k in sa if sb[k].is_meta or not torch.equal(sa[k], sb[k])]
        assert not bad, f"{name}: {bad[:5]}"


def test_save_full_sd15_single_file_round_trip(tiny_sd15, tmp_path):
    pipe = _pipe(tiny_sd15)
    with torch.no_grad():  # a "fine-tuned" model: not the weights of the folder we started from
        pipe.unet.conv_in.weight.add_(0.25)
    model_dir, single = export.save_full(
        tmp_path,
        pipeline=pipe,
        family="sd15",
        metadata={**META, "config": {**CONFIG, "method": "finetune"}},
        name="ft",
    )
    assert model_dir == tmp_path / "model" and single == tmp_path / "ft.safetensors"
    record = json.loads((model_dir / "sdplan.json").read_text())
    assert record["sdplan_config"]["method"] == "finetune" and record["sdplan_plan"] == CONFIG["plan"]
    _assert_same_weights(pipe, _pipe(model_dir))
    assert all(p.stat().st_mode & 0o777 == _plain_mode() for p in [single, *model_dir.rglob("*.safetensors")])

    with safe_open(str(single), framework="pt") as f:
        keys, md = set(f.keys()), f.metadata()
    assert {k.split(".")[0] for k in keys} == {"model", "first_stage_model", "cond_stage_model"}
    assert "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight" in keys
    assert json.loads(md["sdplan_config"])["method"] == "finetune"
    assert md["modelspec.architecture"] == "stable-diffusion-v1"

    loaded = single_file.load_single_file_model(
        single, None, config_dir=model_dir
    )  # family read from the keys
    assert type(loaded).__name__ == "StableDiffusionPipeline"
    _assert_same_weights(pipe, loaded)
    # half precision on request
    _, half = export.save_full(
        tmp_path / "half", pipeline=pipe, family="sd15", metadata=None, dtype=torch.float16
    )
    with safe_open(str(half), framework="pt") as f:
        assert f.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16


def test_save_full_sdxl_single_file_round_trip(tiny_sdxl, tmp_path):
    # The tiny SDXL's encoders differ in width (32, 48) as the real ones do (768, 1280): diffusers'
    # single-file reader tells CLIP-L from the OpenCLIP encoder by that width.
    pipe = _pipe(tiny_sdxl)
    model_dir, single = export.save_full(tmp_path / "out", pipeline=pipe, family="sdxl", metadata=META)
    with safe_open(str(single), framework="pt") as f:
        keys = set(f.keys())
    assert "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight" in keys
    assert "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight" in keys
    assert single_file.detect_single_file_family(single) == "sdxl"
    loaded = single_file.load_single_file_model(single, "sdxl", config_dir=model_dir)
    assert type(loaded).__name__ == "StableDiffusionXLPipeline"
    _assert_same_weights(pipe, loaded)
    torch.testing.assert_close(_run(loaded), _run(pipe), atol=1e-6, rtol=0)


def test_save_full_sd2_text_encoder_in_openclip_layout(tiny_sd15, tmp_path):
    """SD 2.x keeps its text encoder as OpenCLIP (cond_stage_model.model.*, fused q/k/v)."""
    pipe = _pipe(tiny_sd15)
    model_dir, single = export.save_full(tmp_path, pipeline=pipe, family="sd21", metadata=None)
    with safe_open(str(single), framework="pt") as f:
        fused = f.get_tensor("cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight")
        keys = set(f.keys())
    assert not any(k.startswith("cond_stage_model.transformer.") for k in keys)
    attn = pipe.text_encoder.state_dict()
    q, k, v = (attn[f"encoder.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    torch.testing.assert_close(fused, torch.cat([q, k, v]))
    assert single_file.detect_single_file_family(single) == "sd21"
    _assert_same_weights(pipe, single_file.load_single_file_model(single, "sd21", config_dir=model_dir))


def test_ckpt_loads_with_weights_only(tiny_sd15, tmp_path):
    pipe = _pipe(tiny_sd15)
    model_dir, single = export.save_full(tmp_path, pipeline=pipe, family="sd15", metadata=None)
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": load_file(str(single)), "global_step": 10}, ckpt)
    assert single_file.detect_single_file_family(ckpt) == "sd15"
    _assert_same_weights(pipe, single_file.load_single_file_model(ckpt, "sd15", config_dir=model_dir))


@pytest.mark.parametrize("name", ["MyModel.SAFETENSORS", "flux1-dev.sft"])
def test_a_safetensors_file_of_another_suffix_loads(tiny_sd15, tmp_path, name):
    """An upper-case suffix passed sdplan's checks (which lower-case it) but diffusers' load_state_dict compares
    it case-sensitively with "safetensors" and read the file with torch.load: "Unable to load weights". .sft
    (Black Forest Labs' FLUX.1 suffix) was refused as "not a model file". ComfyUI's load_torch_file reads both
    as safetensors; so does sdplan now (through a link named .safetensors), a .sft that is none said so."""
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    pipe = _pipe(tiny_sd15)
    model_dir, single = export.save_full(tmp_path, pipeline=pipe, family="sd15", metadata=None)
    other = single.rename(tmp_path / name)
    assert check_source(str(other)).family == "sd15"
    assert single_file.detect_single_file_family(other) == "sd15"
    _assert_same_weights(pipe, single_file.load_single_file_model(other, None, config_dir=model_dir))
    assert other.is_file() and not single.exists()  # the user's file stays as it is
    from sdplan.trainer import models

    run = tmp_path / "run"  # the trainer's: the link lies in the run's folder while it loads, then goes
    assert models.load_components(str(other), config_dir=str(model_dir), scratch=run).family == "sd15"
    assert run.is_dir() and not any(run.iterdir())
    (tmp_path / "junk.sft").write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(UnsupportedModelError, match="junk.sft: not a safetensors file"):
        check_source(str(tmp_path / "junk.sft"))


def test_ckpt_with_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "evil.ckpt"
    torch.save(
        {"state_dict": {"model.diffusion_model.x": torch.zeros(1)}, "extra": MkdirPayload(marker)}, ckpt
    )
    with pytest.raises(single_file.UnsafeCheckpointError, match="refusing to unpickle"):
        single_file.load_single_file_model(ckpt, "sd15")
    assert not marker.exists()
    torch.load(ckpt, weights_only=False)  # the payload is real: a plain unpickle runs it
    assert marker.exists()


def test_single_file_errors(tmp_path):
    from sdplan.errors import UsageError

    with pytest.raises(UsageError, match="does not exist"):
        single_file.load_single_file_model(tmp_path / "nope.safetensors", "sd15")
    odd = tmp_path / "odd.safetensors"
    save_file({"some.weight": torch.zeros(2)}, str(odd))
    with pytest.raises(UsageError, match="model.family"):
        single_file.load_single_file_model(odd, None)
    (tmp_path / "model.onnx").write_bytes(b"x")
    with pytest.raises(UsageError, match="safetensors or .ckpt"):
        single_file.load_single_file_model(tmp_path / "model.onnx", "sd15")


def _prompt_embeds(pipe, prompt: str):
    return pipe.encode_prompt(
        prompt, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False
    )[0]


def test_embedding_sd15_loads_with_load_textual_inversion(tiny_sd15, tmp_path):
    pipe = _pipe(tiny_sd15)
    token, prompt = "<sks-thing>", "a photo of <sks-thing>"
    before = _prompt_embeds(pipe, prompt)
    embeds = torch.randn(2, pipe.text_encoder.config.hidden_size)
    path = export.save_embedding(tmp_path, token=token, embeds=embeds, metadata=META, name="thing")
    assert path == tmp_path / "thing.safetensors"  # named after the run, not learned_embeds
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == [token]
        md = f.metadata()
    assert json.loads(md["sdplan_config"]) == CONFIG and md["sdplan_token"] == token

    pipe.load_textual_inversion(str(path), token=token)
    ids = pipe.tokenizer.convert_tokens_to_ids([token, f"{token}_1"])
    table = pipe.text_encoder.get_input_embeddings().weight
    torch.testing.assert_close(table[ids], embeds)
    after = _prompt_embeds(pipe, prompt)
    assert before.shape == after.shape and not torch.allclose(before, after)

    fresh = _pipe(tiny_sd15)  # the folder works too, with the file's name
    fresh.load_textual_inversion(str(tmp_path), weight_name=path.name)
    torch.testing.assert_close(_prompt_embeds(fresh, prompt), after)


def test_embedding_sdxl_clip_l_and_clip_g(tiny_sdxl, tmp_path):
    pipe = _pipe(tiny_sdxl)
    token, prompt = "<sks-thing>", "a photo of <sks-thing>"
    before = _prompt_embeds(pipe, prompt)
    width_l = pipe.text_encoder.get_input_embeddings().weight.shape[1]
    width_g = pipe.text_encoder_2.get_input_embeddings().weight.shape[1]
    embeds = {"clip_l": torch.randn(1, width_l), "clip_g": torch.randn(1, width_g)}
    path = export.save_embedding(tmp_path, token=token, embeds=embeds, metadata=META, name="thing")
    assert set(load_file(str(path))) == {"clip_l", "clip_g"}
    export.load_embedding(pipe, path, token)
    for tokenizer, encoder, key in (
        (pipe.tokenizer, pipe.text_encoder, "clip_l"),
        (pipe.tokenizer_2, pipe.text_encoder_2, "clip_g"),
    ):
        row = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids(token)]
        torch.testing.assert_close(row, embeds[key][0])
    assert not torch.allclose(before, _prompt_embeds(pipe, prompt))
    with pytest.raises(export.ExportError, match="clip_l and clip_g"):
        export.save_embedding(tmp_path, token=token, embeds={"clip_l": embeds["clip_l"]}, metadata=None)


def test_metadata_from_a_train_config():
    from sdplan import config

    cfg = config.validate(
        config.apply_overrides(
            config.default_config(),
            ["model.path=/m/sd21-v.safetensors", "data.resolution=768", "lora.rank=8", "lora.alpha=4",
             "training.precision=bf16", "memory.optimizer=adamw8bit"],
        )
    )  # fmt: skip
    cfg.plan = {"batch_size": 2, "fits": True}
    meta = {"config": cfg, "plan": cfg.plan, "steps": 100, "epoch": 2.0, "prediction_type": "v_prediction"}
    md = export.output_metadata(meta, "sd21")
    assert json.loads(md["sdplan_config"]) == cfg.to_dict()
    assert json.loads(md["sdplan_plan"]) == {"batch_size": 2, "fits": True}
    assert md["sdplan_steps"] == "100" and md["sdplan_prediction_type"] == "v_prediction"
    assert all(isinstance(v, str) for v in md.values())
    ss = export._kohya_metadata(meta, "sd21", 8, 4.0, "out")
    assert ss["ss_base_model_version"] == "sd_v2_v" and ss["ss_v2"] == "True"
    # an SD 1.x base fine-tuned to v-prediction too (kohya model_util.get_model_version_str_for_sd1_sd2)
    assert export._kohya_metadata(meta, "sd15", 8, 4.0, "out")["ss_base_model_version"] == "sd_v1_v"
    eps = {**meta, "prediction_type": "epsilon"}
    assert export._kohya_metadata(eps, "sd15", 8, 4.0, "out")["ss_base_model_version"] == "sd_v1"
    assert ss["ss_resolution"] == "(768, 768)" and ss["ss_network_alpha"] == "4.0"
    assert ss["ss_mixed_precision"] == "bf16"
    # what the run trained in wins over the config's: a GPU plan's fp16 config trains in fp32 on the CPU
    # (its kohya file said fp16)
    fp16 = config.validate(config.apply_overrides(cfg.to_dict(), ["training.precision=fp16"]))
    on_cpu = export._kohya_metadata({**meta, "config": fp16, "mixed_precision": "no"}, "sd21", 8, 4.0, "out")
    assert on_cpu["ss_mixed_precision"] == "no" and on_cpu["ss_full_fp16"] == "False"
    assert ss["ss_optimizer"] == "bitsandbytes.optim.adamw.AdamW8bit"  # kohya: the class, module.name
    assert ss["ss_sd_model_name"] == "sd21-v.safetensors"
    assert ss["ss_steps"] == "100" and ss["ss_epoch"] == "2"
    assert export._modelspec("sd21", meta, "out", lora=True)["modelspec.architecture"] == (
        "stable-diffusion-v2-768-v/lora"
    )
