"""SD3.5 and FLUX.1: registry entries, the rectified-flow objective, text conditioning, LoRA training through
the one loop on tiny models built in code, and the outputs loading back into the diffusers pipelines."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLOW, assert_same_run, generate_64px, losses, tiny_train_config, trains_in_process
from limits import scaled

from sdplan import config, registry
from sdplan.errors import UsageError

pytestmark = trains_in_process


def _cfg(model: Path, family: str, data: Path, out: Path, *overrides: str) -> config.TrainConfig:
    """A rank-4 LoRA of ``family``, lr 1e-2, 3 steps, outputs named "t"."""
    return tiny_train_config(
        model, data, out, *overrides, family=family, name="t", learning_rate=1e-2, max_steps=3
    )


# -- registry and planner ---------------------------------------------------------------------------------


def test_registry_names_the_transformer_families_and_their_encoders():
    assert registry.family("flux").name == "flux-dev"
    assert registry.family("sd35").name == "sd35-medium"
    assert set(FLOW) == set(registry.FLOW_FAMILIES)
    assert set(FLOW) <= set(registry.PLANNED_FAMILIES)  # planned for LoRA (issue 14) and the full methods
    assert registry.family("sd35-large").encoders == ("clip-l", "clip-g", "t5")
    assert registry.family("flux-schnell").arch == "flux" and registry.family("sd35-medium").arch == "mmdit"
    assert registry.family_from_name("black-forest-labs/FLUX.1-schnell") == "flux-schnell"
    assert registry.family_from_name("stabilityai/stable-diffusion-3.5-large") == "sd35-large"
    assert registry.family_from_name("stabilityai/stable-diffusion-xl-base-1.0") == "sdxl"
    assert registry.family_from_name("stable-diffusion-v1-5/stable-diffusion-v1-5") == "sd15"
    assert registry.family_from_name("someone/my-model") is None  # was sd15: planned as if it said so
    assert registry.family_from_name("SG161222/Realistic_Vision_V2.0") is None  # an SD 1.5 model's version 2
    assert registry.family_from_name("stabilityai/stable-diffusion-2") == "sd21"


def test_the_planner_says_not_supported_in_one_line():
    from sdplan.planner import Request, hardware_from_catalog, plan
    from sdplan.profiles import load_profiles

    profiles = load_profiles()
    hw = hardware_from_catalog(profiles.find_gpu("RTX 4090"))
    for name in ("flux-dev", "sd35-large"):  # textual inversion only: the full methods are planned
        with pytest.raises(UsageError, match="not supported for this family") as e:
            plan(hw, profiles, Request(method="textual-inversion", model=name))
        assert "\n" not in str(e.value)
        assert "--method lora or finetune or dreambooth" in str(e.value)


def test_recommend_cli_exits_cleanly_for_flux():
    from typer.testing import CliRunner

    from sdplan.cli import app

    res = CliRunner().invoke(
        app, ["recommend", "--method", "textual-inversion", "--model", "flux", "--hardware", "RTX 4090"]
    )
    assert res.exit_code != 0
    assert "not supported for this family" in res.output and "Traceback" not in res.output


# -- the objective and the FLUX latent layout -------------------------------------------------------------


def test_flow_objective_noises_on_the_straight_line_with_the_scheduler_sigmas():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from sdplan.trainer.flow import FlowMatchingObjective, FlowSettings

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    obj = FlowMatchingObjective(sched, FlowSettings(weighting="logit_normal"))
    x0 = torch.randn(64, 16, 4, 4)
    noisy, t, sigmas, noise = obj.corrupt(x0, torch.Generator().manual_seed(1))
    s = sigmas.view(-1, 1, 1, 1)
    assert torch.allclose(noisy, (1 - s) * x0 + s * noise, atol=1e-6)
    assert torch.allclose(t, sigmas * 1000, atol=1e-2)  # the shifted table: timesteps = sigmas x 1000
    assert set(sigmas.tolist()) <= set(sched.sigmas.tolist())
    # logit-normal u concentrates sigmas in the middle; shift 3 pushes them up (mean well above 0.5)
    assert 0.55 < float(sigmas.mean()) < 0.9
    again = obj.corrupt(x0, torch.Generator().manual_seed(1))
    assert torch.equal(again[0], noisy)
    # velocity target: a perfect prediction has zero loss, with or without preconditioning
    for pre in (False, True):
        o = FlowMatchingObjective(sched, FlowSettings(precondition=pre))
        p, tgt = o.prediction_and_target(noise - x0, x0, noisy, sigmas, noise)
        assert float(o.loss(p, tgt)) < 1e-10
    # sigma_sqrt weighs a sample by 1/sigma^2
    o = FlowMatchingObjective(sched, FlowSettings(weighting="sigma_sqrt"))
    p, tgt = o.prediction_and_target(torch.zeros_like(x0), x0, noisy, sigmas, noise)
    per = ((p - tgt) ** 2).mean(dim=(1, 2, 3))
    want = ((noise - x0) ** 2).mean(dim=(1, 2, 3)) / sigmas**2
    assert torch.allclose(per, want, rtol=1e-4)


def test_mode_density_stays_in_the_unit_interval():
    from sdplan.trainer.flow import FlowSettings, sample_density

    u = sample_density(FlowSettings(weighting="mode"), 4096, torch.Generator().manual_seed(0))
    assert float(u.min()) >= 0 and float(u.max()) <= 1
    assert math.isclose(float(u.mean()), 0.5, abs_tol=0.05)


def test_flux_packing_matches_the_pipeline():
    from diffusers import FluxPipeline
    from sdplan.trainer.flow import image_ids, pack_latents, unpack_latents

    z = torch.randn(2, 16, 8, 6)
    packed = pack_latents(z)
    assert torch.equal(packed, FluxPipeline._pack_latents(z, 2, 16, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), z)
    ref = FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    assert torch.equal(image_ids(8, 6, "cpu", torch.float32), ref)


@pytest.mark.parametrize("family", ["sd35-medium", "flux-dev"])
def test_text_conditioning_matches_the_pipeline_encode_prompt(tiny_flow, family):
    from diffusers import DiffusionPipeline
    from sdplan.trainer import conditioning, models

    comps = models.load_components(str(tiny_flow[family]), family=family)
    caps = ["a photo of sks red square", "a blue circle"]
    ids = conditioning.tokenize(comps.tokenizers, caps)
    embeds, pooled = conditioning.encode_prompts(comps.text_encoders, ids, family, "cpu")
    pipe = DiffusionPipeline.from_pretrained(str(tiny_flow[family]))
    n = registry.family(family).t5_max_length
    if family == "flux-dev":
        ref_embeds, ref_pooled, _ = pipe.encode_prompt(caps, prompt_2=None, max_sequence_length=n)
    else:
        ref_embeds, _, ref_pooled, _ = pipe.encode_prompt(
            caps, None, None, do_classifier_free_guidance=False, max_sequence_length=n
        )
    assert torch.allclose(embeds, ref_embeds, atol=1e-5)
    assert torch.allclose(pooled, ref_pooled, atol=1e-5)


@pytest.mark.parametrize("family", ["sd35-medium", "flux-dev", "flux-schnell"])
def test_a_grid_sampled_from_cached_text_outputs_is_the_pipelines_own_without_its_encoders(tiny_flow, family):
    from sdplan.trainer import conditioning, flow, models, sampling

    comps = models.load_components(str(tiny_flow[family]), family=family)
    prompts = ["a photo of sks red square", "a blue circle"]
    cache = conditioning.TextCache()
    cache.precompute(comps, comps.text_encoders, flow.sampling_captions(family, prompts), "cpu")
    assert ("" in cache.embeds) == (family == "sd35-medium")  # SD3.5's guidance: the empty negative prompt
    pipe = comps.pipeline()
    settings = dict(seed=3, steps=2, guidance_scale=4.0, resolution=64)
    own = sampling.generate_images(pipe, prompts, **settings)

    def not_run(*args, **kwargs):
        raise AssertionError("a text encoder ran while sampling from the cache")

    for te in comps.text_encoders:
        te.forward = not_run
    cached = sampling.generate_images(
        pipe, prompts, conditioning=flow.cached_conditioning(family, cache, "cpu"), **settings
    )
    for a, b in zip(own, cached, strict=True):
        assert np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).max() <= 1.0
    with pytest.raises(AssertionError, match="text encoder ran"):
        sampling.generate_images(pipe, prompts[:1], **settings)


@pytest.mark.parametrize("family", FLOW)
def test_a_sample_grid_conditions_on_the_t5_tokens_the_transformer_trained_on(tiny_flow, family):
    """Sampling without the text cache: the pipeline encodes the prompt with as many T5 tokens as training
    (FluxPipeline pads to 512 by default; FLUX.1 [schnell] trains on 256)."""
    from sdplan.trainer import conditioning, models, sampling

    comps = models.load_components(str(tiny_flow[family]), family=family)
    ids = conditioning.tokenize(comps.tokenizers, ["a blue circle"])
    trained, _ = conditioning.encode_prompts(comps.text_encoders, ids, family, "cpu")
    pipe = comps.pipeline()
    seen = []
    forward = pipe.transformer.forward

    def record(*args, **kwargs):
        seen.append(kwargs["encoder_hidden_states"].shape[1])
        return forward(*args, **kwargs)

    pipe.transformer.forward = record
    sampling.generate_images(pipe, ["a blue circle"], seed=0, steps=1, guidance_scale=4.0, resolution=64)
    assert seen and set(seen) == {trained.shape[1]}


@pytest.mark.parametrize(("family", "guidance"), [("flux-dev", 3.5), ("sd35-medium", 7.5)])
def test_a_sample_grid_takes_the_familys_guidance_unless_the_config_says(
    tiny_flow, tmp_path, family, guidance
):
    """FluxPipeline's guidance_scale is FLUX.1 [dev]'s guidance embedding (3.5: FluxPipeline's and kohya's
    default), not the classifier-free 7.5 of the other families; a value in the config is used as given."""
    import contextlib
    import types

    from PIL import Image
    from sdplan.trainer import models, outputs

    from sdplan import config

    comps = models.load_components(str(tiny_flow[family]), family=family)
    seen = []
    forward = comps.unet.forward

    def record(*args, **kwargs):
        seen.append(float(kwargs["guidance"][0]) if kwargs.get("guidance") is not None else None)
        return forward(*args, **kwargs)

    comps.unet.forward = record
    accelerator = types.SimpleNamespace(
        is_main_process=True, device=torch.device("cpu"), autocast=contextlib.nullcontext
    )
    for given, expected in ((None, guidance), (2.0, 2.0)):
        sampling = {"prompts": ["a blue circle"], "num_inference_steps": 1}
        if given is not None:
            sampling["guidance_scale"] = given
        cfg = config.validate(
            {
                "model": {"path": "x"},
                "data": {"resolution": 64},
                "output": {"dir": str(tmp_path)},
                "sampling": sampling,
            }
        )
        seen.clear()
        grid = outputs.samples(
            accelerator, comps, comps.unet, comps.text_encoders, cfg, out_path=tmp_path / "g.png"
        )
        assert json.loads(Image.open(grid).text["sdplan_samples"])["guidance_scale"] == expected
        if family == "flux-dev":  # the guidance embedding's input, at the one denoising step
            assert seen == [expected]


# -- training through the one loop ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family",
    ["sd35-medium", "sd35-large", "flux-dev", "flux-schnell"],
)
def test_lora_trains_and_loads_back_into_the_pipeline(tiny_flow, demo_dataset, tmp_path, family, monkeypatch):
    from diffusers import DiffusionPipeline
    from safetensors import safe_open
    from sdplan.trainer import flow, run

    sampled_from_cache = []
    original = flow.cached_conditioning

    def counted(*args):
        sampled_from_cache.append(args[0])
        return original(*args)

    monkeypatch.setattr(flow, "cached_conditioning", counted)

    extra = ["memory.cache_text_encoder_outputs=true"]
    if family == "flux-schnell":  # the memory savers and half precision through the same path
        extra += [
            "training.precision=bf16",
            "memory.gradient_checkpointing=true",
            "memory.cache_latents=true",
        ]
    cfg = _cfg(tiny_flow[family], family, demo_dataset, tmp_path / "out", *extra)
    summary = run.train(cfg)
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    lora = tmp_path / "out" / "pytorch_lora_weights.safetensors"
    with safe_open(str(lora), framework="pt") as f:
        keys = list(f.keys())
        assert f.metadata()["sdplan_family"] == family
    assert all(k.startswith("transformer.") and ".lora_" in k for k in keys)
    want = {"attn.to_q", "attn.add_k_proj", "attn.to_add_out"}
    if registry.family(family).arch == "flux":
        want |= {"ff.net.2", "ff_context.net.0.proj"}
    assert all(any(f".{w}.lora_A" in k for k in keys) for w in want)
    pipe = DiffusionPipeline.from_pretrained(str(tiny_flow[family]))
    base = generate_64px(pipe)
    pipe.load_lora_weights(str(tmp_path / "out"))
    assert float(np.abs(generate_64px(pipe) - base).max()) > 1e-3
    assert (tmp_path / "out" / "samples" / "final.png").is_file()
    assert sampled_from_cache == [family]  # the final grid: its prompt was encoded with the captions


def _kohya_and_diffusers(tiny_flow, demo_dataset, tmp_path, family, targets):
    """Train ``targets`` a few steps; (kohya tensors, diffusers tensors, kohya module names, transformer config,
    expected ComfyUI names)."""
    import json

    from safetensors.torch import load_file
    from sdplan.trainer import run
    from sdplan.trainer.flow_kohya import kohya_name, original_module_names

    out = tmp_path / "out"
    cfg = _cfg(tiny_flow[family], family, demo_dataset, out, f"lora.target_modules=[{','.join(targets)}]")
    run.train(cfg)
    kohya = load_file(str(out / "t.kohya.safetensors"))
    diff = load_file(str(out / "pytorch_lora_weights.safetensors"))
    tconfig = json.loads((tiny_flow[family] / "transformer" / "config.json").read_text())
    # ComfyUI maps lora_unet_ + the original model's weight path with dots as underscores
    names = {kohya_name(m) for m in original_module_names(registry.family(family).arch, tconfig)}
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    return kohya, diff, modules, tconfig, names


def _delta_kohya(kohya, m):
    down, up, alpha = kohya[f"{m}.lora_down.weight"], kohya[f"{m}.lora_up.weight"], kohya[f"{m}.alpha"]
    return up @ down * float(alpha) / down.shape[0]


def _delta_diffusers(diff, path):
    a, b = diff[f"transformer.{path}.lora_A.weight"], diff[f"transformer.{path}.lora_B.weight"]
    return b @ a  # alpha 8 / rank 4 folded into lora_B, as the SD 1.x / SDXL file has it (ComfyUI: scale 1)


# The joint blocks' attention projections, image side and text side: FLUX's double blocks and SD3.5's alike.
JOINT_ATTN_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]

FLUX_TARGETS = [
    *JOINT_ATTN_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
    "norm1.linear",
]


def test_flux_kohya_names_map_to_the_bfl_model_and_keep_every_delta(tiny_flow, demo_dataset, tmp_path):
    kohya, diff, modules, tconfig, names = _kohya_and_diffusers(
        tiny_flow, demo_dataset, tmp_path, "flux-dev", FLUX_TARGETS
    )
    assert modules <= names, sorted(modules - names)
    assert "lora_unet_double_blocks_0_img_attn_qkv" in modules
    assert "lora_unet_single_blocks_0_linear1" in modules
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "t.kohya.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_module"], meta["ss_base_model_version"]) == ("networks.lora_flux", "flux1")
    assert meta["modelspec.architecture"] == "flux-1-dev/lora"
    # the training's keys, as the SD 1.x / SDXL file has them (it had the network's only)
    keys = ("ss_learning_rate", "ss_steps", "ss_max_train_steps", "ss_num_train_images", "ss_tag_frequency")
    assert all(k in meta for k in keys), [k for k in keys if k not in meta]
    assert meta["ss_mixed_precision"] == "no" and meta["ss_v2"] == "False"
    # kohya's networks/lora_flux.py writes sd-webui-additional-networks' hashes too (A1111 reads them)
    from sdplan.trainer import export

    with safe_open(str(tmp_path / "out" / "t.kohya.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no mapping
    hashes = export._kohya_hashes(tensors, meta)
    assert {k: meta[k] for k in hashes} == hashes and len(meta["sshs_legacy_hash"]) == 8
    # diffusers' kohya FLUX loader folds alpha/rank itself and then handed this peft config to peft, which
    # scaled by it again: the kohya file carries none of the diffusers file's metadata
    assert "lora_adapter_metadata" not in meta and "format" not in meta
    with safe_open(str(tmp_path / "out" / "pytorch_lora_weights.safetensors"), "pt") as f:
        adapter = json.loads(f.metadata()["lora_adapter_metadata"])
    assert (
        adapter["transformer.lora_alpha"] == adapter["transformer.r"] == 4
    )  # folded: loads alike everywhere
    inner = tconfig["num_attention_heads"] * tconfig["attention_head_dim"]
    qkv = torch.cat([_delta_diffusers(diff, f"transformer_blocks.0.attn.to_{p}") for p in "qkv"])
    assert torch.allclose(_delta_kohya(kohya, "lora_unet_double_blocks_0_img_attn_qkv"), qkv, atol=1e-6)
    parts = [_delta_diffusers(diff, f"single_transformer_blocks.0.attn.to_{p}") for p in "qkv"]
    parts.append(_delta_diffusers(diff, "single_transformer_blocks.0.proj_mlp"))
    assert parts[-1].shape[0] == 4 * inner
    assert torch.allclose(
        _delta_kohya(kohya, "lora_unet_single_blocks_0_linear1"), torch.cat(parts), atol=1e-6
    )
    for k, d in (
        ("double_blocks_0_txt_mlp_2", "transformer_blocks.0.ff_context.net.2"),
        ("double_blocks_0_img_mod_lin", "transformer_blocks.0.norm1.linear"),
    ):
        assert torch.allclose(_delta_kohya(kohya, f"lora_unet_{k}"), _delta_diffusers(diff, d), atol=1e-6)
    n_diff = len({k.rsplit(".lora_", 1)[0] for k in diff})
    folded = 2 * 2 + 3  # two qkv fold 3 -> 1 (double block), linear1 folds 4 -> 1 (single block)
    assert len(modules) == n_diff - folded


def test_sd35_kohya_names_map_to_the_mmdit_and_keep_every_delta(tiny_flow, demo_dataset, tmp_path):
    targets = [
        *JOINT_ATTN_TARGETS,
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "norm1.linear",
        "norm1_context.linear",
    ]
    kohya, diff, modules, _, names = _kohya_and_diffusers(
        tiny_flow, demo_dataset, tmp_path, "sd35-medium", targets
    )
    assert modules == names  # every module of the tiny MMDiT-X (dual attention in block 0) and nothing else
    for fused, prefix in (
        ("joint_blocks_0_x_block_attn_qkv", "attn.to_"),
        ("joint_blocks_1_context_block_attn_qkv", "attn.add_"),
        ("joint_blocks_0_x_block_attn2_qkv", "attn2.to_"),
    ):
        block = fused.split("_")[2]
        suffix = "_proj" if prefix == "attn.add_" else ""
        want = torch.cat(
            [_delta_diffusers(diff, f"transformer_blocks.{block}.{prefix}{p}{suffix}") for p in "qkv"]
        )
        assert torch.allclose(_delta_kohya(kohya, f"lora_unet_{fused}"), want, atol=1e-6)
    assert torch.allclose(
        _delta_kohya(kohya, "lora_unet_joint_blocks_0_context_block_mlp_fc1"),
        _delta_diffusers(diff, "transformer_blocks.0.ff_context.net.0.proj"),
        atol=1e-6,
    )


@pytest.mark.parametrize("family", ["sd35-medium", "sd35-large"])
def test_sd35_kohya_deltas_land_on_the_mmdit_as_diffusers_maps_it(tiny_flow, tmp_path, family):
    """The kohya file's deltas, added to the MMDiT checkpoint and converted by diffusers' own
    convert_sd3_transformer_checkpoint_to_diffusers, give the trained diffusers weights. The last joint block's
    context_block.adaLN_modulation.1 is (shift, scale) in the MMDiT and (scale, shift) in diffusers (the
    converter swaps it, single_file_utils.swap_scale_shift; ComfyUI's mmdit_to_diffusers too): its lora_up
    rows must be in the MMDiT's order (it had diffusers')."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers
    from peft import LoraConfig
    from safetensors.torch import load_file
    from sdplan.trainer.flow_export import save_flow_lora
    from sdplan.trainer.flow_single_file import sd3_to_original

    transformer = SD3Transformer2DModel.from_pretrained(tiny_flow[family] / "transformer")
    base = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    last = transformer.config.num_layers - 1
    torch.manual_seed(5)
    targets = ["attn.to_q", "attn.add_k_proj", "norm1.linear", "norm1_context.linear", "ff_context.net.2"]
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    expected = dict(base)
    with torch.no_grad():
        for name, module in transformer.named_modules():
            if hasattr(module, "lora_A"):
                module.lora_B["default"].weight.normal_(0, 0.5)
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                expected[f"{name}.weight"] = base[f"{name}.weight"] + b @ a * module.scaling["default"]
    paths = save_flow_lora(
        tmp_path, transformer=transformer, family=family, rank=4, alpha=8, metadata=None, name="t"
    )
    kohya = load_file(str(paths[1]))
    assert f"lora_unet_joint_blocks_{last}_context_block_adaLN_modulation_1.lora_up.weight" in kohya

    original = sd3_to_original(base, transformer.config)
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert sorted(back) == sorted(base) and all(torch.equal(back[k], base[k]) for k in base)
    by_name = {k[: -len(".weight")].replace(".", "_"): k for k in original if k.endswith(".weight")}
    for module in {k.split(".")[0] for k in kohya}:
        down, up = kohya[f"{module}.lora_down.weight"], kohya[f"{module}.lora_up.weight"]
        key = by_name[module[len("lora_unet_") :]]
        original[key] = original[key] + up @ down * kohya[f"{module}.alpha"].item() / down.shape[0]
    got = convert_sd3_transformer_checkpoint_to_diffusers(original)
    for key, want in expected.items():
        torch.testing.assert_close(got[key], want, atol=1e-5, rtol=1e-5, msg=key)


