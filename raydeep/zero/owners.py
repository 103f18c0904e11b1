"""Who can gather a partitioned parameter: the stage-3 strategy that owns its unit, or
``zero.Init``'s partitions before the engine is built. ``zero.GatheredParameters`` asks here.

A registry beside the parameters rather than an attribute on them: a torch ``Parameter`` stays
a plain parameter (copies, pickles and ``state_dict`` never carry raydeep's objects), and the
entry goes with the parameter (weak keys, compared by identity).
"""
from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

_OWNERS = WeakIdKeyDictionary()


def register(params, owner) -> None:
    """``owner`` (anything with a ``gathered(params)`` context manager) now gathers ``params``."""
    for p in params:
        _OWNERS[p] = owner


def owner_of(param):
    """The registered owner of ``param``, or None (a parameter that is not partitioned)."""
    return _OWNERS.get(param)


def forget(param, owner) -> None:
    """Drop ``param``'s entry if ``owner`` still holds it."""
    if _OWNERS.get(param) is owner:
        del _OWNERS[param]
