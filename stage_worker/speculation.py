"""Verifying drafted tokens on the last stage (speculative decoding; pure torch).

A sequence of a step may end with `draft` tokens the coordinator guessed (by prompt lookup) and
has not accepted yet. The last stage computes the logits after each of the sequence's last
`draft + 1` positions in one forward, and here draws the token after each of them exactly as it
would without a draft (the same rules, the repetition penalty over the tokens before it, the same
per-position seed), accepting drafted tokens while they equal the draws. The first draw that
differs, or the draw after the last drafted token, follows them.

Why this is the standard acceptance rule: a prompt-lookup draft is deterministic (its q puts all
mass on the drafted token d), so the rule "accept d with probability min(1, p(d) / q(d)) = p(d),
else draw from max(p - q, 0) renormalized, which is p without d" is exactly "draw x from p and
accept when x == d": x == d has probability p(d), and x given x != d is p without d,
renormalized. Drawn that way, greedy output is the argmax at every position, and seeded output
is token for token what the same seed gives without speculation.

Knows nothing of sequences' storage, the network or the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerline.shared.sampling import SamplingParams

from .sampler import Draw, sample


def logit_rows(seq_lens: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
    """[sum of (draft + 1)] the packed rows whose logits are needed: each sequence's last
    `draft + 1` rows (its last row alone when it drafted nothing)."""
    rows: list[int] = []
    end = 0
    for n, draft in zip(seq_lens, drafts, strict=True):
        end += n
        rows.extend(range(end - 1 - draft, end))
    return torch.tensor(rows, dtype=torch.long)


def verify(
    logits: torch.Tensor,
    *,
    params: Sequence[SamplingParams],
    drafted: Sequence[Sequence[int]],
    histories: Sequence[Sequence[int]],
    next_positions: Sequence[int],
) -> list[tuple[Draw, ...]]:
    """Per sequence: the drafted tokens it accepts, then one more draw.

    `logits` [sum of (len(drafted[i]) + 1), vocab] are the rows `logit_rows` chose, in order;
    `histories[i]` the tokens sequence i held before its drafted ones (for the repetition
    penalty); `next_positions[i]` the position of the token after its last undrafted one.
    """
    row_params: list[SamplingParams] = []
    row_histories: list[Sequence[int]] = []
    row_positions: list[int] = []
    for p, draft, history, position in zip(params, drafted, histories, next_positions, strict=True):
        for j in range(len(draft) + 1):
            row_params.append(p)
            row_histories.append([*history, *draft[:j]] if p.repetition_penalty != 1.0 else ())
            row_positions.append(position + j)
    draws = sample(logits, row_params, histories=row_histories, positions=row_positions)
    verified: list[tuple[Draw, ...]] = []
    at = 0
    for draft in drafted:
        mine = draws[at : at + len(draft) + 1]
        accepted = 0
        while accepted < len(draft) and mine[accepted].token_id == draft[accepted]:
            accepted += 1
        verified.append(tuple(mine[: accepted + 1]))
        at += len(draft) + 1
    return verified
