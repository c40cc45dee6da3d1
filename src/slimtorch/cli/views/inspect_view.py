"""Rendering of an :class:`~slimtorch.inspection.breakdown.InspectReport` as rich tables."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.format.units import format_bytes, format_share
from slimtorch.inspection.breakdown import InspectReport

# Piped output has no terminal width to follow; rich's fallback of 80 columns folds tensor names.
PIPED_WIDTH = 140

CATEGORY_LABELS = {
    "parameters": "parameters",
    "buffers": "buffers",
    "optimizer_state": "optimizer state",
    "training_state": "other training state",
    "pruning_leftovers": "pruning leftovers (*_mask)",
    "duplicates": "duplicated storage",
    "unreferenced_storage": "storage no tensor uses",
    "non_tensor": "non-tensor objects (pickle / header)",
    "format_overhead": "format overhead",
}


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", header_style="dim")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", overflow="fold")
    return table


class ReportConsole(Console):
    """rich's console, except that a reader gone (``| head``) is left to the command line's one handler
    (exit 0, quietly) instead of rich's own exit 1."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def output_console() -> Console:
    """A console for reports: the terminal's width, or a wide page when piped to a file."""
    console = ReportConsole()
    return console if console.is_terminal else ReportConsole(width=PIPED_WIDTH)


def render_inspect(report: InspectReport, console: Console, *, show_objects: int = 8) -> None:
    """Print the report: summary, categories, dtypes, module tree, largest tensors, savings.

    Names, dtypes, codecs and summaries come from the file: each is shown as data (``untrusted_text``).
    """
    whole = report.file_bytes
    console.print(
        Text.assemble(
            (printable(report.path), "bold"),
            f"  {report.format}  ",
            f"{format_bytes(whole)} on disk, {len(report.tensors)} tensors, ",
            f"{format_bytes(report.tensor_bytes)} of tensor data",
        )
    )
    categories = _table("Where the bytes go", "category", "tensors", "bytes", "of file")
    for bucket in report.categories:
        categories.add_row(
            CATEGORY_LABELS[bucket.name],
            str(bucket.tensors or ""),
            format_bytes(bucket.bytes),
            format_share(bucket.bytes, whole),
        )
    if report.tied.tensors:
        categories.add_row(
            "[dim]tied / shared (stored once)[/]",
            str(report.tied.tensors),
            f"[dim]({format_bytes(report.tied.bytes)})[/]",
            "[dim]0%[/]",
        )
    dtypes = _table("By dtype", "dtype", "tensors", "bytes", "of file")
    for bucket in report.by_dtype:
        dtypes.add_row(
            as_text(bucket.name),
            str(bucket.tensors),
            format_bytes(bucket.bytes),
            format_share(bucket.bytes, whole),
        )
    console.print(Group(categories, dtypes))

    tree = _table("By module", "prefix", "tensors", "bytes", "of file")
    for node in report.tree:
        label = node.prefix.rsplit(".", 1)[-1] if node.depth > 1 else node.prefix
        tree.add_row(
            as_text("  " * (node.depth - 1) + label),
            str(node.tensors),
            format_bytes(node.bytes),
            format_share(node.bytes, whole),
        )
    console.print(tree)

    coded = any(stat.codec != "raw" for stat in report.tensors)
    columns = (
        "name",
        "dtype",
        "shape",
        "bytes",
        *(("stored", "codec") if coded else ()),
        "zeros",
        "category",
    )
    largest = _table(f"Largest {len(report.largest)} tensors", *columns)
    for stat in report.largest:
        zeros = "-" if stat.sparsity is None else f"{100 * stat.sparsity:.1f}%"
        category = CATEGORY_LABELS[stat.category]
        if stat.shares_with:
            relation = "copy of" if stat.category == "duplicates" else "tied to"
            category += f" ({relation} {stat.shares_with})"
        largest.add_row(
            as_text(stat.name),
            as_text(stat.dtype),
            "x".join(map(str, stat.shape)) or "scalar",
            format_bytes(stat.nbytes),
            *((format_bytes(stat.stored_bytes), as_text(stat.codec)) if coded else ()),
            zeros,
            as_text(category),
        )
    console.print(largest)

    if report.objects:
        # Shallow names first: `epoch` tells more than `optimizer.param_groups.0.eps`.
        shown = sorted(report.objects, key=lambda o: o.name.count("."))[:show_objects]
        more = len(report.objects) - len(shown)
        text = ", ".join(f"{o.name}={o.summary}" for o in shown) + (f" (+{more} more)" if more else "")
        console.print(Text.assemble(("Non-tensor objects: ", "bold"), printable(text)))

    savings = _table("What you could save (slimtorch shrink)", "action", "size after", "of file", "saves")
    savings.add_row("as it is", format_bytes(whole), "100%", "")
    for saving in report.savings:
        style = "" if saving.lossless else "dim"
        savings.add_row(
            as_text(saving.action, style),
            format_bytes(saving.bytes_after),
            format_share(saving.bytes_after, whole),
            format_bytes(saving.saved),
        )
    console.print(savings)
    for note in report.notes:
        console.print(as_text(f"- {note}", "dim"))
