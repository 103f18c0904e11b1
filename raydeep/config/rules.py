"""Cross-field rules: combinations DeepSpeed refuses, settings raydeep does not implement or that
have no effect in raydeep (from the table in ``support.py``), and the field report's advice.

Each rule appends to ``errors`` (ConfigError) or ``warnings`` (str); ``check_rules`` runs them all
so a user sees every problem at once.
"""
from __future__ import annotations

from dataclasses import dataclass

from raydeep.config.model import RaydeepConfig
from raydeep.config.support import check_support
from raydeep.errors import ConfigError, ConfigErrors, dotted_key, key_part


def check_rules(cfg: RaydeepConfig, errors: list[ConfigError], warnings: list[str]) -> None:
    """Run every cross-field rule on a validated config, the per-field support table first."""
    check_support(cfg, errors, warnings, cfg._written)
    for rule in (_precision_rules, _zero_rules, _zero_plus_plus_rules, _offload_rules, _reduction_rules,
                 _activation_checkpointing_rules, _optimizer_rules, _scheduler_rules, _advice):
        rule(cfg, errors, warnings)


def _precision_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    fp16, stage = cfg.fp16, cfg.zero_optimization.stage
    if fp16.enabled and cfg.bf16.enabled:
        errors.append(ConfigError("fp16.enabled", "bfloat16 and fp16 modes cannot be simultaneously enabled",
                                  value=True, fix="enable only one of fp16 and bf16"))
    if fp16.enabled and fp16.loss_scale == 0:
        for key in ("loss_scale_window", "min_loss_scale"):
            if getattr(fp16, key) <= 0:
                errors.append(ConfigError(f"fp16.{key}", f"fp16.{key} must be > 0 when dynamic loss scaling is "
                                          "enabled (loss_scale=0)", value=getattr(fp16, key), fix=f"set fp16.{key} to a positive integer"))
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and param_dtype != cfg.precision:
        errors.append(ConfigError("data_types.param_dtype", f"must match the enabled precision ({cfg.precision})",
                                  value=param_dtype, fix=f"set it to {cfg.precision!r} or remove it"))
    if stage == 0 and cfg.grad_accum_dtype != cfg.precision:
        errors.append(ConfigError("data_types.grad_accum_dtype", f"unsupported mix of model_dtype={cfg.precision} and "
                                  f"grad_accum_dtype={cfg.grad_accum_dtype} without ZeRO (as DeepSpeed 0.19.8)",
                                  value=cfg.grad_accum_dtype, fix="enable ZeRO stage >= 1 or remove grad_accum_dtype"))


def _zero_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    zero = cfg.zero_optimization
    if zero.allgather_bucket_size % 2:
        errors.append(ConfigError("zero_optimization.allgather_bucket_size", "allgather_bucket_size must be a multiple "
                                  "of nccl_start_alignment_factor", value=zero.allgather_bucket_size, fix="use an even number"))
    if not zero.compute_grad_norm and zero.stage not in (1, 2):
        errors.append(ConfigError("zero_optimization.compute_grad_norm", "compute_grad_norm=false is supported only "
                                  "with ZeRO Stage 1 or 2", value=False, fix="remove it or use stage 1/2"))


_ZERO_PP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                 "zero_quantized_gradients")


def _zero_plus_plus_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    zero = cfg.zero_optimization
    on = [k for k in _ZERO_PP_KEYS if (getattr(zero, k) > 1 if k == "zero_hpz_partition_size" else getattr(zero, k))]
    if on and zero.stage != 3:
        warnings.append(f"zero_optimization.{on[0]} has no effect at ZeRO stage {zero.stage}: ZeRO++ (hpZ, qwZ, qgZ) "
                        "changes stage 3's parameter all-gathers and gradient reduce-scatter, as in DeepSpeed")
    hpz = zero.zero_hpz_partition_size
    if zero.stage == 3 and hpz > 1 and cfg.world_size > 1:
        if hpz >= cfg.world_size:
            # DeepSpeed asserts; a config written for 16-GPU nodes (its tutorial's) still runs on fewer ranks
            warnings.append(f"zero_optimization.zero_hpz_partition_size = {hpz} is not below the world size "
                            f"{cfg.world_size}: every rank would hold the same secondary partition as its primary "
                            "one, so hpZ is off; set it to the ranks per node")
        elif cfg.world_size % hpz:
            errors.append(ConfigError("zero_optimization.zero_hpz_partition_size", "must divide the world size "
                                      f"{cfg.world_size}", value=hpz, fix="set it to the ranks per node"))


