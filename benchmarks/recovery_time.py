"""How long from a killed worker to the next completed step? Several SIGKILLs in one run.

    python -m benchmarks.recovery_time [--kills 3] [--workers 2]

Trains the tiny GPT at ZeRO-3 on a local Ray cluster (one CPU per worker) and, each time the
current attempt has passed a new checkpoint, SIGKILLs its rank 1. Ray Train notices the dead
worker, restarts the whole worker group, and raydeep resumes from the checkpoint. For every kill
it prints when, after the kill, the new group's train function started, when its engine was built
and the checkpoint loaded, and when its first step completed, then the median of the last.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time


class Killer:
    """on_progress callback: kill rank 1 of the current attempt once it has checkpointed."""

    def __init__(self, kills: int, every: int):
        self.kills, self.every = kills, every
        self.killed_at: list[float] = []
        self.attempts: list[dict] = []

    def __call__(self, snapshot: dict) -> None:
        self.attempts, latest = snapshot["attempts"], snapshot["latest"]
        if len(self.killed_at) >= self.kills or not self.attempts or latest is None:
            return
        current = self.attempts[-1]
        if len(self.attempts) != len(self.killed_at) + 1 or 1 not in current["workers"]:
            return  # the previous kill's restart has not reported yet
        if latest["attempt"] == current["index"] and latest["step"] > current["resumed_from_step"] + self.every:
            self.killed_at.append(time.time())
            os.kill(current["workers"][1]["pid"], signal.SIGKILL)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    args = parser.parse_args(argv)
    from raydeep.ray import TrainSpec, fit

    killer = Killer(args.kills, args.every)
    steps = (args.kills + 1) * (2 * args.every + 2) + 4
    with tempfile.TemporaryDirectory() as storage:
        spec = TrainSpec(num_workers=args.workers, steps=steps, checkpoint_every=args.every, storage_path=storage,
                         name="recovery", max_failures=args.kills)
        summary = fit(spec, on_progress=killer, log_to_driver=False)
    print(f"{os.cpu_count()} cores, {args.workers} workers x 1 CPU, tiny GPT ZeRO-3, {len(killer.killed_at)} SIGKILLs "
          f"(seconds after each kill):")
    firsts = []
    for kill, attempt in zip(killer.killed_at, killer.attempts[1:]):
        entered, ready, first = (attempt[k] - kill for k in ("entered_at", "started_at", "first_step_at"))
        firsts.append(first)
        print(f"  resumed at step {attempt['resumed_from_step']:3d}: train function started {entered:5.1f}, "
              f"engine built and checkpoint loaded {ready:5.1f}, first step done {first:5.1f}")
    if firsts:
        print(f"  kill -> next completed step: median {statistics.median(firsts):.1f} s "
              f"(min {min(firsts):.1f}, max {max(firsts):.1f}); run restarts {summary['restarts']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
