"""slimtorch shrink: only what carries information, in a file a fresh model loads back.

A training checkpoint loses its optimizer state, pruning masks and wrapper prefix and keeps its ties; a
pruned model shrinks to about its non-zeros; ``--scheme`` touches weights and embeddings only; a Hugging
Face folder stays a folder its model loads back from.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import prune

import slimtorch
from slimtorch.cli.main import build_parser, main
from tests.zoo import MLP, TinyGPT, trained_checkpoint

PRUNED = [f"blocks.{i}.{layer}.weight" for i in (0, 1) for layer in ("linear1", "linear2")]


def _shrink(capsys, *args: str) -> dict:
    """Run ``slimtorch shrink ... --json`` and return its report."""
    code = main(["shrink", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def _physical(path) -> list[str]:
    with safe_open(path, "pt") as f:
        return list(f.keys())


def _lossless_bytes(tensor: torch.Tensor) -> int:
    """What exact storage takes: dense, or a bitmask plus the non-zeros where that is smaller."""
    dense = tensor.numel() * tensor.element_size()
    sparse = math.ceil(tensor.numel() / 8) + int(tensor.count_nonzero()) * tensor.element_size()
    return min(dense, sparse)


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """A TinyGPT (tied head) with half of its feed-forward weights pruned, trained 2 steps with AdamW."""
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        prune.l1_unstructured(block.linear1, "weight", amount=0.5)
        prune.l1_unstructured(block.linear2, "weight", amount=0.5)
    checkpoint = trained_checkpoint(model, torch.randint(0, 512, (2, 8)))
    path = tmp_path_factory.mktemp("training") / "checkpoint.pt"
    torch.save(checkpoint, path)
    return path, checkpoint, model


# -- training checkpoints ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_checkpoint_keeps_only_the_model_under_its_own_names(training, tmp_path, capsys):
    path, _, model = training
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out))

    loaded = slimtorch.load(out).tensors
    assert set(loaded) == set(TinyGPT().state_dict())  # no optimizer, no masks, no "model." prefix
    assert report["renamed_prefix"] == "model."
    assert any(name.startswith("optimizer.state.") for name in report["dropped"])
    assert sorted(report["folded"]) == sorted(PRUNED)
    fresh = TinyGPT()
    fresh.load_state_dict(loaded)
    tokens = torch.randint(0, 512, (2, 8))
    model.eval()
    fresh.eval()
    assert torch.equal(fresh(tokens), model(tokens))


def test_pruning_masks_are_folded_into_their_weights_exactly(training, tmp_path):
    path, checkpoint, _ = training
    out = tmp_path / "model.safetensors"

    slimtorch.shrink(path, out)

    loaded, state = slimtorch.load(out).tensors, checkpoint["model"]
    for name in PRUNED:
        folded = state[name + "_orig"] * state[name + "_mask"]
        assert torch.equal(loaded[name], folded), name
        assert (loaded[name] == 0).float().mean() >= 0.5
    assert not any(key.endswith(("_orig", "_mask")) for key in _physical(out))


def test_tied_weights_are_stored_once_and_tied_on_load(training, tmp_path):
    path, checkpoint, _ = training
    out = tmp_path / "model.safetensors"

    report = slimtorch.shrink(path, out)

    assert report.ties == {"head.weight": "embed.weight"}
    assert not any(key.startswith("head.weight") for key in _physical(out))
    loaded = slimtorch.load(out).tensors
    assert loaded["head.weight"] is loaded["embed.weight"]
    assert torch.equal(loaded["embed.weight"], checkpoint["model"]["embed.weight"])


def test_output_is_the_model_weights_plus_a_small_header(training, tmp_path, capsys):
    path, checkpoint, _ = training
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out))

    state = checkpoint["model"]
    weights = {
        name[: -len("_orig")]: state[name] * state[name[:-5] + "_mask"] for name in state if "_orig" in name
    }
    weights |= {name: t for name, t in state.items() if not name.endswith(("_orig", "_mask"))}
    del weights["head.weight"]  # the tie
    expected = sum(_lossless_bytes(t) for t in weights.values())
    assert report["before_bytes"] == path.stat().st_size
    assert report["after_bytes"] == out.stat().st_size
    assert expected < report["after_bytes"] < expected * 1.05  # the rest is the JSON header
    # Adam keeps two moments per parameter and pruning a mask per pruned weight: a third of the file at most.
    assert report["ratio"] == pytest.approx(report["after_bytes"] / report["before_bytes"])
    assert report["ratio"] < 0.3


def test_keep_optimizer_keeps_training_state_and_the_names(training, tmp_path, capsys):
    path, checkpoint, _ = training
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out), "--keep-optimizer")

    loaded = slimtorch.load(out).tensors
    assert report["dropped"] == [] and report["renamed_prefix"] is None
    for index, state in checkpoint["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded[f"optimizer.state.{index}.{key}"], value)
    assert torch.equal(loaded["model.norm.weight"], checkpoint["model"]["norm.weight"])
    assert "model.blocks.0.linear1.weight" in loaded  # masks are folded all the same


def test_keep_names_keeps_the_wrapper_prefix(training, tmp_path, capsys):
    path, _, _ = training
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out), "--keep-names")

    loaded = slimtorch.load(out).tensors
    assert report["renamed_prefix"] is None
    assert all(name.startswith("model.") for name in loaded)
    assert not any(name.startswith("optimizer.") for name in loaded)
    assert loaded["model.head.weight"] is loaded["model.embed.weight"]


def test_equal_tensors_are_stored_once_and_load_as_separate_tensors_even_after_a_second_shrink(tmp_path):
    bias = torch.randn(64, 64)
    weight = torch.randn(64, 64)
    state = {"encoder.bias": bias, "decoder.bias": bias.clone(), "fc.weight": weight, "head.weight": weight}
    path = tmp_path / "model.pt"
    torch.save(state, path)
    once, twice = tmp_path / "once.safetensors", tmp_path / "twice.safetensors"

    first = slimtorch.shrink(path, once)
    second = slimtorch.shrink(once, twice)  # a slim checkpoint shrinks again without losing its meaning

    for report, out in ((first, once), (second, twice)):
        assert report.copies == {"decoder.bias": "encoder.bias"}
        assert report.ties == {"head.weight": "fc.weight"}
        assert sorted(_physical(out)) == ["encoder.bias", "fc.weight"]
        loaded = slimtorch.load(out).tensors
        assert loaded["decoder.bias"] is not loaded["encoder.bias"]
        assert torch.equal(loaded["decoder.bias"], bias) and torch.equal(loaded["encoder.bias"], bias)
        assert loaded["head.weight"] is loaded["fc.weight"]


def test_plain_non_tensor_values_are_kept_and_training_state_values_dropped(training, tmp_path):
    path, _, _ = training
    out = tmp_path / "model.safetensors"

    report = slimtorch.shrink(path, out)

    assert report.objects == ["epoch"]  # not the optimizer's hyperparameters nor the scheduler's state
    assert slimtorch.load_objects(out) == {"epoch": 3}
    with safe_open(out, "pt") as f:
        assert set(f.metadata()) == {
            "slimtorch",
            "slimtorch.crc",
            "format",
        }  # kept inside slimtorch's own metadata


def test_no_objects_drops_every_non_tensor_value(training, tmp_path, capsys):
    path, _, _ = training
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out), "--no-objects")

    assert report["objects"] == [] and slimtorch.load_objects(out) == {}
    assert slimtorch.open(out).objects == []


# -- pruned models ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pruned_90(tmp_path_factory):
    """Three 1024x1024 Linear layers, 90% globally pruned: checkpoints with masks and finalized, the
    finalized state dict, and its size as a dense fp32 safetensors file.

    1024 wide, so that per-row int8 scales and the biases stay well under a percent of the weights (at
    512 they add 0.4% of the dense size and int8 lands at 0.061).
    """
    torch.manual_seed(0)
    model = MLP((1024, 1024, 1024, 1024))
    weights = [(m, "weight") for m in model.modules() if isinstance(m, nn.Linear)]
    prune.global_unstructured(weights, pruning_method=prune.L1Unstructured, amount=0.9)
    folder = tmp_path_factory.mktemp("pruned")
    masked = folder / "masked.pt"
    torch.save(model.state_dict(), masked)
    for module, name in weights:
        prune.remove(module, name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    finalized, dense = folder / "finalized.pt", folder / "dense.safetensors"
    torch.save(state, finalized)
    save_file(state, dense)
    return {"masked": masked, "finalized": finalized}, state, dense.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("form", ["masked", "finalized"])
@pytest.mark.parametrize(("quantize", "share"), [(None, 0.14), ("int8-weight", 0.06)])
def test_90pct_pruned_model_shrinks_to_a_small_share_of_its_dense_size(
    pruned_90, tmp_path, form, quantize, share
):
    paths, state, dense = pruned_90
    out = tmp_path / "model.safetensors"

    report = slimtorch.shrink(paths[form], out, options=slimtorch.ShrinkOptions(quantize=quantize))

    assert out.stat().st_size == report.after_bytes <= share * dense
    loaded = slimtorch.load(out).tensors
    if quantize is None:
        assert all(torch.equal(loaded[name], state[name]) for name in state)
    else:
        assert all(torch.equal(loaded[name] == 0, state[name] == 0) for name in state if "weight" in name)


# -- quantization policy ------------------------------------------------------------------------------------
class Tagger(nn.Module):
    """An embedding, a norm, a big Linear, a small Linear (< 4096 weights) and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.norm = nn.LayerNorm(64)
        self.fc = nn.Linear(64, 128)
        self.small = nn.Linear(128, 16)
        self.register_buffer("steps", torch.tensor(7))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))  # no zeros anywhere: every exact tensor is stored "raw"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.small(self.fc(self.norm(self.embed(ids))))


