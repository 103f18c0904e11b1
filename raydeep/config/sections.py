"""ds_config sections other than ``zero_optimization``: precision, optimizer, scheduler,
activation checkpointing, data types, checkpoint, elasticity, logging/monitoring, autotuning,
and raydeep's own ``raydeep`` section. Defaults are DeepSpeed 0.19.8's unless marked.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from raydeep.config.base import Count, Flag, Section


class FP16Config(Section):
    """fp16 mixed precision with dynamic (``loss_scale: 0``) or static loss scaling."""

    enabled: Flag = False
    auto_cast: Flag = False
    loss_scale: float = Field(0.0, ge=0.0)
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: Flag = False
    min_loss_scale: int = 1
    fp16_master_weights_and_grads: Flag = False

    @field_validator("loss_scale", mode="before")
    @classmethod
    def _finite_number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError("must be a finite number >= 0 (0 selects dynamic loss scaling)")
        return v

    @field_validator("loss_scale_window", "min_loss_scale", "initial_scale_power", "hysteresis", mode="before")
    @classmethod
    def _whole_number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("must be an integer")
        return v

    def scaler_args(self) -> dict:
        """The dynamic-scaler arguments DeepSpeed 0.19.8 always passes (defaults filled in)."""
        return {"init_scale": 2.0 ** self.initial_scale_power, "scale_window": self.loss_scale_window,
                "min_scale": self.min_loss_scale, "delayed_shift": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis}


class BF16Config(Section):
    """bf16 mixed precision: fp32 master weights, no loss scaling, non-finite steps skipped."""

    enabled: Flag = False
    immediate_grad_update: Flag = False
    check_grad_overflow: Flag = True
    bf16_master_weights_and_grads: Flag = False
    bf16_optimizer_states: Flag = False


class OptimizerConfig(Section):
    """``optimizer``: a DeepSpeed or ``torch.optim`` name plus its constructor params."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: Flag = False


class SchedulerConfig(Section):
    """``scheduler``: one of DeepSpeed's five LR schedules or a ``torch.optim.lr_scheduler`` class."""

    type: str
    params: dict[str, Any]


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``. Its presence turns the feature on, as in DeepSpeed: the model's
    own ``deepspeed.checkpointing.checkpoint`` calls always work, and with the section present the
    engine also wraps the modules chosen by ``raydeep.checkpoint_modules``
    (``raydeep.activation.wrap``). The options below are DeepSpeed's (``raydeep.activation.options``);
    raydeep warns for ``partition_activations``, which needs tensor parallelism."""

    partition_activations: Flag = False
    cpu_checkpointing: Flag = False
    contiguous_memory_optimization: Flag = False
    number_checkpoints: int | None = Field(None, ge=1)
    synchronize_checkpoint_boundary: Flag = False
    profile: Flag = False


DTYPE_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
}


def _dtype_name(v: Any) -> Any:
    if v is None:
        return v
    name = DTYPE_NAMES.get(str(v).lower())
    if name is None:
        raise ValueError(f"unknown dtype; use one of {sorted(set(DTYPE_NAMES.values()))}")
    return name


class DataTypesConfig(Section):
    """``data_types``: gradient accumulation dtype and 0.19.8's param/buffer dtype controls."""

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    param_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    buffer_dtype: Literal["fp32", "fp16", "bf16"] | None = None
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"

    _canon = field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")(
        classmethod(lambda cls, v: _dtype_name(v)))


class ParallelWriteConfig(Section):
    pipeline_stage: Flag = False


class CheckpointConfig(Section):
    """``checkpoint``: tag validation and load options."""

    tag_validation: str = "Warn"
    load_universal: Flag = False
    use_node_local_storage: Flag = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    writer: dict | None = None

    @field_validator("tag_validation")
    @classmethod
    def _tag_mode(cls, v: str) -> str:
        if v.lower() not in {"ignore", "warn", "fail"}:
            raise ValueError("must be one of Ignore, Warn, Fail")
        return v.capitalize()


