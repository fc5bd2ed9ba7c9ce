"""transformers' `generate`, the baseline of `layerline bench` (same checkpoint, dtype and threads).

transformers is needed here only (the test extra), and is imported when a baseline is made.
"""

from __future__ import annotations

import time
from pathlib import Path

from layerline.bench.stream import Seconds, Stream


class Baseline:
    """transformers' generate on the same checkpoint, dtype and threads."""

    def __init__(self, checkpoint: Path, *, dtype: str, threads: int, prompt: str, long_prompt: str) -> None:
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as err:
            raise RuntimeError(f"the baseline needs transformers ({err}): pip install 'layerline[test]'") from None
        self.torch = torch
        torch.set_num_threads(threads)
        tok = AutoTokenizer.from_pretrained(checkpoint)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
        self.model.generation_config.eos_token_id = None  # exactly the tokens asked for
        self.ids = torch.tensor([tok(prompt)["input_ids"]])
        self.long_ids = torch.tensor([tok(long_prompt)["input_ids"]])
        self._generate(self.ids, 4)  # warm up

    def _generate(self, ids, n: int) -> float:
        with self.torch.no_grad():
            start = time.perf_counter()
            self.model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=2)
            return time.perf_counter() - start

    def single(self, n: int) -> Stream:
        ttft = self._generate(self.ids, 1)
        total = self._generate(self.ids, n)
        per_token = max(total - ttft, 1e-9) / (n - 1)
        return Stream(ttft, 1 / per_token, 1000 * per_token)

    def batch(self, size: int, n: int) -> float:
        return size * n / self._generate(self.ids.repeat(size, 1), n)

    def long_ttft(self) -> Seconds:
        return Seconds(self._generate(self.long_ids, 1))
