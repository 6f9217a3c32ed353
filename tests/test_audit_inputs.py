"""A new user's mistakes, found by an audit of the CLI with bad inputs and edge cases: each is one clear line, a
non-zero exit, no traceback, nothing of the user's overwritten."""

from __future__ import annotations

import json

import pytest
from conftest import make_images, one_line_error, tiny_train_config, trains_in_process
from typer.testing import CliRunner

from sdplan.cli import app

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


# -- train --resume: a checkpoint whose files have the right sizes but damaged bytes --------------------------


@pytest.mark.train
@trains_in_process
def test_resume_from_a_checkpoint_with_damaged_bytes_is_one_line(tiny_sd15, tmp_path, capsys):
    from sdplan.trainer import checkpoint, run
    from sdplan.trainer.__main__ import main as trainer_main
    from test_trainer import write_cfg

    images = make_images(tmp_path / "data", n=2)
    out = tmp_path / "out"
    run.train(
        tiny_train_config(tiny_sd15, images, out, "training.max_steps=2", "checkpoints.keep_every_steps=2")
    )
    saved = checkpoint.latest_checkpoint(out)
    optimizer = saved / "optimizer.bin"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 256] = b"\xff" * 256  # same size: the sizes listed still match
    optimizer.write_bytes(bytes(data))
    # the sha256 saved with each file finds it before anything loads
    assert "optimizer.bin is damaged" in (checkpoint.verify_checkpoint(saved) or "")
    cfg = write_cfg(tiny_train_config(tiny_sd15, images, out, "training.max_steps=3"), tmp_path / "c.yaml")
    capsys.readouterr()
    assert trainer_main(["--config", str(cfg), "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("error: --resume latest: every checkpoint") and "optimizer.bin is damaged" in err
    assert optimizer.read_bytes() == bytes(data)  # the damaged checkpoint is left for the user to judge
    # A checkpoint saved before the sha256 was kept: the load itself fails, in one line.
    state = json.loads((saved / checkpoint.STATE_FILE).read_text())
    del state["sha256"]
    (saved / checkpoint.STATE_FILE).write_text(json.dumps(state))
    assert checkpoint.verify_checkpoint(saved) is None
    assert trainer_main(["--config", str(cfg), "--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: checkpoint {saved} cannot be loaded") and "--resume" in err


def test_a_checkpoint_file_above_the_whole_file_limit_is_hashed_by_slices(tmp_path, monkeypatch):
    """A large file (a full fine-tune's optimizer state) is hashed by 256 slices of 1 MiB, not read whole: a
    damaged slice changes its digest."""
    from sdplan.trainer import checkpoint

    monkeypatch.setattr(checkpoint, "FULL_HASH_BYTES", 1 << 20)
    monkeypatch.setattr(checkpoint, "_SAMPLE_BYTES", 1 << 10)
    big = tmp_path / "optimizer.bin"
    big.write_bytes(bytes(range(256)) * (8 << 12))  # 8 MiB
    digest = checkpoint.file_digest(big)
    assert digest.startswith("sampled:") and digest == checkpoint.file_digest(big)
    with open(big, "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * 16)
    assert checkpoint.file_digest(big) != digest


# -- bench --store: a folder that cannot be written ---------------------------------------------------------


@pytest.mark.parametrize("where", ["a-file", "a-file/sub"])
def test_bench_store_that_cannot_be_written_is_one_line_before_measuring(tmp_path, where):
    (tmp_path / "a-file").write_text("mine\n")
    r = cli("bench", "--demo", "--store", str(tmp_path / where), "--method", "lora", "--model", "sd15")
    one_line_error(r, 2, "cannot write the profile store", str(tmp_path / where), "--store")
    assert (tmp_path / "a-file").read_text() == "mine\n"
    assert "Measuring" not in r.stdout


def test_writing_points_into_a_store_that_is_a_file_is_a_usage_error(tmp_path):
    from sdplan import profiles
    from sdplan.errors import UsageError

    (tmp_path / "store").write_text("mine\n")
    with pytest.raises(UsageError, match="cannot write the profile store"):
        profiles.write_points(tmp_path / "store", "lora", [], header="")
    assert (tmp_path / "store").read_text() == "mine\n"


# -- train --model with a hub id that cannot be fetched ------------------------------------------------------

_LOAD = """
import sys
from sdplan.errors import SdplanError
from sdplan.trainer.models import load_components
try:
    load_components("someorg/no-such-model")
except SdplanError as e:
    print(e)
"""


@pytest.mark.parametrize(
    ("env", "said"),
    [
        # a network that refuses at once (huggingface_hub retried it five times, about 25 s, a line each)
        ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach the hub"),
        ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ],
    ids=["no-network", "offline"],
)
def test_a_hub_id_that_cannot_be_fetched_is_one_line_without_retries(tmp_path, env, said):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
    run = subprocess.run(
        [sys.executable, "-c", _LOAD],
        env={**base, "HF_HOME": str(tmp_path / "hf"), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.startswith("hub model someorg/no-such-model"), run.stdout + run.stderr
    assert said in run.stdout and len(run.stdout.strip().splitlines()) == 1
    assert "Retrying" not in run.stderr, run.stderr


def test_a_gated_hub_model_says_to_accept_its_license_and_log_in(tmp_path):
    """FLUX.1 [dev] and SD3.5 are gated: the hub answers a request without an accepted license with the
    GatedRepo error code (huggingface_hub raises GatedRepoError, a RepositoryNotFoundError). sdplan said "not
    found on the hub". A local server answers as the hub does."""
    import http.server
    import os
    import subprocess
    import sys
    import threading

    class Gated(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            self.send_response(401)
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to model someorg/no-such-model is restricted.")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE"))}
        run = subprocess.run(
            [sys.executable, "-c", _LOAD],
            env={
                **base,
                "HF_HOME": str(tmp_path / "hf"),
                "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            },
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        server.shutdown()
    assert run.stdout.startswith("hub model someorg/no-such-model"), run.stdout + run.stderr
    assert "gated on the hub" in run.stdout and "hf auth login" in run.stdout
    assert "huggingface.co/someorg/no-such-model" in run.stdout and len(run.stdout.strip().splitlines()) == 1


# -- recommend: an empty --hardware is a mistake, not "probe this machine" ----------------------------------


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_hardware_is_an_error_not_a_plan_for_this_machine(text):
    r = cli("recommend", "--method", "lora", "--hardware", text)
    one_line_error(r, 2, "empty --hardware")
    assert r.stdout == ""


# -- a folder where a file is expected ------------------------------------------------------------------------


def test_a_run_folder_given_as_config_points_at_its_sdplan_yaml(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "sdplan.yaml").write_text("method: lora\n")
    r = cli("train", "--config", str(run), "--out", str(tmp_path / "out"), "--device", "cpu", "--dry-run")
    one_line_error(r, 2, "a folder, not a config file", str(run / "sdplan.yaml"))
    assert "not found" not in r.stderr and not (tmp_path / "out").exists()


def test_a_folder_given_as_machine_snapshot_says_so(tmp_path):
    r = cli("recommend", "--method", "lora", "--machine", str(tmp_path))
    one_line_error(r, 2, "is a folder, not a file", "sdplan doctor --save")


# -- a full disk whose shortfall is not known -----------------------------------------------------------------


def test_a_full_disk_with_an_unknown_shortfall_does_not_say_0_bytes_needed(tmp_path):
    import errno

    from sdplan.trainer import outputs

    err = outputs.write_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path, needed_bytes=0)
    assert isinstance(err, outputs.DiskFull)
    assert str(err).startswith(f"disk full: no room at {tmp_path} (") and "0 bytes needed" not in str(err)


# -- train --force: a file the user put inside sdplan's checkpoints/ ------------------------------------------


def test_force_keeps_a_users_file_inside_the_runs_checkpoints_folder(tmp_path):
    from sdplan import runfolder
    from sdplan.launcher import clear_run_outputs

    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    for name in ("rolling-step-000002", "step-000010", ".tmp-step-000012"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "train_state.json").write_text("{}")
    (ckpt / "best-I-kept").mkdir()
    (ckpt / "best-I-kept" / "weights.safetensors").write_bytes(b"mine")
    (ckpt / "notes.txt").write_text("mine\n")
    runfolder.record(out, ["checkpoints"])
    clear_run_outputs(out)
    assert sorted(p.name for p in ckpt.iterdir()) == ["best-I-kept", "notes.txt"]
    assert (ckpt / "best-I-kept" / "weights.safetensors").read_bytes() == b"mine"
    # with nothing of the user's there, the folder goes as before
    (ckpt / "notes.txt").unlink()
    (ckpt / "best-I-kept" / "weights.safetensors").unlink()
    (ckpt / "best-I-kept").rmdir()
    (ckpt / "step-000020").mkdir()
    clear_run_outputs(out)
    assert not ckpt.exists()


# -- bench: a typo is named before the GPU is looked for ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--method", "lorra"], "unknown method 'lorra'"),
        (["--model", "sd99"], "unknown model 'sd99'"),
        (["--resolution", "50"], "--resolution 50"),
    ],
)
def test_bench_names_a_bad_argument_before_looking_for_a_gpu(monkeypatch, args, said):
    from sdplan import bench

    def no_gpu(*a, **k):
        raise AssertionError("looked for a GPU before checking the arguments")

    monkeypatch.setattr(bench, "resolve_device", no_gpu)
    one_line_error(cli("bench", *args), 2, said)


# -- train --main-process-port out of range on one machine ----------------------------------------------------


@pytest.mark.parametrize("port", ["0", "99999"])
def test_a_port_out_of_range_is_refused_on_one_machine_too(tmp_path, port):
    r = cli("train", "--demo", "--dry-run", "--out", str(tmp_path / "d"), "--main-process-port", port)
    assert r.exit_code == 2 and "--main-process-port" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "d").exists()


# -- train --config with an empty file ----------------------------------------------------------------------


def _dry_run_with_config(cfg, tmp_path):
    """`sdplan train --config cfg --dry-run` on one generated image; (result, the --out folder)."""
    out = tmp_path / "out"
    data = make_images(tmp_path / "data", n=1)
    return cli(
        "train",
        "--config",
        str(cfg),
        "--dataset",
        str(data),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--dry-run",
    ), out


@pytest.mark.parametrize("text", ["", "# my settings, to be written\n"])
def test_an_empty_config_is_an_error_not_every_default(tmp_path, text):
    cfg = tmp_path / "sdplan.yaml"
    cfg.write_text(text)
    r, out = _dry_run_with_config(cfg, tmp_path)
    one_line_error(r, 2, str(cfg), "empty")
    assert not out.exists()


# -- train --dry-run --out under a file ---------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--demo"], ["--model", "MODEL", "--dataset", "DATA", "--device", "cpu"]])
def test_a_dry_run_into_a_folder_under_a_file_says_so(tmp_path, tiny_sd15, args):
    data = make_images(tmp_path / "data", n=1)
    (tmp_path / "notes.txt").write_text("mine\n")
    out = tmp_path / "notes.txt" / "run"
    args = [{"MODEL": str(tiny_sd15), "DATA": str(data)}.get(a, a) for a in args]
    r = cli("train", *args, "--dry-run", "--out", str(out))
    one_line_error(r, 3, str(tmp_path / "notes.txt"), "a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


# -- an empty path flag (an unset shell variable) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", ""], "--out"),
        (["recommend", "--method", "lora", "--hardware", "RTX 4090", "--dataset", ""], "--dataset"),
        (["recommend", "--method", "lora", "--machine", ""], "--machine"),
        (["train", "--demo", "--dry-run", "--out", ""], "--out"),
        (["train", "--config", ""], "--config"),
        (["doctor", "--save", ""], "--save"),  # said ". already exists"
        (["doctor", "--machine", ""], "--machine"),
    ],
)
def test_an_empty_path_flag_is_an_error_not_the_current_folder(tmp_path, monkeypatch, args, flag):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine\n")
    one_line_error(cli(*args), 2, f"{flag} is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written here or in ./output


# -- train --resume with a key=value that changes what the checkpoints were trained with ------------------------


@pytest.mark.parametrize(
    "override",
    [
        "lora.rank=32",
        "lora.alpha=4",
        "method=dreambooth",
        "lora.target_modules=[to_q]",
        "training.full_half_weights=true",  # the fp32 adapters and their state were cast to bf16 silently
    ],
)
def test_resume_refuses_a_setting_the_checkpoints_were_not_trained_with(tmp_path, tiny_sd15, override):
    import yaml

    from sdplan import runfolder

    data = make_images(tmp_path / "data", n=2)
    out = tmp_path / "run"
    step = out / "checkpoints" / "rolling-step-000002"
    step.mkdir(parents=True)
    (step / "train_state.json").write_text('{"global_step": 2, "method": "lora", "files": {}}')
    cfg = tiny_train_config(tiny_sd15, data, out, "lora.rank=16", "training.precision=bf16")
    (out / "sdplan.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    runfolder.record(out, ["sdplan.yaml", "checkpoints"])
    before = (out / "sdplan.yaml").read_text()
    r = cli("train", "--resume", "--out", str(out), "--device", "cpu", "--dry-run", override)
    one_line_error(r, 2, "--resume: " + override.split("=")[0], f"set {override.split('=')[0]}=")
    assert (out / "sdplan.yaml").read_text() == before
    ok = cli("train", "--resume", "--out", str(out), "--device", "cpu", "--dry-run", "training.max_steps=5")
    assert ok.exit_code == 0, ok.output


# -- recommend --compare with a flag it would ignore -----------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--hardware", "RTX 3090"], "--hardware"),
        (["--out", "PLAN"], "--out"),
        (["--machine", "M"], "--machine"),
        (["--gpus", "1"], "--gpus"),  # it planned "2x RTX 4090" on two GPUs all the same
    ],
)
def test_compare_refuses_a_flag_it_would_ignore(tmp_path, extra, flag):
    from conftest import MACHINES

    extra = [
        {"PLAN": str(tmp_path / "plan"), "M": str(MACHINES / "rtx3060_12gb.json")}.get(a, a) for a in extra
    ]
    r = cli("recommend", "--method", "lora", "--compare", "RTX 4090,2x RTX 4090", *extra)
    one_line_error(r, 2, "--compare does not combine with " + flag)
    assert not (tmp_path / "plan").exists()


# -- train --resume --force ------------------------------------------------------------------------------------


def test_resume_and_force_together_is_an_error(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "sdplan.yaml").write_text("method: lora\n")
    r = cli("train", "--resume", "--force", "--out", str(out), "--device", "cpu", "--dry-run")
    one_line_error(r, 2, "--resume continues the run and --force starts it over")
    assert sorted(p.name for p in out.iterdir()) == ["sdplan.yaml"]


# -- a key given twice in a config ----------------------------------------------------------------------------


def test_a_section_given_twice_in_a_config_is_an_error_not_a_silent_drop(tmp_path):
    """Plain YAML keeps the last of two `training:` sections and drops the first's settings without a word."""
    cfg = tmp_path / "sdplan.yaml"
    cfg.write_text("method: lora\ntraining:\n  batch_size: 2\nlora:\n  rank: 8\ntraining:\n  max_steps: 4\n")
    r, out = _dry_run_with_config(cfg, tmp_path)
    one_line_error(r, 2, str(cfg), "line 6", "'training' given twice")
    assert not out.exists()

    from sdplan import config

    with pytest.raises(config.ConfigError, match="'batch_size' given twice"):
        cfg.write_text("training:\n  batch_size: 2\n  batch_size: 4\n")
        config.load(cfg)
    cfg.write_text("base: &b {batch_size: 2}\ntraining:\n  <<: *b\n  batch_size: 4\n")  # a merge may override
    assert config.read_config_file(cfg)["training"]["batch_size"] == 4


# -- sdplan train: an error the trainer reports is the only line ---------------------------------------------


@pytest.mark.slow
def test_an_error_the_trainer_reports_is_the_only_line_from_sdplan_train(tiny_sd15, tmp_path):
    """sdplan's own checks pass (a diffusers folder) and the trainer fails to load the weights: its line is the
    only one, with its exit code. sdplan used to add "the trainer failed (exit code 2); its error is above"."""
    import json
    import shutil
    import subprocess
    import sys
    from types import SimpleNamespace

    from limits import scaled

    model = tmp_path / "model"
    shutil.copytree(tiny_sd15, model)
    # a UNet config diffusers cannot build (a truncated weights file is now refused before the launch)
    config = json.loads((model / "unet" / "config.json").read_text())
    config["down_block_types"] = ["NoSuchDownBlock2D"] * len(config["down_block_types"])
    (model / "unet" / "config.json").write_text(json.dumps(config))
    images = make_images(tmp_path / "data", n=2)
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from sdplan.cli import main; main()", "train", "--device", "cpu"]
    cmd += [
        "--model",
        str(model),
        "--dataset",
        str(images),
        "--out",
        str(out),
        "--yes",
        "training.max_steps=1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=scaled(300))
    result = SimpleNamespace(exit_code=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)
    one_line_error(result, 2, "could not load model", str(model))
    assert not (out / "error.txt").exists()  # the trainer's note to sdplan is not left behind


# -- sdplan train on a stack older than sdplan needs -----------------------------------------------------


@pytest.mark.parametrize("demo", [True, False])
def test_train_on_a_too_old_package_is_one_line_before_anything_is_written(demo, tmp_path, monkeypatch):
    """A diffusers below the requirement used to fail only at the trainer's first export, after loading."""
    from sdplan.machine import Finding
    from sdplan.probe import software

    old = Finding("error", "package_unmet", "diffusers 0.33.1 does not meet sdplan's requirement diffusers>=0.34",
                  "pip install -U 'diffusers>=0.34'")  # fmt: skip
    monkeypatch.setattr(software, "requirement_notes", lambda: (old, old))
    out = tmp_path / "demo"
    given = ["--demo"] if demo else ["--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "d")]
    r = cli("train", *given, "--out", str(out))
    one_line_error(r, 1, "diffusers 0.33.1", "pip install -U 'diffusers>=0.34'", "1 more in `sdplan doctor`")
    assert not out.exists()
