"""An ``ActorTier``'s checkpoint copy held in its offload actors (``ActorTier.remote_snapshot``):
the copy is taken inside the actors and written by them as the rank's part files.

Checkpoints (``remote_snapshot``, used by ``raydeep.checkpoint.snapshot``): each actor copies
its chunks' part of the ranges a checkpoint saves, inside the actor -- its calls run in order,
so the copy holds the state of the last step and of no later one, whatever the rank does next --
and keeps it (12 bytes per element for AdamW, on the CPU node) until ``RemoteSnapshot.write``
has it write the copy as a part file of the rank through the sink the checkpoint provides (its
format, its storage, its staging location), returning only the file's digest and size. The
masters and optimizer states never pass through the rank. An actor that does not see the mark
of the rank's staging location (a node-local directory on another node) hands its copy to the
rank instead, which writes the same file. The commit stays the checkpoint's: the rank reports its
digests only after its actors' files are written, and the manifest comes last. Loads
(``remote_load``, used by ``raydeep.checkpoint.restore`` where every node reaches the storage: an
object store, the memory snapshots) are the same the other way: each actor reads and verifies its
own chunks' ranges and stages them; the rank's ``load_state_dict`` then has them load what they
staged, and receives only the parameters in the model dtype.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from raydeep.tier.base import OptimizerTier, TierState
from raydeep.tier.offload_actor import dtype_of, from_wire


def merged_parts(parts) -> tuple[dict, dict]:
    """The actors' ``(state dtypes, scalars by group)`` as one: each actor knows its own chunks'."""
    dtypes, scalars = {}, {}
    for part_dtypes, part_scalars in parts:
        dtypes.update(part_dtypes)
        for g, found in part_scalars.items():
            scalars.setdefault(g, {}).update(found)
    return dtypes, scalars


@dataclass
class RemoteSnapshot:
    """A copy of an ``ActorTier``'s state over some ranges, held in its actors (see the module
    docstring). ``segments[a]`` lists ``(unit, flat start, flat end)`` of actor ``a``'s copy in
    the order it packed them: element ``i`` of its tensors is element ``i`` of those runs."""

    tier: OptimizerTier  # the ActorTier whose actors hold the copy
    key: str
    calls: list  # one per actor: its state dtypes and scalars
    segments: list[list[tuple[int, int, int]]]
    optimizer: str
    param_groups: list[dict]
    written: bool = False

    def state(self) -> TierState:
        """The optimizer's name, state dtypes, hyperparameters and scalars (no tensors: ``units``
        is empty); waits for the actors' copies."""
        dtypes, scalars = merged_parts(self.tier._get(self.calls))
        return TierState([], self.optimizer, dtypes, self.param_groups,
                         [scalars.get(g, {}) for g in range(len(self.param_groups))])

    def write(self, names: list[str], sink) -> list[dict]:
        """Actor ``a`` writes its copy as file ``names[a]`` through ``sink`` (``sink.reachable()``,
        ``sink(name, master, states) -> entry``; picklable); returns each file's entry. An actor
        that cannot reach the storage hands its copy here, and this process writes it."""
        actors = self.tier.actors
        entries = self.tier._get([a.write_snapshot.remote(self.key, sink, n) for a, n in zip(actors, names)])
        for a, entry in enumerate(entries):
            if entry is None:
                master, states = self.tier._get(actors[a].fetch_snapshot.remote(self.key))
                entries[a] = sink(names[a], from_wire(master, torch.float32),
                                  {k: from_wire(v, dtype_of(d)) for k, (v, d) in states.items()})
        self.written = True
        return entries

    def discard(self) -> None:
        """Drop an unwritten copy (a save that failed before writing); does not wait."""
        if not self.written:
            for actor in self.tier.actors:
                actor.discard_snapshot.remote(self.key)
            self.written = True


def stage_load(tier, source, kinds: list[str], pieces_in) -> dict[str, str]:
    """Phase 1 of a checkpoint load (``raydeep.checkpoint.restore``) done by ``tier``'s actors:
    each reads its own chunks' ranges of state ``kinds`` (the fp32 master first) through
    ``source`` (a ``CheckpointReader`` over a storage every actor reaches: an object store, or
    the run's memory snapshots, whose files other offload actors may hold), verified, and stages
    them, so nothing of the masters and states passes through the rank. The next
    ``load_state_dict`` loads what was staged and does not read its ranges' tensors.
    ``pieces_in(unit, start, end)`` gives the parameters' pieces of a unit's flat range. Returns
    the staged state kinds and their dtypes; raises the checkpoint error an actor found (nothing
    is loaded then)."""
    from raydeep.errors import CheckpointError, CorruptCheckpointError

    calls = [tier._call(actor.stage, source, _load_plan(tier, a, pieces_in), kinds)
             for a, actor in enumerate(tier.actors)]
    failures = [found for found in tier._get(calls) if found is not None]
    if failures:
        kind, message = failures[0]
        raise (CorruptCheckpointError if kind == CorruptCheckpointError.__name__ else CheckpointError)(message)
    return {kind: str(source.state_dtype(kind)).removeprefix("torch.") for kind in kinds[1:]}


def _load_plan(tier, a: int, pieces_in) -> list[tuple]:
    """Actor ``a``'s part of a load, as ``OffloadActor.stage`` takes it: per chunk, the range a
    checkpoint holds of it (the unit's held range: padding excluded) and its parameters' pieces
    there."""
    plan = []
    for c in tier._chunks(a):
        unit = tier.units[c.unit]
        start, end, base = unit.held_range()
        lo, hi = max(start, base + c.lo), min(end, base + c.hi)
        if lo < hi:
            pieces = [(slot.name, s - slot.offset, e - slot.offset, s - lo) for slot, s, e in pieces_in(unit, lo, hi)]
            plan.append((c.unit, lo - base, hi - base, pieces))
    return plan


def take(tier, ranges: list[tuple[int, int]]) -> RemoteSnapshot:
    """``tier``'s snapshot over ``ranges`` (one flat range per unit), copied inside its actors
    and held there (see the module docstring)."""
    local, bases = {}, []
    for i, unit in enumerate(tier.units):
        start, end, base = unit.held_range()
        lo, hi = ranges[i]
        assert lo >= hi or start <= lo <= hi <= end, f"{unit.name}: {ranges[i]} is not held here"
        local[i] = (lo - base, hi - base)
        bases.append(base)
    key = uuid.uuid4().hex
    calls = [actor.snapshot.remote(key, local) for actor in tier.actors]
    segments = []
    for a in range(len(tier.actors)):
        runs: list[tuple[int, int, int]] = []  # the chunks' parts in the actor's order, adjacent ones joined
        for c in tier._chunks(a):
            lo, hi = max(local[c.unit][0], c.lo), min(local[c.unit][1], c.hi)
            if lo >= hi:
                continue
            start, end = bases[c.unit] + lo, bases[c.unit] + hi
            if runs and runs[-1][0] == c.unit and runs[-1][2] == start:
                runs[-1] = (c.unit, runs[-1][1], end)
            else:
                runs.append((c.unit, start, end))
        segments.append(runs)
    hyper = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in tier._hyper()]
    return RemoteSnapshot(tier, key, calls, segments, tier.optimizer_name, hyper)
