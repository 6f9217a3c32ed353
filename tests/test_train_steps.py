"""The pure steps of `sdplan train`: the --out rule, out-of-memory arithmetic, profile observations, demo data."""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from sdplan.config import default_config, validate
from sdplan.errors import ConfigError, OutputExistsError, UsageError
from sdplan.launcher import after_oom, check_out_dir, config_steps, oom_point, record_point

# -- the --out rule -------------------------------------------------------------------------------------------


def test_missing_or_empty_out_is_new(tmp_path):
    assert check_out_dir(tmp_path / "nope") == "new"
    (tmp_path / "empty").mkdir()
    assert check_out_dir(tmp_path / "empty") == "new"


def test_folder_with_user_files_is_refused_even_with_force(tmp_path):
    (tmp_path / "holiday.jpg").write_bytes(b"x")
    for force in (False, True):
        with pytest.raises(OutputExistsError, match="not an sdplan run"):
            check_out_dir(tmp_path, force=force)
    assert (tmp_path / "holiday.jpg").read_bytes() == b"x"


def test_a_users_own_sdplan_yaml_does_not_make_their_folder_a_run(tmp_path):
    """A folder of the user's with their own sdplan.yaml was called "an sdplan run that saved no checkpoint
    (start it over with --force ...)", and --force then refused it for files sdplan did not write."""
    from sdplan import runfolder

    (tmp_path / "sdplan.yaml").write_text("mine\n")
    (tmp_path / "notes.txt").write_text("x")
    for force in (False, True):
        with pytest.raises(OutputExistsError, match="already holds files .* and is not an sdplan run"):
            check_out_dir(tmp_path, force=force)
    runfolder.record(
        tmp_path, ["notes.txt"]
    )  # a manifest that does not list the sdplan.yaml: still the user's
    with pytest.raises(OutputExistsError, match="is not an sdplan run"):
        check_out_dir(tmp_path)
    assert (tmp_path / "sdplan.yaml").read_text() == "mine\n"
    alone = tmp_path / "alone"  # their sdplan.yaml and nothing else: not a plan folder either
    alone.mkdir()
    (alone / "sdplan.yaml").write_text("mine\n")
    with pytest.raises(OutputExistsError, match="is not an sdplan run"):
        check_out_dir(alone)


def test_sdplan_run_needs_force_or_resume(tmp_path):
    from sdplan import runfolder

    runfolder.write_files(tmp_path, {"sdplan.yaml": "method: lora\n"})  # as a run writes it: in its manifest
    (tmp_path / "checkpoints").mkdir()
    runfolder.record(tmp_path, ["checkpoints"])
    # a run that stopped before its first checkpoint: --resume would be refused, so it is not offered
    with pytest.raises(OutputExistsError, match=r"saved no checkpoint \(start it over with --force") as e:
        check_out_dir(tmp_path)
    assert "--resume" not in str(e.value)
    assert check_out_dir(tmp_path, force=True) == "run"
    (tmp_path / "checkpoints" / "step-2").mkdir()
    (tmp_path / "checkpoints" / "step-2" / "train_state.json").write_text("{}")
    with pytest.raises(OutputExistsError, match="--resume, start it over with --force"):
        check_out_dir(tmp_path)
    assert check_out_dir(tmp_path, force=True) == "run"
    assert check_out_dir(tmp_path, resume=True) == "run"
    # a file of the user's in it: --force is refused until it is moved out, and offered so
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(
        OutputExistsError, match=r"move notes.txt \(not sdplan's\) out and start it over with --force"
    ):
        check_out_dir(tmp_path)
    with pytest.raises(OutputExistsError, match=r"did not write \(notes.txt\)"):
        check_out_dir(tmp_path, force=True)


