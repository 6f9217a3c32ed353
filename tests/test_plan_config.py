"""`sdplan train` trains what the planner chose: in plan mode it writes the same settings `recommend --out` writes.

Both go through one translation (planner result -> Settings -> sdplan.yaml); this checks it end to end, for
every method x family on several fixture machines, with nothing launched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import yaml
from conftest import fake_diffusers_folder, make_images
from typer.testing import CliRunner

from sdplan import config as C
from sdplan import registry
from sdplan.cli import app
from sdplan.errors import UsageError
from sdplan.launcher import NotFeasible
from sdplan.machine import Snapshot
from sdplan.profiles import load_profiles
from sdplan.registry import METHODS, PLANNED_FAMILIES
from sdplan.settings import Settings

MACHINES = Path(__file__).parent / "fixtures" / "machines"
HAVE_BNB = importlib.util.find_spec("bitsandbytes") is not None
IMAGES = 13
EPOCHS = 3
NAMES = ("rtx3060_12gb", "2x_rtx4090_pcie", "t4", "8x_h100_sxm")


def fake_model(root: Path, family: str) -> Path:
    """A diffusers folder with the family's config files and no weights (loading it would fail)."""
    if family in registry.FLOW_FAMILIES:  # SD3.5 / FLUX.1: the transformer's config
        return fake_diffusers_folder(root, family, denoiser=load_profiles().model(family).transformer)
    return fake_diffusers_folder(root, family)


@pytest.fixture(scope="module")
def machines(tmp_path_factory) -> dict[str, Path]:
    """The fixture machines with a GPU build of torch (some were saved with a CPU build, which `sdplan train`
    refuses before planning), and a one-GPU RTX 4090 machine (the 2x machine with its first GPU only)."""
    root = tmp_path_factory.mktemp("machines")
    snaps = {name: Snapshot.load(MACHINES / f"{name}.json") for name in NAMES}
    two = snaps["2x_rtx4090_pcie"]
    snaps["rtx4090"] = dataclasses.replace(two, gpus=two.gpus[:1], links=())
    out = {}
    for name, snap in snaps.items():
        if snap.software.torch_build == "cpu":
            snap = dataclasses.replace(snap, software=dataclasses.replace(snap.software, torch_build="cuda"))
        out[name] = root / f"{name}.json"
        snap.save(out[name])
    return out


@pytest.fixture
def no_chart_pixels(monkeypatch):
    """test_train_writes_the_settings_recommend_writes compares the configs the two commands write, for ~135
    cases. Drawing both plan.png files of each (matplotlib, ~0.5-0.9 s a chart) was a third of this file's time:
    the chart's data is still computed from each plan (plan_chart.chart_data), and the drawing is tested by
    test_a_planned_run_draws_its_plan_beside_its_config below and test_recommend.py's plan.png tests."""
    from sdplan import plan_chart

    monkeypatch.setattr(plan_chart, "render_png", lambda data: b"not drawn in this test")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "ds", n=IMAGES)


def recommend_config(
    tmp: Path, machine: Path, method: str, family: str, dataset: Path, pins: tuple[str, ...] = ()
) -> dict | None:
    out = tmp / "recommended"
    args = ["recommend", "--method", method, "--model", family, "--machine", str(machine)]
    args += ["--dataset", str(dataset), "--epochs", str(EPOCHS), "--out", str(out), *pins]
    r = CliRunner().invoke(app, args)
    if "[bold red]does not fit" in r.output or "does not fit:" in r.output:
        assert not out.exists(), r.output
        return None
    assert r.exit_code == 0, r.output
    return yaml.safe_load((out / "sdplan.yaml").read_text())


def train_plan_config(
    tmp: Path, machine: Path, method: str, family: str, dataset: Path, pins: tuple[str, ...] = ()
) -> dict:
    """`sdplan train --method M --model DIR --dataset DIR --epochs N --out DIR` planned on ``machine``, and the
    sdplan.yaml it writes before launching (run() writes exactly these files, then launches)."""
    from sdplan.launcher import UI, TrainRequest, command_line, launch_for, prepare, write_run_files

    req = TrainRequest(
        method=method,
        model=str(fake_model(tmp / "model", family)),
        dataset=str(dataset),
        out=str(tmp / "run"),
        epochs=EPOCHS,
        snapshot=Snapshot.load(machine),
        yes=True,
        overrides=list(pins),
    )
    p = prepare(req, UI(echo=lambda line: None))
    assert p.plan is not None, "plan mode: the planner chose the settings"
    write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out))
    return yaml.safe_load((p.out / "sdplan.yaml").read_text())


