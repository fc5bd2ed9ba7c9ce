"""How a stage's tensors are cut over the ranks of tensor parallelism: one plan, pure functions.

q, k, v, gate and up are column-parallel: each rank holds the rows of their [out, in] weight for
its own output columns and computes Y_r = X A_r. o and down are row-parallel: each rank holds
the columns of their weight that meet its slice of the input, Y = sum_r X_r A_r, one
all-reduce; their bias is added once, by rank 0. The embedding and the LM head are split over
the vocabulary, padded to a multiple of the rank count. KV heads are split like the query heads
they serve, and replicated when there are fewer KV heads than ranks. The norms are whole on
every rank.

`shards_for` gives what one rank holds (`Shards`, sizes per rank); `piece_for` says which rows or
columns of each checkpoint tensor that rank reads, so a rank reads its slices and never a whole
sharded tensor.

Knows nothing of files, of torch modules or of the collectives (parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, NamedTuple

from layerline.shared.model_config import ConfigError, ModelConfig

from .parallel import TensorParallel

ZEROS: Final = "zeros"  # what a row-parallel bias is on ranks > 0: rank 0 alone adds the real one


@dataclass(frozen=True)
class Shards:
    """What one rank holds of each tensor. Every size here is per rank; the global sizes are the
    ModelConfig's (`config.num_heads`, `config.intermediate_size`, `config.vocab_size`)."""

    num_heads: int  # query heads on this rank
    head_start: int  # its first query head
    num_kv_heads: int  # key/value heads on this rank (replicated when fewer than ranks)
    kv_head_start: int  # its first key/value head
    intermediate: int  # MLP width on this rank
    intermediate_start: int  # its first MLP column
    vocab_start: int  # the first vocabulary row it holds
    vocab_per_rank: int  # rows of the embedding and LM head per rank (the vocabulary padded)


class Piece(NamedTuple):
    """Rows (`dim` 0) or columns (`dim` 1) [start, end) of a checkpoint's [out, in] tensor."""

    dim: int
    start: int
    end: int


def shards_for(config: ModelConfig, tp: TensorParallel) -> Shards:
    """The cut of `config`'s tensors for rank `tp.rank` of `tp.size`; ConfigError if it cannot be cut."""
    size, rank = tp.size, tp.rank
    total_heads, total_kv_heads = config.num_heads, config.num_kv_heads
    if total_heads % size:
        raise ConfigError(f"--tp {size} does not divide num_attention_heads = {total_heads}")
    if config.intermediate_size % size:
        raise ConfigError(f"--tp {size} does not divide intermediate_size = {config.intermediate_size}")
    if total_kv_heads % size and size % total_kv_heads:
        raise ConfigError(
            f"--tp {size} and num_key_value_heads = {total_kv_heads}: one must divide the other, so that "
            "each rank's query heads share whole key/value heads"
        )
    heads_per_rank = total_heads // size
    intermediate_per_rank = config.intermediate_size // size
    vocab_per_rank = -(-config.vocab_size // size)  # the last rank's rows past the vocabulary are padding
    if total_kv_heads >= size:
        kv_heads_per_rank = total_kv_heads // size
        kv_head_start = rank * kv_heads_per_rank
    else:  # replicated: ranks that serve the same group of query heads hold the same KV head
        kv_heads_per_rank = 1
        kv_head_start = rank // (size // total_kv_heads)
    return Shards(
        num_heads=heads_per_rank,
        head_start=rank * heads_per_rank,
        num_kv_heads=kv_heads_per_rank,
        kv_head_start=kv_head_start,
        intermediate=intermediate_per_rank,
        intermediate_start=rank * intermediate_per_rank,
        vocab_start=rank * vocab_per_rank,
        vocab_per_rank=vocab_per_rank,
    )


def piece_for(
    param: str, *, config: ModelConfig, shards: Shards, tp: TensorParallel
) -> Piece | Literal["zeros"] | None:
    """This rank's piece of the checkpoint tensor behind `param` (an unfused parameter name such
    as "layers.3.self_attn.q_proj.weight"): a `Piece`, None for all of it, or ZEROS."""
    if tp.size == 1:
        return None
    module, _, what = param.rpartition(".")  # "layers.3.self_attn.q_proj", "weight"
    kind = module.rpartition(".")[2]  # "q_proj"
    d = config.head_dim
    q_span = (shards.head_start * d, (shards.head_start + shards.num_heads) * d)
    kv_span = (shards.kv_head_start * d, (shards.kv_head_start + shards.num_kv_heads) * d)
    mlp_span = (shards.intermediate_start, shards.intermediate_start + shards.intermediate)
    vocab_span = (  # the padding rows past the vocabulary are not in the checkpoint
        min(shards.vocab_start, config.vocab_size),
        min(shards.vocab_start + shards.vocab_per_rank, config.vocab_size),
    )
    column_parallel = {  # rows of the [out, in] tensor
        "q_proj": q_span,
        "k_proj": kv_span,
        "v_proj": kv_span,
        "gate_proj": mlp_span,
        "up_proj": mlp_span,
        "embed_tokens": vocab_span,
        "lm_head": vocab_span,
    }
    row_parallel = {"o_proj": q_span, "down_proj": mlp_span}  # columns of the [out, in] tensor
    if kind in column_parallel:
        return Piece(0, *column_parallel[kind])
    if kind in row_parallel:
        if what == "bias":
            return None if tp.rank == 0 else ZEROS
        return Piece(1, *row_parallel[kind])
    return None  # the norms: every rank holds all of them
