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
import signal
import threading
import time
import uuid
from collections.abc import Sequence

import ray
from ray.train import TrainingFailedError
from ray.train.torch import TorchTrainer

from raydeep.config.sections import RaydeepSection
from raydeep.errors import InputError
from raydeep.ray.batch_plan import BatchSchedule, plan_batches
from raydeep.ray.failures import RaydeepFailurePolicy, deterministic_error
from raydeep.ray.freed_resources import AwaitFreedResources
from raydeep.ray.memory_snapshots import start_store
from raydeep.ray.ray_private import DatasetsCallback, canonicalize_bootstrap_address
from raydeep.ray.run_monitor import start_monitor
from raydeep.ray.progress import HangPrinter, MonitorPoller
from raydeep.ray.spec import TrainSpec, check_storage
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
# torch's NCCL flight recorder: the last collectives of every rank, dumped when one times out
# (what the step watchdog's Python stacks cannot show: the CUDA side of a hang). Read when the
# process group is made, which Ray Train does before raydeep's code runs: so through the
# workers' runtime environment.
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


class RaydeepTorchTrainer(TorchTrainer):
    """``TorchTrainer`` that fails at once on a deterministic error (:mod:`raydeep.ray.failures`),
    less the Ray Data plumbing when no Ray Datasets are given. Both override private methods
    (``raydeep.ray.ray_private.TRAINER_OVERRIDES``, checked by a test against the pinned Ray).

    Ray Train starts a ``DatasetManager`` actor for every worker group, datasets or not: a fresh
    process that imports Ray Data (pandas, pyarrow compute), about 3 CPU-seconds on every restart,
    taken from the new workers while they start. raydeep's workers read their samples themselves,
    so the callback that starts it is left out (and kept whenever datasets are given).
    """

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        # Ray Train takes its failure policy from here only; raydeep's never retries its own errors.
        controller_init_kwargs["failure_policy"] = RaydeepFailurePolicy(self.run_config.failure_config)
        # Ray Train's Ctrl-C handler holds the controller's handle, which keeps the controller
        # actor alive after the run until the driver exits: the handler before it is put back.
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGINT) if main_thread else None
        try:
            return super()._initialize_and_run_controller(**controller_init_kwargs)
        except Exception as failure:
            # Its traceback's frames hold the controller's handle too (a local of Ray Train's): a
            # caller that keeps the error (a notebook, a Tune trial, pytest) would keep the
            # controller actor alive. The message already carries every worker's traceback.
            raise failure.with_traceback(None) from None
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, previous)

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks() + [AwaitFreedResources()]
        if self.datasets:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]


def connect(spec: TrainSpec, address: str | None = None, log_to_driver: bool = True) -> str | None:
    """Connect to Ray as ``ray.init()`` would, sized for the run. Call before anything else starts Ray.

    - ``address`` (``--address``), or ``RAY_ADDRESS`` as under ``ray job submit``: join that cluster;
    - otherwise a cluster started on this machine with ``ray start`` is joined, as plain
      ``ray.init()`` joins it (its resources must hold ``spec``'s smallest worker group);
    - otherwise, or with ``address="local"``, a new local cluster is started for this run alone.

    Returns the address of a running cluster that was joined without being named, else None.
    """
    for key, value in RAY_TRAIN_TUNING.items():
        os.environ.setdefault(key, value)  # read by the controller, which Ray Train starts in fit()
    if ray.is_initialized():
        return None
    if address != "local" and (address or os.environ.get("RAY_ADDRESS")):
        ray.init(address=address, log_to_driver=log_to_driver)
        return None
    running = running_local_cluster() if address is None else None
    if running is not None:
        _join_running(spec, running, log_to_driver)
        return running
    # A local cluster exists only for this run: give it at least one logical CPU per worker, so
    # `--num-workers 2` runs on a 1-core laptop too (slowly) instead of waiting for resources.
    cpus = max(os.cpu_count() or 1, math.ceil(spec.max_workers * spec.cpus_per_worker))
    for key, value in LOCAL_CLUSTER_TUNING.items():
        os.environ.setdefault(key, value)
    ray.init(address="local", num_cpus=cpus, log_to_driver=log_to_driver)
    return None


