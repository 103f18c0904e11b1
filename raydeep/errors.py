"""Error types raised for user mistakes.

Every user-facing error names the offending key, the value it had and a one-line fix, so a
bad ds_config never ends in a traceback from deep inside the engine.
"""
from __future__ import annotations

from typing import Any

_MISSING = object()


class RaydeepError(Exception):
    """Base class of raydeep's own errors."""


class ConfigError(RaydeepError, ValueError):
    """A ds_config value raydeep cannot accept.

    >>> err = ConfigError("zero_optimization.stage", "must be 0..3", value=4, fix="set it to 3")
    >>> str(err)
    'zero_optimization.stage = 4: must be 0..3. Fix: set it to 3'
    """

    def __init__(self, key: str, message: str, *, value: Any = _MISSING, fix: str | None = None):
        self.key, self.message, self.fix = key, message, fix
        self.value = None if value is _MISSING else value
        head = key if value is _MISSING else f"{key} = {value!r}"
        text = f"{head}: {message}"
        if fix:
            text += f". Fix: {fix}"
        super().__init__(text)


class ConfigErrors(ConfigError):
    """Several config problems reported together (e.g. every unresolved "auto")."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        keys = ", ".join(e.key for e in errors)
        RaydeepError.__init__(self, "\n".join(str(e) for e in errors))
        self.key, self.message, self.fix, self.value = keys, str(self), None, None


class ElasticityError(ConfigError):
    """The current world size has no valid batch plan under the `elasticity` section."""
