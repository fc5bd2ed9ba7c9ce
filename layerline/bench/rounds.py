"""Interleaved rounds of `layerline bench`: every figure once a round, in an order that alternates.

A shared machine drifts (20-40% between rounds on the development machines, sometimes within
one), so each figure is measured once a round, beside the figures it is compared with, and the
median of its rounds kept. Odd rounds run the figures in the reverse order of even ones: in a
fixed order a figure always follows the same neighbour (transformers' batch, the products alone
in this process) and always comes at the same point of the round, so whatever that leaves
behind (the caches, a team of OpenMP threads still spinning, the machine's phase) would fall on
one side of a ratio in every round.

A ratio's headline is the ratio of the two medians. Beside it, the ratio within each round of
two figures measured in that round (`paired`): how far the rounds agree, which the medians hide.
A difference (the time an extra hop adds) is the median of the rounds' own (`paired_differences`):
the drift between rounds cancels in each.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping


def interleaved(
    rounds: int, runs: Mapping[str, Callable[[], object]], *, show: Callable[[object], str], log: Callable[[str], None]
) -> dict[str, list]:
    """Each of `runs` once a round for `rounds` rounds, in its order in even rounds and reversed
    in odd ones; the samples of each, by name, in round order."""
    samples: dict[str, list] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(runs[name]())
        order = "" if r % 2 == 0 else " (reversed order)"
        log(f"round {r + 1}/{rounds}{order}: " + ", ".join(f"{k} {show(v[-1])}" for k, v in samples.items()))
    return samples


def paired(numerator: list[float], denominator: list[float]) -> list[float]:
    """The ratio within each round of two figures measured in the same rounds."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired ratios need as many rounds on each side: {len(numerator)} and {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def paired_differences(minuend: list[float], subtrahend: list[float]) -> list[float]:
    """The difference within each round of two figures measured in the same rounds."""
    if len(minuend) != len(subtrahend):
        raise ValueError(f"paired differences need as many rounds on each side: {len(minuend)} and {len(subtrahend)}")
    return [a - b for a, b in zip(minuend, subtrahend, strict=True)]


def describe(ratios: list[float]) -> str:
    """'0.94, 1.02, 0.99 (median 0.99)'."""
    return ", ".join(f"{r:.3f}" for r in ratios) + f" (median {statistics.median(ratios):.3f})"
