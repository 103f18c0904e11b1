"""The engine's step metrics, DeepSpeed's monitors (tensorboard, csv_monitor), wall_clock_breakdown's
timer lines and the comms_logger table, on one rank in this process.

The rank is a one-rank gloo group with ``RAYDEEP_COLLECTIVES_AT_WORLD_1=1``, so ZeRO stage 2's
collectives run for real and the comms logger has ops to record.
"""
from __future__ import annotations

import csv
import logging
import re
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from raydeep import comm
from raydeep.monitor import EVENT_NAMES

STEPS, MICRO, GAS, SEQ = 3, 2, 2, 32
STEP_METRICS_KEYS = {"step", "samples", "lr", "loss_scale", "grad_norm", "skipped_steps", "forward_s", "backward_s",
                     "comm_wait_s", "optimizer_s", "comm", "model_state_bytes", "peak_memory_bytes",
                     "forward_wait_s", "backward_wait_s", "checkpoint_forward_s", "checkpoint_recompute_s"}
MICRO_LINE = re.compile(r"^time \(ms\)" + "".join(
    rf" \| {n}: \d+\.\d\d" for n in ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep",
                                     "bwd_allreduce_microstep", "step_microstep")) + "$")
GLOBAL_LINE = re.compile(r"^time \(ms\) \| fwd: (\d+\.\d\d) \| bwd: (\d+\.\d\d) \| bwd_inner: (\d+\.\d\d) "
                         r"\| bwd_allreduce: (\d+\.\d\d) \| step: (\d+\.\d\d)$")