def test_a_folder_without_a_manifest_is_a_run_only_by_a_checkpoint_that_resume_continues(tmp_path):
    """A user's folder holding their own sdplan.yaml and a checkpoints/ folder (no manifest: nothing in it is
    provably sdplan's) was "an sdplan run that saved no checkpoint (start it over with --force ...)", and --force
    then refused it for files sdplan did not write. A run from before the manifest is a run by its checkpoint:
    --resume continues it; --force, which would be refused, is not offered."""
    from sdplan import runfolder

    (tmp_path / "sdplan.yaml").write_text("precious\n")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "x").write_text("mine")
    (tmp_path / runfolder.LOCK_FILE).write_text("{}")  # a stale lock: no mark of a run either
    for extra in ([], ["run_summary.json"]):
        for name in extra:
            (tmp_path / name).write_text("{}")
        for force in (False, True):
            with pytest.raises(
                OutputExistsError, match=r"already holds files \(checkpoints, .*and is not an sdplan"
            ):
                check_out_dir(tmp_path, force=force)
    state = tmp_path / "checkpoints" / "step-2" / "train_state.json"
    state.parent.mkdir()
    state.write_text("{}")
    with pytest.raises(
        OutputExistsError, match=r"holds an sdplan run \(continue it with --resume, or choose a new"
    ):
        check_out_dir(tmp_path)
    with pytest.raises(OutputExistsError, match="did not write"):
        check_out_dir(tmp_path, force=True)
    assert check_out_dir(tmp_path, resume=True) == "run"
    assert (tmp_path / "sdplan.yaml").read_text() == "precious\n"
    assert (tmp_path / "checkpoints" / "x").read_text() == "mine"


def test_resume_needs_an_sdplan_run(tmp_path):
    with pytest.raises(UsageError, match="not an sdplan run"):
        check_out_dir(tmp_path, resume=True)


def test_a_planned_folder_trains_its_own_config(tmp_path):
    """`sdplan recommend --out DIR` then `sdplan train --config DIR/sdplan.yaml --out DIR` is not refused."""
    (tmp_path / "sdplan.yaml").write_text("method: lora\n")
    (tmp_path / "accelerate.yaml").write_text("distributed_type: 'NO'\n")
    assert check_out_dir(tmp_path, config_path=tmp_path / "sdplan.yaml") == "planned"
    # ... but not once it holds training outputs, and not for another config.
    other = tmp_path.parent / "other.yaml"
    other.write_text("method: lora\n")
    with pytest.raises(OutputExistsError):
        check_out_dir(tmp_path, config_path=other)
    (tmp_path / "run_summary.json").write_text("{}")
    with pytest.raises(OutputExistsError):
        check_out_dir(tmp_path, config_path=tmp_path / "sdplan.yaml")


def test_out_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(OutputExistsError, match="is a file"):
        check_out_dir(f)


# -- out-of-memory recovery ----------------------------------------------------------------------------------


def data(**sections):
    d = default_config()
    for k, v in sections.items():
        d[k].update(v)
    return d


@pytest.mark.parametrize(
    ("b", "ga", "nb", "nga"), [(8, 1, 4, 2), (4, 3, 2, 6), (6, 1, 3, 2), (3, 2, 1, 6), (2, 1, 1, 2)]
)
def test_oom_halves_the_micro_batch_keeping_the_effective_batch(b, ga, nb, nga):
    change = after_oom(
        data(training={"batch_size": b, "grad_accum": ga}), cuda=True, have_bnb=True, have_deepspeed=True
    )
    t = change.data["training"]
    assert (t["batch_size"], t["grad_accum"]) == (nb, nga)
    assert t["batch_size"] * t["grad_accum"] == b * ga
    assert f"micro-batch {b} -> {nb}" in change.message
    validate(change.data)


def test_at_batch_one_the_memory_savers_come_in_order():
    d = data(training={"batch_size": 1, "grad_accum": 4}, ema={"enabled": True, "device": "gpu"})
    d["method"] = "finetune"  # the method that keeps an EMA
    seen = []
    while (change := after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True)) is not None:
        validate(change.data)  # every step is a valid config
        seen.append(change.message.split(" (")[0])
        d = change.data
        assert d["training"]["batch_size"] == 1 and d["training"]["grad_accum"] == 4
    assert seen == [
        "moved the EMA weights to system RAM",
        "turned on gradient checkpointing",
        "switched to 8-bit AdamW",
        "turned on latent caching",
        "turned on text-encoder output caching",
        "turned on DeepSpeed ZeRO-2 with the optimizer state offloaded to CPU",
    ]
    # 8-bit Adam does not combine with DeepSpeed: the last step puts AdamW back.
    assert d["memory"]["optimizer"] == "adamw"
    assert d["distributed"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}