def running_local_cluster() -> str | None:
    """The address of the cluster the last ``ray start`` on this machine left running, if any:
    the one plain ``ray.init()`` would join (Ray's own lookup)."""
    try:
        return canonicalize_bootstrap_address(None)
    except (ValueError, OSError):
        return None


def _join_running(spec: TrainSpec, address: str, log_to_driver: bool) -> None:
    """Join the cluster ``ray start`` left at ``address``; fail if it cannot hold the run."""
    try:
        ray.init(address=address, log_to_driver=log_to_driver)
    except ConnectionError as err:
        raise InputError("--address", f"a Ray cluster was started on this machine at {address} but cannot be "
                         f"reached ({err})", fix="run `ray stop` to clear it, or pass --address local for a new "
                         "local cluster") from None
    per_worker = {"CPU": spec.cpus_per_worker, "GPU": int(spec.use_gpu), **spec.resources_per_worker}
    need = {name: spec.min_workers * amount for name, amount in per_worker.items()}
    have = ray.cluster_resources()
    short = {name: amount for name, amount in need.items() if amount and have.get(name, 0) < amount}
    if short:
        ray.shutdown()
        lacking = ", ".join(f"{amount:g} {name} (it has {have.get(name, 0):g})" for name, amount in short.items())
        raise InputError("--num-workers", f"the running Ray cluster at {address} cannot hold "
                         f"{spec.min_workers} worker(s): they need {lacking}", value=spec.num_workers,
                         fix="pass --address local for a new local cluster of the right size, give the cluster more "
                         "resources (`ray start --num-cpus N`), or use fewer workers")


