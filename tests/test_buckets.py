"""Aspect-ratio buckets: shapes, assignment, batch sampling (seeded, per epoch, distributed)."""

from __future__ import annotations

import math
import re

import pytest
from sdplan.trainer.buckets import (
    BucketBatchSampler,
    assign_buckets,
    bucket_table,
    format_bucket_table,
    make_buckets,
    min_step,
    nearest_bucket,
)


def test_buckets_at_512_respect_budget_and_step():
    buckets = make_buckets(512)
    assert (512, 512) in buckets
    for w, h in buckets:
        assert w % 64 == 0 and h % 64 == 0
        assert w * h <= 512 * 512
        assert 256 <= w <= 1024 and 256 <= h <= 1024
        assert (h, w) in buckets  # every shape also turned
    # the tallest height that fits each width (as kohya makes them)
    assert (704, 320) in buckets and (768, 320) in buckets and (640, 384) in buckets
    assert (704, 384) not in buckets  # over budget
    ratios = [w / h for w, h in buckets]
    assert ratios == sorted(ratios)
    assert len(buckets) == len(set(buckets))


def test_step_rules():
    assert min_step("sdxl") == 32 and min_step("sd15") == 64 and min_step(None) == 64
    sdxl = make_buckets(1024, step=32)
    assert (1024, 1024) in sdxl and all(w % 32 == 0 and h % 32 == 0 for w, h in sdxl)
    assert any(w % 64 for w, _ in sdxl)  # finer shapes than the 64 step gives
    assert all(w * h <= 1024 * 1024 for w, h in sdxl)
    for bad in (16, 48, 0):
        with pytest.raises(ValueError, match="multiple of 32"):
            make_buckets(512, step=bad)
    # a resolution off the step: the square bucket rounds down, the budget holds
    assert (448, 448) in make_buckets(480)


@pytest.mark.parametrize(
    "size, expected",
    [
        ((500, 500), (512, 512)),
        ((1000, 500), (704, 320)),  # 2:1 -> 2.2 is nearer than 1.67 or 2.4
        ((500, 1000), (320, 704)),
        ((600, 400), (640, 384)),  # 1.5 -> 1.67 (log distance .105) beats 1.29 (.154)
        ((400, 600), (384, 640)),
        ((4000, 100), (1024, 256)),  # beyond the widest: the widest
        ((513, 512), (512, 512)),
    ],
)
def test_nearest_bucket(size, expected):
    buckets = make_buckets(512)
    assert buckets[nearest_bucket(size, buckets)] == expected


def test_nearest_bucket_rejects_empty_size():
    with pytest.raises(ValueError):
        nearest_bucket((0, 10), make_buckets(512))


def test_bucket_table_counts_images_and_samples():
    buckets = make_buckets(512)
    sizes = [(500, 500), (1000, 500), (1000, 500), (500, 1000)]
    assign = assign_buckets(sizes, buckets)
    rows = bucket_table(buckets, assign, repeats=[1, 10, 10, 2])
    assert [(r["width"], r["height"], r["images"], r["samples"]) for r in rows] == [
        (320, 704, 1, 2),
        (512, 512, 1, 1),
        (704, 320, 2, 20),
    ]
    assert rows[2]["aspect"] == round(704 / 320, 3)
    text = format_bucket_table(rows)
    assert "704x320" in text and len(text.splitlines()) == 4


def _ids():
    # 3 buckets: 7, 5 and 2 indices, interleaved
    return [0, 1, 0, 2, 1, 0, 0, 1, 0, 2, 1, 0, 1, 0]


def test_batches_come_from_one_bucket_and_cover_the_epoch():
    ids = _ids()
    s = BucketBatchSampler(ids, 3, seed=1)
    batches = list(s)
    assert len(batches) == len(s) == 3 + 2 + 1  # ceil(7/3) + ceil(5/3) + ceil(2/3)
    for b in batches:
        assert len({ids[i] for i in b}) == 1
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(ids)))


def test_drop_last_keeps_only_full_batches():
    ids = _ids()
    s = BucketBatchSampler(ids, 3, seed=1, drop_last=True)
    batches = list(s)
    assert len(batches) == len(s) == 2 + 1 + 0
    assert all(len(b) == 3 for b in batches)


def test_order_is_seeded_and_changes_per_epoch():
    ids = _ids()
    a = BucketBatchSampler(ids, 2, seed=7)
    b = BucketBatchSampler(ids, 2, seed=7)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    c = BucketBatchSampler(ids, 2, seed=8)
    assert list(c) != first
    plain = BucketBatchSampler(ids, 2, shuffle=False)
    assert list(plain)[0] == [0, 2]  # bucket 0 in index order


@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_ranks_split_the_one_process_epoch(drop_last):
    ids = [0] * 12 + [1] * 8  # 6 + 4 = 10 batches of 2: splits evenly over 2 ranks
    one = BucketBatchSampler(ids, 2, seed=3, drop_last=drop_last)
    ranks = [BucketBatchSampler(ids, 2, seed=3, drop_last=drop_last, num_replicas=2, rank=r) for r in (0, 1)]
    parts = [list(r) for r in ranks]
    assert len(parts[0]) == len(parts[1]) == len(ranks[0]) == 5
    assert sorted(map(tuple, parts[0] + parts[1])) == sorted(map(tuple, one))
    assert not set(map(tuple, parts[0])) & set(map(tuple, parts[1]))


