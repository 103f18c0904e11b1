"""RunMonitor: a small actor on the driver's node that the workers tell what they are doing.

Ray Train keeps only the metrics of checkpointed reports and shows the driver nothing while
``fit()`` runs, so the workers send step events here (rank 0, fire-and-forget: training never
waits on it) and the driver polls it for the progress bar, the attempt history (world size,
worker pids and nodes per attempt) and the recovery times of the summary. Every rank's step
watchdog (:mod:`raydeep.ray.watchdog`) reports a hung step here too, for the driver to print.
It holds no training state: losing it loses only the display.
"""
from __future__ import annotations

import ray

# Hang records kept for the driver: the first ones say where a run got stuck; a timeout set too
# low could report every step of every rank, and the dump files on storage keep them all anyway.
MAX_HANGS = 100
# DeepSpeed console lines kept for the driver, which reads them as they come; the oldest go first.
MAX_CONSOLE_LINES = 10_000


@ray.remote(num_cpus=0)
class RunMonitor:
    def __init__(self):
        self._attempts: list[dict] = []
        self._workers: dict[str, dict[int, dict]] = {}
        self._latest: dict | None = None
        self._hangs: list[dict] = []
        self._console: list[str] = []
        self._console_dropped = 0  # lines before self._console[0]

    def attempt_started(self, token: str, record: dict) -> None:
        self._attempts.append({**record, "token": token, "index": len(self._attempts), "first_step_at": None,
                               "last_step_at": None, "first_step": None, "last_step": None})

    def worker_started(self, token: str, rank: int, info: dict) -> None:
        self._workers.setdefault(token, {})[rank] = info

    def step_done(self, token: str, event: dict) -> None:
        event = dict(event)
        self._console.extend(event.pop("console", ()))
        excess = len(self._console) - MAX_CONSOLE_LINES
        if excess > 0:
            del self._console[:excess]
            self._console_dropped += excess
        attempt = next((a for a in self._attempts if a["token"] == token), None)
        if attempt is not None:
            if attempt["first_step_at"] is None:
                attempt["first_step_at"], attempt["first_step"] = event["time"], event["step"]
            attempt["last_step_at"], attempt["last_step"] = event["time"], event["step"]
        self._latest = {**event, "attempt": attempt["index"] if attempt else None}

    def hang(self, token: str, record: dict) -> None:
        """A rank's step outlived the watchdog's timeout (any rank sends these, not only rank 0)."""
        if len(self._hangs) < MAX_HANGS:
            self._hangs.append({**record, "token": token})

    def snapshot(self, console_from: int = 0) -> dict:
        """The run so far, and the console lines numbered ``console_from`` on (``console_next``
        is where the next snapshot's should start)."""
        attempts = [{**a, "workers": dict(sorted(self._workers.get(a["token"], {}).items()))} for a in self._attempts]
        start = max(console_from - self._console_dropped, 0)
        return {"attempts": attempts, "latest": self._latest, "hangs": list(self._hangs),
                "console": self._console[start:], "console_next": self._console_dropped + len(self._console)}


def start_monitor():
    """A RunMonitor pinned to this (the driver's) node, so losing a worker node never loses it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return RunMonitor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
