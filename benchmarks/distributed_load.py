"""Benchmark: 4 ranks filling an FSDP2 model from a sharded 2 GiB checkpoint: what each rank reads, its
peak memory, and the time until the model is ready, against the strongest ways torch users do it today.

Run it with ``.venv/bin/torchrun --standalone --nproc-per-node 4 -m benchmarks.distributed_load`` (about
5 minutes on 2 cores, the files made once under ``--dir``; ``--rounds 1`` for a quick look; ``--check``
exits 1 unless our loads read <= 1.1x their share on every rank, peak within 1.2x the share plus the
model's unsharded buffers, with outputs equal to a single-process load). gloo on CPU.

The model: 16 blocks of Linear(2048, 8192) + Linear(8192, 2048), and two Linear(2048, 2048): 2.03 GiB of
float32 in 36 weights of 16 or 64 MiB (each rank's share is a quarter: 16 or 4 MiB a weight). Files: the
same weights as a slim checkpoint (sharded, stored as is) and as a Hugging Face folder of safetensors
shards with an index (written with safetensors). Methods, interleaved A B C D in each round, in the same
four processes (started once: starting torch costs seconds):

* ``slim, load_model``: ``slimtorch.load_model(folder, Net, mesh=mesh)``: ``fully_shard`` each block, then
  each rank ``pread`` s its rows straight into its local shards, checksums checked by the ranks together;
* ``HF folder, load_model``: the same from the safetensors folder (no checksums there);
* ``dcp.load + HuggingFaceStorageReader``: torch's own way to read a safetensors folder into a sharded
  model (the model sharded and given memory with ``to_empty`` first, as DCP needs);
* ``rank 0 loads, broadcasts``: accelerate's FSDP2 path, ``fsdp2_load_full_state_dict`` (rank 0 reads the
  whole folder with ``safetensors.torch.load_file``, then broadcasts every tensor; the others receive);
  torch's ``set_model_state_dict(..., broadcast_from_rank0=True)`` when accelerate is not installed (the
  table names which ran).

Time-to-ready: from a barrier to the load's return, building and sharding the model included; per round,
the slowest rank's. Peak RSS: ``VmHWM`` (reset through ``/proc/self/clear_refs`` before each load) minus
the RSS before it, per rank; malloc's mmap threshold is fixed at 128 KiB so freed models go back to the
system between methods. Bytes read: what our reader counts (``report.bytes_read``: ``pread`` s, checksum
re-reads included), and ``rchar`` from ``/proc/self/io`` for every method (read syscalls only: mapped
reads, as safetensors makes, are not in it). After round 1 every method runs one forward (batch 2) and
rank 0 compares it with a single-process ``load_model`` of the folder (``torch.equal``). The page cache is
warm (the files are read every round; dropping it needs privileges). Results go to
``benchmarks/results/distributed_load.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import slimtorch
from benchmarks._harness import proc_status, results_file, spread, write_json

RESULTS = results_file("distributed_load")
DIM, FFN, BLOCKS = 2048, 8192, 16
MiB = 2**20
RATIO_TARGET, RSS_TARGET = 1.1, 1.2
METHODS = ("slim, load_model", "HF folder, load_model", "dcp.load + HuggingFaceStorageReader", "rank 0 loads")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


# -- the files -----------------------------------------------------------------------------------------------
def make_files(folder: Path) -> tuple[Path, Path]:
    """The slim and HF folders of one random model, written once (rank 0) and kept."""
    slim, hf = folder / "slim", folder / "hf"
    if (hf / "model.safetensors.index.json").exists() and slim.exists():
        return slim, hf
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.no_grad():
        state = {k: v.normal_(0, 0.02) for k, v in Net().state_dict().items()}
    slimtorch.save(state, slim, shard_bytes=512 * MiB)
    hf.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    for name in state:
        if current and size + state[name].nbytes > 512 * MiB:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += state[name].nbytes
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in names}, hf / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}, "weight_map": weight_map}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    return slim, hf


# -- the methods (each gives the model, and the bytes its reader counts: None, not counted) ------------------
def ours(path: Path) -> Callable[[Any], tuple[nn.Module, int | None]]:
    def load(mesh: Any) -> tuple[nn.Module, int | None]:
        report = slimtorch.load_model(path, Net, mesh=mesh)
        return report.model, report.bytes_read

    return load


def sharded_on_meta(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def dcp_hf(path: Path) -> Callable[[Any], tuple[nn.Module, int | None]]:
    def load(mesh: Any) -> tuple[nn.Module, int | None]:
        import torch.distributed.checkpoint as dcp

        model = sharded_on_meta(mesh)
        model.to_empty(device="cpu")
        dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(str(path)))
        return model, None

    return load


def rank0_broadcast(path: Path) -> tuple[str, Callable[[Any], tuple[nn.Module, int | None]]]:
    """accelerate's FSDP2 path where installed, else torch's own broadcast from rank 0."""
    from safetensors.torch import load_file

    def full_state() -> dict[str, torch.Tensor]:
        if dist.get_rank() != 0:
            return {}
        return {k: v for file in sorted(path.glob("*.safetensors")) for k, v in load_file(file).items()}

    try:
        from accelerate.utils.fsdp_utils import fsdp2_load_full_state_dict
    except ImportError:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        def torch_way(mesh: Any) -> tuple[nn.Module, int | None]:
            model = sharded_on_meta(mesh)
            model.to_empty(device="cpu")
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, full_state(), options=options)
            return model, None

        return "rank 0 loads, broadcasts (torch set_model_state_dict)", torch_way

    def accelerate_way(mesh: Any) -> tuple[nn.Module, int | None]:
        model = sharded_on_meta(mesh)
        fsdp2_load_full_state_dict(SimpleNamespace(is_main_process=dist.get_rank() == 0), model, full_state())
        return model, None

    return "rank 0 loads, broadcasts (accelerate fsdp2_load_full_state_dict)", accelerate_way


# -- measuring -----------------------------------------------------------------------------------------------
LIBC = ctypes.CDLL(None)


def rchar() -> int:
    return int(
        next(x for x in Path("/proc/self/io").read_text().splitlines() if x.startswith("rchar")).split()[1]
    )


def measure(load: Callable[[Any], tuple[nn.Module, int | None]], mesh: Any, forward: bool) -> dict[str, Any]:
    gc.collect()
    LIBC.malloc_trim(0)
    dist.barrier()
    before = proc_status()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the RSS now
    io = rchar()
    clock = time.perf_counter()
    model, bytes_read = load(mesh)
    ready = time.perf_counter() - clock
    peak = proc_status()["VmHWM"] - before
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    result = {
        "ready_s": ready,
        "peak_mib": peak / 1024,
        "bytes_read": bytes_read,
        "rchar": rchar() - io,
        "share": sum(t.numel() * t.element_size() for t in local),
    }
    dist.barrier()
    if forward:
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            result["output"] = model(x).detach().clone()
    del model, local
    return result


def run(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    LIBC.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: big frees go back to the system at once
    warnings.filterwarnings("ignore")
    import safetensors.torch  # noqa: F401  every method's imports now, not in the first one's time and peak
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.tensor.parallel  # noqa: F401

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    folder = Path(args.dir)
    if rank == 0:
        make_files(folder)
    dist.barrier()
    slim, hf = folder / "slim", folder / "hf"
    broadcast_name, broadcast = rank0_broadcast(hf)
    methods = dict(zip(METHODS, (ours(slim), ours(hf), dcp_hf(hf), broadcast), strict=True))
    runs: dict[str, list[list[dict]]] = {name: [] for name in METHODS}
    for round_ in range(args.rounds):
        for name, load in methods.items():
            mine = measure(load, mesh, forward=round_ == 0)
            output = mine.pop("output", None)
            everyone: list[dict] = [{} for _ in range(world)]
            dist.all_gather_object(everyone, mine)
            runs[name].append(everyone)
            if rank == 0 and output is not None:
                runs[name][-1][0]["output"] = output
    if rank == 0:
        report(args, runs, broadcast_name, hf, world)
    dist.barrier()
    dist.destroy_process_group()


# -- the table -----------------------------------------------------------------------------------------------
def report(
    args: argparse.Namespace, runs: dict[str, list[list[dict]]], broadcast: str, hf: Path, world: int
) -> None:
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = slimtorch.load_model(hf, Net).model(x)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"\n{world} ranks, gloo, FSDP2, model {BLOCKS} blocks ({2.03:.2f} GiB float32), warm page cache")
    print(
        f"load average {load}; {args.rounds} rounds interleaved; times: median [min..max] of the slowest rank"
    )
    columns = ("ready s", 18), ("read/share (worst)", 18), ("peak-before MiB r0 / others", 28), ("output", 7)
    header = f"{'method':<64} " + " ".join(f"{name:>{width}}" for name, width in columns)
    print(header)
    print("-" * len(header))
    rows, failures = {}, []
    for name, rounds in runs.items():
        label = broadcast if name == "rank 0 loads" else name
        ready = [max(rank["ready_s"] for rank in r) for r in rounds]
        ratios = [
            rank["bytes_read"] / rank["share"] for r in rounds for rank in r if rank["bytes_read"] is not None
        ]
        peaks0 = [r[0]["peak_mib"] for r in rounds]
        peaks = [rank["peak_mib"] for r in rounds for rank in r[1:]]
        equal = bool(torch.equal(rounds[0][0]["output"], reference))
        share_mib = max(rank["share"] for rank in rounds[0]) / MiB
        worst_rss = max(rank["peak_mib"] for r in rounds for rank in r) / share_mib
        ratio = f"{max(ratios):.3f}" if ratios else "n/a"
        peak_text = f"{statistics.median(peaks0):.0f} / {min(peaks):.0f}-{max(peaks):.0f}"
        same = "equal" if equal else "DIFFERS"
        print(f"{label:<64} {spread(ready):>18} {ratio:>18} {peak_text:>28} {same:>7}")
        rows[label] = {
            "ready_s": ready,
            "read_over_share_worst": max(ratios) if ratios else None,
            "rchar_mib": [[rank["rchar"] / MiB for rank in r] for r in rounds],
            "peak_mib_rank0": peaks0,
            "peak_mib_others": peaks,
            "share_mib": share_mib,
            "peak_over_share_worst": worst_rss,
            "output_equal": equal,
        }
        if name in METHODS[:2]:
            if not ratios or max(ratios) > RATIO_TARGET:
                failures.append(f"{name}: reads {ratio}x the share (target <= {RATIO_TARGET})")
            if worst_rss > RSS_TARGET:  # the model has no unsharded buffers
                failures.append(f"{name}: peak {worst_rss:.2f}x the share (target <= {RSS_TARGET})")
            if not equal:
                failures.append(f"{name}: output differs from the single-process load")
    print(f"share per rank {share_mib:.0f} MiB (the model has no unsharded buffers)")
    mib = {
        name: statistics.median(statistics.median(x) for x in row["rchar_mib"]) for name, row in rows.items()
    }
    print(
        "rchar MiB per rank (read syscalls, median): "
        + "; ".join(f"{k.split(',')[0]}: {v:.0f}" for k, v in mib.items())
    )
    for failure in failures:
        print("FAIL", failure)
    print("PASS" if not failures else f"{len(failures)} target(s) missed")
    write_json(RESULTS, {"load_average": load, "world": world, "methods": rows}, indent=1)
    print(f"results: {RESULTS}")
    if args.check and failures:
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=f"torchrun --standalone --nproc-per-node 4 -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every method (default 3)")
    parser.add_argument(
        "--dir",
        default=os.path.join(tempfile.gettempdir(), "slimtorch-distributed-load"),
        help="where the checkpoints are made once and kept (about 4.1 GB)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error(
            f"run it under torchrun: .venv/bin/torchrun --standalone --nproc-per-node 4 -m {__spec__.name}"
        )
    run(args)


if __name__ == "__main__":
    main()