def test_the_offload_step_of_an_adafactor_run_says_adamw_takes_its_place():
    """accelerate hands the offload DeepSpeed's CPU Adam in place of any other optimizer (Adafactor became an
    Adam at Adafactor's learning rate, silently): sdplan.config refuses the pair, and the out-of-memory retry that
    turns the offload on switches to AdamW and says so."""
    d = data(training={"batch_size": 1, "grad_accum": 4})
    d["method"] = "finetune"
    d["memory"].update(
        optimizer="adafactor",
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=True,
    )
    change = after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True)
    validate(change.data)
    assert change.data["memory"]["optimizer"] == "adamw"
    assert change.data["distributed"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}
    assert "AdamW in place of Adafactor, as the offload runs DeepSpeed's CPU Adam" in change.message
    d["distributed"]["deepspeed"] = {"zero_stage": 2, "offload_optimizer": True}
    with pytest.raises(ConfigError, match="adafactor with distributed.deepspeed.offload_optimizer"):
        validate(d)
    d["distributed"]["deepspeed"]["offload_optimizer"] = (
        False  # sharded on the GPUs: the optimizer is its own
    )
    validate(d)


def test_out_of_memory_before_the_first_step_tries_only_what_changes_the_setup():
    """An out-of-memory error while the models load or the captions encode (trainer/__main__.py: step 0) was
    retried at a halved batch, with checkpointing, 8-bit AdamW and the latent cache, each retry reloading the
    models for nothing: none of them changes what setup holds. Only the savers that do are tried."""
    d = data(training={"batch_size": 8, "grad_accum": 1}, ema={"enabled": True, "device": "gpu"})
    d["method"] = "finetune"
    seen = []
    while (
        change := after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True, before_training=True)
    ) is not None:
        validate(change.data)
        seen.append(change.message.split(" (")[0])
        d = change.data
    assert seen == [
        "moved the EMA weights to system RAM",
        "turned on text-encoder output caching",
        "turned on DeepSpeed ZeRO-2 with the optimizer state offloaded to CPU",
    ]
    assert d["training"]["batch_size"] == 8 and not d["memory"].get("gradient_checkpointing")
    # block swap runs in one process without DeepSpeed (blockswap.support_problem): never offered with it
    swap = data(training={"batch_size": 1}, memory={"gradient_checkpointing": True, "blocks_to_swap": 8})
    while (change := after_oom(swap, cuda=True, have_bnb=False, have_deepspeed=True)) is not None:
        swap = change.data
    assert swap["distributed"].get("deepspeed") is None


def test_a_full_unet_method_in_bf16_tries_full_bf16_weights_before_offload():
    """The planner's order: full bf16 weights (no fp32 master copy) before DeepSpeed offload (the optimizer on the CPU)."""
    d = data(training={"batch_size": 1, "precision": "bf16"}, memory={"gradient_checkpointing": True})
    d["method"] = "finetune"
    seen = []
    while (change := after_oom(d, cuda=True, have_bnb=False, have_deepspeed=True)) is not None:
        validate(change.data)
        seen.append(change.message.split(" (")[0])
        d = change.data
    assert seen[-2:] == [
        "switched to full bf16 weights and gradients",
        "turned on DeepSpeed ZeRO-2 with the optimizer state offloaded to CPU",
    ]
    # DeepSpeed keeps fp32 master weights of its own: the full bf16 step is undone (it stayed on, as if it held)
    assert d["training"]["full_half_weights"] is False
    # fp16 weights would underflow; LoRA trains no UNet weights: neither gets this step.
    for method, precision in (("finetune", "fp16"), ("lora", "bf16")):
        d = data(training={"batch_size": 1, "precision": precision}, memory={"gradient_checkpointing": True})
        d["method"] = method
        while (change := after_oom(d, cuda=True, have_bnb=False, have_deepspeed=True)) is not None:
            assert "full bf16" not in change.message
            d = change.data


def test_a_plans_split_zero2_offloads_its_optimizer_state_last():
    """A plan's DeepSpeed ZeRO-2 without offload (the optimizer state split over the GPUs) that runs out of memory
    at batch 1 with every saver on ends with the state offloaded to the CPU; an offloading one has nothing left."""
    d = data(training={"batch_size": 1, "precision": "bf16"}, memory={"gradient_checkpointing": True})
    d["method"] = "finetune"
    d["distributed"] = {"num_processes": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": False}}
    seen = []
    while (change := after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True)) is not None:
        validate(change.data)
        seen.append(change.message.split(" (")[0])
        d = change.data
    assert seen[-1] == "offloaded the split optimizer state of DeepSpeed ZeRO-2 to CPU"
    assert "switched to 8-bit AdamW" not in seen and not any("full bf16" in m for m in seen)
    assert d["distributed"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}
    d["distributed"]["deepspeed"] = {"zero_stage": 2}  # the config's default offloads
    assert after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True) is None


