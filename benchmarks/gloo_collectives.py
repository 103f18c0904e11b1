"""gloo's reduce-scatter and all-gather against raydeep's direct exchanges (``raydeep.comm.exchange``)
and gloo's all-reduce of the same tensor, interleaved in one run:

    python -m benchmarks.gloo_collectives --world 2 --sizes 250000,1000000,5300000

The ratios it prints are why ``raydeep.comm`` uses the exchanges on gloo groups.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings


def _measure(sizes: list[int], reps: int) -> dict:
    import torch
    import torch.distributed as dist

    from raydeep.comm import exchange

    warnings.filterwarnings("ignore", category=FutureWarning)
    world = dist.get_world_size()
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = {}
    for n in sizes:
        n -= n % world
        x, shard, full = torch.randn(n), torch.empty(n // world), torch.empty(n)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "gloo reduce_scatter": lambda: reduce_scatter(shard, x),
               "exchange reduce_scatter": lambda: exchange.reduce_scatter(shard, x).wait(),
               "gloo all_gather": lambda: all_gather(full, shard),
               "exchange all_gather": lambda: exchange.all_gather(full, shard).wait()}
        times = {name: [] for name in ops}
        for rep in range(reps + 2):
            for name, op in ops.items():
                dist.barrier()
                start = time.perf_counter()
                op()
                if rep >= 2:  # the first two warm the connections and the allocator
                    times[name].append(time.perf_counter() - start)
        out[n] = {name: statistics.median(t) for name, t in times.items()}
    return out


def main(argv=None) -> None:
    from raydeep.bench.ranks import on_gloo_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes", default="250000,1000000,5300000", help="fp32 elements, comma-separated")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = on_gloo_ranks(args.world, _measure, (sizes, args.reps))[0]
    print(f"{args.world} gloo ranks, median of {args.reps} (ms), rank 0")
    print(f"{'elements':>10}  {'all_reduce':>10}  {'RS gloo':>8}  {'RS exch':>8}  {'ratio':>5}  "
          f"{'AG gloo':>8}  {'AG exch':>8}  {'ratio':>5}")
    for n, t in result.items():
        ms = {k: v * 1000 for k, v in t.items()}
        rs, ag = ms["exchange reduce_scatter"] / ms["gloo reduce_scatter"], ms["exchange all_gather"] / ms["gloo all_gather"]
        print(f"{n:>10}  {ms['all_reduce']:>10.2f}  {ms['gloo reduce_scatter']:>8.2f}  "
              f"{ms['exchange reduce_scatter']:>8.2f}  {rs:>5.2f}  {ms['gloo all_gather']:>8.2f}  "
              f"{ms['exchange all_gather']:>8.2f}  {ag:>5.2f}")


if __name__ == "__main__":
    main()
