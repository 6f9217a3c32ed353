"""The machine probe: backends against fake NVML/amdsmi modules, host/software readers, findings rules."""

from __future__ import annotations

import builtins
import os
import pathlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import fake_amdsmi, fake_pynvml

from sdplan.machine import GPU, Finding, Link, Snapshot
from sdplan.probe import amd, host, nvidia, snapshot, software
from sdplan.probe.snapshot import findings, refresh

MACHINES = Path(__file__).parent / "fixtures" / "machines"
FIXTURES = sorted(p.stem for p in MACHINES.glob("*.json"))


def load(name: str) -> Snapshot:
    return Snapshot.load(MACHINES / f"{name}.json")


def raw(name: str) -> dict:
    import json

    return json.loads((MACHINES / f"{name}.json").read_text())


@pytest.fixture
def no_devices(tmp_path) -> dict[str, str]:
    """Empty /sys, /proc and /dev roots: no evidence of any GPU."""
    roots = {"sys": tmp_path / "sys", "proc": tmp_path / "proc", "dev": tmp_path / "dev"}
    for p in roots.values():
        p.mkdir()
    return {k: str(v) for k, v in roots.items()}


def fake_pci(sys_root: Path, vendor: str, cls: str = "0x030000") -> None:
    dev = sys_root / "bus" / "pci" / "devices" / "0000:01:00.0"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    (dev / "class").write_text(cls + "\n")


# -- fixtures are what the issue asks for ------------------------------------------------------------


def test_fixture_set_is_complete():
    assert set(FIXTURES) >= {
        "2x_rtx4090_pcie",
        "8x_h100_sxm",
        "w6800",
        "rx6700xt",
        "rtx3060_12gb",
        "t4",
        "cpu_only",
    }


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_is_a_valid_snapshot_with_consistent_facts(name):
    s = load(name)
    assert s.to_dict() == raw(name)  # round-trips exactly: the fixture is `sdplan doctor --json` output
    for g in s.gpus:
        assert g.memory_free_bytes <= g.memory_total_bytes
        if g.vendor == "nvidia":
            assert g.bf16 == nvidia.bf16_supported(tuple(int(x) for x in g.compute_capability.split(".")))
        else:
            assert g.bf16 == amd.amd_bf16(g.gfx_arch)
    n = len(s.gpus)
    assert len(s.links) in (0, n * (n - 1) // 2)


# -- NVIDIA backend against the fake pynvml ----------------------------------------------------------


NVIDIA_FIXTURES = [n for n in FIXTURES if any(g["vendor"] == "nvidia" for g in raw(n)["gpus"])]
AMD_FIXTURES = [n for n in FIXTURES if any(g["vendor"] == "amd" for g in raw(n)["gpus"])]


@pytest.mark.parametrize("name", NVIDIA_FIXTURES)
def test_nvidia_backend_reads_fixture_exactly(name, monkeypatch, no_devices):
    state = fake_pynvml.install(monkeypatch, MACHINES / f"{name}.json")
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    s = load(name)
    assert reading.gpus == s.gpus
    assert reading.links == s.links
    assert reading.cuda_driver == s.software.cuda_driver
    assert reading.notes == ()
    assert state.init_count == 0, "nvmlShutdown must balance nvmlInit"


def test_nvidia_p2p_uses_literal_index_not_the_tuple_constant(monkeypatch, no_devices):
    fake_pynvml.install(monkeypatch, MACHINES / "2x_rtx4090_pcie.json")
    import pynvml

    assert pynvml.NVML_P2P_CAPS_INDEX_READ == (0,)  # the trap is present in the fake as in 13.615.71
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.links == (Link(0, 1, "pcie", False),)  # False, not None: the call succeeded


def test_nvidia_pcie_generation_is_the_link_capability_not_the_idle_state(monkeypatch, no_devices):
    fake_pynvml.install(monkeypatch, MACHINES / "t4.json")  # current gen reads 1 in the fake, max reads 3
    (gpu,) = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).gpus
    assert gpu.pcie_gen == 3


def test_nvidia_pcie_link_maximum_not_readable_is_not_available_not_the_idle_state(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "2x_rtx4090_pcie.json")  # current gen reads 1
    for name in ("nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"):

        def not_supported(*a):
            raise module.NVMLError_NotSupported()

        setattr(module, name, not_supported)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    gpus = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).gpus
    assert [(g.pcie_gen, g.pcie_width) for g in gpus] == [(None, None)] * 2  # not "gen1 x16"


def test_nvidia_missing_fields_become_none_not_zero(monkeypatch, no_devices):
    data = raw("t4")
    data["gpus"][0].update(pcie_gen=None, pcie_width=None, power_limit_watts=None, uuid=None)
    data["software"]["cuda_driver"] = None
    fake_pynvml.install(monkeypatch, data)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.power_limit_watts, gpu.uuid) == (None, None, None, None)
    assert reading.cuda_driver is None
    assert gpu.name == "Tesla T4" and gpu.memory_total_bytes == 16_106_127_360 and gpu.bf16 is False


def test_no_nvidia_driver_is_quiet_without_evidence(monkeypatch, no_devices):
    state = fake_pynvml.install(monkeypatch, MACHINES / "cpu_only.json")
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading == nvidia.NvidiaReading()
    assert state.calls == ["nvmlInit"]


def test_no_nvidia_driver_with_an_nvidia_gpu_on_the_bus_says_so(monkeypatch, no_devices):
    fake_pynvml.install(monkeypatch, MACHINES / "cpu_only.json")
    fake_pci(Path(no_devices["sys"]), "0x10de")
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.gpus == ()
    assert [n.code for n in reading.notes] == ["nvidia_driver_missing"]


def test_nvidia_driver_loaded_but_library_not_visible_is_a_container_hint(monkeypatch, no_devices):
    # a container started without --gpus: the host's module shows in /proc, its libnvidia-ml.so.1 does not
    fake_pynvml.install(monkeypatch, MACHINES / "cpu_only.json")
    fake_pci(Path(no_devices["sys"]), "0x10de")
    (Path(no_devices["proc"]) / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir(parents=True)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (note,) = reading.notes
    assert (note.severity, note.code) == ("error", "nvidia_library_not_visible")
    assert "driver is loaded" in note.message and "install the NVIDIA driver" not in note.fix
    assert "docker run --gpus all" in note.fix and "NVIDIA Container Toolkit" in note.fix


def test_nvml_bindings_not_installed(monkeypatch, no_devices):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    assert nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).gpus == ()
    fake_pci(Path(no_devices["sys"]), "0x10de")
    notes = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).notes
    assert [n.code for n in notes] == ["nvml_bindings_missing"]


def test_nvml_init_failure_other_than_no_library(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "t4.json")

    def init():
        raise module.NVMLError(module.NVML_ERROR_DRIVER_NOT_LOADED)

    module.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.gpus == ()
    assert [n.code for n in reading.notes] == ["nvml_init_failed"]
    assert "Driver Not Loaded" in reading.notes[0].message


def test_nvidia_unreadable_gpu_keeps_its_place(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "2x_rtx4090_pcie.json")
    real = module.nvmlDeviceGetHandleByIndex

    def handle(index):
        if index == 1:
            raise module.NVMLError(module.NVML_ERROR_GPU_IS_LOST)
        return real(index)

    module.nvmlDeviceGetHandleByIndex = handle
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert [g.index for g in reading.gpus] == [0, 1]
    assert reading.gpus[0].name == "NVIDIA GeForce RTX 4090"
    assert reading.gpus[1].memory_total_bytes is None and reading.gpus[1].name is None
    assert [n.code for n in reading.notes] == ["gpu_unreadable"]
    assert reading.links == ()


def test_nvidia_gpu_whose_memory_nvml_cannot_read_is_a_finding_naming_the_error(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "2x_rtx4090_pcie.json")
    real = module.nvmlDeviceGetMemoryInfo

    def memory(handle, *args):
        if handle.index == 1:
            raise module.NVMLError_GpuIsLost()
        return real(handle, *args)

    module.nvmlDeviceGetMemoryInfo = memory
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.gpus[1].name == "NVIDIA GeForce RTX 4090" and reading.gpus[1].memory_total_bytes is None
    (note,) = reading.notes
    assert (note.severity, note.code) == ("warning", "gpu_unreadable")
    assert note.message.startswith("NVIDIA GPU 1 (NVIDIA GeForce RTX 4090)")
    assert "NVMLError_GpuIsLost" in note.message and "left out of the plans" in note.message
    assert "nvidia-smi -q -i 1" in note.fix


def test_nvidia_handle_failure_names_the_nvml_error(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "2x_rtx4090_pcie.json")
    real = module.nvmlDeviceGetHandleByIndex

    def handle(index):
        if index == 1:
            raise module.NVMLError_NoPermission()
        return real(index)

    module.nvmlDeviceGetHandleByIndex = handle
    monkeypatch.setitem(sys.modules, "pynvml", module)
    (note,) = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).notes
    assert "NVMLError_NoPermission" in note.message


@pytest.mark.parametrize("error", ["NoPermission", "Unknown", "GpuIsLost"])
def test_nvidia_count_failure_is_its_own_error_not_a_missing_driver(error, monkeypatch, tmp_path):
    module, state = fake_pynvml.make_module(MACHINES / "2x_rtx4090_pcie.json")

    def count():
        raise getattr(module, f"NVMLError_{error}")()

    module.nvmlDeviceGetCount = count
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    reading = nvidia.probe()
    assert reading.gpus == () and reading.driver_version and reading.cuda_driver == "12.4"
    (note,) = reading.notes
    assert (note.severity, note.code) == ("error", "nvml_count_failed")
    assert f"NVMLError_{error}" in note.message and reading.driver_version in note.message
    assert state.init_count == 0
    snap = snapshot.probe(tmp_path)
    no_gpu = next(f for f in snap.findings if f.code == "no_gpu")
    assert "install the GPU driver" not in no_gpu.fix and "nvidia-smi" in no_gpu.fix


# MIG slices of an H100 80GB as nvidia-smi reports them (3g.40gb, 2g.20gb, 1g.10gb)
MIG_3G, MIG_2G, MIG_1G = 40_231_960_576, 20_937_965_568, 10_468_982_784


