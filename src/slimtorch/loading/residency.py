"""Where a mapped file's bytes are in memory, as far as the checks need to know
(:mod:`slimtorch.loading.verification`): whether the page cache holds them, and how many page faults the
calling thread took reading them (Linux; elsewhere nothing is counted)."""

from __future__ import annotations

import torch

from slimtorch.format import layout

try:
    import resource

    RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # Windows
    RUSAGE_THREAD = None


def cold(tensors: list[torch.Tensor]) -> bool:
    """Whether the checked bytes are not in the page cache (sampled), which decides how many threads check
    them: on a warm cache one fewer than the load's, the caller's thread being the other (an eager load
    joins in its wait; a forward beside before-use checks pages in the same bytes; measured on 2 cores,
    2 GiB: one check thread beside a 1-thread sum adds nothing, 0.92x the sum alone; two add 1.26x, they
    compete for the cores). Cold, one thread reads and checks the spans in file order and nobody else
    claims a check: the kernel reads a mapping ahead fastest for one sequential reader, and whoever uses
    the weights meanwhile follows behind it. 2 GiB MLP, medians of 5-6 fresh processes on an evicted
    cache, the file's readinto floor at 0.65-0.74 s in each run: before-use until every weight is summed
    0.62 s, eager 0.68; with 4 reading threads and read-ahead hints (the earlier design) 1.19 and 1.03,
    and an eager caller checking beside its one reader went 0.72 s or 2.5 s by the run.

    A page cache that holds almost all of the file is warm: a shared machine's host reclaims pages, and
    "warm" files here held 98-99.9% of their pages. Asked of one first page per sampled tensor with any
    page missing meaning cold, BERT-base's warm loads went the cold way now and then (4 threads beside the
    constructor on 2 cores: returned in 57 ms, not 41); now 4 pages spread over each, and cold means a
    quarter of them missing."""
    sample = [t for t in tensors[:: max(1, len(tensors) // 8)] if t.numel()]
    pages = [t.data_ptr() + t.numel() * t.element_size() * i // 4 for t in sample for i in range(4)]
    missing = sum(not layout.resident(page) for page in pages)
    return bool(pages) and missing * 4 >= len(pages)


def thread_faults() -> int | None:
    """The calling thread's minor page faults so far (Linux), or None."""
    return None if RUSAGE_THREAD is None else resource.getrusage(RUSAGE_THREAD).ru_minflt
