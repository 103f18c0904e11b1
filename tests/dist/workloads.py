"""Training workloads shared by the distributed tests: the engine on the tiny GPT and the
single-process PyTorch reference it must match."""
from __future__ import annotations

import torch

SEQ = 32


def tiny_gpt():
    from raydeep.models import build_gpt

    torch.manual_seed(0)
    return build_gpt("gpt-tiny", block_size=SEQ, n_layer=2, n_embd=64, n_head=4)


def global_batches(steps: int, batch: int, seed: int = 1, repeat: bool = False) -> list[torch.Tensor]:
    """``steps`` global batches of uniform random tokens; with ``repeat``, the first one every step
    (its loss falls steadily, where fresh random tokens keep the loss near ln 256)."""
    g = torch.Generator().manual_seed(seed)
    if repeat:
        return [torch.randint(0, 256, (batch, SEQ + 1), generator=g)] * steps
    return [torch.randint(0, 256, (batch, SEQ + 1), generator=g) for _ in range(steps)]


def config(stage: int, gas: int, micro: int, clip: float, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000,
                                 "stage3_param_persistence_threshold": 100}}
    for key, value in extra.items():
        cfg[key] = value
    return cfg


def train_engine(cfg: dict, steps: int, global_batch: int, warmup_steps: int = 0) -> dict:
    """Train with raydeep on this rank; returns losses and the full fp32 parameters."""
    import raydeep
    from raydeep.zero import GatheredParameters

    model = tiny_gpt()
    engine, *_ = raydeep.initialize(model=model, config=cfg)
    losses = run_steps(engine, steps, global_batch, warmup_steps)
    comm_stats = engine.comm_stats()
    params = list(model.parameters())
    with GatheredParameters(params):
        full = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": full, "memory": engine.memory_breakdown(), "comm": comm_stats,
            "numel": sum(p.numel() for p in params), "grad_norm": engine.get_global_grad_norm()}


def run_steps(engine, steps: int, global_batch: int, warmup_steps: int = 0, skip: int = 0,
              repeat: bool = False) -> list[float]:
    """The loop both raydeep and DeepSpeed run: micro-step k of rank r takes a fixed slice of
    each global batch; returns per-step losses averaged over ranks. ``skip`` starts at that
    global batch (a resumed run continues the same data stream)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step, batch in enumerate(global_batches(steps, global_batch, repeat=repeat)):
        if step < skip:
            continue
        if step == warmup_steps and warmup_steps:
            engine.reset_comm_stats()  # measure steady state: the stage-3 trace is recorded by now
        step_loss = 0.0
        for k in range(gas):
            lo = (k * world + rank) * micro
            x = batch[lo:lo + micro].to(engine.device)
            loss = engine(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / gas
        total = torch.tensor([step_loss], dtype=torch.float64, device=engine.device)  # NCCL: CUDA only
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def train_reference(steps: int, global_batch: int, clip: float, dtype: torch.dtype = torch.float32,
                    micro: int | None = None, trace: bool = False, repeat: bool = False) -> dict:
    """Plain single-process PyTorch with the same global batch: the oracle.

    ``dtype`` float64 gives the exact-arithmetic stand-in the parity test measures against.
    ``micro`` accumulates the gradient over micro-batches of that size, one after another (the
    summation order of gradient accumulation), instead of one backward over the whole batch.
    Returns per-step losses and pre-clip gradient norms and the final parameters; with ``trace``,
    also per step the gradients Adam received (after clipping), Adam's denominators
    ``sqrt(v_hat) + eps`` and the parameters after the step.
    """
    torch.set_num_threads(1)
    model = tiny_gpt().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=dtype == torch.float32)
    losses, norms, grads, denoms, trajectory = [], [], [], [], []
    for batch in global_batches(steps, global_batch, repeat=repeat):
        pieces = batch.split(micro) if micro else [batch]
        loss = 0.0
        for piece in pieces:
            piece_loss = model(piece[:, :-1], piece[:, 1:])
            (piece_loss / len(pieces) if len(pieces) > 1 else piece_loss).backward()
            loss += piece_loss.item() / len(pieces)
        # DeepSpeed's formula: float64 global norm, grads divided by (norm + 1e-6) / clip
        norm = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()
        combined = (norm + 1e-6) / clip if clip > 0 else 1.0
        if combined > 1:
            for p in model.parameters():
                p.grad.mul_(1.0 / combined)
        if trace:
            grads.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        norms.append(norm)
        if trace:
            denoms.append({n: adam_denominator(opt, p) for n, p in model.named_parameters()})
            trajectory.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
    out = {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if trace:
        out.update(grads=grads, denoms=denoms, trajectory=trajectory)
    return out


def adam_denominator(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """``sqrt(v_hat) + eps`` of ``p`` after the step just taken (torch's AdamW arithmetic, in float64)."""
    state, group = opt.state[p], opt.param_groups[0]
    t = float(state["step"])
    return (state["exp_avg_sq"].double() / (1 - group["betas"][1] ** t)).sqrt() + group["eps"]


def sweep(combos: list[tuple[int, int, float]], steps: int, micro: int) -> dict:
    """Run ``train_engine`` for each (stage, gas, clip) on this rank; keyed by the combo."""
    from raydeep import comm

    out = {}
    for stage, gas, clip in combos:
        global_batch = micro * gas * comm.world_size()
        out[(stage, gas, clip)] = train_engine(config(stage, gas, micro, clip), steps, global_batch)
    return out
