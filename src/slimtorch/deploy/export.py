"""``slimtorch.deploy.export``: a model to a verified bundle that runs without PyTorch.

The model is captured once by ``torch.export``; from that program come ``model.onnx`` (through
``torch.onnx.export(dynamo=True)``, optionally int8 through onnxruntime) or ``model.pt2`` (an
``ExportedProgram``, for torch-only deployments). The exported file is then run by its own runtime on
the example and on fresh inputs like it, and compared with eager PyTorch (:mod:`slimtorch.deploy.tolerance`).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten, tree_flatten_with_path

from slimtorch.deploy import fidelity, onnx_model, runner
from slimtorch.deploy import text as text_bundle
from slimtorch.deploy.bundle import BundleWriter
from slimtorch.deploy.program import BATCH, export_program
from slimtorch.deploy.requirements import NO_DEPS, requirements, versions
from slimtorch.deploy.tolerance import (
    FP32,
    INT8,
    INT8_TEXT,
    OutputError,
    Tolerance,
    default_tolerance,
    noise_aware,
    output_errors,
)
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.pending import wait_for_checks
from slimtorch.format.progress import Progress, announcer
from slimtorch.format.verbs import Report, resolve
from slimtorch.graph.capture import as_args, random_like, without_cache
from slimtorch.models.examples import forward_names
from slimtorch.quant import QuantizedWeight, dequantize, model_bytes, quantize
from slimtorch.sources.objects import short_repr

__all__ = [
    "FORMATS",
    "FP32",
    "INT8",
    "INT8_TEXT",
    "ExportOptions",
    "ExportReport",
    "OutputError",
    "TensorSpec",
    "Tolerance",
    "export",
]

FORMATS = ("onnx", "pt2")
MODEL_FILE = {"onnx": "model.onnx", "pt2": "model.pt2"}


@dataclass(frozen=True)
class ExportOptions:
    """How :func:`export` exports and verifies a model; every field has the CLI's default.

    Example:
        >>> ExportOptions(format="pt2", quantize_to="int8").samples
        3
    """

    format: str = "onnx"
    """``"onnx"`` (runs on onnxruntime, no torch) or ``"pt2"`` (a ``torch.export`` program)."""
    quantize_to: str | None = None
    """``"int8"``: for ONNX per-channel int8 weights and per-token int8 activations
    (:mod:`slimtorch.deploy.token_int8`), for pt2 slimtorch's int8 weights; None keeps the model's own."""
    dynamic_batch: bool = False
    """The first dimension of every input may vary (checked at another batch size too)."""
    samples: int = 3
    """Inputs compared with eager PyTorch: the example, then random ones like it."""
    tolerance: Tolerance | None = None
    """The agreement required; None: :data:`FP32` (widened to a model's own float32 rounding noise where
    that exceeds it), quantized :data:`INT8_TEXT` for a text model, else :data:`INT8`."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise OptionError(f"unknown format {self.format!r}; choose one of {', '.join(FORMATS)}")
        if self.quantize_to not in (None, "int8"):
            raise OptionError(f"quantize_to takes 'int8' or None, not {self.quantize_to!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise OptionError(
                f"samples is how many inputs are compared, a count of 1 or more, not {self.samples!r}"
            )
        if self.tolerance is not None and not isinstance(self.tolerance, Tolerance):
            raise OptionError(f"tolerance must be a Tolerance or None, not {type(self.tolerance).__name__}")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    """sizes, ``"batch"`` where the size may vary"""


@dataclass(frozen=True)
class ExportReport(Report):
    """What was exported, where, how big, and how closely it agrees with eager PyTorch."""

    SCHEMA: ClassVar[str] = "slimtorch.export/1"
    DERIVED: ClassVar[dict[str, dict[str, Any]]] = {"passed": {"type": "boolean"}}

    bundle: str
    format: str
    model_file: str
    model_bytes: int
    """the exported model's files"""
    eager_bytes: int
    """the model's parameters and buffers in memory, as given"""
    quantized: str | None
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    errors: tuple[OutputError, ...]
    samples: int
    tolerance: Tolerance
    seconds: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    embedding: fidelity.EmbeddingAgreement | None = None
    """a text model's sentence embeddings against eager's (decides where ``tolerance.min_cosine`` is set)"""
    threads: int | None = None
    """the threads onnxruntime runs the bundle on (verification included): 1 for a graph that runtime
    computes wrong on more (:data:`~slimtorch.deploy.onnx_model.RACY_ON_THREADS`); None: its default,
    every core"""

    @property
    def passed(self) -> bool:
        if self.tolerance.min_cosine is not None and self.embedding is not None:
            return self.embedding.passed
        return all(e.passed for e in self.errors)


