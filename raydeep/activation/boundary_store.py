"""Where the tensors autograd saves for backward are kept: ``saved_tensors_hooks`` that move them
to host memory (``cpu_checkpointing``, ``raydeep.offload_activations``) and/or into contiguous
buffers (``contiguous_memory_optimization``), and bring them back when backward unpacks them.

A non-reentrant checkpoint saves its region's inputs through the saved-tensor hooks active when it
is called (and drops everything inside the region, under its own hooks), so installing a
:class:`SavedTensorStore` around the call places exactly the boundary inputs; installing one
around a whole forward places every activation a non-checkpointed module saves (torch's
``save_on_cpu``, with the copies on a side stream).

Hooks installed outside (a user's own ``save_on_cpu``, a counter of saved bytes) still see every
tensor: a store hands the tensor it keeps to the hooks it found installed, and unpacks through
them, instead of hiding it.

Parameters are never moved: autograd saves the parameter tensor itself (no copy), and moving it
would cost a copy each way and save nothing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from raydeep.activation.host_copies import CudaCopies


def _installed_hooks():
    """The (pack, unpack) saved-tensor hooks in effect now, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


def movable(tensor: torch.Tensor) -> bool:
    """An activation (not a parameter or another leaf that requires grad), with elements."""
    return not isinstance(tensor, nn.Parameter) and not (tensor.is_leaf and tensor.requires_grad) \
        and tensor.numel() > 0


class ContiguousSlots:
    """DeepSpeed's contiguous checkpoint buffers: the saved inputs of one micro-batch go into
    preallocated buffers of ``number`` slots each (one per input shape and dtype), one allocation
    instead of ``number``. A full buffer starts another (DeepSpeed would fail with an index error).
    :meth:`release` forgets the buffers when backward begins -- the slots still saved keep theirs
    alive -- so the next micro-batch's forward starts new ones, as DeepSpeed does."""

    def __init__(self, number: int, allocate: Callable[[tuple, torch.dtype, torch.device | None], torch.Tensor]):
        self.number, self.allocate = number, allocate
        self.buffers: dict[tuple, list] = {}  # key -> [buffer, next free slot]
        self.allocations = 0

    def take(self, tensor: torch.Tensor, host: bool) -> torch.Tensor:
        """The next free slot for ``tensor``'s shape and dtype, in host memory or on its device."""
        key = (tuple(tensor.shape), tensor.dtype, "host" if host else str(tensor.device))
        entry = self.buffers.get(key)
        if entry is None or entry[1] == self.number:
            buffer = self.allocate((self.number, *tensor.shape), tensor.dtype, None if host else tensor.device)
            entry = self.buffers[key] = [buffer, 0]
            self.allocations += 1
        slot = entry[0][entry[1]]
        entry[1] += 1
        return slot

    def release(self) -> None:
        self.buffers = {}


@dataclass
class _Packed:
    kept: Any  # the tensor kept, or what the outer hooks made of it
    event: Any = None  # set when ``kept`` is a host copy still being written
    outer_unpack: Callable | None = None


class SavedTensorStore:
    """Pack and unpack hooks placing saved tensors (see the module docstring).

    ``copies`` (a :class:`~raydeep.activation.host_copies.CudaCopies`, or a stand-in) moves tensors
    on an accelerator to host memory when ``to_host``; without it (a CPU device) tensors are
    already in host memory and stay where they are. ``slots`` copies each into a contiguous buffer.
    ``host_bytes`` counts the bytes this store keeps in host memory (also those already there).
    """

    def __init__(self, to_host: bool = False, copies: CudaCopies | None = None, slots: ContiguousSlots | None = None):
        self.to_host, self.copies, self.slots = to_host, copies, slots
        self.host_bytes = 0

    @contextlib.contextmanager
    def installed(self):
        outer = _installed_hooks()
        outer_pack, outer_unpack = outer if outer is not None else (None, None)

        def pack(tensor):
            packed = self._place(tensor)
            if outer_pack is not None:
                packed.kept, packed.outer_unpack = outer_pack(packed.kept), outer_unpack
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, self._restore):
            yield self

    def _place(self, tensor: torch.Tensor) -> _Packed:
        if not movable(tensor):
            return _Packed(tensor)
        # Moved: a tensor on the device the copies serve; one in host memory stays where it is.
        moved = self.to_host and self.copies is not None and tensor.device.type == self.copies.device.type
        on_host = tensor.device.type == "cpu" and not moved
        if self.to_host and (moved or on_host):
            self.host_bytes += tensor.numel() * tensor.element_size()
        if moved:
            out = self.slots.take(tensor, host=True) if self.slots is not None else None
            host, event = self.copies.to_host(tensor, out)
            return _Packed(host, event)
        if self.slots is not None:
            slot = self.slots.take(tensor, host=on_host)
            slot.copy_(tensor)
            return _Packed(slot)
        return _Packed(tensor)

    def _restore(self, packed: _Packed) -> torch.Tensor:
        if self.slots is not None:
            self.slots.release()  # backward has begun (see ContiguousSlots)
        kept = packed.outer_unpack(packed.kept) if packed.outer_unpack is not None else packed.kept
        if packed.event is not None:
            return self.copies.to_device(kept, packed.event)
        return kept


def store_for(options, copies: CudaCopies | None) -> SavedTensorStore | None:
    """The store a checkpointed region's inputs go through under ``options``; None: left to autograd."""
    if not options.stores_inputs:
        return None
    slots = None
    if options.contiguous_memory_optimization:
        def allocate(shape, dtype, device):
            if device is None and copies is not None:
                return copies.pinned(shape, dtype)
            return torch.empty(shape, dtype=dtype, device=device)
        slots = ContiguousSlots(options.number_checkpoints or 1, allocate)
    return SavedTensorStore(to_host=options.cpu_checkpointing, copies=copies, slots=slots)
