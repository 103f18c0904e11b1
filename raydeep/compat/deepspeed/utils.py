"""``deepspeed.utils``: the logger libraries tune (transformers sets its level from the
Trainer's ``log_level``). DeepSpeed's logger is its runtime's, so here it is raydeep's.

``groups`` (sequence and expert parallel process groups) and ``set_z3_leaf_modules`` (MoE) are
not here: raydeep runs data parallel only.
"""
import logging

logger = logging.getLogger("raydeep")

__all__ = ["logger"]
