"""Consolidated weights: export a checkpoint as one state dict, and load one into an engine.

An export is what a model outside raydeep needs: every trainable parameter as a full tensor
(from the fp32 masters, cast to the chosen dtype), plus buffers and frozen parameters, under
their model names. A tied parameter appears once, under the name the checkpoint has. Formats:

- ``model.safetensors``, or Hugging Face-style shards ``model-00001-of-0000N.safetensors`` with
  ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``) when the
  weights exceed ``max_shard_size``;
- ``pytorch_model.bin`` (a plain ``torch.save`` state dict, loadable with ``weights_only=True``),
  sharded the same way with ``pytorch_model.bin.index.json``.

>>> parse_size("5GB"), parse_size("2MiB"), parse_size(1000)
(5000000000, 2097152, 1000)
"""
from __future__ import annotations

import io
import json
import posixpath
import re

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.parts import CheckpointParts
from raydeep.checkpoint.reader import CheckpointReader
from raydeep.checkpoint.restore import copy_unpartitioned
from raydeep.checkpoint.snapshot import held_range, pieces_in
from raydeep.storage import Storage
from raydeep.errors import CheckpointError
from raydeep.tier import TierState, UnitRange

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
# format -> (single file, shard name pattern, index file)
LAYOUTS = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes in ``size``: an integer, or a number with a unit (``5GB`` = 5e9, ``5GiB`` = 5 * 2**30),
    as Hugging Face reads ``max_shard_size``."""
    if isinstance(size, int):
        if size <= 0:
            raise CheckpointError(f"max shard size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointError(f"max shard size {size!r} is not a size: use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise CheckpointError(f"export dtype {name!r} is not one of fp32, bf16, fp16")
    return DTYPES[name]


# --- checkpoint -> state dict -----------------------------------------------------------------------
def consolidated_state_dict(reader: CheckpointReader, dtype: str | torch.dtype = torch.float32,
                            include_extra: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint as a full tensor (trainable ones in ``dtype``), then
    its buffers and frozen parameters; floating-point buffers/frozen params are cast too and
    integer ones keep their dtype."""
    dtype = resolve_dtype(dtype)
    out = {name: reader.full(fmt.MASTER, name).to(dtype) for name in reader.params}
    if include_extra:
        extra = reader.extra()
        for key in sorted(extra):  # buffers, then frozen parameters, each by name: a stable order
            tensor = extra[key]
            kind, _, name = key.partition("/")
            if kind in ("buffer", "frozen") and name not in out:
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out


