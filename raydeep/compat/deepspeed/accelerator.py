"""``deepspeed.accelerator``: raydeep's accelerator object (:mod:`raydeep.accelerator`)."""
from raydeep.accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
