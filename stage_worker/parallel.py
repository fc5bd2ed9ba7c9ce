"""Tensor parallelism inside one stage: the process group handle and the shard arithmetic.

Owns how a stage's tensors are cut over `size` ranks, as pure functions of the config:
q, k, v, gate and up are column-parallel (each rank computes its own output columns: Y_r = X A_r);
o and down are row-parallel (each rank multiplies its slice of the input by its rows of the
weight, Y = sum_r X_r A_r, one all-reduce); the embedding and the LM head are split over the
vocabulary (padded to a multiple of `size`). KV heads are split like the query heads they serve,
and replicated when there are fewer KV heads than ranks. The collectives take the group
explicitly; with `size == 1` they are no-ops.

Knows nothing of checkpoints, the network or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from layerline.shared.model_config import ConfigError, ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0  # this process's rank in the stage
    size: int = 1  # ranks in the stage
    group: dist.ProcessGroup | None = None  # the stage's process group (gloo on CPU, NCCL on GPU)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, concatenated along the last dimension in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Shards:
    """What one rank holds of each tensor (global sizes are in the ModelConfig)."""

    num_heads: int  # query heads on this rank
    head_start: int  # its first query head
    num_kv_heads: int  # key/value heads on this rank (replicated when fewer than ranks)
    kv_head_start: int  # its first key/value head
    intermediate: int  # MLP width on this rank
    vocab_start: int  # the first vocabulary row it holds
    vocab_per_rank: int  # rows of the embedding and LM head per rank (the vocabulary padded)


def shards_for(config: ModelConfig, tp: TensorParallel) -> Shards:
    """The cut of `config`'s tensors for rank `tp.rank` of `tp.size`; ConfigError if it cannot be cut."""
    size, rank = tp.size, tp.rank
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % size:
        raise ConfigError(f"--tp {size} does not divide num_attention_heads = {heads}")
    if config.intermediate_size % size:
        raise ConfigError(f"--tp {size} does not divide intermediate_size = {config.intermediate_size}")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            f"--tp {size} and num_key_value_heads = {kv_heads}: one must divide the other, so that "
            "each rank's query heads share whole key/value heads"
        )
    local_heads = heads // size
    per_rank = -(-config.vocab_size // size)  # the last rank's rows past the vocabulary are padding
    if kv_heads >= size:
        local_kv, kv_start = kv_heads // size, rank * (kv_heads // size)
    else:  # replicated: ranks that serve the same group of query heads hold the same KV head
        local_kv, kv_start = 1, rank // (size // kv_heads)
    return Shards(
        num_heads=local_heads,
        head_start=rank * local_heads,
        num_kv_heads=local_kv,
        kv_head_start=kv_start,
        intermediate=config.intermediate_size // size,
        vocab_start=rank * per_rank,
        vocab_per_rank=per_rank,
    )
