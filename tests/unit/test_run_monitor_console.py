"""The RunMonitor's console lines: every line once to a reader that follows ``console_next``,
the oldest dropped past MAX_CONSOLE_LINES (the class's logic, without an actor)."""
from __future__ import annotations

from raydeep.ray import run_monitor as monitor_module

Monitor = monitor_module.RunMonitor.__ray_actor_class__


def step(monitor, n: int, lines: list[str]) -> None:
    monitor.step_done("t", {"step": n, "time": float(n), "console": lines})


def test_a_reader_following_the_cursor_sees_every_line_once_and_the_event_keeps_none():
    monitor = Monitor()
    monitor.attempt_started("t", {"world_size": 2})
    seen, cursor = [], 0
    for n in range(1, 6):
        step(monitor, n, [f"step {n} line {k}" for k in range(n % 3)])
        if n % 2:  # the driver polls slower than the steps come
            snapshot = monitor.snapshot(cursor)
            seen += snapshot["console"]
            cursor = snapshot["console_next"]
    assert seen == [f"step {n} line {k}" for n in range(1, 6) for k in range(n % 3)]
    assert "console" not in snapshot["latest"] and snapshot["latest"]["step"] == 5


def test_past_the_cap_the_oldest_lines_go_and_the_cursor_still_lands(monkeypatch):
    monkeypatch.setattr(monitor_module, "MAX_CONSOLE_LINES", 4)
    monitor = Monitor()
    step(monitor, 1, ["a", "b", "c"])
    assert monitor.snapshot(0)["console"] == ["a", "b", "c"]
    step(monitor, 2, ["d", "e", "f"])
    snapshot = monitor.snapshot(3)
    assert snapshot["console"] == ["d", "e", "f"] and snapshot["console_next"] == 6
    assert monitor.snapshot(0)["console"] == ["c", "d", "e", "f"]  # a late reader gets what is kept
