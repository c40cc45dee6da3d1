"""MODEL on the command line: the help text shared by every command; resolution lives in
:mod:`slimtorch.models.spec`, where the Python API finds it too."""

from __future__ import annotations

from slimtorch.models.spec import resolve_factory

SPEC_HELP = "the model: package.module:factory or path/to/file.py:factory (a class or a function)"

__all__ = ["SPEC_HELP", "resolve_factory"]
