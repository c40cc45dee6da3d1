"""Text bundles: a model folder with a tokenizer exports to a bundle that takes the tokenizer's real output
(any batch, any length up to the model's, with the attention mask) and raw text, through predict.py in a
venv without torch, and agrees with eager PyTorch (transformers; sentence-transformers for a
sentence-transformers folder) within 1e-4 at 3, 11 and 200 tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from slimtorch.cli.main import main
from slimtorch.deploy import export, measure_footprint
from slimtorch.deploy.runner import Bundle, BundleError
from slimtorch.errors import SlimtorchError

pytestmark = pytest.mark.slow  # the bundles are exported once for the module (tokenizers, onnxruntime)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "bundle", "runs", "text", "pads", "batch", "mask", "hello", "world", "station"]
PIECES = list("abcdefghijklmnopqrstuvwxyz.,?!")
VOCAB = {t: i for i, t in enumerate(SPECIAL + WORDS + PIECES + ["##" + p for p in PIECES])}
MAX_LENGTH = 256


def sentence(tokens: int) -> str:
    """A text the tiny tokenizer makes exactly ``tokens`` ids of ([CLS] and [SEP] included)."""
    return " ".join((["hello", "world", "station"] * tokens)[: tokens - 2])


def tiny_folder(folder: Path, *, sentence_transformers: bool = False) -> Path:
    """A Hugging Face BERT folder from a config (random weights), with a WordPiece tokenizer.json made by
    the tokenizers package; with ``sentence_transformers``, modules.json, mean pooling and Normalize."""
    import transformers

    transformers.logging.set_verbosity_error()
    folder.mkdir(parents=True)
    tokenizer = Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "BertTokenizer", "model_max_length": 512, "pad_token": "[PAD]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": "[PAD]", "unk_token": "[UNK]"}))
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=len(VOCAB),
        max_position_embeddings=MAX_LENGTH,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    if sentence_transformers:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_LENGTH}))
        (folder / "1_Pooling").mkdir()
        pooling = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_folder(tmp_path_factory.mktemp("text") / "bert")


@pytest.fixture(scope="module")
def bert_bundle(bert_folder: Path) -> Path:
    """The CLI's export of the BERT folder: a text bundle, as `slimtorch export ./folder -o DIR` makes it."""
    out = bert_folder.parent / "bert-bundle"
    assert main(["export", str(bert_folder), "-o", str(out), "--json"]) == 0
    return out


@pytest.fixture(scope="module")
def sentence_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tiny_folder(tmp_path_factory.mktemp("text") / "st", sentence_transformers=True)
    out = folder.parent / "st-bundle"
    assert main(["export", str(folder), "-o", str(out), "--json"]) == 0
    return folder, out


@pytest.fixture(scope="module")
def venv(bert_bundle: Path, tmp_path_factory: pytest.TempPathFactory):
    """One clean venv with a text bundle's requirements.txt alone, for every case here; and its footprint."""
    keep = tmp_path_factory.mktemp("venv") / "venv"
    report = measure_footprint(bert_bundle, baseline=False, keep=keep)
    return keep / "bin" / "python", report


