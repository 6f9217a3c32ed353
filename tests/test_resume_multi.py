"""Resuming with another process count: the images seen carry over, the steps are the new run's
(``sdplan.steps.moved_position``), the learning rate stands where the new schedule has it, and checkpoints rank
by images seen. The slow tests are real 2-process gloo runs (torchrun) resumed on 1 process and back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import assert_same_run, tiny_train_config, train_two_processes, trains_in_process
from sdplan.trainer import checkpoint, run
from sdplan.trainer.buckets import BucketBatchSampler

from sdplan.steps import Position, moved_position, plan_steps

# -- the arithmetic (pure) -----------------------------------------------------------------------------------


def plan(n: int, *, images: int = 8, accum: int = 2, epochs: int = 2, batch: int = 1):
    return plan_steps(
        images_per_epoch=images, batch_size=batch, grad_accum=accum, num_processes=n, epochs=epochs
    )


def moved(epoch: int, batches: int, old: int, new, *, epoch_batches: int = 8, batch: int = 1) -> Position:
    return moved_position(
        epoch=epoch,
        batches_in_epoch=batches,
        images_in_epoch=batches * batch * old,
        batch_size=batch,
        num_processes=old,
        epoch_batches=epoch_batches,
        new=new,
    )


def finish(at: Position, p) -> tuple[int, int]:
    """Where the loop stops from ``at`` under plan ``p``: (epoch, micro-batches into it). A step closes after
    ``grad_accum`` micro-batches or at the epoch's end (accelerate's sync rule), as in ``trainer/loop.py``; the
    counter starts short of it by the position's ``first_step`` (Checkpointer.load)."""
    step, epoch, b, micro = (
        at.step,
        at.epoch,
        at.batches_in_epoch,
        (p.grad_accum - at.first_step) % p.grad_accum,
    )
    while step < p.total_steps:
        if b >= p.batches_per_epoch:
            epoch, b = epoch + 1, 0
        b, micro = b + 1, micro + 1
        if micro == p.grad_accum or b == p.batches_per_epoch:
            step, micro = step + 1, 0
    return (epoch - 1, p.batches_per_epoch) if b == 0 else (epoch, b)


def test_moved_position_two_to_one_and_back():
    # 8 images, batch 1, accumulation 2, 2 epochs: 4 steps/epoch on one process, 2 on two.
    assert moved(0, 2, 2, plan(1)) == Position(step=2, epoch=0, batches_in_epoch=4)  # 4 images done
    assert moved(0, 4, 1, plan(2)) == Position(step=1, epoch=0, batches_in_epoch=2)
    assert moved(0, 4, 2, plan(1)) == Position(step=4, epoch=1, batches_in_epoch=0)  # a finished epoch
    # 3 batches done cannot be shared by 2 processes: the third trains again rather than being left out.
    assert moved(1, 3, 1, plan(2)) == Position(step=2, epoch=1, batches_in_epoch=1)
    # Another micro-batch (an out-of-memory retry: batch 2 -> 1): the images done count.
    assert moved(0, 1, 2, plan(2), batch=2) == Position(step=1, epoch=0, batches_in_epoch=2)


@pytest.mark.parametrize("images,accum", [(8, 1), (8, 2), (8, 3), (7, 2), (5, 3)])
@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (4, 2), (2, 3), (2, 2)])
def test_a_moved_run_ends_at_the_last_epochs_end(images, accum, old, new):
    """From every checkpoint the old run writes (each optimizer step), the new run stops exactly at the end of
    its last epoch: it trains neither an extra epoch nor stops short of one."""
    before, after = (
        plan(old, images=images, accum=accum, epochs=3),
        plan(new, images=images, accum=accum, epochs=3),
    )
    for epoch in range(3):
        for k in range(1, before.steps_per_epoch + 1):
            b = min(k * accum, before.batches_per_epoch)
            at = moved(epoch, b, old, after, epoch_batches=images)
            assert finish(at, after) == (2, after.batches_per_epoch), (epoch, b, at)
            if old == new:  # the same settings: the step the run itself counted
                assert at.step == epoch * before.steps_per_epoch + k


def capped(n: int, *, images: int, accum: int, max_steps: int, batch: int = 1):
    return plan_steps(
        images_per_epoch=images, batch_size=batch, grad_accum=accum, num_processes=n, max_steps=max_steps
    )


def at_micro_batch(where: tuple[int, int], p) -> int:
    """(epoch, micro-batches into it) as micro-batches of each process from the run's start."""
    return where[0] * p.batches_per_epoch + where[1]


