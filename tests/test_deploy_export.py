"""slimtorch export: a bundle whose model agrees with eager PyTorch, runs from its own runner, says what
blocked an export that failed, and exits non-zero when the agreement is outside the tolerance."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.deploy import ExportError, ExportOptions, ExportReport, Tolerance, export
from slimtorch.deploy.runner import Bundle, BundleError, read_inputs
from slimtorch.errors import OptionError
from slimtorch.schemes import WEIGHT_ONLY
from slimtorch.schemes import scheme as scheme_row
from tests.support.specs import Branchy
from tests.zoo.models import MLP, SmallCNN
from tests.zoo.transformers_models import bert, example

IMAGE = torch.randn(1, 1, 8, 8)
BUNDLE_FILES = {
    "model.onnx",
    "requirements.txt",
    "predict.py",
    "manifest.json",
    "sample_inputs.npz",
    "expected_outputs.npz",
}


def _run_predict(bundle, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "predict.py", *args], cwd=bundle, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_cnn_exports_to_onnx_within_1e4_of_eager_as_a_complete_bundle(tmp_path) -> None:
    model = SmallCNN().eval()
    report = export(model, IMAGE, tmp_path / "cnn")
    assert report.passed and report.format == "onnx" and report.samples == 3
    assert report.errors[0].max_abs < 1e-4
    assert {p.name for p in (tmp_path / "cnn").iterdir()} == BUNDLE_FILES
    manifest = json.loads((tmp_path / "cnn" / "manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 1, 8, 8]}]
    assert manifest["verification"]["passed"] is True
    requirements = (tmp_path / "cnn" / "requirements.txt").read_text()
    assert "onnxruntime==" in requirements and "numpy" in requirements and "torch" not in requirements
    expected = np.load(tmp_path / "cnn" / "expected_outputs.npz")["output"]
    np.testing.assert_array_equal(expected, model(IMAGE).detach().numpy())
    done = _run_predict(tmp_path / "cnn", "--check")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True


@pytest.mark.slow
def test_runner_predicts_from_npy_and_json_and_refuses_a_wrong_shape(tmp_path) -> None:
    model = SmallCNN().eval()
    export(model, IMAGE, tmp_path / "b")
    x = torch.randn(1, 1, 8, 8)
    np.save(tmp_path / "x.npy", x.numpy())
    (tmp_path / "x.json").write_text(json.dumps(x.tolist()))
    want = model(x).detach().numpy()
    for given in ("x.npy", "x.json"):
        done = _run_predict(tmp_path / "b", str(tmp_path / given))
        assert done.returncode == 0, done.stderr
        np.testing.assert_allclose(json.loads(done.stdout)["output"], want, atol=1e-4)
    done = _run_predict(tmp_path / "b", str(tmp_path / "x.npy"), "-o", str(tmp_path / "out.npz"))
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["output"], want, atol=1e-4)
    with pytest.raises(BundleError, match=r"shape \[2, 1, 8, 8\], expected \[1, 1, 8, 8\]"):
        Bundle(tmp_path / "b").predict([np.zeros((2, 1, 8, 8), np.float32)])


@pytest.mark.slow
def test_dynamic_batch_runs_any_batch_size(tmp_path) -> None:
    model = SmallCNN().eval()
    report = export(model, IMAGE, tmp_path / "b", dynamic_batch=True)
    assert report.passed and report.samples == 4  # three at batch 1, one at batch 3
    assert report.inputs[0].shape == ["batch", 1, 8, 8]
    x = torch.randn(5, 1, 8, 8)
    got = Bundle(tmp_path / "b").predict({"x": x.numpy()})["output"]
    np.testing.assert_allclose(got, model(x).detach().numpy(), atol=1e-4)


@pytest.mark.slow
def test_int8_onnx_is_smaller_and_within_the_quantized_tolerance(tmp_path) -> None:
    model = MLP((256, 512, 512, 10)).eval()
    fp32 = export(model, torch.randn(4, 256), tmp_path / "fp32")
    int8 = export(model, torch.randn(4, 256), tmp_path / "int8", quantize_to="int8")
    assert int8.quantized == "int8" and int8.tolerance.rtol == 0.1
    assert int8.passed and int8.errors[0].max_rel < 0.05
    assert int8.model_bytes < 0.3 * fp32.model_bytes


@pytest.mark.slow
def test_slimtorch_int8_model_keeps_its_codes_through_onnxruntime_int8(tmp_path) -> None:
    model = MLP((64, 128, 16)).eval()
    slimtorch.quantize(model, "int8-dynamic")
    report = export(model, torch.randn(2, 64), tmp_path / "b")
    assert report.quantized == "int8" and report.passed
    stored = [numpy_helper.to_array(t) for t in onnx.load(tmp_path / "b" / "model.onnx").graph.initializer]
    # stored as uint8 with zero point 128 (exact on CPUs without VNNI): the same codes, 128 up
    int8 = [(a.astype(np.int16) - 128).astype(np.int8) for a in stored if a.dtype == np.uint8 and a.ndim == 2]
    for layer in (model.layers[0], model.layers[2]):
        codes = layer.qweight.numpy()
        assert any(a.shape == codes.T.shape and np.array_equal(a.T, codes) for a in int8)
    assert type(model.layers[0]).__name__ == "Int8DynamicLinear"  # the caller's model is untouched


@pytest.mark.slow
@pytest.mark.parametrize("scheme", WEIGHT_ONLY)
def test_onnx_takes_per_channel_int8_as_codes_and_grouped_layers_as_floats_saying_so(scheme, tmp_path):
    """onnxruntime's int8 here has a scale per channel: grouped codes (int4, a grouped int8 scheme) would
    come back coarser from it, so they are exported as their dequantized floats, with a note."""
    model = MLP((128, 128, 16)).eval()
    slimtorch.quantize(model, scheme, group_size=64)
    report = export(model, torch.randn(2, 128), tmp_path / "b")
    row = scheme_row(scheme)
    assert report.passed
    if row.grouped:
        assert report.quantized != "int8"
        assert any(
            f"{row.codec} layers in groups are exported with their dequantized" in n for n in report.notes
        )
    else:
        assert report.quantized == "int8" and not any("in groups" in n for n in report.notes)


@pytest.mark.slow
def test_pt2_of_a_quantized_model_keeps_int8_codes_and_loads_with_torch_export(tmp_path) -> None:
    model = MLP((256, 512, 10)).eval()
    fp32 = export(model, torch.randn(2, 256), tmp_path / "fp32", format="pt2")
    assert fp32.passed and fp32.errors[0].max_abs == 0.0
    int8 = export(model, torch.randn(2, 256), tmp_path / "int8", format="pt2", quantize_to="int8")
    assert int8.passed and int8.model_bytes < 0.45 * fp32.model_bytes
    assert "torch==" in (tmp_path / "int8" / "requirements.txt").read_text()
    program = torch.export.load(tmp_path / "int8" / "model.pt2")
    assert any(t.dtype == torch.int8 for t in program.state_dict.values())
    assert _run_predict(tmp_path / "int8", "--check").returncode == 0


@pytest.mark.slow
def test_bert_outputs_are_named_and_agree(tmp_path) -> None:
    model = bert().eval()
    report = export(model, example("bert")[0][:1], tmp_path / "b")
    assert [o.name for o in report.outputs] == ["last_hidden_state", "pooler_output"]
    assert report.inputs[0].name == "input_ids" and report.inputs[0].dtype == "int64"
    assert report.passed and max(e.max_abs for e in report.errors) < 1e-4


def test_export_failure_names_the_construct_module_and_line_and_what_was_tried(tmp_path) -> None:
    with pytest.raises(ExportError) as caught:
        export(Branchy(), torch.randn(1, 8), tmp_path / "b")
    message = str(caught.value)
    assert "depends on a tensor's values" in message
    assert "gate (Gate)" in message and "specs.py" in message and "x.sum() > 0" in message
    assert "strict=False" in message and "strict=True" in message
    assert not (tmp_path / "b").exists()  # nothing half-written


@torch.library.custom_op("slimtorch_test::wobble", mutates_args=())
def wobble(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@wobble.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Wobbly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), WobbleLayer())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class WobbleLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wobble(x)


@pytest.mark.slow
def test_an_op_without_onnx_translation_is_named_with_its_module(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"slimtorch_test::wobble, used in inner\.1 \(WobbleLayer\)"):
        export(Wobbly(), torch.randn(2, 4), tmp_path / "b")
    report = export(Wobbly(), torch.randn(2, 4), tmp_path / "pt2", format="pt2")  # pt2 keeps custom ops
    assert report.passed


@pytest.mark.slow
def test_cli_exits_2_on_export_failure_and_1_outside_tolerance(tmp_path, capsys) -> None:
    args = ["export", "tests.support.specs:Branchy", "--input-shape", "1,8", "-o", str(tmp_path / "b")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slimtorch: error: cannot export the model")
    strict = ["export", "tests.zoo.models:MLP", "--input-shape", "2,64", "-o", str(tmp_path / "m")]
    assert main([*strict, "--scheme", "int8-dynamic", "--rtol", "0"]) == 1
    assert "verification failed" in capsys.readouterr().err
    assert json.loads((tmp_path / "m" / "manifest.json").read_text())["verification"]["passed"] is False
    assert _run_predict(tmp_path / "m", "--check").returncode == 1  # the bundle knows it failed


@pytest.mark.slow
def test_cli_json_report_and_example_from_npz(tmp_path, capsys) -> None:
    np.savez(tmp_path / "in.npz", x=np.random.randn(3, 64).astype(np.float32))
    given = str(tmp_path / "in.npz")
    args = ["export", "tests.zoo.models:MLP", "--example", given, "-o", str(tmp_path / "b")]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "slimtorch.export/1" and data["passed"] is True
    assert data["inputs"][0]["shape"] == [3, 64]
    np.savez(tmp_path / "bad.npz", y=np.zeros((1, 64), np.float32))
    assert main(["export", "tests.zoo.models:MLP", "--example", str(tmp_path / "bad.npz"), "-o", "x"]) == 2
    assert "has no input 'y' (it takes x)" in capsys.readouterr().err


@pytest.mark.slow
def test_replaces_a_bundle_but_never_a_folder_of_other_files(tmp_path) -> None:
    export(SmallCNN().eval(), IMAGE, tmp_path / "b")
    export(MLP().eval(), torch.randn(1, 64), tmp_path / "b")  # a bundle is replaced
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["inputs"][0]["shape"] == [1, 64]
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    with pytest.raises(slimtorch.SlimtorchError, match="not a slimtorch bundle; refusing"):
        export(MLP().eval(), torch.randn(1, 64), tmp_path / "work")
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_check_fails_when_a_file_no_longer_matches_its_checksum(tmp_path) -> None:
    export(MLP().eval(), torch.randn(1, 64), tmp_path / "b")
    with open(tmp_path / "b" / "model.onnx", "r+b") as stream:
        stream.seek(-8, 2)
        stream.write(b"\x00" * 8)
    done = _run_predict(tmp_path / "b", "--check")
    assert done.returncode == 2 and "model.onnx: checksum does not match the manifest" in done.stderr


def test_read_inputs_takes_npz_json_objects_and_lists(tmp_path) -> None:
    ids, mask = ({"name": name, "dtype": "int64", "shape": ["batch"]} for name in ("ids", "mask"))
    np.savez(tmp_path / "a.npz", ids=np.arange(3))
    (tmp_path / "a.json").write_text(json.dumps({"ids": [1, 2], "mask": [1, 1]}))
    (tmp_path / "b.json").write_text(json.dumps([[1, 2], [1, 0]]))
    assert read_inputs([str(tmp_path / "a.npz")], [ids])["ids"].tolist() == [0, 1, 2]
    assert set(read_inputs([str(tmp_path / "a.json")], [ids, mask])) == {"ids", "mask"}
    assert read_inputs([str(tmp_path / "b.json")], [ids, mask])["mask"].tolist() == [1, 0]
    with pytest.raises(BundleError, match="takes 2 input"):
        read_inputs([str(tmp_path / "x.npy")], [ids, mask])


@pytest.mark.slow
def test_onnx_bundle_runs_in_its_own_venv_without_torch_within_150_mb(tmp_path) -> None:
    """The whole promise: requirements.txt alone, in a clean venv, runs the model; torch is not there."""
    from slimtorch.deploy import measure_footprint

    model = SmallCNN().eval()
    export(model, IMAGE, tmp_path / "b", dynamic_batch=True)
    report = measure_footprint(tmp_path / "b", baseline=False, keep=tmp_path / "venv")
    assert report.sample_ok, report.sample_error
    assert report.sample_output["ok"] is True
    names = {p.name.lower() for p in report.packages}
    assert {"onnxruntime", "numpy"} <= names and "torch" not in names
    assert report.runtime_bytes <= 150 * 2**20
    assert report.model_bytes == (tmp_path / "b" / "model.onnx").stat().st_size
    python = tmp_path / "venv" / "bin" / "python"
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    x = torch.randn(4, 1, 8, 8)
    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run(
        [python, "predict.py", str(tmp_path / "x.npy")], cwd=tmp_path / "b", capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    np.testing.assert_allclose(json.loads(done.stdout)["output"], model(x).detach().numpy(), atol=1e-4)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.view(2, -1))  # the batch of 2 is written into the model


@pytest.mark.slow
def test_a_batch_the_model_fixes_cannot_be_dynamic_and_says_so(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"the batch dimension cannot stay dynamic .*without --dynamic"):
        export(FixedBatch(), torch.randn(2, 8), tmp_path / "b", dynamic_batch=True)
    assert export(FixedBatch(), torch.randn(2, 8), tmp_path / "b").passed


class Cancelling(nn.Module):
    """Two large, nearly equal matmuls subtracted: outputs near 1 carry rounding of intermediates near
    1e4, so eager fp32 itself is ~3e-3 from fp64 (pesto's pitch head does this on a smaller scale).
    ``offset`` is added only in the exported program: a truly wrong export."""

    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.offset = nn.Linear(256, 256), nn.Linear(256, 256), offset
        with torch.no_grad():
            self.a.weight.mul_(1e3)
            self.b.weight.copy_(self.a.weight * (1 + 1e-4))
            self.b.bias.copy_(self.a.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) - self.b(x)
        return y + self.offset if torch.compiler.is_exporting() else y


@pytest.mark.slow
def test_fp32_tolerance_grows_to_the_models_own_rounding_noise_but_a_wrong_export_still_fails(tmp_path):
    x = torch.randn(4, 256) * 10
    report = export(Cancelling(), x, tmp_path / "right")
    error = report.errors[0]
    assert error.max_abs > slimtorch.deploy.FP32.atol + slimtorch.deploy.FP32.rtol * error.scale
    assert report.passed and report.tolerance.atol > 1e-3
    assert "fp64" in report.tolerance.meaning and any("fp64" in note for note in report.notes)
    manifest = json.loads((tmp_path / "right" / "manifest.json").read_text())
    assert manifest["tolerance"]["atol"] == report.tolerance.atol and manifest["verification"]["passed"]
    assert Bundle(tmp_path / "right").check()["ok"]
    wrong = export(Cancelling(offset=0.1), x, tmp_path / "wrong")
    assert not wrong.passed and wrong.errors[0].max_abs > 0.09


def _seeded_export(model: nn.Module, x: torch.Tensor, out, *args, **kwargs) -> dict:
    """The report as JSON, less what differs between two equal runs (the folder, the time taken)."""
    torch.manual_seed(0)  # the same random verification inputs
    data = export(model, x, out, *args, **kwargs).to_dict()
    del data["bundle"], data["seconds"]
    return data


@pytest.mark.slow
def test_options_by_dataclass_and_by_override_give_the_same_report(tmp_path) -> None:
    model, x = MLP((16, 32, 4)).eval(), torch.randn(2, 16)
    options = ExportOptions(format="pt2", dynamic_batch=True, samples=2)
    given = _seeded_export(model, x, tmp_path / "a", options)
    overridden = _seeded_export(model, x, tmp_path / "b", format="pt2", dynamic_batch=True, samples=2)
    assert given == overridden
    assert given["format"] == "pt2" and given["samples"] == 3  # 2, and one at another batch size
    assert _seeded_export(model, x, tmp_path / "c", options, samples=1)["samples"] == 2  # a field replaced


def test_an_unknown_export_option_names_the_fields_and_writes_nothing(tmp_path) -> None:
    fields = "ExportOptions has: dynamic_batch, format, quantize_to, samples, tolerance"
    with pytest.raises(OptionError, match=f"export: unknown option 'quantize'; {fields}"):
        export(MLP().eval(), torch.randn(1, 64), tmp_path / "b", quantize="int8")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("format", "tflite", "unknown format 'tflite'; choose one of onnx, pt2"),
        ("quantize_to", "int4", "quantize_to takes 'int8' or None, not 'int4'"),
        ("samples", 0, "a count of 1 or more, not 0"),
        ("tolerance", 1e-3, "tolerance must be a Tolerance or None, not float"),
    ],
)
def test_a_bad_option_value_is_an_option_error_where_it_is_written(tmp_path, field, value, says) -> None:
    with pytest.raises(OptionError, match=says):
        ExportOptions(**{field: value})
    with pytest.raises(OptionError, match=says):
        export(MLP().eval(), torch.randn(1, 64), tmp_path / "b", **{field: value})
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_the_onnx_report_as_json_fits_its_schema(tmp_path) -> None:
    tolerance = Tolerance(1e-3, 0.0, "given: within 1e-3")
    report = export(MLP().eval(), torch.randn(1, 64), tmp_path / "b", tolerance=tolerance)
    data = json.loads(json.dumps(report.to_dict()))
    schema = ExportReport.json_schema()
    assert set(data) == set(schema["properties"]) and data["schema"] == "slimtorch.export/1"
    assert data["passed"] is True and data["tolerance"]["meaning"] == "given: within 1e-3"
    assert set(data["errors"][0]) == set(schema["properties"]["errors"]["items"]["properties"])
    assert set(data["inputs"][0]) == set(schema["properties"]["inputs"]["items"]["properties"])


class _Recording(nn.Module):
    """A linear layer that keeps every input it is called with outside tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_exporting() and not torch.jit.is_tracing():
            self.seen.append(x.detach().clone())
        return self.linear(x)


@pytest.mark.slow
def test_the_random_inputs_verified_on_are_the_same_whatever_ran_before(tmp_path) -> None:
    """Two exports of one model and example verify on the same drawn inputs, whatever torch's global
    random state: a verdict on a model whose output jumps with its input (a distance cutoff) is
    repeatable (a wild checkpoint passed on one run's draw and failed on the next)."""
    seen = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = _Recording().eval()
        model.linear.load_state_dict(nn.Linear(4, 2).state_dict() | {"bias": torch.zeros(2)})
        export(model, torch.ones(1, 4), tmp_path / f"bundle-{seed}", samples=3, dynamic_batch=True)
        seen.append([x for x in model.seen if not torch.equal(x, torch.ones(1, 4))])
    assert len(seen[0]) >= 3 and len(seen[0]) == len(seen[1])
    assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))


