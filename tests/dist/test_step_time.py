"""The step-time benchmark runs end to end: a very short run on a one-layer model.

Only the report's structure and that every number is finite are checked; timings on a shared
CI machine are not something a test can assert.
"""
import json
import math
from importlib.util import find_spec

import pytest

from benchmarks import step_time

ARGS = ["--world", "2", "--steps", "2", "--warmup", "1", "--model", "gpt-tiny", "--n-layer", "1", "--seq", "32",
        "--micro-batch", "2", "--gas", "2", "--bucket", "20000", "--timeout", "600"]


@pytest.mark.slow
def test_step_time_benchmark_reports_every_configuration(tmp_path, capsys):
    out = tmp_path / "step_time.json"
    summary = step_time.main(ARGS + ["--json", str(out)])
    printed = capsys.readouterr().out

    with_deepspeed = find_spec("deepspeed") is not None
    names = [row["name"] for row in summary["rows"]]
    expected = ["DDP", "raydeep z0"] + [f"raydeep z{s}{o}" for s in (1, 2, 3) for o in ("", " overlap")]
    expected += [f"DeepSpeed z{s}" for s in range(4)] if with_deepspeed else []
    assert names == expected
    for row in summary["rows"]:
        assert len(row["step_s"]) == 2 and all(t > 0 and math.isfinite(t) for t in row["step_s"])
        assert row["q1_s"] <= row["median_s"] <= row["q3_s"] and math.isfinite(row["vs_ddp"])
        assert row["name"] in printed
        if row["engine"] == "raydeep":
            assert row["blocked_comm_s"] >= 0 and math.isfinite(row["blocked_comm_s"])
            assert (row["vs_deepspeed"] is not None) == with_deepspeed
    # Stage 1-3 gradient reductions block on gloo at least a little with overlap off.
    for stage, share in summary["hidden_comm_share"].items():
        assert share is not None and share <= 1, f"stage {stage}: {share}"
    assert "communication hidden by overlap_comm" in printed
    assert json.loads(out.read_text())["rows"][0]["name"] == "DDP"
