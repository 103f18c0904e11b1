"""What a report is made from: a run directory's ``summary.json`` (absent while the run goes on)
and its per-step metrics (:mod:`raydeep.metrics`), turned into numpy arrays the plots can take
as they are: nulls become NaN, per-rank list columns a (points, ranks) matrix, and a long run's
steps means over bins of consecutive steps.
"""
from __future__ import annotations

import json
import posixpath
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from raydeep.storage import Storage
from raydeep.errors import InputError
from raydeep.metrics import METRICS_DIR, read_metrics

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class AttemptSpan:
    """The consecutive steps one attempt of the worker group trained."""

    attempt: int
    world_size: int | None
    first_step: int
    last_step: int


@dataclass
class RunData:
    name: str
    location: str  # the run directory as the user wrote it, for messages and the report
    summary: dict | None  # None while the run is still going
    metrics: pa.Table  # every step, sorted
    spans: list[AttemptSpan]

    @property
    def finished(self) -> bool:
        return self.summary is not None


def load_run(storage: Storage) -> RunData:
    """The run at ``storage``; an :class:`InputError` naming the directory when it has no metrics."""
    metrics = _read_metrics_or_explain(storage)
    summary = _read_summary(storage)
    name = (summary or {}).get("name") or posixpath.basename(storage.root.rstrip("/")) or storage.describe()
    return RunData(name=name, location=storage.describe(), summary=summary, metrics=metrics,
                   spans=attempt_spans(metrics))


def _read_metrics_or_explain(storage: Storage) -> pa.Table:
    metrics_dir = storage.describe(METRICS_DIR)
    try:
        found = _has_parquet_files(storage)
        table = read_metrics(storage.uri) if found else None
    except (pa.ArrowException, OSError) as err:
        raise InputError("RUN", f"cannot read the metrics in {metrics_dir}: {err}", value=storage.describe(),
                         fix="check RUN and its credentials, and that the files are raydeep metrics") from None
    if table is None:
        where = "no such run directory" if not storage.is_dir("") else f"no metrics files in {metrics_dir}"
        raise InputError("RUN", where, value=storage.describe(),
                         fix=f"point RUN at <storage>/<name> of a `raydeep train` run; it writes "
                             f"{METRICS_DIR}/attempt-<A>.parquet once its first steps are done")
    if table.num_rows == 0:
        raise InputError("RUN", f"no steps recorded yet in {metrics_dir}", value=storage.describe(),
                         fix="wait for the run's first metrics flush and try again")
    return table


def _has_parquet_files(storage: Storage) -> bool:
    if not storage.is_dir(METRICS_DIR):
        return False
    found = storage.fs.get_file_info(pafs.FileSelector(storage.path(METRICS_DIR)))
    return any(info.path.endswith(".parquet") for info in found)


def _read_summary(storage: Storage) -> dict | None:
    if not storage.exists(SUMMARY_FILE):
        return None
    try:
        summary = json.loads(storage.read(SUMMARY_FILE))
    except (ValueError, OSError) as err:
        # A damaged summary should not hide the metrics: report from those alone.
        print(f"warning: ignoring {storage.describe(SUMMARY_FILE)}: {err}", file=sys.stderr)
        return None
    return summary if isinstance(summary, dict) else None


