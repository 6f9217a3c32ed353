"""A quantized frozen base for SD3.5 / FLUX.1 LoRA (issue 14): the transformer's block Linear weights stored at
``model.base_precision`` (fp8 or nf4) under LoRA adapters that train in fp32.

What is quantized is what the planner counts (``sdplan.planner.transformer_linears``): every ``nn.Linear`` inside
``transformer_blocks`` / ``single_transformer_blocks`` (attention, feed-forward, modulation and the single
blocks' fused projections). Embedders, the final norm and projection, biases elsewhere stay in the compute dtype.
With fp8, the text encoders' Linear weights are stored in fp8 too (kohya's ``--fp8_base`` casts every resident
text encoder to fp8 and puts the embeddings back: ``store_text_encoders_fp8``; what the planner counts in
``sdplan.planner.frozen_text_encoder_bytes``); with nf4 they stay in the compute dtype (diffusers' QLoRA
quantizes the transformer only).

Which library, and why (checked against the packages' source and PyPI wheels, torch 2.13 CPU build):

- nf4: bitsandbytes ``Linear4bit`` (NF4, blocks of 64 with one fp32 absmax each, no double quantization: the
  0.5625 bytes per weight the planner assumes). It is QLoRA's own format; peft puts its 4-bit LoRA layer
  (``peft.tuners.lora.bnb.Linear4bit``) on it when the model says ``is_loaded_in_4bit``, as diffusers'
  ``BitsAndBytesConfig`` loading does; it is already sdplan's optional extra ``[bnb]`` (8-bit AdamW). Its PyPI
  wheel carries CUDA kernels (compute capability 6.0+) and, since 0.46.0, CPU kernels for 4-bit
  quantize/dequantize/gemv, so the same code trains on the CPU (the tests) as on an NVIDIA GPU.
- fp8: torch's ``float8_e4m3fn`` storage, upcast layer by layer to the compute dtype for the matmul (kohya's
  ``--fp8_base`` scheme): the transformer's block Linears become ``Fp8Linear`` (:func:`_fp8_linear_class`), whose
  backward upcasts the stored weight again instead of keeping the upcast copy; the text encoders (run without
  gradients) use diffusers' layerwise-casting hook (``diffusers.hooks``, diffusers >= 0.33). bitsandbytes has no
  fp8 storage; this needs no library beyond diffusers, and runs wherever torch casts float8 (any CUDA/ROCm GPU,
  the CPU).
- not torchao: peft's torchao LoRA layer (``peft/tuners/lora/torchao.py``) accepts int8 weights only (a
  TypeError for anything else), torchao's int4 kernels need CUDA, and its compiled parts are built for one torch
  release at a time (the 0.18 wheel against a torch older than the 2.13 here).

:func:`support_problem` is the one owner of what a machine needs for each precision; the launcher calls it on
the probed machine snapshot before launch (no torch import there), the trainer on its own device.
"""

from __future__ import annotations

import functools
from typing import Any

from sdplan.extras import install_hint
from sdplan.probe.snapshot import version_tuple

QUANTIZED = ("fp8", "nf4")
BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")
NF4_BLOCKSIZE = 64  # bitsandbytes' default; the planner's bytes (0.5 + 4/64 per weight) assume it
BITSANDBYTES_MIN = (0, 46)  # the first release whose PyPI wheel has CPU 4-bit kernels (backends/cpu/ops.py)
DIFFUSERS_MIN = (0, 33)  # the first release with diffusers.hooks.apply_layerwise_casting
NF4_MIN_CC = (6, 0)  # bitsandbytes installation guide: NF4/FP4 quantization needs compute capability 6.0+
KEEP = "pin model.base_precision=bf16"


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def install_needed(
    base_precision: str, *, bitsandbytes: str | None = None, diffusers: str | None = None
) -> tuple[str, str] | None:
    """What the installed packages (versions; None: not installed) lack for a ``base_precision`` base, as (what is
    needed, the pip command that installs it); None where they have it. The part of :func:`support_problem` an
    install fixes: the planner leaves out a base a machine's recorded packages cannot run and names this."""
    if base_precision == "fp8":
        have = version_tuple(diffusers)
        if have is None or have < DIFFUSERS_MIN:
            return (
                f"diffusers >= {_dotted(DIFFUSERS_MIN)} (layerwise fp8 casting; found {diffusers or 'none'})",
                f"pip install -U 'diffusers>={_dotted(DIFFUSERS_MIN)}'",
            )
    elif base_precision == "nf4":
        have = version_tuple(bitsandbytes)
        if have is None or have < BITSANDBYTES_MIN:
            found = f"found {bitsandbytes}" if bitsandbytes else "not installed"
            return f"bitsandbytes >= {_dotted(BITSANDBYTES_MIN)} ({found})", install_hint("bnb", upgrade=True)
    return None


