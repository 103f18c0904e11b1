"""Accelerate's own DeepSpeed path, without the Trainer: ``Accelerator(deepspeed_plugin=
DeepSpeedPlugin(hf_ds_config=...))``, ``DummyOptim``/``DummyScheduler`` for the optimizer and
scheduler the ds_config names (WarmupDecayLR: DeepSpeed's scheduler, built by the engine),
``accelerator.accumulate``/``backward``, and ``save_state``/``load_state`` (an engine checkpoint
tagged ``pytorch_model``, accelerate's name).
"""
from __future__ import annotations

from workload import TokenData, tiny_gpt2


def ds_config(stage: int, gas: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                               "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": stage}}


def train(opts, first: int, load_from: str | None = None, save_to: str | None = None) -> list[dict]:
    """Optimizer steps ``first..opts.steps`` of one fixed batch stream, from ``load_from``'s
    state if given; ``save_state`` to ``save_to`` after step ``opts.save_at``. Returns each
    step's loss, averaged over its micro-batches and the ranks."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from torch.utils.data import DataLoader

    AcceleratorState._reset_state(reset_partial_state=False)  # a previous run's plugin goes
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config(opts.stage, opts.gas)))
    world = accelerator.num_processes
    loader = DataLoader(TokenData(opts.steps * opts.gas * opts.micro * world), batch_size=opts.micro)
    model = tiny_gpt2()
    optimizer = DummyOptim(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=opts.steps * world, warmup_num_steps=3)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if load_from is not None:
        accelerator.load_state(load_from)
    batches = iter(loader)
    for _ in range((first - 1) * opts.gas):  # the micro-batches of the steps before ``first``
        next(batches)
    records = []
    for step in range(first, opts.steps + 1):
        losses = []
        for _ in range(opts.gas):
            with accelerator.accumulate(model):
                loss = model(**next(batches)).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        records.append({"step": step, "loss": float(mean) / world})
        if save_to is not None and step == opts.save_at:
            accelerator.save_state(save_to)
    return records
