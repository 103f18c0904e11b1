"""One checkpointed region: torch's non-reentrant ``checkpoint`` with DeepSpeed's options applied.

A :class:`Checkpointer` holds one :class:`~raydeep.activation.options.CheckpointOptions` and runs
``function(*args, **kwargs)`` keeping none of its activations: in backward torch recomputes them
from the region's inputs, with the CPU and device random states (and whatever ``contexts`` adds,
the model-parallel RNG tracker's states) restored, so dropout draws the same masks.

Keyword arguments are passed to torch as positional ones, so that every tensor input is saved
through the saved-tensor hooks (torch captures keyword arguments by reference instead), which is
where ``cpu_checkpointing`` and ``contiguous_memory_optimization`` place them
(:mod:`raydeep.activation.boundary_store`).

Regions nest: inside a region (its forward or its recomputation) further regions run plainly,
because the outermost region already drops and recomputes everything inside it.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.utils.checkpoint

from raydeep.activation.boundary_store import SavedTensorStore, store_for
from raydeep.activation.host_copies import copies_for
from raydeep.activation.options import CheckpointOptions
from raydeep.activation.timing import BoundaryTiming

_depth = 0  # > 0 inside a checkpointed region (its forward or its recomputation)


def inside_region() -> bool:
    return _depth > 0


def _region(function):
    def run(*args, **kwargs):
        global _depth
        _depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            _depth -= 1
    return run


def _no_contexts():
    return contextlib.nullcontext(), contextlib.nullcontext()


class Checkpointer:
    """Checkpointed regions under one set of options; call it like ``checkpoint(function, *args)``.

    ``copies`` replaces the device calls of ``cpu_checkpointing`` (a test's recording stand-in);
    by default they are made for the device of the first region's inputs. ``timing`` replaces the
    synchronisation and profiling around each region.
    """

    def __init__(self, options: CheckpointOptions = CheckpointOptions(), contexts: Callable = _no_contexts,
                 copies=None, timing: BoundaryTiming | None = None):
        self.options, self.contexts, self.copies = options, contexts, copies
        self.timing = timing or BoundaryTiming(options.synchronize_checkpoint_boundary, options.profile)
        self.store: SavedTensorStore | None = None

    def __call__(self, function, *args, **kwargs):
        if _depth or not torch.is_grad_enabled():
            return function(*args, **kwargs)
        n, names = len(args), list(kwargs)

        def call(*flat):
            return function(*flat[:n], **dict(zip(names, flat[n:])))

        with self._store_for(args + tuple(kwargs.values())), self.timing.forward():
            return torch.utils.checkpoint.checkpoint(_region(call), *args, *kwargs.values(), use_reentrant=False,
                                                     context_fn=self._contexts)

    def _store_for(self, inputs):
        if not self.options.stores_inputs:
            return contextlib.nullcontext()
        if self.store is None:
            device = next((t.device for t in inputs if torch.is_tensor(t)), torch.device("cpu"))
            self.store = store_for(self.options, self.copies or copies_for(device))
        return self.store.installed()

    def _contexts(self):
        forward, recompute = self.contexts()
        timed = self.timing.recompute()

        @contextlib.contextmanager
        def both():
            with recompute, timed:
                yield
        return forward, both()

    def reset(self) -> None:
        """Forget the contiguous buffers (DeepSpeed's ``reset()``: forwards ran without backward)."""
        if self.store is not None and self.store.slots is not None:
            self.store.slots.release()
