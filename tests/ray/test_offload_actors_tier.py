"""The actor tier itself, without an engine, on the package's simulated cluster
(tests/ray/conftest.py: its offload node carries ``raydeep_offload``):

- an fp32 gradient reaches the actor as a view of the object store's buffer, which nobody may
  write: after a step with a scale, the object holds the gradient as it was sent;
- a lost object (its owner died) is a lost offload actor, as a dead actor is: retryable;
- a load sends each actor the element ranges of its own chunks only, and the loaded tier
  continues bit for bit;
- with Adam/AdamW, DeepSpeed's default ``sub_group_size`` (one sub-group) still travels in tiles,
  over every actor, with the bits of the whole sub-group's update;
- a step keeps at most ``2 x actors`` sub-groups in flight (and that many, for the overlap),
  computes what ``MasterShards`` computes in-process, and split into ``_submit``/``_collect`` uses
  the scale and hyperparameters of submit time and writes ``unit.local`` only in ``_collect``;
- the delayed update (``submit``/``complete``) takes the gradients at submit, runs every piece
  in the background, and lands at the next ``submit`` or ``complete``;
- actors on the rank's own node exchange through shared memory, with the object store's bits;
  a rank on a marked node asks for its actors there first;
- the actors write a checkpoint's snapshot where they see the rank's staging location, and hand
  it to the rank where they do not (the same files); a snapshot costs the actors 12 bytes per
  element until written or discarded.

What the tier sends and receives is observed from outside it: each actor handle is wrapped in a
``Spy`` that logs every call with the array bytes of its arguments.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import ray
import torch
from torch import nn

from raydeep.tier.actors import ActorTier, OffloadActor, OffloadActorLost, fetch, to_wire
from raydeep.tier.masters import MasterShards, plan_sub_groups
from raydeep.tier.select import offload_placement
from raydeep.zero.flat import FlatUnit
from tests.ray.conftest import OFFLOAD_MARK
from tests.ray.tensors import array_bytes

pytestmark = pytest.mark.slow
PLACEMENT = offload_placement(OFFLOAD_MARK)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)



class Spy:
    """An actor handle that logs every call as ``(actor, method, array bytes of its arguments)``."""

    def __init__(self, index: int, handle, log: list):
        self._index, self._handle, self._log = index, handle, log

    def __getattr__(self, name: str):
        method, log, index = getattr(self._handle, name), self._log, self._index

        class Logged:
            @staticmethod
            def remote(*args, **kwargs):
                log.append((index, name, array_bytes(args)))
                return method.remote(*args, **kwargs)
        return Logged


def _spied(tier: ActorTier) -> list:
    log = []
    tier.handles = tier.actors
    tier.actors = [Spy(a, handle, log) for a, handle in enumerate(tier.actors)]
    return log


def _close(tier: ActorTier) -> None:
    tier.actors = getattr(tier, "handles", tier.actors)
    tier.close()


def _units(shapes=((("a", (40, 50)), ("b", (300,))), (("c", (64, 30)),))) -> list[FlatUnit]:
    """fp32 units as rank 1 of 2 (shards whose element ranges start past zero)."""
    torch.manual_seed(0)
    return [FlatUnit(f"u{i}", [(n, nn.Parameter(torch.randn(s))) for n, s in named], 1, 2, group_index=0,
                     grad_dtype=torch.float32, separate_local=False)
            for i, named in enumerate(shapes)]


def _grads(units, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(u.local.numel(), generator=g) for u in units]


def test_an_fp32_gradient_in_the_object_store_is_not_scaled_in_place(connected):
    """An fp32 model's gradient arrives as a view of the object store's buffer; SGD reads it
    as it is (no copy) only when the scale is 1, so a scale of 0.25 must go into a copy."""
    numel = 1 << 20  # large enough to travel through the object store, not inline in the call
    sub_groups = plan_sub_groups([numel], [0], 0)
    sgd = functools.partial(torch.optim.SGD, lr=0.5)
    actor = ray.remote(OffloadActor).options(num_cpus=0.5, max_restarts=0, **PLACEMENT).remote(sub_groups, [{}],
                                                                                                   sgd, 1)
    try:
        master, grad = torch.randn(numel), torch.randn(numel)
        ray.get(actor.start.remote([to_wire(master)], "float32"))
        sent = ray.put([to_wire(grad)])  # as ``.remote()`` puts a call's large arguments
        params, _ = ray.get(actor.step.remote(0, sent, "float32", 0.25, [{}]))
        # Read where the actor read it: the same object, on the actor's node.
        there = ray.get(actor.__ray_call__.remote(lambda _, arrays: arrays[0].copy(), sent))
        changed = int((there != grad.numpy()).sum())
        assert changed == 0, f"the actor wrote {changed} of {numel} elements of the gradient in the object store"
        assert np.array_equal(ray.get(sent)[0], grad.numpy())
        oracle = MasterShards(sub_groups, [master.clone()], [{}], sgd)
        oracle.step_sub_group(0, [grad.clone()], 0.25)
        assert torch.equal(torch.from_numpy(params[0].copy()), oracle.params[0].detach())
    finally:
        ray.kill(actor)


def test_a_lost_object_or_actor_is_a_lost_offload_actor(connected):
    @ray.remote(num_cpus=0)
    def never_returns():
        time.sleep(600)

    @ray.remote(num_cpus=0)
    class Owner:
        def make(self):
            # An object the actor owns that exists nowhere yet: once its owner is gone no copy can
            # answer for it (a copy already in some node's store may be served on, as Ray allows).
            self.pending = never_returns.remote()
            return [self.pending]

        def ping(self):
            return 1

    owner = Owner.remote()
    inner = ray.get(owner.make.remote())[0]
    ray.kill(owner)
    deadline = time.monotonic() + 60
    while True:  # ray.kill returns before the actor is gone: a call may still be answered
        try:
            fetch(owner.ping.remote())
        except OffloadActorLost as lost:
            assert isinstance(lost.__cause__, ray.exceptions.RayActorError), repr(lost.__cause__)
            break
        assert time.monotonic() < deadline, "the killed actor still answers"
        time.sleep(0.1)
    with pytest.raises(OffloadActorLost) as lost:
        fetch(inner)
    assert isinstance(lost.value.__cause__, ray.exceptions.ObjectLostError), repr(lost.value.__cause__)


def test_a_load_sends_each_actor_only_its_own_chunks_and_continues_bitwise(connected):
    saving_units, loading_units = _units(), _units()
    saving = ActorTier(saving_units, [{}], ADAMW, 256, PLACEMENT, actors_per_rank=1, cpus_per_actor=0.5)
    loading = ActorTier(loading_units, [{}], ADAMW, 256, PLACEMENT, actors_per_rank=3, cpus_per_actor=0.5)
    try:
        for seed in range(2):
            saving.step(_grads(saving_units, seed), 0.5)
        loading.step(_grads(loading_units, 99), 1.0)  # another history, to be overwritten
        state = saving.state_dict()
        log = _spied(loading)
        loading.load_state_dict(state)
        sent = [nbytes for _, method, nbytes in log if method == "load"]
        held = [sum(c.numel for c in loading._chunks(a)) for a in range(3)]
        # Each actor: its chunks' fp32 masters and both AdamW moments, 12 bytes per element.
        assert sent == [12 * n for n in held] and sum(held) == sum(p.end - p.start for p in state.units), \
            (sent, held)
        for a, b in zip(saving_units, loading_units):
            assert torch.equal(a.local, b.local)
        for tier, units in ((saving, saving_units), (loading, loading_units)):
            tier.step(_grads(units, 7), 0.25)
        for a, b in zip(saving_units, loading_units):
            assert torch.equal(a.local, b.local)
        again, other = loading.state_dict(), saving.state_dict()
        for x, y in zip(again.units, other.units):
            assert torch.equal(x.master, y.master) and x.states.keys() == y.states.keys()
            assert all(torch.equal(x.states[k], y.states[k]) for k in x.states)
    finally:
        _close(saving)
        _close(loading)


def _oracle(units, sub_groups, grads, scale: float, lr: float, fused: bool = False) -> list[torch.Tensor]:
    """The update ``MasterShards`` computes in this process: each unit's new parameters."""
    masters = [units[c.unit].local[c.lo:c.hi].detach().clone() for sg in sub_groups for c in sg]
    shards = MasterShards(sub_groups, masters, [{}],
                          functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.1, fused=fused or None))
    out = [u.local.detach().clone() for u in units]
    for k, sg in enumerate(sub_groups):
        for c, p in zip(sg, shards.step_sub_group(k, [grads[c.unit][c.lo:c.hi] for c in sg], scale, writable=False)):
            out[c.unit][c.lo:c.hi] = p.detach()
    return out


