"""The checkpoint-overhead benchmark runs and reports its shape; its estimator is checked on
made-up numbers (timings themselves are never asserted)."""
from __future__ import annotations

import pytest

from benchmarks.checkpoint_overhead import MODES, main, summarise


def test_ratios_are_taken_between_neighbouring_blocks():
    # The machine runs twice as fast in the second round; within each round async costs 10%.
    blocks = {"none": [[100.0] * 5, [50.0] * 5], "async": [[110.0] * 5, [55.0] * 5], "sync": [[150.0] * 5, [75.0] * 5]}
    result = summarise(blocks)
    assert result["ratio_vs_none"] == pytest.approx({"none": 1.0, "async": 1.1, "sync": 1.5})
    # A ratio of whole-run medians would mix the rounds: 55 / 50 instead of 1.1 here.
    assert result["median_step_s"]["async"] == pytest.approx(82.5)


@pytest.mark.slow
def test_benchmark_runs_one_rank(tmp_path, capsys):
    assert main(["--world", "1", "--threads", "1", "--steps", "5", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    for mode in MODES:
        assert f"{mode:>5}: median step" in out
    import json

    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["ratio_vs_none"]) == set(MODES) and result["ratio_vs_none"]["none"] == 1.0
    assert all(len(blocks) == 1 and len(blocks[0]) == 5 for blocks in result["step_s"].values())
