"""An asynchronous save holds exactly the state of the step it was called after, even though
its copy runs beside the next forward and backward; ranks that disagree on the tag are caught
by the save's own coordination."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from raydeep.checkpoint import CheckpointReader
from raydeep.checkpoint import format as fmt
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow


def async_vs_sync(directory: str, stage: int, slow_copy_s: float) -> int:
    """Train 2 steps, save synchronously to ``sync/`` and asynchronously to ``async/``, then
    train 2 more steps at once. The background copy is held back by ``slow_copy_s``, so without
    the engine's fence the optimizer step would reach the states before the copy did."""
    from raydeep.checkpoint import snapshot
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, build
    from tests.dist.workloads import run_steps

    copy = snapshot.RankSnapshot.copy_tensors

    def slow_copy(self):
        time.sleep(slow_copy_s)
        copy(self)
    # Restored after: the pooled rank (tests.dist.harness) runs later workloads, whose saves
    # would each sleep too (and a second call would wrap the slow copy in another sleep).
    snapshot.RankSnapshot.copy_tensors = slow_copy
    try:
        engine = build(stage)
        run_steps(engine, 2, GLOBAL_BATCH)
        engine.save_checkpoint(f"{directory}/sync")
        engine.save_checkpoint(f"{directory}/async", async_save=True)
        run_steps(engine, 4, GLOBAL_BATCH, skip=2)
        engine.destroy()
    finally:
        snapshot.RankSnapshot.copy_tensors = copy
    return engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_async_save_holds_the_state_of_its_step(tmp_path, stage):
    steps = run_ranks(async_vs_sync, 2, str(tmp_path), stage, 0.5)
    assert steps == [4, 4]
    sync, later = CheckpointReader.open(str(tmp_path / "sync")), CheckpointReader.open(str(tmp_path / "async"))
    assert sync.tag == later.tag == "global_step2"
    later.verify_all()
    for name in sync.manifest["files"]:
        a, b = sync.storage.read(f"{sync.tag}/{name}"), later.storage.read(f"{later.tag}/{name}")
        assert a == b, f"{name}: the async save differs from the sync save of the same step"
    assert sync.manifest["counters"] == later.manifest["counters"]
    assert sync.manifest["rng"] == later.manifest["rng"]


def save_with_rank_tags(directory: str, mode: str):
    import raydeep
    from raydeep import comm
    from raydeep.errors import CheckpointError
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, layout_config
    from tests.dist.workloads import run_steps, tiny_gpt

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("raydeep").addHandler(handler)
    try:
        config = layout_config(2, comm.world_size())
        config["checkpoint"] = {"tag_validation": mode}
        engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config)
        run_steps(engine, 1, GLOBAL_BATCH)
        try:
            engine.save_checkpoint(directory, tag=f"mine{comm.rank()}", async_save=True)
            engine.wait_for_checkpoint()
        except CheckpointError as err:
            return {"error": str(err)}
        return {"error": None, "warnings": [r for r in records if "differs" in r]}
    finally:
        logging.getLogger("raydeep").removeHandler(handler)  # the pooled rank runs other workloads


def test_tag_mismatch_fails_every_rank_in_fail_mode(tmp_path):
    results = run_ranks(save_with_rank_tags, 2, str(tmp_path), "Fail")
    for result in results:
        assert "checkpoint tag differs across ranks: ['mine0', 'mine1']" in result["error"]
    assert not (tmp_path / fmt.LATEST).exists()  # nothing was committed


def test_tag_mismatch_in_warn_mode_saves_one_whole_checkpoint(tmp_path):
    results = run_ranks(save_with_rank_tags, 2, str(tmp_path), "Warn")
    assert results[0]["error"] is None and results[1]["error"] is None
    assert any("saving every rank's files under rank 0's tag 'mine0'" in w for w in results[0]["warnings"])
    reader = CheckpointReader.open(str(tmp_path))
    assert reader.tag == "mine0"
    reader.verify_all()
    assert sorted(reader.manifest["files"]) == [fmt.EXTRA_FILE, fmt.rank_file(0, 2), fmt.rank_file(1, 2)]
    for name in reader.params:  # every element of every parameter is in the one tag
        assert torch.isfinite(reader.full(fmt.MASTER, name)).all()


def save_losing_an_offload_actor(directory: str) -> dict:
    """Rank 1 loses an offload actor while the ranks write their files: what each rank raises."""
    import raydeep
    from raydeep import comm
    from raydeep.checkpoint import snapshot
    from raydeep.tier.actors import OffloadActorLost
    from tests.dist.checkpoint_workloads import GLOBAL_BATCH, layout_config
    from tests.dist.workloads import run_steps, tiny_gpt

    write_remote = snapshot.RankSnapshot.write_remote

    def lost(self, *args):
        raise OffloadActorLost("an offload actor of this rank was lost (ActorDiedError)")
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=layout_config(2, comm.world_size()))
    run_steps(engine, 1, GLOBAL_BATCH)
    if comm.rank() == 1:
        snapshot.RankSnapshot.write_remote = lost
    try:
        engine.save_checkpoint(directory, async_save=True)
        engine.wait_for_checkpoint()
    except Exception as err:  # noqa: BLE001 - what each rank raises is the result
        return {"type": [t.__name__ for t in type(err).__mro__], "message": str(err)}
    finally:
        snapshot.RankSnapshot.write_remote = write_remote  # the pooled rank runs other workloads
    return {"type": None}


def test_a_lost_offload_actor_fails_the_save_as_a_loss_on_every_rank(tmp_path):
    """A loss is retried by Ray Train (the attempt resumes from the newest state), never reported
    as a deterministic checkpoint error: not on the rank that lost its actor, nor on the others."""
    rank0, rank1 = run_ranks(save_losing_an_offload_actor, 2, str(tmp_path))
    assert rank1["type"][0] == "OffloadActorLost"
    assert rank0["type"][0] == "LostResource" and rank0["message"].startswith("checkpoint write failed: rank 1: ")
    for rank in (rank0, rank1):
        assert "LostResource" in rank["type"] and "RaydeepError" not in rank["type"]
    assert not (tmp_path / fmt.LATEST).exists()  # nothing was committed
