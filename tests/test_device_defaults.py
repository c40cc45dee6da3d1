"""Device defaults come from the machine: ``device=None`` is CUDA when torch sees it, else the CPU, so the
docs' memory examples run as written on a CPU machine, and naming CUDA where there is none is one
clear error, never torch's bare AssertionError."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from slimtorch import memory
from slimtorch.cli.main import main
from slimtorch.errors import SlimtorchError
from slimtorch.memory import default_device
from tests.support import doc_blocks
from tests.support.models import Blocks


def _train_step(model: nn.Module, inputs: torch.Tensor) -> None:
    optimizer = torch.optim.AdamW(model.parameters())
    model(inputs).float().sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


@pytest.fixture
def no_cuda(monkeypatch) -> None:
    """This machine as a CPU-only one, whatever it really has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_default_device_is_cuda_only_where_torch_sees_it(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


def test_every_memory_function_defaults_to_the_machines_device() -> None:
    for options in (memory.StepOptions(), memory.BatchSizeOptions(), memory.FitOptions()):
        assert options.device is None, type(options).__name__
    assert inspect.signature(memory.measure_peak).parameters["device"].default is None
    assert memory.estimate(Blocks(), torch.randn(2, 256)).device == default_device()


def test_the_docs_fit_examples_leave_the_device_to_the_machine() -> None:
    # they run as written in tests/test_doc_blocks.py, on the machine's device: CUDA where torch sees it,
    # else the CPU, so a CPU-only reader can run them too
    blocks = doc_blocks.blocks(doc_blocks.DOCS / "how-to" / "fit.md")
    code = [block.code for block in blocks if block.kind == "run" and block.language == "python"]
    assert any("find_batch_size(" in c for c in code) and any("memory.fit(" in c for c in code)
    assert not [c for c in code if "device" in c]


@pytest.mark.slow
def test_fit_keeps_bf16_on_the_cpu_and_says_so(no_cuda) -> None:
    model, x = Blocks(), torch.randn(4096, 256)
    every = memory.estimate(model, x, checkpointing="blocks").steps[0].peak_bytes
    plan = memory.fit(model, x, budget=int(every * 0.97))  # checkpointing alone does not fit
    assert plan.device == "cpu" and plan.precision == "bf16-mixed"
    assert any("bf16 autocast on the CPU" in note for note in plan.notes)
    assert model(x[:4]).dtype == torch.bfloat16  # applied, not dropped: CPU autocast runs the Linears in bf16
    plan.remove()
    assert model(x[:4]).dtype == torch.float32


def test_naming_cuda_where_there_is_none_is_one_clear_error(no_cuda) -> None:
    model, x = Blocks(), torch.randn(8, 256)
    report = memory.estimate(model, x, batch_sizes=[8, 16], device="cuda")  # planning for a GPU works
    assert report.device == "cuda" and report.steps[0].peak_bytes % 512 == 0
    calls = {
        "find_batch_size": lambda: memory.find_batch_size(lambda n: None, report, budget=2**30),
        "profile": lambda: memory.profile(model, x, device="cuda"),
        "fit": lambda: memory.fit(model, x, budget=2**30, device="cuda"),
        "measure_peak": lambda: memory.measure_peak(lambda: None, "cuda"),
    }
    for name, call in calls.items():
        with pytest.raises(SlimtorchError, match="no CUDA device: use device='cpu'") as raised:
            call()
        assert name in str(raised.value) and "\n" not in str(raised.value)


def test_the_memory_cli_estimates_for_the_machines_device(no_cuda, capsys) -> None:
    assert main(["memory", "tests.support.models:Blocks", "--input-shape", "8,256"]) == 0
    assert "on cpu" in capsys.readouterr().out
