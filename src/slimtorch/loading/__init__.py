"""Load: tensors and models out of any checkpoint (:func:`load`, :func:`load_model`, told how by
:class:`LoadOptions`, telling back a :class:`LoadReport`), and the model a command works on
(:func:`open_model`)."""

from slimtorch.loading.loader import load, load_model
from slimtorch.loading.opening import ModelInput, open_meta_model, open_model
from slimtorch.loading.options import LoadOptions, LoadReport

__all__ = [
    "LoadOptions",
    "LoadReport",
    "ModelInput",
    "load",
    "load_model",
    "open_meta_model",
    "open_model",
]
