"""Host-to-device copies through a ring of pinned staging buffers, overlapping reading and transfer.

A tensor mapped from a file lives in pageable memory; a CUDA copy from pageable memory is synchronous and
goes through the driver's own small bounce buffer. :class:`Stager` instead copies each tensor's bytes, a
chunk at a time, into one of a few page-locked buffers and starts a ``non_blocking`` copy from there. While
the GPU pulls chunk *k*, the CPU fills the next buffer with chunk *k+1* (that read is what faults the file's
pages in). A buffer is refilled only after the event recorded behind its last copy has completed.

The logic does not depend on CUDA: on the CPU (tests, machines without a GPU) the buffers are ordinary
memory and the events complete at once, so every chunking and ordering rule runs everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_BUFFERS = 3


class Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class _Done:
    """The event of a synchronous device: complete as soon as it is recorded."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


@dataclass
class _Slot:
    buffer: torch.Tensor
    event: Event
    pending: bool = False


@dataclass
class Stager:
    """Copy CPU tensors to ``device`` through ``buffers`` staging buffers of ``buffer_bytes`` each.

    Example:
        >>> stager = Stager(torch.device("cuda"))  # doctest: +SKIP
        >>> on_gpu = stager.copy(torch.randn(1024, 1024))  # doctest: +SKIP
        >>> stager.finish()  # doctest: +SKIP
    """

    device: torch.device
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    buffers: int = DEFAULT_BUFFERS
    pin: bool | None = None
    """Page-lock the buffers; None: where the device is CUDA."""
    make_event: type | None = None
    """Event class; None: ``torch.cuda.Event`` for CUDA, an always-complete event otherwise."""
    bytes_staged: int = 0
    chunks: int = 0
    _slots: list[_Slot] = field(default_factory=list, repr=False)
    _next: int = 0

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        if self.buffer_bytes < 1 or self.buffers < 1:
            raise ValueError("a stager needs at least one buffer of at least one byte")
        cuda = self.device.type == "cuda"
        if self.pin is None:
            self.pin = cuda
        if self.make_event is None:
            self.make_event = torch.cuda.Event if cuda else _Done

    def _slot(self) -> _Slot:
        """The next buffer in the ring, once the copy that last read from it has completed."""
        index = self._next % self.buffers
        self._next += 1
        if index == len(self._slots):  # the first lap allocates the ring, one buffer at a time
            buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=bool(self.pin))
            self._slots.append(_Slot(buffer, self.make_event()))  # type: ignore[misc]
        slot = self._slots[index]
        if slot.pending:
            slot.event.synchronize()
            slot.pending = False
        return slot

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU ``tensor`` on the device; complete only after :meth:`finish`."""
        source = tensor.contiguous()
        out = torch.empty(source.shape, dtype=source.dtype, device=self.device)
        nbytes = source.numel() * source.element_size()
        if nbytes == 0:
            return out
        src = source.reshape(-1).view(torch.uint8)
        dst = out.reshape(-1).view(torch.uint8)
        for start in range(0, nbytes, self.buffer_bytes):
            stop = min(nbytes, start + self.buffer_bytes)
            slot = self._slot()
            staged = slot.buffer[: stop - start]
            staged.copy_(src[start:stop])
            dst[start:stop].copy_(staged, non_blocking=True)
            slot.event.record()
            slot.pending = True
            self.chunks += 1
        self.bytes_staged += nbytes
        return out

    def finish(self) -> None:
        """Wait for every copy in flight; the tensors returned by :meth:`copy` are then complete."""
        for slot in self._slots:
            if slot.pending:
                slot.event.synchronize()
                slot.pending = False
