"""Activation checkpointing wired by the engine, on 2 gloo ranks, ZeRO stages 0-3.

- With the ``activation_checkpointing`` section present, ``raydeep.checkpoint_modules`` "attention"
  and "block" train to the same losses and parameters as no checkpointing (<= 1e-6), on both ranks.
- The wrapped forward really is recomputed in backward (attention's projection runs twice per
  micro-step), and not at all without the section or with "none".
- Stage 3 with one partition unit per leaf module: the recomputation inside backward fetches the
  block's parameters again through the module hooks (checked at the projection's pre-hook).
- Bytes saved for backward in one forward (``saved_tensors_hooks``): block < attention < none.
"""
import pytest

from tests.dist.harness import run_ranks

STEPS, GAS, MICRO = 3, 2, 2
MODES = [None, "none", "attention", "block"]  # None: no activation_checkpointing section at all


def _saved_bytes(engine, model, batch) -> int:
    """Bytes of the activations one forward saves for backward (parameters excluded)."""
    import torch

    params = list(model.parameters())
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in {p.untyped_storage().data_ptr() for p in params}:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(batch[:, :-1], batch[:, 1:])
    engine.backward(loss)  # let stage 3 finish its fetch/release cycle; no optimizer step follows
    engine.zero_grad()
    return sum(saved.values())


def _run(stage: int, mode, partition_units=None) -> dict:
    import raydeep
    from raydeep import comm
    from raydeep.zero import GatheredParameters
    from tests.dist.workloads import config, global_batches, run_steps, tiny_gpt

    extra = {"raydeep": {"checkpoint_modules": mode or "attention"}}
    if partition_units is not None:
        extra["raydeep"]["partition_units"] = partition_units
    if mode is not None:
        extra["activation_checkpointing"] = {}
    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=config(stage, GAS, MICRO, 1.0, **extra))
    seen = []  # per call of one projection: (inside backward, its weight present); runs after ZeRO-3's fetch hook
    c_attn = model.blocks[0].attn.c_attn
    c_attn.register_forward_pre_hook(lambda *_: seen.append(
        (getattr(engine.strategy, "in_backward", False), c_attn.weight.untyped_storage().nbytes() > 0)))
    losses = run_steps(engine, STEPS, MICRO * GAS * comm.world_size())
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "calls_per_micro_step": len(seen) / (STEPS * GAS),
            "recompute_calls": sum(1 for in_backward, _ in seen if in_backward), "all_present": all(p for _, p in seen),
            "saved": _saved_bytes(engine, model, global_batches(1, MICRO)[0])}


def checkpointing_runs() -> dict:
    out = {(stage, mode): _run(stage, mode) for stage in range(4) for mode in MODES}
    for mode in (None, "block"):
        out[("param-units", mode)] = _run(3, mode, partition_units="param")
    return out


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


@pytest.mark.slow
def test_activation_checkpointing_matches_and_saves_memory():
    ranks = run_ranks(checkpointing_runs, 2)
    for res in ranks:
        for key, run in res.items():
            base = res[(key[0], None)]
            diff = _max_diff(run["params"], base["params"])
            assert diff <= 1e-6, f"{key}: max |dtheta| {diff:.3g} against no checkpointing"
            assert run["losses"] == pytest.approx(base["losses"], abs=1e-6), key
            recomputed = key[1] in ("attention", "block")
            assert run["calls_per_micro_step"] == (2 if recomputed else 1), key
            assert run["all_present"], key  # the parameters were there, also when recomputing in backward
            if key[0] in (3, "param-units"):
                assert run["recompute_calls"] == (STEPS * GAS if recomputed else 0), key
    for key in ranks[0]:  # both ranks hold identical parameters
        assert _max_diff(ranks[0][key]["params"], ranks[1][key]["params"]) == 0.0, key
    for stage in range(4):
        saved = {mode: ranks[0][(stage, mode)]["saved"] for mode in MODES}
        assert saved["block"] < saved["attention"] < saved["none"] == saved[None], (stage, saved)
    saved = {mode: ranks[0][(0, mode)]["saved"] for mode in ("none", "attention", "block")}
    print(f"\nsaved activation bytes per forward (tiny GPT, micro-batch {MICRO}): {saved}")
