"""sdplan.yaml: defaults validate, every error is reported at once with its key path, overrides win."""

from __future__ import annotations

import pytest
import yaml

from sdplan import config
from sdplan.errors import ConfigError


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = config.validate(config.default_config())
    path = tmp_path / "sdplan.yaml"
    path.write_text(config.to_yaml(cfg, header="run it with:\n  sdplan train --config sdplan.yaml"))
    text = path.read_text()
    assert text.startswith("# run it with:\n#   sdplan train --config sdplan.yaml\n")
    assert config.load(path) == cfg


def test_every_error_is_reported_at_once_with_its_key_path():
    bad = {
        "method": "dreembooth",
        "training": {"batch_size": 0, "precision": "fp8", "learnin_rate": 1.0},
        "memory": {"gradient_checkpointing": "yes"},
        "data": {"metadata": {"shuffle_tags": 2}},
        "distributed": {"deepspeed": {"zero_stage": 3}},
        "colour": 1,
    }
    with pytest.raises(ConfigError) as info:
        config.validate(bad, source="sdplan.yaml")
    errors = info.value.errors
    assert "training.batch_size: must be >= 1, got 0" in errors
    assert any(e.startswith("method: must be one of lora, dreambooth") for e in errors)
    assert any(e.startswith("training.precision: must be one of fp32, fp16, bf16") for e in errors)
    assert any(e.startswith("training.learnin_rate: unknown key") for e in errors)
    assert any(e.startswith("memory.gradient_checkpointing: must be true or false") for e in errors)
    assert any(e.startswith("data.metadata.shuffle_tags: must be between 0 and 1") for e in errors)
    assert any(e.startswith("distributed.deepspeed.zero_stage: must be 1 or 2") for e in errors)
    assert any(e.startswith("colour: unknown key") for e in errors)
    assert len(errors) == 8
    assert str(info.value).startswith("sdplan.yaml: ")


def test_cross_field_rules():
    data = config.default_config()
    data["memory"]["optimizer"] = "adamw8bit"
    data["distributed"]["deepspeed"] = {"zero_stage": 2, "offload_optimizer": True}
    data["method"] = "dreambooth"
    data["dreambooth"]["with_prior_preservation"] = True
    with pytest.raises(ConfigError) as info:
        config.validate(data)
    assert any("does not combine with DeepSpeed" in e for e in info.value.errors)
    data["method"] = "lora"
    data["memory"]["optimizer"] = "adamw"
    data["training"]["train_text_encoder"] = True
    with pytest.raises(ConfigError, match="DeepSpeed trains one model"):
        config.validate(data)
    assert any(e.startswith("dreambooth.class_prompt: required") for e in info.value.errors)


def test_overrides_win_and_parse_yaml_values(tmp_path):
    path = tmp_path / "sdplan.yaml"
    path.write_text(yaml.safe_dump({"method": "lora", "training": {"batch_size": 2, "learning_rate": 1e-4}}))
    cfg = config.load(
        path,
        [
            "training.batch_size=4",
            "training.learning_rate=1e-5",
            "memory.gradient_checkpointing=true",
            "data.metadata.min_score=3",
        ],
    )
    assert cfg.training.batch_size == 4
    assert cfg.training.learning_rate == pytest.approx(1e-5)
    assert cfg.memory.gradient_checkpointing is True
    assert cfg.data.metadata is not None and cfg.data.metadata.min_score == 3.0


def test_exponent_without_dot_is_a_number():
    # YAML 1.1 reads 1e-4 as a string; a learning rate written that way must still work.
    data = yaml.safe_load("training:\n  learning_rate: 1e-4\n")
    assert data["training"]["learning_rate"] == "1e-4"
    assert config.validate(data).training.learning_rate == pytest.approx(1e-4)


@pytest.mark.parametrize("override", ["training.batch_size", "=3", "training.batch_size.x=1"])
def test_malformed_override_is_a_clear_error(override):
    with pytest.raises(ConfigError):
        config.validate(config.apply_overrides(config.default_config(), [override]))