def test_nvidia_mig_mode_records_the_largest_slice_not_the_whole_card(monkeypatch, no_devices):
    slices = [(MIG_1G, MIG_1G - 2**28), (MIG_3G, MIG_3G - 2**29), (MIG_2G, MIG_2G)]
    state = fake_pynvml.install(monkeypatch, MACHINES / "h100_80gb_hbm3.json", mig={0: slices})
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert {"nvmlDeviceGetMigMode", "nvmlDeviceGetMigDeviceHandleByIndex"} <= set(state.calls)
    assert (gpu.mig, gpu.mig_slices) == (True, 3)
    assert (gpu.memory_total_bytes, gpu.memory_free_bytes) == (MIG_3G, MIG_3G - 2**29)
    assert gpu.compute_capability == "9.0" and gpu.bf16 is True
    assert reading.notes == ()
    assert state.init_count == 0


def test_mig_mode_is_a_finding_and_plans_use_the_slice():
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    s = load("h100_80gb_hbm3")
    card = s.gpus[0]
    mig = replace(
        s, gpus=(replace(card, mig=True, mig_slices=7, memory_total_bytes=MIG_1G, memory_free_bytes=MIG_1G),)
    )
    (f,) = [f for f in findings(mig) if f.code == "mig_enabled"]
    assert f.severity == "warning" and "MIG mode" in f.message and "7 MIG slices" in f.message
    assert "9.8 GiB" in f.message and "nvidia-smi -i 0 -mig 0" in f.fix and "MIG-<uuid>" in f.fix
    hw = hardware_from_snapshot(mig, load_profiles())
    assert [g.memory_bytes for g in hw.gpus] == [MIG_1G]
    assert any("MIG" in n and "times are the whole card's" in n for n in hw.notes)
    # the card is in the catalog by its name: a slice's memory is no other entry's and no unknown GPU
    assert hw.gpus[0].spec is not None and hw.gpus[0].spec.name == "H100 SXM"
    assert not any("not in the GPU catalog" in n for n in hw.notes)
    assert not [f for f in findings(replace(s, gpus=(replace(card, mig=False),))) if f.code == "mig_enabled"]


def test_mig_mode_without_a_readable_slice_is_an_error(monkeypatch, no_devices):
    fake_pynvml.install(monkeypatch, MACHINES / "h100_80gb_hbm3.json", mig={0: []})
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert (gpu.mig, gpu.mig_slices, gpu.memory_total_bytes) == (True, 0, None)
    assert reading.notes == ()  # the rule says it, not a gpu_unreadable note
    s = replace(load("h100_80gb_hbm3"), gpus=reading.gpus)
    fx = {f.code: f for f in findings(s)}
    assert fx["mig_enabled"].severity == "error" and "CUDA sees no device" in fx["mig_enabled"].message
    assert "nvidia-smi mig -cgi" in fx["mig_enabled"].fix
    assert "no_gpu" in fx


def _mig_memory_unreadable(module) -> None:
    """The fake NVML answers NotSupported for a MIG device's memory, as some drivers do."""
    card_memory = module.nvmlDeviceGetMemoryInfo

    def memory(handle, *a):
        if module.nvmlDeviceIsMigDeviceHandle(handle):
            raise module.NVMLError_NotSupported()
        return card_memory(handle, *a)

    module.nvmlDeviceGetMemoryInfo = memory


