"""`sdplan train` trains what the planner chose: in plan mode it writes the same settings `recommend --out` writes.

Both go through one translation (planner result -> Settings -> sdplan.yaml); this checks it end to end, for
every method x family on several fixture machines, with nothing launched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from conftest import make_images
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
    if family in registry.FLOW_FAMILIES:  # SD3.5 / FLUX.1: the pipeline class and the transformer's config
        spec = load_profiles().model(family)
        (root / "transformer").mkdir(parents=True)
        pipe = "FluxPipeline" if spec.architecture == "flux" else "StableDiffusion3Pipeline"
        (root / "model_index.json").write_text(json.dumps({"_class_name": pipe}))
        (root / "transformer" / "config.json").write_text(json.dumps(spec.transformer))
        return root
    (root / "unet").mkdir(parents=True)
    index = {"_class_name": "StableDiffusionXLPipeline" if family == "sdxl" else "StableDiffusionPipeline"}
    unet = {"cross_attention_dim": {"sd15": 768, "sd21": 1024, "sdxl": 2048}[family]}
    if family == "sdxl":
        index["text_encoder_2"] = ["transformers", "CLIPTextModelWithProjection"]
        unet["addition_embed_type"] = "text_time"
    (root / "model_index.json").write_text(json.dumps(index))
    (root / "unet" / "config.json").write_text(json.dumps(unet))
    return root


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


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "ds", n=IMAGES)


def recommend_config(tmp: Path, machine: Path, method: str, family: str, dataset: Path) -> dict | None:
    out = tmp / "recommended"
    args = ["recommend", "--method", method, "--model", family, "--machine", str(machine)]
    args += ["--dataset", str(dataset), "--epochs", str(EPOCHS), "--out", str(out)]
    r = CliRunner().invoke(app, args)
    if "[bold red]does not fit" in r.output or "does not fit:" in r.output:
        assert not out.exists(), r.output
        return None
    assert r.exit_code == 0, r.output
    return yaml.safe_load((out / "sdplan.yaml").read_text())


def train_plan_config(tmp: Path, machine: Path, method: str, family: str, dataset: Path) -> dict:
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
    )
    p = prepare(req, UI(echo=lambda line: None))
    assert p.plan is not None, "plan mode: the planner chose the settings"
    write_run_files(p.out, p.cfg, launch_for(p, req, p.resume), command_line(req, p.out))
    return yaml.safe_load((p.out / "sdplan.yaml").read_text())


def planned(data: dict) -> Settings:
    return Settings.from_config(data)


# the methods the planner plans for each family (SD3.5 / FLUX.1: LoRA; the others are refused by both commands
# with "not supported for this family": tests/test_plan_flow.py)
CASES = [
    (m, method, family)
    for m in (*NAMES, "rtx4090")
    for method in METHODS
    for family in PLANNED_FAMILIES
    if registry.family(family).plans(method)
]


@pytest.mark.parametrize(("machine", "method", "family"), CASES)
def test_train_writes_the_settings_recommend_writes(tmp_path, machines, dataset, machine, method, family):
    recommended = recommend_config(tmp_path, machines[machine], method, family, dataset)
    if recommended is None:  # nothing fits: train refuses with the planner's reason, and writes nothing
        with pytest.raises(NotFeasible, match="GPU"):
            train_plan_config(tmp_path, machines[machine], method, family, dataset)
        assert not (tmp_path / "run").exists()
        return
    want = planned(recommended)
    if want.base_precision != "bf16" or want.blocks_to_swap:  # not in the bundled trainer yet: train stops
        with pytest.raises(UsageError, match="cannot (load quantized bases|swap transformer blocks) yet"):
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
    assert Settings.from_config(C.merge(C.default_config(), lora.to_config())) == dataclasses.replace(
        lora, lora_targets=tuple(C.LoraConfig().target_modules)
    )
