"""Find the training images and their captions; list what cannot be used, once, with the reason.

Pure Python (PIL only inside ``verify``, imported there): ``sdplan recommend --dataset`` calls this to count
images fast, and ``sdplan train`` calls it to fail before any model loads.

Three layouts, detected in this order:

``metadata``
    One ``.json`` per image anywhere under the root, e.g. ``{"path": "img/0001.png", "tags": ["a", "b"],
    "score": 7}``. The image is named by ``image``, ``path`` or ``file_name``, relative to the root first,
    then to the json's own folder; without such a field, the image with the json's name beside it
    (``0001.json`` -> ``0001.png``). ``tags`` is a list or a comma-separated string; ``score`` a number
    (missing counts as 0). Chosen when at least one ``.json`` under the root is such a record.
    With :class:`~sdplan.config.MetadataConfig`, in this order:

    1. ``skip_tags``: an image having any of them is skipped (listed with the tag);
    2. ``score_bonus``: for each tag the image has, its bonus is added to the score;
    3. ``min_score``: an image whose score (after bonuses) is below it is skipped;
    4. ``remove_tags``: dropped from the caption;
    5. ``replace``: substring replacements in every tag (``{":": "="}``: ``rating:safe`` -> ``rating=safe``);
    6. ``score_buckets``: thresholds; the highest one the score reaches adds a ``score_N`` tag at the end
       (thresholds ``[5, 7, 9]``, score 8 -> ``score_7``; below all of them: no tag).

    A tag matches a ``skip_tags`` / ``remove_tags`` / ``score_bonus`` entry when they are equal as written or
    after ``replace`` (``rating:safe`` and ``rating=safe`` both match either way). The caption is the tags joined with ``", "``; ``Item.tags`` keeps the list so
    the dataset can shuffle it at load time (``shuffle_tags``: that happens per sample, not here). A record
    without tags uses its ``caption`` field if it has one. An image with its own caption file (``a.png`` +
    ``a.txt``) trains on that, its record only selecting it (``skip_tags``, ``min_score``; a note says so): a
    downloader's ``a.png.json`` does not replace a caption the user wrote. Images under the root that no json
    describes and that have no caption file are listed as skipped. Every image repeats ``repeats`` times.

``kohya``
    Subfolders named ``N_name`` (``10_sks dog``: 10 repeats). Images anywhere inside such a folder, caption
    in the same-name caption file beside them. An image without a caption file gets the folder's name part
    (``sks dog``) as its caption, as kohya's sd-scripts use it as the class/instance token; ``default_caption``
    does not apply there. ``2_`` is 2 repeats with no name, as kohya splits it (its uncaptioned images take the
    fallback caption; a note says so). Images directly in the root and folders not named ``N_name`` are listed as
    skipped. A root with no ``N_name`` folder whose subfolders hold some (kohya_ss's project: ``img/10_sks dog``,
    ``reg/1_dog``) is an error naming the folder to pass (and the class images' one as dreambooth.class_data).

``flat``
    Images anywhere under the root (subfolders included) with a same-name caption file beside them
    (``a.png`` + ``a.txt``, the extension in any case), or named in a kohya captions file at the root
    (``meta_cap.json``: image name -> ``{"caption": ..., "tags": ...}``) or in Hugging Face's ``metadata.jsonl``
    (``{"file_name": ..., "text": ...}`` per line) or ``metadata.csv`` (columns file_name, text), which come first. Without either: ``default_caption``, else
    ``None`` (the recipe then uses the instance prompt). Every image repeats ``repeats`` times.

Caption files: UTF-8 (a byte-order mark dropped) or UTF-16 with its mark; the first non-empty line, stripped
(as kohya reads them); an empty file counts as missing, and one in another encoding is an error naming it.
Images: png, jpg, jpeg, webp, bmp in any letter case. Files and folders whose names start with ``.`` are
ignored without a word; every other file that is neither a usable image nor a caption for one is listed in
``Scan.skipped`` with its reason, once, the broken images (``Scan.broken``) first. Zero-byte images are always skipped (a cheap ``stat``); with
``verify=True`` each image is also opened and decoded with PIL, so corrupt, truncated or mislabelled files are
skipped too, and ``Item.size`` records each image's ``(width, height)`` (aspect-ratio buckets use it). With
``verify="header"`` (``sdplan recommend``: about 1,000 files in 0.1 s) only each image's header is read: files
that are no image PIL can identify are skipped as the trainer skips them, a file broken further in is not.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import os
import re
import shlex
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdplan.errors import DatasetError

if TYPE_CHECKING:
    from sdplan.config import MetadataConfig, TrainConfig

# the broken images a skipped list names past its first reasons (Scan.skipped_text); the rest are counted
BROKEN_NAMED = 8
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
FORMATS = ("flat", "kohya", "metadata")
KOHYA_DIR = re.compile(r"^(\d+)_(.*)$")  # kohya splits at the first "_": 2_ is 2 repeats, no name
PATH_FIELDS = ("image", "path", "file_name")
_EXT_LIST = "png, jpg, jpeg, webp or bmp"
# images of formats sdplan does not read (phones' and cameras' own among them): skipped, said to convert
OTHER_IMAGE_EXTENSIONS = (
    ".heic",
    ".heif",
    ".avif",
    ".jxl",
    ".tif",
    ".tiff",
    ".gif",
    ".dng",
    ".cr2",
    ".nef",
    ".arw",
)


@dataclass
class Item:
    """One training image. ``caption`` None: no caption found (the recipe decides what to use)."""

    path: Path
    caption: str | None = None
    tags: list[str] | None = None  # metadata layout: the caption's tags, for shuffling at load time
    repeats: int = 1
    score: float | None = None  # metadata layout: score after bonuses
    size: tuple[int, int] | None = None  # (width, height); known after verify (or a header read)


@dataclass
class Scan:
    root: Path
    format: str  # flat | kohya | metadata
    items: list[Item] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (path, reason), each path once
    notes: list[str] = field(default_factory=list)  # what the layout made of something that looks unintended
    broken: set[Path] = field(
        default_factory=set
    )  # skipped images that are empty, unreadable or fail to decode

    @property
    def num_images(self) -> int:
        return len(self.items)

    @property
    def images_x_repeats(self) -> int:
        """Samples in one epoch: each image counted ``repeats`` times."""
        return sum(it.repeats for it in self.items)

    @property
    def num_captioned(self) -> int:
        return sum(1 for it in self.items if it.caption is not None)

    def skipped_text(self, limit: int = 3) -> str:
        """``a.png: truncated; b.png: empty file; 4 files (x.HEIC, y.HEIC, ...): not a supported image type
        (.heic); and 2 more (1 broken image: c.png)``: names relative to the root, the broken images first
        (:func:`scan` sorts them so), files skipped for the same reason said once, and the broken images named up
        to :data:`BROKEN_NAMED` (a corrupt photo hid in "and N more", behind the Thumbs.db and notes.md that came
        first by name; naming all of a thousand made the line 13 KB)."""
        groups: dict[tuple[str, Path | None], list[Path]] = {}  # a broken image each its own (all named)
        for p, why in self.skipped:
            groups.setdefault((why, p if p in self.broken else None), []).append(p)
        parts = []
        for (why, _), paths in list(groups.items())[:limit]:
            names = [_rel(p, self.root) for p in paths[:2]] + (["..."] if len(paths) > 2 else [])
            parts.append(
                f"{names[0]}: {why}" if len(paths) == 1 else f"{len(paths)} files ({', '.join(names)}): {why}"
            )
        rest = [p for paths in list(groups.values())[limit:] for p in paths]
        if rest:
            broken = [_rel(p, self.root) for p in rest if p in self.broken]
            shown = broken[:BROKEN_NAMED] + (
                [f"{len(broken) - BROKEN_NAMED} more"] if len(broken) > BROKEN_NAMED else []
            )
            named = f" ({count_of(len(broken), 'broken image')}: {', '.join(shown)})" if broken else ""
            parts.append(f"and {len(rest)} more{named}")
        return "; ".join(parts)

    def summary(self) -> str:
        """One line for the CLI: ``flat: 8 images x 2 repeats = 16 samples per epoch, 8 captioned``; kohya
        folders of different repeats: ``kohya: 13 images x their folders' repeats = 520 samples ...``."""
        kinds = {it.repeats for it in self.items}
        repeats = (
            f"{next(iter(kinds))} repeat{'s' if kinds != {1} else ''}"
            if len(kinds) == 1
            else "their folders' repeats"
        )
        text = (
            f"{self.format}: {count_of(self.num_images, 'image')}"
            f" x {repeats} = {count_of(self.images_x_repeats, 'sample')} per epoch, {self.num_captioned} captioned"
        )
        if self.skipped:
            text += f", {len(self.skipped)} skipped ({self.skipped_text()})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "format": self.format,
            "num_images": self.num_images,
            "images_x_repeats": self.images_x_repeats,
            "num_captioned": self.num_captioned,
            "skipped": [{"path": str(p), "reason": why} for p, why in self.skipped],
        }


