"""Gradient unscale-and-clip arithmetic with DeepSpeed 0.19.8 semantics.

The engine computes each rank's local sum of squares with ``local_sq_norm``,
all-reduces it (SUM), takes the square root to get the norm of the *scaled*
gradients, and then multiplies every gradient by ``1 / clip_coefficient(...)``.
Folding the loss-scale division and the clip into one multiplier is what DeepSpeed
does, and doing it the same way keeps the rounding identical.

Example:
    >>> import torch
    >>> grads = [torch.tensor([3.0]), torch.tensor([4.0])]  # scaled by S = 2
    >>> total_norm = float(local_sq_norm(grads).sqrt())
    >>> combined = clip_coefficient(total_norm, loss_scale=2.0, clip=1.0)
    >>> [round(float(g / combined), 4) for g in grads]
    [0.6, 0.8]
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

# DeepSpeed adds this to the unscaled norm before dividing by the clip threshold.
CLIP_EPS = 1e-6


def clip_coefficient(total_norm: float, loss_scale: float, clip: float) -> float:
    """DeepSpeed's ``combined_scale``: gradients are multiplied by ``1 / combined_scale``.

    ``total_norm`` is the global L2 norm of the gradients *still multiplied by*
    ``loss_scale``. With ``c = (total_norm / S + 1e-6) / clip`` the result is ``c * S``
    when ``clip > 0`` and ``c > 1``, else ``S`` (only unscale). A NaN norm gives ``S``
    and an infinite one ``inf``; the engine skips such steps anyway.

    Example:
        >>> clip_coefficient(10.0, loss_scale=1.0, clip=1.0)  # clipped: 10 + 1e-6
        10.000001
        >>> clip_coefficient(0.5, loss_scale=4.0, clip=1.0)  # unclipped: unscale only
        4.0
        >>> clip_coefficient(10.0, loss_scale=4.0, clip=0.0)  # clipping disabled
        4.0
    """
    combined_scale = loss_scale
    if clip > 0:
        c = (total_norm / loss_scale + CLIP_EPS) / clip
        if c > 1:
            combined_scale = c * loss_scale
    return combined_scale


def unscaled_norm(total_norm: float, loss_scale: float) -> float:
    """The norm reported as the global gradient norm: ``total_norm / loss_scale``.

    Example:
        >>> unscaled_norm(8.0, 4.0)
        2.0
    """
    return total_norm / loss_scale


def local_sq_norm(tensors: torch.Tensor | Iterable[torch.Tensor | None]) -> torch.Tensor:
    """float64 sum of squares of ``tensors`` as a 0-d tensor; ``None`` entries are skipped.

    float64 keeps the sum exact enough that ranks can all-reduce (SUM) partial sums
    and take one square root without the result depending on the sharding. The result
    lives on the first tensor's device (CPU when there are none), ready to all-reduce.

    Example:
        >>> import torch
        >>> local_sq_norm([torch.tensor([3.0]), None, torch.tensor([[4.0]])])
        tensor(25., dtype=torch.float64)
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    total: torch.Tensor | None = None
    for t in tensors:
        if t is None:
            continue
        if t.is_sparse:
            t = t.coalesce()._values()
        sq = t.detach().to(torch.float64).pow(2).sum()
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    return total


def is_finite_norm(x: float | torch.Tensor) -> bool:
    """True when ``x`` (a Python number or a 1-element tensor) is neither inf nor NaN.

    Example:
        >>> is_finite_norm(3.0), is_finite_norm(float("nan")), is_finite_norm(torch.tensor(float("inf")))
        (True, False, False)
    """
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x).all())
    return math.isfinite(x)
