"""The launch builder: config -> exact command, environment and launcher configs, for every kind of launch."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from limits import scaled

from sdplan.config import validate
from sdplan.errors import UsageError
from sdplan.launch import Launch, build_launch, run_launch

PY = "/venv/bin/python"
CFG = "/runs/a/sdplan.yaml"
OUT = "/runs/a"
TRAINER = ["-m", "sdplan.trainer", "--config", CFG]


def cfg(**sections):
    data = {"training": {"batch_size": 2, "grad_accum": 3, "precision": "bf16"}}
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return validate(data)


def test_one_gpu_is_one_plain_process():
    launch = build_launch(cfg(), CFG, OUT, python=PY)
    assert launch.cmd == [PY, *TRAINER]
    assert launch.kind == "single"
    assert launch.env == {"PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1", "SDPLAN_LAUNCHED": "1"}
    assert launch.deepspeed_config is None
    assert launch.per_node_commands == []
    # accelerate.yaml is still written, for the record and for `accelerate launch` by hand.
    acc = launch.accelerate_config
    assert acc["distributed_type"] == "NO"
    assert acc["num_processes"] == 1
    assert acc["mixed_precision"] == "bf16"


def test_resume_is_passed_to_the_trainer():
    launch = build_launch(cfg(), CFG, OUT, python=PY, resume="latest")
    assert launch.cmd == [PY, *TRAINER, "--resume", "latest"]


def test_fp32_is_mixed_precision_no():
    launch = build_launch(cfg(training={"precision": "fp32"}), CFG, OUT, python=PY)
    assert launch.accelerate_config["mixed_precision"] == "no"


def test_two_gpus_use_accelerate_launch_with_ddp_config():
    launch = build_launch(cfg(distributed={"num_processes": 2}), CFG, OUT, python=PY)
    assert launch.cmd == [
        PY,
        "-m",
        "sdplan.distrun",
        "accelerate.commands.launch",
        "--config_file",
        "/runs/a/accelerate.yaml",
        *TRAINER,
    ]
    assert launch.kind == "multi-gpu"
    assert launch.world_size == 2
    acc = launch.accelerate_config
    assert acc["distributed_type"] == "MULTI_GPU"
    assert acc["num_processes"] == 2
    assert acc["num_machines"] == 1
    assert acc["machine_rank"] == 0
    assert acc["mixed_precision"] == "bf16"
    assert acc["use_cpu"] is False
    assert acc.get("main_process_ip") is None  # one machine: accelerate picks localhost
    assert "deepspeed_config" not in acc
    assert launch.deepspeed_config is None


def test_deepspeed_offload_writes_json_with_batch_arithmetic():
    c = cfg(distributed={"num_processes": 4, "deepspeed": {"zero_stage": 2, "offload_optimizer": True}})
    launch = build_launch(c, CFG, OUT, python=PY)
    assert launch.kind == "deepspeed"
    assert launch.cmd[:6] == [
        PY,
        "-m",
        "sdplan.distrun",
        "accelerate.commands.launch",
        "--config_file",
        "/runs/a/accelerate.yaml",
    ]
    acc = launch.accelerate_config
    assert acc["distributed_type"] == "DEEPSPEED"
    assert acc["num_processes"] == 4
    assert acc["deepspeed_config"] == {
        "deepspeed_config_file": "/runs/a/deepspeed.json",
        "zero3_init_flag": False,
    }
    # accelerate refuses mixed_precision beside a deepspeed_config_file: the JSON carries it.
    assert "mixed_precision" not in acc
    ds = launch.deepspeed_config
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 4
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is True  # on a GPU: accelerate swaps in DeepSpeed's CPU Adam
    assert "offload_param" not in ds["zero_optimization"]  # parameter offload exists only with ZeRO-3
    assert ds["bf16"] == {"enabled": True}
    assert ds["fp16"]["enabled"] is False
    assert ds["gradient_clipping"] == 1.0


def test_deepspeed_on_one_gpu_still_goes_through_accelerate():
    c = cfg(distributed={"num_processes": 1, "deepspeed": {"zero_stage": 2}}, training={"precision": "fp16"})
    launch = build_launch(c, CFG, OUT, python=PY)
    assert launch.cmd[2:4] == ["sdplan.distrun", "accelerate.commands.launch"]
    assert launch.deepspeed_config["train_batch_size"] == 2 * 3 * 1
    assert launch.deepspeed_config["fp16"]["enabled"] is True
    assert "DS_ACCELERATOR" not in launch.env


def test_deepspeed_on_cpu_selects_the_cpu_accelerator():
    c = cfg(
        distributed={"deepspeed": {"zero_stage": 2}},
        training={"device": "cpu", "precision": "fp32"},
    )
    launch = build_launch(c, CFG, OUT, python=PY)
    assert launch.env["DS_ACCELERATOR"] == "cpu"
    assert launch.kind == "deepspeed"


def test_deepspeed_in_two_cpu_processes_is_one_accelerate_launch_of_two():
    """2 CPU processes with DeepSpeed: accelerate's DeepSpeed launcher starts both (torchrun inside it), on
    DeepSpeed's CPU accelerator, one thread each; DeepSpeed's batch counts both processes."""
    c = cfg(
        distributed={"num_processes": 2, "deepspeed": {"zero_stage": 2, "offload_optimizer": True}},
        training={"device": "cpu", "precision": "fp32", "batch_size": 2, "grad_accum": 3},
    )
    launch = build_launch(c, CFG, OUT, python=PY, cpu_processes=2, cpu_cores=2)
    assert launch.cmd == [PY, "-m", "sdplan.distrun", "accelerate.commands.launch", "--config_file",
                          "/runs/a/accelerate.yaml", *TRAINER]  # fmt: skip
    assert (launch.kind, launch.world_size) == ("deepspeed", 2)
    assert launch.env["DS_ACCELERATOR"] == "cpu" and launch.env["OMP_NUM_THREADS"] == "1"
    assert "ACCELERATE_USE_CPU" not in launch.env  # accelerate turns DeepSpeed off with it
    acc = launch.accelerate_config
    assert (acc["distributed_type"], acc["num_processes"], acc["use_cpu"]) == ("DEEPSPEED", 2, False)
    assert launch.deepspeed_config["train_batch_size"] == 2 * 3 * 2
    # on the CPU the offloaded optimizer stays torch's AdamW: no CPU Adam op to compile
    assert launch.deepspeed_config["zero_force_ds_cpu_optimizer"] is False


def test_two_machines_per_node_config_and_commands():
    c = cfg(distributed={"num_processes": 8})
    launch = build_launch(
        c,
        CFG,
        OUT,
        python=PY,
        num_machines=2,
        machine_rank=1,
        main_process_ip="10.0.0.1",
        main_process_port=29555,
    )
    acc = launch.accelerate_config
    assert acc["distributed_type"] == "MULTI_GPU"
    assert acc["num_processes"] == 8  # the total over both machines
    assert acc["num_machines"] == 2
    assert acc["machine_rank"] == 1
    assert acc["main_process_ip"] == "10.0.0.1"
    assert acc["main_process_port"] == 29555
    assert acc["rdzv_backend"] == "static"
    assert launch.cmd == [
        PY,
        "-m",
        "sdplan.distrun",
        "accelerate.commands.launch",
        "--config_file",
        "/runs/a/accelerate.yaml",
        "--machine_rank",
        "1",
        *TRAINER,
    ]
    assert launch.per_node_commands == [
        "accelerate launch --config_file /runs/a/accelerate.yaml --machine_rank 0 "
        "-m sdplan.trainer --config /runs/a/sdplan.yaml",
        "accelerate launch --config_file /runs/a/accelerate.yaml --machine_rank 1 "
        "-m sdplan.trainer --config /runs/a/sdplan.yaml",
    ]


def test_two_machines_with_deepspeed():
    c = cfg(distributed={"num_processes": 4, "deepspeed": {"zero_stage": 2}})
    launch = build_launch(c, CFG, OUT, python=PY, num_machines=2, main_process_ip="host0")
    assert launch.accelerate_config["distributed_type"] == "DEEPSPEED"
    assert launch.accelerate_config["num_machines"] == 2
    assert launch.deepspeed_config["train_batch_size"] == 2 * 3 * 4
    assert len(launch.per_node_commands) == 2


def test_cpu_processes_use_torchrun_with_gloo():
    c = cfg(distributed={"num_processes": 2}, training={"device": "cpu"})
    launch = build_launch(c, CFG, OUT, python=PY, cpu_processes=2, cpu_cores=2)
    assert launch.cmd == [
        PY,
        "-m",
        "sdplan.distrun",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *TRAINER,
    ]
    assert launch.kind == "cpu-multi"
    assert launch.env["ACCELERATE_USE_CPU"] == "true"
    assert launch.env["OMP_NUM_THREADS"] == "1"
    assert launch.accelerate_config is None


def test_one_cpu_process_is_plain():
    c = cfg(training={"device": "cpu"})
    launch = build_launch(c, CFG, OUT, python=PY, cpu_processes=1)
    assert launch.cmd == [PY, *TRAINER]
    assert launch.env["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize(
    ("kwargs", "c", "needle"),
    [
        ({"num_machines": 2}, {"distributed": {"num_processes": 4}}, "--main-process-ip"),
        (
            {"num_machines": 2, "main_process_ip": "h", "machine_rank": 2},
            {"distributed": {"num_processes": 4}},
            "machine-rank",
        ),
        ({"num_machines": 2, "main_process_ip": "h"}, {"distributed": {"num_processes": 3}}, "split evenly"),
        ({"cpu_processes": 2}, {"distributed": {"num_processes": 2}}, "--device cpu"),
        ({"cpu_processes": 2}, {"training": {"device": "cpu"}}, "must agree"),
        ({"num_machines": 0}, {}, "--num-machines"),
    ],
)
def test_impossible_launches_are_usage_errors(kwargs, c, needle):
    with pytest.raises(UsageError, match=needle.replace("-", r"\-")):
        build_launch(cfg(**c), CFG, OUT, python=PY, **kwargs)


def test_shell_line_quotes():
    launch = build_launch(cfg(), "/my runs/sdplan.yaml", "/my runs", python=PY)
    assert shlex.split(launch.shell()) == [
        "PYTHONSAFEPATH=1",
        "PYTHONUNBUFFERED=1",
        "SDPLAN_LAUNCHED=1",
        PY,
        "-m",
        "sdplan.trainer",
        "--config",
        "/my runs/sdplan.yaml",
    ]


# -- run_launch: a real child process ---------------------------------------------------------------------


def test_run_launch_streams_and_returns_the_child_exit_code(capfd):
    code = "import os, sys; print('child says', os.environ['SDPLAN_T']); sys.exit(75)"
    launch = Launch(cmd=[sys.executable, "-c", code], env={"SDPLAN_T": "hi"})
    assert run_launch(launch) == 75
    assert "child says hi" in capfd.readouterr().out


def test_run_launch_keeps_the_users_thread_settings_but_not_empty_ones(capfd):
    """A user's OMP_NUM_THREADS wins over the launch's; an empty one (``OMP_NUM_THREADS=``) is not a setting:
    accelerate reads it as a number and a 2-process CPU run died on int('')."""
    code = "import os; print('threads', repr(os.environ['OMP_NUM_THREADS']))"
    launch = Launch(cmd=[sys.executable, "-c", code], env={"OMP_NUM_THREADS": "1"})
    assert run_launch(launch, environ={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "3"}) == 0
    assert "threads '3'" in capfd.readouterr().out
    assert run_launch(launch, environ={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": ""}) == 0
    assert "threads '1'" in capfd.readouterr().out


def test_multi_process_launches_let_workers_save_after_ctrl_c(capfd):
    """torchrun (and accelerate launch, which runs it) kills its workers 30 s after Ctrl-C unless
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT says otherwise: too soon for a large interrupt checkpoint. Every
    multi-process launch sets 600 s; a user's own value wins; a single process has no torchrun."""
    two = {"num_processes": 2}
    launches = [
        build_launch(cfg(distributed=two), CFG, OUT, python=PY),
        build_launch(cfg(distributed=two, training={"device": "cpu"}), CFG, OUT, python=PY, cpu_processes=2),
        build_launch(cfg(distributed={**two, "deepspeed": {"zero_stage": 2}}), CFG, OUT, python=PY),
        build_launch(cfg(distributed=two), CFG, OUT, python=PY, num_machines=2, main_process_ip="10.0.0.1"),
    ]
    assert [launch.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") for launch in launches] == ["600"] * 4
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in build_launch(cfg(), CFG, OUT, python=PY).env
    code = "import os; print('timeout', os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"
    launch = Launch(cmd=[sys.executable, "-c", code], env=launches[0].env)
    assert run_launch(launch, environ={"PATH": "/usr/bin:/bin", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}) == 0
    assert "timeout 90" in capfd.readouterr().out
    assert run_launch(launch, environ={"PATH": "/usr/bin:/bin"}) == 0
    assert "timeout 600" in capfd.readouterr().out


def test_run_launch_forwards_sigint_to_the_child_group(tmp_path):
    """The parent gets SIGINT (Ctrl-C): the child (in its own group) gets it too, cleans up, and its
    exit code comes back."""
    marker = tmp_path / "child-cleaned-up"
    child = textwrap.dedent(
        f"""
        import signal, sys, time, pathlib
        def stop(*a):
            pathlib.Path({str(marker)!r}).write_text("checkpoint")
            sys.exit(130)
        signal.signal(signal.SIGINT, stop)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    parent = textwrap.dedent(
        f"""
        import sys
        from sdplan.launch import Launch, run_launch
        sys.exit(run_launch(Launch(cmd=[sys.executable, "-c", {child!r}], env={{}})))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    limit = scaled(30)
    assert proc.wait(timeout=limit) == 130
    assert limit is None or time.monotonic() - start < limit
    assert marker.read_text() == "checkpoint"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_while_the_trainer_starts_is_forwarded_not_lost(sig):
    """The signal lands while the child is being started (before it exists as far as sdplan knows): sdplan
    neither dies (SIGTERM, SIGHUP) nor escapes on KeyboardInterrupt (SIGINT) leaving the trainer behind; the
    signal is forwarded once the child runs, and the interrupt exit code comes back."""
    if not hasattr(signal, sig):
        pytest.skip(f"no {sig} here")
    # the child: a program that dies of the signal without a word whenever it lands (a Python child started
    # under load got it inside its interpreter's start-up, and printed its own "Fatal Python error" traceback)
    child = [shutil.which("sleep") or "sleep", "600"]
    parent = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys
        real = subprocess.Popen
        def popen(*a, **k):
            os.kill(os.getpid(), signal.{sig})  # arrives before Popen returns
            return real(*a, **k)
        subprocess.Popen = popen
        from sdplan.launch import Launch, run_launch
        sys.exit(run_launch(Launch(cmd={child!r}, env={{}})))
        """
    )
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_configs():
    """The accelerate and DeepSpeed configs for a plan."""
    from sdplan.config import DeepSpeedConfig, TrainConfig
    from sdplan.launch import accelerate_config, deepspeed_config

    def cfg(num_processes: int, precision: str, *, ds: bool = False, batch: int = 1, accum: int = 1):
        c = TrainConfig()
        c.distributed.num_processes = num_processes
        c.distributed.deepspeed = DeepSpeedConfig() if ds else None
        c.training.precision, c.training.batch_size, c.training.grad_accum = precision, batch, accum
        return c

    assert accelerate_config(cfg(1, "bf16"))["distributed_type"] == "NO"
    multi = accelerate_config(cfg(2, "fp16"))
    assert multi["distributed_type"] == "MULTI_GPU" and multi["mixed_precision"] == "fp16"
    ds = accelerate_config(cfg(1, "fp16", ds=True), deepspeed_file="/runs/a/deepspeed.json")
    # accelerate refuses a deepspeed_config_file beside inline ZeRO keys or mixed_precision.
    assert ds["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in ds
    assert ds["deepspeed_config"] == {
        "deepspeed_config_file": "/runs/a/deepspeed.json",
        "zero3_init_flag": False,
    }
    js = deepspeed_config(cfg(4, "bf16", ds=True, batch=2, accum=3))
    assert js["train_batch_size"] == 24 and js["bf16"]["enabled"] and not js["fp16"]["enabled"]
    with pytest.raises(ValueError):
        deepspeed_config(cfg(1, "fp16", ds=True, batch=0))
    assert deepspeed_config(cfg(1, "fp16", ds=True))["fp16"]["enabled"]
    on_cpu = cfg(1, "fp16", ds=True)
    on_cpu.training.device = "cpu"  # DeepSpeed's CPU accelerator refuses fp16: fp32, as without DeepSpeed
    assert not deepspeed_config(on_cpu)["fp16"]["enabled"]


def test_a_one_machine_run_takes_a_free_port_unless_the_user_gave_one():
    """Two runs started at once on one machine both took 29500 and the second died with EADDRINUSE (seen with
    two test workers). One machine: a free port; several: 29500 (every node must agree); the user's wins."""
    import socket

    from sdplan.launcher import TrainRequest, rendezvous_port

    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = {rendezvous_port(TrainRequest()) for _ in range(3)}
        assert taken not in ports and all(1024 <= p <= 65535 for p in ports)
    assert rendezvous_port(TrainRequest(num_machines=2)) == 29500
    assert rendezvous_port(TrainRequest(main_process_port=29555)) == 29555
    assert rendezvous_port(TrainRequest(num_machines=2, main_process_port=29555)) == 29555


_WORKER = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
if sys.argv[1] == "fail" and rank == 1:
    print("error: something the user can fix", file=sys.stderr, flush=True)
    sys.exit(3)
def stop(signum, frame):
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("ready", rank, flush=True)
time.sleep(120)
"""


def _distrun(tmp_path, mode: str):
    from limits import wait_until

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = tmp_path / f"{mode}.out"
    cmd = [sys.executable, "-m", "sdplan.distrun", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", "2", str(script), mode]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(out, "w") as stdout:
        proc = subprocess.Popen(
            cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        if mode == "stop":
            assert wait_until(lambda: out.read_text().count("ready") == 2, 60), out.read_text()
            os.killpg(proc.pid, signal.SIGINT)  # as sdplan train forwards a Ctrl-C: to the whole group
        _, err = proc.communicate()
    return proc.returncode, err


@pytest.mark.slow
def test_torchrun_stopped_by_ctrl_c_ends_quietly_as_interrupted(tmp_path):
    """Plain torchrun turned a Ctrl-C into a 30-line SignalException traceback and exit 1; through
    sdplan.distrun it ends with 130 (sdplan's interrupted) and prints nothing of its own."""
    code, err = _distrun(tmp_path, "stop")
    assert code == 130, err
    assert "Traceback" not in err and "SignalException" not in err and "death signal" not in err, err


@pytest.mark.slow
def test_a_failed_worker_leaves_only_its_own_error_line(tmp_path):
    code, err = _distrun(tmp_path, "fail")
    assert code == 3, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert [line for line in err.splitlines() if line.strip()] == ["error: something the user can fix"], err


def test_distrun_reports_a_worker_killed_by_a_signal_in_one_line():
    from types import SimpleNamespace

    from sdplan import distrun

    failures = {0: SimpleNamespace(exitcode=0), 1: SimpleNamespace(exitcode=-9)}
    assert "killed by SIGKILL" in distrun._killed_line(failures)
    assert distrun._exit_code(failures) == 137
    assert distrun._exit_code({0: SimpleNamespace(exitcode=2)}) == 2


def test_distrun_ends_as_interrupted_when_the_signal_lands_inside_torchs_metrics_wrapper(monkeypatch):
    """CI: the Ctrl-C hit torch's metrics wrapper before its ``start = time.time()`` finished; its ``finally``
    then raised UnboundLocalError with the SignalException only as context, and distrun printed the traceback
    and exited 1. It now finds the signal in the chain and ends with 130; any other error still raises."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from sdplan import distrun

    def wrapper():
        try:
            raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)
        finally:
            raise UnboundLocalError("cannot access local variable 'start'")

    monkeypatch.setattr(torch.distributed.run, "main", wrapper)
    monkeypatch.setenv("LOGLEVEL", "WARNING")
    assert distrun.main(["torch.distributed.run", "x.py"]) == 130

    def other():
        raise UnboundLocalError("a real bug")

    monkeypatch.setattr(torch.distributed.run, "main", other)
    with pytest.raises(UnboundLocalError):
        distrun.main(["torch.distributed.run", "x.py"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_the_workers_of_a_launcher_killed_by_sigkill_are_stopped_before_run_launch_returns(tmp_path):
    """`kill -9` of torchrun: its workers (each in a session of its own, as torchrun starts them) trained on
    after sdplan said "failed" and released the run lock, so a --resume ran beside them. A fake launcher: it
    starts a worker in a new session (which checkpoints on SIGTERM, as the trainer does) and then dies by
    SIGKILL. run_launch returns only after the worker got SIGTERM, wrote its marker and ended."""
    import time

    worker = (
        "import os, signal, sys, time\n"
        f"open({str(tmp_path / 'worker.pid')!r}, 'w').write(str(os.getpid()))\n"
        "def stop(*a):\n"
        f"    time.sleep(0.5); open({str(tmp_path / 'checkpoint')!r}, 'w').write('saved'); sys.exit(130)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )
    launcher = (
        "import os, signal, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True)\n"
        f"while not os.path.exists({str(tmp_path / 'worker.pid')!r}): time.sleep(0.05)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    t0 = time.monotonic()
    code = run_launch(Launch(cmd=[sys.executable, "-c", launcher], env={}, kind="cpu-multi", world_size=1))
    assert code == 137
    assert (
        tmp_path / "checkpoint"
    ).read_text() == "saved"  # stopped the way Ctrl-C stops it, then waited for
    pid = int((tmp_path / "worker.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") and time.monotonic() - t0 < 30


def test_orphans_of_a_dead_launcher_are_stopped_with_a_bounded_wait_and_a_way_out(
    tmp_path, monkeypatch, capsys
):
    """The wait for the workers a dead launcher left said nothing of Ctrl-C (which cuts it short), and after
    SIGKILL it had no end: a worker in uninterruptible sleep (a wedged driver, a hung file system) kept sdplan
    waiting for ever, and no Ctrl-C got it out. Now the line says Ctrl-C stops waiting, and the wait after
    SIGKILL is bounded, naming the pids it leaves."""
    from sdplan import launch as L

    if not sys.platform.startswith("linux"):
        pytest.skip("the subreaper is Linux's")
    # a launcher that starts a worker in a session of its own (as torchrun does) and dies; the worker stops on
    # SIGTERM
    worker = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(130)); time.sleep(60)"
    )
    launcher = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); sys.exit(1)"
    started = time.monotonic()
    code = run_launch(Launch(cmd=[sys.executable, "-c", launcher], env={}, kind="cpu-multi", world_size=2))
    assert code == 1 and time.monotonic() - started < scaled(30)
    err = capsys.readouterr().err
    assert "ended with 1 training process still running" in err and "Ctrl-C stops waiting" in err, err
    # one that outlives SIGKILL: reported after the bounded wait, not waited for
    kills: list[tuple[int, int]] = []
    monkeypatch.setattr(L, "_reap", lambda pids: set(pids))
    monkeypatch.setattr(L.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    started = time.monotonic()
    left = L.stop_orphans({999_999_999}, timeout=0, kill_timeout=0.3, stop=lambda: False)
    assert left == {999_999_999} and time.monotonic() - started < scaled(5)
    assert kills == [(999_999_999, signal.SIGTERM), (999_999_999, signal.SIGKILL)]