def scan(
    root: str | os.PathLike[str],
    *,
    caption_extension: str = ".txt",
    default_caption: str | None = None,
    repeats: int = 1,
    metadata: MetadataConfig | None = None,
    verify: bool | str = False,
    setting: str = "--dataset",
) -> Scan:
    """Find the images under ``root`` and their captions (see the module doc for the layouts).

    Raises :class:`DatasetError` when ``root`` is missing or not a folder, a ``.json`` in it is not valid
    JSON (file, line and column), or a caption file is not UTF-8 / UTF-16 text; an empty or unreadable
    dataset is a :class:`Scan` with no items (``require_images`` turns that into an error).
    """
    from sdplan.config import expand_user, link_loops

    root = Path(expand_user(root, "dataset folder"))
    if not root.exists():
        why = "is a symbolic link that loops" if link_loops(root) else "does not exist"
        raise DatasetError(
            f"dataset folder {root} {why}",
            fix="give --dataset (data.path in sdplan.yaml) the folder that holds the training images",
        )
    if not root.is_dir():
        raise DatasetError(
            f"dataset path {root} is not a folder",
            fix="give --dataset (data.path in sdplan.yaml) the folder that holds the images, not one file",
        )
    if repeats < 1:
        raise DatasetError(f"repeats must be >= 1, got {repeats}", fix="set data.repeats to 1 or more")
    # as configured: matched in any case, the configured case read first (:func:`_caption_files`)
    cap_ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension

    files = _walk(root)
    records, is_metadata = _metadata_records(files)
    if is_metadata:
        result = _scan_metadata(root, files, records, repeats, metadata, cap_ext)
    elif _kohya_folders(root):
        result = _scan_kohya(root, files, cap_ext)
    elif project := _kohya_project(root, files, setting):
        raise project
    else:
        result = Scan(root, "flat")
        kohya_files, kohya = _kohya_captions(root, records, result)
        jsonl_files, jsonl = _jsonl_captions(root, files, result)
        listed = (kohya_files + jsonl_files, {**jsonl, **kohya})
        _pair_captions(root, files, result, cap_ext, repeats, lambda _p: default_caption, listed)

    listed = len(result.skipped)
    _drop_empty_files(result)
    if verify:
        _verify(result, decode=verify != "header")
    result.broken = {p for p, _ in result.skipped[listed:]}
    result.items.sort(key=lambda it: str(it.path))
    seen: set[Path] = set()
    result.skipped = [s for s in result.skipped if not (s[0] in seen or seen.add(s[0]))]
    result.skipped.sort(key=lambda s: (s[0] not in result.broken, str(s[0])))  # broken images first
    return result


def scan_data(data: Any, *, path: str | os.PathLike[str] | None = None, verify: bool | str = False) -> Scan:
    """:func:`scan` of an sdplan.yaml ``data:`` section with its own settings (caption extension, default
    caption, repeats, metadata filters): what the trainer's dataset, `sdplan train`'s check and `sdplan
    recommend --dataset` read alike. ``path``: another folder than ``data.path``."""
    return scan(
        data.path if path is None else path,
        caption_extension=data.caption_extension,
        default_caption=data.default_caption,
        repeats=data.repeats,
        metadata=data.metadata,
        verify=verify,
    )


def fallback_caption(cfg: TrainConfig) -> str:
    """Caption for an image with none: data.default_caption (already applied by the scan), else the
    instance prompt (textual inversion: ``a photo of <token>``), else ""."""
    if cfg.data.default_caption is not None:
        return cfg.data.default_caption
    if cfg.method == "textual-inversion":
        return f"a photo of {cfg.textual_inversion.token}"
    return cfg.dreambooth.instance_prompt or ""


