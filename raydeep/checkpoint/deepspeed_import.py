"""Import a DeepSpeed ZeRO checkpoint (stages 1-3; fp32, bf16 or fp16 training) into raydeep's format.

What DeepSpeed 0.19.8 writes with ``engine.save_checkpoint`` (one model-parallel rank)::

    <save_dir>/latest                                     # the tag
    <save_dir>/<tag>/mp_rank_00_model_states.pt           # stages 1-2: module weights, counters, scheduler,
                                                          #   param_shapes, buffers, client state
    <save_dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   # stage 3, every rank (empty weights,
                                                          #   frozen-parameter fragments)
    <save_dir>/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt  # every rank: its fp32 partition
                                                          #   and the torch optimizer state over it

The fp32 masters are rebuilt as DeepSpeed's ``zero_to_fp32.py`` does: stages 1-2 (and the
``BF16_Optimizer`` used for ZeRO-1 with fp32 gradient accumulation) concatenate every rank's
partition of each parameter group without its tail padding and cut it in ``param_shapes`` order,
skipping ``param_alignment_paddings``; stage 3 takes ``ceil(numel / world)`` elements of each
parameter from every rank's flat sub-group. The per-element optimizer states (``exp_avg``,
``exp_avg_sq``...) are flat tensors of the same layout and are cut with the same offsets.

Loading never runs code from the files (:mod:`raydeep.checkpoint.safe_torch_load`): DeepSpeed's
loss scaler, ``ZeroStageEnum``, ``fragment_address``... become inert stand-ins, so DeepSpeed
need not be installed. The files are found by :mod:`raydeep.checkpoint.deepspeed_files`.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch

from raydeep.checkpoint import format as fmt
from raydeep.checkpoint.deepspeed_files import DeepSpeedFiles, locate
from raydeep.checkpoint.safe_torch_load import StandIn, safe_load
from raydeep.checkpoint.writer import write_single
from raydeep.errors import CheckpointError

logger = logging.getLogger("raydeep")

# Keys of the model-states file that belong to DeepSpeed; every other key is the user's client_state.
_ENGINE_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
    "global_steps", "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
    "universal_checkpoint_info", "ds_config", "ds_version",
})
# torch optimizer param-group entries that choose an implementation rather than the maths: the
# loading run keeps its own (copying DeepSpeed's ``fused: None`` would switch a fused optimizer off).
_IMPLEMENTATION_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


# --- what an import produces -------------------------------------------------------------------------
@dataclass
class Imported:
    """A DeepSpeed checkpoint as full tensors and JSON: what ``write_single`` needs."""

    tag: str
    stage: int
    world_size: int
    precision: str
    masters: dict[str, torch.Tensor] = field(default_factory=dict)         # name -> fp32, model order
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # kind -> name -> tensor
    params: dict[str, dict] = field(default_factory=dict)                   # name -> {shape, dtype, group}
    scalars: list[dict] = field(default_factory=list)                       # per group: key -> spec
    param_groups: list[dict] = field(default_factory=list)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)            # buffer/, frozen/, client/
    manifest: dict = field(default_factory=dict)                            # counters, scheduler, ...


def read_deepspeed(src: str, tag: str | None = None) -> Imported:
    """Read and rebuild a DeepSpeed ZeRO checkpoint; see the module docstring."""
    files = locate(src, tag)
    try:
        return _read(files)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        # The checks below name what they expect; anything else is a layout this reader does not know.
        raise CheckpointError(f"{files.directory}: unexpected DeepSpeed checkpoint layout "
                              f"({type(err).__name__}: {err})") from err


def _read(files: DeepSpeedFiles) -> Imported:
    models = [_expect_dict(safe_load(f), f) for f in files.model_files]
    optims = []
    for f in files.optim_files:
        osd = _expect_dict(safe_load(f), f).get("optimizer_state_dict")
        optims.append(_expect_dict(osd, f"{f}: optimizer_state_dict"))
    model, where = models[0], files.model_files[0]
    ds_config = model.get("ds_config") if isinstance(model.get("ds_config"), dict) else {}
    stage = _stage(optims[0], ds_config, files.optim_files[0])
    world = _partition_count(optims[0], files.optim_files[0])
    if world != len(optims):
        raise CheckpointError(f"{files.directory}: partition_count is {world} but there are {len(optims)} "
                              "*_optim_states.pt files (an overwritten or incomplete checkpoint)")
    param_shapes = _require(model, "param_shapes", where)
    if not isinstance(param_shapes, list):
        raise CheckpointError(f"{where}: param_shapes is {type(param_shapes).__name__}, expected a list per group")
    out = Imported(files.tag, stage, world, _precision(ds_config, files.optim_files[0]))
    if stage == 3:
        _rebuild_stage3(out, param_shapes, optims, files.optim_files)
    else:
        _rebuild_flat_groups(out, param_shapes, optims, files.optim_files, zero="zero_stage" in optims[0])
    module = model.get("module") or {}
    for name in out.masters:
        value = module.get(name)
        out.params[name]["dtype"] = fmt.dtype_name(value.dtype) if torch.is_tensor(value) else "float32"
    _model_extras(out, models, stage)
    _model_wide(out, model, optims[0], ds_config, where)
    return out


def import_deepspeed(src: str, out_dir: str, tag: str | None = None) -> str:
    """Convert the DeepSpeed checkpoint at ``src`` into a committed raydeep checkpoint under
    ``out_dir`` (same tag; ``latest`` written). Returns the tag."""
    ckpt = read_deepspeed(src, tag)
    optimizer = {"class": None, "state_keys": list(ckpt.states),
                 "state_dtypes": {k: fmt.dtype_name(next(iter(v.values())).dtype) for k, v in ckpt.states.items()
                                  if v},
                 "scalars": ckpt.scalars}
    write_single(out_dir, ckpt.tag, ckpt.masters, ckpt.states, ckpt.extra, params=ckpt.params,
                 world_size=ckpt.world_size, stage=ckpt.stage, precision=ckpt.precision, optimizer=optimizer,
                 param_groups=ckpt.param_groups, source="deepspeed", **ckpt.manifest)
    return ckpt.tag


# --- fp32 masters and optimizer states -----------------------------------------------------------------
def _rebuild_flat_groups(out: Imported, param_shapes, optims, paths, zero: bool) -> None:
    """Stages 1-2 (``zero=True``, DeepSpeedZeroOptimizer) and ``BF16_Optimizer`` (``zero=False``):
    one flat fp32 partition per rank and parameter group."""
    base = [_require(osd, "base_optimizer_state", p) for osd, p in zip(optims, paths)]
    for g, shapes in enumerate(param_shapes):
        fp32_parts, state_parts = [], {}
        for r, (osd, path) in enumerate(zip(optims, paths)):
            fp32 = _group_item(_require(osd, "single_partition_of_fp32_groups", path), g, path,
                               "single_partition_of_fp32_groups")
            padding = _group_item(osd.get("group_paddings") or [0] * (g + 1), g, path, "group_paddings")
            # ZeRO stores its fp32 partition without the tail padding already; BF16_Optimizer does not.
            lean = fp32.numel() if zero else fp32.numel() - padding
            fp32_parts.append(fp32.reshape(-1)[:lean])
            state = _group_state(base[r], g, path)
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() < lean:
                        raise CheckpointError(f"{path}: optimizer state {key!r} of group {g} has {value.numel()} "
                                              f"elements, the fp32 partition {lean}")
                    state_parts.setdefault(key, []).append(value.reshape(-1)[:lean])
            if r == 0:
                out.scalars.append(_scalars(state, base[0], g))
        flat = torch.cat(fp32_parts)
        for key, parts in state_parts.items():
            if len(parts) != len(optims):
                raise CheckpointError(f"{paths[0]}: optimizer state {key!r} of group {g} is saved by "
                                      f"{len(parts)} of {len(optims)} ranks")
        states = {key: torch.cat(parts) for key, parts in state_parts.items()}
        alignment = optims[0].get("param_alignment_paddings")
        paddings = _group_item(alignment, g, paths[0], "param_alignment_paddings") if alignment is not None \
            else [0] * len(shapes)
        if len(paddings) != len(shapes):
            raise CheckpointError(f"{paths[0]}: group {g} has {len(shapes)} parameters but "
                                  f"{len(paddings)} param_alignment_paddings")
        offset = 0
        for (name, shape), pad in zip(shapes.items(), paddings):
            numel = math.prod(shape)
            if offset + numel > flat.numel():
                raise CheckpointError(f"{paths[0]}: parameter {name!r} needs elements [{offset}, {offset + numel}) "
                                      f"of group {g}, which has {flat.numel()}")
            _add_param(out, name, shape, g, flat[offset:offset + numel],
                       {k: v[offset:offset + numel] for k, v in states.items()})
            offset += numel + pad
        # As zero_to_fp32: both counts agree once rounded up to DeepSpeed's 2 * world alignment.
        align = 2 * len(optims)
        if math.ceil(offset / align) != math.ceil(flat.numel() / align):
            raise CheckpointError(f"{paths[0]}: parameters of group {g} use {offset} elements but the partitions "
                                  f"hold {flat.numel()}: param_shapes does not match the optimizer files")
    out.param_groups = _hyperparameters(base[0], paths[0])


def _rebuild_stage3(out: Imported, param_shapes, optims, paths) -> None:
    """Stage 3: each rank holds ``ceil(numel / world)`` elements of every parameter of each sub-group."""
    world = len(optims)
    flats = [_require(osd, "fp32_flat_groups", p) for osd, p in zip(optims, paths)]
    inner = [_require(osd, "optimizer_state_dict", p) for osd, p in zip(optims, paths)]
    groups = _require(inner[0], "param_groups", paths[0])
    # The optimizer's params are the flat sub-groups, listed group by group in sub-group order.
    order = [(g, index) for g, group in enumerate(groups) for index in group.get("params", [])]
    if len(param_shapes) != len(flats[0]) or len(order) != len(flats[0]):
        raise CheckpointError(f"{paths[0]}: {len(flats[0])} fp32 sub-groups, {len(param_shapes)} param_shapes "
                              f"groups and {len(order)} optimizer params: the files do not belong together")
    out.scalars = [{} for _ in groups]
    for j, shapes in enumerate(param_shapes):
        g, index = order[j]
        rank_states = [_expect_dict(inn.get("state", {}).get(index, {}), f"{p}: optimizer state {index}")
                       for inn, p in zip(inner, paths)]
        if not out.scalars[g]:
            out.scalars[g] = _scalars(rank_states[0], inner[0], g)
        kinds = [k for k, v in rank_states[0].items() if torch.is_tensor(v) and v.dim() > 0]
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)

            def gather(tensors, what):
                pieces = []
                for t, p in zip(tensors, paths):
                    if offset + part > t.numel():
                        raise CheckpointError(f"{p}: {what} of sub-group {j} has {t.numel()} elements, parameter "
                                              f"{name!r} needs [{offset}, {offset + part})")
                    pieces.append(t.reshape(-1)[offset:offset + part])
                return torch.cat(pieces)[:numel]
            master = gather([_group_item(f, j, p, "fp32_flat_groups") for f, p in zip(flats, paths)], "fp32")
            states = {k: gather([_require(s, k, f"{p}: optimizer state {index}") for s, p in zip(rank_states, paths)],
                                k) for k in kinds}
            _add_param(out, name, shape, g, master, states)
            offset += part
        for f, p in zip(flats, paths):
            if f[j].numel() != offset:
                raise CheckpointError(f"{p}: fp32 sub-group {j} has {f[j].numel()} elements, its parameters "
                                      f"use {offset}: param_shapes does not match the optimizer files")
    out.param_groups = _hyperparameters(inner[0], paths[0])


def _add_param(out: Imported, name: str, shape, group: int, master: torch.Tensor, states: dict) -> None:
    shape = [int(d) for d in shape]
    out.masters[name] = master.float().reshape(shape).clone()
    out.params[name] = {"shape": shape, "dtype": "float32", "group": group}
    for kind, value in states.items():
        out.states.setdefault(kind, {})[name] = value.reshape(shape).clone()


def _group_state(base, g: int, path: str) -> dict:
    """Group ``g``'s optimizer state: ``base_optimizer_state`` is a torch state_dict (one flat
    param per group) or, with ``elastic_checkpoint``, a list of per-group states."""
    if isinstance(base, dict):
        index = base.get("param_groups", [{}] * (g + 1))[g].get("params", [g])[0]
        return _expect_dict(base.get("state", {}).get(index, {}), f"{path}: optimizer state of group {g}")
    return _expect_dict(_group_item(base, g, path, "base_optimizer_state"), f"{path}: base_optimizer_state[{g}]")


def _scalars(state: dict, base, g: int) -> dict:
    """Per-group scalar optimizer state in the manifest's form (see ``snapshot._scalar``)."""
    scalars = {}
    step = state.get("step")
    group = base.get("param_groups", [])[g] if isinstance(base, dict) and g < len(base.get("param_groups", [])) \
        else {}
    if step is None and "step" in group:  # DeepSpeed's FusedAdam counts steps per group, not per parameter
        step = group["step"]
    if step is not None:
        # torch's Adam family keeps ``step`` as a float32 tensor; a fused kernel keeps it on the
        # parameter's device, as raydeep's own checkpoints record.
        scalars["step"] = {"value": float(step.item() if torch.is_tensor(step) else step), "dtype": "float32",
                           "tensor": True, "on_param_device": True}
    for key, value in state.items():
        if key == "step" or (torch.is_tensor(value) and value.dim() > 0):
            continue
        if torch.is_tensor(value):
            scalars[key] = {"value": value.item(), "dtype": fmt.dtype_name(value.dtype), "tensor": True,
                            "on_param_device": True}
        elif isinstance(value, (bool, int, float)):
            scalars[key] = {"value": value, "tensor": False}
    return scalars


