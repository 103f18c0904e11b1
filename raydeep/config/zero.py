"""The ``zero_optimization`` section with DeepSpeed 0.19.8's keys, defaults and units.

All sizes count elements, not bytes. Every ``stage3_*`` key is an alias of the field without the
prefix (either spelling is accepted; both together is an error), as in DeepSpeed.
"""
from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import Field, model_validator

from raydeep.config.base import Count, Flag, Section


class OffloadOptimizerConfig(Section):
    """Where the fp32 master weights and optimizer states live (``offload_optimizer``)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: Count = Field(4, ge=0)
    pin_memory: Flag = True
    pipeline_read: Flag = False
    pipeline_write: Flag = False
    fast_init: Flag = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)
    super_offload: Flag = False
    cpuadam_cores_perc: float = Field(0.8, ge=0.0, le=1.0)


class OffloadParamConfig(Section):
    """Where stage-3 parameter partitions live (``offload_param``)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    buffer_count: Count = Field(5, ge=0)
    buffer_size: Count = Field(100_000_000, ge=0)
    max_in_cpu: Count = Field(1_000_000_000, ge=0)
    pin_memory: Flag = True


class ZenFlowConfig(Section):
    """DeepSpeed's ZenFlow (``zenflow``): raydeep honours its ``overlap_step`` (the delayed update,
    ``raydeep.delayed_update``) and ``full_warm_up_rounds`` (its warm-up steps); the top-k split of
    important gradients is not implemented (the support table says so per key)."""

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    select_interval: Literal["auto"] | int = "auto"
    update_interval: Literal["auto"] | int = "auto"
    overlap_step: Flag = False
    offload: Flag = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = Field(0, ge=0)
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    steps_per_epoch: int | None = None


class ZeroConfig(Section):
    """ZeRO partitioning: stage 0 (data parallel) to 3 (parameters partitioned)."""

    stage: Literal[0, 1, 2, 3] = 0
    contiguous_gradients: Flag = True
    reduce_scatter: Flag = True
    reduce_bucket_size: Count = Field(500_000_000, gt=0)
    use_multi_rank_bucket_allreduce: Flag = True
    allgather_partitions: Flag = True
    allgather_bucket_size: Count = Field(500_000_000, ge=0)
    overlap_comm: Flag | None = None
    compute_grad_norm: Flag = True
    load_from_fp32_weights: Flag = True
    elastic_checkpoint: Flag = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: ZenFlowConfig | None = None
    sub_group_size: Count = Field(1_000_000_000, ge=0)
    prefetch_bucket_size: Count = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: Count = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: Count = Field(sys.maxsize, ge=0, alias="stage3_model_persistence_threshold")
    # The field report's advice (1e9) is also DeepSpeed's default: keep up to 1e9 elements live.
    max_live_parameters: Count = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: Count = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: Flag = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: Count = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: Flag = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: Flag = Field(False, alias="stage3_allgather_sequential")
    ignore_unused_parameters: Flag = True
    legacy_stage1: Flag = False
    round_robin_gradients: Flag = False
    parameter_alignment: Flag = False
    zero_hpz_partition_size: Count = Field(1, ge=0)
    zero_quantized_weights: Flag = False
    zero_quantized_nontrainable_weights: Flag = False
    zero_quantized_gradients: Flag = False
    zeropp_loco_param: dict | None = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: Flag = False
    memory_efficient_linear: Flag = True
    override_module_apply: Flag = True
    pipeline_loading_checkpoint: Flag = False
    log_trace_cache_warnings: Flag = False
    enable_sanity_checks: Flag = False
    save_muon_momentum_buffer_in_memory: Flag = False
    leaf_module: dict | None = None

    @model_validator(mode="after")
    def _resolve_overlap(self) -> "ZeroConfig":
        # DeepSpeed's overlap_comm_valid: unset means on for stage 3 only.
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        return self


# Deprecated spellings: old key -> (new key, how to translate the value).
DEPRECATED_ZERO_KEYS: dict[str, tuple[str, Any]] = {
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", lambda v: v),
    "cpu_offload": ("offload_optimizer", lambda v: {"device": "cpu"} if v else None),
    "cpu_offload_param": ("offload_param", lambda v: {"device": "cpu"} if v else None),
}


def field_spellings(field: str) -> tuple[str, ...]:
    """The accepted spellings (name, alias) of a ZeroConfig field."""
    info = ZeroConfig.model_fields[field]
    return (field,) if info.alias is None else (field, info.alias)
