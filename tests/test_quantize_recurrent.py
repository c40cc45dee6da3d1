"""slimtorch.quantize on recurrent models, and its safety defaults: nn.LSTM / nn.GRU become int8 layers that
agree with the float ones and round-trip through save_model / load_model with their codes; every layer left
float is listed with the reason; a skip pattern that names nothing and a model with nothing to quantize are
errors; the few layers whose error would dominate stay float (resemblyzer's speaker encoder included)."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import slimtorch
from slimtorch.cli.main import main
from slimtorch.quant import kernels
from slimtorch.quant.recurrent import Int8DynamicRecurrent, QuantizedRecurrent
from slimtorch.quant.sensitivity import flat_outputs
from tests.support.specs import SCALES, OnlyLSTM, OutlierMLP

RESEMBLYZER = (
    Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/resemblyzer/pretrained.pt"
)
KERNELS = ("quantized_rnn", "dequantize")
CONFIGS = [
    ("LSTM", {"num_layers": 2, "batch_first": True}),
    ("LSTM", {"bidirectional": True, "bias": False}),
    ("GRU", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    ("GRU", {"bias": False}),
]


class Recurrent(nn.Module):
    """An LSTM or GRU over 24 features, then a head on its last output: what a speech or sequence model is."""

    def __init__(self, mode: str = "LSTM", **options) -> None:
        super().__init__()
        self.rnn = getattr(nn, mode)(24, 48, **options)
        self.batch_first = self.rnn.batch_first
        self.head = nn.Linear(48 * (2 if self.rnn.bidirectional else 1), 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1] if self.batch_first else out[-1])


def _features(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed))


def _sequence(batch_first: bool, batch: int = 3, steps: int = 20, seed: int = 1) -> torch.Tensor:
    x = torch.randn(steps, batch, 24, generator=torch.Generator().manual_seed(seed))
    return x.transpose(0, 1).contiguous() if batch_first else x


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.detach().flatten().double(), b.detach().flatten().double(), dim=0))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "options"), CONFIGS)
def test_lstm_and_gru_become_int8_layers_that_agree_with_float_on_every_kernel(
    mode: str, options: dict
) -> None:
    model = Recurrent(mode, **options).eval()
    x = _sequence(model.batch_first)
    expected = model.rnn(x)
    report = slimtorch.quantize(model, "int8-dynamic", keep_sensitive=False)
    assert type(model.rnn) is Int8DynamicRecurrent and report.layers[0].kind == f"Int8Dynamic{mode}"
    assert all(model.rnn.parts(m)["q"].dtype == torch.int8 for m in model.rnn.stages)
    assert len(model.rnn.stages) == 2 * options.get("num_layers", 1) * (
        2 if options.get("bidirectional") else 1
    )
    for kernel in KERNELS:
        model.rnn.kernel = kernel
        assert _cosine(flat_outputs(model.rnn(x)), flat_outputs(expected)) >= 0.99, kernel


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_a_quantized_lstm_round_trips_through_save_and_load_with_its_int8_codes(
    kernel: str, tmp_path
) -> None:
    model = slimtorch.quantize(
        Recurrent("LSTM", num_layers=2).eval(), "int8-dynamic", skip=["rnn.weight_ih_l0"]
    ).model
    model.rnn.kernel = kernel
    x = _sequence(False)
    expected = model(x)
    slimtorch.save_model(model, tmp_path / "lstm.safetensors")
    lstm = slimtorch.load_model(tmp_path / "lstm.safetensors", lambda: Recurrent("LSTM", num_layers=2))
    loaded = lstm.model
    assert type(loaded.rnn) is Int8DynamicRecurrent and list(loaded.rnn.stages) == list(model.rnn.stages)
    for matrix in model.rnn.stages:
        assert torch.equal(loaded.rnn.parts(matrix)["q"], model.rnn.parts(matrix)["q"])
    loaded.rnn.kernel = kernel
    assert torch.equal(loaded(x), expected)
    # any slim reader sees float tensors under nn.LSTM's own names: the coded ones decode to the codes
    with slimtorch.open(tmp_path / "lstm.safetensors") as source:
        assert source.info("rnn.weight_hh_l1").codec == "int8"
        assert source.info("rnn.weight_ih_l0").codec == "raw"  # the skipped matrix is stored float
    weights = slimtorch.load(tmp_path / "lstm.safetensors").tensors
    assert torch.equal(weights["rnn.weight_hh_l1"], model.rnn.dequantized(torch.float32, "weight_hh_l1"))
    assert torch.equal(weights["rnn.weight_ih_l0"], model.rnn.weight_ih_l0)


def _qscheme(layer: Int8DynamicRecurrent, matrix: str) -> torch.qscheme:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates its quantized tensors
        packed = layer._packed(matrix, torch.zeros(layer.parts(matrix)["q"].shape[0]))
        return torch.ops.quantized.linear_unpack(packed)[0].qscheme()


def test_int8_dynamic_takes_one_scale_per_matrix_only_where_rows_have_like_ranges(tmp_path) -> None:
    """torch's int8 RNN runs a matrix with one scale faster; a matrix whose rows differ in range (trained
    ones do) keeps a scale per row, and torch's per-channel kernel, for its accuracy."""
    model = Recurrent("GRU", num_layers=2).eval()
    with torch.no_grad():  # rows whose ranges span a decade, as in trained matrices
        model.rnn.weight_hh_l1.mul_(torch.logspace(-1, 0, 144).unsqueeze(1))
    x = _sequence(False)
    expected = model(x)
    slimtorch.quantize(model, "int8-dynamic", keep_sensitive=False)
    layer = model.rnn
    shared = {m for m in layer.stages if bool((layer.parts(m)["scale"] == layer.parts(m)["scale"][0]).all())}
    # (the first input matrix's rows are 24 long: their ranges differ by chance more than 5% allows)
    assert {"weight_hh_l0", "weight_ih_l1"} <= shared and "weight_hh_l1" not in shared
    assert {m: _qscheme(layer, m) for m in layer.stages} == {
        m: torch.per_tensor_affine if m in shared else torch.per_channel_affine for m in layer.stages
    }
    layer.kernel = "quantized_rnn"
    assert _cosine(model(x), expected) >= 0.999
    slimtorch.save_model(model, tmp_path / "gru.safetensors")
    loaded = slimtorch.load_model(tmp_path / "gru.safetensors", lambda: Recurrent("GRU", num_layers=2)).model
    assert _qscheme(loaded.rnn, "weight_hh_l0") == torch.per_tensor_affine
    loaded.rnn.kernel = "quantized_rnn"
    assert torch.equal(loaded(x), model(x))


