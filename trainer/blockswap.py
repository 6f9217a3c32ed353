"""Block swap for SD3.5 / FLUX.1 LoRA (``memory.blocks_to_swap``, kohya's ``--blocks_to_swap``): the frozen
weights of the transformer's last blocks live in host RAM and come to the GPU one block at a time, for that
block's forward pass and again for its recomputation in the backward pass.

Which blocks (as kohya counts them, and the planner: ``sdplan.planner.swapped_block_bytes``): FLUX.1 swaps
``N // 2`` double-stream and ``(N - N // 2) * 2`` single-stream blocks, SD3.5 ``N`` joint blocks, the last ones
of each list. Only the frozen base weights move; the LoRA adapters inside those blocks stay on the GPU (the
optimizer holds them).

How: a forward pre-hook on each swapped block copies its frozen weights in from (pinned) host copies and sends
the previously resident swapped block back; a forward hook sends it back when its forward ends. Sending back is
re-pointing the parameters at their host copies (the base is frozen: nothing to copy back). Gradient
checkpointing is required: it is what keeps the autograd graph from holding every block's GPU weights until
the backward pass (the recomputation brings each block back for its own backward only). An nf4 block's
bitsandbytes QuantState travels as a per-visit copy, so a backward pass never sees the host one.

On the CPU the copies are the host tensors themselves: the swap is a no-op that runs the same hooks (the tests
check it changes nothing). One process only, without DeepSpeed (DDP wants a module on one device).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

from sdplan import registry

from .runtime import same_device


def support_problem(
    blocks: int,
    *,
    family: str | None,
    method: str,
    gradient_checkpointing: bool,
    processes: int,
    deepspeed: bool,
) -> str | None:
    """Why the bundled trainer cannot swap ``blocks`` blocks in this run (one line with the fix); None when it
    can (0 always can). Pure."""
    if not blocks:
        return None
    what = f"memory.blocks_to_swap {blocks}"
    off = "pin memory.blocks_to_swap=0"
    if family is not None and family not in registry.FLOW_FAMILIES:
        return f"{what}: block swap is for the SD3.5 / FLUX.1 transformers only, not {family}; {off}"
    if method != "lora":
        return f"{what} with method {method}: the bundled trainer swaps blocks for LoRA only; {off}"
    if not gradient_checkpointing:
        return (
            f"{what} needs memory.gradient_checkpointing=true (without it the backward pass keeps every block's "
            f"weights on the GPU); set it, or {off}"
        )
    if processes > 1 or deepspeed:
        return f"{what}: the bundled trainer swaps blocks in one process without DeepSpeed; use one GPU, or {off}"
    return None


def swap_names(model, family: str, blocks: int) -> list[str]:
    """Module names of the blocks ``blocks`` swaps (the last ones of each list), kohya's way (module doc)."""
    from sdplan.errors import UsageError

    if not blocks:
        return []
    if registry.family(family).arch == "flux":
        lists = {
            "transformer_blocks": blocks // 2,
            "single_transformer_blocks": (blocks - blocks // 2) * 2,
        }
    else:
        lists = {"transformer_blocks": blocks}
    names = []
    for attr, n in lists.items():
        have = len(getattr(model, attr))
        if n > have:
            raise UsageError(
                f"memory.blocks_to_swap {blocks} swaps {n} of {attr} but this {family} transformer has {have}",
                fix="pin a smaller memory.blocks_to_swap",
            )
        names += [f"{attr}.{i}" for i in range(have - n, have)]
    return names


@contextmanager
def set_aside(model, names: list[str]):
    """The named blocks out of ``model`` inside the block (identity placeholders in their lists), so moving
    the model to the GPU leaves them where they are. Yields the blocks."""
    import torch

    taken = []
    for name in names:
        parent_name, _, index = name.rpartition(".")
        parent, i = model.get_submodule(parent_name), int(index)
        taken.append((parent, i, parent[i]))
        parent[i] = torch.nn.Identity()
    try:
        yield [block for _, _, block in taken]
    finally:
        for parent, i, block in taken:
            parent[i] = block


class BlockSwap:
    """The hooks that bring each swapped block's frozen weights to ``device`` for its forward (module doc).
    Call after the adapters are on: trainable parameters in these blocks move to ``device`` and stay."""

    def __init__(self, model, names: list[str], device):
        import torch

        self.device = torch.device(device)
        self.names = list(names)
        self.resident = None  # the swapped block whose weights are on the device now
        self.moves_in = 0  # blocks brought in (forward passes and recomputations)
        self._host: dict[int, list] = {}
        self._handles = []
        pin = self.device.type == "cuda"
        for name in self.names:
            block = model.get_submodule(name)
            entries = []
            for p in block.parameters():
                if p.requires_grad:
                    p.data = p.data.to(self.device)
                    continue
                host = p.data.to("cpu")
                p.data = host.pin_memory() if pin else host
                state = getattr(p, "quant_state", None)
                if state is not None:
                    state.to("cpu")
                entries.append((p, p.data, state))
            self._host[id(block)] = entries
            self._handles.append(block.register_forward_pre_hook(self._bring_in))
            self._handles.append(block.register_forward_hook(self._send_back))

    def _bring_in(self, block, args) -> None:
        if self.resident is not None and self.resident is not block:
            self._send_back(self.resident)
        for p, host, state in self._host[id(block)]:
            p.data = host.to(self.device, non_blocking=True)
            if state is not None:  # a copy: a graph saved during this visit keeps its own
                visit = copy.copy(state)
                visit.to(self.device)
                p.quant_state = visit
        self.resident = block
        self.moves_in += 1

    def _send_back(self, block, *_) -> None:
        for p, host, state in self._host[id(block)]:
            p.data = host
            if state is not None:
                p.quant_state = state
        if self.resident is block:
            self.resident = None

    def on_device_bytes(self) -> int:
        """Bytes of swapped frozen weights on the device now (0 between forward passes on a GPU)."""
        total = 0
        for entries in self._host.values():
            for p, host, _ in entries:
                if same_device(p.data.device, self.device) and p.data.data_ptr() != host.data_ptr():
                    total += p.data.numel() * p.data.element_size()
        return total

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
