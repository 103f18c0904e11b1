"""DeepSpeed's activation-checkpointing options, in one process: where the saved inputs live
(``cpu_checkpointing``, ``contiguous_memory_optimization``, ``raydeep.offload_activations``), how
many modules are checkpointed (``number_checkpoints``), and the synchronisation and timings around
each region (``synchronize_checkpoint_boundary``, ``profile``).

Where a tensor is saved is observed as autograd sees it: a ``saved_tensors_hooks`` installed
around the forward receives every tensor saved for backward -- the stores hand it what they keep.
On a CPU the host *is* the device, so a stand-in for the device copies (:class:`HostCopies`) makes
every copy a tensor it can recognise; the CUDA path (pinned memory, side stream, events) is checked
in fake mode at the end.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from raydeep.activation.boundary_store import ContiguousSlots, SavedTensorStore, movable
from raydeep.activation.deepspeed_api import checkpointer_for
from raydeep.activation.host_copies import CudaCopies
from raydeep.activation.offload import offload_saved_activations
from raydeep.activation.options import CheckpointOptions
from raydeep.activation.timing import BoundaryTiming, ProfileTotals
from raydeep.activation.wrap import apply_activation_checkpointing, spread
from raydeep.models import build_gpt

B, T = 2, 16


class HostCopies:
    """Stands in for ``CudaCopies`` on a CPU: the CPU plays the device, and each "host copy" is a
    new tensor whose identity it remembers, so a test can tell a moved tensor from the original."""

    device = torch.device("cpu")

    def __init__(self):
        self.hosted: set[int] = set()
        self.log: list[tuple] = []

    def pinned(self, shape, dtype):
        self.log.append(("pinned", tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    def to_host(self, tensor, out=None):
        host = out if out is not None else torch.empty_like(tensor)
        host.copy_(tensor)
        self.hosted.add(id(host))
        self.log.append(("to host", len(self.log)))
        return host, len(self.log) - 1

    def to_device(self, host, event):
        self.log.append(("to device", event))
        return host.clone()


def _model(n_layer: int = 3, dropout: float = 0.1):
    torch.manual_seed(0)
    return build_gpt("gpt-tiny", block_size=T, n_layer=n_layer, n_embd=32, n_head=2, dropout=dropout)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (B, T + 1), generator=g)


def _loss_and_grads(model, outer_pack=None):
    """One forward and backward (dropout on, seeded): the loss, every gradient, and the tensors
    ``outer_pack`` saw saved for backward."""
    batch = _batch()
    torch.manual_seed(5)
    seen = []

    def pack(t):
        seen.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, seen


def _assert_bitwise(a, b):
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def _region_inputs(modules):
    """Each wrapped module's input, per forward (taken before the region runs; held, so that no
    later tensor can take its address)."""
    seen = []
    for m in modules:
        m.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    return seen


@pytest.mark.parametrize("policy", ["attention", "block", ["MLP"]])
def test_cpu_checkpointing_saves_every_region_input_on_the_host(policy):
    reference = _loss_and_grads(_model())
    model, copies = _model(), HostCopies()
    options = CheckpointOptions(cpu_checkpointing=True)
    wrapped = apply_activation_checkpointing(model, options, policy, checkpointer_for(options, copies=copies))
    inputs = _region_inputs(wrapped)
    result = _loss_and_grads(model)
    hosted = [t for t in result[2] if id(t) in copies.hosted]
    assert len(wrapped) == 3 and len(hosted) == len(wrapped)  # one input per region, each a host copy
    assert all(t.shape == (B, T, 32) for t in hosted)
    # No region input was saved where it was computed: the forward's own tensors are not kept.
    device_saved = {t.untyped_storage().data_ptr() for t in result[2] if id(t) not in copies.hosted}
    assert not device_saved & {t.untyped_storage().data_ptr() for t in inputs[:len(wrapped)]}
    # Brought back once each, in backward, last region first.
    backs = [event for kind, event in copies.log if kind == "to device"]
    assert backs == sorted(backs, reverse=True) and len(backs) == len(wrapped)
    _assert_bitwise(result, reference)


def test_offload_activations_keeps_every_saved_activation_on_the_host():
    reference = _loss_and_grads(_model())
    model, copies = _model(), HostCopies()
    offload_saved_activations(model, copies.device, copies=copies)
    result = _loss_and_grads(model)
    activations = [t for t in result[2] if movable(t)]
    assert len(activations) > 40  # every op of three blocks and the head
    assert all(id(t) in copies.hosted for t in activations)
    assert not any(id(t) in copies.hosted for t in result[2] if isinstance(t, nn.Parameter))
    _assert_bitwise(result, reference)


def test_contiguous_inputs_share_one_buffer_per_micro_batch():
    reference = _loss_and_grads(_model(n_layer=4))
    model = _model(n_layer=4)
    options = CheckpointOptions(contiguous_memory_optimization=True, number_checkpoints=4)
    checkpointer = checkpointer_for(options)
    apply_activation_checkpointing(model, options, "block", checkpointer)
    result = _loss_and_grads(model)
    slots = checkpointer.store.slots
    boundary = [t for t in result[2] if t._base is not None and tuple(t._base.shape) == (4, B, T, 32)]
    assert len({t.untyped_storage().data_ptr() for t in boundary}) == 1 and len(boundary) == 4
    assert slots.allocations == 1
    _assert_bitwise(result, reference)
    _loss_and_grads(model)  # the next micro-batch starts a new buffer: the first is freed with its backward
    assert slots.allocations == 2


def test_a_full_buffer_starts_another():
    slots = ContiguousSlots(2, lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    taken = [slots.take(torch.ones(3), host=True) for _ in range(3)]
    assert slots.allocations == 2 and taken[0]._base is taken[1]._base is not taken[2]._base


def test_number_checkpoints_spreads_the_checkpointed_blocks():
    model = _model(n_layer=4)
    wrapped = apply_activation_checkpointing(model, CheckpointOptions(number_checkpoints=2), "block")
    assert wrapped == [model.blocks[0], model.blocks[2]]
    assert spread(list(range(12)), 4) == [0, 3, 6, 9] and spread(list(range(3)), 12) == [0, 1, 2]
    assert spread(list(range(7)), 3) == [0, 2, 4]
    reference = _loss_and_grads(_model(n_layer=4))
    _assert_bitwise(_loss_and_grads(model), reference)


class Recording:
    """A clock that advances 1 ms a reading, and a device synchronisation that logs."""

    def __init__(self):
        self.log: list[str] = []
        self.now = 0.0

    def sync(self):
        self.log.append("sync")

    def clock(self):
        self.now += 0.001
        self.log.append("clock")
        return self.now


@pytest.mark.parametrize("synchronize,profile", [(True, False), (False, True), (True, True)])
def test_boundary_synchronisation_and_profile(synchronize, profile, caplog):
    rec, totals = Recording(), ProfileTotals()
    timing = BoundaryTiming(synchronize, profile, sync=rec.sync, clock=rec.clock, totals=totals)
    layer = nn.Linear(8, 8)
    run = checkpointer_for(CheckpointOptions(synchronize_checkpoint_boundary=synchronize, profile=profile),
                           timing=timing)

    def region(x):
        rec.log.append("region")
        return layer(x).tanh()
    with caplog.at_level(logging.INFO, logger="raydeep"):
        run(region, torch.randn(4, 8, requires_grad=True)).sum().backward()
    events = [e for e in rec.log if e != "clock"]
    # The device is synchronised before and after the forward, and before and after the recomputation.
    assert events == ["sync", "region", "sync", "sync", "region", "sync"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time (ms)")]
    if profile:
        assert lines == ["time (ms) | fwd: 1.00", "time (ms) | backward: 1.00"]  # one 1 ms tick between readings
        assert totals.take() == {"checkpoint_forward_s": pytest.approx(0.001),
                                 "checkpoint_recompute_s": pytest.approx(0.001), "checkpoint_calls": 1}
    else:
        assert lines == [] and totals.take()["checkpoint_calls"] == 0


def test_no_synchronisation_without_the_options():
    rec = Recording()
    run = checkpointer_for(CheckpointOptions(), timing=BoundaryTiming(False, False, sync=rec.sync, clock=rec.clock))
    run(nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert "sync" not in rec.log


# --- the CUDA path, in fake mode ---------------------------------------------------------------------
class RecordingCuda:
    """Stands in for ``torch.cuda`` under ``CudaCopies``: logs each stream, event and pinning call."""

    def __init__(self):
        self.log: list[tuple] = []
        self.on_side = False
        self.events = 0
        cuda = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                cuda.log.append(("wait stream", self.name, other.name))

            def wait_event(self, event):
                cuda.log.append(("wait event", self.name, event.number))

        class Event:
            def __init__(self):
                cuda.events += 1
                self.number = cuda.events

            def record(self, stream):
                cuda.log.append(("record", self.number, stream.name))

        self.Stream, self.Event = Stream, Event

    def side_stream(self, device):
        return self.Stream("side")

    def current_stream(self, device):
        return self.Stream("current")

    def using(self, stream):
        cuda = self

        class On:
            def __enter__(self):
                cuda.on_side = stream.name == "side"

            def __exit__(self, *exc):
                cuda.on_side = False
        return On()

    def event(self):
        return self.Event()

    def pinned(self, shape, dtype):
        self.log.append(("pinned", tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", tensor.device.type, stream.name))


@pytest.fixture
def copy_log():
    """Fake CUDA tensors, with every copy between devices logged (and whether it ran on the side stream)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    cuda = RecordingCuda()

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
                src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                dst = args[0] if func is torch.ops.aten.copy_.default else out
                cuda.log.append(("copy", src.device.type, dst.device.type, "side" if cuda.on_side else "current"))
            return out
    with FakeTensorMode(), Copies():
        yield cuda


