"""Strings from files we did not write, shown on a terminal as data, never as commands to it.

A tensor name, a metadata value, a path, a class name or an error quoting any of them can hold what a
terminal obeys: escape sequences (OSC 52 writes the clipboard, ``ESC [2J`` clears the screen, OSC 0 sets
the window title), C1 controls (``\\x9b`` is a CSI on its own), bidi overrides that make text read in
another order than it runs (Trojan Source), and rich markup (``[link=file:///etc/passwd]`` would become a
live OSC 8 hyperlink). Every such string goes through one of these three before it is printed:

- :func:`printable` for plain ``print``: each control character becomes a visible escape (``\\x1b``,
  ``\\u202e``); ``\\n``, ``\\r`` and ``\\t`` too, so a name stays on its line;
- :func:`as_text` for rich: the same, as a ``rich.text.Text``, which rich never reads as markup;
- :func:`in_markup` for a piece of a string rich reads as markup (a table title): escaped for markup too.

A backslash is left as it is, so a Windows path reads as itself. rich is imported only by the two that
need it: the command line's error line uses :func:`printable` without it.

Example:
    >>> printable("fc\\x1b]0;pwned\\x07.weight")
    'fc\\\\x1b]0;pwned\\\\x07.weight'
    >>> in_markup("[bold red]x")
    '\\\\[bold red]x'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

_C0 = range(0x00, 0x20)
_DEL_AND_C1 = range(0x7F, 0xA0)
# Bidi embeddings, overrides and isolates, the marks (ALM, LRM, RLM), and the line and paragraph
# separators some terminals break lines at.
_FORMATTING = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029)
_SHORT = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}


def _escape(code: int) -> str:
    if code in _SHORT:
        return _SHORT[code]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


_VISIBLE = {code: _escape(code) for code in (*_C0, *_DEL_AND_C1, *_FORMATTING)}


def printable(value: object) -> str:
    """``str(value)`` with every control character a terminal could act on written as a visible escape."""
    return str(value).translate(_VISIBLE)


def as_text(value: object, style: str = "") -> Text:
    """``value`` as rich text: control characters escaped, markup shown as the characters it is."""
    from rich.text import Text

    return Text(printable(value), style=style)


def in_markup(value: object) -> str:
    """``value`` to put inside a string rich reads as markup (``f"[bold]{in_markup(name)}[/]"``)."""
    from rich.markup import escape

    return escape(printable(value))
