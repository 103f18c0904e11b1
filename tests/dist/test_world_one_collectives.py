"""``RAYDEEP_COLLECTIVES_AT_WORLD_1=1``: one rank runs every engine collective for real, so a
single GPU exercises the NCCL path end to end. Here on a one-rank gloo group: each stage issues
its collectives (``comm_stats`` counts them; without the option it counts none) and trains to
the same bits as without them -- a one-rank sum is the identity."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, train_engine


def _both(stages: list[int]) -> dict:
    return {stage: train_engine(config(stage, 2, 2, 1.0), 3, 4) for stage in stages}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_runs_the_collectives_and_trains_the_same(monkeypatch, stage):
    monkeypatch.delenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", raising=False)
    plain = run_ranks(_both, 1, [stage])[0][stage]
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")
    forced = run_ranks(_both, 1, [stage])[0][stage]
    assert plain["comm"] == {}
    assert forced["comm"] and all(op["calls"] > 0 for op in forced["comm"].values()), forced["comm"]
    assert forced["losses"] == plain["losses"]
    for name, value in plain["params"].items():
        assert torch.equal(forced["params"][name], value), name
