"""Inspect: where a checkpoint's bytes go (:func:`inspect`), what shrinking would save
(:mod:`~slimtorch.inspection.estimates`), and what a model costs to run
(:mod:`~slimtorch.inspection.measure`)."""

from slimtorch.inspection.breakdown import InspectReport, inspect
from slimtorch.inspection.options import InspectOptions

__all__ = ["InspectOptions", "InspectReport", "inspect"]
