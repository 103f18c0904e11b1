"""ZeRO++'s process groups: which ranks share a node, and the groups its three parts talk in.

ZeRO++ (DeepSpeed's ``zero_hpz_partition_size``, ``zero_quantized_weights``,
``zero_quantized_gradients``) cuts stage 3's cross-node traffic by talking within a node where it
can. Ranks are numbered node-major, as DeepSpeed and Ray Train number them: rank
``node * ranks_per_node + local``. The groups, made once on every rank in the same order:

- **hpZ** (hierarchical partitioning): consecutive blocks of ``zero_hpz_partition_size`` ranks,
  DeepSpeed's ``_create_zero_param_parallel_group``. Each rank keeps a secondary copy of
  ``1/size`` of every gathered unit, so backward gathers inside its block. The block should be a
  node (that is what makes backward's all-gather stay off the network); a size that does not
  match the ranks per node is warned about.
- **qgZ** (quantized gradients): DeepSpeed's ``all_to_all_quant_reduce`` groups: ``local`` = the
  ranks of this rank's node, ``across`` = the ranks with this rank's local index on every node.

Ranks per node come from ``LOCAL_WORLD_SIZE`` (set by torchrun and by Ray Train), which a test
may also set to declare a node map for ranks on one machine.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raydeep.errors import ConfigError

logger = logging.getLogger("raydeep")


@dataclass(frozen=True)
class Block:
    """One process group this rank belongs to, and where it sits in it."""

    group: object  # a torch.distributed ProcessGroup (None: the whole world)
    size: int
    index: int  # this rank's rank in ``group``


@dataclass(frozen=True)
class ZeroPlusPlus:
    """The ZeRO++ parts switched on, with the groups they need (None: that part is off)."""

    hpz: Block | None = None
    quantize_weights: bool = False
    quantize_frozen_weights: bool = False
    #: qgZ: (this node's ranks, this local index's ranks on every node)
    qgz: tuple[Block, Block] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.hpz or self.quantize_weights or self.quantize_frozen_weights or self.qgz)


def ranks_per_node(world: int) -> int:
    """Ranks on each node: ``LOCAL_WORLD_SIZE`` when set (it must divide the world size, and be
    the same on every rank), else the whole world on one node."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if not value:
        return world
    local = int(value)
    if local < 1 or world % local:
        raise ConfigError("LOCAL_WORLD_SIZE", f"ZeRO++ needs the same number of ranks on every node, a divisor "
                          f"of the world size {world}", value=local, fix="run the same number of workers per node")
    if dist.is_initialized() and world > 1:
        sizes = torch.tensor([local, -local], dtype=torch.int64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
        if int(sizes[0]) != -int(sizes[1]):
            raise ConfigError("LOCAL_WORLD_SIZE", "ZeRO++ needs the same number of ranks on every node; the ranks "
                              f"report between {-int(sizes[1])} and {int(sizes[0])}", value=local,
                              fix="run the same number of workers per node")
    return local


def _blocks(world: int, size: int, rank: int) -> Block:
    """Consecutive blocks of ``size`` ranks; every rank creates every block (torch requires it)."""
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = Block(group, size, rank - start)
    return mine


def _strided(world: int, stride: int, rank: int) -> Block:
    """The ranks with each local index ``0..stride-1``: ``[i, i + stride, i + 2 stride, ...]``."""
    mine = None
    for local in range(stride):
        ranks = list(range(local, world, stride))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = Block(group, len(ranks), ranks.index(rank))
    return mine


def build(zero, rank: int, world: int) -> ZeroPlusPlus:
    """The ZeRO++ groups for ``zero`` (the config's ``zero_optimization``), made on every rank."""
    hpz_size = zero.zero_hpz_partition_size
    wanted = hpz_size > 1 or zero.zero_quantized_gradients
    if world == 1 or not (wanted or zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights):
        return ZeroPlusPlus(quantize_weights=zero.zero_quantized_weights and world > 1,
                            quantize_frozen_weights=zero.zero_quantized_nontrainable_weights and world > 1)
    per_node = ranks_per_node(world) if wanted else world
    hpz = None
    if 1 < hpz_size < world:  # not below the world size: off, as the config's load warned
        if hpz_size != per_node:
            logger.warning("zero_optimization.zero_hpz_partition_size = %d but there are %d ranks per node: the "
                           "secondary partition is shared by %d consecutive ranks, so backward's all-gather %s",
                           hpz_size, per_node, hpz_size,
                           "crosses nodes" if hpz_size > per_node else "stays in the node but uses fewer links")
        hpz = _blocks(world, hpz_size, rank)
    qgz = None
    if zero.zero_quantized_gradients:
        nodes = world // per_node
        if nodes == 1:
            logger.warning("zero_optimization.zero_quantized_gradients: all %d ranks are on one node, so the "
                           "quantized reduce-scatter only loses precision (it pays across nodes); set "
                           "LOCAL_WORLD_SIZE where ranks per node is not detected", world)
        qgz = (_blocks(world, per_node, rank), _strided(world, per_node, rank))
    return ZeroPlusPlus(hpz=hpz, quantize_weights=zero.zero_quantized_weights,
                        quantize_frozen_weights=zero.zero_quantized_nontrainable_weights, qgz=qgz)