def test_weight_only_schemes_keep_a_scale_per_row_in_every_matrix() -> None:
    layer = slimtorch.quantize(Recurrent("GRU").eval(), "int8-weight", keep_sensitive=False).model.rnn
    assert all(len(set(layer.parts(m)["scale"].tolist())) > 1 for m in layer.stages)


@pytest.mark.slow
def test_unbatched_input_a_given_state_and_packed_sequences_run_like_nn_lstm() -> None:
    float_lstm = nn.LSTM(24, 48, 2).eval()
    model = slimtorch.quantize(nn.Sequential(copy.deepcopy(float_lstm)), "int8-dynamic").model
    lstm = model[0]
    x = _sequence(False, batch=1)[:, 0]
    state = (torch.randn(2, 48), torch.randn(2, 48))
    for kernel in KERNELS:
        lstm.kernel = kernel
        (out, (h, c)), (want, (wh, wc)) = lstm(x, state), float_lstm(x, state)
        assert out.shape == want.shape and h.shape == wh.shape and c.shape == wc.shape
        assert _cosine(torch.cat([out, c]), torch.cat([want, wc])) > 0.99
    packed = nn.utils.rnn.pack_padded_sequence(_sequence(False), torch.tensor([20, 12, 5]))
    got, want = lstm(packed)[0], float_lstm(packed)[0]
    assert isinstance(got, nn.utils.rnn.PackedSequence) and _cosine(got.data, want.data) > 0.99


