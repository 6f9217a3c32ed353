"""Load the base model a recipe trains: a diffusers folder, a Hugging Face hub id, or one checkpoint file.

``resolve_source`` is cheap (no torch) and runs first, so a mistyped path is one clear error before anything
heavy loads. ``load_components`` returns the pieces every recipe needs as a small struct; ``detect_family``
reads the family (sd15 / sd21 / sdxl) from the UNet config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdplan.errors import SdplanError, UsageError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")  # torch checkpoints (a pickle, in a zip or bare)
# .sft: Black Forest Labs' own name for FLUX.1's safetensors files (ComfyUI comfy/utils.py load_torch_file reads
# ".safetensors" or ".sft", in any case; A1111 lower-cases the suffix too)
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
SINGLE_FILE_SUFFIXES = (*SAFETENSORS_SUFFIXES, *PICKLE_SUFFIXES)
# owner/name as the hub spells it (no leading dot or slash, exactly one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_safetensors_name(path: str | Path) -> bool:
    """Whether a single file is read as safetensors: by its suffix, in any case (``.safetensors``, ``.sft``)."""
    return Path(path).suffix.lower() in SAFETENSORS_SUFFIXES


LINK_FOLDER = ".sdplan-load-"  # + the loading process's id: in the run's folder, while a single file loads


@contextmanager
def diffusers_readable(path: str | Path, scratch: str | Path | None = None) -> Iterator[str]:
    """``path``, or where it is not named ``*.safetensors`` in lower case but is a safetensors file (``.sft``,
    ``X.SAFETENSORS``), a link to it that is: diffusers' ``load_state_dict`` (``models/model_loading_utils.py``)
    compares the suffix case-sensitively with "safetensors" and reads any other name with ``torch.load``, which
    fails on it ("Unable to load weights"). The link lies in a folder of its own, removed when the load is done;
    with ``scratch`` (the run's output.dir) a hidden one there, ``.sdplan-load-<pid>``, so a trainer stopped
    while it loads (SIGTERM runs no exit handler) leaves it in its own run folder, not /tmp, and the next load
    there removes it (its process is gone). The user's file is untouched."""
    path = Path(path)
    if path.name.endswith(".safetensors") or not is_safetensors_name(path):
        yield str(path)
        return
    import os
    import shutil
    import tempfile

    if scratch is not None:
        root = Path(scratch)
        for old in root.glob(LINK_FOLDER + "*"):  # a load stopped before it removed its link
            pid = old.name[len(LINK_FOLDER) :]
            if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        folder = root / f"{LINK_FOLDER}{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    else:
        folder = Path(tempfile.mkdtemp(prefix="sdplan-model-"))
    try:
        link = folder / f"{path.stem}.safetensors"
        try:
            link.symlink_to(path.resolve())
        except OSError as e:
            raise UsageError(
                f"model.path {path}: cannot read it under a name diffusers reads as safetensors "
                f"({e.strerror or e})",
                fix=f"rename it to {path.stem}.safetensors",
            ) from None
        yield str(link)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        return True
    return True


class ModelLoadError(SdplanError):
    """The model source exists (or looks like a hub id) but could not be loaded."""

    exit_code = 2


class HubUnreachable(ModelLoadError):
    """A hub model that is not in the local cache, and the hub could not be asked (``why``: offline, no
    network)."""

    def __init__(self, message: str, *, fix: str, why: str):
        super().__init__(message, fix=fix)
        self.why = why


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "folder" | "file" | "hub"
    location: str


def load_dtype_kw(dtypes: dict[str, Any] | None, part: str, library: str = "diffusers") -> dict[str, Any]:
    """The from_pretrained keyword that loads ``part`` ("unet" = the denoiser, "vae", "text_encoder") straight
    in the dtype it trains in (the recipe's ``dtypes``), so that host RAM never holds an fp32 copy of a bf16
    checkpoint (diffusers and transformers 4.x load in fp32 by default: a FLUX.1 transformer is then 48 GB
    in RAM instead of 24). The cast is the one ``place_models`` would make, so the weights are the same.
    transformers 5 names the keyword ``dtype`` (``torch_dtype`` is deprecated there); 4.x ``torch_dtype``."""
    dtype = (dtypes or {}).get(part)
    if dtype is None:
        return {}
    if library == "transformers":
        import transformers

        return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}
    return {"torch_dtype": dtype}