def _offload_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    # The devices themselves are refused by the support table; DeepSpeed's own rule still applies.
    zero = cfg.zero_optimization
    opt = zero.offload_optimizer
    if opt is not None and opt.ratio < 1.0 and zero.stage != 3:
        errors.append(ConfigError("zero_optimization.offload_optimizer.ratio", "Partial offloading only supported for "
                                  "ZeRO Stage 3.", value=opt.ratio, fix="use stage 3 or remove ratio"))
    if opt is not None and opt.device != "none" and zero.stage == 0:
        warnings.append("zero_optimization.offload_optimizer has no effect at ZeRO stage 0 (DeepSpeed offloads "
                        "from stage 1 on): use stage 1-3 to keep the optimizer states in host memory")
    delayed = cfg.raydeep.delayed_update or (zero.zenflow is not None and zero.zenflow.overlap_step)
    key = "raydeep.delayed_update" if cfg.raydeep.delayed_update else "zero_optimization.zenflow.overlap_step"
    if delayed and (opt is None or opt.device == "none" or zero.stage == 0):
        errors.append(ConfigError(key, "the delayed parameter update runs the offloaded optimizer step while the "
                                  "next forward and backward run; without optimizer offload there is none to delay",
                                  value=True, fix='set zero_optimization.offload_optimizer.device to "cpu" at stage 1-3, '
                                  "or remove it"))
    elif delayed and opt.ratio < 1.0:
        errors.append(ConfigError(key, "the delayed update needs every sub-group's masters on the host",
                                  value=True, fix="remove offload_optimizer.ratio or the delayed update"))
    param = zero.offload_param
    if param is not None and param.device != "none" and zero.stage != 3:
        warnings.append(f"zero_optimization.offload_param has no effect at ZeRO stage {zero.stage} (parameters are "
                        "offloaded at stage 3 only, as in DeepSpeed)")


def _reduction_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    zero = cfg.zero_optimization
    if cfg.gradient_allreduce_op == "sum" and zero.stage == 3:
        errors.append(ConfigError("gradient_allreduce_op", '"sum" is not supported with ZeRO stage 3', value="sum",
                                  fix='use "mean" (the default)'))
    rs = zero.stage >= 2 and zero.reduce_scatter
    if rs and cfg.prescale_gradients:
        errors.append(ConfigError("prescale_gradients", "ZeRO stage 2/3 with reduce_scatter requires post-scaling "
                                  "(prescale_gradients false)", value=True, fix="remove prescale_gradients"))
    if rs and cfg.gradient_predivide_factor != 1.0:
        errors.append(ConfigError("gradient_predivide_factor", "must be 1.0 with ZeRO stage 2/3 reduce_scatter",
                                  value=cfg.gradient_predivide_factor, fix="remove gradient_predivide_factor"))


def _activation_checkpointing_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    ac = cfg.activation_checkpointing
    if ac is None:
        return
    if ac.contiguous_memory_optimization and not ac.partition_activations:
        errors.append(ConfigError("activation_checkpointing.contiguous_memory_optimization", "Contiguous "
                                  "Checkpointing is only available with partitioned activations", value=True,
                                  fix="set activation_checkpointing.partition_activations to true, or remove this key"))
    modules = cfg.raydeep.checkpoint_modules
    if ac.number_checkpoints is not None and modules != "block" and not ac.contiguous_memory_optimization:
        warnings.append(f"activation_checkpointing.number_checkpoints = {ac.number_checkpoints} has no effect: it "
                        f"chooses how many blocks are checkpointed with raydeep.checkpoint_modules \"block\" "
                        f"(this config: {modules!r}) and sizes the contiguous_memory_optimization buffers (off)")
    if ac.contiguous_memory_optimization and ac.number_checkpoints is None:
        errors.append(ConfigError("activation_checkpointing.number_checkpoints", "Must specify the number of layers "
                                  "with contiguous memory checkpointing", value=None,
                                  fix="set number_checkpoints to the number of checkpointed layers"))


