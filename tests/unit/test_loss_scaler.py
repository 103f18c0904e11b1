"""Loss scalers: hand-computed DeepSpeed 0.19.8 sequences, state, construction from the
fp16 section, the local overflow check, and (when DeepSpeed is installed) step-by-step
parity with DeepSpeed's own scalers."""

from __future__ import annotations

import json
import logging
import os
import random
from types import SimpleNamespace

import pytest
import torch

from raydeep.precision.loss_scaler import (
    MIN_SCALE_ERROR,
    DynamicLossScaler,
    NonZeroDynamicLossScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)

O, C = True, False  # overflow / clean step


def _zero(init=1024, window=1000, min_scale=1, hysteresis=1, consecutive=False, **kw) -> DynamicLossScaler:
    return DynamicLossScaler(init, window, min_scale, hysteresis, consecutive, **kw)


def _run(scaler, flags) -> list[float]:
    out = []
    for flag in flags:
        scaler.update_scale(flag)
        out.append(scaler.cur_scale)
    return out


# ---------------------------------------------------------------- ZeRO rule


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_first_doubling_is_the_w_plus_first_clean_step(window):
    s = _zero(init=8, window=window)
    scales = _run(s, [C] * (2 * window + 1))
    # Fresh start: doubles when cur_iter == W (the (W+1)-th update), then every W.
    assert scales[:window] == [8.0] * window
    assert scales[window] == 16.0
    assert scales[2 * window] == 32.0


def test_window_2_sequence():
    assert _run(_zero(init=8, window=2), [C] * 5) == [8, 8, 16, 16, 32]


def test_window_3_after_overflow():
    s = _zero(init=64, window=3)
    # overflow at iter 1 -> 32; clean steps need stable = iter - 1 - 1 to hit 3, i.e. iter 5.
    assert _run(s, [C, O, C, C, C, C, C, C, C]) == [64, 32, 32, 32, 32, 64, 64, 64, 128]
    assert s.last_overflow_iter == 1 and s.cur_iter == 9


def test_hysteresis_2_non_consecutive():
    s = _zero(init=1024, window=3, hysteresis=2)
    flags = [O, C, O, O, C, C, C, C, O, O]
    expected = [  # (scale, hysteresis) after each update
        (1024, 1),  # hysteresis 2 -> 1, scale kept
        (1024, 1),  # clean, not consecutive: hysteresis stays 1
        (512, 1),  # halved
        (256, 1),  # halved again: no clean window in between to refill hysteresis
        (256, 1), (256, 1), (256, 1),
        (512, 2),  # 4th clean step (stable = 3): doubled and hysteresis refilled
        (512, 1),  # hysteresis absorbs the overflow
        (256, 1),
    ]
    got = []
    for flag in flags:
        s.update_scale(flag)
        got.append((s.cur_scale, s.cur_hysteresis))
    assert got == expected


def test_consecutive_hysteresis_refills_on_every_clean_step():
    on = _zero(init=64, window=100, hysteresis=2, consecutive=True)
    off = _zero(init=64, window=100, hysteresis=2, consecutive=False)
    flags = [O, C, O, C, O, O, C]
    assert _run(on, flags) == [64, 64, 64, 64, 64, 32, 32]
    assert on.cur_hysteresis == 2
    assert _run(off, flags) == [64, 64, 32, 32, 16, 8, 8]
    assert off.cur_hysteresis == 1


def test_down_to_min_then_exception():
    s = _zero(init=4, min_scale=1)
    assert _run(s, [O, O]) == [2, 1]
    with pytest.raises(Exception) as err:
        s.update_scale(True)
    assert str(err.value) == MIN_SCALE_ERROR
    assert MIN_SCALE_ERROR == "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
    assert s.cur_iter == 2  # the failing update did not count


def test_floor_at_non_power_of_two_min_then_exception():
    s = _zero(init=3, min_scale=2)
    assert _run(s, [O]) == [2]
    with pytest.raises(Exception, match="already at minimum"):
        s.update_scale(True)


def test_hysteresis_is_consumed_before_raising_at_min():
    s = _zero(init=1, min_scale=1, hysteresis=2)
    s.update_scale(True)  # only consumes hysteresis
    assert (s.cur_scale, s.cur_hysteresis) == (1, 1)
    with pytest.raises(Exception, match="already at minimum"):
        s.update_scale(True)


def test_no_raise_at_min_when_disabled():
    s = _zero(init=2, min_scale=1, raise_error_at_min_scale=False)
    assert _run(s, [O, O, O]) == [1, 1, 1]
    assert s.last_overflow_iter == 2


def test_no_upper_cap():
    s = _zero(init=2**16, window=1)
    _run(s, [C] * 200)
    assert s.cur_scale == 2.0 ** (16 + 199)