def _hyperparameters(state_dict, path: str) -> list[dict]:
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not groups:
        logger.warning("%s: no optimizer param_groups saved (elastic checkpoint): the loading run keeps its own "
                       "hyperparameters", path)
        return []
    out = []
    for group in groups:
        clean = {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS and k != "step"}
        out.append(_json(clean, f"{path}: param_groups"))
    return out


# --- everything else ---------------------------------------------------------------------------------
def _model_extras(out: Imported, models: list[dict], stage: int) -> None:
    """Buffers and frozen parameters (``extra.safetensors``) from the model-states file(s)."""
    model = models[0]
    module = model.get("module") or {}
    buffers = list(model.get("buffer_names") or [])
    for name in buffers:
        if torch.is_tensor(module.get(name)):
            out.extra[f"buffer/{name}"] = module[name].clone()
    shared = set((model.get("shared_params") or {}).keys())
    if stage == 3:
        shapes = model.get("frozen_param_shapes") or {}
        for name, shape in shapes.items():
            frags = [(m.get("frozen_param_fragments") or {}).get(name) for m in models]
            if any(f is None for f in frags):
                raise CheckpointError(f"frozen parameter {name!r} is missing from some stage-3 model states files")
            numel = math.prod(shape)
            out.extra[f"frozen/{name}"] = torch.cat([f.reshape(-1) for f in frags])[:numel].reshape(list(shape))
        return
    # Stages 1-2 save full module weights: what is neither trained, a buffer nor a tied alias is frozen.
    for name, value in module.items():
        if name in out.masters or name in buffers or name in shared or not torch.is_tensor(value):
            continue
        out.extra[f"frozen/{name}"] = value.clone()


