"""Unknown-key detection at every nesting level, with did-you-mean suggestions.

DeepSpeed ignores unknown top-level keys (``"gradient_clip": 1.0`` passes silently) and only some
sections forbid extras. raydeep walks the whole document against the section models first, so a
typo anywhere is reported with its dotted path and the closest valid spelling.
"""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import BaseModel

from raydeep.errors import ConfigError, key_part


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The Section class inside ``X``, ``X | None`` or ``Optional[X]``, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = section_type(arg)
            if found is not None:
                return found
    return None


def spellings(model: type[BaseModel]) -> dict[str, str]:
    """Map every accepted key (field name and alias) of ``model`` to its field name."""
    names = {}
    for name, info in model.model_fields.items():
        names[name] = name
        if info.alias:
            names[info.alias] = name
    return names


def suggest(key: str, candidates: list[str]) -> str | None:
    """The closest candidate to ``key``, or None when nothing is close."""
    if not key.strip():
        return None  # a blank key is "contained" in every candidate, so any guess would be noise
    same = [c for c in candidates if c.lower() == key.lower()]  # names are case-sensitive; say so first
    if same:
        return same[0]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not match:  # also catch prefix/suffix slips such as "max_live_parameters" vs "stage3_..."
        match = [c for c in candidates if key in c or c in key][:1]
    return match[0] if match else None


def unknown_key_error(path: str, key: str, candidates: list[str], where: str) -> ConfigError:
    """The error for an unknown ``key`` found at dotted ``path``."""
    guess = suggest(key, candidates)
    fix = f"did you mean {guess!r}?" if guess else f"remove it; valid keys in {where} are: {', '.join(sorted(candidates))}"
    return ConfigError(path, f"unknown key in {where}", fix=fix)


def check_keys(data: dict, model: type[BaseModel], prefix: str = "",
               skip: frozenset[str] = frozenset()) -> list[ConfigError]:
    """Every unknown key in ``data`` (recursively) against ``model``; ``skip`` lists keys handled elsewhere."""
    errors: list[ConfigError] = []
    names = spellings(model)
    where = prefix[:-1] or "the top level"
    for key, value in data.items():
        if key in skip:
            continue
        if key not in names:
            errors.append(unknown_key_error(prefix + key_part(key), key, list(names), where))
            continue
        sub = section_type(model.model_fields[names[key]].annotation)
        if sub is not None and isinstance(value, dict):
            errors += check_keys(value, sub, f"{prefix}{key}.")
    return errors
