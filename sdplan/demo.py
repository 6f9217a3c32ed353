"""`sdplan train --demo`: a tiny Stable Diffusion model built in code, a generated captioned dataset, a plan
and a LoRA trained on the CPU, all in one folder and in well under a minute.

The demo goes through the same path as a real run (dataset scan, plan, sdplan.yaml, launch, trainer,
exports); only the model is tiny (``sdplan.trainer.tiny``) and the device is the CPU.
"""

from __future__ import annotations

import json
import random
import shlex
from pathlib import Path
from typing import Any

from sdplan import registry
from sdplan.errors import UsageError
from sdplan.profiles import cache_dir

DEFAULT_OUT = "./sdplan-demo"
# The files the demo built in its base_model/ and dataset/ (relative paths): what --force may delete there
DEMO_FILES = ".sdplan-demo-files.json"
DEMO_INPUTS = ("base_model", "dataset")
DEMO_IMAGES = 8
DEMO_REPEATS = 2  # 8 images x 2 repeats x 2 epochs / batch 2 = 16 optimizer steps on one process
DEMO_EPOCHS = 2
DEMO_BATCH = 2
FLOW_DEMO_FAMILIES = ("sd35-medium", "sd35-large", "flux-dev", "flux-schnell")  # tiny SD3.5 / FLUX.1 too

COLORS = {
    "red": (214, 39, 40),
    "blue": (31, 119, 180),
    "green": (44, 160, 44),
}
SHAPES = ("square", "circle")
# What the demo shows, said after it ran: its samples are noise and its loss barely moves, by design.
DEMO_NOTE = (
    "note: the demo's model is tiny and random, so it shows that the pipeline works end to end (dataset, plan, "
    "training, checkpoints, the LoRA in both formats, the sample grid), not that it learns: the sample grid "
    "is noise and the loss stays about flat. Train a real model (--model PATH --dataset DIR) to see learning."
)
SAMPLE_PROMPTS = [
    "a photo of sks red square",
    "a photo of sks blue circle",
    "a photo of sks green square",
    "a photo of sks red circle",
]


def demo_captions(n: int = DEMO_IMAGES) -> list[tuple[str, str, str]]:
    """(color, shape, caption) for ``n`` images, cycling through every color and shape."""
    combos = [(c, s) for s in SHAPES for c in COLORS]
    out = []
    for i in range(n):
        color, shape = combos[i % len(combos)]
        out.append((color, shape, f"a photo of sks {color} {shape}"))
    return out


def make_dataset(folder: str | Path, *, n: int = DEMO_IMAGES, size: int = 64, seed: int = 0) -> Path:
    """Write ``n`` small PNGs of colored shapes, each with a same-name ``.txt`` caption (a flat dataset)."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i, (color, shape, caption) in enumerate(demo_captions(n)):
        shade = rng.randint(215, 245)
        img = Image.new("RGB", (size, size), (shade, shade, rng.randint(200, 240)))
        draw = ImageDraw.Draw(img)
        side = rng.randint(size * 2 // 5, size * 3 // 5)
        x0 = rng.randint(2, size - side - 2)
        y0 = rng.randint(2, size - side - 2)
        box = (x0, y0, x0 + side, y0 + side)
        if shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.ellipse(box, fill=COLORS[color])
        name = f"{i:02d}_{color}_{shape}"
        img.save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(caption + "\n")
    return folder


def demo_config(
    out: str | Path,
    *,
    family: str = "sd15",
    num_processes: int = 1,
    max_steps: int | None = None,
    resolution: int = 64,
) -> dict[str, Any]:
    """The demo's sdplan.yaml as plain data: a LoRA on the tiny model, on the CPU, with sampling prompts."""
    out = Path(out).resolve()
    return {
        "method": "lora",
        "model": {"path": str(out / "base_model"), "family": family},
        "data": {
            "path": str(out / "dataset"),
            "resolution": resolution,
            "center_crop": True,
            "repeats": DEMO_REPEATS,
        },
        "lora": {"rank": 4, "alpha": 4.0},
        "training": {
            "batch_size": DEMO_BATCH,
            "grad_accum": 1,
            "precision": "fp32",
            "learning_rate": 1e-3,
            "lr_scheduler": "constant",
            "epochs": DEMO_EPOCHS,
            "max_steps": max_steps,
            "seed": 42,
            "device": "cpu",
        },
        "memory": {"gradient_checkpointing": False, "optimizer": "adamw", "cache_latents": False},
        "distributed": {"num_processes": num_processes},
        "output": {"dir": str(out), "save_kohya": True},
        "checkpoints": {"every_steps": 8},
        "sampling": {
            "prompts": list(SAMPLE_PROMPTS),
            "every_steps": 0,
            "num_inference_steps": 6,
            # null: the family's own where it has one (FLUX.1's guidance embedding: 3.5, trainer.sampling.guidance_for),
            # which a classifier-free 5.0 overrode
            "guidance_scale": None if registry.family(family).distilled_guidance else 5.0,
            "seed": 0,
        },
    }


