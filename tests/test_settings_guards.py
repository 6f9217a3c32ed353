"""Settings accepted and then ignored or broken by the run: each refused before the launch, one line, with the fix
(dry runs and config validation: nothing trains here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fake_diffusers_folder, make_images, one_line_error
from typer.testing import CliRunner

from sdplan import config
from sdplan.cli import app

runner = CliRunner()


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path]:
    return fake_diffusers_folder(tmp_path / "model"), make_images(tmp_path / "ds", n=2)


def dry_run(tmp_path, inputs, method: str, *args: str):
    model, ds = inputs
    return runner.invoke(
        app,
        ["train", "--method", method, "--model", str(model), "--dataset", str(ds), "--out", str(tmp_path / "o"),
         "--device", "cpu", "--dry-run", *args],
    )  # fmt: skip


def test_full_half_weights_is_refused_where_the_trainer_keeps_fp32_weights():
    """runtime.trained_dtype serves the full-weight recipes and a LoRA: textual inversion's embeddings stayed fp32,
    while the plan said 'full bf16 weights (no fp32 copy)'."""
    ti = config.validate(  # an older run folder's sdplan.yaml validates (it resumes: it trained so)
        {"method": "textual-inversion", "training": {"precision": "bf16", "full_half_weights": True}}
    )
    (problem,) = config.given_problems(ti)
    assert "training.full_half_weights: textual-inversion trains" in problem and "set it to false" in problem
    for method in ("finetune", "dreambooth", "lora"):
        cfg = config.validate(
            {"method": method, "training": {"precision": "bf16", "full_half_weights": True}}
        )
        assert config.given_problems(cfg) == []


def test_full_half_weights_on_textual_inversion_is_one_line_in_train(tmp_path, inputs):
    r = dry_run(
        tmp_path, inputs, "textual-inversion", "training.precision=bf16", "training.full_half_weights=true"
    )
    one_line_error(r, 2, "training.full_half_weights", "textual-inversion")


PRIOR = ("dreambooth.with_prior_preservation=true", "dreambooth.class_prompt=a dog")


def test_no_class_images_with_prior_preservation_is_refused(tmp_path, inputs):
    """num_class_images 0 passed, the model loaded, and the trainer said 'dataset folder .../class_images does not
    exist (give --dataset (data.path ...))', a key the user had not set."""
    r = dry_run(tmp_path, inputs, "dreambooth", *PRIOR, "dreambooth.num_class_images=0")
    one_line_error(r, 2, "dreambooth.num_class_images: 0", "set it to 1 or more")


def test_num_class_images_0_takes_every_image_of_a_class_folder_that_holds_some(tmp_path, inputs):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = dry_run(tmp_path, inputs, "dreambooth", *PRIOR, "dreambooth.num_class_images=0",
                f"dreambooth.class_data={empty}")  # fmt: skip
    one_line_error(r, 2, "dreambooth.num_class_images 0", str(empty), "holds no images")
    full = make_images(tmp_path / "cls", n=2)
    r = dry_run(tmp_path, inputs, "dreambooth", *PRIOR, "dreambooth.num_class_images=0",
                f"dreambooth.class_data={full}")  # fmt: skip
    assert r.exit_code == 0, r.output


def test_an_ema_that_would_never_update_is_refused(tmp_path, inputs):
    """ema.update_every past the run's optimizer steps: the loop never updated the EMA and exported the base model
    as the EMA weights, without a word."""
    r = dry_run(tmp_path, inputs, "finetune", "--max-steps", "3", "ema.enabled=true", "ema.update_every=5")
    one_line_error(r, 2, "ema.update_every 5", "3 optimizer steps", "set ema.update_every to 3 or less")
    r = dry_run(tmp_path, inputs, "finetune", "--max-steps", "5", "ema.enabled=true", "ema.update_every=5")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ({"steps": "x"}, "plan.steps: must be a mapping or null, got 'x'"),
        ({"plan": 5}, "plan.plan: must be a mapping or null, got 5"),
        ({"steps": {"total_steps": "x"}}, "plan.steps.total_steps: must be a whole number"),
    ],
)
def test_a_malformed_plan_record_is_one_line(tmp_path, inputs, record, needle):
    """The plan: section was only type-checked as a mapping: `plan: {steps: x}` and `plan: {plan: 5}` were a
    traceback in `sdplan train` (drop_a_stale_plan read them as mappings)."""
    import yaml

    model, ds = inputs
    data = {"method": "lora", "model": {"path": str(model)}, "data": {"path": str(ds)},
            "training": {"device": "cpu"}, "output": {"dir": str(tmp_path / "o")}, "plan": record}  # fmt: skip
    path = tmp_path / "sdplan.yaml"
    path.write_text(yaml.safe_dump(data))
    r = runner.invoke(app, ["train", "--config", str(path), "--dry-run"])
    one_line_error(r, 2, needle, "remove the plan: section")


