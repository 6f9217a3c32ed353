"""`sdplan recommend` end to end: JSON shape, human output, dataset counting, output files, bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sdplan.cli import app
from sdplan.machine import Snapshot
from sdplan.recommend import count_dataset

ROOT = Path(__file__).resolve().parents[1]
MACHINES = ROOT / "tests" / "fixtures" / "machines"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, ["recommend", *args])


def _one_line_error(result, code: int | None = None):
    assert result.exit_code != 0
    if code is not None:
        assert result.exit_code == code
    assert "Traceback" not in (result.output + (result.stderr or ""))
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_json_shape_is_exactly_the_issue(tmp_path):
    r = run(
        "--method",
        "lora",
        "--hardware",
        "2x RTX 4090",
        "--images",
        "13",
        "--repeats",
        "40",
        "--epochs",
        "2",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert list(d) == [
        "schema_version",
        "feasible",
        "request",
        "hardware",
        "plan",
        "settings",
        "steps",
        "estimate",
        "needs",
        "reasons",
        "config",
    ]
    assert set(d["request"]) == {
        "method",
        "model",
        "resolution",
        "images",
        "repeats",
        "images_per_epoch",
        "epochs",
        "max_steps",
        "pins",
        "settings",
    }
    assert (
        set(d["hardware"]) == {"source", "gpus", "ram_usable_bytes"} and d["hardware"]["source"] == "catalog"
    )
    assert set(d["plan"]) == {
        "num_gpus",
        "gpu_ids",  # the GPUs it runs on where the machine's differ (None here: alike GPUs)
        "batch_size",
        "grad_accum",
        "precision",
        "gradient_checkpointing",
        "optimizer",
        "cache_latents",
        "cache_text_encoder_outputs",
        "train_text_encoder",
        "full_half_weights",
        "lora_rank",
        "deepspeed",
        "resolution",
        "base_precision",  # the frozen base's storage (issue 14; bf16 for the UNet families)
        "blocks_to_swap",  # kohya block swap (issue 14; 0 for the UNet families)
    }
    assert set(d["steps"]) == {"images_per_epoch", "epochs", "steps_per_epoch", "total_steps", "images_seen"}
    assert set(d["estimate"]) == {
        "peak_vram_bytes",
        "peak_vram_bytes_range",
        "peak_vram_basis",  # measured (bench, these settings, this GPU), scaled (another batch), predicted
        "sampling_peak_vram_bytes",
        "text_cache_peak_vram_bytes",  # the caption pass before training (cached text-encoder outputs)
        "final_sample_grid_fits",
        "within_upper_bound",
        "ram_bytes",
        "seconds",
        "seconds_range",
        "sampling_seconds",  # of seconds: DreamBooth's missing class images and the sample grids
        "it_per_s",
        "speedup_vs_one_gpu",
        "basis",
        "trainable_params",  # the parameters the run trains (a LoRA's on the modules it adapts)
    }
    assert d["estimate"]["basis"] in ("measured", "calibrated", "published")
    # SD1.5 LoRA, 1,040 images on 2x RTX 4090: one or two GPUs by the rule that two must save more than the
    # time uncertainty (test_pins, test_planner); whichever it is, the plan, the settings and the written
    # accelerate config agree on it
    assert d["needs"] is None and d["steps"]["images_seen"] == 1040
    n = d["plan"]["num_gpus"]
    assert d["settings"]["num_gpus"] == d["config"]["distributed"]["num_processes"] == n
    assert (d["estimate"]["speedup_vs_one_gpu"] > 1) == (n > 1)


def test_method_alone_on_a_machine_without_gpu(monkeypatch):
    import sdplan.probe.snapshot as snapmod

    monkeypatch.setattr(snapmod, "probe", lambda path=".": Snapshot.load(MACHINES / "cpu_only.json"))
    r = run("--method", "dreambooth", "--json")
    assert r.exit_code == 1, r.output  # nothing fits: non-zero, with the JSON still printed
    d = json.loads(r.stdout)
    assert d["feasible"] is False and d["hardware"]["source"] == "probe"
    assert d["request"]["model"] == "sd15" and d["request"]["resolution"] == 512
    assert d["needs"]["min_vram_bytes"] > 0 and d["needs"]["suggested_hardware"]
    human = run("--method", "dreambooth")
    assert human.exit_code == 1 and "does not fit" in human.stdout and "would fit" in human.stdout


def test_no_gpu_says_to_plan_for_a_card_with_hardware(monkeypatch, tmp_path):
    """Without a GPU, recommend said "does not fit" and "would fit: ..." and `--out` "nothing written: no
    configuration fits this hardware", never how to plan for the card you will train on (new-user audit, item 13)."""
    import sdplan.probe.snapshot as snapmod

    monkeypatch.setattr(snapmod, "probe", lambda path=".": Snapshot.load(MACHINES / "cpu_only.json"))
    r = run("--method", "lora", "--model", "sdxl", "--out", str(tmp_path / "plan"))
    assert r.exit_code == 1, r.output
    first = r.stdout.split("would fit: ")[1].split(",")[0]
    flat = " ".join(r.stdout.split())
    assert f'this machine has no GPU: plan for the one you will train on with --hardware "{first}"' in flat
    assert "--machine FILE" in flat
    assert "nothing written: this machine has no GPU" in r.stderr and not (tmp_path / "plan").exists()
    by_file = run("--method", "lora", "--model", "sdxl", "--machine", str(MACHINES / "cpu_only.json"))
    assert "--hardware" in by_file.stdout  # a snapshot of a machine without one alike
    named = run("--method", "lora", "--model", "sdxl", "--hardware", "GTX 1060 6GB")
    assert named.exit_code == 1 and "would fit" in named.stdout and "no GPU" not in named.stdout


def test_human_output_has_plan_reasons_and_step_arithmetic():
    r = run(
        "--method",
        "lora",
        "--model",
        "sdxl",
        "--machine",
        str(MACHINES / "2x_rtx4090_pcie.json"),
        "--images",
        "13",
        "--repeats",
        "40",
    )
    assert r.exit_code == 0, r.output
    # SDXL LoRA on 2x RTX 4090 PCIe was measured (Puget): two GPUs, steps normalised
    for text in (
        "peak VRAM",
        "host RAM",
        "time",
        "images seen",
        "why",
        "normalised",
        "precision bf16",
        "likely",
    ):
        assert text in r.stdout


def _reasons_printed(console_kwargs: dict) -> tuple[list[str], list[str]]:
    """`recommend`'s human output for FLUX.1 LoRA on an RTX 4090 (reasons of up to ~550 characters) on a rich
    console built with ``console_kwargs``: (the reasons, the lines after "why")."""
    import io

    from rich.console import Console

    from sdplan import recommend as R
    from sdplan.profiles import load_profiles

    d, res = R.recommend(
        R.RecommendInputs(method="lora", model="flux-dev", hardware="RTX 4090"), load_profiles()
    )
    buf = io.StringIO()
    R.render(d, res, Console(file=buf, highlight=False, **console_kwargs))
    lines = buf.getvalue().splitlines()
    return d["reasons"], lines[lines.index("why") + 1 :]


