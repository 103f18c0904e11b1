"""Write and commit one checkpoint tag so that a crash at any moment leaves the previous one whole.

Protocol (every rank calls the collective steps in the same order; see ``checkpointer.py``):

1. rank 0 clears the staging location of the tag and marks it with a token the ranks share;
2. every rank writes its own file(s) into it (fsynced on local disks), and a rank's offload
   actors write its part files there too (``RemoteSink``), before the rank reports its digests;
3. rank 0 writes ``manifest.json`` (with every file's sha256) last, moves the staging directory
   into place when the filesystem can rename, then rewrites ``latest`` and prunes old tags.

A rank that does not find rank 0's token saves to a directory of its own (a node-local path, as
each Ray Train worker's temporary directory in Ray's DeepSpeed example): it clears and stages its
own files there and moves them into place itself in step 3, as each DeepSpeed rank writes its own
files, and whoever gathers the directories (``ray.train.report``) puts the tag together.

Until step 3 completes, ``latest`` still names the previous committed tag, and a tag without a
manifest is never loaded.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import torch

from raydeep.checkpoint import format as fmt
from raydeep.storage import Storage

logger = logging.getLogger("raydeep")
_MARK = ".rank0-token"  # in rank 0's staging directory from prepare to commit


class TagWriter:
    """The files of one tag being written, and their commit."""

    def __init__(self, storage: Storage, tag: str, fsync: bool = True):
        self.check_tag(tag)
        self.storage, self.tag, self.fsync = storage, tag, fsync
        # Object stores cannot rename a directory: they write in place and commit by the manifest.
        self.staging = f".{tag}.staging" if storage.is_local else tag

    @staticmethod
    def check_tag(tag: str) -> None:
        if not fmt.is_plain_name(tag):
            raise ValueError(f"checkpoint tag {tag!r} must be a non-empty name without '/' or '\\' and not "
                             "start with '.'")

    def prepare(self, mark: str | None = None) -> None:
        """Rank 0 (and a rank saving to a directory of its own), before any rank writes: start
        from an empty staging location; ``mark`` lets the other ranks (and offload actors) find
        out whether they see it."""
        if self.storage.is_local:
            self.storage.delete_dir(self.staging)
        elif self.storage.exists(f"{self.tag}/{fmt.MANIFEST}"):
            # Re-saving a tag in place: un-commit it first so a half-overwritten tag is never loaded.
            self.storage.fs.delete_file(self.storage.path(f"{self.tag}/{fmt.MANIFEST}"))
        self.storage.make_dir(self.staging)
        if mark is not None:
            self.storage.write(f"{self.staging}/{_MARK}", mark.encode(), fsync=False)

    def sees(self, mark: str) -> bool:
        """Whether rank 0's staging location, marked with ``mark``, is the one this rank sees."""
        try:
            return self.storage.read(f"{self.staging}/{_MARK}").decode() == mark
        except (OSError, UnicodeDecodeError):
            return False

    def unmark(self) -> None:
        """Remove the mark ``prepare`` left (before the staging location becomes the tag)."""
        if self.storage.exists(f"{self.staging}/{_MARK}"):
            self.storage.fs.delete_file(self.storage.path(f"{self.staging}/{_MARK}"))

    def write_file(self, name: str, data: bytes | list) -> dict:
        """Write one file of the tag (bytes, or buffers from ``format.encode``); returns its
        manifest entry (digest and size)."""
        self.storage.write(f"{self.staging}/{name}", data, fsync=self.fsync)
        return {"sha256": fmt.sha256(data), "bytes": fmt.encoded_size(data)}

    def move_into_place(self) -> None:
        """Rename the staging directory to the tag (local filesystems; object stores write in place)."""
        if not self.storage.is_local:
            return
        replaced = f".{self.tag}.replaced"
        if self.storage.exists(self.tag):  # re-saving a tag: keep the old one until the new is in place
            self.storage.delete_dir(replaced)
            self.storage.rename_dir(self.tag, replaced)
        self.storage.rename_dir(self.staging, self.tag)
        self.storage.delete_dir(replaced)

    def commit(self, manifest: dict, save_latest: bool = True, keep_last_k: int | None = None,
               known_tags: list | None = None) -> None:
        """Rank 0, after every rank's files are durable: make the tag visible, then ``latest``.

        ``known_tags``: the caller's running ``committed_tags`` list for this storage (kept up to
        date here), so that retention does not re-read every manifest on every save."""
        self.unmark()
        self.storage.write(f"{self.staging}/{fmt.MANIFEST}", fmt.to_json(manifest, "checkpoint manifest").encode())
        self.move_into_place()
        if save_latest:
            self.storage.write_atomic(fmt.LATEST, self.tag.encode())
        if self.storage.is_local:
            for name in self.storage.list_dirs():  # leftovers of saves that were interrupted
                if name.startswith(".") and name.endswith((".staging", ".replaced")):
                    self.storage.delete_dir(name)
        if known_tags is not None:
            known_tags[:] = sorted([t for t in known_tags if t[1] != self.tag]
                                   + [(manifest["counters"]["global_steps"], self.tag)])
        if keep_last_k:
            prune(self.storage, keep_last_k, known_tags, latest=self.tag if save_latest else None)


