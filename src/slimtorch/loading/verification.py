"""Checksums verified off the critical path: a load maps the file's bytes into the model and hands the
CRC-32 checks of those bytes to :class:`Verification`, which runs them on threads of its own.

Hashing cannot keep up with a mapped load (a warm 1 GiB file maps in milliseconds, its CRC takes 0.1 s a
core), so a verified load at the speed of an unverified one has to verify beside other work:

- A slim file loaded to the CPU is checked from the moment it is opened (:meth:`Verification.watch`),
  before the model exists: its stored bytes in spans of :data:`SPAN_BYTES` (:data:`COLD_SPAN_BYTES` on a
  cold page cache), one CRC-32 each against the value the recorded chunk CRCs combine to, in file order,
  beside the model's constructor and the load (Python on the calling thread; the CRC releases the
  interpreter lock). On BERT-base most of the file is checked by the time the model is filled, and the
  checking threads have paged the mapping in for the caller. A large file on a warm page cache is
  checked from its end until the load returns, then from its front, side by side with the caller's
  first use (:data:`LARGE_FILE_BYTES`, :meth:`Verification._from_back`); mapped in small pages, from its
  end throughout, its page faults beside the caller's (:data:`SMALL_PAGE_FAULTS_PER_MIB`). A span that
  does not match is checked chunk by chunk, so the error names the corrupt tensor and no other.
- Otherwise (CUDA staging, offload, a model given with real tensors) each mapped tensor's chunks are
  handed over as the model takes it (:meth:`Verification.add`) and checked after the load.

Then ``verify`` says when the caller waits:

- ``"eager"`` waits for every check before ``load_model`` returns (the calling thread joins in on a warm
  page cache, from the other end of the file than the checking threads; on a cold one a single thread
  reads the file in order, which a second reader would slow);
- ``"before-use"`` returns at once. The checks go on in order (file or model order: about the order a
  forward uses the tensors), and a forward pre-hook on each module waits for its own tensors' checks,
  running them itself when no thread has started them yet (warm page cache), and raises the checksum
  error in the forward that would use a bad tensor. Once everything has passed, the hooks remove
  themselves. Steps that read weights without a forward wait through
  :func:`slimtorch.format.pending.wait_for_checks`, which finds these checks by address.

Tensors that are decoded are checked before decoding, each its own parts (on the loader's pool, or the
calling thread); tensors copied from the mapping (a dtype conversion, a file's one tensor given to two
parameters) before the copy is used, under a watched file by waiting for their spans. A load that fails
stops its checks before it raises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from slimtorch.errors import SlimtorchError
from slimtorch.format import layout, pending
from slimtorch.format.source import StoredChunk, TensorSource
from slimtorch.loading import residency
from slimtorch.loading.check_groups import Check, CheckGroup, MappedUse, VerifyStats, error_of, first_error

SMALL_CODED = 1 << 20
"""Coded parts under this many bytes join a file-wide check's spans (:meth:`Verification.watch`)."""
SPAN_BYTES = 256 << 20
"""Bytes one check of a file-wide verification (:meth:`Verification.watch`) covers on a warm page cache:
few checks, for between two the verifying thread takes the interpreter lock back from a constructor
running Python (each time waiting up to the 5 ms switch interval and interrupting it), and few enough
bytes that a first forward waits for little (256 MiB: 10 ms of CRC). BERT-base, verified before use,
until every weight is summed: 78.9 ms in 16 MiB spans (29 checks), 75.1 in 64 MiB (7), 74.2 in 128
MiB (4), on the slower host of an earlier run; here 35.1 ms in 64 MiB, 35.0 in 128, 34.6 in 256 (2),
34.5 in 1 GiB (1); medians of 11 fresh processes each."""
LARGE_FILE_BYTES = 1 << 30
"""A warm file with at least this many bytes to check is checked from its end while it loads, in
:data:`LARGE_SPAN_BYTES` spans (:meth:`Verification._from_back`). A smaller one is mostly checked by the
time its model is built, front first, so that the caller's first reads find the pages mapped in:
checked from the end, BERT-base (418 MiB) ran 1.09-1.12x its unchecked load in 9 runs of the load
benchmark (7 fresh processes each), against 1.00-1.13x in 4 front first (1.05x on average)."""
LARGE_SPAN_BYTES = 32 << 20
"""Spans of a large warm file: small, so that a checking thread busy with a span from the end when the
load returns turns to the front soon after. 2 GiB MLP, verified before use, until every weight is summed,
fresh processes, over the same file's unchecked load, three rounds of 6 at three speeds of the host's
memory: 1.03 / 1.09 / 1.04x in 32 MiB spans, 1.16 / 1.13 / 1.01 in 64, 1.03 / 1.36 / 1.16 in 256, and
1.06 / 1.26 / 1.18 front first in 256 MiB spans (the small files' way)."""
COLD_SPAN_BYTES = 16 << 20
"""The same on a cold page cache (:func:`~slimtorch.loading.residency.cold`), where one thread checks the
spans in file order, and the first forward, or whoever reads the weights, follows right behind it. 2 GiB
MLP, before-use, until every weight is summed, fresh processes on an evicted cache: 16 MiB spans 0.64 s
(the file's readinto floor 0.74 in the same A/B; 4, 8 and 32 MiB, tried with a sequential-access hint,
0.62-0.66), 64 MiB spans 0.64 s in one run of 5 and 2.4-2.7 s in the others: with spans as large as the
tensors, the sum faulting the tensor the check reads went the slow way."""
SMALL_PAGE_FAULTS_PER_MIB = 4
"""A large warm file whose checks took at least this many page faults per MiB they read is mapped in small
pages, and its checks go on from the end after the load returns (:meth:`Verification._from_back`).
Mapped in 2 MiB pages, a read takes 0.5 faults per MiB (the probe, :data:`PROBE_BYTES`: 4-5 in 4 MiB); in
4 KiB pages 16, one per 64 KiB the kernel maps around a fault (the probe: 67), and 4-13 in a page cache
the host had partly reclaimed and read back. Kernels and file systems without large folios cache every
file in 4 KiB pages. There the faults cost more than the reads (2 GiB summed: 142 ms on a fresh mapping,
57 on a mapped one), and faults in different parts of a mapping run in parallel (``MADV_POPULATE_READ``
of 2 GiB: 113 ms on one thread, 63 on two)."""
PROBE_BYTES = 4 << 20
"""Bytes near the end of a large warm file that the first checking thread reads before its first check,
counting the page faults (:meth:`Verification._probe`): a file's first check from the end is a 64 MiB
chunk, which in small pages can end after the load returns (6 ms, from 3 ms into a load that returned
at 9), leaving nothing to judge by."""


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
        self._groups: list[CheckGroup] = []
        self._lock = threading.Lock()
        self._cursor = 0
        self._back = 0
        """While :meth:`_from_back`: the checking threads take spans from here down."""
        self._back_first = False
        """A large file under :meth:`watch` on a warm page cache (:data:`LARGE_FILE_BYTES`)."""
        self._open = 0
        self._started = 0.0
        self._returned: float | None = None
        self._finished = threading.Event()
        self._hooks: list[tuple[RemovableHandle, int]] = []
        self._token: int | None = None
        self._on_finish: list[Callable[[], None]] = []
        self._spans: dict[str, list[CheckGroup]] = {}
        """Stored tensor name -> the spans over its bytes (:meth:`watch`)."""
        self._uses: list[MappedUse] = []
        self._begun = False
        """:meth:`start` was called: the last check done finishes the verification."""
        self._watching = False
        self._cold = False
        """The checked bytes were not in the page cache: one thread reads them, everyone else waits (while
        it runs: a check added after it ran out of work is run by whoever waits for it)."""
        self._workers = 0
        """Checking threads still claiming work (one leaves when :meth:`_claim` finds nothing left)."""
        self._faults = 0
        self._faulted_bytes = 0
        """The checking threads' page faults, and the bytes their checks read (:meth:`_small_pages`)."""
        self._probed = False
        self._keep_back = False
        """The checks go on from the end after the load returns (:meth:`_from_back`)."""

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def add(
        self, checks: Sequence[Check], tensor: torch.Tensor, modules: list[nn.Module], order: int
    ) -> None:
        """The checks of ``tensor`` (mapped from the file, as the model holds it), which ``modules`` use;
        they run by ``order`` (the tensor's place in the model)."""
        if checks:
            with self._lock:
                self._groups.append(CheckGroup(list(checks), modules, tensor, order))
                self._open += 1

    def watch(self, source: TensorSource) -> None:
        """Start checking every stored byte of ``source`` now, before the model exists, in
        :data:`SPAN_BYTES` spans, in file order (a large file: :meth:`_from_back`), on threads of their
        own: building a model and filling it is Python on the calling thread, the CRC runs beside it
        (BERT-base: 2 spans, most of them checked by the time the load returns). Then :meth:`use` ties
        each mapped tensor to its spans, and :meth:`verify_stored` checks a tensor's bytes before they are
        decoded or copied.

        Example:
            >>> checks = Verification(threads=2)  # doctest: +SKIP
            >>> checks.watch(slimtorch.open("model.safetensors"))  # doctest: +SKIP
        """
        self._started = time.perf_counter()
        # Tensors stored as is come under the spans; coded ones are checked as they are decoded, each its
        # own small parts (a decode waiting for a 64 MiB span would wait on the file-wide check). Their
        # parts under SMALL_CODED still join the spans, which would break at every bias otherwise.
        chunks = source.stored_chunks()
        raw = {name for name in {c.tensor for c in chunks} if source.codec(name) == "raw"}
        chunks = [c for c in chunks if c.tensor in raw or c.length < SMALL_CODED]
        runs, mapped = _spans(source, chunks, SPAN_BYTES)
        # Decided here, not by each check: mincore releases the interpreter lock, and a checking thread
        # taking it back while the model is built waits up to the 5 ms switch interval.
        cold = residency.cold(mapped)
        self._back_first = not cold and sum(c.length for c in chunks) >= LARGE_FILE_BYTES
        span_bytes = COLD_SPAN_BYTES if cold else LARGE_SPAN_BYTES if self._back_first else SPAN_BYTES
        if span_bytes < SPAN_BYTES:
            runs, mapped = _spans(source, chunks, span_bytes)
        for run, data in zip(runs, mapped, strict=True):
            check = layout.SpanCheck(source.path, run, layout.tensor_bytes(data))
            group = CheckGroup([check], [], data, order=len(self._groups), span=True)
            self._groups.append(group)
            for name in dict.fromkeys(chunk.tensor for chunk in run if chunk.tensor in raw):
                self._spans.setdefault(name, []).append(group)
        self._open += len(self._groups)
        self._back = len(self._groups)
        self._watching = True
        self._spawn(cold)

    @property
    def watching(self) -> bool:
        """Whether a file is under :meth:`watch`."""
        return self._watching

    def covers(self, name: str) -> bool:
        """Whether stored tensor ``name`` is under :meth:`watch`."""
        return name in self._spans

    def use(self, name: str, modules: list[nn.Module], order: int) -> None:
        """The model holds stored tensor ``name`` as mapped (under :meth:`watch`), used by ``modules``
        (their forwards wait for its spans) at ``order`` (its place in the model)."""
        self._uses.append(MappedUse(name, self._spans[name], modules, order))

    def verify_stored(self, name: str) -> None:
        """Block until the spans over stored tensor ``name`` are checked, running unstarted ones here;
        raise its own mismatch (before its bytes are decoded or copied)."""
        spans = self._spans[name]
        self._wait_for(spans)
        error = first_error((g, name) for g in spans)
        if error is not None:
            raise error

    def cancel(self) -> None:
        """The load failed: start no more checks, and wait for those running, so that nothing reads the
        file once the load has raised (a caller may rewrite it then: reading a mapped page past a new end
        of the file kills the process with SIGBUS)."""
        with self._lock:
            self._cursor = len(self._groups)
            self._cold = False  # the reader stops: a later wait runs its checks itself
            running = [group for group in self._groups if group.running]
        for group in running:
            group.done.wait()

    def start(self, *, hooks: bool, on_finish: Callable[[], None] | None = None) -> None:
        """Start the threads (already running after :meth:`watch`); with ``hooks``, each module waits in
        its forward for its own tensors."""
        watching = self._watching
        self._on_finish += [on_finish] if on_finish else []
        if not watching:
            self._started = time.perf_counter()
            self._groups.sort(key=lambda group: group.order)
        if self._groups:
            self._token = pending.hold(_ranges(self._groups), self)
        if hooks:
            self._hook_modules()
        if not watching:
            self._spawn()
        with self._lock:
            self._begun = True
            last = self._open == 0 and not self._finished.is_set()
        if last:
            self._finish()

    def _spawn(self, cold: bool | None = None) -> None:
        """Start the checking threads: one on a cold page cache (``None``: look at the pages)."""
        if not self._groups:
            return
        self._cold = residency.cold([g.tensor for g in self._groups]) if cold is None else cold
        workers = 1 if self._cold else min(max(1, self.threads - 1), self._checks())
        with self._lock:
            self._workers += workers
        for _ in range(workers):
            threading.Thread(target=self._work, name="slimtorch-verify").start()

    def _checks(self) -> int:
        return sum(len(g.checks) for g in self._groups)

    def returned(self) -> None:
        """The load returns now: what runs from here on overlaps the caller's work."""
        with self._lock:
            self._returned = time.perf_counter()
            self._keep_back = self._back_first and self._small_pages()

    def wait(self) -> None:
        """Block until every check is done, running unstarted ones on this thread (on a warm page cache)
        from the other end of the file than the checking threads take theirs; raise the first mismatch
        (in the model's order).

        From the same end this thread waited for the span a checking thread ran and lost the next one to
        it (the thread claims its next span as it finishes one, before this thread wakes): the checks ran
        on one thread to the end. ``load_model(2 GiB MLP, verify="before-use").wait()``, medians of 6
        fresh processes: 74 ms with this thread running 2% of the spans, 54 ms running 47% (eager, which
        already took the other end, 53 either way)."""
        with self._lock:
            threads_from_back = self._from_back()
        self._wait_for(self._groups if threads_from_back else self._groups[::-1])
        failed = self._first_error()
        self._finished.wait()  # the last check's thread may still be removing the hooks
        for callback in self._on_finish:
            callback()  # again: this wait's own time
        if failed is not None:
            raise failed

    # -- running checks ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._claim(None)) is not None:
            # The faults of the checks made while a large file loads decide, as it returns, where the
            # checks go on (:meth:`_small_pages`); later ones are not counted.
            counting = self._back_first and self._returned is None
            if counting:
                self._probe(job[0])
            faults = residency.thread_faults() if counting else None
            checked = self._run(*job)
            if faults is not None and checked >= 1 << 20:  # a small check's faults are its own set-up's
                self._count_faults(residency.thread_faults() - faults, checked)  # type: ignore[operator]

    def _probe(self, group: CheckGroup) -> None:
        """Before the first check from the end of a large file with :data:`PROBE_BYTES` and 2 MiB more,
        read those bytes near its end, counting the page faults (:meth:`_small_pages`); the check reads
        them again from the cache. Not the last 2 MiB: the end of a file is mapped in small pages whatever
        its page cache holds (2 GiB MLP in 2 MiB pages: 6 faults in its last 4 MiB, 3 in 4 MiB further in;
        in small pages 65). Part of a claimed check, so a cancelled load waits for it too."""
        if self._probed or residency.RUSAGE_THREAD is None:
            return
        data = layout.tensor_bytes(group.tensor)
        if len(data) < PROBE_BYTES + (2 << 20):
            return
        with self._lock:
            probed, self._probed = self._probed, True
        if not probed:
            end = len(data) - (2 << 20)
            probe = data[end - PROBE_BYTES : end]
            faults = residency.thread_faults()
            layout.crc32(probe)
            self._count_faults(residency.thread_faults() - faults, PROBE_BYTES)  # type: ignore[operator]

    def _count_faults(self, faults: int, read: int) -> None:
        with self._lock:
            self._faults += faults
            self._faulted_bytes += read

    def _claim(self, group: CheckGroup | None) -> tuple[CheckGroup, Check] | None:
        """The next check nobody runs yet: of ``group``, or (None, a checking thread) the first group in
        the model's order, or, while a large watched file is still being loaded (:meth:`_from_back`), the
        last one. A checking thread that finds none leaves (counted here, under the lock: a check added
        later is then run by whoever waits for it). On a cold page cache a waiter claims nothing while the
        one reading thread is there: that thread takes every group in turn, the waiter's among them."""
        with self._lock:
            if group is not None and self._cold and self._workers:
                return None
            if group is None:
                while self._cursor < len(self._groups) and self._groups[self._cursor].exhausted:
                    self._cursor += 1
                if self._from_back():
                    while self._back > self._cursor and self._groups[self._back - 1].exhausted:
                        self._back -= 1
                    if self._back > self._cursor:
                        group = self._groups[self._back - 1]
                if group is None:
                    if self._cursor == len(self._groups):
                        self._workers -= 1
                        return None
                    group = self._groups[self._cursor]
            elif group.exhausted:
                return None
            group.claimed += 1
            group.running += 1
            return group, group.checks[group.claimed - 1]

    def _from_back(self) -> bool:
        """Whether the checking threads take spans from the end of the file: a large one under
        :meth:`watch` on a warm page cache (:data:`LARGE_FILE_BYTES`), until the load returns, and after it
        too where the file is mapped in small pages (:meth:`_small_pages`). Called with the lock held.

        Mapped in 2 MiB pages, whoever uses the weights starts at the front, and the checks turn to the
        front too, side by side with it: two threads reading the same bytes at about the same time share
        the cache, where a check far ahead of the use reads the memory a second time. On this 2-core host
        a 2 GiB sum beside a CRC of the same bytes started with it took 0.95-1.0x the sum alone, and
        1.33-1.39x with the CRC started 9 ms (a model's construction) ahead (medians of 7). By distance,
        2 GiB in memory summed beside a CRC of the same bytes: 1.06x the sum alone with the CRC 0-8 MiB
        ahead, 1.20x at 32 MiB, 1.59-1.63x at 128 MiB or more (a CRC of other bytes: 1.62x). The spans
        checked while loading are where the use ends, so it finds them done.

        Mapped in small pages, the page faults cost more than the reads: the checks keep to the end, mapping
        the pages there while the caller maps the front, the two threads' faults in parallel. 2 GiB MLP,
        before-use, until every weight is summed, medians of 6 fresh processes: 125 ms from the end, 148
        turning to the front, 158 for ``load_file`` + assign (no mapping in 2 MiB pages)."""
        return self._back_first and (self._returned is None or self._keep_back)

    def _small_pages(self) -> bool:
        """Whether the checks done so far (and :meth:`_probe`) read :data:`PROBE_BYTES` or more and took
        :data:`SMALL_PAGE_FAULTS_PER_MIB` faults per MiB or more (Linux; elsewhere no). Asked as the load
        returns, of the checks made alone while it loaded: beside the caller's reads of the same bytes a
        check took 4-8 faults per MiB of a file mapped in 2 MiB pages. Called with the lock held."""
        return self._faulted_bytes >= PROBE_BYTES and self._faults * (1 << 20) >= (
            SMALL_PAGE_FAULTS_PER_MIB * self._faulted_bytes
        )

    def _run(self, group: CheckGroup, check: Check) -> int:
        """Run ``check`` of ``group`` here; the bytes it read (0 when it failed)."""
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
            last = closed and self._open == 0 and self._begun
        if last:
            self._finish()
        return checked

    def _wait_for(self, groups: Sequence[CheckGroup]) -> None:
        """Wait until ``groups`` are done, running their unstarted checks here on a warm page cache (on a
        cold one a second reader would only slow the first: see
        :func:`~slimtorch.loading.residency.cold`)."""
        clock = time.perf_counter()
        for group in groups:
            while (job := self._claim(group)) is not None:
                self._run(*job)
            group.done.wait()
        with self._lock:
            self.stats.waited_s += time.perf_counter() - clock

    def _first_error(self) -> BaseException | None:
        """The first mismatch in the model's order among the tensors it holds (a corrupt tensor it does not
        use fails nothing)."""
        found = [(u.order, e) for u in self._uses if (e := u.error()) is not None]
        found += [(g.order, g.error) for g in self._groups if g.error is not None and not g.span]
        return min(found, key=lambda pair: pair[0])[1] if found else None

    def _finish(self) -> None:
        """Every check is done: drop the hooks (kept on modules with a failed tensor, so their forward
        keeps raising), stop counting these tensors as pending, and tell the report."""
        now = time.perf_counter()
        self.stats.wall_s = now - self._started
        self.stats.after_return_s = max(0.0, now - self._returned) if self._returned is not None else 0.0
        failed = {id(m) for g in self._groups if g.error is not None for m in g.modules}
        failed |= {id(m) for use in self._uses if use.error() is not None for m in use.modules}
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
        by_module: dict[int, tuple[nn.Module, list[tuple[CheckGroup, str | None]]]] = {}
        waits: list[tuple[CheckGroup, str | None, list[nn.Module]]]
        waits = [(g, None, g.modules) for g in self._groups if g.modules]
        waits += [(g, use.name, use.modules) for use in self._uses for g in use.spans]
        for group, name, modules in waits:
            if group.done.is_set() and error_of(group, name) is None:
                continue  # checked already: nothing to wait for
            for module in modules:
                by_module.setdefault(id(module), (module, []))[1].append((group, name))
        for module_id, (module, groups) in by_module.items():
            handle = module.register_forward_pre_hook(_BeforeForward(self, groups))
            self._hooks.append((handle, module_id))


