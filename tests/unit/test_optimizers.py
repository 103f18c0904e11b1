"""Optimizer resolution (DeepSpeed 0.19.8 name rules), validation, Lamb/Lion numerics, fused build."""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch

from raydeep.optim.optimizers import (
    ONEBIT_OPTIMIZERS,
    Lamb,
    Lion,
    OptimizerSpec,
    build_optimizer,
    needs_untested_flag,
    resolve_compressed_optimizer,
    resolve_optimizer,
)
from raydeep.errors import ConfigError


# --------------------------------------------------------------------------- name resolution
@pytest.mark.parametrize(
    "type_name, params, name, cls, adamw_mode",
    [
        ("Adam", {}, "adam", torch.optim.AdamW, True),  # "Adam" is AdamW unless adam_w_mode=false
        ("adam", {"adam_w_mode": False}, "adam", torch.optim.Adam, False),
        ("ADAM", {"adam_w_mode": True}, "adam", torch.optim.AdamW, True),
        ("AdamW", {}, "adamw", torch.optim.AdamW, True),
        ("AdamW", {"adam_w_mode": False}, "adamw", torch.optim.AdamW, True),  # type adamw wins
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, "adam", torch.optim.Adam, False),
        ("Adagrad", {}, "adagrad", torch.optim.Adagrad, None),
        ("ADAGRAD", {"lr": 0.1}, "adagrad", torch.optim.Adagrad, None),
        ("Lamb", {}, "lamb", Lamb, None),
        ("LION", {}, "lion", Lion, None),
        ("SGD", {"lr": 0.1}, "SGD", torch.optim.SGD, None),
        ("RMSprop", {"alpha": 0.9}, "RMSprop", torch.optim.RMSprop, None),
        ("Adamax", {}, "Adamax", torch.optim.Adamax, None),
    ],
)
def test_resolution_table(type_name, params, name, cls, adamw_mode):
    spec = resolve_optimizer(type_name, params)
    assert (spec.name, spec.cls, spec.adamw_mode) == (name, cls, adamw_mode)


@pytest.mark.parametrize(
    "type_name, suggestion",
    [("sgd", "SGD"), ("rmsprop", "RMSprop"), ("Adamm", "Adam"), ("Lambb", "Lamb"), ("adamx", "Adamax")],
)
def test_unknown_names_use_deepspeed_wording_and_suggest(type_name, suggestion):
    with pytest.raises(ValueError) as err:
        resolve_optimizer(type_name, {})
    text = str(err.value)
    assert f"{type_name} is not a supported DeepSpeed Optimizer" in text
    assert f"did you mean {suggestion!r}" in text
    assert "Fix:" in text


@pytest.mark.parametrize("type_name", ["Optimizer", "lr_scheduler", "NoSuchThing"])
def test_non_optimizer_torch_attributes_are_rejected(type_name):
    with pytest.raises(ValueError, match="is not a supported DeepSpeed Optimizer"):
        resolve_optimizer(type_name, {})


@pytest.mark.parametrize("type_name", ["MuAdam", "muadamw", "MuSGD", "Muon"])
def test_deepspeed_names_raydeep_does_not_implement(type_name):
    # "Muon" is also torch.optim.Muon, but DeepSpeed lower-cases it to its own "muon" first.
    with pytest.raises(ValueError, match="is a DeepSpeed optimizer not supported by raydeep"):
        resolve_optimizer(type_name, {})


@pytest.mark.parametrize("type_name", ["", None, 3])
def test_type_must_be_a_name(type_name):
    with pytest.raises(ValueError, match="optimizer.type"):
        resolve_optimizer(type_name, {})


