"""The report's figures, one function per PNG, each taking the run's metrics and returning PNG bytes;
``*_figure`` builds the matplotlib Figure each PNG is rendered from (what a test reads back).

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas rather than through
``pyplot``: no global figure state and no GUI backend, whatever the calling process set up.
Every plot is against the global step, with the attempts shaded and each restart drawn as a
dashed line, so a change in loss, speed or memory can be read against the restart that caused it.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator, PercentFormatter

from raydeep.metrics import COLLECTIVES
from raydeep.report.run_data import AttemptSpan, StepSeries, has_values, step_series, values

WIDTH, ROW_HEIGHT, DPI = 11.0, 3.4, 110
# At most this many points a figure; beyond, each point is the mean of consecutive steps. Lines
# can take a few per pixel and still show a noisy curve's spread; stacked areas take fewer, or
# every step's spike (a checkpoint, a slow batch) would cover the breakdown they are for.
LINE_POINTS, STACK_POINTS = 5000, 500
FEW_POINTS = 60  # below this many steps, draw markers: a line through 1-2 points is invisible
MANY_RANKS = 8  # above this, per-rank lines become a min-max band around rank 0
RESTART_COLOR = "#c0392b"
SPAN_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860", "#da8bc3")

PART_COLORS = {"forward": "#4c72b0", "backward": "#55a868", "comm wait": "#c44e52", "optimizer": "#8172b3",
               "checkpoint": "#ccb974", "other": "#8c8c8c"}
COLLECTIVE_COLORS = {"all_reduce": "#4c72b0", "reduce_scatter": "#dd8452", "all_gather": "#55a868",
                     "broadcast": "#8172b3", "all_to_all": "#937860"}
STEP_PARTS = (("forward_s", "forward"), ("backward_s", "backward"), ("comm_wait_s", "comm wait"),
              ("optimizer_s", "optimizer"), ("checkpoint_s", "checkpoint"), ("other_s", "other"))
SCALAR_COLUMNS = (["loss", "tokens_per_s", "samples_per_s", "mfu", "step_s"] + [c for c, _ in STEP_PARTS]
                  + [f"bytes_{op}" for op in COLLECTIVES])


@dataclass(frozen=True)
class PlotInput:
    """What every figure is drawn from: the run's metrics (every step) and its attempts."""

    run_name: str
    metrics: pa.Table
    spans: list[AttemptSpan]

    def points(self, max_points: int, per_rank: tuple[str, ...] = ()) -> StepSeries:
        return step_series(self.metrics, SCALAR_COLUMNS, list(per_rank), max_points)

    def mean(self, column: str) -> float:
        """Over every step with a value (not over the plotted points); 0 when none has one."""
        array = values(self.metrics, column)
        finite = array[np.isfinite(array)]
        return float(finite.mean()) if finite.size else 0.0


# --- the five figures ----------------------------------------------------------------------------
def loss_png(data: PlotInput) -> bytes:
    return _png(loss_figure(data))


def loss_figure(data: PlotInput) -> Figure:
    points = data.points(LINE_POINTS)
    fig, (ax,) = _figure(data, points, "Training loss", rows=1, height=4.8)
    loss = points.column("loss")
    if has_values(loss):
        _line(ax, points, loss, color="#1f3b73", linewidth=1.4, label="loss (mean over ranks)")
        if _spans_decades(loss):
            ax.set_yscale("log")
    else:
        _note(ax, "loss not recorded")
    _mark_attempts(ax, data.spans, label_spans=True)
    _label(ax, "loss")
    _legend(ax, loc="best")
    return fig


def throughput_png(data: PlotInput) -> bytes:
    return _png(throughput_figure(data))


def throughput_figure(data: PlotInput) -> Figure:
    points = data.points(LINE_POINTS)
    fig, (speed, mfu) = _figure(data, points, "Throughput", rows=2, height_ratios=(3, 2))
    _plot_speed(speed, points)
    _from_zero(speed)  # a dip reads as its true size, not as a fall to nothing
    utilisation = points.column("mfu")
    if has_values(utilisation):
        _line(mfu, points, utilisation * 100, color="#2ca02c", label="MFU")
        mfu.yaxis.set_major_formatter(PercentFormatter())
        _from_zero(mfu)
    else:
        _note(mfu, "MFU not available (no peak FLOP/s known for this device)")
    _label(mfu, "MFU (% of peak)")
    for ax in (speed, mfu):
        _mark_attempts(ax, data.spans, label_spans=ax is speed)
    _legend(speed, loc="best")
    _legend(mfu, loc="best")
    return fig