@dataclass
class Components:
    """What a recipe trains and conditions on. Lists hold one entry for SD 1.x/2.x, two for SDXL."""

    family: str
    unet: Any
    vae: Any
    text_encoders: list[Any]
    tokenizers: list[Any]
    noise_scheduler: Any  # DDPMScheduler with the model's schedule: adds noise in training
    scheduler_config: dict[str, Any] = field(default_factory=dict)  # the model's own (inference) scheduler
    source: str = ""
    adapter: Any = None  # SD3.5/FLUX: flow.FlowAdapter (their objective and denoiser call); None for UNets
    notes: list[str] = field(default_factory=list)  # what the loader detected (family, prediction, variant)

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    def inference_scheduler(self):
        import diffusers

        name = self.scheduler_config.get("_class_name", "DDIMScheduler")
        cls = getattr(diffusers, name, None) or diffusers.DDIMScheduler
        return cls.from_config(self.scheduler_config or dict(self.noise_scheduler.config))

    def pipeline(self, *, unet=None, text_encoders=None):
        """A diffusers pipeline over these components (for sampling, class images and export)."""
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        unet = unet if unet is not None else self.unet
        tes = text_encoders if text_encoders is not None else self.text_encoders
        if self.family == "sdxl":
            return StableDiffusionXLPipeline(
                vae=self.vae,
                text_encoder=tes[0],
                text_encoder_2=tes[1],
                tokenizer=self.tokenizers[0],
                tokenizer_2=self.tokenizers[1],
                unet=unet,
                scheduler=self.inference_scheduler(),
            )
        return StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=tes[0],
            tokenizer=self.tokenizers[0],
            unet=unet,
            scheduler=self.inference_scheduler(),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )


def looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and not text.startswith((".", "~")) and ".." not in text


def _refuse_a_family_name(path: str) -> None:
    """``sdxl`` names a family, as `sdplan recommend --model` takes it, not weights to train from (no local path
    of that name: the caller checked): one line giving the family's hub id (profiles/models: what `recommend
    --out` writes as model.path) rather than "no such file or folder"."""
    from sdplan import registry
    from sdplan.profiles import load_profiles

    try:
        family = registry.family(path)
    except UsageError:
        return
    model = load_profiles().models.get(family.name)
    hub = model.hub_ids[0] if model is not None and model.hub_ids else None
    raise UsageError(
        f"model.path {path}: the {family.label} family, not a model to load",
        fix=(f"give its hub id {hub} (downloaded once), " if hub else "give ")
        + "a diffusers folder or a .safetensors/.ckpt file",
    )


def resolve_source(path: str) -> ModelSource:
    """Say what ``path`` is, without loading anything. A missing local path is a UsageError."""
    from sdplan.config import expand_user

    p = Path(expand_user(path, "model.path"))  # ~typo/x: one line (a hub id never starts with ~)
    if p.is_dir():
        if not (p / "model_index.json").is_file():
            parts = ", ".join(sorted(x.name for x in p.iterdir())[:6]) or "empty"
            raise UsageError(
                f"model.path {path}: a folder but not a diffusers model (no model_index.json; holds: {parts})",
                fix="point it at a diffusers folder, a .safetensors/.ckpt file or a hub id",
            )
        return ModelSource("folder", str(p))
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            raise UsageError(
                f"model.path {path}: a GGUF file (weights quantized for ComfyUI-GGUF / Forge inference), "
                "which diffusers cannot train from",
                fix="give the model's bf16 / fp16 release as a .safetensors file, a diffusers folder or a hub id",
            )
        if p.suffix.lower() not in SINGLE_FILE_SUFFIXES:
            raise UsageError(
                f"model.path {path}: not a model file (expected {', '.join(SINGLE_FILE_SUFFIXES)})"
            )
        return ModelSource("file", str(p))
    if looks_like_hub_id(path) and p.suffix.lower() not in SINGLE_FILE_SUFFIXES:
        return ModelSource("hub", path)
    _refuse_a_family_name(path)
    raise UsageError(
        f"model.path {path}: no such file or folder",
        fix="give a diffusers folder, a .safetensors/.ckpt file, or a hub id such as "
        "stable-diffusion-v1-5/stable-diffusion-v1-5",
    )


