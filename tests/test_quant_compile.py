"""Quantized layers under torch.compile: every scheme and layer kind compiles with ``fullgraph=True`` (no
graph break, or compiling raises) and gives eager's output.

Compiling is slow on a busy machine, so one small model holds one layer of each kind and is compiled once per
scheme with inductor (what users get); the tests per layer kind read that one compiled run.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.quant import sharing
from slimtorch.quant.conv import Int4WeightConv, Int8WeightConv
from slimtorch.quant.modules import (
    Int4Embedding,
    Int4WeightLinear,
    Int8DynamicLinear,
    Int8Embedding,
    Int8WeightLinear,
    _traced_kernel,
    constant_when_compiled,
    int8_dynamic_kernels,
)
from slimtorch.quant.recurrent import Int4WeightRecurrent, Int8DynamicRecurrent, Int8WeightRecurrent

WIDTH = 128  # a multiple of the int4 group size, so the fused int4 kernel is a candidate too
TOLERANCE = 1e-5
"""Relative L2 error allowed between compiled and eager: the compiled graph runs the kernel eager chose, so
only inductor's fused embedding dequantization may round differently."""

LAYERS = {
    "int8-dynamic": {
        "embed": Int8Embedding,
        "linear": Int8DynamicLinear,
        "lstm": Int8DynamicRecurrent,
        "gru": Int8DynamicRecurrent,
    },
    "int8-weight": {
        "embed": Int8Embedding,
        "linear": Int8WeightLinear,
        "conv": Int8WeightConv,
        "lstm": Int8WeightRecurrent,
        "gru": Int8WeightRecurrent,
    },
    "int4-weight": {
        "embed": Int4Embedding,
        "linear": Int4WeightLinear,
        "conv": Int4WeightConv,
        "lstm": Int4WeightRecurrent,
        "gru": Int4WeightRecurrent,
    },
}


class EveryLayer(nn.Module):
    """One of each layer kind slimtorch quantizes, each one's output returned by name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.linear = nn.Linear(WIDTH, 2 * WIDTH)
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.lstm = nn.LSTM(WIDTH, 32, num_layers=2, batch_first=True)
        self.gru = nn.GRU(WIDTH, 32, batch_first=True, bidirectional=True)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(ids)
        lstm_out, (lstm_h, lstm_c) = self.lstm(h)
        gru_out, gru_h = self.gru(h)
        return {
            "embed": h,
            "linear": self.linear(h),
            "conv": self.conv(h.transpose(1, 2)),
            "lstm": torch.cat([lstm_out.flatten(), lstm_h.flatten(), lstm_c.flatten()]),
            "gru": torch.cat([gru_out.flatten(), gru_h.flatten()]),
        }


def quantized(scheme: str) -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # int8-dynamic says it leaves the convolution float
        return slimtorch.quantize(EveryLayer().eval(), scheme, keep_sensitive=False).model


@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, tuple[nn.Module, dict, dict]]:
    """Per scheme: the quantized model, its eager outputs and its outputs compiled (once, lazily)."""
    runs: dict[str, tuple[nn.Module, dict, dict]] = {}

    def run(scheme: str) -> tuple[nn.Module, dict, dict]:
        if scheme not in runs:
            model = quantized(scheme)
            ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
            eager = model(ids)
            compiled = torch.compile(model, fullgraph=True, backend="inductor")(ids)  # raises on a break
            runs[scheme] = (model, eager, compiled)
        return runs[scheme]

    return run  # type: ignore[return-value]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-12))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scheme", "layer"), [(scheme, layer) for scheme, kinds in LAYERS.items() for layer in kinds]
)
def test_quantized_layer_compiles_fullgraph_with_inductor_and_matches_eager(compiled_runs, scheme, layer):
    model, eager, compiled = compiled_runs(scheme)
    assert type(getattr(model, layer)) is LAYERS[scheme][layer]  # the layer compiled is the quantized one
    assert compiled[layer].shape == eager[layer].shape
    assert relative_error(compiled[layer], eager[layer]) <= TOLERANCE


@pytest.mark.slow
def test_int8_dynamic_leaves_the_convolution_float_and_it_still_compiles(compiled_runs):
    model, eager, compiled = compiled_runs("int8-dynamic")
    assert type(model.conv) is nn.Conv1d
    assert relative_error(compiled["conv"], eager["conv"]) <= TOLERANCE


@pytest.mark.slow
def test_compiled_layers_follow_changing_batch_and_sequence_sizes():
    # dynamic shapes: the operators' fake kernels shape their outputs from symbolic sizes
    model = quantized("int8-dynamic")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for batch, length in ((1, 3), (3, 5), (5, 2)):
        ids = torch.randint(0, 64, (batch, length))
        eager, got = model(ids), compiled(ids)
        for layer in LAYERS["int8-dynamic"]:
            assert relative_error(got[layer], eager[layer]) <= TOLERANCE, (batch, length, layer)


def test_a_copied_layer_compiles_as_its_own_layer_not_its_originals():
    model = slimtorch.quantize(nn.Sequential(nn.Linear(WIDTH, WIDTH)).eval(), "int8-weight").model
    twin = copy.deepcopy(model)
    twin[0].weight_scale.mul_(2)  # the copy now computes twice the original's product
    x = torch.randn(3, WIDTH)
    got = torch.compile(twin, fullgraph=True, backend="aot_eager")(x)
    assert relative_error(got, twin(x)) <= TOLERANCE
    assert relative_error(got, model(x)) > 0.1


@pytest.mark.slow
def test_compiled_recurrent_layer_takes_an_initial_state_and_unbatched_input():
    torch.manual_seed(0)
    lstm = slimtorch.quantize(
        nn.Sequential(nn.LSTM(16, 8)).eval(), "int8-dynamic", keep_sensitive=False
    ).model[0]
    compiled = torch.compile(lstm, fullgraph=True, backend="aot_eager")
    x, state = torch.randn(5, 16), (torch.randn(1, 8), torch.randn(1, 8))
    (out, (h, c)), (eager_out, (eager_h, eager_c)) = compiled(x, state), lstm(x, state)
    for got, expected in ((out, eager_out), (h, eager_h), (c, eager_c)):
        assert got.shape == expected.shape and relative_error(got, expected) <= TOLERANCE


class ReusedBuffer(nn.Module):
    """``second``'s input is computed after ``first`` has read its own, from it alone: inductor writes it
    into the first input's buffer in place, so both layers get the same tensor, at the same version."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(x)
        b = self.first(a)
        return self.second(a * b.sum(-1, keepdim=True)) + b


