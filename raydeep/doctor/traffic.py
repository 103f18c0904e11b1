"""Communication per optimizer step, predicted from the config and the model's shape.

Bytes are counted as ``raydeep.comm.CommStats`` counts them (the all-reduced tensor, the
reduce-scatter input, the all-gather output), so a prediction can be checked against
``engine.comm_stats()``; ``ring_bytes`` is what each rank sends over a ring: ``2(N-1)/N`` of an
all-reduce, ``(N-1)/N`` of a reduce-scatter or all-gather.

Per optimizer step of ``G`` micro-steps, Psi elements of communication dtype:

* stage 0: one all-reduce of the gradients (Psi) at the boundary;
* stage 1: one reduce-scatter (Psi) at the boundary, one all-gather of the updated weights (Psi);
* stage 2: a reduce-scatter (Psi) every micro-step, one all-gather (Psi);
* stage 3: every micro-step gathers the partitioned weights for forward and again for backward,
  less what stays gathered in between (the blocks whose reuse distance, the elements fetched
  between their forward and their backward, is within ``stage3_max_reuse_distance``, and the root
  unit, used last in forward and first in backward), and reduce-scatters the gradients (Psi); the
  persistent parameters are re-gathered after the step.

>>> from raydeep.config import load_config
>>> from raydeep.doctor.shape import ModelShape
>>> cfg = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
...                    "zero_optimization": {"stage": 2}}, world_size=4)
>>> t = predict_traffic(cfg, ModelShape.from_counts(10**6, 2, 64, 16, 100))
>>> t.by_op["reduce_scatter"], t.by_op["all_gather"]
(8000000, 4000000)
"""
from __future__ import annotations

from dataclasses import dataclass

from raydeep.config.model import RaydeepConfig
from raydeep.doctor.stage3 import kept_between_passes, persistent_params
from raydeep.doctor.shape import ModelShape
from raydeep.estimate import PRECISION_BYTES



@dataclass(frozen=True)
class Traffic:
    by_op: dict[str, int]  # logical bytes per step, as CommStats counts them
    ring_bytes: int  # bytes each rank sends per step over a ring

    @property
    def total(self) -> int:
        return sum(self.by_op.values())


def predict_traffic(cfg: RaydeepConfig, shape: ModelShape) -> Traffic:
    """Bytes per optimizer step on each rank (see the module docstring)."""
    zero, n, gas = cfg.zero_optimization, cfg.world_size, cfg.gradient_accumulation_steps
    weights = PRECISION_BYTES[cfg.precision]
    grads = PRECISION_BYTES[cfg.communication_data_type or cfg.precision]
    psi = shape.params
    if n == 1:
        return Traffic({}, 0)
    ops: dict[str, int] = {}
    if zero.stage == 0:
        ops["all_reduce"] = grads * psi
    elif zero.stage in (1, 2):
        ops["reduce_scatter"] = grads * psi * (gas if zero.stage == 2 else 1)
        ops["all_gather"] = weights * psi
    else:
        persistent = persistent_params(cfg, shape)
        partitioned = psi - persistent
        kept = kept_between_passes(cfg, shape)
        root = max(0, partitioned - shape.layers * shape.block_params)
        backward = max(0, partitioned - root - kept * shape.block_params)
        ops["all_gather"] = weights * (gas * (partitioned + backward) + persistent)
        ops["reduce_scatter"] = grads * psi * gas
    share = (n - 1) / n
    ring = sum(int((2 * share if op == "all_reduce" else share) * b) for op, b in ops.items())
    return Traffic(ops, ring)
