"""The step watchdog in a real ``raydeep train`` run on the package's shared cluster
(tests/ray/conftest.py): rank 1 sleeps 5 s inside step 3's forward (tests.ray.plain:sleepy_gpt)
under a 2 s step timeout, which the watchdog (a look every 0.5 s) passes 2.5 s before the sleep
ends. Its dump names the sleeping function, the driver prints where rank 1 is, and the run still
finishes."""
from __future__ import annotations

import json

import pytest

from raydeep.cli import main
from tests.ray.plain import SLEEPY_CALL

pytestmark = pytest.mark.slow

STEPS = 5
HUNG_STEP = SLEEPY_CALL  # one micro batch per step (16 = 2 workers x 8), so one forward per step


def thread_section(dump: str, marker: str = "(running the step) ---") -> str:
    """The stack of the thread that ran the step, from a watchdog dump."""
    return dump.split(marker, 1)[1].split("\n--- thread ", 1)[0]


def test_a_rank_stuck_in_a_step_is_reported_and_the_run_finishes(connected, tmp_path, capsys):
    capsys.readouterr()
    code = main(["train", "--model", "tests.ray.plain:sleepy_gpt", "--num-workers", "2", "--steps", str(STEPS),
                 "--checkpoint-every", "0", "--storage-path", str(tmp_path), "--name", "hang",
                 "--address", connected.address,
                 "--set", "raydeep.step_timeout_s=2", "--set", "raydeep.min_step_timeout_s=0"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    run = tmp_path / "hang"

    dump = run / "diagnostics" / "attempt-0" / f"hang-step{HUNG_STEP}-rank1.txt"
    assert dump.is_file(), sorted(p.name for p in run.glob("diagnostics/*/*"))
    text = dump.read_text()
    assert text.startswith(f"rank 1 has been in step {HUNG_STEP} for ")
    assert "in sleep_in_forward" in thread_section(text)

    message = err.split(f"raydeep: rank 1 has been in step {HUNG_STEP} for ", 1)[1].split("\nraydeep: ", 1)[0]
    assert "(watchdog timeout 2.0 s)" in message and "in sleep_in_forward" in message
    assert f"full dump of every thread: {dump}" in message
    assert err.count(f"raydeep: rank 1 has been in step {HUNG_STEP} ") == 1  # once per record

    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_steps"] == STEPS
    hangs = {(h["rank"], h["step"]): h for h in summary["hangs"]}
    assert "in sleep_in_forward" in hangs[(1, HUNG_STEP)]["stack"]
    assert (0, HUNG_STEP) in hangs  # rank 0 waits for rank 1 in a collective: every rank reports
    print(err[err.index("raydeep: rank "):])  # shown with -rA: what the driver printed
