"""What a run leaves besides the trained weights: sample grids, run_summary.json, loss_history.json,
peak memory, and the metadata every exported file records; the export check before training, intermediate
outputs, and the one-line errors for a write that fails (a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sdplan.errors import SdplanError
from sdplan.registry import FLOW_FAMILIES

from .conditioning import read_part, reading_tokenizer
from .dataset_scan import count_of
from .latents import offload
from .progress import say
from .runtime import same_device

INTERMEDIATE = "intermediate"  # {output.dir}/intermediate/{name}-{epoch:06d}/ (output.save_every_n_*)
EXPORT_CHECK = ".export-check"  # the trial export before training, deleted at once


# -- writes that fail ------------------------------------------------------------------------------------


class DiskFull(SdplanError):
    """Not enough free space for what the run must write."""

    def __init__(self, needed_bytes: int, path: str | Path, free_bytes: int, detail: str = "", fix=None):
        self.needed_bytes, self.path, self.free_bytes = needed_bytes, Path(path), free_bytes
        need = f"{needed_bytes} bytes needed at" if needed_bytes > 0 else "no room at"  # 0: not known
        super().__init__(
            f"disk full: {need} {path} ({free_bytes} bytes free){detail}",
            fix=fix or "free space on that disk, or set output.dir to a disk with room",
        )


class WriteFailed(SdplanError):
    """A file the run writes could not be written (not for lack of space)."""


class ExportFailed(SdplanError):
    """The trained weights could not be exported (before training: the check; after: the outputs)."""


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXT = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122", "storagefull")
_WRITE_TEXT = ("unexpected pos", "file write failed")  # torch.save's zip writer on a failed write


def tree_bytes(path: str | Path | None) -> int:
    """Bytes in a file, or in every file under a folder (0 when there is nothing)."""
    if path is None:
        return 0
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for p in path.rglob("*") if path.is_dir() else []:
        with contextlib.suppress(OSError):
            total += p.stat().st_size if p.is_file() else 0
    return total


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged user on the disk holding ``path`` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def write_error(exc: BaseException, path: str | Path, *, needed_bytes: int, detail: str = "", fix=None):
    """The one-line error for a failed write at ``path``: DiskFull when the disk is full (ENOSPC/EDQUOT, or
    a write failure with less than ``needed_bytes`` free), WriteFailed for another failed write, None when
    ``exc`` is no write failure."""
    text = str(exc).lower()
    free = free_bytes(path)
    if (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS) or any(t in text for t in _FULL_TEXT):
        return DiskFull(needed_bytes, path, free, detail, fix)
    if isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and any(t in text for t in _WRITE_TEXT)):
        if free < needed_bytes:
            return DiskFull(needed_bytes, path, free, detail, fix)
        first = (str(exc).strip().splitlines() or [""])[0]
        return WriteFailed(
            f"writing {path} failed ({type(exc).__name__}: {first}; {free} bytes free){detail}", fix=fix
        )
    return None


@contextlib.contextmanager
def write_errors(path: str | Path, *, needed_bytes: int = 0, detail: str = ""):
    """A failed write inside the block (a full disk) becomes the one-line error of :func:`write_error`."""
    try:
        yield
    except SdplanError:
        raise
    except Exception as e:
        err = write_error(e, path, needed_bytes=needed_bytes, detail=detail)
        if err is None:
            raise
        raise err from None


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def copy_grid(accelerator, grid: Path, target: Path) -> Path | None:
    """``grid`` copied to ``target`` (atomically) where the same grid is due again: a save at a step whose
    grid was made (sampling.every_steps), the last step's every-N grid (the final grid). A full disk stops the
    run as any write does; another failed copy is a skipped grid, as a failed sampling is (one line, the run
    goes on)."""
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(grid, tmp)
        os.replace(tmp, target)
        return target
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        err = write_error(e, target, needed_bytes=0)
        if isinstance(err, DiskFull):
            raise err from None
        say(accelerator, f"skipped the copy of sample grid {grid} to {target}: it failed ({_first_line(e)})")
        return None


# -- the export, checked before training -----------------------------------------------------------------


def check_export(export: Callable[[Path], Any], out_dir: str | Path, *, saves: int = 1) -> int:
    """Run ``export(folder)`` (the method's real export of the untrained weights) into a temporary folder
    in ``out_dir``, measure it and delete it; then check the disk holds ``saves`` exports of that size. A
    broken export (an import that fails, an unwritable folder, a name that does not resolve, a model the
    format cannot hold) so fails in the first seconds instead of after the training. Returns the bytes of
    one export.

    The folder goes whatever ends the export, a Ctrl-C included (for a full fine-tune it is a whole model copy,
    and a big model's trial export is a silent pause when users press Ctrl-C); one a killed run left
    (``.export-check-<pid>``: only this run writes in ``out_dir``, its lock says) goes at the next start."""
    out_dir = Path(out_dir)
    tmp = out_dir / f"{EXPORT_CHECK}-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_export_checks(out_dir)
        export(tmp)
        size = tree_bytes(tmp)
    except Exception as e:
        partial = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(
            e,
            out_dir,
            needed_bytes=partial,
            detail="; the trial export before training stopped there: more is needed",
        )
        if err is not None:
            raise err from None
        hint = (
            "another `sdplan` shadows the installed one (e.g. a folder named sdplan in the working directory): "
            "start from another folder"
            if isinstance(e, ImportError)
            else "fix the cause above and start again"
        )
        raise ExportFailed(
            f"the export failed before training started ({_first_line(e)}); nothing was trained", fix=hint
        ) from None
    finally:  # also on KeyboardInterrupt / SystemExit, which the except above lets through
        shutil.rmtree(tmp, ignore_errors=True)
    need, free = size * saves, free_bytes(out_dir)
    if free < need:
        raise DiskFull(
            need,
            out_dir,
            free,
            f": {count_of(saves, 'export')} of {size} bytes{' each' if saves != 1 else ''}",
        )
    return size


def is_export_check(path: Path) -> bool:
    """Whether ``path`` is a trial-export folder of :func:`check_export` (``.export-check-<pid>``), not a link."""
    pid = path.name.removeprefix(f"{EXPORT_CHECK}-")
    return pid != path.name and pid.isdigit() and path.is_dir() and not path.is_symlink()


def remove_stale_export_checks(out_dir: Path) -> None:
    """Remove the trial-export folders (``.export-check-<pid>``) an earlier start left in ``out_dir`` (with the
    run folder's lock held: no trainer of another run is exporting there)."""
    for stale in Path(out_dir).glob(f"{EXPORT_CHECK}-*"):
        if is_export_check(stale):
            shutil.rmtree(stale, ignore_errors=True)


def export_error(
    exc: BaseException, out_dir: Path, *, needed_bytes: int, checkpoint: Path | None
) -> SdplanError:
    """The error for a final export that failed: where the trained state is and how to export it again."""
    if checkpoint is not None:
        kept = f"; the trained state is in checkpoint {checkpoint}"
        fix = (
            f"fix the cause, then resume the run (sdplan train --out {out_dir} --resume): it starts from "
            f"{checkpoint} and only writes the outputs"
        )
    else:
        kept, fix = "; no checkpoint of the trained state could be written", None
    err = write_error(exc, out_dir, needed_bytes=needed_bytes, detail=kept, fix=fix)
    if isinstance(err, DiskFull):
        return err
    return ExportFailed(f"writing the outputs failed after training ({_first_line(exc)}){kept}", fix=fix)


def intermediate_name(name: str, *, epoch: int | None, step: int) -> str:
    """kohya's names for outputs saved during training: ``{name}-{epoch:06d}`` every N epochs,
    ``{name}-step{step:08d}`` every N steps."""
    return f"{name}-{epoch:06d}" if epoch is not None else f"{name}-step{step:08d}"


def grid_name(step: int | None, again: int = 0) -> str:
    """A sample grid's file in samples/: ``step-000100.png`` during training, ``final.png`` at the end;
    ``again`` > 0: ``step-000100-{again}.png``, a step an earlier session of the run has a grid of."""
    if step is None:
        return "final.png"
    return f"step-{step:06d}" + (f"-{again}" if again else "") + ".png"


# What the names above look like, for `train --force` to tell a run's outputs from the user's files
INTERMEDIATE_NAME = re.compile(r".+-(\d{6}|step\d{8})(-\d+)?")
GRID_NAME = re.compile(r"(step-\d{6,}(-\d+)?|final)\.(png|error\.txt)")  # a grid, or why it failed

# when this session of the run started (loop.train marks it): a grid file older than it is an earlier session's
_SESSION_START = time.time()


# whether this session numbers its steps as the earlier sessions of the run did (loop.train says so for a resume
# with the settings its checkpoint was saved with, from a history never renumbered): step N is then the same
# point of the run, and its grid and intermediate outputs are written again under their names, not as ``-1``.
# Only where they do not say which point they are: a grid and an intermediate folder record the images seen when
# they were made (:func:`point_of`), and are written over only at that point (a later, renumbered session that
# made them and left no checkpoint was another point of the run, whatever this session's numbering).
_SAME_STEPS = False

# An intermediate output's record of the point of the run it was saved at: {"step", "images_seen"}
POINT_FILE = ".sdplan-point.json"
# The key of a sample grid's PNG text chunk that sampling.sample_grid writes (its settings and, during training,
# the images seen)
GRID_TEXT = "sdplan_samples"


def mark_session_start() -> None:
    """A session of the run starts now, numbering its steps anew until :func:`same_steps_as_before` says not."""
    global _SESSION_START, _SAME_STEPS
    _SESSION_START, _SAME_STEPS = time.time(), False


def same_steps_as_before(same: bool) -> None:
    """This session's step N is the earlier sessions' step N (an exact resume): see ``_SAME_STEPS``."""
    global _SAME_STEPS
    _SAME_STEPS = same


def point_of(path: Path) -> int | None:
    """The images seen that grid ``path`` (its PNG text) or intermediate folder ``path`` (its
    :data:`POINT_FILE`) was made at; None where it does not say (made before it was recorded, or unreadable)."""
    try:
        if path.is_dir():
            seen = json.loads((path / POINT_FILE).read_text()).get("images_seen")
        else:
            from PIL import Image

            with Image.open(path) as im:
                seen = json.loads(im.text[GRID_TEXT]).get("images_seen")
    except (OSError, ValueError, KeyError, AttributeError, SyntaxError):
        return None
    return seen if isinstance(seen, int) and not isinstance(seen, bool) else None


def _taken(path: Path, images: int | None) -> bool:
    """Whether ``path`` (a grid or an intermediate folder this session would write at ``images`` seen) holds an
    earlier session's output of another point of the run, to keep beside the new one: it was written before this
    session and records other images seen, or records none and this session numbers its steps anew."""
    if not path.exists() or path.stat().st_mtime >= _SESSION_START:
        return False
    recorded = point_of(path) if images is not None else None
    return recorded != images if recorded is not None else not _SAME_STEPS


def grid_path(folder: Path, step: int | None, images: int | None = None) -> Path:
    """Where the grid of ``step`` (made at ``images`` seen) goes in ``folder``: its name, unless an earlier
    session of the run wrote that file at another point of the run (a resume on another process count, batch or
    accumulation numbers its steps anew: step 40 is another point of the run), which is kept beside the new one
    (``step-000040-1.png``). A grid of the same point (the images seen it records; one that records none: an
    exact resume, :func:`same_steps_as_before`) is written over."""
    path = folder / grid_name(step)
    again = 0
    while step is not None and _taken(path, images):
        again += 1
        path = folder / grid_name(step, again)
    return path


def intermediate_folder(root: Path, label: str, images: int | None = None) -> Path:
    """Where the outputs saved as ``label`` (at ``images`` seen) go under ``root`` (intermediate/): its name,
    unless an earlier session of the run wrote that folder at another point of the run, which is kept beside
    the new one (``{name}-step00000040-1``), as :func:`grid_path` keeps grids. The caller records the point in
    the folder (:func:`record_point`)."""
    folder, again = root / label, 0
    while _taken(folder, images):
        again += 1
        folder = root / f"{label}-{again}"
    return folder


def record_point(folder: Path, *, step: int, images: int) -> None:
    """Say in intermediate folder ``folder`` the point of the run its outputs are of (:func:`point_of`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POINT_FILE).write_text(json.dumps({"step": step, "images_seen": images}) + "\n")


@contextlib.contextmanager
def sampling_precision(accelerator, vae):
    """Sampling runs under the training autocast (the pipeline mixes fp16/bf16 and fp32 components) but the
    VAE decodes outside it, in its own dtype: the SD/SDXL VAE overflows to NaN in fp16 (kept fp32 then)."""
    import torch

    original = vae.decode

    def decode(z, *args, **kwargs):
        with torch.autocast(accelerator.device.type, enabled=False):
            return original(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode
    try:
        with torch.no_grad(), accelerator.autocast():
            yield
    finally:
        del vae.decode


def models_away(device, *models) -> list:
    """The models not on ``device`` (moved off it once their outputs were cached): sampling brings them back
    and sends them away again. A model already there is not listed, whatever index its device carries."""
    return [m for m in models if not same_device(m.device, device)]


def samples(
    accelerator,
    comps,
    unet,
    text_encoders,
    cfg,
    *,
    step: int | None = None,
    fallback: str = "",
    tb=None,
    at_step: int | None = None,
    out_path: Path | None = None,
    injected=None,
    text_cache=None,
    failures: list[dict[str, Any]] | None = None,
    measuring: bool = False,
    images: int | None = None,
    ema=None,
) -> Path | None:
    """A PNG grid from ``sampling.prompts`` (else ``fallback``) with a fixed seed, made on the main process:
    ``samples/step-000100.png`` during training (the other processes wait), ``samples/final.png`` at the end
    (call it on the main process only then), or ``out_path``. Each image is labelled, in a strip under it, with
    the step (``step``, else ``at_step``; "EMA weights" with ``ema``) and its prompt. Components moved off the
    GPU (cached outputs) come back for it.
    ``images``: the images seen, recorded in the PNG (the point of the run it shows: :func:`grid_path`).

    Out of GPU memory in a grid during training (``step`` given) skips that grid and training goes on (None):
    the grid needs the VAE and text encoders back beside the training state, which a smaller batch would not
    change, so stopping for the launcher's smaller-batch retry (and recording an out-of-memory at this batch)
    would be wrong; the other processes still meet this one at the barrier. At the end it is raised (the loop
    says what it skipped). A grid that fails otherwise (a pipeline or library error, not a full disk) is skipped
    during training and at the end alike, the weights being written by then: one line with the error, its
    traceback in ``<grid>.error.txt`` beside where the grid would be, and its record (:func:`_grid_failure`)
    appended to ``failures`` (run_summary.json's ``sample_grid_failures``). ``injected``: the run's
    ``faults.Faults`` (a test hook). ``measuring``: the grid is made to be measured (``sdplan bench``, no run's
    weights around it): a failure is raised as it is, not skipped. ``text_cache``: the run's
    cache of text-encoder outputs; SD3.5 / FLUX.1 sample from it (their encoders stay off the GPU:
    ``flow.cached_conditioning``). ``ema``: the run's ``loop.Ema`` (ema.enabled): the grid shows its averaged
    weights, swapped into the model for it and the training weights restored exactly after (``Ema.weights_in``;
    the PNG records ``"weights": "ema"``)."""
    import torch

    from .checkpoint import unwrap

    prompts = list(cfg.sampling.prompts) or ([fallback] if fallback else [])
    shown_step = step if step is not None else at_step
    # what the text encoder reads of each prompt, for its label: a prompt past its tokens is cut there, and its
    # label showed the end the encoder had dropped (loop._long_prompts says so once)
    reader = reading_tokenizer(comps) if prompts and accelerator.is_main_process else None
    shown = [read_part(reader[0], p) for p in prompts] if reader is not None else prompts
    # each label's first line: the step, and "EMA" where the grid shows the averaged weights (ema.enabled)
    head = ", ".join(
        ([f"step {shown_step}"] if shown_step is not None else [])
        + (["EMA weights"] if ema is not None else [])
    )
    grid = None
    skipped = None
    failure = None
    if prompts and accelerator.is_main_process:
        from . import sampling

        tes = [unwrap(te) for te in text_encoders]
        pipe = comps.pipeline(unet=unwrap(unet), text_encoders=tes)
        conditioning = None
        if text_cache is not None and comps.family in FLOW_FAMILIES:
            from .flow import cached_conditioning

            conditioning = cached_conditioning(comps.family, text_cache, accelerator.device)
        away = models_away(accelerator.device, comps.vae, *([] if conditioning else tes))
        for m in away:
            m.to(accelerator.device)
        target = out_path or grid_path(Path(cfg.output.dir) / "samples", step, images)
        try:
            with (
                ema.weights_in(unwrap(unet)) if ema is not None else contextlib.nullcontext(),
                sampling_precision(accelerator, comps.vae),
                _grid_bar(accelerator, step, len(prompts), cfg) as bar,
            ):
                if injected is not None:
                    injected.in_sample_grid(step)
                grid = sampling.sample_grid(
                    pipe,
                    prompts,
                    seed=cfg.sampling.seed,
                    steps=cfg.sampling.num_inference_steps,
                    guidance_scale=sampling.guidance_for(cfg.sampling.guidance_scale, comps.family),
                    resolution=cfg.data.resolution,
                    out_path=target,
                    negative_prompt=cfg.sampling.negative_prompt,
                    labels=[f"{head}\n{p}" if head else p for p in shown],
                    conditioning=conditioning,
                    on_step=bar,
                    record={
                        **({} if images is None else {"images_seen": images}),
                        **({} if ema is None else {"weights": "ema", "ema_decay": ema.decay}),
                    },
                )
        except torch.OutOfMemoryError as e:
            if step is None:
                raise
            skipped = (str(e).strip().splitlines() or ["out of memory"])[0][:200]
        except Exception as e:
            if (
                measuring
                or isinstance(e, SdplanError)
                or isinstance(write_error(e, target, needed_bytes=0), DiskFull)
            ):
                raise  # a full disk stops the run as any write does; another OSError (a connection, a
                # permission, an I/O error) is a failed grid like any other, the weights being written
            failure = _grid_failure(e, target, step)
        finally:
            offload(*away)
        if failure is not None:
            if failures is not None:
                failures.append(failure)
            where = "the final sample grid" if step is None else f"the sample grid of step {step}"
            say(
                accelerator,
                f"skipped {where}: it failed ({failure['error']}); its traceback is in {failure['traceback']}; "
                + ("the trained weights are written" if step is None else "training goes on"),
            )
        if skipped is not None:  # outside the except block: its traceback no longer pins the activations
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            say(
                accelerator,
                f"skipped the sample grid of step {step}: out of GPU memory ({skipped}); training goes on",
            )
        if grid is not None:
            _drop_stale_error(target, step)
        if tb is not None and grid is not None:
            # at the images seen, as the loss's points (progress.log_step): steps change scale on a moved resume
            tb.image("samples", grid, images if images is not None else shown_step or 0)
    if step is not None:
        accelerator.wait_for_everyone()
    return grid


def _drop_stale_error(grid: Path, step: int | None) -> None:
    """The ``.error.txt`` of a grid now written: an earlier session's failure of the same grid (a resume re-made
    it), which sat beside the good PNG. Kept where that session numbered its steps otherwise (another point of
    the run, :func:`grid_path`)."""
    error = grid.with_name(grid.stem + ".error.txt")
    with contextlib.suppress(OSError):
        if step is None or _SAME_STEPS or error.stat().st_mtime >= _SESSION_START:
            error.unlink()


def _grid_failure(exc: BaseException, grid: Path, step: int | None) -> dict[str, Any]:
    """The record of a sample grid that failed: its step (None: the final grid), the error's first line, and the
    file its full traceback went to (``final.error.txt`` for ``final.png``; where that cannot be written, the
    error says so instead)."""
    import traceback

    path = grid.with_name(grid.stem + ".error.txt")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError as e:
        path = f"not written ({e.strerror or type(e).__name__})"
    return {"step": step, "error": _first_line(exc)[:300], "traceback": str(path)}


@contextlib.contextmanager
def _grid_bar(accelerator, step: int | None, n_prompts: int, cfg):
    """The final grid's progress (``step`` None: after training, whose bar is closed; seconds to minutes on a
    real model) as ``on_step`` for ``sampling.sample_grid``; a grid during training (its own bar is live): None."""
    if step is not None:
        yield None
        return
    from .progress import Progress

    bar = Progress(
        accelerator,
        n_prompts * cfg.sampling.num_inference_steps,
        description="final sample grid",
        unit="denoising step",
        lines=4,
    )
    try:
        yield bar.update
    finally:
        bar.close()


def write_json_atomic(path: Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def in_folder(path: Path | str, folder: Path | str) -> str:
    """``path`` as a run summary lists it: relative to the run ``folder`` (posix) when it is in there, so the
    list stays true of a copied or moved folder; absolute otherwise."""
    path, folder = Path(path), Path(folder)
    candidates = (
        (path, folder),
        (Path(os.path.abspath(path)), Path(os.path.abspath(folder))),
        (Path(os.path.abspath(path)).parent.resolve() / path.name, folder.resolve()),
    )
    for p, f in candidates:
        if p.is_relative_to(f) and ".." not in p.relative_to(f).parts and p != f:
            return p.relative_to(f).as_posix()
    return str(Path(os.path.abspath(path)))


def write_run_summary(
    out_dir: Path,
    *,
    method: str,
    steps: int,
    epochs: float,
    images_seen: int,
    num_processes: int,
    final_loss: float | None,
    wall_seconds: float,
    peak_memory_bytes: int,
    outputs: list[Path | str],
    intermediate_outputs: list[dict[str, Any]] | None = None,
    sample_grid_failures: list[dict[str, Any]] | None = None,
    sampling_seconds: float = 0.0,
) -> dict[str, Any]:
    """``run_summary.json``. ``outputs``: listed relative to ``out_dir`` (:func:`in_folder`), with ``folder``,
    where it was written, so a copied or moved run folder's summary still names its own files (sdplan.launcher's
    ``_listed_outputs`` reads them). ``intermediate_outputs``: the outputs saved during training
    (output.save_every_n_*), each ``{"epoch", "step", "files"}`` (``epoch``: the epoch it ends, or the fraction
    reached). ``wall_seconds``: the run's, over its sessions (a resumed run adds its earlier sessions' time up to
    the checkpoint resumed). ``sample_grid_failures``: the grids the run skipped for an error other than out of
    memory, over its sessions (each checkpoint carries those before it), each ``{"step", "error", "traceback"}``
    (the key only where there are some)."""
    summary = {
        "method": method,
        "steps": steps,
        "epochs": epochs,
        "images_seen": images_seen,
        "num_processes": num_processes,
        "final_loss": None if final_loss is None or not math.isfinite(final_loss) else final_loss,
        "wall_seconds": round(wall_seconds, 3),
        "sampling_seconds": round(sampling_seconds, 3),
        "peak_memory_bytes": peak_memory_bytes,
        "folder": str(Path(out_dir).resolve()),
        "outputs": [in_folder(p, out_dir) for p in outputs],
        "intermediate_outputs": list(intermediate_outputs or []),
    }
    if sample_grid_failures:
        summary["sample_grid_failures"] = list(sample_grid_failures)
    write_json_atomic(Path(out_dir) / "run_summary.json", summary)
    return summary


def write_loss_history(out_dir: Path, history: dict[str, list]) -> Path:
    """``loss_history.json``: one entry per optimizer step (``TrainState.loss_history``): ``losses`` its mean
    loss, ``images_seen`` the images trained once it was taken (strictly increasing: loss.png's x axis) and
    ``steps`` its number in the run that took it (1-based; after a resume with another process count,
    micro-batch or accumulation the numbers continue in the new run's steps, ``sdplan.steps.moved_position``,
    so they can repeat or jump there)."""
    return write_json_atomic(Path(out_dir) / "loss_history.json", dict(history))


def run_metadata(
    cfg, *, steps: int, epochs: float, prediction_type: str, mixed_precision: str, **extra: Any
) -> dict[str, Any]:
    """What every output records (export turns it into string metadata): the config, the plan it came from,
    steps, epochs, the prediction type and the mixed precision the run trained in (accelerate's "no" / "fp16" /
    "bf16": "no" on the CPU, where a GPU plan's sdplan.yaml keeps its precision) (kohya's ss_* keys read these)."""
    return {
        "config": cfg,
        "plan": cfg.plan,
        "steps": steps,
        "epoch": epochs,
        "prediction_type": prediction_type,
        "mixed_precision": mixed_precision,
        **extra,
    }