def test_a_model_of_only_an_lstm_is_quantized_and_reported_not_left_float_at_1x() -> None:
    report = slimtorch.quantize(OnlyLSTM(), "int8-dynamic")
    assert [(layer.name, layer.kind) for layer in report.layers] == [("lstm", "Int8DynamicLSTM")]
    assert report.kept_float == [] and report.ratio < 0.3


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "worst"), [("int8-weight", 0.999), ("int4-weight", 0.98)])
def test_weight_only_schemes_quantize_lstm_matrices_and_round_trip(
    scheme: str, worst: float, tmp_path
) -> None:
    model = Recurrent("GRU", num_layers=2).eval()
    x = _sequence(False)
    expected = model(x)
    slimtorch.quantize(model, scheme, keep_sensitive=False)
    assert isinstance(model.rnn, QuantizedRecurrent) and scheme == model.rnn.SCHEME
    assert _cosine(model(x), expected) >= worst
    slimtorch.save_model(model, tmp_path / "gru.safetensors")
    loaded = slimtorch.load_model(tmp_path / "gru.safetensors", lambda: Recurrent("GRU", num_layers=2)).model
    assert torch.equal(loaded(x), model(x))


def test_a_quantized_lstm_deep_copies_after_running_and_dequantizes_to_nn_lstm() -> None:
    model = slimtorch.quantize(OnlyLSTM(), "int8-dynamic", kernel="quantized_rnn").model
    x = torch.randn(10, 2, 32)
    expected = model(x)
    assert torch.equal(copy.deepcopy(model)(x), expected)
    assert slimtorch.quant.dequantize(model) == ["lstm"] and type(model.lstm) is nn.LSTM
    assert _cosine(model(x), expected) > 0.99


@pytest.mark.slow
def test_torch_int8_rnn_kernel_is_never_chosen_where_it_disagrees_with_the_float_one() -> None:
    # an LSTM reading features spread over four decades through weights that make up for it, as
    # resemblyzer's reads power mel bands: per-tensor int8 activations lose the small features
    lstm = nn.LSTM(16, 32).eval()
    with torch.no_grad():
        lstm.weight_ih_l0.div_(SCALES)
    model = slimtorch.quantize(nn.Sequential(lstm), "int8-dynamic", keep_sensitive=False).model
    x = torch.randn(30, 2, 16) * SCALES
    outputs = {}
    for kernel in KERNELS:
        model[0].kernel = kernel
        outputs[kernel] = model(x)[0]
    error = torch.linalg.vector_norm(outputs["quantized_rnn"] - outputs["dequantize"])
    assert float(error / torch.linalg.vector_norm(outputs["dequantize"])) > 0.1
    model[0].kernel = None
    kernels.CHOICES.clear()
    model(x)
    assert set(kernels.CHOICES.measured().values()) == {"dequantize"}
    # an LSTM of the same shape that reads ordinary features gets its own verdict, not this one's
    other = slimtorch.quantize(
        nn.Sequential(nn.LSTM(16, 32).eval()), "int8-dynamic", keep_sensitive=False
    ).model
    other(torch.randn(30, 2, 16))
    assert len(kernels.CHOICES.measured()) == 2


def test_layers_left_float_are_listed_with_their_size_and_reason() -> None:
    model = nn.ModuleDict(
        {
            "conv": nn.Conv1d(64, 64, 9),
            "attn": nn.MultiheadAttention(64, 4),
            "normed": nn.utils.parametrizations.weight_norm(nn.Linear(64, 64)),
            "rnn": nn.RNN(64, 64),
            "projected": nn.LSTM(64, 64, proj_size=16),
            "linear": nn.Linear(64, 64),
        }
    )
    model.register_parameter("table", nn.Parameter(torch.randn(64, 64)))
    report = slimtorch.quantize(model, "int8-dynamic")
    assert [layer.name for layer in report.layers] == ["linear"]
    kept = {layer.name: layer for layer in report.kept_float}
    assert set(kept) == {"conv", "attn", "attn.out_proj", "normed", "rnn", "projected", ""}
    assert "no convolution kernel" in kept["conv"].reason and kept["conv"].bytes == 64 * 64 * 9 * 4
    assert "in_proj_weight" in kept["attn"].reason and "subclasses nn.Linear" in kept["attn.out_proj"].reason
    assert "parametrization" in kept["normed"].reason and kept["normed"].kind == "Linear"
    assert "nn.RNN has no quantized kernel" in kept["rnn"].reason
    assert "proj_size" in kept["projected"].reason
    assert "'table'" in kept[""].reason


