"""Tensor parallelism inside one stage: the process-group handle and its collectives.

Owns `TensorParallel`, which names this process's rank, the number of ranks, and the process
group, and runs the two collectives the model needs (a sum, and a gather of the LM head's
columns). With one rank both are no-ops. The group is passed explicitly to whoever needs it;
there is no global getter.

Knows nothing of the model, of how tensors are cut (sharding.py), of checkpoints or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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


SINGLE_RANK = TensorParallel()  # no tensor parallelism: one rank holds everything