def test_no_8bit_adam_on_cpu_or_without_bitsandbytes_and_no_deepspeed_without_it():
    d = data(training={"batch_size": 1}, memory={"gradient_checkpointing": True})
    for kwargs in ({"cuda": False, "have_bnb": True}, {"cuda": True, "have_bnb": False}):
        change = after_oom(d, have_deepspeed=False, **kwargs)
        assert change.data["memory"]["optimizer"] == "adamw"
        assert change.data["memory"]["cache_latents"] is True
    d["memory"].update(cache_latents=True, cache_text_encoder_outputs=True)
    assert after_oom(d, cuda=True, have_bnb=False, have_deepspeed=False) is None


def test_text_encoder_outputs_are_not_cached_while_the_encoder_trains():
    d = data(
        training={"batch_size": 1, "train_text_encoder": True},
        memory={"gradient_checkpointing": True, "cache_latents": True},
    )
    change = after_oom(d, cuda=False, have_bnb=False, have_deepspeed=True)
    assert change.data["memory"]["cache_text_encoder_outputs"] is False
    assert change.data["distributed"]["deepspeed"] is not None


# -- the observation in the local profile store ------------------------------------------------------------


def test_oom_observation_is_a_valid_local_profile_point(tmp_path):
    from sdplan.profiles import load_methods

    cfg = validate(
        data(training={"batch_size": 4, "grad_accum": 1, "precision": "bf16"}, data={"resolution": 512})
    )
    oom = {
        "step": 3,
        "batch_size": 4,
        "grad_accum": 1,
        "gradient_checkpointing": False,
        "message": "CUDA out of memory.",
    }
    when = dt.datetime(2026, 1, 2, 3, 4, 5)
    point = oom_point(
        cfg, oom, family="sd15", gpu_name="NVIDIA GeForce RTX 3060", gpu_memory_bytes=12 * 2**30, when=when
    )
    path = record_point(point, "lora", tmp_path)
    assert path == tmp_path / "methods" / "observed-lora.yaml"
    # A second observation appends (and keeps ids unique).
    record_point(dict(point), "lora", tmp_path)
    points, _ = load_methods(path, origin="local")
    assert len(points) == 2 and len({p.id for p in points}) == 2
    p = points[0]
    assert (p.model, p.resolution, p.batch, p.grad_accum, p.precision) == ("sd15", 512, 4, 1, "bf16")
    assert p.gpu == "NVIDIA GeForce RTX 3060"
    assert p.outcome == {"fits": False}
    assert p.options.gradient_checkpointing is False and p.options.lora_rank == 16
    assert "2026-01-02T03:04:05" in p.source and "out of memory at step 3" in p.source
    raw = yaml.safe_load(path.read_text())
    assert raw["points"][0]["gpu_memory_gib"] == 12.0


# -- step arithmetic -----------------------------------------------------------------------------------------


def test_step_arithmetic_splits_epochs_over_processes():
    cfg = validate(data(training={"batch_size": 2, "grad_accum": 2, "epochs": 3}))
    one = config_steps(cfg, 40, 1)
    two = config_steps(cfg, 40, 2)
    assert one["steps_per_epoch"] == 10 and one["total_steps"] == 30
    assert two["steps_per_epoch"] == 5 and two["total_steps"] == 15
    assert one["images_seen"] == two["images_seen"] == 120


def test_step_arithmetic_with_max_steps():
    cfg = validate(data(training={"batch_size": 2, "max_steps": 10}))
    s = config_steps(cfg, 8, 2)
    assert s["total_steps"] == 5 and s["images_seen"] == 20


# -- demo data ---------------------------------------------------------------------------------------------------


def test_demo_dataset_is_a_captioned_flat_dataset(tmp_path):
    from sdplan.trainer.dataset_scan import scan

    from sdplan.demo import make_dataset

    make_dataset(tmp_path / "ds", n=8)
    result = scan(tmp_path / "ds", verify=True)
    assert result.format == "flat"
    assert result.num_images == 8 and result.num_captioned == 8 and not result.skipped
    captions = sorted({it.caption for it in result.items})
    assert "a photo of sks red square" in captions and "a photo of sks blue circle" in captions
    # Every caption word is one token of the tiny tokenizer.
    from sdplan.trainer.tiny import DEMO_WORDS

    assert {w for c in captions for w in c.split()} <= set(DEMO_WORDS)


