"""The torch side of the data: images to tensors, captions, batches, and the latent cache.

:class:`CaptionedImages` serves the items of a :class:`~sdplan.trainer.dataset_scan.Scan`, each repeated
``repeats`` times. A sample is the image scaled to cover the target size (LANCZOS when shrinking, BICUBIC
when enlarging) and cropped to it (center or random), flipped left-right with probability ``random_flip``,
as a float tensor in [-1, 1]. The target is ``resolution x resolution``, or the image's aspect-ratio bucket
when buckets are on (:mod:`sdplan.trainer.buckets`).

Every random choice (crop offset, flip, tag shuffle) comes from its own generator seeded by
``(seed, epoch, index)``: the same seed, epoch and index give the same tensor whatever the worker, process or
order of access; ``set_epoch`` gives new choices each epoch. Tag shuffling (metadata layout,
``metadata.shuffle_tags`` = p): with probability p the tags are shuffled, the first ``keep_tags`` of them
staying in front (0 by default; 1 keeps a leading subject/trigger tag in place, as kohya's keep_tokens).

An image that fails to load at training time (changed or removed after the scan) is reported once in
``dataset.warnings`` (and the log) and replaced by the next good one; training goes on. With DataLoader
workers each worker process keeps its own list (the log still shows each failure).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image, ImageOps

from sdplan.errors import DatasetError

from .buckets import assign_buckets, bucket_table, config_buckets
from .dataset_scan import (
    Item,
    Scan,
    fallback_caption,
    image_size,
    quiet_large_images,
    require_images,
    scan,
    scan_data,
)

if TYPE_CHECKING:
    from sdplan.config import TrainConfig

log = logging.getLogger(__name__)


def _rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


_SIXTEEN_BIT_GRAY = ("I", "I;16", "I;16L", "I;16B", "I;16N")  # how PIL opens a 16-bit grayscale PNG


def _scale_gray_key(im: Image.Image) -> None:
    """A 1-, 2- or 4-bit grayscale PNG's transparent value (tRNS) in 8 bits, as PIL gives its pixels (it keeps
    the key as stored: a 4-bit key of 5 matched no pixel, now 85). Read before the pixels load, while PIL still
    says the bit depth."""
    rawmode = getattr(getattr(im, "png", None), "im_rawmode", "") or ""
    key = im.info.get("transparency")
    if rawmode in ("L;1", "L;2", "L;4") and isinstance(key, int):
        bits = int(rawmode[2:])
        im.info["transparency"] = key * (255 // (2**bits - 1))


def _to_rgb(im: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (not the black of a plain convert), those of an alpha channel and
    of a palette's or an RGB / grayscale PNG's transparent colour (tRNS, what PIL's save(transparency=...) and
    optimizers reducing RGBA write); 16-bit grayscale scaled to 8 bits (a plain convert clips every value above
    255, so the image trains as white)."""
    keyed = im.mode in ("RGB", "L", "P") and "transparency" in im.info
    if im.mode == "RGB" and not keyed:
        return im
    key = im.info.get("transparency")
    if (
        im.mode == "RGB" and isinstance(key, tuple) and max(key) > 255
    ):  # a 16-bit PNG's key, its pixels in 8 bits
        im = im.copy()
        im.info["transparency"] = tuple(v >> 8 for v in key)
    if im.mode in _SIXTEEN_BIT_GRAY or (im.mode == "1" and "transparency" in im.info):
        values = np.asarray(im, dtype=np.float64)
        key = im.info.get("transparency")
        clear = values == key if isinstance(key, (int, float)) else np.zeros(values.shape, dtype=bool)
        gray = values / 257.0 if im.mode in _SIXTEEN_BIT_GRAY else values * 255.0  # 0..65535 or 0/1 -> 0..255
        gray[clear] = 255.0  # its transparent value: white, as an alpha channel's
        return Image.fromarray(np.clip(gray, 0, 255).round().astype(np.uint8), "L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA") or keyed:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")


