"""The bench's interleaved rounds: every figure once a round, the order reversed in odd rounds."""

from __future__ import annotations

import statistics

import pytest

from layerline.bench.rounds import describe, interleaved, paired, paired_differences


def test_odd_rounds_run_the_figures_in_reverse_order() -> None:
    calls: list[str] = []
    counts = {"a": 0, "b": 0, "c": 0}

    def run(name: str):
        def measure() -> float:
            calls.append(name)
            counts[name] += 1
            return 10.0 * counts[name] + ord(name)

        return measure

    lines: list[str] = []
    samples = interleaved(3, {n: run(n) for n in "abc"}, show=lambda v: f"{v:.0f}", log=lines.append)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert samples == {"a": [107.0, 117.0, 127.0], "b": [108.0, 118.0, 128.0], "c": [109.0, 119.0, 129.0]}
    assert lines == [
        "round 1/3: a 107, b 108, c 109",
        "round 2/3 (reversed order): a 117, b 118, c 119",
        "round 3/3: a 127, b 128, c 129",
    ]


def test_paired_differences_are_taken_within_each_round_not_between_medians() -> None:
    """Rounds that drift apart: the median of the rounds' differences is 1, the difference of the medians 3."""
    one, two = [1.0, 2.0, 10.0], [5.0, 3.0, 11.0]
    assert paired_differences(two, one) == [4.0, 1.0, 1.0]
    assert statistics.median(paired_differences(two, one)) == 1.0
    assert statistics.median(two) - statistics.median(one) == 3.0
    with pytest.raises(ValueError, match="as many rounds on each side: 3 and 2"):
        paired_differences(two, one[:2])


def test_paired_ratios_are_taken_within_each_round() -> None:
    assert paired([2.0, 3.0, 9.0], [1.0, 6.0, 9.0]) == [2.0, 0.5, 1.0]
    assert describe([2.0, 0.5, 1.0]) == "2.000, 0.500, 1.000 (median 1.000)"
    with pytest.raises(ValueError, match="as many rounds on each side: 2 and 1"):
        paired([1.0, 2.0], [1.0])
