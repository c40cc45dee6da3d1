"""``slimtorch.slim`` on the real all-MiniLM-L6-v2 folder: a size goal reached, the sentence embedding's
cosine to the original reported, and the saved deliverable scoring what the report says."""

from __future__ import annotations

import pytest
import torch

import slimtorch
from slimtorch import slimming
from slimtorch.recovery.data import TaskData, evaluate
from tests.wild import classes, inputs


@pytest.mark.slow
def test_minilm_reaches_a_third_of_its_file_with_embedding_cosine_099(workdir) -> None:
    ids, _ = inputs.sentence_batch(classes.MINILM)
    batches = [(ids, torch.zeros(len(ids)))]
    data = TaskData("minilm sentences", batches, batches, "cosine", ids)
    work = workdir / "slim-minilm"
    options = slimming.SlimOptions(goal="size=0.3x", max_drop=0.01, timings=False)
    report = slimming.slim(str(classes.MINILM), data, options, work=work)
    summary = report.to_dict()
    saved = next(s for s in summary["stages"] if s["output"] == summary["outputs"]["model"])
    assert report.met, report.reason
    assert saved["file_bytes"] <= 0.3 * summary["stages"][0]["file_bytes"]
    assert summary["metric"] == "cosine" and saved["metric"] >= 0.99
    original = slimtorch.open_model(str(classes.MINILM), check_example=False).model
    assert evaluate(report.result, data, reference=original) == pytest.approx(saved["metric"], abs=1e-6)