@pytest.mark.parametrize(
    ("override", "value"),
    [
        (
            "dreambooth.instance_prompt=sks dog, masterpiece: 1.2",
            "sks dog, masterpiece: 1.2",
        ),  # was a mapping
        ("dreambooth.instance_prompt=#sks", "#sks"),  # was a YAML comment: null
        ("dreambooth.instance_prompt=yes", "yes"),  # was True
        ("textual_inversion.token=123", "123"),  # was 123
        ("dreambooth.instance_prompt='quoted: as YAML'", "quoted: as YAML"),
        ("dreambooth.class_prompt=null", None),
        ("sampling.prompts=['a cat: 1.2', dog]", ["a cat: 1.2", "dog"]),
        ("lora.target_modules=[to_q, to_v]", ["to_q", "to_v"]),
        ("training.batch_size = 4", 4),  # the rest is YAML
    ],
)
def test_a_text_setting_takes_the_text_as_typed(override, value):
    """Prompts are text: `key=value` read them as YAML, so `sks dog, masterpiece: 1.2` was a mapping and `#sks`
    nothing, each refused as "must be a string"."""
    key = override.partition("=")[0].strip()
    data = config.apply_overrides(config.default_config(), [override])
    section, name = key.split(".")
    assert data[section][name] == value
    config.validate(data)


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (
            ["dreambooth.instance_prompt=sks dog,", "masterpiece"],
            '"dreambooth.instance_prompt=sks dog, masterpiece"',
        ),
        (
            ["training.epochs=2", "dreambooth.instance_prompt=a", "b", "c"],
            '"dreambooth.instance_prompt=a b c"',
        ),
        (['dreambooth.instance_prompt=say "hi"', "now"], """'dreambooth.instance_prompt=say "hi" now'"""),
        (["stray", "training.epochs=2"], None),  # not after a setting: nothing to quote
    ],
)
def test_words_the_shell_split_off_a_value_say_to_quote_it(overrides, fix):
    """`key=sks dog, masterpiece` typed unquoted reaches sdplan as three arguments: the error named each stray
    word "an override is key=value" and never said why (new-user audit, item 4)."""
    with pytest.raises(ConfigError) as e:
        config.apply_overrides(config.default_config(), overrides)
    assert "an override is key=value" in str(e.value)
    if fix is None:
        assert e.value.fix is None
    else:
        assert e.value.fix == f"a value with spaces must be quoted, as one argument: {fix}"


def test_a_list_item_yaml_reads_as_no_text_says_to_quote_it():
    with pytest.raises(ConfigError) as info:
        config.apply_overrides(config.default_config(), ["sampling.prompts=[a cat: 1.2, dog]"])
    (error,) = info.value.errors
    assert error.startswith("sampling.prompts: an item is not text as YAML reads it ({'a cat': 1.2}); quote")


@pytest.mark.parametrize(
    "override",
    [
        "data.metadata.skip_tags=lowres, bad hands",
        "lora.target_modules=to_k,to_q",
        'sampling.prompts="a cat"',
    ],
)
def test_a_list_setting_given_as_text_says_how_to_write_a_list(override):
    """`skip_tags=lowres, bad hands` is two tags or one? It must not be guessed (one item skipped nothing)."""
    with pytest.raises(ConfigError) as info:
        config.apply_overrides(config.default_config(), [override])
    (error,) = info.value.errors
    key = override.partition("=")[0]
    assert (
        error == f"{key}: takes a list: write it as {key}='[first, second]' (quote an item that holds ', ')"
    )


@pytest.mark.parametrize("value", ["null", "~", ""])
def test_null_for_a_text_setting_that_takes_none_is_refused(value):
    data = config.apply_overrides(config.default_config(), [f"output.dir={value}"])
    with pytest.raises(ConfigError, match="output.dir: must be a string, got None"):
        config.validate(data)
    if not value:  # a setting of choices names them
        data = config.apply_overrides(config.default_config(), ["training.device="])
        with pytest.raises(ConfigError, match="training.device: must be one of auto, cpu, cuda, got ''"):
            config.validate(data)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)


