"""`slimtorch prune` and `slimtorch quantize` show where they are on a terminal, and nothing anywhere else.

The commands run in a pseudo-terminal, as a user's shell runs them, on a model whose forward pass takes
0.4 s: long enough for the counted bars' one-second delay, short enough for a test.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slimtorch.cli.main import main
from slimtorch.format.progress import Recorder
from slimtorch.quant import quantize
from tests.zoo.models import MLP

ROOT = Path(__file__).resolve().parents[1]
SLOW_MODEL = """
    import time

    import torch
    from torch import nn


    class SlowMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.4)
            return self.down(torch.relu(self.up(x)))
"""
PRUNE_STAGES = (
    "loading the model",
    "counting parameters and MACs",
    "capturing the graph",
    "removing channels",
    "checking the pruned model runs",
    "saving",
)
QUANTIZE_STAGES = (
    "loading the model",
    "running the float model",
    "measuring each layer's error",
    "comparing with the float model",
    "saving",
)


@pytest.fixture
def slow_model(tmp_path: Path) -> str:
    """A ``file.py:Factory`` spec of a small model that is slow to run."""
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent(SLOW_MODEL))
    return f"{path}:SlowMLP"


def _in_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run ``slimtorch ARGS`` with stdin, stdout and stderr on a pseudo-terminal; its exit code and all it
    drew there."""
    leader, follower = pty.openpty()
    unset = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PYTEST_CURRENT_TEST")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(TERM="xterm-256color", COLUMNS="120", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "slimtorch.cli.main", *args]
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    screen = bytearray()
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the command closed the terminal's last end
            break
        if not chunk:
            break
        screen += chunk
    os.close(leader)
    return process.wait(timeout=120), screen.decode(errors="replace")


@pytest.mark.slow
def test_prune_on_a_terminal_names_each_stage_while_it_runs(slow_model: str, tmp_path: Path) -> None:
    out = tmp_path / "pruned.safetensors"
    code, screen = _in_a_terminal(
        ["prune", slow_model, "--input-shape", "4,64", "-o", str(out), "--ratio", "0.5", "--runs", "0"]
    )
    assert code == 0 and out.exists(), screen
    for stage in PRUNE_STAGES:
        assert stage in screen, f"{stage!r} never shown:\n{screen}"


@pytest.mark.slow
def test_quantize_on_a_terminal_draws_a_bar_for_each_pass_over_the_samples(
    slow_model: str, tmp_path: Path
) -> None:
    out = tmp_path / "quantized.safetensors"
    code, screen = _in_a_terminal(
        ["quantize", slow_model, "--input-shape", "4,64", "-o", str(out), "--samples", "4", "--runs", "0"]
    )
    assert code == 0 and out.exists(), screen
    for stage in QUANTIZE_STAGES:
        assert stage in screen, f"{stage!r} never shown:\n{screen}"
    assert "━" in screen and "4/4" in screen  # a bar, counted in samples


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["prune", "--ratio", "0.5", "-o", "pruned.safetensors"],
        ["quantize", "--samples", "4", "-o", "quantized.safetensors"],
    ],
)
def test_off_a_terminal_the_commands_draw_nothing(
    args: list[str], slow_model: str, tmp_path: Path, capsys
) -> None:
    command, *rest = args
    rest[-1] = str(tmp_path / rest[-1])
    assert main([command, slow_model, "--input-shape", "4,64", "--runs", "0", *rest]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "wrote" in captured.out
    assert not any(stage in captured.out for stage in PRUNE_STAGES + QUANTIZE_STAGES)


@pytest.mark.slow
def test_quantize_with_samples_tells_progress_of_every_pass_over_them() -> None:
    recorder = Recorder()
    samples = [torch.randn(2, 64) for _ in range(3)]
    quantize(MLP(), "int8-dynamic", calibration=samples, progress=recorder)
    assert recorder.labels == [
        "running the float model",
        "quantizing",
        "measuring each layer's error",
        "comparing with the float model",
    ]
    counted = [e for e in recorder.events if e[0] == "begin" and e[3] == "items"]
    assert [e[2] for e in counted] == [3, 3, 3]