TABLE_HEADER = ("Comm. Op            Message Size        Count               Total Latency(ms)   "
                "Avg Latency(ms)     tput_avg (Gbps)     busbw_avg (Gbps)    ")


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("RAYDEEP_COLLECTIVES_AT_WORLD_1", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        comm.configure_comms_logger(None)
        dist.destroy_process_group()


def _config(tmp_path) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": STEPS,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 20000},
            "wall_clock_breakdown": True, "comms_logger": {"enabled": True},
            "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
            "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}}


def _train(cfg: dict):
    """Three optimizer steps of the tiny GPT; returns the engine, each step's mean loss as the loop
    saw it, and each step's wall seconds."""
    import raydeep
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    model = build_gpt("gpt-tiny", block_size=SEQ, n_layer=2, n_embd=64, n_head=4)
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    losses, walls = [], []
    for _ in range(STEPS):
        start, seen = time.perf_counter(), []
        for _ in range(GAS):
            batch = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            seen.append(loss.item())
        walls.append(time.perf_counter() - start)
        losses.append(sum(seen) / GAS)
    return engine, losses, walls


def test_monitors_timers_comms_table_and_step_metrics(tmp_path, caplog, one_rank):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with caplog.at_level(logging.INFO, logger="raydeep"):
        engine, losses, walls = _train(_config(tmp_path))
        metrics, breakdown, stats = engine.step_metrics, engine.memory_breakdown(), engine.comm_stats()
        engine.destroy()  # closes the monitors' files
    samples = [MICRO * GAS * (s + 1) for s in range(STEPS)]

    # --- step_metrics and step_loss ---
    assert set(metrics) == STEP_METRICS_KEYS
    assert (metrics["step"], metrics["samples"], metrics["skipped_steps"]) == (STEPS, samples[-1], 0)
    assert metrics["lr"] == pytest.approx(1e-3) and metrics["loss_scale"] == 1.0 and metrics["grad_norm"] > 0
    assert metrics["forward_s"] > 0 and metrics["backward_s"] > 0 and metrics["optimizer_s"] > 0
    assert metrics["forward_s"] + metrics["backward_s"] + metrics["optimizer_s"] < walls[-1]
    assert 0 <= metrics["comm_wait_s"] <= metrics["backward_s"] + metrics["optimizer_s"]
    assert metrics["comm_wait_s"] == pytest.approx(sum(op["blocked_s"] for op in metrics["comm"].values()))
    # This step's share of the cumulative counters: one of the three steps' (each step is alike).
    assert set(metrics["comm"]) == set(stats) - {"broadcast"}
    for op, entry in metrics["comm"].items():
        assert entry["calls"] * STEPS == stats[op]["calls"] and entry["bytes"] * STEPS == stats[op]["bytes"], op
    assert metrics["model_state_bytes"] == breakdown["total"] and metrics["peak_memory_bytes"] is None
    assert engine.step_loss.device == engine.device and engine.step_loss.item() == pytest.approx(losses[-1], rel=1e-6)

    # --- TensorBoard: <output_path>/<job_name>/events.out.tfevents.* ---
    events = EventAccumulator(str(tmp_path / "tb" / "run"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == set(EVENT_NAMES) - {"Train/Samples/loss_scale"}  # fp16 only
    train_loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in train_loss] == samples
    assert [e.value for e in train_loss] == pytest.approx(losses, rel=1e-6)
    assert [e.value for e in events.Scalars("Train/Samples/skipped_steps")] == [0, 0, 0]

    # --- CSV: one file per event, header "step,<last part>", a row per step ---
    files = {p.name: p for p in (tmp_path / "csv" / "run").iterdir()}
    assert set(files) == {n.replace("/", "_") + ".csv" for n in tags}
    for name in tags:
        rows = list(csv.reader(files[name.replace("/", "_") + ".csv"].open()))
        assert rows[0] == ["step", name.split("/")[-1]] and [int(r[0]) for r in rows[1:]] == samples, name
    loss_rows = list(csv.reader(files["Train_Samples_train_loss.csv"].open()))[1:]
    assert [float(r[1]) for r in loss_rows] == pytest.approx(losses, rel=1e-6)

    # --- wall_clock_breakdown: micro lines every micro-step, the step's line every optimizer step ---
    messages = [r.getMessage() for r in caplog.records if r.name == "raydeep"]
    assert sum(bool(MICRO_LINE.match(m)) for m in messages) == STEPS * GAS
    global_lines = [GLOBAL_LINE.match(m) for m in messages if GLOBAL_LINE.match(m)]
    assert len(global_lines) == STEPS
    fwd, bwd, inner, allreduce, step = (float(v) for v in global_lines[-1].groups())
    assert fwd == pytest.approx(metrics["forward_s"] * 1000, abs=0.006)
    assert bwd == pytest.approx(inner + allreduce, abs=0.02) and step >= metrics["optimizer_s"] * 1000 - 0.006
    elapsed = events.Scalars("Train/Samples/elapsed_time_ms_forward")[-1].value
    assert elapsed == pytest.approx(metrics["forward_s"] * 1000, rel=1e-5)

    # --- comms_logger: DeepSpeed's table every steps_per_print steps, ops under DeepSpeed's names ---
    tables = [m.splitlines() for m in messages if m.startswith("Comm. Op")]
    assert len(tables) == 1 and tables[0][0] == TABLE_HEADER
    ops = [line for line in tables[0][1:] if not line.startswith(" ")]
    assert set(ops) == {"all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast"}
    # The step= line (kept) comes every steps_per_print steps as before.
    assert sum(m.startswith(f"step={STEPS}, skipped=0, lr=") for m in messages) == 1


def test_comms_logger_options(caplog, one_rank):
    """prof_all false profiles only prof_ops (DeepSpeed's names or raydeep's), debug names the
    caller, verbose logs each op as DeepSpeed's line does."""
    comm.configure_comms_logger(SimpleNamespace(verbose=True, prof_all=False, prof_ops=["all_reduce"], debug=True))
    stats = comm.CommStats()
    with caplog.at_level(logging.INFO, logger="raydeep"):
        comm.all_reduce(torch.ones(256), stats)
        comm.broadcast(torch.ones(8), 0, stats)
        comm.all_reduce(torch.ones(256), stats, async_op=True).wait()
        summary = comm.log_summary(return_dict=True)["summary"]
    record = "all_reduce | [Caller Func: test_comms_logger_options]"
    assert list(summary) == [record] and summary[record][1024]["count"] == 2
    assert summary[record][1024]["msg_size_str"] == "1.0 KB"
    verbose = [r.getMessage() for r in caplog.records if r.getMessage().startswith("comm op: ")]
    assert len(verbose) == 2 and re.match(rf"^comm op: {re.escape(record)} \| time \(ms\): \d+\.\d\d \| msg size: "
                                          r"1\.0 KB \| algbw \(Gbps\): \d+\.\d\d \| busbw \(Gbps\): \d+\.\d\d$",
                                          verbose[0])
    comm.reset_log()
    assert comm.log_summary(return_dict=True)["summary"] == {}


def test_recording_is_off_without_a_comms_logger(one_rank):
    comm.configure_comms_logger(None)
    pending = comm.all_reduce(torch.ones(4), comm.CommStats(), async_op=True)
    assert pending.profile is None
    pending.wait()
    assert comm.log_summary() is None


def test_bandwidth_factors_are_deepspeeds():
    from raydeep.comm.comms_logging import bandwidth_gbps

    mb, n = 2 ** 20, 4  # 1 MiB in 1 ms on 4 ranks: 8.39 Gbps of payload
    base = mb * 8 / 1e6
    assert bandwidth_gbps("all_reduce", mb, 1.0, n) == pytest.approx((2 * base, base * 2 * (n - 1) / n))
    assert bandwidth_gbps("all_gather_into_tensor", mb, 1.0, n) == pytest.approx((n * base, n * base * (n - 1) / n))
    assert bandwidth_gbps("reduce_scatter_tensor", mb, 1.0, n) == pytest.approx((n * base, n * base * (n - 1) / n))
    assert bandwidth_gbps("all_to_all_single", mb, 1.0, n) == pytest.approx((base, base * (n - 1) / n))
    assert bandwidth_gbps("broadcast", mb, 1.0, n) == pytest.approx((base, base))


def test_tensorboard_without_its_package_is_refused_at_load(monkeypatch):
    import importlib.util

    from raydeep.config import load_config
    from raydeep.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "tensorboard": {"enabled": True}})
    assert info.value.key == "tensorboard.enabled" and "pip install 'raydeep[monitor]'" in info.value.fix


