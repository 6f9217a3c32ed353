"""The training runtime: the Accelerator (device, mixed precision, DeepSpeed, DDP), the dtypes each model
lives in, attention and gradient checkpointing, per-step seeds, the data loader, the optimizer and LR schedule,
and the step arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from sdplan import steps
from sdplan.errors import SdplanError
from sdplan.extras import install_hint
from sdplan.steps import Steps

from .dataset_scan import count_of


def use_cpu(cfg) -> bool:
    """CPU when ``training.device`` is cpu, or auto without CUDA; cuda without CUDA is an error."""
    import torch

    if cfg.training.device == "cuda" and not torch.cuda.is_available():
        from sdplan.errors import NoGPUError

        raise NoGPUError(
            "training.device is cuda but torch sees no CUDA GPU",
            fix="check the driver (sdplan doctor), or set training.device=cpu",
        )
    return cfg.training.device == "cpu" or not torch.cuda.is_available()


def mixed_precision_for(cfg, cpu: bool) -> str:
    """accelerate's mixed_precision value. fp16 autocast is a GPU feature: on CPU it trains in fp32."""
    p = cfg.training.precision
    if p == "fp32":
        return "no"
    if p == "fp16" and cpu:
        return "no"
    return p


# DeepSpeed's bare print once its shared-memory collective op is built (deepspeed/comm/torch.py, DeepSpeed's CPU
# accelerator, when accelerate starts it): a stray line between sdplan's own (checked against DeepSpeed's source;
# its logger's notes are silenced at the process's entry: sdplan.quiet).
_DEEPSPEED_BUILT = re.compile(r"^DeepSpeed \S+ built successfully\s*$")


