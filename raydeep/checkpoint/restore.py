"""Load a checkpoint into an engine of any ZeRO stage and world size.

Every rank reads exactly the element ranges its FlatUnits own now (the whole unit for stage 0),
whatever layout wrote them, then publishes the fp32 masters into the model-dtype parameters
the same way an optimizer step does. Optimizer states are rebuilt the same way; scalar states
(``step``) and hyperparameters come from the manifest.
"""
from __future__ import annotations

import logging

import torch

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.reader import CheckpointReader
from raydeep.checkpoint.snapshot import held_range, pieces_in, restore_rng
from raydeep.errors import CheckpointError

logger = logging.getLogger("raydeep")
# Param-group keys that pick an optimizer implementation rather than hold training state.
KERNEL_CHOICES = frozenset({"fused", "foreach", "capturable", "differentiable"})


def check_compatible(engine, reader: CheckpointReader, strict: bool = True) -> None:
    """Every trainable parameter of the engine must be in the checkpoint with the same shape."""
    saved = reader.params
    problems = []
    for unit in engine.strategy.units:
        for slot in unit.layout.slots:
            entry = saved.get(slot.name)
            if entry is None:
                problems.append(f"{slot.name}: missing from the checkpoint")
            elif tuple(entry["shape"]) != tuple(slot.shape):
                problems.append(f"{slot.name}: shape {tuple(entry['shape'])} in the checkpoint, "
                                f"{tuple(slot.shape)} in the model")
    if strict:
        ours = {slot.name for unit in engine.strategy.units for slot in unit.layout.slots}
        problems += [f"{name}: in the checkpoint but not a trainable parameter of the model"
                     for name in saved if name not in ours]
    if problems:
        raise CheckpointError(f"{reader.path} does not fit this model:\n  " + "\n  ".join(problems[:20]))


def read_shards(engine, reader: CheckpointReader, with_optimizer: bool, strict: bool = True) -> dict:
    """Phase 1 (no collectives, so every rank can report a bad file before anyone waits): check
    the model fits, fill this rank's fp32 master ranges, and read its optimizer-state ranges."""
    check_compatible(engine, reader, strict)
    reader.extra()  # verify it now too
    return {id(unit.master): _load_unit(unit, reader, with_optimizer) for unit in engine.strategy.units}


def finish(engine, reader: CheckpointReader, states: dict, with_optimizer: bool, load_lr_scheduler_states: bool = True,
           load_module_only: bool = False) -> dict:
    """Phase 2: publish the parameters (collectives), then optimizer, counters, scheduler,
    scaler and RNG; returns the client state saved with the checkpoint."""
    manifest = reader.manifest
    engine.strategy.after_step()  # fp32 masters -> model-dtype shards -> full parameters
    _load_extra(engine, reader)
    client = dict(manifest.get("client_state", {}))
    client.update({k.removeprefix("client/"): v for k, v in reader.extra().items() if k.startswith("client/")})
    if load_module_only:
        return client
    if with_optimizer:
        if manifest["optimizer"]["class"] not in (None, type(engine.optimizer).__name__):
            logger.warning("checkpoint optimizer %s differs from this run's %s: loading its states anyway",
                           manifest["optimizer"]["class"], type(engine.optimizer).__name__)
        _load_optimizer(engine.optimizer, manifest, states)
    counters = manifest["counters"]
    engine.global_steps, engine.global_samples = counters["global_steps"], counters["global_samples"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.micro_steps = engine.global_steps * engine.settings.grad_accum
    if manifest.get("loss_scaler") and hasattr(engine.loss_scaler, "load_state_dict") \
            and engine.settings.precision == manifest.get("precision"):
        engine.loss_scaler.load_state_dict(manifest["loss_scaler"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and manifest.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    rng = manifest.get("rng", [])
    if len(rng) == engine.world_size:  # a rank's random stream only means something on the same layout
        restore_rng(rng[engine.rank])
    elif rng:
        logger.info("checkpoint was written by %d ranks, this run has %d: RNG states not restored",
                    len(rng), engine.world_size)
    return client


def _load_unit(unit, reader: CheckpointReader, with_optimizer: bool) -> dict[str, torch.Tensor]:
    """Fill this rank's fp32 master range of ``unit``; returns its per-element optimizer states."""
    start, end, base = held_range(unit)
    kinds = reader.manifest["optimizer"]["state_keys"] if with_optimizer else []
    states = {kind: torch.zeros(unit.master.shape, dtype=reader.state_dtype(kind), device=unit.master.device)
              for kind in kinds}
    with torch.no_grad():
        for slot, s, e in pieces_in(unit, start, end):
            lo, hi = s - slot.offset, e - slot.offset
            unit.master.data[s - base:e - base].copy_(reader.read_range(fmt.MASTER, slot.name, lo, hi))
            for kind, buf in states.items():
                buf[s - base:e - base].copy_(reader.read_range(kind, slot.name, lo, hi))
    return states


def _load_optimizer(optimizer, manifest: dict, states: dict[int, dict[str, torch.Tensor]]) -> None:
    """Hyperparameters per group, then each master's state: per-element tensors plus scalars."""
    saved_groups, scalars = manifest["param_groups"], manifest["optimizer"]["scalars"]
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved_groups)} optimizer parameter groups, "
                              f"this run has {len(optimizer.param_groups)}")
    for g, group in enumerate(optimizer.param_groups):
        for key, value in (saved_groups[g] if saved_groups else {}).items():
            if key in KERNEL_CHOICES:
                continue  # how this run's optimizer executes is its own choice, not the checkpoint's
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        group_scalars = scalars[g] if g < len(scalars) else {}
        for master in group["params"]:
            state = dict(states.get(id(master), {}))
            for key, spec in group_scalars.items():
                if spec.get("tensor"):
                    device = master.device if spec.get("on_param_device") else "cpu"
                    state[key] = torch.tensor(spec["value"], dtype=fmt.dtype_from_name(spec["dtype"]), device=device)
                else:
                    state[key] = spec["value"]
            if state:
                optimizer.state[master] = state


def _load_extra(engine, reader: CheckpointReader) -> None:
    extra = reader.extra()
    copy_unpartitioned(engine, buffers={k.removeprefix("buffer/"): v for k, v in extra.items() if k.startswith("buffer/")},
                       frozen={k.removeprefix("frozen/"): v for k, v in extra.items() if k.startswith("frozen/")})


def copy_unpartitioned(engine, buffers: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]) -> set[str]:
    """Copy buffers and frozen (not partitioned) parameters into the model by name; returns the
    names copied."""
    copied = set()
    unit_params = {id(p) for unit in engine.strategy.units for p in unit.params}
    with torch.no_grad():
        for name, buf in engine.module.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])
                copied.add(name)
        for name, p in engine.module.named_parameters():
            if id(p) not in unit_params and name in frozen:
                p.copy_(frozen[name])
                copied.add(name)
    return copied
