"""How `sdplan train` starts the trainer: a pure builder (config -> command, environment, launcher configs)
and a thin subprocess wrapper.

The builder decides between four launches, as accelerate's own `commands/launch.py` does from its args:

- one process (one GPU, or the CPU): ``python -m sdplan.trainer --config sdplan.yaml``;
- several GPUs, or several machines: ``accelerate launch --config_file accelerate.yaml -m sdplan.trainer ...``
  with a ``MULTI_GPU`` (DDP) accelerate config; on several machines the config carries num_machines,
  machine_rank and the main process address, and each node runs the same command with its own
  ``--machine_rank``;
- DeepSpeed ZeRO-2 with CPU optimizer offload: ``accelerate launch`` with ``distributed_type: DEEPSPEED`` and
  the written ``deepspeed.json`` (train_batch_size = micro batch x grad accumulation x world size); on the CPU
  (``DS_ACCELERATOR=cpu``) in one process or several (``--num-processes N``: accelerate's DeepSpeed launcher
  runs torchrun, and the trainer names accelerate the gloo backend: ``trainer/runtime.py``'s make_accelerator);
- CPU-only with ``--num-processes N``, without DeepSpeed: ``torchrun --nproc_per_node N -m sdplan.trainer ...``:
  N real processes with gloo (``accelerate launch --cpu`` alone would run one process).

Nothing here touches the file system or the environment; ``run_launch`` is the only side effect.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdplan.config import TrainConfig
from sdplan.errors import EXIT_INTERRUPTED, UsageError
from sdplan.settings import DEEPSPEED_BUCKET_ELEMENTS, deepspeed_reduce_buckets
from sdplan.terminal import HANGUP, detach_from_terminal, hangup_wanted, terminal_fds
from sdplan.trainer.dataset_scan import count_of

# torchrun / accelerate launch run through sdplan.distrun: a stop signal or a failed worker ends them without a
# traceback of their own (the worker's one error line stays the only one)
DISTRUN = "sdplan.distrun"
DEFAULT_PORT = 29500  # accelerate's and torchrun's rendezvous port
LAUNCHED_ENV = "SDPLAN_LAUNCHED"  # set for a trainer started by `sdplan train`
# {output.dir}/REPORTED_FILE (holding that line): such a trainer printed its one-line error, so `sdplan train`
# exits with its code and prints no second line
REPORTED_FILE = "error.txt"

TRAINER_MODULE = "sdplan.trainer"
ACCELERATE_FILE = "accelerate.yaml"
DEEPSPEED_FILE = "deepspeed.json"
MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}  # training.precision -> accelerate's mixed_precision
# How long torchrun (and accelerate launch, which runs it) lets its workers finish after Ctrl-C or SIGTERM
# before it kills them (torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, default 30 s): they write their interrupt
# checkpoint first, which for a full fine-tune takes longer than 30 s.
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 600
# Defaults the launch sets that a user's own environment setting overrides.
SOFT_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", SHUTDOWN_TIMEOUT_ENV)


@dataclass(frozen=True)
class Launch:
    """What to run, with what extra environment, and the launcher files to write beside sdplan.yaml."""

    cmd: list[str]
    env: dict[str, str]
    accelerate_config: dict[str, Any] | None = None  # written to {out}/accelerate.yaml
    deepspeed_config: dict[str, Any] | None = None  # written to {out}/deepspeed.json
    per_node_commands: list[str] = field(default_factory=list)  # several machines: one line per node
    kind: str = "single"  # single | cpu-multi | multi-gpu | deepspeed
    world_size: int = 1

    def shell(self) -> str:
        """The command as one line a user can paste (environment first)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.cmd)


def world_size(cfg: TrainConfig, cpu_processes: int | None = None) -> int:
    return cpu_processes if cpu_processes else cfg.distributed.num_processes