@dataclass(frozen=True)
class RemoteSink:
    """Writes part files of a rank's tag from another process -- an offload actor, maybe on another
    node -- into the staging location the rank writes into (picklable: it travels to the actor).

    ``mark`` is the mark of that location (None on an object store, which every node reaches by
    its URI): a process that does not see it (a node-local directory on another node) must not
    write there, and hands its tensors to the rank instead (``raydeep.tier.actors``).
    """

    writer: TagWriter
    mark: str | None

    def reachable(self) -> bool:
        return self.mark is None or self.writer.sees(self.mark)

    def __call__(self, name: str, master: torch.Tensor, states: dict[str, torch.Tensor]) -> dict:
        """Write one part file (``fp32`` and each per-element state, packed as the snapshot
        packed them); returns its manifest entry, less its pieces."""
        return self.writer.write_file(name, fmt.encode({fmt.MASTER: master, **states}))


def committed_tags(storage: Storage) -> list[tuple[int, str]]:
    """(global_steps, tag) of every committed checkpoint under ``storage``, oldest first."""
    tags = []
    for name in storage.list_dirs():
        if name.startswith(".") or not storage.exists(f"{name}/{fmt.MANIFEST}"):
            continue
        try:
            steps = json.loads(storage.read(f"{name}/{fmt.MANIFEST}"))["counters"]["global_steps"]
        except (ValueError, KeyError):
            continue
        tags.append((steps, name))
    return sorted(tags)


def prune(storage: Storage, keep_last_k: int, known_tags: list | None = None, latest: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last_k`` committed tags (never the one ``latest`` names).
    ``known_tags`` (see ``TagWriter.commit``) replaces the directory scan and is kept current;
    ``latest`` saves reading the file when the caller just wrote it."""
    if latest is None:
        latest = storage.read(fmt.LATEST).decode().strip() if storage.exists(fmt.LATEST) else None
    tags = committed_tags(storage) if known_tags is None else list(known_tags)
    doomed = [tag for _, tag in tags[:max(0, len(tags) - keep_last_k)] if tag != latest]
    for tag in doomed:
        # Un-commit first: a prune interrupted half-way must not leave a loadable partial tag.
        storage.fs.delete_file(storage.path(f"{tag}/{fmt.MANIFEST}"))
        storage.delete_dir(tag)
        if known_tags is not None:
            known_tags[:] = [t for t in known_tags if t[1] != tag]
        logger.info("removed old checkpoint %s (keep_last_k=%d)", storage.describe(tag), keep_last_k)
    return doomed


def new_manifest(tag: str, params: dict[str, dict], files: dict[str, dict], *, world_size: int = 1,
                 stage: int | None = None, precision: str = "fp32", counters: dict | None = None,
                 optimizer: dict | None = None, param_groups: list | None = None, lr_scheduler=None,
                 loss_scaler=None, rng: list | None = None, client_state: dict | None = None,
                 config: dict | None = None, source: str = "raydeep", rank_local: list | None = None) -> dict:
    """Every manifest field in one place, with the defaults a converted checkpoint gets."""
    return {
        "format": fmt.FORMAT, "version": fmt.VERSION, "tag": tag, "source": source,
        "world_size": world_size, "stage": stage, "precision": precision,
        "counters": {"global_steps": 0, "global_samples": 0, "skipped_steps": 0, **(counters or {})},
        "params": params,
        "optimizer": optimizer or {"class": None, "state_keys": [], "state_dtypes": {}, "scalars": []},
        "param_groups": param_groups or [],
        "lr_scheduler": lr_scheduler, "loss_scaler": loss_scaler, "rng": rng or [],
        "client_state": client_state or {}, "config": config, "files": files,
        "rank_local": rank_local or [],  # tensor names each rank file holds under fmt.RANK_LOCAL
    }


def write_single(directory: str | Storage, tag: str, masters: dict[str, torch.Tensor],
                 states: dict[str, dict[str, torch.Tensor]] | None = None, extra: dict[str, torch.Tensor] | None = None,
                 save_latest: bool = True, **manifest_fields) -> None:
    """Write a checkpoint from full tensors in one process (conversions and imports use this).

    ``masters`` maps parameter names to fp32 weights; ``states`` maps an optimizer state kind
    (``exp_avg``...) to per-parameter tensors; ``extra`` holds buffers/frozen/client tensors.
    """
    storage = directory if isinstance(directory, Storage) else Storage.open(directory)
    writer = TagWriter(storage, tag)
    writer.prepare()
    packed, params = fmt.PackedFile(), {}
    for name, weight in masters.items():
        params.setdefault(name, {"shape": list(weight.shape), "dtype": "float32", "group": 0})
        by_kind = {fmt.MASTER: weight.detach().float()}
        by_kind.update({kind: per_param[name] for kind, per_param in (states or {}).items()})
        packed.add(name, 0, weight.numel(), by_kind)
    for name, spec in manifest_fields.pop("params", {}).items():
        params[name] = {**params.get(name, {}), **spec}
    name = fmt.rank_file(0, 1)
    files = {name: {**writer.write_file(name, fmt.encode(packed.tensors())), "pieces": packed.pieces}}
    if extra:
        files[fmt.EXTRA_FILE] = writer.write_file(fmt.EXTRA_FILE, fmt.encode(extra))
    if states and "optimizer" not in manifest_fields:
        dtypes = {k: fmt.dtype_name(next(iter(v.values())).dtype) for k, v in states.items()}
        manifest_fields["optimizer"] = {"class": None, "state_keys": list(states), "state_dtypes": dtypes,
                                        "scalars": []}
    writer.commit(new_manifest(tag, params, files, **manifest_fields), save_latest=save_latest)
