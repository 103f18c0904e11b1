"""Error types raised for user mistakes.

Every user-facing error names the offending key, the value it had and a one-line fix, so a
bad ds_config never ends in a traceback from deep inside the engine.
"""
from __future__ import annotations

from typing import Any

_MISSING = object()


def key_part(name: str) -> str:
    """One segment of a dotted key, made visible when it is empty or blank.

    >>> key_part("stage"), key_part("")
    ('stage', "'' (empty key)")
    """
    return name if name.strip() else f"{name!r} (empty key)"


def dotted_key(path: str) -> str:
    """A dotted config key with every empty segment made visible (``"a."`` -> ``"a.'' (empty key)"``)."""
    return ".".join(key_part(part) for part in path.split("."))


class RaydeepError(Exception):
    """Base class of raydeep's own errors."""


class ConfigError(RaydeepError, ValueError):
    """A ds_config value raydeep cannot accept.

    >>> err = ConfigError("zero_optimization.stage", "must be 0..3", value=4, fix="set it to 3")
    >>> str(err)
    'zero_optimization.stage = 4: must be 0..3. Fix: set it to 3'
    """

    def __init__(self, key: str, message: str, *, value: Any = _MISSING, fix: str | None = None):
        # An empty key would print as ": message", which names nothing the user can search for.
        key = key_part(key) if isinstance(key, str) else key
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
        keys = ", ".join(dict.fromkeys(e.key for e in errors))  # a union can fail twice at one key
        RaydeepError.__init__(self, "\n".join(str(e) for e in errors))
        self.key, self.message, self.fix, self.value = keys, str(self), None, None


class ElasticityError(ConfigError):
    """The current world size has no valid batch plan under the `elasticity` section."""


class CheckpointError(RaydeepError):
    """A checkpoint that cannot be loaded: missing, uncommitted, corrupt, or for another model.

    The message names the file and, for corruption, the expected and actual digests.
    """