# kohya sd-scripts library/sai_model_spec.py determine_architecture: "stable-diffusion-3-" + the MMDiT's
# model_type (library/sd3_utils.py: "5-large", "5-medium", "medium"), "flux-1-dev" / "flux-1-schnell"; + "/lora"
KOHYA_ARCHITECTURE = {
    "sd35-medium": "stable-diffusion-3-5-medium",
    "sd35-large": "stable-diffusion-3-5-large",
    "flux-dev": "flux-1-dev",
    "flux-schnell": "flux-1-schnell",
}


@pytest.mark.parametrize("family", FLOW)
def test_flow_kohya_lora_carries_kohyas_model_spec(tiny_flow, tmp_path, family):
    """The kohya file's ModelSpec keys as kohya sd-scripts writes them for these models (spec 1.0.1, its
    architecture ids, the spec's required implementation and resolution) and the hash of its tensors."""
    import hashlib

    from peft import LoraConfig
    from safetensors import safe_open
    from sdplan.trainer.flow_export import pipeline_class, save_flow_lora

    transformer = pipeline_class(family).from_pretrained(tiny_flow[family]).transformer
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["attn.to_q", "attn.to_k"]))
    paths = save_flow_lora(tmp_path, transformer=transformer, family=family, rank=4, alpha=4, metadata=None)
    with safe_open(str(paths[1]), framework="pt") as f:
        md = f.metadata()
    assert md["modelspec.sai_model_spec"] == "1.0.1"
    assert md["modelspec.architecture"] == f"{KOHYA_ARCHITECTURE[family]}/lora"
    flux = registry.family(family).arch == "flux"
    assert md["modelspec.implementation"] == (
        "https://github.com/black-forest-labs/flux" if flux else "diffusers"
    )
    assert md["modelspec.resolution"] == "1024x1024" and md["modelspec.title"] == tmp_path.name
    data = paths[1].read_bytes()
    body = data[8 + int.from_bytes(data[:8], "little") :]
    assert md["modelspec.hash_sha256"] == "0x" + hashlib.sha256(body).hexdigest()