@contextlib.contextmanager
def without_deepspeed_build_note():
    """What the block prints on stdout, less DeepSpeed's "DeepSpeed <op> built successfully" lines (printed
    when the block is done)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        kept = [line for line in buf.getvalue().splitlines(keepends=True) if not _DEEPSPEED_BUILT.match(line)]
        if kept:
            sys.stdout.write("".join(kept))
            sys.stdout.flush()


PROCESS_GROUP_TIMEOUT = timedelta(hours=3)
"""How long a process waits at a collective (a barrier) for the others. Several processes wait while the main
one works alone: DreamBooth's class images (100 by default; FLUX.1 at 20-40 s each), the latent cache on disk,
the trial export, samples and outputs. NCCL's default is 10 minutes, after which its watchdog ends the waiting
processes and the run (gloo's is 30); kohya has --ddp_timeout for it. A process that dies is still noticed at
once (the launcher ends the others)."""


CPU_BACKEND = "gloo"


def process_group_backend(cpu: bool, launched_with_ds: bool) -> dict[str, str]:
    """The process-group backend to name to accelerate: gloo for DeepSpeed on the CPU, else accelerate's own
    choice (none named).

    ``accelerate launch`` with DeepSpeed runs every process with ``cpu=False`` (``cpu=True`` turns DeepSpeed
    off), and there accelerate's ``PartialState._prepare_backend`` finds no GPU and picks no backend. DeepSpeed
    still joins the processes into one world (``deepspeed.comm.init_distributed`` with the CPU accelerator's
    backend, gloo without oneCCL), but accelerate, seeing no backend, counts each process as a world of one:
    ``num_processes`` 1 and ``process_index`` 0 in every process, so each trained the whole run alone as the
    main process, and they hung or failed at the first checkpoint (DeepSpeed's save is collective). Named,
    the backend goes to both: one world, with the ranks torchrun gave.

    Only in a launched process (LOCAL_RANK set, accelerate's own test for starting DeepSpeed's communication):
    elsewhere accelerate would read the world size of a process group nobody started (a process that built a
    DeepSpeed Accelerator keeps ACCELERATE_USE_DEEPSPEED=true in its environment)."""
    launched = int(os.environ.get("LOCAL_RANK", -1) or -1) != -1
    return {"backend": CPU_BACKEND} if cpu and launched_with_ds and launched else {}


def launched_with_deepspeed() -> bool:
    """Whether accelerate launched this process with DeepSpeed (``accelerate launch --use_deepspeed``), whatever
    the config says."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def make_accelerator(cfg, out_dir: Path):
    """An Accelerator for this config: precision, grad accumulation, CPU when asked or without CUDA.

    ``rng_types=[]``: the data order comes from our epoch-seeded samplers and the noise from per-step seeds,
    so accelerate need not synchronise generators (that would make resume depend on its internals).
    The LR scheduler is stepped by the recipe once per optimizer step (not prepared), so its total and
    warmup steps are the multi-process ones that ``plan_steps`` computes.
    """
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    cpu = use_cpu(cfg)
    kwargs: dict[str, Any] = {}
    ds = cfg.distributed.deepspeed
    launched_with_ds = launched_with_deepspeed()
    if ds is not None and not launched_with_ds:
        rendezvous_for_one_process(cpu)
        try:
            import deepspeed  # noqa: F401
            from accelerate.utils import DeepSpeedPlugin
        except ImportError as e:
            raise SdplanError(
                "distributed.deepspeed is set but DeepSpeed is not installed",
                fix=f"{install_hint('deepspeed')} or remove distributed.deepspeed",
            ) from e
        from sdplan.launch import deepspeed_config

        # the same DeepSpeed config `sdplan train` writes for a launch (buckets, overlap, offload, precision), not
        # accelerate's defaults for the plugin's arguments, so a run without the launcher (sdplan bench) measures
        # what training runs; for the world and device this process really has: accelerate keeps a given
        # train_batch_size and fp16 block (DeepSpeedPlugin.fill_match replaces only "auto"), and DeepSpeed
        # asserts train_batch_size == micro batch x accumulation x its world size (runtime/config.py
        # _batch_assertion), where distributed.num_processes may name the GPUs of a planned launch
        world = launched_world_size()
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=deepspeed_config(cfg, world_size=world, cpu=cpu)
        )
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    # Gradients as views into DDP's all-reduce buckets: no second copy of the gradients (the planner counts
    # one, kept between steps: planner.ddp_bucket_bytes; kohya's --ddp_gradient_as_bucket_view). SDXL
    # conditions on the first encoder's penultimate layer: its last layer (and any adapter there) gets no
    # gradient, which DDP must be told about.
    kwargs["kwargs_handlers"] = [
        DistributedDataParallelKwargs(
            gradient_as_bucket_view=True, find_unused_parameters=cfg.training.train_text_encoder
        ),
        InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT, **process_group_backend(cpu, launched_with_ds)),
    ]
    if cpu and cfg.training.precision == "fp16" and os.environ.get("RANK", "0") == "0":
        print("training.precision fp16 needs a GPU; training in fp32 on the CPU", flush=True)
    if ds is not None or launched_with_ds:
        ask_py_cpuinfo_once()
        gloo_for_deepspeed_on_the_cpu()
    with without_deepspeed_build_note():  # DeepSpeed's communication starts here (accelerate's PartialState)
        accelerator = Accelerator(
            mixed_precision=mixed_precision_for(cfg, cpu),  # DeepSpeed on the CPU: no fp16 either
            gradient_accumulation_steps=cfg.training.grad_accum,
            # accelerate ignores DeepSpeed when cpu=True; on a CPU-only machine DeepSpeed runs on its CPU
            # accelerator (DS_ACCELERATOR=cpu), which the launcher sets
            cpu=cpu and ds is None and not launched_with_ds,
            rng_types=[],
            step_scheduler_with_optimizer=False,
            project_config=ProjectConfiguration(
                project_dir=str(out_dir), logging_dir=str(Path(out_dir) / "logs")
            ),
            **kwargs,
        )
    check_world(accelerator)
    check_deepspeed_batch(accelerator, cfg)
    if accelerator.device.type == "cuda":
        check_cuda_kernels(accelerator.device)
    return accelerator


