"""``python -m sdplan.trainer --config sdplan.yaml [key=value ...] [--resume latest|DIR]``

Also under ``accelerate launch -m sdplan.trainer ...`` and ``torchrun --nproc_per_node N -m sdplan.trainer ...``.

Exit codes: 0 done; 130 interrupted by SIGINT/SIGTERM (a checkpoint was written: continue with
``--resume latest``); 75 CUDA out of memory (``{output.dir}/oom.json`` holds step, batch_size, grad_accum,
gradient_checkpointing and the message, so the launcher can retry with a smaller micro-batch); 1 or 2 for other
errors the user can fix (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _err(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def _tell_the_launcher(out_dir, e) -> None:
    """Under `sdplan train`: say that the error line is printed, so sdplan adds no second one (best effort: an
    output folder that cannot be written only costs that second line)."""
    from sdplan.launch import LAUNCHED_ENV, REPORTED_FILE

    if not os.environ.get(LAUNCHED_ENV):
        return
    import contextlib
    from pathlib import Path

    with contextlib.suppress(OSError):
        (Path(out_dir) / REPORTED_FILE).write_text(f"error: {e}\n")


def _quiet_libraries() -> None:
    """The trainer prints its own progress: keep the libraries' loading bars and advice out of the log
    (errors still show)."""
    import warnings

    from sdplan.quiet import quiet_library_notes

    quiet_library_notes()  # bitsandbytes' and DeepSpeed's import-time notes (diffusers, peft, accelerate)

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for lib in (diffusers_logging, transformers_logging):
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\.")


def _leave_out_unused_libraries(cfg, modules: dict = sys.modules) -> None:
    """Mark bitsandbytes and DeepSpeed as not installed in a run that uses neither: ``None`` in ``sys.modules``
    (Python's documented way to block an import) makes ``find_spec`` answer None, so diffusers, peft and accelerate
    take them for absent. Installed, diffusers imports bitsandbytes with itself (``diffusers.quantizers``) and
    accelerate imports DeepSpeed to unwrap any model (``extract_model_from_parallel``): about 3 s of each
    trainer process's start, in each process of a multi-GPU run (`sdplan train --demo` on this project's shared
    2-core CPU machine: 10.1-11.5 s with both imported, 7.6-10.0 s without).
    The trainer imports bitsandbytes only for 8-bit AdamW and the nf4 base, DeepSpeed only under DeepSpeed (its
    config's or accelerate's)."""
    if cfg.memory.optimizer != "adamw8bit" and cfg.model.base_precision != "nf4":
        modules.setdefault("bitsandbytes", None)
    from .runtime import launched_with_deepspeed  # torch-free at import

    if cfg.distributed.deepspeed is None and not launched_with_deepspeed():
        modules.setdefault("deepspeed", None)


# what a collective raises in the processes left when another one of the run died (a crash, the kernel's
# out-of-memory killer): gloo's RuntimeError ("Connection closed by peer ... typically caused by a remote worker
# crashing"), NCCL's DistBackendError where its peer's process exited (or a socket it used was reset). Matched
# by these words only, anywhere in the message: an NCCL set-up error or a timeout raises the same classes and
# keeps its own full message (traceback).
_LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "remote process exited",
)


def _lost_peer(e: BaseException) -> str | None:
    """One line for a collective that failed because another process of the run is gone (its own line, or the
    launcher's "was killed by", says why): printed once instead of each survivor's 30-line traceback. None for
    any other error, and outside a multi-process run."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2 or not any(m in str(e) for m in _LOST_PEER):
        return None
    text = str(e).strip().splitlines()[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[.../pair.cc:553] " source prefix
    text = re.sub(
        r"^NCCL error in: \S+:\d+, ", "NCCL: ", text
    )  # NCCL's "NCCL error in: .../NCCLUtils.hpp:317, "
    text = re.sub(r", NCCL version .*$", "", text).split(". ")[0]
    return f"another process of this run stopped, or the network between them failed ({text[:120]}); this one stopped too"


def _cpu_threads(cfg, torch) -> None:
    """CPU training started without OMP_NUM_THREADS (not by `sdplan train`): physical cores / processes."""
    if cfg.training.device != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    from sdplan.cputhreads import threads_per_process

    torch.set_num_threads(threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """The trainer's command line. ``own_process``: this process ends with the run (``python -m``), so the
    libraries the run does not use may be left out of it (:func:`_leave_out_unused_libraries`); a caller that
    goes on after the run keeps them. Ctrl-C outside the steps (torch and the libraries importing, the model
    loading, the export) ends it with the interrupted exit code: under `sdplan train`, sdplan says so and
    whether a checkpoint is there to resume from; a traceback from inside an import says nothing."""
    from sdplan.terminal import print_undecodable_names

    print_undecodable_names()  # a Latin-1 file name in the lines it prints
    try:
        return _main(argv, own_process)
    except KeyboardInterrupt:
        from sdplan.errors import EXIT_INTERRUPTED
        from sdplan.launch import LAUNCHED_ENV

        if _rank() == 0 and not os.environ.get(LAUNCHED_ENV):
            _err("aborted")
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None, own_process: bool) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sdplan.trainer", description="Train as sdplan.yaml says."
    )
    parser.add_argument("--config", required=True, help="sdplan.yaml (written by `sdplan recommend --out`)")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint folder")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. training.batch_size=2")
    args = parser.parse_intermixed_args(argv)

    import sdplan
    from sdplan.terminal import guard_terminal_output

    guard_terminal_output()  # EIO from a closed terminal is a hangup (stop with a checkpoint), not a crash

    if not hasattr(
        sdplan, "__version__"
    ):  # a folder named sdplan shadows the package: fail now, not at export
        where = ", ".join(getattr(sdplan, "__path__", [])) or "?"
        _err(f"`sdplan` resolves to {where}, not the installed package; run from another folder")
        return 2

    from sdplan import config
    from sdplan.errors import SdplanError

    try:
        cfg = config.load(args.config, args.overrides)
    except SdplanError as e:
        _err(str(e))
        return e.exit_code

    if own_process:
        _leave_out_unused_libraries(cfg)
    _quiet_libraries()
    import torch

    _cpu_threads(cfg, torch)

    from . import run, stops

    try:
        summary = run.train(cfg, resume=args.resume)
    except stops.OutOfMemoryStop as e:
        _err(str(e))
        return e.exit_code
    except stops.TrainingInterrupted as e:
        if _rank() == 0:
            print(str(e), file=sys.stderr, flush=True)
        return e.exit_code
    except SdplanError as e:
        if _rank() == 0:
            _err(str(e))
            _tell_the_launcher(cfg.output.dir, e)
        return e.exit_code
    except torch.OutOfMemoryError as e:  # outside the loop, e.g. moving the model to the GPU
        report = stops.write_oom_report(cfg.output.dir, step=0, cfg=cfg, message=str(e))
        _err(f"out of GPU memory before training started; details in {report}")
        return stops.EXIT_OOM
    except RuntimeError as e:
        lost = _lost_peer(e)
        if lost is None:
            raise
        if _rank() == 0:
            _err(lost)
        return 1
    finally:
        # DDP's reducer and gloo's finished work keep tensors in reference cycles; freed during interpreter
        # shutdown they take the GIL and the process aborts after a finished run ("terminate called without an
        # active exception", exit -6: pytorch/pytorch#190489, PR 179291): collect them while Python is alive
        gc.collect()
    from sdplan.launch import LAUNCHED_ENV

    if summary and not os.environ.get(LAUNCHED_ENV):  # under `sdplan train`, sdplan prints the summary
        loss = summary["final_loss"]
        loss_text = f"final loss {loss:.4f}, " if isinstance(loss, float) else ""
        print(
            f"done: {summary['steps']} steps, {summary['images_seen']} images, {loss_text}"
            f"{summary['wall_seconds']:.1f} s; outputs in {cfg.output.dir}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    from sdplan.procexit import exit_process

    # the atexit handlers and a flush, without the 1-2 s interpreter teardown
    exit_process(main(own_process=True))