def export(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    out: str | os.PathLike[str],
    /,
    options: ExportOptions | None = None,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    **overrides: Any,
) -> ExportReport:
    """Export ``model`` to the bundle folder ``out`` and verify it against eager PyTorch.

    Args:
        model: the model, float or quantized by :func:`slimtorch.quantize` (its int8 layers become
            onnxruntime int8 with the same codes; a ``.pt2`` keeps the codes and dequantizes in its graph).
        example_inputs: a tensor, a tuple of positional tensors, or a dict of keyword tensors (a text
            model's ``input_ids``, ``attention_mask`` ...: the bundle's inputs get those names).
        out: the bundle folder (replaced if it is a bundle; refused if it holds anything else).
        options: how to export (:class:`ExportOptions`); ``overrides`` replace single fields
            (``format="pt2"``, ``quantize_to="int8"``, ``dynamic_batch=True``, ``samples``, ``tolerance``).
        tokenizer: a folder with the model's ``tokenizer.json``: a text bundle (see
            :mod:`slimtorch.deploy.text`), whose inputs are the token inputs the model takes, dynamic in
            batch and sequence, checked at several lengths, and whose ``predict.py`` takes ``--text``.
        progress: told each stage as it starts (:mod:`slimtorch.format.progress`).

    Example:
        >>> report = export(nn.Sequential(nn.Linear(8, 4)), torch.randn(1, 8), "bundle")  # doctest: +SKIP
        >>> report.passed, report.errors[0].max_abs < 1e-4  # doctest: +SKIP
        (True, True)
    """
    how = resolve(ExportOptions, options, overrides, "export")
    wait_for_checks(model)  # the bundle holds the weights: verified ones
    if how.format == "onnx":
        onnx_model.require_onnx()  # before a long capture, not after it
    say = announcer(progress)
    model.eval()
    kwargs = without_cache(model, {})
    text = text_bundle.text_inputs(tokenizer, model, example_inputs) if tokenizer is not None else None
    model, args, names_in, kwargs = _by_name(model, text.example if text else example_inputs, kwargs)
    layers = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    held = sorted({m.SCHEME for m in layers})
    per_channel = {m.codec for m in layers if not m.grouped}
    int8 = how.quantize_to == "int8" or (how.format == "onnx" and "int8" in per_channel)
    notes = _notes(how.format, {m.codec for m in layers if m.grouped}) + ((text.note(),) if text else ())
    target = _prepared(model, how.format, how.quantize_to, held)
    bound = _Bound(target, kwargs) if kwargs else target
    if text:
        inputs = text_bundle.verification_inputs(text, how.samples)
    else:
        inputs = _samples(args, how.samples, how.dynamic_batch, _sampler())
    seconds: dict[str, float] = {}

    first = _call(model, inputs[0], kwargs, 0)  # the reference on the example, run once
    constants = _constant_outputs(first)
    if constants:  # a graph returns tensors only (AntiBERTy's loss is the number 0 without labels)
        bound = _TensorOutputs(bound)
        notes += (f"left out of the graph: {constants}, not tensors (the model returns them as they are)",)
    say("capturing the model with torch.export")
    start = time.perf_counter()
    traced = text_bundle.trace_inputs(text) if text else _export_args(args, how.dynamic_batch, _sampler())
    sequence = text.max_length if text else None
    program = export_program(bound, traced, {}, dynamic_batch=how.dynamic_batch, sequence=sequence)
    seconds["capture"] = time.perf_counter() - start
    say("running the model in PyTorch")
    expected = [_outputs(first if i == 0 else _call(model, a, kwargs, i), text) for i, a in enumerate(inputs)]
    names_out = [name for name, _ in expected[0]]
    wanted = [{n: _numpy(t) for n, t in e} for e in expected]
    with BundleWriter(out) as bundle:
        path = bundle.path(MODEL_FILE[how.format])
        start = time.perf_counter()
        threads = None
        if how.format == "onnx":
            _to_onnx(program, path, names_in, names_out, model_bytes(target), int8, say, seconds)
            racy = onnx_model.racy_on_threads(path)
            if racy:
                threads = 1
                notes += (
                    f"runs on one thread: onnxruntime's {', '.join(racy)} loses updates when its threads "
                    "race (microsoft/onnxruntime#18048); predict.py runs it on one thread too",
                )
            run = runner.load_runtime(path, "onnx", threads)
        else:
            say("saving the ExportedProgram")
            torch.export.save(program, str(path))
            run = runner.load_runtime(path, "pt2")
        seconds["write"] = time.perf_counter() - start - seconds.get("quantize", 0.0)
        say(f"verifying on {len(inputs)} input(s)")
        start = time.perf_counter()
        actual = [run([_numpy(t) for t in a]) for a in inputs]
        source = fidelity.embedding_source(names_in, [(n, tuple(t.shape)) for n, t in expected[0]])
        quantized = bool(int8 or held or how.quantize_to)
        tolerance = how.tolerance or default_tolerance(quantized, source)
        errors = output_errors(names_out, wanted, actual, tolerance)
        embedding = _embedding(source, names_in, names_out, inputs, wanted, actual, tolerance)
        if how.tolerance is None and tolerance is FP32 and not all(e.passed for e in errors):
            say("measuring the model's own float32 rounding noise (a float64 copy)")
            found = [[t for _, t in e] for e in expected]
            tolerance, note = noise_aware(model, inputs, kwargs, found, _flatten)
            notes += (note,)
            errors = output_errors(names_out, wanted, actual, tolerance)
        seconds["verify"] = time.perf_counter() - start
        files = sorted(p.name for p in bundle.staging.iterdir() if p.name.startswith("model."))
        report = ExportReport(
            bundle=str(out),
            format=how.format,
            model_file=MODEL_FILE[how.format],
            model_bytes=sum(bundle.path(f).stat().st_size for f in files),
            eager_bytes=model_bytes(model),
            quantized="int8" if int8 else (",".join(held) or None),
            inputs=_specs(names_in, inputs, how.dynamic_batch, text),
            outputs=_specs(names_out, [[t for _, t in e] for e in expected], how.dynamic_batch, text),
            errors=errors,
            samples=len(inputs),
            tolerance=tolerance,
            seconds=seconds,
            notes=notes,
            embedding=embedding,
            threads=threads,
        )
        if text:
            text.copy_files(bundle.path)
        sample = {n: _numpy(t) for n, t in zip(names_in, inputs[0], strict=False)}
        manifest = _manifest(report, files, source, text)
        bundle.commit(manifest, requirements(how.format, text is not None), sample, wanted[0])
    return report


