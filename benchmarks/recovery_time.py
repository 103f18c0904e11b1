"""What a lost worker costs: steps lost, seconds to the next step, the snapshots' price, goodput.

    python -m benchmarks.recovery_time [--kills 3] [--workers 2] [--snapshots 1] [--pairs 3] [--offload]

Trains the tiny GPT at ZeRO-3 on a local Ray cluster (one CPU per worker), in three parts:

1. **Kills.** Storage checkpoints every 10 steps and memory snapshots every ``--snapshots`` steps;
   5 steps into each attempt its rank 1 is SIGKILLed (between checkpoints). For each kill: the
   steps lost (the failed attempt's last step less the step the next one resumed at) and, counted
   from the kill, when the new worker processes started, when their train function was entered,
   when the engine was built, when the state was restored and when the first step completed.
2. **Snapshot overhead.** The same run without kills and without snapshots, with snapshots every
   ``"auto"`` (at most 3% by construction) and every ``--snapshots`` steps, alternated ``--pairs``
   times: the wall time of the steps (first to last step, snapshots included) against no
   snapshots', and the share of it spent in snapshots as the step metrics measured it.
3. **Goodput.** 100 steps with a kill every 20 steps against the same run without kills: useful
   steps per second of each (the run's wall time, start-up and recoveries included), and the ratio.

``--offload``: the optimizer states in offload actors (``raydeep.offload_target`` "actors", half a
CPU each) on the local cluster, which then also carries the ``raydeep_offload`` resource: the
actors hold their parts of each snapshot and outlive the killed rank, and the next attempt's
actors read them from there (``raydeep.ray.snapshot_holders``).
"""
from __future__ import annotations

import argparse
import glob
import os
import signal
import statistics
import tempfile
import time

CHECKPOINT_EVERY = 10
OVERHEAD_STEPS = 60
GOODPUT_STEPS, KILL_EVERY = 100, 20


class Killer:
    """on_progress callback: SIGKILL rank 1 of the current attempt once ``due(latest step,
    attempt)`` says so, at most ``kills`` times, one kill per attempt."""

    def __init__(self, kills: int, due):
        self.kills, self.due = kills, due
        self.killed: list[tuple[float, int]] = []  # (when, the latest step reported then)
        self.attempts: list[dict] = []

    def __call__(self, snapshot: dict) -> None:
        self.attempts, latest = snapshot["attempts"], snapshot["latest"]
        if len(self.killed) >= self.kills or not self.attempts or latest is None:
            return
        current = self.attempts[-1]
        if len(self.attempts) != len(self.killed) + 1 or 1 not in current["workers"]:
            return  # the previous kill's restart has not reported yet
        if latest["attempt"] == current["index"] and self.due(latest["step"], current):
            self.killed.append((time.time(), latest["step"]))
            os.kill(current["workers"][1]["pid"], signal.SIGKILL)


OFFLOAD = ['zero_optimization.offload_optimizer.device="cpu"', 'raydeep.offload_target="actors"',
           "raydeep.offload_actor_cpus=0.5"]


def spec_for(storage: str, name: str, steps: int, workers: int, snapshots: str, checkpoint_every: int,
             max_failures: int = 0, offload: bool = False):
    from raydeep.ray import TrainSpec

    every = '"auto"' if snapshots == "auto" else str(int(snapshots))  # overrides take JSON values
    return TrainSpec(num_workers=workers, steps=steps, checkpoint_every=checkpoint_every, storage_path=storage,
                     name=name, max_failures=max_failures, overrides=[f"raydeep.memory_snapshot_every={every}",
                                "raydeep.metrics=true", *(OFFLOAD if offload else [])])


def start_offload_cluster(workers: int) -> None:
    """The local cluster ``fit`` would start, with the offload resource and half a CPU more per
    offload actor (one per worker)."""
    import ray

    from raydeep.ray.trainer import LOCAL_CLUSTER_TUNING

    for key, value in LOCAL_CLUSTER_TUNING.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, workers) + (workers + 1) // 2,
             resources={"raydeep_offload": 1}, log_to_driver=False)


