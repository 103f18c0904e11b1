"""fp16 and bf16 at the engine level, with overflows injected on one rank at chosen steps.

Two gloo ranks train the tiny GPT at ZeRO stages 0-3. At the chosen optimizer steps one rank
writes inf or NaN into a single element of one gradient during its first micro-batch, so only
one rank ever sees the bad value before the reduction, and after a reduce-scatter only the
owner of that element does. Every rank must still skip the step: no optimizer update
(parameters, fp32 masters and Adam states bitwise unchanged), the LR scheduler does not
advance, ``skipped_steps`` counts it, ``global_steps`` still advances, and the loss scale moves.

The expected sequences come from DeepSpeed 0.19.8's own code, driven with the same overflow
sequence: DeepSpeed's CPU accelerator refuses fp16, so instead of its engine we run the loss
scaler each path builds (``DynamicLossScaler`` for ZeRO 1-3, the non-ZeRO fp16 optimizer's
``_update_scale`` rule for stage 0, ``LossScaler`` for a static scale), with the scaler
arguments from DeepSpeed's own fp16 config model and its ``WarmupLR``, plus the engine
bookkeeping of ``DeepSpeedEngine._take_model_step`` (reference §3.2).
"""
from __future__ import annotations

import math
import types

import pytest
import torch

from tests.dist.harness import run_ranks
from tests.dist.workloads import config, global_batches, tiny_gpt

WORLD, GAS, MICRO = 2, 2, 2
INJECT_RANK = 1  # the only rank that sees the bad gradient value
SCHEDULER = {"type": "WarmupLR",
             "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 4, "warmup_type": "linear"}}
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2,
        "min_loss_scale": 1}
# step -> value written into the gradient. Steps 1-3: hysteresis 2 -> 1, then two halvings;
# 4 clean steps double the scale again on the (W+1)-th; step 9 consumes the restored hysteresis.
DYNAMIC_OVERFLOWS = {1: math.inf, 2: math.nan, 3: -math.inf, 9: math.nan}
DYNAMIC_STEPS = 10
STATIC_FP16 = {"enabled": True, "loss_scale": 128}
STATIC_OVERFLOWS = {1: math.inf, 3: math.nan}
# Scale 2 with no hysteresis: the first overflow halves it to the minimum, the second raises
# under ZeRO; the non-ZeRO rule (stage 0) stays at the minimum instead.
MIN_FP16 = {"enabled": True, "initial_scale_power": 1, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1}
MIN_OVERFLOWS = {1: math.inf, 2: math.inf, 3: math.inf}
BF16_OVERFLOWS = {1: math.nan}


def _cfg(stage: int, **extra) -> dict:
    return config(stage, GAS, MICRO, 1.0, scheduler=SCHEDULER, **extra)


# Every scenario: (name, config, steps, {step: injected value}). All run in one process group.
SCENARIOS = (
    [(f"fp16-dynamic-s{s}", _cfg(s, fp16=FP16), DYNAMIC_STEPS, DYNAMIC_OVERFLOWS) for s in range(4)]
    + [(f"fp16-static-s{s}", _cfg(s, fp16=STATIC_FP16), 5, STATIC_OVERFLOWS) for s in (0, 2)]
    + [(f"fp16-min-scale-s{s}", _cfg(s, fp16=MIN_FP16), 4, MIN_OVERFLOWS) for s in (0, 1)]
    + [(f"bf16-s{s}", _cfg(s, bf16={"enabled": True}), 3, BF16_OVERFLOWS) for s in range(4)]
    + [(f"bf16-nocheck-s{s}", _cfg(s, bf16={"enabled": True, "check_grad_overflow": False}), 2, BF16_OVERFLOWS)
       for s in (1, 2)]
    + [("fp16-no-norm-s2", _cfg(2, fp16=FP16, zero_optimization={
        **config(2, GAS, MICRO, 1.0)["zero_optimization"], "compute_grad_norm": False}), 2, {1: math.inf})]
)


# --- the raydeep side (runs on every rank) ---------------------------------------------------------
def _snapshot(engine, model) -> list[torch.Tensor]:
    """Everything a step may change: full parameters, fp32 masters, optimizer states."""
    from raydeep.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        out = [p.detach().clone() for p in model.parameters()]
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            out.append(p.detach().clone())
            out += [t.clone() for t in engine.optimizer.state.get(p, {}).values() if torch.is_tensor(t)]
    return out


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    # NaN != NaN, so compare bit patterns rather than values.
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x.view(torch.uint8) if x.dim() else x,
                                                                       y.view(torch.uint8) if y.dim() else y)
                                    for x, y in zip(a, b))


def _poison(value: float):
    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[7] = value
        return grad
    return hook


