"""LR schedulers: hand-computed DeepSpeed 0.19.8 sequences, state, validation, and
(when DeepSpeed is installed) step-by-step parity with DeepSpeed's own classes."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from raydeep.optim.schedulers import (
    SCHEDULER_NAMES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    required_params,
)


def _opt(lr: float = 0.1, groups: int = 1, cls: type = torch.optim.SGD) -> torch.optim.Optimizer:
    param_groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (g + 1)} for g in range(groups)]
    return cls(param_groups, lr=lr)


def _lrs(opt: torch.optim.Optimizer, sched, steps: int, group: int = 0) -> list[float]:
    """LR each optimizer step runs at: the constructor's, then one per scheduler step."""
    out = [float(opt.param_groups[group]["lr"])]
    for _ in range(steps):
        sched.step()
        out.append(float(opt.param_groups[group]["lr"]))
    return out


LOG10 = {2: 0.30102999566398120, 3: 0.47712125471966244, 4: 0.6020599913279624, 5: 0.6989700043360189}


# ---------------------------------------------------------------- WarmupLR


def test_warmup_linear_first_two_steps_at_min():
    opt = _opt(lr=0.1)
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")  # max defaults to the group lr
    assert _lrs(opt, sched, 6) == pytest.approx([0.0, 0.0, 0.025, 0.05, 0.075, 0.1, 0.1])


def test_warmup_log():
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=10)
    expected = [0.01, 0.01] + [0.01 + 0.1 * LOG10[k] for k in (2, 3, 4, 5)]
    assert _lrs(opt, sched, 5) == pytest.approx(expected, rel=1e-12)


def test_warmup_num_steps_one_means_two_and_holds_max():
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert sched.warmup_num_steps == 2
    assert _lrs(opt, sched, 5) == pytest.approx([0.0, 0.0, 0.5, 1.0, 1.0, 1.0])


def test_warmup_get_last_lr_right_after_construction_and_message(caplog):
    opt = _opt(lr=0.3)
    with caplog.at_level(logging.DEBUG, logger="raydeep"):
        sched = WarmupLR(opt, warmup_min_lr=0.05, warmup_num_steps=3)
    assert "Attempting to get learning rate from scheduler before it has started" in caplog.text
    assert sched.get_last_lr() == [0.05]
    assert opt.param_groups[0]["lr"] == 0.05


def test_warmup_max_none_is_each_groups_lr_and_lists():
    opt = _opt(lr=0.1, groups=2)  # group lrs 0.1 and 0.2
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    assert sched.max_lrs == [0.1, 0.2]
    for _ in range(3):
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.1, 0.2])

    opt = _opt(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 1.0], warmup_max_lr=(1.0, 3.0), warmup_num_steps=2,
                     warmup_type="linear")
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5, 2.0])


def test_warmup_list_length_mismatch():
    with pytest.raises(ValueError, match=r"^expected 2 value for min_lr, got 3$"):
        WarmupLR(_opt(groups=2), warmup_min_lr=[0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"^expected 1 value for max_lr, got 2$"):
        WarmupLR(_opt(), warmup_max_lr=[0.1, 0.2])


@pytest.mark.parametrize("cls,extra", [(WarmupLR, {}), (WarmupDecayLR, {"total_num_steps": 10}),
                                       (WarmupCosineLR, {"total_num_steps": 10})])
@pytest.mark.parametrize("bad", [0, -3, 2.0, "10", None])
def test_warmup_num_steps_must_be_positive_int(cls, extra, bad):
    with pytest.raises(ValueError, match=rf"^warmup_num_steps must be a positive integer, got {bad}$"):
        cls(_opt(), warmup_num_steps=bad, **extra)


def test_unknown_warmup_type_warns_and_uses_log(caplog):
    opt = _opt()
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.11, warmup_num_steps=10, warmup_type="cubic")
    assert "Using unknown warmup_type: cubic" in caplog.text
    assert sched.warmup_type == "log"
    assert _lrs(opt, sched, 2)[-1] == pytest.approx(0.01 + 0.1 * LOG10[2])


def test_tensor_lr_is_filled_in_place():
    opt = _opt()
    opt.param_groups[0]["lr"] = torch.tensor(0.4)
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    for _ in range(2):
        sched.step()
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.2)


# ---------------------------------------------------------------- WarmupDecayLR


