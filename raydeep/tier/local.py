"""The in-process tiers: the fp32 masters and a ``torch.optim`` optimizer in the rank's own process.

``LocalTier`` keeps them beside the parameters, on the rank's device: the tier every other one is
measured against (the naive reference beside the optimized paths). In fp32 training each unit's
master *is* its shard, so there is no copy.

``HostTier`` is ZeRO-Offload (``offload_optimizer.device: "cpu"``): the masters and optimizer
states live in host memory (pinned with ``pin_memory`` when there is an accelerator), the update
runs on the CPU with torch's fused Adam/AdamW (the multi-tensor path for the others), one
sub-group at a time, and updated parameters are copied back to the device. With ``ratio`` < 1
(stage 3) only the first ``ratio`` of the sub-groups live on the host; the rest stay on the device.

On an accelerator the host tier pipelines the update in pieces of at most ``tile`` elements
(``raydeep.offload_tile_size``; DeepSpeed's ``sub_group_size`` keeps its meaning: how many
elements one optimizer step covers): while the CPU updates piece n, a side stream copies piece
n+1's gradients (model dtype) into a pinned buffer and piece n-1's parameters (model dtype, cast on
the CPU) back to the device. Sub-groups whose masters stay on the device (``ratio`` < 1) are updated
there, on the current stream, and never staged.

Note: ``step`` computes, per element, what the engine did before the tier existed (the gradient
in fp32, times the one scale, the optimizer's update, the master rounded into the model-dtype
shard), so every tier and tiling trains bitwise alike: Adam/AdamW in one pass on the CPU
(``raydeep.tier.pieces``), torch's kernel elsewhere.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from raydeep.tier.base import OptimizerTier, UnitRange
from raydeep.tier.lookahead import look_ahead, rate_buffers, why_not
from raydeep.tier.masters import ALIGN, MasterShards, plan_sub_groups
from raydeep.zero.flat import FlatUnit

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's default: one sub-group for any model that fits a node
# The host tier's transfer piece: 4M elements (8 MB in bf16) keeps PCIe copies near their peak
# bandwidth while a layer-sized shard still splits into several pieces that overlap.
DEFAULT_TILE = 1 << 22


class LocalTier(OptimizerTier):
    """Masters and optimizer states on this rank; ``make_optimizer(param_groups)`` builds the torch
    optimizer over the masters, one group per entry of ``group_options`` (its hyperparameters).
    ``sub_group_size`` tiles the update (``raydeep.tier.masters``)."""

    def __init__(self, units: list[FlatUnit], group_options: list[dict],
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 sub_group_size: int = DEFAULT_SUB_GROUP_SIZE, threads: int | None = None):
        self.units = units
        self.sub_groups = plan_sub_groups([u.local.numel() for u in units], [u.group_index for u in units],
                                          sub_group_size)
        places = self._master_places()
        self.masters = [self._make_master(u, place) for u, place in zip(units, places)]
        chunk_masters = [self.masters[c.unit] if c.numel == units[c.unit].local.numel()
                         else self.masters[c.unit].narrow(0, c.lo, c.numel) for sg in self.sub_groups for c in sg]
        self.shards = MasterShards(self.sub_groups, chunk_masters, group_options, make_optimizer, threads)

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
            self.shards.step_sub_group(k, grads, scale, outs=[self._out(c) for c in sub_group])

    def _out(self, c) -> torch.Tensor | None:
        """Where chunk ``c``'s updated values go in the model dtype: its part of ``unit.local``
        (None where the master is that storage)."""
        unit, master = self.units[c.unit], self.masters[c.unit]
        return None if master is unit.local else unit.local.narrow(0, c.lo, c.numel)

    def _write_params(self, chunks) -> None:
        """Copy the fp32 masters into the model-dtype shards (nothing where they are one)."""
        for c in chunks:
            out = self._out(c)
            if out is not None:
                out.copy_(self.masters[c.unit][c.lo:c.hi], non_blocking=self.masters[c.unit].is_pinned())

    def reload_from_params(self, indices: list[int]) -> None:
        for i in indices:
            master, unit = self.masters[i], self.units[i]
            if master is not unit.local:
                master.copy_(unit.local)

    # --- state over element ranges ------------------------------------------------------------------
    def _export(self, ranges, with_optimizer):
        dtypes, scalars = self.shards.scalars() if with_optimizer else ({}, {})
        return self.shards.export(ranges, with_optimizer), dtypes, scalars

    def _import(self, pieces: list[UnitRange], scalars) -> None:
        self.shards.load(pieces, scalars)
        self._write_params([c for sg in self.sub_groups for c in sg])
        wait_for_copies(self.units)

    # --- accounting ---------------------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        masters = {}
        for unit, master in zip(self.units, self.masters):
            if master is not unit.local:
                place = str(master.device)
                masters[place] = masters.get(place, 0) + master.numel() * 4
        step = dict(self.shards.peak_grad_bytes)
        return {"master": masters, "optimizer_states": self.shards.memory(), "step_buffers": step}


@dataclass(frozen=True)
class Item:
    """One turn of the host tier's pipeline: ``pieces`` (flat chunk index, lo, hi) of sub-group
    ``k``; ``first``: the sub-group's step starts here; ``host``: masters in host memory (staged)."""

    k: int
    pieces: tuple[tuple[int, int, int], ...]
    first: bool
    host: bool


