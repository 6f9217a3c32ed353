"""The machine snapshot: JSON round trip, unknown stays null, malformed files give every error at once."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from sdplan.errors import ConfigError, UsageError
from sdplan.machine import GPU, Host, Link, Snapshot


def _snapshot() -> Snapshot:
    return Snapshot(
        host=Host(os="Linux", cpu_cores=16, ram_total_bytes=64 * 2**30),
        gpus=(
            GPU(
                index=0,
                vendor="nvidia",
                name="NVIDIA GeForce RTX 4090",
                memory_total_bytes=24 * 2**30,
                bf16=True,
            ),
            GPU(
                index=1,
                vendor="nvidia",
                name="NVIDIA GeForce RTX 4090",
                memory_total_bytes=24 * 2**30,
                bf16=True,
            ),
        ),
        links=(Link(a=0, b=1, type="pcie", p2p=False),),
    )


def test_round_trip(tmp_path):
    snap = _snapshot()
    path = tmp_path / "machine.json"
    snap.save(path)
    assert Snapshot.load(path) == snap
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    # Unknown values are null, never a fake 0.
    assert data["host"]["disk_free_bytes"] is None
    assert data["gpus"][0]["pcie_gen"] is None
    assert set(data["env"]) == {
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HSA_OVERRIDE_GFX_VERSION",
        "PYTORCH_CUDA_ALLOC_CONF",
    }


def test_malformed_snapshot_reports_every_error():
    data = _snapshot().to_dict()
    data["schema_version"] = 7
    data["gpus"][0]["memory_total_bytes"] = "24GB"
    data["gpus"][1]["vendor"] = "intel"
    data["host"]["ram"] = 1
    with pytest.raises(ConfigError) as info:
        Snapshot.from_dict(data, source="m.json")
    errors = info.value.errors
    assert "schema_version: expected 1, got 7" in errors
    assert any(e.startswith("gpus[0].memory_total_bytes: expected") for e in errors)
    assert any(e.startswith("gpus[1].vendor: must be 'nvidia' or 'amd'") for e in errors)
    assert "host.ram: unknown key" in errors


def test_a_snapshot_whose_env_values_are_not_text_is_refused():
    """ "env": {"CUDA_VISIBLE_DEVICES": 0} loaded, and `doctor --machine` printed its host table, then a
    TypeError traceback."""
    data = _snapshot().to_dict()
    data["env"]["CUDA_VISIBLE_DEVICES"] = 0
    with pytest.raises(ConfigError) as info:
        Snapshot.from_dict(data, source="m.json")
    assert info.value.errors == ["env.CUDA_VISIBLE_DEVICES: expected text or null, got int"]


@pytest.mark.parametrize("packages", [None, {"torch": 3}, ["torch"]])
def test_a_snapshot_whose_packages_are_not_name_version_pairs_is_refused(packages):
    """ "packages": null loaded, then `doctor --machine` printed half its report and an AttributeError traceback."""
    data = _snapshot().to_dict()
    data["software"]["packages"] = packages
    with pytest.raises(ConfigError) as info:
        Snapshot.from_dict(data, source="m.json")
    assert info.value.errors == ["software.packages: expected an object of name: version (or null)"]


def test_load_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        Snapshot.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Snapshot.load(bad)
    bad.write_text("[]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        Snapshot.load(bad)


def test_negative_numbers_in_a_snapshot_are_errors():
    """A hand-edited snapshot with a negative size planned "-0.0 GiB" GPUs; now each is named."""
    data = _snapshot().to_dict()
    data["gpus"][0]["memory_total_bytes"] = -5
    data["host"]["ram_total_bytes"] = -1
    data["gpus"][1]["power_limit_watts"] = float("nan")
    with pytest.raises(ConfigError) as info:
        Snapshot.from_dict(data, source="m.json")
    errors = info.value.errors
    assert "gpus[0].memory_total_bytes: must be >= 0, got -5" in errors
    assert "host.ram_total_bytes: must be >= 0, got -1" in errors
    assert "gpus[1].power_limit_watts: must be >= 0, got nan" in errors


def test_visible_devices_counts_each_vendors_gpus_in_their_own_order():
    """The environment that shows a process only some GPUs: NVIDIA by PCI bus order (what NVML numbers, not
    CUDA's fastest-first default), AMD after them in the snapshot but numbered from 0 among themselves."""
    snap = _snapshot()
    amd = GPU(index=2, vendor="amd", name="AMD Radeon PRO W6800", memory_total_bytes=32 * 2**30)
    snap = Snapshot(host=snap.host, gpus=(*snap.gpus, amd))
    assert snap.visible_devices([1]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert snap.visible_devices((1, 0)) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,0"}
    assert snap.visible_devices([2]) == {"HIP_VISIBLE_DEVICES": "0"}
    with pytest.raises(ValueError, match="not one vendor's"):
        snap.visible_devices([0, 2])


def test_visible_devices_name_nvidia_gpus_by_uuid_where_nvml_gave_them():
    """NVML's UUIDs ("GPU-..."), which CUDA takes whatever its device order: the GPU sdplan planned for, however
    CUDA numbers them. A GPU without one (a hand-written snapshot) falls back to the PCI bus index."""
    base = _snapshot()
    a, b = (
        GPU(**{**asdict(g), "uuid": f"GPU-{i}1111111-2222-3333-4444-555555555555"})
        for i, g in enumerate(base.gpus)
    )
    snap = Snapshot(host=base.host, gpus=(a, b))
    assert snap.visible_devices([1, 0]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": f"{b.uuid},{a.uuid}",
    }
    half = Snapshot(host=base.host, gpus=(a, base.gpus[1]))
    assert half.visible_devices([0, 1])["CUDA_VISIBLE_DEVICES"] == "0,1"