QUANTIZED = {"embed.weight", "fc.weight"}


@pytest.fixture
def tagger(tmp_path):
    torch.manual_seed(0)
    model = Tagger()
    path = tmp_path / "tagger.pt"
    torch.save(model.state_dict(), path)
    return path, model.state_dict()


def _codecs(path) -> dict[str, str]:
    return {info.name: info.codec for info in slimtorch.open(path).infos()}


def _exact(loaded, state, names) -> None:
    for name in names:
        assert loaded[name].dtype == state[name].dtype and torch.equal(loaded[name], state[name]), name


def test_int8_quantizes_weights_and_embeddings_and_keeps_the_rest_exact(tagger, tmp_path, capsys):
    path, state = tagger
    out = tmp_path / "model.safetensors"

    _shrink(capsys, str(path), "-o", str(out), "--scheme", "int8-weight")

    codecs = _codecs(out)
    assert {name for name, codec in codecs.items() if codec == "int8"} == QUANTIZED
    assert all(codecs[name] == "raw" for name in state if name not in QUANTIZED)
    _exact(slimtorch.load(out).tensors, state, set(state) - QUANTIZED)  # norms, biases, small.weight, steps


def test_keep_embeddings_leaves_embeddings_unquantized(tagger, tmp_path, capsys):
    path, state = tagger
    out = tmp_path / "model.safetensors"

    _shrink(capsys, str(path), "-o", str(out), "--scheme", "int8-weight", "--keep-embeddings")

    codecs = _codecs(out)
    assert codecs["embed.weight"] == "raw" and codecs["fc.weight"] == "int8"
    _exact(slimtorch.load(out).tensors, state, ["embed.weight"])


