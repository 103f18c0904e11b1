"""Every ZeRO stage against a float64 single-process reference with the same global batch.

Stages 0-3 x world sizes 1, 2, 4 x GAS 1 and 4 x clipping on/off, fp32 AdamW, ``STEPS`` optimizer
steps on the tiny GPT. The clipping threshold is the median of the reference's gradient norms,
so about half of the steps are clipped: both branches run, and a wrong clipping coefficient
changes the relative size of the steps, which Adam would otherwise normalise away.

Why not ``max |dtheta| <= 1e-5`` against an fp32 reference: two fp32 runs differ by rounding, by
an amount that depends on the summation order (stages 2-3 reduce at every micro-step, stages 0-1
once per step), and Adam's ``u = m_hat / (sqrt(v_hat) + eps)`` turns the rounding noise of an
element whose gradient nearly vanishes into a step of up to ``lr`` (the attention key bias has a
true gradient of exactly zero). A fixed bound is too tight for some CPU or too loose to see a
bug; so every element gets its own bound, in units of the rounding of its own gradient.

The bound. The oracle is the same training in float64. Adam's update is a smooth function of the
gradients; to first order in their differences ``dg``,

    |du_t| <= C_t * max_{s<=t} |dg_s| / (sqrt(v_hat_t) + eps),  C_t = 1 + U_t * sum_{s<=t} sqrt(b_s)

where ``b_s = (1 - beta2) beta2^(t-s) / (1 - beta2^t)`` are v_hat's weights and ``U_t >= |u_t|``
is Adam's step bound (``adam_step_bound``; 1 at the first step). AdamW moves an element by
``lr * u_t`` per step (weight decay only shrinks a difference) and rounds the fp32 parameter
itself twice per step (the decay's multiply and the update's add, each by at most
``2^-24 |theta|``). So, per element,

    |theta_fp32 - theta_fp64| <= sum_t [ lr * min(2 U_t, C_t * dg_t / (sqrt(v_hat_t) + eps))
                                         + 2 * 2^-24 * (|theta_t| + 2 lr) ]

with ``sqrt(v_hat_t)`` and ``theta_t`` from the float64 run. ``dg_t``, the rounding of the
gradients, is measured, not guessed: a *rounding probe* (the same single-process training in
fp32, the gradient accumulated micro-batch by micro-batch) runs beside the oracle, and the
largest gradient difference in each parameter tensor up to step t, times ``ORDER_FACTOR``
(another valid summation order may round worse), is that tensor's ``dg_t``. The probe's
differences include the feedback of parameter differences into later gradients, and they are
measured on the CPU running the test. An element with a healthy gradient gets a bound of a few
1e-6 (the median is printed); one whose gradient nearly vanishes is held only to Adam's step
bound, ``2 lr U_t`` per step, where the first-order estimate would exceed it. Losses per step
and the last step's gradient norm (which sees a wrong 1/N even where clipping and Adam's
normalisation hide it from the weights) are held to ``ORDER_FACTOR`` times the probe's largest
difference from the oracle (losses plus two fp32 ulps).
"""
import math

import pytest
import torch

from tests.dist.adam_bounds import (FP32_UNIT, ORDER_FACTOR, PARAM_ROUNDINGS, adam_step_bound,
                                    sensitivity)
from tests.dist.harness import run_ranks
from tests.dist.workloads import sweep, train_reference

STEPS, MICRO, LR = 6, 2, 1e-3  # LR: workloads.config's AdamW
STAGES, GAS = (0, 1, 2, 3), (1, 4)


def element_bounds(oracle: dict, probe: dict) -> tuple[dict[str, torch.Tensor], int]:
    """Per-element bound on ``|theta_fp32 - theta_fp64|`` (see the module docstring), and how
    many elements are held only to Adam's step bound at some step."""
    bounds, capped = {}, 0
    for name, final in oracle["params"].items():
        bound, dg, hit_cap = torch.zeros_like(final), 0.0, torch.zeros_like(final, dtype=torch.bool)
        for t in range(1, STEPS + 1):
            dg = max(dg, (probe["grads"][t - 1][name] - oracle["grads"][t - 1][name]).abs().max().item())
            first_order = sensitivity(t) * ORDER_FACTOR * dg / oracle["denoms"][t - 1][name]
            hit_cap |= first_order > 2 * adam_step_bound(t)
            bound += LR * first_order.clamp(max=2 * adam_step_bound(t))
            bound += PARAM_ROUNDINGS * FP32_UNIT * (oracle["trajectory"][t - 1][name].abs() + 2 * LR)
        bounds[name], capped = bound, capped + int(hit_cap.sum())
    return bounds, capped


