"""What a new user's dataset holds and the first run tripped on: captions saved by Windows editors (a UTF-8
byte-order mark, UTF-16, a legacy code page) and 16-bit grayscale PNGs."""

from __future__ import annotations

import codecs
from pathlib import Path

import numpy as np
import pytest
from conftest import one_line_error
from PIL import Image
from sdplan.trainer.dataset_scan import scan
from typer.testing import CliRunner

from sdplan.cli import app
from sdplan.errors import DatasetError


def picture(path: Path) -> Path:
    Image.new("RGB", (32, 32), (10, 20, 30)).save(path)
    return path


def captions(folder: Path) -> dict[str, str | None]:
    return {it.path.name: it.caption for it in scan(folder).items}


def test_a_byte_order_mark_is_not_part_of_the_caption(tmp_path):
    picture(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(codecs.BOM_UTF8 + b"a photo of sks dog\r\nsecond line\r\n")
    assert captions(tmp_path) == {"a.png": "a photo of sks dog"}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])
def test_a_utf16_caption_reads_as_its_text(tmp_path, encoding):
    picture(tmp_path / "a.png")
    raw = "café au lait".encode(encoding)
    if encoding == "utf-16-be":
        raw = codecs.BOM_UTF16_BE + raw
    (tmp_path / "a.txt").write_bytes(raw)
    assert captions(tmp_path) == {"a.png": "café au lait"}


def test_a_caption_in_another_encoding_is_an_error_naming_it(tmp_path):
    picture(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("café au lait".encode("cp1252"))
    with pytest.raises(DatasetError, match=r"a\.txt is not UTF-8 text"):
        scan(tmp_path)
    result = CliRunner().invoke(
        app, ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--dataset", str(tmp_path)]
    )
    one_line_error(result, 2, "a.txt", "UTF-8")


def test_a_16_bit_grayscale_png_keeps_its_gray(tmp_path):
    from sdplan.trainer.data import CaptionedImages

    path = tmp_path / "scan.png"
    Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(path)
    with Image.open(path) as im:
        assert im.mode.startswith("I")  # how PIL opens it: a plain convert("RGB") clips it to white
    pixels = CaptionedImages(scan(path.parent).items, resolution=32)[0]["pixel_values"]
    expected = round(40000 / 257) / 127.5 - 1.0  # 156 of 255: a mid gray
    assert pixels.shape == (3, 32, 32)
    assert abs(float(pixels.mean()) - expected) < 1e-3 and float(pixels.max() - pixels.min()) < 1e-6


def test_a_large_photo_trains_without_a_dos_attack_warning_and_a_huge_one_is_skipped(tmp_path, monkeypatch):
    import warnings

    from sdplan.trainer.data import CaptionedImages

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # as a 100-megapixel photo against PIL's 89.5
    Image.new("RGB", (40, 40), (90, 90, 90)).save(tmp_path / "large.png")  # 1600 pixels: PIL warns
    Image.new("RGB", (50, 50), (90, 90, 90)).save(tmp_path / "huge.png")  # 2500 > 2 x 1000: PIL refuses
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = scan(tmp_path, verify=True)
        CaptionedImages(result.items, resolution=32, buckets=[(32, 32)])[0]
    assert [it.path.name for it in result.items] == ["large.png"]
    assert [(p.name, "too large" in why and "downscale" in why) for p, why in result.skipped] == [
        ("huge.png", True)
    ]
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)], seen


def test_a_metadata_json_with_a_byte_order_mark_is_read(tmp_path):
    picture(tmp_path / "0001.png")
    (tmp_path / "0001.json").write_bytes(codecs.BOM_UTF8 + b'{"tags": ["sks dog", "grass"], "score": 7}')
    result = scan(tmp_path)
    assert (result.format, [it.caption for it in result.items]) == ("metadata", ["sks dog, grass"])


def test_symlinked_folders_are_followed_and_a_link_loop_is_not(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a", "b"):
        picture(photos / f"{name}.png")
    kohya = tmp_path / "kohya"
    kohya.mkdir()
    (kohya / "10_sks dog").symlink_to(photos, target_is_directory=True)
    (kohya / "10_sks dog_again").symlink_to(photos, target_is_directory=True)
    (photos / "loop").symlink_to(kohya, target_is_directory=True)  # photos/loop/10_sks dog/loop/...
    result = scan(kohya)
    assert (result.format, result.num_images, result.images_x_repeats) == ("kohya", 4, 40)
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "photos").symlink_to(photos, target_is_directory=True)
    (flat / "self").symlink_to(flat, target_is_directory=True)
    assert sorted(it.path.name for it in scan(flat).items) == ["a.png", "b.png"]


def test_class_data_that_is_a_file_is_one_error_not_a_traceback(tmp_path):
    from types import SimpleNamespace

    from sdplan.trainer.recipes.dreambooth import _generate_class_images

    photo = picture(tmp_path / "dog.png")
    cfg = SimpleNamespace(dreambooth=SimpleNamespace(num_class_images=2, class_prompt="a dog"))
    with pytest.raises(DatasetError, match=r"class_data .*dog\.png is a file, not a folder"):
        # it reached class_dir.mkdir(): FileExistsError, a traceback after the model had loaded
        _generate_class_images(SimpleNamespace(is_main_process=True), None, cfg, photo, {(64, 64): 1})


def test_a_kohya_project_as_class_data_is_refused_before_any_model_loads(tmp_path, tiny_sd15):
    """kohya_ss's project folder given as dreambooth.class_data failed in the trainer, after the models loaded,
    naming --dataset (the instance folder) as the fix."""
    for f in ("ds/a.png", "proj/img/10_sks dog/b.png", "proj/reg/1_dog/c.png"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        picture(tmp_path / f)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app,
        [
            "train", "--method", "dreambooth", "--model", str(tiny_sd15), "--dataset", str(tmp_path / "ds"),
            "--out", str(out), "--dry-run", "training.device=cpu", "dreambooth.with_prior_preservation=true",
            f"dreambooth.class_data={tmp_path / 'proj'}", "dreambooth.class_prompt=dog",
        ],
    )  # fmt: skip
    one_line_error(
        result, 2, "a kohya project folder", f"set dreambooth.class_data={tmp_path / 'proj' / 'reg'}"
    )
    assert not out.exists()
