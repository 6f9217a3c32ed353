"""`sdplan train`: validate -> probe -> plan -> confirm -> write sdplan.yaml (+ launcher files) -> launch, and
recover from out-of-memory by retrying smaller.

Each step is a small function that can be tested alone; :func:`run` strings them together. Nothing here
imports torch or diffusers: bad input is one clear :class:`~sdplan.errors.SdplanError` before any model
loads, and the trainer runs in its own process (``python -m sdplan.trainer`` or a launcher).

Why one module of ~1,200 lines: it is the one command's sequence (request, --out rule, config, inputs, device,
plan, out-of-memory recovery, run folder), read top to bottom; the parts it shares live elsewhere (the
settings translation in :mod:`sdplan.settings`, step counts in :mod:`sdplan.steps`, the launch in
:mod:`sdplan.launch`, the profile store in :mod:`sdplan.profiles`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from sdplan import config as C
from sdplan import registry
from sdplan.errors import EXIT_INTERRUPTED, EXIT_OOM, NoGPUError, OutputExistsError, SdplanError, UsageError
from sdplan.extras import install_hint
from sdplan.launch import (
    ACCELERATE_FILE,
    DEEPSPEED_FILE,
    DEFAULT_PORT,
    REPORTED_FILE,
    Launch,
    build_launch,
    free_port,
    run_launch,
)
from sdplan.plan_chart import FILE_NAME as PLAN_CHART_FILE
from sdplan.planner import format_duration
from sdplan.probe.snapshot import trained_gpus
from sdplan.probe.software import importable
from sdplan.registry import (
    FAMILIES,
    FLOW_FAMILIES,
    FULL_METHODS,
    family_from_name,
    legacy_lora_targets,
    lora_targets,
)
from sdplan.settings import (
    FAMILY_SETTING,
    OFFLOAD,
    STATE_SETTINGS,
    WEIGHT_SETTINGS,
    Settings,
    get_key,
    settings_data,
    trains_half_weights,
    weight_setting,
)
from sdplan.steps import bucketed_batches, largest_batch, plan_steps, repeated_batches, repeated_batches_text
from sdplan.trainer.dataset_scan import count_of

CONFIG_FILE = "sdplan.yaml"
OOM_FILE = "oom.json"
SUMMARY_FILE = "run_summary.json"
# What an earlier finish of the run wrote, while a later session (an extension, a resume) has not written its own
# outputs: run_summary.json goes at each start, this keeps the list, so --force still removes those files.
PREVIOUS_SUMMARY_FILE = "run_summary.previous.json"
# Files `sdplan recommend --out` / `sdplan train` write before any training (the chart where a plan was made): a
# folder holding only these is a planned run, not yet trained.
PLAN_FILES = (CONFIG_FILE, ACCELERATE_FILE, DEEPSPEED_FILE, PLAN_CHART_FILE)
# What the trainer writes at the top of its output folder, whatever the output name: recorded in the run
# folder's manifest at launch (when they do not exist yet), so a run killed mid-way can still be --force'd.
TRAINER_ENTRIES = (
    "checkpoints", "samples", "logs", "cache", "class_images", "ema", "intermediate", "loss.png", SUMMARY_FILE, OOM_FILE,
    REPORTED_FILE, PREVIOUS_SUMMARY_FILE,
)  # fmt: skip
MAX_OOM_RETRIES = 4


class TrainFailed(SdplanError):
    """The trainer exited non-zero; the exit code is the trainer's. ``reported``: the trainer printed the one
    line that says why, so the CLI adds none."""

    def __init__(self, message: str, code: int, *, fix: str | None = None, reported: bool = False):
        super().__init__(message, fix=fix)
        self.exit_code = code
        self.reported = reported


class OutOfMemoryError(SdplanError):
    """Out of GPU memory and no memory saver left to turn on (or retries spent)."""

    exit_code = EXIT_OOM


class Cancelled(SdplanError):
    exit_code = 1


# -- the request ----------------------------------------------------------------------------------------


@dataclass
class TrainRequest:
    """What the user asked for on the command line (None: not given)."""

    method: str | None = None
    model: str | None = None
    dataset: str | None = None
    out: str | None = None
    resolution: int | None = None
    epochs: int | None = None
    gpus: int | None = None
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    yes: bool = False
    force: bool = False
    resume: bool = False
    device: str | None = None  # "cpu" | "cuda" | None (auto)
    num_processes: int | None = None  # CPU processes (gloo)
    max_steps: int | None = None
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None  # None: 29500 across machines, a free port on one machine
    dry_run: bool = False
    demo: bool = False
    no_plan: bool = False  # --no-plan: train the defaults and key=value settings as given, no fit check
    config_data: dict[str, Any] | None = None  # a config given as data (the demo), instead of a file
    snapshot: Any = None  # a machine Snapshot to plan for instead of probing this machine
    inputs: Any = None  # InputSummary known without scanning (the demo's dry run: its files are not built)
    max_oom_retries: int = MAX_OOM_RETRIES


@dataclass
class UI:
    """How `train` talks: ``echo`` prints a line of plain text (paths and commands are shown as they are,
    never read as markup), ``confirm`` asks on a terminal (None: not a terminal, never ask)."""

    echo: Callable[[str], None] = print
    confirm: Callable[[str], bool] | None = None
    # lines said once a command (an out-of-memory retry records twice: the out of memory, then the fit)
    said: set[str] = field(default_factory=set)

    def echo_once(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            self.echo(line)


# -- the --out rule ---------------------------------------------------------------------------------------


def _holds_a_run(out: Path) -> bool:
    """Whether ``out`` holds an sdplan run or plan: its sdplan.yaml is sdplan's, by the folder's manifest
    (runfolder.record: sdplan records its sdplan.yaml as it writes it, before anything trains). Without a
    manifest (a run from before there was one) only a checkpoint of the trainer's own (its train state) makes it
    a run: one that --resume continues, while --force, which replaces only files the manifest lists, would be
    refused. A user's own sdplan.yaml among their files (and a checkpoints/ folder of theirs) was called "an
    sdplan run that saved no checkpoint", and the --force it suggested was refused."""
    from sdplan import runfolder
    from sdplan.trainer.checkpoint import latest_checkpoint

    if not (out / CONFIG_FILE).is_file():
        return False
    if mine := runfolder.owned(out):  # a readable manifest
        return CONFIG_FILE in mine
    return latest_checkpoint(out) is not None


def check_out_dir(
    out: Path, *, resume: bool = False, force: bool = False, config_path: Path | None = None
) -> str:
    """Refuse an output folder that holds files, unless it is an sdplan run and --resume or --force is given.

    Returns "new" (missing or empty), "planned" (only the files `sdplan recommend --out` writes, and
    ``config_path`` is its sdplan.yaml: training it is what the user asked), or "run" (an sdplan run that
    --resume continues or --force starts over).
    """
    from sdplan import runfolder

    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out {out} is a file, not a folder", fix="choose a folder for the run")
    inside = next((p for p in out.parents if p.exists()), None)  # a dry run creates nothing: say it now
    if inside is not None and not inside.is_dir():
        raise OutputExistsError(
            f"--out {out} is inside {inside}, which is a file, not a folder",
            fix="choose a folder for the run",
        )
    entries = runfolder.entries(out)
    if resume:
        if not out.exists():
            raise UsageError(
                f"--resume: {out} does not exist", fix="point --out at the folder of the run to continue"
            )
        if not (out / CONFIG_FILE).is_file():
            if CONFIG_FILE in runfolder.owned(out):  # sdplan wrote it there: the run's settings are gone
                raise UsageError(
                    f"--resume: the {CONFIG_FILE} of the run in {out} is missing (the settings its checkpoints "
                    "were trained with)",
                    fix=f"put the run's {CONFIG_FILE} back in {out} to continue it",
                )
            from sdplan.demo import unstarted_demo_error

            if (demo := unstarted_demo_error(out)) is not None:
                raise demo
            raise UsageError(
                f"--resume: {out} is not an sdplan run (no {CONFIG_FILE})",
                fix="point --out at the folder of the run to continue",
            )
        return "run"
    if not entries:
        return "new"
    given = config_path is not None and _same_file(config_path, out / CONFIG_FILE)
    # `train --config DIR/sdplan.yaml --out DIR` on a plan's files: its own check says whose the config is
    is_run = _holds_a_run(out) or (given and set(entries) <= set(PLAN_FILES))
    if (
        is_run
        and config_path is not None
        and set(entries) <= set(PLAN_FILES)
        and _same_file(config_path, out / CONFIG_FILE)
    ):
        return "planned"
    if not is_run:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise OutputExistsError(
            f"--out {out} already holds files ({shown}) and is not an sdplan run",
            fix="choose a new or empty folder; sdplan never writes over your files",
        )
    if (
        not force
        and config_path is not None
        and _same_file(config_path, out / CONFIG_FILE)
        and runfolder.owned(out) <= set(PLAN_FILES)
    ):  # `recommend --out` wrote its plan beside the user's own files: nothing has trained here
        theirs = [e for e in entries if e not in PLAN_FILES]
        shown = ", ".join(theirs[:4]) + (", ..." if len(theirs) > 4 else "")
        raise OutputExistsError(
            f"--out {out} holds your files ({shown}) beside the plan; a run there would write among them",
            fix="train into another folder with --out DIR, or move your files out",
        )
    if not force and is_plan(
        out
    ):  # nothing has trained here: "start it over with --force" would lose the plan
        raise OutputExistsError(
            f"--out {out} holds a plan (sdplan recommend --out), not a run",
            fix=f"train the plan with `sdplan train --config {out / CONFIG_FILE}`, or choose a new folder",
        )
    from sdplan.trainer.outputs import is_export_check

    # The trainer's trial export before training (``.export-check-<pid>``) is deleted whatever ends the export,
    # except a SIGKILL. Left by a kill of sdplan and the trainer, it is in no manifest (sdplan did not live to
    # record it), yet sdplan wrote it: it counts as sdplan's, and --force or the next start removes it.
    foreign = [n for n in runfolder.foreign(out) if not is_export_check(out / n)]
    shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
    if not force:
        from sdplan.trainer.checkpoint import latest_checkpoint

        # --force as it would be taken: refused while files sdplan did not write are there, so offered once they
        # are moved out, and not at all for a run from before the manifest (none of its files is provably sdplan's;
        # it is a run by its checkpoint, which --resume continues: _holds_a_run)
        first = (
            "" if not foreign else f"move {shown} (not sdplan's) out and " if runfolder.owned(out) else None
        )
        if (
            latest_checkpoint(out) is None
        ):  # --resume would be refused: it stopped before its first checkpoint
            raise OutputExistsError(
                f"--out {out} holds an sdplan run that saved no checkpoint",
                fix=f"{first or ''}start it over with --force, or choose a new folder",
            )
        if config_path is not None and _same_file(config_path, out / CONFIG_FILE):
            # `train --config RUN/sdplan.yaml key=value` on a run that has trained: --config starts a run, so
            # the way to change a setting of this one is --resume with the setting (or --force to start over)
            over = f"to start it over with them: {first}add --force; " if first is not None else ""
            raise OutputExistsError(
                f"--out {out} holds an sdplan run: --config trains a plan folder or starts a new run",
                fix=f"to change its settings and continue it: sdplan train --resume --out {shlex.quote(str(out))} "
                f"key=value ...; {over}or choose a new folder",
            )
        over = f"{first}start it over with --force, " if first is not None else ""
        raise OutputExistsError(
            f"--out {out} holds an sdplan run", fix=f"continue it with --resume, {over}or choose a new folder"
        )
    if foreign:
        # --force replaces only what sdplan provably wrote (its manifest), never a folder picked by its name.
        raise OutputExistsError(
            f"--out {out} holds files sdplan did not write ({shown}); --force replaces only sdplan's own files",
            fix="move those files out of the folder, or choose a new folder",
        )
    return "run"


def config_output_dir(config_path: Path, base: dict[str, Any]) -> Path:
    """The folder a run from ``config_path`` trains into where --out is not given: its ``output.dir``. The
    sdplan.yaml of a run or plan folder names that folder; where the folder was copied or moved since (its
    manifest says where it was written, and output.dir names that place), training "there" would write into
    the original run (--force would clear it) or start one where the folder was: refused, with the --out that
    trains in the config's own folder. An output.dir set to another folder (`recommend --out DIR
    output.dir=RUN`) is kept."""
    from sdplan import runfolder

    out = C.absolute(str((base.get("output") or {}).get("dir", "./output")), "output.dir")
    folder = config_path.expanduser().resolve().parent
    if config_path.name != CONFIG_FILE or out == folder or CONFIG_FILE not in runfolder.owned(folder):
        return out
    was = runfolder.written_at(folder)
    # a manifest from before it said where: a run folder's config names the run folder itself
    moved = str(out) == was and was != str(folder) if was is not None else not is_plan(folder)
    if moved:
        raise UsageError(
            f"{config_path} is the {CONFIG_FILE} of the run folder {folder}, but its output.dir is {out}, where "
            "the folder was (was it copied or moved?)",
            fix=f"add --out {folder} to train in the folder the config is in, or --out DIR for another",
        )
    return out


def is_plan(out: Path) -> bool:
    """Whether ``out`` holds what `sdplan recommend --out` writes and nothing sdplan wrote by training."""
    from sdplan import runfolder

    return set() < runfolder.owned(out) <= set(PLAN_FILES)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


# What a run's trainer writes that --force clears, by name (else the new run's outputs sit among the old run's,
# as if one run had made them all): its sample grids, its intermediate outputs (kohya's names), its TensorBoard
# event files. A file of the user's in these folders stays, and so do the latent cache and generated class
# images (the same inputs give the same ones).
def _run_products(out: Path) -> list[Path]:
    """The last run's sample grids, intermediate outputs and TensorBoard event files in ``out``, by the names the
    trainer gives them (sdplan.trainer.outputs)."""
    from sdplan.trainer.outputs import GRID_NAME, INTERMEDIATE, INTERMEDIATE_NAME

    found: list[Path] = []
    for folder, name in (("samples", GRID_NAME), (INTERMEDIATE, INTERMEDIATE_NAME)):
        if (out / folder).is_dir():
            found += [p for p in (out / folder).iterdir() if name.fullmatch(p.name) and not p.is_symlink()]
    if (out / "logs").is_dir():
        found += [
            p for p in (out / "logs").rglob("events.out.tfevents.*") if p.is_file() and not p.is_symlink()
        ]
    return found


def summary_outputs(summary: dict[str, Any], out: Path) -> list[Path]:
    """The output files a run summary lists, as paths in the run folder ``out`` now: a relative path (how the
    trainer lists them, :func:`sdplan.trainer.outputs.in_folder`) is in ``out``; an absolute one under the
    folder the summary was written in (its ``folder``) is mapped into ``out``, so a copied or moved run names
    its own files, not the original's; any other absolute path (a summary from before ``folder``) stays."""
    folder = summary.get("folder")
    old = Path(folder) if isinstance(folder, str) and Path(folder).is_absolute() else None
    listed = summary.get("outputs")
    found = []
    for entry in listed if isinstance(listed, list) else []:
        if not isinstance(entry, str) or not entry:
            continue
        path = Path(entry)
        if not path.is_absolute():
            path = out / path
        elif old is not None and path.is_relative_to(old) and path != old:
            path = out / path.relative_to(old)
        found.append(path)
    return found


def _listed_outputs(out: Path, name: str) -> list[Path]:
    """The output files run summary ``name`` in ``out`` lists (:func:`summary_outputs`)."""
    return summary_outputs(read_json(out / name) or {}, out)


def _as_listed(out: Path, paths: list[Path]) -> dict[str, Any]:
    """``folder`` and ``outputs`` for a summary sdplan writes in ``out`` (as the trainer writes them)."""
    from sdplan.trainer.outputs import in_folder

    return {"folder": str(out.resolve()), "outputs": sorted({in_folder(p, out) for p in paths})}


def set_aside_summary(out: Path) -> None:
    """Before the trainer starts: run_summary.json goes (it must describe this session once it ends), but the
    outputs it lists stay until this session writes its own, so their names go into run_summary.previous.json
    (with those an earlier one kept): an interrupted extension or --force start no longer leaves the previous
    finish's weights, loss.png and loss_history.json unknown to the next --force."""
    summary = read_json(out / SUMMARY_FILE)
    if summary is not None:
        listed = _listed_outputs(out, PREVIOUS_SUMMARY_FILE) + _listed_outputs(out, SUMMARY_FILE)
        previous = {
            "about": "what an earlier finish of this run wrote; this run has not written its own outputs over "
            "them yet (`sdplan train --force` removes them)",
            **{k: summary[k] for k in ("steps", "images_seen") if k in summary},
            **_as_listed(out, listed),
        }
        (out / PREVIOUS_SUMMARY_FILE).write_text(json.dumps(previous, indent=1) + "\n")
    (out / SUMMARY_FILE).unlink(missing_ok=True)


