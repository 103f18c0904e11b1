"""1-bit Adam and 0/1 Adam through the engine on the tiny GPT (stage 0, gloo ranks).

- the engine against the N-worker reference over the warm-up and the compressed stage;
- the bytes of a compressed step against the fp32 all-reduce of the same model, counted by
  raydeep's CommStats and, independently, by wrapping torch.distributed.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.compression_workloads import engine_against_reference
from tests.dist.harness import run_ranks

STEPS = 10
CASES = {
    "OneBitAdam": ({"lr": 2e-3, "freeze_step": 4, "weight_decay": 0.01}, {"lr": 2e-3, "freeze_step": 4,
                                                                            "weight_decay": 0.01}),
    "ZeroOneAdam": ({"lr": 2e-3, "var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2,
                     "local_step_clipper": 2}, {"lr": 2e-3, "var_freeze_step": 6, "var_update_scaler": 2,
                                               "local_step_scaler": 2, "local_step_clipper": 2}),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = {}
    for name, (params, ref) in CASES.items():
        out[name] = run_ranks(engine_against_reference, 2, {"type": name, "params": params}, STEPS, ref)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_engine_matches_the_n_worker_reference(runs, name):
    rank0 = runs[name][0]
    assert rank0["phases"][0] == "warm-up" and rank0["phases"][-1] == "compressed"
    for step, (mine, theirs) in enumerate(zip(rank0["history"], rank0["reference"]), start=1):
        worst = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
        assert worst <= 1e-6, f"step {step} ({rank0['phases'][step - 1]}): {worst}"


def test_a_compressed_step_moves_at_most_one_sixteenth_of_the_fp32_all_reduce(runs):
    rank0 = runs["OneBitAdam"][0]
    phases, steps = rank0["phases"], rank0["step_bytes"]
    warm = [s for s, p in zip(steps, phases) if p == "warm-up"][-1]
    compressed = [s for s, p in zip(steps, phases) if p == "compressed"][-1]
    fp32_logical = warm["logical"]["all_reduce"]["bytes"]
    assert fp32_logical >= 4 * rank0["numel"]  # the gradients, plus the 8-byte norm
    wire_ratio = compressed["wire"] / warm["wire"]
    logical = sum(v["bytes"] for v in compressed["logical"].values())
    logical_ratio = logical / fp32_logical
    print(f"compressed step / fp32 step: {wire_ratio:.4f} of the bytes sent (1/{1 / wire_ratio:.1f}), "
          f"{logical_ratio:.4f} by CommStats' logical count (1/{1 / logical_ratio:.2f})")
    assert wire_ratio <= 1 / 16
    # Logical counts: N/8 out and N/8 back per chunk against 4N, so 1/16 plus the padding and scales.
    assert logical_ratio <= 1 / 16 * 1.01
