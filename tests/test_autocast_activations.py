"""scripts/autocast_activations.py: CUDA autocast's casting rules applied on the meta device, and the peak of live
bytes over a forward and backward, the two measurements behind the planner's ACTIVATION_FACTOR."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

sys.path.insert(0, str(ROOT / "scripts"))
try:
    _spec = importlib.util.spec_from_file_location(
        "autocast_activations", ROOT / "scripts" / "autocast_activations.py"
    )
    aa = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(aa)
finally:
    sys.path.pop(0)


class _Block(torch.nn.Module):
    """LayerNorm, then three Linears of one input (q, k, v), the shape of every attention block."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) + self.k(h) + self.v(h), h


def _saved(rules: bool) -> tuple[int, torch.dtype]:
    block = _Block().to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(2, 16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    counter = aa.ca.SavedCounter({p.untyped_storage()._cdata for p in block.parameters()})
    context = aa.autocast_rules(torch.bfloat16) if rules else contextlib.nullcontext()
    with context, counter.hooks():
        out, normed = block(x)
    assert out.dtype == torch.bfloat16  # matmuls run in the low precision either way
    return counter.total, normed.dtype


def test_autocast_rules_keep_norms_in_fp32_and_cast_each_linear_input():
    plain, plain_dtype = _saved(rules=False)
    ruled, ruled_dtype = _saved(rules=True)
    # layer_norm is on autocast's fp32 list: its output stays fp32 until a Linear casts it
    assert plain_dtype == torch.bfloat16 and ruled_dtype == torch.float32
    # The Linears' weights require grad, so each saves its input. Without the rules the three share one bf16
    # tensor; under them each Linear casts the fp32 norm output anew (two more bf16 copies: 2 x 2 bytes), and
    # layer_norm saves its input cast to fp32 (4 instead of 2 bytes) and its weight and bias cast to fp32.
    elements, width = 2 * 16 * 64, 64
    assert ruled - plain == elements * (2 * 2 + 2) + 2 * width * 4


@pytest.mark.slow
def test_sd15_lora_measurement_is_consistent():
    row = aa.measure("sd15", resolution=256, gc=False, trained="lora")
    assert row["autocast_bytes"] > 1.2 * row["shipped_bytes"]  # group_norm / layer_norm outputs in fp32
    assert row["autocast_bytes"] <= row["peak_bytes"] < 1.2 * row["autocast_bytes"]
    assert row["implied_factor"] == pytest.approx(row["peak_bytes"] / row["shipped_bytes"])
