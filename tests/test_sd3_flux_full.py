"""SD3.5 and FLUX.1 full fine-tune and DreamBooth through the one loop on tiny models built in code; the
diffusers folder and the original-layout single file they export; a single-file transformer as the base."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLOW, generate_64px, tiny_train_config, trains_in_process

from sdplan import registry
from sdplan.errors import UsageError

pytestmark = trains_in_process


def _cfg(model, family: str, data: Path, out: Path, *overrides: str, method: str = "finetune"):
    """``method`` on ``family`` (no lora section: the config's LoRA defaults), lr 1e-3, 2 steps, outputs "t"."""
    return tiny_train_config(model, data, out, *overrides, method=method, family=family, name="t", lora=False)


def _pipeline_class(family: str):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    return FluxPipeline if registry.family(family).arch == "flux" else StableDiffusion3Pipeline


def _transformer_class(family: str):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    return FluxTransformer2DModel if registry.family(family).arch == "flux" else SD3Transformer2DModel


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- the original layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["sd35-medium", "sd35-large"])
def test_sd3_single_file_round_trips_through_diffusers_from_single_file(tiny_flow, tmp_path, family):
    """Our inverse, then diffusers' own SD3 single-file loader: the same weights, bit for bit (MMDiT-X's
    attn2 and the last block's context-only modulation included)."""
    from safetensors.torch import save_file
    from sdplan.trainer.flow_single_file import transformer_to_original

    cls = _transformer_class(family)
    t = cls.from_pretrained(tiny_flow[family], subfolder="transformer")
    original = transformer_to_original(t, family)
    assert "joint_blocks.1.context_block.adaLN_modulation.1.weight" in original
    assert ("joint_blocks.0.x_block.attn2.qkv.weight" in original) == (family == "sd35-medium")
    path = tmp_path / "t.safetensors"
    save_file(original, str(path))
    back = cls.from_single_file(
        str(path), config=str(tiny_flow[family]), subfolder="transformer", local_files_only=True
    )
    assert _same_weights(t, back)


def test_flux_original_names_cover_every_weight_and_fuse_qkv(tiny_flow):
    """Every FLUX weight lands under a BFL name once; the fused tensors are q/k/v(/mlp) stacked in order."""
    from diffusers import FluxTransformer2DModel
    from sdplan.trainer.flow_single_file import transformer_to_original

    t = FluxTransformer2DModel.from_pretrained(tiny_flow["flux-dev"], subfolder="transformer")
    sd = t.state_dict()
    original = transformer_to_original(t, "flux-dev")
    assert sum(v.numel() for v in original.values()) == sum(v.numel() for v in sd.values())
    assert "guidance_in.in_layer.weight" in original and "double_blocks.0.img_attn.qkv.weight" in original
    s = "single_transformer_blocks.0."
    fused = torch.cat([sd[f"{s}attn.to_q.weight"], sd[f"{s}attn.to_k.weight"], sd[f"{s}attn.to_v.weight"]])
    assert torch.equal(
        original["single_blocks.0.linear1.weight"], torch.cat([fused, sd[f"{s}proj_mlp.weight"]])
    )
    shift_scale = original["final_layer.adaLN_modulation.1.weight"]
    scale, shift = sd["norm_out.linear.weight"].chunk(2)
    assert torch.equal(shift_scale, torch.cat([shift, scale]))
    schnell = transformer_to_original(
        FluxTransformer2DModel.from_pretrained(tiny_flow["flux-schnell"], subfolder="transformer"),
        "flux-schnell",
    )
    assert not any(k.startswith("guidance_in.") for k in schnell)


