"""Human-readable numbers."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, three significant digits."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``: ``"12.5%"``."""
    return f"{100 * part / whole:.1f}%" if whole else "-"