def _hooks(store):
    """The pack and unpack hooks ``store`` installs (autograd itself cannot run on fake CUDA tensors here)."""
    with store.installed():
        return torch._C._autograd._top_saved_tensors_default_hooks(False)


def test_cuda_boundary_inputs_go_to_pinned_memory_on_the_side_stream(copy_log):
    cuda = copy_log
    copies = CudaCopies(torch.device("cuda", 0), cuda=cuda)
    store = SavedTensorStore(to_host=True, copies=copies)
    pack, unpack = _hooks(store)
    inputs = [torch.empty(B, T, 32, device="cuda") for _ in range(3)]
    packed = [pack(t) for t in inputs]
    forward = list(cuda.log)
    assert [p.kept.device.type for p in packed] == ["cpu"] * 3  # what autograd holds is in host memory
    assert store.host_bytes == 3 * B * T * 32 * 4
    per_input = [("wait stream", "side", "current"), ("pinned", (B, T, 32)), ("copy", "cuda", "cpu", "side"),
                 ("record_stream", "cuda", "side")]
    for k in range(3):
        # the side stream waits for the producer, copies into pinned memory without blocking the
        # host, keeps the source alive for the allocator, and records the event backward waits on
        assert forward[5 * k:5 * k + 5] == per_input + [("record", k + 1, "side")], k
    cuda.log.clear()
    restored = [unpack(p) for p in reversed(packed)]
    assert [t.device.type for t in restored] == ["cuda"] * 3
    assert cuda.log == [entry for k in (3, 2, 1) for entry in
                        (("wait event", "current", k), ("copy", "cpu", "cuda", "current"))]


