"""A machine whose GPUs differ (an RTX 4090 beside an RTX 3060 or RTX 2080 Ti): a plan on several GPUs is planned
at the weakest of those it uses (least memory, slowest step, bf16 only where all have it), a one-GPU plan on the
best, whatever order the machine lists its GPUs in, and the plan names the GPUs it uses."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from sdplan import planner as P
from sdplan.machine import Snapshot
from sdplan.profiles import clear_cache, load_profiles

MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"
GiB = 2**30

BASE = json.loads((MACHINES / "2x_rtx4090_pcie.json").read_text())
RTX4090 = BASE["gpus"][0]
# the RTX 3060 12GB as its own fixture has it (NVML name, memory, compute capability, bf16), on this machine's driver
RTX3060 = {
    **json.loads((MACHINES / "rtx3060_12gb.json").read_text())["gpus"][0],
    "driver_version": RTX4090["driver_version"],
}
# Turing: no bf16 (compute capability 7.5), 11 GB, PCIe 3.0
RTX2080TI = {
    **RTX4090,
    "name": "NVIDIA GeForce RTX 2080 Ti",
    "uuid": "GPU-7c2d9e41-5b3a-4f06-8e1d-a39b6c0f2e75",
    "memory_total_bytes": 11811160064,
    "memory_free_bytes": 11453071360,
    "compute_capability": "7.5",
    "bf16": False,
    "pcie_gen": 3,
    "power_limit_watts": 250.0,
}
RTX3090 = {
    **RTX4090,
    "name": "NVIDIA GeForce RTX 3090",
    "uuid": "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901",
    "memory_total_bytes": 25769803776,
    "memory_free_bytes": 25300000000,
    "compute_capability": "8.6",
    "power_limit_watts": 350.0,
}
RTX4080 = {
    **RTX4090,
    "name": "NVIDIA GeForce RTX 4080",
    "uuid": "GPU-0e9d8c7b-6a5f-4e3d-2c1b-0a9f8e7d6c5b",
    "memory_total_bytes": 17171480576,
    "memory_free_bytes": 16800000000,
    "power_limit_watts": 320.0,
}
W6800 = {**json.loads((MACHINES / "w6800.json").read_text())["gpus"][0]}
# the lent H100 as its own fixture has it (sdplan bench points of its own in profiles/), and an H100 PCIe (none)
H100SXM = {
    **json.loads((MACHINES / "h100_80gb_hbm3.json").read_text())["gpus"][0],
    "driver_version": RTX4090["driver_version"],
}
H100PCIE = {
    **H100SXM,
    "name": "NVIDIA H100 PCIe",
    "uuid": "GPU-5a6b7c8d-9e0f-4a1b-8c2d-3e4f5a6b7c8d",
    "memory_total_bytes": 85520809984,
    "power_limit_watts": 350.0,
}


def machine(*gpus: dict) -> Snapshot:
    """The 2x RTX 4090 fixture machine with these GPUs (numbered in the order given), every pair over PCIe."""
    data = copy.deepcopy(BASE)
    data["gpus"] = [dict(g, index=i) for i, g in enumerate(gpus)]
    data["links"] = [
        {"a": i, "b": j, "type": "pcie", "p2p": False}
        for i in range(len(gpus))
        for j in range(i + 1, len(gpus))
    ]
    return Snapshot.from_dict(data)


@pytest.fixture(scope="module")
def prof():
    clear_cache()
    return load_profiles()


def plan(prof, snap: Snapshot, method: str = "lora", model: str = "sd15", gpus=None, images=20, pins=()):
    return P.plan(
        snap, prof, P.Request(method=method, model=model, images=images, max_gpus=gpus, pins=tuple(pins))
    )


def used_names(res: P.Result) -> list[str]:
    return sorted(g.name for g in P.plan_gpus(res.hardware, res.plan))


def settings(res: P.Result) -> dict:
    """The plan's settings, less the GPUs' numbers (which move with the order the machine lists them in)."""
    return {k: v for k, v in asdict(res.plan).items() if k != "gpu_ids"}


def essence(res: P.Result) -> tuple:
    """What a plan says, less the GPUs' numbers."""
    return (
        settings(res),
        res.seconds,
        res.memory,
        res.vram_bytes,
        res.basis,
        res.peak_range,
        res.seconds_range,
    )


