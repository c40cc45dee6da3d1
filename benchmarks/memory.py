"""Benchmark: a training step's peak memory, estimated on fake tensors against measured on real ones.

Run it with ``.venv/bin/python -m benchmarks.memory`` (about 30 minutes on 2 shared cores, most of it the
steady-state table; ``--check`` exits 1 when a target fails; ``--tables allocator`` runs only the first
table, ``--models lstm`` only one model). For each zoo model, batch size and mode (train with AdamW,
inference) it prints:

* ``estimate``: ``slimtorch.memory.estimate(..., device="cpu")``, fake tensors, no real memory used;
* ``measured``: ``slimtorch.memory.profile(...)``, the same step run for real (after one warm-up step),
  as the C library's heap counts it (bytes in use, read after every op, from before the step made its
  weights and inputs): an allocator-level figure that also sees what no tensor shows (kernel scratch,
  autograd's own records). Both count the step's own copies of the weights: an RNN keeps its weights a
  second time (its flat weight list), and ``profile`` puts the model's list back after the step, so the
  next step does not free the last one's copies inside its own measurement (it did: the LSTM's heap read
  3.5 MiB low, its estimate 1.31 times it);
* the ratio, and PASS when it is within 10%.

Then the steady state: a training loop's peak from step 2 on, when the optimizer's state is alive through
forward and backward. For each zoo model (the LSTM classifier too), each batch size, training with AdamW
and SGD with momentum in fp32, bf16 autocast and fp16 autocast with a ``GradScaler`` (its loss a mean:
a sum overflows fp16; not the LSTM, which torch cannot train in fp16 on the CPU), and inference in each
precision: ``estimate``'s steady-state peak against a measurement that is not the project's: a plain
loop (a real torch optimizer, three steps, ``zero_grad(set_to_none=True)``; for inference, three forward
passes under ``no_grad``) whose live tensor bytes are counted by the tracker in
``tests/test_steady_state.py`` (each op's output storages, freed when their last tensor is collected),
at its third step; and the first step's estimate against its first step. Target: every steady-state
peak within 5%; the worst error is printed.

Then the batch-size finders: the largest BERT (256 wide) training batch under an artificial budget
(``--budget-mib``, default 400; a step whose measured peak is over it raises the CPU allocator's
out-of-memory error), found exhaustively (the truth), by ``slimtorch.memory.find_batch_size``, by
accelerate's ``find_executable_batch_size`` (from 128, 90% after each failure) and by Lightning's
``Tuner.scale_batch_size`` (binsearch, one step a trial): the batch each finds and the real steps it ran.
Target: within 5% of the truth in at most 3 trials of 2 real steps (the truth is measured with the
optimizer's state alive, as every step of a loop after its first has it).

Then ``fit``: eight residual MLP blocks at batch 4096 under 60% of their unmodified step's measured
peak: the plan chosen, its measured peak, and the training loss after 5 AdamW steps against the
unmodified run's (targets: the peak fits, the losses match within float tolerance).

Then it estimates a 7B-parameter Llama (``LlamaConfig`` of Llama-2-7B, built on the meta device) for
batch 1, sequence 2048, AdamW, bf16-mixed, on CUDA, in a fresh process, and reports its wall time and the
process's peak resident memory (``VmHWM``; targets: < 60 s, < 2 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from tests.zoo import UNet, resnet18
from torch import nn
from torch.utils._pytree import tree_leaves

import slimtorch.memory as memory
from benchmarks._harness import (
    Check,
    ChildFailed,
    child_json,
    exit_code,
    print_checks,
    results_file,
    write_json,
)

RESULTS = results_file("memory")
TOLERANCE = 0.10
BATCHES = (4, 16, 32)


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def bert() -> nn.Module:
    t = _transformers()
    config = t.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024)
    return t.BertModel(config)


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_positions=256))


def llama() -> nn.Module:
    t = _transformers()
    config = t.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8000,
    )
    return t.LlamaForCausalLM(config)


class LSTMClassifier(nn.Module):
    """A recurrent classifier: token ids, a 128-wide embedding, a 2-layer LSTM of 256 (batch first; on
    the CPU, oneDNN's kernel, which keeps a workspace for backward), the last step's 10 classes."""

    def __init__(self, vocab: int = 10000, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])


ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    "resnet18": (resnet18, lambda b: torch.randn(b, 3, 64, 64)),
    "unet": (UNet, lambda b: torch.randn(b, 3, 64, 64)),
    "bert": (bert, lambda b: torch.randint(0, 30522, (b, 128))),
    "gpt2": (gpt2, lambda b: torch.randint(0, 50257, (b, 128))),
    "llama": (llama, lambda b: torch.randint(0, 8000, (b, 128))),
    "lstm": (LSTMClassifier, lambda b: torch.randint(0, 10000, (b, 64))),
}

LLAMA_7B = textwrap.dedent(
    """
    import json, time

    def high_water():
        # this process's own peak resident memory (getrusage's ru_maxrss keeps the parent's across exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    import torch, transformers
    import slimtorch.memory as memory
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(1, 2048, dtype=torch.long)
    report = memory.estimate(model, tokens, optimizer="adamw", precision="bf16-mixed", device="cuda")
    step = report.steps[0]
    print(json.dumps({
        "seconds": time.perf_counter() - start,
        "max_rss_bytes": high_water(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_bytes": step.peak_bytes, "peak_phase": step.peak_phase,
        "breakdown": step.breakdown, "phases": step.phases,
    }))
    """
)
"""The 7B estimate, run as ``python -c`` in a fresh process: nothing but what it needs imported before it."""


def compare(name: str, mode: str) -> list[dict[str, Any]]:
    factory, inputs = ZOO[name]
    torch.manual_seed(0)
    model = factory().train()
    example = inputs(BATCHES[0])
    estimated = memory.estimate(model, example, batch_sizes=BATCHES, mode=mode, device="cpu")
    # one untimed real step first: libraries allocate their own buffers once, on first use (a training
    # loop's first step pays that, every later step does not)
    memory.profile(model, example, mode=mode, device="cpu")
    measured = memory.profile(model, example, batch_sizes=BATCHES, mode=mode, device="cpu")
    rows = []
    for guess, real in zip(estimated.steps, measured.steps, strict=True):
        ratio = guess.peak_bytes / real.allocator_peak_bytes if real.allocator_peak_bytes else float("nan")
        rows.append(
            {
                "model": name,
                "mode": mode,
                "batch": guess.batch_size,
                "estimate_bytes": guess.peak_bytes,
                "measured_bytes": real.allocator_peak_bytes,
                "measured_tensor_bytes": real.peak_bytes,
                "ratio": ratio,
                "peak_phase": guess.peak_phase,
            }
        )
    return rows


# -- the steady state ----------------------------------------------------------------------------------
STEADY_TOLERANCE = 0.05
AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
FP16_NOT_RUN = "LSTM fp16 training (torch cannot), U-Net fp16 and ResNet-18 fp16 above batch 4 (slow)"


def mean_loss(output: Any) -> torch.Tensor:
    """The mean of the first floating-point output: an fp16 loop's loss (a sum over a batch's logits,
    times the scaler's first scale, 65536, overflows fp16 and the scaler skips steps until it is lower)."""
    first = next(t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return first.float().mean()


def steady(name: str) -> list[dict[str, Any]]:
    """The steady-state and first-step estimates against a plain loop's third and first steps: training
    with each optimizer and precision, and inference (three forward passes under ``no_grad``) at each
    precision, at each batch size."""
    from tests.support.steady import measured_inference_peaks, measured_peaks

    from slimtorch.memory.step import default_loss

    factory, inputs = ZOO[name]
    rows = []
    for mode, optimizer, precision in _steady_cases(name):
        loss_fn = mean_loss if precision == "fp16-mixed" else default_loss
        for batch_size in _fp16_batches(name, mode) if precision == "fp16-mixed" else BATCHES:
            torch.manual_seed(0)
            model, batch = factory().train(), inputs(batch_size)
            options = dict(mode=mode, precision=precision, device="cpu", loss_fn=loss_fn)
            if optimizer is not None:
                options["optimizer"] = optimizer
            step = memory.estimate(model, batch, **options).steps[0]
            if mode == "train":
                first, _, third = measured_peaks(model, batch, optimizer, loss_fn, AUTOCAST[precision])
            else:
                first, _, third = measured_inference_peaks(model, batch, AUTOCAST[precision])
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "optimizer": optimizer,
                    "precision": precision,
                    "batch": batch_size,
                    "steady_estimate_bytes": step.steady_peak_bytes,
                    "step3_measured_bytes": third,
                    "steady_error": step.steady_peak_bytes / third - 1,
                    "first_estimate_bytes": step.first_step_peak_bytes,
                    "step1_measured_bytes": first,
                    "first_error": step.first_step_peak_bytes / first - 1,
                }
            )
    return rows


def _steady_cases(name: str) -> list[tuple[str, str | None, str]]:
    """(mode, optimizer, precision) to check ``name`` at: inference has no optimizer, so one row each."""
    train = [("train", optimizer, precision) for optimizer in ("adamw", "sgd") for precision in AUTOCAST]
    return train + [("inference", None, precision) for precision in AUTOCAST]


def _fp16_batches(name: str, mode: str) -> tuple[int, ...]:
    """The batch sizes fp16 autocast is checked at. Torch cannot train an LSTM in it on the CPU (oneDNN
    has no fp16 LSTM kernel that keeps what backward needs: a real loop fails, as the estimate says),
    and its CPU convolutions run some 30 times slower than fp32 here (a ResNet-18 step at batch 16:
    127 s), so the CNNs are checked at the smallest batch, ResNet-18's only."""
    if (name == "lstm" and mode == "train") or name == "unet":
        return ()
    return BATCHES[:1] if name == "resnet18" else BATCHES


def print_steady(rows: list[dict[str, Any]]) -> tuple[str, bool, str]:
    print(
        f"\n{'model':10} {'mode':9} {'optimizer':9} {'precision':10} {'batch':>5} {'steady est':>12} "
        f"{'step 3':>12} {'error':>7} {'first est':>12} {'step 1':>12} {'error':>7}"
    )
    for r in rows:
        print(
            f"{r['model']:10} {r['mode']:9} {r['optimizer'] or '-':9} {r['precision']:10} {r['batch']:>5} "
            f"{r['steady_estimate_bytes'] / 2**20:10.1f}Mi {r['step3_measured_bytes'] / 2**20:10.1f}Mi "
            f"{r['steady_error']:+7.2%} {r['first_estimate_bytes'] / 2**20:10.1f}Mi "
            f"{r['step1_measured_bytes'] / 2**20:10.1f}Mi {r['first_error']:+7.2%}"
        )
    worst = max(rows, key=lambda r: abs(r["steady_error"]))
    print(
        f"worst steady-state error {worst['steady_error']:+.2%} ({worst['model']}, {worst['mode']}, "
        f"{worst['optimizer'] or 'no optimizer'}, {worst['precision']}, batch {worst['batch']}); "
        f"not run: {FP16_NOT_RUN}"
    )
    return (
        f"steady-state estimate within {STEADY_TOLERANCE:.0%} of a real loop's step 3: {len(rows)} cases",
        all(abs(r["steady_error"]) <= STEADY_TOLERANCE for r in rows),
        f"worst {worst['steady_error']:+.2%}",
    )


# -- batch-size finders ----------------------------------------------------------------------------------
class BudgetedStep:
    """One step of a real training loop of the model at a batch size (one AdamW kept from step to step, as
    in training), under an artificial budget: a step whose measured peak (the heap it adds plus the
    weights and optimizer state it starts with) is over it raises the CPU allocator's out-of-memory
    error, as running out would, so that every finder meets the same limit. Counts the steps it ran."""

    def __init__(self, model: nn.Module, tokens: torch.Tensor, budget: int) -> None:
        self.model, self.tokens, self.budget, self.steps = model, tokens, budget, 0
        self.optimizer = torch.optim.AdamW(model.parameters())

    def run(self, batch_size: int) -> None:
        self.model(self.tokens[:batch_size]).last_hidden_state.float().sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def peak(self, batch_size: int) -> int:
        held = [*self.model.parameters(), *self.model.buffers()]
        held += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        resident = sum(t.numel() * t.element_size() for t in held)
        return memory.measure_peak(lambda: self.run(batch_size), "cpu", resident)

    def __call__(self, batch_size: int) -> int:
        self.steps += 1
        peak = self.peak(batch_size)
        if peak > self.budget:
            message = f"DefaultCPUAllocator: can't allocate memory: {peak} bytes of a {self.budget} budget"
            raise torch.OutOfMemoryError(message)
        return batch_size


def finders(budget: int) -> dict[str, Any]:
    """slimtorch, accelerate and Lightning finding the largest batch of BERT (256 wide) in ``budget``."""
    torch.manual_seed(0)
    model = bert().train()
    tokens = torch.randint(0, 30522, (1024, 128))
    truth = BudgetedStep(model, tokens, budget)
    truth.run(2)  # warm-up, untimed: libraries allocate their own buffers on first use
    largest = 0
    while truth.peak(largest + 1) <= budget:  # exhaustive: every batch size until one does not fit
        largest += 1
    results = {"true largest (exhaustive)": {"batch": largest, "steps": largest + 1}}
    report = memory.estimate(model, tokens[:8], batch_sizes=[8, 16], device="cpu")
    ours = BudgetedStep(model, tokens, budget)
    found = memory.find_batch_size(ours, report, budget=budget)
    results["slimtorch find_batch_size"] = {"batch": found.batch_size, "steps": ours.steps}
    for name, finder in (("accelerate find_executable_batch_size", _accelerate), ("Lightning", _lightning)):
        step = BudgetedStep(model, tokens, budget)
        try:
            results[name] = {"batch": finder(step), "steps": step.steps}
        except ImportError as missing:
            results[name] = {"batch": None, "steps": None, "missing": str(missing)}
    return results


def _accelerate(step: BudgetedStep) -> int:
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=128)  # its documented default
    def train(batch_size: int) -> int:
        return step(batch_size)

    return train()