def test_distributed_uneven_batches_pad_or_drop():
    ids = [0] * 10  # 5 batches of 2 over 2 ranks
    pad = [list(BucketBatchSampler(ids, 2, seed=0, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(pad[0]) == len(pad[1]) == 3  # one batch repeated so both ranks step 3 times
    assert {i for p in pad for b in p for i in b} == set(range(10))
    drop = [list(BucketBatchSampler(ids, 2, seed=0, drop_last=True, num_replicas=2, rank=r)) for r in (0, 1)]
    assert len(drop[0]) == len(drop[1]) == 2
    with pytest.raises(ValueError):
        BucketBatchSampler(ids, 2, num_replicas=2, rank=2)


def test_skip_batches_resumes_mid_epoch_once():
    ids = _ids()
    s = BucketBatchSampler(ids, 2, seed=5)
    s.set_epoch(2)
    full = list(s)
    s.set_epoch(2, skip_batches=3)
    assert list(s) == full[3:]
    assert list(s) == full  # the skip applies to one iteration only
    assert len(s) == len(full) == math.ceil(7 / 2) + math.ceil(5 / 2) + 1


def test_works_as_a_dataloader_batch_sampler():
    torch = pytest.importorskip("torch")
    data = list(range(14))
    loader = torch.utils.data.DataLoader(data, batch_sampler=BucketBatchSampler(_ids(), 3, seed=0))
    got = sorted(int(x) for batch in loader for x in batch)
    assert got == data


# -- the order batch: one order of images for every micro-batch that divides it --------------------------------

# bucket layouts: (the samples of each bucket); the dataset's indices interleave them
LAYOUTS = [(14,), (7, 5, 2), (9, 1), (8, 8, 3), (1,), (13, 6, 4, 4)]


def _layout_ids(samples: tuple[int, ...]) -> list[int]:
    left = list(samples)
    ids: list[int] = []
    while any(left):
        for b, n in enumerate(left):
            if n:
                ids.append(b)
                left[b] -= 1
    return ids


@pytest.mark.parametrize("samples", LAYOUTS)
@pytest.mark.parametrize("order", [4, 6, 8])
def test_every_micro_batch_that_divides_the_order_batch_draws_the_same_order(samples, order):
    """Cut at the order batch P and split at a micro-batch b that divides it, an epoch's images come in one
    order for every b; each bucket makes ceil(n / b) batches (the step arithmetic's count), its one short batch
    short by n % b; and the pieces of one P-batch are consecutive. At b == P it is the plain sampler's order."""
    ids = _layout_ids(samples)
    for epoch in (0, 3):
        plain = BucketBatchSampler(ids, order, seed=11).epoch_batches(epoch)
        flat = [i for b in plain for i in b]
        for b in [d for d in range(1, order + 1) if order % d == 0]:
            s = BucketBatchSampler(ids, b, seed=11, order_batch_size=order)
            batches = s.epoch_batches(epoch)
            assert [i for x in batches for i in x] == flat, b
            assert len(batches) == len(s) == sum(math.ceil(n / b) for n in samples), b
            assert all(len({ids[i] for i in x}) == 1 for x in batches)
            for bucket, n in enumerate(samples):
                sizes = sorted(len(x) for x in batches if ids[x[0]] == bucket)
                assert sizes == sorted([b] * (n // b) + ([n % b] if n % b else [])), (b, bucket)
            # the pieces of each P-batch, in order, one after another
            pieces = iter(batches)
            for big in plain:
                got: list[int] = []
                while len(got) < len(big):
                    got += next(pieces)
                assert got == big, b
            if b == order:
                assert batches == plain


def test_batches_within_counts_whole_batches_of_the_first_images():
    ids = _layout_ids((7, 5, 2))
    s = BucketBatchSampler(ids, 2, seed=3, order_batch_size=4)
    sizes = [len(b) for b in s.epoch_batches(1)]
    ends = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    for images in range(0, len(ids) + 3):
        within = s.batches_within(images, epoch=1)
        assert within == sum(1 for e in ends if e <= images)
        assert s.images_in(within, epoch=1) <= images
    assert s.images_in(len(sizes), epoch=1) == len(ids)


def test_keep_order_keeps_an_order_batch_the_micro_batch_divides():
    ids = _layout_ids((7, 5, 2))
    s = BucketBatchSampler(ids, 2, seed=3)
    assert s.keep_order(4) and s.order_batch_size == 4
    assert s.keep_order(2) and s.order_batch_size == 2
    assert not s.keep_order(3) and s.order_batch_size == 2  # 2 does not divide 3: its own order
    with pytest.raises(ValueError, match="not a multiple"):
        BucketBatchSampler(ids, 3, order_batch_size=4)
    with pytest.raises(ValueError, match="drop_last"):
        BucketBatchSampler(ids, 2, order_batch_size=4, drop_last=True)
    dropping = BucketBatchSampler(ids, 2, drop_last=True)
    assert not dropping.keep_order(4) and dropping.order_batch_size == 2


# -- the settings that make no buckets: refused with the fix, before anything runs --------------------------


def _refused_by_make_buckets(resolution, step, min_size, max_size) -> bool:
    try:
        make_buckets(resolution, step=step, min_size=min_size, max_size=max_size)
    except ValueError:
        return True
    return False


def test_the_config_refuses_exactly_the_bucket_settings_make_buckets_refuses():
    """data.bucket_min_size above the max (given, or the default twice the resolution), a max below the default
    min or the step, a step above the resolution: make_buckets' ValueError was a traceback in `recommend
    --dataset` and `train`. The config's rule (the one statement of them, with the fix) refuses those and no
    other."""
    from sdplan.config import DataConfig, bucket_problems

    sizes = (None, 64, 100, 128, 256, 512, 1000, 1024, 2048)
    for resolution in (64, 96, 120, 128, 512, 1024):
        for step in (32, 64, 128):
            for lo in sizes:
                for hi in sizes:
                    data = DataConfig(
                        resolution=resolution,
                        buckets=True,
                        bucket_step=step,
                        bucket_min_size=lo,
                        bucket_max_size=hi,
                    )
                    problems = bucket_problems(data)
                    assert len(problems) <= 1 and bool(problems) == _refused_by_make_buckets(
                        resolution, step, lo, hi
                    ), (resolution, step, lo, hi, problems)


@pytest.mark.parametrize(
    "settings, said",
    [
        (
            ["data.bucket_min_size=1024", "data.bucket_max_size=512"],
            "data.bucket_min_size: 1024 is above data.bucket_max_size 512; set data.bucket_min_size to 512 or "
            "less, or data.bucket_max_size to 1024 or more",
        ),
        (
            ["data.resolution=64", "data.bucket_min_size=1024"],
            "data.bucket_min_size: 1024 is above the longest bucket side at data.resolution 64 (128: twice the "
            "resolution, data.bucket_max_size's default); set data.bucket_max_size to 1024 or more",
        ),
        (
            ["data.bucket_max_size=128"],
            "data.bucket_max_size: 128 is below the shortest bucket side at data.resolution 512 (256: half the "
            "resolution, data.bucket_min_size's default); set data.bucket_min_size to 128 or less",
        ),
        (
            ["data.resolution=96", "data.bucket_step=128"],
            "data.bucket_step: 128 is above data.resolution 96 (a bucket side is a whole number of steps); set "
            "data.bucket_step to 64, or data.resolution to 128 or more",
        ),
        (
            ["data.bucket_step=128", "data.bucket_max_size=100"],
            "data.bucket_max_size: 100 is below data.bucket_step 128",
        ),
    ],
)
def test_bucket_settings_that_make_no_buckets_are_one_line_in_recommend_train_and_a_config(
    tmp_path, image_folder, settings, said
):
    """recommend with or without --dataset, train (before the model is looked at) and a config file all say
    the same line with its fix, exit 2, no traceback; without data.buckets the settings are not used."""
    from conftest import one_line_error
    from typer.testing import CliRunner

    from sdplan.cli import app
    from sdplan.config import ConfigError, apply_overrides, default_config, validate

    runner = CliRunner()
    on = ["data.buckets=true", *settings]
    plan = ["recommend", "--method", "lora", "--model", "sd15", "--hardware", "RTX 4090"]
    one_line_error(runner.invoke(app, [*plan, *on]), 2, "error: key=value settings: " + said)
    one_line_error(runner.invoke(app, [*plan, "--dataset", str(image_folder), *on]), 2, said)
    train = ["train", "--model", str(tmp_path / "model"), "--dataset", str(image_folder)]
    one_line_error(runner.invoke(app, [*train, "--out", str(tmp_path / "out"), "--dry-run", *on]), 2, said)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=re.escape(said)):
        validate(apply_overrides(default_config(), on), source="sdplan.yaml")
    validate(apply_overrides(default_config(), settings))  # buckets off: none is made


def test_the_bucket_settings_are_checked_at_the_resolution_the_plan_trains_at():
    """SDXL plans at 1024 px, --resolution at its own: a bucket_min_size of 1536 is below their default max
    (2048), not the default data.resolution's (1024)."""
    from typer.testing import CliRunner

    from sdplan.cli import app

    runner = CliRunner()
    on = ["data.buckets=true", "data.bucket_min_size=1536"]
    plan = ["recommend", "--method", "lora", "--hardware", "RTX 4090", "--json"]
    for args in (["--model", "sdxl"], ["--model", "sd15", "--resolution", "1024"]):
        r = runner.invoke(app, [*plan, *args, *on])
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*plan, "--model", "sd15", *on])
    assert r.exit_code == 2 and "data.bucket_min_size: 1536 is above the longest bucket side" in r.stderr
