"""slimtorch.memory: a step's peak predicted on fake tensors equals the one measured on real tensors,
agrees with the allocator's own count, and breaks down into what a training step is known to hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slimtorch
from slimtorch import memory
from slimtorch.memory import estimate, profile
from slimtorch.memory.estimating import _heap_in_use
from tests.support.models import Blocks


def _params_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
def test_adamw_step_holds_weights_gradients_and_two_moments() -> None:
    model = Blocks()
    step = estimate(model, torch.randn(32, 256), device="cpu").steps[0]
    weights = _params_bytes(model)
    assert step.breakdown["parameters"] == weights
    assert step.breakdown["gradients"] == weights
    # exp_avg and exp_avg_sq per parameter, plus a 4-byte step counter each
    assert step.breakdown["optimizer_state"] == 2 * weights + 4 * len(list(model.parameters()))
    assert step.peak_phase == "optimizer"


@pytest.mark.slow
def test_the_estimate_on_fake_tensors_equals_the_same_step_run_for_real() -> None:
    model, x = Blocks(), torch.randn(64, 256)
    for mode in ("train", "inference"):
        fake = estimate(model, x, batch_sizes=[8, 64], mode=mode, device="cpu")
        real = profile(model, x, batch_sizes=[8, 64], mode=mode, device="cpu")
        assert [s.peak_bytes for s in fake.steps] == [s.peak_bytes for s in real.steps]
        assert [s.breakdown for s in fake.steps] == [s.breakdown for s in real.steps]


@pytest.mark.slow
@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2 to read the heap")
def test_the_estimate_is_within_10_percent_of_the_heap_the_real_step_used() -> None:
    model, x = Blocks(512, 2048), torch.randn(256, 512)
    predicted = estimate(model, x, device="cpu").steps[0].peak_bytes
    profile(model, x, device="cpu")  # warm-up: libraries allocate their own buffers on first use
    measured = profile(model, x, device="cpu").steps[0].allocator_peak_bytes
    assert measured is not None and abs(predicted / measured - 1) < 0.10


@pytest.mark.slow
def test_an_lstm_holds_its_own_weights_in_its_flat_weight_list_after_a_step() -> None:
    # nn.LSTM keeps its weights a second time, in _flat_weights, refreshed by its forward: left holding
    # the step's tensors, it kept them alive after the step
    model = nn.LSTM(16, 32, num_layers=2, batch_first=True)
    own = [id(weight) for weight in model._flat_weights]
    for verb in (estimate, profile):
        for mode in ("train", "inference"):
            verb(model, torch.randn(4, 8, 16), mode=mode, device="cpu")
            assert [id(weight) for weight in model._flat_weights] == own


@pytest.mark.slow
@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2 to read the heap")
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_an_lstms_heap_measured_after_an_earlier_profile_matches_the_estimate(mode: str) -> None:
    # the earlier profile's copies of the weights (3.5 MiB), freed by this one's first forward, read
    # as this step's heap shrinking: its estimate was 1.3 times it
    model, x = nn.LSTM(128, 256, num_layers=2, batch_first=True), torch.randn(8, 16, 128)
    predicted = estimate(model, x, mode=mode, device="cpu").steps[0].peak_bytes
    profile(model, x, mode=mode, device="cpu")
    measured = profile(model, x, mode=mode, device="cpu").steps[0].allocator_peak_bytes
    assert measured is not None and abs(predicted / measured - 1) < 0.05


@pytest.mark.slow
def test_inference_holds_no_gradients_and_keeps_no_activations() -> None:
    model, x = Blocks(), torch.randn(64, 256)
    train = estimate(model, x, device="cpu").steps[0]
    infer = estimate(model, x, mode="inference", device="cpu").steps[0]
    assert infer.breakdown["gradients"] == infer.breakdown["optimizer_state"] == 0
    assert infer.breakdown["activations"] == 0 and infer.peak_bytes < train.peak_bytes / 3


@pytest.mark.slow
def test_checkpointing_blocks_cuts_the_forward_peak_and_matches_a_real_run() -> None:
    model, x = Blocks(), torch.randn(512, 256)
    plain = estimate(model, x, device="cpu").steps[0]
    blocks = estimate(model, x, checkpointing="blocks", device="cpu").steps[0]
    assert blocks.phases["forward"] < plain.phases["forward"] - 4 * 512 * 1024 * 4  # most hidden states gone
    assert blocks.peak_bytes == profile(model, x, checkpointing="blocks", device="cpu").steps[0].peak_bytes
    assert not any(name == "forward" for name in vars(model.blocks[0]))  # the model is left as it was


@pytest.mark.slow
def test_activations_are_attributed_to_the_modules_that_saved_them() -> None:
    step = estimate(Blocks(), torch.randn(64, 256), device="cpu").steps[0]
    hidden, width = 64 * 1024 * 4, 64 * 256 * 4  # float32 bytes of a block's hidden and outer widths
    for block in range(4):
        assert step.modules[f"blocks.{block}.1"] == hidden  # GELU keeps its input
        assert step.modules[f"blocks.{block}.2"] == hidden  # the second Linear keeps the GELU's output
    for block in (1, 2, 3):  # block 0's first Linear keeps the model's input, counted as an input
        assert step.modules[f"blocks.{block}.0"] == width
    assert "blocks.0.0" not in step.modules and step.modules["head"] == width


def test_the_peak_grows_on_a_line_in_the_batch_size_and_predicts_another() -> None:
    model, x = Blocks(), torch.randn(8, 256)
    report = estimate(model, x, batch_sizes=[16, 32, 64], mode="inference", device="cpu")
    at_128 = estimate(model, x, batch_sizes=[128], mode="inference", device="cpu").steps[0].peak_bytes
    assert report.per_sample_bytes and report.per_sample_bytes > 0
    assert abs(report.predict(128) / at_128 - 1) < 0.01


@pytest.mark.slow
def test_optimizer_and_precision_change_what_the_step_holds() -> None:
    model, x = Blocks(), torch.randn(32, 256)
    weights = _params_bytes(model)
    sgd = estimate(model, x, optimizer="sgd", device="cpu").steps[0]
    plain = estimate(model, x, optimizer="sgd-no-momentum", device="cpu").steps[0]
    bf16 = estimate(model, x, precision="bf16", device="cpu").steps[0]
    assert sgd.breakdown["optimizer_state"] == weights and plain.breakdown["optimizer_state"] == 0
    assert bf16.breakdown["parameters"] == weights // 2


def test_cuda_sizes_are_rounded_like_the_caching_allocator() -> None:
    model = nn.Linear(3, 5)  # 15 weights + 5 biases: 60 and 20 bytes, 512 each on CUDA
    step = estimate(model, torch.randn(2, 3), mode="inference", device="cuda").steps[0]
    assert step.breakdown["parameters"] == 2 * 512


@pytest.mark.slow
def test_a_model_built_on_meta_is_estimated_without_memory_for_its_weights() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(8192, 8192) for _ in range(16)))  # 4 GiB of float32
    step = estimate(model, torch.randn(4, 8192), device="cuda").steps[0]
    assert step.breakdown["parameters"] > 4 * 2**30 and step.breakdown["optimizer_state"] > 8 * 2**30


@pytest.mark.slow
def test_a_hugging_face_model_is_estimated_and_its_layers_named() -> None:
    pytest.importorskip("transformers")
    from tests.zoo.transformers_models import TRANSFORMERS

    model = TRANSFORMERS["llama"]()
    report = estimate(model, torch.randint(0, 100, (2, 32)), batch_sizes=[2, 4], device="cpu")
    assert report.steps[1].peak_bytes > report.steps[0].peak_bytes
    forward = estimate(model, torch.randint(0, 100, (2, 32)), device="cpu", checkpointing="blocks")
    assert forward.steps[0].phases["forward"] < report.steps[0].phases["forward"]


def test_bad_options_are_clear_errors() -> None:
    model, x = Blocks(), torch.randn(4, 256)
    cases = [
        (dict(optimizer="lion"), "unknown optimizer 'lion'"),
        (dict(precision="fp8"), "unknown precision 'fp8'"),
        (dict(mode="eval"), "mode must be train or inference"),
        (dict(device="mps"), "device must be cpu or cuda"),
        (dict(device="not a device"), "device must be cpu or cuda"),
        (dict(batch_sizes=[0]), "batch sizes must be positive"),
        (dict(checkpointing=["nope"]), "names no module"),
    ]
    for options, message in cases:
        with pytest.raises(slimtorch.SlimtorchError, match=message):
            estimate(model, x, **options)
    with pytest.raises(slimtorch.SlimtorchError, match="found no repeated blocks"):
        estimate(nn.Linear(4, 4), torch.randn(2, 4), checkpointing="blocks")


@pytest.mark.slow
def test_cli_prints_the_breakdown_and_the_largest_batch_in_a_budget(capsys) -> None:
    from slimtorch.cli.main import main

    args = ["memory", "tests.support.models:Blocks", "--input-shape", "8,256", "--device", "cpu"]
    assert main([*args, "--batch", "8", "64", "--budget", "40MB"]) == 0
    text = capsys.readouterr().out
    assert "optimizer state" in text and "per sample" in text and "largest batch predicted to fit" in text
    assert "peak, steady state" in text and "peak, first step" in text
    assert main([*args, "--batch", "8", "64", "--json", "--checkpointing", "blocks"]) == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert data["schema"] == "slimtorch.memory/1" and len(data["steps"]) == 2
    assert data["steps"][0]["breakdown"]["parameters"] == _params_bytes(Blocks())
    assert data["steps"][0]["steady_peak_bytes"] == data["steps"][0]["peak_bytes"]
    assert 0 < data["steps"][0]["first_step_peak_bytes"] <= data["steps"][0]["peak_bytes"]


@pytest.mark.slow
def test_cli_gives_each_ranks_peak_under_a_strategy(capsys) -> None:
    from slimtorch.cli.main import main

    args = ["memory", "tests.support.models:Blocks", "--input-shape", "8,256", "--device", "cpu"]
    assert main([*args, "--parallel", "fsdp", "--world-size", "4"]) == 0
    assert "per rank, fsdp on 4: peak" in capsys.readouterr().out
    assert main([*args, "--parallel", "ddp", "--world-size", "2", "--json"]) == 0
    data = __import__("json").loads(capsys.readouterr().out)
    assert data["per_rank"]["strategy"] == "ddp" and data["per_rank"]["world_size"] == 2
    assert main([*args, "--world-size", "2"]) == 2  # ranks without a strategy: one line, exit 2
    assert "parallel=" in capsys.readouterr().err


def test_cli_bad_input_is_one_line_and_exit_2(capsys) -> None:
    from slimtorch.cli.main import main

    args = ["memory", "tests.support.models:Blocks", "--input-shape", "8,256"]
    assert main([*args, "--checkpointing", "nothing.here"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names no module" in err[0]
    assert main(["memory", "no_such_module:factory"]) == 2
    assert "cannot import" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--budget", "lots"])
    assert exit_info.value.code == 2


class _Loop:
    """A real training loop of ``Blocks``: one AdamW kept from step to step, ``zero_grad(set_to_none=True)``.
    A step whose peak is above the budget (the heap it adds plus the weights and optimizer state it starts
    with) runs out of memory, as the CPU allocator says it. Counts its steps."""

    def __init__(self, model: nn.Module, budget: int) -> None:
        self.model, self.budget, self.calls = model, budget, 0
        self.optimizer = torch.optim.AdamW(model.parameters())

    def run(self, batch_size: int) -> None:
        self.model(torch.randn(batch_size, 256)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def peak(self, batch_size: int) -> int:
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        resident = _params_bytes(self.model) + sum(v.numel() * v.element_size() for v in state)
        return memory.measure_peak(lambda: self.run(batch_size), "cpu", resident)

    def __call__(self, batch_size: int) -> None:
        self.calls += 1
        if self.peak(batch_size) > self.budget:
            raise torch.OutOfMemoryError("DefaultCPUAllocator: can't allocate memory: over the budget")


@pytest.mark.slow
@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2 to read the heap")
def test_find_batch_size_lands_near_the_true_largest_in_at_most_3_trials_of_2_real_steps() -> None:
    model = Blocks()
    loop = _Loop(model, budget=10**12)
    loop.run(3000)  # BLAS keeps the work buffers of the largest product it has seen: grow them first
    budget = loop.peak(1500)  # 1500 fits, just, with the optimizer's state alive
    loop.budget = budget
    report = estimate(model, torch.randn(8, 256), batch_sizes=[64, 128], device="cpu")
    found = memory.find_batch_size(loop, report, budget=budget, margin=0.0)
    assert len(found.trials) <= 3 and loop.calls <= 2 * len(
        found.trials
    )  # a first step out of memory ends one
    assert any(t.fits and t.batch_size == found.batch_size for t in found.trials)  # a real step ran at it
    assert 0.9 * 1500 <= found.batch_size <= 1.05 * 1500


@pytest.mark.slow
@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2 to read the heap")
def test_find_batch_size_never_returns_a_batch_whose_third_step_runs_out_of_memory() -> None:
    model = Blocks()
    warm = _Loop(model, budget=10**12)
    warm.run(3000)  # BLAS work buffers grown first, as in a loop that has run a while
    budget = warm.peak(1000)
    report = estimate(model, torch.randn(8, 256), batch_sizes=[64, 128], device="cpu")
    first_step_fits = max(b for b in range(1, 3000) if _first_step_peak(report, b) <= budget)
    assert report.largest_batch(budget) < 0.95 * first_step_fits  # sizing by step 1 would be too large
    found = memory.find_batch_size(_Loop(model, budget), report, budget=budget).batch_size
    fresh = _Loop(model, budget)  # a new loop at the batch found: none of its steps runs out of memory
    for _ in range(3):
        fresh(found)
    assert found >= 0.9 * 1000


def _first_step_peak(report: memory.MemoryReport, batch_size: int) -> float:
    """The first step's peak at ``batch_size``, on the line through the report's first-step peaks."""
    (b0, p0), (b1, p1) = ((s.batch_size, s.first_step_peak_bytes) for s in report.steps)
    return p0 + (p1 - p0) / (b1 - b0) * (batch_size - b0)


@pytest.mark.slow
def test_find_batch_size_backs_off_after_running_out_of_memory() -> None:
    report = estimate(Blocks(), torch.randn(8, 256), batch_sizes=[64, 128], device="cpu")
    budget = report.predict(1000)
    limit = int(0.85 * report.largest_batch(budget))  # the real limit is lower than the estimate says

    def step(batch_size: int) -> None:
        if batch_size > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    found = memory.find_batch_size(step, report, budget=budget, margin=0.0, max_trials=3)
    assert not found.trials[0].fits and found.batch_size <= limit
    assert all(t.batch_size < found.trials[0].batch_size for t in found.trials[1:])  # never back up to it


def test_out_of_memory_is_told_by_type_then_message() -> None:
    assert memory.is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: 8 GB"))
    assert memory.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not memory.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not memory.is_out_of_memory(ValueError("out of memory"))


@pytest.mark.slow
def test_find_batch_size_lets_other_errors_through_and_needs_two_batch_sizes() -> None:
    report = estimate(Blocks(), torch.randn(8, 256), batch_sizes=[8, 16], device="cpu")

    def broken(batch_size: int) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        memory.find_batch_size(broken, report, budget=10**9)
    single = estimate(Blocks(), torch.randn(8, 256), device="cpu")
    with pytest.raises(slimtorch.SlimtorchError, match="two or more batch sizes"):
        memory.find_batch_size(broken, single, budget=10**9)
    with pytest.raises(slimtorch.SlimtorchError, match="give find_batch_size a budget"):
        memory.find_batch_size(broken, report, device="cpu")


def test_find_batch_size_agrees_across_ranks(tmp_path) -> None:
    import torch.distributed as dist

    report = estimate(Blocks(), torch.randn(8, 256), batch_sizes=[64, 128], mode="inference", device="cpu")
    budget = report.predict(3000)
    expected = report.largest_batch(budget)

    def step(batch_size: int) -> None:  # fits up to the prediction, not a sample more
        if batch_size > expected:
            raise torch.OutOfMemoryError("CUDA out of memory.")

    alone = memory.find_batch_size(step, report, budget=budget, margin=0.0).batch_size
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert memory.find_batch_size(step, report, budget=budget, margin=0.0).batch_size == alone == expected
    finally:
        dist.destroy_process_group()


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 5) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2 to read the heap")
def test_fit_meets_60_percent_of_the_peak_and_trains_exactly_as_before() -> None:
    import copy

    torch.manual_seed(0)
    base, x = Blocks(), torch.randn(2048, 256)
    y = torch.randint(0, 10, (2048,))
    resident = _params_bytes(base)

    def peak(model: nn.Module) -> int:
        """The third step of a real loop, measured (the optimizer's state alive from the second on)."""
        optimizer = torch.optim.AdamW(model.parameters())

        def step() -> None:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(), step()
        return memory.measure_peak(step, "cpu", resident + 2 * resident)  # weights and the two moments

    peak(copy.deepcopy(base))  # warm-up
    budget = int(0.6 * peak(copy.deepcopy(base)))
    fitted = copy.deepcopy(base)
    plan = memory.fit(
        fitted, x, budget=budget, device="cpu", loss_fn=lambda out: nn.functional.cross_entropy(out, y)
    )
    assert plan.checkpointed and plan.precision == "fp32" and plan.fits
    assert peak(copy.deepcopy(fitted)) <= budget
    assert _train(fitted, x, y) == _train(copy.deepcopy(base), x, y)  # checkpointing is exact
    plan.remove()
    assert "forward" not in vars(fitted.blocks[0]) and "forward" not in vars(fitted)


@pytest.mark.slow
def test_fit_turns_to_mixed_precision_when_checkpointing_is_not_enough_and_refuses_the_impossible() -> None:
    model, x = Blocks(), torch.randn(4096, 256)
    every = estimate(model, x, checkpointing="blocks", device="cpu").steps[0].peak_bytes
    plan = memory.fit(model, x, budget=int(every * 0.97), device="cpu")
    assert plan.precision == "bf16-mixed" and plan.fits
    plan.remove()
    with pytest.raises(slimtorch.SlimtorchError, match="no plan fits"):
        memory.fit(model, x, budget=10**6, device="cpu")
    assert "forward" not in vars(model)  # a refused plan leaves nothing applied


@pytest.mark.slow
def test_cli_draws_memory_over_the_step(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from slimtorch.cli.main import main

    chart = tmp_path / "memory.png"
    args = ["memory", "tests.support.models:Blocks", "--input-shape", "8,256", "--device", "cpu"]
    assert main([*args, "--batch", "8", "64", "--budget", "40MB", "--chart", str(chart)]) == 0
    assert f"wrote {chart}" in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


@pytest.mark.slow
def test_the_curve_follows_the_step_through_its_phases() -> None:
    step = estimate(Blocks(), torch.randn(64, 256), device="cpu").steps[0]
    phases = [phase for phase, _ in step.curve]
    assert phases.index("forward") < phases.index("backward") < phases.index("optimizer")
    assert max(nbytes for _, nbytes in step.curve) == step.peak_bytes


class _Counts(nn.Module):
    """A step whose shapes depend on the data: a histogram (chgnet's bincount) or a selection."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.op == "bincount":
            return y.sum() + torch.bincount((x[:, 0] > 0).long()).sum()
        if self.op == "nonzero":
            return y[y.nonzero(as_tuple=True)].sum()
        return y.sum() * (1 if x.sum().item() > 0 else -1)  # a value read back into Python


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = _Counts("bincount")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@pytest.mark.parametrize(
    ("model", "operator", "where"),
    [
        (_Counts("bincount"), "aten.bincount", "_Counts.forward"),
        (_Counts("nonzero"), "aten.nonzero", "_Counts.forward"),
        (_Counts("item"), "aten._local_scalar_dense", "_Counts.forward"),
        (_Wrapped(), "aten.bincount", "module 'head'"),
    ],
)
def test_a_step_with_data_dependent_shapes_is_refused_in_one_line_naming_the_operator(model, operator, where):
    with pytest.raises(slimtorch.SlimtorchError) as refused:
        estimate(model, torch.randn(8, 4))
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert operator in message and where in message and "slimtorch.memory.profile" in message
    assert profile(model, torch.randn(8, 4)).peak_bytes > 0  # measuring it on real tensors works
