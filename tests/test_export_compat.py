"""Outputs other clients load as sdplan meant them (issue 13, item 8).

- DreamBooth / fine-tune folders saved with transformers 5 must load on transformers 4.x / diffusers 0.3x
  (kohya sd-scripts' and many UIs' pins). What 4.x expects is read from its source (v4.57,
  ``models/clip/tokenization_clip.py``, ``modeling_clip.py``, ``modeling_utils.py``): CLIPTokenizer reads
  ``vocab.json`` + ``merges.txt`` (merges after one ``#version`` line, at most 48894 of them) and its added
  tokens from ``tokenizer_config.json``'s ``added_tokens_decoder``; CLIPTextModel nests its modules under
  ``text_model`` (``embeddings.token_embedding``, ``encoder.layers.N.{self_attn.{q,k,v,out}_proj, layer_norm1,
  mlp.fc1, mlp.fc2, layer_norm2}``, ``final_layer_norm``; WithProjection adds ``text_projection`` without
  bias), and its loader only repairs a ``base_model_prefix`` (``clip``) mismatch, so flattened names load as
  random weights with a warning. A T5 tokenizer saved by 5.x as tokenizer.json loads in 4.x as
  ``T5TokenizerFast`` (4.x's ``T5Tokenizer`` needs ``spiece.model``), and 4.x reads ``extra_special_tokens`` as
  a dict (``tokenization_utils_base.py``). No transformers 4.x here: the tests check the files against that;
  ``scripts/check_older_stack.py`` loads real outputs on transformers 4.57 / diffusers 0.35.
- Embeddings are named after the run (A1111 and ComfyUI call an embedding by its file name).
- Every output is named after the run folder unless a name is given.
- kohya ``ss_*`` / ``sshs_*`` and model spec keys have the types and formats kohya sd-scripts writes
  (train_network.py, networks/lora.py, library/train_util.py, library/sai_model_spec.py).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from sdplan.trainer import export

V4_MAX_MERGES = 49152 - 256 - 2  # transformers 4.x CLIPTokenizer: merges lines [1 : 49152 - 256 - 2 + 1]


def _pipe(folder: Path):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline if (folder / "text_encoder_2").exists() else StableDiffusionPipeline
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _v4_text_model_keys(num_layers: int, projection: bool) -> set[str]:
    """The parameter names of transformers 4.x CLIPTextModel(WithProjection), from its modeling_clip.py."""
    keys = {f"text_model.embeddings.{m}.weight" for m in ("token_embedding", "position_embedding")}
    keys |= {f"text_model.final_layer_norm.{p}" for p in ("weight", "bias")}
    modules = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj"]
    modules += ["layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2"]
    for n in range(num_layers):
        keys |= {f"text_model.encoder.layers.{n}.{m}.{p}" for m in modules for p in ("weight", "bias")}
    if projection:
        keys.add("text_projection.weight")
    return keys


def _v4_problems(folder: Path) -> list[str]:
    """What transformers 4.x would mis-load in a diffusers folder; empty when nothing."""
    problems = []
    index = json.loads((folder / "model_index.json").read_text())
    for component, entry in index.items():
        if not (isinstance(entry, list) and entry[0] == "transformers"):
            continue
        sub = folder / component
        if entry[1] in ("CLIPTextModel", "CLIPTextModelWithProjection"):
            config = json.loads((sub / "config.json").read_text())
            if config.get("model_type") != "clip_text_model" or "torch_dtype" not in config:
                problems.append(f"{component}: config")
            with safe_open(str(sub / "model.safetensors"), framework="pt") as f:
                keys = set(f.keys())
            want = _v4_text_model_keys(config["num_hidden_layers"], entry[1].endswith("WithProjection"))
            if keys != want:
                problems.append(f"{component}: keys {sorted(keys ^ want)[:3]}")
        elif entry[1] == "CLIPTokenizer":
            if not (sub / "vocab.json").is_file() or not (sub / "merges.txt").is_file():
                problems.append(f"{component}: no vocab.json/merges.txt")
                continue
            spec = json.loads((sub / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = json.loads((sub / "vocab.json").read_text(encoding="utf-8"))
            lines = (sub / "merges.txt").read_text(encoding="utf-8").strip().split("\n")
            merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
            if vocab != spec["model"]["vocab"]:
                problems.append(f"{component}: vocab.json differs from tokenizer.json")
            if not lines[0].startswith("#version") or lines[1 : V4_MAX_MERGES + 1] != merges:
                problems.append(f"{component}: merges.txt differs from tokenizer.json")
            config = json.loads((sub / "tokenizer_config.json").read_text(encoding="utf-8"))
            decoder = config.get("added_tokens_decoder") or {}
            for token in spec["added_tokens"]:
                got = decoder.get(str(token["id"]), {})
                if got.get("content") != token["content"] or got.get("special") != token["special"]:
                    problems.append(f"{component}: added token {token['content']} missing")
            for special in ("bos_token", "eos_token", "unk_token", "pad_token"):
                if config.get(special) not in vocab:
                    problems.append(f"{component}: {special}")
        elif entry[1] == "T5Tokenizer" and not (sub / "spiece.model").is_file():
            # 4.x's T5Tokenizer is the sentencepiece class: without spiece.model it cannot load
            problems.append(f"{component}: T5Tokenizer without spiece.model")
        config_file = sub / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
            if isinstance(config.get("extra_special_tokens"), list):  # 4.x reads a dict of named tokens
                problems.append(f"{component}: extra_special_tokens is a list")
    return problems


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_full_folder_has_what_transformers4_reads(family, tiny_sd15, tiny_sdxl, tmp_path):
    from transformers import CLIPTokenizer

    source = tiny_sd15 if family == "sd15" else tiny_sdxl
    pipe = _pipe(source)
    plain = tmp_path / "plain"  # what save_pretrained alone writes with transformers 5: the reported bug
    pipe.save_pretrained(plain)
    if int(__import__("transformers").__version__.split(".")[0]) >= 5:
        assert _v4_problems(plain)

    model_dir, _ = export.save_full(tmp_path / "out", pipeline=pipe, family=family, metadata=None)
    assert _v4_problems(model_dir) == []

    # transformers 5 still loads it, every weight as trained
    loaded = _pipe(model_dir)
    for part in ("text_encoder", "text_encoder_2", "unet"):
        if getattr(pipe, part, None) is None:
            continue
        a = {k: v for k, v in getattr(pipe, part).state_dict().items() if "position_ids" not in k}
        b = {k: v for k, v in getattr(loaded, part).state_dict().items() if "position_ids" not in k}
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part

    # a tokenizer built from vocab.json + merges.txt alone (what 4.x's CLIPTokenizer reads) tokenizes alike
    for name in ("tokenizer", "tokenizer_2"):
        if getattr(pipe, name, None) is None:
            continue
        bare = tmp_path / f"bare_{name}"
        bare.mkdir()
        for file in ("vocab.json", "merges.txt"):
            shutil.copy(model_dir / name / file, bare / file)
        from_files = CLIPTokenizer.from_pretrained(str(bare), pad_token="<|endoftext|>")
        prompt = "a photo of sks dog, red square on blue"
        assert from_files(prompt).input_ids == getattr(loaded, name)(prompt).input_ids


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd35-medium", "flux-dev"])
def test_base_folders_load_alike_on_transformers4_and_5(family, tmp_path):
    """The demo's base model (and any folder folder_for_transformers4 fixes): the plain save_pretrained of a
    FLUX / SD3.5 folder names its T5 tokenizer with 5.x's class and writes a list 4.x cannot read; after the
    fix nothing is left for 4.x to mis-load, and 5.x loads the same weights and tokenizes alike."""
    from diffusers import DiffusionPipeline
    from sdplan.trainer.tiny import save_tiny_model

    fixed = save_tiny_model(tmp_path / "fixed", family)
    assert _v4_problems(fixed) == []
    original = DiffusionPipeline.from_pretrained(fixed)
    plain = tmp_path / "plain"  # what transformers 5 writes on its own
    original.save_pretrained(plain)
    if int(__import__("transformers").__version__.split(".")[0]) >= 5:
        assert _v4_problems(plain)
    export.folder_for_transformers4(plain)
    assert _v4_problems(plain) == []
    index = json.loads((plain / "model_index.json").read_text())
    assert "T5Tokenizer" not in [entry[1] for entry in index.values() if isinstance(entry, list)]

    loaded = DiffusionPipeline.from_pretrained(plain)
    prompt = "a photo of sks dog, red square on blue"
    for name, part in original.components.items():
        if name.startswith("tokenizer") and part is not None:
            assert getattr(loaded, name)(prompt).input_ids == part(prompt).input_ids, name
        elif hasattr(part, "state_dict"):
            a, b = part.state_dict(), getattr(loaded, name).state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_text_encoder_keys_are_renamed_in_shards_too(tmp_path):
    """A sharded text encoder (large OpenCLIP encoders): every shard and the index get text_model. names."""
    from safetensors.torch import save_file

    folder = tmp_path / "te"
    folder.mkdir()
    save_file(
        {"embeddings.token_embedding.weight": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors")
    )
    save_file({"final_layer_norm.weight": torch.ones(2), "text_projection.weight": torch.ones(1)},
              str(folder / "model-00002-of-00002.safetensors"))  # fmt: skip
    index = {
        "metadata": {},
        "weight_map": {
            "embeddings.token_embedding.weight": "model-00001-of-00002.safetensors",
            "final_layer_norm.weight": "model-00002-of-00002.safetensors",
            "text_projection.weight": "model-00002-of-00002.safetensors",
        },
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"model_type": "clip_text_model", "dtype": "float16"}))
    export._text_encoder_for_transformers4(folder)
    keys = set(load_file(str(folder / "model-00001-of-00002.safetensors"))) | set(
        load_file(str(folder / "model-00002-of-00002.safetensors"))
    )
    want = {"text_model.embeddings.token_embedding.weight", "text_model.final_layer_norm.weight"}
    assert keys == want | {"text_projection.weight"}
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == keys
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"


# -- names ----------------------------------------------------------------------------------------------


def test_output_name_defaults_to_the_run_folder():
    assert export.output_name(None, "/runs/cat-v2") == "cat-v2"
    assert export.output_name("", "runs/dog lora [v2]") == "dog_lora__v2"
    assert export.output_name("  my:lora/x ", "/runs/a") == "my_lora_x"
    assert export.output_name("..", "/") == "sdplan"  # nothing usable left


def test_two_embedding_runs_get_their_own_names(tmp_path):
    """A1111 and ComfyUI call an embedding by its file name: two runs must not both be learned_embeds."""
    embeds = torch.randn(2, 32)
    a = export.save_embedding(tmp_path / "cat-run", token="<cat>", embeds=embeds, metadata=None)
    b = export.save_embedding(tmp_path / "dog-run", token="<dog>", embeds=embeds, metadata=None)
    assert (a.name, b.name) == ("cat-run.safetensors", "dog-run.safetensors")
    named = export.save_embedding(tmp_path / "x", token="<t>", embeds=embeds, metadata=None, name="mything")
    assert named.name == "mything.safetensors"
    with safe_open(str(a), framework="pt") as f:
        md, keys = f.metadata(), list(f.keys())
    # A1111 create_embedding_from_data / ComfyUI load_embed: a file with one tensor is that embedding
    assert keys == ["<cat>"] and md["sdplan_token"] == "<cat>" and md["sdplan_name"] == "cat-run"
    assert md["modelspec.architecture"] == "stable-diffusion-v1/textual-inversion"
    assert md["modelspec.title"] == "cat-run"


def test_embedding_loads_in_diffusers_under_its_new_name(tiny_sd15, tiny_sdxl, tmp_path):
    pipe = _pipe(tiny_sd15)
    embeds = torch.randn(1, pipe.text_encoder.config.hidden_size)
    path = export.save_embedding(tmp_path / "run1", token="<thing>", embeds=embeds, metadata=None)
    pipe.load_textual_inversion(str(path.parent), weight_name=path.name, token="<thing>")
    row = pipe.text_encoder.get_input_embeddings().weight[pipe.tokenizer.convert_tokens_to_ids("<thing>")]
    torch.testing.assert_close(row, embeds[0])
    fresh = _pipe(tiny_sd15)
    export.load_embedding(fresh, path.parent, "<thing>")  # the folder: its one sdplan embedding file
    row = fresh.text_encoder.get_input_embeddings().weight[fresh.tokenizer.convert_tokens_to_ids("<thing>")]
    torch.testing.assert_close(row, embeds[0])

    xl = _pipe(tiny_sdxl)
    widths = [te.get_input_embeddings().weight.shape[1] for te in (xl.text_encoder, xl.text_encoder_2)]
    sdxl = {"clip_l": torch.randn(1, widths[0]), "clip_g": torch.randn(1, widths[1])}
    path = export.save_embedding(tmp_path / "run2", token="<x>", embeds=sdxl, metadata=None)
    # A1111: 'clip_g' in data and 'clip_l' in data; ComfyUI: embed[embed_key] with clip_l / clip_g
    assert path.name == "run2.safetensors" and set(load_file(str(path))) == {"clip_l", "clip_g"}
    export.load_embedding(xl, path, "<x>")
    row = xl.text_encoder_2.get_input_embeddings().weight[xl.tokenizer_2.convert_tokens_to_ids("<x>")]
    torch.testing.assert_close(row, sdxl["clip_g"][0])


def test_lora_and_single_file_default_to_the_run_folder_name(tiny_sd15, tmp_path):
    from peft import LoraConfig

    pipe = _pipe(tiny_sd15)
    _, single = export.save_full(tmp_path / "ft-run", pipeline=pipe, family="sd15", metadata=None)
    assert single.name == "ft-run.safetensors"
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q"]))
    for run in ("style-a", "style-b"):
        paths = export.save_lora(
            tmp_path / run, unet=pipe.unet, text_encoders=[], family="sd15", rank=4, alpha=4, metadata=None
        )
        assert paths[1].name == f"{run}.kohya.safetensors"
        with safe_open(str(paths[1]), framework="pt") as f:
            md = f.metadata()
        assert md["ss_output_name"] == run and md["modelspec.title"] == run


# -- kohya metadata -------------------------------------------------------------------------------------

# Every ss_/sshs_ key kohya sd-scripts writes for a LoRA (train_network.py's metadata dict, the dataset keys
# of its non-config branch, model hashes, networks/lora.py save_weights), with the format str() gives it.
INT = {
    "ss_session_id", "ss_num_train_images", "ss_num_validation_images", "ss_num_reg_images",
    "ss_num_batches_per_epoch", "ss_num_epochs", "ss_gradient_accumulation_steps", "ss_max_train_steps",
    "ss_lr_warmup_steps", "ss_network_dim", "ss_clip_skip", "ss_max_token_length", "ss_seed",
    "ss_multires_noise_iterations", "ss_caption_dropout_every_n_epochs", "ss_batch_size_per_device",
    "ss_total_batch_size", "ss_min_bucket_reso", "ss_max_bucket_reso", "ss_keep_tokens", "ss_steps",
    "ss_epoch", "ss_validation_seed", "ss_max_validation_steps", "ss_validate_every_n_epochs",
    "ss_validate_every_n_steps",
}  # fmt: skip
FLOAT = {
    "ss_training_started_at", "ss_training_finished_at", "ss_learning_rate", "ss_text_encoder_lr",
    "ss_unet_lr", "ss_network_alpha", "ss_network_dropout", "ss_noise_offset", "ss_multires_noise_discount",
    "ss_adaptive_noise_scale", "ss_max_grad_norm", "ss_caption_dropout_rate", "ss_caption_tag_dropout_rate",
    "ss_prior_loss_weight", "ss_min_snr_gamma", "ss_scale_weight_norms", "ss_ip_noise_gamma",
    "ss_noise_offset_random_strength", "ss_ip_noise_gamma_random_strength", "ss_huber_scale", "ss_huber_c",
    "ss_validation_split",
}  # fmt: skip
BOOL = {
    "ss_gradient_checkpointing", "ss_full_fp16", "ss_v2", "ss_cache_latents", "ss_lowram",
    "ss_zero_terminal_snr", "ss_debiased_estimation", "ss_fp8_base", "ss_fp8_base_unet", "ss_color_aug",
    "ss_flip_aug", "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale",
}  # fmt: skip
JSON = {"ss_datasets", "ss_tag_frequency", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_bucket_info",
        "ss_network_args"}  # fmt: skip
TEXT = {
    "ss_output_name", "ss_lr_scheduler", "ss_network_module", "ss_mixed_precision", "ss_base_model_version",
    "ss_training_comment", "ss_sd_scripts_commit_hash", "ss_optimizer", "ss_loss_type", "ss_huber_schedule",
    "ss_resize_interpolation", "ss_sd_model_name", "ss_vae_name", "ss_face_crop_aug_range",
}  # fmt: skip
HASH = {"ss_sd_model_hash": 8, "ss_new_sd_model_hash": 64, "ss_vae_hash": 8, "ss_new_vae_hash": 64,
        "sshs_model_hash": 64, "sshs_legacy_hash": 8}  # fmt: skip
KOHYA_KEYS = INT | FLOAT | BOOL | JSON | TEXT | HASH.keys() | {"ss_resolution"}
MODELSPEC = {
    "modelspec.sai_model_spec", "modelspec.architecture", "modelspec.implementation", "modelspec.title",
    "modelspec.resolution", "modelspec.date", "modelspec.prediction_type", "modelspec.implementation_version",
    "modelspec.hash_sha256",
}  # fmt: skip


def _check_kohya_formats(md: dict[str, str]) -> None:
    ours = {k for k in md if k.startswith(("ss_", "sshs_"))}
    assert ours <= KOHYA_KEYS, sorted(ours - KOHYA_KEYS)
    for key in ours:
        value = md[key]
        if key in INT:
            assert re.fullmatch(r"-?\d+", value), (key, value)
        elif key in FLOAT:
            float(value)
        elif key in BOOL:
            assert value in ("True", "False"), (key, value)
        elif key in JSON:
            json.loads(value)
        elif key in HASH:
            assert re.fullmatch(rf"[0-9a-f]{{{HASH[key]}}}", value), (key, value)
        elif key == "ss_resolution":
            assert re.fullmatch(r"\(\d+, \d+\)", value), value
        else:
            assert value and value != "None", (key, value)


def _dataset(root: Path):
    from sdplan.trainer.dataset_scan import Item

    return [
        Item(root / "10_sks dog" / "a.png", "sks dog, red collar", None, 10),
        Item(root / "10_sks dog" / "sub" / "b.png", "sks dog, Red Collar, grass", None, 10),
        Item(root / "3_style" / "c.png", None, ["painting", "sks dog"], 3),
    ]


def test_dataset_info_counts_as_kohya_does(tmp_path, monkeypatch):
    info = export.dataset_info(_dataset(tmp_path), tmp_path, bucket_rows=[
        {"bucket": 4, "width": 512, "height": 512, "aspect": 1.0, "images": 2, "samples": 20},
        {"bucket": 7, "width": 576, "height": 448, "aspect": 1.286, "images": 1, "samples": 3},
    ])  # fmt: skip
    assert info["num_train_images"] == 23
    assert info["dataset_dirs"] == {
        "10_sks dog": {"n_repeats": 10, "img_count": 2},
        "3_style": {"n_repeats": 3, "img_count": 1},
    }
    assert info["tag_frequency"] == {
        "10_sks dog": {"sks dog": 2, "red collar": 2, "grass": 1},
        "3_style": {"painting": 1, "sks dog": 1},
    }
    assert info["bucket_info"]["buckets"]["1"] == {"resolution": [576, 448], "count": 3}
    flat = export.dataset_info(_dataset(tmp_path)[:1], tmp_path / "10_sks dog")  # a flat folder
    assert list(flat["dataset_dirs"]) == ["10_sks dog"]
    (tmp_path / "10_sks dog").mkdir()
    monkeypatch.chdir(tmp_path / "10_sks dog")
    here = export.dataset_info([type(_dataset(tmp_path)[0])(Path("a.png"), "x", None, 1)], ".")
    assert list(here["dataset_dirs"]) == ["10_sks dog"]  # "." is named after the folder it is


def test_kohya_metadata_keys_have_kohya_formats(tiny_sd15, tmp_path):
    from peft import LoraConfig

    from sdplan import config
    from sdplan.steps import plan_steps

    model_file = tmp_path / "base.safetensors"
    model_file.write_bytes(bytes(range(256)) * 8192)  # 2 MiB: both kohya model hashes read real bytes
    cfg = config.validate(
        config.apply_overrides(
            config.default_config(),
            [f"model.path={model_file}", "data.resolution=64", "data.buckets=true", "data.random_flip=0.5",
             "lora.rank=4", "lora.alpha=2", "training.train_text_encoder=true", "training.grad_accum=2",
             "training.batch_size=3", "memory.optimizer=adamw8bit", "memory.gradient_checkpointing=true"],
        )
    )  # fmt: skip
    cfg.plan = {"batch_size": 3, "fits": True}
    step_plan = plan_steps(images_per_epoch=24, batch_size=3, grad_accum=2, epochs=3, batches_per_epoch=8)
    run = export.run_info(
        step_plan=step_plan,
        dataset=export.dataset_info(_dataset(tmp_path), tmp_path),
        started_at=1_700_000_000.5,
        session_id=123456,
    )
    meta = {"config": cfg, "plan": cfg.plan, "steps": 10, "epoch": 2.5, "prediction_type": "epsilon"}

    pipe = _pipe(tiny_sd15)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_v"]))
    pipe.text_encoder.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["q_proj"]))
    _, kohya_file = export.save_lora(
        tmp_path / "my-lora", unet=pipe.unet, text_encoders=[pipe.text_encoder], family="sd15", rank=4,
        alpha=2, metadata=meta, run=run,
    )  # fmt: skip
    with safe_open(str(kohya_file), framework="pt") as f:
        md, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    _check_kohya_formats(md)
    ss = {k for k in md if k.startswith(("ss_", "sshs_"))}
    named_in_issue = {"ss_tag_frequency", "ss_dataset_dirs", "ss_num_train_images", "ss_total_batch_size",
                      "ss_max_train_steps", "sshs_model_hash", "sshs_legacy_hash", "ss_epoch"}  # fmt: skip
    assert named_in_issue <= ss and len(ss) == 50, sorted(ss)  # 24 before; kohya writes up to 90
    assert {k for k in md if k.startswith("modelspec.")} == MODELSPEC

    # values users' tools read
    assert json.loads(md["ss_tag_frequency"])["10_sks dog"] == {"sks dog": 2, "red collar": 2, "grass": 1}
    assert json.loads(md["ss_dataset_dirs"])["3_style"] == {"n_repeats": 3, "img_count": 1}
    assert md["ss_num_train_images"] == "23" and md["ss_total_batch_size"] == "6"
    assert md["ss_max_train_steps"] == str(step_plan.total_steps) and md["ss_num_epochs"] == "3"
    assert md["ss_num_batches_per_epoch"] == "8" and md["ss_batch_size_per_device"] == "3"
    assert md["ss_epoch"] == "3" and md["ss_steps"] == "10"  # 2.5 epochs: kohya counts the begun one
    assert md["ss_optimizer"] == "bitsandbytes.optim.adamw.AdamW8bit"
    assert md["ss_session_id"] == "123456" and md["ss_training_started_at"] == "1700000000.5"
    assert (
        md["ss_flip_aug"] == "True" and md["ss_enable_bucket"] == "True" and md["ss_output_name"] == "my-lora"
    )
    assert md["ss_text_encoder_lr"] == md["ss_learning_rate"] == "0.0001"
    assert md["ss_sd_model_name"] == "base.safetensors"

    # kohya train_util.model_hash / calculate_sha256 of the base model file
    raw = model_file.read_bytes()
    assert md["ss_sd_model_hash"] == hashlib.sha256(raw[0x100000:0x110000]).hexdigest()[:8]
    assert md["ss_new_sd_model_hash"] == hashlib.sha256(raw).hexdigest()
    # sshs_model_hash: sha256 of the tensor bytes (addnet_hash_safetensors), the same in the written file
    data = kohya_file.read_bytes()
    body = data[8 + int.from_bytes(data[:8], "little") :]
    assert md["sshs_model_hash"] == hashlib.sha256(body).hexdigest()
    assert md["modelspec.hash_sha256"] == "0x" + md["sshs_model_hash"]  # ModelSpec: all tensor content
    # sshs_legacy_hash: 64 KiB at 1 MiB of the file serialised with only the ss_ keys (addnet_hash_legacy)
    only_ss = {k: v for k, v in md.items() if k.startswith("ss_")}
    assert md["sshs_legacy_hash"] == hashlib.sha256(save(tensors, only_ss)[0x100000:0x110000]).hexdigest()[:8]

    # model spec as kohya's sai_model_spec.py writes it
    assert md["modelspec.sai_model_spec"] == "1.0.1"
    assert md["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert md["modelspec.implementation"] == "diffusers"  # SD 1.x LoRA: diffusers module names
    assert md["modelspec.resolution"] == "64x64" and md["modelspec.prediction_type"] == "epsilon"
    datetime.datetime.fromisoformat(md["modelspec.date"])


def test_kohya_legacy_hash_reads_past_one_mebibyte():
    """sshs_legacy_hash of a file over 1 MiB hashes real bytes (below, every file gives sha256(b''))."""
    tensors = {"lora_unet_x.lora_down.weight": torch.arange(300_000, dtype=torch.float32)}
    md = {"ss_network_dim": "4", "other": "ignored"}
    got = export._kohya_hashes(tensors, md)
    blob = save(tensors, {"ss_network_dim": "4"})
    assert got["sshs_legacy_hash"] == hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]
    assert got["sshs_legacy_hash"] != hashlib.sha256(b"").hexdigest()[:8]


def test_kohya_metadata_without_a_run_writes_no_guesses():
    ss = export._kohya_metadata({"steps": 7, "epoch": 1.0}, "sdxl", 8, 8.0, "x")
    _check_kohya_formats(ss)
    for unknown in ("ss_tag_frequency", "ss_num_train_images", "ss_session_id", "ss_dataset_dirs"):
        assert unknown not in ss
    assert ss["ss_epoch"] == "1" and ss["ss_base_model_version"] == "sdxl_base_v1-0"
    spec = export._modelspec("sdxl", None, "x", lora=True)
    assert spec["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert spec["modelspec.resolution"] == "1024x1024"


def test_single_file_and_embedding_carry_model_spec_with_hash(tiny_sd15, tmp_path):
    pipe = _pipe(tiny_sd15)
    _, single = export.save_full(tmp_path / "a", pipeline=pipe, family="sd15", metadata=None)
    emb = export.save_embedding(tmp_path / "b", token="<t>", embeds=torch.randn(1, 32), metadata=None)
    for path, arch in ((single, "stable-diffusion-v1"), (emb, "stable-diffusion-v1/textual-inversion")):
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata()
        assert {k for k in md if k.startswith("modelspec.")} == MODELSPEC
        assert md["modelspec.architecture"] == arch
        assert md["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
        data = path.read_bytes()
        body = data[8 + int.from_bytes(data[:8], "little") :]
        assert md["modelspec.hash_sha256"] == "0x" + hashlib.sha256(body).hexdigest()


def test_diffusers_lora_loads_alike_without_its_adapter_metadata(tiny_sd15, tmp_path):
    """diffusers before 0.34 ignores lora_adapter_metadata and takes lora_alpha = r for the diffusers format
    (peft_utils.get_peft_kwargs): with alpha != rank the file must still give the trained model there."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    pipe = _pipe(tiny_sd15)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, param in pipe.unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    x, t, h = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 77, 32)
    with torch.no_grad():
        trained = pipe.unet(x, t, encoder_hidden_states=h).sample
    paths = export.save_lora(
        tmp_path / "out", unet=pipe.unet, text_encoders=[], family="sd15", rank=4, alpha=2, metadata=None
    )
    with safe_open(str(paths[0]), framework="pt") as f:
        md = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    # the adapter metadata holds no field a LoraConfig default says: peft 0.15 (under diffusers 0.34) refused
    # peft 0.21's alora_invocation_tokens=None ("LoraConfig class could not be instantiated")
    adapter = json.loads(md["lora_adapter_metadata"])
    adapter = {k.removeprefix("unet."): v for k, v in adapter.items()}  # diffusers prefixes the model's name
    # rank_pattern / alpha_pattern: diffusers 0.34-0.39 reads them by key (a KeyError without them)
    assert {"r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern"} <= set(adapter)
    assert "alora_invocation_tokens" not in adapter
    assert adapter["r"] == adapter["lora_alpha"] == 4
    old = {k: v for k, v in md.items() if k != "lora_adapter_metadata"}  # what diffusers 0.32 sees
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=old)
    for file in (paths[0], tmp_path / "old.safetensors"):
        loaded = _pipe(tiny_sd15)
        loaded.load_lora_weights(str(file))
        with torch.no_grad():
            got = loaded.unet(x, t, encoder_hidden_states=h).sample
        torch.testing.assert_close(got, trained, atol=1e-5, rtol=0)
