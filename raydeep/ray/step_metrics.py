"""The per-step metrics of a ``raydeep train`` run (:mod:`raydeep.metrics`): rates for every step,
and rank 0's Parquet rows.

- :class:`Throughput` turns a step's wall time into samples/s, tokens/s and MFU. It is plain
  arithmetic that every rank gets the same way, so the progress events and the checkpoint
  reports carry the rates whether or not the rows are written.
- :class:`StepMetrics` is each rank's part in the rows (``raydeep.metrics``, on by default):
  rank 0 builds each step's row from the engine's ``step_metrics`` and the loop's own values,
  and at each flush every rank takes part in one small all-gather of its memory in the steps
  since the last one. With ``raydeep.metrics`` false nothing is written and no collective is
  added.
- :class:`MetricsWriter` owns ``metrics/attempt-<A>.parquet``: it rewrites the file whole at each
  flush (a temporary name, then a rename: readers see the old file or the new one), one row
  group per flush, every ``FLUSH_EVERY`` steps, before each checkpoint and at the end. When an
  attempt starts it first cuts from the files of earlier attempts the steps this attempt trains
  again, so across the files every step appears once.

MFU is model FLOPs per second over ``world size x the chip's peak``: FLOPs per token from
``model.flops_per_token(seq)`` when the model has it (raydeep's GPT: ``6N + 12 L d T``), else
``6 x parameters``; the peak from ``raydeep.peak_tflops`` or, on a chip in :data:`PEAK_TFLOPS`,
its dense bf16/fp16 peak. Without either (a CPU run), MFU is null.

>>> rates = Throughput(samples_per_step=16, tokens_per_sample=128, flops_per_token=1e6, world_size=2,
...                    peak_flops=1e12).of(step_s=0.5)
>>> rates["tokens_per_s"], rates["mfu"]
(4096.0, 0.002048)
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist

from raydeep.storage import Storage
from raydeep.config.sections import RaydeepSection
from raydeep.metrics import METRICS_DIR, SCHEMA, attempt_file, collective_bytes

logger = logging.getLogger("raydeep")

FLUSH_EVERY = 50  # steps between flushes: each rewrites the whole file, so not every step
# Dense bf16/fp16 TFLOP/s of one chip, matched as words of torch.cuda.get_device_name()
# ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"; "L4" does not match an "L40S"). The first
# match wins, so a form factor with its own clock and power ("H100 PCIe", "H100 NVL") comes
# before its chip's SXM figure.
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0, "H200": 989.0,
               "GH200": 989.0, "A100": 312.0, "A10G": 125.0, "L4": 121.0, "V100": 125.0}
_ATTEMPT_FILE = re.compile(r"attempt-(\d+)\.parquet$")


# --- rates ------------------------------------------------------------------------------------------
def chip_peak_tflops(device_name: str) -> float | None:
    """The dense bf16/fp16 peak of the chip ``torch.cuda.get_device_name()`` calls ``device_name``."""
    return next((tflops for chip, tflops in PEAK_TFLOPS.items() if re.search(rf"\b{chip}\b", device_name)), None)


def peak_flops(peak_tflops: float | None, device: torch.device) -> float | None:
    """One chip's peak in FLOP/s: the configured ``raydeep.peak_tflops``, else the table's for a
    CUDA device, else None (a CPU, or a chip the table does not know)."""
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = chip_peak_tflops(torch.cuda.get_device_name(device))
    return None if peak_tflops is None else peak_tflops * 1e12


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own count, else 6 x its parameters. Call it before
    the engine partitions the parameters (ZeRO-3 leaves each rank only its slices)."""
    if hasattr(model, "flops_per_token"):
        return float(model.flops_per_token(seq_len))
    return 6.0 * sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