# --------------------------------------------------------------------------- Adam specifics
def test_adam_strips_deepspeed_keys_and_uses_fused_adam_defaults():
    params = {"lr": 3e-4, "betas": [0.8, 0.99], "torch_adam": False, "adam_w_mode": True,
              "fp32_optimizer_states": True, "bias_correction": True, "set_grad_none": True}
    spec = resolve_optimizer("AdamW", params)
    # FusedAdam's weight_decay default is 0 (torch AdamW's would be 0.01); betas become a tuple
    assert spec.kwargs == {"lr": 3e-4, "betas": (0.8, 0.99), "weight_decay": 0.0}
    assert params["torch_adam"] is False and "fp32_optimizer_states" in params  # input untouched


def test_torch_adam_keeps_torch_defaults_and_passes_foreach():
    spec = resolve_optimizer("AdamW", {"torch_adam": True, "foreach": False})
    assert spec.kwargs == {"foreach": False}
    opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(2))])
    assert opt.defaults["weight_decay"] == 0.01 and opt.defaults["foreach"] is False


def test_adam_amsgrad_needs_torch_adam_and_bias_correction_must_stay_on():
    with pytest.raises(ValueError, match="AMSGrad"):
        resolve_optimizer("Adam", {"amsgrad": True})
    assert resolve_optimizer("Adam", {"amsgrad": True, "torch_adam": True}).kwargs["amsgrad"] is True
    with pytest.raises(ValueError, match="bias_correction"):
        resolve_optimizer("Adam", {"bias_correction": False})


# --------------------------------------------------------------------------- kwargs validation
def test_max_grad_norm_is_rejected_with_deepspeed_message():
    with pytest.raises(ValueError) as err:
        resolve_optimizer("Adam", {"lr": 1e-3, "max_grad_norm": 1.0})
    text = str(err.value)
    assert ("'max_grad_norm' is not supported as an optimizer parameter, please switch to using the "
            "deepspeed parameter 'gradient_clipping'") in text
    assert '"gradient_clipping" at the top level' in text


@pytest.mark.parametrize(
    "type_name, params, key, optimizer, suggestion",
    [
        ("SGD", {"lr": 0.1, "momentun": 0.9}, "momentun", "torch.optim.SGD", "momentum"),
        ("Adam", {"weight_decy": 0.1}, "weight_decy", "Adam", "weight_decay"),
        ("Lamb", {"max_coef": 5.0}, "max_coef", "Lamb", "max_coeff"),
        ("Lion", {"beta": (0.9, 0.99)}, "beta", "Lion", "betas"),
        ("Adagrad", {"lr_decy": 0.1}, "lr_decy", "Adagrad", "lr_decay"),
    ],
)
def test_unknown_keyword_names_key_optimizer_and_suggestion(type_name, params, key, optimizer, suggestion):
    with pytest.raises(ValueError) as err:
        resolve_optimizer(type_name, params)
    text = str(err.value)
    assert f"optimizer.params.{key}" in text
    assert optimizer in text and f"did you mean {suggestion!r}" in text


def test_lamb_rejects_amsgrad_and_accepts_fused_lamb_keywords():
    with pytest.raises(ValueError, match="AMSGrad"):
        resolve_optimizer("Lamb", {"amsgrad": True})
    spec = resolve_optimizer("Lamb", {"amsgrad": False, "eps_inside_sqrt": True, "bias_correction": False,
                                      "max_coeff": 5.0, "min_coeff": 0.1})
    assert spec.kwargs == {"eps_inside_sqrt": True, "bias_correction": False, "max_coeff": 5.0, "min_coeff": 0.1}


def test_cpu_optimizer_keys_are_stripped_for_lion_and_adagrad():
    assert resolve_optimizer("Lion", {"fp32_optimizer_states": True, "set_grad_none": True}).kwargs == {}
    assert resolve_optimizer("Adagrad", {"fp32_optimizer_states": False}).kwargs == {}


# --------------------------------------------------------------------------- 1-bit family
@pytest.mark.parametrize("type_name, cls", [("OneBitAdam", "OnebitAdam"), ("ZeroOneAdam", "ZeroOneAdam"),
                                            ("onebitadam", "OnebitAdam"), ("OneBitLamb", "OnebitLamb")])