def _manifest(
    report: ExportReport,
    files: list[str],
    source: fidelity.EmbeddingSource | None,
    text: text_bundle.TextInputs | None,
) -> dict[str, Any]:
    """The bundle's ``manifest.json``: what the model is, its inputs and outputs, how it was verified."""
    embedding = report.embedding
    manifest: dict[str, Any] = {
        "model": {
            "file": report.model_file,
            "files": files,
            "format": report.format,
            "bytes": report.model_bytes,
            **({"threads": report.threads} if report.threads else {}),
        },
        "quantized": report.quantized,
        "inputs": [asdict(s) for s in report.inputs],
        "outputs": [asdict(s) for s in report.outputs],
        "tolerance": asdict(report.tolerance),
        "verification": {
            "passed": report.passed,
            "samples": report.samples,
            "outputs": [asdict(e) for e in report.errors],
            "embedding": asdict(embedding) if embedding else None,
            "embedding_source": asdict(source) if source and embedding else None,
        },
        "created_by": versions(report.format),
    }
    if text:
        manifest["text"] = text.manifest()
        if report.format == "onnx":
            manifest["pip_options"] = NO_DEPS  # the requirements are the whole runtime, pinned
    return manifest


def _embedding(
    source: fidelity.EmbeddingSource | None,
    names_in: Sequence[str],
    names_out: Sequence[str],
    inputs: list[tuple],
    expected: list[dict[str, np.ndarray]],
    actual: list[list[np.ndarray]],
    tolerance: Tolerance,
) -> fidelity.EmbeddingAgreement | None:
    """The sentence embeddings' agreement over every sample, for a text model (None for any other)."""
    if source is None:
        return None
    return fidelity.embedding_agreement(
        source,
        [{n: _numpy(t) for n, t in zip(names_in, a, strict=False)} for a in inputs],
        expected,
        [dict(zip(names_out, got, strict=False)) for got in actual],
        tolerance.min_cosine or fidelity.MIN_COSINE,
    )


