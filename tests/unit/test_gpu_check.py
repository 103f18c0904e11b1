"""The GPU check's dry run works on any machine: raydeep imports (without Ray), the GPU tests are
collected, and the MFU benchmark's model and configs build on the meta device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out), "--dry-run"],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "--dry-run" and summary["pytest_exit"] == 0 and summary["benchmark_exit"] == 0
    collected = (out / "pytest.txt").read_text()
    for name in ("test_fp32_parity_with_cpu_reference", "test_zero_init_partitions_built_on_the_cpu_meet_nccl",
                 "test_a_checkpoint_saved_on_cuda_loads_on_cpu_at_another_world_size"):
        assert name in collected
    plan = summary["mfu"]
    assert plan["model"] == "gpt-1.3b" and 1.2e9 < plan["params"] < 1.4e9
    # 6N + 12 L h s with N the non-embedding parameters: 24 layers, hidden 2048, seq 2048.
    assert plan["flops_per_token"] > 6 * 1.2e9 + 12 * 24 * 2048 * 2048
    assert len(plan["contenders"]) == 4
