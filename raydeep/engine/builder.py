"""build_engine: the one place where features are chosen from the config.

It casts the model to the training precision, makes every rank start from rank 0's weights,
wraps the modules chosen for activation checkpointing, groups parameters into FlatUnits, picks
the ZeRO strategy for the stage, and builds the optimizer tier (the fp32 masters of the owned
shards, the optimizer over them, the update; ``raydeep.tier``), LR scheduler and loss scaler.
Each component gets only its own section.

A model built under ``raydeep.zero.Init`` arrives partitioned: its slices are moved and cast in
place (never the full parameters), and each FlatUnit assembles its shard from them. At stages
0-2, which keep the full parameters on every rank anyway, the units gather them.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import nn

from raydeep import comm
from raydeep.comm import order as collective_order
from raydeep.checkpoint import Checkpointer
from raydeep.checkpoint.parts import CheckpointParts, CheckpointSettings, CopyFence
from raydeep.config import RaydeepConfig
from raydeep.doctor.oom import OomDiagnosis
from raydeep.errors import ConfigError
from raydeep.activation import apply_activation_checkpointing, offload_saved_activations
from raydeep.engine.engine import Engine, EngineSettings
from raydeep.monitor import build_monitors
from raydeep.optim.optimizers import ONEBIT_OPTIMIZERS, build_optimizer, resolve_optimizer
from raydeep.optim.schedulers import SCHEDULER_NAMES, build_scheduler
from raydeep.precision.diagnosis import OverflowWatch
from raydeep.precision.loss_scaler import build_loss_scaler
from raydeep.tier import OptimizerTier
from raydeep.tier.select import OffloadSettings, rebuild_client_optimizer, select_tier
from raydeep.train_state import TrainState
from raydeep.zero import hierarchy, partitioned, residency
from raydeep.zero.flat import FlatUnit
from raydeep.zero.layout import plan_buckets
from raydeep.zero.stage3 import PrefetchPolicy, Stage3
from raydeep.zero.strategy import ReduceSpec, Stage0, Stage1, Stage2, StrategyLinks

logger = logging.getLogger("raydeep")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build_engine(model: nn.Module, cfg: RaydeepConfig, model_parameters=None, optimizer=None,
                 lr_scheduler=None, device: torch.device | None = None, raw_config=None) -> Engine:
    """Wire an Engine for ``model`` from a resolved config (see ``raydeep.initialize``): every
    part is made here and handed its collaborators; ``raw_config`` is what the caller passed
    (``engine.config``, as DeepSpeed keeps it)."""
    device = device or torch.device("cpu")
    rank, world = comm.rank(), comm.world_size()
    assert world == cfg.world_size, f"config resolved for world size {cfg.world_size}, process group has {world}"
    dtype = DTYPES[cfg.precision]
    stage = cfg.zero_optimization.stage
    stats = comm.CommStats()
    # Before the first broadcast, as DeepSpeed configures its comms logger before its own.
    comm.configure_comms_logger(cfg.comms_logger)
    _place_parameters(model, device, dtype, stats, stage)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.raydeep.checkpoint_modules)
    if cfg.raydeep.offload_activations:
        offload_saved_activations(model, device)
    groups = _param_groups(model, model_parameters)
    units, extra = _build_units(model, groups, cfg, rank, world, dtype)
    tier = _build_tier(cfg, groups, units, optimizer, stats)
    fence = CopyFence()  # closed while an asynchronous save copies the masters
    links = StrategyLinks(fence=fence.wait, masters_changed=tier.reload_from_params,
                          tier_communicates=tier.communicates_gradients)
    strategy = _build_strategy(stage, units, cfg, world, dtype, stats, extra, links)
    sched = _build_scheduler(cfg, tier, lr_scheduler)
    scaler = build_loss_scaler(cfg.fp16.model_dump() if cfg.fp16.enabled else None, stage, rank=rank)
    stats.reset()
    if collective_order.requested(cfg.raydeep.check_collective_order):
        comm.enable_order_check(cfg.raydeep.collective_order_timeout_s)
    settings = EngineSettings(
        train_batch_size=cfg.train_batch_size, micro_batch=cfg.train_micro_batch_size_per_gpu,
        grad_accum=cfg.gradient_accumulation_steps, gradient_clipping=cfg.gradient_clipping,
        precision=cfg.precision, stage=stage, steps_per_print=cfg.steps_per_print,
        skip_nonfinite=cfg.precision != "bf16" or stage in (0, 3) or cfg.bf16.check_grad_overflow,
        compute_grad_norm=cfg.zero_optimization.compute_grad_norm, auto_cast=cfg.fp16.auto_cast,
        comms_logger=cfg.comms_logger is not None, wall_clock_breakdown=cfg.wall_clock_breakdown,
        empty_cache_every=cfg.raydeep.empty_cache_every,
        overflow_diagnosis_after=cfg.raydeep.overflow_diagnosis_after,
        gather_16bit_weights_on_model_save=cfg.zero_optimization.gather_16bit_weights_on_model_save,
        delayed_update_after=_delayed_update_after(cfg))
    state = TrainState()
    parts = CheckpointParts(module=model, units=units, tier=tier, scaler=scaler, scheduler=sched, train_state=state,
                            publish=strategy.publish, rank=rank, world_size=world, device=device, stage=stage,
                            precision=cfg.precision)
    return Engine(model, strategy, tier, sched, scaler, stats, settings, device=device, rank=rank, world_size=world,
                  checkpointer=Checkpointer(parts, CheckpointSettings.from_config(cfg), fence), state=state,
                  oom=OomDiagnosis(cfg, model, device),
                  overflow_watch=OverflowWatch(cfg.raydeep.overflow_diagnosis_after, units),
                  monitors=build_monitors(cfg.tensorboard, cfg.csv_monitor, rank), config=raw_config)


def _delayed_update_after(cfg) -> int | None:
    """The steps before the delayed update starts: ``raydeep.delayed_update`` with its warm-up, or
    DeepSpeed's ``zenflow.overlap_step`` with ZenFlow's ``full_warm_up_rounds`` when given."""
    zenflow = cfg.zero_optimization.zenflow
    if zenflow is not None and zenflow.overlap_step:
        given = "full_warm_up_rounds" in zenflow.model_fields_set
        return zenflow.full_warm_up_rounds if given else cfg.raydeep.delayed_update_warmup_steps
    return cfg.raydeep.delayed_update_warmup_steps if cfg.raydeep.delayed_update else None


def _place_parameters(model: nn.Module, device: torch.device, dtype: torch.dtype, stats, stage: int) -> None:
    """Move to ``device``, cast parameters to the training dtype (0.19.8: buffers keep theirs) and
    make every rank start from rank 0's weights, as DeepSpeed does. Init-partitioned parameters
    were broadcast when they were partitioned; only their slices move."""
    split = [p for p in model.parameters() if partitioned.is_partitioned(p)]
    for p in split:
        partitioned.move(p, device, dtype)  # before model.to(): that would expand the placeholders
    if split and stage < 3:
        logger.warning("the model was built under zero.Init, but ZeRO stage %d keeps full parameters on every "
                       "rank: gathering them", stage)
    model.to(device)
    whole = [p for p in model.parameters() if not partitioned.is_partitioned(p)]
    for p in whole:
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    for t in whole + list(model.buffers()):
        comm.broadcast(t.data, 0, stats)


def _param_groups(model: nn.Module, model_parameters) -> list[tuple[dict, list[tuple[str, nn.Parameter]]]]:
    """Normalise ``model_parameters`` (None, tensors, or group dicts) to named groups."""
    names = {p: n for n, p in model.named_parameters()}
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        raw = [({k: v for k, v in g.items() if k != "params"}, list(g["params"])) for g in model_parameters]
    else:
        raw = [({}, model_parameters)]
    seen, groups = set(), []
    for opts, params in raw:
        named = []
        for p in params:
            if p in seen:
                raise ValueError(f"parameter {names.get(p, '?')} appears in more than one parameter group")
            seen.add(p)
            named.append((names[p], p))
        if named:  # DeepSpeed drops empty groups
            groups.append((opts, named))
    return groups


def _build_units(model, groups, cfg, rank, world, dtype):
    zero = cfg.zero_optimization
    grad_dtype = DTYPES[cfg.grad_accum_dtype]
    if zero.stage < 3:
        partitions = 1 if zero.stage == 0 else world
        units = []
        for g, (_, named) in enumerate(groups):
            ordered = named[::-1]  # gradients arrive roughly in reverse order: bucket that way
            for bucket in plan_buckets([p.numel() for _, p in ordered], zero.reduce_bucket_size):
                units.append(FlatUnit(f"group{g}.bucket{len(units)}", [ordered[i] for i in bucket], rank,
                                      partitions, g, grad_dtype, separate_local=False))
        return units, None
    return _stage3_units(model, groups, cfg, rank, world, grad_dtype)


def partition_modules(model: nn.Module, spec) -> list[nn.Module]:
    """The stage-3 partition units: the root first, then each block (``"auto"``: every element
    of an ``nn.ModuleList``, e.g. each transformer layer), leaf modules (``"param"``), or the
    modules whose class name is listed."""
    if spec == "auto":
        inner = [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]
    elif spec == "param":
        inner = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
    else:
        inner = [m for m in model.modules() if type(m).__name__ in set(spec)]
    return [model] + [m for m in inner if any(p.requires_grad for p in m.parameters())]


def _stage3_units(model, groups, cfg, rank, world, grad_dtype):
    zero = cfg.zero_optimization
    modules = partition_modules(model, cfg.raydeep.partition_units)
    owner = _unit_owners(modules)
    group_of = {p: g for g, (_, named) in enumerate(groups) for _, p in named}
    offload = zero.offload_param
    host_params = offload is not None and offload.device == "cpu"  # ZeRO-3 Offload of the parameters
    ordered = [(name, p) for _, named in groups for name, p in named]
    kept = residency.persistent([p.numel() for _, p in ordered], zero.param_persistence_threshold,
                                zero.model_persistence_threshold)
    buckets: dict[tuple, list] = {}
    for (name, p), small in zip(ordered, kept):
        key = ("persistent", group_of[p]) if small else (owner[p], group_of[p])
        buckets.setdefault(key, []).append((name, p))
    units, persistent, module_units = [], set(), [(m, []) for m in modules]
    for key, named in buckets.items():
        index = len(units)
        units.append(FlatUnit(f"{key[0]}.group{key[1]}", named, rank, world, key[1], grad_dtype,
                              separate_local=key[0] != "persistent", host_local=host_params,
                              pin_memory=bool(offload and offload.pin_memory)))
        if key[0] == "persistent":
            persistent.add(index)
        else:
            module_units[key[0]][1].append(index)
    return units, (module_units, persistent)


def _unit_owners(modules: list[nn.Module]) -> dict[nn.Parameter, int]:
    """The partition unit that gathers each parameter: the deepest unit on the path to every unit
    that uses it. A weight shared by sibling units (an embedding tied to the lm_head under
    ``partition_units: "param"``) goes to their common ancestor -- at least the root, which stays
    fetched through forward and backward -- because each sibling's hooks fetch only its own units."""
    inside = [{id(m) for m in module.modules()} for module in modules]
    users: dict[nn.Parameter, list[int]] = {}
    for m_index, module in enumerate(modules):  # pre-order: an ancestor comes before its descendants
        for p in module.parameters():
            users.setdefault(p, []).append(m_index)

    def on_one_path(i: int, found: list[int]) -> bool:  # each other unit is i's ancestor or descendant
        return all(id(modules[j]) in inside[i] or id(modules[i]) in inside[j] for j in found)
    return {p: max(i for i in found if on_one_path(i, found)) for p, found in users.items()}