@pytest.mark.parametrize("images,accum", [(5, 2), (7, 2), (11, 2), (13, 2), (7, 3), (13, 3), (21, 4), (8, 2)])
@pytest.mark.parametrize("old,new", [(1, 2), (2, 3), (1, 4), (2, 1), (3, 2)])
def test_a_moved_max_steps_run_ends_where_an_uninterrupted_one_does(images, accum, old, new):
    """training.max_steps, resumed on another process count from every checkpoint the old run writes: the run
    ends where an uninterrupted run of the new count does, neither short of it nor past it. The step counted
    back from the epoch's end took a step only partly done as taken (micro-batches per epoch not a multiple of
    the accumulation, more processes): the run ended up to accumulation - 1 micro-batches a process short (the
    audit's 93 cases), or trained nothing after the resume. A checkpoint at or past the new run's end stands at
    its last step or after it (nothing left: the launcher's refusals)."""
    for max_steps in range(2, 16):
        before = capped(old, images=images, accum=accum, max_steps=max_steps)
        after = capped(new, images=images, accum=accum, max_steps=max_steps)
        end = at_micro_batch(finish(Position(step=0, epoch=0, batches_in_epoch=0), after), after)
        for s in range(1, before.total_steps):
            epoch, k = divmod(s, before.steps_per_epoch)
            if k == 0:
                epoch, b = epoch - 1, before.batches_per_epoch
            else:
                b = min(k * accum, before.batches_per_epoch)
            at = moved(epoch, b, old, after, epoch_batches=images)
            here = at.epoch * after.batches_per_epoch + at.batches_in_epoch
            case = (max_steps, s, at)
            if here >= end:
                assert at.step >= after.total_steps, case
            else:
                assert at.step < after.total_steps, case
                assert at_micro_batch(finish(at, after), after) == end, case


def test_the_audits_max_steps_resume_on_two_processes_trains_its_last_step():
    """The audit's run: 11 images, batch 2 x accumulation 2, --max-steps 5 on 1 process, stopped after step 4
    (15 images: 2 micro-batches into epoch 1), resumed on 2 processes (3 steps: 2 an epoch, then 2 micro-batches
    each). It stood at step 3 of 3 and trained nothing more (15 images, the fresh run 18); now step 2 of 3, whose
    last step takes 1 micro-batch on each process (to micro-batch 2 of epoch 1, as the fresh run)."""
    after = capped(2, images=11, accum=2, max_steps=5, batch=2)
    assert (after.total_steps, after.steps_per_epoch, after.batches_per_epoch) == (3, 2, 3)
    at = moved(1, 2, 1, after, epoch_batches=6, batch=2)
    assert at == Position(step=2, epoch=1, batches_in_epoch=1, first_step=1)
    assert finish(at, after) == finish(Position(step=0, epoch=0, batches_in_epoch=0), after) == (1, 2)


def epoch_order(images: int, batch: int, seed: int, buckets: int = 1) -> list[int]:
    """The sizes of an epoch's batches in the sampler's order (its short batches shuffled in among the full)."""
    from sdplan.trainer.buckets import BucketBatchSampler

    ids = [i % buckets for i in range(images)]
    return [len(b) for b in BucketBatchSampler(ids, batch, seed=seed).epoch_batches(0)]


