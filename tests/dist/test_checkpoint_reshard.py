"""Save at world size 4 on each ZeRO stage; load at world sizes 1, 2, 3 (and 4) on every stage.

Two checks per (saved stage, world size, new stage):

- exact: the loaded engine, saved again from its new layout, holds bit-for-bit the same fp32
  masters, Adam moments, step counts, scheduler state and counters as the original checkpoint;
- continued training (fp32 AdamW, WarmupDecayLR, clipping) equals continuing on the original
  layout up to summation order: another world size splits the global batch into different
  micro-batches and reduces in a different order. Both continuations start from bitwise the same
  state (the exact check), so each element is held to the bound ``adam_bounds`` derives from the
  gradient rounding that a *probe* measures on this CPU: the same two steps from the checkpoint in
  one process, once over the whole batch and once sample by sample. An element with a healthy
  gradient gets a bound near 1e-7; one whose gradient nearly vanishes is held to Adam's step bound.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist.adam_bounds import FP32_UNIT, ORDER_FACTOR, PARAM_ROUNDINGS, adam_step_bound, sensitivity
from tests.dist.checkpoint_workloads import (GLOBAL_BATCH, SCHEDULER, fresh_continuation, frozen_and_buffer_round_trip, load_and_continue,
                                             save_and_continue)
from raydeep.checkpoint import CheckpointReader
from tests.dist.harness import run_ranks
from tests.dist.workloads import global_batches, tiny_gpt

pytestmark = pytest.mark.slow

STAGES = [0, 1, 2, 3]
BEFORE, AFTER = 3, 2
MAX_LR = SCHEDULER["params"]["warmup_max_lr"]  # no step of the continuation has a larger lr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt"))
    return directory, run_ranks(save_and_continue, 4, directory, STAGES, BEFORE, AFTER)[0]


@pytest.fixture(scope="module")
def bounds(saved) -> dict:
    """Per saved stage, :func:`continuation_bounds`: the same for every world size that loads it."""
    directory, _ = saved
    return {s: continuation_bounds(f"{directory}/stage{s}") for s in STAGES}


def _max_param_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _probe(directory: str, micro: int | None) -> dict:
    """The continuation in one fp32 process from the checkpoint's state: clipping at 1.0 by
    DeepSpeed's formula, AdamW with the saved moments and step. The gradient is one backward over
    the whole batch, or (``micro``) accumulated micro-batch by micro-batch. Per step: the clipped
    gradients, Adam's denominators ``sqrt(v_hat) + eps`` and the parameters; and the losses."""
    torch.set_num_threads(1)
    reader = CheckpointReader.open(directory)
    model = tiny_gpt()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(named.values(), lr=MAX_LR, weight_decay=0.01)
    step = reader.manifest["optimizer"]["scalars"][0]["step"]["value"]
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(reader.full("fp32", name))
            opt.state[p] = {"step": torch.tensor(step), "exp_avg": reader.full("exp_avg", name).clone(),
                            "exp_avg_sq": reader.full("exp_avg_sq", name).clone()}
    out = {"grads": [], "denoms": [], "params": [], "losses": []}
    for batch in global_batches(BEFORE + AFTER, GLOBAL_BATCH)[BEFORE:]:
        pieces = batch.split(micro) if micro else [batch]
        loss = 0.0
        for piece in pieces:
            piece_loss = model(piece[:, :-1], piece[:, 1:])
            (piece_loss / len(pieces)).backward()
            loss += piece_loss.item() / len(pieces)
        norm = sum(p.grad.double().pow(2).sum() for p in named.values()).sqrt().item()
        if norm + 1e-6 > 1.0:
            for p in named.values():
                p.grad.mul_(1.0 / (norm + 1e-6))
        out["grads"].append({n: p.grad.clone() for n, p in named.items()})
        opt.step()
        opt.zero_grad()
        t = float(opt.state[named[next(iter(named))]]["step"])
        out["denoms"].append({n: (opt.state[p]["exp_avg_sq"].double() / (1 - 0.999 ** t)).sqrt() + 1e-8
                              for n, p in named.items()})
        out["params"].append({n: p.detach().double().clone() for n, p in named.items()})
        out["losses"].append(loss)
    return out


