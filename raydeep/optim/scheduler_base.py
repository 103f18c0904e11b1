"""What every DeepSpeed learning-rate schedule in ``raydeep.optim.schedulers`` shares: the
optimizer it drives, how it writes learning rates, parameter checks, warm-up curves, and the
bookkeeping of ``last_batch_iteration`` and the state dict."""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch.optim import Optimizer

logger = logging.getLogger("raydeep")

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


_NOT_STARTED_MSG = "Attempting to get learning rate from scheduler before it has started"


@runtime_checkable
class OwnParamGroups(Protocol):
    """What owns the update and says so (an optimizer tier, ``raydeep.tier``): its own
    ``param_groups`` are the ones its step reads, wherever it keeps the states."""

    param_groups: list[dict]
    optimizer_name: str


def _optimizer_to_drive(optimizer: Any) -> Optimizer | OwnParamGroups:
    # Other wrappers that keep the real optimizer in ``.optimizer`` are unwrapped one level, so
    # the scheduler drives the param groups the step actually reads.
    if isinstance(optimizer, (Optimizer, OwnParamGroups)):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _update_lr(param_groups: list[dict], lrs: Sequence[Any]) -> list[Any]:
    # Tensor LRs are filled in place: compiled/captured optimizers hold a reference to them.
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _format_param(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    """Broadcast a scalar to every param group, or check a per-group list/tuple."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} value for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_positive_int(value: Any, name: str) -> None:
    # isinstance(True, int) holds, so True passes exactly as it does in DeepSpeed.
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def _checked_warmup_type(warmup_type: str) -> str:
    if warmup_type not in {WARMUP_LOG_RATE, WARMUP_LINEAR_RATE}:
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        return WARMUP_LOG_RATE
    return warmup_type


def _warmup_gamma(t: int, num_steps: int, warmup_type: str) -> float:
    """Warm-up progress in [0, 1) at iteration ``t < num_steps``."""
    if warmup_type == WARMUP_LOG_RATE:
        # Same operation order as DeepSpeed ((1/ln N) * ln(t+1)) so results match bit for bit.
        return (1.0 / math.log(num_steps)) * math.log(t + 1)
    return t / num_steps


class _Scheduler:
    """Shared bookkeeping: ``last_batch_iteration``, ``_last_lr`` and the state dict."""

    optimizer: Optimizer
    last_batch_iteration: int
    _last_lr: list[Any] | None = None

    def get_lr(self) -> list[Any]:
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """Learning rates written by the last ``step()`` (or by construction at t = -1)."""
        if getattr(self, "_last_lr", None) is None:
            raise AssertionError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: previous + 1) and write the LRs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        """Return ``{'last_batch_iteration': t}``, the whole resumable state."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Restore ``last_batch_iteration``; the LR is rewritten on the next ``step()``."""
        self.last_batch_iteration = sd["last_batch_iteration"]
