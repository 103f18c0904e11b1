"""Every ZeRO stage against a single-process PyTorch reference with the same global batch.

stages 0-3 x world sizes 1, 2, 4 x GAS 1 and 4 x clipping on/off, fp32 AdamW, 10 optimizer
steps on the tiny GPT: max |dtheta| <= 1e-5 and the losses of all stages agree.
"""
import itertools

import pytest

from tests.dist.harness import run_ranks
from tests.dist.workloads import sweep, train_reference

STEPS, MICRO = 10, 2
COMBOS = list(itertools.product([0, 1, 2, 3], [1, 4], [1.0, 0.0]))
_reference_cache: dict = {}


def reference(global_batch: int, clip: float) -> dict:
    key = (global_batch, clip)
    if key not in _reference_cache:
        _reference_cache[key] = train_reference(STEPS, global_batch, clip)
    return _reference_cache[key]


def max_param_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stages_match_single_process_reference(world_size):
    results = run_ranks(sweep, world_size, COMBOS, STEPS, MICRO)
    report = []
    for stage, gas, clip in COMBOS:
        ref = reference(MICRO * gas * world_size, clip)
        ranks = [r[(stage, gas, clip)] for r in results]
        diff = max(max_param_diff(r["params"], ref["params"]) for r in ranks)
        loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], ref["losses"]))
        report.append((stage, gas, clip, diff, loss_diff))
        assert diff <= 1e-5, f"stage {stage} gas {gas} clip {clip}: max |dtheta| {diff:.3g}"
        assert loss_diff <= 1e-5, f"stage {stage} gas {gas} clip {clip}: loss diff {loss_diff:.3g}"
    for gas, clip in itertools.product([1, 4], [1.0, 0.0]):  # losses equal across stages
        losses = [results[0][(s, gas, clip)]["losses"] for s in range(4)]
        assert max(abs(a - b) for l in losses[1:] for a, b in zip(l, losses[0])) <= 1e-5
    print(f"\nworld {world_size}: worst max|dtheta| {max(r[3] for r in report):.2e}, "
          f"worst loss diff {max(r[4] for r in report):.2e} over {len(report)} runs")