def test_cuda_contiguous_host_buffer_is_pinned_once(copy_log):
    cuda = copy_log
    copies = CudaCopies(torch.device("cuda", 0), cuda=cuda)
    store = SavedTensorStore(to_host=True, copies=copies,
                             slots=ContiguousSlots(4, lambda shape, dtype, device: copies.pinned(shape, dtype)))
    pack, _ = _hooks(store)
    packed = [pack(torch.empty(B, T, 32, device="cuda")) for _ in range(4)]
    assert [e for e in cuda.log if e[0] == "pinned"] == [("pinned", (4, B, T, 32))]
    assert all(p.kept._base is packed[0].kept._base for p in packed)
    assert [e for e in cuda.log if e[0] == "copy"] == [("copy", "cuda", "cpu", "side")] * 4


def test_parameters_and_host_tensors_are_never_copied(copy_log):
    cuda = copy_log
    store = SavedTensorStore(to_host=True, copies=CudaCopies(torch.device("cuda", 0), cuda=cuda))
    pack, _ = _hooks(store)
    weight = nn.Parameter(torch.empty(4, 4, device="cuda"))
    host = torch.empty(4)
    assert pack(weight).kept is weight and pack(host).kept is host
    assert not [e for e in cuda.log if e[0] == "copy"]


def test_keyword_tensor_inputs_are_placed_too():
    """torch keeps keyword arguments by reference: the region passes them positionally instead."""
    copies, layer = HostCopies(), nn.Linear(8, 8)
    run = checkpointer_for(CheckpointOptions(cpu_checkpointing=True), copies=copies)
    x = torch.randn(4, 8, requires_grad=True)
    out = run(lambda a, scale=None: layer(a) * scale, x * 1.0, scale=x * 2.0)
    assert len(copies.hosted) == 2
    out.sum().backward()
    assert [kind for kind, _ in copies.log] == ["to host", "to host", "to device", "to device"]


@pytest.mark.parametrize("profile", [True, False])
def test_profile_times_reach_the_step_metrics_row(profile):
    import raydeep
    from raydeep.metrics import SCHEMA
    from raydeep.ray.step_metrics import step_row

    engine, *_ = raydeep.initialize(model=_model(n_layer=2), config={
        "train_batch_size": B, "activation_checkpointing": {"profile": profile},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    batch = _batch()
    engine.backward(engine(batch[:, :-1], batch[:, 1:]))
    engine.step()
    row = step_row(engine.step_metrics, attempt=0, world_size=1, loss=1.0, step_s=1.0, checkpoint_s=0.0,
                   rates={"samples_per_s": 1.0, "tokens_per_s": 1.0, "mfu": None}, phase="")
    assert set(row) == set(SCHEMA.names)
    if profile:  # the two attention regions' forwards and recomputations, inside forward_s and backward_s
        assert 0 < row["checkpoint_forward_s"] <= engine.step_metrics["forward_s"]
        assert 0 < row["checkpoint_recompute_s"] <= engine.step_metrics["backward_s"]
    else:
        assert row["checkpoint_forward_s"] is None and row["checkpoint_recompute_s"] is None


def test_number_checkpoints_leaves_other_choices_whole():
    """DeepSpeed's number only sizes buffers: a config from DeepSpeed keeps every checkpoint it had."""
    model = _model(n_layer=4)
    wrapped = apply_activation_checkpointing(model, CheckpointOptions(number_checkpoints=2), "attention")
    assert wrapped == [b.attn for b in model.blocks]