def test_logs_on_rank0_only(caplog):
    s = _zero(init=2**16, hysteresis=2, consecutive=True)
    with caplog.at_level(logging.INFO, logger="raydeep"):
        _run(s, [O, C, O, O])
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. "
        "Reducing hysteresis to 1",
        "Consecutive hysteresis is enabled. Restoring hysteresis to 2",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2. "
        "Reducing hysteresis to 1",
        "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
    ]
    caplog.clear()
    quiet = _zero(init=2**16, hysteresis=2, rank=3)
    with caplog.at_level(logging.INFO, logger="raydeep"):
        _run(quiet, [O, O])
    assert caplog.records == []


def test_state_round_trip_through_json():
    rng = random.Random(0)
    flags = [rng.random() < 0.2 for _ in range(120)]
    a = _zero(init=2**16, window=4, hysteresis=3, consecutive=False)
    _run(a, flags[:60])
    sd = json.loads(json.dumps(a.state_dict()))
    assert sd["cur_iter"] == 60 and sd["type"] == "dynamic"
    b = _zero(init=1, window=999, hysteresis=1, consecutive=True)
    b.load_state_dict(sd)
    assert b.state_dict() == a.state_dict()
    assert _run(a, flags[60:]) == _run(b, flags[60:])
    assert a.loss_scale == b.loss_scale == b.cur_scale


# ---------------------------------------------------------------- non-ZeRO rule, static


def test_non_zero_rule():
    s = NonZeroDynamicLossScaler(8, scale_window=2, min_scale=1)
    # no hysteresis: every overflow halves; doubling on the (W+1)-th clean step
    assert _run(s, [C, C, C, O, C, C, C, O, O, O, O]) == [8, 8, 16, 8, 8, 8, 16, 8, 4, 2, 1]
    assert _run(s, [O, O]) == [1, 1]  # never raises at the minimum
    assert s.cur_iter == 13 and s.last_overflow_iter == 12


def test_non_zero_logs_and_state(caplog):
    s = NonZeroDynamicLossScaler(4, scale_window=1, min_scale=1)
    with caplog.at_level(logging.INFO, logger="raydeep"):
        _run(s, [O, C, C])
    assert [r.getMessage() for r in caplog.records] == [
        "Grad overflow on iteration 0",
        "Reducing dynamic loss scale from 4.0 to 2.0",
        "No Grad overflow for 1 iterations",
        "Increasing dynamic loss scale from 2.0 to 4.0",
    ]
    t = NonZeroDynamicLossScaler(1, scale_window=5, min_scale=0.5)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.state_dict() == s.state_dict()


def test_static(caplog):
    s = StaticLossScaler(128)
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        s.update_scale(True)
        s.update_scale(False)
    assert s.loss_scale == 128.0 and s.dynamic is False
    assert "OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated." in caplog.text
    t = StaticLossScaler()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.loss_scale == 128.0


# ---------------------------------------------------------------- build_loss_scaler


@pytest.mark.parametrize("fp16", [None, {}, {"enabled": False}, {"enabled": False, "loss_scale": 128}])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_build_disabled_is_static_one(fp16, stage):
    s = build_loss_scaler(fp16, stage)
    assert isinstance(s, StaticLossScaler) and s.loss_scale == 1.0


@pytest.mark.parametrize("stage", [0, 2])
def test_build_static(stage):
    s = build_loss_scaler({"enabled": True, "loss_scale": 512}, stage)
    assert isinstance(s, StaticLossScaler) and s.loss_scale == 512.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_build_zero_defaults(stage):
    s = build_loss_scaler({"enabled": True}, stage)
    assert isinstance(s, DynamicLossScaler)
    assert (s.cur_scale, s.scale_window, s.min_scale, s.delayed_shift, s.cur_hysteresis, s.consecutive_hysteresis) \
        == (65536.0, 1000, 1, 2, 2, False)
    assert s.raise_error_at_min_scale is True


