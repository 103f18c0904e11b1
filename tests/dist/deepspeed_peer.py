"""DeepSpeed itself as a peer: ``train_engine`` with ``deepspeed.initialize`` in place of raydeep.

Runs inside ``run_ranks`` ranks. DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) talks
gloo when oneCCL's PyTorch bindings are not installed, and ``deepspeed.initialize`` reuses the
process group the harness already initialised (RANK, LOCAL_RANK, WORLD_SIZE and MASTER_* are
set by the harness). fp32 only: the comparison is between fp32 AdamW runs.

DeepSpeed's CPU communication backend JIT-compiles a shared-memory all-reduce kernel when it
starts (minutes of C++ build on a small machine, and a compiler on the path). Only
``inference_all_reduce`` uses that kernel; training collectives go through torch.distributed,
so the peer skips the build.
"""
from __future__ import annotations

import copy
import importlib
import os
import warnings


from tests.dist.workloads import run_steps, tiny_gpt


def _import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    # DeepSpeed calls torch.distributed.reduce_scatter_tensor / all_gather_into_tensor, which
    # torch deprecates with a FutureWarning on every call.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    # importlib, not ``import deepspeed.comm.torch as m``: ``deepspeed.comm`` has an attribute
    # ``torch`` (the torch package) that shadows its submodule in that form.
    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None  # inference-only kernel; see the module docstring
    return deepspeed


def train_deepspeed(cfg: dict, steps: int, global_batch: int) -> dict:
    """Train with DeepSpeed on this rank exactly as ``train_engine`` trains with raydeep: same
    model init, same slicing of each global batch, same config; per-step losses averaged over
    the ranks, and the full fp32 parameters after the last step."""

    deepspeed = _import_deepspeed()
    model = tiny_gpt()
    # DeepSpeed pops keys (torch_adam, ...) from the optimizer params: give it its own copy.
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg))
    losses = run_steps(engine, steps, global_batch)
    params = list(model.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    else:
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    optimizer = engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    out = {"losses": losses, "params": full, "optimizer": type(inner).__name__,
           "zero_optimizer": type(optimizer).__name__}
    engine.destroy()
    return out


def stage_sweep(trainer: str, stages: list[int], steps: int, micro: int, gas: int, clip: float) -> dict:
    """``train_engine`` (trainer ``"raydeep"``) or ``train_deepspeed`` (``"deepspeed"``) for each
    ZeRO stage on this rank, in one process group; keyed by stage."""
    import torch.distributed as dist

    from tests.dist.workloads import config, train_engine

    train = {"raydeep": train_engine, "deepspeed": train_deepspeed}[trainer]
    global_batch = micro * gas * dist.get_world_size()
    return {stage: train(config(stage, gas, micro, clip), steps, global_batch) for stage in stages}