MIXED = {
    "4090+3060": (RTX4090, RTX3060),
    "4090+2080ti": (RTX4090, RTX2080TI),
    "3090+4080": (RTX3090, RTX4080),
    "4090+4090+3060": (RTX4090, RTX4090, RTX3060),
    "h100sxm+h100pcie": (H100SXM, H100PCIE),  # one of them with sdplan bench points
}
REQUESTS = [
    ("lora", "sd15", None, 20),
    ("lora", "sd15", 1, 20),
    ("lora", "sdxl", None, 400),
    ("dreambooth", "sd15", None, 20),
    ("finetune", "sdxl", None, 100),
    ("textual-inversion", "sdxl", None, 20),
]


def test_a_mixed_rigs_peak_does_not_depend_on_which_gpu_has_bench_evidence_or_comes_first(prof):
    """Several GPUs build on the one-GPU bench peak of the same settings; the evidence was GPU 0's only: an H100
    SXM + H100 PCIe pair planned SDXL LoRA at batch 8 without checkpointing at 69.3 GiB (measured on the SXM)
    in one order and 73.6 (likely 69.9-99.2, may not fit) in the other (here at batch 4, which fits). Each GPU's own evidence now, the
    largest peak of them: the PCIe card (no points) by the model, whichever is first."""
    pins = (
        ("batch", 4),
        ("gradient_checkpointing", False),
        ("num_gpus", 2),
        ("cache_text_encoder_outputs", False),
    )
    a = plan(prof, machine(H100SXM, H100PCIE), "lora", "sdxl", pins=pins)
    assert a.feasible and a.plan.num_gpus == 2
    b = plan(prof, machine(H100PCIE, H100SXM), "lora", "sdxl", pins=pins)
    assert essence(a) == essence(b)
    assert a.peak_basis == b.peak_basis == "predicted"  # the PCIe card's model peak is the larger
    alone = plan(prof, machine(H100SXM, H100SXM), "lora", "sdxl", pins=pins)
    assert alone.peak_basis == "measured" and alone.memory.peak < a.memory.peak


@pytest.mark.parametrize("name", MIXED)
@pytest.mark.parametrize(("method", "model", "gpus", "images"), REQUESTS)
def test_the_plan_does_not_depend_on_the_order_of_the_gpus(prof, name, method, model, gpus, images):
    """The same machine listed in either order (first GPU first or last): the same plan, time, peak, card memory
    and GPUs used. Before: the planner took speed, memory and bf16 from GPU 0 alone."""
    gs = MIXED[name]
    a = plan(prof, machine(*gs), method, model, gpus, images)
    b = plan(prof, machine(*reversed(gs)), method, model, gpus, images)
    assert a.feasible == b.feasible
    if a.feasible:
        assert essence(a) == essence(b)
        assert used_names(a) == used_names(b)
    else:
        assert a.needs == b.needs


