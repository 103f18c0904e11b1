"""Load a checkpoint into a run's stateful parts, at any ZeRO stage and world size.

Every rank reads exactly the element ranges its FlatUnits own now (the whole unit for stage 0),
whatever layout wrote them, into a ``TierState`` (or its offload actors read their own parts of
them, ``remote_load``, where they reach the checkpoint's storage); the optimizer tier takes the
fp32 masters and optimizer states from it and the strategy publishes the parameters the same way
an optimizer step does. Scalar states (``step``) and hyperparameters come from the manifest.
"""
from __future__ import annotations

import logging

import torch

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.parts import CheckpointParts
from raydeep.checkpoint.reader import CheckpointReader
from raydeep.checkpoint.snapshot import held_range, pieces_in, restore_rng
from raydeep.errors import CheckpointError, CorruptCheckpointError
from raydeep.tier import TierState, UnitRange

logger = logging.getLogger("raydeep")


def check_compatible(units: list, reader: CheckpointReader, strict: bool = True) -> None:
    """Every trainable parameter of the units must be in the checkpoint with the same shape."""
    saved = reader.params
    problems = []
    for unit in units:
        for slot in unit.layout.slots:
            entry = saved.get(slot.name)
            if entry is None:
                problems.append(f"{slot.name}: missing from the checkpoint")
            elif tuple(entry["shape"]) != tuple(slot.shape):
                problems.append(f"{slot.name}: shape {tuple(entry['shape'])} in the checkpoint, "
                                f"{tuple(slot.shape)} in the model")
    if strict:
        ours = {slot.name for unit in units for slot in unit.layout.slots}
        problems += [f"{name}: in the checkpoint but not a trainable parameter of the model"
                     for name in saved if name not in ours]
    if problems:
        raise CheckpointError(f"{reader.path} does not fit this model:\n  " + "\n  ".join(problems[:20]))


def read_shards(parts: CheckpointParts, reader: CheckpointReader, with_optimizer: bool,
                strict: bool = True) -> TierState:
    """Phase 1 (no collectives, so every rank can report a bad file before anyone waits): check
    the model fits and read this rank's fp32 master ranges (and optimizer-state ranges, scalars
    and hyperparameters). Nothing in training changes yet."""
    check_compatible(parts.units, reader, strict)
    reader.extra()  # verify it now too
    if parts.tier.remote_load is not None and not reader.storage.is_local:
        # The offload actors read their own ranges where every node reaches them (an object
        # store, the memory snapshots): the masters and states never pass through this rank.
        kinds = [fmt.MASTER, *(reader.manifest["optimizer"]["state_keys"] if with_optimizer else [])]
        parts.tier.remote_load(CheckpointReader(reader.storage, reader.tag, reader.manifest), kinds, pieces_in)
        units = [_ranges_only(unit, reader, with_optimizer) for unit in parts.units]
    else:
        units = [_read_unit(unit, reader, with_optimizer) for unit in parts.units]
    if not with_optimizer:
        return TierState(units)
    state = _optimizer_state(parts.tier, reader.manifest, units)
    state.rank_local, state.rank_local_note = _read_rank_local(parts, reader)
    return state


def _read_rank_local(parts: CheckpointParts, reader: CheckpointReader) -> tuple[dict | None, str]:
    """This rank's own state from its own file, when the checkpoint was written by as many ranks."""
    names = reader.manifest.get("rank_local") or []
    if not names:
        return None, ""
    written_by = reader.manifest["world_size"]
    if written_by != parts.world_size:
        return None, (f"the checkpoint was written by {written_by} ranks and this run has {parts.world_size}; "
                      "the error buffers are per rank, so they start again from zero")
    tensors = reader.file(fmt.rank_file(parts.rank, parts.world_size))
    missing = [n for n in names if fmt.RANK_LOCAL + n not in tensors]
    if missing:
        raise CorruptCheckpointError(f"{reader.path}: {fmt.rank_file(parts.rank, parts.world_size)} lacks its "
                                     f"rank-local tensors {missing[:3]}")
    return {n: tensors[fmt.RANK_LOCAL + n] for n in names}, ""


