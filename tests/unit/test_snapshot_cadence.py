"""The memory snapshots' cadence: every N steps, or "auto" (at most 3% of the training time)."""
import math

import pytest

from raydeep.config import load_config
from raydeep.errors import ConfigError
from raydeep.ray.memory_snapshots import KEEP, available_memory, no_room, too_big_to_keep
from raydeep.ray.snapshot_cadence import BUDGET, SnapshotCadence


def due_steps(cadence: SnapshotCadence, steps, step_s: float = 0.1, snapshot_s: float = 0.0, saves=()) -> list[int]:
    """Drive the cadence as the loop does; the steps it snapshotted at."""
    taken = []
    for step in steps:
        cadence.step_done(step_s)
        if step in saves:
            cadence.saved()
        elif cadence.due(step):
            taken.append(step)
            cadence.measured(snapshot_s, cadence.typical_step_s())
    return taken


def test_a_number_snapshots_every_n_global_steps_whatever_it_costs():
    assert due_steps(SnapshotCadence(3), range(5, 14), snapshot_s=10.0) == [6, 9, 12]
    assert due_steps(SnapshotCadence(0), range(1, 20)) == []


def test_auto_measures_after_the_second_step_and_spends_at_most_the_budget():
    # 0.1 s steps, 0.012 s snapshots: 0.012 / (0.03 * 0.1) = 4 steps apart, counted in this attempt,
    # once the early first snapshot (after 1 step of training time) is paid for: the second waits
    # until 2 snapshots are 3% of the training time (8 steps), then one every 4.
    taken = due_steps(SnapshotCadence("auto"), range(11, 40), snapshot_s=0.012)
    assert taken == [12, 19, 23, 27, 31, 35, 39]
    for end in range(12, 40):  # at every step after its first snapshot the attempt is within budget
        spent, trained = 0.012 * sum(step <= end for step in taken[1:]), 0.1 * (end - 11)
        assert spent <= BUDGET * trained + 1e-12, end
    cadence = SnapshotCadence("auto")
    due_steps(cadence, range(1, 3), step_s=0.09, snapshot_s=0.035)
    assert cadence.gap == math.ceil(0.035 / (BUDGET * 0.09)) == 13
    assert 0.035 / (cadence.gap * 0.09) <= BUDGET


def test_a_snapshot_dearer_than_expected_is_paid_back_by_a_later_next_one():
    cadence, taken, costs = SnapshotCadence("auto"), [], []
    for step in range(1, 80):
        cadence.step_done(0.1)
        if cadence.due(step):
            taken.append(step)
            costs.append(0.05 if len(taken) == 4 else 0.012)  # the 4th costs 4x what was expected
            cadence.measured(costs[-1], cadence.typical_step_s())
    assert taken[:4] == [2, 9, 13, 17]
    # Then nothing until 5 snapshots (the next expected at 0.05 s too) fit in 3% of the training
    # time: 0.086 + 0.05 <= 0.03 * 0.1 * 46 at step 47. The gap alone (17 steps) would say 34.
    assert taken[4] == 47
    assert sum(costs) <= BUDGET * 0.1 * 78  # the whole attempt, the early first snapshot included


def test_the_first_step_of_an_attempt_is_warm_up_not_a_step_time():
    cadence = SnapshotCadence("auto")
    cadence.step_done(30.0)  # compiling, loading: not what a step costs
    cadence.step_done(0.1)
    assert cadence.typical_step_s() == 0.1


def test_a_checkpoint_restarts_the_count():
    # Gap 4 (as above); checkpoints at 15 and 25 protect those steps: the next snapshot is 4 after.
    taken = due_steps(SnapshotCadence("auto"), range(11, 32), snapshot_s=0.012, saves={15, 25})
    assert taken == [12, 19, 23, 29]


def test_a_snapshot_cheaper_than_the_budget_is_taken_every_step():
    assert due_steps(SnapshotCadence("auto"), range(1, 8), snapshot_s=0.001) == [2, 3, 4, 5, 6, 7]


def test_off_takes_no_more():
    cadence = SnapshotCadence("auto")
    cadence.off()
    assert due_steps(cadence, range(1, 10)) == []


def test_the_store_refuses_what_would_take_over_half_its_nodes_memory():
    gib = 2**30
    assert not too_big_to_keep(1 * gib, available=9 * gib)  # KEEP=2 copies: 2 of the 10 GiB there are
    assert too_big_to_keep(3 * gib, available=8 * gib)  # 6 of 11 GiB
    assert not too_big_to_keep(100 * gib, available=None)  # unknown: nothing to refuse on
    assert KEEP == 2
    available = available_memory()
    assert available is None or available > 0


def test_offload_actors_parts_count_against_their_own_node_summed_over_the_actors_there():
    gib = 2**30
    store = (1 * gib // 100, 9 * gib)  # the ranks' own small files on the driver's node: fine
    assert no_room(store, []) is None
    # Two actors on node "a" hold 2 GiB each of the newest snapshot: 4 GiB, 8 of 10 GiB for KEEP=2.
    crowded = [("a" * 16, 2 * gib, 6 * gib), ("a" * 16, 2 * gib, 6 * gib), ("b" * 16, 2 * gib, 20 * gib)]
    why = no_room(store, crowded)
    assert why is not None and "offload node aaaaaaaaaaaa" in why and "4.00 GiB" in why and "bbbb" not in why
    assert no_room(store, crowded[1:]) is None  # one actor's 2 GiB on node a: 4 of 8 GiB
    assert "driver's node" in no_room((3 * gib, 8 * gib), crowded[1:])


def test_the_setting_is_auto_by_default_and_refuses_anything_but_auto_or_steps():
    assert load_config({"train_batch_size": 8}, world_size=1).raydeep.memory_snapshot_every == "auto"
    assert load_config({"train_batch_size": 8, "raydeep": {"memory_snapshot_every": 5}},
                       world_size=1).raydeep.memory_snapshot_every == 5
    for bad in (-1, "often", True, 2.5):
        with pytest.raises(ConfigError, match=r'raydeep.memory_snapshot_every = .*must be "auto" or a number of steps'):
            load_config({"train_batch_size": 8, "raydeep": {"memory_snapshot_every": bad}}, world_size=1)
