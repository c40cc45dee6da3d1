"""``slimtorch.quantize``: swap a model's Linear and Embedding layers for quantized ones, and report the cost.

Schemes:

- ``int8-dynamic``: int8 weights (a scale per output channel) and int8 activations (a scale per row,
  computed on each call); the matmul runs on int8 kernels. Embeddings get int8 rows.
- ``int8-weight``: int8 weights, float activations (computed in the input's dtype).
- ``int4-weight``: 4-bit weights with a scale and zero point per group of ``group_size`` inputs; int4
  embedding rows.

The model remembers what was quantized (its structural delta), so :func:`slimtorch.save_model` stores the
codes as they are and :func:`slimtorch.load_model` rebuilds the quantized layers around them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from slimtorch.errors import SlimtorchError
from slimtorch.graph.capture import as_args
from slimtorch.graph.layers import is_hf_conv1d
from slimtorch.io.codecs.chain import CodecError
from slimtorch.io.codecs.lossy import INT4_GROUP_SIZES
from slimtorch.prune.delta import StructuralDelta, delta_of, record
from slimtorch.quant.build import CONV, LINEAR, SCHEMES, float_weight, quantized_from
from slimtorch.quant.conv import quantizable_conv
from slimtorch.quant.gptq import InputMoments
from slimtorch.quant.modules import QuantizedWeight
from slimtorch.quant.recorded import put_module, quantizable_type
from slimtorch.report.progress import ByteProgress

PROGRESS_DELAY_S = 1.0


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
class QuantizeReport:
    """What :func:`quantize` did; ``to_dict()`` is the ``--json`` output."""

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

    @property
    def ratio(self) -> float:
        return self.after_bytes / self.before_bytes if self.before_bytes else 1.0

    @property
    def weight_ratio(self) -> float:
        """Bytes of the quantized layers' weights, after / before."""
        before = sum(layer.before_bytes for layer in self.layers)
        return sum(layer.after_bytes for layer in self.layers) / before if before else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "slimtorch.quantize/1",
            **asdict(self),
            "ratio": self.ratio,
            "weight_ratio": self.weight_ratio,
        }


def quantize(
    model: nn.Module,
    scheme: str = "int8-dynamic",
    *,
    group_size: int = 128,
    skip: Sequence[str] = (),
    calibration: Iterable[Any] | None = None,
    embeddings: bool = True,
    kernel: str | None = None,
    progress: bool | None = None,
) -> nn.Module:
    """Quantize a model's ``nn.Linear`` and ``nn.Embedding`` layers in place; returns the model.

    Args:
        model: any model; layers are swapped where they sit.
        scheme: ``"int8-dynamic"`` (fastest on CPU), ``"int8-weight"`` or ``"int4-weight"``.
        group_size: inputs sharing one int4 scale and zero point (even, 32 to 256).
        skip: module names or patterns (``"classifier"``, ``"*.pooler.*"``) that stay float.
        calibration: sample inputs (each a tensor, a tuple of arguments or a dict of keyword arguments);
            with them the report measures each layer's output error and the model's output agreement,
            and ``int4-weight`` chooses its codes by GPTQ (errors spread where these inputs feel them
            least) instead of rounding each weight.
        embeddings: quantize ``nn.Embedding`` too (int8 or int4 rows).
        kernel: force one kernel (``"onednn"``, ``"int_mm"``, ``"dequantize"``, ``"int8pack"``,
            ``"int4pack"``, and the weight-only ones with ``-bf16``); None times the candidates on
            first use and keeps the fastest.
        progress: a progress bar on stderr for work over a second; None: only on a terminal.

    Example:
        >>> import slimtorch, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU())
        >>> model = slimtorch.quantize(model, "int8-dynamic")
        >>> type(model[0]).__name__
        'Int8DynamicLinear'
    """
    quantize_with_report(
        model,
        scheme,
        group_size=group_size,
        skip=skip,
        calibration=calibration,
        embeddings=embeddings,
        kernel=kernel,
        progress=progress,
    )
    return model


