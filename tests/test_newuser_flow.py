"""A new user following the README end to end (QA pass, 2026-11-26): `recommend --out DIR` then the command
it prints, a model given by a hub id the profiles list, a .ckpt that is no checkpoint, `sdplan profiles` on the
transformer families, what the plan says about a swapped base, multi-GPU steps, uncaptioned images and the
repeats, whose mistake a bad key=value is, a second machine without --num-machines, recommend --out inside the
dataset or over a trained run, --epochs over a planned max_steps, a broken local store, `python -m sdplan`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from conftest import fake_diffusers_folder, make_images, one_line_error
from typer.testing import CliRunner

from sdplan.cli import app

MACHINES = Path(__file__).resolve().parent / "fixtures" / "machines"

runner = CliRunner()


def _recommend_lora(model, photos) -> list[str]:
    """`sdplan recommend` of a LoRA of ``model`` on ``photos`` for an RTX 4090 (as a list, to add to)."""
    return [
        "recommend",
        "--method",
        "lora",
        "--model",
        str(model),
        "--dataset",
        str(photos),
        "--hardware",
        "RTX 4090",
    ]


def cli(*args: str):
    return runner.invoke(app, list(args))


def test_the_printed_train_command_trains_into_the_recommend_out_folder(tmp_path, monkeypatch):
    """`recommend --out runs/me` wrote output.dir ./output: the `sdplan train --config runs/me/sdplan.yaml` it
    prints trained into ./output, and README's `train --resume --out runs/me` then found no checkpoint."""
    model = fake_diffusers_folder(tmp_path / "model")
    make_images(tmp_path / "photos", 2)
    monkeypatch.chdir(tmp_path)
    result = cli(
        "recommend", "--method", "lora", "--model", str(model), "--dataset", "photos",
        "--hardware", "RTX 4090", "--out", "runs/me",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "run it with: sdplan train --config runs/me/sdplan.yaml" in result.stderr
    written = yaml.safe_load((tmp_path / "runs" / "me" / "sdplan.yaml").read_text())
    # absolute, as `sdplan train` writes them: the config trains the same from any folder (test_recommend_out)
    assert (written["output"]["dir"], written["data"]["path"]) == (
        str(tmp_path / "runs" / "me"),
        str(tmp_path / "photos"),
    )
    result = cli("train", "--config", "runs/me/sdplan.yaml", "--device", "cpu", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert f"output: {tmp_path / 'runs' / 'me'}" in result.stdout.splitlines()
    assert not (tmp_path / "output").exists()


def test_a_hub_id_the_profiles_list_is_planned_for_its_family_without_the_cache(tmp_path, monkeypatch):
    """`recommend --model stabilityai/stable-diffusion-xl-base-1.0` (the id `recommend --out` itself writes as
    model.path) was 'cannot tell its family here' unless the local cache held the model."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for hub_id, family in (
        ("stabilityai/stable-diffusion-xl-base-1.0", "sdxl"),
        ("runwayml/stable-diffusion-v1-5", "sd15"),
    ):
        result = cli("recommend", "--method", "lora", "--model", hub_id, "--hardware", "RTX 4090", "--json")
        assert result.exit_code == 0, result.stderr
        d = yaml.safe_load(result.stdout)
        assert d["request"]["model"] == family and d["config"]["model"]["path"] == hub_id


def test_recommend_says_a_ckpt_that_is_no_checkpoint_is_none_as_train_does(tmp_path):
    """A text file named my_model.ckpt: recommend called it 'an old pickle checkpoint' whose family it cannot
    tell and asked for the family and model.path=... (which train then refused as no checkpoint at all)."""
    bogus = tmp_path / "my_model.ckpt"
    bogus.write_text("not a checkpoint\n")
    result = cli("recommend", "--method", "lora", "--model", str(bogus), "--hardware", "RTX 4090")
    one_line_error(result, 2, "not a PyTorch checkpoint (neither a zip archive nor a pickle)")


def test_profiles_names_the_flux_variants_and_counts_the_transformer(monkeypatch):
    """`sdplan profiles` printed 'FLUX.1 : 1024 px, 4.97B parameters (UNet 0M)': rich took '[dev]' for a style
    tag, and the transformer families' totals left out the transformer (SD3.5 Medium and Large both 5.66B).
    Its points table showed the QLoRA (nf4 base) point with the same settings as the bf16-base one."""
    monkeypatch.setenv("COLUMNS", "400")
    result = cli("profiles")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "FLUX.1 [dev]: 1024 px, 16.87B parameters (transformer 11901M)" in out
    assert "FLUX.1 [schnell]: 1024 px" in out
    assert "Stable Diffusion 3.5 Large: 1024 px, 13.72B parameters (transformer 8057M)" in out
    assert "Stable Diffusion XL 1.0: 1024 px, 3.47B parameters (UNet 2567M)" in out
    assert "rank 4, nf4 base" in out


def test_a_swapped_base_is_not_said_to_sit_whole_on_the_gpu():
    """FLUX.1 LoRA on a 12 GB card (35 blocks swapped) said 'the frozen transformer takes 22.2 GiB on the GPU;
    the 22.2 GiB bf16 base fits' beside a predicted peak of 8.3 GiB."""
    result = cli(
        "recommend", "--method", "lora", "--model", "flux-dev", "--hardware", "RTX 3060 12GB", "--json"
    )
    assert result.exit_code == 0, result.stderr
    d = yaml.safe_load(result.stdout)
    assert d["plan"]["blocks_to_swap"] > 0
    (base,) = [r for r in d["reasons"] if r.startswith("base precision")]
    whole = {"bf16": "22.2", "fp8": "11.1", "nf4": "6.3"}[d["plan"]["base_precision"]]
    assert f"{whole} GiB on the GPU" not in base
    assert re.search(
        rf"takes \d+\.\d GiB on the GPU \({whole} GiB in all; the swapped blocks wait in host RAM\)", base
    )


def test_train_says_what_uncaptioned_images_train_with(tmp_path):
    """A LoRA from photos without .txt captions trained every one as 'a photo of sks person' (the DreamBooth
    instance prompt), and the plan said only '0 captioned'."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 3, caption=None)
    args = ["train", "--model", str(model), "--dataset", str(photos), "--device", "cpu", "--dry-run"]
    result = cli(*args, "--out", str(tmp_path / "a"))
    assert result.exit_code == 0, result.stderr
    (data,) = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert "3 images without a .txt caption train with the caption 'a photo of sks person'" in data
    assert "data.default_caption" in data
    result = cli(*args, "--out", str(tmp_path / "b"), "data.default_caption=a photo of my dog")
    assert result.exit_code == 0, result.stderr
    assert "without a .txt caption" not in result.stdout


def test_a_bad_key_value_setting_is_not_blamed_on_the_config_file(tmp_path):
    """`train --config run.yaml training.learning_rate=abc` said 'run.yaml: training.learning_rate: must be a
    number, got 'abc'': the user looks in a file that holds no 'abc'."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 2)
    config = tmp_path / "run.yaml"
    config.write_text(f"method: lora\nmodel: {{path: {model}}}\ndata: {{path: {photos}}}\n")
    base = ["train", "--config", str(config), "--device", "cpu", "--dry-run", "--out", str(tmp_path / "out")]
    line = one_line_error(
        cli(*base, "training.learning_rate=abc"), 2, "key=value settings: training.learning_rate"
    )
    assert "run.yaml" not in line
    config.write_text(
        config.read_text() + "training: {batchsize: 2}\n"
    )  # the file's own error still names it
    one_line_error(cli(*base, "training.learning_rate=abc"), 2, "run.yaml: training.batchsize: unknown key")


def test_a_multi_gpu_step_is_never_said_to_be_shorter_than_one_gpus():
    """SDXL LoRA on 8x H100: '8 GPUs: each step takes 0.38x as long as on one GPU with the same settings'. The
    plan's step is the H100's measured speed scaled to these settings plus the all-reduce; the one-GPU step it
    was divided by was the bare roofline."""
    import re

    machine = str(MACHINES / "8x_h100_sxm.json")
    for method in ("lora", "finetune"):
        result = cli(
            "recommend", "--method", method, "--model", "sdxl", "--machine", machine, "--images", "5000", "--json"
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        d = yaml.safe_load(result.stdout)
        n = d["plan"]["num_gpus"]
        assert n > 1  # 7 or 8: each GPU added must clear the time uncertainty
        (said,) = [r for r in d["reasons"] if r.startswith(f"{n} GPUs: each step takes")]
        ratio = float(re.match(rf"{n} GPUs: each step takes ([0-9.]+)x", said).group(1))
        assert ratio >= 1.0, said


def test_the_data_line_gives_the_repeats(tmp_path):
    """The demo's plan said 'flat: 8 images x repeats = 16 samples per epoch': the number was left out."""
    from sdplan.trainer.dataset_scan import scan

    photos = make_images(tmp_path / "photos", 4)
    assert scan(photos, repeats=2).summary().startswith("flat: 4 images x 2 repeats = 8 samples per epoch")
    make_images(tmp_path / "kohya" / "10_dog", 1)
    make_images(tmp_path / "kohya" / "5_cat", 2)
    assert (
        scan(tmp_path / "kohya")
        .summary()
        .startswith("kohya: 3 images x their folders' repeats = 20 samples per epoch")
    )


def test_machine_rank_without_num_machines_is_refused(tmp_path):
    """Machine 1 of a two-machine run started with `--machine-rank 1 --main-process-ip 10.0.0.1` and no
    --num-machines trained a run of its own instead of joining machine 0's."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 2)
    base = ["train", "--model", str(model), "--dataset", str(photos), "--device", "cpu", "--dry-run"]
    for extra, flag in (
        (["--machine-rank", "1"], "--machine-rank"),
        (["--main-process-ip", "10.0.0.1"], "--main-process-ip"),
    ):
        result = cli(*base, "--out", str(tmp_path / "run"), *extra)
        one_line_error(result, 2, f"{flag} is for a run on several machines", "--num-machines")
    assert not (tmp_path / "run").exists()


def test_recommend_out_inside_the_dataset_is_refused_as_train_refuses_it(tmp_path):
    """`recommend --dataset photos --out photos` wrote sdplan.yaml and accelerate.yaml among the photos, and
    the config it printed the command for trains into the dataset, which `sdplan train` refuses."""
    photos = make_images(tmp_path / "photos", 2)
    before = sorted(p.name for p in photos.iterdir())
    for out in (photos, photos / "plan"):
        result = cli(
            "recommend",
            "--method",
            "lora",
            "--hardware",
            "RTX 4090",
            "--dataset",
            str(photos),
            "--out",
            str(out),
        )
        one_line_error(result, 2, "is inside the dataset folder")
    assert sorted(p.name for p in photos.iterdir()) == before


def test_recommend_force_never_replaces_the_config_of_a_trained_run(tmp_path):
    """`recommend --out RUN --force` on a folder sdplan trained in replaced the run's sdplan.yaml: `train
    --resume --out RUN` then read the new plan (another model, ./dataset) for the old checkpoints."""
    from sdplan import runfolder

    run = tmp_path / "run"
    (run / "checkpoints" / "rolling-step-000016").mkdir(parents=True)
    (run / "sdplan.yaml").write_text("method: lora\nlora: {rank: 4}\n")
    runfolder.record(run, ["sdplan.yaml", "checkpoints"])
    before = (run / "sdplan.yaml").read_text()
    result = cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(run), "--force")
    one_line_error(result, 3, "holds an sdplan training run (checkpoints)", "--resume")
    assert (run / "sdplan.yaml").read_text() == before
    plan = tmp_path / "plan"  # a folder holding only an earlier plan is still replaced with --force
    assert cli("recommend", "--method", "lora", "--hardware", "RTX 4090", "--out", str(plan)).exit_code == 0
    assert (
        cli(
            "recommend", "--method", "lora", "--hardware", "RTX 3090", "--out", str(plan), "--force"
        ).exit_code
        == 0
    )
    assert "RTX 3090" in (plan / "sdplan.yaml").read_text()


def test_recommend_help_says_model_takes_a_path_or_hub_id():
    """README: `sdplan recommend --model ./models/my_sdxl.safetensors`; --help said only 'Model family: sd15, ...'."""
    result = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if "--model" in ln]
    assert "diffusers folder" in line and ".safetensors" in line and "hub id" in line


def test_a_broken_file_in_the_local_store_says_where_it_lives(tmp_path, monkeypatch):
    """A hand-edited local gpus.yaml (as the 'unknown GPU' error suggests) that does not parse stopped every
    command with 'PATH: line 2: not valid YAML' and no word that it is the user's own store, or what to do."""
    store = tmp_path / "store"
    (store / "methods").mkdir(parents=True)
    (store / "gpus.yaml").write_text("gpus:\n  - name: [\n")
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(store))
    result = cli("recommend", "--method", "lora", "--hardware", "RTX 4090")
    one_line_error(result, 2, "gpus.yaml", "not valid YAML", f"local profile store {store}", "move it out")


def test_epochs_given_to_train_count_over_a_planned_max_steps(tmp_path):
    """`recommend --out` writes its planned step count as training.max_steps; `sdplan train --config
    DIR/sdplan.yaml --epochs 3` (or training.epochs=3) then trained the planned 10 epochs' steps: the epochs
    asked for did nothing."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 4)
    plan = tmp_path / "plan"
    args = _recommend_lora(model, photos)
    assert cli(*args, "--out", str(plan), "training.batch_size=2").exit_code == 0
    train = ["train", "--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run"]
    for extra in (["--epochs", "3"], ["training.epochs=3"]):
        result = cli(*train, *extra)
        assert result.exit_code == 0, result.stderr
        assert "= 2 steps per epoch x 3 epochs = 6 optimizer steps; images seen 12" in result.stdout, (
            result.stdout
        )
    result = cli(*train, "--epochs", "3", "training.max_steps=5")  # both given: the step count still caps
    assert "training.max_steps 5 / 1 process = 5 optimizer steps" in result.stdout, result.stdout


def test_a_planned_step_count_for_another_dataset_is_pointed_out(tmp_path):
    """Planned on a dataset of 2 images (max_steps 20), then trained on 8 images: the run trained 20 steps, a
    quarter of its 10 epochs, and the plan's lines gave no hint. Then it said so; now the plan's step count, made
    for another dataset, is dropped with a note, and the run trains its 10 epochs. (Planned with --images 2, it
    writes no max_steps: a plan that never saw the dataset trains its epochs, test_recommend_out.)"""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 8)
    plan = tmp_path / "plan"
    args = _recommend_lora(model, make_images(tmp_path / "two", 2))
    assert cli(*args, "--out", str(plan), "training.batch_size=1").exit_code == 0
    result = cli(
        "train", "--config", str(plan / "sdplan.yaml"), "--device", "cpu", "--dry-run", f"data.path={photos}"
    )
    assert result.exit_code == 0, result.stderr
    (steps,) = [line for line in result.stdout.splitlines() if line.startswith("steps: ")]
    assert "10 epochs = 80 optimizer steps" in steps
    assert "images per epoch 8 (planned 2)" in result.stdout
    assert "its planned training.max_steps 20 is dropped (the run trains its epochs)" in result.stdout
    result = cli(
        "train",
        "--config",
        str(plan / "sdplan.yaml"),
        "--device",
        "cpu",
        "--dry-run",
        "--max-steps",
        "3",
        f"data.path={photos}",
    )
    assert "optimizer steps = 3 images" in result.stdout and "would be" not in result.stdout  # asked for here


def test_python_dash_m_sdplan_runs_the_cli(tmp_path):
    """`python -m sdplan --version`: 'No module named sdplan.__main__'."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "sdplan", "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sdplan ")


def test_a_plan_written_beside_the_users_files_says_so_when_trained(tmp_path):
    """`recommend --out proj` into a folder of the user's own files, then the printed `sdplan train --config
    proj/sdplan.yaml`: 'holds an sdplan run (continue it with --resume, ...)', of a run that never trained."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 2)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "notes.txt").write_text("mine")
    args = _recommend_lora(model, photos)
    assert cli(*args, "--out", str(proj)).exit_code == 0
    result = cli("train", "--config", str(proj / "sdplan.yaml"), "--device", "cpu", "--dry-run")
    line = one_line_error(result, 3, "holds your files (notes.txt) beside the plan", "--out DIR")
    assert "--resume" not in line
    result = cli(
        "train",
        "--config",
        str(proj / "sdplan.yaml"),
        "--device",
        "cpu",
        "--dry-run",
        "--out",
        str(tmp_path / "run"),
    )
    assert result.exit_code == 0, result.stderr


def test_resume_of_a_folder_that_does_not_exist_says_so(tmp_path):
    """`train --resume --out nope` said 'nope is not an sdplan run (no sdplan.yaml)' for a folder not there."""
    line = one_line_error(cli("train", "--resume", "--out", str(tmp_path / "nope")), 2, "does not exist")
    assert "not an sdplan run" not in line


def test_one_file_is_one_file(tmp_path):
    """A kohya folder of one image without repeats in its name: '(1 files ignored ...)'."""
    from sdplan.trainer.dataset_scan import scan

    make_images(tmp_path / "ds" / "5_ok", n=2)
    make_images(tmp_path / "one", n=1)
    (tmp_path / "ds" / "dog").mkdir()
    next((tmp_path / "one").glob("*.png")).rename(tmp_path / "ds" / "dog" / "a.png")
    skipped = " ".join(why for _, why in scan(tmp_path / "ds").skipped)
    assert "(1 file ignored;" in skipped


def test_doctor_states_the_machines_ram_in_gib_as_its_host_table_does():
    """'25.8 GB RAM: enough to train, tight ...' beside '24.0 GiB total' in the host table (one machine)."""
    from sdplan.machine import Snapshot
    from sdplan.probe import snapshot

    snap = Snapshot.load(Path(__file__).parent / "fixtures" / "machines" / "t4.json")
    ram = next(f for f in snapshot.findings(snap) if f.code == "ram_low")
    assert ram.message.startswith(f"{snap.host.ram_total_bytes / 2**30:.1f} GiB RAM:")


def test_a_list_given_to_hardware_points_at_compare():
    """--hardware "RTX 4090, RTX 3090" was an unknown GPU named 'RTX 4090, RTX 3090'."""
    line = one_line_error(
        cli("recommend", "--method", "lora", "--hardware", "RTX 4090, RTX 3090"), 2, "one kind of GPU"
    )
    assert '--compare "RTX 4090, RTX 3090"' in line
    assert cli("recommend", "--method", "lora", "--compare", "RTX 4090, RTX 3090").exit_code == 0


def test_a_kohya_folder_with_zero_repeats_is_not_called_broken_files(tmp_path):
    """A dataset whose only folder is 0_dog: the fix said 'replace or remove the broken files'."""
    make_images(tmp_path / "ds" / "0_dog", n=2)
    line = one_line_error(cli("recommend", "--method", "lora", "--dataset", str(tmp_path / "ds")), 2, "0_dog")
    assert "broken" not in line and "N >= 1" in line


def test_train_says_which_images_are_scaled_up_far(tmp_path):
    """Photos of 200 px trained at 512 px are scaled up 2.6x and train blurry; the plan said nothing of it. The
    data line now names how many and the smallest. With buckets the area counts: a 200x800 photo is not."""
    model = fake_diffusers_folder(tmp_path / "model")
    photos = make_images(tmp_path / "photos", 2, size=600)
    make_images(tmp_path / "small", 1, size=200)
    (tmp_path / "small" / "img000.png").rename(photos / "tiny.png")
    args = ["train", "--model", str(model), "--dataset", str(photos), "--device", "cpu", "--dry-run"]
    result = cli(*args, "--out", str(tmp_path / "a"), "data.resolution=512")
    assert result.exit_code == 0, result.stderr
    (data,) = [line for line in result.stdout.splitlines() if line.startswith("data: ")]
    assert (
        "1 image is scaled up more than 2x to the 512 px training resolution (the smallest: tiny.png, 200x200)"
        in data
    )
    result = cli(*args, "--out", str(tmp_path / "b"), "data.resolution=384")
    assert result.exit_code == 0, result.stderr
    assert "scaled up" not in result.stdout


def test_small_images_note_counts_the_area_with_buckets(tmp_path):
    from sdplan.trainer.dataset_scan import Item, Scan, small_images_note

    tall = Scan(tmp_path, "flat", items=[Item(tmp_path / "tall.png", size=(200, 800))])
    assert "tall.png, 200x800" in small_images_note(tall, 512)  # its short side: 2.56x
    assert small_images_note(tall, 512, buckets=True) == ""  # its area: 1.28x
    assert (
        small_images_note(Scan(tmp_path, "flat", items=[Item(tmp_path / "a.png")]), 512) == ""
    )  # size unknown


def test_long_captions_are_said_once_with_the_longest(tmp_path):
    """A caption past CLIP's 77 tokens is cut without a word in training (the pipelines warn at each prompt)."""
    from sdplan.trainer.conditioning import long_captions_note
    from sdplan.trainer.tiny import tiny_tokenizer

    tok = tiny_tokenizer(tmp_path / "tok")
    long, short = "a photo of a red dog " * 20, "a photo of a dog"
    note = long_captions_note(tok, [long, long, short], "CLIP")
    n = len(tok(long)["input_ids"])
    assert n > 77
    assert note.startswith(f"2 captions run past the 77 tokens CLIP reads (the longest: {n})")
    assert long_captions_note(tok, [short] * 3, "CLIP") == ""
