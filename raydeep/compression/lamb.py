"""DeepSpeed's 1-bit LAMB as a torch optimizer: LAMB's layer-wise trust ratio on 1-bit Adam's
compressed momentum.

- The first ``step()`` only initialises (``step`` becomes 1), as in 1-bit Adam.
- **Warm-up** (until ``freeze_step``): exact LAMB as DeepSpeed wrote it, without bias
  correction: ``update = m / (sqrt(v) + eps) + wd * p`` and, per layer, the trust ratio
  ``||p|| / ||update||`` clamped to ``[min_coeff, max_coeff]``; an EMA of it (``coeff_beta``)
  becomes the *frozen* coefficient. At ``freeze_step`` the variance is copied into a *fresh*
  variance that keeps tracking the gradients afterwards.
- **Compressed stage**: ``v`` frozen; each rank's own momentum, each layer multiplied by its
  ``scaling_coeff`` (the mean of all layers' momentum RMS over its own, fixed at the first
  compressed step, so that one 1-bit scale fits every layer), all momenta averaged as ONE fused
  tensor with the compressed all-reduce (as DeepSpeed's ``exp_avg_flat``: padded once, the
  padding keeping the last decoded values), divided back. The gradient is reconstructed from the momentum change to
  update the fresh variance; the trust ratio is the frozen coefficient times a factor
  ``max(denominator / fresh denominator)`` (pulled towards 1 by the weight-decay share of the
  update), clamped to ``[factor_min, factor_max]`` and to ``factor_threshold`` of the last one.

A *layer* is one model parameter. raydeep's masters are flat buckets of several parameters, so
the optimizer tier names each bucket's parameter ranges (``set_layers``); a tensor given without
them is one layer. (DeepSpeed's fp16 wrapper flattened each parameter group into one tensor, so
under fp16 its "layer" was the whole group; in fp32 and bf16 it was each parameter, as here.)

The per-layer scalars (``lamb_coeff_freeze``, ``last_factor``, ``scaling_coeff``) are kept by
parameter name in ``layers``, so a checkpoint holds them whatever the layout. Unlike DeepSpeed,
loading a checkpoint keeps them (DeepSpeed reset them when it loaded in the warm-up).
"""
from __future__ import annotations

import math

import torch

from raydeep.compression.allreduce import CompressedAllReduce
from raydeep.compression.optimizers import _CompressedOptimizer

Layer = tuple[str, int, int]  # a parameter's name and its [lo, hi) in a master tensor


