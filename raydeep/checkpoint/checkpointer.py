"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: DeepSpeed's contracts, raydeep's format.

Saving is collective (every rank calls it, as in DeepSpeed). The snapshot is taken in the
caller's thread; writing and committing run either inline or, with ``async_save=True``, in a
background thread so training continues. The ranks coordinate the write on a dedicated gloo
group, so a background save never interleaves with the training collectives. Each coordination
step also agrees on failure: if one rank cannot write or read, every rank raises the same error
instead of waiting forever on the others.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch.distributed as dist

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint import restore, snapshot
from raydeep.checkpoint.reader import CheckpointReader, resolve_tag
from raydeep.checkpoint.storage import Storage
from raydeep.checkpoint.writer import TagWriter, new_manifest
from raydeep.errors import CheckpointError

logger = logging.getLogger("raydeep")


class Checkpointer:
    """Saves and loads one engine's checkpoints."""

    def __init__(self, engine):
        self.engine = engine
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- save -------------------------------------------------------------------------------------
    def save(self, save_dir, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
             async_save: bool = False, keep_last_k: int | None = None) -> bool:
        self.wait()  # one save in flight at a time: the previous must be committed first
        if client_state and "checkpoint_parallel_dimensions" in client_state:
            raise KeyError("client_state key 'checkpoint_parallel_dimensions' is reserved")
        tag = str(tag) if tag is not None else fmt.default_tag(self.engine.global_steps)
        self._validate_tag(tag)
        storage = Storage.open(save_dir)
        snap = snapshot.take(self.engine, client_state)
        if async_save:
            self._thread = threading.Thread(target=self._background, name="raydeep-checkpoint",
                                            args=(storage, tag, snap, save_latest, keep_last_k))
            self._thread.start()
        else:
            self._write_and_commit(storage, tag, snap, save_latest, keep_last_k)
        return True

    def wait(self) -> None:
        """Block until an asynchronous save has committed; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, *args) -> None:
        try:
            self._write_and_commit(*args)
        except BaseException as err:  # surfaced by the next wait()
            self._error = err

    def _write_and_commit(self, storage: Storage, tag: str, snap: snapshot.RankSnapshot, save_latest: bool,
                          keep_last_k: int | None) -> None:
        rank, world = self.engine.rank, self.engine.world_size
        config = getattr(self.engine, "config", None)
        writer = TagWriter(storage, tag, fsync=config.raydeep.checkpoint_fsync if config is not None else True)
        self._agree("prepare", writer.prepare if rank == 0 else (lambda: None))

        def write_own_files():
            name = fmt.rank_file(rank, world)
            files = {name: {**writer.write_file(name, fmt.encode(snap.tensors)), "pieces": snap.pieces}}
            if rank == 0:
                files[fmt.EXTRA_FILE] = writer.write_file(fmt.EXTRA_FILE, fmt.encode(snap.extra))
            return files, snap.rng
        written = self._agree("write", write_own_files, share=True)

        def commit():
            if rank != 0:
                return
            files = {name: entry for rank_files, _ in written for name, entry in rank_files.items()}
            manifest = new_manifest(tag, files=files, rng=[rng for _, rng in written], **snap.manifest)
            writer.commit(manifest, save_latest=save_latest, keep_last_k=keep_last_k)
        self._agree("commit", commit)
        logger.info("saved checkpoint %s", storage.describe(tag))

    def _validate_tag(self, tag: str) -> None:
        config = getattr(self.engine, "config", None)
        mode = config.checkpoint.tag_validation if config is not None else "Warn"
        if mode == "Ignore":
            return
        tags = self._gather(tag)
        if len(set(tags)) > 1:
            message = f"checkpoint tag differs across ranks: {tags}"
            if mode == "Fail":
                raise CheckpointError(message)
            logger.warning(message)

    # --- load -------------------------------------------------------------------------------------
    def load(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
             load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
             load_module_only: bool = False):
        self.wait()
        storage = Storage.open(load_dir)
        if resolve_tag(storage, tag) is None:
            logger.warning("unable to find latest file at %s, if trying to load latest checkpoint please ensure "
                           "this file exists or pass an explicit checkpoint tag when loading a checkpoint",
                           storage.describe(fmt.LATEST))
            return None, None
        with_optimizer = load_optimizer_states and not load_module_only
        reader = self._agree("open", lambda: CheckpointReader.open(storage, tag))
        states = self._agree("read", lambda: restore.read_shards(self.engine, reader, with_optimizer,
                                                                 load_module_strict))
        client = restore.finish(self.engine, reader, states, with_optimizer, load_lr_scheduler_states,
                                load_module_only)
        logger.info("loaded checkpoint %s", reader.path)
        return reader.path, client

    # --- coordination -----------------------------------------------------------------------------
    def _coordination_group(self):
        if self.engine.world_size == 1 or not dist.is_initialized():
            return None
        if self._group is None:  # created by every rank in the same save/load call
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        return self._group

    def _gather(self, obj) -> list:
        group = self._coordination_group()
        if group is None:
            return [obj]
        out = [None] * self.engine.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _agree(self, step: str, fn, share: bool = False):
        """Run ``fn`` on every rank and raise everywhere if any rank failed. Returns this rank's
        result, or with ``share=True`` every rank's (small, picklable) result in rank order."""
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            result, error = None, err
        outcomes = self._gather((None if error is None else f"rank {self.engine.rank}: {error}",
                                 result if share else None))
        failures = [message for message, _ in outcomes if message]
        if error is not None and len(failures) == 1:
            raise error  # only this rank failed: keep its own type and traceback
        if failures:
            raise CheckpointError(f"checkpoint {step} failed: " + "; ".join(failures))
        return [r for _, r in outcomes] if share else result