# (machine, request, pins) -> (GPUs used, precision, card memory GiB)
CASES = [
    # one 4090 is faster than a 4090 and a 3060 at the 3060's pace: a 4090 alone, and it is the 4090 (not GPU 0)
    ((RTX3060, RTX4090), ("lora", "sd15", None, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
    ((RTX4090, RTX3060), ("lora", "sd15", None, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
    # --gpus 1: the best GPU, not GPU 0
    ((RTX3060, RTX4090), ("lora", "sd15", 1, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
    # the 4090 has bf16 (it was said to have none beside a 2080 Ti)
    ((RTX4090, RTX2080TI), ("lora", "sd15", None, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
    ((RTX2080TI, RTX4090), ("lora", "sd15", None, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
    # both, pinned: the 2080 Ti's memory and no bf16
    (
        (RTX4090, RTX2080TI),
        ("lora", "sd15", None, 20),
        (("num_gpus", 2),),
        (["NVIDIA GeForce RTX 2080 Ti", "NVIDIA GeForce RTX 4090"], "fp16", 11),
    ),
    (
        (RTX4090, RTX3060),
        ("lora", "sd15", None, 20),
        (("num_gpus", 2),),
        (["NVIDIA GeForce RTX 3060", "NVIDIA GeForce RTX 4090"], "bf16", 12),
    ),
    # bf16 pinned: only the 4090 can
    (
        (RTX2080TI, RTX4090),
        ("lora", "sd15", None, 20),
        (("precision", "bf16"),),
        (["NVIDIA GeForce RTX 4090"], "bf16", 24),
    ),
    # the GPUs pinned by number: the 3060
    (
        (RTX4090, RTX3060),
        ("lora", "sd15", None, 20),
        (("gpu_ids", (1,)),),
        (["NVIDIA GeForce RTX 3060"], "bf16", 12),
    ),
    # two 4090s and a 3060: two GPUs are the 4090s, wherever the 3060 sits
    (
        (RTX3060, RTX4090, RTX4090),
        ("lora", "sdxl", None, 400),
        (),
        (["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"], "bf16", 24),
    ),
    (
        (RTX4090, RTX3060, RTX4090),
        ("lora", "sdxl", None, 400),
        (),
        (["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"], "bf16", 24),
    ),
    # SDXL textual inversion needs ~14 GiB: the 24 GiB 4090 (GPU 0 was a 12 GiB 3060: "needs a 13.9 GiB GPU")
    ((RTX3060, RTX4090), ("textual-inversion", "sdxl", 1, 20), (), (["NVIDIA GeForce RTX 4090"], "bf16", 24)),
]


@pytest.mark.parametrize(("gpus", "request_", "pins", "want"), CASES)
def test_which_gpus_a_plan_uses(prof, gpus, request_, pins, want):
    method, model, max_gpus, images = request_
    res = plan(prof, machine(*gpus), method, model, max_gpus, images, pins)
    assert res.feasible, res.reasons
    names, precision, card_gib = want
    assert (res.plan.num_gpus, res.plan.precision, round(res.vram_bytes / GiB)) == (
        len(names),
        precision,
        card_gib,
    )
    assert used_names(res) == names
    # the plan names its GPUs (the machine's numbers), and they are the ones it was planned on
    assert res.plan.gpu_ids is not None and len(res.plan.gpu_ids) == res.plan.num_gpus
    assert [g.index for g in P.plan_gpus(res.hardware, res.plan)] == list(res.plan.gpu_ids)
    note = next(r for r in res.reasons if r.startswith("this machine's GPUs differ"))
    assert f"distributed.gpu_ids={list(res.plan.gpu_ids)}" in note


@pytest.mark.parametrize(
    ("mixed", "alike", "pins"),
    [
        # several GPUs that differ plan as that many of the weakest: the same settings, peak, time and card
        ((RTX4090, RTX3060), (RTX3060, RTX3060), (("num_gpus", 2),)),
        ((RTX3060, RTX4090), (RTX3060, RTX3060), (("num_gpus", 2),)),
        ((RTX4090, RTX2080TI), (RTX2080TI, RTX2080TI), (("num_gpus", 2),)),
        ((RTX2080TI, RTX4090), (RTX2080TI, RTX2080TI), (("num_gpus", 2),)),
        # one GPU plans as the best GPU alone
        ((RTX3060, RTX4090), (RTX4090,), (("num_gpus", 1),)),
        ((RTX4090, RTX3060), (RTX4090,), (("num_gpus", 1),)),
        ((RTX2080TI, RTX4090), (RTX4090,), (("num_gpus", 1),)),
        ((RTX4090, RTX2080TI), (RTX4090,), (("num_gpus", 1),)),
    ],
)
@pytest.mark.parametrize(("method", "model"), [("lora", "sd15"), ("dreambooth", "sd15"), ("lora", "sdxl")])
def test_a_plan_is_planned_at_the_weakest_gpu_it_uses(prof, mixed, alike, pins, method, model):
    a = plan(prof, machine(*mixed), method, model, pins=pins)
    b = plan(prof, machine(*alike), method, model, pins=pins)
    assert a.feasible and b.feasible
    assert settings(a) == settings(b)
    assert (a.seconds, a.step_seconds, a.memory, a.vram_bytes) == (
        b.seconds,
        b.step_seconds,
        b.memory,
        b.vram_bytes,
    )


def test_reasons_name_the_gpu_that_limits(prof):
    res = plan(prof, machine(RTX4090, RTX2080TI), pins=(("num_gpus", 2),))
    text = "\n".join(res.reasons)
    assert "precision fp16: NVIDIA GeForce RTX 2080 Ti has no bf16 in hardware" in text
    assert "RTX 4090 has no bf16" not in text
    assert "per GPU of 11.0 GiB (NVIDIA GeForce RTX 2080 Ti's, the least of the 2)" in text
    assert "NVIDIA GeForce RTX 2080 Ti is the slowest of the 2 GPUs: every step waits for it" in text
    # and the machine's GPUs are listed, with the ones used
    note = next(r for r in res.reasons if r.startswith("this machine's GPUs differ"))
    assert (
        "GPU 0: NVIDIA GeForce RTX 4090, 24.0 GiB; GPU 1: NVIDIA GeForce RTX 2080 Ti, 11.0 GiB, no bf16"
        in note
    )
    assert "this plan uses GPUs 0, 1, at the pace of NVIDIA GeForce RTX 2080 Ti" in note
    one = plan(prof, machine(RTX2080TI, RTX4090))
    assert "this plan uses GPU 1 (NVIDIA GeForce RTX 4090, 24.0 GiB)" in one.reasons[0]
    # the slower two-GPU run is named, at its pace
    assert any(
        r.startswith("2 GPUs would take") and "at the pace of NVIDIA GeForce RTX 2080 Ti" in r
        for r in one.reasons
    )


def test_pins_no_gpu_set_can_run_are_refused_naming_the_gpu(prof):
    res = plan(prof, machine(RTX4090, RTX2080TI), pins=(("num_gpus", 2), ("precision", "bf16")))
    assert not res.feasible
    assert res.pin_conflicts == (
        "training.precision=bf16: NVIDIA GeForce RTX 2080 Ti has no bf16 in hardware (use training.precision=fp16)",
    )
    res = plan(prof, machine(RTX4090, RTX3060), pins=(("gpu_ids", (5,)),))
    assert res.pin_conflicts and "has no GPU 5 (it has GPUs 0, 1" in res.pin_conflicts[0]
    res = plan(prof, machine(RTX4090, RTX3060), pins=(("gpu_ids", (0,)), ("num_gpus", 2)))
    assert res.pin_conflicts and "lists 1 GPU but distributed.num_processes=2" in res.pin_conflicts[-1]


def test_nvidia_and_amd_gpus_never_train_together(prof):
    import dataclasses

    """One torch build drives a run, so a machine's NVIDIA and AMD GPUs are never planned together: a known build
    plans its own vendor's GPUs; an unknown one (or none, or a CPU build) the vendor whose driver stack is here,
    and with both stacks the one whose GPUs have the most memory, as doctor judges them (trained_gpus): here
    the W6800's 32 GiB, not the RTX 4090's 24."""
    snap = machine(RTX4090, W6800)
    assert snap.software.cuda_driver and not snap.software.rocm
    for build, rocm, planned in (
        (None, "6.3", "AMD Radeon PRO W6800"),
        ("cpu", "6.3", "AMD Radeon PRO W6800"),
        ("cpu", None, RTX4090["name"]),  # only NVIDIA's driver stack is here
        ("cuda", "6.3", RTX4090["name"]),
    ):
        software = dataclasses.replace(snap.software, torch_build=build, rocm=rocm)
        built = dataclasses.replace(snap, software=software)
        hw = P.hardware_from_snapshot(built, prof)
        assert [g.name for g in hw.gpus] == [planned], build
        assert any("is not planned" in n for n in hw.notes), hw.notes
        assert P.gpu_sets(hw, 2) == []
        res = plan(prof, built, "lora", "sdxl", images=400)
        assert res.feasible and res.plan.num_gpus == 1
        res = plan(prof, built, pins=(("num_gpus", 2),))
        assert res.pin_conflicts and "this hardware has 1 usable GPU" in res.pin_conflicts[0]


def test_gpu_sets_offer_each_gpu_that_is_best_at_something(prof):
    """A 24 GB RTX 3090 and a 16 GB but faster RTX 4080: a one-GPU plan may want either (memory or speed), so
    both are searched; a 4090 beside a 3060 beats it at everything: the 4090 alone. The order the machine lists
    them in does not matter."""
    for gs in ((RTX3090, RTX4080), (RTX4080, RTX3090)):
        hw = P.hardware_from_snapshot(machine(*gs), prof)
        assert [[g.name for g in s] for s in P.gpu_sets(hw, 1)] == [
            ["NVIDIA GeForce RTX 3090"],
            ["NVIDIA GeForce RTX 4080"],
        ]
    for gs in ((RTX4090, RTX3060), (RTX3060, RTX4090)):
        hw = P.hardware_from_snapshot(machine(*gs), prof)
        assert [[g.name for g in s] for s in P.gpu_sets(hw, 1)] == [["NVIDIA GeForce RTX 4090"]]
        assert len(P.gpu_sets(hw, 2)) == 1
    # which is better depends on the work: SD 1.5 LoRA is bound by memory bandwidth (the 3090's 936 GB/s against
    # 717), FLUX.1 LoRA by matmul rate (the 4080's); the plan takes the GPU on which the run is fastest
    for gs in ((RTX4080, RTX3090), (RTX3090, RTX4080)):
        snap = machine(*gs)
        for model, want in (("sd15", "NVIDIA GeForce RTX 3090"), ("flux-dev", "NVIDIA GeForce RTX 4080")):
            res = plan(prof, snap, "lora", model, gpus=1)
            assert used_names(res) == [want]
            each = [plan(prof, snap, "lora", model, pins=(("gpu_ids", (i,)),)).seconds for i in (0, 1)]
            assert res.seconds == min(each) < max(each)


def test_alike_gpus_plan_as_before(prof):
    """Alike GPUs: no GPU numbers in the plan (the first ones, as before) and no note."""
    res = plan(prof, Snapshot.load(MACHINES / "2x_rtx4090_pcie.json"), "lora", "sdxl", images=400)
    assert res.plan.gpu_ids is None
    assert not any("GPUs differ" in r for r in res.reasons)


def test_doctor_verdicts_are_for_the_best_gpu_whatever_the_order():
    """`sdplan doctor`'s per-method verdicts (one-GPU plans) on a 12 GiB RTX 3060 beside a 24 GiB RTX 4090: the same
    verdicts whichever GPU comes first, each on the 4090 (SDXL textual inversion said "needs a 13.9 GiB GPU" with
    the 3060 first)."""
    from sdplan.doctor import planner_verdicts

    def verdicts(snap: Snapshot) -> dict:
        return {(v.method, v.family): v for v in planner_verdicts(snap)}

    first, last = verdicts(machine(RTX3060, RTX4090)), verdicts(machine(RTX4090, RTX3060))
    assert first.keys() == last.keys()
    assert {k: v.status for k, v in first.items()} == {k: v.status for k, v in last.items()}
    assert first["textual-inversion", "sdxl"].status == "ok"
    for key, v in first.items():
        assert v.note.replace("on GPU 1", "on GPU x") == last[key].note.replace("on GPU 0", "on GPU x"), key
        if v.status in ("ok", "tight"):
            assert v.note.endswith("on GPU 1"), key  # the 4090's number


def test_gpu_ids_null_lets_sdplan_choose_as_without_the_key(prof):
    """`distributed.gpu_ids=null` (what the planner's own fix lines say: "drop distributed.gpu_ids and sdplan
    chooses") pinned "no GPUs named", and every set was judged on the first GPUs: the 3060 of a 3060 + 4090
    machine, which then did not fit SDXL DreamBooth without offload while `train` launched on the 4090."""
    from sdplan.recommend import parse_pins

    pins, _ = parse_pins(["distributed.gpu_ids=null"], "dreambooth", "sdxl")
    assert pins == ()
    snap = machine(RTX3060, RTX4090)
    res = plan(prof, snap, "dreambooth", "sdxl", pins=pins)
    assert used_names(res) == ["NVIDIA GeForce RTX 4090"]
    assert essence(res) == essence(plan(prof, snap, "dreambooth", "sdxl"))


def test_a_cuda_build_plans_only_the_nvidia_gpus_of_a_machine_with_amd_ones_too(prof):
    """An RTX 4090 and a W6800 (32 GB) with a CUDA build of torch: the plan was sized for the W6800 and launched
    with HIP_VISIBLE_DEVICES, which a CUDA build ignores: it trained on the 24 GB 4090."""
    snap = machine(RTX4090, W6800)
    assert snap.software.torch_build == "cuda"
    hw = P.hardware_from_snapshot(snap, prof)
    assert [g.vendor for g in hw.gpus] == ["nvidia"]
    assert any("cuda build: it drives the NVIDIA GPUs only" in n and "GPU 1" in n for n in hw.notes)
    res = plan(prof, snap, "dreambooth", "sdxl")
    assert used_names(res) == ["NVIDIA GeForce RTX 4090"]


def test_cards_of_one_model_a_few_mib_apart_are_alike(prof):
    """Two RTX 4090s whose memory differs by 1 MiB (one with ECC on) counted as GPUs that differ: gpu_ids were
    written and the measured multi-GPU evidence was dropped."""
    other = {**RTX4090, "index": 1, "memory_total_bytes": RTX4090["memory_total_bytes"] - 2**20}
    snap = machine(RTX4090, other)
    assert not P.mixed_gpus(P.hardware_from_snapshot(snap, prof))


def test_the_plan_line_names_the_gpus_it_runs_on(prof):
    """`plan  1 GPU, bf16, ...` on a 3060 + 4090 machine did not say which; the reasons did, far below."""
    from sdplan.settings import describe

    res = plan(prof, machine(RTX3060, RTX4090))
    assert describe(res.plan, gpus=True, short=True).startswith("1 GPU (GPU 1), ")
    alike = plan(prof, machine(RTX4090, RTX4090))
    assert describe(alike.plan, gpus=True, short=True).startswith(f"{alike.plan.num_gpus} GPU")
    assert "(GPU" not in describe(alike.plan, gpus=True, short=True)
