"""A Hugging Face folder written back keeps every tensor of its file (issue 45).

A folder whose class is not a transformers class (a BERT body with heads of its own) is built by slimtorch
as the body alone; quantizing it used to write the body only, under the body's names, so the output no
longer fit the user's class. Now the output holds the body under the file's names (``bert.``) and the
heads as they were, and loads into either class, in a fresh process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimtorch.cli.main import main

transformers = pytest.importorskip("transformers")

CLASS = """
import torch, transformers
from torch import nn

CONFIG = transformers.BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    architectures=["BertWithHeads"],
)


class BertWithHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.bert = transformers.BertModel(CONFIG)
        self.species = nn.Linear(32, 3)
        self.chain = nn.Linear(32, 5)

    def forward(self, input_ids):
        first = self.bert(input_ids).last_hidden_state[:, 0]
        return torch.cat([self.species(first), self.chain(first)], dim=1)
"""


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "with-heads"
    namespace: dict = {}
    exec(CLASS, namespace)  # the class as the subprocess defines it
    torch.manual_seed(0)
    model = namespace["BertWithHeads"]()
    namespace["CONFIG"].save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


@pytest.mark.slow
def test_quantizing_a_folder_keeps_its_heads_and_loads_into_the_users_class_in_a_fresh_process(
    tmp_path, capsys
) -> None:
    folder, out = _folder(tmp_path), tmp_path / "quantized"
    assert main(["quantize", str(folder), "-o", str(out), "--scheme", "int8-weight", "--runs", "0"]) == 0
    printed = capsys.readouterr()
    assert "4 tensor(s) of the source file that the model does not hold (species.weight" in printed.out

    code = (
        CLASS
        + f"""
import slimtorch
from safetensors import safe_open

names = set(safe_open({str(out / "model.safetensors")!r}, "pt").keys())
assert {{"species.weight", "species.bias", "chain.weight", "chain.bias"}} <= names, sorted(names)
assert all(n.startswith(("bert.", "species.", "chain.")) for n in names), sorted(names)

torch.manual_seed(0)
original = BertWithHeads().eval()
original.load_state_dict(torch.load({str(folder / "pytorch_model.bin")!r}, weights_only=True))
loaded = slimtorch.load_model({str(out)!r}, BertWithHeads).model.eval()
assert type(loaded.bert.encoder.layer[0].output.dense).__name__ == "Int8WeightLinear"
assert torch.equal(loaded.species.weight, original.species.weight)
ids = torch.randint(0, 100, (4, 12))
with torch.no_grad():
    cosine = torch.nn.functional.cosine_similarity(loaded(ids), original(ids)).min()
assert cosine > 0.99, cosine

body = slimtorch.load_model({str(out)!r}, lambda: transformers.BertModel(CONFIG))  # the body alone
heads = ["chain.bias", "chain.weight", "species.bias", "species.weight"]
assert body.prefix == "bert." and sorted(body.outside_prefix) == heads
print("ok", float(cosine))
"""
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
