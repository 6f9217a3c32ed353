"""The model-family profiles build the real networks with the published parameter counts.

Each family's UNet, text encoder(s) and VAE are built on the meta device with the diffusers /
transformers constructors from the configs in profiles/models/ (no weights, no download; seconds).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sdplan import registry

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "profiles" / "models"

_spec = importlib.util.spec_from_file_location("count_params", ROOT / "scripts" / "count_params.py")
count_params = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(count_params)

FAMILIES = tuple(f for f in registry.PLANNED_FAMILIES if f not in registry.FLOW_FAMILIES)  # UNet files

# ../shared/reference/field-notes.md, section 2
SD1_UNET = 859_520_964
CLIP_VIT_L = 123_060_480
SD_VAE = 83_653_863
SDXL_UNET = 2_567_463_684
SDXL_TEXT_ENCODERS = 817_720_320

TOP_KEYS = {
    "schema_version",
    "family",
    "name",
    "native_resolution",
    "latent_channels",
    "vae_scale_factor",
    "hub_ids",
    "kohya_base_model_version",
    "unet",
    "text_encoders",
    "vae",
    "tokenizer_max_length",
    "params",
    "source",
}


@pytest.fixture(scope="module")
def specs():
    return {f: count_params.load_family(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def counts(specs):
    return {f: count_params.count(spec) for f, spec in specs.items()}


def test_every_family_file_is_shipped():
    # the transformer families (SD3.5, FLUX.1) are tested in test_family_profiles.py
    shipped = sorted(p.stem for p in MODELS.glob("*.yaml"))
    assert shipped == sorted(FAMILIES + registry.FLOW_FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_schema_keys_and_types(specs, family):
    spec = specs[family]
    assert set(spec) - {"epsilon_resolution"} == TOP_KEYS  # optional: SD 2.x's epsilon base at 512
    assert spec["schema_version"] == 1
    assert spec["family"] == family
    assert spec["source"].strip()
    assert spec["tokenizer_max_length"] == 77
    assert all(isinstance(h, str) and "/" in h for h in spec["hub_ids"])
    # floats written as 1e-05 load as strings in PyYAML: every eps must be a real float
    assert isinstance(spec["unet"]["norm_eps"], float)
    for te in spec["text_encoders"]:
        assert set(te) == {"class", "config"}
        assert te["class"] in count_params.TEXT_ENCODER_CLASSES
        assert isinstance(te["config"]["layer_norm_eps"], float)
    for key in ("_class_name", "_diffusers_version", "_name_or_path"):
        assert key not in spec["unet"] and key not in spec["vae"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_fields_agree_with_the_network_configs(specs, family):
    spec = specs[family]
    unet, vae, encoders = spec["unet"], spec["vae"], spec["text_encoders"]
    assert spec["vae_scale_factor"] == 2 ** (len(vae["block_out_channels"]) - 1)
    assert spec["latent_channels"] == vae["latent_channels"] == unet["in_channels"] == unet["out_channels"]
    assert spec["native_resolution"] == unet["sample_size"] * spec["vae_scale_factor"] == vae["sample_size"]
    # the UNet cross-attends to the text encoders' hidden states, concatenated
    assert unet["cross_attention_dim"] == sum(te["config"]["hidden_size"] for te in encoders)
    assert all(te["config"]["max_position_embeddings"] == spec["tokenizer_max_length"] for te in encoders)


def test_family_specifics(specs):
    sd15, sd21, sdxl = specs["sd15"], specs["sd21"], specs["sdxl"]
    assert (sd15["native_resolution"], sd21["native_resolution"], sdxl["native_resolution"]) == (
        512,
        768,
        1024,
    )
    assert sd15["unet"]["use_linear_projection"] is False
    assert sd21["unet"]["attention_head_dim"] == [5, 10, 20, 20]
    assert sd21["unet"]["use_linear_projection"] is True
    te21 = sd21["text_encoders"][0]["config"]
    assert (te21["hidden_size"], te21["num_hidden_layers"], te21["hidden_act"]) == (1024, 23, "gelu")
    assert [te["class"] for te in sdxl["text_encoders"]] == ["CLIPTextModel", "CLIPTextModelWithProjection"]
    assert sdxl["unet"]["addition_embed_type"] == "text_time"
    assert sdxl["unet"]["transformer_layers_per_block"] == [1, 2, 10]
    # pooled bigG projection + 6 size/crop ids x addition_time_embed_dim
    te2 = sdxl["text_encoders"][1]["config"]
    want = te2["projection_dim"] + 6 * sdxl["unet"]["addition_time_embed_dim"]
    assert sdxl["unet"]["projection_class_embeddings_input_dim"] == want == 2816
    assert sd15["kohya_base_model_version"] == "sd_v1"
    assert sdxl["kohya_base_model_version"] == "sdxl_base_v1-0"


def test_counts_match_the_field_notes(counts):
    assert counts["sd15"] == {"unet": SD1_UNET, "text_encoders": [CLIP_VIT_L], "vae": SD_VAE}
    assert counts["sdxl"]["unet"] == SDXL_UNET
    assert counts["sdxl"]["text_encoders"][0] == CLIP_VIT_L
    assert sum(counts["sdxl"]["text_encoders"]) == SDXL_TEXT_ENCODERS
    assert counts["sdxl"]["vae"] == counts["sd21"]["vae"] == SD_VAE
    for family in FAMILIES:
        assert count_params.check_published(family, counts[family]) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_params_match_computed(specs, counts, family):
    assert specs[family]["params"] == counts[family]


def test_build_is_on_the_meta_device(specs):
    nets = count_params.build(specs["sd15"])
    for module in (nets["unet"], nets["vae"], *nets["text_encoders"]):
        assert {p.device.type for p in module.parameters()} == {"meta"}


def test_write_params_rewrites_only_that_line(tmp_path, specs, counts):
    src = (MODELS / "sd21.yaml").read_text()
    path = tmp_path / "sd21.yaml"
    path.write_text(src.replace(count_params.format_params(counts["sd21"]), "params: {unet: 1}"))
    assert count_params.write_params(path, counts["sd21"]) is True
    assert path.read_text() == src
    assert count_params.write_params(path, counts["sd21"]) is False
