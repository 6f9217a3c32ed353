"""`sdplan bench` and `sdplan profiles`: the batch search, the demo bench on the CPU (tiny model, the real
trainer step), what it writes to the local profile store, how the planner reads it, listing and export.

The CPU runs use ``bench.DEMO``-sized efforts (a few tiny-model steps per probe point: seconds).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import typer
import yaml
from conftest import MACHINES, fresh_profile_store
from typer.testing import CliRunner

from sdplan import bench, profiles
from sdplan.commands import bench as bench_cmd
from sdplan.commands import profiles as profiles_cmd
from sdplan.errors import ConfigError, UsageError
from sdplan.machine import Snapshot

TINY = bench.Effort(warmup_steps=0, timed_steps=1, max_batch=4)


def cli() -> typer.Typer:
    """The two commands as sdplan.cli registers them."""
    app = typer.Typer()
    app.command("bench")(bench_cmd.bench)
    app.add_typer(profiles_cmd.profiles_app, name="profiles")
    return app


# -- the batch search (pure) ------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 5, 7, 8, 11, 16, 40])
def test_search_finds_the_largest_fitting_batch(limit):
    probed: list[int] = []

    def fits(b: int) -> bool:
        probed.append(b)
        return b <= limit

    largest, bounded_by = bench.search_largest_batch(fits, max_batch=16)
    assert largest == min(limit, 16)
    assert bounded_by == ("cap" if limit >= 16 else "oom")
    # doubling first (1, 2, 4, ... up to the first failure), then bisection: never a batch twice
    doubling = [b for b in (1, 2, 4, 8, 16) if b <= max(1, min(limit + 1, 16))]
    assert probed[: len(doubling)] == doubling[: len(probed)]
    assert len(probed) == len(set(probed))
    assert len(probed) <= 9
    if limit < 16:
        assert limit + 1 in probed  # the search saw the first batch that does not fit


def test_search_with_a_cap_that_is_not_a_power_of_two():
    probed: list[int] = []
    largest, bounded_by = bench.search_largest_batch(lambda b: probed.append(b) or True, max_batch=12)
    assert (largest, bounded_by) == (12, "cap")
    assert probed == [1, 2, 4, 8, 12]


# -- the demo bench: tiny model, real trainer step, profile store ----------------------------------------


def test_demo_bench_writes_points_the_planner_loader_accepts(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    seen = []
    results = bench.run_bench(
        [bench.demo_request("lora")], demo=True, store_dir=root, on_result=seen.append, effort=TINY
    )
    (res,) = results
    assert res.max_batch == 4 and res.bounded_by == "cap"
    assert [p.batch for p in seen] == [1, 2, 4]
    assert all(p.fits and p.it_s > 0 and p.peak_allocated_bytes is None for p in seen)
    assert all(p.peak_rss_delta_bytes is not None for p in seen)

    path = root / "methods" / "lora.yaml"
    assert seen[-1].store_file == path
    loaded = profiles.load_profiles(local=root)  # the planner's strict loader, shipped + local
    mine = [p for p in loaded.points if p.origin == "local"]
    assert sorted(p.batch for p in mine) == [1, 2, 4]
    for p in mine:
        assert p.method == "lora" and p.model == "sd15" and p.resolution == bench.DEMO_RESOLUTION
        assert p.gpu == "CPU" and p.precision == "fp32" and p.options.lora_rank == bench.DEFAULT_LORA_RANK
        assert p.outcome["fits"] is True and p.outcome["it_s"] > 0
        assert "peak_vram_gib" not in p.outcome  # a CPU run never claims VRAM
        assert p.source.startswith("measured: sdplan bench --demo")
        assert "torch " in p.source and "NOT a full-size sd15" in p.source
        assert "resident-set" in p.note
    # every shipped point is still there
    assert len(loaded.points) == len(profiles.load_profiles(local=tmp_path / "empty").points) + 3


@pytest.mark.parametrize("method", ["dreambooth", "finetune", "textual-inversion"])
def test_demo_bench_runs_every_method(tmp_path, monkeypatch, method):
    root = fresh_profile_store(monkeypatch, tmp_path)
    req = bench.BenchRequest(
        method=method,
        model="sd15",
        resolution=64,
        precision="fp32",
        gradient_checkpointing=True,
        cache_latents=True,
        train_text_encoder=method == "finetune",
        cache_text_encoder_outputs=method == "dreambooth",
        settings_from="test",
    )
    (res,) = bench.run_bench([req], demo=True, store_dir=root, effort=bench.Effort(0, 1, 1))
    assert res.max_batch == 1 and res.points[0].fits
    (point,) = profiles.load_methods(root / "methods" / f"{method}.yaml", origin="local")[0]
    assert point.options.gradient_checkpointing and point.options.cache_latents
    assert point.options.train_text_encoder is (method == "finetune")
    assert point.options.cache_text_encoder_outputs is (method == "dreambooth")


def test_the_harness_is_the_recipe_step(tmp_path):
    """One step trains only what the method trains, and allocates the optimizer state the peak must hold."""
    import torch

    req = bench.BenchRequest(
        method="lora", model="sd15", resolution=64, precision="fp32", cache_latents=False
    )
    h = bench.Harness(req, device="cpu", demo=True, workdir=tmp_path)
    try:
        lora = {n for n, p in h.unet.named_parameters() if p.requires_grad}
        assert lora and all("lora" in n for n in lora)
        assert not any(p.requires_grad for te in h.text_encoders for p in te.parameters())
        before = {n: p.detach().clone() for n, p in h.unet.named_parameters() if n in lora}
        assert not h.optimizer_has_state()
        loss = h.step(2)
        assert h.optimizer_has_state() and loss > 0
        changed = [n for n, p in h.unet.named_parameters() if n in lora and not torch.equal(p, before[n])]
        assert changed
    finally:
        h.close()


def test_after_an_oom_in_the_fp16_optimizer_step_the_next_probe_point_steps():
    """fp16 on a GPU steps through a GradScaler. An OOM inside the optimizer step (Adam allocating its state)
    comes after the gradients were unscaled and before ``scaler.update()``: unless the harness ends that step,
    the next probe point's unscale raises "unscale_() has already been called" instead of measuring."""
    import torch

    from sdplan.bench_harness import end_failed_step

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")  # accelerate's fp16 scaler is torch.amp.GradScaler("cuda")

    def out_of_memory():  # AdamW.step(closure) calls it first: the step's allocation fails there
        raise torch.OutOfMemoryError("CUDA out of memory")

    def step(closure=None):  # loop.optimizer_step under fp16, as accelerate runs it
        scaler.scale(model(torch.ones(2, 8)).square().mean()).backward()  # accelerator.backward
        scaler.unscale_(optimizer)  # accelerator.clip_grad_norm_
        scaler.step(optimizer, closure)  # the prepared optimizer's step ...
        scaler.update()  # ... and its update

    with pytest.raises(torch.OutOfMemoryError):
        step(out_of_memory)
    end_failed_step(optimizer, scaler)
    assert all(p.grad is None for p in model.parameters())
    before = model.weight.detach().clone()
    step()
    assert optimizer.state and not torch.equal(model.weight, before)
    end_failed_step(optimizer, None)  # fp32 / bf16: no scaler; an OOM before the unscale: nothing to end
    end_failed_step(optimizer, scaler)


def test_cached_text_encoder_outputs_need_frozen_encoders():
    with pytest.raises(UsageError, match="frozen"):
        bench.BenchRequest(
            method="textual-inversion", model="sd15", resolution=512, cache_text_encoder_outputs=True
        )
    with pytest.raises(UsageError, match="frozen"):
        bench.BenchRequest(
            method="lora",
            model="sd15",
            resolution=512,
            train_text_encoder=True,
            cache_text_encoder_outputs=True,
        )


