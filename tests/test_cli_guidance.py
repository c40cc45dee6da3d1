"""Help where users look (issue 48): every command's ``--help`` ends with the address of its how-to page,
and a mistyped option, choice or command is answered with the closest valid spelling on the error line.

The error lines are checked as a user meets them: ``python -m slimtorch`` in a fresh process, its stderr
and exit code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slimtorch.cli import shrink_cmd
from slimtorch.cli.arguments import DOCS_URL, did_you_mean, guide_url
from slimtorch.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
NAMES = [command.__name__.rpartition(".")[2].removesuffix("_cmd") for command in COMMANDS]


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def slimtorch(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "slimtorch", *argv], capture_output=True, text=True, env=env, timeout=60
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The error line, after checking it is the last line of stderr and the exit code is 2."""
    assert done.returncode == 2 and done.stdout == "", done
    return done.stderr.splitlines()[-1]


# -- --help ends with the page ------------------------------------------------------------------------------
def test_the_names_are_the_parsers_commands() -> None:
    found = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(found.choices) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_commands_help_ends_with_its_guide(name: str, capsys) -> None:
    last = help_text([name, "--help"], capsys).rstrip("\n").splitlines()[-1]
    assert last == f"Guide: https://slimtorch.github.io/slimtorch/how-to/{name}/"
    assert last == f"Guide: {guide_url(name)}"


def test_slimtorch_help_ends_with_the_sites_root(capsys) -> None:
    last = help_text(["--help"], capsys).rstrip("\n").splitlines()[-1]
    assert last.endswith(" https://slimtorch.github.io/slimtorch/") and DOCS_URL in last


def test_a_commands_help_keeps_its_descriptions_line_breaks(capsys) -> None:
    text = help_text(["shrink", "--help"], capsys)
    for line in shrink_cmd.DESCRIPTION.splitlines():
        assert f"{line}\n" in text, line


@pytest.mark.parametrize("name", NAMES)
def test_each_command_has_its_how_to_page(name: str) -> None:
    """The address --help prints is docs/how-to/NAME.md on the site: the page must be there."""
    assert (ROOT / "docs" / "how-to" / f"{name}.md").is_file()


def test_the_address_is_the_sites() -> None:
    """DOCS_URL is mkdocs.yml's site_url, whose pages are folders (how-to/NAME/, not how-to/NAME.html)."""
    config = (ROOT / "mkdocs.yml").read_text()
    site_url = re.search(r"^site_url:\s*[\"']?([^\s\"']+)", config, re.MULTILINE)
    assert site_url and site_url.group(1).rstrip("/") + "/" == DOCS_URL
    assert not re.search(r"^use_directory_urls:\s*false", config, re.MULTILINE)


# -- did you mean -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["shrink", "m.pt", "-o", "out", "--shceme", "int8-weight"],
            "slimtorch: error: unrecognized arguments: --shceme int8-weight (did you mean --scheme?)",
        ),
        (  # before the command, matched against the command's options (--debug is one of them)
            ["--degub", "inspect", "m.pt"],
            "slimtorch: error: unrecognized arguments: --degub (did you mean --debug?)",
        ),
        (
            ["inspect", "m.pt", "--tpo=3"],
            "slimtorch: error: unrecognized arguments: --tpo=3 (did you mean --top?)",
        ),
        (
            ["shrink", "m.pt", "-o", "out", "--shceme", "int8-weight", "--grup-size", "64"],
            "slimtorch: error: unrecognized arguments: --shceme int8-weight --grup-size 64 "
            "(did you mean --scheme for --shceme, --group-size for --grup-size?)",
        ),
    ],
)
def test_a_mistyped_option_is_answered_with_the_closest_one(argv: list[str], line: str) -> None:
    done = slimtorch(*argv)
    assert error_line(done) == line
    assert done.stderr.startswith("usage: slimtorch ")  # the usage above the line, as before


def test_a_mistyped_option_beside_a_missing_one_is_named_too() -> None:
    """argparse stops at the missing -o and would never mention the typo; the line names both."""
    done = slimtorch("shrink", "m.pt", "--shceme", "int8-weight")
    assert error_line(done) == (
        "slimtorch shrink: error: the following arguments are required: -o/--output; "
        "unrecognized arguments: --shceme (did you mean --scheme?)"
    )
    assert done.stderr.startswith("usage: slimtorch shrink ")


