"""The step watchdog without Ray: the timeout rule, one report per hung step and none for quick
ones, the dump file and the record the driver gets, and the driver's message."""
from __future__ import annotations

import threading
import time

import pytest

from raydeep.ray.progress import HangPrinter, describe_hang
from raydeep.ray.watchdog import FIRST_STEP_TIMEOUT_S, HangReporter, StepWatchdog, step_timeout


def test_the_first_step_gets_the_warm_up_timeout():
    assert step_timeout([], min_timeout_s=60) == FIRST_STEP_TIMEOUT_S == 600


def test_the_timeout_is_ten_medians_of_the_last_twenty_steps_and_at_least_the_minimum():
    assert step_timeout([1.0, 2.0, 100.0], min_timeout_s=0) == 20.0  # the median ignores one slow step
    assert step_timeout([1.0, 2.0, 100.0], min_timeout_s=60) == 60
    assert step_timeout([50.0] * 30 + [1.0] * 20, min_timeout_s=0) == 10.0  # only the last 20 count


def test_a_set_timeout_applies_to_every_step():
    assert step_timeout([], min_timeout_s=60, fixed_s=2.0) == 2.0
    assert step_timeout([10.0], min_timeout_s=60, fixed_s=2.0) == 2.0


def nap_in_step(seconds: float) -> None:
    time.sleep(seconds)


def test_a_long_step_is_reported_once_and_short_steps_never():
    reported = []
    watchdog = StepWatchdog(reported.append, step_timeout_s=0.3, min_step_timeout_s=0, interval_s=0.02)
    try:
        for step in (1, 2, 3):
            watchdog.step_started(step)
            nap_in_step(0.05)
            watchdog.step_finished(0.05)
        watchdog.step_started(4)
        nap_in_step(0.8)  # several checks past the timeout: still one report
        watchdog.step_finished(0.8)
        watchdog.step_started(5)
        nap_in_step(0.05)
        watchdog.step_finished(0.05)
    finally:
        watchdog.stop()
    assert [hang.step for hang in reported] == [4]
    hang = reported[0]
    assert 0.3 < hang.elapsed_s < 0.8 and hang.timeout_s == 0.3
    name, stack = hang.stacks[0]  # the thread that ran the step comes first
    assert name == threading.current_thread().name and "in nap_in_step" in stack
    assert all("raydeep-step-watchdog" != n for n, _ in hang.stacks)


def test_a_failing_sink_never_reaches_training(caplog):
    def broken(hang):
        raise RuntimeError("sink down")

    watchdog = StepWatchdog(broken, step_timeout_s=0.05, min_step_timeout_s=0, interval_s=0.02)
    watchdog.step_started(1)
    nap_in_step(0.2)
    watchdog.step_finished(0.2)
    watchdog.stop()
    assert "failed to report" in caplog.text


class FakeMonitor:
    """Stands in for the RunMonitor actor handle: ``monitor.hang.remote(token, record)``."""

    def __init__(self):
        self.records = []
        self.hang = self

    def remote(self, token, record):
        self.records.append((token, record))


@pytest.fixture
def reported_hang(tmp_path):
    monitor = FakeMonitor()
    reporter = HangReporter(str(tmp_path / "run"), rank=1, monitor=monitor, token="t0")
    reporter.attempt = 2
    watchdog = StepWatchdog(reporter, step_timeout_s=0.1, min_step_timeout_s=0, interval_s=0.02)
    watchdog.step_started(7)
    nap_in_step(0.4)
    watchdog.step_finished(0.4)
    watchdog.stop()
    return tmp_path / "run", monitor


def test_the_reporter_writes_the_dump_and_tells_the_monitor(reported_hang):
    run, monitor = reported_hang
    dump = run / "diagnostics" / "attempt-2" / "hang-step7-rank1.txt"
    text = dump.read_text()
    assert text.startswith("rank 1 has been in step 7 for ") and "pid " in text and "last collective:" in text
    assert "(running the step) ---" in text and "in nap_in_step" in text.split("(running the step)")[1]
    [(token, record)] = monitor.records
    assert token == "t0" and record["rank"] == 1 and record["step"] == 7 and record["dump"] == str(dump)
    assert "in nap_in_step" in record["stack"] and record["attempt"] == 2


def test_the_driver_prints_each_hang_once(reported_hang, capsys):
    _, monitor = reported_hang
    record = monitor.records[0][1]
    message = describe_hang(record)
    assert message.startswith("raydeep: rank 1 has been in step 7 for ") and "(watchdog timeout 0.1 s)" in message
    assert message.count('  File "') <= 8 and "in nap_in_step" in message
    assert message.endswith(f"full dump of every thread: {record['dump']}")
    printer = HangPrinter()
    printer({"hangs": [record]})
    printer({"hangs": [record]})
    assert capsys.readouterr().err.count("raydeep: rank 1 has been in step 7") == 1