def _optimizer_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    if cfg.optimizer is None:
        return
    from raydeep.optim.optimizers import ONEBIT_OPTIMIZERS, needs_untested_flag, resolve_optimizer

    try:
        spec = resolve_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params))
    except ValueError as exc:
        errors.append(_as_config_error(exc, "optimizer.type", cfg.optimizer.type))
        return
    if spec.name in ONEBIT_OPTIMIZERS:
        _compressed_optimizer_rules(cfg, spec, errors, warnings)
    lr = cfg.optimizer.params.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr <= 0:
        errors.append(ConfigError("optimizer.params.lr", "must be a positive learning rate", value=lr,
                                  fix="set a learning rate > 0, e.g. 3e-4"))
    if cfg.zero_optimization.stage >= 1 and needs_untested_flag(spec) and not cfg.zero_allow_untested_optimizer:
        errors.append(ConfigError("zero_allow_untested_optimizer", "You are using an untested ZeRO Optimizer. Please "
                                  'add <"zero_allow_untested_optimizer": true> in the configuration file to use it.',
                                  value=False, fix="set zero_allow_untested_optimizer to true"))


def _compressed_optimizer_rules(cfg: RaydeepConfig, spec, errors: list, warnings: list) -> None:
    """DeepSpeed's rules for 1-bit Adam, 0/1 Adam and 1-bit LAMB, and what raydeep substitutes."""
    display = {"onebitadam": "1bit-Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit Lamb"}[spec.name]
    if cfg.zero_optimization.stage >= 1:
        errors.append(ConfigError("zero_optimization.stage", f"{display} is not compatible with ZeRO: it averages "
                                  "full momentum (or gradient) tensors itself, which ZeRO shards",
                                  value=cfg.zero_optimization.stage, fix="set zero_optimization.stage to 0"))
    if cfg.precision != "fp16":
        warnings.append(f"Currently the convergence of {display} is only verified under FP16 (this config trains in "
                        f"{cfg.precision})")
    backend = spec.kwargs.get("comm_backend_name")
    if backend is not None and backend != "nccl":
        warnings.append(f"optimizer.params.comm_backend_name {backend!r}: raydeep runs the compressed all-reduce over "
                        "the process group's own backend (NCCL on GPUs, gloo on CPUs) with torch.distributed")
    if spec.kwargs.get("cuda_aware"):
        warnings.append("optimizer.params.cuda_aware has no effect: it configured DeepSpeed's MPI backend, which "
                        "raydeep does not use")
    if spec.name == "zerooneadam" and spec.kwargs.get("var_update_scaler", 16) < 2:
        warnings.append(f"optimizer.params.var_update_scaler = {spec.kwargs['var_update_scaler']}: the variance is "
                        "then refreshed only at steps 2, 4, 8, ..., so step 3 already averages the gradient "
                        "compressed over a variance from ONE gradient; every element whose gradient was zero there "
                        "(the embedding rows of tokens absent from that batch) has a variance of 0, receives +-scale "
                        "from the 1-bit average and moves by lr*m/eps, and training diverges. DeepSpeed's 0/1 Adam "
                        "does the same. Use 2 or more (default 16)")


