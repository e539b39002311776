"""Human-readable formatting of report numbers; every helper returns a dash for missing values."""

from __future__ import annotations

from typing import Any

from fedloom.report.rundir import num

MISSING = "—"
_BYTE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_bytes(value: Any) -> str:
    """``1536`` -> ``'1.54 kB'`` (decimal units like the plot axes, three significant digits)."""
    v = num(value)
    if v is None:
        return MISSING
    unit = 0
    while abs(v) >= 999.5 and unit < len(_BYTE_UNITS) - 1:
        v /= 1000
        unit += 1
    if unit == 0:
        return f"{v:.0f} B"
    digits = 2 if abs(v) < 10 else 1 if abs(v) < 100 else 0
    return f"{v:.{digits}f} {_BYTE_UNITS[unit]}"


def percent(value: Any, digits: int = 1) -> str:
    """``0.8123`` -> ``'81.2%'``."""
    v = num(value)
    return MISSING if v is None else f"{v * 100:.{digits}f}%"


def number(value: Any) -> str:
    """A loss or other plain number with four significant digits."""
    v = num(value)
    return MISSING if v is None else f"{v:.4g}"


def duration(value: Any) -> str:
    """Seconds as ``'0.42 s'``, ``'12.3 s'``, ``'4 min 05 s'`` or ``'2 h 03 min'``."""
    v = num(value)
    if v is None:
        return MISSING
    if v < 1:
        return f"{v:.2f} s"
    if v < 60:
        return f"{v:.1f} s"
    seconds = round(v)
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def integer(value: Any) -> str:
    """``12000`` -> ``'12,000'``; non-integral numbers and text are shown as they are."""
    v = num(value)
    if v is None:
        return MISSING if value is None else str(value)
    return f"{v:,.0f}" if v.is_integer() else f"{v:g}"