def finish(parts: CheckpointParts, reader: CheckpointReader, state: TierState, with_optimizer: bool,
           load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> dict:
    """Phase 2: the tier takes the masters (and optimizer), the parameters are published
    (collectives), then counters, scheduler, scaler and RNG; returns the client state saved
    with the checkpoint."""
    manifest = reader.manifest
    with_optimizer = with_optimizer and not load_module_only
    if with_optimizer and manifest["optimizer"]["class"] not in (None, parts.tier.optimizer_name):
        logger.warning("checkpoint optimizer %s differs from this run's %s: loading its states anyway",
                       manifest["optimizer"]["class"], parts.tier.optimizer_name)
    parts.tier.load_state_dict(state if with_optimizer else state.masters_only())
    parts.tier.load_rank_state(state.rank_local if with_optimizer else None, state.rank_local_note)
    parts.publish()  # model-dtype shards -> full parameters
    _load_extra(parts, reader)
    client = dict(manifest.get("client_state", {}))
    client.update({k.removeprefix("client/"): v for k, v in reader.extra().items() if k.startswith("client/")})
    if load_module_only:
        return client
    parts.train_state.load_state_dict(manifest["counters"])
    if manifest.get("loss_scaler") and hasattr(parts.scaler, "load_state_dict") \
            and parts.precision == manifest.get("precision"):
        parts.scaler.load_state_dict(manifest["loss_scaler"])
    if load_lr_scheduler_states and parts.scheduler is not None and manifest.get("lr_scheduler") is not None:
        parts.scheduler.load_state_dict(manifest["lr_scheduler"])
    rng = manifest.get("rng", [])
    if len(rng) == parts.world_size:  # a rank's random stream only means something on the same layout
        restore_rng(rng[parts.rank])
    elif rng:
        logger.info("checkpoint was written by %d ranks, this run has %d: RNG states not restored",
                    len(rng), parts.world_size)
    return client


def _read_unit(unit, reader: CheckpointReader, with_optimizer: bool) -> UnitRange:
    """This rank's fp32 master range of ``unit`` and, ``with_optimizer``, its per-element states."""
    start, end, _ = held_range(unit)
    kinds = reader.manifest["optimizer"]["state_keys"] if with_optimizer else []
    n = max(end - start, 0)
    piece = UnitRange(start, end, torch.empty(n, dtype=torch.float32),
                      {kind: torch.empty(n, dtype=reader.state_dtype(kind)) for kind in kinds})
    for slot, s, e in pieces_in(unit, start, end):
        lo, hi = s - slot.offset, e - slot.offset
        piece.master[s - start:e - start].copy_(reader.read_range(fmt.MASTER, slot.name, lo, hi))
        for kind, buf in piece.states.items():
            buf[s - start:e - start].copy_(reader.read_range(kind, slot.name, lo, hi))
    return piece


def _ranges_only(unit, reader: CheckpointReader, with_optimizer: bool) -> UnitRange:
    """``_read_unit``'s range and kinds, with empty tensors: the tier's processes read the values."""
    start, end, _ = held_range(unit)
    kinds = reader.manifest["optimizer"]["state_keys"] if with_optimizer else []
    return UnitRange(start, end, torch.empty(0), {kind: torch.empty(0, dtype=reader.state_dtype(kind)) for kind in kinds})


def _optimizer_state(tier, manifest: dict, units: list[UnitRange]) -> TierState:
    """The manifest's hyperparameters and scalar states, checked against this run's optimizer."""
    saved_groups, scalars = manifest["param_groups"], manifest["optimizer"]["scalars"]
    if saved_groups and len(saved_groups) != len(tier.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved_groups)} optimizer parameter groups, "
                              f"this run has {len(tier.param_groups)}")
    for group_scalars in scalars:
        for spec in group_scalars.values():
            if spec.get("tensor"):
                fmt.dtype_from_name(spec["dtype"])  # a damaged manifest fails here, before anything changes
    dtypes = {kind: units[0].states[kind].dtype for kind in units[0].states} if units else {}
    return TierState(units, manifest["optimizer"]["class"], dtypes, saved_groups, scalars)


def _load_extra(parts: CheckpointParts, reader: CheckpointReader) -> None:
    extra = reader.extra()
    copy_unpartitioned(parts.module, parts.units, buffers={k.removeprefix("buffer/"): v for k, v in extra.items() if k.startswith("buffer/")},
                       frozen={k.removeprefix("frozen/"): v for k, v in extra.items() if k.startswith("frozen/")})


def copy_unpartitioned(module, units: list, buffers: dict[str, torch.Tensor],
                       frozen: dict[str, torch.Tensor]) -> set[str]:
    """Copy buffers and frozen (not partitioned: in no unit) parameters into ``module`` by name;
    returns the names copied."""
    copied = set()
    unit_params = {id(p) for unit in units for p in unit.params}
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])
                copied.add(name)
        for name, p in module.named_parameters():
            if id(p) not in unit_params and name in frozen:
                p.copy_(frozen[name])
                copied.add(name)
    return copied
