"""Checkpoint workloads run inside ``run_ranks``: save on one layout, resume on another.

The global batch is fixed (12 samples) and split into micro-batches and accumulation steps
that fit each world size, so a continuation on any layout sees the same data per step.
"""
from __future__ import annotations

import torch

from tests.dist.workloads import config, run_steps, tiny_gpt

GLOBAL_BATCH = 12
SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 2, "total_num_steps": 20}}


def layout_config(stage: int, world: int, **extra) -> dict:
    """Micro batch x accumulation for ``world`` ranks that adds up to GLOBAL_BATCH."""
    micro, gas = {1: (6, 2), 2: (3, 2), 3: (4, 1), 4: (3, 1)}[world]
    return config(stage, gas, micro, 1.0, scheduler=SCHEDULER, **extra)


def build(stage: int, **extra):
    import raydeep
    from raydeep import comm

    engine, *_ = raydeep.initialize(model=tiny_gpt(), config=layout_config(stage, comm.world_size(), **extra))
    return engine


def full_params(engine) -> dict[str, torch.Tensor]:
    from raydeep.zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def continue_training(engine, steps: int) -> dict:
    """Train ``steps`` more optimizer steps on the batches that follow ``engine.global_steps``."""
    start = engine.global_steps
    losses = run_steps(engine, start + steps, GLOBAL_BATCH, skip=start)
    return {"losses": losses, "params": full_params(engine), "lr": engine.get_lr(), "steps": engine.global_steps,
            "samples": engine.global_samples}


def save_and_continue(directory: str, stages: list[int], before: int, after: int) -> dict:
    """Per stage: train ``before`` steps, save to ``directory/stage<S>``, train ``after`` more."""
    out = {}
    for stage in stages:
        engine = build(stage)
        run_steps(engine, before, GLOBAL_BATCH)
        engine.save_checkpoint(f"{directory}/stage{stage}", client_state={"note": "hello", "marker": torch.arange(3)})
        out[stage] = continue_training(engine, after)
    return out


def load_and_continue(directory: str, pairs: list[tuple[int, int]], after: int) -> dict:
    """Per (saved stage, new stage): a fresh engine loads the checkpoint, saves it again from
    the new layout (so the test can compare every restored state exactly), and trains
    ``after`` more steps."""
    from raydeep import comm

    out = {}
    for saved, stage in pairs:
        engine = build(stage)
        path, client = engine.load_checkpoint(f"{directory}/stage{saved}")
        assert client["note"] == "hello" and torch.equal(client["marker"], torch.arange(3)), client
        engine.save_checkpoint(f"{directory}/resaved-w{comm.world_size()}-{saved}-to-{stage}")
        out[(saved, stage)] = continue_training(engine, after)
    return out


def fresh_continuation(stage: int, before: int, after: int) -> dict[str, torch.Tensor]:
    """The control: the same continuation without loading anything."""
    engine = build(stage)
    run_steps(engine, before + after, GLOBAL_BATCH, skip=before)
    return full_params(engine)


def frozen_and_buffer_round_trip(directory: str, save: bool) -> dict:
    """bf16 training with a frozen parameter and a buffer: saved at one layout, loaded at another."""
    import raydeep
    from raydeep import comm

    model = tiny_gpt()
    model.register_buffer("calls", torch.zeros(3))
    frozen = next(p for n, p in model.named_parameters() if n.endswith("ln_f.weight"))
    frozen.requires_grad_(False)
    stage = 3 if save else 1
    cfg = layout_config(stage, comm.world_size(), bf16={"enabled": True})
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    if save:
        run_steps(engine, 2, GLOBAL_BATCH)
        with torch.no_grad():
            frozen.add_(0.25)
            model.calls.fill_(7)
        engine.save_checkpoint(directory)
    else:
        engine.load_checkpoint(directory)
        engine.save_checkpoint(directory + "-resaved")
    return {"frozen": frozen.detach().float().clone(), "calls": model.calls.clone(), "params": full_params(engine)}