@pytest.mark.slow
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_int8_dynamic_layers_compiled_never_reuse_codes_of_a_buffer_inductor_rewrote(grad_mode):
    # Codes cached by input identity and version were the first layer's for the second (error 0.9)
    torch.manual_seed(0)
    model = slimtorch.quantize(ReusedBuffer().eval(), "int8-dynamic", keep_sensitive=False).model
    x = torch.randn(4, WIDTH)
    compiled = torch.compile(model, fullgraph=True, backend="inductor", dynamic=False)
    with grad_mode():
        eager, got = model(x), compiled(x)
    assert relative_error(got, eager) <= TOLERANCE


# -- int8-dynamic Linear traced at a fixed batch size ------------------------------------------------------
def recording(model: nn.Module, **compile_args) -> tuple[Callable, list[list[object]]]:
    """``model`` compiled with a backend that records the operators of each graph dynamo hands it (and
    runs the graph as it is), and that record."""
    graphs: list[list[object]] = []

    def record(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    return torch.compile(model, fullgraph=True, backend=record, **compile_args), graphs


def graph_ops(model: nn.Module, x: torch.Tensor, **compile_args) -> tuple[torch.Tensor, list[list[object]]]:
    compiled, graphs = recording(model, **compile_args)
    with torch.inference_mode():
        return compiled(x), graphs


OPS = torch.ops.slimtorch


def int8_mlp(kernel: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)).eval()
    return slimtorch.quantize(mlp, "int8-dynamic", keep_sensitive=False, kernel=kernel).model


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["int_mm", "onednn"])
def test_int8_dynamic_linear_at_a_fixed_batch_is_traced_with_its_kernel(kernel):
    if kernel not in int8_dynamic_kernels(torch.device("cpu")):
        pytest.skip(f"{kernel} does not run right on this CPU (oneDNN's 8-bit product needs VNNI)")
    model, x = int8_mlp(kernel), torch.randn(2, 5, WIDTH)
    got, graphs = graph_ops(model, x, dynamic=False)
    (ops,) = graphs
    assert OPS.quantized_layer.default not in ops  # no layer left as one opaque operator
    assert ops.count(OPS.quantize_rows.default) == 2
    product = torch._int_mm if kernel == "int_mm" else OPS.onednn_product.default
    assert ops.count(product) == 2
    assert relative_error(got, model(x)) <= TOLERANCE


@pytest.mark.slow
def test_a_dynamic_batch_or_the_reference_kernel_keeps_each_layer_one_operator():
    x = torch.randn(3, WIDTH)
    _, graphs = graph_ops(int8_mlp(), x, dynamic=True)  # the kernel per batch size is chosen per call
    assert graphs[0].count(OPS.quantized_layer.default) == 2
    got, graphs = graph_ops(model := int8_mlp("reference"), x, dynamic=False)
    assert graphs[0].count(OPS.quantized_layer.default) == 2
    assert relative_error(got, model(x)) <= TOLERANCE


