"""Strict construction of frozen dataclasses from parsed files.

Unknown keys are rejected with the key named, missing keys are named, and every error says which
file (or section of a file) it came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hrm.errors import HrmError


def check_keys(
    data: Any, *, where: str, required: set[str], optional: set[str] = frozenset()
) -> Mapping[str, Any]:
    """Return `data` as a mapping after checking it holds exactly the allowed keys."""
    if not isinstance(data, Mapping):
        raise HrmError(f"{where}: expected a mapping of keys to values, got {type(data).__name__}")
    unknown = sorted(set(data) - required - set(optional))
    if unknown:
        allowed = ", ".join(sorted(required | set(optional)))
        raise HrmError(f"{where}: unknown key {unknown[0]!r} (allowed: {allowed})")
    missing = sorted(required - set(data))
    if missing:
        raise HrmError(f"{where}: missing key {missing[0]!r}")
    return data


def dataclass_keys(cls: type) -> tuple[set[str], set[str]]:
    """(required, optional) field names of a dataclass: optional ones have defaults."""
    required, optional = set(), set()
    for f in dataclasses.fields(cls):
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        (optional if has_default else required).add(f.name)
    return required, optional


def positive_int(value: Any, *, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise HrmError(f"{where}: must be a positive integer, got {value!r}")
    return value


def positive_float(value: Any, *, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HrmError(f"{where}: must be a positive number, got {value!r}")
    return float(value)


def fraction(value: Any, *, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise HrmError(f"{where}: must be a fraction between 0 and 1, got {value!r}")
    return float(value)
