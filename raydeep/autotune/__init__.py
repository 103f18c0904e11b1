"""``raydeep autotune``: DeepSpeed's autotuner as Ray Tune trials.

    raydeep autotune ds_config.json --model gpt-tiny --num-workers 2 --steps 20 --memory-budget 2GB

The grid (ZeRO stage, micro batch at a fixed global batch, reduce bucket, activation
checkpointing, CPU optimizer offload; :mod:`raydeep.autotune.space`) is pruned by the doctor's
memory estimate before anything runs; every candidate left is one Train run, a Tune trial, stopped
early by ASHA when its throughput lags (:mod:`raydeep.autotune.run`). The command prints a table
of every candidate and writes the fastest finished one as a full ds_config, ready for
``raydeep train --config``. This module imports neither Ray nor torch: the CLI imports it at start.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def add_parser(sub) -> None:
    """Register ``raydeep autotune`` on the CLI's subparsers."""
    tune = sub.add_parser("autotune", help="search ZeRO stage, micro batch, buckets, checkpointing and offload "
                          "as Ray Tune trials; write the fastest config",
                          description="Prune DeepSpeed's autotuning grid (ZeRO stage, micro batch at a fixed global "
                          "batch, reduce bucket, activation checkpointing, CPU optimizer offload) by the doctor's "
                          "memory estimate, run each candidate left as a Ray Tune trial of one raydeep Train run, "
                          "stopped early by ASHA on tokens/s, print every candidate's result and write the fastest "
                          "finished one as a full ds_config.")
    tune.add_argument("config", metavar="CONFIG", help="the ds_config.json to start from (JSON or HJSON)")
    tune.add_argument("--model", default="gpt-tiny", help="GPT size (gpt-tiny, ...) or package.module:function")
    tune.add_argument("--data", default="builtin", help="builtin, synthetic, or a Parquet token dataset")
    tune.add_argument("--num-workers", type=_positive, default=2, metavar="N", help="the world size to tune for")
    tune.add_argument("--steps", type=_positive, default=20, help="steps per trial (a Tune report every steps/4)")
    tune.add_argument("--storage-path", default="runs", help="where the trials' runs and Tune's experiment go")
    tune.add_argument("--name", help="experiment name (default: autotune-<date>-<time>)")
    tune.add_argument("--memory-budget", metavar="BYTES", help="device memory per rank, e.g. 80GB: candidates the "
                      "doctor estimates above it are pruned, not run (default: no pruning)")
    tune.add_argument("--max-candidates", type=_positive, metavar="K", help="try at most K candidates, nearest to "
                      "CONFIG first (default: the whole grid)")
    tune.add_argument("--use-gpu", action="store_true", help="one GPU per worker (the estimate adds the caching "
                      "allocator's margin)")
    tune.add_argument("--cpus-per-worker", type=float, default=1.0)
    tune.add_argument("--address", help="Ray cluster to join, as for `raydeep train` ('local': a new one)")
    tune.add_argument("--out", help="the best config's path (default: <storage>/<name>/best_ds_config.json)")
    tune.add_argument("--verbose", action="store_true", help="show Tune's progress tables")
    tune.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from raydeep.autotune.run import run_trials
    from raydeep.autotune.space import (best_config, best_entry, format_table, model_shape, plan_candidates,
                                        unresolved_auto, write_best_config)
    from raydeep.doctor.shape import parse_bytes
    from raydeep.errors import InputError
    from raydeep.ray.spec import TrainSpec
    from raydeep.ray.summary import write_json
    from raydeep.ray.workload import check_workload

    try:
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    except ValueError as err:
        raise InputError("--memory-budget", str(err), value=args.memory_budget,
                         fix="e.g. --memory-budget 2GB") from None
    name = args.name or time.strftime("autotune-%Y%m%d-%H%M%S")
    storage = args.storage_path
    root = storage.rstrip("/") if "://" in storage else os.path.abspath(os.path.expanduser(storage))
    # The trials' Train runs live beside Tune's experiment, under <storage>/<name>/runs.
    spec = TrainSpec(ds_config=args.config, model=args.model, data=args.data, num_workers=args.num_workers,
                     use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker, steps=args.steps,
                     storage_path=f"{root}/{name}/runs", name=name)
    # The schedule's "auto" lengths filled from --steps; trials get the dict, not the path (Tune runs
    # each trial in its own working directory).
    resolved = spec.resolved_ds_config()
    spec = dataclasses.replace(spec, ds_config=resolved)
    check_workload(spec.model, spec.data, spec.seed)
    entries = plan_candidates(resolved, model_shape(args.model), args.num_workers, budget, on_device=args.use_gpu,
                              max_candidates=args.max_candidates)
    pruned = sum(e.status in ("pruned", "invalid") for e in entries)
    print(f"autotune {args.config}: {len(entries)} candidate(s) for {args.num_workers} worker(s), {pruned} pruned "
          "by the memory model", file=sys.stderr, flush=True)
    if pruned == len(entries):
        print(format_table(entries))
        raise InputError("--memory-budget", "every candidate's estimate exceeds it (or its config is invalid)",
                         value=args.memory_budget, fix="raise the budget, use more workers, or a smaller model")
    run_trials(spec, entries, storage_path=root, name=name, address=args.address, verbose=args.verbose)
    best = best_entry(entries)
    print(format_table(entries, best))
    write_json(f"{root}/{name}/autotune.json", [_as_row(e) for e in entries])
    if best is None:
        print("autotune: no trial finished: nothing to recommend (see the notes above)", file=sys.stderr)
        return 1
    out = args.out or f"{root}/{name}/best_ds_config.json"
    write_best_config(out, best_config(resolved, best))
    print(f"best: #{best.index} {best.candidate.label}: {best.tokens_s:,.0f} tokens/s, loss {best.loss:.4f}")
    print(f"wrote {out}")
    auto = unresolved_auto(args.config)
    if auto:
        print(f"note: {', '.join(auto)} were \"auto\" in {args.config}; written as resolved for --steps {args.steps}: "
              "set them for your run", file=sys.stderr)
    print(f"next: raydeep train --config {out} --num-workers {args.num_workers}")
    return 0


def _as_row(entry) -> dict:
    row = dataclasses.asdict(entry)
    row["label"] = entry.candidate.label
    return row
