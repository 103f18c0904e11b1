"""The branch of :mod:`raydeep.comm` that NCCL takes -- torch's own ``reduce_scatter_tensor`` and
``all_gather_into_tensor``, with the clone of a shard that lies inside its flat buffer -- run on
CPU ranks: gloo with the exchanges turned off (``RAYDEEP_GLOO_EXCHANGE=0``).

On 2 ranks the two paths must train to the same bits: a reduce-scatter's sum of two addends is
``a + b`` whichever order the backend adds them in (IEEE addition is commutative), and an
all-gather only copies. So any difference is a bug in one branch (a wrong chunk, a missed clone,
a buffer reused too early), not rounding.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, train_engine

STEPS, MICRO, GAS = 3, 2, 2


def train_counting_sends(stage: int, overlap: bool) -> dict:
    """Train on this rank and count the point-to-point sends (the exchanges' only way to move bytes)."""
    import torch.distributed as dist

    sends = []
    original = dist.isend

    def counting(*args, **kwargs):
        sends.append(1)
        return original(*args, **kwargs)

    dist.isend = counting
    try:
        cfg = config(stage, GAS, MICRO, 1.0)
        cfg["zero_optimization"]["overlap_comm"] = overlap
        out = train_engine(cfg, STEPS, MICRO * GAS * dist.get_world_size())
    finally:
        dist.isend = original
    return {"losses": out["losses"], "params": out["params"], "sends": len(sends), "comm": out["comm"]}


@pytest.mark.slow
@pytest.mark.parametrize("stage, overlap", [(1, False), (2, False), (2, True), (3, True)])
def test_torch_collectives_train_to_the_same_bits_as_the_exchanges(monkeypatch, stage, overlap):
    monkeypatch.setenv("RAYDEEP_GLOO_EXCHANGE", "0")
    torch_path = run_ranks(train_counting_sends, 2, stage, overlap)
    monkeypatch.setenv("RAYDEEP_GLOO_EXCHANGE", "1")
    exchanged = run_ranks(train_counting_sends, 2, stage, overlap)
    assert all(r["sends"] == 0 for r in torch_path), "the torch branch ran through the exchanges"
    assert all(r["sends"] > 0 for r in exchanged), "the exchanges were not used: nothing was compared"
    assert torch_path[0]["comm"].keys() == exchanged[0]["comm"].keys()
    for a, b in zip(torch_path, exchanged):
        assert a["losses"] == b["losses"]
        for name, theta in a["params"].items():
            assert torch.equal(theta, b["params"][name]), f"{name} differs between the two paths"
