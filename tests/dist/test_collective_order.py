"""Divergent ranks are reported as a divergence naming the op within seconds, not a hang.

Two programs that hang real DeepSpeed jobs until the NCCL timeout: one rank runs an extra forward
the other skips (evaluation or ``generate()`` on rank 0 only, under ZeRO-3 where every forward
gathers parameters), and one rank configured with another bucket size (different gradient
buckets, so different reduce-scatter shapes). With ``raydeep.check_collective_order`` every rank
fails at the same collective with a message that names it; the test measures how long that takes.
"""
import time

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, global_batches, tiny_gpt

DEADLINE_S = 10.0  # the bound on the time from the divergence to the error


def diverge(kind: str) -> dict:
    """Train a few steps with the order check on, diverging at step 1; returns what was raised."""
    import torch
    import torch.distributed as dist

    import raydeep
    from raydeep.comm.order import CollectiveOrderError

    rank = dist.get_rank()
    bucket = 20000 if kind != "bucket" or rank == 0 else 30000
    cfg = config(3 if kind == "forward" else 2, 1, 2, 1.0, raydeep={"check_collective_order": True,
                                                                    "collective_order_timeout_s": 30})
    cfg["zero_optimization"]["reduce_bucket_size"] = bucket
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    started = None
    try:
        for step, batch in enumerate(global_batches(3, 4)):
            x = batch[rank * 2:rank * 2 + 2]
            started = time.monotonic() if step == 1 or kind == "bucket" else started
            if kind == "forward" and step == 1 and rank == 0:
                with torch.no_grad():
                    engine(x[:, :-1], x[:, 1:])  # an evaluation forward only rank 0 runs
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
    except CollectiveOrderError as err:
        return {"error": str(err), "seconds": time.monotonic() - started}
    finally:
        engine.destroy()
    return {"error": None, "seconds": None}


@pytest.mark.parametrize("kind", ["forward", "bucket"])
def test_divergence_is_named_within_seconds(kind):
    results = run_ranks(diverge, 2, kind)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained through a divergence"
        assert result["seconds"] < DEADLINE_S, result
        message = result["error"]
        assert "ranks diverged at collective #" in message
        assert "rank 0:" in message and "rank 1:" in message
        assert "raydeep/" in message and " in " in message  # each rank's call site
    print(f"{kind}: {results[0]['seconds']:.2f} s to the error\n{results[0]['error']}")
    lines = {line.split(":")[0].strip(): line for line in results[0]["error"].splitlines() if line.startswith("  rank")}
    if kind == "bucket":
        # Same op, different shapes: the reduce-scatter of each rank's first gradient bucket.
        assert "reduce_scatter" in lines["rank 0"] and "reduce_scatter" in lines["rank 1"]
        assert lines["rank 0"].split("unit")[0] != lines["rank 1"].split("unit")[0]
    else:
        # Rank 0's extra forward gathers parameters while rank 1 is already in its backward.
        assert lines["rank 0"].split("unit")[0] != lines["rank 1"].split("unit")[0]
        assert "all_gather" in lines["rank 0"]
    assert all("unit -" not in line for line in lines.values()), lines  # each names the unit
