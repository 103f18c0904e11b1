"""Driver-side watching: poll the RunMonitor while ``fit()`` blocks, draw a progress bar, and
say where a rank that hangs in a step is."""
from __future__ import annotations

import logging
import re
import sys
import threading

import ray

logger = logging.getLogger("raydeep")


class MonitorPoller(threading.Thread):
    """Polls the monitor every ``interval_s`` and hands each snapshot to the callbacks.

    Runs beside ``trainer.fit()`` (which keeps the main thread, so Ctrl-C still aborts the run
    gracefully through Ray Train's handler). ``last`` is the newest snapshot after ``stop()``.
    """

    def __init__(self, monitor, callbacks, interval_s: float = 0.25):
        super().__init__(name="raydeep-monitor-poller", daemon=True)
        self.monitor, self.callbacks, self.interval_s = monitor, [c for c in callbacks if c], interval_s
        self.last: dict = {"attempts": [], "latest": None, "hangs": [], "console": [], "console_next": 0}
        self._stop_event = threading.Event()

    def poll(self) -> dict:
        try:
            self.last = ray.get(self.monitor.snapshot.remote(self.last["console_next"]), timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            return self.last  # a busy or lost monitor costs only the display
        for callback in list(self.callbacks):
            try:
                callback(self.last)
            except Exception:  # noqa: BLE001 - a broken display must not stop the run
                logger.exception("progress callback %r failed; it is not called again", callback)
                self.callbacks.remove(callback)
        return self.last

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            self.poll()

    def stop(self) -> dict:
        self._stop_event.set()
        self.join(timeout=30)
        return self.poll()


class ProgressBar:
    """A rich progress bar of the global step, with what the latest step said (:func:`step_status`),
    and above it DeepSpeed's console lines from rank 0 (``print_console``: off where the workers'
    logs reach the console anyway)."""

    def __init__(self, total_steps: int, console=None, print_console: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console or Console()
        columns = [TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                   TimeRemainingColumn()]
        self.progress = Progress(*columns, console=self.console)
        self.task = self.progress.add_task("train", total=total_steps, status="")
        self._attempts_shown = 0
        self.print_console = print_console

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, snapshot: dict) -> None:
        attempts = snapshot["attempts"]
        for attempt in attempts[self._attempts_shown:]:
            how = "started" if attempt["index"] == 0 else "restarted"
            for tag, reason in attempt.get("skipped_checkpoints", []):
                self.console.print(f"[yellow]warning:[/yellow] checkpoint {tag} is damaged and was skipped: {reason}")
            self.console.print(f"worker group {how}: {attempt['world_size']} workers (micro batch "
                               f"{attempt['micro_batch']} x {attempt['grad_accum']} accumulation), from step "
                               f"{attempt['resumed_from_step']}")
            if attempt.get("skipped_checkpoints"):
                self.console.print(f"  resumed from the newest intact checkpoint instead, at step "
                                   f"{attempt['resumed_from_step']}")
        self._attempts_shown = len(attempts)
        if self.print_console:
            for line in snapshot.get("console", ()):
                self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        latest = snapshot["latest"]
        if latest:
            world = attempts[latest["attempt"]]["world_size"] if latest.get("attempt") is not None else None
            self.progress.update(self.task, completed=latest["step"], status=step_status(latest, world))
        elif attempts:
            self.progress.update(self.task, completed=attempts[-1]["resumed_from_step"])


def step_status(latest: dict, world_size: int | None) -> str:
    """The bar's text for the latest step event: loss, tokens/s, MFU (when the chip's peak is
    known), the loss scale (fp16 runs), the workers, the restarts so far and the optimizer's
    phase (1-bit Adam, 0/1 Adam: warm-up / compressed).

    >>> step_status({"loss": 4.81234, "tokens_s": 12345.6, "mfu": 0.4123, "loss_scale": 65536.0, "restarts": 1,
    ...              "phase": "compressed"}, 2)
    'loss 4.812  12,346 tok/s  MFU 41.2%  scale 65536  workers 2  restarts 1  compressed'
    """
    parts = [f"loss {latest['loss']:.3f}"]
    if latest.get("tokens_s") is not None:
        parts.append(f"{latest['tokens_s']:,.0f} tok/s")
    if latest.get("mfu") is not None:
        parts.append(f"MFU {100 * latest['mfu']:.1f}%")
    if latest.get("loss_scale") is not None:
        parts.append(f"scale {latest['loss_scale']:g}")
    parts.append(f"workers {world_size if world_size is not None else '-'}")
    parts.append(f"restarts {latest.get('restarts', 0)}")
    if latest.get("phase"):
        parts.append(latest["phase"])
    return "  ".join(parts)


class HangPrinter:
    """Prints each hang the ranks' step watchdogs report (the snapshot's ``"hangs"``) to stderr,
    once: where the rank is stuck, and where its dump of every thread lies.

    It writes to ``sys.stderr`` as it is at each call, so under a live rich progress bar (which
    redirects stderr) the message appears above the bar, and without one it is plain stderr.
    """

    def __init__(self, frames: int = 8):
        self.frames, self._shown = frames, 0

    def __call__(self, snapshot: dict) -> None:
        hangs = snapshot.get("hangs", [])
        for record in hangs[self._shown:]:
            print(describe_hang(record, self.frames), file=sys.stderr, flush=True)
        self._shown = len(hangs)


def describe_hang(record: dict, frames: int = 8) -> str:
    """The driver's message for one hang record: the rank, step and seconds, the last collective,
    the innermost ``frames`` frames of the stack that runs the step, and the dump's path."""
    stack = [frame for frame in re.split(r'(?m)^(?=  File ")', record.get("stack") or "") if frame.strip()]
    shown = "".join(stack[-frames:]).rstrip("\n")
    return (f"raydeep: rank {record['rank']} has been in step {record['step']} for {record['elapsed_s']:.1f} s "
            f"(watchdog timeout {record['timeout_s']:.1f} s); last collective: "
            f"{record.get('last_collective') or 'none recorded'}; its stack:\n{shown}\n"
            f"full dump of every thread: {record.get('dump') or 'not written (see the worker log)'}")
