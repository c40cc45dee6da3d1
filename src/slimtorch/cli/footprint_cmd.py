"""`slimtorch footprint BUNDLE`: what a deployment bundle's runtime costs on disk, beside torch's, and
whether its sample still runs with nothing but its own requirements."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from slimtorch.cli.arguments import add_command, add_json, print_json
from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.format.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from slimtorch.deploy.footprint import Baseline, FootprintReport

HELP = "measure a deployment bundle's runtime on disk in a clean venv, beside torch's, and run its sample"
DESCRIPTION = """\
Verifies the bundle first, before anything in it is installed or run: manifest.json schema-checked,
every file against its sha256, nothing unlisted Python could import, predict.py byte for byte the runner
this slimtorch writes, requirements.txt nothing but name==version lines of packages the bundle's runtime
needs (onnxruntime or torch, numpy, tokenizers and their dependencies; --allow-package NAME lets one
more through); a bundle that fails is refused in one line (exit 2). Then makes a fresh virtual
environment, installs only the bundle's requirements.txt with its pip (your pip configuration, index and
proxy settings apply) as a deployment image does, wheels only, `pip install --no-compile
--only-binary=:all:`, runs `python -I predict.py --check` there (writing bytecode for what it imports,
as a deployment does), and weighs what is installed: each distribution is the sum of the files its
RECORD lists and the bytecode written for them, each file counted once (the .pyc column). --compile
installs as plain `pip install` does, every module compiled to bytecode whether it is ever imported or
not (about 12% more). pip, setuptools and wheel come with every venv and are not needed to run, so they
are listed aside and left out of the total; the size of all of site-packages is shown as a cross-check.
The model's bytes are the files manifest.json lists under "model".

