"""Every public verb has one shape, no twin survives, and every name the README and the docs use resolves.

The shape (see ``slimtorch.format.verbs``): ``verb(subject, [data,] /, options=None, *, ..., **overrides)``
where ``options`` is a frozen dataclass and the return is a :class:`~slimtorch.format.verbs.Report` with its
own schema name. Read from the signatures and annotations, so a verb that drifts fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types
import typing
import warnings
from pathlib import Path

import pytest

import slimtorch
from slimtorch.format.verbs import Report
from tests.support import doc_blocks

VERBS = [
    "slimtorch.inspect",
    "slimtorch.shrink",
    "slimtorch.save",
    "slimtorch.save_model",
    "slimtorch.save_pretrained",
    "slimtorch.load",
    "slimtorch.load_model",
    "slimtorch.prune.channels",
    "slimtorch.prune.weights",
    "slimtorch.prune.scan",
    "slimtorch.quantize",
    "slimtorch.recover",
    "slimtorch.memory.estimate",
    "slimtorch.memory.profile",
    "slimtorch.memory.find_batch_size",
    "slimtorch.memory.fit",
    "slimtorch.data.tune",
    "slimtorch.deploy.export",
    "slimtorch.deploy.footprint",
    "slimtorch.deploy.operators",
]
NOT_NAMES = {"slimtorch.crc"}  # a metadata key of the format, not a Python name


def resolve_name(dotted: str) -> object:
    """What a dotted name names, as Python finds it: attributes first (``slimtorch.deploy.export`` is the
    function the package exports, not its module), a submodule only where no attribute has the name."""
    parts = dotted.split(".")
    value: object = importlib.import_module(parts[0])
    for depth, attr in enumerate(parts[1:], start=2):
        if not hasattr(value, attr):
            importlib.import_module(".".join(parts[:depth]))
        value = getattr(value, attr)
    return value


def _in_union(hint: object) -> list[type]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for t in typing.get_args(hint) if isinstance(t, type)]
    return [hint] if isinstance(hint, type) else []


@pytest.mark.parametrize("dotted", VERBS)
def test_each_verb_takes_options_and_overrides_and_returns_a_report(dotted: str) -> None:
    verb = resolve_name(dotted)
    parameters = inspect.signature(verb).parameters
    options = parameters.get("options")
    assert options is not None and options.default is None, f"{dotted} has no options=None parameter"
    assert options.kind is options.POSITIONAL_OR_KEYWORD, f"{dotted}: options=... must work as a keyword too"
    subjects = list(parameters.values())[: list(parameters).index("options")]
    assert subjects and all(p.kind is p.POSITIONAL_ONLY for p in subjects), (
        f"{dotted}: subject not positional-only"
    )
    assert any(p.kind is p.VAR_KEYWORD for p in parameters.values()), f"{dotted} takes no **overrides"
    hints = typing.get_type_hints(verb)
    kinds = [t for t in _in_union(hints["options"]) if dataclasses.is_dataclass(t)]
    assert len(kinds) == 1, f"{dotted}: options is not one dataclass"
    assert kinds[0].__dataclass_params__.frozen, f"{dotted}: {kinds[0].__name__} is not frozen"  # type: ignore[attr-defined]
    report = hints["return"]
    assert isinstance(report, type) and issubclass(report, Report), f"{dotted} does not return a Report"
    assert report.SCHEMA != Report.SCHEMA, f"{report.__name__} has no schema name of its own"
    assert "progress" not in {f.name for f in dataclasses.fields(kinds[0])}, "progress is not an option"


@pytest.mark.parametrize("dotted", VERBS)
def test_each_steps_package_exports_its_verb_options_and_report(dotted: str) -> None:
    verb = resolve_name(dotted)
    package = importlib.import_module(".".join(verb.__module__.split(".")[:2]))
    hints = typing.get_type_hints(verb)
    options = next(t for t in _in_union(hints["options"]) if dataclasses.is_dataclass(t))
    exported = set(package.__all__)
    assert {verb.__name__, options.__name__, hints["return"].__name__} <= exported, package.__name__


def test_every_report_has_its_own_schema_name() -> None:
    reports = [typing.get_type_hints(resolve_name(d))["return"] for d in VERBS]
    names = {r.SCHEMA for r in reports}
    assert len(names) == len(set(reports))


def _public_callables() -> list[tuple[str, object]]:
    found = []
    steps = (slimtorch.prune, slimtorch.memory, slimtorch.deploy, slimtorch.quant, slimtorch.data)
    for module in (slimtorch, *steps):
        for name in getattr(module, "__all__", []):
            value = getattr(module, name)
            if callable(value) and not isinstance(value, type):
                found.append((f"{module.__name__}.{name}", value))
    return found


def test_no_twin_survives() -> None:
    twins = [n for n, _ in _public_callables() if re.search(r"_(with_report|profiled)$", n)]
    assert not twins, "each verb's report holds its result: a twin returning a pair is not public"


@pytest.mark.parametrize(
    ("module", "old"),
    [
        ("slimtorch", "quantize_with_report"),
        ("slimtorch", "load_model_profiled"),
        ("slimtorch", "LoadProfile"),
        ("slimtorch.loading", "load_profiled"),
        ("slimtorch.prune", "channels_with_report"),
        ("slimtorch.prune", "save_pretrained"),
        ("slimtorch.memory", "StepPlan"),
    ],
)
def test_a_name_renamed_before_0_1_0_is_gone(module: str, old: str) -> None:
    assert not hasattr(importlib.import_module(module), old), f"{module}.{old} (see CHANGELOG.md)"


def _documented_names() -> list[str]:
    # the changelog names what was renamed or removed, on purpose
    text = "\n".join(page.read_text() for page in doc_blocks.pages() if page.name != "CHANGELOG.md")
    names = set(re.findall(r"(?<![\w/.-])slimtorch(?:\.[A-Za-z_]\w*)+", text))
    return sorted(n for n in names - NOT_NAMES if not re.search(r"\.(md|json|py|toml|txt|safetensors)$", n))


def test_every_public_name_the_docs_use_still_resolves() -> None:
    missing = []
    for name in _documented_names():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                resolve_name(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert missing == []


def test_the_save_and_load_pair_given_the_other_way_round_says_so(tmp_path: Path) -> None:
    """save_model(model, path) as torch.save(obj, f), load_model(path, model) as torch.load(f): the order
    safetensors uses for its load_model (model, filename) is a clear error, not a TypeError from deep in."""
    import torch

    model, path = torch.nn.Linear(2, 2), tmp_path / "linear.safetensors"
    with pytest.raises(slimtorch.OptionError, match=r"save_model takes the model first.*not a \w*Path"):
        slimtorch.save_model(path, model)  # type: ignore[arg-type]
    assert not path.exists()
    slimtorch.save_model(model, path)
    with pytest.raises(slimtorch.OptionError, match=r"load_model takes the file first"):
        slimtorch.load_model(model, path)  # type: ignore[arg-type]
    assert torch.equal(slimtorch.load_model(path, torch.nn.Linear(2, 2)).model.weight, model.weight)
