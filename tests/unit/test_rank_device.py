"""The rank's device follows the process group's backend, checked on a CPU-only machine that
pretends to have two GPUs (``torch.cuda.is_available`` patched true).

The bug this guards: the device used to be ``cuda`` whenever CUDA was available, whatever the
backend, so gloo ranks on a GPU machine all built on ``cuda:0`` and handed CUDA tensors to gloo's
point-to-point sends (which refuse them).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import raydeep
from raydeep import comm
from raydeep.engine.api import rank_device


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """CUDA 'available' with two devices; ``set_device`` records instead of touching a driver."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    return chosen


def test_gloo_ranks_stay_on_the_cpu_and_never_pick_a_gpu(two_fake_gpus):
    assert rank_device("gloo") == torch.device("cpu")
    assert two_fake_gpus == []


def test_nccl_ranks_take_the_local_rank_s_gpu(two_fake_gpus):
    assert rank_device("nccl") == torch.device("cuda", 1)
    assert rank_device("cpu:gloo,cuda:nccl") == torch.device("cuda", 1)
    assert two_fake_gpus == [1, 1]


def test_without_a_group_cuda_where_available_unless_ds_accelerator_says_cpu(two_fake_gpus, monkeypatch):
    assert not dist.is_initialized()
    assert rank_device() == torch.device("cuda", 1)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert rank_device() == torch.device("cpu")


def test_nccl_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="backend is 'nccl', which needs a CUDA device"):
        rank_device("nccl")


@pytest.fixture
def gloo_world_of_one(monkeypatch):
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")  # every collective runs, through gloo
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 3])
def test_an_engine_on_a_gloo_group_builds_and_steps_on_the_cpu(two_fake_gpus, gloo_world_of_one, stage):
    """With CUDA 'available', ``raydeep.initialize`` on a gloo group builds on the CPU: no device is
    made current, and a step's reduce-scatter and all-gather (gloo exchanges) get CPU tensors. On
    the old rule this fails at once (the model moved to ``cuda:0`` on a CPU-only torch)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = raydeep.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert engine.device == torch.device("cpu") and two_fake_gpus == []
    loss = engine(torch.ones(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1 and {p.device.type for p in model.parameters()} == {"cpu"}
    assert engine.comm_stats()["all_gather"]["bytes"] > 0  # the exchanges ran


def test_a_cuda_tensor_never_reaches_gloo(fake_cuda):
    """The collectives' guard, for any code path that still made a CUDA tensor on a gloo rank:
    named before gloo's ``isend`` would fail on it."""
    with fake_cuda:
        t = torch.empty(6, device="cuda")
    with pytest.raises(RuntimeError, match=r"reduce_scatter of a cuda tensor \(6,\) torch.float32 on a gloo "
                                           r"process group, which takes cpu tensors"):
        comm.check_device("reduce_scatter", t, "gloo")


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()
