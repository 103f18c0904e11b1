"""The per-step metrics rank 0 writes (raydeep.ray.step_metrics), without Ray: the rows and their
schema, the atomic flushes, the cut of the steps a new attempt trains again, the MFU arithmetic
and the chips' peaks."""
from __future__ import annotations

import threading

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from raydeep.storage import Storage
from raydeep.config.sections import RaydeepSection
from raydeep.metrics import COLLECTIVES, SCHEMA, attempt_file, read_metrics
from raydeep.ray.step_metrics import (MetricsWriter, StepMetrics, Throughput, chip_peak_tflops, flops_per_token,
                                      gather_memory, peak_flops, step_row, throughput_of)

RATES = {"samples_per_s": 32.0, "tokens_per_s": 4096.0, "mfu": None}


def engine_values(step: int, **changes) -> dict:
    """``engine.step_metrics`` as the engine's contract states it."""
    values = {"step": step, "samples": 16 * step, "lr": 1e-3, "loss_scale": 1.0, "grad_norm": 0.5, "skipped_steps": 0,
              "forward_s": 0.1, "backward_s": 0.2, "comm_wait_s": 0.05, "optimizer_s": 0.1,
              "forward_wait_s": 0.0, "backward_wait_s": 0.03,
              "comm": {"all_reduce": {"calls": 2, "bytes": 800, "blocked_s": 0.01},
                       "compressed_all_gather": {"calls": 1, "bytes": 64, "blocked_s": 0.0}},
              "model_state_bytes": 4096, "peak_memory_bytes": None}
    return {**values, **changes}


def row(step: int, attempt: int = 0) -> dict:
    return {**step_row(engine_values(step), attempt=attempt, world_size=2, loss=4.0 - step / 100, step_s=0.5,
                       checkpoint_s=0.0, rates=RATES, phase=""),
            "model_state_bytes": [4096, 4100], "peak_memory_bytes": [None, None]}


def steps_of(table) -> list[int]:
    return table.column("step").to_pylist()


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (the loop always runs in one)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_row_has_every_column_of_the_schema(tmp_path):
    writer = MetricsWriter(Storage.open(str(tmp_path)), attempt=0)
    writer.add(row(1))
    writer.flush()
    table = read_metrics(str(tmp_path))
    assert table.schema.equals(SCHEMA)
    got = table.to_pylist()[0]
    assert set(got) == set(SCHEMA.names)
    assert (got["step"], got["samples"], got["world_size"], got["restarts"]) == (1, 16, 2, 0)
    # Labelled variants count under their collective; the others are 0.
    assert got["bytes_all_reduce"] == 800 and got["bytes_all_gather"] == 64
    assert all(got[f"bytes_{op}"] == 0 for op in COLLECTIVES if op not in ("all_reduce", "all_gather"))
    assert got["other_s"] == pytest.approx(0.5 - 0.4)  # step minus forward, backward and optimizer
    # Each wait is counted once, in comm_wait_s: backward's 0.03 s out of backward_s, the step's
    # remaining 0.02 s out of optimizer_s; the five parts add up to the step.
    assert got["backward_s"] == pytest.approx(0.17) and got["optimizer_s"] == pytest.approx(0.08)
    parts = ("forward_s", "backward_s", "comm_wait_s", "optimizer_s", "other_s")
    assert sum(got[p] for p in parts) == pytest.approx(0.5)
    assert got["model_state_bytes"] == [4096, 4100] and got["peak_memory_bytes"] == [None, None]


def test_a_flush_every_flush_every_steps_after_every_row_before_it(tmp_path, one_rank_group):
    storage = Storage.open(str(tmp_path))
    metrics = StepMetrics(0, 1, torch.device("cpu"), MetricsWriter(storage, attempt=0), flush_every=3)
    for step in range(1, 8):
        metrics.record(engine_values(step, peak_memory_bytes=1000 + step), loss=1.0, step_s=0.5, rates=RATES,
                       phase=None, saving=False)
    assert pq.ParquetFile(storage.path(attempt_file(0))).metadata.num_rows == 6
    metrics.close()  # the end of the attempt: the last, short group, after one of the 6 before it
    parquet = pq.ParquetFile(storage.path(attempt_file(0)))
    assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == [6, 1]
    table = read_metrics(str(tmp_path))
    assert steps_of(table) == list(range(1, 8))
    # The memory of each step, gathered at the flushes, lands in its own row.
    assert table.column("peak_memory_bytes").to_pylist() == [[1000 + step] for step in range(1, 8)]
    assert table.column("model_state_bytes").to_pylist() == [[4096]] * 7


