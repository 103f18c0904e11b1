"""The global sample order and the ledger: exactly once, whatever the world size (no Ray needed)."""
from __future__ import annotations

import numpy as np
import pytest

from raydeep.ray.batch_plan import plan_batches
from raydeep.ray.ledger import (SampleLedger, SampleOrder, expected_digest, micro_positions,
                                step_ids_in_position_order)


def test_each_epoch_is_a_permutation_and_epochs_differ():
    order = SampleOrder(13, seed=5)
    epochs = [order.ids(e * 13, 13) for e in range(3)]
    for ids in epochs:
        assert sorted(ids.tolist()) == list(range(13))
    assert not np.array_equal(epochs[0], epochs[1])
    # Reading across an epoch boundary gives the same ids as reading each epoch.
    assert np.array_equal(order.ids(10, 6), np.concatenate([epochs[0][10:], epochs[1][:3]]))


def test_order_depends_only_on_seed_and_position():
    a, b = SampleOrder(1000, seed=1), SampleOrder(1000, seed=1)
    b.ids(5000, 7)  # a reader elsewhere in the stream changes nothing
    assert np.array_equal(a.ids(123, 50), b.ids(123, 50))
    assert not np.array_equal(a.ids(0, 50), SampleOrder(1000, seed=2).ids(0, 50))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_world_size_trains_on_the_same_global_batch(world):
    plan = plan_batches({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, world, world) \
        .for_world_size(world)
    order, start = SampleOrder(100, seed=0), 48
    per_rank = [np.concatenate([order.ids(p.start, len(p)) for p in
                                (micro_positions(start, k, rank, world, plan.micro_batch) for k in range(plan.grad_accum))])
                for rank in range(world)]
    covered = sorted(p for rank in range(world) for k in range(plan.grad_accum)
                     for p in micro_positions(start, k, rank, world, plan.micro_batch))
    assert covered == list(range(start, start + 16))  # each position exactly once
    assert np.array_equal(step_ids_in_position_order(per_rank, world, plan.micro_batch), order.ids(start, 16))


def test_resumed_ledger_ends_with_the_uninterrupted_digest():
    order, batch = SampleOrder(50, seed=3), 8
    whole = SampleLedger()
    for step in range(10):
        whole.record(order.ids(step * batch, batch))
    first = SampleLedger()
    for step in range(4):
        first.record(order.ids(step * batch, batch))
    resumed = SampleLedger.from_state(first.state_dict())
    for step in range(4, 10):
        resumed.record(order.ids(step * batch, batch))
    assert resumed.digest == whole.digest == expected_digest(order, 10, batch)
    assert (resumed.samples, resumed.steps) == (80, 10)


def test_a_repeated_or_skipped_step_changes_the_digest():
    order, batch = SampleOrder(50, seed=3), 8
    repeated, skipped = SampleLedger(), SampleLedger()
    for step in [0, 1, 1, 2]:
        repeated.record(order.ids(step * batch, batch))
    for step in [0, 2, 3]:
        skipped.record(order.ids(step * batch, batch))
    reference = expected_digest(order, 4, batch)
    assert repeated.digest != reference and skipped.digest != reference
