"""Which tensor storages are alive at every moment of a step, recorded as every op runs.

:class:`StorageTimeline` is a dispatch mode: each aten op's outputs are looked at, a storage seen for the
first time is an allocation, and a weak reference on every tensor that uses it frees it when the last of
them dies (PyTorch keeps a tensor's Python object alive as long as C++ holds the tensor, so tensors saved
for backward count until backward releases them). It works the same on real tensors and on fake ones
(``FakeTensorMode``), which is what lets :func:`slimtorch.memory.estimate` run a step of a model larger
than RAM: fake tensors have shapes and storages, no data.

A timeline may hold several steps of a training loop (:meth:`StorageTimeline.begin_step`): storages
alive from one step to the next (the optimizer's state) stay counted, and each step's peak, phases and
curve are read from its own stretch of events.

What it cannot see: scratch memory an op allocates and frees inside its own kernel (a convolution's
workspace: ``scratch_sizes`` names the blocks known, kept apart from the live bytes for the resident-memory
model), and anything that is not a tensor.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Event:
    key: int
    nbytes: int
    """positive: allocated; negative: freed"""
    phase: str
    module: str


@dataclass
class Peak:
    """The largest total of live bytes, where it happened, and which storages made it up."""

    bytes: int = 0
    phase: str = ""
    module: str = ""
    live: dict[int, int] = field(default_factory=dict)
    """storage key -> bytes, at the peak"""


class StorageTimeline(TorchDispatchMode):
    """Record storage allocations and frees of every op run inside it; ``rounding`` is the allocator's
    granularity (512 bytes for CUDA's caching allocator, 1 for the CPU)."""

    def __init__(self, rounding: int = 1) -> None:
        super().__init__()
        self.rounding = rounding
        self.events: list[Event] = []
        self.live: dict[int, int] = {}
        """storage key -> bytes, for the storages alive now"""
        self._users: dict[int, int] = {}
        # A storage's address is reused once it is freed: each allocation gets a key of its own.
        self._keys: dict[int, int] = {}  # address -> key, while alive
        self._addresses: dict[int, int] = {}  # key -> address
        self.current = 0
        self.phase = "setup"
        self.modules: list[str] = []
        self.starts: list[int] = [0]
        """the index in ``events`` where each step begins (the first step's setup included)"""
        self.step_phase_peaks: list[dict[str, int]] = [{}]
        """per step: the highest live bytes within each phase"""
        self.saved: dict[int, str] = {}
        """storages saved for backward -> the module that saved them"""
        self.true_sizes: Callable[[Any, tuple, dict], dict[int, int]] | None = None
        """(op, args, kwargs) -> {output index: true bytes}, for outputs whose own size is wrong (a fake
        tensor's, where a meta function leaves a workspace out)"""
        self.scratch_sizes: Callable[[Any, tuple, dict, Any], tuple[int, ...]] | None = None
        """(op, args, kwargs, outputs) -> the blocks its kernel allocates and frees inside itself, which no
        tensor shows, in order around its outputs (:func:`slimtorch.memory.heap.kernel_scratch`); recorded
        in ``scratch``"""
        self.scratch: list[tuple[int, int, tuple[int, ...]]] = []
        """(index in ``events`` where an op's outputs begin, where they end, its scratch program)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = self.true_sizes(func, args, kwargs or {}) if self.true_sizes else {}
        start = len(self.events)
        for index, value in enumerate(tree_flatten(out)[0]):
            if isinstance(value, torch.Tensor):
                self.track(value, sizes.get(index))
        blocks = self.scratch_sizes(func, args, kwargs or {}, out) if self.scratch_sizes else ()
        if blocks:
            self.scratch.append((start, len(self.events), blocks))
        return out

    def key_of(self, tensor: torch.Tensor) -> int | None:
        """The key of ``tensor``'s storage, if it is one this timeline saw allocated and still alive."""
        return self._keys.get(tensor.untyped_storage()._cdata)

    def track(self, tensor: torch.Tensor, nbytes: int | None = None) -> int:
        """Count ``tensor``'s storage (of ``nbytes``, if its own size is not the true one) as alive until
        its last tensor dies; returns the storage's key."""
        storage = tensor.untyped_storage()
        address = storage._cdata
        key = self._keys.get(address)
        if key is None:
            key = self._keys[address] = len(self._addresses)
            self._addresses[key] = address
            nbytes = storage.nbytes() if nbytes is None else nbytes
            nbytes = -(-nbytes // self.rounding) * self.rounding
            self.live[key] = nbytes
            self._users[key] = 0
            self.current += nbytes
            self.events.append(Event(key, nbytes, self.phase, self.module))
            peaks = self.step_phase_peaks[-1]
            if self.current > peaks.get(self.phase, 0):
                peaks[self.phase] = self.current
        self._users[key] += 1
        weakref.finalize(tensor, self._release, key)
        return key

    def _release(self, key: int) -> None:
        self._users[key] -= 1
        if self._users[key] == 0:
            nbytes = self.live.pop(key)
            del self._users[key]
            del self._keys[self._addresses[key]]
            self.current -= nbytes
            self.events.append(Event(key, -nbytes, self.phase, self.module))

    @property
    def module(self) -> str:
        return self.modules[-1] if self.modules else ""

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        self.phase = phase
        self.step_phase_peaks[-1].setdefault(phase, self.current)
        yield

    def begin_step(self) -> None:
        """Start the next step of the loop: what follows is counted in its stretch of events."""
        self.starts.append(len(self.events))
        self.step_phase_peaks.append({})

    def window(self, step: int = -1) -> range:
        """The indices in ``events`` of step ``step`` (the last by default)."""
        step = step % len(self.starts)
        end = self.starts[step + 1] if step + 1 < len(self.starts) else len(self.events)
        return range(self.starts[step], end)

    def peak(self, phase: str | None = None, step: int = -1) -> Peak:
        """Replay the events: the moment of step ``step`` (the last by default) with the most live bytes
        (within ``phase``, if given), and what was alive then."""
        live: dict[int, int] = {}
        current = best = 0
        best_at = -1
        window = self.window(step)
        for index, event in enumerate(self.events[: window.stop]):
            current += event.nbytes
            if index in window and current > best and (phase is None or event.phase == phase):
                best, best_at = current, index
        for event in self.events[: best_at + 1]:
            if event.nbytes > 0:
                live[event.key] = event.nbytes
            else:
                live.pop(event.key, None)
        at = self.events[best_at] if best_at >= 0 else Event(0, 0, "", "")
        return Peak(best, at.phase, at.module, live)

    def watch_saved(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Hooks that note every tensor autograd saves for backward (the activations), and where."""

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = self.key_of(tensor)
            if key is not None:
                self.saved.setdefault(key, self.module)
            # Kept detached: the tensor itself, when an op saves its own output (tanh, sigmoid), would
            # hold its grad_fn that holds it, a cycle no collector frees, so a branch backward never
            # reaches (a pooler the loss ignores) would stay alive into the next step.
            return tensor.detach()

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
