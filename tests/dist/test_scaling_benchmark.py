"""benchmarks/scaling.py end to end, small: the engine's layout and traffic in a fake process group
equal those of real gloo runs at 1, 2 and 4 ranks at every stage, grow as ZeRO says, and the
world-size plot draws exactly those numbers."""
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
    assert_world_size_plot(summary, tmp_path)


def assert_world_size_plot(summary: dict, out) -> None:
    """world_size.png is the figure drawn from the summary (drawn again, the same PNG), and that
    figure has, per panel, one line per stage through the fake group's numbers in MB at every
    world size, and a circle at each real gloo run's number."""
    again = out / "again"
    again.mkdir()
    figures = scaling.plots(summary, str(again))
    assert set(figures) == {"world_size"} | ({"model_size"} if summary["model_size"] else set())
    assert (again / "world_size.png").read_bytes() == (out / "world_size.png").read_bytes()
    worlds = sorted(summary["world_size"])
    panels = dict(zip(("states", "bytes_per_step"), figures["world_size"].axes))
    assert panels["states"].get_ylabel() == "model-state MB per rank"
    assert panels["bytes_per_step"].get_ylabel() == "MB each rank moved per step"
    for key, ax in panels.items():
        assert ax.get_xlabel() == "world size" and list(ax.get_xticks()) == worlds
        lines = {line.get_label(): line for line in ax.lines}
        assert set(lines) == {f"z{stage}" for stage in scaling.STAGES}
        assert [line.get_label() for line in ax.get_legend().get_lines()] == [f"z{s}" for s in scaling.STAGES]
        for stage in scaling.STAGES:
            line = lines[f"z{stage}"]
            assert list(line.get_xdata()) == worlds
            # The same division by 1e6 of the same integers: equal floats.
            assert list(line.get_ydata()) == [summary["world_size"][w][stage][key] / 1e6 for w in worlds], (key, stage)
        circles = sorted(tuple(map(float, c.get_offsets()[0])) for c in ax.collections)
        assert circles == sorted((c["world"], c["real"][key] / 1e6) for c in summary["checks"]), key


def test_the_model_size_plot_draws_each_stage_against_the_parameters(tmp_path):
    """The model-size part is timings, too slow for a test to run; its plot is checked on a summary
    of made-up numbers, each distinct, so a series drawn from another column or stage shows."""
    layers, stages = [1, 2], scaling.STAGES
    rows = [{"n_layer": n, "params": 1_000_000 * n, "stage": s, "median_s": 0.01 * (n + 10 * s + 1),
             "bytes_per_step": 1e6 * (3 * n + 7 * s + 1), "states_per_rank": 1e6 * (n + s)}
            for n in layers for s in stages]
    world = {w: {s: {"states": 1e6 * (10 - w - s), "bytes_per_step": 1e5 * (w + s)} for s in stages} for w in (1, 2)}
    summary = {"setup": {"model": "gpt-tiny", "layers": layers, "world": 2, "micro": 2, "seq": 32, "gas": 2,
                         "layout_layers": 1},
               "model_size": rows, "world_size": world,
               "checks": [{"world": 2, "stage": s, "real": world[2][s], "fake": world[2][s], "equal": True}
                          for s in stages]}
    figures = scaling.plots(summary, str(tmp_path))
    assert (tmp_path / "model_size.png").is_file() and (tmp_path / "world_size.png").is_file()
    times, moved = figures["model_size"].axes
    assert times.get_ylabel() == "median ms per optimizer step" and moved.get_ylabel() == "MB each rank moved per step"
    for ax, value in ((times, lambda r: 1e3 * r["median_s"]), (moved, lambda r: r["bytes_per_step"] / 1e6)):
        assert ax.get_xlabel() == "parameters (M)"
        lines = {line.get_label(): line for line in ax.lines}
        assert set(lines) == {f"z{s}" for s in stages}
        for s in stages:
            mine = [r for r in rows if r["stage"] == s]
            assert list(lines[f"z{s}"].get_xdata()) == [r["params"] / 1e6 for r in mine]
            assert list(lines[f"z{s}"].get_ydata()) == [value(r) for r in mine], (ax.get_ylabel(), s)
    assert_world_size_plot(summary, tmp_path)
