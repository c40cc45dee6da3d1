"""Which name of a checkpoint is which tensor of a model: wrapper prefixes, renames, names to ignore.

Real checkpoints rarely hold a model's names as they are. A training script wraps them (``model_state.``,
``model.state_dict.``, Lightning's ``state_dict.``, DataParallel's ``module.``), an older version of the
library stored buffers that are now computed (``embeddings.position_ids``), and a base model saved on its
own lacks its task head's prefix (``bert.``). :func:`find_prefix` finds the wrapper by matching instead of
guessing from a list; :class:`IgnoreRules` knows which names a model declares it does not need; the rest
helps an error say what the file holds instead of only what it lacks.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

from slimtorch.errors import OptionError, SlimtorchError

RenameRules = tuple[tuple[str, str], ...]
Rename = Sequence[tuple[str, str]] | Mapping[str, str]
TORCH_WRAPPERS = ("module.", "_orig_mod.")
"""The attribute torch's own wrappers hold the model in, in front of every name of their state dict:
``DataParallel`` and ``DistributedDataParallel`` (``module.``), ``torch.compile`` (``_orig_mod.``)."""
WRAPPER_HEADS = ("model", "state_dict", "model_state_dict", "module", "net", "network")
"""Names a training script keeps its model under, trusted only where the file has no dict keys to show it
(safetensors, TorchScript) and holds training state besides."""


@dataclass(frozen=True)
class Prefix:
    """How the file's names line up with the model's: ``file + rest`` in the file is ``model + rest`` in
    the model (after the renames). ``file`` is a training wrapper (``model_state.``); ``model`` is a prefix
    the model has and the file lacks (``bert.``, a base model saved alone). At most one of them is set."""

    file: str = ""
    model: str = ""
    matched: int = 0
    """Model names found in the file this way."""


def find_prefix(file_names: Iterable[str], model_names: Iterable[str], rename: Rename = ()) -> Prefix:
    """The wrapper prefix under which the file holds the most names of the model.

    Candidates are the file's own dotted prefixes, so any wrapper at any depth is found, in one pass over
    the names (names x depth). When the model's names carry a prefix the file lacks (a ``bert.`` base
    model under a task head), that is found the same way from the model's side. Exact names win a tie;
    two different wrappers holding the model equally well (``model.`` and ``ema.``) are refused.

    Example:
        >>> find_prefix(["model_state.fc.weight", "optimizer_state.state.0.exp_avg"], ["fc.weight"]).file
        'model_state.'
        >>> find_prefix(["fc.weight"], ["bert.fc.weight", "classifier.bias"]).model
        'bert.'
    """
    rules = rename_rules(rename)
    wanted = set(model_names)
    files = list(file_names)
    if not rules and len(files) == len(wanted) and wanted.issuperset(files):
        return Prefix(matched=len(files))  # the model's names exactly: no prefix can hold more
    counts: Counter[str] = Counter()
    for name in files:
        for cut in _cuts(name):
            rest = name[cut:]
            if (apply_rename(rest, rules) if rules else rest) in wanted:
                counts[name[:cut]] += 1
    best, tied = _best(counts)
    if counts[best] < len(wanted):
        have = {apply_rename(name, rules) for name in files}
        reverse: Counter[str] = Counter()
        for name in wanted:
            for cut in _cuts(name)[1:]:
                if name[cut:] in have:
                    reverse[name[:cut]] += 1
        other, others = _best(reverse)
        # Two model prefixes alike (two copies of one submodule) say nothing about which the file is.
        if len(others) == 1 and reverse[other] > counts[best]:
            return Prefix(model=other, matched=reverse[other])
    if len(tied) > 1:
        a, b = tied[:2]
        raise SlimtorchError(
            f"the file holds the model's names under {a!r} and {b!r} alike ({counts[a]} each): "
            f"choose one with prefix={a!r} (--prefix {a})"
        )
    return Prefix(file=best, matched=counts[best])


def training_wrapper(names: Sequence[str], tree: object | None = None, training: bool = False) -> str:
    """The wrapper prefix a training checkpoint put around the model's tensors, found without the model:
    what shrink takes off (``load_model`` finds the same by matching, :func:`find_prefix`).

    ``names`` are the model's tensors in the file (training state left out), ``tree`` the pickle's
    objects (None: no pickle), ``training`` whether the file held training state. The prefix is, in turn:
    the dict keys every name sits under in the pickle (``model_state.``, ``model.state_dict.``, Lightning's
    ``state_dict.``; a Lightning module's own dotted ``model.`` stays); else, in a training checkpoint, a
    single head in :data:`WRAPPER_HEADS`; then any of torch's own :data:`TORCH_WRAPPERS` in front of every
    name.

    Example:
        >>> training_wrapper(["module.fc.weight", "module.fc.bias"], {"model": {}}, training=True)
        'module.'
        >>> training_wrapper(["model.fc.weight"], {"model": {"fc.weight": 0}})
        'model.'
    """
    if not names or not all("." in name for name in names):
        return ""
    prefix = _dict_path(names, tree)
    if not prefix and training:
        heads = {name.split(".", 1)[0] for name in names}
        prefix = f"{next(iter(heads))}." if len(heads) == 1 and heads <= set(WRAPPER_HEADS) else ""
    while wrapper := next((w for w in TORCH_WRAPPERS if all(n.startswith(prefix + w) for n in names)), None):
        prefix += wrapper
    return prefix


def _dict_path(names: Sequence[str], tree: object | None) -> str:
    """The path of dict keys to where every name's tensor sits in the pickle, not dotted state-dict keys."""
    prefix, node = "", tree
    while isinstance(node, dict):
        key = names[0][len(prefix) :].split(".", 1)[0]
        if not isinstance(node.get(key), dict) or not all(n.startswith(f"{prefix}{key}.") for n in names):
            break
        prefix, node = f"{prefix}{key}.", node[key]
    return prefix


def explicit_prefix(
    file_names: Iterable[str], model_names: Iterable[str], prefix: str, rename: Rename
) -> Prefix:
    """A prefix the user gave (a missing final dot is added: ``model_state`` is ``model_state.``)."""
    if prefix and not prefix.endswith("."):
        prefix += "."
    rules, wanted = rename_rules(rename), set(model_names)
    matched = sum(
        n.startswith(prefix) and apply_rename(n[len(prefix) :], rules) in wanted for n in file_names
    )
    return Prefix(file=prefix, matched=matched)


def _cuts(name: str) -> list[int]:
    """Where a wrapper prefix can end: the start, and after every dot."""
    cuts = [0]
    while (dot := name.find(".", cuts[-1])) >= 0:
        cuts.append(dot + 1)
    return cuts


def _best(counts: Counter[str]) -> tuple[str, list[str]]:
    """The prefix with the most names and every prefix with as many; exact names ("") win a tie."""
    most = max(counts.values(), default=0)
    tied = [prefix for prefix, count in counts.items() if count == most]
    if not most or "" in tied:
        return "", [""]
    return tied[0], tied


def rename_rules(rename: Rename) -> RenameRules:
    """``rename`` as (old, new) pairs: a mapping, pairs, or ``"old=new"`` strings (the CLI's form).

    Example:
        >>> rename_rules({"lstm.": "rnn."}) == rename_rules(["lstm.=rnn."]) == (("lstm.", "rnn."),)
        True
    """
    pairs = rename.items() if isinstance(rename, Mapping) else rename
    rules = []
    for pair in pairs:
        if isinstance(pair, str) and "=" in pair:
            pair = tuple(pair.split("=", 1))
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise OptionError(f"rename takes (old, new) name prefixes, like ('lstm.', 'rnn.'), not {pair!r}")
        rules.append((pair[0], pair[1]))
    return tuple(rules)


def apply_rename(name: str, rules: RenameRules) -> str:
    """The first rule whose old prefix starts ``name`` replaces it; the name is kept if none does."""
    for old, new in rules:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def model_name_of(file_name: str, prefix: Prefix, rules: RenameRules) -> str | None:
    """The model's name for one of the file's names (None: outside the wrapper prefix)."""
    if not file_name.startswith(prefix.file):
        return None
    return prefix.model + apply_rename(file_name[len(prefix.file) :], rules)


def weight_norm_aliases(model: nn.Module) -> dict[str, str]:
    """The other spelling of every weight-norm tensor of ``model``: model name -> the name a file saved
    with the other ``weight_norm`` holds.

    ``torch.nn.utils.weight_norm`` (deprecated) stores ``X.weight_g`` / ``X.weight_v``; the
    parametrization that replaced it stores ``X.parametrizations.weight.original0`` / ``original1``,
    the same tensors (magnitude, direction) under new names. torch's own load hook maps old files onto
    new modules; this does the same, both ways, for any parametrized name.

    Example:
        >>> from torch.nn.utils.parametrizations import weight_norm
        >>> aliases = weight_norm_aliases(nn.Sequential(weight_norm(nn.Linear(2, 2))))
        >>> aliases["0.parametrizations.weight.original0"]
        '0.weight_g'
    """
    aliases: dict[str, str] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        # a parametrized module holds them as a submodule: asked first, for a miss through
        # nn.Module.__getattr__ (is_parametrized's getattr) costs 1.4 us a module
        if "parametrizations" in module._modules and parametrize.is_parametrized(module):
            for attr, chain in module.parametrizations.items():
                if len(chain) == 1 and type(chain[0]).__name__ == "_WeightNorm":
                    new = f"{dot}parametrizations.{attr}.original"
                    aliases[new + "0"], aliases[new + "1"] = f"{dot}{attr}_g", f"{dot}{attr}_v"
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, WeightNorm):
                new = f"{dot}parametrizations.{hook.name}.original"
                aliases[f"{dot}{hook.name}_g"], aliases[f"{dot}{hook.name}_v"] = new + "0", new + "1"
    return aliases


