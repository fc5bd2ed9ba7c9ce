"""Choosing the next token from the last stage's logits (torch, and a compiled argmax for greedy rows).

Owns the sampling rules: repetition penalty, temperature (0 means greedy), top-k, top-p,
min-p, a per-request seed that makes a draw reproducible whatever else shares the batch, and
optional top-n log-probabilities. Processing order follows Hugging Face transformers':
repetition penalty, temperature, top-k, top-p, min-p, then the draw.

Knows nothing of sequences' storage, the network or the tokenizer.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from layerline.shared.sampling import SamplingParams

from . import native, paged_attention

log = logging.getLogger(__name__)

TWO_ROUNDS_FROM = 8  # rows from which `greedy` reduces in two rounds
HEAD = 256  # a top-p row's most likely tokens, sorted first: its nucleus where they reach p (`_kept`)


@dataclass(frozen=True)
class Draw:
    token_id: int
    logprob: float | None = None  # of the chosen token, unprocessed distribution; when asked
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
    so each step of a seeded request draws differently but reproducibly). Plain greedy rows
    are decided by one batched `greedy`; log-probabilities are computed only for rows that ask.
    """
    tokens = [0] * len(params)
    plain = [i for i, p in enumerate(params) if p.temperature == 0.0 and p.repetition_penalty == 1.0]
    if plain:  # every row plain (the common batch) takes the logits' maxima in place, without a copy
        rows = logits if len(plain) == len(params) else logits[plain]
        for i, t in zip(plain, greedy(rows)):
            tokens[i] = t
    for i, p in enumerate(params):
        if p.temperature == 0.0 and p.repetition_penalty != 1.0:
            row = _penalize(logits[i], histories[i], p.repetition_penalty) if histories[i] else logits[i]
            tokens[i] = greedy(row[None])[0]
    drawn = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if drawn:
        for i, t in zip(drawn, _drawn_rows(logits, params, rows=drawn, histories=histories, positions=positions)):
            tokens[i] = t
    draws = [Draw(t) for t in tokens]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asking:
        raw = torch.log_softmax(logits[asking], dim=-1)  # [A, vocab]
        for at, i in enumerate(asking):
            top: tuple[tuple[int, float], ...] = ()
            if params[i].logprobs:  # n > 0: the n most likely alternatives too
                values, ids = torch.topk(raw[at], params[i].logprobs)  # type: ignore[arg-type]
                top = tuple(zip(ids.tolist(), values.tolist()))
            draws[i] = Draw(tokens[i], float(raw[at, tokens[i]]), top)
    return draws


def reads_argmax(p: SamplingParams | None) -> bool:
    """Whether `sample` reads nothing of a row drawn with `p` but its argmax (greedy, no repetition
    penalty, no log-probabilities): the model may then return rows that keep only that
    (`StageModel.forward`'s `argmax_only`)."""
    return p is None or (p.temperature == 0.0 and p.repetition_penalty == 1.0 and p.logprobs is None)


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's token of highest logit [B, vocab] -> B ids: `torch.argmax`'s answer (the first
    of equal maxima, a NaN where one is).

    Through the compiled argmax (kernels/argmax.c) where it serves float32 CPU rows: one row of
    SmolLM2's 49152 logits 8 us against torch's `max` 50-85, 32 rows 150 against 800 (2 cores of an
    Intel Xeon, AVX-512; an AVX2 build of it 21 us a row there). Else from `max` over the rows, which
    torch's CPU kernel reduces 2.6x as fast as `argmax`: 32 rows 0.38 against 0.99 ms, one row 21
    against 62 us (Intel Xeon, AVX-512, two threads). Eight rows or more go in two rounds: each slice
    of `_chunk(vocab)` logits' maximum (`amax`, vectorized), then `max` within the first slice holding
    the row's. On 2 cores of an AMD EPYC (Zen 4), the logits cold after a product: 32 rows 559 against
    1336 us, 16 rows 317 against 408, 8 rows 298 against 322; 2 and 4 rows slower (249 against 122,
    247 against 180).
    """
    rows, vocab = logits.shape
    if _compiled_argmax_takes(logits):
        kernel = argmax_kernel()
        if kernel is not None:
            return _compiled_argmax(kernel, logits)
    chunk = _chunk(vocab)
    if rows < TWO_ROUNDS_FROM or chunk is None:
        return logits.max(-1).indices.tolist()
    slices = logits.unflatten(-1, (vocab // chunk, chunk))  # [B, S, chunk], a view
    first = slices.amax(-1).max(-1).indices  # [B]: the first slice holding each row's maximum (or a NaN)
    within = slices[torch.arange(rows, device=logits.device), first].max(-1).indices  # [B]
    return (first * chunk + within).tolist()


def _compiled_argmax_takes(logits: torch.Tensor) -> bool:
    """float32 rows on the CPU, each contiguous, of 1 to 2^31 - 1 logits (the kernel's lanes count in int32)."""
    return (
        logits.dtype == torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and 0 < logits.shape[1] < 2**31
        and (logits.stride(1) == 1 or logits.shape[1] == 1)
    )


def _compiled_argmax(kernel: native.PagedAttentionKernel, logits: torch.Tensor) -> list[int]:
    """Each row's argmax through kernels/argmax.c; the caller checked `_compiled_argmax_takes`."""
    rows = logits.shape[0]
    out = (ctypes.c_int64 * rows)()
    if rows:
        kernel.unchecked["argmax_rows"](
            logits.data_ptr(), rows, logits.shape[1], logits.stride(0), torch.get_num_threads(), out
        )
    return list(out)


@functools.cache
def argmax_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library, for greedy rows' argmax too, where its build vectorizes it (AVX2 or
    AVX-512) and it answers as torch does on rows of ties, NaNs, infinities and signed zeros;
    None otherwise (logged once): torch's reductions then."""
    kernel = paged_attention.compiled_kernel()
    if kernel is None:
        return None
    if not kernel.unchecked["argmax_vectorized"]():
        log.info("greedy argmax: torch's reductions (%s has no AVX2 or AVX-512 vectors)", kernel.path)
        return None
    return paged_attention.exact_kernel("greedy argmax", _argmax_is_torchs, "does not answer as torch.argmax does")


