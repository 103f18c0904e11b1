"""The optimizer tier's interface, tested directly on the local tier (no process group).

Units are built as rank 1 of 2 (a ZeRO shard, so element ranges start past zero) or unpartitioned
(stage 0); the engine's behaviour through the tier is covered by the parity and checkpoint suites.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import raydeep
from raydeep.optim.optimizers import build_optimizer, resolve_optimizer
from raydeep.optim.schedulers import build_scheduler
from raydeep.tier import HostTier, LocalTier, OptimizerTier, TierState, UnitRange, cpu_update
from raydeep.tier.masters import ALIGN, plan_sub_groups
from raydeep.zero.flat import FlatUnit


def _units(dtype: torch.dtype = torch.float32, partitions: int = 2, rank: int = 1,
           shapes=((("a", (3, 5)), ("b", (7,))), (("c", (4, 3)),))) -> list[FlatUnit]:
    torch.manual_seed(0)
    return [FlatUnit(f"u{i}", [(n, nn.Parameter(torch.randn(s).to(dtype))) for n, s in named], rank, partitions,
                     group_index=i, grad_dtype=dtype, separate_local=False)
            for i, named in enumerate(shapes)]


def _adamw(units, lr: float = 1e-2) -> LocalTier:
    spec = resolve_optimizer("AdamW", {"lr": lr, "weight_decay": 0.1})
    return LocalTier(units, [{}, {"weight_decay": 0.0}], lambda groups: build_optimizer(spec, groups))


def _grads(units, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(u.layout.shard_numel, generator=g).to(u.grad.dtype) for u in units]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_local_tier_is_an_optimizer_tier_and_writes_the_model_dtype_shard():
    units = _units(torch.bfloat16)
    tier = _adamw(units)
    assert isinstance(tier, OptimizerTier) and tier.optimizer_name == "AdamW"
    tier.step(_grads(units, 1), scale=0.5)
    for unit, master in zip(units, tier.masters):
        assert master.dtype == torch.float32 and master.grad is None
        assert _same(unit.local, master.detach().to(torch.bfloat16))


def test_state_dict_round_trip_over_ranges_continues_bitwise():
    units_a, units_b = _units(), _units()
    a, b = _adamw(units_a), _adamw(units_b)
    for seed in range(3):
        a.step(_grads(units_a, seed), scale=0.25)
    b.step(_grads(units_b, 99), scale=1.0)  # different history, to be overwritten
    state = a.state_dict()
    assert list(state.state_dtypes) == ["exp_avg", "exp_avg_sq"] and state.optimizer == "AdamW"
    assert [set(g) for g in state.scalars] == [{"step"}, {"step"}]
    assert [g["weight_decay"] for g in state.param_groups] == [0.1, 0.0]
    for unit, piece in zip(units_a, state.units):
        start, end, _ = unit.held_range()
        assert (piece.start, piece.end) == (start, end) and piece.master.numel() == end - start
    b.load_state_dict(state)
    for unit_a, unit_b in zip(units_a, units_b):
        assert _same(unit_a.full, unit_b.full)
    for seed in (7, 8):
        a.step(_grads(units_a, seed), scale=0.25)
        b.step(_grads(units_b, seed), scale=0.25)
    for ma, mb in zip(a.shards.params, b.shards.params):
        assert _same(ma.detach(), mb.detach())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert _same(a.state[ma][key], b.state[mb][key])


def test_state_dict_of_sub_ranges_is_the_slice_of_the_whole():
    units = _units(partitions=1, rank=0)  # stage 0: a checkpoint splits each unit across ranks
    tier = _adamw(units)
    tier.step(_grads(units, 1), scale=1.0)
    whole = tier.state_dict()
    ranges = [(2, 9), (0, 5)]
    part = tier.state_dict(ranges)
    for (lo, hi), w, p in zip(ranges, whole.units, part.units):
        assert (p.start, p.end) == (lo, hi)
        assert _same(p.master, w.master[lo:hi])
        assert all(_same(p.states[k], w.states[k][lo:hi]) for k in w.states)


def test_masters_only_state_leaves_the_optimizer_alone():
    units = _units()
    tier = _adamw(units)
    tier.step(_grads(units, 1), scale=1.0)
    first = tier.shards.params[0]
    before = {k: v.clone() for k, v in tier.state[first].items()}
    pieces = [UnitRange(p.start, p.end, torch.full_like(p.master, 2.0)) for p in tier.state_dict().units]
    tier.load_state_dict(TierState(pieces))
    start, end, base = units[0].held_range()
    assert torch.all(units[0].local[:end - base] == 2.0)
    assert all(_same(v, tier.state[first][k]) for k, v in before.items())


def test_param_group_writes_reach_the_update():
    units = _units(partitions=1, rank=0)
    tier = LocalTier(units, [{}, {}], lambda groups: torch.optim.SGD(groups, lr=0.5))
    before = [u.local.clone() for u in units]
    tier.param_groups[1]["lr"] = 0.25
    tier.step([torch.ones(u.layout.shard_numel) for u in units], scale=2.0)
    assert torch.equal(units[0].local, before[0] - 0.5 * 2.0)
    assert torch.equal(units[1].local, before[1] - 0.25 * 2.0)
    # DeepSpeed's schedulers drive a tier through the same param_groups.
    build_scheduler("WarmupLR", {"warmup_min_lr": 0.125, "warmup_max_lr": 1.0}, tier)
    assert [g["lr"] for g in tier.param_groups] == [0.125, 0.125]
    after = [u.local.clone() for u in units]
    tier.step([torch.ones(u.layout.shard_numel) for u in units], scale=1.0)
    assert all(torch.equal(u.local, b - 0.125) for u, b in zip(units, after))


def test_memory_accounts_masters_and_states():
    units = _units(torch.bfloat16)
    tier = _adamw(units)
    shard = sum(u.layout.shard_numel for u in units)
    assert tier.memory() == {"master": {"cpu": 4 * shard}, "optimizer_states": {}, "step_buffers": {}}
    tier.step(_grads(units, 1), scale=1.0)
    assert tier.memory() == {"master": {"cpu": 4 * shard}, "optimizer_states": {"cpu": 2 * 4 * shard},
                             "step_buffers": {"cpu": 4 * shard}}  # one sub-group: every fp32 gradient at once
    fp32 = _units(torch.float32)
    assert _adamw(fp32).memory()["master"] == {}  # in fp32 training the master is the shard itself


def test_reload_from_params_takes_the_masters_from_the_shards():
    units = _units(torch.bfloat16)
    tier = _adamw(units)
    units[1].local.fill_(3.0)
    tier.reload_from_params([1])
    assert torch.all(tier.masters[1] == 3.0) and not torch.all(tier.masters[0] == 3.0)


def test_engine_optimizer_fronts_the_tier():
    model = nn.Linear(4, 2)
    engine, optimizer, _, scheduler = raydeep.initialize(model=model, config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1}},
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    # DeepSpeed's ZeRO-optimizer contract in front of the tier (tests/unit/test_client_surface.py)
    assert optimizer is engine.optimizer and isinstance(engine.tier, OptimizerTier)
    assert optimizer.param_groups is engine.tier.param_groups and optimizer.masters is engine.tier.masters
    assert scheduler.optimizer is engine.tier and engine.get_lr() == [0.01]
    engine.backward(engine(torch.ones(2, 4, dtype=torch.bfloat16)).float().pow(2).mean())
    engine.step()
    memory = engine.memory_breakdown()
    numel = sum(p.numel() for p in model.parameters())
    assert list(memory) == ["params", "grads", "master", "optimizer_states", "buffers", "total", "offloaded",
                            "step_buffers"]
    assert memory["total"] == sum(memory[k] for k in ("params", "grads", "master", "optimizer_states", "buffers"))
    assert memory["offloaded"] == 0
    assert memory["master"] >= 4 * numel and memory["optimizer_states"] >= 8 * numel
    with pytest.raises(ValueError, match="parameter groups"):
        engine.tier.load_state_dict(TierState(engine.tier.state_dict().units, param_groups=[{}, {}], scalars=[]))


# --- sub-group tiling and the host tier -----------------------------------------------------------------
BIG = ((("a", (17, 19)), ("b", (101,))), (("c", (13, 23)),))  # units cut by sub-groups of 64 and more


def _tier(kind: str, units, sub_group_size: int = 10**9, fused: bool = True):
    spec = resolve_optimizer("AdamW", {"lr": 1e-2, "weight_decay": 0.1, **({} if fused else {"foreach": True})})
    make = lambda groups: build_optimizer(spec, groups, prefer_fused=fused)  # noqa: E731
    cls = HostTier if kind == "host" else LocalTier
    return cls(units, [{}, {"weight_decay": 0.0}], make, sub_group_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,sub_group_size", [("local", 64), ("local", 200), ("host", 10**9), ("host", 128)])
def test_tiers_and_tilings_compute_the_same_bits(dtype, kind, sub_group_size):
    """Adam is elementwise: tiling the update into sub-groups, or running it on host masters,
    changes where and when each element is computed, never what."""
    ref_units, units = _units(dtype, shapes=BIG), _units(dtype, shapes=BIG)
    ref, tier = _tier("local", ref_units), _tier(kind, units, sub_group_size)
    for seed in range(3):
        ref.step(_grads(ref_units, seed), scale=0.5)
        tier.step(_grads(units, seed), scale=0.5)
    for a, b in zip(ref_units, units):
        assert _same(a.full, b.full)
    whole, tiled = ref.state_dict(), tier.state_dict()
    for p, q in zip(whole.units, tiled.units):
        assert _same(p.master, q.master) and all(_same(p.states[k], q.states[k]) for k in p.states)
    assert whole.scalars == tiled.scalars and whole.param_groups == tiled.param_groups
    # The tiled state loads into the whole one and the reverse (checkpoints do not see the tiling).
    ref.load_state_dict(tiled)
    tier.load_state_dict(whole)
    ref.step(_grads(ref_units, 9), scale=1.0)
    tier.step(_grads(units, 9), scale=1.0)
    assert all(_same(a.full, b.full) for a, b in zip(ref_units, units))


def test_sub_group_size_bounds_the_fp32_gradients_held_at_once():
    """An optimizer that steps whole chunks holds one sub-group's fp32 gradients at once; Adam in
    pieces holds one chunk's at most, and none with the one-pass CPU update."""
    units = _units(torch.bfloat16, shapes=BIG)
    shard = sum(u.layout.shard_numel for u in units)
    assert shard > 256
    for size in (10**9, 128, 256):
        tier = _tier("local", _units(torch.bfloat16, shapes=BIG), size, fused=False)
        assert tier.shards.pieces is None
        tier.step(_grads(units, 1), scale=1.0)
        largest = max(sum(c.numel for c in sg) for sg in tier.sub_groups)
        assert largest == min(shard, size) if size != 256 else largest <= size
        assert tier.memory()["step_buffers"] == {"cpu": 4 * largest}, size

        pieces = _tier("local", _units(torch.bfloat16, shapes=BIG), size)
        assert pieces.shards.pieces is not None
        pieces.step(_grads(units, 1), scale=1.0)
        chunk = max(c.numel for sg in pieces.sub_groups for c in sg)
        expected = {} if cpu_update.available() else {"cpu": 4 * chunk}
        assert pieces.memory()["step_buffers"] == expected, size