def _lightning(step: BudgetedStep) -> int:
    import lightning
    from lightning.pytorch.tuner import Tuner
    from torch.utils.data import DataLoader, TensorDataset

    class Module(lightning.LightningModule):
        """Runs the budgeted step; its own optimizer over a dummy weight is what makes Lightning count
        steps (a trial is one optimizer step)."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2
            self.dummy = nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            step(self.batch_size)
            return (self.dummy * 0).sum()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.zeros(1 << 16)), batch_size=self.batch_size)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([self.dummy], lr=0.0)

    trainer = lightning.Trainer(
        default_root_dir=tempfile.mkdtemp(prefix="slimtorch-lightning-"),  # its finder saves a checkpoint
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # binsearch: double until out of memory, then bisect (the closer of its two modes); one step a trial
    return Tuner(trainer).scale_batch_size(Module(), mode="binsearch", steps_per_trial=1, init_val=2)


# -- fit ------------------------------------------------------------------------------------------------
class Residual(nn.Module):
    """Eight residual MLP blocks (256 -> 1024 -> 256) and a classifier: at batch 4096 activations make
    most of its step's peak, which is what checkpointing can cut."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(8)
        )
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def fitting(share: float = 0.6, steps: int = 5) -> dict[str, Any]:
    """fit() under ``share`` of the unmodified step's measured peak: the plan, its measured peak, and the
    training loss of both after ``steps`` AdamW steps from the same weights."""
    import copy

    torch.manual_seed(0)
    base, x, y = Residual(), torch.randn(4096, 256), torch.randint(0, 10, (4096,))
    resident = sum(p.numel() * p.element_size() for p in base.parameters())

    def loss_of(output: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, y)

    def peak(model: nn.Module) -> int:
        def step() -> None:
            optimizer = torch.optim.AdamW(model.parameters())
            loss_of(model(x)).backward()
            optimizer.step()
            model.zero_grad(set_to_none=True)

        return memory.measure_peak(step, "cpu", resident)

    def losses(model: nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seen = []
        for _ in range(steps):
            loss = loss_of(model(x))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seen.append(loss.item())
        return seen

    peak(copy.deepcopy(base))  # warm-up: BLAS grows its work buffers once
    unmodified = peak(copy.deepcopy(base))
    budget = int(share * unmodified)
    fitted = copy.deepcopy(base)
    plan = memory.fit(fitted, x, budget=budget, device="cpu", loss_fn=loss_of)
    planned_peak = peak(copy.deepcopy(fitted))
    before, after = losses(copy.deepcopy(base)), losses(fitted)
    return {
        "unmodified_peak_bytes": unmodified,
        "budget_bytes": budget,
        "checkpointed": plan.checkpointed,
        "precision": plan.precision,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": planned_peak,
        "recompute_share": plan.recompute_share,
        "losses_unmodified": before,
        "losses_planned": after,
        "largest_loss_difference": max(abs(a - b) for a, b in zip(before, after, strict=True)),
    }


def llama_7b() -> dict[str, Any]:
    try:
        return child_json([sys.executable, "-c", LLAMA_7B], what="the 7B estimate", timeout=600)
    except ChildFailed as failed:
        raise SystemExit(str(failed)) from None


TABLES = ("allocator", "steady", "finders", "fit", "7b")


def allocator_table(models: list[str]) -> tuple[list[dict[str, Any]], list[Check]]:
    """The allocator-level table: each model's estimate against ``profile``'s heap in use."""
    rows = [row for name in models for mode in ("train", "inference") for row in compare(name, mode)]
    print(f"{'model':10} {'mode':10} {'batch':>5} {'estimate':>12} {'measured':>12} {'ratio':>7}  within 10%")
    for row in rows:
        ok = abs(row["ratio"] - 1) <= TOLERANCE
        print(
            f"{row['model']:10} {row['mode']:10} {row['batch']:>5} {row['estimate_bytes'] / 2**20:10.1f}Mi "
            f"{row['measured_bytes'] / 2**20:10.1f}Mi {row['ratio']:7.3f}  {'PASS' if ok else 'FAIL'}"
        )
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    check = (
        f"estimate within {TOLERANCE:.0%} of measured: {len(rows)} cases",
        all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows),
        f"worst ratio {worst['ratio']:.3f} ({worst['model']}, {worst['mode']}, batch {worst['batch']})",
    )
    return rows, [check]


