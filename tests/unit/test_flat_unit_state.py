"""A FlatUnit's shard state: ``unshard``, ``wait`` and ``reshard`` move it between SHARDED,
UNSHARDING and UNSHARDED, each idempotent, with exactly one all-gather per SHARDED -> UNSHARDED.
One gloo rank with ``RAYDEEP_COLLECTIVES_AT_WORLD_1=1``, so the all-gathers run and are counted."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raydeep import comm
from raydeep.zero.flat import FlatUnit, ShardState


@pytest.fixture
def unit(monkeypatch):
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        params = [("a", nn.Parameter(torch.arange(6.0))), ("b", nn.Parameter(torch.ones(3)))]
        yield FlatUnit("u", params, rank=0, partitions=1, group_index=0, grad_dtype=torch.float32,
                       separate_local=True)
    finally:
        dist.destroy_process_group()


def gathers(stats: comm.CommStats) -> int:
    return int(stats.summary().get("all_gather", {}).get("calls", 0))


def test_a_new_unit_is_unsharded_and_resharding_twice_is_resharding_once(unit):
    assert unit.state is ShardState.UNSHARDED
    unit.reshard()
    unit.reshard()
    assert unit.state is ShardState.SHARDED and unit.full.untyped_storage().nbytes() == 0


def test_unshard_gathers_once_and_refills_the_parameter_views(unit):
    a = unit.params[0]
    unit.reshard()
    stats = comm.CommStats()
    unit.unshard(stats)
    unit.unshard(stats)  # already whole: nothing to do
    assert unit.state is ShardState.UNSHARDED and gathers(stats) == 1
    assert torch.equal(a.data, torch.arange(6.0))  # the view made before the reshard sees the values again


def test_an_asynchronous_unshard_is_finished_by_wait_or_a_synchronous_unshard(unit):
    stats = comm.CommStats()
    unit.reshard()
    unit.unshard(stats, async_op=True)
    assert unit.state is ShardState.UNSHARDING
    unit.unshard(stats, async_op=True)  # in flight: not started again
    unit.unshard(stats)  # waits for the one in flight
    assert unit.state is ShardState.UNSHARDED and gathers(stats) == 1
    unit.wait()  # nothing in flight: nothing to do
    assert unit.state is ShardState.UNSHARDED


def test_resharding_under_an_all_gather_in_flight_is_refused(unit):
    unit.reshard()
    unit.unshard(comm.CommStats(), async_op=True)
    with pytest.raises(AssertionError, match="all-gather is in flight"):
        unit.reshard()
    unit.wait()
    unit.reshard()
    assert unit.state is ShardState.SHARDED
