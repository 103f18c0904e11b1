"""Shared memory between a rank and an offload actor on the rank's own node.

Through the object store a step's bytes are copied twice more than they need be: the rank copies
its gradients into the store (``ray.put``), and the actor, after writing its results into its own
buffers, has Ray copy them into the store again as the call's return value, with the raylet
creating, sealing and freeing each object. On a node with CPUs to spare for the optimizer (a GPU
node has dozens) that copying costs more CPU than the update itself. An actor on the rank's node
therefore shares a window of host memory with the rank instead: the rank writes each piece's
gradients into it, the actor reads them there and writes the updated parameters (or, with the
delayed update's lookahead, its bases and rates) beside them, and the call carries only the
piece's number. Actors on other nodes use the object store as before.

The window is one file in ``/dev/shm`` that both processes map, unlinked as soon as the actor has
mapped it (the memory lives while either mapping does, and nothing is left behind by a crash).
It is made only where ``/dev/shm`` has room for it twice over (the object store lives there
too), and used only after the actor has read back the random header the rank wrote, which proves
that both see the same file (containers on one Ray node normally share ``/dev/shm``; where not,
the actor sees no such file and the rank keeps the object store).

Layout, for the actor's chunks in its own order (``ActorTier._chunks``): a header, the
gradients (``grad_dtype``), then ``rows`` model-dtype rows of results (the parameters, or the
lookahead's bases and its rates), each region 64-byte aligned. The writers never overlap in
time: the rank writes a piece's gradients before the call that reads them, the actor writes its
results before that call returns, and the rank reads them after it returned and before it sends
the next update's gradients.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch

ROOT = "/dev/shm"
HEADER = 64  # bytes: the random check the rank writes and the actor reads back
ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class WindowLayout:
    """What a window holds: one entry of ``numels`` per chunk, in the actor's order."""

    numels: tuple[int, ...]
    grad_dtype: torch.dtype
    out_dtype: torch.dtype
    rows: int  # result rows: 1 (parameters), 2 with the lookahead (bases, rates)

    @property
    def total(self) -> int:
        return sum(self.numels)

    def offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return out

    @property
    def grad_bytes(self) -> int:
        return _aligned(self.total * self.grad_dtype.itemsize)

    @property
    def row_bytes(self) -> int:
        return _aligned(self.total * self.out_dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return HEADER + self.grad_bytes + self.rows * self.row_bytes


class SharedWindow:
    """A mapped window (see the module docstring): ``grad(i)`` and ``out(row, i)`` are chunk
    ``i``'s views."""

    def __init__(self, memory: torch.Tensor, layout: WindowLayout):
        self.memory, self.layout = memory, layout
        self._offsets = layout.offsets()
        body = memory[HEADER:]
        self._grads = body[:layout.grad_bytes].view(layout.grad_dtype)
        self._rows = [body[layout.grad_bytes + r * layout.row_bytes:layout.grad_bytes + (r + 1) * layout.row_bytes]
                      .view(layout.out_dtype) for r in range(layout.rows)]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def header(self) -> bytes:
        return bytes(self.memory[:HEADER].tolist())

    def grad(self, i: int) -> torch.Tensor:
        lo = self._offsets[i]
        return self._grads[lo:lo + self.layout.numels[i]]

    def out(self, row: int, i: int) -> torch.Tensor:
        lo = self._offsets[i]
        return self._rows[row][lo:lo + self.layout.numels[i]]

    @classmethod
    def create(cls, name: str, layout: WindowLayout) -> tuple[SharedWindow, str] | None:
        """The rank's side: a new window file and its path, or None where ``/dev/shm`` is
        missing or has no room for it twice over."""
        try:
            free = os.statvfs(ROOT)
        except OSError:
            return None
        if free.f_bavail * free.f_frsize < 2 * layout.nbytes:
            return None
        path = os.path.join(ROOT, name)
        # Every page is allocated now: a sparse file would fail later, with SIGBUS on first
        # touch, if /dev/shm filled up meanwhile (the object store grows there too).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, layout.nbytes)
        except OSError:
            unlink(path)
            return None
        finally:
            os.close(fd)
        memory = torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8)
        memory[:HEADER].copy_(torch.frombuffer(bytearray(secrets.token_bytes(HEADER)), dtype=torch.uint8))
        return cls(memory, layout), path

    @classmethod
    def open(cls, path: str, layout: WindowLayout) -> SharedWindow | None:
        """The actor's side: the window at ``path``, or None where this process sees no such
        file (another node's, or another container's, ``/dev/shm``)."""
        try:
            if os.path.getsize(path) != layout.nbytes:
                return None
        except OSError:
            return None
        return cls(torch.from_file(path, shared=True, size=layout.nbytes, dtype=torch.uint8), layout)


def unlink(path: str) -> None:
    """Remove a window's file (its memory lives on while mapped)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def share(actors: list, layouts: list[WindowLayout | None], tag: str) -> list[SharedWindow | None]:
    """The rank's side of opening windows: one for each actor given a layout (those on this
    rank's node), kept where the actor maps the same file; None for the others."""
    from raydeep.tier.actor_faults import fetch

    made = [SharedWindow.create(f"raydeep-offload-{tag}-{a}", layout) if layout is not None else None
            for a, layout in enumerate(layouts)]
    asked = [a for a, m in enumerate(made) if m is not None]
    try:
        headers = fetch([actors[a].open_window.remote(made[a][1], layouts[a]) for a in asked]) if asked else []
    finally:
        for m in made:
            if m is not None:
                unlink(m[1])
    windows: list[SharedWindow | None] = [None] * len(actors)
    for a, header in zip(asked, headers):
        if header is not None and header == made[a][0].header():
            windows[a] = made[a][0]
    return windows