def steady_table(models: list[str]) -> tuple[list[dict[str, Any]], list[Check]]:
    """The steady-state table: each model's steady and first-step estimates against a plain loop's."""
    rows = [row for name in models for row in steady(name)]
    return rows, [print_steady(rows)]


def finders_table(budget_mib: int) -> tuple[dict[str, Any], list[Check]]:
    """The batch-size finders against the exhaustive truth."""
    found = finders(budget_mib * 2**20)
    print(f"\nlargest BERT (256 wide, 4 layers, 128 tokens) training batch in {budget_mib} MiB, AdamW:")
    for name, row in found.items():
        print(f"  {name:40} batch {row['batch']!s:>5}   real steps {row['steps']!s:>4}")
    truth, ours = found["true largest (exhaustive)"]["batch"], found["slimtorch find_batch_size"]
    check = (
        "find_batch_size within 5% of the true largest, in <= 3 trials (6 real steps)",
        ours["batch"] >= 0.95 * truth and ours["batch"] <= truth and ours["steps"] <= 6,
        f"{ours['batch']} of {truth} in {ours['steps']} steps",
    )
    return found, [check]


def fit_table() -> tuple[dict[str, Any], list[Check]]:
    """``fit``'s plan under 60% of the unmodified peak: its measured peak and its losses."""
    fitted = fitting()
    mib = {k: v / 2**20 for k, v in fitted.items() if k.endswith("_bytes")}
    print(
        f"\nfit, 8 residual MLP blocks, batch 4096, AdamW: unmodified peak "
        f"{mib['unmodified_peak_bytes']:.1f} MiB, budget (60%) {mib['budget_bytes']:.1f} MiB"
    )
    print(
        f"  plan: checkpoint {len(fitted['checkpointed'])} of 8 blocks, {fitted['precision']}; predicted "
        f"{mib['predicted_peak_bytes']:.1f} MiB, measured {mib['measured_peak_bytes']:.1f} MiB; "
        f"loss after 5 steps {fitted['losses_planned'][-1]:.6f} against {fitted['losses_unmodified'][-1]:.6f}"
    )
    checks = [
        (
            "fit: the plan's measured peak fits 60% of the unmodified peak",
            fitted["measured_peak_bytes"] <= fitted["budget_bytes"],
            f"{fitted['measured_peak_bytes'] / fitted['unmodified_peak_bytes']:.3f} of it",
        ),
        (
            "fit: training loss matches the unmodified run after 5 steps (within 1e-5)",
            fitted["largest_loss_difference"] <= 1e-5,
            f"largest difference {fitted['largest_loss_difference']:.2e}",
        ),
    ]
    return fitted, checks


