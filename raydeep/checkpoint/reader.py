"""Read a committed checkpoint: resolve the tag, check the manifest, verify and slice files.

A reader fetches a file only when a requested range lives in it, verifies the file's sha256
against the manifest before decoding it, and caches decoded files for the rest of the load.

>>> import tempfile, torch
>>> from raydeep.checkpoint.writer import write_single
>>> d = tempfile.mkdtemp()
>>> write_single(d, "t", {"w": torch.arange(6.0).view(2, 3)})
>>> CheckpointReader.open(d).read_range("fp32", "w", 2, 5)
tensor([2., 3., 4.])
"""
from __future__ import annotations

import json

import torch

from raydeep.checkpoint import format as fmt
from raydeep.storage import Storage
from raydeep.errors import CheckpointError, CorruptCheckpointError


def resolve_tag(storage: Storage, tag: str | None) -> str | None:
    """The given tag, or the one ``latest`` names; None when there is no ``latest``. Either must
    be a plain name inside the checkpoint directory."""
    if tag is not None:
        return fmt.check_name(tag, "checkpoint tag", storage.describe(), written_by_user=True)
    if not storage.exists(fmt.LATEST):
        return None
    text = storage.read(fmt.LATEST).decode(errors="replace").strip()
    return fmt.check_name(text, "the tag it names", storage.describe(fmt.LATEST))


class CheckpointReader:
    """One committed checkpoint ``<dir>/<tag>``; see :mod:`raydeep.checkpoint.format`."""

    def __init__(self, storage: Storage, tag: str, manifest: dict):
        self.storage, self.tag, self.manifest = storage, tag, manifest
        self._files: dict[str, dict[str, torch.Tensor]] = {}
        # name -> [(start, end, file, offset)] over every file's pieces, for range lookups.
        self._where: dict[str, list[tuple[int, int, str, int]]] = {}
        for file, entry in manifest["files"].items():
            for name, start, end, offset in entry.get("pieces", []):
                self._where.setdefault(name, []).append((start, end, file, offset))
        for spans in self._where.values():
            spans.sort()

    @staticmethod
    def open(directory: str | Storage, tag: str | None = None) -> "CheckpointReader":
        storage = directory if isinstance(directory, Storage) else Storage.open(directory)
        resolved = resolve_tag(storage, tag)
        if resolved is None:
            raise CheckpointError(f"{storage.describe(fmt.LATEST)} does not exist: no committed checkpoint to load")
        manifest_path = f"{resolved}/{fmt.MANIFEST}"
        if not storage.exists(manifest_path):
            if storage.exists(f"{resolved}/mp_rank_00_model_states.pt") or \
                    storage.exists(f"{resolved}/zero_pp_rank_0_mp_rank_00_model_states.pt"):
                raise CheckpointError(
                    f"checkpoint {storage.describe(resolved)} is a DeepSpeed checkpoint, not a raydeep one; convert it "
                    f"once with `raydeep convert import-deepspeed {storage.describe('')} OUT --tag {resolved}` and load "
                    "OUT (any world size)")
            state = "was never committed (its save did not finish)" if storage.is_dir(resolved) else "does not exist"
            # A tag that ``latest`` names must exist: then its absence is damage, not a wrong name.
            error = CheckpointError if tag is not None else CorruptCheckpointError
            raise error(f"checkpoint {storage.describe(resolved)} {state}: {fmt.MANIFEST} is missing")
        try:
            manifest = json.loads(storage.read(manifest_path))
        except ValueError as err:
            raise CorruptCheckpointError(f"{storage.describe(manifest_path)} is not valid JSON ({err})") from err
        if not isinstance(manifest, dict) or manifest.get("format") != fmt.FORMAT:
            raise CorruptCheckpointError(f"{storage.describe(manifest_path)} is not a raydeep checkpoint manifest")
        for name in manifest.get("files", {}):
            fmt.check_name(name, "file name", storage.describe(manifest_path))
        if manifest.get("version", 0) > fmt.VERSION:
            raise CheckpointError(f"{storage.describe(manifest_path)} has format version {manifest['version']}; "
                                  f"this raydeep reads up to {fmt.VERSION}: upgrade raydeep")
        return CheckpointReader(storage, resolved, manifest)

    @property
    def path(self) -> str:
        return self.storage.describe(self.tag)

    # --- files -----------------------------------------------------------------------------------
    def file(self, name: str) -> dict[str, torch.Tensor]:
        """A verified, decoded file of this checkpoint."""
        if name not in self._files:
            entry = self.manifest["files"].get(name)
            where = self.storage.describe(f"{self.tag}/{name}")
            if entry is None:
                raise CorruptCheckpointError(f"{where} is not listed in the manifest")
            try:
                data = self.storage.read(f"{self.tag}/{name}")
            except (FileNotFoundError, OSError) as err:
                raise CorruptCheckpointError(f"{where} is missing or unreadable ({err})") from err
            actual = fmt.sha256(data)
            if actual != entry["sha256"]:
                raise CorruptCheckpointError(f"{where} is corrupt: sha256 expected {entry['sha256']}, got {actual} "
                                      f"({len(data)} bytes, expected {entry['bytes']})")
            self._files[name] = fmt.decode(data, where)
        return self._files[name]

    def verify_all(self) -> None:
        """Check every file's digest (``raydeep convert`` and tests use this; loads check lazily)."""
        for name in self.manifest["files"]:
            self.file(name)

    # --- tensors -------------------------------------------------------------------------------
    @property
    def params(self) -> dict[str, dict]:
        """name -> {shape, dtype, group} for every trainable parameter, in model order."""
        return self.manifest["params"]

    @property
    def state_kinds(self) -> list[str]:
        """``fp32`` and the per-element optimizer states saved with it."""
        return [fmt.MASTER] + list(self.manifest["optimizer"]["state_keys"])

    def read_range(self, kind: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of flattened parameter ``name``'s state ``kind``."""
        if name not in self._where:
            raise CheckpointError(f"{self.path}: parameter {name!r} is not in this checkpoint")
        out = torch.empty(end - start, dtype=self.state_dtype(kind))
        covered = 0
        for lo, hi, file, offset in self._where[name]:
            s, e = max(lo, start), min(hi, end)
            if s >= e:
                continue
            packed = self.file(file)[kind]
            out[s - start:e - start] = packed[offset + s - lo:offset + e - lo]
            covered += e - s
        if covered != end - start:
            raise CheckpointError(f"{self.path}: the files cover {covered} of elements [{start}, {end}) "
                                  f"of {kind} {name!r}")
        return out

    def full(self, kind: str, name: str) -> torch.Tensor:
        shape = self.params[name]["shape"]
        numel = 1
        for d in shape:
            numel *= d
        return self.read_range(kind, name, 0, numel).view(shape)

    def extra(self) -> dict[str, torch.Tensor]:
        """Buffers (``buffer/<name>``), frozen parameters (``frozen/<name>``), client tensors (``client/<key>``)."""
        return self.file(fmt.EXTRA_FILE) if fmt.EXTRA_FILE in self.manifest["files"] else {}

    def state_dtype(self, kind: str) -> torch.dtype:
        if kind == fmt.MASTER:
            return torch.float32
        return fmt.dtype_from_name(self.manifest["optimizer"]["state_dtypes"].get(kind, "float32"))