@pytest.mark.parametrize("actors,delayed", [(1, False), (2, False), (2, True)])
def test_a_step_keeps_two_pieces_per_actor_in_flight(connected, actors, delayed):
    """``step``, and with ``delayed`` the delayed update's ``submit``/``complete`` (whose driver
    thread sends the pieces)."""
    units = _units()
    tier = ActorTier(units, [{}], ADAMW, 128, PLACEMENT, actors_per_rank=actors, cpus_per_actor=0.5)
    try:
        assert len(tier.sub_groups) >= 10
        log, fetch_results = _spied(tier), tier._get

        def logged_get(refs):
            log.append((None, "result", 0))
            return fetch_results(refs)
        tier._get = logged_get
        grads = _grads(units, 1)
        expected = _oracle(units, tier.sub_groups, grads, 0.5, 1e-2)
        if delayed:
            tier.submit(grads, 0.5)
            tier.complete()
        else:
            tier.step(grads, 0.5)
        outstanding, most = 0, 0
        for _, method, _ in log:
            outstanding += {"step": 1, "result": -1}.get(method, 0)
            most = max(most, outstanding)
        steps = [entry for entry in log if entry[1] == "step"]
        print(f"\n{actors} actor(s), {len(tier.sub_groups)} sub-groups{', delayed' if delayed else ''}: "
              f"at most {most} in flight")
        assert len(steps) == len(tier.sub_groups) and outstanding == 0
        assert most == 2 * actors == tier.in_flight_limit, f"{most} sub-groups in flight at once"
        assert [a for a, _, _ in steps] == [k % actors for k in range(len(tier.sub_groups))]
        for unit, want in zip(units, expected):
            assert torch.equal(unit.local, want)
    finally:
        _close(tier)


