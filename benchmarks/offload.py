"""What ZeRO-Offload costs, measured against its peers in the same run.

    python -m benchmarks.offload --json offload.json

1. The CPU step: elements per second per core of the tier's update (the bf16 gradient, the one
   scale, AdamW, the fp32 master, both moments and the bf16 shard, in one pass) against torch's
   fused AdamW alone on fp32 tensors, on one thread. Target: >= 0.9x. Also the four passes it
   replaced (cast, scale, fused AdamW, write-back), each timed.
2. The actor tier's pipeline: one offload actor updating a shard at DeepSpeed's default
   ``sub_group_size``, in pieces of the default tile (``--tile``), through the object store (as
   an actor on another node) and through shared memory (an actor on the rank's node, the
   default there). Its step time against ``max(transfer, compute)``, where compute is the
   actor's own CPU-step seconds and transfer is the same step with an optimizer that does
   nothing (only the pieces' round trip). Target: <= 1.25x, which shows transfer and compute
   overlap.
3. The step time of a GPT (``--model``, gpt-small-cpu by default; it prints the update's share of
   the step without offload, and engine.step()'s) on 2 gloo ranks (ZeRO-2, bf16) with the optimizer
   states on the rank, in host memory, and in offload actors (on this node: through shared memory,
   and as actors on other nodes would, through the object store), each also with the delayed
   parameter update (with its lookahead, the default), in rotating blocks of 4 steps. Targets:
   host <= 1.05x, actors <= 1.25x, actors with the delayed update <= 1.10x.

Medians over the repetitions; the machine's other load hits every contender alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

from raydeep.bench.ranks import on_gloo_ranks
from raydeep.tier.local import DEFAULT_SUB_GROUP_SIZE, DEFAULT_TILE

class NoUpdate(torch.optim.Optimizer):
    """An optimizer that changes nothing: what is left of an offloaded step is the transfer."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- 1. the CPU step -----------------------------------------------------------------------------------
def cpu_step(numel: int, reps: int) -> dict:
    from raydeep.tier import cpu_update
    from raydeep.tier.masters import MasterShards, plan_sub_groups

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    grad_fp32 = torch.randn(numel, generator=g)
    grad_bf16 = grad_fp32.to(torch.bfloat16)
    shard = torch.randn(numel, generator=g).to(torch.bfloat16)

    param = nn.Parameter(shard.float())
    fused = torch.optim.AdamW([param], lr=1e-3, fused=True)
    param.grad = grad_fp32

    shards = MasterShards(plan_sub_groups([numel], [0], 10**9), [shard.float()], [{}],
                          lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=True))
    # The four passes the update made before it was one (each timed too, to show where time goes).
    four = nn.Parameter(shard.float())
    four_opt = torch.optim.AdamW([four], lr=1e-3, fused=True)
    buffer = torch.empty(numel)
    passes = {"cast bf16->fp32": lambda: buffer.copy_(grad_bf16), "scale": lambda: buffer.mul_(0.5),
              "AdamW": four_opt.step, "write back fp32->bf16": lambda: shard.copy_(four.detach())}
    four.grad = buffer
    fused_s, tier_s, four_s, pass_s = [], [], [], {name: [] for name in passes}
    for _ in range(reps):  # interleaved
        began = time.perf_counter()
        fused.step()
        fused_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        shards.step_sub_group(0, [grad_bf16], 0.5, outs=[shard])
        tier_s.append(time.perf_counter() - began)
        total = 0.0
        for name, run in passes.items():
            began = time.perf_counter()
            run()
            pass_s[name].append(time.perf_counter() - began)
            total += pass_s[name][-1]
        four_s.append(total)
    fused_rate, tier_rate, four_rate = numel / _median(fused_s), numel / _median(tier_s), numel / _median(four_s)
    return {"numel": numel, "one_pass": cpu_update.available(), "fused_adamw_elems_per_s": fused_rate,
            "tier_step_elems_per_s": tier_rate, "ratio": tier_rate / fused_rate, "target": ">= 0.9",
            "four_passes_ratio": four_rate / fused_rate, "fused_adamw_s": _median(fused_s),
            "tier_step_s": _median(tier_s), "passes_s": {name: _median(t) for name, t in pass_s.items()}}


