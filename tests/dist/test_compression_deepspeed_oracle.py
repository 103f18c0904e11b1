"""raydeep's 1-bit Adam, 0/1 Adam and 1-bit LAMB against a second oracle: DeepSpeed's own ``step``
functions and ``compressed_allreduce``, transcribed per rank (``tests/dist/deepspeed_onebit_oracle``).

The first oracle (``raydeep.compression.reference``) is raydeep's reading of DeepSpeed; this one is
DeepSpeed's code with its process group replaced by lists. Both raydeep's distributed optimizers
(gloo ranks, ``run_optimizer``'s three parameters of 1000, 37 and 4096 elements) and the first
oracle are held to it, step by step, on rank 0's parameters. The gradients are dyadic, so the exact
averages are the same bits everywhere, and all later arithmetic is the same torch operations on the
same shapes: 1-bit Adam and 0/1 Adam agree to the bit (the test allows 1e-6).

1-bit LAMB compresses all its momenta as one fused tensor, padded once, whose padding keeps the
last decoded values (DeepSpeed's ``exp_avg_flat`` and ``dummy_exp_avg``), and fixes each layer's
``scaling_coeff`` from an fp32 norm, as DeepSpeed did: it agrees to the bit too, whether its layers
are three parameters or three ranges of one fused parameter.

Last: DeepSpeed's 0/1 Adam itself with ``var_update_scaler=1`` on a small learnable problem.
"""
from __future__ import annotations

import pytest
import torch

from raydeep.compression import reference
from tests.dist import deepspeed_onebit_oracle as deepspeed
from tests.dist.compression_workloads import SIZES, dyadic_grads, initial_params, run_optimizer
from tests.dist.harness import run_ranks

ADAM = {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01}
LAMB = {"lr": 1e-2, "freeze_step": 5, "weight_decay": 0.01, "factor_threshold": 0.3}


def _zero_one(scaler: int) -> dict:
    return {"lr": 1e-2, "var_freeze_step": 8, "var_update_scaler": scaler, "local_step_scaler": 2,
            "local_step_clipper": 4}


# case: (raydeep optimizer, options, steps, oracle function)
CASES = {
    "onebitadam": ("onebitadam", ADAM, 14, "onebit_adam"),
    "zerooneadam-scaler1": ("zerooneadam", _zero_one(1), 16, "zero_one_adam"),
    "zerooneadam-scaler2": ("zerooneadam", _zero_one(2), 16, "zero_one_adam"),
    "zerooneadam-scaler16": ("zerooneadam", _zero_one(16), 16, "zero_one_adam"),
    "onebitlamb": ("onebitlamb", LAMB, 14, "onebit_lamb"),
}
LAMB_STEPS = 14
LAYERS = [("param0", 0, 1000), ("param1", 1000, 1037), ("param2", 1037, sum(SIZES))]

def _worst(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> float:
    assert len(got) == len(expected)
    return max(float((a - b).abs().max()) for mine, theirs in zip(got, expected) for a, b in zip(mine, theirs))


def _fused(history: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[torch.cat(step)] for step in history]


def _fused_grads(step: int, rank: int, params=None) -> list[torch.Tensor]:
    return [torch.cat(dyadic_grads(step, rank))]


# --- on the ranks ---------------------------------------------------------------------------------------
def run_fused_lamb(options: dict, steps: int) -> list[list[torch.Tensor]]:
    """raydeep's OnebitLamb on ONE parameter holding the three (as DeepSpeed's fused momentum), each
    a layer, fed like ``run_optimizer``."""
    import torch.distributed as dist

    from raydeep import comm
    from raydeep.compression import CompressedAllReduce, OnebitLamb

    world = dist.get_world_size()
    rank = dist.get_rank()
    p = torch.nn.Parameter(torch.cat(initial_params()))
    opt = OnebitLamb([p], communicator=CompressedAllReduce(comm.CommStats()), **options)
    opt.set_layers({p: LAYERS})
    history = []
    for step in range(1, steps + 1):
        (g,) = _fused_grads(step, rank)
        if not opt.communicates_gradients():
            comm.all_reduce(g, None)
            g.mul_(1.0 / world)
        p.grad = g
        with opt.one_phase():
            opt.step()
        history.append([p.detach().clone()])
    return history


def run_all_cases() -> dict:
    out = {case: run_optimizer(name, options, steps)["history"] for case, (name, options, steps, _) in CASES.items()}
    out["onebitlamb-fused"] = run_fused_lamb(LAMB, LAMB_STEPS)
    return out


@pytest.fixture(scope="module")
def raydeep_runs() -> dict:
    return {world: run_ranks(run_all_cases, world)[0] for world in (2, 4)}


def _oracle(case: str, world: int, **extra) -> list[list[torch.Tensor]]:
    _, options, steps, fn = CASES[case]
    return getattr(deepspeed, fn)(initial_params(), dyadic_grads, steps, world, **options, **extra)


# --- raydeep's distributed optimizers ----------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_raydeep_matches_deepspeed(raydeep_runs, case, world):
    worst = _worst(raydeep_runs[world][case], _oracle(case, world))
    print(f"raydeep {case} world={world}: max |raydeep - deepspeed| = {worst:.3e}")
    assert worst <= 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_raydeep_lamb_with_layers_inside_one_tensor_matches_deepspeed(raydeep_runs, world):
    """The optimizer tier's masters are buckets of several parameters (``set_layers``)."""
    worst = _worst(raydeep_runs[world]["onebitlamb-fused"], _fused(_oracle("onebitlamb", world)))
    print(f"raydeep onebitlamb, three layers in one tensor, world={world}: max |raydeep - deepspeed| = {worst:.3e}")
    assert worst <= 1e-6


# --- the first oracle ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_deepspeed(case, world):
    _, options, steps, fn = CASES[case]
    worst = _worst(getattr(reference, fn)(initial_params(), dyadic_grads, steps, world, **options),
                   _oracle(case, world))
    print(f"reference {case} world={world}: max |reference - deepspeed| = {worst:.3e}")
    assert worst <= 1e-6


# --- DeepSpeed's 0/1 Adam with var_update_scaler=1 -------------------------------------------------------
VOCAB, ACTIVE, BATCH = 64, 4, 8  # a linear model on bag-of-tokens inputs: sparse gradients, like embeddings
W_TRUE = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))


