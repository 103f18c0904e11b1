"""The contenders of ``raydeep bench``, each built on the same model init in one process group.

A :class:`Contender` runs one optimizer step over a list of micro-batches and returns this rank's
mean loss over them; after a step it can say how many bytes of model states (parameters,
gradients, fp32 masters, optimizer states) this rank holds, which the report sets against the
ZeRO formula of its stage. Every one trains the same fp32 AdamW with clipping at 1.0:

==================  =====  ==========================================================================
name                stage  what
==================  =====  ==========================================================================
raydeep zN          0-3    ``raydeep.initialize`` on the shared ds_config (``overlap`` on or off)
DeepSpeed zN        0-3    ``deepspeed.initialize`` on the same ds_config (``torch_adam``)
DDP                 0      ``DistributedDataParallel``, ``no_sync`` over the accumulation
torch ZeRO-1        1      DDP with ``ZeroRedundancyOptimizer`` (optimizer states sharded)
FSDP2 grad-op       2      ``fully_shard(reshard_after_forward=False)``: ZeRO-2's layout
FSDP2               3      ``fully_shard`` per block and the root: ZeRO-3's layout
==================  =====  ==========================================================================
"""
from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


@dataclass
class Contender:
    name: str
    family: str  # raydeep, deepspeed, ddp, torch-zero, fsdp2
    stage: int  # the ZeRO stage whose layout it has
    step: Callable[[list], float]
    state_bytes: Callable[[], int | None] = lambda: None
    comm_bytes: Callable[[], int | None] = lambda: None  # cumulative bytes this rank moved (raydeep)
    blocked_s: Callable[[], float | None] = lambda: None  # cumulative seconds blocked on collectives (raydeep)
    engine: object = field(default=None, repr=False)


def ds_config(micro_batch: int, gas: int, stage: int, bucket: int, overlap: bool | None,
              deepspeed: bool = False, dtype: str = "fp32", lr: float = LR) -> dict:
    """The one ds_config raydeep and DeepSpeed read (the torch peers use its batch, clip and
    optimizer). DeepSpeed's also bounds its all-gather buckets by ``bucket``; raydeep all-gathers
    each unit whole (and would warn that the key has no effect). ``dtype="bf16"`` turns on
    ``bf16`` (bf16 weights and communication, fp32 masters)."""
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if deepspeed:
        zero["allgather_bucket_size"] = bucket
    if overlap is not None:  # None: the engine's default
        zero["overlap_comm"] = overlap
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas,
            "gradient_clipping": CLIP, **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
            "zero_optimization": zero}


def _nbytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds its shard only
        total += local.numel() * local.element_size()
    return total


def _optimizer_state_bytes(state: dict) -> int:
    return _nbytes(v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def model_state_bytes(engine) -> int:
    """What a raydeep engine holds of the ZeRO formula's model states (no buffers, no activations)."""
    memory = engine.memory_breakdown()
    return sum(memory[k] for k in ("params", "grads", "master", "optimizer_states"))


def _engine_step(engine) -> Callable[[list], float]:
    """DeepSpeed's loop (raydeep's is the same): backward and step after every micro-batch."""

    def step(micro_batches) -> float:
        total = 0.0
        for x, y in micro_batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / len(micro_batches)
    return step


def raydeep_contender(model, cfg: dict, stage: int, overlap: bool | None, variant: str = "") -> Contender:
    import raydeep

    engine, *_ = raydeep.initialize(model=model, config=cfg)
    suffix = (" overlap" if overlap else "") + (f" {variant}" if variant else "")
    return Contender(f"raydeep z{stage}{suffix}", "raydeep", stage, _engine_step(engine), lambda: model_state_bytes(engine),
                     lambda: sum(op["bytes"] for op in engine.comm_stats().values()),
                     lambda: sum(op["blocked_s"] for op in engine.comm_stats().values()), engine)


def deepspeed_contender(model, cfg: dict, stage: int) -> Contender:
    deepspeed = import_deepspeed()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    return Contender(f"DeepSpeed z{stage}", "deepspeed", stage, _engine_step(engine), engine=engine)


def import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # The CPU backend JIT-compiles a shared-memory all-reduce used only for inference; skip it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def _torch_step(model, optimizer, micro_batches, no_sync, autocast: bool = False) -> float:
    """Accumulate over the micro-batches (gradients synchronised on the last only), clip, step.
    ``autocast``: the forward under ``torch.autocast`` in bf16 (torch's bf16 recipe for fp32 weights)."""
    total = 0.0
    for k, (x, y) in enumerate(micro_batches):
        with no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return total / len(micro_batches)


def ddp_contender(model, bucket: int, zero_optimizer: bool = False, bf16: bool = False, lr: float = LR) -> Contender:
    """DDP (or DDP with ZeRO-1's optimizer) on fp32 weights; ``bf16``: its forward autocast to bf16."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket * 4 / 2**20)
    if zero_optimizer:
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                                            weight_decay=WEIGHT_DECAY)
        states = lambda: optimizer.optim.state  # noqa: E731 - the shard this rank updates
    else:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
        states = lambda: optimizer.state  # noqa: E731
    held = {}

    def step(micro_batches) -> float:
        loss = _torch_step(ddp, optimizer, micro_batches, ddp.no_sync, autocast=bf16)
        held["bytes"] = (_nbytes(p for p in model.parameters()) + _nbytes(p.grad for p in model.parameters())
                         + _optimizer_state_bytes(states()))
        optimizer.zero_grad(set_to_none=True)
        return loss

    name, family, stage = ("torch ZeRO-1", "torch-zero", 1) if zero_optimizer else ("DDP", "ddp", 0)
    return Contender(name, family, stage, step, lambda: held.get("bytes"))


def fsdp2_contender(model, world: int, reshard_after_forward: bool, bf16: bool = False,
                    lr: float = LR) -> Contender:
    """FSDP2; ``bf16``: its mixed-precision policy with bf16 parameters and gradient reduction
    (fp32 sharded weights), what DeepSpeed's bf16 does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.blocks:  # one unit per block, like raydeep's and DeepSpeed's stage 3
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    held = {}

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def step(micro_batches) -> float:
        loss = _torch_step(model, optimizer, micro_batches, no_sync)
        held["bytes"] = (_nbytes(p for p in model.parameters()) + _nbytes(p.grad for p in model.parameters())
                         + _optimizer_state_bytes(optimizer.state))
        optimizer.zero_grad(set_to_none=True)
        return loss

    name, stage = ("FSDP2", 3) if reshard_after_forward else ("FSDP2 grad-op", 2)
    return Contender(name, "fsdp2", stage, step, lambda: held.get("bytes"))
