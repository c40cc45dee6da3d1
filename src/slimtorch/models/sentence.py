"""sentence-transformers folders as one module: the transformer, its pooling and its normalization.

A sentence-transformers folder lists its pipeline in ``modules.json``: a ``Transformer`` (a Hugging Face
model folder, at the top or in ``0_Transformer``), a ``Pooling`` (``1_Pooling/config.json`` says mean, CLS,
max ...) and often a ``Normalize``. :class:`SentenceEmbedder` is that pipeline as a torch module whose
forward takes token ids and returns the sentence embeddings, what ``SentenceTransformer.encode`` gives.

It is the transformer's own class with a different forward, so its parameters have the transformer's own
names: the folder's weights load into it as they are, and what slimtorch saves from it loads back into
the transformer class too. Nothing of sentence-transformers is imported.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slimtorch.errors import FormatError, SlimtorchError
from slimtorch.models import hub
from slimtorch.sources.companions import MODULE_TYPES, NORMALIZE, POOLING, TRANSFORMER

# pooling_mode_* keys of 1_Pooling/config.json, in the order sentence-transformers concatenates them
POOLING_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weighted_mean",
    "pooling_mode_lasttoken": "last",
}
# the values of "pooling_mode" (a name or a list of names), which newer folders write instead
POOLING_NAMES = {
    "cls": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weighted_mean",
    "lasttoken": "last",
}


class SentenceEmbedder(nn.Module):
    """A transformer that returns pooled (and normalized) sentence embeddings.

    Not built directly: :meth:`around` makes the subclass of a transformers model class, which keeps that
    class's modules and parameter names and replaces its forward.

    Example:
        >>> import transformers
        >>> Embedder = SentenceEmbedder.around(transformers.BertModel)
        >>> config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...                                  intermediate_size=64, vocab_size=100)
        >>> model = Embedder(config, pooling=("mean",), normalize=True)
        >>> ids = torch.randint(5, 100, (2, 7))
        >>> model(ids, torch.ones_like(ids)).shape
        torch.Size([2, 32])
    """

    pooling: tuple[str, ...]
    normalize: bool

    @classmethod
    def around(cls, transformer_class: type[nn.Module]) -> type[SentenceEmbedder]:
        """The embedder class for ``transformer_class`` (``BertModel`` gives ``SentenceBertModel``)."""
        return type(f"Sentence{transformer_class.__name__}", (cls, transformer_class), {})

    def __init__(
        self, config: Any, *, pooling: Sequence[str] = ("mean",), normalize: bool = False, **options: Any
    ) -> None:
        super().__init__(config, **options)  # the transformer's own constructor: its modules, its names
        unknown = [mode for mode in pooling if mode not in POOLING_MODES.values()]
        if unknown or not pooling:
            raise SlimtorchError(
                f"unknown pooling {unknown or 'none'}; known: {', '.join(POOLING_MODES.values())}"
            )
        self.pooling = tuple(pooling)
        self.normalize = normalize
        named = inspect.signature(super().forward).parameters
        self._takes_token_types = "token_type_ids" in named

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        extra = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        if not self._takes_token_types:
            extra = {}
        tokens = super().forward(input_ids=input_ids, attention_mask=attention_mask, **extra)[0]
        pooled = pool(tokens, attention_mask, self.pooling)
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled


def pool(tokens: torch.Tensor, attention_mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Token embeddings (batch, length, hidden) pooled over the unmasked tokens as sentence-transformers'
    ``Pooling`` does, one block of ``hidden`` per mode, concatenated in ``modes``' order.

    Example:
        >>> pool(torch.ones(1, 3, 4), torch.tensor([[1, 1, 0]]), ["mean", "cls"]).shape
        torch.Size([1, 8])
    """
    mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
    counts = mask.sum(1).clamp(min=1e-9)
    blocks = []
    for mode in modes:
        if mode == "cls":
            blocks.append(tokens[:, 0])
        elif mode == "max":
            blocks.append(tokens.masked_fill(mask == 0, -1e9).max(1).values)
        elif mode == "mean":
            blocks.append((tokens * mask).sum(1) / counts)
        elif mode == "mean_sqrt_len":
            blocks.append((tokens * mask).sum(1) / counts.sqrt())
        elif mode == "weighted_mean":
            positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device, dtype=tokens.dtype)
            weights = mask * positions.view(1, -1, 1)
            blocks.append((tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9))
        else:  # last: the last unmasked token, whichever side the padding is on
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            last = (attention_mask.to(torch.long) * positions).argmax(1)
            blocks.append(tokens[torch.arange(tokens.shape[0], device=tokens.device), last])
    return torch.cat(blocks, dim=1)


@dataclass(frozen=True)
class SentenceFolder:
    """What ``modules.json`` describes: where the transformer is, how it pools, whether it normalizes."""

    transformer: Path
    """the Hugging Face folder of the Transformer module (the folder itself or a sub-folder)"""
    pooling: tuple[str, ...]
    normalize: bool
    max_length: int | None
    """``max_seq_length`` of ``sentence_bert_config.json``: what the tokenizer truncates to"""


