"""What a process really holds in tensors, found by walking objects (no one's own accounting)."""
from __future__ import annotations

import gc
import types

import numpy as np
import torch

# Objects the walk does not enter: through them every module global would be reachable.
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType)


def storage_bytes(root, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the distinct tensor storages of ``dtype`` reachable from ``root`` through
    attributes and containers (a storage counted once, however many views reach it); tensors of
    zero dimensions (an optimizer's ``step``) are left out."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.dtype == dtype and obj.dim() > 0:
                storage = obj.untyped_storage()
                if storage.nbytes():
                    storages[storage.data_ptr()] = storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def actor_storage_bytes(actor, dtype: torch.dtype = torch.float32, attribute: str | None = None) -> int:
    """:func:`storage_bytes` of a Ray actor's instance (or of one of its attributes), walked
    inside the actor's process."""
    import ray

    return ray.get(actor.__ray_call__.remote(
        lambda instance: storage_bytes(getattr(instance, attribute) if attribute else instance, dtype)))


def array_bytes(obj) -> int:
    """Bytes of the numpy arrays and tensors anywhere in ``obj`` (containers and dataclasses):
    what a call or a reply carries."""
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(array_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(array_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(array_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def received_while(fn, measure=array_bytes) -> int:
    """Run ``fn()`` in this process, counting what ``ray.get`` hands it meanwhile: the sum of
    ``measure`` over the replies (not raydeep's own accounting)."""
    import ray

    original, received = ray.get, []

    def counting(refs, *args, **kw):
        out = original(refs, *args, **kw)
        received.append(measure(out))
        return out

    ray.get = counting
    try:
        fn()
    finally:
        ray.get = original
    return sum(received)