def planned(data: dict) -> Settings:
    return Settings.from_config(data)


# the methods the planner plans for each family (SD3.5 / FLUX.1: LoRA, DreamBooth, full fine-tune; textual
# inversion is refused by both commands with "not supported for this family": tests/test_plan_flow.py)
CASES = [
    (m, method, family)
    for m in (*NAMES, "rtx4090")
    for method in METHODS
    for family in PLANNED_FAMILIES
    if registry.family(family).plans(method)
]


@pytest.mark.usefixtures("no_chart_pixels")
@pytest.mark.parametrize(("machine", "method", "family"), CASES)
def test_train_writes_the_settings_recommend_writes(tmp_path, machines, dataset, machine, method, family):
    recommended = recommend_config(tmp_path, machines[machine], method, family, dataset)
    if recommended is None:  # nothing fits: train refuses with the planner's reason, and writes nothing
        with pytest.raises(NotFeasible, match="GPU"):
            train_plan_config(tmp_path, machines[machine], method, family, dataset)
        assert not (tmp_path / "run").exists()
        return
    want = planned(recommended)
    if want.base_precision != "bf16":  # the fixtures' packages (diffusers 0.31, no or an old bitsandbytes)
        # cannot hold a quantized base: train stops before launch
        with pytest.raises(UsageError, match=r"base_precision (fp8|nf4) needs"):
            train_plan_config(tmp_path, machines[machine], method, family, dataset)
        assert not (tmp_path / "run").exists()
        return
    trained = train_plan_config(tmp_path, machines[machine], method, family, dataset)
    if want.optimizer == "adamw8bit" and not HAVE_BNB:
        want = dataclasses.replace(
            want, optimizer="adamw"
        )  # train's documented fallback without bitsandbytes
    assert planned(trained) == want
    assert trained["plan"]["plan"] == recommended["plan"]["plan"]


def test_sdxl_finetune_on_rtx4090_trains_with_full_half_weights(tmp_path, machines, dataset):
    """The plan fits a 24 GB card only with bf16 master weights; the config `sdplan train` runs must say so
    (it used to drop them and train fp32 weights that the plan says do not fit)."""
    recommended = recommend_config(tmp_path, machines["rtx4090"], "finetune", "sdxl", dataset)
    trained = train_plan_config(tmp_path, machines["rtx4090"], "finetune", "sdxl", dataset)
    assert recommended["training"]["full_half_weights"] is True
    assert trained["training"]["full_half_weights"] is True
    assert trained["training"]["precision"] == "bf16"
    assert trained["distributed"]["deepspeed"] is None
    cfg = C.validate(trained)
    assert cfg.training.full_half_weights and cfg.distributed.num_processes == 1


def test_a_planned_run_draws_its_plan_beside_its_config(tmp_path, machines, dataset):
    """`sdplan train` that planned writes plan.png with its sdplan.yaml, as `recommend --out` does, and records
    it as sdplan's own (a later --force may replace it); a run given a config did not plan and draws none."""
    from sdplan import runfolder
    from sdplan.launcher import (
        UI,
        TrainRequest,
        command_line,
        launch_for,
        plan_chart_png,
        prepare,
        write_run_files,
    )

    req = TrainRequest(
        method="lora",
        model=str(fake_model(tmp_path / "model", "sd15")),
        dataset=str(dataset),
        out=str(tmp_path / "run"),
        epochs=EPOCHS,
        snapshot=Snapshot.load(machines["rtx4090"]),
        yes=True,
    )
    p = prepare(req, UI(echo=lambda line: None))
    chart = plan_chart_png(p)
    assert chart is not None and chart.startswith(b"\x89PNG")
    write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out), chart)
    assert (p.out / "plan.png").read_bytes() == chart
    assert {"sdplan.yaml", "plan.png"} <= runfolder.owned(p.out)
    again = dataclasses.replace(req, config=str(p.out / "sdplan.yaml"), out=str(tmp_path / "run2"))
    assert plan_chart_png(prepare(again, UI(echo=lambda line: None))) is None


