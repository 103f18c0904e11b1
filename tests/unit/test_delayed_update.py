"""The delayed parameter update (``raydeep.delayed_update``, ZeRO-Offload's DPU) against a
single-process reference of the same one-step-delayed rule, bit for bit.

The rule: after ``W`` ordinary steps, step t's update is computed from the masters and step t's
gradients as always, but the parameters the next forward reads are the masters *before* it (the
update lands one step later). An overflowed step applies the pending update and no new one; a save
lands the pending update first.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import raydeep
from raydeep.errors import ConfigError
from raydeep.optim.schedulers import build_scheduler

WARMUP, STEPS, OVERFLOW_AT = 3, 9, 6
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6}}


def _config(delayed: bool = True, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.1}}, "scheduler": SCHEDULER,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, **zero},
            "raydeep": {"offload_target": "host", "delayed_update": delayed, "delayed_update_warmup_steps": WARMUP}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return (x * float("inf") if t == OVERFLOW_AT else x), y


def _reference(model: nn.Module) -> list[list[torch.Tensor]]:
    """The parameters after each step under the one-step-delayed rule, in plain torch."""
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=0.02, weight_decay=0.1, fused=True)
    sched = build_scheduler(SCHEDULER["type"], SCHEDULER["params"], opt)
    after = []
    for t in range(1, STEPS + 1):
        x, y = _batch(t)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        with torch.no_grad():
            if not all(torch.isfinite(g).all() for g in grads):  # skipped; the pending one has landed
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
            else:
                before = [m.detach().clone() for m in masters]
                for m, g in zip(masters, grads):
                    m.grad = g.clone()
                opt.step()
                sched.step()
                for p, m, b in zip(model.parameters(), masters, before):
                    p.copy_(m if t <= WARMUP else b)
        model.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    with torch.no_grad():  # a save lands the pending update
        for p, m in zip(model.parameters(), masters):
            p.copy_(m)
    after.append([p.detach().clone() for p in model.parameters()])
    return after


def _train(config: dict) -> tuple[list[list[torch.Tensor]], object]:
    engine, *_ = raydeep.initialize(model=_model(), config=config)
    after = []
    for t in range(1, STEPS + 1):
        x, y = _batch(t)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        after.append([p.detach().clone() for p in engine.module.parameters()])
    engine.complete_update()
    after.append([p.detach().clone() for p in engine.module.parameters()])
    return after, engine


def test_the_delayed_update_follows_the_one_step_delayed_rule_bitwise():
    expected = _reference(_model())
    got, engine = _train(_config())
    assert engine.skipped_steps == 1
    for t, (a, b) in enumerate(zip(got, expected), start=1):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"after step {t}"
    engine.destroy()


def test_without_the_delay_the_parameters_differ():
    """The reference can tell: the ordinary update does not follow it."""
    expected = _reference(_model())
    got, engine = _train(_config(delayed=False))
    assert not all(torch.equal(p, q) for p, q in zip(got[WARMUP + 1], expected[WARMUP + 1]))
    engine.destroy()


def test_zenflow_overlap_step_is_the_same_switch():
    expected = _reference(_model())
    config = _config(delayed=False, zenflow={"overlap_step": True, "full_warm_up_rounds": WARMUP})
    got, engine = _train(config)
    assert all(torch.equal(p, q) for a, b in zip(got, expected) for p, q in zip(a, b))
    engine.destroy()


def test_the_delayed_update_needs_an_offloaded_optimizer():
    config = _config()
    del config["zero_optimization"]["offload_optimizer"]
    with pytest.raises(ConfigError, match="raydeep.delayed_update"):
        raydeep.initialize(model=_model(), config=config)