def test_sd3_medium_kohya_keys_name_sd3_medium():
    """SD3 Medium (3.0: no qk-norm, no MMDiT-X attn2) is planned as sd35-medium but is another network: kohya's
    model_type for it is "medium" (library/sd3_utils.py), its architecture stable-diffusion-3-medium."""
    from sdplan.trainer.flow_export import _kohya_metadata

    sd3 = {"qk_norm": None, "dual_attention_layers": []}
    md = _kohya_metadata("mmdit", sd3, 4, 4.0, "x", "sd35-medium")
    assert md["ss_base_model_version"] == "medium"
    assert md["modelspec.architecture"] == "stable-diffusion-3-medium/lora"
    sd35 = {"qk_norm": "rms_norm", "dual_attention_layers": [0]}
    assert _kohya_metadata("mmdit", sd35, 4, 4.0, "x", "sd35-medium")["ss_base_model_version"] == "5-medium"


def test_flow_families_refuse_textual_inversion_and_noise_offset(tiny_flow, demo_dataset, tmp_path):
    from sdplan.trainer import run

    cfg = _cfg(
        tiny_flow["flux-schnell"],
        "flux-schnell",
        demo_dataset,
        tmp_path / "o",
        "method=textual-inversion",
        "textual_inversion.token=<sks>",
        "textual_inversion.init_token=square",
    )
    with pytest.raises(UsageError, match="does lora, finetune, dreambooth"):
        run.train(cfg)
    # the config refuses it where it names the family; the trainer where its files say it
    with pytest.raises(config.ConfigError, match="noise_offset"):
        _cfg(
            tiny_flow["flux-schnell"],
            "flux-schnell",
            demo_dataset,
            tmp_path / "o",
            "training.noise_offset=0.1",
        )
    cfg = tiny_train_config(
        tiny_flow["flux-schnell"], demo_dataset, tmp_path / "o", "training.noise_offset=0.1"
    )
    with pytest.raises(UsageError, match="noise_offset"):
        run.train(cfg)


