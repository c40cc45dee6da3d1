"""Build a model without paying for its weights: parameters on the meta device, buffers real.

A model's constructor allocates every parameter and fills it with random numbers, which a loader then
overwrites: for a 1 GiB model that is 1 GiB of RAM and seconds of ``kaiming_uniform_`` for nothing.
:func:`build_on_meta` runs the constructor with :meth:`torch.nn.Module.register_parameter` moving each new
parameter to the meta device, so the initialisers that follow see meta tensors and do nothing.

Buffers stay real on purpose. Non-persistent buffers (``position_ids``, rotary ``inv_freq``, causal masks)
are not in any checkpoint: the constructor is the only place their values come from. A transformers
model's own initialisation pass runs only where it can change something (:func:`_hf_init_of_state_only`).

Constructors move what they built (``nn.Linear(4, 4).to(device)``, ``self.cuda()``): a meta tensor stays
on meta and remembers where it was sent (:func:`intended_device`), so the loader puts the file's tensor
there. A constructor that needs its weights' values (``.item()``, a buffer computed from them) cannot run
on meta: :func:`build_model` then builds normally and says so.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from slimtorch.errors import SlimtorchError

_lock = threading.Lock()
# In-place ops that initialisers use and that leave a tensor's metadata alone: on a meta tensor they do
# nothing, but torch still runs their Python reference implementations (``normal_`` on meta costs ~100 us).
_INIT_OP_NAMES = """normal_ uniform_ fill_ zero_ random_ exponential_ log_normal_ cauchy_ geometric_
bernoulli_ erfinv_ mul_ div_ add_ sub_ clamp_ clamp_min_ clamp_max_ copy_ masked_fill_ index_fill_ abs_ neg_
sqrt_ exp_ log_ fmod_ remainder_ sign_ trunc_"""
INIT_OPS = frozenset(_INIT_OP_NAMES.split())

INITIALISERS = frozenset(
    f for name, f in vars(nn.init).items() if name.endswith("_") and not name.startswith("_") and callable(f)
)


_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})
_INTENDED = "_slimtorch_intended_device"


class _SkipMetaInit(TorchFunctionMode):
    """Return a meta tensor untouched from the value-only in-place ops above, and keep it on meta when the
    constructor moves it (a copy "out of meta" has no data to copy)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return _stay_on_meta(func, args[0], args[1:], kwargs)
        if getattr(func, "__name__", "") in INIT_OPS or func in INITIALISERS:
            # torch.nn.init passes its tensor as a keyword to __torch_function__
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def _stay_on_meta(func, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    if func is torch.Tensor.to:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)  # Module.to's own parser
    elif func is torch.Tensor.cuda:
        index = args[0] if args else kwargs.get("device")
        device, dtype = (
            torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda"),
            None,
        )
    else:
        device, dtype = torch.device("cpu"), None
    moved = tensor if dtype is None or dtype == tensor.dtype else tensor.to(dtype)
    if device is not None and device.type != "meta":
        for each in (tensor, moved):  # Module._apply keeps the parameter object and swaps its .data
            setattr(each, _INTENDED, device)
    return moved


def intended_device(tensor: torch.Tensor) -> torch.device | None:
    """Where the constructor sent a meta tensor (``.to(device)``, ``.cuda()``); None: it did not say.

    Example:
        >>> with parameters_on_meta():
        ...     layer = nn.Linear(2, 2).to("cpu")
        >>> layer.weight.is_meta, intended_device(layer.weight)
        (True, device(type='cpu'))
    """
    return getattr(tensor, _INTENDED, None)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside this context every parameter a module registers is put on the meta device.

    Example:
        >>> with parameters_on_meta():
        ...     layer = nn.Linear(4096, 4096)
        >>> layer.weight.device
        device(type='meta')
    """
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = meta = _like(param, param.to("meta"))
            if param.device.type != "cpu":  # created on an accelerator: that is where it belongs
                setattr(meta, _INTENDED, param.device)

    # Patching a class attribute is process-wide: one build at a time, restored whatever happens.
    with _lock, _hf_init_of_state_only():
        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        try:
            with _SkipMetaInit():
                yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _hf_init_of_state_only() -> Iterator[None]:
    """Hugging Face's weight initialisation (``post_init``) visits only the modules it can change.

    transformers calls ``_init_weights`` on every module after construction (BERT-base: 228 modules, 3 ms of
    isinstance chains and config lookups). A module whose subtree holds nothing but parameters on meta has
    nothing that call could change: every write would land on meta. A subtree with a buffer, a tensor
    attribute or a real parameter is initialised as transformers does, for ``_init_weights`` is where some
    models fill their non-persistent buffers (transformers 5 re-fills BERT's ``position_ids`` there).
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling, "PreTrainedModel", None)
    original = getattr(pretrained, "_initialize_weights", None)
    if pretrained is None or original is None:
        yield
        return
    only_meta: dict[int, tuple[nn.Module, bool]] = {}  # children are visited first: one pass in all

    def initialize_state(self: nn.Module, module: nn.Module, *args: object, **kwargs: object) -> None:
        if _only_meta_parameters(module, only_meta):
            # as transformers marks a module it initialised (torch types Module.__setattr__ for tensors and
            # modules only; any other value is set as a plain attribute)
            module._is_hf_initialized = True  # type: ignore[assignment]
            return
        original(self, module, *args, **kwargs)

    pretrained._initialize_weights = initialize_state
    try:
        yield
    finally:
        pretrained._initialize_weights = original


