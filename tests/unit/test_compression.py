"""1-bit compression: sign packing, the padding rule, error feedback, the compressed all-reduce at
one rank against the reference, the optimizers' phase schedules, and device propagation under a
fake CUDA device.

Everything here runs on the CPU in one process (no process group), in a few seconds.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raydeep.compression import bits, reference
from raydeep.compression.allreduce import CompressedAllReduce
from raydeep.compression.bits import pack_signs, packed_nbytes, padded_size, signs, unpack_signs
from raydeep.compression.optimizers import OnebitAdam, ZeroOneAdam

LENGTHS = list(range(0, 71)) + [127, 128, 129, 1000, 4095, 4096, 4097]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_or_fail(reason: str) -> None:
    """Skip locally; under CI=true an environment limitation fails the run instead."""
    if _under_ci():
        pytest.fail(f"CI=true, so this is not skipped: {reason}")
    pytest.skip(reason)


def _with_zeros(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` with exact +0.0 and -0.0 sprinkled in (and at both ends)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n:
        which = torch.randint(0, 4, (n,), generator=g)
        x[which == 0] = 0.0
        x[which == 1] = -0.0
        x[0] = -0.0
        x[-1] = 0.0
    return x.to(dtype)


# ------------------------------------------------------------------------------------------------
# 1. Round trip
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_round_trip_signs_every_length(dtype):
    for n in LENGTHS:
        x = _with_zeros(n, dtype, seed=n)
        # +1 for x >= 0 (so +0.0 and -0.0 both decode to +1), -1 for x < 0: built without ``>=``.
        expected = torch.ones(n)
        expected[x.float() < 0] = -1.0
        out = unpack_signs(pack_signs(x), n)
        assert out.dtype == torch.float32 and out.shape == (n,)
        assert torch.equal(out, expected), f"n={n} dtype={dtype}"
        assert torch.equal(signs(x).float(), expected), f"signs(), n={n} dtype={dtype}"
        assert signs(x).dtype == dtype


def test_round_trip_zero_and_negative_zero_decode_to_plus_one():
    x = torch.tensor([0.0, -0.0, -0.0, 0.0, -1e-30, 1e-30, -0.0, -5.0, 0.0])
    assert torch.signbit(x[1])  # really a negative zero
    out = unpack_signs(pack_signs(x), x.numel())
    assert out.tolist() == [1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_round_trip_two_dimensional_and_output_dtype(dtype, out_dtype):
    for shape in [(1, 1), (3, 5), (5, 13), (8, 8), (7, 100)]:
        n = math.prod(shape)
        x = _with_zeros(n, dtype, seed=n).view(shape)
        packed = pack_signs(x)
        assert packed.shape == (packed_nbytes(n),)
        out = unpack_signs(packed, n, dtype=out_dtype)
        assert out.dtype == out_dtype and out.shape == (n,)
        expected = torch.where(x.reshape(-1).float() < 0, -1.0, 1.0).to(out_dtype)
        assert torch.equal(out, expected)


# ------------------------------------------------------------------------------------------------
# 2. Packed size and bit order
# ------------------------------------------------------------------------------------------------

def test_packed_size_and_numpy_bit_order():
    for n in LENGTHS:
        x = _with_zeros(n, torch.float32, seed=1000 + n)
        packed = pack_signs(x)
        assert packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == -(-n // 8) == packed_nbytes(n), f"n={n}"
        # numpy.packbits: most significant bit first, a short last byte padded with 0 bits.
        want = np.packbits((x.numpy() >= 0).astype(np.uint8))
        assert np.array_equal(packed.numpy(), want), f"n={n}"


def test_bit_order_single_positions():
    for n in (8, 13, 24):
        for i in range(n):
            x = -torch.ones(n)
            x[i] = 0.5
            want = torch.zeros(packed_nbytes(n), dtype=torch.uint8)
            want[i // 8] = 1 << (7 - i % 8)
            assert torch.equal(pack_signs(x), want), f"n={n} i={i}"
    assert pack_signs(torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, -1.0, 5.0])).tolist() == [185]


# ------------------------------------------------------------------------------------------------
# 3. Padding rule
# ------------------------------------------------------------------------------------------------

def test_padded_size_rule():
    numels = list(range(0, 300)) + [1000, 1023, 1024, 4097, 65535, 65536, 1_000_003]
    for w in range(1, 17):
        unit = w * math.lcm(w, 8)
        for n in numels:
            padded = padded_size(n, w)
            assert padded >= n
            assert padded % unit == 0, (n, w, padded)
            assert padded - unit < n, f"not the smallest: n={n} w={w} padded={padded}"
            chunk = padded // w
            assert chunk * w == padded
            assert chunk % 8 == 0, f"server chunk not whole bytes: n={n} w={w}"
            assert chunk % w == 0, f"server chunk does not split across ranks: n={n} w={w}"
            assert packed_nbytes(chunk) * w == packed_nbytes(padded) == padded // 8
            assert reference._padded(n, w) == padded  # the oracle pads the same way
    assert (padded_size(100, 1), padded_size(100, 2), padded_size(100, 3), padded_size(100, 4)) == (104, 112, 144, 128)


# ------------------------------------------------------------------------------------------------
# 4. Error feedback (property)
# ------------------------------------------------------------------------------------------------

EF_STEPS = 400
EF_SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                       suppress_health_check=[HealthCheck.too_slow])


def _simulate(xs, steps: int, feedback: bool, noise: float, seed: int):
    """``steps`` compressed averages of the fixed ``xs`` (plus noise): the running mean's max abs
    error against the exact mean after each step, the inputs' summed mean, the summed outputs and
    the final error buffers."""
    world, n = len(xs), xs[0].numel()
    padded = padded_size(n, world)
    worker = [torch.zeros(padded) for _ in range(world)]
    server = [torch.zeros(padded // world) for _ in range(world)]
    true = torch.stack(xs).mean(0)
    g = torch.Generator().manual_seed(seed)
    in_total, out_total, errors = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), []
    for t in range(1, steps + 1):
        if not feedback:
            for e in worker + server:
                e.zero_()
        inputs = [x + noise * torch.randn(n, generator=g) for x in xs]
        out = reference.compressed_average(inputs, worker, server)
        assert out.shape == (n,) and torch.isfinite(out).all()
        in_total += torch.stack(inputs).double().mean(0)
        out_total += out.double()
        errors.append((out_total / t - true.double()).abs().max().item())
    return errors, in_total, out_total, worker, server


@given(world=st.sampled_from([2, 3, 4]), n=st.integers(1, 64), seed=st.integers(0, 2**31 - 1),
       noise=st.sampled_from([0.0, 0.01]))
@example(world=2, n=37, seed=0, noise=0.0)
@example(world=3, n=50, seed=1, noise=0.0)
@example(world=4, n=64, seed=2, noise=0.01)
@EF_SETTINGS
def test_error_feedback_running_mean_converges(world, n, seed, noise):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed magnitudes, so one scale per tensor is a biased code and a step's error is large.
    xs = [torch.randn(n, generator=g) * torch.randn(n, generator=g).exp() for _ in range(world)]

    errors, in_total, out_total, worker, server = _simulate(xs, EF_STEPS, True, noise, seed + 1)
    single = errors[0]
    assert single > 0.05, "the compression should be lossy for these inputs"

    # Telescoping: what all steps delivered is what went in, less what the buffers still hold.
    held = torch.stack(worker).double().mean(0)[:n] + torch.cat(server).double()[:n]
    torch.testing.assert_close(out_total, in_total - held, rtol=0, atol=1e-3 * (1 + in_total.abs().max().item()))

    # So the running mean's error shrinks like 1/T: tiny at the end, and falling from T/4 to T.
    final = errors[-1]
    assert final < 0.05 * single, (final, single)
    quarter = max(errors[EF_STEPS // 4 - 25:EF_STEPS // 4 + 25])
    last = max(errors[-50:])
    assert last < 0.5 * quarter, (last, quarter)

    # Without error feedback (buffers zeroed every step) the bias stays: the running mean is no
    # better than one step.
    no_feedback, *_ = _simulate(xs, EF_STEPS // 4, False, noise, seed + 1)
    assert no_feedback[-1] > 0.5 * single, (no_feedback[-1], single)
    assert no_feedback[-1] > 10 * final, (no_feedback[-1], final)


def test_without_error_feedback_noise_free_every_step_is_the_same():
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(29, generator=g) * torch.randn(29, generator=g).exp() for _ in range(3)]
    errors, *_ = _simulate(xs, 20, False, 0.0, 0)
    assert max(errors) - min(errors) < 1e-5 * errors[0]  # a fixed bias that averaging never removes
    assert errors[0] > 0.05


# ------------------------------------------------------------------------------------------------
# 5. CompressedAllReduce at one rank == reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (8,), (37,), (4, 9), (3, 5, 7), (1000,)])
def test_compressed_all_reduce_world_one_matches_reference_bitwise(shape):
    assert not (dist.is_available() and dist.is_initialized())
    reduce = CompressedAllReduce()
    assert reduce.world == 1 and reduce.rank == 0
    n = math.prod(shape)
    worker, server = reduce.new_errors(n, torch.device("cpu"))
    padded = padded_size(n, 1)
    assert worker.shape == (padded,) and server.shape == (padded // 1,)
    assert worker.dtype == server.dtype == torch.float32
    ref_worker, ref_server = torch.zeros(padded), torch.zeros(padded // 1)

    g = torch.Generator().manual_seed(n)
    for call in range(6):
        x = torch.randn(shape, generator=g) * torch.randn(shape, generator=g).exp()
        if call == 3:
            x.view(-1)[::2] = 0.0
        x_before = x.clone()
        out = reduce(x, worker, server)
        want = reference.compressed_average([x.clone()], [ref_worker], [ref_server])
        assert torch.equal(x, x_before), "the input must not be modified"
        assert out.shape == x.shape and out.dtype == torch.float32
        assert torch.equal(out, want), f"call {call}"
        assert torch.equal(worker, ref_worker), f"worker error after call {call}"
        assert torch.equal(server, ref_server), f"server error after call {call}"
    assert worker.abs().sum() > 0  # the errors really were carried, not all zero


# ------------------------------------------------------------------------------------------------
# 6. Optimizer phases at one rank
# ------------------------------------------------------------------------------------------------

def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(13, generator=g)), torch.nn.Parameter(torch.randn(4, 5, generator=g))]


def _set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) + 0.1 * p.detach()


@pytest.mark.parametrize("freeze_step", [0, 1, 2, 5, 7])
def test_onebit_adam_phases(freeze_step):
    params = _params()
    opt = OnebitAdam(params, lr=0.01, freeze_step=freeze_step)
    first_compressed = max(freeze_step, 2) + 1  # the first call that runs compressed
    seen = []
    for call in range(1, 13):
        assert opt.steps_taken == call - 1
        seen.append(opt.phase)
        assert opt.communicates_gradients() == (opt.phase == "compressed")
        _set_grads(params, call)
        opt.step()
    assert seen == ["warm-up"] * (first_compressed - 1) + ["compressed"] * (12 - first_compressed + 1)


def test_onebit_adam_freeze_step_five_explicit_and_variance_frozen():
    params = _params()
    opt = OnebitAdam(params, lr=0.01, freeze_step=5)
    phases, variances = [], []
    for call in range(1, 10):
        phases.append(opt.phase)
        _set_grads(params, call)
        opt.step()
        variances.append([opt.state[p]["exp_avg_sq"].clone() for p in params])
    assert phases == ["warm-up"] * 5 + ["compressed"] * 4
    # Calls 2..5 update the variance; from call 6 on it is frozen.
    for call in range(2, 6):
        assert not torch.equal(variances[call - 1][0], variances[call - 2][0]), f"call {call}"
    for call in range(6, 10):
        for now, before in zip(variances[call - 1], variances[call - 2]):
            assert torch.equal(now, before), f"variance changed at compressed call {call}"


@pytest.mark.parametrize("cls, kwargs", [(OnebitAdam, dict(freeze_step=1)),
                                         (ZeroOneAdam, dict(var_freeze_step=1))], ids=["onebit", "zero_one"])
def test_first_step_is_initialization_only(cls, kwargs):
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = cls(params, lr=0.1, weight_decay=0.1, **kwargs)
    _set_grads(params, 1)
    opt.step()
    assert opt.steps_taken == 1
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
    _set_grads(params, 2)
    opt.step()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before)), "the second step must move"


def test_zero_one_adam_var_interval_schedule():
    params = _params()
    opt = ZeroOneAdam(params, lr=0.01, var_freeze_step=20, var_update_scaler=2)
    # Call 1 initialises; the variance refreshes (exact average, no compression) with var_interval
    # 1, 1, 2, 2, 4, 4, 8, ... : at steps 2, 3, 4, 6, 8, 12, 16, (24, 32, 48 were it not frozen).
    exact_calls = {1, 2, 3, 4, 6, 8, 12, 16}
    communicates, frozen = [], []
    for call in range(1, 61):
        communicates.append(opt.communicates_gradients())
        frozen.append(opt.frozen)
        assert opt.phase == ("compressed" if communicates[-1] else "warm-up")
        _set_grads(params, call)
        opt.step()
    assert communicates == [call not in exact_calls for call in range(1, 61)]
    # Frozen once more than var_freeze_step steps are done: from call 22 on, always compressed,
    # including 24, 32 and 48 where phase 1 would have refreshed the variance.
    assert frozen == [call >= 22 for call in range(1, 61)]
    assert all(communicates[21:])


def test_zero_one_adam_var_update_scaler_three():
    params = _params()
    opt = ZeroOneAdam(params, lr=0.01, var_freeze_step=100, var_update_scaler=3)
    exact_calls = {1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32}  # var_interval 1,1,1,2,2,2,4,4,4,8,8
    got = []
    for call in range(1, 33):
        got.append(opt.communicates_gradients())
        _set_grads(params, call)
        opt.step()
    assert got == [call not in exact_calls for call in range(1, 33)]


@pytest.mark.parametrize("cls", [OnebitAdam, ZeroOneAdam], ids=["onebit", "zero_one"])
def test_rejects_amsgrad_and_exp_avg_mask(cls):
    with pytest.raises(ValueError, match="AMSGrad"):
        cls(_params(), amsgrad=True)
    p = _params()
    with pytest.raises(ValueError, match="exp_avg_mask"):
        cls([{"params": p[:1]}, {"params": p[1:], "exp_avg_mask": torch.ones(4, 5)}])
    cls(_params(), amsgrad=False)  # the default is accepted


def _grad_fn(step, rank, params):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return [torch.randn(p.shape, generator=g) + 0.1 * p for p in params]


@pytest.mark.parametrize("cls, ref, kwargs", [
    (OnebitAdam, reference.onebit_adam, dict(freeze_step=4)),
    (ZeroOneAdam, reference.zero_one_adam,
     dict(var_freeze_step=9, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)),
], ids=["onebit", "zero_one"])
def test_optimizer_matches_reference_at_world_one(cls, ref, kwargs):
    init = [torch.randn(13, generator=torch.Generator().manual_seed(3)),
            torch.randn(4, 5, generator=torch.Generator().manual_seed(4))]
    steps = 30
    history = ref(init, _grad_fn, steps, 1, lr=0.01, weight_decay=0.01, **kwargs)
    params = [torch.nn.Parameter(p.clone()) for p in init]
    opt = cls(params, lr=0.01, weight_decay=0.01, **kwargs)
    for step in range(1, steps + 1):
        for p, g in zip(params, _grad_fn(step, 0, [p.detach() for p in params])):
            p.grad = g
        opt.step()
        for p, want in zip(params, history[step - 1]):
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7, msg=f"step {step}")


# ------------------------------------------------------------------------------------------------
# 7. Device propagation under a fake CUDA device
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    """A FakeTensorMode that can make CUDA tensors, and a fresh bit-weight cache (bits caches one
    tensor per device globally, so a fake tensor cached here must not leak into other tests, nor a
    real one cached elsewhere into this one)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr(bits, "_WEIGHTS", {})
    mode = FakeTensorMode()
    try:
        with mode:
            probe = torch.empty(100, device="cuda")
        assert isinstance(probe, FakeTensor) and probe.device.type == "cuda"
    except Exception as exc:  # noqa: BLE001 - any failure here is the environment, not raydeep
        _skip_or_fail(f"FakeTensorMode cannot create CUDA tensors in this torch build "
                      f"({torch.__version__}): {exc!r}")
    return mode