def kills(args) -> None:
    from raydeep.ray import fit

    killer = Killer(args.kills, lambda step, attempt: step >= attempt["resumed_from_step"] + 5)
    steps = (args.kills + 1) * CHECKPOINT_EVERY + 4
    with tempfile.TemporaryDirectory() as storage:
        spec = spec_for(storage, "kills", steps, args.workers, args.snapshots, CHECKPOINT_EVERY, args.kills,
                        args.offload)
        summary = fit(spec, on_progress=killer, log_to_driver=False)
        first_rows, median = _first_steps(spec.run_uri)
    tier = ", optimizer states in offload actors" if args.offload else ""
    print(f"1. kills: {os.cpu_count()} cores, {args.workers} workers x 1 CPU, tiny GPT ZeRO-3{tier}, checkpoints "
          f"every {CHECKPOINT_EVERY} steps, memory snapshots every {args.snapshots}; {len(killer.killed)} SIGKILLs of "
          f"rank 1 (seconds after each kill):")
    print("   killed after  resumed at  lost  from              processes  train fn  engine  restored  first step")
    firsts, lost = [], []
    for (kill, _), attempt, recovery in zip(killer.killed, killer.attempts[1:], summary["recoveries"]):
        started = [w.get("process_started_at") for w in attempt["workers"].values()]
        process = max(started) - kill if None not in started and started else float("nan")
        entered, built, ready, first = (attempt[k] - kill for k in ("entered_at", "built_at", "started_at",
                                                                      "first_step_at"))
        firsts.append(first)
        lost.append(recovery["steps_lost"])
        source = recovery["restored_from"].split(" global_step")[0]  # "memory snapshot" or "checkpoint"
        print(f"   step {recovery['last_step_before']:7d}  {recovery['resumed_from_step']:10d}  {recovery['steps_lost']:4d}  "
              f"{source:16s}  {process:9.1f}  {entered:8.1f}  {built:6.1f}  {ready:8.1f}  {first:10.1f}")
    if firsts:
        print(f"   steps lost per kill: {lost}; kill -> next completed step: median {statistics.median(firsts):.1f} s "
              f"(min {min(firsts):.1f}, max {max(firsts):.1f})")
    print("   the first step of each restarted attempt, from its metrics row (seconds), and the run's median step:")
    print("   attempt  step  " + "  ".join(f"{name:>9s}" for name in STEP_COLUMNS.values()))
    for label, step, row in [(str(r["attempt"]), str(r["step"]), r) for r in first_rows] + [("median", "", median)]:
        print(f"   {label:>7s}  {step:>4s}  " + "  ".join(f"{row[c] or 0:9.3f}" for c in STEP_COLUMNS))


# The step's metrics columns the kill part prints, with their headings.
STEP_COLUMNS = {"step_s": "step_s", "forward_s": "forward", "backward_s": "backward", "comm_wait_s": "comm wait",
                "optimizer_s": "optimizer", "other_s": "other", "checkpoint_s": "snapshot"}


def _first_steps(run_uri: str) -> tuple[list[dict], dict]:
    """The metrics row of each restarted attempt's first step, and the run's median of each of
    :data:`STEP_COLUMNS`."""
    from raydeep.metrics import read_metrics

    rows = read_metrics(run_uri).to_pylist()
    firsts = [min((r for r in rows if r["attempt"] == a), key=lambda r: r["step"])
              for a in sorted({r["attempt"] for r in rows}) if a > 0]
    return firsts, {c: statistics.median(r[c] or 0.0 for r in rows) for c in STEP_COLUMNS}