def test_reasons_wrap_to_the_terminal_with_a_hanging_indent():
    """On an 80-column terminal the summary wrapped and the "why" list did not: reasons of up to 553 characters
    were printed unbroken, and the terminal wrapped them at column 0, under the dashes. Each reason now wraps to
    the terminal's width, its continuation lines indented under its first word."""
    reasons, lines = _reasons_printed({"force_terminal": True, "width": 80, "color_system": None})
    assert max(len(r) for r in reasons) > 200  # the case: reasons far wider than the terminal
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert all(line.startswith(("  - ", "    ")) and line[4] != " " for line in lines)
    items = []  # each reason's lines joined back: the words are all there, in order
    for line in lines:
        if line.startswith("  - "):
            items.append(line[4:].rstrip())
        else:
            items[-1] += " " + line[4:].rstrip()
    assert [" ".join(item.split()) for item in items] == [" ".join(r.split()) for r in reasons]
    assert len(lines) > len(reasons)  # wrapped


def test_reasons_are_one_line_each_in_a_pipe():
    """Piped (a log, grep), each reason stays one line, whatever the width, as before."""
    reasons, lines = _reasons_printed({"force_terminal": False, "width": 80})
    assert lines == [f"  - {r}" for r in reasons]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal of a given width")
def test_recommend_on_an_80_column_terminal_wraps_every_line(tmp_path):
    """The report's case end to end: `sdplan recommend` on a terminal 80 columns wide (a pseudo-terminal, as
    `script` gives one) prints no line wider than the terminal."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import termios

    main, tty = pty.openpty()
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {
        k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE")
    }
    args = ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--model", "flux-dev"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdplan", *args], stdin=tty, stdout=tty, stderr=tty, env=env, cwd=tmp_path
    )
    os.close(tty)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the process is gone and the terminal closed
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.decode()).replace("\r\n", "\n")
    lines = text.splitlines()
    assert "why" in lines and "precision bf16" in text.replace("\n", " "), text
    assert all(len(line.rstrip()) <= 80 for line in lines), max(lines, key=len)


def test_compare_table():
    r = run("--method", "dreambooth", "--compare", "RTX 3060 12GB,RTX 4090,2x RTX 4090,H100 SXM")
    assert r.exit_code == 0, r.output
    for name in ("RTX 3060 12GB", "2x RTX 4090", "H100 SXM"):
        assert name in r.stdout


def test_compare_says_what_its_times_are_for_and_why_an_option_uses_fewer_gpus():
    """The table showed a full fine-tune at "84 s" without saying it was of the 20 images assumed, and its
    "2x RTX 4090" row "1.00x" vs 1 GPU, the one GPU it planned only in the settings (new-user audit, item 6)."""
    options = "RTX 4090,2x RTX 4090"
    r = runner.invoke(
        app,
        ["recommend", "--method", "finetune", "--model", "sd15", "--compare", options],
        env={"COLUMNS": "200"},
    )
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert (
        "times: 20 images per epoch x 10 epochs (planned for 20 images: pass --images N or --dataset DIR"
        in flat
    )
    row = next(line for line in r.stdout.splitlines() if "2x RTX 4090" in line)
    assert "1 GPU," in row and re.search(r"1\.00x, uses 1 of 2 GPUs \(2: [^,]+, slower\)", row), row
    one = next(line for line in r.stdout.splitlines() if "│ RTX 4090" in line)
    assert "uses" not in one, one  # a one-GPU option says nothing more
    r = runner.invoke(
        app,
        ["recommend", "--method", "lora", "--compare", options, "--images", "13", "--repeats", "40"],
        env={"COLUMNS": "200"},
    )
    flat = " ".join(r.stdout.split())
    assert "times: 520 images (13 x 40 repeats) per epoch x 10 epochs" in flat and "planned for" not in flat


@pytest.mark.parametrize(
    ("options", "pin", "said"),
    [
        (
            "2x RTX 4090,4x RTX 4090",
            "distributed.num_processes=2",
            "uses 2 of 4 GPUs (distributed.num_processes=2 is pinned)",
        ),
        (
            "2x RTX 4090,4x RTX 4090",
            "distributed.gpu_ids=[1]",
            "uses 1 of 2 GPUs (distributed.gpu_ids=[1] is pinned)",
        ),
    ],
)
def test_compare_says_a_pin_not_memory_kept_the_other_gpus_out(options, pin, said):
    """An SDXL LoRA fits any RTX 4090, yet a row planned on fewer GPUs for a pinned count or pinned GPU ids read
    "(4 do not fit)": the planner never tried them (review h102, item 1)."""
    r = runner.invoke(
        app,
        ["recommend", "--method", "lora", "--model", "sdxl", "--compare", options, pin],
        env={"COLUMNS": "250"},
    )
    assert r.exit_code == 0, r.output
    assert said in r.stdout and "do not fit" not in r.stdout, r.stdout


def test_compare_caption_with_max_steps_says_multi_gpu_options_divide_the_steps():
    """The caption said "1000 optimizer steps (training.max_steps)" while a 4-GPU row plans 250 per GPU: it says
    they are one-GPU steps divided among each option's GPUs, with the steps each plans."""
    args = ("--method", "lora", "--model", "sdxl", "--images", "400", "training.max_steps=1000")
    r = runner.invoke(app, ["recommend", *args, "--compare", "RTX 4090,4x RTX 4090"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert (
        "times: 1000 one-GPU steps (training.max_steps), divided among each option's GPUs: 1000 on 1 GPU, "
        "250 per GPU on 4; over 400 images per epoch" in flat
    ), flat
    assert "1000 optimizer steps" not in flat


def test_compare_with_max_steps_states_the_plans_steps_and_weighs_options_for_their_images():
    """With training.max_steps the caption said "x 10 epochs" (the default, not the 20 the steps make) and the
    row "2: 59 min, too little faster to be sure of it" beside a 1.8 h plan: the 2-GPU run sees 4000 images, the
    plan 8000, and --hardware called the same option slower (review h102, item 2). Both weigh it as the planner
    chooses (planner.speedup: the plan's run scaled to the 4000 images the 2 GPUs see)."""
    args = ("--method", "dreambooth", "--model", "sdxl", "--images", "400", "training.max_steps=1000")
    r = runner.invoke(app, ["recommend", *args, "--compare", "2x RTX 4090"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert (
        "times: 1000 optimizer steps (training.max_steps) over 400 images per epoch: 8000 images seen (20 epochs)"
        in flat
    )
    assert "x 10 epochs" not in flat and "too little faster" not in flat
    assert (
        "uses 1 of 2 GPUs (2: 59 min for 4000 images seen against the plan's 8000, slower for its images)"
        in flat
    )
    r = runner.invoke(app, ["recommend", *args, "--hardware", "2x RTX 4090"], env={"COLUMNS": "250"})
    assert (
        "2 GPUs would take 59 min for 4000 images seen against the plan's 8000 (slower for its images than the "
        "1-GPU run;" in " ".join(r.stdout.split())
    )


@pytest.mark.parametrize("columns", [40, 60])
def test_compare_on_a_narrow_terminal_is_a_list_with_nothing_cut(columns):
    """At 40 or 60 columns the table's cells were cut to 'y…', '2 m…', '(7.0-…': too narrow for the table, each
    option is listed under the other, its values whole (a long one wrapped at a word)."""
    options = ["RTX 3060 12GB", "RTX 4090", "2x RTX 4090", "H100 SXM"]
    r = runner.invoke(
        app, ["recommend", "--method", "lora", "--compare", ",".join(options)], env={"COLUMNS": str(columns)}
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "…" not in r.stdout and "┃" not in r.stdout, r.stdout
    assert all(len(line) <= columns for line in lines), r.stdout
    assert [line for line in lines if line and not line.startswith(" ")] == ["hardware options", *options]
    assert lines[1].startswith("  times: 20 images per epoch"), lines[1]  # the default's images, said first
    flat = " ".join(r.stdout.split())
    assert flat.count("fits: yes") == 4 and flat.count("vs 1 GPU: ") == 4, flat
    assert re.search(r"RTX 3060 12GB fits: yes settings: 1 GPU, \w+, batch \d+, .+ peak VRAM \(likely\): "
                     r"[\d.]+ GiB \([\d.]+-[\d.]+\)", flat), flat  # fmt: skip
    wide = runner.invoke(
        app, ["recommend", "--method", "lora", "--compare", ",".join(options)], env={"COLUMNS": "120"}
    )
    assert "┃ hardware " in wide.stdout and "…" not in wide.stdout  # wide enough: the table


@pytest.mark.parametrize("columns", [80, 200])
def test_compare_table_breaks_a_long_word_onto_the_next_line_never_cuts_it(columns):
    """At 80 columns a T4 row's pin conflict read "training.prec… T4 has no bf16 in hardware (use training.prec…":
    rich narrows the settings column below its longest word and cut it, and the fix was lost. Each cell's
    text is now whole, read down its column."""
    r = runner.invoke(
        app,
        [
            "recommend",
            "--method",
            "lora",
            "--model",
            "sdxl",
            "--compare",
            "T4,RTX 4090",
            "training.precision=bf16",
        ],
        env={"COLUMNS": str(columns)},
    )
    assert r.exit_code == 0, r.output
    assert "┃ hardware " in r.stdout and "…" not in r.stdout, r.stdout
    rows = [line.split("│")[1:-1] for line in r.stdout.splitlines() if line.startswith("│")]
    settings = "".join(cells[2].strip() for cells in rows if len(cells) == 6)  # folded: its pieces, joined
    assert "training.precision=bf16:" in settings and "(usetraining.precision=fp16)" in settings.replace(
        " ", ""
    )


def test_a_gtx_16_card_that_does_not_fit_says_its_need_is_in_fp32():
    """It trains in fp32 there (fp16 mixed precision gives NaN losses): the figures say so, in the compare table
    (its row only) and beside 'needs at least', with what a GPU that trains in fp16 needs."""
    import re

    r = run("--method", "lora", "--model", "sdxl", "--compare", "GTX 1660 Super,RTX 2060 6GB")
    assert r.exit_code == 0, r.output
    table = re.sub(
        r"[│┃\s]+", " ", r.stdout
    )  # a wrapped cell's lines, read on (the row's other cells are "-")
    assert table.count("GiB in fp32") == 1, table
    one = run("--method", "lora", "--model", "sdxl", "--hardware", "GTX 1660 Super")
    flat = " ".join(one.stdout.split())
    want = r"does not fit: needs at least [\d.]+ GiB of GPU memory in fp32 \([\d.]+ GiB on a GPU that trains in fp16"
    assert one.exit_code == 1 and re.search(want, flat), flat


def _image(path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)


def test_dataset_counting(tmp_path):
    kohya = tmp_path / "kohya"
    for folder, n in (("10_sks dog", 3), ("10_dog", 2)):
        (kohya / folder).mkdir(parents=True)
        for i in range(n):
            _image(kohya / folder / f"{i}.png")
    c = count_dataset(kohya)
    assert (c.images, c.repeats, c.images_per_epoch, c.layout) == (5, 10, 50, "kohya")
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(4):
        _image(flat / f"{i}.jpg")
        (flat / f"{i}.txt").write_text("a photo")
    (flat / "notes.md").write_text("not an image")
    f = count_dataset(flat)
    assert (f.images, f.captions, f.layout) == (4, 4, "flat")
    r = run("--method", "lora", "--hardware", "RTX 4090", "--dataset", str(kohya), "--json")
    d = json.loads(r.stdout)
    assert (
        d["request"]["images"] == 5 and d["request"]["repeats"] == 10 and d["steps"]["images_per_epoch"] == 50
    )


def test_out_writes_files_and_never_overwrites(tmp_path):
    out = tmp_path / "plan"
    args = (
        "--method",
        "dreambooth",
        "--model",
        "sd21",
        "--machine",
        str(MACHINES / "rx6700xt.json"),
        "--out",
        str(out),
    )
    r = run(*args)
    assert r.exit_code == 0, r.output
    text = (out / "sdplan.yaml").read_text()
    assert text.startswith("#") and f"sdplan train --config {out / 'sdplan.yaml'}" in text
    from sdplan import config

    cfg = config.validate(yaml.safe_load(text), "sdplan.yaml")
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert acc["num_processes"] == cfg.distributed.num_processes
    # SD 2.x DreamBooth at 768 fits the 12 GB RDNA2 card only with optimizer offload (no 8-bit Adam on ROCm).
    assert cfg.distributed.deepspeed is not None and cfg.distributed.deepspeed.offload_optimizer
    ds = json.loads((out / "deepspeed.json").read_text())
    assert acc["distributed_type"] == "DEEPSPEED"
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str((out / "deepspeed.json").resolve())
    assert (
        ds["train_batch_size"]
        == cfg.training.batch_size * cfg.training.grad_accum * cfg.distributed.num_processes
    )
    again = run(*args)
    assert again.exit_code == 3 and "--force" in again.stderr
    assert run(*args, "--force").exit_code == 0


def test_a_file_that_is_no_image_is_not_counted_as_the_trainer_does_not_train_it(tmp_path):
    """recommend counted a corrupt image the trainer skips: the plan's steps (and the max_steps `--out` wrote)
    were for more images than the run had. It reads each image's header, as the trainer's full decode would
    refuse such a file, and says which it left out."""
    from sdplan.trainer.dataset_scan import scan

    for i in range(6):
        _image(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text("a photo")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(200)))
    (tmp_path / "bad.txt").write_text("a photo")
    c = count_dataset(tmp_path)
    trained = scan(tmp_path, verify=True)  # what `sdplan train` scans
    assert c.images == trained.num_images == 6
    assert "bad.png: not an image PIL can read" in c.skipped
    r = run("--method", "lora", "--hardware", "RTX 4090", "--dataset", str(tmp_path), "--json")
    assert json.loads(r.stdout)["steps"]["images_per_epoch"] == 6


def test_out_draws_the_plan(tmp_path):
    """The quality bar: a plan breakdown is a picture. `--out` writes plan.png beside the config: the memory
    parts stacked against the card, the stated peak with its likely range, and the plan's settings at other
    batch sizes (peak and whole-run time), from the planner's own evaluation of each."""
    from PIL import Image

    from sdplan import plan_chart
    from sdplan import planner as P
    from sdplan.profiles import load_profiles

    out = tmp_path / "plan"
    r = run("--method", "lora", "--model", "sdxl", "--hardware", "RTX 4090", "--out", str(out))
    assert r.exit_code == 0, r.output
    with Image.open(out / "plan.png") as im:
        assert im.format == "PNG" and 1000 <= im.size[0] <= 1400 and 450 <= im.size[1] <= 800  # legends whole
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 20)) > 50  # drawn, not blank

    prof = load_profiles()
    res = P.plan(
        P.hardware_from_catalog(prof.find_gpu("RTX 4090")), prof, P.Request(method="lora", model="sdxl")
    )
    d = plan_chart.chart_data(res, prof)
    assert d["card"] == pytest.approx(prof.find_gpu("RTX 4090").memory_bytes / 2**30)
    assert d["limit"] == pytest.approx(d["card"] * P.HEADROOM)
    assert d["peak"] == pytest.approx(res.memory.peak / 2**30)
    # the parts add up to about the peak (the peak is the largest phase; see the plan's breakdown reason)
    assert 0.9 < sum(g for _, g in d["parts"]) / d["peak"] < 1.15
    by_batch = {row["batch"]: row for row in d["sweep"]}
    assert res.plan.batch in by_batch and by_batch[res.plan.batch]["peak"] == pytest.approx(d["peak"])
    assert [b for b in sorted(by_batch)] == sorted(by_batch) and min(by_batch) == 1
    peaks = [by_batch[b]["peak"] for b in sorted(by_batch)]
    assert peaks == sorted(peaks)  # more images a step, more memory
    # each batch as the planner judges it (test_plan_chart_judges_each_batch_as_the_planner_does)
    assert [row["verdict"] for row in d["sweep"]] == [c.verdict for c in P.batch_sweep(res, prof)]
    assert all(row["tried"] for row in d["sweep"])  # 20 images: every batch up to 8 was a candidate


def test_plan_chart_marks_batches_the_search_did_not_try():
    """FLUX.1 fine-tune on 8x H100, 20 images: batch 4 x 6 GPUs is over the distinct images, so the search did
    not take it; the chart drew it as a faster batch that fits, as if the planner had missed it."""
    from sdplan import plan_chart
    from sdplan import planner as P
    from sdplan.profiles import load_profiles

    prof = load_profiles()
    hw = P.hardware_from_catalog(prof.find_gpu("H100 SXM"), count=8)
    res = P.plan(hw, prof, P.Request(method="finetune", model="flux-dev"))
    d = plan_chart.chart_data(res, prof)
    n = res.plan.num_gpus
    for row in d["sweep"]:
        assert row["tried"] == (row["batch"] == 1 or row["batch"] * n <= 20), (row, n)
    assert any(not row["tried"] for row in d["sweep"])
    assert plan_chart.render_png(d).startswith(b"\x89PNG")


def _planned(gpu: str, method: str, model: str):
    from sdplan import planner as P
    from sdplan.profiles import load_profiles

    prof = load_profiles()
    res = P.plan(P.hardware_from_catalog(prof.find_gpu(gpu)), prof, P.Request(method=method, model=model))
    return prof, res


@pytest.mark.parametrize(
    ("gpu", "method", "model", "verdicts"),
    [
        ("RTX 3060 12GB", "lora", "sdxl", {1: "fits", 2: "fits", 4: "may run out of memory"}),
        ("RTX 3060 12GB", "dreambooth", "sd15", {1: "fits", 2: "fits", 4: "fits", 8: "does not fit"}),
        ("RTX 4090", "lora", "sdxl", {1: "fits", 2: "fits", 4: "fits", 8: "fits"}),
    ],
)
def test_plan_chart_judges_each_batch_as_the_planner_does(gpu, method, model, verdicts):
    """plan.png drew SDXL LoRA's batch 4 on an RTX 3060 12GB as a plain circle, fitting (its peak 10.9 GiB is
    under the 92% limit), though its likely range reaches 14.1 GiB, over the 12 GiB card: the very batch the
    planner avoids ("its upper end over the card's 12.0 GiB"). Each batch now carries the planner's own verdict
    on it (Candidate.verdict: fits / may run out of memory / does not fit), which the chart draws apart."""
    from sdplan import plan_chart
    from sdplan import planner as P

    prof, res = _planned(gpu, method, model)
    d = plan_chart.chart_data(res, prof)
    assert {row["batch"]: row["verdict"] for row in d["sweep"]} == verdicts
    for row in d["sweep"]:  # what each verdict means, in the chart's own numbers
        if row["verdict"] == P.FITS:
            assert row["peak"] <= d["limit"] and row["high"] <= d["card"]
        elif row["verdict"] == P.MAY_RUN_OUT:
            assert row["peak"] <= d["limit"] < d["card"] < row["high"]
    assert d["verdict"] == P.FITS  # the plan itself: within the upper end (the search's first preference)
    assert plan_chart.render_png(d).startswith(b"\x89PNG")  # every kind of batch draws


def test_plan_chart_flags_a_plan_whose_likely_range_crosses_the_card():
    """Where nothing fits within the likely peak's upper end, the plan is flagged in the text ("may run out of
    memory"); the chart says the same of the plan, not only of other batch sizes."""
    from sdplan import plan_chart
    from sdplan import planner as P

    prof, res = _planned("GTX 1080", "lora", "sdxl")
    assert res.within_upper_bound is False
    assert any("may run out of memory" in r for r in res.reasons)
    d = plan_chart.chart_data(res, prof)
    assert d["verdict"] == P.MAY_RUN_OUT
    assert {row["batch"]: row["verdict"] for row in d["sweep"]}[res.plan.batch] == P.MAY_RUN_OUT


def test_the_peak_share_and_the_chart_state_the_real_fit_rule():
    """SDXL LoRA on an RTX 3060 12GB, 9.2 GiB (likely 8.7-11.9): "(77%, limit 92%)" read as a limit the plan
    breaks (its range passes 92%), and plan.png's dashed "plan limit" line was crossed by the plan's own range.
    Both say the rule: the estimate under 92%, the likely range within the card."""
    from sdplan import plan_chart

    prof, res = _planned("RTX 3060 12GB", "lora", "sdxl")
    line = next(r for r in res.reasons if r.startswith("predicted peak"))
    assert re.search(
        r"\(\d+% of the card; a plan keeps its estimate under 92% and its likely range within the card\)",
        line,
    ), line
    assert not any("limit 92%" in r for r in res.reasons)
    d = plan_chart.chart_data(res, prof)
    assert "plan limit" not in d["limit_label"] and "92%" in d["limit_label"] and "card" in d["limit_label"]


def test_out_never_overwrites_a_users_own_plan_png(tmp_path):
    out = tmp_path / "plan"
    out.mkdir()
    (out / "plan.png").write_bytes(b"mine")
    r = run("--method", "lora", "--hardware", "RTX 4090", "--out", str(out), "--force")
    assert r.exit_code != 0 and "plan.png" in r.stderr and "Traceback" not in r.output
    assert (out / "plan.png").read_bytes() == b"mine" and not (out / "sdplan.yaml").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--method", "dremboth", "--hardware", "RTX 4090"), "unknown method"),
        (("--method", "lora", "--model", "sd3", "--hardware", "RTX 4090"), "unknown model"),
        (("--method", "lora", "--hardware", "RTX 4099"), "unknown GPU"),
        (("--method", "lora", "--hardware", "RTX 4090", "--images", "0"), "--images must be >= 1"),
        (("--method", "lora", "--hardware", "RTX 4090", "--epochs", "-2"), "--epochs must be >= 1"),
        (("--method", "lora", "--hardware", "RTX 4090", "--resolution", "500"), "multiple of 8"),
        (("--method", "lora", "--hardware", "0x RTX 4090"), "between 1 and 64"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle):
    line = _one_line_error(run(*args))
    assert needle in line


def test_bad_dataset_and_snapshot(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_line_error(run("--method", "lora", "--hardware", "T4", "--dataset", str(empty)))
    assert "no readable images" in line and "the folder has no image files" in line  # as `sdplan train`
    missing = tmp_path / "nope"
    assert "does not exist" in _one_line_error(
        run("--method", "lora", "--hardware", "T4", "--dataset", str(missing))
    )
    # a wrong model beside it: one line with both, as `sdplan train` says them
    both = (
        "--method",
        "lora",
        "--hardware",
        "T4",
        "--dataset",
        str(empty),
        "--model",
        str(missing / "m.ckpt"),
    )
    line = _one_line_error(run(*both))
    assert "the dataset and the model" in line and "no readable images" in line
    assert "no such file or folder" in line
    bad = tmp_path / "snap.json"
    bad.write_text('{"schema_version": 1, "host": {}, "gpus": [{"index": 0}]}')
    assert "gpus[0].vendor: missing" in _one_line_error(run("--method", "lora", "--machine", str(bad)))
    bad.write_text("{not json")
    assert "not valid JSON" in _one_line_error(run("--method", "lora", "--machine", str(bad)))


def test_recommend_never_imports_torch():
    from conftest import recommend_in_a_process

    out = recommend_in_a_process("--method", "dreambooth", "--hardware", "2x RTX 4090", "--json")
    assert json.loads(out)["feasible"] is True


def test_full_bf16_choice_reaches_the_trainer_config(tmp_path):
    """SDXL fine-tune on a 24 GB card fits only with bf16 master weights (kohya --full_bf16): the written
    sdplan.yaml must say so, or the trainer would keep fp32 weights and run out of memory."""
    out = tmp_path / "plan"
    r = run("--method", "finetune", "--model", "sdxl", "--hardware", "RTX 4090", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "full bf16 weights" in r.stdout
    from sdplan import config

    cfg = config.load(out / "sdplan.yaml")
    assert cfg.training.full_half_weights is True and cfg.training.precision == "bf16"


def test_model_given_as_a_folder_plans_its_family_and_the_config_trains_it(tmp_path):
    """`sdplan train --model` takes a folder, a file or a hub id; `sdplan recommend --model` said "unknown model"
    for any of them. The folder's own files say its family (read without torch), and `--out` writes a config
    that trains that folder."""
    from conftest import fake_diffusers_folder

    folder = fake_diffusers_folder(tmp_path / "my-sdxl", "sdxl")
    from conftest import recommend_in_a_process

    args = (
        "--method",
        "lora",
        "--model",
        str(folder),
        "--hardware",
        "RTX 4090",
        "--out",
        str(tmp_path / "plan"),
    )
    assert "a diffusers folder of the sdxl family" in recommend_in_a_process(*args)
    cfg = yaml.safe_load((tmp_path / "plan" / "sdplan.yaml").read_text())
    assert cfg["model"]["family"] == "sdxl" and cfg["model"]["path"] == str(folder)


def test_model_given_as_an_uncached_hub_id_asks_for_the_family(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    r = run("--method", "lora", "--model", "someone/not-cached", "--hardware", "RTX 4090")
    _one_line_error(r, 2)
    assert "cannot tell its family" in r.output and "model.path=someone/not-cached" in r.output
    assert "the hub cannot be asked (HF_HUB_OFFLINE is set)" in " ".join(r.output.split())


def test_a_model_path_setting_is_checked_as_model_is(tmp_path, monkeypatch):
    """`model.path=X` was written into sdplan.yaml unchecked: a path that does not exist, and an SD 1.x folder
    under --model sdxl (planned and written as SDXL). Alone it is --model X; beside --model FAMILY (what recommend
    says to give where it cannot tell a model's family) its files, where they say one, must say that family."""
    from conftest import fake_diffusers_folder, make_images
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    sd15 = fake_diffusers_folder(tmp_path / "my-sd15", "sd15")
    base = ("--method", "lora", "--hardware", "RTX 4090")
    r = run(*base, f"model.path={tmp_path / 'nope'}")
    _one_line_error(r, 2)
    assert "no such file or folder" in r.output
    r = run(*base, "--model", "sdxl", f"model.path={sd15}")
    _one_line_error(r, 2)
    assert f"model.path={sd15} is of the sd15 family, and --model says sdxl" in " ".join(r.output.split())
    r = run(*base, "--model", str(sd15), "model.path=someone/other")
    _one_line_error(r, 2)
    assert "two models" in r.output
    out = tmp_path / "plan"
    for args in ((f"model.path={sd15}",), ("--model", "sd15", f"model.path={sd15}")):
        r = run(*base, *args, "--out", str(out), "--force")
        assert r.exit_code == 0 and "a diffusers folder of the sd15 family" in r.output, r.output
        cfg = yaml.safe_load((out / "sdplan.yaml").read_text())
        assert (cfg["model"]["family"], cfg["model"]["path"]) == ("sd15", str(sd15))
    # a folder named as a family is a folder (it was read as the family, and its hub model written); a path
    # quoted as for sdplan train; the same model twice; the note said once (it was said twice)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my sd15").symlink_to(sd15)
    (tmp_path / "sdxl").symlink_to(sd15)
    for args in (("model.path=sdxl",), ('model.path="my sd15"',), ("--model", "sdxl/", "model.path=sdxl")):
        r = run(*base, *args, "--json")
        assert r.exit_code == 0, r.output
        said = [x for x in json.loads(r.stdout)["reasons"] if x.startswith("model ")]
        assert len(said) == 1 and "a diffusers folder of the sd15 family" in said[0], said
    for bad, error in (
        ("model.path=sd21", "model.path=sd21: no such file or folder"),
        ("model.path=", "empty"),
    ):
        r = run(*base, bad)
        _one_line_error(r, 2)
        assert error in r.output
    ds = make_images(tmp_path / "ds", n=2)
    assert run(*base, "--dataset", "ds", f"data.path={ds}").exit_code == 0  # the same folder: agree
    # a hub id whose family cannot be told here keeps the family given
    r = run(*base, "--model", "flux-dev", "model.path=someone/not-cached", "--out", str(tmp_path / "hub"))
    assert r.exit_code == 0 and "lora flux-dev" in r.output, r.output
    cfg = yaml.safe_load((tmp_path / "hub" / "sdplan.yaml").read_text())
    assert (cfg["model"]["family"], cfg["model"]["path"]) == ("flux-dev", "someone/not-cached")


def test_gpus_on_a_machine_without_a_gpu_is_an_error(monkeypatch):
    """`recommend --gpus 2` on a machine without a GPU planned as if --gpus were not given, without a word."""
    from sdplan import recommend as R
    from sdplan.planner import Hardware

    monkeypatch.setattr(R, "hardware_from_probe", lambda profiles: Hardware(source="probe", gpus=()))
    r = CliRunner().invoke(app, ["recommend", "--method", "lora", "--model", "sd15", "--gpus", "2"])
    assert r.exit_code == 2 and "--gpus 2: this machine has no GPU" in r.output
    assert '--hardware "2x RTX 4090"' in r.output and "Traceback" not in r.output


def test_a_snapshot_without_the_hosts_ram_says_it_is_not_checked(tmp_path):
    data = json.loads((Path(__file__).parent / "fixtures" / "machines" / "rtx3060_12gb.json").read_text())
    del data["host"]
    (tmp_path / "m.json").write_text(json.dumps(data))
    args = ["recommend", "--method", "lora", "--model", "sd15", "--machine", str(tmp_path / "m.json")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "this machine's RAM is not known" in r.output


def test_a_gpu_id_the_hardware_lacks_names_the_ones_it_has():
    r = CliRunner().invoke(
        app, ["recommend", "--method", "lora", "--hardware", "RTX 4090", "distributed.gpu_ids=[3]"]
    )
    assert r.exit_code == 2 and "has no GPU 3 (it has GPU 0;" in r.output


def test_kohya_folders_of_unequal_repeats_count_their_distinct_images(tmp_path):
    """10_a and 3_b with one image each: 13 images an epoch, of 2 distinct. The plan took 13 for the distinct
    count: the latent cache 'encoded each of the 13 images once' and the batch passed the 2 a batch can hold."""
    from conftest import make_images

    make_images(tmp_path / "ds" / "10_a", n=1)
    make_images(tmp_path / "ds" / "3_b", n=1)
    args = (
        "--method",
        "lora",
        "--model",
        "sd15",
        "--hardware",
        "RTX 4090",
        "--dataset",
        str(tmp_path / "ds"),
    )
    r = CliRunner().invoke(app, ["recommend", *args, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["request"]["images"], d["request"]["images_per_epoch"]) == (2, 13)
    assert d["steps"]["images_per_epoch"] == 13 and d["plan"]["batch_size"] <= 2
    assert any("the VAE encodes each of the 2 images once" in line for line in d["reasons"])


@pytest.mark.parametrize(
    ("prediction", "side"), [("epsilon", 512), ("v_prediction", 768), ("unset", 512)]
)  # unset: a scheduler config without prediction_type is diffusers' default, epsilon
def test_an_sd2_model_plans_at_the_side_its_prediction_type_trains_at(tmp_path, prediction, side):
    """stabilityai/stable-diffusion-2-1-base is epsilon at 512; a folder of it was planned at the family's 768
    (2.25x the pixels of each step). Its files' prediction type says which; --resolution still wins."""
    from conftest import fake_diffusers_folder

    model = fake_diffusers_folder(tmp_path / "sd2", "sd21")
    sched = {"_class_name": "DDPMScheduler"} | (
        {} if prediction == "unset" else {"prediction_type": prediction}
    )
    (model / "scheduler" / "scheduler_config.json").write_text(json.dumps(sched))
    d = json.loads(run("--method", "lora", "--model", str(model), "--hardware", "RTX 4090", "--json").stdout)
    assert d["request"]["resolution"] == side
    if side == 512:
        assert any("epsilon-prediction: planned at its 512 px" in r for r in d["reasons"])
    d = json.loads(
        run(
            "--method",
            "lora",
            "--model",
            str(model),
            "--hardware",
            "RTX 4090",
            "--resolution",
            "640",
            "--json",
        ).stdout
    )
    assert d["request"]["resolution"] == 640


def test_the_sd2_base_hub_id_plans_at_512(tmp_path, monkeypatch):
    """stabilityai/stable-diffusion-2-1-base from a cache holding its configs: recommend read the family from
    the hub check but the prediction type from the check before it (none), and planned 768 where train 512."""
    import hub_cache
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    files = hub_cache.configs("sd21")
    files["scheduler/scheduler_config.json"] = {"_class_name": "DDIMScheduler", "prediction_type": "epsilon"}
    hub_cache.write_repo(cache, "stabilityai/stable-diffusion-2-1-base", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    args = ("--method", "lora", "--model", "stabilityai/stable-diffusion-2-1-base", "--hardware", "RTX 4090")
    d = json.loads(run(*args, "--json").stdout)
    assert d["request"]["resolution"] == 512, d["reasons"]


def test_a_max_steps_plan_with_buckets_says_up_to_the_images_it_sees(tmp_path):
    """Each aspect bucket ends in a short batch: where the steps stop inside an epoch, full batches are the most
    they see (recommend said the full-batch count as exact, train "up to" it)."""
    from PIL import Image

    ds = tmp_path / "ds"
    ds.mkdir()
    for i, size in enumerate([(512, 512), (512, 768), (768, 512), (512, 1024), (1024, 512), (600, 400)]):
        Image.new("RGB", size, (i * 30, 60, 90)).save(ds / f"{i}.png")
    base = ("--method", "lora", "--hardware", "RTX 4090", "--dataset", str(ds), "data.buckets=true")
    r = run(*base, "training.batch_size=2", "training.max_steps=1")
    assert r.exit_code == 0 and "images seen up to 2 (" in " ".join(r.output.split()), r.output


def test_a_learning_rate_pinned_in_e_notation_is_written_as_a_number(tmp_path):
    """YAML 1.1 reads 3e-4 (no dot) as text: --json said "3e-4" and sdplan.yaml `learning_rate: 3e-4`, which a
    tool reading either gets as a string."""
    out = tmp_path / "plan"
    base = ("--method", "lora", "--model", "sdxl", "--hardware", "RTX 4090", "training.learning_rate=3e-4")
    r = run(*base, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["config"]["training"]["learning_rate"] == 0.0003
    assert run(*base, "--out", str(out)).exit_code == 0
    assert yaml.safe_load((out / "sdplan.yaml").read_text())["training"]["learning_rate"] == 0.0003


def test_json_request_carries_every_setting_given_as_read():
    """request.pins holds only what the planner plans around: a pinned learning rate or max_steps was in the
    JSON only inside the config (none for a plan that does not fit)."""
    given = ("training.learning_rate=3e-4", "training.max_steps=500", "data.metadata.skip_tags=[lowres, bad]")
    r = run(
        "--method",
        "lora",
        "--model",
        "sd15",
        "--hardware",
        "RTX 4090",
        "training.batch_size=2",
        *given,
        "--json",
    )
    request = json.loads(r.stdout)["request"]
    assert request["pins"] == {"training.batch_size": 2}
    assert request["settings"] == {
        "training.learning_rate": 0.0003,
        "training.max_steps": 500,
        "data.metadata.skip_tags": ["lowres", "bad"],
        "training.batch_size": 2,
    }


def test_json_request_settings_name_places_as_the_config_does(tmp_path, monkeypatch):
    """request.settings kept data.path=./ds as typed while the config beside it had it absolute: a JSON consumer in
    another folder read the request's path wrongly (review h102, item 7). Both now hold the absolute place."""
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()
    for i in range(3):
        Image.new("RGB", (512, 512), (i * 40, 60, 90)).save(tmp_path / "ds" / f"{i}.png")
    given = (
        "data.path=./ds",
        "output.dir=./out",
        "dreambooth.with_prior_preservation=true",
        "dreambooth.class_prompt=a person",
        "dreambooth.class_data=cls",
        "training.learning_rate=3e-6",
    )
    r = run("--method", "dreambooth", "--model", "sd15", "--hardware", "RTX 4090", *given, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    settings, config = d["request"]["settings"], d["config"]
    here = tmp_path.resolve()
    assert settings["data.path"] == config["data"]["path"] == str(here / "ds")
    assert settings["output.dir"] == config["output"]["dir"] == str(here / "out")
    assert settings["dreambooth.class_data"] == config["dreambooth"]["class_data"] == str(here / "cls")
    assert settings["training.learning_rate"] == 3e-6


def test_a_pinned_gpu_count_that_does_not_fit_suggests_that_many_of_a_card():
    """A plan that failed only for its distributed.num_processes=2 pin suggested no hardware: suggest_hardware
    tried single GPUs, and the pin ruled each out."""
    pins = ("distributed.num_processes=2", "training.batch_size=4")
    r = run("--method", "finetune", "--model", "sdxl", "--hardware", "2x RTX 3080 10GB", *pins, "--json")
    needs = json.loads(r.stdout)["needs"]
    assert needs["suggested_hardware"] and all(h.startswith("2x ") for h in needs["suggested_hardware"])
    text = " ".join(
        run("--method", "finetune", "--model", "sdxl", "--hardware", "2x RTX 3080 10GB", *pins).output.split()
    )
    assert re.search(r"needs at least [\d.]+ GiB of GPU memory per GPU", text) and "would fit: 2x " in text
    first = needs["suggested_hardware"][0]
    again = json.loads(
        run("--method", "finetune", "--model", "sdxl", "--hardware", first, *pins, "--json").stdout
    )
    assert again["feasible"], again["reasons"]


@pytest.mark.parametrize(("ids", "machine"), [("[0,1]", "2x "), ("[2,3]", "4x ")])
def test_pinned_gpu_ids_that_do_not_fit_suggest_a_machine_with_those_gpus(ids, machine):
    """distributed.gpu_ids got neither "per GPU" nor a "would fit" line: suggest_hardware built one-GPU catalog
    machines, each of which lacked the GPUs named (review h102, item 3)."""
    args = ("--method", "finetune", "--model", "sdxl", "--images", "200", f"distributed.gpu_ids={ids}")
    r = run(*args, "--hardware", "4x RTX 3060 8GB", "--json")
    suggested = json.loads(r.stdout)["needs"]["suggested_hardware"]
    assert suggested and all(h.startswith(machine) for h in suggested), suggested
    text = " ".join(run(*args, "--hardware", "4x RTX 3060 8GB").output.split())
    assert (
        re.search(r"needs at least [\d.]+ GiB of GPU memory per GPU", text)
        and f"would fit: {machine}" in text
    )
    again = json.loads(run(*args, "--hardware", suggested[0], "--json").stdout)
    assert again["feasible"] and again["plan"]["num_gpus"] == 2, again["reasons"]


def test_recommend_plans_prior_preservation_as_train_does(monkeypatch):
    """`sdplan recommend ... dreambooth.with_prior_preservation=true` never set the planner's class_images, which
    `sdplan train` sets from dreambooth.num_class_images: recommend's plan lacked the "prior preservation: N class
    images are trained alongside" reason train's has. Both now read them with config.prior_preservation."""
    from sdplan import config as C
    from sdplan import launcher
    from sdplan import planner as P
    from sdplan import recommend as R
    from sdplan.profiles import load_profiles

    prof = load_profiles()
    settings = (
        "dreambooth.with_prior_preservation=true",
        "dreambooth.class_prompt=a dog",
        "dreambooth.num_class_images=200",
    )
    inp = R.RecommendInputs(
        method="dreambooth", model="sd15", hardware="RTX 4090", images=20, settings=settings
    )
    _, res = R.recommend(inp, prof)
    assert res.request.prior_preservation and res.request.class_images == 200
    assert "prior preservation: 200 class images are trained alongside (batch doubled)" in res.reasons

    # train's request for the same settings: the same prior preservation and class images
    seen = []
    monkeypatch.setattr(P, "plan", lambda hw, profiles, request: seen.append(request) or res)
    base = C.default_config()
    base["method"], base["model"]["family"] = "dreambooth", "sd15"
    cfg = C.validate(C.apply_overrides(base, list(settings)))
    inputs = launcher.InputSummary(
        images=20, images_x_repeats=20, skipped=0, model_kind="hub", family="sd15", scan_summary=""
    )
    launcher.plan_request(cfg, inputs, res.hardware, launcher.TrainRequest(overrides=list(settings)))
    assert (seen[0].prior_preservation, seen[0].class_images) == (True, 200)
    assert C.prior_preservation(cfg) == (True, 200)


def test_a_max_steps_run_cut_inside_an_epoch_does_not_multiply_out_wrong():
    """`training.max_steps=100` printed "20 images/epoch x 34 epochs = 668 images seen" (680): the last epoch is
    cut short, and the line now says so. Its last step draws one of the epoch's batches of 8, 8 and 4 (shuffled):
    up to 668."""
    r = run("--method", "lora", "--hardware", "RTX 4090", "training.max_steps=100")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert (
        "20 images/epoch, up to 668 images seen (34 epochs, the last cut short by training.max_steps)" in flat
    ), flat
    r = run("--method", "lora", "--hardware", "RTX 4090")  # by epochs: the product holds
    assert "20 images/epoch x 10 epochs = 200 images seen" in " ".join(r.stdout.split())


def test_plan_chart_says_when_the_peak_is_the_caption_pass():
    """SD3.5 Medium LoRA on an RTX 3060 12GB: the plan's peak is the pass that encodes the captions before
    training (the encoders and the VAE alone on the GPU), above the step whose parts the bars stack; the chart
    gave the peak and the bars with nothing to say why they differ."""
    from sdplan import plan_chart

    prof, res = _planned("RTX 3060 12GB", "lora", "sd35-medium")
    assert res.memory.text_cache_peak > res.memory.step_peak
    d = plan_chart.chart_data(res, prof)
    assert d["caption_pass"] == pytest.approx(res.memory.text_cache_peak / 2**30)
    assert d["peak"] == pytest.approx(d["caption_pass"])
    assert plan_chart.render_png(d).startswith(b"\x89PNG")


def test_the_transformer_families_time_is_said_weakly_calibrated_as_its_reason_says():
    """The headline said "(uncalibrated)" while the time reason said "fitted on 4 published SD3.5 / FLUX.1
    speeds ... weakly calibrated": one word for one basis."""
    r = run("--method", "lora", "--model", "flux-dev", "--hardware", "RTX 3090")
    assert r.exit_code == 0, r.output
    (row,) = [line for line in r.stdout.splitlines() if line.startswith("time ")]
    assert row.rstrip().endswith("(weakly calibrated)") and "uncalibrated" not in r.stdout, row
    assert "weakly calibrated" in " ".join(r.stdout.split())
    # and the JSON has that word (it said "uncalibrated")
    j = run("--method", "lora", "--model", "flux-dev", "--hardware", "RTX 3090", "--json")
    assert json.loads(j.stdout)["estimate"]["basis"] == "weakly_calibrated"


def test_the_headline_time_and_the_run_time_reason_say_the_same():
    """SDXL LoRA on 8x H100, 13 images x 3 repeats x 7 epochs: the headline formatted the JSON's seconds (78.5,
    rounded to the tenth) as "78 s", the run-time reason the unrounded time as "run time 79 s"."""
    r = run(
        "--method", "lora", "--model", "sdxl", "--hardware", "8x H100 SXM", "--images", "13", "--repeats", "3",
        "--epochs", "7",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (row,) = [line for line in r.stdout.splitlines() if line.startswith("time ")]
    said = row.split()[1:3]  # "78 s" / "1 min 48 s" start alike
    (reason,) = [line for line in r.stdout.splitlines() if line.strip().startswith("- run time ")]
    assert reason.strip().startswith(f"- run time {' '.join(said)}"), (row, reason)


def test_counts_of_one_are_singular():
    """One image, one epoch, one step: the plan said "1 images/epoch x 1 epochs = 1 images seen; 1 steps/epoch",
    "1 steps per epoch", "up to 1 images twice an epoch", "1 micro-batches" and, after a single pin, "(planned
    around them)"."""
    args = ("--method", "lora", "--hardware", "8x H100 SXM", "--images", "1", "--epochs", "1")
    r = run(*args, "distributed.num_processes=2")
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert "1 image/epoch x 1 epoch = 1 image seen; 1 step/epoch, 1 optimizer step per process" in flat, flat
    assert "pinned: distributed.num_processes=2 (planned around it)" in flat
    assert "up to 1 image twice an epoch" in flat and "= 1 step per epoch" in flat, flat
    assert not re.search(r"\b1 (images|epochs|steps|micro-batches)\b", flat), flat
    r = run(
        *args[:3], "RTX 4090", "--images", "1", "training.max_steps=1", "training.batch_size=1",
        "training.grad_accum=1", "--json",
    )  # fmt: skip
    reasons = " ".join(json.loads(r.stdout)["reasons"])
    assert "(planned around them)" in reasons and "pinned: 1 step of batch 1" in reasons, reasons
    assert not re.search(r"\b1 (images|epochs|steps|micro-batches)\b", reasons), reasons


def test_the_compare_caption_says_counts_of_one_in_the_singular():
    """`--compare` over one image said "times: 1 images per epoch x 1 epochs" and "1 optimizer steps ... 1 images
    seen (1 epochs)"."""
    r = run("--method", "lora", "--images", "1", "--epochs", "1", "--compare", "RTX 4090,H100 SXM")
    assert r.exit_code == 0, r.output
    assert "times: 1 image per epoch x 1 epoch" in " ".join(r.stdout.split()), r.stdout
    r = run("--method", "lora", "--images", "1", "training.max_steps=1", "--compare", "RTX 4090,H100 SXM")
    flat = " ".join(r.stdout.split())
    assert (
        "times: 1 optimizer step (training.max_steps) over 1 image per epoch: 1 image seen (1 epoch)" in flat
    )


def test_does_not_fit_says_from_where_a_plan_may_run_out():
    r = runner.invoke(
        app,
        ["recommend", "--method", "lora", "--model", "sdxl", "--hardware", "GTX 1060 6GB"],
        env={"COLUMNS": "250"},
    )
    flat = " ".join(r.stdout.split())
    assert (
        "does not fit: needs at least 8.9 GiB of GPU memory (from 7.1 GiB a plan is given that may run out"
        in flat
    )
