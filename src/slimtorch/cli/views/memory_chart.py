"""A PNG of memory over a training loop's steady step (the optimizer's state alive from step 2 on): live
bytes through forward, backward and the optimizer step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slimtorch.errors import SlimtorchError
from slimtorch.memory import MemoryReport

PHASE_COLOURS = {"setup": "#999999", "forward": "#1f77b4", "backward": "#d62728", "optimizer": "#2ca02c"}


def write_chart(
    report: MemoryReport, path: str | os.PathLike[str], *, title: str, budget: int | None
) -> Path:
    """Draw each batch size's curve (coloured by phase) with the budget as a line; returns the file."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        from matplotlib import pyplot
    except ImportError:
        raise SlimtorchError("charts need matplotlib: pip install 'slimtorch[charts]'") from None
    # The title names the model's path: a `$` there is a dollar sign, not the start of mathtext.
    with pyplot.rc_context({"text.parse_math": False, "text.usetex": False}):
        return _draw(pyplot, report, path, title=title, budget=budget)


def _draw(
    pyplot: Any, report: MemoryReport, path: str | os.PathLike[str], *, title: str, budget: int | None
) -> Path:
    figure, axes = pyplot.subplots(figsize=(9, 4.5), dpi=120)
    try:
        styles = ("-", "--", ":", "-.")
        for index, step in enumerate(report.steps):
            xs = range(len(step.curve))
            ys = [nbytes / 2**30 for _, nbytes in step.curve]
            name = f"batch {step.batch_size}: " if step.batch_size else ""
            axes.plot(
                xs,
                ys,
                color="#888888",
                linewidth=0.8,
                linestyle=styles[index % len(styles)],
                label=f"{name}steady peak {step.peak_bytes / 2**30:.3g} GiB "
                f"(first step {step.first_step_peak_bytes / 2**30:.3g})",
            )
            for phase, colour in PHASE_COLOURS.items():
                dots = [(x, y) for x, (p, _), y in zip(xs, step.curve, ys, strict=True) if p == phase]
                if dots:
                    label = phase if index == 0 else None
                    axes.scatter(*zip(*dots, strict=True), s=3, color=colour, label=label)
        if budget:
            axes.axhline(budget / 2**30, color="black", linestyle="--", linewidth=1, label="budget")
        axes.set_xlabel("allocations and frees through the steady step (step 2 on)")
        axes.set_ylabel("live tensors (GiB)")
        axes.set_title(title, fontsize=10)
        axes.legend(loc="upper left", fontsize=8, markerscale=3)
        figure.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out)
    finally:
        pyplot.close(figure)
    return out
