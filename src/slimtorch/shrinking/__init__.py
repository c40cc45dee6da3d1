"""Save: any checkpoint, state dict or model to the slim format (:func:`shrink`, :func:`save`,
:func:`save_model`), and pruned Hugging Face models as folders ``from_pretrained`` reads
(:func:`save_pretrained`)."""

from slimtorch.format.policy import ShrinkOptions
from slimtorch.shrinking.pretrained import save_pretrained
from slimtorch.shrinking.report import ShrinkReport, TensorResult
from slimtorch.shrinking.saving import save, save_model, shrink

__all__ = ["ShrinkOptions", "ShrinkReport", "TensorResult", "save", "save_model", "save_pretrained", "shrink"]
