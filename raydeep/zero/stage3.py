"""ZeRO stage 3: parameters partitioned too, gathered per module just in time.

Each *partition unit* (by default one transformer block; the root module keeps the leftover
parameters) owns FlatUnits whose full buffers exist only while the module runs. Parameters at
or below ``stage3_param_persistence_threshold`` elements live in *persistent* units that stay
gathered (re-gathered after every step), as in DeepSpeed.

Note: ordering. The first training micro-step records the order in which units are fetched
(forward pre-hooks, then pre-backward hooks on module outputs). Later micro-steps follow that
trace: after fetching position k, the next units are all-gathered asynchronously while the
elements in flight stay under ``min(stage3_prefetch_bucket_size, stage3_max_live_parameters -
live)``. A unit is kept after its forward if the trace shows it is needed again within
``stage3_max_reuse_distance`` elements. A fetch order that deviates from the trace drops
prefetching until the next micro-step re-records it. Every rank makes the same decisions from
the same trace, so the collectives stay matched.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from raydeep import comm
from raydeep.zero import owners, qgz
from raydeep.zero.flat import FlatUnit, ShardState
from raydeep.zero.hierarchy import ZeroPlusPlus
from raydeep.zero.strategy import Stage2, StrategyLinks, _gather_all

logger = logging.getLogger("raydeep")


@dataclass(frozen=True)
class PrefetchPolicy:
    prefetch_bucket_size: int
    max_live_parameters: int
    max_reuse_distance: int


class Stage3(Stage2):
    """Stage 2 plus partitioned parameters fetched and released around each module."""

    stage = 3

    def __init__(self, units: list[FlatUnit], reduce, stats, module_units: list[tuple[nn.Module, list[int]]],
                 persistent: set[int], policy: PrefetchPolicy, links: StrategyLinks = StrategyLinks(),
                 plus: ZeroPlusPlus = ZeroPlusPlus()):
        super().__init__(units, reduce, stats, links)
        self.module_units, self.persistent, self.policy, self.plus = module_units, persistent, policy, plus
        for i, unit in enumerate(units):
            owners.register(unit.params, self)  # lets zero.GatheredParameters find the owner
            if i not in persistent:
                unit.reshard()
                # Persistent units are gathered once per step, exactly: ZeRO++ spares the per-module gathers.
                trained = any(p.requires_grad for p in unit.params)
                unit.use_zero_plus_plus(plus.hpz, plus.quantize_weights if trained else plus.quantize_frozen_weights)
        # qgZ's group size per unit, fixed by its layout: worked out once, not on every reduce-scatter
        self._qgz_groups = [qgz.group_values([slot.shape for slot in u.layout.slots], u.layout.world_size)
                            for u in units] if plus.qgz else []
        self.trace: list[int] = []
        self.trace_complete = False
        self.position = 0
        self.in_backward = False
        self._bwd_fetched: set[int] = set()
        for m, (module, _) in enumerate(module_units):
            module.register_forward_pre_hook(self._make_pre_forward(m))
            module.register_forward_hook(self._make_post_forward(m))

    # --- hooks --------------------------------------------------------------------------------------
    def _make_pre_forward(self, m: int):
        def hook(module, args):
            self.fetch(m)
        return hook

    def _make_post_forward(self, m: int):
        def hook(module, args, output):
            if not self.in_backward:  # a recompute inside backward keeps its params for backward
                self.release(m)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad, m=m: self._pre_backward(m))
            return output
        return hook

    def _pre_backward(self, m: int) -> None:
        if m not in self._bwd_fetched:
            self._bwd_fetched.add(m)
            self.fetch(m)

    # --- the fetch/release coordinator ------------------------------------------------------------
    def fetch(self, m: int) -> None:
        """Make module ``m``'s parameters available, then prefetch along the trace."""
        self._follow_trace(m)
        for i in self.module_units[m][1]:
            self._gather(i, async_op=False)
        if self.trace_complete:
            self._prefetch()

    def release(self, m: int) -> None:
        if self.trace_complete and self._reuse_distance(m) <= self.policy.max_reuse_distance:
            return
        for i in self.module_units[m][1]:
            if i not in self.persistent:
                self.units[i].reshard()

    def _gather(self, i: int, async_op: bool) -> None:
        self.units[i].unshard(self.stats, async_op)

    def _follow_trace(self, m: int) -> None:
        if not self.trace_complete:
            self.trace.append(m)
            return
        if self.position >= len(self.trace) or self.trace[self.position] != m:
            expected = self.trace[self.position] if self.position < len(self.trace) else "end of trace"
            logger.warning("Invalidate trace cache @ step %d: expected module %s, but got module %s",
                           self.position, expected, m)
            self._wait_all_prefetches()
            self.trace, self.trace_complete = [m], False
            return
        self.position += 1

    def _live_numel(self) -> int:
        return sum(u.numel for i, u in enumerate(self.units)
                   if u.state is not ShardState.SHARDED and i not in self.persistent)

    def _prefetch(self) -> None:
        budget = min(self.policy.prefetch_bucket_size, self.policy.max_live_parameters - self._live_numel())
        for m in self.trace[self.position:]:
            for i in self.module_units[m][1]:
                unit = self.units[i]
                if unit.state is not ShardState.SHARDED or i in self.persistent:
                    continue
                if unit.numel > budget:
                    return
                budget -= unit.numel
                self._gather(i, async_op=True)

    def _reuse_distance(self, m: int) -> float:
        """Elements fetched between now and module ``m``'s next use in the trace."""
        distance = 0
        for nxt in self.trace[self.position:]:
            if nxt == m:
                return distance
            distance += sum(self.units[i].numel for i in self.module_units[nxt][1])
        return float("inf")

    def _wait_all_prefetches(self) -> None:
        for unit in self.units:
            unit.wait()

    # --- the strategy interface ------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        super().begin_backward(boundary)
        self.in_backward = True
        self._bwd_fetched.clear()

    def end_backward(self, boundary: bool) -> None:
        self.in_backward = False
        super().end_backward(boundary)
        self._wait_all_prefetches()
        self.release_all()
        if not self.trace_complete and self.trace:
            self.trace_complete = True
        self.position = 0

    def _launch(self, i: int):
        unit = self.units[i]
        result = super()._launch(i)
        if i not in self.persistent and unit.state is ShardState.UNSHARDED:
            unit.reshard()  # its backward is done: every gradient of the unit has arrived
        return result

    def _reduce_scatter(self, i: int, out: torch.Tensor, src: torch.Tensor) -> comm.Pending:
        if self.plus.qgz is None or i in self.persistent:
            return super()._reduce_scatter(i, out, src)
        qgz.reduce_scatter_sum(out, src, *self.plus.qgz, self._qgz_groups[i], self.stats, owner=self.units[i].name)
        return comm.Pending(None, None, "quantized_reduce_scatter")  # done: synchronous

    def release_all(self) -> None:
        for i, unit in enumerate(self.units):
            if i not in self.persistent and unit.state is ShardState.UNSHARDED:
                unit.reshard()  # a prefetch still in flight is left to finish

    def publish(self) -> None:
        # Non-persistent units are gathered when their module next runs, from the new shards.
        for unit in self.units:
            unit.invalidate_secondary()
        _gather_all([self.units[i] for i in sorted(self.persistent)], self.stats)

    def gathered(self, params: list[nn.Parameter]):
        """Context manager gathering the units holding ``params`` (see ``raydeep.zero.GatheredParameters``)."""
        wanted = {id(p) for p in params}  # identity: tensor == would compare (freed) values
        return _Gathered(self, {i for i, u in enumerate(self.units) if any(id(p) in wanted for p in u.params)})


class _Gathered:
    def __init__(self, strategy: Stage3, indices: set[int]):
        self.strategy, self.indices = strategy, sorted(indices)

    def __enter__(self):
        for i in self.indices:
            self.strategy.units[i].unshard(self.strategy.stats, exact=True)  # never ZeRO++'s quantized weights
        return self

    def write_back(self, src_rank: int) -> None:
        """After a modification on ``src_rank``, broadcast it and keep each rank's shard."""
        self.strategy.links.fence()  # an asynchronous save may still be copying the masters
        for i in self.indices:
            unit = self.strategy.units[i]
            comm.broadcast(unit.full, src_rank, self.strategy.stats, owner=unit.name)
            lo, hi = unit.layout.shard_range(unit.rank)
            unit.local.copy_(unit.full[lo:hi])
            unit.invalidate_secondary()
        self.strategy.links.masters_changed(self.indices)

    def __exit__(self, *exc):
        for i in self.indices:
            if i not in self.strategy.persistent:
                self.strategy.units[i].reshard()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    return []
