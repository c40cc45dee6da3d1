"""The few layers whose quantization error would dominate the model's, measured, to keep them float.

A *unit* is a layer, or one matrix of an LSTM / GRU. It is judged by its weights: the RMS rounding error
the codes leave (shrink's test, :mod:`slimtorch.format.sensitive`; embeddings are left out, their rows
have no input to be compared against). With calibration inputs it is also judged by the relative error
of its layer's output when only that unit is quantized: the float model runs once per input, and a hook
runs each unit's quantized twin on the very arguments its layer got. Either test can keep a unit float:
random example inputs (the CLI's) may not exercise what real ones do.

A unit is kept float when its error is :data:`~slimtorch.format.sensitive.DOMINANT` times the median
unit's or more (at most a tenth of the units, worst first) and, for output errors, at least
:data:`OUTPUT_ERROR_FLOOR`. The case it is for: resemblyzer's speaker encoder, whose first LSTM layer
reads power mel bands through weights up to 61 (its others stay under 6): its rounding error is 6.4x the
median, its output error on synthetic voices 112x (9x on Gaussian noise, 1x on uniform noise), and
quantizing that one matrix alone drops the embedding cosine to 0.48; everything else quantized, it stays
above 0.99.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from slimtorch.format.progress import Progress, task
from slimtorch.format.sensitive import dominant_errors, rounding_error
from slimtorch.quant.build import quantized_from
from slimtorch.quant.modules import QuantizedWeight
from slimtorch.quant.targets import Target

OUTPUT_ERROR_FLOOR = 0.02
"""Relative output error under which no layer is worth keeping float, however it compares (int8 layers
sit around 0.5%, int4 ones around 5%)."""
OVERRIDE = "keep_sensitive=False / --quantize-all quantizes it anyway"


def sensitive_units(
    model: nn.Module,
    targets: list[Target],
    twin: Callable[[Target, str], QuantizedWeight],
    inputs: list[Any],
    call: Callable[[nn.Module, Any], Any],
    codec: str,
    group_size: int,
    progress: Progress | None = None,
) -> dict[str, str]:
    """Unit name -> why it stays float, for the units whose error dominates.

    ``twin(target, unit)`` is the layer with only that unit quantized; ``call(model, sample)`` runs the
    model on one calibration input; ``codec`` is ``"int8"`` or ``"int4"`` (for the weight statistics);
    ``progress`` hears of each input run.
    """
    weights = {
        unit: rounding_error(weight.detach(), codec, group_size)
        for target in targets
        if not isinstance(target.module, nn.Embedding)
        for unit, weight in target.weights().items()
    }
    kept = {
        k.name: f"its {codec} rounding error is {k.ratio:.1f}x the median weight's: kept float ({OVERRIDE})"
        for k in dominant_errors(weights)
    }
    if inputs:
        errors = output_errors(model, targets, twin, inputs, call, progress)
        median = statistics.median(errors.values()) if errors else 0.0
        for k in dominant_errors(errors):
            if k.error >= OUTPUT_ERROR_FLOOR:
                kept[k.name] = (
                    f"its output error {k.error:.1%} is {k.ratio:.0f}x the median layer's ({median:.2%}) "
                    f"on the calibration inputs: kept float ({OVERRIDE})"
                )
    return kept


def output_errors(
    model: nn.Module,
    targets: list[Target],
    twin: Callable[[Target, str], QuantizedWeight],
    inputs: list[Any],
    call: Callable[[nn.Module, Any], Any],
    progress: Progress | None = None,
) -> dict[str, float]:
    """Relative L2 error of each unit's layer output when only that unit is quantized, over ``inputs``."""
    units = {t.name: [(unit, twin(t, unit)) for unit in t.weights()] for t in targets}
    errors = OutputErrors()

    def compare(name: str, args: tuple, kwargs: dict, out: Any) -> None:
        want = flat_outputs(out)
        for unit, quantized in units[name]:
            errors.add(unit, flat_outputs(quantized(*args, **kwargs)), want)

    with watching_outputs({t.name: t.module for t in targets}, compare):
        each_sample(inputs, lambda sample: call(model, sample), progress, "measuring each layer's error")
    return errors.ratios()