def uncaptioned_note(result: Scan, cfg: TrainConfig) -> str:
    """What the images without a caption train with, for the plan's data line ("" when all have one): a LoRA
    of a dog from uncaptioned photos trained as 'a photo of sks person' without a word."""
    n = sum(1 for it in result.items if it.caption is None)
    if not n:
        return ""
    caption = fallback_caption(cfg)
    key = (
        "data.default_caption"  # a kohya 2_ folder's images (no name to caption them by) have none to use
        if cfg.data.default_caption is not None
        else "textual_inversion.token"
        if cfg.method == "textual-inversion"
        else "dreambooth.instance_prompt"
    )
    said = f"the caption {caption!r} (from {key})" if caption else "an empty caption"
    ext = cfg.data.caption_extension
    ext = ext if ext.startswith(".") else "." + ext
    change = (
        "add captions"
        if cfg.data.default_caption is not None
        else "set data.default_caption=... or add captions"
    )
    return f"{count_of(n, 'image')} without a {ext} caption train with {said}; {change} to change that"


def metadata_note(result: Scan, cfg: TrainConfig) -> str:
    """data.metadata.* set for a dataset without per-image .json records, whose tags and scores they act on (a
    kohya folder's or a flat folder's .txt captions, kohya's meta_cap.json): they did nothing, without a word
    ("" where they apply, or none is set)."""
    from dataclasses import asdict

    from sdplan.config import MetadataConfig

    if result.format == "metadata" or not isinstance(cfg.data.metadata, MetadataConfig):
        return ""
    default = asdict(MetadataConfig())
    given = [k for k, v in asdict(cfg.data.metadata).items() if v != default[k]]
    if not given:
        return ""
    keys = ", ".join(f"data.metadata.{k}" for k in given)
    return (
        f"{keys} act on the tags and scores of per-image .json records, which this {result.format} dataset does "
        "not have: ignored here"
    )


UPSCALE_NOTE = 2.0  # an image scaled up more than this many times to the training resolution is said


def small_images_note(result: Scan, resolution: int, *, buckets: bool = False) -> str:
    """The images a run scales up more than :data:`UPSCALE_NOTE` times to ``resolution`` (trainer.data: the
    short side to the square's side; with buckets, the area to the bucket's, about ``resolution`` squared), for
    the plan's data line: they train blurry. "" when none is, or sizes are unknown (a scan without verify)."""

    def upscale(size: tuple[int, int]) -> float:
        w, h = size
        return resolution / ((w * h) ** 0.5 if buckets else min(w, h))

    small = [it for it in result.items if it.size and upscale(it.size) > UPSCALE_NOTE]
    if not small:
        return ""
    worst = max(small, key=lambda it: upscale(it.size))
    w, h = worst.size
    return (
        f"{count_of(len(small), 'image')} {'is' if len(small) == 1 else 'are'} scaled up more than "
        f"{UPSCALE_NOTE:g}x to the {resolution} px training resolution (the smallest: {_rel(worst.path, result.root)}, "
        f"{w}x{h}): they train blurry; use larger images or a lower data.resolution"
    )


def require_images(result: Scan) -> Scan:
    """Raise :class:`DatasetError` when the scan found no usable image; return the scan otherwise."""
    if result.items:
        return result
    put = (
        f"put {_EXT_LIST} images there, each with an optional same-name .txt caption, "
        "or kohya-style N_name subfolders (10_name/a.png)"
    )
    if result.skipped:
        detail = f" ({len(result.skipped)} skipped: {result.skipped_text()})"
        # photos in a format sdplan does not read (an iPhone's .HEIC) are no broken files: they convert
        other = sorted(
            {p.suffix.lower() for p, _ in result.skipped if p.suffix.lower() in OTHER_IMAGE_EXTENSIONS}
        )
        fixes = ["replace or remove the broken files"] if result.broken else []
        fixes += [f"convert the {', '.join(other)} files to jpg or png"] if other else []
        fix = "; ".join(fixes)
        if result.format == "metadata":
            fix = ", or ".join(filter(None, (fix, "loosen data.metadata (skip_tags, min_score)")))
        elif result.format == "kohya" and all((Path(result.root) / p).is_dir() for p, _ in result.skipped):
            fix = "name each image folder N_name, N >= 1 its repeats (10_name/a.png)"  # no file is broken
        elif result.format == "kohya":
            fix = "; ".join(filter(None, (fix, "images belong in N_name folders (10_name/a.png)")))
        fix = fix or put
    else:
        detail = " (the folder has no image files)"
        fix = put
    raise DatasetError(f"no readable images in {result.root}{detail}", fix=fix)


def is_image(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def quiet_large_images() -> None:
    """Silence PIL's DecompressionBombWarning ("could be decompression bomb DOS attack", once per open) for
    a large photo of the user's own (a 100-megapixel camera's): images over PIL's hard limit are still
    refused (:func:`check_image` lists them as skipped)."""
    import warnings

    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)  # idempotent


def image_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(width, height) from the file's header (PIL opens lazily: no decode), after EXIF rotation."""
    from PIL import Image

    quiet_large_images()
    with Image.open(path) as im:
        w, h = im.size
        if _exif_rotated(im):
            w, h = h, w
        return w, h


# -- walking ------------------------------------------------------------------------------------------


def _walk(root: Path) -> list[Path]:
    """Every file under root, sorted; names starting with '.' (files and folders) left out. Symlinked
    folders are followed (``ln -s ~/photos/dog 10_dog`` is how many build a kohya dataset), except a link
    back to a folder above it, which would loop."""
    out: list[Path] = []
    above: dict[str, tuple[str, ...]] = {str(root): ()}  # folder -> the real paths of the folders above it
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        chain = (*above.pop(dirpath, ()), os.path.realpath(dirpath))
        keep = []
        for d in sorted(dirnames):
            sub = os.path.join(dirpath, d)
            if d.startswith(".") or os.path.realpath(sub) in chain:
                continue
            above[sub] = chain
            keep.append(d)
        dirnames[:] = keep
        base = Path(dirpath)
        out.extend(base / f for f in sorted(filenames) if not f.startswith("."))
    return out


