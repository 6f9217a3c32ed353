"""`sdplan bench` for SD3.5 and FLUX.1: the CPU demo measures the tiny flow models through the trainer's
recipes and flow objective; a named family is selected even while the planner does not plan it, in the
leanest LoRA configuration; the full-size networks are built from profiles/models (on a GPU only)."""

from __future__ import annotations

import pytest
from conftest import MACHINES, fresh_profile_store
from typer.testing import CliRunner

from sdplan import bench, profiles, registry
from sdplan.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cli():
    import typer

    from sdplan.commands import bench as bench_cmd

    app = typer.Typer()
    app.command("bench")(bench_cmd.bench)
    app.command("other")(lambda: None)  # two commands: typer keeps the "bench" name on the command line
    return app


TINY = bench.Effort(warmup_steps=0, timed_steps=1, max_batch=2)


@pytest.mark.parametrize("family", ["sd35-medium", "flux-dev"])
def test_demo_bench_measures_the_tiny_flow_model_through_the_recipe(tmp_path, monkeypatch, family):
    root = fresh_profile_store(monkeypatch, tmp_path)
    sel = bench.select_requests(["lora"], [family], demo=True)
    (req,) = sel.requests
    assert req.model == family and req.resolution == bench.DEMO_RESOLUTION
    (res,) = bench.run_bench(sel.requests, demo=True, store_dir=root, effort=TINY)
    assert res.max_batch == 2 and all(p.fits and p.it_s > 0 for p in res.points)
    loaded = profiles.load_profiles(local=root)  # the planner's strict loader accepts the points
    mine = [p for p in loaded.points if p.origin == "local"]
    assert {p.model for p in mine} == {family} and sorted(p.batch for p in mine) == [1, 2]
    assert all(f"NOT a full-size {family}" in p.source for p in mine)


def _cached_demo_request(model: str):
    """A LoRA bench request on the tiny demo model, latents and text-encoder outputs cached."""
    return bench.BenchRequest(
        method="lora",
        model=model,
        resolution=64,
        precision="fp32",
        gradient_checkpointing=True,
        cache_latents=True,
        cache_text_encoder_outputs=True,
        settings_from="test",
    )


