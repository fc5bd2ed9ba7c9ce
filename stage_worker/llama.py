"""The math of a Llama-family decoder for one contiguous layer range (pure torch, no I/O).

A `StageModel` holds the layers `[start, end)` under their global indices, plus the token
embedding when `start == 0` and the final norm and LM head when `end == num_layers`. Its forward
runs one micro-batch: the new tokens of several sequences packed into rows (prefill chunks and
single decode tokens mixed), each at its own positions, reading and appending K/V through a
caller-owned `PagedKVCache` and the step's `StepLayout`.

Knows nothing of checkpoints, the network or sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerline.shared.model_config import LayerRange, ModelConfig, RopeConfig

from .kv_cache import PagedKVCache, StepLayout
from .parallel import Shards, TensorParallel, shards_for


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32, then cast, then scaled: the order transformers uses.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


MANY_ROWS = 16  # from this many rows on, a matmul is worth computing as (W x^T)^T (see below)


def _by_weight_rows(weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b computed as (W x^T)^T: `weight` is [out, in] (any strides); contiguous result."""
    y = (weight @ x.t()).t()
    return y + bias if bias is not None else y.contiguous()


class TransposedLinear(nn.Module):
    """y = x W^T + b, with W kept transposed: `weight_t` is [in, out], contiguous.

    On CPU a matmul of one or a few rows (decoding) streams a weight stored this way about twice
    as fast as torch's [out, in] layout when `out >= in`. Loading transposes the checkpoint's
    [out, in] tensor once (see weights.py).

    From MANY_ROWS rows on, a weight no more than twice as wide as it is deep (q/k/v, o) is
    multiplied the other way round, y^T = W x^T: MKL then splits the weight's many rows rather
    than the few rows of x, 5-10% faster on one thread and about 30% on two (measured on this
    model's shapes). Wider ones (gate/up, the LM head) lose that way on one thread and keep x W^T.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.flipped = out_features <= 2 * in_features

    def dense(self) -> torch.Tensor:
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flipped and x.shape[0] >= MANY_ROWS:
            return _by_weight_rows(self.weight_t.t(), x, self.bias)
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


class Linear(nn.Linear):
    """torch's Linear ([out, in] weight), computed as y^T = W x^T from MANY_ROWS rows on when
    torch has more than one thread: about 25% faster for the MLP's down projection on two
    threads, slower on one."""

    def dense(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= MANY_ROWS and torch.get_num_threads() > 1:
            return _by_weight_rows(self.weight, x, self.bias)
        return F.linear(x, self.weight, self.bias)


HEAD_BLOCKS = (8, 4, 2, 1)  # the LM head's blocks: the first of these that divides the vocabulary


class LMHead(nn.Module):
    """logits = x W^T with the head's W [vocab, hidden] kept as column blocks of W^T:
    `weight_blocks` is [blocks, hidden, vocab / blocks], contiguous, and one batched matmul runs
    every block. MKL then works on the blocks side by side, where one [hidden, vocab] matrix
    leaves it little to split. Measured on SmolLM2's head (49152 x 576) against that one
    matrix: 16 rows take 22 instead of 30 ms on one thread and 11 instead of 22 on two; one row
    takes as long on one thread, and 3.2 instead of 4.6 ms on two.
    """

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        blocks = next(b for b in HEAD_BLOCKS if vocab % b == 0)
        self.weight_blocks = nn.Parameter(torch.empty(blocks, hidden, vocab // blocks))
        self.bias = None

    def dense(self) -> torch.Tensor:
        """The [vocab, hidden] weight, copied out of the blocks."""
        blocks, hidden, width = self.weight_blocks.shape
        return self.weight_blocks.transpose(1, 2).reshape(blocks * width, hidden)

    @staticmethod
    def blocked(weight: torch.Tensor) -> torch.Tensor:
        """A checkpoint's [vocab, hidden] head weight in this module's layout."""
        vocab, hidden = weight.shape
        blocks = next(b for b in HEAD_BLOCKS if vocab % b == 0)
        return weight.reshape(blocks, vocab // blocks, hidden).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_blocks)  # [blocks, R, vocab / blocks]
        return y.transpose(0, 1).reshape(x.shape[0], -1)  # [R, vocab], block after block


WEIGHT_LAYOUTS = ("both", "packed", "plain")  # see PackedLinear; the stage's --weight-layout


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `PackedLinear` serves this dtype on this device: float32 on CPU, and bfloat16 on
    CPUs with bfloat16 instructions."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b through oneDNN, with W reordered once, at load, into oneDNN's blocked layout.

    On CPU in float32 this beats the plain layouts above from two rows on. Measured on this
    model's 19 layers on one thread: 2 rows 1.2x, 4 rows 2.5x, 16 rows 1.9x, 32 rows 1.5x faster;
    the LM head at 16 rows 2x. One row is 5-15% slower than the plain layouts (the LM head's
    1.5x slower), and a token of a lone stream is one row.

    So by default (`--weight-layout both`) the plain module is kept beside the packed weight and
    runs single rows: the speed of each, for twice the memory of these weights. `packed` keeps
    the packed weight alone (the memory of one copy; single rows slower), `plain` does not pack.

    In bfloat16 (on a CPU with bfloat16 instructions) the packed weight wins at every row count
    (one row 1.7x, 16 rows 1.65x, 32 rows 1.3x against torch's plain bfloat16 matmul, 19 layers,
    one thread), so no plain copy is kept even under `both`.
    """

    def __init__(self, plain: nn.Module, *, keep_plain: bool) -> None:
        super().__init__()
        self.register_buffer("weight_packed", torch.ops.mkldnn._reorder_linear_weight(plain.dense().contiguous(), None))
        self.register_buffer("bias", None if plain.bias is None else plain.bias.detach().contiguous())
        self.plain = plain if keep_plain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.shape[0] == 1:
            return self.plain(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with linear or Llama 3 scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """qkv is column-parallel (this rank's heads), o is row-parallel (all-reduced)."""

    def __init__(self, config: ModelConfig, *, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> None:
        super().__init__()
        # num_heads / num_kv_heads are the heads held here (per rank under tensor parallelism).
        self.tp = tp
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = config.head_dim
        hidden, d = config.hidden_size, config.head_dim
        # q, k and v in one matmul: rows [q | k | v], fused at load time (see weights.py).
        self.qkv_proj = TransposedLinear(hidden, (num_heads + 2 * num_kv_heads) * d, bias=config.qkv_bias)
        self.o_proj = TransposedLinear(num_heads * d, hidden, bias=config.o_bias)

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
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        qk = qk * cos + rotate_half(qk) * sin  # rotary on q and k at once: [T, h + kvh, d]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # q [T, h, d]; k, v [T, kvh, d]
        k_pool.index_copy_(0, layout.write_slots, k)
        v_pool.index_copy_(0, layout.write_slots, v)
        if layout.decode_only:  # the common batched-decode step: no row shuffling
            kd = _gather_blocks(k_pool, layout.decode_blocks, layout.block_size)  # [T, kvh, L, d]
            vd = _gather_blocks(v_pool, layout.decode_blocks, layout.block_size)
            od = self._sdpa(q.unsqueeze(2), kd, vd, mask=layout.decode_mask, causal=False)  # [T, h, 1, d]
            return self.tp.all_reduce(self.o_proj(od.reshape(t, self.num_heads * self.head_dim)))
        out = torch.empty_like(q)  # [T, h, d]
        if layout.decode_rows.numel():
            qd = q[layout.decode_rows].unsqueeze(2)  # [D, h, 1, d]
            kd = _gather_blocks(k_pool, layout.decode_blocks, layout.block_size)  # [D, kvh, L, d]
            vd = _gather_blocks(v_pool, layout.decode_blocks, layout.block_size)
            od = self._sdpa(qd, kd, vd, mask=layout.decode_mask, causal=False)  # [D, h, 1, d]
            out[layout.decode_rows] = od.squeeze(2)
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
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)))

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
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.num_heads != self.num_kv_heads
        )


