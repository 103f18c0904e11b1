"""The offload benchmark runs end to end at small sizes: only the report's structure and that
every number is finite and positive are checked; timings on a shared CI machine are not something
a test can assert (the benchmark prints the ratios against its targets)."""
import json
import math

import pytest

from benchmarks import offload

pytestmark = pytest.mark.slow


def test_offload_benchmark_reports_every_measurement(connected, tmp_path, capsys):
    """On the package's shared cluster (tests/ray/conftest.py), whose offload node carries the
    resource the benchmark's offload actors ask for; the smallest sizes that run every path
    (``python -m benchmarks.offload`` measures at full size)."""
    out = tmp_path / "offload.json"
    report = offload.main(["--numel", "200000", "--actor-numel", "300000", "--tile", "102400",
                           "--reps", "2", "--gpt-steps", "3", "--model", "gpt-tiny", "--json", str(out)])
    printed = capsys.readouterr().out
    cpu, gpt = report["cpu_step"], report["gpt_2_ranks"]
    assert cpu["tier_step_elems_per_s"] > 0 and cpu["fused_adamw_elems_per_s"] > 0 and math.isfinite(cpu["ratio"])
    for how in ("object store", "shared memory"):
        actors = report[f"actor_pipeline, {how}"]
        assert actors["pieces"] == 3 and actors["compute_s"] > 0 and actors["transfer_s"] > 0
        assert actors["step_s"] > 0 and math.isfinite(actors["ratio_vs_max"])
    # this driver's node has no CPUs: every actor is on another node
    assert not report["actor_pipeline, shared memory"]["shared_memory"]
    assert set(gpt["median_step_s"]) == set(offload.TIERS) and gpt["vs_on_the_rank"]["on the rank"] == 1.0
    assert all(t > 0 for t in gpt["median_step_s"].values())
    # the update alone is a part of engine.step(), which is a part of the step
    assert 0 < gpt["update_share_on_the_rank"] < gpt["optimizer_step_share_on_the_rank"] < 1
    for phrase in ("CPU step", "actor tier", "gpt-tiny, 2 ranks"):
        assert phrase in printed
    assert json.loads(out.read_text())["actor_pipeline, object store"]["pieces"] == 3