def _scheduler_rules(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    if cfg.scheduler is None:
        return
    import inspect

    from raydeep.config.keys import suggest
    from raydeep.optim import schedulers

    name, params = cfg.scheduler.type, cfg.scheduler.params
    try:
        # The scheduler factory's own lookup, so a name passes here exactly when it builds later
        # (torch's module also exports non-schedulers such as Optimizer and LRScheduler itself).
        cls = schedulers.resolve_scheduler_class(name)
    except ValueError:
        errors.append(_unknown_scheduler(name))
        return
    for key in schedulers.required_params(name):
        if key not in params:
            errors.append(ConfigError(f"scheduler.params.{key}", f"is required by {name}", fix=f"add scheduler.params.{key}"))
    accepted = [p for p in inspect.signature(cls).parameters if p != "optimizer"]
    for key in params:
        if key not in accepted:
            guess = suggest(key, accepted)
            errors.append(ConfigError(f"scheduler.params.{key_part(key)}", f"unknown parameter of {name}",
                                      fix=f"did you mean {guess!r}?" if guess else f"valid parameters: {', '.join(accepted)}"))


def _unknown_scheduler(name: str) -> ConfigError:
    import torch.optim.lr_scheduler as torch_schedulers

    from raydeep.config.keys import suggest
    from raydeep.optim.schedulers import SCHEDULER_NAMES

    valid = f"use one of {list(SCHEDULER_NAMES)} or a torch.optim.lr_scheduler scheduler class such as StepLR"
    if isinstance(getattr(torch_schedulers, name, None), type):
        # An exact name of a base class or helper (LRScheduler, Optimizer, Counter): a look-alike
        # guess would only mislead, so say what it is instead.
        return ConfigError("scheduler.type", f"torch.optim.lr_scheduler.{name} is not a learning-rate scheduler "
                           "(it is a base class or helper)", value=name, fix=valid)
    guess = suggest(name, _scheduler_names())
    return ConfigError("scheduler.type", f"DeepSpeed does not recognize LR scheduler {name}", value=name,
                       fix=f"did you mean {guess!r}?" if guess else valid)


def _scheduler_names() -> list[str]:
    """Every name ``scheduler.type`` accepts: DeepSpeed's schedulers, then torch's scheduler classes."""
    import torch.optim.lr_scheduler as torch_schedulers

    from raydeep.optim.schedulers import SCHEDULER_NAMES, resolve_scheduler_class

    names = list(SCHEDULER_NAMES)
    for candidate in sorted(vars(torch_schedulers)):
        try:
            resolve_scheduler_class(candidate)
        except ValueError:
            continue
        if candidate not in names:
            names.append(candidate)
    return names


# The field report's threshold: accumulating over more micro-batches than this needs clipping.
ACCUMULATION_CLIP_STEPS = 32


@dataclass(frozen=True)
class Advice:
    """A piece of the field report's advice, in the parts ``raydeep doctor`` reports separately;
    ``str()`` is the load-time warning, so both say the same thing from one text."""

    message: str
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}: {self.reason}; {self.fix}"


def accumulation_advice(cfg: RaydeepConfig) -> Advice | None:
    """The advice for gradient accumulation without clipping, or None when it does not apply.

    Shared by the load-time warning below and the doctor's ``accumulation-without-clipping`` rule.
    """
    gas = cfg.gradient_accumulation_steps
    if gas is None or gas <= ACCUMULATION_CLIP_STEPS or cfg.gradient_clipping != 0:
        return None
    return Advice(f"gradient_accumulation_steps is {gas} with gradient clipping off",
                  f"above {ACCUMULATION_CLIP_STEPS} accumulation steps gradients can explode",
                  "set gradient_clipping (e.g. 1.0)")


def _advice(cfg: RaydeepConfig, errors: list, warnings: list) -> None:
    advice = accumulation_advice(cfg)
    if advice is not None:
        warnings.append(str(advice))


def _as_config_error(exc: ValueError, default_key: str, value) -> ConfigError:
    if isinstance(exc, ConfigError):
        # An empty parameter name leaves a trailing "." ("optimizer.params."): make it visible.
        if exc.key != dotted_key(exc.key) and not isinstance(exc, ConfigErrors):
            shown = {} if exc.value is None else {"value": exc.value}
            return ConfigError(dotted_key(exc.key), exc.message, fix=exc.fix, **shown)
        return exc
    key = getattr(exc, "key", None) or default_key
    return ConfigError(dotted_key(key), str(exc), value=value)
