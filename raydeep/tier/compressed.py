"""The optimizer tier of the compressed-communication optimizers: where they take over the
gradient communication from the stage-0 strategy.

The strategy asks ``communicates_gradients()`` before each backward (the builder links its
``tier_communicates`` at it): in the warm-up it is False and gradients are all-reduced as usual; in
the compressed stage it is True, the strategy leaves each rank its own gradients, and the
optimizer averages what it needs with the compressed all-reduce. The engine then agrees on
overflow and clipping across the ranks, whose gradients now differ.

The masters, ``exp_avg`` and ``exp_avg_sq`` (and the step counters) are ordinary optimizer state
and go through the checkpoint's element ranges like any other; what is this rank's own (the
error-feedback buffers, 0/1 Adam's momentum accumulator and, during its local steps, the rank's
parameters and momentum: ``rank_tensors``) goes into the rank's file by chunk name (unit and
element range) and comes back only to the same rank of the same world size and layout, shapes
checked; otherwise it restarts, together with what depends on it, with one warning.
"""
from __future__ import annotations

import copy
import logging

import torch

from raydeep.compression.allreduce import CompressedAllReduce
from raydeep.tier.local import LocalTier

logger = logging.getLogger("raydeep")
_SHARED = "all"  # the rank-file prefix of what belongs to no one chunk (1-bit LAMB's fused exchange)


class CompressedTier(LocalTier):
    """A ``LocalTier`` whose optimizer (``OnebitAdam``, ``ZeroOneAdam`` or ``OnebitLamb``) communicates.

    1-bit LAMB's trust ratio is per model parameter, so its masters are whole units (a parameter
    is never cut by ``sub_group_size``) and the tier names each parameter's range in them.
    """

    def __init__(self, units, group_options, optimizer_cls: type, kwargs: dict, communicator: CompressedAllReduce,
                 sub_group_size: int):
        def make(groups):
            return optimizer_cls(groups, **kwargs, communicator=communicator)
        layer_wise = hasattr(optimizer_cls, "set_layers")
        if layer_wise and 0 < sub_group_size < max((u.local.numel() for u in units), default=0):
            logger.warning("zero_optimization.sub_group_size %d has no effect with %s: its trust ratio is per "
                           "parameter, so each bucket is updated whole", sub_group_size, optimizer_cls.__name__)
        # 1-bit LAMB steps every unit whole and all in one sub-group: its momenta are compressed
        # as one fused tensor, which one ``step()`` call must see.
        whole = max(sum(u.local.numel() for u in units), 1)
        super().__init__(units, group_options, make, whole if layer_wise else sub_group_size)
        self.compressor = communicator
        if layer_wise:
            self.optimizer.set_layers(self._parameter_ranges())

    def _parameter_ranges(self) -> dict:
        """Per master (one whole unit each, see ``__init__``): each model parameter's name and
        ``[lo, hi)`` inside it."""
        out = {}
        for param, c in zip(self.shards.params, self.shards.chunks):
            unit = self.units[c.unit]
            assert c.lo == 0 and c.hi == unit.local.numel(), "1-bit LAMB steps whole units"
            base = unit.layout.shard_range(unit.rank)[0]
            out[param] = [(slot.name, slot.offset + s - base, slot.offset + e - base)
                          for slot, s, e in unit.layout.pieces_of_rank(unit.rank)]
        return out

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

    # --- 1-bit LAMB's per-parameter scalars travel with group 0's scalar states (JSON, by name) ------
    def _export(self, ranges, with_optimizer):
        segments, dtypes, scalars = super()._export(ranges, with_optimizer)
        layers = getattr(self.optimizer, "layers", None)
        if with_optimizer and layers is not None:
            scalars.setdefault(0, {})["layers"] = {"value": copy.deepcopy(layers), "tensor": False}
        return segments, dtypes, scalars

    def _import(self, pieces, scalars) -> None:
        if scalars is not None and hasattr(self.optimizer, "layers"):
            scalars = [dict(s) for s in scalars]
            saved = scalars[0].pop("layers", None) if scalars else None
            self.optimizer.layers = copy.deepcopy(saved["value"]) if saved else {}
        super()._import(pieces, scalars)

    # --- rank-local state (error feedback) ---------------------------------------------------------
    def _chunk_names(self) -> list[str]:
        """Each master's name in a rank file: its unit and element range, so a checkpoint
        written with another ``sub_group_size`` or bucket layout is told apart, not misread."""
        return [f"unit{c.unit}.{c.lo}-{c.hi}" for sg in self.sub_groups for c in sg]

    def rank_state(self) -> dict[str, torch.Tensor]:
        out = {f"{_SHARED}.{key}": tensor for key, tensor in self.optimizer.shared_rank_tensors().items()}
        for name, param in zip(self._chunk_names(), self.shards.params):
            for key, tensor in self.optimizer.rank_tensors(param).items():
                out[f"{name}.{key}"] = tensor
        return out

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None, why_not: str = "") -> None:
        """Take this rank's own state back, all of it or (another world size or layout) none:
        what cannot be carried restarts together, with one warning."""
        what = type(self.optimizer).__name__ + " " + self.optimizer.rank_state_description
        if tensors is not None and (mismatch := self._match(tensors)):
            tensors, why_not = None, (f"the checkpoint was saved with another layout of the optimizer's chunks "
                                      f"({mismatch}), so this rank's own state cannot be matched to this run's")
        if tensors is None:
            self.optimizer.reset_rank_state()
            if why_not:
                logger.warning("%s reset: %s", what, why_not)
            return
        self.optimizer.rank_local.clear()
        self.optimizer.load_shared_rank_tensors({k.removeprefix(_SHARED + "."): v for k, v in tensors.items()
                                                 if k.startswith(_SHARED + ".")})
        for name, param in zip(self._chunk_names(), self.shards.params):
            prefix = name + "."
            found = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if found:
                self.optimizer.load_rank_tensors(param, found)
        if any(k.rpartition(".")[2] == "params" for k in tensors):  # each rank's own parameters, published
            self._write_params([c for sg in self.sub_groups for c in sg])

    def _match(self, tensors: dict[str, torch.Tensor]) -> str:
        """Why ``tensors`` do not fit this run's chunks ('' when they do)."""
        by_name = dict(zip(self._chunk_names(), self.shards.params))
        for key, tensor in tensors.items():
            name, _, kind = key.rpartition(".")
            param = by_name.get(name)
            if name == _SHARED:
                expected = self.optimizer.shared_rank_tensor_shape(kind)
            elif param is None:
                return f"{key} names no chunk of this run"
            else:
                expected = self.optimizer.rank_tensor_shape(param, kind)
            if expected is None or tuple(tensor.shape) != tuple(expected):
                return f"{key} has shape {tuple(tensor.shape)}, this run's is {tuple(expected or ())}"
        return ""

    def compression_report(self) -> dict:
        stats = self.compressor.stats.summary() if self.compressor.stats is not None else {}
        compressed = sum(v["bytes"] for k, v in stats.items() if k.startswith("compressed_"))
        return {"optimizer": type(self.optimizer).__name__, "phase": self.phase,
                "steps": self.optimizer.steps_taken, "compressed_bytes": compressed}
