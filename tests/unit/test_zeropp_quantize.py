"""raydeep.zero.quantize against DeepSpeed's ZeRO++ kernels, transcribed thread by thread in
tests/dist/deepspeed_zeropp_oracle.py, and against the bounds its arithmetic implies."""
from __future__ import annotations

import math

import pytest
import torch

from raydeep.zero import quantize as Q
from tests.dist import deepspeed_zeropp_oracle as O


def _weights(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over several magnitudes, with an all-zero stretch (a whole group when groups are small)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)[torch.randperm(numel, generator=g)]
    x[: min(numel // 4, 256)] = 0.0
    return x.to(dtype)


# --------------------------------------------------------------------------------------------
# qwZ: int8 weights
# --------------------------------------------------------------------------------------------

WEIGHT_GROUP_CASES = [
    (8, 1),  # ceil(8/8000) = 1 and 8 % 8 == 0
    (4096, 1),
    (8000, 1),
    (8008, 7),  # 8008 = 8 * 7 * 11 * 13: 2..6 groups leave fractional loads, 7 is the first that fits
    (16000, 2),  # 8000 a group is not "> 8000", so no doubling
    (24000, 3),
    (98760, 15),  # 8 * 12345; 13, 14 do not divide 12345
    (12296, 29),  # 8 * 29 * 53: the first fitting count is 29 (groups of 424)
    (1_000_000, 125),
]


@pytest.mark.parametrize("numel,groups", WEIGHT_GROUP_CASES)
def test_weight_groups_hand_cases(numel, groups):
    assert Q.weight_groups(numel) == groups
    assert O.CUDAQuantizer().groups_for(numel) == groups


def test_weight_groups_agrees_with_deepspeed_everywhere_and_rejects_what_it_asserts():
    oracle = O.CUDAQuantizer()
    for numel in list(range(8, 4000, 8)) + list(range(7992, 200_000, 1096)):
        assert Q.weight_groups(numel) == oracle.groups_for(numel), numel
    for bad in (0, 7, 100, 8001):
        with pytest.raises(ValueError, match="qwZ"):
            Q.weight_groups(bad)
    with pytest.raises(AssertionError):
        oracle.groups_for(100)


# (numel, dtype, explicit groups): one group (256 threads, 1 unroll), 3 groups of 8000 (2 unrolls),
# 29 groups of 424 (32 threads), 13 groups of 16 (sub-block schedule, 16 groups a block), and
# sizes that are not multiples of 8 (raydeep pads: 100 -> 104, 12290 -> 12296).
QWZ_CASES = [
    (4096, torch.float32, None),
    (24000, torch.bfloat16, None),
    (12290, torch.float32, None),
    (208, torch.bfloat16, 13),
    (100, torch.float32, None),
    (5000, torch.float16, None),
]


@pytest.mark.parametrize("numel,dtype,groups", QWZ_CASES)
def test_qwz_matches_deepspeed_bitwise(numel, dtype, groups):
    x = _weights(numel, dtype, seed=numel)
    q, scales = Q.quantize_weights(x, groups)
    padded = Q.padded_weight_numel(numel)
    assert q.dtype == torch.int8 and q.shape == (padded,) and scales.dtype == torch.float32

    # DeepSpeed asserts on a size that is not a multiple of 8: feed it the zero-padded tensor.
    x_ds = torch.cat([x, x.new_zeros(padded - numel)])
    ds = O.CUDAQuantizer()
    q_ds, scales_ds = ds.quantize(x_ds, groups)
    assert torch.equal(q, q_ds.view(-1))
    assert torch.equal(scales, scales_ds)

    for out_dtype in (torch.float16, dtype):
        deq = Q.dequantize_weights(q, scales, out_dtype, numel=numel)
        deq_ds = ds.dequantize(q_ds, scales_ds, dtype=out_dtype).view(-1)[:numel]
        assert deq.dtype == out_dtype and deq.shape == (numel,)
        assert torch.equal(deq, deq_ds)


def test_qwz_rounds_half_to_even_and_clamps_the_maximum():
    # max |h| = 128 makes scale = 256 / 256 = 1 exactly (also under fast-math: a power of two), so
    # h * scale hits .5 ties: __float2int_rn rounds them to even; 128 itself clamps to 127.
    ties = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, -127.5, 128.0, -128.0,
                         0.0, -0.0, 7.0, 1.0])
    expected = torch.tensor([0, 2, 2, 4, 0, -2, -2, -4, 126, -128, 127, -128, 0, 0, 7, 1], dtype=torch.int8)
    q, scales = Q.quantize_weights(ties)
    assert torch.equal(q, expected)
    assert scales.item() == 1.0
    q_ds, _ = O.CUDAQuantizer().quantize(ties)
    assert torch.equal(q_ds, expected)
    # A smaller power-of-two maximum: max 4 -> scale 32; 0.078125 * 32 = 2.5 -> 2, 0.109375 * 32 = 3.5 -> 4
    q2, scales2 = Q.quantize_weights(torch.tensor([4.0, 0.078125, 0.109375, -0.078125, 0, 0, 0, 0]))
    assert q2.tolist()[:4] == [127, 2, 4, -2]
    assert scales2.item() == 1 / 32


