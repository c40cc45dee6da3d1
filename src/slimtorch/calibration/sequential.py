"""Calibration one block at a time, for a model built of repeated blocks (a language model's decoder
layers, a ViT's encoder layers).

Wanda, SparseGPT and GPTQ change each layer's weights from what its inputs look like. Gathered in one
pass over the whole model, every layer's inputs come from the original layers before it, and the moments
of every layer are held at once (``X^T X`` of a 1B Llama's layers: 5.6 GB). :func:`blockwise` runs the
samples up to the first block and keeps what enters it; then for each block it gathers the moments of
that block's layers only, lets the caller change them, and runs the changed block to make the next
block's inputs. Memory holds one block's moments and the samples' activations at one depth; each block is
chosen against the inputs it will really see once the blocks before it are changed (the SparseGPT paper's
sequential order).

The blocks are found, not named: the ``nn.ModuleList`` whose children share one class and hold most of
the layers to calibrate. That one block's output is the next block's input is checked on the first sample
before it is relied on; a model where it is not (a block that also returns its attention weights first,
a stack with something between its blocks) is calibrated in one pass instead, and the note says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slimtorch.calibration.moments import InputMoments, wrapping_forward
from slimtorch.errors import SlimtorchError
from slimtorch.graph.capture import as_args, without_cache

Sample = Any
"""a model input: a tensor, a tuple of positional arguments, or a dict of keyword arguments"""


@dataclass(frozen=True)
class Stage:
    """One step of :func:`blockwise`: the layers calibrated together, with their input moments."""

    name: str
    """the block (``model.layers.3``), or ``"the rest of the model"``"""
    layers: dict[str, nn.Module]
    moments: InputMoments


def call(model: nn.Module, sample: Sample) -> Any:
    """``model`` on one sample, a Hugging Face decoder without its key/value cache (calibration runs each
    sample once; a cache would only hold memory)."""
    if isinstance(sample, dict):
        return model(**without_cache(model, dict(sample)))
    return model(*as_args(sample), **without_cache(model, {}))


def blockwise(
    model: nn.Module,
    layers: dict[str, nn.Module],
    samples: Iterable[Sample],
    change: Callable[[Stage], None],
    *,
    full: bool = True,
    say: Callable[[str], None] | None = None,
) -> list[str]:
    """Calibrate ``layers`` (by their names in ``model``) on ``samples``, one block at a time where the
    model is a stack of blocks: for each stage, ``change(stage)`` gets the stage's layers with their input
    moments (``full``: ``X^T X``; else the squares of each input column) and changes them in place; the
    next stage's inputs come from the changed ones. Layers outside the blocks come last, in one pass of
    the changed model. Returns notes (how the model was staged, when not block by block); runs without
    gradients, in eval mode (the model's mode is put back)."""
    samples = list(samples)
    if not samples:
        raise SlimtorchError("calibration needs at least one sample input")
    notes: list[str] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            stack = _block_stack(model, layers)
            rest = dict(layers)
            if stack is not None:
                prefix, blocks = stack
                inputs, problem = _block_inputs(model, prefix, blocks, samples)
                if problem is not None:
                    notes.append(
                        f"calibrated in one pass over the whole model, not block by block: {problem}"
                    )
                else:
                    for index, block in enumerate(blocks):
                        where = f"{prefix}.{index}."
                        inside = {name: m for name, m in rest.items() if name.startswith(where)}
                        if inside:
                            if say:
                                say(f"calibrating {where[:-1]} ({len(inside)} layers)")
                            moments = InputMoments(inside, full)
                            with moments.recording():
                                for args, kwargs in inputs:
                                    block(*args, **kwargs)
                            change(Stage(where[:-1], inside, moments))
                        inputs = [
                            (_next_args(args, block(*args, **kwargs)), kwargs) for args, kwargs in inputs
                        ]
                        rest = {name: m for name, m in rest.items() if name not in inside}
            if rest:
                if say:
                    say(f"calibrating {len(rest)} layers in one pass")
                moments = InputMoments(rest, full)
                with moments.recording():
                    for sample in samples:
                        call(model, sample)
                change(
                    Stage("the rest of the model" if len(rest) < len(layers) else "the model", rest, moments)
                )
    finally:
        model.train(was_training)
    return notes


def _block_stack(model: nn.Module, layers: dict[str, nn.Module]) -> tuple[str, list[nn.Module]] | None:
    """The ``nn.ModuleList`` of two or more blocks of one class that holds the most of ``layers``."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        children = list(module)
        if len({type(child) for child in children}) != 1:
            continue
        held = sum(1 for layer in layers if layer.startswith(f"{name}."))
        if held and (best is None or held > best[0]):
            best = (held, name, children)
    return (best[1], best[2]) if best else None


class _Reached(Exception):
    """Raised by a wrapped block: the sample has gone as far as calibration needs."""


def _block_inputs(
    model: nn.Module, prefix: str, blocks: list[nn.Module], samples: list[Sample]
) -> tuple[list[tuple[tuple, dict]], str | None]:
    """What enters the first block for each sample (its positional and keyword arguments), and why the
    stack cannot be run block by block (None: it can). The first sample also records what enters the
    second block, which the first block's output must equal."""
    seen: dict[int, list[tuple[tuple, dict]]] = {0: [], 1: []}
    stop_at = [1]

    def entering(index: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                seen[index].append((args, kwargs))
                if index >= stop_at[0]:
                    raise _Reached
                return forward(*args, **kwargs)

            return run

        return wrap

    with wrapping_forward(blocks[0], entering(0)), wrapping_forward(blocks[1], entering(1)):
        for i, sample in enumerate(samples):
            stop_at[0] = 1 if i == 0 else 0
            with contextlib.suppress(_Reached):
                call(model, sample)
    first = seen[0]
    if len(first) != len(samples):
        raise SlimtorchError(
            f"calibration: {prefix}.0 ran {len(first)} times for {len(samples)} samples; each sample must "
            "run the model's blocks once"
        )
    if not seen[1]:
        return [], f"{prefix}.1 never ran after {prefix}.0"
    args, kwargs = first[0]
    if not args or not isinstance(args[0], torch.Tensor):
        return [], f"{prefix}.0 does not take its hidden states as its first argument"
    made = _next_args(args, blocks[0](*args, **kwargs))[0]
    wanted = seen[1][0][0][0] if seen[1][0][0] else None
    if (
        not isinstance(made, torch.Tensor)
        or not isinstance(wanted, torch.Tensor)
        or made.shape != wanted.shape
    ):
        return [], f"what {prefix}.1 takes is not what {prefix}.0 returns"
    if not torch.allclose(made, wanted, rtol=1e-4, atol=1e-5):
        return [], f"something changes {prefix}.0's output before {prefix}.1 takes it"
    return first, None


def _next_args(args: tuple, output: Any) -> tuple:
    """The next block's positional arguments: this block's hidden states (its output, or the first item of
    a tuple it returns) in place of the first."""
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    return (hidden, *args[1:])
