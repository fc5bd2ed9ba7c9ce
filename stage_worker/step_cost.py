"""What a decode step costs on this machine: one decoder layer against the LM head, measured.

A chain runs at the pace of its slowest stage, so `layerline up` splits a model's layers where
the stages' steps take equally long. The last stage runs the LM head and samples; the first
embeds. How many layers' worth that is depends on the machine and the batch, not only on bytes:
the head is one large matmul, a layer is four smaller ones plus attention and a few dozen small
operations, whose fixed costs weigh more at a few rows. So it is measured, with random weights
of the model's shapes (the cost of a step does not depend on the values) on the threads a stage
will have, at a decode batch of `rows` sequences each holding `context` tokens:

- `first`: layer 0 with the embedding, as a first stage;
- `last`: the last layer with the norm, head and sampling, as a last stage;
- `more`: the last `1 + k` layers with the head, so that `more - last` is k layers.

The head's weight, in layers, is `(last - first) / layer`: the last stage's extra work over
the first's. Run as a module it prints the figures as JSON, for the launcher, which never
imports torch: `python -m layerline.stage_worker.step_cost --model DIR --threads N`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from layerline.shared.model_config import LayerRange, ModelConfig

from .engine import SequenceStep, StageEngine
from .kv_cache import CacheShape, PagedKVCache
from .layouts import apply_layouts
from .llama import StageModel
from .settings import QUANTIZE

ROWS = 16  # the decode batch measured: where a chain under load spends its time
# Tokens each of its sequences holds. A layer's attention grows with it and the head does not: at
# 128 the head weighed 5.2 layers here (1 thread, AMD EPYC), at 32 and 64 5.9 and 6.0, and a
# 2-stage chain under 32 streams of 17-81 tokens ran its stages at 77 and 87 ms a step on the
# split that 128 gave (0:17), where its steps said the head was 6.3 layers' worth.
CONTEXT = 64
REPEATS = 15  # timed steps of each model, interleaved; the median of each is kept


@dataclass(frozen=True)
class StepCost:
    layer_ms: float  # one decoder layer's part of a decode step
    head_weight: float  # the last stage's extra work over the first's, in layers (>= 0)
    rows: int
    threads: int


class _Timed:
    """A stage of the model's shapes with random weights, holding `rows` sequences of `context` tokens."""

    def __init__(
        self, config: ModelConfig, layers: LayerRange, *, rows: int, context: int, dtype: torch.dtype, quantize: str
    ) -> None:
        model = StageModel(config, layers).to(dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model = apply_layouts(model, weight_layout="both", dtype=dtype, device="cpu", quantize=quantize).eval()
        blocks = rows * (-(-(context + REPEATS + 4) // 16))
        shape = CacheShape(blocks, 16, config.num_kv_heads, config.head_dim)
        self.engine = StageEngine(model, PagedKVCache(shape, layer_ids=layers, dtype=dtype))
        self.rows, self.length = rows, context
        self.hidden = config.hidden_size
        self.dtype = dtype
        self._run([tuple(range(context)) for _ in range(rows)])

    def _run(self, positions: list[tuple[int, ...]]) -> float:
        steps = [SequenceStep(f"s{i}", p, p if self.engine.is_first else ()) for i, p in enumerate(positions)]
        total = sum(len(p) for p in positions)
        hidden = None if self.engine.is_first else torch.zeros(total, self.hidden, dtype=self.dtype)
        start = time.perf_counter()
        out = self.engine.run(steps, hidden, alone=False)
        assert not out.errors, out.errors
        return time.perf_counter() - start

    def step(self) -> float:
        """Seconds of one decode step of every sequence."""
        seconds = self._run([(self.length,)] * self.rows)
        self.length += 1
        return seconds


def measure(
    config: ModelConfig, *, rows: int = ROWS, context: int = CONTEXT, dtype: torch.dtype, quantize: str = "none"
) -> StepCost:
    """The cost of a decoder layer and the head's weight in layers, on torch's current threads,
    with the stages' weights (`quantize`: one of settings.QUANTIZE)."""
    n = config.num_layers
    if n < 3:
        raise ValueError(f"measuring needs 3 layers or more; the model has {n}")
    k = min(4, n - 2)  # `more` holds layers n-1-k .. n-1, never layer 0
    ranges = {"first": LayerRange(0, 1), "last": LayerRange(n - 1, n), "more": LayerRange(n - 1 - k, n)}
    with torch.inference_mode():
        models = {
            name: _Timed(config, r, rows=rows, context=context, dtype=dtype, quantize=quantize)
            for name, r in ranges.items()
        }
        for model in models.values():
            model.step()  # warm
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(REPEATS):
            for name, model in models.items():
                times[name].append(model.step())
    first, last, more = (statistics.median(times[name]) for name in ("first", "last", "more"))
    layer = max((more - last) / k, 1e-6)
    return StepCost(1000 * layer, max(0.0, (last - first) / layer), rows, torch.get_num_threads())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory (only its config.json is read)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, as each stage will have")
    parser.add_argument("--dtype", default="float32", help="the stages' dtype")
    parser.add_argument("--rows", type=int, default=ROWS, help="decode batch: sequences per step")
    parser.add_argument("--quantize", default="none", choices=QUANTIZE, help="the stages' --quantize")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_checkpoint(args.model)
    cost = measure(config, rows=args.rows, dtype=getattr(torch, args.dtype), quantize=args.quantize)
    print(json.dumps(asdict(cost)))


if __name__ == "__main__":
    main()
