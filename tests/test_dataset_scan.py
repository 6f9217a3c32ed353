"""The dataset scan: layouts, captions, metadata filters, skipped files, clear errors, no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from limits import scaled
from PIL import Image
from sdplan.trainer.dataset_scan import require_images, scan

from sdplan.config import MetadataConfig
from sdplan.errors import DatasetError


def img(path: Path, size=(32, 24), color=(200, 30, 30)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG", ".png": "PNG", ".webp": "WEBP", ".bmp": "BMP"}[
        path.suffix.lower()
    ]
    Image.new("RGB", size, color).save(path, format=fmt)
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def truncated_png(path: Path) -> Path:
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    noise.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def names(result) -> dict[str, str | None]:
    return {it.path.name: it.caption for it in result.items}


def skipped(result) -> dict[str, str]:
    return {Path(p).name: why for p, why in result.skipped}


# -- flat -------------------------------------------------------------------------------------------------


def test_flat_images_captions_and_defaults(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / "a.txt", "\n  a red square  \nsecond line ignored\n")
    img(tmp_path / "b.JPG")
    img(tmp_path / "c.webp")
    write(tmp_path / "c.txt", "   \n")  # empty caption file counts as missing
    img(tmp_path / "sub" / "d.bmp")
    write(tmp_path / "sub" / "d.txt", "nested")

    result = scan(tmp_path, repeats=3)
    assert result.format == "flat"
    assert names(result) == {"a.png": "a red square", "b.JPG": None, "c.webp": None, "d.bmp": "nested"}
    assert result.num_images == 4
    assert result.images_x_repeats == 12
    assert result.skipped == []
    assert all(it.repeats == 3 for it in result.items)

    with_default = scan(tmp_path, default_caption="a photo")
    assert names(with_default)["b.JPG"] == "a photo"
    assert names(with_default)["a.png"] == "a red square"


def test_caption_extension_with_or_without_dot(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / "a.caption", "from caption file")
    write(tmp_path / "a.txt", "from txt")
    for ext in (".caption", "caption"):
        result = scan(tmp_path, caption_extension=ext)
        assert names(result) == {"a.png": "from caption file"}
        assert skipped(result) == {"a.txt": skipped(result)["a.txt"]}  # .txt now is just another file
        # said as what it is: a caption of another extension, not an odd image
        assert skipped(result)["a.txt"] == "a .txt caption, not read: data.caption_extension is .caption"


def test_caption_files_in_another_case_are_read(tmp_path):
    """IMG_0001.JPG beside IMG_0001.TXT trained on the fallback caption without a word (images were taken in
    any case, their captions only in the extension's own)."""
    img(tmp_path / "IMG_0001.JPG")
    write(tmp_path / "IMG_0001.TXT", "a red square")
    img(tmp_path / "b.png")
    write(tmp_path / "b.Txt", "a blue one")
    result = scan(tmp_path)
    assert names(result) == {"IMG_0001.JPG": "a red square", "b.png": "a blue one"} and not result.skipped


def test_a_utf16_caption_without_its_byte_order_mark_is_an_error(tmp_path):
    """It decodes as UTF-8 to 'c\x00a\x00t\x00' and trained on that, counted as captioned."""
    img(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("a cat".encode("utf-16-le"))
    with pytest.raises(
        DatasetError, match=r"a\.txt holds NUL bytes \(UTF-16 text without a byte-order mark\?\)"
    ):
        scan(tmp_path)


def test_hugging_face_metadata_jsonl_captions_the_images_it_names(tmp_path):
    """diffusers' imagefolder layout (metadata.jsonl: file_name, text): its captions were ignored and every
    image trained on the fallback, the file listed as 'not a supported image type'."""
    img(tmp_path / "a.png")
    img(tmp_path / "sub" / "b.png")
    img(tmp_path / "c.png")
    write(tmp_path / "c.txt", "c from its own file")
    lines = [{"file_name": "a.png", "text": "a from jsonl"}, {"file_name": "sub/b.png", "caption": "b too"}]
    write(tmp_path / "metadata.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    result = scan(tmp_path)
    assert names(result) == {"a.png": "a from jsonl", "b.png": "b too", "c.png": "c from its own file"}
    assert not result.skipped
    write(tmp_path / "metadata.jsonl", '{"file_name": "a.png"\n')
    with pytest.raises(DatasetError, match=r"metadata\.jsonl: line 1 is not a JSON object .*Expecting"):
        scan(tmp_path)


def test_hugging_faces_metadata_csv_is_read_as_its_metadata_jsonl(tmp_path):
    """Hugging Face's imagefolder takes metadata.csv as it takes metadata.jsonl; it was listed as 'not a
    supported image type (.csv)' and the images trained on the fallback caption."""
    img(tmp_path / "a.png")
    img(tmp_path / "b.png")
    img(tmp_path / "c.png")
    write(tmp_path / "c.txt", "c from its file")
    write(tmp_path / "metadata.csv", 'file_name,text\na.png,csv a\nb.png,"csv, b"\ngone.png,x\n')
    result = scan(tmp_path)
    assert names(result) == {"a.png": "csv a", "b.png": "csv, b", "c.png": "c from its file"}
    assert skipped(result) == {"metadata.csv": "names images that are not in the dataset: gone.png"}
    write(tmp_path / "metadata.jsonl", json.dumps({"file_name": "a.png", "text": "jsonl a"}))
    assert names(scan(tmp_path))["a.png"] == "jsonl a"  # beside it, the .jsonl wins
    (tmp_path / "metadata.jsonl").unlink()
    write(tmp_path / "metadata.csv", "image,caption\na.png,x\n")
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    assert e.value.message.endswith("metadata.csv: its header row names no file_name column (image, caption)")
    # a space after the comma is not part of the column's name
    write(tmp_path / "metadata.csv", "file_name, text\na.png, spaced a\n")
    assert names(scan(tmp_path))["a.png"] == "spaced a"
    # a caption starting with a quoted word reads as pandas (Hugging Face's reader) reads it
    write(tmp_path / "metadata.csv", 'file_name,text\na.png,"Starry Night" style painting of a dog\n')
    assert names(scan(tmp_path))["a.png"] == "Starry Night style painting of a dog"
    # an unclosed quote: the rest of the file was read as one caption, the other images had none
    write(tmp_path / "metadata.csv", 'file_name,text\na.png,"a dog\nb.png,b cat\n')
    with pytest.raises(DatasetError, match="a quote is not closed"):
        scan(tmp_path)
    # an open quote after a line strict CSV refuses, which the quote check read past
    write(tmp_path / "metadata.csv", 'file_name,text\na.png,"a cat" on a mat\nb.png,"a dog\nc.png,a bird\n')
    with pytest.raises(DatasetError, match="a quote is not closed"):
        scan(tmp_path)
    # an inch mark is no quote (as pandas reads it)
    write(tmp_path / "metadata.csv", 'file_name,text\na.png,a 6" tall figurine\n')
    assert names(scan(tmp_path))["a.png"] == 'a 6" tall figurine'
    # an unquoted comma cut the caption to its first part; the line named past a blank line is its own
    write(tmp_path / "metadata.csv", "file_name,text\n\nb.png,b\n\na.png,red, blue and green dog\n")
    with pytest.raises(DatasetError, match="line 5 has more fields than its header row"):
        scan(tmp_path)
    img(tmp_path / "10_dog" / "d.png")
    write(tmp_path / "10_dog" / "metadata.csv", "file_name,text\nd.png,x\n")
    (tmp_path / "metadata.csv").unlink()
    reason = skipped(scan(tmp_path))["metadata.csv"]
    assert reason.startswith("Hugging Face's metadata.csv: read in a flat dataset folder")


def test_a_downloaders_json_among_captioned_images_keeps_their_captions(tmp_path):
    """gallery-dl writes a.png.json beside a.png: one such file turned the whole folder into the metadata
    layout, every other image skipped ('no .json record describes this image') and its caption dropped; the
    record's own image was not found either (a.png.png). The image's own caption file is what trains, not the
    record's tags (they replaced the caption the user wrote without a word): the note says so."""
    for n in "abc":
        img(tmp_path / f"{n}.png")
        write(tmp_path / f"{n}.txt", f"{n} captioned")
    write(tmp_path / "c.png.json", json.dumps({"category": "pixiv", "tags": ["red", "circle"]}))
    result = scan(tmp_path)
    assert names(result) == {"a.png": "a captioned", "b.png": "b captioned", "c.png": "c captioned"}
    assert not result.skipped
    assert result.notes == [
        "1 image (c.png) has both a .txt caption and a .json record: the .txt caption trains, the record only "
        "selects (skip_tags, min_score); remove the .txt to train on its tags"
    ]
    write(tmp_path / "d.png.json", json.dumps({"tags": ["blue"]}))  # its record alone: the tags train
    img(tmp_path / "d.png")
    write(tmp_path / "old.txt", "no image of this name")
    result = scan(tmp_path)
    assert names(result)["d.png"] == "blue"
    assert skipped(result) == {
        "old.txt": "caption file without an image of the same name"
    }  # as in a flat folder
    # the record still selects: its skip tag leaves the image out, caption file or not
    assert "c.png" not in names(scan(tmp_path, metadata=MetadataConfig(skip_tags=["red"])))


def test_a_kohya_folder_named_by_a_year_says_its_repeats(tmp_path):
    img(tmp_path / "2023_summer" / "a.png")
    img(tmp_path / "10_dog" / "b.png")
    result = scan(tmp_path)
    assert result.images_x_repeats == 2033
    assert result.notes == [
        "folder 2023_summer: 2023 repeats (kohya reads the number before '_' as repeats; a date or an id there "
        "multiplies the epoch: rename it, e.g. 1_2023_summer)"
    ]


def test_hidden_files_are_ignored_silently(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / ".DS_Store", "junk")
    img(tmp_path / ".thumbs" / "x.png")
    result = scan(tmp_path)
    assert names(result) == {"a.png": None}
    assert result.skipped == []


# -- kohya ------------------------------------------------------------------------------------------------


def test_kohya_folders_repeats_and_folder_name_captions(tmp_path):
    img(tmp_path / "10_sks dog" / "1.png")
    write(tmp_path / "10_sks dog" / "1.txt", "sks dog on grass")
    img(tmp_path / "10_sks dog" / "2.jpg")
    img(tmp_path / "3_style_x" / "3.png")
    img(tmp_path / "loose.png")
    img(tmp_path / "misc" / "4.png")
    img(tmp_path / "misc" / "5.png")

    result = scan(tmp_path, default_caption="unused in kohya", repeats=7)
    assert result.format == "kohya"
    by_name = {it.path.name: (it.caption, it.repeats) for it in result.items}
    assert by_name == {
        "1.png": ("sks dog on grass", 10),
        "2.jpg": ("sks dog", 10),  # no caption file: the folder's name part
        "3.png": ("style_x", 3),  # only the first underscore splits
    }
    assert result.images_x_repeats == 23
    why = skipped(result)
    assert set(why) == {"loose.png", "misc"}
    assert "N_name" in why["loose.png"]
    assert "2 files ignored" in why["misc"]


def test_a_kohya_project_folder_is_refused_naming_its_image_folder(tmp_path):
    """kohya_ss's project folder (img/10_sks dog, reg/1_dog) given as the dataset was scanned flat: the class
    images trained as instance images, the repeats and the folders' captions dropped, nothing said (kohya
    itself finds no image folder there)."""
    img(tmp_path / "img" / "10_sks dog" / "a.png")
    img(tmp_path / "img" / "5_other" / "c.png")
    img(tmp_path / "reg" / "1_dog" / "r.png")
    (tmp_path / "model").mkdir()
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg
    assert e.value.message == (
        f"dataset folder {tmp_path} holds no kohya N_name folder, but img/ holds 2 such folders (10_sks dog): "
        "a kohya project folder, not its image folder"
    )
    assert e.value.fix.startswith(
        f"pass --dataset {tmp_path / 'img'} instead; reg/ holds class (regularization) "
    )
    assert e.value.fix.endswith(
        f"dreambooth.with_prior_preservation=true dreambooth.class_data={tmp_path / 'reg'} dreambooth.class_prompt=dog"
    )
    # what it names scans as kohya: the images with their repeats, the class folder too
    assert scan(tmp_path / "img").images_x_repeats == 15
    assert scan(tmp_path / "reg").format == "kohya"
    # without a reg folder: only the folder to pass
    import shutil

    shutil.rmtree(tmp_path / "reg")
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    assert e.value.fix == f"pass --dataset {tmp_path / 'img'} instead"


def test_a_kohya_project_folder_as_class_data_names_its_reg_folder(tmp_path):
    """The same project given as dreambooth.class_data said "pass --dataset .../img", the instance folder."""
    img(tmp_path / "img" / "10_sks dog" / "a.png")
    img(tmp_path / "reg" / "1_dog" / "r.png")
    (tmp_path / "model").mkdir()
    with pytest.raises(DatasetError) as e:
        scan(tmp_path, setting="dreambooth.class_data")
    assert e.value.message.startswith(
        f"dreambooth.class_data {tmp_path} holds no kohya N_name folder, but reg/"
    )
    assert e.value.fix == f"set dreambooth.class_data={tmp_path / 'reg'} instead"
    # without a reg/ folder its N_name folders are the instance images: never named as the class images
    import shutil

    shutil.rmtree(tmp_path / "reg")
    with pytest.raises(DatasetError) as e:
        scan(tmp_path, setting="dreambooth.class_data")
    assert "no regularization (reg/) folder: img/ holds its instance images" in e.value.message
    assert "img" not in e.value.fix


def test_a_folder_of_photos_with_dated_subfolders_stays_flat(tmp_path):
    """photos/2023_summer looks like a kohya N_name folder one level down: a flat dataset with its own images, or
    without kohya_ss's project folders (img/, reg/, log/, model/), was refused as a kohya project."""
    img(tmp_path / "own" / "a.png")
    img(tmp_path / "own" / "photos" / "2023_summer" / "c.png")
    img(tmp_path / "own" / "photos" / "2024_winter" / "d.png")
    assert (scan(tmp_path / "own").format, scan(tmp_path / "own").num_images) == ("flat", 3)
    img(tmp_path / "only" / "trips" / "10_summer" / "c.png")
    assert scan(tmp_path / "only").format == "flat"
    # beside kohya_ss's log/ and model/ it is a project
    (tmp_path / "only" / "log").mkdir()
    with pytest.raises(DatasetError, match="a kohya project folder"):
        scan(tmp_path / "only")
    # a year is no count of repeats, and "reg" is a word, not any name holding it (Greg, Oregon)
    img(tmp_path / "years" / "images" / "2023_summer" / "c.png")
    img(tmp_path / "years" / "Greg" / "2019_christmas" / "d.png")
    img(tmp_path / "years" / "Oregon" / "21_coast" / "e.png")
    assert scan(tmp_path / "years").format == "flat"
    # a kohya_ss project with a cover image at its root is still one
    img(tmp_path / "proj" / "cover.png")
    img(tmp_path / "proj" / "img" / "10_sks dog" / "a.png")
    img(tmp_path / "proj" / "reg" / "1_dog" / "r.png")
    (tmp_path / "proj" / "log").mkdir()
    with pytest.raises(DatasetError, match="a kohya project folder"):
        scan(tmp_path / "proj")


def test_a_kohya_folder_with_no_name_trains_as_kohya_reads_it(tmp_path):
    """kohya reads 2_ as 2 repeats with an empty class token (it splits the name at the first '_'); it was
    'folder not named N_name (1 file ignored; e.g. 10_2_)'. Its images train; those without a caption file are
    said."""
    img(tmp_path / "2_" / "y.png")
    img(tmp_path / "2_" / "z.png")
    write(tmp_path / "2_" / "z.txt", "z captioned")
    img(tmp_path / "3_cat_black" / "x.png")
    result = scan(tmp_path)
    assert not result.skipped
    assert names(result) == {"y.png": None, "z.png": "z captioned", "x.png": "cat_black"}
    assert result.images_x_repeats == 7
    assert result.notes == [
        "folder 2_: no name after the repeats (kohya's class token, the caption of an image without a caption "
        "file); 1 image there has none"
    ]


# -- metadata ---------------------------------------------------------------------------------------------


def _record(json_path: Path, /, **fields) -> Path:
    return write(json_path, json.dumps(fields))


def test_metadata_layout_path_fields_and_tag_forms(tmp_path):
    img(tmp_path / "images" / "a.png")
    img(tmp_path / "images" / "b.png")
    img(tmp_path / "deep" / "c.png")
    img(tmp_path / "deep" / "d.webp")
    img(tmp_path / "e.png")
    _record(tmp_path / "meta" / "a.json", path="images/a.png", tags=["cat", "outdoors"], score=5)
    _record(tmp_path / "meta" / "b.json", image="images/b.png", tags="dog, indoors ,, ", score="3")
    _record(tmp_path / "deep" / "c.json", file_name="c.png", tags=[])  # relative to the json folder
    _record(tmp_path / "deep" / "d.json", tags=["beside"])  # no path: the same-name image beside it
    # e.png has no record

    result = scan(tmp_path, repeats=2)
    assert result.format == "metadata"
    items = {it.path.name: it for it in result.items}
    assert set(items) == {"a.png", "b.png", "c.png", "d.webp"}
    assert items["a.png"].caption == "cat, outdoors"
    assert items["a.png"].tags == ["cat", "outdoors"]
    assert items["a.png"].score == 5.0
    assert items["b.png"].tags == ["dog", "indoors"]
    assert items["b.png"].score == 3.0
    assert items["c.png"].caption is None and items["c.png"].score is None
    assert items["d.webp"].caption == "beside"
    assert all(it.repeats == 2 for it in result.items)
    assert items["a.png"].path == tmp_path / "images" / "a.png"
    assert skipped(result) == {"e.png": "no .json record describes this image, and it has no caption file"}


def test_metadata_filters(tmp_path):
    def rec(name, tags, score=None):
        img(tmp_path / f"{name}.png")
        fields = {"path": f"{name}.png", "tags": tags}
        if score is not None:
            fields["score"] = score
        _record(tmp_path / f"{name}.json", **fields)

    rec("keep", ["rating:safe", "cat", "watermark"], 6)
    rec("skipped_tag", ["cat", "nsfw"], 9)
    rec("skipped_replaced_form", ["rating=explicit"], 9)  # matches skip_tags entry after replacement
    rec("low", ["cat"], 2)
    rec("bonus", ["cat", "masterpiece"], 2)  # 2 + 5 bonus = 7 >= min_score
    rec("noscore", ["masterpiece"])  # missing score counts as 0; + 5 = 5 >= 4
    rec("top", ["cat"], 9.5)

    meta = MetadataConfig(
        skip_tags=["nsfw", "rating:explicit"],
        remove_tags=["watermark", "rating=safe"],
        replace={":": "="},
        min_score=4,
        score_bonus={"masterpiece": 5},
        score_buckets=[9, 5, 7],  # unsorted on purpose
    )
    result = scan(tmp_path, metadata=meta)
    items = {it.path.stem: it for it in result.items}
    assert set(items) == {"keep", "bonus", "noscore", "top"}
    assert items["keep"].tags == ["cat", "score_5"]  # rating=safe removed (replaced form), watermark removed
    assert items["bonus"].score == 7 and items["bonus"].tags == ["cat", "masterpiece", "score_7"]
    assert items["noscore"].score == 5 and items["noscore"].tags == ["masterpiece", "score_5"]
    assert items["top"].tags == ["cat", "score_9"]
    assert items["keep"].caption == "cat, score_5"
    why = skipped(result)
    assert why["skipped_tag.png"] == "has skip tag 'nsfw'"
    assert why["skipped_replaced_form.png"] == "has skip tag 'rating=explicit'"
    assert why["low.png"] == "score 2 < min_score 4"
    assert len(result.skipped) == 3


def test_metadata_replace_keeps_tags_without_filters(tmp_path):
    img(tmp_path / "a.png")
    _record(tmp_path / "a.json", path="a.png", tags=["artist:foo", "a:b:c"])
    result = scan(tmp_path, metadata=MetadataConfig(replace={":": "="}))
    assert result.items[0].tags == ["artist=foo", "a=b=c"]
    assert result.items[0].caption == "artist=foo, a=b=c"


def test_metadata_bad_records_each_listed_once(tmp_path):
    img(tmp_path / "ok.png")
    _record(tmp_path / "ok.json", path="ok.png", tags=["x"])
    _record(tmp_path / "missing.json", path="nowhere/gone.png", tags=["x"])
    _record(tmp_path / "dup.json", image="ok.png", tags=["y"])
    _record(tmp_path / "badtags.json", path="ok2.png", tags=5)
    img(tmp_path / "ok2.png")
    write(tmp_path / "list.json", "[1, 2]")
    result = scan(tmp_path)
    assert [it.path.name for it in result.items] == ["ok.png"]
    assert result.items[0].tags == ["y"]
    why = skipped(result)
    assert "'nowhere/gone.png' (path) was not found" in why["missing.json"]
    # dup.json comes first in path order, so ok.json is the second record of ok.png
    assert why["ok.json"] == "describes the same image as dup.json"
    assert "dup.json" not in why
    assert "tags must be a list" in why["badtags.json"]
    assert why["list.json"].startswith("not a metadata record")
    paths = [p for p, _ in result.skipped]
    assert len(paths) == len(set(paths))


def test_json_that_is_no_record_leaves_flat_layout(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / "settings.json", json.dumps({"lr": 1}))
    result = scan(tmp_path)
    assert result.format == "flat"
    assert names(result) == {"a.png": None}
    assert "settings.json" in skipped(result)


# -- broken files -----------------------------------------------------------------------------------------


def _broken_folder(root: Path) -> None:
    img(root / "good.png", size=(40, 20))
    write(root / "good.txt", "fine")
    (root / "corrupt.png").write_bytes(os.urandom(300))
    (root / "empty.png").write_bytes(b"")
    truncated_png(root / "truncated.png")
    write(root / "orphan.txt", "caption of nothing")
    write(root / "notes.pdf", "%PDF-1.4")
    img(root / "anim.png").rename(root / "anim.gif")


def test_verify_skips_each_broken_file_once_with_reason(tmp_path):
    _broken_folder(tmp_path)
    result = scan(tmp_path, verify=True)
    assert [it.path.name for it in result.items] == ["good.png"]
    assert result.items[0].size == (40, 20)
    why = skipped(result)
    assert set(why) == {"corrupt.png", "empty.png", "truncated.png", "orphan.txt", "notes.pdf", "anim.gif"}
    assert len(result.skipped) == 6
    assert why["corrupt.png"].startswith("not an image PIL can read")
    assert why["empty.png"] == "empty file (0 bytes)"
    assert why["truncated.png"].startswith(("truncated", "corrupt"))
    assert why["orphan.txt"] == "caption file without an image of the same name"
    assert why["notes.pdf"].startswith("not a supported image type (.pdf)")
    assert why["anim.gif"].startswith("not a supported image type (.gif)")


def test_without_verify_only_empty_files_are_caught(tmp_path):
    _broken_folder(tmp_path)
    result = scan(tmp_path)
    assert sorted(it.path.name for it in result.items) == ["corrupt.png", "good.png", "truncated.png"]
    assert skipped(result)["empty.png"] == "empty file (0 bytes)"
    assert all(it.size is None for it in result.items)


def test_image_with_wrong_extension_content(tmp_path):
    img(tmp_path / "really_a_jpeg.png").write_bytes((img(tmp_path / "x.jpg")).read_bytes())
    (tmp_path / "x.jpg").unlink()
    result = scan(tmp_path, verify=True)
    assert [it.path.name for it in result.items] == ["really_a_jpeg.png"]  # PIL reads by content: fine


def test_broken_images_come_first_and_are_named(tmp_path):
    """A truncated photo hid in 'and 1 more' behind Thumbs.db, desktop.ini and notes.md, which came first by
    name; the broken images are named (up to BROKEN_NAMED past the first reasons), the others counted."""
    for n in range(3):
        img(tmp_path / f"p{n}.png")
    truncated_png(tmp_path / "vacation.png")
    truncated_png(tmp_path / "z.png")
    (tmp_path / "zz.png").write_bytes(b"")
    for junk in ("Thumbs.db", "desktop.ini", "notes.md"):
        write(tmp_path / junk, "x")
    result = scan(tmp_path, verify=True)
    assert [p.name for p, _ in result.skipped[:3]] == ["vacation.png", "z.png", "zz.png"]
    assert result.broken == {tmp_path / "vacation.png", tmp_path / "z.png", tmp_path / "zz.png"}
    text = result.skipped_text(limit=1)
    assert text.startswith("vacation.png: truncated")
    assert text.endswith("; and 5 more (2 broken images: z.png, zz.png)")
    # a thousand of them: the first named, the rest counted (naming them all made a 13 KB line)
    for n in range(1000):
        (tmp_path / f"bad{n:04d}.png").write_bytes(b"")
    many = scan(tmp_path, verify=True).skipped_text()
    assert len(many) < 500 and many.endswith(f"{1003 - 3 - 8} more)"), many


def test_photos_of_an_unread_format_are_said_once_and_to_convert(tmp_path):
    """A folder of iPhone photos: each .HEIC was listed with the same reason, and the fix said 'replace or
    remove the broken files'; they are not broken."""
    for n in range(4):
        write(tmp_path / f"IMG_000{n}.HEIC", "heic")
    with pytest.raises(DatasetError) as e:
        require_images(scan(tmp_path, verify=True))
    assert e.value.message == (
        f"no readable images in {tmp_path} (4 skipped: 4 files (IMG_0000.HEIC, IMG_0001.HEIC, ...): not a "
        "supported image type (.heic); convert to jpg or png)"
    )
    assert e.value.fix == "convert the .heic files to jpg or png"
    (tmp_path / "bad.png").write_bytes(b"garbage")
    with pytest.raises(DatasetError) as e:
        require_images(scan(tmp_path, verify=True))
    assert "(5 skipped: bad.png: not an image PIL can read" in e.value.message
    assert e.value.fix == "replace or remove the broken files; convert the .heic files to jpg or png"
    for f in tmp_path.iterdir():
        f.unlink()
    write(tmp_path / "notes.md", "x")  # nothing broken, nothing to convert: what a dataset holds
    with pytest.raises(DatasetError) as e:
        require_images(scan(tmp_path))
    assert "broken" not in str(e.value) and e.value.fix.startswith("put png, jpg")


# -- errors -----------------------------------------------------------------------------------------------


def test_missing_folder_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        scan(tmp_path / "nope")
    f = img(tmp_path / "a.png")
    with pytest.raises(DatasetError, match="not a folder"):
        scan(f)


def test_empty_folder_is_a_clear_error(tmp_path):
    result = scan(tmp_path)
    assert result.items == [] and result.skipped == []
    with pytest.raises(DatasetError) as e:
        require_images(result)
    msg = str(e.value)
    assert f"no readable images in {tmp_path}" in msg
    assert "\n" not in msg
    assert "png" in e.value.fix


def test_folder_of_broken_files_names_them(tmp_path):
    (tmp_path / "a.png").write_bytes(b"garbage!" * 10)
    truncated_png(tmp_path / "b.png")
    (tmp_path / "c.png").write_bytes(b"")
    (tmp_path / "d.png").write_bytes(b"more garbage" * 3)
    result = scan(tmp_path, verify=True)
    with pytest.raises(DatasetError) as e:
        require_images(result)
    msg = str(e.value)
    assert "(4 skipped: a.png: not an image PIL can read" in msg
    assert "b.png: " in msg and "c.png: empty file (0 bytes)" in msg
    assert "and 1 more" in msg
    assert "\n" not in msg


def test_require_images_returns_the_scan(tmp_path):
    img(tmp_path / "a.png")
    result = scan(tmp_path)
    assert require_images(result) is result
    assert "flat: 1 image" in result.summary()
    assert result.to_dict()["num_images"] == 1


# -- speed and imports ------------------------------------------------------------------------------------


def test_scan_of_many_files_imports_no_torch(tmp_path):
    tiny = tmp_path / "many"
    tiny.mkdir()
    data = tmp_path / "seed.png"
    Image.new("RGB", (2, 2), (1, 2, 3)).save(data)
    raw = data.read_bytes()
    for i in range(1000):
        (tiny / f"{i:04d}.png").write_bytes(raw)
        if i % 2:
            (tiny / f"{i:04d}.txt").write_text(f"caption {i}")
    code = (
        "import sys\n"
        "from sdplan.trainer.dataset_scan import scan\n"
        "import sdplan.trainer.buckets\n"
        f"r = scan({str(tiny)!r})\n"
        "assert r.num_images == 1000, r.num_images\n"
        "assert sum(1 for it in r.items if it.caption) == 500\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'PIL' not in sys.modules, 'PIL imported without verify'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_kohya_captions_file_captions_the_images_it_names(tmp_path):
    """kohya's meta_cap.json (image name -> caption and tags, from sd-scripts' merge_captions_to_metadata.py)
    was skipped as 'not a supported image type (.json)' and every image trained on the fallback caption. Its
    captions come first (caption, then tags, as sd-scripts joins them); an image it does not name keeps its
    caption file; full-path keys match too."""
    for name in ("a", "b", "c", "d"):
        Image.new("RGB", (64, 64)).save(tmp_path / f"{name}.png")
    (tmp_path / "c.txt").write_text("from the caption file")
    meta = {
        "a": {"caption": "a red cat", "tags": "cat, red"},
        "b": {"tags": "dog", "train_resolution": [512, 512]},
        str(tmp_path / "d"): {"caption": "by its full path"},
    }
    (tmp_path / "meta_cap.json").write_text(json.dumps(meta))
    result = scan(tmp_path)
    assert result.format == "flat" and not result.skipped
    assert {it.path.name: it.caption for it in result.items} == {
        "a.png": "a red cat, cat, red",
        "b.png": "dog",
        "c.png": "from the caption file",
        "d.png": "by its full path",
    }


def test_a_kohya_captions_file_matches_full_paths_through_links_and_tag_lists(tmp_path):
    """Keys written as full paths through a link, read from the real folder (or the other way round), did not
    match, so `recommend` and `train` counted different captions; tags as a JSON list were dropped."""
    real = tmp_path / "real"
    real.mkdir()
    for name in ("a", "b"):
        Image.new("RGB", (64, 64)).save(real / f"{name}.png")
    (tmp_path / "link").symlink_to(real)
    meta = {str(tmp_path / "link" / "a.png"): {"caption": "by the link"}, "b": {"tags": ["x", "y"]}}
    (real / "meta_cap.json").write_text(json.dumps(meta))
    for root in (real, tmp_path / "link"):
        result = scan(root)
        assert {it.path.name: it.caption for it in result.items} == {"a.png": "by the link", "b.png": "x, y"}


@pytest.mark.parametrize(
    "meta, said",
    [
        (
            {"a": {"caption": 5}, "b": {"caption": "fine"}},
            'meta_cap.json: record "a" is not a kohya caption record {"caption": text, "tags": text}: its caption '
            "is 5, not text (fix the record, or move the file out of the dataset)",
        ),
        (
            {"a": {"caption": "red"}, "b": "blue", "c": {"tags": {"x": 1}}},
            'meta_cap.json: 2 records are not kohya caption records {"caption": text, "tags": text}; the first, '
            'record "b": it is "blue", not an object (fix the records, or move the file out of the dataset)',
        ),
    ],
)
def test_a_kohya_captions_file_with_a_malformed_record_is_an_error_naming_it(tmp_path, meta, said):
    """{"a": {"caption": 5}, "b": "blue"}: one record in error turned the whole meta_cap.json off, said as 'not
    a supported image type (.json)', and every image trained on the fallback caption. A bad line of a
    metadata.jsonl is an error naming it; so is a bad record of a kohya captions file. A record without caption
    or tags, or with null ones, is none (sd-scripts reads it as no caption): that image keeps its caption file."""
    for name in ("a", "b", "c"):
        img(tmp_path / f"{name}.png")
    write(tmp_path / "meta_cap.json", json.dumps(meta))
    with pytest.raises(DatasetError) as e:
        scan(tmp_path)
    assert str(e.value) == f"{tmp_path / said}"
    write(tmp_path / "c.txt", "its own")
    write(tmp_path / "meta_cap.json", json.dumps({"a": {"caption": "red"}, "b": {"caption": None}, "c": {}}))
    assert names(scan(tmp_path)) == {"a.png": "red", "b.png": None, "c.png": "its own"}


def test_a_json_file_that_is_no_captions_file_is_skipped_saying_so(tmp_path):
    """A .json in a flat folder that holds no kohya records (a name -> text mapping, a list, a settings file) was
    skipped as 'not a supported image type (.json)'; a kohya captions file in a subfolder is not read either."""
    img(tmp_path / "a.png")
    img(tmp_path / "sub" / "b.png")
    write(tmp_path / "names.json", json.dumps({"a": "red"}))
    write(tmp_path / "list.json", json.dumps([1, 2]))
    write(tmp_path / "sub" / "meta_cap.json", json.dumps({"b": {"caption": "blue"}}))
    result = scan(tmp_path)
    assert names(result) == {"a.png": None, "b.png": None}
    why = skipped(result)
    assert (
        why["names.json"]
        == why["list.json"]
        == (
            "a .json file that is no captions file, not read (kohya's meta_cap.json maps each image name to "
            '{"caption": text, "tags": text})'
        )
    )
    assert why["meta_cap.json"] == (
        "a kohya captions file in a subfolder, not read: it is read in the dataset folder itself"
    )


def test_a_link_that_loops_is_not_used_as_a_dangling_link_is(tmp_path):
    """`ln -s loop.png loop.png` in a dataset crashed recommend --dataset and train (Path.resolve: RuntimeError
    Symlink loop) in a flat folder, with a kohya captions file naming it, and in a metadata folder; it is listed
    as not used, as a link to a file that is gone is."""
    flat = tmp_path / "flat"
    img(flat / "ok.png")
    (flat / "loop.png").symlink_to("loop.png")
    (flat / "gone.png").symlink_to("nowhere.png")
    write(
        flat / "meta_cap.json",
        json.dumps({str(flat / "loop.png"): {"caption": "x"}, "ok": {"caption": "ok"}}),
    )
    result = scan(flat)
    assert names(result) == {"ok.png": "ok"}
    why = skipped(result)
    assert why["loop.png"].startswith("cannot be read (") and why["gone.png"].startswith("cannot be read (")

    meta = tmp_path / "meta"
    img(meta / "ok.png")
    (meta / "loop.png").symlink_to("loop.png")
    write(meta / "ok.json", json.dumps({"file_name": "ok.png", "tags": ["a"]}))
    write(meta / "l.json", json.dumps({"image": "loop.png", "tags": ["b"]}))
    result = scan(meta)
    assert names(result) == {"ok.png": "a"}
    assert set(skipped(result)) == {"l.json", "loop.png"}


def test_a_metadata_record_of_file_name_and_text_is_captioned(tmp_path):
    """Per-image .json records {"file_name", "text"} (Hugging Face's column names) were 'metadata: 0 captioned'."""
    img(tmp_path / "a.png")
    write(tmp_path / "a.json", json.dumps({"file_name": "a.png", "text": "a red square"}))
    assert names(scan(tmp_path)) == {"a.png": "a red square"}


def test_metadata_jsonl_is_per_image_and_says_what_it_cannot_use(tmp_path):
    """A root metadata.jsonl naming a.png captioned sub/a.png too (over its own caption file); a line of valid
    JSON that is no object was a traceback; names of images that are not there passed without a word."""
    img(tmp_path / "a.png")
    img(tmp_path / "sub" / "a.png")
    write(tmp_path / "sub" / "a.txt", "the sub folder's own")
    write(tmp_path / "metadata.jsonl", json.dumps({"file_name": "a.png", "text": "ROOT a"}) + "\n")
    result = scan(tmp_path)
    assert {_rel(it.path, tmp_path): it.caption for it in result.items} == {
        "a.png": "ROOT a",
        "sub/a.png": "the sub folder's own",
    }
    lines = [
        {"file_name": "a.png", "text": ""},
        {"file_name": "../x.png", "text": "t"},
        {"file_name": "gone.png"},
    ]
    write(tmp_path / "metadata.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    write(tmp_path / "sub" / "metadata.jsonl", json.dumps({"file_name": "a.png", "caption": "deeper wins"}))
    result = scan(tmp_path)
    assert {_rel(it.path, tmp_path): it.caption for it in result.items}["sub/a.png"] == "deeper wins"
    assert (
        skipped(result)["metadata.jsonl"] == "names images that are not in the dataset: ../x.png and 1 more"
    )
    for line in ("[1, 2]", "null", '"x"'):
        write(tmp_path / "metadata.jsonl", line + "\n")
        with pytest.raises(
            DatasetError, match=r"metadata\.jsonl: line 1 is not a JSON object with file_name"
        ):
            scan(tmp_path)


def test_metadata_jsonl_reads_through_linked_folders_and_names_only_its_own(tmp_path):
    """Images in a linked folder (the walk follows links: `ln -s ~/photos sub`) resolve outside the root: their
    jsonl captions were dropped and the file said to name images not in the dataset. A deeper file naming
    ../b.png captioned the root's b.png."""
    photos = tmp_path / "photos"
    img(photos / "a.png")
    root = tmp_path / "ds"
    root.mkdir()
    (root / "sub").symlink_to(photos, target_is_directory=True)
    img(root / "b.png")
    write(root / "metadata.jsonl", json.dumps({"file_name": "sub/a.png", "text": "linked"}) + "\n")
    write(root / "sub" / "metadata.jsonl", json.dumps({"file_name": "../b.png", "text": "from below"}) + "\n")
    result = scan(root)
    assert {_rel(it.path, root): it.caption for it in result.items} == {"sub/a.png": "linked", "b.png": None}
    assert skipped(result) == {"metadata.jsonl": "names images that are not in the dataset: ../b.png"}  # sub/


def test_metadata_jsonl_in_a_kohya_folder_is_said_to_be_unread(tmp_path):
    img(tmp_path / "10_dog" / "a.png")
    write(tmp_path / "10_dog" / "metadata.jsonl", json.dumps({"file_name": "a.png", "text": "x"}))
    reason = skipped(scan(tmp_path))["metadata.jsonl"]
    assert reason.startswith("Hugging Face's metadata.jsonl: read in a flat dataset folder")


def test_downloader_records_with_tags_by_category_or_none_keep_the_images(tmp_path):
    """e621's tags by category ({"general": [...]}) dropped the image (marked as described, then skipped with
    its record); an empty tags list trained it uncaptioned beside its caption file."""
    img(tmp_path / "a.png")
    write(tmp_path / "a.png.json", json.dumps({"tags": {"general": ["dog", "grass"], "artist": ["me"]}}))
    img(tmp_path / "b.png")
    write(tmp_path / "b.txt", "b from its file")
    write(tmp_path / "b.png.json", json.dumps({"tags": []}))
    img(tmp_path / "c.png")
    write(tmp_path / "c.txt", "c from its file")
    write(tmp_path / "c.png.json", json.dumps({"tags": 5, "score": 0.1}))  # unusable: its image is left out
    result = scan(tmp_path)  # (with its caption file it would pass any min_score unchecked)
    assert names(result) == {"a.png": "dog, grass, me", "b.png": "b from its file"}
    assert "tags must be a list" in skipped(result)["c.png.json"]


def test_record_captions_take_the_first_field_that_is_not_empty(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / "a.json", json.dumps({"file_name": "a.png", "caption": "", "text": "a dog"}))
    assert names(scan(tmp_path)) == {"a.png": "a dog"}


def test_two_caption_files_differing_in_case_read_one_and_say_the_other(tmp_path):
    img(tmp_path / "a.png")
    write(tmp_path / "a.TXT", "upper")
    write(tmp_path / "a.txt", "lower")
    result = scan(tmp_path)
    assert names(result) == {"a.png": "lower"}
    assert skipped(result) == {"a.TXT": "another caption file of the same image (a.txt is read)"}
    # the configured case is read first (data.caption_extension=.TXT read a.txt)
    result = scan(tmp_path, caption_extension=".TXT")
    assert names(result) == {"a.png": "upper"}
    assert skipped(result) == {"a.txt": "another caption file of the same image (a.TXT is read)"}


def test_a_utf32_caption_with_its_mark_is_read():
    from sdplan.trainer.dataset_scan import _decode_caption

    assert (
        _decode_caption(Path("a.txt"), "a cat".encode("utf-32")) == "a cat"
    )  # it trained as '\x00c\x00a...'


def test_a_pngs_exif_rotation_is_read_from_its_header(tmp_path):
    """`recommend` (header reads) took an EXIF-rotated PNG as stored and planned other buckets than train."""
    from sdplan.trainer.dataset_scan import check_image

    im = Image.new("RGB", (256, 96))
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(tmp_path / "r.png", exif=exif)
    assert check_image(tmp_path / "r.png", decode=False) == check_image(tmp_path / "r.png") == (96, 256)


def _rel(path, root):
    return Path(path).relative_to(root).as_posix()


def test_metadata_settings_on_a_dataset_without_json_records_are_said_to_do_nothing(tmp_path):
    """data.metadata.shuffle_tags / skip_tags on a kohya folder (or flat .txt captions) did nothing, silently."""
    from sdplan.trainer.dataset_scan import metadata_note

    from sdplan import config as C

    img(tmp_path / "10_sks dog" / "a.png")
    data = C.default_config()
    cfg = C.validate(data)
    assert metadata_note(scan(tmp_path), cfg) == ""
    data["data"]["metadata"] = {"shuffle_tags": 1.0, "skip_tags": ["red"]}
    note = metadata_note(scan(tmp_path), C.validate(data))
    assert note.startswith("data.metadata.skip_tags, data.metadata.shuffle_tags act on the tags")
    assert "this kohya dataset" in note
