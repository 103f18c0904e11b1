"""raydeep's ds_config system: parse once, refuse mistakes loudly, resolve for a world size.

>>> from raydeep.config import load_config
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}}, world_size=2)
>>> cfg.train_batch_size, cfg.zero_optimization.overlap_comm
(8, True)
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from raydeep.config.batch import BatchPlan, derive_batch, elastic_plan
from raydeep.config.keys import check_keys, spellings
from raydeep.config.loading import AUTO, apply_overrides, drop_auto, find_auto, read_config
from raydeep.config.model import BATCH_KEYS, UNSUPPORTED, RaydeepConfig
from raydeep.config.rules import check_rules
from raydeep.config.support import written_spellings
from raydeep.config.zero import DEPRECATED_ZERO_KEYS, ZeroConfig, field_spellings
from raydeep.errors import ConfigError, ConfigErrors, key_part

__all__ = ["BatchPlan", "ConfigError", "RaydeepConfig", "load_config", "read_config"]

logger = logging.getLogger("raydeep")

# Sections DeepSpeed validates with pydantic, where an unresolved "auto" silently means the default.
AUTO_DROPPING_SECTIONS = ("zero_optimization", "fp16", "bf16", "comms_logger", "tensorboard", "csv_monitor",
                          "wandb", "comet")

# Keys whose own value set includes "auto" (a real setting, not a placeholder to fill in).
AUTO_IS_A_VALUE = frozenset({"raydeep.partition_units", "raydeep.offload_target", "raydeep.memory_snapshot_every",
                             "data_types.keep_in_fp32_modules",
                             "zero_optimization.zenflow.select_strategy", "zero_optimization.zenflow.select_interval",
                             "zero_optimization.zenflow.update_interval"})
# Where Hugging Face's integration fills each "auto" from, to make the unresolved-key error useful.
HF_SOURCES = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "the number of training steps",
}


def load_config(config: Any, *, world_size: int | None = None,
                overrides: Mapping[str, Any] | Iterable[str] | None = None) -> RaydeepConfig:
    """Parse, validate and resolve a ds_config for ``world_size`` data-parallel ranks.

    ``config`` is a dict, a JSON/HJSON path, JSON text or base64; ``overrides`` maps dotted keys
    to values (or is a list of ``key=JSON`` strings) and is how ``"auto"`` values get resolved.
    Raises :class:`ConfigError` naming the key, the value and the fix.
    """
    world_size = 1 if world_size is None else int(world_size)
    if world_size < 1:
        raise ConfigError("world_size", "must be at least 1", value=world_size, fix="pass the number of workers")
    data = apply_overrides(read_config(config), overrides)
    warnings: list[str] = []
    renamed: dict[str, tuple[str, bool]] = {}
    _normalise(data, warnings, renamed)
    _resolve_auto(data, warnings)
    cfg = _validate(data)
    cfg._written = written_spellings(data, RaydeepConfig, renamed)  # so messages name the keys as written
    plan = _batch_plan(cfg, world_size, warnings)
    for key, value in zip(BATCH_KEYS, (plan.train_batch_size, plan.micro_batch, plan.grad_accum)):
        object.__setattr__(cfg, key, value)
    cfg._world_size = world_size  # before the rules: some depend on it (ZeRO++'s hpZ group)
    errors: list[ConfigError] = []
    check_rules(cfg, errors, warnings)
    _raise(errors)
    cfg._warnings.extend(dict.fromkeys(warnings))  # de-duplicated, in order
    for text in cfg.warnings:
        logger.warning(text)
    return cfg


def _raise(errors: list[ConfigError]) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def _normalise(data: dict, warnings: list[str], renamed: dict[str, tuple[str, bool]]) -> None:
    """Legacy spellings, unsupported top-level keys and unknown keys, before validation. ``renamed``
    collects, per legacy spelling translated, canonical path -> (legacy key, whether its value was
    translated too) -- see ``support.written_spellings``."""
    errors: list[ConfigError] = []
    if "bfloat16" in data:
        legacy = data.pop("bfloat16")
        if "bf16" in data:
            warnings.append('both "bf16" and the legacy "bfloat16" are given; "bf16" wins, as in DeepSpeed')
        else:
            data["bf16"] = legacy
            renamed["bf16"] = ("bfloat16", False)
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        warnings.append('"zero_optimization": true/false is deprecated; use {"stage": N}')
        data["zero_optimization"] = zero = {"stage": 1 if zero else 0}
    if isinstance(zero, dict):
        errors += _normalise_zero(zero, warnings, renamed)
    for key in [k for k in data if k in UNSUPPORTED]:
        action, text = UNSUPPORTED[key]
        value = data.pop(key)
        disabled = isinstance(value, dict) and value.get("enabled") is False
        if action == "warn" or disabled:
            warnings.append(f"{key}: {text}" if action == "warn" else f"{key} is disabled and has no effect in raydeep")
        else:
            errors.append(ConfigError(key, text.split(";")[0], fix=text.split(";", 1)[-1].strip()))
    errors += check_keys(data, RaydeepConfig)
    _raise(errors)


def _normalise_zero(zero: dict, warnings: list[str], renamed: dict[str, tuple[str, bool]]) -> list[ConfigError]:
    errors = []
    for old, (new, translate) in DEPRECATED_ZERO_KEYS.items():
        if old not in zero:
            continue
        if new in zero:
            errors.append(ConfigError(f"zero_optimization.{old}", f"Cannot provide deprecated parameter '{old}' and "
                                      f"replacing parameter '{new}' together", fix=f"keep only {new}"))
            continue
        warnings.append(f"Config parameter zero_optimization.{old} is deprecated use {new} instead")
        value = translate(zero.pop(old))
        if value is not None:
            zero[new] = value
            renamed[f"zero_optimization.{spellings(ZeroConfig)[new]}"] = (f"zero_optimization.{old}", True)
    if "cpu_offload_use_pin_memory" in zero:
        zero.pop("cpu_offload_use_pin_memory")
        warnings.append("zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect")
    for field in ZeroConfig.model_fields:
        given = [s for s in field_spellings(field) if s in zero]
        if len(given) > 1:
            errors.append(ConfigError(f"zero_optimization.{given[1]}", f"is the same setting as {given[0]!r}",
                                      fix="give only one spelling"))
    return errors


def _resolve_auto(data: dict, warnings: list[str]) -> None:
    """Apply DeepSpeed's "auto" rules; anything left unresolved is one error listing every key."""
    for name in AUTO_DROPPING_SECTIONS:
        section = data.get(name)
        if isinstance(section, dict):
            for key in drop_auto(section, name, AUTO_IS_A_VALUE):
                warnings.append(f'{name}.{key} = "auto" was not resolved: using its default, as DeepSpeed does '
                                f"(set it with --set {name}.{key}=VALUE)")
    if data.get("train_batch_size") == AUTO:
        # Derived from the other two and the world size (m * g * W), the triangle's own rule.
        data.pop("train_batch_size")
    unresolved = [key for key in find_auto(data) if key not in AUTO_IS_A_VALUE]
    if unresolved:
        errors = []
        for key in unresolved:
            source = f" (Hugging Face fills it from {HF_SOURCES[key]})" if key in HF_SOURCES else ""
            errors.append(ConfigError(key, f'"auto" is not resolved{source}',
                                      fix=f"pass --set {key}=VALUE, or overrides={{'{key}': VALUE}} in Python"))
        raise ConfigErrors(errors) if len(errors) > 1 else errors[0]


