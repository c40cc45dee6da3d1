"""A byte progress bar on stderr that stays out of the way: only on a terminal, only for long work."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn


class ByteProgress:
    """``advance(nbytes)`` as work gets done; a bar appears once ``delay`` seconds have passed.

    Silent when stderr is not a terminal (pipes, CI, tests) or ``enabled`` is False; the bar is removed
    when the work ends.

    Example:
        >>> with ByteProgress("loading", total=1 << 30) as progress:  # doctest: +SKIP
        ...     progress.advance(1 << 20)
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        delay: float = 0.0,
        enabled: bool | None = None,
        console: Console | None = None,
    ) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled and self.console.is_terminal
        self.label, self.total, self.delay = label, total, delay
        self.done = 0
        self._started = time.perf_counter()
        self._bar: Progress | None = None
        self._task = None

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        if self._bar is None:
            if time.perf_counter() - self._started < self.delay:
                return
            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.done)
            return
        self._bar.update(self._task, completed=self.done)  # type: ignore[arg-type]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StageStatus:
    """A spinner on stderr naming the current stage of long work (``status("translating to ONNX")``);
    silent off a terminal or when ``enabled`` is False.

    Example:
        >>> with StageStatus() as status:  # doctest: +SKIP
        ...     status("installing requirements.txt")
    """

    def __init__(self, *, enabled: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self._status = self.console.status("") if enabled and self.console.is_terminal else None

    @property
    def active(self) -> bool:
        """Whether a spinner shows (a terminal, and enabled)."""
        return self._status is not None

    def __call__(self, message: str) -> None:
        if self._status is not None:
            self._status.update(f"{message} ...")

    def __enter__(self) -> StageStatus:
        if self._status is not None:
            self._status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.stop()
