"""``deepspeed.comm``: DeepSpeed's communication functions over torch.distributed.

Process-group set-up and queries are raydeep's (:mod:`raydeep.comm.process_group`, which
initialises gloo or NCCL as raydeep places ranks). The collectives keep DeepSpeed's signatures and
call torch.distributed, as DeepSpeed's own do; DeepSpeed's profiling keywords (``prof``,
``log_name``, ``debug``) are accepted and ignored: raydeep's comms logger counts the engine's
collectives, not a client's.
"""
import functools

import torch.distributed as _dist

from raydeep.comm.process_group import (ReduceOp, barrier, destroy_process_group, get_backend, get_global_rank,
                                        get_local_rank, get_rank, get_world_size, init_distributed, is_initialized,
                                        new_group)

_PROFILING = ("prof", "log_name", "debug")


def _torch(name: str):
    collective = getattr(_dist, name)

    @functools.wraps(collective)
    def call(*args, **kwargs):
        for key in _PROFILING:
            kwargs.pop(key, None)
        return collective(*args, **kwargs)
    return call


all_reduce = _torch("all_reduce")
broadcast = _torch("broadcast")
all_gather = _torch("all_gather")
all_gather_into_tensor = _torch("all_gather_into_tensor")
reduce_scatter_tensor = _torch("reduce_scatter_tensor")
all_to_all_single = _torch("all_to_all_single")
reduce = _torch("reduce")
gather = _torch("gather")
scatter = _torch("scatter")
send, recv, isend, irecv = _torch("send"), _torch("recv"), _torch("isend"), _torch("irecv")


def is_available() -> bool:
    return _dist.is_available()


def get_world_group():
    return _dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    return _dist.get_process_group_ranks(group or _dist.group.WORLD)


__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier",
           "broadcast", "destroy_process_group", "gather", "get_all_ranks_from_group", "get_backend",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed",
           "irecv", "is_available", "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter_tensor",
           "scatter", "send"]
