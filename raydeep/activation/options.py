"""What a checkpointed region does besides recomputing: DeepSpeed's ``activation_checkpointing``
options, resolved once into :class:`CheckpointOptions`.

One object per source: the engine builds one from the ds_config's section for the modules it
wraps; ``deepspeed.checkpointing.configure`` builds the one the model's own ``checkpoint`` calls
use. Each option's effect lives in its own module:

- ``cpu_checkpointing`` and ``contiguous_memory_optimization``: where the region's saved inputs
  live (:mod:`raydeep.activation.boundary_store`);
- ``number_checkpoints``: how many of the selected modules are wrapped (:mod:`raydeep.activation.wrap`);
- ``synchronize_checkpoint_boundary`` and ``profile``: the device synchronisation and timings around
  each region (:mod:`raydeep.activation.timing`).

>>> CheckpointOptions.from_section({"cpu_checkpointing": True, "number_checkpoints": 4}).cpu_checkpointing
True
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointOptions:
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @classmethod
    def from_section(cls, section: Any) -> "CheckpointOptions":
        """From an ``ActivationCheckpointingConfig``, or a dict of its keys (absent keys: DeepSpeed's defaults)."""
        get = section.get if isinstance(section, dict) else lambda key, default=None: getattr(section, key, default)
        return cls(cpu_checkpointing=bool(get("cpu_checkpointing", False)),
                   contiguous_memory_optimization=bool(get("contiguous_memory_optimization", False)),
                   number_checkpoints=get("number_checkpoints", None),
                   synchronize_checkpoint_boundary=bool(get("synchronize_checkpoint_boundary", False)),
                   profile=bool(get("profile", False)))

    @property
    def stores_inputs(self) -> bool:
        """True when the saved inputs are placed by raydeep rather than kept where autograd has them."""
        return self.cpu_checkpointing or self.contiguous_memory_optimization