def _real(path: str | os.PathLike[str]) -> Path:
    """``path`` through its links, as Path.resolve() gives it; a link that loops is left as it is (Path.resolve()
    raised RuntimeError on it: a traceback), for the scan to list as not used, as a dangling link is
    (:func:`_drop_empty_files`: it cannot be read)."""
    return Path(os.path.realpath(path))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


# caption files of the tools people use: one of another extension than data.caption_extension is not read
CAPTION_EXTENSIONS = (".txt", ".caption", ".tags")


def _not_image_reason(path: Path, cap_ext: str | None = None) -> str:
    ext = path.suffix.lower() or "no extension"
    if cap_ext is not None and ext in CAPTION_EXTENSIONS and ext != cap_ext.lower():
        return f"a {ext} caption, not read: data.caption_extension is {cap_ext}"
    if path.name.lower() in HF_METADATA:  # read in a flat folder (_jsonl_captions); not here
        return f"Hugging Face's {path.name}: read in a flat dataset folder, not in kohya N_name folders or beside .json records"
    if ext in OTHER_IMAGE_EXTENSIONS:
        return f"not a supported image type ({ext}); convert to jpg or png"
    return f"not a supported image type ({ext}); use {_EXT_LIST}"


def _read_caption(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    for line in _decode_caption(path, raw).splitlines():
        line = line.strip()
        if line:
            return line
    return None


def _decode_caption(path: Path, raw: bytes) -> str:
    """UTF-8 with or without a byte-order mark (Windows editors write one), or UTF-16 with its mark
    (Notepad's "Unicode"); anything else is an error naming the file: decoding it with replacement
    characters would train on a garbled caption without a word."""
    text = None
    # by byte-order mark, UTF-32's first: UTF-32 LE's mark begins with UTF-16 LE's
    marks = (
        ((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE), "utf-32"),
        ((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE), "utf-16"),
    )
    for boms, codec in marks:
        if text is None and raw.startswith(boms):
            with contextlib.suppress(UnicodeDecodeError):
                text = raw.decode(codec)
    if text is None:
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"caption {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})",
                fix="save it as UTF-8 (in most editors: Save as, encoding UTF-8)",
            ) from None
    if "\x00" in text:  # valid UTF-8, but UTF-16 without its byte-order mark: 'c\x00a\x00t\x00' trained as is
        raise DatasetError(
            f"caption {path} holds NUL bytes (UTF-16 text without a byte-order mark?)",
            fix="save it as UTF-8 (in most editors: Save as, encoding UTF-8)",
        )
    return text


def _caption_files(files: Iterable[Path], cap_ext: str, result: Scan) -> dict[tuple[Path, str], Path]:
    """(folder, stem) -> the caption file, its extension in any case (IMG_0001.JPG beside IMG_0001.TXT), as
    images are taken; of two differing in case only, the one in the configured case (``cap_ext``; else the
    first found), the other listed as skipped."""
    out: dict[tuple[Path, str], Path] = {}
    for f in files:
        if f.suffix.lower() != cap_ext.lower():
            continue
        key = (f.parent, f.stem)
        if key in out:
            keep, other = (
                (f, out[key]) if f.suffix == cap_ext and out[key].suffix != cap_ext else (out[key], f)
            )
            out[key] = keep
            result.skipped.append((other, f"another caption file of the same image ({keep.name} is read)"))
        else:
            out[key] = f
    return out


def _record_caption(record: dict[str, Any]) -> str | None:
    """A record's caption: its "caption", else Hugging Face's "text", else "prompt", the first that is not
    empty (per-image .json records and metadata.jsonl lines alike)."""
    for key in ("caption", "text", "prompt"):
        value = record.get(key)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def _pair_captions(root, files, result, cap_ext, repeats, fallback, listed=None) -> None:
    """Images with same-name caption files beside them; leftovers listed as skipped. ``listed``: captions of a
    kohya captions file (:func:`_kohya_captions`), which come first."""
    files_of, captions = listed or ((), {})
    images = [f for f in files if is_image(f)]
    stems = {(f.parent, f.stem) for f in images}
    cap_files = _caption_files(files, cap_ext, result)
    for f in files:
        if is_image(f) or f in files_of:
            continue
        if f.suffix.lower() == cap_ext.lower() and cap_files.get((f.parent, f.stem)) == f:
            if (f.parent, f.stem) not in stems:
                result.skipped.append((f, "caption file without an image of the same name"))
            continue
        result.skipped.append((f, _not_image_reason(f, cap_ext)))
    for img in images:
        caption = next((captions[k] for k in _image_keys(root, img) if k in captions), None)
        if caption is None and (cap_file := cap_files.get((img.parent, img.stem))) is not None:
            caption = _read_caption(cap_file)
        if caption is None:
            caption = fallback(img)
        result.items.append(Item(img, caption, None, repeats))


KOHYA_RECORD = '{"caption": text, "tags": text}'
NO_CAPTIONS_FILE = f"a .json file that is no captions file, not read (kohya's meta_cap.json maps each image name to {KOHYA_RECORD})"


def _kohya_captions(
    root: Path, records: dict[Path, dict[str, Any] | str], result: Scan
) -> tuple[tuple[Path, ...], dict[str, str]]:
    """kohya's captions file in the dataset folder (sd-scripts' finetune/merge_captions_to_metadata.py and
    merge_dd_tags_to_metadata.py write it, meta_cap.json): one object of image key (the file name without
    its extension, or the full path) -> ``{"caption": ..., "tags": ...}``. The caption is the caption, then the
    tags, as sd-scripts joins them (train_util: caption + separator + tags). Returns (the .json files it has
    dealt with, key -> caption); an image it does not name keeps its caption file. ``records``: the dataset's
    .json files, read (:func:`_metadata_records`). One whose records hold a caption or tags is a captions file:
    a record of it that is no such object is an error naming it (a record in error turned the whole file off,
    said as 'not a supported image type (.json)'); another .json file is listed as skipped, saying what it is
    not."""
    found: list[Path] = []
    captions: dict[str, str] = {}
    for f, data in records.items():
        found.append(f)
        values = data.values() if isinstance(data, dict) else ()
        if not any(isinstance(v, dict) and ("caption" in v or "tags" in v) for v in values):
            result.skipped.append((f, NO_CAPTIONS_FILE))
            continue
        if f.parent != root:
            result.skipped.append(
                (f, "a kohya captions file in a subfolder, not read: it is read in the dataset folder itself")
            )
            continue
        bad = [(key, why) for key, record in data.items() if (why := _kohya_record_problem(record))]
        if bad:
            key, why = bad[0]
            record = f"record {json.dumps(str(key), ensure_ascii=False)}"
            what = (
                f"{record} is not a kohya caption record {KOHYA_RECORD}"
                if len(bad) == 1
                else f"{len(bad)} records are not kohya caption records {KOHYA_RECORD}; the first, {record}"
            )
            raise DatasetError(
                f"{f}: {what}: {why}",
                fix=f"fix the record{'s' if len(bad) > 1 else ''}, or move the file out of the dataset",
            )
        for key, record in data.items():
            parts = [record.get("caption"), record.get("tags")]
            parts = [", ".join(map(str, p)) if isinstance(p, list) else p for p in parts]  # tags as a list
            text = ", ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
            if text:
                captions[str(key)] = text
                if Path(key).is_absolute():  # as the image's own resolved path (a link in either path)
                    captions.setdefault(str(_real(key)), text)
    return tuple(found), captions


