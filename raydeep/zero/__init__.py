"""ZeRO partitioning: layouts, the per-stage strategies, and DeepSpeed's ``zero`` utilities."""
from raydeep.zero.gathered import GatheredParameters
from raydeep.zero.init import Init

__all__ = ["GatheredParameters", "Init"]
