"""The math of a Llama-family decoder for one contiguous layer range (pure torch, no I/O).

A `StageModel` holds the layers `[start, end)` under their global indices, plus the token
embedding when `start == 0` and the final norm and LM head when `end == num_layers`. Its forward
runs one micro-batch: the new tokens of several sequences packed into rows (prefill chunks and
single decode tokens mixed), each at its own positions, reading and appending K/V through a
caller-owned `PagedKVCache` and the step's `StepLayout`.

Its linear layers are torch's, with the checkpoint's [out, in] weights; q, k, v and gate, up are
fused into one matmul each. Under tensor parallelism a module's sizes are this rank's
(`Shards`: `heads_per_rank` against the config's `num_heads`) and the row-parallel projections
all-reduce through the `TensorParallel` handed in.

Knows nothing of checkpoints, of the CPU weight layouts that replace the linear layers after
loading (layouts.py), of how tensors are cut (sharding.py), the network or sampling (beyond
`argmax_only`: the caller reads each row's argmax alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from layerline.shared.model_config import LayerRange, ModelConfig

from .fused import rms_norm, silu_mul
from .kv_cache import PagedKVCache, StepLayout
from .paged_attention import attends_off_pools, paged_decode_attention, reads_pools, rotated_and_stored
from .parallel import SINGLE_RANK, TensorParallel
from .rotary import rope_inv_freq
from .sharding import Shards, shards_for
from .step_paths import DecodePath, RowPath


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass
class StepThreads:
    """How many CPU threads the current step runs on. The engine decides it per step and tells
    the model (`StageModel.set_threads`); a layer whose fastest kernel depends on it holds the
    model's one `StepThreads` and reads `count` in forward, never asking torch."""

    count: int = 1


