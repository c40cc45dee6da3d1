"""The quantization schemes: one row each, read by every command that offers or runs one.

A row says what a scheme is (its name, bits, the codec that stores its weights, whether activations are
quantized on each call too, whether scales go per group of inputs or per output row) and which layer
class stands for each kind of float layer it quantizes (by dotted path: this module imports no torch, so
``slimtorch --help`` lists the schemes at once). ``slimtorch.quant`` builds the layers from it; the
command line, the slim planner, shrink, prune and export read it.

Adding a scheme is one row here and its layer classes (each with ``SCHEME`` set to the row's name where
the class is the scheme's own): ``tests/test_schemes.py`` checks that every path resolves, that the
classes agree with their row and that each command offers the schemes its row allows.

Example:
    >>> scheme("int4-weight").bits, scheme("int4-weight").grouped, "int4-weight" in WEIGHT_ONLY
    (4, True, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from slimtorch.errors import OptionError

LAYER_KINDS = ("linear", "embedding", "conv", "recurrent")
"""The float layers a scheme may quantize: ``nn.Linear`` (and Hugging Face's ``Conv1D``), ``nn.Embedding``,
zero-padded convolutions, ``nn.LSTM`` / ``nn.GRU``."""


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme."""

    name: str
    """what the API and every command call it: ``quantize(model, "int4-weight")``, ``--scheme int4-weight``"""
    bits: int
    """bits per stored weight code"""
    codec: str
    """the codec (:mod:`slimtorch.format.codecs`) that stores the weights: ``int8`` or ``int4``"""
    dynamic: bool
    """activations are quantized on each call too (a file stores only weights: such a scheme is a way to
    run, not one to store)"""
    grouped: bool
    """a scale and zero point per group of ``group_size`` inputs (else one scale per output row)"""
    layers: Mapping[str, str] = field(default_factory=dict)
    """kind of float layer (:data:`LAYER_KINDS`) -> ``module:Class`` of the layer that replaces it; a kind
    left out stays float under this scheme"""
    summary: str = ""
    """one line, in each command's ``--scheme`` help (no semicolon: they separate the schemes there)"""

    def __post_init__(self) -> None:
        unknown = set(self.layers) - set(LAYER_KINDS)
        if unknown:
            raise ValueError(f"scheme {self.name}: unknown layer kinds {sorted(unknown)}")
        object.__setattr__(self, "layers", MappingProxyType(dict(self.layers)))

    @property
    def weight_only(self) -> bool:
        """Weights quantized, activations computed in float: what a file stores (shrink, prune, save)."""
        return not self.dynamic

    def quantizes(self, kind: str) -> bool:
        return kind in self.layers

    def codec_chain(self, group_size: int, grid: str = "") -> list[Any]:
        """The codec stage its weights go through: grouped codes follow rows, as the kernels want them;
        ``grid`` names where int4 zero points go (``symmetric``, ``integer_zero``, or "" for anywhere).
        int8 is symmetric and its groups never span rows: it takes neither option."""
        if not self.grouped:
            return [self.codec]
        if self.codec != "int4":
            return [(self.codec, {"group_size": group_size})]
        return [(self.codec, {"group_size": group_size, "flat": False, **({grid: True} if grid else {})})]

    @property
    def writer_form(self) -> str | None:
        """The codec form (a key of :data:`WRITER_FORMS`: ``"int8"``, ``"int4"``) in which the file writers
        store its weights as the row says, or None when they have no such form (the row is then quantized by
        ``quantize``, never by shrink or prune). Their ``quantize`` option takes the row's name; the
        writers' policy turns it into this form (``slimtorch.format.policy.TensorPolicy.codec``)."""
        return next(
            (value for value, form in WRITER_FORMS.items() if form == (self.codec, self.grouped)), None
        )


WRITER_FORMS: Mapping[str, tuple[str, bool]] = MappingProxyType(
    {"int8": ("int8", False), "int4": ("int4", True)}
)
"""What the file writers store for each codec form they quantize weights in (``slimtorch.format.policy``:
shrink, prune, ``save``): ``(codec, grouped)``, int8 with a scale per row, int4 in groups. Their
``quantize`` option names a scheme (:data:`WRITTEN`), whose row's :attr:`Scheme.writer_form` is the key
here. Here, not there, so that the command line reads it without torch; ``tests/test_schemes.py`` holds the
two together. A row whose form is not listed is not offered by the commands that write files, and the
writers refuse its name: stored by codec it would come out in another form (a grouped int8 row as a
scale per row)."""

_MODULES, _RECURRENT, _CONV = "slimtorch.quant.modules", "slimtorch.quant.recurrent", "slimtorch.quant.conv"

ROWS: tuple[Scheme, ...] = (
    Scheme(
        "int8-dynamic",
        bits=8,
        codec="int8",
        dynamic=True,
        grouped=False,
        layers={
            "linear": f"{_MODULES}:Int8DynamicLinear",
            "embedding": f"{_MODULES}:Int8Embedding",
            "recurrent": f"{_RECURRENT}:Int8DynamicRecurrent",
        },
        summary="int8 weights (a scale per output row) and activations (a scale per row, each call)",
    ),
    Scheme(
        "int8-weight",
        bits=8,
        codec="int8",
        dynamic=False,
        grouped=False,
        layers={
            "linear": f"{_MODULES}:Int8WeightLinear",
            "embedding": f"{_MODULES}:Int8Embedding",
            "conv": f"{_CONV}:Int8WeightConv",
            "recurrent": f"{_RECURRENT}:Int8WeightRecurrent",
        },
        summary="int8 weights (a scale per output row), activations in the input's dtype",
    ),
    Scheme(
        "int8-group-weight",
        bits=8,
        codec="int8",
        dynamic=False,
        grouped=True,
        layers={"linear": f"{_MODULES}:Int8GroupWeightLinear", "embedding": f"{_MODULES}:Int8Embedding"},
        summary="int8 weights, a scale per group of inputs, activations in the input's dtype",
    ),
    Scheme(
        "int4-weight",
        bits=4,
        codec="int4",
        dynamic=False,
        grouped=True,
        layers={
            "linear": f"{_MODULES}:Int4WeightLinear",
            "embedding": f"{_MODULES}:Int4Embedding",
            "conv": f"{_CONV}:Int4WeightConv",
            "recurrent": f"{_RECURRENT}:Int4WeightRecurrent",
        },
        summary="4-bit weights, a scale and zero point per group of inputs, activations in the input's dtype",
    ),
)
"""Every scheme, in the order ``--help`` lists them."""

BY_NAME: Mapping[str, Scheme] = MappingProxyType({row.name: row for row in ROWS})
SCHEMES: tuple[str, ...] = tuple(BY_NAME)
"""Every scheme's name."""
WEIGHT_ONLY: tuple[str, ...] = tuple(row.name for row in ROWS if row.weight_only)
"""The schemes whose weights are quantized and activations computed in float: what a file holds."""
WRITTEN: tuple[str, ...] = tuple(row.name for row in ROWS if row.weight_only and row.writer_form)
"""The weight-only schemes the file writers store as their rows say (:data:`WRITER_FORMS`): the names their
``quantize`` option takes, what shrink and prune offer."""


def scheme(name: str) -> Scheme:
    """The row of scheme ``name``; an unknown name is an :class:`~slimtorch.errors.OptionError` listing the
    known ones."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise OptionError(f"unknown scheme {name!r} (known: {', '.join(SCHEMES)})")
    return BY_NAME[name]


def quantizing(kind: str) -> tuple[str, ...]:
    """The schemes that quantize layers of ``kind`` (``"conv"``: the weight-only ones)."""
    return tuple(row.name for row in ROWS if row.quantizes(kind))