def test_settings_round_trip_through_sdplan_yaml_and_profile_points():
    s = Settings(
        method="finetune",
        model="sdxl",
        resolution=1024,
        batch=2,
        grad_accum=4,
        precision="bf16",
        gradient_checkpointing=True,
        optimizer="adafactor",
        cache_latents=True,
        full_half_weights=True,
        ema="cpu",
        num_gpus=2,
    )
    data = C.merge(C.default_config(), s.to_config())
    C.validate(data)
    assert Settings.from_config(data) == s
    assert Settings.from_profile("finetune", s.profile_fields()) == s
    lora = Settings(method="lora", model="sd15", resolution=512, lora_rank=32, lora_alpha=16.0)
    # lora.target_modules null: the family's default, as the Settings' None
    assert Settings.from_config(C.merge(C.default_config(), lora.to_config())) == lora
    pinned = dataclasses.replace(lora, lora_targets=("to_v", "to_q"))
    assert pinned.lora_targets == ("to_q", "to_v")
    assert Settings.from_config(C.merge(C.default_config(), pinned.to_config())) == pinned


# -- key=value settings: `sdplan train` plans around them as `sdplan recommend` plans around pins ------------

# The keys that differ by design: where the files are (recommend writes the hub id and ./output, train the
# paths given), how the steps are counted (recommend writes its count as max_steps, train counts from epochs
# and the scanned dataset) and the plan record (train keeps the planner's whole result, reasons included).
PLACE_KEYS = (
    ("model", "path"),
    ("data", "path"),
    ("data", "repeats"),
    ("output", "dir"),
    ("training", "max_steps"),
    ("plan",),
)
PIN_CASES = [
    ("rtx3060_12gb", "lora", "sd15", ("training.batch_size=8",)),
    ("rtx3060_12gb", "lora", "sdxl", ("lora.rank=64", "memory.gradient_checkpointing=false")),
    ("rtx3060_12gb", "finetune", "sd15", ("memory.optimizer=adafactor", "training.learning_rate=5e-5")),
    ("t4", "lora", "sd15", ("training.precision=fp32", "training.batch_size=4")),
    ("t4", "dreambooth", "sd15", ("memory.cache_latents=false",)),
    ("rtx4090", "finetune", "sdxl", ("memory.gradient_checkpointing=true", "training.batch_size=2")),
    ("2x_rtx4090_pcie", "lora", "sdxl", ("distributed.num_processes=2", "training.batch_size=2")),
    ("8x_h100_sxm", "dreambooth", "sdxl", ("training.train_text_encoder=true",)),
    ("rtx3060_12gb", "lora", "sd15", ("training.batch_size=64", "memory.gradient_checkpointing=false")),
]


def _without_places(data: dict) -> dict:
    data = C.validate(data).to_dict()
    for path in PLACE_KEYS:
        parent = data
        for part in path[:-1]:
            parent = parent[part]
        parent.pop(path[-1], None)
    return data