@pytest.mark.slow
def test_flux_single_file_round_trips_through_diffusers_at_the_real_width(tiny_flow, tmp_path):
    """diffusers' FLUX single-file converter assumes the real width (3072, MLP ratio 4): one double and one
    single block at that width (about 0.5B parameters, bf16) round-trip bit for bit, through
    ``from_single_file`` and as a training base (``model.config_dir``: a FLUX folder with that config)."""
    import shutil

    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file
    from sdplan.trainer import models
    from sdplan.trainer.flow_single_file import transformer_to_original

    torch.manual_seed(0)
    t = FluxTransformer2DModel(
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=48,  # the tiny T5 width
        pooled_projection_dim=32,
        guidance_embeds=True,
    ).to(torch.bfloat16)
    cfg_dir = tmp_path / "cfg"  # the tiny FLUX.1 [dev] folder with this transformer's config, no weights
    shutil.copytree(tiny_flow["flux-dev"], cfg_dir)
    shutil.rmtree(cfg_dir / "transformer")
    t.save_config(str(cfg_dir / "transformer"))
    path = tmp_path / "flux.safetensors"
    save_file(
        {f"model.diffusion_model.{k}": v for k, v in transformer_to_original(t, "flux-dev").items()},
        str(path),
    )
    back = FluxTransformer2DModel.from_single_file(
        str(path),
        config=str(cfg_dir),
        subfolder="transformer",
        local_files_only=True,
        torch_dtype=torch.bfloat16,
    )
    assert _same_weights(t, back)
    del back
    comps = models.load_components(str(path), config_dir=str(cfg_dir))
    assert comps.family == "flux-dev"
    assert _same_weights(t, comps.unet.to(torch.bfloat16))


# -- full fine-tune and DreamBooth ------------------------------------------------------------------------


def _check_full_outputs(out: Path, family: str, base: Path) -> None:
    """The diffusers folder loads with the family's pipeline and generates something else than the base; the
    single file holds the same transformer (read back with diffusers' loader where it can: SD3 at any width)."""
    from safetensors import safe_open

    cls = _pipeline_class(family)
    tuned = cls.from_pretrained(str(out / "model"), torch_dtype=torch.float32)  # bf16 with full_half_weights
    original = cls.from_pretrained(str(base))
    assert not _same_weights(tuned.transformer, original.transformer)
    assert float(np.abs(generate_64px(tuned) - generate_64px(original)).max()) > 1e-4
    single = out / "t.safetensors"
    with safe_open(str(single), framework="pt") as f:
        keys = list(f.keys())
        md = f.metadata()
    assert md["sdplan_family"] == family
    # kohya sd-scripts library/sai_model_spec.py determine_architecture (stable-diffusion-3-<model_type>)
    assert (
        md["modelspec.architecture"]
        == {
            "sd35-medium": "stable-diffusion-3-5-medium",
            "sd35-large": "stable-diffusion-3-5-large",
            "flux-dev": "flux-1-dev",
            "flux-schnell": "flux-1-schnell",
        }[family]
    )
    if registry.family(family).arch == "flux":  # the transformer only, as BFL's flux1-dev.safetensors
        # BFL's bare names: its load_flow_model (load_state_dict(strict=False)) matched none of the prefixed ones
        assert not any(k.startswith("model.") for k in keys)
        assert "double_blocks.0.img_attn.qkv.weight" in keys and "single_blocks.0.linear1.weight" in keys
        assert md["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
        return
    # SD3.5: the whole pipeline in Stability's layout, read back by diffusers' own single-file loader
    prefixes = ("model.diffusion_model.", "first_stage_model.", "text_encoders.")
    assert all(k.startswith(prefixes) for k in keys)
    assert {k.split(".")[1] for k in keys if k.startswith("text_encoders.")} == {"clip_l", "clip_g", "t5xxl"}
    back = _pipeline_class(family).from_single_file(
        str(single), config=str(out / "model"), local_files_only=True, torch_dtype=torch.float32
    )
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        a, b = getattr(tuned, part).state_dict(), getattr(back, part).state_dict()
        if part == "text_encoder":  # diffusers sets CLIP-L's projection to the identity for these files
            a.pop("text_projection.weight")
            b.pop("text_projection.weight")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part


@pytest.mark.parametrize("family", FLOW)
def test_finetune_trains_the_whole_transformer_and_exports_folder_and_single_file(
    tiny_flow, demo_dataset, tmp_path, family
):
    from sdplan.trainer import run

    extra = ["memory.cache_text_encoder_outputs=true"]
    if family == "flux-schnell":  # bf16 weights (kohya --full_bf16) and the memory savers
        extra += [
            "training.precision=bf16",
            "training.full_half_weights=true",
            "memory.gradient_checkpointing=true",
            "memory.cache_latents=true",
        ]
    summary = run.train(_cfg(tiny_flow[family], family, demo_dataset, tmp_path / "out", *extra))
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    _check_full_outputs(tmp_path / "out", family, tiny_flow[family])
    record = json.loads((tmp_path / "out" / "model" / "sdplan.json").read_text())
    assert record["sdplan_family"] == family


def test_finetune_with_ema_writes_the_averaged_transformer(tiny_flow, demo_dataset, tmp_path):
    from sdplan.trainer import run

    cfg = _cfg(tiny_flow["sd35-large"], "sd35-large", demo_dataset, tmp_path / "out", "ema.enabled=true")
    run.train(cfg)
    from diffusers import StableDiffusion3Pipeline

    tuned = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "out" / "model"))
    ema = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "out" / "ema" / "model"))
    assert not _same_weights(tuned.transformer, ema.transformer)