def llama_7b_table() -> tuple[dict[str, Any], list[Check]]:
    """The 7B-parameter Llama's estimate, in a fresh process: its time and memory."""
    big = llama_7b()
    print(
        f"\nLlama 7B ({big['parameters'] / 1e9:.2f} B parameters), batch 1 x 2048, AdamW, bf16-mixed, "
        f"CUDA: peak {big['peak_bytes'] / 2**30:.1f} GiB in the {big['peak_phase']} phase"
    )
    print("  " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in big["breakdown"].items() if v))
    checks = [
        ("7B estimate in < 60 s", big["seconds"] < 60, f"{big['seconds']:.1f} s"),
        ("7B estimate in < 2 GB RAM", big["max_rss_bytes"] < 2e9, f"{big['max_rss_bytes'] / 1e9:.2f} GB"),
    ]
    return big, checks


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__spec__.name}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    parser.add_argument(
        "--tables",
        nargs="+",
        default=list(TABLES),
        choices=TABLES,
        help="the tables to run (default: all); the results file keeps the others' last results",
    )
    parser.add_argument("--skip-7b", action="store_true", help="leave out the 7B-parameter Llama estimate")
    parser.add_argument("--budget-mib", type=int, default=400, help="the batch-size finders' budget")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tables = [t for t in args.tables if not (t == "7b" and args.skip_7b)]
    runs: dict[str, Callable[[], tuple[Any, list[Check]]]] = {
        "allocator": lambda: allocator_table(args.models),
        "steady": lambda: steady_table(args.models),
        "finders": lambda: finders_table(args.budget_mib),
        "fit": fit_table,
        "7b": llama_7b_table,
    }
    keys = {"allocator": "rows", "steady": "steady", "finders": "finders", "fit": "fit", "7b": "llama_7b"}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    checks: list[Check] = []
    for table in tables:
        result, table_checks = runs[table]()
        results[keys[table]] = result
        checks += table_checks
    print()
    passed = print_checks(checks)
    write_json(RESULTS, results)
    print(f"\nwrote {RESULTS}")
    return exit_code(passed, args.check)


if __name__ == "__main__":
    sys.exit(main())