def each_sample(
    inputs: list[Any], run: Callable[[Any], Any], progress: Progress | None, label: str
) -> list[Any]:
    """``run(sample)`` for each calibration input, in order, told to ``progress`` as one task counted in
    inputs: a large model's forward pass takes seconds. Without inputs there is no task at all."""
    results = []
    if inputs:
        with task(progress, label, len(inputs), unit="items") as advance:
            for sample in inputs:
                results.append(run(sample))
                advance(1)
    return results


class OutputErrors:
    """Relative L2 error of outputs against their float reference, summed over calls, by key."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}

    def add(self, key: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """One call's outputs (a shape mismatch counts for nothing: there is nothing to compare)."""
        sums = self._sums.setdefault(key, [0.0, 0.0])
        if got.shape == want.shape:
            sums[0] += float(torch.linalg.vector_norm(got - want)) ** 2
            sums[1] += float(torch.linalg.vector_norm(want)) ** 2

    def ratios(self) -> dict[str, float]:
        """Key -> relative error, for the keys whose reference was ever non-zero."""
        return {key: (err / ref) ** 0.5 for key, (err, ref) in self._sums.items() if ref}


@contextlib.contextmanager
def watching_outputs(
    modules: Mapping[str, nn.Module], on_output: Callable[[str, tuple, dict, Any], None]
) -> Iterator[None]:
    """Inside, ``on_output(name, args, kwargs, output)`` sees every call of each named module; the hooks
    are removed whatever happens."""
    handles = [
        module.register_forward_hook(
            lambda _m, args, kwargs, out, name=name: on_output(name, args, kwargs, out), with_kwargs=True
        )
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def one_unit_quantized(
    twins: dict[str, QuantizedWeight], scheme: str, group_size: int
) -> Callable[[Target, str], QuantizedWeight]:
    """``build(target, unit)``: the layer with only that unit quantized, for :func:`sensitive_units`: the
    layer's twin, or an LSTM / GRU with that one matrix coded (run by ``dequantize``, so that it is judged
    by its codes, not by which kernel happens to be faster).

    Example:
        >>> lstm = torch.nn.LSTM(8, 8)
        >>> build = one_unit_quantized({}, "int8-dynamic", 128)
        >>> list(build(Target("lstm", lstm, ("weight_ih_l0", "weight_hh_l0")), "lstm.weight_hh_l0").stages)
        ['weight_hh_l0']
    """

    def build(target: Target, unit: str) -> QuantizedWeight:
        if not target.matrices:
            return twins[target.name]
        matrix = unit.removeprefix(f"{target.name}.") if target.name else unit
        single = quantized_from(target.module, scheme, group_size, matrices=(matrix,))
        single.kernel = "dequantize"
        return single

    return build


def without_units(
    targets: list[Target],
    twins: dict[str, QuantizedWeight],
    sensitive: dict[str, str],
    scheme: str,
    group_size: int,
) -> tuple[list[Target], dict[str, QuantizedWeight]]:
    """The targets and their twins once the ``sensitive`` units stay float: a layer dropped, an LSTM / GRU
    rebuilt with its other matrices coded (dropped too when none is left)."""
    kept, rebuilt = [], {}
    for target in targets:
        units = set(target.weights())
        if not units & set(sensitive):
            kept.append(target)
            rebuilt[target.name] = twins[target.name]
            continue
        matrices = tuple(m for m in target.matrices if f"{target.name}.{m}" not in sensitive)
        if matrices:
            target = Target(target.name, target.module, matrices)
            kept.append(target)
            rebuilt[target.name] = quantized_from(target.module, scheme, group_size, matrices=matrices)
    return kept, rebuilt


def flat_outputs(value: Any) -> torch.Tensor:
    """Every float tensor of a layer's output (an LSTM's is a tuple), flattened into one, in float32."""
    tensors = list(_floats(value))
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _floats(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value.detach().float()
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floats(item)
