"""The Ray Train side of a worker: ``train_loop_per_worker`` and the session it trains through.

Ray Train has already started the process group (gloo on CPU, NCCL on GPU), set ``RANK``,
``LOCAL_RANK`` and the CUDA device, and hands the latest reported checkpoint to every new
attempt. The session adds raydeep's part:

- every rank writes its own shard files with ``engine.save_checkpoint`` straight into the run's
  directory in shared storage (``<storage_path>/<name>/checkpoints/global_stepN``), then all
  ranks report that directory to Ray Train (``CheckpointUploadMode.NO_UPLOAD``: it is already in
  the run's storage, so nothing is copied). Ray Train then keeps its history, deletes the oldest
  beyond ``num_to_keep``, and gives it back after a worker failure, a resize or a driver restart;
- the restore reads the newest committed checkpoint (Ray Train's, or a newer one raydeep's
  ``latest`` names), resharding when the world size changed; a damaged one (a file failing its
  sha256) is passed over for the newest intact one, with a warning the driver shows;
- with ``raydeep.memory_snapshot_every``, the same save goes every N steps into the memory of the
  driver's snapshot store (:mod:`raydeep.ray.memory_snapshots`), and the restore takes the newest
  intact snapshot when it is further along than the newest checkpoint (a store that cannot be read
  is reported, and the checkpoint is used);
- where Ray Train watches for node drains, the session asks it once a step
  (``preemption_notice``); from a notice on the loop snapshots every step (:mod:`raydeep.ray.loop`);
- step events go to the driver's :class:`~raydeep.ray.run_monitor.RunMonitor` (with the DeepSpeed
  console lines rank 0 logged in the step, :mod:`raydeep.console_lines`) and, from rank 0, to
  Prometheus gauges (:mod:`raydeep.ray.gauges`); each checkpoint's report carries the step's
  loss, tokens/s, MFU, samples/s and step time, which Ray Train's result and Tune's trials show;
- every rank runs a step watchdog (:mod:`raydeep.ray.watchdog`, ``raydeep.watchdog``): a step
  that outlives ``raydeep.step_timeout_s`` (derived from the recent step times when unset) dumps
  every thread's stack under ``<run>/diagnostics/attempt-<A>/`` and tells the driver.
"""
from __future__ import annotations

import logging
import os
import posixpath
import socket
import time
import uuid

import ray
import ray.train
import torch

from raydeep.checkpoint import committed_tags
from raydeep.storage import Storage
from raydeep.checkpoint.format import LATEST
from raydeep.checkpoint.reader import CheckpointReader, resolve_tag
from raydeep.config.sections import RaydeepSection
from raydeep.console_lines import ConsoleLines
from raydeep.errors import CheckpointError
from raydeep.ray.gauges import StepGauges
from raydeep.ray.loop import run_training
from raydeep.ray.snapshot_holders import StoreOwner
from raydeep.ray.watchdog import HangReporter, StepWatchdog
from raydeep.tier.actor_faults import actors_owned_by

logger = logging.getLogger("raydeep")


def train_loop_per_worker(config: dict) -> dict:
    """Ray Train entry point (``TorchTrainer(train_loop_per_worker, train_loop_config=config)``)."""
    entered_at = time.time()
    spec = config["spec"]
    # One intra-op thread per reserved CPU: the same math (and so the same bits) on every attempt.
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    session = RaySession(spec, config.get("monitor"), config.get("driver_id", ""), entered_at, config["ds_config"],
                         config.get("snapshot_store"), config.get("preemption_watch", False))
    try:
        with actors_owned_by(session.offload_owner()):
            return run_training(spec, config["ds_config"], config["schedule"], session)
    finally:
        session.close()


def resume_candidates(storage: Storage, reported: str | None) -> tuple[list[str], list[tuple[str, str]]]:
    """The tags a new attempt may resume from, newest first, and the ones already known damaged.

    Every committed tag counts, ordered by its step, so the newest whole checkpoint wins whether
    Ray Train's report (``reported``) or raydeep's ``latest`` names it: they differ when a worker
    died after a save committed but before Ray Train's controller took in its report. A tag one
    of them names whose manifest cannot be read is damage to report, not a tag to pass over
    silently: it comes back in the second list with the reason.
    """
    damaged: list[tuple[str, str]] = []
    named = [reported] if reported else []
    try:
        latest = resolve_tag(storage, None)
    except CheckpointError as err:
        damaged.append((LATEST, str(err)))
    else:
        named += [latest] if latest else []
    tags = [tag for _, tag in reversed(committed_tags(storage))]
    for tag in dict.fromkeys(named):
        if tag not in tags:
            try:
                CheckpointReader.open(storage, tag)
                tags.insert(0, tag)  # readable after all (written between the two looks)
            except CheckpointError as err:
                damaged.append((tag, str(err)))
    return tags, damaged


