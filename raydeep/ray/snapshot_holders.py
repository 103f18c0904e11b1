"""Offload actors that outlive their rank and keep their part of each memory snapshot.

Left to itself a rank creates its offload actors (:mod:`raydeep.tier.actors`) and they die with
it, so a memory snapshot has to carry their masters and optimizer states, 12 bytes per element
for AdamW, to the driver's :class:`~raydeep.ray.memory_snapshots.SnapshotStore`. In a Ray Train
run the store creates them instead (:class:`StoreOwner`, which ``ActorTier`` uses while a worker
trains under :func:`raydeep.tier.actors.actors_owned_by`) and keeps their handles:

- a rank that dies leaves its actors alive on their CPU nodes;
- each actor keeps the part files it writes into a snapshot in its own memory (:func:`hold`); the
  store records only who holds which path, so the states never reach the driver's node;
- the next attempt reads those files from the actors that hold them (:func:`read_held`), as it
  reads any checkpoint's: the same manifest and sha256s, resharded at another world size, into
  the new attempt's own actors;
- the earlier attempt's actors drop their training state when the new attempt creates its first
  actor, and are killed once the store deletes the last snapshot file they hold (newer snapshots
  replace it), or with the store when the run ends.

A holder that is lost (its node died) leaves its files unreadable: reading one raises an
``OSError`` naming the file and the actor, the snapshot counts as damaged, and the restart falls
back to an older snapshot or to the storage checkpoint, with a warning saying why.
"""
from __future__ import annotations

import uuid

import ray

from raydeep.tier.offload_actor import OffloadActor

_held: dict[str, list[bytes]] = {}  # this process's part files, by key (in an offload actor only)
_holder = None  # this process's own actor handle, once it is a HoldingOffloadActor


def holding_here() -> bool:
    """Whether this process keeps the snapshot files it writes (it is an offload actor the
    store owns)."""
    return _holder is not None


def hold(chunks: list[bytes]) -> tuple:
    """Keep a file's ``chunks`` here (not joined: one copy of the file is enough); returns
    ``(holder, key, size)`` for the store's record."""
    key = f"{ray.get_runtime_context().get_actor_name()}/{uuid.uuid4().hex}"  # its name, for messages
    _held[key] = chunks
    return _holder, key, sum(len(c) for c in chunks)


def read_held(path: str, holder, key: str) -> bytes:
    """File ``path``'s bytes from the actor that holds them."""
    from raydeep.tier.actors import lost_errors

    if holder == _holder:  # this very actor: asking itself would wait on its own running call
        return b"".join(_held[key])
    try:
        return ray.get(holder.read_held.remote(key))
    except lost_errors() as err:
        raise OSError(f"{path} was held in the memory of offload actor {key.split('/')[0]}, which is lost "
                      f"({type(err).__name__})") from None


class HoldingOffloadActor(OffloadActor):
    """An offload actor whose snapshot part files stay in its memory (see the module docstring)."""

    def __init__(self, *args):
        global _holder
        super().__init__(*args)
        _holder = ray.get_runtime_context().current_actor

    def read_held(self, key: str) -> bytes:
        if key not in _held:
            raise FileNotFoundError(f"offload actor: no snapshot file {key} held here")
        return b"".join(_held[key])

    def drop_held(self, key: str) -> None:
        _held.pop(key, None)

    def node_room(self) -> tuple[str, int | None]:
        """This actor's node, and the bytes of memory still available there (None: unknown)."""
        from raydeep.ray.memory_snapshots import available_memory

        return ray.get_runtime_context().get_node_id(), available_memory()

    def retire(self) -> None:
        """Its rank is gone: drop the training state, keep the snapshot files."""
        self.shards, self._out, self._saved = None, None, None


class StoreOwner:
    """Creates a rank's offload actors through the run's snapshot store, which owns them.
    ``attempt`` is the attempt's id, the same on every rank."""

    def __init__(self, store, attempt: str):
        self.store, self.attempt = store, attempt

    def create(self, options: list[dict], args: list[tuple]) -> list:
        return ray.get(self.store.create_offload_actors.remote(self.attempt, options, args))
