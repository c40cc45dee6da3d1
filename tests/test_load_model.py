"""load_model: a model built on the meta device and filled from any checkpoint, without holding it twice.

Each format is written by its real writer at test time. The model that comes back must give the same
outputs as the one that was saved (exactly for lossless files), keep ties, never share memory between
parameters that the model keeps apart, and fail with the tensor's name when the file does not fit.
"""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.loading.construct import build_on_meta, parameters_on_meta
from tests.hostile import data_range
from tests.zoo import MLP, SmallCNN, TinyGPT, trained_checkpoint


class WithNonPersistentBuffer(nn.Module):
    """A buffer no checkpoint holds: only the constructor knows its value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("positions", torch.arange(8.0) * 2, persistent=False)
        with torch.no_grad():
            self.fc.weight.fill_(0.5)  # an initialiser that writes through .data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.positions)


class Twins(nn.Module):
    """Two separate parameters that start equal: a file may store them once, the model keeps two."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(64, 64))
        self.b = nn.Parameter(torch.ones(64, 64))


def _eval(model: nn.Module) -> nn.Module:
    return model.eval()


@pytest.fixture
def cnn() -> SmallCNN:
    model = SmallCNN()
    model(torch.randn(8, 1, 8, 8))  # train-mode pass: running statistics are no longer 0 and 1
    return model.eval()


def test_factory_is_built_with_parameters_on_meta_and_buffers_real() -> None:
    model = build_on_meta(WithNonPersistentBuffer)
    assert model.fc.weight.is_meta and model.fc.bias.is_meta
    assert torch.equal(model.positions, torch.arange(8.0) * 2)
    with parameters_on_meta():
        bn = nn.BatchNorm1d(4)
    assert bn.weight.is_meta and not bn.running_mean.is_meta


def test_a_4_gib_model_builds_on_meta_without_memory_or_initialisation() -> None:
    with parameters_on_meta():
        big = nn.Linear(32768, 32768)  # 4 GiB of float32: a real init would take seconds and the RAM
    assert big.weight.is_meta and big.weight.shape == (32768, 32768)
    assert nn.Module.register_parameter is torch.nn.modules.module.Module.register_parameter


def test_the_patch_is_undone_when_the_factory_raises() -> None:
    original = nn.Module.register_parameter

    def broken() -> nn.Module:
        raise ValueError("bad factory")

    with pytest.raises(ValueError, match="bad factory"):
        build_on_meta(broken)
    assert nn.Module.register_parameter is original
    assert not nn.Linear(2, 2).weight.is_meta


@pytest.mark.parametrize("writer", ["slim", "slim-sharded", "safetensors", "torch-zip"])
def test_model_from_every_format_gives_identical_outputs(cnn, tmp_path, writer) -> None:
    path = tmp_path / "model.safetensors"
    if writer == "slim":
        slimtorch.save(cnn.state_dict(), path)
    elif writer == "slim-sharded":
        path = tmp_path / "sharded"
        slimtorch.save(cnn.state_dict(), path, shard_bytes=4096)
        assert len(list(path.glob("model-*.safetensors"))) > 1
    elif writer == "safetensors":
        safetensors.torch.save_file(cnn.state_dict(), path)
    else:
        path = tmp_path / "model.pt"
        torch.save(cnn.state_dict(), path)
    x = torch.randn(4, 1, 8, 8)
    loaded = _eval(slimtorch.load_model(path, SmallCNN).model)
    assert torch.equal(loaded(x), cnn(x))
    assert loaded.features[1].num_batches_tracked.dtype == torch.int64


def test_raw_tensors_are_the_files_bytes_and_writing_them_never_changes_the_file(tmp_path) -> None:
    mlp = MLP()
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(mlp.state_dict(), path)
    before = path.read_bytes()
    report = slimtorch.load_model(path, MLP)
    model = report.model
    assert report.zero_copy == report.tensor_count == len(mlp.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # copy-on-write: a private page, not the file's
    assert path.read_bytes() == before
    again = slimtorch.load_model(path, MLP).model
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), mlp.parameters(), strict=True))


def test_tensors_stored_as_is_skip_the_general_fetch_and_the_rest_take_it(tmp_path, monkeypatch) -> None:
    from slimtorch.loading import fetching

    fetched: list[str] = []
    general = fetching.fetch

    def fetch(source, name, *args):
        fetched.append(name)
        return general(source, name, *args)

    monkeypatch.setattr(fetching, "fetch", fetch)
    mlp = MLP()
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(mlp.state_dict(), path)
    for verify in ("before-use", False):
        report = slimtorch.load_model(path, MLP, verify=verify)
        assert fetched == [] and report.zero_copy == report.tensor_count == len(mlp.state_dict())
    half = slimtorch.load_model(path, MLP, dtype=torch.float16)  # converted: the general path
    assert len(fetched) == len(mlp.state_dict()) and half.model.layers[0].weight.dtype == torch.float16
    coded = tmp_path / "int8.safetensors"
    slimtorch.save(mlp.state_dict(), coded, quantize="int8-weight")
    source = slimtorch.open(coded)
    int8 = [name for name in source.names() if source.codec(name) != "raw"]
    assert int8 and all(source.as_stored(name) is None for name in int8)
    assert all(torch.equal(source.as_stored(n), mlp.state_dict()[n]) for n in source.names() if n not in int8)


