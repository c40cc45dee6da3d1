"""int8 ONNX export of text models: per-token activation scales, and a check decided by the sentence
embedding's cosine to eager (each output's error still reported), which a wrongly quantized file fails."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from slimtorch.deploy import INT8, ExportReport, OutputError, export, onnx_model
from slimtorch.deploy.export import INT8_TEXT
from slimtorch.deploy.fidelity import EmbeddingAgreement, EmbeddingSource, embedding_source, embeddings
from slimtorch.deploy.runner import Bundle
from tests.zoo.models import SmallCNN
from tests.zoo.transformers_models import bert


def _tokens(batch: int = 3, length: int = 12) -> dict[str, torch.Tensor]:
    """Token ids with right padding: each row a quarter shorter than the last."""
    ids = torch.randint(1, 100, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row in range(batch):
        mask[row, : length - row * (length // 4)] = 1
    return {"input_ids": ids * mask, "attention_mask": mask}


def _session(path) -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_bert_int8_passes_on_its_embedding_cosine_with_per_token_matmuls(tmp_path) -> None:
    report = export(bert().eval(), _tokens(), tmp_path / "b", quantize_to="int8")
    assert report.tolerance == INT8_TEXT and "decided by the sentence embedding" in report.tolerance.meaning
    assert report.passed and report.embedding.min_cosine >= 0.99 and report.embedding.texts >= 3
    assert report.embedding.source == "mean of last_hidden_state over the tokens attention_mask keeps"
    assert {e.name for e in report.errors} == {"last_hidden_state", "pooler_output"}  # reported beside it
    graph = onnx.load(tmp_path / "b" / "model.onnx").graph
    weights = {t.name for t in graph.initializer}
    ops = {n.op_type for n in graph.node}
    assert {"MatMulInteger", "ReduceMax"} <= ops and "DynamicQuantizeLinear" not in ops
    assert not [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]  # all int8
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["tolerance"]["min_cosine"] == 0.99
    assert manifest["verification"]["embedding"]["min_cosine"] == report.embedding.min_cosine
    checked = Bundle(tmp_path / "b").check()  # the bundle's own check (predict.py --check) decides alike
    assert checked["ok"] and checked["embedding_cosine"] >= 0.99


@pytest.mark.slow
def test_the_bundles_own_check_fails_a_text_model_whose_embedding_drifts(tmp_path) -> None:
    export(bert().eval(), _tokens(), tmp_path / "b", quantize_to="int8")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["tolerance"]["min_cosine"] = 0.9999999  # stricter than int8 can be
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    checked = Bundle(tmp_path / "b").check()
    assert not checked["ok"] and checked["embedding_cosine"] < 0.9999999


_real_quantize = onnx_model.quantize_int8


def _scrambled(source, target) -> None:
    """The real int8 pass, then every int8 weight's rows shuffled (stored as int8 or as uint8 with zero
    point 128): a file quantized wrongly."""
    _real_quantize(source, target)
    model = onnx.load(str(target))
    rng = np.random.default_rng(0)
    for tensor in model.graph.initializer:
        if tensor.data_type in (TensorProto.INT8, TensorProto.UINT8) and len(tensor.dims) == 2:
            codes = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array(codes[rng.permutation(codes.shape[0])], tensor.name))
    onnx.save(model, str(target))


@pytest.mark.slow
def test_a_wrongly_quantized_bert_fails_the_embedding_check(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(onnx_model, "quantize_int8", _scrambled)
    report = export(bert().eval(), _tokens(), tmp_path / "b", quantize_to="int8")
    assert not report.passed and report.embedding.min_cosine < 0.9
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["verification"]["passed"] is False


def _outlier_token_model(path) -> tuple[np.ndarray, np.ndarray]:
    """A float ONNX ``x @ w`` and an input whose first token is 200 times larger than the rest, as a
    transformer's separator tokens are in its outlier channels."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "outlier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 32])],
        [numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(path))
    x = rng.normal(size=(1, 16, 64)).astype(np.float32)
    x[0, 0] *= 200
    return x, x @ weight


