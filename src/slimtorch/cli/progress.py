"""Progress on stderr that stays out of the way: only on a terminal, and a bar only for work over a second.

:class:`TerminalProgress` is the command line's :class:`slimtorch.format.progress.Progress`: a counted task
(bytes or steps) gets a bar once it has lasted ``delay`` seconds; a stage with no count (``total=None``)
gets a spinner naming it at once. Off a terminal (pipes, CI, tests) it draws nothing. Python users who
want the same bar pass ``progress=TerminalProgress()`` to any verb. A label may name a tensor or a file:
it is shown as data (:mod:`slimtorch.cli.untrusted_text`), never read as markup or a format string.
"""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.status import Status

from slimtorch.cli.untrusted_text import as_text, printable

DELAY_S = 1.0


class TerminalProgress:
    """Bars and spinners on stderr for the tasks a verb reports.

    Example:
        >>> import slimtorch  # doctest: +SKIP
        >>> slimtorch.load_model("big.safetensors", Net, progress=TerminalProgress())  # doctest: +SKIP
    """

    def __init__(
        self, *, delay: float = DELAY_S, enabled: bool = True, console: Console | None = None
    ) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.delay = delay
        self.label, self.unit, self.done = "", "bytes", 0
        self.total: int | None = None
        self._started = time.perf_counter()
        self._bar: Progress | None = None
        self._task: TaskID | None = None  # the bar's one task: set with the bar
        self._status: Status | None = None

    @property
    def drawing(self) -> bool:
        """Whether a bar or a spinner is on the screen now."""
        return self._bar is not None or self._status is not None

    def begin(self, label: str, total: int | None = None, unit: str = "bytes") -> None:
        self.end()
        self.label, self.total, self.unit, self.done = label, total, unit, 0
        self._started = time.perf_counter()
        if self.enabled and total is None:
            self._status = self.console.status(as_text(f"{label} ..."))
            self._status.start()

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        if not self.enabled or self.total is None:
            return
        if self._bar is None:
            if time.perf_counter() - self._started < self.delay:
                return
            counted = DownloadColumn(binary_units=True) if self.unit == "bytes" else MofNCompleteColumn()
            self._bar = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                counted,
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(printable(self.label), total=self.total, completed=self.done)
            return
        assert self._task is not None  # added when the bar was started
        self._bar.update(self._task, completed=self.done)

    def end(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._status is not None:
            self._status.stop()
            self._status = None

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end()
