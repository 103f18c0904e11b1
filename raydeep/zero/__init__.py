"""ZeRO partitioning: layouts, the per-stage strategies, and DeepSpeed's ``zero`` utilities."""
from raydeep.zero.gathered import GatheredParameters

__all__ = ["GatheredParameters"]
