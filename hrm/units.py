"""Decimal and binary sizes, bandwidths and FLOP rates: parse from files, print for people.

Files hold "16 GB", "16GiB", "300 GB/s", "65 TFLOP/s" or plain numbers in SI base units (bytes,
bytes per second, FLOP per second); everything in memory is SI base units.
Convert only here.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from hrm.errors import HrmError

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

_NUMBER = r"(?P<num>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)"
_PREFIX = r"(?P<prefix>Ki|Mi|Gi|Ti|Pi|[kKMGTPE]?)"
_SIZE_RE = re.compile(rf"^{_NUMBER}\s*(?:{_PREFIX}(?:B|bytes?))?$")
_BANDWIDTH_RE = re.compile(rf"^{_NUMBER}\s*{_PREFIX}(?:B/s|Bps|bytes?/s)$")
_FLOPS_RE = re.compile(rf"^{_NUMBER}\s*{_PREFIX}(?:FLOP/s|FLOPS|flop/s|flops)$")


def _parse(value: object, pattern: re.Pattern, kind: str, example: str, field: str) -> float:
    if isinstance(value, bool):
        raise HrmError(f"{field}: {value!r} is not a {kind} (write it like {example!r})")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = pattern.match(value.strip())
        if match is None:
            raise HrmError(
                f"{field}: cannot read {value!r} as a {kind} (write it like {example!r})"
            )
        prefix = match.groupdict().get("prefix") or ""
        number = _scaled(match["num"], _BINARY.get(prefix) or _DECIMAL[prefix])
    else:
        raise HrmError(f"{field}: {value!r} is not a {kind} (write it like {example!r})")
    if not math.isfinite(number) or number <= 0:
        raise HrmError(f"{field}: {kind} must be positive and finite, got {value!r}")
    return number


def _scaled(digits: str, scale: float) -> float:
    """digits * scale, rounded once (Decimal), so that printing and parsing round-trip exactly."""
    try:
        return float(Decimal(digits) * Decimal(scale))
    except InvalidOperation:
        return math.nan


def parse_bytes(value: object, field: str = "size") -> float:
    """'16 GB' -> 16e9, '16GiB' -> 17179869184, 1e9 -> 1e9 (bytes)."""
    return _parse(value, _SIZE_RE, "size", "16 GB", field)


def parse_bandwidth(value: object, field: str = "bandwidth") -> float:
    """'300 GB/s' -> 3e11 bytes per second; a plain number is bytes per second."""
    return _parse(value, _BANDWIDTH_RE, "bandwidth", "300 GB/s", field)


def parse_flops(value: object, field: str = "FLOP rate") -> float:
    """'65 TFLOP/s' -> 6.5e13 FLOP per second; a plain number is FLOP per second."""
    return _parse(value, _FLOPS_RE, "FLOP rate", "65 TFLOP/s", field)


def _format(value: float, unit: str, digits: int | None) -> str:
    """With `digits`, rounded for people; without, exact: parsing the text gives `value` back."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0)):
        if abs(value) >= scale or scale == 1.0:
            if digits is not None:
                return f"{value / scale:.{digits}g} {prefix}{unit}"
            text = repr(value / scale).removesuffix(".0")
            if _scaled(text, scale) == value:
                return f"{text} {prefix}{unit}"
            return f"{repr(value).removesuffix('.0')} {unit}"
    raise AssertionError("unreachable")


def format_bytes(value: float, digits: int | None = 4) -> str:
    """16e9 -> '16 GB' (decimal prefixes, as files are written); digits=None for exact text."""
    return _format(value, "B", digits)


def format_bandwidth(value: float, digits: int | None = 4) -> str:
    return _format(value, "B/s", digits)


def format_flops(value: float, digits: int | None = 4) -> str:
    return _format(value, "FLOP/s", digits)


def format_duration(seconds: float) -> str:
    """12 ms, 2.5 s, 45 s, 3 min 20 s, 2 h 05 min: the units a person reads at a glance."""
    if seconds <= 0:
        return "0 s"
    if seconds < 0.0005:
        return "under 1 ms"
    if seconds < 0.9995:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2g} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def format_percent(fraction: float) -> str:
    """Whole percent; a share a rounding error put below zero reads 0%, never -0%."""
    return f"{round(100 * fraction)}%"
