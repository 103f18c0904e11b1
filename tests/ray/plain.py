"""The same training as a Ray run, in plain gloo processes and without raydeep.ray's loop: the
engine through ``raydeep.initialize``, the samples read straight from the documented order, the
weights gathered with ``GatheredParameters``. A Ray run must reproduce it. (With bf16 weights a
run's ``param_sha256`` is its fp32 masters': ``masters`` has them.)"""
from __future__ import annotations

import torch


def train_plain(spec, steps: int) -> dict:
    """Run on every rank of a gloo group (tests.dist.harness); returns the full parameters (as fp32),
    the fp32 masters and the losses."""
    import torch.distributed as dist

    import raydeep
    from raydeep.data import builtin_dataset
    from raydeep.models import build_gpt
    from raydeep.ray.batch_plan import plan_batches
    from raydeep.ray.ledger import SampleOrder
    from raydeep.ray.weights import consolidated_fp32
    from raydeep.zero import GatheredParameters

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ds_config = spec.resolved_ds_config()
    config = plan_batches(ds_config, world, world).engine_config(ds_config, world)
    torch.manual_seed(spec.seed)
    model = build_gpt(spec.model)
    engine, *_ = raydeep.initialize(model=model, config=config)
    data = builtin_dataset(model.config.block_size)
    order = SampleOrder(len(data), spec.seed)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    batch, losses = engine.train_batch_size(), []
    for step in range(steps):
        total = 0.0
        for k in range(accum):
            ids = order.ids(step * batch + (k * world + rank) * micro, micro)
            x = torch.stack([data[int(i)][0] for i in ids])
            y = torch.stack([data[int(i)][1] for i in ids])
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / accum)
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"params": params, "masters": consolidated_fp32(engine), "losses": losses}


SLEEPY_CALL, SLEEPY_SECONDS = 3, 5.0  # rank 1's third forward (step 3) sleeps this long


def sleepy_gpt():
    """``--model tests.ray.plain:sleepy_gpt``: the built-in gpt-tiny, whose forward on rank 1
    sleeps in :func:`sleep_in_forward` at its ``SLEEPY_CALL``-th call: a rank stuck in a step,
    for the step watchdog to find."""
    import itertools

    import torch.distributed as dist

    from raydeep.models import build_gpt

    model = build_gpt("gpt-tiny")
    plain_forward, calls = model.forward, itertools.count(1)

    def forward(*args, **kwargs):
        if next(calls) == SLEEPY_CALL and dist.is_initialized() and dist.get_rank() == 1:
            sleep_in_forward(SLEEPY_SECONDS)
        return plain_forward(*args, **kwargs)

    model.forward = forward
    return model


def sleep_in_forward(seconds: float) -> None:
    import time

    time.sleep(seconds)
