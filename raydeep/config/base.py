"""The pydantic base of every config section, and element-count coercion.

Sections forbid unknown keys (the unknown-key walk in ``keys.py`` reports them first, with a
did-you-mean) and accept both a field's name and its DeepSpeed alias, as DeepSpeed's own
``DeepSpeedConfigModel`` does with ``populate_by_name``.
"""
from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


class Section(BaseModel):
    """A ds_config section: unknown keys forbidden, aliases and field names both accepted."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              use_enum_values=True)


def _element_count(value: Any) -> Any:
    # ds_configs write sizes as floats ("5e8", 1e9); DeepSpeed stores them as ints. Refuse
    # fractional or boolean values instead of truncating them silently.
    if isinstance(value, bool):
        raise ValueError("must be a number of elements, not a boolean")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError("must be a whole number of elements")
        return int(value)
    return value


def _strict_bool(value: Any) -> Any:
    # JSON true/false only: a stray "yes" or 1 in a flag is more likely a mistake than intent.
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


Count = Annotated[int, BeforeValidator(_element_count)]
Flag = Annotated[bool, BeforeValidator(_strict_bool)]
