"""Does the delayed parameter update train as well? The same run with and without it.

    python -m benchmarks.delayed_update --steps 300

Two gloo ranks train a GPT (ZeRO-2, bf16, the optimizer in host memory) on the built-in corpus,
the same batches in the same order, once with ``raydeep.delayed_update`` (ZeRO-Offload's
one-step-delayed update, after its warm-up) and once without. Reported: the final loss of each
(the mean of the last 20 steps) and their ratio. Target: within 1%.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from raydeep.bench.ranks import on_gloo_ranks


def _rank(model: str, steps: int, delayed: bool, lookahead: bool, warmup: int) -> list[float]:
    import torch.distributed as dist

    import raydeep
    from raydeep.data.corpus import builtin_dataset
    from raydeep.models import build_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 20}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "raydeep": {"offload_target": "host", "delayed_update": delayed, "delayed_update_warmup_steps": warmup,
                       "delayed_update_lookahead": lookahead}}
    engine, *_ = raydeep.initialize(model=build_gpt(model, block_size=128), config=cfg)
    data = builtin_dataset(block_size=128)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        order = torch.randint(0, len(data), (8 * world,), generator=g)[rank::world]
        pairs = [data[int(i)] for i in order]
        loss = engine(torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs]))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    engine.destroy()
    return losses


RUNS = (("no delay", False, False), ("delayed, plain rule", True, False), ("delayed, lookahead", True, True))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10, help="ordinary steps before the delay starts")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    runs = {name: on_gloo_ranks(2, _rank, (args.model, args.steps, delayed, lookahead, args.warmup))[0]
            for name, delayed, lookahead in RUNS}
    final = {name: statistics.mean(losses[-20:]) for name, losses in runs.items()}
    ratios = {name: final[name] / final["no delay"] for name in final}
    print(f"{args.model}, 2 ranks, {args.steps} steps on the built-in corpus, warm-up {args.warmup}: "
          "final loss (mean of the last 20), and against no delay (target: the lookahead within 1%)")
    for name in final:
        print(f"  {name:<28} {final[name]:.4f}  {ratios[name]:.4f}x")
    report = {"model": args.model, "steps": args.steps, "final_loss": final, "ratio": ratios, "losses": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return report


if __name__ == "__main__":
    main()