@dataclass(frozen=True)
class Skipped:
    """A name left out of a load on purpose, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class IgnoreRules:
    """Names a model says it can do without.

    - buffers it computes itself (non-persistent), which older checkpoints stored: matched on the last
      two parts of the name, because a library may also have moved them (every layer's
      ``rotary_emb.inv_freq`` became one at the top);
    - Hugging Face's ``_keys_to_ignore_on_load_unexpected`` / ``_missing`` regexes, searched in the name,
      gathered from every submodule as transformers does;
    - under a transformers model (``PreTrainedModel``), any tensor its class lacks: ``from_pretrained``
      reports those and loads the rest (an ALBERT folder's pooler under ``AlbertForMaskedLM``, a
      pre-training head under a classifier), and so does slimtorch, with the same one line for each in
      the load report. Tensors such a model lacks in the file still refuse (``from_pretrained`` would
      initialise them at random). Any other model keeps torch's strict default.
    """

    buffers: Mapping[str, str]
    unexpected: tuple[tuple[str, re.Pattern[str]], ...]
    missing: tuple[tuple[str, re.Pattern[str]], ...]
    pretrained: tuple[tuple[str, str], ...] = ()
    """(name prefix, class name) of each outermost transformers model in the model: "" for the root."""

    @classmethod
    def of(cls, model: nn.Module) -> IgnoreRules:
        """The rules ``model`` declares.

        Example:
            >>> IgnoreRules.of(nn.Linear(2, 2)).unexpected_reason("weight") is None
            True
        """
        buffers: dict[str, str] = {}
        patterns: dict[str, dict[str, re.Pattern[str]]] = {"unexpected": {}, "missing": {}}
        pretrained: list[tuple[str, str]] = []
        transformers = sys.modules.get("transformers")  # a transformers model means it is imported already
        base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
        for prefix, module in model.named_modules(remove_duplicate=False):
            # the outermost ones only (named_modules gives a parent before its children)
            if base is not None and isinstance(module, base) and not _under(prefix, pretrained):
                pretrained.append((prefix, type(module).__name__))
            for attr in module._non_persistent_buffers_set:
                if module._buffers.get(attr) is not None:
                    name = f"{prefix}.{attr}" if prefix else attr
                    buffers.setdefault(_tail(name), name)
            for which, found in patterns.items():
                _add_patterns(module, which, found)
        return cls(
            buffers,
            tuple(patterns["unexpected"].items()),
            tuple(patterns["missing"].items()),
            tuple(pretrained),
        )

    def unexpected_reason(self, name: str) -> str | None:
        """Why the file's tensor (under the model's name ``name``) may be skipped; None: it may not."""
        buffer = self.buffers.get(_tail(name))
        if buffer is not None:
            return f"the model computes its buffer {buffer!r} itself (not persistent)"
        declared = _reason(self.unexpected, name, "_keys_to_ignore_on_load_unexpected")
        if declared is not None:
            return declared
        for prefix, kind in self.pretrained:
            if not prefix or name.startswith(f"{prefix}."):
                return f"{kind} has no such tensor: skipped, as transformers' from_pretrained skips it"
        return None

    def missing_reason(self, name: str) -> str | None:
        """Why the model's ``name`` may keep its own value when the file lacks it; None: it may not."""
        return _reason(self.missing, name, "_keys_to_ignore_on_load_missing")


