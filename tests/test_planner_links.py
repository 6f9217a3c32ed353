"""A machine whose GPUs are joined unevenly (NVLink bridges on some pairs, as on a 4x RTX 3090 rig with two bridges):
a plan on several GPUs runs its all-reduce over the links among the GPUs it uses, not the machine's best or worst,
and on alike GPUs it picks the best-joined ones and names them (distributed.gpu_ids), which `sdplan train` launches
on. Before, any NVLink on the machine planned every GPU set as NVLink-joined, and a 2-GPU plan took GPUs 0 and 1."""

from __future__ import annotations

import copy

import pytest
from test_planner_mixed import BASE, RTX3060, RTX3090, machine

from sdplan import config as C
from sdplan import planner as P
from sdplan.launcher import run_gpus
from sdplan.machine import Snapshot
from sdplan.profiles import clear_cache, load_profiles


def joined(gpus: list[dict], fast: set[tuple[int, int]], kind: str = "nvlink", gens=None) -> Snapshot:
    """The fixture machine with ``gpus``, ``fast`` pairs joined by ``kind`` and the rest over PCIe (``gens``: each
    GPU's PCIe generation)."""
    data = copy.deepcopy(BASE)
    data["gpus"] = [dict(g, index=i, uuid=f"GPU-{i:08d}") for i, g in enumerate(gpus)]
    if gens is not None:
        for g, gen in zip(data["gpus"], gens, strict=True):
            g["pcie_gen"] = gen
    n = len(gpus)
    data["links"] = [
        {"a": a, "b": b, "type": kind if (a, b) in fast else "pcie", "p2p": (a, b) in fast}
        for a in range(n)
        for b in range(a + 1, n)
    ]
    return Snapshot.from_dict(data)


BRIDGED = joined([RTX3090] * 4, {(0, 2), (1, 3)})  # two bridges, not on 0-1


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def hw(prof, snap: Snapshot) -> P.Hardware:
    return P.hardware_from_snapshot(snap, prof, source="file")


def ids(gpus) -> tuple[int, ...]:
    return tuple(g.index for g in gpus)


@pytest.mark.parametrize(
    ("n", "fast", "want"),
    [
        (2, {(0, 1)}, "nvlink"),
        (2, {(0, 2)}, None),
        (3, {(0, 1), (1, 2)}, None),  # three GPUs: a ring uses every pair
        (3, {(0, 1), (1, 2), (0, 2)}, "nvlink"),
        (4, {(0, 1), (2, 3)}, None),  # two bridges: the ring crosses PCIe twice
        (4, {(0, 1), (1, 2), (2, 3), (0, 3)}, "nvlink"),  # a ring without the diagonals
        (4, {(0, 2), (1, 2), (1, 3), (0, 3)}, "nvlink"),  # the ring 0-2-1-3
        (8, {(a, b) for a in range(8) for b in range(a + 1, 8)}, "nvlink"),  # NVSwitch: every pair
        (8, {(a, a + 1) for a in range(7)}, None),  # a chain, not a ring
        (8, {(a, a + 1) for a in range(7)} | {(0, 7)}, "nvlink"),
    ],
)
def test_a_gpu_set_is_nvlink_joined_only_where_a_ring_of_nvlink_passes_through_all(n, fast, want):
    links = tuple((a, b, "nvlink" if (a, b) in fast else "pcie") for a in range(n) for b in range(a + 1, n))
    assert P._fast_ring(tuple(range(n)), links) == want


def test_a_two_gpu_plan_takes_the_bridged_pair_and_names_it(prof):
    h = hw(prof, BRIDGED)
    assert P.set_link(h, h.gpus) == ("pcie", 32.0)  # the whole machine: its ring crosses PCIe
    assert [ids(gs) for gs in P.gpu_sets(h, 2)] == [(0, 2)]
    assert [ids(gs) for gs in P.gpu_sets(h, 3)] == [(0, 1, 2)]  # no 3 of them NVLink-joined: the first three
    assert [ids(gs) for gs in P.gpu_sets(h, 4)] == [(0, 1, 2, 3)]
    assert P.set_link(h, P.gpu_sets(h, 2)[0]) == ("nvlink", P.BRIDGE_GBS)

    res = P.plan(h, prof, P.Request(method="finetune", model="sd15", max_gpus=2, pins=(("num_gpus", 2),)))
    assert res.feasible and res.plan.num_gpus == 2
    assert res.plan.gpu_ids == (0, 2)
    said = "\n".join(res.reasons)
    assert "NVLink between GPUs 0-2, 1-3, PCIe otherwise" in said
    assert "this plan uses GPUs 0, 2, whose all-reduce runs over NVLink" in said
    assert "distributed.gpu_ids=[0, 2]" in said


def test_the_bridged_pair_is_faster_than_a_pair_over_pcie(prof):
    """A full fine-tune's 3.2 GiB gradient all-reduce: over the bridge vs pinned onto GPUs 0 and 1 (PCIe)."""
    h = hw(prof, BRIDGED)
    req = P.Request(method="finetune", model="sd15", max_gpus=2, pins=(("num_gpus", 2),))
    bridged = P.plan(h, prof, req)
    pcie = P.plan(h, prof, P.Request(**{**req.__dict__, "pins": (("gpu_ids", (0, 1)),)}))
    assert pcie.plan.gpu_ids == (0, 1)
    assert bridged.seconds < pcie.seconds
    assert any("this plan uses GPUs 0, 1, whose all-reduce runs over PCIe" in r for r in pcie.reasons)


