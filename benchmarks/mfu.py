"""Model FLOPs utilisation of the built-in GPT on one GPU: raydeep against a plain PyTorch loop.

    python -m benchmarks.mfu --model gpt-1.3b --seq 2048 --micro 4 --steps 20 --json mfu.json
    python -m benchmarks.mfu --dry-run --json plan.json   # any machine: the model on the meta device

Contenders, each alone in turn on the same model init and data (two 1.3B models' states at once
would crowd the device), bf16:

- ``plain``: the ceiling -- fp32 parameters under ``torch.autocast(bfloat16)``, torch's fused
  AdamW, one ``backward`` and ``step`` per micro batch;
- ``raydeep stage 0`` and ``raydeep stage 3``: ``raydeep.initialize`` on a one-rank NCCL group with
  ``RAYDEEP_COLLECTIVES_AT_WORLD_1=1``, so every collective runs through NCCL;
- ``raydeep stage 3, host optimizer``: the same with the fp32 masters and Adam states in pinned
  host memory (``offload_optimizer.device: "cpu"``).

Reported per contender: tokens/s, MFU (``GPT.flops_per_token``: 6N + 12 L h s, against
``--peak-tflops``, the H200's dense bf16 peak by default), the allocator's peak memory, and the
ratio of tokens/s to the plain loop. The first ``--warmup`` steps are dropped; medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

H200_BF16_DENSE_TFLOPS = 989.0


def contenders(micro: int) -> dict[str, dict | None]:
    """Each contender's ds_config (None: the plain loop)."""
    def cfg(stage: int, **zero) -> dict:
        return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
                "raydeep": {"offload_target": "host"}}
    return {"plain": None, "raydeep stage 0": cfg(0), "raydeep stage 3": cfg(3),
            "raydeep stage 3, host optimizer": cfg(3, offload_optimizer={"device": "cpu", "pin_memory": True})}


def _model(args, device):
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    with torch.device(device):
        return build_gpt(args.model, block_size=args.seq)


def plan(args) -> dict:
    """What a run measures, from the model built on the meta device (no memory, no GPU)."""
    from raydeep.config import load_config

    model = _model(args, "meta")
    for name, cfg in contenders(args.micro).items():
        if cfg is not None:
            load_config(cfg, world_size=1)  # a config the engine would refuse fails here
    return {"model": args.model, "seq": args.seq, "micro": args.micro, "params": model.num_params(),
            "flops_per_token": model.flops_per_token(args.seq), "peak_tflops": args.peak_tflops,
            "contenders": list(contenders(args.micro)), "tokens_per_step": args.micro * args.seq}


def _batches(args, vocab: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (args.micro, args.seq + 1), generator=g).to(device) for _ in range(args.steps)]


def _time_steps(step, batches) -> list[float]:
    times = []
    for x in batches:
        torch.cuda.synchronize()
        began = time.perf_counter()
        step(x[:, :-1], x[:, 1:])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return times


def run_plain(args, device, batches) -> list[float]:
    model = _model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _time_steps(step, batches)


def run_raydeep(args, device, batches, cfg: dict) -> list[float]:
    import raydeep

    engine, *_ = raydeep.initialize(model=_model(args, device), config=cfg)

    def step(x, y):
        engine.backward(engine(x, y))
        engine.step()
    try:
        return _time_steps(step, batches)
    finally:
        engine.destroy()


def measure(args) -> dict:
    import gc

    import torch.distributed as dist

    os.environ.setdefault("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1)
    out = plan(args)
    batches = _batches(args, _model(args, "meta").config.vocab_size, device)
    results = {}
    for name, cfg in contenders(args.micro).items():
        torch.cuda.reset_peak_memory_stats(device)
        times = run_plain(args, device, batches) if cfg is None else run_raydeep(args, device, batches, cfg)
        step_s = statistics.median(times[args.warmup:])
        tokens_s = out["tokens_per_step"] / step_s
        results[name] = {"step_s": step_s, "tokens_per_s": tokens_s,
                         "mfu": tokens_s * out["flops_per_token"] / (args.peak_tflops * 1e12),
                         "peak_memory_bytes": torch.cuda.max_memory_allocated(device)}
        gc.collect()
        torch.cuda.empty_cache()
    for r in results.values():
        r["vs_plain"] = r["tokens_per_s"] / results["plain"]["tokens_per_s"]
    dist.destroy_process_group()
    return {**out, "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "results": results}


def render(report: dict) -> str:
    lines = [f"{report['model']} ({report['params'] / 1e9:.2f}B), seq {report['seq']}, micro {report['micro']}, "
             f"{report['flops_per_token'] / 1e9:.1f} GFLOP/token, peak {report['peak_tflops']:.0f} TFLOPS"]
    for name, r in report.get("results", {}).items():
        lines.append(f"  {name:32s} {r['tokens_per_s']:9.0f} tokens/s  MFU {r['mfu']:.1%}  "
                     f"{r['vs_plain']:.2f}x plain  peak {r['peak_memory_bytes'] / 2**30:.1f} GiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                        help="the chip's dense bf16 peak (default: H200)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build on the meta device, check the configs")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = plan(args) if args.dry_run else measure(args)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
