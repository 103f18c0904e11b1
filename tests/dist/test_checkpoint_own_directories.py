"""Ranks that save to directories of their own, as Ray's DeepSpeed example does (each Ray Train
worker calls ``model.save_checkpoint(tmpdir)`` on its own temporary directory and
``ray.train.report`` gathers them into one checkpoint): each rank's files end up committed in its
own directory, and the directories put together load like a save to one shared directory.

Before, rank 0 alone moved the staging directory into place, so another rank's shard stayed in
``.global_step0.staging`` of its own directory and the gathered checkpoint missed it.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.slow


def _save_both_ways(root: str) -> dict:
    import torch.distributed as dist

    import raydeep
    from raydeep.ray.weights import consolidated_fp32
    from tests.dist.workloads import config, run_steps, tiny_gpt

    rank = dist.get_rank()
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(2, 1, 2, 1.0))
    run_steps(engine, 2, 2 * dist.get_world_size())
    engine.save_checkpoint(os.path.join(root, f"own{rank}"), client_state={"epoch": 3})  # a directory per rank
    engine.save_checkpoint(os.path.join(root, "shared"), client_state={"epoch": 3})
    return {"params": consolidated_fp32(engine)}


def _load(directory: str) -> dict:
    import raydeep
    from raydeep.ray.weights import consolidated_fp32
    from tests.dist.workloads import config, tiny_gpt

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(2, 1, 2, 1.0))
    path, client_state = engine.load_checkpoint(directory)
    return {"path": path, "client_state": client_state, "params": consolidated_fp32(engine),
            "global_steps": engine.global_steps}


def test_directories_of_their_own_gather_into_one_checkpoint(tmp_path):
    saved = run_ranks(_save_both_ways, 2, str(tmp_path))
    own0, own1 = tmp_path / "own0", tmp_path / "own1"
    assert sorted(os.listdir(own1)) == ["global_step2"]  # committed, no staging left; `latest` is rank 0's
    assert sorted(os.listdir(own1 / "global_step2")) == ["rank00001-of-00002.safetensors"]
    shared = sorted(os.listdir(tmp_path / "shared" / "global_step2"))
    assert sorted(os.listdir(own0 / "global_step2")) == [n for n in shared if n != "rank00001-of-00002.safetensors"]
    # Put the directories together as ray.train.report does, then load on 2 ranks and on 1.
    merged = tmp_path / "merged"
    for own in (own0, own1):
        shutil.copytree(own, merged, dirs_exist_ok=True)
    for name in shared:
        assert (merged / "global_step2" / name).read_bytes() == \
            (tmp_path / "shared" / "global_step2" / name).read_bytes(), name
    for world in (2, 1):
        for result in run_ranks(_load, world, str(merged)):
            assert result["client_state"]["epoch"] == 3 and result["global_steps"] == 2
            for name, value in saved[0]["params"].items():
                assert torch.equal(result["params"][name], value), name