ROPE_TABLE_ROWS = 1024  # positions in a stage's first rotary table, at most its context (`StageModel.rope`)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """The two halves of the last dimension swapped: transformers' `rotate_half` without its
    negation, which `StageModel.rope` folds into the sine once per step instead of once per layer."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """qkv is column-parallel (this rank's heads), o is row-parallel (all-reduced)."""

    def __init__(self, config: ModelConfig, *, heads_per_rank: int, kv_heads_per_rank: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.heads_per_rank = heads_per_rank
        self.kv_heads_per_rank = kv_heads_per_rank
        self.head_dim = config.head_dim
        hidden, d = config.hidden_size, config.head_dim
        # q, k and v in one matmul: rows [q | k | v], fused at load time (see weights.py). After
        # loading, each linear layer becomes a layout of the same weight faster on CPU (layouts.py).
        qkv_rows = (heads_per_rank + 2 * kv_heads_per_rank) * d
        self.qkv_proj: nn.Module = nn.Linear(hidden, qkv_rows, bias=config.qkv_bias)
        self.o_proj: nn.Module = nn.Linear(heads_per_rank * d, hidden, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layout: StepLayout,
    ) -> torch.Tensor:
        t, h, kvh = x.shape[0], self.heads_per_rank, self.kv_heads_per_rank
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.head_dim)  # [T, h + 2 kvh, d]
        # rotary and KV writes in one kernel call; a lone row too where the compiled kernel attends off
        # the pools, so that its numbers are a batch row's (kv_cache.plan_step's `token_rows`)
        kernel = attends_off_pools(k_pool)
        if layout.decode_only and (layout.decode_slots is None or kernel):
            q = rotated_and_stored(qkv, cos, sin, k_pool, v_pool, heads=h, layout=layout)
            if q is not None:
                return self.tp.all_reduce(self.o_proj(batch_decode_attention(q, k_pool, v_pool, layout=layout)))
        qk, v = qkv.split([h + kvh, kvh], dim=1)
        qk = qk * cos + swap_halves(qk) * sin  # rotary on q and k at once (sin signed): [T, h + kvh, d]
        q, k = qk.split([h, kvh], dim=1)  # q [T, h, d]; k, v [T, kvh, d]
        k_pool.index_copy_(0, layout.write_slots, k)
        v_pool.index_copy_(0, layout.write_slots, v)
        if layout.decode_slots is not None and not kernel:  # one decoding sequence, its KV in one run of slots
            kd = k_pool[layout.decode_slots].transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d], a view
            vd = v_pool[layout.decode_slots].transpose(0, 1).unsqueeze(0)
            od = decode_attention(q, kd, vd, mask=None)  # [1, h * d]
            return self.tp.all_reduce(self.o_proj(od))
        if layout.decode_only:  # the common batched-decode step: no row shuffling
            return self.tp.all_reduce(self.o_proj(batch_decode_attention(q, k_pool, v_pool, layout=layout)))
        out = torch.empty_like(q)  # [T, h, d]
        if layout.decode_rows.numel():
            od = batch_decode_attention(q[layout.decode_rows], k_pool, v_pool, layout=layout)  # [D, h * d]
            out[layout.decode_rows] = od.view(-1, h, self.head_dim)
        for span in layout.prefills:
            qp = q[span.rows].transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
            if span.mask is None:  # a fresh sequence: its context is exactly its new rows
                kp = k[span.rows].transpose(0, 1).unsqueeze(0)  # [1, kvh, n, d]
                vp = v[span.rows].transpose(0, 1).unsqueeze(0)
                op = self._sdpa(qp, kp, vp, mask=None, causal=True)
            else:
                slots = span.context_slots.to(k_pool.device)
                kp = k_pool[slots].transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d]
                vp = v_pool[slots].transpose(0, 1).unsqueeze(0)
                mask = span.mask.to(k_pool.device)[None, None]  # [1, 1, n, L]
                op = self._sdpa(qp, kp, vp, mask=mask, causal=False)
            out[span.rows] = op.squeeze(0).transpose(0, 1)  # [n, h, d]
        return self.tp.all_reduce(self.o_proj(out.reshape(t, h * self.head_dim)))

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.heads_per_rank != self.kv_heads_per_rank
        )


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new token per sequence: q [D, h, d] over k, v [D, kvh, L, d] (any strides)
    under `mask` [D, 1, 1, L] (added to the scores: 0 where a key is held, -inf where not; None:
    all are held). Returns [D, h * d].

    The query heads that share a key/value head (h / kvh of them, consecutive) go in as that
    head's query positions, so that the kernel sees no grouped-query attention: with one query
    position they all attend to every held key alike. torch's CPU kernel with `enable_gqa` took
    0.74 ms for 32 sequences of 128 keys (SmolLM2's 9 and 3 heads, two threads, caches cold;
    Intel Xeon, AVX-512) and 0.43 ms so; hot 0.50 and 0.21 ms."""
    n, h, d = q.shape
    kvh = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(n, kvh, h // kvh, d), k, v, attn_mask=mask)  # [D, kvh, h / kvh, d]
    return out.reshape(n, h * d)


def batch_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *, layout: StepLayout
) -> torch.Tensor:
    """Attention of `layout`'s decode batch, q [D, h, d], over the [slots, kvh, d] pools: [D, h * d].
    On CPU straight off the pools where paged_attention.py reads them (float32; bfloat16 with its
    compiled kernel); elsewhere each sequence's blocks are gathered for torch's kernel."""
    if reads_pools(k_pool):
        return paged_decode_attention(q, k_pool, v_pool, layout=layout)
    return gathered_decode_attention(q, k_pool, v_pool, layout=layout)


def gathered_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *, layout: StepLayout
) -> torch.Tensor:
    """The same attention with each sequence's whole blocks gathered for torch's kernel: [D, h * d]."""
    kd = _gather_blocks(k_pool, layout.decode_blocks, layout.block_size)  # [D, kvh, L, d]
    vd = _gather_blocks(v_pool, layout.decode_blocks, layout.block_size)
    return decode_attention(q, kd, vd, mask=layout.decode_mask)


def _gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole KV blocks of each sequence from a [slots, kvh, d] pool: [D, kvh, B * block_size, d]."""
    n_seqs, n_blocks = blocks.shape
    _, kvh, d = pool.shape
    # index_select copies whole blocks as rows, several times faster than advanced indexing.
    gathered = pool.view(-1, block_size * kvh * d).index_select(0, blocks.flatten())
    return gathered.view(n_seqs, n_blocks * block_size, kvh, d).transpose(1, 2)


