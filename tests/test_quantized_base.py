"""A quantized frozen base for SD3.5 / FLUX.1 LoRA (issue 14): model.base_precision fp8 (torch float8 storage
through diffusers' layerwise casting) and nf4 (bitsandbytes Linear4bit, whose wheel has CPU 4-bit kernels), on
tiny transformers built in code; what each precision needs, and `sdplan train` refusing before launch where the
machine lacks it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    assert_same_run,
    generate_64px,
    losses,
    make_images,
    one_line_error,
    reset_accelerator,
    tiny_train_config,
    train_two_processes,
    trains_in_process,
)
from sdplan.trainer.quantize import support_problem

from sdplan.errors import UsageError

MACHINES = Path(__file__).parent / "fixtures" / "machines"
FAMILIES = ("flux-dev", "sd35-medium")


pytestmark = trains_in_process


def _needs(base: str) -> None:
    if base == "nf4":
        pytest.importorskip(
            "bitsandbytes", reason="the nf4 base needs bitsandbytes (pip install 'bitsandbytes>=0.46')"
        )


# -- what each precision needs (pure) ----------------------------------------------------------------------


def _problem(base, **kw):
    args = {
        "family": "flux-dev",
        "method": "lora",
        "deepspeed": False,
        "device": "cuda",
        "gpus": (("nvidia", "8.6"),),
        "bitsandbytes": "0.50.2",
        "diffusers": "0.42.1",
    }
    return support_problem(base, **{**args, **kw})


def test_support_problem_says_what_each_precision_needs_in_one_line():
    assert _problem("bf16", family="sd15", method="finetune", device="rocm", bitsandbytes=None) is None
    assert _problem("nf4") is None
    assert _problem("nf4", device="cpu", gpus=()) is None  # bitsandbytes' CPU 4-bit kernels
    assert _problem("fp8", device="rocm", gpus=(("amd", None),), bitsandbytes=None) is None
    assert _problem("fp8", device="cpu", gpus=()) is None
    refused = {
        "sd15": _problem("nf4", family="sd15"),
        "method": _problem("fp8", method="dreambooth"),
        "deepspeed": _problem("nf4", deepspeed=True),
        "rocm": _problem("nf4", device="rocm", gpus=(("amd", None),)),
        "maxwell": _problem("nf4", gpus=(("nvidia", "8.6"), ("nvidia", "5.2"))),
        "no bnb": _problem("nf4", bitsandbytes=None),
        "old bnb": _problem("nf4", bitsandbytes="0.45.5"),
        "old diffusers": _problem("fp8", diffusers="0.32.2"),
    }
    for why, msg in refused.items():
        assert msg and "\n" not in msg, why
        assert msg.startswith(("model.base_precision nf4", "model.base_precision fp8")), msg
        assert "pin model.base_precision=" in msg, msg  # the fix is in the line
    assert "SD3.5 / FLUX.1 transformers only, not sd15" in refused["sd15"]
    assert "only LoRA trains over a quantized frozen base" in refused["method"]
    assert "NVIDIA CUDA GPU (or the CPU)" in refused["rocm"] and "fp8 or bf16" in refused["rocm"]
    assert "compute capability 6.0+" in refused["maxwell"] and "5.2" in refused["maxwell"]
    assert "bitsandbytes >= 0.46 (not installed): pip install -U 'bitsandbytes>=0.46'" in refused["no bnb"]
    assert "(found 0.45.5)" in refused["old bnb"]
    assert "diffusers >= 0.33" in refused["old diffusers"] and "found 0.32.2" in refused["old diffusers"]


# -- sdplan train: the gate before launch, on the probed machine ---------------------------------------------


def _snapshot(name: str, **packages):
    from sdplan.machine import Snapshot

    snap = Snapshot.load(MACHINES / f"{name}.json")
    software = dataclasses.replace(
        snap.software,
        torch_build="rocm" if snap.gpus[0].vendor == "amd" else "cuda",
        packages={**snap.software.packages, **packages},
    )
    # the RX 6700 XT (gfx1031) trains under ROCm's override (without it train stops: no kernels for it)
    env = {**snap.env, "HSA_OVERRIDE_GFX_VERSION": "10.3.0"} if snap.gpus[0].vendor == "amd" else snap.env
    return dataclasses.replace(snap, software=software, env=env)


def _prepare(tmp_path, snapshot, base: str, family: str = "flux-dev", method: str = "lora"):
    from sdplan.launcher import UI, TrainRequest, prepare

    ds = tmp_path / "ds"
    if not ds.exists():
        make_images(ds)
    path = {"flux-dev": "black-forest-labs/FLUX.1-dev", "sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5"}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "method": method,
                "model": {"path": path[family], "family": family, "base_precision": base},
                "data": {"path": str(ds), "resolution": 512},
            }
        )
    )
    req = TrainRequest(config=str(cfg), out=str(tmp_path / "o"), dry_run=True, snapshot=snapshot)
    return prepare(req, UI(echo=lambda line: None))


@pytest.mark.parametrize(
    ("machine", "packages", "base", "want"),
    [
        ("t4", {"bitsandbytes": "0.50.2", "diffusers": "0.42.1"}, "nf4", None),
        ("rx6700xt", {"diffusers": "0.42.1"}, "fp8", None),
        ("t4", {"bitsandbytes": None}, "nf4", "needs bitsandbytes >= 0.46 (not installed)"),
        ("rx6700xt", {"bitsandbytes": "0.50.2"}, "nf4", "needs bitsandbytes' 4-bit kernels on an NVIDIA"),
        ("t4", {"diffusers": "0.31.0"}, "fp8", "needs diffusers >= 0.33"),
    ],
)
def test_train_gates_the_quantized_base_on_the_probed_machine(tmp_path, machine, packages, base, want):
    snap = _snapshot(machine, **packages)
    if want is None:
        p = _prepare(tmp_path, snap, base)
        assert p.cfg.model.base_precision == base  # allowed: trained as configured
        return
    with pytest.raises(UsageError) as e:
        _prepare(tmp_path, snap, base)
    assert want in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "o").exists()


def test_train_cli_refuses_a_quantized_unet_base_before_anything_is_written(tmp_path):
    from typer.testing import CliRunner

    from sdplan.cli import app

    ds = make_images(tmp_path / "ds")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "method": "lora",
                "model": {"path": "stable-diffusion-v1-5/stable-diffusion-v1-5", "base_precision": "nf4"},
                "data": {"path": str(ds), "resolution": 512},
            }
        )
    )
    out = tmp_path / "o"
    r = CliRunner().invoke(
        app, ["train", "--config", str(cfg), "--out", str(out), "--device", "cpu", "--yes"]
    )
    assert r.exit_code == 2, r.output
    assert "SD3.5 / FLUX.1 transformers only, not sd15" in r.output
    assert "model.base_precision=bf16" in r.output and "Traceback" not in r.output
    assert not out.exists()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from sdplan.trainer.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny-quant")
    return {f: save_tiny_model(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("data") / "ds", n=4)


# -- quantize_base on tiny transformers built in code --------------------------------------------------------


def _tiny_transformer(folder: Path, family: str):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = FluxTransformer2DModel if family == "flux-dev" else SD3Transformer2DModel
    return cls.from_pretrained(str(folder), subfolder="transformer").eval()


def _inputs(model, family: str):
    g = torch.Generator().manual_seed(0)
    c = model.config
    if family == "flux-dev":
        return {
            "hidden_states": torch.randn(1, 16, c.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, 8, c.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
            "timestep": torch.tensor([0.5]),
            "guidance": torch.tensor([1.0]),
            "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(8, 3),
        }
    return {
        "hidden_states": torch.randn(1, c.in_channels, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 8, c.joint_attention_dim, generator=g),
        "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
        "timestep": torch.tensor([500.0]),
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_quantize_base_stores_every_block_linear_and_keeps_the_output_close(tiny_models, family, base):
    _needs(base)
    from sdplan.trainer.quantize import block_linears, quantize_base

    model = _tiny_transformer(tiny_models[family], family)
    names = block_linears(model)
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
    assert names and any(n.startswith("transformer_blocks.0.attn.") for n in names)
    if family == "flux-dev":
        assert any(n.startswith("single_transformer_blocks.0.") for n in names)
    x = _inputs(model, family)
    with torch.no_grad():
        want = model(**x, return_dict=False)[0]
    summary = quantize_base(model, base, torch.device("cpu"), torch.float32)
    elements = sum(o * i for o, i in shapes.values())
    assert summary["quantized"] == len(names)
    for n in names:
        w = model.get_submodule(n).weight
        o, i = shapes[n]
        if base == "nf4":
            import bitsandbytes as bnb

            assert isinstance(model.get_submodule(n), bnb.nn.Linear4bit) and isinstance(w, bnb.nn.Params4bit)
            assert w.dtype == torch.uint8 and w.numel() == o * i // 2  # two 4-bit codes per byte
            assert w.quant_state.quant_type == "nf4" and w.quant_state.absmax.numel() == math.ceil(o * i / 64)
        else:
            assert w.dtype == torch.float8_e4m3fn and w.numel() == o * i
    rest = [p for name, p in model.named_parameters() if not any(name.startswith(n + ".") for n in names)]
    assert rest and all(p.dtype == torch.float32 for p in rest)  # embedders, final layer: not quantized
    assert not any(p.requires_grad for p in model.parameters())
    per_weight = summary["weight_bytes"] / elements  # fp8: 1 byte; nf4: 0.5 + one fp32 absmax per 64 + code
    assert (per_weight == 1.0) if base == "fp8" else (0.5625 <= per_weight < 0.5625 + 0.2)
    with torch.no_grad():
        got = model(**x, return_dict=False)[0]
    rel = float((got - want).norm() / want.norm())
    assert torch.isfinite(got).all() and 0 < rel < (0.05 if base == "fp8" else 0.2), rel


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_a_quantized_layer_follows_autocast_as_the_linear_it_replaces(tiny_models, base):
    """Under autocast an nn.Linear returns the autocast dtype whatever its input's; bitsandbytes' Linear4bit
    returns its input's. On a GPU autocast runs the blocks' LayerNorms in fp32, so every nf4 Linear after one
    returned fp32 and the rest of the block ran and was saved in fp32: measured on an H100 (FLUX.1 LoRA, 1024
    px), 4.4 GiB per image of batch against bf16's 2.3, 1.26-1.39x its step time, and torch warning that
    rms_norm got a float input. A quantized layer now answers as the Linear it replaces, gradient included."""
    _needs(base)
    from sdplan.trainer.quantize import block_linears, quantize_base

    model = _tiny_transformer(tiny_models["flux-dev"], "flux-dev")
    name = block_linears(model)[0]
    plain = model.get_submodule(name)
    w, b = plain.weight.detach().clone(), plain.bias.detach().clone()
    quantize_base(model, base, torch.device("cpu"), torch.bfloat16)
    layer = model.get_submodule(name)
    x = torch.randn(2, 5, w.shape[1], requires_grad=True)  # fp32, as a LayerNorm's output under CUDA autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
        want = torch.nn.functional.linear(x, w, b)
    assert want.dtype == torch.bfloat16 and got.dtype == want.dtype, got.dtype
    rel = float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())
    assert rel < (0.05 if base == "fp8" else 0.2), rel
    (grad,) = torch.autograd.grad(got.float().square().sum(), x)
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():  # outside autocast it computes in the compute dtype it was given
        assert layer(x.detach().to(torch.bfloat16)).dtype == torch.bfloat16


def test_an_nf4_layer_samples_and_trains_on_after_an_eval_forward_on_any_cpu(monkeypatch):
    """bitsandbytes repacks a Linear4bit for its AVX512-BF16 CPU kernel at its first eval forward without
    gradients (a sample grid). On the demo's tiny FLUX.1 (a 16-wide layer, narrower than the 64-wide block) the
    final grid failed after the weights were written: "shape '[96, 0]' is invalid for input of size 24". On a
    wide layer the repack works, but the training after that grid failed, or with no bias went on with no
    gradient through the base layer. The trainer's nf4 layers never take that path: as on a CPU without
    AVX512-BF16 (the machine's answer is forced to yes here; the narrow layer fails in Python before any kernel
    runs), they dequantize, in eval as in training."""
    _needs("nf4")
    import bitsandbytes.functional as F
    import bitsandbytes.nn.modules as modules
    from sdplan.trainer.quantize import _nf4_linear

    monkeypatch.setattr(modules, "has_avx512bf16", lambda: True, raising=False)
    torch.manual_seed(0)
    for i, o in ((16, 96), (96, 64), (64, 48), (3072, 64)):
        linear = torch.nn.Linear(i, o)
        layer = _nf4_linear(linear, torch.float32, "cpu")
        if i == 3072:  # the repack works here, and its kernel would run: not called on a CPU that may lack it
            assert layer.support_avx512bf16_for_cpu is False
            continue
        w = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        x = torch.randn(3, i)
        layer.eval()
        with torch.no_grad():
            got = layer(x)
        torch.testing.assert_close(got, x @ w.T + linear.bias.detach())
        layer.train()
        x.requires_grad_(True)
        layer(x).sum().backward()
        torch.testing.assert_close(x.grad, w.sum(0).expand(3, i))


@pytest.mark.parametrize("family", ["flux-dev", "sd35-medium"])
def test_an_fp8_base_keeps_only_its_fp8_weights_for_the_backward(tiny_models, family):
    """What autograd saves for the backward through an fp8 base: the 1-byte stored weights, never their upcast
    copies. Through diffusers' layerwise-casting hook every block Linear's compute-dtype copy was saved (without
    checkpointing a whole bf16 base beside the fp8 one, which the planner does not count); the input gradient
    is the same as through the upcast weights."""
    from sdplan.trainer.quantize import block_linears, quantize_base

    model = _tiny_transformer(tiny_models[family], family)
    names = block_linears(model)
    quantize_base(model, "fp8", torch.device("cpu"), torch.float32)
    stored = [model.get_submodule(n).weight for n in names]
    x = _inputs(model, family)
    x["hidden_states"].requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(**x, return_dict=False)[0]
    # the stored weights themselves (of every Linear whose input needs a gradient: not the modulation ones,
    # which read the frozen timestep embedding)
    assert len({id(w) for w in stored} & {id(t) for t in saved}) > len(stored) // 2
    copies = [
        t
        for t in saved
        for w in stored
        if t.dtype != w.dtype and t.shape == w.shape and torch.equal(t, w.to(t.dtype))
    ]
    assert not copies, f"{len(copies)} upcast copies of the stored weights kept for the backward"
    (grad,) = torch.autograd.grad(out.square().sum(), x["hidden_states"])
    # the same model with the stored weights upcast once, as plain Linears
    for n in names:
        m = model.get_submodule(n)
        m.__class__ = torch.nn.Linear
        m.weight.data = m.weight.data.to(torch.float32)
    x["hidden_states"] = x["hidden_states"].detach().requires_grad_(True)
    (want,) = torch.autograd.grad(model(**x, return_dict=False)[0].square().sum(), x["hidden_states"])
    assert torch.allclose(grad, want, rtol=1e-5, atol=1e-6)


# -- LoRA over a quantized base through the one loop ---------------------------------------------------------


def test_an_fp8_base_stores_the_text_encoders_linears_in_fp8_and_keeps_embeddings_and_norms(tiny_models):
    """kohya's --fp8_base (and the planner's frozen_text_encoder_bytes): the resident text encoders' Linear
    weights in fp8, their embeddings and norms in the compute dtype; the outputs stay close to bf16's."""
    from sdplan.trainer.quantize import store_text_encoders_fp8
    from transformers import CLIPTextModel, T5EncoderModel

    folder = tiny_models["flux-dev"]
    encoders = [
        CLIPTextModel.from_pretrained(str(folder / "text_encoder"), torch_dtype=torch.bfloat16).eval(),
        T5EncoderModel.from_pretrained(str(folder / "text_encoder_2"), torch_dtype=torch.bfloat16).eval(),
    ]
    vocab = min(te.config.vocab_size for te in encoders)
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = [te(ids)[0].float() for te in encoders]
    stored = store_text_encoders_fp8(encoders, torch.bfloat16)
    for te in encoders:
        for name, module in te.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, torch.nn.Linear):
                assert weight.dtype == torch.float8_e4m3fn, name
            elif weight is not None:  # embeddings, layer norms
                assert weight.dtype == torch.bfloat16, name
    linear_weights = sum(
        m.weight.numel() for te in encoders for m in te.modules() if isinstance(m, torch.nn.Linear)
    )
    assert 0 < linear_weights <= stored  # 1 byte per Linear weight (and bias)
    with torch.no_grad():
        after = [te(ids)[0].float() for te in encoders]
    for b, a in zip(before, after):
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < 0.2  # fp8 storage of random tiny weights: close, not equal