def _kohya_record_problem(record: Any) -> str | None:
    """Why one record of a kohya captions file is not ``{"caption": ..., "tags": ...}`` (each text, a list of
    tags, or absent or null: sd-scripts reads a record without them as no caption), or None."""
    if not isinstance(record, dict):
        return f"it is {_short_json(record)}, not an object"
    for key in ("caption", "tags"):
        value = record.get(key)
        if value is not None and not isinstance(value, (str, list)):
            return f"its {key} is {_short_json(value)}, not text"
    return None


def _short_json(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


HF_METADATA = ("metadata.jsonl", "metadata.csv")  # Hugging Face imagefolder's captions files


def _hf_records(f: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of a metadata.jsonl or metadata.csv (:func:`_jsonl_captions`)."""
    try:
        text = f.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(
            f"{f}: cannot read it ({type(e).__name__})", fix="save it as UTF-8, or move it out of the dataset"
        ) from None
    out: list[tuple[int, dict[str, Any]]] = []
    if f.suffix.lower() == ".csv":
        # as pandas reads it for Hugging Face (datasets' folder_based_builder: pd.read_csv): a quoted word that
        # starts a caption ("Starry Night" style ...) is read; an unclosed quote (the rest of the file read as one
        # caption) and a row with more fields than the header (a caption's unquoted comma cut it short) are
        # refused; a space after a comma ("file_name, text") is not part of the next column's name
        fix = 'quote a caption that holds commas or quotes ("a, b"), or move the file out of the dataset'
        # strict reading only to find a quote left open to the file's end (an inch mark reads as pandas does); past
        # any other strict error (a caption starting with a quoted word) it reads on from the next line
        lines, start = text.splitlines(keepends=True), 0
        while start < len(lines):
            probe = csv.reader(io.StringIO("".join(lines[start:]), newline=""), strict=True)
            try:
                for _ in probe:
                    pass
                break
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    raise DatasetError(f"{f}: a quote is not closed", fix=fix) from None
                start += max(1, probe.line_num)
        reader = csv.DictReader(io.StringIO(text, newline=""), skipinitialspace=True)
        try:
            names = [n.strip() for n in reader.fieldnames or []]
            reader.fieldnames = names
            if "file_name" not in names:
                raise DatasetError(
                    f"{f}: its header row names no file_name column ({', '.join(names) or 'empty'})",
                    fix="name the images' column file_name and the captions' column text, as Hugging Face reads them",
                )
            for row in reader:
                # the row's first line: the last it read, less the line breaks inside its quoted fields (blank
                # lines between rows are skipped, so the line after the previous row's is not always it)
                fields = [v for v in row.values() if isinstance(v, str)] + list(row.get(None) or [])
                line = reader.line_num - sum(v.count("\n") for v in fields)
                if row.get(None):  # DictReader's restkey: the fields past the header's
                    raise DatasetError(f"{f}: line {line} has more fields than its header row", fix=fix)
                out.append((line, {k: v for k, v in row.items() if isinstance(k, str)}))
        except csv.Error as e:
            raise DatasetError(f"{f}: line {reader.line_num + 1} is not valid CSV ({e})", fix=fix) from None
        return out
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = e.msg
        if not isinstance(record, dict):
            why = record if isinstance(record, str) and not line.lstrip().startswith('"') else "not an object"
            raise DatasetError(
                f"{f}: line {n} is not a JSON object with file_name and text ({why})",
                fix="fix the line, or move the file out of the dataset",
            )
        out.append((n, record))
    return out


def _jsonl_captions(
    root: Path, files: Iterable[Path], result: Scan
) -> tuple[tuple[Path, ...], dict[str, str]]:
    """Captions of Hugging Face's imagefolder layout (what diffusers' training scripts load with
    ``load_dataset("imagefolder")``): a ``metadata.jsonl`` whose lines are ``{"file_name": "a.png", "text":
    "..."}`` (:func:`_record_caption`), or a ``metadata.csv`` with a header row naming those columns, names
    relative to its folder; one deeper in the tree wins for the images under it (in one folder the .jsonl over the
    .csv). Returns (the files read, each named image's resolved path -> caption: its own, never another folder's
    image of the same name); an image none names keeps its caption file. A line that is not a JSON object, or a
    .csv without a file_name column, is an error naming the file and line; names of images that are not in the
    dataset are listed as skipped."""
    found: list[Path] = []
    captions: dict[str, str] = {}
    listed = (f for f in files if f.name.lower() in HF_METADATA)
    for f in sorted(listed, key=lambda f: (len(f.parts), f.name.lower())):
        missing: list[str] = []
        for n, record in _hf_records(f):
            name, text = record.get("file_name"), _record_caption(record)
            if not isinstance(name, str) or not name.strip():
                missing.append(f"line {n} has no file_name")
                continue
            # in its own folder, as the dataset's walk sees it (through linked folders, as _walk follows them)
            image = Path(os.path.normpath(f.parent / name.strip()))
            if not (image.is_relative_to(f.parent) and image.is_file() and is_image(image)):
                missing.append(name.strip())
            elif text:
                captions[str(_real(image))] = text  # the key _image_keys gives the image (its real path)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            result.skipped.append((f, f"names images that are not in the dataset: {missing[0]}{more}"))
        found.append(f)
    return tuple(found), captions


def _image_keys(root: Path, img: Path) -> tuple[str, ...]:
    """The keys a kohya captions file may name ``img`` by: its stem, its path relative to the root or in full
    (as given, made absolute, or resolved through links), each with and without the extension."""
    rel, full, real = img.relative_to(root), img.absolute(), _real(img)
    named = (rel.with_suffix("").as_posix(), rel.as_posix())
    return (img.stem, img.name, *named, *(str(p) for q in (img, full, real) for p in (q.with_suffix(""), q)))


# -- kohya --------------------------------------------------------------------------------------------


SUSPICIOUS_REPEATS = 1000  # a kohya folder's repeats from here on look like a year or an id (2023_summer)


def kohya_repeats(folder: Path) -> int | None:
    """The repeats an ``N_name`` folder's name gives (kohya splits it at the first "_"); None for another name."""
    m = KOHYA_DIR.match(folder.name)
    return int(m.group(1)) if m else None


def _kohya_folders(folder: Path) -> list[Path]:
    """The kohya ``N_name`` folders directly in ``folder``, sorted."""
    with contextlib.suppress(OSError):
        dirs = sorted(d for d in folder.iterdir() if not d.name.startswith(".") and d.is_dir())
        return [d for d in dirs if KOHYA_DIR.match(d.name)]
    return []


# the folders kohya_ss makes in a project (its "Dataset preparation": img/, reg/, log/, model/)
_PROJECT_IMAGE_DIRS = ("img", "image", "images", "train", "training")
_PROJECT_OTHER_DIRS = ("log", "logs", "model", "models", "output")
# a regularization folder's name: reg, reg_data, regs, regularization, class_reg ... ("reg" as a word)
_REG_DIR = re.compile(r"(?i)(^|[_\- ])(reg|regs|regularization|regularisation)([_\- ]|$)")


class KohyaProjectError(DatasetError):
    """A kohya project folder given where its image (or class image) folder belongs."""


def _kohya_project(root: Path, files: list[Path], setting: str = "--dataset") -> DatasetError | None:
    """A kohya project folder given as the dataset (kohya_ss makes ``img/10_sks dog``, ``reg/1_dog``, ``log/``,
    ``model/``): no image and no ``N_name`` folder of its own, some one level down in a folder named as kohya_ss
    names them (or beside its log/ and model/). Scanned flat, its class images trained as instance images,
    without their folders' repeats and captions, and kohya itself finds no image folder there: the error names
    the folder to pass instead, and a regularization folder as dreambooth.class_data. A folder of the user's own
    photos with a subfolder of dated ones (photos/2023_summer, images/2023_summer: a year is no count of repeats)
    or of people (family_greg/Greg/2019_christmas: "reg" only as a word) stays flat, as it was read before; a
    project with a cover image at its root (img/, reg/ and log/ beside it) is still one. ``setting``: what the
    folder was given as (``--dataset``; ``dreambooth.class_data``, where the project's reg/ folder is the one to
    name)."""
    inner = {}
    with contextlib.suppress(OSError):
        for d in sorted(root.iterdir()):
            if d.name.startswith(".") or not d.is_dir():
                continue
            # repeats a person gives (10_sks dog, 1_dog), not a year (2023_summer)
            if kohya := [k for k in _kohya_folders(d) if kohya_repeats(k) < SUSPICIOUS_REPEATS]:  # type: ignore[operator]
                inner[d] = kohya
    if not inner:
        return None
    images_dir = any(d.name.lower() in _PROJECT_IMAGE_DIRS for d in inner)
    reg_dir = any(_REG_DIR.search(d.name) for d in inner)
    others = any((root / n).is_dir() for n in _PROJECT_OTHER_DIRS)
    if not (images_dir or reg_dir or others):
        return None
    own_images = any(f.parent == root and f.suffix.lower() in IMAGE_EXTENSIONS for f in files)
    if own_images and not ((images_dir or reg_dir) and (others or (images_dir and reg_dir))):
        return None  # images of its own, and not a project's folders beside them: a dataset
    reg = [d for d in inner if _REG_DIR.search(d.name)]  # kohya_ss's reg/, reg_data, regularization ...
    train = [d for d in inner if d not in reg] or reg[:1]
    reg = [d for d in reg if d not in train]
    if setting != "--dataset" and not reg:  # its N_name folders hold the instance images, not class ones
        return KohyaProjectError(
            f"{setting} {root} is a kohya project folder with no regularization (reg/) folder: "
            f"{train[0].name}/ holds its instance images ({inner[train[0]][0].name}), not class images",
            fix=f"set {setting} to a folder of class images, or to an empty folder (sdplan generates them there)",
        )
    if setting != "--dataset":  # class images: the project's regularization folder
        first = reg[0]
        return KohyaProjectError(
            f"{setting} {root} holds no kohya N_name folder, but {first.name}/ holds "
            f"{count_of(len(inner[first]), 'such folder')} ({inner[first][0].name}): a kohya project folder, "
            "not its class image folder",
            fix=f"set {setting}={shlex.quote(str(first))} instead",
        )
    first = train[0]
    also = f" (or {', '.join(shlex.quote(str(d)) for d in train[1:])})" if len(train) > 1 else ""
    fix = f"pass --dataset {shlex.quote(str(first))}{also} instead"
    if reg:
        token = KOHYA_DIR.match(inner[reg[0]][0].name).group(2).strip()  # type: ignore[union-attr]
        settings = ("dreambooth.with_prior_preservation=true", f"dreambooth.class_data={reg[0]}")
        settings += (f"dreambooth.class_prompt={token or '...'}",)
        fix += (
            f"; {reg[0].name}/ holds class (regularization) images, which sdplan reads with --method dreambooth "
            + " ".join(map(shlex.quote, settings))
        )
    return KohyaProjectError(
        f"dataset folder {root} holds no kohya N_name folder, but {first.name}/ holds "
        f"{count_of(len(inner[first]), 'such folder')} ({inner[first][0].name}): a kohya project folder, "
        "not its image folder",
        fix=fix,
    )


def _scan_kohya(root: Path, files: list[Path], cap_ext: str) -> Scan:
    result = Scan(root, "kohya")
    groups: dict[Path, list[Path]] = {}
    for f in files:
        top = f.relative_to(root).parts[0]
        if f.parent == root:
            result.skipped.append((f, "outside an N_name folder (kohya layout: 10_name/image.png)"))
        else:
            groups.setdefault(root / top, []).append(f)
    for folder, members in groups.items():
        m = KOHYA_DIR.match(folder.name)
        if m is None:
            result.skipped.append(
                (
                    folder,
                    f"folder not named N_name ({count_of(len(members), 'file')} ignored; e.g. 10_{folder.name})",
                )
            )
            continue
        n, name = int(m.group(1)), m.group(2).strip()
        if n >= SUSPICIOUS_REPEATS:
            result.notes.append(
                f"folder {folder.name}: {n} repeats (kohya reads the number before '_' as repeats; a date or an "
                "id there multiplies the epoch: rename it, e.g. 1_" + folder.name + ")"
            )
        if n < 1:
            result.skipped.append(
                (folder, f"repeats {n} in the folder name ({count_of(len(members), 'file')} ignored)")
            )
            continue
        before = len(result.items)
        _pair_captions(root, members, result, cap_ext, n, lambda _p, name=name: name or None)
        bare = sum(1 for it in result.items[before:] if it.caption is None)
        if not name and bare:  # kohya trains them with an empty caption; here they take the fallback caption
            result.notes.append(
                f"folder {folder.name}: no name after the repeats (kohya's class token, the caption of an image "
                f"without a caption file); {count_of(bare, 'image')} there {'has' if bare == 1 else 'have'} none"
            )
    return result


# -- metadata -----------------------------------------------------------------------------------------


def _metadata_records(files: Iterable[Path]) -> tuple[dict[Path, dict[str, Any] | str], bool]:
    """(each .json file -> its parsed object, or a reason string when it is not one; whether any is a per-image
    record: else the layout is not metadata, and a kohya captions file may be among them)."""
    out: dict[Path, dict[str, Any] | str] = {}
    found = False
    for f in files:
        if f.suffix.lower() != ".json":
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8-sig"))  # a BOM (Windows tools) is no error
        except json.JSONDecodeError as e:
            # A broken metadata file is an error, not a file skipped as "not an image": its image would
            # train with no caption, or the whole dataset would silently fall back to another layout.
            raise DatasetError(
                f"{f}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                fix="fix the file, or move it out of the dataset folder",
            ) from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DatasetError(
                f"{f}: cannot read it as JSON ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                fix="fix the file, or move it out of the dataset folder",
            ) from None
        if not isinstance(data, dict):
            out[f] = "not a metadata record (expected an object with image/path, tags, score)"
            continue
        if any(isinstance(data.get(k), str) for k in PATH_FIELDS) or "tags" in data:
            found = True
        out[f] = data
    return out, found


def _as_tags(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        parts = value.split(",")
    elif isinstance(value, (list, tuple)):
        parts = [str(v) for v in value if v is not None]
    elif isinstance(value, dict):  # by category (gallery-dl's e621 records): {"general": [...], "count": 3}
        return [t for v in value.values() if isinstance(v, (str, list, tuple)) for t in _as_tags(v)]
    else:
        raise ValueError(f"tags must be a list or a comma-separated string, got {type(value).__name__}")
    return [t.strip() for t in parts if t.strip()]


def _replace(tag: str, replace: dict[str, str]) -> str:
    for old, new in replace.items():
        if old:
            tag = tag.replace(old, new)
    return tag


def _fmt_num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _record_image(root: Path, json_path: Path, data: dict[str, Any]) -> Path | str:
    """The image a record names, or why it cannot be used."""
    for key in PATH_FIELDS:
        rel = data.get(key)
        if isinstance(rel, str) and rel.strip():
            rel = rel.strip()
            for base in (root, json_path.parent):
                cand = _real(base / rel) if not os.path.isabs(rel) else Path(rel)
                if cand.is_file():
                    return cand
            return f"its image {rel!r} ({key}) was not found under {root} or beside the json"
    named = json_path.with_suffix("")  # gallery-dl's a.png.json beside a.png
    if is_image(named) and named.is_file():
        return named
    for ext in IMAGE_EXTENSIONS:
        for cand in (json_path.with_suffix(ext), json_path.with_suffix(ext.upper())):
            if cand.is_file():
                return cand
    return "names no image (fields image, path or file_name) and has no same-name image beside it"


def _scan_metadata(root, files, records, repeats, meta: MetadataConfig | None, cap_ext) -> Scan:
    result = Scan(root, "metadata")
    replace = dict(meta.replace) if meta else {}
    # Config entries match a tag in their written form or after the replacements.
    skip = {f for t in (meta.skip_tags if meta else []) for f in (t, _replace(t, replace))}
    remove = {f for t in (meta.remove_tags if meta else []) for f in (t, _replace(t, replace))}
    bonus: dict[str, float] = {}
    for t, v in (meta.score_bonus if meta else {}).items():
        bonus.setdefault(t, v)
        bonus.setdefault(_replace(t, replace), v)
    min_score = meta.min_score if meta else None
    thresholds = sorted(meta.score_buckets) if meta else []
    root_resolved = root.resolve()

    described: dict[Path, Path] = {}  # resolved image -> json that described it
    over_records: list[
        Path
    ] = []  # images whose caption file is read instead of their image's record's tags or caption
    cap_files = _caption_files(files, cap_ext, result)
    for json_path, data in records.items():
        if isinstance(data, str):
            result.skipped.append((json_path, data))
            continue
        image = _record_image(root, json_path, data)
        if isinstance(image, str):
            result.skipped.append((json_path, image))
            continue
        image = _real(image)
        if image in described:
            result.skipped.append((json_path, f"describes the same image as {_rel(described[image], root)}"))
            continue
        described[image] = json_path
        # Keep the path as the user sees it (under root) where it is there.
        shown = root / image.relative_to(root_resolved) if image.is_relative_to(root_resolved) else image
        if not is_image(image):
            result.skipped.append((shown, _not_image_reason(image)))
            continue
        try:
            raw = _as_tags(data.get("tags"))
        except ValueError as e:
            result.skipped.append((json_path, str(e)))  # its image too: its score and tags are unknown
            continue
        forms = [(t, _replace(t, replace)) for t in raw]

        def has(names: set[str] | dict[str, float], t: str, r: str) -> bool:
            return t in names or r in names

        hit = next((t for t, r in forms if has(skip, t, r)), None)
        if hit is not None:
            result.skipped.append((shown, f"has skip tag {hit!r}"))
            continue
        score_value = data.get("score")
        try:
            base = float(score_value) if score_value is not None else None
        except (TypeError, ValueError):
            result.skipped.append((json_path, f"score {score_value!r} is not a number"))
            continue
        added = sum(bonus.get(t, bonus.get(r, 0.0)) for t, r in forms if has(bonus, t, r))
        has_score = base is not None or any(has(bonus, t, r) for t, r in forms)
        score = (base or 0.0) + added
        if min_score is not None and score < min_score:
            result.skipped.append((shown, f"score {_fmt_num(score)} < min_score {_fmt_num(min_score)}"))
            continue
        tags = [r for t, r in forms if not has(remove, t, r)]
        tags = [t for t in tags if t]
        if thresholds and has_score:
            reached = [th for th in thresholds if score >= th]
            if reached:
                tags.append(f"score_{_fmt_num(reached[-1])}")
        # the image's own caption file first: a downloader's record (gallery-dl's a.png.json) beside captions the
        # user wrote replaced one of them without a word; the record still selects (skip_tags, min_score)
        cap_file = cap_files.get((shown.parent, shown.stem))
        caption = _read_caption(cap_file) if cap_file is not None else None
        if caption is not None:
            if tags or _record_caption(data):
                over_records.append(shown)
            tags = []
        elif tags:
            caption = ", ".join(tags)
        else:
            caption = _record_caption(data)
        result.items.append(Item(shown, caption, tags or None, repeats, score if has_score else None))

    stems = {(f.parent, f.stem) for f in files if is_image(f)}
    for f in files:
        if f.suffix.lower() == ".json" or _real(f) in described:
            continue
        if is_image(f) and (cap_file := cap_files.get((f.parent, f.stem))) is not None:
            # beside the records, an image with a caption file trains on it (a few .json files, e.g. a
            # downloader's, among captioned images took the whole dataset to the metadata layout)
            result.items.append(Item(f, _read_caption(cap_file), None, repeats))
        elif is_image(f):
            result.skipped.append((f, "no .json record describes this image, and it has no caption file"))
        elif f.suffix.lower() == cap_ext.lower():
            if cap_files.get((f.parent, f.stem)) == f and (f.parent, f.stem) not in stems:
                result.skipped.append((f, "caption file without an image of the same name"))
        else:
            result.skipped.append((f, _not_image_reason(f)))
    if over_records:
        first = _rel(over_records[0], root)
        result.notes.append(
            f"{count_of(len(over_records), 'image')} ({first}{', ...' if len(over_records) > 1 else ''}) "
            f"{'has' if len(over_records) == 1 else 'have'} both a {cap_ext} caption and a .json record: the "
            f"{cap_ext} caption trains, the record only selects (skip_tags, min_score); remove the {cap_ext} to "
            "train on its tags"
        )
    return result


# -- checks -------------------------------------------------------------------------------------------


def _drop_empty_files(result: Scan) -> None:
    keep = []
    for it in result.items:
        try:
            size = it.path.stat().st_size
        except OSError as e:
            result.skipped.append((it.path, f"cannot be read ({e.strerror or e})"))
            continue
        if size == 0:
            result.skipped.append((it.path, "empty file (0 bytes)"))
        else:
            keep.append(it)
    result.items = keep


def _exif_rotated(im: Any) -> bool:
    try:
        return im.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # orientations that swap width and height
    except Exception:
        return False


def check_image(path: str | os.PathLike[str], *, decode: bool = True) -> tuple[int, int] | str:
    """Open and fully decode one image: its (width, height) after EXIF rotation, or why it is unusable.
    ``decode=False`` reads the header only: what PIL identifies, its size after a JPEG's or WebP's EXIF
    rotation (in its header; a PNG's EXIF can follow its pixel data: reading it costs a decode, so a PNG's
    size is as stored); a file broken further in passes."""
    from PIL import Image, UnidentifiedImageError

    quiet_large_images()
    try:
        if decode:
            with Image.open(path) as im:
                im.verify()  # structure and checksums (PNG CRCs); leaves the image unusable
        with Image.open(path) as im:
            if decode:
                im.load()  # a real decode catches truncated data that verify() lets through
            w, h = im.size
            # a PNG's EXIF is in its header only where written before the pixels (Pillow does): in im.info
            header_exif = "exif" in im.info or "Raw profile type exif" in im.info  # ImageMagick's text chunk
            if (decode or im.format != "PNG" or header_exif) and _exif_rotated(im):
                w, h = h, w
    except UnidentifiedImageError:
        return "not an image PIL can read (corrupt, or another format with an image extension)"
    except Image.DecompressionBombError:  # over twice Image.MAX_IMAGE_PIXELS (then set: never None here)
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0) / 1e6
        return f"too large to open safely (over {limit:.0f} megapixels); downscale it"
    except OSError as e:
        msg = str(e) or type(e).__name__
        if "truncated" in msg.lower():
            return f"truncated ({msg})"
        return f"corrupt ({msg})"
    except Exception as e:  # PIL raises SyntaxError, ValueError, struct.error ... on bad data
        return f"corrupt ({type(e).__name__}: {e})"
    if w < 1 or h < 1:
        return f"has no pixels ({w}x{h})"
    return w, h


def _verify(result: Scan, *, decode: bool = True) -> None:
    paths = [it.path for it in result.items]
    workers = min(8, os.cpu_count() or 1, max(1, len(paths) // 16))

    def check(path: Path) -> tuple[int, int] | str:
        return check_image(path, decode=decode)

    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            checks = list(pool.map(check, paths))
    else:
        checks = [check(p) for p in paths]
    keep = []
    for it, outcome in zip(result.items, checks):
        if isinstance(outcome, str):
            result.skipped.append((it.path, outcome))
        else:
            it.size = outcome
            keep.append(it)
    result.items = keep


def count_of(n: int, noun: str, plural: str | None = None) -> str:
    """'1 image', '3 images': how the dataset's counts are worded (here and in `sdplan recommend`); ``plural``
    where it is not noun + s ('process', 'processes')."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
