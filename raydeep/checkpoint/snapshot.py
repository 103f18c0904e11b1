"""Take a rank's share of the training state as plain tensors and JSON, independent of the stage.

Each rank saves, for every FlatUnit, the element ranges it owns: its shard for stages 1-3, and
for stage 0 (where every rank holds everything) an even split of each unit across the ranks, so
the save is shared out in every stage. Pieces are copied once, packed per kind (the snapshot must
not change while an asynchronous write is in flight); padding is never saved.

A tier whose states live in other processes (``ActorTier``: offload actors on CPU nodes) offers
``remote_snapshot``: the copy is taken there and written from there as the rank's part files
(``format.part_file``), so the masters and optimizer states never reach the rank's memory.
"""
from __future__ import annotations

import base64
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.parts import CheckpointParts
from raydeep.zero.layout import UnitLayout


@dataclass
class RankSnapshot:
    """What one rank contributes to a checkpoint."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by ``copy_tensors``
    pieces: list[list] = field(default_factory=list)  # [param name, start, end, offset]
    rng: dict = field(default_factory=dict)  # as captured; ``rng_json`` makes it storable
    # rank 0 only: model-wide tensors (buffers, frozen params, client tensors) and JSON state
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    packed: fmt.PackedFile | None = None  # views of the live states, until ``copy_tensors``
    rank_local: dict[str, torch.Tensor] = field(default_factory=dict)  # the tier's rank_state, as views
    # On CUDA: recorded on the training stream when the snapshot is taken, so the copies (maybe
    # in the writer thread, on their own stream) start after the step that produced the states.
    ready: "torch.cuda.Event | None" = None
    # A copy held by the tier's own processes (``remote_snapshot``), written by them as part files
    # whose pieces are ``remote_pieces[i]``; None when the pieces are in ``tensors``.
    remote: Any = None
    remote_pieces: list[list[list]] = field(default_factory=list)

    def copy_tensors(self) -> None:
        """Copy the states the snapshot points at into host memory (once). Until then they must
        not change. A remote copy is already taken: rank 0 adds its optimizer fields to the
        manifest (its state dtypes and scalars come from where the copy is)."""
        if self.packed is not None:
            self.tensors, self.packed = self.packed.tensors(after=self.ready), None
            self.tensors.update({fmt.RANK_LOCAL + name: t.detach().to("cpu", copy=True)
                                 for name, t in self.rank_local.items()})
            self.rank_local = {}
            if self.remote is not None and self.manifest:
                self.manifest.update(_optimizer_fields(self.remote.state()))

    def write_remote(self, sink, rank: int, world_size: int) -> dict[str, dict]:
        """The remote copy written as this rank's part files through ``sink``
        (``writer.RemoteSink``); returns their manifest entries."""
        if self.remote is None:
            return {}
        names = [fmt.part_file(rank, world_size, i) for i in range(len(self.remote_pieces))]
        entries = self.remote.write(names, sink)
        return {name: {**entry, "pieces": pieces} for name, entry, pieces in zip(names, entries, self.remote_pieces)}

    def release(self) -> None:
        """A save that failed: drop a remote copy that was not written."""
        if self.remote is not None:
            self.remote.discard()


def held_range(unit) -> tuple[int, int, int]:
    """(start, end, base): the flat range of ``unit`` this rank holds (its shard; the whole unit
    for stage 0), padding excluded, and the flat offset of the shard's element 0."""
    return unit.held_range()


def owned_range(unit, rank: int, world_size: int) -> tuple[int, int, int]:
    """Like ``held_range``, but the range this rank *saves*: stage 0 splits each unit across ranks."""
    if unit.layout.world_size > 1:
        return held_range(unit)
    lo, hi = UnitLayout(unit.layout.slots, world_size).shard_range(rank)
    return lo, min(hi, unit.layout.numel), 0


def pieces_in(unit, start: int, end: int):
    """(slot, flat_start, flat_end) of each parameter of ``unit`` overlapping ``[start, end)``."""
    for slot in unit.layout.slots:
        s, e = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if s < e:
            yield slot, s, e


