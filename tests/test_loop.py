"""The one training loop's seams: the recipes' dtypes (what the bench builds too) and the test-fault hook."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sdplan.trainer import faults, run

from sdplan.config import TrainConfig
from sdplan.errors import UsageError


def _cfg(method: str, *, full_half_weights: bool = False, train_text_encoder: bool = False) -> TrainConfig:
    cfg = TrainConfig()
    cfg.method = method
    cfg.training.precision = "bf16"
    cfg.training.full_half_weights = full_half_weights
    cfg.training.train_text_encoder = train_text_encoder
    return cfg


@pytest.mark.parametrize(
    ("method", "half", "train_te", "unet", "te"),
    [
        ("lora", False, True, "bfloat16", "bfloat16"),  # frozen base in half precision; adapters fp32
        ("finetune", False, False, "float32", "bfloat16"),  # fp32 master weights
        ("finetune", True, True, "bfloat16", "float32"),  # kohya --full_bf16
        ("dreambooth", True, False, "bfloat16", "bfloat16"),
        ("textual-inversion", False, False, "bfloat16", "float32"),  # the embedding trains in fp32
    ],
)
def test_each_recipe_says_the_dtype_of_each_model(method, half, train_te, unet, te):
    bf16 = SimpleNamespace(mixed_precision="bf16")
    dtypes = run.recipe(method).dtypes(
        _cfg(method, full_half_weights=half, train_text_encoder=train_te), bf16
    )
    assert (str(dtypes["unet"]), str(dtypes["text_encoder"]), str(dtypes["vae"])) == (
        f"torch.{unet}",
        f"torch.{te}",
        "torch.bfloat16",
    )


def test_every_method_has_a_recipe():
    assert sorted(run.recipes()) == ["dreambooth", "finetune", "lora", "textual-inversion"]
    with pytest.raises(Exception, match="method: must be one of"):
        run.recipe("hypernetwork")


def test_faults_are_read_once_from_the_environment():
    f = faults.Faults.from_env({faults.NAN_AT_STEP_ENV: "3", faults.BENCH_OOM_ABOVE_BATCH_ENV: "2"})
    assert (f.oom_at_step, f.nan_at_step, f.bench_oom_above_batch) == (None, 3, 2)
    assert f.bench_oom(3) and not f.bench_oom(2)
    assert faults.Faults.from_env({}) == faults.NONE
    with pytest.raises(UsageError, match=faults.OOM_AT_STEP_ENV):
        faults.Faults.from_env({faults.OOM_AT_STEP_ENV: "soon"})


def test_an_injected_out_of_memory_is_not_recorded_in_the_local_profile_store(tmp_path, monkeypatch):
    """A run with SDPLAN_INJECT_* wrote its injected out-of-memory (a CPU 'OOM' and a 'fits') into the user's
    local profile store, which the planner learns from. Now it says so and writes nothing, unless the test of
    that recording asks for it (SDPLAN_RECORD_INJECTED=1)."""
    from sdplan import launcher

    store = tmp_path / "store"
    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(store))
    cfg = TrainConfig()
    cfg.model.family = "sd15"
    p = SimpleNamespace(inputs=SimpleNamespace(family="sd15"), snapshot=None, gpu_ids=None)
    said: list[str] = []
    ui = launcher.UI(echo=said.append)
    oom = {"step": 9, "batch_size": 2, "grad_accum": 1, "message": "CUDA out of memory (injected)"}
    monkeypatch.setenv(faults.OOM_AT_STEP_ENV, "9")
    assert launcher._record(cfg, oom, p, ui, fits=False) is None
    assert not store.exists()
    assert said == [
        f"not recorded in the local profile store: faults are injected ({faults.OOM_AT_STEP_ENV})"
    ]
    monkeypatch.setenv(faults.RECORD_INJECTED_ENV, "1")
    assert launcher._record(cfg, oom, p, ui, fits=False) == store / "methods" / "observed-lora.yaml"
    monkeypatch.delenv(faults.OOM_AT_STEP_ENV)
    monkeypatch.delenv(faults.RECORD_INJECTED_ENV)
    assert faults.unrecordable() == []


def test_the_injected_faults_line_is_said_once_in_an_out_of_memory_retry(tmp_path, monkeypatch):
    """An out-of-memory retry records twice (the out of memory, then the fit after the retry): the line that
    says nothing is recorded because faults are injected was printed twice. It is said once."""
    from sdplan import launcher

    monkeypatch.setenv("SDPLAN_PROFILE_DIR", str(tmp_path / "store"))
    cfg = TrainConfig()
    cfg.model.family = "sd15"
    p = SimpleNamespace(inputs=SimpleNamespace(family="sd15"), snapshot=None, gpu_ids=None)
    said: list[str] = []
    ui = launcher.UI(echo=said.append)
    monkeypatch.setenv(faults.OOM_AT_STEP_ENV, "9")
    launcher._record(cfg, {"step": 9, "batch_size": 2, "grad_accum": 1}, p, ui, fits=False)
    launcher._record(cfg, {}, p, ui, fits=True)
    assert said == [
        f"not recorded in the local profile store: faults are injected ({faults.OOM_AT_STEP_ENV})"
    ]


def test_a_damaged_checkpoint_error_nests_no_parentheses(tmp_path):
    """ "every checkpoint ... is incomplete or damaged (...optimizer.bin is damaged (its sha256 ...)) (start it
    over: `sdplan train --force` instead of --resume (the trainer's own command: without --resume))": three
    levels. Now the reasons follow a colon, and only the fix is in parentheses."""
    import json

    from sdplan.trainer import checkpoint

    path = checkpoint.checkpoint_root(tmp_path) / "step-000002"
    path.mkdir(parents=True)
    (path / "optimizer.bin").write_bytes(b"damaged")
    state = {"images_seen": 4, "files": {"optimizer.bin": 7}, "sha256": {"optimizer.bin": "0" * 64}}
    (path / checkpoint.STATE_FILE).write_text(json.dumps(state))
    for resume in ("latest", str(path)):
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.resolve_resume(resume, tmp_path)
        line, depth, deepest = str(err.value), 0, 0
        for c in line:
            depth += {"(": 1, ")": -1}.get(c, 0)
            deepest = max(deepest, depth)
        assert "optimizer.bin is damaged" in line and "--force" in line
        assert deepest == 1, line


def test_injected_faults_change_only_their_step():
    import torch

    f = faults.Faults(oom_at_step=2, nan_at_step=3)
    loss = torch.tensor(1.0)
    assert f.after_forward(1, 2, loss) is loss
    assert torch.isnan(f.after_forward(3, 2, loss))
    assert f.after_forward(2, 1, loss) is loss  # the OOM is injected only above batch 1
    with pytest.raises(torch.OutOfMemoryError):
        f.after_forward(2, 2, loss)


def test_ema_of_bf16_weights_is_kept_in_fp32_and_follows_them():
    """training.full_half_weights trains bf16 weights; an EMA kept in bf16 moves by (1 - decay) x the gap per
    update, below bf16's resolution, and never left the starting weights (the exported EMA was the base)."""
    import torch
    from sdplan.trainer.loop import Ema

    class Tiny(torch.nn.Linear):
        config: dict = {}  # what EMAModel keeps to rebuild the model class

    model = Tiny(16, 16).to(torch.bfloat16)
    master = torch.full_like(model.weight, 0.5, dtype=torch.float32)  # the weights as training moves them
    with torch.no_grad():
        model.weight.copy_(master)
    ema = Ema(model, decay=0.999, device="cpu", every=1)
    for _ in range(2000):
        master += 1e-4
        with torch.no_grad():
            model.weight.copy_(master)
        ema.step(model.parameters())
    average = ema.model.shadow_params[0]
    assert average.dtype == torch.float32
    assert 0.55 < float(average.mean()) < float(master.mean())  # behind the weights (0.7), but following them
    ema.copy_to(model)  # back into the bf16 model
    assert model.weight.dtype == torch.bfloat16 and float(model.weight.detach().float().mean()) > 0.55


def _peak_new_bytes(fn):
    """(result, peak bytes of the tensors ``fn`` creates that are alive at once): every op's new output storage
    is counted once while a Python reference to it lives (views and in-place results are not new). Deterministic, unlike
    the process's peak RSS, which earlier tests in the same worker may already have raised."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    live: dict[int, tuple] = {}  # storage pointer -> (weakref to a tensor using it, bytes)
    peak = [0]

    class Meter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr in inputs:  # a view or an in-place result: nothing new
                        continue
                    if ptr not in live or live[ptr][0]() is None:
                        live[ptr] = (weakref.ref(t), t.untyped_storage().nbytes())
            for ptr in [k for k, (ref, _) in live.items() if ref() is None]:
                del live[ptr]
            peak[0] = max(peak[0], sum(n for _, n in live.values()))
            return out

    with Meter():
        result = fn()
    return result, peak[0]


def _bf16_model():
    import torch

    class Tiny(torch.nn.Sequential):
        config: dict = {}

    return Tiny(*(torch.nn.Linear(512, 512, bias=False) for _ in range(8))).to(torch.bfloat16)


def test_ema_holds_one_fp32_copy_of_the_weights_while_it_is_made():
    """EMAModel clones what it is given: handing it fp32 copies held two copies of the model at once (on the
    GPU with ema.device=gpu: an SDXL UNet in bf16 took 4x its size at start-up instead of 2x)."""
    import torch
    from sdplan.trainer.loop import Ema

    model = _bf16_model()
    fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
    ema, peak = _peak_new_bytes(lambda: Ema(model, decay=0.99, device="cpu", every=1))
    assert peak <= 1.05 * fp32_bytes  # one fp32 copy (two before)
    averages = ema.model.shadow_params
    assert all(a.dtype == torch.float32 for a in averages)
    assert all(torch.equal(a, p.detach().float()) for a, p in zip(averages, model.parameters()))
    assert ema.model.state_dict()["shadow_params"][0] is averages[0]  # what a checkpoint saves


def test_an_ema_update_holds_one_parameter_copy_at_a_time_and_follows_emamodel():
    """EMAModel.step takes a list: the fp32 copies of bf16 weights (or host-RAM copies of GPU weights) it needs
    were all alive at once, a whole fp32 model per update. Ema.step converts one parameter at a time, with
    EMAModel's own decay schedule and the same result."""
    import torch
    from diffusers.training_utils import EMAModel
    from sdplan.trainer.loop import Ema

    model = _bf16_model()
    ema = Ema(model, decay=0.9, device="cpu", every=1)
    reference = EMAModel([p.detach().float().clone() for p in model.parameters()], decay=0.9)
    one_fp32 = max(p.numel() for p in model.parameters()) * 4
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        _, peak = _peak_new_bytes(lambda: ema.step(model.parameters()))
        assert peak <= 3 * one_fp32  # a parameter's copy and lerp's temporaries, never the model's
        reference.step([p.detach().float().requires_grad_(True) for p in model.parameters()])
    assert ema.model.optimization_step == reference.optimization_step == 3
    assert ema.model.cur_decay_value == reference.cur_decay_value
    for a, b in zip(ema.model.shadow_params, reference.shadow_params):
        assert torch.allclose(a, b, atol=1e-6)


def test_processes_wait_at_a_barrier_longer_than_nccls_ten_minutes(tmp_path, fresh_accelerator_state):
    """While the main process works alone (DreamBooth class images, the latent cache on disk, exports) the
    others wait at a barrier; NCCL's default 10 minutes ended them (and the run) during e.g. 100 SDXL class
    images. The process group is made with runtime.PROCESS_GROUP_TIMEOUT."""
    from datetime import timedelta

    from sdplan.trainer import runtime

    cfg = TrainConfig()
    cfg.training.device = "cpu"
    accelerator = runtime.make_accelerator(cfg, tmp_path)
    assert accelerator.init_handler.to_kwargs() == {"timeout": runtime.PROCESS_GROUP_TIMEOUT}
    assert timedelta(hours=1) <= runtime.PROCESS_GROUP_TIMEOUT


def test_the_ema_export_copy_is_made_in_host_ram_one_tensor_at_a_time(monkeypatch):
    """runtime.host_copy (the EMA export's UNet copy) never deep-copies a tensor where it lives: a plain
    deepcopy of a model on the GPU would put a whole second model there at the end of a long run."""
    import torch
    from diffusers import UNet2DConditionModel
    from sdplan.trainer import runtime

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        layers_per_block=1,
        sample_size=8,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    unet.requires_grad_(False)
    unet.conv_in.requires_grad_(True)
    deep_copied = []
    for cls in (torch.Tensor, torch.nn.Parameter):
        original = cls.__deepcopy__

        def counting(self, memo, original=original):
            deep_copied.append(tuple(self.shape))
            return original(self, memo)

        monkeypatch.setattr(cls, "__deepcopy__", counting)
    twin = runtime.host_copy(unet)
    assert deep_copied == []  # every parameter and buffer came from its one-tensor host copy
    a, b = unet.state_dict(), twin.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(p.device.type == "cpu" for p in twin.parameters())
    assert {n for n, p in twin.named_parameters() if p.requires_grad} == {"conv_in.weight", "conv_in.bias"}
    twin.conv_in.weight.data.add_(1.0)  # its own storage
    assert not torch.equal(twin.conv_in.weight, unet.conv_in.weight)
    assert type(twin) is UNet2DConditionModel and twin.config == unet.config
