"""``slimtorch.deploy.export``: a model to a verified bundle that runs without PyTorch.

The model is captured once by ``torch.export``; from that program come ``model.onnx`` (through
``torch.onnx.export(dynamo=True)``, optionally int8 through onnxruntime) or ``model.pt2`` (an
``ExportedProgram``, for torch-only deployments). The exported file is then run by its own runtime on
the example and on fresh inputs like it, and compared with eager PyTorch.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path

from slimtorch.deploy import fidelity, onnx_model, runner
from slimtorch.deploy import text as text_bundle
from slimtorch.deploy.bundle import BundleWriter
from slimtorch.deploy.noise import NOISE_FACTOR, rounding_noise
from slimtorch.deploy.program import BATCH, export_program
from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.progress import Progress, announcer
from slimtorch.graph.capture import as_args, random_like, without_cache
from slimtorch.models.examples import forward_names
from slimtorch.quant import QuantizedWeight, dequantize, model_bytes, quantize

FORMATS = ("onnx", "pt2")
MODEL_FILE = {"onnx": "model.onnx", "pt2": "model.pt2"}
RUNTIME = {"onnx": ("onnxruntime", "numpy"), "pt2": ("torch", "numpy")}


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
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    """sizes, ``"batch"`` where the size may vary"""


@dataclass(frozen=True)
class OutputError:
    """The largest difference from eager over all samples, absolute and relative to the output's scale."""

    name: str
    max_abs: float
    max_rel: float
    scale: float
    passed: bool


@dataclass(frozen=True)
class ExportReport:
    """What was exported, where, how big, and how closely it agrees with eager PyTorch."""

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

    @property
    def passed(self) -> bool:
        if self.tolerance.min_cosine is not None and self.embedding is not None:
            return self.embedding.passed
        return all(e.passed for e in self.errors)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "slimtorch.export/1", **asdict(self), "passed": self.passed}


