"""The Ray Train side of a worker: ``train_loop_per_worker`` and the session it trains through.

Ray Train has already started the process group (gloo on CPU, NCCL on GPU), set ``RANK``,
``LOCAL_RANK`` and the CUDA device, and hands the latest reported checkpoint to every new
attempt. The session adds raydeep's part:

- every rank writes its own shard files with ``engine.save_checkpoint`` straight into the run's
  directory in shared storage (``<storage_path>/<name>/checkpoints/global_stepN``), then all
  ranks report that directory to Ray Train (``CheckpointUploadMode.NO_UPLOAD``: it is already in
  the run's storage, so nothing is copied). Ray Train then keeps its history, deletes the oldest
  beyond ``num_to_keep``, and gives it back after a worker failure, a resize or a driver restart;
- the restore reads it (or raydeep's ``latest``, when that is newer) with ``engine.load_checkpoint``,
  which reshards when the world size changed;
- step events go to the driver's :class:`~raydeep.ray.monitor.RunMonitor`.
"""
from __future__ import annotations

import os
import posixpath
import socket
import time
import uuid

import ray
import ray.train
import torch

from raydeep.checkpoint import Storage
from raydeep.checkpoint.reader import CheckpointReader, resolve_tag
from raydeep.ray.loop import run_training


def train_loop_per_worker(config: dict) -> dict:
    """Ray Train entry point (``TorchTrainer(train_loop_per_worker, train_loop_config=config)``)."""
    entered_at = time.time()
    spec = config["spec"]
    # One intra-op thread per reserved CPU: the same math (and so the same bits) on every attempt.
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    session = RaySession(spec, config.get("monitor"), config.get("driver_id", ""), entered_at)
    return run_training(spec, config["ds_config"], config["schedule"], session)


def newest_tag(storage: Storage, reported: str | None) -> str | None:
    """Of ``reported`` (Ray Train's checkpoint) and the tag ``latest`` names, the one further on."""
    tags = {tag for tag in (reported, resolve_tag(storage, None)) if tag}
    steps = {tag: CheckpointReader.open(storage, tag).manifest["counters"]["global_steps"] for tag in tags}
    return max(tags, key=steps.get) if tags else None


class RaySession:
    """Checkpoints through ``ray.train.report``, resume from ``ray.train.get_checkpoint`` (see above)."""

    def __init__(self, spec, monitor, driver_id: str, entered_at: float):
        from ray.train.collective import broadcast_from_rank_zero

        context = ray.train.get_context()
        storage = context.get_storage()
        self.rank = context.get_world_rank()
        self.checkpoint_uri = spec.checkpoint_uri
        self.filesystem = storage.storage_filesystem
        self.checkpoint_fs_path = posixpath.join(storage.experiment_fs_path, "checkpoints")
        self.monitor, self.driver_id, self.entered_at = monitor, driver_id, entered_at
        # One id per attempt, agreed by all ranks, so the monitor can group this attempt's reports.
        self.token = broadcast_from_rank_zero(uuid.uuid4().hex)
        if monitor is not None:
            monitor.worker_started.remote(self.token, self.rank, {
                "pid": os.getpid(), "host": socket.gethostname(), "node_id": ray.get_runtime_context().get_node_id(),
                "local_rank": context.get_local_rank(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")})

    def restore(self, engine) -> dict | None:
        tag = self._resume_tag()
        if tag is None:
            return None
        path, client_state = engine.load_checkpoint(self.checkpoint_uri, tag=tag)
        if path is None:
            raise RuntimeError(f"no raydeep checkpoint {tag!r} under {self.checkpoint_uri} to resume from")
        return client_state

    def _resume_tag(self) -> str | None:
        """The newer of the checkpoint Ray Train hands this attempt and the one raydeep's
        ``latest`` names. They differ when a worker died after a save committed but before Ray
        Train's controller took in its report (the controller collects reports when it polls the
        workers), or before the report was made: that checkpoint is whole all the same (``latest``
        moves only once every rank's files are in), and resuming from it loses no steps."""
        checkpoint = ray.train.get_checkpoint()
        reported = posixpath.basename(checkpoint.path.rstrip("/")) if checkpoint is not None else None
        return newest_tag(Storage.open(self.checkpoint_uri), reported)

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
        if self.monitor is not None and self.rank == 0:
            self.monitor.attempt_started.remote(self.token, {**record, "entered_at": self.entered_at})

    def step_done(self, event: dict) -> None:
        if self.monitor is not None and self.rank == 0:
            self.monitor.step_done.remote(self.token, event)