# --- 2. the actor pipeline ---------------------------------------------------------------------------
def actor_pipeline(numel: int, tile: int, reps: int, shared_memory: bool) -> dict:
    import functools

    import ray

    from raydeep.optim.optimizers import build_optimizer, resolve_optimizer
    from raydeep.tier.actors import ActorTier
    from raydeep.zero.flat import FlatUnit

    def tier(make, sub_group_size: int) -> tuple[ActorTier, FlatUnit]:
        unit = FlatUnit("u", [("w", nn.Parameter(torch.randn(numel).to(torch.bfloat16)))], 0, 1, 0,
                        torch.bfloat16, False)
        return ActorTier([unit], [{}], make, sub_group_size, {}, actors_per_rank=1, cpus_per_actor=1, tile=tile,
                         shared_memory=shared_memory), unit

    adamw = functools.partial(build_optimizer, resolve_optimizer("AdamW", {"lr": 1e-3}), prefer_fused=True)
    noop = functools.partial(NoUpdate)
    # At DeepSpeed's default sub_group_size (one sub-group): AdamW's is cut to the tile by the
    # tier itself; the optimizer that changes nothing is not Adam, so it is given the tile as its
    # sub-group size, which makes the same pieces.
    full, unit = tier(adamw, DEFAULT_SUB_GROUP_SIZE)
    empty, unit2 = tier(noop, tile)
    pieces = [sum(c.numel for c in sg) for sg in full.sub_groups]
    assert pieces == [sum(c.numel for c in sg) for sg in empty.sub_groups], "both contenders send the same pieces"
    # Shared memory only where the actor is on this node (a cluster may place it elsewhere).
    used = all(w is not None for w in full.windows + empty.windows)
    grads = [torch.randn(numel).to(torch.bfloat16)]
    step_s, transfer_s, compute_s = [], [], []
    for _ in range(reps + 1):
        cpu_before = full.timings["cpu_step_s"]
        began = time.perf_counter()
        full.step(grads, 1.0)
        step_s.append(time.perf_counter() - began)
        compute_s.append(full.timings["cpu_step_s"] - cpu_before)
        began = time.perf_counter()
        empty.step(grads, 1.0)
        transfer_s.append(time.perf_counter() - began)
    full.close()
    empty.close()
    step, transfer, compute = _median(step_s[1:]), _median(transfer_s[1:]), _median(compute_s[1:])
    return {"numel": numel, "shared_memory": used, "sub_group_size": DEFAULT_SUB_GROUP_SIZE, "tile": tile, "pieces": len(full.sub_groups),
            "step_s": step, "transfer_s": transfer, "compute_s": compute,
            "ratio_vs_max": step / max(transfer, compute), "serial_s": transfer + compute, "target": "<= 1.25",
            "ray_initialized": ray.is_initialized()}


# --- 3. a GPT on 2 ranks ---------------------------------------------------------------------------------
# name -> (offload target, delayed update, shared memory); the delayed update has its default
# lookahead (raydeep.tier.lookahead). The actors run on this node, so by default they exchange
# through shared memory; "object store" is the path actors on other nodes take.
TIERS = {"on the rank": (None, False, True), "host memory": ("host", False, True),
         "offload actors": ("actors", False, True), "actors, object store": ("actors", False, False),
         "host, delayed": ("host", True, True), "actors, delayed": ("actors", True, True),
         "actors, delayed, object store": ("actors", True, False)}
# Each object-store contender and its shared-memory twin: where the twin's actors are on other
# nodes (it found no window), both take the same path, which is measured once, by the twin.
TWINS = {"actors, object store": "offload actors", "actors, delayed, object store": "actors, delayed"}


BLOCK = 4  # consecutive steps per contender


def _timed(fn, seconds: list[float]):
    """``fn`` that appends the seconds each call takes to ``seconds``."""
    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - began)
    return timed


