"""Launch configuration: the accelerate config and the DeepSpeed config for a plan (pure functions).

`sdplan recommend --out` writes them and `sdplan train` reuses them. Field notes section 5: accelerate's
``distributed_type`` is NO / MULTI_GPU / DEEPSPEED, ``num_processes`` counts all processes, and DeepSpeed
requires ``train_batch_size = micro batch x gradient accumulation x world size``.
"""

from __future__ import annotations

from typing import Any

MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}
BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce / allgather bucket defaults (the planner counts them)


def accelerate_config(
    *,
    num_processes: int,
    precision: str,
    deepspeed: dict | None = None,
    main_process_port: int = 29500,
    deepspeed_file: str = "deepspeed.json",
) -> dict[str, Any]:
    """The `accelerate launch --config_file` YAML as a dict, for one machine.

    With DeepSpeed, the ZeRO settings, accumulation, clipping and precision live in ``deepspeed_file`` (the
    JSON from :func:`deepspeed_config`; give an absolute path, accelerate resolves it from its working
    folder): accelerate 1.x refuses a ``deepspeed_config_file`` beside inline ZeRO keys or
    ``mixed_precision``, so those are left out here.
    """
    if num_processes < 1:
        raise ValueError("num_processes must be >= 1")
    if precision not in MIXED:
        raise ValueError(f"precision must be one of {', '.join(MIXED)}")
    if deepspeed:
        dist = "DEEPSPEED"
    elif num_processes > 1:
        dist = "MULTI_GPU"
    else:
        dist = "NO"
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": dist,
        "mixed_precision": MIXED[precision],
        "num_processes": num_processes,
        "num_machines": 1,
        "machine_rank": 0,
        "main_process_ip": None,
        "main_process_port": main_process_port,
        "gpu_ids": "all",
        "use_cpu": False,
        "downcast_bf16": "no",
        "rdzv_backend": "static",
        "same_network": True,
    }
    if deepspeed:
        del cfg["mixed_precision"]
        cfg["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file, "zero3_init_flag": False}
    return cfg


def deepspeed_config(
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    precision: str,
    zero_stage: int = 2,
    offload_optimizer: bool = True,
    gradient_clipping: float = 1.0,
) -> dict[str, Any]:
    """A DeepSpeed JSON config; ``train_batch_size`` = micro batch x gradient accumulation x world size."""
    for name, v in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1")
    if zero_stage not in (1, 2):
        raise ValueError("zero_stage must be 1 or 2 (optimizer offload; parameter offload needs ZeRO-3)")
    zero: dict[str, Any] = {
        "stage": zero_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": BUCKET_ELEMENTS,
        "allgather_bucket_size": BUCKET_ELEMENTS,
    }
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": gradient_clipping,
        "zero_optimization": zero,
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 100,
    }