Beside it, torch's own footprint, measured the same way: torch==<this torch's version> alone in a clean
venv (pip's configured indexes pick the build), imported once. That takes a minute and about 860 MB
once, so the result is cached in $XDG_CACHE_HOME/slimtorch/footprint/ (~/.cache/slimtorch/footprint/
by default), one file per torch version, Python version, platform and --compile; --refresh-baseline
measures again.

Exit code 0 when the sample passed, 1 when it failed (the runner's last line is shown), 2 when the
bundle is refused.

examples:
  slimtorch footprint ./resnet-bundle
  slimtorch footprint ./resnet-bundle --no-baseline --keep-venv ./resnet-venv
  slimtorch footprint ./bert-bundle --python python3.12 --json > footprint.json
"""


def register(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = add_command(commands, common, "footprint", HELP, DESCRIPTION)
    parser.add_argument("bundle", metavar="DIR", help="a bundle folder (requirements.txt, predict.py)")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch's footprint")
    parser.add_argument(
        "--refresh-baseline", action="store_true", help="measure torch's footprint again, not from the cache"
    )
    parser.add_argument(
        "--python", metavar="PATH", help="the interpreter that makes the venvs (default: this one)"
    )
    parser.add_argument(
        "--keep-venv", metavar="DIR", help="make the venv in this new or empty folder and leave it there"
    )
    parser.add_argument(
        "--compile", action="store_true", help="install as plain pip does: every module compiled to bytecode"
    )
    parser.add_argument(
        "--allow-package",
        action="append",
        default=[],
        metavar="NAME",
        help="let requirements.txt pin NAME, a package no bundle's runtime needs (refused by default; "
        "repeatable)",
    )
    add_json(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from slimtorch.cli.progress import TerminalProgress
    from slimtorch.cli.views.inspect_view import output_console
    from slimtorch.deploy.footprint import FootprintOptions, footprint

    console = output_console()
    options = FootprintOptions(
        baseline=not args.no_baseline,
        refresh_baseline=args.refresh_baseline,
        python=args.python,
        keep=args.keep_venv,
        compile_bytecode=args.compile,
        allow_packages=tuple(args.allow_package),
    )
    with TerminalProgress(enabled=not args.json) as progress:
        report = footprint(args.bundle, options, progress=progress)
    if args.json:
        print_json(report.to_dict())
    else:
        _render(console, report, args.keep_venv)
    return 0 if report.sample_ok else 1


def _render(console: Console, report: FootprintReport, keep: str | None) -> None:
    """The tables and lines of a footprint; package names, versions and the sample's output come from the
    bundle and what it ran, so each is shown as data (``untrusted_text``)."""
    from rich.console import Group
    from rich.text import Text

    runtime = _table(f"{report.bundle}: runtime installed", "package", "version", "bytes", "of it .pyc")
    for package in report.packages:
        runtime.add_row(
            as_text(package.name), as_text(package.version), *_sizes(package.bytes, package.bytecode)
        )
    runtime.add_section()
    runtime.add_row("runtime", "", *_sizes(report.runtime_bytes, report.bytecode_bytes), style="bold")
    runtime.add_row(
        "runtime without .pyc", "", format_bytes(report.runtime_bytes - report.bytecode_bytes), ""
    )
    runtime.add_row("model", "", format_bytes(report.model_bytes), "")
    runtime.add_row("runtime + model", "", format_bytes(report.total_bytes), "", style="bold")
    tables = [runtime] if report.baseline is None else [runtime, _baseline_table(report, report.baseline)]
    console.print(Group(*tables) if console.width < 120 else _side_by_side(tables))
    aside = ", ".join(f"{p.name} {p.version} {format_bytes(p.bytes)}" for p in report.excluded)
    console.print(as_text(f"left out, installers not needed to run: {aside or 'none'}"))
    console.print(
        f"all of site-packages: {format_bytes(report.site_packages_bytes)} (a cross-check); "
        f"venv made and requirements installed in {report.install_seconds:.1f} s",
        highlight=False,
    )
    if report.sample_ok:
        output = "" if report.sample_output is None else f": {_short(report.sample_output)}"
        console.print(Text.assemble(("sample check passed", "green"), printable(output)))
    else:
        console.print(Text.assemble(("sample check FAILED", "red"), f": {printable(report.sample_error)}"))
    if keep:
        console.print(as_text(f"the environment is kept in {keep}"))


def _baseline_table(report: FootprintReport, baseline: Baseline) -> Table:
    when = "cached, measured" if baseline.cached else "measured"
    title = f"{baseline.requirement} ({when} {baseline.measured_at[:10]})"
    table = _table(title, "package", "version", "bytes", "of it .pyc")
    for package in baseline.packages:
        table.add_row(
            as_text(package.name), as_text(package.version), *_sizes(package.bytes, package.bytecode)
        )
    table.add_section()
    table.add_row("torch runtime", "", *_sizes(baseline.runtime_bytes, baseline.bytecode_bytes), style="bold")
    without = format_bytes(baseline.runtime_bytes - baseline.bytecode_bytes)
    table.add_row("torch runtime without .pyc", "", without, "")
    ratio = "-" if report.ratio is None else f"{report.ratio:.3f}x"
    table.add_row("bundle runtime / torch's", "", ratio, "", style="bold")
    return table


def _sizes(total: int, bytecode: int) -> tuple[str, str]:
    return format_bytes(total), format_bytes(bytecode)


def _table(title: str, *columns: str) -> Table:
    from rich.table import Table

    table = Table(title=as_text(title), title_justify="left", header_style="dim")
    for column in columns:
        table.add_column(column, justify="left" if column in ("package", "version") else "right")
    return table


def _side_by_side(tables: list[Table]) -> Table:
    from rich.table import Table

    grid = Table.grid(padding=(0, 4))
    for _ in tables:
        grid.add_column(vertical="top")
    grid.add_row(*tables)
    return grid


def _short(output: dict) -> str:
    """The runner's JSON report on one line: slimtorch's runner says how far each output was from the
    expected one; any other report is shown as it is, cut where it would run on."""
    errors = output.get("outputs")
    if isinstance(errors, dict) and all(isinstance(e, dict) and "max_abs" in e for e in errors.values()):
        return ", ".join(f"{name} largest difference {e['max_abs']:.3g}" for name, e in errors.items())
    text = ", ".join(f"{key}={value}" for key, value in output.items())
    return text if len(text) <= 100 else text[:97] + "..."