def _rank(address: str, steps: int, model: str, micro_batch: int = 4, seq: int = 64) -> dict:
    import ray
    import torch.distributed as dist

    import raydeep
    from raydeep.models import build_gpt

    rank = dist.get_rank()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    engines = {}
    for name, (target, delayed, shared_memory) in TIERS.items():
        if name in TWINS:
            twin = engines[TWINS[name]]
            windows = torch.tensor([twin.tier.report()["shared_memory"]])
            dist.all_reduce(windows, op=dist.ReduceOp.MIN)  # every rank decides alike
            if windows.item() == 0:
                engines[name] = twin
                continue
        torch.manual_seed(0)
        zero = {"stage": 2, "reduce_bucket_size": 200_000}
        if target:
            zero.update(offload_optimizer={"device": "cpu"})
        cfg = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero,
               "raydeep": {"offload_target": target or "auto", "offload_actor_cpus": 0.5,
                           "delayed_update": delayed, "delayed_update_warmup_steps": 0,
                           "offload_shared_memory": shared_memory}}
        engines[name], *_ = raydeep.initialize(model=build_gpt(model, block_size=seq), config=cfg)
    g = torch.Generator().manual_seed(rank)
    times = {name: [] for name in TIERS}
    # On the rank: the share of the step in engine.step() (the gradient norm, the update, the
    # parameters' all-gather) and in the update alone (the tier's step).
    step_share, update_share, update_s = [], [], []
    engines["on the rank"].tier.step = _timed(engines["on the rank"].tier.step, update_s)
    # Blocks of BLOCK steps per contender, in a rotating order, the first step of each block not
    # counted: a delayed update's background work runs into whatever step follows it, which
    # within a block is its own contender's next step (as in training), and at a block's end the
    # next contender's uncounted first step.
    for block in range(-(-steps // (BLOCK - 1))):
        order = list(TIERS)[block % len(TIERS):] + list(TIERS)[:block % len(TIERS)]
        for name, j in ((name, j) for name in order for j in range(BLOCK)):
            x = torch.randint(0, 256, (micro_batch, seq + 1), generator=g)
            dist.barrier()
            began = time.perf_counter()
            engine = engines[name]
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            stepped = time.perf_counter()
            engine.step()
            took = torch.tensor([time.perf_counter() - began, time.perf_counter() - stepped,
                                 update_s[-1] if name == "on the rank" else 0.0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if j == 0:
                continue
            times[name].append(took[0].item())
            if name == "on the rank":
                step_share.append(took[1].item() / took[0].item())
                update_share.append(took[2].item() / took[0].item())
    for engine in {id(e): e for e in engines.values()}.values():
        engine.destroy()
    ray.shutdown()
    return {"times": times, "step_share": step_share, "update_share": update_share}


def gpt_offload_cost(steps: int, address: str, model: str, micro_batch: int = 4, seq: int = 64) -> dict:
    # every rank's are the max over ranks
    found = on_gloo_ranks(2, _rank, (address, steps, model, micro_batch, seq), timeout=1800)[0]
    medians = {name: _median(ts[2:]) for name, ts in found["times"].items()}  # the first steps warm up
    base = medians["on the rank"]
    return {"model": model, "micro_batch": micro_batch, "seq": seq, "median_step_s": medians,
            "vs_on_the_rank": {n: m / base for n, m in medians.items()},
            "update_share_on_the_rank": _median(found["update_share"][2:]),
            "optimizer_step_share_on_the_rank": _median(found["step_share"][2:]),
            "targets": {"host memory": "<= 1.05", "offload actors": "<= 1.25", "actors, delayed": "<= 1.10"}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8_000_000, help="elements of the CPU-step tensors")
    parser.add_argument("--actor-numel", type=int, default=16_000_000)
    parser.add_argument("--tile", type=int, default=DEFAULT_TILE,
                        help="the actor pipeline's pieces (raydeep.offload_tile_size; sub_group_size is DeepSpeed's 1e9)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--gpt-steps", type=int, default=12)
    parser.add_argument("--model", default="gpt-small-cpu", help="the GPT of part 3 (raydeep.models)")
    parser.add_argument("--micro-batch", type=int, default=4, help="part 3's sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64, help="part 3's tokens per sequence")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)

    import ray

    report = {"cpu_step": cpu_step(args.numel, args.reps)}
    c = report["cpu_step"]
    print(f"CPU step, 1 thread, {args.numel:,} elements: tier {c['tier_step_elems_per_s'] / 1e6:.0f} M/s "
          f"({'one pass' if c['one_pass'] else 'four passes: the extension is unavailable'}), "
          f"fused AdamW {c['fused_adamw_elems_per_s'] / 1e6:.0f} M/s: {c['ratio']:.2f}x (target >= 0.9)")
    print(f"  the four passes it replaces: {c['four_passes_ratio']:.2f}x = "
          + " + ".join(f"{name} {t * 1e3:.1f} ms" for name, t in c["passes_s"].items()))
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=4, resources={"raydeep_offload": 1}, logging_level="ERROR", log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    try:
        shared = actor_pipeline(args.actor_numel, args.tile, args.reps, True)
        # With the actor on another node that was the object store's path already: measured once.
        store = actor_pipeline(args.actor_numel, args.tile, args.reps, False) if shared["shared_memory"] else shared
        for how, a in (("the object store", store), ("shared memory", shared)):
            report[f"actor_pipeline, {how.removeprefix('the ')}"] = a
            print(f"actor tier through {how}, {a['numel']:,} bf16 elements in {a['pieces']} pieces: step "
                  f"{a['step_s'] * 1e3:.0f} ms, transfer alone {a['transfer_s'] * 1e3:.0f} ms, CPU step "
                  f"{a['compute_s'] * 1e3:.0f} ms: {a['ratio_vs_max']:.2f}x max(transfer, compute) (target <= 1.25; "
                  f"serial would be {a['serial_s'] / max(a['transfer_s'], a['compute_s']):.2f}x)"
                  + ("" if a["shared_memory"] or how != "shared memory" else " (the actor is on another node: "
                     "the object store's path)"))
        address = ray.get_runtime_context().gcs_address
        report["gpt_2_ranks"] = g = gpt_offload_cost(args.gpt_steps, address, args.model, args.micro_batch, args.seq)
        print(f"{args.model}, 2 ranks, ZeRO-2 bf16, {args.micro_batch} x {args.seq} tokens, median step (on the rank "
              f"the update is {g['update_share_on_the_rank']:.0%} of it, engine.step() with the gradient norm and the "
              f"all-gather {g['optimizer_step_share_on_the_rank']:.0%}): " + ", ".join(
                  f"{n} {g['median_step_s'][n] * 1e3:.0f} ms ({g['vs_on_the_rank'][n]:.2f}x)" for n in TIERS)
              + "; targets: host <= 1.05x, actors <= 1.25x, actors delayed <= 1.10x")
    finally:
        if started_here:
            ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