def test_build_stage0_and_explicit_keys():
    s = build_loss_scaler({"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50, "min_loss_scale": 4,
                           "hysteresis": 5}, 0)
    assert isinstance(s, NonZeroDynamicLossScaler)
    assert (s.cur_scale, s.scale_window, s.min_scale) == (256.0, 50, 4)
    z = build_loss_scaler({"enabled": True, "loss_scale": 0, "initial_scale_power": 0, "loss_scale_window": 7,
                           "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 1}, 3)
    assert (z.cur_scale, z.scale_window, z.delayed_shift, z.consecutive_hysteresis) == (1.0, 7, 3, True)


def test_build_auto_means_default():
    s = build_loss_scaler({"enabled": True, "loss_scale": "auto", "initial_scale_power": "auto",
                           "loss_scale_window": "auto", "hysteresis": "auto", "min_loss_scale": "auto"}, 2)
    assert (s.cur_scale, s.scale_window, s.delayed_shift, s.min_scale) == (65536.0, 1000, 2, 1)


@pytest.mark.parametrize("key", ["loss_scale_window", "min_loss_scale"])
def test_build_rejects_non_positive_dynamic_params(key):
    with pytest.raises(ValueError, match=rf"^fp16.{key} must be > 0 when dynamic loss scaling is enabled"):
        build_loss_scaler({"enabled": True, key: 0}, 1)
    build_loss_scaler({"enabled": True, "loss_scale": 8, key: 0}, 1)  # unused by a static scale: accepted


# ---------------------------------------------------------------- has_overflow


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_has_overflow(dtype):
    ok = torch.ones(4, dtype=dtype)
    assert has_overflow([ok, None, torch.empty(0, dtype=dtype)]) is False
    for bad in (float("inf"), float("-inf"), float("nan")):
        assert has_overflow([ok, torch.tensor([1.0, bad], dtype=dtype)]) is True
        assert has_overflow(torch.tensor([[bad]], dtype=dtype)) is True
    assert has_overflow([]) is False


def test_has_overflow_fp16_overflowed_value_and_sparse():
    assert has_overflow([torch.tensor([70000.0]).half()]) is True  # beyond fp16 max -> inf
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, float("nan")], (5,), check_invariants=True)
    assert has_overflow([sparse]) is True
    assert has_overflow([torch.sparse_coo_tensor([[1]], [2.0], (5,), check_invariants=True)]) is False


# ---------------------------------------------------------------- parity with DeepSpeed


@pytest.fixture
def ds_scaler(monkeypatch):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    mod = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler", exc_type=ImportError)
    # DeepSpeed's scaler asks its comm layer for the rank; there is no process group here.
    monkeypatch.setattr(mod.dist, "get_rank", lambda *a, **k: 0)
    return mod


def _drive(scaler, flags):
    """Per-step (scale, iter, last_overflow, hysteresis) until the end or an exception."""
    trace = []
    for flag in flags:
        try:
            scaler.update_scale(flag)
        except Exception as err:  # noqa: BLE001 - DeepSpeed raises a bare Exception
            trace.append(("raised", type(err).__name__, str(err)))
            break
        trace.append((scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter,
                      getattr(scaler, "cur_hysteresis", None)))
    return trace


COMBOS = [(w, h, c) for w in (1, 2, 3, 7) for h in (1, 2, 3) for c in (False, True)]


@pytest.mark.peers
@pytest.mark.parametrize("window,hysteresis,consecutive", COMBOS)
@pytest.mark.parametrize("p_overflow", [0.05, 0.3, 0.6])
@pytest.mark.parametrize("raise_at_min", [True, False])
def test_zero_scaler_parity_with_deepspeed(ds_scaler, window, hysteresis, consecutive, p_overflow, raise_at_min):
    rng = random.Random(f"{window}-{hysteresis}-{consecutive}-{p_overflow}")
    flags = [rng.random() < p_overflow for _ in range(300)]
    args = dict(init_scale=2**10, scale_window=window, min_scale=1, delayed_shift=hysteresis,
                consecutive_hysteresis=consecutive, raise_error_at_min_scale=raise_at_min)
    ours, theirs = _drive(DynamicLossScaler(**args), flags), _drive(ds_scaler.DynamicLossScaler(**args), flags)
    assert ours == theirs


@pytest.mark.peers
def test_zero_scaler_parity_hits_the_minimum(ds_scaler):
    flags = [True] * 40
    args = dict(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    ours = _drive(DynamicLossScaler(**args), flags)
    theirs = _drive(ds_scaler.DynamicLossScaler(**args), flags)
    assert ours == theirs
    assert ours[-1] == ("raised", "Exception", MIN_SCALE_ERROR)


@pytest.mark.peers
@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("p_overflow", [0.1, 0.5])
@pytest.mark.parametrize("wrapper", ["fused", "unfused"])
def test_non_zero_scaler_parity_with_deepspeed(ds_scaler, window, p_overflow, wrapper):
    if wrapper == "fused":
        from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer as Wrapper
    else:
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer as Wrapper
    args = dict(init_scale=2**8, scale_window=window, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    cfg = ds_scaler.LossScaleConfig(torch.float16, True, 1.0, args)
    # Drive the wrappers' own update rule on a stand-in `self` holding just its state.
    fake = SimpleNamespace(loss_scale_config=cfg, verbose=False)
    ours = NonZeroDynamicLossScaler(args["init_scale"], window, args["min_scale"])
    rng = random.Random(window * 31 + int(p_overflow * 10))
    for _ in range(300):
        flag = rng.random() < p_overflow
        Wrapper._update_scale(fake, flag)
        ours.update_scale(flag)
        assert (ours.cur_scale, ours.cur_iter, ours.last_overflow_iter) == \
            (cfg.cur_scale, cfg.cur_iter, cfg.last_overflow_iter)