@pytest.mark.parametrize("family", ["sd35-medium", "flux-dev"])
def test_dreambooth_with_prior_preservation_generates_class_images_and_trains(
    tiny_flow, demo_dataset, tmp_path, family
):
    from sdplan.trainer import run

    cfg = _cfg(
        tiny_flow[family],
        family,
        demo_dataset,
        tmp_path / "out",
        "dreambooth.instance_prompt=a photo of sks square",
        "dreambooth.with_prior_preservation=true",
        "dreambooth.class_prompt=a photo of a square",
        "dreambooth.num_class_images=2",
        "dreambooth.prior_loss_weight=1.0",
        "memory.cache_text_encoder_outputs=true",
        method="dreambooth",
    )
    summary = run.train(cfg)
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
    assert len(list((tmp_path / "out" / "class_images").glob("class-*.png"))) == 2
    _check_full_outputs(tmp_path / "out", family, tiny_flow[family])


def test_text_encoder_training_and_textual_inversion_are_refused_in_one_line(
    tiny_flow, demo_dataset, tmp_path
):
    from sdplan.trainer import run

    cfg = _cfg(
        tiny_flow["flux-dev"], "flux-dev", demo_dataset, tmp_path / "o", "training.train_text_encoder=true"
    )
    with pytest.raises(UsageError, match="train_text_encoder"):
        run.train(cfg)
    cfg = _cfg(
        tiny_flow["flux-dev"],
        "flux-dev",
        demo_dataset,
        tmp_path / "o",
        "textual_inversion.token=<sks>",
        "textual_inversion.init_token=square",
        method="textual-inversion",
    )
    with pytest.raises(UsageError, match="textual-inversion for flux-dev"):
        run.train(cfg)


# -- a single-file base -----------------------------------------------------------------------------------