def test_demo_harness_steps_the_flow_objective_and_trains_only_the_adapter(tmp_path):
    """The harness is the trainer's LoRA recipe on the tiny FLUX model: the flow adapter's objective, only
    LoRA weights trainable, the transformer's weights unchanged by a step, the LoRA's changed."""
    import torch
    from sdplan.trainer.flow import FlowMatchingObjective

    from sdplan.bench_harness import Harness

    req = _cached_demo_request("flux-schnell")
    h = Harness(req, device="cpu", demo=True, workdir=tmp_path)
    try:
        assert isinstance(h.recipe.objective, FlowMatchingObjective)
        trainable = {n: p.detach().clone() for n, p in h.unet.named_parameters() if p.requires_grad}
        frozen = {n: p.detach().clone() for n, p in h.unet.named_parameters() if not p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        loss = h.step(2)
        assert loss == loss  # finite
        after = dict(h.unet.named_parameters())
        assert all(torch.equal(after[n], v) for n, v in frozen.items())
        assert any(not torch.equal(after[n], v) for n, v in trainable.items())
    finally:
        h.close()


@pytest.mark.parametrize("method", ["finetune", "dreambooth"])
def test_demo_bench_runs_the_full_weight_methods_on_sd35(tmp_path, monkeypatch, method):
    root = fresh_profile_store(monkeypatch, tmp_path)
    sel = bench.select_requests([method], ["sd35-large"], demo=True)
    (res,) = bench.run_bench(sel.requests, demo=True, store_dir=root, effort=bench.Effort(0, 1, 1))
    assert res.max_batch == 1 and res.points[0].fits


def test_named_flow_family_is_selected_in_the_leanest_lora_configuration(tmp_path):
    """Without a planner profile for the family, a named one is measured anyway (alias accepted), with the
    settings people run on 24 GB: bf16 base, gradient checkpointing, cached latents and T5/CLIP outputs."""
    from sdplan.machine import Snapshot

    snap = Snapshot.load(MACHINES / "rtx3060_12gb.json")
    sel = bench.select_requests(None, ["flux"], snapshot=snap, store_dir=tmp_path / "s")
    (req,) = sel.requests
    assert req.model == "flux-dev" and req.method == "lora"
    assert req.resolution == 1024  # FluxPipeline's default (profiles/models/flux-dev.yaml native_resolution)
    assert (req.precision, req.gradient_checkpointing, req.cache_latents, req.cache_text_encoder_outputs) == (
        "bf16",
        True,
        True,
        True,
    )
    if "flux-dev" not in registry.PLANNED_FAMILIES:
        assert req.settings_from == "default"
    with pytest.raises(UsageError, match="textual-inversion"):
        bench.select_requests(["textual-inversion"], ["sd35-medium"], snapshot=snap, store_dir=tmp_path / "s")


def test_full_size_flow_components_come_from_the_profiles_on_the_meta_device(tmp_path):
    """The full-size path builds the profile's networks (here on the meta device: shapes, no memory): the
    parameter counts are the profile's."""
    from sdplan.bench_harness import build_components

    spec = profiles.load_model(profiles.shipped_dir() / "models" / "sd35-medium.yaml")
    comps = build_components("sd35-medium", demo=False, workdir=tmp_path, device="meta", with_vae=False)
    assert comps.adapter is not None and comps.vae is None
    assert sum(p.numel() for p in comps.unet.parameters()) == spec.params_transformer
    assert [sum(p.numel() for p in te.parameters()) for te in comps.text_encoders] == list(
        spec.params_text_encoders
    )
    assert comps.tokenizers[2].model_max_length == registry.family("sd35-medium").t5_max_length


def test_bench_demo_command_takes_a_flow_model(tmp_path, monkeypatch):
    root = fresh_profile_store(monkeypatch, tmp_path)
    result = CliRunner().invoke(
        cli(),
        ["bench", "--demo", "--model", "flux-schnell", "--quick", "--store", str(root)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "lora flux-schnell tiny 64px" in result.output


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_a_quantized_base_is_measured_as_the_trainer_stores_it(tmp_path, monkeypatch, base):
    """`sdplan bench --model flux-dev model.base_precision=fp8`: the recipe stores the frozen base quantized
    (the trainer's quantize_base) and the point says so, so the planner reads it as that base's measurement
    (the validation set's two largest FLUX.1 speed misses are nf4 runs; the dequantising cost is uncalibrated)."""
    root = fresh_profile_store(monkeypatch, tmp_path)
    sel = bench.select_requests(["lora"], ["flux-dev"], demo=True, pins=(f"model.base_precision={base}",))
    (req,) = sel.requests
    assert req.base_precision == base and f"{base} base" in req.label
    (res,) = bench.run_bench(sel.requests, demo=True, store_dir=root, effort=TINY)
    assert all(p.fits for p in res.points) and all(
        p.point_id.endswith(f"-{base}-b{p.batch}") for p in res.points
    )
    mine = [p for p in profiles.load_profiles(local=root).points if p.origin == "local"]
    assert mine and {p.settings.base_precision for p in mine} == {base}


def test_a_quantized_base_is_refused_for_the_unet_families():
    result = CliRunner().invoke(cli(), ["bench", "--demo", "--model", "sd15", "model.base_precision=fp8"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "model.base_precision" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(("model", "negative"), [("flux-schnell", False), ("sd35-medium", True)])
def test_the_harness_caches_what_its_steps_and_grid_read_before_the_denoiser_is_placed(
    tmp_path, model, negative
):
    """sdplan bench encoded its caption after setup had placed the denoiser beside the encoders (a run encodes
    first: Recipe.place_models), and cached no empty caption, which SD3.5's grid reads as its negative prompt (a
    KeyError on CUDA). The harness now hands setup its captions, as a run's are cached."""
    from sdplan.trainer import loop

    from sdplan.bench_harness import Harness

    order: list[str] = []
    place = loop.Recipe.place_denoiser

    def placed(self, dtype):
        order.append("denoiser" if self.text_cache is not None else "denoiser before the cache")
        return place(self, dtype)

    req = _cached_demo_request(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop.Recipe, "place_denoiser", placed)
        h = Harness(req, device="cpu", demo=True, workdir=tmp_path)
    try:
        assert order == ["denoiser"]
        assert set(h.recipe.text_cache.embeds) == {Harness.CAPTION, *([""] if negative else [])}
    finally:
        h.close()
