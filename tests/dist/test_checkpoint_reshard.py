"""Save at world size 4 on each ZeRO stage; load at world sizes 1, 2, 3 (and 4) on every stage.

Two checks per (saved stage, world size, new stage):

- exact: the loaded engine, saved again from its new layout, holds bit-for-bit the same fp32
  masters, Adam moments, step counts, scheduler state and counters as the original checkpoint;
- continued training (fp32 AdamW, WarmupDecayLR, clipping) equals continuing on the original
  layout within 1e-6. What remains is summation order: another world size splits the global
  batch into different micro-batches and reduces in a different order.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.checkpoint_workloads import (fresh_continuation, frozen_and_buffer_round_trip, load_and_continue,
                                             save_and_continue)
from raydeep.checkpoint import CheckpointReader
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow

STAGES = [0, 1, 2, 3]
BEFORE, AFTER = 3, 2
TOL = 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return directory, run_ranks(save_and_continue, 4, directory, STAGES, BEFORE, AFTER)[0]


def _max_param_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _assert_same_state(original_dir: str, resaved_dir: str) -> None:
    original, resaved = CheckpointReader.open(original_dir), CheckpointReader.open(resaved_dir)
    assert original.state_kinds == resaved.state_kinds == ["fp32", "exp_avg", "exp_avg_sq"]
    for kind in original.state_kinds:
        for name in original.params:
            assert torch.equal(original.full(kind, name), resaved.full(kind, name)), (resaved_dir, kind, name)
    for key in ("counters", "param_groups", "lr_scheduler", "params"):
        assert original.manifest[key] == resaved.manifest[key], key
    assert original.manifest["optimizer"]["scalars"] == resaved.manifest["optimizer"]["scalars"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resume_on_any_world_size_and_stage(saved, world):
    directory, original = saved
    pairs = [(s, t) for s in STAGES for t in STAGES]
    resumed = run_ranks(load_and_continue, world, directory, pairs, AFTER)[0]
    worst_loss = worst_param = 0.0
    for (saved_stage, stage), got in resumed.items():
        want = original[saved_stage]
        assert got["steps"] == want["steps"] == BEFORE + AFTER
        assert got["samples"] == want["samples"]
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        loss = max(abs(x - y) for x, y in zip(got["losses"], want["losses"]))
        param = _max_param_diff(got["params"], want["params"])
        assert loss <= TOL and param <= TOL, (saved_stage, stage, world, loss, param)
        worst_loss, worst_param = max(worst_loss, loss), max(worst_param, param)
        _assert_same_state(f"{directory}/stage{saved_stage}", f"{directory}/resaved-w{world}-{saved_stage}-to-{stage}")
    print(f"\nsaved at W4 -> resumed at W{world}, stages 0-3 x 0-3: "
          f"max |dloss| {worst_loss:.2e}, max |dθ| {worst_param:.2e}")


def test_without_loading_the_run_differs(saved):
    """The control: a fresh engine that does not load diverges, so the comparison above can fail."""
    _, original = saved
    params = run_ranks(fresh_continuation, 2, 2, BEFORE, AFTER)[0]
    assert _max_param_diff(params, original[2]["params"]) > 1e-3


def test_bf16_frozen_params_and_buffers(tmp_path):
    """bf16 (fp32 masters), a frozen parameter and a buffer: ZeRO-3 at W2 -> ZeRO-1 at W1."""
    directory = str(tmp_path / "bf16")
    saved = run_ranks(frozen_and_buffer_round_trip, 2, directory, True)[0]
    loaded = run_ranks(frozen_and_buffer_round_trip, 1, directory, False)[0]
    assert torch.equal(loaded["frozen"], saved["frozen"]) and torch.equal(loaded["calls"], saved["calls"])
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name  # bf16 weights re-derived from the masters
    _assert_same_state(directory, directory + "-resaved")