def _steps_wall(run_uri: str) -> tuple[float, float]:
    """(seconds from the first step's end to the last step's before the final checkpoint, seconds
    of it in memory snapshots), from the run's step metrics."""
    import pyarrow.parquet as pq

    table = pq.read_table(glob.glob(f"{run_uri}/metrics/**/*.parquet", recursive=True)).to_pandas()
    table = table.sort_values("step")
    body = table[table.step < table.step.max()]
    return float(body.time.max() - body.time.min()), float(body.checkpoint_s.fillna(0).iloc[1:].sum())


def overhead(args) -> None:
    from raydeep.ray import fit

    settings = list(dict.fromkeys(["0", "auto", str(args.snapshots)]))  # --snapshots 0: the first two only
    walls: dict[str, list[float]] = {s: [] for s in settings}
    shares: dict[str, list[float]] = {s: [] for s in settings}
    for pair in range(args.pairs):
        for setting in settings:
            with tempfile.TemporaryDirectory() as storage:
                spec = spec_for(storage, "overhead", args.overhead_steps, args.workers, setting, 0)
                fit(spec, log_to_driver=False)
                wall, in_snapshots = _steps_wall(spec.run_uri)
            walls[setting].append(wall)
            shares[setting].append(in_snapshots / wall)
    base = statistics.median(walls["0"])
    print(f"2. snapshot overhead: {args.overhead_steps} steps, {args.workers} workers, {args.pairs} runs each, alternated "
          "(median wall of steps 2..N-1; paired: the median of each round's ratio to the no-snapshot run "
          "just before it, which a machine's drift between rounds does not move):")
    for setting in settings:
        wall = statistics.median(walls[setting])
        paired = statistics.median(w / w0 for w, w0 in zip(walls[setting], walls["0"]))
        print(f"   memory_snapshot_every={setting:5s} {wall:6.2f} s  x{wall / base:.3f} of no snapshots "
              f"(paired x{paired:.3f}); in snapshots {100 * statistics.median(shares[setting]):4.1f}% of the wall")


def goodput(args) -> None:
    from raydeep.ray import fit

    elapsed = {}
    for label, count in (("no kills", 0), (f"a kill every {KILL_EVERY} steps", GOODPUT_STEPS // KILL_EVERY - 1)):
        killer = Killer(count, lambda step, attempt: step >= KILL_EVERY * (len(killer.killed) + 1))
        with tempfile.TemporaryDirectory() as storage:
            summary = fit(spec_for(storage, "goodput", GOODPUT_STEPS, args.workers, args.snapshots, CHECKPOINT_EVERY,
                                   count), on_progress=killer, log_to_driver=False)
        elapsed[label] = summary["elapsed_s"], len(killer.killed), sum(r["steps_lost"] or 0
                                                                       for r in summary["recoveries"])
    print(f"3. goodput: {GOODPUT_STEPS} steps, checkpoints every {CHECKPOINT_EVERY}, snapshots every {args.snapshots}:")
    rates = {}
    for label, (seconds, killed, lost) in elapsed.items():
        rates[label] = GOODPUT_STEPS / seconds
        print(f"   {label:22s} {seconds:6.1f} s  {killed} kills, {lost} steps lost  {rates[label]:5.2f} useful steps/s")
    quiet, killed = rates.values()
    print(f"   goodput with kills / without: {killed / quiet:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--snapshots", default="1", help='memory snapshot cadence of the kill and goodput runs '
                        '(steps, or "auto")')
    parser.add_argument("--pairs", type=int, default=3, help="runs of each snapshot setting in the overhead part")
    parser.add_argument("--overhead-steps", type=int, default=OVERHEAD_STEPS, help="steps of each overhead run")
    parser.add_argument("--parts", default="kills,overhead,goodput")
    parser.add_argument("--offload", action="store_true", help="the optimizer states in offload actors (kills only)")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if args.offload:
        if parts != ["kills"]:
            parser.error("--offload measures the kills part only: pass --parts kills")
        start_offload_cluster(args.workers)
    for name, part in (("kills", kills), ("overhead", overhead), ("goodput", goodput)):
        if name in parts:
            part(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
