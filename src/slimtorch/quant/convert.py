"""``slimtorch.quantize``: swap a model's layers for quantized ones, and report the cost.

Layers: ``nn.Linear`` (and Hugging Face's ``Conv1D``), ``nn.Embedding``, ``nn.LSTM`` / ``nn.GRU`` (each
matrix coded on its own: :mod:`slimtorch.quant.recurrent`), and zero-padded convolutions for the
weight-only schemes. Every layer holding a real share of the weights that stays float is listed in the
report with the reason (:mod:`slimtorch.quant.targets`), and so are the few kept float because their
error would dominate the model's (:mod:`slimtorch.quant.sensitivity`); a model where nothing could be
quantized is an error.

Schemes:

- ``int8-dynamic``: int8 weights (a scale per output channel) and int8 activations (a scale per row,
  computed on each call); the matmul runs on int8 kernels. Embeddings get int8 rows.
- ``int8-weight``: int8 weights, float activations (computed in the input's dtype).
- ``int4-weight``: 4-bit weights with a scale and zero point per group of ``group_size`` inputs; int4
  embedding rows.

How is :class:`~slimtorch.quant.options.QuantizeOptions` (a recipe records it); the verb changes the
model in place and returns a :class:`QuantizeReport` that holds it.

The model remembers what was quantized (its structural delta), so :func:`slimtorch.save_model` stores the
codes as they are and :func:`slimtorch.load_model` rebuilds the quantized layers around them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from slimtorch.calibration.moments import InputMoments
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.codecs.chain import CodecError
from slimtorch.format.delta import StructuralDelta, delta_of, record
from slimtorch.format.pending import wait_for_checks
from slimtorch.format.progress import Progress, announcer, task
from slimtorch.format.source import dtype_name
from slimtorch.format.verbs import NOT_JSON, Report, resolve
from slimtorch.graph.capture import as_args
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.quant import kernels, rowcodes
from slimtorch.quant.awq import awq_scale
from slimtorch.quant.build import quantized_from
from slimtorch.quant.modules import Int8DynamicLinear, QuantizedWeight
from slimtorch.quant.options import QuantizeOptions
from slimtorch.quant.readers import watching_weight_reads
from slimtorch.quant.recorded import put_module
from slimtorch.quant.recurrent import QuantizedRecurrent
from slimtorch.quant.sensitivity import (
    OutputErrors,
    each_sample,
    flat_outputs,
    one_unit_quantized,
    sensitive_units,
    watching_outputs,
    without_units,
)
from slimtorch.quant.sharing import share_input_codes
from slimtorch.quant.targets import (
    FloatLayer,
    Target,
    check_skip_patterns,
    choose_targets,
    kept_float,
    weight_bytes,
)
from slimtorch.schemes import scheme as scheme_row


@dataclass(frozen=True)
class LayerResult:
    """One quantized layer: its weight's bytes before and after, and its errors."""

    name: str
    kind: str
    before_bytes: int
    after_bytes: int
    weight_error: float
    """relative L2 error of the dequantized weight"""
    output_error: float | None = None
    """relative L2 error of the layer's output against the float layer on the same inputs (calibration)"""


@dataclass(frozen=True)
class QuantizeReport(Report):
    """What :func:`quantize` did, and the model it did it to; ``to_dict()`` is the ``--json`` output."""

    SCHEMA: ClassVar[str] = "slimtorch.quantize/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {
        "ratio": {"type": "number"},
        "weight_ratio": {"type": "number"},
    }

    scheme: str
    group_size: int | None
    layers: list[LayerResult]
    skipped: dict[str, str]
    """module name -> why it kept its float weights"""
    before_bytes: int
    """the model's parameters and buffers, before"""
    after_bytes: int
    samples: int = 0
    output_cosine: float | None = None
    """cosine similarity of the model's outputs with the float model's, over the calibration inputs"""
    output_max_abs: float | None = None
    notes: list[str] = field(default_factory=list)
    kernels: list[str] = field(default_factory=list)
    """how the quantized layers run in this process where it depends on what is installed (int8-dynamic:
    activation rows quantized by numba's fused kernel, or torch's operations and why)"""
    kept_float: list[FloatLayer] = field(default_factory=list)
    """the layers (and LSTM / GRU matrices) left float that hold a real share of the weights, largest
    first, each with the reason; the rest are summed up in ``notes``"""
    model: nn.Module | None = field(default=None, repr=False, compare=False, metadata=NOT_JSON)
    """the quantized model (the one passed in, changed in place)"""

    @property
    def ratio(self) -> float:
        return self.after_bytes / self.before_bytes if self.before_bytes else 1.0

    @property
    def weight_ratio(self) -> float:
        """Bytes of the quantized layers' weights, after / before."""
        before = sum(layer.before_bytes for layer in self.layers)
        return sum(layer.after_bytes for layer in self.layers) / before if before else 1.0


