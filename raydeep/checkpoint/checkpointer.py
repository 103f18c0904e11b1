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
import uuid
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint import restore, snapshot
from raydeep.checkpoint.parts import CheckpointParts, CheckpointSettings, CopyFence
from raydeep.checkpoint.reader import CheckpointReader, resolve_tag
from raydeep.storage import Storage
from raydeep.checkpoint.writer import RemoteSink, TagWriter, committed_tags, new_manifest
from raydeep.errors import CheckpointError, CorruptCheckpointError, LostResource

logger = logging.getLogger("raydeep")


class Checkpointer:
    """Saves and loads the checkpoints of one run's stateful parts (``raydeep.checkpoint.parts``).
    ``fence`` is shared with whatever writes the masters: it stays closed while an asynchronous
    save copies them."""

    def __init__(self, parts: CheckpointParts, settings: CheckpointSettings = CheckpointSettings(),
                 fence: CopyFence | None = None):
        self.parts, self.settings = parts, settings
        self.copy_fence = fence if fence is not None else CopyFence()
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._static: dict | None = None  # manifest fields fixed for this engine (rank 0)
        self._known_tags: dict[str, list] = {}  # committed tags per save_dir, for retention (rank 0)

    # --- save -------------------------------------------------------------------------------------
    def save(self, save_dir, tag: str | None = None, client_state: dict | None = None, save_latest: bool = True,
             async_save: bool | None = None, keep_last_k: int | None = None) -> bool:
        """Training waits only for a snapshot of references and small state: with
        ``async_save`` the copy of the parameter and optimizer states, the write and every
        collective of the save run in a background thread (CheckFreq's pipelined snapshot: the
        copy overlaps the next forward and backward, and the next optimizer step waits for it
        in ``fence``). ``async_save`` and ``keep_last_k`` default to the settings'."""
        async_save = self.settings.async_save if async_save is None else async_save
        keep_last_k = self.settings.keep_last_k if keep_last_k is None else keep_last_k
        self.wait()  # one save in flight at a time: the previous must be committed first
        if client_state and "checkpoint_parallel_dimensions" in client_state:
            raise KeyError("client_state key 'checkpoint_parallel_dimensions' is reserved")
        tag = str(tag) if tag is not None else fmt.default_tag(self.parts.train_state.global_steps)
        TagWriter.check_tag(tag)
        storage = Storage.open(save_dir)
        self._coordination_group()  # created here, never beside training collectives in the writer thread
        if self.parts.rank == 0 and self._static is None:
            self._static = snapshot.static_state(self.parts, self.settings.config)
        snap = snapshot.take(self.parts, client_state, self._static)
        if async_save:
            self.copy_fence.close()
            self._thread = threading.Thread(target=self._background, name="raydeep-checkpoint",
                                            args=(storage, tag, snap, save_latest, keep_last_k))
            self._thread.start()
        else:
            try:
                snap.copy_tensors()
                self._write_and_commit(storage, tag, snap, save_latest, keep_last_k)
            finally:
                snap.release()
        return True

    def fence(self) -> None:
        """Block until an asynchronous save has copied the states it saves; the engine calls
        this before it changes parameters or optimizer states."""
        self.copy_fence.wait()

    def wait(self) -> None:
        """Block until an asynchronous save has committed; re-raise its failure here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _background(self, storage, tag, snap, *args) -> None:
        try:
            try:
                snap.copy_tensors()
            finally:
                self.copy_fence.open()
            self._write_and_commit(storage, tag, snap, *args)
        except BaseException as err:  # surfaced by the next wait()
            self._error = err
        finally:
            snap.release()

    def _write_and_commit(self, storage: Storage, tag: str, snap: snapshot.RankSnapshot, save_latest: bool,
                          keep_last_k: int | None) -> None:
        rank, world, fsync = self.parts.rank, self.parts.world_size, self.settings.fsync

        # 1. Rank 0 empties the staging location of its tag and marks it; every rank learns every
        # rank's tag and rank 0's mark.
        mark = uuid.uuid4().hex if storage.is_local else None

        def prepare():
            if rank == 0:
                TagWriter(storage, tag, fsync).prepare(mark)
            return tag, mark
        prepared = self._agree("prepare", prepare, share=True)
        tag = self._agreed_tag([t for t, _ in prepared])
        writer = TagWriter(storage, tag, fsync=fsync)
        # A rank that does not see rank 0's mark saves to a directory of its own (each Ray Train
        # worker's temporary directory, gathered later by ray.train.report): it stages there and
        # moves its own files into place in step 3, as each DeepSpeed rank writes its own files.
        own_directory = rank != 0 and prepared[0][1] is not None and not writer.sees(prepared[0][1])
        # Offload actors write into this rank's staging location only where they see its mark.
        sink_mark = uuid.uuid4().hex if own_directory else prepared[0][1]
        if own_directory:
            writer.prepare(sink_mark)

        # 2. Every rank writes its own file(s), and has its offload actors write theirs (part files
        # of the same staging location, or handed back here when they cannot see it); rank 0
        # collects the digests.
        def write_own_files():
            name = fmt.rank_file(rank, world)
            files = {name: {**writer.write_file(name, fmt.encode(snap.tensors)), "pieces": snap.pieces}}
            files.update(snap.write_remote(RemoteSink(writer, sink_mark), rank, world))
            if rank == 0:
                files[fmt.EXTRA_FILE] = writer.write_file(fmt.EXTRA_FILE, fmt.encode(snap.extra))
            return files, snapshot.rng_json(snap.rng)
        written = self._agree("write", write_own_files, share=True)

        # 3. Rank 0 commits (manifest last, then ``latest``, then retention).
        def commit():
            if own_directory:
                writer.unmark()
                writer.move_into_place()
            if rank != 0:
                return
            files = {name: entry for rank_files, _ in written for name, entry in rank_files.items()}
            manifest = new_manifest(tag, files=files, rng=[rng for _, rng in written], **snap.manifest)
            if storage.uri not in self._known_tags:  # scan a directory once; commits keep the list current
                self._known_tags[storage.uri] = committed_tags(storage)
            writer.commit(manifest, save_latest=save_latest, keep_last_k=keep_last_k,
                          known_tags=self._known_tags[storage.uri])
        self._agree("commit", commit)
        logger.info("saved checkpoint %s", storage.describe(tag))

    def _agreed_tag(self, tags: list[str]) -> str:
        """DeepSpeed's ``checkpoint.tag_validation``: ranks must name the same tag. ``Fail`` stops
        the save everywhere; ``Warn`` and ``Ignore`` save under rank 0's tag, so the files of all
        ranks still land in one checkpoint."""
        if len(set(tags)) > 1:
            mode = self.settings.tag_validation
            message = f"checkpoint tag differs across ranks: {tags}"
            if mode == "Fail":
                raise CheckpointError(message + " (checkpoint.tag_validation is Fail)")
            if mode == "Warn" and self.parts.rank == 0:
                logger.warning("%s; saving every rank's files under rank 0's tag %r", message, tags[0])
        return tags[0]

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
        states = self._agree("read", lambda: restore.read_shards(self.parts, reader, with_optimizer,
                                                                 load_module_strict))
        client = restore.finish(self.parts, reader, states, with_optimizer, load_lr_scheduler_states,
                                load_module_only)
        logger.info("loaded checkpoint %s", reader.path)
        return reader.path, client

    def load_first_intact(self, load_dir, tags: list[str], skipped: list[tuple[str, str]] = ()
                          ) -> tuple[str, dict, list[tuple[str, str]]]:
        """Collective: load the first of ``tags`` (newest first) that passes verification.

        A tag that is damaged (a file failing its sha256, a missing file, an unreadable manifest)
        is skipped for the next; any other failure (a checkpoint of another model, say) is raised
        at once. Returns ``(tag, client_state, skipped)`` with ``skipped`` = ``[(tag, reason)]``
        (starting with the ones passed in, already found damaged); raises
        :class:`CorruptCheckpointError` when none is intact.

        Note: a tag that fails can only fail in the read phase, which only reads (the optimizer
        tier takes the masters in the next phase), so nothing of a damaged checkpoint survives
        into training.
        """
        skipped = list(skipped)
        for tag in tags:
            try:
                _, client = self.load(load_dir, tag)
                return tag, client, skipped
            except CorruptCheckpointError as err:
                skipped.append((tag, str(err)))
                if self.parts.rank == 0:
                    logger.warning("checkpoint %s is damaged, trying an older one: %s", tag, err)
        where = Storage.open(load_dir).describe()
        reasons = "".join(f"\n  {tag}: {reason}" for tag, reason in skipped)
        raise CorruptCheckpointError(f"no intact checkpoint to resume from under {where}; every one is damaged:"
                                     f"{reasons}\nFix: restore these files from a copy, or start afresh under a "
                                     "new run name (the damaged checkpoints are left as they are, for inspection)")

    # --- coordination -----------------------------------------------------------------------------
    def _coordination_group(self):
        if self.parts.world_size == 1 or not dist.is_initialized():
            return None
        if self._group is None:  # created by every rank in the same save/load call
            self._group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
        return self._group

    def _gather(self, obj) -> list:
        group = self._coordination_group()
        if group is None:
            return [obj]
        out = [None] * self.parts.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _agree(self, step: str, fn, share: bool = False, same: str | None = None):
        """Run ``fn`` on every rank and raise everywhere if any rank failed. Returns this rank's
        result; with ``share=True`` every rank's (small, picklable) result in rank order; with
        ``same`` (a string every rank should pass alike, such as the tag) every rank's ``same``.

        Without ``share`` the ranks exchange one small all-reduce (failure flag and a hash of
        ``same``); the pickled exchange of messages happens only when something differs: a save
        in the background should not take the interpreter from training longer than it must."""
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            result, error = None, err
        # What kind of failure travels with the message: damage (an older checkpoint may be intact)
        # or a loss (an offload actor or object died: the attempt is retried, not the run failed).
        message = None if error is None else (f"rank {self.parts.rank}: {error}", _failure_kind(error))
        group = self._coordination_group()
        if group is not None and not share:
            digest = zlib.crc32(same.encode()) if same is not None else 0
            flags = torch.tensor([int(error is not None), digest, -digest], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if not flags[0] and flags[1] == -flags[2]:  # nobody failed, all passed the same ``same``
                return [same] * self.parts.world_size if same is not None else result
        outcomes = self._gather((message, result if share else same))
        failures = [m for m, _ in outcomes if m]
        if error is not None and len(failures) == 1:
            raise error  # only this rank failed: keep its own type and traceback
        if failures:
            kinds = {kind for _, kind in failures}
            error_type = (LostResource if "lost" in kinds else
                          CorruptCheckpointError if kinds == {"corrupt"} else CheckpointError)
            raise error_type(f"checkpoint {step} failed: " + "; ".join(text for text, _ in failures))
        return [r for _, r in outcomes] if share or same is not None else result


def _failure_kind(error: BaseException) -> str:
    """``"lost"`` (retryable), ``"corrupt"`` (an older checkpoint may be intact) or ``"failed"``."""
    if isinstance(error, LostResource):
        return "lost"
    return "corrupt" if isinstance(error, CorruptCheckpointError) else "failed"