def test_warmup_decay_to_zero():
    opt = _opt()
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    lrs = _lrs(opt, sched, 12)
    # t = -1, 0, 1, 2, 3 warm up; from t = 4 gamma = (10 - t) / 6, clamped at 0 past t = 10.
    expected = [0.0, 0.0, 0.25, 0.5, 0.75] + [(10 - t) / 6 for t in range(4, 11)] + [0.0]
    assert lrs == pytest.approx(expected)


def test_warmup_decay_default_max_is_0_001_and_warns(caplog):
    opt = _opt(lr=0.5)
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        sched = WarmupDecayLR(opt, total_num_steps=3, warmup_num_steps=5, warmup_type="linear")
    assert sched.max_lrs == [0.001]
    assert "total_num_steps 3 is less than warmup_num_steps 5" in caplog.text


# ---------------------------------------------------------------- WarmupCosineLR


def test_warmup_cosine_sequence_and_hold():
    opt = _opt(lr=1.0)
    sched = WarmupCosineLR(opt, total_num_steps=6, warmup_min_ratio=0.1, warmup_num_steps=2, cos_min_ratio=0.2,
                           warmup_type="linear")
    c = 0.5 * (1 + math.cos(math.pi / 4))  # 0.853553...
    expected = [
        0.0,  # constructor: LR 0
        0.1,  # t=0: warmup_min_ratio * org_lr
        0.55,  # t=1: 0.1 + 0.9 * 1/2
        0.2 + 0.8 * c,  # t=2: p = 1/4
        0.6,  # t=3: p = 1/2
        0.2 + 0.8 * (1 - c),  # t=4: p = 3/4
        0.2, 0.2, 0.2,  # t >= T - 1: held at cos_min_ratio
    ]
    assert _lrs(opt, sched, 8) == pytest.approx(expected)
    sched.step(500)
    assert sched.get_last_lr() == pytest.approx([0.2])


def test_warmup_cosine_total_not_above_warmup_holds_floor():
    opt = _opt(lr=2.0)
    sched = WarmupCosineLR(opt, total_num_steps=2, warmup_num_steps=4, cos_min_ratio=0.25, warmup_type="linear")
    lrs = _lrs(opt, sched, 8)
    assert lrs[5:] == pytest.approx([0.5, 0.5, 0.5, 0.5])  # t >= 4: org_lr * cos_min_ratio


def test_warmup_cosine_scales_each_group_and_log():
    opt = _opt(lr=1.0, groups=2)
    sched = WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10)
    sched.step()
    sched.step()
    assert sched.get_last_lr() == pytest.approx([LOG10[2], 2 * LOG10[2]])


# ---------------------------------------------------------------- OneCycle


def test_one_cycle_lr_and_momentum():
    opt = _opt(cls=torch.optim.Adam)
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99)
    with pytest.raises(AssertionError, match="need to call step"):
        sched.get_last_lr()
    lrs, moms = [opt.param_groups[0]["lr"]], []
    for _ in range(10):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1])
    assert [m[0] for m in moms] == pytest.approx([0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9, 0.9])
    assert all(m[1] == 0.99 for m in moms)


def test_one_cycle_post_cycle_decay():
    opt = _opt(cls=torch.optim.AdamW)
    sched = OneCycle(opt, 0.1, 0.5, decay_lr_rate=0.5, cycle_first_step_size=4, decay_step_size=2,
                     decay_mom_rate=0.1)
    sched.step(8)  # first post-cycle iteration: interval (8 - 8 + 1) / 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 1.25)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9 * 1.05)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 1.5)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.99, 0.99))


def test_one_cycle_stairs():
    opt = _opt()
    sched = OneCycle(opt, 0.1, 0.5, cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False)
    assert _lrs(opt, sched, 8) == pytest.approx([0.1, 0.1, 0.3, 0.3, 0.5, 0.3, 0.3, 0.1, 0.1])


def test_one_cycle_asymmetric_halves():
    opt = _opt()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=2, cycle_second_step_size=4, cycle_momentum=False)
    assert _lrs(opt, sched, 6) == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_one_cycle_without_betas_warns_and_disables_momentum(caplog):
    opt = _opt()  # SGD has no betas
    with caplog.at_level(logging.WARNING, logger="raydeep"):
        sched = OneCycle(opt, 0.1, 0.5, cycle_first_step_size=4)
    assert "cycle_momentum is disabled because optimizer SGD does not support momentum" in caplog.text
    assert sched.cycle_momentum is False and sched.get_mom() is None
    sched.step()
    assert "betas" not in opt.param_groups[0]


