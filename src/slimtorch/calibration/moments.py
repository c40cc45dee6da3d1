"""Each watched layer's input moments, gathered while calibration samples run, and the factor of their
inverse that column-by-column weight updates (GPTQ, SparseGPT) read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from slimtorch.graph.layers import is_hf_conv1d

DAMPING = 0.01
"""of the mean diagonal, added to ``X^T X`` before it is inverted: keeps it invertible (GPTQ's and
SparseGPT's value)"""


@contextlib.contextmanager
def wrapping_forward(
    module: nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    """While the block runs, ``module(...)`` and ``module.forward(...)`` call ``wrap(forward)``; the
    module's own ``forward`` (an instance attribute some libraries set, or its class's) is back after.
    Unlike a hook, nothing that looks at the module's hooks can tell."""
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = wrap(module.forward)
    try:
        yield
    finally:
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = previous


class InputMoments:
    """The inputs of each watched layer, summed while ``recording``: ``X^T X`` (``full``) or only the
    squares of each input column (its diagonal, what Wanda reads: ``in`` numbers, not ``in**2``), and the
    row count. A row is one input vector (a token), whatever the batch and sequence dimensions.

    Example:
        >>> layer = nn.Linear(4, 2)
        >>> moments = InputMoments({"fc": layer}, full=False)
        >>> with moments.recording():
        ...     _ = layer(torch.ones(3, 4))
        >>> moments.rows["fc"], moments.column_norms("fc").tolist()
        (3, [1.0, 1.0, 1.0, 1.0])
    """

    def __init__(self, layers: dict[str, nn.Module], full: bool = True) -> None:
        self.layers = layers
        self.full = full
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[InputMoments]:
        """Inside, each call of a watched layer adds its input. The layers' forwards are wrapped, not
        hooked: a hook would change what some models run (``nn.TransformerEncoderLayer`` leaves its fused
        path when any of its modules has one), and quantization's pass finds the weights a model reads
        itself in the same run (``slimtorch.quant.readers``)."""
        with ExitStack() as stack:
            for name, layer in self.layers.items():
                stack.enter_context(wrapping_forward(layer, self._recorded(name)))
            yield self

    def _recorded(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def record(x: torch.Tensor) -> None:
            x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
            product = x.t() @ x if self.full else x.square().sum(dim=0)
            self.sums[name] = self.sums[name] + product if name in self.sums else product
            self.rows[name] = self.rows.get(name, 0) + x.shape[0]

        def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                record(args[0] if args else next(iter(kwargs.values())))
                return forward(*args, **kwargs)

            return call

        return wrap

    def hessian(self, name: str) -> torch.Tensor | None:
        """``X^T X / n`` of the layer's inputs (None: the layer never ran during calibration, or only the
        diagonal was gathered)."""
        if name not in self.sums or not self.full:
            return None
        return self.sums[name] / max(self.rows[name], 1)

    def column_norms(self, name: str) -> torch.Tensor | None:
        """The root mean square of each input column over every row seen (None: the layer never ran)."""
        if name not in self.sums:
            return None
        squares = torch.diagonal(self.sums[name]) if self.full else self.sums[name]
        return (squares / max(self.rows[name], 1)).sqrt()


def out_in(module: nn.Module) -> torch.Tensor:
    """The layer's weight as an (outputs, inputs) matrix, a view of it: Hugging Face's ``Conv1D`` (GPT-2)
    stores (inputs, outputs), so its view is the transpose; writing the view writes the weight."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.t() if is_hf_conv1d(module) else weight


def inverse_cholesky(hessian: torch.Tensor) -> torch.Tensor | None:
    """The upper Cholesky factor of ``(H + damping)^-1`` (what column updates read), with dead inputs
    (always zero: ``H[i, i] == 0``) given a 1 on the diagonal; ``hessian`` is changed in place. None when
    ``H`` cannot be factored even with a thousand times the damping."""
    dead = torch.diag(hessian) == 0
    hessian[dead, dead] = 1
    damping = DAMPING * float(torch.diag(hessian).mean())
    for _ in range(4):  # more damping if H is too ill-conditioned to factor
        try:
            lower = torch.linalg.cholesky(hessian + damping * torch.eye(len(hessian)))
            inverse = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inverse, upper=True)
        except RuntimeError:
            damping *= 10
    return None