def _train(model: Path, family: str, data: Path, out: Path, base: str, *extra: str):
    """LoRA on ``model`` over a ``base`` base; returns (summary, the transformer trained)."""
    from sdplan.trainer import loop
    from sdplan.trainer.recipes.lora import LoRA

    seen = {}

    class Watched(LoRA):  # the real recipe; keeps a handle on the transformer it trained
        def setup(self):
            super().setup()
            seen["transformer"] = self.unet
            seen["summary"] = self.base_summary
            seen["recipe"] = self

    cfg = tiny_train_config(
        model,
        data,
        out,
        f"model.base_precision={base}",
        "memory.cache_text_encoder_outputs=true",
        *extra,
        family=family,
        name="t",
        learning_rate=1e-2,
        max_steps=3,
    )
    reset_accelerator()
    summary = loop.train(cfg, Watched)
    return summary, seen


_REFERENCE: dict[str, dict] = {}


def _shapes(path: Path) -> dict[str, tuple]:
    from safetensors.torch import load_file

    return {k: tuple(v.shape) for k, v in load_file(str(path)).items()}


def _reference(tiny_models, dataset, tmp_path_factory, family):
    """The LoRA files of a bf16 (here: unquantized fp32) base, trained once per family."""
    if family not in _REFERENCE:
        out = tmp_path_factory.mktemp(f"ref-{family}")
        _train(tiny_models[family], family, dataset, out, "bf16")
        _REFERENCE[family] = {
            "diffusers": _shapes(out / "pytorch_lora_weights.safetensors"),
            "kohya": _shapes(out / "t.kohya.safetensors"),
            "untrained": _untrained(out / "pytorch_lora_weights.safetensors"),
        }
    return _REFERENCE[family]


