"""ZeRO stages 0-2: one strategy class per stage behind one small interface.

The engine calls, per micro-step: ``begin_backward(boundary)``, autograd, ``end_backward(boundary)``;
at the boundary: ``grad_sq_norm()`` and ``norm_reduction()`` (how the ranks combine it), the
optimizer tier's step on ``grad_shards()`` (which writes each ``unit.local``), ``publish()``,
``zero_grad()``. What a strategy asks of the parts around it -- the optimizer tier, the
checkpointer -- it is given at construction (:class:`StrategyLinks`). Gradients are reduced unit by
unit: a unit is a bucket of parameters (stages 0-2, sized by ``reduce_bucket_size``) or a module
(stage 3, ``stage3.py``).

Note: collectives must be issued in the same order on every rank. Units are reduced when their
last gradient arrives (autograd runs in the same order everywhere) and any unit a rank did not
finish in backward is flushed in unit order by ``end_backward``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from raydeep import comm
from raydeep.zero.flat import FlatUnit


@dataclass(frozen=True)
class ReduceSpec:
    """How gradients are averaged: DeepSpeed's mean/sum, pre/post scaling and comm dtype."""

    world_size: int
    comm_dtype: torch.dtype
    average: bool = True
    prescale: bool = False
    predivide: float = 1.0
    overlap: bool = False

    @property
    def pre_factor(self) -> float:
        if not self.average:
            return 1.0
        return 1.0 / self.world_size if self.prescale else 1.0 / self.predivide

    @property
    def post_factor(self) -> float:
        if not self.average or self.prescale:
            return 1.0
        return self.predivide / self.world_size


def _never() -> bool:
    return False


def _nothing(*args) -> None:
    return None


@dataclass(frozen=True)
class StrategyLinks:
    """What a strategy asks of the parts around it; the builder wires them at construction."""

    #: Before anything writes the masters outside the optimizer step: an asynchronous save may
    #: still be copying them (the checkpointer's copy fence).
    fence: Callable[[], None] = _nothing
    #: The unit indices whose parameters were overwritten outside the step: the optimizer tier
    #: re-reads its masters from them.
    masters_changed: Callable[[list[int]], None] = _nothing
    #: Asked before each backward and at the norm: True when the optimizer tier communicates the
    #: gradients itself this step (compressed communication), so the strategy leaves each rank its own.
    tier_communicates: Callable[[], bool] = _never