class RaySession:
    """Checkpoints through ``ray.train.report``, resume from ``ray.train.get_checkpoint`` (see above)."""

    def __init__(self, spec, monitor, driver_id: str, entered_at: float, ds_config: dict | None = None,
                 snapshot_store=None, preemption_watch: bool = False):
        from ray.train.collective import broadcast_from_rank_zero

        from raydeep.ray.memory_snapshots import snapshot_storage

        context = ray.train.get_context()
        storage = context.get_storage()
        self.rank = context.get_world_rank()
        self.checkpoint_uri = spec.checkpoint_uri
        self.filesystem = storage.storage_filesystem
        self.checkpoint_fs_path = posixpath.join(storage.experiment_fs_path, "checkpoints")
        self.monitor, self.driver_id, self.entered_at = monitor, driver_id, entered_at
        self.skipped: list[tuple[str, str]] = []  # damaged checkpoints the restore passed over
        self.store = snapshot_store
        self.snapshots = snapshot_storage(snapshot_store, spec.name) if snapshot_store is not None else None
        self.restored_from: str | None = None  # "checkpoint <tag>" / "memory snapshot <tag>"
        self.snapshots_lost: str | None = None  # why the snapshot store could not be read, if it could not
        self.preemption_watch = preemption_watch  # Ray Train's controller watches for node drains
        # One id per attempt, agreed by all ranks, so the monitor can group this attempt's reports;
        # and the lowest attempt number no earlier attempt's diagnostics use, so none overwrites them.
        self.token, self.unused_attempt = broadcast_from_rank_zero(
            (uuid.uuid4().hex, unused_diagnostics_attempt(spec.run_uri) if self.rank == 0 else 0))
        if monitor is not None:
            monitor.worker_started.remote(self.token, self.rank, {
                "pid": os.getpid(), "process_started_at": process_started_at(), "host": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "local_rank": context.get_local_rank(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})
        self.gauges = StepGauges(spec.name) if self.rank == 0 else None
        # DeepSpeed's console lines (timers, comms table), which the driver prints above its bar.
        self.console_lines = ConsoleLines.attach() if self.rank == 0 and monitor is not None else None
        self.hang_reporter, self.watchdog = None, None
        options = RaydeepSection.model_validate((ds_config or {}).get("raydeep") or {})
        if options.watchdog:
            self.hang_reporter = HangReporter(spec.run_uri, self.rank, monitor, self.token)
            self.watchdog = StepWatchdog(self.hang_reporter, step_timeout_s=options.step_timeout_s,
                                         min_step_timeout_s=options.min_step_timeout_s)
            _make_nccl_trace_dir()

    def restore(self, engine) -> dict | None:
        """Load the newest intact checkpoint (see :func:`resume_candidates`); a damaged newer one
        is skipped with a warning, and ``self.skipped`` says which and why."""
        checkpoint = ray.train.get_checkpoint()
        reported = posixpath.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None
        storage = Storage.open(self.checkpoint_uri)
        tags, damaged = resume_candidates(storage, reported)
        newest = max((step for step, _ in committed_tags(storage)), default=0)
        restored = self._restore_snapshot(engine, newest)
        if restored is not None:
            return restored
        if not tags and not damaged:
            return None
        # The checkpointer logs each damaged tag; the driver shows them from the attempt record.
        tag, client_state, self.skipped = engine.load_first_intact(self.checkpoint_uri, tags, damaged)
        self.restored_from = f"checkpoint {tag}" + (f" (memory snapshots lost: {self.snapshots_lost})"
                                                    if self.snapshots_lost else "")
        return client_state

    def _restore_snapshot(self, engine, newer_than: int) -> dict | None:
        """The newest intact memory snapshot past step ``newer_than`` loaded into ``engine``
        (its client_state), or None: none is newer, or the store is lost or holds none intact
        (a warning says so; the caller loads the storage checkpoint)."""
        if self.snapshots is None:
            return None
        try:
            tags = [tag for step, tag in reversed(committed_tags(self.snapshots)) if step > newer_than]
            if not tags:
                return None
            tag, client_state, _ = engine.load_first_intact(self.snapshots, tags)
        except (ray.exceptions.RayError, CheckpointError) as err:
            # The store's own loss, or every newer snapshot damaged (a file unreadable: the offload
            # actor holding it was lost); the second line of the latter names the first file.
            lines = str(err).splitlines()
            self.snapshots_lost = f"{type(err).__name__}: {' '.join(line.strip() for line in lines[:2])}"
            if self.rank == 0:
                logger.warning("memory snapshots lost (%s): resuming from the storage checkpoint instead",
                               self.snapshots_lost)
            if isinstance(err, ray.exceptions.RayError):
                self.snapshots = None  # a store that failed once is not written to again
            return None
        self.restored_from = f"memory snapshot {tag}"
        return client_state

    def offload_owner(self) -> StoreOwner | None:
        """Who creates this attempt's offload actors: the snapshot store, when the run keeps one,
        so that they outlive this worker with their part of the snapshots
        (:mod:`raydeep.ray.snapshot_holders`)."""
        if self.snapshots is None:
            return None
        return StoreOwner(self.store, self.token, self.rank, ray.train.get_context().get_world_size())

    def preemption_notice(self) -> dict | None:
        """Ray Train's preemption info (``ray.train.get_preemption_info``, the same on every rank:
        it is a barrier), or None; nothing is asked when the controller does not watch for drains."""
        if not self.preemption_watch:
            return None
        try:
            info = ray.train.get_preemption_info()
        except (RuntimeError, DeprecationWarning) as err:  # Ray Train refuses it inside a Tune session
            logger.warning("not watching for node preemption: %s", err)
            self.preemption_watch = False
            return None
        if info is None:
            return None
        return {"ranks": info.preempted_ranks, "nodes": info.preempted_node_ids,
                "deadline_s": None if info.deadline_ms is None else info.deadline_ms / 1000}

    def snapshot(self, engine, tag: str, client_state: dict) -> None:
        """Save into the snapshot store (every rank). A store that cannot be written is reported
        once and left alone: storage checkpoints still protect the run."""
        if self.snapshots is None:
            return
        from raydeep.ray.memory_snapshots import KEEP

        try:
            # Whole when this returns, even under raydeep.checkpoint_async: the loop reports the
            # step done only then, and "auto" paces what the snapshot really costs.
            engine.save_checkpoint(self.snapshots, tag=tag, client_state=client_state, keep_last_k=KEEP,
                                   async_save=False)
        except (ray.exceptions.RayError, CheckpointError, OSError) as err:
            if self.rank == 0:
                logger.warning("memory snapshot %s failed (%s: %s); snapshots are off for this attempt", tag,
                               type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self.snapshots = None

    def snapshot_room(self) -> str | None:
        """Rank 0: why the store's node, or an offload node holding parts of the snapshots,
        cannot keep ``KEEP`` snapshots of the largest size held."""
        if self.snapshots is None or self.rank != 0:
            return None
        from raydeep.ray.memory_snapshots import no_room

        try:
            store = ray.get(self.store.room.remote())
            holders = ray.get(self.store.holders.remote())
            rooms = ray.get([holder.node_room.remote() for holder, _ in holders])
        except ray.exceptions.RayError:
            return None  # a lost store or actor is reported where it is written to or read
        return no_room(store, [(node, size, free) for (_, size), (node, free) in zip(holders, rooms)])

    def drop_snapshots(self) -> None:
        if self.snapshots is not None and self.rank == 0:
            try:
                ray.get(self.store.delete.remote("/", True))
            except ray.exceptions.RayError:
                pass
        self.snapshots = None

    def save(self, engine, tag: str, client_state: dict, metrics: dict) -> None:
        from ray.train import Checkpoint, CheckpointUploadMode

        engine.save_checkpoint(self.checkpoint_uri, tag=tag, client_state=client_state)
        # Ray Train may hand this checkpoint to the next attempt as soon as it is reported, so an
        # asynchronous save (raydeep.checkpoint_async) must be committed first.
        engine.wait_for_checkpoint()
        checkpoint = Checkpoint(path=posixpath.join(self.checkpoint_fs_path, tag), filesystem=self.filesystem)
        # Every rank calls report (it is a barrier) with the same directory: the shards are all there.
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"checkpoints/{tag}",
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)

    def attempt_started(self, record: dict) -> None:
        if self.hang_reporter is not None:
            # The history index alone repeats when an attempt died before its first checkpoint.
            self.hang_reporter.attempt = max(record.get("attempt", 0), self.unused_attempt)
        if self.monitor is not None and self.rank == 0:
            self.monitor.attempt_started.remote(self.token, {**record, "entered_at": self.entered_at})

    def step_started(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.step_started(step)

    def step_finished(self, seconds: float) -> None:
        if self.watchdog is not None:
            self.watchdog.step_finished(seconds)

    def step_done(self, event: dict) -> None:
        if self.rank != 0:
            return
        if self.monitor is not None:
            self.monitor.step_done.remote(self.token, {**event, "console": self.console_lines.take()})
        self.gauges.set(event)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.console_lines is not None:
            self.console_lines.detach()


def process_started_at() -> float | None:
    """When this process started (epoch seconds, to 10 ms), from Linux's /proc; None elsewhere.
    A restart's breakdown starts here: the seconds before it are Ray's (noticing the failure,
    placing and starting the new worker actors), the ones after it this process's."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            booted_at = time.time() - float(uptime.read().split()[0])
        return booted_at + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def unused_diagnostics_attempt(run_uri: str) -> int:
    """One more than the highest ``diagnostics/attempt-<A>`` of the run (0 when there is none)."""
    try:
        names = Storage.open(run_uri).list_dirs("diagnostics")
    except Exception:  # noqa: BLE001 - diagnostics are not worth failing an attempt over
        return 0
    numbers = [int(name.split("-", 1)[1]) for name in names if name.startswith("attempt-")
               and name.split("-", 1)[1].isdigit()]
    return max(numbers, default=-1) + 1


def _make_nccl_trace_dir() -> None:
    """NCCL's flight recorder (turned on for GPU runs by the driver) writes its dump on a
    collective timeout into this file prefix, and does not create the directory itself."""
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if prefix and os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") == "1":
        try:
            os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
        except OSError as err:
            logger.warning("cannot create the directory of NCCL's trace dump %s: %s", prefix, err)