def _under(prefix: str, found: list[tuple[str, str]]) -> bool:
    return any(not outer or prefix.startswith(f"{outer}.") for outer, _ in found)


def _tail(name: str) -> str:
    return ".".join(name.rsplit(".", 2)[-2:])


def _add_patterns(module: nn.Module, which: str, found: dict[str, re.Pattern[str]]) -> None:
    """Add ``module``'s ``_keys_to_ignore_on_load_<which>`` regexes to ``found``, compiled."""
    attribute = f"_keys_to_ignore_on_load_{which}"
    # Looked up in the instance, then its class: a missing attribute through nn.Module.__getattr__ raises
    # inside (1.4 us; a load asks every module of BERT-base twice).
    declared = module.__dict__.get(attribute, getattr(type(module), attribute, None))
    for pattern in declared or ():
        if pattern not in found:
            try:
                found[pattern] = re.compile(pattern)
            except re.error as exc:
                raise SlimtorchError(
                    f"{type(module).__name__}.{attribute} holds {pattern!r}, not a regular expression ({exc})"
                ) from None


def _reason(patterns: tuple[tuple[str, re.Pattern[str]], ...], name: str, attribute: str) -> str | None:
    for text, pattern in patterns:
        if pattern.search(name):
            return f"the model's {attribute} matches it ({text!r})"
    return None