def export(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    out: str | os.PathLike[str],
    *,
    format: str = "onnx",
    quantize_to: str | None = None,
    dynamic_batch: bool = False,
    samples: int = 3,
    tolerance: Tolerance | None = None,
    progress: Progress | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> ExportReport:
    """Export ``model`` to the bundle folder ``out`` and verify it against eager PyTorch.

    Args:
        model: the model, float or quantized by :func:`slimtorch.quantize` (its int8 layers become
            onnxruntime int8 with the same codes; a ``.pt2`` keeps the codes and dequantizes in its graph).
        example_inputs: a tensor, a tuple of positional tensors, or a dict of keyword tensors (a text
            model's ``input_ids``, ``attention_mask`` ...: the bundle's inputs get those names).
        out: the bundle folder (replaced if it is a bundle; refused if it holds anything else).
        format: ``"onnx"`` (runs on onnxruntime, no torch) or ``"pt2"`` (a ``torch.export`` program).
        quantize_to: ``"int8"``: for ONNX per-channel int8 weights and per-token int8 activations
            (:mod:`slimtorch.deploy.token_int8`), for pt2 slimtorch's int8 weights.
        dynamic_batch: the first dimension of every input may vary.
        samples: inputs compared (the example, then random ones like it).
        tolerance: the agreement required (default :data:`FP32`; quantized, :data:`INT8_TEXT` for a text
            model, decided by its sentence embedding's cosine, else :data:`INT8`).
        progress: told each stage as it starts (:mod:`slimtorch.format.progress`).
        tokenizer: a folder with the model's ``tokenizer.json``: a text bundle (see
            :mod:`slimtorch.deploy.text`), whose inputs are the token inputs the model takes, dynamic in
            batch and sequence, checked at several lengths, and whose ``predict.py`` takes ``--text``.

    Example:
        >>> report = export(nn.Sequential(nn.Linear(8, 4)), torch.randn(1, 8), "bundle")  # doctest: +SKIP
        >>> report.passed, report.errors[0].max_abs < 1e-4  # doctest: +SKIP
        (True, True)
    """
    if format not in FORMATS:
        raise OptionError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    if quantize_to not in (None, "int8"):
        raise OptionError(f"--quantize takes int8, not {quantize_to!r}")
    if format == "onnx":
        onnx_model.require_onnx()  # before a long capture, not after it
    say = announcer(progress)
    model.eval()
    kwargs = without_cache(model, {})
    text = text_bundle.text_inputs(tokenizer, model, example_inputs) if tokenizer is not None else None
    model, args, names_in, kwargs = _by_name(model, text.example if text else example_inputs, kwargs)
    held = sorted({m.SCHEME for m in model.modules() if isinstance(m, QuantizedWeight)})
    int8 = quantize_to == "int8" or (format == "onnx" and any(s.startswith("int8") for s in held))
    notes = _notes(format, held) + ((text.note(),) if text else ())
    target = _prepared(model, format, quantize_to, held)
    bound = _Bound(target, kwargs) if kwargs else target
    inputs = (
        text_bundle.verification_inputs(text, samples) if text else _samples(args, samples, dynamic_batch)
    )
    seconds: dict[str, float] = {}

    say("capturing the model with torch.export")
    start = time.perf_counter()
    traced = text_bundle.trace_inputs(text) if text else _export_args(args, dynamic_batch)
    sequence = text.max_length if text else None
    program = export_program(bound, traced, {}, dynamic_batch=dynamic_batch, sequence=sequence)
    seconds["capture"] = time.perf_counter() - start
    say("running the model in PyTorch")
    expected = [_outputs(_call(model, a, kwargs, i), text) for i, a in enumerate(inputs)]
    names_out = [name for name, _ in expected[0]]
    with BundleWriter(out) as bundle:
        path = bundle.path(MODEL_FILE[format])
        start = time.perf_counter()
        if format == "onnx":
            run = _to_onnx(program, path, names_in, names_out, model_bytes(target), int8, say, seconds)
        else:
            say("saving the ExportedProgram")
            torch.export.save(program, str(path))
            run = runner.load_runtime(path, "pt2")
        seconds["write"] = time.perf_counter() - start - seconds.get("quantize", 0.0)
        say(f"verifying on {len(inputs)} input(s)")
        start = time.perf_counter()
        actual = [run([_numpy(t) for t in a]) for a in inputs]
        source = fidelity.embedding_source(names_in, [(n, tuple(t.shape)) for n, t in expected[0]])
        quantized = bool(int8 or held or quantize_to)
        given, tolerance = tolerance, tolerance or _default_tolerance(quantized, source)
        errors = _errors(names_out, expected, actual, tolerance)
        embedding = _embedding(source, names_in, names_out, inputs, expected, actual, tolerance)
        if given is None and tolerance is FP32 and not all(e.passed for e in errors):
            say("measuring the model's own float32 rounding noise (a float64 copy)")
            tolerance, note = _noise_aware(model, inputs, kwargs, expected)
            notes += (note,)
            errors = _errors(names_out, expected, actual, tolerance)
        seconds["verify"] = time.perf_counter() - start
        files = sorted(p.name for p in bundle.staging.iterdir() if p.name.startswith("model."))
        size = sum(bundle.path(f).stat().st_size for f in files)
        spec_in = _specs(names_in, inputs, dynamic_batch, text)
        spec_out = _specs(names_out, [[t for _, t in e] for e in expected], dynamic_batch, text)
        report = ExportReport(
            str(out),
            format,
            MODEL_FILE[format],
            size,
            model_bytes(model),
            "int8" if int8 else (",".join(held) or None),
            spec_in,
            spec_out,
            errors,
            len(inputs),
            tolerance,
            seconds,
            notes,
            embedding,
        )
        manifest = {
            "model": {"file": MODEL_FILE[format], "files": files, "format": format, "bytes": size},
            "quantized": report.quantized,
            "inputs": [asdict(s) for s in spec_in],
            "outputs": [asdict(s) for s in spec_out],
            "tolerance": asdict(tolerance),
            "verification": {
                "passed": report.passed,
                "samples": len(inputs),
                "outputs": [asdict(e) for e in errors],
                "embedding": asdict(embedding) if embedding else None,
                "embedding_source": asdict(source) if source and embedding else None,
            },
            "created_by": _versions(format),
        }
        if text:
            manifest["text"] = text.manifest()
            text.copy_files(bundle.path)
        sample = {n: _numpy(t) for n, t in zip(names_in, inputs[0], strict=False)}
        requirements = _requirements(format, text is not None)
        if text and format == "onnx":
            manifest["pip_options"] = NO_DEPS  # the requirements are the whole runtime, pinned
        bundle.commit(manifest, requirements, sample, {n: _numpy(t) for n, t in expected[0]})
    return report


def _default_tolerance(quantized: bool, source: fidelity.EmbeddingSource | None) -> Tolerance:
    """:data:`FP32`; quantized, :data:`INT8_TEXT` for a model with a sentence embedding, else :data:`INT8`."""
    if not quantized:
        return FP32
    return INT8_TEXT if source is not None else INT8


def _embedding(
    source: fidelity.EmbeddingSource | None,
    names_in: Sequence[str],
    names_out: Sequence[str],
    inputs: list[tuple],
    expected: list,
    actual: list,
    tolerance: Tolerance,
) -> fidelity.EmbeddingAgreement | None:
    """The sentence embeddings' agreement over every sample, for a text model (None for any other)."""
    if source is None:
        return None
    return fidelity.embedding_agreement(
        source,
        [{n: _numpy(t) for n, t in zip(names_in, a, strict=False)} for a in inputs],
        [{n: _numpy(t) for n, t in want} for want in expected],
        [dict(zip(names_out, got, strict=False)) for got in actual],
        tolerance.min_cosine or fidelity.MIN_COSINE,
    )


def _noise_aware(
    model: nn.Module, inputs: list[tuple], kwargs: dict[str, Any], expected: list
) -> tuple[Tolerance, str]:
    """:data:`FP32` widened to the model's own rounding noise, and a note saying what was measured."""
    noise = rounding_noise(
        model, inputs, [[t for _, t in e] for e in expected], lambda m, a: m(*a, **kwargs), _flatten
    )
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


def _to_onnx(
    program: torch.export.ExportedProgram,
    path: Path,
    names_in: list[str],
    names_out: list[str],
    weight_bytes: int,
    int8: bool,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    """Write ``path`` (int8 through a float file that is removed), and a function that runs it."""
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
    return runner.load_runtime(path, "onnx")


def _prepared(model: nn.Module, format: str, quantize_to: str | None, held: list[str]) -> nn.Module:
    """The model as the format takes it. ONNX: quantized layers float again (onnxruntime quantizes them
    back to int8 with the same codes). pt2 with int8: a copy with slimtorch's int8 weights."""
    if format == "onnx" and held:
        target = copy.deepcopy(model)
        dequantize(target)
        return target
    if format == "pt2" and quantize_to == "int8":
        return quantize(copy.deepcopy(model), "int8-weight", progress=False)
    return model


def _notes(format: str, held: list[str]) -> tuple[str, ...]:
    if format == "onnx" and any(s.startswith("int4") for s in held):
        return ("int4 layers are exported with their dequantized float weights (ONNX holds no int4 here)",)
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


def _samples(args: tuple, count: int, dynamic_batch: bool) -> list[tuple]:
    inputs = [args, *(tuple(random_like(a) for a in args) for _ in range(max(0, count - 1)))]
    if dynamic_batch:  # and one at another batch size, to show that it really varies
        inputs.append(tuple(_batched(a, 3) for a in args))
    return inputs


def _export_args(args: tuple, dynamic_batch: bool) -> tuple:
    """Export specialises a dimension of size 1, so a dynamic batch is traced at batch 2."""
    return tuple(_batched(a, 2) for a in args) if dynamic_batch else args


def _batched(value: Any, size: int) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    rows = [random_like(value[:1]) for _ in range(size)]
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


def _errors(names: list[str], expected: list, actual: list, tolerance: Tolerance) -> tuple[OutputError, ...]:
    """Each output's worst agreement over the samples."""
    found = []
    for want, got in zip(expected, actual, strict=False):
        if len(got) != len(want):
            raise SlimtorchError(f"the exported model gives {len(got)} output(s), eager PyTorch {len(want)}")
        found.append(
            runner.compare_outputs({n: _numpy(t) for n, t in want}, dict(zip(names, got, strict=False)))
        )
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


def _requirements(format: str, text: bool = False) -> list[str]:
    """The runtime, pinned to the versions the check ran on; ``tokenizers`` for a text bundle.

    A text bundle lists its whole runtime, every dependency pinned, to be installed with ``--no-deps``
    (:data:`NO_DEPS`): ``tokenizers`` declares ``huggingface_hub``, which the runner never imports and which
    would bring about 21 MiB (hf-xet, httpx, PyYAML ...) into every deployment.
    """
    from importlib.metadata import version

    if format == "onnx" and text:
        return [f"{name}=={version(name)}" for name in _closure(("onnxruntime", "numpy", "tokenizers"))]
    tokenizers = [f"tokenizers=={version('tokenizers')}"] if text else []
    if format == "onnx":
        return [f"onnxruntime=={version('onnxruntime')}", "numpy>=1.24", *tokenizers]
    return [f"torch=={torch.__version__.split('+')[0]}", "numpy>=1.24", *tokenizers]


# Declared dependencies a bundle's runner never imports: left out of a text bundle's pinned runtime.
UNUSED_DEPENDENCIES = {"tokenizers": {"huggingface-hub"}}
NO_DEPS = ["--no-deps"]


def _closure(roots: tuple[str, ...]) -> list[str]:
    """``roots`` and every package they need here (markers evaluated for this interpreter), less
    :data:`UNUSED_DEPENDENCIES`; sorted, by distribution name."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        skip = UNUSED_DEPENDENCIES.get(name, set())
        for line in requires(name) or []:
            needed = Requirement(line)
            if needed.marker is not None and not needed.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(needed.name) not in skip:
                todo.append(canonicalize_name(needed.name))
    return sorted(found)


def _versions(format: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"torch": torch.__version__}
    for package in ("onnx", "onnxscript", "onnxruntime") if format == "onnx" else ():
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found
