"""1-bit Adam and 0/1 Adam as torch optimizers, with DeepSpeed's parameters and update rules.

They differ from a torch optimizer in one way: on some steps their ``step()`` communicates. The
optimizer tier (``raydeep.tier.compressed``) asks ``communicates_gradients()`` before each
backward; when it is True the stage-0 strategy leaves the gradients un-reduced (each rank's own)
and the optimizer averages what it needs itself, compressed. It never touches the engine.

Each runs on the fp32 masters of the optimizer tier: one tensor per chunk (a flat bucket of a
parameter group), so a compressed tensor and its RMS scale span a bucket, as they span a whole
flattened group in DeepSpeed's fp16 wrapper. Both follow DeepSpeed's code, quirks included:

- the first ``step()`` is an initialization pass: ``step`` becomes 1, nothing else changes (DeepSpeed
  also ran a compressed all-reduce of zeros there, to warm its cupy buffers: it changes nothing);
- the update has no bias correction (``bias_correction`` is accepted and has no effect), and
  weight decay is added to the update: ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``;
- one world size: DeepSpeed does not compress with one rank, and neither does this.

The error-feedback buffers are per rank and shaped unlike the masters (padded for the world
size), so they are not optimizer state of the usual kind: ``rank_state()`` hands them to the
checkpoint, which stores them in the rank's own file.
"""
from __future__ import annotations

import contextlib

import torch

from raydeep.compression.allreduce import CompressedAllReduce