# -- planning, confirming ----------------------------------------------------------------------------------


def _fake_model(root):
    from conftest import fake_diffusers_folder

    return fake_diffusers_folder(root)


def test_plan_mode_uses_the_planner_and_overrides_win(tmp_path):
    from pathlib import Path

    from conftest import make_images

    from sdplan.launcher import UI, TrainRequest, prepare
    from sdplan.machine import Snapshot

    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "t4.json")
    model = _fake_model(tmp_path / "m")
    ds = make_images(tmp_path / "ds", n=4)
    base = dict(model=str(model), dataset=str(ds), out=str(tmp_path / "o"), epochs=3, snapshot=snap)
    planned = prepare(TrainRequest(**base), UI(echo=lambda s: None))
    assert planned.plan is not None and planned.plan["feasible"]
    p = planned.plan["plan"]
    t = planned.cfg.training
    assert (t.batch_size, t.grad_accum, t.precision) == (p["batch_size"], p["grad_accum"], p["precision"])
    assert t.precision == "fp16"  # a T4 has no bf16
    assert planned.cfg.plan["schema_version"] == 1  # the plan travels in sdplan.yaml
    assert planned.steps["images_per_epoch"] == 4 and planned.steps["epochs"] == 3
    overridden = prepare(
        TrainRequest(**base, overrides=["training.batch_size=3", "training.precision=fp32"]),
        UI(echo=lambda s: None),
    )
    assert (overridden.cfg.training.batch_size, overridden.cfg.training.precision) == (3, "fp32")


def test_no_confirmation_means_nothing_is_written(tmp_path):
    from conftest import make_images

    from sdplan.launcher import UI, Cancelled, TrainFailed, TrainRequest, run

    model = _fake_model(tmp_path / "m")
    ds = make_images(tmp_path / "ds", n=2)
    asked = []

    def confirm(question):
        asked.append(question)
        return False

    req = TrainRequest(model=str(model), dataset=str(ds), out=str(tmp_path / "o"), device="cpu")
    with pytest.raises(Cancelled):
        run(req, UI(echo=lambda s: None, confirm=confirm))
    assert asked == ["Start training?"]
    assert not (tmp_path / "o").exists()
    # --yes never asks: the run goes on to the trainer, which fails on this weightless model with its own
    # exit code (one line from the trainer, then ours).
    req.yes = True
    with pytest.raises(TrainFailed) as err:
        run(req, UI(echo=lambda s: None, confirm=lambda q: pytest.fail("asked despite --yes")))
    assert err.value.exit_code not in (0, 75, 130)
    assert (tmp_path / "o" / "sdplan.yaml").is_file()


def test_resume_of_a_finished_run_is_refused_but_an_unfinished_one_is_not(tmp_path):
    """`train --resume` of a finished run loaded the model, cached the latents, trained nothing and wrote the
    same outputs again. It is one line now, unless the config asks for more images, or an output is missing
    (a run stopped between its last checkpoint and its outputs)."""
    import json

    from sdplan.trainer.checkpoint import latest_checkpoint

    from sdplan import config as C
    from sdplan.launcher import InputSummary, checkpoint_step, config_steps, refuse_a_finished_resume

    ckpt = tmp_path / "checkpoints" / "rolling-step-000016"
    ckpt.mkdir(parents=True)
    state = {"images_seen": 32, "global_step": 16, "epoch": 2, "batch_size": 2}
    (ckpt / "train_state.json").write_text(json.dumps(state))
    lora = tmp_path / "pytorch_lora_weights.safetensors"
    lora.write_bytes(b"x")
    summary = {"steps": 16, "images_seen": 32, "outputs": [str(lora)]}
    (tmp_path / "run_summary.json").write_text(json.dumps(summary))
    inputs = InputSummary(
        images=16, images_x_repeats=16, skipped=0, model_kind="folder", family="sd15", scan_summary=""
    )

    def refuse(epochs: int) -> None:
        data = C.default_config()
        data["training"].update(batch_size=2, grad_accum=1, epochs=epochs, max_steps=None)
        cfg = C.validate(data)
        last = latest_checkpoint(tmp_path)
        refuse_a_finished_resume(
            tmp_path, checkpoint_step(last, cfg, inputs, 1), cfg, 1, config_steps(cfg, 16, 1)
        )

    with pytest.raises(
        UsageError,
        match=r"is finished: its newest checkpoint stands at step .* of the .*32 images trained.*--epochs N",
    ):
        refuse(2)
    refuse(3)  # --epochs 3: more to train
    lora.unlink()
    refuse(2)  # its outputs are not all there: the export again


