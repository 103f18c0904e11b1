"""Step time and bytes of 1-bit Adam, 0/1 Adam and 1-bit LAMB against uncompressed Adam and LAMB, in one run.

    python -m benchmarks.compression --world 2 --steps 14 --model gpt-tiny --json compression.json
    python -m benchmarks.compression --bucket 50000    # ~17 buckets: one compressed tensor each

Spawns ``--world`` gloo ranks. On the same model init and data, at ZeRO stage 0, five engines
take turns one optimizer step at a time: torch AdamW and raydeep's Lamb (the gradients
all-reduced in fp32), 1-bit Adam, 0/1 Adam and 1-bit LAMB, past their warm-up after two steps
(``freeze_step`` / ``var_freeze_step`` 2; 0/1 Adam's local steps are off, ``local_step_clipper``
1, so every step communicates). 1-bit LAMB's step is also given against Lamb's. A step's time
is the slowest rank's wall time from a barrier; the first ``--warmup`` steps are dropped;
medians over the rest. Bytes and collectives per step come from ``CommStats`` (the collectives
include the gradient norm's all-reduce).

On CPU ranks sharing two cores the compressed all-reduce does more arithmetic (norms, signs,
packing, unpacking) than it saves in gloo transfer over loopback: compression pays where the
network, not the CPU, is the bottleneck. The benchmark reports what it measures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from raydeep.bench.ranks import on_gloo_ranks

ENGINES = {
    "Adam": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-3, "weight_decay": 0.01, "freeze_step": 2}},
    "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "weight_decay": 0.01, "var_freeze_step": 2,
                                                      "local_step_clipper": 1}},
    "Lamb": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 1e-2, "weight_decay": 0.01, "freeze_step": 2}},
}


def measure(args) -> dict:
    import torch.distributed as dist

    import raydeep
    from raydeep.models import build_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    engines = {}
    for name, optimizer in ENGINES.items():
        torch.manual_seed(0)
        model = build_gpt(args.model)
        config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "optimizer": optimizer, "zero_optimization": {"stage": 0}}
        if args.bucket:  # several buckets: the optimizers compress one chunk per bucket
            config["zero_optimization"]["reduce_bucket_size"] = args.bucket
        engines[name] = raydeep.initialize(model=model, config=config)[0]
    block = engines["Adam"].module.config.block_size
    g = torch.Generator().manual_seed(rank)
    times = {name: [] for name in engines}
    nbytes = {name: [] for name in engines}
    calls = {name: [] for name in engines}
    for step in range(args.steps):
        x = torch.randint(0, 256, (args.micro, block + 1), generator=g)
        order = list(engines)[step % len(engines):] + list(engines)[:step % len(engines)]
        for name in order:
            engine = engines[name]
            engine.reset_comm_stats()
            dist.barrier()
            began = time.perf_counter()
            engine.backward(engine(x[:, :-1], x[:, 1:]))
            engine.step()
            elapsed = torch.tensor([time.perf_counter() - began])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
            nbytes[name].append(sum(op["bytes"] for op in engine.comm_stats().values()))
            calls[name].append(sum(op["calls"] for op in engine.comm_stats().values()))
    phases = {name: engine.tier.phase for name, engine in engines.items()}
    chunks = {name: len(engine.tier.shards.params) for name, engine in engines.items()}
    return {"times": times, "bytes": nbytes, "calls": calls, "phases": phases, "chunks": chunks}


def summarize(args, result: dict) -> dict:
    out = {"world": args.world, "model": args.model, "micro": args.micro, "bucket": args.bucket, "engines": {}}
    base = statistics.median(result["times"]["Adam"][args.warmup:])
    base_bytes = statistics.median(result["bytes"]["Adam"][args.warmup:])
    for name in ENGINES:
        t = statistics.median(result["times"][name][args.warmup:])
        b = statistics.median(result["bytes"][name][args.warmup:])
        out["engines"][name] = {"step_s": t, "vs_adam": t / base, "bytes_per_step": b,
                                "bytes_vs_adam": b / base_bytes, "phase": result["phases"][name],
                                "collectives_per_step": statistics.median(result["calls"][name][args.warmup:]),
                                "chunks": result["chunks"][name]}
    lamb = out["engines"]["Lamb"]["step_s"]
    out["engines"]["OneBitLamb"]["vs_lamb"] = out["engines"]["OneBitLamb"]["step_s"] / lamb
    return out


def render(summary: dict) -> str:
    bucket = f", reduce_bucket_size {summary['bucket']}" if summary.get("bucket") else ""
    lines = [f"{summary['model']}, {summary['world']} gloo ranks, stage 0{bucket}, median step after warm-up:"]
    for name, e in summary["engines"].items():
        versus = f", {e['vs_lamb']:.2f}x Lamb" if "vs_lamb" in e else ""
        lines.append(f"  {name:12s} {e['step_s'] * 1e3:7.1f} ms ({e['vs_adam']:.2f}x Adam{versus}), "
                     f"{e['bytes_per_step'] / 1e6:7.3f} MB per step ({e['bytes_vs_adam']:.4f}x Adam), "
                     f"{e['collectives_per_step']:g} collectives per step for {e['chunks']} chunks")
    return "\n".join(lines)


def run(args) -> dict:
    return summarize(args, on_gloo_ranks(args.world, measure, (args,))[0])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--bucket", type=int, default=0,
                        help="zero_optimization.reduce_bucket_size (elements); 0: DeepSpeed's default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    summary = run(args)
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