def plan_shards(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Consecutive names per shard, each shard at most ``max_bytes`` (a larger tensor gets its own)."""
    shards, current, filled = [], [], 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if current and filled + size > max_bytes:
            shards.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    if current or not shards:
        shards.append(current)
    return shards


def write_state_dict(state_dict: dict[str, torch.Tensor], out: str | Storage, file_format: str = "safetensors",
                     max_shard_size: str | int = "5GB") -> list[str]:
    """Write ``state_dict`` under the directory ``out`` (a path or URI); returns the files written."""
    if file_format not in LAYOUTS:
        raise CheckpointError(f"export format {file_format!r} is not one of {sorted(LAYOUTS)}")
    storage = out if isinstance(out, Storage) else Storage.open(out)
    single, pattern, index_name = LAYOUTS[file_format]
    shards = plan_shards(state_dict, parse_size(max_shard_size))
    names = [single] if len(shards) == 1 else [pattern.format(i + 1, len(shards)) for i in range(len(shards))]
    _remove_previous(storage, file_format)
    for name, keys in zip(names, shards):
        storage.write(name, _encode({k: state_dict[k] for k in keys}, file_format))
    if len(shards) == 1:
        return names
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {key: name for name, keys in zip(names, shards) for key in keys}}
    storage.write(index_name, json.dumps(index, indent=2).encode())
    return names + [index_name]


def _remove_previous(storage: Storage, file_format: str) -> None:
    """Delete an earlier export of this format in the directory: a stale index (which readers
    prefer) or stale shards must not survive next to the new files."""
    single, _, index_name = LAYOUTS[file_format]
    doomed = [single]
    if storage.exists(index_name):
        try:
            doomed += list(dict.fromkeys(json.loads(storage.read(index_name))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # an unreadable index: remove it and keep whatever it pointed at
        doomed.append(index_name)
    for name in doomed:
        if storage.exists(name):
            storage.fs.delete_file(storage.path(name))


def _encode(tensors: dict[str, torch.Tensor], file_format: str) -> bytes:
    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    if file_format == "safetensors":
        return st_save(tensors, metadata={"format": "pt"})
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def export_checkpoint(src: str, out: str, tag: str | None = None, dtype: str = "fp32",
                      formats: tuple[str, ...] = ("safetensors",), max_shard_size: str | int = "5GB") -> list[str]:
    """Export the committed checkpoint ``src`` (``tag`` or ``latest``) to ``out``; returns the files."""
    parse_size(max_shard_size), resolve_dtype(dtype)  # reject bad options before reading anything
    reader = CheckpointReader.open(src, tag)
    reader.verify_all()
    state_dict = consolidated_state_dict(reader, dtype)
    written = []
    for file_format in formats:
        written += write_state_dict(state_dict, out, file_format, max_shard_size)
    return written


# --- state dict <- files ------------------------------------------------------------------------------
def load_consolidated(path: str) -> dict[str, torch.Tensor]:
    """Read an export: a ``.safetensors``/``.bin`` file, an ``*.index.json``, or a directory holding
    one of the layouts above (safetensors preferred). ``.bin`` files load with ``weights_only=True``.
    Sharded exports keep the index's order; a single safetensors file comes back sorted by name."""
    storage, name = _locate_export(path)
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads(storage.read(name))["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{storage.describe(name)} is not a shard index ({err})") from err
        out = {}
        for shard in dict.fromkeys(weight_map.values()):
            part = _read_file(storage, posixpath.join(posixpath.dirname(name), shard))
            out.update({k: v for k, v in part.items() if weight_map.get(k) == shard})
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(f"{storage.describe(name)} lists tensors its shards lack: {missing[:5]}")
        return {k: out[k] for k in weight_map}
    return _read_file(storage, name)


def _locate_export(path: str) -> tuple[Storage, str]:
    storage = Storage.open(path)
    if storage.is_dir(""):
        for single, _, index in LAYOUTS.values():
            for candidate in (index, single):
                if storage.exists(candidate):
                    return storage, candidate
        raise CheckpointError(f"{path} holds no exported weights (model.safetensors, pytorch_model.bin or their "
                              "*.index.json)")
    parent, name = posixpath.split(storage.uri.rstrip("/"))
    storage = Storage.open(parent or ".")
    if not storage.exists(name):
        raise CheckpointError(f"{path} does not exist")
    return storage, name


def _read_file(storage: Storage, name: str) -> dict[str, torch.Tensor]:
    where = storage.describe(name)
    try:
        data = storage.read(name)
    except OSError as err:
        raise CheckpointError(f"{where} is missing or unreadable ({err})") from err
    if name.endswith(".safetensors"):
        try:
            tensors = st_load(data)
            return {k: tensors[k] for k in sorted(tensors)}  # the file's header has no order to keep
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{where}: not a readable safetensors file ({err})") from err
    try:
        state_dict = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # the weights-only unpickler raises several types
        raise CheckpointError(f"{where}: not a plain tensor state dict ({type(err).__name__}: {err})") from err
    if not isinstance(state_dict, dict) or not all(torch.is_tensor(v) for v in state_dict.values()):
        raise CheckpointError(f"{where}: expected a dict of tensors")
    return dict(state_dict)


# --- state dict -> engine -----------------------------------------------------------------------------
def load_into_engine(engine, source: str | dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """:func:`load_weights` into ``engine``'s stateful parts (those its checkpoints save)."""
    return load_weights(engine.checkpointer.parts, source, strict)


def load_weights(parts: CheckpointParts, source: str | dict[str, torch.Tensor], strict: bool = True) -> list[str]:
    """Load consolidated weights into a run's parts at any stage and world size: every rank hands
    the ranges its units own to the optimizer tier as fp32 masters, then publishes them as after
    an optimizer step (collective: every rank calls it). Buffers and frozen parameters are copied
    whole. Optimizer state, counters and scheduler are untouched. Returns the names not used.

    With ``strict``, every trainable parameter must be present with its shape, and every name
    in the file must be a parameter or buffer of the model (a tied alias counts)."""
    state_dict = load_consolidated(source) if isinstance(source, str) else source
    where = source if isinstance(source, str) else "state dict"
    problems, used = [], set()
    for unit in parts.units:
        for slot in unit.layout.slots:
            tensor = state_dict.get(slot.name)
            if tensor is None:
                problems.append(f"{slot.name}: missing")
            elif tuple(tensor.shape) != tuple(slot.shape):
                problems.append(f"{slot.name}: shape {tuple(tensor.shape)} in the file, "
                                f"{tuple(slot.shape)} in the model")
    known = {n for n, _ in parts.module.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in parts.module.named_buffers(remove_duplicate=False)}
    unexpected = [name for name in state_dict if name not in known]
    if strict:
        problems += [f"{name}: not a parameter or buffer of the model" for name in unexpected]
    if problems:
        raise CheckpointError(f"{where} does not fit this model:\n  " + "\n  ".join(problems[:20]))
    pieces = []
    for unit in parts.units:
        start, end, _ = held_range(unit)
        master = torch.empty(max(end - start, 0), dtype=torch.float32)
        for slot, s, e in pieces_in(unit, start, end):
            master[s - start:e - start].copy_(state_dict[slot.name].reshape(-1)[s - slot.offset:e - slot.offset])
        pieces.append(UnitRange(start, end, master))
        used.update(unit.param_names)  # every rank reports the same: each name has an owner somewhere
    parts.tier.load_state_dict(TierState(pieces))  # fp32 masters -> model-dtype shards
    parts.publish()  # -> full parameters
    used |= copy_unpartitioned(parts.module, parts.units, buffers=state_dict, frozen=state_dict)
    return [name for name in state_dict if name not in used]
