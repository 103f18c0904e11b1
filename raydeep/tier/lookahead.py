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

It costs one model-dtype buffer of the owned shard on the device (``rate``) and twice the bytes
back from the CPU per step (``base`` and ``rate`` instead of the parameters). It predicts Adam and
AdamW only (torch's, and what DeepSpeed's Adam/AdamW/CPUAdam build): ``why_not`` says so for any
other optimizer.
"""
from __future__ import annotations

import math

import torch

# Elements computed at once: the fp32 temporaries stay in cache instead of spanning a sub-group.
_TILE = 1 << 16


def why_not(optimizer: torch.optim.Optimizer) -> str | None:
    """None when ``optimizer``'s next step can be predicted (torch's Adam or AdamW, plain float
    hyperparameters), otherwise why not."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"it predicts Adam's and AdamW's next step, and the optimizer is {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        if torch.is_tensor(group["lr"]) or any(torch.is_tensor(b) for b in group["betas"]):
            return "it needs plain float hyperparameters (this optimizer has tensor lr or betas)"
    return None


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
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        steps = float(state["step"])
        bc1, bc2_root = 1 - beta1 ** (steps + 1), math.sqrt(1 - beta2 ** steps)
        decoupled = type(self.optimizer) is torch.optim.AdamW or group.get("decoupled_weight_decay", False)
        sign = -1.0 if group.get("maximize", False) else 1.0  # the moments hold the negated gradients then
        x, m = param.detach(), state["exp_avg"]
        v = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        with torch.no_grad():
            for lo in range(0, x.numel(), _TILE):
                hi = min(x.numel(), lo + _TILE)
                r = v[lo:hi].sqrt().div_(bc2_root).add_(eps).reciprocal_()
                rate[lo:hi].copy_(r * (sign * lr * (1 - beta1) / bc1))
                if decoupled:
                    step = r.mul_(m[lo:hi]).mul_(lr * beta1 / bc1)
                    base[lo:hi].copy_(x[lo:hi].mul(1 - lr * wd).sub_(step))
                else:
                    pull = m[lo:hi].mul(beta1).add_(x[lo:hi], alpha=(1 - beta1) * wd)
                    base[lo:hi].copy_(x[lo:hi].sub(r.mul_(pull).mul_(lr / bc1)))


def look_ahead(local: torch.Tensor, rate: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    """On the rank, where ``local`` already holds ``base``: ``local -= rate * (grad * scale)``, the
    product in fp32 (``grad`` is read, never written) and one rounding into the model dtype."""
    with torch.no_grad():
        local.sub_(grad.to(torch.float32, copy=True).mul_(scale).mul_(rate))
