"""Learning-rate schedulers with DeepSpeed 0.19.8 semantics.

The five DeepSpeed schedulers (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``, ``LRRangeTest``) are reproduced formula for formula, with the same
parameter names, defaults, validation messages and -- most importantly -- the same
timing: a scheduler built with ``last_batch_iteration=-1`` writes its t = -1 learning
rate into the optimizer immediately, the engine steps it once per *applied* optimizer
step, and so the first two optimizer steps of ``WarmupLR`` both run at ``warmup_min_lr``.

``build_scheduler`` resolves a ds_config ``scheduler.type`` the way the DeepSpeed engine
does: these five first, then ``torch.optim.lr_scheduler`` (case-sensitive).

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> sched = build_scheduler("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, opt)
    >>> [round((sched.step(), opt.param_groups[0]["lr"])[1], 3) for _ in range(4)]
    [0.0, 0.025, 0.05, 0.075]
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Sequence

import torch
from torch.optim import Optimizer

from raydeep.optim.scheduler_base import (
    _NOT_STARTED_MSG,
    WARMUP_LOG_RATE,
    _check_positive_int,
    _checked_warmup_type,
    _format_param,
    _optimizer_to_drive,
    _update_lr,
    _Scheduler,
    _warmup_gamma,
)

logger = logging.getLogger("raydeep")

SCHEDULER_NAMES: tuple[str, ...] = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class LRRangeTest(_Scheduler):
    """LR range test: ``lr = min_lr * (1 + step_rate * k)`` with ``k = (t+1)/step_size``.

    With ``lr_range_test_staircase`` the interval ``k`` is floored, so the LR rises in
    steps of ``lr_range_test_step_size`` iterations.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> s = LRRangeTest(opt, lr_range_test_min_lr=0.1, lr_range_test_step_size=2)
        >>> s.step(); round(opt.param_groups[0]["lr"], 6)
        0.15
    """

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.optimizer = _optimizer_to_drive(optimizer)
        n_groups, is_list = len(self.optimizer.param_groups), isinstance(lr_range_test_min_lr, (list, tuple))
        if is_list and len(lr_range_test_min_lr) != n_groups:
            raise ValueError(f"expected {n_groups} lr_range_test_min_lr, got {len(lr_range_test_min_lr)}")
        self.min_lr = list(lr_range_test_min_lr) if is_list else [lr_range_test_min_lr] * n_groups
        _check_positive_int(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        k = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(k) if self.staircase else k

    def get_lr(self) -> list[Any]:
        """LRs for the current ``last_batch_iteration``."""
        increase = 1 + self.step_rate * self._interval()
        return [min_lr * increase for min_lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's keyword name
        """Advance to ``batch_iteration`` (default: previous + 1) and write the LRs."""
        super().step(batch_iteration)


class OneCycle(_Scheduler):
    """1Cycle policy: LR up then down between two bounds, then optional decay.

    Momentum (``betas[0]``) is cycled inversely to the LR when the optimizer has
    ``betas``; ``betas[1]`` is forced to 0.99, as in DeepSpeed. Unlike the other four
    schedulers, ``get_last_lr()`` needs a ``step()`` first.

    Example:
        >>> import torch
        >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> s = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=2)
        >>> s.step(); round(opt.param_groups[0]["lr"], 6), round(opt.param_groups[0]["betas"][0], 6)
        (0.3, 0.85)
    """

    def __init__(self, optimizer: Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | Sequence[float] = 0.8, cycle_max_mom: float | Sequence[float] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        self.optimizer = _optimizer_to_drive(optimizer)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                         cycle_second_stair_count, decay_step_size)
        self.min_lrs = _format_param(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _format_param(self.optimizer, cycle_max_lr, "cycle_max_lr")
        # Both bounds are validated first so a bad cycle_max_lr leaves the groups untouched.
        if last_batch_iteration == -1:
            _update_lr(self.optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(decay_lr_rate, 0):
            self.skip_lr_decay = True
        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            self._init_momentum(cycle_min_mom, cycle_max_mom, decay_mom_rate, last_batch_iteration)
        self.last_batch_iteration = last_batch_iteration

    def _init_cycle(self, first: float, second: float | None, first_stairs: int, second_stairs: int | None,
                    decay_step_size: float) -> None:
        first = float(first)
        second = float(second) if second is not None else first
        # A zero-length first half would make step_ratio 0, which the scale divides by.
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size = first
        self.second_step_size = second
        self.first_stair_count = first_stairs
        self.second_stair_count = first_stairs if second_stairs is None else second_stairs
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)

    def _init_momentum(self, min_mom: Any, max_mom: Any, decay_mom_rate: float, last_batch_iteration: int) -> None:
        if "betas" not in self.optimizer.defaults:
            name = getattr(self.optimizer, "optimizer_name", type(self.optimizer).__name__)  # a tier: its optimizer's
            logger.warning(f"cycle_momentum is disabled because optimizer {name} does not "
                           "support momentum, no betas attribute in defaults")
            self.cycle_momentum = False
            return
        self.decay_mom_rate = decay_mom_rate
        self.min_moms = [(m, 0.99) for m in _format_param(self.optimizer, min_mom, "cycle_min_mom")]
        self.max_moms = [(m, 0.99) for m in _format_param(self.optimizer, max_mom, "cycle_max_mom")]
        if last_batch_iteration == -1:
            for betas, group in zip(self.min_moms, self.optimizer.param_groups):
                group["betas"] = betas
        if math.isclose(decay_mom_rate, 0):
            self.skip_mom_decay = True

    def _get_scale_factor(self) -> float:
        i = self.last_batch_iteration + 1
        cycle = math.floor(1 + i / self.total_size)
        x = 1.0 + i / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset, not from the float scale: at a half-cycle
            # boundary the float can land 1e-16 under an exact stair and floor a whole
            # stair too low (even off the peak).
            c = i % self.total_size
            if c <= self.first_step_size:
                position = c * stairs / self.first_step_size
            else:
                position = (self.total_size - c) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> list[Any]:
        """LRs for the current ``last_batch_iteration`` (cycle, then post-cycle decay)."""
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * interval) for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``betas`` per group for the current iteration, or None when not cycling momentum."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        interval = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        # A multiplication, as in DeepSpeed: a positive decay_mom_rate grows beta1.
        return [(b0 * (1 + self.decay_mom_rate * interval), b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's keyword name
        """Advance to ``batch_iteration`` (default: previous + 1); write LRs and betas."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_Scheduler):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    ``lr = min + (max - min) * gamma(t)`` with ``gamma = ln(t+1)/ln(N)`` ("log") or
    ``t/N`` ("linear") for ``t < N = max(2, warmup_num_steps)``, else 1.
    ``warmup_max_lr=None`` means each param group's own ``lr`` at construction.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> s = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
        >>> s.get_last_lr() + [(s.step(), s.get_last_lr()[0])[1] for _ in range(3)]
        [0.0, 0.0, 0.05, 0.1]
    """

    def __init__(self, optimizer: Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = _optimizer_to_drive(optimizer)
        if warmup_max_lr is None:
            # Cloned so that filling a tensor lr in place cannot move the target.
            warmup_max_lr = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"]
                             for g in self.optimizer.param_groups]
        self.min_lrs = _format_param(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _format_param(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[Any]:
        """LRs for the current ``last_batch_iteration`` (``min`` with a warning before start)."""
        if self.last_batch_iteration < 0:
            logger.debug(_NOT_STARTED_MSG)  # DeepSpeed warns on every construction: noise, not news
            return self.min_lrs
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay that reaches 0 at ``total_num_steps``.

    After warm-up ``gamma = max(0, (T - t) / max(1, T - N))``. Note that this class's
    own ``warmup_max_lr`` default is still 0.001, as in DeepSpeed.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> s = WarmupDecayLR(opt, total_num_steps=4, warmup_max_lr=1.0, warmup_num_steps=2)
        >>> for _ in range(5): s.step()
        >>> s.get_last_lr()
        [0.0]
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Scheduler):
    """Warm up a ratio of each group's own LR, then cosine-decay it to ``cos_min_ratio``.

    Warm-up: ``ratio = wmin + (1 - wmin) * gamma(t)``. Afterwards
    ``p = min(1, (t - N + 1) / max(1, T - N))`` and
    ``ratio = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2)``, so the ratio holds at
    ``cos_min_ratio`` from ``t = T - 1`` on. The LR is ``org_lr * ratio`` with ``org_lr``
    captured at construction; before the first step it is 0.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> s = WarmupCosineLR(opt, total_num_steps=4, warmup_num_steps=2, cos_min_ratio=0.1)
        >>> for _ in range(10): s.step()
        >>> s.get_last_lr()
        [0.1]
    """

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1) -> None:
        _check_positive_int(warmup_num_steps, "warmup_num_steps")
        self.optimizer = _optimizer_to_drive(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _checked_warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        """The multiplier applied to every group's original LR at the current iteration."""
        t = self.last_batch_iteration
        if t < 0:
            logger.debug(_NOT_STARTED_MSG)  # DeepSpeed warns on every construction: noise, not news
            return 0.0
        if t < self.warmup_num_steps:
            gamma = _warmup_gamma(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        real_last_step = t - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped so the ratio stays at cos_min_ratio past the end instead of rising again.
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[Any]:
        """LRs for the current ``last_batch_iteration`` (0 with a warning before start)."""
        if self.last_batch_iteration < 0:
            logger.debug(_NOT_STARTED_MSG)  # DeepSpeed warns on every construction: noise, not news
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [org_lr * ratio for org_lr in self.org_lrs]


_SCHEDULERS: dict[str, type] = {cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR,
                                                                WarmupCosineLR)}