def test_adam_at_deepspeeds_default_sub_group_size_travels_in_tiles_over_every_actor(connected):
    """DeepSpeed's default ``sub_group_size`` (1e9) makes the whole shard one sub-group, which
    would be one call to one actor: no transfer overlaps the update, and a second actor gets
    nothing. With Adam/AdamW the tier cuts it to the tile instead, round-robin over the actors,
    and the parameters are the bits of the whole sub-group's update in this process (any other
    optimizer steps sub-groups whole: tests/unit/test_optimizer_tier.py)."""
    units = _units()
    fused = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True)
    whole = plan_sub_groups([u.local.numel() for u in units], [0] * len(units), 10**9)
    grads = _grads(units, 1)
    expected = _oracle(units, whole, grads, 0.5, 1e-2, fused=True)
    tier = ActorTier(units, [{}], fused, 10**9, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5, tile=256)
    try:
        assert len(whole) == 1 and len(tier.sub_groups) >= 8 and len(tier.actors) == 2
        assert max(sum(c.numel for c in sg) for sg in tier.sub_groups) == 256
        log = _spied(tier)
        tier.step(grads, 0.5)
        assert [a for a, method, _ in log if method == "step"] == [k % 2 for k in range(len(tier.sub_groups))]
        for unit, want in zip(units, expected):
            assert torch.equal(unit.local, want)
    finally:
        _close(tier)


