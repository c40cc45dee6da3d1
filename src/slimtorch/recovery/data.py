"""Task data by name: what ``slimtorch recover`` and ``slimtorch slim`` train on and measure with.

:func:`open_data` turns a spec into a :class:`TaskData` (train and held-out batches, and the metric):

- ``digits``: scikit-learn's bundled 8x8 digits, split exactly as ``examples/digits.py`` splits them;
- a folder (``train.npz`` + ``eval.npz``, or ``x.npy`` + ``y.npy``) or one ``.npz`` file, arrays ``x`` and
  ``y``; one set of arrays is split 80/20 by the seed. Arrays are read without pickle, within the budget of
  :mod:`slimtorch.format.numpy_files` (headers and sizes checked before anything is allocated);
- ``pkg.module:factory`` or ``path/file.py:factory`` (the import rules of model specs): it returns a
  DataLoader (or any re-iterable of ``(inputs, targets)`` batches), a ``(train, eval)`` pair, or a dict with
  ``train`` and ``eval``; a ``metric`` key or module attribute chooses the metric;
- a ``.txt`` file, for a causal language model, with its ``tokenizer``: token sequences, the file's tail
  held out (:mod:`slimtorch.recovery.text`), scored by perplexity.

:func:`evaluate` measures a model on the held-out batches: accuracy (percent of argmax hits), the cosine
of its outputs to a reference model's, or a causal language model's perplexity (lower is better). Data
that does not fit the model is one error naming the data, not a traceback from deep in torch: inputs the
model rejects (a wrong width, token ids given to a float model), class ids outside its outputs, float
targets where accuracy needs class ids.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slimtorch.errors import OptionError, SlimtorchError
from slimtorch.format.numpy_files import read_npy, read_npz
from slimtorch.models.spec import resolve_factory
from slimtorch.recovery import text

METRICS = ("accuracy", "cosine", "perplexity")
DIGITS = "digits"
BATCH = 64
"""samples per batch unless told"""
EVAL_SHARE = 0.2
"""the held-out share of one set of arrays"""
XY = ("x", "y")


@dataclass(frozen=True)
class TaskData:
    """Train and held-out batches of a task, and how a model is scored on it.

    Example:
        >>> data = open_data("digits")  # doctest: +SKIP
        >>> data.metric, len(data.train), tuple(data.example.shape)  # doctest: +SKIP
        ('accuracy', 22, (64, 1, 8, 8))
    """

    spec: str
    """what the user named (``digits``, a folder, ``pkg.mod:factory``): recipes record it"""
    train: Iterable[tuple[torch.Tensor, torch.Tensor]]
    """``(inputs, targets)`` batches, re-iterable (a DataLoader)"""
    eval: Iterable[tuple[torch.Tensor, torch.Tensor]]
    """held-out ``(inputs, targets)`` batches, re-iterable, in a fixed order"""
    metric: str
    """``accuracy`` (targets are class ids), ``cosine`` (outputs against a reference model's) or
    ``perplexity`` (a causal language model on token sequences; lower is better)"""
    example: torch.Tensor
    """the inputs of one held-out batch (graph capture, latency)"""
    notes: tuple[str, ...] = field(default=())
    """what the spec left to a fallback, one line each (a factory's one loader used for eval too)"""
    class_ids: tuple[int, int] | None = None
    """the least and the greatest class id of every target, train and held-out (arrays of class ids; None
    where not known in advance): checked against the model's outputs before it is scored"""


class Batches:
    """Fixed ``batch``-sized slices of ``x`` and ``y``: re-iterable, with a length (``epochs`` needs it)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
        self.x, self.y, self.batch = x, y, batch

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, len(self.x), self.batch):
            yield self.x[start : start + self.batch], self.y[start : start + self.batch]


def open_data(
    spec: str,
    *,
    batch: int = BATCH,
    seed: int = 0,
    tokenizer: Any = None,
    length: int = text.LENGTH,
    sequences: int = text.MAX_SEQUENCES,
) -> TaskData:
    """The task data ``spec`` names (see the module's docstring for the forms).

    ``batch`` and ``seed`` (the training order; the split of one set of arrays) apply to ``digits`` and to
    arrays; a factory is given them as keywords when it takes ``batch`` / ``seed``, else it batches alone.
    A ``.txt`` file needs the model's ``tokenizer`` (see :func:`slimtorch.recovery.text.open_text`) and is
    cut into ``sequences`` sequences of ``length`` tokens at most, ``batch`` to a batch.

    Example:
        >>> data = open_data("digits", batch=32)  # doctest: +SKIP
        >>> evaluate(model, data)  # doctest: +SKIP
        99.56
    """
    if batch < 1:
        raise OptionError(f"batch must be at least 1, not {batch}")
    if spec == DIGITS:
        x, y = _digits_arrays(spec)
        return _from_arrays(spec, _train_eval_digits(x, y, seed), batch)
    path = Path(spec)
    if path.suffix.lower() == ".txt" and (path.is_file() or tokenizer is not None):
        if tokenizer is None:
            raise SlimtorchError(
                f"data {spec!r}: text is read with the model's tokenizer, and none was given (a Hugging Face "
                "folder's own is used on the command line)"
            )
        train, held, note = text.open_text(path, tokenizer, length=length, sequences=sequences, batch=batch)
        return TaskData(spec, train, held, "perplexity", next(iter(held))[0], notes=(note,))
    if path.exists():
        return _from_arrays(spec, _arrays(spec, path, seed), batch)
    if ":" in spec:
        return _from_factory(spec, batch, seed)
    raise SlimtorchError(
        f"data {spec!r}: no such file or folder, and not pkg.module:factory, file.py:factory or digits"
    )


def evaluate(
    model: nn.Module, data: TaskData, *, reference: nn.Module | None = None, metric: str | None = None
) -> float:
    """``model`` scored on ``data.eval``: accuracy in percent (0..100), the mean cosine (0..1) of its
    outputs to ``reference``'s (each vector along the last dimension: a token's embedding, a sample's
    logits), or a causal language model's perplexity on held-out token sequences (1 and up, lower is
    better). Runs in eval mode without gradients; each model's training mode is put back after.

    Example:
        >>> evaluate(pruned, data)  # doctest: +SKIP
        98.9
        >>> evaluate(pruned, data, reference=original, metric="cosine")  # doctest: +SKIP
        0.994
    """
    metric = metric or data.metric
    if metric not in METRICS:
        raise OptionError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
    if metric == "cosine" and reference is None:
        raise SlimtorchError(f"data {data.spec!r}: the cosine metric needs a reference model to compare to")
    models = [model] if reference is None else [model, reference]
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        with torch.no_grad():
            return _score(model, reference, data, metric)
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)


def _score(model: nn.Module, reference: nn.Module | None, data: TaskData, metric: str) -> float:
    if metric == "perplexity":
        return text.perplexity(model, data.eval)
    device = _device_of(model)
    total, count = 0.0, 0
    for inputs, targets in data.eval:
        inputs = inputs.to(device)
        outputs = _outputs(model, inputs, data)
        if metric == "accuracy":
            _check_class_ids(data, torch.as_tensor(targets), outputs.shape[-1] if outputs.dim() else 1)
            predicted, expected = outputs.argmax(-1).reshape(-1).cpu(), torch.as_tensor(targets).reshape(-1)
            if predicted.shape != expected.shape:
                raise SlimtorchError(
                    f"data {data.spec!r}: {len(expected)} targets for {len(predicted)} predictions in a batch"
                )
            total += float((predicted == expected).sum())
            count += expected.numel()
        else:
            assert reference is not None
            expected = _outputs(reference, inputs.to(_device_of(reference)), data).to(outputs.device)
            cosines = nn.functional.cosine_similarity(
                outputs.float().reshape(-1, outputs.shape[-1]),
                expected.float().reshape(-1, expected.shape[-1]),
                dim=-1,
            )
            total += float(cosines.sum())
            count += cosines.numel()
    if count == 0:
        raise SlimtorchError(f"data {data.spec!r}: the held-out data yielded no sample")
    return total / count * (100.0 if metric == "accuracy" else 1.0)


def _outputs(model: nn.Module, inputs: torch.Tensor, data: TaskData) -> torch.Tensor:
    """The model's output tensor for a batch of the data; inputs it cannot take are one line naming the
    data and the inputs' shape, not the traceback of the layer that choked on them."""
    try:
        return output_tensor(model(inputs))
    except SlimtorchError:
        raise
    except Exception as exc:  # whatever the model's own code raises on inputs it cannot take
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        shape = "x".join(map(str, getattr(inputs, "shape", ()))) or "()"
        dtype = str(getattr(inputs, "dtype", type(inputs).__name__)).removeprefix("torch.")
        raise SlimtorchError(
            f"data {data.spec!r}: the model does not accept its inputs, {dtype} of shape {shape} "
            f"({type(exc).__name__}: {first})"
        ) from exc


def _check_class_ids(data: TaskData, targets: torch.Tensor, classes: int) -> None:
    """Targets scored by accuracy are class ids, each an output of the model: 0 to ``classes - 1``."""
    if targets.is_floating_point() or targets.is_complex():
        raise SlimtorchError(
            f"data {data.spec!r}: accuracy needs class ids (integer targets), not "
            f"{str(targets.dtype).removeprefix('torch.')} ones; give integer targets, or a cosine metric"
        )
    spans = [data.class_ids] if data.class_ids is not None else []
    if targets.numel():
        spans.append((int(targets.min()), int(targets.max())))
    if not spans:
        return
    low, high = min(span[0] for span in spans), max(span[1] for span in spans)
    if low < 0 or high >= classes:
        raise SlimtorchError(
            f"data {data.spec!r}: class ids run from {low} to {high}, but the model has {classes} outputs "
            f"(class ids 0 to {classes - 1})"
        )


def output_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's output is scored by: the output itself, a sentence embedding, or the first
    tensor of a tuple or a Hugging Face ``ModelOutput`` (logits, last hidden state)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if isinstance(output.get("sentence_embedding"), torch.Tensor):
            return output["sentence_embedding"]
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        first = next((value for value in output if isinstance(value, torch.Tensor)), None)
        if first is not None:
            return first
    raise SlimtorchError(f"cannot score a model whose output is a {type(output).__name__}: no tensor in it")


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


# digits and arrays


def _digits_arrays(spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as ``examples/digits.py`` makes them: (N, 1, 8, 8) floats in 0..1, class ids."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SlimtorchError(f"data {spec!r} needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(digits.target)


def _train_eval_digits(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[tuple, tuple]:
    """The stratified 75/25 split of ``examples/digits.py`` (``random_state=0`` whatever the seed: the
    held-out set is the same from run to run), the training part shuffled by ``seed``."""
    from sklearn.model_selection import train_test_split

    train_x, eval_x, train_y, eval_y = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return _shuffled(train_x, train_y, seed), (eval_x, eval_y)


def _shuffled(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x[order], y[order]


def _from_arrays(spec: str, parts: tuple[tuple, tuple], batch: int) -> TaskData:
    (train_x, train_y), (eval_x, eval_y) = parts
    metric = "accuracy" if not eval_y.is_floating_point() else "cosine"
    ids = [y for y in (train_y, eval_y) if y.numel()]
    class_ids = None
    if metric == "accuracy" and ids:
        class_ids = (min(int(y.min()) for y in ids), max(int(y.max()) for y in ids))
    return TaskData(
        spec,
        Batches(train_x, train_y, batch),
        Batches(eval_x, eval_y, batch),
        metric,
        eval_x[:batch],
        class_ids=class_ids,
    )


def _arrays(spec: str, path: Path, seed: int) -> tuple[tuple, tuple]:
    """Train and eval ``(x, y)`` from a folder or an ``.npz`` file."""
    if path.is_dir():
        if (path / "train.npz").is_file() and (path / "eval.npz").is_file():
            train = _xy(spec, read_npz(path / "train.npz", XY), "train.npz")
            return _shuffled(*train, seed), _xy(spec, read_npz(path / "eval.npz", XY), "eval.npz")
        if (path / "x.npy").is_file() and (path / "y.npy").is_file():
            found = {"x": read_npy(path / "x.npy"), "y": read_npy(path / "y.npy")}
            return _split(spec, *_xy(spec, found, "x.npy, y.npy"), seed)
        raise SlimtorchError(
            f"data {spec!r}: the folder holds neither train.npz + eval.npz nor x.npy + y.npy"
        )
    if path.suffix != ".npz":
        raise SlimtorchError(f"data {spec!r}: expected a folder or an .npz file, not a {path.suffix} file")
    return _split(spec, *_xy(spec, read_npz(path, XY), path.name), seed)


def _split(spec: str, x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[tuple, tuple]:
    """One set of arrays: a seeded 20% held out, the rest shuffled for training."""
    if len(x) < 2:
        raise SlimtorchError(f"data {spec!r}: {len(x)} sample(s), too few to hold some out")
    x, y = _shuffled(x, y, seed)
    held = max(1, round(len(x) * EVAL_SHARE))
    return (x[held:], y[held:]), (x[:held], y[:held])


def _xy(spec: str, arrays: dict[str, np.ndarray], where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` as tensors: floats as float32, integers as int64 (class ids, token ids)."""
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing:
        raise SlimtorchError(f"data {spec!r}: {where} has no array {' or '.join(missing)} (it needs x and y)")
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
        raise SlimtorchError(f"data {spec!r}: {where}: x has shape {x.shape} and y {y.shape}: lengths differ")
    if len(x) == 0:
        raise SlimtorchError(f"data {spec!r}: {where} holds no sample")
    return _tensor(spec, x, "x"), _tensor(spec, y, "y")


def _tensor(spec: str, array: np.ndarray, name: str) -> torch.Tensor:
    if array.dtype.kind in "iub":
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if array.dtype.kind == "f":
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    raise SlimtorchError(f"data {spec!r}: array {name} holds {array.dtype}, not numbers")


# factories


def _from_factory(spec: str, batch: int, seed: int) -> TaskData:
    """What a ``pkg.module:factory`` / ``file.py:factory`` returns, checked and sorted into train and eval."""
    factory = resolve_factory(spec, what="data")
    made = factory(**_keywords(factory, batch=batch, seed=seed))
    metric = getattr(sys.modules.get(getattr(factory, "__module__", "") or ""), "metric", None)
    notes: tuple[str, ...] = ()
    if isinstance(made, Mapping):
        missing = [key for key in ("train", "eval") if key not in made]
        if missing:
            raise SlimtorchError(f"data {spec!r}: the factory's dict has no {' or '.join(missing)} key")
        train, held, metric = made["train"], made["eval"], made.get("metric", metric)
    elif isinstance(made, tuple) and len(made) == 2 and not any(_is_batch(part) for part in made):
        train, held = made
    else:
        train = held = made
        notes = (f"data {spec!r}: one loader, so the model is also evaluated on its training data",)
    _check_batches(spec, "train", train)
    first = _check_batches(spec, "eval", held)
    if metric is None:
        targets = first[1]
        class_ids = isinstance(targets, torch.Tensor) and not targets.is_floating_point()
        metric = "accuracy" if class_ids else "cosine"
    if metric not in METRICS:
        raise SlimtorchError(f"data {spec!r}: metric must be one of {', '.join(METRICS)}, not {metric!r}")
    targets = first[1]
    if metric == "accuracy" and isinstance(targets, torch.Tensor) and targets.is_floating_point():
        raise SlimtorchError(
            f"data {spec!r}: the accuracy metric needs class ids (integer targets), but the targets are "
            f'{str(targets.dtype).removeprefix("torch.")}; return integer targets, or metric = "cosine"'
        )
    return TaskData(spec, train, held, metric, first[0], notes)


def _keywords(factory: Any, **offered: Any) -> dict[str, Any]:
    """Those of ``offered`` the factory takes by name."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    return {name: value for name, value in offered.items() if name in parameters}


def _is_batch(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor)


def _check_batches(spec: str, which: str, batches: Any) -> tuple[torch.Tensor, Any]:
    """The first batch of ``batches``, which must be re-iterable and yield ``(inputs, targets)``."""
    if not isinstance(batches, Iterable) or isinstance(batches, (torch.Tensor, str, bytes)):
        raise SlimtorchError(
            f"data {spec!r}: the factory's {which} is a {type(batches).__name__}, not batches: "
            "return a DataLoader, (train, eval) or {'train': ..., 'eval': ...}"
        )
    if iter(batches) is batches:
        raise SlimtorchError(
            f"data {spec!r}: the factory's {which} is an iterator, read only once: return a DataLoader "
            "or a list of batches"
        )
    first = next(iter(batches), None)
    if first is None:
        raise SlimtorchError(f"data {spec!r}: the factory's {which} data yields no batch")
    if not _is_batch(first):
        raise SlimtorchError(
            f"data {spec!r}: a {which} batch must be (inputs, targets) with inputs a tensor, not "
            f"{type(first).__name__}"
        )
    return first[0], first[1]