@pytest.mark.parametrize("family", ["sd35-medium", "flux-schnell"])
def test_flow_families_refuse_a_resolution_that_is_no_whole_number_of_patches(
    tiny_flow, demo_dataset, tmp_path, family
):
    """72 px: a 9x9 latent, which FLUX cannot pack into 2x2 tokens (a reshape error at the first step) and
    SD3's patch embedding cuts to 8x8 (a shape mismatch in the loss). A config that names the family refuses it
    (as `recommend` does); a family found in the model's files, the trainer."""
    from sdplan.trainer import run

    with pytest.raises(config.ConfigError, match="multiple of 16 pixels"):
        _cfg(tiny_flow[family], family, demo_dataset, tmp_path / "o", "data.resolution=72")
    cfg = _cfg(tiny_flow[family], family, demo_dataset, tmp_path / "o")
    cfg.data.resolution, cfg.model.family = 72, None
    with pytest.raises(UsageError, match="multiple of 16 pixels"):
        run.train(cfg)


def test_family_of_another_network_kind_is_refused(tiny_flow):
    from sdplan.trainer import models

    from sdplan.launcher import _family_of

    assert {f: _family_of("folder", str(p)) for f, p in tiny_flow.items()} == {f: f for f in FLOW}

    with pytest.raises(models.ModelLoadError, match="model.family is sd35-medium"):
        models.load_components(str(tiny_flow["flux-dev"]), family="sd35-medium")
    assert models.load_components(str(tiny_flow["sd35-large"])).family == "sd35-large"
    single = tiny_flow["flux-dev"].parent / "flux.safetensors"
    single.write_bytes(b"")
    with pytest.raises(UsageError, match="a single flux-dev file needs model.config_dir"):
        models.load_components(str(single), family="flux-dev")


