"""1-bit Adam, 0/1 Adam and 1-bit LAMB through the engine on the tiny GPT (stage 0, gloo ranks).

- the engine against the N-worker reference over the warm-up and the compressed stage;
- the bytes of a compressed step against the fp32 all-reduce of the same model, counted by
  raydeep's CommStats and, independently, by wrapping torch.distributed.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.compression_workloads import engine_against_reference, load_at_another_world_size, reload_in_compressed_stage
from tests.dist.harness import run_ranks

STEPS = 10
CASES = {
    "OneBitAdam": ({"lr": 2e-3, "freeze_step": 4, "weight_decay": 0.01}, {"lr": 2e-3, "freeze_step": 4,
                                                                            "weight_decay": 0.01}),
    "ZeroOneAdam": ({"lr": 2e-3, "var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2,
                     "local_step_clipper": 2}, {"lr": 2e-3, "var_freeze_step": 6, "var_update_scaler": 2,
                                               "local_step_scaler": 2, "local_step_clipper": 2}),
    "OneBitLamb": ({"lr": 2e-3, "freeze_step": 4, "weight_decay": 0.01}, {"lr": 2e-3, "freeze_step": 4,
                                                                            "weight_decay": 0.01}),
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


@pytest.mark.parametrize("name", list(CASES))
def test_a_reload_in_the_compressed_stage_continues_the_same_trajectory(name, tmp_path):
    """The error feedback is saved per rank and restored: the resumed run's losses equal the
    uninterrupted run's (DeepSpeed reset the errors on load, which changed them)."""
    params = dict(CASES[name][0])
    optimizer = {"type": name, "params": params}
    rank0 = run_ranks(reload_in_compressed_stage, 2, optimizer, 9, 7, str(tmp_path / "ckpt"))[0]
    assert rank0["phase_at_save"] == "compressed"
    for step, (a, b) in enumerate(zip(rank0["got"], rank0["expected"]), start=1):
        assert abs(a - b) <= 1e-6, f"step {step}: {a} vs {b}"
    assert rank0["same_params"]
    # Another world size: the buffers are per rank, so they restart from zero, and it says so.
    other = run_ranks(load_at_another_world_size, 4, optimizer, str(tmp_path / "ckpt"))[0]
    assert other["phase"] == "compressed" and len(other["warnings"]) == 1
    assert "written by 2 ranks and this run has 4" in other["warnings"][0]
    assert other["errors"] and all(v > 0 for k, v in other["errors"].items() if "error" in k)


CONVERGENCE_STEPS, BETAS = 300, [0.9, 0.99]


def test_compressed_optimizers_converge_within_three_percent_of_the_same_update_uncompressed():
    """World size 4, the tiny GPT on the built-in corpus, 300 steps. The uncompressed run is
    DeepSpeed's Adam update without compression (1-bit Adam that never freezes: no bias
    correction, like every phase of both compressed optimizers). beta2 = 0.99 so the variance
    settles within the warm-up of a run this short (1-bit Adam freezes it at 15% of the steps).
    Also prints the communication saved over the whole run, warm-up included."""
    from tests.dist.compression_workloads import converge

    common = {"lr": 2e-3, "betas": BETAS}
    optimizers = {
        "uncompressed": {"type": "OneBitAdam", "params": {**common, "freeze_step": 10 ** 9}},
        "OneBitAdam": {"type": "OneBitAdam", "params": {**common, "freeze_step": 45}},
        "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {**common, "var_freeze_step": 150, "var_update_scaler": 16,
                                                          "local_step_scaler": 100, "local_step_clipper": 2}},
    }
    runs = run_ranks(converge, 4, optimizers, CONVERGENCE_STEPS, 4)[0]
    final = {k: sum(v["losses"][-20:]) / 20 for k, v in runs.items()}
    total = {k: sum(op["bytes"] for op in v["comm"].values()) for k, v in runs.items()}
    for name in ("OneBitAdam", "ZeroOneAdam"):
        print(f"{name}: final loss {final[name]:.4f} vs {final['uncompressed']:.4f} uncompressed "
              f"({final[name] / final['uncompressed'] - 1:+.2%}); bytes over the run "
              f"{total[name] / total['uncompressed']:.3f}x ({total['uncompressed'] / total[name]:.1f}x less)")
        assert runs[name]["phase"] == "compressed"
        assert final[name] <= 1.03 * final["uncompressed"], final
    assert final["uncompressed"] < 0.5 * runs["uncompressed"]["losses"][0]  # the task is learnt


def test_onebit_lamb_converges_within_three_percent_of_lamb():
    """The same task for 1-bit LAMB against its own warm-up update run uncompressed to the end
    (DeepSpeed's LAMB: no bias correction, the trust ratio clamped per parameter), freezing at
    15% of the steps. raydeep's ``Lamb`` (FusedLamb's update) is printed beside them."""
    from tests.dist.compression_workloads import converge

    common = {"lr": 2e-2, "betas": BETAS}
    optimizers = {
        "uncompressed": {"type": "OneBitLamb", "params": {**common, "freeze_step": 10 ** 9}},
        "OneBitLamb": {"type": "OneBitLamb", "params": {**common, "freeze_step": 45}},
        "Lamb": {"type": "Lamb", "params": common},
    }
    runs = run_ranks(converge, 4, optimizers, CONVERGENCE_STEPS, 4)[0]
    final = {k: sum(v["losses"][-20:]) / 20 for k, v in runs.items()}
    total = {k: sum(op["bytes"] for op in v["comm"].values()) for k, v in runs.items()}
    print(f"OneBitLamb: final loss {final['OneBitLamb']:.4f} vs {final['uncompressed']:.4f} uncompressed "
          f"({final['OneBitLamb'] / final['uncompressed'] - 1:+.2%}; raydeep Lamb {final['Lamb']:.4f}); bytes over "
          f"the run {total['OneBitLamb'] / total['uncompressed']:.3f}x "
          f"({total['uncompressed'] / total['OneBitLamb']:.1f}x less)")
    assert runs["OneBitLamb"]["phase"] == "compressed" and runs["uncompressed"]["phase"] == "warm-up"
    assert final["OneBitLamb"] <= 1.03 * final["uncompressed"], final
    assert final["uncompressed"] < 0.5 * runs["uncompressed"]["losses"][0]  # the task is learnt
