"""The ranks of a tensor-parallel stage: rank 0 leads every operation, the others follow.

Owns keeping the ranks in lockstep. Rank 0 serves gRPC; before it runs a step (or a release, a
probe, a keepalive) on its engine it broadcasts the operation and its inputs, and every other
rank runs the very same operation on its own engine, so their KV caches and collectives stay in
step. Inputs cross as plain tensors (int64 ids and positions, float64 sampling parameters,
UTF-8 bytes of sequence ids, the hidden states as they are): nothing is pickled.

A collective that does not complete within the process group's timeout raises; the rank that
sees it fails stop (`RankFailed`). Knows nothing of gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from layerline.shared.errors import Unreachable
from layerline.shared.sampling import SamplingParams

from .engine import SequenceStep, StageEngine, StepOutput

log = logging.getLogger(__name__)

STOP, RUN, RELEASE, PROBE, KEEPALIVE = range(5)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RankFailed(Unreachable):
    """A rank of this stage died or hung: the stage fails stop."""


class _Wire:
    """Broadcasts from rank 0 over the stage's process group; other ranks receive the same."""

    def __init__(self, group: dist.ProcessGroup | None, *, leader: bool) -> None:
        self.group = group
        self.leader = leader

    def ints(self, values: Sequence[int] = ()) -> list[int]:
        size = torch.tensor([len(values)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        data = (
            torch.tensor(list(values), dtype=torch.int64) if self.leader else torch.empty(int(size), dtype=torch.int64)
        )
        if int(size):
            dist.broadcast(data, 0, group=self.group)
        return data.tolist()

    def floats(self, values: Sequence[float] = ()) -> list[float]:
        size = torch.tensor([len(values)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        data = (
            torch.tensor(list(values), dtype=torch.float64)
            if self.leader
            else torch.empty(int(size), dtype=torch.float64)
        )
        if int(size):
            dist.broadcast(data, 0, group=self.group)
        return data.tolist()

    def strings(self, values: Sequence[str] = ()) -> list[str]:
        encoded = [v.encode() for v in values]
        lengths = self.ints([len(e) for e in encoded])
        blob = self.ints(list(b"".join(encoded)))
        out, at = [], 0
        for n in lengths:
            out.append(bytes(blob[at : at + n]).decode())
            at += n
        return out

    def tensor(self, t: torch.Tensor | None) -> torch.Tensor | None:
        meta = self.ints([] if t is None else [_DTYPES.index(t.dtype), *t.shape])
        if not meta:
            return None
        if not self.leader:
            t = torch.empty(meta[1:], dtype=_DTYPES[meta[0]])
        assert t is not None
        t = t.contiguous()
        dist.broadcast(t, 0, group=self.group)
        return t


def _steps_out(wire: _Wire, seqs: Sequence[SequenceStep]) -> None:
    wire.strings([s.sequence_id for s in seqs])
    wire.strings([s.prefix_from for s in seqs])
    wire.ints(
        [
            n
            for s in seqs
            for n in (len(s.positions), len(s.token_ids), len(s.history), s.sampling is not None, s.draft, s.rewind)
        ]
    )
    wire.ints([x for s in seqs for x in (*s.positions, *s.token_ids, *s.history)])
    wire.floats([x for s in seqs if s.sampling is not None for x in _sampling_floats(s.sampling)])


def _steps_in(wire: _Wire) -> list[SequenceStep]:
    ids = wire.strings()
    prefix_from = wire.strings()
    shape = wire.ints()
    flat = wire.ints()
    floats = wire.floats()
    seqs, at, fat = [], 0, 0
    for i, sid in enumerate(ids):
        n_pos, n_tok, n_hist, sampled, draft, rewind = shape[6 * i : 6 * i + 6]
        positions = tuple(flat[at : at + n_pos])
        tokens = tuple(flat[at + n_pos : at + n_pos + n_tok])
        history = tuple(flat[at + n_pos + n_tok : at + n_pos + n_tok + n_hist])
        at += n_pos + n_tok + n_hist
        sampling = None
        if sampled:
            sampling = _sampling_from(floats[fat : fat + 7])
            fat += 7
        seqs.append(SequenceStep(sid, positions, tokens, sampling, history, prefix_from[i], draft, bool(rewind)))
    return seqs


def _sampling_floats(p: SamplingParams) -> list[float]:
    return [
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        -1 if p.seed is None else p.seed,
        -1 if p.logprobs is None else p.logprobs,
    ]


def _sampling_from(v: list[float]) -> SamplingParams:
    return SamplingParams(
        temperature=v[0],
        top_k=int(v[1]),
        top_p=v[2],
        min_p=v[3],
        repetition_penalty=v[4],
        seed=None if v[5] < 0 else int(v[5]),
        logprobs=None if v[6] < 0 else int(v[6]),
    )


class LeadingEngine:
    """Rank 0's engine: every operation is broadcast to the other ranks before it runs here."""

    def __init__(self, engine: StageEngine, group: dist.ProcessGroup | None) -> None:
        self.engine = engine
        self._wire = _Wire(group, leader=True)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # is_first, is_last, cache, config, model ...

    def _op(self, op: int) -> None:
        try:
            self._wire.ints([op])
        except RuntimeError as err:
            raise RankFailed(f"a rank of this stage did not answer: {err}") from None

    def run(
        self,
        seqs: Sequence[SequenceStep],
        hidden: torch.Tensor | None = None,
        *,
        alone: bool = True,
        chain: str = "",
    ) -> StepOutput:
        try:
            self._op(RUN)
            _steps_out(self._wire, seqs)
            self._wire.strings([chain])
            self._wire.ints([alone])  # every rank takes the same threads: an all-reduce waits for the slowest
            self._wire.tensor(hidden)
            return self.engine.run(seqs, hidden, alone=alone, chain=chain)
        except RuntimeError as err:
            raise RankFailed(f"tensor-parallel step failed: {err}") from None

    def release(self, sequence_id: str) -> bool:
        self._op(RELEASE)
        self._wire.strings([sequence_id])
        return self.engine.release(sequence_id)

    def probe(self) -> None:
        self._op(PROBE)
        self.engine.probe()

    def keepalive(self) -> None:
        self._op(KEEPALIVE)

    def stop(self) -> None:
        self._op(STOP)


def follow(engine: StageEngine, group: dist.ProcessGroup | None) -> None:
    """A rank > 0: run what rank 0 broadcasts, until STOP; raises RankFailed when it goes silent."""
    wire = _Wire(group, leader=False)
    while True:
        try:
            (op,) = wire.ints()
            if op == STOP:
                return
            if op == RUN:
                seqs = _steps_in(wire)
                (chain,) = wire.strings()
                (alone,) = wire.ints()
                engine.run(seqs, wire.tensor(None), alone=bool(alone), chain=chain)
            elif op == RELEASE:
                engine.release(wire.strings()[0])
            elif op == PROBE:
                engine.probe()
        except RuntimeError as err:
            raise RankFailed(f"rank 0 of this stage went silent: {err}") from None