# --- columns as arrays ---------------------------------------------------------------------------
def values(table: pa.Table, name: str) -> np.ndarray:
    """A numeric column as float64, null as NaN (an absent column is all NaN)."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    return table.column(name).cast(pa.float64()).to_numpy()


def max_over_ranks(table: pa.Table, name: str) -> float | None:
    """The largest value of a per-rank list column over every rank and step."""
    if name not in table.column_names:
        return None
    value = pc.max(pc.list_flatten(table.column(name))).as_py()
    return None if value is None else float(value)


def has_values(array: np.ndarray) -> bool:
    return bool(np.isfinite(array).any())


def finite_median(array: np.ndarray) -> float | None:
    finite = array[np.isfinite(array)]
    return float(np.median(finite)) if finite.size else None


def last_finite(array: np.ndarray) -> float | None:
    finite = array[np.isfinite(array)]
    return float(finite[-1]) if finite.size else None


# --- attempts and points to plot -------------------------------------------------------------------
def attempt_spans(table: pa.Table) -> list[AttemptSpan]:
    """One span per run of consecutive rows with the same attempt, in step order."""
    steps, attempts, worlds = values(table, "step"), values(table, "attempt"), values(table, "world_size")
    if steps.size == 0:
        return []
    starts = np.flatnonzero(np.r_[True, attempts[1:] != attempts[:-1]])
    ends = np.r_[starts[1:], steps.size]
    spans = []
    for start, end in zip(starts, ends):
        known = worlds[start:end][np.isfinite(worlds[start:end])]
        attempt = attempts[start]
        spans.append(AttemptSpan(attempt=int(attempt) if np.isfinite(attempt) else -1,
                                 world_size=int(known[0]) if known.size else None,
                                 first_step=int(steps[start]), last_step=int(steps[end - 1])))
    return spans


def bin_size(rows: int, max_points: int) -> int:
    """Steps per plotted point so that ``rows`` steps make at most about ``max_points`` points."""
    return max(1, -(-rows // max_points))


@dataclass(frozen=True)
class StepSeries:
    """Metrics as arrays against the step, ready to plot. In a long run each point is the mean
    of ``bin_size`` consecutive steps of one attempt (a bin never straddles a restart), so the
    shape of a curve survives where keeping every k-th step would keep only chance spikes."""

    steps: np.ndarray  # the mean step of each point
    attempts: np.ndarray
    columns: dict[str, np.ndarray]
    per_rank: dict[str, np.ndarray]  # (points, ranks), NaN where a rank has no value
    bin_size: int

    def column(self, name: str) -> np.ndarray:
        return self.columns[name]

    def attempt_slices(self) -> list[slice]:
        """The points of each attempt, in step order."""
        starts = np.flatnonzero(np.r_[True, self.attempts[1:] != self.attempts[:-1]]) if self.steps.size else []
        ends = list(starts[1:]) + [self.steps.size]
        return [slice(int(a), int(b)) for a, b in zip(starts, ends)]


def step_series(table: pa.Table, columns: list[str], per_rank: list[str], max_points: int) -> StepSeries:
    """``columns`` (scalars) and ``per_rank`` (list columns) of ``table``, averaged into at most
    about ``max_points`` points. Nulls, NaN and inf (an overflowed fp16 step's loss) are left out
    of the means, so one bad step is a gap rather than a line off the plot; all missing: NaN."""
    attempts = values(table, "attempt")
    size = bin_size(table.num_rows, max_points)
    bins = _bin_of_row(attempts, size)
    points = int(bins[-1]) + 1 if bins.size else 0
    first_row = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]]) if bins.size else np.array([], int)
    return StepSeries(steps=_bin_means(values(table, "step"), bins, points), attempts=attempts[first_row],
                      columns={name: _bin_means(values(table, name), bins, points) for name in columns},
                      per_rank={name: _per_rank_means(table, name, bins, points) for name in per_rank},
                      bin_size=size)


def _bin_of_row(attempts: np.ndarray, size: int) -> np.ndarray:
    """Each row's point: runs of ``size`` rows, restarting at every change of attempt."""
    rows = np.arange(attempts.size)
    attempt_start = np.maximum.accumulate(np.where(np.r_[True, attempts[1:] != attempts[:-1]], rows, 0))
    return np.cumsum((rows - attempt_start) % size == 0) - 1


def _bin_means(array: np.ndarray, bins: np.ndarray, points: int) -> np.ndarray:
    finite = np.isfinite(array)
    sums = np.bincount(bins, weights=np.where(finite, array, 0.0), minlength=points)
    counts = np.bincount(bins, weights=finite, minlength=points)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _per_rank_means(table: pa.Table, name: str, bins: np.ndarray, points: int) -> np.ndarray:
    """A list column (one value per rank; attempts differ in ranks) as (points, ranks) means,
    built from the flat values so no (steps, ranks) matrix of a long run is ever held."""
    if name not in table.column_names or table.num_rows == 0:
        return np.full((points, 0), np.nan)
    lists = table.column(name).combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy().astype(np.int64)
    width = int(lengths.max(initial=0))
    flat = pc.list_flatten(lists).cast(pa.float64()).to_numpy(zero_copy_only=False)
    row_of_value = np.repeat(np.arange(lengths.size), lengths)
    rank_of_value = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cell = bins[row_of_value] * width + rank_of_value
    finite = np.isfinite(flat)
    sums = np.bincount(cell[finite], weights=flat[finite], minlength=points * width)
    counts = np.bincount(cell[finite], minlength=points * width)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return means.reshape(points, width)
