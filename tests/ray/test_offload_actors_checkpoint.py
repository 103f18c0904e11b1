"""Checkpoints of the actor tier are written by the offload actors, not by the rank.

On the package's simulated cluster (tests/ray/conftest.py), 2 gloo ranks train a GPT of 3.3
million parameters in bf16 at stage 2 with their masters and AdamW states in 2 offload actors
each, and save three checkpoints at the same step:

- ``by-actors``: each actor copies its chunks' masters and states and writes them as a part file
  of the rank (``raydeep.tier.actors``'s module docstring); what reaches the rank's process from
  the actors during the save is counted by wrapping ``ray.get`` in the rank (not raydeep's own
  accounting) and must hold no array at all, where
- ``by-rank`` (the save as it was: ``remote_snapshot`` hidden, so the checkpoint pulls the states
  through ``state_dict``) brings ZeRO's 12 bytes per element of the rank's shard into it;
- ``async``: an asynchronous save whose write overlaps the next steps (the actors run their calls
  in order, so the copy is of this step, whatever the rank does next).

The three hold the same values bit for bit, in the same manifest and file format; a load of the
actor-written one at the same world size continues training bit for bit like the saving run, and
loads at another world size (1 rank: the actor tier and no offload) continue bit for bit like a
load of the rank-written one.
"""
from __future__ import annotations

import json

import pytest
import ray
import torch

from tests.dist.harness import run_ranks
from tests.ray.tensors import received_while

pytestmark = pytest.mark.slow
BEFORE, AFTER = 2, 2
SUB_GROUP = 1 << 18  # several sub-groups per rank, so each of the 2 actors per rank owns some


def _model():
    from raydeep.models import build_gpt
    from tests.dist.workloads import SEQ

    torch.manual_seed(0)
    return build_gpt("gpt-tiny", block_size=SEQ, n_layer=4, n_embd=256, n_head=4)


def _engine(actors: bool):
    import raydeep
    from raydeep import comm
    from tests.dist.checkpoint_workloads import layout_config

    cfg = layout_config(2, comm.world_size(), bf16={"enabled": True})
    if actors:
        cfg["zero_optimization"].update(offload_optimizer={"device": "cpu"}, sub_group_size=SUB_GROUP)
        cfg["raydeep"] = {"offload_target": "actors", "offload_actors_per_rank": 2, "offload_actor_cpus": 0.5}
    engine, *_ = raydeep.initialize(model=_model(), config=cfg)
    return engine



def _save_counting(engine, path: str, **kwargs) -> int:
    """Save, counting the array bytes ``ray.get`` hands this process meanwhile."""
    def save():
        engine.save_checkpoint(path, **kwargs)
        engine.checkpointer.wait()
    return received_while(save)


def _save_and_continue(address: str, directory: str) -> dict:
    from tests.dist.checkpoint_workloads import continue_training
    from tests.dist.workloads import run_steps

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        engine = _engine(actors=True)
        run_steps(engine, BEFORE, 12)
        shard = sum(end - start for start, end, _ in (u.held_range() for u in engine.tier.units))
        traffic = engine.tier.traffic["received"]
        by_actors = _save_counting(engine, f"{directory}/by-actors")
        traffic = engine.tier.traffic["received"] - traffic
        engine.tier.remote_snapshot = None  # the save as it was: through state_dict
        by_rank = _save_counting(engine, f"{directory}/by-rank")
        del engine.tier.remote_snapshot
        engine.save_checkpoint(f"{directory}/async", async_save=True)  # written while the next steps run
        out = continue_training(engine, AFTER)
        engine.destroy()
        return {**out, "shard": shard, "received": {"by-actors": by_actors, "by-rank": by_rank},
                "tier_received": traffic}
    finally:
        ray.shutdown()


def _load_and_continue(address: str, directory: str, loads: list[tuple[str, bool]]) -> dict:
    from tests.dist.checkpoint_workloads import continue_training

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        out = {}
        for saved, actors in loads:
            engine = _engine(actors)
            engine.load_checkpoint(f"{directory}/{saved}")
            out[(saved, actors)] = {**continue_training(engine, AFTER), "tier": type(engine.tier).__name__}
            engine.destroy()
        return out
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def saved(shared_ray, tmp_path_factory) -> tuple[str, list[dict]]:
    directory = tmp_path_factory.mktemp("actor-saves")
    return str(directory), run_ranks(_save_and_continue, 2, shared_ray.address, str(directory))


