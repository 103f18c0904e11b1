"""The optimizer tier (the update seam): one object per rank owns the fp32 masters, the optimizer
states and the update. See ``raydeep.tier.base`` for what the engine, checkpoints and schedulers
ask of a tier.

- ``base``: the interface (``OptimizerTier``) and the state it exchanges over element ranges;
- ``masters``: fp32 masters over chunks of the owned shards, a torch optimizer, the update tiled
  by ``sub_group_size`` -- what every tier runs, wherever it runs;
- ``local``: ``LocalTier`` (on the rank's device) and ``HostTier`` (ZeRO-Offload to host memory);
- ``actors``: ``ActorTier`` (ZeRO-Offload to Ray actors on CPU nodes, through the object store);
- ``offload_actor``: what runs inside each of those actors (its masters, update and part files);
- ``select``: which tier a config asks for.
"""
from raydeep.tier.base import KERNEL_CHOICES, OptimizerTier, TierState, UnitRange
from raydeep.tier.local import HostTier, LocalTier

__all__ = ["KERNEL_CHOICES", "HostTier", "LocalTier", "OptimizerTier", "TierState", "UnitRange"]
