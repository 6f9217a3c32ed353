"""Trained outputs in the formats people load, each recording the run's config and plan in its metadata.

- LoRA: ``pytorch_lora_weights.safetensors`` (diffusers/peft; ``pipe.load_lora_weights(out_dir)``) and
  ``{name}.kohya.safetensors`` (kohya names, ``.lora_down``/``.lora_up``/``.alpha`` with the real alpha, ``ss_*``
  metadata) for AUTOMATIC1111, ComfyUI and kohya sd-scripts.
- DreamBooth / full fine-tune: a diffusers folder (``save_pretrained``) and one ``{name}.safetensors`` in the
  original (ldm/sgm) single-file checkpoint layout.
- Textual inversion: ``{name}.safetensors`` (A1111 and ComfyUI call an embedding by its file name;
  ``pipe.load_textual_inversion(path, token=...)``; SDXL: ``clip_l``/``clip_g``).
- ``name`` defaults to the run folder's name (``output_name``), so two runs do not write same-named files.
- Diffusers folders load on transformers 4.x as well as 5.x (``folder_for_transformers4``).

Reading single-file checkpoints (the other direction) is ``single_file.py``; the SD3.5 / FLUX.1 LoRA exports
are ``flow_export.py`` / ``flow_kohya.py``.

Why one module of ~1,100 lines: most of it is the name tables of the formats users load (diffusers <-> the
original ldm/sgm layout for UNet and VAE, HF CLIP <-> OpenCLIP, kohya's ``ss_*`` metadata and ModelSpec keys)
and the functions that write each format; they are checked together against the clients' source
(tests/test_export.py, tests/test_export_compat.py) and change together when a client changes.

The heavy lifting is diffusers/peft: ``get_peft_model_state_dict``, ``convert_state_dict_to_kohya``,
``save_lora_weights``, ``from_single_file``. Two things diffusers has no function for are ours and table-driven
below: diffusers -> original module paths for the UNet/VAE (the single file, and SDXL kohya names) and HF CLIP
-> OpenCLIP for SD 2.x / SDXL's second text encoder.

Kohya UNet names (why SD 1.x/2.x and SDXL differ): kohya sd-scripts names a LoRA after the module path of the
UNet it trains. Its SD 1.x/2.x UNet has the diffusers layout (``lora_unet_down_blocks_0_attentions_0_...``); its
SDXL UNet has the original sgm layout (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``; sd-scripts
``networks/lora.py`` even detects SDXL by ``input_blocks`` in the names). We write the same. Both UIs load both:
ComfyUI ``comfy/lora.py`` ``model_lora_keys_unet`` maps ``lora_unet_`` + the ``diffusion_model`` path and the
diffusers path (via ``unet_to_diffusers``); A1111 ``extensions-builtin/Lora/networks.py`` converts diffusers names
with ``convert_diffusers_name_to_compvis`` (hard-coded to the SD 1.x block arithmetic, e.g. its up-sampler rule)
and, failing that, replaces ``lora_unet`` by ``diffusion_model``, which is exact for sgm names. So sgm names for
SDXL are the ones that need no guessing in either UI. Text encoders: ``lora_te_`` for SD 1.x/2.x, ``lora_te1_``/
``lora_te2_`` for SDXL, HF CLIP module paths (``lora_te1_text_model_encoder_layers_0_self_attn_q_proj``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from sdplan import registry
from sdplan.errors import SdplanError, UsageError
from sdplan.registry import FAMILIES, FLOW_FAMILIES

from .checkpoint import unwrap
from .dataset_scan import count_of

DIFFUSERS_LORA_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_JSON = "sdplan.json"  # beside a diffusers folder's model_index.json

# kohya sd-scripts ss_base_model_version (library/model_util.py, library/sdxl_model_util.py)
BASE_MODEL_VERSION = {"sd15": "sd_v1", "sd21": "sd_v2", "sdxl": "sdxl_base_v1-0"}


class ExportError(SdplanError):
    """A model that cannot be written in the asked format."""


# -- metadata -------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value


def output_metadata(metadata: dict[str, Any] | None, family: str) -> dict[str, str]:
    """The string metadata every output carries: ``sdplan_config`` and ``sdplan_plan`` (JSON), the family,
    the sdplan version, and every other key of ``metadata`` (non-strings as JSON; names without a
    ``sdplan_``/``ss_``/``modelspec.`` prefix get ``sdplan_``).

    ``metadata`` keys with a meaning: ``config`` (a TrainConfig or its dict), ``plan`` (defaults to the
    config's ``plan``), ``comment`` (kohya ``ss_training_comment``), ``prediction_type`` (the scheduler's;
    SD 1.x / 2.x v-prediction is ``sd_v1_v`` / ``sd_v2_v`` for kohya), ``steps``, ``epoch`` (kohya ``ss_steps``/``ss_epoch``),
    ``mixed_precision`` (accelerate's, what the run trained in: kohya ``ss_mixed_precision``).
    """
    from sdplan import __version__

    md = dict(metadata or {})
    config = _plain(md.pop("config", None))
    plan = md.pop("plan", None)
    if plan is None and isinstance(config, dict):
        plan = config.get("plan")
    out = {
        "sdplan_version": __version__,
        "sdplan_family": family,
        "sdplan_config": json.dumps(config, sort_keys=True, default=str),
        "sdplan_plan": json.dumps(_plain(plan), sort_keys=True, default=str),
    }
    for key, value in md.items():
        name = key if key.startswith(("sdplan_", "ss_", "modelspec.")) else f"sdplan_{key}"
        out[name] = (
            value if isinstance(value, str) else json.dumps(_plain(value), sort_keys=True, default=str)
        )
    return out


# kohya sd-scripts train_util.get_optimizer names an optimizer by its class: f"{cls.__module__}.{cls.__name__}".
_KOHYA_OPTIMIZER = {
    "adamw": "torch.optim.adamw.AdamW",
    "adamw8bit": "bitsandbytes.optim.adamw.AdamW8bit",
}
_KOHYA_DIR = re.compile(r"^\d+_")  # kohya's `N_name` image folders


def _caption_tags(caption: str) -> list[str]:
    """kohya BaseDataset.set_tag_frequency: a caption's comma-separated pieces, stripped, lower-cased."""
    return [t.strip().lower() for t in caption.split(",") if t.strip()]


def dataset_info(
    items, root: str | Path, *, fallback_caption: str = "", bucket_rows: list[dict] | None = None
) -> dict[str, Any]:
    """What kohya records about a dataset, from the scanned images (``trainer.dataset_scan.Item``: ``path``,
    ``caption``, ``tags``, ``repeats``).

    Returns ``{"dataset_dirs": {dir: {"n_repeats", "img_count"}}, "tag_frequency": {dir: {tag: n}},
    "num_train_images": images x repeats, "bucket_info": ...}``. A dir is kohya's subset name: the ``N_name``
    folder of a kohya layout, else the dataset folder's name. Tags are counted once per image (not per repeat),
    as kohya does. ``bucket_rows`` (``CaptionedImages.bucket_table`` with buckets on) become kohya's
    ``bucket_info`` (``{"buckets": {i: {"resolution": [w, h], "count": samples}}}``).
    """
    root = Path(root)
    root_name = Path(os.path.abspath(root)).name  # "." is the folder it names
    dirs: dict[str, dict[str, int]] = {}
    tags: dict[str, dict[str, int]] = {}
    total = 0
    for item in items:
        path = Path(item.path)
        try:
            parts = path.relative_to(root).parts
        except ValueError:
            parts = () if path.is_absolute() else path.parts
        name = parts[0] if len(parts) > 1 and _KOHYA_DIR.match(parts[0]) else root_name
        repeats = max(1, int(getattr(item, "repeats", 1) or 1))
        entry = dirs.setdefault(name, {"n_repeats": repeats, "img_count": 0})
        entry["img_count"] += 1
        total += repeats
        item_tags = getattr(item, "tags", None)
        caption = ", ".join(item_tags) if item_tags else (getattr(item, "caption", None) or fallback_caption)
        freq = tags.setdefault(name, {})
        for tag in _caption_tags(caption):
            freq[tag] = freq.get(tag, 0) + 1
    info: dict[str, Any] = {"dataset_dirs": dirs, "tag_frequency": tags, "num_train_images": total}
    if bucket_rows:
        info["bucket_info"] = {
            "buckets": {
                str(n): {"resolution": [r["width"], r["height"]], "count": r["samples"]}
                for n, r in enumerate(bucket_rows)
            }
        }
    return info


def run_info(
    *,
    step_plan=None,
    dataset: dict[str, Any] | None = None,
    reg_dataset: dict[str, Any] | None = None,
    started_at: float | None = None,
    session_id: int | None = None,
) -> dict[str, Any]:
    """The facts of a run that only the training loop knows, for the kohya ``ss_*`` keys: pass it as the save
    functions' ``run=``. ``step_plan``: the loop's ``sdplan.steps.Steps`` (or a dict with max_steps as the total); ``dataset``/``reg_dataset``:
    ``dataset_info`` of the training / class images; ``started_at``: ``time.time()`` when training began;
    ``session_id``: one random integer per run (kohya: ``random.randint(0, 2**32)``)."""
    plan = _plain(step_plan)
    if plan is not None and not isinstance(plan, dict):
        plan = {
            "num_processes": plan.num_processes,
            "batches_per_epoch": plan.batches_per_epoch,
            "max_steps": plan.total_steps,
            "epochs": plan.epochs,
        }
    out: dict[str, Any] = {"step_plan": plan, "dataset": dataset, "reg_dataset": reg_dataset}
    out.update({"started_at": started_at, "session_id": session_id})
    return {k: v for k, v in out.items() if v is not None}


def output_name(name: str | None, out_dir: str | Path) -> str:
    """The stem outputs are named after: ``name``, else the run folder's name (so two runs do not share one
    LoRA / embedding name). Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``: A1111 and
    ComfyUI use an embedding's file name as its prompt word."""
    raw = (name or "").strip() or Path(os.path.abspath(out_dir)).name
    clean = re.sub(r"[^\w.\-]", "_", raw, flags=re.ASCII).strip("._")
    return clean or "sdplan"


def _epoch_int(epoch: Any) -> int:
    """kohya's ss_epoch is a whole number: the epochs begun (num_train_epochs = ceil(steps / steps per epoch))."""
    value = float(epoch)
    return max(0, math.ceil(round(value, 6)))


def _model_hashes(path: str) -> dict[str, str]:
    """kohya train_util.model_hash / calculate_sha256 of the base model file (A1111's old and new hash);
    nothing for a folder, a hub id or an unreadable file."""
    file = Path(path)
    if not file.is_file():
        return {}
    try:
        stat = file.stat()
        return dict(_file_hashes(str(file), stat.st_size, stat.st_mtime_ns))
    except OSError:
        return {}


@functools.lru_cache(maxsize=8)
def _file_hashes(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    import hashlib

    with open(path, "rb") as f:
        f.seek(0x100000)
        legacy = hashlib.sha256(f.read(0x10000)).hexdigest()[:8]
        f.seek(0)
        full = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            full.update(chunk)
    return (("ss_sd_model_hash", legacy), ("ss_new_sd_model_hash", full.hexdigest()))


def _kohya_metadata(
    metadata: dict[str, Any] | None,
    family: str,
    rank: int,
    alpha: float,
    name: str,
    *,
    run: dict[str, Any] | None = None,
    module: str = "networks.lora",
    version: str | None = None,
) -> dict[str, str]:
    """kohya sd-scripts ``ss_*`` keys as train_network.py writes them (every value through ``str()``: numbers
    as ``"4"``/``"0.0001"``, booleans as ``"True"``, tuples as ``"(512, 512)"``, dicts as JSON). Only keys this
    run can fill truthfully: from the config, ``metadata`` (steps, epoch, prediction type) and ``run``
    (``run_info``: step plan, dataset, start time). kohya options sdplan has no equivalent of (caption dropout,
    min-SNR, huber loss, ...) are left out rather than written as defaults. ``module`` / ``version``: the
    network module and base model version (SD3.5 / FLUX.1: ``flow_export``'s; default the UNet families')."""
    import time

    md = dict(metadata or {})
    run = run or {}
    config = _plain(md.get("config")) or {}

    def get(section: str, key: str, default: Any = None) -> Any:
        return (config.get(section) or {}).get(key, default)

    version = version or BASE_MODEL_VERSION[family]
    # kohya library/model_util.py get_model_version_str_for_sd1_sd2: "_v" for any v-parameterised SD 1.x / 2.x
    if family in ("sd15", "sd21") and md.get("prediction_type") == "v_prediction":
        version += "_v"
    resolution = md.get("resolution") or get("data", "resolution")
    method = config.get("method", "lora")
    ss: dict[str, Any] = {
        "ss_network_module": module,
        "ss_network_dim": rank,
        "ss_network_alpha": float(alpha),
        "ss_base_model_version": version,
        "ss_v2": family == "sd21",
        "ss_resolution": (resolution, resolution) if isinstance(resolution, int) else resolution,
        "ss_training_comment": md.get("comment") or f"trained with sdplan ({method})",
        "ss_output_name": name,
        "ss_training_finished_at": time.time(),  # kohya: set when the file is saved
    }
    if run.get("started_at") is not None:
        ss["ss_training_started_at"] = run["started_at"]
    if run.get("session_id") is not None:
        ss["ss_session_id"] = int(run["session_id"])
    if config:
        training, memory, data = (
            config.get("training") or {},
            config.get("memory") or {},
            config.get("data") or {},
        )
        # what the run trained in (a GPU plan's config on the CPU trains in fp32), else the config's
        precision = {"no": "fp32"}.get(md.get("mixed_precision"), md.get("mixed_precision"))
        precision = precision or training.get("precision")
        lr = training.get("learning_rate")
        ss.update(
            {
                "ss_learning_rate": lr,
                "ss_unet_lr": lr,
                "ss_lr_scheduler": training.get("lr_scheduler"),
                "ss_lr_warmup_steps": training.get("lr_warmup_steps"),
                # a one-process count in the config; kohya's is the run's optimizer steps (run_info's plan)
                "ss_max_train_steps": training.get("max_steps")
                if (get("distributed", "num_processes") or 1) == 1
                else None,
                "ss_gradient_accumulation_steps": training.get("grad_accum"),
                "ss_mixed_precision": {"fp32": "no"}.get(precision, precision),
                "ss_full_fp16": bool(training.get("full_half_weights")) and precision == "fp16",
                "ss_seed": training.get("seed"),
                "ss_max_grad_norm": training.get("max_grad_norm"),
                "ss_noise_offset": training.get("noise_offset"),
                "ss_min_snr_gamma": training.get("min_snr_gamma"),
                "ss_caption_dropout_rate": data.get("caption_dropout"),
                "ss_network_dropout": get("lora", "dropout"),
                "ss_optimizer": _KOHYA_OPTIMIZER.get(memory.get("optimizer"), memory.get("optimizer")),
                "ss_gradient_checkpointing": memory.get("gradient_checkpointing"),
                "ss_cache_latents": memory.get("cache_latents"),
                "ss_batch_size_per_device": training.get("batch_size"),
                "ss_loss_type": "l2",  # the recipes train on objective.mse (kohya loss_type l2)
                "ss_color_aug": False,
                "ss_flip_aug": bool(data.get("random_flip")),
                "ss_random_crop": data.get("center_crop") is False,
                "ss_enable_bucket": bool(data.get("buckets")),
            }
        )
        if training.get("train_text_encoder"):
            ss["ss_text_encoder_lr"] = training.get("text_encoder_learning_rate") or lr
        if not training.get("max_steps"):
            ss["ss_num_epochs"] = training.get("epochs")
        if data.get("buckets"):
            ss["ss_min_bucket_reso"] = data.get("bucket_min_size")
            ss["ss_max_bucket_reso"] = data.get("bucket_max_size")
        meta_cfg = data.get("metadata") or {}
        if meta_cfg:
            ss["ss_shuffle_caption"] = bool(meta_cfg.get("shuffle_tags"))
            ss["ss_keep_tokens"] = meta_cfg.get("keep_tags")
        if method == "dreambooth" and get("dreambooth", "with_prior_preservation"):
            ss["ss_prior_loss_weight"] = get("dreambooth", "prior_loss_weight")
        model_path = str(get("model", "path", "") or "")
        if model_path:
            # kohya: the file/folder name of a local model, else the name as given (a hub id)
            hub_id = not Path(model_path).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", model_path)
            ss["ss_sd_model_name"] = model_path if hub_id else Path(model_path).name
            ss.update(_model_hashes(model_path))
        plan = run.get("step_plan") or {}
        processes = plan.get("num_processes") or get("distributed", "num_processes") or 1
        if training.get("batch_size") and training.get("grad_accum"):
            ss["ss_total_batch_size"] = training["batch_size"] * processes * training["grad_accum"]
    plan = run.get("step_plan") or {}
    if plan:
        ss["ss_num_batches_per_epoch"] = plan.get("batches_per_epoch")
        ss["ss_num_epochs"] = plan.get("epochs")
        ss["ss_max_train_steps"] = plan.get("max_steps")
    dataset = run.get("dataset")
    if dataset:
        ss["ss_num_train_images"] = dataset.get("num_train_images")
        ss["ss_num_validation_images"] = 0  # sdplan holds no images out for validation
        ss["ss_dataset_dirs"] = json.dumps(dataset.get("dataset_dirs") or {})
        ss["ss_tag_frequency"] = json.dumps(dataset.get("tag_frequency") or {})
        if dataset.get("bucket_info") is not None:
            ss["ss_bucket_info"] = json.dumps(dataset["bucket_info"])
        reg = run.get("reg_dataset") or {}
        ss["ss_num_reg_images"] = reg.get("num_train_images", 0)
        ss["ss_reg_dataset_dirs"] = json.dumps(reg.get("dataset_dirs") or {})
    if md.get("steps") is not None:
        ss["ss_steps"] = int(md["steps"])
    if md.get("epoch") is not None:
        ss["ss_epoch"] = _epoch_int(md["epoch"])
    return {k: str(v) for k, v in ss.items() if v is not None and v != ""}


_HASH_PLACEHOLDER = "0x" + "0" * 64  # same length as the real value: patched into the header after writing


def _modelspec(
    family: str,
    metadata: dict[str, Any] | None,
    name: str,
    *,
    lora: bool,
    textual_inversion: bool = False,
    transformer_config: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Stability's model spec keys as kohya sd-scripts library/sai_model_spec.py writes them (spec 1.0.1:
    architecture with ``/lora`` or ``/textual-inversion``, implementation, title, resolution ``WxH``, ISO date,
    prediction type), plus ``hash_sha256`` (the spec's hash of all tensor bytes, ``0x``-prefixed; kohya leaves
    it out), filled in by ``_save_safetensors``. ``transformer_config``: SD3.5 / FLUX.1's, which tells SD3
    Medium from SD3.5 Medium (``flow_export.modelspec_architecture``)."""
    import datetime

    from sdplan import __version__

    md = metadata or {}
    v_pred = md.get("prediction_type") == "v_prediction"
    if family in FLOW_FAMILIES:
        from .flow_export import modelspec_architecture

        arch = modelspec_architecture(family, transformer_config)
    elif family == "sd21":
        arch = "stable-diffusion-v2-768-v" if v_pred else "stable-diffusion-v2-512"
    else:
        arch = {"sd15": "stable-diffusion-v1", "sdxl": "stable-diffusion-xl-v1-base"}[family]
    if lora:
        arch += "/lora"
    elif textual_inversion:
        arch += "/textual-inversion"
    # kohya determine_implementation: the original (sgm/ldm) key layout for SDXL LoRA, embeddings and single
    # files; diffusers module names for SD 1.x/2.x LoRA.
    sgm = (lora and family == "sdxl") or textual_inversion or not lora
    config = _plain(md.get("config")) or {}
    resolution = md.get("resolution") or (config.get("data") or {}).get("resolution")
    if isinstance(resolution, int):
        resolution = (resolution, resolution)
    if not resolution:
        resolution = (
            (1024, 1024) if family in ("sdxl", *FLOW_FAMILIES) else (768, 768) if v_pred else (512, 512)
        )
    impl = "https://github.com/Stability-AI/generative-models" if sgm else "diffusers"
    if family in FLOW_FAMILIES and registry.family(family).arch == "flux":
        impl = "https://github.com/black-forest-labs/flux"  # kohya sai_model_spec IMPL_FLUX
    return {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": arch,
        "modelspec.implementation": impl,
        "modelspec.implementation_version": f"sdplan/{__version__}",
        "modelspec.title": name,
        "modelspec.resolution": f"{resolution[0]}x{resolution[1]}",
        "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
        **({} if family in FLOW_FAMILIES else {"modelspec.prediction_type": "v" if v_pred else "epsilon"}),
        "modelspec.hash_sha256": _HASH_PLACEHOLDER,
    }


# -- small file helpers ---------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def _umask_permissions(*paths: Path) -> None:
    """safetensors (0.8) creates its files 0600; outputs are meant to be read by a UI that may run as another
    user, so give files the mode a plain ``open()`` would (0666 minus the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            os.chmod(file, 0o666 & ~mask)


def _tensor_data_sha256(path: Path) -> str:
    """sha256 of a safetensors file's tensor bytes (everything after the header): kohya's
    ``addnet_hash_safetensors`` and, ``0x``-prefixed, the model spec's ``hash_sha256``."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _patch_header(path: Path, old: str, new: str) -> None:
    """Replace one metadata value in a written safetensors header by one of the same length, in place."""
    assert len(old) == len(new)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size)
        at = header.find(old.encode())
        if at < 0 or header.find(old.encode(), at + 1) >= 0:
            raise ExportError(f"{path}: cannot place the hash in the header")
        f.seek(8 + at)
        f.write(new.encode())


def _save_safetensors(tensors: dict, path: Path, metadata: dict[str, str]) -> Path:
    """safetensors written atomically (temp file then rename): a kill mid-write leaves the old file. A
    ``modelspec.hash_sha256`` placeholder gets the hash of the tensor bytes written."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        if metadata.get("modelspec.hash_sha256") == _HASH_PLACEHOLDER:
            _patch_header(tmp, _HASH_PLACEHOLDER, "0x" + _tensor_data_sha256(tmp))
        _umask_permissions(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _kohya_hashes(tensors: dict, metadata: dict[str, str]) -> dict[str, str]:
    """kohya networks/lora.py save_weights: ``sshs_model_hash`` / ``sshs_legacy_hash`` (sd-webui-additional-
    networks' hashes) of the file serialised with only the ``ss_*`` metadata (train_util.
    precalculate_safetensors_hashes, addnet_hash_safetensors, addnet_hash_legacy)."""
    import hashlib

    from safetensors.torch import save

    blob = save(
        {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
        {k: v for k, v in metadata.items() if k.startswith("ss_")},
    )
    header = int.from_bytes(blob[:8], "little")
    return {
        "sshs_model_hash": hashlib.sha256(blob[8 + header :]).hexdigest(),
        "sshs_legacy_hash": hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8],
    }


def _replace_dir(tmp: Path, final: Path) -> None:
    """Put folder ``tmp`` at ``final``, replacing what was there with a rename, not a copy."""
    old = None
    if final.exists():
        old = _tmp_name(final)
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_diffusers_lora(
    pipeline_cls, out_dir: Path, metadata: dict[str, str], **layers: Any
) -> tuple[Path, dict[str, str]]:
    """``out_dir/pytorch_lora_weights.safetensors`` written by diffusers' own ``save_lora_weights`` (through a
    temporary folder, so a failure leaves no half file), keeping diffusers' metadata (format,
    lora_adapter_metadata) merged with ``metadata``. Returns (the file, the metadata written)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tmp = _tmp_name(out_dir / "lora")
    try:
        pipeline_cls.save_lora_weights(save_directory=str(tmp), safe_serialization=True, **layers)
        with safe_open(str(tmp / DIFFUSERS_LORA_NAME), framework="pt") as f:
            md = {**(f.metadata() or {}), **metadata}
        path = _save_safetensors(load_file(str(tmp / DIFFUSERS_LORA_NAME)), out_dir / DIFFUSERS_LORA_NAME, md)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, md


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UsageError(f"unknown model family {family!r}", fix=f"use one of {', '.join(FAMILIES)}")


# -- LoRA -----------------------------------------------------------------------------------------------


ALPHA_FOLDED = (
    "alpha/rank is folded into lora_B; load with lora_alpha = rank"  # the diffusers file's metadata
)


def fold_alpha(state_dict: dict, config: Any, rank: int, alpha: float) -> tuple[dict, dict]:
    """A peft LoRA state dict with alpha/rank folded into ``lora_B``, and its LoraConfig as adapter metadata
    saying ``lora_alpha = r``: the diffusers-format file every diffusers version applies alike (before 0.34 it
    reads no lora_adapter_metadata and takes lora_alpha = r, peft_utils.get_peft_kwargs). ComfyUI reads the kohya
    file: its key map (comfy/lora.py model_lora_keys_unet) takes none of peft's SD 1.x / SDXL UNet names in this
    one (only its text-encoder names, and the FLUX.1 / SD3.5 files' diffusers names)."""
    scale = float(alpha) / rank
    folded = {k: (v * scale if ".lora_B." in k else v) for k, v in state_dict.items()}
    return folded, {**adapter_metadata(config), "lora_alpha": config.r}


def adapter_metadata(config: Any) -> dict:
    """A LoraConfig as lora_adapter_metadata: its rank, alpha and targets, and the fields that differ from
    LoraConfig's defaults. Not every field: diffusers builds ``LoraConfig(**metadata)``, and an older peft refuses
    a field it lacks (peft 0.15 under diffusers 0.34: "unexpected keyword argument 'alora_invocation_tokens'",
    a field of peft 0.21 whose default says nothing); a field left out takes the reader's default. rank_pattern
    and alpha_pattern stay: diffusers 0.34-0.39 reads them by key (peft_utils._maybe_raise_error_for_ambiguous_keys
    ``config["rank_pattern"]``; a KeyError there, before 0.40's #14463)."""
    full, default = config.to_dict(), type(config)().to_dict()
    keep = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern")
    return {k: v for k, v in full.items() if k in keep or k not in default or default[k] != v}


def _peft_lora(model, adapter: str = "default") -> tuple[dict, Any] | None:
    """(peft state dict, LoraConfig) of a model carrying a peft LoRA adapter; None when it carries none."""
    from peft import get_peft_model_state_dict

    if model is None:
        return None
    model = unwrap(model)
    configs = getattr(model, "peft_config", None) or {}
    if adapter not in configs:
        return None
    # no embedding layer is ever a LoRA target here (textual inversion saves its own embeddings): with peft's
    # "auto" the export looked for the base model's config.json, on the Hub for a hub id (a network call at
    # the end of the run), and warned "Could not find a config file" for a diffusers folder
    state = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
    return state, configs[adapter]


def _diffusers_text_encoder_names(state_dict: dict) -> dict:
    """peft's ``...q_proj.lora_A.weight`` / ``lora_B`` -> diffusers' ``...q_proj.lora_linear_layer.down.weight``
    / ``up`` (diffusers' StateDictType.DIFFUSERS; its DIFFUSERS_TO_PEFT maps every module back), for any module:
    ComfyUI reads these too (comfy/lora.py ``transformers_lora``)."""
    renames = ((".lora_A.", ".lora_linear_layer.down."), (".lora_B.", ".lora_linear_layer.up."))
    out = {}
    for key, value in state_dict.items():
        for peft_name, diffusers_name in renames:
            key = key.replace(peft_name, diffusers_name)
        out[key] = value
    return out


def _text_model_keys(state_dict: dict) -> dict:
    """transformers >= 5.6 flattened CLIPTextModel (no ``text_model.``): put the prefix back so the files carry
    the canonical HF CLIP paths every loader knows (diffusers strips it again for a flattened encoder)."""
    return {
        (k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}"): v
        for k, v in state_dict.items()
    }


def save_lora(
    out_dir: str | Path,
    *,
    unet,
    text_encoders: list,
    family: str,
    rank: int,
    alpha: float,
    metadata: dict[str, Any] | None,
    name: str | None = None,
    kohya: bool = True,
    run: dict[str, Any] | None = None,
) -> list[Path]:
    """Write the LoRA that ``unet`` (and any of ``text_encoders``) carry as peft adapters.

    ``text_encoders``: ``[text_encoder]`` (SD 1.x/2.x) or ``[text_encoder, text_encoder_2]`` (SDXL); entries
    that are None or carry no adapter are skipped. ``rank``/``alpha`` must be those of the adapters (checked).
    ``name``: the kohya file's stem and title (None/empty: the run folder's name, see ``output_name``);
    ``run``: ``run_info`` (dataset, step plan, start time) for kohya's ``ss_*`` keys.
    Returns ``[out_dir/pytorch_lora_weights.safetensors, out_dir/{name}.kohya.safetensors]`` (the second only
    when ``kohya``).
    """
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya

    _check_family(family)
    out_dir = Path(out_dir)
    name = output_name(name, out_dir)
    te_names = ["text_encoder", "text_encoder_2"] if family == "sdxl" else ["text_encoder"]
    if len(text_encoders) > len(te_names):
        raise ExportError(f"{family} has {count_of(len(te_names), 'text encoder')}, got {len(text_encoders)}")

    parts: dict[str, tuple[dict, Any]] = {}
    found = _peft_lora(unet)
    if found is not None:
        parts["unet"] = found
    for te_name, te in zip(te_names, text_encoders):
        found = _peft_lora(te)
        if found is not None:
            parts[te_name] = (_text_model_keys(found[0]), found[1])
    if not parts:
        raise ExportError(
            "no LoRA adapter found on the UNet or the text encoders", fix="add one with add_adapter"
        )
    for part, (_, config) in parts.items():
        if config.r != rank or float(config.lora_alpha) != float(alpha):
            raise ExportError(
                f"the {part} adapter has rank {config.r}, alpha {config.lora_alpha}; asked to save rank {rank}, "
                f"alpha {alpha}"
            )
        if config.rank_pattern or config.alpha_pattern or config.use_dora:
            raise ExportError(f"the {part} adapter uses rank/alpha patterns or DoRA; kohya LoRA has neither")

    # 1. diffusers format, written by diffusers (with the LoraConfig as lora_adapter_metadata), alpha folded.
    # The UNet in peft's names, as flow_export writes SD3.5/FLUX (not convert_state_dict_to_diffusers, which
    # renames only to_q/k/v/out.0 and q/k/v/out_proj to diffusers' older names: with any other target the file
    # mixed both, and diffusers' UNet loader, which picks the format from the first key (loaders/peft.py
    # load_lora_adapter, 0.34 to now: `if "lora_A" not in first_key: convert_unet_state_dict_to_peft`), dropped
    # the old-named attention LoRA when a peft name came first). The text encoders in diffusers' names
    # (``lora_linear_layer.down/up``) for every module: their loader (lora_base._load_lora_into_text_encoder)
    # converts to those and back to peft's, and convert_state_dict_to_peft infers the format from them (with
    # peft names and only fc1/fc2 targeted it raised "Could not automatically infer state dict type").
    pipeline_cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
    kwargs = {}
    for part, (state_dict, config) in parts.items():
        folded, adapter_metadata = fold_alpha(state_dict, config, rank, alpha)
        kwargs[f"{part}_lora_layers"] = folded if part == "unet" else _diffusers_text_encoder_names(folded)
        kwargs[f"{part}_lora_adapter_metadata"] = adapter_metadata
    md = output_metadata(metadata, family)
    md.update({"sdplan_lora_rank": str(rank), "sdplan_lora_alpha": str(float(alpha))})
    md["sdplan_lora_alpha_folded"] = ALPHA_FOLDED
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [save_diffusers_lora(pipeline_cls, out_dir, md, **kwargs)[0]]

    if not kohya:
        return written

    # 2. kohya format: diffusers' PEFT -> kohya conversion (names, lora_down/lora_up), then what it leaves out:
    # SDXL UNet in sgm module paths, `lora_te_` for a single text encoder, and the real alpha (it writes rank).
    peft_sd: dict[str, Any] = {}
    for part, (state_dict, _) in parts.items():
        for key, value in state_dict.items():
            if part == "unet" and family == "sdxl":
                key = unet_key_to_original(key, unwrap(unet).config)
            peft_sd[f"{part}.{key}"] = value
    kohya_sd = convert_state_dict_to_kohya(peft_sd)
    out: dict[str, Any] = {}
    for key, value in kohya_sd.items():
        if family != "sdxl" and key.startswith("lora_te1_"):
            key = "lora_te_" + key[len("lora_te1_") :]
        if key.endswith(".alpha"):
            value = torch.tensor(float(alpha))
        out[key] = value
    kohya_md = _kohya_metadata(metadata, family, rank, alpha, name, run=run)
    kohya_md.update(_kohya_hashes(out, kohya_md))
    kohya_md.update({**_modelspec(family, metadata, name, lora=True), **output_metadata(metadata, family)})
    written.append(_save_safetensors(out, out_dir / f"{name}.kohya.safetensors", kohya_md))
    return written


# -- diffusers -> original (ldm/sgm) layout ----------------------------------------------------------------

# Inner renames of a UNet ResnetBlock2D: diffusers -> ldm ResBlock.
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
# UNet modules outside the down/mid/up blocks.
_UNET_TOP = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "class_embedding.linear_1": "label_emb.0.0",
    "class_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_VAE_TOP = {
    "encoder.conv_norm_out": "encoder.norm_out",
    "decoder.conv_norm_out": "decoder.norm_out",
}


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def _unet_table(config) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers module prefix -> (ldm module prefix, inner renames) for one UNet2DConditionModel config.

    ldm numbering: input block 0 is conv_in; each down block i contributes ``layers_per_block`` (ResBlock
    [+ SpatialTransformer]) entries and, except the last, a Downsample; each up block contributes
    ``layers_per_block + 1`` entries, the Upsample riding on its last one (slot 2 after an attention, else 1).
    """
    lpb = _get(config, "layers_per_block")
    if not isinstance(lpb, int):
        raise ExportError(f"layers_per_block={lpb!r}: only one int for all blocks has an original layout")
    mid = _get(config, "mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid != "UNetMidBlock2DCrossAttn":
        raise ExportError(f"mid block {mid}: no original single-file layout")
    down = list(_get(config, "down_block_types"))
    up = list(_get(config, "up_block_types"))
    table: dict[str, tuple[str, dict[str, str]]] = {k: (v, {}) for k, v in _UNET_TOP.items()}
    for i in range(len(down)):
        for j in range(lpb):
            n = 1 + i * (lpb + 1) + j
            table[f"down_blocks.{i}.resnets.{j}"] = (f"input_blocks.{n}.0", _UNET_RESNET)
            table[f"down_blocks.{i}.attentions.{j}"] = (f"input_blocks.{n}.1", {})
        if i < len(down) - 1:
            table[f"down_blocks.{i}.downsamplers.0.conv"] = (f"input_blocks.{(i + 1) * (lpb + 1)}.0.op", {})
    table["mid_block.resnets.0"] = ("middle_block.0", _UNET_RESNET)
    table["mid_block.attentions.0"] = ("middle_block.1", {})
    table["mid_block.resnets.1"] = ("middle_block.2", _UNET_RESNET)
    for i, block_type in enumerate(up):
        for j in range(lpb + 1):
            n = i * (lpb + 1) + j
            table[f"up_blocks.{i}.resnets.{j}"] = (f"output_blocks.{n}.0", _UNET_RESNET)
            table[f"up_blocks.{i}.attentions.{j}"] = (f"output_blocks.{n}.1", {})
        if i < len(up) - 1:
            slot = 2 if "CrossAttn" in block_type else 1
            table[f"up_blocks.{i}.upsamplers.0.conv"] = (
                f"output_blocks.{i * (lpb + 1) + lpb}.{slot}.conv",
                {},
            )
    return table


def _vae_table(config) -> dict[str, tuple[str, dict[str, str]]]:
    """diffusers AutoencoderKL module prefix -> (ldm prefix, inner renames). Decoder up blocks run in
    reverse order in ldm (``up.{n-1-i}``)."""
    n_down = len(_get(config, "down_block_types"))
    n_up = len(_get(config, "up_block_types"))
    lpb = _get(config, "layers_per_block")
    table: dict[str, tuple[str, dict[str, str]]] = {k: (v, {}) for k, v in _VAE_TOP.items()}
    for side in ("encoder", "decoder"):
        table[f"{side}.mid_block.resnets.0"] = (f"{side}.mid.block_1", _VAE_RESNET)
        table[f"{side}.mid_block.resnets.1"] = (f"{side}.mid.block_2", _VAE_RESNET)
        table[f"{side}.mid_block.attentions.0"] = (f"{side}.mid.attn_1", _VAE_ATTENTION)
    for i in range(n_down):
        for j in range(lpb):
            table[f"encoder.down_blocks.{i}.resnets.{j}"] = (f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        table[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = (f"encoder.down.{i}.downsample.conv", {})
    for i in range(n_up):
        for j in range(lpb + 1):
            table[f"decoder.up_blocks.{i}.resnets.{j}"] = (
                f"decoder.up.{n_up - 1 - i}.block.{j}",
                _VAE_RESNET,
            )
        table[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = (f"decoder.up.{n_up - 1 - i}.upsample.conv", {})
    return table


def _rename(key: str, table: dict[str, tuple[str, dict[str, str]]]) -> str | None:
    """Map one dotted key through a prefix table (longest module prefix wins, then the inner renames of that
    module); None when no prefix matches."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in table:
            target, inner = table[prefix]
            rest = ".".join(parts[cut:])
            for old, new in inner.items():
                if rest == old or rest.startswith(old + "."):
                    rest = new + rest[len(old) :]
                    break
            return f"{target}.{rest}"
    return None


def unet_key_to_original(key: str, config) -> str:
    """A diffusers UNet parameter / module key in the original ldm/sgm layout
    (``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight`` ->
    ``input_blocks.4.1.transformer_blocks.0.attn1.to_q.lora_A.weight`` for SDXL)."""
    new = _rename(key, _unet_table(config))
    if new is None:
        raise ExportError(f"UNet key {key!r} has no place in the original layout")
    return new


def unet_to_original(state_dict: dict, config) -> dict:
    """diffusers UNet2DConditionModel state dict -> ldm ``diffusion_model`` keys (without the prefix)."""
    table = _unet_table(config)
    out, unknown = {}, []
    for key, value in state_dict.items():
        new = _rename(key, table)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise ExportError(f"UNet keys with no place in the original layout: {', '.join(unknown[:5])}")
    return out


def vae_to_original(state_dict: dict, config) -> dict:
    """diffusers AutoencoderKL state dict -> ldm ``first_stage_model`` keys (without the prefix); the mid
    attention's linear q/k/v/proj_out become the 1x1 convolutions of the original."""
    table = _vae_table(config)
    same = {"encoder.conv_in", "encoder.conv_out", "decoder.conv_in", "decoder.conv_out"}
    same |= {"quant_conv", "post_quant_conv"}
    out, unknown = {}, []
    for key, value in state_dict.items():
        module = key.rsplit(".", 1)[0]
        if module in same:
            out[key] = value
            continue
        new = _rename(key, table)
        if new is None:
            unknown.append(key)
            continue
        if ".mid.attn_1." in new and new.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]
        out[new] = value
    if unknown:
        raise ExportError(f"VAE keys with no place in the original layout: {', '.join(unknown[:5])}")
    return out


# HF CLIP text transformer -> OpenCLIP (SD 2.x cond_stage_model.model, SDXL conditioner.embedders.1.model).
_OPENCLIP_TOP = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_OPENCLIP_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_LAYER = re.compile(r"text_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def clip_to_openclip(state_dict: dict) -> dict:
    """An HF CLIPTextModel(WithProjection) state dict in OpenCLIP names: q/k/v fused into ``attn.in_proj_*``,
    ``text_projection`` as the transposed matrix OpenCLIP multiplies by."""
    import torch

    sd = _text_model_keys({k: v for k, v in state_dict.items() if not k.endswith("position_ids")})
    out: dict[str, Any] = {}
    qkv: dict[tuple[int, str], dict[str, Any]] = {}
    unknown = []
    for key, value in sd.items():
        if key in _OPENCLIP_TOP:
            out[_OPENCLIP_TOP[key]] = value
        elif key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()
        elif m := _LAYER.match(key):
            layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((layer, kind), {})[module[-6]] = value
            elif module in _OPENCLIP_LAYER:
                out[f"transformer.resblocks.{layer}.{_OPENCLIP_LAYER[module]}.{kind}"] = value
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    for (layer, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise ExportError(f"text encoder layer {layer} lacks one of q/k/v_proj.{kind}")
        out[f"transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat(
            [parts["q"], parts["k"], parts["v"]]
        )
    if unknown:
        raise ExportError(f"text encoder keys with no OpenCLIP name: {', '.join(unknown[:5])}")
    return out


def pipeline_to_original(pipeline, family: str) -> dict:
    """The whole pipeline as one original-layout state dict (what A1111/ComfyUI/``from_single_file`` read):
    ``model.diffusion_model.*``, ``first_stage_model.*`` and ``cond_stage_model.transformer.*`` (SD 1.x),
    ``cond_stage_model.model.*`` (SD 2.x, OpenCLIP) or ``conditioner.embedders.{0,1}.*`` (SDXL)."""
    _check_family(family)
    for part in ("unet", "text_encoder", "text_encoder_2"):
        model = getattr(pipeline, part, None)
        if model is not None and getattr(unwrap(model), "peft_config", None):
            raise ExportError(
                f"the pipeline's {part} carries a LoRA adapter", fix="fuse it or save it with save_lora"
            )
    unet, vae = unwrap(pipeline.unet), unwrap(pipeline.vae)
    out = {
        f"model.diffusion_model.{k}": v for k, v in unet_to_original(unet.state_dict(), unet.config).items()
    }
    out.update(
        {f"first_stage_model.{k}": v for k, v in vae_to_original(vae.state_dict(), vae.config).items()}
    )
    te = unwrap(pipeline.text_encoder).state_dict()
    te = {k: v for k, v in te.items() if not k.endswith("position_ids")}
    if family == "sd15":
        out.update({f"cond_stage_model.transformer.{k}": v for k, v in _text_model_keys(te).items()})
    elif family == "sd21":
        out.update({f"cond_stage_model.model.{k}": v for k, v in clip_to_openclip(te).items()})
    else:
        out.update({f"conditioner.embedders.0.transformer.{k}": v for k, v in _text_model_keys(te).items()})
        te2 = unwrap(pipeline.text_encoder_2).state_dict()
        out.update({f"conditioner.embedders.1.model.{k}": v for k, v in clip_to_openclip(te2).items()})
    return out | _prediction_markers(pipeline.scheduler.config)


def _prediction_markers(scheduler_config) -> dict:
    """ComfyUI's markers of a v-prediction checkpoint: an empty ``v_pred`` tensor and, with zero terminal SNR,
    ``ztsnr`` (what its own checkpoint saver writes, comfy/model_base.py; its SDXL loader reads no model spec:
    comfy/supported_models.py SDXL.model_type). Nothing for epsilon."""
    import torch

    if scheduler_config.get("prediction_type") != "v_prediction":
        return {}
    markers = {"v_pred": torch.tensor([])}
    if scheduler_config.get("rescale_betas_zero_snr"):
        markers["ztsnr"] = torch.tensor([])
    return markers


# transformers components of a diffusers folder that transformers 4.x reads differently from 5.x.
_CLIP_TEXT_MODELS = ("CLIPTextModel", "CLIPTextModelWithProjection")
_CLIP_TOKENIZERS = ("CLIPTokenizer", "CLIPTokenizerFast")
_T5_TOKENIZERS = ("T5Tokenizer", "T5TokenizerFast")


def _text_encoder_for_transformers4(folder: Path) -> None:
    """transformers >= 5.6 saves CLIPTextModel flattened (``embeddings.*``, ``encoder.*``); 4.x's CLIPTextModel
    nests them under ``text_model`` and its loader only fixes a ``base_model_prefix`` (``clip``) mismatch, so
    it would start from random weights with a warning. Write the ``text_model.`` names, which 5.x also loads
    (its CLIP key mapping). ``torch_dtype`` mirrors ``dtype`` for 4.x before 4.56."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    renamed: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys, md = list(f.keys()), f.metadata()
        new = _text_model_keys(dict.fromkeys(keys))
        if list(new) == keys:
            continue
        renamed.update(zip(keys, new))
        tensors = _text_model_keys(load_file(str(file)))
        save_file(tensors, str(file), metadata=md or {"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if renamed and index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {renamed.get(k, k): v for k, v in data.get("weight_map", {}).items()}
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    config_file = folder / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        if "dtype" in config and "torch_dtype" not in config:
            config["torch_dtype"] = config["dtype"]
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _tokenizer_for_transformers4(folder: Path) -> None:
    """transformers 5.x saves a CLIP tokenizer as ``tokenizer.json`` only; 4.x's CLIPTokenizer (the class
    diffusers' model_index names) reads ``vocab.json`` + ``merges.txt`` (its VOCAB_FILES_NAMES; merges after a
    ``#version`` line) and its added tokens from ``tokenizer_config.json``'s ``added_tokens_decoder``. Write
    both from the BPE model in tokenizer.json, so the two versions tokenize alike."""
    spec_file = folder / "tokenizer.json"
    if not spec_file.is_file():
        return
    spec = json.loads(spec_file.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ExportError(f"{folder}: a {model.get('type')} tokenizer, not CLIP's BPE")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    (folder / "vocab.json").write_text(
        json.dumps(model["vocab"], ensure_ascii=False, indent=2, sort_keys=False) + "\n", encoding="utf-8"
    )
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8"
    )
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    decoder = dict(config.get("added_tokens_decoder") or {})
    for token in spec.get("added_tokens", []):
        decoder.setdefault(str(token["id"]), {k: token[k] for k in fields if k in token})
    config["added_tokens_decoder"] = decoder
    config.setdefault("tokenizer_class", "CLIPTokenizer")
    config.setdefault("errors", "replace")
    _special_tokens_for_transformers4(config)
    config_file.write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _special_tokens_for_transformers4(config: dict[str, Any]) -> bool:
    """transformers 5 writes ``tokenizer_config.json``'s ``extra_special_tokens`` as a list of tokens; 4.x
    (v4.57 ``tokenization_utils_base.py``, ``_set_model_specific_special_tokens``) reads it as a dict of named
    tokens and fails on a list ("'list' object has no attribute 'keys'"). Both read the list under
    ``additional_special_tokens`` (5.x converts it back), so it moves there. Edits ``config``; whether it did."""
    if not isinstance(config.get("extra_special_tokens"), list):
        return False
    tokens = config.pop("extra_special_tokens")
    if tokens:
        config.setdefault("additional_special_tokens", tokens)
    return True


def _t5_tokenizer_for_transformers4(folder: Path) -> None:
    """A T5 tokenizer's config with the special tokens where 4.x reads them (its tokenizer.json serves both)."""
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if _special_tokens_for_transformers4(config):
        config_file.write_text(
            json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def folder_for_transformers4(folder: str | Path) -> None:
    """Make a diffusers folder saved with transformers 5 load the same on transformers 4.x / diffusers 0.3x
    (kohya sd-scripts' and many UIs' pins): CLIP text encoders with ``text_model.`` names, CLIP tokenizers with
    vocab.json + merges.txt, special tokens 4.x can read. A T5 tokenizer saved as ``tokenizer.json`` is named
    ``T5TokenizerFast`` in model_index.json, as the SD3.5 / FLUX.1 hub repos name it: 5.x's ``T5Tokenizer``
    is 4.x's sentencepiece class (it needs ``spiece.model``), while ``T5TokenizerFast`` reads tokenizer.json
    in 4.x and is the same class in 5.x. A folder saved by 4.x is left as it is."""
    folder = Path(folder)
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    renamed = False
    for component, entry in index.items():
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "transformers"):
            continue
        if entry[1] in _CLIP_TEXT_MODELS:
            _text_encoder_for_transformers4(folder / component)
        elif entry[1] in _CLIP_TOKENIZERS:
            _tokenizer_for_transformers4(folder / component)
        elif entry[1] in _T5_TOKENIZERS:
            _t5_tokenizer_for_transformers4(folder / component)
            if entry[1] == "T5Tokenizer" and (folder / component / "tokenizer.json").is_file():
                index[component] = ["transformers", "T5TokenizerFast"]
                renamed = True
    if renamed:
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_full(
    out_dir: str | Path,
    *,
    pipeline,
    family: str,
    metadata: dict[str, Any] | None,
    single_file: bool = True,
    name: str | None = None,
    dtype=None,
) -> list[Path]:
    """A diffusers folder ``out_dir/model`` (``save_pretrained``, made loadable by transformers 4.x too, plus
    ``sdplan.json`` with the config and plan) and, when ``single_file``, ``out_dir/{name}.safetensors`` in the
    original layout (``name`` None/empty: the run folder's name). ``dtype`` (e.g. torch.float16) casts the
    single file's floating tensors; None keeps the pipeline's."""
    _check_family(family)
    out_dir = Path(out_dir)
    name = output_name(name, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = output_metadata(metadata, family)
    tensors = None
    if single_file and family in FLOW_FAMILIES and registry.family(family).arch == "mmdit":
        from .flow_single_file import sd3_pipeline_to_original

        tensors = sd3_pipeline_to_original(pipeline)  # MMDiT, VAE, CLIP-L/G and T5 (Stability's layout)
    elif single_file and family in FLOW_FAMILIES:  # FLUX: the transformer only, as BFL's release
        from .flow_single_file import transformer_to_original

        # BFL's bare names (double_blocks.0...): BFL's own load_flow_model reads only those; diffusers, ComfyUI's
        # diffusion-model loader and kohya read them, and the ComfyUI prefix too
        tensors = transformer_to_original(unwrap(pipeline.transformer), family)
    elif single_file:
        tensors = pipeline_to_original(pipeline, family)  # checks before writing

    folder = out_dir / "model"
    tmp = _tmp_name(folder)
    try:
        pipeline.save_pretrained(str(tmp), safe_serialization=True)
        folder_for_transformers4(tmp)
        record = {k: (json.loads(v) if k in ("sdplan_config", "sdplan_plan") else v) for k, v in md.items()}
        (tmp / METADATA_JSON).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        _umask_permissions(tmp)
        _replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    written = [folder]
    if tensors is not None:
        if dtype is not None:
            tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        config = dict(unwrap(pipeline.transformer).config) if family in FLOW_FAMILIES else None
        md = {
            **md,
            **_modelspec(family, metadata, name, lora=False, transformer_config=config),
            "format": "pt",
        }
        written.append(_save_safetensors(tensors, out_dir / f"{name}.safetensors", md))
    return written


# -- textual inversion ----------------------------------------------------------------------------------


def save_embedding(
    out_dir: str | Path,
    *,
    token: str,
    embeds,
    metadata: dict[str, Any] | None,
    name: str | None = None,
    family: str | None = None,
) -> Path:
    """``out_dir/{name}.safetensors`` (``name`` None/empty: the run folder's name, see ``output_name``).

    A1111 (``modules/textual_inversion/textual_inversion.py``) and ComfyUI (``comfy/sd1_clip.py`` load_embed)
    call an embedding by its file name, so the name is the prompt word there; diffusers loads the file with
    ``pipe.load_textual_inversion(path, token=token)`` (or ``weight_name=`` for the folder). SD 1.x/2.x:
    ``embeds`` is a ``[n, dim]`` tensor, saved as ``{token: embeds}`` (diffusers' format; A1111 and ComfyUI take
    a file's one tensor). SDXL: ``embeds`` is ``{"clip_l": [n, 768], "clip_g": [n, 1280]}`` (the keys A1111 and
    ComfyUI's SDXL loaders read), loaded per encoder (see ``load_embedding``).
    """
    import torch

    if isinstance(embeds, dict):
        if set(embeds) != {"clip_l", "clip_g"}:
            raise ExportError(f"SDXL embeddings need clip_l and clip_g, got {sorted(embeds)}")
        tensors = {k: v.detach().float().cpu().reshape(-1, v.shape[-1]) for k, v in embeds.items()}
        if tensors["clip_l"].shape[0] != tensors["clip_g"].shape[0]:
            raise ExportError("clip_l and clip_g hold different numbers of vectors")
        family = family or "sdxl"
    elif isinstance(embeds, torch.Tensor):
        tensors = {token: embeds.detach().float().cpu().reshape(-1, embeds.shape[-1])}
        family = family or "sd15"
    else:
        raise ExportError(f"embeds must be a tensor or a clip_l/clip_g dict, not {type(embeds).__name__}")
    name = output_name(name, out_dir)
    md = output_metadata(metadata, family)
    md.update(_modelspec(family, metadata, name, lora=False, textual_inversion=True))
    md.update(
        {
            "sdplan_token": token,
            "sdplan_name": name,
            "sdplan_num_vectors": str(next(iter(tensors.values())).shape[0]),
        }
    )
    return _save_safetensors(tensors, Path(out_dir) / f"{name}.safetensors", md)


def _embedding_file(folder: Path) -> Path:
    """The one ``save_embedding`` file in a folder (the one whose metadata has ``sdplan_num_vectors``)."""
    from safetensors import safe_open

    found = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "sdplan_num_vectors" in (f.metadata() or {}):
                found.append(file)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise UsageError(f"{folder}: {what} sdplan embedding files", fix="pass the embedding file itself")
    return found[0]


def load_embedding(pipeline, path: str | Path, token: str) -> None:
    """Load a ``save_embedding`` file into a pipeline with ``pipe.load_textual_inversion`` (both encoders for
    SDXL)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = _embedding_file(path)
    state = load_file(str(path))
    if "clip_l" in state and "clip_g" in state:
        pipeline.load_textual_inversion(
            state["clip_l"], token=token, text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer
        )
        pipeline.load_textual_inversion(
            state["clip_g"], token=token, text_encoder=pipeline.text_encoder_2, tokenizer=pipeline.tokenizer_2
        )
    else:
        pipeline.load_textual_inversion(str(path), token=token)