def test_a_model_with_nothing_to_quantize_is_an_error(tmp_path, capsys) -> None:
    with pytest.raises(
        slimtorch.SlimtorchError, match="nothing in this model could be quantized with int8-dynamic"
    ):
        slimtorch.quantize(nn.Sequential(nn.Conv1d(8, 8, 3), nn.ReLU()), "int8-dynamic")
    with pytest.raises(slimtorch.SlimtorchError, match="matches skip pattern"):
        slimtorch.quantize(nn.Sequential(nn.Linear(8, 8)), "int8-dynamic", skip=["0"])
    args = ["quantize", "tests.zoo.models:SmallCNN", "-o", str(tmp_path / "x.safetensors")]
    assert main([*args, "--input-shape", "1,1,8,8", "--skip", "head", "--runs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing in this model could be quantized" in err[0]


def test_a_mistyped_skip_pattern_is_refused_naming_the_closest_modules(tmp_path, capsys) -> None:
    with pytest.raises(
        slimtorch.SlimtorchError,
        match=r"skip pattern 'rnn\.weight_ih_10' matches no module .*rnn\.weight_ih_l0",
    ):
        slimtorch.quantize(Recurrent(), "int8-dynamic", skip=["rnn.weight_ih_10"])
    args = [
        "quantize",
        "tests.zoo.models:MLP",
        "-o",
        str(tmp_path / "x.safetensors"),
        "--input-shape",
        "2,64",
    ]
    assert main([*args, "--skip", "layer.0", "--runs", "0"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "slimtorch: error: skip pattern 'layer.0' matches no module of the model (closest: layers.0, "
    )


@pytest.mark.slow
def test_the_outlier_layer_stays_float_judged_by_its_outputs_or_by_its_weights() -> None:
    base, held_out = OutlierMLP().eval(), _features(64, seed=3)
    expected = base(held_out)
    calibration = [_features(32, seed=s) for s in (10, 11)]
    for inputs in (calibration, None):
        report = slimtorch.quantize(copy.deepcopy(base), "int8-dynamic", calibration=inputs)
        model = report.model
        assert [layer.name for layer in report.kept_float] == ["layers.0"]
        assert "the median" in report.kept_float[0].reason and "--quantize-all" in report.kept_float[0].reason
        assert type(model.layers[0]) is nn.Linear and len(report.layers) == 5
        assert _cosine(model(held_out), expected) > 0.999
    report = slimtorch.quantize(copy.deepcopy(base), "int8-dynamic", keep_sensitive=False)
    everything = report.model
    assert report.kept_float == [] and _cosine(everything(held_out), expected) < 0.99


@pytest.mark.slow
def test_cli_lists_the_outlier_kept_float_and_quantize_all_quantizes_it(tmp_path, capsys) -> None:
    args = ["quantize", "tests.support.specs:OutlierMLP", "-o", str(tmp_path / "q.safetensors")]
    args += ["--input-shape", "4,16", "--runs", "0", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["name"] for layer in data["kept_float"]] == ["layers.0"]
    assert main([*args[:-1]]) == 0
    assert "kept float: layers.0 (Linear, 4 KiB): its " in capsys.readouterr().out
    assert main([*args, "--quantize-all"]) == 0
    assert json.loads(capsys.readouterr().out)["kept_float"] == []


@pytest.mark.slow
def test_no_deprecation_or_other_warning_from_quantized_lstm_forward_save_and_load(tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's int8 RNN kernel is deprecated: it must not say so here
        for kernel in KERNELS:
            model = slimtorch.quantize(OnlyLSTM(), "int8-dynamic", kernel=kernel).model
            model(torch.randn(5, 2, 32))
            slimtorch.save_model(model, tmp_path / f"{kernel}.safetensors")
            slimtorch.load_model(tmp_path / f"{kernel}.safetensors", OnlyLSTM).model(torch.randn(5, 2, 32))


# -- resemblyzer ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def speaker_encoder():
    if not RESEMBLYZER.is_file():
        pytest.skip("resemblyzer's checkpoint is not installed")
    from tests.wild.inputs import speaker_partials
    from tests.wild.reimplemented import VoiceEncoder

    def build() -> nn.Module:
        model = VoiceEncoder().eval()
        checkpoint = torch.load(RESEMBLYZER, weights_only=True, map_location="cpu")
        model.load_state_dict(checkpoint["model_state"], strict=False)  # as resemblyzer loads it
        return model

    partials = torch.cat([speaker_partials(seed=seed) for seed in range(8)])  # 16 x (160 frames, 40 mels)
    return build, partials


@pytest.mark.slow
def test_resemblyzer_keeps_its_first_lstm_input_matrix_float_and_embeds_within_0_99(speaker_encoder) -> None:
    build, partials = speaker_encoder
    expected = build()(partials)
    for calibration in ([partials[:4]], None):
        report = slimtorch.quantize(build(), "int8-dynamic", calibration=calibration)
        model = report.model
        assert [layer.name for layer in report.kept_float] == ["lstm.weight_ih_l0"]
        assert type(model.lstm) is Int8DynamicRecurrent and len(model.lstm.stages) == 5
        assert F.cosine_similarity(model(partials), expected).min() >= 0.99
    everything = slimtorch.quantize(build(), "int8-dynamic", keep_sensitive=False).model
    assert F.cosine_similarity(everything(partials), expected).min() < 0.9


@pytest.mark.slow
def test_cli_quantizes_an_lstm_model_into_a_file_load_model_reads(tmp_path, capsys) -> None:
    out = tmp_path / "lstm.safetensors"
    args = ["quantize", "tests.support.specs:OnlyLSTM", "-o", str(out), "--input-shape", "20,2,32"]
    assert main([*args, "--runs", "2"]) == 0
    text = capsys.readouterr().out
    assert "Int8DynamicLSTM" in text and "cosine similarity" in text and "kept float" not in text
    loaded = slimtorch.load_model(out, OnlyLSTM).model
    assert type(loaded.lstm) is Int8DynamicRecurrent and len(loaded.lstm.stages) == 4


def test_a_kernel_that_lost_keeps_no_state_after_a_later_batch_size_is_timed() -> None:
    """Timing a new batch size builds every candidate again (the float fallback: a whole float copy of
    the weights); the losers' state must go whichever kernel wins, not only the first time."""
    kernels.CHOICES.clear()
    model = nn.Sequential()
    model.rnn = nn.LSTM(32, 32, num_layers=2, batch_first=True)
    slimtorch.quantize(model, "int8-dynamic")
    layer = model.rnn
    with torch.inference_mode():
        for batch in (1, 16, 3):
            layer(torch.randn(batch, 5, 32))
            assert {kernel for kernel, _ in layer._prepared} <= layer._chosen


def test_a_batch_size_is_chosen_for_once_and_a_kernel_forced_later_takes_effect(monkeypatch) -> None:
    kernels.CHOICES.clear()
    model = nn.Sequential()
    model.rnn = nn.LSTM(16, 16, batch_first=True)
    slimtorch.quantize(model, "int8-dynamic")
    layer = model.rnn
    asked: list[str | None] = []
    real = type(layer).choose
    monkeypatch.setattr(
        type(layer), "choose", lambda self, *a, **k: asked.append(self.kernel) or real(self, *a, **k)
    )
    x = torch.randn(2, 5, 16)
    first = layer(x)[0]
    for _ in range(3):
        assert torch.equal(layer(x)[0], first)  # the kernel remembered: straight to it
    assert asked == [None]
    layer.kernel = "dequantize"  # forced after the first calls: asked again, and the float module runs
    with torch.no_grad():
        expected = layer.float_module().float()(x)[0]
    assert torch.allclose(layer(x)[0], expected, atol=1e-6)
    assert asked == [None, "dequantize"]
    layer(torch.randn(7, 5, 16))  # another batch size bucket: a choice of its own
    assert len(asked) == 3
