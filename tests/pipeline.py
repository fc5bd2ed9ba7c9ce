"""A test-side driver that chains StageModels in one process: prefill, then greedy decode."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.llama import StageModel


def cache_for(stage: StageModel, *, num_blocks: int = 64, block_size: int = 8) -> PagedKVCache:
    cfg = stage.config
    shape = CacheShape(num_blocks, block_size, stage.shards.num_kv_heads, cfg.head_dim)
    dtype = next(stage.parameters()).dtype
    return PagedKVCache(shape, layer_ids=stage.layer_range, dtype=dtype, device=next(stage.parameters()).device)


class LocalPipeline:
    """Stages run in order in one process, each with its own cache. `token_rows`: every token a
    decode row, as a stage worker lays steps out where its compiled kernel reads the pools."""

    def __init__(self, stages: Sequence[StageModel], *, num_blocks: int = 64, token_rows: bool = False) -> None:
        self.stages = list(stages)
        self.caches = [cache_for(s, num_blocks=num_blocks) for s in self.stages]
        self.token_rows = token_rows

    @torch.no_grad()
    def step(
        self, seqs: dict[str, list[int]], *, all_logits: bool = False, drafts: dict[str, int] | None = None
    ) -> torch.Tensor:
        """Feed each sequence's new token ids (the last `drafts[s]` of them drafted); returns logits
        (last row of each, or all rows)."""
        ids = [s for s in seqs]
        lens = [len(seqs[s]) for s in ids]
        device = next(self.stages[0].parameters()).device
        x: torch.Tensor = torch.tensor([t for s in ids for t in seqs[s]], dtype=torch.long, device=device)
        for stage, cache in zip(self.stages, self.caches):
            for s, n in zip(ids, lens):
                cache.reserve(s, n)
            drafted = [(drafts or {}).get(s, 0) for s in ids]
            window = stage.config.sliding_window
            layout = cache.plan_step(ids, lens, sliding_window=window, drafts=drafted, token_rows=self.token_rows)
            rows = None if all_logits else layout.last_rows()
            x = stage(x, cache=cache, layout=layout, logit_rows=rows)
        return x.cpu()

    def greedy(self, prompts: dict[str, list[int]], max_new: int) -> dict[str, list[int]]:
        out = {s: [] for s in prompts}
        logits = self.step(prompts)
        for _ in range(max_new):
            nxt = logits.argmax(-1).tolist()
            for s, t in zip(prompts, nxt):
                out[s].append(t)
            if len(out[next(iter(prompts))]) == max_new:
                break
            logits = self.step({s: [out[s][-1]] for s in prompts})
        return out
