"""The command line's conventions: one vocabulary, instant help, quiet pipes, one line on Ctrl-C,
``python -m slimtorch``, shell completion.

Every command's parser is walked, so a command added later is held to the same rules without a line
here: a shared option has one spelling and one meaning, a spelling renamed before 0.1.0 is refused
and never a command's own again, and ``--help`` imports no torch.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimtorch.cli import choices, inspect_cmd
from slimtorch.cli.arguments import group_size, machine_device
from slimtorch.cli.completion_cmd import SHELLS
from slimtorch.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
RETIRED = {"--quantize", "--no-embeddings", "--ignore", "--keep", "--batch-size"}
"""Spellings renamed before 0.1.0 (CHANGELOG.md): no command may take them again."""
SAME_EVERYWHERE = ("type", "nargs", "choices", "default", "const", "required")
"""What an option shared by commands must agree on, unless listed in PER_COMMAND."""
PER_COMMAND = {
    "--scheme": {"choices", "default"},  # each offers the schemes it can do, of one list
    "--dtype": {"choices"},  # load can also convert to fp32; shrink only stores smaller
    "--group-size": {"default"},  # shrink stores 32-value groups, quantize runs 128-value ones
    "--top": {"default", "type"},
    "--samples": {"default"},
    "--world-size": {"default", "type"},  # fit also takes auto
    "--budget": {"required"},  # fit's whole point; memory's optional check
    "--output": {"required"},  # ops prints to stdout without -o
    "--batch": {"nargs"},  # memory estimates several batch sizes at once, dataloader times one
    "--steps": {"default"},  # prune's steps toward its ratio (default 1); recover's optimizer steps
}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(found.choices)


def own_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's options, without --help."""
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_shared_option_has_one_spelling_and_one_meaning() -> None:
    spellings: dict[str, set[tuple[str, ...]]] = {}
    meanings: dict[str, dict[str, str]] = {}
    for command, parser in subcommands().items():
        for action in own_options(parser):
            spellings.setdefault(action.dest, set()).add(tuple(action.option_strings))
            name = action.option_strings[-1]
            free = PER_COMMAND.get(name, set())
            meaning = (
                action.dest,
                type(action).__name__,
                *(getattr(action, k) for k in SAME_EVERYWHERE if k not in free),
            )
            meanings.setdefault(name, {})[command] = repr(meaning)
    assert {dest: s for dest, s in spellings.items() if len(s) > 1} == {}
    differing = {name: by for name, by in meanings.items() if len(set(by.values())) > 1}
    assert differing == {}


def test_the_shared_vocabulary_is_where_the_docs_say() -> None:
    commands = subcommands()
    with_option = {
        name: {c for c, p in commands.items() for a in own_options(p) if name in a.option_strings}
        for name in ("--output", "--json", "--device", "--scheme", "--skip", "--keep-embeddings")
    }
    assert with_option["--device"] == {"load", "memory", "fit"}
    assert with_option["--scheme"] == {"shrink", "prune", "quantize", "export"}
    assert with_option["--skip"] == {"shrink", "prune", "quantize"}
    assert with_option["--keep-embeddings"] == {"shrink", "quantize"}
    assert with_option["--output"] == {"shrink", "prune", "quantize", "export", "ops", "recover"}
    assert with_option["--json"] == set(commands) - {"completion"}
    for command in with_option["--scheme"]:
        scheme = next(a for a in own_options(commands[command]) if a.dest == "scheme")
        assert set(scheme.choices) <= set(choices.SCHEMES), command
    page = (ROOT / "docs" / "concepts" / "command-line.md").read_text()
    section = page[page.index("## One vocabulary") :]
    section = section[: section.index("\n## ")]
    for name in with_option:
        assert f"| `{name}" in section or f"/{name} " in section, name


def test_no_command_uses_a_retired_spelling_as_its_own() -> None:
    for command, parser in subcommands().items():
        own = {s for a in own_options(parser) for s in a.option_strings}
        assert not own & RETIRED, command
    export = next(a for a in own_options(subcommands()["export"]) if "--format" in a.option_strings)
    assert export.dest == "format"  # --format is the bundle's format; a folder's layout is --layout


@pytest.mark.parametrize(
    "argv",
    [
        ["shrink", "m.pt", "-o", "o", "--quantize", "int8"],
        ["prune", "m:f", "-o", "o", "--ratio", "0.5", "--quantize", "int4"],
        ["export", "m:f", "-o", "o", "--quantize", "int8"],
        ["quantize", "m:f", "-o", "o", "--no-embeddings"],
        ["shrink", "m.pt", "-o", "o", "--format", "slim"],
        ["prune", "m:f", "-o", "o", "--ratio", "0.5", "--ignore", "a", "b"],
        ["dataloader", "m:d", "--batch-size", "8"],
        ["footprint", "b", "--keep", "v"],  # no prefix of --keep-venv: options are matched whole
    ],
)
def test_a_spelling_renamed_before_0_1_0_is_a_usage_error(argv, capsys) -> None:
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "unrecognized arguments" in err
    renamed = (RETIRED | {"--format"}) & set(argv)  # --format is export's own, a layout no longer
    assert any(option in err for option in renamed), err


def test_device_defaults_to_the_machine_everywhere(monkeypatch) -> None:
    for command in ("load", "memory", "fit"):
        device = next(a for a in own_options(subcommands()[command]) if a.dest == "device")
        assert device.default is None and "cuda if this machine has one, else cpu" in device.help
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert machine_device() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert machine_device() == "cuda"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["load", "m.pt", "--device", "gpu"])


