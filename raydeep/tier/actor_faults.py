"""How offload actors are owned, and how their loss shows on the rank.

The fault model: Ray Train restarts the whole worker group. The actors have ``max_restarts=0``: a
dead actor or a lost object fails the attempt (``OffloadActorLost``, retried), whose next attempt
loads its actors from the newest snapshot or checkpoint. Left to itself the tier creates its
actors, so they die with the rank; under ``actors_owned_by`` (a Ray Train run keeping memory
snapshots) the run's snapshot store creates them, they outlive the rank, keep their part of each
memory snapshot, and the next attempt's ranks adopt them (``raydeep.ray.snapshot_holders``). No
placement group is created, so none can leak.
"""
from __future__ import annotations

from contextlib import contextmanager

from raydeep.errors import LostResource

_owner = None  # who creates this process's offload actors (``actors_owned_by``); None: the tier itself


@contextmanager
def actors_owned_by(owner):
    """Offload actors created meanwhile in this process are created by ``owner``
    (``owner.create(options, args) -> handles``: Ray actor options and constructor arguments, one
    per actor), which outlives the process, instead of by the tier, which dies with it. A
    process-wide setting because the engine builds its tier from a ds_config, which carries no
    Ray handle. Used by Ray Train workers (``raydeep.ray.snapshot_holders``)."""
    global _owner
    previous, _owner = _owner, owner
    try:
        yield
    finally:
        _owner = previous


class OffloadActorLost(LostResource):
    """An offload actor died (its node was lost or it was killed), or an object on the way to or
    from one was lost. Retryable: Ray Train restarts the worker group, whose next attempt
    recreates the actors from the last checkpoint."""


def lost_errors() -> tuple[type, ...]:
    """Ray 2.60's errors for a lost actor, object, worker or node: ``RayActorError``
    (``ActorDiedError``, ``ActorUnavailableError``), ``ObjectLostError`` (``OwnerDiedError``,
    ``ObjectReconstructionFailedError``, ``ObjectFetchTimedOutError``, ``ObjectFreedError``),
    ``NodeDiedError``, ``WorkerCrashedError``, ``LocalRayletDiedError``. Not ``RayTaskError``: an
    exception raised by the actor's own code is a bug, not a loss."""
    from ray import exceptions as e

    return (e.RayActorError, e.ObjectLostError, e.NodeDiedError, e.WorkerCrashedError, e.LocalRayletDiedError)


def fetch(refs):
    """``ray.get``, with every loss (``lost_errors``) raised as ``OffloadActorLost``."""
    import ray

    try:
        return ray.get(refs)
    except lost_errors() as err:
        raise OffloadActorLost(f"an offload actor of this rank or an object it needed was lost "
                               f"({type(err).__name__}); the attempt fails and restarts from the last checkpoint") \
            from err


def owner():
    """Who creates this process's offload actors now (``actors_owned_by``), or None: the tier."""
    return _owner
