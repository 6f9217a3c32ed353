"""The SD3.5 and FLUX.1 family profiles: hub configs that load, build and count as published, and activations.

The networks are built on the meta device from the configs in profiles/models/ with the installed diffusers /
transformers classes (no weights, no download). The planner does not plan these families yet (issue 14): the
loader keeps them in ``Profiles.unplanned_models``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from sdplan import profiles, registry
from sdplan.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "profiles" / "models"
NEW = registry.FLOW_FAMILIES

_spec = importlib.util.spec_from_file_location("count_params", ROOT / "scripts" / "count_params.py")
count_params = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(count_params)

# every value in a transformer-family file that is not derived from another one (checked below) names its source
SOURCED = {
    "transformer",
    "text_encoders",
    "text_encoder_max_lengths",
    "vae",
    "scheduler",
    "transformer_text_tokens",
    "lora_target_modules",
    "kohya_base_model_version",
    "native_resolution",
    "params",
}


def _flops_at(coef: dict, latent: int) -> float:
    return profiles.Activations._eval(coef, 1, latent)


@pytest.fixture(scope="module")
def specs():
    return {f: yaml.safe_load((MODELS / f"{f}.yaml").read_text()) for f in NEW}


@pytest.fixture(scope="module")
def built(specs):
    return {f: count_params.build(spec) for f, spec in specs.items()}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    return profiles.load_profiles(ROOT / "profiles", tmp_path_factory.mktemp("no-local-store"))


def test_new_files_load_through_the_profile_loader(shipped):
    assert not shipped.unplanned_models  # planned since issue 14 (sdplan.planner.memory_flow)
    assert set(NEW) <= set(shipped.models) == set(registry.PLANNED_FAMILIES)
    for family in NEW:
        m = profiles.load_model(MODELS / f"{family}.yaml")
        assert m == shipped.models[family]
        assert m.unet == {} and m.params_unet == 0
        assert m.denoiser_params == m.params_transformer > 0
        assert m.latent_channels == 16 and m.vae_scale_factor == 8 and m.native_resolution == 1024
        assert len(m.text_encoder_max_lengths) == len(m.text_encoders) == len(m.params_text_encoders)
        assert m.scheduler["class"] == "FlowMatchEulerDiscreteScheduler"
    assert shipped.models["sd35-large"].architecture == "mmdit"
    assert shipped.models["sd35-large"].buffers_transformer == 192 * 192 * 2432
    assert shipped.models["flux-dev"].buffers_transformer == 0
    assert shipped.models["flux-dev"].transformer_class == "FluxTransformer2DModel"


def test_unet_families_are_unchanged_by_the_new_fields(shipped):
    sdxl = shipped.models["sdxl"]
    assert sdxl.architecture == "unet" and sdxl.transformer is None and sdxl.params_transformer is None
    assert sdxl.denoiser_params == sdxl.params_unet == 2_567_463_684
    assert sdxl.text_encoder_max_lengths == () and sdxl.lora_target_modules == ()


@pytest.mark.parametrize("family", NEW)
def test_meta_device_counts_equal_the_stored_counts(specs, built, family):
    spec, nets = specs[family], built[family]
    counts = {
        "transformer": count_params.numel(nets["transformer"]),
        "text_encoders": [count_params.numel(te) for te in nets["text_encoders"]],
        "vae": count_params.numel(nets["vae"]),
    }
    assert spec["params"] == counts
    assert spec["buffers"] == {"transformer": count_params.persistent_buffer_numel(nets["transformer"])}
    for module in (nets["transformer"], nets["vae"], *nets["text_encoders"]):
        assert {p.device.type for p in module.parameters()} == {"meta"}
    assert count_params.check_published(family, counts, spec["buffers"]) == []


def test_counts_agree_with_the_published_figures(specs):
    p = {f: specs[f]["params"] for f in NEW}
    # T5-XXL encoder (embedding tied to `shared`), CLIP-L, OpenCLIP bigG with projection, the 16-channel VAE
    t5 = 4_762_310_656
    assert [te[-1] for te in (p[f]["text_encoders"] for f in NEW)] == [t5] * 4
    assert p["sd35-large"]["text_encoders"][:2] == [123_060_480 + 768 * 768, 694_659_840]
    assert p["flux-dev"]["text_encoders"][0] == 123_060_480
    assert {p[f]["vae"] for f in NEW} == {83_819_683}
    # SD3.5 Large Turbo's bf16 weight index: params + the 192^2 x 2432 positional table, to the element
    large = p["sd35-large"]["transformer"] + specs["sd35-large"]["buffers"]["transformer"]
    assert large * 2 == 16_292_561_536
    assert specs["sd35-large"]["buffers"]["transformer"] == 192 * 192 * 2432
    medium = p["sd35-medium"]["transformer"] + specs["sd35-medium"]["buffers"]["transformer"]
    assert 2.45e9 <= medium < 2.55e9  # "2.5B" counts the 384^2 x 1536 table too
    # schnell lacks only the guidance embedder: two Linear layers 256 -> 3072 -> 3072
    assert p["flux-dev"]["transformer"] - p["flux-schnell"]["transformer"] == (256 * 3072 + 3072) + (
        3072 * 3072 + 3072
    )


@pytest.mark.parametrize("family", NEW)
def test_every_value_names_its_source(specs, family):
    spec = specs[family]
    assert set(spec["sources"]) == SOURCED
    for key, text in spec["sources"].items():
        assert isinstance(text, str) and "/" in text, f"sources.{key} names no repository or path"
    assert spec["source"].strip()
    # the rest is derived from the sourced configs
    cfg, vae, encoders = spec["transformer"]["config"], spec["vae"], spec["text_encoders"]
    assert spec["vae_scale_factor"] == 2 ** (len(vae["block_out_channels"]) - 1)
    assert spec["latent_channels"] == vae["latent_channels"] == 16
    clip = [te for te in encoders if te["class"].startswith("CLIP")]
    t5 = [te for te in encoders if te["class"] == "T5EncoderModel"]
    assert len(t5) == 1 and cfg["joint_attention_dim"] == t5[0]["config"]["d_model"] == 4096
    assert all(te["max_length"] == te["config"]["max_position_embeddings"] == 77 for te in clip)
    assert spec["tokenizer_max_length"] == 77
    assert isinstance(t5[0]["config"]["layer_norm_epsilon"], float)
    if spec["transformer"]["class"] == "SD3Transformer2DModel":
        assert spec["native_resolution"] == cfg["sample_size"] * spec["vae_scale_factor"]
        assert cfg["in_channels"] == cfg["out_channels"] == spec["latent_channels"]
        assert cfg["caption_projection_dim"] == cfg["num_attention_heads"] * cfg["attention_head_dim"]
        assert cfg["pooled_projection_dim"] == sum(te["config"]["projection_dim"] for te in clip)
        assert spec["transformer_text_tokens"] == 77 + t5[0]["max_length"] == 333
    else:
        assert cfg["in_channels"] == 4 * spec["latent_channels"]  # 2x2-packed latents
        assert cfg["pooled_projection_dim"] == clip[0]["config"]["hidden_size"]
        assert spec["transformer_text_tokens"] == t5[0]["max_length"]
        assert sum(cfg["axes_dims_rope"]) == cfg["attention_head_dim"]


def test_family_specifics(specs):
    medium, large = (
        specs["sd35-medium"]["transformer"]["config"],
        specs["sd35-large"]["transformer"]["config"],
    )
    assert medium["dual_attention_layers"] == list(range(13)) and "dual_attention_layers" not in large
    assert (medium["pos_embed_max_size"], large["pos_embed_max_size"]) == (384, 192)
    assert "stabilityai/stable-diffusion-3.5-large-turbo" in specs["sd35-large"]["hub_ids"]
    dev, schnell = specs["flux-dev"], specs["flux-schnell"]
    assert dev["transformer"]["config"]["guidance_embeds"] is True
    assert schnell["transformer"]["config"]["guidance_embeds"] is False
    assert (dev["text_encoders"][1]["max_length"], schnell["text_encoders"][1]["max_length"]) == (512, 256)
    assert dev["scheduler"]["config"]["use_dynamic_shifting"] is True
    assert schnell["scheduler"]["config"] == {**schnell["scheduler"]["config"], "shift": 1.0}
    assert specs["sd35-medium"]["scheduler"]["config"] == {"num_train_timesteps": 1000, "shift": 3.0}
    assert {s["vae"]["scaling_factor"] for s in (dev, schnell)} == {0.3611}
    assert {specs[f]["vae"]["shift_factor"] for f in ("sd35-medium", "sd35-large")} == {0.0609}


@pytest.mark.parametrize("family", NEW)
def test_lora_targets_match_modules_of_the_built_transformer(built, specs, family):
    names = [n for n, _ in built[family]["transformer"].named_modules()]
    for target in specs[family]["lora_target_modules"]:
        assert any(n == target or n.endswith("." + target) for n in names), target


@pytest.mark.parametrize("family", NEW)
def test_activations_cover_every_new_family(shipped, family):
    act = shipped.activations
    assert act.source.startswith("computed: scripts/compute_activations.py")
    entry = act.families[family]
    assert entry["text_tokens"] == shipped.models[family].transformer_text_tokens
    for trained in profiles.TRANSFORMER_TRAINED:
        held_at = {}
        for res in (512, 1024):
            lat = (res // 8) ** 2
            held, peak = act.transformer(family, gc=False, batch=1, latent_pixels=lat, trained=trained)
            held_gc, peak_gc = act.transformer(family, gc=True, batch=1, latent_pixels=lat, trained=trained)
            assert peak == 0 and 0 < held_gc < held / 5 and 0 < peak_gc < held
            two, _ = act.transformer(family, gc=False, batch=2, latent_pixels=lat, trained=trained)
            assert two > 1.9 * held
            held_at[res] = held
        # held bytes grow with the tokens: 4x the image tokens at 1024 px, the same text tokens
        tokens = entry["text_tokens"]
        assert 0.8 * (4096 + tokens) / (1024 + tokens) < held_at[1024] / held_at[512] < 4.0
    full, _ = act.transformer(family, gc=False, batch=1, latent_pixels=128 * 128, trained="full")
    lora, _ = act.transformer(family, gc=False, batch=1, latent_pixels=128 * 128, trained="lora")
    assert lora < full
    flops = entry["flops"]
    step = flops["transformer_train_step"]
    fwd = _flops_at(flops["transformer_forward"], 128 * 128)
    assert 2.5 < _flops_at(step["full"], 128 * 128) / fwd < 3.5  # forward + backward ~ 3 forwards
    assert _flops_at(step["lora"], 128 * 128) < _flops_at(step["full"], 128 * 128)
    assert _flops_at(step["full_gc"], 128 * 128) > _flops_at(step["full"], 128 * 128)
    assert entry["flops_fit_max_error"] < 1e-3
    assert len(entry["text_encoders"]) == len(shipped.models[family].text_encoders)


def test_loader_rejects_a_transformer_family_without_its_parts(tmp_path):
    data = yaml.safe_load((MODELS / "flux-dev.yaml").read_text())
    data.pop("sources")
    data["unet"] = {"block_out_channels": [1]}
    del data["text_encoders"][1]["max_length"]
    path = tmp_path / "flux-dev.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        profiles.load_model(path)
    text = str(err.value)
    assert "sources: missing" in text
    assert "unet: not used by the flux-dev family" in text
    assert "text_encoders[1].max_length: missing" in text
