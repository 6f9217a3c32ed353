"""`sdplan recommend`: inputs (dataset, hardware) -> the planner -> JSON dict, rich rendering, output files.

Compute (:func:`recommend`, returning the issue-3 JSON dict and the planner's Result) and render
(:func:`render`, :func:`render_compare`) are separate. Pure Python: no torch, no PIL.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdplan import config as cfgmod
from sdplan import planner, registry
from sdplan.errors import ConfigError, OutputExistsError, SdplanError, UsageError
from sdplan.profiles import GiB, Profiles
from sdplan.registry import FAMILIES
from sdplan.settings import describe

DEFAULT_IMAGES = 20
NO_DATASET_NOTE = "no --dataset or --images"  # how a plan's reasons start where it assumed DEFAULT_IMAGES
DEFAULT_EPOCHS = cfgmod.DEFAULT_EPOCHS


# -- dataset ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetCount:
    images: int
    repeats: int
    images_per_epoch: int
    layout: str  # "kohya" | "flat" | "metadata"
    folders: tuple[tuple[str, int, int], ...] = ()  # (folder, repeats, images)
    captions: int = 0
    skipped: str = ""  # the files the trainer would not use, and why ("" when none)
    sizes: tuple[tuple[int, int] | None, ...] = ()  # each image's (width, height), for aspect buckets
    item_repeats: tuple[int, ...] = ()  # each image's repeats
    notes: tuple[str, ...] = ()  # what the scan made of something that looks unintended (a year as repeats)


def count_dataset(path: str | Path, data: Any = None) -> DatasetCount:
    """Count training images as the trainer finds them (:func:`sdplan.trainer.dataset_scan.scan`, torch-free):
    kohya-style ``N_name`` folders (N repeats each), a flat image+caption folder, or per-image metadata, read
    with the ``data`` section's settings (an sdplan.yaml ``data:`` with the pins: caption extension, default
    caption, repeats, metadata filters; None: the defaults). Each image's header is read, so a file that is no
    image is left out as the trainer leaves it out (the plan's steps would otherwise count it); one broken past
    its header only the trainer's full decode finds."""
    from sdplan.trainer.dataset_scan import count_of, require_images, scan, scan_data

    if data is None:
        result = require_images(scan(Path(path), verify="header"))  # as `sdplan train` says it
    else:
        result = require_images(scan_data(data, path=Path(path), verify="header"))
    per_epoch = result.images_x_repeats
    n = len(result.skipped)
    skipped = f"{count_of(n, 'file')} not used: {result.skipped_text()}" if n else ""
    each = dict(
        sizes=tuple(it.size for it in result.items),
        item_repeats=tuple(it.repeats for it in result.items),
        notes=tuple(result.notes),
    )
    if result.format != "kohya":
        return DatasetCount(
            images=result.num_images,
            repeats=1,
            images_per_epoch=per_epoch,
            layout=result.format,
            captions=result.num_captioned,
            skipped=skipped,
            **each,
        )
    groups: dict[str, list[int]] = {}
    for item in result.items:
        folder = item.path.relative_to(result.root).parts[0]
        groups.setdefault(folder, []).append(item.repeats)
    folders = tuple((name, reps[0], len(reps)) for name, reps in sorted(groups.items()))
    kinds = {r for _, r, _ in folders}
    repeats = kinds.pop() if len(kinds) == 1 else 1  # unequal: images_per_epoch counts each folder's own
    return DatasetCount(
        images=result.num_images,
        repeats=repeats,
        images_per_epoch=per_epoch,
        layout="kohya",
        folders=folders,
        skipped=skipped,
        **each,
    )


# -- hardware --------------------------------------------------------------------------------------------

_COUNT = re.compile(r"^\s*(\d+)\s*[x×*]\s*(.+?)\s*$", re.IGNORECASE)
# "H100 SXM x8", "4090x2" (an x after a space or a digit), not "RTX 4090"
_COUNT_AFTER = re.compile(r"^\s*(.+?)(?:\s+|(?<=\d))[x×*]\s*(\d+)\s*$", re.IGNORECASE)


def parse_hardware(text: str, profiles: Profiles) -> planner.Hardware:
    """'2x RTX 4090', 'RTX 4090', 'H100 SXM x8', '4090x2' -> catalog hardware; unknown names raise UsageError."""
    if not text or not text.strip():
        raise UsageError("empty --hardware", fix="e.g. --hardware '2x RTX 4090'")
    name = text.strip()
    if "," in name:  # a list: one machine has one kind of GPU here; --compare plans each
        raise UsageError(
            f"--hardware {text!r}: one kind of GPU, as 'RTX 4090' or '2x RTX 4090'",
            fix=f'to plan for each of them, use --compare "{name}"',
        )
    readings = [(1, name)]  # a catalog name can read as a count too: "7900 XTX" is not 7900 x "TX"
    if m := _COUNT.match(name):
        readings.append((int(m.group(1)), m.group(2)))
    if m := _COUNT_AFTER.match(name):
        readings.append((int(m.group(2)), m.group(1)))
    # none names a GPU: the error says why, of a count in range where one is ("9999x2": unknown GPU '9999')
    counted = readings[1:] or readings
    fallback = next((r for r in counted if 1 <= r[0] <= 64), counted[0])
    count, name = next((r for r in readings if profiles.gpu_or_none(r[1]) is not None), fallback)
    if count < 1 or count > 64:
        raise UsageError(f"GPU count in {text!r} must be between 1 and 64")
    match = profiles.match_gpu(name, count=count)
    hw = planner.hardware_from_catalog(match.spec, count)
    return replace(hw, notes=(match.assumption,)) if match.assumption else hw


def hardware_from_machine(path: str | Path, profiles: Profiles) -> planner.Hardware:
    from sdplan.machine import Snapshot

    snap = Snapshot.load(path)
    return planner.hardware_from_snapshot(snap, profiles, source="file")


def hardware_from_probe(profiles: Profiles) -> planner.Hardware:
    from sdplan.probe.snapshot import probe

    return planner.hardware_from_snapshot(probe("."), profiles, source="probe")


# -- compute ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecommendInputs:
    method: str
    model: str | None = None  # None: not given (the default family, or a model.path=X setting's model)
    resolution: int | None = None
    dataset: str | None = None
    images: int | None = None
    repeats: int | None = None
    epochs: int | None = None
    max_steps: int | None = None  # training.max_steps, pinned (no flag of its own)
    hardware: str | None = None
    machine: str | None = None
    gpus: int | None = None
    settings: tuple[str, ...] = ()  # `key=value` sdplan.yaml settings, as `sdplan train` takes them: pinned
    out: str | None = None  # --out: the folder the plan is written to, the run's output.dir
    notes: tuple[str, ...] = ()  # said first among the plan's reasons (what --model turned out to be)
    sourced: bool = False  # model_source has read the model's files (model is its family)


# sdplan.yaml keys given on the command line instead (a pin would only repeat or contradict them)
_FLAG_KEYS = {"method": "--method", "model.family": "--model"}


def parse_pins(
    items: tuple[str, ...] | list[str],
    method: str,
    model: str,
    *,
    shared: bool = False,
    resolution: int | None = None,
) -> tuple[tuple, int | None]:
    """`key=value` sdplan.yaml settings -> (planner pins as (Settings field, value) pairs, a pinned
    data.resolution). Parsed and validated as `sdplan train` does (:func:`sdplan.config.apply_overrides`,
    :func:`sdplan.config.validate`: unknown keys, types, ranges, combinations; a setting only another method
    reads, :func:`sdplan.config.method_setting_problems`); keys that do not change the plan
    (training.learning_rate, ...) are only carried to the written config. ``shared``: the settings are pinned on
    every method's requests (`sdplan bench`): another method's (lora.rank) is left out of this one's pins.
    ``resolution``: the side the plan trains at unless data.resolution is pinned (what the settings are
    validated at: the aspect buckets' sides follow it)."""
    from sdplan import config as C
    from sdplan.settings import FIELD_FOR_KEY, Settings

    if not items:
        return (), None
    base = C.default_config()
    base["method"] = method
    base["model"]["family"] = model
    if resolution is not None:
        base["data"]["resolution"] = resolution
    given = C.override_keys(items)
    if "training.full_half_weights" in given and "training.precision" not in given:
        # the planner picks the precision; full bf16 weights leave it one (not the default's, checked below)
        base["training"]["precision"] = "bf16"
    data = C.apply_overrides(base, list(items))
    cfg = C.validate(data, source="key=value settings")
    if not shared and (
        problems := C.method_setting_problems(method, given)
        + C.switched_setting_problems(cfg, items)
        + C.given_problems(cfg)
    ):
        raise C.ConfigError("key=value settings", problems)
    for key, flag in _FLAG_KEYS.items():
        if key in given and (cfg.method if key == "method" else cfg.model.family) != (
            method if key == "method" else model
        ):
            raise UsageError(f"{key}: give it with {flag}, not as a key=value setting")
    settings = Settings.from_config(cfg, model=model)
    pins: dict[str, object] = {}
    resolution = cfg.data.resolution if "data.resolution" in given else None
    for key in sorted(given):
        field = FIELD_FOR_KEY.get(key)
        if key.startswith("distributed.deepspeed"):
            field = "deepspeed"
        elif key.startswith("ema.") and field is None:  # ema.update_every has a field of its own
            field = "ema"
        if field is None or field in ("method", "model", "resolution"):
            continue
        if field.startswith("lora_") and method != "lora":
            continue  # shared with a LoRA request (refused above otherwise)
        value = getattr(settings, field)
        if field == "gpu_ids" and value is None:
            continue  # distributed.gpu_ids=null: sdplan chooses the GPUs, as without the key
        if field == "deepspeed" and value and not {"distributed.deepspeed", OFFLOAD_KEY} & set(given):
            # only the stage given: whether the optimizer state goes to the CPU stays the planner's to choose
            # (the section's default, true, pinned an offload nobody asked for: ~1.6 s a step on SDXL)
            value = {k: v for k, v in value.items() if k != "offload_optimizer"}
        pins[field] = value
    return tuple(pins.items()), resolution


OFFLOAD_KEY = "distributed.deepspeed.offload_optimizer"


# sdplan.yaml keys that size the run as a flag does: pinned, they count as that flag (and must agree with it)
_SIZING_KEYS = {
    "data.path": "--dataset",
    "data.repeats": "--repeats",
    "training.epochs": "--epochs",
    "training.max_steps": "--max-steps",
}


def _sizing_pins(inp: RecommendInputs, resolution: int) -> RecommendInputs:
    """``inp`` with its ``data.path`` / ``data.repeats`` / ``training.epochs`` / ``training.max_steps`` pins in
    the flags' places (the plan counted its steps without them, and `--out` wrote a config whose max_steps
    contradicted them; ``training.max_steps`` has no flag of its own)."""
    given = cfgmod.override_keys(inp.settings)
    keys = [key for key in _SIZING_KEYS if key in given]
    if not keys:
        return inp
    cfg = _pinned_config(inp, resolution)
    changes: dict[str, Any] = {}
    for key in keys:
        flag = _SIZING_KEYS[key]
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        field = flag.removeprefix("--").replace("-", "_")
        given_flag = getattr(inp, field)
        if given_flag is not None and cfgmod.setting_place(key, given_flag, flag) != cfgmod.setting_place(
            key, value, key
        ):
            raise UsageError(f"{flag} {given_flag} and {key}={value} disagree", fix="give one")
        changes[field] = str(value) if field == "dataset" else value
    return replace(inp, **changes)


def _setting_as_written(key: str, raw: str) -> Any:
    """A `key=raw` setting's value as the planned sdplan.yaml holds it: read as `sdplan train` reads it
    (:func:`sdplan.config.setting_value`), a path of :data:`sdplan.config.PATH_KEYS` made absolute as the
    config makes it (:func:`sdplan.config.setting_place`; model.path only where it is local, not a hub id)."""
    value = cfgmod.setting_value(key, raw)
    if key in cfgmod.PATH_KEYS and isinstance(value, str) and value.strip():
        return cfgmod.setting_place(key, raw, key)
    return value


def _pinned_config(inp: RecommendInputs, resolution: int) -> cfgmod.TrainConfig:
    """The sdplan.yaml the key=value settings make for this method and family at ``resolution`` (the plan's,
    :func:`_plan_resolution`, unless they pin data.resolution), validated as `sdplan train` validates it (what
    they set that the planner's pins do not carry: sizes, aspect buckets)."""
    base = cfgmod.default_config()
    base["method"], base["model"]["family"] = inp.method, inp.model
    base["data"]["resolution"] = resolution
    return cfgmod.validate(cfgmod.apply_overrides(base, list(inp.settings)), source="key=value settings")


def _plan_resolution(inp: RecommendInputs, profiles: Profiles) -> int:
    """The side the plan trains at unless data.resolution is pinned: --resolution, else the family's own (an
    epsilon model's is in --resolution's place: model_source). The written sdplan.yaml holds it, so the settings
    are validated at it (a bucket_min_size fine at SDXL's 1024 px was no fault of the default 512)."""
    return inp.resolution or profiles.model(inp.model).native_resolution


def _check_choice(kind: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise UsageError(f"unknown {kind} {value!r}", fix=f"{hint}one of: {', '.join(choices)}")


def _is_family_name(model: str, profiles: Profiles) -> bool:
    if model in profiles.models or model in FAMILIES:
        return True
    try:
        registry.family(model)  # an alias (flux) or another case
    except SdplanError:
        return False
    return True


def model_source(inp: RecommendInputs, profiles: Profiles) -> RecommendInputs:
    """``--model`` as `sdplan train` takes it: a family, or a diffusers folder, a .safetensors/.ckpt file or a
    hub id. A model's own files say its family (read without torch, as `sdplan train` checks them before
    launching); the plan is for that family and the written sdplan.yaml trains that model. Returns the inputs
    with the family in ``model``, ``model.path`` among the settings and a note (unchanged for a family name).
    A wrong model beside a wrong ``--dataset`` is one line with both, as `sdplan train` says them."""
    if inp.sourced:  # the command found it, and recommend() is asked with what it found
        return inp
    try:
        return replace(_model_source(_given_model(inp, profiles), profiles), sourced=True)
    except SdplanError as e:
        if inp.dataset:
            try:
                count_dataset(inp.dataset)
            except SdplanError as d:
                raise ConfigError("the dataset and the model", [str(d), str(e)]) from e
        raise


class UnknownFamily(UsageError):
    """A model whose family cannot be told here (a hub id not cached, with no hub to ask; a pickle whose keys
    cannot be read without loading it)."""


def _given_model(inp: RecommendInputs, profiles: Profiles) -> RecommendInputs:
    """The model as given: ``--model`` (None: not given), or a ``model.path=X`` setting, which alone is ``--model
    X`` (X a path or hub id, read as `sdplan train` reads the setting). Beside ``--model FAMILY`` (how a model
    whose family cannot be told here is given) ``X`` is checked as ``--model X`` would be, and where its files
    say another family that is an error: the plan and the written config were for the family named while the
    run trains another model. Beside ``--model X`` it must be the same model."""
    from sdplan.trainer.models import SINGLE_FILE_SUFFIXES

    raw = cfgmod.given_settings(inp.settings).get("model.path")
    if raw is None:
        return inp if inp.model is not None else replace(inp, model=registry.DEFAULT_FAMILY)
    value = cfgmod.setting_value("model.path", raw)
    if not value:
        raise UsageError("model.path is empty", fix="give the model as --model PATH_OR_ID")
    path = str(value)
    if os.path.exists(os.path.expanduser(path)):
        path = os.path.abspath(os.path.expanduser(path))
    elif "/" not in path and not path.lower().endswith(SINGLE_FILE_SUFFIXES):  # nor a hub id (owner/name)
        raise UsageError(  # a family name would plan that family's hub model
            f"model.path={path}: no such file or folder",
            fix="give a diffusers folder, a .safetensors/.ckpt file or a hub id (a family as --model FAMILY)",
        )
    rest = tuple(s for s in inp.settings if s.partition("=")[0].strip() != "model.path")
    if inp.model is None:
        return replace(inp, model=path, settings=rest)
    if not _is_family_name(inp.model, profiles):
        if cfgmod.setting_place("model.path", inp.model, "--model") == cfgmod.setting_place(
            "model.path", path, ""
        ):
            return replace(inp, settings=rest)
        raise UsageError(
            f"--model {inp.model} and model.path={path}: two models", fix="give the model once, as --model"
        )
    try:
        found = _model_source(replace(inp, model=path, settings=rest), profiles)
    except UnknownFamily:
        return inp  # the family given is what its files cannot say here
    if found.model != registry.family(inp.model).name:
        raise UsageError(
            f"model.path={path} is of the {found.model} family, and --model says {inp.model}",
            fix="drop --model (the model's files say its family), or give the model of that family",
        )
    return found


def _model_source(inp: RecommendInputs, profiles: Profiles) -> RecommendInputs:
    model = inp.model
    if _is_family_name(model, profiles):
        return inp
    local = os.path.expanduser(model)
    exists = os.path.exists(local)
    from sdplan.trainer.models import PICKLE_SUFFIXES, SINGLE_FILE_SUFFIXES, HubUnreachable
    from sdplan.trainer.source_check import check_source

    looks_like_source = exists or "/" in model or model.lower().endswith(SINGLE_FILE_SUFFIXES)
    if not looks_like_source:  # a typo of a family name: build_request names the closest one
        return inp

    path = os.path.abspath(local) if exists else model
    if exists and os.path.isfile(path) and path.lower().endswith(PICKLE_SUFFIXES):
        from sdplan.launcher import check_model_file

        check_model_file(Path(path))  # as `sdplan train`: a file that is no torch checkpoint at all says so
    pinned = _model_pins(inp)
    info = check_source(path, **pinned)
    family = info.family or (_listed_hub_family(model, profiles) if info.kind == "hub" else None)
    why = "a hub id that is not in the local cache"
    if not family and info.kind == "hub":
        try:  # its configs from the hub (a few KB, as `sdplan train` asks before its launch)
            info = check_source(path, hub=True, **pinned)  # its prediction type too (2-1-base plans at 512)
            family = info.family
        except HubUnreachable as e:
            why += f", and the hub cannot be asked ({e.why})"
    if not family:
        if info.kind == "file":
            why = f"a pickled checkpoint whose keys cannot be read without loading it: {info.unread}"
        raise UnknownFamily(
            f"--model {model}: cannot tell its family here ({why})",
            fix=f"give the family instead (one of: {', '.join(registry.PLANNED_FAMILIES)}), and "
            f"model.path={model}",
        )
    if family not in profiles.models:
        raise registry.not_planned(family)
    what = {"folder": "a diffusers folder", "file": "a single file", "hub": "a hub id"}.get(
        info.kind, info.kind
    )
    note = f"model {model}: {what} of the {family} family (planned as {family})"
    from sdplan.trainer.source_check import single_file_configs

    configs = single_file_configs(info.kind, family, pinned.get("config_dir"))
    if configs:
        note += f"; warning: {configs}"
    resolution = inp.resolution
    own = profiles.model(family).resolution_for(info.prediction_type)
    pinned = "data.resolution" in cfgmod.override_keys(inp.settings)
    if resolution is None and not pinned and own != profiles.model(family).native_resolution:
        resolution = own
        note += f"; {info.prediction_type}-prediction: planned at its {own} px (--resolution to change it)"
    return replace(
        inp,
        model=family,
        resolution=resolution,
        settings=(*inp.settings, f"model.path={path}"),
        notes=(*inp.notes, note),
    )


def _model_pins(inp: RecommendInputs) -> dict[str, Any]:
    """The ``model.config_dir`` / ``model.variant`` / ``model.revision`` the key=value settings give, as
    ``check_source`` takes them (`sdplan train` checks the model with them: a single SD3.5 / FLUX.1
    transformer needs its config_dir, which says its family)."""
    keys = ("config_dir", "variant", "revision")
    items = [s for s in inp.settings if s.partition("=")[0].strip() in {f"model.{k}" for k in keys}]
    if not items:
        return {}
    model = cfgmod.apply_overrides({}, items).get("model") or {}
    return {k: str(model[k]) for k in keys if model.get(k) is not None}


def _listed_hub_family(hub_id: str, profiles: Profiles) -> str | None:
    """The family whose profile lists ``hub_id`` (the ids `recommend --out` itself writes as model.path), for
    a hub id the local cache does not hold."""
    want = hub_id.lower()
    return next((m.family for m in profiles.models.values() if want in (h.lower() for h in m.hub_ids)), None)


def build_request(inp: RecommendInputs, profiles: Profiles) -> tuple[planner.Request, list[str]]:
    """Validate the command-line inputs; returns the planner request and notes for the reasons."""
    inp = replace(inp, method=registry.method(inp.method).name)  # an alias (ti) or another case (LoRA)
    if inp.model not in profiles.models and inp.model not in FAMILIES:  # an alias (flux) or a typo
        inp = replace(inp, model=registry.family(inp.model).name)
    if inp.model in FAMILIES and inp.model not in profiles.models:
        raise registry.not_planned(inp.model)
    _check_choice("model", inp.model, tuple(sorted(profiles.models)))
    for name, v in (
        ("--images", inp.images),
        ("--repeats", inp.repeats),
        ("--epochs", inp.epochs),
        ("--gpus", inp.gpus),
    ):
        if v is not None and v < 1:
            raise UsageError(f"{name} must be >= 1, got {v}")
    if inp.resolution is not None and not cfgmod.resolution_ok(inp.resolution):
        raise UsageError(f"--resolution {cfgmod.RESOLUTION_RULE}, got {inp.resolution}")
    if inp.resolution is not None:  # said of --resolution, before the settings are validated at it
        raw = cfgmod.given_settings(inp.settings).get("data.buckets")
        buckets = raw is not None and cfgmod.setting_value("data.buckets", raw) is True
        if problem := cfgmod.flow_resolution_problem(inp.resolution, inp.model, buckets=buckets):
            raise UsageError(problem)
    planned_resolution = _plan_resolution(inp, profiles)
    inp = _sizing_pins(inp, planned_resolution)
    if inp.dataset and inp.images is not None:
        raise UsageError("give --dataset or --images, not both")
    if inp.hardware is not None and inp.machine is not None:
        raise UsageError("give --hardware or --machine, not both")
    notes = list(inp.notes)
    if inp.dataset:
        from sdplan.trainer.dataset_scan import count_of

        # read as `sdplan train` reads it: the pinned data settings (caption extension, metadata filters), the
        # flat folder's repeats on each image (the aspect buckets' samples count them)
        data = _pinned_config(inp, planned_resolution).data
        ds = count_dataset(inp.dataset, replace(data, repeats=inp.repeats or data.repeats))
        images, repeats, per_epoch = ds.images, ds.repeats, None  # None: images x repeats
        counted = ds
        if ds.layout == "kohya":  # each folder's own repeats
            per_epoch = ds.images_per_epoch
            desc = ", ".join(f"{n} ({count_of(n_img, 'image')} x {r})" for n, r, n_img in ds.folders)
            notes.append(
                f"dataset {inp.dataset}: kohya folders {desc} = {ds.images_per_epoch} images per epoch"
            )
            if inp.repeats is not None:
                which = (
                    "data.repeats" if "data.repeats" in cfgmod.override_keys(inp.settings) else "--repeats"
                )
                notes.append(f"{which} {inp.repeats} ignored: kohya folder names carry the repeats")
        else:
            repeats = inp.repeats or 1
            captioned = "captioned"  # .txt files or a kohya captions file
            notes.append(f"dataset {inp.dataset}: {count_of(ds.images, 'image')} ({ds.captions} {captioned})")
        notes += [f"dataset {inp.dataset}: {note}" for note in ds.notes]
        if ds.skipped:  # as `sdplan train` would say: a file left out is no surprise later
            notes.append(f"dataset {inp.dataset}: {ds.skipped}")
    else:
        images, repeats, per_epoch = inp.images or DEFAULT_IMAGES, inp.repeats or 1, None
        counted = None
        if inp.images is None:
            notes.append(
                f"{NO_DATASET_NOTE}: planned for {DEFAULT_IMAGES} images (the steps and time are for "
                f"{DEFAULT_IMAGES}; a run trains its epochs over the dataset it is given)"
            )
    epochs = inp.epochs or DEFAULT_EPOCHS
    pins, pinned_resolution = parse_pins(inp.settings, inp.method, inp.model, resolution=planned_resolution)
    resolution = inp.resolution
    if pinned_resolution is not None:
        if resolution is not None and resolution != pinned_resolution:
            raise UsageError(
                f"--resolution {resolution} and data.resolution={pinned_resolution} disagree", fix="give one"
            )
        resolution = pinned_resolution
    fields = dict(pins)
    # the config the settings make, read where they set what the plan depends on beyond its pins: aspect buckets
    # (the steps and sides differ), the class images trained alongside and what the run samples (num_class_images,
    # the class folder, sampling.*), as `sdplan train` reads them; the defaults' where none is set
    keys = cfgmod.override_keys(inp.settings)
    bucketing = any(k.startswith("data.bucket") for k in keys)
    sampling_pinned = any(k.startswith(("sampling.", "dreambooth.", "output.")) for k in keys)
    read = bucketing or fields.get("prior_preservation") or sampling_pinned
    pinned_cfg = _pinned_config(inp, planned_resolution) if read else cfgmod.TrainConfig(method=inp.method)
    data = pinned_cfg.data if bucketing else None
    if resolution is not None and (
        problem := cfgmod.flow_resolution_problem(resolution, inp.model, buckets=bool(data and data.buckets))
    ):
        raise UsageError(problem)
    if inp.out is not None and "output.dir" not in keys:  # --out: the run's folder (trainer_config writes it)
        pinned_cfg.output.dir = str(inp.out)
    prior, class_images = cfgmod.prior_preservation(pinned_cfg)
    req = planner.Request(
        method=inp.method,
        model=inp.model,
        resolution=resolution,
        images=images,
        repeats=repeats,
        images_per_epoch=per_epoch,
        epochs=epochs,
        max_gpus=inp.gpus,
        lora_rank=fields.get("lora_rank") or planner.Request.lora_rank,
        prior_preservation=prior,
        class_images=class_images,
        **cfgmod.planned_sampling(pinned_cfg),
        max_steps=inp.max_steps,
        bucket_samples=_bucket_samples(
            counted, data, resolution or profiles.model(inp.model).native_resolution
        ),
        pins=pins,
    )
    return req, notes


def given_reasons(reasons: tuple[str, ...], settings) -> tuple[str, ...]:
    """The plan's reasons with every key=value setting given said in its "pinned:" reason: the planner's names
    those it plans around (lora.rank, the batch, ...); the others (the learning rate, the scheduler, the seed,
    data.buckets, sampling.*) went to --json and the written sdplan.yaml without a word here. Each as typed."""
    pinned = next((i for i, r in enumerate(reasons) if r.startswith("pinned: ")), None)
    shown = reasons[pinned] if pinned is not None else ""
    rest = [
        f"{key}={raw.strip()}"
        for key, raw in cfgmod.given_settings(settings).items()
        # model.path: --model's (model_source puts it among the settings), which the plan's first line names
        if key != "model.path" and not _said_in(key, shown)
    ]
    if not rest:
        return reasons
    if pinned is None:
        return (f"settings: {', '.join(rest)} (written to the run's sdplan.yaml)", *reasons)
    return (
        *reasons[:pinned],
        f"{shown}; also set: {', '.join(rest)}",
        *reasons[pinned + 1 :],
    )


def _said_in(key: str, text: str) -> bool:
    """Whether ``text`` sets ``key`` or the section that holds it (distributed.deepspeed={zero_stage: 1})."""
    parts = key.split(".")
    return any(
        re.search(r"(?<![\w.])" + re.escape(".".join(parts[:n])) + "=", text)
        for n in range(1, len(parts) + 1)
    )


def _bucket_samples(ds: DatasetCount | None, data: Any, resolution: int) -> tuple[int, ...]:
    """With data.buckets pinned (``data``: the pinned data section) and the dataset counted: the samples in each
    aspect bucket, as the trainer's dataset assigns them (the steps of an epoch: each bucket ends in a short
    batch; the plan counted 2 steps an epoch where the trainer ran 7). () otherwise."""
    if ds is None or data is None or not data.buckets:
        return ()
    from sdplan.trainer.buckets import bucket_samples, config_buckets

    return bucket_samples(ds.sizes, ds.item_repeats, config_buckets(data, resolution))


def resolve_hardware(inp: RecommendInputs, profiles: Profiles) -> planner.Hardware:
    if inp.hardware is not None:  # "" is a mistake to name, not "probe this machine"
        return parse_hardware(inp.hardware, profiles)
    if inp.machine:
        return hardware_from_machine(inp.machine, profiles)
    return hardware_from_probe(profiles)


def recommend(
    inp: RecommendInputs, profiles: Profiles, hardware: planner.Hardware | None = None, *, strict: bool = True
):
    """-> (the `--json` dict, the planner Result). ``strict``: a pin this hardware cannot run at all (bf16 on
    a GPU without it, more processes than GPUs) is a UsageError; --compare shows it as a row that does not fit.
    With a plan, the dict's ``config`` is the sdplan.yaml `--out` writes (pins included as given)."""
    inp = model_source(inp, profiles)
    req, notes = build_request(inp, profiles)
    hw = hardware if hardware is not None else resolve_hardware(inp, profiles)
    if inp.gpus is not None and inp.gpus > hw.count:
        if not hw.count:  # was planned as if not given
            raise UsageError(
                f"--gpus {inp.gpus}: this machine has no GPU",
                fix=f'plan for GPUs it does not have with --hardware "{inp.gpus}x RTX 4090" (any GPU name)',
            )
        hidden = f" ({hw.hidden_by} hides {planner.count_text(len(hw.hidden), 'other')})" if hw.hidden else ""
        raise UsageError(
            f"--gpus {inp.gpus}: this hardware has {planner.count_text(hw.count, 'GPU')}{hidden}"
        )
    res = planner.plan(hw, profiles, req)
    if strict and res.pin_conflicts:
        raise UsageError(res.pin_conflicts[0])
    res = replace(res, reasons=tuple(notes) + given_reasons(res.reasons, inp.settings))
    d = planner.result_dict(res)
    # every key=value setting as read (request.pins holds those the planner plans around; the learning rate,
    # max_steps and the like only go to the config), a path as the config names it: absolute (a relative one
    # read from another folder named other files)
    d["request"]["settings"] = {
        key: _setting_as_written(key, raw) for key, raw in cfgmod.given_settings(inp.settings).items()
    }
    d["config"] = (
        trainer_config(res, profiles, inp.dataset, overrides=inp.settings) if res.plan is not None else None
    )
    # an EMA that never updates in the run's steps, refused as `sdplan train --config` of the written file would;
    # where the steps are for an assumed image count (no dataset counted: no max_steps written), not said
    counted = d["config"] is not None and d["config"]["training"].get("max_steps") is not None
    steps = d["steps"]["total_steps"]  # one process's optimizer steps (max_steps is written for the world)
    if counted and (refusal := cfgmod.ema_refusal(cfgmod.validate(d["config"]), steps)):
        raise UsageError(refusal[0], fix=refusal[1])
    return d, res


def compare(
    inp: RecommendInputs, profiles: Profiles, options: list[str]
) -> list[tuple[str, dict, planner.Result]]:
    rows = []
    for text in options:
        hw = parse_hardware(text, profiles)
        d, res = recommend(
            replace(inp, hardware=text, machine=None, gpus=None), profiles, hardware=hw, strict=False
        )
        rows.append((text, d, res))
    return rows


# -- output files ----------------------------------------------------------------------------------------


def trainer_config(
    res: planner.Result,
    profiles: Profiles,
    dataset: str | None,
    overrides: tuple[str, ...] | list[str] = (),
    *,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """The sdplan.yaml for this plan: defaults, the planner's settings, then the user's key=value settings
    (as `sdplan train` applies them). ``out``: the folder it is written to, which is then the run's
    output.dir. Its places are absolute, as `sdplan train` writes them: `sdplan train --config
    OUT/sdplan.yaml` trains the same dataset into OUT from any folder. The planned step count is written as
    training.max_steps only where the plan counted the dataset itself (--dataset or data.path=...): a plan
    for an assumed image count (none given, or --images) trains its epochs over the dataset the run is given
    (steps.py counts them there), and its data.path stays the placeholder `sdplan train --dataset` replaces."""
    from sdplan import config as cfgmod

    s = res.plan
    assert s is not None
    model = profiles.model(s.model)
    data = cfgmod.merge(cfgmod.default_config(), s.to_config())  # the planner's settings (as `sdplan train`)
    data["model"]["path"] = model.hub_ids[0] if model.hub_ids else data["model"]["path"]
    data["data"]["path"] = dataset or data["data"]["path"]
    if out is not None:
        data["output"]["dir"] = str(out)
    data["data"]["repeats"] = res.request.repeats
    counted = dataset_counted(dataset, overrides)
    data["training"].update(
        epochs=res.steps.epochs,
        # a one-process count (steps.py): `sdplan train` divides it by the processes, back to the plan's steps
        max_steps=res.steps.total_steps * res.steps.num_processes if counted else None,
        lr_warmup_steps=res.steps.lr_warmup_steps,
    )
    d = planner.result_dict(res)
    data["plan"] = {
        "plan": d["plan"],
        "steps": d["steps"],
        "estimate": d["estimate"],
        "hardware": d["hardware"],
    }
    if overrides:
        data = cfgmod.apply_overrides(data, list(overrides))
    for section, key in (("model", "path"), ("model", "config_dir")):  # a hub id, or a file or folder here
        data[section][key] = _absolute(data[section][key], only_existing=True)
    for section, key, place, what in (
        ("data", "path", counted, "data.path"),
        ("output", "dir", out is not None, "--out"),
    ):
        if place:  # else data.path is the placeholder: there is no dataset yet
            data[section][key] = _absolute(data[section][key], what=what)
    # a place given as a setting (checkpoints.resume, a model.config_dir not made yet, ...): as request.settings
    # shows it, absolute as train makes it (the one function for both)
    for key, raw in cfgmod.given_settings(overrides).items():
        section, _, name = key.partition(".")
        if key in cfgmod.PATH_KEYS and isinstance(data.get(section), dict):
            data[section][name] = _setting_as_written(key, raw)
    cfg = cfgmod.validate(data, "sdplan.yaml (from the plan)")
    # the method's learning rate where none is pinned (a pinned 3e-4 is the number: config.setting_value)
    for key in ("learning_rate", "text_encoder_learning_rate"):
        if data["training"].get(key) is None:
            data["training"][key] = getattr(cfg.training, key)
    # a pinned lora.target_modules as train reads it (sorted, each once: the modules it names, in any order)
    data["lora"]["target_modules"] = cfg.lora.target_modules
    return data


def _absolute(path: Any, *, only_existing: bool = False, what: str = "") -> Any:
    """A local path made absolute as `sdplan train` writes --model, --dataset and --out. ``only_existing``:
    a path that names nothing here is left alone (a hub id), and an absolute one as given. ``what``: the flag or
    setting named where the path is a symbolic link that loops."""
    if not isinstance(path, str) or not path:
        return path
    if only_existing:
        return path if os.path.isabs(path) else cfgmod.absolute_if_local(path)
    return str(cfgmod.absolute(path, what))


def dataset_counted(dataset: str | None, overrides: tuple[str, ...] | list[str] = ()) -> bool:
    """Whether the plan counted the real dataset (--dataset, or data.path=... which counts as it), rather than
    an assumed image count."""
    return bool(dataset) or "data.path" in cfgmod.override_keys(overrides)


def run_command(out: str | Path, *, dataset_given: bool) -> str:
    """The `sdplan train` line for a written plan; one without a dataset says the run still needs one."""
    line = f"sdplan train --config {out}"
    if dataset_given:
        return line
    return (
        f"{line} --dataset DIR (needed: the folder of training images; no --dataset was given here, so "
        "data.path in sdplan.yaml is only a placeholder; or give data.path=DIR)"
    )


def planned_devices(hw: planner.Hardware, ids: tuple[int, ...] | None) -> dict[str, str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` for the GPUs a plan names (a machine whose GPUs differ): their NVML UUIDs, which
    CUDA takes in any device order, as ``sdplan train`` shows them (:meth:`sdplan.machine.Snapshot.
    visible_devices`); without UUIDs, on GPUs all alike, their indices. None where the plan names none, or a
    GPU's UUID is unknown on GPUs that differ (a hand-written snapshot; an index there would be counted in CUDA's
    fastest-first order): ``sdplan train`` chooses them from the sdplan.yaml's ``distributed.gpu_ids``."""
    from sdplan.machine import nvidia_uuid

    if not ids:
        return None
    by_index = {g.index: g for g in hw.gpus}
    uuids = [by_index[i].uuid if i in by_index else None for i in ids]
    if all(nvidia_uuid(u) for u in uuids):
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(u) for u in uuids)}
    if len({g.name for g in hw.gpus}) == 1 and all(i in by_index for i in ids):
        # GPUs alike (a catalog "2x RTX 4090"): CUDA's fastest-first order has no faster one to put first, so
        # its indices are the bus order's (else `accelerate launch` took GPU 0 for a pinned GPU 1: "all")
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)}
    return None


def write_outputs(
    out: str | Path,
    res: planner.Result,
    profiles: Profiles,
    *,
    dataset: str | None,
    force: bool,
    overrides: tuple[str, ...] | list[str] = (),
) -> tuple[list[Path], list[Path]]:
    """Write sdplan.yaml, accelerate.yaml, (with offload) deepspeed.json and plan.png (sdplan.plan_chart);
    never overwrite without force, never a user's file. Returns (written, copies kept of the user's edits:
    ``runfolder.write_files``)."""
    import yaml

    from sdplan import config as cfgmod
    from sdplan.launch import DEEPSPEED_FILE, accelerate_config, accelerate_gpu_ids, deepspeed_config

    if res.plan is None:
        raise UsageError(
            "nothing to write: no configuration fits this hardware", fix="see the suggested hardware"
        )
    outdir = Path(out)
    files: dict[str, str | bytes] = {}
    cfg = trainer_config(res, profiles, dataset, overrides=overrides, out=outdir)
    config_file = shlex.quote(str(outdir.resolve() / "sdplan.yaml"))  # the file may be read from anywhere
    given = dataset_counted(dataset, overrides)
    header = (
        f"sdplan.yaml written by `sdplan recommend` for {res.hardware.label or 'this machine'}\n"
        f"run it with: {run_command(config_file, dataset_given=given)}"
    )
    files["sdplan.yaml"] = cfgmod.to_yaml(cfg, header)
    # The same builders `sdplan train` uses, from the validated trainer config.
    train_cfg = cfgmod.validate(cfg, source="the planned sdplan.yaml")
    acc = accelerate_config(
        train_cfg,
        deepspeed_file=str((outdir / DEEPSPEED_FILE).resolve()),
        gpu_ids=accelerate_gpu_ids(planned_devices(res.hardware, res.plan.gpu_ids)),
    )
    files["accelerate.yaml"] = yaml.safe_dump(acc, sort_keys=False)
    ds = deepspeed_config(train_cfg)
    if ds is not None:
        files[DEEPSPEED_FILE] = json.dumps(ds, indent=2) + "\n"
    from sdplan import plan_chart

    files[plan_chart.FILE_NAME] = plan_chart.render_png(plan_chart.chart_data(res, profiles))
    if outdir.exists() and not outdir.is_dir():
        raise OutputExistsError(
            f"--out {outdir} exists and is not a folder",
            fix="give --out a new or empty folder for the plan's files",
        )
    from sdplan.launcher import check_out_not_in_dataset

    check_out_not_in_dataset(outdir, cfg["data"]["path"])  # `sdplan train` would refuse the file written
    from sdplan import runfolder
    from sdplan.launcher import PLAN_FILES

    # a run training there (before its first checkpoint its manifest names no trained file: --force replaced the
    # sdplan.yaml it was started with)
    runfolder.check_free(outdir)
    # never a user's own sdplan.yaml, --force or not (so --force is not offered for one)
    runfolder.check_not_ours(outdir, files, fix="choose another --out")
    existing = [n for n in files if (outdir / n).exists()]
    if existing and not force:
        raise OutputExistsError(
            f"{outdir} already holds {', '.join(existing)} from an earlier plan",
            fix="pass --force to replace them",
        )

    trained = sorted(e for e in runfolder.owned(outdir) - set(PLAN_FILES) if (outdir / e).exists())
    if (
        existing and trained
    ):  # --force replaces a plan, not the settings a run's checkpoints were trained with
        raise OutputExistsError(
            f"{outdir} holds an sdplan training run ({', '.join(trained[:4])}): a new sdplan.yaml there would "
            "leave its checkpoints without the settings they were trained with",
            fix="choose another --out; continue that run with `sdplan train --resume --out DIR`",
        )
    # the run folder's manifest: `train --force` may later replace only these; an edited plan is kept aside
    return runfolder.write_files(
        outdir, files, retire=[DEEPSPEED_FILE]
    )  # an earlier plan's, if this has none


# -- render ----------------------------------------------------------------------------------------------


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / GiB:.1f} GiB"


def _dur(s: float | None) -> str:
    return "unknown" if s is None else planner.format_duration(s)


def _range(value: float | None, rng: list | None, *, seconds: bool = False) -> str:
    """'15.9 GiB (likely 14.2-18.1)', '13 min (likely 9 min to 23 min)'."""
    if value is None:
        return "-" if not seconds else "unknown"
    if not rng:
        return _dur(value) if seconds else _gib(value)
    return planner.format_range(value, (rng[0], rng[1]), unit="s" if seconds else "GiB")


def _compact(value: float | None, rng: list | None, *, seconds: bool = False) -> str:
    """'9.8 GiB (8.1-13.6)', '5 min (4 min-10 min)': the compare table's short form."""
    if value is None:
        return "-"
    if seconds:
        return _dur(value) + (f" ({_dur(rng[0])}-{_dur(rng[1])})" if rng else "")
    return _gib(value) + (f" ({rng[0] / GiB:.1f}-{rng[1] / GiB:.1f})" if rng else "")


def no_gpu_hint(d: dict, res: planner.Result) -> str | None:
    """On a machine with no GPU (as probed) nothing fits: how to plan for the card the user will train on."""
    if d["feasible"] or res.hardware.count or res.hardware.source == "catalog":
        return None
    name = next(iter((d["needs"] or {}).get("suggested_hardware") or ()), "RTX 4090")
    return (
        f'this machine has no GPU: plan for the one you will train on with --hardware "{name}" (any GPU name, '
        '"2x ..." for several), or --machine FILE with `sdplan doctor --save FILE` from that machine'
    )


def render(d: dict, res: planner.Result, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    req = d["request"]
    hw = res.hardware
    title = f"{req['method']} {req['model']} at {req['resolution']}px on {hw.label or 'no GPU'} ({d['hardware']['source']})"
    console.print(f"[bold]{escape(title)}[/]")
    if d["feasible"]:
        est, st = d["estimate"], d["steps"]
        t = Table(show_header=False, box=None, pad_edge=False)
        t.add_row("plan", describe(res.plan, gpus=True, short=True))
        peak = f"{_range(est['peak_vram_bytes'], est['peak_vram_bytes_range'])} per GPU (of {_gib(res.vram_bytes)})"
        if est["within_upper_bound"] is False:
            peak += " [yellow]may not fit: the upper end is over the card[/]"
        t.add_row("peak VRAM", peak)
        t.add_row("host RAM", _gib(est["ram_bytes"]))
        # the transformer families' "weakly_calibrated" basis: an efficiency fitted on few published speeds
        basis = est["basis"].replace("_", " ")
        t.add_row("time", f"{_range(est['seconds'], est['seconds_range'], seconds=True)} ({basis})")
        if est["it_per_s"]:
            t.add_row(
                "speed",
                # the largest batch the trainer forms, as the step was sized (20 images at batch 64: 20)
                f"{est['it_per_s']:.2f} it/s per process (one micro-batch of {res.steps.largest_batch})",
            )
        if res.speedup_vs_one_gpu and d["plan"]["num_gpus"] > 1:  # unrounded: the reasons' own figure
            t.add_row("vs one GPU", planner.speed_ratio_text(res.speedup_vs_one_gpu))
        whole = st["images_per_epoch"] * st["epochs"]
        count = planner.count_text
        # "up to" where training.max_steps stops inside an epoch whose short batches can fall among its steps
        per_epoch, images_seen = count(st["images_per_epoch"], "image"), res.steps.images_seen_text()
        seen = (
            f"{per_epoch}/epoch x {count(st['epochs'], 'epoch')} = {images_seen} seen"
            if whole == st["images_seen"]  # training.max_steps can stop inside the last epoch
            else f"{per_epoch}/epoch, {images_seen} seen ({count(st['epochs'], 'epoch')}, the last cut short by "
            "training.max_steps)"
        )
        t.add_row(
            "steps",
            f"{seen}; {count(st['steps_per_epoch'], 'step')}/epoch, {count(st['total_steps'], 'optimizer step')} per "
            "process",
        )
        console.print(t)
    else:
        needs = d["needs"] or {}
        # the model says it fits; a measured out of memory says not (see the reasons)
        if needs.get("observed_oom"):
            console.print(
                "[bold red]does not fit[/]: it, or a configuration the model puts within 5% of its memory, ran out "
                "of GPU memory when measured on this GPU"
            )
        elif needs.get("min_vram_bytes") is None:  # the host RAM blocks every configuration (see the reasons)
            console.print("[bold red]does not fit[/]: this machine's host RAM is too small for it")
        else:
            mixed = needs.get("min_vram_bytes_mixed_precision")
            per_gpu = " per GPU" if (planner.pinned_gpu_count(res.request) or 1) > 1 else ""
            risky = needs.get("min_vram_bytes_may_run_out")
            console.print(
                f"[bold red]does not fit[/]: needs at least {_gib(needs.get('min_vram_bytes'))} of GPU memory"
                + per_gpu
                + (f" in fp32 ({_gib(mixed)} on a GPU that trains in fp16 mixed precision)" if mixed else "")
                + (
                    f" (from {_gib(risky)} a plan is given that may run out: its estimate fits, its likely range "
                    "does not)"
                    if risky and not mixed
                    else ""
                )
            )
        if needs.get("fits_after_install"):  # this GPU would do, after an install (see the reasons)
            console.print(
                "fits this GPU after: "
                + " or ".join(
                    f"`{fix['install']}` (an {fix['base_precision']} base)"
                    for fix in needs["fits_after_install"]
                ),
                markup=False,
            )
        if needs.get("suggested_hardware"):
            own = set(needs.get("suggested_by_own_peaks") or ())
            console.print(
                "would fit: "
                + ", ".join(
                    h + (" (by its own sdplan bench peaks)" if h in own else "")
                    for h in needs["suggested_hardware"]
                ),
                markup=False,
            )
        if hint := no_gpu_hint(d, res):
            console.print(hint, markup=False, soft_wrap=True)
    console.print("[bold]why[/]")
    _print_reasons(d["reasons"], console)


def _print_reasons(reasons: list[str], console) -> None:
    """The plan's reasons as a list. On a terminal each wraps to its width with a hanging indent (a grid, as
    the summary's table wraps its values); piped (a log, grep), each stays one line."""
    from rich.table import Table
    from rich.text import Text

    if not console.is_terminal:
        for r in reasons:
            console.print(f"  - {r}", soft_wrap=True, markup=False)
        return
    grid = Table.grid()
    grid.add_column(no_wrap=True)  # "  - ": the continuation lines start under the reason's first word
    grid.add_column(overflow="fold")  # a word wider than the terminal (a long path) breaks, never spills
    for r in reasons:
        grid.add_row("  - ", Text(r))  # Text: a reason's "[dev]" is no markup
    console.print(grid)


COMPARE_COLUMNS = ("hardware", "fits", "settings", "peak VRAM (likely)", "time (likely)", "vs 1 GPU")


def render_compare(rows: list[tuple[str, dict, planner.Result]], console) -> None:
    """The hardware options as a table; as a list, one option under another, where the terminal is narrower
    than the table's narrowest layout (at 40 or 60 columns its cells were cut to 'y…', '(7.0-…')."""
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    cells = [_compare_cells(d, res, text) for text, d, res in rows]
    caption = compare_caption(rows)
    t = Table(title="hardware options", caption=caption, caption_justify="left")
    t.add_column(COMPARE_COLUMNS[0], no_wrap=True)
    for col in COMPARE_COLUMNS[1:]:
        # rich narrows the widest columns below their longest word where the table is wider than the terminal:
        # such a word breaks onto the next line, never cut to '…' (a pin's fix read "training.prec…")
        t.add_column(col, overflow="fold")
    for row in cells:
        t.add_row(*(Text(c) for c in row))
    # the narrowest it can be laid out (measured unclamped: rich clamps a measurement to the console's width)
    if console.measure(t, options=console.options.update_width(2**16)).minimum <= console.width:
        console.print(t)
        return
    console.print("hardware options", markup=False)
    if caption:
        console.print(Padding(Text(caption), (0, 0, 0, 2), expand=False))
    for hardware, *values in cells:
        console.print(Text(hardware, style="bold"))
        for name, value in zip(COMPARE_COLUMNS[1:], values):
            if value != "-":
                console.print(Padding(Text(f"{name}: {value}"), (0, 0, 0, 2), expand=False))


def compare_caption(rows: list[tuple[str, dict, planner.Result]]) -> str:
    """What the times are for: the images and epochs every option was planned with, and, where neither
    --dataset nor --images was given, that they are the default's (a table of "84 s" fine-tunes read as the time
    of a fine-tune, of 20 images)."""
    if not rows:
        return ""
    res = rows[0][2]
    req = res.request
    per_epoch = req.images_per_epoch or req.images * req.repeats
    count = planner.count_text
    what = count(per_epoch, "image") + (f" ({req.images} x {req.repeats} repeats)" if req.repeats > 1 else "")
    if req.max_steps:
        # the steps are set: the epochs and images seen are each plan's, by its global batch
        seen = sorted({(r.steps.images_seen, r.steps.epochs) for _, _, r in rows if r.plan is not None})
        # a multi-GPU option divides the one-GPU steps among its GPUs (the steps reason's "counts one process's
        # steps"): the caption says so, with the steps each option plans, as its own steps line says them
        split = sorted({(r.plan.num_gpus, r.steps.total_steps) for _, _, r in rows if r.plan is not None})
        if any(n > 1 for n, _ in split):
            each = ", ".join(f"{t} on 1 GPU" if n == 1 else f"{t} per GPU on {n}" for n, t in split)
            text = (
                f"times: {req.max_steps} one-GPU steps (training.max_steps), divided among each option's GPUs: "
                f"{each}; over {what} per epoch"
            )
        else:
            text = (
                f"times: {count(req.max_steps, 'optimizer step')} (training.max_steps) over {what} per epoch"
            )
        # "up to" where an option's steps stop inside an epoch whose short batches can fall among them
        up = (
            "up to "
            if any(r.steps.images_seen_min < r.steps.images_seen for _, _, r in rows if r.plan)
            else ""
        )
        if len(seen) == 1:
            text += f": {up}{count(seen[0][0], 'image')} seen ({count(seen[0][1], 'epoch')})"
        elif seen:
            text += f": {up}{seen[0][0]}-{seen[-1][0]} images seen, by each option's global batch"
    else:
        text = f"times: {what} per epoch x {count(req.epochs, 'epoch')}"
    if any(r.startswith(NO_DATASET_NOTE) for r in res.reasons):
        text += f" (planned for {DEFAULT_IMAGES} images: pass --images N or --dataset DIR for your run's)"
    classes = planner.sampled_images(req, res.steps).classes  # the same in each option: generated first
    if classes:
        text += f"; each includes {planner.count_text(classes, 'class image')} generated first"
    return text


def _compare_cells(d: dict, res: planner.Result, text: str) -> tuple[str, ...]:
    """One hardware option's cells, in :data:`COMPARE_COLUMNS` order, as plain text."""
    est = d["estimate"] or {}
    if res.pin_conflicts:
        return (text, "no", res.pin_conflicts[0], "-", "-", "-")
    return (
        text,
        "yes" if d["feasible"] else "no",
        describe(res.plan, gpus=True, short=True)
        if d["feasible"]
        else (
            f"needs {_gib(need)}"
            + (" in fp32" if (d["needs"] or {}).get("min_vram_bytes_mixed_precision") else "")
            + (
                f" (may run out from {_gib(risky)})"
                if (risky := (d["needs"] or {}).get("min_vram_bytes_may_run_out"))
                and not (d["needs"] or {}).get("min_vram_bytes_mixed_precision")
                else ""
            )
            if (need := (d["needs"] or {}).get("min_vram_bytes")) is not None
            else "measured out of memory"
            if (d["needs"] or {}).get("observed_oom")
            else "needs more host RAM"
        ),
        _compact(est.get("peak_vram_bytes"), est.get("peak_vram_bytes_range"))
        + ("" if est.get("within_upper_bound") is not False else " may not fit"),
        _compact(est.get("seconds"), est.get("seconds_range"), seconds=True) if d["feasible"] else "-",
        (f"{est['speedup_vs_one_gpu']:.2f}x" if est.get("speedup_vs_one_gpu") else "-") + _fewer_gpus(res),
    )


def _fewer_gpus(res: planner.Result) -> str:
    """For an option of N GPUs planned on fewer: how many it uses and why not all (the row read "2x RTX 4090 ...
    1.00x vs 1 GPU", its one GPU only in the settings)."""
    if res.plan is None or res.hardware.count <= res.plan.num_gpus:
        return ""
    used, n = res.plan.num_gpus, res.hardware.count
    text = f", uses {used} of {n} GPUs"
    req = res.request
    # a pinned count or pinned GPUs kept the others out, not their memory: the planner never tried all n
    for name in ("gpu_ids", "num_gpus"):
        if req.pinned(name):
            return text + f" ({planner.pin_text(name, req.pin(name))} is pinned)"
    alt = next((c for c in res.alternatives if c.setup.num_gpus == n), None)
    if alt is None:
        return text + f" ({n} do not fit)"
    best = next((c for c in res.alternatives if c.setup == res.plan), None)
    if alt.seconds is None or best is None or best.seconds is None:
        return text
    # weighed as the planner weighs it (planner.speedup: with training.max_steps the runs see other images)
    return text + f" ({n}: {planner.run_time_text(alt, best)}, {planner.more_gpus_text(alt, best)})"
