"""Adam and AdamW over any piece of a chunk: what lets a pipeline tile below the optimizer.

A torch optimizer updates whole parameters (here: chunks). Adam and AdamW are elementwise, so a
pipeline may update a chunk one piece at a time, the next piece's gradient in flight while one is
computed, and get the same bits, provided each piece runs the very kernel ``optimizer.step()``
runs and the step counter moves once per chunk. ``PieceAdam`` does that for torch's fused
Adam/AdamW: ``begin(chunks)`` creates the state as torch does and counts the step;
``update(chunk, lo, hi, grad, scale, out)`` updates elements ``[lo, hi)``.

On the CPU the update is one pass over memory (``raydeep.tier.cpu_update``: the gradient in the
model dtype, the scale, Adam, the fp32 master, both moments and the parameter in the model dtype);
where that extension is missing, or on a device, it is torch's own kernel after a widening copy
and a multiply (the bits are the same: the extension's tests hold it to this path).
"""
from __future__ import annotations

import torch
from torch import nn

from raydeep.tier.lookahead import constants, decoupled_decay, write_terms


def piecewise_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group of ``optimizer`` runs torch's fused Adam/AdamW with plain floats, which
    ``PieceAdam`` reproduces; any other optimizer steps whole chunks."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return all(g.get("fused") and not g.get("amsgrad") and not g.get("capturable") and not g.get("differentiable")
               and not torch.is_tensor(g["lr"]) and not any(torch.is_tensor(b) for b in g["betas"])
               for g in optimizer.param_groups)


class PieceAdam:
    """Torch's fused Adam/AdamW on pieces of ``params`` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], threads: int | None = None):
        self.optimizer = optimizer
        self.params = params
        self.threads = threads
        self._group = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._group[id(p)] = group
        self._buffer: torch.Tensor | None = None  # the widened gradient, where the extension is not used

    def begin(self, indices: list[int]) -> None:
        """The start of a step over these chunks: their state as torch creates it, step + 1."""
        for i in indices:
            p = self.params[i]
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # fused: on the device
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"].add_(1)  # torch: _foreach_add_(steps, 1)

    def update(self, i: int, lo: int, hi: int, grad: torch.Tensor, scale: float,
               out: torch.Tensor | None, terms: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Elements ``[lo, hi)`` of chunk ``i`` from ``grad`` (those elements, any float dtype, on
        the master's device) x ``scale``; the new values also go to ``out`` (model dtype) when
        given, and the delayed update's lookahead ``(base, rate)`` to ``terms`` (with ``out``).
        Returns the fp32 gradient bytes this needed beyond its inputs."""
        p, group = self.params[i], self._group[id(self.params[i])]
        state = self.optimizer.state[p]
        master = p.detach().narrow(0, lo, hi - lo)
        exp_avg, exp_avg_sq = state["exp_avg"].narrow(0, lo, hi - lo), state["exp_avg_sq"].narrow(0, lo, hi - lo)
        beta1, beta2 = group["betas"]
        decoupled = decoupled_decay(self.optimizer, group)
        from raydeep.tier import cpu_update  # here: `python -m raydeep.tier.cpu_update` imports this package

        # the step count is read (a device sync) only where the kernel or the lookahead needs it
        fused = master.device.type == "cpu" and cpu_update.available()
        step = int(state["step"].item()) if fused or terms is not None else None
        lookahead = None if terms is None else (*terms, constants(group, float(step), decoupled))
        if fused:
            cpu_update.fused_adam_step(master, exp_avg, exp_avg_sq, grad, out, scale=scale, lr=group["lr"],
                                       beta1=beta1, beta2=beta2, eps=group["eps"],
                                       weight_decay=group["weight_decay"], step=step,
                                       decoupled=decoupled, maximize=group.get("maximize", False),
                                       threads=self.threads, lookahead=lookahead)
            return 0
        wide = self._widen(grad, scale)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel([master], [wide], [exp_avg], [exp_avg_sq], [], [state["step"]], amsgrad=False, lr=group["lr"],
               beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group.get("maximize", False), grad_scale=None, found_inf=None)
        if out is not None:
            out.copy_(master)
        if lookahead is not None:
            write_terms(master, exp_avg, exp_avg_sq, *lookahead, decoupled)
        return 0 if wide is grad else wide.numel() * 4

    def _widen(self, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """``grad`` x ``scale`` in fp32, as ``MasterShards`` computes it (a widening copy, then an
        fp32 multiply in place), in one reused buffer on the CPU."""
        if grad.device.type != "cpu":
            return grad.to(torch.float32, copy=True).mul_(scale)
        if grad.dtype == torch.float32 and scale == 1.0:
            return grad
        if self._buffer is None or self._buffer.numel() < grad.numel():
            self._buffer = torch.empty(grad.numel(), dtype=torch.float32)
        wide = self._buffer[:grad.numel()].copy_(grad)
        return wide if scale == 1.0 else wide.mul_(scale)


def pieces_of(sub_group_size: int, tile: int, optimizer: torch.optim.Optimizer) -> int:
    """The elements of one call to an offload actor (``raydeep.tier.actors``). Adam and AdamW are
    elementwise, so their sub-groups are cut to the transfer ``tile``
    (``raydeep.offload_tile_size``) and give the same bits (see the module docstring): at DeepSpeed's default ``sub_group_size`` (1e9, one sub-group
    for a whole shard) the pieces still overlap their transfers with the update and spread over
    the rank's actors. Any other optimizer steps whole sub-groups, as DeepSpeed's does."""
    if not piecewise_adam(optimizer):
        return sub_group_size
    return tile if sub_group_size <= 0 else min(sub_group_size, tile)