def support_problem(
    base_precision: str,
    *,
    family: str | None,
    method: str,
    deepspeed: bool,
    device: str,
    gpus: tuple[tuple[str, str | None], ...] = (),
    bitsandbytes: str | None = None,
    diffusers: str | None = None,
) -> str | None:
    """Why this run cannot train over a ``base_precision`` base: one line saying what is needed and the fix;
    None when it can (bf16 always can). ``device``: "cpu", "cuda" or "rocm" (the torch build the run uses);
    ``gpus``: (vendor, compute capability "8.9" or None) of the GPUs it trains on; ``bitsandbytes`` /
    ``diffusers``: installed versions (None: not installed). Pure: no torch, no I/O."""
    from sdplan import registry

    if base_precision == "bf16":
        return None
    what = f"model.base_precision {base_precision}"
    if base_precision not in QUANTIZED:
        return f"{what}: not a base precision (bf16, fp8 or nf4)"
    if family is not None and family not in registry.FLOW_FAMILIES:
        return f"{what}: a quantized frozen base is for the SD3.5 / FLUX.1 transformers only, not {family}; {KEEP}"
    if method != "lora":
        return (
            f"{what} with method {method}: only LoRA trains over a quantized frozen base (the other methods train "
            f"the base's own weights); {KEEP}"
        )
    if deepspeed:
        return f"{what} with DeepSpeed: not supported (DeepSpeed shards the base's weights); {KEEP} or drop deepspeed"
    if base_precision == "fp8":
        if need := install_needed("fp8", diffusers=diffusers):
            return f"{what} needs {need[0]}: {need[1]}, or {KEEP}"
        return None
    # nf4: bitsandbytes' 4-bit kernels on an NVIDIA GPU or the CPU; fp8 the way out only where diffusers runs it
    instead = (
        "pin model.base_precision=fp8 or bf16" if install_needed("fp8", diffusers=diffusers) is None else KEEP
    )
    if device == "rocm" or any(vendor != "nvidia" for vendor, _ in gpus):
        return (
            f"{what} needs bitsandbytes' 4-bit kernels on an NVIDIA CUDA GPU (or the CPU); this run trains on "
            f"AMD ROCm: {instead}"
        )
    old = [cc for _, cc in gpus if (version_tuple(cc) or NF4_MIN_CC) < NF4_MIN_CC]
    if old:
        return (
            f"{what} needs an NVIDIA GPU of compute capability {_dotted(NF4_MIN_CC)}+ for bitsandbytes' 4-bit "
            f"kernels (this one: {old[0]}): {instead}"
        )
    if need := install_needed("nf4", bitsandbytes=bitsandbytes):
        return f"{what} needs {need[0]}: {need[1]}, or {instead}"
    return None