def _build_strategy(stage, units, cfg, world, dtype, stats, extra, links: StrategyLinks):
    comm_dtype = DTYPES[cfg.communication_data_type] if cfg.communication_data_type else dtype
    zero = cfg.zero_optimization
    reduce = ReduceSpec(world, comm_dtype, average=cfg.gradient_allreduce_op == "mean",
                        prescale=cfg.prescale_gradients, predivide=cfg.gradient_predivide_factor,
                        overlap=zero.overlap_comm)
    if stage == 3:
        module_units, persistent = extra
        policy = PrefetchPolicy(zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance)
        plus = hierarchy.build(zero, comm.rank(), world)
        return Stage3(units, reduce, stats, module_units, persistent, policy, links, plus)
    return {0: Stage0, 1: Stage1, 2: Stage2}[stage](units, reduce, stats, links)


def _build_tier(cfg, groups, units, client_optimizer, stats) -> OptimizerTier:
    """The optimizer tier over the units (``raydeep.tier.select``); the torch optimizer comes from
    the client or the config, through a factory that pickles (offload actors build it too)."""
    offload = OffloadSettings.of(cfg.zero_optimization, cfg.raydeep)
    if client_optimizer is not None:
        if offload.offloading and cfg.zero_force_ds_cpu_optimizer:
            raise ConfigError("zero_force_ds_cpu_optimizer", "You are using ZeRO-Offload with a client provided "
                              f"optimizer ({type(client_optimizer).__name__}) which in most cases will yield poor "
                              "performance", value=True, fix="set an optimizer in the ds_config (raydeep runs it "
                              "with torch's fused CPU kernel) or set \"zero_force_ds_cpu_optimizer\": false")
        if callable(client_optimizer) and not isinstance(client_optimizer, torch.optim.Optimizer):
            make = client_optimizer
        else:  # rebuild the user's optimizer over the master shards, keeping its hyperparameters
            make = functools.partial(rebuild_client_optimizer, type(client_optimizer),
                                     dict(client_optimizer.defaults))
    elif cfg.optimizer is None:
        raise ValueError("no optimizer: add an \"optimizer\" section to the config or pass optimizer=")
    else:
        spec = resolve_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params))
        if spec.name in ONEBIT_OPTIMIZERS:
            return _compressed_tier(cfg, spec, groups, units, stats)
        make = functools.partial(build_optimizer, spec, prefer_fused=True)
    return select_tier(offload, units, [opts for opts, _ in groups], make)