def test_wandb_and_comet_warn_to_use_the_file_monitors():
    from raydeep.config import load_config

    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "wandb": {"enabled": True},
                       "comet": {"enabled": True}})
    for key in ("wandb.enabled", "comet.enabled"):
        text = next(w for w in cfg.warnings if w.startswith(f"{key} = "))
        assert "not supported (no network access from raydeep's workers" in text
        assert text.endswith("use tensorboard or csv_monitor")


def test_step_metrics_without_monitors_or_timers():
    """No monitor and no wall_clock_breakdown: step_metrics still fills, step_loss stays on the device."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, losses, _ = _train(cfg)
    assert engine.monitors is None and not engine.meter.sync
    assert set(engine.step_metrics) == STEP_METRICS_KEYS
    assert engine.step_metrics["comm"] == {} and engine.step_metrics["comm_wait_s"] == 0.0
    assert torch.is_tensor(engine.step_loss) and engine.step_loss.item() == pytest.approx(losses[-1], rel=1e-6)


def test_a_checkpoint_load_adds_nothing_to_the_next_steps_bytes(tmp_path, one_rank):
    """The collectives of a load (a resumed attempt's restore) are between steps: the first step
    after it moves what every other step moves."""
    cfg = {key: value for key, value in _config(tmp_path).items() if key not in ("tensorboard", "csv_monitor")}
    engine, *_ = _train(cfg)
    before = engine.step_metrics["comm"]
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    calls = engine.comm_stats()
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert engine.comm_stats() != calls, "the load issued no collective: this test shows nothing"
    g = torch.Generator().manual_seed(2)
    for _ in range(GAS):
        batch = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    after = engine.step_metrics["comm"]
    engine.destroy()
    assert {op: e["bytes"] for op, e in after.items()} == {op: e["bytes"] for op, e in before.items()}