class CaptionedImages(torch.utils.data.Dataset):
    """Images and captions for training; see the module doc.

    A sample is a dict: ``pixel_values`` float [3, H, W] in [-1, 1]; ``caption`` str; ``index`` (the index
    asked for); ``original_size`` (h, w) of the image as stored (after EXIF rotation); ``crop_top_left``
    (top, left) of the crop in the scaled image, as the flipped image sees it; ``target_size`` (h, w) =
    (H, W); ``flip`` bool; ``path`` str of the file used; ``cache_key`` str: sha256 of the file's bytes,
    the target size, the crop and the flip (what :class:`LatentCache` keys on).
    """

    def __init__(
        self,
        items: Sequence[Item],
        *,
        resolution: int = 512,
        center_crop: bool = True,
        random_flip: float = 0.0,
        caption_dropout: float = 0.0,
        shuffle_tags: float = 0.0,
        keep_tags: int = 0,
        seed: int = 0,
        fallback_caption: str = "",
        buckets: Sequence[tuple[int, int]] | None = None,
        name: str = "instance",
    ):
        if not items:
            raise DatasetError("no images to train on", fix="check data.path")
        if (
            not 0.0 <= random_flip <= 1.0
            or not 0.0 <= shuffle_tags <= 1.0
            or not 0.0 <= caption_dropout < 1.0
        ):
            raise ValueError("random_flip, shuffle_tags and caption_dropout are probabilities in [0, 1]")
        self.caption_dropout = float(caption_dropout)
        self.items = list(items)
        self.resolution = int(resolution)
        self.center_crop = center_crop
        self.random_flip = float(random_flip)
        self.shuffle_tags = float(shuffle_tags)
        self.keep_tags = max(0, int(keep_tags))
        self.seed = seed
        self.fallback_caption = fallback_caption
        self.name = name
        self.epoch = 0
        self.warnings: list[str] = []
        self._bad: set[int] = set()
        self._index = [n for n, it in enumerate(self.items) for _ in range(max(1, it.repeats))]
        self.buckets = [tuple(b) for b in buckets] if buckets else None
        if self.buckets:
            sizes = []
            for it in self.items:
                if it.size is None:
                    try:
                        it.size = image_size(it.path)
                    except Exception:  # unreadable: square bucket; the load will fail and be replaced
                        it.size = (1, 1)
                sizes.append(it.size)
            self.item_buckets = assign_buckets(sizes, self.buckets)
        else:
            self.item_buckets = [0] * len(self.items)

    # -- epoch and buckets --------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self._index)

    def bucket_ids(self) -> list[int]:
        """Bucket index of each dataset index (all 0 without buckets); for BucketBatchSampler."""
        return [self.item_buckets[n] for n in self._index]

    def target_size(self, index: int) -> tuple[int, int]:
        """(height, width) of the sample at ``index``."""
        if self.buckets:
            w, h = self.buckets[self.item_buckets[self._index[index]]]
            return h, w
        return self.resolution, self.resolution

    def bucket_table(self) -> list[dict[str, Any]]:
        """Rows (width, height, aspect, images, samples) of the buckets in use; one square row without."""
        shapes = self.buckets or [(self.resolution, self.resolution)]
        return bucket_table(shapes, self.item_buckets, [max(1, it.repeats) for it in self.items])

    # -- samples -------------------------------------------------------------------------------------

    def caption_for(self, item: Item, index: int, *, shuffle: bool = True) -> str:
        """``item``'s caption for the sample at ``index`` this epoch: its tags shuffled as data.metadata says
        (``shuffle`` False: in their own order, the same every epoch)."""
        if item.tags:
            tags = list(item.tags)
            if (
                shuffle
                and self.shuffle_tags > 0
                and _rng(self.seed, self.epoch, index, self.name, "tags").random() < (self.shuffle_tags)
            ):
                head, tail = tags[: self.keep_tags], tags[self.keep_tags :]
                _rng(self.seed, self.epoch, index, self.name, "tag-order").shuffle(tail)
                tags = head + tail
            return ", ".join(tags)
        return item.caption if item.caption is not None else self.fallback_caption

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample_at(index)

    def _flips(self, index: int) -> bool:
        """Whether the sample at ``index`` is flipped this epoch (``data.random_flip``)."""
        return self.random_flip > 0 and _rng(self.seed, self.epoch, index, self.name, "flip").random() < (
            self.random_flip
        )

    def variant(self, index: int) -> tuple:
        """What tells the sample at ``index`` from another of its image, read without loading it: its target size,
        its crop (a random crop is drawn per epoch and index; a centre crop is the image's own) and its flip.
        Samples of one variant have one ``cache_key`` (:meth:`LatentCache.precompute` loads one of them)."""
        index %= len(self._index)
        th, tw = self.target_size(index)
        crop = None if self.center_crop else (self.epoch, index)
        return (self._index[index], th, tw, crop, self._flips(index))

    def sample_at(self, index: int, shape: tuple[int, int] | None = None) -> dict[str, Any]:
        """The sample at ``index``; ``shape`` (height, width): scaled to cover it and cropped (its aspect
        kept, its real size and crop in the SDXL time ids) instead of its bucket's (DreamBooth's class images
        beside an instance batch of a bucket they have none in)."""
        n = len(self._index)
        if not -n <= index < n:
            raise IndexError(index)
        index %= n
        for k in range(n):
            item_no = self._index[(index + k) % n]
            if item_no in self._bad:
                continue
            try:
                return self._sample(index, self.items[item_no], shape)
            except Exception as e:  # a file changed or broken since the scan: report once, use the next
                self._bad.add(item_no)
                path = self.items[item_no].path
                msg = f"{path}: could not be loaded ({type(e).__name__}: {e}); replaced by the next image"
                self.warnings.append(msg)
                log.warning(msg)
        raise DatasetError(
            f"none of the {len(self.items)} images could be loaded at training time",
            fix="see the warnings above; re-check the dataset folder",
        )

    def _sample(self, index: int, item: Item, shape: tuple[int, int] | None = None) -> dict[str, Any]:
        th, tw = shape or self.target_size(index)
        data = Path(item.path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        quiet_large_images()  # here too: DataLoader workers are fresh processes
        with Image.open(io.BytesIO(data)) as opened:
            _scale_gray_key(opened)
            im = ImageOps.exif_transpose(opened)
            im = _to_rgb(im)
        w, h = im.size
        scale = max(tw / w, th / h)
        nw, nh = max(tw, round(w * scale)), max(th, round(h * scale))
        if (nw, nh) != (w, h):
            im = im.resize((nw, nh), Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC)
        if self.center_crop:
            top, left = (nh - th) // 2, (nw - tw) // 2
        else:
            crop_rng = _rng(self.seed, self.epoch, index, self.name, "crop")
            top, left = crop_rng.randint(0, nh - th), crop_rng.randint(0, nw - tw)
        im = im.crop((left, top, left + tw, top + th))
        flip = self._flips(index)
        if flip:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            left = nw - left - tw  # where this crop sits in the flipped scaled image
        arr = np.asarray(im, dtype=np.uint8)
        pixels = torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)
        key = hashlib.sha256(f"{digest}|{tw}x{th}|{top},{left}|{int(flip)}".encode()).hexdigest()
        caption = self.caption_for(item, index)
        if self.caption_dropout and (
            _rng(self.seed, self.epoch, index, self.name, "caption-dropout").random() < self.caption_dropout
        ):
            caption = ""  # kohya caption_dropout_rate: this sample trains on the empty caption
        return {
            "pixel_values": pixels,
            "caption": caption,
            "index": index,
            "original_size": (h, w),
            "crop_top_left": (top, left),
            "target_size": (th, tw),
            "flip": flip,
            "path": str(item.path),
            "cache_key": key,
        }


