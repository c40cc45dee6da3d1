"""`slimtorch completion bash|zsh|fish`: the shell's tab completion of commands, options and their values.

Through argcomplete: the script a shell sources is a few lines that ask ``slimtorch`` itself what fits
the word under the cursor, so completion never goes stale after an upgrade, and the answer comes from
the same parser as ``--help`` (which imports no torch: about 0.1 s a tab).
"""

from __future__ import annotations

import argparse
import sys

from slimtorch.cli.arguments import add_command
from slimtorch.errors import SlimtorchError

SHELLS = ("bash", "zsh", "fish")
HELP = "print the shell code that completes slimtorch's commands and options (bash, zsh, fish)"
DESCRIPTION = """\
Prints the code that makes your shell complete slimtorch's commands, options and choices on TAB.
Load it once in the current shell, or add that line to the shell's start-up file:

examples:
  eval "$(slimtorch completion bash)"        # bash: in ~/.bashrc
  eval "$(slimtorch completion zsh)"         # zsh: in ~/.zshrc, after compinit
  slimtorch completion fish | source         # fish: or > ~/.config/fish/completions/slimtorch.fish
"""
INSTALL = "pip install argcomplete (a dependency of slimtorch: reinstall slimtorch to get it)"


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "completion", HELP, DESCRIPTION)
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(script(args.shell))
    return 0


def script(shell: str, program: str = "slimtorch") -> str:
    """The code ``shell`` sources to complete ``program``.

    Example:
        >>> "slimtorch" in script("fish")
        True
    """
    return _argcomplete().shellcode([program], shell=shell)


def complete(parser: argparse.ArgumentParser) -> None:
    """Answer a shell's completion request (the environment names the word) and exit; the scripts
    :func:`script` prints call ``slimtorch`` this way. Without argcomplete there is no answer to give
    (the scripts come from it), and stderr goes nowhere then: the shell just completes nothing."""
    try:
        import argcomplete
    except ImportError:
        return
    argcomplete.autocomplete(parser)


def _argcomplete():
    try:
        import argcomplete
    except ImportError:
        raise SlimtorchError(f"shell completion needs argcomplete: {INSTALL}") from None
    return argcomplete
