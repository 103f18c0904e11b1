"""What stage 3 keeps gathered, as pure rules on sizes: the builder applies them to a model's
parameters, the doctor to a model's shape, so the doctor predicts what the engine does.

>>> persistent([10, 500, 20, 30], param_threshold=100, model_threshold=40)
[True, False, True, False]
>>> blocks_kept_between_passes(layers=24, block_params=1000, max_reuse_distance=5000)
3
>>> blocks_kept_between_passes(layers=24, block_params=1000, max_reuse_distance=5000, root_params=1500)
2
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


def blocks_kept_between_passes(layers: int, block_params: int, max_reuse_distance: int, root_params: int = 0) -> int:
    """Blocks stage 3 keeps gathered from their forward to their backward. Stage 3 keeps a unit
    when the elements fetched before its next use in the trace are within
    ``stage3_max_reuse_distance``. Block ``i`` of ``layers`` is next used in its backward. Before
    that the trace runs the forward of the blocks after it, then the root's entry that opens
    backward, then the backward of those same blocks. That is ``2 (layers - 1 - i)`` blocks plus
    the root's ``root_params`` partitioned elements, which count although the root is still
    gathered (the trace counts a fetch's elements, not what it moves)."""
    if block_params <= 0 or max_reuse_distance < root_params:
        return 0
    return min(layers, (max_reuse_distance - root_params) // (2 * block_params) + 1)
