"""Checksums verified off the critical path: a load maps the file's bytes into the model and hands the
CRC-32 checks of those bytes to :class:`Verification`, which runs them on threads of its own.

Hashing cannot keep up with a mapped load (a warm 1 GiB file maps in milliseconds, its CRC takes 0.1 s a
core), so a verified load at the speed of an unverified one has to verify beside the caller's own work:

- ``"eager"`` waits for every check before ``load_model`` returns (the calling thread joins in);
- ``"before-use"`` returns at once. The checks run in the order the model's modules are registered (about
  the order a forward uses them), chunks of several parts at a time, and a forward pre-hook on each module
  waits for its own tensors' checks, running them itself when no thread has started them yet, and raises
  the checksum error in the forward that would use a bad tensor. Once everything has passed, the hooks
  remove themselves. Steps that read weights without a forward wait through
  :func:`slimtorch.format.pending.wait_for_checks`, which finds these checks by address.

Tensors that are decoded or copied never come here: their parts are checked before the bytes are used,
on the loader's pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slimtorch.errors import SlimtorchError
from slimtorch.format import layout, pending

COLD_READERS = 4
"""Check threads on a cold page cache at least (each mostly waits on its read)."""

Check = Callable[[], int]
"""Reads one chunk, returns its bytes, raises FormatError on a mismatch (``TensorSource.checks``)."""


@dataclass(eq=False)
class _Group:
    """The checks of one tensor: done when every check has passed or one has failed."""

    checks: list[Check]
    modules: list[nn.Module]
    tensor: torch.Tensor
    order: int
    claimed: int = 0
    running: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def exhausted(self) -> bool:
        return self.claimed == len(self.checks) or self.error is not None


@dataclass
class VerifyStats:
    """What the checks cost; filled in as they run."""

    checked_bytes: int = 0
    check_s: float = 0.0
    """Seconds spent hashing, summed over the threads."""
    wall_s: float = 0.0
    """From the start of the checks to the last one done."""
    waited_s: float = 0.0
    """Seconds forwards and waits were blocked on checks."""
    after_return_s: float = 0.0
    """How long the checks went on after the load returned (0: done before it)."""


class Verification:
    """The checks of one load: :meth:`add` each tensor's, :meth:`start`, then :meth:`wait` (or let each
    module's forward wait for its own).

    Example:
        >>> checks = Verification(threads=2)
        >>> checks.add([lambda: 4], torch.zeros(1), [], order=0)
        >>> checks.start(hooks=False); checks.wait(); checks.stats.checked_bytes
        4
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.stats = VerifyStats()
        self._groups: list[_Group] = []
        self._lock = threading.Lock()
        self._cursor = 0
        self._open = 0
        self._started = 0.0
        self._returned: float | None = None
        self._finished = threading.Event()
        self._hooks: list[tuple[RemovableHandle, int]] = []
        self._token: int | None = None
        self._on_finish: list[Callable[[], None]] = []

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def add(
        self, checks: Sequence[Check], tensor: torch.Tensor, modules: list[nn.Module], order: int
    ) -> None:
        """The checks of ``tensor`` (mapped from the file, as the model holds it), which ``modules`` use;
        they run by ``order`` (the tensor's place in the model)."""
        if checks:
            self._groups.append(_Group(list(checks), modules, tensor, order))

    def start(self, *, hooks: bool, on_finish: Callable[[], None] | None = None) -> None:
        """Start the threads; with ``hooks``, each module waits in its forward for its own tensors."""
        self._started = time.perf_counter()
        self._groups.sort(key=lambda group: group.order)
        self._on_finish += [on_finish] if on_finish else []
        self._open = len(self._groups)
        if not self._groups:
            self._finish()
            return
        self._token = pending.hold(_ranges(self._groups), self)
        if hooks:
            self._hook_modules()
        workers = min(_workers(self.threads, self._groups), sum(len(g.checks) for g in self._groups))
        for i in range(workers):
            threading.Thread(target=self._work, args=(i == 0,), name="slimtorch-verify").start()

    def returned(self) -> None:
        """The load returns now: what runs from here on overlaps the caller's work."""
        self._returned = time.perf_counter()

    def wait(self) -> None:
        """Block until every check is done, running unstarted ones on this thread; raise the first
        mismatch (in the model's order)."""
        failed = self._wait_for(self._groups)
        self._finished.wait()  # the last check's thread may still be removing the hooks
        for callback in self._on_finish:
            callback()  # again: this wait's own time
        if failed is not None:
            raise failed

    # -- running checks ---------------------------------------------------------------------------------
    def _work(self, read_ahead: bool) -> None:
        if read_ahead:  # queue the reads of every tensor now, in the model's order (cold cache)
            for start, end in _ranges(self._groups):
                layout.read_ahead(start, end - start)
        while (job := self._claim(None)) is not None:
            self._run(*job)

    def _claim(self, group: _Group | None) -> tuple[_Group, Check] | None:
        """The next check nobody runs yet: of ``group``, or (None) the first group in the model's order."""
        with self._lock:
            if group is None:
                while self._cursor < len(self._groups) and self._groups[self._cursor].exhausted:
                    self._cursor += 1
                if self._cursor == len(self._groups):
                    return None
                group = self._groups[self._cursor]
            elif group.exhausted:
                return None
            group.claimed += 1
            group.running += 1
            return group, group.checks[group.claimed - 1]

    def _run(self, group: _Group, check: Check) -> None:
        clock = time.perf_counter()
        error, checked = None, 0
        try:
            checked = check()
        except Exception as exc:  # a mismatch (FormatError), or a read that failed: either way not verified
            error = exc
        with self._lock:
            self.stats.check_s += time.perf_counter() - clock
            self.stats.checked_bytes += checked
            group.running -= 1
            if error is not None and group.error is None:
                group.error = error
            closed = group.exhausted and group.running == 0 and not group.done.is_set()
            if closed:
                group.done.set()
                self._open -= 1
            last = closed and self._open == 0
        if last:
            self._finish()

    def _wait_for(self, groups: Sequence[_Group]) -> BaseException | None:
        """Wait until ``groups`` are done, running their unstarted checks here; their first error."""
        clock = time.perf_counter()
        for group in groups:
            while (job := self._claim(group)) is not None:
                self._run(*job)
            group.done.wait()
        with self._lock:
            self.stats.waited_s += time.perf_counter() - clock
        return next((g.error for g in groups if g.error is not None), None)

    def _finish(self) -> None:
        """Every check is done: drop the hooks (kept on modules with a failed tensor, so their forward
        keeps raising), stop counting these tensors as pending, and tell the report."""
        now = time.perf_counter()
        self.stats.wall_s = now - self._started
        self.stats.after_return_s = max(0.0, now - self._returned) if self._returned is not None else 0.0
        failed = {id(m) for g in self._groups if g.error is not None for m in g.modules}
        kept = []
        for handle, module_id in self._hooks:
            if module_id in failed:
                kept.append((handle, module_id))
            else:
                handle.remove()
        self._hooks = kept
        if self._token is not None and not failed:
            pending.release(self._token)
        for callback in self._on_finish:
            callback()
        self._finished.set()

    # -- waiting in forwards ----------------------------------------------------------------------------
    def _hook_modules(self) -> None:
        by_module: dict[int, tuple[nn.Module, list[_Group]]] = {}
        for group in self._groups:
            for module in group.modules:
                by_module.setdefault(id(module), (module, []))[1].append(group)
        for module_id, (module, groups) in by_module.items():
            handle = module.register_forward_pre_hook(_BeforeForward(self, groups))
            self._hooks.append((handle, module_id))


