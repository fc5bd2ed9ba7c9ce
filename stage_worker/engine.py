"""One stage's step execution: validate a micro-batch, run the layers, sample on the last stage.

Owns the `StageModel`, its `PagedKVCache`, when a step last touched each sequence it holds
(monotonic seconds: the sequences a step names and those it copies a prefix from, whether or not
they ran) and the rules a step must satisfy. A step is checked sequence by sequence: a sequence
that breaks a rule (positions that skip, or repeat without `rewind`, token ids outside the
vocabulary, an unknown sequence, a cache that cannot hold it) is dropped from the step with a
typed error while the others run. A sequence may end with drafted tokens: the last stage verifies
them (`speculation`) and drops the KV of those it rejects; the other stages drop it when the next
step rewinds. Works on plain dataclasses and tensors; the servicer turns wire frames into these and back.

Knows nothing of gRPC, of the next hop or of which requests the sequences belong to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from layerline.shared.errors import InvalidInput
from layerline.shared.sampling import SamplingParams

from .fused import norm_kernel
from .kv_cache import KVCacheExhausted, PagedKVCache
from .llama import StageModel
from .native import POOL_DTYPES
from .paged_attention import attends_off_pools, rotary_kernel
from .sampler import Draw, argmax_kernel, reads_argmax, sample
from .speculation import logit_rows, verify


class StepInputError(InvalidInput):
    """A step, or one sequence of it, that breaks the rules of the wire contract."""


@dataclass(frozen=True)
class SequenceStep:
    sequence_id: str
    positions: tuple[int, ...]  # consecutive, starting at the tokens the cache already holds
    token_ids: tuple[int, ...] = ()  # the new tokens (first stage); empty on later stages
    sampling: SamplingParams | None = None  # what the last stage samples with
    history: tuple[int, ...] = ()  # token ids so far, for the repetition penalty
    prefix_from: str = ""  # a sequence whose KV of positions [0, positions[0]) is copied first
    draft: int = 0  # the last `draft` token ids are drafted: the last stage verifies them
    rewind: bool = False  # positions[0] may be below what the cache holds: the KV past it is dropped

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class SequenceError:
    sequence_id: str
    error: Exception  # a StepInputError or KVCacheExhausted


@dataclass
class StepOutput:
    kept: list[SequenceStep]  # the sequences that ran, in packed order
    hidden: torch.Tensor | None = None  # [T, hidden] of the kept sequences (not the last stage)
    draws: dict[str, Draw] = field(default_factory=dict)  # sequence id -> token (last stage)
    accepted: dict[str, tuple[Draw, ...]] = field(default_factory=dict)  # drafted tokens accepted, before draws'
    errors: list[SequenceError] = field(default_factory=list)


class StageEngine:
    """Runs steps in arrival order on one thread; everything it owns is touched only there."""

    def __init__(
        self,
        model: StageModel,
        cache: PagedKVCache,
        *,
        max_step_tokens: int = 8192,
        max_threads: int | None = None,
        prefill_threads: int | None = None,
        samples: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.cache = cache
        self.config = model.config
        self.max_step_tokens = max_step_tokens
        self.samples = samples  # False on tensor-parallel ranks > 0: rank 0 alone samples
        self.dtype = next(model.parameters()).dtype
        self.steps_computed = 0  # steps `run` completed since the start, and their compute time
        self.compute_seconds = 0.0
        self._lock = threading.Lock()
        self._chains: dict[str, str] = {}  # sequence id -> the chain it started on (one per held sequence)
        self.clock = clock  # seconds, only ever increasing: when steps touch sequences
        self._touched: dict[str, float] = {}  # held sequence id -> when a step last touched it
        # A step runs on this stage's share of the cores, and one alone on its chain on the
        # cores of the whole chain: the chain's other stages wait for it meanwhile.
        self.max_threads = max_threads or torch.get_num_threads()
        # Every token a decode row where the kernel (compiled now, not at the first step) reads the pools.
        self.token_rows = attends_off_pools(next(iter(cache.k.values())))
        if cache.device.type == "cpu" and cache.dtype in POOL_DTYPES:
            rotary_kernel(), norm_kernel(), argmax_kernel()  # its rotary, RMSNorm, greedy's argmax checked
        self.prefill_threads = prefill_threads or self.max_threads
        model.set_threads(torch.get_num_threads())  # and again each time `_use_threads` changes it

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def release(self, sequence_id: str) -> bool:
        with self._lock:
            self._chains.pop(sequence_id, None)
            self._touched.pop(sequence_id, None)
            return self.cache.release(sequence_id)

    def rewind(self, sequence_id: str, length: int) -> None:
        """Drop a held sequence's KV past its first `length` tokens (a guess that was not asked for)."""
        with self._lock:
            if sequence_id in self.cache and self.cache.length(sequence_id) > length:
                self.cache.truncate(sequence_id, length)

    def untouched(self, seconds: float) -> list[str]:
        """The held sequences no step has touched for longer than `seconds` (never a probe's scratch one)."""
        with self._lock:
            now = self.clock()
            held = self.cache.sequences()
            return [sid for sid in held if not sid.startswith("\x00") and now - self._touched[sid] > seconds]

    def probe(self) -> None:
        """Readiness: a real one-token forward through this stage on scratch KV, then released."""
        sid = "\x00probe"
        hidden = None if self.is_first else torch.zeros(1, self.config.hidden_size, dtype=self.dtype)
        out = self._step([SequenceStep(sid, (0,), (0,) if self.is_first else ())], hidden, alone=True)
        self.release(sid)
        if out.errors:
            raise out.errors[0].error

    def run(
        self, seqs: Sequence[SequenceStep], hidden: torch.Tensor | None = None, *, alone: bool = True, chain: str = ""
    ) -> StepOutput:
        """Run one micro-batch. `hidden` is [sum of tokens, hidden_size] on later stages.

        `alone`: no other step of the chain is in flight, so this one may take `prefill_threads`.
        `chain`: the route the step came by; a sequence belongs to the chain it started on, and only
        steps of that chain continue it or copy its KV.
        A step that returns is counted in `steps_computed` and `compute_seconds` (the probe is not)."""
        started = time.perf_counter()
        out = self._step(seqs, hidden, alone=alone, chain=chain)
        self.compute_seconds += time.perf_counter() - started
        self.steps_computed += 1
        return out

    def _step(
        self, seqs: Sequence[SequenceStep], hidden: torch.Tensor | None, *, alone: bool, chain: str = ""
    ) -> StepOutput:
        if not torch.is_inference_mode_enabled():  # a stage's compute thread stays in it (compute.py)
            with torch.inference_mode():
                return self._step(seqs, hidden, alone=alone, chain=chain)
        with self._lock:
            if self.cache.device.type == "cpu":
                self._use_threads(alone=alone)
            try:
                return self._run(seqs, hidden, chain)
            finally:
                self._touch(seqs)

    def _touch(self, seqs: Sequence[SequenceStep]) -> None:
        """A step touches the held sequences it names, as a sequence of it or as a prefix's lender."""
        now = self.clock()
        for seq in seqs:
            for sid in (seq.sequence_id, seq.prefix_from):
                if sid in self.cache:
                    self._touched[sid] = now

    def _use_threads(self, *, alone: bool) -> None:
        """Decoding a few tokens is bound by how fast the weights stream from memory, and on the
        CPUs measured (an AVX-512 Xeon, an AVX2 EPYC) two threads stream them 1.5-1.8x as fast
        as one: every step takes all the threads it may. torch's thread count belongs to the
        calling thread (the stage's compute thread, compute.py), so it is read there, not remembered."""
        wanted = self.prefill_threads if alone else self.max_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        self.model.set_threads(wanted)

    def _run(self, seqs: Sequence[SequenceStep], hidden: torch.Tensor | None, chain: str) -> StepOutput:
        self._check_step(seqs, hidden)
        out = StepOutput(kept=[])
        rows: list[range] = []  # the packed rows of each kept sequence
        row = 0
        seen: set[str] = set()
        for seq in seqs:
            n = seq.num_tokens
            try:
                if seq.sequence_id in seen:
                    raise StepInputError(f"sequence {seq.sequence_id!r} appears twice in one step")
                seen.add(seq.sequence_id)
                self._admit(seq, chain)
            except (StepInputError, KVCacheExhausted) as err:
                out.errors.append(SequenceError(seq.sequence_id, err))
            else:
                out.kept.append(seq)
                rows.append(range(row, row + n))
            row += n
        if not out.kept:
            return out
        if self.is_first:
            inputs = self.model.embed([t for s in out.kept for t in s.token_ids])
        else:
            assert hidden is not None
            if len(out.kept) < len(seqs):  # only the rows of the sequences that run
                hidden = hidden[torch.tensor([r for kept in rows for r in kept], dtype=torch.long)]
            inputs = hidden.to(device=self.cache.device, dtype=self.dtype)
        layout = self.cache.plan_step(
            [s.sequence_id for s in out.kept],
            [s.num_tokens for s in out.kept],
            sliding_window=self.config.sliding_window,
            drafts=[s.draft for s in out.kept],
            token_rows=self.token_rows,
        )
        if not self.is_last:
            out.hidden = self.model(inputs, cache=self.cache, layout=layout)
            return out
        drafts = [s.draft for s in out.kept]
        wanted = logit_rows(layout.seq_lens, drafts) if any(drafts) else layout.last_rows()
        greedy = self.samples and all(reads_argmax(s.sampling) for s in out.kept)  # drafts too: `verify` draws
        logits = self.model(inputs, cache=self.cache, layout=layout, logit_rows=wanted, argmax_only=greedy)
        if self.samples:
            self._sample(out, logits)
        return out

    def _admit(self, seq: SequenceStep, chain: str) -> None:
        """Check one sequence of a step and make room for its tokens. A sequence refused by a check
        keeps its KV as it was (one refused for want of KV has its rejected drafts dropped)."""
        self._check_chain(seq.sequence_id, chain)
        if seq.prefix_from:
            self._check_prefix(seq)
            self._check_chain(seq.prefix_from, chain, lender=True)
            self._check_sequence(seq, held=seq.positions[0])
            self.cache.copy_prefix(seq.prefix_from, seq.sequence_id, seq.positions[0], room_for=seq.num_tokens)
        else:
            rewind_to = self._rewind_to(seq)
            self._check_sequence(seq, held=rewind_to)
            if rewind_to is not None:  # only once the step is known good: bad input drops no KV
                self.cache.truncate(seq.sequence_id, rewind_to)
        self.cache.reserve(seq.sequence_id, seq.num_tokens)
        self._chains[seq.sequence_id] = chain

    def _sample(self, out: StepOutput, logits: torch.Tensor) -> None:
        if any(s.draft for s in out.kept):
            self._verify(out, logits)
            return
        params = [s.sampling or SamplingParams() for s in out.kept]
        draws = sample(
            logits,
            params,
            histories=[s.history for s in out.kept],
            positions=[s.positions[-1] + 1 for s in out.kept],
        )
        out.draws = {s.sequence_id: d for s, d in zip(out.kept, draws)}

    def _verify(self, out: StepOutput, logits: torch.Tensor) -> None:
        """Draw after each drafted token and accept while they agree. The rejected ones' KV stays
        until the sequence's next step rewinds it, on this stage as on every other and on every
        tensor-parallel rank (only rank 0 samples, so only a rewind reaches them all alike)."""
        kept = out.kept
        verified = verify(
            logits,
            params=[s.sampling or SamplingParams() for s in kept],
            drafted=[s.token_ids[len(s.token_ids) - s.draft :] for s in kept],
            histories=[s.history for s in kept],
            next_positions=[s.positions[-1] + 1 - s.draft for s in kept],
        )
        for seq, draws in zip(kept, verified):
            out.draws[seq.sequence_id] = draws[-1]
            if seq.draft:
                out.accepted[seq.sequence_id] = draws[:-1]

    def _rewind_to(self, seq: SequenceStep) -> int | None:
        """What a rewinding sequence will hold once the KV from its positions[0] on (drafted tokens
        that were rejected) is dropped. None when it does not rewind, or starts past what it holds
        (which `_check_sequence` refuses)."""
        if not seq.rewind or not seq.positions or seq.sequence_id not in self.cache:
            return None
        start = seq.positions[0]
        return start if 0 <= start <= self.cache.length(seq.sequence_id) else None

    def _check_step(self, seqs: Sequence[SequenceStep], hidden: torch.Tensor | None) -> None:
        total = sum(s.num_tokens for s in seqs)
        if total > self.max_step_tokens:
            raise StepInputError(f"step carries {total} tokens, above this stage's limit of {self.max_step_tokens}")
        if self.is_first:
            if hidden is not None:
                raise StepInputError("the first stage takes token ids, not hidden states")
            return
        if hidden is None:
            raise StepInputError(f"stage {self.model.layer_range} needs hidden states, none were sent")
        expected = (total, self.config.hidden_size)
        if tuple(hidden.shape) != expected:
            raise StepInputError(
                f"hidden states have shape {tuple(hidden.shape)}, the step's positions need {expected}"
            )

    def _check_chain(self, sequence_id: str, chain: str, *, lender: bool = False) -> None:
        """A sequence held here belongs to the chain it started on."""
        held = self._chains.get(sequence_id)
        if held is not None and held != chain:
            what = "prefix_from names" if lender else "sequence"
            raise StepInputError(f"{what} {sequence_id!r}: it belongs to another chain, not to this step's")

    def _check_prefix(self, seq: SequenceStep) -> None:
        """A shared prefix is copied only into a new sequence, from one that holds all of it."""
        sid, source = seq.sequence_id, seq.prefix_from
        if sid in self.cache:
            raise StepInputError(f"sequence {sid!r} already holds KV here: prefix_from starts only a new sequence")
        if source == sid:
            raise StepInputError(f"sequence {sid!r} names itself in prefix_from")
        length = seq.positions[0] if seq.positions else 0
        if length <= 0:
            raise StepInputError(f"sequence {sid!r} with prefix_from must start past position 0, at the prefix's end")
        if self.cache.length(source) < length:
            raise StepInputError(
                f"sequence {sid!r} prefix_from {source!r}: that sequence holds {self.cache.length(source)} "
                f"token(s) here, fewer than the {length} to copy"
            )

    def _check_sequence(self, seq: SequenceStep, *, held: int | None = None) -> None:
        """`held`: the tokens the sequence will hold before this step (default: what it holds)."""
        sid = seq.sequence_id
        if not sid:
            raise StepInputError("sequence_id must not be empty")
        if not seq.positions:
            raise StepInputError(f"sequence {sid!r} has no positions")
        if held is None:
            held = self.cache.length(sid)
        if seq.positions[0] != held:
            if held == 0 and sid not in self.cache:
                raise StepInputError(
                    f"unknown sequence id {sid!r}: it holds no tokens here, so its positions "
                    f"must start at 0, not {seq.positions[0]}"
                )
            raise StepInputError(
                f"sequence {sid!r} positions start at {seq.positions[0]}, expected {held} "
                "(positions may not skip or repeat)"
            )
        if list(seq.positions) != list(range(held, held + seq.num_tokens)):
            raise StepInputError(f"sequence {sid!r} positions must be consecutive")
        if seq.positions[-1] >= self.config.max_position_embeddings:
            raise StepInputError(
                f"sequence {sid!r} position {seq.positions[-1]} exceeds the model's "
                f"max_position_embeddings of {self.config.max_position_embeddings}"
            )
        self._check_tokens(seq)

    def _check_draft(self, seq: SequenceStep) -> None:
        sid, vocab = seq.sequence_id, self.config.vocab_size
        if seq.draft >= seq.num_tokens:
            raise StepInputError(
                f"sequence {sid!r} draft = {seq.draft}: must be fewer than its {seq.num_tokens} positions"
            )
        if not self.is_last:
            return
        if seq.sampling is None:
            raise StepInputError(f"sequence {sid!r} draft = {seq.draft}: the last stage needs its sample set")
        if len(seq.token_ids) != seq.num_tokens:
            raise StepInputError(
                f"sequence {sid!r} draft = {seq.draft}: the last stage needs a token id at each of its "
                f"{seq.num_tokens} positions, got {len(seq.token_ids)}"
            )
        if any(not 0 <= t < vocab for t in seq.token_ids[-seq.draft :]):
            raise StepInputError(f"sequence {sid!r} draft holds a token id outside the vocabulary [0, {vocab})")

    def _check_tokens(self, seq: SequenceStep) -> None:
        """The token ids the first stage embeds, and what the last stage samples with."""
        sid = seq.sequence_id
        if self.is_first:
            if len(seq.token_ids) != seq.num_tokens:
                raise StepInputError(
                    f"sequence {sid!r} has {len(seq.token_ids)} token ids for {seq.num_tokens} positions"
                )
            bad = [t for t in seq.token_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise StepInputError(
                    f"sequence {sid!r} token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})"
                )
        if seq.draft:
            self._check_draft(seq)
        if self.is_last and seq.sampling is not None:
            try:
                seq.sampling.check()
            except ValueError as err:
                raise StepInputError(f"sequence {sid!r} sampling {err}") from None
            if any(not 0 <= t < self.config.vocab_size for t in seq.history):
                raise StepInputError(f"sequence {sid!r} history holds a token id outside [0, {self.config.vocab_size})")
