"""What every stage of a ``slimtorch slim`` run works with: the original model (never changed), a factory
that rebuilds it (to load a stage's file), the task data and its metric, and the work folder."""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.format.progress import Progress
from slimtorch.loading import load_model
from slimtorch.recovery.data import TaskData, evaluate, output_tensor
from slimtorch.slimming.goal import Goal
from slimtorch.slimming.measuring import module_kinds
from slimtorch.slimming.options import SlimOptions
from slimtorch.slimming.workdir import WorkFolder

MODEL_FILE = "model.safetensors"


@dataclass
class Context:
    """One run's fixed inputs; ``models`` caches the model each finished stage left, by stage folder, so a
    stage run in this process hands its model on without a reload."""

    original: nn.Module
    data: TaskData
    options: SlimOptions
    goal: Goal
    work: WorkFolder
    folder: Path | None = None
    """the Hugging Face folder the model came from (its result is saved as such a folder too)"""
    progress: Progress | None = None
    spec: str = ""
    """the model spec the user named (empty: a module passed in)"""
    models: dict[str, nn.Module] = field(default_factory=dict)
    recipe_hash: str = ""
    """the sha256 of the recipe's identity and the model's tensors: what every stage's marker records"""
    seals: dict[str, str] = field(default_factory=dict)
    """each finished (or verified) stage's seal, by stage folder: what the stages made from it record"""
    notes: list[str] = field(default_factory=list)
    """what the run says besides its report, one line each (a stage redone, and why)"""

    def __post_init__(self) -> None:
        self.kinds = module_kinds(self.original)
        self._template: nn.Module | None = None

    def copy(self) -> nn.Module:
        """A copy of the original, weights and all (the original itself is never changed)."""
        return copy.deepcopy(self.original)

    def factory(self) -> nn.Module:
        """The original with its parameters on the meta device (buffers real, as ``load_model``'s own
        builds have them: a non-persistent one is in no file): what ``load_model`` reshapes and fills from
        a stage's file, so a load time is the file's, not a copy's."""
        if self._template is None:
            self._template = meta_parameters(copy.deepcopy(self.original))
        return copy.deepcopy(self._template)

    def score(self, model: nn.Module) -> float:
        """The task metric of ``model``: accuracy, or the cosine of its outputs to the original's."""
        reference = self.original if self.data.metric == "cosine" else None
        return evaluate(model, self.data, reference=reference)

    def model_of(self, stage: str) -> nn.Module:
        """The model stage folder ``stage`` saved: from this run's memory, else loaded from its file."""
        if stage not in self.models:
            model = load_model(self.work.root / stage / MODEL_FILE, self.factory).model
            assert model is not None  # load_model's report holds the model it filled
            self.models[stage] = model
        return self.models[stage]

    def calibration(self, batches: int = 2) -> list[torch.Tensor]:
        """A few training inputs, for the quantizer's sensitivity and GPTQ."""
        found = []
        for inputs, _ in self.data.train:
            found.append(inputs)
            if len(found) == batches:
                break
        return found


def meta_parameters(model: nn.Module) -> nn.Module:
    """``model`` with each parameter replaced by a meta one (tied ones stay tied), in place."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None:
                if id(parameter) not in moved:
                    meta = parameter.detach().to("meta")
                    moved[id(parameter)] = nn.Parameter(meta, requires_grad=parameter.requires_grad)
                module._parameters[name] = moved[id(parameter)]
    return model


class TeacherTargets:
    """The training batches with the original's outputs as targets: what a cosine task distils on, since
    its data has no labels to learn from."""

    def __init__(self, data: TaskData, teacher: nn.Module) -> None:
        self.data, self.teacher = data, teacher

    def __len__(self) -> int:
        return len(self.data.train)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.teacher.eval()
        for inputs, _ in self.data.train:
            with torch.no_grad():
                yield inputs, output_tensor(self.teacher(inputs)).detach()


def cosine_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """1 - cosine of each output vector to the teacher's, averaged: the loss of a cosine task."""
    mine = output_tensor(outputs)
    return (
        1
        - nn.functional.cosine_similarity(
            mine.reshape(-1, mine.shape[-1]), targets.reshape(-1, targets.shape[-1]), dim=-1
        ).mean()
    )


def model_digest(model: nn.Module) -> str:
    """The sha256 of the model's class and tensors (names, dtypes, shapes, bytes): a rerun on other weights
    is another recipe (the recipe records its first 16 digits), and every stage's marker records it whole.

    It hashes what the stages start from, the tensors as loaded, rather than the weights' file: the run
    holds them in memory anyway, a file's size and time say nothing of its bytes, and sha256 at over
    1 GB/s is seconds beside what loading a large model costs."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """``work()``'s result and the seconds it took."""
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started
