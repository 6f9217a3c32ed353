"""GPU names (issue 10): exact or alias matches only, form factors planned with the assumption stated, probed
names (NVML / amdsmi) resolved with their memory, uncatalogued GPUs never planned as another GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdplan import planner
from sdplan.cli import app
from sdplan.errors import SdplanError, UsageError
from sdplan.machine import Snapshot
from sdplan.profiles import GiB, load_profiles, match_gpu, normalise_gpu_name
from sdplan.recommend import parse_hardware

MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"


@pytest.fixture(scope="module")
def prof():
    return load_profiles()


def _keys(g) -> set[str]:
    return {normalise_gpu_name(n) for n in (g.name, *g.aliases)}


def test_entry_names_are_unique_and_never_another_entrys_alias(prof):
    names = [normalise_gpu_name(g.name) for g in prof.gpus]
    assert len(names) == len(set(names))
    for g in prof.gpus:
        for other in prof.gpus:
            if other is not g:
                assert normalise_gpu_name(g.name) not in _keys(other), (g.name, other.name)


def test_a_shared_name_is_told_apart_by_memory_or_is_a_form_factor(prof):
    """Two entries may share a name only as memory variants or as form factors of one GPU (same memory, arch)."""
    by_key: dict[str, list] = {}
    for g in prof.gpus:
        for k in _keys(g):
            by_key.setdefault(k, []).append(g)
    for key, gs in by_key.items():
        for a in gs:
            for b in gs:
                if a is not b and a.memory_gib == b.memory_gib:
                    assert (a.vendor, a.arch, a.family) == (b.vendor, b.arch, b.family), (key, a.name, b.name)


def test_every_alias_resolves_to_its_own_entry(prof):
    """Each name and alias, given the entry's memory (as a probe does), is that entry; where form factors of the
    same memory share it ("V100", "H100"), the slowest of them with the assumption stated, or a refusal that
    lists the entry among the options."""
    for g in prof.gpus:
        for alias in (g.name, *g.aliases):
            same = [
                o for o in prof.gpus if normalise_gpu_name(alias) in _keys(o) and o.memory_gib == g.memory_gib
            ]
            if len(same) == 1:
                m = prof.match_gpu(alias, memory_bytes=g.memory_bytes)
                assert m.spec is g and m.assumption is None, (alias, m.spec.name)
                continue
            try:
                m = prof.match_gpu(alias, memory_bytes=g.memory_bytes)
            except UsageError as e:
                assert "matches several catalog GPUs" in str(e) and g.name in str(e), alias
                continue
            assert m.spec is min(same, key=lambda o: (o.fp16_tflops, o.memory_bandwidth_gbs, o.name))
            assert g.name in m.assumption or m.spec is g, (alias, m.assumption)
            if len({o.name for o in prof.gpus if normalise_gpu_name(alias) in _keys(o)}) == 1:
                assert prof.find_gpu(alias) is g  # a name only one entry has needs no memory


# what a name may carry before the model number (normalised: no spaces, lower case)
_BRAND = {
    "",
    "rtx",
    "gtx",
    "geforcertx",
    "geforcegtx",
    "nvidiageforcertx",
    "nvidiageforcegtx",
    "tesla",
    "nvidiatesla",
}


def test_a_typed_name_without_a_size_never_picks_one_memory_variant(prof):
    """Memory variants share their NVML name (RTX 3080 10/12 GB, RTX 4060 Ti 8/16 GB): typed without a size, a
    name either of them has is refused with both listed ("4060 Ti" and "3080" sat on one variant's aliases
    only, and planned the 8 GB / 10 GB card without a word)."""
    import re

    for g in prof.gpus:
        for alias in (g.name, *g.aliases):
            key = normalise_gpu_name(alias)
            # another memory's entry has this name, or a longer name ending in it (the NVML name of both)
            shared = [
                o
                for o in prof.gpus
                if o.memory_gib != g.memory_gib
                and any(k.endswith(key) and k[: len(k) - len(key)] in _BRAND for k in _keys(o))
            ]
            if not shared or re.search(r"\d+\s*GB", alias, re.IGNORECASE):
                continue
            with pytest.raises(UsageError, match="matches several catalog GPUs") as e:
                prof.match_gpu(alias)
            assert g.name in str(e.value), alias


# (NVML nvmlDeviceGetName / amdsmi market_name, probed memory in GiB, catalog entry)
REAL_NAMES = [
    ("NVIDIA GeForce RTX 4090", 23.99, "RTX 4090"),
    ("NVIDIA GeForce RTX 4070 SUPER", 11.99, "RTX 4070 Super"),
    ("NVIDIA GeForce RTX 4060 Ti", 15.99, "RTX 4060 Ti 16GB"),
    ("NVIDIA GeForce RTX 4060 Ti", 7.99, "RTX 4060 Ti 8GB"),
    ("NVIDIA GeForce RTX 3080", 10.0, "RTX 3080 10GB"),
    ("NVIDIA GeForce RTX 3080", 12.0, "RTX 3080 12GB"),
    ("NVIDIA GeForce RTX 3060", 12.0, "RTX 3060 12GB"),
    ("NVIDIA GeForce RTX 3050", 8.0, "RTX 3050 8GB"),
    ("NVIDIA GeForce RTX 3050", 5.99, "RTX 3050 6GB"),
    ("NVIDIA GeForce RTX 2060", 5.79, "RTX 2060 6GB"),
    ("NVIDIA GeForce RTX 2060", 11.77, "RTX 2060 12GB"),
    ("NVIDIA GeForce RTX 5060 Ti", 7.96, "RTX 5060 Ti 8GB"),
    ("NVIDIA GeForce RTX 5060 Ti", 15.93, "RTX 5060 Ti 16GB"),
    ("NVIDIA GeForce RTX 3070 Ti", 8.0, "RTX 3070 Ti"),
    ("NVIDIA GeForce RTX 3060 Laptop GPU", 6.0, "RTX 3060 Laptop"),
    ("NVIDIA GeForce RTX 3080 Laptop GPU", 16.0, "RTX 3080 Laptop 16GB"),
    ("NVIDIA GeForce RTX 3080 Laptop GPU", 8.0, "RTX 3080 Laptop 8GB"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", 15.99, "RTX 4090 Laptop"),
    ("NVIDIA GeForce RTX 4060 Laptop GPU", 8.0, "RTX 4060 Laptop"),
    ("NVIDIA GeForce GTX 1080 Ti", 11.0, "GTX 1080 Ti"),
    ("NVIDIA GeForce GTX 1660 SUPER", 6.0, "GTX 1660 Super"),
    ("NVIDIA GeForce GTX 1060 6GB", 6.0, "GTX 1060 6GB"),
    ("GeForce GTX 1070", 8.0, "GTX 1070"),
    ("NVIDIA GeForce RTX 5090", 31.84, "RTX 5090"),
    ("NVIDIA RTX A6000", 47.99, "RTX A6000"),
    ("NVIDIA RTX A4000", 15.99, "RTX A4000"),
    ("NVIDIA RTX 6000 Ada Generation", 47.99, "RTX 6000 Ada"),
    ("NVIDIA RTX 4000 Ada Generation", 19.99, "RTX 4000 Ada"),
    ("NVIDIA RTX 2000 Ada Generation", 15.99, "RTX 2000 Ada"),
    ("Tesla T4", 15.0, "T4"),  # ECC on: 15360 MiB
    ("Tesla P100-PCIE-16GB", 15.89, "P100 PCIe 16GB"),
    ("Tesla P40", 22.38, "P40"),
    ("Tesla V100-SXM2-16GB", 15.78, "V100 SXM2 16GB"),
    ("Tesla V100-PCIE-32GB", 31.74, "V100 PCIe 32GB"),
    ("NVIDIA A10G", 22.49, "A10G"),
    ("NVIDIA A10", 22.49, "A10"),
    ("NVIDIA A40", 44.99, "A40"),
    ("NVIDIA L4", 22.49, "L4"),
    ("NVIDIA L40", 44.99, "L40"),
    ("NVIDIA L40S", 44.99, "L40S"),
    ("NVIDIA A100-SXM4-40GB", 39.59, "A100 SXM 40GB"),
    ("NVIDIA A100-SXM4-80GB", 79.15, "A100 SXM 80GB"),
    ("NVIDIA A100-PCIE-40GB", 39.59, "A100 PCIe 40GB"),
    ("NVIDIA A100 80GB PCIe", 79.15, "A100 PCIe 80GB"),
    ("NVIDIA A800-SXM4-80GB", 80.0, "A800 SXM 80GB"),
    ("NVIDIA H100 80GB HBM3", 79.65, "H100 SXM"),
    ("NVIDIA H100 PCIe", 79.65, "H100 PCIe"),
    ("NVIDIA H100 NVL", 93.58, "H100 NVL"),
    ("NVIDIA H800", 79.65, "H800 SXM"),
    ("NVIDIA H200", 140.4, "H200"),
    ("NVIDIA B200", 179.06, "B200"),
    ("AMD Radeon RX 7900 XTX", 23.98, "RX 7900 XTX"),
    ("AMD Radeon RX 7600 XT", 15.98, "RX 7600 XT"),
    ("AMD Radeon RX 6800 XT", 15.98, "RX 6800 XT"),
    ("AMD Radeon Pro W7900", 47.98, "Radeon PRO W7900"),
    ("AMD Instinct MI300X", 191.5, "MI300X"),
    ("AMD Instinct MI250X / MI250", 63.98, "MI250"),
    ("AMD Instinct MI210", 63.98, "MI210"),
]


@pytest.mark.parametrize(("probed", "gib", "entry"), REAL_NAMES)
def test_real_driver_names_resolve(prof, probed, gib, entry):
    assert prof.find_gpu(probed, memory_bytes=int(gib * GiB)).name == entry


@pytest.mark.parametrize(
    ("typed", "entry"),
    [
        ("A40", "A40"),
        ("L40", "L40"),
        ("L4", "L4"),
        ("A10", "A10"),
        ("rtx4090", "RTX 4090"),
        ("H800", "H800 SXM"),
    ],
)
def test_short_names_are_exact(prof, typed, entry):
    """issue 10: `A40` was planned as an RTX A4000 (16 GB) and `L40` as an L40S."""
    m = prof.match_gpu(typed)
    assert (m.spec.name, m.assumption) == (entry, None)


@pytest.mark.parametrize("typed", ["RTX 40", "A4", "RTX 4099", "H10", "V100S", "RTX 3060 Ti Super"])
def test_a_near_miss_is_only_a_suggestion(prof, typed):
    with pytest.raises(UsageError) as e:
        prof.find_gpu(typed)
    assert isinstance(e.value, SdplanError)
    assert str(e.value).startswith(f"unknown GPU {typed!r}") and "\n" not in str(e.value)
    assert "--machine" in str(e.value)


def test_an_unknown_gpu_names_the_local_stores_gpus_yaml_where_it_is(prof, tmp_path, monkeypatch):
    """It said "the local profile store ($SDPLAN_PROFILE_DIR)", a variable that is usually unset: the store was
    under $XDG_DATA_HOME (new-user audit, item 12)."""
    monkeypatch.delenv("SDPLAN_PROFILE_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    with pytest.raises(UsageError) as e:
        prof.find_gpu("RTX 9999")
    assert (
        f"add it to the local profile store's {tmp_path / 'xdg' / 'sdplan' / 'profiles' / 'gpus.yaml'}"
        in str(e.value)
    )
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path / "store"))
    with pytest.raises(UsageError, match="profile store's " + str(tmp_path / "store" / "gpus.yaml")):
        prof.find_gpu("RTX 9999")


def test_unknown_name_suggests_the_closest(prof):
    with pytest.raises(UsageError, match=r"did you mean: .*RTX A4000"):
        prof.find_gpu("RTX A4001")


@pytest.mark.parametrize(
    ("typed", "first"),
    [
        ("RTX 4090 48GB", "RTX 4090 (24 GiB)"),  # suggested 4060 Ti 8GB, 3060 8GB, ... but not the RTX 4090
        ("RTX 4070 Ti 16GB", "RTX 4070 Ti Super (16 GiB)"),  # the card of that name and size
    ],
)
def test_a_known_name_in_a_size_it_does_not_come_in_suggests_its_own_sizes(prof, typed, first):
    with pytest.raises(UsageError) as e:
        prof.find_gpu(typed)
    assert str(e.value).startswith(f"unknown GPU {typed!r} (did you mean: {first}")


def test_form_factors_are_planned_with_the_assumption_stated(prof):
    """issue 10: `V100 16GB` was refused although both form factors have 16 GB."""
    m = prof.match_gpu("V100 16GB")
    assert m.spec.name == "V100 PCIe 16GB"
    assert "V100 SXM2 16GB" in m.assumption and "planned as V100 PCIe 16GB" in m.assumption
    hw = parse_hardware("V100 16GB", prof)
    assert hw.notes == (m.assumption,)
    res = planner.plan(hw, prof, planner.Request(method="lora"))
    assert m.assumption in res.reasons
    assert prof.match_gpu("A100 80GB").spec.name == "A100 PCIe 80GB"
    assert prof.match_gpu("V100 SXM2 16GB").assumption is None


@pytest.mark.parametrize(
    ("typed", "options"),
    [
        ("H100", "H100 NVL, H100 PCIe, H100 SXM"),  # 757 vs 989 TFLOPS, 80 vs 94 GB
        ("H100 80GB", "H100 PCIe, H100 SXM"),
        ("A100", "A100 PCIe 40GB, A100 PCIe 80GB, A100 SXM 40GB, A100 SXM 80GB"),
        ("RTX 3080", "RTX 3080 10GB, RTX 3080 12GB"),
        ("RTX 3060", "RTX 3060 12GB, RTX 3060 8GB"),
        ("P100", "P100 PCIe 12GB, P100 PCIe 16GB, P100 SXM2 16GB"),
    ],
)
def test_variants_that_plan_differently_are_refused_with_the_options(prof, typed, options):
    with pytest.raises(UsageError, match="matches several catalog GPUs") as e:
        prof.find_gpu(typed)
    assert options in str(e.value)


def test_several_gpus_need_the_link_named(prof):
    assert parse_hardware("V100 16GB", prof).count == 1
    with pytest.raises(UsageError, match="different GPU-to-GPU links"):
        parse_hardware("2x V100 16GB", prof)
    with pytest.raises(UsageError, match="different GPU-to-GPU links"):
        parse_hardware("4x A800", prof)
    assert parse_hardware("2x V100 SXM2 16GB", prof).link == "nvlink"


def test_a_probed_memory_the_catalog_does_not_know_is_no_match(prof):
    """A board of a known NVML name with a memory the catalog lacks (a 4 GB RTX 3050, as the 2024 6 GB one was
    before it had an entry) must not be planned as a board it has."""
    assert prof.gpu_or_none("NVIDIA GeForce RTX 3050", 4 * GiB) is None
    with pytest.raises(UsageError, match="4.0 GiB is not in the catalog"):
        match_gpu(prof.gpus, "NVIDIA GeForce RTX 3050", 4 * GiB)


def test_both_rtx_3060_boards_are_matched_by_their_probed_memory(prof):
    """The 8 GB and 12 GB RTX 3060 share the NVML name; the probed memory picks the board (and its bandwidth)."""
    small = prof.gpu_or_none("NVIDIA GeForce RTX 3060", int(7.8 * GiB))
    large = prof.gpu_or_none("NVIDIA GeForce RTX 3060", int(11.8 * GiB))
    assert (small.name, small.memory_bandwidth_gbs) == ("RTX 3060 8GB", 240)
    assert (large.name, large.memory_bandwidth_gbs) == ("RTX 3060 12GB", 360)


def _with_gpu(name: str, memory_gib: float) -> Snapshot:
    snap = Snapshot.load(MACHINES / "t4.json")
    g = dataclasses.replace(snap.gpus[0], name=name, memory_total_bytes=int(memory_gib * GiB))
    return dataclasses.replace(snap, gpus=(g,))


def test_an_uncatalogued_probed_gpu_keeps_its_memory_and_has_no_speed(prof):
    hw = planner.hardware_from_snapshot(_with_gpu("Quadro RTX 8000", 47.5), prof)
    (gpu,) = hw.gpus
    assert gpu.spec is None and gpu.memory_bytes == int(47.5 * GiB)
    assert any("not in the GPU catalog" in n and "speed is unknown" in n for n in hw.notes)
    res = planner.plan(hw, prof, planner.Request(method="lora"))
    assert res.feasible and res.seconds is None and res.vram_bytes == int(47.5 * GiB)
    assert any("not in the GPU catalog" in r for r in res.reasons)
    assert any(r.startswith("time: unknown") for r in res.reasons)


def test_a_probed_a40_is_the_a40(prof):
    hw = planner.hardware_from_snapshot(_with_gpu("NVIDIA A40", 44.99), prof)
    assert hw.gpus[0].spec.name == "A40" and hw.notes == ()


def test_cli_unknown_gpu_is_one_line():
    r = CliRunner().invoke(app, ["recommend", "--method", "lora", "--hardware", "A4"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown GPU 'A4'")


@pytest.mark.parametrize(
    ("typed", "memory_gib"),
    [
        ("A10G", 24),
        ("P100 PCIe 12GB", 12),
        ("P100 16GB", 16),
        ("P40", 24),
        ("GTX 1060 6GB", 6),
        ("GTX 1070", 8),
        ("GTX 1070 Ti", 8),
        ("GTX 1080", 8),
        ("GTX 1080 Ti", 11),
        ("GTX 1650", 4),
        ("GTX 1660", 6),
        ("GTX 1660 Super", 6),
        ("GTX 1660 Ti", 6),
        ("RTX 3050 8GB", 8),
        ("RTX 3070 Ti", 8),
        ("RTX 4070 Super", 12),
        ("RTX 4070 Ti Super", 16),
        ("RTX 4080 Super", 16),
        ("RTX 3060 Laptop", 6),
        ("RTX 3070 Laptop", 8),
        ("RTX 3080 Laptop 16GB", 16),
        ("RTX 4060 Laptop", 8),
        ("RTX 4070 Laptop", 8),
        ("RTX 4080 Laptop", 12),
        ("RTX 4090 Laptop", 16),
        ("A800", 80),
        ("H800", 80),
        ("B200", 180),
        ("L4", 24),
        ("RTX 2000 Ada", 16),
        ("RTX 4000 Ada", 20),
        ("RTX 5000 Ada", 32),
        ("RTX 5070 Ti", 16),
        ("MI250", 64),
        ("RX 7900 XTX", 24),
    ],
)
def test_the_cards_issue_10_found_missing_are_planned(prof, typed, memory_gib):
    hw = parse_hardware(typed, prof)
    spec = hw.gpus[0].spec
    assert spec is not None and spec.memory_gib == memory_gib
    assert hw.gpus[0].memory_bytes == spec.memory_bytes  # the card's NVML total where known (L4: 23034 MiB)


@pytest.mark.parametrize(
    "typed, mib", [("T4", 15360), ("L4", 23034), ("A10", 23028), ("A10G", 23028), ("L40S", 46068)]
)
def test_a_card_with_ecc_is_planned_with_the_memory_nvml_reports(prof, typed, mib):
    """ECC keeps 1/16 of these GDDR6 cards' memory: a plan for the card counts what the driver reports, not the
    marketing size (a T4 sold as 16 GB has 15 GiB), as a plan on the probed card does."""
    assert parse_hardware(typed, prof).gpus[0].memory_bytes == mib * 2**20
    assert match_gpu(prof.gpus, typed).spec.memory_gib * GiB > mib * 2**20  # the size users type is kept


def test_a_t4_named_is_planned_as_the_probed_t4(prof):
    """`--hardware T4` and a probed T4 (the fixture's NVML reading) plan the same card: the same memory, the same
    plan, the same verdict."""
    snap = Snapshot.load(MACHINES / "t4.json")
    probed = planner.hardware_from_snapshot(snap, prof)
    named = parse_hardware("T4", prof)
    assert named.gpus[0].memory_bytes == probed.gpus[0].memory_bytes == snap.gpus[0].memory_total_bytes
    request = planner.Request(method="dreambooth", model="sd15")
    a, b = planner.plan(named, prof, request), planner.plan(probed, prof, request)
    assert (a.plan, a.memory.peak, a.vram_bytes) == (b.plan, b.memory.peak, b.vram_bytes)


def test_an_unknown_gpu_names_the_shipped_catalog_by_its_full_path(prof):
    """The fix said "or to profiles/gpus.yaml": relative to a clone of sdplan, nothing from the user's folder."""
    from sdplan.profiles import shipped_dir

    with pytest.raises(UsageError) as e:
        prof.find_gpu("RTX 9999")
    assert f"(or to sdplan's own {shipped_dir() / 'gpus.yaml'})" in str(e.value)
    assert (shipped_dir() / "gpus.yaml").is_file()