class ElasticityConfig(Section):
    """``elasticity`` (kept from DeepSpeed releases before 0.19.8, which removed it)."""

    enabled: Flag = False
    max_train_batch_size: Count = Field(2000, ge=1)
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: Count = Field(1, ge=1)
    max_gpus: Count = Field(10000, ge=1)
    num_gpus_per_node: Count = Field(1, ge=1)
    model_parallel_size: Count = Field(1, ge=1)
    min_time: Count = Field(0, ge=0)
    prefer_larger_batch: Flag = True
    ignore_non_elastic_batch_info: Flag = False
    version: float = Field(0.2, le=0.2)

    @field_validator("micro_batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(isinstance(m, bool) or m <= 0 for m in v):
            raise ValueError("must be a non-empty list of positive integers")
        return v


class CommsLoggerConfig(Section):
    enabled: Flag = False
    verbose: Flag = False
    prof_all: Flag = True
    debug: Flag = False
    prof_ops: list[str] = Field(default_factory=list)


class FlopsProfilerConfig(Section):
    enabled: Flag = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: Flag = True
    output_file: str | None = None


class MonitorConfig(Section):
    """tensorboard / csv_monitor (and the shape shared by the others)."""

    enabled: Flag = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    enabled: Flag = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CometConfig(Section):
    enabled: Flag = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: Flag | None = None
    mode: str | None = None


class AutotuningConfig(Section):
    """``autotuning``: parsed for compatibility; raydeep tunes through Ray Tune instead."""

    enabled: Flag = False
    fast: Flag = True
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: Flag = True
    start_profile_step: int = 3
    end_profile_step: int = 5
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    metric_path: str | None = None
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: dict[str, str] | None = None
    max_train_batch_size: int | None = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    mp_size: int = 1
    model_info: dict[str, Any] | None = None
    model_info_path: str | None = None


class ThroughputTimerConfig(Section):
    enabled: Flag = True
    synchronized: Flag = True


class TimersConfig(Section):
    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)