def check_run(cfg, family: str, device) -> None:
    """:func:`support_problem` for this process (its torch device and installed packages): a UsageError."""
    base = cfg.model.base_precision
    if base == "bf16":
        return
    import importlib.metadata

    import torch

    from sdplan.errors import UsageError

    def installed(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    gpus: tuple[tuple[str, str | None], ...] = ()
    kind = device.type
    if kind == "cuda":
        kind = "rocm" if torch.version.hip else "cuda"
        if kind == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            gpus = (("nvidia", f"{major}.{minor}"),)
    problem = support_problem(
        base,
        family=family,
        method=cfg.method,
        deepspeed=cfg.distributed.deepspeed is not None,
        device=kind,
        gpus=gpus,
        bitsandbytes=installed("bitsandbytes"),
        diffusers=installed("diffusers"),
    )
    if problem:
        raise UsageError(problem)


# -- quantizing a loaded transformer ------------------------------------------------------------------------


def block_linears(model, prefixes: tuple[str, ...] = BLOCK_PREFIXES) -> list[str]:
    """Names of the ``nn.Linear`` modules inside the transformer's blocks (what a quantized base stores);
    ``prefixes=("",)``: every Linear of ``model`` (one block)."""
    import torch

    return [
        name for name, m in model.named_modules() if type(m) is torch.nn.Linear and name.startswith(prefixes)
    ]


@functools.cache
def _nf4_linear_class():
    """bitsandbytes' ``Linear4bit`` that follows autocast as ``nn.Linear`` does. Linear4bit returns its input's
    dtype; under autocast an ``nn.Linear`` returns the autocast dtype. On a GPU autocast runs LayerNorm in fp32,
    so each Linear4bit after a block's norms returned fp32 and the rest of the block ran, and was saved for the
    backward, in fp32: on an H100 (FLUX.1 LoRA, 1024 px, checkpointing) 4.4 GiB per image of batch against
    bf16's 2.3, and 1.26-1.39x bf16's step time. The input is cast as autocast casts an ``nn.Linear``'s."""
    import bitsandbytes as bnb
    import torch

    class AutocastLinear4bit(bnb.nn.Linear4bit):
        def forward(self, x):
            kind = x.device.type
            if torch.is_autocast_enabled(kind):
                x = x.to(torch.get_autocast_dtype(kind))
            return super().forward(x)

    return AutocastLinear4bit


def _nf4_linear(linear, compute_dtype, device):
    """A bitsandbytes Linear4bit holding ``linear``'s weight as NF4 (quantized as it moves to ``device``)."""
    import bitsandbytes as bnb

    q = _nf4_linear_class()(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=False,
        quant_type="nf4",
        device="meta",
    )
    q.weight = bnb.nn.Params4bit(
        linear.weight.data,
        requires_grad=False,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=False,
        quant_type="nf4",
        module=q,
    )
    if linear.bias is not None:
        q.bias = linear.bias
    q.requires_grad_(False)
    # bitsandbytes (0.50.2 here) repacks the weight in place for its AVX512-BF16 CPU kernel at the first forward in eval
    # mode without gradients (a sample grid). The repack fails on a layer whose inputs are not a multiple of the
    # 64-wide block or whose outputs are not of 32 (the demo's tiny FLUX.1: "shape '[96, 0]' is invalid"), and on
    # the layers it repacks the training after that grid fails ("a view of a leaf Variable ... in-place") or, with
    # no bias, trains on with no gradient through the base layer (gemv_4bit has no autograd). Off: the CPU
    # dequantizes as it does in training (slower CPU sampling only; GPUs never take that path).
    q.support_avx512bf16_for_cpu = False
    return q.to(device)


@functools.cache
def _fp8_linear_class():
    """``nn.Linear`` whose weight is stored in fp8 and upcast to ``compute_dtype`` for each matmul, and again in
    the backward: autograd keeps the 1-byte weight, not the upcast copy. diffusers' layerwise-casting hook (used
    here before) upcasts the module and calls its forward, so autograd saved each layer's bf16 copy for the
    backward: without gradient checkpointing most of a bf16 base (16 GiB for FLUX.1, 10 GiB for SD3.5 Large: the
    Linears whose input needs a gradient) stayed alive until the backward reached it, beside the fp8 one.
    kohya's --fp8_base (autocast casts) holds the same copies; its users train with checkpointing, where one
    block's copies are held at a time."""
    import torch

    class UpcastMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, compute_dtype):
            ctx.save_for_backward(weight)
            ctx.x_dtype = x.dtype
            w = weight.to(compute_dtype)
            return torch.nn.functional.linear(x, w, bias)

        @staticmethod
        def backward(ctx, grad):
            (weight,) = ctx.saved_tensors
            return (grad @ weight.to(grad.dtype)).to(ctx.x_dtype), None, None, None

    class Fp8Linear(torch.nn.Linear):
        compute_dtype = torch.bfloat16

        def forward(self, x):
            return UpcastMatmul.apply(x, self.weight, self.bias, self.compute_dtype)

    return Fp8Linear


