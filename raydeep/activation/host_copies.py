"""The device calls that move saved activations to host memory and back, in one place so that a
test can put a recording stand-in in their stead and check their order on a CPU.

Note: the order each copy depends on.

- To the host: the side stream first waits for the current stream (the tensor's producer kernels
  have run), copies into pinned memory there without blocking the host, and records an event.
  ``record_stream`` tells the caching allocator that the side stream still reads the tensor, so
  its memory is not handed to a later kernel of the current stream before the copy has finished,
  although autograd drops its last reference right away -- that drop is the memory saved.
- Back to the device: the current stream waits for that event (a device-side wait, never a host
  synchronisation), then copies the pinned buffer on the current stream, ordered before the
  recomputation that reads it. The pinned allocator keeps the buffer until that copy has run.
"""
from __future__ import annotations

import torch


class TorchCuda:
    """The ``torch.cuda`` calls :class:`CudaCopies` makes; a test records them instead."""

    def side_stream(self, device: torch.device):
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def using(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class CudaCopies:
    """Pinned host memory, a side stream and events for one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device, cuda: TorchCuda | None = None):
        self.device, self.cuda = device, cuda or TorchCuda()
        self.side = self.cuda.side_stream(device)

    def pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.cuda.pinned(shape, dtype)

    def to_host(self, tensor: torch.Tensor, out: torch.Tensor | None = None):
        """Start copying ``tensor`` to pinned memory (``out`` if given); returns (host tensor, event)."""
        self.side.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.using(self.side):
            host = out if out is not None else self.pinned(tuple(tensor.shape), tensor.dtype)
            host.copy_(tensor, non_blocking=True)
            self.cuda.record_stream(tensor, self.side)
            event = self.cuda.event()
            event.record(self.side)
        return host, event

    def to_device(self, host: torch.Tensor, event) -> torch.Tensor:
        """A device copy of ``host``, ordered after the copy that filled it (``event``)."""
        self.cuda.current_stream(self.device).wait_event(event)
        return host.to(self.device, non_blocking=True)


def copies_for(device: torch.device) -> CudaCopies | None:
    """The copies for ``device``; None where the activations already live in host memory."""
    return CudaCopies(device) if device.type == "cuda" else None
