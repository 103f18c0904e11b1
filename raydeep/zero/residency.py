"""What stage 3 keeps gathered, as pure rules on sizes: the builder applies them to a model's
parameters, the doctor to a model's shape, so the doctor predicts what the engine does.

>>> persistent([10, 500, 20, 30], param_threshold=100, model_threshold=40)
[True, False, True, False]
>>> blocks_kept_between_passes(layers=24, block_params=1000, max_reuse_distance=5000)
3
"""
from __future__ import annotations

from collections.abc import Iterable


def persistent(sizes: Iterable[int], param_threshold: int, model_threshold: int) -> list[bool]:
    """DeepSpeed's rule, in parameter order: a parameter of at most ``param_threshold`` elements
    stays gathered (a *persistent* unit) while the persistent elements so far stay within
    ``model_threshold`` (``stage3_param_persistence_threshold``, ``stage3_model_persistence_threshold``)."""
    budget, kept = model_threshold, []
    for n in sizes:
        small = n <= param_threshold and n <= budget
        if small:
            budget -= n
        kept.append(small)
    return kept


def blocks_kept_between_passes(layers: int, block_params: int, max_reuse_distance: int) -> int:
    """Blocks stage 3 keeps gathered from their forward to their backward: block ``i`` of
    ``layers`` is used again after about ``2 (layers - 1 - i)`` blocks' elements are fetched, and
    a unit is kept when its reuse comes within ``stage3_max_reuse_distance`` elements."""
    if block_params <= 0:
        return 0
    return min(layers, max_reuse_distance // (2 * block_params) + 1)