class RaydeepSection(Section):
    """raydeep's own options, under a top-level ``"raydeep"`` key DeepSpeed ignores."""

    # The ZeRO-3 unit of gathering and releasing. "auto": each transformer block is one unit
    # (the field report: "a Transformer layer should be one complete partition"); otherwise a
    # list of module class names, or "param" for one unit per leaf module.
    partition_units: Literal["auto", "param"] | list[str] = "auto"
    # Which modules the engine wraps for activation checkpointing -- only when the ds_config has an
    # "activation_checkpointing" section: "attention", "block", "none", or a list of class names.
    # The field report found checkpointing only attention the best memory/compute balance, so that
    # is the default.
    checkpoint_modules: Literal["none", "attention", "block"] | list[str] = "attention"
    # Keep every activation autograd saves outside checkpointed regions in pinned host memory,
    # copied on a side stream and brought back in backward (torch's save_on_cpu): activation
    # offload without recomputation. activation_checkpointing.cpu_checkpointing does the same for
    # the inputs of the checkpointed regions only.
    offload_activations: Flag = False
    # Where offload_optimizer.device "cpu" keeps each rank's fp32 masters and optimizer states:
    # "host" (the rank's own host memory), "actors" (Ray actors on offload nodes), or "auto"
    # (actors when the cluster has offload nodes, the host otherwise).
    offload_target: Literal["auto", "host", "actors"] = "auto"
    # What marks offload nodes: a Ray custom resource name (ray start --resources='{"raydeep_offload": 1}')
    # or a node label as key=value (ray start --labels='raydeep/role=offload').
    offload_resource: str = "raydeep_offload"
    # Offload actors per rank (each holds a share of the rank's sub-groups; more overlap the
    # transfers of one with the CPU step of another) and the CPUs each asks for (its threads).
    offload_actors_per_rank: int = Field(1, ge=1)
    offload_actor_cpus: float = Field(1.0, gt=0)
    # The offload tiers' transfer piece, in elements: the next piece's gradients travel while one
    # is updated (host tier: over PCIe; actor tier, Adam/AdamW: through the object store).
    # DeepSpeed's sub_group_size keeps its meaning (how much one optimizer step covers).
    offload_tile_size: int = Field(1 << 22, ge=64)
    # An offload actor on the rank's own node exchanges the gradients and results through shared
    # memory (/dev/shm) instead of the object store: two copies fewer per step and no work for
    # the raylet (raydeep/tier/shared_window.py). false: always the object store.
    offload_shared_memory: Flag = True
    # Threads of the offloaded CPU update (None: the CPUs the worker or offload actor was given).
    cpu_update_threads: int | None = Field(None, ge=1)
    # ZeRO-Offload's one-step delayed parameter update: step t's update runs on the CPU while step
    # t+1's forward and backward run, after delayed_update_warmup_steps ordinary steps. The
    # gradients are one step stale; off by default, as in ZeRO-Offload. Needs offload_optimizer.
    # DeepSpeed's zero_optimization.zenflow.overlap_step turns on the same thing.
    delayed_update: Flag = False
    delayed_update_warmup_steps: int = Field(10, ge=0)
    # Under the delayed update, take each step's gradients where the running update is taking
    # the parameters (raydeep.tier.lookahead): the rank sets them to Adam's next step predicted
    # from its new gradients, so one step of delay does not shrink Adam's stable step size 38-fold.
    # Adam/AdamW only; costs one model-dtype buffer of the owned shard. false: ZeRO-Offload's
    # plain rule (the forward reads parameters one update old).
    delayed_update_lookahead: Flag = True
    # Empty the accelerator allocator's cache every N optimizer steps (0: never). The field
    # report's advice against fragmentation in long runs; it does nothing on a CPU.
    empty_cache_every: int = Field(0, ge=0)
    # After this many consecutive steps skipped for fp16 overflow, log which parameters' gradients
    # overflowed first, the loss-scale history and what to try (0: never). The same diagnosis is
    # attached to the minimum-scale exception whatever this is.
    overflow_diagnosis_after: int = Field(5, ge=0)
    # Check before every collective that all ranks issue the same op with the same shape and dtype,
    # so a divergent rank fails in seconds naming the op, its call site and its unit instead of
    # hanging until the process group times out (raydeep.comm.order; also
    # RAYDEEP_CHECK_COLLECTIVES=1). One small gloo all-gather per collective: for debugging.
    # Write one row of metrics per optimizer step (rank 0) to <run>/metrics/ as Parquet in
    # `raydeep train` runs (raydeep.metrics); cheap enough to leave on.
    metrics: Flag = True
    # The accelerator's peak dense TFLOP/s for the MFU estimate; None looks the device up in a
    # table of common GPUs (bf16/fp16 tensor-core peaks) and leaves MFU empty on other devices.
    peak_tflops: float | None = Field(None, gt=0)
    check_collective_order: Flag = False
    # How long the check waits for a rank that has not announced its next collective.
    collective_order_timeout_s: float = Field(60.0, gt=0)
    seed: int = 1234
    # engine.save_checkpoint writes in a background thread (training continues; the next save waits).
    checkpoint_async: Flag = False
    # fsync every checkpoint file before the commit, so even a machine crash cannot leave a
    # committed tag with missing data. Turning it off makes frequent saves much cheaper; a killed
    # process still loses nothing, and a file lost to a machine crash fails its checksum on load.
    checkpoint_fsync: Flag = True
    # Keep only the newest K committed checkpoints under a save_dir (None keeps all).
    checkpoint_keep_last_k: int | None = Field(None, ge=1)
    # Ray Train runs (`raydeep train`): every N steps each rank's state also goes, as a checkpoint,
    # into the memory of a store the driver holds (raydeep.ray.memory_snapshots), and a restart
    # resumes from the newest snapshot when it is newer than the newest storage checkpoint: a lost
    # worker then costs the steps since the snapshot, not since the checkpoint. "auto": as often as
    # costs at most 3% of the training time, measured (raydeep.ray.snapshot_cadence), and off when
    # two snapshots would take more than half of the driver node's free memory. 0: off.
    memory_snapshot_every: Literal["auto"] | int = "auto"
    # The step watchdog of Ray Train runs (raydeep.ray.watchdog): a rank stuck inside a step (a
    # deadlocked collective, a stuck data read) would otherwise block every rank silently until
    # the process group times out. When a step runs longer than step_timeout_s, each rank writes
    # every thread's stack under <run>/diagnostics/ and the driver prints where the rank is. None
    # derives it: 10x the median of the last 20 steps, at least min_step_timeout_s, and 600 s
    # before the first step finishes (it includes the warm-up). A set value applies to every step.
    step_timeout_s: float | None = Field(None, gt=0)
    min_step_timeout_s: float = Field(60.0, ge=0)
    watchdog: Flag = True
    # The torch.distributed process-group timeout of Ray Train runs (TorchConfig(timeout_s=...)):
    # how long a collective waits for a missing rank before the run fails and restarts. Ray's
    # default, 1800 s, leaves a hang unnoticed for half an hour.
    collective_timeout_s: float = Field(600.0, gt=0)

    @field_validator("memory_snapshot_every", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> Any:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError("must be \"auto\" or a number of steps >= 0 (0 turns memory snapshots off)")
        return v