def run_demo(req: Any, ui: Any) -> dict[str, Any]:
    """`sdplan train --demo`: tiny model + generated dataset in ``--out`` (default ./sdplan-demo), then the
    same plan/write/launch path as a real run, on the CPU, and :data:`DEMO_NOTE` on what it shows. Returns
    run_summary.json."""
    import dataclasses
    import time

    from sdplan import config as C
    from sdplan import runfolder
    from sdplan.errors import UsageError
    from sdplan.launcher import (
        InputSummary,
        TrainRequest,
        _validate_given,
        check_out_dir,
        check_start_checkpoint,
        clear_run_outputs,
        removed_line,
        run,
        settings_as_flags,
    )
    from sdplan.registry import family as lookup_family

    req = settings_as_flags(req)  # output.dir=DIR is --out DIR
    demo_families = ("sd15", "sdxl", *FLOW_DEMO_FAMILIES)
    family = lookup_family(req.model or "sd15").name  # aliases: flux -> flux-dev, sd35 -> sd35-medium
    if family not in demo_families:
        raise UsageError(f"--demo --model {family}: the tiny demo models are {', '.join(demo_families)}")
    if req.config or req.dataset or req.method not in (None, "lora") or req.gpus or req.num_machines > 1:
        raise UsageError(
            "--demo builds its own model, dataset and config on the CPU",
            fix="drop --config/--dataset/--method/--gpus/--num-machines, or leave out --demo",
        )
    given = C.given_settings(req.overrides)
    if (
        req.device == "cuda"
        or C.setting_value("training.device", given.get("training.device", "cpu")) != "cpu"
    ):
        raise UsageError("--demo trains on the CPU", fix="drop --device cuda / training.device")
    out = C.absolute(req.out or DEFAULT_OUT, "--out")
    unstarted = _an_unstarted_demo(out)
    if req.resume:  # a run like any other: its flags (--dry-run, --epochs, --max-steps, ...) count as there
        if req.model:  # else the run's own model trained on, and only its first line said which
            raise UsageError(
                "--resume continues the demo as configured in its sdplan.yaml",
                fix="drop --model (a demo of another model: --demo --model NAME --out NEW)",
            )
        if unstarted:
            raise unstarted_demo_error(out)
        return run(dataclasses.replace(req, out=str(out), yes=True, model=None, demo=False), ui)
    runfolder.check_free(out)
    # a demo stopped between building its model and dataset and writing sdplan.yaml: every entry is the demo's
    # own (its manifest says so), which a new demo rebuilds
    state = "unstarted" if unstarted else check_out_dir(out, force=req.force)
    if state == "run":
        _check_inputs_are_the_demos(out)
    data = demo_config(out, family=family, num_processes=req.num_processes or 1, max_steps=req.max_steps)
    train_req = TrainRequest(
        config_data=data,
        out=str(out),
        overrides=list(req.overrides),
        yes=True,
        device="cpu",
        num_processes=req.num_processes,
        max_steps=req.max_steps,
        epochs=req.epochs,
        resolution=req.resolution,
        dry_run=req.dry_run,
        demo=True,
    )
    # the key=value settings validate before the model and dataset are built: a typo (zero_stage=3) left them in
    # --out, which the corrected command then refused as a folder of someone else's files
    cfg = _validate_given(data, train_req, out, "demo config")
    check_start_checkpoint(cfg, out, clears=state == "run")  # before --force clears the checkpoints
    if req.dry_run:  # touches nothing: the plan for the model and dataset the demo would build
        ui.echo(
            f"dry run: would build a tiny {family} model in {out / 'base_model'} and {DEMO_IMAGES} captioned "
            f"images in {out / 'dataset'}"
        )
        train_req.inputs = InputSummary(
            images=DEMO_IMAGES,
            images_x_repeats=DEMO_IMAGES * DEMO_REPEATS,
            skipped=0,
            model_kind="folder",
            family=family,
            scan_summary=f"{DEMO_IMAGES} generated images x {DEMO_REPEATS} repeats (not built in a dry run)",
        )
        return run(train_req, ui)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise runfolder.cannot_write(out, e) from None
    with runfolder.RunLock(out, command="sdplan train --demo"):
        if state == "run":  # only what the manifest says sdplan wrote
            ui.echo(removed_line(out, clear_run_outputs(out)))
            runfolder.remove_owned(out, (*DEMO_INPUTS, DEMO_FILES))
        elif state == "unstarted":
            _check_inputs_are_the_demos(out)
            runfolder.remove_owned(out, (*DEMO_INPUTS, DEMO_FILES))
            ui.echo(f"removed the model and dataset of a demo stopped before it trained in {out}")
        start = time.perf_counter()
        new = [n for n in (*DEMO_INPUTS, DEMO_FILES) if not (out / n).exists()]
        runfolder.record(out, new)
        kept = _build_tiny_model(out / "base_model", family)
        make_dataset(out / "dataset")
        try:
            (out / DEMO_FILES).write_text(json.dumps({n: _files_in(out / n) for n in DEMO_INPUTS}, indent=1))
        except OSError as e:
            raise runfolder.cannot_write(out, e) from None
        how = (
            f"copied the tiny {family} model an earlier demo built ({kept})"
            if kept
            else f"built a tiny {family} model"
        )
        ui.echo(
            f"{how} in {out / 'base_model'}, {DEMO_IMAGES} captioned images in {out / 'dataset'} "
            f"({time.perf_counter() - start:.1f} s)"
        )
        summary = run(train_req, ui)
    ui.echo(DEMO_NOTE)
    return summary


