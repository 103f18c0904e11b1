"""DeepSpeed's monitors: ``tensorboard`` and ``csv_monitor``, written on rank 0 after every
optimizer step with x = ``global_samples``, under DeepSpeed's event names (:data:`EVENT_NAMES`).

Each writes into ``<output_path>/<job_name>/`` as DeepSpeed's do: TensorBoard event files
(``events.out.tfevents.*``) and one CSV file per event. ``wandb`` and ``comet`` need the network,
which raydeep's workers do not have: the config loader warns about them instead.

>>> [name for name in EVENT_NAMES if "elapsed" not in name]  # doctest: +NORMALIZE_WHITESPACE
['Train/Samples/train_loss', 'Train/Samples/lr', 'Train/Samples/loss_scale', 'Train/Samples/grad_norm',
 'Train/Samples/skipped_steps']
"""
from __future__ import annotations

# Every event a monitor receives, in the order written at each step. DeepSpeed's names; the
# train_loss name is its pipeline engine's, grad_norm and skipped_steps are raydeep's own.
EVENT_NAMES = (
    "Train/Samples/train_loss",  # the mean loss engine.backward got over the step (rank 0's)
    "Train/Samples/lr",  # the first parameter group's, after the step
    "Train/Samples/loss_scale",  # fp16 only: the scale after the step, as DeepSpeed reads it
    "Train/Samples/grad_norm",  # when computed; inf on an overflow
    "Train/Samples/skipped_steps",
    # With wall_clock_breakdown: DeepSpeed's global timers of the step, in milliseconds.
    "Train/Samples/elapsed_time_ms_forward",
    "Train/Samples/elapsed_time_ms_backward",
    "Train/Samples/elapsed_time_ms_backward_inner",
    "Train/Samples/elapsed_time_ms_backward_allreduce",
    "Train/Samples/elapsed_time_ms_step",
)
_TIMED = EVENT_NAMES[5:]


def step_events(metrics: dict, loss: float | None, loss_scale: float | None,
                timer_ms: tuple[float, ...] | None) -> list[tuple[str, float, int]]:
    """``(name, value, global_samples)`` for one step from ``engine.step_metrics``; ``loss_scale``
    only with fp16 and ``timer_ms`` (forward, backward, backward_inner, backward_allreduce, step)
    only with wall_clock_breakdown."""
    values = {"Train/Samples/train_loss": loss, "Train/Samples/lr": metrics["lr"],
              "Train/Samples/loss_scale": loss_scale, "Train/Samples/grad_norm": metrics["grad_norm"],
              "Train/Samples/skipped_steps": metrics["skipped_steps"]}
    if timer_ms is not None:
        values.update(zip(_TIMED, timer_ms))
    x = metrics["samples"]
    return [(name, values[name], x) for name in EVENT_NAMES if values.get(name) is not None]


class Monitors:
    """The enabled monitors of rank 0 (DeepSpeed's ``MonitorMaster``)."""

    def __init__(self, writers: list):
        self.writers = writers

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def build_monitors(tensorboard, csv_monitor, rank: int) -> Monitors | None:
    """The monitors the config's ``tensorboard`` and ``csv_monitor`` sections enable, on rank 0;
    None elsewhere or when none is enabled."""
    if rank != 0:
        return None
    writers = []
    if tensorboard.enabled:
        from raydeep.monitor.tensorboard import TensorBoardMonitor

        writers.append(TensorBoardMonitor(tensorboard))
    if csv_monitor.enabled:
        from raydeep.monitor.csv_monitor import CsvMonitor

        writers.append(CsvMonitor(csv_monitor))
    return Monitors(writers) if writers else None