def _bag_of_tokens(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + rank)
    x = torch.zeros(BATCH, VOCAB).scatter_(1, torch.randint(0, VOCAB, (BATCH, ACTIVE), generator=g), 1.0)
    return x, x @ W_TRUE


def _sparse_grads(step: int, rank: int, params) -> list[torch.Tensor]:
    (w,) = params
    x, y = _bag_of_tokens(step, rank)
    return [2 * x.T @ (x @ w - y) / BATCH]


def test_deepspeed_zero_one_adam_with_var_update_scaler_one_blows_up_on_sparse_gradients():
    """With ``var_update_scaler=1`` DeepSpeed's 0/1 Adam doubles ``var_interval`` after every
    refresh: the variance is refreshed at steps 2, 4, 8, 16, ... and step 3 is already a compressed
    step, with ``exp_avg_sq = (1 - beta2) * g_2**2`` from ONE gradient. A coordinate whose averaged
    gradient was 0 at step 2 has ``exp_avg_sq == 0``, but the 1-bit average cannot represent 0:
    it hands that coordinate +-scale, so ``exp_avg = 0.1 * scale`` and the update is
    ``lr * exp_avg / (0 + eps)`` with eps = 1e-8. Those weights jump by ~1e4 at step 3 and
    training never recovers (the next refreshes, at steps 4, 8, 16, ..., are too few to matter).
    With 2 the first compressed step is step 5, after three exact refreshes; with 16, step 19, after 17."""
    world, steps, lr = 4, 30, 1e-2
    x_eval = torch.cat([_bag_of_tokens(10**6 + i, 0)[0] for i in range(64)])

    def loss(w):
        return float(((x_eval @ w - x_eval @ W_TRUE) ** 2).mean())

    start = [torch.zeros(VOCAB)]
    runs = {s: deepspeed.zero_one_adam(start, _sparse_grads, steps, world, lr=lr, var_freeze_step=100000,
                                       var_update_scaler=s) for s in (1, 2, 16)}
    for s, history in runs.items():
        print(f"0/1 Adam var_update_scaler={s}: loss at start {loss(start[0]):.3g}, after step 2 "
              f"{loss(history[1][0]):.3g}, step 3 {loss(history[2][0]):.3g}, step {steps} {loss(history[-1][0]):.3g}")
    zero_at_step_2 = sum(_sparse_grads(2, r, start)[0] for r in range(world)) == 0
    step_3 = runs[1][2][0]
    print(f"scaler 1, step 3: {int(zero_at_step_2.sum())} coordinates had a zero averaged gradient at step 2; "
          f"their |w| >= {step_3[zero_at_step_2].abs().min():.3g}, every other |w| <= "
          f"{step_3[~zero_at_step_2].abs().max():.3g}")
    assert zero_at_step_2.any()
    assert torch.equal(step_3.abs() > 1e3, zero_at_step_2)  # exactly the coordinates with v == 0 blow up
    assert loss(runs[1][-1][0]) > 1e6 * loss(start[0])
    for s in (2, 16):
        assert loss(runs[s][-1][0]) < 0.5 * loss(start[0])