def collate(batch: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples: ``pixel_values`` [B, 3, H, W]; ``index``, ``flip`` [B]; ``original_size``,
    ``crop_top_left``, ``target_size`` long [B, 2] (SDXL time ids); ``caption``, ``path``, ``cache_key``
    lists of str. All samples must have one size (buckets: draw batches with BucketBatchSampler)."""
    if not batch:
        raise ValueError("empty batch")
    shapes = {tuple(b["pixel_values"].shape) for b in batch}
    if len(shapes) > 1:
        raise ValueError(
            f"a batch mixes image sizes {sorted(shapes)}; with buckets, draw batches with BucketBatchSampler"
        )
    pixels = torch.stack([b["pixel_values"] for b in batch]).contiguous(memory_format=torch.contiguous_format)
    return {
        "pixel_values": pixels.float(),
        "caption": [b["caption"] for b in batch],
        "index": torch.tensor([b["index"] for b in batch], dtype=torch.long),
        "original_size": torch.tensor([b["original_size"] for b in batch], dtype=torch.long),
        "crop_top_left": torch.tensor([b["crop_top_left"] for b in batch], dtype=torch.long),
        "target_size": torch.tensor([b["target_size"] for b in batch], dtype=torch.long),
        "flip": torch.tensor([b["flip"] for b in batch], dtype=torch.bool),
        "path": [b["path"] for b in batch],
        "cache_key": [b["cache_key"] for b in batch],
    }


# -- from the config ------------------------------------------------------------------------------------


def _option(section: Any, name: str, default: Any) -> Any:
    """A config option the schema may not have yet (buckets, keep_tags): its default then."""
    value = getattr(section, name, None) if section is not None else None
    return default if value is None else value


def _buckets_for(cfg: TrainConfig, buckets: bool | Sequence[tuple[int, int]] | None):
    if buckets is None:
        buckets = bool(_option(cfg.data, "buckets", False))
    if buckets is False:
        return None
    if buckets is True:
        return config_buckets(cfg.data)
    return [tuple(b) for b in buckets]


def build_dataset(
    cfg: TrainConfig,
    *,
    verify: bool = True,
    buckets: bool | Sequence[tuple[int, int]] | None = None,
) -> tuple[CaptionedImages, Scan]:
    """Scan ``data.path`` (opening every image when ``verify``) and build the training dataset.

    Raises :class:`DatasetError` when nothing usable is there, before any model is loaded. ``buckets``:
    None reads ``data.buckets`` (off when the config has no such key), True makes them from the resolution
    (``data.bucket_step``, default 64), or pass the shapes.
    """
    d = cfg.data
    result = require_images(scan_data(d, verify=verify))
    meta = d.metadata
    dataset = CaptionedImages(
        result.items,
        resolution=d.resolution,
        center_crop=d.center_crop,
        random_flip=d.random_flip,
        caption_dropout=d.caption_dropout,
        shuffle_tags=meta.shuffle_tags if meta is not None else 0.0,
        keep_tags=int(_option(meta, "keep_tags", 0)),
        seed=cfg.training.seed,
        fallback_caption=fallback_caption(cfg),
        buckets=_buckets_for(cfg, buckets),
    )
    return dataset, result


def build_class_dataset(
    cfg: TrainConfig,
    *,
    verify: bool = True,
    buckets: bool | Sequence[tuple[int, int]] | None = None,
) -> tuple[CaptionedImages, Scan]:
    """DreamBooth prior preservation: the images in ``dreambooth.class_data`` (any layout; at most
    ``num_class_images`` of them, in path order), every one captioned with ``class_prompt``, repeated once,
    with the instance data's size, crop and flip settings."""
    db = cfg.dreambooth
    if not db.class_data:
        raise DatasetError(
            "dreambooth.class_data is not set",
            fix="set dreambooth.class_data to a folder for the class images (generated there when short)",
        )
    if not db.class_prompt:
        raise DatasetError("dreambooth.class_prompt is not set", fix="set it, e.g. 'a photo of a dog'")
    result = require_images(scan(db.class_data, verify=verify, setting="dreambooth.class_data"))
    items = [Item(it.path, db.class_prompt, None, 1, None, it.size) for it in result.items]
    if db.num_class_images > 0:
        items = items[: db.num_class_images]
    result.items = items
    d = cfg.data
    dataset = CaptionedImages(
        items,
        resolution=d.resolution,
        center_crop=d.center_crop,
        random_flip=d.random_flip,
        seed=cfg.training.seed,
        fallback_caption=db.class_prompt,
        buckets=_buckets_for(cfg, buckets),
        name="class",
    )
    return dataset, result


# -- latent cache ---------------------------------------------------------------------------------------


def vae_identity(vae: Any, *extra: Any) -> str:
    """A short hash naming a VAE for cache keys: its class, config, dtype and a sample of its weights
    (two VAEs with one config but other weights, e.g. a fixed fp16 VAE, get different names). ``extra``:
    anything else the encoding depends on (``"mode"`` vs ``"sample"``, the scaling factor)."""
    h = hashlib.sha256()
    h.update(type(vae).__name__.encode())
    config = getattr(vae, "config", None)
    if config is not None:
        h.update(json.dumps(dict(config), sort_keys=True, default=str).encode())
    params = list(vae.parameters()) if hasattr(vae, "parameters") else []
    for p in params[:2] + params[-2:]:
        h.update(str(p.dtype).encode())
        h.update(p.detach().flatten()[:256].float().cpu().numpy().tobytes())
    for x in extra:
        h.update(f"|{x}".encode())
    return h.hexdigest()[:16]


class LatentCache:
    """VAE latents keyed by a sample's ``cache_key`` (file content, target size, crop, flip) and the VAE
    ``identity`` (see :func:`vae_identity`): a changed image, another crop or flip, or another VAE encodes
    anew. ``dir`` None keeps them in memory; a folder keeps one ``.safetensors`` per latent there (written
    to a temp file then renamed, so concurrent processes and kills leave no half file; an unreadable file is
    encoded again). Latents come back on the CPU in the dtype ``encode_fn`` returned.
    """

    def __init__(self, dir: str | os.PathLike[str] | None = None, *, identity: str = ""):
        self.dir = Path(dir) if dir is not None else None
        self.identity = identity
        self._memory: dict[str, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def key(self, key_item: dict[str, Any] | str) -> str:
        base = key_item if isinstance(key_item, str) else key_item["cache_key"]
        return hashlib.sha256(f"{self.identity}|{base}".encode()).hexdigest()

    def _file(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> torch.Tensor | None:
        if self.dir is None:
            return self._memory.get(key)
        path = self._file(key)
        if not path.is_file():
            return None
        from safetensors.torch import load_file

        try:
            return load_file(str(path))["latent"]
        except Exception:
            log.warning("latent cache file %s is unreadable; encoding again", path)
            return None

    def put(self, key: str, latent: torch.Tensor) -> None:
        latent = latent.detach().to("cpu").contiguous()
        if self.dir is None:
            self._memory[key] = latent.clone()
            return
        from safetensors.torch import save_file

        path = self._file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:8]}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            save_file({"latent": latent}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _has(self, key: str) -> bool:
        return key in self._memory if self.dir is None else self._file(key).is_file()

    def __contains__(self, key_item: dict[str, Any] | str) -> bool:
        return self._has(self.key(key_item))

    def __len__(self) -> int:
        if self.dir is None:
            return len(self._memory)
        return sum(1 for _ in self.dir.glob("*/*.safetensors"))

    def get_or_encode(
        self, key_item: dict[str, Any], encode_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The latent of one sample (a CaptionedImages item); ``encode_fn`` maps pixels [N, 3, H, W] to
        latents [N, ...] and is called (with N = 1) only when the cache lacks it."""
        key = self.key(key_item)
        latent = self.get(key)
        if latent is not None:
            self.hits += 1
            return latent
        self.misses += 1
        with torch.no_grad():
            latent = encode_fn(key_item["pixel_values"].unsqueeze(0))[0]
        latent = latent.detach().to("cpu").contiguous()
        self.put(key, latent)
        return latent

    def get_or_encode_batch(
        self, batch: dict[str, Any], encode_fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Latents [B, ...] of a collated batch; the missing ones are encoded in one ``encode_fn`` call."""
        keys = [self.key(k) for k in batch["cache_key"]]
        found = [self.get(k) for k in keys]
        missing = [i for i, x in enumerate(found) if x is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            pixels = batch["pixel_values"][missing]
            with torch.no_grad():
                encoded = encode_fn(pixels)
            for j, i in enumerate(missing):
                latent = encoded[j].detach().to("cpu").contiguous()
                self.put(keys[i], latent)
                found[i] = latent
        return torch.stack(found)

    def precompute(
        self,
        dataset: CaptionedImages,
        encode_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        epochs: Sequence[int] = (0,),
        batch_size: int = 8,
        on_sample: Callable[[], None] | None = None,
    ) -> int:
        """Encode every sample of the given epochs that the cache lacks (so the VAE can leave the GPU);
        returns how many were encoded. With random crops or flips each epoch has its own samples: pass
        every epoch that will be trained. Leaves the dataset at its current epoch. ``on_sample`` is called
        once per sample looked at (progress). A sample of a variant already looked at (another repeat or epoch
        of an image with its crop and flip: :meth:`CaptionedImages.variant`) is not loaded again: each image
        was read, decoded and resized once per repeat and epoch, 40 s for 8 latents at 10 repeats x 10 epochs."""
        before = self.misses
        keep = dataset.epoch
        seen: set[tuple] = set()
        try:
            for epoch in epochs:
                dataset.set_epoch(epoch)
                group: list[dict[str, Any]] = []
                for index in range(len(dataset)):
                    if (variant := dataset.variant(index)) in seen:
                        if on_sample is not None:
                            on_sample()
                        continue
                    seen.add(variant)
                    sample = dataset[index]
                    if not self._has(self.key(sample)):
                        group.append(sample)
                    elif on_sample is not None:
                        on_sample()
                    if len(group) >= batch_size:
                        self._encode_group(group, encode_fn, on_sample)
                        group = []
                if group:
                    self._encode_group(group, encode_fn, on_sample)
        finally:
            dataset.set_epoch(keep)
        return self.misses - before

    def _encode_group(self, group: list[dict[str, Any]], encode_fn, on_sample=None) -> None:
        by_shape: dict[tuple[int, ...], list[dict[str, Any]]] = {}
        for s in group:
            by_shape.setdefault(tuple(s["pixel_values"].shape), []).append(s)
        for samples in by_shape.values():
            # Two samples of one epoch can share a key (same image, crop and flip): encode it once.
            unique = list({s["cache_key"]: s for s in samples}.values())
            self.get_or_encode_batch(collate(unique), encode_fn)
            if on_sample is not None:
                for _ in samples:
                    on_sample()