class OnebitLamb(_CompressedOptimizer):
    """DeepSpeed's 1-bit LAMB (see the module docstring).

    >>> p = torch.nn.Parameter(torch.ones(4))
    >>> opt = OnebitLamb([p], lr=0.1, freeze_step=2)
    >>> for _ in range(3):
    ...     p.grad = torch.ones(4); opt.step()
    >>> opt.steps_taken, opt.phase, sorted(opt.layers["param0"])
    (3, 'compressed', ['lamb_coeff_freeze', 'last_factor'])
    """

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, communicator: CompressedAllReduce | None = None):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff, amsgrad=amsgrad)
        super().__init__(params, defaults, communicator)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.layers: dict[str, dict[str, float]] = {}
        # This rank's fused exchange: its worker and server error and the padding (``_fused_average``).
        self.fused: dict[str, torch.Tensor] = {}
        self.lamb_coeffs: dict[str, float] = {}  # the trust ratio each layer used in the last step
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._layers = {p: [(f"param{i}", 0, p.numel())] for i, p in enumerate(all_params)}

    def set_layers(self, layers: dict[torch.nn.Parameter, list[Layer]]) -> None:
        """Name the model parameters inside each master tensor (the optimizer tier's buckets)."""
        self._layers.update(layers)

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio of each layer in the last step (DeepSpeed's accessor)."""
        return list(self.lamb_coeffs.values())

    def communicates_gradients(self) -> bool:
        steps = self.steps_taken  # as 1-bit Adam: after a non-initial step that reached freeze_step
        return steps >= 2 and steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        initialized, compressed = self.steps_taken > 0, self.communicates_gradients()
        if compressed and any("scaling_coeff" not in self._layer(name) for name in self._names()):
            self._fix_scaling_coeffs()
        work = []
        for group, p, state in self._params_with_grad():
            if "exp_avg_sq_fresh" not in state:
                state["exp_avg_sq_fresh"] = torch.zeros_like(p)
            state["step"] += 1
            if initialized:
                work.append((group, p, state))
        if compressed:
            self._compressed_updates(work)
        else:
            for group, p, state in work:
                self._warmup_update(group, p, state)
        return loss

    # --- the two phases -----------------------------------------------------------------------------
    def _warmup_update(self, group, p, state) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"].copy_(exp_avg_sq)
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"] > 0.0:
            update += group["weight_decay"] * p.data
        for name, lo, hi in self._layers[p]:
            weight_norm = p.data[lo:hi].pow(2).sum().sqrt()
            update_norm = update[lo:hi].pow(2).sum().sqrt()
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max((weight_norm / update_norm).item(), group["min_coeff"]), group["max_coeff"])
            layer = self._layer(name)
            if coeff != 1.0:
                layer["lamb_coeff_freeze"] = self.coeff_beta * layer["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
            self.lamb_coeffs[name] = coeff
            p.data[lo:hi].add_(-group["lr"] * coeff * update[lo:hi])

    def _compressed_updates(self, work) -> None:
        """Every parameter's momentum from its own gradient, scaled per layer, averaged as one
        fused tensor, then each updated with its frozen trust ratio."""
        self._check_variance(work)
        lasts = []
        for group, p, state in work:
            exp_avg, beta1 = state["exp_avg"], group["betas"][0]
            lasts.append(exp_avg.clone())
            exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            for name, lo, hi in self._layers[p]:
                exp_avg[lo:hi].mul_(self.layers[name]["scaling_coeff"])
        self._fused_average([state["exp_avg"] for _, _, state in work])
        for (group, p, state), last in zip(work, lasts):
            for name, lo, hi in self._layers[p]:
                state["exp_avg"][lo:hi].div_(self.layers[name]["scaling_coeff"])
            self._compressed_update(group, p, state, last)

    def _compressed_update(self, group, p, state, last: torch.Tensor) -> None:
        exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        beta1, beta2 = group["betas"]
        grad = (exp_avg - last * beta1) / (1 - beta1)
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.sqrt() + group["eps"]
        prelim = exp_avg / denom
        update = prelim + group["weight_decay"] * p.data if group["weight_decay"] > 0.0 else prelim
        denom_real = fresh.sqrt() + group["eps"]
        for name, lo, hi in self._layers[p]:
            layer = self._layer(name)
            factor = self._factor(group, layer, denom[lo:hi] / denom_real[lo:hi], prelim[lo:hi], update[lo:hi])
            coeff = layer["lamb_coeff_freeze"] * factor
            self.lamb_coeffs[name] = coeff
            p.data[lo:hi].add_(-group["lr"] * coeff * update[lo:hi])

    def _fused_average(self, momenta: list[torch.Tensor]) -> None:
        """Replace ``momenta`` by their compressed average over the ranks, compressed as DeepSpeed
        did: one tensor of them all, end to end, padded once (so one scale spans every layer, which
        the scaling coefficients make fit); the padding keeps the last decoded values, which enter
        the next step's scale, as DeepSpeed's padded buffer did."""
        if self.comm.world == 1 or not momenta:
            return
        total = sum(m.numel() for m in momenta)
        if self.fused.get("padding") is None or self.fused["padding"].numel() + total != \
                self.fused["worker_error"].numel():
            worker, server = self.comm.new_errors(total, momenta[0].device)
            self.fused = {"worker_error": worker, "server_error": server,
                          "padding": torch.zeros(worker.numel() - total, device=worker.device)}
        flat = torch.cat([m.reshape(-1) for m in momenta] + [self.fused["padding"]])
        (out,) = self.comm.average([flat], [(self.fused["worker_error"], self.fused["server_error"])])
        at = 0
        for m in momenta:
            m.copy_(out.narrow(0, at, m.numel()).view_as(m))
            at += m.numel()
        self.fused["padding"].copy_(out.narrow(0, at, out.numel() - at))

    def shared_rank_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.fused)

    def shared_rank_tensor_shape(self, key: str) -> torch.Size | None:
        total = sum(p.numel() for group in self.param_groups for p in group["params"])
        worker, server = self.comm.error_shapes(total)
        return {"worker_error": worker, "server_error": server,
                "padding": torch.Size([worker[0] - total])}.get(key)

    def load_shared_rank_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        device = next(p.device for group in self.param_groups for p in group["params"])
        self.fused = {k: v.to(device, copy=True) for k, v in tensors.items()}

    def reset_rank_state(self) -> None:
        super().reset_rank_state()
        self.fused = {}

    def _factor(self, group, layer: dict, ratio: torch.Tensor, prelim: torch.Tensor, update: torch.Tensor) -> float:
        """How much the frozen trust ratio is scaled this step: the largest growth of the
        denominator, weighted by the gradient share of the update, within its clamps."""
        factor = ratio.max().item()
        if group["weight_decay"] > 0.0:
            update_norm = update.pow(2).sum().sqrt()
            share = 1.0 if update_norm == 0 else min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
            factor = factor * share + (1.0 - share)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = layer["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        layer["last_factor"] = factor
        return factor

    # --- per-layer scalars --------------------------------------------------------------------------
    def _layer(self, name: str) -> dict[str, float]:
        return self.layers.setdefault(name, {"lamb_coeff_freeze": 0.0, "last_factor": 1.0})

    def _names(self) -> list[str]:
        return [name for layers in self._layers.values() for name, _, _ in layers]

    def _fix_scaling_coeffs(self) -> None:
        """At the first compressed step: each layer's momentum RMS against the mean RMS of all
        layers (from the momenta the warm-up left, the same on every rank), each RMS the fp32
        norm over the square root of the size, as DeepSpeed computed it."""
        pieces: dict[str, list[torch.Tensor]] = {}
        for p, layers in self._layers.items():
            exp_avg = self.state[p]["exp_avg"] if self.state.get(p) else torch.zeros_like(p)
            for name, lo, hi in layers:
                pieces.setdefault(name, []).append(exp_avg[lo:hi])
        rms = {}
        for name, parts in pieces.items():
            size = sum(t.numel() for t in parts)
            if len(parts) == 1:
                rms[name] = (torch.linalg.vector_norm(parts[0]) / math.sqrt(size)).item() if size else 0.0
            else:  # a layer in several pieces (not in raydeep's own layouts)
                rms[name] = math.sqrt(sum(t.double().pow(2).sum().item() for t in parts) / size) if size else 0.0
        united = sum(rms.values()) / len(rms)
        for name, value in rms.items():
            # A layer whose momentum is exactly zero (unused) keeps its scale: DeepSpeed divided by zero.
            self._layer(name)["scaling_coeff"] = united / value if value > 0 else 1.0
