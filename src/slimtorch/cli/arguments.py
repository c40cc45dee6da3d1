"""The command line's one vocabulary: every option two commands share is added here, so it has one
spelling and one meaning everywhere (docs/concepts/command-line.md).

Nothing here imports torch: ``--help``, ``--version`` and a mistyped option answer at once. A value that
only torch knows (the machine's device) is resolved when the command runs.

A mistyped option, choice or command is answered with the closest valid spellings on the error line
(``unrecognized arguments: --shceme (did you mean --scheme?)``), and each command's ``--help`` ends with
the address of its page on the documentation site (:func:`guide_url`).

Numbers are checked where they are parsed (:func:`integer`, :func:`real`, :func:`size`, and
``model_input.shape``): whole where they count things, finite, within bounds a run can meet (a batch or an
input's elements within what this machine's memory holds). A bad one is a usage error: one line naming
the option and its bounds, exit 2, before any model is read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from slimtorch.cli.choices import GROUP_SIZES, SCHEMES
from slimtorch.cli.untrusted_text import printable
from slimtorch.errors import OptionError
from slimtorch.format.units import parse_size
from slimtorch.schemes import scheme

DOCS_URL = "https://slimtorch.github.io/slimtorch/"
"""The documentation site (mkdocs.yml's site_url); a page docs/how-to/NAME.md is at how-to/NAME/ there."""
SUGGEST_CUTOFF = 0.6
"""How alike a typed name and a valid one must be to be suggested (difflib's ratio, 0 to 1): --shceme and
--scheme are 0.88, --sheme and --scheme 0.92, --foo and --scheme 0.4."""
DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda if this machine has one, else cpu)"
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps")
MAX_COUNT = 2**31 - 1
"""the largest count an option takes where nothing bounds it more tightly (torch's sizes are int64, but
no count on the command line means anything past two billion)"""
MAX_BATCH = 2**16
"""the most samples a batch may have: far beyond any step's batch, the bound a slim recipe's batch has"""
MAX_RANKS = 2**16
"""the most ranks of --world-size: the largest clusters run tens of thousands of GPUs"""
MAX_SAMPLES = 1000
"""the most inputs a command compares models on: each is a run of both models"""
MAX_STEPS = 1_000_000
"""the most --steps: prune's passes toward its ratio and recover's optimizer steps share the option"""
MAX_SIZE = 2**60
"""the largest byte size a --budget or --shard-size takes (an exbibyte)"""


class Parser(argparse.ArgumentParser):
    """The ``slimtorch`` parser, and (as :class:`CommandParser`) each command's. A mistyped option, choice
    or command gets the closest valid spellings on its error line (:func:`did_you_mean`), the same on
    every Python (3.14's own ``suggest_on_error`` is left off). Every error line is shown through
    :func:`~slimtorch.cli.untrusted_text.printable`: it quotes what was typed, and a control character
    there is shown as an escape, never sent to the terminal. Options are matched whole, never by a
    prefix: ``--keep`` would otherwise be ``--keep-venv``, and a prefix that is unique today means another
    option tomorrow."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.suggest_on_error = False  # Python 3.14+: ours instead, so every Python says the same

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        """argparse's, with the options closest to each unrecognized one named on the error line. A
        command's unknown options reach here (the top level reports them), so they are matched against
        the options of the command that was given."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            typed = [arg for arg in extras if _looks_like_option(arg)]
            known = _options_of(_command_parser(self, parsed) or self)
            self.error(f"unrecognized arguments: {' '.join(extras)}{_suggestions(typed, known)}")
        return parsed

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """argparse's check of a value against ``choices`` (an option's, or the command's name), with the
        closest choices named right after the value typed."""
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            if not isinstance(value, str) or action.choices is None:
                raise
            hint = did_you_mean(value, [str(choice) for choice in action.choices])
            if not hint:
                raise
            message = exc.message
            where = message.find(" (choose from")
            where = len(message) if where < 0 else where
            raise argparse.ArgumentError(action, message[:where] + hint + message[where:]) from None

    def error(self, message: str) -> NoReturn:
        """argparse's usage and ``prog: error: message`` line, exit 2; the message shown as data."""
        super().error(printable(message))


