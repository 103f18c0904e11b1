"""Run a function on ``world`` gloo ranks and collect what each returns: processes spawned on this
machine (:func:`on_gloo_ranks`) or Ray actors, one per rank, on a Ray cluster (:func:`on_ray_ranks`).

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


def _one_rank(rank: int, world: int, address: str, port: int, threads: int, fn, args) -> tuple:
    """Join the gloo group as ``rank``, run ``fn(*args)``, leave: (None, the result saved) or
    (the traceback, None). What a spawned process and a Ray actor each run."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=address,
                      MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(*args)
        dist.barrier()  # leave together: a gloo group torn down while its peer still sends aborts
        dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        return None, buffer.getvalue()
    except BaseException:  # report instead of leaving the parent waiting
        return traceback.format_exc(), None


def _rank_main(rank: int, world: int, port: int, threads: int, fn, args, queue) -> None:
    queue.put((rank, *_one_rank(rank, world, "127.0.0.1", port, threads, fn, args)))


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


def on_ray_ranks(world: int, fn, args: tuple = (), threads: int = 1, timeout: float = 1800,
                 address: str | None = None) -> list:
    """``fn(*args)`` on ``world`` Ray actors of one gloo group, each with ``threads`` CPUs, in a
    placement group (packed onto as few nodes as fit, as Ray Train packs a worker group); the
    results in rank order. Joins the cluster at ``address`` (or ``RAY_ADDRESS``, or one running
    here; else starts one) and removes its placement group and actors before returning."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = not ray.is_initialized()
    if started:
        ray.init(address=address, log_to_driver=False)
    group = placement_group([{"CPU": threads}] * world, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout)

        @ray.remote(num_cpus=threads)
        class Rank:
            def where(self) -> tuple[str, int]:
                return ray.util.get_node_ip_address(), _free_port()

            def run(self, *call):
                return _one_rank(*call)

        actors = [Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, r)).remote()
                  for r in range(world)]
        master, port = ray.get(actors[0].where.remote(), timeout=timeout)
        outcomes = ray.get([a.run.remote(r, world, master, port, threads, fn, args) for r, a in enumerate(actors)],
                           timeout=timeout)
        for actor in actors:
            ray.kill(actor)
    finally:
        remove_placement_group(group)
        if started:
            ray.shutdown()
    results = []
    for rank, (error, payload) in enumerate(outcomes):
        if error:
            raise RuntimeError(f"rank {rank} failed:\n{error}")
        results.append(torch.load(io.BytesIO(payload)))
    return results
