"""One real ``raydeep train`` run on the package's shared cluster (tests/ray/conftest.py), 2 workers
of the tiny GPT, 5 steps (a run costs the suite half a minute, so it checks two things):

- the step watchdog: rank 1 sleeps 5 s inside step 3's forward (tests.ray.plain:sleepy_gpt) under
  a 2 s step timeout, which the watchdog (a look every 0.5 s) passes 2.5 s before the sleep ends.
  Its dump names the sleeping function, the driver prints where rank 1 is, and the run still
  finishes;
- two sections written elsewhere train unchanged: the field report's 175B
  ``activation_checkpointing`` section (partitioned and contiguous checkpoints, number_checkpoints
  12, boundary synchronisation), whose per-step metrics carry the checkpoint-profile columns,
  empty since the section's ``profile`` is false (that only ``partition_activations`` is warned
  about is checked where the config is loaded: tests/unit/test_activation_report_config.py); and
  the ``zero_optimization`` section of DeepSpeed's ZeRO++ tutorial
  (``jobs/configs/deepspeed_zeropp_tutorial.json``: qwZ, hpZ over 16 ranks, qgZ). On one machine
  the two workers are one node, so hpZ (16 ranks per secondary partition, not below the world
  size) is switched off with a warning printed at load; qgZ runs within the node (its workers log
  that it only pays across nodes) and qwZ's int8 all-gathers run.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from raydeep.cli import main
from raydeep.metrics import read_metrics
from tests.ray.plain import SLEEPY_CALL

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "jobs" / "configs"
STEPS = 5
HUNG_STEP = SLEEPY_CALL  # one micro batch per step (16 = 2 workers x 8), so one forward per step


@pytest.fixture(scope="module")
def run(shared_ray, tmp_path_factory) -> dict:
    """The run's directory and what its driver printed. The driver is this process (as the
    shared cluster's driver, its ``sys.path`` reaches the workers, which import the model from
    tests.ray.plain); what it prints is captured here."""
    out = tmp_path_factory.mktemp("watched")
    checkpointing = json.loads((CONFIGS / "seed_175b_zero3_offload.json").read_text())["activation_checkpointing"]
    zero = json.loads((CONFIGS / "deepspeed_zeropp_tutorial.json").read_text())["zero_optimization"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["train", "--address", shared_ray.address, "--worker-resources", '{"trainer": 1}',
                     "--storage-path", str(out), "--name", "hang", "--model", "tests.ray.plain:sleepy_gpt",
                     "--num-workers", "2", "--steps", str(STEPS), "--checkpoint-every", "0", "--data", "synthetic",
                     "--set", "raydeep.step_timeout_s=2", "--set", "raydeep.min_step_timeout_s=0",
                     "--set", f"activation_checkpointing={json.dumps(checkpointing)}",
                     "--set", f"zero_optimization={json.dumps(zero)}"])
    assert code == 0, (stdout.getvalue() + stderr.getvalue())[-3000:]
    return {"dir": out / "hang", "out": stdout.getvalue(), "err": stderr.getvalue()}


def thread_section(dump: str, marker: str = "(running the step) ---") -> str:
    """The stack of the thread that ran the step, from a watchdog dump."""
    return dump.split(marker, 1)[1].split("\n--- thread ", 1)[0]


def test_a_rank_stuck_in_a_step_is_reported_and_the_run_finishes(run):
    err = run["err"]
    dump = run["dir"] / "diagnostics" / "attempt-0" / f"hang-step{HUNG_STEP}-rank1.txt"
    assert dump.is_file(), sorted(p.name for p in run["dir"].glob("diagnostics/*/*"))
    text = dump.read_text()
    assert text.startswith(f"rank 1 has been in step {HUNG_STEP} for ")
    assert "in sleep_in_forward" in thread_section(text)

    message = err.split(f"raydeep: rank 1 has been in step {HUNG_STEP} for ", 1)[1].split("\nraydeep: ", 1)[0]
    assert "(watchdog timeout 2.0 s)" in message and "in sleep_in_forward" in message
    assert f"full dump of every thread: {dump}" in message
    assert err.count(f"raydeep: rank 1 has been in step {HUNG_STEP} ") == 1  # once per record

    summary = json.loads((run["dir"] / "summary.json").read_text())
    assert summary["global_steps"] == STEPS
    hangs = {(h["rank"], h["step"]): h for h in summary["hangs"]}
    assert "in sleep_in_forward" in hangs[(1, HUNG_STEP)]["stack"]
    assert (0, HUNG_STEP) in hangs  # rank 0 waits for rank 1 in a collective: every rank reports
    print(err[err.index("raydeep: rank "):])  # shown with -rA: what the driver printed


def test_the_report_and_tutorial_sections_train_unchanged(run):
    summary = json.loads((run["dir"] / "summary.json").read_text())
    assert summary["global_steps"] == STEPS and math.isfinite(summary["final_loss"])
    assert summary["zero_stage"] == 3
    metrics = read_metrics(str(run["dir"]))
    assert metrics.num_rows == STEPS and metrics.column("checkpoint_forward_s").null_count == STEPS
    output = run["out"] + run["err"]
    assert "zero_hpz_partition_size = 16 is not below the world size 2" in output, output[-3000:]