def test_four_gpus_with_two_bridges_are_planned_over_pcie(prof):
    """Before: any NVLink on the machine made every set NVLink-joined, the 4-GPU all-reduce included."""
    h = hw(prof, BRIDGED)
    res = P.plan(h, prof, P.Request(method="finetune", model="sd15", pins=(("num_gpus", 4),)))
    assert res.feasible and res.plan.num_gpus == 4
    assert res.plan.gpu_ids is None  # the first four: all of them
    said = "\n".join(res.reasons)
    assert "whose all-reduce runs over PCIe" in said
    assert "over nvlink" not in said


def test_alike_gpus_joined_alike_keep_the_first_ones_and_say_nothing_of_links(prof):
    for snap in (machine(RTX3090, RTX3090, RTX3090), joined([RTX3090] * 3, {(0, 1), (1, 2), (0, 2)})):
        h = hw(prof, snap)
        assert [ids(gs) for gs in P.gpu_sets(h, 2)] == [(0, 1)]
        res = P.plan(h, prof, P.Request(method="finetune", model="sd15", pins=(("num_gpus", 2),)))
        assert res.plan.gpu_ids is None
        assert not any("joined unevenly" in r for r in res.reasons)


def test_a_gpu_on_a_slower_pcie_link_is_left_out_of_a_pair(prof):
    """No NVLink: the pair's all-reduce runs at the slower of its PCIe links, so the two on PCIe 4.0 are chosen."""
    h = hw(prof, joined([RTX3090] * 3, set(), gens=[3, 4, 4]))
    assert [ids(gs) for gs in P.gpu_sets(h, 2)] == [(1, 2)]
    assert P.set_link(h, P.gpu_sets(h, 2)[0]) == ("pcie", P.PCIE_GBS[4])
    assert P.set_link(h, h.gpus) == ("pcie", P.PCIE_GBS[3])


def test_an_unread_pcie_generation_takes_the_catalogs_and_the_plan_says_so(prof):
    """A GPU whose maximum PCIe generation NVML did not give is planned at its catalog entry's (RTX 3090: 4), not
    at a GPU's known lower one alone nor an idle gen 1, and the notes say what was assumed."""
    h = hw(prof, joined([RTX3090] * 2, set(), gens=[None, None]))
    assert P.set_link(h, h.gpus) == ("pcie", P.PCIE_GBS[4])
    (note,) = [n for n in h.notes if "PCIe generation" in n]
    assert "GPU 0, GPU 1 could not be read" in note and "the catalog's gen 4" in note
    mixed = hw(prof, joined([RTX3090] * 2, set(), gens=[3, None]))
    assert P.set_link(mixed, mixed.gpus) == ("pcie", P.PCIE_GBS[3])  # the lowest: GPU 0's probed gen 3
    assert any("PCIe generation of GPU 1 could not" in n for n in mixed.notes)
    assert not [n for n in hw(prof, joined([RTX3090] * 2, set(), gens=[4, 4])).notes if "PCIe gen" in n]


def test_an_unread_pcie_generation_is_said_only_where_an_all_reduce_crosses_pcie(prof):
    """Where NVLink joins every pair (an NVSwitch: 8x H100 SXM), no multi-GPU time runs over PCIe, so a PCIe
    generation NVML did not give changes no time and is not said; where a pair is on PCIe (bridges 0-2 and 1-3),
    a set with the unread GPU crosses it and the note stays; one GPU has no all-reduce."""
    every = {(a, b) for a in range(4) for b in range(a + 1, 4)}
    h = hw(prof, joined([RTX3090] * 4, every, gens=[None, None, 4, 4]))
    assert not [n for n in h.notes if "PCIe generation" in n], h.notes
    assert P.set_link(h, h.gpus)[0] == "nvlink"
    h = hw(prof, joined([RTX3090] * 4, {(0, 2), (1, 3)}, gens=[None, 4, 4, 4]))
    assert any("PCIe generation of GPU 0 could not be read" in n for n in h.notes), h.notes
    assert not [n for n in hw(prof, joined([RTX3090], set(), gens=[None])).notes if "PCIe generation" in n]


def test_gpus_that_differ_take_the_bridged_pair_of_the_better_kind(prof):
    """Four RTX 3090s (bridges 0-2, 1-3) beside an RTX 3060: two 3090s, the bridged ones."""
    h = hw(prof, joined([RTX3090, RTX3090, RTX3090, RTX3090, RTX3060], {(0, 2), (1, 3)}))
    assert P.mixed_gpus(h)
    assert ids(P.gpu_sets(h, 2)[0]) == (0, 2)


def test_xgmi_pairs_count_as_fast_links(prof):
    from test_planner_mixed import W6800

    h = hw(prof, joined([W6800] * 4, {(0, 1), (2, 3)}, kind="xgmi"))
    assert ids(P.gpu_sets(h, 2)[0]) == (0, 1)
    assert P.set_link(h, P.gpu_sets(h, 2)[0])[0] == "xgmi"
    assert P.set_link(h, h.gpus)[0] == "pcie"


def test_catalog_hardware_keeps_its_one_link(prof):
    h = P.hardware_from_catalog(prof.find_gpu("H100 SXM"), 8)
    assert P.set_link(h, h.gpus[:2]) == (h.link, h.link_gbs) == ("nvlink", h.link_gbs)
    assert [ids(gs) for gs in P.gpu_sets(h, 2)] == [(0, 1)]


def test_train_launches_a_config_without_gpus_on_the_bridged_pair():
    """`sdplan train --config` with 2 processes and no distributed.gpu_ids on the bridged rig: GPUs 0 and 2."""
    data = C.default_config()
    data["distributed"].update(num_processes=2)
    cfg = C.validate(data)
    assert run_gpus(cfg, BRIDGED, 2) == (0, 2)
    assert run_gpus(cfg, BRIDGED, 4) is None
    assert run_gpus(cfg, machine(RTX3090, RTX3090), 2) is None
