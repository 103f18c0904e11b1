"""Rank/device mapping on GPU comes from Ray (run with ``-m gpu`` where CUDA is available).

Ray Train gives each worker one GPU, lists the node's GPUs in ``CUDA_VISIBLE_DEVICES`` (sorted,
shared by the node's workers) and orders local ranks by GPU id; the engine must then train on
exactly the GPU Ray assigned: ``CUDA_VISIBLE_DEVICES[LOCAL_RANK]`` is the worker's GPU id.
"""
from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def report_device(config: dict) -> None:
    import os

    import ray
    import ray.train
    import torch.distributed as dist

    import raydeep

    context = ray.train.get_context()
    engine, *_ = raydeep.initialize(model=torch.nn.Linear(8, 8), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    record = {"rank": context.get_world_rank(), "local_rank": context.get_local_rank(),
              "env_local_rank": int(os.environ["LOCAL_RANK"]), "visible": os.environ["CUDA_VISIBLE_DEVICES"],
              "ray_gpu_ids": [str(g) for g in ray.get_gpu_ids()], "current": torch.cuda.current_device(),
              "engine_device": str(engine.device), "backend": dist.get_backend(), "node": context.get_node_rank()}
    with open(os.path.join(config["out"], f"rank{record['rank']}.json"), "w") as fh:
        json.dump(record, fh)


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_gpus=torch.cuda.device_count(), num_cpus=4)
    yield min(torch.cuda.device_count(), 2)
    ray.shutdown()


def test_each_rank_trains_on_the_gpu_ray_assigned(gpu_ray, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(report_device, train_loop_config={"out": str(tmp_path)},
                 scaling_config=ScalingConfig(num_workers=gpu_ray, use_gpu=True),
                 run_config=RunConfig(storage_path=str(tmp_path), name="devices")).fit()
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(gpu_ray)]
    for r in records:
        visible = r["visible"].split(",")
        assert r["env_local_rank"] == r["local_rank"] and r["backend"] == "nccl"
        assert visible[r["local_rank"]] == r["ray_gpu_ids"][0]  # LOCAL_RANK indexes Ray's GPU
        assert r["current"] == r["local_rank"] and r["engine_device"] == f"cuda:{r['local_rank']}"
    assert len({(r["node"], r["ray_gpu_ids"][0]) for r in records}) == gpu_ray  # one GPU per rank


def test_a_short_run_on_gpus(gpu_ray, tmp_path):
    from raydeep.ray import TrainSpec, fit

    summary = fit(TrainSpec(num_workers=gpu_ray, use_gpu=True, steps=4, checkpoint_every=2,
                            storage_path=str(tmp_path), name="gpu"))
    assert summary["global_steps"] == 4 and summary["final_loss"] < summary["first_loss"]