def _get(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


@pytest.mark.parametrize(("machine", "method", "family", "pins"), PIN_CASES)
def test_train_with_key_value_settings_writes_what_recommend_writes_with_the_same_pins(
    tmp_path, machines, dataset, machine, method, family, pins
):
    """`sdplan train ... training.batch_size=8` is planned around batch 8 (it used to be planned for the
    planner's own batch, then batch 8 applied on top of settings chosen for another batch): every setting in
    its sdplan.yaml is the one `sdplan recommend ... training.batch_size=8 --out` writes."""
    recommended = recommend_config(tmp_path, machines[machine], method, family, dataset, pins)
    if recommended is None:  # the pins cannot fit: train says so before writing anything
        with pytest.raises(NotFeasible, match="nothing fits") as err:
            train_plan_config(tmp_path, machines[machine], method, family, dataset, pins)
        assert "--no-plan" in str(err.value)
        assert not (tmp_path / "run").exists()
        return
    trained = train_plan_config(tmp_path, machines[machine], method, family, dataset, pins)
    want = planned(recommended)
    if want.optimizer == "adamw8bit" and not HAVE_BNB:
        want = dataclasses.replace(want, optimizer="adamw")
        recommended["memory"]["optimizer"] = "adamw"
    assert planned(trained) == want
    assert _without_places(trained) == _without_places(recommended)
    for pin in pins:
        key, _, _ = pin.partition("=")
        assert _get(C.validate(trained).to_dict(), key) == _get(C.validate(recommended).to_dict(), key)
    for part in ("plan", "steps", "estimate"):
        assert trained["plan"][part] == recommended["plan"][part], part
    assert trained["plan"]["request"]["pins"] == {
        p.partition("=")[0]: yaml.safe_load(p.partition("=")[2])
        for p in pins
        if p.partition("=")[0] != "training.learning_rate"
    }


def test_a_pin_that_cannot_fit_is_one_line_before_anything_launches_even_with_yes(
    tmp_path, machines, dataset, monkeypatch
):
    import sdplan.launcher as L
    import sdplan.probe.snapshot as probe_module

    snap = Snapshot.load(machines["rtx3060_12gb"])
    monkeypatch.setattr(probe_module, "probe", lambda *a, **k: snap)
    monkeypatch.setattr(L, "run_launch", lambda *a, **k: pytest.fail("launched"))
    model = fake_model(tmp_path / "model", "sd15")
    args = ["train", "--model", str(model), "--dataset", str(dataset), "--out", str(tmp_path / "o"), "--yes"]
    r = CliRunner().invoke(app, [*args, "training.batch_size=64", "memory.gradient_checkpointing=false"])
    assert r.exit_code == NotFeasible.exit_code, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: nothing fits: "), r.stderr
    # by how much, and what to change
    assert "at least" in lines[0] and "GiB of GPU memory" in lines[0]
    assert "training.batch_size=" in lines[0].split("change a pin:")[1] and "--no-plan" in lines[0]
    assert "Traceback" not in r.output and not (tmp_path / "o").exists()
    # a pin this card cannot run at all (bf16 on a T4): one line too
    monkeypatch.setattr(probe_module, "probe", lambda *a, **k: Snapshot.load(machines["t4"]))
    r = CliRunner().invoke(app, [*args, "training.precision=bf16"])
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training.precision=bf16" in lines[0] and "no bf16" in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_no_plan_trains_the_settings_as_given(tmp_path, machines, dataset, monkeypatch):
    """--no-plan is the way to force settings the planner refuses: the defaults plus the key=value
    settings, unchecked (and said so)."""
    import sdplan.probe.snapshot as probe_module

    monkeypatch.setattr(probe_module, "probe", lambda *a, **k: Snapshot.load(machines["rtx3060_12gb"]))
    model = fake_model(tmp_path / "model", "sd15")
    out = tmp_path / "o"
    args = [
        "train",
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--out",
        str(out),
        "--yes",
        "--no-plan",
    ]
    r = CliRunner().invoke(
        app, [*args, "--dry-run", "training.batch_size=64", "memory.gradient_checkpointing=false"]
    )
    assert r.exit_code == 0, r.output
    assert "not planned (--no-plan)" in r.stdout
    assert "batch: 64 per process x 1 accumulation" in r.stdout
    assert not out.exists()


def test_pins_that_contradict_a_flag_or_miss_a_package_are_one_line(tmp_path, machines):
    from sdplan.errors import UsageError

    with pytest.raises(UsageError, match="--resolution 768 and data.resolution=512 disagree"):
        train_request_plan(tmp_path, machines["rtx4090"], ("data.resolution=512",), resolution=768)
    if HAVE_BNB:
        p = train_request_plan(tmp_path, machines["rtx4090"], ("memory.optimizer=adamw8bit",))
        assert p.cfg.memory.optimizer == "adamw8bit"
    else:  # a pinned 8-bit AdamW is never swapped for AdamW behind the user's back
        with pytest.raises(UsageError, match="adamw8bit: bitsandbytes is not installed"):
            train_request_plan(tmp_path, machines["rtx4090"], ("memory.optimizer=adamw8bit",))


def train_request_plan(tmp: Path, machine: Path, pins: tuple[str, ...], **flags):
    from sdplan.launcher import UI, TrainRequest, prepare

    req = TrainRequest(
        method="lora",
        model=str(fake_model(tmp / "model", "sd15")) if not (tmp / "model").exists() else str(tmp / "model"),
        dataset=str(tmp / "ds") if (tmp / "ds").exists() else str(make_images(tmp / "ds", n=4)),
        out=str(tmp / "run"),
        snapshot=Snapshot.load(machine),
        overrides=list(pins),
        **flags,
    )
    return prepare(req, UI(echo=lambda line: None))


def test_a_plans_config_trained_with_other_settings_drops_its_stale_plan(tmp_path, machines, dataset):
    """`train --config OUT/sdplan.yaml training.batch_size=2`: the run kept the plan's record (batch 4, its peak
    and time) in its sdplan.yaml and every output's metadata, and its planned training.max_steps, so the smaller
    batch trained fewer images than the epochs asked. Both are dropped, with a note; unchanged, both stay."""
    from sdplan.launcher import UI, TrainRequest, prepare

    model = fake_model(tmp_path / "model", "sd15")
    out = tmp_path / "recommended"
    args = ["recommend", "--method", "lora", "--model", str(model), "--machine", str(machines["rtx4090"])]
    args += ["--dataset", str(dataset), "--epochs", str(EPOCHS), "--out", str(out), "training.batch_size=4"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    written = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert written["training"]["max_steps"] == 12  # 13 images at batch 4: 4 steps x 3 epochs
    config = str(out / "sdplan.yaml")

    def train(name, *overrides):
        lines: list[str] = []
        req = TrainRequest(
            config=config,
            out=str(tmp_path / name),
            snapshot=Snapshot.load(machines["rtx4090"]),
            yes=True,
            overrides=list(overrides),
        )
        return prepare(req, UI(echo=lines.append)), lines

    same, lines = train("same")
    assert same.cfg.plan is not None and same.cfg.training.max_steps == 12
    assert not any("was made for other settings" in line for line in lines)
    smaller, lines = train("smaller", "training.batch_size=2")
    (note,) = [line for line in lines if "was made for other settings" in line]
    assert note.startswith("note: training.batch_size 2 (planned 4): the plan in ")
    assert "planned training.max_steps 12 is dropped" in note and "planned again" in note
    assert smaller.cfg.training.max_steps is None
    assert smaller.steps["total_steps"] == 7 * EPOCHS  # the epochs asked for, at batch 2
    # the record is planned again with every setting pinned: the config's own settings, their estimate
    record = smaller.cfg.plan
    assert record["plan"]["batch_size"] == 2 and record["steps"]["total_steps"] == 7 * EPOCHS
    assert {k: v for k, v in record["plan"].items() if k != "batch_size"} == {
        k: v for k, v in same.cfg.plan["plan"].items() if k != "batch_size"
    }
    assert record["estimate"]["peak_vram_bytes"] < same.cfg.plan["estimate"]["peak_vram_bytes"]
    # the file edited by hand, another dataset, other epochs: the record is of other settings all the same
    edited = yaml.safe_load((out / "sdplan.yaml").read_text())
    edited["training"]["batch_size"] = 1
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))
    config = str(tmp_path / "edited.yaml")
    by_hand, lines = train("by_hand")
    assert any(line.startswith("note: training.batch_size 1 (planned 4)") for line in lines)
    assert by_hand.cfg.training.max_steps is None and by_hand.steps["total_steps"] == 13 * EPOCHS
    assert by_hand.cfg.plan["plan"]["batch_size"] == 1
    config = str(out / "sdplan.yaml")
    more = make_images(tmp_path / "more", n=20)
    other, lines = train("other_data", f"data.path={more}")
    assert any("images per epoch 20 (planned 13)" in line for line in lines)
    assert other.cfg.training.max_steps is None and other.steps["total_steps"] == 5 * EPOCHS
    longer, lines = train("longer", "training.epochs=6")
    assert any("training.epochs 6 (planned 3)" in line for line in lines)
    assert longer.cfg.plan["steps"]["total_steps"] == longer.steps["total_steps"] == 4 * 6
    # a max_steps the user gives stays
    capped, _ = train("capped", "training.batch_size=2", "training.max_steps=5")
    assert capped.cfg.training.max_steps == 5
    # settings that cannot fit are refused as recommend refuses such pins: by how much, and what fits
    from sdplan.launcher import NotFeasible

    with pytest.raises(NotFeasible) as e:
        train("huge", "training.batch_size=64", "memory.gradient_checkpointing=false", "data.resolution=1024")
    assert "GiB" in str(e.value)