@pytest.mark.parametrize("images,batch,buckets", [(11, 2, 1), (13, 4, 1), (10, 3, 1), (12, 4, 3), (9, 2, 2)])
@pytest.mark.parametrize("old,new,new_batch", [(2, 1, 1), (2, 2, 1), (2, 1, 4), (3, 2, 1), (2, 3, 2)])
def test_a_resume_with_another_micro_batch_skips_only_images_its_processes_trained(
    images, batch, buckets, old, new, new_batch
):
    """A resume with a new micro-batch (sdplan allows it on --resume; the out-of-memory retry halves it) after
    ``k`` rounds of a multi-process epoch: the position skips at most the images all the processes trained, and
    trains again fewer than a batch of each new process. The checkpoint kept the first process's images, which
    times the processes overcounted where another had the epoch's short batch (the audit's 2-process epoch of 11
    at batch 2: 7 images, counted 8, one image never trained; reported as none trained again). A checkpoint from
    before (only that count) counts the fewest its processes can have trained, and says up to how many train
    again."""
    for seed in range(6):
        order = epoch_order(images, batch, seed, buckets)
        rounds = -(-len(order) // old)
        samples = tuple(images // buckets + (i < images % buckets) for i in range(buckets))
        after = plan_steps(
            images_per_epoch=images, batch_size=new_batch, num_processes=new, bucket_samples=samples
        )
        epoch_batches = sum(-(-n // new_batch) for n in samples)
        for k in range(1, rounds):
            trained = sum(order[: k * old])  # every process's batches of the first k rounds
            own = sum(order[: k * old : old])  # the first process's
            state = checkpoint.TrainState(
                epoch=0,
                batches_in_epoch=k,
                samples_in_epoch=own,
                images_in_epoch=trained,
                batch_size=batch,
                num_processes=old,
            )
            legacy = checkpoint.TrainState.from_json(
                {x: v for x, v in state.to_json().items() if x != "images_in_epoch"}
            )
            assert legacy.images_in_epoch is None
            for saved in (state, legacy):
                live = checkpoint.TrainState(batch_size=new_batch, num_processes=new)
                at = checkpoint.resume_position(saved, live, after, epoch_batches)
                mine = at.batches_in_epoch * new if at.epoch == 0 else len(order)
                # the same micro-batch: the same order, its first batches; another: the images they count
                skipped = sum(order[:mine]) if new_batch == batch else min(mine * new_batch, trained)
                least, most = checkpoint.epoch_images(saved, after)
                case = (seed, k, order, own, trained, at, least, most)
                assert least <= trained <= most, case
                assert skipped <= trained, case  # no image left out
                assert least - skipped < new_batch * new or at.epoch == 1, case  # whole new batches of it
                if (
                    new_batch != batch
                ):  # what it says trains again: exact, or at most (a checkpoint from before)
                    again = checkpoint.images_again(saved, at, after)
                    assert again == trained - skipped if saved is state else again >= trained - skipped, case


def _interleaved(samples: tuple[int, ...]) -> list[int]:
    """Bucket ids of a dataset whose buckets hold ``samples``, their indices interleaved."""
    return [b for r in range(max(samples)) for b, n in enumerate(samples) if r < n]


def _dealt(batches: list, processes: int, rounds: int) -> list:
    """The batches ``processes`` processes drew in an epoch's first ``rounds`` rounds: accelerate deals batch j to
    process j % processes, and where the epoch's batches do not divide by them its last round deals the first
    again (even_batches)."""
    per = -(-len(batches) // processes)
    padded = [batches[j % len(batches)] for j in range(per * processes)]
    return padded[: rounds * processes]


@pytest.mark.parametrize("samples", [(11,), (7, 5, 2), (9, 4), (6, 6, 1)])
@pytest.mark.parametrize("order", [4, 6, 8])
def test_a_resume_at_a_micro_batch_that_divides_the_order_batch_covers_the_epoch(samples, order):
    """The out-of-memory retry resumes the last checkpoint at a smaller micro-batch (a divisor). A checkpoint of
    1-3 processes at the order batch P or a divisor of it, after any round of an epoch, resumed on 1-3 processes
    at any divisor of P: the images it trained in that epoch and those the new processes draw after their skip
    are every image of the epoch, the images trained twice are those of the at most ``new - 1`` batches the
    processes' share rounds down, and a batch that straddles the checkpoint's images (P=6 at 2 -> 3), and
    images_again counts them exactly. Each bucket's sampler order is cut at P (BucketBatchSampler.keep_order).
    At a micro-batch that does not divide P the order is another (said): the position is the images done,
    rounded down to whole batches, as moved_position documents, and skips no more images than were trained."""
    ids = _interleaved(samples)
    images = len(ids)
    divisors = [d for d in range(1, order + 1) if order % d == 0]
    others = [b for b in (3, 4, 5) if order % b]
    for old_batch in divisors:
        old_sampler = BucketBatchSampler(ids, old_batch, seed=2, order_batch_size=order)
        for old in (1, 2, 3):
            for epoch in (0, 1):
                done_order = old_sampler.epoch_batches(epoch)
                rounds = -(-len(done_order) // old)
                for k in range(1, rounds + 1):
                    trained = [i for b in _dealt(done_order, old, k) for i in b]
                    saved = checkpoint.TrainState(
                        epoch=epoch,
                        batches_in_epoch=k,
                        images_in_epoch=len(trained),
                        batch_size=old_batch,
                        order_batch_size=order,
                        num_processes=old,
                    )
                    for new_batch in divisors + others:
                        for new in (1, 2, 3):
                            case = (old_batch, old, epoch, k, new_batch, new)
                            sampler = BucketBatchSampler(ids, new_batch, seed=2)
                            kept = sampler.keep_order(saved.order_batch_size)
                            assert kept == (new_batch in divisors), case
                            after = plan_steps(
                                images_per_epoch=images,
                                batch_size=new_batch,
                                num_processes=new,
                                grad_accum=2,
                                epochs=3,
                                bucket_samples=samples,
                            )
                            live = checkpoint.TrainState(
                                batch_size=new_batch, grad_accum=2, num_processes=new, order_batch_size=order
                            )
                            at = checkpoint.resume_position(saved, live, after, len(sampler), sampler)
                            if k == rounds:  # the epoch was done
                                assert (at.epoch, at.batches_in_epoch) == (epoch + 1, 0), case
                                continue
                            assert at.epoch == epoch, case
                            skip = at.batches_in_epoch * new  # all the new processes' skipped batches
                            drawn = [i for b in sampler.epoch_batches(epoch)[skip:] for i in b]
                            if not kept:
                                plain = checkpoint.resume_position(saved, live, after, len(sampler))
                                assert at == plain, case
                                assert checkpoint.skipped_images(at, after, sampler) <= len(trained), case
                                continue
                            assert sorted(set(trained) | set(drawn)) == list(range(images)), case
                            twice = len(set(trained) & set(drawn))
                            assert len(drawn) + len(trained) - twice == images, case  # nothing drawn 3 times
                            assert twice == checkpoint.images_again(saved, at, after, sampler), case
                            whole = sampler.batches_within(len(trained), epoch)
                            assert whole - skip < new, case  # the share rounded down
                            if old_batch % new_batch == 0:  # a smaller micro-batch: no batch straddles
                                assert twice == sampler.images_in(whole, epoch) - sampler.images_in(
                                    skip, epoch
                                )


def test_a_checkpoint_from_before_the_order_batch_resumed_at_half_its_micro_batch_covers_its_epoch():
    """A checkpoint from before images_in_epoch and order_batch_size were kept was cut at its micro-batch:
    resumed at half of it, the batches within the fewest images its processes can have trained are skipped,
    none left out, and images_again says at most how many train again."""
    ids = _interleaved((7, 5, 2))
    done_order = BucketBatchSampler(ids, 4, seed=9).epoch_batches(0)
    for old in (1, 2, 3):
        for k in range(1, -(-len(done_order) // old)):
            dealt = _dealt(done_order, old, k)
            trained = [i for b in dealt for i in b]
            saved = checkpoint.TrainState.from_json(
                {
                    "epoch": 0,
                    "batches_in_epoch": k,
                    "samples_in_epoch": sum(len(b) for b in dealt[::old]),
                    "batch_size": 4,
                    "num_processes": old,
                }
            )
            assert saved.images_in_epoch is None and saved.order_batch_size == 4
            for new in (1, 2):
                sampler = BucketBatchSampler(ids, 2, seed=9)
                assert sampler.keep_order(saved.order_batch_size)
                after = plan_steps(
                    images_per_epoch=len(ids), batch_size=2, num_processes=new, bucket_samples=(7, 5, 2)
                )
                live = checkpoint.TrainState(batch_size=2, num_processes=new, order_batch_size=4)
                at = checkpoint.resume_position(saved, live, after, len(sampler), sampler)
                drawn = [i for b in sampler.epoch_batches(0)[at.batches_in_epoch * new :] for i in b]
                assert sorted(set(trained) | set(drawn)) == list(range(len(ids))), (old, k, new)
                again = checkpoint.images_again(saved, at, after, sampler)
                assert again >= len(set(trained) & set(drawn)), (old, k, new)


def test_the_audits_two_process_epoch_resumed_at_another_micro_batch():
    """The audit's checkpoint: 2 processes at batch 2 over 11 images, after 2 micro-batches each: 7 images
    (images_seen 7), the first process's own 4 (the short batch was the second's). Resumed on 1 process at batch 1
    x accumulation 4 it skipped 4 x 2 = 8 batches of 1 (an image never trained) and said none trained again. Now
    it skips 7; the same checkpoint from before images_in_epoch was kept counts the fewest its processes can have
    trained (7 of up to 8) and says up to 1 trains again."""
    saved = {
        "global_step": 1,
        "epoch": 0,
        "batches_in_epoch": 2,
        "samples_in_epoch": 4,
        "images_seen": 7,
        "batch_size": 2,
        "grad_accum": 2,
        "num_processes": 2,
    }
    after = plan_steps(images_per_epoch=11, batch_size=1, grad_accum=4, epochs=2)
    live = checkpoint.TrainState(batch_size=1, grad_accum=4)
    now = checkpoint.TrainState.from_json({**saved, "images_in_epoch": 7})
    at = checkpoint.resume_position(now, live, after, 11)
    assert at == Position(step=2, epoch=0, batches_in_epoch=7)
    assert checkpoint.images_again(now, at, after) == 0
    before = checkpoint.TrainState.from_json(saved)
    assert checkpoint.epoch_images(before, after) == (7, 8)
    assert checkpoint.resume_position(before, live, after, 11) == at
    assert checkpoint.images_again(before, at, after) == 1
    # the first process had the short batch: its own 3 tell the count (7) exactly
    assert checkpoint.epoch_images(
        checkpoint.TrainState.from_json({**saved, "samples_in_epoch": 3}), after
    ) == (7, 7)


# -- the learning-rate schedule ------------------------------------------------------------------------------


def test_the_learning_rate_moves_with_the_step():
    """A 2-process checkpoint after step 1 of 4 resumed on 1 process is step 2 of 8: its learning rate is the
    1-process schedule's at step 2 (cosine with warmup), and the schedule goes on from there."""
    import torch
    from diffusers.optimization import get_scheduler

    def scheduler(total: int, warmup: int):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        return opt, get_scheduler("cosine", opt, num_warmup_steps=warmup, num_training_steps=total)

    old_opt, old = scheduler(4, 1)
    old_opt.step()
    old.step()
    opt, sched = scheduler(8, 2)
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old.state_dict())
    checkpoint.apply_learning_rates(opt, sched, [1e-3], 2)
    ref_opt, ref = scheduler(8, 2)
    for _ in range(2):
        ref_opt.step()
        ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
    ref_opt.step()
    ref.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])


# -- which checkpoints stay, which is the latest -------------------------------------------------------------


def fake_checkpoint(out: Path, name: str, images: int) -> Path:
    path = checkpoint.checkpoint_root(out) / name
    path.mkdir(parents=True)
    (path / checkpoint.STATE_FILE).write_text(json.dumps({"images_seen": images, "files": {}}))
    return path


def test_only_a_resume_that_keeps_the_numbering_writes_over_a_steps_outputs():
    """checkpoint.same_numbering: a same-settings resume of a history numbered 1..n keeps step N one point of
    the run (its grid / intermediate outputs are written over); a renumbered resume, or any resume of a history
    that was renumbered before, keeps an earlier session's beside (``-1``)."""
    p1 = plan(1, accum=1)
    saved = checkpoint.TrainState(global_step=3, loss_steps=[1, 2, 3], batch_size=1, grad_accum=1)
    assert checkpoint.same_numbering(saved, None, p1)
    assert not checkpoint.same_numbering(saved, Position(step=1, epoch=0, batches_in_epoch=3), plan(2))
    # batch 1 x accumulation 2 <-> batch 2 x 1: the same images per step, the same step: the same numbering
    assert checkpoint.same_numbering(saved, Position(step=3, epoch=0, batches_in_epoch=3), p1)
    renumbered = checkpoint.TrainState(global_step=3, loss_steps=[1, 2, 3, 2, 3], batch_size=1, grad_accum=1)
    assert not checkpoint.same_numbering(renumbered, None, p1)


def test_a_moved_resume_says_the_images_it_trains_again():
    """The audit's batch 2 -> 4 (and 1 -> 2 processes) resume at 14 images: step 3 = 12 images, 2 again; a
    position that the new batches meet exactly, or a finished epoch, trains none again."""
    saved = checkpoint.TrainState(
        epoch=0, batches_in_epoch=7, samples_in_epoch=14, images_in_epoch=14, batch_size=2
    )

    def p(batch: int, n: int):
        return plan_steps(images_per_epoch=16, batch_size=batch, num_processes=n)

    assert checkpoint.images_again(saved, Position(step=3, epoch=0, batches_in_epoch=3), p(4, 1)) == 2
    assert checkpoint.images_again(saved, Position(step=3, epoch=0, batches_in_epoch=3), p(2, 2)) == 2
    assert checkpoint.images_again(saved, Position(step=7, epoch=0, batches_in_epoch=14), p(1, 1)) == 0
    assert checkpoint.images_again(saved, Position(step=4, epoch=1, batches_in_epoch=0), p(4, 1)) == 0


def test_latest_is_the_checkpoint_with_the_most_images(tmp_path):
    """A 2-process run's step 4 (16 images) is further than the 1-process step 6 it resumed from (12)."""
    fake_checkpoint(tmp_path, "rolling-step-000006", 12)
    further = fake_checkpoint(tmp_path, "step-000004", 16)
    assert checkpoint.latest_checkpoint(tmp_path) == further
    assert checkpoint.resolve_resume("latest", tmp_path) == further


@pytest.fixture
def checkpointer(tmp_path, fresh_accelerator_state):
    import torch
    from accelerate import Accelerator

    def make(state: checkpoint.TrainState, **kw) -> checkpoint.Checkpointer:
        return checkpoint.Checkpointer(
            Accelerator(cpu=True),
            tmp_path,
            state,
            get_weights=lambda: {"w": torch.zeros(2)},
            set_weights=lambda _: None,
            **kw,
        )

    return make


def test_a_kept_checkpoint_replaces_the_rolling_one_before_it(tmp_path, checkpointer):
    state = checkpoint.TrainState()
    ckpt = checkpointer(state, every_steps=1, keep_every_steps=2)
    names = []
    for step in (1, 2, 3):
        state.global_step, state.images_seen = step, 2 * step
        ckpt.maybe_save()
        names.append(sorted(p.name for _, _, p in checkpoint.list_checkpoints(tmp_path)))
    assert names == [["rolling-step-000001"], ["step-000002"], ["rolling-step-000003", "step-000002"]]


def test_a_rolling_checkpoint_replaces_one_with_fewer_images_and_a_higher_step(tmp_path, checkpointer):
    """Resumed on 2 processes from a 1-process rolling checkpoint at step 6 (12 images): the 2-process rolling
    checkpoint at step 4 (16 images) replaces it, and is the latest."""
    fake_checkpoint(tmp_path, "rolling-step-000006", 12)
    state = checkpoint.TrainState(global_step=4, images_seen=16, num_processes=2)
    saved = checkpointer(state, every_steps=1).maybe_save()
    assert [p for _, _, p in checkpoint.list_checkpoints(tmp_path)] == [saved]
    assert saved.name == "rolling-step-000004" and checkpoint.latest_checkpoint(tmp_path) == saved


def test_a_kept_checkpoint_of_an_earlier_session_is_never_replaced(tmp_path, checkpointer):
    """Resumed on 2 processes from a 1-process run that kept step-000004 (8 images): this run's step 4 (18
    images) is another point of the run. It replaced the kept one; now it is kept beside it as step-000004-1,
    which ranks as the latest (most images). Within one session the same step written again replaces its own."""
    earlier = fake_checkpoint(tmp_path, "step-000004", 8)
    state = checkpoint.TrainState(global_step=4, images_seen=18, num_processes=2)
    ckpt = checkpointer(state, keep_every_steps=2)
    saved = ckpt.maybe_save()
    assert saved.name == "step-000004-1"
    assert checkpoint.images_seen(earlier) == 8 and checkpoint.images_seen(saved) == 18
    assert [p for _, _, p in checkpoint.list_checkpoints(tmp_path)] == [earlier, saved]
    assert checkpoint.latest_checkpoint(tmp_path) == saved
    assert ckpt.save("keep") == saved  # this session's own: replaced, no -2
    assert len(checkpoint.list_checkpoints(tmp_path)) == 2
    checkpoint.remove_checkpoints(tmp_path)  # --force knows the suffixed name as sdplan's
    assert not checkpoint.checkpoint_root(tmp_path).exists()


def test_a_resume_at_a_point_that_is_not_a_multiple_of_the_new_accumulation_takes_the_planned_steps(
    tmp_path, checkpointer
):
    """The review's batch 1 x accumulation 1 checkpoint at micro-batch 4 of a 16-image epoch, resumed at
    accumulation 3 (2 epochs: 12 steps, 32 images). accelerate's counter was set to the 4 micro-batches done,
    so the first step closed after 2 (at 6, a multiple of 3 from the epoch's start), the epoch took 5 steps where
    the plan counts 4, and the run reached step 12 with 31 images. Now it takes the plan's steps: 3 micro-batches
    each from the resume point, the epoch's last step what is left, and ends after all 32 images."""
    from accelerate.data_loader import DataLoader

    saved = checkpoint.TrainState(global_step=4, batches_in_epoch=4, samples_in_epoch=4, images_seen=4)
    ckpt = checkpointer(saved, keep_every_steps=4)
    ckpt.accelerator.step = 4  # the saving session's counter at accumulation 1
    path = ckpt.maybe_save()
    p = plan_steps(images_per_epoch=16, batch_size=1, grad_accum=3, epochs=2)
    assert (p.steps_per_epoch, p.total_steps) == (6, 12)
    resumed = checkpointer(checkpoint.TrainState(batch_size=1, grad_accum=3))
    live = resumed.load(path, p, 16)
    assert (live.global_step, live.epoch, live.batches_in_epoch) == (2, 0, 4)
    acc = resumed.accelerator
    acc.gradient_accumulation_steps = 3
    loader = acc.prepare(DataLoader(list(range(16)), batch_size=1))
    step, images, micro, taken = live.global_step, live.images_seen, 0, []
    while step < p.total_steps:  # as trainer/loop.py: skip the epoch's done batches, a step at each sync
        for _ in acc.skip_first_batches(loader, live.batches_in_epoch):
            with acc.accumulate():
                images, micro = images + 1, micro + 1
                if acc.sync_gradients:
                    step, taken, micro = step + 1, [*taken, micro], 0
                    if step >= p.total_steps:
                        break
        live.batches_in_epoch = 0
    assert taken == [3, 3, 3, 3, 3, 3, 3, 3, 3, 1]  # epoch 0: 4 steps from micro-batch 4; epoch 1: 6
    assert (step, images) == (12, 32)


def test_a_new_run_started_from_another_runs_checkpoint_keeps_its_progress_not_that_runs_history(
    tmp_path, checkpointer
):
    """checkpoints.resume of another run's checkpoint: the position and loss history carry over, but that run's
    failed grids (with paths into its folder), intermediate outputs and wall time are not this run's. A resume
    of the run's own checkpoint keeps them."""
    import torch
    from accelerate import Accelerator

    history = {
        "intermediate_outputs": [{"epoch": 1, "step": 8, "files": ["x"]}],
        "sample_grid_failures": [
            {"step": 8, "traceback": str(tmp_path / "samples" / "step-000008.error.txt")}
        ],
        "wall_seconds": 12.5,
        "sampling_seconds": 3.0,
    }
    saved = checkpoint.TrainState(global_step=8, batches_in_epoch=8, images_seen=8, losses=[1.0], **history)
    saved.loss_steps, saved.loss_images = [8], [8]
    path = checkpointer(saved, keep_every_steps=8).maybe_save()
    p = plan_steps(images_per_epoch=8, batch_size=1, grad_accum=1, epochs=3)

    own = checkpointer(checkpoint.TrainState()).load(path, p, 8)
    assert (own.intermediate_outputs, own.sample_grid_failures) == (
        history["intermediate_outputs"],
        history["sample_grid_failures"],
    )
    assert own.wall_seconds >= 12.5  # and the saving session's seconds
    assert own.sampling_seconds == 3.0

    other = checkpoint.Checkpointer(
        Accelerator(cpu=True),
        tmp_path / "new-run",
        checkpoint.TrainState(),
        get_weights=lambda: {"w": torch.zeros(2)},
        set_weights=lambda _: None,
    )
    live = other.load(path, p, 8)
    assert (live.global_step, live.images_seen, live.losses) == (8, 8, [1.0])
    assert (live.intermediate_outputs, live.sample_grid_failures, live.wall_seconds) == ([], [], 0.0)
    assert live.sampling_seconds == 0.0


# -- the loss history across a moved resume ------------------------------------------------------------------


def history(out: Path) -> dict:
    return json.loads((out / "loss_history.json").read_text())


@pytest.mark.train
@trains_in_process
def test_the_loss_history_of_a_resume_with_another_micro_batch_counts_images(tiny_sd15, tmp_path, capsys):
    """4 images x 2 epochs at batch 1 (8 steps), checkpoint after step 3, resumed at batch 2: step 1 of 4
    (moved_position: 1 of the 3 images done is a whole batch of 2, the third trains again). The history
    numbered its 6 entries 1..6 for a run of 4 steps whose steps covered 1 image, then 2: loss.png drew them
    on one step axis. Now each entry says the images seen (strictly increasing, to the run's 9) and its step
    in the run that took it: 1..3 before the resume, 2..4 (this run's steps) after."""
    from conftest import make_images

    data = make_images(tmp_path / "data", n=4)
    opts = ("training.max_steps=null", "training.epochs=2")
    first = tmp_path / "first"
    run.train(
        tiny_train_config(
            tiny_sd15, data, first, "training.batch_size=1", *opts, "checkpoints.keep_every_steps=3"
        )
    )
    kept = checkpoint.checkpoint_root(first) / "step-000003"
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    run.train(tiny_train_config(tiny_sd15, data, resumed, "training.batch_size=2", *opts), resume=str(kept))
    # the batches of size 2 are another order than the checkpoint's of size 1: said, not counted as exact
    said = capsys.readouterr().out
    assert (
        "that is step 1 of 4 (the micro-batch changed inside epoch 1 to one that does not divide the batch 1 "
        "its order was cut at: the rest of that epoch is drawn" in said
    )
    h, s = history(resumed), summary(resumed)
    assert (s["steps"], s["images_seen"]) == (4, 9)
    assert h["images_seen"] == [1, 2, 3, 5, 7, 9]  # strictly increasing, ending at the run's images
    assert h["steps"] == [1, 2, 3, 2, 3, 4]
    assert h["losses"][:3] == history(first)["losses"][:3] and len(h["losses"]) == 6
    assert history(first)["images_seen"] == history(first)["steps"] == list(range(1, 9))


@pytest.mark.train
@trains_in_process
def test_a_resume_at_half_the_micro_batch_trains_the_images_of_the_uninterrupted_run(
    tiny_sd15, tmp_path, capsys, monkeypatch
):
    """What the out-of-memory retry does: a batch-4 run over 10 images (batches of 4, 4 and 2 an epoch) resumed
    from its step 2 at batch 2 x accumulation 2. Its epoch's rest was drawn in batch 2's order, so some of the
    epoch's images trained twice and as many not at all. Now the resumed run keeps the checkpoint's order
    (batch 4's, cut in halves): the images it trains, in order, are the uninterrupted run's after the
    checkpoint's, and none twice; its checkpoints say the order batch, 4, so a second resume of it inside an
    epoch at batch 1 trains the rest of the uninterrupted run's images too."""
    from conftest import make_images
    from sdplan.trainer import loop

    drawn: list[list[int]] = []
    step = loop.optimizer_step

    def recorded(recipe, optimizer, batch, *args, **kwargs):
        drawn.append(batch["index"].tolist())  # the dataset indices this micro-batch trains
        return step(recipe, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", recorded)

    def train(out: Path, *settings: str, resume: Path | None = None) -> list[int]:
        drawn.clear()
        opts = ("training.max_steps=null", "training.epochs=2", "checkpoints.keep_every_steps=1")
        config = tiny_train_config(tiny_sd15, data, out, *settings, *opts)
        run.train(config, resume=None if resume is None else str(resume))
        assert all(len(b) <= config.training.batch_size for b in drawn)
        return [i for b in drawn for i in b]

    data = make_images(tmp_path / "data", n=10)
    straight = train(tmp_path / "straight", "training.batch_size=4")
    assert sorted(straight[:10]) == sorted(straight[10:]) == list(range(10))
    kept = checkpoint.checkpoint_root(tmp_path / "straight") / "step-000002"
    done = checkpoint.read_state(kept).images_seen  # 8 or 6: the short batch may be among the first two
    capsys.readouterr()
    half = train(tmp_path / "half", "training.batch_size=2", "training.grad_accum=2", resume=kept)
    assert "micro-batch changed" not in capsys.readouterr().out
    assert straight[:done] + half == straight
    assert summary(tmp_path / "half")["images_seen"] == 20

    again = checkpoint.checkpoint_root(tmp_path / "half") / "step-000004"  # inside epoch 2
    state = checkpoint.read_state(again)
    assert (state.epoch, state.batch_size, state.order_batch_size) == (1, 2, 4)
    assert 10 < state.images_seen < 20
    one = train(tmp_path / "one", "training.batch_size=1", "training.grad_accum=4", resume=again)
    assert straight[: state.images_seen] + one == straight
    assert summary(tmp_path / "one")["images_seen"] == 20


@pytest.mark.train
@trains_in_process
def test_a_resume_with_another_accumulation_trains_the_images_of_an_uninterrupted_run(tiny_sd15, tmp_path):
    """A batch 2 x accumulation 1 checkpoint after step 1 resumed as batch 1 x accumulation 2 (what the
    out-of-memory retry does): accelerate's micro-batch counter came back as saved (1), so the next step closed
    after one micro-batch and the run reached its 4 steps with 7 of its 8 images. Now every step takes its 2
    images, as in an uninterrupted 1 x 2 run."""
    from conftest import make_images

    data = make_images(tmp_path / "data", n=4)
    opts = ("training.max_steps=null", "training.epochs=2")
    first = tmp_path / "first"
    run.train(
        tiny_train_config(
            tiny_sd15, data, first, "training.batch_size=2", *opts, "checkpoints.keep_every_steps=1"
        )
    )
    kept = checkpoint.checkpoint_root(first) / "step-000001"
    small = ("training.batch_size=1", "training.grad_accum=2", *opts)
    resumed = tmp_path / "resumed"
    run.train(tiny_train_config(tiny_sd15, data, resumed, *small), resume=str(kept))
    straight = tmp_path / "straight"
    run.train(tiny_train_config(tiny_sd15, data, straight, *small))
    assert history(straight)["images_seen"] == [2, 4, 6, 8]
    assert history(resumed)["images_seen"] == history(straight)["images_seen"]
    assert (summary(resumed)["steps"], summary(resumed)["images_seen"]) == (4, 8)


@pytest.mark.train
@trains_in_process
def test_a_resume_on_a_dataset_of_another_size_says_so(tiny_sd15, tmp_path, capsys):
    """Images added between an interrupt and the resume: the resumed epoch skips the first batches of the new
    order (some images twice, some never in that epoch) without a word. Now one note; none for the same set."""
    from conftest import make_images

    first = tmp_path / "first"
    run.train(
        tiny_train_config(
            tiny_sd15, make_images(tmp_path / "d4", n=4), first, "checkpoints.keep_every_steps=1"
        )
    )
    kept = checkpoint.checkpoint_root(first) / "step-000001"
    assert checkpoint.read_state(kept).samples_per_epoch == 4
    capsys.readouterr()
    run.train(tiny_train_config(tiny_sd15, tmp_path / "d4", tmp_path / "same"), resume=str(kept))
    assert "note: the dataset has" not in capsys.readouterr().out
    run.train(
        tiny_train_config(tiny_sd15, make_images(tmp_path / "d6", n=6), tmp_path / "more"), resume=str(kept)
    )
    assert f"note: the dataset has 6 samples per epoch; {kept} was saved with 4" in capsys.readouterr().out


def test_a_checkpoint_without_the_history_positions_numbers_its_steps_and_spreads_its_images():
    """A train_state.json written before the history kept steps and images still resumes: steps 1..n, the
    images it had seen spread over them."""
    state = checkpoint.TrainState.from_json(
        {"global_step": 4, "images_seen": 8, "losses": [1.0, 0.9, 0.8, 0.7]}
    )
    assert state.loss_history() == {
        "steps": [1, 2, 3, 4],
        "images_seen": [2, 4, 6, 8],
        "losses": [1.0, 0.9, 0.8, 0.7],
    }
    state.images_seen = 10
    state.record_loss(5, 0.6)
    assert state.loss_history()["steps"][-1] == 5 and state.loss_history()["images_seen"][-1] == 10


# -- real 2-process runs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """8 captioned images of three aspect ratios (aspect-ratio buckets at 128 px)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("shapes")
    for i in range(8):
        Image.new("RGB", [(256, 96), (96, 256), (200, 200)][i % 3], (30 * i, 120, 200 - 20 * i)).save(
            folder / f"img{i}.png"
        )
        (folder / f"img{i}.txt").write_text("a photo of sks shape")
    return folder


# 8 images x 2 epochs = 16, batch 1, accumulation 3: 3 steps/epoch on one process (3 + 3 + 2 micro-batches),
# 2 on two (3 + 1 each); cosine schedule with warmup; LoRA dropout.
OPTS = (
    "training.batch_size=1",
    "training.grad_accum=3",
    "training.max_steps=null",
    "training.epochs=2",
    "training.lr_scheduler=cosine",
    "training.lr_warmup_steps=2",
    "lora.dropout=0.1",
    "data.resolution=128",
    "data.buckets=true",
)


def config_file(model: Path, data: Path, out: Path, *extra: str) -> Path:
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(tiny_train_config(model, data, out, *OPTS, *extra).to_dict()))
    return path


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


def assert_continuous_history(out: Path) -> None:
    """loss.png's x axis after a moved resume: the images seen, strictly increasing to the run's total."""
    seen = history(out)["images_seen"]
    assert all(a < b for a, b in zip(seen, seen[1:])) and seen[-1] == summary(out)["images_seen"], seen


@pytest.mark.slow
@pytest.mark.train
@trains_in_process
def test_two_processes_resumed_on_two_and_on_one(tiny_sd15, shapes, tmp_path):
    """A 2-process run's checkpoint after step 1 (mid-epoch, 6 of 16 images): resumed on 2 processes it equals
    the uninterrupted run bit for bit; resumed on 1 process it trains the other 10 images (it trained 19)."""
    straight = tmp_path / "straight"
    train_two_processes(config_file(tiny_sd15, shapes, straight, "checkpoints.keep_every_steps=1"), tmp_path)
    assert (summary(straight)["steps"], summary(straight)["images_seen"]) == (4, 16)
    kept = checkpoint.checkpoint_root(straight) / "step-000001"
    assert checkpoint.read_state(kept).images_seen == 6
    assert checkpoint.read_state(kept).images_in_epoch == 6  # both processes' (the first's own: 3)

    again = tmp_path / "again"
    train_two_processes(config_file(tiny_sd15, shapes, again), tmp_path, "--resume", str(kept))
    assert_same_run(straight, again)

    one = tmp_path / "one"
    run.train(tiny_train_config(tiny_sd15, shapes, one, *OPTS), resume=str(kept))
    assert (summary(one)["num_processes"], summary(one)["steps"], summary(one)["images_seen"]) == (1, 6, 16)
    assert_continuous_history(one)
    # step 1 of 2 processes (6 images), then 1 process from its step 2: 3 + 3 + 2 micro-batches an epoch
    assert (history(one)["steps"], history(one)["images_seen"]) == ([1, 3, 4, 5, 6], [6, 8, 11, 14, 16])


@pytest.mark.slow
@pytest.mark.train
@trains_in_process
def test_one_process_resumed_on_two(tiny_sd15, shapes, tmp_path):
    """A 1-process checkpoint after step 2 (6 of 16 images) resumed on 2 processes trains the other 10 (it
    trained 14: the step count was the 1-process one)."""
    first = tmp_path / "first"
    run.train(tiny_train_config(tiny_sd15, shapes, first, *OPTS, "checkpoints.keep_every_steps=2"))
    kept = checkpoint.checkpoint_root(first) / "step-000002"
    assert checkpoint.read_state(kept).images_seen == 6

    two = tmp_path / "two"
    train_two_processes(config_file(tiny_sd15, shapes, two), tmp_path, "--resume", str(kept))
    assert (summary(two)["num_processes"], summary(two)["steps"], summary(two)["images_seen"]) == (2, 4, 16)
    assert_continuous_history(two)
    # steps 1-2 of 1 process (3 images each), then 2 processes from their step 1: 3 + 1 micro-batches each
    assert (history(two)["steps"], history(two)["images_seen"]) == ([1, 2, 2, 3, 4], [3, 6, 8, 14, 16])