class CudaStreams:
    """The device calls of the host tier's pipeline, in one place so that a test can put a
    recording stand-in in its stead (``HostTier(streams=...)``) and check their order on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device)

    def side_waits_current(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def current_waits_side(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)

    def on_side(self):
        return torch.cuda.stream(self.side)

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy between host and device on the side stream (inside ``on_side``)."""
        dst.copy_(src, non_blocking=True)


class HostTier(LocalTier):
    """ZeRO-Offload to the rank's host memory (see the module docstring)."""

    def __init__(self, units, group_options, make_optimizer, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
                 pin_memory: bool = True, ratio: float = 1.0, tile: int = DEFAULT_TILE, streams=None,
                 threads: int | None = None, delayed: bool = False, lookahead: bool = False):
        self.pin = pin_memory and torch.cuda.is_available()
        self.ratio = ratio
        super().__init__(units, group_options, make_optimizer, sub_group_size, threads)
        # The delayed update runs while the LR schedulers write the next step's values: they
        # write into a holder's groups, and each update takes a copy (as the actor tier does).
        self._holder = make_optimizer([{**o, "params": [nn.Parameter(torch.zeros(1))]} for o in group_options]) \
            if delayed else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="raydeep-update") if delayed else None
        self._pending: Future | None = None
        self._held_back: tuple | None = None  # a submitted update's (scale, hyperparameters) until release()
        self._held_params: list[torch.Tensor] = []  # the delayed update's new parameters, until complete()
        self._held_grads: list[torch.Tensor] = []  # its copy of the gradients
        # With the lookahead (raydeep.tier.lookahead) the update also writes ``base`` and ``rate``;
        # ``rate`` travels to a buffer beside each ``unit.local``.
        self.lookahead = delayed and lookahead
        assert not self.lookahead or why_not(self.shards.optimizer) is None, why_not(self.shards.optimizer)
        self._held_terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rates: list[torch.Tensor] = []
        # The compute device: under offload_param ``unit.local`` is in host memory, ``full`` is not.
        self.device = units[0].full.device if units else torch.device("cpu")
        self.streams = streams or (CudaStreams(self.device) if self.device.type == "cuda" else None)
        self.items = self._plan(max(ALIGN, tile // ALIGN * ALIGN))
        self._grad_staging: list[torch.Tensor | None] = [None, None]  # pinned, reused: by item parity
        self._out_staging: list[torch.Tensor | None] = [None, None]
        self._written: list = [None, None]  # the event of the last copy out of each out buffer
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

    def _plan(self, tile: int) -> list[Item]:
        """The pipeline's items: with Adam/AdamW, each host chunk cut into pieces of at most
        ``tile`` elements (cuts ``ALIGN`` apart, as sub-groups are) and each device chunk whole;
        with any other optimizer, one item per sub-group (its step is one ``optimizer.step()``)."""
        items, i = [], 0
        for k, sub_group in enumerate(self.sub_groups):
            indices = list(range(i, i + len(sub_group)))
            i += len(sub_group)
            on_host = [self.masters[c.unit].device.type == "cpu" for c in sub_group]
            if self.shards.pieces is None:
                items.append(Item(k, tuple((n, 0, c.numel) for n, c in zip(indices, sub_group)), True, any(on_host)))
                continue
            first = True
            for n, c, host in zip(indices, sub_group, on_host):
                cuts = range(0, c.numel, tile) if host else range(0, c.numel, c.numel or 1)
                for lo in cuts:
                    hi = min(c.numel, lo + tile) if host else c.numel
                    items.append(Item(k, ((n, lo, hi),), first, host))
                    first = False
        return items

    # --- hyperparameters: the holder's, under the delayed update ---------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self._holder.param_groups if self._holder is not None else self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self._holder.defaults if self._holder is not None else self.optimizer.defaults

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self._holder if self._holder is not None else self.optimizer

    def _frozen_hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    # --- the delayed parameter update (raydeep.delayed_update) -----------------------------------------
    @property
    def pending(self) -> bool:
        return self._pending is not None or self._held_back is not None

    def submit(self, grad_shards, scale) -> None:
        """Land the pending update, and take this step's: the gradients are copied (the engine
        clears them next) and the hyperparameters frozen; it starts at ``release`` (after the
        all-gather) and its parameters reach ``unit.local`` only at the next ``submit`` or
        ``complete``, so the next forward and backward run on the current ones meanwhile. With
        the lookahead, the pending update lands as ``base - rate * gradient`` instead."""
        assert self._worker is not None, "built without delayed=True"
        if self.lookahead and self.pending:
            self._land_lookahead(grad_shards, scale)
        else:
            self.complete()
        if not self._held_grads:
            self._held_grads = [torch.empty(u.local.numel(), dtype=g.dtype, pin_memory=self.pin)
                                for u, g in zip(self.units, grad_shards)]
            self._held_params = [torch.empty(u.local.numel(), dtype=u.local.dtype, pin_memory=self.pin)
                                 for u in self.units]
            if self.lookahead:
                self._held_terms = [tuple(torch.empty(u.local.numel(), dtype=u.local.dtype, pin_memory=self.pin)
                                          for _ in range(2)) for u in self.units]
                self._rates = rate_buffers([u.local for u in self.units])
        for held, grad in zip(self._held_grads, grad_shards):
            held.copy_(grad)  # synchronous: the gradients are cleared after this step
        self._held_back = (scale, self._frozen_hyperparameters())

    def release(self) -> None:
        if self._held_back is not None:
            (scale, hyper), self._held_back = self._held_back, None
            self._pending = self._worker.submit(self._update_held, scale, hyper)

    def _update_held(self, scale: float, hyper: list[dict]) -> None:
        began = time.perf_counter()
        self.shards.set_hyperparameters(hyper)
        self.shards.peak_grad_bytes = {}
        for k, sub_group in enumerate(self.sub_groups):
            terms = [tuple(t.narrow(0, c.lo, c.numel) for t in self._held_terms[c.unit])
                     for c in sub_group] if self.lookahead else None
            self.shards.step_sub_group(
                k, [self._held_grads[c.unit].narrow(0, c.lo, c.numel) for c in sub_group], scale, writable=False,
                outs=[self._held_params[c.unit].narrow(0, c.lo, c.numel) for c in sub_group], terms=terms)
        self.timings["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - began

    def complete(self) -> None:
        """Wait for the submitted update, if any, and write its parameters into ``unit.local``."""
        self.release()
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.result()
        for unit, held in zip(self.units, self._held_params):
            unit.local.copy_(held, non_blocking=held.is_pinned())
        wait_for_copies(self.units)

    def _land_lookahead(self, grad_shards, scale) -> None:
        """Wait for the submitted update and set each ``unit.local`` to its ``base - rate *
        gradient`` (``raydeep.tier.lookahead``) from this step's gradients."""
        self.release()
        pending, self._pending = self._pending, None
        pending.result()
        for unit, (base, rate), on_device, grad in zip(self.units, self._held_terms, self._rates, grad_shards):
            look_ahead(unit.local, base, rate, on_device, grad, scale)
        wait_for_copies(self.units)  # the pinned terms are rewritten by the next update

    def close(self) -> None:
        self.complete()
        if self._worker is not None:
            self._worker.shutdown()

    def report(self) -> dict:
        held = self.memory()
        steps = max(1, self.timings["steps"])
        return {"tier": "host", "bytes_held": sum(held["master"].values()) + sum(held["optimizer_states"].values()),
                "step_s": self.timings["step_s"] / steps}

    def step(self, grad_shards, scale):
        began = time.perf_counter()
        self.complete()
        if self._holder is not None:
            self.shards.set_hyperparameters(self._frozen_hyperparameters())
        self._step(grad_shards, scale)
        self.timings["steps"] += 1
        self.timings["step_s"] += time.perf_counter() - began

    def _step(self, grad_shards, scale):
        if self.streams is None:  # a CPU rank: the gradients are in host memory already
            super().step(grad_shards, scale)
            return
        self.shards.peak_grad_bytes = {}
        s = self.streams
        s.side_waits_current()  # the reduced gradients are ready
        staged = self._stage(0, grad_shards)
        for n, item in enumerate(self.items):
            grads, ready = staged
            if n + 1 < len(self.items):
                staged = self._stage(n + 1, grad_shards)  # in flight while the CPU works on item n
            if ready is not None:
                ready.synchronize()
            outs = self._outs(n, item)
            self._update(item, grads, scale, outs)
            if item.host:
                self._write_back(n, item, outs)
        s.current_waits_side()  # the published parameters are the ones written back

    def _update(self, item: Item, grads, scale, outs) -> None:
        if self.shards.pieces is None:
            self.shards.step_sub_group(item.k, grads, scale, writable=False, outs=outs)
            return
        if item.first:
            self.shards.begin(item.k)
        for (i, lo, hi), grad, out in zip(item.pieces, grads, outs):
            self.shards.update_piece(i, lo, hi, grad, scale, out)

    def _target(self, i: int, lo: int, hi: int) -> torch.Tensor:
        c = self.shards.chunks[i]
        return self.units[c.unit].local.narrow(0, c.lo + lo, hi - lo)

    def _stage(self, n: int, grad_shards) -> tuple[list[torch.Tensor], object]:
        """Start copying item n's host gradients into a pinned buffer on the side stream; device
        gradients are read where they are. Returns the views and the copy's event (None: none)."""
        item, views, offset = self.items[n], [], 0
        host = [self.masters[self.shards.chunks[i].unit].device.type == "cpu" for i, _, _ in item.pieces]
        grads = []
        for i, lo, hi in item.pieces:
            c = self.shards.chunks[i]
            grads.append(grad_shards[c.unit].narrow(0, c.lo + lo, hi - lo))
        if not any(host):
            return grads, None
        buf = self._buffer(self._grad_staging, n % 2, grads[0].dtype)
        with self.streams.on_side():
            for grad, on_host in zip(grads, host):
                if on_host and grad.device.type != "cpu":
                    view = buf[offset:offset + grad.numel()]
                    self.streams.copy(view, grad)
                    offset += grad.numel()
                    grad = view
                views.append(grad)
            event = self.streams.record()
        return views, event

    def _outs(self, n: int, item: Item) -> list[torch.Tensor | None]:
        """Where item n's new values go: a pinned buffer for a host master whose parameter is on
        the device (copied over by ``_write_back``), else the parameter itself (None: the master
        is the parameter)."""
        outs, offset, buf = [], 0, None
        for i, lo, hi in item.pieces:
            c = self.shards.chunks[i]
            target, master = self._target(i, lo, hi), self.masters[c.unit]
            if master is self.units[c.unit].local:
                outs.append(None)
            elif master.device.type == "cpu" and target.device.type != "cpu":
                if buf is None:
                    if self._written[n % 2] is not None:
                        self._written[n % 2].synchronize()  # its last copy to the device has read it
                    buf = self._buffer(self._out_staging, n % 2, target.dtype)
                outs.append(buf[offset:offset + hi - lo])
                offset += hi - lo
            else:
                outs.append(target)
        return outs

    def _write_back(self, n: int, item: Item, outs) -> None:
        """Copy item n's host-computed parameters to the device on the side stream."""
        copies = [(self._target(i, lo, hi), out) for (i, lo, hi), out in zip(item.pieces, outs)
                  if out is not None and out.device.type == "cpu" and self._target(i, lo, hi).device.type != "cpu"]
        if not copies:
            return
        with self.streams.on_side():
            for target, out in copies:
                self.streams.copy(target, out)
            self._written[n % 2] = self.streams.record()

    def _buffer(self, buffers: list, parity: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned staging buffer as large as the largest item's host part, reused every step."""
        buf = buffers[parity]
        if buf is None or buf.dtype != dtype:
            size = max((sum(hi - lo for _, lo, hi in it.pieces) for it in self.items if it.host), default=0)
            buf = buffers[parity] = self.streams.pinned(size, dtype)
        return buf

    def memory(self):
        held = super().memory()
        staging = sum(b.numel() * b.element_size()
                      for b in self._grad_staging + self._out_staging + self._held_grads + self._held_params
                      + [t for terms in self._held_terms for t in terms] if b is not None)
        if staging:
            held["step_buffers"]["cpu"] = held["step_buffers"].get("cpu", 0) + staging
        for rate in (r for r in self._rates if r is not None):  # the lookahead's, on the device
            place = str(rate.device)
            held["step_buffers"][place] = held["step_buffers"].get(place, 0) + rate.numel() * rate.element_size()
        return held


def wait_for_copies(units: list[FlatUnit]) -> None:
    """Wait for non-blocking host-to-device parameter copies before anyone reads them."""
    if units and units[0].local.device.type == "cuda":
        torch.cuda.current_stream(units[0].local.device).synchronize()