@dataclass(frozen=True)
class Throughput:
    """What a step's wall time means for the run (see the module docstring)."""

    samples_per_step: int           # the global batch
    tokens_per_sample: int
    flops_per_token: float
    world_size: int
    peak_flops: float | None        # one chip's, FLOP/s

    def of(self, step_s: float) -> dict:
        """``samples_per_s``, ``tokens_per_s`` and ``mfu`` (None without a peak) of a step."""
        if step_s <= 0:
            return {"samples_per_s": None, "tokens_per_s": None, "mfu": None}
        samples_s = self.samples_per_step / step_s
        tokens_s = samples_s * self.tokens_per_sample
        mfu = None if self.peak_flops is None else tokens_s * self.flops_per_token / (self.world_size * self.peak_flops)
        return {"samples_per_s": samples_s, "tokens_per_s": tokens_s, "mfu": mfu}


def throughput_of(options: RaydeepSection, engine, tokens_per_sample: int, model_flops_per_token: float) -> Throughput:
    """The run's :class:`Throughput` at this attempt's world size, the peak from
    ``raydeep.peak_tflops`` or the engine's chip."""
    return Throughput(samples_per_step=engine.train_batch_size(), tokens_per_sample=tokens_per_sample,
                      flops_per_token=model_flops_per_token, world_size=engine.world_size,
                      peak_flops=peak_flops(options.peak_tflops, engine.device))


# --- rows ---------------------------------------------------------------------------------------------
def gather_memory(pending: list[tuple[int | None, int | None]], device: torch.device,
                  world: int) -> list[tuple[list, list]]:
    """Every rank's ``(model_state_bytes, peak_memory_bytes)`` of each pending step, as one row's
    two per-rank lists (rank order): one all-gather of ``steps x 2`` int64 on the engine's device
    (NCCL gathers CUDA tensors only), one copy to the host. None travels as -1."""
    mine = torch.tensor([[-1 if v is None else int(v) for v in step] for step in pending], dtype=torch.int64,
                        device=device).reshape(len(pending), 2)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    by_rank = torch.stack(everyone).tolist()  # [rank][step][state, peak]
    known = lambda v: None if v < 0 else v  # noqa: E731
    return [([known(r[i][0]) for r in by_rank], [known(r[i][1]) for r in by_rank]) for i in range(len(pending))]


def step_row(values: dict, *, attempt: int, world_size: int, loss: float, step_s: float, checkpoint_s: float | None,
             rates: dict, phase: str | None) -> dict:
    """One row of :data:`raydeep.metrics.SCHEMA` from the engine's ``step_metrics`` (``values``)
    and the loop's measurements of the step; the per-rank memory columns come at the flush."""
    # The engine's phase times include their waits for collectives; the row keeps the waits in
    # comm_wait_s alone, so that forward, backward, comm_wait, optimizer and other add up to step_s.
    wait, fwd_wait, bwd_wait = values["comm_wait_s"], values["forward_wait_s"], values["backward_wait_s"]
    forward_s = max(0.0, values["forward_s"] - fwd_wait)
    backward_s = max(0.0, values["backward_s"] - bwd_wait)
    optimizer_s = max(0.0, values["optimizer_s"] - max(0.0, wait - fwd_wait - bwd_wait))
    other_s = max(0.0, step_s - forward_s - backward_s - wait - optimizer_s)
    return {"step": values["step"], "attempt": attempt, "world_size": world_size, "time": time.time(), "loss": loss,
            "lr": values["lr"], "loss_scale": values["loss_scale"], "grad_norm": values["grad_norm"],
            "skipped_steps": values["skipped_steps"], "samples": values["samples"], "step_s": step_s, **rates,
            "forward_s": forward_s, "backward_s": backward_s, "comm_wait_s": wait, "optimizer_s": optimizer_s,
            "checkpoint_s": checkpoint_s, "checkpoint_forward_s": values.get("checkpoint_forward_s"),
            "checkpoint_recompute_s": values.get("checkpoint_recompute_s"),
            "other_s": other_s, **collective_bytes(values["comm"]), "model_state_bytes": None,
            "peak_memory_bytes": None, "phase": phase or "", "restarts": attempt}


