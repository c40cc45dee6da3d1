"""A griffe extension for the docs site (mkdocs.yml loads it into mkdocstrings): our docstrings' reST, as
Markdown, so the API reference reads cleanly.

The docstrings are written for ``help()`` and for Sphinx-style readers: roles (:func:`open`,
:class:`~slimtorch.errors.FormatError`), double backticks, and ``text::`` before an indented literal block.
mkdocstrings renders Markdown, where a role would show as it is typed. Each docstring is rewritten once,
when griffe reads it (nothing is imported):

- a role is a code span of its target, or of the target's last dotted part when it starts with ``~``
  (``text <target>`` shows the text; a leading ``!`` is dropped);
- ``double backticks`` are single ones where the text holds no backtick (the same code span, read plainly);
- ``text::`` is ``text:`` and the indented block after it a fenced ``text`` block; a ``::`` alone on its line
  goes.

Two Google-style habits griffe's parser reads otherwise are made plain too: an ``Example:`` section is
``Examples:`` (griffe's name for the section whose ``>>>`` lines are code; ``Example:`` would be a box of
Markdown, where doctests turn into quotes), and an argument entry naming several parameters
(``strict, prefix, rename: ...``) is one entry for each, so each parameter is found in the signature.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|attr|exc|data|obj|const|type|ref|term|doc):`(?P<body>[^`]+)`"
)
DOUBLE = re.compile(r"(?<!`)``(?P<code>[^`]+?)``(?!`)")
EXPLICIT = re.compile(r"(?P<title>.*?)\s*<(?P<target>[^<>]+)>")
LITERAL = re.compile(r"(?P<lead>.*?)(?P<space>\s?)::$")
ARGS = re.compile(r"(?P<indent>\s*)(?:Args|Arguments|Parameters|Keyword Args|Keyword Arguments):")
SHARED = re.compile(r"(?P<names>\w+(?:,\s*\w+)+)(?P<rest>(?:\s*\(.*?\))?:\s.*)")


def role_text(body: str) -> str:
    """What a role shows: ``~a.b.c`` -> ``c``, ``title <target>`` -> ``title``, ``!name`` -> ``name``."""
    explicit = EXPLICIT.fullmatch(body)
    if explicit and explicit["title"]:
        return explicit["title"]
    body = body.lstrip("!")
    if body.startswith("~"):
        return body[1:].rsplit(".", 1)[-1]
    return body


def markdown(text: str) -> str:
    """``text`` (a docstring, reST-flavoured) as Markdown."""
    text = _literal_blocks(text)
    text = re.sub(r"(?m)^(\s*)Example:$", r"\1Examples:", text)
    text = _shared_entries(text)
    text = ROLE.sub(lambda m: f"`{role_text(m['body'])}`", text)
    return DOUBLE.sub(lambda m: f"`{m['code']}`", text)


def _literal_blocks(text: str) -> str:
    """``text::`` + an indented block -> ``text:`` + a fenced block (reST's literal block)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        match = LITERAL.fullmatch(line.rstrip())
        if not match or line.lstrip().startswith((">>>", "...")):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # no indented block follows: not a literal block
            out.append(line)
            i += 1
            continue
        lead = match["lead"]
        if lead.strip():
            out += [lead + ":", ""]
        pad = " " * indent
        block = textwrap.dedent("\n".join(lines[j:k])).split("\n")
        out += [pad + "```text", *(pad + row if row else row for row in block), pad + "```"]
        i = k
    return "\n".join(out)


def _shared_entries(text: str) -> str:
    """``a, b: what`` in an ``Args:`` section -> ``a: what`` and ``b: what`` (with its continuation lines)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        header = ARGS.fullmatch(lines[i].rstrip())
        i += 1
        if not header:
            continue
        base = len(header["indent"])
        item: int | None = None
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            line = lines[i]
            item = _indent(line) if item is None and line.strip() else item
            shared = SHARED.fullmatch(line.strip()) if line.strip() and _indent(line) == item else None
            if not shared:
                out.append(line)
                i += 1
                continue
            end = i + 1
            while end < len(lines) and lines[end].strip() and _indent(lines[end]) > (item or 0):
                end += 1
            for name in re.split(r",\s*", shared["names"]):
                out += [" " * (item or 0) + name + shared["rest"], *lines[i + 1 : end]]
            i = end
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class SphinxRoles(griffe.Extension):
    """Every docstring griffe reads, rewritten by :func:`markdown` before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
