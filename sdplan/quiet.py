"""Library notes that are no news in an sdplan run, silenced once per process at its entry (`sdplan`'s
``cli.main``, the trainer's ``python -m sdplan.trainer``): each would be a stray line between sdplan's own, or
beside its one error line. Their other warnings still show. Torch-free.

- bitsandbytes (imported with diffusers / peft) warns at import, on CPUs with AVX512-BF16, that an optional CPU
  kernel package is missing.
- DeepSpeed's accelerator detection falling back to the CPU: a WARNING through its "DeepSpeed" logger
  (accelerator/real_accelerator.py) on any import of deepspeed on a machine without a GPU and without
  DS_ACCELERATOR (accelerate's extract_model_from_parallel imports it: every CPU run, the demo's model build);
  and its "MPU is not provided, setting tp size to 1" (runtime/base_optimizer.py) when a ZeRO checkpoint loads
  (sdplan never runs tensor parallelism).
- torch's FutureWarning that ``torch.distributed.all_gather_into_tensor`` is deprecated, raised at each of
  DeepSpeed ZeRO's calls of it: a library's catch_warnings resets the once-per-place registry, so a 2-process
  ZeRO-2 run printed it about once per step and process.
"""

from __future__ import annotations

import logging
import warnings

_DEEPSPEED_NOTES = ("Setting accelerator to CPU.", "MPU is not provided")


class _DropDeepSpeedCpuNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DEEPSPEED_NOTES)


def quiet_library_notes() -> None:
    """Silence the notes above in this process (before or after the libraries are imported: their loggers
    keep the level and the filter when they set themselves up)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    log = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropDeepSpeedCpuNote) for f in log.filters):
        log.addFilter(_DropDeepSpeedCpuNote())
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
    )
