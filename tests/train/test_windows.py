"""The windows of a run (train.costs.windows): where the step time settles, and time and energy read together."""

import pytest

from train.costs import windows
from train.costs.windows import Reading, Span, Tally


def test_the_h100_profile_settles_after_twenty_steps():
    """Steps of 235 ms (10), 73 ms (10) and 26 ms (80), as the fused kernels' first steps were on an H100."""
    times = [0.235] * 10 + [0.073] * 10 + [0.026] * 80
    assert windows.steady_median(times) == 0.026
    assert windows.warmup_flags(times, [0]) == [True] * 20 + [False] * 80


def test_a_lucky_fast_step_does_not_end_warm_up_and_a_later_hiccup_stays_steady():
    times = [0.2, 0.2, 0.02, 0.2, 0.2, 0.2] + [0.02] * 10 + [0.5] + [0.02] * 10
    # Step 2 is fast but the median of steps 2-6 is 0.2: still warm-up. Step 16's 0.5 s comes after settling.
    assert windows.warmup_flags(times, [0]) == [True] * 6 + [False] * 21


def test_within_ten_percent_of_the_steady_median_is_settled():
    steady = 0.1
    assert windows.settled_offset([0.111, 0.109, 0.1, 0.1, 0.1, 0.1], steady) == 1  # 0.111 > 0.11 >= 0.109
    assert windows.settled_offset([0.3, 0.3, 0.3], steady) == 3  # never settles: all warm-up


def test_each_resumed_segment_has_its_own_warm_up():
    first, second = [0.3] * 3 + [0.02] * 20, [0.4] * 2 + [0.02] * 20
    flags = windows.warmup_flags(first + second, [0, len(first)])
    assert [index for index, warm in enumerate(flags) if warm] == [0, 1, 2, 23, 24]
    # Steps before the first recorded segment (a log that did not record them) are not warm-up.
    assert windows.warmup_flags(first, [3]) == [False] * 23
    assert windows.warmup_flags([], [0]) == []


def test_readings_and_sums_keep_unknown_energy_unknown():
    span = Reading(12.5, 300.0).since(Reading(10.0, 100.0))
    assert span == Span(2.5, 200.0)
    assert Reading(12.5, None).since(Reading(10.0, 100.0)) == Span(2.5, None)
    assert span + Span(1.0, 50.0) == Span(3.5, 250.0) and (span + Span(1.0, None)).energy_j is None
    assert windows.total([1.0, 2.5]) == 3.5 and windows.total([1.0, None]) is None and windows.total([]) == 0.0
    tally = Tally()
    tally.add(Span(2.0, 10.0))
    tally.add(Span(1.0, 5.0))
    assert (tally.count, tally.time_s, tally.energy_j) == (2, 3.0, pytest.approx(15.0))
