"""Several int8-dynamic layers reading one input quantize it once, and multiply it once.

Attention's query, key and value (and Llama's gate and up projections) read the same tensor. In the modules
known to change no tensor in place while those layers run (:data:`SHARING_PARENTS`), hooks open a scope
around each call: eagerly, :data:`slimtorch.quant.kernels.SHARED_INPUTS` keeps the last input's codes for
the scope; in a compiled graph, :data:`TRACED_SCOPES` keeps them as values of the graph while dynamo
traces (:func:`traced_codes`), so the graph holds one quantization per input.

Eagerly, layers seen reading one input (:class:`Siblings` learns which, from the parent's calls) then run
as one product: their weights side by side in one packed matrix, one oneDNN call, one epilogue in place,
each layer's output a view of its columns (what the parents' reshapes take as it is). The int32 product
is exact and each output column is scaled as its layer alone would scale it, so the outputs are the same
floats. On an AVX2 EPYC at 128 rows, oneDNN's product of 1152 columns took 820 us against 315 for one of
384 (12 weights called in turn), each call also paying oneDNN's fixed cost (about 40 us) and ours once
instead of three times.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from slimtorch.quant import kernels

JointRun = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]
"""A group's joint run: ``(x, x2d) -> [each layer's output]`` (``Int8DynamicLinear.joint_run``)."""


class SharingLayer(Protocol):
    """What this module reads of an int8-dynamic layer: ``Int8DynamicLinear``, whose module imports this
    one (named here, it would make the two a circle)."""

    _run_of: dict[tuple, Any]

    def prepared_source(self) -> tuple: ...

    @staticmethod
    def joint_run(layers: tuple[Any, ...], kernel: str) -> JointRun | None: ...


SHARING_PARENTS = frozenset(
    {
        "transformers.models.bert.modeling_bert.BertSelfAttention",
        "transformers.models.bert.modeling_bert.BertCrossAttention",
        "transformers.models.llama.modeling_llama.LlamaAttention",
        "transformers.models.llama.modeling_llama.LlamaMLP",
    }
)
"""Modules whose forward hands one tensor to several of their Linears and changes no tensor in place
while those run (read in transformers 5.23): inside one call of theirs, the layers share that tensor's codes
under ``torch.inference_mode`` too, where no version counter would show such a change. Others share them
under ``no_grad`` only."""


def share_input_codes(model: nn.Module) -> int:
    """Let the int8-dynamic layers (``SHARES_INPUT_CODES``) under each module of :data:`SHARING_PARENTS`
    share their input's codes within one call of it, under any grad mode (hooks that open and close a
    scope: :class:`~slimtorch.quant.kernels.SharedInputCodes` eagerly, :data:`TRACED_SCOPES` while dynamo
    traces); how many modules were set up. Idempotent.

    Example:
        >>> share_input_codes(bert)  # doctest: +SKIP
        12
    """
    count = 0
    for parent in model.modules():
        kind = type(parent)
        if f"{kind.__module__}.{kind.__qualname__}" not in SHARING_PARENTS:
            continue
        if sum(getattr(child, "SHARES_INPUT_CODES", False) for child in parent.children()) < 2:
            continue
        if _open_sharing not in parent._forward_pre_hooks.values():
            parent.register_forward_pre_hook(_open_sharing)
            parent.register_forward_hook(_close_sharing, always_call=True)  # closed on errors too
        count += 1
    return count


def _open_sharing(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():
        TRACED_SCOPES.append({})
    else:
        kernels.SHARED_INPUTS.open()
        siblings = _SIBLINGS.get(module)
        if siblings is None:
            siblings = _SIBLINGS[module] = Siblings()
        _calls().append(_Call(siblings))


def _close_sharing(module: nn.Module, args: tuple, output: Any) -> None:
    if torch.compiler.is_compiling():
        if TRACED_SCOPES:
            TRACED_SCOPES.pop()
    else:
        kernels.SHARED_INPUTS.close()
        calls = _calls()
        if calls:
            calls.pop().close()


class Siblings:
    """Which int8-dynamic children of one sharing parent read one input, learned from its calls: once two
    calls in a row have grouped them alike (by the identity of the tensor each layer got), each group of
    two or more runs as one product (:meth:`_Call.output`). A group whose members stop reading one input
    (one is not called, or gets another tensor) is parted for good: its layers run alone again, as right
    as before, never given another's output."""

    SETTLE = 2  # calls grouping the layers alike before the groups are adopted

    def __init__(self) -> None:
        self.adopted = False
        self.group_of: dict[SharingLayer, tuple[SharingLayer, ...]] = {}
        self._last: frozenset[tuple[SharingLayer, ...]] | None = None
        self._seen = 0
        # (group, kernel) -> (what the joint state was made from, the joint run or None)
        self._runs: dict[tuple[tuple[SharingLayer, ...], str], tuple[tuple, JointRun | None]] = {}

    def learn(self, inputs: dict[SharingLayer, torch.Tensor]) -> None:
        """One call's layers grouped by the tensor each got; adopted after :data:`SETTLE` alike."""
        by_input: dict[int, list[SharingLayer]] = {}
        for layer, x in inputs.items():
            by_input.setdefault(id(x), []).append(layer)
        groups = frozenset(tuple(layers) for layers in by_input.values() if len(layers) > 1)
        self._seen = self._seen + 1 if groups == self._last else 1
        self._last = groups
        if self._seen >= self.SETTLE:
            self.adopted = True
            self.group_of = {layer: group for group in groups for layer in group}

    def part(self, group: tuple[SharingLayer, ...]) -> None:
        for layer in group:
            self.group_of.pop(layer, None)
        for key in [key for key in self._runs if key[0] == group]:
            del self._runs[key]

    def run_for(self, group: tuple[SharingLayer, ...], known: tuple, kernel: str) -> JointRun | None:
        """The joint run of ``group`` where every member chose ``kernel`` for this key and the kernel can
        run jointly (``joint_run``); else ``None`` (each runs alone this call)."""
        for layer in group:
            chosen = layer._run_of.get(known)
            if chosen is None or chosen[2] != kernel:
                return None
        source = tuple(layer.prepared_source() for layer in group)
        made = self._runs.get((group, kernel))
        if made is None or made[0] != source:  # a kernel that cannot run jointly is remembered too
            made = self._runs[group, kernel] = (source, type(group[0]).joint_run(group, kernel))
        return made[1]