def _only_meta_parameters(module: nn.Module, known: dict[int, tuple[nn.Module, bool]]) -> bool:
    """Whether ``module`` and everything under it hold only parameters on meta (memoised in ``known`` by
    identity, the module kept with its answer: a module class may define ``__eq__``, and a freed one's id
    could come back)."""
    if id(module) in known:
        return known[id(module)][1]
    found = (
        not any(b is not None for b in module._buffers.values())
        and all(p is None or p.is_meta for p in module._parameters.values())
        and not _holds_tensor_attributes(module)
        and all(_only_meta_parameters(child, known) for child in module._modules.values() if child)
    )
    known[id(module)] = (module, found)
    return found


def _like(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """``data`` as a parameter of ``param``'s class where that class takes (data, requires_grad)."""
    if type(param) is not nn.Parameter:
        with contextlib.suppress(TypeError):
            return type(param)(data, requires_grad=param.requires_grad)
    return nn.Parameter(data, requires_grad=param.requires_grad)


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """Call ``factory()`` with its parameters on the meta device (no RAM, no random init).

    Example:
        >>> model = build_on_meta(lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
        >>> model[0].weight.is_meta, model[1].running_mean.is_meta
        (True, False)
    """
    with parameters_on_meta():
        model = factory()
    if not isinstance(model, nn.Module):
        raise SlimtorchError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(factory: Callable[[], nn.Module]) -> tuple[nn.Module, str | None]:
    """:func:`build_on_meta` where the constructor allows it, else a normal build and a note saying why.

    A constructor that reads its weights' values (``float(w.max())``, a buffer computed from them) fails
    on meta or leaves a meta tensor that no checkpoint fills; built normally, it costs RAM and an init
    but works. A factory that fails both ways raises its own error.

    Example:
        >>> model, note = build_model(lambda: nn.Linear(2, 2))
        >>> model.weight.is_meta, note
        (True, None)
    """
    try:
        model = build_on_meta(factory)
    except SlimtorchError:
        raise
    except Exception as exc:  # any failure on meta is retried for real: a real bug raises again there
        lines = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {lines[0] if lines else ''}"
        return _build_normally(
            factory
        ), f"built with initialised weights: its constructor fails on meta ({why})"
    unfilled = _meta_no_file_fills(model)
    if unfilled is None:
        return model, None
    note = f"built with initialised weights: its constructor computes {unfilled!r} from weights on meta"
    return _build_normally(factory), note


def _build_normally(factory: Callable[[], nn.Module]) -> nn.Module:
    model = factory()
    if not isinstance(model, nn.Module):
        raise SlimtorchError(f"the model factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _meta_no_file_fills(model: nn.Module) -> str | None:
    """A meta tensor that a checkpoint never holds (a non-persistent buffer, a plain tensor attribute)."""
    for prefix, module in model.named_modules():
        computed = module._non_persistent_buffers_set
        owned = [(a, b) for a, b in module._buffers.items() if a in computed] if computed else []
        if _holds_tensor_attributes(module):
            owned += [(a, v) for a, v in vars(module).items() if isinstance(v, torch.Tensor)]
        for attr, tensor in owned:
            if tensor is not None and tensor.is_meta:
                return f"{prefix}.{attr}" if prefix else attr
    return None


def _holds_tensor_attributes(module: nn.Module) -> bool:
    """Whether a plain attribute of ``module`` is a tensor. A module's attributes rarely are: their few
    types are asked, not each value (an isinstance against torch.Tensor takes 120 ns; BERT-base's 228
    modules hold 4,600 attributes)."""
    return any(issubclass(kind, torch.Tensor) for kind in set(map(type, vars(module).values())))
