"""The engine on CUDA with NCCL: parity, precision and device mapping (run with ``-m gpu``).

``RAYDEEP_COLLECTIVES_AT_WORLD_1=1`` for every test: on a machine with one GPU the one rank runs
every collective through NCCL (a one-rank NCCL group works; two ranks cannot share a device), so
the device discipline of each collective's tensors is exercised even at world size 1.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, run_steps, tiny_gpt, train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS, MICRO = 5, 4


@pytest.fixture(autouse=True)
def collectives_at_world_one(monkeypatch):
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")


def world() -> int:
    return min(2, torch.cuda.device_count())  # NCCL needs one device per rank


def train_on_gpu(stage: int, precision: str) -> dict:
    import os

    import raydeep
    from raydeep.zero import GatheredParameters

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = config(stage, 1, MICRO, 1.0)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    losses = run_steps(engine, STEPS, MICRO * torch.distributed.get_world_size())
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "device": str(engine.device),
            "local_rank": int(os.environ["LOCAL_RANK"]), "current": torch.cuda.current_device()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parity_with_cpu_reference(stage):
    got = run_ranks(train_on_gpu, world(), stage, "fp32", backend="nccl")[0]
    ref = train_reference(STEPS, MICRO * world(), 1.0)
    worst = max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"])
    print(f"stage {stage}: max |dθ| vs CPU reference {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_trains(precision):
    got = run_ranks(train_on_gpu, world(), 3, precision, backend="nccl")[0]
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    assert got["losses"][-1] < got["losses"][0]


def test_rank_owns_its_device():
    results = run_ranks(train_on_gpu, world(), 2, "fp32", backend="nccl")
    for r in results:
        assert r["device"] == f"cuda:{r['local_rank']}" and r["current"] == r["local_rank"]


def zero_init_on_gpu(remote_device) -> dict:
    """A model built on the CPU under zero.Init (slices kept in host memory with
    ``remote_device="cpu"``): its broadcast and all-gathers go through the rank's GPU."""
    import raydeep
    from raydeep import comm

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = config(3, 1, MICRO, 1.0)
    with raydeep.zero.Init(remote_device=remote_device):
        model = tiny_gpt()
    devices = sorted({p.ds_tensor.device.type for p in model.parameters()})
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    return {"losses": run_steps(engine, STEPS, MICRO * comm.world_size()), "slice_devices": devices}


def test_zero_init_partitions_built_on_the_cpu_meet_nccl_on_the_gpu():
    host = run_ranks(zero_init_on_gpu, world(), "cpu", backend="nccl")[0]
    plain = run_ranks(zero_init_on_gpu, world(), None, backend="nccl")[0]
    assert host["slice_devices"] == ["cpu"]
    assert host["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def save_on_gpu(path: str) -> dict:
    import raydeep
    from raydeep import comm

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(2, 1, MICRO, 1.0))
    run_steps(engine, 2, MICRO * comm.world_size())
    engine.save_checkpoint(path, tag="gpu")
    return {"steps": engine.global_steps}


def load_on_cpu(path: str) -> dict:
    import raydeep

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(3, 1, MICRO, 1.0))
    engine.load_checkpoint(path, tag="gpu")
    return {"steps": engine.global_steps, "device": str(engine.device)}


def test_a_checkpoint_saved_on_cuda_loads_on_cpu_at_another_world_size(tmp_path):
    """The save stages device state through host memory (a CUDA tensor has no ``.numpy()``); the
    files are device-independent, so two gloo ranks on the CPU resume them at another stage."""
    saved = run_ranks(save_on_gpu, world(), str(tmp_path), backend="nccl")[0]
    loaded = run_ranks(load_on_cpu, 2, str(tmp_path))
    assert all(r["steps"] == saved["steps"] == 2 and r["device"] == "cpu" for r in loaded)
