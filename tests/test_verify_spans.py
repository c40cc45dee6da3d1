"""A slim file loaded to the CPU is checked file-wide from the moment it is opened: its stored bytes in
spans of many tensors, one CRC-32 each, on threads beside the model's constructor.

Each test would fail if the checks waited for the model (the factory waits for them), if one corrupt
tensor failed its span's intact neighbours, or if a failed load left a thread reading the file.
"""

from __future__ import annotations

import mmap
import threading
import time
import zlib
from pathlib import Path

import numpy
import pytest
import torch

import slimtorch
from slimtorch.format import layout
from slimtorch.format.layout import ChecksumMismatches, SpanCheck
from slimtorch.format.source import StoredChunk
from slimtorch.loading import residency, verification
from slimtorch.loading.verification import Verification
from tests.hostile import data_range
from tests.zoo import MLP


@pytest.fixture
def watched(monkeypatch) -> list[Verification]:
    """Every Verification that watches a file during the test, as it starts."""
    found: list[Verification] = []
    original = Verification.watch

    def watch(self: Verification, source) -> None:
        found.append(self)
        original(self, source)

    monkeypatch.setattr(Verification, "watch", watch)
    return found


def _saved(tmp_path: Path, corrupt: tuple[str, ...] = (), **save: object) -> Path:
    path = tmp_path / "mlp.safetensors"
    torch.manual_seed(0)
    slimtorch.save(MLP().state_dict(), path, **save)  # type: ignore[arg-type]
    data = bytearray(path.read_bytes())
    for key in corrupt:
        start, _ = data_range(path, key)
        data[start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def test_the_file_is_checked_while_the_model_is_built(tmp_path, watched) -> None:
    path = _saved(tmp_path)
    seen: list[int] = []

    def build() -> MLP:  # waits for the checks to make progress: they must not wait for it
        deadline = time.monotonic() + 20
        while not watched[0].stats.checked_bytes and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append(watched[0].stats.checked_bytes)
        return MLP()

    for mode in ("eager", "before-use"):
        seen.clear()
        report = slimtorch.load_model(path, build, verify=mode)
        report.wait()
        assert seen[0] > 0, f"{mode}: nothing was checked while the model was built"
        assert report.verified_bytes == path.stat().st_size - data_range(path, "layers.0.weight")[0]


def test_a_corrupt_tensor_fails_itself_only_though_its_span_holds_its_neighbours(tmp_path, watched) -> None:
    path = _saved(tmp_path, corrupt=("layers.2.weight",))
    report = slimtorch.load_model(path, MLP, verify="before-use")
    assert len(watched[0]._groups) == 1  # one span holds every tensor of this small model
    model = report.model
    model.layers[0](torch.randn(2, 64))  # same span, intact tensors: it runs
    with pytest.raises(slimtorch.FormatError, match=r"tensor 'layers\.2\.weight': checksum mismatch"):
        model.layers[2](torch.randn(2, 128))
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight'"):
        report.wait()


def test_the_first_corrupt_tensor_in_the_models_order_is_the_one_raised(tmp_path) -> None:
    path = _saved(tmp_path, corrupt=("layers.4.bias", "layers.2.weight"))
    with pytest.raises(slimtorch.FormatError, match=r"tensor 'layers\.2\.weight'"):
        slimtorch.load_model(path, MLP)
    with pytest.raises(slimtorch.FormatError, match=r"tensor 'layers\.2\.weight'"):
        slimtorch.load(path)


def test_spans_cut_a_file_and_each_mismatch_names_its_own_tensor_and_bytes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(verification, "SPAN_BYTES", 8 << 10)  # the 128x128 weight alone is 64 KiB
    path = _saved(tmp_path)
    _, end = data_range(path, "layers.2.weight")
    data = bytearray(path.read_bytes())
    data[end - 3] ^= 0x01
    path.write_bytes(bytes(data))
    report = slimtorch.load_model(path, MLP, verify="before-use")
    report.model.layers[0](torch.randn(2, 64))
    # one 64 MiB chunk: the message gives where the chunk starts, as a per-tensor check does
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight': checksum mismatch .*\(bytes 0\."):
        report.wait()


def test_a_span_check_names_every_corrupt_tensor_as_a_chunk_check_would() -> None:
    parts = [b"slim" * 4, b"torch" * 3, b"safetensors"]
    data = bytearray(b"".join(parts))
    chunks, at = [], 0
    for name, part in zip("abc", parts, strict=True):
        chunks.append(StoredChunk(Path("f"), at, len(part), zlib.crc32(part), name, name, 0))
        at += len(part)
    assert SpanCheck(Path("f"), chunks, memoryview(bytes(data)))() == len(data)
    data[1] ^= 1  # in a
    data[-1] ^= 1  # in c
    with pytest.raises(ChecksumMismatches) as caught:
        SpanCheck(Path("f"), chunks, memoryview(bytes(data)))()
    assert set(caught.value.errors) == {"a", "c"}
    alone = layout.ChunkCheck(Path("f"), "a", "a", 0, memoryview(bytes(data))[:16], chunks[0].expected)
    with pytest.raises(slimtorch.FormatError) as direct:
        alone()
    assert str(caught.value.errors["a"]) == str(direct.value) == str(caught.value)


def test_coded_tensors_are_checked_as_they_are_decoded_not_under_the_spans(tmp_path, watched) -> None:
    path = _saved(tmp_path, quantize="int8-weight")
    slimtorch.load_model(path, MLP).wait()
    checks = watched[0]
    assert not checks.covers("layers.0.weight")  # int8 codes: checked before decoding, on their own
    assert checks.covers("layers.0.bias")  # stored as is: under a span
    assert len(checks._groups) == 1  # the codes' small parts join the span, which does not break at them
    corrupt = _saved(tmp_path, corrupt=("layers.2.weight::q",), quantize="int8-weight")
    with pytest.raises(slimtorch.FormatError, match=r"'layers\.2\.weight': checksum mismatch"):
        slimtorch.load_model(corrupt, MLP, verify="before-use")


def test_a_failed_load_stops_its_checks_before_it_raises(tmp_path, monkeypatch, watched) -> None:
    monkeypatch.setattr(verification, "SPAN_BYTES", 1 << 10)  # about 100 spans: most are never started
    check = SpanCheck.__call__

    def slow(self: SpanCheck) -> int:  # 5 ms a span: the whole file would take half a second
        time.sleep(0.005)
        return check(self)

    monkeypatch.setattr(SpanCheck, "__call__", slow)
    path = _saved(tmp_path)

    def build() -> torch.nn.Module:
        while not watched[0].stats.checked_bytes:  # a check is running or done: the threads are live
            time.sleep(0.001)
        raise RuntimeError("the constructor failed")

    with pytest.raises(RuntimeError, match="the constructor failed"):
        slimtorch.load_model(path, build)
    checks = watched[0]
    assert all(group.done.is_set() for group in checks._groups if group.claimed)  # none still running
    assert checks.stats.checked_bytes < path.stat().st_size  # the rest were never read
    deadline = time.monotonic() + 10
    while any(t.name == "slimtorch-verify" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "slimtorch-verify" for t in threading.enumerate())


def test_no_check_watches_a_load_that_verifies_nothing_or_offloads(tmp_path, watched) -> None:
    path = _saved(tmp_path)
    slimtorch.load_model(path, MLP, verify=False)
    slimtorch.load_model(path, MLP, max_memory="cpu=1MB", verify="eager")  # each unit checked as it is read
    assert watched == []


def test_a_file_with_no_tensor_stored_as_is_still_finishes_its_checks(tmp_path, watched) -> None:
    """Every tensor coded: the spans hold only small coded parts, no tensor is under them, and the
    verification must still end (it once waited for spans it had counted twice)."""
    path = tmp_path / "coded.safetensors"
    build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False))  # noqa: E731
    slimtorch.save(build().state_dict(), path, quantize="int8-weight")
    done: list[object] = []
    loading = threading.Thread(target=lambda: done.append(slimtorch.load_model(path, build)), daemon=True)
    loading.start()
    loading.join(timeout=30)
    assert done, "load_model did not return"
    assert watched[0].watching and not watched[0].covers("0.weight") and watched[0]._groups


