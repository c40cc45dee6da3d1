"""The bookkeeping of a load's checks (:mod:`slimtorch.loading.verification`): the checks of one tensor or
span as a group, done when all have passed or one has failed; a tensor the model holds as mapped and the
spans over its bytes; which error concerns which stored tensor; and what the checks cost."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from slimtorch.format import layout

Check = Callable[[], int]
"""Reads one chunk, returns its bytes, raises FormatError on a mismatch (``TensorSource.checks``)."""


@dataclass(eq=False)
class CheckGroup:
    """The checks of one tensor: done when every check has passed or one has failed."""

    checks: list[Check]
    modules: list[nn.Module]
    tensor: torch.Tensor
    order: int
    span: bool = False
    """A span of a watched file (:meth:`~slimtorch.loading.verification.Verification.watch`): its errors
    concern the uses of its tensors."""
    claimed: int = 0
    running: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def exhausted(self) -> bool:
        return self.claimed == len(self.checks) or self.error is not None


@dataclass(eq=False)
class MappedUse:
    """A tensor the model holds as mapped from a watched file: stored tensor ``name``, whose bytes the
    ``spans`` cover, used by ``modules``."""

    name: str
    spans: list[CheckGroup]
    modules: list[nn.Module]
    order: int

    def error(self) -> BaseException | None:
        return first_error((g, self.name) for g in self.spans)


def first_error(waits: Iterable[tuple[CheckGroup, str | None]]) -> BaseException | None:
    """The first error among (group, stored tensor name) pairs, each as :func:`error_of` sees it."""
    return next((e for group, name in waits if (e := error_of(group, name)) is not None), None)


def error_of(group: CheckGroup, name: str | None) -> BaseException | None:
    """The group's error as it concerns stored tensor ``name`` (None: any tensor of the group): a span
    holding another tensor's corrupt chunk is no error for this one."""
    if isinstance(group.error, layout.ChecksumMismatches) and name is not None:
        return group.error.errors.get(name)
    return group.error


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