def test_skip_pattern_keeps_matching_tensors_exact(tagger, tmp_path, capsys):
    path, state = tagger
    out = tmp_path / "model.safetensors"

    _shrink(capsys, str(path), "-o", str(out), "--scheme", "int8-weight", "--dtype", "fp16", "--skip", "fc*")

    loaded = slimtorch.load(out).tensors
    _exact(loaded, state, ["fc.weight", "fc.bias"])
    assert _codecs(out)["embed.weight"] == "int8"
    assert loaded["embed.weight"].dtype == torch.float16


def test_dtype_fp16_loads_back_as_float16(tagger, tmp_path, capsys):
    path, state = tagger
    out = tmp_path / "model.safetensors"

    _shrink(capsys, str(path), "-o", str(out), "--dtype", "fp16")

    loaded = slimtorch.load(out).tensors
    for name, tensor in state.items():
        if tensor.dtype.is_floating_point:
            assert loaded[name].dtype == torch.float16, name
            assert torch.equal(loaded[name], tensor.half()), name
        else:
            assert torch.equal(loaded[name], tensor), name
    fresh = Tagger().half()
    fresh.load_state_dict(loaded)


def test_json_report_has_sizes_and_the_error_of_lossy_tensors_only(tagger, tmp_path, capsys):
    path, state = tagger
    out = tmp_path / "model.safetensors"

    report = _shrink(capsys, str(path), "-o", str(out), "--scheme", "int8-weight")

    assert report["schema"] == "slimtorch.shrink/1"
    assert report["before_bytes"] == path.stat().st_size
    assert report["after_bytes"] == out.stat().st_size
    assert report["ratio"] == pytest.approx(report["after_bytes"] / report["before_bytes"])
    assert report["files"] == [str(out)]
    loaded = slimtorch.load(out).tensors
    tensors = {t["name"]: t for t in report["tensors"]}
    assert set(tensors) == set(state)
    for name, entry in tensors.items():
        if name in QUANTIZED:
            error = (loaded[name] - state[name]).abs()
            assert entry["max_abs"] == pytest.approx(float(error.max()))
            assert 0 < entry["rel_l2"] < 0.01
            assert entry["after_bytes"] < 0.3 * entry["before_bytes"]
        else:
            assert entry["max_abs"] is None and entry["rel_l2"] is None, name
            assert entry["after_bytes"] == entry["before_bytes"]