def _gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Whole KV blocks of each sequence from a [slots, kvh, d] pool: [D, kvh, B * block_size, d]."""
    n_seqs, n_blocks = blocks.shape
    _, kvh, d = pool.shape
    # index_select copies whole blocks as rows, several times faster than advanced indexing.
    gathered = pool.view(-1, block_size * kvh * d).index_select(0, blocks.flatten())
    return gathered.view(n_seqs, n_blocks * block_size, kvh, d).transpose(1, 2)


class MLP(nn.Module):
    """gate_up is column-parallel (this rank's slice of the width), down is row-parallel."""

    def __init__(self, config: ModelConfig, *, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        hidden, bias = config.hidden_size, config.mlp_bias
        # gate and up in one matmul: rows [gate | up], fused at load time (see weights.py).
        self.gate_up_proj = TransposedLinear(hidden, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden, bias=bias)  # out < in: [out, in] is faster

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [T, intermediate]
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, layer_id: int, shards: Shards, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = Attention(config, num_heads=shards.num_heads, num_kv_heads=shards.num_kv_heads, tp=tp)
        self.mlp = MLP(config, intermediate_size=shards.intermediate, tp=tp)
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

    def __init__(self, config: ModelConfig, layers: LayerRange, *, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        layers.check(config.num_layers)
        self.config = config
        self.layer_range = layers
        self.tp = tp
        self.shards = shards = shards_for(config, tp)
        self.embed_tokens = (
            VocabParallelEmbedding(shards.vocab_per_rank, config.hidden_size, start=shards.vocab_start, tp=tp)
            if layers.is_first
            else None
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, layer_id=i, shards=shards, tp=tp) for i in layers})
        last = layers.is_last(config.num_layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.lm_head = LMHead(config.hidden_size, shards.vocab_per_rank) if last else None
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, config.head_dim), persistent=False)

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def pack_linears(self, *, keep_plain: bool) -> None:
        """Wrap every linear layer (and the LM head) in its `PackedLinear`, once, after loading."""
        for owner in list(self.modules()):
            for name, child in list(owner.named_children()):
                if isinstance(child, (TransposedLinear, Linear, LMHead)):
                    setattr(owner, name, PackedLinear(child, keep_plain=keep_plain))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [T, 1, head_dim], computed in float32 then cast."""
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        inputs: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one packed micro-batch through this stage.

        `inputs` is [T] token ids on the first stage, else [T, hidden] hidden states.
        Returns [T, hidden] hidden states, or on the last stage [R, vocab] float32 logits for
        `logit_rows` (every row when None).
        """
        x = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs  # [T, hidden]
        cos, sin = self.rope(layout.positions, x.dtype)
        for layer in self.layers.values():
            x = layer(x, cos, sin, cache=cache, layout=layout)
        if self.lm_head is None:
            return x
        if logit_rows is not None:
            x = x[logit_rows]
        logits = self.tp.all_gather(self.lm_head(self.norm(x)))  # [R, vocab padded to a multiple of tp]
        return logits[:, : self.config.vocab_size].float()  # [R, vocab]