# the cross-attention width of each released UNet family (SD 1.x: CLIP-L, SD 2.x: OpenCLIP-H, SDXL: both of
# its encoders); a UNet of another width is a test model built in code (trainer/tiny.py)
CROSS_WIDTHS = {768: "sd15", 1024: "sd21", 2048: "sdxl"}


def cross_attention_width(unet_config: Any) -> int | None:
    get = unet_config.get if isinstance(unet_config, dict) else lambda k, d=None: getattr(unet_config, k, d)
    cross = get("cross_attention_dim")
    if isinstance(cross, (list, tuple)):
        cross = cross[0] if cross else None
    return cross if isinstance(cross, int) else None


def detect_family(unet_config: Any, num_text_encoders: int = 1) -> str:
    """sdxl when the UNet takes text_time added conditioning; sd21 for 1024-wide cross attention; else sd15.

    Tiny test models have narrow cross attention (not 768/1024): they count as SD 1.x unless they have two
    text encoders or text_time conditioning.
    """
    get = unet_config.get if isinstance(unet_config, dict) else lambda k, d=None: getattr(unet_config, k, d)
    if get("addition_embed_type") == "text_time" or num_text_encoders >= 2:
        return "sdxl"
    if cross_attention_width(unet_config) == 1024:
        return "sd21"
    return "sd15"


def _check_family(found: str, wanted: str | None, where: str, unet_config: Any) -> str:
    """:func:`.source_check.check_family` on a loaded UNet: sd15 vs sd21 is the setting's call only for a UNet
    of none of the released widths (a test model)."""
    from .source_check import check_family

    tiny = cross_attention_width(unet_config) not in CROSS_WIDTHS
    return check_family(found, wanted, where, tiny=tiny) or found


def load_components(
    path: str,
    *,
    family: str | None = None,
    revision: str | None = None,
    variant: str | None = None,
    config_dir: str | None = None,
    dtypes: dict[str, Any] | None = None,
    info: Any = None,
    scratch: str | Path | None = None,
) -> Components:
    """Load UNet, VAE, text encoder(s), tokenizer(s) and the training noise scheduler from ``path``.

    ``info``: what ``source_check.check_source`` found (checked here when not given): the family, the
    prediction type the files say, the weights variant of each component, the cached snapshot of a hub id;
    its notes are the returned components' ``notes``.
    ``config_dir``: for a single file, a local diffusers folder with the matching component configs (nothing
    is downloaded then); without it diffusers fetches the default configs of the detected family.
    ``dtypes``: the dtype each part trains in (a recipe's ``dtypes``, keys unet / vae / text_encoder): each
    loads in it (:func:`load_dtype_kw`); None loads as the libraries default. ``scratch``: the run's folder,
    where a single file named .sft / X.SAFETENSORS is linked while it loads (:func:`diffusers_readable`)."""
    from .source_check import check_source

    if config_dir is not None:
        from sdplan.config import expand_user

        config_dir = expand_user(config_dir, "model.config_dir")
    info = info or check_source(
        path, family=family, variant=variant, config_dir=config_dir, revision=revision, deep=True
    )
    if info.kind == "file":
        comps = _load_single_file(info.location, family or info.family, config_dir, dtypes, info, scratch)
    else:
        comps = _load_pretrained(
            info.location,
            family or info.family,
            None if info.cached else revision,
            variant,
            hub=info.kind == "hub" and not info.cached,
            dtypes=dtypes,
            variants=info.variants,
        )
        if info.cached:
            comps.source = path
    if info.family is None and info.notes:  # a single transformer file: its family is config_dir's
        from .source_check import describe

        info.family = comps.family
        info.notes[0] = describe(info)
    comps.notes = list(info.notes) + comps.notes
    return comps