def test_simulated_oom_ends_the_search_at_the_last_fitting_batch(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    monkeypatch.setenv(bench.OOM_HOOK_ENV, "2")
    (res,) = bench.run_bench(
        [bench.demo_request("lora")], demo=True, store_dir=root, effort=bench.Effort(0, 1, 8)
    )
    assert (res.max_batch, res.bounded_by) == (2, "oom")
    assert [(p.batch, p.fits) for p in res.points] == [(1, True), (2, True), (4, False), (3, False)]
    assert all(p.simulated_oom for p in res.points if not p.fits)
    assert "out of memory" in res.points[2].error.lower()
    # the OOM points are measurements too: written, labelled as simulated
    written = {p.batch: p for p in profiles.load_methods(root / "methods" / "lora.yaml", origin="local")[0]}
    assert sorted(written) == [1, 2, 3, 4]
    assert written[4].outcome == {"fits": False}
    assert bench.OOM_HOOK_ENV in written[4].source and "SIMULATED" in written[4].source
    assert bench.OOM_HOOK_ENV not in written[2].source


def test_oom_at_batch_one_means_nothing_fits(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    monkeypatch.setenv(bench.OOM_HOOK_ENV, "0")
    (res,) = bench.run_bench([bench.demo_request("lora")], demo=True, store_dir=root, effort=TINY)
    assert (res.max_batch, res.bounded_by) == (0, "oom")
    assert [(p.batch, p.fits) for p in res.points] == [(1, False)]


def test_weights_that_do_not_fit_are_recorded_not_raised(tmp_path, monkeypatch):
    import torch

    root = fresh_profile_store(monkeypatch, tmp_path)

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(bench, "Harness", no_room)
    (res,) = bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=TINY)
    assert (res.max_batch, res.bounded_by) == (0, "oom")
    (point,) = res.points
    assert point.batch == 1 and not point.fits and "placing the weights" in point.error
    (written,) = profiles.load_methods(root / "methods" / "lora.yaml", origin="local")[0]
    assert written.outcome == {"fits": False} and "placing the weights" in written.note


def test_bad_oom_hook_value_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setenv(bench.OOM_HOOK_ENV, "lots")
    with pytest.raises(UsageError, match=bench.OOM_HOOK_ENV):
        bench.run_bench([bench.demo_request()], demo=True, store_dir=tmp_path, effort=TINY)


def test_ctrl_c_keeps_what_was_measured(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)

    def stop_after_two(point):
        if point.batch == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(
            [bench.demo_request("lora"), bench.demo_request("dreambooth")],
            demo=True,
            store_dir=root,
            on_result=stop_after_two,
            effort=TINY,
        )
    kept, _ = profiles.load_methods(root / "methods" / "lora.yaml", origin="local")
    assert sorted(p.batch for p in kept) == [1, 2]
    assert not (root / "methods" / "dreambooth.yaml").exists()


def test_remeasuring_replaces_points_with_the_same_id(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    effort = bench.Effort(0, 1, 2)
    bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=effort)
    bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=effort)
    points, _ = profiles.load_methods(root / "methods" / "lora.yaml", origin="local")
    assert sorted(p.batch for p in points) == [1, 2]


def test_a_broken_store_file_is_never_overwritten(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    broken = root / "methods" / "lora.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("schema_version: 1\nmethod: lora\npoints: [{id: x, bogus: 1}]\n")
    with pytest.raises(ConfigError, match="bogus"):
        bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=TINY)
    assert "bogus" in broken.read_text()


# -- bench points teach the planner ------------------------------------------------------------------------


def _gpu_machine(gpu: str, memory_bytes: int) -> bench.Machine:
    return bench.Machine(
        kind="cuda",
        name=gpu,
        memory_total_bytes=memory_bytes,
        driver="550.90.07",
        torch="2.13.0",
        cuda="12.6",
    )


def _gpu_bench_point(req: bench.BenchRequest, machine: bench.Machine, b: int) -> bench.BenchPoint:
    """One point as a GPU bench's search leaves it, with stand-in numbers and the bench's own id."""
    point = bench.BenchPoint(
        request=req,
        batch=b,
        fits=True,
        it_s=2.0 / b,
        peak_allocated_bytes=(3 + b) * 2**30,
        peak_reserved_bytes=(4 + b) * 2**30,
        steps=6,
        warmup_steps=2,
        date="2026-01-01T00:00:00Z",
    )
    return replace(point, point_id=bench.point_id(machine, req, b, demo=False))


def _gpu_bench_points(req: bench.BenchRequest, gpu: str, memory_bytes: int, batches=(1, 2, 4, 8, 16)):
    """Records exactly as a GPU bench writes them (point_record), with stand-in numbers: this machine has no
    GPU to measure. The field names, ids and provenance are the bench's own."""
    machine = _gpu_machine(gpu, memory_bytes)
    return [bench.point_record(_gpu_bench_point(req, machine, b), machine) for b in batches]


def test_bench_points_make_the_planner_report_basis_measured(tmp_path, monkeypatch):
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    request = planner.Request(method="lora", model="sd15")
    before = planner.plan(snap, profiles.load_profiles(local=root), request)
    assert before.feasible and before.basis != "measured"

    sel = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap)
    (req,) = sel.requests
    assert req.settings_from.startswith("the planner")
    assert (req.precision, req.resolution) == (before.plan.precision, 512)
    assert req.gradient_checkpointing == before.plan.gradient_checkpointing
    assert req.cache_latents == before.plan.cache_latents

    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes))
    after = planner.plan(snap, profiles.load_profiles(local=root), request)
    assert after.feasible and after.basis == "measured"
    assert planner.result_dict(after)["estimate"]["basis"] == "measured"


def _rx6700xt_with_ram():
    """A 12 GB card (no bitsandbytes on ROCm) whose host holds an offloaded optimizer: the planner's SD1.5
    fine-tune here is DeepSpeed ZeRO-2 with CPU offload."""
    snap = Snapshot.load(MACHINES / "rx6700xt.json")
    return replace(snap, host=replace(snap.host, ram_total_bytes=64 * 2**30))


