"""The optimizer tier (the update seam): one object per rank owns the fp32 masters, the optimizer
states and the update. ``OptimizerTier`` is the interface; ``LocalTier`` keeps everything on the
rank. See ``raydeep.tier.base`` for what the engine, checkpoints and schedulers ask of a tier."""
from raydeep.tier.base import KERNEL_CHOICES, OptimizerTier, TierState, UnitRange
from raydeep.tier.local import LocalTier

__all__ = ["KERNEL_CHOICES", "LocalTier", "OptimizerTier", "TierState", "UnitRange"]
