"""``deepspeed.runtime.zero.partition_parameters``: the names transformers reaches into.

Around ``zero.Init`` transformers swaps ``zero_wrapper_for_fp_tensor_constructor`` for a version
that leaves ``torch.arange`` (``_orig_torch_arange``) in its own dtype, because DeepSpeed's Init
casts every floating-point tensor constructor to the training dtype. raydeep's Init wraps no
constructor (parameters are cast when the engine is built), so the wrapper here is never called:
swapping it changes nothing, which is the behaviour transformers asks for.
"""
import torch

from raydeep.accelerator import get_accelerator
from raydeep.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed's constructor wrapper; raydeep's Init does not wrap constructors, so ``fn`` as is."""
    return fn


__all__ = ["GatheredParameters", "Init", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor"]
