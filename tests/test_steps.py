"""sdplan.steps.plan_steps: the one step arithmetic of the planner, the launcher and the trainer."""

from __future__ import annotations

import itertools
import math

import pytest

from sdplan.steps import plan_steps


def test_each_epoch_is_split_over_the_processes():
    # 8 samples, batch 2, accum 1: 4 steps on one process, 2 on two, 1 on four.
    spe = [plan_steps(images_per_epoch=8, batch_size=2, num_processes=n).steps_per_epoch for n in (1, 2, 4)]
    assert spe == [4, 2, 1]
    assert plan_steps(images_per_epoch=9, batch_size=2, grad_accum=2, num_processes=2).steps_per_epoch == 2


def test_warmup_and_max_steps_are_one_process_counts():
    one = plan_steps(images_per_epoch=8, batch_size=2, epochs=3, warmup_steps=4, num_processes=1)
    two = plan_steps(images_per_epoch=8, batch_size=2, epochs=3, warmup_steps=4, num_processes=2)
    assert (one.total_steps, one.lr_warmup_steps) == (12, 4)
    assert (two.total_steps, two.lr_warmup_steps) == (6, 2)
    assert one.images_seen == two.images_seen == 24
    capped = plan_steps(images_per_epoch=8, batch_size=2, epochs=1, max_steps=10, num_processes=2)
    assert (capped.total_steps, capped.epochs, capped.images_seen) == (5, 3, 20)


def test_micro_batches_and_images_count_an_epochs_partial_last_step():
    """20 images at batch 8 and accumulation 4: 3 micro-batches an epoch (8, 8, 4), one optimizer step. The
    planner charged 4 micro-batches a step (its time 25% over), and 10 steps of batch 8 counted 80 images where
    the epochs' last batches hold 4."""
    run = plan_steps(images_per_epoch=20, batch_size=8, grad_accum=4, epochs=10)
    assert (run.total_steps, run.micro_batches, run.images_seen) == (10, 30, 200)
    capped = plan_steps(images_per_epoch=20, batch_size=8, epochs=1, max_steps=10)
    assert (capped.steps_per_epoch, capped.epochs, capped.micro_batches) == (3, 4, 10)
    assert capped.images_seen == 3 * 20 + 8  # three whole epochs, then one batch of the fourth
    even = plan_steps(images_per_epoch=16, batch_size=4, grad_accum=2, epochs=2)
    assert even.micro_batches == even.total_steps * 2 == 8


def test_the_dataloader_length_when_known_gives_the_same_steps():
    """ceil(ceil(n / (b x N)) / ga) == ceil(n / (b x ga x N)): the trainer's sharded dataloader length and the
    planner's image count give the same steps."""
    for n, b, ga, procs in itertools.product((1, 7, 40, 123), (1, 2, 3), (1, 2, 4), (1, 2, 3)):
        s = plan_steps(images_per_epoch=n, batch_size=b, grad_accum=ga, num_processes=procs, epochs=2)
        loader = plan_steps(
            images_per_epoch=n,
            batch_size=b,
            grad_accum=ga,
            num_processes=procs,
            epochs=2,
            batches_per_epoch=math.ceil(n / (b * procs)),
        )
        assert s == loader
        assert s.steps_per_epoch == max(1, math.ceil(n / (b * ga * procs)))
        assert s.one_gpu_total_steps == math.ceil(n / (b * ga)) * 2


def test_aspect_buckets_end_each_in_a_short_batch():
    """8 images in 3 buckets (3, 3, 2) at batch 4: 3 batches an epoch, not ceil(8 / 4) = 2; dealt over 2
    processes, 2 each. One bucket is the plain count."""
    from sdplan.trainer.buckets import bucket_samples, make_buckets

    from sdplan.steps import bucketed_batches

    sizes = [(512, 512), (512, 768), (768, 512), (512, 1024), (1024, 512), (600, 400), (400, 600), (512, 512)]
    samples = bucket_samples(sizes, [1] * 8, make_buckets(256))
    assert samples == (3, 3, 2)
    assert bucketed_batches(samples, 4) == 3 and bucketed_batches(samples, 4, 2) == 2
    assert bucketed_batches((8,), 4) == math.ceil(8 / 4)
    assert bucket_samples(sizes, [2] * 8, make_buckets(256)) == (
        6,
        6,
        4,
    )  # repeats count in their image's bucket
    run = plan_steps(
        images_per_epoch=8, batch_size=4, epochs=2, batches_per_epoch=bucketed_batches(samples, 4)
    )
    assert (run.steps_per_epoch, run.total_steps) == (3, 6)


