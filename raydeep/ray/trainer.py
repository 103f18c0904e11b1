"""The driver: plan the batches, build a Ray Train ``TorchTrainer``, run it, write the summary.

Ray Train does the distributed part: gang-scheduling the workers in a placement group, starting
the process group, health checks, restarting the whole group from the latest checkpoint after a
failure (``FailureConfig``), resizing within ``num_workers=(min, max)``, and resuming a run whose
driver restarted with the same ``(storage_path, name)``. raydeep adds the batch plan (computed
here, before any worker starts), the worker loop, and the summary.

>>> from raydeep.ray import TrainSpec, fit  # doctest: +SKIP
>>> summary = fit(TrainSpec(num_workers=2, steps=100, storage_path="runs", name="tiny"))  # doctest: +SKIP
>>> summary["final_loss"], summary["param_sha256"]  # doctest: +SKIP
"""
from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Sequence

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import DatasetsCallback

from raydeep.ray.batch_plan import BatchSchedule, plan_batches
from raydeep.ray.monitor import start_monitor
from raydeep.ray.progress import MonitorPoller
from raydeep.ray.spec import TrainSpec
from raydeep.ray.summary import build_summary, write_json
from raydeep.ray.worker import train_loop_per_worker
from raydeep.ray.workload import check_workload

# Ray Train's controller polls worker health every 2 s by default; a dead worker is noticed at
# the next poll, so a shorter interval shortens every recovery (a poll is one cheap actor call
# per worker). A worker group that cannot start is given up on after this many seconds and
# retried, possibly at another size, instead of after 60 s. Set the variables to override.
RAY_TRAIN_TUNING = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
}
# On a cluster that raydeep starts on this machine no node is ever drained, so Ray Train's
# preemption watcher (an extra actor process per worker group, started again on every restart)
# would only take CPU from the new workers while they start.
LOCAL_CLUSTER_TUNING = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
CHECKPOINTS_TO_KEEP = 2


class RaydeepTorchTrainer(TorchTrainer):
    """``TorchTrainer``, less the Ray Data plumbing when no Ray Datasets are given.

    Ray Train starts a ``DatasetManager`` actor for every worker group, datasets or not: a fresh
    process that imports Ray Data (pandas, pyarrow compute), about 3 CPU-seconds on every restart,
    taken from the new workers while they start. raydeep's workers read their samples themselves,
    so the callback that starts it is left out (and kept whenever datasets are given).
    """

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]


def connect(spec: TrainSpec, address: str | None = None, log_to_driver: bool = True) -> None:
    """Join the given cluster (``--address``, or ``RAY_ADDRESS`` as under ``ray job submit``), or
    start a local one large enough for the run's workers. Call before anything else starts Ray."""
    for key, value in RAY_TRAIN_TUNING.items():
        os.environ.setdefault(key, value)  # read by the controller, which Ray Train starts in fit()
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address, log_to_driver=log_to_driver)
        return
    # A local cluster exists only for this run: give it at least one logical CPU per worker, so
    # `--num-workers 2` runs on a 1-core laptop too (slowly) instead of waiting for resources.
    cpus = max(os.cpu_count() or 1, math.ceil(spec.max_workers * spec.cpus_per_worker))
    for key, value in LOCAL_CLUSTER_TUNING.items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=cpus, log_to_driver=log_to_driver)


def build_trainer(spec: TrainSpec, ds_config: dict, schedule: BatchSchedule, monitor=None, driver_id: str = "",
                  callbacks: Sequence = ()):
    """The ``TorchTrainer`` for ``spec``; ``callbacks`` are Ray Train ``UserCallback``s (e.g. Tune's)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    resources = {"CPU": spec.cpus_per_worker, **spec.resources_per_worker}
    scaling = ScalingConfig(num_workers=spec.num_workers, use_gpu=spec.use_gpu, resources_per_worker=resources)
    run = RunConfig(name=spec.name, storage_path=spec.storage_path,
                    failure_config=FailureConfig(max_failures=spec.max_failures),
                    checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_TO_KEEP), callbacks=list(callbacks))
    config = {"spec": spec, "ds_config": ds_config, "schedule": schedule, "monitor": monitor, "driver_id": driver_id}
    return RaydeepTorchTrainer(train_loop_per_worker, train_loop_config=config, scaling_config=scaling, run_config=run)


def plan_run(spec: TrainSpec) -> tuple[dict, BatchSchedule]:
    """The resolved ds_config and the batch plan of ``spec``. Raises ``ConfigError`` before any
    Ray process starts: a world size in the range that cannot keep the global batch (naming the
    valid ones), a bad config key, a model or dataset that cannot be built."""
    ds_config = spec.resolved_ds_config()
    schedule = plan_batches(ds_config, spec.min_workers, spec.max_workers)
    check_workload(spec.model, spec.data, spec.seed)
    return ds_config, schedule


def fit(spec: TrainSpec, on_progress=None, address: str | None = None, poll_interval_s: float = 0.25,
        log_to_driver: bool = True, callbacks: Sequence = (), plan: tuple[dict, BatchSchedule] | None = None) -> dict:
    """Train ``spec`` to ``spec.steps`` (continuing the run if it exists); returns the summary,
    also written to ``<storage_path>/<name>/summary.json``.

    ``on_progress(snapshot)`` is called from a background thread with the monitor's snapshot
    (attempts with their world size and worker pids, the latest step) every ``poll_interval_s``.
    ``callbacks`` go to Ray Train's ``RunConfig`` (see :func:`raydeep.ray.tune.make_driver`).
    ``plan`` is :func:`plan_run`'s result when the caller has already checked the spec.
    """
    ds_config, schedule = plan or plan_run(spec)
    connect(spec, address, log_to_driver)
    driver_id = uuid.uuid4().hex
    monitor = start_monitor()
    trainer = build_trainer(spec, ds_config, schedule, monitor, driver_id, callbacks)
    poller = MonitorPoller(monitor, [on_progress], poll_interval_s)
    started = time.time()
    poller.start()
    try:
        result = trainer.fit()
    finally:
        snapshot = poller.stop()
        ray.kill(monitor)
    summary = build_summary(spec, result.return_value, snapshot, driver_id, started, time.time())
    write_json(f"{spec.run_uri}/summary.json", summary)
    return summary
