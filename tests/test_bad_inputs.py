"""Bad inputs the launcher must catch before any training (issue 13, items 6 and 7): each is one clear line,
a non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import fake_diffusers_folder, make_images, one_line_error
from typer.testing import CliRunner

from sdplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
MACHINES = ROOT / "tests" / "fixtures" / "machines"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def fake_model(tmp_path) -> Path:
    return fake_diffusers_folder(tmp_path / "model")


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A folder path nobody can create: under a read-only folder (as root, where modes do not bind: /sys)."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        yield ro / "out"
        ro.chmod(0o755)
        return
    path = Path("/sys/sdplan-test-out")
    try:
        path.mkdir()
    except OSError:
        yield path
        return
    path.rmdir()
    pytest.skip("no read-only location on this machine")


def train(*args: str):
    return cli("train", *args)


# -- item 6 --------------------------------------------------------------------------------------------------


def test_read_only_out_for_train(tmp_path, fake_model, unwritable):
    ds = make_images(tmp_path / "ds", n=2)
    r = train("--model", str(fake_model), "--dataset", str(ds), "--out", str(unwritable), "--device", "cpu",
              "--yes")  # fmt: skip
    one_line_error(r, 2, "cannot write to", str(unwritable))


def test_read_only_out_for_recommend(unwritable):
    r = cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(unwritable))
    one_line_error(r, 2, "cannot write to", str(unwritable))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            "recommend --method lora --hardware RTX_4090 --out {lp}",
            "--out {lp} is a symbolic link that loops",
        ),
        (
            "recommend --method lora --hardware RTX_4090 --out {lp}/sub",
            "--out {lp}/sub is under a symbolic link",
        ),
        (
            "recommend --method lora --hardware RTX_4090 --dataset {lp}",
            "dataset folder {lp} is a symbolic link",
        ),
        ("train --demo --out {lp}", "--out {lp} is a symbolic link that loops"),
        ("train --demo --dry-run --out {lp}", "--out {lp} is a symbolic link that loops"),
        (
            "train --model {model} --dataset {ds} --out {lp} --device cpu --dry-run",
            "--out {lp} is a symbolic",
        ),
        ("train --model {model} --dataset {lp} --out {tmp}/o --device cpu --dry-run", "--dataset {lp} is a"),
        ("train --config {cfg} --device cpu --dry-run", "output.dir {lp} is a symbolic link that loops"),
        ("train --resume --out {lp}", "--out {lp} is a symbolic link that loops"),
        ("train --config {cfg} --device cpu --dry-run --out {tmp}/o output.dir={lp}", "output.dir {lp} is a"),
        # alone, output.dir is --out, and is named as it was given
        (
            "train --model {model} --dataset {ds} --device cpu --dry-run output.dir={lp}",
            "output.dir {lp} is a",
        ),
    ],
)
def test_a_symbolic_link_that_loops_is_one_line(tmp_path, fake_model, args, needle):
    """`ln -s lp lp` given as --out, --dataset or output.dir was a traceback (Path.resolve: RuntimeError Symlink
    loop) in recommend, train and train --demo."""
    lp = tmp_path / "lp"
    lp.symlink_to("lp")
    ds = make_images(tmp_path / "ds", n=2)
    cfg = tmp_path / "sdplan.yaml"
    cfg.write_text(
        f"method: lora\nmodel: {{path: {fake_model}}}\ndata: {{path: {ds}}}\noutput: {{dir: {lp}}}\n"
    )
    fill = {"lp": lp, "ds": ds, "model": fake_model, "cfg": cfg, "tmp": tmp_path}
    argv = [a.format(**fill).replace("RTX_4090", "RTX 4090") for a in args.split()]
    one_line_error(cli(*argv), 2, needle.format(**fill))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "lp", "model", "sdplan.yaml"]  # nothing made


def _zip(files: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name, data, needle",
    [
        ("model.bin", os.urandom(4096), "not a PyTorch checkpoint"),
        # a zip that torch.load cannot read (torch's message was "Expected hasRecord("version") to be true")
        ("images.ckpt", _zip({"photos/img0.png": b"png"}), "a zip archive but not a PyTorch checkpoint"),
        (
            "half.ckpt",
            _zip({"archive/data.pkl": b"\x80\x02}q\x00."}),
            "a zip archive but not a PyTorch checkpoint",
        ),
        ("model.ckpt", b"hello, not a checkpoint", "not a PyTorch checkpoint"),
        ("model.safetensors", os.urandom(4096), "not a safetensors file"),
        ("lora.safetensors", None, "a LoRA, which is applied to a base model"),
    ],
)
def test_bad_model_file_is_refused_before_launch(tmp_path, name, data, needle):
    path = tmp_path / name
    if data is None:  # a real safetensors file, but a LoRA's keys
        header = json.dumps({"lora_unet_down_blocks_0.lora_down.weight": {
            "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()  # fmt: skip
        data = len(header).to_bytes(8, "little") + header + b"\0\0\0\0"
    path.write_bytes(data)
    ds = make_images(tmp_path / "ds", n=2)
    out = tmp_path / "o"
    one_line_error(train("--model", str(path), "--dataset", str(ds), "--out", str(out), "--device", "cpu"), 2,
                   needle, name)  # fmt: skip
    assert not out.exists()


# -- item 7 --------------------------------------------------------------------------------------------------


def test_malformed_metadata_json_names_file_and_position(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds", n=2, caption=None)
    (ds / "img000.json").write_text('{"path": "img000.png",\n "tags": ["a", "b"\n}')
    r = train(
        "--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu"
    )
    line = one_line_error(r, 2, "img000.json", "not valid JSON", "line 3, column 1")
    assert "supported image type" not in line


def test_out_inside_the_dataset_is_refused(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds", n=2)
    before = sorted(p.name for p in ds.iterdir())
    r = train("--model", str(fake_model), "--dataset", str(ds), "--out", str(ds / "run"), "--device", "cpu")
    one_line_error(r, 2, "inside the dataset")
    assert sorted(p.name for p in ds.iterdir()) == before


@pytest.mark.parametrize("value", ["100000", "4104", "100"])
def test_resolution_out_of_range_is_a_config_error(tmp_path, fake_model, value):
    ds = make_images(tmp_path / "ds", n=2)
    r = train("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu",
              "--resolution", value)  # fmt: skip
    one_line_error(r, 2, "data.resolution", "4096")
    one_line_error(cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--resolution", value), 2,
                   "--resolution", "4096")  # fmt: skip


def test_yaml_error_gives_line_and_column(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: lora\ntraining:\n  batch_size: [1, 2\n  epochs: 3\n")
    one_line_error(train("--config", str(cfg)), 2, str(cfg), "line ", "column ")


def test_recommend_exits_non_zero_when_nothing_fits_and_still_prints_json():
    r = cli("recommend", "--method", "dreambooth", "--machine", str(MACHINES / "cpu_only.json"), "--json")
    d = json.loads(r.stdout)
    assert d["feasible"] is False
    assert r.exit_code == 1


def test_cpu_with_gpus_is_an_error(tmp_path, fake_model):
    ds = make_images(tmp_path / "ds", n=2)
    r = train("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu",
              "--gpus", "2", "--dry-run")  # fmt: skip
    one_line_error(r, 2, "--gpus")


def test_train_and_recommend_share_default_epochs(tmp_path, fake_model):
    from sdplan import config, recommend

    assert config.TrainConfig().training.epochs == recommend.DEFAULT_EPOCHS == config.DEFAULT_EPOCHS == 10
    ds = make_images(tmp_path / "ds", n=2)
    r = train("--model", str(fake_model), "--dataset", str(ds), "--out", str(tmp_path / "o"), "--device", "cpu",
              "--dry-run")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "x 10 epochs" in r.stdout


@pytest.mark.parametrize("name", ["mymodel.pth", "MyModel.SAFETENSORS", "weights.bin"])
def test_recommend_reads_a_missing_model_file_of_any_suffix_train_takes_as_a_path(tmp_path, name):
    """`sdplan train` takes .safetensors, .ckpt, .pt, .pth and .bin files (any case); `recommend` read only the
    first three as a path and called a missing `mymodel.pth` an unknown family name."""
    line = one_line_error(
        cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--model", name), 2, "no such file"
    )
    assert name in line


@pytest.mark.parametrize(
    "args, what",
    [
        (
            ["recommend", "--method", "lora", "--hardware", "T4", "--dataset", "~nosuchuser-sdplan/ds"],
            "dataset folder",
        ),
        (
            ["recommend", "--method", "lora", "--hardware", "T4", "--model", "~nosuchuser-sdplan/m"],
            "model.path",
        ),
        (["train", "--config", "~nosuchuser-sdplan/c.yaml", "--dry-run"], "--config"),
        (["train", "--demo", "--dry-run", "--out", "~nosuchuser-sdplan/run"], "--out"),
    ],
)
def test_a_home_folder_of_an_unknown_user_is_one_line(args, what, tmp_path, monkeypatch):
    """`~typo/run` raised RuntimeError("Could not determine home directory") from Path.expanduser; left as the
    shell leaves it, it made a folder named `~typo` in the current one."""
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, args)
    one_line_error(r, 2, what, "no user 'nosuchuser-sdplan'")
    assert not any(tmp_path.iterdir())


def test_expand_user_says_which_home_folder_it_cannot_find(monkeypatch):
    from sdplan.config import expand_user
    from sdplan.errors import UsageError

    monkeypatch.setenv("HOME", "/home/someone")
    assert expand_user("~/runs", "--out") == "/home/someone/runs"
    assert expand_user("a/~b", "--out") == "a/~b" and expand_user("/abs/x", "--out") == "/abs/x"
    with pytest.raises(UsageError, match=r"no user 'nosuchuser-sdplan'"):
        expand_user("~nosuchuser-sdplan/x", "--out")
    if os.sep == "/":  # a backslash is part of a POSIX name: the user asked for is \ds, shown as typed
        with pytest.raises(UsageError, match=r"no user '\\ds'"):
            expand_user("~\\ds", "--dataset")