@pytest.mark.slow
def test_a_batch_size_no_call_met_gets_its_kernel_chosen_while_tracing(monkeypatch):
    chosen_on = []

    def choose(self, x2d, rows, candidates, tolerance=None, truth=None):
        chosen_on.append((type(x2d), rows))
        return "int_mm"

    monkeypatch.setattr(Int8DynamicLinear, "choose", choose)
    model, x = int8_mlp(), torch.randn(4, WIDTH)
    state = torch.get_rng_state()
    layer = model[0]
    assert layer.kernel_at(4, torch.float32, torch.device("cpu")) == "int_mm"  # timed on its own rows
    assert torch.equal(torch.get_rng_state(), state)  # not on the caller's random stream
    layer._run_of.clear()
    chosen_on.clear()
    got, graphs = graph_ops(model, x, dynamic=False)
    assert chosen_on == [(torch.Tensor, 4), (torch.Tensor, 4)]  # real rows, timed once per layer
    assert graphs[0].count(torch._int_mm) == 2
    assert all(layer._run_of for layer in model if isinstance(layer, Int8DynamicLinear))
    assert relative_error(got, model(x)) <= TOLERANCE
    assert len(chosen_on) == 2  # the eager call found the choice made while tracing


@pytest.mark.slow
def test_forcing_another_kernel_after_compiling_compiles_again():
    model, x = int8_mlp("int_mm"), torch.randn(3, WIDTH)
    compiled, graphs = recording(model, dynamic=False)
    with torch.inference_mode():
        compiled(x)
        model[0].kernel = "reference"
        got = compiled(x)
    assert len(graphs) == 2 and graphs[1].count(OPS.quantized_layer.default) == 1
    assert relative_error(got, model(x)) <= TOLERANCE


def _tiny_transformer(kind: str) -> tuple[nn.Module, int]:
    """A 2-layer transformers model from a config, and how many row quantizations its layers save by
    sharing: per layer, query / key / value read one input (2 saved), and Llama's gate / up another (1)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=99, **sizes)
        return transformers.BertModel(config, add_pooling_layer=False).eval(), 2 * 2
    config = transformers.LlamaConfig(vocab_size=99, num_key_value_heads=2, **sizes)
    return transformers.LlamaModel(config).eval(), 2 * 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_layers_reading_one_input_compiled_share_one_quantization_of_it(kind):
    model, saved = _tiny_transformer(kind)
    model = slimtorch.quantize(model, "int8-dynamic", kernel="int_mm").model
    linears = sum(isinstance(m, Int8DynamicLinear) for m in model.modules())
    ids = torch.randint(0, 99, (1, 7), generator=torch.Generator().manual_seed(0))
    compiled, graphs = recording(model, dynamic=False)
    with torch.inference_mode():
        got, expected = compiled(input_ids=ids), model(input_ids=ids)
    assert linears == (12 if kind == "bert" else 14)
    assert graphs[0].count(OPS.quantize_rows.default) == linears - saved
    assert sharing.TRACED_SCOPES == []  # each scope opened and closed within the call, as dynamo replays it
    assert relative_error(got.last_hidden_state, expected.last_hidden_state) <= TOLERANCE


class BrokenAttention(nn.Module):
    """Query and key read one input, with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query(x)
        torch._dynamo.graph_break()
        return q + self.key(x)


@pytest.mark.slow
def test_a_sharing_scope_broken_by_a_graph_break_still_gives_eager_outputs_and_closes(monkeypatch):
    name = f"{BrokenAttention.__module__}.{BrokenAttention.__qualname__}"
    monkeypatch.setattr(sharing, "SHARING_PARENTS", sharing.SHARING_PARENTS | {name})
    torch.manual_seed(0)
    model = slimtorch.quantize(nn.Sequential(BrokenAttention()).eval(), "int8-dynamic", kernel="int_mm").model
    assert sharing._open_sharing in model[0]._forward_pre_hooks.values()
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    with torch.inference_mode():
        for x in (torch.randn(3, WIDTH), torch.randn(3, WIDTH) + 1):
            assert relative_error(compiled(x), model(x)) <= TOLERANCE
            assert sharing.TRACED_SCOPES == []


@pytest.mark.slow
def test_the_traced_kernel_is_marked_as_torchs_decorator_marks_without_importing_dynamo() -> None:
    """``constant_when_compiled`` sets the mark ``torch.compiler.assume_constant_result`` sets (so the
    traced kernel stays a constant of the graph), and a fresh process that loads quantized layers imports
    neither dynamo nor sympy's shapes (1.7 s of each ``slimtorch load`` of a quantized file)."""

    def theirs() -> int:
        return 1

    def ours() -> int:
        return 1

    torch.compiler.assume_constant_result(theirs)
    constant_when_compiled(ours)
    assert vars(ours) == vars(theirs) and vars(ours)
    assert vars(_traced_kernel) == vars(theirs)
    script = (
        "import sys, slimtorch.quant.build, slimtorch.loading.loader\n"
        "heavy = ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    imported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert imported.stdout.strip() == "[]"