def test_a_long_run_s_file_keeps_two_row_groups(tmp_path):
    """A flush rewrites the file: its cost must grow with the rows, not with the flushes so far
    (a memory snapshot flushes every few steps, for the whole run)."""
    storage = Storage.open(str(tmp_path))
    writer = MetricsWriter(storage, attempt=0)
    for step in range(1, 601):
        writer.add(row(step))
        if step % 3 == 0:
            writer.flush()
        if step % 30 == 0:
            writer.set_last(checkpoint_s=0.25)  # a save after its flush changes the newest row
    writer.flush()
    parquet = pq.ParquetFile(storage.path(attempt_file(0)))
    assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == [597, 3]
    table = read_metrics(str(tmp_path))
    assert steps_of(table) == list(range(1, 601))
    saved = [step for step, s in zip(steps_of(table), table.column("checkpoint_s").to_pylist()) if s == 0.25]
    assert saved == list(range(30, 601, 30))


def test_a_reader_during_the_flushes_always_reads_a_whole_file(tmp_path):
    writer = MetricsWriter(Storage.open(str(tmp_path)), attempt=0)
    done = threading.Event()

    def write():
        for step in range(1, 41):
            writer.add(row(step))
            writer.flush()  # rewrites the whole file
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    counts = []
    while not done.is_set():
        table = read_metrics(str(tmp_path))  # raises on a torn file
        counts.append(table.num_rows)
        assert steps_of(table) == list(range(1, table.num_rows + 1))
    thread.join()
    assert counts == sorted(counts) and read_metrics(str(tmp_path)).num_rows == 40
    assert not list((tmp_path / "metrics").glob("*.tmp"))


def test_a_new_attempt_cuts_the_steps_it_trains_again_from_older_attempts(tmp_path):
    storage = Storage.open(str(tmp_path))
    first = MetricsWriter(storage, attempt=0)
    for step in range(1, 11):  # died after step 10; its last checkpoint was step 8
        first.add(row(step))
        if step % 4 == 0:
            first.flush()
    first.flush()
    second = MetricsWriter.start(str(tmp_path), attempt=1, resumed_from_step=8)
    parquet = pq.ParquetFile(storage.path(attempt_file(0)))
    assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == [8]
    for step in range(9, 13):
        second.add(row(step, attempt=1))
    second.flush()
    assert pq.ParquetFile(storage.path(attempt_file(1))).num_row_groups == 1
    table = read_metrics(str(tmp_path))
    assert steps_of(table) == list(range(1, 13))
    assert table.column("attempt").to_pylist() == [0] * 8 + [1] * 4
    assert set(table.column("restarts").to_pylist()) == {0, 1}


def test_a_reused_attempt_number_keeps_its_rows_up_to_the_resume(tmp_path):
    """An attempt that died before its first checkpoint leaves the next one the same number (the
    history comes from the checkpoint): its file's re-trained rows go, the earlier ones stay."""
    storage = Storage.open(str(tmp_path))
    died = MetricsWriter(storage, attempt=1)
    for step in (5, 6, 7):
        died.add(row(step, attempt=1))
    died.flush()
    again = MetricsWriter.start(str(tmp_path), attempt=1, resumed_from_step=6)
    assert steps_of(read_metrics(str(tmp_path))) == [5, 6]
    again.add(row(7, attempt=1))
    again.flush()
    assert steps_of(read_metrics(str(tmp_path))) == [5, 6, 7]


def test_a_checkpoints_seconds_reach_its_row_at_the_next_flush(tmp_path):
    writer = MetricsWriter(Storage.open(str(tmp_path)), attempt=0)
    writer.add(row(1))
    writer.add({**row(2), "checkpoint_s": None})  # a save follows: not known yet
    writer.flush()  # before the save: the row is on disk first
    assert read_metrics(str(tmp_path)).column("checkpoint_s").to_pylist() == [0.0, None]
    writer.set_last(checkpoint_s=1.25)
    writer.flush()
    assert read_metrics(str(tmp_path)).column("checkpoint_s").to_pylist() == [0.0, 1.25]


