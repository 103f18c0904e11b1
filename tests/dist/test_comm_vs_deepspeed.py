"""Bytes on the wire per optimizer step: raydeep against DeepSpeed itself, stages 0-3.

Both engines train the tiny GPT with the same config and data (fp32, 2 gloo ranks, GAS 2) in
one process group, with every torch.distributed collective wrapped to count its tensor bytes
(``deepspeed_peer.CollectiveRecorder``). After warm-up steps (stage 3 records its fetch trace
in the first), the steady-state volume per step is converted to per-rank ring traffic:

    all-reduce 2(W-1)/W * n;  reduce-scatter, all-gather, reduce, broadcast (W-1)/W * n

with n the logical tensor bytes (the reduced tensor, the reduce-scatter input, the all-gather
output). raydeep must not move more than DeepSpeed (2% slack). Byte counts are deterministic,
so nothing here is timed.

raydeep's own ``engine.comm_stats()`` is checked against what the recorder saw it issue, so
the comparison does not rest on the engine reporting itself correctly (on gloo its
reduce-scatters and all-gathers are point-to-point exchanges, whose sent bytes must equal the
ring traffic reported for them).
"""
from __future__ import annotations

import sys

import pytest

from tests.dist.harness import run_ranks

STAGES, WORLD, GAS, MICRO, CLIP = [0, 1, 2, 3], 2, 2, 2, 1.0
WARMUP, STEPS = 2, 4
SLACK = 1.02
# Per-rank ring traffic per logical byte, for each collective kind.
RING = {"all_reduce": 2 * (WORLD - 1) / WORLD, "reduce_scatter": (WORLD - 1) / WORLD,
        "all_gather": (WORLD - 1) / WORLD, "reduce": (WORLD - 1) / WORLD, "broadcast": (WORLD - 1) / WORLD,
        # Point-to-point sends are wire bytes as they are; a receive is the other end of a send.
        "send": 1.0, "irecv": 0.0}


def ring_bytes(counts: dict[str, dict]) -> float:
    unknown = set(counts) - set(RING)
    assert not unknown, f"collectives without a ring-traffic rule: {sorted(unknown)}"
    return sum(RING[kind] * entry["bytes"] for kind, entry in counts.items())


def _raydeep_stage(recorder, stage: int) -> dict:
    import torch.distributed as dist

    import raydeep
    from tests.dist.workloads import config, run_steps, tiny_gpt

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(stage, GAS, MICRO, CLIP))
    own_reset = engine.reset_comm_stats

    def reset():  # start both counts at the same step
        own_reset()
        recorder.reset()

    engine.reset_comm_stats = reset
    run_steps(engine, STEPS, MICRO * GAS * dist.get_world_size(), WARMUP)
    seen = {kind: dict(entry) for kind, entry in recorder.counts.items()}
    seen["all_reduce"]["calls"] -= STEPS - WARMUP  # run_steps' own float64 loss all-reduce per step
    seen["all_reduce"]["bytes"] -= 8 * (STEPS - WARMUP)
    seen = {kind: entry for kind, entry in seen.items() if entry["calls"]}
    reported = {kind: {"calls": s["calls"], "bytes": s["bytes"]} for kind, s in engine.comm_stats().items()}
    return {"reported": reported, "seen": seen}


def _measure(stages: list[int]) -> dict:
    from tests.dist import deepspeed_peer

    # The recorder must wrap torch.distributed before raydeep.comm binds its collectives.
    assert "raydeep.comm" not in sys.modules, "raydeep was imported before the collectives were wrapped"
    recorder = deepspeed_peer._RECORDER = deepspeed_peer.CollectiveRecorder().install()
    ours = {stage: _raydeep_stage(recorder, stage) for stage in stages}
    theirs = deepspeed_peer.deepspeed_comm_sweep(stages, STEPS, WARMUP, MICRO, GAS, CLIP)
    return {"raydeep": ours, "deepspeed": theirs}


def _ops(counts: dict, steps: int) -> str:
    """``kind:calls x bytes`` per step, for the table."""
    return " ".join(f"{kind}:{v['calls'] // steps}x{v['bytes'] // steps}" for kind, v in sorted(counts.items()))


@pytest.mark.peers
@pytest.mark.slow
def test_ring_traffic_not_above_deepspeed(capsys):
    pytest.importorskip("deepspeed", exc_type=ImportError)
    results = run_ranks(_measure, WORLD, STAGES, fresh=True)  # collectives wrapped before raydeep is imported
    steps = STEPS - WARMUP
    rows, failures = [], []
    for stage in STAGES:
        for rank, res in enumerate(results):
            ours = res["raydeep"][stage]
            # On gloo raydeep's reduce-scatters and all-gathers are exchanges of sends and
            # receives (raydeep.comm.exchange): what they put on the wire must be what comm_stats()
            # reports by the ring rule; every other collective is reported as issued.
            reported, seen = ours["reported"], ours["seen"]
            assert ring_bytes(reported) == ring_bytes(seen), (
                f"stage {stage} rank {rank}: comm_stats() {reported} but issued {seen}")
            exchanged = {"reduce_scatter", "all_gather", "send", "irecv"}
            assert {k: v for k, v in reported.items() if k not in exchanged} == \
                {k: v for k, v in seen.items() if k not in exchanged}, (stage, rank, reported, seen)
            assert seen.get("send", {}).get("calls") == seen.get("irecv", {}).get("calls"), seen
            mine, theirs = ring_bytes(ours["reported"]) / steps, ring_bytes(res["deepspeed"][stage]) / steps
            if mine > SLACK * theirs:
                failures.append(f"stage {stage} rank {rank}: raydeep {mine:.0f} B/step > "
                                f"DeepSpeed {theirs:.0f} x {SLACK}")
            if rank == 0:
                rows.append((stage, mine, theirs, _ops(ours["reported"], steps), _ops(res["deepspeed"][stage], steps)))
    with capsys.disabled():
        print(f"\nper-rank ring traffic per optimizer step (bytes): world {WORLD}, GAS {GAS}, fp32, "
              f"mean of steps {WARMUP + 1}-{STEPS}")
        print(f"{'stage':>5}  {'raydeep':>10}  {'DeepSpeed':>10}  {'ratio':>5}  "
              "raydeep ops | DeepSpeed ops (calls x bytes per step)")
        for stage, mine, theirs, ops_ours, ops_theirs in rows:
            print(f"{stage:>5}  {mine:>10.0f}  {theirs:>10.0f}  {mine / theirs:>5.2f}  {ops_ours} | {ops_theirs}")
    assert not failures, "; ".join(failures)