def _model_wide(out: Imported, model: dict, osd: dict, ds_config: dict, where: str) -> None:
    """Counters, scheduler, loss scaler, client state and config: the manifest's JSON part."""
    counters = {key: int(model.get(key) or 0) for key in ("global_steps", "global_samples", "skipped_steps")}
    scheduler = model.get("lr_scheduler")
    if isinstance(scheduler, dict) and "last_batch_iteration" in scheduler:  # DeepSpeed's own schedulers
        scheduler = {"last_batch_iteration": int(scheduler["last_batch_iteration"])}
    elif scheduler is not None:
        logger.warning("%s: the lr_scheduler state is not a DeepSpeed scheduler's ({last_batch_iteration}) and is "
                       "not imported: the loading run's scheduler starts from its own state", where)
        scheduler = None
    client, tensors = {}, {}
    for key, value in model.items():
        if key in _ENGINE_KEYS:
            continue
        if torch.is_tensor(value):
            tensors[f"client/{key}"] = value.clone()
            continue
        try:
            client[key] = _json(value, f"client_state[{key!r}]", strict=True)
        except CheckpointError as err:
            logger.warning("%s: client_state key %r is not plain data and is not imported (%s)", where, key, err)
    out.extra.update(tensors)
    out.manifest = {"counters": counters, "lr_scheduler": scheduler, "client_state": client,
                    "loss_scaler": _loss_scaler(osd.get("loss_scaler"), out.precision),
                    "config": _json(ds_config, "ds_config")}


