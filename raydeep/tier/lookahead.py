"""The delayed update's lookahead: the next forward reads the parameters the running update makes.

Under ZeRO-Offload's delayed parameter update (``raydeep.delayed_update``) step t's update runs on
the CPU while step t+1's forward and backward run, so step t+1's gradients are taken at parameters
one update older than those they are applied to. For Adam that costs more than one step: on a
direction of curvature h (in Adam's preconditioned units) momentum 0.9 keeps the update stable up
to a step of 38/h, and one step of delay cuts that to 1/h whatever the momentum. A run tuned
without delay then trains at the edge of a much smaller region: a 300-step GPT run at lr 1e-3
stalled on its unigram plateau for 200 steps and ended 18% above the same run without delay.

The lookahead moves the parameters, not the update. Adam's next step is, per element,

    x' = x (1 - lr wd) - lr / bc1 * (b1 m + (1 - b1) g) / (sqrt(v' / bc2') + eps)      (AdamW)

and everything in it but the new gradient ``g`` is known once update t has run. So the CPU, after
update t (masters ``x``, moments ``m`` and ``v``, ``k`` steps), also writes two model-dtype terms

    r    = 1 / (sqrt(v / (1 - b2^k)) + eps)
    base = x (1 - lr wd) - lr b1 / bc1 * m * r           bc1 = 1 - b1^(k+1)
    rate = lr (1 - b1) / bc1 * r

(for Adam, whose weight decay joins the gradient, ``base = x - lr / bc1 * (b1 m + (1 - b1) wd x) * r``),
and after step t+1's backward the rank lands them and sets its parameters to ``base - rate * g``
with its own new gradient shard (times the one scale) before publishing them. That is update t+1's
result except that ``v`` has not seen ``g`` yet (``v / (1 - b2^k)`` is its unbiased estimate
either way) and the learning rate is update t's. Step t+2's forward then reads, to that precision,
the parameters its gradients are applied to, as without the delay, while update t+1 -- the exact
Adam step from the exact masters, as without the lookahead -- runs on the CPU. Only where the
gradients are taken moves; the masters never see the prediction, and whenever the pending update
is landed for its own sake (a save, a load, an overflowed step, the end) the parameters are the
masters again.

On the CPU the fused update (``csrc/fused_adam.cpp``) writes both terms in its own pass, from the
registers it just updated (about 1.45x the update's time; ``write_terms`` is the torch path with
the same bits, used without the extension, on a device, and for other kernels). The rank lands
them with one ``addcmul``. It costs one model-dtype buffer of the owned shard on an accelerator
(``rate``; none on a CPU rank) and twice the bytes back from the CPU per step (``base`` and
``rate`` instead of the parameters). It predicts Adam and AdamW only (torch's, and what
DeepSpeed's Adam/AdamW/CPUAdam build): ``why_not`` says so for any other optimizer.
"""
from __future__ import annotations

import math

import torch

_TILE = 1 << 16  # elements computed at once by the torch path


def why_not(optimizer: torch.optim.Optimizer) -> str | None:
    """None when ``optimizer``'s next step can be predicted (torch's Adam or AdamW, plain float
    hyperparameters), otherwise why not."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"it predicts Adam's and AdamW's next step, and the optimizer is {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
            return "it needs plain float hyperparameters (this optimizer has tensor lr or betas)"
    return None


def constants(group: dict, steps: float, decoupled: bool) -> tuple[float, ...]:
    """The terms' constants ``(bc2, eps, rate, a, b, b1)`` after an update of ``steps`` steps
    with ``group``'s hyperparameters (see ``write_terms``), computed in double as Python does."""
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    bc1 = 1 - beta1 ** (steps + 1)  # the next step's
    sign = -1.0 if group.get("maximize", False) else 1.0  # the moments hold the negated gradients then
    rate = sign * lr * (1 - beta1) / bc1
    if decoupled:
        return math.sqrt(1 - beta2 ** steps), eps, rate, 1 - lr * wd, lr * beta1 / bc1, beta1
    return math.sqrt(1 - beta2 ** steps), eps, rate, (1 - beta1) * wd, lr / bc1, beta1


