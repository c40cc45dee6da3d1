"""`slimtorch dataloader` on a wild text dataset (:mod:`tests.wild.datasets`: real sentences through
all-MiniLM-L6-v2's own tokenizer, item by item): the settings it prints are ones a DataLoader takes, every
candidate ran (the Rust tokenizer went to the workers and back), no worker outlives it, and the tuned
loader feeds the real model the batches ``num_workers=0`` feeds it, embedded as the suite's reference
embeds them. Which settings win is a timing, not asserted here (``python -m benchmarks.dataloader`` measures
it)."""

from __future__ import annotations

import json
import multiprocessing

import torch
from torch.utils.data import DataLoader

from slimtorch.cli.main import main
from tests.wild.classes import bert_original, sentence_embeddings
from tests.wild.datasets import minilm_sentences
from tests.wild.inputs import SENTENCES
from tests.wild.matrix import reference
from tests.wild.models import BY_NAME


def test_dataloader_cli_tunes_a_tokenizing_text_dataset_and_its_loader_feeds_minilm(capsys) -> None:
    spec = "tests.wild.datasets:minilm_sentences"
    args = ["dataloader", spec, "--batch", "16", "--budget-s", "8", "--max-workers", "2", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["trials"][0]["candidate"]["num_workers"] == 0
    assert [t["error"] for t in report["trials"]] == [None] * len(report["trials"])
    assert {t["candidate"]["num_workers"] for t in report["trials"]} >= {0, 1}  # workers were tried
    assert multiprocessing.active_children() == []
    dataset = minilm_sentences()
    tuned = DataLoader(dataset, **report["settings"])
    plain = DataLoader(dataset, batch_size=16)
    (ids, mask), (plain_ids, plain_mask) = next(iter(tuned)), next(iter(plain))
    assert torch.equal(ids, plain_ids) and torch.equal(mask, plain_mask) and ids.shape == (16, 32)
    del tuned
    with torch.no_grad():
        embeddings = sentence_embeddings(bert_original()(ids, mask), (ids, mask))
    _, expected = reference(BY_NAME["minilm"])  # the sentences padded to the longest, not to 32
    torch.testing.assert_close(embeddings[: len(SENTENCES)], expected, atol=1e-5, rtol=0)
