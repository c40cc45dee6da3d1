"""The byte progress bar: silent off a terminal, shown only once work has lasted its delay."""

from __future__ import annotations

import io
import time

from rich.console import Console

from slimtorch.report.progress import ByteProgress


def test_silent_when_stderr_is_not_a_terminal(capsys) -> None:
    with ByteProgress("loading", 100) as bar:
        bar.advance(60)
        bar.advance(40)
    assert bar.done == 100 and bar._bar is None
    assert capsys.readouterr().err == ""


def _terminal() -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=80), screen


def test_on_a_terminal_the_bar_waits_for_its_delay_then_shows_the_bytes() -> None:
    console, screen = _terminal()
    bar = ByteProgress("loading", 1 << 20, delay=0.05, console=console)
    bar.advance(1 << 10)
    assert bar._bar is None  # quicker than the delay: nothing drawn
    time.sleep(0.06)
    bar.advance(1 << 19)
    assert bar._bar is not None
    bar.close()
    assert "loading" in screen.getvalue() and bar._bar is None


def test_enabled_false_silences_it_even_on_a_terminal() -> None:
    console, screen = _terminal()
    bar = ByteProgress("loading", 10, enabled=False, console=console)
    bar.advance(10)
    bar.close()
    assert bar._bar is None and screen.getvalue() == ""