def test_override_keys_are_read_as_the_overrides_apply():
    """One reading of which keys key=value settings set (train, recommend and bench each had a copy, and one a
    `startswith("training.max_steps=")` that missed a spaced 'training.max_steps = 5')."""
    items = ["training.max_steps = 5", "lora.rank=8"]
    assert config.override_keys(items) == ["training.max_steps", "lora.rank"]
    applied = config.apply_overrides(config.default_config(), items)
    assert applied["training"]["max_steps"] == 5 and applied["lora"]["rank"] == 8


@pytest.mark.parametrize(
    ("value", "ok"),
    [("[1]", True), ("[0, 2]", True), ("null", True), ("[]", False), ("[0, 0]", False), ("[-1]", False)],
)
def test_gpu_ids_are_distinct_gpu_numbers(value, ok):
    """distributed.gpu_ids: the GPUs a run uses, as `sdplan doctor` numbers them (the planner writes them where the
    machine's GPUs differ); Settings carries them both ways."""
    from sdplan.settings import Settings

    data = config.apply_overrides(config.default_config(), [f"distributed.gpu_ids={value}"])
    if not ok:
        with pytest.raises(ConfigError, match="distributed.gpu_ids"):
            config.validate(data)
        return
    cfg = config.validate(data)
    s = Settings.from_config(cfg)
    assert s.gpu_ids == (tuple(cfg.distributed.gpu_ids) if cfg.distributed.gpu_ids is not None else None)
    assert s.to_config()["distributed"]["gpu_ids"] == cfg.distributed.gpu_ids


def test_unknown_keys_without_a_near_name_are_said_together_with_the_known_names_once():
    """Each unknown key repeated the whole list of known ones: a wrong file gave a 1,200-character line."""
    with pytest.raises(ConfigError) as e:
        config.validate({"method": "lora", "foo": 1, "bar": 2, "training": {"batch_sise": 2}})
    assert e.value.errors[0].startswith("foo, bar: unknown keys (known: method, model,")
    assert "training.batch_sise: unknown key (did you mean training.batch_size?)" in e.value.errors
    assert str(e.value).count("known:") == 1


def test_a_key_of_another_section_names_its_full_path():
    """`optimizer=prodigy` listed the sections ("known: method, model, data, ...") and left the user to find
    memory.optimizer; a key that names a setting of another section now names its full key."""
    with pytest.raises(ConfigError) as e:
        config.validate({"method": "lora", "optimizer": "prodigy", "rank": 8, "memory": {"optimzer": "x"}})
    assert "optimizer: unknown key (did you mean memory.optimizer?)" in e.value.errors
    assert "rank: unknown key (did you mean lora.rank?)" in e.value.errors
    assert "memory.optimzer: unknown key (did you mean memory.optimizer?)" in e.value.errors


def test_a_machine_snapshot_given_as_the_config_says_what_it_is(tmp_path):
    """`sdplan train --config machine.json` (what `doctor --save` writes) listed every snapshot key as unknown."""
    from conftest import MACHINES

    with pytest.raises(ConfigError) as e:
        config.load(MACHINES / "rtx3060_12gb.json")
    assert "a machine snapshot (sdplan doctor --save), not an sdplan.yaml" in str(e.value)
    assert "sdplan recommend --machine FILE" in str(e.value) and "unknown key" not in str(e.value)


