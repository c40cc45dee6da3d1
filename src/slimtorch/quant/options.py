"""What :func:`slimtorch.quantize` is told to do: :class:`QuantizeOptions`, checked when it is made, so a
recipe holding a bad scheme, group size or kernel fails where it is written, not halfway through a model."""

from __future__ import annotations

from dataclasses import dataclass

from slimtorch.errors import OptionError
from slimtorch.format.codecs.lossy import INT4_GROUP_SIZE, check_group_size
from slimtorch.quant.build import layer_class
from slimtorch.schemes import scheme as scheme_row


@dataclass(frozen=True)
class QuantizeOptions:
    """How :func:`slimtorch.quantize` quantizes a model; every field has the default the CLI has.

    Example:
        >>> QuantizeOptions("int4-weight", group_size=64, skip=["classifier"]).skip
        ('classifier',)
    """

    scheme: str = "int8-dynamic"
    """a name of :data:`slimtorch.schemes.SCHEMES`: ``"int8-dynamic"`` (fastest on CPU), ``"int8-weight"`` or
    ``"int4-weight"``."""
    group_size: int = INT4_GROUP_SIZE
    """Inputs sharing one int4 scale and zero point (even, 32 to 256; checked under every scheme)."""
    skip: tuple[str, ...] = ()
    """Module names or patterns (``"classifier"``, ``"*.pooler.*"``, an LSTM's matrix
    ``"lstm.weight_ih_l0"``) that stay float; a pattern that matches nothing in the model is an error."""
    embeddings: bool = True
    """Quantize ``nn.Embedding`` too (int8 or int4 rows)."""
    keep_sensitive: bool = True
    """Keep float the few layers (or LSTM / GRU matrices) whose error would dominate the model's, measured
    (see :mod:`slimtorch.quant.sensitivity`); False quantizes them too."""
    kernel: str | None = None
    """Force one kernel (``"onednn"``, ``"int_mm"``, ``"dequantize"``, ``"int8pack"``, ``"int4pack"``, the
    weight-only ones with ``-bf16``; ``"quantized_rnn"`` for LSTM / GRU); None times the candidates on
    first use and keeps the fastest."""
    symmetric: bool = False
    """int4 codes on the symmetric grid (zero point at code 8), one of the forms compressed-tensors reads
    as stored (vLLM's int4 kernels want it). No effect on int8."""
    integer_zero: bool = False
    """int4 zero points each on a code of its own group (asymmetric groups, written as
    compressed-tensors' ``weight_zero_point``): what a Hugging Face folder written by
    :func:`slimtorch.save_model` needs to hold them quantized, as accurate as the slim layout
    (``slimtorch quantize`` and ``slim`` set it for such folders). No effect on int8."""

    gptq: bool = True
    """int4 with ``calibration``: codes chosen by GPTQ (each rounding error spread where the inputs feel it
    least); False rounds each weight to nearest (with ``awq``: AWQ alone)."""
    awq: bool = False
    """int4: scale each Linear's input channels by how large its calibration inputs are before rounding,
    the inverse folded into the layer before (AWQ, :mod:`slimtorch.quant.awq`); needs ``calibration``."""

    @property
    def int4_grid(self) -> str:
        """Where int4 zero points go (:data:`slimtorch.quant.build.INT4_GRIDS`)."""
        return "symmetric" if self.symmetric else "integer_zero" if self.integer_zero else ""

    def __post_init__(self) -> None:
        row = scheme_row(self.scheme)
        check_group_size(self.group_size)
        if self.symmetric and self.integer_zero:
            raise OptionError("int4 zero points are symmetric or integer, not both")
        if self.awq and row.codec != "int4":
            raise OptionError(f"awq scales int4 weights (int4-weight), not {self.scheme}")
        if isinstance(self.skip, str):  # one pattern, not its characters
            raise OptionError(f"skip takes a list of patterns, not the string {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        classes = [layer_class(self.scheme, kind) for kind in ("linear", "recurrent") if row.quantizes(kind)]
        known = dict.fromkeys(kernel for cls in classes for kernel in cls.KERNELS)
        if self.kernel is not None and self.kernel not in known:
            raise OptionError(
                f"kernel {self.kernel!r} does not compute {self.scheme} (its kernels: {', '.join(known)})"
            )