def test_plan_sub_groups_cuts_aligned_and_packs_in_unit_order():
    plan = plan_sub_groups([200, 30, 100], [0, 1, 1], 128)
    assert [[(c.unit, c.group, c.lo, c.hi) for c in sg] for sg in plan] == [
        [(0, 0, 0, 128)], [(0, 0, 128, 200), (1, 1, 0, 30)], [(2, 1, 0, 100)]]
    assert [[(c.unit, c.lo, c.hi) for c in sg] for sg in plan_sub_groups([5, 3], [0, 0], 4)] == [
        [(0, 0, 5), (1, 0, 3)]]  # below ALIGN: sub-groups of ALIGN elements
    assert [[(c.unit, c.lo, c.hi) for c in sg] for sg in plan_sub_groups([5, 3], [0, 0], 0)] == [
        [(0, 0, 5)], [(1, 0, 3)]]


def test_the_actor_tier_cuts_only_elementwise_optimizers_to_the_tile():
    """Offload actors get Adam/AdamW in pieces of the tile whatever ``sub_group_size`` is (the same
    bits: tests/ray/test_offload_actors_tier.py); any other optimizer keeps DeepSpeed's sub-groups."""
    from raydeep.tier.pieces import pieces_of

    def made(cls, **kw):
        return cls([nn.Parameter(torch.zeros(1))], lr=0.1, **kw)
    adamw, adam = made(torch.optim.AdamW, fused=True), made(torch.optim.Adam, fused=True)
    assert [pieces_of(size, 4096, adamw) for size in (10**9, 1000, 0)] == [4096, 1000, 4096]
    assert pieces_of(10**9, 4096, adam) == 4096
    for other in (made(torch.optim.SGD), made(torch.optim.AdamW, foreach=True), made(torch.optim.Adagrad)):
        assert [pieces_of(size, 4096, other) for size in (10**9, 0)] == [10**9, 0], type(other).__name__