def test_extending_a_run_that_finished_with_checkpoints_off_says_why_it_cannot(tmp_path):
    """A run with checkpoints off, Ctrl-C'd and resumed, finished and removed the interrupt checkpoint it had
    passed (and now the checkpoints folder left empty). `--resume --epochs 3` then said "no checkpoint ... add
    --force to reuse the folder", which throws the finished run away without a word. It says now that the run
    finished with checkpoints off, so no state was kept to extend from, and what the choices are."""
    import json

    from conftest import make_images
    from sdplan.trainer import checkpoint

    from sdplan.launcher import UI, TrainRequest, run
    from sdplan.runfolder import record

    out = tmp_path / "run"
    out.mkdir()
    cfg = default_config()
    cfg["model"]["path"] = str(_fake_model(tmp_path / "m"))
    cfg["data"]["path"] = str(make_images(tmp_path / "ds", n=2))
    cfg["output"]["dir"] = str(out)
    cfg["checkpoints"]["every_steps"] = 0
    (out / "sdplan.yaml").write_text(yaml.safe_dump(cfg))
    (out / "run_summary.json").write_text(json.dumps({"steps": 16, "images_seen": 32, "outputs": []}))
    passed = checkpoint.checkpoint_root(out) / "interrupt-step-000005"
    passed.mkdir(parents=True)
    (passed / "train_state.json").write_text(json.dumps({"images_seen": 10}))
    record(out, ["sdplan.yaml", "run_summary.json", "checkpoints"])
    assert checkpoint.remove_passed(out, 32) == [passed]  # the finish
    assert not checkpoint.checkpoint_root(out).exists()
    req = TrainRequest(resume=True, out=str(out), device="cpu", yes=True, epochs=3)
    with pytest.raises(UsageError) as err:
        run(req, UI(echo=lambda s: None))
    assert "finished (16 steps, 32 images) with checkpoints off" in str(err.value)
    assert "--force" in err.value.fix and "replaces the finished run's outputs" in err.value.fix
    assert "--out NEW_DIR --epochs N" in err.value.fix


def test_an_interrupted_run_under_sdplan_says_the_one_resume_command(monkeypatch, tmp_path):
    """The trainer said "continue with --resume latest" (its own command line), and sdplan right after "continue
    with `sdplan train --resume --out DIR`": `sdplan train --resume latest` then failed on 'latest'."""
    from sdplan.trainer.stops import TrainingInterrupted

    ckpt = tmp_path / "run" / "checkpoints" / "interrupt-step-000020"
    monkeypatch.setenv("SDPLAN_LAUNCHED", "1")
    assert f"continue with `sdplan train --resume --out {tmp_path / 'run'}`" in str(
        TrainingInterrupted(20, ckpt)
    )
    monkeypatch.delenv("SDPLAN_LAUNCHED")
    assert "continue with --resume latest" in str(TrainingInterrupted(20, ckpt))


