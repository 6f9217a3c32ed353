"""`sdplan train` on a machine whose GPUs differ launches on the GPUs the plan is for: the plan's
distributed.gpu_ids become CUDA_VISIBLE_DEVICES by NVML's UUIDs (else by index with CUDA_DEVICE_ORDER=PCI_BUS_ID:
CUDA's own order puts the fastest first, NVML and `sdplan doctor` go by PCI bus), so a one-GPU plan on the RTX 4090 trains on the 4090 whichever
GPU the machine lists first. Nothing is launched here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import fake_diffusers_folder, make_images
from test_planner_mixed import RTX2080TI, RTX3060, RTX3090, RTX4090, machine

from sdplan import config as C
from sdplan.errors import UsageError
from sdplan.launch import build_launch
from sdplan.launcher import UI, TrainRequest, launch_for, prepare, run_gpus

PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "ds", n=12)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return fake_diffusers_folder(tmp_path_factory.mktemp("model") / "sd15")


def prepared(tmp_path, model, dataset, snap, *, lines=None, **kw):
    req = TrainRequest(
        method="lora",
        model=str(model),
        dataset=str(dataset),
        out=str(tmp_path / "run"),
        epochs=2,
        snapshot=snap,
        yes=True,
        **kw,
    )
    p = prepare(req, UI(echo=(lines.append if lines is not None else lambda line: None)))
    return p, launch_for(p, req, p.resume)


@pytest.mark.parametrize(
    ("gpus", "flags", "want"),
    [
        # the 4090 alone, wherever it sits (before: GPU 0 whatever it was, and CUDA's fastest-first numbering)
        ((RTX3060, RTX4090), {}, [1]),
        ((RTX4090, RTX3060), {}, [0]),
        ((RTX2080TI, RTX4090), {"gpus": 1}, [1]),
        ((RTX3060, RTX4090, RTX4090), {"gpus": 1}, [1]),
        # pinned by number: those
        ((RTX4090, RTX3060), {"overrides": ["distributed.gpu_ids=[1]"]}, [1]),
    ],
)
def test_train_launches_on_the_planned_gpus(tmp_path, model, dataset, monkeypatch, gpus, flags, want):
    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    p, launch = prepared(tmp_path, model, dataset, machine(*gpus), **flags)
    assert p.cfg.distributed.gpu_ids == want == p.plan["plan"]["gpu_ids"]
    assert p.cfg.distributed.num_processes == len(want)
    # by NVML's UUIDs, which CUDA takes in any device order; accelerate's gpu_ids sets the same again
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ",".join(gpus[i]["uuid"] for i in want)
    assert launch.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert launch.accelerate_config["gpu_ids"] == launch.env["CUDA_VISIBLE_DEVICES"]
    written = yaml.safe_load(C.to_yaml(p.cfg))
    assert written["distributed"]["gpu_ids"] == want


def test_alike_gpus_launch_as_before(tmp_path, model, dataset):
    snap = machine(RTX4090, RTX4090)
    p, launch = prepared(tmp_path, model, dataset, snap)
    assert p.cfg.distributed.gpu_ids is None and p.devices is None
    assert "CUDA_VISIBLE_DEVICES" not in launch.env and "CUDA_DEVICE_ORDER" not in launch.env


def test_the_users_own_visible_devices_are_kept_with_a_note(tmp_path, model, dataset, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    lines: list[str] = []
    p, launch = prepared(tmp_path, model, dataset, machine(RTX3060, RTX4090), lines=lines)
    assert p.cfg.distributed.gpu_ids == [1] and p.devices is None
    assert "CUDA_VISIBLE_DEVICES" not in launch.env  # run_launch passes the user's environment on
    assert any(
        "CUDA_VISIBLE_DEVICES=0 is set" in line and "GPU 1 (NVIDIA GeForce RTX 4090)" in line
        for line in lines
    )


def _cfg(**distributed) -> C.TrainConfig:
    data = C.default_config()
    data["distributed"].update(distributed)
    return C.validate(data)


def test_run_gpus_for_a_config_trained_as_given():
    """A config without GPUs (--config, --no-plan, --resume --gpus N) on GPUs that differ: those the planner would
    choose for that many (with the config's precision); its own GPUs where it names them, checked."""
    snap = machine(RTX3060, RTX4090, RTX2080TI)
    assert run_gpus(_cfg(), snap, 1) == (1,)
    assert run_gpus(_cfg(num_processes=2), snap, 2) in ((0, 1), (1, 2))
    # bf16 (the default precision): not the 2080 Ti
    assert run_gpus(_cfg(num_processes=2), snap, 2) == (0, 1)
    assert run_gpus(_cfg(gpu_ids=[2]), snap, 1) == (2,)
    with pytest.raises(UsageError, match="no usable GPU 5"):
        run_gpus(_cfg(gpu_ids=[5]), snap, 1)
    with pytest.raises(UsageError, match="lists 1 GPU for 2 processes"):
        run_gpus(_cfg(num_processes=2, gpu_ids=[1]), snap, 2)
    assert run_gpus(_cfg(), machine(RTX4090, RTX4090), 1) is None


def test_resume_on_another_gpu_count_chooses_the_gpus_again():
    from sdplan.launcher import flag_overrides

    req = TrainRequest(resume=True, out="/tmp/x", gpus=1)
    assert "distributed.gpu_ids=null" in flag_overrides(req, None)


def test_build_launch_shows_the_processes_only_their_gpus(tmp_path):
    devices = {**PCI, "CUDA_VISIBLE_DEVICES": "1"}
    one = build_launch(_cfg(), tmp_path / "sdplan.yaml", tmp_path, devices=devices)
    two = build_launch(
        _cfg(num_processes=2),
        tmp_path / "sdplan.yaml",
        tmp_path,
        devices={**PCI, "CUDA_VISIBLE_DEVICES": "0,2"},
    )
    assert one.kind == "single" and one.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert two.kind == "multi-gpu" and two.env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1" in one.shell()
    data = C.default_config()
    data["training"]["device"] = "cpu"
    cpu = build_launch(C.validate(data), tmp_path / "sdplan.yaml", tmp_path, devices=devices)
    assert "CUDA_VISIBLE_DEVICES" not in cpu.env


def test_another_node_without_the_planned_gpus_chooses_its_own():
    """A config planned on node 0 (a 3060 and a 4090: gpu_ids [1]) run on a node with one RTX 4090: "this
    machine has no usable GPU 1". On several machines the ids are node 0's; a node that lacks them chooses."""
    assert run_gpus(_cfg(gpu_ids=[1]), machine(RTX4090), 1, num_machines=2) is None
    with pytest.raises(UsageError, match="no usable GPU 1"):
        run_gpus(_cfg(gpu_ids=[1]), machine(RTX4090), 1)  # one machine: the config names a GPU it lacks


def test_recommend_out_writes_the_planned_gpus_into_accelerate_yaml(tmp_path):
    """`recommend --out` on a 3060 + 4090 machine wrote accelerate.yaml with gpu_ids "all": a hand `accelerate
    launch --config_file` of it trained on CUDA's first GPU, not the 4090 planned. Now it names the 4090 by its
    UUID (accelerate puts gpu_ids in CUDA_VISIBLE_DEVICES, which takes UUIDs in any device order)."""
    from typer.testing import CliRunner

    from sdplan.cli import app

    snap = machine(RTX3060, RTX4090)
    (tmp_path / "machine.json").write_text(snap.to_json())
    out = tmp_path / "plan"
    args = ["recommend", "--method", "lora", "--model", "sd15", "--machine", str(tmp_path / "machine.json")]
    r = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load((out / "sdplan.yaml").read_text())
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert cfg["distributed"]["gpu_ids"] == [1]
    assert acc["gpu_ids"] == RTX4090["uuid"]
    # alike GPUs: all of them, as before
    (tmp_path / "alike.json").write_text(machine(RTX4090, RTX4090).to_json())
    r = CliRunner().invoke(app, [*args[:-1], str(tmp_path / "alike.json"), "--out", str(tmp_path / "alike")])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load((tmp_path / "alike" / "accelerate.yaml").read_text())["gpu_ids"] == "all"


def test_a_pinned_gpu_on_alike_catalog_gpus_is_written_into_accelerate_yaml(tmp_path):
    """`recommend --hardware "2x RTX 4090" distributed.gpu_ids=[1] --out` wrote accelerate.yaml with gpu_ids
    "all" (the catalog's GPUs have no UUIDs): `accelerate launch` of it trained on GPU 0. On GPUs all alike,
    CUDA's order is the bus order, so the index is the GPU."""
    from typer.testing import CliRunner

    from sdplan.cli import app

    out = tmp_path / "plan"
    args = ["recommend", "--method", "lora", "--model", "sdxl", "--hardware", "2x RTX 4090"]
    r = CliRunner().invoke(app, [*args, "distributed.gpu_ids=[1]", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load((out / "accelerate.yaml").read_text())["gpu_ids"] == "1"


@pytest.mark.parametrize("value", ["", "-1"])
@pytest.mark.parametrize("gpus", [(RTX4090, RTX4090), (RTX3060, RTX4090)], ids=["alike", "mixed"])
def test_visible_devices_that_hide_every_gpu_are_refused(tmp_path, model, dataset, monkeypatch, value, gpus):
    """CUDA_VISIBLE_DEVICES="" (or -1) hides every GPU: a run planned on one was launched on the GPUs sdplan chose
    (mixed GPUs: the empty value read as unset) or with none (alike GPUs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    with pytest.raises(UsageError, match=r"shows the trainer no GPU") as e:
        prepared(tmp_path, model, dataset, machine(*gpus))
    shown = '""' if value == "" else value
    assert f"CUDA_VISIBLE_DEVICES={shown} is set" in str(e.value) and "--device cpu" in e.value.fix


def test_rocr_visible_devices_set_empty_hides_amd_gpus_from_the_trainer(
    tmp_path, model, dataset, monkeypatch
):
    """ROCm's runtime filters by ROCR_VISIBLE_DEVICES when it is set at all, empty too; HIP then reads
    HIP_VISIBLE_DEVICES where it is not empty, else CUDA_VISIBLE_DEVICES (not one after the other)."""
    from conftest import MACHINES

    from sdplan.machine import Snapshot

    amd = Snapshot.load(MACHINES / "rx6700xt.json")
    # gfx1031: ROCm's wheels run it as gfx1030 under the override (without it train stops: no kernels)
    amd = replace(amd, env={**amd.env, "HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "")
    with pytest.raises(UsageError, match=r'ROCR_VISIBLE_DEVICES="" is set, which shows the trainer no GPU'):
        prepared(tmp_path / "a", model, dataset, amd)
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # HIP's value wins: GPU 0 is shown
    prepared(tmp_path / "b", model, dataset, amd)


def _shown(monkeypatch, snap, **env: str):
    """The machine as probed with these visibility variables set: in its snapshot, as `probe` reads them, and in
    the environment the trainer is launched from."""
    from dataclasses import replace

    for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return replace(snap, env={**snap.env, **env})


def test_train_plans_for_the_gpus_the_users_visible_devices_show(tmp_path, model, dataset, monkeypatch):
    """CUDA_VISIBLE_DEVICES=1 on a machine with an RTX 4090 (GPU 0) and an RTX 3060 (GPU 1): the run trains on
    the 3060. It was planned for the 4090 (its 24 GiB and speed), then launched on the 3060 with a note."""
    lines: list[str] = []
    snap = _shown(monkeypatch, machine(RTX4090, RTX3060), CUDA_VISIBLE_DEVICES="1", **PCI)
    p, launch = prepared(tmp_path, model, dataset, snap, lines=lines)
    assert p.plan["plan"]["gpu_ids"] in ([1], None) and p.devices is None  # the user's own setting is kept
    assert p.plan["hardware"]["gpus"][0]["name"] == RTX3060["name"] and len(p.plan["hardware"]["gpus"]) == 1
    assert "CUDA_VISIBLE_DEVICES" not in launch.env
    assert not any("may not be" in line for line in lines)


def test_train_narrows_the_users_visible_devices_to_the_planned_gpus(tmp_path, model, dataset, monkeypatch):
    """Fewer GPUs planned than the user's setting shows: the plan's, by UUID (within what the user chose)."""
    snap = _shown(monkeypatch, machine(RTX4090, RTX3060, RTX3090), CUDA_VISIBLE_DEVICES="1,2", **PCI)
    lines: list[str] = []
    p, launch = prepared(tmp_path, model, dataset, snap, lines=lines, gpus=1)
    assert p.cfg.distributed.gpu_ids == [2]  # the RTX 3090 of the two it shows, never the hidden RTX 4090
    assert launch.env["CUDA_VISIBLE_DEVICES"] == RTX3090["uuid"]
    assert any(
        line.startswith(
            "note: CUDA_VISIBLE_DEVICES=1,2 shows 2 GPUs; the plan runs on GPU 2 (NVIDIA GeForce RTX 3090)"
        )
        for line in lines
    )


def test_gpu_counts_and_ids_count_only_the_gpus_shown(tmp_path, model, dataset, monkeypatch):
    snap = _shown(monkeypatch, machine(RTX4090, RTX4090), CUDA_VISIBLE_DEVICES="1")
    with pytest.raises(
        UsageError, match=r"--gpus 2: this machine shows the run 1 usable GPU \(CUDA_VISIBLE_DEV"
    ):
        prepared(tmp_path / "a", model, dataset, snap, gpus=2)
    with pytest.raises(UsageError, match=r"GPU 0 is hidden from the run") as e:
        prepared(tmp_path / "b", model, dataset, snap, overrides=["distributed.gpu_ids=[0]"])
    assert "unset CUDA_VISIBLE_DEVICES" in str(e.value) + (e.value.fix or "")


def test_doctor_and_recommend_plan_the_gpus_shown():
    from dataclasses import replace

    from sdplan.doctor import planner_verdicts
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    snap = machine(RTX4090, RTX3060)
    shown = replace(snap, env={**snap.env, "CUDA_VISIBLE_DEVICES": "1", **PCI})
    hw = hardware_from_snapshot(shown, load_profiles())
    assert [g.index for g in hw.gpus] == [1]
    assert any("CUDA_VISIBLE_DEVICES=1 shows only GPU 1" in n and "GPU 0" in n for n in hw.notes)
    both, one = planner_verdicts(snap), planner_verdicts(shown)
    # SD3.5 Medium's DreamBooth fits the 4090 (GPU 0), not the 12 GiB RTX 3060 the run is shown
    assert {(v.method, v.family): v.status for v in both}[("dreambooth", "sd35-medium")] == "ok"
    assert {(v.method, v.family): v.status for v in one}[("dreambooth", "sd35-medium")] == "no"
    assert not any(v.note.endswith("on GPU 0") for v in one)
    # CUDA's default order on GPUs that differ counts fastest first: doctor cannot tell which, so every GPU counts
    unsure = replace(snap, env={**snap.env, "CUDA_VISIBLE_DEVICES": "1"})
    assert len(hardware_from_snapshot(unsure, load_profiles()).gpus) == 2


def _amd_three():
    """RX 6700 XT (GPU 0), W6800 (GPU 1), RX 6700 XT (GPU 2), HIP numbering them as doctor does."""
    import copy
    import json

    from conftest import MACHINES

    from sdplan.machine import Snapshot

    w = json.loads((MACHINES / "w6800.json").read_text())
    rx = json.loads((MACHINES / "rx6700xt.json").read_text())["gpus"][0]
    d = copy.deepcopy(w)
    d["gpus"] = [
        dict(rx, index=0, hip_index=0, kfd_node=1, uuid="aaaa0000-0000-1000-8058-000000000001"),
        dict(w["gpus"][0], index=1, hip_index=1, kfd_node=2),
        dict(rx, index=2, hip_index=2, kfd_node=3, uuid="aaaa0000-0000-1000-8058-000000000002"),
    ]
    d["links"] = [{"a": i, "b": j, "type": "pcie", "p2p": False} for i in range(3) for j in range(i + 1, 3)]
    return Snapshot.from_dict(d)


def test_rocr_visible_devices_narrowed_by_hips_place_in_its_list(tmp_path, model, dataset, monkeypatch):
    """ROCR_VISIBLE_DEVICES=0,1 and a one-GPU plan on the W6800 (GPU 1): the run was launched with the user's
    setting kept, so the trainer took the first GPU it shows, the RX 6700 XT. HIP numbers the GPUs ROCr leaves
    by their place in its list: HIP_VISIBLE_DEVICES=1 is the W6800."""
    lines: list[str] = []
    snap = _shown(monkeypatch, _amd_three(), ROCR_VISIBLE_DEVICES="0,1")
    p, launch = prepared(tmp_path, model, dataset, snap, lines=lines, gpus=1)
    assert p.cfg.distributed.gpu_ids == [1]
    assert launch.env["HIP_VISIBLE_DEVICES"] == "1"
    snap = _shown(monkeypatch, _amd_three(), ROCR_VISIBLE_DEVICES="2,1")
    p, launch = prepared(tmp_path / "b", model, dataset, snap, gpus=1)
    assert p.cfg.distributed.gpu_ids == [1] and launch.env["HIP_VISIBLE_DEVICES"] == "1"


def test_doctor_judges_only_the_gpus_shown(monkeypatch):
    """CUDA_VISIBLE_DEVICES=1 on an RTX 4090 + RTX 3060 machine: doctor planned the 3060 alone, yet warned of mixed
    GPUs (its fix naming the hidden 4090) and of their slow link."""
    from dataclasses import replace

    from sdplan.probe.snapshot import findings

    snap = machine(RTX4090, RTX3060)
    both = {f.code for f in findings(snap)}
    assert "mixed_gpus" in both
    one = {f.code for f in findings(replace(snap, env={**snap.env, "CUDA_VISIBLE_DEVICES": "1", **PCI}))}
    assert "mixed_gpus" not in one and "multi_gpu_slow_link" not in one and "visible_devices_some" in one


def _with_igpu(snap, memory_gib: float = 2, **software):
    """``snap`` with a laptop's AMD iGPU (gfx1036: outside the ROCm wheels' arches) after its GPUs."""
    from dataclasses import replace

    from sdplan.machine import GPU

    igpu = GPU(
        index=len(snap.gpus),
        vendor="amd",
        name="AMD Radeon Graphics",
        uuid="amd-igpu",
        memory_total_bytes=int(memory_gib * 2**30),
        gfx_arch="gfx1036",
        bf16=False,
        fp16=True,
        hip_index=0,
    )
    return replace(snap, gpus=(*snap.gpus, igpu), software=replace(snap.software, **software))


def test_gpu_counts_leave_out_an_igpu_the_torch_build_never_drives(tmp_path, model, dataset, monkeypatch):
    """An RTX 4090 beside an AMD iGPU under a CUDA torch: --gpus 2 trained on one GPU without a word, and
    num_processes=2 (--no-plan) started two processes for the one GPU CUDA sees."""
    _shown(monkeypatch, machine(RTX4090))
    snap = _with_igpu(machine(RTX4090), torch_build="cuda")
    with pytest.raises(UsageError, match=r"--gpus 2: this machine has 1 usable GPU"):
        prepared(tmp_path / "a", model, dataset, snap, gpus=2)
    with pytest.raises(UsageError, match=r"needs 2 GPUs per machine; this machine has 1 usable GPU"):
        prepared(
            tmp_path / "b", model, dataset, snap, no_plan=True, overrides=["distributed.num_processes=2"]
        )


def test_an_igpus_carve_out_does_not_make_it_the_gpu_trained_on():
    """No torch (or a CPU one) on a laptop with an 8 GiB RTX 4060 and a 780M whose BIOS gives it 16 GiB: doctor
    planned the iGPU and said ROCm wheels have no kernels for it. The CUDA driver says which GPU a GPU build of
    torch would be for."""
    from dataclasses import replace

    from sdplan.probe.snapshot import findings, trained_vendor

    snap = _with_igpu(machine(RTX4090), memory_gib=32, torch_build="cpu", rocm=None)
    assert snap.software.cuda_driver and trained_vendor(snap) == "nvidia"
    assert "rocm_arch_unsupported" not in {f.code for f in findings(snap)}
    # under a CUDA build, CUDA_VISIBLE_DEVICES says nothing of the iGPU (it hid "all 1 AMD GPU": an error)
    cuda = replace(
        _with_igpu(machine(RTX4090, RTX4090), torch_build="cuda"), env={"CUDA_VISIBLE_DEVICES": "1"}
    )
    assert "visible_devices_none" not in {f.code for f in findings(cuda)}


def test_require_gpu_stops_where_rocm_has_no_kernels_for_any_gpu():
    from dataclasses import replace

    from sdplan.errors import NoGPUError
    from sdplan.launcher import require_gpu

    igpu_only = _with_igpu(machine(RTX4090), torch="2.7.0+rocm6.3", torch_build="rocm", rocm="6.3")
    igpu_only = replace(igpu_only, gpus=igpu_only.gpus[1:])
    with pytest.raises(NoGPUError, match="outside the arches ROCm torch wheels ship kernels for"):
        require_gpu(igpu_only)
    require_gpu(replace(igpu_only, env={**igpu_only.env, "HSA_OVERRIDE_GFX_VERSION": "10.3.0"}))


def test_a_pinned_gpu_rocm_has_no_kernels_for_is_refused(tmp_path, model, dataset, monkeypatch):
    """An RX 6700 XT (gfx1031) beside a W6800 (gfx1030) under a ROCm torch, no override: one supported GPU let
    train pass its check, and distributed.gpu_ids=[0] launched on the 6700 XT alone ('invalid device function').
    Unpinned, the plan takes the W6800; doctor's fix hides the 6700 XT, not an override that would make the
    W6800 run as another arch."""
    from sdplan.errors import NoGPUError
    from sdplan.probe.snapshot import findings

    snap = _shown(monkeypatch, _amd_three())
    snap = replace(snap, gpus=snap.gpus[:2], links=snap.links[:1])
    assert snap.software.torch_build == "rocm" and not snap.env.get("HSA_OVERRIDE_GFX_VERSION")
    with pytest.raises(
        UsageError, match=r"gpu_ids=\[0\]: GPU 0 cannot train here: its arch gfx1031 is outside"
    ):
        prepared(tmp_path / "a", model, dataset, snap, overrides=["distributed.gpu_ids=[0]"])
    with pytest.raises(NoGPUError, match=r"GPU 0 \(AMD Radeon RX 6700 XT, gfx1031\): outside the arches"):
        prepared(tmp_path / "a2", model, dataset, snap, no_plan=True, overrides=["distributed.gpu_ids=[0]"])
    (f,) = [f for f in findings(snap) if f.code == "rocm_arch_unsupported"]
    assert f.severity == "warning" and f.fix == "train on the others: HIP_VISIBLE_DEVICES=1"
    shown = _shown(monkeypatch, snap, HIP_VISIBLE_DEVICES="1")
    p, _ = prepared(tmp_path / "c", model, dataset, shown)
    assert (
        p.plan["hardware"]["gpus"][0]["name"] == "AMD Radeon PRO W6800"
        and p.cfg.distributed.num_processes == 1
    )


def test_gpu_counts_name_the_runs_own_setting_once(tmp_path, model, dataset, monkeypatch):
    snap = _shown(
        monkeypatch, _with_igpu(machine(RTX4090, RTX4090), torch_build="cuda"), CUDA_VISIBLE_DEVICES="0"
    )
    with pytest.raises(UsageError) as e:
        prepared(tmp_path, model, dataset, snap, gpus=3)
    assert str(e.value).startswith(
        "--gpus 3: this machine shows the run 1 usable GPU (CUDA_VISIBLE_DEVICES=0)"
    )


def test_a_laptop_apu_with_both_driver_stacks_is_not_the_gpu_trained_on():
    from sdplan.probe.snapshot import trained_vendor

    snap = _with_igpu(machine(RTX4090), memory_gib=32, torch_build="cpu", rocm="6.3.0")
    snap = replace(snap, gpus=(snap.gpus[0], replace(snap.gpus[1], gfx_arch="gfx1103")))
    assert trained_vendor(snap) == "nvidia"


def test_the_plan_leaves_out_a_gpu_rocm_has_no_kernels_for(tmp_path, model, dataset, monkeypatch):
    """An RX 6700 XT (gfx1031, GPU 0) beside a W6800 (gfx1030) under a ROCm torch: the planner planned both, and
    `train` refused its own plan, naming HIP_VISIBLE_DEVICES=1. The plan now takes the W6800 alone, says why,
    and the launch shows the trainer only it; two processes given as they are say which GPU cannot train."""
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    snap = _shown(monkeypatch, _amd_three())
    snap = replace(snap, gpus=snap.gpus[:2], links=snap.links[:1])
    hw = hardware_from_snapshot(snap, load_profiles())
    assert [g.index for g in hw.gpus] == [1] and [i for i, _ in hw.left_out] == [0]
    assert any("GPU 0 (AMD Radeon RX 6700 XT, gfx1031) is outside the arches" in n for n in hw.notes)
    p, launch = prepared(tmp_path / "a", model, dataset, snap)
    assert p.cfg.distributed.gpu_ids == [1] and launch.env["HIP_VISIBLE_DEVICES"] == "1"
    with pytest.raises(
        UsageError, match=r"num_processes 2: this machine trains on 1 GPU; GPU 0 cannot train"
    ):
        prepared(
            tmp_path / "b", model, dataset, snap, no_plan=True, overrides=["distributed.num_processes=2"]
        )
    with pytest.raises(
        UsageError, match=r"--gpus 2: this machine trains on 1 GPU; GPU 0 \(AMD Radeon RX 6700"
    ):
        prepared(tmp_path / "c", model, dataset, snap, gpus=2)
    # an arch override, global or ROCm's per-GPU one for its KFD node (libhsakmt: HSA_OVERRIDE_GFX_VERSION_<n>),
    # is the user's choice to run it: both GPUs are planned, nothing refused
    for key in ("HSA_OVERRIDE_GFX_VERSION", "HSA_OVERRIDE_GFX_VERSION_1"):
        over = replace(snap, env={**snap.env, key: "10.3.0"})
        assert len(hardware_from_snapshot(over, load_profiles()).gpus) == 2
        p, _ = prepared(tmp_path / key, model, dataset, over, overrides=["distributed.gpu_ids=[0]"])
        assert p.cfg.distributed.gpu_ids == [0]
    # a per-GPU override covers its own node only: the other RX 6700 XT (node 3) still has no kernels
    three = replace(_amd_three(), env={**snap.env, "HSA_OVERRIDE_GFX_VERSION_1": "10.3.0"})
    hw = hardware_from_snapshot(three, load_profiles())
    assert [g.index for g in hw.gpus] == [0, 1] and [i for i, _ in hw.left_out] == [2]


def test_doctor_names_no_gpu_without_rocm_kernels_to_train_on(monkeypatch):
    """Beside the W6800, two RX 6700 XTs the ROCm wheels have no kernels for: doctor's mixed-GPU fix said 'train
    on identical GPUs: HIP_VISIBLE_DEVICES=0,2', the two that cannot run, beside its own fix naming the W6800."""
    from sdplan.probe.snapshot import findings

    codes = {f.code: f for f in findings(_amd_three())}
    assert "mixed_gpus" not in codes and codes["rocm_arch_unsupported"].fix.endswith("HIP_VISIBLE_DEVICES=1")


def test_an_igpu_of_the_other_vendor_changes_nothing_of_an_nvidia_run(tmp_path, model, dataset, monkeypatch):
    """Two RTX 4090s and an AMD iGPU under a CUDA torch: the plan named no GPUs (the first ones, as CUDA numbers
    them) and said nothing of the iGPU in its counts."""
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    snap = _shown(monkeypatch, _with_igpu(machine(RTX4090, RTX4090), torch_build="cuda"))
    assert hardware_from_snapshot(snap, load_profiles()).left_out == ()
    p, launch = prepared(tmp_path, model, dataset, snap, gpus=2)
    assert p.cfg.distributed.gpu_ids is None and "CUDA_VISIBLE_DEVICES" not in launch.env


def test_a_per_gpu_arch_override_is_recorded_and_read():
    """ROCm's per-GPU HSA_OVERRIDE_GFX_VERSION_<n> was not read: with only it set, `train` refused an APU that it
    runs. The snapshot records it (doctor --json round trip) and doctor names it."""
    from sdplan.errors import NoGPUError
    from sdplan.launcher import require_gpu
    from sdplan.machine import Snapshot
    from sdplan.probe import software
    from sdplan.probe.snapshot import findings

    env = software.probe_env(
        {"HSA_OVERRIDE_GFX_VERSION_1": "10.3.0", "HSA_OVERRIDE_GFX_VERSION_X": "1", "HOME": "/"}
    )
    assert env["HSA_OVERRIDE_GFX_VERSION_1"] == "10.3.0" and "HSA_OVERRIDE_GFX_VERSION_X" not in env
    igpu_only = _with_igpu(machine(RTX4090), torch="2.7.0+rocm6.3", torch_build="rocm", rocm="6.3")
    igpu_only = replace(igpu_only, gpus=igpu_only.gpus[1:])
    with pytest.raises(NoGPUError):
        require_gpu(igpu_only)
    over = replace(igpu_only, env={**igpu_only.env, **env})
    over = Snapshot.from_dict(over.to_dict())
    assert over.env["HSA_OVERRIDE_GFX_VERSION_1"] == "10.3.0"
    require_gpu(over)
    (f,) = [f for f in findings(over) if f.code == "rocm_arch_override"]
    assert "HSA_OVERRIDE_GFX_VERSION_1=10.3.0 is set" in f.message
