"""Pure shard math: how a unit's parameters are laid out in one flat buffer and split evenly
across ranks. No process group is needed, so reshard plans and tests use it directly.

A unit's parameters are concatenated in order and padded to a multiple of the world size; rank
``r`` owns the contiguous range ``[r * S, (r + 1) * S)`` with ``S = padded / world``. Because the
layout is recorded per parameter (name, shape, offset), any rank's range maps back to slices of
named parameters, which is what makes checkpoints loadable on another world size.

>>> layout = UnitLayout.build([("w", (2, 3)), ("b", (3,))], world_size=4)
>>> layout.numel, layout.padded_numel, layout.shard_numel
(9, 12, 3)
>>> [(s.name, lo, hi) for s, lo, hi in layout.pieces_of_rank(1)]
[('w', 3, 6)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    """A flat, padded buffer of parameters partitioned evenly across ``world_size`` ranks."""

    slots: tuple[Slot, ...]
    world_size: int

    @staticmethod
    def build(named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> "UnitLayout":
        slots, offset = [], 0
        for name, shape in named_shapes:
            slots.append(Slot(name, tuple(shape), offset))
            offset += math.prod(shape)
        return UnitLayout(tuple(slots), world_size)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        return math.ceil(self.numel / self.world_size) * self.world_size if self.numel else 0

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces_of_rank(self, rank: int) -> list[tuple[Slot, int, int]]:
        """(slot, start, end) element ranges *within each parameter* that ``rank`` owns."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for slot in self.slots:
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                pieces.append((slot, start - slot.offset, end - slot.offset))
        return pieces


def plan_buckets(sizes: list[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive items into buckets of at most ``bucket_numel`` elements.

    An item larger than the bucket gets a bucket of its own, as DeepSpeed's IPG buckets do.

    >>> plan_buckets([4, 4, 4, 10, 1], 8)
    [[0, 1], [2], [3], [4]]
    """
    buckets: list[list[int]] = []
    current, filled = [], 0
    for i, size in enumerate(sizes):
        if current and filled + size > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets
