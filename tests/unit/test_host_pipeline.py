"""The host tier's pipeline on an accelerator, checked on CPU: fake CUDA tensors
(``FakeTensorMode``) and a recording stand-in for the streams give the order of every device call.

What a GPU run depends on and no CPU run reaches: each piece's gradients are copied to pinned
host memory on the side stream and waited for before the CPU reads them; the next piece is in
flight while one is computed; parameters go back in the model dtype (the cast on the CPU, 2 bytes
per element over the bus) from a buffer not rewritten before its copy has finished; masters that
stay on the device (``ratio`` < 1) are updated there, on the current stream, never staged.
"""
from __future__ import annotations

import pytest
import torch

from raydeep.optim.optimizers import build_optimizer, resolve_optimizer
from raydeep.tier import HostTier, cpu_update


class Recorder:
    """Stands in for ``CudaStreams``: runs nothing on a device, logs each call in order."""

    def __init__(self):
        self.log: list[tuple] = []
        self.side = False
        self.events = 0

    def side_waits_current(self):
        self.log.append(("side waits current",))

    def current_waits_side(self):
        self.log.append(("current waits side",))

    def on_side(self):
        recorder = self

        class Side:
            def __enter__(self):
                recorder.side = True

            def __exit__(self, *exc):
                recorder.side = False

        return Side()

    def record(self):
        self.events += 1
        event, log = self.events, self.log
        log.append(("record", event))

        class Event:
            def synchronize(self):
                log.append(("wait", event))

        return Event()

    def pinned(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst, src):
        assert self.side, "a host-device copy outside the side stream"
        self.log.append(("copy", src.device.type, dst.device.type, src.dtype, dst.dtype, src.numel()))


