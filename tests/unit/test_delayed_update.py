"""The delayed parameter update (``raydeep.delayed_update``, ZeRO-Offload's DPU) against a
single-process reference of the same one-step-delayed rule, bit for bit, with and without the
lookahead (``raydeep.tier.lookahead``).

The rule: after ``W`` ordinary steps, step t's update is computed from the masters and step t's
gradients as always, but the parameters the next forward reads are the masters *before* it (the
update lands one step later). An overflowed step applies the pending update and no new one; a save
lands the pending update first. With the lookahead, a pending update lands instead as
``base - rate * g`` with the landing step's gradients ``g``: Adam's next step, predicted.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import raydeep
from raydeep.errors import ConfigError
from raydeep.optim.schedulers import build_scheduler

WARMUP, STEPS, OVERFLOW_AT = 3, 9, 6
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6}}


def _config(delayed: bool = True, lookahead: bool = False, optimizer: str = "AdamW", **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": optimizer, "params": {"lr": 0.02, "weight_decay": 0.1}}, "scheduler": SCHEDULER,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, **zero},
            "raydeep": {"offload_target": "host", "delayed_update": delayed, "delayed_update_warmup_steps": WARMUP,
                        "delayed_update_lookahead": lookahead}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    return (x * float("inf") if t == OVERFLOW_AT else x), y


def _terms(opt: torch.optim.Optimizer, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookahead's ``base`` and ``rate`` after an AdamW update of ``m``, written out."""
    group, state = opt.param_groups[0], opt.state[m]
    lr, (b1, b2), eps, wd, k = group["lr"], group["betas"], group["eps"], group["weight_decay"], float(state["step"])
    bc1 = 1 - b1 ** (k + 1)
    # IEEE's fp32 sqrt (through fp64, as the fused update's vector sqrt computes it; torch's own fp32
    # sqrt on the CPU may differ from it in the last bit)
    r = state["exp_avg_sq"].double().sqrt().float().div_(math.sqrt(1 - b2 ** k)).add_(eps).reciprocal_()
    rate = r * (lr * (1 - b1) / bc1)
    return m.detach().mul(1 - lr * wd).sub_(r.mul_(state["exp_avg"]).mul_(lr * b1 / bc1)), rate


def _reference(model: nn.Module, lookahead: bool = False) -> list[list[torch.Tensor]]:
    """The parameters after each step under the one-step-delayed rule, in plain torch."""
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=0.02, weight_decay=0.1, fused=True)
    sched = build_scheduler(SCHEDULER["type"], SCHEDULER["params"], opt)
    after, terms = [], None  # terms: those of the pending update, with the lookahead
    for t in range(1, STEPS + 1):
        x, y = _batch(t)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        with torch.no_grad():
            if not all(torch.isfinite(g).all() for g in grads):  # skipped; the pending one has landed
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
                terms = None
            else:
                before = [m.detach().clone() for m in masters]
                for m, g in zip(masters, grads):
                    m.grad = g.clone()
                opt.step()
                for p, m, b, g in zip(model.parameters(), masters, before, grads):
                    if t <= WARMUP:
                        p.copy_(m)
                    elif terms is None:
                        p.copy_(b)
                    else:  # the pending update lands as its terms predict from this step's gradients
                        base, rate = terms[m]
                        p.copy_(base).addcmul_(g, rate, value=-1.0)
                terms = {m: _terms(opt, m) for m in masters} if lookahead and t > WARMUP else None
                sched.step()
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


@pytest.mark.parametrize("lookahead", [False, True], ids=["the plain one-step-delayed rule", "the lookahead"])
def test_the_delayed_update_follows_its_rule_bitwise(lookahead):
    expected = _reference(_model(), lookahead=lookahead)
    got, engine = _train(_config(lookahead=lookahead))
    assert engine.skipped_steps == 1
    for t, (a, b) in enumerate(zip(got, expected), start=1):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"after step {t}"
    engine.destroy()


