"""The profile loader: every shipped file loads, schemas are strict, GPU names match leniently."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import one_line_error

from sdplan.errors import ConfigError, UsageError
from sdplan.profiles import clear_cache, load_gpus, load_methods, load_profiles, shipped_dir
from sdplan.registry import PLANNED_FAMILIES


@pytest.fixture
def profiles():
    clear_cache()
    return load_profiles()


def test_every_shipped_file_loads(profiles):
    assert len(profiles.gpus) >= 40
    assert set(profiles.models) == set(PLANNED_FAMILIES)
    assert {p.method for p in profiles.points} == {"lora", "dreambooth", "finetune", "textual-inversion"}
    assert len(profiles.multi_gpu) == 3
    assert profiles.activations.source.startswith("computed: scripts/compute_activations.py")
    for p in profiles.points:
        assert p.source.strip(), p.id
        if p.gpu is not None:
            profiles.find_gpu(p.gpu)  # every point names a catalog GPU
    for m in profiles.multi_gpu:
        profiles.find_gpu(m.gpu)


def test_unknown_keys_and_every_error_reported_at_once(tmp_path):
    bad = tmp_path / "gpus.yaml"
    bad.write_text(
        "schema_version: 1\n"
        "gpus:\n"
        "  - {name: X1, aliases: [], vendor: intel, memory_gib: -1, arch: '1', family: f, bf16: true, fp16: true,\n"
        "     fp16_tflops: 1, bf16_tflops: 1, memory_bandwidth_gbs: 1, pcie_gen: 4, interconnect: null,\n"
        "     source: s, colour: red}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_gpus(bad)
    text = " | ".join(e.value.errors)
    assert "gpus[0].colour: unknown key" in text
    assert "gpus[0].vendor" in text and "gpus[0].memory_gib: must be > 0" in text
    assert len(e.value.errors) == 3


def test_method_file_missing_and_bad_values(tmp_path):
    bad = tmp_path / "lora.yaml"
    bad.write_text(
        "schema_version: 1\nmethod: lora\npoints:\n"
        "  - {id: a, model: sd99, resolution: 512, batch: 0, grad_accum: 1, precision: fp8, gpu: null, num_gpus: 1,\n"
        "     options: {gradient_checkpointing: true, optimizer: adamw, cache_latents: false, train_text_encoder: false,\n"
        "               attention: sdpa, deepspeed: null, ema: null}, outcome: {fits: true}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_methods(bad)
    errs = e.value.errors
    assert any("points[0].model" in x for x in errs)
    assert any("points[0].batch: must be > 0" in x for x in errs)
    assert any("points[0].precision" in x for x in errs)
    assert any("points[0].source: missing" in x for x in errs)


def test_infinite_and_overflowing_numbers_are_refused(tmp_path, monkeypatch):
    """.inf passed as > 0: an infinite measured peak made recommend call AdamW "does not fit" and its speed
    "(measured)", an infinite memory_gib crashed it (OverflowError); 1.0e+300 GiB overflowed the same way.
    1e300 (YAML 1.1 reads it as text) says how to write it as a number."""
    card = (
        "  - {{name: {name}, aliases: [], vendor: nvidia, memory_gib: {mem}, arch: '8.9', family: ada, bf16: true,\n"
        "     fp16: true, fp16_tflops: {tflops}, bf16_tflops: null, memory_bandwidth_gbs: 1000, pcie_gen: 4,\n"
        "     interconnect: null, source: mine}}\n"
    )
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(
        "schema_version: 1\ngpus:\n"
        + card.format(name="A", mem=".inf", tflops=".nan")
        + card.format(name="B", mem="1.0e+300", tflops="1e300")
        + card.format(name="C", mem="24", tflops="1.0e+3")
        + card.format(
            name="D", mem="'24'", tflops="100"
        )  # quoted: text to YAML too, but not for its exponent
        + card.format(name="E", mem='"24\\t"', tflops="100")  # a tab: the hint's own YAML read crashed
    )
    with pytest.raises(ConfigError) as e:
        load_gpus(gpus)
    assert e.value.errors == [
        "gpus[0].memory_gib: must be > 0 and at most 1048576 (GiB)",
        "gpus[0].fp16_tflops: must be > 0 and finite",
        "gpus[1].memory_gib: must be > 0 and at most 1048576 (GiB)",
        "gpus[1].fp16_tflops: must be an integer or a number, got '1e300' (YAML reads 1e300 as text: write it "
        "as 1.0e+300)",
        "gpus[3].memory_gib: must be an integer or a number, got '24' (it is quoted: write it without the quotes)",
        "gpus[4].memory_gib: must be an integer or a number, got '24\\t'",
    ]
    points = tmp_path / "lora.yaml"
    points.write_text(
        "schema_version: 1\nmethod: lora\npoints:\n"
        "  - {id: a, model: sd15, resolution: 512, batch: 4, grad_accum: 1, precision: bf16, gpu: RTX 4090,\n"
        "     num_gpus: 1, gpu_memory_gib: 1.0e+300, source: mine, options: {gradient_checkpointing: false,\n"
        "     optimizer: adamw, cache_latents: true, train_text_encoder: false, attention: sdpa, deepspeed: null,\n"
        "     ema: null}, outcome: {fits: true, peak_vram_gib: .inf, it_s: .inf}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_methods(points)
    assert e.value.errors == [
        "points[0].gpu_memory_gib: must be > 0 and at most 1048576 (GiB)",
        "points[0].outcome.peak_vram_gib: must be > 0 and finite",
        "points[0].outcome.it_s: must be > 0 and finite",
    ]
    # in a local store: one line from recommend, no traceback
    from typer.testing import CliRunner

    from sdplan.cli import app

    store = tmp_path / "store"
    store.mkdir()
    (store / "gpus.yaml").write_text(
        "schema_version: 1\ngpus:\n" + card.format(name="A", mem=".inf", tflops=1)
    )
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(store))
    clear_cache()
    r = CliRunner().invoke(app, ["recommend", "--method", "lora", "--hardware", "A"])
    one_line_error(r, 2, "gpus[0].memory_gib: must be > 0 and at most 1048576 (GiB)")
    clear_cache()


def test_broken_yaml_names_the_line(tmp_path):
    bad = tmp_path / "gpus.yaml"
    bad.write_text("schema_version: 1\ngpus: [\n  - oops: {\n")
    with pytest.raises(ConfigError) as e:
        load_gpus(bad)
    assert "line" in str(e.value) and "not valid YAML" in str(e.value)


def test_parsed_yaml_is_kept_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """read_yaml keeps a file's parsed data in the cache and uses it only for the very bytes it was parsed from:
    an edit is read again, and a cache that is corrupt, missing or cannot be written costs only the parse."""
    from sdplan import profiles

    monkeypatch.setenv("SDPLAN_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "gpus.yaml"
    f.write_text("schema_version: 1\nnote: first\n")
    assert profiles.read_yaml(f) == {"schema_version": 1, "note": "first"}
    entry = profiles._parsed_cache(f)
    assert entry.is_file() and list(entry.parent.iterdir()) == [entry]  # one entry, no temporary file left
    # the entry is what is read: a parse of the file would not give this
    digest, _ = pickle.loads(entry.read_bytes())
    entry.write_bytes(pickle.dumps((digest, {"from": "cache"})))
    assert profiles.read_yaml(f) == {"from": "cache"}
    f.write_text("schema_version: 1\nnote: second\n")  # an edit: the entry's digest no longer matches
    assert profiles.read_yaml(f) == {"schema_version": 1, "note": "second"}
    assert profiles.read_yaml(f) == {"schema_version": 1, "note": "second"}  # and the new entry serves it
    entry.write_bytes(b"torn")
    assert profiles.read_yaml(f) == {"schema_version": 1, "note": "second"}
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("SDPLAN_CACHE_DIR", str(blocked))  # no folder can be made there
    assert profiles.read_yaml(f) == {"schema_version": 1, "note": "second"}


def test_no_home_folder_is_no_cache_and_one_line_for_the_store(tmp_path, monkeypatch):
    """A container's arbitrary user may have no home folder (Path.home() raises): sdplan keeps no cache then
    (the demo passes its cache over the same way), and a command that needs the local profile store says in one
    line to set $SDPLAN_PROFILE_DIR (it was a traceback)."""
    from typer.testing import CliRunner

    from sdplan import profiles
    from sdplan.cli import app

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    for var in ("SDPLAN_CACHE_DIR", "XDG_CACHE_HOME", "SDPLAN_PROFILE_DIR", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(OSError, match="SDPLAN_CACHE_DIR"):
        profiles.cache_dir()
    f = tmp_path / "gpus.yaml"
    f.write_text("schema_version: 1\n")
    assert profiles.read_yaml(f) == {"schema_version": 1}

    result = CliRunner().invoke(app, ["recommend", "--method", "lora", "--hardware", "RTX 4090"])
    one_line_error(result, 2, "no home folder", "SDPLAN_PROFILE_DIR")
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path / "store"))
    assert CliRunner().invoke(app, ["recommend", "--method", "lora", "--hardware", "RTX 4090"]).exit_code == 0


def test_a_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    bad = tmp_path / "gpus.yaml"
    bad.write_bytes(b"schema_version: 1\nnote: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_gpus(bad)


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("rtx4090", "RTX 4090"),
        ("RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("H100 SXM", "H100 SXM"),
        ("NVIDIA GeForce RTX 3060 Ti", "RTX 3060 Ti"),
        ("rtx 3060 12gb", "RTX 3060 12GB"),
        ("Tesla T4", "T4"),
    ],
)
def test_lenient_gpu_names(profiles, query, name):
    assert profiles.find_gpu(query).name == name


def test_shared_driver_name_settled_by_memory(profiles):
    ten = profiles.find_gpu("NVIDIA GeForce RTX 3080", memory_bytes=10 * 2**30)
    twelve = profiles.find_gpu("NVIDIA GeForce RTX 3080", memory_bytes=12 * 2**30)
    assert (ten.name, twelve.name) == ("RTX 3080 10GB", "RTX 3080 12GB")


def test_unknown_gpu_lists_the_closest(profiles):
    with pytest.raises(UsageError) as e:
        profiles.find_gpu("RTX 4099")
    assert "unknown GPU 'RTX 4099'" in str(e.value) and "RTX 4090" in str(e.value)


def test_lora_params_from_the_unet_config(profiles):
    # diffusers' SD1.5 attention LoRA at rank 4 has 797,184 parameters (to_q/k/v/out.0 of 16 transformer blocks)
    assert profiles.model("sd15").lora_params(4) == 797_184
    assert profiles.model("sdxl").lora_params(8) == 2 * profiles.model("sdxl").lora_params(4)


def test_local_store_adds_measured_points(tmp_path, monkeypatch):
    store = tmp_path / "store"
    (store / "methods").mkdir(parents=True)
    src = (shipped_dir() / "methods" / "lora.yaml").read_text()
    (store / "methods" / "lora.yaml").write_text(src.replace("id: diffusers-lora-2080ti", "id: mine"))
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(store))
    clear_cache()
    prof = load_profiles()
    mine = [p for p in prof.points if p.id == "mine"]
    assert mine and mine[0].origin == "local"


def test_empty_stores_share_one_profiles_object_and_its_calibration(tmp_path):
    """A store that adds nothing (a new user's, each test's) gives the one shipped-only Profiles, so what the
    planner keeps in its memo (the calibration) is computed once; a store with a point of its own gets its own."""
    from sdplan import planner

    a, b = load_profiles(local=tmp_path / "a"), load_profiles(local=tmp_path / "b")
    assert a is b and a.host is None
    assert planner.calibrate_for(a, _one_gpu()) is planner.calibrate_for(b, _one_gpu())

    store = tmp_path / "mine"
    (store / "methods").mkdir(parents=True)
    src = (shipped_dir() / "methods" / "lora.yaml").read_text()
    (store / "methods" / "lora.yaml").write_text(src.replace("id: diffusers-lora-2080ti", "id: mine"))
    mine = load_profiles(local=store)
    assert mine is not a and "mine" in {p.id for p in mine.points} and "mine" not in {p.id for p in a.points}


def _one_gpu():
    from sdplan import planner

    return planner.hardware_from_catalog(load_profiles().find_gpu("RTX 4090"))


def test_loading_imports_no_torch():
    code = "import sys; from sdplan.profiles import load_profiles; load_profiles(); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[1],
    )
    assert out.stdout.strip() == "False"