def test_single_file_sd35_transformer_is_a_base_model(tiny_flow, demo_dataset, tmp_path):
    """A fine-tune's single file trains on as the base (``model.config_dir``: the folder of the same family);
    its transformer loads back with identical weights; without config_dir: one clear error."""
    from sdplan.trainer import models, run

    first = tmp_path / "first"
    run.train(_cfg(tiny_flow["sd35-medium"], "sd35-medium", demo_dataset, first))
    single = first / "t.safetensors"
    import shutil

    configs = tmp_path / "configs"  # the folder's transformer weights are not needed (nor read)
    shutil.copytree(tiny_flow["sd35-medium"], configs)
    for f in (configs / "transformer").glob("*.safetensors"):
        f.unlink()
    comps = models.load_components(str(single), config_dir=str(configs))
    assert comps.family == "sd35-medium" and comps.adapter is not None
    from diffusers import SD3Transformer2DModel

    assert _same_weights(
        comps.unet, SD3Transformer2DModel.from_pretrained(first / "model", subfolder="transformer")
    )
    with pytest.raises(UsageError, match="needs model.config_dir"):
        models.load_components(str(single))
    from sdplan.launcher import check_model_file

    check_model_file(single)  # the pre-launch check knows the transformer-only layout
    second = tmp_path / "second"
    summary = run.train(
        _cfg(
            single,
            "sd35-medium",
            demo_dataset,
            second,
            f"model.config_dir={tiny_flow['sd35-medium']}",
            "lora.rank=4",
            method="lora",
        )
    )
    assert summary["steps"] == 2 and (second / "pytorch_lora_weights.safetensors").is_file()


def test_an_all_in_one_sd35_file_trains_with_its_own_text_encoders_and_vae(tiny_flow, demo_dataset, tmp_path):
    """An SD3.5 file holding its own CLIP-L, CLIP-G, T5 and VAE beside the MMDiT (ComfyUI's checkpoint save,
    Stability's *_incl_clips_t5xxl files) trained with model.config_dir's encoders and VAE, silently, and its
    export carried those, not the user's. Its own load, as diffusers' StableDiffusion3Pipeline.from_single_file
    reads them (CLIP-L's projection the identity), and the check before the launch says which parts come from
    where; a file of the transformer alone (named .sft here) still takes them all from model.config_dir."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import save_file
    from sdplan.trainer import models
    from sdplan.trainer.flow_single_file import sd3_pipeline_to_original, transformer_to_original
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folder = tiny_flow["sd35-medium"]
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the user's encoders and VAE: not the folder's
        for part in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae):
            for p in part.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    aio = tmp_path / "mine.safetensors"
    save_file(sd3_pipeline_to_original(pipe), str(aio))

    notes = check_source(str(aio), config_dir=str(folder)).notes
    assert any(
        n.startswith("model: the file's own CLIP-L, CLIP-G, T5, VAE (an all-in-one file") for n in notes
    ), notes
    comps = models.load_components(str(aio), config_dir=str(folder))
    clip_l, clip_g, t5 = comps.text_encoders
    mine = pipe.text_encoder.state_dict()
    theirs = clip_l.state_dict()
    assert all(torch.equal(theirs[k], mine[k]) for k in mine if k != "text_projection.weight")
    assert torch.equal(theirs["text_projection.weight"], torch.eye(mine["text_projection.weight"].shape[0]))
    assert _same_weights(clip_g, pipe.text_encoder_2) and _same_weights(t5, pipe.text_encoder_3)
    assert _same_weights(comps.vae, pipe.vae) and _same_weights(comps.unet, pipe.transformer)
    from safetensors import safe_open
    from sdplan.trainer import run

    run.train(_cfg(aio, "sd35-medium", demo_dataset, tmp_path / "out", f"model.config_dir={folder}"))
    with (
        safe_open(str(tmp_path / "out" / "t.safetensors"), framework="pt") as f,
        safe_open(str(aio), "pt") as g,
    ):
        names = g.keys()
        kept = [k for k in names if k.startswith(("text_encoders.", "first_stage_model."))]
        assert kept and all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in kept if "clip_l" not in k)
        assert not torch.equal(  # the transformer trained
            f.get_tensor("model.diffusion_model.final_layer.linear.weight"),
            g.get_tensor("model.diffusion_model.final_layer.linear.weight"),
        )

    alone = tmp_path / "transformer.sft"  # BFL's suffix: read as safetensors
    save_file(transformer_to_original(pipe.transformer, "sd35-medium"), str(alone))
    notes = check_source(str(alone), config_dir=str(folder)).notes
    assert any("the file holds the transformer only" in n for n in notes), notes
    comps = models.load_components(str(alone), config_dir=str(folder))
    assert _same_weights(comps.unet, pipe.transformer)
    assert _same_weights(comps.vae, StableDiffusion3Pipeline.from_pretrained(folder).vae)

    state = sd3_pipeline_to_original(pipe)  # no T5 in the file: the folder's, said so
    save_file({k: v for k, v in state.items() if not k.startswith("text_encoders.t5xxl.")}, str(aio))
    notes = check_source(str(aio), config_dir=str(folder)).notes
    assert any("; T5 from model.config_dir (the file holds none)" in n for n in notes), notes
    other = tmp_path / "other"  # a folder whose CLIP-G is of another width: one line before anything loads
    shutil.copytree(folder, other)
    conf = json.loads((other / "text_encoder_2" / "config.json").read_text())
    (other / "text_encoder_2" / "config.json").write_text(json.dumps({**conf, "hidden_size": 64}))
    with pytest.raises(
        UnsupportedModelError, match="does not describe .*'s own CLIP-G: the file's is 48 wide"
    ):
        check_source(str(aio), config_dir=str(other))


def test_an_all_in_one_files_t5_saved_with_its_shared_embedding_only_loads(tiny_flow, tmp_path):
    """ComfyUI's T5 holds its token embedding as shared.weight alone (the encoder's embed_tokens is tied to it),
    so its all-in-one SD3.5 saves have no text_encoders.t5xxl.transformer.encoder.embed_tokens.weight: the check
    passed such a file and the trainer refused it ("its T5 lacks 1 of the weights ... embed_tokens"). The
    embedding is shared's, as T5 ties them."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import save_file
    from sdplan.trainer import models
    from sdplan.trainer.flow_single_file import sd3_pipeline_to_original

    folder = tiny_flow["sd35-medium"]
    pipe = StableDiffusion3Pipeline.from_pretrained(folder)
    state = sd3_pipeline_to_original(pipe)
    state.pop("text_encoders.t5xxl.transformer.encoder.embed_tokens.weight")
    comfy = tmp_path / "comfy_sd35.safetensors"
    save_file(state, str(comfy))
    t5 = models.load_components(str(comfy), config_dir=str(folder)).text_encoders[2]
    assert not any(p.is_meta for p in t5.parameters())
    assert torch.equal(t5.encoder.embed_tokens.weight, t5.shared.weight)
    assert _same_weights(t5, pipe.text_encoder_3)


