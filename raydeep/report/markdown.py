"""``report.md``: the run's summary table and the figures, each with a one-line caption.

The table takes what ``summary.json`` says once the run has finished, and falls back on the
metrics while it is still going; speeds and traffic are always computed from the metrics
(medians, so a slow first step or a checkpoint step does not move them).
"""
from __future__ import annotations

import numpy as np

from raydeep.metrics import COLLECTIVES
from raydeep.report.run_data import RunData, finite_median, last_finite, max_over_ranks, values

CAPTIONS = {
    "loss.png": ("Loss", "Loss per global step; shaded spans are attempts (named with their world size), "
                 "dashed red lines are restarts."),
    "throughput.png": ("Throughput", "Tokens/s and samples/s per step (top) and model FLOPs utilisation "
                       "(bottom)."),
    "step_time.png": ("Step time", "Where each step's time went on rank 0, stacked; the black line is the "
                      "measured step time."),
    "memory.png": ("Memory", "Device memory per rank: model states (top) and the allocator's peak during "
                   "the step (bottom)."),
    "comm_bytes.png": ("Communication", "Bytes rank 0 moved per step in each collective, stacked, in MB."),
}


def render_report(run: RunData, most_averaged: int = 1) -> str:
    """The markdown; ``most_averaged``: the most steps a plotted point averages (1: none)."""
    lines = [f"# Run report: {run.name}", "", _status_line(run), ""]
    lines += ["## Summary", "", "| Quantity | Value |", "|:--|:--|"]
    lines += [f"| {_cell(label)} | {_cell(value)} |" for label, value in summary_rows(run)]
    lines += ["", "## Plots", ""]
    if most_averaged > 1:
        lines += [f"Over {run.metrics.num_rows:,} steps, each point of a plot is the mean of up to {most_averaged} "
                  "consecutive steps of one attempt (each plot's subtitle says how many); the table uses every "
                  "step.", ""]
    for image, (heading, caption) in CAPTIONS.items():
        lines += [f"### {heading}", "", f"![{heading}]({image})", "", f"*{caption}*", ""]
    return "\n".join(lines)


def _status_line(run: RunData) -> str:
    last_step = int(values(run.metrics, "step")[-1])
    if run.finished:
        return f"Run directory `{run.location}`: finished (summary.json written), metrics up to step {last_step}."
    return (f"Run directory `{run.location}`: **still running or stopped early** (no summary.json yet); "
            f"metrics up to step {last_step}.")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