def test_qwz_all_zero_groups():
    x = torch.zeros(16)
    x[8:] = -0.0
    q, scales = Q.quantize_weights(x, groups=2)
    assert torch.equal(q, torch.zeros(16, dtype=torch.int8))
    assert scales.view(-1).tolist() == [1.0, 1.0]  # Params(max == 0) sets scale 1, stored 1 / 1
    q_ds, scales_ds = O.CUDAQuantizer().quantize(x, 2)
    assert torch.equal(scales, scales_ds) and torch.equal(q, q_ds)
    assert torch.equal(Q.dequantize_weights(q, scales, torch.float32), torch.zeros(16))


def _half_ulp16(v: torch.Tensor) -> torch.Tensor:
    """Half an fp16 spacing at |v| (subnormals included), as float64."""
    v = v.double().abs()
    exponent = torch.floor(torch.log2(torch.clamp(v, min=2.0 ** -14)))
    return 2.0 ** (exponent - 11)


def test_qwz_error_bound_follows_from_the_arithmetic():
    """Per group with m = max |h| (h = fp16(x)): scale s = 128/m, q = rint(h s), stored 1/s.

    - unclamped: |h - q/s| <= 0.5/s = m/256, plus fp32 rounding of s, h*s and 1/s (each
      relative 2**-24, on values up to 128: together < 3 m 2**-23), plus the final fp16
      rounding of the result (half an fp16 ulp of it);
    - the positive maximum maps to 128 and clamps to 127, so values with h s >= 127.5 lose up
      to a full step: |h - 127/s| <= m/128 (+ the same small terms). Negative values never clamp
      (-128 is representable).
    Against the fp32 input add |x - h| <= half an fp16 ulp of x.
    """
    torch.manual_seed(1)
    x = torch.cat([torch.randn(8000) * 10 ** e for e in (-3, -1, 0, 2)] + [torch.rand(8000) * 5])
    q, scales = Q.quantize_weights(x)
    groups = scales.numel()
    deq = Q.dequantize_weights(q, scales, torch.float32).double().view(groups, -1)
    h = x.to(torch.float16).double().view(groups, -1)
    m = h.abs().amax(dim=1, keepdim=True)
    clamped = (h * 128 / m >= 127.5)
    step_bound = torch.where(clamped, m / 128, m / 256)
    bound = step_bound + 3 * m * 2.0 ** -23 + _half_ulp16(deq)
    err = (h - deq).abs()
    assert (err <= bound).all(), (err - bound).max()
    # The clamp is real: each group's positive maximum misses by a whole step (m/128), so the
    # tighter m/256 bound fails there.
    assert clamped.any()
    assert ((err > m / 256 + _half_ulp16(deq)) & clamped).any()
    total = (x.double().view(groups, -1) - deq).abs()
    assert (total <= bound + _half_ulp16(x.view(groups, -1))).all()
    print(f"qwZ max error / group max: {(err / m).max().item():.6f} (bound 1/128 = {1 / 128:.6f})")


def test_qwz_bytes_per_element_for_a_4096_element_shard():
    q, scales = Q.quantize_weights(torch.randn(4096))
    payload = q.numel() * q.element_size() + scales.numel() * scales.element_size()
    # One group of 4096: 4096 int8 bytes + one fp32 scale.
    assert scales.numel() == 1 and payload == 4096 + 4
    ratio = payload / (4096 * 4)
    print(f"qwZ bytes for a 4096-element shard: {payload} = {ratio:.5f} x fp32's {4096 * 4}")
    assert ratio == pytest.approx(0.250244140625) and ratio <= 0.26


