"""How far two fp32 AdamW trajectories that differ only in summation order may drift apart.

Adam's ``u = m_hat / (sqrt(v_hat) + eps)`` turns the rounding noise of an element whose gradient
nearly vanishes into a step of up to ``lr``, so no fixed bound fits every CPU. These helpers give
each element its own bound, in units of the rounding of its own gradient (the derivation is in
``test_parity``'s docstring): to first order,

    |du_t| <= C_t * max_{s<=t} |dg_s| / (sqrt(v_hat_t) + eps),   and always |u_t| <= U_t.
"""
from __future__ import annotations

import math

BETAS = (0.9, 0.999)  # workloads.config's AdamW
ORDER_FACTOR = 10  # how much worse than a measured probe another valid summation order may round
FP32_UNIT = 2.0 ** -24  # fp32 unit roundoff: one rounding moves a value by at most this fraction
PARAM_ROUNDINGS = 2  # of the fp32 parameter per step: weight decay's multiply, the update's add


def adam_step_bound(t: int) -> float:
    """``U_t``: the largest ``|m_hat_t| / sqrt(v_hat_t)`` over all gradient histories (Cauchy-Schwarz)."""
    b1, b2 = BETAS
    ratio = sum((b1 * b1 / b2) ** k for k in range(t))
    return math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * (1 - b1) / math.sqrt(1 - b2) * math.sqrt(ratio)


def sensitivity(t: int) -> float:
    """``C_t``: the sum over s <= t of ``|du_t / dg_s|``, times ``sqrt(v_hat_t) + eps``."""
    b2 = BETAS[1]
    sqrt_weights = sum(math.sqrt((1 - b2) * b2 ** (t - s) / (1 - b2 ** t)) for s in range(1, t + 1))
    return 1 + adam_step_bound(t) * sqrt_weights