def test_full_bf16_weights_do_not_combine_with_deepspeed():
    """A plan pinned to DeepSpeed and full bf16 weights said "full bf16 weights and gradients (no fp32 master
    copy)" while DeepSpeed's ZeRO optimizer kept its fp32 master weights (the plan's 60 GiB of host RAM for
    SDXL counted them): refused, with the fix."""
    with pytest.raises(ConfigError) as e:
        config.validate(
            {
                "method": "finetune",
                "training": {"precision": "bf16", "full_half_weights": True},
                "distributed": {"deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
            }
        )
    assert "training.full_half_weights: DeepSpeed keeps fp32 master weights" in str(e.value)
    assert "set it to false or remove distributed.deepspeed" in str(e.value)


@pytest.mark.parametrize(
    ("method", "rate"),
    [("lora", 1e-4), ("dreambooth", 5e-6), ("finetune", 1e-5), ("textual-inversion", 1e-4)],
)
def test_the_learning_rate_left_out_is_the_methods(method, rate):
    """Every method trained at 1e-4, a LoRA's rate: a DreamBooth or full fine-tune there trains every weight of
    the network 20x faster than diffusers' DreamBooth script (5e-6) and overfits or breaks. A given one stays."""
    assert config.validate({"method": method}).training.learning_rate == rate
    data = {**config.default_config(), "method": method}
    assert config.validate(data).training.learning_rate == rate  # the defaults as data (`sdplan train`)
    given = {"method": method, "training": {"learning_rate": 3e-6}}
    assert config.validate(given).training.learning_rate == 3e-6


@pytest.mark.parametrize("value", [".inf", "-.inf", "0", "-1e-4", "1e39", "3e38"])
@pytest.mark.parametrize("key", ["learning_rate", "text_encoder_learning_rate"])
def test_a_learning_rate_must_be_positive_and_a_float32(key, value):
    """1e39 passed (finite as a Python float) and the optimizer step raised torch's "value cannot be converted to
    type float without overflow" as a traceback; so did 3e38, under float32's largest value (AdamW's first step
    scales the rate by 10)."""
    data = yaml.safe_load(f"method: lora\ntraining:\n  {key}: {value}\n")
    with pytest.raises(config.ConfigError, match=f"training.{key}: must be > 0 and at most 3e35"):
        config.validate(data)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("training.noise_offset=.inf", "training.noise_offset: must be >= 0 and finite, got inf"),
        ("training.noise_offset=1e400", "training.noise_offset: must be >= 0 and finite, got inf"),
        ("training.max_grad_norm=.inf", "training.max_grad_norm: must be >= 0 and finite, got inf"),
        ("lora.alpha=.inf", "lora.alpha: must be a finite number, got inf"),
        ("dreambooth.prior_loss_weight=.inf", "dreambooth.prior_loss_weight: must be a finite number"),
        ("data.metadata.score_buckets=[.inf,0.5]", "data.metadata.score_buckets[0]: must be a finite number"),
        (
            "data.metadata.score_bonus={a: .inf}",
            "data.metadata.score_bonus.a: must be a finite number, got inf",
        ),
    ],
)
def test_a_number_setting_must_be_finite(setting, said):
    """training.noise_offset=inf passed its rule (>= 0) and `recommend --json` printed `Infinity`, which no strict
    JSON parser reads (review h102, item 5): every number setting is finite, as the learning rate was."""
    data = config.apply_overrides({"method": "lora"}, [setting])
    with pytest.raises(config.ConfigError) as e:
        config.validate(data)
    assert said in str(e.value)


def test_a_non_finite_number_under_plan_names_its_key_not_the_whole_record():
    """`plan: {x: .inf, ...}` printed the whole plan record in its error: one line hundreds of characters long.
    It names the key that holds it, with that value only."""
    record = {
        "plan": {"batch_size": 4, "steps": [1, 2, 3]},
        "estimate": {"seconds": float("inf")},
        "x": "y" * 300,
    }
    with pytest.raises(config.ConfigError) as e:
        config.validate({"method": "lora", "plan": record})
    (line,) = [s for s in str(e.value).splitlines() if "finite" in s]
    assert "plan.estimate.seconds: must be a finite number, got inf" in line and len(line) < 120, line


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("{a: null}", "data.metadata.score_bonus.a: must be a number, got None"),
        ("{a: true}", "data.metadata.score_bonus.a: must be a number, got True"),
        ("{1: 0.5}", "data.metadata.score_bonus: its key 1 must be a string"),
    ],
)
def test_score_bonus_says_which_key_or_value_is_wrong(value, said):
    """score_bonus {a: null} / {a: true} / {1: 0.5} said "must be a mapping, got {...}", though it is one."""
    data = config.apply_overrides({"method": "lora"}, [f"data.metadata.score_bonus={value}"])
    with pytest.raises(config.ConfigError) as e:
        config.validate(data)
    assert said in str(e.value) and "must be a mapping" not in str(e.value), str(e.value)