def test_the_rank_receives_no_master_or_state_bytes_during_a_save(saved):
    directory, ranks = saved
    for rank, run in enumerate(ranks):
        received, shard = run["received"], run["shard"]
        print(f"\nrank {rank}: shard of {shard:,} elements; array bytes from the actors during a save: "
              f"{received['by-rank']:,} through the rank, {received['by-actors']:,} written by the actors")
        assert received["by-actors"] == 0 and run["tier_received"] == 0
        assert received["by-rank"] >= 12 * shard  # fp32 masters and both AdamW moments
    manifest = json.loads(open(f"{directory}/by-actors/global_step{BEFORE}/manifest.json").read())
    parts = [name for name in manifest["files"] if "-part" in name]
    assert sorted(parts) == [f"rank{r:05d}-of-00002-part{a:03d}.safetensors" for r in range(2) for a in range(2)]
    for r in range(2):
        assert manifest["files"][f"rank{r:05d}-of-00002.safetensors"]["pieces"] == []
    assert all(manifest["files"][name]["pieces"] for name in parts)


def test_the_actor_written_checkpoints_hold_the_rank_written_values(saved):
    from raydeep.checkpoint import CheckpointReader

    directory, _ = saved
    readers = {name: CheckpointReader.open(f"{directory}/{name}") for name in ("by-actors", "by-rank", "async")}
    for reader in readers.values():
        reader.verify_all()
    reference = readers["by-rank"]
    assert reference.state_kinds == ["fp32", "exp_avg", "exp_avg_sq"]
    for name, reader in readers.items():
        for key in ("optimizer", "param_groups", "counters", "params", "world_size"):
            assert reader.manifest[key] == reference.manifest[key], (name, key)
        for kind in reference.state_kinds:
            for param in reference.params:
                assert torch.equal(reader.full(kind, param), reference.full(kind, param)), (name, kind, param)


def test_an_actor_written_checkpoint_continues_bitwise_at_the_same_and_another_world_size(saved, shared_ray):
    directory, ranks = saved
    same = run_ranks(_load_and_continue, 2, shared_ray.address, directory, [("by-actors", True)])[0]
    resumed = same[("by-actors", True)]
    assert resumed["tier"] == "ActorTier" and resumed["losses"] == ranks[0]["losses"]
    assert all(torch.equal(resumed["params"][k], v) for k, v in ranks[0]["params"].items())

    loads = [("by-rank", False), ("by-actors", False), ("by-actors", True)]
    other = run_ranks(_load_and_continue, 1, shared_ray.address, directory, loads)[0]
    reference = other[("by-rank", False)]
    assert other[("by-actors", True)]["tier"] == "ActorTier" and reference["tier"] == "LocalTier"
    for load in loads[1:]:
        assert other[load]["losses"] == reference["losses"], load
        assert all(torch.equal(other[load]["params"][k], v) for k, v in reference["params"].items()), load


def _interrupted_save(address: str, directory: str) -> dict:
    """Save at step 1; at step 2 an offload actor dies after the snapshot, before the write."""
    from raydeep.tier.actors import OffloadActorLost
    from tests.dist.workloads import run_steps

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        engine = _engine(actors=True)
        run_steps(engine, 1, 12)
        engine.save_checkpoint(directory)
        run_steps(engine, 2, 12, skip=1)
        take, victim = engine.tier.remote_snapshot, engine.tier.actors[1]

        def then_kill(ranges):
            snap = take(ranges)
            snap.state()  # both actors hold their copy
            ray.kill(victim, no_restart=True)
            return snap
        engine.tier.remote_snapshot = then_kill
        error = None
        try:
            engine.save_checkpoint(directory)
        except OffloadActorLost as err:
            error = str(err)
        engine.destroy()
        return {"error": error}
    finally:
        ray.shutdown()


def test_an_actor_lost_during_a_save_leaves_the_previous_checkpoint_whole(shared_ray, tmp_path):
    from raydeep.checkpoint import CheckpointReader

    out = run_ranks(_interrupted_save, 1, shared_ray.address, str(tmp_path))[0]
    assert out["error"] and "lost" in out["error"]
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert not (tmp_path / "global_step2").exists()  # never moved into place: no manifest, never loaded
    reader = CheckpointReader.open(str(tmp_path))
    reader.verify_all()
    assert reader.tag == "global_step1" and reader.manifest["counters"]["global_steps"] == 1
    assert any("-part" in name for name in reader.manifest["files"])