class MLP(nn.Module):
    """gate_up is column-parallel (this rank's slice of the width), down is row-parallel."""

    def __init__(self, config: ModelConfig, *, intermediate_per_rank: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        hidden, bias = config.hidden_size, config.mlp_bias
        # gate and up in one matmul: rows [gate | up], fused at load time (see weights.py).
        self.gate_up_proj: nn.Module = nn.Linear(hidden, 2 * intermediate_per_rank, bias=bias)
        self.down_proj: nn.Module = nn.Linear(intermediate_per_rank, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 x intermediate per rank]: gate | up
        return self.tp.all_reduce(self.down_proj(silu_mul(gate_up)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, layer_id: int, shards: Shards, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(
            config, heads_per_rank=shards.num_heads, kv_heads_per_rank=shards.num_kv_heads, tp=tp
        )
        self.mlp = MLP(config, intermediate_per_rank=shards.intermediate, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
    ) -> torch.Tensor:
        h = self.self_attn(
            self.input_layernorm(x),
            cos,
            sin,
            k_pool=cache.k[self.layer_id],
            v_pool=cache.v[self.layer_id],
            layout=layout,
        )
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + rows) of the embedding; other ids embed to zero, summed over ranks."""

    def __init__(self, rows: int, hidden: int, *, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [T]
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[:, None]
        return self.tp.all_reduce(x)  # [T, hidden]


class StageModel(nn.Module):
    """Layers `[start, end)` of a Llama-family model, with embedding and head where owned.

    Under tensor parallelism each rank builds the same model with its own shards (`tp`), and
    every rank runs every step; the LM head's logits are gathered so each rank has them all.
    """

    inv_freq: torch.Tensor  # [head_dim / 2] rotary inverse frequencies (a buffer, not a weight)

    def __init__(self, config: ModelConfig, layers: LayerRange, *, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        layers.check(config.num_layers)
        self.config = config
        self.layer_range = layers
        self.tp = tp
        self.shards = shards = shards_for(config, tp)
        self.step_threads = StepThreads()
        self.embed_tokens = (
            VocabParallelEmbedding(shards.vocab_per_rank, config.hidden_size, start=shards.vocab_start, tp=tp)
            if layers.is_first
            else None
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, layer_id=i, shards=shards, tp=tp) for i in layers})
        last = layers.is_last(config.num_layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        head = nn.Linear(config.hidden_size, shards.vocab_per_rank, bias=False) if last else None
        self.lm_head: nn.Module | None = head
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)
        # By dtype: (the inv_freq it was made from, cos, sin) for positions 0 .. n - 1 (`rope`)
        self._rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.row_path: RowPath | None = None  # for a step of one token (see RowPath); layouts.py sets it
        self.decode_path: DecodePath | None = None  # for a decode batch (see DecodePath); layouts.py sets it
        self.head_screen: nn.Module | None = None  # a few greedy rows' head (head_screen.py); layouts.py sets it

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def set_threads(self, threads: int) -> None:
        """The CPU threads the next steps run on, as the engine decided (see `StepThreads`)."""
        self.step_threads.count = threads

    def rope(self, positions: Tensor | None, dtype: torch.dtype, *, run: range | None = None) -> tuple[Tensor, Tensor]:
        """cos and the signed sin, each [T, 1, head_dim], computed in float32 then cast.

        The sine's first half is negated: rotary is then `x * cos + swap_halves(x) * sin`, the
        same numbers as transformers' `x * cos + rotate_half(x) * sin` (a product's sign is exact).
        Rows of a table of every position up to the largest asked so far (a power of two, from
        ROPE_TABLE_ROWS), made by the same operations on them all: elementwise, so the same bits
        as made for the step's positions alone, in one indexing instead of eight small operations
        a step (23 -> 9 us of a step's fixed work on 2 cores of an Intel Xeon). The table stops at the
        model's context (`max_position_embeddings`) unless a step asks past it. `run`: the positions
        as a range, where they are one (StepLayout's `positions_run`): a slice of the table, read
        only (the indexing and the read of the largest took 60 us of a lone token's step, its
        caches cold: 2 cores of an Intel Xeon, model 106)."""
        if run is not None:
            table = self._rope_table(dtype, run.stop)
            return table[0][run.start : run.stop], table[1][run.start : run.stop]
        assert positions is not None, "the positions, or their run"
        table = self._rope_table(dtype, int(positions.max()) + 1 if positions.numel() else 0)
        at = positions.to(self.inv_freq.device)
        return table[0][at], table[1][at]

    def _rope_table(self, dtype: torch.dtype, end: int) -> tuple[Tensor, Tensor]:
        """cos and the signed sin of positions 0 .. at least end - 1 (`rope`)."""
        table = self._rope_tables.get(dtype)
        if table is None or table[0] is not self.inv_freq or table[1].shape[0] < end:
            rows = max(end, min(max(ROPE_TABLE_ROWS, 1 << (end - 1).bit_length()), self.config.max_position_embeddings))
            table = self._rope_tables[dtype] = (self.inv_freq, *self._rope_rows(torch.arange(rows), dtype))
        return table[1], table[2]

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, d]
        sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
        return cos.to(dtype), sin.to(dtype)

    def forward(
        self,
        inputs: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        logit_rows: torch.Tensor | None = None,
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """Run one packed micro-batch through this stage.

        `inputs` is [T] token ids on the first stage (or their rows, `embed`), else [T, hidden] hidden states.
        Returns [T, hidden] hidden states, or on the last stage [R, vocab] float32 logits for
        `logit_rows` (every row when None). `argmax_only`: the caller reads only each row's argmax
        (`sampler.greedy`), and a path may return rows that keep only that (rows.py, head_screen.py).
        """
        x = self.embed_tokens(inputs) if self.embed_tokens is not None and inputs.dim() == 1 else inputs  # [T, hidden]
        run = layout.positions_run  # a run's rows are a slice: its positions' tensor is never made
        cos, sin = self.rope(layout.positions if run is None else None, x.dtype, run=run)
        if self.row_path is not None and layout.decode_slots is not None and x.shape[0] == 1:
            threads = self.step_threads.count
            out = self.row_path(x, cos, sin, cache=cache, layout=layout, threads=threads, argmax_only=argmax_only)
            if out is not None:
                return out
        if self.decode_path is not None and layout.decode_only and x.shape[0] > 1:
            out = self.decode_path(
                x, cos, sin, cache=cache, layout=layout, logit_rows=logit_rows, argmax_only=argmax_only
            )
            if out is not None:
                return out
        for layer in self.layers.values():
            x = layer(x, cos, sin, cache=cache, layout=layout)
        if self.lm_head is None:
            return x
        assert self.norm is not None  # the last stage holds both
        x = self.norm(x if logit_rows is None else x[logit_rows])
        if (screened := self.screened(x, argmax_only)) is not None:
            return screened
        logits = self.tp.all_gather(self.lm_head(x))  # [R, vocab padded to a multiple of tp]
        return logits[:, : self.config.vocab_size].float()  # [R, vocab]

    def embed(self, token_ids: Sequence[int]) -> Tensor:
        """[T, hidden]: the first stage's rows for `token_ids`. A lone token's, where the embedding is
        one rank's plain weight, is a view of its row, read only (a step never changes its input in
        place): a tensor of the id and the embedding's call took 90 us of its step, caches cold."""
        embed = self.embed_tokens
        assert embed is not None, "only the first stage embeds"
        if len(token_ids) == 1 and type(embed) is VocabParallelEmbedding and embed.tp.size == 1:
            if 0 <= (token := token_ids[0]) < embed.weight.shape[0]:  # else the embedding's own IndexError
                return embed.weight.detach()[token : token + 1]
        return embed(torch.tensor(token_ids, dtype=torch.long, device=self.inv_freq.device))  # int8's too

    def screened(self, x: torch.Tensor, argmax_only: bool) -> torch.Tensor | None:
        """The head's answer for the final norm's rows x through its screen (head_screen.py), where
        the caller reads only each row's argmax and the screen takes these rows; else None."""
        if not argmax_only or self.head_screen is None or self.tp.size != 1:  # a rank alone would skip the gather
            return None
        return self.head_screen(x)
