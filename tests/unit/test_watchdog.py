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


class SteppedClock:
    """Stands in for the watchdog module's ``time``: ``monotonic()`` moves only when the test moves
    it, so what the watchdog sees does not depend on how a loaded machine schedules its thread
    (every other attribute is the real ``time`` module's). It counts the watchdog's checks, so a
    test can wait until the watchdog has looked at the moved clock."""

    def __init__(self):
        self.now = 1000.0  # a multiple of 1/8 far from 0: sums of eighths stay exact
        self.checks, self._turn = 0, threading.Condition()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)

    def watch(self, watchdog: StepWatchdog) -> None:
        original = watchdog.check

        def check():  # the watchdog's thread looks up self.check on every pass
            try:
                return original()
            finally:
                with self._turn:
                    self.checks += 1
                    self._turn.notify_all()
        watchdog.check = check

    def advance(self, seconds: float) -> None:
        """Move the clock, then wait for two whole checks: the first may have read the clock
        before it moved, the second cannot have. The wait's limit is no timing assertion: it only
        keeps a watchdog that stopped checking from hanging the test."""
        with self._turn:
            self.now += seconds
            target = self.checks + 2
            assert self._turn.wait_for(lambda: self.checks >= target, timeout=60), "the watchdog stopped checking"


def stepped_watchdog(monkeypatch, sink, timeout_s: float) -> tuple[StepWatchdog, SteppedClock]:
    from raydeep.ray import watchdog as module

    clock = SteppedClock()
    monkeypatch.setattr(module, "time", clock)
    watchdog = StepWatchdog(sink, step_timeout_s=timeout_s, min_step_timeout_s=0, interval_s=0.005)
    clock.watch(watchdog)
    return watchdog, clock


def nap_in_step(clock: SteppedClock, *seconds: float) -> None:
    """The step's work as the watchdog sees it: the clock moves by each of ``seconds`` in turn,
    each seen by the watchdog, while this frame is on the step's thread's stack."""
    for s in seconds:
        clock.advance(s)


def test_a_long_step_is_reported_once_and_short_steps_never(monkeypatch):
    reported = []
    # The timeout and the naps are multiples of 1/8: the elapsed times the watchdog computes are exact.
    watchdog, clock = stepped_watchdog(monkeypatch, reported.append, timeout_s=0.25)
    try:
        for step in (1, 2, 3):
            watchdog.step_started(step)
            nap_in_step(clock, 0.125)
            watchdog.step_finished(0.125)
        watchdog.step_started(4)
        # At exactly the timeout a step is not hung yet; an eighth later it is; checks at three
        # more eighths past that must not report it again.
        nap_in_step(clock, *[0.125] * 6)
        watchdog.step_finished(0.75)
        watchdog.step_started(5)
        nap_in_step(clock, 0.125)
        watchdog.step_finished(0.125)
    finally:
        watchdog.stop()
    assert [hang.step for hang in reported] == [4]
    hang = reported[0]
    # Every check saw every clock value, so the report came at the first one past the timeout:
    # an early report says 0.25 or less, a late one more than 0.375.
    assert hang.elapsed_s == 0.375 and hang.timeout_s == 0.25
    name, stack = hang.stacks[0]  # the thread that ran the step comes first
    assert name == threading.current_thread().name and "in nap_in_step" in stack
    assert all("raydeep-step-watchdog" != n for n, _ in hang.stacks)


def test_a_failing_sink_never_reaches_training(monkeypatch, caplog):
    def broken(hang):
        raise RuntimeError("sink down")

    watchdog, clock = stepped_watchdog(monkeypatch, broken, timeout_s=0.125)
    watchdog.step_started(1)
    nap_in_step(clock, 0.25)
    watchdog.step_finished(0.25)
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
def reported_hang(tmp_path, monkeypatch):
    monitor = FakeMonitor()
    reporter = HangReporter(str(tmp_path / "run"), rank=1, monitor=monitor, token="t0")
    reporter.attempt = 2
    watchdog, clock = stepped_watchdog(monkeypatch, reporter, timeout_s=0.1)
    watchdog.step_started(7)
    nap_in_step(clock, 0.25)
    watchdog.step_finished(0.25)
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
