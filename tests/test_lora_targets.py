"""lora.target_modules: a pinned list trains exactly the modules it names, in any order, on every family; null (the
default) trains the family's default targets (sdplan.registry.LORA_TARGETS); the planner charges what the
trainer trains either way; an sdplan.yaml or checkpoint written before null meant "the family's default" (with
the old default list [to_k, to_q, to_v, to_out.0]) keeps the meaning it trained with."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from conftest import tiny_train_config, trains_in_process

from sdplan import config as C
from sdplan import planner as P
from sdplan import registry
from sdplan.errors import ConfigError, UsageError
from sdplan.settings import Settings

ATTN = ["to_k", "to_q", "to_v", "to_out.0"]  # the old default's order (and the UNet's default set)
ATTN_OTHER_ORDER = ["to_q", "to_k", "to_v", "to_out.0"]
OLD_DEFAULT = ["to_k", "to_q", "to_v", "to_out.0"]


def _pin(targets: list[str]) -> str:
    return f"lora.target_modules=[{', '.join(targets)}]"


# -- the config and the registry -------------------------------------------------------------------------


def test_the_default_is_null_and_means_the_familys_targets():
    assert C.LoraConfig().target_modules is None
    assert registry.lora_targets("sd15", None) == registry.UNET_LORA_TARGETS
    assert registry.lora_targets("sdxl", None) == registry.UNET_LORA_TARGETS
    assert registry.lora_targets("flux-dev", None) == registry.LORA_TARGETS["flux"]
    assert registry.lora_targets("flux-schnell", None) == registry.LORA_TARGETS["flux"]
    assert registry.lora_targets("sd35-large", None) == registry.LORA_TARGETS["mmdit"]
    assert registry.lora_targets(None, None) == registry.UNET_LORA_TARGETS  # family left to detection


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_a_pinned_list_is_the_modules_it_names_whatever_their_order(family):
    one, other = registry.lora_targets(family, ATTN), registry.lora_targets(family, ATTN_OTHER_ORDER)
    assert one == other == tuple(sorted(ATTN))
    assert registry.lora_targets(family, ["to_q", "to_q"]) == ("to_q",)


def test_a_pin_is_kept_sorted_so_a_written_file_never_holds_the_old_defaults_order(tmp_path):
    for targets in (ATTN, ATTN_OTHER_ORDER):
        cfg = C.validate(C.apply_overrides({"model": {"family": "flux-dev"}}, [_pin(targets)]))
        assert cfg.lora.target_modules == sorted(ATTN)
        path = tmp_path / "sdplan.yaml"
        path.write_text(C.to_yaml(cfg))
        assert C.load(path).lora.target_modules == sorted(ATTN)  # read back as a pin, not as the default


def test_an_empty_list_is_refused():
    with pytest.raises(ConfigError, match="lora.target_modules: must name at least one module"):
        C.validate({"lora": {"target_modules": []}})


def test_null_and_an_empty_setting_are_the_default():
    for raw in ("lora.target_modules=null", "lora.target_modules="):
        assert C.validate(C.apply_overrides({}, [raw])).lora.target_modules is None


@pytest.mark.parametrize("family", ["flux-dev", "sd35-medium", "sd15"])
def test_an_old_sdplan_yaml_with_the_old_default_keeps_its_meaning(tmp_path, family):
    """Written before: every sdplan.yaml held the old default list; on SD3.5 / FLUX.1 it trained their
    LORA_TARGETS (trainer/flow.py then), on SD 1.x / SDXL the UNet's attention. It reads as null, which means the
    same; a key=value pin of the same list given with it is a pin."""
    data = C.default_config()
    data["model"]["family"] = family
    data["lora"]["target_modules"] = OLD_DEFAULT
    path = tmp_path / "sdplan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = C.load(path)
    assert cfg.lora.target_modules is None
    assert (
        registry.lora_targets(family, cfg.lora.target_modules) == registry.family(family).default_lora_targets
    )
    pinned = C.load(path, [_pin(ATTN)])
    assert registry.lora_targets(family, pinned.lora.target_modules) == tuple(sorted(ATTN))
    # another list in an old file is the pin it was (order aside)
    data["lora"]["target_modules"] = ["to_v", "to_q"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert C.load(path).lora.target_modules == ["to_q", "to_v"]


def test_the_flow_profiles_default_targets_are_the_registrys():
    from sdplan.profiles import load_profiles

    profiles = load_profiles()
    for family in registry.FLOW_FAMILIES:
        model = profiles.model(family)
        assert set(model.lora_target_modules) == set(registry.lora_targets(family, None))


# -- resume / start checks compare the modules, not the list ---------------------------------------------


def _check(old_targets, new_targets, family="flux-dev"):
    from sdplan.launcher import check_settings

    def data(targets, fam):
        return {"method": "lora", "model": {"family": fam}, "lora": {"target_modules": targets}}

    check_settings(
        data(old_targets, family),
        data(new_targets, None),
        what="t",
        where="w",
        fix="set {key}={value}{with_it}",
    )


def test_a_checkpoint_of_the_old_default_resumes_under_null_and_a_reordered_pin_is_the_same():
    _check(OLD_DEFAULT, None)  # an old FLUX checkpoint: LORA_TARGETS, as null is now
    _check(None, ["attn.to_q"] + [t for t in registry.LORA_TARGETS["flux"] if t != "attn.to_q"][::-1])
    _check(ATTN_OTHER_ORDER, sorted(ATTN))
    _check(OLD_DEFAULT, sorted(ATTN), family="sd15")  # the UNet's default, pinned: the same modules
    with pytest.raises(UsageError, match="lora.target_modules") as e:
        _check(OLD_DEFAULT, sorted(ATTN))  # FLUX: LORA_TARGETS then, attention only now
    assert "is null (the family's default: attn.to_k," in str(e.value)  # what the old list meant there
    assert "lora.target_modules=null" in e.value.fix
    with pytest.raises(UsageError, match="lora.target_modules"):
        _check(None, ["to_q"], family="sd15")


# -- the planner -----------------------------------------------------------------------------------------


def _lora_settings(family: str, targets) -> Settings:
    return Settings(method="lora", model=family, resolution=1024, lora_rank=16, lora_targets=targets)


@pytest.mark.parametrize("family", ["flux-dev", "sd35-large", "sd35-medium"])
def test_the_planner_charges_the_pinned_modules_whatever_their_order(family):
    from sdplan.profiles import load_profiles

    model = load_profiles().model(family)
    pinned = {P.flow_lora_params(model, _lora_settings(family, t)) for t in (ATTN, ATTN_OTHER_ORDER)}
    assert len(pinned) == 1
    default = P.flow_lora_params(model, _lora_settings(family, None))
    assert pinned.pop() < default  # attention only: less than the family's default targets
    # the default's modules pinned (any order) are the default
    listed = list(reversed(registry.LORA_TARGETS[registry.family(family).arch]))
    assert _lora_settings(family, listed).lora_targets is None
    assert P.flow_lora_params(model, _lora_settings(family, listed)) == default


def test_recommend_plans_the_pin_the_trainer_trains():
    """FLUX.1 on an H100: the pin of the attention projections, in either order, charges their weights (71 MiB
    at rank 16), no pin the family's default targets (171 MiB): what the trainer adapts for each."""
    from typer.testing import CliRunner

    from sdplan.cli import app
    from sdplan.profiles import load_profiles

    model = load_profiles().model("flux-dev")

    def planned(*pins: str) -> tuple[int, list | None, list, str]:
        args = ["recommend", "--method", "lora", "--model", "flux-dev", "--hardware", "H100 SXM", *pins]
        res = CliRunner().invoke(app, [*args, "--json"])
        assert res.exit_code == 0, res.output
        d = json.loads(res.output)
        s = d["settings"]
        params = (
            P.flow_lora_params(model, _lora_settings("flux-dev", s["lora_targets"])) // 16 * s["lora_rank"]
        )
        assert d["estimate"]["trainable_params"] == params
        return params, s["lora_targets"], s["lora_modules"], CliRunner().invoke(app, args).output

    one, other, default = planned(_pin(ATTN)), planned(_pin(ATTN_OTHER_ORDER)), planned()
    assert one[:3] == other[:3] and one[1] == one[2] == sorted(ATTN)
    assert default[1] is None and default[2] == list(registry.LORA_TARGETS["flux"])
    assert default[0] > 2 * one[0]
    assert "weights 71 MiB" in one[3] and "weights 71 MiB" in other[3] and "weights 171 MiB" in default[3]