class ZeroStrategy:
    """Shared machinery: per-unit gradient-ready counting and pending reductions."""

    stage = -1
    #: True when each rank holds only a shard of the gradients, so the norm needs a SUM all-reduce.
    sharded_grads = True

    def __init__(self, units: list[FlatUnit], reduce: ReduceSpec, stats: comm.CommStats,
                 links: StrategyLinks = StrategyLinks()):
        self.units, self.reduce, self.stats, self.links = units, reduce, stats, links
        self._ready: dict[int, int] = {}
        self._reduced: set[int] = set()
        self._pending: list[tuple[comm.Pending, callable]] = []
        self._hooks_live = False
        self._flushing = False
        self._unit_of = {}
        # Gradients a unit waits for before it is reduced (computed once: the hooks are a hot path).
        self._expected = [sum(1 for p in unit.params if p.requires_grad) for unit in units]
        for i, unit in enumerate(units):
            for p in unit.params:
                if p.requires_grad:
                    self._unit_of[p] = i
                    p.register_post_accumulate_grad_hook(self._on_grad)

    # --- the engine-facing interface -------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._ready.clear()
        self._reduced.clear()
        self._hooks_live = self._reduce_this_micro_step(boundary) and self._reduce_from_hooks()

    def end_backward(self, boundary: bool) -> None:
        self._hooks_live = False
        if self._reduce_this_micro_step(boundary):
            # Backward is over, so nothing is left to overlap: the units still to reduce are all
            # launched before any is waited for, and the process group works through them back
            # to back instead of one round trip at a time.
            self._flushing = True
            for i, unit in enumerate(self.units):  # Note: unit order, identical on every rank
                if i not in self._reduced:
                    self._reduce_unit(i)
            self._flushing = False
        for pending, finish in self._pending:
            pending.wait()
            finish()
        self._pending.clear()

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's gradient shard of each unit, in unit order: what the optimizer tier updates from."""
        return [unit.grad for unit in self.units]

    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's owned gradients: a float64 scalar tensor on their device
        (the engine reduces it there and reads it once per step)."""
        return sum_of_squares(self.grad_shards())

    def norm_reduction(self) -> str | None:
        """How the ranks combine ``grad_sq_norm`` into the norm every rank clips with: ``"sum"``
        over gradient shards; ``"max"`` where each rank holds its own, not-yet-averaged gradients
        (the tier communicates them this step: DeepSpeed clipped each rank by its own norm, which
        can differ, and the largest keeps every rank within the clip and the ranks in agreement);
        None where every rank holds the same reduced gradients."""
        if self.sharded_grads:
            return "sum"
        return "max" if self.links.tier_communicates() else None

    def publish(self) -> None:
        """Make the updated shards (each ``unit.local``) visible as full parameters. At stage 0
        ``local`` is the full buffer itself: nothing to do."""

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad.zero_()

    def memory_breakdown(self) -> dict[str, int]:
        totals = {"params": 0, "grads": 0, "offloaded": 0}
        for unit in self.units:
            for kind, nbytes in unit.memory().items():
                totals[kind] += nbytes
        return totals

    # --- stage-specific ----------------------------------------------------------------------------
    def _reduce_this_micro_step(self, boundary: bool) -> bool:
        return boundary

    def _reduce_from_hooks(self) -> bool:
        return self.reduce.overlap

    def _launch(self, i: int) -> tuple[comm.Pending, callable]:
        """Start reducing unit ``i``'s gradients; returns the pending op and what to do after it."""
        raise NotImplementedError

    # --- gradient readiness -----------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        i = self._unit_of[param]
        self._ready[i] = self._ready.get(i, 0) + 1
        if self._ready[i] == self._expected[i]:
            self._unit_grads_complete(i)

    def _unit_grads_complete(self, i: int) -> None:
        if self._hooks_live:
            self._reduce_unit(i)

    def _reduce_unit(self, i: int) -> None:
        assert i not in self._reduced, f"Gradient computed twice for this partition ({self.units[i].name})"
        self._reduced.add(i)
        pending, finish = self._launch(i)
        if self._async_launch:
            self._pending.append((pending, finish))
        else:
            pending.wait()
            finish()

    @property
    def _async_launch(self) -> bool:
        """Launch reductions without waiting: with ``overlap_comm`` (from the hooks), and for the
        flush after backward (see ``end_backward``)."""
        return self.reduce.overlap or self._flushing

    def _comm_input(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat if flat.dtype == self.reduce.comm_dtype else flat.to(self.reduce.comm_dtype)
        return flat.mul_(self.reduce.pre_factor) if self.reduce.pre_factor != 1.0 else flat


class Stage0(ZeroStrategy):
    """Plain data parallelism (the oracle): full replicas, bucketed all-reduce at the boundary."""

    stage = 0
    sharded_grads = False

    def __init__(self, units, reduce, stats, links: StrategyLinks = StrategyLinks()):
        super().__init__(units, reduce, stats, links)
        _attach_grad_views(units, [u.grad for u in units])

    def _reduce_this_micro_step(self, boundary: bool) -> bool:
        return boundary and not self.links.tier_communicates()

    def begin_backward(self, boundary: bool) -> None:
        _attach_grad_views(self.units, [u.grad for u in self.units])
        super().begin_backward(boundary)

    def _launch(self, i):
        unit = self.units[i]
        buf = self._comm_input(unit.grad if unit.grad.dtype == self.reduce.comm_dtype else unit.grad.clone())
        pending = comm.all_reduce(buf, self.stats, async_op=self._async_launch, owner=unit.name)

        def finish():
            if buf.data_ptr() != unit.grad.data_ptr():
                unit.grad.copy_(buf)
            if self.reduce.post_factor != 1.0:
                unit.grad.mul_(self.reduce.post_factor)
        return pending, finish


class Stage1(ZeroStrategy):
    """Optimizer states partitioned: full gradients accumulate locally, then one reduce-scatter
    per bucket at the boundary; updated shards are all-gathered after the step."""

    stage = 1

    def __init__(self, units, reduce, stats, links: StrategyLinks = StrategyLinks()):
        super().__init__(units, reduce, stats, links)
        self.full_grads = [torch.zeros_like(u.full) for u in units]
        _attach_grad_views(units, self.full_grads)
        for unit, full in zip(units, self.full_grads):
            if unit.grad.dtype == full.dtype:  # keep the reduced shard inside the full buffer: no extra copy
                lo, hi = unit.layout.shard_range(unit.rank)
                unit.grad = full[lo:hi]

    def begin_backward(self, boundary: bool) -> None:
        _attach_grad_views(self.units, self.full_grads)
        super().begin_backward(boundary)

    def _launch(self, i):
        unit = self.units[i]
        full = self.full_grads[i]
        # The reduce-scatter only reads its input: a copy is needed only to scale or convert it.
        plain = full.dtype == self.reduce.comm_dtype and self.reduce.pre_factor == 1.0
        src = full if plain else self._comm_input(full.clone())
        out = torch.empty(unit.layout.shard_numel, dtype=src.dtype, device=src.device)
        pending = comm.reduce_scatter(out, src, self.stats, async_op=self._async_launch, owner=unit.name)
        return pending, lambda: unit.grad.copy_(out.mul_(self.reduce.post_factor))

    def publish(self) -> None:
        _gather_all(self.units, self.stats)

    def zero_grad(self) -> None:
        super().zero_grad()
        for g in self.full_grads:
            g.zero_()

    def memory_breakdown(self) -> dict[str, int]:
        totals = super().memory_breakdown()
        for unit, full in zip(self.units, self.full_grads):
            shared = unit.grad.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            totals["grads"] += full.numel() * full.element_size() - (unit.grad.numel() * unit.grad.element_size() if shared else 0)
        return totals


class Stage2(ZeroStrategy):
    """Optimizer states and gradients partitioned: each bucket is reduce-scattered from the
    backward hooks on every micro-step and accumulated into the owned gradient shard.

    A bucket's gradients are flattened into one of at most :attr:`BUFFERS` reused buffers
    (DeepSpeed's two ``ipg`` buckets with ``overlap_comm``): a new buffer every micro-step would be
    fresh pages to fault in on a CPU and allocator churn on a GPU. When both are in flight, the
    older reduction is finished first."""

    stage = 2
    BUFFERS = 2

    def __init__(self, units, reduce, stats, links: StrategyLinks = StrategyLinks()):
        super().__init__(units, reduce, stats, links)
        self._spare: list[torch.Tensor] = []
        self._buffers = 0

    def _reduce_this_micro_step(self, boundary: bool) -> bool:
        return True

    def _reduce_from_hooks(self) -> bool:
        return True

    def _take_buffer(self, unit: FlatUnit) -> torch.Tensor:
        if not self._spare and self._buffers == self.BUFFERS:
            pending, finish = self._pending.pop(0)  # the oldest reduction in flight gives its buffer back
            pending.wait()
            finish()
        if self._spare:
            return self._spare.pop()
        self._buffers += 1
        largest = max(u.layout.padded_numel for u in self.units)
        return torch.empty(largest, dtype=self.reduce.comm_dtype, device=unit.full.device)

    def _launch(self, i):
        unit = self.units[i]
        buffer = self._take_buffer(unit)
        src = self._comm_input(unit.flat_grads(self.reduce.comm_dtype, out=buffer[:unit.layout.padded_numel]))
        unit.drop_param_grads()  # the full gradient is not kept: that is stage 2's saving
        out = torch.empty(unit.layout.shard_numel, dtype=src.dtype, device=src.device)
        pending = self._reduce_scatter(i, out, src)

        def finish():
            unit.grad.add_(out.to(unit.grad.dtype), alpha=self.reduce.post_factor)
            self._spare.append(buffer)
        return pending, finish

    def _reduce_scatter(self, i: int, out: torch.Tensor, src: torch.Tensor) -> comm.Pending:
        """Sum ``src`` (unit ``i``'s flat gradients) over the ranks into this rank's chunk ``out``."""
        return comm.reduce_scatter(out, src, self.stats, async_op=self._async_launch, owner=self.units[i].name)

    def publish(self) -> None:
        _gather_all(self.units, self.stats)


def _attach_grad_views(units: list[FlatUnit], buffers: list[torch.Tensor]) -> None:
    """Point every ``param.grad`` into its unit's flat gradient buffer, so autograd accumulates
    in place and the boundary reduction needs no flattening copy."""
    for unit, buf in zip(units, buffers):
        for slot, p in zip(unit.layout.slots, unit.params):
            view = buf[slot.offset:slot.offset + slot.numel].view(slot.shape)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view


def _gather_all(units: list[FlatUnit], stats: comm.CommStats) -> None:
    """All-gather every unit's updated shard into its full buffer."""
    for unit in units:
        comm.all_gather(unit.full, unit.local, stats, owner=unit.name)


# Elements converted to float64 at a time by ``sum_of_squares``: on a CPU a chunk that stays in
# cache (converting a 5.3M-element gradient whole, then squaring it into another tensor, took 8x
# as long); on an accelerator, large enough that the loop stays a few launches per step.
NORM_CHUNK = {"cpu": 1 << 16}
NORM_CHUNK_DEFAULT = 1 << 22


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of the tensors' elements, accumulated in float64 (as DeepSpeed's norm is)
    into a float64 scalar on the tensors' device: a CPU accumulator would take a CUDA value in
    place (an error on CUDA) and cost a host synchronization per tensor. Each chunk of
    ``NORM_CHUNK`` elements is converted to float64, squared in place and summed.
    A non-finite element makes the sum non-finite (the overflow check reads it).

    >>> sum_of_squares([torch.ones(3), torch.full((2,), 2.0)]).item()
    11.0
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    chunk = NORM_CHUNK.get(device.type, NORM_CHUNK_DEFAULT)
    for t in tensors:
        flat = t.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            total += flat.narrow(0, start, min(chunk, flat.numel() - start)).double().square_().sum()
    return total
