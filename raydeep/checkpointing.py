"""DeepSpeed's import name for activation checkpointing (``deepspeed.checkpointing``): this name
is :mod:`raydeep.activation.deepspeed_api` itself (one module, one set of settings), so code written
for DeepSpeed finds it where it looks.
"""
import sys

from raydeep.activation import deepspeed_api

sys.modules[__name__] = deepspeed_api