def test_submit_captures_scale_and_hyperparameters_and_only_collect_writes_the_parameters(connected):
    units = _units()
    tier = ActorTier(units, [{}], ADAMW, 128, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5)
    try:
        grads = _grads(units, 3)
        expected = _oracle(units, tier.sub_groups, grads, 0.5, 1e-2)
        before = [u.local.clone() for u in units]
        handle = tier._submit(grads, 0.5)
        assert len(handle.in_flight) == tier.in_flight_limit < len(tier.sub_groups)
        tier.param_groups[0]["lr"] = 123.0  # a scheduler moving on while the update is in flight
        ray.get([call for _, call in handle.in_flight])  # the first pieces are done ...
        assert all(torch.equal(u.local, b) for u, b in zip(units, before))  # ... and not yet written
        tier._collect(handle)
        for unit, want in zip(units, expected):
            assert torch.equal(unit.local, want)
        assert tier.timings["steps"] == 1
        with pytest.raises(AssertionError):
            tier._collect(handle)  # collected once
    finally:
        _close(tier)


def test_a_delayed_update_takes_the_gradients_at_submit_runs_meanwhile_and_lands_at_complete(connected):
    """The engine's delayed parameter update: ``submit``, then the engine clears the gradients
    and the next forward and backward run (the schedulers may move), then the next ``submit``
    (or ``complete``) lands the update."""
    units = _units()
    tier = ActorTier(units, [{}], ADAMW, 128, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5)
    try:
        first, second = _grads(units, 3), _grads(units, 4)
        expected = _oracle(units, tier.sub_groups, first, 0.5, 1e-2)
        before = [u.local.clone() for u in units]
        tier.submit(first, 0.5)
        assert tier.pending
        handle = tier._pending
        assert handle.driver is None and handle.next == 0  # held until the engine has published
        for g in first:
            g.zero_()  # the engine clears the gradients right after
        tier.release()
        tier.param_groups[0]["lr"] = 1e-3  # the scheduler's next value: for the next update
        handle.driver.result(timeout=120)  # every piece runs without waiting for complete() ...
        assert handle.next == len(tier.sub_groups) and not handle.in_flight
        assert all(torch.equal(u.local, b) for u, b in zip(units, before))  # ... and lands only there
        tier.submit(second, 0.25)  # lands the first, takes the second
        for unit, want in zip(units, expected):
            assert torch.equal(unit.local, want)
        assert tier.pending
        tier.complete()
        assert not tier.pending and tier.timings["steps"] == 2
        assert tier.timings["cpu_step_s"] > 0  # the actors' own seconds, landed from the object store
        assert not torch.equal(units[0].local, expected[0])
    finally:
        _close(tier)


@pytest.mark.parametrize("from_store", [True, False])
def test_the_lookahead_lands_in_the_actor_tier_as_in_the_host_tier(connected, from_store):
    """The delayed update with the lookahead (``raydeep.tier.lookahead``): each ``submit`` lands
    the pending update as ``base - rate * gradient`` from the actors' terms, bit for bit as the
    host tier computes them in-process; ``complete`` lands the masters' own parameters (fetched),
    those of the same updates without the delay. A CPU rank lands the terms from the object
    store's buffers; an accelerator's rank copies them into held host buffers first (forced here)."""
    from raydeep.tier.local import HostTier

    actor_units, host_units, exact_units = _units(), _units(), _units()
    tier = ActorTier(actor_units, [{}], ADAMW, 128, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5, lookahead=True)
    tier.land_from_store = from_store
    host = HostTier(host_units, [{}], ADAMW, 128, delayed=True, lookahead=True)
    exact = HostTier(exact_units, [{}], ADAMW, 128)
    try:
        for t in range(1, 4):
            for each, units in ((tier, actor_units), (host, host_units)):
                each.submit(_grads(units, t), 0.5)
            exact.step(_grads(exact_units, t), 0.5)
            for a, h in zip(actor_units, host_units):
                assert torch.equal(a.local, h.local), f"after submit {t}"
        # Landed by prediction: near the masters' parameters of two updates, not equal to them.
        assert not torch.equal(actor_units[0].local, exact_units[0].local)
        tier.complete()
        host.complete()
        for a, h, e in zip(actor_units, host_units, exact_units):
            assert torch.equal(a.local, e.local) and torch.equal(h.local, e.local)
        # The gradients wait in the object store; held host buffers take the bases and rates, where
        # they are not landed from the object store
        copies = 1 if from_store else 3
        assert tier.memory()["step_buffers"]["cpu"] == sum(copies * u.local.numel() * 4 for u in actor_units)
    finally:
        _close(tier)
        host.close()