def test_train_says_the_class_images_of_prior_preservation_as_recommend_does(tmp_path, machines, dataset):
    """recommend said "20 class images are trained alongside (batch doubled)" and how many are generated first;
    train's plan lines said "2 images per optimizer step" and neither."""
    from sdplan.launcher import UI, TrainRequest, describe, prepare

    classes = make_images(tmp_path / "cls", n=6)
    req = TrainRequest(
        method="dreambooth",
        model=str(fake_model(tmp_path / "model", "sd15")),
        dataset=str(dataset),
        out=str(tmp_path / "run"),
        snapshot=Snapshot.load(machines["rtx4090"]),
        yes=True,
        overrides=[
            "dreambooth.with_prior_preservation=true",
            f"dreambooth.class_data={classes}",
            "dreambooth.class_prompt=a dog",
            "dreambooth.num_class_images=20",
            "training.batch_size=2",
        ],
    )
    p = prepare(req, UI(echo=lambda line: None))
    lines = describe(p.cfg, p.steps, p.world, p.inputs)
    assert (
        "prior preservation: 20 class images trained alongside, 2 in each batch beside the instance images "
        "(batch doubled); 14 the class folder lacks are generated before the first step"
    ) in lines


def test_a_plan_folder_trained_on_the_cpu_with_other_settings_drops_the_plans_chart(
    tmp_path, machines, dataset
):
    """recommend's plan.png (the GPU plan, batch 4 at 512 px) stayed beside a run that trained other settings on
    the CPU, whose sdplan.yaml has no plan any more."""
    from sdplan.launcher import UI, TrainRequest, command_line, launch_for, prepare, write_run_files

    model = fake_model(tmp_path / "model", "sd15")
    out = tmp_path / "plan"
    args = ["recommend", "--method", "lora", "--model", str(model), "--machine", str(machines["rtx4090"])]
    r = CliRunner().invoke(app, [*args, "--dataset", str(dataset), "--out", str(out)])
    assert r.exit_code == 0 and (out / "plan.png").is_file(), r.output
    req = TrainRequest(
        config=str(out / "sdplan.yaml"), yes=True, overrides=["training.device=cpu", "data.resolution=64"]
    )
    p = prepare(req, UI(echo=lambda line: None))
    assert p.cfg.plan is None
    write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out))
    assert not (out / "plan.png").exists() and (out / "sdplan.yaml").is_file()


def test_a_config_with_zero_on_one_process_without_offload_is_refused(tmp_path, machines, dataset):
    """The planner refuses the pin; a config trained as it is (--no-plan, --config) ran it: ZeRO on one process
    splits nothing and holds more than without DeepSpeed."""
    from sdplan.launcher import UI, TrainRequest, prepare

    req = TrainRequest(
        method="finetune",
        model=str(fake_model(tmp_path / "model", "sd15")),
        dataset=str(dataset),
        out=str(tmp_path / "run"),
        snapshot=Snapshot.load(machines["rtx4090"]),
        yes=True,
        no_plan=True,
        overrides=["distributed.deepspeed.zero_stage=2", "distributed.deepspeed.offload_optimizer=false"],
    )
    with pytest.raises(UsageError, match="on one process without offload") as e:
        prepare(req, UI(echo=lambda line: None))
    assert "offload_optimizer=true" in e.value.fix
