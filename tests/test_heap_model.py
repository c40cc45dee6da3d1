"""The resident-memory prediction: glibc's malloc modelled over a step's allocations (``memory.heap``), and
``estimate``'s ``resident_bytes`` against a real loop's RSS growth in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimtorch import memory
from slimtorch.memory.heap import (
    ALIGNMENT,
    HEADER,
    MMAP_THRESHOLD,
    PAGE,
    kernel_scratch,
    repeated,
    resident_peak,
)

KiB, MiB = 2**10, 2**20
ROOT = Path(__file__).resolve().parent.parent


def mapped(nbytes: int) -> int:
    return -(-(nbytes + HEADER) // PAGE) * PAGE


def test_a_block_over_the_threshold_gets_pages_of_its_own_given_back_when_freed() -> None:
    # freed, its pages go back: a second block of the same size costs nothing more
    assert resident_peak([(1, MiB), (1, -MiB), (2, MiB)]) == mapped(MiB)
    assert resident_peak([(1, MiB), (2, MiB)]) == 2 * mapped(MiB)


def test_freeing_a_mapped_block_raises_the_threshold_and_smaller_blocks_then_stay_in_the_heap() -> None:
    half = 512 * KiB
    before = resident_peak([(1, half), (1, -half), (2, half), (2, -half), (3, 600 * KiB)])
    assert before == mapped(600 * KiB)  # all mapped: nothing kept
    # after a 1 MiB mapped block is freed, 512 KiB blocks live in the heap, and a freed one is kept there
    after = resident_peak([(1, MiB), (1, -MiB), (2, half), (3, half), (2, -half), (4, 600 * KiB)])
    heap_block = half + HEADER
    assert after == 2 * heap_block + 600 * KiB + HEADER  # the 600 KiB block did not fit the freed hole


def test_freed_neighbours_are_not_merged_but_a_hole_that_fits_is_reused() -> None:
    small = 48 * KiB  # twice it is still under the threshold: the heap
    assert 2 * small < MMAP_THRESHOLD
    block = small + HEADER
    # two freed neighbours (a and b) do not make room for one block twice their size: the top grows
    events = [(1, small), (2, small), (3, small), (1, -small), (2, -small), (4, 2 * small)]
    assert resident_peak(events) == 3 * block + (2 * small + HEADER)
    # a freed block that fits is reused: nothing grows
    assert resident_peak([(1, small), (2, small), (1, -small), (3, small)]) == 2 * block
    # the top comes down when the block at its edge is freed
    assert resident_peak([(1, small), (2, small), (2, -small), (1, -small), (3, small)]) == 2 * block


def test_a_request_takes_the_smallest_freed_block_that_fits() -> None:
    small = 16 * KiB
    big, medium = 3 * small, small  # a big hole below a small one: the small one is taken, whole
    events = [(1, big), (9, 1), (2, medium), (10, 1), (1, -big), (2, -medium), (3, medium), (4, 2 * small)]
    blocks = (big + HEADER) + (medium + HEADER) + 2 * (ALIGNMENT + HEADER)
    assert resident_peak(events) == blocks  # the 2x block then fits in the big hole, nothing grows
    first_fit_would_need = blocks + 2 * small + HEADER  # had the medium block gone into the big hole
    assert resident_peak(events) < first_fit_would_need


def test_an_ops_scratch_program_runs_around_its_outputs() -> None:
    small = 64 * KiB
    block = small + HEADER
    # the op at event 1 made one output (event 1) with one scratch block held across it: three at once
    assert resident_peak([(1, small), (2, small), (2, -small)], [(1, 2, (small,))]) == 3 * block
    # an op with no output: its scratch comes and goes at its place
    assert resident_peak([(1, small), (1, -small)], [(1, 1, (small,))]) == 2 * block
    # a reorder freed before the output is made (-small, then 0): the output fills its hole
    held = 96 * KiB  # under the threshold: the heap
    reorder = (small, held, -small, 0)
    assert (
        resident_peak([(1, small), (2, small), (2, -small)], [(1, 2, reorder)]) == 2 * block + held + HEADER
    )
    # blocks the program leaves alive are freed after the outputs: a later block reuses them
    assert resident_peak([(1, small), (3, small)], [(1, 1, (small, 0))]) == 2 * block


def test_repeating_the_steady_step_frees_each_copys_twins_and_keeps_the_live_set() -> None:
    events = [(0, 1000), (1, 500), (2, 200), (2, -200), (1, -500), (3, 500), (4, 200), (4, -200)]
    steady = range(4, 8)  # frees last step's gradient (1), makes its own (3)
    longer, _ = repeated(events, [], steady, 3)
    assert len(longer) == len(events) + 3 * len(steady)
    alive: dict[int, int] = {}
    for key, nbytes in longer:
        if nbytes > 0:
            assert key not in alive
            alive[key] = nbytes
        else:
            assert alive.pop(key) == -nbytes  # every free is of a block alive, of its size
    assert sorted(alive.values()) == [500, 1000]


def test_the_kernels_scratch_the_model_knows() -> None:
    aten = torch.ops.aten
    expanded = torch.ones(()).expand(16, 32)
    assert kernel_scratch(aten.mm.default, (expanded, torch.zeros(32, 8)), {}, None) == (16 * 32 * 4,)
    assert kernel_scratch(aten.mm.default, (torch.zeros(16, 32), torch.zeros(32, 8)), {}, None) == ()
    image = torch.zeros(2, 3, 8, 8)
    assert kernel_scratch(aten.add.Tensor, (image, image), {}, image) == ()
    norm = (torch.zeros(2, 4, 8, 8), image, None, None, None, None, None, True, 1e-5, [True, True, True])
    assert kernel_scratch(aten.native_batch_norm_backward.default, norm, {}, None) == (image.nbytes,)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the rules are oneDNN's")
def test_a_convolution_reorders_its_input_and_weights_then_keeps_a_blocked_output_across_its_own() -> None:
    """The sizes and order a malloc trace of a U-Net's 16-channel 3x3 convolution at batch 16 shows:
    +4096K +9K +4096K -9K -4096K, the output (4096K), -4096K; its backward: the gradient's reorder, the
    weights', a blocked input gradient, the output, then the weights' pass (both activations)."""
    aten = torch.ops.aten
    x, weight = torch.zeros(16, 16, 64, 64), torch.zeros(16, 16, 3, 3)
    args = (x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out = torch.zeros(16, 16, 64, 64)
    n, w = x.nbytes, weight.nbytes
    assert kernel_scratch(aten.convolution.default, args, {}, out) == (n, w, n, -w, -n, 0)
    gradients = (torch.zeros_like(x), torch.zeros_like(weight), None)
    backward = (out, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    program = (n, w, n, -w, -n, 0, n, n, w, -w, -n, -n)
    assert kernel_scratch(aten.convolution_backward.default, backward, {}, gradients) == program
    # a strided backward makes a second blocked input gradient once the reorders are gone
    strided = (torch.zeros(16, 16, 32, 32), *backward[1:4], [2, 2], *backward[5:])
    small = strided[0].nbytes
    assert kernel_scratch(aten.convolution_backward.default, strided, {}, gradients)[:7] == (
        small,
        w,
        n,
        -w,
        -small,
        n,
        0,
    )


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the rules are oneDNN's")
def test_a_convolution_pads_channels_to_a_block_and_reads_a_3_channel_image_as_it_is() -> None:
    aten = torch.ops.aten
    block = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
    image, weight = torch.zeros(4, 3, 32, 32), torch.zeros(2, 3, 1, 1)
    out = torch.zeros(4, 2, 32, 32)  # 2 channels, computed in a block of them
    args = (image, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert kernel_scratch(aten.convolution.default, args, {}, out) == (
        weight.nbytes,
        out.nbytes // 2 * block,
        -weight.nbytes,
        0,
    )
    # a slice of cat's gradient is copied first, and the copy freed last
    sliced = torch.zeros(4, 4, 32, 32)[:, :2]
    backward = (sliced, image, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
    program = kernel_scratch(aten.convolution_backward.default, backward, {}, (None, weight, None))
    assert program[0] == sliced.numel() * 4 and program[1] == 0  # no input gradient asked for


def test_the_prediction_is_on_the_cpu_only_and_is_more_than_the_live_peak() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    batch = torch.zeros(64, 256)
    cpu = memory.estimate(model, batch, device="cpu").steps[0]
    assert cpu.resident_bytes is not None and cpu.resident_bytes >= cpu.peak_bytes
    assert memory.estimate(model, batch, device="cuda").steps[0].resident_bytes is None
    assert "resident_bytes" in memory.estimate(model, batch, device="cpu").to_dict()["steps"][0]


# A real loop in a fresh process (this one's heap holds what earlier tests freed): its RSS growth.
LOOP_RUN = """
import json, sys, torch
from benchmarks.allocator_overhead import ZOO, first_float
from slimtorch.memory.allocator import measure_host
factory, inputs = ZOO[sys.argv[1]]
batch = inputs(int(sys.argv[2]))
with torch.device("meta"):
    factory()

def train():
    torch.manual_seed(0)
    model = factory().train()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        first_float(model(batch)).backward()
        optimizer.step()

print(json.dumps(measure_host(train).rss_growth))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the model is glibc's malloc")
@pytest.mark.parametrize(("name", "batch_size"), [("bert", 4), ("unet", 16)])
def test_a_real_loops_rss_growth_is_predicted_within_15_percent(name: str, batch_size: int) -> None:
    """BERT, and the U-Net at batch 16: its convolutions' scratch and its few block sizes (1-8 MiB)
    are where a first-fit heap or scratch held across outputs erred by 15-20%."""
    from benchmarks.allocator_overhead import ZOO, first_float

    command = [sys.executable, "-c", LOOP_RUN, name, str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    factory, inputs = ZOO[name]
    torch.manual_seed(0)
    step = memory.estimate(factory(), inputs(batch_size), device="cpu", loss_fn=first_float).steps[0]
    assert step.resident_bytes == pytest.approx(growth, rel=0.15), (step.resident_bytes / MiB, growth / MiB)
    assert step.resident_bytes > 1.15 * step.peak_bytes  # what malloc keeps is not nothing