class _BeforeForward:
    """A module's forward pre-hook: wait for its own tensors' checks and raise a mismatch among them.

    A model holding these hooks refuses to be copied or pickled: the copy would hold bytes nobody checked
    yet, with no hook of its own to check them (and the checks' threads and locks cannot be copied)."""

    def __init__(self, verification: Verification, groups: list[tuple[CheckGroup, str | None]]) -> None:
        self.verification = verification
        self.groups = groups
        """(group, stored tensor name or None: any of the group's errors is this module's)"""

    def __call__(self, module: nn.Module, args: Any) -> None:
        if all(g.done.is_set() and error_of(g, name) is None for g, name in self.groups):
            return
        self.verification._wait_for([g for g, _ in self.groups])
        failed = first_error(self.groups)
        if failed is not None:
            raise failed

    def __reduce__(self) -> Any:
        raise SlimtorchError(
            "this model's checksums are still being verified (load_model(verify='before-use')): call the "
            "load report's wait() before copying or pickling it"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self.__reduce__()


def _spans(
    source: TensorSource, chunks: list[StoredChunk], span_bytes: int
) -> tuple[list[list[StoredChunk]], list[torch.Tensor]]:
    """``chunks`` cut into spans of at most ``span_bytes``, and each span's bytes as mapped."""
    runs = layout.spans(chunks, span_bytes)
    return runs, [source.mapped_range(r[0].file, r[0].offset, r[-1].offset + r[-1].length) for r in runs]


def _ranges(groups: list[CheckGroup]) -> list[tuple[int, int]]:
    """The bytes of every tensor under check, for :func:`~slimtorch.format.pending.wait_for_checks`."""
    ranges = []
    for group in groups:
        storage = group.tensor.untyped_storage()  # the part's bytes in the file mapping
        if group.tensor.device.type == "cpu" and storage.nbytes():
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges
