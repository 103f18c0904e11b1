"""Run a function on ``world`` gloo ranks spawned on this machine and collect what each returns.

The benchmarks measure in fresh processes: each rank joins one gloo group, calls
``fn(*args)``, and sends its result back (through ``torch.save``, so tensors travel too). A
rank's exception comes back as its traceback and is raised in the parent, naming the rank.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback

import torch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, threads: int, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        dist.barrier()  # leave together: a gloo group torn down while its peer still sends aborts
        dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, None, buffer.getvalue()))
    except BaseException:  # report instead of leaving the parent waiting
        queue.put((rank, traceback.format_exc(), None))


def on_gloo_ranks(world: int, fn, args: tuple = (), threads: int = 1, timeout: float = 1800) -> list:
    """``fn(*args)`` on every rank of a new ``world``-rank gloo group; the results in rank order.
    ``fn`` must be importable by name (the ranks are spawned)."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, threads, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, error, payload = queue.get(timeout=timeout)
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(payload))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
