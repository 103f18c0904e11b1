"""1-bit Adam, 0/1 Adam and 1-bit LAMB for N simulated workers in one process: the oracle the distributed
optimizers are tested against.

A direct transcription of DeepSpeed's algorithms with lists in place of ranks: no packing, no
collectives, no optimizer classes. An exact average is the rank-order sum times ``1/N`` (what
the stage-0 strategy computes); the compressed average is written out worker by worker and
server chunk by server chunk. Each tensor stands for one chunk of the optimizer tier (a flat
bucket): 1-bit Adam and 0/1 Adam compress each alone, 1-bit LAMB all of them fused into one, as
DeepSpeed did.

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


def _lamb_factor(ratio, prelim, update, weight_decay, last, factor_min, factor_max, threshold) -> float:
    factor = ratio.max().item()
    if weight_decay > 0.0:
        norm = update.pow(2).sum().sqrt()
        share = 1.0 if norm == 0 else min(1.0, (prelim.pow(2).sum().sqrt() / norm).item())
        factor = factor * share + (1.0 - share)
    factor = min(max(factor, factor_min), factor_max)
    return min(max(factor, last * (1.0 - threshold)), last * (1.0 + threshold))


def onebit_lamb(params: list[torch.Tensor], grad_fn: GradFn, steps: int, world: int, *, lr: float,
                freeze_step: int, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0,
                factor_min: float = 0.5, factor_threshold: float = 0.1,
                layers: list[list[tuple[str, int, int]]] | None = None) -> list[list[torch.Tensor]]:
    """1-bit LAMB: step 1 only initialises; LAMB with an EMA of each layer's trust ratio while
    fewer than ``max(freeze_step, 2)`` steps are done; then frozen variance, each worker's
    momentum scaled per layer and averaged compressed, a fresh variance from the reconstructed
    gradient, and the frozen trust ratio times a clamped factor. ``layers[i]`` names the layers
    inside tensor ``i`` (default: the tensor is one layer, ``param<i>``). As in DeepSpeed, the
    momenta of all tensors are compressed as one fused tensor, padded once, whose padding keeps
    the last decoded values."""
    beta1, beta2 = betas
    params = [p.detach().clone().float() for p in params]
    layers = layers or [[(f"param{i}", 0, p.numel())] for i, p in enumerate(params)]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    fresh = [torch.zeros_like(p) for p in params]
    freeze = {name: 0.0 for tensor in layers for name, _, _ in tensor}
    last_factor = dict.fromkeys(freeze, 1.0)
    scaling: dict[str, float] = {}
    # All momenta travel as one fused tensor, padded once; its padding keeps the last decoded values.
    total = sum(p.numel() for p in params)
    worker_errors, server_errors = _errors([torch.zeros(total)], world)
    fused_worker, fused_server = worker_errors[0], server_errors[0]
    padding = torch.zeros(fused_worker[0].numel() - total)
    history = []
    for step in range(1, steps + 1):
        grads = [grad_fn(step, r, params) for r in range(world)]
        compressed = step > 1 and step - 1 >= max(freeze_step, 2)
        if compressed and not scaling:  # each layer's momentum RMS (fp32) against their mean, once
            rms = {}
            for i, tensor in enumerate(layers):
                for name, lo, hi in tensor:
                    rms[name] = (torch.linalg.vector_norm(m[i][lo:hi]) / math.sqrt(hi - lo)).item()
            united = sum(rms.values()) / len(rms)
            scaling = {name: united / r if r > 0 else 1.0 for name, r in rms.items()}
        if compressed and step > 1:
            lasts = [t.clone() for t in m]
            local = []
            for g in grads:
                xs = []
                for i in range(len(params)):
                    x = m[i].clone().mul_(beta1).add_(g[i], alpha=1 - beta1)
                    for name, lo, hi in layers[i]:
                        x[lo:hi].mul_(scaling[name])
                    xs.append(x.reshape(-1))
                local.append(torch.cat(xs + [padding]))
            fused = compressed_average(local, fused_worker, fused_server) if world > 1 else local[0]
            at = 0
            for i, p in enumerate(params):
                m[i] = fused[at:at + p.numel()].clone().view_as(p)
                at += p.numel()
            padding = fused[at:].clone()
        for i, p in enumerate(params) if step > 1 else ():
            if not compressed:
                g = _mean(grads, i)
                m[i].mul_(beta1).add_(g, alpha=1 - beta1)
                v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if step == freeze_step:
                    fresh[i].copy_(v[i])
                update = m[i] / (v[i].sqrt() + eps)
                if weight_decay > 0.0:
                    update += weight_decay * p
                for name, lo, hi in layers[i]:
                    w, u = p[lo:hi].pow(2).sum().sqrt(), update[lo:hi].pow(2).sum().sqrt()
                    coeff = min(max((w / u).item(), min_coeff), max_coeff) if w != 0 and u != 0 else 1.0
                    if coeff != 1.0:
                        freeze[name] = coeff_beta * freeze[name] + (1 - coeff_beta) * coeff
                    p[lo:hi].add_(-lr * coeff * update[lo:hi])
                continue
            last = lasts[i]
            for name, lo, hi in layers[i]:
                m[i][lo:hi].div_(scaling[name])
            g = (m[i] - last * beta1) / (1 - beta1)
            fresh[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom, denom_real = v[i].sqrt() + eps, fresh[i].sqrt() + eps
            prelim = m[i] / denom
            update = prelim + weight_decay * p if weight_decay > 0.0 else prelim
            for name, lo, hi in layers[i]:
                last_factor[name] = _lamb_factor(denom[lo:hi] / denom_real[lo:hi], prelim[lo:hi], update[lo:hi],
                                                 weight_decay, last_factor[name], factor_min, factor_max,
                                                 factor_threshold)
                coeff = freeze[name] * last_factor[name]
                p[lo:hi].add_(-lr * coeff * update[lo:hi])
        history.append([p.clone() for p in params])
    return history
