"""The metrics-overhead benchmark runs and reports its shape; its estimator is checked on made-up
numbers (timings themselves are never asserted)."""
from __future__ import annotations

import json

import pytest

from benchmarks.metrics_overhead import MODES, main, summarise


def test_the_overhead_is_taken_between_the_runs_of_one_repetition():
    # The machine runs twice as fast in the second repetition; within each, the metrics cost 2%.
    intervals = {"off": [[100.0] * 4, [50.0] * 4], "on": [[102.0] * 4, [51.0] * 4]}
    result = summarise(intervals, in_metrics_s=[1.0, 0.5])
    assert result["overhead"] == pytest.approx(0.02)
    assert result["ratio_per_rep"] == pytest.approx([1.02, 1.02])
    assert result["in_metrics_s_per_step"] == 0.75 and result["in_loop_overhead"] == pytest.approx(0.75 / 75.0)


@pytest.mark.slow
def test_benchmark_runs_two_ranks(tmp_path, capsys):
    argv = ["--world", "2", "--reps", "1", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "overhead, A/B" in out and "overhead, in the loop" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["median_step_s"]) == set(MODES)
    assert all(len(runs) == 1 and len(runs[0]) == 2 for runs in result["step_s"].values())
