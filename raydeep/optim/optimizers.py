"""Optimizer resolution from a ds_config ``optimizer`` block, with DeepSpeed 0.19.8 semantics.

``resolve_optimizer(type, params)`` turns ``{"type": ..., "params": {...}}`` into an
:class:`OptimizerSpec` at config time, so that every mistake (an unknown name, an unknown
keyword, ``max_grad_norm`` in the wrong place) is reported before any worker starts.
``build_optimizer(spec, param_groups)`` then constructs the optimizer.

Name rules (DeepSpeed's ``DeepSpeedConfig`` + ``engine._configure_basic_optimizer``):

* the type is lower-cased only if the lower-cased name is one of DeepSpeed's own names
  (``adagrad, adam, adamw, lamb, lion, muadam, muadamw, musgd, muon``) or of the
  compressed-communication family ``onebitadam, zerooneadam, onebitlamb`` (DeepSpeed releases
  before 0.19.8 had them). They build ``raydeep.compression``'s optimizers (stage 0 only, as in
  DeepSpeed);
* anything else is looked up case-sensitively as ``torch.optim.<type>`` (``"SGD"`` works,
  ``"sgd"`` does not).

Example:
    >>> import torch
    >>> spec = resolve_optimizer("Adam", {"lr": 0.01})
    >>> spec.name, spec.cls.__name__, spec.adamw_mode, spec.kwargs
    ('adam', 'AdamW', True, {'lr': 0.01, 'weight_decay': 0.0})
    >>> opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(3))])
    >>> type(opt).__name__
    'AdamW'
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from raydeep.errors import ConfigError

__all__ = [
    "DEEPSPEED_OPTIMIZERS",
    "ONEBIT_OPTIMIZERS",
    "ZERO_TESTED_OPTIMIZERS",
    "Lamb",
    "Lion",
    "OptimizerSpec",
    "build_optimizer",
    "needs_untested_flag",
    "resolve_compressed_optimizer",
    "resolve_optimizer",
]

# DeepSpeed 0.19.8 `runtime/config.py::DEEPSPEED_OPTIMIZERS`: the names it lower-cases.
DEEPSPEED_OPTIMIZERS: tuple[str, ...] = (
    "adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon",
)
# DeepSpeed names raydeep does not implement (mup's optimizers, DeepSpeed's Muon).
_UNSUPPORTED_DEEPSPEED = frozenset({"muadam", "muadamw", "musgd", "muon"})

# Documented defaults of the compressed-communication optimizers (older DeepSpeed releases).
# ``comm_backend_name`` None: the process group's own backend (DeepSpeed's default was "nccl").
_ONEBIT_COMMON: dict[str, Any] = {
    "lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
    "eps_inside_sqrt": False, "weight_decay": 0.0, "amsgrad": False,
    "cuda_aware": False, "comm_backend_name": None,
}
ONEBIT_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "onebitadam": {**_ONEBIT_COMMON, "freeze_step": 100000},
    "zerooneadam": {
        **_ONEBIT_COMMON, "var_freeze_step": 100000, "var_update_scaler": 16,
        "local_step_scaler": 32678, "local_step_clipper": 16,
    },
    "onebitlamb": {
        **_ONEBIT_COMMON, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01,
        "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1,
    },
}
_COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")

# Canonical spellings offered in did-you-mean suggestions and fixes.
_DISPLAY_NAMES: dict[str, str] = {
    "adagrad": "Adagrad", "adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "lion": "Lion",
    "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb",
}

# Names whose optimizer needs no `zero_allow_untested_optimizer` under ZeRO. DeepSpeed's rule
# (`zero/utils.py::ZERO_SUPPORTED_OPTIMIZERS`) lists torch Adam/AdamW/Adagrad, FusedAdam,
# the CPU Adam/Adagrad/Lion and FusedLion; FusedLamb is *not* listed, so "Lamb" needs the flag.
ZERO_TESTED_OPTIMIZERS: frozenset[str] = frozenset({"adam", "adamw", "adagrad", "lion"})

_MAX_GRAD_NORM_MESSAGE = (
    "'max_grad_norm' is not supported as an optimizer parameter, please switch to using the "
    "deepspeed parameter 'gradient_clipping' see: "
    "https://www.deepspeed.ai/docs/config-json/#gradient-clipping for more details"
)


@dataclass(frozen=True)
class OptimizerSpec:
    """A resolved ``optimizer`` block: what to build and with which keyword arguments.

    ``adamw_mode`` is set only for Adam/AdamW (DeepSpeed's effective mode).

    Example:
        >>> spec = resolve_optimizer("SGD", {"lr": 0.1, "momentum": 0.9})
        >>> spec.name, spec.cls.__name__, spec.kwargs["momentum"], spec.adamw_mode
        ('SGD', 'SGD', 0.9, None)
    """

    name: str
    cls: type[torch.optim.Optimizer] | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    adamw_mode: bool | None = None


class Lamb(torch.optim.Optimizer):
    """LAMB with the semantics and defaults of DeepSpeed's ``FusedLamb`` (per-tensor trust ratio).

    Per parameter: ``m, v`` are Adam moments *without* bias correction; ``update = m / denom
    + weight_decay * w`` with ``denom = sqrt(v) + eps`` (or ``sqrt(v + eps)`` with
    ``eps_inside_sqrt``); ``coeff = clamp(||w|| / ||update||, min_coeff, max_coeff)``, or 1 when
    either norm is 0; ``w -= step_size * coeff * update`` where bias correction, if on, is
    folded into ``step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` -- so the trust ratio
    is measured on the uncorrected update, exactly as the DeepSpeed kernel does.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
        >>> opt = Lamb([w], lr=0.1)
        >>> w.grad = torch.tensor([1.0, 1.0])
        >>> opt.step()
        >>> [round(x, 4) for x in w.tolist()]
        [2.8882, 3.8882]
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01) -> None:
        _check_hyper(lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one LAMB update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        # at least fp32 math for low-precision params: the trust ratio needs the precision
        dtype = torch.promote_types(p.dtype, torch.float32)
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad.to(dtype)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        w = p.detach().to(dtype)
        update = m / denom
        if group["weight_decay"] != 0:
            update.add_(w, alpha=group["weight_decay"])
        w_norm, u_norm = w.norm(), update.norm()
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        coeff = torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
        step_size = group["lr"]
        if group["bias_correction"]:
            t = state["step"]
            step_size *= math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
        state["lamb_coeff"] = coeff
        p.copy_(w - step_size * coeff * update)

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios used by the last step, one per parameter (as ``FusedLamb`` reports)."""
        return [float(s["lamb_coeff"]) for s in self.state.values() if "lamb_coeff" in s]


class Lion(torch.optim.Optimizer):
    """Lion (sign momentum, decoupled weight decay), with DeepSpeed ``FusedLion`` defaults.

    ``c = beta1 * m + (1 - beta1) * g``; ``w = w * (1 - lr * wd) - lr * sign(c)``;
    ``m = beta2 * m + (1 - beta2) * g``. Defaults are DeepSpeed's (lr 1e-3, betas
    (0.9, 0.999)), so a config that omits them behaves as under DeepSpeed.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.0]))
        >>> opt = Lion([w], lr=0.1)
        >>> w.grad = torch.tensor([2.0, -3.0, 0.0])
        >>> opt.step()
        >>> [round(x, 4) for x in w.tolist()]
        [0.9, -0.9, 0.0]
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0) -> None:
        _check_hyper(lr=lr, eps=0.0, weight_decay=weight_decay, betas=betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one Lion update to every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m, g = state["exp_avg"], p.grad
                direction = (m * beta1).add_(g, alpha=1.0 - beta1).sign_()
                if wd != 0:
                    p.mul_(1.0 - lr * wd)
                p.add_(direction, alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1.0 - beta2)
        return loss


def _check_hyper(*, lr: float, eps: float, weight_decay: float, betas: Any) -> None:
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")


def _suggest(word: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'X'?`` (case-insensitive closest match), or an empty string."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[match[0]]!r}?" if match else ""


def _torch_optimizer_names() -> list[str]:
    names = []
    for attr in dir(torch.optim):
        obj = getattr(torch.optim, attr)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
            if obj is not torch.optim.Optimizer and attr.lower() not in DEEPSPEED_OPTIMIZERS:
                names.append(attr)
    return sorted(names)


def _unknown_name(type_name: str) -> ConfigError:
    valid = list(_DISPLAY_NAMES.values()) + _torch_optimizer_names()
    return ConfigError(
        "optimizer.type",
        f"{type_name} is not a supported DeepSpeed Optimizer{_suggest(type_name, valid)}",
        value=type_name,
        fix="use one of " + ", ".join(_DISPLAY_NAMES.values())
        + " (any case) or a torch.optim class spelled exactly, e.g. SGD, RMSprop",
    )


def _accepted_keywords(cls: type) -> set[str] | None:
    """Constructor keywords of ``cls`` (``None`` if it takes ``**kwargs``)."""
    sig = inspect.signature(cls.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {n for n in sig.parameters if n not in ("self", "params", "model_params")}


def _validate_keys(display: str, params: Mapping[str, Any], allowed: set[str] | None) -> None:
    if allowed is None:
        return
    for key in params:
        if key not in allowed:
            raise ConfigError(
                f"optimizer.params.{key}",
                f"{display} has no parameter {key!r}{_suggest(key, allowed)}",
                value=params[key],
                fix=f"remove or rename it; {display} accepts: " + ", ".join(sorted(allowed)),
            )


def _normalise(params: dict[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; torch and DeepSpeed both document `betas` as a tuple.
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return params


def _reject_amsgrad(display: str, params: dict[str, Any], fix: str) -> None:
    if params.pop("amsgrad", False):
        raise ConfigError("optimizer.params.amsgrad", f"{display} does not support the AMSGrad variant",
                          value=True, fix=fix)


def _resolve_adam(name: str, params: dict[str, Any]) -> OptimizerSpec:
    torch_adam = bool(params.pop("torch_adam", False))
    adam_w_mode = params.pop("adam_w_mode", True)
    params.pop("fp32_optimizer_states", None)  # consumed by DeepSpeed's CPU Adam only
    adamw = name == "adamw" or bool(adam_w_mode)  # DeepSpeed: type == adamw or adam_w_mode
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    if not torch_adam:
        # DeepSpeed builds FusedAdam / DeepSpeedCPUAdam here: accept their extra keywords,
        # reject what they reject, and use their weight_decay default (0, not AdamW's 0.01).
        if not params.pop("bias_correction", True):
            raise ConfigError("optimizer.params.bias_correction", "raydeep's Adam always applies "
                              "bias correction", value=False, fix="remove the key")
        params.pop("set_grad_none", None)
        _reject_amsgrad("FusedAdam", params, fix='set "torch_adam": true to use torch Adam with amsgrad')
        params.setdefault("weight_decay", 0.0)
    _validate_keys(_DISPLAY_NAMES[name], params, _accepted_keywords(cls))
    return OptimizerSpec(name, cls, _normalise(params), adamw)


def _resolve_onebit(name: str, params: dict[str, Any]) -> OptimizerSpec:
    defaults = ONEBIT_OPTIMIZERS[name]
    display = _DISPLAY_NAMES[name]
    _validate_keys(display, params, set(defaults))
    if params.get("amsgrad"):
        raise ConfigError("optimizer.params.amsgrad", f"{display} does not support the AMSGrad variant",
                          value=params["amsgrad"], fix="remove the key or set it to false")
    backend = params.get("comm_backend_name", defaults["comm_backend_name"])
    if backend is not None and backend not in _COMM_BACKENDS:
        raise ConfigError("optimizer.params.comm_backend_name", f"unknown backend for {display}",
                          value=backend, fix="use one of " + ", ".join(_COMM_BACKENDS))
    return OptimizerSpec(name, _compressed_class(name), _normalise({**defaults, **params}))


def _compressed_class(name: str) -> type:
    from raydeep.compression import OnebitAdam, OnebitLamb, ZeroOneAdam

    return {"onebitadam": OnebitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OnebitLamb}[name]


def _resolve_class(type_name: str) -> tuple[str, type | None]:
    """Canonical name and class for ``type_name`` (class ``None``: resolved by a helper)."""
    lowered = type_name.lower()
    if lowered in _UNSUPPORTED_DEEPSPEED:
        raise ConfigError("optimizer.type",
                          f"{type_name} is a DeepSpeed optimizer not supported by raydeep",
                          value=type_name, fix="use Adam, AdamW, Lamb, Lion, Adagrad or a torch.optim class")
    if lowered in DEEPSPEED_OPTIMIZERS or lowered in ONEBIT_OPTIMIZERS:
        cls = {"adagrad": torch.optim.Adagrad, "lamb": Lamb, "lion": Lion}.get(lowered)
        return lowered, cls
    obj = getattr(torch.optim, type_name, None)
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)) or obj is torch.optim.Optimizer:
        raise _unknown_name(type_name)
    return type_name, obj


def resolve_optimizer(type_name: str, params: Mapping[str, Any] | None = None) -> OptimizerSpec:
    """Resolve a ds_config ``optimizer`` block the way DeepSpeed 0.19.8 does, failing early.

    DeepSpeed-only keys (``torch_adam``, ``adam_w_mode``, ``fp32_optimizer_states``, and for
    the fused Adam path ``bias_correction``/``set_grad_none``) are consumed; every other key must
    be a constructor keyword of the chosen class. Errors are :class:`~raydeep.errors.ConfigError`
    (a ``ValueError``) naming the key, the optimizer and a fix.

    Example:
        >>> resolve_optimizer("Adam", {"adam_w_mode": False}).cls.__name__
        'Adam'
        >>> resolve_optimizer("sgd", {})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        raydeep.errors.ConfigError: ... sgd is not a supported DeepSpeed Optimizer; did you mean 'SGD'?...
    """
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError("optimizer.type", "must be a non-empty string", value=type_name,
                          fix='set it to an optimizer name such as "AdamW"')
    name, cls = _resolve_class(type_name)
    params = dict(params or {})
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm", _MAX_GRAD_NORM_MESSAGE,
                          value=params["max_grad_norm"],
                          fix='remove it and set "gradient_clipping" at the top level of the config')
    if name in ONEBIT_OPTIMIZERS:
        return _resolve_onebit(name, params)
    if name in ("adam", "adamw"):
        return _resolve_adam(name, params)
    if name in ("adagrad", "lion"):
        params.pop("fp32_optimizer_states", None)  # DeepSpeed's CPU Adagrad/Lion take it
    if name == "lion":
        params.pop("set_grad_none", None)  # a FusedLion keyword that only affects zero_grad
    if name == "lamb":
        _reject_amsgrad("Lamb", params, fix="remove the key or set it to false")
    _validate_keys(_DISPLAY_NAMES.get(name, f"torch.optim.{name}"), params, _accepted_keywords(cls))
    return OptimizerSpec(name, cls, _normalise(params))


def resolve_compressed_optimizer(type_name: str, params: Mapping[str, Any] | None = None) -> OptimizerSpec:
    """Validate a compressed-communication optimizer block (1-bit Adam, 0/1 Adam, 1-bit LAMB) against
    its documented keywords and defaults, for the runtime that will build it.

    Example:
        >>> spec = resolve_compressed_optimizer("OneBitAdam", {"freeze_step": 400})
        >>> spec.name, spec.cls.__name__, spec.kwargs["freeze_step"], spec.kwargs["comm_backend_name"]
        ('onebitadam', 'OnebitAdam', 400, None)
    """
    name = type_name.lower() if isinstance(type_name, str) else type_name
    if name not in ONEBIT_OPTIMIZERS:
        raise ConfigError("optimizer.type", "is not a compressed-communication optimizer", value=type_name,
                          fix="use one of " + ", ".join(_DISPLAY_NAMES[n] for n in ONEBIT_OPTIMIZERS))
    return _resolve_onebit(name, dict(params or {}))


def needs_untested_flag(spec: OptimizerSpec) -> bool:
    """Whether ZeRO needs ``"zero_allow_untested_optimizer": true`` for this optimizer.

    DeepSpeed's rule: Adam/AdamW (fused, CPU or torch), Adagrad and Lion are tested; Lamb
    (FusedLamb) and every other ``torch.optim`` class are not. The compressed-communication
    family is incompatible with ZeRO in DeepSpeed, so the flag never applies to it.

    Example:
        >>> needs_untested_flag(resolve_optimizer("AdamW", {}))
        False
        >>> needs_untested_flag(resolve_optimizer("SGD", {"lr": 0.1}))
        True
    """
    if spec.name in ONEBIT_OPTIMIZERS:
        return False
    return spec.name not in ZERO_TESTED_OPTIMIZERS


def build_optimizer(spec: OptimizerSpec, param_groups: Iterable[Any],
                    prefer_fused: bool = False) -> torch.optim.Optimizer:
    """Construct the optimizer of ``spec`` over ``param_groups`` (tensors or group dicts).

    With ``prefer_fused=True`` and neither ``fused`` nor ``foreach`` given in the config, torch's
    single-kernel ``fused=True`` implementation is used when the class and the parameters'
    devices/dtypes support it (Adam, AdamW, Adagrad, SGD on CPU and CUDA in torch >= 2.4),
    otherwise the multi-tensor ``foreach=True`` path where the class has it.

    Example:
        >>> import torch
        >>> spec = resolve_optimizer("AdamW", {})
        >>> opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))], prefer_fused=True)
        >>> opt.defaults["fused"]
        True
    """
    if spec.cls is None:
        raise NotImplementedError(f"{spec.name} is not built in raydeep")
    # torch writes defaults into group dicts, so each attempt gets fresh copies.
    groups = list(param_groups)
    fresh = lambda: [dict(g) if isinstance(g, Mapping) else g for g in groups]  # noqa: E731
    kwargs = dict(spec.kwargs)
    if prefer_fused and not ({"fused", "foreach"} & kwargs.keys()):
        accepted = _accepted_keywords(spec.cls) or set()
        if "fused" in accepted:
            try:
                return spec.cls(fresh(), **kwargs, fused=True)
            except (RuntimeError, ValueError):
                pass  # unsupported device or dtype, or an option fused mode excludes
        if "foreach" in accepted:
            kwargs["foreach"] = True
    return spec.cls(fresh(), **kwargs)
