"""1-bit LAMB in one process: its phases, DeepSpeed's coefficient rules, the per-parameter layers
inside a flat master, and the optimizer against the N-worker reference at world size 1 (the
compressed average of one worker is the worker's own tensor: the multi-rank comparison is
``tests/dist/test_compression.py``)."""
from __future__ import annotations

import pytest
import torch

from raydeep.compression import OnebitLamb, reference


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (13, 20)]


def _grad_fn(step, rank, params):
    g = torch.Generator().manual_seed(step * 100 + rank)
    return [torch.randn(p.shape, generator=g) + 0.1 * p for p in params]


def _run(opt, params, steps, record=None):
    history = []
    for step in range(1, steps + 1):
        for p, g in zip(params, _grad_fn(step, 0, [p.detach() for p in params])):
            p.grad = g
        if record is not None:
            record(opt)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


@pytest.mark.parametrize("freeze_step", [0, 1, 2, 5])
def test_phases_switch_after_the_step_that_reaches_freeze_step(freeze_step):
    params = _params()
    opt = OnebitLamb(params, lr=0.01, freeze_step=freeze_step)
    seen = []
    _run(opt, params, 10, record=lambda o: seen.append(o.phase))
    first = max(freeze_step, 2) + 1
    assert seen == ["warm-up"] * (first - 1) + ["compressed"] * (10 - first + 1)


def test_first_step_only_initialises():
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = OnebitLamb(params, lr=0.1, weight_decay=0.1, freeze_step=3)
    _run(opt, params, 1)
    assert opt.steps_taken == 1 and all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert not any(opt.state[p]["exp_avg"].any() for p in params)


def test_variance_freezes_and_the_fresh_variance_takes_over():
    params = _params()
    opt = OnebitLamb(params, lr=0.01, freeze_step=4)
    states = []
    _run(opt, params, 4)
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    assert all(torch.equal(opt.state[p]["exp_avg_sq_fresh"], f) for p, f in zip(params, frozen))  # copied at 4
    _run(opt, params, 3, record=lambda o: states.append([o.state[p]["exp_avg_sq_fresh"].clone() for p in params]))
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], f) for p, f in zip(params, frozen))
    assert not torch.equal(opt.state[params[0]]["exp_avg_sq_fresh"], states[-1][0])  # still tracking
    assert all(0 < layer["scaling_coeff"] for layer in opt.layers.values())


def test_warmup_trust_ratio_is_clamped_and_averaged_into_the_frozen_coefficient():
    params = _params()
    opt = OnebitLamb(params, lr=0.01, freeze_step=100, max_coeff=0.5, min_coeff=0.2, coeff_beta=0.5)
    _run(opt, params, 4)
    coeffs = opt.get_lamb_coeffs()
    assert len(coeffs) == 2 and all(0.2 <= c <= 0.5 for c in coeffs)
    # Three warm-up steps with coeff_beta 0.5 from 0: at least (1 - 0.5^3) of the smallest coefficient.
    assert all(layer["lamb_coeff_freeze"] >= 0.875 * 0.2 for layer in opt.layers.values())


def test_factor_moves_at_most_factor_threshold_per_step():
    params = _params()
    opt = OnebitLamb(params, lr=0.05, freeze_step=3, factor_threshold=0.05)
    factors = []
    _run(opt, params, 12, record=lambda o: factors.append({k: v["last_factor"] for k, v in o.layers.items()}))
    for before, after in zip(factors, factors[1:]):
        for name in after:
            assert after[name] <= before.get(name, 1.0) * 1.05 + 1e-12
            assert after[name] >= before.get(name, 1.0) * 0.95 - 1e-12


CASES = [dict(freeze_step=4), dict(freeze_step=6, weight_decay=0.01, max_coeff=2.0, factor_threshold=0.2),
         dict(freeze_step=3, factor_max=1.02, factor_min=0.99, factor_threshold=1.0)]


@pytest.mark.parametrize("kwargs", CASES, ids=["plain", "decay", "factor-clamps"])
def test_matches_reference_at_world_one(kwargs):
    init = [p.detach().clone() for p in _params()]
    history = reference.onebit_lamb(init, _grad_fn, 20, 1, lr=0.01, **kwargs)
    params = [torch.nn.Parameter(p.clone()) for p in init]
    got = _run(OnebitLamb(params, lr=0.01, **kwargs), params, 20)
    for step, (mine, theirs) in enumerate(zip(got, history), start=1):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


def test_layers_inside_one_flat_master_match_separate_tensors():
    """The tier's buckets: two parameters in one flat tensor, named by ``set_layers``, train as
    the two tensors do on their own (each its own trust ratio and scaling coefficient)."""
    init = [p.detach().clone() for p in _params()]
    separate = [torch.nn.Parameter(p.clone()) for p in init]
    want = _run(OnebitLamb(separate, lr=0.01, freeze_step=4, weight_decay=0.01), separate, 12)
    flat = torch.nn.Parameter(torch.cat(init))
    opt = OnebitLamb([flat], lr=0.01, freeze_step=4, weight_decay=0.01)
    opt.set_layers({flat: [("param0", 0, 13), ("param1", 13, 33)]})

    def grads(step, rank, params):
        return [torch.cat(_grad_fn(step, rank, list(params[0].split([13, 20]))))]
    got = []
    for step in range(1, 13):
        flat.grad = grads(step, 0, [flat.detach()])[0]
        opt.step()
        got.append(flat.detach().clone())
    for step, (mine, theirs) in enumerate(zip(got, want), start=1):
        torch.testing.assert_close(mine, torch.cat(theirs), rtol=0, atol=1e-6, msg=f"step {step}")
    with_layers = reference.onebit_lamb([torch.cat(init)], grads, 12, 1, lr=0.01, freeze_step=4, weight_decay=0.01,
                                        layers=[[("param0", 0, 13), ("param1", 13, 33)]])
    assert torch.equal(with_layers[-1][0], got[-1])


def test_rejects_amsgrad():
    with pytest.raises(ValueError, match="AMSGrad"):
        OnebitLamb(_params(), amsgrad=True)
