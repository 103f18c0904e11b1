"""ZeRO model-state memory arithmetic: the ZeRO paper's numbers and DeepSpeed's estimators."""

from __future__ import annotations

import os

import pytest

from raydeep.estimate import (
    GB,
    MemoryEstimate,
    deepspeed_zero2_estimate,
    deepspeed_zero3_estimate,
    estimate_model_states,
)


def _gb(num_params, world_size, stage, **kw):
    return estimate_model_states(num_params, world_size, stage, **kw).total / GB


def _close_to_printed(value: float, printed: str) -> bool:
    """True if ``value`` rounds to ``printed`` (half a unit of its last digit, plus float slack)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) <= 0.5 * 10**-decimals + 1e-9


def test_zero_paper_worked_example():
    # Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB
    totals = [_gb(7.5e9, 64, stage) for stage in range(4)]
    assert totals[0] == 120.0
    assert _close_to_printed(totals[1], "31.4") and totals[1] == pytest.approx(30 + 1.40625)
    assert _close_to_printed(totals[2], "16.6") and totals[2] == pytest.approx(15 + 1.640625)
    assert totals[3] == 1.875 and _close_to_printed(totals[3], "1.9")


@pytest.mark.parametrize(
    "psi, n, stage, printed",
    [
        (7.5e9, 4, 1, "52.5"), (7.5e9, 4, 2, "41.3"), (7.5e9, 4, 3, "30.0"),
        (7.5e9, 16, 1, "35.6"), (7.5e9, 16, 2, "21.6"), (7.5e9, 16, 3, "7.5"),
        (7.5e9, 1024, 1, "30.1"), (7.5e9, 1024, 2, "15.1"), (7.5e9, 1024, 3, "0.12"),
        (128e9, 4, 1, "896"), (128e9, 16, 2, "368"),
        (128e9, 64, 1, "536"), (128e9, 64, 2, "284"), (128e9, 64, 3, "32.0"),
        (128e9, 1024, 1, "513.5"), (128e9, 1024, 2, "257.8"), (128e9, 1024, 3, "2.0"),
        (1e12, 64, 1, "4188"), (1e12, 64, 2, "2219"), (1e12, 64, 3, "250"),
        (1e12, 1024, 1, "4012"), (1e12, 1024, 2, "2014"), (1e12, 1024, 3, "15.6"),
    ],
)
def test_zero_paper_table(psi, n, stage, printed):
    assert _close_to_printed(_gb(psi, n, stage), printed)


def test_breakdown_mixed_precision():
    psi, n = 1_000_000, 4
    assert estimate_model_states(psi, n, 0).as_dict() == {
        "params": 2 * psi, "grads": 2 * psi, "master": 4 * psi, "optimizer_states": 8 * psi,
        "buffers": 0, "cpu": 0, "total": 16 * psi}
    z1 = estimate_model_states(psi, n, 1)
    assert (z1.params, z1.grads, z1.master, z1.optimizer_states) == (2 * psi, 2 * psi, psi, 2 * psi)
    z2 = estimate_model_states(psi, n, 2)
    assert (z2.params, z2.grads) == (2 * psi, psi // 2)
    z3 = estimate_model_states(psi, n, 3)
    assert z3.total == 16 * psi // n


def test_bf16_equals_fp16():
    for stage in range(4):
        assert estimate_model_states(10**9, 8, stage, "bf16") == estimate_model_states(10**9, 8, stage, "fp16")


@pytest.mark.parametrize(
    "stage, per_param",  # bytes/param with N = 4: fp32 params 4, grads 4, no separate master, Adam 8
    [(0, 16), (1, 4 + 4 + 8 / 4), (2, 4 + (4 + 8) / 4), (3, 16 / 4)],
)
def test_fp32_rows(stage, per_param):
    psi = 4_000_000
    est = estimate_model_states(psi, 4, stage, precision="fp32")
    assert est.master == 0
    assert est.total == pytest.approx(per_param * psi)


def test_partitions_round_up_to_the_largest_rank():
    est = estimate_model_states(10, 3, 3)  # partitions of 4, 3, 3 elements; rank 0 holds 4
    assert (est.params, est.grads, est.master, est.optimizer_states) == (8, 8, 16, 32)


def test_offload_optimizer_moves_master_adam_and_fp32_grads_to_cpu():
    psi, n = 8_000_000, 8
    base = estimate_model_states(psi, n, 2)
    off = estimate_model_states(psi, n, 2, offload_optimizer=True)
    assert (off.master, off.optimizer_states, off.grads) == (0, 0, 0)
    assert off.params == base.params == 2 * psi  # DeepSpeed's ZeRO-2 offload GPU figure: 2 B/param
    assert off.cpu == 16 * psi // n  # fp32 master 4 + Adam 8 + fp32 grads 4, partitioned
    z1 = estimate_model_states(psi, n, 1, offload_optimizer=True)
    assert z1.grads == 2 * psi and z1.cpu == 16 * psi // n  # ZeRO-1 keeps full 16-bit grads


def test_offload_in_fp32_still_needs_a_cpu_master_copy():
    off = estimate_model_states(1_000_000, 4, 2, precision="fp32", offload_optimizer=True)
    assert off.params == 4_000_000 and off.cpu == 16 * 1_000_000 // 4


def test_stage3_offload_matches_deepspeed_bytes_per_param():
    psi, n = 8_000_000, 8
    opt_only = estimate_model_states(psi, n, 3, offload_optimizer=True)
    assert (opt_only.total, opt_only.cpu) == (2 * psi // n, 16 * psi // n)
    both = estimate_model_states(psi, n, 3, offload_optimizer=True, offload_param=True)
    assert (both.total, both.cpu) == (0, 18 * psi // n)


@pytest.mark.parametrize(
    "kw",
    [{"stage": 0, "offload_optimizer": True}, {"stage": 2, "offload_param": True}, {"stage": 4},
     {"stage": 1, "precision": "fp8"}, {"stage": 1, "world_size": 0}, {"stage": 1, "num_params": -1},
     {"stage": 2, "reduce_bucket_size": 0}],
)
def test_invalid_arguments(kw):
    args = {"num_params": 1000, "world_size": 2, **kw}
    with pytest.raises(ValueError):
        estimate_model_states(**args)


def test_buffers():
    psi = 1000
    assert estimate_model_states(psi, 4, 2).buffers == 0  # only counted on request
    # ZeRO-1/2: one reduce bucket of 16-bit grads, two with overlap_comm (off by default there)
    assert estimate_model_states(psi, 4, 2, include_buffers=True).buffers == 500_000_000 * 2
    assert estimate_model_states(psi, 4, 1, include_buffers=True, overlap_comm=True).buffers == 2 * 500_000_000 * 2
    assert estimate_model_states(psi, 4, 2, "fp32", include_buffers=True,
                                 reduce_bucket_size=1000).buffers == 1000 * 4
    # ZeRO-3: one bucket, whatever overlap_comm says; stage 0: none
    assert estimate_model_states(psi, 4, 3, include_buffers=True, overlap_comm=True).buffers == 500_000_000 * 2
    assert estimate_model_states(psi, 4, 0, include_buffers=True).buffers == 0
    # the all-gather is in place: its bucket size changes nothing
    assert estimate_model_states(psi, 4, 2, include_buffers=True, allgather_bucket_size=10) == \
        estimate_model_states(psi, 4, 2, include_buffers=True)
    est = estimate_model_states(psi, 4, 2, include_buffers=True)
    assert est.total == est.params + est.grads + est.master + est.optimizer_states + est.buffers


def test_estimate_is_frozen_and_formats():
    est = estimate_model_states(7.5e9, 64, 1)
    assert isinstance(est, MemoryEstimate)
    with pytest.raises(AttributeError):
        est.params = 0  # type: ignore[misc]
    table = est.format_table()
    assert "total (device)" in table and "31.406" in table and "cpu (offload)" in table


# --------------------------------------------------------------------------- DeepSpeed estimators
def test_deepspeed_estimates_by_hand():
    # ZeRO-2, no offload: GPU 2 psi + 18 psi / N; CPU 4 psi per GPU of the node, times 1.5
    assert deepspeed_zero2_estimate(10**9, 8, 1, cpu_offload=False) == (48 * 10**9, 2 * 10**9 + 18 * 10**9 // 8)
    # ZeRO-2 offload: GPU 2 psi; CPU psi * max(4 * gpus, 16) * 1.5
    assert deepspeed_zero2_estimate(10**9, 2, 1, cpu_offload=True) == (24 * 10**9, 2 * 10**9)
    # ZeRO-3 full offload with zero.Init: GPU = the largest layer's 4 B/param; CPU 18 psi * 1.5
    assert deepspeed_zero3_estimate(10**9, 10**7, 8, 1, True, True, True) == (27 * 10**9, 4 * 10**7)


_ZERO2_CASES = [
    (10**9, 1, 1, False), (10**9, 8, 1, True), (10**9, 8, 4, False), (7_500_000_000, 8, 8, True),
    (123_456_789, 3, 5, False), (123_456_789, 16, 2, True),
]
_ZERO3_CASES = [
    (tp, ll, g, n, off, offp, zi)
    for tp, ll in [(10**9, 10**7), (123_456_789, 4_567_891), (7_500_000_000, 262_144_000)]
    for g, n in [(1, 1), (8, 1), (8, 4), (3, 5)]
    for off in (True, False) for offp in (True, False) for zi in (True, False)
]


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2

    return z2, z3


@pytest.mark.peers
@pytest.mark.parametrize("factor", [1.5, 1.0, 2.25])
def test_deepspeed_zero2_estimate_equals_deepspeed(factor):
    z2, _ = _deepspeed()
    for tp, g, n, off in _ZERO2_CASES:
        assert deepspeed_zero2_estimate(tp, g, n, off, factor) == z2(tp, g, n, off, factor)


@pytest.mark.peers
@pytest.mark.parametrize("factor", [1.5, 1.0, 2.25])
def test_deepspeed_zero3_estimate_equals_deepspeed(factor):
    _, z3 = _deepspeed()
    for tp, ll, g, n, off, offp, zi in _ZERO3_CASES:
        cpu, gpu, _largest = z3(tp, ll, g, n, off, offp, zi, factor)
        assert deepspeed_zero3_estimate(tp, ll, g, n, off, offp, zi, factor) == (cpu, gpu)
