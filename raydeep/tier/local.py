"""The in-process tiers: the fp32 masters and a ``torch.optim`` optimizer in the rank's own process.

``LocalTier`` keeps them beside the parameters, on the rank's device: the tier every other one is
measured against (the naive reference beside the optimized paths). In fp32 training each unit's
master *is* its shard, so there is no copy.

``HostTier`` is ZeRO-Offload (``offload_optimizer.device: "cpu"``): the masters and optimizer
states live in host memory (pinned with ``pin_memory`` when there is an accelerator), the update
runs on the CPU with torch's fused Adam/AdamW (the multi-tensor path for the others), one
sub-group at a time, and updated parameters are copied back to the device. With ``ratio`` < 1
(stage 3) only the first ``ratio`` of the sub-groups live on the host; the rest stay on the device.

Note: ``step`` does what the engine did before the tier existed, in the same order per element
(cast or copy the gradient to fp32, multiply by the one scale, the optimizer's update, copy the
master into the model-dtype shard), so the local tier trains bitwise as before and the host tier
computes the same bits on a CPU rank.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from raydeep.tier.base import OptimizerTier, UnitRange
from raydeep.tier.masters import MasterShards, plan_sub_groups
from raydeep.zero.flat import FlatUnit

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default: one sub-group for any model that fits a node


class LocalTier(OptimizerTier):
    """Masters and optimizer states on this rank; ``make_optimizer(param_groups)`` builds the torch
    optimizer over the masters, one group per entry of ``group_options`` (its hyperparameters).
    ``sub_group_size`` tiles the update (``raydeep.tier.masters``)."""

    def __init__(self, units: list[FlatUnit], group_options: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE):
        self.units = units
        self.sub_groups = plan_sub_groups([u.local.numel() for u in units], [u.group_index for u in units],
                                          sub_group_size)
        places = self._master_places()
        self.masters = [self._make_master(u, place) for u, place in zip(units, places)]
        chunk_masters = [self.masters[c.unit] if c.numel == units[c.unit].local.numel()
                         else self.masters[c.unit][c.lo:c.hi] for sg in self.sub_groups for c in sg]
        self.shards = MasterShards(self.sub_groups, chunk_masters, group_options, make_optimizer)

    def _master_places(self) -> list[torch.device]:
        return [u.full.device for u in self.units]  # the compute device, even where offload_param keeps ``local``

    def _make_master(self, unit: FlatUnit, place: torch.device) -> torch.Tensor:
        # In fp32 training on the parameters' device the master is the shard itself (no copy).
        if unit.dtype == torch.float32 and place == unit.local.device:
            return unit.local
        return unit.local.detach().to(place, torch.float32, copy=True)

    # --- DeepSpeed's optimizer surface: what user code reads from engine.optimizer ----------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.shards.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # the same dicts: a write reaches the next step

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        """The torch optimizer's per-chunk state (DeepSpeed's ZeRO optimizers expose it too)."""
        return self.optimizer.state

    @property
    def optimizer_name(self) -> str:
        return type(self.optimizer).__name__

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    # --- the update -------------------------------------------------------------------------------
    def step(self, grad_shards: list[torch.Tensor], scale: float) -> None:
        self.shards.peak_grad_bytes = {}
        for k, sub_group in enumerate(self.sub_groups):
            grads = [grad_shards[c.unit][c.lo:c.hi] for c in sub_group]
            self.shards.step_sub_group(k, grads, scale)
            self._write_params(sub_group)

    def _write_params(self, chunks) -> None:
        """Copy updated fp32 masters into the model-dtype shards (nothing where they are one)."""
        for c in chunks:
            unit, master = self.units[c.unit], self.masters[c.unit]
            if master.data_ptr() != unit.local.data_ptr():
                unit.local[c.lo:c.hi].copy_(master[c.lo:c.hi], non_blocking=master.is_pinned())

    def reload_from_params(self, indices: list[int]) -> None:
        for i in indices:
            master, unit = self.masters[i], self.units[i]
            if master.data_ptr() != unit.local.data_ptr():
                master.copy_(unit.local)

    # --- state over element ranges ------------------------------------------------------------------
    def _export(self, ranges, with_optimizer):
        dtypes, scalars = self.shards.scalars() if with_optimizer else ({}, {})
        return self.shards.export(ranges, with_optimizer), dtypes, scalars

    def _import(self, pieces: list[UnitRange], scalars) -> None:
        self.shards.load(pieces, scalars)
        self._write_params([c for sg in self.sub_groups for c in sg])
        _sync(self.units)

    # --- accounting ---------------------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        masters = {}
        for unit, master in zip(self.units, self.masters):
            if master.data_ptr() != unit.local.data_ptr():
                place = str(master.device)
                masters[place] = masters.get(place, 0) + master.numel() * 4
        step = dict(self.shards.peak_grad_bytes)
        return {"master": masters, "optimizer_states": self.shards.memory(), "step_buffers": step}


class HostTier(LocalTier):
    """ZeRO-Offload to the rank's host memory (see the module docstring).

    Note: on an accelerator, ``step`` pipelines the sub-groups: while the CPU updates sub-group k,
    a side stream copies sub-group k+1's gradients into a pinned staging buffer and sub-group
    k-1's parameters back to the device. Each staging buffer is reused only after the event of
    the copy that last read or wrote it.
    """

    def __init__(self, units, group_options, make_optimizer, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
                 pin_memory: bool = True, ratio: float = 1.0):
        self.pin = pin_memory and torch.cuda.is_available()
        self.ratio = ratio
        super().__init__(units, group_options, make_optimizer, sub_group_size)
        self.device = units[0].local.device if units else torch.device("cpu")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: dict[int, torch.Tensor] = {}
        self.timings = {"steps": 0, "step_s": 0.0}

    def _master_places(self) -> list[torch.device]:
        # ``ratio``: the units of the first ceil(ratio x sub-groups) sub-groups go to the host.
        offloaded = math.ceil(self.ratio * len(self.sub_groups))
        host = {c.unit for sg in self.sub_groups[:offloaded] for c in sg}
        return [torch.device("cpu") if i in host else u.full.device for i, u in enumerate(self.units)]

    def _make_master(self, unit, place):
        if place.type != "cpu":
            return super()._make_master(unit, place)
        master = torch.empty(unit.local.numel(), dtype=torch.float32, pin_memory=self.pin)
        return master.copy_(unit.local)

    def report(self) -> dict:
        held = self.memory()
        steps = max(1, self.timings["steps"])
        return {"tier": "host", "bytes_held": sum(held["master"].values()) + sum(held["optimizer_states"].values()),
                "step_s": self.timings["step_s"] / steps}

    def step(self, grad_shards, scale):
        began = time.perf_counter()
        self._step(grad_shards, scale)
        self.timings["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - began

    def _step(self, grad_shards, scale):
        if self._stream is None:  # a CPU rank: the gradients are already in host memory
            super().step(grad_shards, scale)
            return
        self.shards.peak_grad_bytes = {}
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduced gradients are ready
        staged = self._stage(0, grad_shards)
        for k, sub_group in enumerate(self.sub_groups):
            grads, ready = staged
            if k + 1 < len(self.sub_groups):
                staged = self._stage(k + 1, grad_shards)  # copies while the CPU works on sub-group k
            ready.synchronize()
            self.shards.step_sub_group(k, grads, scale)
            with torch.cuda.stream(self._stream):
                self._write_params(sub_group)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _stage(self, k: int, grad_shards) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Start copying sub-group k's gradients into pinned host memory on the side stream."""
        chunks = self.sub_groups[k]
        dtype = grad_shards[chunks[0].unit].dtype
        numel = sum(c.numel for c in chunks)
        buf = self._staging.get(k % 2)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            size = max(sum(c.numel for c in sg) for sg in self.sub_groups)
            buf = self._staging[k % 2] = torch.empty(size, dtype=dtype, pin_memory=True)
        views, offset = [], 0
        with torch.cuda.stream(self._stream):
            for c in chunks:
                grad = grad_shards[c.unit][c.lo:c.hi]
                view = buf[offset:offset + c.numel] if grad.device.type == "cuda" else grad
                if grad.device.type == "cuda":
                    view.copy_(grad, non_blocking=True)
                views.append(view)
                offset += c.numel
            event = torch.cuda.Event()
            event.record(self._stream)
        return views, event

    def memory(self):
        held = super().memory()
        staging = sum(b.numel() * b.element_size() for b in self._staging.values())
        if staging:
            held["step_buffers"]["cpu"] = held["step_buffers"].get("cpu", 0) + staging
        return held


def _sync(units: list[FlatUnit]) -> None:
    """Wait for non-blocking host-to-device parameter copies before anyone reads them."""
    if units and units[0].local.device.type == "cuda":
        torch.cuda.current_stream(units[0].local.device).synchronize()