def _fp8_linear(linear, compute_dtype, device):
    """``linear`` as an Fp8Linear on ``device``: its weight stored in fp8, its bias in ``compute_dtype``."""
    import torch

    linear.__class__ = _fp8_linear_class()
    linear.compute_dtype = compute_dtype
    linear.weight.data = linear.weight.data.to(device=device, dtype=torch.float8_e4m3fn)
    if linear.bias is not None:
        linear.bias.data = linear.bias.data.to(device=device, dtype=compute_dtype)
    return linear


def quantize_base(model, base_precision: str, device, compute_dtype, *, names=None) -> dict[str, Any]:
    """Freeze ``model`` (a transformer on the CPU), store its block Linear weights (``names``: those Linear
    layers instead; a block set aside for block swap passes all of its own) at ``base_precision`` on ``device``
    one layer at a time (the device never holds the bf16 base), and move the rest there in ``compute_dtype``.
    Returns {"quantized": n layers, "weight_bytes": bytes of those layers' stored weights}. LoRA goes on top
    afterwards (``runtime.add_lora_adapters``)."""
    if base_precision not in QUANTIZED:
        raise ValueError(f"base precision {base_precision!r}: one of {QUANTIZED}")
    model.requires_grad_(False)
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), compute_dtype)
    if current != compute_dtype:
        model.to(dtype=compute_dtype)  # on the CPU: what stays unquantized, in the compute dtype
    names = block_linears(model) if names is None else list(names)
    stored = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        if base_precision == "nf4":
            q = _nf4_linear(linear, compute_dtype, device)
            setattr(parent, attr, q)
            stored += q.weight.numel() * q.weight.element_size() + _quant_state_bytes(q.weight.quant_state)
        else:
            stored += _fp8_linear(linear, compute_dtype, device).weight.nbytes
    if base_precision == "nf4":
        model.is_loaded_in_4bit = True  # peft then wraps Linear4bit in its 4-bit LoRA layer
    model.to(device)  # no dtype: the stored fp8 / 4-bit weights stay as they are
    return {"quantized": len(names), "weight_bytes": stored}


def store_text_encoders_fp8(text_encoders, compute_dtype) -> int:
    """Store the frozen text encoders' Linear weights in fp8, upcast to ``compute_dtype`` around each layer's
    forward (diffusers' layerwise-casting hook, as for the transformer); embeddings and norms keep the compute
    dtype (kohya ``flux_train_network.py`` ``prepare_text_encoder_fp8`` puts them back). T5's feed-forward
    casts its input to its output layer's weight dtype before calling it, so each T5 feed-forward block is cast
    as one (its three Linears come up together; kohya replaces that forward instead). Returns bytes stored."""
    import torch
    from diffusers.hooks import apply_layerwise_casting_hook

    fp8 = torch.float8_e4m3fn
    stored = 0
    for te in text_encoders:
        te.requires_grad_(False)
        whole: list[str] = []
        for name, module in te.named_modules():
            if any(name.startswith(w + ".") for w in whole):
                continue  # inside a block cast as one
            if type(module).__name__.startswith("T5Dense"):
                whole.append(name)
            elif not isinstance(module, torch.nn.Linear):
                continue
            apply_layerwise_casting_hook(module, fp8, compute_dtype, non_blocking=False)
        stored += sum(p.numel() for p in te.parameters() if p.dtype == fp8)
    return stored


def keep_out_of_ddp(model) -> list[str]:
    """Leave the quantized base weights out of DistributedDataParallel's start-up broadcast: every process
    loaded and quantized the same file the same way, they never get gradients, and gloo (the CPU backend)
    cannot broadcast float8 at all ("Invalid scalar type"). Call after the adapters are on (peft renames the
    wrapped layers' weights ``base_layer.weight``). Returns the names left out."""
    import torch

    names = [
        name
        for name, p in model.named_parameters()
        if not p.requires_grad and (p.dtype == torch.float8_e4m3fn or type(p).__name__ == "Params4bit")
    ]
    if names:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def _quant_state_bytes(state) -> int:
    """Bytes of a bitsandbytes QuantState's tensors (absmax per block, the NF4 code)."""
    import torch

    total = 0
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def describe(base_precision: str, summary: dict[str, Any]) -> str:
    """One line for the run's log."""
    n = summary["weight_bytes"]
    size = f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
    return (
        f"frozen base: {summary['quantized']} transformer-block Linear layers stored at {base_precision} "
        f"({size} of weights)"
    )
