"""Offload actors that outlive their rank and keep their part of each memory snapshot.

Left to itself a rank creates its offload actors (:mod:`raydeep.tier.actors`) and they die with
it, so a memory snapshot has to carry their masters and optimizer states, 12 bytes per element
for AdamW, to the driver's :class:`~raydeep.ray.memory_snapshots.SnapshotStore`. In a Ray Train
run the store creates them instead (:class:`StoreOwner`, which ``ActorTier`` uses while a worker
trains under :func:`raydeep.tier.actor_faults.actors_owned_by`) and keeps their handles:

- a rank that dies leaves its actors alive on their CPU nodes;
- each actor keeps the part files it writes into a snapshot as objects it owns in its node's
  object store (:func:`hold`); the store records only who holds which path, so the states never
  reach the driver's node;
- the next attempt's ranks adopt their predecessors' actors (reset to the new plan; more are
  created only where the new world size needs more), and the actors read their ranges of the
  snapshot from there (:func:`read_held`), as any checkpoint is read: the same manifest and
  sha256s, resharded at another world size. At the same world size each actor reads the files
  it wrote, from its own node;
- actors no rank adopts drop their training state and are killed once the store deletes the last
  snapshot file they hold (newer snapshots replace it), or with the store when the run ends.

A holder that is lost (its node died) leaves its files unreadable: reading one raises an
``OSError`` naming the file and the actor, the snapshot counts as damaged, and the restart falls
back to an older snapshot or to the storage checkpoint, with a warning saying why.
"""
from __future__ import annotations

import ray

from raydeep.tier.offload_actor import OffloadActor

_holder = None  # this process's own actor handle, once it is a HoldingOffloadActor


def holding_here() -> bool:
    """Whether this process keeps the snapshot files it writes (it is an offload actor the
    store owns)."""
    return _holder is not None


def hold(chunks: list[bytes]) -> tuple:
    """Keep a file's ``chunks`` here, as one object in this node's object store that this actor
    owns; returns ``(holder, its name, size, [the object])`` for the store's record. Readers take
    the object without a call to this actor, so an actor busy in a call of its own never keeps
    another from reading what it holds."""
    data = b"".join(chunks)
    return _holder, ray.get_runtime_context().get_actor_name(), len(data), [ray.put(data)]


def read_held(path: str, name: str, content: list) -> bytes:
    """File ``path``'s bytes, from the object its holder (offload actor ``name``) owns."""
    from raydeep.tier.actor_faults import lost_errors

    try:
        return ray.get(content[0])
    except lost_errors() as err:
        raise OSError(f"{path} was held in the memory of offload actor {name}, which is lost "
                      f"({type(err).__name__})") from None


class HoldingOffloadActor(OffloadActor):
    """An offload actor whose snapshot part files stay on its node (see the module docstring)."""

    def __init__(self, *args):
        global _holder
        super().__init__(*args)
        _holder = ray.get_runtime_context().current_actor

    def node_room(self) -> tuple[str, int | None]:
        """This actor's node, and the bytes of memory still available there (None: unknown)."""
        from raydeep.ray.node_memory import available_memory

        return ray.get_runtime_context().get_node_id(), available_memory()

    def reset(self, *args) -> None:
        """Adopted by a new attempt's rank: start over with its plan (``OffloadActor``'s
        arguments); the snapshot files held stay."""
        OffloadActor.__init__(self, *args)

    def retire(self) -> None:
        """Its rank is gone: drop the training state, keep the snapshot files."""
        self.shards, self._out, self._saved = None, None, None


class StoreOwner:
    """Creates rank ``rank``'s offload actors through the run's snapshot store, which owns them,
    adopting the previous attempt's where it can. ``attempt`` is the attempt's id, the same on
    every rank."""

    def __init__(self, store, attempt: str, rank: int, world_size: int):
        self.store, self.attempt, self.rank, self.world_size = store, attempt, rank, world_size

    def create(self, options: list[dict], args: list[tuple]) -> list:
        from raydeep.tier.actor_faults import lost_errors

        actors, adopted = ray.get(self.store.create_offload_actors.remote(self.attempt, self.rank, self.world_size,
                                                                          options, args))
        # Reset here, before the tier's first call: calls from one process run in order.
        resets = [actor.reset.remote(*a) for actor, a in zip(actors[:adopted], args)]
        for i, reset in enumerate(resets):
            try:
                ray.get(reset)
            except lost_errors():  # lost since: a new one in its place
                actors[i] = ray.get(self.store.replace_offload_actor.remote(self.rank, actors[i], options[i], args[i]))
        return actors