# -- doctor -----------------------------------------------------------------------------------------------


def test_doctor_verdicts_do_not_crash_when_the_flow_families_are_planned(monkeypatch):
    """Once the planner plans SD3.5/FLUX (``registry`` planned flags), doctor asks it for every method: a
    method the planner refuses for a family is an n/a cell, not a traceback."""
    from sdplan import doctor
    from sdplan.machine import Snapshot

    monkeypatch.setattr(doctor, "PLANNED_FAMILIES", ("sd15", "flux-dev", "sd35-medium"))
    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "rtx3060_12gb.json")
    verdicts = doctor.planner_verdicts(snap)
    grid = doctor.verdict_grid(verdicts)
    assert all(set(grid[m]) == {"sd15", "flux-dev", "sd35-medium"} for m in registry.METHODS)
    assert grid["lora"]["sd15"][0] in ("ok", "tight", "no")


def test_tiny_flux_single_file_base_is_refused_in_one_line(tiny_flow, tmp_path):
    """diffusers reads FLUX single files only at the released width: a narrower one is a clear error."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file
    from sdplan.trainer import models
    from sdplan.trainer.flow_single_file import transformer_to_original

    t = FluxTransformer2DModel.from_pretrained(tiny_flow["flux-dev"], subfolder="transformer")
    path = tmp_path / "flux.safetensors"
    save_file(transformer_to_original(t, "flux-dev"), str(path))
    with pytest.raises(UsageError, match="only at the released width"):
        models.load_components(str(path), config_dir=str(tiny_flow["flux-dev"]))
