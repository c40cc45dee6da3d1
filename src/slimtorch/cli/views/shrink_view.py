"""Rendering of a :class:`~slimtorch.shrinking.ShrinkReport`: before/after by category, then per tensor."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slimtorch.cli.untrusted_text import as_text, printable
from slimtorch.cli.views.inspect_view import CATEGORY_LABELS
from slimtorch.format.units import format_bytes
from slimtorch.shrinking.report import ShrinkReport


def _ratio(after: int, before: int) -> str:
    return f"{after / before:.3f}x" if before else "-"


def render_shrink(report: ShrinkReport, console: Console, *, top: int = 15) -> None:
    """Print what was written, bytes per category before and after, and the largest tensors' codecs/errors.

    Paths, names and notes quote the file: each is shown as data (``untrusted_text``).
    """
    console.print(
        Text.assemble(
            (printable(report.source), "bold"),
            f"  {format_bytes(report.before_bytes)} -> ",
            (
                f"{format_bytes(report.after_bytes)} ({_ratio(report.after_bytes, report.before_bytes)})",
                "bold green",
            ),
            f"  in {report.seconds:.1f} s",
        )
    )
    console.print(as_text("wrote " + ", ".join(report.files)))
    table = Table(title="Bytes by category", title_justify="left", title_style="bold", header_style="dim")
    for column in ("category", "before", "after", "ratio"):
        table.add_column(column, justify="left" if column == "category" else "right")
    before = {b.name: b.bytes for b in report.before}
    after = {b.name: b.bytes for b in report.after}
    for name in [*before, *(n for n in after if n not in before)]:
        b, a = before.get(name, 0), after.get(name, 0)
        if b or a:
            table.add_row(
                as_text(CATEGORY_LABELS.get(name, name)), format_bytes(b), format_bytes(a), _ratio(a, b)
            )
    table.add_row(
        "total",
        format_bytes(report.before_bytes),
        format_bytes(report.after_bytes),
        _ratio(report.after_bytes, report.before_bytes),
        style="bold",
    )
    console.print(table)

    largest = sorted(report.tensors, key=lambda t: t.before_bytes, reverse=True)[:top]
    tensors = Table(
        title=f"Largest tensors ({len(largest)} of {len(report.tensors)})",
        title_justify="left",
        title_style="bold",
        header_style="dim",
    )
    for column in ("tensor", "codec", "before", "after", "ratio", "max abs err", "rel L2 err"):
        tensors.add_column(
            column, justify="left" if column in ("tensor", "codec") else "right", overflow="fold"
        )
    for t in largest:
        tensors.add_row(
            as_text(t.name),
            as_text(t.chain),
            format_bytes(t.before_bytes),
            format_bytes(t.after_bytes),
            _ratio(t.after_bytes, t.before_bytes),
            "-" if t.max_abs is None else f"{t.max_abs:.3g}",
            "-" if t.rel_l2 is None else f"{t.rel_l2:.3g}",
        )
    console.print(tensors)
    lossy = [t for t in report.tensors if t.rel_l2 is not None]
    if lossy:
        worst = max(lossy, key=lambda t: t.rel_l2 or 0.0)
        console.print(
            as_text(f"lossy tensors: {len(lossy)}; worst relative L2 error {worst.rel_l2:.3g} ({worst.name})")
        )
    dropped = [f"dropped {len(report.dropped)} optimizer / training tensors"] if report.dropped else []
    folded = [f"folded {len(report.folded)} pruning masks into their weights"] if report.folded else []
    shared = (
        [f"stored {len(report.ties) + len(report.copies)} tied / duplicate tensors once"]
        if (report.ties or report.copies)
        else []
    )
    for line in [*dropped, *folded, *shared, *_objects(report), *_stored_instead(report), *report.notes]:
        console.print(as_text(f"- {line}"))


def _objects(report: ShrinkReport) -> list[str]:
    lines = []
    if report.objects:
        lines.append(
            f"kept non-tensor values {_listed(report.objects)} as JSON (slimtorch.load_objects reads them)"
        )
    if report.dropped_objects:
        listed = _listed(
            [f"{name} ({why})" for name, why in report.dropped_objects.items()], 3, " (--json lists all)"
        )
        count = len(report.dropped_objects)
        what = "objects that are" if count > 1 else "object that is"
        lines.append(f"dropped {count} {what} not plain data: {listed}")
    return lines


def _stored_instead(report: ShrinkReport) -> list[str]:
    """One line per precision chosen, e.g. ``int8 instead of int4: lstm.weight_hh_l0 (recurrent ...)``."""
    lines = []
    for stored in ("float16", "int8"):
        chosen = [c for c in report.stored_instead if c.stored == stored]
        if chosen:
            by_reason: dict[str, list[str]] = {}
            for c in chosen:
                by_reason.setdefault(c.reason, []).append(c.name)
            listed = "; ".join(
                f"{_listed(names, 4, ' (--json lists all)')} ({why})" for why, names in by_reason.items()
            )
            lines.append(
                f"{stored} instead of {chosen[0].instead_of}: {listed}; --quantize-all quantizes them anyway"
            )
    return lines


def _listed(names: list[str], most: int = 4, where: str = "") -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more{where}" if len(names) > most else "")