def test_throughput_and_mfu_arithmetic():
    rates = Throughput(samples_per_step=16, tokens_per_sample=128, flops_per_token=6e6, world_size=2,
                       peak_flops=100e12).of(step_s=0.25)
    assert rates["samples_per_s"] == 64.0 and rates["tokens_per_s"] == 64.0 * 128
    # model FLOPs per second over the peak of both chips
    assert rates["mfu"] == pytest.approx(64 * 128 * 6e6 / (2 * 100e12))
    assert Throughput(16, 128, 6e6, 2, None).of(0.25)["mfu"] is None


def test_flops_per_token_from_the_model_or_six_per_parameter():
    from raydeep.models import build_gpt

    gpt = build_gpt("gpt-tiny")
    assert flops_per_token(gpt, 64) == gpt.flops_per_token(64)
    linear = torch.nn.Linear(10, 10)  # 110 parameters
    assert flops_per_token(linear, 64) == 6 * 110


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L4", 121.0), ("NVIDIA A10G", 125.0), ("Tesla V100-SXM2-16GB", 125.0),
    ("NVIDIA L40S", None), ("NVIDIA GeForce RTX 4090", None)])
def test_the_peak_table_matches_chip_names(name, tflops):
    assert chip_peak_tflops(name) == tflops


def test_the_configured_peak_wins_and_a_cpu_has_none():
    cpu = torch.device("cpu")
    assert peak_flops(None, cpu) is None
    assert peak_flops(50.0, cpu) == 50e12


class FakeEngine:
    rank, world_size, device, global_steps = 0, 1, torch.device("cpu"), 0

    def train_batch_size(self) -> int:
        return 16


def test_metrics_off_writes_nothing_and_adds_no_collective(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: pytest.fail("a collective with metrics off"))
    options = RaydeepSection.model_validate({"metrics": False})
    metrics = StepMetrics.start(options, str(tmp_path), FakeEngine(), attempt=0, flush_every=1)
    for step in (1, 2):
        metrics.record(engine_values(step), loss=1.0, step_s=0.5, rates=RATES, phase=None, saving=step == 2)
    metrics.before_checkpoint()
    metrics.checkpoint_saved(1.0)
    metrics.close()
    assert not (tmp_path / "metrics").exists()
    assert throughput_of(options, FakeEngine(), 128, 1e6).of(0.5)["tokens_per_s"] == 16 / 0.5 * 128


def test_memory_of_every_rank_and_step_in_one_gather(one_rank_group, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather", lambda out, t: (calls.append(t.shape), out[0].copy_(t)))
    memory = gather_memory([(123, None), (124, 7)], torch.device("cpu"), 1)
    assert memory == [([123], [None]), ([124], [7])] and calls == [(2, 2)]


def test_rows_from_a_real_engine(tmp_path, one_rank_group):
    """The engine's step_metrics, as they are, make rows of the schema."""
    import raydeep
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt("gpt-tiny")
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = raydeep.initialize(model=model, config=config)
    options = RaydeepSection.model_validate({})
    metrics = StepMetrics.start(options, str(tmp_path), engine, attempt=0)
    x = torch.randint(0, model.config.vocab_size, (2, 17))
    for _ in range(2):
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        metrics.record(engine.step_metrics, loss=float(loss.detach()), step_s=0.5, rates=RATES, phase=engine.tier.phase,
                       saving=False)
    metrics.close()
    table = read_metrics(str(tmp_path))
    assert steps_of(table) == [1, 2] and table.schema.equals(SCHEMA)
    first = table.to_pylist()[0]
    assert first["samples"] == 2 and first["model_state_bytes"][0] > 0 and first["forward_s"] > 0
    assert first["peak_memory_bytes"] == [None]  # a CPU rank


def test_the_step_event_of_an_fp16_run_carries_the_loss_scale():
    import raydeep
    from raydeep.models import build_gpt
    from raydeep.ray.loop import _step_event

    cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "initial_scale_power": 8},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = raydeep.initialize(model=build_gpt("gpt-tiny", n_layer=1), config=cfg)
    event = _step_event(engine, 3.0, 0.5, {"tokens_per_s": 10.0, "mfu": None}, restarts=1)
    assert event["loss_scale"] == 256.0 and event["restarts"] == 1