def unstarted_demo_error(out: Path) -> UsageError | None:
    """The error for --resume of a demo stopped before it started training (:func:`_an_unstarted_demo`), with or
    without --demo; None for another folder."""
    if not _an_unstarted_demo(out):
        return None
    return UsageError(
        f"--resume: the demo in {out} was stopped before it started training: nothing to resume",
        fix=f"start it again: sdplan train --demo --out {shlex.quote(str(out))}",
    )


def _an_unstarted_demo(out: Path) -> bool:
    """Whether ``out`` holds only what a demo builds before its sdplan.yaml (its model, dataset and their file
    list), each in sdplan's manifest: a demo stopped (Ctrl-C) between the two, which --demo, --demo --force and
    --resume all refused as a folder of someone else's files."""
    from sdplan import runfolder

    entries = set(runfolder.entries(out))
    return bool(entries) and entries <= {*DEMO_INPUTS, DEMO_FILES} and entries <= runfolder.owned(out)


def _files_in(folder: Path) -> list[str]:
    """Every file under ``folder``, as paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())


def _check_inputs_are_the_demos(out: Path) -> None:
    """--force on a demo run rebuilds its model and dataset: refused where the user put files of their own
    among them (the list the demo wrote of its files says; a demo from before the list: as it was built)."""
    from sdplan import runfolder
    from sdplan.errors import OutputExistsError

    if not (out / DEMO_FILES).exists():
        return
    try:
        made = json.loads((out / DEMO_FILES).read_text())
        listed = {name: set(made[name]) for name in DEMO_INPUTS}
        if not all(isinstance(f, str) for files in listed.values() for f in files):
            raise TypeError
    except (OSError, ValueError, TypeError, KeyError):  # a list that cannot be read tells nothing: refused
        raise OutputExistsError(
            f"--force rebuilds the demo's {' and '.join(DEMO_INPUTS)}, and {out / DEMO_FILES}, the list of the "
            "files the demo made there, cannot be read",
            fix="choose a new folder with --out, or delete the folder yourself",
        ) from None
    mine = runfolder.owned(out)
    for name in DEMO_INPUTS:
        if name not in mine or not (out / name).is_dir():
            continue
        theirs = sorted(set(_files_in(out / name)) - listed[name])
        if theirs:
            shown = ", ".join(theirs[:4]) + (", ..." if len(theirs) > 4 else "")
            raise OutputExistsError(
                f"--force rebuilds the demo's {name}/, and {out / name} holds files the demo did not make "
                f"({shown})",
                fix="move them out of the folder, or choose a new folder with --out",
            )


def tiny_model_cache(family: str) -> Path:
    """Where a built tiny model of ``family`` is kept for the next demo (in sdplan's :func:`cache_dir`):
    building one imports diffusers and transformers in `sdplan train` itself, ~5 s of a demo's ~18. Named by
    what makes its files: the tiny model's code (trainer/tiny.py and the transformers-4 export it applies) and
    the installed torch, diffusers and transformers; a change to any is a new name."""
    import hashlib
    import importlib.metadata

    import sdplan.trainer  # its __init__ only: no torch

    trainer = Path(sdplan.trainer.__file__).resolve().parent  # the repo's trainer/ in an editable install
    digest = hashlib.sha256()
    for name in ("tiny.py", "export.py"):
        digest.update((trainer / name).read_bytes())
    for dist in ("torch", "diffusers", "transformers"):
        digest.update(f"{dist}=={importlib.metadata.version(dist)};".encode())
    return cache_dir() / "tiny-models" / f"{family}-{digest.hexdigest()[:16]}"


def _build_tiny_model(folder: Path, family: str) -> Path | None:
    """The tiny model: a copy of the one an earlier demo built (:func:`tiny_model_cache`; returns where it was
    kept), else built here and kept there (returns None). The cache only saves time: one that cannot be read or
    written is passed over."""
    import shutil

    from sdplan.errors import SdplanError
    from sdplan.trainer.source_check import check_folder

    try:
        cached = tiny_model_cache(family)
        if cached.is_dir():
            try:  # a kept model a disk or an editor damaged since: built again (it failed every later demo)
                check_folder(cached, str(cached), family=family)
            except SdplanError:
                shutil.rmtree(cached)
            else:
                shutil.copytree(cached, folder)
                return cached
    except OSError:
        cached = None
        shutil.rmtree(folder, ignore_errors=True)
    _build_tiny_model_here(folder, family)
    if cached is not None:
        _keep(folder, cached)
    return None


def _keep(folder: Path, cached: Path) -> None:
    """``folder`` copied to ``cached`` whole or not at all: copied beside it, then renamed (two demos at once:
    the second rename finds the first's folder and its copy is dropped)."""
    import os
    import shutil

    part = cached.with_name(f".{cached.name}.{os.getpid()}.part")
    try:
        shutil.copytree(folder, part)
        os.rename(part, cached)
    except OSError:
        shutil.rmtree(part, ignore_errors=True)


def _build_tiny_model_here(folder: Path, family: str) -> None:
    """The tiny model, without the library chatter a newcomer would take for errors (the tiny scheduler's
    config notes, save progress bars)."""
    import warnings

    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    from sdplan.trainer.tiny import save_tiny_model

    levels = dlog.get_verbosity(), tlog.get_verbosity()
    for log in (dlog, tlog):
        log.set_verbosity_error()
        log.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            save_tiny_model(folder, family)
    finally:
        for log, level in zip((dlog, tlog), levels):
            log.set_verbosity(level)
            log.enable_progress_bar()
