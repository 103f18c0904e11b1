"""``raydeep demo``: train the built-in GPT with ZeRO on a local Ray cluster of CPU workers.

The run is an ordinary ``raydeep train`` run (Ray Train workers, the embedded corpus — the Python
standard library's own source as bytes — checkpoints, progress bar, summary.json), followed by
rank 0's model-state memory as the engine measured it, next to the ZeRO formula.
"""
from __future__ import annotations

import math
import time


def run_demo(steps: int = 200, world_size: int = 2, stage: int = 3, model: str = "gpt-tiny",
             storage_path: str = "runs") -> int:
    """Train and print the summary; returns 0 when the loss fell."""
    from rich.console import Console

    from raydeep.ray import TrainSpec
    from raydeep.ray.train_command import run_train_command

    spec = TrainSpec(model=model, num_workers=world_size, steps=steps, checkpoint_every=max(1, steps // 2),
                     storage_path=storage_path, name=time.strftime("demo-%Y%m%d-%H%M%S"),
                     overrides=[f"zero_optimization.stage={stage}"])
    code = run_train_command(spec, verbose=False)
    if code:
        return code
    from raydeep.ray.summary import read_json

    summary = read_json(f"{spec.run_uri}/summary.json")
    print_memory(Console(), summary, world_size, stage)
    return 0 if summary["final_loss"] < summary["first_loss"] else 1


def print_memory(console, summary: dict, world_size: int, stage: int) -> None:
    from raydeep.estimate import estimate_model_states

    est = estimate_model_states(summary["num_parameters"], world_size, stage, precision="fp32")
    mem = summary["memory_rank0"]
    console.print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} "
                  f"(ln 256 = {math.log(256):.3f} is chance for byte tokens) | {summary['num_parameters']:,} parameters")
    console.print(f"rank 0 model states (bytes), measured vs ZeRO-{stage} formula at {world_size} ranks: "
                  f"params {mem['params']:,} ({est.params:,}), grads {mem['grads']:,} ({est.grads:,}), "
                  f"optimizer states {mem['optimizer_states']:,} ({est.optimizer_states:,})")