def _load_pretrained(
    location: str,
    family: str | None,
    revision: str | None,
    variant: str | None,
    *,
    hub: bool,
    dtypes: dict[str, Any] | None = None,
    variants: dict[str, str | None] | None = None,
) -> Components:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    kw: dict[str, Any] = {"revision": revision} if revision else {}
    if not hub:
        kw["local_files_only"] = True  # a local folder (or a hub id's cached snapshot): never the network

    def wkw(sub: str) -> dict[str, Any]:
        """The keywords that load ``sub``'s weights: the variant the check chose for it (a folder of only
        fp16 files loads those), else the one asked for."""
        v = variants.get(sub, variant) if variants else variant
        return dict(kw, variant=v) if v else dict(kw)

    try:
        if hub:
            index = _hub_index(location, revision)
        else:
            index = json.loads((Path(location) / "model_index.json").read_text())
        from .flow_models import PIPELINES, load_flow_components

        if index.get("_class_name") in PIPELINES:  # SD3.5 / FLUX.1: a transformer, not a UNet
            return load_flow_components(location, index, family, kw, wkw, dtypes=dtypes)
        two = "text_encoder_2" in index and index.get("text_encoder_2", [None])[0] is not None
        unet = UNet2DConditionModel.from_pretrained(
            location, subfolder="unet", **wkw("unet"), **load_dtype_kw(dtypes, "unet")
        )
        found = _check_family(detect_family(unet.config, 2 if two else 1), family, location, unet.config)
        vae = AutoencoderKL.from_pretrained(
            location, subfolder="vae", **wkw("vae"), **load_dtype_kw(dtypes, "vae")
        )
        te_kw = load_dtype_kw(dtypes, "text_encoder", "transformers")
        tokenizers = [CLIPTokenizer.from_pretrained(location, subfolder="tokenizer", **kw)]
        text_encoders = [
            CLIPTextModel.from_pretrained(location, subfolder="text_encoder", **wkw("text_encoder"), **te_kw)
        ]
        if found == "sdxl":
            tokenizers.append(CLIPTokenizer.from_pretrained(location, subfolder="tokenizer_2", **kw))
            text_encoders.append(
                CLIPTextModelWithProjection.from_pretrained(
                    location, subfolder="text_encoder_2", **wkw("text_encoder_2"), **te_kw
                )
            )
        noise_scheduler = DDPMScheduler.from_pretrained(location, subfolder="scheduler", **kw)
        scheduler_config = dict(DDPMScheduler.load_config(location, subfolder="scheduler", **kw))
    except SdplanError:
        raise
    except Exception as e:  # hub errors, missing subfolders, corrupt weights
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = " (no such local path, so tried it as a Hugging Face hub id)" if hub else ""
        raise ModelLoadError(f"could not load model {location}{where}: {first}") from e
    return Components(
        family=found,
        unet=unet,
        vae=vae,
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        noise_scheduler=noise_scheduler,
        scheduler_config=scheduler_config,
        source=location,
    )


def _hub_index(location: str, revision: str | None) -> dict[str, Any]:
    """A hub model's model_index.json (:func:`hub_file`)."""
    path = hub_file(location, "model_index.json", revision)
    assert path is not None  # not optional: its absence is an error
    return json.loads(path.read_text())


