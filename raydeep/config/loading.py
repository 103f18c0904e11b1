"""Reading a ds_config from any of the forms DeepSpeed accepts, and applying overrides.

Accepted: a dict, a path to a JSON/HJSON file (comments allowed, duplicate keys rejected), a
JSON string, or URL-safe base64 of JSON. Overrides are ``dotted.key=JSON`` strings (the CLI's
``--set``) or a mapping of dotted keys to values (``overrides=`` in Python).
"""
from __future__ import annotations

import base64
import binascii
import codecs
import copy
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import hjson

from raydeep.errors import ConfigError, dotted_key, key_part

AUTO = "auto"


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    dups = []
    for key, value in pairs:
        if key in seen:
            dups.append(key)
        seen[key] = value
    if dups:
        raise ConfigError(
            ", ".join(sorted(set(dups))),
            f"Duplicate keys in DeepSpeed config: {sorted(set(dups))}",
            fix="keep one occurrence of each key (JSON silently keeps the last one; raydeep refuses)",
        )
    return seen


def _parse_text(text: str, origin: str) -> dict:
    try:
        data = hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except ConfigError:
        raise
    except (hjson.HjsonDecodeError, ValueError) as exc:
        raise ConfigError(origin, f"is not valid JSON/HJSON: {exc}",
                          fix="check the syntax near the reported line") from None
    return _plain(data)


def _plain(value: Any) -> Any:
    """hjson returns OrderedDicts; normalise to plain dicts/lists for pydantic and printing."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def read_config(source: Any) -> dict:
    """Return the raw ds_config dict from a dict, file path, JSON string or base64 string.

    >>> read_config('{"train_batch_size": 8}')
    {'train_batch_size': 8}
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(_plain(source))
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise ConfigError("config", f"must be a dict, a path, JSON text or base64, not {type(source).__name__}",
                          fix="pass the ds_config dict or the path of ds_config.json")
    if os.path.isfile(source):
        return _require_object(_parse_text(_read_text(source), source), source)
    stripped = source.strip()
    if stripped.startswith("{"):
        return _require_object(_parse_text(stripped, "config"), "config")
    try:
        decoded = base64.urlsafe_b64decode(stripped.encode()).decode("utf-8")
        return _require_object(_parse_text(decoded, "config (base64)"), "config (base64)")
    except (binascii.Error, UnicodeDecodeError, ConfigError):
        pass
    raise ConfigError(
        "config",
        "Expected a string path to an existing deepspeed config, or a dictionary or a valid base64. "
        f"Received: {source[:120]!r}",
        fix="check the path exists (relative paths are resolved from the current directory)",
    )


def _read_text(path: str) -> str:
    """A config file's text: UTF-8 (a BOM allowed), or UTF-16 when it starts with a UTF-16 BOM."""
    with open(path, "rb") as fh:
        raw = fh.read()
    # Windows PowerShell's `>` writes UTF-16 with a BOM and Notepad may add a UTF-8 BOM; both are
    # unambiguous. Anything else that is not UTF-8 (Latin-1, ...) would only be a guess.
    encoding = "utf-16" if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "utf-8-sig"
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"is not {encoding.replace('-sig', '').upper()} text ({exc.reason} at byte {exc.start})",
                          fix="save the file as UTF-8") from None


def _require_object(data: Any, origin: str) -> dict:
    if not isinstance(data, dict):
        raise ConfigError(origin, f"must hold a JSON object at the top level, found {type(data).__name__}",
                          fix='wrap the settings in { ... }')
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """Split a ``dotted.key=JSON`` override; a value that is not JSON is taken as a string.

    >>> parse_override("zero_optimization.stage=3")
    ('zero_optimization.stage', 3)
    """
    if "=" not in text:
        raise ConfigError(dotted_key(text), "an override must look like dotted.key=VALUE",
                          fix="e.g. --set train_micro_batch_size_per_gpu=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(dotted_key(key), "an override needs a key before '='", value=text,
                          fix="e.g. --set optimizer.params.lr=3e-4")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: Mapping[str, Any] | Iterable[str] | None) -> dict:
    """Set each dotted key in ``data`` (creating intermediate sections as needed)."""
    if not overrides:
        return data
    items = overrides.items() if isinstance(overrides, Mapping) else (parse_override(o) for o in overrides)
    for dotted, value in items:
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None or child is True or child is False:
                # `"zero_optimization": true` style booleans become sections when overridden inside.
                child = {} if child is None else {"stage": int(child)} if part == "zero_optimization" else {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(dotted_key(dotted), f"cannot set a key inside {part!r}, which holds {child!r}",
                                  fix=f"override {part} as a whole instead")
            node = child
        node[parts[-1]] = value
    return data


def find_auto(data: Any, prefix: str = "") -> list[str]:
    """Every dotted key whose value is the string "auto"."""
    found: list[str] = []
    if isinstance(data, dict):
        for key, value in data.items():
            found += find_auto(value, f"{prefix}{key_part(key)}.")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += find_auto(value, f"{prefix}{i}.")
    elif data == AUTO:
        found.append(prefix[:-1])
    return found


def drop_auto(section: dict, path: str = "", keep: frozenset = frozenset()) -> list[str]:
    """Remove "auto" values from a section in place (DeepSpeed's pydantic sections do this),
    except at the dotted paths in ``keep`` (under ``path``), where "auto" is a real value."""
    dropped = []
    for key in list(section):
        value, here = section[key], f"{path}.{key}" if path else key
        if value == AUTO and here not in keep:
            del section[key]
            dropped.append(key)
        elif isinstance(value, dict):
            dropped += [f"{key}.{k}" for k in drop_auto(value, here, keep)]
    return dropped