# -- what an error says ------------------------------------------------------------------------------------
def some(names: Sequence[str]) -> str:
    """``3 tensors ('a', 'b', 'c')``, the first three names of a list and how many there are."""
    shown = ", ".join(repr(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} ({shown}{more})"


def file_groups(names: Sequence[str], limit: int = 4) -> str:
    """What a file holds, by top-level group: ``16 tensors under 'model_state.' and 32 under ...``.

    Example:
        >>> file_groups(["model_state.w", "model_state.b", "optimizer_state.m"])
        "2 tensors under 'model_state.' and 1 under 'optimizer_state.'"
    """
    groups = Counter(n.split(".", 1)[0] + "." if "." in n else "" for n in names)
    parts = []
    for i, (group, count) in enumerate(groups.most_common(limit)):
        amount = f"{count} tensor{'s' if count != 1 else ''}" if i == 0 else str(count)
        parts.append(f"{amount} at the top level" if group == "" else f"{amount} under {group!r}")
    if len(groups) > limit:
        parts.append(f"{len(groups) - limit} more groups")
    if not parts:
        return "no tensors"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def closest(wanted: Sequence[str], pool: Iterable[str], count: int = 3) -> str:
    """``'lstm.weight_ih_l0' for 'rnn.weight_ih_l0', ...``: the nearest name in ``pool`` for the first
    few ``wanted`` names, compared on as many trailing parts as the wanted name has (so a wrapper in
    front does not hide a match); empty when nothing is close."""
    pool = list(pool)
    found = []
    for name in wanted[:count]:
        depth = name.count(".") + 1
        tails: dict[str, str] = {}
        for candidate in pool:
            tails.setdefault(".".join(candidate.split(".")[-depth:]), candidate)
        near = difflib.get_close_matches(name, list(tails), n=1, cutoff=0.6)
        if near:
            found.append(f"{tails[near[0]]!r} for {name!r}")
    return ", ".join(found)


def unmatched_pattern(patterns: Iterable[str], names: Sequence[str]) -> tuple[str, list[str]] | None:
    """The first pattern (fnmatch, case-sensitive) that matches none of ``names``, with up to three of the
    closest names; None when every pattern matches. Options that take patterns (shrink's and quantize's
    ``skip``) refuse such a pattern: a typo would otherwise quietly change what they do.

    Example:
        >>> unmatched_pattern(["fc.*", "norm.wieght"], ["fc.weight", "norm.weight"])
        ('norm.wieght', ['norm.weight', 'fc.weight'])
    """
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            return pattern, difflib.get_close_matches(pattern, sorted(names), n=3, cutoff=0.5)
    return None
