"""Run a function on N gloo ranks in spawned processes and collect each rank's result."""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, args, queue, backend="gloo"):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            # Serialise to bytes: tensors sent through a Queue would point at the child's
            # shared memory, which disappears when the child exits.
            buffer = io.BytesIO()
            torch.save(fn(*args), buffer)
            queue.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report the failure to the parent instead of hanging it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 600, backend: str = "gloo") -> list:
    """``fn(*args)`` on every rank of a fresh process group; returns results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
