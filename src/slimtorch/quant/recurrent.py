"""``nn.LSTM`` and ``nn.GRU`` with quantized weight matrices, saved and loaded like the Linear layers.

Each matrix (``weight_ih_l0``, ``weight_hh_l0_reverse`` ...) is coded on its own, one int8 scale per
row (or int4 groups), and stored under its own name: a slim reader decodes ``lstm.weight_ih_l0`` to the
float matrix. A matrix can also stay float (one whose error would dominate, or one ``skip`` names): it
stays a float parameter under the same name. Biases stay float.

``int8-dynamic`` runs the faster of two kernels, measured on first use like the Linear ones:

- ``quantized_rnn``: torch's own int8 LSTM / GRU (``torch.quantized_lstm``, what
  ``torch.ao.quantization.quantize_dynamic`` runs), on these codes packed per output row; it multiplies
  the input projection of the whole sequence at once and each step's recurrent matrix in int8, with
  activations quantized on the fly. A float matrix goes in as float16 (its input projection runs in
  float16, not int8). It must agree with ``dequantize`` within :data:`RECURRENT_AGREEMENT`, else it is
  never chosen for that layer. (A loop of our own, the whole sequence's input projection through the
  int8 kernels of :mod:`slimtorch.quant.kernels` and one float matmul per step, measured twice as slow
  at batch 1 as this C++ loop, which also projects the whole sequence at once.)
- ``dequantize``: torch's float LSTM / GRU (oneDNN's fused RNN on CPU) on the dequantized weights, kept
  once made. A fallback: it wins only by :data:`~slimtorch.quant.kernels.FALLBACK_MARGIN` and after leading
  on quiet timings for several rounds, so a busy spell of the machine during the timing cannot hand a
  layer whose int8 loop is 4-5x faster to the float one (it did, in 1 of 9 processes, with best-of-3).

The weight-only schemes (``int8-weight``, ``int4-weight``) dequantize the matrices on each call and run
the float LSTM / GRU: their point is memory, not speed.

Under ``torch.compile`` a layer is one operator, ``slimtorch::quantized_rnn``, that runs this eager path
(dynamo does not trace ``nn.LSTM`` / ``nn.GRU`` themselves); a packed sequence is the exception: it has no
operator form and breaks the graph there.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeGuard

import torch
from torch import nn

from slimtorch.format.codecs import Encoded, decode, encode
from slimtorch.quant import kernels
from slimtorch.quant.modules import INT4_PARTS, INT8_PARTS, QuantizedWeight
from slimtorch.schemes import scheme as scheme_row

RECURRENT = (nn.LSTM, nn.GRU)
_LAYER_IDS = itertools.count()  # tells layers apart in the kernel choice (copies share their original's)
SETTINGS = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "bidirectional")
RECURRENT_AGREEMENT = 0.1
"""Relative L2 error of the output sequence that ``quantized_rnn`` may have against ``dequantize``: its
activations are int8 at every step and the recurrence carries that error along (3 to 4% on resemblyzer's
speaker encoder); a layer reading raw features whose scale spans decades (power spectra) loses far more
(60% for resemblyzer's first layer), and then runs float."""


ONE_SCALE_COST = 1.05
"""How much larger (relative L2) the weight error of one int8 scale for a whole matrix may be than that of a
scale per row, for ``int8-dynamic`` to code the matrix with one scale. torch's int8 RNN runs a matrix
with one scale faster (measured 3 to 16% per call with a scale per row, GRU more than LSTM): that is the
granularity ``torch.ao`` uses everywhere. Matrices whose rows have like ranges (a freshly initialised
layer) lose nothing by it; trained matrices usually lose 2.5 to 12x (resemblyzer's LSTM) and keep a
scale per row."""


def is_recurrent(module: nn.Module) -> TypeGuard[nn.LSTM | nn.GRU]:
    """``nn.LSTM`` or ``nn.GRU`` themselves (a subclass may read its weights in its own code).

    Example:
        >>> is_recurrent(nn.GRU(4, 8)), is_recurrent(nn.RNN(4, 8))
        (True, False)
    """
    return type(module) in RECURRENT


def recurrent_matrices(module: nn.RNNBase) -> list[str]:
    """The weight matrices of an LSTM / GRU, in torch's order.

    Example:
        >>> recurrent_matrices(nn.GRU(4, 8, bidirectional=True))
        ['weight_ih_l0', 'weight_hh_l0', 'weight_ih_l0_reverse', 'weight_hh_l0_reverse']
    """
    return [name for name in module._flat_weights_names if name.startswith("weight_")]


def unsupported(module: nn.Module) -> str | None:
    """Why this LSTM / GRU keeps its float weights, or None when it can be quantized.

    Example:
        >>> unsupported(nn.LSTM(4, 8, proj_size=2))
        'an LSTM with proj_size > 0 has no quantized kernel here'
    """
    if getattr(module, "proj_size", 0):
        return "an LSTM with proj_size > 0 has no quantized kernel here"
    return None


def encode_matrices(module: nn.Module, names: Sequence[str], scheme: str, chain: list) -> dict[str, Encoded]:
    """The codes of the matrices ``names``: ``int8-dynamic`` takes one scale per matrix where it costs at
    most :data:`ONE_SCALE_COST` in weight error (see there), a scale per row elsewhere."""
    coded = {}
    for name in names:
        weight = getattr(module, name).detach()
        encoded = encode(weight, chain)
        if scheme_row(scheme).dynamic and chain == ["int8"]:  # torch's int8 RNN kernels: per matrix
            shared = encode(weight, [("int8", {"one_scale": True})])
            if _error(shared, weight) <= ONE_SCALE_COST * _error(encoded, weight):
                encoded = shared
        coded[name] = encoded
    return coded


def _error(encoded: Encoded, weight: torch.Tensor) -> float:
    decoded = decode(encoded.parts, encoded.stages, weight.dtype, weight.shape)
    return float((decoded.float() - weight.float()).norm())


def one_scale(scale: torch.Tensor) -> bool:
    """Whether int8 row scales are one positive scale (torch's per-tensor kernels can take the codes).

    Example:
        >>> one_scale(torch.tensor([0.5, 0.5])), one_scale(torch.tensor([0.5, 0.25]))
        (True, False)
    """
    return scale.numel() > 0 and bool((scale == scale[0]).all()) and float(scale[0]) > 0


class QuantizedRecurrent(QuantizedWeight):
    """An ``nn.LSTM`` / ``nn.GRU`` whose matrices named in ``coded`` are codec parts; the others (and the
    biases) stay float parameters under their own names."""

    REFERENCE = "dequantize"
    KERNELS: ClassVar[tuple[str, ...]] = ("dequantize",)

    def __init__(self, rnn: nn.LSTM | nn.GRU, coded: Mapping[str, Encoded]) -> None:
        super().__init__()
        self.mode = type(rnn).__name__
        for name in SETTINGS:
            setattr(self, name, getattr(rnn, name))
        self.weight_names: list[str] = list(rnn._flat_weights_names)
        # Per instance: which buffers hold which part depends on how many layers and which are coded.
        self.SLIM_PARTS: dict[str, tuple[str, str]] = {}  # type: ignore[misc]
        self.stages: dict[str, dict[str, Any]] = {}
        for name in self.weight_names:
            if name in coded:
                encoded = coded[name]
                self.stages[name] = encoded.stages[0]
                roles = INT8_PARTS if encoded.stages[0]["codec"] == "int8" else INT4_PARTS
                for attr, (_, role) in roles.items():
                    buffer = attr.replace("weight", name, 1)  # qweight_ih_l0, weight_ih_l0_scale ...
                    self.SLIM_PARTS[buffer] = (name, role)
                    self.register_buffer(buffer, encoded.parts[role].contiguous())
            else:
                self.register_parameter(name, nn.Parameter(getattr(rnn, name).detach(), requires_grad=False))
        # The float module's forward (unbatched inputs, packed sequences, hx) runs on this empty twin.
        object.__setattr__(self, "_shell", type(rnn)(**self.settings(), device="meta").eval())
        self._layer_id = next(_LAYER_IDS)
        self._init_kernels()

    def settings(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SETTINGS}

    @property
    def kind(self) -> str:
        return type(self).__name__.replace("Recurrent", self.mode)

    def stage_of(self, tensor: str = "weight") -> dict[str, Any]:
        return self.stages[tensor]

    def extra_repr(self) -> str:
        float_ones = [n for n in recurrent_matrices(self._shell) if n not in self.stages]
        kept = f", float: {', '.join(float_ones)}" if float_ones else ""
        return f"{self.mode}, " + ", ".join(f"{k}={v}" for k, v in self.settings().items()) + kept

    def float_module(self) -> nn.Module:
        rnn = type(self._shell)(**self.settings(), device="meta").eval()
        for name, tensor in self.float_weights().items():
            setattr(rnn, name, nn.Parameter(tensor.detach().clone(), requires_grad=False))
        return rnn

    def float_weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every weight and bias as the float LSTM / GRU takes them: coded matrices dequantized."""
        return {
            name: self.dequantized(dtype, name) if name in self.stages else self._float(name, dtype)
            for name in self.weight_names
        }

    def _float(self, name: str, dtype: torch.dtype | None) -> torch.Tensor:
        tensor = getattr(self, name)
        return tensor if dtype is None else tensor.to(dtype)

    def _prepared_from(self) -> list[torch.Tensor]:
        return [
            *super()._prepared_from(),
            *(self._parameters[n] for n in self.weight_names if n not in self.stages),
        ]

    def _shape_key(self) -> tuple:
        # Per layer, not per shape: whether torch's int8 kernel agrees depends on the weights and inputs
        # (a layer reading power spectra does not), so one layer's verdict must not decide another's.
        return self.mode, tuple(self.settings().values()), tuple(self.stages), self._layer_id

    def forward(self, input: Any, hx: Any = None) -> Any:
        if torch.compiler.is_exporting():  # the codes stay in the program, dequantized in its graph
            return self._float_call(input, hx, self.float_weights(_dtype(input)))
        if torch.compiler.is_compiling() and isinstance(input, torch.Tensor):
            return self.compiled_forward(input, hx)
        with torch.no_grad():  # inference only, like every quantized layer
            return self._forward(input, hx)

    def compiled_forward(self, input: torch.Tensor, hx: Any = None) -> Any:
        """Under ``torch.compile``: :meth:`eager_forward` as one operator; ``hx`` and the state it returns
        travel as a flat list (``[h]`` or ``[h, c]``)."""
        state = [] if hx is None else list(hx) if isinstance(hx, (tuple, list)) else [hx]
        with torch.no_grad():
            out, *last = kernels.quantized_rnn(input, state, self._compile_handle)
        return out, (tuple(last) if self.mode == "LSTM" else last[0])

    def eager_forward(self, input: torch.Tensor, hx: list[torch.Tensor]) -> list[torch.Tensor]:
        state = None if not hx else tuple(hx) if self.mode == "LSTM" else hx[0]
        with torch.no_grad():
            out, last = self._forward(input, state)
        return [out, *(last if self.mode == "LSTM" else (last,))]

    def fake_forward(self, input: torch.Tensor, hx: list[torch.Tensor]) -> list[torch.Tensor]:
        directions = 2 if self.bidirectional else 1
        batch = [] if input.dim() < 3 else [input.shape[0] if self.batch_first else input.shape[1]]
        states = 2 if self.mode == "LSTM" else 1
        return [
            input.new_empty(*input.shape[:-1], directions * self.hidden_size),
            *(input.new_empty(directions * self.num_layers, *batch, self.hidden_size) for _ in range(states)),
        ]

    def _forward(self, input: Any, hx: Any) -> Any:
        return self._float_call(input, hx, self.float_weights(_dtype(input)))

    def _float_call(self, input: Any, hx: Any, weights: dict[str, torch.Tensor]) -> Any:
        return torch.func.functional_call(self._shell, weights, (input, hx))


class Int8DynamicRecurrent(QuantizedRecurrent):
    """``nn.LSTM`` / ``nn.GRU`` with int8 matrices (a scale per row) and int8 activations where the
    faster kernel quantizes them (see the module docstring)."""

    SCHEME = "int8-dynamic"
    SLIM_PARTS: ClassVar[dict[str, tuple[str, str]]] = {}
    KERNELS = ("quantized_rnn", "dequantize")

    def _forward(self, input: Any, hx: Any) -> Any:
        if not (
            isinstance(input, torch.Tensor) and input.dtype == torch.float32 and input.device.type == "cpu"
        ):
            # a packed sequence, another dtype or device: the float module in the input's dtype
            return self._float_call(input, hx, self.float_weights(_dtype(input)))
        rows = _batch(input, self.batch_first)
        # once a batch size has its kernel, a call goes straight to it (the choice's key is rebuilt
        # otherwise, and its candidates made, on every call)
        known = (kernels.batch_bucket(rows), torch.get_num_threads(), self.kernel)
        name = self._run_of.get(known)
        if name is None:
            names = ["dequantize", *(["quantized_rnn"] if quantized_rnn_available() else [])]
            # Candidates are compared on the output sequence; the hidden state's last step is in it.
            outputs = {n: (lambda n=n: self._run(n, input, hx)[0]) for n in names}
            tolerance = {"quantized_rnn": RECURRENT_AGREEMENT}
            name = self._run_of[known] = self.choose(input, rows, outputs, tolerance)
        return self._run(name, input, hx)

    def _run(self, name: str, input: torch.Tensor, hx: Any) -> Any:
        if name == "quantized_rnn":
            return self._quantized_call(input, hx, self.prepared("quantized_rnn", self._packed_cells))
        # the float module, made once from the dequantized weights: torch's own call, nothing swapped in
        return self.prepared("dequantize", lambda: self.float_module().float())(input, hx)

    def _packed_cells(self) -> list[Any]:
        """Packed int8 parameters per layer and direction, as ``torch.quantized_lstm`` takes them."""
        cells = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch deprecates its quantized tensors; these live only here
            for ih, hh, b_ih, b_hh in _cell_names(self.weight_names, self.bias):
                bias_ih, bias_hh = self._bias(b_ih, ih), self._bias(b_hh, hh)
                cells.append(
                    torch.ops.quantized.make_quantized_cell_params_dynamic(
                        self._packed(ih, bias_ih), self._packed(hh, bias_hh), bias_ih, bias_hh, True
                    )
                )
        return cells

    def _bias(self, name: str | None, matrix: str) -> torch.Tensor:
        rows = self.stages[matrix]["shape"][0] if matrix in self.stages else getattr(self, matrix).shape[0]
        return torch.zeros(rows) if name is None else getattr(self, name).float()  # the kernel wants biases

    def _packed(self, name: str, bias: torch.Tensor) -> Any:
        if name not in self.stages:  # a matrix kept float: float16 in this kernel, not int8
            return torch.ops.quantized.linear_prepack_fp16(getattr(self, name).float(), bias)
        codes, scale = self.parts(name)["q"], self.parts(name)["scale"].double()
        if one_scale(scale):  # the same codes, torch's faster per-tensor kernel
            return torch.ops.quantized.linear_prepack(
                torch._make_per_tensor_quantized_tensor(codes, float(scale[0]), 0), bias
            )
        rows = torch._make_per_channel_quantized_tensor(
            codes, scale, torch.zeros_like(scale, dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(rows, bias)

    def _quantized_call(self, input: torch.Tensor, hx: Any, cells: list[Any]) -> Any:
        batched = input.dim() == 3
        if not batched:  # torch's int8 RNN takes batches only: one of one, like nn.LSTM does it
            input = input.unsqueeze(0 if self.batch_first else 1)
            hx = None if hx is None else _map(hx, lambda t: t.unsqueeze(1))
        if hx is None:
            directions = 2 if self.bidirectional else 1
            zeros = input.new_zeros(
                self.num_layers * directions, _batch(input, self.batch_first), self.hidden_size
            )
            hx = (zeros, zeros) if self.mode == "LSTM" else zeros
        args = (self.num_layers, 0.0, False, self.bidirectional, self.batch_first)
        if self.mode == "LSTM":
            out, h, c = torch.quantized_lstm(
                input, list(hx), cells, True, *args, dtype=torch.qint8, use_dynamic=True
            )
            result: Any = (out, (h, c))
        else:
            result = torch.quantized_gru(input, hx, cells, True, *args)
        if not batched:
            out, state = result
            result = (out.squeeze(0 if self.batch_first else 1), _map(state, lambda t: t.squeeze(1)))
        return result


class Int8WeightRecurrent(QuantizedRecurrent):
    """``nn.LSTM`` / ``nn.GRU`` with int8 matrices, dequantized on each call; float activations."""

    SCHEME = "int8-weight"
    SLIM_PARTS: ClassVar[dict[str, tuple[str, str]]] = {}


class Int4WeightRecurrent(QuantizedRecurrent):
    """``nn.LSTM`` / ``nn.GRU`` with 4-bit matrices in groups, dequantized on each call."""

    SCHEME = "int4-weight"
    SLIM_PARTS: ClassVar[dict[str, tuple[str, str]]] = {}


def quantized_rnn_available() -> bool:
    """torch's int8 RNN kernels (deprecated with the rest of ``torch.ao`` quantization) exist here."""
    ops = torch.ops.quantized
    return all(hasattr(torch, f) for f in ("quantized_lstm", "quantized_gru")) and all(
        hasattr(ops, op)
        for op in ("linear_prepack", "linear_prepack_fp16", "make_quantized_cell_params_dynamic")
    )


def _cell_names(names: list[str], bias: bool) -> list[tuple[str, str, str | None, str | None]]:
    """(weight_ih, weight_hh, bias_ih, bias_hh) names of each layer and direction, in torch's order."""
    per_cell = 4 if bias else 2
    cells = []
    for start in range(0, len(names), per_cell):
        group = names[start : start + per_cell]
        cells.append((group[0], group[1], group[2] if bias else None, group[3] if bias else None))
    return cells


def _batch(input: torch.Tensor, batch_first: bool) -> int:
    if input.dim() < 3:
        return 1
    return input.shape[0] if batch_first else input.shape[1]


def _dtype(input: Any) -> torch.dtype:
    data = input.data if isinstance(input, nn.utils.rnn.PackedSequence) else input
    return data.dtype


def _map(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tuple(fn(t) for t in state) if isinstance(state, (tuple, list)) else fn(state)
