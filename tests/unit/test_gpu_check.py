"""The GPU check on a CPU-only machine: its dry run, and a ``summary.json`` that says what happened
whichever stage fails (no wheels, a failing test, a benchmark contender that raises).

The GPU image has no Ray: the dry run runs with ``import ray`` made to fail, so an import of Ray
anywhere on the engine's path fails this test although Ray is installed here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The benchmark's whole code path on the CPU in seconds: the tiny GPT, gloo instead of NCCL.
CPU_MFU = "--device cpu --model gpt-tiny --seq 32 --micro 2 --steps 3 --warmup 1"


def gpu_check(out: Path, *mode: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(out), *mode],
                          env={**os.environ, "PYTHON": sys.executable, **env}, capture_output=True, text=True,
                          timeout=300)
    return done, json.loads((out / "summary.json").read_text())


@pytest.fixture
def without_ray(tmp_path) -> str:
    """A ``ray`` package that refuses to import, first on the path."""
    shadow = tmp_path / "no-ray" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('Ray is not on the GPU image')\n")
    return str(shadow.parent)


def test_the_dry_run_imports_collects_and_plans_without_ray(tmp_path, without_ray):
    done, summary = gpu_check(tmp_path / "gpu", "--dry-run", PYTHONPATH=without_ray)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["mode"] == "--dry-run" and summary["failed_stage"] is None
    assert [name for name in summary["stages"]] == ["import", "tests", "mfu"]
    for name in ("test_fp32_parity_with_the_float64_reference[0]", "test_rank_owns_its_device",
                 "test_half_precision_follows_the_float64_reference[bf16]",
                 "test_zero_init_partitions_built_on_the_cpu_meet_nccl_on_the_gpu",
                 "test_a_checkpoint_saved_on_cuda_loads_on_cpu_at_another_world_size"):
        assert f"tests/gpu/test_gpu_engine.py::{name}" in summary["collected"]
    plan = summary["mfu"]
    assert plan["model"] == "gpt-1.3b" and len(plan["contenders"]) == 4


def test_the_benchmark_counts_flops_as_six_n_plus_attention():
    """6N + 12 L h s, N the parameters that do matmul work (all but the position table; the tied
    token table is the output projection), counted here from the model's own tensors."""
    import torch

    from benchmarks import mfu

    args = mfu.main(["--dry-run"])
    model = mfu._model(type("Args", (), {"model": "gpt-1.3b", "seq": 2048})(), "meta")
    unique = {id(p): p for name, p in model.named_parameters() if not name.startswith("wpe.")}
    n = sum(p.numel() for p in unique.values())
    assert isinstance(model.wpe, torch.nn.Embedding) and model.lm_head.weight is model.wte.weight
    assert args["flops_per_token"] == 6 * n + 12 * 24 * 2048 * 2048


def test_no_wheels_is_an_error_that_names_the_fix(tmp_path):
    done, summary = gpu_check(tmp_path / "gpu", GPU_WHEELS=str(tmp_path / "missing"))
    assert done.returncode == 2
    assert summary["failed_stage"] == "install" and summary["exit"] == 2
    assert "no " in summary["failure"] and "bash benchmarks/gpu_wheels.sh" in summary["failure"]
    assert summary["tests"] == {} and summary["mfu"] is None


FAILING_TESTS = '''
import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    assert True


def test_fails():
    assert 1 == 2, "a GPU test that fails"
'''


def test_a_failing_test_and_a_raising_contender_are_both_reported(tmp_path):
    """Installed (an empty wheel folder: everything is present here), one test fails, then the
    benchmark runs anyway and one of its contenders raises: the summary names the first failed
    stage, each test's result and message, the error of the contender and the others' numbers."""
    (tmp_path / "wheels").mkdir()
    tests = tmp_path / "gpu_tests" / "test_simulated.py"
    tests.parent.mkdir()
    tests.write_text(FAILING_TESTS)
    done, summary = gpu_check(tmp_path / "gpu", GPU_WHEELS=str(tmp_path / "wheels"), GPU_CHECK_TESTS=str(tests),
                              GPU_CHECK_MFU_ARGS=f"{CPU_MFU} --break-contender 'raydeep stage 3'")
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary["failed_stage"] == "tests"
    assert [(name, row["exit"]) for name, row in summary["stages"].items()] == [
        ("install", 0), ("import", 0), ("tests", 1), ("mfu", 1)]
    results = {name.rsplit("::", 1)[1]: r for name, r in summary["tests"].items()}
    assert results["test_passes"]["result"] == "passed"
    assert results["test_fails"]["result"] == "failed" and "a GPU test that fails" in results["test_fails"]["message"]
    assert summary["test_counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}
    mfu = summary["mfu"]["results"]
    assert "unknown key" in mfu["raydeep stage 3"]["error"]
    for name in ("plain", "raydeep stage 0", "raydeep stage 3, host optimizer"):
        assert mfu[name]["tokens_per_s"] > 0 and len(mfu[name]["losses"]) == 3 and mfu[name]["skipped_steps"] == 0
    # the MFU's denominator and the chip's measured rate, stated
    assert summary["peak_tflops"] == 989.0 and "not in raydeep's table" in summary["peak_source"]
    assert summary["matmul_tflops"] > 0