# the original-layout keys that tell the variants apart (diffusers infer_diffusers_model_type reads the same)
_FLOW_KEYS = {
    "flux-dev": ["double_blocks.0.img_attn.qkv.weight", "img_in.weight", "guidance_in.in_layer.bias"],
    "flux-schnell": ["double_blocks.0.img_attn.qkv.weight", "img_in.weight"],
    "sd35-medium": [
        "joint_blocks.0.x_block.attn.qkv.weight",
        "joint_blocks.0.x_block.attn.ln_q.weight",
        "joint_blocks.0.x_block.attn2.qkv.weight",
    ],
    "sd35-large": ["joint_blocks.0.x_block.attn.qkv.weight", "joint_blocks.0.x_block.attn.ln_q.weight"],
}


def _flow_file(path: Path, family: str, prefix: str = "") -> Path:
    """A single transformer file of ``family`` in the original layout (a few tiny tensors, no torch)."""
    from safetensors.numpy import save_file

    save_file({prefix + k: np.zeros((2, 2), np.float16) for k in _FLOW_KEYS[family]}, str(path))
    return path


def _flow_configs(root: Path, family: str) -> Path:
    """A diffusers folder of ``family`` that passes the model check: its transformer config says the variant."""
    from conftest import fake_diffusers_folder

    config = {"in_channels": 64 if family.startswith("flux") else 16}
    config.update(
        {"guidance_embeds": family == "flux-dev"}
        if family.startswith("flux")
        else {"qk_norm": "rms_norm", "dual_attention_layers": [0] if family == "sd35-medium" else []}
    )
    return fake_diffusers_folder(root, family, denoiser=config)


