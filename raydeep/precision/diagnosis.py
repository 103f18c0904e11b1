"""Loss-scale collapse, named: which parameters' gradients overflowed, the scale history, what to try.

fp16 training that overflows step after step halves its loss scale until DeepSpeed stops with
"Current loss scale already at minimum", which says neither where the inf/NaN came from nor what to
change. ``OverflowWatch`` follows the skipped steps: at the first overflow of a run of them every
rank notes which parameters hold non-finite gradients in its shard (a read per parameter, paid only
on an overflowing step) and the ranks exchange their lists, so each tells the same story; after
``after`` consecutive skips it logs that diagnosis once; and the engine attaches the same text to
the minimum-scale exception (``LossScaleCollapse``).

Note: the exchange is a collective, which is safe because the overflow decision it follows is the
same on every rank (all-reduced, or taken from gradients every rank holds alike).
"""
from __future__ import annotations

import logging
from collections import deque

import torch
import torch.distributed as dist
from raydeep.errors import RaydeepError

logger = logging.getLogger("raydeep")

ADVICE = ("try a lower learning rate (or a longer warm-up), \"bf16\" instead of \"fp16\" (no loss scaling), "
          "\"gradient_clipping\" (1.0 is usual), a larger \"fp16.hysteresis\", and check the data for inf/NaN inputs")


class LossScaleCollapse(RaydeepError):
    """DeepSpeed's minimum-scale exception (the same message first), with the diagnosis attached.
    A raydeep error: resuming from the last checkpoint replays the same batches into the same
    collapse, so Ray Train must not retry it (the run ends with this message, exit status 2)."""


def nonfinite_parameters(units) -> list[str]:
    """The parameters whose gradient slice on this rank holds an inf or NaN, in unit order."""
    found = []
    for unit in units:
        base = unit.layout.shard_range(unit.rank)[0]
        for slot, s, e in unit.layout.pieces_of_rank(unit.rank):
            if not torch.isfinite(unit.grad.narrow(0, slot.offset + s - base, e - s)).all():
                found.append(slot.name)
    return found


def _everyone(names: list[str]) -> list[tuple[str, list[int]]]:
    """Every rank's names, each with the ranks that found it, in rank and then unit order."""
    lists = [names]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, names)
    merged: dict[str, list[int]] = {}
    for rank, found in enumerate(lists):
        for name in found:
            merged.setdefault(name, []).append(rank)
    return list(merged.items())


class OverflowWatch:
    """Consecutive overflow skips, the recent loss scales, and where the run of skips began
    (the first parameters of ``units`` whose gradients were not finite)."""

    def __init__(self, after: int, units=(), history: int = 16):
        self.after, self.units = after, units
        self.run, self.run_began = 0, 0
        self.scales: deque[float] = deque(maxlen=history)
        self.first: list[tuple[str, list[int]]] = []
        self._told = False

    def observe(self, step: int, overflow: bool, scale: float) -> None:
        """After each optimizer step's overflow decision (``scale``: the scale it ran with)."""
        self.scales.append(scale)
        if not overflow:
            self.run, self._told = 0, False
            return
        self.run += 1
        if self.run == 1:
            self.run_began, self.first = step, _everyone(nonfinite_parameters(self.units))
        if self.after and self.run >= self.after and not self._told:
            self._told = True
            logger.warning("%s", self.describe())

    def describe(self) -> str:
        history = " -> ".join(f"{s:g}" for s in self.scales)
        named = [f"{name} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                 for name, ranks in self.first[:5]]
        more = f" and {len(self.first) - 5} more" if len(self.first) > 5 else ""
        where = ", ".join(named) + more if named else "no parameter (the loss itself was not finite)"
        return (f"fp16 loss scale collapse: {self.run} consecutive steps skipped for inf/NaN gradients since step "
                f"{self.run_began}; loss scale over the last {len(self.scales)} steps: {history}; non-finite "
                f"gradients first seen in: {where}. Fix: {ADVICE}")
