"""The real all-MiniLM-L6-v2, int8-dynamic under ``torch.compile(fullgraph=True)`` with inductor at a fixed
batch size: every quantized Linear traced around its kernel (none left as one opaque operator, query, key
and value quantizing their input once), and the sentence embeddings within cosine 0.99 of the original
model's, on real sentences with padding (an attention mask that is not all ones)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import slimtorch
from slimtorch.quant import kernels
from slimtorch.quant.modules import Int8DynamicLinear
from tests.wild import classes, inputs
from tests.wild.matrix import INT8_DYNAMIC_COSINE


@pytest.mark.slow
def test_minilm_int8_compiled_is_traced_and_keeps_sentence_embeddings_at_cosine_099() -> None:
    from torch._inductor.compile_fx import compile_fx

    original = classes.bert_original()
    ids, mask = inputs.sentence_batch(classes.MINILM)
    model = slimtorch.quantize(classes.bert_original(), "int8-dynamic").model
    graphs: list[list[object]] = []

    def inductor(gm: torch.fx.GraphModule, example: list) -> Callable:
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return compile_fx(gm, example)

    compiled = torch.compile(model, fullgraph=True, backend=inductor, dynamic=False)
    with torch.inference_mode():
        want = classes.sentence_embeddings(original(input_ids=ids, attention_mask=mask), (ids, mask))
        got = classes.sentence_embeddings(compiled(input_ids=ids, attention_mask=mask), (ids, mask))
    (ops,) = graphs
    linears = sum(isinstance(m, Int8DynamicLinear) for m in model.modules())
    assert linears >= 36
    if kernels.onednn_exact("uint8"):  # its kernels are traced; onednn-u7 (no VNNI) runs as one operator
        assert torch.ops.slimtorch.quantized_layer.default not in ops
        layers = model.config.num_hidden_layers
        assert ops.count(torch.ops.slimtorch.quantize_rows.default) <= linears - 2 * layers
    cosine = F.cosine_similarity(got, want)
    assert cosine.min() >= INT8_DYNAMIC_COSINE, cosine