def _train(cfg: dict, steps: int, inject: dict[int, float]) -> list[dict]:
    """Train on this rank and record the engine's bookkeeping after every optimizer step; an
    exception ends the run and is recorded as the last entry."""
    import torch.distributed as dist

    import raydeep

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    target = model.blocks[0].mlp.c_fc.weight
    records = []
    for step, batch in enumerate(global_batches(steps, MICRO * GAS * world)):
        before = _snapshot(engine, model)
        try:
            for k in range(GAS):
                handle = target.register_hook(_poison(inject[step])) if (
                    k == 0 and step in inject and rank == INJECT_RANK) else None
                lo = (k * world + rank) * MICRO
                x = batch[lo:lo + MICRO]
                engine.backward(engine(x[:, :-1], x[:, 1:]))
                if handle is not None:
                    handle.remove()
                engine.step()
        except Exception as exc:  # noqa: BLE001 - the min-scale exception is part of the contract
            records.append({"error": str(exc), "step": step, "skipped": engine.skipped_steps,
                            "global_steps": engine.global_steps})
            break
        after = _snapshot(engine, model)
        records.append({"scale": engine.cur_scale, "skipped": engine.skipped_steps,
                        "global_steps": engine.global_steps, "applied": engine.was_step_applied(),
                        "lr": engine.get_lr(), "norm": engine.get_global_grad_norm(),
                        "unchanged": _bitwise_equal(before, after),
                        "finite": all(bool(t.float().isfinite().all()) for t in after)})
    return records


def _run_all(scenarios) -> dict[str, list[dict]]:
    return {name: _train(cfg, steps, inject) for name, cfg, steps, inject in scenarios}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, list[dict]]]:
    return run_ranks(_run_all, WORLD, SCENARIOS)


def _scenario(name: str):
    return next(s for s in SCENARIOS if s[0] == name)


# --- DeepSpeed's side: its own scaler and scheduler classes, driven step by step -------------------
@pytest.fixture(scope="module")
def ds():
    pytest.importorskip("deepspeed", exc_type=ImportError)
    from tests.dist.deepspeed_peer import _import_deepspeed

    deepspeed = _import_deepspeed()
    from deepspeed.runtime.fp16 import loss_scaler

    # DynamicLossScaler asks deepspeed.comm for the rank only to decide who logs; this process
    # has no DeepSpeed process group, so answer "rank 0".
    saved = loss_scaler.dist
    loss_scaler.dist = types.SimpleNamespace(get_rank=lambda group=None: 0)
    yield deepspeed
    loss_scaler.dist = saved


def _deepspeed_scaler(fp16: dict, stage: int):
    """(update(overflow), current scale) as DeepSpeed 0.19.8 builds them for this stage."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    section = DeepSpeedFP16Config(**fp16)
    dynamic = section.loss_scale == 0
    args = section.dynamic_loss_scale_args()
    if stage >= 1:  # DeepSpeedZeroOptimizer / stage 3: CreateLossScaler
        scaler = CreateLossScaler(torch.half, section.loss_scale, dynamic, args)
        return scaler.update_scale, lambda: scaler.cur_scale
    # Stage 0 with torch AdamW: FP16_UnfusedOptimizer (engine._configure_fp16_optimizer); run its
    # scale rule on a stand-in holding only the state that rule reads.
    state = types.SimpleNamespace(verbose=False, loss_scale_config=LossScaleConfig(
        torch.half, dynamic, section.loss_scale, args, profile=LossScaleProfile.UNFUSED))
    return (lambda overflow: FP16_UnfusedOptimizer._update_scale(state, overflow),
            lambda: state.loss_scale_config.cur_scale)


def _deepspeed_expected(fp16: dict | None, stage: int, steps: int, overflows) -> list[dict]:
    """DeepSpeedEngine._take_model_step's bookkeeping around DeepSpeed's scaler and WarmupLR."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    if fp16 is not None:
        update, scale = _deepspeed_scaler(fp16, stage)
    else:  # bf16: no scaling
        update, scale = (lambda overflow: None), (lambda: 1.0)
    lr = config(stage, GAS, MICRO, 1.0)["optimizer"]["params"]["lr"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = WarmupLR(optimizer, **SCHEDULER["params"])
    skipped, out = 0, []
    for step in range(steps):
        overflow = step in overflows
        try:
            update(overflow)  # inside optimizer.step(): before any counter moves
        except Exception as exc:  # noqa: BLE001
            out.append({"error": str(exc), "step": step, "skipped": skipped, "global_steps": step})
            break
        if overflow:
            skipped += 1
        else:
            scheduler.step()
        out.append({"scale": scale(), "skipped": skipped, "global_steps": step + 1, "applied": not overflow,
                    "lr": [g["lr"] for g in optimizer.param_groups]})
    return out


# --- the tests ------------------------------------------------------------------------------------
def _check_step_invariants(name: str, records: list[dict], overflows) -> None:
    for step, rec in enumerate(records):
        if "error" in rec:
            continue
        if step in overflows:
            assert rec["unchanged"], f"{name} step {step}: a skipped step changed parameters or optimizer state"
            assert rec["norm"] == math.inf, f"{name} step {step}: grad norm {rec['norm']} on a skipped step"
        else:
            assert not rec["unchanged"], f"{name} step {step}: an applied step left the parameters untouched"
            assert rec["finite"] and math.isfinite(rec["norm"]), f"{name} step {step}: non-finite after a clean step"


def _compare(name: str, ours: list[dict], theirs: list[dict]) -> None:
    keys = ("scale", "skipped", "global_steps", "applied")
    assert len(ours) == len(theirs), f"{name}: {len(ours)} steps recorded, DeepSpeed {len(theirs)}:\n{ours}\n{theirs}"
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if "error" in b:
            # DeepSpeed's message first; raydeep adds its collapse diagnosis on the lines after it.
            assert a.get("error", "").split("\n")[0] == b["error"] and a["step"] == b["step"], \
                f"{name} step {step}: {a} vs {b}"
            assert "loss scale collapse" in a["error"], a["error"]
            continue
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, f"{name} step {step}: {a} vs DeepSpeed {b}"
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12), f"{name} step {step}: lr {a['lr']} vs {b['lr']}"


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS if s[0].startswith("fp16-") and "no-norm" not in s[0]])
def test_fp16_overflow_sequence_matches_deepspeed(runs, ds, name):
    _, cfg, steps, overflows = _scenario(name)
    stage = cfg["zero_optimization"]["stage"]
    ours = runs[0][name]
    assert runs[1][name] == ours, f"{name}: the ranks disagree:\n{runs[0][name]}\n{runs[1][name]}"
    expected = _deepspeed_expected(cfg["fp16"], stage, steps, overflows)
    _compare(name, [{k: v for k, v in r.items() if k not in ("norm", "unchanged", "finite")} for r in ours],
             expected)
    _check_step_invariants(name, ours, overflows)


