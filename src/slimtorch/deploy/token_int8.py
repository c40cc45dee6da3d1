"""int8 ONNX matmuls with one activation scale per token: what a transformer's outlier channels need.

onnxruntime's dynamic int8 quantizes a matmul's input with one scale for the whole tensor. In BERT-family
models a few hidden channels are 10-20 times larger than the rest, on a few tokens (MiniLM: channel 99
reaches 28 where the median channel peaks at 1.5), so one scale leaves the other tokens a handful of
levels: MiniLM's sentence embeddings fall to cosine 0.979 against float32 (worst of 17 sentences).
Measured there, the activation scale, not the weights, is the loss: per-channel int8 weights alone keep
cosine 0.998, per-tensor activations alone give 0.983, one scale per token 0.998. Leaving operators in
float does not get there: one linear layer gains at most 0.004, a whole role 0.012 at best (every FFN
up-projection: 0.990, a third of the weights in float), the embeddings' Gather or the attention output
projection less; SmoothQuant-style channel scaling calibrated on one sentence made it worse (0.93).

:func:`per_token_matmuls` rewrites every matmul with a constant weight into standard ONNX operators that
quantize each row (token) of the input on its own, asymmetric uint8, then run ``MatMulInteger`` against
per-output-channel symmetric int8 weights: ``y = s * (cast(q(x) @ w_q) * w_s - z * colsum(w_q) * w_s)``.
The weight codes are onnxruntime's own (absmax / 127 per column), so a model slimtorch already quantized
keeps its codes. They are stored as uint8 with zero point 128 (the same values): onnxruntime then runs its
uint8 x uint8 kernel, which widens the bytes to int16 before multiplying, and is exact on every CPU. Its
uint8 x int8 kernel is not on CPUs without VNNI (AVX2), whose byte instruction adds each pair of products
into a saturating int16 (onnxruntime's documented caveat), and a bundle runs on whatever CPU it is copied
to. Measured on an AVX2 EPYC (``benchmarks/onnx_int8.py``, MiniLM, 128 tokens, 1 thread): uint8 x int8
codes gave worst sentence cosine 0.9717 (8-bit rows) and 0.9894 (7-bit rows, 45 ms), uint8 x uint8 0.9966
at 51 ms (fp32 55, onnxruntime's own dynamic int8 39 ms at cosine 0.984).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ACTIVATION_LEVELS = 255
"""the largest row code (uint8)"""
WEIGHT_ZERO = 128
"""the stored weight codes' zero point: int8 codes kept as uint8 (see the module's docstring)"""
WEIGHT_LEVELS = 127
"""the largest weight code (symmetric int8, as onnxruntime's per-channel weights)"""


def per_token_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place: each ``MatMul`` whose second input is a 2-D float initializer becomes a
    per-token uint8 x per-channel int8 ``MatMulInteger``. Returns how many were rewritten.

    Example:
        >>> import onnx.helper as h
        >>> w = numpy_helper.from_array(np.ones((4, 2), np.float32), "w")
        >>> graph = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "g",
        ...     [h.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        ...     [h.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])], [w])
        >>> per_token_matmuls(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]))
        1
    """
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    rewritten, quantized_inputs, nodes = 0, {}, []
    for node in graph.node:
        table = _constant_table(node, initializers)
        if table is not None:
            nodes.extend(_row_gather(node, table, graph))
            rewritten += 1
            continue
        linear = _constant_weight(node, initializers)
        if linear is None:
            nodes.append(node)
            continue
        source = node.input[0]
        if source not in quantized_inputs:
            quantized_inputs[source] = _quantize_rows(source, graph, nodes)
        nodes.extend(_integer_matmul(node, *linear, quantized_inputs[source], graph))
        rewritten += 1
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unused(graph)
    return rewritten


def _constant_weight(
    node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]
) -> tuple[np.ndarray, str | None] | None:
    """The float (in, out) weight of a ``MatMul`` by a constant, or of a ``Gemm`` (a linear layer on 2-D
    input) with its bias input; None for any other node (a matmul of two activations stays float)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
        return None
    tensor = initializers.get(node.input[1])
    if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
        return None
    weight = numpy_helper.to_array(tensor)
    if node.op_type == "MatMul":
        return weight, None
    options = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if options.get("transA", 0) or (bias is not None and options.get("beta", 1.0) != 1.0):
        return None
    weight = weight.T if options.get("transB", 0) else weight
    return (weight * np.float32(options.get("alpha", 1.0))).astype(np.float32), bias