class _CompressedOptimizer(torch.optim.Optimizer):
    """What 1-bit Adam and 0/1 Adam share: defaults, the error buffers, the phase query."""

    def __init__(self, params, defaults: dict, communicator: CompressedAllReduce | None):
        if defaults.pop("amsgrad", False):
            raise ValueError(f"{type(self).__name__} does not support the AMSGrad variant")
        super().__init__(params, defaults)
        for group in self.param_groups:
            if "exp_avg_mask" in group:
                raise ValueError("exp_avg_mask: raydeep compresses flat buckets of a parameter group, so a "
                                 "per-parameter momentum mask does not apply; remove it from the param group")
        self.comm = communicator or CompressedAllReduce()
        # Per parameter: worker and server error (and 0/1 Adam's momentum accumulator), rank-local.
        self.rank_local: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}

        self._latched: int | None = None

    @property
    def steps_taken(self) -> int:
        """``step`` of the first parameter (all advance together), 0 before the first step;
        inside ``one_phase`` the count when it was entered."""
        if self._latched is not None:
            return self._latched
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    return int(self.state[p]["step"])
        return 0

    @contextlib.contextmanager
    def one_phase(self):
        """Run several ``step()`` calls (one per sub-group of parameters) as one optimizer step:
        each sees the phase the step began in."""
        self._latched = self.steps_taken
        try:
            yield
        finally:
            self._latched = None

    def communicates_gradients(self) -> bool:
        """Whether the next ``step()`` takes each rank's own gradient and averages it itself."""
        raise NotImplementedError

    @property
    def phase(self) -> str:
        """``warm-up`` (exact, uncompressed) or ``compressed``, for the next step."""
        return "compressed" if self.communicates_gradients() else "warm-up"

    def _errors(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        local = self.rank_local.setdefault(p, {})
        if "worker_error" not in local:
            local["worker_error"], local["server_error"] = self.comm.new_errors(p.numel(), p.device)
        return local

    def _compressed_average(self, p: torch.nn.Parameter, x: torch.Tensor) -> torch.Tensor:
        if self.comm.world == 1:
            return x
        errors = self._errors(p)
        return self.comm(x, errors["worker_error"], errors["server_error"])

    @staticmethod
    def _apply(p, group, exp_avg, exp_avg_sq) -> torch.Tensor:
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p.data
        p.data.add_(-group["lr"] * update)
        return update

    def _params_with_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    yield group, p, state


class OnebitAdam(_CompressedOptimizer):
    """DeepSpeed's 1-bit Adam: exact Adam until ``freeze_step``, then frozen variance and the
    momentum averaged with the compressed all-reduce.

    >>> p = torch.nn.Parameter(torch.ones(4))
    >>> opt = OnebitAdam([p], lr=0.1, freeze_step=2)
    >>> for _ in range(3):
    ...     p.grad = torch.ones(4); opt.step()
    >>> opt.steps_taken, opt.phase, round(p[0].item(), 4)  # the first step only initialises
    (3, 'compressed', 0.0829)
    """

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", communicator: CompressedAllReduce | None = None):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, amsgrad=amsgrad)
        super().__init__(params, defaults, communicator)
        self.freeze_step = freeze_step

    def communicates_gradients(self) -> bool:
        # DeepSpeed switches after a non-initial step whose count reached freeze_step.
        steps = self.steps_taken
        return steps >= 2 and steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        initialized, compressed = self.steps_taken > 0, self.communicates_gradients()
        for group, p, state in self._params_with_grad():
            state["step"] += 1
            if not initialized:
                continue
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            beta1, beta2 = group["betas"]
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if compressed:  # v frozen; the local momentum averaged, compressed
                exp_avg.copy_(self._compressed_average(p, exp_avg))
            else:  # the gradient is already the average over the ranks
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            self._apply(p, group, exp_avg, exp_avg_sq)
        return loss


class ZeroOneAdam(_CompressedOptimizer):
    """DeepSpeed's 0/1 Adam: the variance is refreshed from the exact average on an exponentially
    sparser schedule (every ``var_interval`` steps, doubling after ``var_update_scaler`` refreshes)
    and the gradient is averaged compressed in between; after ``var_freeze_step`` the variance is
    frozen and ranks take local steps, synchronising the accumulated update compressed every
    ``local_step_interval`` steps (doubling every ``local_step_scaler`` steps, at most
    ``local_step_clipper``).

    >>> p = torch.nn.Parameter(torch.ones(4))
    >>> opt = ZeroOneAdam([p], lr=0.1, var_freeze_step=3)
    >>> for _ in range(5):
    ...     p.grad = torch.ones(4); opt.step()
    >>> opt.steps_taken, opt.phase
    (5, 'compressed')
    """

    _COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter", "lrs")

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 communicator: CompressedAllReduce | None = None):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, amsgrad=amsgrad)
        super().__init__(params, defaults, communicator)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper

    def _first_state(self) -> dict:
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    return self.state[p]
        return {}

    @property
    def frozen(self) -> bool:
        """Phase 2: the variance is frozen and ranks take local steps."""
        return self.steps_taken > self.var_freeze_step and self.steps_taken >= 2

    def communicates_gradients(self) -> bool:
        state = self._first_state()
        if not state or state["step"] == 0:
            return False  # the initialization pass takes the reduced gradient (and ignores it)
        if self.frozen:
            return True
        # Phase 1: the exact average only on the steps that refresh the variance.
        return (state["step"] + 1) % state.get("var_interval", 1) != 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        initialized, frozen = self.steps_taken > 0, self.frozen
        if frozen and self.steps_taken == max(self.var_freeze_step + 1, 2):
            self._zero_errors()  # entering phase 2: the errors now measure accumulated updates
        for group, p, state in self._params_with_grad():
            if initialized and "var_interval" not in state:  # DeepSpeed restarts its counters here
                state.update(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)
            state["step"] += 1
            if not initialized:
                continue
            self._update(group, p, state, frozen)
        return loss

    def _update(self, group, p, state, frozen: bool) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        local = self.rank_local.setdefault(p, {})
        accumulator = local.setdefault("momentum_accumulator", torch.zeros_like(p))
        if not frozen:
            if state["step"] % state["var_interval"] == 0:  # the gradient is the exact average
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            else:
                exp_avg.mul_(beta1).add_(self._compressed_average(p, p.grad), alpha=1 - beta1)
        else:
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["lrs"] += group["lr"]
        update = self._apply(p, group, exp_avg, exp_avg_sq)
        if frozen:
            accumulator.add_(-group["lr"] * update)
            if state["step"] % state["local_step_interval"] == 0:  # synchronise the local steps
                p.data.add_(-1 * accumulator)
                accumulator.mul_(exp_avg_sq.sqrt() + group["eps"])
                accumulator.copy_(self._compressed_average(p, accumulator))
                exp_avg.zero_().add_(accumulator / state["lrs"], alpha=-1)
                p.data.add_(accumulator / (exp_avg_sq.sqrt() + group["eps"]))
                accumulator.zero_()
                state["lrs"] = 0.0
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
        else:
            if state["step"] % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2

    def _zero_errors(self) -> None:
        for local in self.rank_local.values():
            for key in ("worker_error", "server_error"):
                if key in local:
                    local[key].zero_()
