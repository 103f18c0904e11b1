"""Step time of raydeep against torch DDP and DeepSpeed, and how much communication overlap hides.

    python -m benchmarks.step_time --world 2 --steps 10 --model gpt-small-cpu --json step_time.json

One invocation spawns ``--world`` gloo ranks on this machine and builds, in that one process
group, every engine on the same model init and the same data:

* raydeep at ZeRO stage 0 and at stages 1-3 with ``overlap_comm`` off and on;
* DeepSpeed at stages 0-3 with its default ``overlap_comm`` (when DeepSpeed is installed);
* plain ``torch.nn.parallel.DistributedDataParallel`` with torch's AdamW (``fused=True``).

The engines take turns one optimizer step at a time (round robin, starting point rotated each
round), so a change in machine load hits them all alike. A step's time is the slowest rank's
wall time from a barrier to the end of the step; warm-up steps are dropped and the report gives
medians and quartiles over the measured steps. For raydeep it also reports the seconds per
step the training loop was blocked on collectives (``CommStats.blocked_s``) and the share of it
that overlap hides: ``1 - blocked(overlap on) / blocked(overlap off)``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
import warnings

import torch

DDP = "ddp"


# --- what is measured -------------------------------------------------------------------------------
def ds_config(args, stage: int, overlap: bool | None) -> dict:
    """The one ds_config every engine reads (DDP uses its batch, clipping and optimizer)."""
    zero = {"stage": stage, "reduce_bucket_size": args.bucket, "allgather_bucket_size": args.bucket}
    if overlap is not None:  # None: the engine's default (DeepSpeed: on for stage 3 only)
        zero["overlap_comm"] = overlap
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": zero}


def plan(args) -> list[tuple[str, int | None, bool | None]]:
    """(engine, stage, overlap_comm) for every configuration, in measuring order."""
    runs = [(DDP, None, None), ("raydeep", 0, False)]
    runs += [("raydeep", stage, overlap) for stage in (1, 2, 3) for overlap in (False, True)]
    if args.deepspeed:
        runs += [("deepspeed", stage, None) for stage in range(4)]
    return runs


def label(engine: str, stage, overlap) -> str:
    if engine == DDP:
        return "DDP"
    name = "raydeep" if engine == "raydeep" else "DeepSpeed"
    return f"{name} z{stage}" + ("" if overlap is None else (" overlap" if overlap else ""))


def build_model(args):
    from raydeep.models import build_gpt

    torch.manual_seed(0)  # every engine starts from the same weights
    overrides = {"n_layer": args.n_layer} if args.n_layer else {}
    return build_gpt(args.model, block_size=args.seq, **overrides)


def build(args, engine: str, stage, overlap):
    """Returns (step(micro_batches), blocked_seconds() or None)."""
    model = build_model(args)
    if engine == DDP:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket * 4 / 2**20)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

        def ddp_step(micro_batches):
            for k, (x, y) in enumerate(micro_batches):
                last = k == len(micro_batches) - 1
                with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once per step
                    (ddp(x, y) / len(micro_batches)).backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return ddp_step, None
    if engine == "raydeep":
        import raydeep

        eng, *_ = raydeep.initialize(model=model, config=ds_config(args, stage, overlap))
        blocked = lambda: sum(op["blocked_s"] for op in eng.comm_stats().values())  # noqa: E731
    else:
        deepspeed = _import_deepspeed()
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds_config(args, stage, overlap))
        blocked = None

    def engine_step(micro_batches):
        for x, y in micro_batches:
            eng.backward(eng(x, y))
            eng.step()
    return engine_step, blocked


def _import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    # The CPU backend JIT-compiles a shared-memory all-reduce used only for inference; skip it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    return deepspeed


def batches(args, rank: int, world: int, steps: int, vocab: int):
    """Each step's micro-batches for this rank, sliced from one global batch per step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (args.micro_batch * args.gas * world, args.seq + 1), generator=g)
        micro = []
        for k in range(args.gas):
            lo = (k * world + rank) * args.micro_batch
            x = data[lo:lo + args.micro_batch]
            micro.append((x[:, :-1], x[:, 1:]))
        out.append(micro)
    return out


