"""The engine on CUDA with NCCL: parity, precision and device mapping (run with ``-m gpu``).

``RAYDEEP_COLLECTIVES_AT_WORLD_1=1`` for every test: on a machine with one GPU the one rank runs
every collective through NCCL (a one-rank NCCL group works; two ranks cannot share a device), so
the device discipline of each collective's tensors is exercised even at world size 1.

Every check holds the GPU run to a CPU oracle with a bound from the arithmetic: fp32 against the
per-element bounds of ``tests/dist/test_parity.py`` (the float64 reference and its rounding probe),
half precision against the float64 reference on a repeated batch (its loss falls by many units of
half precision's rounding in five steps, so a run that does not train cannot pass).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist import test_parity as parity
from tests.dist.harness import run_ranks
from tests.dist.workloads import config, run_steps, sweep, tiny_gpt, train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
STEPS, MICRO = 5, 4
MANTISSA_BITS = {"bf16": 7, "fp16": 10}


@pytest.fixture(autouse=True)
def collectives_at_world_one(monkeypatch):
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")


def world() -> int:
    return min(2, torch.cuda.device_count())  # NCCL needs one device per rank


def _exact_fp32() -> None:
    """No TF32: the oracle's bounds are for fp32 arithmetic (TF32 keeps 10 mantissa bits)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def parity_sweep_on_gpu(combos: list) -> dict:
    """``test_parity``'s sweep on this rank's GPU, with the parameters brought to the host."""
    _exact_fp32()
    out = sweep(combos, parity.STEPS, parity.MICRO)
    for result in out.values():
        result["params"] = {n: t.cpu() for n, t in result["params"].items()}
    return out


@pytest.fixture(scope="module")
def parity_references() -> dict:
    return parity.references(world(), 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_parity_with_the_float64_reference(stage, parity_references):
    combos = [(stage, 1, clip) for clip in (parity_references["clip"], 0.0)]
    results = run_ranks(parity_sweep_on_gpu, world(), combos, backend="nccl")
    failures = []
    for combo in combos:
        used, errors = parity.check([r[combo] for r in results], parity_references[combo[2]])
        print(f"stage {stage} clip {combo[2]:g}: largest fraction of a bound used {used}")
        failures += [f"clip {combo[2]:g}: {e}" for e in errors]
    assert not failures, "\n".join(failures)


def half_precision_on_gpu(stage: int, precision: str) -> dict:
    import raydeep

    _exact_fp32()
    cfg = config(stage, 1, MICRO, 1.0)
    # fp16: a start scale the tiny model's gradients cannot overflow, so no step is skipped and
    # every step can be compared with the reference's.
    cfg[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=cfg)
    losses = run_steps(engine, STEPS, MICRO * torch.distributed.get_world_size(), repeat=True)
    return {"losses": losses, "skipped": engine.skipped_steps}


def loss_rounding(loss: float, precision: str) -> float:
    """One unit in the last place of ``loss`` in ``precision``."""
    return 2.0 ** (math.floor(math.log2(abs(loss))) - MANTISSA_BITS[precision])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_follows_the_float64_reference(precision):
    """The half-precision run computes the forward in 8 (bf16) or 11 (fp16) significant bits and
    keeps fp32 masters: its loss differs from exact arithmetic's by about the rounding of the loss
    itself in that precision, and Adam's fp32 steps (lr 1e-3, five of them) do not let that grow.
    One unit in the last place of each loss is the bound; on the CPU the measured differences are
    about a tenth of it. The reference's loss falls by more than eight such units, so a run that
    never updates (or updates wrongly) fails from the second step on."""
    got = run_ranks(half_precision_on_gpu, world(), 3, precision, backend="nccl")[0]
    ref = train_reference(STEPS, MICRO * world(), 1.0, torch.float64, repeat=True)["losses"]
    bound = [loss_rounding(r, precision) for r in ref]
    print(f"{precision}: losses {got['losses']}, reference {ref}")
    assert got["skipped"] == 0
    assert ref[0] - ref[-1] > 8 * max(bound), "the reference does not train: the comparison would show nothing"
    for step, (a, b, tol) in enumerate(zip(got["losses"], ref, bound)):
        assert abs(a - b) <= tol, f"step {step}: {precision} loss {a:.6f}, float64 reference {b:.6f}, bound {tol:.2e}"


def devices_on_gpu() -> dict:
    """Where each part of a stage-2 engine lives after a step: parameters, gradient shards, the
    fp32 masters and Adam's states."""
    import os

    import raydeep

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=config(2, 1, MICRO, 1.0))
    run_steps(engine, 1, MICRO * torch.distributed.get_world_size())
    optimizer = engine.tier.torch_optimizer
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    states = [t for p in masters for t in optimizer.state[p].values() if torch.is_tensor(t) and t.dim() > 0]
    held = {"parameters": list(engine.module.parameters()), "gradient shards": engine.strategy.grad_shards(),
            "masters": masters, "optimizer states": states}
    return {"device": str(engine.device), "local_rank": int(os.environ["LOCAL_RANK"]),
            "current": torch.cuda.current_device(),
            "held": {what: sorted({str(t.device) for t in tensors if t is not None}) for what, tensors in held.items()}}


def test_rank_owns_its_device():
    """Each rank's engine, and everything it holds, on ``cuda:LOCAL_RANK``: fails for an engine
    that picked the CPU (or another GPU), or a tier that left its masters or states in host memory."""
    results = run_ranks(devices_on_gpu, world(), backend="nccl")
    for r in results:
        mine = f"cuda:{r['local_rank']}"
        assert r["device"] == mine and r["current"] == r["local_rank"], r
        assert r["held"] == {what: [mine] for what in r["held"]}, r


def zero_init_on_gpu(remote_device) -> dict:
    """A model built on the CPU under zero.Init (slices kept in host memory with
    ``remote_device="cpu"``): its broadcast and all-gathers go through the rank's GPU."""
    import raydeep
    from raydeep import comm

    _exact_fp32()
    cfg = config(3, 1, MICRO, 1.0)
    with raydeep.zero.Init(remote_device=remote_device):
        model = tiny_gpt()
    devices = sorted({p.ds_tensor.device.type for p in model.parameters()})
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    return {"losses": run_steps(engine, STEPS, MICRO * comm.world_size()), "slice_devices": devices}


def test_zero_init_partitions_built_on_the_cpu_meet_nccl_on_the_gpu():
    """Where the slices wait between steps changes no arithmetic; the two runs differ only where
    CUDA's atomics reorder a sum (a few fp32 ulps of a loss near 5.5, ulp 4.8e-7): rel 1e-5 is
    about a hundred of them, and far below what a wrong slice would change."""
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
    files are device-independent, so two gloo ranks on the CPU resume them at another stage. The
    gloo ranks build on the CPU although this machine has CUDA: the device follows the backend."""
    saved = run_ranks(save_on_gpu, world(), str(tmp_path), backend="nccl")[0]
    loaded = run_ranks(load_on_cpu, 2, str(tmp_path))
    assert all(r["steps"] == saved["steps"] == 2 and r["device"] == "cpu" for r in loaded)
