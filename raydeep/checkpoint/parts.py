"""What a checkpoint is made of: the stateful parts of a training run, and the checkpoint's own
settings. The builder hands them over; a checkpoint never sees the engine.

Each part brings its own ``state_dict``/``load_state_dict`` (the optimizer tier, the loss
scaler, the LR scheduler, the train counters); the model contributes its buffers and frozen
parameters, and the FlatUnits the layout: which element ranges this rank holds. Held in another
process's memory instead of files, the same composition is an in-memory snapshot.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from raydeep.train_state import TrainState


class CopyFence:
    """Open unless an asynchronous save is still copying the states it saves: whatever is about
    to change the masters or optimizer states (the optimizer step, a write into the masters
    outside it) passes through ``wait`` first."""

    def __init__(self):
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait(self) -> None:
        self._open.wait()


@dataclass(frozen=True)
class CheckpointSettings:
    """The config's checkpoint options (``checkpoint``, ``raydeep.checkpoint_*``) and the resolved
    config, which the manifest records for a later reader."""

    fsync: bool = True
    tag_validation: str = "Warn"
    async_save: bool = False
    keep_last_k: int | None = None
    config: dict | None = None  # the resolved ds_config, as JSON

    @classmethod
    def from_config(cls, cfg) -> "CheckpointSettings":
        return cls(fsync=cfg.raydeep.checkpoint_fsync, tag_validation=cfg.checkpoint.tag_validation,
                   async_save=cfg.raydeep.checkpoint_async, keep_last_k=cfg.raydeep.checkpoint_keep_last_k,
                   config=cfg.model_dump(mode="json"))


@dataclass(frozen=True)
class CheckpointParts:
    """The stateful parts one rank saves and restores."""

    module: nn.Module  # buffers, frozen parameters and parameter shapes
    units: list  # FlatUnits: the layout (which ranges of which parameters this rank holds)
    tier: Any  # OptimizerTier: fp32 masters and optimizer states
    scaler: Any  # the loss scaler (fp16's is dynamic; others have no state)
    scheduler: Any | None  # the LR scheduler, if any
    train_state: TrainState
    publish: Callable[[], None]  # after a load: the tier's shards -> full parameters (collective)
    rank: int
    world_size: int
    device: torch.device
    stage: int
    precision: str
