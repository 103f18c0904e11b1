"""The doctor's lint rules: settings that load fine but train worse than the user expects.

Each rule has a stable id (``RULES``), and each finding names the key and its value, says why it
matters and what to change. Load-time warnings that ``load_config`` already collects
(``cfg.warnings``: keys without effect, deprecated spellings) become findings here instead of being
checked twice, and the field report's gradient-clipping advice is reported once, by its own rule.

>>> from raydeep.config import load_config
>>> from raydeep.doctor.shape import Cluster, ModelShape
>>> shape = ModelShape.from_counts(params=10**9, layers=24, hidden=2048, seq=2048, vocab=50304)
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3,
...                    "stage3_max_live_parameters": 10**6}}, world_size=8)
>>> [(f.rule, f.severity) for f in lint(cfg, shape, Cluster(world_size=8))]
[('live-parameters-below-layer', 'warning')]
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from raydeep.config.model import UNSUPPORTED, RaydeepConfig
from raydeep.config.rules import ACCUMULATION_CLIP_STEPS, accumulation_advice
from raydeep.config.support import HONOURED, SUPPORT, as_written, changed_fields
from raydeep.doctor.shape import Cluster, Finding, ModelShape, Severity
from raydeep.estimate import PRECISION_BYTES

__all__ = ["RULES", "RuleInfo", "lint", "lr_sweep_finding", "rules_markdown"]


@dataclass(frozen=True)
class RuleInfo:
    """One lint rule as the docs list it: id, what it checks, the severities it reports, why, the fix."""

    id: str
    title: str
    severities: tuple[Severity, ...]
    reason: str
    fix: str


def _rule(id: str, title: str, severities: tuple[Severity, ...], reason: str, fix: str) -> tuple[str, RuleInfo]:
    return id, RuleInfo(id, title, severities, reason, fix)


RULES: dict[str, RuleInfo] = dict([
    _rule("accumulation-without-clipping",
          f"gradient_accumulation_steps > {ACCUMULATION_CLIP_STEPS} with gradient_clipping 0", ("warning",),
          f"the field report's advice: above {ACCUMULATION_CLIP_STEPS} accumulation steps gradients can explode",
          "set gradient_clipping (e.g. 1.0)"),
    _rule("fp16-without-hysteresis",
          "fp16 dynamic loss scaling without hysteresis on a model of 1e9 parameters or more", ("warning",),
          "a single overflow then halves the loss scale at once; large models overflow sporadically, so the scale "
          "keeps falling (DeepSpeed's default hysteresis is 2, and stage 0's non-ZeRO scaler has none at all)",
          'set fp16.hysteresis to 2 or more (fp16.consecutive_hysteresis true refills it after each clean step) '
          'under ZeRO stage >= 1, or train in bf16'),
    _rule("bucket-size", "reduce_bucket_size larger than device memory allows, or far from 1/8 of it",
          ("error", "info"),
          "the gradient buckets (two with overlap_comm at stages 1-2) sit beside the model states; the field "
          "report found buckets near 1/8 of device memory hide communication behind compute best",
          "set zero_optimization.reduce_bucket_size to about device memory / 8 / bytes per gradient element"),
    _rule("live-parameters-below-layer",
          "stage3_max_live_parameters below the largest ZeRO-3 unit (one transformer block)", ("warning",),
          "a unit is always gathered whole, so the limit cannot hold, and with no room left under it nothing "
          "is prefetched: every gather waits in the open",
          "raise zero_optimization.stage3_max_live_parameters to at least the largest unit (DeepSpeed's "
          "default, 1e9, is the field report's advice)"),
    _rule("prefetch-below-layer",
          "stage3_prefetch_bucket_size below the largest ZeRO-3 unit", ("info",),
          "the next unit never fits the prefetch budget, so stage 3 gathers each unit only when it is needed",
          "raise zero_optimization.stage3_prefetch_bucket_size to at least the largest unit (or set 0 to say "
          "that no prefetch is meant)"),
    _rule("offload-without-pin-memory", "CPU offload with pin_memory false", ("warning",),
          "copies between the device and pageable host memory are about 2-3x slower than from pinned memory and "
          "cannot overlap with compute",
          "set pin_memory true in offload_optimizer / offload_param (the default)"),
    _rule("bf16-accumulation", "bf16 gradients accumulated in bf16 over 8 or more micro-batches", ("warning",),
          "bf16's 8-bit mantissa drops small contributions when many micro-batch gradients are summed "
          "(DeepSpeed issues #1800, #2768); ZeRO stages 0-1 always sum them in the model dtype",
          'set "data_types": {"grad_accum_dtype": "fp32"} with ZeRO stage 2 or 3'),
    _rule("lr-swept-under-scheduler", "optimizer.params.lr swept while the scheduler sets the LR itself",
          ("warning",),
          "WarmupLR/WarmupDecayLR with warmup_max_lr, OneCycle, LRRangeTest and torch's OneCycleLR/CyclicLR "
          "overwrite the optimizer's lr from their own parameters, so every trial trains with the same LR. "
          "WarmupCosineLR and torch schedulers such as StepLR multiply the optimizer's lr, and WarmupLR without "
          "warmup_max_lr warms up to it: sweeping it works there",
          "sweep the scheduler's key instead (e.g. scheduler.params.warmup_max_lr)"),
    _rule("no-effect", "keys that have no effect in this combination", ("warning", "info"),
          "the config says something the run does not do; a value that differs from the default is a warning, "
          "one written at its default is info",
          "remove the key, or change the setting it depends on"),
    _rule("deprecated-key", "deprecated DeepSpeed spellings (load_config translates them)", ("warning",),
          "the old spelling still works, but newer DeepSpeed releases drop it",
          "use the spelling the message names"),
    _rule("load-warning", "any other warning load_config raised", ("warning",),
          "load_config warns about settings that work but not as well as they could",
          "see the message"),
])


def rules_markdown() -> str:
    """The rules as a Markdown table (one row per rule), for the doctor's docs.

    >>> rules_markdown().splitlines()[2].split(" | ")[:2]
    ['| `accumulation-without-clipping`', 'warning']
    """
    rows = ["| Rule | Severity | What it checks | Why | Fix |", "|---|---|---|---|---|"]
    for info in RULES.values():
        cells = [f"`{info.id}`", ", ".join(info.severities), info.title, info.reason, info.fix]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


def lint(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster, swept: Collection[str] = ()) -> list[Finding]:
    """Every finding for ``cfg`` (from ``load_config(..., world_size=cluster.world_size)``) training
    ``shape`` on ``cluster``; ``swept`` holds the dotted keys a sweep varies (Ray Tune's "set")."""
    findings: list[Finding] = []
    for check in (_accumulation_without_clipping, _fp16_without_hysteresis, _bucket_size, _live_parameters,
                  _offload_without_pin_memory, _bf16_accumulation, _load_warnings, _no_effect):
        findings += check(cfg, shape, cluster)
    if "optimizer.params.lr" in swept and cfg.scheduler is not None:
        found = lr_sweep_finding(cfg.scheduler.type, cfg.scheduler.params)
        findings += [found] if found else []
    return findings


def _finding(rule: str, severity: Severity, message: str, key: str | None = None, *, reason: str | None = None,
             fix: str | None = None) -> Finding:
    assert severity in RULES[rule].severities, (rule, severity)
    return Finding(rule, severity, message, reason or RULES[rule].reason, fix or RULES[rule].fix, key)


def _key(cfg: RaydeepConfig, path: str) -> str:
    """``path`` spelled as the user wrote it (``stage3_*`` aliases, legacy keys)."""
    return as_written(path, cfg._written)


# --- precision and accumulation ------------------------------------------------------------------
def _accumulation_without_clipping(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    # The text is config/rules.py's, which also warns at load time; _load_warnings skips that warning.
    advice = accumulation_advice(cfg)
    if advice is None:
        return []
    return [_finding("accumulation-without-clipping", "warning", advice.message, "gradient_clipping",
                     reason=advice.reason, fix=advice.fix)]


def _fp16_without_hysteresis(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    fp16, stage = cfg.fp16, cfg.zero_optimization.stage
    if not fp16.enabled or fp16.loss_scale != 0 or shape.params < 10**9:
        return []
    if stage == 0:
        # The non-ZeRO scaler (DeepSpeed's fp16 wrapper without ZeRO) has no hysteresis to set.
        return [_finding("fp16-without-hysteresis", "warning", f"fp16 dynamic loss scaling at ZeRO stage 0 on a "
                         f"{shape.params:,}-parameter model: stage 0's scaler halves the scale on every overflow "
                         "(fp16.hysteresis is not used)", "zero_optimization.stage",
                         fix="use ZeRO stage 1 or more with fp16.hysteresis 2 (the default), or train in bf16")]
    if fp16.hysteresis > 1:
        return []
    return [_finding("fp16-without-hysteresis", "warning", f"fp16.hysteresis = {fp16.hysteresis} with dynamic loss "
                     f"scaling on a {shape.params:,}-parameter model", _key(cfg, "fp16.hysteresis"))]


def _bf16_accumulation(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    gas, stage = cfg.gradient_accumulation_steps or 1, cfg.zero_optimization.stage
    if not cfg.bf16.enabled or gas < 8:
        return []
    if stage >= 2 and cfg.grad_accum_dtype != "bf16":
        return []
    where = (f"ZeRO stage {stage} sums micro-batch gradients in the model dtype (bf16)" if stage <= 1 else
             "data_types.grad_accum_dtype is bf16" + ("" if cfg.data_types.grad_accum_dtype else " (the default)"))
    return [_finding("bf16-accumulation", "warning", f"gradient_accumulation_steps = {gas} in bf16: {where}",
                     "data_types.grad_accum_dtype")]


# --- ZeRO ----------------------------------------------------------------------------------------


def _bucket_size(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    """reduce_bucket_size against device memory. Stage 3 reduces per partition unit instead (its
    reduce_bucket_size is a ``no-effect`` finding), and raydeep has no all-gather buckets:
    allgather_bucket_size set to another value is reported by load_config as having no effect."""
    memory, zero = cluster.device_memory, cfg.zero_optimization
    if memory is None or zero.stage == 3:
        return []
    element = PRECISION_BYTES[cfg.communication_data_type or cfg.precision]
    bucket = min(zero.reduce_bucket_size, shape.params) * element  # never more than the model's gradients
    count = 2 if zero.overlap_comm and zero.stage in (1, 2) else 1
    states = _model_states(cfg, shape, cluster)
    key = _key(cfg, "zero_optimization.reduce_bucket_size")
    value = f"{key} = {zero.reduce_bucket_size:,} elements ({_gb(bucket)} per bucket)"
    if bucket > memory / 2:
        return [_finding("bucket-size", "error", f"{value} is more than half of the {_gb(memory)} of device memory",
                         key, fix=f"set {key} to about {_suggest(memory / 8 / element)}")]
    # The most a bucket can usefully be: 1/8 of the memory, no more than the whole gradient, and
    # leaving half of what the model states leave free (so the suggestion itself fits).
    limits = {"1/8 of the device memory": memory / 8, "the whole gradient": shape.params * element,
              "half the memory the model states leave": (memory - states) / count / 2}
    what, target = min(limits.items(), key=lambda item: item[1])
    if states <= memory < states + count * bucket:  # the model states fit, the bucket(s) tip them over
        held = "two buckets (overlap_comm)" if count == 2 else "the bucket"
        return [_finding("bucket-size", "error", f"{value}: {held} and {_gb(states)} of model states exceed "
                         f"the {_gb(memory)} of device memory", key,
                         fix=f"set {key} to about {_suggest(target / element)}")]
    # More than 4x too large is past half the memory: the first error above.
    if bucket * 4 < target:
        return [_finding("bucket-size", "info", f"{value} is more than 4x below {what} ({_gb(target)})", key,
                         fix=f"set {key} to about {_suggest(target / element)}")]
    return []


def _model_states(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> int:
    from raydeep.estimate import estimate_model_states

    zero = cfg.zero_optimization
    opt, param = zero.offload_optimizer, zero.offload_param
    return estimate_model_states(shape.params, cluster.world_size, zero.stage, cfg.precision,
                                 offload_optimizer=bool(opt and opt.device == "cpu" and zero.stage >= 1),
                                 offload_param=bool(param and param.device == "cpu" and zero.stage == 3)).total


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def _suggest(elements: float) -> str:
    # Two significant digits, and even: DeepSpeed wants bucket sizes to be multiples of 2.
    return f"{max(2, int(float(f'{elements:.2g}')) // 2 * 2):,} elements"


def _largest_unit(cfg: RaydeepConfig, shape: ModelShape) -> int:
    # raydeep.partition_units "param" gathers each parameter alone; otherwise a block is the unit.
    return shape.largest_tensor if cfg.raydeep.partition_units == "param" else shape.block_params


def _live_parameters(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    zero, unit = cfg.zero_optimization, _largest_unit(cfg, shape)
    if zero.stage != 3 or unit <= 0:
        return []
    if zero.max_live_parameters < unit:
        key = _key(cfg, "zero_optimization.max_live_parameters")
        return [_finding("live-parameters-below-layer", "warning", f"{key} = {zero.max_live_parameters:,} is below "
                         f"the largest ZeRO-3 unit ({unit:,} parameters)", key,
                         fix=f"set {key} to at least {unit:,} (1e9 is DeepSpeed's default)")]
    if 0 < zero.prefetch_bucket_size < unit:
        key = _key(cfg, "zero_optimization.prefetch_bucket_size")
        return [_finding("prefetch-below-layer", "info", f"{key} = {zero.prefetch_bucket_size:,} is below the "
                         f"largest ZeRO-3 unit ({unit:,} parameters): nothing is prefetched", key,
                         fix=f"set {key} to at least {unit:,}, or to 0 to say no prefetch is meant")]
    return []


def _offload_without_pin_memory(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    zero, found = cfg.zero_optimization, []
    opt, param = zero.offload_optimizer, zero.offload_param
    # Offload actors receive gradients through the object store or a shared window: only the host tier pins.
    host_tier = cfg.raydeep.offload_target != "actors"
    if opt and opt.device == "cpu" and zero.stage >= 1 and not opt.pin_memory and host_tier:
        key = _key(cfg, "zero_optimization.offload_optimizer.pin_memory")
        found.append(_finding("offload-without-pin-memory", "warning", f"{key} = false with the optimizer "
                              "offloaded to host memory", key, fix=f"set {key} to true"))
    if param and param.device == "cpu" and zero.stage == 3 and not param.pin_memory:
        key = _key(cfg, "zero_optimization.offload_param.pin_memory")
        found.append(_finding("offload-without-pin-memory", "warning", f"{key} = false with the parameters "
                              "offloaded to host memory", key, fix=f"set {key} to true"))
    return found


# --- learning-rate sweeps ------------------------------------------------------------------------
# Schedulers that set the LR from their own parameters: the key to sweep instead, and what they do.
_LR_SETTERS = {
    "WarmupLR": ("warmup_max_lr", "warms up from warmup_min_lr to warmup_max_lr"),
    "WarmupDecayLR": ("warmup_max_lr", "warms up to warmup_max_lr (0.001 unless given) and decays from it"),
    "OneCycle": ("cycle_max_lr", "cycles between cycle_min_lr and cycle_max_lr"),
    "LRRangeTest": ("lr_range_test_min_lr", "starts at lr_range_test_min_lr and grows from it"),
    "OneCycleLR": ("max_lr", "anneals from max_lr / div_factor to max_lr and down"),
    "CyclicLR": ("max_lr", "cycles between base_lr and max_lr"),
}


def _sets_lr(scheduler_type: str, params: Mapping[str, Any]) -> bool:
    # WarmupLR warms up to the optimizer's lr unless warmup_max_lr is given; WarmupDecayLR does so
    # only when warmup_max_lr is explicitly null (its default is 0.001).
    if scheduler_type == "WarmupLR":
        return params.get("warmup_max_lr") is not None
    if scheduler_type == "WarmupDecayLR":
        return params.get("warmup_max_lr", 0.001) is not None
    return scheduler_type in _LR_SETTERS


def lr_sweep_finding(scheduler_type: str | None, params: Mapping[str, Any] | None) -> Finding | None:
    """The ``lr-swept-under-scheduler`` finding for a sweep of ``optimizer.params.lr`` under this
    ``scheduler`` section, or None when the optimizer's lr still matters. Ray Tune trials use it too
    (``raydeep.ray.tune.trial_spec``).

    >>> lr_sweep_finding("WarmupLR", {"warmup_max_lr": 3e-4}).fix
    'sweep scheduler.params.warmup_max_lr instead of optimizer.params.lr'
    >>> lr_sweep_finding("WarmupCosineLR", {"total_num_steps": 1000}) is None  # it scales the optimizer's lr
    True
    """
    params = params or {}
    if scheduler_type is None or not _sets_lr(scheduler_type, params):
        return None
    name, what = _LR_SETTERS[scheduler_type]
    key = f"scheduler.params.{name}"
    return _finding("lr-swept-under-scheduler", "warning", f"optimizer.params.lr is swept, but scheduler.type = "
                    f"{scheduler_type!r} {what}: every trial trains with the same LR",
                    "optimizer.params.lr", fix=f"sweep {key} instead of optimizer.params.lr")


# --- load-time warnings and keys without effect --------------------------------------------------
_NO_EFFECT_WORDS = ("no effect", "ignored", "wins", "not resolved")


def _load_warnings(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    """``cfg.warnings`` as findings, except the one ``accumulation-without-clipping`` reports."""
    advice = accumulation_advice(cfg)
    found = []
    for text in cfg.warnings:
        if advice is not None and text == str(advice):
            continue
        if "deprecated" in text and "no effect" not in text:
            rule = "deprecated-key"
        else:
            rule = "no-effect" if any(word in text for word in _NO_EFFECT_WORDS) else "load-warning"
        found.append(_finding(rule, "warning", text, _warning_key(text)))
    return found


_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*")


def _warning_key(text: str) -> str | None:
    """The key a load-time warning is about: its leading key, else its first dotted key."""
    tokens = _TOKEN.findall(text)
    top = set(RaydeepConfig.model_fields) | set(UNSUPPORTED)
    if tokens and tokens[0].split(".")[0] in top and text.startswith(tokens[0]):
        return tokens[0]
    return next((t for t in tokens if "." in t and t.split(".")[0] in top), None)


@dataclass(frozen=True)
class _Inert:
    """Keys that do nothing while ``when(cfg)`` holds, and why."""

    when: Callable[[RaydeepConfig], bool]
    paths: tuple[str, ...]
    why: str


_DYNAMIC_SCALER = ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis", "min_loss_scale")
_INERT = (
    _Inert(lambda c: c.zero_optimization.stage < 3,
           ("zero_optimization.prefetch_bucket_size", "zero_optimization.param_persistence_threshold",
            "zero_optimization.model_persistence_threshold", "zero_optimization.max_live_parameters",
            "zero_optimization.max_reuse_distance", "raydeep.partition_units"),
           "it configures stage 3's parameter gathering, and this config trains at ZeRO stage {stage}"),
    _Inert(lambda c: c.zero_optimization.stage == 3, ("zero_optimization.reduce_bucket_size",),
           "at stage 3 raydeep reduce-scatters each partition unit's gradients in one collective "
           "(raydeep.partition_units chooses the units)"),
    _Inert(lambda c: c.zero_optimization.stage == 0, ("zero_optimization.reduce_scatter",),
           "ZeRO stage 0 all-reduces the gradients"),
    _Inert(lambda c: c.fp16.enabled and c.fp16.loss_scale > 0, tuple(f"fp16.{k}" for k in _DYNAMIC_SCALER),
           "it tunes dynamic loss scaling, and fp16.loss_scale = {loss_scale} is a static scale"),
    _Inert(lambda c: c.fp16.enabled and c.fp16.loss_scale == 0 and c.zero_optimization.stage == 0,
           ("fp16.hysteresis", "fp16.consecutive_hysteresis"),
           "ZeRO stage 0's loss scaler has no hysteresis: every overflow halves the scale"),
    _Inert(lambda c: c.gradient_allreduce_op == "sum", ("prescale_gradients", "gradient_predivide_factor"),
           'gradient_allreduce_op is "sum": gradients are summed, never divided'),
    _Inert(lambda c: c.gradient_allreduce_op == "mean" and c.prescale_gradients, ("gradient_predivide_factor",),
           "prescale_gradients divides by the world size before the reduction instead"),
    _Inert(lambda c: c.zero_optimization.offload_optimizer is not None
           and c.zero_optimization.offload_optimizer.device == "none",
           ("zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_optimizer.ratio"),
           'zero_optimization.offload_optimizer.device is "none"'),
    _Inert(lambda c: c.zero_optimization.offload_param is not None
           and c.zero_optimization.offload_param.device == "none",
           ("zero_optimization.offload_param.pin_memory",), 'zero_optimization.offload_param.device is "none"'),
)
# Sections switched on by their own "enabled": the other keys do nothing while it is false (and
# load_config's support table skips them, so they are reported here only).
_SWITCHED = ("fp16", "bf16", "elasticity")


def _no_effect(cfg: RaydeepConfig, shape: ModelShape, cluster: Cluster) -> list[Finding]:
    """Written keys without effect in this combination that load_config does not warn about."""
    # Fields the support table already warns about (or refuses): never reported a second time.
    reported = {path for path, _ in changed_fields(cfg) if path in SUPPORT and SUPPORT[path].status != HONOURED}
    context = {"stage": cfg.zero_optimization.stage, "loss_scale": cfg.fp16.loss_scale}
    found = []
    for inert in _INERT:
        if inert.when(cfg):
            found += [_inert_finding(cfg, path, inert.why.format(**context)) for path in inert.paths
                      if path not in reported and _written(cfg, path)]
    for name in _SWITCHED:
        section = getattr(cfg, name)
        if not section.enabled:
            written = [f for f in type(section).model_fields if f != "enabled" and f in section.model_fields_set]
            found += [_inert_finding(cfg, f"{name}.{field}", f"{name}.enabled is false") for field in written]
    return found


def _written(cfg: RaydeepConfig, path: str) -> bool:
    """Whether the user wrote ``path`` (any value, the default included)."""
    *heads, name = path.split(".")
    section = cfg
    for head in heads:
        section = getattr(section, head)
        if section is None:
            return False
    return name in section.model_fields_set


def _value(cfg: RaydeepConfig, path: str) -> tuple[Any, bool]:
    """(value, whether it is the field's default)."""
    *heads, name = path.split(".")
    section = cfg
    for head in heads:
        section = getattr(section, head)
    value = getattr(section, name)
    return value, value == type(section).model_fields[name].get_default(call_default_factory=True)


def _inert_finding(cfg: RaydeepConfig, path: str, why: str) -> Finding:
    value, default = _value(cfg, path)
    key = _key(cfg, path)
    return _finding("no-effect", "info" if default else "warning", f"{key} = {value!r} has no effect: {why}", key,
                    fix=f"remove {key}" + (" (it is the default)" if default else ""))