class StepMetrics:
    """One rank's part in the run's per-step rows (see the module docstring).

    Note: the per-rank memory columns are gathered at each flush, for all the steps since the
    previous one, in one collective: measured on 2 CPU ranks, an all-gather per step cost about
    1% of a step, one per flush nothing measurable. Every rank flushes at the same steps (every
    ``flush_every`` steps, before each checkpoint, at the end), so the collective order holds.
    """

    def __init__(self, attempt: int, world_size: int, device: torch.device, writer: MetricsWriter | None,
                 flush_every: int = FLUSH_EVERY, enabled: bool = True):
        self.attempt, self.world_size, self.device, self.writer = attempt, world_size, device, writer
        self.flush_every, self.enabled = flush_every, enabled
        self.pending_memory: list[tuple[int | None, int | None]] = []  # this rank's, per step since the flush

    @classmethod
    def start(cls, options: RaydeepSection, run_uri: str, engine, attempt: int,
              flush_every: int = FLUSH_EVERY) -> StepMetrics:
        """This rank's part; with ``raydeep.metrics`` off, one that does nothing. On rank 0, cuts
        the steps this attempt trains again (after ``engine.global_steps``, where it resumes)
        from earlier attempts' files."""
        if not options.metrics:
            return cls(attempt, engine.world_size, engine.device, None, flush_every, enabled=False)
        writer = MetricsWriter.start(run_uri, attempt, engine.global_steps) if engine.rank == 0 else None
        return cls(attempt, engine.world_size, engine.device, writer, flush_every)

    def record(self, values: dict, *, loss: float, step_s: float, rates: dict, phase: str | None,
               saving: bool) -> None:
        """The step just taken (every rank calls it: it may flush). ``saving``: a checkpoint
        follows, whose seconds :meth:`checkpoint_saved` fills in (null on disk until then)."""
        if not self.enabled:
            return
        self.pending_memory.append((values["model_state_bytes"], values["peak_memory_bytes"]))
        if self.writer is not None:
            self.writer.add(step_row(values, attempt=self.attempt, world_size=self.world_size, loss=loss,
                                     step_s=step_s, checkpoint_s=None if saving else 0.0, rates=rates, phase=phase))
        if len(self.pending_memory) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Gather the pending steps' memory and, on rank 0, write the file (collective)."""
        if self.pending_memory:
            memory = gather_memory(self.pending_memory, self.device, self.world_size)
            self.pending_memory = []
            if self.writer is not None:
                for row, (states, peaks) in zip(self.writer.pending, memory):
                    row["model_state_bytes"], row["peak_memory_bytes"] = states, peaks
        if self.writer is not None:
            self.writer.flush()

    def before_checkpoint(self) -> None:
        """Flush, so the row of every step a checkpoint holds is on disk before it is committed."""
        self.flush()

    def checkpoint_saved(self, seconds: float) -> None:
        if self.writer is not None:
            self.writer.set_last(checkpoint_s=seconds)

    def close(self) -> None:
        self.flush()


