"""Where slimtorch keeps what it makes for this user on this machine: ``$XDG_CACHE_HOME/slimtorch``
(``~/.cache/slimtorch`` by default). The footprint baselines, numba's compiled kernels and the key that
signs a slim work folder's stage markers live there, never in the installed package's folder (which may
not be writable)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/slimtorch/<parts>`` (``~/.cache/slimtorch/...`` without the variable); not made.

    Example:
        >>> cache_folder("numba").parts[-2:]
        ('slimtorch', 'numba')
    """
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base, "slimtorch", *parts)
