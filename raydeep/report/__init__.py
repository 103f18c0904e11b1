"""``raydeep report RUN``: plots and a markdown report of a run directory.

Reads ``<RUN>/metrics/attempt-<A>.parquet`` (:mod:`raydeep.metrics`) and, once the run has
finished, ``<RUN>/summary.json``, and writes into ``<RUN>/report/`` (or ``--out``)::

    loss.png  throughput.png  step_time.png  memory.png  comm_bytes.png  report.md

RUN may still be training: the report then covers the steps flushed so far. RUN and the output
may be local paths or pyarrow URIs (``s3://``, ``gs://``, ...).
"""
from __future__ import annotations

import pyarrow as pa

from raydeep.storage import Storage
from raydeep.errors import InputError, RaydeepError

REPORT_DIR = "report"
REPORT_FILE = "report.md"


class MissingPlotting(RaydeepError):
    """matplotlib, an optional dependency, is not installed."""


def build_report(run_uri: str, out_uri: str | None = None) -> list[str]:
    """Write the report of the run at ``run_uri``; returns what was written, report.md last."""
    _require_matplotlib()
    # Imported only now: the figures import matplotlib, which may be missing.
    from raydeep.report.markdown import render_report
    from raydeep.report.plots import FIGURES, STACK_POINTS, PlotInput
    from raydeep.report.run_data import bin_size, load_run

    run_storage = _open(run_uri, "RUN")
    run = load_run(run_storage)
    out = _open(out_uri, "--out") if out_uri else _subdir(run_storage, REPORT_DIR)
    figures = PlotInput(run_name=run.name, metrics=run.metrics, spans=run.spans)
    files = {name: draw(figures) for name, draw in FIGURES.items()}
    most_averaged = bin_size(run.metrics.num_rows, STACK_POINTS)
    files[REPORT_FILE] = render_report(run, most_averaged).encode()
    for name, content in files.items():
        _write(out, name, content)
    return [out.describe(name) for name in files]


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingPlotting("raydeep report draws its plots with matplotlib, which is not installed: "
                              "pip install 'raydeep[monitor]'") from None


def _open(uri: str, flag: str) -> Storage:
    try:
        return Storage.open(uri)
    except (ValueError, pa.ArrowException, OSError) as err:
        raise InputError(flag, f"not a path or filesystem URI: {err}", value=uri,
                         fix="pass a directory, or a URI such as s3://bucket/runs/NAME") from None


def _subdir(storage: Storage, rel: str) -> Storage:
    # Built from the run's filesystem rather than by appending to its URI, which may end in
    # query options (?region=...).
    return Storage(storage.fs, storage.path(rel), storage.describe(rel))


def _write(out: Storage, name: str, content: bytes) -> None:
    try:
        out.write(name, content, fsync=False)  # a report can be rebuilt, so no need to wait for the disk
    except OSError as err:
        raise InputError("--out", f"cannot write {name}: {err}", value=out.describe(),
                         fix="pass --out a directory you can write to") from None