def drop_previous_summary(out: Path) -> None:
    """After a finish: run_summary.previous.json keeps only the files the new summary does not list (an output
    name that changed), and goes when there are none."""
    now = set(_listed_outputs(out, SUMMARY_FILE))
    left = [p for p in _listed_outputs(out, PREVIOUS_SUMMARY_FILE) if p not in now and p.exists()]
    previous = read_json(out / PREVIOUS_SUMMARY_FILE)
    if previous is None:
        return
    if not left:
        (out / PREVIOUS_SUMMARY_FILE).unlink(missing_ok=True)
    else:
        (out / PREVIOUS_SUMMARY_FILE).write_text(
            json.dumps({**previous, **_as_listed(out, left)}, indent=1) + "\n"
        )


def clear_run_outputs(out: Path) -> list[str]:
    """--force on an existing run: remove what the last run left (its checkpoints, which a retry would resume
    from, its OOM report and summary, the output files its summary lists, its grids, intermediate outputs and
    event files: :func:`_run_products`), only in entries the run folder's manifest proves sdplan made, and of
    the folders only what the trainer names so (a file the user put there stays; so does a folder). Returns
    what it removed (paths relative to ``out``, checkpoints first), for the line that says so
    (:func:`removed_line`)."""
    import shutil

    from sdplan import runfolder
    from sdplan.trainer.checkpoint import CHECKPOINTS, list_checkpoints, remove_checkpoints
    from sdplan.trainer.outputs import remove_stale_export_checks

    remove_stale_export_checks(out)
    mine = runfolder.owned(out)
    listed = _listed_outputs(out, SUMMARY_FILE) + _listed_outputs(out, PREVIOUS_SUMMARY_FILE)
    files = [p for p in listed if p.is_relative_to(out) and ".." not in p.parts and p.is_file()]
    removed = (
        [p.relative_to(out).as_posix() for _, _, p in list_checkpoints(out)] if CHECKPOINTS in mine else []
    )
    removed += runfolder.remove_owned(out, (OOM_FILE, SUMMARY_FILE, REPORTED_FILE, PREVIOUS_SUMMARY_FILE))
    rewritten = {CONFIG_FILE, ACCELERATE_FILE, DEEPSPEED_FILE, PLAN_CHART_FILE}  # an edited one kept aside
    for path in [*files, *_run_products(out)]:
        top = path.relative_to(out).parts[0]
        if top not in mine or top in rewritten or not (path.exists() or path.is_symlink()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.relative_to(out).as_posix())
    for folder in ("samples", "intermediate", "logs"):  # left empty by the above: gone too
        if folder in mine and (out / folder).is_dir():
            for sub in sorted((out / folder).rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if sub.is_dir() and not sub.is_symlink() and not any(sub.iterdir()):
                    sub.rmdir()
            if not any((out / folder).iterdir()):
                (out / folder).rmdir()
    if CHECKPOINTS in mine:
        remove_checkpoints(out)
    return removed


def removed_line(out: Path, removed: list[str]) -> str:
    """The line --force prints for what :func:`clear_run_outputs` removed from the run folder ``out``."""
    from sdplan.trainer.checkpoint import CHECKPOINTS

    if not removed:
        return f"--force: {out} held nothing of an earlier run's to remove"
    ckpts = [Path(r).name for r in removed if r.startswith(CHECKPOINTS + "/")]
    others = len(removed) - len(ckpts)
    parts = []
    if ckpts:
        shown = ", ".join(ckpts[:4]) + (", ..." if len(ckpts) > 4 else "")
        parts.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) != 1 else ''} ({shown})")
    if others:
        parts.append(f"{others} output file{'s' if others != 1 else ''} of the last run")
    return f"--force: removed {' and '.join(parts)} from {out}"


def check_start_checkpoint(cfg: C.TrainConfig, out: Path, *, clears: bool) -> None:
    """``checkpoints.resume`` in a run that is not a ``--resume`` (a new run starting from another run's
    checkpoint): it must name a checkpoint folder, outside what ``--force`` clears (``clears``: this run
    starts over in ``out``, deleting its checkpoints first). One line before anything is deleted or written
    (else --force deleted every checkpoint, then failed naming a --resume never typed)."""
    from sdplan.trainer.checkpoint import STATE_FILE, checkpoint_root

    if cfg.checkpoints.resume == "latest":
        raise UsageError(
            "checkpoints.resume=latest: `sdplan train` continues a run's newest checkpoint with --resume",
            fix=f"`sdplan train --resume --out {shlex.quote(str(out))}`, or drop checkpoints.resume "
            "(checkpoints.resume=null) to start a new run",
        )
    path = start_checkpoint(cfg)
    if path is None:
        return
    if clears and _inside(path, checkpoint_root(out)):
        raise UsageError(
            f"--force starts the run in {out} over and deletes its checkpoints, and checkpoints.resume names "
            f"{path}, one of them",
            fix=f"continue the run with `sdplan train --resume --out {shlex.quote(str(out))}`, or set "
            "checkpoints.resume=null to start over from the base model (copy that checkpoint out of the folder "
            "first to start from it)",
        )
    if not (path / STATE_FILE).is_file():
        raise UsageError(
            f"checkpoints.resume {path}: not a checkpoint folder (no {STATE_FILE})",
            fix="point it at a checkpoint folder (checkpoints/step-N of a run), or set checkpoints.resume=null",
        )


def check_resume_choice(saved: C.TrainConfig, cfg: C.TrainConfig, out: Path) -> None:
    """``--resume`` continues the run's newest checkpoint; a ``checkpoints.resume`` given with it (another
    checkpoint) was dropped without a word and written into sdplan.yaml, where a later --force met it: one line
    instead. The run's own value (the checkpoint it started from) stays as it is."""
    from sdplan.trainer.checkpoint import checkpoint_root, latest_checkpoint

    now = cfg.checkpoints.resume
    if now in (None, "") or now == C.absolute_paths(saved.to_dict())["checkpoints"]["resume"]:
        return
    last = latest_checkpoint(out)
    raise UsageError(
        f"--resume continues the run from its newest checkpoint ({last.name if last else 'none'}); "
        f"checkpoints.resume={now} is not used with it",
        fix=f"drop checkpoints.resume; to go back to an older checkpoint, move the newer ones out of "
        f"{checkpoint_root(out)} first",
    )


# -- the config ---------------------------------------------------------------------------------------------


def flag_overrides(req: TrainRequest, out: Path | None) -> list[str]:
    """Command-line flags as key=value overrides (they win over a config file, as key=value does)."""
    o: list[str] = []
    if req.method:
        o.append(f"method={req.method}")
    if req.model:
        o.append(f"model.path={C.absolute_if_local(req.model)}")
    if req.dataset:
        o.append(f"data.path={C.absolute(req.dataset, '--dataset')}")
    if req.resolution is not None:
        o.append(f"data.resolution={req.resolution}")
    if req.epochs is not None:
        o.append(f"training.epochs={req.epochs}")
    given = C.override_keys(req.overrides)
    if req.max_steps is not None:
        o.append(f"training.max_steps={req.max_steps}")
    elif (req.epochs is not None or "training.epochs" in given) and "training.max_steps" not in given:
        # the epochs asked for count: a config's max_steps (recommend --out writes its planned count there)
        # would stop the run at its old length and the new epochs would do nothing
        o.append("training.max_steps=null")
    if req.device:
        o.append(f"training.device={req.device}")
    if req.num_processes is not None:
        o.append(f"distributed.num_processes={req.num_processes}")
    elif req.gpus is not None and (req.config or req.resume):
        o.append(f"distributed.num_processes={req.gpus * req.num_machines}")
        o.append("distributed.gpu_ids=null")  # the config's GPUs were for its count: chosen again for --gpus
    if out is not None:
        o.append(f"output.dir={out}")
    return o


def _quote_override(item: str) -> str:
    """Make the value of a generated override a YAML string when it would parse as something else."""
    key, _, value = item.partition("=")
    if key in ("model.path", "data.path", "output.dir") and value:
        return f"{key}={C.yaml_quoted(value)}"
    return item


def config_data(
    base: dict[str, Any], req: TrainRequest, out: Path | None, *, plan: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Base data, then the plan's settings, then flags, then the user's key=value overrides (last wins), as
    plain data (not yet validated), with its paths absolute (:func:`sdplan.config.absolute_paths`)."""
    data = C.merge(base, plan) if plan else base
    data = C.apply_overrides(data, [_quote_override(o) for o in flag_overrides(req, out)])
    if req.overrides:
        data = C.apply_overrides(data, req.overrides)
    return C.absolute_paths(data)


def _validate_given(base: dict[str, Any], req: TrainRequest, out: Path, source: str) -> C.TrainConfig:
    """The config as given, validated. An error that only the user's key=value settings bring is theirs: named
    'key=value settings', not the config file that holds no such value."""
    try:
        cfg = C.validate(config_data(base, req, out), source=source)
    except C.ConfigError as e:
        if not req.overrides:
            raise
        C.validate(config_data(base, replace(req, overrides=[]), out), source=source)  # the file's own errors
        raise C.ConfigError("key=value settings", e.errors, fix=e.fix) from None
    if req.resume and cfg.method != base.get("method", C.TrainConfig.method):
        # method=... changes the run's method: that is the error (check_resume_settings, which names it); the
        # other method's settings beside it only followed it ('use --method lora', which --resume refuses)
        return cfg
    given = C.override_keys(req.overrides)
    if problems := C.method_setting_problems(
        cfg.method, given, resume=req.resume
    ) + C.switched_setting_problems(cfg, req.overrides):
        raise C.ConfigError("key=value settings", problems)
    # a resumed run keeps what its sdplan.yaml trained with unless the setting is given again
    if problems := C.given_problems(cfg, given if req.resume else None):
        raise C.ConfigError("key=value settings" if given else source, problems)
    return cfg


def drop_a_stale_plan(
    cfg: C.TrainConfig, base: dict[str, Any], source: str, req: TrainRequest, inputs: InputSummary
) -> tuple[C.TrainConfig, str | None]:
    """A config `sdplan recommend --out` wrote, trained with settings other than those its ``plan:`` record is
    of: flags or key=value settings that change what it planned (sdplan.settings.CONFIG_KEYS: the batch, the
    memory savers, the GPUs ...), a hand edit of the file, other epochs or another dataset. The record (the peak,
    the time, the steps) went into every output's metadata; the planned ``training.max_steps`` changed the run's
    length with the batch or the dataset. Both are dropped (a GPU run plans the record again, every setting
    pinned: :func:`prepare`); returned with what changed, in words (None where nothing did)."""
    from sdplan.settings import CONFIG_KEYS

    record = cfg.plan or {}
    now = cfg.to_dict()
    try:
        written = C.validate(base, source=source).to_dict()
    except SdplanError:
        written = now
    changed: dict[str, tuple[Any, Any]] = {}  # key -> (now, planned)
    for key in (*CONFIG_KEYS.values(), "ema.enabled", "ema.device", "data.buckets", "data.repeats"):
        if get_key(written, key) != get_key(now, key):
            changed[key] = (get_key(now, key), get_key(written, key))
    # the file's own settings against its record (edited by hand since it was written)
    family = cfg.model.family or inputs.family
    planned = record.get("plan") or {}
    if family in registry.FAMILIES:
        settings = Settings.from_config(cfg, model=family)
        for name, value in planned.items():
            field = {"batch_size": "batch"}.get(name, name)
            if field not in CONFIG_KEYS or (field == "num_gpus" and req.num_machines > 1):
                continue
            have = getattr(settings, field, None)
            have = list(have) if isinstance(have, tuple) else have
            if have != value and CONFIG_KEYS[field] not in changed:
                changed[CONFIG_KEYS[field]] = (get_key(now, CONFIG_KEYS[field]), value)
    steps = record.get("steps") or {}
    if steps.get("epochs") not in (None, cfg.training.epochs):
        changed["training.epochs"] = (cfg.training.epochs, steps["epochs"])
    if steps.get("images_per_epoch") not in (None, inputs.images_x_repeats):
        changed["images per epoch"] = (inputs.images_x_repeats, steps["images_per_epoch"])
    if not changed:
        return cfg, None
    said = ", ".join(f"{k} {_value_text(a)} (planned {_value_text(b)})" for k, (a, b) in changed.items())
    said += f": the plan in {source} was made for other settings"
    typed = req.max_steps is not None or "training.max_steps" in C.override_keys(req.overrides)
    planned_steps = (steps.get("total_steps") or 0) * max(
        1, get_key(written, "distributed.num_processes") or 1
    )
    cfg.plan = None
    if not typed and cfg.training.max_steps is not None and cfg.training.max_steps == planned_steps:
        said += f"; its planned training.max_steps {cfg.training.max_steps} is dropped (the run trains its epochs)"
        cfg = replace(cfg, training=replace(cfg.training, max_steps=None))
    return cfg, said


def _value_text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def read_yaml_config(path: Path) -> dict[str, Any]:
    """A config file as data; ConfigError when missing or not YAML (validation comes after overrides)."""
    data = C.read_config_file(path)
    if data is None:  # an empty file (or only comments) would train every default, the hub model included
        raise C.ConfigError(str(path), ["empty: no settings (write one with `sdplan recommend --out DIR`)"])
    if not isinstance(data, dict):
        raise C.ConfigError(
            str(path), ["top level: must be a mapping of sections (model:, data:, training:, ...)"]
        )
    return data


def config_file_data(path: Path) -> dict[str, Any]:
    """A config file's settings as validated data, paths absolute as this folder reads them (to compare with
    another run's); SdplanError where it cannot be read or is not valid."""
    return C.absolute_paths(C.validate(read_yaml_config(path), source=str(path)).to_dict())


# -- inputs ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSummary:
    """What the inputs are, found without loading a model."""

    images: int
    images_x_repeats: int
    skipped: int
    model_kind: str  # folder | file | hub
    family: str | None
    scan_summary: str
    # what could not be checked before the launch (a dry run without the hub); which parts an all-in-one file gives
    model_notes: tuple[str, ...] = ()
    bucket_samples: tuple[int, ...] = ()  # data.buckets: the samples in each aspect bucket (steps.py)
    # data.buckets: each sample's bucket, in the dataset's order (the trainer's BucketBatchSampler's bucket ids)
    sample_buckets: tuple[int, ...] = ()
    prediction_type: str | None = None  # what the model's files say (an SD 2.x epsilon base plans at 512)
    revision: str | None = None  # a hub model's
    hub_cached: bool = False  # a hub model the local cache holds whole (else its weights come from the hub)
    layout: str = ""  # the dataset's (dataset_scan.Scan.format: flat | kohya | metadata)


def listed_hub_family(hub_id: str) -> str | None:
    """The family whose profile lists ``hub_id`` (recommend plans those offline: :mod:`sdplan.recommend`)."""
    from sdplan.profiles import load_profiles
    from sdplan.recommend import _listed_hub_family

    return _listed_hub_family(hub_id, load_profiles())


def check_inputs(
    cfg: C.TrainConfig, *, dry_run: bool = False, planned_resolution: bool = False
) -> InputSummary:
    """The dataset has readable images and the model exists: one clear error otherwise, or one line with both
    when both are wrong (the user fixes them in one go, not one per run). No torch. A hub id the cache does not
    hold is checked on the hub; ``dry_run``: where the hub cannot be asked, it is planned from its name, and
    said (a run would fail there: it is refused). ``planned_resolution``: the plan picks the resolution (none
    given): the model's own, which the images are measured against."""
    from sdplan.trainer.dataset_scan import (
        KohyaProjectError,
        metadata_note,
        require_images,
        scan,
        scan_data,
        small_images_note,
        uncaptioned_note,
    )
    from sdplan.trainer.models import PICKLE_SUFFIXES, HubUnreachable, resolve_source
    from sdplan.trainer.source_check import check_source, single_file_configs

    dataset_error: SdplanError | None = None
    try:
        result = require_images(scan_data(cfg.data, verify=True))
    except SdplanError as e:
        dataset_error = e
    if dataset_error is None and C.prior_preservation(cfg)[0] and cfg.dreambooth.class_data:
        # a kohya project as the class folder: the folder to name instead, before any model loads (the trainer
        # says what else is wrong with it; short, it is generated into)
        try:
            folder = Path(C.expand_user(cfg.dreambooth.class_data, "dreambooth.class_data"))
            if folder.is_dir():
                scan(folder, setting="dreambooth.class_data")
        except KohyaProjectError as e:
            dataset_error = e
        except (SdplanError, OSError):
            pass
    try:
        source = resolve_source(cfg.model.path)
        if source.kind == "file" and source.location.lower().endswith(PICKLE_SUFFIXES):
            check_model_file(Path(source.location))  # torch checkpoints: their head
        # what the model is, from its files: an incomplete folder, another family, an inpainting / refiner /
        # EDM model, a LoRA or embedding given as the model are one line here, not a traceback in the trainer
        kw = dict(
            family=cfg.model.family,
            variant=cfg.model.variant,
            config_dir=cfg.model.config_dir,
            revision=cfg.model.revision,
        )
        model_note, unknown = None, None
        try:  # an uncached hub id: its configs, before the launch (the trainer downloads it anyway)
            info = check_source(cfg.model.path, **kw, hub=True)
        except HubUnreachable as e:
            if not dry_run:
                raise
            info = check_source(cfg.model.path, **kw)
            listed = listed_hub_family(cfg.model.path)
            info.family = info.family or listed or family_from_name(cfg.model.path)
            unknown = f"a hub id the hub cannot be asked about here ({e.why})"
            model_note = f"model: not checked ({e.why}): planned as " + (
                "model.family says"
                if cfg.model.family
                else "the family sdplan's profiles list it under"
                if listed
                else "the family its name suggests"
            )
        family = cfg.model.family or info.family or _family_of(source.kind, source.location)
        # a single file's component configs come from the hub at its load: not cached and no hub is one line
        # now, not in the trainer ~11 s after the launch (a dry run asks no hub: it says so)
        configs = single_file_configs(
            source.kind, family, cfg.model.config_dir, ask=not dry_run, where=cfg.model.path
        )
        if configs and model_note is None:
            model_note = f"model: warning: {configs}"
        if family is None:  # the plan (memory, resolution) is the family's: it was the default family's
            why = unknown or (
                f"a pickled checkpoint whose keys cannot be read without loading it: {info.unread}"
                if info.unread
                else "its files do not say it"
            )
            raise UsageError(
                f"model {cfg.model.path}: cannot tell its family here ({why})",
                fix=f"give it as model.family=FAMILY (one of: {', '.join(registry.PLANNED_FAMILIES)})",
            )
    except SdplanError as e:
        if dataset_error is not None:
            raise C.ConfigError("the dataset and the model", [str(dataset_error), str(e)]) from e
        raise
    if dataset_error is not None:
        raise dataset_error
    resolution = cfg.data.resolution
    if (
        planned_resolution
    ):  # as plan_request plans it: the model's own (SDXL 1024; an SD 2.x epsilon base 512)
        from sdplan.profiles import load_profiles

        models = load_profiles().models
        if family in models:
            resolution = models[family].resolution_for(info.prediction_type)
    buckets, sample_buckets = (), ()
    # as the trainer's dataset assigns them: the epoch's batches (each bucket ends short), at the resolution it
    # trains at (the plan's: SDXL's 1024 px buckets group the images otherwise than the config's default 512)
    if cfg.data.buckets:
        from sdplan.trainer.buckets import bucket_counts, config_buckets, sample_bucket_ids

        sizes, reps = [it.size for it in result.items], [it.repeats for it in result.items]
        sample_buckets = sample_bucket_ids(sizes, reps, config_buckets(cfg.data, resolution))
        buckets = bucket_counts(sample_buckets)  # bucket_samples' counts, the images assigned once
    return InputSummary(
        bucket_samples=buckets,
        sample_buckets=sample_buckets,
        prediction_type=info.prediction_type,
        revision=cfg.model.revision,
        hub_cached=info.cached,
        images=result.num_images,
        images_x_repeats=result.images_x_repeats,
        layout=result.format,
        skipped=len(result.skipped),
        model_kind=source.kind,
        family=family,
        scan_summary="; ".join(
            filter(
                None,
                (
                    result.summary(),
                    *result.notes,
                    uncaptioned_note(result, cfg),
                    metadata_note(result, cfg),
                    small_images_note(result, resolution, buckets=cfg.data.buckets),
                ),
            )
        ),
        # an SD3.5 / FLUX.1 single file: which encoders and VAE are its own, before minutes of loading
        model_notes=tuple(filter(None, (model_note, info.parts_note))),
    )


def check_model_file(path: Path) -> None:
    """A single-file model is a Stable Diffusion checkpoint, read from its first bytes (no torch): a
    .safetensors header that parses and holds UNet weights (``model.diffusion_model.*``), or a torch
    checkpoint (zip archive, or a legacy pickle). Anything else is one clear error before the launch."""
    import zipfile

    fix = "give a Stable Diffusion checkpoint (.safetensors or .ckpt), a diffusers folder or a hub id"
    try:
        with path.open("rb") as f:
            head = f.read(8)
            size = path.stat().st_size
            if path.suffix.lower() == ".safetensors":
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 2 <= n <= min(size - 8, 256 * 2**20):
                    raise UsageError(f"model.path {path}: not a safetensors file (no valid header)", fix=fix)
                try:
                    header = json.loads(f.read(n))
                except ValueError:
                    raise UsageError(
                        f"model.path {path}: not a safetensors file (header is not JSON)", fix=fix
                    ) from None
                if not isinstance(header, dict):
                    raise UsageError(f"model.path {path}: not a safetensors file", fix=fix)
                # SD3.5 / FLUX.1 transformer-only files (BFL's flux1-dev.safetensors) have no prefix.
                flow = ("joint_blocks.", "double_blocks.")
                if not any(k.startswith(("model.diffusion_model.", *flow)) for k in header):
                    lora = any("lora" in k for k in header)
                    raise UsageError(
                        f"model.path {path}: holds no Stable Diffusion UNet weights (model.diffusion_model.*)"
                        + (
                            "; it looks like a LoRA, which is applied to a base model, not trained from"
                            if lora
                            else ""
                        ),
                        fix=fix,
                    )
                return
    except OSError as e:
        raise UsageError(f"model.path {path}: cannot read it ({e.strerror or e})") from None
    # .ckpt/.pt/.pth/.bin: torch.save writes a zip archive (a pickle inside); old files are a bare pickle
    # (protocol 2+ starts with 0x80). Whether it holds only tensors is checked safely when it loads.
    if head.startswith(b"PK\x03\x04") and not zipfile.is_zipfile(path):  # a zip's end holds its directory
        raise UsageError(
            f"model.path {path}: a zip archive cut short or damaged (its end is missing)",
            fix="download or copy it again",
        )
    if not (zipfile.is_zipfile(path) or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)):
        raise UsageError(
            f"model.path {path}: not a PyTorch checkpoint (neither a zip archive nor a pickle)", fix=fix
        )
    # torch.save's archive holds <name>/data.pkl and <name>/version, as torch reads it
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                names = {n.split("/", 1)[-1] for n in z.namelist()}
        except (OSError, zipfile.BadZipFile) as e:
            raise UsageError(f"model.path {path}: a damaged zip archive ({e})", fix=fix) from None
        if not {"data.pkl", "version"} <= names:
            raise UsageError(
                f"model.path {path}: a zip archive but not a PyTorch checkpoint (no data.pkl and version)",
                fix=fix,
            )