# --- the table -----------------------------------------------------------------------------------
def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, value) rows; a row whose value is unknown is left out rather than shown empty."""
    rows = _progress_rows(run) + _attempt_rows(run) + _model_rows(run.summary or {})
    rows += _speed_rows(run) + _traffic_rows(run) + _health_rows(run.summary or {})
    return [(label, value) for label, value in rows if value not in (None, "")]


def _progress_rows(run: RunData) -> list[tuple[str, str | None]]:
    summary, metrics = run.summary or {}, run.metrics
    loss = values(metrics, "loss")
    first_loss = _known(summary.get("first_loss"), _first_finite(loss))
    final_loss = _known(summary.get("final_loss"), last_finite(loss))
    steps = _known(summary.get("global_steps"), int(values(metrics, "step")[-1]))
    samples = _known(summary.get("global_samples"), last_finite(values(metrics, "samples")))
    return [("Model", summary.get("model")), ("Data", summary.get("data")),
            ("Steps", f"{int(steps):,}"), ("Samples", _count(samples)),
            ("First loss", _number(first_loss, ".4f")), ("Final loss", _number(final_loss, ".4f"))]


def _attempt_rows(run: RunData) -> list[tuple[str, str | None]]:
    summary = run.summary or {}
    worlds = summary.get("world_sizes") or [s.world_size for s in run.spans]
    restarts = _known(summary.get("restarts"), max(len(worlds) - 1, 0))
    shown = " → ".join("?" if w is None else str(w) for w in worlds)
    sizes = "world size" if len(worlds) == 1 else "world sizes"
    rows = [("Attempts", f"{len(worlds)} ({restarts} restart{'s' if restarts != 1 else ''}), {sizes} {shown}")]
    rows.append(("Attempt steps", "\n".join(
        f"attempt {s.attempt}: {_step_range(s.first_step, s.last_step)} on {_ranks(s.world_size)}"
        for s in run.spans)))
    rows.append(("Recoveries", "\n".join(_recovery(r) for r in summary.get("recoveries") or [])))
    return rows


def _recovery(recovery: dict) -> str:
    stall = recovery.get("stall_s")
    stalled = f"stalled {stall:.1f} s" if isinstance(stall, (int, float)) else "stall unknown"
    return (f"attempt {recovery.get('attempt', '?')} on {_ranks(recovery.get('world_size'))}: "
            f"resumed from step {recovery.get('resumed_from_step', '?')} "
            f"(last step before: {recovery.get('last_step_before', '?')}), {stalled}")


def _model_rows(summary: dict) -> list[tuple[str, str | None]]:
    memory = summary.get("memory_rank0") or {}
    return [("Parameters", _count(summary.get("num_parameters"))),
            ("ZeRO stage", None if summary.get("zero_stage") is None else str(summary["zero_stage"])),
            ("Train batch size", _count(summary.get("train_batch_size"))),
            ("Model states, rank 0", _bytes(memory.get("total")) if isinstance(memory, dict) else None),
            ("Offload", _offload(summary.get("offload")))]


def _offload(offload) -> str | None:
    if not isinstance(offload, dict):
        return None
    return f"optimizer tier on {offload.get('tier', '?')}"


def _speed_rows(run: RunData) -> list[tuple[str, str | None]]:
    summary, metrics = run.summary or {}, run.metrics
    step_s = finite_median(values(metrics, "step_s"))
    mfu = finite_median(values(metrics, "mfu"))
    return [("Median step time", None if step_s is None else _seconds(step_s)),
            ("Median tokens/s", _number(finite_median(values(metrics, "tokens_per_s")), ",.0f")),
            ("Median samples/s", _number(finite_median(values(metrics, "samples_per_s")), ",.1f")),
            ("Median MFU", "not available" if mfu is None else f"{mfu:.1%}"),
            ("Samples/s over the run", _number(summary.get("samples_per_s"), ",.1f")),
            ("Wall time", None if summary.get("elapsed_s") is None else _seconds(summary["elapsed_s"])),
            ("Peak device memory (any rank)", _bytes(max_over_ranks(metrics, "peak_memory_bytes")))]


def _traffic_rows(run: RunData) -> list[tuple[str, str | None]]:
    """Per collective, the median bytes of a step and the total over the run (rank 0's)."""
    rows, per_step_total = [], 0.0
    for op in COLLECTIVES:
        moved = values(run.metrics, f"bytes_{op}")
        if not np.nansum(moved) > 0:
            continue
        median = finite_median(moved) or 0.0
        per_step_total += median
        rows.append((f"{op.replace('_', '-')} per step (median)",
                     f"{_bytes(median)} (run total {_bytes(np.nansum(moved))})"))
    if rows:
        rows.append(("All collectives per step (median)", _bytes(per_step_total)))
    return rows


def _health_rows(summary: dict) -> list[tuple[str, str | None]]:
    hangs = summary.get("hangs") or []
    skipped = [tag for a in summary.get("attempts") or [] for tag, _ in a.get("skipped_checkpoints") or []]
    hung_steps = ", ".join(str(hang.get("step")) for hang in hangs)
    return [("Hangs reported", f"{len(hangs)} (steps {hung_steps})" if hangs else None),
            ("Damaged checkpoints passed over", ", ".join(map(str, skipped)) or None)]


# --- formatting ----------------------------------------------------------------------------------
def _known(value, fallback):
    """The summary's value, or the metrics' where the summary has none (or says null)."""
    return fallback if value is None else value


def _step_range(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _ranks(world_size) -> str:
    return "? ranks" if world_size is None else f"{world_size} rank{'' if world_size == 1 else 's'}"


def _first_finite(array: np.ndarray) -> float | None:
    finite = array[np.isfinite(array)]
    return float(finite[0]) if finite.size else None


def _number(value, spec: str) -> str | None:
    return None if not isinstance(value, (int, float)) or not np.isfinite(value) else format(value, spec)


def _count(value) -> str | None:
    if not isinstance(value, (int, float)) or not np.isfinite(value):
        return None
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.2f} {unit} ({int(value):,})"
    return f"{int(value):,}"


def _bytes(value) -> str | None:
    if not isinstance(value, (int, float)) or not np.isfinite(value):
        return None
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} B"


def _seconds(value: float) -> str:
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    hours, minutes = divmod(round(value / 60), 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min"
