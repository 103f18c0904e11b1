"""What raydeep does with every field of the config model: the single source of truth.

Each dotted field path (``"zero_optimization.offload_optimizer.device"``, ``"fp16.hysteresis"``,
``"raydeep.seed"``) has exactly one :class:`Support` entry in ``SUPPORT``:

- ``HONOURED``: the setting takes effect; ``where`` names the modules that read it. One that
  needs an optional Python package (``package``) is a ConfigError while that package is missing.
- ``WARNED``: accepted, but it has no effect in raydeep; setting it to a non-default value logs a
  warning naming the key and saying why.
- ``REFUSED``: setting it to a non-default value is a :class:`~raydeep.errors.ConfigError` naming
  the key, with a fix, because ignoring it would change results or memory a user counts on.

:func:`check_support` turns the table into those warnings and errors for the keys the user actually
wrote (pydantic's ``model_fields_set``) with values other than the default; ``load_config`` runs it
with the cross-field rules. A field of a section switched off by its own ``enabled: false`` is
skipped: it has no effect in DeepSpeed either. ``tests/unit/test_config_classification.py`` keeps the
table complete: a new field without an entry fails it.

>>> SUPPORT["zero_optimization.contiguous_gradients"].status
'warned'
>>> SUPPORT["fp16.hysteresis"].where
('raydeep/precision/loss_scaler.py',)
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Iterator

from pydantic import BaseModel

from raydeep.config.keys import section_type, spellings
from raydeep.errors import ConfigError

HONOURED, WARNED, REFUSED = "honoured", "warned", "refused"


@dataclass(frozen=True)
class Support:
    """How raydeep treats one config field (see the module docstring)."""

    status: str
    where: tuple[str, ...] = ()  # HONOURED: modules whose source reads the field
    why: str = ""  # WARNED: why it has no effect; REFUSED: what is not supported
    fix: str = ""  # REFUSED: what to do instead; HONOURED with a package: how to install it
    example: Any = None  # WARNED/REFUSED: a non-default value, as the tests set it
    needs: tuple[tuple[str, Any], ...] = ()  # other keys the example needs to reach this entry
    inert: tuple = ()  # values that mean "off", treated like the default
    # REFUSED whenever written, default value included: DeepSpeed 0.19.8 removed the key, or it
    # belongs to a refused feature whose section is switched on.
    written: bool = False
    package: str = ""  # HONOURED: the module a true value needs importable


def read(*where: str, package: str = "", fix: str = "") -> Support:
    return Support(HONOURED, where=where, package=package, fix=fix)


def warn(why: str, example: Any, needs: dict | None = None) -> Support:
    return Support(WARNED, why=why, example=example, needs=tuple((needs or {}).items()))


def refuse(why: str, fix: str, example: Any, *, needs: dict | None = None, inert: tuple = (),
           written: bool = False) -> Support:
    return Support(REFUSED, why=why, fix=fix, example=example, needs=tuple((needs or {}).items()), inert=inert,
                   written=written)


BUILDER, ENGINE = "raydeep/engine/builder.py", "raydeep/engine/engine.py"
PARTS = "raydeep/checkpoint/parts.py"  # the checkpoint's settings
HIERARCHY = "raydeep/zero/hierarchy.py"  # ZeRO++
SCALER, BATCH, STAGE3 = "raydeep/precision/loss_scaler.py", "raydeep/config/batch.py", "raydeep/zero/stage3.py"

_ZENFLOW_TOPK = ("raydeep does not split gradients by importance (ZenFlow's top-k columns): every gradient goes "
                 "through the offloaded update, delayed one step with zenflow.overlap_step, and the forward reads "
                 "Adam's next step predicted with the new gradient (raydeep.delayed_update_lookahead), which "
                 "closes the delay's loss gap that the top-k split narrows")
_NVME = "it configures NVMe offload, which raydeep does not support (CPU offload does not read it)"
TIERS = "raydeep/tier/select.py"
WATCHDOG, WORKER, RAY_TRAINER = "raydeep/ray/watchdog.py", "raydeep/ray/worker.py", "raydeep/ray/trainer.py"
_MONITOR = ("the {name} monitor is not supported (no network access from raydeep's workers, which write "
            "only to the run's storage); use tensorboard or csv_monitor")
MONITOR = "raydeep/monitor/__init__.py"
_TENSORBOARD_FIX = "pip install 'raydeep[monitor]' (or pip install tensorboard)"
_AUTOTUNE = ("the autotuning section is not read: `raydeep autotune CONFIG --model M --num-workers N` runs "
             "DeepSpeed's search (stage, micro batch, buckets, checkpointing, offload) as Ray Tune trials")
_FLOPS = "the FLOPs profiler is not implemented in raydeep"
_FLOPS_FIX = "remove the flops_profiler section; `raydeep train` reports MFU from the model's FLOPs per token"
COMMS = ("raydeep/comm/__init__.py", "raydeep/comm/comms_logging.py")
_ZERO_PP = "remove zero_optimization.{key}"
_UNITS = "raydeep gathers stage-3 parameters per partition unit; choose the units with raydeep.partition_units"
_STAGE3 = {"zero_optimization.stage": 3}
_ELASTIC = {"elasticity.enabled": True}


def _monitor(section: str, name: str, fields: dict[str, Any]) -> dict[str, Support]:
    text = _MONITOR.format(name=name)
    return {f"{section}.{field}": warn(text, example) for field, example in fields.items()}


SUPPORT: dict[str, Support] = {
    # --- top level ------------------------------------------------------------------------------
    "train_batch_size": read(BATCH, BUILDER),
    "train_micro_batch_size_per_gpu": read(BATCH, BUILDER, "raydeep/engine/api.py"),
    "gradient_accumulation_steps": read(BATCH, BUILDER),
    "managed_gradient_accumulation": refuse(
        "false (the caller owns the accumulation boundary) is not implemented: raydeep applies the update "
        "every gradient_accumulation_steps micro-batches", "remove it and call engine.step() after every "
        "micro-batch, as with the default", False),
    "steps_per_print": read(BUILDER, ENGINE),
    "wall_clock_breakdown": read(BUILDER, ENGINE, "raydeep/engine/metrics.py"),
    "memory_breakdown": warn("raydeep does not print memory use while training; engine.memory_breakdown() "
                             "returns the per-rank bytes", True),
    "dump_state": warn("raydeep does not print the engine state at initialize", True),
    "gradient_clipping": read(BUILDER, ENGINE),
    "prescale_gradients": read(BUILDER),
    "gradient_allreduce_op": read(BUILDER),
    "gradient_predivide_factor": read(BUILDER),
    "communication_data_type": read(BUILDER),
    "seq_parallel_communication_data_type": warn("it is the gradient dtype of sequence parallelism, which "
                                                 "raydeep does not implement", "bf16"),
    "optimizer.type": read(BUILDER, "raydeep/optim/optimizers.py"),
    "optimizer.params": read(BUILDER, "raydeep/optim/optimizers.py"),
    "optimizer.legacy_fusion": warn("it selects DeepSpeed's legacy fused-Adam fp16 step; raydeep has one fp16 "
                                    "step", True, needs={"optimizer.type": "AdamW"}),
    "scheduler.type": read(BUILDER, "raydeep/optim/schedulers.py"),
    "scheduler.params": read(BUILDER, "raydeep/optim/schedulers.py"),
    "zero_allow_untested_optimizer": read("raydeep/config/rules.py"),
    "zero_force_ds_cpu_optimizer": read(BUILDER),
    "dataloader_drop_last": read("raydeep/engine/api.py"),
    "vocabulary_size": warn("raydeep takes the vocabulary from the model (pad the model's vocabulary to a "
                            "multiple of 8 for tensor-core friendly shapes)", 50304),
    "disable_python_gc": warn("raydeep leaves Python's garbage collector as it is", True),
    "log_level": warn("set the level of the \"raydeep\" logger instead: "
                      "logging.getLogger(\"raydeep\").setLevel(...)", "debug"),
    # --- fp16 / bf16 ----------------------------------------------------------------------------
    "fp16.enabled": read(BUILDER, SCALER),
    "fp16.auto_cast": read(BUILDER, ENGINE),
    "fp16.loss_scale": read(SCALER),
    "fp16.initial_scale_power": read(SCALER),
    "fp16.loss_scale_window": read(SCALER),
    "fp16.hysteresis": read(SCALER),
    "fp16.consecutive_hysteresis": read(SCALER),
    "fp16.min_loss_scale": read(SCALER),
    "fp16.fp16_master_weights_and_grads": refuse(
        "is not supported by raydeep (it needs DeepSpeed's half-precision CPU Adam)",
        "remove it; raydeep keeps fp32 master weights", True, needs={"fp16.enabled": True}),
    "bf16.enabled": read("raydeep/config/model.py", BUILDER),
    "bf16.immediate_grad_update": refuse(
        "is not implemented as an option: ZeRO stages 2 and 3 always add each micro-batch's reduced gradients "
        "to the data_types.grad_accum_dtype shard, while stage 1 first sums the micro-batches in the model dtype",
        'remove it; for fp32 gradient accumulation use ZeRO stage 2 or 3 with data_types.grad_accum_dtype "fp32"',
        True, needs={"bf16.enabled": True}),
    "bf16.check_grad_overflow": read(BUILDER),
    "bf16.bf16_master_weights_and_grads": refuse("is not supported by raydeep", "remove it; raydeep keeps fp32 "
                                                 "master weights", True, needs={"bf16.enabled": True}),
    "bf16.bf16_optimizer_states": refuse("is not supported by raydeep", "remove it; raydeep keeps fp32 optimizer "
                                         "states", True, needs={"bf16.enabled": True}),
    # --- zero_optimization ----------------------------------------------------------------------
    "zero_optimization.stage": read(BUILDER),
    "zero_optimization.contiguous_gradients": warn("raydeep's gradient buckets are always contiguous flat "
                                                   "buffers", False),
    "zero_optimization.reduce_scatter": warn(
        "raydeep's ZeRO stages 1-3 always reduce-scatter each gradient bucket (the same sums as an all-reduce, "
        "with less traffic); prescale_gradients and gradient_predivide_factor still apply", False),
    "zero_optimization.reduce_bucket_size": read(BUILDER),
    "zero_optimization.use_multi_rank_bucket_allreduce": warn("raydeep reduces each gradient bucket in one "
                                                              "collective", False),
    "zero_optimization.allgather_partitions": warn("DeepSpeed 0.19.8 reads it but never uses it; raydeep always "
                                                   "all-gathers the updated partitions", False),
    "zero_optimization.allgather_bucket_size": warn("raydeep all-gathers each unit's updated shard in one "
                                                    "collective; stage 1-2 units are sized by reduce_bucket_size",
                                                    200_000_000),
    "zero_optimization.overlap_comm": read(BUILDER),
    "zero_optimization.compute_grad_norm": read(BUILDER, ENGINE),
    "zero_optimization.load_from_fp32_weights": warn("raydeep checkpoints keep trainable parameters only as fp32 "
                                                     "master weights, and loading always restores those", False),
    "zero_optimization.elastic_checkpoint": warn("raydeep checkpoints always load on any world size and stage",
                                                 True),
    "zero_optimization.offload_param.device": refuse(
        "NVMe parameter offload is not supported by raydeep", 'use "cpu" (ZeRO stage 3 keeps the parameter '
        'partitions in host memory) or "none"', "nvme", inert=("cpu",)),
    "zero_optimization.offload_param.pin_memory": read(BUILDER, "raydeep/zero/flat.py"),
    **{f"zero_optimization.offload_param.{k}": warn(_NVME, v) for k, v in {
        "nvme_path": "/local_nvme", "buffer_count": 8, "buffer_size": 10**8 // 2, "max_in_cpu": 10**8}.items()},
    "zero_optimization.offload_optimizer.device": refuse(
        "NVMe optimizer offload is not supported by raydeep", 'use "cpu": the host tier or offload actors on CPU '
        'nodes (raydeep.offload_target)', "nvme", inert=("cpu",)),
    "zero_optimization.offload_optimizer.pin_memory": read(TIERS),
    "zero_optimization.offload_optimizer.ratio": read(TIERS),
    **{f"zero_optimization.offload_optimizer.{k}": warn(_NVME, v) for k, v in {
        "nvme_path": "/local_nvme", "buffer_count": 8, "pipeline_read": True, "pipeline_write": True,
        "fast_init": True}.items()},
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": warn(
        "it applies to SuperOffload only; the CPU step's threads are the offload actor's CPUs "
        "(raydeep.offload_actor_cpus) or the rank's own", 0.5),
    "zero_optimization.offload_optimizer.super_offload": refuse("SuperOffload is not supported by raydeep",
                                                                "remove super_offload", True),
    "zero_optimization.sub_group_size": read(TIERS),
    "zero_optimization.zenflow.overlap_step": read(BUILDER),
    "zero_optimization.zenflow.full_warm_up_rounds": read(BUILDER),
    **{f"zero_optimization.zenflow.{k}": warn(_ZENFLOW_TOPK, v) for k, v in {
        "topk_ratio": 0.2, "select_strategy": "step", "select_interval": 4, "update_interval": 4,
        "auto_ratio": 0.9, "offload": True}.items()},
    "zero_optimization.zenflow.pt_reserved_cores_perc": warn(
        "the offloaded update's threads are raydeep.cpu_update_threads (default: the CPUs the worker or "
        "offload actor was given)", 0.25),
    "zero_optimization.zenflow.steps_per_epoch": refuse(
        "steps_per_epoch is set by DeepSpeed's ZenFlow at run time, not by users", "remove it", 100),
    "zero_optimization.prefetch_bucket_size": read(BUILDER, STAGE3),
    "zero_optimization.param_persistence_threshold": read(BUILDER),
    "zero_optimization.model_persistence_threshold": read(BUILDER),
    "zero_optimization.max_live_parameters": read(BUILDER, STAGE3),
    "zero_optimization.max_reuse_distance": read(BUILDER, STAGE3),
    "zero_optimization.gather_16bit_weights_on_model_save": read(BUILDER),
    "zero_optimization.module_granularity_threshold": warn(_UNITS, 100),
    "zero_optimization.use_all_reduce_for_fetch_params": warn("parameters are always gathered with all-gather",
                                                              True),
    "zero_optimization.allgather_sequential": warn("raydeep gathers each partition unit with one all-gather and "
                                                   "prefetches by stage3_prefetch_bucket_size", True),
    "zero_optimization.ignore_unused_parameters": warn(
        "raydeep reduces a parameter that got no gradient as zeros, which is what DeepSpeed does with the "
        "default (true)", False),
    "zero_optimization.legacy_stage1": refuse("The deprecated version of ZeRO Stage 1 is not supported in "
                                              "deepspeed >= 0.5.9", "remove legacy_stage1", True),
    "zero_optimization.round_robin_gradients": warn(
        "raydeep partitions every gradient bucket evenly across ranks, which already spreads the reduction "
        "work", True),
    "zero_optimization.parameter_alignment": warn("raydeep lays out its flat buffers itself, and its checkpoints "
                                                  "do not depend on the layout", True),
    "zero_optimization.zero_hpz_partition_size": read(HIERARCHY),
    "zero_optimization.zero_quantized_weights": read(HIERARCHY),
    "zero_optimization.zero_quantized_nontrainable_weights": read(HIERARCHY),
    "zero_optimization.zero_quantized_gradients": read(HIERARCHY),
    **{f"zero_optimization.{key}": refuse(f"{feature} is not supported by raydeep", _ZERO_PP.format(key=key),
                                          example, written=written)
       for key, feature, example, written in (
           ("zeropp_loco_param", "LoCo-ZeRO++", {"err_beta": 0.8, "reset_T": 1024}, True),
           ("mics_shard_size", "MiCS", 8, True),
           ("mics_hierarchical_params_gather", "MiCS", True, True))},
    "zero_optimization.memory_efficient_linear": warn("raydeep never replaces the model's linear layers, which "
                                                      "is what false asks for", False),
    "zero_optimization.override_module_apply": warn("raydeep.zero.Init does not wrap Module.apply", False),
    "zero_optimization.pipeline_loading_checkpoint": warn("raydeep has no pipeline parallelism", True),
    "zero_optimization.log_trace_cache_warnings": warn("raydeep's stage 3 always logs when its prefetch trace is "
                                                       "invalidated", True),
    "zero_optimization.enable_sanity_checks": warn("raydeep's stage 3 has no optional sanity checks", True),
    "zero_optimization.save_muon_momentum_buffer_in_memory": warn("it applies to Muon, which raydeep does not "
                                                                  "support", True),
    "zero_optimization.leaf_module": warn(_UNITS + " (each transformer block by default)",
                                          {"classes": ["MixtralSparseMoeBlock"]}),
    # --- activation_checkpointing (the section's presence turns the feature on) -------------------
    "activation_checkpointing.partition_activations": warn(
        "it splits activations across tensor-parallel ranks, and raydeep runs data parallel only", True),
    "activation_checkpointing.cpu_checkpointing": read("raydeep/activation/options.py",
                                                       "raydeep/activation/boundary_store.py"),
    "activation_checkpointing.contiguous_memory_optimization": read("raydeep/activation/options.py",
                                                                    "raydeep/activation/boundary_store.py"),
    "activation_checkpointing.number_checkpoints": read("raydeep/activation/wrap.py",
                                                        "raydeep/activation/boundary_store.py"),
    "activation_checkpointing.synchronize_checkpoint_boundary": read("raydeep/activation/options.py",
                                                                     "raydeep/activation/timing.py"),
    "activation_checkpointing.profile": read("raydeep/activation/options.py", "raydeep/activation/timing.py"),
    # --- data_types -----------------------------------------------------------------------------
    "data_types.grad_accum_dtype": read("raydeep/config/model.py", BUILDER),
    "data_types.param_dtype": read("raydeep/config/rules.py"),
    "data_types.buffer_dtype": refuse("is not implemented: raydeep keeps each buffer's own dtype",
                                      "remove it and cast the model's buffers before raydeep.initialize", "fp32"),
    "data_types.keep_in_fp32_modules": warn("raydeep never casts buffers, so they keep their own dtype",
                                            ["norm"]),
    # --- checkpoint -----------------------------------------------------------------------------
    "checkpoint.tag_validation": read(PARTS, "raydeep/checkpoint/checkpointer.py"),
    "checkpoint.load_universal": warn("raydeep checkpoints load on any world size and stage; convert a DeepSpeed "
                                      "checkpoint with `raydeep convert import-deepspeed`", True),
    "checkpoint.use_node_local_storage": warn("every rank writes its own files under the save directory, which "
                                              "must be storage every rank reaches", True),
    "checkpoint.parallel_write.pipeline_stage": warn("raydeep has no pipeline parallelism", True),
    "checkpoint.writer": warn("raydeep writes its own safetensors checkpoints (raydeep.checkpoint_async saves "
                              "in the background)", {"type": "fast"}),
    # --- elasticity (read when enabled) -------------------------------------------------------------
    "elasticity.enabled": read("raydeep/config/__init__.py", "raydeep/ray/batch_plan.py"),
    **{f"elasticity.{k}": read(BATCH) for k in ("max_train_batch_size", "micro_batch_sizes", "min_gpus",
                                                "max_gpus", "num_gpus_per_node", "prefer_larger_batch", "version")},
    "elasticity.ignore_non_elastic_batch_info": read("raydeep/config/__init__.py", "raydeep/ray/batch_plan.py"),
    "elasticity.min_time": warn("it is a hint for a cluster scheduler; DeepSpeed's batch computation does not "
                                "use it either", 10, needs=_ELASTIC),
    "elasticity.model_parallel_size": refuse("model parallelism is not supported by raydeep (every worker is a "
                                             "data-parallel rank)", "set it to 1 or remove it", 2, needs=_ELASTIC),
    # --- logging and monitoring -----------------------------------------------------------------
    "comms_logger.enabled": read("raydeep/config/model.py", BUILDER),
    **{f"comms_logger.{k}": read(*COMMS) for k in ("verbose", "prof_all", "debug", "prof_ops")},
    "flops_profiler.enabled": refuse(_FLOPS, _FLOPS_FIX, True),
    # With the profiler on, each of its keys is refused as well (the section is off otherwise).
    **{f"flops_profiler.{k}": refuse(_FLOPS, _FLOPS_FIX, v, written=True) for k, v in {
        "recompute_fwd_factor": 1.0, "profile_step": 5, "module_depth": 2, "top_modules": 3,
        "detailed": False, "output_file": "flops.txt"}.items()},
    "tensorboard.enabled": read(MONITOR, package="tensorboard", fix=_TENSORBOARD_FIX),
    **{f"tensorboard.{k}": read("raydeep/monitor/tensorboard.py") for k in ("output_path", "job_name")},
    "csv_monitor.enabled": read(MONITOR),
    **{f"csv_monitor.{k}": read("raydeep/monitor/csv_monitor.py") for k in ("output_path", "job_name")},
    **_monitor("wandb", "Weights & Biases", {"enabled": True, "group": "g", "team": "t", "project": "p"}),
    **_monitor("comet", "Comet", {"enabled": True, "samples_log_interval": 10, "project": "p", "workspace": "w",
                         "api_key": "k", "experiment_name": "e", "experiment_key": "k", "online": True,
                         "mode": "offline"}),
    "timers.throughput.enabled": warn("raydeep has no throughput timer", False),
    "timers.throughput.synchronized": warn("raydeep has no throughput timer", False),
    **{f"autotuning.{k}": warn(_AUTOTUNE, v) for k, v in {
        "enabled": True, "fast": False, "results_dir": "r", "exps_dir": "e", "overwrite": False,
        "start_profile_step": 2, "end_profile_step": 4, "metric": "latency", "metric_path": "m.json",
        "tuner_type": "random", "tuner_early_stopping": 3, "tuner_num_trials": 10, "arg_mappings": {"a": "b"},
        "max_train_batch_size": 64, "min_train_batch_size": 2, "max_train_micro_batch_size_per_gpu": 16,
        "min_train_micro_batch_size_per_gpu": 2, "num_tuning_micro_batch_sizes": 2, "mp_size": 2,
        "model_info": {"num_params": 10}, "model_info_path": "info.json"}.items()},
    # --- raydeep's own section ------------------------------------------------------------------
    "raydeep.partition_units": read(BUILDER),
    "raydeep.checkpoint_modules": read(BUILDER, "raydeep/activation/wrap.py"),
    "raydeep.offload_activations": read(BUILDER, "raydeep/activation/offload.py"),
    "raydeep.offload_target": read(TIERS),
    "raydeep.offload_resource": read(TIERS),
    "raydeep.offload_actors_per_rank": read(TIERS),
    "raydeep.offload_actor_cpus": read(TIERS),
    "raydeep.offload_tile_size": read(TIERS),
    "raydeep.offload_shared_memory": read(TIERS),
    "raydeep.cpu_update_threads": read(TIERS),
    "raydeep.delayed_update": read(BUILDER, ENGINE),
    "raydeep.delayed_update_warmup_steps": read(BUILDER),
    "raydeep.delayed_update_lookahead": read(TIERS),
    "raydeep.empty_cache_every": read(BUILDER, ENGINE),
    "raydeep.overflow_diagnosis_after": read(BUILDER),
    "raydeep.metrics": read("raydeep/ray/step_metrics.py"),
    "raydeep.peak_tflops": read("raydeep/ray/step_metrics.py"),
    "raydeep.check_collective_order": read(BUILDER, "raydeep/comm/order.py"),
    "raydeep.collective_order_timeout_s": read(BUILDER, "raydeep/comm/order.py"),
    "raydeep.seed": refuse("is not read by raydeep: nothing is seeded from it",
                           "remove it and call torch.manual_seed(N) before building the model "
                           "(`raydeep train` takes --seed N)", 42),
    "raydeep.checkpoint_async": read(PARTS),
    "raydeep.checkpoint_fsync": read(PARTS),
    "raydeep.checkpoint_keep_last_k": read(PARTS),
    "raydeep.memory_snapshot_every": read("raydeep/ray/loop.py", RAY_TRAINER),
    "raydeep.step_timeout_s": read(WATCHDOG, WORKER),
    "raydeep.min_step_timeout_s": read(WATCHDOG, WORKER),
    "raydeep.watchdog": read(WORKER, RAY_TRAINER),
    "raydeep.collective_timeout_s": read(RAY_TRAINER),
}


def check_support(cfg: BaseModel, errors: list[ConfigError], warnings: list[str],
                  written: dict[str, str] | None = None) -> None:
    """A ConfigError for each REFUSED field the user set, a warning for each WARNED one.

    ``written`` maps a canonical dotted path to the spelling the user wrote (an alias such as
    ``stage3_gather_16bit_weights_on_model_save``, or a deprecated key), so messages name that.
    """
    for path, value in changed_fields(cfg):
        entry = SUPPORT.get(path)
        if entry is not None and entry.package and value and importlib.util.find_spec(entry.package) is None:
            errors.append(ConfigError(as_written(path, written or {}), f"needs the {entry.package!r} package, "
                                      "which is not installed", value=value, fix=entry.fix))
        if entry is None or entry.status == HONOURED:
            continue
        key = as_written(path, written or {})
        if entry.status == REFUSED:
            errors.append(ConfigError(key, entry.why, value=value, fix=entry.fix))
        else:
            warnings.append(f"{key} = {value!r} has no effect: {entry.why}")


def changed_fields(section: BaseModel, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every field the user wrote with a value that is not "off".

    Sections are walked recursively; fields of a section whose own ``enabled`` is false are skipped.
    """
    fields = type(section).model_fields
    switched_off = "enabled" in fields and section.enabled is False
    for name, info in fields.items():
        value, path = getattr(section, name), prefix + name
        if isinstance(value, BaseModel):
            yield from changed_fields(value, path + ".")
            continue
        if name not in section.model_fields_set or (switched_off and name != "enabled"):
            continue
        entry = SUPPORT.get(path)
        if entry is not None and entry.written:
            yield path, value
        elif value != info.get_default(call_default_factory=True) and not (entry and value in entry.inert):
            yield path, value