def test_e_notation_reaches_lists_and_mappings_of_numbers_and_underscores_are_no_number():
    """data.metadata.score_buckets="[1e-4, 0.5]" was refused as "must be a list of numbers, got ['1e-4', 0.5]":
    YAML 1.1 reads 1e-4 (no dot) as text, and only a float setting took it as the number it is. And Python's
    float() read learning_rate=1_0e-4, text to YAML, as 0.001 (review h102, item 6)."""
    data = config.apply_overrides(
        {"method": "lora"},
        ["data.metadata.score_buckets=[1e-4, 0.5]", "data.metadata.score_bonus={a: 2E-1, b: 1}"],
    )
    meta = config.validate(data).data.metadata
    assert meta.score_buckets == [0.0001, 0.5] and meta.score_bonus == {"a": 0.2, "b": 1.0}
    # the same in an sdplan.yaml
    text = "method: lora\ndata:\n  metadata:\n    score_buckets: [1e-4, 0.5]\n    score_bonus: {a: 2E-1}\n"
    meta = config.validate(yaml.safe_load(text)).data.metadata
    assert meta.score_buckets == [0.0001, 0.5] and meta.score_bonus == {"a": 0.2}
    for setting, said in (
        ("training.learning_rate=1_0e-4", "training.learning_rate: must be a number or null, got '1_0e-4'"),
        ("data.metadata.score_buckets=[1_0e-4]", "data.metadata.score_buckets: must be a list of numbers"),
        ("training.noise_offset=inf", "training.noise_offset: must be a number, got 'inf'"),
    ):
        with pytest.raises(config.ConfigError) as e:
            config.validate(config.apply_overrides({"method": "lora"}, [setting]))
        assert said in str(e.value), str(e.value)
    with pytest.raises(config.ConfigError, match="must be a number or null, got '1_0e-4'"):
        config.validate(yaml.safe_load("method: lora\ntraining:\n  learning_rate: 1_0e-4\n"))
    assert config.setting_value("training.learning_rate", "3e-4") == 0.0003


@pytest.mark.parametrize("key", ["training.seed", "sampling.seed"])
def test_a_seed_is_what_every_seeder_takes(key):
    """training.seed=99999999999999999999 passed (--dry-run too) and the trainer failed after launch
    (torch.manual_seed: Overflow when unpacking long long); numpy and accelerate's set_seed take 0 to 2**32 - 1."""
    section, name = key.split(".")
    for ok in (0, 2**32 - 1):
        assert getattr(getattr(config.validate({"method": "lora", section: {name: ok}}), section), name) == ok
    for bad in (-1, 2**32, 99999999999999999999):
        with pytest.raises(config.ConfigError, match=rf"{key}: must be from 0 to 4294967295 \(2\*\*32 - 1\)"):
            config.validate({"method": "lora", section: {name: bad}})


@pytest.mark.parametrize("method", ["lora", "dreambooth", "textual-inversion"])
def test_an_ema_on_a_method_that_keeps_none_is_refused(method):
    """`recommend --method lora ema.enabled=true` planned and charged an EMA (3.2 GiB on SD 1.5) that the LoRA
    trainer never kept: only the full fine-tune keeps one."""
    with pytest.raises(
        config.ConfigError, match="ema.enabled: an EMA of the weights is kept by method finetune"
    ):
        config.validate({"method": method, "ema": {"enabled": True}})
    assert config.validate({"method": "finetune", "ema": {"enabled": True}}).ema.enabled