def test_oom_offloads_a_zero1_split_naming_its_own_stage():
    """A ZeRO-1 run without offload that runs out of memory is offloaded as ZeRO-2 (the planner's offload); the
    message named the split it had as ZeRO-2."""
    d = data(
        training={"batch_size": 1, "precision": "bf16"},
        memory={"gradient_checkpointing": True, "cache_latents": True, "cache_text_encoder_outputs": True},
        distributed={"deepspeed": {"zero_stage": 1, "offload_optimizer": False}, "num_processes": 2},
    )
    d["method"] = "finetune"
    change = after_oom(d, cuda=True, have_bnb=True, have_deepspeed=True)
    assert change.data["distributed"]["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}
    assert "DeepSpeed ZeRO-1 to CPU (ZeRO-2 offload)" in change.message, change.message
    validate(change.data)


# -- a trainer process leaves out the libraries its run does not use ---------------------------------------------


@pytest.mark.parametrize(
    "overrides, left_out",
    [
        ([], {"bitsandbytes", "deepspeed"}),
        (["memory.optimizer=adamw8bit"], {"deepspeed"}),
        (["model.base_precision=nf4"], {"deepspeed"}),
        (["distributed.deepspeed.zero_stage=2"], {"bitsandbytes"}),
    ],
)
def test_a_trainer_process_leaves_out_bitsandbytes_and_deepspeed_where_its_run_uses_neither(
    overrides, left_out, monkeypatch
):
    """diffusers imports bitsandbytes with itself and accelerate imports DeepSpeed to unwrap any model, about
    3 s of each trainer process's start: a run that uses neither marks them absent; one that uses one keeps it."""
    from sdplan.trainer.__main__ import _leave_out_unused_libraries

    from sdplan.config import apply_overrides

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    modules: dict = {}
    _leave_out_unused_libraries(validate(apply_overrides(default_config(), overrides)), modules)
    assert modules == dict.fromkeys(left_out)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # `accelerate launch --use_deepspeed`
    launched: dict = {}
    _leave_out_unused_libraries(validate(apply_overrides(default_config(), overrides)), launched)
    assert launched == dict.fromkeys(left_out - {"deepspeed"})
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    imported = {"deepspeed": object()}  # one already imported stays
    _leave_out_unused_libraries(validate(default_config()), imported)
    assert imported["deepspeed"] is not None and imported["bitsandbytes"] is None


def test_a_library_marked_absent_is_absent_to_the_checks_the_libraries_make(monkeypatch):
    """None in sys.modules: ``find_spec`` (diffusers', accelerate's and peft's availability checks) answers None
    and an import fails, as for a library that is not installed."""
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert importlib.util.find_spec("bitsandbytes") is None
    with pytest.raises(ImportError):
        import bitsandbytes  # noqa: F401


def test_a_nan_loss_in_fp16_on_a_gtx_16_card_says_to_train_in_fp32():
    """fp16 mixed precision gives NaN losses on GTX 16 cards: a NaN loss there names that cause and fp32 (a pinned
    fp16 is the only way such a run trains in fp16); elsewhere the fp16 advice stays."""
    from pathlib import Path

    from sdplan.trainer.stops import nonfinite_error

    from sdplan.config import apply_overrides

    cfg = validate(apply_overrides(default_config(), ["training.precision=fp16"]))
    gtx = nonfinite_error(7, cfg, Path("ck"), device=("NVIDIA GeForce GTX 1660 SUPER", "7.5"))
    assert "fp16 mixed precision on NVIDIA GeForce GTX 1660 SUPER" in str(gtx) and "ck" in str(gtx)
    assert gtx.fix == "train with training.precision=fp32 (what sdplan plans on GTX 16 cards)"
    for device in (("NVIDIA GeForce RTX 2080 Ti", "7.5"), (None, None)):
        other = nonfinite_error(7, cfg, None, device=device)
        assert "fp16 overflow" in str(other) and "bf16" in other.fix


def test_train_stops_before_anything_where_torch_has_no_kernels_for_the_gpus():
    """A GTX 1080 Ti under torch 2.8 cu128 (PyTorch dropped Pascal from those wheels): `sdplan train` says so and
    which build to install, before loading anything; a T4 under cu124 goes on."""
    import dataclasses
    from pathlib import Path

    from sdplan.errors import NoGPUError
    from sdplan.launcher import require_gpu
    from sdplan.machine import Snapshot

    t4 = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "t4.json")
    require_gpu(t4)
    pascal = dataclasses.replace(t4.gpus[0], name="NVIDIA GeForce GTX 1080 Ti", compute_capability="6.1")
    sw = dataclasses.replace(t4.software, torch="2.8.0+cu128", cuda_runtime="12.8", cuda_driver="12.9")
    with pytest.raises(NoGPUError, match=r"has no CUDA kernels for NVIDIA GeForce GTX 1080 Ti") as err:
        require_gpu(dataclasses.replace(t4, gpus=(pascal,), software=sw))
    assert err.value.fix.endswith("whl/cu126")
    # one GPU it has kernels for: the run goes on (the plan picks among the GPUs)
    require_gpu(dataclasses.replace(t4, gpus=(pascal, dataclasses.replace(t4.gpus[0], index=1)), software=sw))


