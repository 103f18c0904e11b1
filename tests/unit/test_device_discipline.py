"""Device discipline of the hot-path helpers, checked on a CPU-only machine with fake CUDA tensors.

``FakeTensorMode`` makes tensors that claim to live on ``cuda`` and raises when an op mixes them
with real CPU tensors the way CUDA would, which is how the bugs below would have failed on a GPU:

- the gradient norm accumulated CUDA values into a CPU float64 tensor, in place;
- ``train_batch`` summed CUDA losses into a CPU scalar;
- scalars reached NCCL built on the CPU (NCCL moves CUDA tensors only): every collective now
  checks its tensor's device against the group's backend and names the op.
"""
from __future__ import annotations

import pytest
import torch

from raydeep import comm
from raydeep.precision.loss_scaler import overflow_flag
from raydeep.zero.strategy import sum_of_squares


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        probe = torch.empty(4, device="cuda")
    assert probe.device.type == "cuda"
    return mode


def _grads():
    return [torch.empty(10, device="cuda"), torch.empty(7, device="cuda", dtype=torch.bfloat16)]


def test_fake_mode_catches_a_cpu_accumulator_of_cuda_values(fake_cuda):
    """The control: the pattern the engine used to have fails under the fake mode, as on a GPU."""
    with fake_cuda:
        total = torch.zeros((), dtype=torch.float64)
        with pytest.raises(RuntimeError, match="wrong device"):
            for g in _grads():
                total += g.double().pow(2).sum()


def test_gradient_norm_accumulates_on_the_gradients_device(fake_cuda):
    with fake_cuda:
        total = sum_of_squares(_grads())
    assert total.device.type == "cuda" and total.dtype == torch.float64 and total.dim() == 0


def test_overflow_flag_stays_on_the_device(fake_cuda):
    with fake_cuda:
        flag = overflow_flag(_grads() + [None])
    assert flag.device.type == "cuda" and flag.dtype == torch.bool


def test_the_reduced_value_is_built_where_the_norm_lives(fake_cuda):
    """What the engine hands ``all_reduce_value``: the norm (or +inf) on the device, never a host
    float turned back into a CPU tensor."""
    import math

    with fake_cuda:
        sq = sum_of_squares(_grads())
        finite_or_inf = torch.where(sq.isfinite(), sq, math.inf).reshape(1)
        flag = overflow_flag(_grads()).to(torch.float64).reshape(1)
    assert finite_or_inf.device.type == "cuda" and flag.device.type == "cuda"


def test_collectives_refuse_cpu_tensors_on_nccl_naming_the_op():
    with pytest.raises(RuntimeError, match=r"all_reduce of a cpu tensor \(1,\) torch.float64 on a nccl process "
                                           r"group, which takes cuda tensors"):
        comm.check_device("all_reduce", torch.zeros(1, dtype=torch.float64), "nccl")
    comm.check_device("all_reduce", torch.zeros(1), "gloo")  # gloo takes CPU tensors


def test_collectives_accept_cuda_tensors_on_nccl(fake_cuda):
    with fake_cuda:
        t = torch.empty(3, device="cuda")
    comm.check_device("reduce_scatter", t, "nccl")


def test_gradient_copy_into_the_masters_stays_on_the_device(fake_cuda):
    """The optimizer tier's copy of a bf16 gradient shard into fp32, times the one scale, on the
    masters' device (the local tier on a GPU rank)."""
    from raydeep.tier.masters import MasterShards, plan_sub_groups

    with fake_cuda:
        master = torch.empty(64, device="cuda")
        shards = MasterShards(plan_sub_groups([64], [0], 10 ** 9), [master], [{}],
                              lambda groups: torch.optim.SGD(groups, lr=0.1))
        grad = shards._fp32_grad(shards.params[0], torch.empty(64, device="cuda", dtype=torch.bfloat16), 0.5, True)
    assert grad.device.type == "cuda" and grad.dtype == torch.float32


def test_checkpoint_pieces_are_staged_into_host_memory(fake_cuda):
    """A rank file's tensors come out on the host whatever device the states live on: ``encode``
    reads them with ``.numpy()``, which a CUDA tensor refuses (the save failed on every GPU)."""
    from raydeep.checkpoint import format as fmt

    with fake_cuda:
        packed = fmt.PackedFile()
        packed.add_run([("w", 0, 6)], {"fp32": torch.empty(6, device="cuda"),
                                       "exp_avg": torch.empty(6, device="cuda")})
        packed.add("b", 0, 2, {"fp32": torch.empty(2, device="cuda"), "exp_avg": torch.empty(2, device="cuda")})
        staged = packed.tensors()
    assert {k: (t.device.type, t.shape[0]) for k, t in staged.items()} == {"fp32": ("cpu", 8), "exp_avg": ("cpu", 8)}


def test_staged_pieces_are_copies_in_order():
    from raydeep.checkpoint import format as fmt

    a, b = torch.arange(4.0), torch.arange(10.0, 13.0)
    packed = fmt.PackedFile()
    packed.add("a", 0, 4, {"fp32": a})
    packed.add("b", 0, 3, {"fp32": b})
    staged = packed.tensors()["fp32"]
    a.add_(100)  # a later update does not reach the file
    assert staged.tolist() == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0]


def test_zeropp_quantizers_keep_everything_on_the_device(fake_cuda):
    """qwZ and qgZ run as torch ops on the tensors' own device: no host round trip, no CPU scale."""
    from raydeep.zero import quantize

    with fake_cuda:
        shard = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
        values, scales = quantize.quantize_weights(shard)
        weights = quantize.dequantize_weights(values, scales, torch.bfloat16)
        grads = torch.empty(4 * 8 * 64, device="cuda", dtype=torch.bfloat16)
        packed, gscales = quantize.swizzle_quant(grads, 32, nodes=2, devices_per_node=2)
        reduced, rscales = quantize.quantized_reduction(packed, gscales, 32, 16, devices_per_node=2)
        summed = quantize.sum_node_chunks(reduced, rscales, nodes=2)
    for t in (values, scales, weights, packed, gscales, reduced, rscales, summed):
        assert t.device.type == "cuda", t
    assert values.dtype == torch.int8 and weights.dtype == torch.bfloat16 and summed.dtype == torch.float16
