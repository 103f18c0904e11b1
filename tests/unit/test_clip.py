"""Unscale-and-clip arithmetic (DeepSpeed 0.19.8 formula) with hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from raydeep.optim.clip import CLIP_EPS, clip_coefficient, is_finite_norm, local_sq_norm, unscaled_norm


def test_clip_active_folds_loss_scale_and_clip():
    # unscaled norm 20/4 = 5 > clip 1: c = (5 + 1e-6) / 1, combined = c * 4
    assert clip_coefficient(20.0, loss_scale=4.0, clip=1.0) == pytest.approx(20.000004, rel=1e-15)
    # S = 1, norm 3, clip 2: c = (3 + 1e-6) / 2
    assert clip_coefficient(3.0, loss_scale=1.0, clip=2.0) == pytest.approx(1.5000005, rel=1e-15)


def test_clip_inactive_only_unscales():
    assert clip_coefficient(2.0, loss_scale=4.0, clip=1.0) == 4.0  # unscaled 0.5 < 1
    assert clip_coefficient(0.0, loss_scale=65536.0, clip=1.0) == 65536.0
    assert clip_coefficient(1.0, loss_scale=1.0, clip=5.0) == 1.0


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_clip_disabled(clip):
    assert clip_coefficient(1e9, loss_scale=8.0, clip=clip) == 8.0


def test_norm_exactly_at_threshold_is_clipped_by_eps():
    # c = (4/4 + 1e-6)/1 = 1.000001 > 1, so DeepSpeed still (barely) clips.
    assert clip_coefficient(4.0, loss_scale=4.0, clip=1.0) == pytest.approx(4.0 * (1 + CLIP_EPS), rel=1e-15)


def test_same_as_min_one_clip_over_norm_plus_eps():
    # The bf16/fp32 path scales by min(1, clip / (norm + 1e-6)); with S = 1 it is the same number.
    for norm, clip in [(0.3, 1.0), (7.5, 1.0), (2.0, 0.5), (1e-3, 1e-4)]:
        ours = 1.0 / clip_coefficient(norm, loss_scale=1.0, clip=clip)
        assert ours == pytest.approx(min(1.0, clip / (norm + CLIP_EPS)), rel=1e-12)


def test_non_finite_norms():
    assert clip_coefficient(float("nan"), loss_scale=2.0, clip=1.0) == 2.0  # nan > 1 is False
    assert clip_coefficient(float("inf"), loss_scale=2.0, clip=1.0) == math.inf


def test_clipped_grads_have_norm_clip():
    torch.manual_seed(0)
    scale = 1024.0
    grads = [torch.randn(7, 3) * 10 * scale, torch.randn(11) * 10 * scale]
    total = float(local_sq_norm(grads).sqrt())
    combined = clip_coefficient(total, scale, clip=1.0)
    clipped = [g / combined for g in grads]
    assert float(local_sq_norm(clipped).sqrt()) == pytest.approx(1.0 / (1 + CLIP_EPS * scale / total), rel=1e-6)
    assert unscaled_norm(total, scale) == pytest.approx(total / 1024.0)


def test_local_sq_norm_hand_numbers():
    out = local_sq_norm([torch.tensor([3.0]), None, torch.tensor([[4.0, 0.0], [0.0, 12.0]])])
    assert out.dtype == torch.float64 and out.dim() == 0
    assert float(out) == 169.0
    assert float(local_sq_norm(torch.tensor([1.0, 2.0]))) == 5.0  # a bare tensor
    empty = local_sq_norm([])
    assert empty.dtype == torch.float64 and float(empty) == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_local_sq_norm_no_half_precision_overflow(dtype):
    # 300^2 = 90000 overflows fp16 (max 65504); the sum is taken in float64.
    assert float(local_sq_norm([torch.tensor([300.0, 256.0], dtype=dtype)])) == 300.0**2 + 256.0**2


def test_shard_partial_sums_add_up():
    torch.manual_seed(1)
    full = torch.randn(1000, dtype=torch.float32)
    partial = sum(float(local_sq_norm([shard])) for shard in full.chunk(4))
    assert partial == pytest.approx(float(full.double().pow(2).sum()), rel=1e-14)


def test_local_sq_norm_sparse():
    sparse = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 4.0], (5,), check_invariants=True)  # dup index 0 -> 3
    assert float(local_sq_norm([sparse])) == 9.0 + 16.0


def test_is_finite_norm():
    assert is_finite_norm(3.0) and is_finite_norm(0) and is_finite_norm(torch.tensor(2.5, dtype=torch.float64))
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert not is_finite_norm(bad)
        assert not is_finite_norm(torch.tensor(bad))
