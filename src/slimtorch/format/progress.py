"""How long work says how far it got: one protocol for every verb, drawn by whoever calls it.

A verb never draws anything itself. It takes ``progress``: None (silent, the default for a library) or any
object with :class:`Progress`'s three methods. The command line passes
:class:`slimtorch.cli.progress.TerminalProgress` (a bar on a terminal, only for work over a second); a
notebook or a service passes its own, a test a recorder.

One task runs at a time: :meth:`Progress.begin` names it and its total (bytes, steps, or None for a stage
with no count, such as "translating to ONNX"), :meth:`Progress.advance` adds what got done, and
:meth:`Progress.end` closes it. :func:`task` does the three around a block, so an error still ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from slimtorch.errors import OptionError

UNITS = ("bytes", "steps", "items")


@runtime_checkable
class Progress(Protocol):
    """What a verb reports while it works."""

    def begin(self, label: str, total: int | None = None, unit: str = "bytes") -> None:
        """A task starts: ``label`` names it, ``total`` is its size in ``unit`` (None: a stage, no count)."""

    def advance(self, amount: int = 1) -> None:
        """``amount`` more of the task's total got done."""

    def end(self) -> None:
        """The task is over (done, or given up on an error)."""


class Recorder:
    """A :class:`Progress` that keeps what it is told: ``(event, label or amount)`` tuples, for tests and
    for callers that draw after the fact.

    Example:
        >>> recorder = Recorder()
        >>> with task(recorder, "loading", 10) as advance:
        ...     advance(4)
        >>> recorder.events
        [('begin', 'loading', 10, 'bytes'), ('advance', 4), ('end',)]
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def begin(self, label: str, total: int | None = None, unit: str = "bytes") -> None:
        self.events.append(("begin", label, total, unit))

    def advance(self, amount: int = 1) -> None:
        self.events.append(("advance", amount))

    def end(self) -> None:
        self.events.append(("end",))

    @property
    def labels(self) -> list[str]:
        """The tasks begun, in order."""
        return [event[1] for event in self.events if event[0] == "begin"]


def checked(progress: object) -> Progress | None:
    """``progress`` as a verb takes it: None, False (silent) or a :class:`Progress`; anything else is an
    :class:`OptionError` that says what to pass (True draws nothing by itself in a library)."""
    if progress is None or progress is False:
        return None
    if isinstance(progress, Progress):
        return progress
    raise OptionError(
        f"progress must be None or an object with begin/advance/end, not {progress!r} "
        "(slimtorch.cli.progress.TerminalProgress() draws a bar on a terminal)"
    )


@contextmanager
def task(
    progress: Progress | None, label: str, total: int | None = None, unit: str = "bytes"
) -> Iterator[Callable[[int], None]]:
    """Run a block as one task of ``progress``; yields the function that advances it (a no-op when
    ``progress`` is None). The task ends however the block ends."""
    reporter = checked(progress)
    if reporter is None:
        yield _nothing
        return
    reporter.begin(label, total, unit)
    try:
        yield reporter.advance
    finally:
        reporter.end()


def _nothing(amount: int = 1) -> None:
    """Progress nobody watches."""


def announcer(progress: Progress | None) -> Callable[[str], None]:
    """The function that starts each named stage with no count ("installing requirements", "translating
    to ONNX") of a verb made of stages: each one ends the one before it (one task at a time), and the
    caller's :meth:`Progress.end` (a ``with TerminalProgress()`` block) ends the last."""
    reporter = checked(progress)
    return _unwatched if reporter is None else reporter.begin


def _unwatched(label: str) -> None:
    """A stage nobody watches."""
