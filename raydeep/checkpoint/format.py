"""raydeep's checkpoint format: independent of ZeRO stage and world size.

::

    <save_dir>/
      latest                          # the tag of the newest committed checkpoint
      <tag>/
        manifest.json                 # written last: its presence is the commit
        rank00000-of-00004.safetensors
        rank00000-of-00004-part000.safetensors   # pieces written by the rank's offload actors
        ...
        extra.safetensors             # buffers, frozen parameters, client-state tensors (rank 0)

Each rank file holds *pieces*: the element range ``[start, end)`` of one flattened parameter,
for each kind of state: ``fp32`` (the master weights) and every per-element optimizer state
(``exp_avg``, ``exp_avg_sq``, ...). A file has one flat tensor per kind, named after the kind,
with the pieces packed one after another; the manifest lists, per file, its pieces as
``[param, start, end, offset]`` and its sha256, so a loader at any world size and stage finds
which files hold the ranges it now owns and verifies them before use. (Few large tensors keep
serialising cheap, which matters for a save running beside training.) A rank whose states live
elsewhere (offload actors) has them write *part files*, holding pieces the same way; its rank
file then holds only what the rank itself holds. Everything else
(counters, scheduler, loss scaler, optimizer hyperparameters, RNG states) is plain JSON in
the manifest: loading never unpickles.
"""
from __future__ import annotations

import contextlib
import hashlib
import json

import torch
from safetensors.torch import load as st_load

from raydeep.errors import CheckpointError, CorruptCheckpointError

FORMAT = "raydeep-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
EXTRA_FILE = "extra.safetensors"
MASTER = "fp32"
# Prefix of the tensors in a rank file that only that rank of that world size reads back (the
# error feedback of compressed communication); they are not pieces of any parameter.
RANK_LOCAL = "rank_local/"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def part_file(rank: int, world_size: int, part: int) -> str:
    """A file of rank ``rank``'s pieces that another process wrote (offload actor ``part``)."""
    return f"rank{rank:05d}-of-{world_size:05d}-part{part:03d}.safetensors"


class PackedFile:
    """Builds one rank file: pieces appended to one flat tensor per kind.

    >>> f = PackedFile()
    >>> f.add("w", 2, 5, {"fp32": torch.arange(3.0)}); f.add("b", 0, 1, {"fp32": torch.ones(1)})
    >>> f.pieces, f.tensors()["fp32"].tolist()
    ([['w', 2, 5, 0], ['b', 0, 1, 3]], [0.0, 1.0, 2.0, 1.0])
    """

    def __init__(self):
        self.pieces: list[list] = []
        self._chunks: dict[str, list[torch.Tensor]] = {}
        self._offset = 0

    def add(self, name: str, start: int, end: int, by_kind: dict[str, torch.Tensor]) -> None:
        self.add_run([(name, start, end)], by_kind)

    def add_run(self, pieces: list[tuple[str, int, int]], by_kind: dict[str, torch.Tensor]) -> None:
        """Consecutive pieces whose values lie back to back in each of ``by_kind``'s tensors."""
        for name, start, end in pieces:
            self.pieces.append([name, start, end, self._offset])
            self._offset += end - start
        for kind, values in by_kind.items():
            self._chunks.setdefault(kind, []).append(values.detach().reshape(-1))

    def tensors(self, after: "torch.cuda.Event | None" = None) -> dict[str, torch.Tensor]:
        """One copy of every piece, in host memory (so later updates to the sources do not reach
        the file, and the writer reads host memory only).

        Note: pieces on a CUDA device are copied into pinned host buffers on a side stream that
        first waits for ``after`` (an event recorded on the stream that produced them), and this
        returns once those copies are done. Nothing is duplicated in device memory.
        """
        cuda = next((c.device for cs in self._chunks.values() for c in cs if c.device.type == "cuda"), None)
        stream = torch.cuda.Stream(device=cuda) if cuda is not None and torch.cuda.is_available() else None
        out = {}
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and after is not None:
                stream.wait_event(after)
            for kind, chunks in self._chunks.items():
                out[kind] = _to_host(chunks, pinned=stream is not None)
        if stream is not None:
            stream.synchronize()
        return out


def _to_host(chunks: list[torch.Tensor], pinned: bool) -> torch.Tensor:
    """The chunks back to back in one new host tensor (pinned for asynchronous device copies)."""
    if not chunks:
        return torch.zeros(0)
    total = sum(c.numel() for c in chunks)
    host = torch.empty(total, dtype=chunks[0].dtype, device="cpu", pin_memory=pinned)
    offset = 0
    for c in chunks:  # ``narrow``, not slicing: the FakeTensorMode tests follow it on CPU builds
        host.narrow(0, offset, c.numel()).copy_(c, non_blocking=pinned)
        offset += c.numel()
    return host


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


# safetensors' dtype codes.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def sha256(data: bytes | list) -> str:
    digest = hashlib.sha256()
    for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
        digest.update(chunk)  # releases the GIL for large buffers
    return digest.hexdigest()


def encode(tensors: dict[str, torch.Tensor]) -> list:
    """A safetensors file as buffers: the header, then each tensor's own memory (no copy).

    A save running beside training must not hold the GIL: serialising into one bytes object
    does, for milliseconds per megabyte, while writing and hashing these buffers does not.
    The layout is safetensors' (8-byte header length, JSON header padded to 8 bytes, data), so
    ``decode`` reads it with the safetensors library, which validates it.
    """
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in a checkpoint")
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.numel()]}
        chunks.append(memoryview(raw.numpy()))
        offset += raw.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text] + chunks


def is_plain_name(name) -> bool:
    """One non-empty path component that is neither hidden nor a parent reference."""
    return isinstance(name, str) and bool(name.strip()) and not name.startswith(".") \
        and not any(c in name for c in "/\\\0")


def check_name(name, what: str, where: str, written_by_user: bool = False) -> str:
    """``name`` if it is one plain path component, else a CheckpointError.

    Tags (from ``latest`` or a caller) and file names (from a manifest) are joined onto the
    checkpoint directory: a crafted ``latest`` or manifest naming ``../x`` or ``/etc/x`` must not
    make a load read outside it. A bad name read from the checkpoint itself makes it corrupt;
    one the caller passed (``written_by_user``) is the caller's mistake.
    """
    if is_plain_name(name):
        return name
    error = CheckpointError if written_by_user else CorruptCheckpointError
    raise error(f"{where}: {what} {name!r} is not a plain name (a non-empty name without '/', '\\' or a "
                "leading '.')")


def encoded_size(data: bytes | list) -> int:
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    return sum(memoryview(c).nbytes for c in chunks)


def decode(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CorruptCheckpointError(f"{where}: not a readable safetensors file ({err})") from err


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def to_json(obj, where: str) -> str:
    try:
        # Compact: the manifest is rewritten on every save, and piece lists and RNG states are long.
        return json.dumps(obj, separators=(",", ":"), allow_nan=True)
    except TypeError as err:
        raise TypeError(f"{where} must be JSON-serialisable (numbers, strings, lists, dicts) or tensors: {err}") \
            from err
