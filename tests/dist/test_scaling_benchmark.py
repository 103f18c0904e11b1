"""benchmarks/scaling.py end to end, small: the engine's layout and traffic in a fake process group
equal those of real gloo runs at 1, 2 and 4 ranks at every stage, and grow as ZeRO says."""
import pytest

from benchmarks import scaling

ARGS = ["--model", "gpt-small-cpu", "--layers", "", "--max-world", "4", "--real-worlds", "2,4", "--layout-layers", "1",
        "--seq", "32"]  # the world-size part only: the model-size part is timings


@pytest.mark.slow
def test_fake_group_layouts_equal_real_runs_and_follow_zero(tmp_path, capsys):
    summary = scaling.main(ARGS + ["--out", str(tmp_path)])
    print(capsys.readouterr().out)
    assert len(summary["checks"]) == 8 and all(c["equal"] for c in summary["checks"]), summary["checks"]
    layouts = summary["world_size"]
    assert all(layouts[1][stage]["bytes_per_step"] == 0 for stage in range(4))  # one rank moves nothing
    # Stage 0 keeps every state whole; stages 1-3 shard more of them as ranks are added.
    assert len({layouts[w][0]["states"] for w in layouts}) == 1
    for stage in (1, 2, 3):
        states = [layouts[w][stage]["states"] for w in sorted(layouts)]
        assert states == sorted(states, reverse=True) and states[0] > states[-1], (stage, states)
    # Stage 3 partitions this model's weight matrices, which stage 2 keeps whole.
    assert layouts[4][3]["states"] < layouts[4][2]["states"]
    assert (tmp_path / "world_size.png").is_file()