def measure(args) -> dict:
    """On every rank: build all configurations, run them round robin, return per-step times."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    runs = plan(args)
    built = [build(args, *run) for run in runs]
    vocab = build_model(args).config.vocab_size
    data = batches(args, rank, world, args.warmup + args.steps, vocab)
    times = [[] for _ in runs]
    blocked = [0.0 for _ in runs]
    for step, micro in enumerate(data):
        shift = step % len(runs)
        for i in list(range(shift, len(runs))) + list(range(shift)):
            run_step, blocked_s = built[i]
            before = blocked_s() if blocked_s else 0.0
            dist.barrier()
            start = time.perf_counter()
            run_step(micro)
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[i].append(elapsed)
                blocked[i] += (blocked_s() - before) if blocked_s else 0.0
    return {"times": times, "blocked": blocked}


# --- reporting ----------------------------------------------------------------------------------
def summarize(args, per_rank: list[dict]) -> dict:
    runs = plan(args)
    rows = []
    for i, (engine, stage, overlap) in enumerate(runs):
        # A step ends when its slowest rank does.
        steps = [max(rank["times"][i][s] for rank in per_rank) for s in range(args.steps)]
        q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else (steps[0],) * 3
        blocked = None if engine != "raydeep" else max(r["blocked"][i] for r in per_rank) / args.steps
        rows.append({"name": label(engine, stage, overlap), "engine": engine, "stage": stage, "overlap_comm": overlap,
                     "median_s": statistics.median(steps), "q1_s": q1, "q3_s": q3, "step_s": steps,
                     "blocked_comm_s": blocked})
    ddp = next(r for r in rows if r["engine"] == DDP)["median_s"]
    deepspeed = {r["stage"]: r["median_s"] for r in rows if r["engine"] == "deepspeed"}
    for row in rows:
        row["vs_ddp"] = row["median_s"] / ddp
        row["vs_deepspeed"] = row["median_s"] / deepspeed[row["stage"]] if row["stage"] in deepspeed else None
    hidden = {}
    for stage in (1, 2, 3):
        off, on = (next(r for r in rows if r["engine"] == "raydeep" and r["stage"] == stage and r["overlap_comm"] is o)
                   for o in (False, True))
        hidden[stage] = 1 - on["blocked_comm_s"] / off["blocked_comm_s"] if off["blocked_comm_s"] > 0 else None
    return {"setup": vars(args), "rows": rows, "hidden_comm_share": hidden}


def render(summary: dict) -> str:
    s = summary["setup"]
    lines = [f"{s['model']} (n_layer {s['n_layer'] or 'default'}), {summary['params'] / 1e6:.2f}M params, "
             f"world {s['world']}, micro batch {s['micro_batch']} x seq {s['seq']}, GAS {s['gas']}, "
             f"{s['steps']} measured steps after {s['warmup']} warm-up, bucket {s['bucket']} elements",
             f"1-minute load average {summary['load_average']['start']:.1f} at start, "
             f"{summary['load_average']['end']:.1f} at end, on {os.cpu_count()} CPUs",
             f"{'configuration':<22}{'median ms':>10}{'IQR ms':>14}{'vs DDP':>8}{'vs DS':>7}{'comm blocked ms':>17}"]
    for r in summary["rows"]:
        iqr = f"{r['q1_s'] * 1e3:.0f}-{r['q3_s'] * 1e3:.0f}"
        vs_ds = f"{r['vs_deepspeed']:.2f}" if r["vs_deepspeed"] is not None else "-"
        blocked = f"{r['blocked_comm_s'] * 1e3:.1f}" if r["blocked_comm_s"] is not None else "-"
        lines.append(f"{r['name']:<22}{r['median_s'] * 1e3:>10.1f}{iqr:>14}{r['vs_ddp']:>8.2f}{vs_ds:>7}{blocked:>17}")
    shares = ", ".join(f"z{stage} " + ("-" if share is None else f"{100 * share:.0f}%")
                       for stage, share in summary["hidden_comm_share"].items())
    lines.append(f"communication hidden by overlap_comm (1 - blocked on / blocked off): {shares}")
    return "\n".join(lines)


# --- ranks --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch.distributed as dist

        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = measure(args)
        dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, None, buffer.getvalue()))
    except BaseException:  # report instead of leaving the parent waiting
        queue.put((rank, traceback.format_exc(), None))


def run(args) -> dict:
    """Spawn the ranks, collect their measurements, and summarize them."""
    load_at_start = os.getloadavg()[0]  # other work on the machine skews every number: report it
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, args.world, port, args, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, error, payload = queue.get(timeout=args.timeout)
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = torch.load(io.BytesIO(payload))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    summary = summarize(args, [results[r] for r in range(args.world)])
    summary["params"] = sum(p.numel() for p in build_model(args).parameters())
    summary["load_average"] = {"start": load_at_start, "end": os.getloadavg()[0]}
    return summary


def parse_args(argv=None) -> argparse.Namespace:
    from importlib.util import find_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks on this machine")
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps dropped before measuring")
    parser.add_argument("--model", default="gpt-small-cpu", help="a size from raydeep.models.GPT_SIZES")
    parser.add_argument("--n-layer", type=int, default=2, help="override the size's layer count (0: keep it)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="per rank")
    parser.add_argument("--gas", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--bucket", type=int, default=500_000,
                        help="reduce/all-gather bucket in elements (also DDP's bucket): several buckets per "
                             "model give overlap something to overlap")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="skip DeepSpeed")
    parser.add_argument("--json", help="also write the summary, with every step time, to this path")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the ranks")
    args = parser.parse_args(argv)
    if args.deepspeed and find_spec("deepspeed") is None:
        print("DeepSpeed is not installed: measuring raydeep and DDP only", file=sys.stderr)
        args.deepspeed = False
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    summary = run(args)
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
