"""When a Ray Train run takes its next memory snapshot (``raydeep.memory_snapshot_every``).

A number N snapshots every N steps. ``"auto"`` (the default) snapshots as often as costs at most
``BUDGET`` (3%) of the training time, measured: the attempt's first snapshot comes after its
second step (the first is warm-up), and from then on two rules, both from measurements every rank
agrees on (a snapshot is collective: every rank must take it at the same step, so each snapshot's
seconds and the median step since the previous one, the slowest rank's, are agreed with one
all-reduce):

- the gap: at least ``ceil(snapshot_s / (BUDGET * step_s))`` steps after the previous snapshot or
  storage checkpoint (a checkpoint protects the same steps, so it restarts the count);
- the budget: the attempt's snapshots, the next one included (expected to cost what the last
  did), take at most ``BUDGET`` of its training time (its steps but the warm-up one, at the last
  median step). A snapshot dearer than the last was expected to be is paid back by a later next
  one, so the share holds over the attempt, the early first snapshot included.

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
        # "auto", all agreed by every rank: the attempt's snapshot seconds so far, what the next is
        # expected to cost (the last one's seconds) and the median step at the last snapshot.
        self.spent_s = 0.0
        self.next_s = 0.0
        self.step_s = 0.0

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
        return len(self.since_save) >= self.gap and self._affordable()

    def _affordable(self) -> bool:
        """Whether the next snapshot keeps the attempt's within the budget (every rank decides alike:
        from agreed seconds and the step count)."""
        if self.step_s <= 0:
            return True  # no step measured to weigh against: the gap alone decides
        trained_s = self.step_s * (self.steps_done - 1)  # the warm-up step is not training time
        return self.spent_s + self.next_s <= BUDGET * trained_s

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
            self.spent_s += snapshot_s
            self.next_s, self.step_s = snapshot_s, step_s

    def off(self) -> None:
        self.auto, self.gap = False, 0