def test_data_repeats_on_a_kohya_dataset_is_said_to_be_unused(tmp_path, inputs):
    """kohya `N_name` folders carry their own repeats: data.repeats=3 was dropped by `train` without a word, and
    recommend's note named --repeats, a flag the user had not given."""
    model, _ = inputs
    kohya = tmp_path / "kohya"
    make_images(kohya / "2_sks dog", n=2)
    r = runner.invoke(
        app,
        ["train", "--method", "lora", "--model", str(model), "--dataset", str(kohya), "--out", str(tmp_path / "o"),
         "--device", "cpu", "--dry-run", "data.repeats=3"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "note: data.repeats=3 is not used: kohya folder names carry the repeats" in r.stdout
    assert "2 images x 2 repeats = 4 samples" in r.stdout
    r = runner.invoke(app, ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--dataset", str(kohya), "data.repeats=3"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "data.repeats 3 ignored: kohya folder names carry the repeats" in " ".join(r.stdout.split())


@pytest.mark.parametrize(
    ("method", "key", "value"),
    [("lora", "lora.alpha", 4.0), ("textual-inversion", "textual_inversion.token", "<new>")],
)
def test_resume_refuses_a_setting_the_trained_weights_depend_on(method, key, value):
    """--resume with another lora.alpha was accepted: the adapters' scale (alpha / rank) changed under the trained
    weights. textual_inversion.token: the word the embedding was trained under."""
    from sdplan.errors import UsageError
    from sdplan.launcher import check_resume_settings
    from sdplan.settings import _put

    saved = config.validate({"method": method})
    data = saved.to_dict()
    _put(data, key, value)
    with pytest.raises(UsageError) as e:
        check_resume_settings(saved, config.validate(data))
    assert str(e.value).startswith(f"--resume: {key} is ")
    check_resume_settings(saved, config.validate({**saved.to_dict(), "lora": {**saved.to_dict()["lora"],
                                                                              "dropout": 0.1}}))  # fmt: skip


GIVEN = ("lora.rank=8", "lora.alpha=4", "training.learning_rate=3e-4", "training.lr_scheduler=cosine",
         "training.seed=5", "sampling.every_steps=50", "checkpoints.every_steps=100")  # fmt: skip


def test_train_shows_every_setting_given(tmp_path, inputs):
    """`sdplan train --dry-run ... lora.rank=8 lora.alpha=4 training.learning_rate=3e-4 ...` printed none of them:
    what the plan lines do not show was taken without a word."""
    r = dry_run(tmp_path, inputs, "lora", *GIVEN)
    assert r.exit_code == 0, r.output
    assert f"settings: {', '.join(GIVEN)}" in r.stdout.splitlines()


def test_recommend_says_every_setting_given_in_its_pinned_reason():
    """The "pinned:" reason listed only the planner's Settings fields: the learning rate, the scheduler, the seed,
    data.buckets and sampling.* were in --json and the written sdplan.yaml, not in the text."""
    r = runner.invoke(
        app, ["recommend", "--method", "lora", "--hardware", "RTX 4090", *GIVEN, "data.buckets=true"]
    )
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    pinned = text[text.index("pinned: ") :].split(" - ")[0]
    assert "lora.rank=8" in pinned and "planned around them" in pinned
    for item in (*GIVEN[2:], "data.buckets=true"):
        assert item in pinned, pinned
    assert pinned.count("lora.alpha=") == 1


def test_recommend_refuses_an_ema_its_counted_steps_never_update(tmp_path, inputs):
    """recommend wrote an sdplan.yaml whose EMA never updates in its steps, which its own `sdplan train --config`
    line then refused; a plan for an assumed image count (no dataset) says nothing: the run's dataset counts."""
    model, ds = inputs
    args = [
        "recommend",
        "--method",
        "finetune",
        "--hardware",
        "H100 SXM",
        "ema.enabled=true",
        "ema.update_every=500",
    ]
    one_line_error(
        runner.invoke(app, [*args, "--model", str(model), "--dataset", str(ds)]), 2, "ema.update_every 500"
    )
    assert runner.invoke(app, args).exit_code == 0


def test_recommend_says_settings_the_plan_does_not_depend_on():
    from sdplan.recommend import given_reasons

    assert given_reasons(("a",), ["training.seed=5"]) == (
        "settings: training.seed=5 (written to the run's sdplan.yaml)",
        "a",
    )
    assert given_reasons(("a",), ["model.path=/m/sd15"]) == (
        "a",
    )  # --model's: the plan's first line names it
    shown = "pinned: distributed.deepspeed={zero_stage: 2} (planned around it)"
    assert given_reasons((shown,), ["distributed.deepspeed.zero_stage=2"]) == (shown,)


def test_lora_targets_no_module_has_are_refused_before_the_launch(tmp_path, inputs):
    """A typo in lora.target_modules passed recommend and the dry run, and the trainer refused it only after the
    model had loaded (a FLUX.1 base: minutes). The family's architecture, built on the meta device, answers first."""
    for targets, said in (
        ("[foo_bar]", "lora.target_modules=['foo_bar']: no module of UNet2DConditionModel has such a name"),
        ("[to_q,to_kk]", "no module of UNet2DConditionModel is named 'to_kk'"),
        ("[attn1]", "'attn1' in UNet2DConditionModel is a Attention, not a layer"),
    ):
        one_line_error(dry_run(tmp_path, inputs, "lora", f"lora.target_modules={targets}"), 2, said)
    r = dry_run(tmp_path, inputs, "lora", "lora.target_modules=[to_q, ff.net.2]")
    assert r.exit_code == 0, r.output
    te = ("training.train_text_encoder=true", "lora.text_encoder_target_modules=[q_proj, o_proj]")
    one_line_error(dry_run(tmp_path, inputs, "lora", *te), 2, "CLIPTextModel is named 'o_proj'")
    # the model's own config, not the family's profile: an LCM UNet's time_embedding.cond_proj, which peft adapts
    import json

    unet = inputs[0] / "unet" / "config.json"
    unet.write_text(json.dumps({**json.loads(unet.read_text()), "time_cond_proj_dim": 8}))
    r = dry_run(tmp_path, inputs, "lora", "lora.target_modules=[to_q, cond_proj]")
    assert r.exit_code == 0, r.output