def test_int8_file_loads_decoded_within_its_bound(tmp_path) -> None:
    mlp = MLP((64, 256, 256, 10))
    path = tmp_path / "int8.safetensors"
    slimtorch.save(mlp.state_dict(), path, quantize="int8-weight")
    report = slimtorch.load_model(path, lambda: MLP((64, 256, 256, 10)))
    model = report.model
    assert report.decoded >= 2 and report.by_codec.get("int8", 0) >= 2
    for (name, loaded), original in zip(model.state_dict().items(), mlp.state_dict().values(), strict=True):
        scale = original.abs().amax(dim=-1, keepdim=True) / 127 if original.dim() == 2 else 0
        assert ((loaded - original).abs() <= scale / 2 + 1e-7).all(), name


def test_tied_weights_stay_one_parameter(tmp_path) -> None:
    gpt = TinyGPT().eval()
    path = tmp_path / "gpt.safetensors"
    slimtorch.save(gpt.state_dict(), path, quantize="int8-weight")
    loaded = slimtorch.load_model(path, TinyGPT).model
    assert loaded.head.weight is loaded.embed.weight
    assert len(list(loaded.parameters())) == len(list(gpt.parameters()))


def test_a_tensor_stored_once_for_two_separate_parameters_is_copied_for_the_second(tmp_path) -> None:
    torch.save(Twins().state_dict(), tmp_path / "twins.pt")
    path = tmp_path / "twins.safetensors"
    report = slimtorch.shrink(tmp_path / "twins.pt", path)
    assert report.copies == {"b": "a"}  # equal bytes, stored once in the file
    loaded = slimtorch.load_model(path, Twins).model
    assert loaded.a is not loaded.b
    with torch.no_grad():
        loaded.a.zero_()
    assert torch.equal(loaded.b, torch.ones(64, 64))


def test_non_persistent_buffers_keep_their_constructor_values(tmp_path) -> None:
    model = WithNonPersistentBuffer()
    path = tmp_path / "m.safetensors"
    slimtorch.save(model.state_dict(), path)
    loaded = slimtorch.load_model(path, WithNonPersistentBuffer).model
    x = torch.randn(2, 8)
    assert torch.equal(loaded(x), model(x))


def test_a_built_model_is_filled_in_place_keeping_its_parameter_objects(cnn, tmp_path) -> None:
    path = tmp_path / "cnn.safetensors"
    slimtorch.save(cnn.state_dict(), path)
    target = SmallCNN().eval()
    identities = [id(p) for p in target.parameters()]
    assert slimtorch.load_model(path, target).model is target
    assert [id(p) for p in target.parameters()] == identities
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(target(x), cnn(x))


def test_dtype_converts_floats_and_leaves_integer_buffers(cnn, tmp_path) -> None:
    path = tmp_path / "cnn.safetensors"
    slimtorch.save(cnn.state_dict(), path)
    loaded = slimtorch.load_model(path, SmallCNN, dtype=torch.bfloat16).model
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.features[1].running_mean.dtype == torch.bfloat16
    assert loaded.features[1].num_batches_tracked.dtype == torch.int64


@pytest.mark.slow
def test_training_checkpoint_loads_the_model_under_its_wrapper_prefix(tmp_path) -> None:
    cnn = SmallCNN()
    path = tmp_path / "ckpt.pt"
    torch.save(trained_checkpoint(cnn, torch.randn(4, 1, 8, 8)), path)
    loaded = _eval(slimtorch.load_model(path, SmallCNN).model)
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(loaded(x), cnn.eval()(x))


