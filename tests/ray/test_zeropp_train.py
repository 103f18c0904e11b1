"""``raydeep train`` with the ``zero_optimization`` section of DeepSpeed's ZeRO++ tutorial as
written (``jobs/configs/deepspeed_zeropp_tutorial.json``: qwZ, hpZ over 16 ranks, qgZ) on the
tiny GPT: it trains. On one machine its two workers are one node, so hpZ (16 ranks per secondary
partition, not below the world size) is switched off with a warning at load; qgZ runs within the
node (its workers log that it only pays across nodes) and qwZ's int8 all-gathers run."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_tutorial_section_trains_unchanged(ray_cluster, tmp_path):
    section = json.loads((REPO / "jobs" / "configs" / "deepspeed_zeropp_tutorial.json").read_text())["zero_optimization"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "raydeep", "train", "--address", ray_cluster.address,
               "--worker-resources", '{"trainer": 1}', "--storage-path", str(tmp_path), "--name", "zeropp",
               "--num-workers", "2", "--steps", "3", "--data", "synthetic",
               "--set", f"zero_optimization={json.dumps(section)}"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    summary = json.loads((tmp_path / "zeropp" / "summary.json").read_text())
    assert summary["global_steps"] == 3 and math.isfinite(summary["final_loss"])
    assert "zero_hpz_partition_size = 16 is not below the world size 2" in output, output[-3000:]