def test_train_stops_where_torch_has_no_kernels_for_the_nvidia_gpu_beside_an_amd_igpu():
    """An RTX 5090 Laptop (Blackwell) under torch 2.7 cu126 beside the laptop's AMD Radeon 890M: a CUDA build
    never trains on the iGPU, so the run has no GPU it can use and stops, as doctor's torch_arch_unsupported
    error says; the iGPU let it start. require_gpu judges the GPUs doctor and the planner do (trained_gpus)."""
    import dataclasses
    from pathlib import Path

    from sdplan.errors import NoGPUError
    from sdplan.launcher import require_gpu
    from sdplan.machine import Snapshot

    t4 = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "t4.json")
    blackwell = dataclasses.replace(
        t4.gpus[0],
        name="NVIDIA GeForce RTX 5090 Laptop GPU",
        compute_capability="12.0",
        driver_version="570.86.10",
    )
    igpu = dataclasses.replace(
        t4.gpus[0], index=1, vendor="amd", name="AMD Radeon 890M", compute_capability=None, gfx_arch="gfx1150"
    )
    igpu = dataclasses.replace(igpu, memory_total_bytes=512 * 2**20, memory_free_bytes=400 * 2**20)
    sw = dataclasses.replace(t4.software, torch="2.7.0+cu126", cuda_runtime="12.6", cuda_driver="12.8")
    for gpus in ((blackwell,), (blackwell, igpu)):
        with pytest.raises(NoGPUError, match=r"has no CUDA kernels for NVIDIA GeForce RTX 5090 Laptop GPU"):
            require_gpu(dataclasses.replace(t4, gpus=gpus, software=sw))
    # a CUDA build on a machine whose GPUs are all AMD trains on none of them: doctor's torch_build_mismatch
    amd = dataclasses.replace(t4, gpus=(dataclasses.replace(igpu, index=0),), software=sw)
    with pytest.raises(NoGPUError, match=r"is a CUDA build but this machine's GPUs need ROCm"):
        require_gpu(amd)


CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]  # PyTorch's cu126 wheels
CU128 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


@pytest.mark.parametrize(
    ("arches", "capability", "need"),
    [
        (CU126, (6, 1), None),  # sm_60's code runs on 6.1
        (CU126, (8, 9), None),  # sm_86's on Ada
        (CU126, (12, 0), "CUDA 12.8 or newer"),  # RTX 5090
        (CU128, (6, 1), "CUDA 12.6"),  # GTX 1080 Ti
        (CU128, (12, 1), None),
        (["sm_80", "compute_90"], (12, 0), None),  # PTX the driver compiles
        (["sm_90a", "sm_100f"], (9, 0), None),
        (["gfx90a"], (9, 0), None),  # a form not known: not judged
    ],
)
def test_the_trainer_says_which_build_a_gpu_without_kernels_needs(monkeypatch, arches, capability, need):
    import torch
    from sdplan.trainer.runtime import check_cuda_kernels

    from sdplan.errors import NoGPUError

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arches)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GPU")
    if need is None:
        check_cuda_kernels("cuda:0")
        return
    with pytest.raises(
        NoGPUError, match=r"has no CUDA kernels for NVIDIA GeForce GPU \(compute capability"
    ) as e:
        check_cuda_kernels("cuda:0")
    assert f"torch built for {need}" in e.value.fix


def test_the_oom_retry_halves_the_batch_the_trainer_formed():
    """Batch 64 over 20 images is a batch of 20: halved to 32 (the same batch of 20), the retry reloaded the models
    and ran out again, and said '64 images per optimizer step'."""
    change = after_oom(
        {"training": {"batch_size": 64, "grad_accum": 1}},
        cuda=True,
        have_bnb=True,
        have_deepspeed=False,
        largest=20,
    )
    assert (change.data["training"]["batch_size"], change.data["training"]["grad_accum"]) == (10, 2)
    assert (
        "a batch held at most 20 images" in change.message
        and "64 images per optimizer step" not in change.message
    )
    same = after_oom(
        {"training": {"batch_size": 8, "grad_accum": 1}},
        cuda=True,
        have_bnb=True,
        have_deepspeed=False,
        largest=20,
    )
    assert (same.data["training"]["batch_size"], same.data["training"]["grad_accum"]) == (4, 2)
    assert "still 8 images per optimizer step" in same.message


def test_the_oom_retry_halves_a_prime_buckets_batch_not_down_to_one():
    """Batch 8 whose largest aspect bucket holds 5: halved by divisors, 5 went straight to 1 (accumulation 5)."""
    change = after_oom(
        {"training": {"batch_size": 8, "grad_accum": 1}},
        cuda=True,
        have_bnb=True,
        have_deepspeed=False,
        largest=5,
    )
    assert (change.data["training"]["batch_size"], change.data["training"]["grad_accum"]) == (3, 2)
    assert "a batch held at most 5 images" in change.message
