"""Progress: one protocol every verb reports to, and the command line's bar that stays out of the way."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from slimtorch.cli.progress import TerminalProgress
from slimtorch.errors import OptionError
from slimtorch.format.progress import Progress, Recorder, checked, task


def test_silent_when_stderr_is_not_a_terminal(capsys) -> None:
    with TerminalProgress() as bar:
        bar.begin("loading", 100)
        bar.advance(60)
        bar.advance(40)
        assert bar.done == 100 and not bar.drawing
    assert capsys.readouterr().err == ""


def _terminal() -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=80), screen


def test_on_a_terminal_the_bar_waits_for_its_delay_then_shows_the_bytes() -> None:
    console, screen = _terminal()
    bar = TerminalProgress(delay=0.05, console=console)
    bar.begin("loading", 1 << 20)
    bar.advance(1 << 10)
    assert not bar.drawing  # quicker than the delay: nothing drawn
    time.sleep(0.06)
    bar.advance(1 << 19)
    assert bar.drawing
    bar.end()
    assert "loading" in screen.getvalue() and not bar.drawing


def test_a_stage_without_a_count_is_a_spinner_at_once_and_the_next_task_ends_it() -> None:
    console, _ = _terminal()
    bar = TerminalProgress(console=console)
    bar.begin("translating to ONNX")
    assert bar.drawing
    bar.begin("checking outputs")
    bar.end()
    assert not bar.drawing


def test_enabled_false_silences_it_even_on_a_terminal() -> None:
    console, screen = _terminal()
    bar = TerminalProgress(enabled=False, console=console)
    bar.begin("loading", 10)
    bar.advance(10)
    bar.end()
    assert not bar.drawing and screen.getvalue() == ""


def test_task_ends_on_an_error_and_is_silent_without_a_reporter() -> None:
    recorder = Recorder()
    with pytest.raises(RuntimeError), task(recorder, "quantizing", 8) as advance:
        advance(3)
        raise RuntimeError("boom")
    assert recorder.events == [("begin", "quantizing", 8, "bytes"), ("advance", 3), ("end",)]
    with task(None, "quantizing", 8) as advance:
        advance(3)  # nobody watches: nothing happens, nothing fails


def test_the_terminal_bar_is_a_progress_and_a_bool_is_refused_with_what_to_pass() -> None:
    assert isinstance(TerminalProgress(), Progress) and checked(False) is None
    with pytest.raises(OptionError, match="TerminalProgress"):
        checked(True)
