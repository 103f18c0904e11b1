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


class LostResource(RuntimeError):
    """A process, actor, object or node that the attempt needed was lost. Not a ``RaydeepError``
    on purpose: a loss is transient, so Ray Train retries the attempt, which resumes from the
    newest memory snapshot or checkpoint."""


class NamedInputError(RaydeepError):
    """A user input that cannot work, named by its key or flag, with its value and a one-line fix.
    Deterministic: retrying cannot help, so a run fails once with this message."""

    def __init__(self, key: str, message: str, *, value: Any = _MISSING, fix: str | None = None):
        self.key, self.message, self.fix = key, message, fix
        self.value = None if value is _MISSING else value
        self._value_given = value is not _MISSING
        head = key if value is _MISSING else f"{key} = {value!r}"
        super().__init__(f"{head}: {message}" + (f". Fix: {fix}" if fix else ""))

    def __reduce__(self):
        # Raised in Ray workers and re-raised on the driver: keep the fields through pickling.
        kwargs = {"value": self.value, "fix": self.fix} if self._value_given else {"fix": self.fix}
        return (_rebuild, (type(self), (self.key, self.message), kwargs))


def _rebuild(cls: type, args: tuple, kwargs: dict) -> RaydeepError:
    return cls(*args, **kwargs)


class ConfigError(NamedInputError, ValueError):
    """A ds_config value raydeep cannot accept.

    >>> err = ConfigError("zero_optimization.stage", "must be 0..3", value=4, fix="set it to 3")
    >>> str(err)
    'zero_optimization.stage = 4: must be 0..3. Fix: set it to 3'
    """

    def __init__(self, key: str, message: str, *, value: Any = _MISSING, fix: str | None = None):
        # An empty key would print as ": message", which names nothing the user can search for.
        super().__init__(key_part(key) if isinstance(key, str) else key, message, value=value, fix=fix)


class ConfigErrors(ConfigError):
    """Several config problems reported together (e.g. every unresolved "auto")."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        keys = ", ".join(dict.fromkeys(e.key for e in errors))  # a union can fail twice at one key
        RaydeepError.__init__(self, "\n".join(str(e) for e in errors))
        self.key, self.message, self.fix, self.value = keys, str(self), None, None

    def __reduce__(self):
        return (type(self), (self.errors,))


class ElasticityError(ConfigError):
    """The current world size has no valid batch plan under the `elasticity` section."""


class CheckpointError(RaydeepError):
    """A checkpoint that cannot be loaded: missing, uncommitted, corrupt, or for another model.

    The message names the file and, for corruption, the expected and actual digests.
    """


class InputError(NamedInputError):
    """A run input other than the ds_config: a dataset, a model choice, a storage path.

    >>> str(InputError("--data", "no Parquet files in the directory", value="corpus/", fix="build one"))
    "--data = 'corpus/': no Parquet files in the directory. Fix: build one"
    """

    @property
    def name(self) -> str:
        """The flag that names the input (``--data``)."""
        return self.key


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose bytes are damaged or missing: a file that fails its sha256, an
    unreadable manifest, a file the manifest lists that is gone. An older committed checkpoint
    may still be intact, which is what a resume falls back to."""