def test_per_token_scales_keep_the_ordinary_tokens_that_one_whole_tensor_scale_loses(tmp_path) -> None:
    x, want = _outlier_token_model(tmp_path / "float.onnx")
    onnx_model.quantize_int8(tmp_path / "float.onnx", tmp_path / "ours.onnx")
    quantize_dynamic(
        tmp_path / "float.onnx", tmp_path / "ort.onnx", weight_type=QuantType.QInt8, per_channel=True
    )
    rest = np.abs(want[0, 1:]).max()
    ours = _session(tmp_path / "ours.onnx").run(None, {"x": x})[0]
    plain = _session(tmp_path / "ort.onnx").run(None, {"x": x})[0]
    assert np.abs(ours[0, 1:] - want[0, 1:]).max() < 0.02 * rest  # each token at its own scale
    assert np.abs(plain[0, 1:] - want[0, 1:]).max() > 0.2 * rest  # one scale set by the outlier token
    assert np.abs(ours[0, 0] - want[0, 0]).max() < 0.02 * np.abs(want[0, 0]).max()


def test_embedding_source_is_the_sentence_output_or_the_masked_mean_and_none_for_other_models() -> None:
    ids = ["input_ids", "attention_mask"]
    assert embedding_source(ids, [("sentence_embedding", (2, 8))]) == EmbeddingSource(
        "sentence_embedding", False, None
    )
    assert embedding_source(ids, [("last_hidden_state", (2, 5, 8)), ("pooler_output", (2, 8))]) == (
        EmbeddingSource("last_hidden_state", True, "attention_mask")
    )
    assert embedding_source(["input_ids"], [("last_hidden_state", (2, 5, 8))]).mask is None
    assert embedding_source(ids, [("logits", (2, 3))]) is None  # a classifier: today's per-output rule
    assert embedding_source(["x"], [("last_hidden_state", (2, 5, 8))]) is None


def test_masked_mean_ignores_padding_and_leaves_out_a_text_with_no_tokens() -> None:
    source = EmbeddingSource("last_hidden_state", True, "attention_mask")
    hidden = np.ones((3, 4, 2))
    hidden[0, 2:] = 1e6  # padding of the first text: must not count
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    got = embeddings(asdict(source), {"attention_mask": mask}, {"last_hidden_state": hidden})
    np.testing.assert_allclose(got, np.ones((2, 2)))


def _report(cosine: float, output_passed: bool) -> ExportReport:
    error = OutputError("last_hidden_state", 0.5, 0.2 if not output_passed else 0.01, 2.5, output_passed)
    agreement = EmbeddingAgreement("mean", cosine, cosine, 4, 0.99, cosine >= 0.99)
    return ExportReport(
        "b", "onnx", "model.onnx", 1, 1, "int8", (), (), (error,), 4, INT8_TEXT, {}, (), agreement
    )


@pytest.mark.parametrize(
    ("cosine", "output_passed", "passed"), [(0.995, False, True), (0.98, True, False), (0.995, True, True)]
)
def test_cosine_decides_a_text_tolerance_and_the_output_errors_decide_otherwise(
    cosine: float, output_passed: bool, passed: bool
) -> None:
    report = _report(cosine, output_passed)
    assert report.passed is passed
    assert replace(report, tolerance=INT8).passed is output_passed  # no min_cosine: each output decides


@pytest.mark.slow
def test_a_cnn_keeps_onnxruntime_int8_convolutions_beside_per_token_linears(tmp_path) -> None:
    report = export(SmallCNN().eval(), torch.randn(2, 1, 8, 8), tmp_path / "b", quantize_to="int8")
    ops = {n.op_type for n in onnx.load(tmp_path / "b" / "model.onnx").graph.node}
    assert report.passed and report.tolerance == INT8 and report.embedding is None  # not a text model
    assert {"ConvInteger", "MatMulInteger"} <= ops and "Conv" not in ops
    assert sorted(p.name for p in (tmp_path / "b").iterdir() if p.name.endswith(".onnx")) == ["model.onnx"]


@pytest.mark.slow
def test_a_bundle_whose_manifest_names_no_such_embedding_output_is_one_clear_error(tmp_path) -> None:
    from slimtorch.deploy.runner import BundleError

    export(bert().eval(), _tokens(), tmp_path / "b", quantize_to="int8")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["verification"]["embedding_source"] = {"output": "nothing", "pooled": False, "mask": None}
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="embedding_source is unusable"):
        Bundle(tmp_path / "b").check()


@pytest.mark.slow
def test_the_bundles_own_check_lets_the_embedding_decide_over_the_outputs_errors(tmp_path) -> None:
    export(bert().eval(), _tokens(), tmp_path / "b", quantize_to="int8")
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    manifest["tolerance"].update(atol=0.0, rtol=0.0)  # every output "fails" on its own error
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(manifest))
    checked = Bundle(tmp_path / "b").check()
    assert checked["ok"] and checked["embedding_cosine"] >= 0.99