def test_a_single_transformer_files_family_is_read_from_its_keys(tmp_path):
    """A FLUX.1 [dev] file with a [schnell] model.config_dir loaded as [schnell], its guidance embedder dropped,
    and its LoRA was labelled flux-1-schnell; an SD3.5 file was whatever model.family said (flux-dev too). The
    file's keys say its variant, as diffusers reads them; model.family or a config_dir that says another is one
    line naming both."""
    from sdplan.trainer import flow_models
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folders = {f: _flow_configs(tmp_path / f, f) for f in FLOW}
    for family in FLOW:
        for prefix in ("", "model.diffusion_model."):
            path = _flow_file(tmp_path / f"{family}-{len(prefix)}.safetensors", family, prefix)
            info = check_source(str(path), config_dir=str(folders[family]))
            assert (info.family, info.prediction_type) == (family, "flow_matching")
            assert info.notes[0] == f"model: single file: family {family}, prediction flow_matching"
    from conftest import fake_diffusers_folder
    from safetensors.numpy import save_file

    sd3_medium = tmp_path / "sd3.safetensors"  # SD3 Medium: no qk-norm (planned as SD3.5 Medium, its size)
    save_file({"joint_blocks.0.x_block.attn.qkv.weight": np.zeros(2, np.float16)}, str(sd3_medium))
    sd3_folder = fake_diffusers_folder(tmp_path / "sd3", "sd35-medium", denoiser={"in_channels": 16})
    assert check_source(str(sd3_medium), config_dir=str(sd3_folder)).family == "sd35-medium"

    dev = tmp_path / "flux-dev-0.safetensors"
    with pytest.raises(UnsupportedModelError, match="model.family is flux-schnell but .* flux-dev model"):
        check_source(str(dev), family="flux-schnell", config_dir=str(folders["flux-dev"]))
    with pytest.raises(UnsupportedModelError, match="model.family is flux-dev but .* sd35-large model"):
        check_source(str(tmp_path / "sd35-large-0.safetensors"), family="flux-dev", config_dir="x")
    with pytest.raises(
        UnsupportedModelError, match="is a flux-schnell folder but .* is a flux-dev transformer"
    ):
        check_source(str(dev), config_dir=str(folders["flux-schnell"]))
    with pytest.raises(
        UnsupportedModelError, match="is a sd35-medium folder but .* is a sd35-large transformer"
    ):
        check_source(str(tmp_path / "sd35-large-0.safetensors"), config_dir=str(folders["sd35-medium"]))
    with pytest.raises(UsageError, match="a single flux-dev file needs model.config_dir") as e:
        check_source(str(dev))
    # not "its text encoders, VAE and configs are used": an all-in-one file's own load; its configs alone do
    assert (
        "for an all-in-one file its configs alone do (`hf download black-forest-labs/FLUX.1-dev"
        in e.value.fix
    )
    # a folder: its transformer config says the variant (the trainer's own check on the loaded one too)
    with pytest.raises(UnsupportedModelError, match="model.family is flux-schnell but"):
        check_source(str(folders["flux-dev"]), family="flux-schnell")
    with pytest.raises(UnsupportedModelError, match="model.family is sd35-medium but"):
        flow_models._check("sd35-large", "sd35-medium", "m")


def test_bitsandbytes_layers_are_refused_only_in_the_transformer(tmp_path):
    """Forge's flux1-dev-bnb-nf4 (the transformer's Linear weights packed 4-bit by bitsandbytes, each with
    weight.absmax, weight.quant_map and weight.quant_state.bitsandbytes__nf4) passed the check as flux-dev, and
    diffusers' converter failed on it after launch. A bundled text encoder's 4-bit layers are not read from the
    file (text encoders come from model.config_dir) and do not make it refused."""
    from safetensors.numpy import save_file
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folder = _flow_configs(tmp_path / "cfg", "flux-dev")
    dit = {"model.diffusion_model." + k: np.zeros((2, 2), np.float16) for k in _FLOW_KEYS["flux-dev"]}
    t5 = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"
    packed = {t5: np.zeros((2, 1), np.uint8), t5 + ".quant_state.bitsandbytes__nf4": np.zeros(9, np.uint8)}
    path = tmp_path / "flux1-dev-bnb-nf4.safetensors"
    save_file({**dit, **packed}, str(path))
    assert check_source(str(path), config_dir=str(folder)).family == "flux-dev"

    q = "model.diffusion_model.double_blocks.0.img_attn.qkv.weight"
    mine = {
        q + ".absmax": np.ones(1, np.float32),
        q + ".quant_state.bitsandbytes__nf4": np.zeros(9, np.uint8),
    }
    save_file({**dit, **mine}, str(path))
    with pytest.raises(
        UnsupportedModelError, match=r"a bitsandbytes NF4 checkpoint \(model.diffusion_model.double"
    ):
        check_source(str(path), config_dir=str(folder))


def test_a_scaled_fp8_text_encoder_in_an_all_in_one_file_is_not_the_transformers(tmp_path):
    """Comfy-Org's sd3.5_medium_incl_clips_t5xxlfp8scaled.safetensors (the MMDiT in fp16, only T5-XXL scaled
    fp8, its marker text_encoders.t5xxl.transformer.scaled_fp8) was refused as a scaled-fp8 checkpoint: sdplan
    reads only the transformer from an SD3.5 / FLUX.1 file (text encoders from model.config_dir). A marker of
    the transformer's own is still refused, and so is the ComfyUI metadata naming a transformer layer."""
    from safetensors.numpy import save_file
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folder = _flow_configs(tmp_path / "cfg", "sd35-medium")
    t5 = "text_encoders.t5xxl.transformer."
    mmdit = {"model.diffusion_model." + k: np.zeros((2, 2), np.float16) for k in _FLOW_KEYS["sd35-medium"]}
    rest = {
        "text_encoders.clip_l.transformer.text_model.embeddings.token_embedding.weight": np.zeros(
            2, np.float16
        ),
        "first_stage_model.decoder.conv_in.weight": np.zeros(2, np.float16),
        t5 + "scaled_fp8": np.zeros(0, np.float16),
        t5 + "encoder.block.0.layer.0.SelfAttention.q.weight": np.zeros((2, 2), np.float16),
        t5 + "encoder.block.0.layer.0.SelfAttention.q.scale_weight": np.ones((), np.float32),
    }
    path = tmp_path / "sd3.5_medium_incl_clips_t5xxlfp8scaled.safetensors"
    save_file({**mmdit, **rest}, str(path))
    assert check_source(str(path), config_dir=str(folder)).family == "sd35-medium"
    quant = json.dumps(
        {"format_version": "1.0", "layers": {t5 + "encoder.block.0.layer.0.SelfAttention.q": {}}}
    )
    save_file({**mmdit, **rest}, str(path), metadata={"_quantization_metadata": quant})
    assert check_source(str(path), config_dir=str(folder)).family == "sd35-medium"

    q = "model.diffusion_model.joint_blocks.0.x_block.attn.qkv."
    save_file({**mmdit, **rest, q + "scale_weight": np.ones((), np.float32)}, str(path))
    with pytest.raises(UnsupportedModelError, match=r"scaled-fp8 checkpoint \(model.diffusion_model.joint"):
        check_source(str(path), config_dir=str(folder))
    quant = json.dumps({"layers": {q[:-1]: {"format": "float8_e4m3fn"}}})
    save_file({**mmdit, **rest}, str(path), metadata={"_quantization_metadata": quant})
    with pytest.raises(
        UnsupportedModelError, match="scaled-fp8 checkpoint .*_quantization_metadata of model"
    ):
        check_source(str(path), config_dir=str(folder))