def _updates_both_ways(lookahead: bool, modes: list[str]) -> dict:
    """The same updates through a tier whose actors share windows with this process and through
    one that uses the object store, for each of ``modes`` in turn (plain steps; the delayed update,
    with ``lookahead`` or not): whether the parameters are equal after each update, and what the
    step calls carried."""
    import glob

    tiers, units = {}, {}
    for shared in (True, False):
        units[shared] = _units()
        tiers[shared] = ActorTier(units[shared], [{}], ADAMW, 128, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5,
                                  lookahead=lookahead, shared_memory=shared)
    try:
        out = {"windows": [w is not None for w in tiers[True].windows],
               "store windows": [w is not None for w in tiers[False].windows],
               "files left": glob.glob("/dev/shm/raydeep-offload-*"), "sub-groups": len(tiers[True].sub_groups)}
        log = _spied(tiers[True])
        for mode in modes:
            equal, first = [], len(log)
            for t in range(1, 4):
                for shared, tier in tiers.items():
                    grads = _grads(units[shared], t)
                    if mode == "step":
                        tier.step(grads, 0.5)
                    else:
                        tier.submit(grads, 0.5)
                        for g in grads:
                            g.zero_()  # the engine clears them: the window holds its own copy
                        tier.release()
                equal.append(all(torch.equal(a.local, b.local) for a, b in zip(units[True], units[False])))
            for tier in tiers.values():
                tier.complete()
            equal.append(all(torch.equal(a.local, b.local) for a, b in zip(units[True], units[False])))
            out[mode] = {"equal": equal, "step calls": [n for _, method, n in log[first:] if method == "step"]}
        out["traffic"] = [tiers[True].traffic, tiers[False].traffic]
        out["window bytes"] = tiers[True].memory()["step_buffers"].get("cpu", 0)
        out["window size"] = sum(w.nbytes for w in tiers[True].windows)
        out["reported"] = tiers[True].report()["shared_memory"]
        return out
    finally:
        for tier in tiers.values():
            _close(tier)


def _chosen_on_this_node() -> dict:
    """The tier ``select_tier`` builds for a rank on the offload node, and the placement it asks for."""
    from types import SimpleNamespace

    from raydeep.tier.select import OffloadSettings, offload_nodes, select_tier

    settings = OffloadSettings(stage=2, sub_group_size=128, offload=SimpleNamespace(device="cpu", ratio=1.0),
                               target="actors", resource=OFFLOAD_MARK, actor_cpus=0.5)
    tier = select_tier(settings, _units(), [{}], ADAMW)
    try:
        strategy = tier.placement.get("scheduling_strategy")
        return {"here": ray.get_runtime_context().get_node_id(), "marked": offload_nodes(OFFLOAD_MARK),
                "near": (strategy.node_id, strategy.soft) if strategy is not None else None,
                "windows": [w is not None for w in tier.windows]}
    finally:
        tier.close()


def _beside_the_actors() -> dict:
    """Run on the offload node, as a rank would run beside its actors (one task for all of it:
    each task and actor is a process to start)."""
    return {"plain": _updates_both_ways(False, ["step", "delayed"]), "lookahead": _updates_both_ways(True, ["delayed"]),
            "chosen": _chosen_on_this_node()}


@pytest.fixture(scope="module")
def beside_the_actors(shared_ray) -> dict:
    from tests.ray.conftest import connect

    connect(shared_ray.address)
    found = ray.get(ray.remote(_beside_the_actors).options(num_cpus=0.5, **PLACEMENT).remote())
    print(f"\nbeside the actors: {found}")
    return found


