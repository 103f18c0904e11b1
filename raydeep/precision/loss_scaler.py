"""fp16 loss scalers with DeepSpeed 0.19.8 semantics.

Three scalers cover every precision mode:

* ``DynamicLossScaler`` -- the rule every ZeRO stage uses: factor 2, hysteresis,
  optional consecutive hysteresis, doubling on the (W+1)-th clean step, no upper cap,
  and an exception when an overflow arrives at the minimum scale.
* ``NonZeroDynamicLossScaler`` -- the simpler rule of the non-ZeRO fp16 wrappers: no
  hysteresis, and it never raises at the minimum.
* ``StaticLossScaler`` -- a constant scale (``fp16.loss_scale > 0``), and ``1.0`` for
  bf16/fp32.

``update_scale(overflow)`` is called once per optimizer step at the gradient
accumulation boundary with the *globally reduced* overflow flag; ``has_overflow`` is
the local check each rank contributes to that reduction. Log lines keep DeepSpeed's
wording (including the ``[deepspeed]`` tag) because users grep training logs for them.

Example:
    >>> s = build_loss_scaler({"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}, zero_stage=2)
    >>> for overflow in [True, True, False, False, False]:
    ...     s.update_scale(overflow)
    >>> s.loss_scale  # 16 -> hysteresis 2->1 -> 8 -> clean, clean, doubled on the 3rd clean step
    16.0
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

logger = logging.getLogger("raydeep")

MIN_SCALE_ERROR = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
SCALE_FACTOR = 2.0  # Hard-coded in DeepSpeed; not configurable.

# ds_config fp16 keys and their DeepSpeed 0.19.8 defaults.
FP16_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}


class StaticLossScaler:
    """A loss scale that never changes.

    Used for ``fp16.loss_scale > 0`` and, with ``scale=1.0``, for bf16 and fp32. An
    overflow still skips the step (the engine decides that); here it is only logged.

    Example:
        >>> s = StaticLossScaler(128.0)
        >>> s.update_scale(True); s.loss_scale
        128.0
    """

    dynamic = False

    def __init__(self, scale: float = 1.0, *, rank: int = 0) -> None:
        self.cur_scale = float(scale)
        self.rank = rank

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before ``backward``."""
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """No-op apart from the overflow log line; a static scale never moves."""
        if overflow and self.rank == 0:
            logger.warning("[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.")

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``{'type': 'static', 'cur_scale': S}``."""
        return {"type": "static", "cur_scale": self.cur_scale}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore ``cur_scale``."""
        self.cur_scale = float(sd["cur_scale"])


