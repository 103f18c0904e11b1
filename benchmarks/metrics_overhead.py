"""What do the per-step metrics (``raydeep.metrics``: a Parquet row per step) cost? Step time with
them on and off, same ranks, interleaved.

    python -m benchmarks.metrics_overhead [--world 2] [--reps 5] [--steps 60] [--model gpt-tiny]

``--world`` gloo ranks on this machine run raydeep's own worker loop (``raydeep.ray.loop.
run_training``, the loop a ``raydeep train`` worker runs) through a plain in-process session:
no Ray, no checkpoints but the one at the end. Each repetition trains one run with the metrics
off and one with them on, the order alternating between repetitions, so drift in the machine's
load hits both alike. A step's time is the interval between the starts of consecutive steps on
rank 0: the whole iteration, so the metrics' per-step all-gather, the row and the flush every
``FLUSH_EVERY`` rows are in it. The first ``--warmup`` steps of every run are dropped.

It prints the median step time of each mode, its quartiles, and the overhead two ways:

- A/B: the median over repetitions of ``median(on) / median(off)`` within a repetition. On a
  shared machine the load changes between two runs seconds apart, so this one is noisy;
- in the loop: the seconds rank 0 spends inside the metrics' calls per step (the all-gather, the
  row, the flushes), timed around them in the runs with metrics on, over the median step time
  with them off. It misses indirect costs (caches, garbage collection) but hardly moves with
  the load.

``--json`` writes every interval. The target is an overhead of at most 2%.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

from raydeep.bench.ranks import on_gloo_ranks

MODES = ("off", "on")


class PlainSession:
    """The loop's session without Ray: no checkpoint to resume, saves dropped, step starts timed."""

    driver_id = ""

    def __init__(self):
        self.skipped: list = []
        self.step_starts: list[float] = []

    def restore(self, engine):
        return None

    def save(self, engine, tag, client_state, metrics) -> None:
        pass

    def snapshot(self, engine, tag, client_state) -> None:
        pass

    def snapshot_room(self):
        return None

    def drop_snapshots(self) -> None:
        pass

    def preemption_notice(self):
        return None

    def attempt_started(self, record) -> None:
        pass

    def step_started(self, step: int) -> None:
        self.step_starts.append(time.perf_counter())

    def step_finished(self, seconds: float) -> None:
        pass

    def step_done(self, event) -> None:
        pass

    def close(self) -> None:
        pass


def _train(args: argparse.Namespace, out_dir: str) -> dict:
    import torch.distributed as dist

    from raydeep.ray.batch_plan import plan_batches
    from raydeep.ray.loop import run_training
    from raydeep.ray.spec import DEFAULT_DS_CONFIG, TrainSpec

    world = dist.get_world_size()
    spent = _time_the_metrics_calls()
    intervals: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
    in_metrics: list[float] = []  # seconds per step inside the metrics' calls, per run with them on
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            ds_config = copy.deepcopy(DEFAULT_DS_CONFIG)
            ds_config["raydeep"] = {"metrics": mode == "on"}
            spec = TrainSpec(ds_config=ds_config, model=args.model, data="builtin", num_workers=world,
                             steps=args.warmup + args.steps + 1, checkpoint_every=0, storage_path=out_dir,
                             name=f"{mode}-{rep}")
            schedule = plan_batches(spec.resolved_ds_config(), world, world)
            session = PlainSession()  # n + 1 step starts time n steps
            spent[0] = 0.0
            run_training(spec, spec.resolved_ds_config(), schedule, session)
            starts = session.step_starts
            intervals[mode].append([b - a for a, b in zip(starts, starts[1:])][args.warmup:])
            if mode == "on":
                in_metrics.append(spent[0] / len(starts))
    return {"intervals": intervals, "in_metrics_s": in_metrics}


def _time_the_metrics_calls() -> list[float]:
    """Wrap every per-step call of ``StepMetrics`` in a timer; returns the running total."""
    from raydeep.ray.step_metrics import StepMetrics

    spent = [0.0]

    def timed(method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    for name in ("record", "before_checkpoint", "checkpoint_saved", "close"):
        setattr(StepMetrics, name, timed(getattr(StepMetrics, name)))
    return spent


def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        times = on_gloo_ranks(args.world, _train, (args, out_dir), threads=args.threads)[0]
    setup = {"world": args.world, "model": args.model, "reps": args.reps, "steps": args.steps,
             "warmup": args.warmup, "threads": args.threads}
    return summarise(times["intervals"], times["in_metrics_s"]) | setup


def summarise(intervals: dict[str, list[list[float]]], in_metrics_s: list[float]) -> dict:
    """Medians and quartiles per mode over every measured step, and the overhead both ways (see
    the module docstring)."""
    def quartiles(values):
        if len(values) < 2:
            return [values[0]] * 3
        low, mid, high = statistics.quantiles(values, n=4)
        return [low, mid, high]

    every = {mode: [t for run in runs for t in run] for mode, runs in intervals.items()}
    ratios = [statistics.median(on) / statistics.median(off) for on, off in zip(intervals["on"], intervals["off"])]
    medians = {mode: statistics.median(times) for mode, times in every.items()}
    return {"median_step_s": medians, "quartiles_s": {mode: quartiles(times) for mode, times in every.items()},
            "ratio_per_rep": ratios, "overhead": statistics.median(ratios) - 1.0,
            "in_metrics_s_per_step": statistics.median(in_metrics_s),
            "in_loop_overhead": statistics.median(in_metrics_s) / medians["off"], "step_s": intervals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the (off, on) pair")
    parser.add_argument("--steps", type=int, default=60, help="measured steps per run (a flush every 50 rows)")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every run")
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    started = time.time()
    result = measure(args)
    print(f"{args.model}, ZeRO-3 (the default ds_config), {args.world} gloo ranks x {args.threads} thread(s), "
          f"{args.reps} x (off, on), {args.steps} measured steps per run; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {time.time() - started:.0f} s")
    print(f"  {'metrics':>7}  {'median ms':>9}  {'q1 ms':>8}  {'q3 ms':>8}")
    for mode in MODES:
        q1, _, q3 = result["quartiles_s"][mode]
        print(f"  {mode:>7}  {result['median_step_s'][mode] * 1e3:9.2f}  {q1 * 1e3:8.2f}  {q3 * 1e3:8.2f}")
    print(f"  overhead, A/B (median of per-repetition ratios on/off): {100 * result['overhead']:+.2f}%  "
          f"(per repetition: {', '.join(f'{r:.3f}' for r in result['ratio_per_rep'])})")
    print(f"  overhead, in the loop (rank 0 inside the metrics' calls): "
          f"{result['in_metrics_s_per_step'] * 1e3:.2f} ms per step = {100 * result['in_loop_overhead']:.2f}% "
          f"of the median step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