def references(world: int, gas: int) -> dict:
    """The clipping threshold, and for clipping off and on: the float64 oracle, the fp32
    rounding probe and the per-element bounds."""
    global_batch = MICRO * gas * world
    unclipped = train_reference(STEPS, global_batch, 0.0, torch.float64, trace=True)
    norms = sorted(unclipped["norms"])
    clip = round((norms[(STEPS - 1) // 2] + norms[STEPS // 2]) / 2, 6)  # the median
    out = {"clip": clip}
    for c in (clip, 0.0):
        oracle = unclipped if c == 0 else train_reference(STEPS, global_batch, c, torch.float64, trace=True)
        probe = train_reference(STEPS, global_batch, c, micro=MICRO, trace=True)
        bounds, capped = element_bounds(oracle, probe)
        out[c] = {"oracle": oracle, "probe": probe, "bounds": bounds, "capped": capped}
    return out


def check(ranks: list[dict], ref: dict) -> tuple[dict, list[str]]:
    """One run (every rank's parameters, the losses, the last gradient norm) against its bounds:
    the largest fraction of each bound used, and what exceeded its bound."""
    oracle, probe, bounds = ref["oracle"], ref["probe"], ref["bounds"]
    worst, over = (0.0, ""), 0
    for rank, result in enumerate(ranks):
        for name, theta in result["params"].items():
            diff = (theta.double() - oracle["params"][name]).abs().flatten()
            excess = diff / bounds[name].flatten()
            i = int(excess.argmax())
            over += int((excess > 1).sum())
            if excess[i] > worst[0]:
                worst = (excess[i].item(), f"rank {rank} {name}[{i}] |dtheta| {diff[i]:.3g} > its bound "
                         f"{bounds[name].flatten()[i]:.3g} (largest |dtheta| in the tensor {diff.max():.3g})")
    errors = [f"{worst[1]}; {over} elements (all ranks) over their bounds"] if over else []
    ulps = 2 * max(math.ulp(torch.tensor(x, dtype=torch.float32).item()) for x in oracle["losses"])
    loss_bound = ORDER_FACTOR * max(abs(a - b) for a, b in zip(probe["losses"], oracle["losses"])) + ulps
    loss_diff = max(abs(a - b) for a, b in zip(ranks[0]["losses"], oracle["losses"]))
    if loss_diff > loss_bound:
        errors.append(f"losses differ by up to {loss_diff:.3g} > {loss_bound:.3g}")
    norm_bound = ORDER_FACTOR * max(abs(a - b) for a, b in zip(probe["norms"], oracle["norms"]))
    norm_diff = abs(ranks[0]["grad_norm"] - oracle["norms"][-1])
    if norm_diff > norm_bound:
        errors.append(f"last gradient norm {ranks[0]['grad_norm']:.6g}, float64 reference "
                      f"{oracle['norms'][-1]:.6g} (bound {norm_bound:.3g})")
    return {"params": worst[0], "loss": loss_diff / loss_bound, "norm": norm_diff / norm_bound}, errors


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_stages_match_single_process_reference(world_size):
    refs = {gas: references(world_size, gas) for gas in GAS}
    combos = [(stage, gas, clip) for stage in STAGES for gas in GAS for clip in (refs[gas]["clip"], 0.0)]
    results = run_ranks(sweep, world_size, combos, STEPS, MICRO)
    used, failures = [], []
    for stage, gas, clip in combos:
        fractions, errors = check([r[(stage, gas, clip)] for r in results], refs[gas][clip])
        used.append(fractions)
        failures += [f"stage {stage} gas {gas} clip {clip:g}: {e}" for e in errors]
    assert not failures, f"{len(failures)} bounds exceeded at world size {world_size}:\n" + "\n".join(failures)
    median = torch.cat([b.flatten() for b in refs[1][0.0]["bounds"].values()]).median().item()
    capped = max(refs[gas][clip]["capped"] for gas in GAS for clip in (refs[gas]["clip"], 0.0))
    print(f"\nworld {world_size}, {len(used)} runs; largest fraction of a bound used: parameters "
          f"{max(u['params'] for u in used):.2f}, losses {max(u['loss'] for u in used):.2f}, gradient norm "
          f"{max(u['norm'] for u in used):.2f}; median element bound {median:.1e}; "
          f"at most {capped} elements held only to Adam's step bound")