def rendezvous_for_one_process(cpu: bool) -> None:
    """A DeepSpeed config in a process no launcher started (``python -m sdplan.trainer --config``): the
    environment of a one-process world, as `sdplan bench` gives its harness (sdplan/bench_harness.py). Without
    all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK DeepSpeed looks for an MPI launcher
    (``deepspeed.comm.init_distributed``: ``required_env``, then ``mpi_discovery``) and stopped with a traceback
    (ModuleNotFoundError: mpi4py); some of them set (a cluster exporting MASTER_ADDR, a stray RANK=0) did the
    same. The missing ones are set for one process; a world of more than one given without the rest is refused."""
    from sdplan.errors import UsageError

    required = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    if all(os.environ.get(name) for name in required):
        return
    given = {name: os.environ[name] for name in required if os.environ.get(name)}
    if (
        given.get("WORLD_SIZE", "1") != "1"
        or given.get("RANK", "0") != "0"
        or given.get("LOCAL_RANK", "0") != "0"
    ):
        missing = [name for name in required if name not in given]
        raise UsageError(
            f"{', '.join(f'{k}={v}' for k, v in given.items())} is set but not {', '.join(missing)}: a process of "
            "a larger DeepSpeed world needs its launcher",
            fix="start it with `sdplan train` (or accelerate launch / torchrun), or unset those variables",
        )
    from sdplan.launch import one_process_world

    one = one_process_world(cpu)  # DS_ACCELERATOR=cpu as the launcher sets it, where none is set
    os.environ.update({k: v for k, v in one.items() if not os.environ.get(k)})
    # one process hosts its own rendezvous: a MASTER_ADDR naming another host (a cluster's) beside a port free
    # here waited 3 hours for that host, silently
    os.environ["MASTER_ADDR"] = one["MASTER_ADDR"]


def _config_file() -> str:
    """The sdplan config this process trains (the trainer's --config), for messages."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return "sdplan.yaml"


def check_deepspeed_batch(accelerator, cfg) -> None:
    """The DeepSpeed config's micro-batch and accumulation are the sdplan config's. accelerate trains with the
    DeepSpeed config's gradient_accumulation_steps where they differ (accelerate/accelerator.py
    ``_prepare_deepspeed``: "Using DeepSpeed's value"), DeepSpeed with its micro-batch: a stale deepspeed.json
    launched by hand (`sdplan train` writes both files together) trained another run than the one the trainer
    planned and announced (2 epochs announced, 4 trained). "auto" takes the sdplan config's."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    ds, t = plugin.deepspeed_config, cfg.training
    pairs = (
        ("train_micro_batch_size_per_gpu", "training.batch_size", t.batch_size),
        ("gradient_accumulation_steps", "training.grad_accum", t.grad_accum),
    )
    wrong = [(k, ds[k], key, v) for k, key, v in pairs if ds.get(k, "auto") != "auto" and int(ds[k]) != v]
    # DeepSpeed's own check of the three (runtime/config.py: an AssertionError after the models loaded)
    world = int(getattr(accelerator, "num_processes", 1) or 1)
    total = ds.get("train_batch_size", "auto")
    if not wrong and total != "auto" and int(total) != t.batch_size * t.grad_accum * world:
        wrong = [
            (
                "train_batch_size",
                total,
                f"training.batch_size x training.grad_accum x {world} process{'es' if world > 1 else ''}",
                t.batch_size * t.grad_accum * world,
            )
        ]
    if not wrong:
        return
    where = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "the DeepSpeed config"
    raise SdplanError(
        f"{where} has {', '.join(f'{k} {d}' for k, d, _, _ in wrong)} but {_config_file()} has "
        f"{', '.join(f'{key} {v}' for _, _, key, v in wrong)}: DeepSpeed would train with the first",
        fix="launch it with `sdplan train`, which writes deepspeed.json from sdplan.yaml, or make the two agree",
    )