def quantize(
    model: nn.Module,
    /,
    options: QuantizeOptions | str | None = None,
    *,
    calibration: Iterable[Any] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> QuantizeReport:
    """Quantize a model's Linear, Embedding, LSTM and GRU layers in place; the report holds the model,
    its sizes and errors, and the layers left float with the reason.

    Args:
        model: any model; layers are swapped where they sit.
        options: a :class:`QuantizeOptions`, or its scheme alone (``"int4-weight"``), or None for the
            defaults; keyword ``overrides`` replace single fields (``group_size=64``, ``skip=["fc"]``).
        calibration: sample inputs (each a tensor, a tuple of arguments or a dict of keyword arguments);
            with them the report measures each layer's output error and the model's output agreement,
            the sensitivity check measures output errors besides judging weights, and
            ``int4-weight`` chooses its codes by GPTQ (errors spread where these inputs feel them
            least) instead of rounding each weight.
        progress: told how many bytes got quantized and, with ``calibration``, of each input the float
            model, the sensitivity check and the final comparison run (:mod:`slimtorch.format.progress`);
            None: silent.

    Example:
        >>> import slimtorch, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Conv1d(4, 4, 3))
        >>> report = slimtorch.quantize(model, "int8-dynamic")
        >>> type(report.model[0]).__name__, [(k.name, k.reason[:28]) for k in report.kept_float]
        ('Int8DynamicLinear', [('1', 'int8-dynamic has no convolut')])
    """
    chosen = _options(options, overrides)
    wait_for_checks(model)  # the weights are read (quantized) outside a forward
    scheme, group_size = chosen.scheme, chosen.group_size
    row = scheme_row(scheme)
    check_skip_patterns(model, chosen.skip)
    choice = choose_targets(model, scheme, chosen.skip, chosen.embeddings)
    skipped = choice.skipped
    inputs = list(calibration) if calibration is not None else []
    if chosen.awq and not inputs:
        raise OptionError(
            "awq chooses its scales from calibration inputs: quantize(model, 'int4-weight', awq=True, "
            "calibration=batches)"
        )
    before, weights_before = model_bytes(model), weight_bytes(model)
    was_training = model.training
    model.eval()
    awq_notes: list[str] = []
    try:
        with torch.no_grad():
            linear = {
                t.name: t.module
                for t in choice.targets
                if type(t.module) is nn.Linear or is_hf_conv1d(t.module)
            }
            if chosen.awq:  # before anything reads the weights: the scaled ones are what gets quantized
                plain: dict[str, nn.Module] = {n: m for n, m in linear.items() if type(m) is nn.Linear}
                awq_notes = awq_scale(model, plain, inputs, group_size, say=announcer(progress))
            moments = InputMoments(linear if row.codec == "int4" and chosen.gptq else {})  # GPTQ's codes
            candidates = {t.name: t.module for t in choice.targets}
            with moments.recording(), watching_weight_reads(candidates) as readers:
                references = each_sample(
                    inputs, lambda s: _outputs(_call(model, s)), progress, "running the float model"
                )
            for name, where in readers.items():  # the swap would take away a weight their model reads
                skipped[name] = f"its weight is read outside its forward ({where}): kept float"
            choice.targets = [t for t in choice.targets if t.name not in readers]
            targets, twins = _twins(choice.targets, chosen, moments, skipped, progress)
            sensitive: dict[str, str] = {}
            if chosen.keep_sensitive:
                build = one_unit_quantized(twins, scheme, group_size)
                sensitive = sensitive_units(
                    model, targets, build, inputs, _call, row.codec, group_size, progress
                )
                targets, twins = without_units(targets, twins, sensitive, scheme, group_size)
                skipped.update(sensitive)
            if not twins:
                kept, _ = kept_float(model, skipped, set(skipped), weights_before)
                raise SlimtorchError(_nothing_quantized(scheme, kept))
            originals, layers = {}, []
            for target in targets:
                quantized = twins[target.name]
                quantized.kernel = chosen.kernel if chosen.kernel in type(quantized).KERNELS else None
                put_module(model, target.name, quantized)
                originals[target.name] = target.module
                layers.append(_layer_result(target, quantized))
            record(model, StructuralDelta(quantized=_recorded(twins, scheme, group_size)))
            share_input_codes(model)
            output_errors, agreement = _calibrate(model, inputs, references, originals, progress)
    finally:
        model.train(was_training)
    if output_errors:
        layers = [LayerResult(**{**asdict(r), "output_error": output_errors.get(r.name)}) for r in layers]
    listed = {
        name for name, why in skipped.items() if name in sensitive or "skip pattern" in why or name in readers
    }
    float_layers, summary = kept_float(model, skipped, listed, weights_before)
    return QuantizeReport(
        scheme,
        group_size if row.grouped else None,
        layers,
        skipped,
        before,
        model_bytes(model),
        len(inputs),
        *agreement,
        notes=([summary] if summary else []) + awq_notes,
        kernels=_kernel_notes(scheme, layers),
        kept_float=float_layers,
        model=model,
    )


def _kernel_notes(scheme: str, layers: list[LayerResult]) -> list[str]:
    """How int8-dynamic layers run in this process: how their activations are quantized (the fused kernel
    or torch's operations, and why), whether this CPU's oneDNN product saturates, and the kernel each
    layer shape got at each batch size the calibration ran, with the timing and refusals behind it. A
    speed that depends on the CPU or an optional package is said, not left to guess."""
    if not scheme_row(scheme).dynamic or not layers:
        return []
    notes = [f"activation rows quantized with {rowcodes.describe()}"]
    if kernels.onednn_available() and not kernels.onednn_exact("uint8"):
        notes.append(
            "oneDNN's 8-bit product saturates on this CPU (no VNNI): its kernel here takes 7-bit "
            "asymmetric activation codes per row (onednn-u7)"
        )
    for key, decision in kernels.CHOICES.decisions().items():
        if isinstance(key, tuple) and key and key[0] == Int8DynamicLinear.__name__:
            out_features, in_features = key[1]
            notes.append(f"{in_features}->{out_features} at {key[3]} rows: {decision.describe()}")
    return notes


def _options(options: QuantizeOptions | str | None, overrides: dict[str, Any]) -> QuantizeOptions:
    """The options :func:`quantize` runs with; a string is the scheme alone, the shorthand every call
    before :class:`QuantizeOptions` wrote (``quantize(model, "int4-weight")``)."""
    if isinstance(options, str):
        if "scheme" in overrides:
            raise OptionError(
                f"quantize: the scheme is given twice ({options!r} and {overrides['scheme']!r})"
            )
        options, overrides = None, {"scheme": options, **overrides}
    return resolve(QuantizeOptions, options, overrides, "quantize")


def _twins(
    targets: list[Target],
    options: QuantizeOptions,
    moments: InputMoments,
    skipped: dict[str, str],
    progress: Progress | None,
) -> tuple[list[Target], dict[str, QuantizedWeight]]:
    """The quantized twin of each target (those whose weights the codecs can hold)."""
    kept, twins = [], {}
    total = sum(t.nbytes() for t in targets)
    with task(progress, "quantizing", total) as advance:
        for target in targets:
            try:
                hessian = moments.hessian(target.name)
                twins[target.name] = quantized_from(
                    target.module,
                    options.scheme,
                    options.group_size,
                    hessian,
                    target.matrices,
                    options.int4_grid,
                )
                kept.append(target)
            except CodecError as exc:  # inf or nan in a weight: a scale cannot hold them
                skipped[target.name] = f"its weight cannot be quantized ({exc})"
            finally:
                advance(target.nbytes())
    return kept, twins


def _nothing_quantized(scheme: str, listed: list[FloatLayer]) -> str:
    if not listed:
        return (
            f"nothing to quantize with {scheme}: the model has no Linear, Embedding, LSTM, GRU or conv layer"
        )
    why = "; ".join(f"{layer.name}: {layer.reason}" for layer in listed[:2])
    more = f" (and {len(listed) - 2} more)" if len(listed) > 2 else ""
    return f"nothing in this model could be quantized with {scheme}: {why}{more}"


def dequantize(model: nn.Module) -> list[str]:
    """Swap every quantized layer back for the float layer it stands for, in place, holding the
    dequantized weight (exactly the values the codes encode); returns the layers' names.

    For runtimes that have no use for these layers' kernels: ONNX export, for one, which re-quantizes
    int8 weights to the same codes.

    Example:
        >>> import slimtorch, torch
        >>> model = slimtorch.quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)), "int8-weight").model
        >>> dequantize(model), type(model[0]).__name__
        (['0'], 'Linear')
    """
    layers = {name: module for name, module in model.named_modules() if isinstance(module, QuantizedWeight)}
    for name, layer in layers.items():
        put_module(model, name, layer.float_module())
    names = list(layers)
    delta = delta_of(model)
    if delta is not None:  # a save must not record layers that are float again
        delta.quantized = {k: v for k, v in delta.quantized.items() if k not in names}
    return names


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


# -- results ----------------------------------------------------------------------------------
def _recorded(twins: dict[str, QuantizedWeight], scheme: str, group_size: int) -> dict[str, dict[str, Any]]:
    group = group_size if scheme_row(scheme).grouped else None
    recorded = {}
    for name, twin in twins.items():
        how: dict[str, Any] = {"scheme": scheme, "group_size": group, "dtype": dtype_name(twin.weight_dtype)}
        if isinstance(twin, QuantizedRecurrent):
            how["matrices"] = list(twin.stages)  # the others stay float, stored as they are
        recorded[name] = how
    return recorded


def _layer_result(target: Target, quantized: QuantizedWeight) -> LayerResult:
    error = norm = 0.0
    for unit, weight in target.weights().items():
        tensor = unit.rpartition(".")[2] if target.matrices else "weight"
        reference = weight.detach().float()
        error += (
            float(torch.linalg.vector_norm(quantized.dequantized(torch.float32, tensor) - reference)) ** 2
        )
        norm += float(torch.linalg.vector_norm(reference)) ** 2
    after = sum(
        getattr(quantized, a).numel() * getattr(quantized, a).element_size() for a in quantized.SLIM_PARTS
    )
    return LayerResult(
        target.name, quantized.kind, target.nbytes(), after, (error / norm) ** 0.5 if norm else 0.0
    )


# -- calibration ----------------------------------------------------------------------------------------
def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    return model(*as_args(sample))


def _outputs(value: Any) -> list[torch.Tensor]:
    """The float tensors of a model's output (a tensor, a tuple, a dict or a Hugging Face ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value.detach().float()] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _outputs(item)]
    return []


def _calibrate(
    model: nn.Module,
    inputs: list[Any],
    references: list[list[torch.Tensor]],
    originals: dict[str, nn.Module],
    progress: Progress | None,
) -> tuple[dict[str, float], tuple[float | None, float | None]]:
    """Each quantized layer's output error against its float layer, and the model's output agreement."""
    if not inputs:
        return {}, (None, None)
    errors = OutputErrors()

    def compare(name: str, args: tuple, kwargs: dict, out: Any) -> None:
        errors.add(name, flat_outputs(out), flat_outputs(originals[name](*args, **kwargs)))

    modules = dict(model.named_modules())
    agreement = _Agreement()
    wanted = iter(references)
    with watching_outputs({name: modules[name] for name in originals}, compare):
        each_sample(
            inputs,
            lambda s: agreement.add(_outputs(_call(model, s)), next(wanted)),
            progress,
            "comparing with the float model",
        )
    ratios = errors.ratios()
    return {name: ratios.get(name, 0.0) for name in originals}, agreement.result()


class _Agreement:
    """The cosine and the largest difference of every output of every sample, taken together as one
    vector, summed a sample at a time: a language model's logits over many calibration sequences are
    gigabytes, never concatenated (they once took 24 GB for 16,000 tokens of a 49,152-word vocabulary)."""

    CHUNK = 1 << 22

    def __init__(self) -> None:
        self.dot = self.got = self.want = self.largest = 0.0
        self.count, self.alike = 0, True

    def add(self, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
        if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=False)):
            self.alike = False
            return
        for g, w in zip(got, want, strict=True):
            flat_g, flat_w = g.reshape(-1), w.reshape(-1)
            for start in range(0, flat_g.numel(), self.CHUNK):  # float64 a chunk at a time
                g64 = flat_g[start : start + self.CHUNK].double()
                w64 = flat_w[start : start + self.CHUNK].double()
                self.dot += float(g64 @ w64)
                self.got += float(g64 @ g64)
                self.want += float(w64 @ w64)
                self.largest = max(self.largest, float((g64 - w64).abs().max()))
            self.count += g.numel()

    def result(self) -> tuple[float | None, float | None]:
        if not self.alike or not self.count:
            return None, None
        norms = max(self.got**0.5, 1e-8) * max(self.want**0.5, 1e-8)  # torch's cosine_similarity's eps
        return self.dot / norms, self.largest
