"""``synchronize_checkpoint_boundary`` and ``profile``: what happens around each checkpointed region.

- ``synchronize_checkpoint_boundary``: the device is synchronised when a region's forward starts and
  ends, and when its recomputation starts and ends (DeepSpeed's ``accelerator.synchronize()`` at
  the start and end of its checkpoint forward and backward). It makes a region's time its own in a
  profile (nothing queued before it runs inside it) at the cost of stalling the host.
- ``profile``: each region's forward and recomputation is timed and logged on rank 0 in DeepSpeed's
  timer format -- ``time (ms) | fwd: 1.23`` and ``time (ms) | backward: 4.56`` (DeepSpeed's names; the
  ``backward`` line is the recomputation, the part of the region's backward checkpointing adds).
  The times also add up in :data:`PROFILE_TOTALS` (``take()`` reads and restarts them, as
  ``checkpoint_forward_s``, ``checkpoint_recompute_s`` and ``checkpoint_calls``). Timing a region on
  an accelerator synchronises the device at its ends, as DeepSpeed's timers do.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("raydeep")


def synchronize_device() -> None:
    """Wait for the current accelerator's queued work (nothing on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class ProfileTotals:
    """The profiled regions' times since the last :meth:`take`."""

    forward_s: float = 0.0
    recompute_s: float = 0.0
    calls: int = 0

    def take(self) -> dict:
        """The totals as step-metric columns, and start again from zero."""
        out = {"checkpoint_forward_s": self.forward_s, "checkpoint_recompute_s": self.recompute_s,
               "checkpoint_calls": self.calls}
        self.forward_s, self.recompute_s, self.calls = 0.0, 0.0, 0
        return out


PROFILE_TOTALS = ProfileTotals()


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class BoundaryTiming:
    """Wraps a region's forward (:meth:`forward`) and its recomputation (:meth:`recompute`)."""

    def __init__(self, synchronize: bool, profile: bool, sync=synchronize_device, clock=time.perf_counter,
                 totals: ProfileTotals = PROFILE_TOTALS):
        self.synchronize, self.profile = synchronize, profile
        self.sync, self.clock, self.totals = sync, clock, totals

    @property
    def active(self) -> bool:
        return self.synchronize or self.profile

    @contextlib.contextmanager
    def forward(self):
        began = self._begin()
        yield
        self.totals.calls += self.profile
        self._end(began, "fwd", "forward_s")

    @contextlib.contextmanager
    def recompute(self):
        began = self._begin()
        try:
            yield
        finally:  # torch stops a recomputation early, by an exception, once it has what backward needs
            self._end(began, "backward", "recompute_s")

    def _begin(self) -> float:
        if self.active:
            self.sync()
        return self.clock()

    def _end(self, began: float, name: str, total: str) -> None:
        if not self.active:
            return
        self.sync()
        if self.profile:
            seconds = self.clock() - began
            setattr(self.totals, total, getattr(self.totals, total) + seconds)
            if _rank0():
                logger.info("time (ms) | %s: %.2f", name, seconds * 1000)