def test_works_under_no_grad_and_keeps_requires_grad(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with torch.no_grad():
        loaded = slimtorch.load_model(path, MLP).model
    assert all(p.requires_grad and isinstance(p, nn.Parameter) for p in loaded.parameters())
    loaded(torch.randn(2, 64)).sum().backward()
    assert all(p.grad is not None for p in loaded.parameters())


@pytest.mark.slow
def test_hugging_face_folder_loads_into_a_transformers_model(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    build = lambda: transformers.GPT2LMHeadModel(config)  # noqa: E731
    loaded = slimtorch.load_model(tmp_path / "gpt2", build).model.eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    tokens = torch.randint(0, 300, (2, 16))
    assert torch.equal(loaded(tokens).logits, gpt2(tokens).logits)


def test_checksum_mismatch_names_the_tensor(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    start, _ = data_range(path, "layers.2.weight")
    data = bytearray(path.read_bytes())
    data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight'.*checksum mismatch"):
        slimtorch.load_model(path, MLP, verify="eager")
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight'.*checksum mismatch"):
        slimtorch.load_model(path, MLP).wait()  # the default verifies beside the caller


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.0\.weight' is \[128, 64\].*\[100, 64\]"):
        slimtorch.load_model(path, lambda: MLP((64, 100, 128, 10)))


def test_missing_and_unexpected_tensors_are_refused_when_strict(tmp_path) -> None:
    state = MLP().state_dict()
    path = tmp_path / "partial.safetensors"
    slimtorch.save({k: v for k, v in state.items() if k != "layers.4.bias"}, path)
    with pytest.raises(slimtorch.FormatError, match=r"lacks 1 tensor \('layers\.4\.bias'\).*meta device"):
        slimtorch.load_model(path, MLP, strict=False)  # a factory's parameter has no other value
    built = MLP()
    kept = built.layers[4].bias.detach().clone()
    slimtorch.load_model(path, built, strict=False)
    assert torch.equal(built.layers[4].bias, kept)
    extra = tmp_path / "extra.safetensors"
    slimtorch.save({**state, "stray": torch.zeros(3)}, extra)
    with pytest.raises(slimtorch.FormatError, match=r"holds 1 tensor \('stray'\)"):
        slimtorch.load_model(extra, MLP)
    assert isinstance(slimtorch.load_model(extra, MLP, strict=False).model, MLP)


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(slimtorch.SlimtorchError, match="no CUDA device"):
        slimtorch.load_model(path, MLP, device="cuda")


def test_factory_that_returns_something_else_is_refused(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(slimtorch.SlimtorchError, match="returned a dict"):
        slimtorch.load_model(path, dict)
    with pytest.raises(slimtorch.SlimtorchError, match="not a str"):
        slimtorch.load_model(path, "MLP")  # type: ignore[arg-type]


def test_profile_accounts_for_every_tensor_and_phase(tmp_path) -> None:
    path = tmp_path / "gpt.safetensors"
    state = TinyGPT().state_dict()
    slimtorch.save(state, path, quantize="int8-weight")
    report = slimtorch.load_model(path, TinyGPT)
    unique = [*TinyGPT().parameters(), *TinyGPT().buffers()]  # the tied weight once
    assert report.tensor_count == len(unique) == len(state) - 1
    assert report.bytes == sum(t.numel() * t.element_size() for t in unique)
    assert report.zero_copy + report.decoded <= report.tensor_count
    assert 0 < report.construct_s < report.wall_s and report.read_s > 0 and report.decode_s > 0
    assert json.loads(json.dumps(report.to_dict()))["schema"] == "slimtorch.load-profile/1"


def test_cli_load_with_a_model_file_prints_the_phases(tmp_path, capsys, monkeypatch) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path, quantize="int8-weight")
    (tmp_path / "models.py").write_text("from tests.zoo import MLP\n\ndef build():\n    return MLP()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(os.getcwd())
    assert main(["load", str(path), "--model", "models:build", "--profile"]) == 0
    out = capsys.readouterr().out
    for phase in ("open", "construct", "read", "decode", "copy", "assign", "wall"):
        assert phase in out
    assert "decoded" in out
    assert main(["load", str(path), "--model", str(tmp_path / "models.py") + ":build", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 6


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nocolon", "expected package.module:factory"),
        ("no_such_pkg_x:f", "cannot import"),
        ("torch.nn:NoSuch", "no attribute"),
        ("./missing.py:f", "no such file"),
    ],
)
def test_cli_bad_model_spec_is_one_line_and_exit_2(tmp_path, capsys, spec, words) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    assert main(["load", str(path), "--model", spec]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_cli_corrupt_file_is_one_line_naming_the_tensor(tmp_path, capsys) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    start, _ = data_range(path, "layers.0.weight")
    data = bytearray(path.read_bytes())
    data[start] ^= 1
    path.write_bytes(bytes(data))
    assert main(["load", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "'layers.0.weight'" in err and "checksum" in err and len(err.splitlines()) == 1


def test_a_weight_stored_transposed_gets_the_models_layout_and_bit_identical_outputs(tmp_path) -> None:
    # facenet's legacy files store Linear weights as .t() views: kept as they are, matmul would take
    # another kernel and round differently from load_state_dict (which copies into the model's layout).
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(576, 128), nn.PReLU(128), nn.Linear(128, 16))

    torch.manual_seed(0)
    source = build()
    state = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in source.state_dict().items()}
    path = tmp_path / "transposed.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    report = slimtorch.load_model(path, build)
    model = report.model
    assert all(p.is_contiguous() for p in model.parameters())
    assert report.zero_copy == 3  # the contiguous biases and PReLU weight are still the file's bytes
    x = torch.randn(64, 576)
    source.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(model(x), source(x))
