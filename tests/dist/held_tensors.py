"""What a live object holds in tensors, found by walking its attributes rather than asked of its own
accounting (``memory_breakdown()`` is what the doctor's estimate is checked against, so it cannot
also be the measurement): every tensor reachable from it, each storage counted once, at the size
allocated for it now (a freed storage counts zero).

Tensors are not walked into (their autograd graph is not held state), except a parameter's
``.grad``; nor are functions, classes and modules.
"""
from __future__ import annotations

import types
from collections import deque

import torch

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           torch.dtype, torch.device, str, bytes, int, float, bool, complex, type(None))


def reachable(root):
    """Every object reachable from ``root`` through attributes (``__dict__`` and ``__slots__``),
    containers and tensors' ``.grad``, breadth first, each once."""
    seen, queue = set(), deque([root])
    while queue:
        obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, torch.Tensor):
            if obj.grad is not None:
                queue.append(obj.grad)
        elif isinstance(obj, dict):
            queue.extend(obj.keys())
            queue.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            queue.extend(obj)
        else:
            queue.extend(getattr(obj, "__dict__", {}).values())
            queue.extend(getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name))


class HeldBytes:
    """Storages claimed by kind, in the order of the calls: a storage claimed once (a master that
    is the parameters' own storage, a gradient that is a view of a flat buffer) is not counted
    again under a later kind."""

    def __init__(self):
        self._kind: dict[int, tuple[str, int]] = {}  # storage address -> (kind, bytes)

    def claim(self, kind: str, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes():
                    self._kind.setdefault(storage.data_ptr(), (kind, storage.nbytes()))

    def claim_reachable(self, kind: str, root) -> None:
        self.claim(kind, (obj for obj in reachable(root) if isinstance(obj, torch.Tensor)))

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, nbytes in self._kind.values():
            out[kind] = out.get(kind, 0) + nbytes
        return out