def test_one_cycle_validation():
    with pytest.raises(ValueError, match=r"^cycle_first_step_size must be positive, got 0.0$"):
        OneCycle(_opt(), 0.1, 0.5, cycle_first_step_size=0)
    with pytest.raises(ValueError, match=r"^cycle_second_step_size must be non-negative, got -1.0$"):
        OneCycle(_opt(), 0.1, 0.5, cycle_second_step_size=-1)
    opt = _opt(groups=2)
    with pytest.raises(ValueError, match=r"^expected 2 value for cycle_max_lr, got 3$"):
        OneCycle(opt, [0.1, 0.1], [0.5, 0.5, 0.5])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]  # untouched by the failed construction


# ---------------------------------------------------------------- LRRangeTest


def test_lr_range_test_continuous_and_staircase():
    opt = _opt()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.1, lr_range_test_step_size=2)
    assert sched.get_last_lr() == [0.1]
    assert _lrs(opt, sched, 4) == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3])
    opt = _opt()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.1, lr_range_test_step_size=2, lr_range_test_step_rate=2.0,
                        lr_range_test_staircase=True)
    assert _lrs(opt, sched, 5) == pytest.approx([0.1, 0.1, 0.3, 0.3, 0.5, 0.5])


def test_lr_range_test_validation_and_lists():
    with pytest.raises(ValueError, match=r"^lr_range_test_step_size must be a positive integer, got 0$"):
        LRRangeTest(_opt(), lr_range_test_step_size=0)
    with pytest.raises(ValueError, match=r"^lr_range_test_step_size must be a positive integer, got 2.5$"):
        LRRangeTest(_opt(), lr_range_test_step_size=2.5)
    with pytest.raises(ValueError, match=r"^expected 2 lr_range_test_min_lr, got 1$"):
        LRRangeTest(_opt(groups=2), lr_range_test_min_lr=[0.1])
    sched = LRRangeTest(_opt(groups=2), lr_range_test_min_lr=[0.1, 1.0], lr_range_test_step_size=1)
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.2, 2.0])


# ---------------------------------------------------------------- state and construction


def _make(name: str, opt: torch.optim.Optimizer, **kw):
    params = {
        "WarmupLR": {"warmup_num_steps": 5},
        "WarmupDecayLR": {"total_num_steps": 12, "warmup_num_steps": 3},
        "WarmupCosineLR": {"total_num_steps": 12, "warmup_num_steps": 3},
        "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3, "decay_step_size": 2,
                     "decay_lr_rate": 0.2},
        "LRRangeTest": {"lr_range_test_step_size": 3},
    }[name]
    return build_scheduler(name, {**params, **kw}, opt)


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_state_dict_round_trip(name):
    opt_a = _opt(cls=torch.optim.Adam)
    a = _make(name, opt_a)
    for _ in range(7):
        a.step()
    sd = a.state_dict()
    assert sd == {"last_batch_iteration": 6}
    opt_b = _opt(cls=torch.optim.Adam)
    b = _make(name, opt_b, last_batch_iteration=0)  # resuming: nothing written at construction
    b.load_state_dict(sd)
    for _ in range(8):
        a.step()
        b.step()
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
        assert opt_a.param_groups[0]["betas"] == opt_b.param_groups[0]["betas"]


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_resume_construction_writes_nothing(name):
    opt = _opt(lr=0.123)
    sched = _make(name, opt, last_batch_iteration=4)
    assert opt.param_groups[0]["lr"] == 0.123
    with pytest.raises(AssertionError, match="need to call step"):
        sched.get_last_lr()
    sched.step()
    assert sched.last_batch_iteration == 5


def test_explicit_step_iteration():
    opt = _opt()
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.step(7)
    assert sched.last_batch_iteration == 7 and sched.get_last_lr() == pytest.approx([0.7])
    LRRangeTest(opt, lr_range_test_step_size=1).step(batch_iteration=3)  # DeepSpeed's keyword name
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 5)


def test_build_scheduler_names_and_torch_fallback():
    assert set(SCHEDULER_NAMES) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    for name in SCHEDULER_NAMES:
        assert type(_make(name, _opt(cls=torch.optim.Adam))).__name__ == name
    sched = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, _opt(lr=1.0))
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)


