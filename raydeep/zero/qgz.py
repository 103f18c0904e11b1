"""qgZ: ZeRO++'s quantized gradient reduce-scatter, DeepSpeed's ``all_to_all_quant_reduce``.

Instead of a reduce-scatter over all ranks (each gradient element crosses the network in the
communication dtype), each rank quantizes its gradient to int4 in groups, sends each node peer
the partitions that peer's column of ranks owns (an all-to-all inside the node), sums what it
received and re-quantizes it to int4, then sends each other node the partition its rank owns (an
all-to-all across nodes, carrying ``1/ranks_per_node`` of the data). The kernels' arithmetic is
DeepSpeed's, reproduced in :mod:`raydeep.zero.quantize` (swizzled quantization, the fp16
dequantize-sum-requantize, int4 packing).

What is raydeep's here:

- **Flat units.** DeepSpeed quantizes each parameter's gradient with one group per row of the
  weight (``max(rows, cols, world)`` groups) and scatters it by parameter partitions. raydeep
  reduces a unit's flat gradient buffer, whose rank ``r`` owns the contiguous ``r``-th chunk, so
  each chunk is one partition of ``k`` groups of at most the group DeepSpeed would give the
  unit's largest weight (:func:`group_values`: its shorter side, e.g. the hidden size), padded
  with zeros to whole groups of 8-value loads; the padding is dropped at the end.
- **The sum, then the average.** DeepSpeed's last step is ``sum(node chunks) / nodes``, which makes
  its quantized gradients ``ranks_per_node`` times the average (its 1-D gradients, reduce-scattered
  plainly, are the average). raydeep keeps DeepSpeed's fp16 sum of the node chunks and leaves the
  division to the strategy's post-scaling (``1/world``), as for every reduce-scatter: the gradient
  is the average, whatever path it took, so clipping sees the norm it would without qgZ.
- Units of persistent (small, mostly 1-D) parameters take the plain reduce-scatter, as DeepSpeed's
  1-D parameters do.
"""
from __future__ import annotations

import math

import torch

from raydeep import comm
from raydeep.zero import quantize
from raydeep.zero.hierarchy import Block

def group_values(shapes: list[tuple[int, ...]], world: int) -> int:
    """Values per quantization group for a unit: DeepSpeed's for its largest parameter of two or
    more dimensions, ``numel / max(rows, cols, world)`` (a row of a weight), at least 8; 2048 for a
    unit of vectors only.

    >>> group_values([(192, 64), (192,), (64, 64)], world=4)
    64
    """
    weights = [s for s in shapes if len(s) >= 2]
    if not weights:
        return 2048
    largest = max(weights, key=math.prod)
    return max(quantize.HALVES_PER_LOAD, math.prod(largest) // max(largest[0], largest[1], world))


def partition_groups(shard: int, group: int) -> tuple[int, int]:
    """(groups per rank's partition, values per group) for a shard of ``shard`` values: the fewest
    groups of at most ``group`` values, each a whole number of 8-value loads.

    >>> partition_groups(5000, 2048)
    (3, 1672)
    """
    groups = max(1, math.ceil(shard / group))
    return groups, -(-shard // (groups * quantize.HALVES_PER_LOAD)) * quantize.HALVES_PER_LOAD


def reduce_scatter_sum(out: torch.Tensor, flat: torch.Tensor, local: Block, across: Block, group: int,
                       stats: comm.CommStats | None = None, owner: str = "") -> None:
    """``out`` (this rank's chunk, ``flat.numel() / world`` values) <- the sum over all ranks of
    that chunk of ``flat``, through int4 in groups of at most ``group`` values and two all-to-alls
    (see the module docstring)."""
    dpn, nodes = local.size, across.size
    world, shard = dpn * nodes, out.numel()
    k, group = partition_groups(shard, group)
    padded = flat.new_zeros((world, k * group), dtype=torch.float16)
    padded[:, :shard] = flat.view(world, shard)
    groups = world * k
    values, scales = quantize.swizzle_quant(padded.view(-1), groups, nodes, dpn)
    values, scales = _all_to_all(values, local, stats, owner), _all_to_all(scales, local, stats, owner)
    values, scales = quantize.quantized_reduction(values, scales, groups, groups // dpn, dpn)
    values, scales = _all_to_all(values, across, stats, owner), _all_to_all(scales, across, stats, owner)
    out.copy_(quantize.sum_node_chunks(values, scales, nodes)[:shard])


def _all_to_all(tensor: torch.Tensor, block: Block, stats, owner: str) -> torch.Tensor:
    received = torch.empty_like(tensor)
    comm.all_to_all(received, tensor, stats, group=block.group, label="quantized_reduce_scatter")
    return received