def _plot_speed(ax, points: StepSeries) -> None:
    """tokens/s on the left axis. samples/s is tokens/s over the sequence length, so when that
    ratio is constant it is a second scale on the right rather than a line drawn over the first."""
    tokens, samples = points.column("tokens_per_s"), points.column("samples_per_s")
    ax.yaxis.set_major_formatter(EngFormatter())
    if not has_values(tokens) and not has_values(samples):
        _note(ax, "throughput not recorded")
        _label(ax, "tokens/s", xlabel=False)
        return
    if not has_values(tokens):
        _line(ax, points, samples, color="#ff7f0e", label="samples/s")
        _label(ax, "samples/s", xlabel=False)
        return
    _line(ax, points, tokens, color="#1f77b4", label="tokens/s")
    _label(ax, "tokens/s", xlabel=False)
    ratio = _constant_ratio(tokens, samples)
    if ratio is not None:
        right = ax.secondary_yaxis("right", functions=(lambda t: t / ratio, lambda s: s * ratio))
        right.set_ylabel(f"samples/s (= tokens/s ÷ {ratio:g})")
        right.yaxis.set_major_formatter(EngFormatter())
    elif has_values(samples):
        right = ax.twinx()
        _line(right, points, samples, color="#ff7f0e", label="samples/s", alpha=0.85)
        _from_zero(right)
        right.set_ylabel("samples/s")
        right.yaxis.set_major_formatter(EngFormatter())
        lines = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=lines, loc="best")


def step_time_png(data: PlotInput) -> bytes:
    return _png(step_time_figure(data))


def step_time_figure(data: PlotInput) -> Figure:
    points = data.points(STACK_POINTS)
    fig, (ax,) = _figure(data, points, "Step time breakdown (rank 0)", rows=1, height=4.8)
    parts = {label: points.column(column) for column, label in STEP_PARTS}
    # The measured line is the step plus its checkpoint save: the parts stacked below add up to it.
    total = points.column("step_s") + np.nan_to_num(points.column("checkpoint_s"))
    scale, unit = (1e3, "ms") if np.nanmax(np.r_[total, *parts.values(), 0.0]) < 1 else (1.0, "s")
    # Stacked areas cannot show a gap, so a part unknown at a step counts as zero there;
    # the measured step time drawn on top shows what the parts do not account for.
    recorded = {label: np.nan_to_num(v) * scale for label, v in parts.items() if has_values(v)}
    # Means in the legend, because they add up: the parts' to the mean step time.
    legend = [f"{label} (mean {data.mean(column) * scale:.3g} {unit})" for column, label in STEP_PARTS
              if label in recorded]
    _stack(ax, points, recorded, [PART_COLORS[label] for label in recorded], legend)
    if has_values(total):
        _line(ax, points, total * scale, color="black", linewidth=1.1,
              label=f"whole step with its save, measured (mean {np.nanmean(total) * scale:.3g} {unit})")
    if not recorded and not has_values(total):
        _note(ax, "step times not recorded")
    _from_zero(ax)
    _mark_attempts(ax, data.spans, label_spans=True)
    _label(ax, f"time per step ({unit})")
    _legend_outside(ax)
    return fig


def memory_png(data: PlotInput) -> bytes:
    return _png(memory_figure(data))


def memory_figure(data: PlotInput) -> Figure:
    points = data.points(LINE_POINTS, per_rank=("model_state_bytes", "peak_memory_bytes"))
    fig, (states, peak) = _figure(data, points, "Device memory per rank", rows=2)
    model_states, peaks = points.per_rank["model_state_bytes"], points.per_rank["peak_memory_bytes"]
    scale, unit = _byte_unit(np.r_[model_states.ravel(), peaks.ravel()])
    _plot_per_rank(states, points, model_states / scale, "model states not recorded")
    _plot_per_rank(peak, points, peaks / scale, "peak memory not recorded (CPU ranks have no allocator peak)")
    _label(states, f"model states ({unit})", xlabel=False)
    _label(peak, f"allocator peak during the step ({unit})")
    for ax in (states, peak):
        _mark_attempts(ax, data.spans, label_spans=ax is states)
        _legend(ax, loc="best", ncols=4, fontsize=8.5)
    return fig