def accelerate_config(
    cfg: TrainConfig,
    *,
    deepspeed_file: str | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = DEFAULT_PORT,
    gpu_ids: str = "all",
) -> dict[str, Any]:
    """The accelerate config YAML (as a dict) for ``accelerate launch --config_file``, for this node of
    ``num_machines`` (field notes section 5: ``distributed_type`` is NO / MULTI_GPU / DEEPSPEED).

    ``num_processes`` is the total over all machines, as accelerate expects; the trainer's
    ``distributed.num_processes`` is that same world size. With DeepSpeed, the ZeRO settings, accumulation,
    clipping and precision live in ``deepspeed_file`` (the JSON from :func:`deepspeed_config`; give an absolute
    path, accelerate resolves it from its working folder): accelerate 1.x refuses a ``deepspeed_config_file``
    beside inline ZeRO keys or ``mixed_precision``, so those are left out here.

    ``gpu_ids``: the GPUs the run uses, as ``CUDA_VISIBLE_DEVICES`` takes them (:func:`accelerate_gpu_ids`):
    ``accelerate launch`` sets that variable to it, so a hand launch of the file runs on the planned GPUs.
    """
    num_processes = cfg.distributed.num_processes
    precision = cfg.training.precision
    if num_processes < 1:
        raise ValueError("num_processes must be >= 1")
    if precision not in MIXED:
        raise ValueError(f"precision must be one of {', '.join(MIXED)}")
    deepspeed = cfg.distributed.deepspeed is not None
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED" if deepspeed else ("MULTI_GPU" if num_processes > 1 else "NO"),
        "mixed_precision": MIXED[precision],
        "num_processes": num_processes,
        "num_machines": num_machines,
        "machine_rank": machine_rank,
        "main_process_ip": main_process_ip if num_machines > 1 else None,
        "main_process_port": main_process_port,
        "gpu_ids": gpu_ids,
        "use_cpu": False,
        "downcast_bf16": "no",
        "rdzv_backend": "static",
        "same_network": True,
    }
    if deepspeed:
        del out["mixed_precision"]
        out["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_file or DEEPSPEED_FILE,
            "zero3_init_flag": False,
        }
    return out


def accelerate_gpu_ids(devices: Mapping[str, str] | None) -> str:
    """accelerate's ``gpu_ids`` for a launch with ``devices`` (:meth:`sdplan.machine.Snapshot.visible_devices`):
    its ``CUDA_VISIBLE_DEVICES``, which ``accelerate launch`` sets again to the same; "all" otherwise. AMD's
    ``HIP_VISIBLE_DEVICES`` stays alone: ROCm applies ``CUDA_VISIBLE_DEVICES`` after it, to the GPUs it left."""
    return (devices or {}).get("CUDA_VISIBLE_DEVICES") or "all"


def deepspeed_config(
    cfg: TrainConfig, *, world_size: int | None = None, cpu: bool | None = None
) -> dict[str, Any] | None:
    """The DeepSpeed JSON for ZeRO-1/2, optimizer state offloaded to CPU when planned; None without DeepSpeed.
    DeepSpeed checks train_batch_size == micro batch x grad accumulation x world size.

    ``world_size`` / ``cpu``: the world and device the run really has, where they are known and may differ from
    ``distributed.num_processes`` and ``training.device`` (a process not started by ``accelerate launch``:
    trainer/runtime.py make_accelerator); default: the config's."""
    ds = cfg.distributed.deepspeed
    if ds is None:
        return None
    t = cfg.training
    world = cfg.distributed.num_processes if world_size is None else world_size
    on_cpu = t.device == "cpu" if cpu is None else cpu
    for name, v in (("micro_batch", t.batch_size), ("grad_accum", t.grad_accum), ("world_size", world)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1")
    if ds.zero_stage not in (1, 2):
        raise ValueError("zero_stage must be 1 or 2 (optimizer offload; parameter offload needs ZeRO-3)")
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        # overlapping the reduction with the backward costs a second bucket (0.93 GiB of bf16), worth it only
        # where there is a reduction to overlap: several processes
        "overlap_comm": deepspeed_reduce_buckets(world) == 2,
        "contiguous_gradients": True,
        "reduce_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
        "allgather_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
    }
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": t.batch_size * t.grad_accum * world,
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        # fp16 is a GPU feature: on the CPU (DeepSpeed's CPU accelerator refuses it) the run trains in fp32,
        # as it does without DeepSpeed
        "fp16": {
            "enabled": t.precision == "fp16" and not on_cpu,
            "loss_scale": 0,
            "initial_scale_power": 16,
        },
        "bf16": {"enabled": t.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        # On the CPU the offloaded optimizer is the run's own torch AdamW: accelerate would swap in DeepSpeed's
        # CPU Adam, whose C++ op DeepSpeed compiles on first use (1.5-3 minutes of both cores of a 2-core machine,
        # again for every new environment) to speed up a step these CPU runs (the demo, the tests) barely have.
        # GPU runs keep DeepSpeed's CPU Adam (the planner's offload time is its measured rate).
        "zero_force_ds_cpu_optimizer": not (on_cpu and ds.offload_optimizer),
        "steps_per_print": 100,
    }


