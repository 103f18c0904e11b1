"""raydeep's checkpoint format: independent of ZeRO stage and world size.

::

    <save_dir>/
      latest                          # the tag of the newest committed checkpoint
      <tag>/
        manifest.json                 # written last: its presence is the commit
        rank00000-of-00004.safetensors
        ...
        extra.safetensors             # buffers, frozen parameters, client-state tensors (rank 0)

Each rank file holds *pieces*: the element range ``[start, end)`` of one flattened parameter,
for each kind of state: ``fp32`` (the master weights) and every per-element optimizer state
(``exp_avg``, ``exp_avg_sq``, ...). A piece's tensor key is ``"<kind>/<param>@<start>"``. The
manifest lists, per file, its pieces and its sha256, so a loader at any world size and stage
finds which files hold the ranges it now owns and verifies them before use. Everything else
(counters, scheduler, loss scaler, optimizer hyperparameters, RNG states) is plain JSON in
the manifest: loading never unpickles.
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from raydeep.errors import CheckpointError

FORMAT = "raydeep-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
EXTRA_FILE = "extra.safetensors"
MASTER = "fp32"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


def piece_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}@{start}"


def default_tag(global_steps: int) -> str:
    return f"global_step{global_steps}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: t.detach().contiguous() for k, t in tensors.items()})


def decode(data: bytes, where: str) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{where}: not a readable safetensors file ({err})") from err


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype


def to_json(obj, where: str) -> str:
    try:
        return json.dumps(obj, indent=1, sort_keys=False, allow_nan=True)
    except TypeError as err:
        raise TypeError(f"{where} must be JSON-serialisable (numbers, strings, lists, dicts) or tensors: {err}") \
            from err