def test_the_one_gpu_count_is_the_one_process_plan_with_buckets_too():
    """The one-GPU figure a multi-GPU plan states is the one-process run's own steps: with aspect buckets each
    bucket ends in a short batch there too (24 images in three buckets of 8 at batch 3: 9 batches an epoch,
    not ceil(24 / 3) = 8; it said 80 steps where one process plans 90)."""
    for buckets, batch, accum in itertools.product(((7, 7, 5, 5), (1, 23), ()), (1, 3, 4), (1, 2)):
        kw = dict(images_per_epoch=24, batch_size=batch, grad_accum=accum, epochs=10, bucket_samples=buckets)
        one = plan_steps(**kw)
        assert one.one_gpu_total_steps == one.total_steps
        for procs in (2, 3):
            assert plan_steps(**kw, num_processes=procs).one_gpu_total_steps == one.total_steps
    assert (
        plan_steps(
            images_per_epoch=24, batch_size=3, epochs=10, num_processes=2, bucket_samples=(8, 8, 8)
        ).one_gpu_total_steps
        == 90
    )


def test_a_multi_gpu_plan_states_the_one_gpu_plans_steps_with_buckets():
    """`recommend` on 2x RTX 4090 with aspect buckets said "(one GPU: 80)" where planning one GPU gave 90, and
    its epoch arithmetic (24 images / (batch 3 x 2 GPUs) = 5) did not hold: it counts the buckets' batches."""
    from sdplan import planner as P
    from sdplan.profiles import load_profiles

    prof = load_profiles()
    req = P.Request(method="lora", model="sdxl", images=24, bucket_samples=(8, 8, 8), pins=(("batch", 3),))
    two = P.plan(P.hardware_from_catalog(prof.find_gpu("RTX 4090"), 2), prof, req)
    one = P.plan(P.hardware_from_catalog(prof.find_gpu("RTX 4090"), 1), prof, req)
    assert two.plan.num_gpus == 2 and one.steps.total_steps == 90
    said = next(r for r in two.reasons if "steps normalised" in r)
    assert "(one GPU: 90)" in said, said
    assert "in 3 aspect buckets = 9 batches of up to 3" in said and "= 5 steps per epoch" in said, said


def test_repeated_batches_are_what_accelerate_deals_again():
    """8 images at batch 2 on 5 processes: the plan said 8 images, the run trained 10. accelerate's even batches
    deal the epoch's first batches again so every process has as many: repeated_batches counts them as the
    trainer's sharded loader does (its EpochBatches, with and without aspect buckets)."""
    from accelerate.data_loader import BatchSamplerShard
    from sdplan.trainer.buckets import BucketBatchSampler
    from sdplan.trainer.runtime import EpochBatches

    from sdplan.steps import repeated_batches

    cases = [
        ((8,), 2, 5),
        ((8,), 2, 2),
        ((9,), 2, 2),
        ((8,), 1, 20),
        ((5, 3), 2, 2),
        ((3, 3, 2), 4, 2),
        ((7,), 3, 1),
    ]
    for samples, batch, n in cases:
        ids = [b for b, k in enumerate(samples) for _ in range(k)]
        batches = EpochBatches(BucketBatchSampler(ids, batch, seed=1))
        dealt = (
            sum(len(BatchSamplerShard(batches, n, p, even_batches=True)) for p in range(n)) if n > 1 else 0
        )
        want = dealt - len(batches) if n > 1 else 0
        assert repeated_batches(sum(samples), batch, n, samples if len(samples) > 1 else ()) == want, samples
    assert repeated_batches(8, 2, 5) == 1 and repeated_batches(16, 2, 2) == 0


