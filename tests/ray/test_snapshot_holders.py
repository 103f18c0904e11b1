"""Offload actors that outlive their rank hold their part of each memory snapshot
(``raydeep.ray.snapshot_holders``).

On the package's simulated cluster, a snapshot store (this process its driver, as ``fit``'s is)
owns the offload actors of 2 gloo ranks that train a GPT in bf16 at stage 2 (2 actors per rank),
snapshot at step 2 into the store, train 2 more steps and exit without closing anything, as
killed ranks would. Then:

- what reached the store's process is the ranks' own small files; the masters and AdamW states
  (12 bytes per element) stayed in the actors, which are still alive;
- a new attempt of 2 ranks adopts those actors (no new ones), which load the snapshot from their
  own memory, and trains the same 2 steps bit for bit; so does 1 rank, adopting 2 of them, like a
  load of the same step's storage checkpoint; nothing of the masters and states reaches a rank;
- the actors no rank adopted dropped their training state and are killed once the store deletes
  the snapshot, the rest when the store is closed; a file whose holder is lost cannot be read, and the error
  names the file and the actor.
"""
from __future__ import annotations

import json

import pytest
import ray
import torch

from tests.dist.harness import run_ranks
from tests.ray.tensors import actor_storage_bytes, array_bytes, received_while
from tests.ray.test_offload_actors import _eventually

pytestmark = pytest.mark.slow
BEFORE, AFTER = 2, 2
STORE, NAMESPACE = "snapshot-holders-store", "raydeep-tests"
SUB_GROUP = 1 << 18  # several sub-groups per rank, so each of the 2 actors per rank owns some


def _engine(actors: bool):
    import raydeep
    from raydeep import comm
    from raydeep.models import build_gpt
    from tests.dist.checkpoint_workloads import layout_config
    from tests.dist.workloads import SEQ

    torch.manual_seed(0)
    cfg = layout_config(2, comm.world_size(), bf16={"enabled": True})
    if actors:
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=SUB_GROUP)
        cfg["raydeep"] = {"offload_target": "actors", "offload_actors_per_rank": 2, "offload_actor_cpus": 0.5}
    engine, *_ = raydeep.initialize(model=build_gpt("gpt-tiny", block_size=SEQ, n_layer=4, n_embd=256, n_head=4),
                                    config=cfg)
    return engine


def _attempt(address: str, attempt: str, directory: str, load: str | None) -> dict:
    """One attempt's rank: its offload actors made by the store. The first (``load`` None)
    trains, snapshots into the store and checkpoints to ``directory`` at step ``BEFORE``, trains
    on and leaves without closing anything; a later one loads ``load`` ("snapshot" or
    "checkpoint") and trains on, with or without (``attempt`` ending in "-none") offload."""
    from raydeep import comm
    from raydeep.ray.memory_snapshots import snapshot_storage
    from raydeep.ray.snapshot_holders import StoreOwner
    from raydeep.tier.actors import actors_owned_by
    from tests.dist.checkpoint_workloads import continue_training
    from tests.dist.workloads import run_steps

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        store = ray.get_actor(STORE, namespace=NAMESPACE)
        snapshots = snapshot_storage(store, "holders")
        with actors_owned_by(StoreOwner(store, attempt, comm.rank(), comm.world_size())):
            engine = _engine(actors=not attempt.endswith("-none"))
        out = {"tier": type(engine.tier).__name__}
        if load is None:
            run_steps(engine, BEFORE, 12)
            out["shard"] = sum(end - start for start, end, _ in (u.held_range() for u in engine.tier.units))
            engine.save_checkpoint(snapshots, tag=f"global_step{BEFORE}")
            engine.save_checkpoint(directory, tag=f"global_step{BEFORE}")
        else:
            out["received"] = _load_counting(engine, snapshots if load == "snapshot" else directory)
        out.update(continue_training(engine, AFTER))
        return out  # the actors are left as a killed rank leaves them
    finally:
        ray.shutdown()


def _payload(obj) -> int:
    """Bytes of the arrays, tensors and ``bytes`` (a file's content) in ``obj``."""
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, (list, tuple)):
        return sum(_payload(v) for v in obj)
    return array_bytes(obj)


def _load_counting(engine, where) -> int:
    """Load, counting the bytes ``ray.get`` hands this process meanwhile (arrays, tensors and
    files)."""
    return received_while(lambda: engine.load_checkpoint(where), _payload)


def _holders() -> list:
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name == "HoldingOffloadActor"]


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], v) for k, v in b["params"].items())


