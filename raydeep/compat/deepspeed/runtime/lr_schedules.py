"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers, as raydeep implements them.

accelerate reads ``VALID_LR_SCHEDULES`` to tell a DeepSpeed scheduler object from a torch one.
"""
from raydeep.optim.schedulers import SCHEDULER_NAMES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