# -- Hugging Face folders -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    folder = tmp_path_factory.mktemp("hf") / "bert"
    model.save_pretrained(folder)
    return transformers, config, model, folder


@pytest.mark.slow
def test_hugging_face_folder_shrinks_to_a_folder_its_model_loads_back_from(bert, tmp_path, capsys):
    transformers, config, model, folder = bert
    out = tmp_path / "bert-slim"

    report = _shrink(capsys, str(folder), "-o", str(out))

    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    assert (out / "model.safetensors").is_file()
    assert str(out / "config.json") in report["files"]
    loaded = slimtorch.load(out).tensors
    assert set(loaded) == set(model.state_dict())
    fresh = transformers.BertModel(config).eval()
    fresh.load_state_dict(loaded)
    ids = torch.randint(0, 120, (2, 10))
    with torch.no_grad():
        assert torch.equal(fresh(ids).last_hidden_state, model(ids).last_hidden_state)


def test_hugging_face_folder_keeps_a_model_prefix_shared_by_every_weight(tmp_path):
    """A tied causal LM saves no lm_head: every key starts with "model.", which is no training wrapper."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    names = slimtorch.open(folder).names()
    assert all(name.startswith("model.") for name in names)

    report = slimtorch.shrink(folder, tmp_path / "slim")

    assert report.renamed_prefix is None
    assert sorted(slimtorch.load(tmp_path / "slim").tensors) == sorted(names)


# -- the command line ---------------------------------------------------------------------------------------
OPTIONS = [
    "--output",
    "--dtype",
    "--scheme",
    "--group-size",
    "--sparse",
    "--entropy",
    "--keep-optimizer",
    "--keep-embeddings",
    "--keep-names",
    "--quantize-all",
    "--no-objects",
    "--shard-size",
    "--skip",
    "--top",
    "--json",
    "--layout",
    "--allow-global",
    "--debug",
]


def test_help_mentions_every_option(capsys):
    parser = build_parser()
    shrink = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["shrink"]
    declared = {s for action in shrink._actions for s in action.option_strings if s.startswith("--")}
    assert declared == {*OPTIONS, "--help"}

    with pytest.raises(SystemExit) as done:
        main(["shrink", "--help"])

    assert done.value.code == 0
    text = capsys.readouterr().out
    for option in OPTIONS:
        assert option in text, option


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--group-size", "7"], "group size"),
        (["--group-size", "300"], "group size"),
        (["--group-size", "many"], "--group-size"),
        (["--dtype", "fp8"], "invalid choice"),
        (["--scheme", "int3"], "invalid choice"),
        (["--sparse", "maybe"], "invalid choice"),
        (["--shard-size", "lots"], "--shard-size"),
    ],
)
def test_bad_arguments_are_usage_errors_not_tracebacks(training, tmp_path, capsys, args, words):
    path, _, _ = training
    out = tmp_path / "model.safetensors"

    with pytest.raises(SystemExit) as usage:
        main(["shrink", str(path), "-o", str(out), *args])

    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not out.exists()


def test_missing_output_is_a_usage_error(training, capsys):
    path, _, _ = training

    with pytest.raises(SystemExit) as usage:
        main(["shrink", str(path)])

    assert usage.value.code == 2
    assert "--output" in capsys.readouterr().err


def test_a_file_the_header_outweighs_says_so_instead_of_growing_silently(tmp_path) -> None:
    # lpips' 6 KB state dict: five 1x1 convolutions of 64 to 384 weights; the slim header (a checksum and
    # a record per tensor, the provenance) makes it larger, and nothing in it is large enough to quantize
    path = tmp_path / "tiny.pth"
    tensors = {
        f"lin{i}.model.1.weight": torch.randn(1, c, 1, 1) for i, c in enumerate((64, 192, 384, 256, 256))
    }
    torch.save(tensors, path, _use_new_zipfile_serialization=False)  # as lpips saved it: legacy, no zip
    report = slimtorch.shrink(path, tmp_path / "tiny.safetensors", quantize="int8-weight")
    assert report.after_bytes > report.before_bytes
    note = next(n for n in report.notes if n.startswith("the output is"))
    assert "more than the source's" in note and "no tensor has the 4,096 elements" in note

    big = tmp_path / "big.pth"
    torch.save({"w": torch.randn(256, 256)}, big)
    report = slimtorch.shrink(big, tmp_path / "big.safetensors", quantize="int8-weight")
    assert report.after_bytes < report.before_bytes and not any(
        n.startswith("the output is") for n in report.notes
    )
