"""How close an exported model must stay to eager PyTorch, and how close each of its outputs came.

:class:`Tolerance` is the bound (absolute, relative to the output's largest magnitude, or a text model's
embedding cosine); :func:`output_errors` is each output's worst agreement over the samples compared;
:func:`noise_aware` widens the fp32 bound to a model's own rounding noise, where that noise exceeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from torch import nn

from slimtorch.deploy import fidelity, runner
from slimtorch.deploy.noise import NOISE_FACTOR, rounding_noise
from slimtorch.errors import SlimtorchError


@dataclass(frozen=True)
class Tolerance:
    """Pass when ``max |exported - eager| <= atol + rtol * max |eager|`` on every output; or, with
    ``min_cosine``, when every text's embedding has at least that cosine to eager (each output's error is
    then reported, not decided on). ``meaning`` says which decides."""

    atol: float
    rtol: float
    meaning: str
    min_cosine: float | None = None


FP32 = Tolerance(1e-4, 1e-5, "fp32: within 1e-4 (+1e-5 of the output's largest magnitude) of eager")
INT8 = Tolerance(0.0, 0.1, "quantized: within 10% of the output's largest magnitude of eager")
INT8_TEXT = Tolerance(
    0.0,
    0.1,
    f"quantized text model: decided by the sentence embedding, cosine to eager >= {fidelity.MIN_COSINE:g} "
    "for every text; each output's largest error is reported beside it (10% of its largest magnitude "
    "marks it), not decided on",
    fidelity.MIN_COSINE,
)


@dataclass(frozen=True)
class OutputError:
    """The largest difference from eager over all samples, absolute and relative to the output's scale."""

    name: str
    max_abs: float
    max_rel: float
    scale: float
    passed: bool


def default_tolerance(quantized: bool, source: fidelity.EmbeddingSource | None) -> Tolerance:
    """:data:`FP32`; quantized, :data:`INT8_TEXT` for a model with a sentence embedding, else :data:`INT8`."""
    if not quantized:
        return FP32
    return INT8_TEXT if source is not None else INT8


def output_errors(
    names: list[str],
    expected: list[dict[str, np.ndarray]],
    actual: list[list[np.ndarray]],
    tolerance: Tolerance,
) -> tuple[OutputError, ...]:
    """Each output's worst agreement over the samples: ``expected`` eager's outputs by name, ``actual``
    the exported model's in ``names``' order, one entry per sample."""
    found = []
    for want, got in zip(expected, actual, strict=False):
        if len(got) != len(want):
            raise SlimtorchError(f"the exported model gives {len(got)} output(s), eager PyTorch {len(want)}")
        found.append(runner.compare_outputs(want, dict(zip(names, got, strict=False))))
    limits = asdict(tolerance)
    return tuple(
        OutputError(
            name,
            max(f[name]["max_abs"] for f in found),
            max(f[name]["max_rel"] for f in found),
            max(f[name]["scale"] for f in found),
            all(runner.passes(f[name], limits) for f in found),
        )
        for name in names
    )


def noise_aware(
    model: nn.Module,
    inputs: list[tuple],
    kwargs: Mapping[str, Any],
    expected: Sequence[Sequence[Any]],
    flatten: Callable[[Any], list[tuple[str, Any]]],
) -> tuple[Tolerance, str]:
    """:data:`FP32` widened to the model's own rounding noise, and a note saying what was measured.

    ``expected`` holds eager's output tensors per sample; ``flatten`` names a raw output's tensors as the
    export did, so the float64 run is compared output for output."""
    noise = rounding_noise(model, inputs, expected, lambda m, a: m(*a, **kwargs), flatten)
    if noise is None:
        return FP32, "the model cannot run in float64, so the fp32 tolerance is the default 1e-4"
    if NOISE_FACTOR * noise <= FP32.atol:
        return FP32, f"eager fp32 is within {noise:.2g} of fp64: the default fp32 tolerance stands"
    atol = NOISE_FACTOR * noise
    return (
        Tolerance(
            atol,
            FP32.rtol,
            f"fp32, noise-aware: within {atol:.3g} (+1e-5 of the output's largest magnitude) of eager: "
            f"{NOISE_FACTOR:g} x the model's own rounding noise, max|eager fp32 - eager fp64| = "
            f"{noise:.3g}, which exceeds the default 1e-4",
        ),
        f"eager fp32 is itself {noise:.2g} from fp64 on this model, so verification allows "
        f"{NOISE_FACTOR:g} x that ({atol:.2g}) instead of 1e-4",
    )