def test_a_deepspeed_plan_is_benched_as_planned_and_then_measured(tmp_path, monkeypatch):
    """The bench measured the leanest setting without offload where the planner chose DeepSpeed, so a 12 GB
    card's own offload plan could never be measured. It now benches the plan itself (each batch in a process
    of its own: the slow test below), records DeepSpeed in the point's id and settings, and the plan at those
    settings then says basis "measured"."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = _rx6700xt_with_ram()
    request = planner.Request(method="finetune", model="sd15", max_gpus=1)
    before = planner.plan(snap, profiles.load_profiles(local=root), request)
    assert before.plan.deepspeed == {"zero_stage": 2, "offload_optimizer": True}
    assert before.basis != "measured"

    (req,) = bench.select_requests(["finetune"], ["sd15"], store_dir=root, snapshot=snap).requests
    assert req.settings_from.startswith("the planner") and req.deepspeed == before.plan.deepspeed
    assert "DeepSpeed ZeRO-2 offload" in req.label

    gpu = snap.gpus[0]
    records = _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2, 4))
    assert all(r["id"].endswith(f"-zero2-offload-b{r['batch']}") for r in records)
    bench.write_points(root, "finetune", records)
    loaded = profiles.load_profiles(local=root)
    mine = [p for p in loaded.points if p.origin == "local"]
    assert [p.settings.deepspeed for p in mine] == [req.deepspeed] * 3 and all(p.from_bench for p in mine)
    after = planner.plan(snap, loaded, request)
    assert after.plan.deepspeed == req.deepspeed and after.basis == "measured"


def test_without_deepspeed_installed_the_bench_measures_the_leanest_setting_and_says_why(
    tmp_path, monkeypatch
):
    root = fresh_profile_store(monkeypatch, tmp_path)
    monkeypatch.setattr(bench, "importable", lambda module: module != "deepspeed")
    sel = bench.select_requests(["finetune"], ["sd15"], store_dir=root, snapshot=_rx6700xt_with_ram())
    (req,) = sel.requests
    assert req.deepspeed is None and "DeepSpeed, which is not installed" in req.settings_from


def test_deepspeed_is_pinned_as_sdplan_train_takes_it_and_checked_as_it_checks_it():
    req = bench.BenchRequest(method="finetune", model="sd15", resolution=512, settings_from="test")
    pinned = bench.pin_request(req, ["distributed.deepspeed.zero_stage=2"])
    assert pinned.deepspeed == {"zero_stage": 2, "offload_optimizer": True}
    sharded = bench.pin_request(pinned, ["distributed.deepspeed.offload_optimizer=false"])
    assert sharded.deepspeed == {"zero_stage": 2, "offload_optimizer": False}
    assert bench.pin_request(pinned, ["distributed.deepspeed=null"]).deepspeed is None
    # what the trainer refuses under DeepSpeed, the bench refuses with the trainer's words
    with pytest.raises(ConfigError, match="adamw8bit .* does not combine with DeepSpeed"):
        bench.pin_request(pinned, ["memory.optimizer=adamw8bit"])
    with pytest.raises(UsageError, match="cannot pin distributed.num_processes"):
        bench.pin_request(req, ["distributed.num_processes=2"])


@pytest.mark.slow
def test_a_deepspeed_request_measures_each_batch_in_a_process_of_its_own(tmp_path, monkeypatch):
    """DeepSpeed's engine fixes the micro-batch when it is prepared and its process group lives as long as the
    process, so each batch the search tries runs in a new process (bench_harness.probe_in_process), here on
    the tiny model with DeepSpeed's CPU accelerator, one batch (a process costs ~10 s of imports here; the
    search over several is test_search_*'s and the out-of-memory handling in it probe_point's, as in one
    process). Its point comes back from the child, is stored with DeepSpeed in its settings and id."""
    pytest.importorskip("deepspeed")
    root = fresh_profile_store(monkeypatch, tmp_path)
    req = replace(bench.demo_request("finetune"), deepspeed={"zero_stage": 2, "offload_optimizer": True})
    one = replace(TINY, max_batch=1)
    (res,) = bench.run_bench([req], demo=True, store_dir=root, effort=one)
    (point,) = res.points
    assert point.fits and (res.max_batch, res.bounded_by) == (1, "cap")
    assert point.it_s > 0 and point.peak_rss_delta_bytes > 0 and point.warmup_steps == one.warmup_steps + 1
    assert point.point_id.endswith("-zero2-offload-b1")
    (loaded,) = [p for p in profiles.load_profiles(local=root).points if p.origin == "local"]
    assert loaded.id == point.point_id and loaded.settings.deepspeed == req.deepspeed and loaded.from_bench


def test_a_measured_sample_grid_is_the_plans_grid_peak(tmp_path, monkeypatch):
    """On a GPU the bench ends each request with the trainer's final sample grid and writes its peak onto the
    largest fitting point (record_sample_grid: the same id, so the record is replaced, not added). A plan at
    those settings, at any batch, states that peak for the grid (plus the usual allowances) and says where it
    comes from when the grid would not fit."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    request = planner.Request(method="lora", model="sd15")
    before = planner.plan(snap, profiles.load_profiles(local=root), request)
    (req,) = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests
    gpu = snap.gpus[0]
    machine = _gpu_machine(gpu.name, gpu.memory_total_bytes)
    result = bench.BenchResult(request=req, points=[_gpu_bench_point(req, machine, b) for b in (1, 2)])
    path = bench.write_points(root, "lora", [bench.point_record(p, machine) for p in result.points])
    grid = int(11.5 * 2**30)  # over the card's 92%: the plan says the grid would not fit
    updated = bench.record_sample_grid(result, grid, machine=machine, root=root)
    assert updated.batch == 2 and result.points[-1] is updated and updated.store_file == path
    written = profiles.read_yaml(path)["points"]
    assert len(written) == 2 and written[-1]["outcome"]["sample_grid_peak_gib"] == 11.5
    assert "sample_grid_peak_gib: the trainer's final sample grid" in written[-1]["note"]

    prof = profiles.load_profiles(local=root)
    after = planner.plan(snap, prof, request)
    grid_allocated = 11.5 * 2**30
    assert after.memory.sampling_peak == pytest.approx(
        grid_allocated + planner._overhead_bytes(grid_allocated)
    )
    assert after.memory.sampling_peak != before.memory.sampling_peak
    assert any("final sample grid" in r and updated.point_id in r for r in after.reasons)


def test_default_selection_skips_what_is_measured_on_this_gpu(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    first = bench.select_requests(store_dir=root, snapshot=snap)
    cases = {(r.method, r.model, r.resolution) for r in first.requests}
    assert cases == {(m, f, 512 if f == "sd15" else 1024) for m in bench.METHODS for f in ("sd15", "sdxl")}
    assert not first.skipped

    lora = next(r for r in first.requests if (r.method, r.model) == ("lora", "sd15"))
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(lora, gpu.name, gpu.memory_total_bytes, batches=(1,)))
    second = bench.select_requests(store_dir=root, snapshot=snap)
    assert ("lora", "sd15") not in {(r.method, r.model) for r in second.requests}
    assert len(second.requests) == len(first.requests) - 1
    assert second.skipped and "lora sd15 512px" in second.skipped[0]
    # named explicitly, it is measured again
    again = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap)
    assert [(r.method, r.model) for r in again.requests] == [("lora", "sd15")]
    # another GPU's measurement does not count for this one
    other = Snapshot.load(MACHINES / "t4.json")
    assert ("lora", "sd15") in {
        (r.method, r.model) for r in bench.select_requests(store_dir=root, snapshot=other).requests
    }
    # nor do points at other settings than the planner's (a pinned bench's): its settings stay unmeasured
    pinned_root = fresh_profile_store(monkeypatch, tmp_path / "pinned")
    elsewhere = replace(lora, precision="fp16", gradient_checkpointing=not lora.gradient_checkpointing)
    bench.write_points(
        pinned_root, "lora", _gpu_bench_points(elsewhere, gpu.name, gpu.memory_total_bytes, batches=(1,))
    )
    third = bench.select_requests(store_dir=pinned_root, snapshot=snap)
    assert ("lora", "sd15") in {(r.method, r.model) for r in third.requests} and not third.skipped


def test_selection_rejects_bad_names():
    with pytest.raises(UsageError, match="unknown method"):
        bench.select_requests(["lorra"], demo=True)
    with pytest.raises(UsageError, match="unknown model"):
        bench.select_requests(None, ["sd3"], demo=True)
    with pytest.raises(UsageError, match="tiny model"):
        bench.select_requests(None, ["sd21"], demo=True)


# -- the commands ------------------------------------------------------------------------------------------