def hub_file(location: str, filename: str, revision: str | None, *, optional: bool = False) -> Path | None:
    """One file of a hub model: from the local cache, else downloaded after one quick request without
    retries (:func:`ask_hub`). ``optional``: a file the repo may lack is None then; otherwise only
    model_index.json is asked for this way, and its absence says "not a diffusers model"."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub import try_to_load_from_cache as cached

    if isinstance(hit := cached(location, filename, revision=revision), str):
        return Path(hit)
    if not ask_hub(location, filename, revision, optional=optional):
        return None
    return Path(hf_hub_download(location, filename, revision=revision))


def ask_hub(
    location: str,
    filename: str,
    revision: str | None,
    *,
    optional: bool = False,
    cache: str = "it is not in the local cache",
) -> bool:
    """One quick request for ``filename`` of a hub model, without retries, so that no network, an offline
    setting or a wrong id is one line at once (huggingface_hub's own download retries a dead network for half
    a minute). False where an ``optional`` file is not in the repo. ``cache``: what the local cache lacks, for
    the line saying the hub cannot be reached."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"hub model {location} (no such local path, so tried it as a Hugging Face hub id)"
    if constants.HF_HUB_OFFLINE:
        raise HubUnreachable(
            f"{where}: {cache} and HF_HUB_OFFLINE is set",
            fix="download it once with network access, or give a local diffusers folder or .safetensors file",
            why="HF_HUB_OFFLINE is set",
        )
    try:
        get_hf_file_metadata(hf_hub_url(location, filename, revision=revision), timeout=10)
    except GatedRepoError:  # FLUX.1 [dev], SD3.5: the repo exists, its files need an accepted license
        raise ModelLoadError(
            f"{where}: gated on the hub (its license must be accepted, and this machine logged in)",
            fix=f"accept it at https://huggingface.co/{location} while logged in there, then `hf auth login` here",
        ) from None
    except RepositoryNotFoundError:  # also a private model without a login
        raise ModelLoadError(
            f"{where}: not found on the hub",
            fix="check the id, or log in (`hf auth login`) for a gated or private model",
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{where}: no revision {revision}", fix="fix model.revision") from None
    except EntryNotFoundError:
        if optional:
            return False
        raise ModelLoadError(
            f"{where}: not a diffusers model (no {filename})",
            fix="give a diffusers model's hub id, a local diffusers folder or a .safetensors file",
        ) from None
    except Exception as e:  # no network: a name that does not resolve, a refused connection, a timeout
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HubUnreachable(
            f"{where}: cannot reach the hub ({first}) and {cache}",
            fix="check the network, or give a local diffusers folder or .safetensors file",
            why=first,
        ) from None
    return True


def _from_an_unreachable_hub(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is the hub client's "not in the cache, and the hub cannot be asked"
    (offline, no network: huggingface_hub raises LocalEntryNotFoundError for both)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _load_single_file(
    location: str,
    family: str | None,
    config_dir: str | None,
    dtypes: dict[str, Any] | None = None,
    info: Any = None,
    scratch: str | Path | None = None,
) -> Components:
    from diffusers import DDPMScheduler

    from sdplan.registry import FLOW_FAMILIES

    from .flow_single_file import is_flow_transformer_file, load_flow_single_file
    from .single_file import load_single_file_model

    if family in FLOW_FAMILIES or (family is None and is_flow_transformer_file(location)):
        return load_flow_single_file(location, family, config_dir, dtypes, scratch)  # SD3.5 / FLUX.1

    # one dtype for the whole pipeline file: only where every part trains in the same one
    same = set((dtypes or {}).values())
    try:  # the family is read from the file's keys when not given
        pipe = load_single_file_model(
            location, family, config_dir, torch_dtype=same.pop() if len(same) == 1 else None, scratch=scratch
        )
    except SdplanError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if config_dir is None and _from_an_unreachable_hub(e):
            raise ModelLoadError(
                f"could not load model file {location}: a single file's component configs and tokenizers come "
                f"from the Hugging Face hub, and it cannot be reached here ({first})",
                fix="set model.config_dir to a local diffusers folder of the same family (then nothing is "
                "downloaded), or connect to the network once",
            ) from e
        raise ModelLoadError(f"could not load model file {location}: {first}") from e
    parts = pipe.components if hasattr(pipe, "components") else dict(pipe)
    two = parts.get("text_encoder_2") is not None
    unet_config = parts["unet"].config
    found = _check_family(detect_family(unet_config, 2 if two else 1), family, location, unet_config)
    text_encoders = [parts["text_encoder"]] + ([parts["text_encoder_2"]] if two else [])
    tokenizers = [parts["tokenizer"]] + ([parts["tokenizer_2"]] if two else [])
    # a loaded config lists the keys its JSON lacked in _use_default_values, and from_config drops those keys:
    # without this, a prediction type or zero terminal SNR set below on such a key is silently lost
    scheduler_config = {k: v for k, v in parts["scheduler"].config.items() if k != "_use_default_values"}
    notes = _single_file_prediction(scheduler_config, info, found, location)
    return Components(
        family=found,
        unet=parts["unet"],
        vae=parts["vae"],
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        noise_scheduler=DDPMScheduler.from_config(scheduler_config),
        scheduler_config=scheduler_config,
        source=location,
        notes=notes,
    )


def _single_file_prediction(
    scheduler_config: dict[str, Any], info: Any, family: str, location: str
) -> list[str]:
    """Set the prediction type a single file trains with in ``scheduler_config`` (in place): what the file
    says (``source_check``: a .yaml beside it, a ``v_pred`` key, its metadata), else for SD 2.x ComfyUI's
    test on its weights; else the scheduler config stands (``model.config_dir``'s, or diffusers' default
    for the family). A ``ztsnr`` key adds zero terminal SNR. Returns the notes to print."""
    from .source_check import SD2_V_PROBE, sd2_v_from_weights

    pred = getattr(info, "prediction_type", None)
    if pred is None and family == "sd21":
        bias = _read_tensor(location, SD2_V_PROBE)
        if bias is not None:
            pred = "v_prediction" if sd2_v_from_weights(bias) else "epsilon"
            note = f"prediction type {pred} from its weights (ComfyUI's SD 2.x test)"
            scheduler_config["prediction_type"] = pred
            return [note]
    if pred is None:
        return [
            f"prediction type {scheduler_config.get('prediction_type')} (the scheduler config's; "
            "the file does not say)"
        ]
    scheduler_config["prediction_type"] = pred
    if getattr(info, "zero_snr", False):
        scheduler_config["rescale_betas_zero_snr"] = True
        scheduler_config["timestep_spacing"] = "trailing"
        import inspect

        import diffusers

        name = scheduler_config.get("_class_name", "")
        cls = getattr(diffusers, name, None)
        if cls is None or "rescale_betas_zero_snr" not in inspect.signature(cls.__init__).parameters:
            # SD 1.5's PNDMScheduler has no zero-terminal-SNR option: it would keep the value in its config and
            # sample from SNR 0.0047, in the grids, class images and the exported folder. DDIM with trailing
            # spacing is the sampler of the zero-SNR paper (Lin et al. 2023) and diffusers' docs for it
            scheduler_config["_class_name"] = "DDIMScheduler"
            return [f"samples with DDIMScheduler: {name or 'the scheduler'} has no zero terminal SNR"]
    return []


def _read_tensor(location: str, key: str):
    """One tensor of a checkpoint file (None when it has no such key)."""
    if is_safetensors_name(location):
        from safetensors import safe_open

        with safe_open(location, framework="pt") as f:
            return f.get_tensor(key) if key in set(f.keys()) else None
    from .single_file import read_checkpoint_safely

    return read_checkpoint_safely(location).get(key)