@pytest.mark.parametrize(
    "images,batch,accum,procs,max_steps,buckets,seen,least,text",
    [
        (11, 2, 2, 1, 5, (), 19, 18, "up to 19 images"),  # the audit's: "= 19 images", then 18 seen
        (11, 2, 2, 2, 5, (), 19, 18, "up to 19 images"),  # the same on 2 processes
        (8, 2, 1, 1, 3, (), 6, 6, "6 images"),  # no short batch: certain
        (11, 2, 2, 1, None, (), 22, 22, "22 images"),  # by epochs: every image, certain
        (11, 2, 2, 1, 6, (), 22, 22, "22 images"),  # max_steps at an epoch's end
        (8, 4, 1, 1, 2, (3, 3, 2), 8, 4, "up to 8 images"),  # 3 aspect buckets, each ends short
        (4, 4, 1, 1, 2, (1, 1, 1, 1), 4, 2, "up to 4 images"),  # short batches of 1: a batch holds 1 at least
    ],
)
def test_a_max_steps_plan_says_up_to_where_its_last_epochs_batches_can_be_short(
    images, batch, accum, procs, max_steps, buckets, seen, least, text
):
    """The plan of a run that training.max_steps stops inside an epoch: the sampler shuffles the epoch's short
    batches in among its full ones, so its steps see full batches at most (images_seen) and fewer where a short
    one falls among them (images_seen_min). `sdplan train` said "= 19 images" for a run that saw 18."""
    st = plan_steps(
        images_per_epoch=images,
        batch_size=batch,
        grad_accum=accum,
        num_processes=procs,
        epochs=2,
        max_steps=max_steps,
        bucket_samples=buckets,
    )
    assert (st.images_seen, st.images_seen_min, st.images_seen_text()) == (seen, least, text)


@pytest.mark.parametrize("images,batch,buckets", [(11, 2, 1), (13, 4, 1), (12, 4, 3), (9, 2, 2)])
def test_the_images_a_cut_epoch_sees_are_within_the_plans_range(images, batch, buckets):
    """The batches the sampler deals (its seeded order) in a cut epoch hold images_seen_min to images_seen."""
    from sdplan.trainer.buckets import BucketBatchSampler

    ids = [i % buckets for i in range(images)]
    samples = tuple(sorted((ids.count(b) for b in range(buckets)), reverse=True))
    for procs, accum, seed in itertools.product((1, 2, 3), (1, 2), range(5)):
        order = [len(b) for b in BucketBatchSampler(ids, batch, seed=seed).epoch_batches(0)]
        for max_steps in range(1, 12):
            st = plan_steps(
                images_per_epoch=images,
                batch_size=batch,
                grad_accum=accum,
                num_processes=procs,
                max_steps=max_steps,
                bucket_samples=samples,
            )
            full, rest = divmod(st.total_steps, st.steps_per_epoch)
            drawn = min(rest * accum, st.batches_per_epoch) * procs if rest else 0
            sees = full * images + sum(order[:drawn])  # the epochs' whole images, then the cut one's batches
            assert st.images_seen_min <= sees <= st.images_seen, (procs, accum, seed, max_steps, order)


def test_the_largest_batch_is_the_samplers_largest():
    """steps.largest_batch, which the planner sizes memory and time at, is the largest batch BucketBatchSampler
    hands any process: 20 images at batch 64 are one batch of 20; 13 at batch 8 on 2 processes, 8 and 5."""
    from sdplan.trainer.buckets import BucketBatchSampler, bucket_counts

    from sdplan.steps import largest_batch

    for ids, batch, procs in itertools.product(
        ([0] * 20, [0] * 13, [0] * 7 + [1] * 3 + [2] * 12, [5, 5, 1]), (1, 3, 8, 64), (1, 2, 3)
    ):
        formed = [
            len(b)
            for rank in range(procs)
            for b in BucketBatchSampler(ids, batch, num_replicas=procs, rank=rank, seed=1)
        ]
        assert max(formed) == largest_batch(batch, len(ids), bucket_counts(ids)), (ids, batch, procs)
        run = plan_steps(images_per_epoch=len(ids), batch_size=batch, bucket_samples=bucket_counts(ids))
        assert run.largest_batch == max(formed)