def test_a_page_cache_missing_a_few_pages_counts_as_warm_and_one_missing_a_quarter_as_cold(monkeypatch):
    spans = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(7)]
    pages = [t.data_ptr() + (1 << 20) * i // 4 for t in spans for i in range(4)]  # the 28 pages asked

    def missing(count: int) -> bool:
        gone = set(pages[:: len(pages) // count][:count])
        monkeypatch.setattr(layout, "resident", lambda address: address not in gone)
        return residency.cold(spans)

    assert not missing(1)  # one missing page: warm (one check thread beside the constructor)
    assert not missing(6)
    assert missing(7)  # a quarter of them: cold
    assert missing(28)


@pytest.mark.parametrize("cold", [False, True])
def test_a_cold_file_is_cut_into_smaller_spans(tmp_path, monkeypatch, watched, cold):
    monkeypatch.setattr(verification, "SPAN_BYTES", 128 << 10)  # the whole MLP: one span when warm
    monkeypatch.setattr(verification, "COLD_SPAN_BYTES", 16 << 10)
    monkeypatch.setattr(residency, "cold", lambda tensors: cold)
    path = _saved(tmp_path)
    report = slimtorch.load_model(path, MLP, verify="before-use")
    report.wait()
    spans = [group for group in watched[0]._groups if group.span]
    assert len(spans) == (4 if cold else 1)  # cold: as many as the tensors over 16 KiB allow


@pytest.mark.parametrize("verify", ["eager", "before-use"])
def test_a_cold_file_has_one_reader_and_the_caller_waits_for_it_instead_of_reading_beside_it(
    tmp_path, monkeypatch, watched, verify
) -> None:
    """On a cold page cache a second reader of the mapping slows the first (the kernel's read-ahead follows
    one sequential reader): one thread checks, in file order, and a waiting caller claims no check."""
    monkeypatch.setattr(verification, "COLD_SPAN_BYTES", 16 << 10)
    monkeypatch.setattr(residency, "cold", lambda tensors: True)
    waiting, readers, callers = threading.Event(), [], []
    original_work, original_run, original_wait = Verification._work, Verification._run, Verification._wait_for

    def work(self: Verification) -> None:
        readers.append(threading.current_thread())
        waiting.wait(20)  # until the caller waits: a caller that reads beside the reader starts now
        time.sleep(0.2)
        original_work(self)

    def run(self: Verification, group, check) -> int:
        if threading.current_thread() not in readers:
            callers.append(threading.current_thread())
        return original_run(self, group, check)

    def wait_for(self: Verification, groups) -> None:
        waiting.set()
        original_wait(self, groups)

    monkeypatch.setattr(Verification, "_work", work)
    monkeypatch.setattr(Verification, "_run", run)
    monkeypatch.setattr(Verification, "_wait_for", wait_for)
    report = slimtorch.load_model(_saved(tmp_path), MLP, verify=verify)
    report.wait()
    assert len(readers) == 1 and not callers
    assert len([g for g in watched[0]._groups if g.span]) > 1 and report.verified_bytes > 0
    assert torch.equal(report.model(torch.ones(1, 64)), report.model(torch.ones(1, 64)))


@pytest.mark.parametrize(("large", "small_pages"), [(True, False), (True, True), (False, False)])
def test_a_large_warm_file_is_checked_from_its_end_while_loading_then_from_its_front(
    tmp_path, monkeypatch, watched, large, small_pages
) -> None:
    """A large file's checks made while the model is built come from the end of the file; once the load
    returns the next one is the file's first, where a forward or a copy of the weights starts: a check
    far ahead of that use reads the memory a second time instead of sharing the caller's reads. Mapped in
    small pages, the checks keep to the end, faulting there while the caller faults at the front. A small
    file is checked front first throughout, so the caller's first reads find their pages mapped in."""
    monkeypatch.setattr(Verification, "_small_pages", lambda self: small_pages)
    monkeypatch.setattr(verification, "LARGE_FILE_BYTES", 0 if large else 1 << 40)
    monkeypatch.setattr(verification, "LARGE_SPAN_BYTES", 16 << 10)
    monkeypatch.setattr(verification, "SPAN_BYTES", 16 << 10)
    monkeypatch.setattr(residency, "cold", lambda tensors: False)
    ran: list[tuple[int, bool]] = []  # (span, the load had returned)
    released = threading.Event()
    original_run = Verification._run
    main = threading.current_thread()

    def run(self: Verification, group, check) -> int:
        if threading.current_thread() is not main:
            ran.append((group.order, self._returned is not None))
        checked = original_run(self, group, check)
        if len(ran) == 2:
            released.wait(20)  # the checking thread holds here until the load has returned
        return checked

    def build() -> MLP:
        deadline = time.monotonic() + 20
        while len(ran) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        return MLP()

    monkeypatch.setattr(Verification, "_run", run)
    report = slimtorch.load_model(_saved(tmp_path), build, verify="before-use", threads=2)
    released.set()
    deadline = time.monotonic() + 20
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    report.wait()
    spans = len([g for g in watched[0]._groups if g.span])
    assert spans >= 4
    after = (spans - 3, True) if small_pages else (0, True)
    expected = [(spans - 1, False), (spans - 2, False), after]
    expected = expected if large else [(0, False), (1, False), (2, True)]
    assert ran[:3] == expected
    assert report.verified_bytes == watched[0].stats.checked_bytes > 0


def test_a_large_file_is_checked_in_smaller_spans_on_a_warm_cache_only(
    tmp_path, monkeypatch, watched
) -> None:
    monkeypatch.setattr(verification, "LARGE_FILE_BYTES", 0)
    monkeypatch.setattr(verification, "LARGE_SPAN_BYTES", 16 << 10)
    monkeypatch.setattr(verification, "SPAN_BYTES", 128 << 10)  # the whole MLP: one span
    monkeypatch.setattr(verification, "COLD_SPAN_BYTES", 64 << 10)
    counts = []
    for cold in (False, True):
        monkeypatch.setattr(residency, "cold", lambda tensors, cold=cold: cold)
        slimtorch.load_model(_saved(tmp_path), MLP, verify="before-use").wait()
        counts.append(len([g for g in watched[-1]._groups if g.span]))
        assert watched[-1]._back_first is not cold
    assert counts[0] == 4 and counts[1] < counts[0]  # cold: the cold spans, never the large file's


@pytest.mark.parametrize("returned", [True, False])
def test_a_waiting_caller_takes_checks_from_the_other_end_than_the_checking_thread(returned) -> None:
    """From the same end the caller waited for the span the checking thread ran and lost the next one to
    it, every time: the checks ran on one thread (``load_model(...).wait()`` on a 2 GiB file: 74 ms, now
    54). Here the thread's first check holds until the caller has run the last one, which it can only do
    by starting from the other end; while a large file still loads the thread takes the end first
    (:meth:`Verification._from_back`) and the caller the front."""
    checks = Verification(threads=2)
    held, released, ran = threading.Event(), [], {}

    def check(index: int, count: int = 4):
        def run() -> int:
            ran[index] = threading.current_thread().name
            if index == (0 if returned else count - 1):
                held.set()
                released.append(release.wait(20))
            else:
                release.set() if index == (count - 1 if returned else 0) else None
            return 1

        return run

    release = threading.Event()
    for index in range(4):
        checks.add([check(index)], torch.zeros(1), [], order=index)
    if not returned:
        checks._back_first = True  # a large file under watch, the load not yet returned
        checks._back = 4
    checks.start(hooks=False)
    assert held.wait(20)
    if returned:
        checks.returned()
    checks.wait()
    assert released == [True]  # the held check was let go by the caller, not by the timeout
    far = 3 if returned else 0
    assert ran[far] == threading.current_thread().name and checks.stats.checked_bytes == 4


@pytest.mark.parametrize(
    ("back_first", "faults_per_mib", "read_mib", "keeps_back"),
    [
        (True, 16, 4, True),  # 4 KiB pages: one fault per 64 KiB
        (True, 4, 64, True),
        (True, 1, 64, False),  # 2 MiB pages (with the check's own few faults)
        (True, 16, 1, False),  # too little read to judge: the 2 MiB pages' way
        (False, 16, 64, False),  # a small file: front first whatever its pages
    ],
)
def test_the_checks_keep_to_the_end_after_the_return_only_where_they_took_many_faults(
    back_first, faults_per_mib, read_mib, keeps_back
) -> None:
    checks = Verification(threads=2)
    checks._back_first = back_first
    checks._count_faults(faults_per_mib * read_mib, read_mib << 20)
    with checks._lock:
        assert checks._from_back() is back_first  # while loading: from the end, a large file
    checks.returned()
    with checks._lock:
        assert checks._from_back() is keeps_back
    checks._count_faults(0, 1 << 30)  # faults counted later (beside the caller's reads) change nothing
    with checks._lock:
        assert checks._from_back() is keeps_back


@pytest.mark.skipif(residency.RUSAGE_THREAD is None, reason="per-thread fault counts are Linux's")
def test_fault_counts_are_the_calling_threads_own() -> None:
    def touch() -> None:  # a fresh mapping (an allocator may hand back pages it already has): faults
        with mmap.mmap(-1, 16 << 20) as fresh:
            numpy.frombuffer(fresh, dtype=numpy.uint8)[:: mmap.PAGESIZE] = 1

    start = residency.thread_faults()
    other = threading.Thread(target=touch)
    other.start()
    other.join()
    after_other = residency.thread_faults()
    touch()
    after_own = residency.thread_faults()
    assert after_other - start < (after_own - after_other) / 2  # type: ignore[operator]


@pytest.mark.skipif(residency.RUSAGE_THREAD is None, reason="per-thread fault counts are Linux's")
def test_a_large_file_is_probed_near_its_end_before_its_first_check(tmp_path, monkeypatch, watched) -> None:
    """The first checking thread reads PROBE_BYTES near the end of its first span first, counting the
    faults, so that the load's return finds something to judge the pages by even where that check outlasts
    the load; the probe is part of the claimed check (a cancelled load waits for it)."""
    monkeypatch.setattr(verification, "LARGE_FILE_BYTES", 0)
    monkeypatch.setattr(verification, "PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(residency, "cold", lambda tensors: False)
    probed: list[tuple[int, int, int]] = []
    original = Verification._count_faults

    def count(self: Verification, faults: int, read: int) -> None:
        running = sum(group.running for group in self._groups)
        probed.append((faults, read, running)) if not probed else None
        original(self, faults, read)

    def build() -> torch.nn.Module:  # the load returns once the probe has run
        deadline = time.monotonic() + 20
        while not probed and time.monotonic() < deadline:
            time.sleep(0.001)
        return torch.nn.ParameterDict({"w": torch.zeros(1024, 1024)})

    monkeypatch.setattr(Verification, "_count_faults", count)
    path = tmp_path / "wide.safetensors"
    slimtorch.save({"w": torch.randn(1024, 1024)}, path)  # 4 MiB: the probe and the 2 MiB past it
    slimtorch.load_model(path, build, verify="before-use").wait()
    assert watched[0]._back_first
    assert probed and probed[0][1] == 1 << 20 and probed[0][0] >= 1 and probed[0][2] == 1


@pytest.mark.slow
@pytest.mark.parametrize("verify", ["eager", "before-use"])
def test_a_check_added_after_the_cold_reader_left_is_run_by_whoever_waits_for_it(
    tmp_path, monkeypatch, verify
) -> None:
    """A quantized layer's codes are checked as the load decodes them, added after the file-wide spans: on
    a cold page cache the one reading thread may have run out of spans and left by then. The waiter runs
    those checks itself (it waited forever: ``slimtorch load`` of an int8 MLP hung in CI, whose files
    read as cold)."""
    monkeypatch.setattr(residency, "cold", lambda tensors: True)
    path = tmp_path / "int8.safetensors"
    torch.manual_seed(0)
    model = MLP().eval()
    slimtorch.quantize(model, "int8-dynamic")
    slimtorch.save_model(model, path)
    readers: list[threading.Thread] = []
    late: list[int] = []
    original_work, original_add = Verification._work, Verification.add

    def work(self: Verification) -> None:
        readers.append(threading.current_thread())
        original_work(self)

    def add(self: Verification, checks, tensor, modules, order) -> None:
        for reader in readers:
            reader.join(20)  # the reader has left before this check is added
        late.append(len(checks))
        original_add(self, checks, tensor, modules, order)

    monkeypatch.setattr(Verification, "_work", work)
    monkeypatch.setattr(Verification, "add", add)
    done: list[slimtorch.LoadReport] = []
    loading = threading.Thread(
        target=lambda: done.append(slimtorch.load_model(path, MLP, verify=verify).wait())
    )
    loading.start()
    loading.join(60)
    assert not loading.is_alive(), "the load waited for a check nobody runs"
    assert sum(late) > 0 and len(readers) == 1 and not readers[0].is_alive()
    x = torch.ones(1, 64)
    assert torch.allclose(done[0].model(x), model(x), atol=1e-5)
