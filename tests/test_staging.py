"""The CUDA staging logic, run on the CPU: chunking through a ring of buffers, and waiting before reuse.

On a machine with a GPU the same class moves bytes through pinned buffers with non-blocking copies; here
the buffers are plain memory and a recording event stands in for ``torch.cuda.Event``, so every rule about
which bytes go where, and when a buffer may be refilled, is checked without one.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from slimtorch.loading.staging import Stager


class RecordingEvent:
    """Stands in for torch.cuda.Event: logs record/synchronize so the test can check the ordering."""

    log: ClassVar[list[tuple[str, int]]] = []
    count: ClassVar[int] = 0

    def __init__(self) -> None:
        RecordingEvent.count += 1
        self.id = RecordingEvent.count

    def record(self) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("sync", self.id))


@pytest.fixture(autouse=True)
def _fresh_log() -> None:
    RecordingEvent.log = []
    RecordingEvent.count = 0


TENSORS = [
    torch.randn(1000),  # 4000 bytes: several chunks
    torch.arange(7, dtype=torch.int16),  # 14 bytes: smaller than a buffer
    torch.empty(0),  # nothing to copy
    torch.tensor(3.5, dtype=torch.float64),  # 0-d
    torch.randn(33, 17).t(),  # non-contiguous
    torch.randint(0, 255, (513,), dtype=torch.uint8),  # odd size, crosses buffer edges
    torch.randn(64, 64).to(torch.bfloat16),
]


@pytest.mark.parametrize("buffer_bytes", [1, 64, 100, 4096, 1 << 20])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_every_tensor_arrives_whole_whatever_the_buffer_size(buffer_bytes: int, buffers: int) -> None:
    stager = Stager(
        torch.device("cpu"), buffer_bytes=buffer_bytes, buffers=buffers, make_event=RecordingEvent
    )
    copies = [stager.copy(t) for t in TENSORS]
    stager.finish()
    for original, copy in zip(TENSORS, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert copy.is_contiguous() and torch.equal(copy, original)
        assert copy.numel() == 0 or copy.data_ptr() != original.data_ptr()
    total = sum(t.numel() * t.element_size() for t in TENSORS)
    assert stager.bytes_staged == total
    expected_chunks = sum(-(-t.numel() * t.element_size() // buffer_bytes) for t in TENSORS)
    assert stager.chunks == expected_chunks
    assert len(stager._slots) == min(buffers, expected_chunks)


def test_a_buffer_is_refilled_only_after_the_copy_that_read_it_has_completed() -> None:
    stager = Stager(torch.device("cpu"), buffer_bytes=16, buffers=2, make_event=RecordingEvent)
    stager.copy(torch.arange(20, dtype=torch.float32))  # 80 bytes: 5 chunks through 2 buffers
    # Chunks 1, 3, 5 use buffer 1 and chunks 2, 4 buffer 2: before each reuse, that buffer's event waits.
    assert RecordingEvent.log == [
        ("record", 1),
        ("record", 2),
        ("sync", 1),
        ("record", 1),
        ("sync", 2),
        ("record", 2),
        ("sync", 1),
        ("record", 1),
    ]
    stager.finish()
    assert sorted(RecordingEvent.log[-2:]) == [("sync", 1), ("sync", 2)]  # both in flight, both awaited
    RecordingEvent.log.clear()
    stager.finish()  # nothing in flight: nothing to wait for
    assert RecordingEvent.log == []


def test_cpu_stager_uses_plain_memory_and_cuda_would_pin() -> None:
    assert Stager(torch.device("cpu")).pin is False
    assert Stager(torch.device("cuda")).pin is True  # nothing is allocated until the first copy
    with pytest.raises(ValueError, match="at least one buffer"):
        Stager(torch.device("cpu"), buffers=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_matches_a_plain_copy() -> None:
    stager = Stager(torch.device("cuda"), buffer_bytes=1 << 16)
    copies = [stager.copy(t) for t in TENSORS]
    stager.finish()
    for original, copy in zip(TENSORS, copies, strict=True):
        assert copy.is_cuda and torch.equal(copy.cpu(), original)


def test_load_model_sends_every_tensor_through_the_stager_and_converts_after_it(
    tmp_path, monkeypatch
) -> None:
    """The loader's device path, on the CPU: the stager it would use for CUDA, with tiny buffers."""
    import slimtorch
    from slimtorch.loading import loader
    from tests.zoo import SmallCNN

    cnn = SmallCNN().eval()
    path = tmp_path / "cnn.safetensors"
    slimtorch.save(cnn.state_dict(), path, quantize="int8-weight")
    stagers: list[Stager] = []

    def small_stager(device):
        stagers.append(Stager(torch.device("cpu"), buffer_bytes=256, buffers=2, make_event=RecordingEvent))
        return stagers[-1]

    monkeypatch.setattr(loader, "stager_for", small_stager)
    staged = slimtorch.load_model(path, SmallCNN, device="cpu", dtype=torch.float64).model
    (stager,) = stagers
    monkeypatch.undo()
    expected = slimtorch.load_model(path, SmallCNN, dtype=torch.float64).model
    # What crosses is the file's float32 (converted to float64 only on the far side), every tensor once.
    assert stager.bytes_staged == sum(t.numel() * t.element_size() for t in cnn.state_dict().values())
    assert RecordingEvent.log[-1][0] == "sync"  # finish() waited for the last copies
    assert {p.dtype for p in staged.parameters()} == {torch.float64}
    for a, b in zip(staged.state_dict().values(), expected.state_dict().values(), strict=True):
        assert torch.equal(a, b)