def _to_onnx(
    program: torch.export.ExportedProgram,
    path: Path,
    names_in: list[str],
    names_out: list[str],
    weight_bytes: int,
    int8: bool,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> None:
    """Write ``path`` (int8 through a float file that is removed)."""
    say("translating to ONNX")
    float_path = path.with_name("float." + path.name) if int8 else path
    onnx_model.write_onnx(program, float_path, names_in, names_out, weight_bytes)
    if int8:
        say("quantizing to int8 with onnxruntime")
        start = time.perf_counter()
        onnx_model.quantize_int8(float_path, path)
        for leftover in (float_path, float_path.with_name(float_path.name + ".data")):
            leftover.unlink(missing_ok=True)
        seconds["quantize"] = time.perf_counter() - start


def _prepared(model: nn.Module, format: str, quantize_to: str | None, held: list[str]) -> nn.Module:
    """The model as the format takes it. ONNX: quantized layers float again (onnxruntime quantizes those of
    int8 with a scale per channel back to int8 with the same codes; grouped ones stay float). pt2 with
    int8: a copy with slimtorch's int8 weights."""
    if format == "onnx" and held:
        target = copy.deepcopy(model)
        dequantize(target)
        return target
    if format == "pt2" and quantize_to == "int8":
        quantized = quantize(copy.deepcopy(model), "int8-weight").model
        assert quantized is not None  # quantize's report holds the model it quantized
        return quantized
    return model


def _notes(format: str, grouped: set[str]) -> tuple[str, ...]:
    """What ONNX cannot hold as codes: onnxruntime's int8 here has a scale per channel, and no int4."""
    if format == "onnx" and grouped:
        held = " and ".join(sorted(grouped))
        return (
            f"{held} layers in groups are exported with their dequantized float weights (no such codes here)",
        )
    return ()


class _Bound(nn.Module):
    """The model with keyword arguments fixed (``use_cache=False``), and with ``names`` its inputs given
    by name (``input_ids``, ``attention_mask``: a text model's need not be its first parameters), so the
    program takes only tensors, in order."""

    def __init__(self, model: nn.Module, kwargs: dict[str, Any], names: Sequence[str] = ()) -> None:
        super().__init__()
        self.model, self.kwargs, self.names = model, kwargs, tuple(names)

    def forward(self, *args: Any) -> Any:
        if self.names:
            return self.model(**dict(zip(self.names, args, strict=True)), **self.kwargs)
        return self.model(*args, **self.kwargs)


class _TensorOutputs(nn.Module):
    """The model with its output's non-tensor leaves left out: the tensors, flat, in the order
    :func:`_flatten` names them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        return tuple(v for v in tree_flatten(self.model(*args))[0] if isinstance(v, torch.Tensor))


def _constant_outputs(output: Any) -> str:
    """The output's leaves that are not tensors (None is no leaf), as ``name = value``; "" for none."""
    found = [(path, v) for path, v in tree_flatten_with_path(output)[0] if not isinstance(v, torch.Tensor)]
    shown = [f"{'_'.join(_key(k) for k in path) or 'output'} = {short_repr(v, 40)}" for path, v in found[:3]]
    return ", ".join(shown) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def _by_name(
    model: nn.Module, example: Any, kwargs: dict[str, Any]
) -> tuple[nn.Module, tuple, list[str], dict[str, Any]]:
    """The model as export calls it, its inputs in order, their names, and the keyword arguments left to
    pass: a dict example is given by name through :class:`_Bound`, anything else positionally."""
    if not isinstance(example, Mapping):
        args = as_args(example)
        return model, args, _input_names(model, args), kwargs
    names = [str(name) for name in example]
    return _Bound(model, kwargs, names), tuple(example.values()), names, {}


def _outputs(output: Any, text: text_bundle.TextInputs | None) -> list[tuple[str, torch.Tensor]]:
    """The named output tensors; a sentence-transformers model's one output is ``sentence_embedding``, as
    sentence-transformers names it."""
    found = _flatten(output)
    if text is not None and text.sentence and [name for name, _ in found] == ["output"]:
        return [("sentence_embedding", found[0][1])]
    return found


SAMPLE_SEED = 0
"""The seed of the random inputs an export is traced and verified on: the same model and example give the
same inputs, so a verdict is repeatable. A model whose output jumps with its input (a distance cutoff, a
``nonzero``) could otherwise pass on one run's draw and fail on the next, as a wild checkpoint's did."""


def _sampler() -> torch.Generator:
    return torch.Generator().manual_seed(SAMPLE_SEED)


def _samples(args: tuple, count: int, dynamic_batch: bool, generator: torch.Generator) -> list[tuple]:
    inputs = [args, *(tuple(random_like(a, generator) for a in args) for _ in range(max(0, count - 1)))]
    if dynamic_batch:  # and one at another batch size, to show that it really varies
        inputs.append(tuple(_batched(a, 3, generator) for a in args))
    return inputs


def _export_args(args: tuple, dynamic_batch: bool, generator: torch.Generator) -> tuple:
    """Export specialises a dimension of size 1, so a dynamic batch is traced at batch 2."""
    return tuple(_batched(a, 2, generator) for a in args) if dynamic_batch else args


def _batched(value: Any, size: int, generator: torch.Generator) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    rows = [random_like(value[:1], generator) for _ in range(size)]
    return torch.cat(rows)


def _input_names(model: nn.Module, args: tuple) -> list[str]:
    named = forward_names(model)
    if len(named) >= len(args) and len(args):
        return named[: len(args)]
    return ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]


