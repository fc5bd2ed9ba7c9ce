"""Sampling parameters: the one definition the coordinator and the last stage share.

Owns the fields of a request's sampling rules, their limits (`check` raises a ValueError that
names the field and the limit) and their reading from the wire message, where an absent field
takes the neutral value the proto documents. Imports neither torch nor grpc, so the
coordinator uses it as freely as the stage worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from layerline.protos.v1 import common_pb2

MAX_LOGPROBS = 20


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
        """Raise ValueError naming the field and its limit."""
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature = {self.temperature} must be in [0, 100]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p = {self.top_p} must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p = {self.min_p} must be in [0, 1]")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty = {self.repetition_penalty} must be in (0, 100]")
        if not 0 <= (self.logprobs or 0) <= MAX_LOGPROBS:
            raise ValueError(f"logprobs = {self.logprobs} must be in [0, {MAX_LOGPROBS}]")

    @classmethod
    def from_wire(cls, msg: common_pb2.SamplingParams) -> SamplingParams:
        """Read the wire message; absent fields take the proto's documented defaults."""
        return cls(
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            min_p=msg.min_p,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        )

    def to_wire(self, msg: common_pb2.SamplingParams) -> None:
        """Fill `msg` (max_tokens and stop are the coordinator's, and are not sent on)."""
        msg.temperature = self.temperature
        msg.top_p = self.top_p
        msg.top_k = self.top_k
        msg.min_p = self.min_p
        msg.repetition_penalty = self.repetition_penalty
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
