"""Checks on several gloo ranks in one ``torch.multiprocessing.spawn``: the ranks meet through a file in
the test's folder (no ports), run the named tasks of a test module's ``TASKS`` table, and each writes what
it saw to a JSON file the test asserts on. Starting a rank costs seconds here, so a test file runs every
check of one world size in one spawn."""

from __future__ import annotations

import gc
import importlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(module: str, world: int, root: Path, tasks: Iterable[str]) -> list[dict]:
    """What each of ``world`` ranks returned from ``module.TASKS[task](root, mesh)`` for every task."""
    mp.spawn(_worker, args=(module, world, str(root), tuple(tasks)), nprocs=world, join=True)
    return [json.loads((root / f"rank{rank}.json").read_text()) for rank in range(world)]


def _worker(rank: int, module: str, world: int, folder: str, tasks: tuple[str, ...]) -> None:
    warnings.filterwarnings("ignore")
    root = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world)
    try:
        _run_tasks(rank, module, world, root, tasks)
    finally:
        # Models the tasks left in reference cycles (a failed load's traceback, FSDP's hooks) hold the
        # mesh and through it gloo's process group: collected now, the group's destructor joins its
        # worker threads here. Left to the interpreter's exit, a worker still dropping its last
        # collective's tensors meets a finalizing interpreter and the rank aborts (SIGABRT).
        gc.collect()
        dist.destroy_process_group()


def _run_tasks(rank: int, module: str, world: int, root: Path, tasks: tuple[str, ...]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    table = importlib.import_module(module).TASKS
    seen = {task: table[task](root, mesh) for task in tasks}
    (root / f"rank{rank}.json").write_text(json.dumps(seen))
