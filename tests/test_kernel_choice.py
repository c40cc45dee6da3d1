"""How slimtorch picks a layer's kernel by timing, on canned timings (a fake clock, nothing really timed):
a float fallback wins only by a margin and only after it led on quiet timings for several rounds, so a
noisy neighbour's spike never hands a layer to a kernel five times slower; close calls on noisy timings
take more rounds, up to a cap and a time budget; every decision keeps what it measured."""

from __future__ import annotations

import itertools

import pytest
import torch

from slimtorch.quant import kernels

OUT = torch.ones(4)


class FakeClock:
    """A clock that moves only when a canned kernel runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def canned(clock: FakeClock, seconds: list[float], calls: list[int] | None = None):
    """A kernel whose n-th timed run takes ``seconds[n]`` (the last one from then on). Its first call is
    the agreement check, which is not timed."""
    count = itertools.count()

    def run() -> torch.Tensor:
        n = next(count)
        if n > 0:
            clock.now += seconds[min(n - 1, len(seconds) - 1)]
        if calls is not None:
            calls.append(n)
        return OUT.clone()

    return run


def decide(timings: dict[str, list[float]], reference: str = "dequantize") -> kernels.KernelDecision:
    clock = FakeClock()
    candidates = {name: canned(clock, seconds) for name, seconds in timings.items()}
    return kernels._fastest(candidates, reference, {}, clock)


def test_a_neighbours_spikes_never_hand_the_layer_to_a_fallback_five_times_slower() -> None:
    fast, slow = 0.010, 0.050
    rounds = 7  # a busy spell of the machine as long as seven rounds of both kernels
    for spike in (0.060, 0.100):  # 6x and 10x the quantized kernel's time, slower than the fallback
        for hit in itertools.product((False, True), repeat=rounds):  # every placement of spikes
            quantized = [spike if h else fast for h in hit] + [fast]
            decision = decide({"quantized_rnn": quantized, "dequantize": [slow]})
            assert decision.kernel == "quantized_rnn", (spike, hit, decision)


def test_a_fallback_clearly_faster_on_quiet_timings_wins_after_confirming_rounds() -> None:
    decision = decide({"quantized_rnn": [0.020], "dequantize": [0.010]})
    assert decision.kernel == "dequantize"
    assert decision.rounds == kernels.CONFIRM_TRIALS
    assert decision.ratio == pytest.approx(2.0)


def test_a_fallback_faster_by_less_than_the_margin_loses_and_the_ratio_says_so() -> None:
    decision = decide({"quantized_rnn": [0.011], "dequantize": [0.010]})
    assert decision.kernel == "quantized_rnn"
    assert decision.ratio == pytest.approx(0.010 / 0.011)


def test_a_clear_lead_on_quiet_timings_is_decided_in_the_first_rounds() -> None:
    decision = decide({"quantized_rnn": [0.010], "dequantize": [0.050]})
    assert (decision.kernel, decision.rounds) == ("quantized_rnn", kernels.TRIALS)
    assert decision.seconds == pytest.approx({"quantized_rnn": 0.010, "dequantize": 0.050})


def test_a_close_call_on_noisy_timings_takes_rounds_up_to_the_cap_and_keeps_the_best_of_each() -> None:
    noisy_a = [0.0010, 0.0030, 0.0030] * kernels.MAX_TRIALS  # its median is far above its best
    noisy_b = [0.0011, 0.0030, 0.0030] * kernels.MAX_TRIALS
    decision = decide({"onednn": noisy_a, "int_mm": noisy_b, "checker": [1.0]}, reference="checker")
    assert decision.rounds == kernels.MAX_TRIALS
    assert decision.kernel == "onednn"
    assert "checker" not in decision.seconds  # a checking reference is never timed against the others


def test_no_round_starts_past_the_time_budget() -> None:
    per_round = [0.1, 0.2, 0.2] * kernels.MAX_TRIALS  # two candidates, noisy and tied
    decision = decide({"onednn": per_round, "int_mm": per_round, "checker": [1.0]}, "checker")
    spent = [2 * sum(per_round[:n]) for n in range(kernels.MAX_TRIALS + 1)]
    assert kernels.TRIALS < decision.rounds < kernels.MAX_TRIALS
    assert spent[decision.rounds - 1] < kernels.ROUNDS_BUDGET_S <= spent[decision.rounds] + 1e-9


def test_a_fallback_ahead_on_a_busy_machine_is_timed_to_the_cap_before_it_wins() -> None:
    # the fallback is really faster (1.6x), but every candidate's rounds are noisy: no early verdict
    quantized = [0.016, 0.030, 0.030] * kernels.MAX_TRIALS
    fallback = [0.010, 0.020, 0.020] * kernels.MAX_TRIALS
    decision = decide({"quantized_rnn": quantized, "dequantize": fallback})
    assert decision.kernel == "dequantize"
    assert decision.rounds == kernels.MAX_TRIALS


def test_one_agreeing_candidate_is_chosen_without_timing() -> None:
    clock = FakeClock()
    calls: list[int] = []
    candidates = {
        "quantized_rnn": lambda: OUT * 2,  # disagrees with the reference: never chosen, never timed
        "dequantize": canned(clock, [0.010], calls),
    }
    decision = kernels._fastest(candidates, "dequantize", {}, clock)
    assert (decision.kernel, decision.rounds, decision.ratio, calls) == ("dequantize", 0, 1.0, [0])
    assert decision.describe() == (
        "dequantize (the only candidate that agreed); quantized_rnn refused: 1 relative error against the "
        "reference"
    )


def test_kernel_choice_keeps_each_decision_with_its_ratio_and_times_a_key_once() -> None:
    clock = FakeClock()
    choice = kernels.KernelChoice(clock)
    calls: list[int] = []
    candidates = {
        "quantized_rnn": canned(clock, [0.010], calls),
        "dequantize": canned(clock, [0.048]),
    }
    assert choice.best("lstm", candidates, "dequantize") == "quantized_rnn"
    assert choice.best("lstm", candidates, "dequantize") == "quantized_rnn"
    assert len(calls) == 1 + kernels.TRIALS  # the agreement check, then the rounds: measured once per key
    decision = choice.decisions()["lstm"]
    assert decision.ratio == pytest.approx(4.8)
    assert decision.describe() == f"quantized_rnn, 4.80x dequantize ({kernels.TRIALS} rounds)"
    assert decision.to_dict()["ratio"] == pytest.approx(4.8)
    assert choice.measured() == {"lstm": "quantized_rnn"}
    choice.clear()
    assert choice.decisions() == {} and choice.measured() == {}