def check_cuda_kernels(device) -> None:
    """This torch build's kernels run on ``device``: its arch list (``torch.cuda.get_arch_list``) has code for
    the GPU's compute capability: a cubin of the same major and no higher minor, or PTX of no higher capability
    the driver compiles. Else every CUDA call fails with "no kernel image is available" (a GTX 1080 Ti under
    PyTorch 2.8's CUDA 12.8 wheels; an RTX 5090 under a CUDA 12.6 build): one line saying which build to
    install. ROCm builds list gfx targets: not checked here (`sdplan doctor` judges them)."""
    import torch

    if torch.version.hip:
        return
    arches = torch.cuda.get_arch_list()
    if not arches:  # a build that does not say
        return
    major, minor = torch.cuda.get_device_capability(device)

    codes = [m.groups() for a in arches if (m := re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", a))]  # sm_90a
    if not codes:  # an arch list in a form not known here: not judged
        return
    cubins = [(int(x), int(y)) for kind, x, y in codes if kind == "sm"]
    ptx = [(int(x), int(y)) for kind, x, y in codes if kind == "compute"]
    if any(m == major and n <= minor for m, n in cubins) or any(x <= (major, minor) for x in ptx):
        return
    from sdplan.errors import NoGPUError

    need = "12.8 or newer" if major >= 10 else "12.6"
    raise NoGPUError(
        f"torch {torch.__version__} has no CUDA kernels for {torch.cuda.get_device_name(device)} (compute "
        f"capability {major}.{minor}; this build has {' '.join(arches)})",
        fix=f"install a torch built for CUDA {need} (`sdplan doctor` prints the command), or set "
        "training.device=cpu",
    )


def ask_py_cpuinfo_once() -> None:
    """DeepSpeed asks py-cpuinfo about this CPU three times in each process (its op builder's -march and SIMD
    flags, DeepSpeedCPUAdam's vendor check), and each ask runs py-cpuinfo in a new Python interpreter: about a
    second of CPU each, in every process of a run. The CPU does not change while the process runs: ask once."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu itself
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)


def gloo_for_deepspeed_on_the_cpu() -> None:
    """DeepSpeed on its CPU accelerator (a CPU run: the demo, the tests) compiles a shared-memory all-reduce op
    whenever its communication starts, one process included (``TorchBackend.__init__`` calls ``build_shm_op``,
    deepspeed/comm/torch.py): two C++ files, about a minute on two cores, again for every new environment.
    gloo, which DeepSpeed uses when that op is not marked compatible, does the same reductions, and these runs
    are tiny: mark it so. GPU runs are untouched (DeepSpeed's CUDA accelerator has no such op). Nor do CPU runs
    build DeepSpeed's optimizer op (cpu_adam): their offloaded optimizer is torch's AdamW (sdplan.launch
    deepspeed_config); GPU runs with offload build and use it."""
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":
            return
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # read by build_shm_op
    except (ImportError, AttributeError, TypeError):  # another DeepSpeed layout: it builds the op, as before
        return


def launched_world_size() -> int:
    """The processes the launcher started (its WORLD_SIZE; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_world(accelerator) -> None:
    """Every process the launcher started counted in one world: a process that counts itself alone trains the
    whole run as the main process, then waits forever at the first checkpoint another process saves with it."""
    launched = launched_world_size()
    if accelerator.num_processes != launched:
        raise SdplanError(
            f"the launcher started {launched} processes but accelerate counts {accelerator.num_processes} "
            f"({accelerator.distributed_type}, backend {accelerator.state.backend}): each would train the whole "
            "run alone",
            fix="report this with the launch command sdplan printed",
        )


def check_deepspeed(accelerator, trained: dict) -> None:
    """accelerate's DeepSpeed integration trains one model: say so before prepare() fails obscurely."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED and len(trained) > 1:
        raise SdplanError(
            f"DeepSpeed trains one model, this run trains {len(trained)} ({', '.join(trained)})",
            fix="set training.train_text_encoder=false (textual inversion on SDXL: without DeepSpeed), "
            "or remove distributed.deepspeed",
        )


def deepspeed_cpu_adam_build_note() -> str | None:
    """What to say before DeepSpeed's optimizer offload builds its CPU Adam op: DeepSpeed compiles it on first
    use (a minute or two, silent) unless its wheel was built with the op or torch's extension cache holds it
    (``$TORCH_EXTENSIONS_DIR`` or ~/.cache/torch_extensions/<python and CUDA tag>/cpu_adam). None: it is there."""
    try:
        from deepspeed.git_version_info import installed_ops

        if installed_ops.get("cpu_adam"):
            return None
    except Exception:  # no deepspeed, or another layout: say nothing rather than something wrong
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory

        built = Path(_get_build_directory("cpu_adam", verbose=False))
        if any(built.glob("cpu_adam*.so")):
            return None
    except Exception:
        pass
    return (
        "DeepSpeed is building its CPU Adam op for the optimizer offload (once per machine: a minute or two, "
        "cached in torch's extension folder)"
    )


def weight_dtype(accelerator):
    """dtype for frozen weights: half precision under fp16/bf16 mixed precision, else fp32."""
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(accelerator.mixed_precision, torch.float32)


def trained_dtype(cfg, accelerator):
    """dtype of the weights a full-weight recipe or a LoRA trains: fp32 master weights under mixed precision, or
    bf16 with ``training.full_half_weights`` (kohya --full_bf16: half the weight and gradient memory)."""
    import torch

    if cfg.training.full_half_weights and accelerator.mixed_precision == "bf16":
        return torch.bfloat16
    return torch.float32


def vae_dtype(accelerator):
    """The SD/SDXL VAE overflows to NaN in fp16: keep it in fp32 then (bf16 is safe)."""
    import torch

    return torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32


def host_copy(model, dtype=None):
    """A copy of ``model`` with every parameter and buffer in host RAM, made one tensor at a time: a plain
    ``copy.deepcopy`` of a model on the GPU allocates the whole copy on the GPU, which at an export beside the
    training state (the EMA weights of a full fine-tune) can run out of memory after hours of training.
    ``dtype``: its floating-point tensors in that dtype (the EMA's fp32 average copied into a bf16 model's copy
    was rounded to bf16)."""
    import copy

    import torch

    def host(t):
        return t.detach().to(
            "cpu", dtype=dtype if dtype is not None and t.is_floating_point() else None, copy=True
        )

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(host(p), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = host(b)
    return copy.deepcopy(model, memo)


def same_device(a, b) -> bool:
    """Whether tensors on ``a`` are on ``b``. accelerate's one-GPU device is ``cuda`` without an index, while a
    tensor on it says ``cuda:0`` (``torch.device("cuda:0") != torch.device("cuda")``): a device without an
    index is the process's current one, the only GPU this trainer uses per process."""
    import torch

    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def place(model, device, dtype) -> None:
    """Move ``model`` to ``device`` in ``dtype``, cast on the way: one ``to(device=, dtype=)`` converts tensor
    by tensor, so the device never holds the whole model in its load dtype (moving an fp32 SDXL UNet first and
    casting after needs 9.6 GiB for a 4.8 GiB bf16 UNet). The dtype is passed only when it differs (diffusers
    warns on every dtype cast, even a no-op)."""
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    if current != dtype:
        model.to(device=device, dtype=dtype)
    else:
        model.to(device)


def avoid_faulty_attention_kernels() -> None:
    """Turn PyTorch's cuDNN attention backend off for training (flash / memory-efficient SDPA take over).
    PyTorch >= 2.11 prefers it on Hopper (H100/H200), and its bf16 backward has given non-finite gradients
    at some shapes (pytorch/pytorch#196678, huggingface/trl#7181, kyutai-labs/pocket-tts#264: same throughput
    without it). On sdplan's lent H100 (torch 2.11, 2026-11-26) the FLUX demo LoRA in bf16 turned NaN at step 2
    with the default backends and trained with math attention; the same run with only the flash kernel off
    still failed. On 2026-11-27 a bare copy of diffusers' FLUX.1 LoRA script step (benchmarks/flux_script_memory.py)
    faulted there in its first backward ("illegal memory access", mha_graph.execute) and ran with it off.
    A no-op on machines without cuDNN attention."""
    import torch

    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def use_sdpa(*models) -> None:
    """PyTorch scaled-dot-product attention (flash / memory-efficient kernels on GPU). The SD3/FLUX
    transformers' joint-attention processors already use it (and AttnProcessor2_0 would break them)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    for m in models:
        if isinstance(m, (UNet2DConditionModel, AutoencoderKL)):
            m.set_attn_processor(AttnProcessor2_0())


def enable_gradient_checkpointing(*models) -> None:
    """Recompute activations in the backward pass: diffusers models and transformers text encoders (the
    non-reentrant variant, so adapters inside frozen layers still get gradients)."""
    for m in models:
        m = getattr(m, "module", m)  # DDP-wrapped
        if hasattr(m, "enable_gradient_checkpointing"):  # diffusers
            m.enable_gradient_checkpointing()
        elif hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.x
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older transformers
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(getattr(m, "config", None), "use_cache"):
            m.config.use_cache = False


def add_lora_adapters(unet, text_encoders, lcfg, train_text_encoder: bool, dtype=None) -> dict:
    """peft LoRA adapters on the UNet and, when asked, on each text encoder. The adapters train in ``dtype``
    (:func:`trained_dtype`: fp32 whatever the base weights are, bf16 with training.full_half_weights, as kohya's
    train_network.py casts the network under --full_bf16). Returns ``{name: model}`` of what trains (``unet``,
    ``text_encoder_i``)."""
    from peft import LoraConfig

    def adapter(targets):
        return LoraConfig(
            r=lcfg.rank,
            lora_alpha=lcfg.alpha,
            lora_dropout=lcfg.dropout,
            init_lora_weights="gaussian",
            target_modules=targets,
        )

    def attach(model, targets, key: str) -> None:
        from sdplan.errors import UsageError

        check_lora_targets(model, targets, key)
        try:
            model.add_adapter(adapter(targets))
        except ValueError as e:  # peft's NoMatchingPeftModuleError (a ValueError) or, before it, a ValueError
            if type(e).__name__ != "NoMatchingPeftModuleError" and "not found in the base model" not in str(
                e
            ):
                raise
            raise UsageError(
                f"{key}={list(targets)}: no module of {type(model).__name__} has such a name",
                fix=_targets_fix(model, key),
            ) from None

    attach(unet, lcfg.target_modules, "lora.target_modules")
    trained = {"unet": unet}
    if train_text_encoder:
        for i, te in enumerate(text_encoders):
            attach(te, lcfg.text_encoder_target_modules, "lora.text_encoder_target_modules")
            trained[f"text_encoder_{i}"] = te
    import torch

    for m in trained.values():
        for p in m.parameters():
            if p.requires_grad:
                p.data = p.data.to(dtype or torch.float32)
    return trained


def _targets_fix(model, key: str) -> str:
    return f"name its layers (e.g. {', '.join(_module_names(model))}), or leave {key} out for the default"


def check_lora_targets(model, targets, key: str) -> None:
    """A UsageError where ``targets`` (lora.target_modules / lora.text_encoder_target_modules) name a module
    ``model`` lacks, or one that is no Linear / Conv layer; also run before the launch on the family's
    architecture built on the meta device (sdplan.launcher.check_lora_targets_early)."""
    import torch

    from sdplan.errors import UsageError

    modules = list(model.named_modules())
    fix = _targets_fix(model, key)
    # peft matches a listed target by a module name's dotted suffix, and drops one that matches nothing
    # as long as another matches: a misspelt name trained without its layers, silently
    matched = {t: [m for n, m in modules if n == t or n.endswith("." + t)] for t in targets}
    unmatched = [t for t, found in matched.items() if not found]
    if unmatched and len(unmatched) < len(targets):
        raise UsageError(
            f"{key}: no module of {type(model).__name__} is named {', '.join(map(repr, unmatched))}",
            fix=fix,
        )
    if unmatched:
        raise UsageError(
            f"{key}={list(targets)}: no module of {type(model).__name__} has such a name", fix=fix
        )
    # a block (attn1) or a norm matches modules LoRA does not adapt: peft's 'not supported' was a traceback.
    # An Embedding peft adapts, but no LoRA file kohya, A1111 or ComfyUI read holds it (kohya's names know
    # lora_down / lora_up only: diffusers' convert_state_dict_to_kohya left peft's lora_embedding_A/B as
    # they were, a file diffusers' own loader then refused), and the alpha folding missed its lora_embedding_B
    layers = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv1d)
    other = [t for t, found in matched.items() if found and not any(isinstance(m, layers) for m in found)]
    if other:
        kinds = sorted({type(m).__name__ for t in other for m in matched[t]})
        raise UsageError(
            f"{key}: {', '.join(map(repr, other))} in {type(model).__name__} is a {'/'.join(kinds)}, not a "
            "layer the LoRA files other tools read hold (Linear or Conv)",
            fix=fix,
        )


def _module_names(model, limit: int = 6) -> list[str]:
    """The last parts of a model's Linear / Conv layer names, most frequent first (what target_modules match)."""
    import collections

    import torch

    def tail(name: str) -> str:  # "...attn1.to_out.0" -> "to_out.0", as the default names it
        parts = name.split(".")
        return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]

    layers = (torch.nn.Linear, torch.nn.Conv2d)
    counts = collections.Counter(tail(n) for n, m in model.named_modules() if isinstance(m, layers))
    return [name for name, _ in counts.most_common(limit)]


def seed_step(seed: int, process_index: int, step: int):
    """Seed everything random in one optimizer step from (seed, process, step) and return the generator
    for noise, timesteps and VAE sampling. A resumed run redraws exactly what the uninterrupted one drew,
    and each process draws its own noise."""
    import torch

    value = (seed * 1_000_003 + process_index * 7919 + step) % (2**63 - 1)
    torch.manual_seed(value)  # dropout and anything else on the global generator
    return torch.Generator("cpu").manual_seed(value)


def plan_steps(
    *,
    images_per_epoch: int,
    batches_per_epoch: int,
    batch_size: int,
    grad_accum: int,
    epochs: int,
    max_steps: int | None,
    warmup_steps: int,
    num_processes: int,
    bucket_samples: tuple[int, ...] = (),
) -> Steps:
    """Optimizer steps for this run: :func:`sdplan.steps.plan_steps` (the planner's and the launcher's
    arithmetic) with each process's real dataloader length (``batches_per_epoch``, the sharded loader's) and
    the samples of each aspect bucket (``bucket_samples``: where the epoch's short batches are)."""
    return steps.plan_steps(
        images_per_epoch=images_per_epoch,
        batch_size=batch_size,
        grad_accum=grad_accum,
        num_processes=num_processes,
        epochs=epochs,
        max_steps=max_steps,
        warmup_steps=warmup_steps,
        batches_per_epoch=batches_per_epoch,
        bucket_samples=bucket_samples,
    )


def describe_plan(method: str, family: str, samples: int, cfg, plan: Steps, repeated: int = 0) -> str:
    """The trainer's plan line; ``repeated``: the batches each epoch's last round deals again (accelerate's
    even batches over the processes)."""
    t = cfg.training
    warmup = f"warmup {plan.lr_warmup_steps}"
    if (
        t.lr_scheduler == "constant" and t.lr_warmup_steps
    ):  # an older sdplan.yaml: diffusers' constant has none
        warmup = f"no warmup (training.lr_warmup_steps {t.lr_warmup_steps} does nothing with the constant scheduler)"
    elif plan.num_processes > 1 and t.lr_warmup_steps:
        warmup += f" (training.lr_warmup_steps {t.lr_warmup_steps} one-process steps / {plan.num_processes})"
    return (
        f"{method} {family}: {count_of(samples, 'sample')}/epoch, batch {t.batch_size} x accum {t.grad_accum} x "
        f"{count_of(plan.num_processes, 'process', 'processes')} -> {count_of(plan.steps_per_epoch, 'step')}/epoch, "
        f"{count_of(plan.total_steps, 'step')} ({epochs_text(plan.total_steps / plan.steps_per_epoch)}), {warmup}"
        + (f"; {steps.repeated_batches_text(repeated, plan.largest_batch)}" if repeated else "")
    )


def epochs_value(epochs: float) -> float:
    """The epochs a run trains as run_summary.json and an intermediate output's metadata record them (steps /
    steps per epoch): to 6 places, or more where those would make a part of an epoch a whole number (1 step of
    3200 was recorded as 0.0)."""
    if float(epochs).is_integer():
        return float(epochs)
    return next(round(epochs, p) for p in range(6, 16) if not round(epochs, p).is_integer())


def epochs_text(epochs: float) -> str:
    """'1 epoch', '3 epochs', '0.125 of an epoch', '1.5 epochs': the epochs a run trains, as run_summary.json's
    ``epochs`` records them (:func:`epochs_value`), to 3 significant digits where that says no whole number; a
    training.max_steps stop inside an epoch was said as the whole epoch it starts ('1 steps (1 epoch)' where the
    summary said 0.125). 1 step of 2500 is '0.0004 of an epoch', 2999 of 3000 '0.9997 of an epoch'."""
    value = epochs_value(epochs)
    if value.is_integer():
        return count_of(int(value), "epoch")
    shown = f"{value:.3g}"
    if float(shown).is_integer():
        shown = f"{value:g}"
    return f"{shown} of an epoch" if value < 1 else f"{shown} epochs"


class EpochBatches:
    """The epoch-seeded BucketBatchSampler, shown to accelerate without a ``batch_size`` attribute so that
    its sharding treats batches as lists of any length (bucket batches can be short mid-epoch; with a
    batch_size, accelerate would drop a round whose last batch is short)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def make_loader(dataset, cfg, device):
    """(DataLoader, EpochBatches): batches of ``training.batch_size`` from one bucket each, in an order that
    depends only on (seed, epoch). Pass the loader to ``accelerator.prepare`` to shard it over processes."""
    import torch

    from .buckets import BucketBatchSampler
    from .data import collate

    batches = EpochBatches(
        BucketBatchSampler.for_dataset(dataset, cfg.training.batch_size, seed=cfg.training.seed)
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )
    return loader, batches


def make_optimizer(param_groups: list[dict[str, Any]], cfg):
    """AdamW, 8-bit AdamW (bitsandbytes) or Adafactor over ``param_groups`` (each with its own ``lr``)."""
    import torch

    name = cfg.memory.optimizer
    lr = cfg.training.learning_rate
    if name == "adamw":
        return torch.optim.AdamW(param_groups, lr=lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as e:
            raise SdplanError(
                "memory.optimizer: adamw8bit needs bitsandbytes, which is not installed",
                fix=f"{install_hint('bnb')}, or set memory.optimizer=adamw",
            ) from e
        return bnb.optim.AdamW8bit(param_groups, lr=lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(param_groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise SdplanError(f"memory.optimizer: unknown optimizer {name!r}")


def make_lr_scheduler(optimizer, cfg, plan: Steps):
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.training.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=plan.lr_warmup_steps,
        num_training_steps=plan.total_steps,
    )


def peak_memory_bytes(accelerator=None) -> int:
    """Peak GPU memory allocated by torch on CUDA; else this process's peak resident set size."""
    import torch

    if torch.cuda.is_available() and (accelerator is None or accelerator.device.type == "cuda"):
        return int(torch.cuda.max_memory_allocated())
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory() -> None:
    """Start :func:`peak_memory_bytes` over on CUDA before the loop: run_summary's ``peak_memory_bytes`` is the
    loop's (its steps, and the sample grids made during it), which a local calibration point takes as a step's;
    the setup's caption pass and loading are not in it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def gather_max(accelerator, value: int) -> int:
    import torch

    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return int(accelerator.reduce(t, reduction="max").item())
