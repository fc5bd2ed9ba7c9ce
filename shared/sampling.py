"""Sampling parameters: the one definition the coordinator and the last stage share.

Owns the fields of a request's sampling rules and their limits (`check` raises `InvalidInput`
naming the field and the limit). Reading and writing the wire message is `wire`'s. Imports
neither torch, grpc nor protobuf, so the engine and the coordinator use it alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidInput

MAX_LOGPROBS = 20
MAX_SPECULATE = 16  # tokens drafted for speculative decoding that one step may verify, at most


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p
    min_p: float = 0.0  # drop tokens below min_p times the most likely one's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the sequence
    seed: int | None = None  # makes a non-greedy draw reproducible
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: also the top n

    def check(self) -> None:
        """Raise InvalidInput (a ValueError) naming the field and its limit."""
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInput(f"temperature = {self.temperature} must be in [0, 100]")
        if not 0 <= self.top_k < 2**32:
            raise InvalidInput(f"top_k = {self.top_k} must be in [0, 2**32)")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInput(f"top_p = {self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidInput(f"min_p = {self.min_p} must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidInput(f"repetition_penalty = {self.repetition_penalty} must be in (0, 100]")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidInput(f"seed = {self.seed} must be in [0, 2**64)")
        if not 0 <= (self.logprobs or 0) <= MAX_LOGPROBS:
            raise InvalidInput(f"logprobs = {self.logprobs} must be in [0, {MAX_LOGPROBS}]")