def test_mig_slices_whose_memory_nvml_cannot_read_exist_and_the_error_is_said(monkeypatch, no_devices):
    """NVML answering NotSupported for a MIG device's memory: the slices exist, so doctor neither says CUDA sees
    no device on the card nor tells the user to create GPU instances; it says NVML's error."""
    module, state = fake_pynvml.make_module(
        MACHINES / "h100_80gb_hbm3.json", mig={0: [(MIG_3G, MIG_3G), (MIG_2G, MIG_2G)]}
    )
    _mig_memory_unreadable(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert (gpu.mig, gpu.mig_slices, gpu.memory_total_bytes) == (True, 2, None)
    (note,) = reading.notes
    assert note.code == "gpu_unreadable" and "MIG slices' memory" in note.message
    assert "NVMLError_NotSupported" in note.message
    s = replace(load("h100_80gb_hbm3"), gpus=reading.gpus, findings=reading.notes)
    fx = {f.code: f for f in refresh(s).findings}
    mig = fx["mig_enabled"]
    assert mig.severity == "warning" and "2 MIG slices" in mig.message and "could not be read" in mig.message
    assert (
        "no MIG slice" not in mig.message
        and "-cgi" not in mig.fix
        and "CUDA sees no device" not in mig.message
    )
    assert "gpu_unreadable" in fx and "no_gpu" in fx
    # the card answers, its slices do not: no GPU reset is the fix, the slices' profiles and MIG's access are
    assert "nvidia-smi -r" not in fx["gpu_unreadable"].fix and "reset" not in fx["gpu_unreadable"].fix
    assert (
        "nvidia-smi mig -lgi -i 0" in fx["gpu_unreadable"].fix
        and "/dev/nvidia-caps" in fx["gpu_unreadable"].fix
    )
    from sdplan.doctor import gpu_rows

    assert "2 slices, memory not readable" in gpu_rows(s)[0][2]


def test_one_mig_slice_is_said_in_the_singular_and_no_profile_of_another_card_is_named(
    monkeypatch, no_devices
):
    """An A100 40GB in MIG mode with one slice: "1 slice", "its MIG slice's memory", never "1 slices" or "slice'
    memory"; no note or fix names 3g.40gb, a profile an A100 40GB has not (its 3g slice is 3g.20gb)."""
    from sdplan.doctor import gpu_rows
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    data = raw("h100_80gb_hbm3")
    data["gpus"][0].update(
        name="NVIDIA A100-SXM4-40GB", compute_capability="8.0", memory_total_bytes=40 * 2**30
    )
    module, state = fake_pynvml.make_module(data, mig={0: [(MIG_3G, MIG_3G)]})
    _mig_memory_unreadable(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    s = refresh(replace(load("h100_80gb_hbm3"), gpus=reading.gpus, findings=reading.notes))
    assert "(MIG mode: 1 slice, memory not readable)" in gpu_rows(s)[0][2]
    fx = {f.code: f for f in s.findings}
    assert "its MIG slice's memory" in fx["gpu_unreadable"].message
    assert "with 1 MIG slice, but its memory" in fx["mig_enabled"].message
    read = replace(s, gpus=(replace(s.gpus[0], memory_total_bytes=20 * 2**30, memory_free_bytes=None),))
    assert "(MIG: largest of 1 slice)" in gpu_rows(read)[0][2]
    said = [f.message + f.fix for f in refresh(read).findings + s.findings]
    said += list(hardware_from_snapshot(read, load_profiles()).notes)
    assert not [t for t in said if "3g.40gb" in t or "1 slices" in t or "slice' " in t], said


def test_mig_mode_off_or_not_supported_reads_as_before(monkeypatch, no_devices):
    data = raw("h100_80gb_hbm3")
    data["gpus"][0]["mig"] = False
    fake_pynvml.install(monkeypatch, data)
    (gpu,) = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"]).gpus
    assert (
        gpu.mig is False
        and gpu.mig_slices is None
        and gpu.memory_total_bytes == data["gpus"][0]["memory_total_bytes"]
    )


def test_bindings_without_the_mig_functions_read_as_before(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "h100_80gb_hbm3.json")
    for name in (
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
    ):
        delattr(module, name)  # nvidia-ml-py before 11.450
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.gpus == load("h100_80gb_hbm3").gpus
    (note,) = reading.notes
    assert note.code == "nvml_bindings_old" and "nvmlDeviceGetMigMode" in note.message
    # what that means, as no table shows it: the memory read is the whole card's, a MIG slice has less
    assert "whether a GPU is in MIG mode" in note.message and "read as the whole card's" in note.message
    assert "a run gets one MIG slice" in note.message and "n/a" not in note.message


def test_an_old_binding_on_a_card_in_mig_mode_says_its_memory_is_the_whole_cards(monkeypatch, no_devices):
    """An A100 80GB in MIG mode (two slices, 40 and 20 GiB) under a pynvml without the MIG calls: NVML's memory
    is the card's 80 GiB, which the plans use; the warning says MIG mode cannot be read and what that means, and
    each field it calls n/a is n/a in doctor's GPU table."""
    from sdplan.doctor import gpu_rows

    data = raw("h100_80gb_hbm3")
    data["gpus"][0].update(name="NVIDIA A100-SXM4-80GB", compute_capability="8.0", mig=True)
    module, state = fake_pynvml.make_module(
        data, mig={0: [(40 * 2**30, 39 * 2**30), (20 * 2**30, 19 * 2**30)]}
    )
    for name in OLD_BINDING_LACKS:
        delattr(module, name)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert gpu.mig is None and gpu.memory_total_bytes == data["gpus"][0]["memory_total_bytes"]
    (note,) = reading.notes
    assert "whether a GPU is in MIG mode" in note.message and "a fraction of the memory" in note.message
    assert "NVLink" not in note.message  # one GPU: no pair to read
    row = dict(
        zip(
            ("#", "name", "memory", "arch", "bf16", "fp16"),
            gpu_rows(replace(load("h100_80gb_hbm3"), gpus=(gpu,)))[0],
        )
    )
    assert "compute capability, and bf16 and fp16 by it (n/a under GPUs" in note.message
    assert (row["arch"], row["bf16"], row["fp16"]) == ("n/a", "n/a", "n/a")
    assert reading.cuda_driver is None  # this binding has neither CUDA version call: the note says so
    assert "the CUDA version the driver supports (n/a under Stack)" in note.message


# the functions nvidia-ml-py3 7.352.0's pynvml.py does not define; it returns names and versions as bytes
OLD_BINDING_LACKS = (
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetP2PStatus",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
)


def test_an_old_binding_without_functions_reads_them_as_not_available(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "8x_h100_sxm.json")
    for name in OLD_BINDING_LACKS:
        delattr(module, name)
    for name in ("nvmlDeviceGetName", "nvmlSystemGetDriverVersion"):
        text = getattr(module, name)
        setattr(module, name, lambda *a, text=text: text(*a).encode())
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    want = load("8x_h100_sxm")
    assert [g.name for g in reading.gpus] == [g.name for g in want.gpus]  # str, not b"..."
    assert reading.driver_version == want.gpus[0].driver_version
    assert [g.memory_total_bytes for g in reading.gpus] == [g.memory_total_bytes for g in want.gpus]
    assert all((g.compute_capability, g.bf16, g.fp16, g.mig) == (None,) * 4 for g in reading.gpus)
    assert reading.cuda_driver is None
    assert reading.links and all(lk.type == "pcie" and lk.p2p is None for lk in reading.links)
    (note,) = reading.notes
    assert note.code == "nvml_bindings_old" and note.severity == "warning"
    assert "nvmlDeviceGetP2PStatus" in note.message and "pip install -U nvidia-ml-py" in note.fix
    assert state.init_count == 0
    s = replace(want, gpus=reading.gpus, links=reading.links, findings=reading.notes)
    assert [f.code for f in findings(s)]  # the rules judge what was read without a crash


def test_an_old_binding_reads_the_cuda_driver_version_from_its_first_function(monkeypatch, no_devices):
    module, state = fake_pynvml.make_module(MACHINES / "t4.json")
    module.nvmlSystemGetCudaDriverVersion = module.nvmlSystemGetCudaDriverVersion_v2
    delattr(module, "nvmlSystemGetCudaDriverVersion_v2")
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    assert reading.cuda_driver == load("t4").software.cuda_driver
    assert not reading.notes  # nothing is left unread: no nvml_bindings_old warning


def test_snapshot_saved_before_the_mig_fields_still_loads():
    data = raw("h100_80gb_hbm3")
    for g in data["gpus"]:
        del g["mig"], g["mig_slices"]
    s = Snapshot.from_dict(data)
    assert s.gpus[0].mig is None and findings(s) == findings(load("h100_80gb_hbm3"))


@pytest.mark.parametrize(
    ("value", "expected"), [(12040, "12.4"), (12020, "12.2"), (11080, "11.8"), (13000, "13.0"), (0, None)]
)
def test_cuda_version_string(value, expected):
    assert nvidia.cuda_version_string(value) == expected


def test_nvidia_bf16_is_capability_8_or_newer():
    assert nvidia.bf16_supported((7, 5)) is False  # T4: torch says True by emulation
    assert nvidia.bf16_supported((7, 0)) is False  # V100
    assert nvidia.bf16_supported((8, 0)) is True
    assert nvidia.bf16_supported((8, 6)) is True
    assert nvidia.bf16_supported(None) is None


# -- AMD backend against the fake amdsmi -------------------------------------------------------------


@pytest.mark.parametrize("gfx_form", ["decimal", "name"])
@pytest.mark.parametrize("name", AMD_FIXTURES)
def test_amd_backend_reads_fixture_exactly(name, gfx_form, monkeypatch, no_devices):
    state = fake_amdsmi.install(monkeypatch, MACHINES / f"{name}.json", gfx_form=gfx_form)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    s = load(name)
    assert reading.gpus == s.gpus
    assert reading.links == s.links
    assert reading.rocm == s.software.rocm
    assert reading.notes == ()
    assert state.initialized is False, "amdsmi_shut_down must follow amdsmi_init"


def test_amd_cdna_decimal_arch_and_xgmi_links(monkeypatch, no_devices):
    """An MI210 pair: amdsmi reports gfx90a as "gfx9010"; XGMI links; bf16 yes."""
    data = raw("w6800")
    mi210 = dict(
        data["gpus"][0], name="AMD Instinct MI210", gfx_arch="gfx90a", bf16=True, power_limit_watts=300.0
    )
    data["gpus"] = [dict(mi210, index=0), dict(mi210, index=1, uuid="0bff740f-0000-1000-80d1-9e3c1a2b4c5d")]
    data["links"] = [{"a": 0, "b": 1, "type": "xgmi", "p2p": True}]
    state = fake_amdsmi.install(monkeypatch, data, gfx_form="decimal")
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    assert "amdsmi_get_gpu_asic_info" in state.calls
    assert [g.gfx_arch for g in reading.gpus] == ["gfx90a", "gfx90a"]
    assert all(g.bf16 for g in reading.gpus)
    assert reading.links == (Link(0, 1, "xgmi", True),)


def test_amd_gpus_carry_hips_numbers_where_amdsmi_lists_them_in_another_order(monkeypatch, no_devices):
    """amdsmi lists GPUs in its discovery order, HIP numbers them by KFD topology node: a pair whose second
    amdsmi GPU is HIP's device 0 (as on some MI350X hosts). The probe reads each GPU's KFD node and
    HIP_VISIBLE_DEVICES shows a process the GPU sdplan chose, by HIP's number."""
    from sdplan.machine import Snapshot

    data = raw("w6800")
    first = data["gpus"][0]
    data["gpus"] = [
        dict(first, index=0, hip_index=1, kfd_node=2),
        dict(first, index=1, uuid="0bff740f-1", hip_index=0, kfd_node=1),
    ]
    data["links"] = [{"a": 0, "b": 1, "type": "pcie", "p2p": False}]
    state = fake_amdsmi.install(monkeypatch, data)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    assert "amdsmi_get_gpu_kfd_info" in state.calls
    assert [g.hip_index for g in reading.gpus] == [1, 0]
    snap = Snapshot.from_dict(data)
    assert snap.gpus == reading.gpus  # the snapshot keeps it (doctor --save, --machine)
    assert snap.visible_devices([0]) == {"HIP_VISIBLE_DEVICES": "1"}
    assert snap.visible_devices([1, 0]) == {"HIP_VISIBLE_DEVICES": "0,1"}


@pytest.mark.parametrize(
    ("nodes", "want"),
    [
        ([1, 2, 3], [0, 1, 2]),
        ([3, 1, 2], [2, 0, 1]),
        ([2, 5], [0, 1]),  # not consecutive: HIP's numbers are dense, in node order
        ([1, None], [None, None]),  # one unknown: no map at all, amdsmi's order instead
        ([1, 1], [None, None]),
        ([], []),
    ],
)
def test_hip_numbers_from_kfd_nodes(nodes, want):
    assert amd.hip_indexes(nodes) == want


def test_amd_without_kfd_info_numbers_hip_devices_in_amdsmi_order(monkeypatch, no_devices):
    """Bindings without amdsmi_get_gpu_kfd_info (older amdsmi): no HIP number, so amdsmi's order, as before."""
    data = raw("w6800")
    w6800 = dict(data["gpus"][0], hip_index=None)
    data["gpus"] = [dict(w6800, index=0), dict(w6800, index=1, uuid="0bff740f-1")]
    data["links"] = [{"a": 0, "b": 1, "type": "pcie", "p2p": False}]
    module, _ = fake_amdsmi.make_module(data)
    del module.amdsmi_get_gpu_kfd_info
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    assert [g.hip_index for g in reading.gpus] == [None, None]
    from sdplan.machine import Snapshot

    snap = Snapshot.from_dict(data)
    assert snap.visible_devices([1]) == {"HIP_VISIBLE_DEVICES": "1"}


def test_amd_missing_power_and_pcie_become_none(monkeypatch, no_devices):
    data = raw("rx6700xt")
    data["gpus"][0].update(power_limit_watts=None, pcie_gen=None, pcie_width=None, driver_version=None)
    fake_amdsmi.install(monkeypatch, data)
    (gpu,) = amd.probe(
        sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"]
    ).gpus
    assert (gpu.power_limit_watts, gpu.pcie_gen, gpu.pcie_width, gpu.driver_version) == (
        None,
        None,
        None,
        None,
    )
    assert gpu.gfx_arch == "gfx1031" and gpu.memory_total_bytes == 12_868_124_672


def test_amd_pcie_width_is_the_links_maximum_not_its_current_width(monkeypatch, no_devices):
    module, state = fake_amdsmi.make_module(raw("rx6700xt"))
    info = module.amdsmi_get_pcie_info

    def narrow_idle_link(h):
        out = info(h)
        out["pcie_static"]["max_pcie_width"] = "N/A"
        out["pcie_metric"]["pcie_width"] = 4
        return out

    module.amdsmi_get_pcie_info = narrow_idle_link
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    (gpu,) = amd.probe(
        sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"]
    ).gpus
    assert gpu.pcie_width is None and gpu.pcie_gen == 4


def test_an_amdsmi_binding_without_functions_reads_them_as_not_available(monkeypatch, no_devices):
    """An older amdsmi without the byte-figure memory calls (and their enum), the PCIe, power and link calls:
    those fields are not available, never an AttributeError; memory comes from the MB figures."""
    module, state = fake_amdsmi.make_module(raw("rx6700xt"))
    for name in (
        "AmdSmiMemoryType",
        "amdsmi_get_gpu_memory_total",
        "amdsmi_get_gpu_memory_usage",
        "amdsmi_get_pcie_info",
        "amdsmi_get_power_cap_info",
        "amdsmi_topo_get_link_type",
        "amdsmi_is_P2P_accessible",
        "amdsmi_get_gpu_kfd_info",
        "amdsmi_get_rocm_version",
    ):
        delattr(module, name)
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    (gpu,) = reading.gpus
    assert (gpu.pcie_gen, gpu.pcie_width, gpu.power_limit_watts) == (None, None, None)
    assert gpu.gfx_arch == "gfx1031" and gpu.memory_total_bytes is not None


def test_an_amdsmi_binding_of_rocm_5_6_reads_the_gpu_by_its_older_names(monkeypatch, no_devices):
    """ROCm 5.5-5.6's amdsmi lists GPUs with amdsmi_get_device_handles (5.7+: amdsmi_get_processor_handles) and
    names the GPU's calls without "gpu_" (amdsmi_get_asic_info, amdsmi_dev_get_memory_total, ...): read by the
    new names alone the GPU vanished and doctor said only no_gpu. Its asic info has no arch: not available."""
    module, state = fake_amdsmi.make_module(raw("rx6700xt"))
    older = {
        "amdsmi_get_processor_handles": "amdsmi_get_device_handles",
        "amdsmi_get_gpu_asic_info": "amdsmi_get_asic_info",
        "amdsmi_get_gpu_device_uuid": "amdsmi_get_device_uuid",
        "amdsmi_get_gpu_memory_total": "amdsmi_dev_get_memory_total",
        "amdsmi_get_gpu_memory_usage": "amdsmi_dev_get_memory_usage",
        "amdsmi_get_gpu_vram_usage": "amdsmi_get_vram_usage",
    }
    for new, old in older.items():
        fn = getattr(module, new)
        if new == "amdsmi_get_gpu_asic_info":  # no target_graphics_version before ROCm 6.x
            fn = (lambda f: lambda h: {k: v for k, v in f(h).items() if k != "target_graphics_version"})(fn)
        setattr(module, old, fn)
        delattr(module, new)
    driver_info = module.amdsmi_get_gpu_driver_info
    module.amdsmi_get_driver_version = lambda h: driver_info(h)["driver_version"]  # a string, 5.x
    for name in ("amdsmi_get_gpu_driver_info", "amdsmi_get_gpu_kfd_info", "amdsmi_get_pcie_info"):
        delattr(module, name)
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    (gpu,) = reading.gpus
    want = raw("rx6700xt")["gpus"][0]
    assert (gpu.name, gpu.uuid, gpu.memory_total_bytes) == (
        want["name"],
        want["uuid"],
        want["memory_total_bytes"],
    )
    assert gpu.driver_version == want["driver_version"] and gpu.gfx_arch is None and gpu.bf16 is None
    assert not reading.notes


def test_amdsmi_not_installed_is_quiet_without_an_amd_gpu(monkeypatch, no_devices):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    assert reading == amd.AmdReading()


def test_amdsmi_not_installed_with_an_amd_gpu_gives_an_info_note(monkeypatch, no_devices, tmp_path):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    (Path(no_devices["dev"]) / "kfd").write_text("")
    rocm = tmp_path / "rocm" / ".info"
    rocm.mkdir(parents=True)
    (rocm / "version").write_text("6.2.4-120\n")
    reading = amd.probe(
        sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=str(tmp_path / "rocm")
    )
    assert reading.gpus == ()
    assert [(n.severity, n.code) for n in reading.notes] == [("info", "amdsmi_missing")]
    assert reading.rocm == "6.2.4"


def test_amdsmi_without_its_library_prints_nothing(monkeypatch, no_devices, tmp_path, capsys):
    """amdsmi's wrapper prints to stdout and raises KeyError when libamd_smi.so is missing."""
    pkg = tmp_path / "site" / "amdsmi"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "print('Unable to find amdsmi library try installing amd-smi-lib from your package manager')\n"
        "raise KeyError('libamd_smi.so')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    fake_pci(Path(no_devices["sys"]), "0x1002")
    reading = amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"])
    assert capsys.readouterr().out == ""
    assert [n.code for n in reading.notes] == ["amdsmi_missing"]
    assert "KeyError" in reading.notes[0].message


def test_amdsmi_init_failure_with_an_amd_gpu(monkeypatch, no_devices):
    fake_amdsmi.install(monkeypatch, MACHINES / "cpu_only.json")  # no AMD GPUs: init says driver not loaded
    assert (
        amd.probe(sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"]).notes
        == ()
    )
    (Path(no_devices["dev"]) / "kfd").write_text("")
    notes = amd.probe(
        sys_root=no_devices["sys"], dev_root=no_devices["dev"], rocm_root=no_devices["proc"]
    ).notes
    assert [n.code for n in notes] == ["amdsmi_init_failed"]
    assert "\n" not in notes[0].message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("gfx90a", "gfx90a"),
        ("gfx1030", "gfx1030"),
        ("gfx942:sramecc+:xnack-", "gfx942"),
        ("90a", "gfx90a"),
        (1030, "gfx1030"),
        ("1031", "gfx1031"),
        ("gfx9010", "gfx90a"),  # amdsmi's decimal rendering of KFD 90010
        ("gfx9008", "gfx908"),
        ("gfx9006", "gfx906"),
        ("gfx11000", "gfx1100"),
        ("gfx11001", "gfx1101"),
        ("gfx12001", "gfx1201"),
        ("gfx1151", "gfx1151"),
        (90010, "gfx90a"),  # KFD gfx_target_version
        (90402, "gfx942"),
        (100300, "gfx1030"),
        (110001, "gfx1101"),
        ("gfx18446744073709551615", None),  # UINT64_MAX: not supported
        ("N/A", None),
        (None, None),
        ("", None),
    ],
)
def test_parse_gfx_arch(value, expected):
    assert amd.parse_gfx_arch(value) == expected


@pytest.mark.parametrize(
    ("arch", "bf16"),
    [
        ("gfx1010", False),  # RDNA1
        ("gfx1030", False),  # RDNA2
        ("gfx1031", False),
        ("gfx1100", True),  # RDNA3
        ("gfx1151", True),  # RDNA3.5
        ("gfx1201", True),  # RDNA4
        ("gfx908", True),  # CDNA1
        ("gfx90a", True),  # CDNA2
        ("gfx942", True),  # CDNA3
        ("gfx950", True),
        ("gfx906", False),  # Vega 20
        ("gfx803", False),
        (None, None),
    ],
)
def test_amd_bf16_by_arch(arch, bf16):
    assert amd.amd_bf16(arch) is bf16


def test_rocm_version_string_forms():
    assert amd.rocm_version_string((True, "6.3.1")) == "6.3.1"
    assert amd.rocm_version_string((False, "librocm-core.so not found")) is None
    assert amd.rocm_version_string("6.4.0-47") == "6.4.0"
    assert amd.rocm_version_string(None) is None


# -- a whole machine through both fakes ------------------------------------------------------------------


def test_probe_mixed_vendor_machine_numbers_gpus_across_backends(monkeypatch, tmp_path):
    data = raw("2x_rtx4090_pcie")
    w6800 = dict(raw("w6800")["gpus"][0], index=2)
    data["gpus"].append(w6800)
    data["software"]["rocm"] = "6.2.4"
    fake_pynvml.install(monkeypatch, data)
    fake_amdsmi.install(monkeypatch, data)
    s = snapshot.probe(tmp_path)
    assert [(g.index, g.vendor) for g in s.gpus] == [(0, "nvidia"), (1, "nvidia"), (2, "amd")]
    assert s.gpus[2].name == "AMD Radeon PRO W6800"
    assert s.software.cuda_driver == "12.4" and s.software.rocm == "6.2.4"
    codes = {f.code for f in s.findings}
    assert "multi_gpu_slow_link" in codes
    # one torch build drives a run: the two RTX 4090s and the W6800 never train together, so they are no mix;
    # with this CPU torch the run a GPU build would make is on the vendor with the most memory (the 4090s'
    # 48 GiB), so the W6800's missing bf16 is no problem of it
    assert "mixed_gpus" not in codes and "links_unknown" not in codes and "bf16_unavailable" not in codes
    assert "cu126" in next(f for f in s.findings if f.code == "torch_cpu_build").fix


@pytest.mark.parametrize("name", FIXTURES)
def test_probe_through_fakes_gives_the_fixture_findings(name, monkeypatch, tmp_path):
    """probe() on a fixture's GPUs finds what findings() finds on the fixture for the GPU-side rules."""
    fake_pynvml.install(monkeypatch, MACHINES / f"{name}.json")
    fake_amdsmi.install(monkeypatch, MACHINES / f"{name}.json")
    live = snapshot.probe(tmp_path)
    expected = load(name)
    assert live.gpus == expected.gpus and live.links == expected.links
    gpu_side = {"no_gpu", "mixed_gpus", "multi_gpu_slow_link", "bf16_unavailable", "rocm_arch_unsupported"}
    want = {f.code for f in findings(replace(expected, env=live.env, software=live.software))} & gpu_side
    assert {f.code for f in live.findings} & gpu_side == want


# -- host and software readers ---------------------------------------------------------------------------


def test_meminfo_is_read_in_bytes(tmp_path):
    (tmp_path / "meminfo").write_text(
        "MemTotal:       24684084 kB\nMemFree:        23293276 kB\nMemAvailable:   24079616 kB\nHugePages_Total:       0\n"
    )
    info = host.read_meminfo_bytes(tmp_path / "meminfo")
    assert info["MemTotal"] == 24684084 * 1024
    assert info["MemAvailable"] == 24079616 * 1024
    assert info["HugePages_Total"] == 0
    assert host.read_meminfo_bytes(tmp_path / "missing") == {}


def test_host_probe_with_missing_sources_gives_none(tmp_path):
    h = host.probe_host(tmp_path, proc=str(tmp_path / "noproc"), shm=str(tmp_path / "noshm"))
    assert h.ram_total_bytes is None and h.ram_available_bytes is None and h.shm_bytes is None
    assert h.disk_free_bytes is not None and h.disk_free_bytes > 0


def test_disk_free_of_a_path_not_created_yet(tmp_path):
    st = os.statvfs(tmp_path)
    free = host.disk_free_bytes(tmp_path / "out" / "run1")
    assert abs(free - st.f_bavail * st.f_frsize) < 256 * 2**20


def test_cpu_model_x86_and_arm(tmp_path):
    (tmp_path / "x86").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n")
    (tmp_path / "arm").write_text(
        "processor\t: 0\nBogoMIPS\t: 50.00\nModel\t: Raspberry Pi 5 Model B Rev 1.0\n"
    )
    assert host.cpu_model(tmp_path / "x86") == "AMD EPYC 7B13"
    assert host.cpu_model(tmp_path / "arm") == "Raspberry Pi 5 Model B Rev 1.0"


def test_pci_display_vendors_only_counts_display_controllers(tmp_path):
    fake_pci(tmp_path, "0x1002")
    other = tmp_path / "bus" / "pci" / "devices" / "0000:00:14.0"
    other.mkdir()
    (other / "vendor").write_text("0x10de\n")
    (other / "class").write_text("0x0c0330\n")  # a USB controller
    assert host.pci_display_vendors(str(tmp_path)) == {"0x1002"}
    assert host.pci_display_vendors(str(tmp_path / "none")) == set()


def _cgroup_tree(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return str(root)


def test_cgroup_memory_limit(tmp_path):
    (tmp_path / "cgroup").write_text("0::/docker/abc\n")
    box = tmp_path / "fs" / "docker" / "abc"
    box.mkdir(parents=True)
    (box / "memory.max").write_text("8589934592\n")
    assert host.cgroup_memory_limit_bytes(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == 8 * 2**30
    (box / "memory.max").write_text("max\n")
    assert host.cgroup_memory_limit_bytes(str(tmp_path / "fs"), str(tmp_path / "cgroup")) is None


@pytest.mark.parametrize(
    "self_cgroup, files",
    [
        # cgroup v1: the memory controller's own line names the job's cgroup (a Slurm job), with or without v2
        (
            "11:memory:/slurm/uid_1000/job_42\n1:name=systemd:/\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/slurm/uid_1000/job_42/memory.limit_in_bytes": "8589934592",
            },
        ),
        (
            "11:memory:/slurm/uid_1000/job_42\n0::/\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/slurm/uid_1000/job_42/memory.limit_in_bytes": "8589934592",
            },
        ),
        # v1 with a combined controller mount line and the limit on the job, the step below it unlimited
        (
            "4:cpu,memory:/slurm/job_42/step_0\n",
            {
                "memory/slurm/job_42/memory.limit_in_bytes": "8589934592",
                "memory/slurm/job_42/step_0/memory.limit_in_bytes": "9223372036854771712",
            },
        ),
        # v1 docker without a cgroup namespace: the host's path is not mounted, the container's cgroup is the root
        ("4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": "8589934592"}),
        # v2: the limit on a parent binds its child whose own file says max
        ("0::/parent/child\n", {"parent/memory.max": "8589934592", "parent/child/memory.max": "max"}),
        # v2: the smallest on the way up binds
        ("0::/a/b\n", {"a/memory.max": "17179869184", "a/b/memory.max": "8589934592"}),
    ],
)
def test_cgroup_limit_of_v1_and_v2_and_of_ancestors(tmp_path, self_cgroup, files):
    (tmp_path / "cgroup").write_text(self_cgroup)
    root = _cgroup_tree(tmp_path / "fs", files)
    assert host.cgroup_memory_limit_bytes(root, str(tmp_path / "cgroup")) == 8 * 2**30