def _loss_scaler(scaler, precision: str) -> dict | None:
    """DeepSpeed's scaler object (a stand-in here) as raydeep's scaler state; fp16 only."""
    if precision != "fp16" or not isinstance(scaler, StandIn):
        return None
    attrs = vars(scaler)
    if scaler.source.endswith("DynamicLossScaler"):
        keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_window", "min_scale",
                "delayed_shift", "consecutive_hysteresis", "raise_error_at_min_scale")
        return {"type": "dynamic", **{k: _json(attrs[k], "loss_scaler") for k in keys if k in attrs}}
    if "cur_scale" in attrs:
        return {"type": "static", "cur_scale": float(attrs["cur_scale"])}
    return None


def _stage(osd: dict, ds_config: dict, path: str) -> int:
    if "zero_stage" in osd:
        stage = osd["zero_stage"]
        stage = stage.value if isinstance(stage, StandIn) else stage
    else:  # BF16_Optimizer (ZeRO-1 with fp32 gradient accumulation) records no stage
        if "single_partition_of_fp32_groups" not in osd:
            raise CheckpointError(f"{path}: not a ZeRO optimizer file (no zero_stage and no "
                                  "single_partition_of_fp32_groups)")
        stage = ds_config.get("zero_optimization", {}).get("stage", 1)
    if stage not in (1, 2, 3):
        raise CheckpointError(f"{path}: zero_stage {stage!r} is not a ZeRO stage 1-3")
    return int(stage)


