"""Human-readable numbers."""

from __future__ import annotations

from slimtorch.errors import OptionError

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, three significant digits."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)} {unit}"
            return f"{value:.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"  # not 1e+03
        value /= 1024
    raise AssertionError("unreachable")


def format_share(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``: ``"12.5%"``."""
    return f"{100 * part / whole:.1f}%" if whole else "-"


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"2GB"`` -> ``2_000_000_000``, ``"512MiB"`` -> ``536870912``, ``"1e6"`` -> ``1000000``."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgtib")
    unit = cleaned[len(number) :]
    if unit not in _SIZE_UNITS:
        raise OptionError(f"unknown size unit in {text!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except ValueError:
        raise OptionError(f"not a size: {text!r}") from None
    if value <= 0:
        raise OptionError(f"size must be positive: {text!r}")
    return int(value)