def test_cgroup_limit_unreadable_or_garbage_is_not_available(tmp_path):
    assert host.cgroup_memory_limit_bytes(str(tmp_path / "none"), str(tmp_path / "none")) is None
    (tmp_path / "cgroup").write_bytes(b"\xff\xfe garbage\n0::/x\n")
    root = _cgroup_tree(tmp_path / "fs", {"x/memory.max": "lots", "memory.max": "0"})
    assert host.cgroup_memory_limit_bytes(root, str(tmp_path / "cgroup")) is None
    (tmp_path / "fs" / "x" / "memory.max").unlink()
    (tmp_path / "fs" / "x" / "memory.max").mkdir()  # a folder where a file should be
    assert host.cgroup_memory_limit_bytes(root, str(tmp_path / "cgroup")) is None


def test_host_probe_records_the_cgroup_limit(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       24641536 kB\nMemAvailable:   20000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    root = _cgroup_tree(tmp_path / "fs", {"memory.max": "max", "job/memory.max": "8589934592"})
    h = host.probe_host(tmp_path, proc=str(proc), shm=str(tmp_path), cgroup_root=root)
    assert h.ram_total_bytes == 24641536 * 1024
    assert h.ram_limit_bytes == 8 * 2**30
    assert h.ram_usable_bytes == 8 * 2**30


def test_rules_and_planner_use_the_cgroup_limit_not_memtotal():
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    s = load("2x_rtx4090_pcie")
    assert s.host.ram_total_bytes > snapshot.RAM_COMFORT_BYTES
    assert not {f.code for f in findings(s)} & {"ram_insufficient", "ram_low", "ram_cgroup_limit"}
    capped = replace(s, host=replace(s.host, ram_limit_bytes=8 * 2**30))
    fx = {f.code: f for f in findings(capped)}
    assert fx["ram_insufficient"].severity == "warning"
    assert "8.0 GiB RAM (this process's cgroup memory limit" in fx["ram_insufficient"].message
    assert "--memory" in fx["ram_insufficient"].fix
    assert hardware_from_snapshot(capped, load_profiles()).ram_usable_bytes == 8 * 2**30
    roomy = replace(s, host=replace(s.host, ram_limit_bytes=48 * 2**30))
    assert [f.code for f in findings(roomy) if f.code.startswith("ram")] == ["ram_cgroup_limit"]
    above = replace(s, host=replace(s.host, ram_limit_bytes=s.host.ram_total_bytes * 2))
    assert not [f for f in findings(above) if f.code.startswith("ram")]


def test_snapshot_saved_before_the_cgroup_field_still_loads():
    data = raw("2x_rtx4090_pcie")
    del data["host"]["ram_limit_bytes"]
    s = Snapshot.from_dict(data)
    assert s.host.ram_limit_bytes is None
    assert s.host.ram_usable_bytes == s.host.ram_total_bytes


def test_torch_version_file_is_parsed_not_imported():
    text_cuda = (
        "from typing import Optional\n__version__ = '2.5.1+cu124'\ndebug = False\n"
        "cuda: Optional[str] = '12.4'\nhip: Optional[str] = None\n"
    )
    text_rocm = "__version__ = '2.5.1+rocm6.2'\ncuda = None\nhip = '6.2.41133-dd7f95766'\n"
    assert software.parse_version_py(text_cuda) == {"__version__": "2.5.1+cu124", "cuda": "12.4", "hip": None}
    assert software.parse_version_py(text_rocm)["hip"] == "6.2.41133-dd7f95766"
    assert software.parse_version_py("def broken(:") == {}


def test_software_probe_on_this_machine_does_not_import_torch():
    import subprocess

    code = (
        "import sys\nfrom sdplan.probe.software import probe_software\ns = probe_software()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import importlib.metadata as m\n"
        "assert s.torch == m.version('torch'), (s.torch, m.version('torch'))\n"
        "print(s.torch_build)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import torch  # now compare with what torch itself says

    want = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    assert out.stdout.strip() == want


def test_missing_package_versions_are_none():
    assert software.dist_version("no-such-package-sdplan-test") is None
    assert software.package_versions(("typer",))["typer"]


def test_env_reads_only_the_known_keys():
    env = software.probe_env({"HSA_OVERRIDE_GFX_VERSION": "10.3.0", "HOME": "/root"})
    assert env["HSA_OVERRIDE_GFX_VERSION"] == "10.3.0" and "HOME" not in env
    assert env["CUDA_VISIBLE_DEVICES"] is None


# -- findings rules on the fixture machines --------------------------------------------------------------

EXPECTED = {
    "2x_rtx4090_pcie": {("warning", "multi_gpu_slow_link")},
    "8x_h100_sxm": set(),
    "h100_80gb_hbm3": set(),  # the real `sdplan doctor --json` of a lent H100 (2026-11-26): nothing wrong
    "w6800": {("warning", "bf16_unavailable")},
    "rx6700xt": {
        ("error", "rocm_arch_unsupported"),
        ("warning", "amd_kernel_old"),
        ("warning", "bf16_unavailable"),
    },
    "rtx3060_12gb": {("error", "torch_cpu_build"), ("warning", "ram_low"), ("warning", "disk_low")},
    "t4": {("warning", "cuda_driver_too_old"), ("warning", "bf16_unavailable"), ("warning", "ram_low")},
    "cpu_only": {
        ("error", "no_gpu"),
        ("warning", "torch_missing"),
        ("warning", "ram_insufficient"),
        ("warning", "shm_small"),
    },
}


def test_every_fixture_has_expectations():
    assert set(EXPECTED) == set(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_findings(name):
    got = findings(load(name))
    assert {(f.severity, f.code) for f in got} == EXPECTED[name]
    for f in got:
        assert f.message and f.fix and "\n" not in f.message + f.fix
        assert f.code in snapshot.RULE_CODES


def test_findings_name_the_fix_per_machine():
    fx = {f.code: f for f in findings(load("rx6700xt"))}
    assert "HSA_OVERRIDE_GFX_VERSION=10.3.0" in fx["rocm_arch_unsupported"].fix
    # a 12.4 driver runs cu126 under CUDA minor-version compatibility (any 12.x driver from 525.60.13)
    fx = {f.code: f for f in findings(load("rtx3060_12gb"))}
    assert fx["torch_cpu_build"].fix == (
        "pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu126"
    )
    # torch cu124 under a CUDA 12.2 driver runs (minor-version compatibility): no other torch, a newer driver
    fx = {f.code: f for f in findings(load("t4"))}
    assert fx["cuda_driver_too_old"].severity == "warning"
    assert "pip install" not in fx["cuda_driver_too_old"].fix
    assert "update the NVIDIA driver to one for CUDA 12.4 or newer" in fx["cuda_driver_too_old"].fix


def _laptop_with_an_amd_igpu(torch_build: str | None) -> Snapshot:
    """An RTX 3060 beside an AMD Radeon 780M iGPU (gfx1103, no ROCm wheel kernels) that amdsmi lists."""
    data = raw("rtx3060_12gb")
    igpu = dict(raw("rx6700xt")["gpus"][0], index=1, name="AMD Radeon 780M", gfx_arch="gfx1103", bf16=True)
    igpu.update(memory_total_bytes=512 * 2**20, memory_free_bytes=100 * 2**20)  # the desktop holds most of it
    data["gpus"].append(igpu)
    builds = {
        "cuda": {"torch": "2.5.1+cu124", "cuda_runtime": "12.4"},
        "rocm": {"torch": "2.5.1+rocm6.2", "hip_runtime": "6.2"},
    }
    data["software"].update(torch_build=torch_build, **builds.get(torch_build, {}))
    return Snapshot.from_dict(data)


def test_a_cuda_build_beside_an_amd_igpu_judges_only_the_nvidia_gpu():
    """A CUDA torch never runs on the laptop's AMD iGPU (the planner plans the NVIDIA GPU only): no false ROCm arch
    error, no mix of an NVIDIA and an AMD GPU, no unknown cross-vendor link, no busy iGPU."""
    s = _laptop_with_an_amd_igpu("cuda")
    codes = {f.code for f in findings(s)}
    assert not codes & {"rocm_arch_unsupported", "mixed_gpus", "links_unknown", "gpu_memory_in_use"}
    assert not [f for f in findings(s) if f.severity == "error"]
    # a ROCm build drives the iGPU: its arch is judged; the two vendors still never count as one mix
    rocm = {f.code for f in findings(_laptop_with_an_amd_igpu("rocm"))}
    assert "rocm_arch_unsupported" in rocm and not rocm & {"mixed_gpus", "links_unknown"}


@pytest.mark.parametrize("build", [None, "cpu"])
def test_no_gpu_build_beside_an_amd_igpu_judges_the_gpu_a_gpu_build_would_train_on(build):
    """No torch, or a CPU one: the run a GPU build would make is on the NVIDIA GPU (the most memory), so the fix
    installs a CUDA build and the iGPU's gfx1103 is no error (it gave `rocm_arch_unsupported`, exit 1, and a fix
    offering ROCm); the planner plans the same GPU and says the iGPU is not planned."""
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    s = _laptop_with_an_amd_igpu(build)
    if build is None:
        s = replace(s, software=replace(s.software, torch=None))
    assert [g.vendor for g in snapshot.trained_gpus(s)] == ["nvidia"]
    got = {f.code: f for f in findings(s)}
    errors = {code for code, f in got.items() if f.severity == "error"}
    assert errors == (set() if build is None else {"torch_cpu_build"}), errors  # no rocm_arch_unsupported
    torch = got["torch_missing" if build is None else "torch_cpu_build"]
    assert "download.pytorch.org/whl/cu" in torch.fix and "ROCm" not in torch.fix, torch.fix
    hw = hardware_from_snapshot(s, load_profiles())
    assert [g.vendor for g in hw.gpus] == ["nvidia"]
    assert any("GPU 1 (AMD Radeon 780M) is not planned" in n and "most memory" in n for n in hw.notes), (
        hw.notes
    )


def test_a_cuda_build_whose_nvidia_gpu_is_unreadable_is_not_told_to_use_rocm_on_the_igpu():
    """A CUDA torch, NVML unable to read the NVIDIA GPU's memory, and the AMD iGPU readable: the run would still
    be on the NVIDIA GPU, never the iGPU, so no `torch_build_mismatch` (it told the user to reinstall torch for
    ROCm) and no ROCm arch error: no usable GPU for this torch (no_gpu), and the planner plans none."""
    from sdplan.planner import hardware_from_snapshot
    from sdplan.profiles import load_profiles

    s = _laptop_with_an_amd_igpu("cuda")
    s = replace(s, gpus=(replace(s.gpus[0], memory_total_bytes=None), s.gpus[1]))
    assert snapshot.trained_gpus(s) == ()
    got = {f.code: f for f in findings(s)}
    assert not got.keys() & {"torch_build_mismatch", "rocm_arch_unsupported"}, got
    assert got["no_gpu"].severity == "error"
    assert "1 NVIDIA GPU found but its memory could not be read" in got["no_gpu"].message
    assert "rocm" not in got["no_gpu"].fix.lower()
    hw = hardware_from_snapshot(s, load_profiles())
    assert hw.gpus == () and any("whose memory could not be read" in n for n in hw.notes), hw.notes
    # a CUDA build on a machine with AMD GPUs only is still the mismatch, told to install ROCm's
    amd_only = replace(s, gpus=(replace(s.gpus[1], index=0),))
    mismatch = {f.code: f for f in findings(amd_only)}["torch_build_mismatch"]
    assert "ROCm build" in mismatch.fix, mismatch.fix


def test_a_cuda_build_beside_an_amd_igpu_gets_doctor_exit_zero(tmp_path):
    from typer.testing import CliRunner

    from sdplan.cli import app

    path = tmp_path / "laptop.json"
    _laptop_with_an_amd_igpu("cuda").save(path)
    result = CliRunner().invoke(app, ["doctor", "--machine", str(path)])
    assert result.exit_code == 0, result.output
    assert "rocm_arch_unsupported" not in result.output and "mixed_gpus" not in result.output


def test_a_gtx_16_card_is_told_to_train_in_fp32_not_fp16():
    """GTX 16 cards (compute capability 7.5, NVML name "NVIDIA GeForce GTX 16..."): fp16 mixed precision gives NaN
    losses there, so the finding says fp32; an RTX 2080 Ti (7.5 too, tensor cores) keeps the fp16 advice."""
    t4 = load("t4")
    gtx = replace(t4.gpus[0], name="NVIDIA GeForce GTX 1650 Ti", compute_capability="7.5", bf16=False)
    rtx = replace(
        t4.gpus[0], index=1, name="NVIDIA GeForce RTX 2080 Ti", compute_capability="7.5", bf16=False
    )
    fx = {f.code: f for f in findings(replace(t4, gpus=(gtx,)))}
    assert "bf16_unavailable" not in fx and "mixed_precision no" in fx["fp16_nan"].fix
    assert fx["fp16_nan"].message.startswith("NVIDIA GeForce GTX 1650 Ti has no hardware bf16, and fp16")
    both = {f.code: f for f in findings(replace(t4, gpus=(gtx, rtx)))}
    assert both["bf16_unavailable"].message.startswith("NVIDIA GeForce RTX 2080 Ti has no hardware bf16 (")
    assert both["fp16_nan"].message.startswith("NVIDIA GeForce GTX 1650 Ti has")


@pytest.mark.parametrize(
    ("cc", "torch", "cuda", "lacks"),
    [
        ("6.1", "2.9.0+cu130", "13.0", "CUDA 13 compiles nothing below compute capability 7.5"),
        ("7.0", "2.11.0+cu130", "13.0", "CUDA 13 compiles nothing below compute capability 7.5"),
        ("7.5", "2.11.0+cu130", "13.0", None),  # Turing: still built
        ("12.0", "2.5.1+cu124", "12.4", "Blackwell GPUs need a torch built for CUDA 12.8 or newer"),
        ("10.0", "2.7.0+cu126", "12.6", "Blackwell GPUs need a torch built for CUDA 12.8 or newer"),
        ("12.0", "2.8.0+cu128", "12.8", None),
        ("6.1", "2.8.0+cu128", "12.8", "PyTorch's CUDA 12.8 wheels dropped Maxwell and Pascal in torch 2.8"),
        ("5.2", "2.10.0+cu129", "12.9", "PyTorch's CUDA 12.9 wheels dropped Maxwell and Pascal in torch 2.8"),
        ("6.1", "2.7.1+cu128", "12.8", None),  # before 2.8: not said
        ("6.1", "2.8.0+cu126", "12.6", None),  # cu126 keeps Maxwell and Pascal
        ("8.9", "2.13.0+cu130", "13.0", None),
        ("7.0", "2.11.0+cu128", "12.8", "PyTorch's CUDA 12.8 wheels dropped Volta in torch 2.11"),
        ("7.0", "2.10.0+cu128", "12.8", None),  # before 2.11: not said
        ("7.0", "2.11.0+cu126", "12.6", None),  # cu126 keeps Volta
        ("7.5", "2.11.0+cu128", "12.8", None),  # Turing: still built
        (None, "2.8.0+cu128", "12.8", None),
    ],
)
def test_torch_cuda_lacks_the_gpus_its_wheels_have_no_kernels_for(cc, torch, cuda, lacks):
    got = snapshot.torch_cuda_lacks(cc, torch, cuda)
    assert (got is None) if lacks is None else got.startswith(lacks), got


def test_a_torch_without_kernels_for_the_gpu_is_an_error_with_the_build_to_install():
    """A GTX 1080 Ti under torch 2.8 cu128, an RTX 5090 under cu124: 'no kernel image is available' at the first
    CUDA call; doctor says so, and which index has the kernels where this driver runs it."""
    t4 = load("t4")
    pascal = replace(t4.gpus[0], name="NVIDIA GeForce GTX 1080 Ti", compute_capability="6.1")
    sw = replace(t4.software, torch="2.8.0+cu128", cuda_runtime="12.8", cuda_driver="12.9")
    fx = {f.code: f for f in findings(replace(t4, gpus=(pascal,), software=sw))}
    f = fx["torch_arch_unsupported"]
    assert f.severity == "error" and "NVIDIA GeForce GTX 1080 Ti (compute capability 6.1)" in f.message
    assert f.fix.endswith("whl/cu126")
    blackwell = replace(t4.gpus[0], name="NVIDIA GeForce RTX 5090", compute_capability="12.0")
    old = replace(t4.software, torch="2.5.1+cu124", cuda_runtime="12.4", cuda_driver="12.9")
    fx = {f.code: f for f in findings(replace(t4, gpus=(blackwell,), software=old))}
    # torch publishes no CUDA 12.8 build since 2.12; its last cu128 release runs under this 12.9 driver
    assert fx["torch_arch_unsupported"].fix == (
        'pip install --force-reinstall "torch==2.11.*" --index-url https://download.pytorch.org/whl/cu128'
    )
    newer_driver = replace(old, cuda_driver="13.0")
    fx = {f.code: f for f in findings(replace(t4, gpus=(blackwell,), software=newer_driver))}
    assert fx["torch_arch_unsupported"].fix.endswith(
        "torch --index-url https://download.pytorch.org/whl/cu130"
    )
    too_old_driver = replace(old, cuda_driver="12.4")
    fx = {f.code: f for f in findings(replace(t4, gpus=(blackwell,), software=too_old_driver))}
    assert fx["torch_arch_unsupported"].fix.startswith("update the NVIDIA driver to one for CUDA 12.8")
    assert "torch_arch_unsupported" not in {f.code for f in findings(t4)}  # a T4 under cu124
    # no torch yet: the install doctor prints is one with the GPU's kernels (cu126 for Pascal, not cu129)
    bare = replace(t4.software, torch=None, torch_build=None, cuda_runtime=None, cuda_driver="12.9")
    fx = {f.code: f for f in findings(replace(t4, gpus=(pascal,), software=bare))}
    assert fx["torch_missing"].fix.endswith("whl/cu126")
    fx = {f.code: f for f in findings(replace(t4, software=bare))}  # a T4: the newest build the driver runs
    assert fx["torch_missing"].fix == "pip install torch --index-url https://download.pytorch.org/whl/cu126"
    fx = {f.code: f for f in findings(replace(t4, software=replace(bare, cuda_driver="13.1")))}
    assert fx["torch_missing"].fix == "pip install torch --index-url https://download.pytorch.org/whl/cu130"
    # a V100 under torch 2.11's cu128 build (Volta left it in 2.11): cu126, which keeps it, under this driver
    volta = replace(t4.gpus[0], name="Tesla V100-SXM2-16GB", compute_capability="7.0")
    sw = replace(t4.software, torch="2.11.0+cu128", cuda_runtime="12.8", cuda_driver="12.8")
    fx = {f.code: f for f in findings(replace(t4, gpus=(volta,), software=sw))}
    assert "dropped Volta in torch 2.11" in fx["torch_arch_unsupported"].message
    assert fx["torch_arch_unsupported"].fix.endswith(
        "torch --index-url https://download.pytorch.org/whl/cu126"
    )


def test_findings_is_pure(monkeypatch):
    def no_io(*args, **kwargs):
        raise AssertionError("findings() did I/O")

    snaps = [load(n) for n in FIXTURES]
    monkeypatch.setattr(builtins, "open", no_io)
    monkeypatch.setattr(os, "statvfs", no_io)
    monkeypatch.setattr(os, "stat", no_io)
    monkeypatch.setattr(pathlib.Path, "read_text", no_io)
    for s in snaps:
        assert findings(s) == findings(s)


def test_cuda_major_mismatch_is_an_error():
    s = load("t4")
    s = replace(s, software=replace(s.software, cuda_runtime="13.0", torch="2.9.0+cu130"))
    (f,) = [f for f in findings(s) if f.code == "cuda_driver_too_old"]
    assert f.severity == "error"
    assert "pip install --force-reinstall" in f.fix  # CUDA will not start: another torch is a fix


@pytest.mark.parametrize(
    ("driver", "torch", "runtime", "severity", "fix"),
    [
        # a CUDA 13 build under a 12.2 driver: cu126 runs there (minor-version compatibility), not 2.7's cu118
        ("12.2", "2.9.0+cu130", "13.0", "error", "or pip install --force-reinstall torch --index-url "),
        # a CUDA 12 build under an 11.4 driver: no CUDA 12 or 13 build starts; 2.7's cu118 does
        (
            "11.4",
            "2.4.1+cu121",
            "12.1",
            "error",
            '"torch==2.7.*" --index-url https://download.pytorch.org/whl/cu118',
        ),
        # and under a CUDA 10 driver none does: the driver first, with the version to get
        (
            "10.2",
            "2.4.1+cu121",
            "12.1",
            "error",
            "update the NVIDIA driver to one for CUDA 12 (525.60.13 or newer)",
        ),
        ("12.2", "2.13.0+cu126", "12.6", "warning", "keep this torch"),  # runs: same major
    ],
)
def test_torch_fixes_follow_cuda_minor_version_compatibility(driver, torch, runtime, severity, fix):
    s = load("rtx3060_12gb")
    s = replace(
        s,
        software=replace(
            s.software, cuda_driver=driver, torch=torch, torch_build="cuda", cuda_runtime=runtime
        ),
    )
    (f,) = [f for f in findings(s) if f.code == "cuda_driver_too_old"]
    assert f.severity == severity and fix in f.fix, f.fix
    if driver == "12.2" and severity == "error":
        assert f.fix.endswith("whl/cu126") and "580.65.06" in f.fix
    if driver == "10.2":
        assert "torch (" not in f.fix and "ROCm" not in f.fix


def test_a_12x_build_under_minor_version_compatibility_needs_its_least_driver():
    """CUDA 12.x builds need a 525.60.13 driver or newer: a GPU recording an older one gets cu118 named."""
    s = load("rtx3060_12gb")
    gpu = replace(s.gpus[0], driver_version="525.00.00")
    s = replace(s, gpus=(gpu,), software=replace(s.software, cuda_driver="12.0"))
    assert snapshot.cuda_build_runs(s, "12.6") is False and snapshot.cuda_build_runs(s, "11.8") is True
    (f,) = [f for f in findings(s) if f.code == "torch_cpu_build"]
    assert f.fix.endswith("whl/cu118")


def test_an_nvidia_only_machine_is_never_told_of_a_rocm_build():
    s = load("rtx3060_12gb")
    for driver in (None, "10.2"):
        fx = {f.code: f for f in findings(replace(s, software=replace(s.software, cuda_driver=driver)))}
        assert "ROCm" not in fx["torch_cpu_build"].fix and "CUDA" in fx["torch_cpu_build"].fix


def test_cuda_runtime_within_driver_is_fine():
    s = load("t4")
    s = replace(s, software=replace(s.software, cuda_runtime="12.1"))
    assert "cuda_driver_too_old" not in {f.code for f in findings(s)}


def test_mixed_gpu_models():
    a, b = load("2x_rtx4090_pcie"), load("rtx3060_12gb")
    gpus = (*a.gpus, replace(b.gpus[0], index=2))
    links = (*a.links, Link(0, 2, "pcie", False), Link(1, 2, "pcie", False))
    s = replace(a, gpus=gpus, links=links)
    (f,) = [f for f in findings(s) if f.code == "mixed_gpus"]
    assert "2x NVIDIA GeForce RTX 4090, NVIDIA GeForce RTX 3060" in f.message
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1" in f.fix


def test_torch_build_mismatch():
    s = load("w6800")
    s = replace(s, software=replace(s.software, torch="2.5.1+cu124", torch_build="cuda", cuda_runtime="12.4"))
    assert ("error", "torch_build_mismatch") in {(f.severity, f.code) for f in findings(s)}


def test_rocm_arch_with_override_set_is_info():
    s = load("rx6700xt")
    s = replace(s, env={**s.env, "HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    codes = {(f.severity, f.code) for f in findings(s)}
    assert ("info", "rocm_arch_override") in codes and "rocm_arch_unsupported" not in {c for _, c in codes}


@pytest.mark.parametrize(
    ("arch", "torch", "unsupported", "advice"),
    [
        ("gfx1103", "2.7.1+rocm6.3", True, "11.0.0"),
        ("gfx1101", "2.5.1+rocm6.2", True, "11.0.0"),  # gfx1101 kernels came with torch 2.6
        ("gfx1101", "2.7.1+rocm6.3", False, None),
        ("gfx1102", "2.7.1+rocm6.3", False, None),
        ("gfx1201", "2.7.1+rocm6.3", False, None),
        ("gfx1100", "2.3.1+rocm6.0", False, None),
        ("gfx1012", "2.7.1+rocm6.3", True, "10.1.0"),
        ("gfx803", "2.7.1+rocm6.3", True, "PYTORCH_ROCM_ARCH=gfx803"),
    ],
)
def test_rocm_arch_set_follows_the_torch_version(arch, torch, unsupported, advice):
    s = load("w6800")
    s = replace(s, gpus=(replace(s.gpus[0], gfx_arch=arch),), software=replace(s.software, torch=torch))
    got = [f for f in findings(s) if f.code == "rocm_arch_unsupported"]
    assert bool(got) is unsupported
    if advice:
        assert advice in got[0].fix


def test_amd_kernel_rule_only_applies_to_amd():
    s = load("8x_h100_sxm")  # kernel 5.15 with NVIDIA: fine
    assert "amd_kernel_old" not in {f.code for f in findings(s)}
    s = load("w6800")
    s = replace(s, host=replace(s.host, kernel="5.18.19-051819-generic"))
    assert "amd_kernel_old" in {f.code for f in findings(s)}


def test_multi_gpu_links_unknown_and_pcie_p2p():
    s = load("2x_rtx4090_pcie")
    assert {f.code for f in findings(replace(s, links=()))} >= {"links_unknown"}
    p2p = replace(s, links=(Link(0, 1, "pcie", True),))
    codes = {(f.severity, f.code) for f in findings(p2p)}
    assert ("info", "multi_gpu_pcie_p2p") in codes and "multi_gpu_slow_link" not in {c for _, c in codes}
    unknown = replace(s, links=(Link(0, 1, "pcie", None),))
    (slow,) = [f for f in findings(unknown) if f.code == "multi_gpu_slow_link"]
    assert "P2P unknown" in slow.message


def _mixed_3060_4090() -> Snapshot:
    s, small = load("2x_rtx4090_pcie"), load("rtx3060_12gb").gpus[0]
    return replace(s, gpus=(replace(small, index=0), replace(s.gpus[1], index=1)))


def _visible(s: Snapshot, **env: str) -> list[Finding]:
    s = replace(s, env={**s.env, **env})
    return [f for f in findings(s) if f.code.startswith("visible_devices")]


@pytest.mark.parametrize("value", ["", "-1", "7", "nonsense", " -1,0"])
def test_visible_devices_that_hide_every_gpu_are_an_error(value):
    (f,) = _visible(load("2x_rtx4090_pcie"), CUDA_VISIBLE_DEVICES=value)
    assert (f.severity, f.code) == ("error", "visible_devices_none")
    assert "hides all 2 NVIDIA GPUs" in f.message and "torch sees no GPU" in f.message
    assert f.fix.startswith("unset CUDA_VISIBLE_DEVICES")


def test_visible_devices_unset_or_showing_every_gpu_say_nothing():
    s = load("2x_rtx4090_pcie")
    assert _visible(s) == []
    assert _visible(s, CUDA_VISIBLE_DEVICES="0,1") == []
    assert _visible(s, CUDA_VISIBLE_DEVICES="1,0") == []
    assert _visible(load("cpu_only"), CUDA_VISIBLE_DEVICES="") == []  # no GPU to hide


def test_visible_devices_that_hide_some_gpus_name_what_the_run_sees():
    (f,) = _visible(load("2x_rtx4090_pcie"), CUDA_VISIBLE_DEVICES="1")
    assert (f.severity, f.code) == ("info", "visible_devices_some")  # the plans follow it
    assert "shows the run only GPU 1 (NVIDIA GeForce RTX 4090)" in f.message
    assert "plan only the GPUs it shows" in f.message
    assert "hides GPU 0 (NVIDIA GeForce RTX 4090)" in f.message
    # CUDA stops at the first id that names no GPU: "0,5,1" shows GPU 0 only
    (f,) = _visible(load("2x_rtx4090_pcie"), CUDA_VISIBLE_DEVICES="0,5,1")
    assert "only GPU 0 " in f.message and "5 names no GPU" in f.message and "hides GPU 1" in f.message
    mixed = _mixed_3060_4090()
    uuid = mixed.gpus[1].uuid
    for env in ({"CUDA_VISIBLE_DEVICES": uuid}, {"CUDA_VISIBLE_DEVICES": uuid[:12]}):
        (f,) = _visible(mixed, **env)
        assert (
            "only GPU 1 (NVIDIA GeForce RTX 4090)" in f.message
            and "hides GPU 0 (NVIDIA GeForce RTX 3060)" in f.message
        )
    (f,) = _visible(mixed, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert "only GPU 0 (NVIDIA GeForce RTX 3060)" in f.message


@pytest.mark.parametrize("value", ["0,0", "0,1,0", "1,0,1", "MIG-aaaa,MIG-aaaa,MIG-bbbb"])
def test_visible_devices_that_repeat_a_gpu_show_none(value):
    """CUDA shows no GPU where a device is listed twice (torch's model of it: _parse_visible_devices, "Repeated
    ordinal results in empty set"); doctor read "0,1,0" as both GPUs and said nothing."""
    (f,) = _visible(load("2x_rtx4090_pcie"), CUDA_VISIBLE_DEVICES=value)
    assert (f.severity, f.code) == ("error", "visible_devices_none")
    assert "names a GPU listed before it: CUDA then shows none" in f.message


def test_visible_devices_count_the_gpus_doctor_could_not_read():
    """CUDA numbers every GPU: with GPU 0 unreadable, CUDA_VISIBLE_DEVICES=1 is the healthy GPU 1, which doctor
    took for a second GPU that is not there ("hides all ... torch sees no GPU")."""
    s = load("2x_rtx4090_pcie")
    s = replace(s, gpus=(replace(s.gpus[0], memory_total_bytes=None), s.gpus[1]))
    assert not any(f.code == "visible_devices_none" for f in _visible(s, CUDA_VISIBLE_DEVICES="1"))
    (f,) = _visible(s, CUDA_VISIBLE_DEVICES="0")
    assert "GPU 0" in f.message and "hides GPU 1" in f.message


def test_visible_devices_doctor_cannot_name_say_how_many():
    # mixed GPUs in CUDA's default fastest-first order: index 0 is the RTX 4090 there, not doctor's GPU 0
    (f,) = _visible(_mixed_3060_4090(), CUDA_VISIBLE_DEVICES="0")
    assert f.code == "visible_devices_some" and "shows the run 1 GPU of the 2" in f.message
    assert "fastest first" in f.message and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in f.fix
    assert _visible(_mixed_3060_4090(), CUDA_VISIBLE_DEVICES="1,0") == []  # every GPU, whatever the order
    (f,) = _visible(load("h100_80gb_hbm3"), CUDA_VISIBLE_DEVICES="MIG-0d5f5e0b-1111-2222-3333-444444444444")
    assert "1 MIG device" in f.message and "fastest first" not in f.message


def test_hip_visible_devices_for_amd_gpus():
    s = load("rx6700xt")
    assert _visible(s, HIP_VISIBLE_DEVICES="") == []  # HIP takes an empty value as unset
    (f,) = _visible(s, HIP_VISIBLE_DEVICES="-1")
    assert f.code == "visible_devices_none" and f.message.startswith(
        "HIP_VISIBLE_DEVICES=-1 hides all 1 AMD GPU"
    )
    # HIP reads HIP_VISIBLE_DEVICES where it is not empty, else CUDA_VISIBLE_DEVICES (ROCclr rocdevice.cpp): a
    # CUDA value beside a HIP one is not applied after it (that refused HIP_VISIBLE_DEVICES=0 CUDA_...=-1)
    assert _visible(s, HIP_VISIBLE_DEVICES="0", CUDA_VISIBLE_DEVICES="1") == []
    assert _visible(s, HIP_VISIBLE_DEVICES="0", CUDA_VISIBLE_DEVICES="-1") == []
    (f,) = _visible(s, CUDA_VISIBLE_DEVICES="-1")
    assert f.code == "visible_devices_none" and f.message.startswith("CUDA_VISIBLE_DEVICES=-1 hides")
    # ROCR_VISIBLE_DEVICES filters first, and set empty it hides every GPU (ROCR-Runtime: set at all filters)
    (f,) = _visible(s, ROCR_VISIBLE_DEVICES="")
    assert f.code == "visible_devices_none" and f.message.startswith('ROCR_VISIBLE_DEVICES="" hides')
    assert _visible(s, ROCR_VISIBLE_DEVICES="0") == []
    # a repeated index ends ROCr's list, the GPUs before it shown (amd_filter_device.cpp): not "none", as CUDA
    shown = _visible(s, ROCR_VISIBLE_DEVICES="0,0")
    assert all(f.code != "visible_devices_none" for f in shown)
    assert all("names no GPU" not in f.message for f in shown)


def test_snapshot_saved_before_cuda_device_order_still_loads():
    data = raw("2x_rtx4090_pcie")
    del data["env"]["CUDA_DEVICE_ORDER"]
    assert Snapshot.from_dict(data).env["CUDA_DEVICE_ORDER"] is None


def test_gpu_memory_other_processes_hold_is_a_finding():
    s = load("2x_rtx4090_pcie")
    busy = replace(s.gpus[1], memory_free_bytes=2 * 2**30)
    (f,) = [f for f in findings(replace(s, gpus=(s.gpus[0], busy))) if f.code == "gpu_memory_in_use"]
    assert f.severity == "warning" and f.message.startswith(
        "GPU 1 (NVIDIA GeForce RTX 4090) had 2.0 GiB free"
    )
    assert "nvidia-smi" in f.fix
    # a display or an idle CUDA context is not worth a word
    idle = replace(s.gpus[1], memory_free_bytes=s.gpus[1].memory_total_bytes - 2**30)
    assert not [f for f in findings(replace(s, gpus=(s.gpus[0], idle))) if f.code == "gpu_memory_in_use"]


def test_gpu_with_unknown_memory_is_not_usable():
    s = load("t4")
    s = replace(s, gpus=(GPU(index=0, vendor="nvidia", name="Tesla T4"),))
    (f,) = [f for f in findings(s) if f.code == "no_gpu"]
    assert "memory could not be read" in f.message


def test_refresh_keeps_probe_notes_and_recomputes_rules():
    s = load("rx6700xt")
    note = Finding("info", "amdsmi_missing", "m", "f")
    stale = Finding("error", "ram_insufficient", "old rule output", "f")
    fresh = refresh(replace(s, findings=(note, stale)))
    assert fresh.findings[0] == note
    assert stale not in fresh.findings
    assert {f.code for f in fresh.findings[1:]} == {c for _, c in EXPECTED["rx6700xt"]}


# -- the installed stack against sdplan's own requirements ------------------------------------------------


def test_packages_below_sdplans_requirements_are_findings_with_the_pip_fix():
    requires = [
        "diffusers>=0.34",
        "transformers>=4.46",
        "torch>=2.5",
        'deepspeed>=0.15; extra == "deepspeed"',  # optional: judged only when installed
        'amdsmi; extra == "amd"',
        'pytest>=8; extra == "test"',  # the developers' tools: never the user's problem
        'pywin32>=300; sys_platform == "win32"',  # a platform this is not
    ]
    installed = {"diffusers": "0.33.1", "torch": "2.13.0+cpu", "deepspeed": "0.14.0", "pytest": "7.0"}
    found = {f.message: f for f in software.unmet_requirements(requires, installed.get)}
    assert set(found) == {
        "diffusers 0.33.1 does not meet sdplan's requirement diffusers>=0.34",
        "transformers is not installed",
        "deepspeed 0.14.0 does not meet sdplan's requirement deepspeed>=0.15",
    }
    assert found["diffusers 0.33.1 does not meet sdplan's requirement diffusers>=0.34"] == Finding(
        "error", "package_unmet", "diffusers 0.33.1 does not meet sdplan's requirement diffusers>=0.34",
        "pip install -U 'diffusers>=0.34'",
    )  # fmt: skip
    assert found["transformers is not installed"].fix == "pip install 'transformers>=4.46'"
    assert found["deepspeed 0.14.0 does not meet sdplan's requirement deepspeed>=0.15"].severity == "warning"
    fixed = {**installed, "diffusers": "0.42.1", "transformers": "5.0"}
    assert [f.code for f in software.unmet_requirements(requires, fixed.get)] == [
        "package_unmet"
    ]  # deepspeed


def test_this_environment_meets_the_requirements_it_was_installed_with():
    """The live probe reads sdplan's real metadata: the environment the suite runs in satisfies it."""
    import importlib.metadata

    assert any(r.startswith("diffusers") for r in importlib.metadata.requires("sdplan"))
    assert software.requirement_notes() == ()


def test_an_old_binding_says_nothing_of_mig_on_a_card_without_it(monkeypatch, no_devices):
    """An RTX 3060 cannot run MIG: the warning listed 'whether a GPU is in MIG mode (A100, H100 ...)' there."""
    module, _ = fake_pynvml.make_module(MACHINES / "rtx3060_12gb.json")
    for name in OLD_BINDING_LACKS:
        delattr(module, name)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reading = nvidia.probe(sys_root=no_devices["sys"], proc_root=no_devices["proc"])
    (note,) = reading.notes
    assert note.code == "nvml_bindings_old" and "MIG mode" not in note.message
    assert "compute capability" in note.message