class CommandParser(Parser):
    """A command's parser. A wrong value of an option (argparse's ``argument --batch: ...``) is one line,
    ``slimtorch: error: argument --batch: ...``, and exit 2, as every other error of a command is; a
    command called without what it needs, or with an option it does not know, keeps argparse's usage
    above the line, which is what helps there. Called without what it needs and with an option it does
    not know (``shrink m.pt --shceme int8-weight``, no ``-o``), the line names both, the unknown option
    with its closest spellings: argparse stops at the first and would never reach the typo."""

    _given: list[str]

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):
            unknown = self._unknown_options(getattr(self, "_given", []))
            if unknown:
                hint = _suggestions(unknown, _options_of(self))
                message = f"{message}; unrecognized arguments: {' '.join(unknown)}{hint}"
        if not message.startswith("argument "):
            super().error(message)
        self.exit(2, f"slimtorch: error: {printable(' '.join(message.split()))}\n")

    def _unknown_options(self, given: list[str]) -> list[str]:
        """The words of ``given`` argparse takes for options this command does not have (before ``--``;
        ``--name=value`` by its name, ``-oFILE`` as ``-o FILE``)."""
        known = _options_of(self)
        words = given[: given.index("--")] if "--" in given else given
        return [
            word
            for word in words
            if _looks_like_option(word)
            and word.split("=", 1)[0] not in known
            and not (word[1] != "-" and word[:2] in known)
        ]


def did_you_mean(typed: str, valid: Sequence[str]) -> str:
    """`` (did you mean X?)`` naming the valid name closest to ``typed`` (difflib's ratio, at least
    :data:`SUGGEST_CUTOFF`; names equally close are all named), or ``""`` when none is close.

    Example:
        >>> did_you_mean("--shceme", ["--scheme", "--skip", "--top"])
        ' (did you mean --scheme?)'
        >>> did_you_mean("--frobnicate", ["--scheme", "--skip"])
        ''
    """
    close = _closest(typed, valid)
    return f" (did you mean {_either(close)}?)" if close else ""


def _closest(typed: str, valid: Sequence[str]) -> list[str]:
    """The valid names closest to ``typed``: the best of difflib's matches, and any as close as it, in
    the order ``valid`` gives them."""
    import difflib  # only when a name was mistyped

    names = list(dict.fromkeys(valid))
    close = difflib.get_close_matches(typed, names, n=3, cutoff=SUGGEST_CUTOFF)
    ratios = {name: difflib.SequenceMatcher(None, typed, name).ratio() for name in close}
    return [name for name in names if name in ratios and ratios[name] == max(ratios.values())]


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _suggestions(typed: list[str], known: Sequence[str]) -> str:
    """The hint for unrecognized options: ``(did you mean --scheme?)`` for one with a close spelling,
    ``(did you mean --scheme for --shceme, --top for --tpo?)`` for several (``--name=value`` by its name)."""
    names = [word.split("=", 1)[0] for word in typed]
    found = [(name, close) for name in names if (close := _closest(name, known))]
    if not found:
        return ""
    if len(found) == 1:
        return f" (did you mean {_either(found[0][1])}?)"
    return f" (did you mean {', '.join(f'{_either(close)} for {word}' for word, close in found)}?)"


def _looks_like_option(word: str) -> bool:
    """Whether argparse reads ``word`` as an option's name (not a value such as ``-1`` or ``-``)."""
    if not word.startswith("-") or word == "-" or " " in word:
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False  # a negative number is a value


def _options_of(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions for name in action.option_strings]


