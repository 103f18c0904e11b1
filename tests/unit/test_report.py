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
