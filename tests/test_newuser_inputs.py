"""What a new user typed and sdplan misread: GPU names that read as a count ("7900 XTX"), key=value pins
that size the run (training.epochs, data.repeats, data.path), a key given twice, `doctor --save` a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import make_images, one_line_error
from typer.testing import CliRunner

from sdplan.cli import app
from sdplan.profiles import load_profiles
from sdplan.recommend import parse_hardware

MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"
runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    ("typed", "name", "count"),
    [
        ("7900 XTX", "RX 7900 XTX", 1),
        ("7900 XT", "RX 7900 XT", 1),
        ("2x 7900 XTX", "RX 7900 XTX", 2),
        ("7900 XTX x2", "RX 7900 XTX", 2),
        ("2x RTX 4090", "RTX 4090", 2),
        ("RTX 4090 x2", "RTX 4090", 2),
        ("4090x2", "RTX 4090", 2),  # read as 4090 GPUs of a "2"
        ("RTX 4090x2", "RTX 4090", 2),
        ("4090 x 2", "RTX 4090", 2),
        ("2x4090", "RTX 4090", 2),
    ],
)
def test_a_gpu_name_that_reads_as_a_count_is_the_gpu(typed, name, count):
    hw = parse_hardware(typed, load_profiles())
    assert (hw.gpus[0].name, hw.count) == (name, count)


def test_a_count_out_of_range_is_still_refused():
    result = cli("recommend", "--method", "lora", "--hardware", "999x RTX 4090")
    one_line_error(result, 2, "between 1 and 64")
    result = cli("recommend", "--method", "lora", "--hardware", "4090x999")
    one_line_error(result, 2, "between 1 and 64")


def test_an_unknown_name_with_a_count_after_it_is_an_unknown_gpu():
    result = cli("recommend", "--method", "lora", "--hardware", "9999x2")
    one_line_error(result, 2, "unknown GPU '9999'")


def plan(*args: str) -> dict:
    result = cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--json", *args)
    assert result.exit_code == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_sizing_pins_count_as_their_flags(tmp_path):
    assert plan("training.epochs=3")["steps"] == plan("--epochs", "3")["steps"]
    assert (
        plan("--images", "8", "data.repeats=3")["steps"] == plan("--images", "8", "--repeats", "3")["steps"]
    )
    data = make_images(tmp_path / "data", 6)
    assert plan(f"data.path={data}")["steps"] == plan("--dataset", str(data))["steps"]
    assert plan("training.epochs=3")["steps"] != plan()["steps"]  # the pin was dropped: 10 epochs planned


def test_a_sizing_pin_that_contradicts_its_flag_is_refused():
    result = cli(
        "recommend", "--method", "lora", "--hardware", "RTX 4090", "--epochs", "3", "training.epochs=5"
    )
    one_line_error(result, 2, "--epochs 3", "training.epochs=5", "disagree")


def test_the_written_config_trains_the_pinned_epochs(tmp_path):
    data = make_images(tmp_path / "data", 6)
    for given in ((), ("--dataset", str(data))):
        out = tmp_path / f"plan{len(given)}"
        result = cli(
            "recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(out), "training.epochs=3",
            *given,
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        training = yaml.safe_load((out / "sdplan.yaml").read_text())["training"]
        # with the dataset counted, max_steps is 3 epochs' steps (it was the default 10 epochs' beside epochs:
        # 3); without it there is no step count to write: the run trains the 3 epochs (test_recommend_out)
        steps = plan("--epochs", "3", *given)["steps"]["total_steps"] if given else None
        assert (training["epochs"], training["max_steps"]) == (3, steps)


@pytest.mark.parametrize("command", ["recommend", "train"])
def test_a_key_given_twice_with_two_values_is_refused(command, tmp_path):
    args = ["--method", "lora", "--dataset", str(tmp_path), "--dry-run"] if command == "train" else []
    if command == "recommend":
        args = ["--method", "lora", "--hardware", "RTX 4090"]
    result = cli(command, *args, "training.batch_size=4", "training.batch_size=8")
    one_line_error(result, 2, "training.batch_size given twice")


def test_a_key_given_twice_with_one_value_is_fine():
    assert plan("training.batch_size=2", "training.batch_size=2")["plan"]["batch_size"] == 2


def test_doctor_save_to_a_folder_says_so_with_or_without_force(tmp_path):
    for extra in ([], ["--force"]):
        result = cli("doctor", "--machine", str(MACHINES / "t4.json"), "--save", str(tmp_path), *extra)
        one_line_error(result, 2, "is a folder", "machine.json")


def test_profiles_export_to_a_folder_says_so_with_or_without_force(tmp_path):
    for extra in ([], ["--force"]):
        result = cli("profiles", "export", str(tmp_path), *extra)
        one_line_error(result, 2, "is a folder")


@pytest.mark.parametrize(
    ("typed", "method", "model"),
    [
        (["--method", "LoRA", "--model", "SDXL"], "lora", "sdxl"),
        (["--method", "ti"], "textual-inversion", "sd15"),  # registry aliases
        (["--method", "fine-tune", "--model", "SD3.5"], "finetune", "sd35-medium"),
    ],
)
def test_recommend_takes_method_and_model_names_as_users_type_them(typed, method, model):
    result = cli("recommend", "--hardware", "RTX 4090", "--json", *typed)
    assert result.exit_code == 0, result.stderr
    request = yaml.safe_load(result.stdout)["request"]
    assert (request["method"], request["model"]) == (method, model)


def test_train_takes_the_method_in_any_case(tmp_path, tiny_sd15):
    data = make_images(tmp_path / "data", 2)
    result = cli(
        "train",
        "--method",
        "LoRA",
        "--model",
        str(tiny_sd15),
        "--dataset",
        str(data),
        "--device",
        "cpu",
        "--dry-run",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("lora on sd15")


def test_recommend_says_which_dataset_files_it_leaves_out(tmp_path):
    make_images(tmp_path / "10_sks dog", 2)
    make_images(tmp_path / "loose", 1)
    (tmp_path / "loose" / "img000.png").rename(tmp_path / "stray.png")
    reasons = plan("--dataset", str(tmp_path))["reasons"]
    assert any("not used" in r and "stray.png" in r and "loose" in r for r in reasons), reasons


def test_lora_target_modules_that_match_nothing_are_one_error_naming_real_ones():
    from sdplan.trainer.runtime import add_lora_adapters
    from sdplan.trainer.tiny import tiny_unet

    from sdplan.config import LoraConfig
    from sdplan.errors import UsageError

    lcfg = LoraConfig(rank=2, alpha=2.0, target_modules=["nope"])
    # peft's NoMatchingPeftModuleError came out of the trainer as a traceback
    with pytest.raises(UsageError, match=r"lora\.target_modules=\['nope'\]") as caught:
        unet = tiny_unet(
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
        )  # as tiny_sd15_components wires it
        add_lora_adapters(unet, [], lcfg, train_text_encoder=False)
    assert "to_out.0" in caught.value.fix  # a name that would match, as the default writes it


@pytest.mark.parametrize("content", [b"", b'{"a":', b"[1, 2]", b'{"foo": 1}'])
def test_a_broken_machine_snapshot_says_how_to_make_a_good_one(tmp_path, content):
    path = tmp_path / "machine.json"
    path.write_bytes(content)
    result = cli("recommend", "--method", "lora", "--machine", str(path))
    one_line_error(result, 2, "machine.json", "sdplan doctor --save FILE")


def test_a_machine_snapshot_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "machine.json"
    path.write_bytes(b"\xef\xbb\xbf" + (MACHINES / "t4.json").read_bytes())
    result = cli("recommend", "--method", "lora", "--machine", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    assert yaml.safe_load(result.stdout)["hardware"]["gpus"][0]["name"].endswith("T4")


def test_a_path_with_a_tilde_the_shell_left_alone_means_home(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)  # `--out=~/plan` reaches sdplan with the "~": it made ./~/plan here
    result = cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", "~/plan")
    assert result.exit_code == 0, result.stderr
    result = cli("doctor", "--machine", str(MACHINES / "t4.json"), "--save", "~/machine.json")
    assert result.exit_code == 0, result.stderr
    assert (home / "plan" / "sdplan.yaml").is_file() and (home / "machine.json").is_file()
    assert list(cwd.iterdir()) == []