def _call(model: nn.Module, args: tuple, kwargs: dict[str, Any], index: int) -> Any:
    """The eager reference; a failure on an input other than the example is the user's to know about."""
    try:
        with torch.no_grad():
            return model(*args, **kwargs)
    except Exception as exc:
        if index == 0:
            raise
        shapes = ", ".join("x".join(map(str, a.shape)) for a in args if isinstance(a, torch.Tensor))
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SlimtorchError(
            f"the model fails in PyTorch itself on a verification input of shape {shapes}: {first} "
            "(without --dynamic-batch every input has the example's shape)"
        ) from exc


def _flatten(output: Any) -> list[tuple[str, torch.Tensor]]:
    """The output's tensors in the order export flattens them, named by where they sit."""
    leaves = [(path, v) for path, v in tree_flatten_with_path(output)[0] if isinstance(v, torch.Tensor)]
    if len(leaves) == 1 and not leaves[0][0]:
        return [("output", leaves[0][1])]
    named = ["_".join(_key(k) for k in path) or "output" for path, _ in leaves]
    if len(set(named)) < len(named):
        named = [f"output_{i}" for i in range(len(leaves))]
    return [(n if not n[0].isdigit() else f"output_{n}", v) for n, (_, v) in zip(named, leaves, strict=False)]


def _key(entry: Any) -> str:
    if isinstance(entry, MappingKey):
        return str(entry.key)
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, GetAttrKey):
        return entry.name
    return str(entry)


def _specs(
    names: Sequence[str], samples: list, dynamic_batch: bool, text: text_bundle.TextInputs | None
) -> tuple[TensorSpec, ...]:
    """Each tensor's spec; for a text bundle, ``"batch"`` and ``"sequence"`` where the samples varied."""
    if text is None:
        return tuple(_spec(n, t, dynamic_batch) for n, t in zip(names, samples[0], strict=False))
    return tuple(
        TensorSpec(
            n, str(_numpy(t.reshape(-1)[:0]).dtype), text_bundle.dynamic_shape([s[i].shape for s in samples])
        )
        for i, (n, t) in enumerate(zip(names, samples[0], strict=False))
    )


def _spec(name: str, tensor: torch.Tensor, dynamic_batch: bool) -> TensorSpec:
    shape: list[int | str] = list(tensor.shape)
    if dynamic_batch and shape:
        shape[0] = BATCH
    return TensorSpec(name, str(_numpy(tensor.reshape(-1)[:0]).dtype), shape)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()