def take(parts: CheckpointParts, client_state: dict | None, static: dict | None = None) -> RankSnapshot:
    """This rank's snapshot of the stateful ``parts``; rank 0 also fills the model-wide parts.

    It runs in the caller's thread while training waits, so it does little: the parameter and
    optimizer states are only *referenced* (``copy_tensors`` copies them, and an asynchronous
    save does that in its thread, before the next optimizer step, while the next forward and
    backward run); the RNG states are kept as they are (``rng_json`` converts them later), and
    ``static`` (``static_state``, computed once per run) is reused rather than rebuilt.
    Model-wide tensors (buffers may change in a forward) are copied here.
    """
    snap = RankSnapshot(rng=_capture_rng())
    ranges = [owned_range(u, parts.rank, parts.world_size)[:2] for u in parts.units]
    remote_snapshot = getattr(parts.tier, "remote_snapshot", None)
    packed = fmt.PackedFile()
    if remote_snapshot is not None:
        state, snap.remote = None, remote_snapshot(ranges)
        snap.remote_pieces = [_runs_pieces(parts.units, runs) for runs in snap.remote.segments]
    else:
        state = parts.tier.state_dict(ranges)
        for unit, piece in zip(parts.units, state.units):
            if piece.start < piece.end:
                _add_run(packed, unit, piece.start, piece.end, {fmt.MASTER: piece.master, **piece.states})
    snap.packed, snap.pieces = packed, packed.pieces
    snap.rank_local = parts.tier.rank_state()
    if parts.device.type == "cuda":
        snap.ready = torch.cuda.Event()
        snap.ready.record(torch.cuda.current_stream(parts.device))
    if parts.rank == 0:
        snap.manifest = {**(static if static is not None else static_state(parts)), **_dynamic_state(parts, state)}
        snap.extra = _extra_tensors(parts, client_state or {})
        snap.manifest["client_state"] = {k: v for k, v in (client_state or {}).items() if not torch.is_tensor(v)}
        if snap.manifest["client_state"]:
            fmt.to_json(snap.manifest["client_state"], "client_state")  # fail now, in the caller's thread
    return snap


def _add_run(packed: fmt.PackedFile, unit, start: int, end: int, by_kind: dict) -> None:
    # The unit's parameters lie back to back, so the pieces of [start, end) are one slice.
    packed.add_run([(slot.name, s - slot.offset, e - slot.offset) for slot, s, e in pieces_in(unit, start, end)],
                   by_kind)


def _runs_pieces(units: list, runs: list[tuple[int, int, int]]) -> list[list]:
    """The pieces of a part file packing ``(unit, flat start, flat end)`` runs back to back."""
    packed = fmt.PackedFile()
    for u, start, end in runs:
        _add_run(packed, units[u], start, end, {})
    return packed.pieces


def static_state(parts: CheckpointParts, config: dict | None = None) -> dict:
    """The manifest fields that do not change while a run trains (shapes, layout, config)."""
    names_in_units = {name: unit for unit in parts.units for name in unit.param_names}
    params = {}
    for name, p in parts.module.named_parameters():
        if name in names_in_units:
            params[name] = {"shape": list(p.shape), "dtype": fmt.dtype_name(p.dtype),
                            "group": names_in_units[name].group_index}
    return {"world_size": parts.world_size, "stage": parts.stage, "precision": parts.precision,
            "params": params, "config": config}


def _dynamic_state(parts: CheckpointParts, state) -> dict:
    """Counters, optimizer scalars and hyperparameters (from the tier's ``state``; None: added
    by ``copy_tensors`` from the remote copy), scheduler, scaler."""
    scaler = parts.scaler.state_dict() if hasattr(parts.scaler, "state_dict") else None
    sched = parts.scheduler.state_dict() if parts.scheduler is not None else None
    return {
        "counters": parts.train_state.state_dict(),
        **(_optimizer_fields(state) if state is not None else {}),
        "lr_scheduler": _jsonable(sched, "lr_scheduler state"),
        "rank_local": sorted(parts.tier.rank_state()),  # names in every rank's file (error feedback)
        "loss_scaler": _jsonable(scaler, "loss scaler state"),
    }


def _optimizer_fields(state) -> dict:
    return {"optimizer": {"class": state.optimizer, "state_keys": list(state.state_dtypes),
                          "state_dtypes": {k: fmt.dtype_name(d) for k, d in state.state_dtypes.items()},
                          "scalars": state.scalars},
            "param_groups": state.param_groups}


def _jsonable(obj, what: str):
    if obj is None:
        return None
    if torch.is_tensor(obj):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _jsonable(v, what) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, what) for v in obj]
    if isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{what}: {type(obj).__name__} values cannot be saved without pickling")


def _extra_tensors(parts: CheckpointParts, client_state: dict) -> dict[str, torch.Tensor]:
    unit_params = {id(p) for unit in parts.units for p in unit.params}
    extra = {}
    for name, buf in parts.module.named_buffers():
        extra[f"buffer/{name}"] = buf.detach().cpu().clone()
    for name, p in parts.module.named_parameters():
        if id(p) not in unit_params:  # frozen: not partitioned, the same on every rank
            extra[f"frozen/{name}"] = p.detach().cpu().clone()
    for key, value in client_state.items():
        if torch.is_tensor(value):
            extra[f"client/{key}"] = value.detach().cpu().clone()
    return extra


# --- RNG -----------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _capture_rng() -> dict:
    """The generators' states as they are now (copies; cheap)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def rng_json(captured: dict) -> dict:
    """``_capture_rng``'s states as the manifest stores them (plain JSON)."""
    version, mt, gauss = captured["python"]
    name, keys, pos, has_gauss, cached = captured["numpy"]
    state = {"python": [version, list(mt), gauss], "torch": _b64(captured["torch"]),
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if "cuda" in captured:
        state["cuda"] = _b64(captured["cuda"])
    return state


def restore_rng(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
