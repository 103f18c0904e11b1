"""Model FLOPs utilisation of the built-in GPT on one GPU: raydeep against a plain PyTorch loop.

    python -m benchmarks.mfu --model gpt-1.3b --seq 2048 --micro 4 --steps 20 --json mfu.json
    python -m benchmarks.mfu --dry-run --json plan.json   # any machine: the model on the meta device
    python -m benchmarks.mfu --device cpu --model gpt-tiny --seq 32 --micro 2 --steps 3 --warmup 1
                                                          # the whole code path on a CPU (gloo)

Contenders, each alone in turn on the same model init and data (two 1.3B models' states at once
would crowd the device), bf16:

- ``plain``: the ceiling -- fp32 parameters under ``torch.autocast(bfloat16)``, torch's fused
  AdamW, one ``backward`` and ``step`` per micro batch;
- ``raydeep stage 0`` and ``raydeep stage 3``: ``raydeep.initialize`` on a one-rank NCCL group with
  ``RAYDEEP_COLLECTIVES_AT_WORLD_1=1``, so every collective runs through NCCL;
- ``raydeep stage 3, host optimizer``: the same with the fp32 masters and Adam states in pinned
  host memory (``offload_optimizer.device: "cpu"``).

Reported per contender: tokens/s, MFU (``GPT.flops_per_token``: 6N + 12 L h s, against the chip's
dense bf16 peak from raydeep's table, or ``--peak-tflops``), the losses, how many steps were
skipped (an fp16 overflow: a fast step that trained nothing, so it is not timed), the allocator's
peak memory, and the ratio of tokens/s to the plain loop. The first ``--warmup`` steps are dropped;
medians. Beside the datasheet peak, the bf16 matmul rate this chip reaches here.

The JSON is rewritten after each contender: a contender that raises is recorded with its error
and the next one still runs; a run cut short by a timeout leaves what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch

H200_BF16_DENSE_TFLOPS = 989.0


def contenders(micro: int, broken: str | None = None) -> dict[str, dict | None]:
    """Each contender's ds_config (None: the plain loop). ``broken`` names one whose config gets a
    misspelt key, so that it raises as a real failure would (how the check's handling is tested)."""
    def cfg(stage: int, **zero) -> dict:
        return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
                "raydeep": {"offload_target": "host"}}
    out = {"plain": None, "raydeep stage 0": cfg(0), "raydeep stage 3": cfg(3),
           "raydeep stage 3, host optimizer": cfg(3, offload_optimizer={"device": "cpu", "pin_memory": True})}
    if broken is not None:
        out[broken] = {**(out[broken] or {}), "train_micro_batch_size_per_gpus": micro}
    return out


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step, batches, device) -> dict:
    """Each step's seconds, loss and whether it was applied (an fp16 overflow skips the update:
    such a step is fast and trained nothing, so it must not count toward tokens/s)."""
    times, losses, applied = [], [], []
    for x in batches:
        _sync(device)
        began = time.perf_counter()
        loss, stepped = step(x[:, :-1], x[:, 1:])
        _sync(device)
        times.append(time.perf_counter() - began)
        losses.append(float(loss))
        applied.append(stepped)
    return {"times": times, "losses": losses, "applied": applied}


