"""The command line's one vocabulary: every option two commands share is added here, so it has one
spelling and one meaning everywhere (README, "The command line"), and a retired spelling keeps working
for one release with one line on stderr.

Nothing here imports torch: ``--help``, ``--version`` and a mistyped option answer at once. A value that
only torch knows (the machine's device) is resolved when the command runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from slimtorch.cli.choices import GROUP_SIZES, SCHEMES
from slimtorch.errors import OptionError
from slimtorch.format.units import parse_size

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda if this machine has one, else cpu)"
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps")


def add_command(
    commands: argparse._SubParsersAction,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A sub-command whose ``--help`` keeps the description's own line breaks (examples stay readable)."""
    return commands.add_parser(
        name,
        help=help,
        description=description,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


class DeprecatedOption(argparse.Action):
    """A retired spelling: does what its successor does, after one line on stderr naming it.

    ``values`` maps an old value to the new one (``--quantize int8`` -> ``--scheme int8-weight``); ``store``
    is the value a flag without an argument stores (``--no-embeddings`` -> ``keep_embeddings=True``)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        *,
        new: str,
        values: Mapping[str, str] | None = None,
        store: Any = None,
        extend: bool = False,
        **kwargs: Any,
    ) -> None:
        if values is not None:
            kwargs["choices"] = tuple(values)
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new, self.values_map, self.store, self.extend = new, values, store, extend

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # type: ignore[no-untyped-def]
        if self.nargs == 0:
            value, new = self.store, self.new
        elif self.values_map is not None:
            value = self.values_map[values]
            new = f"{self.new} {value}"
        else:
            value, new = values, self.new
        if self.extend:
            value = [*(getattr(namespace, self.dest, None) or []), *value]
        print(
            f"slimtorch: warning: {option_string} is deprecated, use {new} ({option_string} goes in the "
            "next release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, value)


def add_deprecated(parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any) -> None:
    """``old`` kept working for one release as ``new`` (see :class:`DeprecatedOption` for ``kwargs``)."""
    parser.add_argument(old, action=DeprecatedOption, dest=dest, new=new, default=argparse.SUPPRESS, **kwargs)


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
    those it can do."""
    assert set(offered) <= set(SCHEMES), offered
    parser.add_argument("--scheme", choices=tuple(offered), default=default, help=help)


def add_skip(parser: argparse.ArgumentParser, help: str) -> None:
    """``--skip PATTERN ...``: names (glob patterns) left out of what the command does; repeatable."""
    parser.add_argument("--skip", nargs="+", action="extend", default=[], metavar="PATTERN", help=help)


def add_keep_embeddings(parser: argparse.ArgumentParser) -> None:
    """``--keep-embeddings`` (retired: ``--no-embeddings``): embeddings stay at their precision."""
    parser.add_argument(
        "--keep-embeddings", action="store_true", help="do not quantize embeddings (nn.Embedding)"
    )
    add_deprecated(parser, "--no-embeddings", "--keep-embeddings", "keep_embeddings", nargs=0, store=True)


def add_layout(parser: argparse.ArgumentParser) -> None:
    """``--layout hf|slim`` (retired: ``--format``): the layout of a folder output."""
    parser.add_argument(
        "--layout",
        choices=("hf", "slim"),
        help="folder layout: hf (from_pretrained reads it; int8/int4 in the compressed-tensors format), "
        "slim (smallest; from_pretrained refuses it); default hf from a Hugging Face folder, else slim",
    )
    add_deprecated(parser, "--format", "--layout", "layout", values={"hf": "hf", "slim": "slim"})


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
    """A size such as 24GB or 512MiB, in bytes."""
    try:
        return parse_size(text)
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_allow_global(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-global",
        action="append",
        default=[],
        metavar="NAME",
        help="trust one more pickle global, e.g. mypkg.Config (repeatable; only for files you trust)",
    )


def print_json(data: dict[str, Any]) -> None:
    """A report's ``to_dict()`` on stdout, indented, with a final newline."""
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def add_runs(parser: argparse.ArgumentParser) -> None:
    """``--runs``: the rounds of the interleaved before/after latency comparison (prune, quantize)."""
    parser.add_argument(
        "--runs",
        type=int,
        default=10,
        help="interleaved latency rounds, about 2 s in all (default 10; 0: none)",
    )
