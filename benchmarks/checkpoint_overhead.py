"""What does checkpointing every step cost? Step-time medians, same run, three modes.

    python -m benchmarks.checkpoint_overhead [--world 2] [--steps 30] [--model gpt-tiny] [--stage 3]

Each rank trains the built-in GPT on synthetic tokens; the same engine alternates blocks of
steps with no checkpoint, with ``save_checkpoint(async_save=True)`` after every step, and with
a synchronous save after every step, ``--steps`` steps of each. It prints the median step time of each mode (the save's
own call included: that is what training waits for) and the ratios to no checkpointing, taken
between neighbouring blocks (see ``summarise``).

``--world 1 --threads 1`` on a 2-core machine leaves a core to the background writer, as a GPU
node does; ``--world 2`` there makes the writer compete with training for every cycle.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from raydeep.bench.ranks import on_gloo_ranks

MODES = ("none", "async", "sync")
BLOCK = 5  # steps per mode in a row


def _train(args: argparse.Namespace, out_dir: str) -> dict:
    import raydeep
    from raydeep.models import build_gpt

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = build_gpt(args.model)
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": args.stage}, "raydeep": {"checkpoint_keep_last_k": 2, "checkpoint_fsync": not args.no_fsync}}
    engine, *_ = raydeep.initialize(model=model, config=config)
    seq = model.config.block_size
    g = torch.Generator().manual_seed(rank)
    blocks: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    # Modes alternate in short blocks, each round starting from the next mode, so that drift in
    # machine load, and whatever a block leaves behind for the next, hit all three alike. The
    # first round warms up and is dropped.
    for round_ in range(1 + -(-args.steps // BLOCK)):
        for mode in MODES[round_ % len(MODES):] + MODES[:round_ % len(MODES)]:
            block = []
            for _ in range(BLOCK):
                x = torch.randint(0, model.config.vocab_size, (args.micro, seq + 1), generator=g)
                start = time.perf_counter()
                loss = engine(x[:, :-1], x[:, 1:])
                engine.backward(loss)
                engine.step()
                if mode != "none":
                    engine.save_checkpoint(os.path.join(out_dir, "ckpt"), async_save=mode == "async")
                block.append(time.perf_counter() - start)
            engine.wait_for_checkpoint()  # the next block starts with no save in flight
            if round_:
                blocks[mode].append(block)
    engine.destroy()
    return blocks


def measure(args: argparse.Namespace) -> dict:
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    with tempfile.TemporaryDirectory() as out_dir:
        times = on_gloo_ranks(args.world, _train, (args, out_dir), threads=threads)[0]
    return summarise(times) | {"steps": args.steps, "world": args.world, "model": args.model, "stage": args.stage}


def summarise(blocks: dict[str, list[list[float]]]) -> dict:
    """Medians per mode, and each mode's ratio to no saving: the median over rounds of the ratio
    of block medians within a round (blocks of one round ran seconds apart, so a slow minute of
    the machine changes both sides of a ratio, not one)."""
    medians = {mode: statistics.median(t for block in b for t in block) for mode, b in blocks.items()}
    ratios = {mode: statistics.median(statistics.median(mine) / statistics.median(none)
                                      for mine, none in zip(b, blocks["none"])) for mode, b in blocks.items()}
    return {"median_step_s": medians, "ratio_vs_none": ratios, "step_s": blocks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--no-fsync", action="store_true", help="raydeep.checkpoint_fsync=false")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: cores / ranks); fewer leaves a core to the writer")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world)
    print(f"{args.model}, ZeRO-{args.stage}, {args.world} ranks x {threads} torch threads on {os.cpu_count()} cores, "
          f"{args.steps} steps, checkpoint after every step{' (no fsync)' if args.no_fsync else ''}")
    for mode in MODES:
        print(f"  {mode:>5}: median step {result['median_step_s'][mode] * 1000:8.1f} ms   "
              f"x{result['ratio_vs_none'][mode]:.3f} vs none (median of per-round ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