def _validate(data: dict) -> RaydeepConfig:
    try:
        return RaydeepConfig.model_validate(data)
    except ValidationError as exc:
        errors = []
        for err in exc.errors(include_url=False):
            key = ".".join(key_part(str(p)) for p in err["loc"] if not _is_union_tag(p)) or "config"
            msg = err["msg"].removeprefix("Value error, ")
            errors.append(ConfigError(key, msg, value=err.get("input"), fix=_fix_for(err)))
        _raise(errors)
        raise  # pragma: no cover - _raise always raises for a non-empty list


def _is_union_tag(part: Any) -> bool:
    # pydantic names the union member (or validator) that failed, e.g. "list[str]" or
    # "function-before[...]"; those are its internals, not keys the user wrote.
    return isinstance(part, str) and ("[" in part or part.startswith("function-"))


def _fix_for(err: dict) -> str:
    kind = err["type"]
    if kind == "literal_error":
        return f"use {err['ctx']['expected']}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return "use a value in the allowed range"
    if kind == "missing":
        return "add the key"
    return "use a value of the expected type"


def _batch_plan(cfg: RaydeepConfig, world_size: int, warnings: list[str]) -> BatchPlan:
    if not cfg.elasticity.enabled:
        return derive_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                            cfg.gradient_accumulation_steps, world_size)
    given = [k for k in BATCH_KEYS if getattr(cfg, k) is not None]
    if given and not cfg.elasticity.ignore_non_elastic_batch_info:
        raise ConfigError(given[0], "One or more batch related parameters were found in your ds_config "
                          f"({', '.join(given)}). These parameters *will not be used* since elastic training is "
                          "enabled, which takes control of these parameters.",
                          fix="remove them, or set elasticity.ignore_non_elastic_batch_info to true")
    if given:
        warnings.append(f"{', '.join(given)} ignored: elasticity decides the batch")
    return elastic_plan(cfg.elasticity, world_size)