class _Call:
    """One call of a sharing parent, eagerly: what its layers got (while :class:`Siblings` learns) and the
    joint outputs not yet handed out."""

    __slots__ = ("inputs", "pending", "siblings")

    def __init__(self, siblings: Siblings) -> None:
        self.siblings = siblings
        self.inputs: dict[SharingLayer, torch.Tensor] = {}
        self.pending: dict[
            tuple[SharingLayer, ...], tuple[torch.Tensor, dict[SharingLayer, torch.Tensor]]
        ] = {}

    def output(
        self, layer: SharingLayer, x: torch.Tensor, x2d: torch.Tensor, known: tuple, kernel: str
    ) -> torch.Tensor | None:
        """``layer``'s output (rows x out_features) from its group's joint product of ``x``, made by the
        first member called; ``None`` where the layer runs alone."""
        siblings = self.siblings
        group = siblings.group_of.get(layer)
        if group is None:
            if not siblings.adopted:
                self.inputs.setdefault(layer, x)
            return None
        pending = self.pending.get(group)
        if pending is None or pending[0] is not x:
            if pending is not None and pending[1]:  # outputs for another input left: not one input
                siblings.part(group)
                return None
            run = siblings.run_for(group, known, kernel)
            if run is None:
                return None
            pending = self.pending[group] = (x, dict(zip(group, run(x, x2d), strict=True)))
        return pending[1].pop(layer, None)  # None the second time: a layer called twice runs alone

    def close(self) -> None:
        siblings = self.siblings
        for group, (_, left) in self.pending.items():
            if left:  # a member was not called with the group's input
                siblings.part(group)
        if not siblings.adopted and self.inputs:
            siblings.learn(self.inputs)


_SIBLINGS: weakref.WeakKeyDictionary[nn.Module, Siblings] = weakref.WeakKeyDictionary()
"""Each sharing parent's :class:`Siblings`, kept beside it (not in it: a copy or a pickle of the model
starts learning anew, and no state of ours lands in a user's pickle)."""
_LOCAL = threading.local()


def _calls() -> list[_Call]:
    calls = getattr(_LOCAL, "calls", None)
    if calls is None:
        calls = _LOCAL.calls = []
    return calls


def current_call() -> _Call | None:
    """The innermost sharing parent's call on this thread, eagerly; ``None`` outside any."""
    calls = getattr(_LOCAL, "calls", None)
    return calls[-1] if calls else None


TRACED_SCOPES: list[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
"""The sharing scopes open while dynamo traces (:data:`kernels.SHARED_INPUTS`' scopes in a compiled graph),
innermost last: per scope and kind of codes (``uint8``, ``int8``, ``uint7``), the last input quantized, its
codes and row scales, all values of the graph. Dynamo replays what a graph did to this list after the graph
runs: each scope opens and closes within one call, so the list is empty between calls."""


def traced_codes(x: torch.Tensor, x2d: torch.Tensor, codes: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``'s row codes in a compiled graph: one ``slimtorch::quantize_rows`` per input, shared by the
    layers of one sharing scope (query, key and value read the same input: 2 operators fewer)."""
    scope = TRACED_SCOPES[-1] if TRACED_SCOPES else None
    hit = None if scope is None else scope.get(codes)
    if hit is not None and hit[0] is x:
        return hit[1], hit[2]
    values, row_scale = kernels.quantize_rows_op(x2d, codes)
    if scope is not None:
        scope[codes] = (x, values, row_scale)
    return values, row_scale