def test_the_parts_a_single_file_takes_from_config_dir_must_have_weights_there(tmp_path):
    """The parts an SD3.5 / FLUX.1 file does not give load from model.config_dir: a configs-only folder (the
    review's: a file without a VAE, or whose T5 is scaled fp8) passed the check and the trainer failed after
    the launch (OSError: no file named diffusion_pytorch_model.bin). One line naming each part and why it comes
    from the folder; the parts the file gives need no weights there."""
    from safetensors.numpy import save_file
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folder = _flow_configs(tmp_path / "cfg", "sd35-medium")
    for sub in ("transformer", "vae", "text_encoder_3"):  # the transformer's are never read
        (folder / sub / "diffusion_pytorch_model.safetensors").unlink()
    z = np.zeros((2, 2), np.float16)
    mmdit = {"model.diffusion_model." + k: z for k in _FLOW_KEYS["sd35-medium"]}
    t5 = "text_encoders.t5xxl.transformer."
    clips = {
        f"text_encoders.{n}.transformer.text_model.embeddings.position_embedding.weight": z
        for n in ("clip_l", "clip_g")
    }
    fp8_t5 = {t5 + "shared.weight": z, t5 + "scaled_fp8": np.zeros(0, np.float16)}
    path = tmp_path / "sd3.5_medium_incl_clips_t5xxlfp8scaled.safetensors"
    save_file({**mmdit, **clips, **fp8_t5}, str(path))
    with pytest.raises(UnsupportedModelError) as e:
        check_source(str(path), config_dir=str(folder))
    assert e.value.message == (
        f"model.config_dir {folder}: holds no weights for the parts {path} does not give: VAE (vae/: none in the "
        "file), T5 (text_encoder_3/: the file's is quantized, which diffusers does not read)"
    )
    assert "--include 'vae/*' 'text_encoder_3/*' --local-dir" in e.value.fix
    (folder / "vae" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    with pytest.raises(UnsupportedModelError, match="VAE .vae/: none in the file"):  # loaded without variant
        check_source(str(path), config_dir=str(folder))
    for sub in ("vae", "text_encoder_3"):
        (folder / sub / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    assert check_source(str(path), config_dir=str(folder)).family == "sd35-medium"
    alone = _flow_file(tmp_path / "t.safetensors", "sd35-medium")  # the transformer only: all four from it
    (folder / "text_encoder" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(
        UnsupportedModelError, match=r"the parts .*t.safetensors does not give: CLIP-L \(text"
    ):
        check_source(str(alone), config_dir=str(folder))


def test_an_all_in_one_files_encoder_deeper_than_config_dirs_is_one_line(tmp_path):
    """diffusers skips the keys of layers a config lacks: an all-in-one file's CLIP or T5 with more layers than
    model.config_dir's config trained cut short, silently (the width was compared, not the depth)."""
    import json

    from safetensors.numpy import save_file
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    folder = _flow_configs(tmp_path / "cfg", "flux-dev")
    (folder / "text_encoder" / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps({"num_layers": 2}))
    z = np.zeros((2, 2), np.float16)
    clip, t5 = "text_encoders.clip_l.transformer.text_model.", "text_encoders.t5xxl.transformer."
    state = {"model.diffusion_model." + k: z for k in _FLOW_KEYS["flux-dev"]}
    state |= {clip + "embeddings.position_embedding.weight": z, t5 + "shared.weight": z}
    state |= {f"{t5}encoder.block.{i}.layer.0.SelfAttention.q.weight": z for i in (0, 1)}
    state |= {f"{clip}encoder.layers.{i}.mlp.fc1.weight": z for i in (0, 1)}
    path = tmp_path / "flux_aio.safetensors"
    save_file(state, str(path))
    with pytest.raises(UnsupportedModelError) as e:
        check_source(str(path), config_dir=str(folder))
    assert e.value.message == (
        f"model.config_dir {folder} does not describe {path}'s own CLIP-L: the file's has 2 layers, "
        "text_encoder/config.json says 1"
    )
    (folder / "text_encoder" / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert check_source(str(path), config_dir=str(folder)).family == "flux-dev"
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps({"num_layers": 3}))
    with pytest.raises(UnsupportedModelError, match="own T5: the file's has 2 layers, text_encoder_2/config"):
        check_source(str(path), config_dir=str(folder))


def test_an_sd3_medium_file_with_an_sd35_medium_config_dir_is_one_line(tmp_path):
    """SD3 Medium and SD3.5 Medium are both planned as sd35-medium, so an SD3 Medium file with an SD3.5 Medium
    model.config_dir (or the reverse) passed every check and failed after the launch on a shape mismatch.
    The file's structure is compared with the transformer config it loads with: the dual-attention blocks,
    the qk-norm and pos_embed's positions (what diffusers tells SD3 from SD3.5 Medium by)."""
    from conftest import fake_diffusers_folder
    from safetensors.numpy import save_file
    from sdplan.trainer.source_check import UnsupportedModelError, check_source

    sd35 = _flow_configs(tmp_path / "sd35", "sd35-medium")  # dual attention in block 0, qk-norm
    sd3 = fake_diffusers_folder(tmp_path / "sd3", "sd35-medium", denoiser={"in_channels": 16})
    z = np.zeros((2, 2), np.float16)
    sd3_file = tmp_path / "sd3_medium.safetensors"
    save_file({"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": z}, str(sd3_file))
    sd35_file = _flow_file(tmp_path / "sd3.5_medium.safetensors", "sd35-medium", "model.diffusion_model.")
    assert check_source(str(sd3_file), config_dir=str(sd3)).family == "sd35-medium"
    assert check_source(str(sd35_file), config_dir=str(sd35)).family == "sd35-medium"
    with pytest.raises(
        UnsupportedModelError, match=r"sd35 does not describe .*sd3_medium.safetensors's transf"
    ):
        check_source(str(sd3_file), config_dir=str(sd35))
    with pytest.raises(UnsupportedModelError, match=r"dual attention .x_block.attn2. in 1 blocks, .* in 0"):
        check_source(str(sd35_file), config_dir=str(sd3))
    qk_only = tmp_path / "qk.safetensors"  # the dual blocks agree, the qk-norm does not
    save_file(
        {"joint_blocks.0.x_block.attn2.qkv.weight": z, "joint_blocks.0.x_block.attn.qkv.weight": z},
        str(qk_only),
    )
    with pytest.raises(
        UnsupportedModelError, match="the file has no qk-norm .x_block.attn.ln_q., the folder"
    ):
        check_source(str(qk_only), config_dir=str(sd35))
    pos = {"pos_embed": np.zeros((1, 36864, 2), np.float16)}  # SD3 Medium's 192 x 192 positions
    save_file({**{k: z for k in _FLOW_KEYS["sd35-medium"]}, **pos}, str(sd35_file))
    config = json.loads((sd35 / "transformer" / "config.json").read_text())
    (sd35 / "transformer" / "config.json").write_text(json.dumps({**config, "pos_embed_max_size": 384}))
    with pytest.raises(
        UnsupportedModelError, match="pos_embed holds 36,864 positions, .* 147,456 .pos_embed_max"
    ):
        check_source(str(sd35_file), config_dir=str(sd35))
    (sd35 / "transformer" / "config.json").write_text(json.dumps({**config, "pos_embed_max_size": 192}))
    assert check_source(str(sd35_file), config_dir=str(sd35)).family == "sd35-medium"


def test_recommend_reads_a_single_transformer_file_with_its_config_dir(tmp_path):
    """`recommend --model flux.safetensors model.config_dir=DIR` said the file needs model.config_dir: the
    settings' config_dir never reached the model check."""
    from conftest import one_line_error
    from typer.testing import CliRunner

    from sdplan.cli import app

    dev = _flow_file(tmp_path / "flux.safetensors", "flux-dev", "model.diffusion_model.")
    args = ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--model", str(dev)]
    folder = _flow_configs(tmp_path / "dev", "flux-dev")
    r = CliRunner().invoke(app, [*args, f"model.config_dir={folder}"])
    assert r.exit_code == 0, r.output
    assert "lora flux-dev" in r.output and "a single file of the flux-dev family" in r.output
    schnell = _flow_configs(tmp_path / "schnell", "flux-schnell")
    one_line_error(
        CliRunner().invoke(app, [*args, f"model.config_dir={schnell}"]), 2, "flux-schnell folder", "flux-dev"
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd35"])
def test_demo_cli_trains_the_tiny_transformer_families(tmp_path, model):
    import subprocess
    import sys

    out = tmp_path / "demo"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdplan.cli",
            "train",
            "--demo",
            "--model",
            model,
            "--out",
            str(out),
            "--max-steps",
            "1",  # the outputs checked below come from any run of one step or more
        ],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        timeout=scaled(200),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "sdplan.yaml").read_text().count(registry.family(model).name) >= 1


def test_flux_resume_equals_uninterrupted_exactly(tiny_flow, demo_dataset, tmp_path):
    """The flow objective draws everything from the step's generator: 4 steps straight vs. 2 + resume 2 give
    identical losses and identical adapters (mid-epoch, with accumulation and LoRA dropout)."""

    from sdplan.trainer import checkpoint, run

    opts = ("training.batch_size=1", "training.grad_accum=2", "training.max_steps=4", "lora.dropout=0.1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run.train(
        _cfg(
            tiny_flow["flux-dev"], "flux-dev", demo_dataset, straight, *opts, "checkpoints.keep_every_steps=2"
        )
    )
    kept = checkpoint.checkpoint_root(straight) / "step-000002"
    run.train(_cfg(tiny_flow["flux-dev"], "flux-dev", demo_dataset, resumed, *opts), resume=str(kept))

    assert len(losses(straight)) == 4
    assert_same_run(straight, resumed)


def test_an_all_in_one_files_parts_are_found_by_diffusers_own_keys():
    """The text encoders and VAE of an all-in-one SD3.5 / FLUX.1 file are found by the keys diffusers' pipeline
    from_single_file reads them by; a quantized one (ComfyUI's scaled fp8 T5) is left to model.config_dir."""
    from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES, LDM_VAE_KEYS
    from sdplan.trainer.flow_models import FILE_PARTS, file_parts, file_parts_note

    def marker(name):
        return FILE_PARTS[name][1] + FILE_PARTS[name][2]

    assert (marker("clip_l"), marker("clip_g")) == (
        CHECKPOINT_KEY_NAMES["clip_sd3"],
        CHECKPOINT_KEY_NAMES["open_clip_sd3"],
    )
    assert marker("t5") == "text_encoders.t5xxl.transformer.shared.weight"  # is_t5_in_single_file
    assert {FILE_PARTS["vae"][1], FILE_PARTS["vae_flux"][1]} == set(LDM_VAE_KEYS)
    t5 = "text_encoders.t5xxl.transformer."
    keys = ["double_blocks.0.img_attn.qkv.weight", marker("clip_l"), marker("t5"), t5 + "scaled_fp8"]
    parts = file_parts([*keys, "vae.decoder.conv_out.weight"], "flux")
    assert parts == {
        "text_encoder": ("CLIP-L", FILE_PARTS["clip_l"][1], False),
        "text_encoder_2": ("T5", t5, True),
        "vae": ("VAE", "vae.", False),
    }
    assert file_parts_note(parts, "flux") == (  # FLUX: export.save_full's single file is the transformer only
        "model: the file's own CLIP-L, VAE (an all-in-one file: they load from it and the exported model/ folder "
        "carries them; the exported single file is the transformer alone, as ComfyUI's Load Diffusion Model node "
        "and BFL's release hold it); T5 from model.config_dir (the file's is quantized, which diffusers does not "
        "read); configs and tokenizers from model.config_dir"
    )
    assert "(an all-in-one file: they load from it and the exported model carries them)" in file_parts_note(
        parts, "mmdit"
    )  # SD3.5: the single file holds them all, in Stability's layout (sd3_pipeline_to_original)
    assert file_parts(keys[:1], "mmdit") == {}


def test_train_says_before_the_launch_which_parts_a_single_file_gives(tmp_path, demo_dataset):
    """Which text encoders and VAE an SD3.5 / FLUX.1 single file gives and which model.config_dir does was said
    by the trainer only, after the launch; the plan says it first."""
    from typer.testing import CliRunner

    from sdplan.cli import app

    dev = _flow_file(tmp_path / "flux.safetensors", "flux-dev", "model.diffusion_model.")
    folder = _flow_configs(tmp_path / "dev", "flux-dev")
    r = CliRunner().invoke(
        app,
        [
            "train",
            "--dry-run",
            "--method",
            "lora",
            "--model",
            str(dev),
            "--dataset",
            str(demo_dataset),
            "--out",
            str(tmp_path / "out"),
            f"model.config_dir={folder}",
            "training.device=cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "model: the file holds the transformer only: its text encoders and VAE are model.config_dir's" in (
        " ".join(r.output.split())
    )