def continuation_bounds(directory: str) -> tuple[dict[str, torch.Tensor], float]:
    """Per element, how far two fp32 continuations from this checkpoint in different summation
    orders may end apart (``adam_bounds``, both runs rounding), and the bound on their losses."""
    whole, by_sample = _probe(directory, None), _probe(directory, 1)
    bounds = {}
    for name in whole["params"][0]:
        bound, dg = torch.zeros_like(whole["params"][0][name]), 0.0
        for k in range(AFTER):
            t = BEFORE + 1 + k
            dg = max(dg, (whole["grads"][k][name] - by_sample["grads"][k][name]).abs().max().item())
            first_order = sensitivity(t) * ORDER_FACTOR * dg / whole["denoms"][k][name]
            bound += MAX_LR * first_order.clamp(max=2 * adam_step_bound(t))
            bound += 2 * PARAM_ROUNDINGS * FP32_UNIT * (whole["params"][k][name].abs() + 2 * MAX_LR)
        bounds[name] = bound
    ulps = 2 * max(math.ulp(torch.tensor(x, dtype=torch.float32).item()) for x in whole["losses"])
    loss_bound = ORDER_FACTOR * max(abs(a - b) for a, b in zip(whole["losses"], by_sample["losses"])) + ulps
    return bounds, loss_bound


def _worst_excess(got: dict, want: dict, bounds: dict) -> tuple[float, str]:
    """The largest ``|dtheta| / bound`` over every element, and where."""
    worst = (0.0, "")
    for name, theta in got.items():
        diff = (theta.double() - want[name].double()).abs().flatten()
        excess = diff / bounds[name].flatten()
        i = int(excess.argmax())
        if excess[i] > worst[0]:
            worst = (excess[i].item(), f"{name}[{i}] |dtheta| {diff[i]:.3g}, bound {bounds[name].flatten()[i]:.3g}")
    return worst


def _assert_same_state(original_dir: str, resaved_dir: str) -> None:
    original, resaved = CheckpointReader.open(original_dir), CheckpointReader.open(resaved_dir)
    assert original.state_kinds == resaved.state_kinds == ["fp32", "exp_avg", "exp_avg_sq"]
    for kind in original.state_kinds:
        for name in original.params:
            assert torch.equal(original.full(kind, name), resaved.full(kind, name)), (resaved_dir, kind, name)
    for key in ("counters", "param_groups", "lr_scheduler", "params"):
        assert original.manifest[key] == resaved.manifest[key], key
    assert original.manifest["optimizer"]["scalars"] == resaved.manifest["optimizer"]["scalars"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_resume_on_any_world_size_and_stage(saved, bounds, world):
    directory, original = saved
    pairs = [(s, t) for s in STAGES for t in STAGES]
    resumed = run_ranks(load_and_continue, world, directory, pairs, AFTER)[0]
    worst_loss = worst_param = worst_used = 0.0
    for (saved_stage, stage), got in resumed.items():
        want = original[saved_stage]
        assert got["steps"] == want["steps"] == BEFORE + AFTER
        assert got["samples"] == want["samples"]
        assert got["lr"] == pytest.approx(want["lr"], rel=1e-12)
        loss = max(abs(x - y) for x, y in zip(got["losses"], want["losses"]))
        element_bounds, loss_bound = bounds[saved_stage]
        used, where = _worst_excess(got["params"], want["params"], element_bounds)
        assert loss <= loss_bound, (saved_stage, stage, world, f"losses differ by {loss:.3g} > {loss_bound:.3g}")
        assert used <= 1, (saved_stage, stage, world, where)
        worst_loss, worst_used = max(worst_loss, loss), max(worst_used, used)
        worst_param = max(worst_param, _max_param_diff(got["params"], want["params"]))
        _assert_same_state(f"{directory}/stage{saved_stage}", f"{directory}/resaved-w{world}-{saved_stage}-to-{stage}")
    print(f"\nsaved at W4 -> resumed at W{world}, stages 0-3 x 0-3: "
          f"max |dloss| {worst_loss:.2e}, max |dθ| {worst_param:.2e}, largest fraction of an element's bound "
          f"{worst_used:.2f}")


def test_without_loading_the_run_differs(saved):
    """The control: a fresh engine that does not load diverges, so the comparison above can fail."""
    _, original = saved
    params = run_ranks(fresh_continuation, 2, 2, BEFORE, AFTER)[0]
    assert _max_param_diff(params, original[2]["params"]) > 1e-3


def test_bf16_frozen_params_and_buffers(tmp_path):
    """bf16 (fp32 masters), a frozen parameter and a buffer: ZeRO-3 at W2 -> ZeRO-1 at W1."""
    directory = str(tmp_path / "bf16")
    saved = run_ranks(frozen_and_buffer_round_trip, 2, directory, True)[0]
    loaded = run_ranks(frozen_and_buffer_round_trip, 1, directory, False)[0]
    assert torch.equal(loaded["frozen"], saved["frozen"]) and torch.equal(loaded["calls"], saved["calls"])
    for name, value in saved["params"].items():
        assert torch.equal(loaded["params"][name], value), name  # bf16 weights re-derived from the masters
    _assert_same_state(directory, directory + "-resaved")
