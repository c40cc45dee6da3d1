"""What a saved model's structural delta says about its quantized layers, checked, and how to rebuild them."""

from __future__ import annotations

from typing import Any

from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.format.codecs.chain import parse_dtype
from slimtorch.format.codecs.lossy import INT4_GROUP_SIZE, is_int4_group_size
from slimtorch.format.delta import Swaps
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.quant.build import quantized_on_meta
from slimtorch.quant.conv import quantizable_conv
from slimtorch.quant.recurrent import is_recurrent, recurrent_matrices
from slimtorch.quant.sharing import share_input_codes
from slimtorch.schemes import SCHEMES
from slimtorch.schemes import scheme as scheme_row

FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def quantizable_type(module: nn.Module) -> bool:
    """``nn.Linear``, ``nn.Embedding`` (not subclasses, whose owners may read the weight), HF ``Conv1D``,
    a zero-padded ``nn.Conv1d/2d/3d``, ``nn.LSTM`` or ``nn.GRU``."""
    return (
        type(module) in (nn.Linear, nn.Embedding)
        or is_hf_conv1d(module)
        or quantizable_conv(module)
        or is_recurrent(module)
    )


def restore(model: nn.Module, quantized: dict[str, dict[str, Any]]) -> None:
    """Swap the float layers a saved model had quantized for empty quantized ones (on the meta device),
    as its structural delta says; :func:`slimtorch.load_model` then fills their parts from the file."""
    modules = dict(model.named_modules())
    for name, how in quantized.items():
        module = modules.get(name)
        if (
            module is None
            or not quantizable_type(module)
            or (quantizable_conv(module) and not scheme_row(how["scheme"]).quantizes("conv"))
        ):
            what = "which the model does not have" if module is None else f"a {type(module).__name__}"
            raise SlimtorchError(f"the file quantized module {name!r}, {what}")
        matrices = how.get("matrices", ())
        if is_recurrent(module) and not (matrices and set(matrices) <= set(recurrent_matrices(module))):
            raise SlimtorchError(f"the file quantized matrices {matrices} of {name!r}, which is a {module}")
        dtype = parse_dtype(how["dtype"])
        group = how.get("group_size") or INT4_GROUP_SIZE  # int8 layers record none
        put_module(model, name, quantized_on_meta(module, how["scheme"], group, dtype, matrices))
    share_input_codes(model)  # as quantize set it up


def check_recorded(quantized: object) -> dict[str, dict[str, Any]]:
    """The ``quantized`` map of a file's structural delta, checked: known schemes, sizes and dtypes only."""
    if not isinstance(quantized, dict):
        raise SlimtorchError("the structural delta's quantized layers are not an object")
    for name, how in quantized.items():
        ok = (
            isinstance(how, dict)
            and how.get("scheme") in SCHEMES
            and how.get("dtype") in FLOAT_NAMES
            and (how.get("group_size") is None or is_int4_group_size(how.get("group_size")))
            and _names(how.get("matrices", []))
        )
        if not ok:
            raise SlimtorchError(f"the structural delta quantizes {name!r} as {how!r}, not a known scheme")
    return {name: dict(how) for name, how in quantized.items()}


def _names(value: object) -> bool:
    """A recurrent layer's coded matrices: a list of names."""
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def put_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule called ``name`` (a dotted path) with ``module``."""
    parent, _, attr = name.rpartition(".")
    if not attr:
        raise SlimtorchError("quantize takes a model holding layers, not a single layer")
    setattr(model.get_submodule(parent), attr, module)


SWAPS = Swaps(check_recorded, restore)
"""How a delta's ``quantized`` section is read: :data:`slimtorch.format.delta.SECTIONS` names this."""
