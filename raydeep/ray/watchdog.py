"""The step watchdog: says which rank is stuck in a step, and where, long before the process
group times out.

A rank that hangs inside a step (a deadlocked collective, a stuck data read) blocks every other
rank at its next collective, and nothing is printed until torch.distributed's timeout fails the
run. So every rank runs a :class:`StepWatchdog` thread beside training: once a step has run longer
than its timeout (:func:`step_timeout`), it takes every thread's Python stack, once per step, and
hands the :class:`Hang` to a sink. On Ray Train runs the sink is a :class:`HangReporter`: it writes
the dump to ``<run>/diagnostics/attempt-<A>/hang-step<S>-rank<R>.txt`` and tells the driver's
RunMonitor, which prints where the rank is.

The watchdog only looks: it never stops or fails the step (the process-group timeout still does
that), never waits on the driver, and logs its own errors instead of raising them into training.
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

logger = logging.getLogger("raydeep")

FIRST_STEP_TIMEOUT_S = 600.0  # before any step finished: the first one includes the warm-up
TIMEOUT_FACTOR = 10  # a step this many times slower than usual is a hang, not noise
HISTORY = 20  # steps the usual step time is the median of
CHECK_INTERVAL_S = 0.5


def step_timeout(step_times: Sequence[float], min_timeout_s: float, fixed_s: float | None = None) -> float:
    """The seconds a step may run before it counts as hung: ``fixed_s`` when set, else
    ``max(min_timeout_s, 10 x the median of the last 20 step times)``, and 600 s before any
    step has finished.

    >>> step_timeout([], 60), step_timeout([1.0, 2.0, 30.0], 5), step_timeout([1.0] * 3, 60, fixed_s=2)
    (600.0, 20.0, 2)
    """
    if fixed_s is not None:
        return fixed_s
    if not step_times:
        return FIRST_STEP_TIMEOUT_S
    return max(min_timeout_s, TIMEOUT_FACTOR * statistics.median(list(step_times)[-HISTORY:]))


@dataclass
class Hang:
    """One step that outlived its timeout, as the watchdog saw it."""

    step: int
    elapsed_s: float
    timeout_s: float
    stacks: list[tuple[str, str]]  # (thread name, formatted stack): the step's thread first
    last_collective: str | None


def thread_stacks(first: int | None = None, skip: int | None = None) -> list[tuple[str, str]]:
    """Every thread's (name, Python stack): thread ``first`` (the one running the step), then the
    main thread, then the rest; thread ``skip`` (the watchdog itself) is left out."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != first, ident != main))
    return [(names.get(ident, f"thread {ident}"), "".join(traceback.format_stack(frames[ident])))
            for ident in order if ident != skip]


def last_collective() -> str | None:
    """The last collective this process issued, where raydeep.comm tracks it (else None)."""
    from raydeep import comm

    read = getattr(comm, "last_collective", None)
    return read() if read is not None else None


class StepWatchdog:
    """A daemon thread that checks the running step twice a second (see the module docstring).

    The training thread calls :meth:`step_started` and :meth:`step_finished` (they only note the
    time: they cost nothing and cannot fail) and :meth:`stop` at the end.
    """

    def __init__(self, on_hang: Callable[[Hang], None], step_timeout_s: float | None = None,
                 min_step_timeout_s: float = 60.0, interval_s: float = CHECK_INTERVAL_S):
        self.on_hang, self.interval_s = on_hang, interval_s
        self.fixed_s, self.min_s = step_timeout_s, min_step_timeout_s
        self.step_times: deque[float] = deque(maxlen=HISTORY)
        self._running: tuple[int, float, int] | None = None  # (step, started, the step's thread)
        self._reported: int | None = None  # the step already dumped: once per step is enough
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raydeep-step-watchdog", daemon=True)
        self._thread.start()

    def step_started(self, step: int) -> None:
        self._running = (step, time.monotonic(), threading.get_ident())

    def step_finished(self, seconds: float) -> None:
        self._running = None
        self.step_times.append(seconds)

    def stop(self) -> None:
        """Stop checking; a dump being written is given a moment (the thread is a daemon anyway)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1)

    def check(self) -> Hang | None:
        """Report the running step if it has outlived its timeout and was not reported yet."""
        running = self._running
        if running is None:
            return None
        step, started, thread = running
        elapsed = time.monotonic() - started
        timeout = step_timeout(tuple(self.step_times), self.min_s, self.fixed_s)
        if elapsed <= timeout or self._reported == step:
            return None
        self._reported = step
        hang = Hang(step, elapsed, timeout, thread_stacks(first=thread, skip=threading.get_ident()),
                    last_collective())
        self.on_hang(hang)
        return hang

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a broken watchdog must not take training down
                logger.exception("the step watchdog failed to report a slow step")


class HangReporter:
    """The sink of a Ray Train rank: the dump file through raydeep's storage layer (local paths
    and object stores alike), then a short record to the driver's RunMonitor, fire-and-forget."""

    def __init__(self, run_uri: str, rank: int, monitor=None, token: str = ""):
        self.run_uri, self.rank, self.monitor, self.token = run_uri, rank, monitor, token
        self.attempt = 0  # set once the attempt's number in the run is known

    def __call__(self, hang: Hang) -> None:
        from raydeep.storage import Storage

        rel = f"diagnostics/attempt-{self.attempt}/hang-step{hang.step}-rank{self.rank}.txt"
        storage = Storage.open(self.run_uri)
        dump: str | None = storage.describe(rel)
        try:
            storage.write(rel, self.dump_text(hang).encode(), fsync=False)
        except Exception:  # noqa: BLE001 - the driver still hears about the hang without the file
            logger.exception("could not write the step watchdog's dump to %s", dump)
            dump = None
        logger.warning("rank %d has been in step %d for %.1f s (watchdog timeout %.1f s); every thread's stack: %s",
                       self.rank, hang.step, hang.elapsed_s, hang.timeout_s, dump)
        if self.monitor is not None:
            self.monitor.hang.remote(self.token, {
                "rank": self.rank, "step": hang.step, "elapsed_s": hang.elapsed_s, "timeout_s": hang.timeout_s,
                "stack": hang.stacks[0][1] if hang.stacks else "", "last_collective": hang.last_collective,
                "dump": dump, "attempt": self.attempt, "host": socket.gethostname(), "pid": os.getpid(),
                "time": time.time()})

    def dump_text(self, hang: Hang) -> str:
        lines = [f"rank {self.rank} has been in step {hang.step} for {hang.elapsed_s:.1f} s "
                 f"(step watchdog timeout {hang.timeout_s:.1f} s)",
                 f"host {socket.gethostname()}, pid {os.getpid()}, attempt {self.attempt}, "
                 f"at {time.strftime('%Y-%m-%d %H:%M:%S')}",
                 f"last collective: {hang.last_collective or 'none recorded'}", ""]
        for index, (name, stack) in enumerate(hang.stacks):
            role = " (running the step)" if index == 0 else ""
            lines += [f"--- thread {name}{role} ---", stack]
        return "\n".join(lines)