def predict(python: Path, bundle: Path, *args: str) -> dict:
    done = subprocess.run(
        [str(python), "predict.py", *args], cwd=bundle, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


LOADED = """
import json, sys
from importlib import metadata
sys.path.insert(0, ".")
from predict import Bundle
Bundle(".").predict_text(["hello world"])
owners = metadata.packages_distributions()
found = {d for m in list(sys.modules) for d in owners.get(m.split(".")[0], ())}
print(json.dumps(sorted(d.lower().replace("-", "_") for d in found)))
"""


def loaded_distributions(python: Path, bundle: Path) -> set[str]:
    """The distributions whose modules predict.py has loaded after tokenizing and running a text."""
    done = subprocess.run(
        [str(python), "-c", LOADED], cwd=bundle, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def alone(folder: Path, text: str) -> dict[str, torch.Tensor]:
    """The tokenizer's own output for one text, unpadded: what eager gets, independent of the runner."""
    encoding = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text)
    return {
        "input_ids": torch.tensor([encoding.ids]),
        "attention_mask": torch.tensor([encoding.attention_mask]),
        "token_type_ids": torch.tensor([encoding.type_ids]),
    }


def test_a_folder_with_a_tokenizer_exports_token_inputs_dynamic_in_batch_and_sequence(bert_bundle) -> None:
    manifest = json.loads((bert_bundle / "manifest.json").read_text())
    assert [(s["name"], s["shape"]) for s in manifest["inputs"]] == [
        ("input_ids", ["batch", "sequence"]),
        ("attention_mask", ["batch", "sequence"]),
        ("token_type_ids", ["batch", "sequence"]),
    ]
    assert manifest["outputs"][0] == {
        "name": "last_hidden_state",
        "dtype": "float32",
        "shape": ["batch", "sequence", 32],
    }
    text = manifest["text"]
    assert (
        text["max_length"] == MAX_LENGTH
        and text["pad_id"] == VOCAB["[PAD]"]
        and text["tokenizer"] == "tokenizer.json"
    )
    assert set(text["files"]) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    assert set(text["files"]) <= set(manifest["files"])  # checksummed like the rest
    assert "tokenizers==" in (bert_bundle / "requirements.txt").read_text()
    assert manifest["verification"]["passed"] and manifest["verification"]["samples"] == 4
    sample = np.load(bert_bundle / "sample_inputs.npz")  # the sample texts, tokenized and padded
    assert (
        sample["attention_mask"][0].sum() < sample["attention_mask"][1].sum() == sample["input_ids"].shape[1]
    )


def test_predict_text_in_a_venv_without_torch_matches_eager_at_3_11_and_200_tokens(
    bert_folder, bert_bundle, venv
) -> None:
    import transformers

    python, report = venv
    assert report.sample_ok, report.sample_error
    assert report.sample_output["tokenizer"] == "same token ids as at export"
    names = {p.name.lower() for p in report.packages}
    assert {"onnxruntime", "numpy", "tokenizers"} <= names and "torch" not in names
    loaded = loaded_distributions(python, bert_bundle)
    assert {"onnxruntime", "numpy", "tokenizers"} <= loaded and "huggingface_hub" not in loaded
    # tokenizers declares huggingface_hub (and its hf-xet, httpx ...) for Tokenizer.from_pretrained, which
    # the runner never calls: the requirements pin the whole runtime without it, installed with --no-deps
    assert "huggingface_hub" not in names and "hf_xet" not in names and "hf-xet" not in names
    assert report.runtime_bytes <= 150 * 2**20
    texts = [sentence(n) for n in (3, 11, 200)]
    got = predict(python, bert_bundle, *(arg for t in texts for arg in ("--text", t)))
    model = transformers.BertModel.from_pretrained(bert_folder).eval()
    for row, (text, tokens) in enumerate(zip(texts, (3, 11, 200), strict=True)):
        inputs = alone(bert_folder, text)
        assert inputs["input_ids"].shape[1] == tokens
        with torch.no_grad():
            want = model(**inputs)
        hidden = np.asarray(got["last_hidden_state"][row])[:tokens]  # the rest is padding
        np.testing.assert_allclose(hidden, want.last_hidden_state[0].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(
            got["pooler_output"][row], want.pooler_output[0].numpy(), atol=1e-4, rtol=0
        )
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in no_torch.stderr


def test_a_sentence_transformers_folder_gives_its_normalised_embeddings_from_text(
    sentence_bundle, bert_bundle, venv, tmp_path
) -> None:
    from sentence_transformers import SentenceTransformer

    folder, bundle = sentence_bundle
    python, _ = venv  # the same requirements as the BERT bundle's
    assert (bundle / "requirements.txt").read_text() == (bert_bundle / "requirements.txt").read_text()
    texts = [sentence(3), sentence(11), sentence(200), sentence(300)]  # the last truncated at 256
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    got = np.asarray(
        predict(python, bundle, "--text-file", str(tmp_path / "texts.json"))["sentence_embedding"]
    )
    want = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert got.shape == (4, 32)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert Bundle(bundle).encode(texts)["input_ids"].shape == (4, MAX_LENGTH)


def test_the_export_check_runs_at_several_lengths_and_batches(bert_folder, tmp_path) -> None:
    import transformers

    model = transformers.BertModel.from_pretrained(bert_folder).eval()
    ids = torch.randint(len(SPECIAL), len(VOCAB), (1, 7))
    report = export(model, {"input_ids": ids}, tmp_path / "b", tokenizer=bert_folder, samples=4)
    assert report.passed and report.samples == 5  # texts, the example, then 3 x 5, 1 x 256, 2 x random
    assert [i.name for i in report.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert any("text bundle" in note for note in report.notes)
    with pytest.raises(BundleError, match="257 tokens, more than the 256 the model takes"):
        Bundle(tmp_path / "b").predict({spec.name: np.ones((1, 257), np.int64) for spec in report.inputs})


def test_without_a_tokenizer_or_with_inputs_a_tokenizer_cannot_make_export_refuses(
    bert_folder, tmp_path
) -> None:
    import transformers

    model = transformers.BertModel.from_pretrained(bert_folder).eval()
    ids = torch.randint(len(SPECIAL), len(VOCAB), (2, 8))
    with pytest.raises(SlimtorchError, match=r"no tokenizer\.json, which a text bundle carries"):
        export(model, {"input_ids": ids}, tmp_path / "b", tokenizer=tmp_path)
    with pytest.raises(SlimtorchError, match="gives 'position_ids'"):
        export(model, {"input_ids": ids, "position_ids": ids}, tmp_path / "b", tokenizer=bert_folder)
    with pytest.raises(SlimtorchError, match="more than the 256 the model takes"):
        export(
            model, {"input_ids": torch.ones(1, 300, dtype=torch.long)}, tmp_path / "b", tokenizer=bert_folder
        )
    assert not (tmp_path / "b").exists()


def test_a_bundle_without_a_tokenizer_refuses_text_in_one_line(tmp_path) -> None:
    export(torch.nn.Linear(4, 2), torch.randn(1, 4), tmp_path / "b")
    done = subprocess.run(
        [sys.executable, "predict.py", "--text", "hello"], cwd=tmp_path / "b", capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip().endswith(
        "this bundle has no tokenizer; give token ids (.npz, .json)"
    )


def test_a_manifest_asks_pip_for_no_deps_and_nothing_else(bert_bundle, tmp_path) -> None:
    """A text bundle's requirements are its whole runtime, pinned (``--no-deps``); a manifest asking pip for
    anything else (another index, say) is refused before pip runs."""
    import shutil

    from slimtorch.deploy.bundle import verify_bundle
    from slimtorch.errors import FormatError

    assert verify_bundle(bert_bundle)["pip_options"] == ["--no-deps"]
    pinned = (bert_bundle / "requirements.txt").read_text().splitlines()
    assert {"onnxruntime", "numpy", "tokenizers", "protobuf"} <= {
        line.split("==")[0] for line in pinned if "==" in line
    }
    assert not any(line.startswith("huggingface") for line in pinned)
    hostile = tmp_path / "hostile"
    shutil.copytree(bert_bundle, hostile)
    manifest = json.loads((hostile / "manifest.json").read_text())
    manifest["pip_options"] = ["--index-url", "http://example.invalid"]
    (hostile / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="pip is given no other option"):
        verify_bundle(hostile)


def test_many_texts_run_in_batches_of_similar_length_and_come_back_in_their_order(
    bert_bundle, monkeypatch
) -> None:
    """Texts past one batch's budget run in several (and tokenized a block at a time): each row is what the
    text gives alone, token-level rows zero past the text's own length, in the order given."""
    from slimtorch.deploy import runner

    bundle = Bundle(bert_bundle)
    lengths = (3, 200, 5, 11, 3, 250, 7, 200)
    texts = [sentence(n) for n in lengths]
    whole = bundle.predict(bundle.encode(texts))  # one batch padded to 250: the reference
    monkeypatch.setattr(runner, "TEXT_BATCH_TOKENS", 420)  # two texts of 200 tokens at most
    monkeypatch.setattr(runner, "TEXT_BLOCK", 3)
    batches: list[int] = []
    run = Bundle.predict
    monkeypatch.setattr(
        Bundle, "predict", lambda self, a: batches.append(a["input_ids"].size) or run(self, a)
    )
    got = bundle.predict_text(texts)
    assert len(batches) >= 5 and max(batches) <= 420
    assert got["last_hidden_state"].shape == (8, 250, 32) and got["pooler_output"].shape == (8, 32)
    np.testing.assert_allclose(got["pooler_output"], whole["pooler_output"], atol=1e-5, rtol=0)
    for row, tokens in enumerate(lengths):
        hidden = got["last_hidden_state"][row]
        np.testing.assert_allclose(
            hidden[:tokens], whole["last_hidden_state"][row][:tokens], atol=1e-5, rtol=0
        )
        assert not hidden[tokens:].any()  # the padding, zeros whichever batch the text ran in


def test_text_batches_group_by_length_within_the_budget_and_never_pad_an_unmasked_model(monkeypatch) -> None:
    from slimtorch.deploy import runner

    monkeypatch.setattr(runner, "TEXT_BATCH_TOKENS", 100)
    assert runner.text_batches(np.array([5, 9, 7]), masked=True) == [[0, 1, 2]]  # fits: as given
    assert runner.text_batches(np.array([5, 9, 5]), masked=False) == [[0, 2], [1]]  # lengths never mixed
    lengths = [3] * 40 + [150] + [30] * 4
    batches = runner.text_batches(np.array(lengths), masked=True)
    assert batches == [list(range(33)), list(range(33, 40)), [41, 42, 43], [44], [40]]  # 150 alone
    assert all(len(b) * max(lengths[r] for r in b) <= 100 for b in batches[:-1])


PEAK_AT_EXIT = """
import atexit, runpy, sys
atexit.register(lambda: print(open("/proc/self/status").read(), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path("predict.py", run_name="__main__")
"""
"""Runs ``predict.py ARGS`` and prints its own /proc status at exit (VmHWM: the peak of this process, not of
the parent it was forked from, which ``wait4``'s ``ru_maxrss`` reports when that is larger)."""


def test_a_long_text_among_thousands_of_short_ones_runs_in_bounded_memory(bert_bundle, tmp_path) -> None:
    """Issue 44: 2,000 one-word texts and one of the model's full length used to be padded into one batch
    (2,001 x 256 tokens: its attention scores alone about 1 GB); batched, the run stays near its start, and
    outputs over the JSON budget are refused in one line, pointing at .npz."""
    texts = ["hello"] * 2000 + [sentence(400)]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    out = tmp_path / "out.npz"
    args = ["predict.py", "--text-file", str(tmp_path / "texts.json"), "-o", str(out)]
    done = subprocess.run(
        [sys.executable, "-c", PEAK_AT_EXIT, *args],
        cwd=bert_bundle,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    peak_mib = int(re.search(r"VmHWM:\s+(\d+) kB", done.stderr).group(1)) / 1024
    saved = np.load(out)
    assert saved["last_hidden_state"].shape == (2001, MAX_LENGTH, 32)  # 65 MB of outputs
    assert saved["last_hidden_state"][0, 3:].sum() == 0 and saved["last_hidden_state"][-1, -1].any()
    assert peak_mib < 400, f"peak RSS {peak_mib:.0f} MiB"  # about 160 here; one batch took over 1 GiB
    done = subprocess.run(
        [sys.executable, "predict.py", "--text-file", str(tmp_path / "texts.json")],
        cwd=bert_bundle,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "write them with -o out.npz" in done.stderr
