"""Choosing the next token from the last stage's logits (pure torch).

Owns the sampling rules: repetition penalty, temperature (0 means greedy), top-k, top-p,
min-p, a per-request seed that makes a draw reproducible whatever else shares the batch, and
optional top-n log-probabilities. Processing order follows Hugging Face transformers':
repetition penalty, temperature, top-k, top-p, min-p, then the draw.

Knows nothing of sequences' storage, the network or the tokenizer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence
    seed: int | None = None  # makes a non-greedy draw reproducible
    logprobs: int = 0  # how many top alternatives to report with each token

    def check(self) -> None:
        """Raise ValueError naming the field and its limit."""
        if not (self.temperature >= 0.0 and self.temperature <= 100.0):
            raise ValueError(f"temperature = {self.temperature} must be in [0, 100]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p = {self.min_p} must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty = {self.repetition_penalty} must be in (0, 100]")
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs = {self.logprobs} must be in [0, {MAX_LOGPROBS}]")


@dataclass(frozen=True)
class Draw:
    token_id: int
    logprob: float  # of the chosen token under the model's unprocessed distribution
    top: tuple[tuple[int, float], ...] = field(default=())  # (token id, logprob), best first


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    histories: Sequence[Sequence[int]],
    positions: Sequence[int],
) -> list[Draw]:
    """Draw one token per row of `logits` [B, vocab] (float32).

    `histories[i]` are the token ids row i's sequence holds so far (for the repetition
    penalty); `positions[i]` is the position the drawn token will take (mixed into the seed,
    so each step of a seeded request draws differently but reproducibly).
    """
    raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, vocab]
    draws: list[Draw] = []
    for i, p in enumerate(params):
        row = logits[i]
        if p.repetition_penalty != 1.0 and histories[i]:
            row = _penalize(row, histories[i], p.repetition_penalty)
        if p.temperature == 0.0:
            token = int(torch.argmax(row))
        else:
            probs = _filtered_probs(row / p.temperature, p)
            token = int(torch.multinomial(probs, 1, generator=_generator(p.seed, positions[i])))
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = torch.topk(raw_logprobs[i], p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        draws.append(Draw(token, float(raw_logprobs[i, token]), top))
    return draws


def _penalize(row: torch.Tensor, history: Sequence[int], penalty: float) -> torch.Tensor:
    ids = torch.tensor(sorted(set(history)), dtype=torch.long)
    seen = row[ids]
    row = row.clone()
    row[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return row


def _filtered_probs(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.top_k > 0 and p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= p.top_p  # keep the token crossing p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _generator(seed: int | None, position: int) -> torch.Generator | None:
    if seed is None:
        return None
    mixed = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed, "little") & (2**63 - 1))
