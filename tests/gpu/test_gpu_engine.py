"""The engine on CUDA with NCCL: parity, precision and device mapping (run with ``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, run_steps, tiny_gpt, train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS, MICRO = 5, 4


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
