"""The optimizer tier of the compressed-communication optimizers: where they take over the
gradient communication from the stage-0 strategy.

The strategy asks ``communicates_gradients()`` before each backward (the engine points its
``skip_reduction`` at it): in the warm-up it is False and gradients are all-reduced as usual; in
the compressed stage it is True, the strategy leaves each rank its own gradients, and the
optimizer averages what it needs with the compressed all-reduce. The engine then agrees on
overflow and clipping across the ranks, whose gradients now differ.

The masters, ``exp_avg`` and ``exp_avg_sq`` (and the step counters) are ordinary optimizer state
and go through the checkpoint's element ranges like any other; the error-feedback buffers (and
0/1 Adam's momentum accumulator) are this rank's own: ``rank_state`` hands them to the
checkpoint, which keeps them in the rank's file and gives them back only to the same rank of the
same world size.
"""
from __future__ import annotations

import logging

import torch

from raydeep.compression.allreduce import CompressedAllReduce
from raydeep.tier.local import LocalTier

logger = logging.getLogger("raydeep")


class CompressedTier(LocalTier):
    """A ``LocalTier`` whose optimizer (``OnebitAdam`` or ``ZeroOneAdam``) communicates."""

    def __init__(self, units, group_options, optimizer_cls: type, kwargs: dict, communicator: CompressedAllReduce,
                 sub_group_size: int):
        def make(groups):
            return optimizer_cls(groups, **kwargs, communicator=communicator)
        super().__init__(units, group_options, make, sub_group_size)
        self.compressor = communicator

    def communicates_gradients(self) -> bool:
        return self.optimizer.communicates_gradients()

    @property
    def phase(self) -> str:
        return self.optimizer.phase

    def step(self, grad_shards, scale):
        # One phase for the whole step, whatever the sub-groups: the optimizer reads it from its
        # own step counter, which the first sub-group advances.
        with self.optimizer.one_phase():
            super().step(grad_shards, scale)

    # --- rank-local state (error feedback) ---------------------------------------------------------
    def rank_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, param in enumerate(self.shards.params):
            for key, tensor in self.optimizer.rank_local.get(param, {}).items():
                out[f"chunk{i}.{key}"] = tensor
        return out

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None, why_not: str = "") -> None:
        self.optimizer.rank_local.clear()
        if tensors is None:
            if why_not:
                logger.warning("%s error feedback reset: %s", type(self.optimizer).__name__, why_not)
            return
        for i, param in enumerate(self.shards.params):
            prefix = f"chunk{i}."
            found = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if found:
                self.optimizer.rank_local[param] = {k: v.to(param.device, copy=True) for k, v in found.items()}

    def compression_report(self) -> dict:
        stats = self.compressor.stats.summary() if self.compressor.stats is not None else {}
        compressed = sum(v["bytes"] for k, v in stats.items() if k.startswith("compressed_"))
        return {"optimizer": type(self.optimizer).__name__, "phase": self.phase,
                "steps": self.optimizer.steps_taken, "compressed_bytes": compressed}
