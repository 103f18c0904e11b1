"""``raydeep train`` on the tiny GPT with two sections written elsewhere, unchanged, in one run (a
run costs the suite half a minute):

- the field report's 175B ``activation_checkpointing`` section (partitioned and contiguous
  checkpoints, number_checkpoints 12, boundary synchronisation): it trains, and its per-step
  metrics carry the checkpoint-profile columns, empty since the section's ``profile`` is false.
  (That only ``partition_activations`` is warned about is checked where the config is loaded:
  tests/unit/test_activation_report_config.py.)
- the ``zero_optimization`` section of DeepSpeed's ZeRO++ tutorial
  (``jobs/configs/deepspeed_zeropp_tutorial.json``: qwZ, hpZ over 16 ranks, qgZ). On one machine
  the two workers are one node, so hpZ (16 ranks per secondary partition, not below the world
  size) is switched off with a warning printed at load; qgZ runs within the node (its workers log
  that it only pays across nodes) and qwZ's int8 all-gathers run.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from raydeep.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "jobs" / "configs"


def test_the_report_and_tutorial_sections_train_unchanged(ray_cluster, tmp_path):
    checkpointing = json.loads((CONFIGS / "seed_175b_zero3_offload.json").read_text())["activation_checkpointing"]
    zero = json.loads((CONFIGS / "deepspeed_zeropp_tutorial.json").read_text())["zero_optimization"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # On the package's shared cluster (tests/ray/conftest.py), not a cluster of its own.
    command = [sys.executable, "-m", "raydeep", "train", "--address", ray_cluster.address,
               "--worker-resources", '{"trainer": 1}', "--storage-path", str(tmp_path), "--name", "report",
               "--num-workers", "2", "--steps", "2", "--data", "synthetic",
               "--set", f"activation_checkpointing={json.dumps(checkpointing)}",
               "--set", f"zero_optimization={json.dumps(zero)}"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["global_steps"] == 2 and math.isfinite(summary["final_loss"])
    metrics = read_metrics(str(tmp_path / "report"))
    assert metrics.num_rows == 2 and metrics.column("checkpoint_forward_s").null_count == 2
    assert "zero_hpz_partition_size = 16 is not below the world size 2" in output, output[-3000:]