def is_sentence_folder(path: Path) -> bool:
    """Whether ``path`` is a sentence-transformers folder (it has a ``modules.json``)."""
    return path.is_dir() and (path / "modules.json").is_file()


def read_sentence_folder(folder: Path) -> SentenceFolder:
    """``modules.json`` and the files it points at; a module slimtorch does not build is refused.

    Example:
        >>> read_sentence_folder(Path("all-MiniLM-L6-v2")).pooling  # doctest: +SKIP
        ('mean',)
    """
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise SlimtorchError(f"{folder}/modules.json: expected a list of modules")
    kinds = [MODULE_TYPES.get(str(m.get("type", "")), str(m.get("type", ""))) for m in modules]
    for module, kind in zip(modules, kinds, strict=True):
        if kind not in (TRANSFORMER, POOLING, NORMALIZE):
            raise SlimtorchError(
                f"{folder}/modules.json: module {module.get('name', '?')!r} is {kind or 'untyped'}, which "
                "slimtorch does not build (it builds Transformer, Pooling and Normalize); give a factory "
                "(package.module:factory) that builds the model and --weights"
            )
    if kinds[:1] != [TRANSFORMER] or kinds.count(TRANSFORMER) != 1 or kinds.count(POOLING) != 1:
        raise SlimtorchError(
            f"{folder}/modules.json: expected one Transformer first and one Pooling, found {', '.join(kinds)}"
        )
    transformer = _module_folder(folder, modules[0])
    pooling_path = _module_folder(folder, modules[kinds.index(POOLING)]) / "config.json"
    settings = _json(transformer / "sentence_bert_config.json", missing={})
    max_length = settings.get("max_seq_length") if isinstance(settings, dict) else None
    return SentenceFolder(
        transformer,
        _pooling_modes(pooling_path),
        NORMALIZE in kinds,
        max_length if isinstance(max_length, int) and max_length > 0 else None,
    )


def sentence_factory(
    folder: SentenceFolder, config: Any, weights: Path | None, allow_globals: tuple[str, ...] = ()
) -> Callable[[], nn.Module]:
    """A function building the :class:`SentenceEmbedder` for ``folder``, with the pooler layer only when
    ``weights`` holds one (sentence-transformers never uses it, and many folders save none)."""
    model_class = hub.model_class_of(config)
    if model_class is None:
        raise SlimtorchError(
            f"{folder.transformer}/config.json: transformers has no class "
            f"{(config.architectures or ['(none)'])[0]}, which a sentence-transformers folder needs"
        )
    embedder = SentenceEmbedder.around(model_class)
    options: dict[str, Any] = {}
    if "add_pooling_layer" in inspect.signature(model_class.__init__).parameters and weights is not None:
        options["add_pooling_layer"] = _holds_pooler(weights, allow_globals)
    return lambda: embedder(config, pooling=folder.pooling, normalize=folder.normalize, **options)


def _pooling_modes(path: Path) -> tuple[str, ...]:
    settings = _json(path)
    if not isinstance(settings, dict):
        raise SlimtorchError(f"{path}: expected a JSON object")
    if "pooling_mode" in settings:
        return _named_pooling(path, settings["pooling_mode"])
    asked = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
    unknown = [key for key in asked if key not in POOLING_MODES]
    if unknown:
        raise SlimtorchError(f"{path}: {unknown[0]} is a pooling slimtorch does not know")
    modes = tuple(mode for key, mode in POOLING_MODES.items() if key in asked)
    if not modes:
        raise SlimtorchError(f"{path}: names no pooling mode (pooling_mode_mean_tokens, ...)")
    return modes


def _named_pooling(path: Path, value: Any) -> tuple[str, ...]:
    """``"pooling_mode": "mean"`` or ``["cls", "mean"]``, as sentence-transformers 5.4 and later write it."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise SlimtorchError(f"{path}: pooling_mode should be a name or a list of names")
    unknown = [n for n in names if n not in POOLING_NAMES]
    if unknown:
        raise SlimtorchError(f"{path}: pooling_mode {unknown[0]!r} is a pooling slimtorch does not know")
    return tuple(POOLING_NAMES[n] for n in names)


def _holds_pooler(weights: Path, allow_globals: tuple[str, ...]) -> bool:
    from slimtorch.sources import open_checkpoint

    with open_checkpoint(weights, allow_globals=allow_globals) as source:
        return any(name.startswith("pooler.") for name in source.names())


def _module_folder(folder: Path, module: dict) -> Path:
    """Where a module of ``modules.json`` lives: a folder inside ``folder`` (sentence-transformers writes
    ``""`` or ``1_Pooling``). An absolute path or ``..`` would make a downloaded folder read, and copy into
    the output, files from anywhere on this machine."""
    given = module.get("path", "")
    relative = Path(given) if isinstance(given, str) else None
    if relative is None or relative.is_absolute() or ".." in relative.parts or "\0" in given:
        raise FormatError(folder / "modules.json", f"module path {given!r} is outside the folder")
    return folder / relative


def _json(path: Path, missing: Any = None) -> Any:
    if missing is not None and not path.is_file():
        return missing
    try:
        return hub.read_json(path)
    except FileNotFoundError:
        raise SlimtorchError(f"{path}: missing (modules.json points at it)") from None
