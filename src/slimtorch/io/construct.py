"""Build a model without paying for its weights: parameters on the meta device, buffers real.

A model's constructor allocates every parameter and fills it with random numbers, which a loader then
overwrites: for a 1 GiB model that is 1 GiB of RAM and seconds of ``kaiming_uniform_`` for nothing.
:func:`build_on_meta` runs the constructor with :meth:`torch.nn.Module.register_parameter` moving each new
parameter to the meta device, so the initialisers that follow see meta tensors and do nothing.

Buffers stay real on purpose. Non-persistent buffers (``position_ids``, rotary ``inv_freq``, causal masks)
are not in any checkpoint: the constructor is the only place their values come from.
"""

from __future__ import annotations

import contextlib
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


class _SkipMetaInit(TorchFunctionMode):
    """Return a meta tensor untouched from the value-only in-place ops above."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in INIT_OPS or func in INITIALISERS:
            # torch.nn.init passes its tensor as a keyword to __torch_function__
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


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

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = _like(param, param.to("meta"))

    # Patching a class attribute is process-wide: one build at a time, restored whatever happens.
    with _lock:
        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        try:
            with _SkipMetaInit():
                yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]


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
