"""Run a function on N gloo ranks in spawned processes and collect each rank's result.

Starting a process that imports torch costs seconds on a 2-core machine, and the suite runs
dozens of multi-rank workloads, so the ranks live in a pool, one per (world size, backend),
reused from test to test. Each call gets a fresh process group (a new port), the caller's
environment variables as they are at the call, and the default dtype and thread count reset, so a
workload sees what a newly spawned rank would. A rank that imported DeepSpeed retires after its
call (DeepSpeed caches process groups in module globals), ``fresh=True`` asks for new processes
(a workload that must run before anything imports raydeep), and a failed or hung call ends its
pool; the next call starts a new one.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import traceback

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(fn, rank: int, world: int, port: int, args: tuple, backend: str, env: dict) -> tuple:
    """One workload on this rank in a new process group: (rank, "ok", bytes) or (rank, "error", text)."""
    saved_env = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        try:
            # Serialise to bytes: tensors sent through a Queue would point at the child's
            # shared memory, which disappears when the child exits.
            buffer = io.BytesIO()
            torch.save(fn(*args), buffer)
            return rank, "ok", buffer.getvalue()
        finally:
            dist.destroy_process_group()
    except BaseException:  # report the failure to the parent instead of hanging it
        return rank, "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def _serve(rank: int, world: int, backend: str, inbox, results) -> None:
    """A pooled rank: run each job it is sent until it is sent None."""
    import sys

    while (job := inbox.get()) is not None:
        fn, args, port, env = job
        result = _run_one(fn, rank, world, port, args, backend, env)
        # DeepSpeed's module globals hold this call's process groups: the next call needs a new rank.
        retiring = "deepspeed" in sys.modules
        results.put((*result, retiring))
        if retiring:
            return


class _RankPool:
    def __init__(self, world: int, backend: str):
        ctx = mp.get_context("spawn")
        self.world, self.results, self.retired = world, ctx.Queue(), False
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_serve, args=(r, world, backend, self.inboxes[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return not self.retired and all(p.is_alive() for p in self.procs)

    def run(self, fn, args: tuple, timeout: float) -> list:
        port, env = free_port(), dict(os.environ)
        for inbox in self.inboxes:
            inbox.put((fn, args, port, env))
        results = {}
        for _ in range(self.world):
            try:
                rank, status, value, retiring = self.results.get(timeout=timeout)
                self.retired |= retiring
            except queue_module.Empty:
                raise RuntimeError(f"{fn.__name__} on {self.world} ranks: no result within {timeout} s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_pools: dict[tuple[int, str], _RankPool] = {}


def _shared_pool(key: tuple[int, str]) -> _RankPool:
    pool = _pools.get(key)
    if pool is None or not pool.alive():  # first use, or its ranks retired after DeepSpeed
        if pool is not None:
            pool.close()
        pool = _pools[key] = _RankPool(*key)
    return pool


def run_ranks(fn, world_size: int, *args, timeout: float = 600, backend: str = "gloo", fresh: bool = False) -> list:
    """``fn(*args)`` on every rank of a fresh process group; returns results ordered by rank.
    ``fresh``: in newly started processes, used for this call only."""
    key = (world_size, backend)
    for attempt in range(2):
        pool = _RankPool(*key) if fresh else _shared_pool(key)
        try:
            return pool.run(fn, args, timeout)
        except BaseException as err:
            # The other ranks may be waiting in a collective the failed one never joined.
            if _pools.get(key) is pool:
                del _pools[key]
            for p in pool.procs:
                p.kill()
            # The free port was taken between the look and the bind (other processes run too): once more.
            if attempt or "EADDRINUSE" not in str(err):
                raise
        finally:
            if fresh:
                pool.close()