class _BeforeForward:
    """A module's forward pre-hook: wait for its own tensors' checks and raise a mismatch among them.

    A model holding these hooks refuses to be copied or pickled: the copy would hold bytes nobody checked
    yet, with no hook of its own to check them (and the checks' threads and locks cannot be copied)."""

    def __init__(self, verification: Verification, groups: list[_Group]) -> None:
        self.verification = verification
        self.groups = groups

    def __call__(self, module: nn.Module, args: Any) -> None:
        if all(g.done.is_set() and g.error is None for g in self.groups):
            return
        failed = self.verification._wait_for(self.groups)
        if failed is not None:
            raise failed

    def __reduce__(self) -> Any:
        raise SlimtorchError(
            "this model's checksums are still being verified (load_model(verify='before-use')): call the "
            "load report's wait() before copying or pickling it"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self.__reduce__()


def _workers(threads: int, groups: list[_Group]) -> int:
    """Check threads for a load on ``threads``: on a warm page cache one fewer, the caller's thread being
    the other (an eager load joins in its wait; a forward beside before-use checks pages in the same
    bytes). Measured on 2 cores, 2 GiB: one check thread beside a 1-thread sum adds nothing (0.92x the
    sum alone), two add 1.26x (they compete for the cores). Cold, the threads mostly wait on the disk,
    which serves several reads at once: as many as the parallel read floor uses, COLD_READERS."""
    cold = any(not layout.resident(group.tensor.data_ptr()) for group in groups[:: max(1, len(groups) // 8)])
    return max(threads, COLD_READERS) if cold else max(1, threads - 1)


def _ranges(groups: list[_Group]) -> list[tuple[int, int]]:
    """The bytes of every tensor under check, for :func:`~slimtorch.format.pending.wait_for_checks`."""
    ranges = []
    for group in groups:
        storage = group.tensor.untyped_storage()  # the part's bytes in the file mapping
        if group.tensor.device.type == "cpu" and storage.nbytes():
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges
