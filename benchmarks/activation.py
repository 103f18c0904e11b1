"""What each activation-checkpointing choice saves and costs: bytes saved for backward per
micro-batch and step time, for one rank.

    python -m benchmarks.activation [--model gpt-small-cpu] [--micro 4] [--reps 5] [--json out.json]

Rows: no checkpointing; attention (raydeep's default); every block; every k-th block
(``number_checkpoints`` = layers / k); every block with ``cpu_checkpointing``; every block with
``contiguous_memory_optimization`` (``number_checkpoints`` = layers).

- **saved bytes**: the distinct storages autograd saves for backward in one forward, counted with
  ``saved_tensors_hooks`` installed around it (parameters excluded: they are kept anyway). The
  checkpoint stores hand the hook what they keep, so an input kept in host memory is counted too;
  the ``host bytes`` column is the part ``cpu_checkpointing`` keeps in host memory (on a CPU run
  it is already there, so the device total is the same as every block's; on a GPU it leaves).
- **step ms**: median over ``--reps`` of forward + backward + optimizer step, the rows' steps taken
  round-robin after one warm-up round (a shared machine's load drifts; it hits every row alike).
- **allocs/step, peak MB**: one more step under ``torch.profiler`` (``profile_memory``): the
  allocations the CPU allocator made in it, and the peak of what was allocated within the step
  (fragmentation itself is a caching allocator's; on CPU the count is what can change).
- **doctor**: ``raydeep doctor``'s activation estimate for the same choice
  (:func:`raydeep.doctor.memory.saved_activation_bytes`), against the counted bytes.

Targets (issue 35): every block's saved bytes at most none's / layers plus the block inputs;
every block's step at most 35% slower than none's, attention's in between.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

ROWS = ("none", "attention", "block", "every-k", "block+cpu", "block+contig")


def _config(row: str, layers: int, k: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if row == "none":
        return cfg
    section = {"cpu_checkpointing": True} if row == "block+cpu" else {}
    if row == "every-k":
        section["number_checkpoints"] = layers // k
    if row == "block+contig":
        # DeepSpeed allows contiguous buffers only with partitioned activations (a no-op here: one rank)
        section.update(contiguous_memory_optimization=True, number_checkpoints=layers, partition_activations=True)
    modules = "attention" if row == "attention" else "block"
    return {**cfg, "activation_checkpointing": section, "raydeep": {"checkpoint_modules": modules}}


def _saved_bytes(engine, model, x, y) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x, y)
    engine.backward(loss)
    engine.zero_grad()
    return sum(saved.values())


def build(row: str, model_name: str, micro: int, k: int = 2) -> dict:
    """One row's engine and batch, with its saved bytes counted and the doctor's estimate."""
    import raydeep
    from raydeep.doctor.memory import saved_activation_bytes
    from raydeep.doctor.shape import ModelShape
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt(model_name)
    layers, seq = model.config.n_layer, model.config.block_size
    cfg = _config(row, layers, k)
    cfg["train_micro_batch_size_per_gpu"] = micro
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (micro, seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    saved = _saved_bytes(engine, model, x, y)
    # what the blocks' checkpointer kept in host memory in that forward (one checkpointer serves them all)
    run = next((m.__dict__["_raydeep_checkpointer"] for m in model.blocks if "_raydeep_checkpointer" in m.__dict__),
               None)
    host = run.store.host_bytes if run is not None and run.store is not None else 0
    choice = {"none": "none", "attention": "attention"}.get(row, "block")
    checkpointed = layers // k if row == "every-k" else layers
    doctor = saved_activation_bytes(ModelShape.from_gpt(model_name), micro, "fp32", choice, checkpointed=checkpointed)
    return {"row": row, "saved_bytes": saved, "host_bytes": host, "doctor_bytes": doctor, "layers": layers,
            "block_input_bytes": micro * seq * model.config.n_embd * 4, "engine": engine, "batch": (x, y)}


def _step_seconds(row: dict) -> float:
    engine, (x, y) = row["engine"], row["batch"]
    began = time.perf_counter()
    engine.backward(engine(x, y))
    engine.step()
    return time.perf_counter() - began


def _allocations(row: dict) -> dict:
    """One step under the profiler: how many allocations the CPU allocator made, their bytes,
    and the peak of the bytes allocated during the step over those live when it began."""
    from torch.profiler import ProfilerActivity, profile

    engine, (x, y) = row["engine"], row["batch"]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.backward(engine(x, y))
        engine.step()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for n in sizes:  # in the order they happened: + an allocation, - a free
        live += n
        peak = max(peak, live)
    return {"allocations": sum(1 for n in sizes if n > 0), "allocated_bytes": sum(n for n in sizes if n > 0),
            "peak_step_bytes": peak}


def measure(model_name: str, micro: int, reps: int, k: int = 2) -> list[dict]:
    """Every row: the steps are timed round-robin (one step of each row in turn, after one warm-up
    round), so that the load of a shared machine drifting over the run hits every row alike; then
    one more step of each is profiled for its allocations."""
    rows = [build(row, model_name, micro, k) for row in ROWS]
    times: dict[str, list[float]] = {r["row"]: [] for r in rows}
    for rep in range(reps + 1):
        for r in rows:
            seconds = _step_seconds(r)
            if rep:
                times[r["row"]].append(seconds)
    for r in rows:
        r.update(_allocations(r))
    for r in rows:
        del r["engine"], r["batch"]
        r["step_ms"] = 1000 * statistics.median(times[r["row"]])
    return rows


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["row"] == "none")
    lines = [f"{'choice':<12} {'saved MB':>9} {'vs none':>8} {'host MB':>8} {'step ms':>8} {'vs none':>8} "
             f"{'doctor MB':>10} {'doctor/counted':>15} {'allocs/step':>12} {'peak MB':>8}"]
    for r in rows:
        lines.append(f"{r['row']:<12} {r['saved_bytes'] / 1e6:>9.2f} {r['saved_bytes'] / base['saved_bytes']:>8.2f} "
                     f"{r['host_bytes'] / 1e6:>8.2f} {r['step_ms']:>8.1f} {r['step_ms'] / base['step_ms']:>8.2f} "
                     f"{r['doctor_bytes'] / 1e6:>10.2f} {r['doctor_bytes'] / r['saved_bytes']:>15.3f} "
                     f"{r['allocations']:>12} {r['peak_step_bytes'] / 1e6:>8.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small-cpu")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--k", type=int, default=2, help="every-k row: checkpoint every k-th block")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.micro, args.reps, args.k)
    print(f"{args.model}, micro-batch {args.micro}, fp32, one rank; every-k: k = {args.k}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