@pytest.mark.parametrize("n", [1, 7, 8, 100, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_pack_signs_and_signs_stay_on_fake_cuda(fake_cuda, n, dtype):
    with fake_cuda:
        x = torch.empty(n, device="cuda", dtype=dtype)
        packed = pack_signs(x)
        s = signs(x)
        x2d = torch.empty(3, n, device="cuda", dtype=dtype)
        packed2d = pack_signs(x2d)
    assert packed.device.type == "cuda" and packed.dtype == torch.uint8 and packed.shape == (packed_nbytes(n),)
    assert s.device.type == "cuda" and s.dtype == dtype and s.shape == (n,)
    assert packed2d.device.type == "cuda" and packed2d.shape == (packed_nbytes(3 * n),)
    assert all(t.device.type == "cuda" for t in bits._WEIGHTS.values())


@pytest.mark.parametrize("n", [1, 7, 8, 100, 4097])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES, ids=str)
def test_unpack_signs_stays_on_fake_cuda(fake_cuda, n, out_dtype):
    with fake_cuda:
        packed = torch.empty(packed_nbytes(n), device="cuda", dtype=torch.uint8)
        out = unpack_signs(packed, n, dtype=out_dtype)
        round_trip = unpack_signs(pack_signs(torch.empty(n, device="cuda")), n)
    assert out.device.type == "cuda" and out.dtype == out_dtype and out.shape == (n,)
    assert round_trip.device.type == "cuda" and round_trip.dtype == torch.float32 and round_trip.shape == (n,)


@pytest.mark.parametrize("cls, options", [(OnebitAdam, {"freeze_step": 3}), (ZeroOneAdam, {"var_freeze_step": 100,
                                                                                            "var_update_scaler": 1})])
def test_elements_with_a_zero_variance_are_reported_once_at_the_first_compressed_step(cls, options, caplog):
    """An element that never had a gradient keeps a variance of exactly 0, which the 1-bit
    average cannot respect: said once, with the count."""
    p = torch.nn.Parameter(torch.ones(8))
    opt = cls([p], lr=0.1, **options)
    with caplog.at_level("WARNING", logger="raydeep"):
        for _ in range(6):
            p.grad = torch.tensor([1.0, -1.0, 0.5, 0.25, 0.0, 0.0, 0.0, 2.0])  # three elements never move
            opt.step()
    warned = [r.getMessage() for r in caplog.records if "variance of exactly 0" in r.getMessage()]
    assert len(warned) == 1 and "3 of 8 elements" in warned[0], warned
