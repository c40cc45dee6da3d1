"""open_model: the model a user names (a factory, a Hugging Face folder, a sentence-transformers folder),
its weights loaded safely, and example inputs it is known to accept. What every slimtorch command starts from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.source import FileRest
from slimtorch.loading.options import LoadReport
from slimtorch.models import hub, sentence
from slimtorch.models.examples import Example, check_accepts, example_for, forward_names, fresh
from slimtorch.models.spec import resolve_factory
from slimtorch.sources.hub_cache import resolve_model_path

Rename = Sequence[tuple[str, str] | str] | Mapping[str, str]
"""(old, new) name prefixes, ``"old=new"`` strings, or a mapping, as :func:`slimtorch.load_model` takes"""


@dataclass(frozen=True)
class ModelInput:
    """A model ready to work on, and an input it accepts (already run through it once)."""

    model: nn.Module
    args: tuple[Any, ...]
    """positional example inputs (an image, a tensor of ``input_shape``)"""
    kwargs: dict[str, Any]
    """keyword example inputs (``input_ids``, ``attention_mask`` ... for a text model)"""
    source: str
    """the spec or folder, as given"""
    folder: Path | None = None
    """the Hugging Face folder the model came from, where its ``config.json`` and tokenizer files are (for
    a sentence-transformers folder, its Transformer's folder: often the folder itself); None: a factory"""
    weights: Path | None = None
    """the checkpoint loaded into the model; None: the factory's own initial values (or meta tensors)"""
    ignored: tuple[str, ...] = ()
    """what the load left out, one ``name (reason)`` each: tensors of the file the model does not use and
    (non-strict) model tensors the file lacks"""
    origin: str = "the default"
    """where the example's shape came from"""
    _example: Example = field(default_factory=Example, repr=False)
    rest: FileRest = field(default_factory=FileRest)
    """what of the file the model does not hold (:class:`FileRest`)"""

    @property
    def example(self) -> dict[str, Any] | tuple[Any, ...]:
        """The example as one value: the keyword inputs as a dict, or the positional ones as a tuple (what
        :func:`slimtorch.quantize`'s calibration and :func:`slimtorch.memory.estimate` take)."""
        return dict(self.kwargs) if self.kwargs else self.args

    @property
    def shape(self) -> tuple[int, ...]:
        """The main input's shape (``input_ids``' for a text model)."""
        return self._example.shape

    def positional(self) -> tuple[Any, ...]:
        """The example as positional arguments, in the order of the model's forward: keyword inputs that
        follow its leading parameters in order (``input_ids, attention_mask, token_type_ids`` for BERT);
        a keyword input after a gap is left out. For APIs that take positional inputs only (export)."""
        if not self.kwargs:
            return self.args
        ordered = []
        for name in forward_names(self.model):
            if name not in self.kwargs:
                break
            ordered.append(self.kwargs[name])
        return tuple(ordered) or tuple(self.kwargs.values())

    def samples(self, count: int, seed: int = 1) -> list[dict[str, Any] | tuple[Any, ...]]:
        """``count`` inputs like the example (see :attr:`example`): the example first, then fresh ones of
        its shape and kind (new noise; new token ids, same masks)."""
        generator = torch.Generator().manual_seed(seed)
        made = [self._example]
        while len(made) < count:
            made.append(fresh(self._example, generator))
        return [dict(e.kwargs) if e.kwargs else e.args for e in made]


def open_model(
    spec_or_folder: str | os.PathLike[str],
    weights: str | os.PathLike[str] | None = None,
    *,
    strict: bool = True,
    prefix: str | None = None,
    rename: Rename = (),
    input_shape: Sequence[int] | None = None,
    allow_globals: tuple[str, ...] = (),
    check_example: bool = True,
) -> ModelInput:
    """Build the model ``spec_or_folder`` names, load its weights with slimtorch's safe loader, and find an
    example input it accepts.

    Args:
        spec_or_folder: ``package.module:factory`` or ``file.py:factory`` (a class or function taking no
            arguments), a Hugging Face model folder (``config.json``; its class from ``architectures``, never
            its code), a sentence-transformers folder (``modules.json``: a :class:`SentenceEmbedder`), or
            either by its Hub repo id (``org/name[@revision]``) from the local cache, never downloaded.
        weights: a checkpoint to load (any format slimtorch reads, or a repo id); a folder's own weights by
            default.
        strict, prefix, rename: how the file's names are matched to the model's, as in
            :func:`slimtorch.load_model`.
        input_shape: the example's shape (``(batch, length)`` for a text model); by default it comes from
            the model (see :mod:`slimtorch.models.examples`).
        allow_globals: pickle globals to trust for a ``torch.save`` file (only for files you trust).
        check_example: run the example through the model once (False: the caller brings its own input).

    Raises :class:`slimtorch.SlimtorchError` with one line when the model cannot be built or loaded, or when
    it rejects the example.

    Example:
        >>> from slimtorch.loading import open_model
        >>> opened = open_model("all-MiniLM-L6-v2")  # doctest: +SKIP
        >>> sorted(opened.kwargs), opened.model(**opened.kwargs).shape  # doctest: +SKIP
        (['attention_mask', 'input_ids', 'token_type_ids'], torch.Size([2, 384]))
    """
    source = str(spec_or_folder)
    weights = resolve_model_path(weights) if weights is not None else None
    recipe = _recipe(resolve_model_path(spec_or_folder), source, weights, allow_globals)
    path = weights if weights is not None else recipe.weights
    ignored: tuple[str, ...] = ()
    if path is None:
        if prefix or rename:
            raise SlimtorchError(
                "--prefix and --rename rename the names of a checkpoint: give it with --weights"
            )
        model = _built(recipe.build(), source)
    else:
        if recipe.folder is not None:  # names transformers itself renames on load, after the user's own
            given = list(rename.items()) if isinstance(rename, Mapping) else list(rename)
            rename = [*given, *_transformers_renames(path, recipe.build, allow_globals)]
        model, ignored, rest = _loaded(path, recipe.build, strict, prefix, rename, allow_globals)
    model.eval()
    opened = _with_example(model, source, recipe, path, ignored, input_shape, check_example)
    return replace(opened, rest=rest) if path is not None else opened


def open_meta_model(
    spec_or_folder: str | os.PathLike[str], *, input_shape: Sequence[int] | None = None
) -> ModelInput:
    """The model built on the meta device (shapes, no memory, no weights read) and an example input it
    accepts, checked on fake tensors: what a memory estimate needs, for models larger than RAM too.

    Example:
        >>> opened = open_meta_model("torch.nn:Identity", input_shape=(2, 8))
        >>> opened.args[0].shape
        torch.Size([2, 8])
    """
    source = str(spec_or_folder)
    recipe = _recipe(resolve_model_path(spec_or_folder), source, None, ())
    return _with_example(_built_on_meta(recipe.build, source), source, recipe, None, (), input_shape)


@dataclass(frozen=True)
class _Recipe:
    build: Callable[[], nn.Module]
    folder: Path | None = None
    weights: Path | None = None
    max_length: int | None = None


def _recipe(path: Path, source: str, weights: Any, allow_globals: tuple[str, ...]) -> _Recipe:
    if sentence.is_sentence_folder(path):
        found = sentence.read_sentence_folder(path)
        config = hub.read_config(found.transformer)
        own = Path(weights) if weights is not None else found.transformer
        build = sentence.sentence_factory(found, config, own if own.exists() else None, allow_globals)
        return _Recipe(build, found.transformer, found.transformer, found.max_length)
    if hub.is_model_folder(path):
        return _Recipe(hub.model_factory(hub.read_config(path)), path, path)
    if path.is_dir():
        raise SlimtorchError(
            f"{path}: a folder, but not a model folder (no config.json, no modules.json); for a checkpoint "
            "folder, name the model's factory as MODEL and give the folder with --weights"
        )
    return _Recipe(resolve_factory(source))


def _built_on_meta(build: Callable[[], nn.Module], source: str) -> nn.Module:
    """The model with every tensor on meta. A constructor that loads weights itself refuses a meta default
    device (``SentenceTransformer(folder)`` calls ``from_pretrained``, which transformers forbids under
    ``torch.device("meta")``): it is built with only its parameters on meta (what it loads is dropped as
    it is registered), then its buffers are moved there too."""
    try:
        with torch.device("meta"):
            return _built(build(), source)
    except SlimtorchError:
        raise
    except Exception:  # a real bug raises again below
        from slimtorch.loading.construct import build_on_meta

        return _built(build_on_meta(build), source).to("meta")


def _built(model: Any, source: str) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise SlimtorchError(f"{source} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _loaded(
    path: Path,
    build: Callable[[], nn.Module],
    strict: bool,
    prefix: str | None,
    rename: Rename,
    allow_globals: tuple[str, ...],
) -> tuple[nn.Module, tuple[str, ...], FileRest]:
    from slimtorch.loading.loader import load_model  # looked up at each call: tests watch what it gets

    report = load_model(path, build, strict=strict, allow_globals=allow_globals, prefix=prefix, rename=rename)
    assert report.model is not None  # load_model's report holds the model it filled
    return report.model, _left_out(report), _rest_of(path, report)


def _rest_of(path: Path, report: LoadReport) -> FileRest:
    """The report's file names the model did not load: outside the prefix, not the model's, or skipped
    (an ignored name is the file's when unexpected, the model's when the file lacks it)."""
    names = [*report.outside_prefix, *report.unmatched]
    names += [s.name for s in report.ignored if s.name.startswith(report.prefix) and s.name not in names]
    return FileRest(path, report.prefix, tuple(dict.fromkeys(names)))


def _transformers_renames(
    path: Path, build: Callable[[], nn.Module], allow_globals: tuple[str, ...]
) -> list[tuple[str, str]]:
    from slimtorch.sources import open_checkpoint

    with torch.device("meta"):  # the model's names and classes, for free
        model = build()
    with open_checkpoint(path, allow_globals=allow_globals) as source:
        names = list(source.names())
    return hub.checkpoint_renames(model, names)


def _left_out(report: LoadReport) -> tuple[str, ...]:
    """What the load report says it left out, as ``name (reason)`` lines."""
    found = [f"{s.name} ({s.reason})" if s.reason else s.name for s in report.ignored]
    found += [f"{name} (not in the model)" for name in report.unmatched]
    found += [f"{name} (not in the file: kept as built)" for name in report.missing]
    outside = report.outside_prefix
    if outside:
        found.append(
            f"{len(outside)} tensor(s) outside {report.prefix!r} (not the model's: {outside[0]}, ...)"
        )
    return tuple(found)


def _with_example(
    model: nn.Module,
    source: str,
    recipe: _Recipe,
    weights: Path | None,
    ignored: tuple[str, ...],
    input_shape: Sequence[int] | None,
    check: bool = True,
) -> ModelInput:
    if input_shape is not None and (not input_shape or any(int(n) < 1 for n in input_shape)):
        raise OptionError(f"input shape {tuple(input_shape)}: sizes must be positive")
    shape = tuple(int(n) for n in input_shape) if input_shape is not None else None
    example = example_for(model, shape, max_length=recipe.max_length)
    if check:
        check_accepts(model, example, source)
    return ModelInput(
        model,
        example.args,
        dict(example.kwargs),
        source,
        recipe.folder,
        weights,
        ignored,
        example.origin,
        example,
    )
