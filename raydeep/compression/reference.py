"""1-bit Adam and 0/1 Adam for N simulated workers in one process: the oracle the distributed
optimizers are tested against.

A direct transcription of DeepSpeed's algorithms with lists in place of ranks: no packing, no
collectives, no optimizer classes. An exact average is the rank-order sum times ``1/N`` (what
the stage-0 strategy computes); the compressed average is written out worker by worker and
server chunk by server chunk. Each tensor stands for one chunk of the optimizer tier (a flat
bucket), as the distributed optimizers compress per chunk.

``grad_fn(step, rank, params)`` gives worker ``rank``'s own gradients (one tensor per chunk) at
``step`` (1-based) for that worker's parameters. Each function returns rank 0's parameters after
every step.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

GradFn = Callable[[int, int, list[torch.Tensor]], list[torch.Tensor]]


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def _padded(numel: int, world: int) -> int:
    unit = world * math.lcm(world, 8)
    return -(-numel // unit) * unit


def compressed_average(xs: list[torch.Tensor], worker_errors: list[torch.Tensor],
                       server_errors: list[torch.Tensor]) -> torch.Tensor:
    """The average of the workers' ``xs`` through 1-bit compression with error feedback (both
    error lists are updated in place: one entry per worker, and per server chunk)."""
    world, numel = len(xs), xs[0].numel()
    padded = worker_errors[0].numel()
    chunk = padded // world
    signs, scales = [], []
    for x, error in zip(xs, worker_errors):
        buf = torch.zeros(padded)
        buf[:numel] = x.reshape(-1)
        buf += error
        scale = torch.linalg.vector_norm(buf) / math.sqrt(padded)
        error.copy_(buf - scale * _sign(buf))
        signs.append(_sign(buf))
        scales.append(scale)
    weights = torch.stack(scales) * (1.0 / world)
    out = []
    for j, error in enumerate(server_errors):
        y = torch.stack([s[j * chunk:(j + 1) * chunk] for s in signs]).mul(weights.view(-1, 1)).sum(0)
        y += error
        scale = torch.linalg.vector_norm(y) / math.sqrt(chunk)
        error.copy_(y - scale * _sign(y))
        out.append(scale * _sign(y))
    return torch.cat(out)[:numel].view(xs[0].shape)


def _errors(tensors: list[torch.Tensor], world: int) -> tuple[list, list]:
    """Per tensor: zeroed worker errors (one per worker) and server errors (one per chunk)."""
    worker, server = [], []
    for t in tensors:
        padded = _padded(t.numel(), world)
        worker.append([torch.zeros(padded) for _ in range(world)])
        server.append([torch.zeros(padded // world) for _ in range(world)])
    return worker, server


def _mean(grads: list[list[torch.Tensor]], i: int) -> torch.Tensor:
    total = grads[0][i].clone()
    for g in grads[1:]:
        total += g[i]
    return total.mul_(1.0 / len(grads))


def _apply(p, m, v, lr, eps, weight_decay) -> torch.Tensor:
    update = m / (v.sqrt() + eps)
    if weight_decay > 0.0:
        update += weight_decay * p
    p.add_(-lr * update)
    return update


def onebit_adam(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
                ) -> list[list[torch.Tensor]]:
    """1-bit Adam: step 1 only initialises; exact Adam while fewer than ``max(freeze_step, 2)``
    steps are done; then each worker's momentum from its own gradient, averaged compressed."""
    beta1, beta2 = betas
    params = [p.detach().clone().float() for p in params]  # one copy: every worker holds the same
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    worker_errors, server_errors = _errors(params, world)
    history = []
    for step in range(1, steps + 1):
        grads = [grad_fn(step, r, params) for r in range(world)]
        if step > 1:
            compressed = step - 1 >= max(freeze_step, 2)
            for i, p in enumerate(params):
                if compressed:
                    local = [m[i].clone().mul_(beta1).add_(g[i], alpha=1 - beta1) for g in grads]
                    m[i] = compressed_average(local, worker_errors[i], server_errors[i]) if world > 1 else local[0]
                else:
                    g = _mean(grads, i)
                    m[i].mul_(beta1).add_(g, alpha=1 - beta1)
                    v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                _apply(p, m[i], v[i], lr, eps, weight_decay)
        history.append([p.clone() for p in params])
    return history


def zero_one_adam(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                  var_freeze_step: int, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0
                  ) -> list[list[torch.Tensor]]:
    """0/1 Adam: step 1 only initialises; then variance refreshes from the exact average every
    ``var_interval`` steps (the gradient averaged compressed in between) until ``var_freeze_step``;
    then local steps, synchronised compressed every ``local_step_interval`` steps."""
    beta1, beta2 = betas
    n = len(params)
    P = [[p.detach().clone().float() for p in params] for _ in range(world)]
    M = [[torch.zeros_like(p) for p in P[0]] for _ in range(world)]
    V = [[torch.zeros_like(p) for p in P[0]] for _ in range(world)]
    acc = [[torch.zeros_like(p) for p in P[0]] for _ in range(world)]
    worker_errors, server_errors = _errors(P[0], world)
    var_interval, var_counter, interval, counter, lrs = 1, 0, 1, 0, 0.0
    history = []
    for step in range(1, steps + 1):
        grads = [grad_fn(step, r, P[r]) for r in range(world)]
        if step == 1:
            history.append([p.clone() for p in P[0]])
            continue
        frozen = step - 1 > var_freeze_step and step - 1 >= 2
        if frozen and step - 1 == max(var_freeze_step + 1, 2):
            for errors in worker_errors + server_errors:
                for e in errors:
                    e.zero_()
        if frozen:
            lrs += lr
        for i in range(n):
            if frozen:
                for r in range(world):
                    M[r][i].mul_(beta1).add_(grads[r][i], alpha=1 - beta1)
            elif step % var_interval == 0:
                g = _mean(grads, i)
                for r in range(world):
                    V[r][i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    M[r][i].mul_(beta1).add_(g, alpha=1 - beta1)
            else:
                c = compressed_average([grads[r][i] for r in range(world)], worker_errors[i], server_errors[i]) \
                    if world > 1 else grads[0][i]
                for r in range(world):
                    M[r][i].mul_(beta1).add_(c, alpha=1 - beta1)
            for r in range(world):
                update = _apply(P[r][i], M[r][i], V[r][i], lr, eps, weight_decay)
                if frozen:
                    acc[r][i].add_(-lr * update)
            if frozen and step % interval == 0:
                for r in range(world):
                    P[r][i].add_(-1 * acc[r][i])
                    acc[r][i].mul_(V[r][i].sqrt() + eps)
                c = compressed_average([acc[r][i] for r in range(world)], worker_errors[i], server_errors[i]) \
                    if world > 1 else acc[0][i]
                for r in range(world):
                    acc[r][i].copy_(c)
                    M[r][i].zero_().add_(acc[r][i] / lrs, alpha=-1)
                    P[r][i].add_(acc[r][i] / (V[r][i].sqrt() + eps))
                    acc[r][i].zero_()
        if frozen:
            if step % interval == 0:
                lrs = 0.0
            counter += 1
            if counter == local_step_scaler:
                counter, interval = 0, min(local_step_clipper, interval * 2)
        elif step % var_interval == 0:
            var_counter += 1
            if var_counter == var_update_scaler:
                var_counter, var_interval = 0, var_interval * 2
        history.append([p.clone() for p in P[0]])
    return history
