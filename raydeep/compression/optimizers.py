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

Every tensor a ``step()`` compresses goes out in one compressed all-reduce
(``CompressedAllReduce.average``): two collectives per call, whatever the number of chunks.

Each rank's own state (``rank_tensors``): the error-feedback buffers, per rank and shaped unlike
the masters (padded for the world size), and, for 0/1 Adam, the momentum accumulator and, while
ranks take local steps, the rank's own parameters and momentum (they differ between ranks until
the next synchronisation). The checkpoint keeps them in the rank's own file; where they cannot be
carried (another world size or layout), ``reset_rank_state`` restarts them together with what
depends on them.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from raydeep import comm

from raydeep.compression.allreduce import CompressedAllReduce

logger = logging.getLogger("raydeep")


class _CompressedOptimizer(torch.optim.Optimizer):
    """What 1-bit Adam and 0/1 Adam share: defaults, the error buffers, the phase query."""

    #: what ``reset_rank_state`` restarts, for its warning
    rank_state_description = "error feedback"

    def __init__(self, params, defaults: dict, communicator: CompressedAllReduce | None):
        if defaults.pop("amsgrad", False):
            raise ValueError(f"{type(self).__name__} does not support the AMSGrad variant")
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            if "exp_avg_mask" in group:
                raise ValueError(f"param group {i}: exp_avg_mask is not supported: raydeep compresses flat buckets "
                                 "of several parameters, so a per-parameter momentum mask does not apply; remove it "
                                 "from the param group (docs/config.md, 'Param-group keys of the compressed "
                                 "optimizers')")
        self._check_non_freeze()
        self.comm = communicator or CompressedAllReduce()
        # Per parameter: worker and server error (and 0/1 Adam's momentum accumulator), rank-local.
        self.rank_local: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}

        self._latched: int | None = None
        self._variance_checked = False

    def _check_non_freeze(self) -> None:
        for i, group in enumerate(self.param_groups):
            if group.get("non_freeze"):
                logger.warning("param group %d: non_freeze has no effect with %s (DeepSpeed reads it in 1-bit Adam "
                               "only): the group is compressed like the others", i, type(self).__name__)

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

    # --- communication ------------------------------------------------------------------------------
    def _errors(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        local = self.rank_local.setdefault(p, {})
        if "worker_error" not in local:
            local["worker_error"], local["server_error"] = self.comm.new_errors(p.numel(), p.device)
        return local

    def _compressed_average(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> list[torch.Tensor]:
        """The compressed average of each ``(parameter, tensor)``'s tensor, all in one exchange."""
        if self.comm.world == 1 or not items:
            return [x for _, x in items]
        pairs = [(e["worker_error"], e["server_error"]) for e in (self._errors(p) for p, _ in items)]
        return self.comm.average([x for _, x in items], pairs)

    def _exact_average(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` over the ranks in place, uncompressed, in one all-reduce."""
        if self.comm.world == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        comm.all_reduce(flat, self.comm.stats, group=self.comm.group, owner="non_freeze")
        flat.mul_(1.0 / self.comm.world)
        at = 0
        for t in tensors:
            t.copy_(flat.narrow(0, at, t.numel()).view_as(t))
            at += t.numel()

    # --- this rank's own state ----------------------------------------------------------------------
    def rank_tensors(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """This rank's own tensors for ``p`` (live, not copies), by name."""
        return dict(self.rank_local.get(p, {}))

    def rank_tensor_shape(self, p: torch.nn.Parameter, key: str) -> torch.Size | None:
        """The shape ``rank_tensors(p)[key]`` has in this run (None: not a name this optimizer keeps)."""
        if key in ("worker_error", "server_error"):
            return self.comm.error_shapes(p.numel())[key == "server_error"]
        return None

    def load_rank_tensors(self, p: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        """Take back ``rank_tensors(p)`` as saved (shapes already checked)."""
        self.rank_local[p] = {k: v.to(p.device, copy=True) for k, v in tensors.items()}

    def shared_rank_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own tensors that belong to no one parameter (1-bit LAMB's fused exchange)."""
        return {}

    def shared_rank_tensor_shape(self, key: str) -> torch.Size | None:
        return None

    def load_shared_rank_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back ``shared_rank_tensors()`` as saved (shapes already checked)."""

    def reset_rank_state(self) -> None:
        """Start this rank's own state again, with everything that must restart with it."""
        self.rank_local.clear()

    def _check_variance(self, work) -> None:
        """Once, at the first compressed step: say how many elements have a variance of exactly 0.
        1-bit compression cannot send a zero (every element decodes to +-scale), so such an
        element (a parameter that never had a gradient: the embedding row of a token never seen)
        moves by about lr * scale / eps per step. DeepSpeed masked them with ``exp_avg_mask``."""
        if self._variance_checked or not work:
            return
        self._variance_checked = True
        zero = sum(int((state["exp_avg_sq"] == 0).sum()) for _, _, state in work)
        if zero:
            total = sum(state["exp_avg_sq"].numel() for _, _, state in work)
            logger.warning("%s: %d of %d elements have a variance of exactly 0 at the first compressed step (never "
                           "given a gradient, e.g. embedding rows of tokens not seen yet); 1-bit compression cannot "
                           "send a zero, so each will move by about lr*scale/eps per step. Warm up longer, or (1-bit "
                           "Adam) put those parameters in a param group with non_freeze: true",
                           type(self).__name__, zero, total)

    # --- the update ---------------------------------------------------------------------------------
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
    momentum averaged with the compressed all-reduce. A parameter group with ``non_freeze: True``
    stays exact Adam throughout (its gradient all-reduced by the optimizer, uncompressed), as in
    DeepSpeed.

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

    def _check_non_freeze(self) -> None:
        pass  # honoured: see ``step``

    def communicates_gradients(self) -> bool:
        # DeepSpeed switches after a non-initial step whose count reached freeze_step.
        steps = self.steps_taken
        return steps >= 2 and steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        initialized, compressed = self.steps_taken > 0, self.communicates_gradients()
        work = []
        for group, p, state in self._params_with_grad():
            state["step"] += 1
            if initialized:
                work.append((group, p, state))
        exact = [(g, p, s) for g, p, s in work if not compressed or g.get("non_freeze")]
        if compressed:  # the non-frozen groups' own gradients, averaged exactly
            self._exact_average([p.grad for _, p, _ in exact])
        for group, p, state in exact:  # exact Adam: the gradient is the average over the ranks
            beta1, beta2 = group["betas"]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        squeezed = [(g, p, s) for g, p, s in work if compressed and not g.get("non_freeze")]
        self._check_variance(squeezed)
        for group, p, state in squeezed:  # v frozen; the local momentum, averaged compressed below
            state["exp_avg"].mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
        averaged = self._compressed_average([(p, state["exp_avg"]) for _, p, state in squeezed])
        for (_, _, state), avg in zip(squeezed, averaged):
            state["exp_avg"].copy_(avg)
        for group, p, state in work:
            self._apply(p, group, state["exp_avg"], state["exp_avg_sq"])
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
    rank_state_description = ("error feedback, local-step momentum accumulator and lrs (the parameters and "
                              "momentum continue from the checkpoint's, which every rank shares)")

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

    # --- this rank's own state: while ranks take local steps, their parameters and momentum too ----
    def rank_tensors(self, p):
        out = super().rank_tensors(p)
        if self.frozen and self.state.get(p):
            out["params"], out["exp_avg"] = p.detach(), self.state[p]["exp_avg"]
        return out

    def rank_tensor_shape(self, p, key):
        if key in ("momentum_accumulator", "params", "exp_avg"):
            return p.shape
        return super().rank_tensor_shape(p, key)

    def load_rank_tensors(self, p, tensors):
        tensors = dict(tensors)
        params, exp_avg = tensors.pop("params", None), tensors.pop("exp_avg", None)
        super().load_rank_tensors(p, tensors)
        if params is not None:
            p.data.copy_(params)
        if exp_avg is not None and self.state.get(p):
            self.state[p]["exp_avg"].copy_(exp_avg)

    def reset_rank_state(self) -> None:
        # The accumulator and lrs restart together: the next synchronisation then spans the
        # local steps since this point, from the parameters every rank now shares.
        super().reset_rank_state()
        for state in self.state.values():
            if "lrs" in state:
                state["lrs"] = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        initialized, frozen = self.steps_taken > 0, self.frozen
        entering_phase_two = frozen and self.steps_taken == max(self.var_freeze_step + 1, 2)
        work = []
        for group, p, state in self._params_with_grad():
            if initialized and "var_interval" not in state:  # DeepSpeed restarts its counters here
                state.update(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)
            state["step"] += 1
            if initialized:
                if entering_phase_two:  # the errors now measure accumulated updates: once per parameter
                    for key in ("worker_error", "server_error"):
                        if key in self.rank_local.get(p, {}):
                            self.rank_local[p][key].zero_()
                work.append((group, p, state))
        if frozen:
            self._local_steps(work)
        else:
            self._variance_steps(work)
        return loss

    def _variance_steps(self, work) -> None:
        """Phase 1: the exact average refreshes the variance on its schedule; between refreshes
        the gradient is averaged compressed."""
        refresh = [(g, p, s) for g, p, s in work if s["step"] % s["var_interval"] == 0]
        squeezed = [(g, p, s) for g, p, s in work if s["step"] % s["var_interval"] != 0]
        self._check_variance(squeezed)
        for group, p, state in refresh:  # the gradient is the exact average
            beta1, beta2 = group["betas"]
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        averaged = self._compressed_average([(p, p.grad) for _, p, _ in squeezed])
        for (group, p, state), avg in zip(squeezed, averaged):
            state["exp_avg"].mul_(group["betas"][0]).add_(avg, alpha=1 - group["betas"][0])
        for group, p, state in work:
            self._accumulator(p)
            self._apply(p, group, state["exp_avg"], state["exp_avg_sq"])
            if state["step"] % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2

    def _local_steps(self, work) -> None:
        """Phase 2: each rank steps on its own gradient and accumulates the update; every
        ``local_step_interval`` steps the ranks replace their local progress by the compressed
        average of everyone's."""
        self._check_variance(work)
        syncing = []
        for group, p, state in work:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.mul_(group["betas"][0]).add_(p.grad, alpha=1 - group["betas"][0])
            state["lrs"] += group["lr"]
            update = self._apply(p, group, exp_avg, exp_avg_sq)
            accumulator = self._accumulator(p)
            accumulator.add_(-group["lr"] * update)
            if state["step"] % state["local_step_interval"] == 0:
                p.data.add_(-1 * accumulator)  # back to the last synchronised point
                accumulator.mul_(exp_avg_sq.sqrt() + group["eps"])
                syncing.append((group, p, state))
        averaged = self._compressed_average([(p, self._accumulator(p)) for _, p, _ in syncing])
        for (group, p, state), avg in zip(syncing, averaged):
            accumulator, exp_avg_sq = self._accumulator(p), state["exp_avg_sq"]
            accumulator.copy_(avg)
            state["exp_avg"].zero_().add_(accumulator / state["lrs"], alpha=-1)
            p.data.add_(accumulator / (exp_avg_sq.sqrt() + group["eps"]))
            accumulator.zero_()
            state["lrs"] = 0.0
        for _, _, state in work:
            state["local_step_counter"] += 1
            if state["local_step_counter"] == self.local_step_scaler:
                state["local_step_counter"] = 0
                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)

    def _accumulator(self, p) -> torch.Tensor:
        return self.rank_local.setdefault(p, {}).setdefault("momentum_accumulator", torch.zeros_like(p))