def _argmax_is_torchs(kernel: native.PagedAttentionKernel, dtype: torch.dtype) -> bool:
    """Whether the kernel's argmax is torch's: on `edge_rows`, and on random rows of few distinct
    values, so that ties abound, with NaNs, infinities and signed zeros among them, whole and sliced.
    Logits are float32 whatever the pools' `dtype`: checked once, under float32, not again for the other."""
    if dtype != torch.float32:
        return True
    rows = edge_rows()
    generator = torch.Generator().manual_seed(0)
    for count, width in ((1, 1), (1, 7), (3, 17), (5, 64), (9, 100), (2, 1031), (4, 49152)):
        x = torch.randint(-3, 3, (count, width), generator=generator).float()
        pick = torch.rand(count, width, generator=generator)
        x[pick < 0.2 / width] = float("nan")  # in a row now and then, not in most
        x[(pick >= 0.01) & (pick < 0.2)] = -float("inf")
        x[(pick >= 0.2) & (pick < 0.3)] = -0.0
        x[(pick >= 0.3) & (pick < 0.3 + 1 / width)] = float("inf")
        if count > 1:
            x[0] = -float("inf")  # a row of nothing but -inf answers 0
        rows += [x, x[:, 1:]] if width > 1 else [x]
    return all(_compiled_argmax(kernel, x) == x.max(-1).indices.tolist() for x in rows)


def edge_rows() -> list[torch.Tensor]:
    """Rows whose answer lies where a vectorized argmax goes wrong: rows shorter than a vector, the
    maximum only in the tail past the last whole vector or only in the last lane of a vector, two
    equal maxima in different lanes, descending rows, a NaN only at index 0 or only in the tail."""
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(1, width, generator=generator) for width in range(1, 18)]
    for width in (17, 33, 49157):
        tail = torch.randn(1, width, generator=generator)
        tail[0, -1] = 9.0
        rows.append(tail)
    for lane in (7, 15, 39, 47):
        x = torch.randn(1, 48, generator=generator)
        x[0, lane] = 9.0
        rows.append(x)
    tied = torch.randn(1, 64, generator=generator)
    tied[0, [21, 5, 50]] = 9.0
    rows += [tied, torch.arange(49157, 0, -1, dtype=torch.float32)[None], torch.arange(20, 0, -1).float()[None]]
    for at in (0, 49156):
        x = torch.randn(1, 49157, generator=generator)
        x[0, at] = float("nan")
        rows.append(x)
    return rows


@functools.cache
def _chunk(vocab: int) -> int | None:
    """The width nearest 1024, between 512 and 2048, that divides `vocab`: the slices `greedy`
    reduces in two rounds (1024 for 49152 logits, 1002 for 128256, 1000 for 32000); None if none does."""
    widths = sorted(range(512, 2049), key=lambda width: abs(width - 1024))
    return next((width for width in widths if vocab % width == 0), None)


