"""How :func:`slimtorch.inspect` looks at a checkpoint: :class:`InspectOptions`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slimtorch.errors import OptionError


@dataclass(frozen=True)
class InspectOptions:
    """What :func:`~slimtorch.inspection.breakdown.inspect` shows and reads.

    Example:
        >>> InspectOptions(depth=2, scan=False).top
        10
    """

    depth: int = 3
    """Depth of the module-prefix tree (``model.encoder.layer`` is depth 3)."""
    top: int = 10
    """How many of the largest tensors to list."""
    scan: bool = True
    """Read tensor data to count zeros and find duplicated storages (streamed, tensor by tensor); False
    reads only the file's structure: instant on any size, without sparsity or duplicate figures."""
    allow_globals: Sequence[str] = ()
    """Extra globals trusted in pickles, as for :func:`slimtorch.open` (a path only: an open source was
    read already)."""

    def __post_init__(self) -> None:
        for name, least in (("depth", 1), ("top", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise OptionError(f"{name} must be an integer, {least} or more, not {value!r}")
        if isinstance(self.allow_globals, str):  # one global, not its characters
            raise OptionError(f"allow_globals takes a list of names, not the string {self.allow_globals!r}")
        object.__setattr__(self, "allow_globals", tuple(self.allow_globals))