@pytest.mark.parametrize("lookahead,mode", [(False, "step"), (False, "delayed"), (True, "delayed")])
def test_actors_on_the_ranks_node_exchange_through_shared_memory_with_the_same_bits(beside_the_actors, lookahead,
                                                                                   mode):
    """An offload actor on the rank's own node reads the gradients from, and writes its results
    into, a window of shared memory (``raydeep.tier.shared_window``): its step calls carry no
    arrays, the parameters are those of the object store's path bit for bit (plain steps, the
    delayed update, its lookahead), and no file is left in /dev/shm. The rank runs as a task on
    the offload node, beside its actors; from this driver's node (no actor is on it) the same
    tier uses the object store."""
    found = beside_the_actors["lookahead" if lookahead else "plain"]
    assert found["windows"] == [True, True] and found["store windows"] == [False, False]
    assert found["files left"] == []
    assert found[mode]["equal"] == [True] * 4
    assert found[mode]["step calls"] == [0] * (3 * found["sub-groups"])  # gradients and results in the window
    assert found["traffic"][0] == found["traffic"][1]  # the same bytes, moved another way
    assert found["window bytes"] == found["window size"] > 0
    assert found["reported"] == 2


def test_a_rank_on_an_offload_node_asks_for_its_actors_there_first(beside_the_actors):
    """A rank whose own node is marked for offload (a GPU node lending its spare CPUs) asks for
    its actors on that node, softly (another marked node takes them when it is full), and
    shares windows with them; a rank elsewhere asks for any marked node."""
    from raydeep.tier.select import near_the_rank, offload_nodes

    found = beside_the_actors["chosen"]
    assert found["marked"] == [found["here"]]
    assert found["near"] == (found["here"], True) and found["windows"] == [True]
    assert near_the_rank(PLACEMENT, offload_nodes(OFFLOAD_MARK)) == PLACEMENT  # this driver's node is not marked
    elsewhere = ActorTier(_units(), [{}], ADAMW, 128, PLACEMENT, actors_per_rank=1, cpus_per_actor=0.5)
    try:
        assert elsewhere.windows == [None] and elsewhere.report()["shared_memory"] == 0
    finally:
        elsewhere.close()


def test_actors_write_their_snapshot_where_they_see_the_rank_write_and_hand_it_over_where_not(connected, tmp_path):
    """Two snapshots of the same state: one written by the actors (they see the mark of the
    staging location), one handed to this process and written here (a mark they cannot see, as
    a node-local directory on another node would be): the same files, byte for byte, and only the
    second brings the state here. A snapshot held in an actor costs 12 bytes per element there
    until written or discarded."""
    from raydeep.checkpoint.writer import RemoteSink, TagWriter
    from raydeep.storage import Storage
    from tests.ray.tensors import actor_storage_bytes

    units = _units()
    tier = ActorTier(units, [{}], ADAMW, 256, PLACEMENT, actors_per_rank=2, cpus_per_actor=0.5)
    try:
        tier.step(_grads(units, 1), 0.5)
        ranges = [u.held_range()[:2] for u in units]
        shard = sum(hi - lo for lo, hi in ranges)
        writer = TagWriter(Storage.open(str(tmp_path)), "t", fsync=False)
        writer.prepare(mark="seen")
        entries, received = {}, {}
        for how, mark in (("by the actors", "seen"), ("handed over", "not there")):
            before = tier.traffic["received"]
            snap = tier.remote_snapshot(ranges)
            names = [f"{how.replace(' ', '-')}-{a}.safetensors" for a in range(2)]
            entries[how] = snap.write(names, RemoteSink(writer, mark))
            received[how] = tier.traffic["received"] - before
        assert received == {"by the actors": 0, "handed over": 12 * shard}, received
        assert entries["by the actors"] == entries["handed over"]
        assert sorted(p.name for p in (tmp_path / ".t.staging").iterdir()) == sorted(
            [".rank0-token"] + [f"{how}-{a}.safetensors" for how in ("by-the-actors", "handed-over") for a in range(2)])

        held = sum(actor_storage_bytes(a) for a in tier.actors)
        snap = tier.remote_snapshot(ranges)
        snap.state()  # the copies are taken
        assert sum(actor_storage_bytes(a) for a in tier.actors) == held + 12 * shard
        snap.discard()
        assert sum(actor_storage_bytes(a) for a in tier.actors) == held
        assert ray.get([a.__ray_call__.remote(lambda actor: actor._saved) for a in tier.actors]) == [None, None]
    finally:
        _close(tier)
