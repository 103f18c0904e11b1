"""The Ray Train side of a worker: ``train_loop_per_worker`` and the session it trains through.

Ray Train has already started the process group (gloo on CPU, NCCL on GPU), set ``RANK``,
``LOCAL_RANK`` and the CUDA device, and hands the latest reported checkpoint to every new
attempt. The session adds raydeep's part:

- every rank writes its own shard files with ``engine.save_checkpoint`` straight into the run's
  directory in shared storage (``<storage_path>/<name>/checkpoints/global_stepN``), then all
  ranks report that directory to Ray Train (``CheckpointUploadMode.NO_UPLOAD``: it is already in
  the run's storage, so nothing is copied). Ray Train then keeps its history, deletes the oldest
  beyond ``num_to_keep``, and gives it back after a worker failure, a resize or a driver restart;
- the restore reads it with ``engine.load_checkpoint``, which reshards when the world size changed;
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
from raydeep.ray.loop import run_training


def train_loop_per_worker(config: dict) -> dict:
    """Ray Train entry point (``TorchTrainer(train_loop_per_worker, train_loop_config=config)``)."""
    entered_at = time.time()
    spec = config["spec"]
    # One intra-op thread per reserved CPU: the same math (and so the same bits) on every attempt.
    torch.set_num_threads(max(1, int(spec.cpus_per_worker)))
    session = RaySession(spec, config.get("monitor"), config.get("driver_id", ""), entered_at)
    return run_training(spec, config["ds_config"], config["schedule"], session)


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
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            # Nothing reported yet; a save that committed just before a crash, before its report,
            # is still a whole checkpoint: resume from the engine's `latest` if there is one.
            if not Storage.open(self.checkpoint_uri).exists("latest"):
                return None
            path, client_state = engine.load_checkpoint(self.checkpoint_uri)
            return client_state
        tag = posixpath.basename(checkpoint.path.rstrip("/"))
        path, client_state = engine.load_checkpoint(self.checkpoint_uri, tag=tag)
        if path is None:
            raise RuntimeError(f"Ray Train resumed from {checkpoint.path}, but no raydeep checkpoint is there")
        return client_state

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
