"""TEST-ONLY fault injection: the one place where the trainer and ``sdplan bench`` read their test hooks.

Production code never reads these variables itself: a run reads them once, at its start, with
:meth:`Faults.from_env`, and passes the result to the loop (or the bench harness). With none set, :data:`NONE`
injects nothing. They exist so that out-of-memory and NaN handling can be tested on a CPU:

- ``SDPLAN_INJECT_OOM_AT_STEP=N``: raise ``torch.OutOfMemoryError`` in optimizer step N (1-based) when
  ``training.batch_size > 1``, so the launcher's retry with a smaller micro-batch can be tested.
- ``SDPLAN_INJECT_NAN_AT_STEP=N``: make the loss NaN in optimizer step N.
- ``SDPLAN_INJECT_INF_GRAD_AT_STEP=N``: keep the loss of optimizer step N finite but make its gradients inf
  (as a faulty GPU kernel in the backward pass does).
- ``SDPLAN_INJECT_SAMPLE_OOM_AT_STEP=N``: raise ``torch.OutOfMemoryError`` in the sample grid made after
  optimizer step N (``sampling.every_steps``), inside the pipeline's precision as a real one would be.
- ``SDPLAN_BENCH_OOM_ABOVE_BATCH=N``: in ``sdplan bench``, every probe point with a batch larger than N raises
  ``torch.OutOfMemoryError`` after the forward pass, as a real OOM would.

A run with any of them set records nothing in the local profile store (``sdplan train``'s out-of-memory
observations: an injected one is no measurement, and the planner learns from the store), unless
``SDPLAN_RECORD_INJECTED=1`` (the tests of that recording).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from sdplan.errors import UsageError

OOM_AT_STEP_ENV = "SDPLAN_INJECT_OOM_AT_STEP"
NAN_AT_STEP_ENV = "SDPLAN_INJECT_NAN_AT_STEP"
INF_GRAD_AT_STEP_ENV = "SDPLAN_INJECT_INF_GRAD_AT_STEP"
SAMPLE_OOM_AT_STEP_ENV = "SDPLAN_INJECT_SAMPLE_OOM_AT_STEP"
BENCH_OOM_ABOVE_BATCH_ENV = "SDPLAN_BENCH_OOM_ABOVE_BATCH"
RECORD_INJECTED_ENV = "SDPLAN_RECORD_INJECTED"
ENVS = (
    OOM_AT_STEP_ENV,
    NAN_AT_STEP_ENV,
    INF_GRAD_AT_STEP_ENV,
    SAMPLE_OOM_AT_STEP_ENV,
    BENCH_OOM_ABOVE_BATCH_ENV,
)


def unrecordable(environ: Mapping[str, str] | None = None) -> list[str]:
    """The fault-injection variables set in ``environ`` (default: this process's) that keep a run's observations
    out of the local profile store; empty when none is set or ``SDPLAN_RECORD_INJECTED=1``."""
    env = os.environ if environ is None else environ
    if env.get(RECORD_INJECTED_ENV, "").strip() == "1":
        return []
    return [name for name in ENVS if env.get(name, "").strip()]


def _read(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        n = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r}: must be an integer") from None
    if n < 0:
        raise UsageError(f"{name}={raw!r}: must be >= 0")
    return n


@dataclass(frozen=True)
class Faults:
    """The faults to inject in this run (all None: none)."""

    oom_at_step: int | None = None
    nan_at_step: int | None = None
    bench_oom_above_batch: int | None = None
    sample_oom_at_step: int | None = None
    inf_grad_at_step: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Faults:
        env = os.environ if environ is None else environ
        return cls(
            oom_at_step=_read(env, OOM_AT_STEP_ENV),
            nan_at_step=_read(env, NAN_AT_STEP_ENV),
            bench_oom_above_batch=_read(env, BENCH_OOM_ABOVE_BATCH_ENV),
            sample_oom_at_step=_read(env, SAMPLE_OOM_AT_STEP_ENV),
            inf_grad_at_step=_read(env, INF_GRAD_AT_STEP_ENV),
        )

    def after_forward(self, step: int, batch_size: int, loss):
        """The trainer's hook, between the forward and the backward pass of optimizer step ``step``."""
        if self.oom_at_step is not None and self.oom_at_step == step and batch_size > 1:
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {OOM_AT_STEP_ENV}={self.oom_at_step})"
            )
        if self.nan_at_step is not None and self.nan_at_step == step:
            return loss * float("nan")
        if self.inf_grad_at_step is not None and self.inf_grad_at_step == step:
            return _inf_backward(loss)
        return loss

    def in_sample_grid(self, step: int | None) -> None:
        """The trainer's hook inside the sample grid made after optimizer step ``step`` (None: the final one)."""
        if self.sample_oom_at_step is not None and step == self.sample_oom_at_step:
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected by {SAMPLE_OOM_AT_STEP_ENV}={self.sample_oom_at_step})"
            )

    def bench_oom(self, batch: int) -> bool:
        """True when the bench must simulate an out-of-memory at this batch."""
        return self.bench_oom_above_batch is not None and batch > self.bench_oom_above_batch


NONE = Faults()


def _inf_backward(loss):
    """``loss`` unchanged, with an inf gradient flowing back from it."""
    import torch

    class _Inf(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("inf")

    return _Inf.apply(loss)