def test_onebit_family_resolves_to_raydeeps_optimizers(type_name, cls):
    spec = resolve_optimizer(type_name, {"lr": 2e-4})
    assert spec.cls.__name__ == cls and spec.name == type_name.lower() and spec.adamw_mode is None
    assert spec.kwargs["lr"] == 2e-4
    assert spec.kwargs["comm_backend_name"] is None and spec.kwargs["amsgrad"] is False
    assert needs_untested_flag(spec) is False
    opt = build_optimizer(spec, [torch.nn.Parameter(torch.zeros(1))])
    assert type(opt).__name__ == cls


def test_onebit_defaults_match_documentation():
    assert ONEBIT_OPTIMIZERS["onebitadam"]["freeze_step"] == 100000
    zo = ONEBIT_OPTIMIZERS["zerooneadam"]
    assert (zo["var_freeze_step"], zo["var_update_scaler"], zo["local_step_scaler"],
            zo["local_step_clipper"]) == (100000, 16, 32678, 16)
    lamb = ONEBIT_OPTIMIZERS["onebitlamb"]
    assert (lamb["max_coeff"], lamb["min_coeff"], lamb["coeff_beta"], lamb["factor_max"],
            lamb["factor_min"], lamb["factor_threshold"]) == (10.0, 0.01, 0.9, 4.0, 0.5, 0.1)


@pytest.mark.parametrize(
    "type_name, params, match",
    [
        ("OneBitAdam", {"var_freeze_step": 10}, "var_freeze_step"),  # a 0/1 Adam key
        ("ZeroOneAdam", {"freeze_step": 10}, "freeze_step"),
        ("OneBitAdam", {"freze_step": 10}, "did you mean 'freeze_step'"),
        ("OneBitLamb", {"amsgrad": True}, "AMSGrad"),
        ("OneBitAdam", {"comm_backend_name": "gloo"}, "comm_backend_name"),
    ],
)
def test_onebit_validation(type_name, params, match):
    with pytest.raises(ValueError, match=match):
        resolve_compressed_optimizer(type_name, params)


def test_compressed_resolution_refuses_other_names():
    with pytest.raises(ConfigError, match="not a compressed-communication optimizer"):
        resolve_compressed_optimizer("Adam", {})


# --------------------------------------------------------------------------- ZeRO untested rule
@pytest.mark.parametrize(
    "type_name, params, expected",
    [
        ("Adam", {}, False), ("AdamW", {"torch_adam": True}, False), ("Adagrad", {}, False),
        ("Lion", {}, False),
        ("Lamb", {}, True),  # FusedLamb is not in DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS
        ("SGD", {"lr": 0.1}, True), ("RMSprop", {}, True),
    ],
)
def test_needs_untested_flag(type_name, params, expected):
    assert needs_untested_flag(resolve_optimizer(type_name, params)) is expected