def _command_parser(parser: argparse.ArgumentParser, parsed: Any) -> argparse.ArgumentParser | None:
    """The parser of the command ``parsed`` holds (``slimtorch shrink ...``: shrink's), if any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
            if isinstance(chosen, argparse.ArgumentParser):
                return chosen
    return None


def guide_url(command: str) -> str:
    """The address of ``command``'s how-to page (docs/how-to/COMMAND.md, in mkdocs' directory URLs).

    Example:
        >>> guide_url("shrink")
        'https://slimtorch.github.io/slimtorch/how-to/shrink/'
    """
    return f"{DOCS_URL}how-to/{command}/"


def add_command(
    commands: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` keeps the description's own line breaks (examples stay readable) and
    ends with its page's address (``Guide: https://.../how-to/NAME/``); its bad option values are one line
    where ``commands`` makes :class:`CommandParser` parsers (``main.py``)."""
    return commands.add_parser(
        name,
        help=help,
        description=description,
        epilog=f"Guide: {guide_url(name)}",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_output(
    parser: argparse.ArgumentParser, help: str, *, required: bool = True, metavar: str = "OUT"
) -> None:
    """``-o/--output``: where the command writes (checked by :func:`check_output` before any work)."""
    parser.add_argument("-o", "--output", required=required, metavar=metavar, help=help)


def add_json(parser: argparse.ArgumentParser, schema: str | None = None) -> None:
    """``--json``: the report's ``to_dict()`` on stdout instead of tables (progress and notes: stderr)."""
    named = f" (schema {schema})" if schema else ""
    parser.add_argument("--json", action="store_true", help=f"print the report as JSON{named}")


def add_device(parser: argparse.ArgumentParser, what: str) -> None:
    """``--device``: None unless given, resolved by the command to this machine's (:func:`machine_device`)."""
    parser.add_argument("--device", type=device_name, metavar="DEVICE", help=f"{what}: {DEVICE_HELP}")


def device_name(text: str) -> str:
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda, cuda:N or mps)")
    return text


def machine_device() -> str:
    """The default ``--device``: cuda if torch sees one, else cpu (asked only when a command runs)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_scheme(
    parser: argparse.ArgumentParser, offered: Sequence[str], help: str, default: str | None = None
) -> None:
    """``--scheme``: a quantization scheme, by the names ``slimtorch quantize`` uses; each command offers
    those it can do, each explained by its row's summary (:mod:`slimtorch.schemes`)."""
    assert set(offered) <= set(SCHEMES), offered
    explained = "; ".join(f"{name}: {scheme(name).summary}" for name in offered)
    parser.add_argument("--scheme", choices=tuple(offered), default=default, help=f"{help} ({explained})")


def add_skip(parser: argparse.ArgumentParser, help: str) -> None:
    """``--skip PATTERN ...``: names (glob patterns) left out of what the command does; repeatable."""
    parser.add_argument("--skip", nargs="+", action="extend", default=[], metavar="PATTERN", help=help)


def add_keep_embeddings(parser: argparse.ArgumentParser) -> None:
    """``--keep-embeddings``: embeddings stay at their precision."""
    parser.add_argument(
        "--keep-embeddings", action="store_true", help="do not quantize embeddings (nn.Embedding)"
    )


def add_layout(parser: argparse.ArgumentParser) -> None:
    """``--layout hf|slim``: the layout of a folder output."""
    parser.add_argument(
        "--layout",
        choices=("hf", "slim"),
        help="folder layout: hf (from_pretrained reads it; int8/int4 in the compressed-tensors format), "
        "slim (smallest; from_pretrained refuses it); default hf from a Hugging Face folder, else slim",
    )


def add_group_size(parser: argparse.ArgumentParser, default: int) -> None:
    """``--group-size``, checked while parsing by the rule every verb checks it with: a bad one is a usage
    error naming the option (exit 2), before any model is read."""
    parser.add_argument(
        "--group-size",
        type=group_size,
        default=default,
        metavar="G",
        help=f"int4 values per scale, even, 32 to 256 (default {default})",
    )