def _constant_table(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    """The table of an embedding lookup: ``Gather`` on axis 0 of a 2-D float initializer."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or node.input[0] not in initializers:
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    tensor = initializers[node.input[0]]
    if axis != 0 or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
        return None
    return numpy_helper.to_array(tensor)


def _row_gather(node: onnx.NodeProto, table: np.ndarray, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """An embedding lookup from int8 rows, each with its own scale (a rare token's row keeps its own
    range), dequantized after the lookup so only the looked-up rows are widened."""
    name = _fresh(graph, (node.name or node.output[0]) + "_int8")
    peak = np.abs(table).max(axis=1, keepdims=True)
    scale = np.where(peak > 0, peak / 127, 1.0).astype(np.float32)
    codes = np.clip(np.round(table / scale), -127, 127).astype(np.int8)
    n = f"{name}_"
    graph.initializer.extend(
        [numpy_helper.from_array(codes, n + "rows"), numpy_helper.from_array(scale, n + "scales")]
    )
    return [
        helper.make_node("Gather", [n + "rows", node.input[1]], [n + "codes"], name=n + "gather"),
        helper.make_node("Gather", [n + "scales", node.input[1]], [n + "scale"], name=n + "gather_scale"),
        helper.make_node("Cast", [n + "codes"], [n + "float"], name=n + "cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [n + "float", n + "scale"], [node.output[0]], name=n + "out"),
    ]


def _quantize_rows(source: str, graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> tuple[str, str, str]:
    """Nodes that turn ``source`` into uint8 codes with a scale and zero point per row (last axis): the
    range always holds 0, so zero padding and ReLU-like inputs stay exact. Returns (codes, scale, zero)."""
    name = _fresh(graph, source + "_tok")
    constants = {
        "axes": np.array([-1], np.int64),
        "zero": np.float32(0),
        "levels": np.float32(ACTIVATION_LEVELS),
    }
    constants["tiny"] = np.float32(np.finfo(np.float32).tiny)
    for key, value in constants.items():
        graph.initializer.append(numpy_helper.from_array(np.asarray(value), f"{name}_{key}"))

    def c(key: str) -> str:
        return f"{name}_{key}"

    steps = [
        ("ReduceMin", [source, c("axes")], "lo0"),
        ("ReduceMax", [source, c("axes")], "hi0"),
        ("Min", ["lo0", c("zero")], "lo"),
        ("Max", ["hi0", c("zero")], "hi"),
        ("Sub", ["hi", "lo"], "span"),
        ("Div", ["span", c("levels")], "scale0"),
        ("Max", ["scale0", c("tiny")], "scale"),
        ("Div", ["lo", "scale"], "neg_zero"),
        ("Neg", ["neg_zero"], "zero_f"),
        ("Round", ["zero_f"], "zero_point"),
        ("Div", [source, "scale"], "scaled"),
        ("Add", ["scaled", "zero_point"], "shifted"),
        ("Round", ["shifted"], "rounded"),
        ("Clip", ["rounded", c("zero"), c("levels")], "clipped"),
    ]
    for op, inputs, output in steps:
        wired = [i if i.startswith(name) or i == source else f"{name}_{i}" for i in inputs]
        nodes.append(helper.make_node(op, wired, [f"{name}_{output}"], name=f"{name}_{output}_node"))
    codes = f"{name}_codes"
    nodes.append(
        helper.make_node("Cast", [c("clipped")], [codes], name=codes + "_node", to=TensorProto.UINT8)
    )
    return codes, c("scale"), c("zero_point")


def _integer_matmul(
    node: onnx.NodeProto,
    weight: np.ndarray,
    bias: str | None,
    quantized: tuple[str, str, str],
    graph: onnx.GraphProto,
) -> list[onnx.NodeProto]:
    """``node`` as ``MatMulInteger`` on per-channel int8 weights (stored as uint8, zero point 128),
    rescaled to float with the per-token scale and the zero point's correction, writing the node's own
    output name."""
    codes, scale, zero_point = quantized
    name = _fresh(graph, (node.name or node.output[0]) + "_int8")
    peak = np.abs(weight).max(axis=0)
    w_scale = np.where(peak > 0, peak / WEIGHT_LEVELS, 1.0).astype(np.float32)
    w_codes = np.clip(np.round(weight / w_scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
    correction = (w_codes.astype(np.float64).sum(axis=0) * w_scale).astype(np.float32)
    stored = (w_codes.astype(np.int16) + WEIGHT_ZERO).astype(np.uint8)
    for suffix, value in (
        ("w", stored),
        ("w_zero", np.uint8(WEIGHT_ZERO)),
        ("w_scale", w_scale),
        ("w_colsum", correction),
    ):
        graph.initializer.append(numpy_helper.from_array(value, f"{name}_{suffix}"))
    n = f"{name}_"
    return [
        helper.make_node("MatMulInteger", [codes, n + "w", "", n + "w_zero"], [n + "int"], name=n + "matmul"),
        helper.make_node("Cast", [n + "int"], [n + "float"], name=n + "cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", [n + "float", n + "w_scale"], [n + "weighted"], name=n + "weighted_node"),
        helper.make_node("Mul", [zero_point, n + "w_colsum"], [n + "shift"], name=n + "shift_node"),
        helper.make_node("Sub", [n + "weighted", n + "shift"], [n + "centred"], name=n + "centred_node"),
        helper.make_node(
            "Mul", [n + "centred", scale], [n + "y" if bias else node.output[0]], name=n + "out"
        ),
        *([helper.make_node("Add", [n + "y", bias], [node.output[0]], name=n + "bias")] if bias else []),
    ]


def _fresh(graph: onnx.GraphProto, base: str) -> str:
    """A name prefix no tensor of ``graph`` starts with (exported names are often ``val_12``)."""
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    candidate, index = base, 0
    while any(t.startswith(candidate + "_") for t in taken):
        index += 1
        candidate = f"{base}{index}"
    return candidate


def _drop_unused(graph: onnx.GraphProto) -> None:
    """The float weights the rewrite replaced (an initializer nothing reads any more)."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
