"""When a Ray Train run takes its next memory snapshot (``raydeep.memory_snapshot_every``).

A number N snapshots every N steps. ``"auto"`` (the default) snapshots as often as costs at most
``BUDGET`` (3%) of the training time, measured: the attempt's first snapshot comes after its
second step (the first is warm-up), and each snapshot's seconds set the gap to the next,

    gap = ceil(snapshot_s / (BUDGET * step_s))

where ``step_s`` is the median step since the previous snapshot or checkpoint, and both are the
slowest rank's. A storage checkpoint restarts the count (it protects the same steps). Every rank
must snapshot at the same step (a snapshot is collective), so the measurements are agreed with
one all-reduce per snapshot and every rank computes the same gap.

>>> cadence = SnapshotCadence(4)
>>> [step for step in range(1, 13) if cadence.due(step)]
[4, 8, 12]
>>> auto = SnapshotCadence("auto")
>>> auto.step_done(1.0); auto.step_done(0.1); auto.due(2)
True
>>> auto.measured(snapshot_s=0.012, step_s=0.1); auto.gap
4
"""
from __future__ import annotations

import math
import statistics

BUDGET = 0.03  # the share of training time "auto" spends on snapshots
FIRST_AFTER = 2  # "auto": the attempt's first snapshot follows its second step


class SnapshotCadence:
    def __init__(self, every: int | str):
        self.auto = every == "auto"
        self.gap: int | None = None if self.auto else int(every)  # None: not measured yet
        self.steps_done = 0  # in this attempt
        self.since_save: list[float] = []  # step seconds since the last snapshot or checkpoint

    def step_done(self, seconds: float) -> None:
        self.steps_done += 1
        if self.steps_done > 1:  # the attempt's first step is warm-up, not a step's cost
            self.since_save.append(seconds)

    def due(self, step: int) -> bool:
        """Whether global step ``step``, just finished, is followed by a snapshot."""
        if not self.auto:
            return bool(self.gap) and step % self.gap == 0
        if self.gap is None:
            return self.steps_done == FIRST_AFTER
        return len(self.since_save) >= self.gap

    def saved(self) -> None:
        """A storage checkpoint was taken: it protects these steps as a snapshot would."""
        self.since_save = []

    def typical_step_s(self) -> float:
        return statistics.median(self.since_save) if self.since_save else 0.0

    def measured(self, snapshot_s: float, step_s: float) -> None:
        """A snapshot took ``snapshot_s`` after steps of ``step_s`` (both agreed by every rank)."""
        self.since_save = []
        if self.auto:
            self.gap = max(1, math.ceil(snapshot_s / (BUDGET * step_s))) if step_s > 0 else 1

    def off(self) -> None:
        self.auto, self.gap = False, 0