def _torch_scheduler_names() -> list[str]:
    # Only concrete scheduler classes: the module also exports helpers such as Optimizer.
    mod = torch.optim.lr_scheduler
    return sorted(name for name, obj in vars(mod).items()
                  if not name.startswith("_") and name != "LRScheduler" and isinstance(obj, type)
                  and (issubclass(obj, mod.LRScheduler) or name == "ReduceLROnPlateau"))


def resolve_scheduler_class(scheduler_type: str) -> type:
    """Map a ds_config ``scheduler.type`` to a class: DeepSpeed's five, then torch's.

    Example:
        >>> resolve_scheduler_class("StepLR").__name__
        'StepLR'
    """
    if scheduler_type in _SCHEDULERS:
        return _SCHEDULERS[scheduler_type]
    if scheduler_type in _torch_scheduler_names():
        return getattr(torch.optim.lr_scheduler, scheduler_type)
    known = list(SCHEDULER_NAMES) + _torch_scheduler_names()
    hint = [n for n in known if n.lower() == str(scheduler_type).lower()]
    did_you_mean = f" Did you mean '{hint[0]}'? Names are case-sensitive." if hint else ""
    raise ValueError(
        f"Unrecognized LR scheduler type '{scheduler_type}'.{did_you_mean} Valid DeepSpeed schedulers: "
        f"{', '.join(SCHEDULER_NAMES)}; torch.optim.lr_scheduler classes: {', '.join(_torch_scheduler_names())}"
    )


def required_params(scheduler_type: str) -> list[str]:
    """Names of the ``scheduler.params`` keys that ``scheduler_type`` cannot do without.

    Example:
        >>> required_params("OneCycle")
        ['cycle_min_lr', 'cycle_max_lr']
        >>> required_params("WarmupLR")
        []
    """
    cls = resolve_scheduler_class(scheduler_type)
    params = list(inspect.signature(cls).parameters.values())[1:]  # drop the optimizer
    return [p.name for p in params
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def build_scheduler(scheduler_type: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """Build the scheduler a ds_config ``scheduler`` section describes.

    ``params`` is passed as keyword arguments, so unknown keys raise ``TypeError`` just
    as they do in DeepSpeed; a missing ``params`` dict is a ``TypeError`` too.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> type(build_scheduler("WarmupDecayLR", {"total_num_steps": 10}, opt)).__name__
        'WarmupDecayLR'
    """
    cls = resolve_scheduler_class(scheduler_type)
    if params is None:
        raise TypeError(f"scheduler '{scheduler_type}' needs a 'params' dict in the config")
    return cls(optimizer, **params)
