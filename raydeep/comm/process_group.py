"""The process group as DeepSpeed's ``deepspeed.comm`` shows it to client scripts:
``init_distributed`` (torchrun's, Ray Train's or a one-process group), where a rank computes
(``rank_device``), and the queries and helpers scripts call (``get_rank``, ``get_world_size``,
``get_local_rank``, ``barrier``, ``is_initialized``, ``ReduceOp``, ...).

``raydeep.comm`` re-exports these, so ``import raydeep.comm as dist`` serves a script written for
``import deepspeed.comm as dist``. Its collectives (``all_reduce``, ``broadcast``, ...) count
bytes for the engine and take ``stats`` as their second positional argument: pass ``op=`` by
keyword, as DeepSpeed's own examples do, or call torch.distributed for anything else.

>>> get_rank(), get_world_size(), is_initialized()
(0, 1, False)
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (0 without a process group, as DeepSpeed's single process)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """The rank on this node, from ``LOCAL_RANK`` (torchrun and Ray Train set it)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_backend(group=None) -> str | None:
    return dist.get_backend(group) if is_initialized() else None


def barrier(group=None, async_op: bool = False, device_ids=None):
    """Wait for every rank of ``group``; nothing to wait for without a process group."""
    if not is_initialized():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    if is_initialized():
        dist.destroy_process_group(group)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta = timedelta(minutes=30), init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialise torch.distributed from the environment (torchrun, Ray Train, or one process).

    Without ``WORLD_SIZE`` in the environment this sets up a one-rank group, as DeepSpeed does
    for a script started with plain ``python``.
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    env = os.environ
    if world_size < 0:
        world_size = int(env.get("WORLD_SIZE", 1))
    if rank < 0:
        rank = int(env.get("RANK", 0))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(distributed_port))
    env.setdefault("LOCAL_RANK", env.get("LOCAL_RANK", "0"))
    backend = dist_backend or ("nccl" if wants_cuda(None) else "gloo")
    if "nccl" in backend:
        rank_device(backend)  # set this rank's device before the group: NCCL binds its communicator to it
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


def wants_cuda(backend: str | None) -> bool:
    """Whether a rank on ``backend`` computes on CUDA. The backend decides where there is one:
    gloo sends CPU tensors only (its point-to-point ops refuse CUDA ones), and gloo ranks that
    built on the GPU would all land on ``cuda:0``. Without a process group, CUDA where available
    unless ``DS_ACCELERATOR=cpu`` (DeepSpeed's override)."""
    if backend is not None:
        return "nccl" in backend
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "").lower() != "cpu"


def rank_device(backend: str | None = None) -> torch.device:
    """This rank's device, following ``backend`` (default: the process group's, if any):
    ``cuda:LOCAL_RANK`` for NCCL (made current), the CPU for gloo.

    >>> rank_device("gloo")
    device(type='cpu')
    """
    if backend is None and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
    if not wants_cuda(backend):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"raydeep: the process group's backend is {backend!r}, which needs a CUDA device, and "
                           "this process sees none; use backend 'gloo' on CPU-only machines")
    # Ray sets CUDA_VISIBLE_DEVICES per worker, so LOCAL_RANK indexes the visible devices.
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