# --------------------------------------------------------------------------- Lamb numerics
def _reference_lamb(w, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, bias_correction=True,
                    eps_inside_sqrt=False, max_coeff=10.0, min_coeff=0.01):
    """FusedLamb's kernel written out element by element in plain floats."""
    b1, b2 = betas
    m, v = [0.0] * len(w), [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        den = [math.sqrt(vi + eps) if eps_inside_sqrt else math.sqrt(vi) + eps for vi in v]
        upd = [mi / di + wd * wi for mi, di, wi in zip(m, den, w)]
        wn, un = math.hypot(*w), math.hypot(*upd)
        coeff = min(max(wn / un, min_coeff), max_coeff) if wn > 0 and un > 0 else 1.0
        step = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        w = [wi - step * coeff * ui for wi, ui in zip(w, upd)]
    return w


def _run(opt_cls, w0, grads, **kw):
    w = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = opt_cls([w], **kw)
    for g in grads:
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return w.detach().tolist(), opt


def test_lamb_first_step_by_hand():
    # m = 0.1 g, v = 0.001 g^2, so m / sqrt(v) = sign(g) * sqrt(10); ||update|| = sqrt(30),
    # ||w|| = 3, trust ratio 3 / sqrt(30); step size lr * sqrt(0.001) / 0.1 = lr / sqrt(10);
    # every element moves by lr * 3 / sqrt(30) = 0.0547723 against the sign of its gradient.
    w, opt = _run(Lamb, [1.0, 2.0, 2.0], [[0.5, -1.0, 2.0]], lr=0.1)
    d = 0.1 * 3 / math.sqrt(30)
    assert w == pytest.approx([1 - d, 2 + d, 2 - d], abs=1e-6)
    assert opt.get_lamb_coeffs() == pytest.approx([3 / math.sqrt(30)], rel=1e-6)


def test_lamb_zero_weights_use_unit_trust_ratio_and_large_ratios_clamp():
    w, _ = _run(Lamb, [0.0, 0.0, 0.0], [[1.0, 1.0, 1.0]], lr=0.1)
    assert w == pytest.approx([-0.1, -0.1, -0.1], abs=1e-6)  # coeff 1, |m / sqrt(v)| * step = lr
    _, opt = _run(Lamb, [100.0, 100.0, 100.0], [[1.0, 1.0, 1.0]], lr=0.1)
    assert opt.get_lamb_coeffs() == [10.0]  # 100 sqrt(3) / (sqrt(10) sqrt(3)) > max_coeff


@pytest.mark.parametrize(
    "kw",
    [{}, {"lr": 0.05, "weight_decay": 0.1}, {"bias_correction": False, "eps_inside_sqrt": True},
     {"betas": (0.8, 0.9), "max_coeff": 0.5, "min_coeff": 0.2}],
)
def test_lamb_two_steps_match_reference(kw):
    grads = [[0.5, -1.0, 2.0], [-0.3, 0.2, 1.0]]
    ours, _ = _run(Lamb, [1.0, 2.0, 2.0], grads, **kw)
    ref_kw = {("wd" if k == "weight_decay" else k): v for k, v in kw.items()}
    assert ours == pytest.approx(_reference_lamb([1.0, 2.0, 2.0], grads, **ref_kw), rel=1e-9, abs=1e-12)


@pytest.mark.peers
def test_lamb_matches_deepspeed_fused_lamb_math():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    try:  # DeepSpeed ships a pure-torch port of the FusedLamb kernel for NPUs; it runs on CPU.
        from deepspeed.ops.op_builder.npu.fused_lamb import NPUFusedLamb
    except Exception as exc:  # pragma: no cover - depends on the DeepSpeed build
        pytest.skip(f"DeepSpeed's torch LAMB port is not importable here: {exc}")
    w_ref = torch.tensor([1.0, 2.0, 2.0])
    m, v = torch.zeros(3), torch.zeros(3)
    w = torch.nn.Parameter(w_ref.clone())
    opt = Lamb([w], lr=0.05, weight_decay=0.01)
    for step, g in enumerate([[0.5, -1.0, 2.0], [-0.3, 0.2, 1.0]], start=1):
        grad = torch.tensor(g)
        NPUFusedLamb.lamb(w_ref, torch.tensor([]), m, v, grad, 0.05, 0.9, 0.999, 10.0, 0.01, 1e-8, 1.0,
                          step, 1, True, 0.01)
        w.grad = grad
        opt.step()
    assert torch.allclose(w.detach(), w_ref, rtol=1e-6, atol=1e-7)


# DeepSpeed's FusedLamb CUDA kernel itself (no CPU implementation) is compared in
# tests/gpu/test_gpu_optimizers.py, run with -m gpu.


def test_lamb_defaults_match_deepspeed():
    defaults = Lamb([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert (defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"],
            defaults["bias_correction"], defaults["max_coeff"], defaults["min_coeff"]) == (
        1e-3, (0.9, 0.999), 1e-8, 0.0, True, 10.0, 0.01)


# --------------------------------------------------------------------------- Lion numerics
def test_lion_two_steps_by_hand():
    # step 1: c = 0.1 g -> sign (1, -1, 0); m = 0.001 g = (0.002, -0.003, 0)
    # step 2: c = 0.9 m + 0.1 g2 = (-0.0982, -0.1027, 0.1) -> sign (-1, -1, 1)
    w, _ = _run(Lion, [1.0, -1.0, 0.5], [[2.0, -3.0, 0.0], [-1.0, -1.0, 1.0]], lr=0.1)
    assert w == pytest.approx([1.0, -0.8, 0.4], abs=1e-12)


def test_lion_decoupled_weight_decay():
    w, _ = _run(Lion, [1.0, -1.0, 0.5], [[2.0, -3.0, 0.0]], lr=0.1, weight_decay=0.5)
    assert w == pytest.approx([0.95 - 0.1, -0.95 + 0.1, 0.475], abs=1e-12)


def test_lion_defaults_match_deepspeed_fused_lion():
    defaults = Lion([torch.nn.Parameter(torch.zeros(1))]).defaults
    assert (defaults["lr"], defaults["betas"], defaults["weight_decay"]) == (1e-3, (0.9, 0.999), 0.0)


@pytest.mark.peers
def test_lion_defaults_equal_deepspeed_signature():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.ops.lion import FusedLion

    sig = inspect.signature(FusedLion.__init__).parameters
    assert (sig["lr"].default, tuple(sig["betas"].default), sig["weight_decay"].default) == (
        1e-3, (0.9, 0.999), 0.0)


@pytest.mark.parametrize("cls", [Lamb, Lion])
def test_optimizers_reject_bad_hyperparameters(cls):
    with pytest.raises(ValueError):
        cls([torch.nn.Parameter(torch.zeros(1))], lr=-1.0)
    with pytest.raises(ValueError):
        cls([torch.nn.Parameter(torch.zeros(1))], betas=(0.9, 1.0))


# --------------------------------------------------------------------------- build / fused
@pytest.mark.parametrize("type_name", ["Adam", "AdamW", "Adagrad", "SGD"])
def test_prefer_fused_uses_torch_fused_on_cpu(type_name):
    spec = resolve_optimizer(type_name, {"lr": 0.1})
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    opt = build_optimizer(spec, [w], prefer_fused=True)
    assert opt.defaults["fused"] is True
    w.grad = torch.ones(3)
    opt.step()
    # one fused step equals one plain step
    w2 = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    plain = build_optimizer(spec, [w2])
    w2.grad = torch.ones(3)
    plain.step()
    assert torch.allclose(w, w2, rtol=1e-6, atol=1e-7)


def test_prefer_fused_falls_back_to_foreach():
    w = torch.nn.Parameter(torch.zeros(2))
    assert build_optimizer(resolve_optimizer("RMSprop", {}), [w], prefer_fused=True).defaults["foreach"] is True
    # fused excludes `differentiable`: the fallback must not inherit fused=True from the failed try
    groups = [{"params": [w], "lr": 0.1}]
    opt = build_optimizer(resolve_optimizer("Adam", {"differentiable": True}), groups, prefer_fused=True)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert "fused" not in groups[0]  # caller's group dicts are not written into


def test_explicit_foreach_or_fused_wins_and_default_builds_plain():
    w = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer(resolve_optimizer("Adam", {"foreach": False}), [w], prefer_fused=True)
    assert opt.defaults["foreach"] is False and not opt.defaults["fused"]
    opt = build_optimizer(resolve_optimizer("Adam", {}), [w])
    assert not opt.defaults["fused"] and opt.defaults["foreach"] is None


def test_spec_is_frozen_and_builds_lamb_and_lion_with_groups():
    spec = resolve_optimizer("Lamb", {"lr": 0.01})
    assert isinstance(spec, OptimizerSpec)
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = build_optimizer(spec, [{"params": [a]}, {"params": [b], "lr": 0.5}], prefer_fused=True)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.5]
    assert isinstance(build_optimizer(resolve_optimizer("Lion", {}), [a]), Lion)
