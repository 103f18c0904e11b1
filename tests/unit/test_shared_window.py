"""The shared window between a rank and an offload actor on its node (raydeep/tier/shared_window.py):
its regions do not overlap, a second mapping sees the first one's writes, and a process that does
not see the same file gets no window (the actor tests in tests/ray run it between processes)."""
from __future__ import annotations

import os
import uuid

import torch

from raydeep.tier import shared_window
from raydeep.tier.shared_window import SharedWindow, WindowLayout


def _layout() -> WindowLayout:
    return WindowLayout((5, 1000, 3), torch.bfloat16, torch.bfloat16, rows=2)


def test_every_chunk_view_is_its_own_memory_and_a_second_mapping_sees_it():
    layout = _layout()
    made = SharedWindow.create(f"raydeep-test-{uuid.uuid4().hex}", layout)
    assert made is not None
    window, path = made
    try:
        other = SharedWindow.open(path, layout)
        assert other is not None and other.header() == window.header() != bytes(shared_window.HEADER)
        views = [window.grad(i) for i in range(3)] + [window.out(r, i) for r in range(2) for i in range(3)]
        for n, view in enumerate(views):
            view.fill_(n + 1)
        seen = [other.grad(i) for i in range(3)] + [other.out(r, i) for r in range(2) for i in range(3)]
        for n, (view, there) in enumerate(zip(views, seen)):
            assert view.numel() == layout.numels[n % 3]
            assert bool((there == n + 1).all()), f"region {n} was overwritten"
        starts = [v.data_ptr() - window.memory.data_ptr() for v in (window.grad(0), window.out(0, 0), window.out(1, 0))]
        assert all(s % shared_window.ALIGN == 0 for s in starts)
        assert window.nbytes == os.path.getsize(path) == layout.nbytes
    finally:
        shared_window.unlink(path)
    assert not os.path.exists(path)
    window.grad(1).fill_(7)  # the memory outlives the file while mapped
    assert bool((other.grad(1) == 7).all())


def test_no_window_where_the_file_is_not_the_ranks():
    layout = _layout()
    missing = os.path.join(shared_window.ROOT, f"raydeep-test-{uuid.uuid4().hex}")
    assert SharedWindow.open(missing, layout) is None
    assert not os.path.exists(missing)  # looking did not create it
    made = SharedWindow.create(f"raydeep-test-{uuid.uuid4().hex}", layout)
    window, path = made
    try:
        smaller = WindowLayout((5, 100, 3), torch.bfloat16, torch.bfloat16, rows=2)
        assert SharedWindow.open(path, smaller) is None  # another layout: not this window
    finally:
        shared_window.unlink(path)


def test_no_window_where_dev_shm_has_no_room_and_nothing_left_behind(monkeypatch):
    """Too little free space, or an allocation /dev/shm refuses (ENOSPC): no window, no file (the
    tier keeps the object store). The pages are allocated at creation, so a /dev/shm that fills
    up later cannot fail a step with SIGBUS."""
    import errno

    layout = _layout()
    name = f"raydeep-test-{uuid.uuid4().hex}"
    real = os.statvfs(shared_window.ROOT)

    class Full:
        f_bavail, f_frsize = (2 * layout.nbytes - 1) // real.f_frsize, real.f_frsize

    monkeypatch.setattr(shared_window.os, "statvfs", lambda _: Full)
    assert SharedWindow.create(name, layout) is None
    monkeypatch.undo()

    def refused(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_window.os, "posix_fallocate", refused)
    assert SharedWindow.create(name, layout) is None
    assert not os.path.exists(os.path.join(shared_window.ROOT, name))