def _family_of(kind: str, location: str) -> str | None:
    """The model family from a diffusers folder's config files, without loading weights; None when unknown
    (single files and hub ids: the trainer detects it when it loads the model)."""
    from sdplan.trainer.models import detect_family

    if kind != "folder":
        return None
    from sdplan.trainer.flow_models import flow_family_of_folder

    if (flow := flow_family_of_folder(location)) is not None:  # SD3.5 / FLUX.1: a transformer, no unet/
        return flow
    try:
        root = Path(location)
        index = json.loads((root / "model_index.json").read_text())
        unet = json.loads((root / "unet" / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return detect_family(unet, 2 if "text_encoder_2" in index else 1)


# -- device ----------------------------------------------------------------------------------------------------


def require_gpu(snapshot: Any, gpu_ids: tuple[int, ...] | None = None) -> None:
    """No usable GPU a run here trains on (or a CPU build of torch): stop before loading anything, and say how to
    go on. The GPUs are doctor's and the planner's (:func:`sdplan.probe.snapshot.trained_gpus`): a CUDA build's
    NVIDIA GPUs, never the AMD iGPU beside them."""
    from sdplan.probe.snapshot import build_vendor, findings, torch_cuda_lacks, trained_gpus

    gpus = trained_gpus(snapshot)
    if gpu_ids is not None:  # the GPUs the run launches on (a pin, the plan's): judged alone
        gpus = tuple(g for g in gpus if g.index in gpu_ids) or gpus
    if not gpus:
        raise NoGPUError(
            "no usable GPU on this machine (run `sdplan doctor` to see why)",
            fix="train on the CPU with --device cpu (slow), or try `sdplan train --demo`",
        )
    build = snapshot.software.torch_build
    if build == "cpu":
        raise NoGPUError(
            f"torch {snapshot.software.torch or ''} is a CPU build: it cannot use the "
            f"GPU{'s' if len(gpus) > 1 else ''} here".replace("  ", " "),
            fix="install the CUDA or ROCm build of torch (`sdplan doctor` prints the command), or add --device cpu",
        )
    if build_vendor(snapshot) not in (None, gpus[0].vendor):  # a CUDA build on AMD GPUs, ROCm on NVIDIA ones
        mismatch = next(f for f in findings(snapshot) if f.code == "torch_build_mismatch")
        raise NoGPUError(mismatch.message, fix=mismatch.fix)
    if (
        build == "cuda"
    ):  # a torch whose wheels hold no kernels for any GPU it trains on fails at its first call
        sw = snapshot.software
        if all(
            g.vendor == "nvidia" and torch_cuda_lacks(g.compute_capability, sw.torch, sw.cuda_runtime)
            for g in gpus
        ):
            lacking = next(f for f in findings(snapshot) if f.code == "torch_arch_unsupported")
            raise NoGPUError(lacking.message, fix=lacking.fix)
    if build == "rocm":
        # no kernels for the arch of a GPU it trains on: 'invalid device function' at the first call
        from sdplan.probe.snapshot import rocm_lacking

        if (lack := rocm_lacking(snapshot, gpus)) and (
            len(lack) == len(gpus) or gpu_ids is not None
        ):  # the run uses one the wheels have no kernels for (a plan leaves such a GPU out where others run)
            lacking = next(f for f in findings(snapshot) if f.code == "rocm_arch_unsupported")
            raise NoGPUError(
                f"{', '.join(f'GPU {g.index} ({g.name}, {g.gfx_arch})' for g in lack)}: outside the arches "
                "ROCm torch wheels ship kernels for: torch fails with 'invalid device function'",
                fix=lacking.fix,
            )


# -- step arithmetic -----------------------------------------------------------------------------------------


def config_plan_steps(
    cfg: C.TrainConfig, images_x_repeats: int, world: int, bucket_samples: tuple[int, ...] = ()
):
    """The run's :class:`sdplan.steps.Steps` (:func:`sdplan.steps.plan_steps`, as the trainer counts them);
    ``bucket_samples``: with aspect buckets, each bucket's samples (:class:`InputSummary`)."""
    t = cfg.training
    return plan_steps(
        images_per_epoch=images_x_repeats,
        batch_size=t.batch_size,
        grad_accum=t.grad_accum,
        num_processes=world,
        epochs=t.epochs,
        max_steps=t.max_steps,
        bucket_samples=bucket_samples,
    )


def config_steps(
    cfg: C.TrainConfig, images_x_repeats: int, world: int, bucket_samples: tuple[int, ...] = ()
) -> dict[str, int]:
    """The run's step counts (:func:`config_plan_steps`) for the user."""
    return config_plan_steps(cfg, images_x_repeats, world, bucket_samples).summary()


def describe(
    cfg: C.TrainConfig,
    steps: dict[str, int],
    world: int,
    inputs: InputSummary,
    *,
    max_steps_from_file: bool = True,
) -> list[str]:
    """The plan as lines for the user: what is trained, how, and the step arithmetic. ``max_steps_from_file``:
    training.max_steps came with the config (not --max-steps or a key=value), so what its epochs would train
    is worth a word where that differs."""
    t, m, ds = cfg.training, cfg.memory, cfg.distributed.deepspeed
    savers = [
        name
        for on, name in (
            (m.gradient_checkpointing, "gradient checkpointing"),
            (m.optimizer == "adamw8bit", "8-bit AdamW"),
            (m.cache_latents, "cached latents"),
            (m.cache_text_encoder_outputs, "cached text-encoder outputs"),
            (t.full_half_weights, f"full {t.precision} weights (no fp32 copy)"),
            (cfg.model.base_precision != "bf16", f"{cfg.model.base_precision} base weights"),
            (m.blocks_to_swap > 0, f"{m.blocks_to_swap} transformer blocks swapped to host RAM"),
            (
                ds is not None and ds.offload_optimizer,
                f"DeepSpeed ZeRO-{ds and ds.zero_stage} optimizer offload",
            ),
            # without offload: the optimizer state split over the processes (one process: nothing to split)
            (
                ds is not None and not ds.offload_optimizer,
                f"DeepSpeed ZeRO-{ds and ds.zero_stage} (optimizer state split over {world} process"
                + ("es)" if world > 1 else ")"),
            ),
        )
        if on
    ]
    device = "CPU" if t.device == "cpu" else f"{world} GPU" + ("s" if world > 1 else "")
    if t.device == "cpu" and world > 1:
        device = f"CPU, {world} processes (gloo)"
    lines = [
        f"{cfg.method} on {cfg.model.family or inputs.family or 'the model'} ({cfg.model.path})",
        *inputs.model_notes,
        f"data: {inputs.scan_summary}",
        f"device: {device}; precision {t.precision}; resolution {cfg.data.resolution}",
        f"batch: {t.batch_size} per process x {t.grad_accum} accumulation x {world} process"
        + ("es" if world > 1 else "")
        + f" = {count_of(steps['images_per_step'], 'image')} per optimizer step"
        + (
            f" (a batch holds at most {formed} images: "
            + ("its largest aspect bucket's" if len(inputs.bucket_samples) > 1 else "the epoch's")
            + ")"
            if (formed := largest_batch(t.batch_size, steps["images_per_epoch"], inputs.bucket_samples))
            < t.batch_size
            else ""
        ),
        f"memory savers: {', '.join(savers) if savers else 'none needed'}; optimizer {m.optimizer}",
    ]
    prior, class_images = C.prior_preservation(cfg)
    if prior and class_images:  # as recommend says it: the class images ride in each batch
        short = C.planned_sampling(cfg)["class_images_to_generate"]
        lines.append(
            f"prior preservation: {count_of(class_images, 'class image')} trained alongside, "
            f"{t.batch_size} in each batch beside the instance images (batch doubled)"
            + (f"; {short} the class folder lacks are generated before the first step" if short else "")
        )
    if t.max_steps:
        by_epochs = config_steps(
            replace(cfg, training=replace(t, max_steps=None)),
            steps["images_per_epoch"],
            world,
            inputs.bucket_samples,
        )
        lines.append(
            f"steps: training.max_steps {t.max_steps} / {count_of(world, 'process', 'processes')} = "
            f"{count_of(steps['total_steps'], 'optimizer step')} = "
            # where the steps stop inside an epoch with short batches, full batches are the most they can see
            + config_plan_steps(
                cfg, steps["images_per_epoch"], world, inputs.bucket_samples
            ).images_seen_text()
            # a planned count (recommend --out) for another dataset than this one trains another length
            + (
                f" ({count_of(by_epochs['epochs'], 'epoch')} of this dataset would be "
                f"{by_epochs['total_steps']} steps: training.max_steps=null trains by epochs)"
                if max_steps_from_file and by_epochs["total_steps"] != steps["total_steps"]
                else ""
            )
        )
    reaches_last_round = (
        steps["total_steps"] >= steps["steps_per_epoch"]
    )  # a max_steps run may stop before it
    repeats = reaches_last_round and repeated_batches(
        steps["images_per_epoch"], t.batch_size, world, inputs.bucket_samples
    )
    if not t.max_steps:
        n = len(inputs.bucket_samples)
        buckets = f" in {count_of(n, 'aspect bucket')} (each ends in a short batch)" if n > 1 else ""
        split = f"each epoch is split {world} ways"
        lines.append(
            f"steps: {count_of(steps['images_per_epoch'], 'image')} (with repeats){buckets} / "
            f"{steps['images_per_step']} per step = {count_of(steps['steps_per_epoch'], 'step')} per epoch x "
            f"{count_of(steps['epochs'], 'epoch')} = {count_of(steps['total_steps'], 'optimizer step')}; images seen "
            f"{steps['epochs'] * steps['images_per_epoch']}"
            + (
                f" ({split}, and some batches are trained again: see the note)"
                if repeats
                else f" (the same as on one process: {split})"
                if world > 1
                else ""
            )
        )
    if repeats:
        lines.append(
            f"note: the epoch's batches do not divide by {world} processes: "
            + repeated_batches_text(
                repeats,
                largest_batch(t.batch_size, steps["images_per_epoch"], inputs.bucket_samples),
                None if t.max_steps else steps["epochs"],
            )
        )
    return lines


# -- out-of-memory recovery ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    data: dict[str, Any]  # the new config, as data
    message: str  # what changed, for the user


def _smaller_batch(b: int) -> int:
    """The largest divisor of b that is at most half of it (b=4 -> 2, b=6 -> 3, b=3 -> 1)."""
    for d in range(b // 2, 0, -1):
        if b % d == 0:
            return d
    return 1


def after_oom(
    data: dict[str, Any],
    *,
    cuda: bool,
    have_bnb: bool,
    have_deepspeed: bool,
    resumes: bool = False,
    before_training: bool = False,
    largest: int | None = None,
) -> Change | None:
    """The next config after an out-of-memory error, with the same effective batch; None when nothing is left.

    First the micro-batch is halved and gradient accumulation doubled (same images per optimizer step). At a
    micro-batch of 1, the next memory saver in the planner's order: EMA weights to system RAM, gradient
    checkpointing (~20-30% slower), 8-bit AdamW (CUDA with bitsandbytes, not with DeepSpeed), cached latents,
    cached text-encoder outputs (frozen encoders only), full bf16 weights (a full-UNet method in bf16 on a GPU:
    the planner's fallback before offload, kohya --full_bf16), and last DeepSpeed ZeRO-2 with the optimizer
    state offloaded to CPU (the optimizer step on the CPU: the last resort; a plan's ZeRO-2 that splits the
    optimizer state over the GPUs offloads it then).

    ``resumes``: the retry resumes a checkpoint; the savers it could not be loaded with (8-bit AdamW's other
    optimizer state, DeepSpeed turned on: :func:`unloadable_change`) are passed over.

    ``before_training``: it ran out before the first step (loading and placing the models, the caption pass,
    DeepSpeed's engine): only the savers that change what setup holds are tried (the EMA copy, the text
    encoders leaving the GPU, bf16 weights, DeepSpeed offload); a smaller batch, checkpointing, 8-bit AdamW's
    state (made at the first step) and the latent cache change nothing there, and each retry reloads the models.

    ``largest``: the largest micro-batch the trainer forms (:func:`sdplan.steps.largest_batch`): 64 over 20
    images is a batch of 20, and halving 64 to 32 changed nothing; it is halved from what ran.
    """
    new = json.loads(json.dumps(data))  # deep copy of plain data
    t = new.setdefault("training", {})
    m = new.setdefault("memory", {})
    dist = new.setdefault("distributed", {})
    b = int(t.get("batch_size", 1))
    ga = int(t.get("grad_accum", 1))
    ran = min(b, largest) if largest else b  # the micro-batch the trainer formed
    if ran > 1 and not before_training:
        # a divisor keeps the images per step; where the formed batch is a bucket's (a prime 13), half of it
        nb = _smaller_batch(ran) if ran == b else (ran + 1) // 2
        t["batch_size"] = nb
        t["grad_accum"] = ga * -(-ran // nb)
        return Change(
            new,
            f"micro-batch {b} -> {nb}, gradient accumulation {ga} -> {t['grad_accum']} "
            + (
                f"(still {ran * ga} images per optimizer step per process)"
                if ran == b
                else f"(a batch held at most {ran} images; up to {nb * t['grad_accum']} per optimizer step per "
                "process now)"
            ),
        )
    ema = new.get("ema") or {}
    if ema.get("enabled") and ema.get("device", "cpu") == "gpu":
        ema["device"] = "cpu"
        return Change(new, "moved the EMA weights to system RAM (ema.device=cpu)")
    if not m.get("gradient_checkpointing", False) and not before_training:
        m["gradient_checkpointing"] = True
        return Change(new, "turned on gradient checkpointing (less activation memory, ~20-30% slower)")
    deepspeed_on = dist.get("deepspeed") is not None
    eight_bit = cuda and have_bnb and not deepspeed_on and not resumes and not before_training
    if eight_bit and m.get("optimizer", "adamw") == "adamw":
        m["optimizer"] = "adamw8bit"
        return Change(new, "switched to 8-bit AdamW (optimizer state ~75% smaller)")
    if not m.get("cache_latents", False) and not before_training:
        m["cache_latents"] = True
        return Change(new, "turned on latent caching (the VAE encodes once and leaves the GPU)")
    frozen_te = not t.get("train_text_encoder", False) and new.get("method") != "textual-inversion"
    if frozen_te and not m.get("cache_text_encoder_outputs", False):
        m["cache_text_encoder_outputs"] = True
        return Change(new, "turned on text-encoder output caching (the frozen text encoders leave the GPU)")
    full_bf16 = new.get("method") in FULL_METHODS and t.get("precision") == "bf16"
    # not on a resume: an fp32 checkpoint's weights and state are not loaded as bf16 (settings.STATE_SETTINGS)
    if cuda and full_bf16 and not deepspeed_on and not resumes and not t.get("full_half_weights", False):
        t["full_half_weights"] = True
        return Change(
            new, "switched to full bf16 weights and gradients (no fp32 master copy; kohya --full_bf16)"
        )
    # a DeepSpeed config without the key offloads (config.DeepSpeedConfig's default)
    offloaded = deepspeed_on and dist["deepspeed"].get("offload_optimizer", True)
    # not with block swap (the trainer swaps in one process without DeepSpeed: blockswap.support_problem), and
    # before training only for a full-weight method, whose optimizer state DeepSpeed builds in setup
    can_offload = not m.get("blocks_to_swap") and (new.get("method") in FULL_METHODS or not before_training)
    # not on a resume: a checkpoint without offload holds torch's AdamW state, which DeepSpeed's CPU Adam cannot
    # load (KeyError 'bias_correction' at the first step), and one without DeepSpeed no DeepSpeed state at all
    if have_deepspeed and can_offload and not offloaded and not resumes:
        was_split = deepspeed_on  # ZeRO-1/2 splitting the optimizer state over the GPUs: offload it too
        stage = int(dist["deepspeed"].get("zero_stage", 2)) if was_split else None
        dist["deepspeed"] = dict(OFFLOAD)
        # bitsandbytes does not combine with DeepSpeed, and the offload runs DeepSpeed's CPU Adam in Adafactor's
        # place (sdplan.config): AdamW, said
        replaced = {"adamw8bit": "8-bit AdamW", "adafactor": "Adafactor"}.get(m.get("optimizer", "adamw"))
        if replaced:
            m["optimizer"] = "adamw"
        t["full_half_weights"] = False  # DeepSpeed keeps fp32 master weights of its own (offloaded here)
        return Change(
            new,
            (
                f"offloaded the split optimizer state of DeepSpeed ZeRO-{stage} to CPU"
                + (" (ZeRO-2 offload)" if stage != 2 else "")
                if was_split
                else "turned on DeepSpeed ZeRO-2 with the optimizer state offloaded to CPU"
            )
            + " (slower: the optimizer runs on the CPU"
            + (
                f"; AdamW in place of {replaced}, as the offload runs DeepSpeed's CPU Adam"
                if replaced
                else ""
            )
            + ")",
        )
    return None


def oom_point(
    cfg: C.TrainConfig,
    oom: dict[str, Any],
    *,
    family: str,
    gpu_name: str | None,
    gpu_memory_bytes: int | None,
    when: _dt.datetime,
    fits: bool = False,
    peak_bytes: int | None = None,
) -> dict[str, Any]:
    """A method point for the local profile store (profiles/methods schema): what ran out of memory on this
    GPU (or, with fits=True, what then fit), with its provenance."""
    from sdplan.profiles import point_record

    t, m = cfg.training, cfg.memory
    batch = int(oom.get("batch_size", t.batch_size)) if not fits else t.batch_size
    accum = int(oom.get("grad_accum", t.grad_accum)) if not fits else t.grad_accum
    gc = (
        bool(oom.get("gradient_checkpointing", m.gradient_checkpointing))
        if not fits
        else m.gradient_checkpointing
    )
    stamp = when.strftime("%Y-%m-%dT%H:%M:%S")
    gpu_label = gpu_name or "cpu"
    outcome: dict[str, Any] = {"fits": fits}
    if fits and peak_bytes:
        outcome["peak_vram_gib"] = round(peak_bytes / 2**30, 3)
    if fits:
        source = f"sdplan train on this machine ({gpu_label}), {stamp}: ran to the end after an out-of-memory retry"
    else:
        source = (
            f"sdplan train on this machine ({gpu_label}), {stamp}: out of memory at step {oom.get('step')} "
            f"({str(oom.get('message', 'CUDA out of memory'))[:160]})"
        )
    settings = Settings.from_config(
        cfg, model=family, batch=batch, grad_accum=accum, gradient_checkpointing=gc
    )
    return point_record(
        settings,
        id=f"observed-{'fit' if fits else 'oom'}-{_slug(gpu_label)}-{stamp}-b{batch}",
        gpu=gpu_name,
        gpu_memory_bytes=gpu_memory_bytes,
        outcome=outcome,
        source=source,
    )


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def record_point(point: dict[str, Any], method: str, store: Path) -> Path:
    """Append a point to ``{store}/methods/observed-{method}.yaml`` (the local profile store that the planner
    reads beside the shipped profiles; :func:`sdplan.profiles.write_points`)."""
    from sdplan.profiles import write_points

    header = "# Observed by `sdplan train` on this machine (out-of-memory errors and what fit after them).\n"
    return write_points(store, method, [point], header=header, file_name=f"observed-{method}", replace=False)


# -- writing the run folder ------------------------------------------------------------------------------------


def command_line(req: TrainRequest, out: Path) -> str:
    """The header of the written sdplan.yaml: how to run this config again."""
    return f"sdplan train --config {shlex.quote(str(out / CONFIG_FILE))} --out {shlex.quote(str(out))}"


def plan_chart_png(p: Prepared) -> bytes | None:
    """plan.png of the plan this run trains, as `sdplan recommend --out` draws it (None: it did not plan)."""
    if p.planned is None:
        return None
    from sdplan import plan_chart
    from sdplan.profiles import load_profiles

    return plan_chart.render_png(plan_chart.chart_data(p.planned, load_profiles()))


def _drop_stale_plan_chart(out: Path) -> None:
    """The plan.png sdplan drew for a config an out-of-memory retry has since rewritten: it no longer shows what
    runs, so it goes (a user's own file of that name is left alone)."""
    from sdplan import runfolder

    if PLAN_CHART_FILE in runfolder.owned(out):
        (out / PLAN_CHART_FILE).unlink(missing_ok=True)


def run_files(
    cfg: C.TrainConfig, launch: Launch, header: str, chart: bytes | None = None
) -> dict[str, str | bytes]:
    """The files a run writes at the top of its folder before the launch: name -> text (or bytes: the plan's
    chart, when this run planned)."""
    files: dict[str, str | bytes] = {CONFIG_FILE: C.to_yaml(cfg, header=header)}
    if launch.accelerate_config is not None:
        files[ACCELERATE_FILE] = yaml.safe_dump(launch.accelerate_config, sort_keys=False)
    if launch.deepspeed_config is not None:
        files[DEEPSPEED_FILE] = json.dumps(launch.deepspeed_config, indent=2) + "\n"
    if chart is not None:
        files[PLAN_CHART_FILE] = chart
    return files


def check_run_files(out: Path, files: dict[str, str | bytes]) -> None:
    """Never write over a user's sdplan.yaml / accelerate.yaml / deepspeed.json: one sdplan wrote (the
    manifest lists it) is rewritten, one already holding these bytes is left as it is, any other refused."""
    from sdplan import runfolder

    runfolder.check_not_ours(
        out,
        files,
        fix=f"train it into another folder: --config stays where it is, --out NEW (this run writes {CONFIG_FILE} "
        "there with the settings it trains)",
    )


def write_run_files(
    out: Path, cfg: C.TrainConfig, launch: Launch, header: str, chart: bytes | None = None
) -> tuple[list[Path], list[Path]]:
    """The run files written (:func:`run_files`), and the copies kept of those the user had edited."""
    from sdplan import runfolder

    files = run_files(cfg, launch, header, chart)
    check_run_files(out, files)
    # an earlier plan's, if this has none: its DeepSpeed config; its chart where the run's plan record was dropped
    # (a plan folder trained with other settings on the CPU: the chart showed the GPU plan it no longer runs)
    retire = [DEEPSPEED_FILE] + ([PLAN_CHART_FILE] if cfg.plan is None else [])
    return runfolder.write_files(out, files, retire=retire)


def check_out_not_in_dataset(out: Path, dataset: str) -> None:
    """UsageError for a run folder inside the dataset folder (`train --out`, `recommend --out`): the next run
    would train on this run's outputs."""
    if _inside(out, Path(dataset).expanduser()):
        raise UsageError(
            f"--out {out} is inside the dataset folder {dataset}: the next run would train on this run's outputs",
            fix="choose an output folder outside the dataset",
        )


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except (OSError, ValueError):
        return False
    return folder.is_dir()


def checkpoint_step(
    last: Path, cfg: C.TrainConfig, inputs: InputSummary, world: int
) -> tuple[int, Any] | None:
    """(the step checkpoint ``last`` stands at in this run's steps, its TrainState), or None where its state
    cannot be read: :func:`sdplan.steps.moved_position` where it was saved with another micro-batch,
    accumulation or process count, as the trainer places it: at a micro-batch in the checkpoint's order of
    images (trainer/buckets.py) by the batches its images make whole, short ones too, from the epoch's order,
    which the trainer's sampler gives from each sample's bucket and the seed (counted in full batches, it stood
    up to a batch per aspect bucket earlier than the trainer, and the guards let a resume past the run's end
    through)."""
    from sdplan.trainer.buckets import BucketBatchSampler
    from sdplan.trainer.checkpoint import CheckpointError, TrainState, read_state, resume_position

    try:
        saved = read_state(last)
    except CheckpointError:
        return None
    t = cfg.training
    buckets = inputs.bucket_samples
    new = config_plan_steps(cfg, inputs.images_x_repeats, world, buckets or ())
    epoch_batches = bucketed_batches(
        buckets or (inputs.images_x_repeats,), t.batch_size
    )  # one process's list
    live = TrainState(batch_size=t.batch_size, grad_accum=t.grad_accum, num_processes=world)
    # the trainer's order of the epoch (trainer/runtime.py make_loader), in the checkpoint's order batch where
    # this micro-batch divides it
    order = BucketBatchSampler(
        inputs.sample_buckets or (0,) * inputs.images_x_repeats, t.batch_size, seed=t.seed
    )
    order.keep_order(saved.order_batch_size)
    moved = resume_position(saved, live, new, epoch_batches, order)  # None: saved with these settings
    return (saved.global_step if moved is None else moved.step), saved


def _asked(cfg: C.TrainConfig) -> str:
    t = cfg.training
    return f"training.max_steps {t.max_steps}" if t.max_steps else count_of(t.epochs, "epoch")


def refuse_a_shortened_resume(
    last: Path,
    placed: tuple[int, Any],
    cfg: C.TrainConfig,
    inputs: InputSummary,
    world: int,
    steps: dict[str, int],
    saved_config: Any = None,
) -> None:
    """UsageError for --resume with a length (--max-steps, --epochs, training.max_steps) shorter than what the
    newest checkpoint already trained: the trainer found nothing left to do and exported the longer-trained
    weights with metadata that said the shorter run, without a word. ``saved_config``: the run's sdplan.yaml
    (validated); where it already holds this length (a shorter resume that finished), the fix does not offer
    a plain --resume, which is refused as finished. ``last``: the newest checkpoint, ``placed``: where it stands
    in this config's steps, and its state (:func:`checkpoint_step`)."""
    at, saved = placed
    total = steps["total_steps"]
    if at <= total:
        return
    own = None  # the steps the run's own sdplan.yaml asks for, where a plain --resume has none left either
    if saved_config is not None:
        length = {"max_steps": saved_config.training.max_steps, "epochs": saved_config.training.epochs}
        own_cfg = replace(cfg, training=replace(cfg.training, **length))
        own = config_steps(own_cfg, inputs.images_x_repeats, world, inputs.bucket_samples)["total_steps"]
        own = own if at >= own else None
    raise UsageError(
        f"--resume: its newest checkpoint {last.name} already trained {at} steps ({saved.images_seen} images), "
        f"more than the {total} this config asks for ({_asked(cfg)}): there is nothing left to train, and its "
        "outputs would be the longer-trained weights",
        fix=(
            f"the run's {CONFIG_FILE} asks for {own} steps, which it has trained: to train longer, resume with "
            "more (--epochs N or training.max_steps=N); to train "
            if own is not None
            else "resume without the shorter --max-steps/--epochs to finish the run; to train "
        )
        + f"{total} steps, start it over with --force instead of --resume",
    )


def refuse_a_start_past_its_length(
    path: Path, cfg: C.TrainConfig, inputs: InputSummary, world: int, steps: dict[str, int]
) -> None:
    """UsageError for a new run from the checkpoint ``path`` (``checkpoints.resume``) that already trained as
    many steps as this run asks for, or more: the trainer found nothing left to do and exported that
    checkpoint's weights as a run of this length ("done: 12 steps" of an 8-step run), without a word."""
    if (found := checkpoint_step(path, cfg, inputs, world)) is None:
        return
    at, saved = found
    total = steps["total_steps"]
    if at < total:
        return
    more = "more than" if at > total else "as many as"
    raise UsageError(
        f"checkpoints.resume {path} already trained {at} steps ({saved.images_seen} images), {more} the "
        f"{total} this run asks for ({_asked(cfg)}): there is nothing left to train",
        fix="ask for more steps (--epochs N or training.max_steps=N), or start from an earlier checkpoint",
    )


def refuse_a_finished_resume(
    out: Path, placed: tuple[int, Any], cfg: C.TrainConfig, world: int, steps: dict[str, int]
) -> None:
    """UsageError for --resume of a run that is done: its newest checkpoint stands at the last of this config's
    steps (``steps``: :func:`config_steps`; placed as the trainer places it, :func:`checkpoint_step`), and its
    summary and every output it lists are there. The trainer would load the model, cache the latents, train
    nothing and write the same outputs again (minutes for a large model). A run stopped between its last
    checkpoint and its outputs still resumes. (Compared by images, a bucketed run cut by training.max_steps,
    whose short batches see fewer images than full ones would, was started again.) ``placed``: where the newest
    checkpoint stands in this config's steps, and its state (:func:`checkpoint_step`)."""
    summary = read_json(out / SUMMARY_FILE)
    if summary is None:
        return
    done = placed[1].images_seen
    listed = summary.get("outputs") if isinstance(summary.get("outputs"), list) else []
    outputs = summary_outputs(summary, out)
    if (
        placed[0] < steps["total_steps"]
        or summary.get("images_seen") != done
        or len(outputs) != len(listed)  # an entry that is not a path: not provably all there
        or not all(o.exists() for o in outputs)
    ):
        return
    raise UsageError(
        f"--resume: the run in {out} is finished: its newest checkpoint stands at step {placed[0]}"
        + (" of the " if placed[0] == steps["total_steps"] else ", past the ")
        + f"{steps['total_steps']} this config asks for ({_asked(cfg)} on {count_of(world, 'process', 'processes')}; "
        f"{done} images trained), and it wrote its outputs",
        fix="to train longer, resume with more: --epochs N or training.max_steps=N; to train again from the "
        "start, --force instead of --resume",
    )


def finished_without_checkpoints(out: Path, saved: C.TrainConfig) -> None:
    """--resume of a run that finished with checkpoints off (its own sdplan.yaml ``saved`` says so, its
    run_summary.json says it finished) and left no checkpoint: nothing was kept to continue or extend it from.
    "no checkpoint ... add --force" read as a way to extend it, and --force throws the finished run away:
    refused with what the choices are."""
    summary = read_json(out / SUMMARY_FILE)
    if summary is None or saved.checkpoints.every_steps or saved.checkpoints.keep_every_steps:
        return
    steps, images = summary.get("steps"), summary.get("images_seen")
    done = f" ({steps} steps, {images} images)" if isinstance(steps, int) and isinstance(images, int) else ""
    config = shlex.quote(str(out / CONFIG_FILE))
    raise UsageError(
        f"--resume: the run in {out} finished{done} with checkpoints off (checkpoints.every_steps=0): no "
        "training state was kept to continue or extend it from",
        fix="to train longer, train from the start with more epochs, in a new folder: `sdplan train --config "
        f"{config} --out NEW_DIR --epochs N`, or in this one with --force instead of --resume, which replaces "
        "the finished run's outputs; with checkpoints.every_steps=N set, a run can be extended later",
    )


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# -- the whole command ----------------------------------------------------------------------------------------


@dataclass
class Prepared:
    cfg: C.TrainConfig
    out: Path
    inputs: InputSummary
    world: int
    steps: dict[str, int]
    snapshot: Any = None
    plan: dict[str, Any] | None = None
    resume: str | None = None
    state: str = "new"
    planned: Any = None  # the planner's Result this run trains, when it planned (drawn as plan.png at launch)
    gpu_ids: tuple[int, ...] | None = None  # the GPUs this machine's processes run on (run_gpus)
    devices: dict[str, str] | None = None  # the environment that shows them only those (None: every GPU)


def check_stack() -> None:
    """A package older than sdplan needs (or missing) fails mid-run with an error that names neither: say so
    before anything is written."""
    from sdplan.probe.software import requirement_notes

    if unmet := [f for f in requirement_notes() if f.severity == "error"]:
        more = f"; {len(unmet) - 1} more in `sdplan doctor`" if len(unmet) > 1 else ""
        raise SdplanError(unmet[0].message, fix=unmet[0].fix + more)


# The flags that set an sdplan.yaml key (flag_overrides), by key
FLAG_KEYS = {
    "method": "--method",
    "model.path": "--model",
    "data.path": "--dataset",
    "data.resolution": "--resolution",
    "training.epochs": "--epochs",
    "training.max_steps": "--max-steps",
    "training.device": "--device",
    "distributed.num_processes": "--num-processes",
    "output.dir": "--out",
}


def settings_as_flags(req: TrainRequest) -> TrainRequest:
    """A key=value setting that a flag also sets must agree with the flag (the setting won, without a word:
    `--epochs 5 training.epochs=20` trained 20); ``output.dir=DIR`` alone is ``--out DIR``, so the --out rule
    checks the folder the run writes to (it checked the config's folder and the run went to DIR)."""
    given = C.given_settings(req.overrides)
    for key, flag in FLAG_KEYS.items():
        attr = flag.removeprefix("--").replace("-", "_")
        mine, theirs = getattr(req, "out" if key == "output.dir" else attr, None), given.get(key)
        if mine is None or theirs is None:
            continue
        if C.setting_place(key, mine, flag) != C.setting_place(key, theirs, key):
            raise UsageError(f"{flag} {mine} and {key}={theirs.strip()} disagree", fix="give one")
    if (
        req.out is None
        and "output.dir" in given
        and (out := C.setting_value("output.dir", given["output.dir"]))
    ):
        C.absolute(str(out), "output.dir")  # a link that loops is named as the user gave it, not as --out
        return replace(req, out=str(out))
    return req


# What `sdplan train` writes into a run's sdplan.yaml from its flags and the machine (--out, --device, fp32 on
# the CPU, the processes of --num-machines): a plan's sdplan.yaml that started the run differs there only
TRAIN_OWNED = ("output.dir", "training.device", "training.precision", "distributed.num_processes")


def config_differs(config_path: Path, out: Path) -> str | None:
    """None where the config file ``config_path`` is the run's own ``out/sdplan.yaml``, or holds the same
    settings (validated, paths absolute as the current folder reads them; its ``plan:`` record and what
    `sdplan train` rewrites, :data:`TRAIN_OWNED`, aside); else what differs, in a few words."""
    own = out / CONFIG_FILE
    if _same_file(config_path, own):
        return None
    if not own.is_file():
        return None  # check_out_dir says what the folder lacks

    def settings(path: Path) -> dict[str, Any]:
        data = config_file_data(path)
        data.pop("plan", None)
        for key in TRAIN_OWNED:
            section, _, name = key.partition(".")
            data.get(section, {}).pop(name, None)
        return data

    try:
        given, run = settings(config_path), settings(own)
    except SdplanError:
        return "its settings are not the run's"
    key = _first_difference(given, run)
    if key is None:
        return None
    return f"its {key} is {get_key(given, key)!r}, the run's {get_key(run, key)!r}"


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The first dotted key at which the nested dicts ``a`` and ``b`` differ, or None where they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if (found := _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")) is not None:
                return found
        return None
    return None if a == b else prefix.rstrip(".")


def resume_command(req: TrainRequest, out: Path) -> str:
    """The `sdplan train --resume --out OUT` line for ``req`` without its --config, keeping its other flags and
    key=value settings (--epochs N, --max-steps, ...)."""
    words = ["sdplan", "train", "--resume", "--out", str(out)]
    for flag, value in (
        ("--epochs", req.epochs),
        ("--max-steps", req.max_steps),
        ("--resolution", req.resolution),
        ("--gpus", req.gpus),
        ("--device", req.device),
        ("--num-processes", req.num_processes),
    ):
        if value is not None:
            words += [flag, str(value)]
    if req.num_machines != 1:
        words += ["--num-machines", str(req.num_machines), "--machine-rank", str(req.machine_rank)]
        if req.main_process_ip:
            words += ["--main-process-ip", req.main_process_ip]
        if req.main_process_port is not None:
            words += ["--main-process-port", str(req.main_process_port)]
    words += [
        flag
        for flag, on in (("--yes", req.yes), ("--dry-run", req.dry_run), ("--no-plan", req.no_plan))
        if on
    ]
    return " ".join(shlex.quote(w) for w in [*words, *req.overrides])


def force_reads_run_config(req: TrainRequest) -> TrainRequest:
    """`sdplan train --force --out DIR` with no --model/--dataset/--config starts the run in DIR over with its
    own sdplan.yaml, as ``--config DIR/sdplan.yaml --out DIR --force`` does: what every "--force instead of
    --resume" hint says (it was '--model and --dataset missing'), --resume reading the same file."""
    if not req.force or req.resume or req.demo or req.config or req.model or req.dataset or not req.out:
        return req
    config = Path(C.absolute(req.out, "--out")) / CONFIG_FILE
    return replace(req, config=str(config)) if req.config_data is None and config.is_file() else req


def prepare(req: TrainRequest, ui: UI) -> Prepared:
    """Everything before the launch: config, --out rule, inputs, device, plan. No model loads here."""
    req = force_reads_run_config(settings_as_flags(req))
    # 1. Where the run lives and which config it starts from.
    config_path = Path(C.expand_user(req.config, "--config")) if req.config else None
    if req.resume:
        if req.out is None and config_path is None:
            raise UsageError(
                "--resume needs the run's folder: --out has no default with --resume",
                fix="add --out DIR (--out ./output for a run started without --out)",
            )
        if req.force:  # else --force was ignored: the user may have meant to start over
            raise UsageError(
                "--resume continues the run and --force starts it over", fix="give one of them, not both"
            )
        if req.method or req.model or req.dataset:
            raise UsageError(
                "--resume continues the run as configured in its sdplan.yaml",
                fix="drop --method/--model/--dataset; change settings with key=value overrides",
            )
    out_given = C.absolute(req.out, "--out") if req.out else None

    if req.resume:
        from sdplan.runfolder import check_free

        # the run folder: --out, else the output.dir of --config; what resumes is always that folder's own
        # sdplan.yaml (comparing --config with itself passed every resume check, and the run's file was
        # overwritten with the edited one)
        out = out_given or config_output_dir(config_path, read_yaml_config(config_path))
        check_free(out)  # a live run in it: say who, not what its half-written files look like
        check_out_dir(out, resume=True)  # an sdplan run, before its config is read
        # a --config whose settings are the run's own (the plan's sdplan.yaml that started it, a copy) resumes
        # as --resume --out does; another one is refused, naming what differs (dropped without a word, the run's
        # own sdplan.yaml resumed and the --config file was never used)
        if config_path is not None and (differs := config_differs(config_path, out)) is not None:
            where = f"--out {req.out}" if req.out else f"{out} (the output.dir of --config {req.config})"
            raise UsageError(
                f"--resume continues the run in {where} with its own "
                f"{CONFIG_FILE}; --config {req.config} is not used with it: {differs}",
                fix=f"resume with `{resume_command(req, out)}` (change settings with key=value overrides), or "
                "train that config in another folder without --resume",
            )
        base_path = out / CONFIG_FILE
        base = read_yaml_config(base_path)
        source = str(base_path)
    elif req.config_data is not None:
        base, source = req.config_data, "demo config"
        out = out_given or Path(base["output"]["dir"]).resolve()
    elif config_path is not None:
        base = read_yaml_config(config_path)
        source = str(config_path)
        out = out_given or config_output_dir(config_path, base)
    else:
        if not req.model or not req.dataset:
            missing = " and ".join(
                f for f, v in (("--model", req.model), ("--dataset", req.dataset)) if not v
            )
            raise UsageError(
                f"{missing} missing",
                fix="sdplan train --method lora --model PATH_OR_ID --dataset DIR, or --config sdplan.yaml, "
                "or try --demo",
            )
        base = C.default_config()
        base["method"] = req.method or "lora"
        source = "command line"
        out = out_given or C.absolute("./output", "output.dir")

    # 2. The config validates (unknown keys, wrong types) before anything else is looked at.
    cfg = _validate_given(base, req, out, source)

    # 3. The --out rule (the demo checked it before building its model and dataset there).
    from sdplan.runfolder import check_free

    if not req.demo:
        check_free(out)
    state = (
        "new" if req.demo else check_out_dir(out, resume=req.resume, force=req.force, config_path=config_path)
    )

    # 4. --resume needs a checkpoint.
    resume = None
    if req.resume:
        from sdplan.trainer.checkpoint import checkpoint_root, latest_checkpoint, resolve_resume

        if latest_checkpoint(out) is None and is_plan(out):
            raise UsageError(
                f"--resume: {out} holds a plan (sdplan recommend --out), not a run: nothing to resume",
                fix=f"train the plan with `sdplan train --config {out / CONFIG_FILE}`",
            )
        if latest_checkpoint(out) is None:
            finished_without_checkpoints(out, C.validate(base, source=source))
            raise UsageError(
                f"--resume: no checkpoint in {checkpoint_root(out)}",
                fix="start the run again without --resume (add --force to reuse the folder)",
            )
        # the trainer's own check, before anything is written: every checkpoint damaged was refused by the
        # trainer after the run's sdplan.yaml had taken the new settings (sizes and sha256, sampled above 2 GiB)
        found = resolve_resume("latest", out, say=lambda line: None)  # the trainer says which it skips
        resume = "latest"
        saved = C.validate(base, source=source)
        check_resume_choice(saved, cfg, out)
        check_resume_settings(saved, cfg, family=_recorded_family(found))
    else:
        check_start_checkpoint(cfg, out, clears=state == "run")

    # 5. The inputs exist and hold something, and the run folder is not among them.
    if not req.demo:
        check_out_not_in_dataset(out, cfg.data.path)
    if cfg.training.device == "cpu" and req.gpus is not None:
        raise UsageError(
            "--gpus counts GPUs; this run is on the CPU", fix="drop --gpus, or use --num-processes N"
        )
    if sys.version_info < (3, 11) and any((Path.cwd() / n).exists() for n in ("sdplan", "sdplan.py")):
        raise UsageError(
            f"the current folder {Path.cwd()} holds `sdplan`, which Python 3.10 would import instead of sdplan",
            fix="run sdplan from another folder (Python >= 3.11 ignores the current folder)",
        )
    planned_resolution = (  # as step 7 plans (on a GPU, no resolution given), before the device is probed
        not (
            req.resume
            or req.config
            or req.config_data is not None
            or req.no_plan
            or req.resolution is not None
        )
        and "data.resolution" not in C.override_keys(req.overrides)
        and cfg.training.device != "cpu"
    )
    inputs = (
        req.inputs
        if req.inputs is not None
        else check_inputs(cfg, dry_run=req.dry_run, planned_resolution=planned_resolution)
    )
    if inputs.layout == "kohya" and "data.repeats" in (given := C.given_settings(req.overrides)):
        # as recommend says it: the trainer counts each N_name folder's own repeats (dataset_scan)
        ui.echo(
            f"note: data.repeats={given['data.repeats'].strip()} is not used: kohya folder names carry the "
            "repeats (rename a folder's N_ to change its own)"
        )
    if C.prior_preservation(cfg) == (True, 0):  # every image of dreambooth.class_data: it must hold some
        C.require_class_images(cfg)

    # 6. The device.
    snapshot = None
    if cfg.training.device != "cpu":
        from sdplan.probe.snapshot import probe

        snapshot = req.snapshot or probe(str(out.parent if not out.exists() else out))
        require_gpu(snapshot)
        have = len(trained_gpus(snapshot))
        if req.gpus is not None and req.gpus > have:
            raise UsageError(f"--gpus {req.gpus}: this machine {gpus_here(snapshot)}")
        from sdplan.probe.snapshot import runnable_gpus

        runs = runnable_gpus(snapshot)
        if req.gpus is not None and req.gpus > len(runs):
            lack = [g for g in trained_gpus(snapshot) if g not in runs]
            raise UsageError(
                f"--gpus {req.gpus}: this machine trains on {count_of(len(runs), 'GPU')}; "
                + ", ".join(f"GPU {g.index} ({g.name}, {g.gfx_arch})" for g in lack)
                + " is outside the arches the ROCm torch wheels ship kernels for",
                fix=f"use --gpus {len(runs)}, or see `sdplan doctor` for the override that runs it",
            )
    elif cfg.training.precision == "fp16":
        # fp16 autocast is a GPU feature: the trainer would train in fp32, and the run's sdplan.yaml says so.
        cfg = replace(cfg, training=replace(cfg.training, precision="fp32"))
        asked = any(o.partition("=")[0].strip() == "training.precision" for o in req.overrides) or (
            source != "command line" and "precision" in (base.get("training") or {})
        )
        if asked:  # else the default's: the plan line's fp32 says it
            ui.echo(
                "note: training.precision fp16 needs a GPU; this CPU run trains (and its sdplan.yaml says) fp32"
            )

    # 7. The plan (as `sdplan recommend`), unless a config was given to train as it is.
    stale = None
    if config_path is not None and not req.resume and cfg.plan:
        cfg, stale = drop_a_stale_plan(cfg, base, source, req, inputs)
    plan_result, planned = None, None
    planning = (
        not (req.resume or req.config or req.config_data is not None or req.no_plan) and snapshot is not None
    )
    if planning:
        from sdplan.planner import result_dict

        result = plan_request(cfg, inputs, snapshot, req)
        chosen = result.plan
        plan_result = result_dict(result)
        planned = result
        if chosen.optimizer == "adamw8bit" and not importable("bitsandbytes"):
            chosen = replace(chosen, optimizer="adamw")
            ui.echo(
                "note: the plan uses 8-bit AdamW but bitsandbytes is not installed: AdamW instead "
                f"({install_hint('bnb')} for the planned optimizer; out of memory is retried smaller)"
            )
        settings = plan_settings(chosen, plan_result, num_machines=req.num_machines)
        cfg = C.validate(config_data(base, req, out, plan=settings), source=source)
    elif stale and snapshot is not None and req.num_machines == 1 and not req.no_plan:
        # the config's own settings, changed from its plan: checked for fit as recommend checks pins, every
        # setting pinned (one that cannot fit is one line here, saying by how much and what fits)
        from sdplan.planner import result_dict

        ui.echo(f"note: {stale}; planned again with every setting as given")
        planned = plan_request(cfg, inputs, snapshot, req, every_setting=True)
        plan_result = result_dict(planned)
        cfg.plan = plan_result
    elif snapshot is not None and req.num_machines > 1 and req.gpus is None and not req.resume:
        # A config written for one machine: its num_processes are this machine's GPUs.
        per_node = cfg.distributed.num_processes
        cfg = C.validate(
            C.apply_overrides(cfg.to_dict(), [f"distributed.num_processes={per_node * req.num_machines}"]),
            source=source,
        )
    if stale and planned is None:
        ui.echo(f"note: {stale}; whether these settings fit is not checked here")

    world = cfg.distributed.num_processes
    per_node = world // max(1, req.num_machines)
    ds = cfg.distributed.deepspeed
    if ds is not None and not ds.offload_optimizer and world == 1 and not req.resume:
        # as the planner refuses the pin (planner.pin_conflicts): a config given as it is, the same rule
        from sdplan.planner import zero_alone

        what, fix = zero_alone(ds.zero_stage, "one process")
        raise UsageError(what, fix=fix)
    if snapshot is not None and per_node > len(trained_gpus(snapshot)):
        raise UsageError(
            f"distributed.num_processes {world} needs {per_node} GPUs per machine; this machine {gpus_here(snapshot)}",
            fix="lower distributed.num_processes (or --gpus)",
        )
    gpu_ids = (
        run_gpus(cfg, snapshot, per_node, num_machines=req.num_machines) if snapshot is not None else None
    )
    if snapshot is not None and snapshot.usable_gpus:
        refuse_hidden_gpus(snapshot, gpu_ids)
        if gpu_ids is not None:
            require_gpu(snapshot, gpu_ids)  # the GPUs chosen (a pin, the plan's) judged alone
    devices = launch_devices(snapshot, gpu_ids, ui) if gpu_ids is not None else None

    family = cfg.model.family or inputs.family
    if family in FAMILIES and not registry.family(family).plans(cfg.method):
        raise registry.not_supported(cfg.method, family)  # as recommend says it: before anything is written
    if not cfg.model.family and (problems := C.family_problems(cfg, family)):  # found in the model's files
        raise C.ConfigError(source, problems)
    for note in C.loader_notes(cfg, family):
        ui.echo(f"note: {note}")
    if refusal := quantized_base_refusal(cfg, family, snapshot, gpu_ids):
        raise UsageError(refusal)
    if refusal := block_swap_refusal(cfg, family):
        raise UsageError(refusal)
    check_lora_targets_early(cfg, family)
    if inputs.model_kind == "hub" and not inputs.hub_cached:
        # its configs may all be in the cache (what an earlier check kept), not its weights: they come from the
        # hub, and the trainer failed on them without naming why where it cannot be reached (offline, no network)
        from sdplan.trainer.models import HubUnreachable, ask_hub

        try:
            ask_hub(
                cfg.model.path, "model_index.json", inputs.revision, cache="the local cache lacks its weights"
            )
        except HubUnreachable as e:
            if not req.dry_run:
                raise
            ui.echo(
                f"note: the local cache lacks the model's weights, and the hub cannot be reached ({e.why})"
            )

    steps = config_steps(cfg, inputs.images_x_repeats, world, inputs.bucket_samples)
    if refusal := C.ema_refusal(cfg, steps["total_steps"]):
        raise UsageError(refusal[0], fix=refusal[1])
    if resume is not None:
        from sdplan.trainer.checkpoint import latest_checkpoint

        # the newest checkpoint placed once in this config's steps (its state read, the trainer's sampler built)
        last = latest_checkpoint(out)
        if last is not None and (placed := checkpoint_step(last, cfg, inputs, world)) is not None:
            refuse_a_shortened_resume(last, placed, cfg, inputs, world, steps, saved_config=saved)
            refuse_a_finished_resume(out, placed, cfg, world, steps)
    elif (start := start_checkpoint(cfg)) is not None:  # the settings as planned: what the trainer builds
        check_start_settings(cfg, start, family)
        refuse_a_start_past_its_length(start, cfg, inputs, world, steps)
    if req.demo and cfg.plan is None:
        # The demo's plan: the tiny model on the CPU; its memory and time are trivially small, its step
        # arithmetic is the real one (recorded in the outputs' metadata like a planned run's).
        cfg.plan = {
            "source": "demo",
            "plan": {
                "device": "cpu",
                "num_processes": world,
                "batch_size": cfg.training.batch_size,
                "grad_accum": cfg.training.grad_accum,
                "precision": cfg.training.precision,
                "resolution": cfg.data.resolution,
            },
            "steps": steps,
        }
    return Prepared(
        cfg=cfg,
        out=out,
        inputs=inputs,
        world=world,
        steps=steps,
        snapshot=snapshot,
        plan=plan_result,
        resume=resume,
        state=state,
        planned=planned,
        gpu_ids=gpu_ids,
        devices=devices,
    )


def given_settings_line(overrides) -> str | None:
    """The key=value settings given, each once as typed (the last of a key given twice), as one line: what the
    plan lines do not show (the learning rate, the scheduler, the seed, EMA, sampling, checkpoint and bucket
    settings) was taken without a word. None where none was given."""
    given = C.given_settings(overrides)
    if not given:
        return None
    return "settings: " + ", ".join(f"{key}={raw.strip()}" for key, raw in given.items())


VISIBLE_DEVICES_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def check_lora_targets_early(cfg: C.TrainConfig, family: str | None) -> None:
    """LoRA target modules the user named (lora.target_modules; lora.text_encoder_target_modules with text-encoder
    training) checked before the launch, on the model's architecture built on the meta device (no weights; a few
    seconds, most of it importing diffusers): a name no module has was refused by the trainer only after the
    model loaded (a FLUX.1 base: minutes and 24 GB read). The architecture is the model's own config where it
    is here (a diffusers folder, a cached hub model, model.config_dir: an LCM UNet's time_embedding.cond_proj),
    else the family's profile; the trainer checks the loaded model again (runtime.add_lora_adapters)."""
    lora = cfg.lora
    te = cfg.training.train_text_encoder and lora.text_encoder_target_modules
    if cfg.method != "lora" or family not in FAMILIES or (lora.target_modules is None and not te):
        return
    import diffusers
    import torch
    import transformers

    from sdplan.profiles import load_profiles
    from sdplan.trainer.runtime import check_lora_targets

    spec = load_profiles().model(family)
    flow = family in FLOW_FAMILIES
    own = _model_configs(cfg)
    with torch.device("meta"):
        if lora.target_modules is not None:
            denoiser_cls = (
                getattr(diffusers, spec.transformer_class) if flow else diffusers.UNet2DConditionModel
            )
            config = own.get("transformer" if flow else "unet") or dict(
                spec.transformer if flow else spec.unet
            )
            try:
                denoiser = denoiser_cls.from_config(config)
            except Exception:  # a config this diffusers cannot build: the trainer's check on the model stands
                denoiser = denoiser_cls.from_config(dict(spec.transformer if flow else spec.unet))
            check_lora_targets(denoiser, list(lora.target_modules), "lora.target_modules")
        if te and not flow:
            for i, encoder in enumerate(spec.text_encoders):
                config = own.get("text_encoder" + (f"_{i + 1}" if i else "")) or encoder["config"]
                model = getattr(transformers, encoder["class"])(transformers.CLIPTextConfig(**config))
                check_lora_targets(model, list(te), "lora.text_encoder_target_modules")


def _model_configs(cfg: C.TrainConfig) -> dict[str, dict]:
    """The model's own component configs that are here (subfolder -> config.json as read): a diffusers folder's,
    model.config_dir's beside a single file, a hub model's in the local cache; {} where none is."""
    from sdplan.trainer.models import resolve_source

    names = ("unet", "transformer", "text_encoder", "text_encoder_2")
    try:
        source = resolve_source(cfg.model.path)
    except SdplanError:
        return {}
    folder = (
        Path(source.location)
        if source.kind == "folder"
        else Path(C.expand_user(cfg.model.config_dir, "model.config_dir"))
        if source.kind == "file" and cfg.model.config_dir
        else None
    )
    files: dict[str, Path] = {}
    if folder is not None:
        files = {n: folder / n / "config.json" for n in names if (folder / n / "config.json").is_file()}
    elif source.kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        for n in names:
            found = try_to_load_from_cache(source.location, f"{n}/config.json", revision=cfg.model.revision)
            if isinstance(found, str):
                files[n] = Path(found)
    out = {}
    for n, f in files.items():
        try:
            out[n] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def run_gpus(
    cfg: C.TrainConfig, snapshot: Any, per_node: int, *, num_machines: int = 1
) -> tuple[int, ...] | None:
    """The GPUs (as `sdplan doctor` numbers them) this machine's ``per_node`` processes run on: the config's
    ``distributed.gpu_ids`` (the plan's, on a machine whose GPUs differ); where it names none on such a machine,
    the ones the planner would choose for that many (:func:`sdplan.planner.gpu_sets`, the first that has the
    config's precision); None on alike GPUs (the first ones, as the framework numbers them) unless others are
    better joined (NVLink between two of four, :func:`sdplan.planner.gpu_sets`). On several machines
    the config's ids are the machine it was planned on: another node that lacks them chooses its own."""
    usable = {g.index: g for g in snapshot.usable_gpus}
    shown = {g.index for g in trained_gpus(snapshot)}
    ids = cfg.distributed.gpu_ids
    if ids is not None and num_machines > 1 and (len(ids) != per_node or any(i not in shown for i in ids)):
        ids = None
    if ids is not None:
        fix = "`sdplan doctor` numbers the GPUs; or drop distributed.gpu_ids and sdplan chooses"
        if missing := [i for i in ids if i not in usable]:
            raise UsageError(
                f"distributed.gpu_ids {ids}: this machine has no usable GPU {missing[0]} "
                f"(it has {', '.join(map(str, usable))})",
                fix=fix,
            )
        if hidden := [i for i in ids if i not in shown]:
            raise UsageError(
                f"distributed.gpu_ids {ids}: GPU {hidden[0]} is hidden from the run ({gpus_here(snapshot)})",
                fix=f"unset {visible_setting(snapshot)}, or drop distributed.gpu_ids and sdplan chooses",
            )
        if len(ids) != per_node:
            raise UsageError(
                f"distributed.gpu_ids {ids} lists {count_of(len(ids), 'GPU')} for "
                f"{count_of(per_node, 'process', 'processes')} on this machine",
                fix="list one GPU per process (distributed.num_processes), or drop distributed.gpu_ids",
            )
        if len({usable[i].vendor for i in ids}) > 1:
            raise UsageError(
                f"distributed.gpu_ids {ids}: NVIDIA and AMD GPUs cannot train together (one torch build drives "
                "a run)",
                fix=fix,
            )
        from sdplan.probe.snapshot import build_vendor

        drives = build_vendor(snapshot)
        if drives is not None and usable[ids[0]].vendor != drives:
            raise UsageError(
                f"distributed.gpu_ids {ids}: {usable[ids[0]].name} is an {usable[ids[0]].vendor.upper()} GPU, and "
                f"this machine's torch is a {snapshot.software.torch_build} build, which does not drive it",
                fix=fix,
            )
        return tuple(ids)
    from sdplan.planner import gpu_sets, hardware_from_snapshot, named_gpu_ids
    from sdplan.profiles import load_profiles

    hw = hardware_from_snapshot(snapshot, load_profiles())
    if per_node > hw.count and hw.left_out:  # a GPU it shows that cannot train (no ROCm kernels for its arch)
        index, why = hw.left_out[0]
        raise UsageError(
            f"distributed.num_processes {per_node}: this machine trains on {count_of(hw.count, 'GPU')}; GPU "
            f"{index} cannot train here: {why}",
            fix=f"lower distributed.num_processes (or --gpus) to {hw.count}, or see `sdplan doctor`",
        )
    sets = gpu_sets(hw, per_node)
    if cfg.training.precision == "bf16":  # alike GPUs: one set, all with bf16 or none
        sets = [s for s in sets if all(g.bf16 for g in s)] or sets
    return named_gpu_ids(hw, sets[0]) if sets else None


def _run_visibility(snapshot: Any) -> Any:
    """What the user's CUDA_VISIBLE_DEVICES (HIP_ / ROCR_) shows of the vendor a run here trains on
    (:func:`sdplan.probe.snapshot.visible_gpus`), where it restricts the GPUs doctor can name; None otherwise."""
    from sdplan.probe.snapshot import trained_vendor, visible_gpus

    vendor = trained_vendor(snapshot)
    seen = visible_gpus(snapshot, vendor) if vendor else None  # the run's vendor's setting only
    return None if seen is None or seen.unnamed or not seen.gpus else seen


def visible_setting(snapshot: Any) -> str:
    """The variables that choose the GPUs a run here sees ('CUDA_VISIBLE_DEVICES'), '' where none does."""
    seen = _run_visibility(snapshot)
    return " and ".join(s.split("=")[0] for s in seen.setting.split() if "=" in s) if seen else ""


def gpus_here(snapshot: Any) -> str:
    """'has 2 usable GPUs', or 'shows the run 1 usable GPU (CUDA_VISIBLE_DEVICES=1)'."""
    n = count_of(len(trained_gpus(snapshot)), "usable GPU")
    seen = _run_visibility(snapshot)
    return f"shows the run {n} ({seen.setting})" if seen else f"has {n}"


def refuse_hidden_gpus(snapshot: Any, gpu_ids: tuple[int, ...] | None) -> None:
    """A GPU run where the user's ``CUDA_VISIBLE_DEVICES`` (or ``HIP_VISIBLE_DEVICES``) shows no GPU at all
    (``""`` or ``-1``, the usual ways to hide every GPU) is refused: the trainer would find none for a run planned
    on one (:func:`sdplan.probe.snapshot.visible_gpus` reads the variables as CUDA and ROCm do)."""
    from sdplan.machine import env_of
    from sdplan.probe.snapshot import visible_gpus

    first = next((g for g in snapshot.usable_gpus if gpu_ids is None or g.index in gpu_ids), None)
    if first is None:
        return
    here = replace(snapshot, env=env_of(os.environ))
    seen = visible_gpus(here, first.vendor)
    if seen is not None and not seen.gpus and not seen.unnamed:
        raise UsageError(
            f"{seen.setting} is set, which shows the trainer no GPU",
            fix=f"unset it to train on GPU {first.index} ({first.name}), or train on the CPU with --device cpu",
        )


def launch_devices(snapshot: Any, gpu_ids: tuple[int, ...], ui: UI) -> dict[str, str] | None:
    """The environment that shows the trainer only ``gpu_ids`` (:meth:`sdplan.machine.Snapshot.visible_devices`);
    None where the user's own CUDA_VISIBLE_DEVICES (or HIP_ / ROCR_) already chooses, which is kept, with a note."""
    from sdplan.machine import env_of
    from sdplan.probe.snapshot import shown_gpus

    own = {k: v for k in VISIBLE_DEVICES_ENV if (v := os.environ.get(k, "").strip())}
    shown = shown_gpus(replace(snapshot, env=env_of(os.environ))) if own else None
    if shown is not None and {g.index for g in shown[0]} == set(gpu_ids):
        return None  # the plan's GPUs are the ones the user's setting shows: it is kept, and says which
    if shown is not None and set(gpu_ids) < {g.index for g in shown[0]}:
        # fewer than it shows: the plan's, named by UUID or doctor's numbers; under ROCR_VISIBLE_DEVICES, HIP
        # numbers the GPUs it leaves by their place in its list (HIP_VISIBLE_DEVICES applies after it)
        env = snapshot.visible_devices(gpu_ids)
        if "ROCR_VISIBLE_DEVICES" in own:
            from sdplan.probe.snapshot import visible_gpus

            rocr = visible_gpus(
                replace(snapshot, env={"ROCR_VISIBLE_DEVICES": own["ROCR_VISIBLE_DEVICES"]}), "amd"
            )
            left = [g.index for g in rocr.gpus] if rocr is not None else []
            env = {"HIP_VISIBLE_DEVICES": ",".join(str(left.index(i)) for i in gpu_ids)}
        ui.echo(
            f"note: {shown[1]} shows {count_of(len(shown[0]), 'GPU')}; the plan runs on "
            + ", ".join(f"GPU {g.index} ({g.name})" for g in shown[0] if g.index in gpu_ids)
            + ": "
            + " ".join(f"{k}={v}" for k, v in env.items())
        )
        return env
    if own:
        names = ", ".join(
            f"GPU {i} ({g.name})" for i in gpu_ids for g in snapshot.usable_gpus if g.index == i
        )
        # one id in each variable set (CUDA_VISIBLE_DEVICES=1): "the GPU it shows"
        one = all(len([d for d in v.split(",") if d.strip()]) == 1 for v in own.values())
        ui.echo(
            f"note: {', '.join(f'{k}={v}' for k, v in own.items())} is set: the run uses the "
            f"GPU{'' if one else 's'} it shows, "
            f"which may not be {names} (sdplan's numbers, as `sdplan doctor` shows them) that it is planned for; "
            "unset it to train there"
        )
        return None
    return snapshot.visible_devices(gpu_ids)


def quantized_base_refusal(
    cfg: C.TrainConfig, family: str | None, snapshot: Any, gpu_ids: tuple[int, ...] | None = None
) -> str | None:
    """The one line `sdplan train` stops with before launch when this machine cannot train over the config's
    quantized frozen base (``model.base_precision`` fp8 / nf4; what each needs: ``trainer/quantize.py``), from
    the probed snapshot's GPUs and packages (``--device cpu``: this Python's packages); None when it can."""
    from sdplan.trainer.quantize import support_problem

    if cfg.model.base_precision == "bf16":
        return None
    if snapshot is None:  # --device cpu
        from sdplan.probe.software import dist_version

        device, gpus = "cpu", ()
        packages = {name: dist_version(name) for name in ("bitsandbytes", "diffusers")}
    else:
        used = (
            tuple(g for g in snapshot.usable_gpus if g.index in gpu_ids)
            if gpu_ids is not None
            else snapshot.usable_gpus[: max(1, cfg.distributed.num_processes)]
        )
        gpus = tuple((g.vendor, g.compute_capability) for g in used)
        device = "rocm" if snapshot.software.torch_build == "rocm" else "cuda"
        packages = snapshot.software.packages
    return support_problem(
        cfg.model.base_precision,
        family=family,
        method=cfg.method,
        deepspeed=cfg.distributed.deepspeed is not None,
        device=device,
        gpus=gpus,
        bitsandbytes=packages.get("bitsandbytes"),
        diffusers=packages.get("diffusers"),
    )


def block_swap_refusal(cfg: C.TrainConfig, family: str | None) -> str | None:
    """The one line `sdplan train` stops with before launch when the bundled trainer cannot swap the config's
    ``memory.blocks_to_swap`` blocks (``trainer/blockswap.py``); None when it can."""
    from sdplan.trainer.blockswap import support_problem

    return support_problem(
        cfg.memory.blocks_to_swap,
        family=family,
        method=cfg.method,
        gradient_checkpointing=cfg.memory.gradient_checkpointing,
        processes=cfg.distributed.num_processes,
        deepspeed=cfg.distributed.deepspeed is not None,
    )


class NotFeasible(SdplanError):
    """The planner found no configuration that fits this machine."""

    exit_code = 1


NO_PLAN_FIX = "or add --no-plan to train your settings as given, unchecked"


def plan_request(
    cfg: C.TrainConfig, inputs: InputSummary, snapshot: Any, req: TrainRequest, *, every_setting: bool = False
):
    """The planner's (feasible) Result for this request on this machine, planned around the user's
    ``key=value`` settings as `sdplan recommend` plans around its pins (:func:`sdplan.recommend.parse_pins`):
    a pinned setting is never replaced by one the planner chose for other settings. A pin this machine cannot
    run, or nothing fitting, is one clear error here, before anything is written or launched. ``every_setting``:
    every planned setting of ``cfg`` is a pin (a config trained as given, checked for fit)."""
    from sdplan.planner import Request, plan
    from sdplan.profiles import load_profiles
    from sdplan.recommend import parse_pins

    family = cfg.model.family or inputs.family
    if every_setting:
        pins, pinned_resolution = config_pins(cfg, family), cfg.data.resolution
    else:
        pins, pinned_resolution = parse_pins(req.overrides, cfg.method, family)
    images, repeats = inputs.images, max(1, inputs.images_x_repeats // max(1, inputs.images))
    if req.resolution is not None and pinned_resolution is not None and req.resolution != pinned_resolution:
        raise UsageError(
            f"--resolution {req.resolution} and data.resolution={pinned_resolution} disagree", fix="give one"
        )
    profiles = load_profiles()
    resolution = req.resolution or pinned_resolution
    if resolution is None and family in profiles.models:  # the model's own (an SD 2.x epsilon base: 512)
        resolution = profiles.model(family).resolution_for(inputs.prediction_type)
    prior, class_images = C.prior_preservation(cfg)
    fields = dict(pins)
    request = Request(
        method=cfg.method,
        model=family,
        resolution=resolution,
        images=images,
        repeats=repeats,
        images_per_epoch=inputs.images_x_repeats,  # kohya folders of unequal repeats: each its own
        epochs=cfg.training.epochs,
        max_steps=cfg.training.max_steps,
        bucket_samples=inputs.bucket_samples,
        max_gpus=req.gpus,
        lora_rank=fields.get("lora_rank") or cfg.lora.rank,
        prior_preservation=prior,
        class_images=class_images,
        **C.planned_sampling(cfg),
        pins=pins,
        pins_named=f"the settings of {cfg_source(req)}" if every_setting else None,
    )
    result = plan(snapshot, profiles, request)
    if result.pin_conflicts:
        raise UsageError(result.pin_conflicts[0], fix=NO_PLAN_FIX)
    if not result.feasible or result.plan is None:
        what, fix = infeasible_message(result)
        raise NotFeasible(what, fix=fix)
    if chosen_needs_bnb(result.plan, pins):
        raise UsageError(
            "memory.optimizer=adamw8bit: bitsandbytes is not installed",
            fix=f"{install_hint('bnb')}, or pin memory.optimizer=adamw",
        )
    return result


def infeasible_message(result: Any) -> tuple[str, str]:
    """(what does not fit and by how much, what to change) from an infeasible planner Result."""
    reasons = list(result.reasons)
    what = next((r for r in reasons if r.startswith(("nothing fits", "no usable GPU"))), None)
    what = what or (reasons[-1] if reasons else "nothing fits on this machine")
    relax = next((r for r in reasons if r.startswith("fits when changed: ")), None)
    fits = ", ".join(((result.needs or {}).get("suggested_hardware") or [])[:4])
    if installs := (result.needs or {}).get("fits_after_install"):  # this GPU, after an install (planner)
        fix = " or ".join(
            f"`{f['install']}`, then model.base_precision={f['base_precision']}" for f in installs
        )
        fix = f"it fits this GPU after {fix}"
    elif relax:
        fix = relax.replace("fits when changed: ", "change a pin: ", 1)
    elif fits:
        fix = f"GPUs that would fit: {fits}"
    else:
        fix = "see `sdplan recommend --compare`"
    return what, f"{fix}; {NO_PLAN_FIX}" if result.request.pins else fix


def chosen_needs_bnb(chosen: Settings, pins: tuple) -> bool:
    """A pinned 8-bit AdamW without bitsandbytes installed (an unpinned one falls back to AdamW)."""
    return (
        chosen.optimizer == "adamw8bit"
        and dict(pins).get("optimizer") == "adamw8bit"
        and not importable("bitsandbytes")
    )


def cfg_source(req: TrainRequest) -> str:
    """The config file a request trains, as the user named it (with its key=value settings where any)."""
    return (req.config or CONFIG_FILE) + (" with the key=value settings" if req.overrides else "")


def config_pins(cfg: C.TrainConfig, family: str | None) -> tuple[tuple[str, Any], ...]:
    """Every setting the planner chooses, as ``cfg`` has it: planner pins (Settings field, value), so that a
    plan of them is a fit check of this config."""
    from sdplan.settings import CONFIG_KEYS

    s = Settings.from_config(cfg, model=family)
    # GPU ids for another count than the processes: refused where the run's GPUs are chosen (run_gpus: "lists 1
    # GPU for 2 processes"), not as a pin this hardware cannot run
    ids_apart = s.gpu_ids is None or len(s.gpu_ids) != s.num_gpus
    skip = {"method", "model", "resolution"} | ({"gpu_ids"} if ids_apart else set())
    if cfg.method != "lora":
        skip |= {"lora_rank", "lora_alpha", "lora_dropout", "lora_targets"}
    return tuple((f, getattr(s, f)) for f in CONFIG_KEYS if f not in skip) + (("ema", s.ema),)


def plan_settings(chosen: Settings, result: dict[str, Any], *, num_machines: int = 1) -> dict[str, Any]:
    """The planner's settings as sdplan.yaml sections (:meth:`Settings.to_config`, as `recommend --out` writes
    them), with the plan recorded; flags and key=value overrides are applied on top."""
    return {**chosen.to_config(num_machines=num_machines), "plan": result}


def describe_plan(result: dict[str, Any]) -> list[str]:
    """The planner's reasons and estimate, as lines."""
    lines = [f"  - {r}" for r in result.get("reasons", [])]
    est = result.get("estimate") or {}
    if est:
        secs = est.get("seconds")
        lines.append(
            f"predicted: peak {est['peak_vram_bytes'] / 2**30:.1f} GiB per GPU, host RAM "
            f"{est['ram_bytes'] / 2**30:.1f} GiB"
            + (f", about {format_duration(secs)}" if secs else "")
            + f" ({str(est.get('basis')).replace('_', ' ')})"
        )
    return lines


def launch_for(p: Prepared, req: TrainRequest, resume: str | None) -> Launch:
    return build_launch(
        p.cfg,
        p.out / CONFIG_FILE,
        p.out,
        num_machines=req.num_machines,
        machine_rank=req.machine_rank,
        main_process_ip=req.main_process_ip,
        main_process_port=rendezvous_port(req),
        cpu_processes=p.world if p.cfg.training.device == "cpu" and p.world > 1 else None,
        resume=resume,
        cpu_cores=_cpu_cores(),
        devices=p.devices,
    )


def rendezvous_port(req: TrainRequest) -> int:
    """The user's port; else accelerate's 29500 where several machines must agree on it, and a free port on one
    machine (another run may be starting beside this one)."""
    if req.main_process_port is not None:
        return req.main_process_port
    return DEFAULT_PORT if req.num_machines > 1 else free_port()


def _cpu_cores() -> int:
    """Physical cores this process may use (CPU runs split them between processes)."""
    from sdplan.cputhreads import physical_cores

    return physical_cores()


# The signals that stop a run with a checkpoint (Ctrl-C, kill, a closed terminal); a trainer that one kills while
# Python is still starting exits by the signal itself.
STOP_SIGNALS = frozenset(
    {int(signal.SIGINT), int(signal.SIGTERM), int(getattr(signal, "SIGHUP", signal.SIGTERM))}
)


def interrupted(out: Path) -> TrainFailed:
    """The trainer stopped on Ctrl-C, SIGTERM or a hangup: with the checkpoint it saved (or an earlier one) to
    resume from, or, stopped while it was still starting, with none."""
    from sdplan.trainer.checkpoint import latest_checkpoint

    last = latest_checkpoint(out)
    if last is None:
        return TrainFailed(
            "training interrupted before its first checkpoint: there is nothing to resume from",
            EXIT_INTERRUPTED,
            fix="start it again: the same command with --force",
        )
    return TrainFailed(
        f"training interrupted; its last checkpoint is {last.name}",
        EXIT_INTERRUPTED,
        fix=f"continue with `sdplan train --resume --out {shlex.quote(str(out))}`",
    )


def killed_by_signal(out: Path, code: int, world: int = 1) -> TrainFailed | None:
    """The trainer (or, with several processes, one of them) ended by a signal it could not handle (exit
    ``128 + n``: SIGKILL from the kernel's out-of-memory killer or a ``kill -9``): said so, with the checkpoint
    to continue from, instead of "its error is above" over no error; None for another exit code."""
    from sdplan.trainer.checkpoint import latest_checkpoint

    if code <= 128 or (code - 128) not in signal.valid_signals():
        return None
    sig = signal.Signals(code - 128)
    who = "a training process (or their launcher)" if world > 1 else "the trainer"
    why = " (often the kernel's out-of-memory killer, for lack of host RAM)" if sig == signal.SIGKILL else ""
    last = latest_checkpoint(out)
    if last is None:
        return TrainFailed(
            f"{who} was killed by {sig.name}{why} before its first checkpoint: there is nothing to resume from",
            code,
            fix="start it again: the same command with --force",
        )
    return TrainFailed(
        f"{who} was killed by {sig.name}{why}; its last checkpoint is {last.name}",
        code,
        fix=f"continue with `sdplan train --resume --out {shlex.quote(str(out))}`",
    )


def execute(p: Prepared, req: TrainRequest, ui: UI, launch: Launch, lock: Any = None) -> dict[str, Any]:
    """Launch, and on out-of-memory retry with the next smaller config (bounded). Returns run_summary.json.
    Every top-level entry the trainer creates goes into the run folder's manifest."""
    from sdplan import runfolder
    from sdplan.trainer.outputs import remove_stale_export_checks

    out = p.out
    remove_stale_export_checks(out)
    before = set(runfolder.entries(out))
    runfolder.record(out, [n for n in TRAINER_ENTRIES if n not in before])
    cfg = p.cfg
    resume = p.resume
    header = command_line(req, out)
    retries = 0
    fixes: list[str] = []
    while True:
        for stale in (OOM_FILE, REPORTED_FILE):
            (out / stale).unlink(missing_ok=True)
        set_aside_summary(out)
        code = run_launch(launch, on_start=lock.set_trainer if lock is not None else None)
        runfolder.record(out, set(runfolder.entries(out)) - before)
        oom = read_json(out / OOM_FILE)
        if code == 0:
            break
        if code == EXIT_INTERRUPTED or -code in STOP_SIGNALS:  # killed by one before Python handled it
            raise interrupted(out)
        if oom is None:
            reported = (out / REPORTED_FILE).is_file()  # its one line is already on the screen
            (out / REPORTED_FILE).unlink(missing_ok=True)  # a signal between the two, not an output
            if not reported and (killed := killed_by_signal(out, code, p.world)) is not None:
                raise killed
            raise TrainFailed(
                f"the trainer failed (exit code {code}); its error is above", code, reported=reported
            )
        # Out of memory: record what did not fit, then retry smaller. Before the first step (trainer/__main__.py:
        # step 0) no batch had run: recorded at batch 1, so the planner does not take a smaller batch for a fix
        setup_oom = oom.get("step") == 0
        at = "before training started" if setup_oom else f"at step {oom.get('step')}"
        _record(cfg, {**oom, "batch_size": 1, "grad_accum": 1} if setup_oom else oom, p, ui, fits=False)
        if req.num_machines > 1:
            raise OutOfMemoryError(
                f"out of GPU memory at step {oom.get('step')} on this node",
                fix="lower training.batch_size on every node, or turn on memory.gradient_checkpointing",
            )
        retries += 1
        own = _latest(out)
        started_from = start_checkpoint(cfg) if not own else None  # the trainer loads it again: resuming too
        resumes = own or started_from is not None
        kw = dict(
            cuda=cfg.training.device != "cpu",
            have_bnb=importable("bitsandbytes"),
            have_deepspeed=importable("deepspeed"),
            largest=largest_batch(
                cfg.training.batch_size, p.inputs.images_x_repeats, p.inputs.bucket_samples
            ),
        )
        change = after_oom(cfg.to_dict(), **kw, resumes=resumes, before_training=setup_oom)
        if change is None or retries > req.max_oom_retries:
            # a saver passed over because the checkpoint cannot be loaded with it: a new start can have it
            fresh = (
                after_oom(cfg.to_dict(), **kw, before_training=setup_oom)
                if change is None and resumes
                else None
            )
            if setup_oom and change is None and fresh is None:
                raise OutOfMemoryError(
                    "out of GPU memory before training started (loading the models, or encoding the captions), "
                    "with every saver that changes that on: a smaller batch would not help",
                    fix=(
                        "use a quantized base (model.base_precision=fp8) and memory.blocks_to_swap, or a GPU "
                        if (cfg.model.family or p.inputs.family) in FLOW_FAMILIES
                        else "use a GPU "
                    )
                    + "with more memory (`sdplan recommend --compare` lists what fits)",
                )
            raise OutOfMemoryError(
                f"out of GPU memory {at} with every memory saver on"
                + (f" (after {retries - 1} retries)" if retries > 1 else "")
                + (
                    f"; not tried: {fresh.message}, which this run's checkpoints cannot be resumed with"
                    if fresh is not None
                    else ""
                ),
                fix="lower data.resolution or lora.rank, or use a GPU with more memory "
                "(`sdplan recommend --compare` lists what fits)"
                + (
                    "; or start over with that saver (--force"
                    + (", with checkpoints.resume=null)" if started_from is not None else ")")
                    if fresh is not None
                    else ""
                ),
            )
        cfg = C.validate(change.data, source="out-of-memory retry")
        fixes.append(change.message)
        resume = "latest" if own else None
        where = (
            "from the last checkpoint"
            if own
            else f"from {started_from}, the checkpoint it started from"
            if started_from is not None
            else "from the start (no checkpoint yet)"
        )
        ui.echo(f"out of memory {at}: {change.message}; restarting {where}")
        launch = build_launch(
            cfg,
            out / CONFIG_FILE,
            out,
            cpu_processes=p.world if cfg.training.device == "cpu" and p.world > 1 else None,
            resume=resume,
            cpu_cores=_cpu_cores(),
            devices=p.devices,
        )
        write_run_files(out, cfg, launch, header + f"\nrewritten after out of memory: {change.message}")
        _drop_stale_plan_chart(out)
    summary = read_json(out / SUMMARY_FILE) or {}
    drop_previous_summary(out)
    if fixes:
        _record(cfg, {}, p, ui, fits=True, peak=summary.get("peak_memory_bytes"))
        summary = {**summary, "oom_retries": fixes}
    return summary


def _latest(out: Path) -> bool:
    from sdplan.trainer.checkpoint import latest_checkpoint

    return latest_checkpoint(out) is not None


def _record(
    cfg: C.TrainConfig, oom: dict[str, Any], p: Prepared, ui: UI, *, fits: bool, peak: int | None = None
):
    from sdplan.profiles import local_dir
    from sdplan.trainer.faults import unrecordable

    family = cfg.model.family or p.inputs.family
    if family not in FAMILIES:
        return None
    if injected := unrecordable():  # a test's fault is no measurement: the planner learns from the store
        ui.echo_once(f"not recorded in the local profile store: faults are injected ({', '.join(injected)})")
        return None
    gpus = p.snapshot.usable_gpus if p.snapshot is not None else ()
    if p.gpu_ids is not None:  # the run's GPUs: out of memory is the one with the least memory's
        gpus = tuple(
            sorted((g for g in gpus if g.index in p.gpu_ids), key=lambda g: g.memory_total_bytes or 0)
        )
    gpu = gpus[0] if gpus else None
    point = oom_point(
        cfg,
        oom,
        family=family,
        gpu_name=gpu.name if gpu else None,
        gpu_memory_bytes=gpu.memory_total_bytes if gpu else None,
        when=_dt.datetime.now(),
        fits=fits,
        peak_bytes=peak if gpu else None,
    )
    try:
        path = record_point(point, cfg.method, local_dir())
    except SdplanError as e:  # the store is bookkeeping: a store that cannot be written must not stop the run
        ui.echo(f"warning: not recorded in the local profile store: {e}")
        return None
    ui.echo(
        f"recorded in the local profile store: {path} ({'fits' if fits else 'out of memory'}, batch {point['batch']})"
    )
    return path


# WEIGHT_SETTINGS / STATE_SETTINGS: sdplan.settings (the trainer records them in each checkpoint)


def _state_setting(data: dict[str, Any], key: str) -> Any:
    """The value of a :data:`STATE_SETTINGS` key as the checkpoint's state depends on it: DeepSpeed off, on, or
    on with its optimizer offloaded (the ZeRO stage loads either way; an offloaded optimizer is DeepSpeed's CPU
    Adam, whose state torch's AdamW checkpoint lacks: KeyError 'bias_correction'); an EMA only where the method
    keeps one."""
    if key == "distributed.deepspeed":
        ds = get_key(data, key)
        if ds is None:
            return "off"
        return "on, optimizer offloaded" if (ds or {}).get("offload_optimizer", True) else "on"
    if key == "ema.enabled":
        return bool(get_key(data, key)) and registry.method(str(data.get("method"))).ema
    if key == "training.full_half_weights":  # what the trainer applies
        return trains_half_weights(
            data.get("method"), get_key(data, "training.precision"), get_key(data, key)
        )
    return get_key(data, key)


def unloadable_change(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(key, old value, new value) of the first setting that changes from ``old`` to ``new`` (configs as data)
    that a checkpoint made under ``old`` cannot be loaded with (:data:`STATE_SETTINGS`); None when it can."""
    for key in STATE_SETTINGS:
        if (was := _state_setting(old, key)) != (now := _state_setting(new, key)):
            return key, was, now
    return None


def _recorded_family(checkpoint: Path | None) -> str | None:
    """The model family a checkpoint's state records (None where it records none or cannot be read)."""
    from sdplan.trainer.checkpoint import read_state

    try:
        return read_state(checkpoint).settings.get(FAMILY_SETTING) if checkpoint is not None else None
    except (SdplanError, OSError, ValueError, AttributeError):
        return None


def check_resume_settings(saved: C.TrainConfig, cfg: C.TrainConfig, family: str | None = None) -> None:
    """--resume with a key=value that changes a setting its checkpoints' weights were made with, or one their
    saved state cannot be loaded with: one line before anything is written (else the run's sdplan.yaml keeps
    the change and every later --resume fails too). ``family``: the one its checkpoint records, where the
    run's sdplan.yaml leaves model.family to detection (null: the family's LoRA targets, known only then)."""
    # paths as this run reads them: a run written before they were made absolute names them relative
    check_settings(
        C.absolute_paths(saved.to_dict()),
        cfg.to_dict(),
        family=family,
        what="--resume",
        where="the run's sdplan.yaml",
        fix="set {key}={value}, the run's (or drop the key=value that changes it), to continue the run, or start "
        "a new one{with_it} (--force or a new --out)",
    )


def setting_text(value: Any) -> str:
    """``value`` as a key=value override writes it (YAML: text as it is, the rest as JSON, which YAML reads)."""
    if isinstance(value, str) and value.strip() == value and value:
        return value
    return C.yaml_quoted(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _shown(key: str, value: Any, family: str | None) -> str:
    """A setting's value in a resume check's message: lora.target_modules null with the modules it means."""
    if key == "lora.target_modules" and value is None:
        return f"null (the family's default: {', '.join(lora_targets(family, None))})"
    return repr(value)


def check_settings(
    old: dict[str, Any],
    new: dict[str, Any],
    *,
    what: str,
    where: str,
    fix: str,
    subject: tuple[str, str] = ("its checkpoints were", "its checkpoints hold"),
    skip: tuple[str, ...] = (),
    family: str | None = None,
) -> None:
    """UsageError for the first setting of :data:`WEIGHT_SETTINGS` or :data:`STATE_SETTINGS` (less ``skip``)
    that differs from ``old`` (the settings a checkpoint was made with, as config data) to ``new`` (this run's).
    ``what`` starts the line, ``where`` names where the old value is, ``fix`` is formatted with ``key``,
    ``value`` (the old value, as a key=value sets it) and ``with_it``; ``subject`` says what was trained with /
    holds the old value."""
    # lora.target_modules compared as the modules it adapts, on the family the checkpoint records (else the
    # config's): [to_q, to_k] is [to_k, to_q], and null the family's default
    family = family or get_key(old, FAMILY_SETTING) or get_key(new, FAMILY_SETTING)
    for key in WEIGHT_SETTINGS:
        if key in skip:
            continue
        if weight_setting(old, key, family) != weight_setting(new, key, family):
            was, now = get_key(old, key), get_key(new, key)
            if key == "lora.target_modules":  # the old default list: null, as it trained (and as set again)
                was = legacy_lora_targets(was)
            raise UsageError(
                f"{what}: {key} is {_shown(key, was, family)} in {where}, {_shown(key, now, family)} here; "
                f"{subject[0]} trained with the first",
                fix=fix.format(key=key, value=setting_text(was), with_it=""),
            )
    if (change := unloadable_change(old, new)) is not None:
        key, was, now = change
        shown = {"ema.enabled": "an EMA" if was else "no EMA", "distributed.deepspeed": f"DeepSpeed {was}"}
        raise UsageError(
            f"{what}: {key} is {was!r} in {where}, {now!r} here; {subject[1]} the "
            f"state of {shown.get(key, f'{was} optimizer')} and cannot be loaded with the second",
            fix=fix.format(key=key, value=setting_text(get_key(old, key)), with_it=" with it"),
        )


def start_checkpoint(cfg: C.TrainConfig) -> Path | None:
    """The checkpoint a new run starts from (``checkpoints.resume``, absolute), or None."""
    value = cfg.checkpoints.resume
    if value in (None, "", "latest"):
        return None
    return C.absolute(str(value), "checkpoints.resume")


def check_start_settings(cfg: C.TrainConfig, path: Path, family: str | None = None) -> None:
    """A new run from the checkpoint ``path`` (``checkpoints.resume``) with a setting its weights or saved state
    were not made with: one line, as for --resume (an optimizer change gave the trainer's 45-line KeyError
    'beta1'). The settings its train_state.json records; in a checkpoint saved before it kept them, those of
    the sdplan.yaml of the run folder it is in (none where it was copied out of one: not checked).

    model.path is not compared: a base model moved, copied to another machine or a local snapshot of the hub
    id the checkpoint names is the same model at another path. What the weights' shapes depend on is: the
    method, the LoRA settings, and the model's family (``family``: this run's, as detected; compared with the
    one the checkpoint records, where it records one)."""
    from sdplan.trainer.checkpoint import CHECKPOINTS, CheckpointError, read_state

    try:
        recorded = read_state(path).settings
    except CheckpointError:
        return  # the trainer says what is wrong with it
    new = cfg.to_dict()
    if recorded:  # the keys it records (a checkpoint of another sdplan version may record others)
        old, where = settings_data(recorded), f"the checkpoint's train_state.json ({path})"
        new = settings_data({key: get_key(new, key) for key in recorded})
    else:
        run_config = path.parent.parent / CONFIG_FILE
        if path.parent.name != CHECKPOINTS or not run_config.is_file():
            return
        try:
            old = config_file_data(run_config)
        except SdplanError:
            return
        where = f"{run_config}, the run it was saved in"
    what = f"checkpoints.resume {path}"
    made_for = recorded.get(FAMILY_SETTING) if recorded else None
    skip: tuple[str, ...] = ("model.path",)
    if not made_for:  # a checkpoint saved before it recorded its family: that of the base it names, if here
        made_for = _family_at(get_key(old, "model.path"))
        if made_for is None:  # neither can be read: the base's path is all there is to compare
            skip = ()
    if made_for and family and made_for != family:
        raise UsageError(
            f"{what}: it was trained on a model of the {made_for} family ({where}); model.path "
            f"{cfg.model.path} is {family}",
            fix=f"set model.path to a model of the {made_for} family to start from that checkpoint, or set "
            "checkpoints.resume=null to start from the base model",
        )
    check_settings(
        old,
        new,
        what=what,
        where=where,
        fix="set {key}={value}, the checkpoint's, to start from that checkpoint, or set checkpoints.resume=null "
        "to start from the base model{with_it}",
        subject=("it was", "it holds"),
        skip=skip,
    )


def _family_at(path: Any) -> str | None:
    """The family of the model at the local path ``path`` (a checkpoint's recorded model.path), or None where
    it is not here or its files do not say."""
    from sdplan.trainer.source_check import check_source

    if not isinstance(path, str) or not Path(path).expanduser().exists():
        return None
    try:
        return check_source(path).family
    except Exception:  # noqa: BLE001 - any unreadable model: the caller compares paths instead
        return None


def run(req: TrainRequest, ui: UI | None = None) -> dict[str, Any]:
    """`sdplan train` from request to finished run. Returns run_summary.json (plus what was retried)."""
    ui = ui or UI()
    given = given_settings_line(req.overrides)  # as typed, before any becomes a flag
    req = force_reads_run_config(settings_as_flags(req))  # as prepare reads it: the launch and header too
    p = prepare(req, ui)
    launch = launch_for(p, req, p.resume)
    if p.plan is not None:
        gpus = p.plan["hardware"]["gpus"]
        if p.gpu_ids is not None:
            gpus = [g for g in gpus if g.get("index") in p.gpu_ids] or gpus
            on = ", ".join(f"GPU {g['index']} ({g['name']})" for g in gpus)
        else:
            on = f"{len(gpus)}x {gpus[0]['name']}"
        ui.echo(f"plan for this machine ({on}):")
        for line in describe_plan(p.plan):
            ui.echo(line)
    elif req.no_plan and not (req.config or req.resume or req.demo):
        ui.echo(
            "not planned (--no-plan): the defaults with your key=value settings; whether they fit is not checked"
        )
    typed = req.max_steps is not None or "training.max_steps" in C.override_keys(req.overrides)
    for line in describe(p.cfg, p.steps, p.world, p.inputs, max_steps_from_file=not typed):
        ui.echo(line)
    if given:
        ui.echo(given)
    ui.echo(f"output: {p.out}")
    if launch.per_node_commands:
        ui.echo(f"{req.num_machines} machines: the same files at the same paths on each node, then:")
        for rank, line in enumerate(launch.per_node_commands):
            ui.echo(f"  node {rank}: {line}")
    chart = plan_chart_png(p)
    check_run_files(p.out, run_files(p.cfg, launch, command_line(req, p.out), chart))  # a dry run too
    if req.dry_run:
        ui.echo(f"dry run: would run `{launch.shell()}`")
        return {}
    if ui.confirm is not None and not req.yes and not ui.confirm("Start training?"):
        raise Cancelled("not started", fix="run again and answer y, or add --yes")
    from sdplan import runfolder

    header = command_line(req, p.out)
    try:
        p.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise runfolder.cannot_write(p.out, e) from None
    lock = runfolder.RunLock(p.out, command=header).acquire()
    try:
        if lock.taken_over is not None:
            ui.echo(f"note: took over the lock of a run that is gone ({runfolder.describe(lock.taken_over)})")
        if p.state == "new" and not req.demo and runfolder.entries(p.out):
            raise OutputExistsError(
                f"--out {p.out} was filled by another run while this one started", fix="choose a new folder"
            )
        if p.state == "run" and not req.resume:
            ui.echo(removed_line(p.out, clear_run_outputs(p.out)))
        written, copies = write_run_files(p.out, p.cfg, launch, header, chart)
        for path in written:
            ui.echo(f"wrote {path}")
        for copy in copies:
            ui.echo(runfolder.kept_line(copy))
        ui.echo(f"$ {launch.shell()}")
        return execute(p, req, ui, launch, lock)
    finally:
        lock.release()


def _counted(n: Any, noun: str) -> str:
    """'1 step', '4 steps' (count_of), for a run summary's number, which an older or edited file may lack."""
    return count_of(n, noun) if isinstance(n, int) and not isinstance(n, bool) else f"{n} {noun}s"


def render_summary(summary: dict[str, Any]) -> list[str]:
    """run_summary.json as a few lines for the user."""
    lines = []
    loss = summary.get("final_loss")
    wall = summary.get("wall_seconds")
    sampled = summary.get("sampling_seconds")
    if isinstance(wall, (int, float)) and isinstance(sampled, (int, float)) and sampled >= 1:
        wall_text = f", {wall:.1f} s (sampling {sampled:.1f} s of it)"
    else:
        wall_text = f", {wall:.1f} s" if isinstance(wall, (int, float)) else ""
    lines.append(
        f"done: {_counted(summary.get('steps'), 'step')}, {_counted(summary.get('images_seen'), 'image')} seen on "
        f"{count_of(summary.get('num_processes', 1), 'process', 'processes')}"
        + (f", final loss {loss:.4f}" if isinstance(loss, (int, float)) else "")
        + wall_text
    )
    for fix in summary.get("oom_retries", []):
        lines.append(f"after out of memory: {fix}")
    for failed in summary.get("sample_grid_failures") or []:  # outputs.samples: step None is the final grid
        if isinstance(failed, dict):
            step = failed.get("step")
            which = "the final sample grid" if step is None else f"the sample grid of step {step}"
            lines.append(f"skipped {which}: {failed.get('error')} (traceback: {failed.get('traceback')})")
    folder = summary.get("folder")
    if isinstance(folder, str):  # listed relative to the run folder: shown where they are
        lines += [f"  {path}" for path in summary_outputs(summary, Path(folder))]
    else:
        lines += [f"  {path}" for path in summary.get("outputs") or []]
    return lines
