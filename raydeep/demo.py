"""``raydeep demo``: train the built-in GPT with ZeRO on local CPU ranks over the embedded corpus.

Spawns ``world_size`` gloo processes, each running the engine on its slice of every global
batch (the corpus is the Python standard library's own source, tokenised to bytes), shows a
progress bar on rank 0 and ends with a summary: loss, throughput, and per-rank model-state
memory measured by the engine next to the ZeRO formula.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import os
import socket
import time

DEMO_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 30, "total_num_steps": 300,
                                                      "warmup_max_lr": 2e-3, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, config: dict, steps: int, model_name: str, queue) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    # Import submodules explicitly: a spawned child can see the package without running its __init__.
    from raydeep import comm
    from raydeep.data import builtin_dataset
    from raydeep.engine.api import init_distributed, initialize
    from raydeep.models import build_gpt

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = build_gpt(model_name)
    engine, *_ = initialize(model=model, config=config)
    data = builtin_dataset(model.config.block_size)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    global_batch = engine.train_batch_size()
    first = last = None
    start = time.perf_counter()
    for step in range(steps):
        micro = engine.train_micro_batch_size_per_gpu()
        ids = order[(step * global_batch + rank * micro) % len(data):][:micro]
        x = torch.stack([data[int(i)][0] for i in ids])
        y = torch.stack([data[int(i)][1] for i in ids])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        value = comm.all_reduce_scalar(loss.item(), "sum") / world
        first = value if first is None else first
        last = value
        if rank == 0:
            queue.put(("step", step + 1, value))
    elapsed = time.perf_counter() - start
    queue.put(("done", rank, {"first": first, "last": last, "elapsed": elapsed, "samples": steps * global_batch,
                              "memory": engine.memory_breakdown(), "numel": sum(p.numel() for p in model.parameters()),
                              "comm": engine.comm_stats()}))
    torch.distributed.destroy_process_group()


def run_demo(steps: int = 300, world_size: int = 2, stage: int = 3, model: str = "gpt-tiny") -> int:
    """Train and print the summary; returns 0 when the loss fell."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    config = {**DEMO_CONFIG, "zero_optimization": {**DEMO_CONFIG["zero_optimization"], "stage": stage}}
    config["scheduler"] = {**config["scheduler"], "params": {**config["scheduler"]["params"], "total_num_steps": steps}}
    console = Console()
    console.print(f"raydeep demo: {model}, ZeRO stage {stage}, {world_size} CPU ranks (gloo), {steps} steps, "
                  "corpus: the Python standard library as bytes")
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, config, steps, model, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports = {}
    columns = [TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
               TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=steps, loss="-")
        while len(reports) < world_size:
            try:
                kind, a, b = queue.get(timeout=5)
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:  # a rank crashed: stop the others instead of waiting forever
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"rank process exited with code {dead[0].exitcode}; see its output above")
                continue
            if kind == "step":
                progress.update(task, completed=a, loss=f"{b:.3f}")
            else:
                reports[a] = b
    for p in procs:
        p.join()
    return _summarise(console, reports, world_size, stage)


def _summarise(console, reports: dict, world_size: int, stage: int) -> int:
    from raydeep.estimate import estimate_model_states

    r0 = reports[0]
    est = estimate_model_states(r0["numel"], world_size, stage, precision="fp32")
    console.print(f"loss {r0['first']:.3f} -> {r0['last']:.3f} | {r0['samples'] / r0['elapsed']:.1f} samples/s "
                  f"| {r0['elapsed']:.1f} s | {r0['numel']:,} parameters")
    console.print("per-rank model states (bytes): measured vs ZeRO formula")
    for rank in sorted(reports):
        mem = reports[rank]["memory"]
        console.print(f"  rank {rank}: params {mem['params']:,} (formula {est.params:,}), grads {mem['grads']:,} "
                      f"(formula {est.grads:,}), optimizer states {mem['optimizer_states']:,} "
                      f"(formula {est.optimizer_states:,})")
    comm = {op: v["bytes"] for op, v in r0["comm"].items()}
    console.print(f"communication, rank 0, whole run (bytes): {comm}")
    return 0 if r0["last"] < r0["first"] else 1