def group_size(text: str) -> int:
    """An int4 group size (``check_group_size``'s rule, without importing the codecs)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value not in GROUP_SIZES or value % 2:
        raise argparse.ArgumentTypeError(f"int4 group size must be even, 32 to 256, not {value!r}")
    return value


def size(text: str) -> int:
    """A size such as 24GB or 512MiB, in bytes: positive, finite, at most :data:`MAX_SIZE`."""
    try:
        value = parse_size(text)
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except (ValueError, OverflowError):  # nan, inf
        raise argparse.ArgumentTypeError(f"not a size: {_shown(text)}") from None
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SIZE:,} bytes (1 EiB), not {_shown(text)}")
    return value


def integer(low: int = 1, high: int = MAX_COUNT) -> Integer:
    """``type=`` for a whole number from ``low`` to ``high``.

    Example:
        >>> integer(1, 64)("8")
        8
        >>> integer(1, 64)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a whole number from 1 to 64, not '0'
    """
    return Integer(low, high)


def real(low: float = -math.inf, high: float = math.inf, *, above: bool = False, below: bool = False) -> Real:
    """``type=`` for a finite number from ``low`` to ``high`` (``above``/``below``: not the bound itself);
    nan and inf are refused whatever the bounds.

    Example:
        >>> real(0, 1, below=True)("0.5")
        0.5
        >>> real(0)("nan")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a finite number, at least 0, not 'nan'
    """
    return Real(low, high, above, below)


@dataclass(frozen=True)
class Integer:
    """A whole number within bounds, as a ``type=`` (a value, so two commands' options compare equal)."""

    low: int
    high: int

    def __call__(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = self.low - 1  # refused below, as a number out of bounds is
        if not self.low <= value <= self.high:
            raise argparse.ArgumentTypeError(
                f"must be a whole number from {self.low:,} to {self.high:,}, not {_shown(text)}"
            )
        return value


@dataclass(frozen=True)
class Real:
    """A finite number within bounds, as a ``type=``; ``above``/``below`` leave the bound itself out."""

    low: float
    high: float
    above: bool = False
    below: bool = False

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low, high = self.low, self.high
        inside = (value > low if self.above else value >= low) and (
            value < high if self.below else value <= high
        )
        if not math.isfinite(value) or not inside:
            parts = [
                f"{'above' if self.above else 'at least'} {low:g}" if low > -math.inf else "",
                f"{'below' if self.below else 'at most'} {high:g}" if high < math.inf else "",
            ]
            bounds = ", " + " and ".join(p for p in parts if p) if any(parts) else ""
            raise argparse.ArgumentTypeError(f"must be a finite number{bounds}, not {_shown(text)}")
        return value


def fraction(text: str) -> float:
    """A share: at least 0 and below 1 (a share of channels or weights to remove)."""
    return Real(0, 1, below=True)(text)


def machine_memory() -> int:
    """This machine's physical memory in bytes: no input larger than it can be made here."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a platform without sysconf: bound by int64 alone
        return 2**63 - 1


def _shown(text: str) -> str:
    """The value as the user gave it, in quotes, cut short if it is long (a 5,000-digit number)."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def add_allow_global(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="build one more pickle global for real, e.g. mypkg.Config, instead of keeping it as an inert "
        "placeholder (repeatable; only for files you trust)",
    )


def print_json(data: dict[str, Any]) -> None:
    """A report's ``to_dict()`` on stdout, indented, with a final newline."""
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_runs(parser: argparse.ArgumentParser) -> None:
    """``--runs``: the rounds of the interleaved before/after latency comparison (prune, quantize)."""
    parser.add_argument(
        "--runs",
        type=integer(0, MAX_SAMPLES),
        default=10,
        help="interleaved latency rounds, about 2 s in all (default 10; 0: none)",
    )
