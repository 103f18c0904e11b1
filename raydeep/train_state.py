"""The training counters, as one stateful part a checkpoint saves and restores.

>>> state = TrainState(micro_steps=8, global_steps=4, global_samples=64)
>>> restored = TrainState()
>>> restored.load_state_dict(state.state_dict())
>>> restored
TrainState(micro_steps=0, global_steps=4, global_samples=64, skipped_steps=0)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """How far training has come: micro-steps taken, optimizer steps (skipped ones included, as
    DeepSpeed counts them), samples consumed, and steps skipped for overflow."""

    micro_steps: int = 0
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint's manifest keeps (``counters``). Not ``micro_steps``, as in DeepSpeed:
        a checkpoint is taken at a step boundary, so the engine's boundaries do not depend on it."""
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.global_steps, self.global_samples = state["global_steps"], state["global_samples"]
        self.skipped_steps = state["skipped_steps"]  # micro_steps stays: DeepSpeed does not restore it
