"""The faster ways through a stage a `StageModel` may be given (llama.py holds them, layouts.py
installs them): their calls, as the model makes them.

Knows the calls' shapes only; nothing of the math behind them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .kv_cache import PagedKVCache, StepLayout


class RowPath(Protocol):
    """A faster way through a stage for a step of one token of one sequence whose KV is one run of
    cache slots, over the same weights: rows.py's, which the CPU layouts install (layouts.py).
    Returns what `StageModel.forward` returns, or None where it cannot serve the step."""

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        threads: int,
        argmax_only: bool,
    ) -> torch.Tensor | None: ...


class DecodePath(Protocol):
    """A faster way through a stage for a step of decoding sequences only, over the same weights:
    decode_path.py's, which the CPU layouts install where they pack (layouts.py). Returns what
    `StageModel.forward` returns, or None where it cannot serve the step."""

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        cache: PagedKVCache,
        layout: StepLayout,
        logit_rows: torch.Tensor | None,
        argmax_only: bool,
    ) -> torch.Tensor | None: ...