class RowSums(nn.Module):
    """Sums 20,000 rows into 64 by a fixed index: ``index_add``, which ONNX writes as a ScatterND with
    reduction=add, the operator onnxruntime's CPU kernel races on when it has more than one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "rows", torch.randint(0, 64, (20_000,), generator=torch.Generator().manual_seed(3))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(64, x.shape[1]).index_add(0, self.rows, x)


@pytest.mark.slow
def test_a_graph_onnxruntime_races_on_runs_on_one_thread_verified_and_in_the_bundle(tmp_path) -> None:
    model, x = RowSums(), torch.randn(20_000, 32)
    report = export(model, x, tmp_path / "sums", samples=2)
    assert report.passed and report.threads == 1
    assert any("one thread" in note and "ScatterND (reduction=add)" in note for note in report.notes)
    manifest = json.loads((tmp_path / "sums" / "manifest.json").read_text())
    assert manifest["model"]["threads"] == 1
    bundle, want = Bundle(tmp_path / "sums"), model(x).numpy()
    worst = max(float(np.abs(bundle.predict([x.numpy()])["output"] - want).max()) for _ in range(10))
    assert worst < 1e-3  # on two threads: off by up to 13, differently each run
    assert _run_predict(tmp_path / "sums", "--check").returncode == 0


def test_racy_operators_are_found_in_subgraphs_and_only_with_a_reduction(tmp_path) -> None:
    from onnx import TensorProto, helper

    from slimtorch.deploy.onnx_model import racy_on_threads

    def scatter(reduction: str, out: str) -> onnx.NodeProto:
        return helper.make_node("ScatterND", ["d", "i", "u"], [out], reduction=reduction)

    floats = helper.make_tensor_value_info("d", TensorProto.FLOAT, [4])
    branch = helper.make_graph(
        [scatter("add", "a")], "then", [], [helper.make_tensor_value_info("a", 1, [4])]
    )
    plain = helper.make_graph(
        [scatter("none", "b")], "else", [], [helper.make_tensor_value_info("b", 1, [4])]
    )
    nodes = [
        scatter("none", "n"),
        scatter("max", "m"),
        helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=plain),
    ]
    graph = helper.make_graph(nodes, "g", [floats], [helper.make_tensor_value_info("y", 1, [4])])
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    assert racy_on_threads(tmp_path / "m.onnx") == ["ScatterND (reduction=add)", "ScatterND (reduction=max)"]
    onnx.save(
        helper.make_model(helper.make_graph([scatter("none", "y")], "g", [floats], [])), tmp_path / "n.onnx"
    )
    assert racy_on_threads(tmp_path / "n.onnx") == []
