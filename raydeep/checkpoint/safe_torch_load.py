"""Load a ``torch.save`` file written by another program without running code from it.

``torch.load(weights_only=True)`` refuses any class the pickle names; here every such class is
mapped to an inert stand-in that only records its arguments and attributes, so files holding
e.g. DeepSpeed's loss scaler or enums load without DeepSpeed installed and without executing
anything. torch still refuses modules it considers dangerous (``os``, ``subprocess``...).
"""
from __future__ import annotations

import torch

from raydeep.errors import CheckpointError


class StandIn:
    """An inert replacement for a class a checkpoint names: it records the arguments it was
    called with (``args``; an enum member's value is ``args[0]``) and the attributes the pickle
    sets, and does nothing else."""

    source = "?"  # the dotted name the pickle used

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
            if isinstance(slots, dict):
                self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)

    @property
    def value(self):
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<stand-in for {self.source} args={self.args} {vars(self)}>"


_STAND_INS: dict[str, type] = {}


def _stand_in(name: str) -> type:
    if name not in _STAND_INS:
        _STAND_INS[name] = type(name.rsplit(".", 1)[-1], (StandIn,), {"source": name})
    return _STAND_INS[name]


def safe_load(path: str):
    """``torch.load`` of a DeepSpeed file with ``weights_only=True``; classes become stand-ins."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError, OSError) as err:
        raise CheckpointError(f"{path}: not a readable torch.save file ({err})") from err
    try:
        with torch.serialization.safe_globals([(_stand_in(name), name) for name in names]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # the weights-only unpickler raises several types for a hostile or broken file
        # torch's message is a page of advice; the line naming the refused global is the news.
        lines = [line for line in str(err).splitlines() if "GLOBAL" in line] or [str(err)[:500]]
        raise CheckpointError(f"{path}: cannot be loaded safely ({type(err).__name__}: {lines[0].strip()})") from err