def _penalize(row: torch.Tensor, history: Sequence[int], penalty: float) -> torch.Tensor:
    ids = torch.tensor(sorted(set(history)), dtype=torch.long)
    seen = row[ids]
    row = row.clone()
    row[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return row


def _drawn_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    *,
    rows: Sequence[int],
    histories: Sequence[Sequence[int]],
    positions: Sequence[int],
) -> list[int]:
    """The tokens drawn for `rows` of `logits` (temperature above 0): each from the softmax of its
    logits over its temperature as `_kept` filters it, by one uniform number of its own generator
    through the kept probabilities' cumulative sum (`_inverse_cdf`). The softmax of the rows without
    top-k, and the most likely HEAD of those with top-p, are computed for all of them at once, row
    by row as for one alone: a row draws the same token whatever shares its batch.

    SmolLM2's logits after a real prompt (32 positions), 2 cores of an Intel Xeon (Ice Lake), the old
    draw against this one, one row / 32 rows at once, ms: temperature 1 alone 1.4 / 45 -> 0.27 / 6.7;
    temperature 0.8 with top-p 0.95 5.3 / 172 -> 0.49 / 7.1 (at temperature 1.2, where a nucleus often
    passes 256 tokens, 6.5 / 196 -> 0.91 / 33); temperature 0.7 with top-k 50 1.7 / 55 -> 0.37 / 9.7.
    `torch.multinomial` drew an exponential variate for every token, and top-p sorted the vocabulary."""
    temperatures = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype, device=logits.device)
    scores = (logits if len(rows) == logits.shape[0] else logits[list(rows)]) / temperatures[:, None]  # [R, vocab]
    for r, i in enumerate(rows):
        if params[i].repetition_penalty != 1.0 and histories[i]:
            scores[r] = _penalize(logits[i], histories[i], params[i].repetition_penalty) / params[i].temperature
    vocab = scores.shape[1]
    plain = [r for r, i in enumerate(rows) if not 0 < params[i].top_k < vocab]  # no top-k: softmax of all
    softmax = _rows(scores, plain).softmax(-1)
    probs = dict(zip(plain, softmax))
    nucleus = [n for n, r in enumerate(plain) if params[rows[r]].top_p < 1.0]  # rows of `softmax`
    heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if nucleus:
        values, ids = _rows(softmax, nucleus).topk(min(HEAD, vocab), dim=-1)
        heads = {plain[n]: (values[at], ids[at]) for at, n in enumerate(nucleus)}
    tokens = []
    for r, i in enumerate(rows):
        kept, kept_ids = _kept(scores[r], params[i], probs=probs.get(r), head=heads.get(r))
        at = _inverse_cdf(kept, _generator(params[i].seed, positions[i]))
        tokens.append(at if kept_ids is None else int(kept_ids[at]))
    return tokens


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`x[rows]`: x itself where those are all its rows, in order, else a copy."""
    return x if rows == list(range(x.shape[0])) else x[rows]


def _kept(
    scores: torch.Tensor,
    p: SamplingParams,
    *,
    probs: torch.Tensor | None = None,
    head: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The probabilities (not renormalized) of the tokens top-k, top-p and min-p keep of the softmax
    of `scores` [vocab], in that order (transformers'), and their token ids (None: every token, in
    order; 0 where dropped). Top-k keeps the tokens scoring at least the k-th highest (ties with it
    too), top-p the most likely until their probability reaches p (the one crossing it too), min-p
    those at least min_p times the most likely one's probability. They work on candidates, not on the
    vocabulary: `torch.topk` finds the top-k, and the top-p among the most likely HEAD, then 2048,
    when those do not reach p; the whole vocabulary sorted only when those do not either. `probs`:
    the softmax of `scores`, and `head` the most likely HEAD of it, where computed already."""
    ids: torch.Tensor | None = None
    if 0 < p.top_k < scores.numel():
        values, ids = torch.topk(scores, p.top_k)  # descending
        tied = ~(scores < values[-1])  # a NaN too: kept, so that the row is refused as before
        if int(tied.sum()) > p.top_k:  # others tie with the k-th: kept as well
            ids = tied.nonzero().squeeze(1)  # [kept]
            values, order = scores[ids].sort(descending=True)
            ids = ids[order]
        probs, head = values.softmax(-1), None
    elif probs is None:
        probs = scores.softmax(-1)
    if p.top_p < 1.0:
        probs, ids = (probs, ids) if ids is not None else _most_likely(probs, p.top_p, head)
        before = probs.cumsum(-1, dtype=torch.float64) - probs
        kept = max(1, int((before < p.top_p).sum()))  # a prefix: `before` only grows
        probs, ids = probs[:kept], ids[:kept]
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs, ids


def _most_likely(
    probs: torch.Tensor, top_p: float, head: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely HEAD of `probs` (`head`, where given), or 2048 where those fall short of
    `top_p`, or all of them where those do too: their probabilities, descending, and indices."""
    for wanted in (HEAD, 2048):
        if wanted < probs.numel():
            values, ids = head if head is not None and wanted == HEAD else torch.topk(probs, wanted)
            if float(values.sum(dtype=torch.float64)) >= top_p:  # as `_kept` sums them
                return values, ids
    values, ids = torch.sort(probs, descending=True)
    return values, ids


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index i with probability probs[i] / sum(probs): the first whose cumulative sum (in float64) passes
    a uniform draw times the total, so a token of probability 0 is never drawn."""
    cdf = probs.cumsum(0, dtype=torch.float64)
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"no token to draw: the kept probabilities sum to {total} (logits of NaN or all -inf)")
    u = torch.rand((), generator=generator, dtype=torch.float64) * total  # the generators are the CPU's
    return min(int(torch.searchsorted(cdf, u.reshape(1).to(cdf.device), right=True)), probs.numel() - 1)


def _generator(seed: int | None, position: int) -> torch.Generator | None:
    if seed is None:
        return None
    mixed = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(mixed, "little") & (2**63 - 1))