class _DynamicScale:
    """What DeepSpeed's two dynamic rules share: the scale, the step counter, the last overflow,
    the doubling rule -- double when ``stable = cur_iter - last_overflow_iter - 1`` is a positive
    multiple of ``scale_window`` (the (W+1)-th clean step after an overflow or from the start) --
    and a ``state_dict`` of the fields in ``STATE_KEYS``. ``rank`` only decides whether this
    process logs (rank 0 does)."""

    dynamic = True
    TYPE = ""
    STATE_KEYS: tuple[str, ...] = ("cur_iter", "last_overflow_iter", "scale_window", "min_scale")

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, rank: int) -> None:
        self.cur_scale = float(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = SCALE_FACTOR
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.rank = rank

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before ``backward``."""
        return self.cur_scale

    def _window_passed(self) -> bool:
        stable = self.cur_iter - self.last_overflow_iter - 1
        return stable > 0 and stable % self.scale_window == 0

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state; ``load_state_dict`` of it resumes the exact sequence."""
        return {"type": self.TYPE, "cur_scale": self.cur_scale, **{key: getattr(self, key) for key in self.STATE_KEYS}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore every field present in ``sd`` (as written by ``state_dict``)."""
        for key in self.STATE_KEYS:
            if key in sd:
                setattr(self, key, sd[key])
        self.cur_scale = float(sd["cur_scale"])


class DynamicLossScaler(_DynamicScale):
    """The ZeRO dynamic loss scaler (DeepSpeed 0.19.8, bit for bit).

    On overflow: with hysteresis left (``cur_hysteresis > 1`` and ``delayed_shift > 1``)
    only the hysteresis drops by one; otherwise the scale halves, floored at
    ``min_scale``, and an overflow *at* ``min_scale`` raises (unless
    ``raise_error_at_min_scale`` is False). Every step is counted in ``cur_iter``; the
    scale doubles by the shared rule (:class:`_DynamicScale`).

    Example:
        >>> s = DynamicLossScaler(8, scale_window=2, min_scale=1, delayed_shift=1, consecutive_hysteresis=False)
        >>> [(s.update_scale(False), s.cur_scale)[1] for _ in range(3)]
        [8.0, 8.0, 16.0]
    """

    TYPE = "dynamic"
    STATE_KEYS = _DynamicScale.STATE_KEYS + ("cur_hysteresis", "delayed_shift", "consecutive_hysteresis",
                                             "raise_error_at_min_scale")

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        *,
        rank: int = 0,
    ) -> None:
        super().__init__(init_scale, scale_window, min_scale, rank)
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    def update_scale(self, overflow: bool) -> None:
        """Advance one optimizer step given the all-reduced ``overflow`` flag."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        prefix = f"[deepspeed] OVERFLOW! Rank {self.rank} Skipping step."
        if self.delayed_shift == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise Exception(MIN_SCALE_ERROR)
            next_scale = float(max(self.cur_scale / self.scale_factor, self.min_scale))
            if self.rank == 0:
                logger.info(f"{prefix} Attempted loss scale: {int(self.cur_scale)}, reducing to {int(next_scale)}")
            self.cur_scale = next_scale
        else:
            if self.rank == 0:
                logger.info(
                    f"{prefix} Attempted loss scale: {int(self.cur_scale)}, but hysteresis is "
                    f"{self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}"
                )
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            if self.rank == 0:
                logger.info(f"Consecutive hysteresis is enabled. Restoring hysteresis to {self.delayed_shift}")
            self.cur_hysteresis = self.delayed_shift
        if self._window_passed():
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            self.cur_scale *= self.scale_factor


class NonZeroDynamicLossScaler(_DynamicScale):
    """The dynamic rule of DeepSpeed's non-ZeRO fp16 wrappers (stage 0).

    No hysteresis: every overflow halves the scale, floored at ``min_scale``, and it
    never raises. Doubling follows the same rule as the ZeRO scaler.

    Example:
        >>> s = NonZeroDynamicLossScaler(2, scale_window=1000, min_scale=1)
        >>> for _ in range(3): s.update_scale(True)
        >>> s.cur_scale
        1.0
    """

    TYPE = "dynamic_non_zero"

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, *, rank: int = 0) -> None:
        super().__init__(init_scale, scale_window, min_scale, rank)

    def update_scale(self, overflow: bool) -> None:
        """Advance one optimizer step given the all-reduced ``overflow`` flag."""
        prev_scale = self.cur_scale
        if overflow:
            self.cur_scale = float(max(self.cur_scale / self.scale_factor, self.min_scale))
            self.last_overflow_iter = self.cur_iter
            if self.rank == 0:
                logger.info(f"Grad overflow on iteration {self.cur_iter}")
                logger.info(f"Reducing dynamic loss scale from {prev_scale} to {self.cur_scale}")
        elif self._window_passed():
            self.cur_scale *= self.scale_factor
            if self.rank == 0:
                logger.info(f"No Grad overflow for {self.scale_window} iterations")
                logger.info(f"Increasing dynamic loss scale from {prev_scale} to {self.cur_scale}")
        self.cur_iter += 1


LossScaler = StaticLossScaler | DynamicLossScaler | NonZeroDynamicLossScaler


def _fp16_value(section: dict[str, Any], key: str) -> Any:
    # DeepSpeed's pydantic fp16 section drops "auto" values, so they mean the default.
    value = section.get(key, "auto")
    return FP16_DEFAULTS[key] if value == "auto" or value is None else value


def build_loss_scaler(fp16: dict[str, Any] | None, zero_stage: int, *, rank: int = 0) -> LossScaler:
    """Build the loss scaler a ds_config ``fp16`` section asks for.

    fp16 absent/disabled -> ``StaticLossScaler(1.0)``; ``loss_scale > 0`` -> static at
    that value; otherwise dynamic from ``2**initial_scale_power`` with the ZeRO rule
    (``zero_stage >= 1``) or the non-ZeRO rule (stage 0).

    Example:
        >>> build_loss_scaler(None, zero_stage=3).loss_scale
        1.0
        >>> build_loss_scaler({"enabled": True}, zero_stage=1).cur_hysteresis
        2
        >>> type(build_loss_scaler({"enabled": True}, zero_stage=0)).__name__
        'NonZeroDynamicLossScaler'
    """
    if not fp16 or not _fp16_value(fp16, "enabled"):
        return StaticLossScaler(1.0, rank=rank)
    static = float(_fp16_value(fp16, "loss_scale"))
    if static > 0:
        return StaticLossScaler(static, rank=rank)
    window = _fp16_value(fp16, "loss_scale_window")
    min_scale = _fp16_value(fp16, "min_loss_scale")
    # A zero window would divide by zero in update_scale; a non-positive floor collapses.
    if window <= 0:
        raise ValueError("fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled (loss_scale=0)")
    if min_scale <= 0:
        raise ValueError("fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled (loss_scale=0)")
    init_scale = 2 ** _fp16_value(fp16, "initial_scale_power")
    if zero_stage >= 1:
        return DynamicLossScaler(
            init_scale=init_scale,
            scale_window=window,
            min_scale=min_scale,
            delayed_shift=_fp16_value(fp16, "hysteresis"),
            consecutive_hysteresis=_fp16_value(fp16, "consecutive_hysteresis"),
            rank=rank,
        )
    return NonZeroDynamicLossScaler(init_scale, window, min_scale, rank=rank)


def _tensor_has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on ``x``'s device: does ``x`` hold an inf or NaN?"""
    if x.is_sparse:
        # Only stored entries can be non-finite; the implicit zeros cannot.
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    # Two scalar reductions instead of an elementwise mask: max propagates NaN and +inf,
    # min exposes -inf, and nothing the size of x is allocated.
    return torch.isfinite(x.amax()).logical_and(torch.isfinite(x.amin())).logical_not()


def has_overflow(tensors: torch.Tensor | Iterable[torch.Tensor | None]) -> bool:
    """Local check: does any tensor in ``tensors`` hold an inf or NaN? ``None`` entries are skipped.

    The per-tensor flags are combined on the device and read back once, so checking
    many gradients costs one host synchronization. The engine all-reduces the result
    (MAX) so that every rank skips the same steps.

    Example:
        >>> import torch
        >>> has_overflow([torch.ones(3), None]), has_overflow([torch.tensor([1.0, float("inf")])])
        (False, True)
    """
    found = overflow_flag(tensors)
    return bool(found) if found is not None else False


def overflow_flag(tensors: torch.Tensor | Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """``has_overflow`` without the host synchronization: a bool tensor on the tensors' device
    (None when there are none), which the engine all-reduces there before reading it once."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    found: torch.Tensor | None = None
    for t in tensors:
        if t is None:
            continue
        flag = _tensor_has_inf_or_nan(t.detach())
        found = flag if found is None else found.logical_or(flag.to(found.device))
    return found