@pytest.mark.parametrize("method", ["lora", "finetune", "textual-inversion"])
def test_prior_preservation_outside_dreambooth_is_refused(method):
    data = {"method": method, "dreambooth": {"with_prior_preservation": True, "class_prompt": "a dog"}}
    with pytest.raises(config.ConfigError, match="only method dreambooth trains with class images"):
        config.validate(data)


def test_min_snr_gamma_is_a_positive_number_for_the_ddpm_families():
    assert config.validate({"method": "lora", "training": {"min_snr_gamma": 5}}).training.min_snr_gamma == 5
    with pytest.raises(config.ConfigError, match="training.min_snr_gamma: must be > 0 and finite, or null"):
        config.validate({"method": "lora", "training": {"min_snr_gamma": 0}})
    flux = {"method": "lora", "model": {"family": "flux-dev"}, "training": {"min_snr_gamma": 5}}
    with pytest.raises(config.ConfigError, match="flux-dev's rectified flow weighs its own"):
        config.validate(flux)


def test_caption_dropout_is_a_share_and_not_for_textual_inversion():
    assert config.validate({"method": "lora", "data": {"caption_dropout": 0.1}}).data.caption_dropout == 0.1
    with pytest.raises(config.ConfigError, match="data.caption_dropout: must be at least 0 and below 1"):
        config.validate({"method": "lora", "data": {"caption_dropout": 1}})
    with pytest.raises(config.ConfigError, match="textual inversion learns its token from the captions"):
        config.validate({"method": "textual-inversion", "data": {"caption_dropout": 0.1}})


def test_sampling_steps_past_the_schedule_are_refused_before_the_run():
    """sampling.num_inference_steps=1000 passed, and the final grid failed after the whole run with an IndexError
    from the scheduler (timestep 1000 of 1000)."""
    with pytest.raises(config.ConfigError, match="sampling.num_inference_steps: must be between 1 and 999"):
        config.validate({"method": "lora", "sampling": {"num_inference_steps": 1000}})
    assert config.validate({"method": "lora", "sampling": {"num_inference_steps": 999}})


def test_a_written_config_reads_back_every_text_as_written():
    """PyYAML wrote NEL (U+0085) raw in a single-quoted scalar, which reads back as a space: a dataset folder with
    one in its name was "does not exist" to the trainer. A lone surrogate (a Latin-1 file name) and DEL too."""
    data = {"data": {"path": "/tmp/nel\x85dir", "other": ["caf\udce9", "del\x7f", "plain", "x\u2028y"]}}
    assert yaml.safe_load(config.to_yaml(data, header="run: /tmp/nel\x85dir caf\udce9")) == data


@pytest.mark.parametrize(
    "given",
    [["memory.cache_latents_to_disk=true"], ["memory={cache_latents_to_disk: true}"]],
)
def test_latents_cached_to_disk_imply_latent_caching_in_either_form(given):
    assert config.implied_settings(given) == [*given, "memory.cache_latents=true"]
    assert config.implied_settings([*given, "memory.cache_latents=false"]) == [
        *given,
        "memory.cache_latents=false",
    ]


