"""``raydeep bench --ray --dtype bf16``: the ranks as Ray actors in a placement group on the
package's shared cluster (tests/ray/conftest.py), every contender in bf16; the rows, each
contender's losses against the same training in float64 (computed here), the model states against
the formula, and the placement group gone afterwards."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import ray
import torch

from raydeep.cli import main

pytestmark = pytest.mark.slow

MODEL, N_LAYER, SEQ, MICRO, GAS, WORLD = "gpt-tiny", 1, 32, 2, 2, 2
STEPS, WARMUP = 1, 1  # two rounds: the loss before any update, and after one
ARGS = ["bench", "--ray", "--dtype", "bf16", "--world", str(WORLD), "--steps", str(STEPS), "--warmup", str(WARMUP),
        "--model", MODEL, "--n-layer", str(N_LAYER), "--seq", str(SEQ), "--micro-batch", str(MICRO), "--gas", str(GAS),
        "--bucket", "20000", "--no-deepspeed", "--lr"]

# The bench's default learning rate, 1e-4, moves the loss on its random tokens by ~2e-3 in one
# AdamW update (every element moves by about lr): less than the bf16 recipes can be told apart by,
# so a contender that never updated would pass. At 1e-2 the first update moves the loss by ~0.06
# (the float64 reference below says how much, and the test checks it).
LR = 1e-2
# bf16 keeps 8 significant bits: a loss in [4, 8) is known to half an ulp, 2^-6. The three bf16
# recipes (raydeep's fp32 masters, torch autocast, FSDP2's bf16 parameters) round at different
# places; none may lose more than that against the float64 training (they agree to ~1e-3).
BF16_LOSS_TOLERANCE = 2.0 ** -6
ARGS.append(str(LR))


def reference_losses(lr: float) -> list[float]:
    """The bench's training in float64 in this process: the same initial weights and batches
    (raydeep.bench.run), the mean of every rank's micro-batch losses as the gradient, clipping,
    AdamW; rank 0's mean micro-batch loss at each round, before that round's update."""
    from raydeep.bench.engines import CLIP, WEIGHT_DECAY
    from raydeep.bench.run import batches, build_model

    model = build_model(argparse.Namespace(model=MODEL, n_layer=N_LAYER, seq=SEQ)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    rounds = WARMUP + STEPS
    data = [batches(MICRO, GAS, SEQ, rank, WORLD, rounds, model.config.vocab_size) for rank in range(WORLD)]
    losses = []
    for step in range(rounds):
        optimizer.zero_grad()
        rank0 = 0.0
        for rank in range(WORLD):
            for x, y in data[rank][step]:
                loss = model(x, y)
                (loss / (GAS * WORLD)).backward()
                if rank == 0:
                    rank0 += loss.item() / GAS
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(rank0)
    return losses


def this_jobs_placement_groups() -> list:
    from ray.util.state import list_placement_groups

    context = ray.get_runtime_context()
    groups = list_placement_groups(address=context.gcs_address, detail=True,
                                   filters=[("creator_job_id", "=", context.get_job_id())])
    return [g for g in groups if g.state != "REMOVED"]


def test_bench_on_ray_actors_in_bf16(connected, tmp_path):
    assert main(ARGS + ["--out", str(tmp_path)]) == 0
    assert not this_jobs_placement_groups()
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert summary["machine"]["ranks"] == "Ray actors" and summary["setup"]["dtype"] == "bf16"
    assert "bf16 AdamW" in (tmp_path / "bench.md").read_text()
    names = [row["name"] for row in summary["rows"]]
    # overlap_comm at each stage's default: the rows carry no "overlap" suffix
    assert names == ["raydeep z0", "raydeep z1", "raydeep z2", "raydeep z3", "DDP", "torch ZeRO-1", "FSDP2 grad-op",
                     "FSDP2"]
    trained, untrained = reference_losses(LR), reference_losses(0.0)
    # The update moves the loss by more than twice the tolerance: a contender that never updated
    # (its second loss the untrained model's, give or take its rounding) fails below.
    assert abs(trained[1] - untrained[1]) > 2 * BF16_LOSS_TOLERANCE, (trained, untrained)
    for row in summary["rows"]:
        assert len(row["losses"]) == WARMUP + STEPS and all(math.isfinite(x) for x in row["losses"]), row["name"]
        for step, (loss, exact) in enumerate(zip(row["losses"], trained)):
            assert abs(loss - exact) <= BF16_LOSS_TOLERANCE, (row["name"], step, loss, exact, untrained[step])
        assert row["loss_max_abs_diff"] <= 2 * BF16_LOSS_TOLERANCE, row["name"]  # against raydeep z0's
        if row["family"] == "raydeep":
            assert max(row["state_bytes"]) == row["state_bytes_formula"], row["name"]