def test_host_tier_keeps_separate_fp32_masters_in_host_memory():
    units = _units(torch.float32)
    tier = _tier("host", units)
    shard = sum(u.layout.shard_numel for u in units)
    assert all(m.data_ptr() != u.local.data_ptr() and m.device.type == "cpu" for m, u in zip(tier.masters, units))
    tier.step(_grads(units, 1), scale=1.0)
    assert tier.memory()["master"] == {"cpu": 4 * shard}
    units[0].local.fill_(3.0)
    tier.reload_from_params([0])
    assert torch.all(tier.masters[0] == 3.0)


def test_offload_with_a_client_optimizer_follows_deepspeeds_flag():
    """DeepSpeed refuses ZeRO-Offload with a client optimizer unless zero_force_ds_cpu_optimizer
    is false; then the client's class runs on the host masters."""
    from raydeep.errors import ConfigError

    config = {"train_batch_size": 2, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
              "raydeep": {"offload_target": "host", "empty_cache_every": 3}}
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="zero_force_ds_cpu_optimizer"):
        raydeep.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    engine, *_ = raydeep.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    config={**config, "zero_force_ds_cpu_optimizer": False})
    assert isinstance(engine.tier, HostTier) and engine.tier.optimizer_name == "SGD"
    assert engine.settings.empty_cache_every == 3


def test_actors_without_a_ray_cluster_is_a_config_error_naming_the_key():
    import ray

    from raydeep.errors import ConfigError

    assert not ray.is_initialized()
    with pytest.raises(ConfigError, match="raydeep.offload_target") as info:
        raydeep.initialize(model=nn.Linear(4, 2), config={
            "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "raydeep": {"offload_target": "actors"}})
    assert "raydeep_offload" in str(info.value)
    # auto, outside a Ray cluster: the host tier
    engine, *_ = raydeep.initialize(model=nn.Linear(4, 2), config={
        "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert isinstance(engine.tier, HostTier)