def quantize_with_report(
    model: nn.Module,
    scheme: str = "int8-dynamic",
    *,
    group_size: int = 128,
    skip: Sequence[str] = (),
    calibration: Iterable[Any] | None = None,
    embeddings: bool = True,
    kernel: str | None = None,
    progress: bool | None = None,
) -> tuple[nn.Module, QuantizeReport]:
    """:func:`quantize`, plus a :class:`QuantizeReport` of sizes and errors."""
    _check_options(scheme, group_size, kernel)
    targets, skipped = _targets(model, scheme, tuple(skip), embeddings)
    inputs = list(calibration) if calibration is not None else []
    before = model_bytes(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            linear = {n: m for n, m in targets if type(m) is nn.Linear or is_hf_conv1d(m)}
            moments = InputMoments(linear if scheme == "int4-weight" else {})
            with moments.recording():
                references = [_outputs(_call(model, sample)) for sample in inputs]
            originals, layers = {}, []
            total = sum(_weight_bytes(module) for _, module in targets)
            with ByteProgress("quantizing", total, delay=PROGRESS_DELAY_S, enabled=progress) as bar:
                for name, module in targets:
                    try:
                        quantized = quantized_from(module, scheme, group_size, moments.hessian(name))
                    except CodecError as exc:  # inf or nan in a weight: a scale cannot hold them
                        skipped[name] = f"its weight cannot be quantized ({exc})"
                        continue
                    finally:
                        bar.advance(_weight_bytes(module))
                    quantized.kernel = kernel if kernel in type(quantized).KERNELS else None
                    put_module(model, name, quantized)
                    originals[name] = module
                    layers.append(_layer_result(name, module, quantized))
            record(model, StructuralDelta(quantized=_recorded(originals, scheme, group_size)))
            output_errors, agreement = _calibrate(model, inputs, references, originals)
    finally:
        model.train(was_training)
    if output_errors:
        layers = [LayerResult(**{**asdict(r), "output_error": output_errors.get(r.name)}) for r in layers]
    report = QuantizeReport(
        scheme,
        group_size if scheme == "int4-weight" else None,
        layers,
        skipped,
        before,
        model_bytes(model),
        len(inputs),
        *agreement,
    )
    return model, report


def dequantize(model: nn.Module) -> list[str]:
    """Swap every quantized layer back for the float layer it stands for, in place, holding the
    dequantized weight (exactly the values the codes encode); returns the layers' names.

    For runtimes that have no use for these layers' kernels: ONNX export, for one, which re-quantizes
    int8 weights to the same codes.

    Example:
        >>> import slimtorch, torch
        >>> model = slimtorch.quantize(torch.nn.Sequential(torch.nn.Linear(64, 64)), "int8-weight")
        >>> dequantize(model), type(model[0]).__name__
        (['0'], 'Linear')
    """
    names = [name for name, module in model.named_modules() if isinstance(module, QuantizedWeight)]
    for name in names:
        put_module(model, name, model.get_submodule(name).float_module())
    delta = delta_of(model)
    if delta is not None:  # a save must not record layers that are float again
        delta.quantized = {k: v for k, v in delta.quantized.items() if k not in names}
    return names


def _weight_bytes(module: nn.Module) -> int:
    return module.weight.numel() * module.weight.element_size()


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each storage once."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


# -- choosing layers --------------------------------------------------------------------------------------
def _check_options(scheme: str, group_size: int, kernel: str | None) -> None:
    if scheme not in SCHEMES:
        raise SlimtorchError(f"unknown scheme {scheme!r} (known: {', '.join(SCHEMES)})")
    if scheme == "int4-weight" and (group_size not in INT4_GROUP_SIZES or group_size % 2):
        raise SlimtorchError(f"int4 group size must be even, 32 to 256, not {group_size}")
    if kernel is not None and kernel not in LINEAR[scheme].KERNELS:
        raise SlimtorchError(
            f"kernel {kernel!r} does not compute {scheme} (its kernels: {', '.join(LINEAR[scheme].KERNELS)})"
        )


def _targets(
    model: nn.Module, scheme: str, skip: tuple[str, ...], embeddings: bool
) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for tensor in module._parameters.values():
            if tensor is not None:
                owners.setdefault(id(tensor), []).append(name)
    targets, skipped = [], {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            continue
        why = _why_not(name, module, scheme, skip, embeddings, owners)
        if why is None:
            targets.append((name, module))
        elif why:
            skipped[name] = why
    return targets, skipped


def _why_not(
    name: str,
    module: nn.Module,
    scheme: str,
    skip: tuple[str, ...],
    embeddings: bool,
    owners: dict[int, list[str]],
) -> str | None:
    """Why a layer stays float; None: it is quantized; "": not a layer anyone would expect quantized."""
    if isinstance(module, (nn.Linear, nn.Embedding)) and not quantizable_type(module):
        base = "Linear" if isinstance(module, nn.Linear) else "Embedding"
        return f"{type(module).__name__} subclasses nn.{base}; its owner may use the weight directly"
    if isinstance(module, nn.modules.conv._ConvNd) and (scheme not in CONV or not quantizable_conv(module)):
        if scheme not in CONV:
            return f"{scheme} has no convolution kernel (int8-weight and int4-weight quantize convolutions)"
        return "transposed, or padded other than with zeros: only plain zero-padded convolutions are swapped"
    if not quantizable_type(module):
        return ""
    pattern = next((p for p in skip if fnmatch.fnmatchcase(name, p)), None)
    if pattern is not None:
        return f"matches skip pattern {pattern!r}"
    weight = module.weight
    if not weight.is_floating_point() or weight.is_meta:
        return "its weight is not a float tensor with values"
    others = [other for other in owners.get(id(weight), []) if other != name]
    if others:
        return f"its weight is tied to {others[0]!r} (quantizing one would untie them)"
    if isinstance(module, nn.Embedding):
        if not embeddings:
            return "embeddings stay float (embeddings=False)"
        if module.max_norm is not None:
            return "max_norm renormalises rows in place on lookup"
    return None


def _recorded(originals: dict[str, nn.Module], scheme: str, group_size: int) -> dict[str, dict[str, Any]]:
    group = group_size if scheme == "int4-weight" else None
    return {
        name: {"scheme": scheme, "group_size": group, "dtype": str(m.weight.dtype).removeprefix("torch.")}
        for name, m in originals.items()
    }


def _layer_result(name: str, module: nn.Module, quantized: QuantizedWeight) -> LayerResult:
    weight = float_weight(module).detach().float()
    error = quantized.dequantized(torch.float32).sub_(weight)
    norm = float(torch.linalg.vector_norm(weight))
    after = sum(t.numel() * t.element_size() for t in quantized.parts().values())
    return LayerResult(
        name,
        type(quantized).__name__,
        weight.numel() * module.weight.element_size(),
        after,
        float(torch.linalg.vector_norm(error)) / norm if norm else 0.0,
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
) -> tuple[dict[str, float], tuple[float | None, float | None]]:
    """Each quantized layer's output error against its float layer, and the model's output agreement."""
    if not inputs:
        return {}, (None, None)
    sums: dict[str, list[float]] = {name: [0.0, 0.0] for name in originals}
    modules = dict(model.named_modules())

    def hook(name: str):
        def compare(_module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            reference = originals[name](*args).float()
            sums[name][0] += float(torch.linalg.vector_norm(out.float() - reference)) ** 2
            sums[name][1] += float(torch.linalg.vector_norm(reference)) ** 2

        return compare

    handles = [modules[name].register_forward_hook(hook(name)) for name in originals]
    try:
        outputs = [_outputs(_call(model, sample)) for sample in inputs]
    finally:
        for handle in handles:
            handle.remove()
    got = torch.cat([t.reshape(-1) for out in outputs for t in out] or [torch.zeros(0)])
    want = torch.cat([t.reshape(-1) for ref in references for t in ref] or [torch.zeros(0)])
    if got.shape != want.shape or not got.numel():
        return _ratios(sums), (None, None)
    cosine = float(torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0))
    return _ratios(sums), (cosine, float((got - want).abs().max()))


def _ratios(sums: dict[str, list[float]]) -> dict[str, float]:
    return {name: (err / ref) ** 0.5 if ref else 0.0 for name, (err, ref) in sums.items()}