def test_the_lookahead_reads_nearly_the_parameters_of_the_undelayed_run():
    """What the lookahead is for: the parameters the forward reads stay near those of the run
    without delay, where the plain rule's fall one update behind and drift."""
    undelayed, engine = _train(_config(delayed=False))
    engine.destroy()
    runs = {}
    for lookahead in (False, True):
        runs[lookahead], engine = _train(_config(lookahead=lookahead))
        engine.destroy()

    def gap(after, t):
        return math.sqrt(sum(float((p - q).square().sum()) for p, q in zip(after[t - 1], undelayed[t - 1])))

    # The steps the lookahead lands (the first delayed step after the warm-up and after the
    # overflow at step 6 lands nothing): 4.1-6.2 times nearer here, at lr 0.02 on 4 samples.
    for t in (WARMUP + 2, 8, 9):
        plain, ahead = gap(runs[False], t), gap(runs[True], t)
        assert ahead < plain / 3, (t, ahead, plain)


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "AdamW maximize"])
def test_the_lookahead_terms_are_adams_next_step(kind):
    """Where the new gradient leaves Adam's second-moment estimate unchanged (g^2 = v / (1 - b2^k)),
    ``base - rate * g`` is Adam's next step itself, to fp32 rounding."""
    from raydeep.tier.lookahead import Lookahead

    torch.manual_seed(0)
    x = nn.Parameter(torch.randn(1000))
    cls = torch.optim.Adam if kind == "Adam" else torch.optim.AdamW
    opt = cls([x], lr=1e-2, weight_decay=0.1, maximize=kind.endswith("maximize"))
    for _ in range(5):
        x.grad = torch.randn(1000)
        opt.step()
    base, rate = torch.empty(1000), torch.empty(1000)
    Lookahead(opt).terms(x, base, rate)
    state = opt.state[x]
    k = float(state["step"])
    grad = state["exp_avg_sq"].div(1 - 0.999 ** k).sqrt() * torch.sign(torch.randn(1000))
    if kind == "Adam":  # its weight decay joins the gradient before the moments see it
        grad = grad - 0.1 * x.detach()
    if kind.endswith("maximize"):
        grad = -grad
    predicted, before = base - rate * grad, x.detach().clone()
    x.grad = grad
    opt.step()
    step = (x.detach() - before).abs()
    # Each side rounds a handful of times at |x| < 5: a few ulps (4.8e-7 at 4) of x, where the
    # steps are ~1e-3 (the gradient's own term alone, (1 - b1) of it, is ~1e-4).
    assert step.mean() > 1e-3
    assert (predicted - x.detach()).abs().max() < 2e-6


def test_the_lookahead_needs_adam():
    config = {**_config(optimizer="SGD"), "zero_allow_untested_optimizer": True}
    del config["raydeep"]["delayed_update_lookahead"]  # on by default
    with pytest.raises(ConfigError, match="raydeep.delayed_update_lookahead"):
        raydeep.initialize(model=_model(), config=config)
    config["raydeep"]["delayed_update_lookahead"] = False
    engine, *_ = raydeep.initialize(model=_model(), config=config)
    engine.destroy()


def test_the_update_starts_after_the_parameters_are_published():
    """The parameters' all-gather is a chain of waits on every rank: the submitted update is held
    until it is done (``release``), so that it does not take the cores the all-gather needs."""
    engine, *_ = raydeep.initialize(model=_model(), config=_config())
    tier, publish, seen = engine.tier, engine.strategy.publish, []

    def recording_publish():
        seen.append((tier._held_back is not None, tier._pending is None))  # held, nothing running
        publish()

    engine.strategy.publish = recording_publish
    for t in range(1, STEPS + 1):
        x, y = _batch(t)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        if seen[-1] == (True, True):
            assert tier._held_back is None and tier._pending is not None  # released after publishing
    assert seen.count((True, True)) >= STEPS - WARMUP - 2  # every delayed step but an overflowed one
    engine.destroy()


def test_without_the_delay_the_parameters_differ():
    """The reference can tell: the ordinary update does not follow it."""
    expected = _reference(_model())
    got, engine = _train(_config(delayed=False))
    assert not all(torch.equal(p, q) for p, q in zip(got[WARMUP + 1], expected[WARMUP + 1]))
    engine.destroy()


def test_zenflow_overlap_step_is_the_same_switch():
    config = _config(delayed=False, lookahead=True, zenflow={"overlap_step": True, "full_warm_up_rounds": WARMUP})
    expected = _reference(_model(), lookahead=True)
    got, engine = _train(config)
    assert all(torch.equal(p, q) for a, b in zip(got, expected) for p, q in zip(a, b))
    engine.destroy()


def test_the_delayed_update_needs_an_offloaded_optimizer():
    config = _config()
    del config["zero_optimization"]["offload_optimizer"]
    with pytest.raises(ConfigError, match="raydeep.delayed_update"):
        raydeep.initialize(model=_model(), config=config)