def test_qwz_keeps_the_input_device_and_rejects_unlaunchable_groups():
    x = torch.randn(64)
    q, scales = Q.quantize_weights(x)
    assert q.device == x.device and scales.device == x.device
    with pytest.raises(ValueError, match="equal groups"):
        Q.quantize_weights(torch.randn(64), groups=3)
    with pytest.raises(ValueError, match="multiple of 8"):
        Q.quantize_weights(torch.randn(64), groups=16)  # groups of 4 would read the next group
    with pytest.raises(ValueError, match="exceed"):
        Q.quantize_weights(torch.randn(16384 * 2), groups=1)  # launch_quant has no kernel for it


# --------------------------------------------------------------------------------------------
# qgZ pieces: swizzle_quant, quantized_reduction, dequantize_int4
# --------------------------------------------------------------------------------------------


def test_int4_packing_puts_the_first_value_in_the_high_nibble():
    # max 8 -> scale 16 / 16 = 1: values quantize to themselves, 8 clamps to 7, ties go to even.
    x = torch.tensor([8.0, -8.0, 1.0, -1.0, 2.5, 3.5, -0.5, 0.0], dtype=torch.float16)
    packed, scales = Q.swizzle_quant(x, 1, 1, 1)
    q = [7, -8, 1, -1, 2, 4, 0, 0]
    assert packed.tolist() == [((a & 0xF) << 4 | (b & 0xF)) - (256 if a < 0 else 0)
                               for a, b in zip(q[0::2], q[1::2])]
    assert scales.item() == 1.0
    packed_ds, scales_ds = O.swizzle_quant(x, 1, 4, O.SYMMETRIC, 1, 1, 1)
    assert torch.equal(packed, packed_ds) and torch.equal(scales, scales_ds)
    assert Q.dequantize_int4(packed, scales, 1).tolist() == [7, -8, 1, -1, 2, 4, 0, 0]


# (numel, groups, nodes, devices_per_node): groups of 8 .. 16384 values (32 to 512 threads,
# 2 or 4 chunks a thread), swizzles for 2x2, 2x4, 4x2 and one rank.
SWIZZLE_CASES = [
    (2048, 64, 2, 2),
    (2048, 64, 2, 4),
    (4096, 16, 4, 2),
    (1536, 8, 2, 4),
    (256, 32, 2, 2),
    (16384, 1, 1, 1),
    (24576, 2, 2, 1),
]