# --- the file -----------------------------------------------------------------------------------------
class MetricsWriter:
    """Rank 0's rows of one attempt and ``metrics/attempt-<A>.parquet`` (see the module docstring)."""

    def __init__(self, storage: Storage, attempt: int):
        self.storage, self.attempt = storage, attempt
        self.groups: list[pa.Table] = []   # the file's row groups: the rows before the newest flush, its rows
        self.pending: list[dict] = []      # rows since the last flush
        self.changed = False               # a written row changed since (set_last)

    @classmethod
    def start(cls, run_uri: str, attempt: int, resumed_from_step: int) -> MetricsWriter:
        """A writer for ``attempt``, after cutting every step past ``resumed_from_step`` from the
        run's files. Rows this attempt's own file already holds up to there (its number is reused
        when the attempt before it died before its first checkpoint) stay in it."""
        writer = cls(Storage.open(run_uri), attempt)
        # pyarrow's first conversion from Python rows takes about 0.4 s: here, not in a step.
        pa.Table.from_pylist([], schema=SCHEMA)
        try:
            writer.groups = cut_retrained_steps(writer.storage, resumed_from_step, keep_attempt=attempt)
        except (OSError, pa.ArrowException) as exc:  # metrics are worth a warning, never the run
            logger.warning("could not cut the re-trained steps from the earlier attempts' metrics in %s (%s): "
                           "steps after %d may appear twice", writer.storage.describe(METRICS_DIR), exc,
                           resumed_from_step)
        return writer

    def add(self, row: dict) -> None:
        self.pending.append(row)

    def set_last(self, **values) -> None:
        """Change columns of the newest row; the next flush writes it."""
        if self.pending:
            self.pending[-1].update(values)
        elif self.groups:
            last = self.groups[-1]
            for name, value in values.items():
                column = last.column(name).to_pylist()
                column[-1] = value
                array = pa.array(column, SCHEMA.field(name).type)
                last = last.set_column(last.schema.get_field_index(name), name, array)
            self.groups[-1], self.changed = last, True

    def flush(self) -> None:
        """Rewrite the file with every row so far, the pending ones as a new row group after one
        of every row before them (nothing to write, nothing written). A failed write costs a
        warning, not the run: the rows stay here for the next flush.

        Note: one row group per flush made each flush cost a write per group: 0.33 s at step
        15,000 with a flush every 15 steps (a memory snapshot's), against 9 ms in two groups."""
        if not self.pending and not self.changed:
            return
        if self.pending:
            if len(self.groups) > 1:
                self.groups = [pa.concat_tables(self.groups).combine_chunks()]
            self.groups.append(pa.Table.from_pylist(self.pending, schema=SCHEMA))
            self.pending = []
        try:
            write_groups(self.storage, attempt_file(self.attempt), self.groups)
            self.changed = False
        except (OSError, pa.ArrowException) as exc:
            self.changed = True
            logger.warning("could not write the step metrics to %s (%s); trying again at the next flush",
                           self.storage.describe(attempt_file(self.attempt)), exc)


def write_groups(storage: Storage, rel: str, groups: list[pa.Table]) -> None:
    """Replace ``rel`` with a Parquet file of one row group per table (atomically: see
    ``Storage.write_atomic``)."""
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, SCHEMA) as parquet:
        for group in groups:
            parquet.write_table(group, row_group_size=max(1, group.num_rows))
    storage.write_atomic(rel, sink.getvalue().to_pybytes())


def cut_retrained_steps(storage: Storage, resumed_from_step: int, keep_attempt: int) -> list[pa.Table]:
    """Drop the rows past ``resumed_from_step`` from every attempt's file, keeping row groups; a
    file that loses nothing is left alone. Returns ``keep_attempt``'s own remaining row groups,
    which its writer goes on from."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if not storage.is_dir(METRICS_DIR):
        return []
    own: list[pa.Table] = []
    for info in storage.fs.get_file_info(pafs.FileSelector(storage.path(METRICS_DIR))):
        match = _ATTEMPT_FILE.search(info.path)
        if match is None:
            continue
        with storage.fs.open_input_file(info.path) as f:
            parquet = pq.ParquetFile(f)
            groups = [parquet.read_row_group(i).cast(SCHEMA) for i in range(parquet.num_row_groups)]
        kept = [g.filter(pc.less_equal(g["step"], resumed_from_step)) for g in groups]
        kept = [g for g in kept if g.num_rows]
        attempt = int(match.group(1))
        if sum(g.num_rows for g in kept) < sum(g.num_rows for g in groups):
            write_groups(storage, attempt_file(attempt), kept)
        if attempt == keep_attempt:
            own = kept
    return own
