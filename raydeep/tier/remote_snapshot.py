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