def test_debug_before_the_command_is_kept_and_after_it_too() -> None:
    assert build_parser().parse_args(["--debug", "inspect", "m.pt"]).debug is True
    assert build_parser().parse_args(["inspect", "m.pt", "--debug"]).debug is True
    assert build_parser().parse_args(["inspect", "m.pt"]).debug is False


def test_the_copied_choices_match_the_packages_that_own_them() -> None:
    from slimtorch.data import TuneOptions
    from slimtorch.data.options import START_METHODS
    from slimtorch.format.codecs.lossy import INT4_GROUP_SIZE, INT4_GROUP_SIZES, check_group_size
    from slimtorch.format.policy import SHRINK_INT4_GROUP_SIZE
    from slimtorch.memory import OPTIMIZERS, PRECISIONS
    from slimtorch.memory.options import FIT_MARGIN, PARALLEL
    from slimtorch.models.examples import DEFAULT_SHAPE

    assert (choices.INT4_GROUP_SIZE, choices.SHRINK_INT4_GROUP_SIZE) == (
        INT4_GROUP_SIZE,
        SHRINK_INT4_GROUP_SIZE,
    )
    assert choices.GROUP_SIZES == INT4_GROUP_SIZES
    assert tuple(OPTIMIZERS) == choices.OPTIMIZERS and tuple(PRECISIONS) == choices.PRECISIONS
    assert (tuple(PARALLEL), FIT_MARGIN) == (choices.PARALLEL, choices.FIT_MARGIN)
    assert tuple(START_METHODS) == choices.START_METHODS and TuneOptions.budget_s == choices.TUNE_BUDGET_S
    assert tuple(DEFAULT_SHAPE) == choices.DEFAULT_SHAPE
    for value in range(0, 300):
        try:
            expected = check_group_size(value)
        except Exception:
            expected = None
        try:
            got = group_size(str(value))
        except argparse.ArgumentTypeError:
            got = None
        assert got == expected, value


def python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **kwargs.pop("env", {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, **kwargs)


TORCH_FREE_ARGV = (
    ["--help"],
    ["--version"],
    *([command.__name__.rpartition(".")[2].removesuffix("_cmd"), "--help"] for command in COMMANDS),
    ["shrink", "m.pt", "-o", "o", "--scheme", "int3"],
    ["quantize", "m:f", "-o", "o", "--group-size", "7"],
    ["no-such-command"],
    ["completion", "bash"],
)


@pytest.mark.slow
def test_help_version_completion_and_argument_errors_import_no_torch() -> None:
    probe = (
        "import sys\nfrom slimtorch.cli.main import main\n"
        f"for argv in {[list(a) for a in TORCH_FREE_ARGV]!r}:\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
    )
    done = python("-c", probe)
    assert "HEAVY []" in done.stderr, done.stderr[-2000:]
    timed = python("-X", "importtime", "-c", "import slimtorch.cli.main")
    imported = {line.rsplit("|", 1)[-1].strip() for line in timed.stderr.splitlines()}
    assert timed.returncode == 0 and "slimtorch.cli.main" in imported
    assert not {name for name in imported if name.split(".")[0] in ("torch", "rich")}


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_the_command_quietly_with_exit_0(tmp_path) -> None:
    checkpoint = tmp_path / "many.pt"
    torch.save({f"layer{i}.weight": torch.zeros(4) for i in range(400)}, checkpoint)
    for extra in ([], ["--json"]):
        reader = subprocess.Popen(
            [sys.executable, "-m", "slimtorch", "inspect", str(checkpoint), "--top", "400", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert reader.stdout.readline()  # then the reader goes, as `| head -1` does
        reader.stdout.close()
        assert reader.wait(timeout=120) == 0
        assert reader.stderr.read() == b""


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(inspect_cmd, "run", interrupted)
    assert main(["inspect", "m.pt"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "slimtorch: interrupted\n" and captured.out == ""


def test_python_dash_m_slimtorch_is_the_command_line() -> None:
    version = python("-m", "slimtorch", "--version")
    assert version.returncode == 0 and version.stdout.startswith("slimtorch ")
    usage = python("-m", "slimtorch", "inspect")
    assert usage.returncode == 2 and "usage: slimtorch inspect" in usage.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_completion_prints_each_shells_script_and_completes_every_command(shell, tmp_path, capsys) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    assert "slimtorch" in script and "_ARGCOMPLETE" in script
    names = {command.__name__.rpartition(".")[2].removesuffix("_cmd") for command in COMMANDS}
    assert completions(shell, "slimtorch ", tmp_path) >= names
    assert "--scheme" in completions(shell, "slimtorch shrink m.pt --sch", tmp_path)


def completions(shell: str, line: str, tmp_path: Path) -> set[str]:
    """What slimtorch answers a shell that asks how to complete ``line`` (as the printed script asks)."""
    answer = tmp_path / "completions"
    env = {
        "_ARGCOMPLETE": "1",
        "_ARGCOMPLETE_SHELL": shell,
        "_ARGCOMPLETE_STDOUT_FILENAME": str(answer),
        "COMP_LINE": line,
        "COMP_POINT": str(len(line)),
    }
    done = python("-m", "slimtorch", env=env)
    assert done.returncode == 0, done.stderr
    words = answer.read_text().replace("\x0b", "\n").splitlines()
    return {word.split("\t")[0].split(":")[0].strip() for word in words}


def test_completion_without_argcomplete_names_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "argcomplete", None)
    assert main(["completion", "fish"]) == 2
    assert "pip install argcomplete" in capsys.readouterr().err