def build_trainer(spec: TrainSpec, ds_config: dict, schedule: BatchSchedule, monitor=None, driver_id: str = "",
                  callbacks: Sequence = (), snapshot_store=None):
    """The ``TorchTrainer`` for ``spec``; ``callbacks`` are Ray Train ``UserCallback``s (e.g. Tune's);
    ``snapshot_store``: the run's :class:`~raydeep.ray.memory_snapshots.SnapshotStore`, if it keeps one."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    resources = {"CPU": spec.cpus_per_worker, **spec.resources_per_worker}
    scaling = ScalingConfig(num_workers=spec.num_workers, use_gpu=spec.use_gpu, resources_per_worker=resources)
    options = RaydeepSection.model_validate(ds_config.get("raydeep") or {})
    worker_env = nccl_flight_recorder_env(spec) if spec.use_gpu and options.watchdog else {}
    run = RunConfig(name=spec.name, storage_path=spec.storage_path,
                    failure_config=FailureConfig(max_failures=spec.max_failures),
                    checkpoint_config=CheckpointConfig(num_to_keep=CHECKPOINTS_TO_KEEP), callbacks=list(callbacks),
                    worker_runtime_env={"env_vars": worker_env} if worker_env else None)
    # backend=None: Ray Train picks it (nccl on GPU workers, gloo on CPU ones).
    torch_config = TorchConfig(backend=None, timeout_s=options.collective_timeout_s)
    config = {"spec": spec, "ds_config": ds_config, "schedule": schedule, "monitor": monitor, "driver_id": driver_id,
              "snapshot_store": snapshot_store, "preemption_watch": preemption_watched()}
    return RaydeepTorchTrainer(train_loop_per_worker, train_loop_config=config, scaling_config=scaling, run_config=run,
                               torch_config=torch_config)


def preemption_watched() -> bool:
    """Whether Ray Train's controller will watch for node drains (its preemption watcher, on unless
    ``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER`` turns it off, as raydeep does on a local cluster)."""
    return os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1").strip().lower() not in ("0", "false", "no")


def nccl_flight_recorder_env(spec: TrainSpec) -> dict[str, str]:
    """The flight recorder's variables the user has not set already (on the driver, or in the
    job's runtime environment, which the workers inherit). Its dump goes next to the watchdog's
    in a local run directory; for a remote one torch's own default (a local temporary file)."""
    wanted = dict(NCCL_FLIGHT_RECORDER)
    if "://" not in spec.run_uri:
        wanted["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = f"{spec.run_uri}/diagnostics/nccl_trace_rank_"
    job_env = {}
    if ray.is_initialized():
        job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return {key: value for key, value in wanted.items() if key not in os.environ and key not in job_env}


def plan_run(spec: TrainSpec) -> tuple[dict, BatchSchedule]:
    """The resolved ds_config and the batch plan of ``spec``. Raises ``ConfigError`` before any
    Ray process starts: a world size in the range that cannot keep the global batch (naming the
    valid ones), a bad config key, a model or dataset that cannot be built."""
    ds_config = spec.resolved_ds_config()
    schedule = plan_batches(ds_config, spec.min_workers, spec.max_workers)
    check_workload(spec.model, spec.data, spec.seed)
    if "://" in spec.storage_path:
        check_storage(spec.storage_path)  # local paths were checked when the spec was made
    return ds_config, schedule


def fit(spec: TrainSpec, on_progress=None, address: str | None = None, poll_interval_s: float = 0.25,
        log_to_driver: bool = True, callbacks: Sequence = (), plan: tuple[dict, BatchSchedule] | None = None) -> dict:
    """Train ``spec`` to ``spec.steps`` (continuing the run if it exists); returns the summary,
    also written to ``<storage_path>/<name>/summary.json``.

    ``on_progress(snapshot)`` is called from a background thread with the monitor's snapshot
    (attempts with their world size and worker pids, the latest step, the step watchdogs' hang
    records) every ``poll_interval_s``. Each hang is also printed to stderr as it is reported.
    ``callbacks`` go to Ray Train's ``RunConfig`` (see :func:`raydeep.ray.tune.make_driver`).
    ``plan`` is :func:`plan_run`'s result when the caller has already checked the spec.
    """
    ds_config, schedule = plan or plan_run(spec)
    connect(spec, address, log_to_driver)
    driver_id = uuid.uuid4().hex
    result, snapshot, started, error = _run(spec, ds_config, schedule, driver_id, on_progress, poll_interval_s,
                                            callbacks)
    if error is not None:
        # Raised here, where no frame holds a handle of the run's actors: a caller that keeps the
        # error (a notebook, a Tune trial) keeps nothing of the run alive.
        raise error
    summary = build_summary(spec, result.return_value, snapshot, driver_id, started, time.time())
    write_json(f"{spec.run_uri}/summary.json", summary)
    return summary


def _close_store(store) -> None:
    """Kill the snapshot store and the offload actors it owns (see ``SnapshotStore.close``)."""
    try:
        ray.get(store.close.remote(), timeout=30)
    except (ray.exceptions.RayError, TimeoutError):
        pass  # a lost store took its actors with it
    ray.kill(store)


def _run(spec: TrainSpec, ds_config: dict, schedule: BatchSchedule, driver_id: str, on_progress,
         poll_interval_s: float, callbacks: Sequence) -> tuple:
    """``fit``'s Ray Train run: ``(result, monitor snapshot, start time, error)``, the error (a
    raydeep error, or Ray Train's once it gave up) returned rather than raised, and without
    traceback frames, once the run's own actors are killed."""
    monitor = start_monitor()
    options = RaydeepSection.model_validate(ds_config.get("raydeep") or {})
    # The driver owns the snapshot store: it outlives every worker group and dies with the driver.
    # Where Ray Train watches for node drains there is one too: a drained node's ranks snapshot
    # every step until the run moves off it (raydeep.ray.loop), so a preemption loses no step.
    snapshots = start_store() if options.memory_snapshot_every or preemption_watched() else None
    trainer = build_trainer(spec, ds_config, schedule, monitor, driver_id, callbacks, snapshots)
    # Hangs are printed whoever watches the run: a stuck rank is news to a library caller too.
    poller = MonitorPoller(monitor, [on_progress, HangPrinter()], poll_interval_s)
    started = time.time()
    poller.start()
    result = error = None
    try:
        result = trainer.fit()
    except TrainingFailedError as failure:
        # A raydeep error's own message says what to fix; the worker traceback adds nothing.
        error = deterministic_error(failure) or failure.with_traceback(None)
    finally:
        snapshot = poller.stop()
        ray.kill(monitor)
        if snapshots is not None:
            _close_store(snapshots)
    return result, snapshot, started, error