# -- the trainer, against the planner --------------------------------------------------------------------


def _planned_per_rank(family: str, model_dir: Path, targets) -> int:
    """The planner's LoRA parameters per rank for the tiny model's transformer config (planner.flow_lora_params,
    which reads the transformer config and registry.lora_targets)."""
    tconfig = json.loads((model_dir / "transformer" / "config.json").read_text())
    spec = SimpleNamespace(transformer=tconfig, architecture=registry.family(family).arch)
    return P.flow_lora_params(spec, _lora_settings(family, targets)) // 16


@trains_in_process
@pytest.mark.slow
@pytest.mark.parametrize("family", ["flux-dev", "sd35-medium"])
def test_the_trainer_trains_what_the_planner_charges(tiny_flow, demo_dataset, tmp_path, family):
    from safetensors import safe_open
    from sdplan.trainer import run

    trained: dict[str, tuple[set, int, int]] = {}
    for label, targets in (("attn", ATTN), ("attn-other-order", ATTN_OTHER_ORDER), ("default", None)):
        out = tmp_path / label
        pins = (_pin(targets),) if targets else ()
        cfg = tiny_train_config(tiny_flow[family], demo_dataset, out, *pins, family=family, name="t")
        assert cfg.lora.rank == 4
        run.train(cfg)
        with safe_open(str(out / "pytorch_lora_weights.safetensors"), framework="pt") as f:
            meta = json.loads(f.metadata()["lora_adapter_metadata"])
            config = json.loads(f.metadata()["sdplan_config"])
            shapes = [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118 (safe_open: no iteration)
        params = sum(a * b for a, b in shapes)
        modules = set(meta["transformer.target_modules"])
        assert modules == set(registry.lora_targets(family, targets))
        assert params == 4 * _planned_per_rank(family, tiny_flow[family], targets), label
        assert config["lora"]["target_modules"] == (sorted(targets) if targets else None)
        with safe_open(str(out / "t.kohya.safetensors"), framework="pt") as f:
            kohya = [k for k in f.keys() if k.endswith(".lora_down.weight")]  # noqa: SIM118
        written = (
            yaml.safe_load((out / "sdplan.yaml").read_text()) if (out / "sdplan.yaml").is_file() else None
        )
        if written is not None:
            assert written["lora"]["target_modules"] == (sorted(targets) if targets else None)
        trained[label] = (modules, params, len(kohya))
    assert trained["attn"] == trained["attn-other-order"]
    assert trained["attn"][1] < trained["default"][1] and trained["attn"][2] < trained["default"][2]


def test_a_resume_of_a_detected_flow_family_compares_targets_on_the_checkpoints_family():
    """A run whose sdplan.yaml leaves model.family to detection (null) took null and the 4 attention modules as
    the same targets (the UNet's default) on FLUX: `--resume lora.target_modules=[...]` passed, the trainer
    refused the checkpoint, and the pin, written into the run's sdplan.yaml, kept every later resume failing."""
    from sdplan.launcher import check_resume_settings

    def cfg(targets):
        data = C.default_config()
        data.update(method="lora")
        data["lora"]["target_modules"] = targets
        return C.validate(data)

    check_resume_settings(cfg(None), cfg(ATTN_OTHER_ORDER))  # no family known: the UNet's reading
    with pytest.raises(UsageError, match="lora.target_modules is null .the family's default: attn.to_k"):
        check_resume_settings(cfg(None), cfg(ATTN_OTHER_ORDER), family="flux-dev")
    check_resume_settings(cfg(None), cfg(None), family="flux-dev")


def _lora_cfg(**sections) -> C.TrainConfig:
    data = C.default_config()
    data["method"] = "lora"
    for name, values in sections.items():
        data[name].update(values)
    return C.validate(data)


def test_unet_targets_kohyas_loader_drops_are_noted():
    """kohya sd-scripts' loader builds LoRA modules only inside Transformer2DModel / ResnetBlock2D / Down- and
    Upsample2D (networks/lora.py) and loads with strict=False: conv_in's weights vanish from the kohya file there
    without a word, where ComfyUI and A1111 apply them."""
    cfg = _lora_cfg(
        lora={"target_modules": ["to_q", "to_k", "to_v", "to_out.0", "conv_in", "time_embedding.linear_1"]}
    )
    (note,) = C.loader_notes(cfg, "sdxl")
    assert note.startswith(
        "lora.target_modules conv_in, time_embedding.linear_1: kohya sd-scripts' LoRA loader"
    )
    assert (
        C.loader_notes(_lora_cfg(lora={"target_modules": ["to_q", "conv1", "time_emb_proj"]}), "sd15") == []
    )
    # not written as a kohya file, or a family whose kohya loader is another (FLUX.1): nothing to say
    off = _lora_cfg(lora={"target_modules": ["conv_in"]}, output={"save_kohya": False})
    assert C.loader_notes(off, "sdxl") == [] and C.loader_notes(cfg, "flux-dev") == []


def test_text_encoder_attention_a1111_skips_is_noted():
    """A1111 adds LoRA to OpenCLIP's nn.MultiheadAttention (SD 2.x, SDXL's second encoder) only with q, k, v and
    out all present (extensions-builtin/Lora/networks.py): q_proj and v_proj alone are skipped there."""
    some = {"train_text_encoder": True}
    cfg = _lora_cfg(training=some, lora={"text_encoder_target_modules": ["q_proj", "v_proj", "fc1"]})
    (note,) = C.loader_notes(cfg, "sdxl")
    assert "q_proj, v_proj without k_proj, out_proj" in note and "SDXL's second text encoder" in note
    assert "the text encoder's attention" in C.loader_notes(cfg, "sd21")[0]
    assert (
        C.loader_notes(cfg, "sd15") == []
    )  # CLIP-L's projections are Linear layers A1111 patches one by one
    full = _lora_cfg(
        training=some, lora={"text_encoder_target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"]}
    )
    mlp = _lora_cfg(training=some, lora={"text_encoder_target_modules": ["fc1", "fc2"]})
    assert C.loader_notes(full, "sdxl") == [] == C.loader_notes(mlp, "sdxl")
    assert (
        C.loader_notes(_lora_cfg(lora={"text_encoder_target_modules": ["q_proj"]}), "sdxl") == []
    )  # TE frozen
