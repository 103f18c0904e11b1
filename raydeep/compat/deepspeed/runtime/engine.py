"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is raydeep's engine class."""
from raydeep.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