def write_terms(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, base: torch.Tensor, rate: torch.Tensor,
                terms: tuple[float, ...], decoupled: bool) -> None:
    """``base`` and ``rate`` from the updated master ``x`` and moments ``m``, ``v`` (fp32, flat),
    each operation one fp32 rounding, as the fused CPU update computes them in its pass
    (``csrc/fused_adam.cpp``: the same bits)::

        r = 1 / (sqrt(v) / bc2 + eps);  rate = r * c_rate
        AdamW: base = x * a - (r * m) * b;   Adam: base = x - (r * (m * b1 + x * a)) * b
    """
    bc2, eps, c_rate, a, b, b1 = terms
    with torch.no_grad():
        for lo in range(0, x.numel(), _TILE):  # the fp32 temporaries stay in cache
            hi = min(x.numel(), lo + _TILE)
            xs, ms = x[lo:hi], m[lo:hi]
            # sqrt through fp64: torch's fp32 sqrt is not always correctly rounded on the CPU (its
            # vector math library), fp64's is close enough that rounding it gives IEEE's fp32 sqrt.
            r = v[lo:hi].double().sqrt_().float().div_(bc2).add_(eps).reciprocal_()
            rate[lo:hi].copy_(r * c_rate)
            if decoupled:
                base[lo:hi].copy_(xs.mul(a).sub_(r.mul_(ms).mul_(b)))
            else:
                base[lo:hi].copy_(xs.sub(r.mul_(ms.mul(b1).add_(xs.mul(a))).mul_(b)))


def decoupled_decay(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether ``group``'s weight decay is AdamW's (decoupled) rather than Adam's (in the gradient)."""
    return type(optimizer) is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))


class Lookahead:
    """Writes ``base`` and ``rate`` (see the module docstring) for chunks of ``optimizer``'s
    parameters just updated, with the hyperparameters their update ran with."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        reason = why_not(optimizer)
        assert reason is None, reason
        self.optimizer = optimizer
        self._group = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def terms(self, param: torch.Tensor, base: torch.Tensor, rate: torch.Tensor) -> None:
        """``base`` and ``rate`` (model dtype, ``param``'s shape) for updated parameter ``param``."""
        group, state = self._group[id(param)], self.optimizer.state[param]
        decoupled = decoupled_decay(self.optimizer, group)
        v = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        write_terms(param.detach().reshape(-1), state["exp_avg"].reshape(-1), v.reshape(-1), base.reshape(-1),
                    rate.reshape(-1), constants(group, float(state["step"]), decoupled), decoupled)


def rate_buffers(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Where the rates go on the rank before use: a buffer beside each of ``params`` on an
    accelerator; None on a CPU, where the rank reads the held rates where they are."""
    return [torch.empty_like(p) if p.device.type != "cpu" else None for p in params]


def look_ahead(local: torch.Tensor, base: torch.Tensor, rate: torch.Tensor, on_device: torch.Tensor | None,
               grad: torch.Tensor, scale: float) -> None:
    """On the rank: ``local = base - rate * grad * scale`` in one pass, the products in fp32 and
    one rounding into the model dtype. ``base`` and ``rate`` are the held terms (host memory);
    ``on_device`` is ``rate``'s buffer beside ``local`` (``rate_buffers``). Only ``local`` and
    ``on_device`` are written."""
    with torch.no_grad():
        if on_device is None:
            torch.addcmul(base, grad, rate, value=-scale, out=local)
        else:
            local.copy_(base, non_blocking=base.is_pinned())
            local.addcmul_(grad, on_device.copy_(rate, non_blocking=rate.is_pinned()), value=-scale)