def comm_bytes_png(data: PlotInput) -> bytes:
    return _png(comm_bytes_figure(data))


def comm_bytes_figure(data: PlotInput) -> Figure:
    points = data.points(STACK_POINTS)
    fig, (ax,) = _figure(data, points, "Collective traffic per step (bytes rank 0 moved)", rows=1, height=4.8)
    by_op = {op: points.column(f"bytes_{op}") / 1e6 for op in COLLECTIVES}
    moved = {op: np.nan_to_num(mb) for op, mb in by_op.items() if np.nansum(mb) > 0}
    if moved:
        # The mean in the legend gives a collective too small to see in the stack its size.
        legend = [f"{op.replace('_', '-')} (mean {_megabytes(data.mean(f'bytes_{op}'))})" for op in moved]
        _stack(ax, points, moved, [COLLECTIVE_COLORS[op] for op in moved], legend)
        _from_zero(ax)
    else:
        _note(ax, "no collective traffic recorded")
    _mark_attempts(ax, data.spans, label_spans=True)
    _label(ax, "MB per step")
    _legend_outside(ax)
    return fig


FIGURES = {"loss.png": loss_png, "throughput.png": throughput_png, "step_time.png": step_time_png,
           "memory.png": memory_png, "comm_bytes.png": comm_bytes_png}


# --- shared pieces -------------------------------------------------------------------------------
def _figure(data: PlotInput, points: StepSeries, title: str, rows: int, height: float | None = None,
            height_ratios=None):
    fig = Figure(figsize=(WIDTH, height or ROW_HEIGHT * rows + 0.8), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False, height_ratios=height_ratios)[:, 0]
    fig.suptitle(f"{title} — {data.run_name}", fontsize=13, fontweight="bold")
    if data.spans:
        # Half a step of margin either side keeps a one-step run (or attempt) visible.
        for ax in axes:
            ax.set_xlim(data.spans[0].first_step - 0.5, data.spans[-1].last_step + 0.5)
    averaged = f"; each point is the mean of {points.bin_size} steps" if points.bin_size > 1 else ""
    axes[0].set_title(_attempts_line(data.spans) + averaged, fontsize=9, color="#555555", loc="left")
    return fig, list(axes)


def _attempts_line(spans: list[AttemptSpan]) -> str:
    worlds = " → ".join(str(s.world_size) if s.world_size is not None else "?" for s in spans)
    return f"{_plural(len(spans), 'attempt')}, {_plural(len(spans) - 1, 'restart')}, world size {worlds}"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _line(ax, points: StepSeries, y: np.ndarray, label: str | None = None, **style) -> None:
    """One line per attempt, in one colour: a restart is a gap, not a slope between the last
    step of one attempt and the first of the next."""
    for i, rows in enumerate(points.attempt_slices()):
        ax.plot(points.steps[rows], y[rows], label=label if i == 0 else None, **style, **_markers(points.steps.size))


def _stack(ax, points: StepSeries, series: dict[str, np.ndarray], colors: list[str], labels: list[str]) -> None:
    """Stacked areas, one stack per attempt (a restart is a gap), labelled once."""
    if not series:
        return
    for i, rows in enumerate(points.attempt_slices()):
        ax.stackplot(points.steps[rows], *(v[rows] for v in series.values()), colors=colors, alpha=0.85,
                     labels=labels if i == 0 else ())


