"""Reduce-scatter and all-gather on gloo as direct exchanges: one send and one receive per peer.

gloo's own ``reduce_scatter`` and ``all_gather`` are slower than its ``all_reduce`` of the same
tensor, although they move half its bytes (``reference/performance-anchors.md`` §7). The same data
movement as point-to-point sends is what the ring algorithm would cost: on 2 ranks, 5.3M fp32
elements, a reduce-scatter took 15 ms this way against 32 ms for gloo's and an all-gather about
half of gloo's (``python -m benchmarks.gloo_collectives`` prints both, measured in the same run).
:mod:`raydeep.comm` uses these on gloo groups only; NCCL's collectives are the fast path there.

Each rank sends chunk ``j`` of its input to rank ``j`` and receives its own chunk from every
peer, then adds the ``world`` chunks in rank order: every rank adds in the same order, whatever its
own rank, so no rank's chunk is rounded differently from how another rank would round it. Sends and receives are
matched in the order they are posted, per pair of ranks, which is the order the collectives are
issued on every rank (the same rule as for collectives).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Exchange:
    """An in-flight exchange: ``wait()`` waits for its sends and receives, then finishes it (the
    sum of a reduce-scatter). Quacks like the ``Work`` a torch collective returns."""

    def __init__(self, works: list, finish=None):
        self.works, self.finish = works, finish

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.works = []
        return True


def _peers(group) -> tuple[int, int, list[int]]:
    """(world, this rank in ``group``, each group rank's global rank)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = list(range(world)) if group is None else [dist.get_global_rank(group, r) for r in range(world)]
    return world, me, ranks


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> Exchange:
    """Sum ``input`` (contiguous, ``world x output.numel()`` elements) over the ranks and keep this
    rank's chunk in ``output``; ``input`` is only read."""
    world, me, ranks = _peers(group)
    chunks = input.view(world, -1)
    received = torch.empty((max(world - 1, 1), chunks.shape[1]), dtype=input.dtype, device=input.device)
    row = {}  # peer -> its row of ``received``: its copy of this rank's chunk
    works = []
    for peer in range(world):
        if peer != me:
            row[peer] = received[len(row)]
            works.append(dist.irecv(row[peer], ranks[peer], group=group))
            works.append(dist.isend(chunks[peer], ranks[peer], group=group))

    def finish() -> None:
        addends = [row.get(r, chunks[me]) for r in range(world)]
        if world == 1:
            output.copy_(addends[0])
            return
        torch.add(addends[0], addends[1], out=output)
        for addend in addends[2:]:
            output.add_(addend)
    return Exchange(works, finish)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> Exchange:
    """Write every rank's ``input`` into its chunk of ``output`` (contiguous, ``world`` chunks).
    ``input`` may be this rank's chunk of ``output`` itself (then nothing is copied)."""
    world, me, ranks = _peers(group)
    rows = output.view(world, -1)
    mine = rows[me]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.reshape(-1))
    works = []
    for peer in range(world):
        if peer != me:
            works.append(dist.irecv(rows[peer], ranks[peer], group=group))
            works.append(dist.isend(mine, ranks[peer], group=group))
    return Exchange(works)
