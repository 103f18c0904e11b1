"""Stage 3's residency rules (``raydeep.zero.residency``, the engine's own) applied to a config
and a model's shape: what the memory plan and the traffic prediction both read."""
from __future__ import annotations

from raydeep.config.model import RaydeepConfig
from raydeep.doctor.shape import ModelShape
from raydeep.zero.residency import blocks_kept_between_passes, persistent


def persistent_params(cfg: RaydeepConfig, shape: ModelShape) -> int:
    """Stage 3's always-gathered elements, by the builder's rule over the model's tensors (or,
    for a model known only by its sizes, the biases and norms of each block)."""
    zero = cfg.zero_optimization
    sizes = list(shape.tensors.values()) if shape.tensors else _synthetic_small(shape)
    kept = persistent(sizes, zero.param_persistence_threshold, zero.model_persistence_threshold)
    return sum(n for n, small in zip(sizes, kept) if small)


def _synthetic_small(shape: ModelShape) -> list[int]:
    # A model known by its sizes: the biases and LayerNorms of each block and the final norm.
    h = shape.hidden
    return [3 * h, h, 4 * h, h, h, h, h, h] * shape.layers + [h, h]


def block_partitioned(cfg: RaydeepConfig, shape: ModelShape) -> int:
    """A block's partitioned elements (its stage-3 unit): its tensors above
    ``stage3_param_persistence_threshold``; for a model known by its sizes, the block less its
    share of the persistent parameters."""
    if shape.block_tensors:
        threshold = cfg.zero_optimization.param_persistence_threshold
        return sum(n for n in shape.block_tensors if n > threshold)
    return max(0, shape.block_params - persistent_params(cfg, shape) // max(1, shape.layers))


def root_partitioned(cfg: RaydeepConfig, shape: ModelShape) -> int:
    """The root unit's partitioned elements (embeddings, an untied head): what the blocks leave."""
    partitioned = shape.params - persistent_params(cfg, shape)
    return max(0, partitioned - shape.layers * block_partitioned(cfg, shape))


def kept_between_passes(cfg: RaydeepConfig, shape: ModelShape) -> int:
    """Blocks stage 3 keeps gathered from their forward to their backward."""
    return blocks_kept_between_passes(shape.layers, block_partitioned(cfg, shape),
                                      cfg.zero_optimization.max_reuse_distance, root_partitioned(cfg, shape))
