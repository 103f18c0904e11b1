"""``raydeep report RUN``: the five PNGs and report.md of a run directory, finished or still going,
and exit status 2 with a message naming the directory when there is nothing to report.

The run directories are synthetic: metrics files written with ``raydeep.metrics.SCHEMA`` the
way a run writes them (one per attempt), with nulls and per-rank list columns.
"""
from __future__ import annotations

import io
import json
import math
import socket
import struct
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydeep.storage import Storage
from raydeep.cli import main
from raydeep.metrics import COLLECTIVES, SCHEMA, attempt_file
from raydeep.report.run_data import step_series

PLOTS = ("loss.png", "throughput.png", "step_time.png", "memory.png", "comm_bytes.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH, SEQ = 16, 128


def metric_rows(attempt: int, world: int, steps: range, mfu: bool = True) -> list[dict]:
    """Rows like a GPT run's: falling loss, a checkpoint at every 10th step, rank 0 moving the
    ZeRO-3 collectives, model states split over ``world`` ranks."""
    rows = []
    for step in steps:
        step_s = 0.2 + 0.05 * (step % 3) + (0.15 if step % 10 == 0 else 0.0)
        per_rank_states = [int(2.4e9 / world) + rank * 10_000_000 for rank in range(world)]
        rows.append({
            "step": step, "attempt": attempt, "world_size": world, "time": 1.7e9 + step,
            "loss": 4.0 * math.exp(-step / 12) + 1.5, "lr": 3e-4, "loss_scale": 1.0,
            "grad_norm": None if step % 4 == 0 else 1.2, "skipped_steps": 0, "samples": step * BATCH,
            "step_s": step_s, "samples_per_s": BATCH / step_s, "tokens_per_s": BATCH * SEQ / step_s,
            "mfu": (0.31 + 0.01 * (step % 2)) if mfu else None,
            "forward_s": 0.05, "backward_s": 0.08, "comm_wait_s": 0.02 + 0.05 * (step % 3), "optimizer_s": 0.03,
            "checkpoint_s": 0.15 if step % 10 == 0 else 0.0, "other_s": 0.02,
            **{f"bytes_{op}": 0 for op in COLLECTIVES},
            "bytes_reduce_scatter": int(4.8e8 / world) * world, "bytes_all_gather": int(9.6e8),
            "bytes_all_reduce": 8 if step != 13 else None,
            "model_state_bytes": per_rank_states,
            "peak_memory_bytes": None if step == 1 else [s + 300_000_000 for s in per_rank_states],
            "phase": "", "restarts": attempt,
        })
    return rows


def write_attempt(run, attempt: int, rows: list[dict]) -> None:
    path = run / attempt_file(attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)


SUMMARY = {
    "name": "elastic-gpt", "model": "gpt-tiny", "data": "builtin", "zero_stage": 3, "train_batch_size": BATCH,
    "num_parameters": 124_439_808, "memory_rank0": {"params": 10, "total": 1_200_000_000},
    "first_loss": 5.2, "final_loss": 1.9876, "global_steps": 20, "global_samples": 20 * BATCH,
    "world_sizes": [2, 3], "restarts": 1,
    "attempts": [{"world_size": 2, "micro_batch": 4, "grad_accum": 2, "resumed_from_step": 0},
                 {"world_size": 3, "micro_batch": 4, "grad_accum": 1, "resumed_from_step": 10}],
    "recoveries": [{"attempt": 1, "world_size": 3, "last_step_before": 12, "resumed_from_step": 10, "stall_s": 14.25}],
    "samples_per_s": 55.5, "elapsed_s": 31.0, "hangs": [], "offload": None,
}


@pytest.fixture
def finished_run(tmp_path):
    run = tmp_path / "runs" / "elastic-gpt"
    write_attempt(run, 0, metric_rows(0, 2, range(1, 11)))
    write_attempt(run, 1, metric_rows(1, 3, range(11, 21)))
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    return run


def report(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG header, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_plots(out_dir) -> None:
    for name in PLOTS:
        path = out_dir / name
        assert path.is_file(), name
        assert path.stat().st_size > 5_000, (name, path.stat().st_size)
        width, height = png_size(path)
        assert width >= 1000 and height >= 400, (name, width, height)


def assert_user_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    assert err.startswith("error:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


def test_report_of_a_finished_elastic_run(capsys, finished_run):
    code, out, err = report(capsys, str(finished_run))
    assert code == 0, err
    out_dir = finished_run / "report"
    assert_plots(out_dir)
    assert str(out_dir / "report.md") in out

    text = (out_dir / "report.md").read_text()
    assert text.startswith("# Run report: elastic-gpt")
    for name in PLOTS:
        assert f"]({name})" in text, name
    for row in ("| Steps | 20 |", "| Final loss | 1.9876 |", "| ZeRO stage | 3 |",
                "| Parameters | 124.44 M (124,439,808) |", "| Median MFU | 31.5% |"):
        assert row in text, row
    assert "2 (1 restart), world sizes 2 → 3" in text
    assert "attempt 1: steps 11-20 on 3 ranks" in text
    assert "resumed from step 10 (last step before: 12), stalled 14.2 s" in text
    assert "| Median step time |" in text and "| Median tokens/s |" in text
    assert "| all-gather per step (median) | 960.00 MB (run total 19.20 GB) |" in text
    assert "still running" not in text


# --- what the figures show ----------------------------------------------------------------------
# The synthetic run has 20 steps, far below the points a figure averages down to, so every point is
# one step's value, scaled (ms, GB, MB, %): equal to the rows' numbers up to that one rounding.
RTOL = 1e-12


def figure_input(run):
    from raydeep.report.plots import PlotInput
    from raydeep.report.run_data import load_run

    loaded = load_run(Storage.open(str(run)))
    return PlotInput(run_name=loaded.name, metrics=loaded.metrics, spans=loaded.spans)


def curves(ax) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """The data lines of ``ax`` by legend label, one (steps, values) piece per attempt: a series
    is drawn as its labelled first piece followed by its unlabelled continuations."""
    out, label = {}, None
    for line in ax.lines:
        if line.get_transform() is not ax.transData:
            continue  # a restart marker, drawn in axes-fraction height
        if not line.get_label().startswith("_"):
            label = line.get_label()
        out.setdefault(label, []).append((np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)))
    return out


def bands(ax) -> dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """The stacked areas of ``ax`` by legend label, one (steps, bottom, top) per attempt: each
    attempt's stack is drawn whole, the first one labelled."""
    stacks = ax.collections
    labels = [c.get_label() for c in stacks if not c.get_label().startswith("_")]
    out = {}
    for i, collection in enumerate(stacks):
        vertices = np.concatenate([path.vertices for path in collection.get_paths()])
        steps = np.unique(vertices[:, 0])
        low = np.array([vertices[vertices[:, 0] == x, 1].min() for x in steps])
        high = np.array([vertices[vertices[:, 0] == x, 1].max() for x in steps])
        out.setdefault(labels[i % len(labels)], []).append((steps, low, high))
    return out


def by_attempt(rows: list[dict], value) -> list[tuple[np.ndarray, np.ndarray]]:
    pieces = {}
    for row in rows:
        steps, values = pieces.setdefault(row["attempt"], ([], []))
        steps.append(row["step"])
        values.append(np.nan if value(row) is None else value(row))
    return [(np.array(s, float), np.array(v, float)) for s, v in pieces.values()]


def assert_pieces(drawn, expected, what) -> None:
    assert len(drawn) == len(expected), what  # one piece per attempt: a restart is a gap
    for (x, y), (want_x, want_y) in zip(drawn, expected):
        np.testing.assert_array_equal(x, want_x, err_msg=what)
        np.testing.assert_allclose(y, want_y, rtol=RTOL, err_msg=what)  # NaN where the rows have none


def assert_stack(ax, rows, parts: list[tuple[str, callable]]) -> None:
    """``parts`` (legend label start, value) stacked bottom up in that order, per attempt."""
    drawn = bands(ax)
    assert len(drawn) == len(parts), list(drawn)
    below = by_attempt(rows, lambda row: 0.0)
    for start, value in parts:
        [label] = [label for label in drawn if label.startswith(start + " (mean ")]
        mine = by_attempt(rows, lambda row: value(row) or 0.0)  # a missing value stacks as zero
        for (x, low, high), (want_x, base), (_, add) in zip(drawn[label], below, mine):
            np.testing.assert_array_equal(x, want_x, err_msg=label)
            np.testing.assert_allclose(low, base, rtol=RTOL, atol=1e-12, err_msg=label)
            np.testing.assert_allclose(high, base + add, rtol=RTOL, atol=1e-12, err_msg=label)
        below = [(x, base + add) for (x, base), (_, add) in zip(below, mine)]


def test_the_figures_draw_the_metrics(finished_run):
    from raydeep.report import plots

    rows = metric_rows(0, 2, range(1, 11)) + metric_rows(1, 3, range(11, 21))
    data = figure_input(finished_run)

    [ax] = plots.loss_figure(data).axes
    assert ax.get_ylabel() == "loss" and ax.get_xlabel() == "global step"
    assert_pieces(curves(ax)["loss (mean over ranks)"], by_attempt(rows, lambda r: r["loss"]), "loss")

    speed, mfu = plots.throughput_figure(data).axes
    assert_pieces(curves(speed)["tokens/s"], by_attempt(rows, lambda r: r["tokens_per_s"]), "tokens/s")
    [samples] = speed.child_axes  # samples/s is tokens/s over the sequence: a second scale, not a line
    assert speed.get_ylabel() == "tokens/s" and samples.get_ylabel() == f"samples/s (= tokens/s ÷ {SEQ})"
    assert_pieces(curves(mfu)["MFU"], by_attempt(rows, lambda r: 100 * r["mfu"]), "MFU")

    [ax] = plots.step_time_figure(data).axes
    assert ax.get_ylabel() == "time per step (ms)"  # every step is under a second
    parts = [(label, lambda r, c=column: 1e3 * r[c]) for label, column in (
        ("forward", "forward_s"), ("backward", "backward_s"), ("comm wait", "comm_wait_s"),
        ("optimizer", "optimizer_s"), ("checkpoint", "checkpoint_s"), ("other", "other_s"))]
    assert_stack(ax, rows, parts)
    [(label, whole)] = [(k, v) for k, v in curves(ax).items() if k.startswith("whole step with its save")]
    assert_pieces(whole, by_attempt(rows, lambda r: 1e3 * (r["step_s"] + r["checkpoint_s"])), label)
    mean_forward = 1e3 * sum(r["forward_s"] for r in rows) / len(rows)
    assert f"forward (mean {mean_forward:.3g} ms)" in bands(ax)

    states, peak = plots.memory_figure(data).axes
    assert (states.get_ylabel(), peak.get_ylabel()) == ("model states (GB)", "allocator peak during the step (GB)")
    for ax, column in ((states, "model_state_bytes"), (peak, "peak_memory_bytes")):
        for rank in range(3):  # the first attempt had 2 ranks: rank 2's line is a gap there
            value = lambda r, c=column, k=rank: r[c][k] / 1e9 if r[c] and k < len(r[c]) else None  # noqa: E731
            assert_pieces(curves(ax)[f"rank {rank}"], by_attempt(rows, value), (column, rank))

    [ax] = plots.comm_bytes_figure(data).axes
    assert ax.get_ylabel() == "MB per step"
    assert_stack(ax, rows, [(op.replace("_", "-"), lambda r, o=op: None if r[f"bytes_{o}"] is None else
                             r[f"bytes_{o}"] / 1e6) for op in ("all_reduce", "reduce_scatter", "all_gather")])


def test_report_of_a_run_still_going(capsys, tmp_path):
    run = tmp_path / "runs" / "live"
    write_attempt(run, 0, metric_rows(0, 2, range(1, 8), mfu=False))
    out_dir = tmp_path / "elsewhere"
    code, _, err = report(capsys, str(run), "--out", str(out_dir))
    assert code == 0, err
    assert_plots(out_dir)
    assert not (run / "report").exists()
    text = (out_dir / "report.md").read_text()
    assert text.startswith("# Run report: live")  # the directory's name, with no summary.json to give one
    assert "still running" in text
    assert "| Steps | 7 |" in text and "1 (0 restarts), world size 2" in text
    assert "| Median MFU | not available |" in text


def test_one_row_of_mostly_nulls(capsys, tmp_path):
    run = tmp_path / "first-step"
    row = {name: None for name in SCHEMA.names} | {"step": 1, "attempt": 0, "world_size": 1, "loss": float("nan")}
    write_attempt(run, 0, [row])
    code, _, err = report(capsys, str(run))
    assert code == 0, err
    for name in PLOTS:
        assert png_size(run / "report" / name)[0] >= 1000


def test_a_uri_run_directory(capsys, finished_run):
    code, out, err = report(capsys, f"file://{finished_run}")
    assert code == 0, err
    assert_plots(finished_run / "report")
    assert f"file://{finished_run}/report/report.md" in out


@pytest.fixture
def s3_run(monkeypatch):
    """A run directory on an S3 API (moto's server), as ``s3://runs/elastic-gpt?...``."""
    moto_server = pytest.importorskip("moto.server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # The test server accepts any credentials.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="runs")
    uri = f"s3://runs/elastic-gpt?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    storage = Storage.open(uri)
    for attempt, world, steps in ((0, 2, range(1, 11)), (1, 3, range(11, 21))):
        sink = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(metric_rows(attempt, world, steps), schema=SCHEMA), sink)
        storage.write(attempt_file(attempt), sink.getvalue())
    storage.write("summary.json", json.dumps(SUMMARY).encode())
    yield storage
    server.stop()


@pytest.mark.peers
def test_an_s3_run_directory(capsys, s3_run):
    code, out, err = report(capsys, s3_run.uri)
    assert code == 0, err
    assert "s3://runs/elastic-gpt/report/report.md" in out and "endpoint_override" not in out
    text = s3_run.read("report/report.md").decode()
    assert text.startswith("# Run report: elastic-gpt")
    for name in PLOTS:
        assert s3_run.read(f"report/{name}")[:8] == PNG_SIGNATURE, name


@pytest.mark.parametrize("layout", ["no metrics dir", "empty metrics dir"])
def test_nothing_to_report_names_the_metrics_directory(capsys, tmp_path, layout):
    run = tmp_path / "runs" / "fresh"
    run.mkdir(parents=True)
    if layout == "empty metrics dir":
        (run / "metrics").mkdir()
    code, _, err = report(capsys, str(run))
    assert_user_error(code, err, f"no metrics files in {run}/metrics")
    assert not (run / "report").exists()


def test_unreadable_metrics_file(capsys, tmp_path):
    run = tmp_path / "runs" / "damaged"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "attempt-0.parquet").write_bytes(b"not parquet")
    code, _, err = report(capsys, str(run))
    assert_user_error(code, err, f"cannot read the metrics in {run}/metrics")


def test_missing_run_directory(capsys, tmp_path):
    code, _, err = report(capsys, str(tmp_path / "typo"))
    assert_user_error(code, err, "no such run directory", str(tmp_path / "typo"))


def test_without_matplotlib_says_what_to_install(capsys, finished_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    code, _, err = report(capsys, str(finished_run))
    assert_user_error(code, err, "pip install 'raydeep[monitor]'")


def test_long_runs_are_averaged_for_plotting_within_attempts():
    rows = metric_rows(0, 2, range(1, 7001)) + metric_rows(1, 3, range(7001, 12001))
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    points = step_series(table, ["loss", "bytes_all_reduce"], ["model_state_bytes"], max_points=5000)
    assert points.bin_size == 3
    assert points.steps.size == 2334 + 1667  # bins restart at the attempt: 7000 = 2333*3 + 1, 5000 = 1666*3 + 2
    first_of_attempt_1 = 2334
    assert points.steps[first_of_attempt_1 - 1] == 7000 and points.steps[first_of_attempt_1] == 7002
    assert list(points.attempts[first_of_attempt_1 - 1:first_of_attempt_1 + 1]) == [0, 1]
    assert points.steps[0] == 2  # mean of steps 1, 2, 3
    # A bin with a null (step 13's all-reduce) averages the steps that have a value.
    assert points.column("bytes_all_reduce")[4] == 8
    memory = points.per_rank["model_state_bytes"]
    assert memory.shape == (points.steps.size, 3)
    assert math.isnan(memory[0, 2]) and memory[first_of_attempt_1, 2] == int(2.4e9 / 3) + 20_000_000
