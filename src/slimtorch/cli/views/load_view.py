"""Rendering of a :class:`~slimtorch.loading.options.LoadReport`: where the time of a load went."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.format.units import format_bytes
from slimtorch.loading.options import LoadReport

PHASES = (
    ("open", "open_s", "parse the file's structure (headers, index, pickle); start checking it"),
    ("construct", "construct_s", "the model factory, parameters on meta (and any import it triggers)"),
    ("read", "read_s", "map the stored parts; verify the checksums of those decoded or copied"),
    ("decode", "decode_s", "int8 / int4 / sparse / cast / zstd back to tensors"),
    ("copy", "copy_s", "dtype conversion, copies into existing tensors, transfer to the device"),
    ("assign", "assign_s", "put the tensors into the model"),
)


def render_load(report: LoadReport, console: Console, *, show_phases: bool) -> None:
    """One summary line; with ``show_phases``, the table of phases. The path, the class and the codecs'
    names (from the file) are shown as data (``untrusted_text``)."""
    rate = report.bytes / report.wall_s / 1e9 if report.wall_s else 0.0
    codecs = ", ".join(f"{n} {c}" for c, n in sorted(report.by_codec.items(), key=lambda kv: -kv[1]))
    console.print(
        Text.assemble(
            (printable(report.path), "bold"),
            f"  {report.format}, {format_bytes(report.file_bytes)} on disk -> ",
            (
                f"{format_bytes(report.bytes)} "
                + (f"into {printable(report.model_class)} " if report.model_class else "")
                + f"on {report.device}",
                "bold green",
            ),
            f" in {report.wall_s:.3f} s ({rate:.2f} GB/s)",
        )
    )
    console.print(
        as_text(
            f"{report.tensor_count} tensors: {report.zero_copy} mapped from the file without a copy, "
            f"{report.decoded} decoded ({codecs or 'none'}); {report.threads} threads"
        ),
        highlight=False,
    )
    console.print(verify_line(report), highlight=False)
    if report.max_memory:
        console.print(as_text(offload_line(report)), highlight=False)
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
    table.add_row("wall", f"{report.wall_s:.3f}", "100%", "start to return", style="bold")
    if report.verify != "off":
        when = "before the return" if report.verify == "eager" else "after the return, beside the caller"
        share = f"{100 * report.verify_s / report.wall_s:.0f}%" if report.wall_s else "-"
        what = f"hash the mapped tensors' bytes (pages them in), {when}"
        table.add_row("verify", f"{report.verify_s:.3f}", share, what)
    console.print(table)


def verify_line(report: LoadReport) -> str:
    """What verifying the checksums cost, and whether it overlapped the caller's work."""
    if report.verify == "off":
        return "checksums: not verified (--no-verify)"
    line = (
        f"checksums: {format_bytes(report.verified_bytes)} of mapped tensors verified in "
        f"{report.verify_wall_s:.3f} s ({report.verify_s:.3f} s of hashing over the threads)"
    )
    if report.verify == "eager":
        return line + ", before the load returned"
    if report.verify_after_s:
        return (
            line + f"; {report.verify_after_s:.3f} s of it after the load returned, beside the caller's work"
        )
    return line + "; all of it before the load returned (nothing left to overlap)"


def offload_line(report: LoadReport) -> str:
    """What a memory budget kept resident and what it left in the file."""
    budget = format_bytes(report.max_memory.get("cpu", 0))
    line = f"offload: {format_bytes(report.resident_bytes)} resident of a {budget} budget"
    if not report.offloaded:
        return line + "; nothing offloaded"
    names = ", ".join(report.offloaded[:3]) + (" ..." if len(report.offloaded) > 3 else "")
    return (
        line + f"; {len(report.offloaded)} units left in the file ({names}), paged in by each forward and "
        f"released after it ({report.page_release})"
    )