def _compressed_tier(cfg, spec, groups, units, stats) -> OptimizerTier:
    """1-bit Adam or 0/1 Adam: the tier that takes over gradient communication (stage 0; the
    config rules refuse ZeRO)."""
    from raydeep.compression.allreduce import CompressedAllReduce
    from raydeep.tier.compressed import CompressedTier

    kwargs = dict(spec.kwargs)
    backend = kwargs.get("comm_backend_name")
    ours = dist.get_backend() if dist.is_initialized() else "gloo"
    if backend is not None and backend != ours and comm.rank() == 0:
        logger.warning("optimizer.params.comm_backend_name %r: the compressed all-reduce runs over this process "
                       "group's backend, %s", backend, ours)
    return CompressedTier(units, [opts for opts, _ in groups], spec.cls, kwargs, CompressedAllReduce(stats),
                          cfg.zero_optimization.sub_group_size)


def _build_scheduler(cfg, tier: OptimizerTier, client_scheduler):
    # DeepSpeed's schedulers drive the tier's param_groups; torch's schedulers and a client's
    # factory require a torch.optim.Optimizer (DeepSpeed hands them its basic optimizer too).
    torch_optimizer = tier.torch_optimizer or tier
    if client_scheduler is not None:
        return client_scheduler(torch_optimizer) if callable(client_scheduler) \
            and not hasattr(client_scheduler, "step") else client_scheduler
    if cfg.scheduler is None:
        return None
    target = tier if cfg.scheduler.type in SCHEDULER_NAMES else torch_optimizer
    return build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), target)