def as_written(path: str, written: dict[str, str]) -> str:
    """``path`` as the user spelled it: its longest written prefix replaced, the rest kept."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in written:
            return ".".join([written[head], *parts[i:]])
    return path


def written_spellings(data: dict, model: type[BaseModel], renamed: dict[str, tuple[str, bool]] | None = None,
                      prefix: str = "", shown_prefix: str = "") -> dict[str, str]:
    """Canonical dotted path -> the key the user wrote, wherever the two differ.

    ``renamed`` maps a canonical dotted path to the legacy key it was renamed from and whether the
    value was translated as well: ``"bf16" -> ("bfloat16", False)`` keeps the keys inside, while
    ``"zero_optimization.offload_optimizer" -> ("zero_optimization.cpu_offload", True)`` reports
    everything under it as ``cpu_offload``, because the user wrote no deeper key.
    """
    renamed = renamed or {}
    found: dict[str, str] = {}
    names = spellings(model)
    for key, value in data.items():
        name = names.get(key)
        if name is None:
            continue
        path, shown = prefix + name, shown_prefix + key
        old, translated = renamed.get(path, (shown, False))
        if translated:
            found.update({p: old for p in _paths_under(value, path)})
            continue
        if old != path:
            found[path] = old
        sub = section_type(model.model_fields[name].annotation)
        if sub is not None and isinstance(value, dict):
            found.update(written_spellings(value, sub, renamed, path + ".", old + "."))
    return found


def _paths_under(value: Any, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [path]
    return [path] + [p for k, v in value.items() for p in _paths_under(v, f"{path}.{k}")]


def support_table() -> str:
    """The table as Markdown, one row per field: the reference table of ``docs/config.md``."""
    rows = ["| Key | Status | Where it is read / why |", "|---|---|---|"]
    for path, entry in SUPPORT.items():
        detail = ", ".join(f"`{m}`" for m in entry.where) if entry.status == HONOURED else entry.why
        if entry.package:
            detail += f" (needs the `{entry.package}` package: {entry.fix})"
        elif entry.fix:
            detail += f". Fix: {entry.fix}"
        rows.append(f"| `{path}` | {entry.status} | {detail.replace('|', '/')} |")
    return "\n".join(rows)