def test_a_snapshot_held_by_offload_actors_that_outlive_their_ranks(shared_ray, tmp_path):
    from raydeep.ray.memory_snapshots import SnapshotStore, snapshot_storage

    store = SnapshotStore.options(name=STORE, namespace=NAMESPACE).remote()
    try:
        first = run_ranks(_attempt, 2, shared_ray.address, "first", str(tmp_path), None)
        here, in_actors = ray.get(store.bytes_held.remote()), ray.get(store.bytes_held_by_actors.remote())
        shard = sum(r["shard"] for r in first)
        print(f"\nsnapshot of {shard:,} elements in 2 ranks: {here:,} bytes in the store, {in_actors:,} held by the "
              f"offload actors ({in_actors / shard:.2f} bytes per element)")
        assert in_actors >= 12 * shard  # fp32 masters and both AdamW moments, in the actors
        assert here < 0.05 * in_actors  # the ranks' own files: no masters, no states
        first_actors = {a.actor_id for a in _holders()}
        assert len(first_actors) == 4  # 2 ranks x 2 actors, alive after their ranks left
        # What "auto" weighs against each offload node's memory: the parts held there.
        holders = ray.get(store.holders.remote())
        assert len(holders) == 4 and sum(size for _, size in holders) == in_actors
        nodes = {node for node, _ in ray.get([holder.node_room.remote() for holder, _ in holders])}
        assert nodes == {shared_ray.offload.node_id}

        again = run_ranks(_attempt, 2, shared_ray.address, "second", str(tmp_path), "snapshot")
        assert again[0]["tier"] == "ActorTier" and _same(again[0], first[0])
        # Each rank adopted its predecessor's actors (no new ones, no new CPUs), which read their
        # own parts of the snapshot in their own memory: what reached each rank is its parameters
        # in bf16 (2 bytes per element) and its own small file, not the 12 bytes of the masters
        # and states.
        assert {a.actor_id for a in _holders()} == first_actors
        for rank, shard_of in zip(again, first):
            print(f"load at the same world size: {rank['received']:,} array bytes reached a rank of "
                  f"{shard_of['shard']:,} elements")
            assert rank["received"] <= 2 * shard_of["shard"] + 0.05 * in_actors

        loads = [("third-none", "checkpoint"), ("fourth-none", "snapshot"), ("fifth", "snapshot")]
        one = [run_ranks(_attempt, 1, shared_ray.address, attempt, str(tmp_path), load)[0]
               for attempt, load in loads]
        assert one[0]["tier"] == "LocalTier" and one[2]["tier"] == "ActorTier"
        assert one[2]["received"] <= 2 * shard + 0.05 * in_actors  # resharded 2 -> 1 by the actors
        # The one rank adopted the 2 actors of rank 0; rank 1's are retired: they dropped their
        # training state and keep only the snapshot files, until those are deleted.
        alive = _holders()
        trained = [actor_storage_bytes(ray.get_actor(a.name, namespace=a.ray_namespace), attribute="shards")
                   for a in alive]
        assert len(alive) == 4 and sorted(b > 0 for b in trained) == [False, False, True, True], trained
        assert _same(one[1], one[0]) and _same(one[2], one[0])

        # A lost holder: its files cannot be read, and the error says which and why.
        storage = snapshot_storage(store, "holders")
        held = [n for n in json.loads(storage.read(f"global_step{BEFORE}/manifest.json"))["files"] if "-part" in n]
        assert len(held) == 4
        victim = next(a for a, kept in zip(alive, trained) if not kept)  # a retired one: the other 2 train on
        victim_handle = ray.get_actor(victim.name, namespace=victim.ray_namespace)
        ray.kill(victim_handle, no_restart=True)
        # Read only once it is gone: a file fetched while it still lived may stay in the reader's
        # node store, and Ray serves such a copy on.
        assert _eventually(lambda: _is_dead(victim_handle)), victim.name

        def unreadable() -> list[str]:
            errors = []
            for name in held:
                try:
                    storage.read(f"global_step{BEFORE}/{name}")
                except OSError as err:
                    errors.append(str(err))
            return errors

        # Ray frees a dead owner's objects once it learns of the death (about a second).
        assert _eventually(lambda: len(unreadable()) == 1), unreadable()
        errors = unreadable()
        assert victim.name in errors[0] and "lost" in errors[0], errors

        ray.get(store.delete.remote("/", True))  # the snapshots replaced: the retired holders go
        assert _eventually(lambda: len(_holders()) == 2), _holders()
    finally:
        ray.get(store.close.remote())  # as fit does at the end of a run
        ray.kill(store)
    assert _eventually(lambda: _holders() == []), _holders()


def _is_dead(actor) -> bool:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        pass
    return False