def build_launch(
    cfg: TrainConfig,
    config_path: str | Path,
    out_dir: str | Path,
    *,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: str | None = None,
    main_process_port: int = DEFAULT_PORT,
    cpu_processes: int | None = None,
    resume: str | None = None,
    python: str | None = None,
    cpu_cores: int | None = None,
    devices: Mapping[str, str] | None = None,
) -> Launch:
    """Pure: the launch for ``cfg`` (already validated, the one written at ``config_path``).

    ``cpu_processes``: run that many CPU processes with gloo (``--num-processes``): through torchrun, or
    accelerate's DeepSpeed launcher with DeepSpeed.
    ``resume``: passed to the trainer as ``--resume`` ("latest" or a checkpoint folder).
    ``python``: the interpreter (default: this one), ``cpu_cores``: splits threads between CPU processes.
    ``devices``: the environment that shows the processes only the GPUs they run on (``distributed.gpu_ids``,
    :meth:`sdplan.machine.Snapshot.visible_devices`); None: every GPU, the framework's first ones used.
    """
    py = python or sys.executable
    out = Path(out_dir)
    config_path = str(config_path)
    trainer_args = ["-m", TRAINER_MODULE, "--config", config_path]
    if resume:
        trainer_args += ["--resume", str(resume)]
    # PYTHONSAFEPATH (Python >= 3.11, inherited by torchrun/accelerate workers): the trainer never imports
    # from the working folder, where a folder named `sdplan` would shadow this package.
    # SDPLAN_LAUNCHED: sdplan prints the run's summary itself, so the trainer does not print its own as well.
    env = {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", LAUNCHED_ENV: "1"}
    on_cpu = cfg.training.device == "cpu"
    if devices and not on_cpu:
        env.update(devices)
    ds = cfg.distributed.deepspeed
    if on_cpu:
        from sdplan.cputhreads import thread_env

        procs = cpu_processes or cfg.distributed.num_processes
        env.update(thread_env(procs, cpu_cores if cpu_cores else procs))

    if num_machines < 1:
        raise UsageError(f"--num-machines must be >= 1, got {num_machines}")
    if num_machines == 1 and (machine_rank or main_process_ip):
        # a node that forgot --num-machines would train alone, not join machine 0's run
        given = "--machine-rank" if machine_rank else "--main-process-ip"
        raise UsageError(
            f"{given} is for a run on several machines, but --num-machines is 1",
            fix="add --num-machines N (the number of machines), or drop it",
        )
    if num_machines > 1:
        if cpu_processes:
            raise UsageError("--num-processes (CPU processes) does not combine with --num-machines")
        if not main_process_ip:
            raise UsageError("several machines need the address of machine 0", fix="add --main-process-ip IP")
        if not 0 <= machine_rank < num_machines:
            raise UsageError(f"--machine-rank must be in 0..{num_machines - 1}, got {machine_rank}")
        if not 1 <= main_process_port <= 65535:
            raise UsageError(f"--main-process-port must be in 1..65535, got {main_process_port}")

    if cpu_processes is not None:
        if cpu_processes < 1:
            raise UsageError(f"--num-processes must be >= 1, got {cpu_processes}")
        if cfg.distributed.num_processes != cpu_processes:
            raise UsageError(
                f"distributed.num_processes is {cfg.distributed.num_processes} but --num-processes is "
                f"{cpu_processes}; they must agree"
            )
        if not on_cpu:
            raise UsageError("--num-processes runs CPU processes", fix="add --device cpu")

    if on_cpu and ds is not None:
        # DeepSpeed's CPU accelerator, launched by accelerate's DeepSpeed launcher (one process or several).
        env["DS_ACCELERATOR"] = "cpu"

    if cfg.distributed.num_processes > 1 or num_machines > 1:
        env[SHUTDOWN_TIMEOUT_ENV] = str(SHUTDOWN_TIMEOUT_S)

    # CPU, several processes without DeepSpeed: torchrun with gloo (accelerate sees MULTI_CPU).
    if on_cpu and ds is None and cfg.distributed.num_processes > 1:
        n = cfg.distributed.num_processes
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [
            py,
            "-m",
            DISTRUN,
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(n),
            *trainer_args,
        ]
        return Launch(cmd=cmd, env=env, kind="cpu-multi", world_size=n)

    world = cfg.distributed.num_processes
    if ds is None and world == 1 and num_machines == 1:
        if on_cpu:
            env["ACCELERATE_USE_CPU"] = "true"
        acc = accelerate_config(cfg, gpu_ids=accelerate_gpu_ids(devices)) if not on_cpu else None
        return Launch(cmd=[py, *trainer_args], env=env, accelerate_config=acc, kind="single", world_size=1)

    if world % num_machines:
        raise UsageError(
            f"{world} processes do not split evenly over {num_machines} machines",
            fix="give every machine the same number of GPUs",
        )
    acc_path = str(out / ACCELERATE_FILE)
    ds_path = str(out / DEEPSPEED_FILE)
    acc = accelerate_config(
        cfg,
        deepspeed_file=ds_path if ds is not None else None,
        num_machines=num_machines,
        machine_rank=machine_rank,
        main_process_ip=main_process_ip,
        main_process_port=main_process_port,
        gpu_ids=accelerate_gpu_ids(None if on_cpu else devices),
    )
    launcher = ["--config_file", acc_path]
    cmd = [py, "-m", DISTRUN, "accelerate.commands.launch", *launcher, *trainer_args]
    per_node: list[str] = []
    if num_machines > 1:
        # The same files on every node (same paths); only the rank differs.
        cmd = [
            py,
            "-m",
            DISTRUN,
            "accelerate.commands.launch",
            *launcher,
            "--machine_rank",
            str(machine_rank),
        ]
        cmd += trainer_args
        for rank in range(num_machines):
            per_node.append(
                shlex.join(["accelerate", "launch", *launcher, "--machine_rank", str(rank), *trainer_args])
            )
    return Launch(
        cmd=cmd,
        env=env,
        accelerate_config=acc,
        deepspeed_config=deepspeed_config(cfg),
        per_node_commands=per_node,
        kind="deepspeed" if ds is not None else "multi-gpu",
        world_size=world,
    )


# -- the one side effect ---------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on this machine now (the OS picks it): a one-machine run's rendezvous port, so two runs
    started at once on one machine do not both take accelerate's default 29500 (the second failed with
    EADDRINUSE: accelerate's own in-use check races with a launch starting beside it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def one_process_world(cpu: bool) -> dict[str, str]:
    """The environment of a one-process world DeepSpeed starts in without a launcher: rank 0 of 1, its own
    rendezvous on this machine (a free port: another run here may hold any fixed one), and DeepSpeed's CPU
    accelerator for a CPU run. `sdplan bench`'s DeepSpeed probes run in it (bench_harness.probe_in_process), and
    so does a trainer started by hand (trainer/runtime.py rendezvous_for_one_process)."""
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """Linux: a ``preexec_fn`` that asks the kernel to send the child SIGTERM when this process dies
    (``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of sdplan or a closed terminal cannot leave the trainer
    running unseen; the trainer treats SIGTERM as an interrupt (checkpoint, exit 130). Elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - no libc
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # sdplan died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
# How long the training processes a dead launcher left get to write their checkpoint after SIGTERM, as torchrun
# gives them (SHUTDOWN_TIMEOUT_S), before SIGKILL.
ORPHAN_STOP_TIMEOUT_S = SHUTDOWN_TIMEOUT_S
# How long they get to end after SIGKILL; one that has not (uninterruptible sleep) is reported, not waited for.
ORPHAN_KILL_TIMEOUT_S = 30.0


def _subreaper(on: bool) -> bool:
    """Linux: make this process the child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) or stop being one: the
    processes a dead launcher leaves (torchrun starts each worker in a session of its own) become this
    process's children instead of init's, so they can be found, stopped and waited for. Returns whether it took
    effect; elsewhere False."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc
        return False


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; empty elsewhere)."""
    found = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[-1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def _reap(pids: set[int]) -> set[int]:
    """Those of ``pids`` (children of this process) still running; the ones that ended are reaped."""
    alive = set()
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            alive.add(pid)
    return alive


def stop_orphans(
    pids: set[int],
    *,
    timeout: float = ORPHAN_STOP_TIMEOUT_S,
    kill_timeout: float = ORPHAN_KILL_TIMEOUT_S,
    stop: Callable[[], bool],
) -> set[int]:
    """The training processes a dead launcher left (children of this subreaper): SIGTERM (they stop as on
    Ctrl-C: a checkpoint, exit 130), then wait for them; SIGKILL after ``timeout`` seconds or once ``stop()``
    says so (a Ctrl-C while waiting). Returns once every one has ended, so the run lock is released only then;
    or ``kill_timeout`` seconds after the SIGKILL, with the pids still there (a process in uninterruptible sleep
    -- a wedged GPU driver, a hung network file system -- outlives SIGKILL: the wait had no end, and no Ctrl-C
    got sdplan out of it)."""
    import time

    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed_at = None
    while pids := _reap(pids):
        if killed_at is None and (time.monotonic() > deadline or stop()):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
        elif killed_at is not None and time.monotonic() - killed_at > kill_timeout:
            return pids
        time.sleep(0.1)
    return set()


def run_launch(
    launch: Launch,
    *,
    environ: Mapping[str, str] | None = None,
    on_start: Callable[[int], None] | None = None,
) -> int:
    """Run the launch; the child's output streams through. Returns the trainer's exit code.

    The child gets its own process group. Ctrl-C (SIGINT), SIGTERM or SIGHUP (the terminal closed; not under
    ``nohup``) here is forwarded to that whole group (torchrun/accelerate and every trainer process; a hangup
    as SIGHUP, after pointing our own terminal output at /dev/null), and we wait: the trainer writes its interrupt
    checkpoint and exits 130. A second Ctrl-C sends SIGINT again to a lone trainer (which aborts on it) and
    SIGTERM to a launcher, a third SIGKILL. If sdplan itself dies (kill -9,
    a closed terminal), the kernel sends the child SIGTERM (Linux, see ``_die_with_parent``); torchrun and
    accelerate pass it on to their workers. ``on_start(pid)`` is called once the child runs (the run lock
    records it). Settings in ``SOFT_ENV`` (threads, torchrun's shutdown timeout) that the user set in the
    environment are kept (an empty value counts as not set: accelerate and torch read it as a number).

    If the launcher itself dies (a ``kill -9`` of torchrun), its workers, each in a session of its own, would
    train on after sdplan reported the failure and released the run lock, beside a ``--resume``: this process is
    their subreaper while the launch runs (Linux, :func:`_subreaper`), and they are stopped with a checkpoint
    and waited for (:func:`stop_orphans`) before this returns.
    """
    env = dict(os.environ if environ is None else environ)
    env.update({k: v for k, v in launch.env.items() if not (k in SOFT_ENV and env.get(k, "").strip())})
    proc: subprocess.Popen | None = None
    early: list[int | None] = []  # stop signals that came before the child existed
    signals_sent = 0
    # The trainer stops at a first SIGINT (a checkpoint) and aborts at a second ("Ctrl-C again to abort"); it
    # takes a SIGTERM after a first stop as the same request, so a second Ctrl-C forwarded as SIGTERM did nothing
    # and only a third (SIGKILL) ended it. A launcher (torchrun / accelerate) passes its own SIGTERM on.
    second = signal.SIGINT if launch.kind == "single" else signal.SIGTERM
    escalation = (signal.SIGINT, second, signal.SIGKILL)
    ttys = terminal_fds()
    orphans: set[int] = set()

    def forward(signum: int | None = None, frame: Any = None) -> None:
        nonlocal signals_sent
        if proc is None:
            early.append(signum)
            return
        if orphans:  # waiting for what a dead launcher left: stop_orphans kills them on the next poll
            signals_sent += 1
            return
        sig = escalation[min(signals_sent, len(escalation) - 1)]
        if signum is not None and signum == HANGUP:
            # The terminal closed: our output goes nowhere from now on, and the trainer is told why it stops
            # (SIGHUP: it stops like SIGTERM, checkpoint and exit 130, with its own output detached too).
            detach_from_terminal(ttys)
            if signals_sent == 0:
                sig = signal.Signals(HANGUP)
        signals_sent += 1
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    # The handlers go in before the child starts: a signal between the start and their installation would
    # otherwise kill sdplan (SIGHUP, SIGTERM) or escape as KeyboardInterrupt, and the trainer would not be told.
    handled = [signal.SIGINT, signal.SIGTERM] + ([signal.Signals(HANGUP)] if hangup_wanted() else [])
    previous: dict[int, Any] = {}
    for s in handled:
        try:
            previous[s] = signal.signal(s, forward)
        except ValueError:  # not the main thread
            break
    reaper = launch.kind != "single" and _subreaper(True)  # a launcher between sdplan and the trainers
    # children this process had before the launch are not the launch's (read only where orphans are reaped)
    ours = _children(os.getpid()) if reaper else set()
    try:
        proc = subprocess.Popen(
            launch.cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent(os.getpid())
        )
        if on_start is not None:
            on_start(proc.pid)
        for signum in early:
            forward(signum)
        code = proc.wait()
        if reaper and code != 0 and (left := _reap(_children(os.getpid()) - ours - {proc.pid})):
            orphans.update(left)
            them, they, are = (
                ("it", "it writes", "it is") if len(left) == 1 else ("them", "they write", "they are")
            )
            print(
                f"the launcher (pid {proc.pid}) ended with "
                f"{count_of(len(left), 'training process', 'training processes')} still running: "
                f"stopping {them} ({they} a checkpoint) before the run folder is released; waiting up to "
                f"{ORPHAN_STOP_TIMEOUT_S:.0f} s, Ctrl-C stops waiting ({are} killed, without a checkpoint)",
                file=sys.stderr,
                flush=True,
            )
            before = signals_sent
            if stuck := stop_orphans(left, stop=lambda: signals_sent > before):
                one = len(stuck) == 1
                print(
                    f"training process{'' if one else 'es'} {', '.join(map(str, sorted(stuck)))} did not end "
                    f"{ORPHAN_KILL_TIMEOUT_S:.0f} s after SIGKILL (stuck in the kernel: a hung GPU driver or "
                    f"file system?); sdplan stops waiting for {'it' if one else 'them'}: check "
                    f"{'it is' if one else 'they are'} gone (ps -p PID) before resuming the run",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if reaper:
            _subreaper(False)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals_sent and code != 0:
        # torchrun and accelerate turn a child's exit into their own (1 or -SIGINT): report an interrupt.
        return EXIT_INTERRUPTED
    if code < 0:
        return 128 - code
    return code