def _mark_attempts(ax, spans: list[AttemptSpan], label_spans: bool) -> None:
    """Shade each attempt, draw each restart as a dashed line, and name the attempt and its
    world size at the top of its span when there is room for the text."""
    if not spans:
        return
    low, high = ax.get_xlim()
    width = max(high - low, 1.0)
    for i, span in enumerate(spans):
        left, right = span.first_step - 0.5, span.last_step + 0.5
        ax.axvspan(left, right, color=SPAN_COLORS[i % len(SPAN_COLORS)], alpha=0.08, linewidth=0)
        if i:
            ax.axvline(left, color=RESTART_COLOR, linestyle="--", linewidth=1.2,
                       label="restart (new attempt)" if i == 1 else None)
        if label_spans and (right - left) / width > 0.06:
            world = _plural(span.world_size, "rank") if span.world_size is not None else "world size ?"
            ax.text(left + 0.01 * width, 0.97, f"attempt {span.attempt} · {world}", transform=ax.get_xaxis_transform(),
                    fontsize=8.5, va="top", ha="left", color="#333333",
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
    if label_spans:
        _headroom(ax)
    ax.set_xlim(low, high)


def _from_zero(ax) -> None:
    """A y axis from 0 with a margin above the highest value drawn, so no line runs along the
    top edge under the legend."""
    top = ax.dataLim.y1
    if np.isfinite(top) and top > 0:
        ax.set_ylim(0, top * 1.08)
    else:
        ax.set_ylim(bottom=0)


def _headroom(ax, fraction: float = 0.12) -> None:
    """Room above the data for the attempt labels."""
    low, high = ax.get_ylim()
    if ax.get_yscale() == "log":
        ax.set_ylim(low, high * (high / low) ** fraction)
    else:
        ax.set_ylim(low, high + (high - low) * fraction)


def _plot_per_rank(ax, points: StepSeries, per_rank: np.ndarray, missing: str) -> None:
    if not has_values(per_rank):
        _note(ax, missing)
        return
    ranks = per_rank.shape[1]
    if ranks > MANY_RANKS:
        _plot_rank_band(ax, points, per_rank)
    else:
        for rank in range(ranks):
            if has_values(per_rank[:, rank]):
                _line(ax, points, per_rank[:, rank], label=f"rank {rank}", color=f"C{rank}", linewidth=1.4,
                      linestyle=("-", "--", "-.", ":")[rank % 4])
    _from_zero(ax)


def _plot_rank_band(ax, points: StepSeries, per_rank: np.ndarray) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # steps with no rank recorded stay NaN: a gap
        low, high = np.nanmin(per_rank, axis=1), np.nanmax(per_rank, axis=1)
    for i, rows in enumerate(points.attempt_slices()):
        ax.fill_between(points.steps[rows], low[rows], high[rows], color="C0", alpha=0.3,
                        label=f"min-max over {per_rank.shape[1]} ranks" if i == 0 else None)
    _line(ax, points, per_rank[:, 0], label="rank 0", color="C0", linewidth=1.2)


def _label(ax, ylabel: str, xlabel: bool = True) -> None:
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel("global step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # steps are whole
    ax.grid(True, alpha=0.3)


def _legend(ax, **options) -> None:
    if ax.get_legend_handles_labels()[0] and ax.get_legend() is None:
        ax.legend(**options)


def _legend_outside(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        # Stacked series are listed top first, the order they appear in the plot.
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=11, color="#777777")
    ax.set_yticks([])


def _markers(points: int) -> dict:
    return {"marker": "o", "markersize": 3} if points < FEW_POINTS else {}


def _constant_ratio(numerator: np.ndarray, denominator: np.ndarray) -> float | None:
    both = np.isfinite(numerator) & np.isfinite(denominator) & (denominator > 0)
    if not both.any():
        return None
    ratio = numerator[both] / denominator[both]
    return float(ratio[0]) if np.allclose(ratio, ratio[0], rtol=1e-6) else None


def _spans_decades(array: np.ndarray) -> bool:
    """A log scale when the values are positive and span more than a decade (the early loss of
    a run dwarfs the rest on a linear one)."""
    finite = array[np.isfinite(array)]
    return finite.size > 1 and finite.min() > 0 and finite.max() / finite.min() > 10


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB" if nbytes >= 1e4 else f"{nbytes:.0f} B"


def _byte_unit(array: np.ndarray) -> tuple[float, str]:
    finite = array[np.isfinite(array)]
    return (1e9, "GB") if finite.size and finite.max() >= 1e9 else (1e6, "MB")


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
