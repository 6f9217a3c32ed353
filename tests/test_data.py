"""The torch data side: tensors, crops, flips, tag shuffles, determinism, failures, buckets, latent cache."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image
from sdplan.trainer.buckets import BucketBatchSampler, make_buckets
from sdplan.trainer.data import (
    CaptionedImages,
    LatentCache,
    build_class_dataset,
    build_dataset,
    collate,
    vae_identity,
)
from sdplan.trainer.dataset_scan import Item, scan

from sdplan.config import DataConfig, MetadataConfig, TrainConfig
from sdplan.errors import DatasetError

RED = (255, 0, 0)
BLUE = (0, 0, 255)


def halves(path, size=(64, 64), left=RED, right=BLUE):
    """An image whose left half is one color and right half another."""
    w, h = size
    im = Image.new("RGB", size, right)
    im.paste(Image.new("RGB", (w // 2, h), left), (0, 0))
    im.save(path)
    return path


def solid(path, size=(40, 30), color=RED):
    Image.new("RGB", size, color).save(path)
    return path


def noise(path, size=(80, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    Image.fromarray(arr).save(path)
    return path


def rgb_at(sample, y, x):
    return tuple(round(float(v), 2) for v in sample["pixel_values"][:, y, x])


# -- one sample -------------------------------------------------------------------------------------------


def test_sample_shape_range_and_center_crop(tmp_path):
    # 100x60, left half red: at 64 it scales to 107x64, center crop starts at x = 21
    halves(tmp_path / "a.png", size=(100, 60))
    ds = CaptionedImages([Item(tmp_path / "a.png", "cap")], resolution=64)
    s = ds[0]
    assert s["pixel_values"].shape == (3, 64, 64)
    assert s["pixel_values"].dtype == torch.float32
    assert float(s["pixel_values"].min()) >= -1.0 and float(s["pixel_values"].max()) <= 1.0
    assert s["original_size"] == (60, 100)
    assert s["crop_top_left"] == (0, 21)
    assert s["target_size"] == (64, 64)
    assert s["caption"] == "cap" and s["index"] == 0 and s["flip"] is False
    assert rgb_at(s, 32, 0) == (1.0, -1.0, -1.0)  # red on the left
    assert rgb_at(s, 32, 63) == (-1.0, -1.0, 1.0)  # blue on the right
    # the crop's middle is the image's middle: the color boundary sits near x = 53.5 - 21 = 32
    assert rgb_at(s, 32, 29) == (1.0, -1.0, -1.0) and rgb_at(s, 32, 35) == (-1.0, -1.0, 1.0)


def test_small_images_are_enlarged_to_cover(tmp_path):
    solid(tmp_path / "small.png", size=(20, 10))
    s = CaptionedImages([Item(tmp_path / "small.png")], resolution=64)[0]
    assert s["pixel_values"].shape == (3, 64, 64)
    assert s["original_size"] == (10, 20)
    assert s["crop_top_left"] == (0, 32)  # scaled to 128x64


def test_flip_mirrors_and_reports_the_flipped_crop(tmp_path):
    halves(tmp_path / "a.png", size=(100, 60))
    s = CaptionedImages([Item(tmp_path / "a.png")], resolution=64, random_flip=1.0)[0]
    assert s["flip"] is True
    assert rgb_at(s, 32, 0) == (-1.0, -1.0, 1.0)  # blue now on the left
    assert s["crop_top_left"] == (0, 107 - 21 - 64)


def test_transparency_becomes_white_and_grey_becomes_rgb(tmp_path):
    Image.new("RGBA", (64, 64), (0, 0, 0, 0)).save(tmp_path / "clear.png")
    Image.new("L", (64, 64), 0).save(tmp_path / "grey.png")
    ds = CaptionedImages([Item(tmp_path / "clear.png"), Item(tmp_path / "grey.png")], resolution=64)
    assert rgb_at(ds[0], 5, 5) == (1.0, 1.0, 1.0)
    assert rgb_at(ds[1], 5, 5) == (-1.0, -1.0, -1.0)
    assert ds[1]["pixel_values"].shape == (3, 64, 64)


def test_a_pngs_transparent_colour_becomes_white_too(tmp_path):
    """An RGB or grayscale PNG with a tRNS colour key (PIL's save(transparency=...), optimizers reducing RGBA)
    trained its transparent background black where the same picture as RGBA trained white."""
    im = Image.new("RGB", (64, 64), (0, 0, 0))
    im.paste((200, 30, 30), (16, 16, 48, 48))
    im.save(tmp_path / "keyed.png", transparency=(0, 0, 0))
    Image.new("L", (64, 64), 0).save(tmp_path / "keyed_l.png", transparency=0)
    ds = CaptionedImages([Item(tmp_path / "keyed.png"), Item(tmp_path / "keyed_l.png")], resolution=64)
    assert rgb_at(ds[0], 2, 2) == (1.0, 1.0, 1.0) and rgb_at(ds[1], 2, 2) == (1.0, 1.0, 1.0)
    assert rgb_at(ds[0], 32, 32)[0] > 0.5  # the opaque square keeps its colour
    # 16-bit grayscale and 1-bit PNGs with a transparent value (the 16-bit branch ran first and kept it dark)
    import numpy as np

    gray16 = np.full((64, 64), 1000, dtype=np.uint16)
    gray16[32:, 32:] = 60000
    Image.fromarray(gray16).save(tmp_path / "g16.png", transparency=1000)
    Image.new("1", (64, 64), 0).save(tmp_path / "bits.png", transparency=0)
    ds = CaptionedImages([Item(tmp_path / "g16.png"), Item(tmp_path / "bits.png")], resolution=64)
    assert rgb_at(ds[0], 2, 2) == (1.0, 1.0, 1.0) and rgb_at(ds[1], 2, 2) == (1.0, 1.0, 1.0)
    assert 0.7 < rgb_at(ds[0], 48, 48)[0] < 0.9  # 60000 / 257 = 233: scaled, not transparent
    # a 16-bit RGB PNG: PIL gives its pixels in 8 bits and its tRNS key in 16 (the key matched nothing)
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rgb16 = np.full((64, 64, 3), 4660, dtype=">u2")
    rows = b"".join(b"\x00" + rgb16[y].tobytes() for y in range(64))
    (tmp_path / "rgb16.png").write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 16, 2, 0, 0, 0))
        + chunk(b"tRNS", struct.pack(">HHH", 4660, 4660, 4660))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    assert rgb_at(CaptionedImages([Item(tmp_path / "rgb16.png")], resolution=64)[0], 2, 2) == (1.0, 1.0, 1.0)
    # a 4-bit grayscale PNG: PIL scales its pixels to 8 bits (5 -> 85) but not its key (5 matched no pixel)
    rows = b"".join(b"\x00" + bytes([0x55] * 16 + [0xAA] * 16) for _ in range(64))  # left 5, right 10
    (tmp_path / "gray4.png").write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 4, 0, 0, 0, 0))
        + chunk(b"tRNS", struct.pack(">H", 5))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    gray4 = CaptionedImages([Item(tmp_path / "gray4.png")], resolution=64)[0]
    assert rgb_at(gray4, 2, 2) == (1.0, 1.0, 1.0) and rgb_at(gray4, 2, 60) == (0.33, 0.33, 0.33)  # 10: 170


def test_exif_rotation_is_applied(tmp_path):
    im = Image.new("RGB", (80, 40), RED)
    exif = im.getexif()
    exif[0x0112] = 6  # rotate 90: shown as 40 wide, 80 tall
    im.save(tmp_path / "rot.jpg", exif=exif)
    result = scan(tmp_path, verify=True)
    assert result.items[0].size == (40, 80)
    s = CaptionedImages(result.items, resolution=64)[0]
    assert s["original_size"] == (80, 40)


def test_missing_caption_uses_the_fallback(tmp_path):
    solid(tmp_path / "a.png")
    ds = CaptionedImages([Item(tmp_path / "a.png", None)], resolution=64, fallback_caption="a photo of sks")
    assert ds[0]["caption"] == "a photo of sks"
    ds = CaptionedImages([Item(tmp_path / "a.png", "")], resolution=64, fallback_caption="x")
    assert ds[0]["caption"] == ""  # an empty caption given on purpose stays empty


# -- determinism ------------------------------------------------------------------------------------------


def _random_ds(tmp_path, **kw):
    paths = [noise(tmp_path / f"{i}.png", size=(80 + 8 * i, 48), seed=i) for i in range(4)]
    items = [Item(p, f"img {i}", repeats=4) for i, p in enumerate(paths)]
    return CaptionedImages(items, resolution=32, center_crop=False, random_flip=0.5, seed=11, **kw)


def test_same_seed_and_epoch_give_same_tensors_in_any_order(tmp_path):
    a, b = _random_ds(tmp_path), _random_ds(tmp_path)
    assert len(a) == 16
    order = list(reversed(range(16)))
    got_b = {i: b[i] for i in order}
    for i in range(16):
        sa = a[i]
        assert torch.equal(sa["pixel_values"], got_b[i]["pixel_values"])
        assert sa["crop_top_left"] == got_b[i]["crop_top_left"]
        assert sa["flip"] == got_b[i]["flip"]


def test_epochs_and_repeats_get_new_flips_and_crops(tmp_path):
    ds = _random_ds(tmp_path)
    e0 = [(ds[i]["flip"], ds[i]["crop_top_left"]) for i in range(16)]
    flips0 = [f for f, _ in e0]
    assert any(flips0) and not all(flips0)
    assert len({c for _, c in e0[:4]}) > 1  # the 4 repeats of image 0 are cropped differently
    ds.set_epoch(1)
    e1 = [(ds[i]["flip"], ds[i]["crop_top_left"]) for i in range(16)]
    assert [f for f, _ in e1] != flips0
    assert e1 != e0
    ds.set_epoch(0)
    assert [(ds[i]["flip"], ds[i]["crop_top_left"]) for i in range(16)] == e0
    other = _random_ds(tmp_path)
    other.seed = 12
    assert [(other[i]["flip"], other[i]["crop_top_left"]) for i in range(16)] != e0


def test_tag_shuffle_probability_keep_and_determinism(tmp_path):
    solid(tmp_path / "a.png")
    tags = ["subject", "b", "c", "d", "e", "f"]
    item = Item(tmp_path / "a.png", ", ".join(tags), list(tags), repeats=8)

    never = CaptionedImages([item], resolution=64, shuffle_tags=0.0)
    assert {never[i]["caption"] for i in range(8)} == {", ".join(tags)}

    always = CaptionedImages([item], resolution=64, shuffle_tags=1.0, keep_tags=1, seed=3)
    caps = [always[i]["caption"] for i in range(8)]
    assert all(c.startswith("subject, ") for c in caps)
    assert all(sorted(c.split(", ")) == sorted(tags) for c in caps)
    assert len(set(caps)) > 1
    again = CaptionedImages([item], resolution=64, shuffle_tags=1.0, keep_tags=1, seed=3)
    assert [again[i]["caption"] for i in range(8)] == caps
    again.set_epoch(1)
    assert [again[i]["caption"] for i in range(8)] != caps

    half = CaptionedImages(
        [Item(tmp_path / "a.png", None, list(tags), repeats=200)], resolution=64, shuffle_tags=0.5
    )
    kept = sum(half.caption_for(half.items[0], i) == ", ".join(tags) for i in range(200))
    assert 60 < kept < 140  # about half keep the written order (the other half rarely lands on it)


def test_caption_dropout_empties_a_share_of_the_samples_the_same_way_each_time(tmp_path):
    """data.caption_dropout (kohya caption_dropout_rate): about that share of the samples train on "", drawn
    from (seed, epoch, index) like the flips; the captions the text cache encodes include ""; a recipe's
    sample prompt (caption_for) is the caption itself."""
    from sdplan.trainer.conditioning import epoch_captions

    solid(tmp_path / "a.png")
    item = Item(tmp_path / "a.png", "a red square", None, repeats=200)
    ds = CaptionedImages([item], resolution=16, caption_dropout=0.3, seed=1)
    caps = [ds[i]["caption"] for i in range(200)]
    assert set(caps) == {"", "a red square"} and 30 < caps.count("") < 90
    assert [
        CaptionedImages([item], resolution=16, caption_dropout=0.3, seed=1)[i]["caption"] for i in range(200)
    ] == caps
    ds.set_epoch(1)
    assert [ds[i]["caption"] for i in range(200)] != caps
    assert ds.caption_for(item, 0) == "a red square"
    assert epoch_captions(ds, 2) == {"", "a red square"}
    plain = CaptionedImages([item], resolution=16)
    assert {plain[i]["caption"] for i in range(20)} == {"a red square"} and epoch_captions(plain, 2) == {
        "a red square"
    }


# -- failures at load time --------------------------------------------------------------------------------


def test_file_broken_after_scan_is_replaced_and_reported_once(tmp_path, caplog):
    for i in range(3):
        solid(tmp_path / f"{i}.png", color=(i * 100, 0, 0))
    result = scan(tmp_path, verify=True)
    ds = CaptionedImages(result.items, resolution=32)
    (tmp_path / "1.png").write_bytes(os.urandom(100))
    s = ds[1]
    assert s["path"].endswith("2.png") and s["index"] == 1
    for _ in range(3):
        assert ds[1]["path"].endswith("2.png")
    assert len(ds.warnings) == 1 and "1.png" in ds.warnings[0]
    assert sum("1.png" in r.message for r in caplog.records) == 1
    (tmp_path / "2.png").unlink()
    assert ds[1]["path"].endswith("0.png")  # wraps around
    assert len(ds.warnings) == 2
    (tmp_path / "0.png").write_bytes(b"")
    with pytest.raises(DatasetError, match="none of the 3 images could be loaded"):
        ds[0]


# -- collate and buckets ----------------------------------------------------------------------------------


def test_collate_stacks_and_rejects_mixed_sizes(tmp_path):
    solid(tmp_path / "a.png")
    halves(tmp_path / "b.png")
    ds = CaptionedImages([Item(tmp_path / "a.png", "a"), Item(tmp_path / "b.png", "b")], resolution=32)
    batch = collate([ds[0], ds[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    assert batch["caption"] == ["a", "b"]
    assert batch["index"].tolist() == [0, 1]
    assert batch["original_size"].tolist() == [[30, 40], [64, 64]]
    assert batch["crop_top_left"].shape == (2, 2) and batch["target_size"].tolist() == [[32, 32]] * 2
    assert len(batch["cache_key"]) == 2
    other = CaptionedImages([Item(tmp_path / "a.png")], resolution=64)[0]
    with pytest.raises(ValueError, match="mixes image sizes"):
        collate([ds[0], other])


def test_buckets_put_each_image_where_expected(tmp_path):
    sizes = {"square": (500, 500), "wide": (1000, 500), "tall": (500, 1000), "photo": (600, 400)}
    for name, size in sizes.items():
        solid(tmp_path / f"{name}.png", size=size)
    result = scan(tmp_path, verify=True)
    ds = CaptionedImages(result.items, resolution=512, buckets=make_buckets(512))
    got = {os.path.basename(ds[i]["path"]): tuple(ds[i]["pixel_values"].shape[1:]) for i in range(len(ds))}
    assert got == {
        "photo.png": (384, 640),
        "square.png": (512, 512),
        "tall.png": (704, 320),
        "wide.png": (320, 704),
    }
    table = {(r["width"], r["height"]): r["images"] for r in ds.bucket_table()}
    assert table == {(640, 384): 1, (512, 512): 1, (320, 704): 1, (704, 320): 1}


def test_bucket_batches_stack_through_a_dataloader(tmp_path):
    for i in range(3):
        solid(tmp_path / f"w{i}.png", size=(128, 64))
        solid(tmp_path / f"t{i}.png", size=(64, 128))
    solid(tmp_path / "sq.png", size=(64, 64))
    result = scan(tmp_path)  # no verify: sizes come from the file headers
    ds = CaptionedImages(
        result.items, resolution=64, buckets=make_buckets(64, step=32, min_size=32, max_size=128)
    )
    sampler = BucketBatchSampler.for_dataset(ds, 2, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=collate)
    shapes = [tuple(b["pixel_values"].shape) for b in loader]
    assert sorted(shapes) == sorted(
        [(2, 3, 32, 96)] + [(1, 3, 32, 96)] + [(2, 3, 96, 32), (1, 3, 96, 32)] + [(1, 3, 64, 64)]
    )


# -- from the config --------------------------------------------------------------------------------------


def _cfg(tmp_path, **data):
    cfg = TrainConfig()
    cfg.data = DataConfig(path=str(tmp_path), resolution=64, **data)
    return cfg


def test_build_dataset_fails_clearly_on_empty_or_broken_data(tmp_path):
    with pytest.raises(DatasetError, match="no readable images"):
        build_dataset(_cfg(tmp_path))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError, match=r"1 skipped: bad.png: not an image"):
        build_dataset(_cfg(tmp_path))
    with pytest.raises(DatasetError, match="does not exist"):
        build_dataset(_cfg(tmp_path / "missing"))


def test_build_dataset_skips_broken_and_uses_config(tmp_path):
    solid(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("captioned")
    solid(tmp_path / "b.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    cfg = _cfg(tmp_path, repeats=3, random_flip=1.0)
    cfg.dreambooth.instance_prompt = "a photo of sks dog"
    ds, result = build_dataset(cfg)
    assert len(ds) == 6 and result.num_images == 2
    assert [p.name for p, _ in result.skipped] == ["bad.png"]
    assert {ds[i]["caption"] for i in range(6)} == {"captioned", "a photo of sks dog"}
    assert all(ds[i]["flip"] for i in range(6))
    assert ds[0]["pixel_values"].shape == (3, 64, 64)

    cfg.data.default_caption = "default"
    ds, _ = build_dataset(cfg)
    assert {ds[i]["caption"] for i in range(6)} == {"captioned", "default"}

    cfg = _cfg(tmp_path)
    cfg.method = "textual-inversion"
    cfg.textual_inversion.token = "<cat-toy>"
    ds, _ = build_dataset(cfg)
    assert "a photo of <cat-toy>" in {ds[i]["caption"] for i in range(len(ds))}

    cfg = _cfg(tmp_path)
    ds, _ = build_dataset(cfg, buckets=True)
    assert ds.buckets and ds[0]["pixel_values"].shape[1:] == (64, 64)


def test_build_dataset_metadata_options(tmp_path):
    for name, tags, score in [("a", ["x", "keep"], 9), ("b", ["x"], 1), ("c", ["bad"], 9)]:
        solid(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"path": f"{name}.png", "tags": tags, "score": score})
        )
    cfg = _cfg(tmp_path, metadata=MetadataConfig(skip_tags=["bad"], min_score=5, shuffle_tags=1.0))
    ds, result = build_dataset(cfg)
    assert result.format == "metadata" and len(ds) == 1
    assert ds.shuffle_tags == 1.0
    assert sorted(ds[0]["caption"].split(", ")) == ["keep", "x"]


def test_build_class_dataset(tmp_path):
    inst, cls = tmp_path / "inst", tmp_path / "class"
    inst.mkdir()
    cls.mkdir()
    solid(inst / "a.png")
    for i in range(5):
        solid(cls / f"{i}.png")
        (cls / f"{i}.txt").write_text("ignored")
    cfg = _cfg(inst)
    cfg.method = "dreambooth"
    cfg.dreambooth.class_prompt = "a photo of a dog"
    cfg.dreambooth.num_class_images = 3
    with pytest.raises(DatasetError, match="class_data is not set"):
        build_class_dataset(cfg)
    cfg.dreambooth.class_data = str(cls)
    ds, result = build_class_dataset(cfg)
    assert len(ds) == 3 and result.num_images == 3
    assert {ds[i]["caption"] for i in range(3)} == {"a photo of a dog"}
    cfg.dreambooth.class_data = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no readable images"):
        build_class_dataset(cfg)


# -- latent cache -----------------------------------------------------------------------------------------


class CountingEncoder:
    def __init__(self):
        self.calls = 0
        self.images = 0

    def __call__(self, pixels):
        self.calls += 1
        self.images += pixels.shape[0]
        return torch.nn.functional.avg_pool2d(pixels, 8)[:, :3] * 0.5


@pytest.mark.parametrize("on_disk", [False, True])
def test_latent_cache_reencodes_only_what_changed(tmp_path, on_disk):
    data = tmp_path / "data"
    data.mkdir()
    noise(data / "a.png", size=(64, 64), seed=1)
    noise(data / "b.png", size=(64, 64), seed=2)
    items = scan(data).items
    ds = CaptionedImages(items, resolution=64)
    enc = CountingEncoder()
    cache = LatentCache(tmp_path / "cache" if on_disk else None, identity="vae-1")

    first = cache.get_or_encode(ds[0], enc)
    assert first.shape == (3, 8, 8) and enc.images == 1
    again = cache.get_or_encode(ds[0], enc)
    assert torch.equal(first, again) and enc.images == 1 and cache.hits == 1
    assert torch.equal(first, enc(ds[0]["pixel_values"][None])[0])
    enc.images = 0

    batch = collate([ds[0], ds[1]])
    latents = cache.get_or_encode_batch(batch, enc)
    assert latents.shape == (2, 3, 8, 8) and enc.images == 1  # only b was encoded

    noise(data / "a.png", size=(64, 64), seed=3)  # the image changes on disk
    changed = cache.get_or_encode(ds[0], enc)
    assert enc.images == 2 and not torch.equal(changed, first)

    other_vae = LatentCache(tmp_path / "cache" if on_disk else None, identity="vae-2")
    other_vae.get_or_encode(ds[1], enc)
    assert enc.images == 3

    flipped = CaptionedImages(items, resolution=64, random_flip=1.0)
    cache.get_or_encode(flipped[1], enc)
    assert enc.images == 4  # a flip is another latent

    if on_disk:
        reopened = LatentCache(tmp_path / "cache", identity="vae-1")
        assert torch.equal(reopened.get_or_encode(ds[1], enc), latents[1]) and enc.images == 4
        files = list((tmp_path / "cache").glob("*/*.safetensors"))
        assert len(files) == len(reopened) == 5
        assert not list((tmp_path / "cache").glob("*/*.tmp"))
        for f in files:
            f.write_bytes(b"broken")
        reopened.get_or_encode(ds[1], enc)
        assert enc.images == 5  # an unreadable cache file is encoded again


def test_latent_cache_precompute_covers_every_epoch(tmp_path):
    noise(tmp_path / "a.png", size=(64, 64), seed=1)
    noise(tmp_path / "b.png", size=(64, 64), seed=2)
    ds = CaptionedImages(
        [Item(p, repeats=3) for p in sorted(tmp_path.glob("*.png"))], resolution=64, random_flip=0.5
    )
    enc = CountingEncoder()
    cache = LatentCache(None, identity="v")
    n = cache.precompute(ds, enc, epochs=range(4), batch_size=4)
    assert n == enc.images <= 4  # at most 2 images x (flipped, not flipped)
    assert n >= 3
    assert ds.epoch == 0
    for epoch in range(4):
        ds.set_epoch(epoch)
        for i in range(len(ds)):
            assert ds[i] in cache
    ds.set_epoch(9)
    assert cache.precompute(ds, enc, epochs=[9]) == 0  # both flips of both images are there already


@pytest.mark.parametrize(
    "opts, loads",
    [
        ({}, 2),  # a centre crop, no flip: one sample of each image
        ({"random_flip": 0.5}, 4),  # at most each image flipped and not
        ({"center_crop": False}, 2 * 3 * 4),  # a random crop per epoch and sample: each its own
    ],
)
def test_latent_cache_precompute_loads_each_variant_once(tmp_path, monkeypatch, opts, loads):
    """The precompute read, decoded and resized every repeat of every image in every epoch to find its key: 8
    PNGs at 10 repeats x 10 epochs took 40 s for 8 latents. It loads one sample of each variant (image, size,
    crop, flip), and every sample trained is in the cache after it."""
    noise(tmp_path / "a.png", size=(96, 64), seed=1)
    noise(tmp_path / "b.png", size=(64, 64), seed=2)
    ds = CaptionedImages([Item(p, repeats=3) for p in sorted(tmp_path.glob("*.png"))], resolution=64, **opts)
    loaded = []
    real = CaptionedImages._sample
    monkeypatch.setattr(CaptionedImages, "_sample", lambda self, i, *a: loaded.append(i) or real(self, i, *a))
    cache = LatentCache(None, identity="v")
    cache.precompute(ds, CountingEncoder(), epochs=range(4))
    assert len(loaded) <= loads and (len(loaded) == loads or opts.get("random_flip"))
    for epoch in range(4):
        ds.set_epoch(epoch)
        assert all(ds[i] in cache for i in range(len(ds)))


def test_vae_identity_tells_weights_apart():
    from diffusers import AutoencoderKL

    cfg = dict(block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=8)
    torch.manual_seed(0)
    a = AutoencoderKL(**cfg)
    torch.manual_seed(0)
    same = AutoencoderKL(**cfg)
    torch.manual_seed(1)
    other = AutoencoderKL(**cfg)
    assert vae_identity(a) == vae_identity(same)
    assert vae_identity(a) != vae_identity(other)
    assert vae_identity(a, "mode") != vae_identity(a, "sample")
    assert len(vae_identity(a)) == 16


def test_caching_latents_shows_its_progress(tmp_path, capsys, fresh_accelerator_state):
    """A VAE pass over every sample of every epoch (minutes on a real dataset) printed nothing until its
    'latent cache: N encoded' line at the end."""
    from accelerate import Accelerator
    from diffusers import AutoencoderKL
    from sdplan.trainer.latents import precompute_latents

    for i in range(3):
        noise(tmp_path / f"{i}.png", size=(64, 64), seed=i)
    ds = CaptionedImages([Item(p) for p in sorted(tmp_path.glob("*.png"))], resolution=64, random_flip=0.5)
    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=8)
    precompute_latents(Accelerator(cpu=True), LatentCache(None, identity="v"), vae, [ds], epochs=2)
    lines = capsys.readouterr().out.splitlines()
    assert "caching latents: sample 1/6" in lines[0]
    assert any(line.startswith("caching latents: sample 6/6") for line in lines)
    assert lines[-1].startswith("latent cache: ")