def _partition_count(osd: dict, path: str) -> int:
    count = _require(osd, "partition_count", path)
    # Stage 1/2 keep one count per group (expert groups may differ); the data-parallel size is the largest.
    return int(max(count) if isinstance(count, (list, tuple)) else count)


def _precision(ds_config: dict, optim_path: str) -> str:
    def enabled(key):
        section = ds_config.get(key)
        return isinstance(section, dict) and bool(section.get("enabled"))
    if enabled("bf16") or enabled("bfloat16") or os.path.basename(optim_path).startswith("bf16_"):
        return "bf16"
    return "fp16" if enabled("fp16") else "fp32"


def _require(mapping: dict, key: str, where: str):
    if key not in mapping:
        raise CheckpointError(f"{where}: key {key!r} is missing (not a DeepSpeed ZeRO checkpoint file, "
                              "or one written by an unsupported version)")
    return mapping[key]


def _expect_dict(obj, where: str) -> dict:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a dict, found {type(obj).__name__}")
    return obj


def _group_item(items, g: int, path: str, key: str):
    if not isinstance(items, (list, tuple)) or g >= len(items):
        raise CheckpointError(f"{path}: {key} has no entry for parameter group {g}")
    return items[g]


def _json(obj, what: str, strict: bool = False):
    """Plain JSON data; other objects raise (``strict``) or are dropped with a warning."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if torch.is_tensor(obj) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            value = _json(v, f"{what}.{k}", strict)
            if value is not _DROP:
                out[str(k)] = value
        return out
    if isinstance(obj, (list, tuple)):
        return [v for v in (_json(x, what, strict) for x in obj) if v is not _DROP]
    if strict:
        raise CheckpointError(f"{what} holds a {type(obj).__name__}")
    logger.warning("%s holds a %s, which is not imported", what, type(obj).__name__)
    return _DROP


_DROP = object()
