"""Rendering of a :class:`~slimtorch.loading.options.LoadReport`: where the time of a load went."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slimtorch.format.units import format_bytes
from slimtorch.loading.options import LoadReport

PHASES = (
    ("open", "open_s", "parse the file's structure (headers, index, pickle)"),
    ("construct", "construct_s", "the model factory, parameters on meta (and any import it triggers)"),
    ("read", "read_s", "map the stored parts, verify their checksums"),
    ("decode", "decode_s", "int8 / int4 / sparse / cast / zstd back to tensors"),
    ("copy", "copy_s", "dtype conversion, copies into existing tensors, transfer to the device"),
    ("assign", "assign_s", "put the tensors into the model"),
)


def render_load(report: LoadReport, console: Console, *, show_phases: bool) -> None:
    """One summary line; with ``show_phases``, the table of phases."""
    rate = report.bytes / report.wall_s / 1e9 if report.wall_s else 0.0
    codecs = ", ".join(f"{n} {c}" for c, n in sorted(report.by_codec.items(), key=lambda kv: -kv[1]))
    console.print(
        Text.assemble(
            (report.path, "bold"),
            f"  {report.format}, {format_bytes(report.file_bytes)} on disk -> ",
            (
                f"{format_bytes(report.bytes)} "
                + (f"into {report.model_class} " if report.model_class else "")
                + f"on {report.device}",
                "bold green",
            ),
            f" in {report.wall_s:.3f} s ({rate:.2f} GB/s)",
        )
    )
    console.print(
        f"{report.tensor_count} tensors: {report.zero_copy} mapped from the file without a copy, "
        f"{report.decoded} decoded ({codecs or 'none'}); {report.threads} threads",
        highlight=False,
    )
    if not show_phases:
        return
    table = Table(
        title="Where the time went (phases summed over threads, so they can exceed the wall time)",
        title_justify="left",
        title_style="bold",
        header_style="dim",
    )
    for column in ("phase", "seconds", "share", "what"):
        table.add_column(column, justify="right" if column in ("seconds", "share") else "left")
    for label, attr, what in PHASES:
        if attr == "construct_s" and report.model_class is None:
            continue
        seconds = getattr(report, attr)
        share = f"{100 * seconds / report.wall_s:.0f}%" if report.wall_s else "-"
        table.add_row(label, f"{seconds:.3f}", share, what)
    table.add_row("wall", f"{report.wall_s:.3f}", "100%", "start to ready", style="bold")
    console.print(table)