def run_plain(args, device, batches) -> dict:
    model = _model(args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach(), True
    return _time_steps(step, batches, device)


def run_raydeep(args, device, batches, cfg: dict) -> dict:
    import raydeep

    engine, *_ = raydeep.initialize(model=_model(args, device), config=cfg)

    def step(x, y):
        skipped = engine.skipped_steps
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach(), engine.skipped_steps == skipped
    try:
        return _time_steps(step, batches, device)
    finally:
        engine.destroy()


def matmul_ceiling_tflops(device: torch.device, n: int, repeats: int = 10) -> float:
    """The bf16 rate an ``n x n x n`` matmul reaches here (best of ``repeats``): the practical
    ceiling beside the datasheet's peak."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * n ** 3 / best / 1e12


def summarise(run: dict, report: dict, warmup: int) -> dict:
    """Tokens/s and MFU over the applied steps after the warm-up (medians), the losses and how
    many steps were skipped."""
    kept = [t for i, (t, ok) in enumerate(zip(run["times"], run["applied"])) if i >= warmup and ok]
    result = {"losses": run["losses"], "skipped_steps": run["applied"].count(False), "timed_steps": len(kept)}
    if kept:
        step_s = statistics.median(kept)
        tokens_s = report["tokens_per_step"] / step_s
        result.update(step_s=step_s, tokens_per_s=tokens_s,
                      mfu=tokens_s * report["flops_per_token"] / (report["peak_tflops"] * 1e12))
    return result


def _peak(args, device: torch.device) -> tuple[float, str]:
    """The dense bf16 peak MFU is measured against, and where the figure came from."""
    from raydeep.ray.step_metrics import chip_peak_tflops

    if args.peak_tflops is not None:
        return args.peak_tflops, "--peak-tflops"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = chip_peak_tflops(name)
    if peak is not None:
        return peak, f"raydeep's table for {name!r}"
    return H200_BF16_DENSE_TFLOPS, f"{name!r} is not in raydeep's table: the H200's figure"


def _start(device: torch.device) -> None:
    import torch.distributed as dist

    os.environ.setdefault("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def measure(args, write) -> dict:
    """Run each contender in turn; ``write(report)`` after each."""
    import torch.distributed as dist

    device = torch.device(args.device)
    report = plan(args)
    report["peak_tflops"], report["peak_source"] = _peak(args, device)
    report.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, results={},
                  matmul_tflops=matmul_ceiling_tflops(device, 8192 if device.type == "cuda" else 256))
    write(report)
    _start(device)
    batches = _batches(args, _model(args, "meta").config.vocab_size, device)
    for name, cfg in contenders(args.micro, args.break_contender).items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            run = run_plain(args, device, batches) if cfg is None else run_raydeep(args, device, batches, cfg)
            result = summarise(run, report, args.warmup)
        except Exception as err:  # noqa: BLE001 -- recorded; the next contender still runs
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=-4)}
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        report["results"][name] = result
        plain = report["results"].get("plain", {}).get("tokens_per_s")
        for r in report["results"].values():
            if plain and "tokens_per_s" in r:
                r["vs_plain"] = r["tokens_per_s"] / plain
        write(report)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return report


def render(report: dict) -> str:
    peak = f"{report['peak_tflops']:.0f} TFLOPS" if report.get("peak_tflops") else "the device's"
    lines = [f"{report['model']} ({report['params'] / 1e9:.2f}B), seq {report['seq']}, micro {report['micro']}, "
             f"{report['flops_per_token'] / 1e9:.1f} GFLOP/token, peak {peak}"
             + (f", bf16 matmul reaches {report['matmul_tflops']:.1f}" if "matmul_tflops" in report else "")]
    for name, r in report.get("results", {}).items():
        if "tokens_per_s" not in r:
            lines.append(f"  {name:32s} {r.get('error', 'no step was timed')}")
            continue
        vs = f"{r['vs_plain']:.2f}x plain" if "vs_plain" in r else "  -  plain"
        memory = f"peak {r['peak_memory_bytes'] / 2**30:.1f} GiB  " if r["peak_memory_bytes"] is not None else ""
        lines.append(f"  {name:32s} {r['tokens_per_s']:9.0f} tokens/s  MFU {r['mfu']:.1%}  {vs}  {memory}"
                     f"skipped {r['skipped_steps']}  loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda:0", help="cuda:0, or cpu to run the code path without a GPU")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the chip's dense bf16 peak (default: raydeep's table for the device, else the H200's)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: build on the meta device, check the configs")
    parser.add_argument("--json", help="write the report here (rewritten after each contender)")
    parser.add_argument("--break-contender", help=argparse.SUPPRESS)  # make this one raise (tests the handling)
    args = parser.parse_args(argv)

    def write(report: dict) -> None:
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(args.json + ".tmp", args.json)  # a reader never sees half a file

    report = plan(args) if args.dry_run else measure(args, write)
    write(report)
    print(render(report))
    return report


if __name__ == "__main__":
    failed = [name for name, r in main().get("results", {}).items() if "error" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    raise SystemExit(1 if failed else 0)
