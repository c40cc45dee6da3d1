"""Load: tensors and models out of any checkpoint (:func:`load`, :func:`load_model`), and the model a
command works on (:func:`open_model`)."""

from slimtorch.loading.loader import LoadProfile, load, load_model, load_model_profiled, load_profiled
from slimtorch.loading.opening import ModelInput, open_meta_model, open_model

__all__ = [
    "LoadProfile",
    "ModelInput",
    "load",
    "load_model",
    "load_model_profiled",
    "load_profiled",
    "open_meta_model",
    "open_model",
]