def test_an_embedding_layer_as_a_text_encoder_target_is_refused_before_anything_runs():
    """lora.text_encoder_target_modules=[q_proj, token_embedding] was refused only inside the trainer, after the
    models loaded (on a GPU, after SDXL or FLUX.1 was read): no LoRA file other tools read holds an embedding.
    Only where the trainer reads the key: a LoRA that trains its text encoders."""
    data = config.default_config()
    data["method"] = "lora"
    data["training"]["train_text_encoder"] = True
    data["lora"]["text_encoder_target_modules"] = ["q_proj", "token_embedding"]
    with pytest.raises(ConfigError, match="token_embedding is an embedding layer"):
        config.validate(data)
    data["lora"]["text_encoder_target_modules"] = ["q_proj", "text_model.embeddings.position_embedding"]
    with pytest.raises(ConfigError, match="is an embedding layer"):
        config.validate(data)
    data["lora"]["text_encoder_target_modules"] = ["q_proj", "fc1"]
    assert config.validate(data).lora.text_encoder_target_modules == ["q_proj", "fc1"]
    for empty in ([], [""]):  # it failed in the trainer, after the models loaded
        data["lora"]["text_encoder_target_modules"] = empty
        with pytest.raises(ConfigError, match="must name at least one module"):
            config.validate(data)
    # not read (the text encoders frozen): an old sdplan.yaml holding it still loads
    data["training"]["train_text_encoder"] = False
    for unread in (["q_proj", "token_embedding"], []):
        data["lora"]["text_encoder_target_modules"] = unread
        assert config.validate(data)


def test_warmup_with_the_constant_scheduler_is_refused():
    """diffusers' get_scheduler drops num_warmup_steps for "constant" (optimization.py): the run trained at the
    full rate from step 1 while its plan line said "warmup 2". kohya refuses the pair too."""
    data = config.default_config()
    data["training"]["lr_warmup_steps"] = 2
    (problem,) = config.given_problems(config.validate(data))  # an older run's sdplan.yaml still validates
    assert problem.startswith("training.lr_warmup_steps: 2 with training.lr_scheduler constant")
    data["training"]["lr_scheduler"] = "constant_with_warmup"
    assert config.given_problems(config.validate(data)) == []


def test_warmup_with_the_constant_scheduler_is_refused_where_given_and_resumes_where_saved(tmp_path):
    """`sdplan train` refuses the pair as given; a run folder an older sdplan wrote with it still resumes (it
    trained without warmup, and goes on so), unless the schedule is given again."""
    from sdplan.errors import ConfigError as CE
    from sdplan.launcher import TrainRequest, _validate_given

    base = config.default_config()
    base["training"]["lr_warmup_steps"] = 2
    new = TrainRequest(method="lora", model="m", dataset=str(tmp_path))
    with pytest.raises(CE, match="no warmup"):
        _validate_given(base, new, tmp_path / "run", "sdplan.yaml")
    resume = TrainRequest(resume=True, out=str(tmp_path / "run"))
    assert _validate_given(base, resume, tmp_path / "run", "sdplan.yaml").training.lr_warmup_steps == 2
    again = TrainRequest(resume=True, out=str(tmp_path / "run"), overrides=["training.lr_warmup_steps=3"])
    with pytest.raises(CE, match="no warmup"):
        _validate_given(base, again, tmp_path / "run", "sdplan.yaml")


def test_a_resume_is_refused_only_for_the_ignored_setting_it_gives_again(tmp_path):
    """An older textual-inversion run folder holding both ignored settings (warmup with the constant schedule,
    full_half_weights) resumes; giving the schedule again asked to drop full_half_weights too, which the resume
    had not touched: only the problems of the keys given are said."""
    from sdplan.errors import ConfigError as CE
    from sdplan.launcher import TrainRequest, _validate_given

    base = config.default_config()
    base["method"] = "textual-inversion"
    base.pop("lora", None)
    base["training"].update(lr_warmup_steps=2, precision="bf16", full_half_weights=True)
    run = tmp_path / "run"
    assert _validate_given(base, TrainRequest(resume=True, out=str(run)), run, "sdplan.yaml")
    with pytest.raises(CE) as e:
        _validate_given(
            base, TrainRequest(resume=True, out=str(run), overrides=["training.lr_warmup_steps=3"]), run, "x"
        )
    assert "no warmup" in str(e.value) and "full_half_weights" not in str(e.value)
    with pytest.raises(CE) as e:
        _validate_given(
            base,
            TrainRequest(resume=True, out=str(run), overrides=["training.full_half_weights=true"]),
            run,
            "x",
        )
    assert "full_half_weights" in str(e.value) and "warmup" not in str(e.value)
