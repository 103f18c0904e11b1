"""``raydeep train`` on the tiny GPT with the field report's 175B ``activation_checkpointing``
section as written (partitioned and contiguous checkpoints, number_checkpoints 12, boundary
synchronisation): it trains, and its per-step metrics carry the checkpoint-profile columns, empty
since the section's ``profile`` is false. (That only ``partition_activations`` is warned about is
checked where the config is loaded: tests/unit/test_activation_report_config.py.)"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from raydeep.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]


def test_the_report_section_trains_unchanged(ray_cluster, tmp_path):
    section = json.loads((REPO / "jobs" / "configs" / "seed_175b_zero3_offload.json").read_text())[
        "activation_checkpointing"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # On the package's shared cluster (tests/ray/conftest.py), not a cluster of its own.
    command = [sys.executable, "-m", "raydeep", "train", "--address", ray_cluster.address,
               "--worker-resources", '{"trainer": 1}', "--storage-path", str(tmp_path), "--name", "report",
               "--num-workers", "1", "--steps", "2", "--data", "synthetic",
               "--set", f"activation_checkpointing={json.dumps(section)}"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["global_steps"] == 2 and math.isfinite(summary["final_loss"])
    metrics = read_metrics(str(tmp_path / "report"))
    assert metrics.num_rows == 2 and metrics.column("checkpoint_forward_s").null_count == 2