def test_build_scheduler_errors():
    with pytest.raises(ValueError, match=r"'warmuplr'.*Did you mean 'WarmupLR'\?.*WarmupCosineLR.*StepLR"):
        build_scheduler("warmuplr", {}, _opt())
    with pytest.raises(ValueError, match=r"'Nope'.*WarmupLR, WarmupDecayLR"):
        build_scheduler("Nope", {}, _opt())
    with pytest.raises(TypeError, match="params"):
        build_scheduler("WarmupLR", None, _opt())
    with pytest.raises(TypeError):
        build_scheduler("WarmupLR", {"warmup_steps": 3}, _opt())  # misspelt key
    with pytest.raises(TypeError):
        build_scheduler("WarmupDecayLR", {}, _opt())  # total_num_steps missing
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        build_scheduler("WarmupLR", {}, object())


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = _opt()
    WarmupLR(Wrapper(opt), warmup_min_lr=0.02)
    assert opt.param_groups[0]["lr"] == 0.02


def test_required_params():
    assert required_params("WarmupLR") == []
    assert required_params("LRRangeTest") == []
    assert required_params("WarmupDecayLR") == ["total_num_steps"]
    assert required_params("WarmupCosineLR") == ["total_num_steps"]
    assert required_params("OneCycle") == ["cycle_min_lr", "cycle_max_lr"]
    assert required_params("StepLR") == ["step_size"]
    with pytest.raises(ValueError, match="Unrecognized LR scheduler"):
        required_params("onecycle")


# ---------------------------------------------------------------- parity with DeepSpeed


@pytest.fixture
def ds_lr():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.runtime.lr_schedules", exc_type=ImportError)


PARITY_CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}, 1),
    ("WarmupLR", {"warmup_num_steps": 7, "warmup_type": "linear"}, 2),
    ("WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_max_lr": [0.1, 0.2], "warmup_num_steps": 1}, 2),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_max_lr": 0.02, "warmup_num_steps": 10}, 1),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 8, "warmup_type": "linear"}, 2),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_num_steps": 20}, 1),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 10, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05}, 2),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_type": "linear"}, 1),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10, "cos_min_ratio": 0.3}, 1),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 10}, 1),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 7, "cycle_second_step_size": 3,
                  "decay_lr_rate": 0.3, "decay_step_size": 4, "decay_mom_rate": 0.01}, 2),
    ("OneCycle", {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": [0.1, 0.3], "cycle_first_step_size": 10,
                  "cycle_second_step_size": 5, "cycle_first_stair_count": 3, "cycle_second_stair_count": 2,
                  "cycle_min_mom": [0.7, 0.75], "cycle_max_mom": 0.95}, 2),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 4, "cycle_momentum": False}, 1),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3}, 1),
    ("LRRangeTest", {"lr_range_test_min_lr": [0.001, 0.01], "lr_range_test_step_size": 4,
                     "lr_range_test_step_rate": 0.5, "lr_range_test_staircase": True}, 2),
]


@pytest.mark.peers
@pytest.mark.parametrize("name,params,groups", PARITY_CASES)
@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
def test_parity_with_deepspeed(ds_lr, name, params, groups, opt_cls):
    opt_ours, opt_ds = _opt(groups=groups, cls=opt_cls), _opt(groups=groups, cls=opt_cls)
    ours = build_scheduler(name, dict(params), opt_ours)
    theirs = getattr(ds_lr, name)(opt_ds, **dict(params))

    def snapshot(opt):
        return [(g["lr"], g.get("betas")) for g in opt.param_groups]

    assert snapshot(opt_ours) == snapshot(opt_ds)
    for _ in range(50):
        ours.step()
        theirs.step()
        assert snapshot(opt_ours) == snapshot(opt_ds)  # exact equality, lr and betas
        assert ours.get_last_lr() == theirs.get_last_lr()
        assert ours.state_dict() == theirs.state_dict()


@pytest.mark.peers
@pytest.mark.parametrize("name,params", [
    ("WarmupLR", {"warmup_num_steps": 0}),
    ("WarmupLR", {"warmup_min_lr": [0.0, 0.1]}),
    ("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": -1}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 1.5}),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_first_step_size": 0}),
    ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2, "cycle_second_step_size": -2}),
    ("OneCycle", {"cycle_min_lr": [0.1, 0.1], "cycle_max_lr": 0.2}),
    ("LRRangeTest", {"lr_range_test_step_size": 0}),
    ("LRRangeTest", {"lr_range_test_min_lr": [0.1, 0.1]}),
])
def test_validation_messages_match_deepspeed(ds_lr, name, params):
    with pytest.raises(ValueError) as ours:
        build_scheduler(name, dict(params), _opt(cls=torch.optim.Adam))
    with pytest.raises(ValueError) as theirs:
        getattr(ds_lr, name)(_opt(cls=torch.optim.Adam), **dict(params))
    assert str(ours.value) == str(theirs.value)
