"""What `raydeep train`'s progress bar shows of the monitor's snapshots (raydeep.ray.progress)."""
from __future__ import annotations

import io

from rich.console import Console

from raydeep.ray.progress import ProgressBar, step_status

ATTEMPTS = [{"index": 0, "world_size": 2, "micro_batch": 8, "grad_accum": 1, "resumed_from_step": 0},
            {"index": 1, "world_size": 1, "micro_batch": 8, "grad_accum": 2, "resumed_from_step": 4}]


def event(**changes) -> dict:
    """A step event as rank 0 sends it (raydeep.ray.loop), with the monitor's attempt index."""
    return {"step": 6, "loss": 4.81234, "samples": 96, "seconds": 0.4, "time": 0.0, "phase": None, "tokens_s": 5120.4,
            "mfu": None, "loss_scale": None, "restarts": 1, "attempt": 1, **changes}


def test_a_cpu_run_shows_loss_tokens_workers_and_restarts():
    assert step_status(event(), 1) == "loss 4.812  5,120 tok/s  workers 1  restarts 1"


def test_mfu_when_the_peak_is_known_the_scale_in_fp16_runs_and_the_phase():
    status = step_status(event(mfu=0.3871, loss_scale=32768.0, phase="compressed", restarts=0), 2)
    assert status == "loss 4.812  5,120 tok/s  MFU 38.7%  scale 32768  workers 2  restarts 0  compressed"


def test_the_bar_prints_the_attempts_and_the_latest_step():
    out = io.StringIO()
    with ProgressBar(16, Console(file=out, width=200, force_terminal=False)) as bar:
        bar({"attempts": ATTEMPTS, "latest": event(), "hangs": []})
    text = out.getvalue()
    assert "worker group started: 2 workers" in text and "worker group restarted: 1 workers" in text
    bar_line = next(line for line in text.splitlines() if line.startswith("step"))
    assert "6/16" in bar_line and "loss 4.812  5,120 tok/s  workers 1  restarts 1" in bar_line


def test_the_bar_prints_deepspeeds_console_lines_above_it_unless_told_not_to():
    lines = ["time (ms) | fwd: 41.20 | bwd: 96.10 | bwd_inner: 80.00 | bwd_allreduce: 16.10 | step: 12.00",
             "Comm. Op            Message Size        Count"]
    for print_console in (True, False):
        out = io.StringIO()
        with ProgressBar(16, Console(file=out, width=200, force_terminal=False), print_console=print_console) as bar:
            bar({"attempts": ATTEMPTS, "latest": event(), "hangs": [], "console": lines, "console_next": 2})
        assert all((line in out.getvalue()) == print_console for line in lines), out.getvalue()
