"""The top-level ds_config model: every DeepSpeed 0.19.8 training key, plus ``raydeep``.

What raydeep does with each field of the model (honoured, warned about, or refused) is the table
in ``raydeep.config.support``. DeepSpeed top-level keys that are not fields at all are listed in
``UNSUPPORTED`` with what happens to them: an error ("not supported by raydeep") or, where they are
harmless, a warning.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, Strict, field_validator, model_validator

from raydeep.config.base import Flag, Section
from raydeep.config.sections import (
    ActivationCheckpointingConfig, AutotuningConfig, BF16Config, CheckpointConfig, CometConfig,
    CommsLoggerConfig, DataTypesConfig, ElasticityConfig, FlopsProfilerConfig, FP16Config,
    MonitorConfig, OptimizerConfig, RaydeepSection, SchedulerConfig, TimersConfig, WandbConfig,
)
from raydeep.config.zero import ZeroConfig

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _whole_batch(value: Any) -> Any:
    # Python's int() would read true as 1 and "8" as 8, hiding a typo in the batch arithmetic;
    # only a whole float (8.0, as some generators write it) is taken as the integer it spells.
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("must be a whole number")
        return int(value)
    return value


# A batch key: a strict integer (range checks are DeepSpeed's, in derive_batch, with its messages).
BatchInt = Annotated[int, Strict(), BeforeValidator(_whole_batch)]


class RaydeepConfig(Section):
    """A validated, resolved ds_config. Components read only their own section.

    Build it with :func:`raydeep.config.load_config`, which also derives the batch triangle:

    >>> from raydeep.config import load_config
    >>> cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    >>> cfg.gradient_accumulation_steps, cfg.zero_optimization.stage
    (4, 0)
    """

    train_batch_size: BatchInt | None = None
    train_micro_batch_size_per_gpu: BatchInt | None = None
    gradient_accumulation_steps: BatchInt | None = None
    managed_gradient_accumulation: Flag = True
    steps_per_print: int | None = Field(None, ge=1)
    wall_clock_breakdown: Flag = False
    memory_breakdown: Flag = False
    dump_state: Flag = False
    gradient_clipping: float = Field(1.0, ge=0.0)
    prescale_gradients: Flag = False
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    gradient_predivide_factor: float = Field(1.0, gt=0.0)
    communication_data_type: Literal["fp16", "bf16", "fp32"] | None = None
    seq_parallel_communication_data_type: Literal["fp16", "bf16", "fp32"] = "fp32"
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_allow_untested_optimizer: Flag = False
    zero_force_ds_cpu_optimizer: Flag = True
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    comms_logger: CommsLoggerConfig | None = None
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    dataloader_drop_last: Flag = False
    vocabulary_size: int | None = None
    disable_python_gc: Flag = False
    log_level: str | None = None
    raydeep: RaydeepSection = Field(default_factory=RaydeepSection)

    # Set by load_config: the data-parallel world size the batch keys were derived for.
    _world_size: int = PrivateAttr(1)
    _warnings: list = PrivateAttr(default_factory=list)
    # Set by load_config: canonical dotted path -> the spelling the user wrote, where they differ.
    _written: dict = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gradient_allreduce_op_case(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("gradient_allreduce_op"), str):
            data = dict(data, gradient_allreduce_op=data["gradient_allreduce_op"].lower())
        return data

    @model_validator(mode="after")
    def _disabled_comms_logger_is_absent(self) -> "RaydeepConfig":
        # DeepSpeed logs collectives only with comms_logger.enabled; the engine switches its logging
        # on by the section's presence, so a disabled section must not be present.
        if self.comms_logger is not None and not self.comms_logger.enabled:
            object.__setattr__(self, "comms_logger", None)
        return self

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _comm_dtype(cls, v: Any) -> Any:
        if v is not None and v not in ("fp16", "bf16", "fp32"):
            raise ValueError(f"Invalid communication_data_type. Supported data types: ['fp16', 'bf16', 'fp32']. Got: {v}")
        return v

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch triangle was derived for."""
        return self._world_size

    @property
    def warnings(self) -> list[str]:
        """Warnings raised while loading (settings accepted but without effect, advice)."""
        return self._warnings

    @property
    def precision(self) -> str:
        """The model dtype name: "fp16", "bf16" or "fp32"."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def grad_accum_dtype(self) -> str:
        """``data_types.grad_accum_dtype`` if set, else the model dtype (DeepSpeed 0.19.8)."""
        return self.data_types.grad_accum_dtype or self.precision

    def to_ds_dict(self) -> dict:
        """The resolved config as a DeepSpeed-style dict (aliases, batch keys as integers)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# DeepSpeed top-level keys raydeep does not implement: "error" refuses them, "warn" accepts
# them as harmless no-ops. The text says what to do instead.
UNSUPPORTED: dict[str, tuple[str, str]] = {
    "amp": ("error", "NVIDIA Apex AMP is not supported by raydeep (DeepSpeed 0.19.8 removed it too); use \"fp16\" or \"bf16\""),
    "pipeline": ("error", "pipeline parallelism is not supported by raydeep; remove the section"),
    "tensor_parallel": ("error", "tensor parallelism (AutoTP) is not supported by raydeep; remove the section"),
    "sequence_parallel_size": ("error", "sequence parallelism is not supported by raydeep; remove the key"),
    "data_parallel_size": ("error", "explicit device meshes are not supported by raydeep; the data-parallel size is the number of workers"),
    "expert_parallel": ("error", "expert parallelism (AutoEP) is not supported by raydeep; remove the section"),
    "hybrid_engine": ("error", "the RLHF hybrid engine is not supported by raydeep; remove the section"),
    "compile": ("error", "DeepCompile is not supported by raydeep; remove the section"),
    "torch_autocast": ("error", "torch_autocast is not supported by raydeep; use \"bf16\" or \"fp16\""),
    "nebula": ("error", "Nebula checkpointing is not supported by raydeep (removed in DeepSpeed 0.19.8); remove the section"),
    "compression_training": ("error", "compression training is not supported by raydeep; remove the section"),
    "quantize_training": ("error", "quantize training is not supported by raydeep; remove the section"),
    "sparse_gradients": ("error", "sparse gradients are not supported by raydeep; remove the key"),
    "eigenvalue": ("error", "eigenvalue computation is not supported by raydeep; remove the section"),
    "sparse_attention": ("error", "sparse attention is not supported by raydeep; remove the section"),
    "graph_harvesting": ("error", "CUDA graph harvesting is not supported by raydeep; remove the key"),
    "curriculum_learning": ("error", "curriculum learning is not supported by raydeep; remove the section"),
    "progressive_layer_drop": ("error", "progressive layer drop is not supported by raydeep; remove the section"),
    "data_efficiency": ("error", "data efficiency (curriculum/random-LTD) is not supported by raydeep; remove the section"),
    "weight_quantization": ("error", "weight quantization is not supported by raydeep; remove the section"),
    "datastates": ("error", "DataStates checkpointing is not supported by raydeep; raydeep checkpoints are sharded and async already"),
    "aio": ("warn", "NVMe I/O settings have no effect in raydeep (NVMe offload is not supported)"),
    "use_data_before_expert_parallelism": ("warn", "has no effect in raydeep (no expert parallelism)"),
    "disable_allgather": ("warn", "has no effect in raydeep"),
    "mesh_param": ("warn", "has no effect in raydeep"),
}