def test_bench_demo_command_prints_a_table_and_saves(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    monkeypatch.setenv(bench.OOM_HOOK_ENV, "2")
    result = CliRunner().invoke(cli(), ["bench", "--demo", "--store", str(root)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "lora sd15 tiny 64px" in out and "OOM at 3 (simulated)" in out
    assert "batch 4: out of memory (simulated)" in out
    assert "4 points saved to" in out and "not VRAM" in out
    assert (root / "methods" / "lora.yaml").is_file()
    # not a terminal (a log, a pipe): no live bar, so each phase is a line, before the minutes it can take
    assert "  ... building the model" in out and "  ... batch 1" in out


def test_demo_points_stay_out_of_the_planners_store_by_default(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["bench", "--demo"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert (root / "demo" / "methods" / "lora.yaml").is_file()
    assert not (root / "methods").exists()
    assert not [p for p in profiles.load_profiles(local=root).points if p.origin == "local"]


def test_bench_without_a_gpu_says_so(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["bench", "--quick"])
    assert result.exit_code == 4
    assert "no usable GPU" in result.output and "--demo" in result.output


def test_profiles_lists_shipped_and_local(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests[0]
    bench.write_points(
        root, "lora", _gpu_bench_points(req, snap.gpus[0].name, snap.gpus[0].memory_total_bytes)
    )
    bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=bench.Effort(0, 1, 1))

    result = CliRunner().invoke(cli(), ["profiles", "--full"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    out = result.output
    assert "gpus.yaml" in out and "models/sdxl.yaml" in out and "activations.yaml" in out
    assert "shipped" in out and "local" in out
    assert "measured here" in out and "demo (CPU, tiny model)" in out and "published" in out
    assert "NVIDIA GeForce RTX 3060" in out and "measured: sdplan bench" in out
    assert "diffusers" in out  # a shipped point's source
    n_local = 6
    assert f"({n_local} measured here)" in out

    gpus = CliRunner().invoke(cli(), ["profiles", "--gpus"], env={"COLUMNS": "250"})
    assert gpus.exit_code == 0 and "GPU catalog" in gpus.output and "H100 SXM" in gpus.output
    # each card's memory as a plan counts it: a T4's NVML total (ECC), a 4090's marketing size
    rows = {
        line.split("│")[1].strip(): line.split("│")[3].strip()
        for line in gpus.output.splitlines()
        if line.count("│") > 4
    }
    assert (rows["T4"], rows["A10G"], rows["RTX 4090"]) == ("15 GiB", "22.5 GiB", "24 GiB")


def test_profiles_fit_an_80_column_terminal_with_their_figures_whole(tmp_path, monkeypatch):
    """On 80 columns every table of `sdplan profiles --gpus` fits, and the figures stay whole: a fixed 40-column
    source cut the catalog's TFLOPS to '4.…' and wrapped the points' settings a few letters a line."""
    from rich.cells import cell_len

    fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["profiles", "--gpus"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    h100 = next(line for line in lines if line.startswith("│ H100 SXM "))
    assert "989.4" in h100 and "80 GiB" in h100
    assert any("adamw8bit" in line for line in lines)  # a setting on one line, not 'adam / w8bi / t'
    assert "Method points: published measurement" in result.output


def test_profiles_export_writes_a_shareable_file_and_refuses_overwrite(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests[0]
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=bench.Effort(0, 1, 1))

    dest = tmp_path / "share" / "rtx3060.yaml"
    dest.parent.mkdir()
    runner = CliRunner()
    result = runner.invoke(cli(), ["profiles", "export", str(dest)])
    assert result.exit_code == 0, result.output
    assert "wrote 2 measured points" in result.output and "1 demo/simulated point left out" in result.output
    doc = yaml.safe_load(dest.read_text())
    assert doc["kind"] == bench.EXPORT_KIND and set(doc["methods"]) == {"lora"}
    exported = bench.load_export(dest)
    assert [p.batch for p in exported["lora"]] == [1, 2]
    assert all(p.gpu == gpu.name and p.source.startswith("measured: sdplan bench") for p in exported["lora"])

    # each section is a complete method file: saved as one, the planner's loader reads it
    ship = tmp_path / "ship" / "methods" / "lora.yaml"
    ship.parent.mkdir(parents=True)
    ship.write_text(yaml.safe_dump(doc["methods"]["lora"]))
    assert len(profiles.load_methods(ship)[0]) == 2

    before = dest.read_text()
    again = runner.invoke(cli(), ["profiles", "export", str(dest)])
    assert again.exit_code == 3 and "already exists" in again.output and "--force" in again.output
    assert dest.read_text() == before
    forced = runner.invoke(cli(), ["profiles", "export", str(dest), "--force"])
    assert forced.exit_code == 0, forced.output


def test_profiles_export_keeps_bench_points_beside_what_train_observed(tmp_path, monkeypatch):
    """A store holds a method's bench points (lora.yaml) and what `sdplan train` observed (observed-lora.yaml,
    an out of memory): the export had one section per file read, so the second replaced the first's points."""
    import datetime

    from sdplan import config as C
    from sdplan.launcher import oom_point, record_point

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests[0]
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    oom = oom_point(
        C.validate(C.default_config()),
        {"batch_size": 8, "grad_accum": 1, "step": 3},
        family="sd15",
        gpu_name=gpu.name,
        gpu_memory_bytes=gpu.memory_total_bytes,
        when=datetime.datetime(2026, 12, 7, 12, 0, 0),
    )
    record_point(oom, "lora", root)
    dest = tmp_path / "all.yaml"
    _, count, _ = bench.export_measurements(dest)
    exported = bench.load_export(dest)["lora"]
    assert count == 3 and sorted(p.batch for p in exported) == [1, 2, 8]
    assert [p.outcome["fits"] for p in exported if p.batch == 8] == [False]
    # and they import as they were: three points in the other store
    other = fresh_profile_store(monkeypatch, tmp_path / "other")
    _, added, _ = bench.import_measurements(dest)
    assert (
        added == {"lora": 3}
        and len(profiles.load_methods(other / "methods" / "lora.yaml", origin="local")[0]) == 3
    )
    # imported back where it came from (its observed point now in lora.yaml too), the store exports again
    fresh_profile_store(monkeypatch, tmp_path)
    bench.import_measurements(dest)
    again = tmp_path / "again.yaml"
    _, count, _ = bench.export_measurements(again)
    assert count == 3 and len(bench.load_export(again)["lora"]) == 3
    assert not list(tmp_path.glob(".again.yaml.*"))


def test_profiles_import_adds_an_exported_file_to_another_store(tmp_path, monkeypatch):
    """The export file's header said to save it as a store's methods/<method>.yaml; saved so, every recommend
    failed on its unknown keys. `sdplan profiles import FILE` adds its points (twice: nothing more), a copy
    in the store says to import it, and `profiles --store FILE` is refused as `bench --store` is."""
    root = fresh_profile_store(monkeypatch, tmp_path / "here")
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests[0]
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    shared = tmp_path / "rtx3060.yaml"
    runner = CliRunner()
    assert runner.invoke(cli(), ["profiles", "export", str(shared)]).exit_code == 0
    assert "sdplan profiles import THIS_FILE" in shared.read_text()

    other = tmp_path / "there"
    for _ in range(2):
        result = runner.invoke(cli(), ["profiles", "import", str(shared), "--store", str(other)])
        assert result.exit_code == 0, result.output
        assert f"imported 2 points (2 lora) into {other}" in " ".join(result.output.split())
    points, _ = profiles.load_methods(other / "methods" / "lora.yaml", origin="local")
    assert [p.batch for p in points] == [1, 2] and all(p.gpu == gpu.name for p in points)

    misplaced = other / "methods" / "sd15.yaml"
    misplaced.write_text(shared.read_text())
    listed = runner.invoke(cli(), ["profiles", "--store", str(other)])
    assert listed.exit_code == 2 and "a `sdplan profiles export` file" in listed.output
    assert "sdplan profiles import sd15.yaml" in " ".join(listed.output.split())

    bad = runner.invoke(cli(), ["profiles", "import", str(tmp_path / "nope.yaml"), "--store", str(other)])
    assert bad.exit_code == 2 and "no such file" in bad.output
    a_file = tmp_path / "keep.txt"
    a_file.write_text("mine")
    for args in (
        ["profiles"],
        ["profiles", "export", str(tmp_path / "e.yaml")],
        ["profiles", "import", str(shared)],
    ):
        refused = runner.invoke(cli(), [*args, "--store", str(a_file)])
        assert refused.exit_code == 2 and "is a file, not a folder" in refused.output, args
    # set by $SDPLAN_PROFILE_DIR, as a file or below one: every command says so (recommend skipped it silently)
    from sdplan.cli import app

    for where in (a_file, a_file / "sub"):
        env = {"SDPLAN_PROFILE_DIR": str(where)}
        r = runner.invoke(
            app, ["recommend", "--method", "lora", "--model", "sd15", "--hardware", "RTX 4090"], env=env
        )
        assert r.exit_code == 2 and f"{a_file} is a file, not a folder" in " ".join(r.output.split()), (
            r.output
        )
    assert a_file.read_text() == "mine"
    loop = tmp_path / "loop"
    loop.symlink_to(
        loop
    )  # `sdplan profiles` crashed on it (RuntimeError: Symlink loop), recommend skipped it
    r = runner.invoke(cli(), ["profiles", "--store", str(loop)])
    assert r.exit_code == 2 and "is a symbolic link that loops" in " ".join(r.output.split()), r.output
    (tmp_path / "later").symlink_to(tmp_path / "not-yet")  # a link to a folder not made yet is fine
    assert runner.invoke(cli(), ["profiles", "--store", str(tmp_path / "later")]).exit_code == 0


def test_profiles_group_store_applies_to_export_and_import(tmp_path, monkeypatch):
    """`sdplan profiles --store DIR export FILE` / `... import FILE`: the group's --store was dropped (the
    callback returned before reading it) and import wrote into the default store, exit 0. It applies to the
    subcommand as its own --store does; two different --store values are refused."""
    default = fresh_profile_store(monkeypatch, tmp_path / "default")
    mine = tmp_path / "mine"
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=mine, snapshot=snap).requests[0]
    gpu = snap.gpus[0]
    bench.write_points(mine, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    runner = CliRunner()
    shared = tmp_path / "shared.yaml"
    result = runner.invoke(cli(), ["profiles", "--store", str(mine), "export", str(shared)])
    assert result.exit_code == 0 and "wrote 2 measured points" in result.output, result.output

    other = tmp_path / "other"
    result = runner.invoke(cli(), ["profiles", "--store", str(other), "import", str(shared)])
    assert result.exit_code == 0, result.output
    assert f"into {other}" in " ".join(result.output.split())
    assert (other / "methods" / "lora.yaml").is_file() and not default.exists()

    both = runner.invoke(
        cli(), ["profiles", "--store", str(mine), "import", str(shared), "--store", str(other)]
    )
    assert both.exit_code == 2 and "--store given twice" in both.output, both.output
    same = runner.invoke(
        cli(), ["profiles", "--store", str(other), "import", str(shared), "--store", str(other)]
    )
    assert same.exit_code == 0, same.output


def test_profiles_import_leaves_out_demo_points_as_export_does(tmp_path, monkeypatch):
    """`profiles export` leaves out CPU/tiny-model demo points and simulated OOMs; `profiles import` took them
    from a file (an export edited by hand, an older sdplan's) into the store the planner reads. They are left
    out with a line saying so; a file holding nothing else is refused and nothing is written."""
    here = fresh_profile_store(monkeypatch, tmp_path / "here")
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=here, snapshot=snap).requests[0]
    gpu = snap.gpus[0]
    bench.write_points(here, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    bench.run_bench([bench.demo_request()], demo=True, store_dir=here, effort=bench.Effort(0, 1, 1))
    shared = tmp_path / "shared.yaml"
    runner = CliRunner()
    assert runner.invoke(cli(), ["profiles", "export", str(shared)]).exit_code == 0
    doc = yaml.safe_load(shared.read_text())
    demo_doc = yaml.safe_load((here / "methods" / f"{bench.demo_request().method}.yaml").read_text())
    demo = [p for p in demo_doc["points"] if not bench._is_shareable(p)]
    assert demo
    doc["methods"]["lora"]["points"] += demo
    shared.write_text(yaml.safe_dump(doc, sort_keys=False))

    other = tmp_path / "other"
    result = runner.invoke(cli(), ["profiles", "import", str(shared), "--store", str(other)])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    left_out = f"{len(demo)} demo/simulated point{'s' if len(demo) != 1 else ''} left out"
    assert "imported 2 points (2 lora)" in out and left_out in out
    points, _ = profiles.load_methods(other / "methods" / "lora.yaml", origin="local")
    assert [p.batch for p in points] == [1, 2]

    doc["methods"]["lora"]["points"] = demo
    only_demo = tmp_path / "demo.yaml"
    only_demo.write_text(yaml.safe_dump(doc, sort_keys=False))
    empty = tmp_path / "empty"
    refused = runner.invoke(cli(), ["profiles", "import", str(only_demo), "--store", str(empty)])
    assert refused.exit_code == 2 and "demo or simulated" in refused.output, refused.output
    assert not empty.exists()


def test_profiles_export_where_it_cannot_write_is_one_line_and_makes_no_folder(tmp_path, monkeypatch):
    """A missing folder is refused as `doctor --save` refuses it (export made it, a mistyped path too), and a
    file it cannot write is one line, not a traceback (PermissionError, FileNotFoundError)."""
    from conftest import one_line_error

    from sdplan.cli import app

    root = fresh_profile_store(monkeypatch, tmp_path / "store")
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    req = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, "NVIDIA GeForce RTX 3060", 12 * 2**30))
    (tmp_path / "a-file").write_text("mine\n")
    for dest in (tmp_path / "no" / "such" / "e.yaml", tmp_path / "a-file" / "e.yaml"):
        r = CliRunner().invoke(app, ["profiles", "export", str(dest)])
        one_line_error(r, 2, f"cannot write to {dest}", "name a file in a folder you can write to")
    assert not (tmp_path / "no").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "store"]  # no temporary file left
    assert (tmp_path / "a-file").read_text() == "mine\n"


def test_profiles_export_with_nothing_measured(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["profiles", "export", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "no local measurements" in result.output
    bench.run_bench([bench.demo_request()], demo=True, store_dir=root, effort=bench.Effort(0, 1, 1))
    result = CliRunner().invoke(cli(), ["profiles", "export", str(tmp_path / "x.yaml")])
    assert result.exit_code == 2 and "demo or simulated" in result.output
    assert not (tmp_path / "x.yaml").exists()


def test_commands_import_no_torch():
    code = (
        "import sys, sdplan.commands.bench, sdplan.commands.profiles; "
        "print('torch' in sys.modules, 'diffusers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_profiles_reports_a_broken_local_file_in_one_line(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    bad = root / "methods" / "lora.yaml"
    bad.parent.mkdir(parents=True)
    bad.write_text("schema_version: 1\nmethod: lora\npoints: [{id: x, bogus: 1}]\n")
    result = CliRunner().invoke(cli(), ["profiles"])
    assert result.exit_code == 2
    assert "lora.yaml" in result.output and "bogus: unknown key" in result.output
    assert "Traceback" not in result.output


def _write_oom_point(root: Path, snap: Snapshot, s, *, batch: int) -> bench.BenchPoint:
    """A bench out of memory on the snapshot's first GPU at the LoRA settings ``s`` (a planner Settings) and
    ``batch``, written to the store ``root``."""
    req = bench.BenchRequest(
        method="lora",
        model="sd15",
        resolution=s.resolution,
        precision=s.precision,
        gradient_checkpointing=s.gradient_checkpointing,
        optimizer=s.optimizer,
        cache_latents=s.cache_latents,
        lora_rank=s.lora_rank,
        settings_from="the planner",
    )
    gpu = snap.gpus[0]
    machine = bench.Machine(
        kind="cuda", name=gpu.name, memory_total_bytes=gpu.memory_total_bytes, torch="2.13.0"
    )
    oom = bench.BenchPoint(
        request=req, batch=batch, fits=False, error="CUDA out of memory", date="2026-01-01"
    )
    oom = replace(oom, point_id=bench.point_id(machine, req, batch, demo=False))
    bench.write_points(root, "lora", [bench.point_record(oom, machine)])
    return oom


def test_a_bench_oom_point_rules_that_configuration_out(tmp_path, monkeypatch):
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    request = planner.Request(method="lora", model="sd15")
    chosen = planner.plan(snap, profiles.load_profiles(local=root), request).plan
    _write_oom_point(root, snap, chosen, batch=1)
    after = planner.plan(snap, profiles.load_profiles(local=root), request).plan
    same = (after.precision, after.gradient_checkpointing, after.optimizer, after.cache_latents) == (
        chosen.precision,
        chosen.gradient_checkpointing,
        chosen.optimizer,
        chosen.cache_latents,
    )
    assert not same  # out of memory at batch 1 with those settings: the planner picks other settings


def test_a_pin_ruled_out_by_a_measured_oom_says_so_not_that_the_card_is_too_small(tmp_path, monkeypatch):
    """A pinned batch that ran out of memory here, where the model says it fits: it said "needs 6.0 GiB ... more
    than its 92% limit (11.0 GiB): at least 6.5 GiB" on a 12 GiB card and suggested cards to buy."""
    from sdplan import planner
    from sdplan.recommend import render

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    free = planner.plan(
        snap, profiles.load_profiles(local=root), planner.Request(method="lora", model="sd15")
    )
    s = replace(free.plan, batch=4, gradient_checkpointing=False)
    # every memory setting pinned: an out of memory at them rules out the one configuration left
    names = ("batch", "gradient_checkpointing", "precision", "optimizer", "cache_latents", "lora_rank")
    names += ("cache_text_encoder_outputs",)
    request = planner.Request(method="lora", model="sd15", pins=tuple((n, getattr(s, n)) for n in names))
    assert planner.plan(snap, profiles.load_profiles(local=root), request).feasible  # the model: it fits
    oom = _write_oom_point(root, snap, s, batch=4)
    gpu = snap.gpus[0]
    after = planner.plan(snap, profiles.load_profiles(local=root), request)
    assert not after.feasible and after.needs == {"min_vram_bytes": None, "observed_oom": oom.point_id}
    (why,) = [r for r in after.reasons if r.startswith("nothing fits")]
    assert (
        f"ran out of GPU memory when measured on {gpu.name} (at batch 4: local point {oom.point_id})" in why
    )
    assert "limit" not in why and "at least" not in why
    from rich.console import Console

    console = Console(width=400, record=True)
    render(planner.result_dict(after), after, console)
    text = console.export_text()
    assert (
        "does not fit: it, or a configuration the model puts within 5% of its memory, ran out of GPU memory"
        in text
    )
    # what needs more memory than what ran out (the model's own figures) is not offered as a fix
    assert "memory.cache_latents=false" not in " ".join(after.reasons)
    from sdplan.recommend import _compare_cells

    assert _compare_cells(planner.result_dict(after), after, gpu.name)[2] == "measured out of memory"
    assert "would fit" not in text and "needs at least" not in text


def test_a_measured_oom_rules_out_its_near_twins_and_the_plan_says_so(tmp_path, monkeypatch):
    """After an out of memory at the planner's own settings it recommended the same with 8-bit AdamW, 19 MiB less
    by the model (which errs by more than that), and said nothing. Within OOM_MARGIN of what ran out is out too;
    the plan names the point."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    request = planner.Request(method="lora", model="sd15")
    chosen = planner.plan(snap, profiles.load_profiles(local=root), request).plan
    oom = _write_oom_point(root, snap, chosen, batch=chosen.batch)
    learned = profiles.load_profiles(local=root)
    after = planner.plan(snap, learned, request)
    failed = planner.memory(learned, chosen).peak
    assert planner.memory(learned, after.plan).peak < planner.OOM_MARGIN * failed
    (said,) = [r for r in after.reasons if r.startswith("measured out of memory on")]
    assert oom.point_id in said and "rules out its configuration" in said


def test_a_point_of_the_other_board_of_a_shared_name_does_not_count_for_this_one(tmp_path, monkeypatch):
    """The RTX 3060 8GB and 12GB report one NVML name: the recorded memory keeps their measurements apart, in
    what the bench skips and in the planner's measured basis."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    (req,) = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, 8 * 2**30, batches=(1,)))
    learned = profiles.load_profiles(local=root)
    assert {learned.point_gpu(p).name for p in learned.points if p.origin == "local"} == {"RTX 3060 8GB"}
    assert ("lora", "sd15") in {
        (r.method, r.model) for r in bench.select_requests(store_dir=root, snapshot=snap).requests
    }
    result = planner.plan(snap, learned, planner.Request(method="lora", model="sd15"))
    assert result.feasible and result.basis != "measured"


def test_importing_the_other_boards_points_keeps_this_boards_own(tmp_path, monkeypatch):
    """A point's id is made of the GPU's name, which the RTX 3060 8GB and 12GB share: importing the 8 GB board's
    export into the 12 GB machine's store replaced its own measurement (same id), and its plans then stood on
    the other board's speed. Both stay; a re-measurement of the same board still replaces."""
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    gpu = snap.gpus[0]
    other = fresh_profile_store(monkeypatch, tmp_path / "other")
    (req,) = bench.select_requests(["lora"], ["sd15"], store_dir=other, snapshot=snap).requests
    bench.write_points(other, "lora", _gpu_bench_points(req, gpu.name, 8 * 2**30, batches=(1,)))
    shared = tmp_path / "8gb.yaml"
    bench.export_measurements(shared, store_dir=other)
    mine = fresh_profile_store(monkeypatch, tmp_path / "mine")
    bench.write_points(mine, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1,)))
    bench.import_measurements(shared)
    points, _ = profiles.load_methods(mine / "methods" / "lora.yaml", origin="local")
    assert sorted(p.gpu_memory_gib for p in points) == [8.0, pytest.approx(gpu.memory_total_bytes / 2**30)]
    assert len({p.id for p in points}) == 2
    # measured again on this board: replaced, not added; the other board's export imported again: the same
    bench.write_points(mine, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1,)))
    bench.import_measurements(shared)
    bench.import_measurements(shared)
    assert len(profiles.load_methods(mine / "methods" / "lora.yaml", origin="local")[0]) == 2


def test_a_speed_measured_at_another_resolution_states_a_wider_range(tmp_path, monkeypatch):
    """A bench speed at 512 px scaled a 768 px plan's time with the narrow band of a near point (x0.93-1.04):
    the H100's speeds scaled so across resolutions, each left out, missed by up to 2.3x. The scaling stays
    (far better than the model alone there) and the range widens to the validation set's at each end."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    (req,) = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).requests
    gpu = snap.gpus[0]
    bench.write_points(root, "lora", _gpu_bench_points(req, gpu.name, gpu.memory_total_bytes, batches=(1, 2)))
    learned = profiles.load_profiles(local=root)
    unc = learned.uncertainty
    near = planner.plan(
        snap, learned, planner.Request(method="lora", model="sd15", resolution=req.resolution)
    )
    other = planner.plan(snap, learned, planner.Request(method="lora", model="sd15", resolution=768))
    assert other.feasible and other.basis == "scaled"
    (why,) = [r for r in other.reasons if r.startswith("time:")]
    assert "widened to the validation set's" in why and "another resolution" in why
    wide = (
        min(unc.seconds_scaled[0], unc.seconds_for("sd15")[0][0]),
        max(unc.seconds_scaled[1], unc.seconds_for("sd15")[0][1]),
    )
    assert f"x{wide[0]:g}-{wide[1]:g}" in why
    assert not any("widened" in r for r in near.reasons)


def test_bench_on_a_gpu_outside_the_catalog_says_the_planner_cannot_use_its_points(tmp_path, monkeypatch):
    """The planner finds a GPU's points by its catalog entry: on a GPU outside the catalog the bench saved them,
    said "The planner uses these now", skipped the case next time as measured, and recommend's time stayed
    unknown. Now both the bench and the plan say what makes them count."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    odd = replace(snap, gpus=(replace(snap.gpus[0], name="NVIDIA Unlisted GPU 12GB"),))
    sel = bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=odd)
    assert "NVIDIA Unlisted GPU 12GB is not in sdplan's GPU catalog" in sel.uncatalogued
    assert str(root / "gpus.yaml") in sel.uncatalogued
    assert bench.select_requests(["lora"], ["sd15"], store_dir=root, snapshot=snap).uncatalogued is None
    res = planner.plan(odd, profiles.load_profiles(local=root), planner.Request(method="lora", model="sd15"))
    (note,) = [r for r in res.reasons if "is not in the GPU catalog" in r]
    assert "measurements count for it once it is there" in note


class _SleepyHarness:
    """Stands in for the bench harness's step: a step takes ``seconds`` (as a short GPU step does)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps = 0

    def step(self, batch: int) -> float:
        import time

        time.sleep(self.seconds)
        self.steps += 1
        return 0.0


def test_short_steps_are_timed_over_a_minimum_window_not_a_fixed_count():
    """On an H100 a 3-step window (0.2 s steps) gave it/s off by up to 2x; the bench now times steps until the
    effort's minimum time has passed and reports the median."""
    from sdplan.bench_harness import timed_steps

    effort = bench.Effort(
        warmup_steps=0, timed_steps=3, max_batch=1, min_timed_seconds=0.2, max_timed_steps=50
    )
    h = _SleepyHarness(0.01)
    seconds = timed_steps(lambda: h.step(1), effort, cuda=False)
    assert len(seconds) > 3 and sum(seconds) >= 0.2 and len(seconds) == h.steps
    capped = bench.Effort(
        warmup_steps=0, timed_steps=3, max_batch=1, min_timed_seconds=100.0, max_timed_steps=8
    )
    assert len(timed_steps(lambda: _SleepyHarness(0.0).step(1), capped, cuda=False)) == 8
    slow = bench.Effort(warmup_steps=0, timed_steps=3, max_batch=1, min_timed_seconds=0.0)
    assert len(timed_steps(lambda: _SleepyHarness(0.0).step(1), slow, cuda=False)) == 3


def test_a_gpu_table_with_out_of_memory_points_is_labelled_vram_not_cpu():
    """A GPU bench whose search ended in out of memory printed its table as a CPU demo's ("sdxl tiny",
    "RSS delta (CPU)"): the out-of-memory points have no peak, which was taken for a CPU run."""
    req = bench.BenchRequest(method="lora", model="sdxl", resolution=1024, precision="bf16")
    fits = bench.BenchPoint(request=req, batch=1, fits=True, it_s=1.6, peak_allocated_bytes=14 * 2**30)
    oom = bench.BenchPoint(request=req, batch=2, fits=False, error="CUDA out of memory")
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(bench_cmd.results_table([req], [fits, oom], cap=16, interrupted=False))
    text = console.export_text()
    assert "peak VRAM" in text and "RSS" not in text and "tiny" not in text


def test_local_bench_points_inform_their_gpu_but_do_not_refit_the_roofline(tmp_path, monkeypatch):
    """A user's `sdplan bench` points are evidence for that GPU (the plan's basis), not a refit of the roofline
    every other GPU's prediction rests on: shipping the H100's points into the fit moved the out-of-sample
    speed median from 20.1% to 31.6%."""
    from sdplan import planner

    root = fresh_profile_store(monkeypatch, tmp_path)
    before = planner.calibrate(profiles.load_profiles(local=root))
    req = bench.BenchRequest(
        method="lora", model="sd15", resolution=512, precision="fp16", settings_from="test"
    )
    bench.write_points(root, "lora", _gpu_bench_points(req, "NVIDIA GeForce RTX 3060", 12 * 2**30))
    loaded = profiles.load_profiles(local=root)
    assert [p.fit_speed for p in loaded.points if p.origin == "local"] == [False] * 5
    after = planner.calibrate(loaded)
    assert (after.bandwidth_efficiency, after.step_overhead_s) == (
        before.bandwidth_efficiency,
        before.step_overhead_s,
    )


def test_pinned_settings_override_the_planners_choice(tmp_path, monkeypatch):
    """`sdplan bench ... memory.gradient_checkpointing=false lora.rank=32`: the settings the largest misses ran
    with (the H100 session had to script them); the rest stays the planner's, the batch is still searched."""
    root = fresh_profile_store(monkeypatch, tmp_path)
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    (planned,) = bench.select_requests(["lora"], ["sdxl"], store_dir=root, snapshot=snap).requests
    pins = ("memory.gradient_checkpointing=false", "lora.rank=32", "memory.cache_text_encoder_outputs=false")
    (req,) = bench.select_requests(["lora"], ["sdxl"], store_dir=root, snapshot=snap, pins=pins).requests
    assert (req.gradient_checkpointing, req.lora_rank, req.cache_text_encoder_outputs) == (False, 32, False)
    assert (req.precision, req.optimizer, req.cache_latents) == (
        planned.precision,
        planned.optimizer,
        planned.cache_latents,
    )
    assert "pinned memory.gradient_checkpointing=false" in req.settings_from
    point = bench.point_id(bench.describe_machine("cpu"), req, 1, demo=False)
    assert "-nogc-" in point and point.endswith("-r32-b1")  # another point than the planner's settings
    # pinned, a measured case is measured again (the default selection skips it)
    assert bench.select_requests(store_dir=root, snapshot=snap, pins=("lora.rank=8",)).requests


def test_a_pin_no_benched_method_reads_is_refused(tmp_path, monkeypatch):
    """`sdplan bench --demo --method textual-inversion lora.rank=8` measured textual inversion and dropped
    lora.rank without a word (bench pins are shared by the methods benched); `recommend`/`train` refuse a
    setting only another method reads. It is refused where no benched method reads it, before anything runs."""
    store = fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(
        cli(), ["bench", "--demo", "--method", "textual-inversion", "lora.rank=8"], env={"COLUMNS": "300"}
    )
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "lora.rank" in result.output and "--method lora" in result.output, result.output
    assert not store.exists()
    # benched beside LoRA, it pins the LoRA request (the textual-inversion one takes none)
    bench.check_selection(["textual-inversion", "lora"], ["sd15"], None, demo=True, pins=("lora.rank=8",))
    bench.check_selection(None, ["sd15"], None, demo=True, pins=("lora.rank=8",))  # lora by default


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("training.learning_rate=1e-4", "sdplan bench cannot pin training.learning_rate"),
        ("training.batch_size=4", "sdplan bench cannot pin training.batch_size"),
        ("memory.optimizer=sgd", "memory.optimizer: must be one of"),
        ("memory.gradient_checkpointing=maybe", "must be true or false"),
    ],
)
def test_bad_pins_are_one_line_before_anything_runs(tmp_path, monkeypatch, item, message):
    fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["bench", "--quick", item], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("model", ["sd15", "sdxl"])
def test_trainer_vs_reference_script_times_both_loops_on_the_demo_model(model):
    """benchmarks/trainer_vs_reference.py (the trainer's step against diffusers' LoRA example loop written
    out bare) runs end to end on the tiny model; its figures are for a GPU (the CPU here is shared)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer_vs_reference.py"
    spec = importlib.util.spec_from_file_location("trainer_vs_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure(model, 2, demo=True, warmup=1, steps=2)
    assert r["sdplan"]["median_step_s"] > 0 and r["reference"]["median_step_s"] > 0
    assert r["ratio"] == r["sdplan"]["median_step_s"] / r["reference"]["median_step_s"]


def test_flux_script_memory_runs_each_variant_of_the_diffusers_step_on_the_demo_model():
    """benchmarks/flux_script_memory.py (diffusers' FLUX.1 LoRA example's step written out bare, for the next
    lent GPU) runs each variant on the tiny model. What the CPU can show: fp32 LoRA weights under autocast save
    more for the backward than bf16 ones without it (each LoRA's own bf16 cast of its input and weights), a
    batch of 2 about twice what a batch of 1 saves, and LayerNorm in fp32 (CUDA's autocast policy) more again."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "flux_script_memory.py"
    spec = importlib.util.spec_from_file_location("flux_script_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saved = {
        (v, b): mod.run(v, b, 64, 1, True, None)["saved_for_backward_bytes"]
        for v in ("script", "no-autocast")
        for b in (1, 2)
    }
    assert saved[("script", 1)] > saved[("no-autocast", 1)] > 0
    assert 1.8 < saved[("script", 2)] / saved[("script", 1)] < 2.2
    with mod.cuda_layer_norm_policy():  # CUDA's autocast keeps LayerNorm in fp32: its output is saved wider
        wider = mod.run("script", 1, 64, 1, True, None)["saved_for_backward_bytes"]
    assert wider > saved[("script", 1)]


def test_the_harness_makes_the_trainers_sample_grid_after_its_steps(tmp_path):
    """benchmarks/sampling_peak.py's measurement: two steps of a LoRA with cached latents (the VAE built anyway,
    off the GPU as the trainer leaves it), then the trainer's own sample grid (trainer/outputs.py samples), the
    VAE back for it. On the tiny SD1.5 model on the CPU: the grid is written as a PNG of the training
    resolution and the planner's figures for the full-size model come with it."""
    import importlib.util

    from PIL import Image

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sampling_peak.py"
    spec = importlib.util.spec_from_file_location("sampling_peak", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    row = mod.measure("sd15", 512, 1, demo=True)
    assert row["grid_written"] and row["resolution"] == 64
    assert row["predicted_grid_gib"] > row["predicted_step_gib"] > 0  # the VAE decode at 512 px: the larger
    from sdplan.bench_harness import Harness

    h = Harness(mod.request("sd15", 64), device="cpu", demo=True, workdir=tmp_path, keep_vae=True)
    try:
        assert h.comps.vae is not None and h.req.cache_latents  # built for the grid, not used by the steps
        h.step(1)
        grid = h.sample_grid(tmp_path / "grid.png")
        width, height = Image.open(grid).size
        assert width == 64 and 64 < height < 128  # the image, its label strip under it
    finally:
        h.close()


def test_a_sample_grid_that_fails_in_the_bench_records_no_peak(tmp_path, monkeypatch, capsys):
    """The trainer's grid now skips a failure (not out of memory, not a full disk) and returns None; the bench's
    sample_grid_peak then recorded the peak of the grid that died part-way as sample_grid_peak_bytes, and said
    "the trained weights are written". The bench's grid raises: "sample grid not measured", nothing recorded."""
    import torch
    from sdplan.trainer import sampling

    def broken(*args, **kwargs):
        raise RuntimeError("shape '[96, 0]' is invalid for input of size 24")

    monkeypatch.setattr(sampling, "sample_grid", broken)
    for name in ("synchronize", "reset_peak_memory_stats"):  # the CUDA bookkeeping, on the CPU
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 123)
    monkeypatch.setattr(bench, "free_memory", lambda: None)
    req = bench.BenchRequest(
        method="lora", model="sd15", resolution=64, precision="fp32", cache_latents=False
    )
    h = bench.Harness(req, device="cpu", demo=True, workdir=tmp_path)
    try:
        h.step(1)
        with pytest.raises(RuntimeError, match="invalid for input"):
            bench.sample_grid_peak(h, tmp_path)
    finally:
        h.close()
    assert "the trained weights are written" not in capsys.readouterr().out
    assert not list(tmp_path.glob("*.error.txt"))


@pytest.mark.slow
def test_the_harness_runs_the_trainers_step_under_deepspeed_in_one_process():
    """benchmarks/deepspeed_memory.py (for the next lent GPU): the trainer's step under DeepSpeed ZeRO-2 with CPU
    optimizer offload, accelerate's plugin built in this one process (the micro-batch given as the trainer's
    data loader would), on the tiny model with DeepSpeed's CPU accelerator. It prints one JSON line: the
    planner's allocated peak for the full settings, DeepSpeed's ZeRO optimizer in place, a step time."""
    pytest.importorskip("deepspeed")
    import json
    import os

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "deepspeed_memory.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--demo", "--model", "sd15", "--method", "finetune", "--batch", "2"],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=1800,  # a hang guard only
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert "error" not in row, row
    assert row["optimizer"] == "DeepSpeedZeroOptimizer" and row["step_s"] > 0
    assert row["deepspeed"] == {"zero_stage": 2, "offload_optimizer": True}
    assert (
        row["predicted_parts_gib"]["optimizer"] == 0
    )  # offloaded: the master weights and Adam live on the host


# -- sdplan bench --host: this host's CPU Adam rate -----------------------------------------------------------


def test_a_measured_host_rate_sets_offload_time_on_this_machine_only(tmp_path, monkeypatch):
    """host.yaml in the local store (what `sdplan bench --host` writes) replaces the shipped CPU Adam rate when
    the plan is for this machine (a probe), and says so; a saved snapshot of another machine or a catalog GPU
    keeps the shipped rate."""
    from sdplan import planner as P
    from sdplan.settings import OFFLOAD

    root = fresh_profile_store(monkeypatch, tmp_path)
    slow = profiles.HostMeasurement(
        cpu="Test CPU", threads=4, cpu_adam_params_per_s=0.5e9, source="a test's figure"
    )
    profiles.write_host(root, slow)
    prof = profiles.load_profiles(local=root)
    assert prof.host == slow
    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    snap = replace(snap, host=replace(snap.host, ram_total_bytes=64 * 2**30))  # room for the offload
    # the settings pinned: a slower optimizer step makes a larger batch worth more, so the searches may differ
    pins = (("deepspeed", dict(OFFLOAD)), ("batch", 4), ("gradient_checkpointing", True))
    req = P.Request(method="finetune", model="sd15", pins=pins)
    here = P.plan(P.hardware_from_snapshot(snap, prof, source="probe"), prof, req)
    there = P.plan(P.hardware_from_snapshot(snap, prof, source="file"), prof, req)
    assert here.plan.offload and there.plan.offload and here.plan == there.plan
    assert here.step_seconds > there.step_seconds
    trained = here.memory.trainable_params
    # CPU Adam once per optimizer step: the step grows by the rates' difference over the trained parameters
    extra = trained / 0.5e9 - trained / P.CPU_ADAM_PARAMS_PER_S
    assert here.step_seconds - there.step_seconds == pytest.approx(extra / here.plan.grad_accum, rel=1e-6)
    assert any("at 0.50 G/s: measured on this host by `sdplan bench --host`" in r for r in here.reasons)
    assert any("`sdplan bench --host` measures this host's" in r for r in there.reasons)


def test_host_bench_refuses_other_options_in_one_line(tmp_path, monkeypatch):
    fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(cli(), ["bench", "--host", "--model", "sdxl"])
    assert result.exit_code != 0
    assert "--host measures this host's CPU only" in result.output
    assert not (tmp_path / "host.yaml").exists()


# extended: `make test-all` runs it, `make test` (CI) does not: the only test that needs DeepSpeed's CPU Adam op,
# which DeepSpeed compiles on first use (1.5-3 minutes of both cores of CI's 2-core machine; the trainer's CPU
# runs offload to torch's AdamW instead, sdplan.launch deepspeed_config)
@pytest.mark.slow
@pytest.mark.extended
def test_host_bench_measures_deepspeeds_cpu_adam_and_saves_it(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    root = fresh_profile_store(monkeypatch, tmp_path)
    monkeypatch.setattr(bench, "HOST_PARAMS", 5_000_000)
    result = CliRunner().invoke(cli(), ["bench", "--host"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    host = profiles.load_profiles(local=root).host
    assert host is not None and host.cpu_adam_params_per_s > 1e7 and host.threads >= 1
    assert "DeepSpeedCPUAdam" in host.source and "5M fp32 parameters" in host.source
    assert f"{host.cpu_adam_params_per_s / 1e9:.2f} G parameters/s" in result.output


@pytest.mark.parametrize("where", ["planners", "elsewhere"])
def test_bench_says_the_planner_uses_its_points_only_in_the_planners_store(tmp_path, monkeypatch, where):
    """`sdplan bench --store DIR` said "The planner uses these now" of a folder the planner never reads. The GPU
    parts are the demo's here (no GPU): the measuring, the saving and the words after it are the command's own."""
    planner_store = fresh_profile_store(monkeypatch, tmp_path / "planner")
    real_run = bench.run_bench
    real_resolve = bench.resolve_device
    # the command's check finds "a GPU"; the demo's run inside takes the CPU
    monkeypatch.setattr(
        bench,
        "resolve_device",
        lambda device="auto", *, demo=False: real_resolve(device, demo=True) if demo else "cuda",
    )
    monkeypatch.setattr(
        bench,
        "select_requests",
        lambda *a, **k: bench.Selection(requests=[bench.demo_request()], skipped=[], gpu="Test GPU"),
    )
    monkeypatch.setattr(
        bench,
        "run_bench",
        lambda reqs, **kw: real_run(reqs, **{**kw, "demo": True, "effort": bench.Effort(0, 1, 1)}),
    )
    store = planner_store if where == "planners" else tmp_path / "elsewhere"
    result = CliRunner().invoke(cli(), ["bench", "--store", str(store)], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"saved to {store}" in said
    if where == "planners":
        assert "The planner uses these now" in said
    else:
        assert "The planner uses these now" not in said
        assert (
            f"The planner reads {planner_store}, not {store}" in said
            and f"SDPLAN_PROFILE_DIR={store}" in said
        )