@pytest.fixture
def fake_cuda(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    # torch's kernel after a widening copy: the one-pass extension cannot read fake tensors
    monkeypatch.setattr(cpu_update, "available", lambda: False)
    return FakeTensorMode()


class Unit:
    """What the tier reads of a FlatUnit (fake mode cannot copy into a CUDA tensor, which
    building a real one does): ``full`` on the device, ``local`` a view of it or in host memory."""

    def __init__(self, numel: int, host_local: bool):
        self.full = torch.empty(numel, device="cuda", dtype=torch.bfloat16)
        self.local = torch.empty(numel, dtype=torch.bfloat16) if host_local else self.full
        self.dtype, self.group_index = torch.bfloat16, 0


def _tier(sizes, ratio=1.0, tile=1 << 22, sub_group_size=10**9, host_local=False, optimizer="AdamW"):
    recorder = Recorder()
    units = [Unit(n, host_local) for n in sizes]
    spec = resolve_optimizer(optimizer, {"lr": 1e-3})
    tier = HostTier(units, [{}], lambda groups: build_optimizer(spec, groups, prefer_fused=True), sub_group_size,
                    ratio=ratio, tile=tile, streams=recorder)
    updates = []
    update_piece, step_sub_group = tier.shards.update_piece, tier.shards.step_sub_group

    def logged_piece(i, lo, hi, grad, scale, out):
        recorder.log.append(("update", i, lo, hi, grad.device.type, None if out is None else out.device.type))
        if out is None or out.device.type == "cpu":  # fake mode cannot write into a CUDA tensor
            update_piece(i, lo, hi, grad, scale, out)

    def logged_group(k, grads, scale, writable=True, outs=None):
        recorder.log.append(("update group", k, tuple(g.device.type for g in grads)))
        return step_sub_group(k, grads, scale, writable, outs)

    tier.shards.update_piece, tier.shards.step_sub_group = logged_piece, logged_group
    grads = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    return tier, recorder, grads, updates


def test_pieces_are_staged_waited_updated_and_written_back_in_order(fake_cuda):
    with fake_cuda:
        tier, rec, grads, _ = _tier([640, 320], tile=256)
        tier.step(grads, 0.5)
        tier.step(grads, 0.5)  # the second step reuses the buffers: waits for the first step's copies
    pieces = [(it.pieces[0][0], it.pieces[0][1], it.pieces[0][2]) for it in tier.items]
    assert pieces == [(0, 0, 256), (0, 256, 512), (0, 512, 640), (1, 0, 256), (1, 256, 320)]
    second_step = rec.log.index(("side waits current",), 1)
    log, second = rec.log[:second_step], rec.log[second_step:]
    assert log[0] == ("side waits current",) and log[-1] == ("current waits side",)
    stages = [n for n, e in enumerate(log) if e[0] == "copy" and e[1] == "cuda"]
    updates = [n for n, e in enumerate(log) if e[0] == "update"]
    writes = [n for n, e in enumerate(log) if e[0] == "copy" and e[1] == "cpu"]
    assert len(stages) == len(updates) == len(writes) == 5
    for n in range(5):
        event = log[stages[n] + 1]
        assert event[0] == "record"
        wait = log.index(("wait", event[1]))
        assert stages[n] < wait < updates[n] < writes[n], n  # staged -> waited -> updated -> written back
        if n + 1 < 5:
            assert stages[n + 1] < updates[n], n  # the next piece is in flight while this one is computed
        assert log[updates[n]][4:] == ("cpu", "cpu")  # read from and written to host memory
    # Back in the model dtype from the host: 2 bytes per element over the bus, no fp32 on the device.
    assert all(log[w][3] == log[w][4] == torch.bfloat16 for w in writes)
    assert all(log[s][3] == torch.bfloat16 for s in stages)
    # An out buffer (two, by item parity) is rewritten only after its last copy to the device was
    # waited for: in this step, and across steps.
    written = [log[w + 1][1] for w in writes]  # the event recorded after each write-back
    for n in range(2, 5):
        assert log.index(("wait", written[n - 2])) < updates[n], n
    second_updates = [n for n, e in enumerate(second) if e[0] == "update"]
    assert second.index(("wait", written[4])) < second_updates[0]
    assert second.index(("wait", written[3])) < second_updates[1]


def test_masters_kept_on_the_device_are_updated_there_and_never_staged(fake_cuda):
    with fake_cuda:
        tier, rec, grads, _ = _tier([640, 640], ratio=0.5, tile=256, sub_group_size=640)
        tier.step(grads, 0.5)
    assert [m.device.type for m in tier.masters] == ["cpu", "cuda"]
    device_updates = [e for e in rec.log if e[0] == "update" and e[1] == 1]
    assert device_updates == [("update", 1, 0, 640, "cuda", "cuda")]  # whole, on the device, into local
    copies = [e for e in rec.log if e[0] == "copy"]
    assert sum(e[-1] for e in copies if e[1] == "cuda") == 640  # only the host unit's gradients staged
    assert sum(e[-1] for e in copies if e[1] == "cpu") == 640  # and only its parameters written back
    device_at = rec.log.index(device_updates[0])
    assert not any(e[0] == "copy" for e in rec.log[device_at:device_at + 1])


def test_offloaded_parameters_still_pipeline_on_the_compute_device(fake_cuda):
    """Under offload_param ``unit.local`` is host memory; the tier must still find the device."""
    with fake_cuda:
        tier, rec, grads, _ = _tier([640], tile=256, host_local=True)
        assert tier.units[0].local.device.type == "cpu"
        tier.step(grads, 0.5)
    assert tier.device.type == "cuda"
    assert sum(e[-1] for e in rec.log if e[0] == "copy" and e[1] == "cuda") == 640  # gradients staged
    # The new values go straight into the host-resident partition: nothing is copied back.
    assert not [e for e in rec.log if e[0] == "copy" and e[1] == "cpu"]
    assert all(e[5] == "cpu" for e in rec.log if e[0] == "update")


def test_default_sub_groups_still_overlap_transfer_and_compute(fake_cuda):
    """DeepSpeed's default sub_group_size (1e9) makes one sub-group; the tile still cuts it."""
    with fake_cuda:
        tier, rec, grads, _ = _tier([3000], tile=1024)
        tier.step(grads, 1.0)
    assert len(tier.sub_groups) == 1 and len(tier.items) == 3


def test_an_optimizer_stepping_whole_chunks_is_pipelined_by_sub_group(fake_cuda):
    with fake_cuda:
        tier, rec, grads, _ = _tier([640, 640], sub_group_size=640, optimizer="SGD")
        tier.step(grads, 0.5)
    assert tier.shards.pieces is None
    groups = [e for e in rec.log if e[0] == "update group"]
    assert groups == [("update group", 0, ("cpu",)), ("update group", 1, ("cpu",))]
    stages = [n for n, e in enumerate(rec.log) if e[0] == "copy" and e[1] == "cuda"]
    assert stages[1] < rec.log.index(groups[0])