def test_a_mistyped_choice_is_answered_with_the_closest_one() -> None:
    done = slimtorch("shrink", "m.pt", "-o", "out", "--scheme", "int8-weigth")
    assert done.stderr == (  # one line, no usage: a wrong value of an option, as before
        "slimtorch: error: argument --scheme: invalid choice: 'int8-weigth' (did you mean int8-weight?) "
        "(choose from 'int8-weight', 'int4-weight')\n"
    )
    assert done.returncode == 2


def test_a_mistyped_command_is_answered_with_the_closest_one() -> None:
    line = error_line(slimtorch("shrnik", "m.pt"))
    assert line.startswith(
        "slimtorch: error: argument COMMAND: invalid choice: 'shrnik' (did you mean shrink?) (choose from "
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["inspect", "m.pt", "--frobnicate"], "slimtorch: error: unrecognized arguments: --frobnicate"),
        (["inspect", "m.pt", "other.pt"], "slimtorch: error: unrecognized arguments: other.pt"),
        (
            ["shrink", "m.pt", "-o", "out", "--scheme", "int3"],
            "slimtorch: error: argument --scheme: invalid choice: 'int3' "
            "(choose from 'int8-weight', 'int4-weight')",
        ),
        (["inspect"], "slimtorch inspect: error: the following arguments are required: PATH"),
    ],
)
def test_nothing_close_is_the_line_it_was(argv: list[str], line: str) -> None:
    assert error_line(slimtorch(*argv)) == line


def test_nothing_close_to_a_command_suggests_none() -> None:
    line = error_line(slimtorch("frobnicate"))
    assert "invalid choice: 'frobnicate'" in line and "did you mean" not in line


@pytest.mark.parametrize(
    ("typed", "shown"),
    [
        ("--dep\x1b[2Jth", "--dep\\x1b[2Jth (did you mean --depth?)"),  # ESC: an escape sequence
        ("--dep\u202eth", "--dep\\u202eth (did you mean --depth?)"),  # a bidi override
        ("--a\nb", "--a\\nb"),  # a newline: the line stays one line
        ("--x\x9b31m", "--x\\x9b31m"),  # a C1 CSI
    ],
)
def test_what_was_typed_is_shown_escaped(typed: str, shown: str) -> None:
    done = slimtorch("inspect", "m.pt", typed)
    assert error_line(done) == f"slimtorch: error: unrecognized arguments: {shown}"
    assert not {"\x1b", "\x9b", "\u202e"} & set(done.stderr)


def test_a_typed_choice_and_command_are_shown_escaped() -> None:
    for argv in (["shrink", "m.pt", "-o", "out", "--scheme", "int8-weigh\x1b[2J"], ["shr\x1b[2Jink"]):
        done = slimtorch(*argv)
        assert "\\x1b[2J" in error_line(done) and "\x1b" not in done.stderr


def test_suggesting_imports_no_torch() -> None:
    """--help and a mistyped name answer at once: nothing on the way imports torch."""
    argvs = [
        ["shrink", "m.pt", "-o", "out", "--shceme", "int8-weight"],
        ["shrink", "m.pt", "--shceme", "int8-weight"],
        ["shrink", "m.pt", "-o", "out", "--scheme", "int8-weigth"],
        ["shrnik"],
        ["shrink", "--help"],
    ]
    probe = (
        "import sys\nfrom slimtorch.cli.main import main\n"
        f"for argv in {argvs!r}:\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'rich')), "
        "file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]


def test_did_you_mean_names_the_closest_and_only_close_ones() -> None:
    assert did_you_mean("--shceme", ["--scheme", "--skip", "--top"]) == " (did you mean --scheme?)"
    assert did_you_mean("bsh", ["bash", "zsh", "fish"]) == " (did you mean bash?)"  # not zsh, less close
    assert did_you_mean("--frobnicate", ["--scheme", "--skip"]) == ""
    assert did_you_mean("abcd", ["abce", "abcf"]) == " (did you mean abce or abcf?)"  # equally close: both