@pytest.mark.slow
def test_min_scale_raises_under_zero_only(runs):
    """ZeRO's scaler raises at the minimum on every rank; the stage-0 rule holds the minimum."""
    zero = runs[0]["fp16-min-scale-s1"]
    assert zero[-1].get("error", "").startswith("Current loss scale already at minimum"), zero
    assert zero[-1]["step"] == 2 and [r["scale"] for r in zero[:-1]] == [2.0, 1.0]
    assert runs[1]["fp16-min-scale-s1"][-1]["error"] == zero[-1]["error"]
    plain = runs[0]["fp16-min-scale-s0"]
    assert [r["scale"] for r in plain] == [2.0, 1.0, 1.0, 1.0] and plain[-1]["skipped"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("stage", range(4))
def test_bf16_skips_nonfinite_steps(runs, stage):
    """bf16 (default ``check_grad_overflow: true``): a non-finite step is skipped at every stage,
    with no loss scale and the scheduler held."""
    name = f"bf16-s{stage}"
    records = runs[0][name]
    assert runs[1][name] == records
    assert [r["applied"] for r in records] == [True, False, True]
    assert [r["skipped"] for r in records] == [0, 1, 1] and [r["global_steps"] for r in records] == [1, 2, 3]
    assert {r["scale"] for r in records} == {1.0}
    assert records[1]["lr"] == records[0]["lr"] != records[2]["lr"]
    _check_step_invariants(name, records, BF16_OVERFLOWS)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_without_overflow_check_lets_nan_through(runs, stage):
    """DeepSpeed 0.19.8: ZeRO 1/2 with ``bf16.check_grad_overflow: false`` apply the step, so the
    NaN reaches the weights (reference §3.6); raydeep's builder keeps that behaviour."""
    records = runs[0][f"bf16-nocheck-s{stage}"]
    for rank_records in runs:  # NaN != NaN: compare the bookkeeping, not the norms
        assert [(r["applied"], r["skipped"]) for r in rank_records[f"bf16-nocheck-s{stage}"]] == [(True, 0), (True, 0)]
    assert not records[-1]["finite"] and not math.isfinite(records[-1]["norm"])


@pytest.mark.slow
def test_fp16_overflow_skipped_without_grad_norm(runs):
    records = runs[0]["fp16-no-norm-s2"]
    assert [r["applied"] for r in records] == [True, False] and records[-1]["unchanged"]


@pytest.mark.slow
@pytest.mark.peers
def test_counters_after_min_scale_exception_match_deepspeed(runs, ds):
    _, cfg, steps, overflows = _scenario("fp16-min-scale-s1")
    expected = _deepspeed_expected(cfg["fp16"], 1, steps, overflows)[-1]
    ours = runs[0]["fp16-min-scale-s1"][-1]
    assert (ours["skipped"], ours["global_steps"]) == (expected["skipped"], expected["global_steps"])
