"""An exported program translated to ONNX (torch.onnx's dynamo exporter), and its int8 form.

The translation starts from the ``torch.export`` program that :mod:`slimtorch.deploy.program` made, so a
failure here is about one operator that has no ONNX translation: it is named, with the modules that use
it (each graph node remembers the module it was traced in).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from slimtorch.deploy import token_int8
from slimtorch.deploy.program import Attempt, ExportError, module_of, quiet
from slimtorch.errors import SlimtorchError

EXTERNAL_DATA_BYTES = 1 << 30  # protobuf cannot hold a model over 2 GiB: larger weights go beside it
ONNXRUNTIME_INT8 = ("Conv", "LSTM")
"""left to onnxruntime's dynamic int8 (ConvInteger, DynamicQuantizeLSTM) after the per-token rewrite"""
RACY_ON_THREADS = "ScatterND"
"""onnxruntime's CPU ScatterND with a reduction (what ``index_add``, ``scatter_add`` over rows and
``index_put(accumulate=True)`` become) splits the updates over its threads, and updates to the same row
race: onnxruntime 1.32 adding 20,000 rows into 64 on two threads was off by up to 13, and by a different
amount each run (microsoft/onnxruntime#18048, #23396). On one thread it is exact. ScatterElements, which
applies its updates in order, is not affected."""


def require_onnx() -> None:
    """ONNX export needs onnx, onnxscript and onnxruntime (the ``deploy`` extra)."""
    missing = [m for m in ("onnx", "onnxscript", "onnxruntime") if not _importable(m)]
    if missing:
        raise SlimtorchError(
            f"ONNX export needs {', '.join(missing)}: pip install 'slimtorch[deploy]' (or --format pt2)"
        )


def write_onnx(
    program: torch.export.ExportedProgram,
    path: Path,
    input_names: Sequence[str],
    output_names: Sequence[str],
    weight_bytes: int,
) -> None:
    """Translate ``program`` into ``path`` (weights in ``path.data`` beside it when they are large)."""
    try:
        with quiet():
            exported = torch.onnx.export(
                program,
                dynamo=True,
                input_names=list(input_names),
                output_names=list(output_names),
                external_data=weight_bytes > EXTERNAL_DATA_BYTES,
                optimize=True,
                verbose=False,
            )
            # dynamo=True always gives a program: torch's annotation covers the legacy exporter's None too
            onnx_program = cast(torch.onnx.ONNXProgram, exported)
            onnx_program.save(str(path), external_data=weight_bytes > EXTERNAL_DATA_BYTES)
    except Exception as exc:  # the exporter raises its own error types; name the op behind them
        raise _translation_error(program, exc) from exc


def quantize_int8(source: Path, target: Path) -> None:
    """int8 ``target`` from the float ``source``: per-channel int8 weights for every MatMul and Gemm with a
    constant weight, each input row (token) quantized with its own scale as it runs, and int8 rows for
    embedding lookups (:mod:`slimtorch.deploy.token_int8`: onnxruntime's dynamic int8 quantizes a whole
    activation with one scale, too coarse for a transformer's outlier channels); convolutions and LSTMs
    by onnxruntime's dynamic int8 (per-channel weights). Weights that are already int8 values times a
    per-channel scale (a model slimtorch quantized) come back as the same codes."""
    import onnx

    model = onnx.load(str(source))
    token_int8.per_token_matmuls(model)
    rest = {n.op_type for n in model.graph.node} & set(ONNXRUNTIME_INT8)
    large = model.ByteSize() > EXTERNAL_DATA_BYTES
    staged = target.with_name("tokens." + target.name) if rest else target
    onnx.save(model, str(staged), save_as_external_data=large, location=staged.name + ".data")
    if not rest:
        return
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(
            str(staged),
            str(target),
            op_types_to_quantize=sorted(rest),
            weight_type=QuantType.QInt8,
            per_channel=True,
            use_external_data_format=large,
        )
    for leftover in (staged, staged.with_name(staged.name + ".data")):
        leftover.unlink(missing_ok=True)


def racy_on_threads(path: Path) -> list[str]:
    """The operators of the ONNX file ``path`` (its subgraphs and functions too) that onnxruntime gets
    wrong on more than one thread (:data:`RACY_ON_THREADS`), as ``"ScatterND (reduction=add) x3"``;
    empty when it runs right on any number. Reads the graph only, not external weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found: dict[str, int] = {}
    pending = [model.graph.node, *(function.node for function in model.functions)]
    while pending:
        for node in pending.pop():
            attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            for value in attributes.values():  # the bodies of If, Loop and Scan
                graphs = value if isinstance(value, list) else [value]
                pending += [g.node for g in graphs if isinstance(g, onnx.GraphProto)]
            reduction = attributes.get("reduction", b"none")
            reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
            if node.op_type == RACY_ON_THREADS and reduction != "none":
                name = f"{node.op_type} (reduction={reduction})"
                found[name] = found.get(name, 0) + 1
    return [f"{name} x{count}" if count > 1 else name for name, count in sorted(found.items())]


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _translation_error(program: torch.export.ExportedProgram, exc: BaseException) -> ExportError:
    # the exporter's own message is a generic page of advice in terminal colours; its cause names the node
    found = exc.__cause__ if exc.__cause__ is not None and str(exc.__cause__).strip() else exc
    text = " ".join(_ANSI.sub("", str(found)).split())
    ops = _ops_named(program, " ".join(_ANSI.sub("", f"{exc} {text}").split()))
    if ops:
        op, nodes = next(iter(ops.items()))
        where = sorted({module_of(n) for n in nodes if module_of(n)})
        place = f", used in {', '.join(where[:3])}" + (
            f" and {len(where) - 3} more" if len(where) > 3 else ""
        )
        problem = f"ONNX has no translation for {op}{place if where else ''}"
    else:
        problem = f"the ONNX translation failed: {text[:300]}"
    attempt = Attempt(
        "torch.onnx.export(dynamo=True) after decompositions", text[:300], type(exc).__name__, "", ""
    )
    return ExportError(f"cannot export the model to ONNX: {problem}; export --format pt2 instead", [attempt])


def _ops_named(program: torch.export.ExportedProgram, text: str) -> dict[str, list[torch.fx.Node]]:
    """The graph's operators that the error message names (``aten::foo`` or ``aten.foo.default``)."""
    named = set(re.findall(r"\b([a-z_][\w]*)(?:::|\.)([\w]+)(?:\.([\w]+))?", text))
    found: dict[str, list[torch.fx.Node]] = {}
    for node in program.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        namespace, name = target.namespace, target._opname
        if any(ns == namespace and op == name for ns, op, _ in named):
            found.setdefault(f"{namespace}::{name}", []).append(node)
    return found


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