def _untrained(path: Path) -> set[str]:
    """lora_B matrices still at their zero init (SD3.5's last block: its context queries reach no output)."""
    from safetensors.torch import load_file

    return {k for k, v in load_file(str(path)).items() if "lora_B" in k and float(v.abs().max()) == 0}


@pytest.mark.train
@pytest.mark.parametrize(
    ("family", "base", "extra"),
    [
        ("flux-dev", "nf4", ("memory.gradient_checkpointing=true",)),
        ("flux-dev", "fp8", ()),
        ("sd35-medium", "nf4", ()),
        ("sd35-medium", "fp8", ("training.precision=bf16", "memory.gradient_checkpointing=true")),
    ],
)
def test_lora_trains_over_a_quantized_base_and_exports_what_a_bf16_base_exports(
    tiny_models, dataset, tmp_path, tmp_path_factory, family, base, extra
):
    _needs(base)
    from diffusers import DiffusionPipeline

    out = tmp_path / "out"
    summary, seen = _train(tiny_models[family], family, dataset, out, base, *extra)
    assert summary["steps"] == 3 and math.isfinite(summary["final_loss"])
    transformer = seen["transformer"]
    assert seen["summary"]["quantized"] > 0
    # peft's adapters sit on quantized base layers: the 4-bit LoRA layer on Linear4bit, fp8 weights under the
    # Fp8Linear; only the adapters train
    lora_layers = [m for m in transformer.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert lora_layers
    for m in lora_layers:
        w = m.base_layer.weight
        if base == "nf4":
            from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

            assert isinstance(m, LoraLinear4bit) and w.dtype == torch.uint8
        else:
            assert w.dtype == torch.float8_e4m3fn
        assert not w.requires_grad and m.lora_A["default"].weight.dtype == torch.float32
    trained = {n for n, p in transformer.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    # the same files, keys and shapes as over an unquantized base (diffusers/peft and kohya/ComfyUI names)
    ref = _reference(tiny_models, dataset, tmp_path_factory, family)
    diff, kohya = out / "pytorch_lora_weights.safetensors", out / "t.kohya.safetensors"
    assert _shapes(diff) == ref["diffusers"] and _shapes(kohya) == ref["kohya"]
    # lora_B starts at zero: every one the unquantized base trains has trained
    assert _untrained(diff) == ref["untrained"] and len(ref["untrained"]) <= 1
    # loads back into the (unquantized) pipeline and changes what it makes
    pipe = DiffusionPipeline.from_pretrained(str(tiny_models[family]))
    before = generate_64px(pipe)
    pipe.load_lora_weights(str(out))
    assert float(np.abs(generate_64px(pipe) - before).max()) > 1e-3
    assert (out / "samples" / "final.png").is_file()  # sampled through the quantized transformer


@pytest.mark.slow
@pytest.mark.train
def test_two_processes_train_over_an_fp8_base(tiny_models, dataset, tmp_path):
    """DDP leaves the quantized weights out of its start-up broadcast (gloo cannot send float8 at all)."""
    import json

    cfg = tiny_train_config(
        tiny_models["flux-dev"],
        dataset,
        tmp_path / "out",
        "model.base_precision=fp8",
        "training.batch_size=1",
        "memory.cache_text_encoder_outputs=true",
        family="flux-dev",
        name="t",
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    train_two_processes(path, tmp_path)
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["num_processes"] == 2 and math.isfinite(summary["final_loss"])
    assert (tmp_path / "out" / "t.kohya.safetensors").is_file()


# -- block swap (memory.blocks_to_swap) ------------------------------------------------------------------------


def test_block_swap_support_problem_and_the_gate_before_launch(tmp_path):
    from sdplan.trainer.blockswap import support_problem as swap_problem

    ok = {
        "family": "flux-dev",
        "method": "lora",
        "gradient_checkpointing": True,
        "processes": 1,
        "deepspeed": False,
    }
    assert swap_problem(0, **{**ok, "family": "sd15", "gradient_checkpointing": False}) is None
    assert swap_problem(16, **ok) is None
    for change, want in (
        ({"family": "sd15"}, "SD3.5 / FLUX.1 transformers only"),
        ({"method": "finetune"}, "for LoRA only"),
        ({"gradient_checkpointing": False}, "needs memory.gradient_checkpointing=true"),
        ({"processes": 2}, "in one process"),
    ):
        msg = swap_problem(16, **{**ok, **change})
        assert want in msg and "pin memory.blocks_to_swap=0" in msg and "\n" not in msg
    # sdplan train, a config as given: refused before anything is written without checkpointing, else allowed
    snap = _snapshot("t4")
    from sdplan.launcher import UI, TrainRequest, prepare

    make_images(tmp_path / "ds")
    for gc in (False, True):
        cfg = tmp_path / "c.yaml"
        data = {
            "method": "lora",
            "model": {"path": "black-forest-labs/FLUX.1-dev", "family": "flux-dev"},
            "data": {"path": str(tmp_path / "ds"), "resolution": 512},
            "memory": {"blocks_to_swap": 16, "gradient_checkpointing": gc},
        }
        cfg.write_text(yaml.safe_dump(data))
        req = TrainRequest(config=str(cfg), out=str(tmp_path / "o"), dry_run=True, snapshot=snap)
        if gc:
            assert prepare(req, UI(echo=lambda line: None)).cfg.memory.blocks_to_swap == 16
        else:
            with pytest.raises(UsageError, match="needs memory.gradient_checkpointing=true"):
                prepare(req, UI(echo=lambda line: None))
            assert not (tmp_path / "o").exists()


def _flux_in_code():
    """A FLUX transformer with 2 double- and 2 single-stream blocks (the tiny model has one of each)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=48,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )


def test_block_swap_picks_kohyas_blocks_and_changes_nothing_on_the_cpu():
    import copy

    from peft import LoraConfig
    from sdplan.trainer.blockswap import BlockSwap, swap_names

    model = _flux_in_code()
    assert swap_names(model, "flux-dev", 1) == ["single_transformer_blocks.0", "single_transformer_blocks.1"]
    assert swap_names(model, "flux-dev", 2) == [
        "transformer_blocks.1",
        "single_transformer_blocks.0",
        "single_transformer_blocks.1",
    ]
    with pytest.raises(
        UsageError, match="swaps 4 of single_transformer_blocks but this flux-dev transformer has 2"
    ):
        swap_names(model, "flux-dev", 3)
    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_v"])
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # non-zero, so the swapped blocks' adapters matter
    model.enable_gradient_checkpointing()
    model.train()
    plain = copy.deepcopy(model)
    swap = BlockSwap(model, swap_names(model, "flux-dev", 2), "cpu")
    x = _inputs(model, "flux-dev")

    def step(m):
        m.zero_grad(set_to_none=True)
        out = m(**x, return_dict=False)[0]
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    (want, want_grads), (got, got_grads) = step(plain), step(model)
    assert torch.equal(got, want) and want_grads.keys() == got_grads.keys()
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)
    assert any(n.startswith("single_transformer_blocks.1.") for n in got_grads)  # a swapped block's adapter
    assert swap.moves_in == 2 * 3  # each swapped block: its forward, then its recomputation for the backward
    frozen = [
        p
        for n, p in model.named_parameters()
        if n.startswith("transformer_blocks.1.") and not p.requires_grad
    ]
    assert frozen and all(p.device.type == "cpu" for p in frozen)


@pytest.mark.train
@pytest.mark.parametrize("base", ["bf16", "fp8", "nf4"])
def test_block_swap_trains_the_same_losses_through_the_loop(tiny_models, dataset, tmp_path, base):

    _needs(base)
    gc = "memory.gradient_checkpointing=true"
    runs = {}
    for n in (0, 1):
        out = tmp_path / f"swap{n}"
        summary, seen = _train(
            tiny_models["sd35-medium"], "sd35-medium", dataset, out, base, gc, f"memory.blocks_to_swap={n}"
        )
        runs[n] = losses(out), seen
    assert runs[1][0] == runs[0][0] and all(math.isfinite(v) for v in runs[1][0])
    swap = runs[1][1]["recipe"].block_swap
    assert swap.names == ["transformer_blocks.1"] and runs[0][1]["recipe"].block_swap is None
    assert swap.moves_in == 3 * 2 + 2  # 3 steps (forward + recomputation), then the 2-step final sample


@pytest.mark.train
def test_resume_over_an_nf4_base_equals_uninterrupted(tiny_models, dataset, tmp_path):
    """A checkpoint holds the adapters only; the resumed run quantizes the same base the same way."""

    from safetensors.torch import load_file
    from sdplan.trainer import checkpoint, run

    _needs("nf4")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def cfg(out, *extra):
        return tiny_train_config(
            tiny_models["flux-dev"],
            dataset,
            out,
            "model.base_precision=nf4",
            "memory.cache_text_encoder_outputs=true",
            *extra,
            family="flux-dev",
            name="t",
            max_steps=4,
        )

    run.train(cfg(straight, "checkpoints.keep_every_steps=2"))
    run.train(cfg(resumed), resume=str(checkpoint.checkpoint_root(straight) / "step-000002"))
    kept = load_file(str(next(checkpoint.checkpoint_root(straight).glob("step-000002/*.safetensors"))))
    assert kept and all(".lora_" in k for k in kept)  # no quantized base weights in the checkpoint

    assert len(losses(straight)) == 4
    assert_same_run(straight, resumed)


# -- sdplan recommend: only the bases the machine's packages run ---------------------------------------------


def _recommend_on(tmp_path, snap, *args: str):
    from typer.testing import CliRunner

    from sdplan.cli import app

    machine = tmp_path / f"machine{len(list(tmp_path.glob('machine*')))}.json"
    snap.save(machine)
    return CliRunner().invoke(
        app, ["recommend", "--method", "lora", "--model", "sd35-medium", "--machine", str(machine), *args]
    )


@pytest.mark.parametrize(
    ("machine", "base", "lacks", "install"),
    [
        ("rtx3060_12gb", "fp8", {"diffusers": "0.31.0"}, "pip install -U 'diffusers>=0.33'"),
        ("t4", "nf4", {"bitsandbytes": None}, "pip install -U 'bitsandbytes>=0.46'"),
    ],
)
def test_recommend_plans_only_a_base_the_machines_packages_run(tmp_path, machine, base, lacks, install):
    """rtx3060_12gb.json records diffusers 0.31.0, yet its SD3.5 Medium LoRA was planned with an fp8 base (t4.json,
    without bitsandbytes, an nf4 base): `sdplan train` then refused its own plan, and the bf16 base its refusal
    offered did not fit either. The search leaves such a base out and says which install lets it fit; after that
    install the plan takes it and train accepts it. Catalog hardware records no packages: planned as before."""
    from sdplan.launcher import UI, TrainRequest, prepare

    ds = make_images(tmp_path / "ds", n=13)
    without = _snapshot(machine, **lacks)
    r = _recommend_on(tmp_path, without, "--dataset", str(ds), "--json")
    d = yaml.safe_load(r.stdout)
    assert (d["plan"] or {}).get("base_precision", "bf16") != base, d["plan"]
    said = [line for line in d["reasons"] if line.startswith(f"an {base} base would fit")]
    assert len(said) == 1 and f"after `{install}`" in said[0], d["reasons"]
    if d["plan"] is None:  # nothing fits without it: the refusal names the install as the fix
        assert d["needs"]["fits_after_install"] == [{"install": install, "base_precision": base}], d["needs"]
        headline = _recommend_on(tmp_path, without, "--dataset", str(ds)).stdout
        assert f"fits this GPU after: `{install}` (an {base} base)" in headline, headline
        # sdplan train's refusal says the same fix (with the base to set, the bf16 its gate offered included)
        from conftest import fake_diffusers_folder

        from sdplan.errors import SdplanError
        from sdplan.profiles import load_profiles

        transformer = load_profiles().model("sd35-medium").transformer
        model = fake_diffusers_folder(tmp_path / "sd35m", "sd35-medium", denoiser=transformer)
        for overrides in ([], ["model.base_precision=bf16"]):
            train = TrainRequest(
                method="lora", model=str(model), dataset=str(ds),
                out=str(tmp_path / "run"), dry_run=True, snapshot=without, overrides=overrides,
            )  # fmt: skip
            with pytest.raises(SdplanError) as refused:
                prepare(train, UI(echo=lambda line: None))
            said = f"{refused.value} {getattr(refused.value, 'fix', '')}"
            assert f"it fits this GPU after `{install}`, then model.base_precision={base}" in said, said
    # the install made: the plan takes the base, and train runs the plan it wrote
    have = {"diffusers": "0.33.0"} if base == "fp8" else {"bitsandbytes": "0.46.0", "diffusers": "0.31.0"}
    with_it = _snapshot(machine, **have)
    out = tmp_path / "plan"
    r = _recommend_on(tmp_path, with_it, "--dataset", str(ds), "--out", str(out))
    assert r.exit_code == 0, r.output
    written = yaml.safe_load((out / "sdplan.yaml").read_text())
    assert written["model"]["base_precision"] == base
    req = TrainRequest(config=str(out / "sdplan.yaml"), dry_run=True, snapshot=with_it)
    assert prepare(req, UI(echo=lambda line: None)).cfg.model.base_precision == base
    # catalog hardware: no packages known, so the base stays a candidate
    from typer.testing import CliRunner

    from sdplan.cli import app

    gpu = {"rtx3060_12gb": "RTX 3060 12GB", "t4": "T4"}[machine]
    args = ["recommend", "--method", "lora", "--model", "sd35-medium", "--hardware", gpu, "--images", "13"]
    catalog = yaml.safe_load(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert not any("would fit (" in line and "after `pip" in line for line in catalog["reasons"])


def test_a_pinned_base_the_machine_cannot_run_is_refused_naming_the_install(tmp_path):
    """nf4 pinned on t4.json (no bitsandbytes, diffusers 0.31.0): one line naming the install, and bf16 as the other
    way: fp8, which its refusal offered, needs a newer diffusers there too. train's own gate says the same."""
    snap = _snapshot("t4", bitsandbytes=None, diffusers="0.31.0")
    r = _recommend_on(tmp_path, snap, "--images", "13", "model.base_precision=nf4")
    line = one_line_error(r, 2, "model.base_precision=nf4", "pip install -U 'bitsandbytes>=0.46'")
    assert "model.base_precision=bf16" in line and "=fp8" not in line, line
    r = _recommend_on(tmp_path, snap, "--images", "13", "model.base_precision=fp8")
    one_line_error(r, 2, "model.base_precision=fp8", "pip install -U 'diffusers>=0.33'")
    msg = _problem("nf4", bitsandbytes=None, diffusers="0.31.0")
    assert msg.endswith("or pin model.base_precision=bf16"), msg
    assert _problem("nf4", bitsandbytes=None).endswith("pin model.base_precision=fp8 or bf16")


def test_nf4_is_not_planned_on_a_gpu_older_than_compute_capability_6():
    """A GTX TITAN X (5.2) with bitsandbytes installed: recommend planned an nf4 base, which train then refused
    (bitsandbytes' 4-bit kernels need 6.0+). The planner leaves it out, as it leaves out what an install lacks."""
    from sdplan import planner as P
    from sdplan.profiles import load_profiles

    snap = _snapshot("t4", bitsandbytes="0.50.2", diffusers="0.42.1")
    old = dataclasses.replace(snap.gpus[0], name="NVIDIA GeForce GTX TITAN X", compute_capability="5.2")
    snap = dataclasses.replace(snap, gpus=(old,))
    prof = load_profiles()
    hw = P.hardware_from_snapshot(snap, prof)
    assert "compute capability 6.0+" in P.base_precision_allowed("nf4", hw.gpus[0])
    res = P.plan(hw, prof, P.Request(method="lora", model="flux-schnell", images=13))
    assert res.plan is None or res.plan.base_precision != "nf4"
    assert not any("nf4" in r for r in res.reasons if r.startswith("nothing fits"))