@pytest.mark.parametrize("numel,groups,nodes,dpn", SWIZZLE_CASES)
def test_swizzle_quant_matches_deepspeed_bitwise(numel, groups, nodes, dpn):
    x = _weights(numel, torch.float16, seed=numel + groups)
    packed, scales = Q.swizzle_quant(x, groups, nodes, dpn)
    packed_ds, scales_ds = O.swizzle_quant(x, groups, 4, O.SYMMETRIC, 1, nodes, dpn)
    assert packed.shape == (numel // 2,) and scales.shape == (groups, 1)
    assert torch.equal(packed, packed_ds)
    assert torch.equal(scales, scales_ds)
    deq = Q.dequantize_int4(packed, scales, groups)
    assert torch.equal(deq, O.dequantize(packed_ds, scales_ds, groups, 4))


def test_swizzle_layout_moves_whole_partitions():
    # 2 nodes x 4 devices: partition p (one group each) is filled with p + 1; after the swizzle,
    # position d * nodes + n holds partition n * 4 + d: 0 4 1 5 2 6 3 7 (swizzled_quantize.cu's comment).
    x = torch.arange(1, 9, dtype=torch.float16).repeat_interleave(16)
    packed, scales = Q.swizzle_quant(x, 8, 2, 4)
    deq = Q.dequantize_int4(packed, scales, 8).view(8, 16)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    # every group is constant c: c * 16 / (2c) = 8 clamps to 7, so it comes back as 7c/8
    assert torch.equal(deq[:, 0], torch.tensor([7 * (p + 1) / 8 for p in order], dtype=torch.float16))


def _random_pieces(dpn: int, tensor_bytes: int, groups_per_tensor: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (dpn * tensor_bytes,), generator=g, dtype=torch.int8)
    scales = (torch.rand(dpn * groups_per_tensor, 1, generator=g) * 4 + 1e-3).float()
    scales[0] = 1.0  # an all-zero group's stored value
    return values, scales


# (devices_per_node, bytes a tensor, in groups a tensor, out groups): out groups of 4 bytes
# (one thread) to 12288 bytes (1024 threads, 3 chunks each).
REDUCE_CASES = [
    (2, 256, 16, 16),
    (4, 256, 8, 8),
    (4, 1024, 8, 2),
    (2, 12288, 1, 1),
    (3, 96, 6, 24),
]


@pytest.mark.parametrize("dpn,tensor_bytes,in_per_tensor,out_groups", REDUCE_CASES)
def test_quantized_reduction_matches_deepspeed_bitwise(dpn, tensor_bytes, in_per_tensor, out_groups):
    values, scales = _random_pieces(dpn, tensor_bytes, in_per_tensor, seed=tensor_bytes + dpn)
    in_groups = dpn * in_per_tensor
    out, out_scales = Q.quantized_reduction(values, scales, in_groups, out_groups, dpn)
    out_ds, out_scales_ds = O.quantized_reduction(values, scales, in_groups, out_groups, 4, O.SYMMETRIC, dpn)
    assert out.shape == (tensor_bytes,) and out_scales.shape == (out_groups, 1)
    assert torch.equal(out, out_ds)
    assert torch.equal(out_scales, out_scales_ds)


def test_quantized_reduction_sums_in_fp16():
    # Piece a dequantizes to -2048 everywhere (max 2048: scale 1/256, q = -8, step 256); piece b
    # to [-1, -3, 1, 0, 0, 0, 0, 7] (max 8: scale 1, 8 clamps to 7). Above 2048 fp16 values are 2
    # apart, so __hadd2 gives -2049 -> -2048 and -2051 -> -2052 (ties to even): the group maximum is
    # 2052, where an fp32 sum would give 2051 and another scale.
    dpn = 2
    piece_a = torch.full((8,), -2048.0, dtype=torch.float16)
    piece_b = torch.tensor([-1.0, -3.0, 1.0, 0, 0, 0, 0, 8.0], dtype=torch.float16)
    qa, sa = Q.swizzle_quant(piece_a, 1, 1, 1)
    qb, sb = Q.swizzle_quant(piece_b, 1, 1, 1)
    values, scales = torch.cat([qa, qb]), torch.cat([sa, sb])
    out, out_scales = Q.quantized_reduction(values, scales, 2, 1, dpn)
    out_ds, out_scales_ds = O.quantized_reduction(values, scales, 2, 1, 4, O.SYMMETRIC, dpn)
    assert torch.equal(out, out_ds) and torch.equal(out_scales, out_scales_ds)

    def stored(max_abs: float) -> float:
        scale = torch.tensor(16.0) / (2 * torch.tensor(max_abs))
        return (torch.tensor(1.0) / scale).item()

    assert out_scales.item() == stored(2052.0) != stored(2051.0)


# --------------------------------------------------------------------------------------------
# qgZ end to end: all_to_all_quant_reduce for W ranks
# --------------------------------------------------------------------------------------------

END_TO_END_CASES = [
    ((64, 32), 2, 2),
    ((64, 32), 2, 4),
    ((2, 3, 64), 2, 4),  # intra groups = W
    ((16, 128), 2, 2),
    ((4, 4, 512), 2, 2),  # 4 groups of 2048 values
    ((24, 48), 3, 2),  # three nodes: 1/3 is not exact in fp32
    ((100,), 2, 2),  # 1-D: plain reduce-scatter
    ((3, 5), 2, 2),  # 15 % 8: plain reduce-scatter, uneven chunks
    ((6, 6), 2, 4),  # 36 % 16: plain reduce-scatter, the last rank gets 1 value
]


@pytest.mark.parametrize("shape,nodes,dpn", END_TO_END_CASES)
def test_all_to_all_quant_reduce_matches_deepspeed_bitwise(shape, nodes, dpn):
    world = nodes * dpn
    g = torch.Generator().manual_seed(world * 1000 + math.prod(shape))
    grads = [(torch.randn(shape, generator=g) * (r + 1)).half() for r in range(world)]
    grads[0].view(-1)[:16] = 0  # an all-zero group in rank 0's first partition
    out = Q.simulate_all_to_all_quant_reduce(grads, nodes, dpn)
    out_ds = O.all_to_all_quant_reduce_world(grads, nodes, dpn)
    assert len(out) == world
    for r in range(world):
        assert out[r].dtype == out_ds[r].dtype == torch.float16
        assert torch.equal(out[r], out_ds[r]), r
    falls_back = Q.qgz_fallback_reason(shape, nodes, dpn) is not None
    assert falls_back == (len(shape) == 1 or math.prod(shape) % (2 * world) != 0)


def test_bf16_gradients_are_converted_to_fp16_first():
    shape, nodes, dpn = (64, 32), 2, 2
    torch.manual_seed(3)
    grads = [torch.randn(shape).bfloat16() for _ in range(nodes * dpn)]
    out = Q.simulate_all_to_all_quant_reduce(grads, nodes, dpn)
    out_ds = O.all_to_all_quant_reduce_world([t.half() for t in grads], nodes, dpn)
    assert all(torch.equal(a, b) for a, b in zip(out, out_ds))
    with pytest.raises(TypeError):  # DeepSpeed's kernel would read bf16 bits as fp16
        O.swizzle_quant(grads[0], 64, 4, O.SYMMETRIC, 1, nodes, dpn)


@pytest.mark.parametrize("nodes,dpn", [(2, 2), (2, 4)])
def test_each_rank_gets_its_own_partition_summed_over_ranks_over_nodes(nodes, dpn):
    """Routing, independent of the oracle: rank k's partition p is constant c[k, p], far apart
    per partition. Each stage's constant groups come back as 7/8 of themselves (max -> 8 -> 7),
    so rank r gets (7/8)**2 * sum_k c[k, r] / nodes: divided by the node count, not by W."""
    world = nodes * dpn
    shape = (world * 8, 16)  # intra groups = world * 8: 8 groups a partition, 16 values each
    part = math.prod(shape) // world
    c = [[(p + 1) * 4.0 + k * 0.125 for p in range(world)] for k in range(world)]
    grads = [torch.tensor(c[k], dtype=torch.float16).repeat_interleave(part).view(shape) for k in range(world)]
    out = Q.simulate_all_to_all_quant_reduce(grads, nodes, dpn)
    for r in range(world):
        expected = (7 / 8) ** 2 * sum(c[k][r] for k in range(world)) / nodes
        assert out[r].shape == (part,)
        assert torch.allclose(out[r].double(), torch.full((part,), expected, dtype=torch.float64), rtol=2e-3), r


@pytest.mark.parametrize("shape", [(6, 4), (10, 8), (12, 2)])
def test_layouts_deepspeed_mishandles_fall_back_in_raydeep(shape):
    # DeepSpeed's two rules let these through (2-D, numel % 8 == 0 for W = 4), but its swizzle
    # would leave groups unwritten or read across groups: the oracle reports that, raydeep falls back.
    nodes, dpn = 2, 2
    reason = Q.qgz_fallback_reason(shape, nodes, dpn)
    assert reason is not None and reason.startswith("raydeep:")
    grads = [torch.randn(shape).half() for _ in range(nodes * dpn)]
    with pytest.raises(O.UndefinedBehaviour):
        O.all_to_all_quant_reduce_world(grads, nodes, dpn)
    out = Q.simulate_all_to_all_quant_reduce(grads, nodes, dpn)
    assert all(torch.equal(a, b) for a, b in zip(out, Q.simulate_reduce_scatter(grads)))


def test_gradient_groups_and_group_layout():
    assert Q.gradient_groups((64, 32), 8, 4) == (64, 16)
    assert Q.gradient_groups((2, 3, 64), 8, 4) == (8, 2)
    assert Q.local_group_ranks(1, 4) == [4, 5, 6, 7]
    assert Q.global_group_ranks(2, 2, 4) == [2, 6]
    groups = O.get_local_all_to_all_groups(8, 4)
    assert list(groups["local_1"].ranks) == Q.local_group_ranks(1, 4)
    assert list(groups["global_2"].ranks) == Q.global_group_ranks(2, 2, 4)
    with pytest.raises(ValueError):
        Q.gradient_groups((64,), 8, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(600,), (7, 5)])
def test_reduce_scatter_fallback_keeps_dtype_and_divides_as_cuda_does(shape, dtype):
    # 3 nodes x 2: CUDA's ``div_(6)`` multiplies by the fp32 1/6, which is not a true division.
    nodes, dpn = 3, 2
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(shape, generator=g).to(dtype) for _ in range(nodes * dpn)]
    out = Q.simulate_all_to_all_quant_reduce(grads, nodes, dpn)
    out_ds = O.all_to_all_quant_reduce_world(grads, nodes, dpn)
    chunk = math.ceil(math.prod(shape) / 6)
    for r in range(6):
        assert out[r].dtype == dtype and out[r].shape == out_ds[r].shape
        assert out[r].numel() == len(range(math.prod(shape))[r * chunk:(r + 1) * chunk])
        assert torch.equal(out[r], out_ds[r])
    if dtype == torch.float32 and shape == (600,):
        flat = torch.stack([t.reshape(-1) for t in grads])
        true_div = flat / 6
        assert not torch.equal(true_div, torch.stack([Q._divide_like_cuda(t.reshape(-1), 6) for t in grads]))
