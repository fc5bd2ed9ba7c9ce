"""`layerline bench quantize`: float32 against `--quantize int8` and `int4`, in one process, one run.

For each scheme it loads the whole model as one stage (the same loader a stage worker uses) and
measures, on the model's forward with its paged KV cache (no gRPC, no engine: the math a
quantized layer changes):

- the bytes of the weights the stage holds (what a stage worker reports as `weights_bytes`);
- decode tokens/s of one stream and of 32 streams, over interleaved rounds, medians kept;
- accuracy against float32: teacher-forced, at each of 32 positions after each of the
  HELD_PROMPTS, whether the argmax agrees with float32's greedy token (the test's measure,
  tests/test_quantize.py), and the perplexity of HELD_TEXT, a paragraph written for this.

Knows nothing of clusters or of the coordinator.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from layerline.shared.cpu import cpu_name
from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.llama import StageModel
from layerline.stage_worker.paged_attention import attends_off_pools
from layerline.stage_worker.weights import load_stage

SCHEMES = ("none", "int8", "int4")

HELD_PROMPTS = (
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
    "The capital of France is",
    "Water boils at",
    "In machine learning, a neural network",
    "To make a cup of tea, first",
    "The history of Rome",
)

HELD_TEXT = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody "
    "went there but the keeper. Every evening he climbed the spiral stairs, one hundred and twelve of "
    "them, trimmed the wick, wound the clockwork that turned the lens, and wrote the weather into a "
    "book with a green cover. In winter the wind came straight off the sea and rattled the windows so "
    "hard that he kept a rolled towel along the sill to stop the draught. In summer the days were "
    "long, and he spent the afternoons mending nets for the fishermen in the village, who paid him in "
    "bread, eggs and news. He liked the news best. A new teacher had come to the school; the baker's "
    "daughter was learning to sail; the harbour wall would be repaired before the autumn storms, or so "
    "the council promised every year. When the supply boat was late he read the books that earlier "
    "keepers had left behind: a guide to the stars, a history of shipwrecks on that coast, and a "
    "cookery book with notes in the margins in three different hands. He added his own notes to the "
    "cookery book, mostly about how long bread takes to rise when the kitchen is cold. On clear "
    "nights he sat on the gallery outside the lamp room and watched the beam sweep across the water, "
    "counting the seconds between flashes, which never changed, and the ships on the horizon, which "
    "always did."
)


@dataclass
class SchemeFigures:
    quantize: str
    weights_bytes: int  # the tensors the stage holds: parameters and quantized buffers
    weights_bytes_one_copy: int  # the same without a second copy of a weight (--weight-layout both's, where kept)
    decode_tok_s_1: float  # one stream
    decode_tok_s_32: float  # 32 streams, tokens of all of them
    prefill_ms: float  # the first token of HELD_TEXT (about 300 tokens): one step of all of them
    agreement: float  # teacher-forced argmax agreement with float32's greedy tokens
    positions: int  # positions that agreement counts
    agreement_by_token: float  # the same fed one token a step, as a lone stream decodes (the row path)
    perplexity: float  # of HELD_TEXT


@dataclass
class QuantizeBench:
    model: str
    threads: int
    new_tokens: int
    rounds: int
    cpu: str
    schemes: list[SchemeFigures] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)  # e.g. "int8 decode_tok_s_1 vs none"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def weights_bytes(model: torch.nn.Module, *, packed: bool = True) -> int:
    """Bytes of the tensors `model` holds (parameters and buffers, each counted once); unless
    `packed`, without the packed copy of a layer that keeps a second one beside it (float32's plain
    module, bfloat16's [out, in] weight: `--weight-layout both` where it keeps two)."""
    beside = ("plain", "weight_rows")  # what a packed layer may keep beside its packed weight
    second = (
        set()
        if packed
        else {
            f"{name}.weight_packed" if name else "weight_packed"
            for name, module in model.named_modules()
            if any(getattr(module, key, None) is not None for key in beside)
        }
    )
    held = {id(t): t for name, t in model.state_dict(keep_vars=True).items() if name not in second}
    return sum(t.numel() * t.element_size() for t in held.values())


class Decoder:
    """One stage holding the whole model, driven as the tests' pipeline drives it: fed token ids,
    it returns the logits of each sequence's last new token (or of every new token)."""

    def __init__(self, stage: StageModel, *, num_blocks: int = 256, block_size: int = 16) -> None:
        config = stage.config
        shape = CacheShape(num_blocks, block_size, stage.shards.num_kv_heads, config.head_dim)
        self.stage = stage
        self.cache = PagedKVCache(shape, layer_ids=stage.layer_range, dtype=torch.float32, device="cpu")
        self.token_rows = attends_off_pools(next(iter(self.cache.k.values())))  # as a stage worker (engine.py)

    @torch.no_grad()
    def step(self, seqs: dict[str, list[int]], *, all_logits: bool = False) -> torch.Tensor:
        names = list(seqs)
        lens = [len(seqs[s]) for s in names]
        for s, n in zip(names, lens):
            self.cache.reserve(s, n)
        window = self.stage.config.sliding_window
        layout = self.cache.plan_step(names, lens, sliding_window=window, token_rows=self.token_rows)
        ids = torch.tensor([t for s in names for t in seqs[s]], dtype=torch.long)
        return self.stage(ids, cache=self.cache, layout=layout, logit_rows=None if all_logits else layout.last_rows())

    def greedy(self, prompts: dict[str, list[int]], new_tokens: int) -> tuple[dict[str, list[int]], float]:
        """Each prompt's greedy continuation, and the seconds its decode steps took (not the prefill)."""
        out: dict[str, list[int]] = {s: [] for s in prompts}
        logits = self.step(prompts)
        start = time.perf_counter()
        for i in range(new_tokens):
            for s, t in zip(prompts, logits.argmax(-1).tolist()):
                out[s].append(t)
            if i + 1 < new_tokens:
                logits = self.step({s: [out[s][-1]] for s in prompts})
        return out, time.perf_counter() - start


def agreement(
    stage: StageModel, held: dict[str, tuple[list[int], list[int]]], *, by_token: bool = False
) -> tuple[int, int]:
    """(positions whose argmax is the reference token, positions): `held` maps a name to a prompt's
    ids and the reference's greedy tokens after it, each fed whole (teacher-forced), or with
    `by_token` the prompt whole and then the reference one token a step, as a lone stream decodes
    (steps of one row: the row path, and under int8 its kernel)."""
    agree = total = 0
    for name, (prompt, reference) in held.items():
        if by_token:
            decoder = Decoder(stage)
            rows = [decoder.step({name: prompt})[0]] + [decoder.step({name: [t]})[0] for t in reference[:-1]]
            predicted = torch.stack(rows).argmax(-1).tolist()
        else:
            logits = Decoder(stage).step({name: prompt + reference}, all_logits=True)  # [prompt + ref, vocab]
            predicted = logits[len(prompt) - 1 : len(prompt) + len(reference) - 1].argmax(-1).tolist()
        agree += sum(p == r for p, r in zip(predicted, reference))
        total += len(reference)
    return agree, total


def perplexity(stage: StageModel, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each of `ids` after those before it."""
    logits = Decoder(stage).step({"text": ids}, all_logits=True).double()  # [len, vocab]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()
    return math.exp(nll.item())


def run_quantize_bench(
    checkpoint: Path,
    *,
    threads: int = 1,
    new_tokens: int = 32,
    rounds: int = 3,
    log: Callable[[str], None] = print,
) -> QuantizeBench:
    """Load float32, int8 and int4 once each, then measure them in interleaved rounds."""
    from tokenizers import Tokenizer

    torch.set_num_threads(threads)
    layers = LayerRange(0, ModelConfig.from_checkpoint(checkpoint).num_layers)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    prompts = {str(i): tokenizer.encode(p).ids for i, p in enumerate(HELD_PROMPTS)}
    text_ids = tokenizer.encode(HELD_TEXT).ids
    stages = {}
    for scheme in SCHEMES:
        log(f"loading {checkpoint.name} with --quantize {scheme} ...")
        stages[scheme] = load_stage(checkpoint, layers, quantize=scheme)
    reference, _ = Decoder(stages["none"]).greedy(prompts, 32)
    held = {name: (prompts[name], reference[name]) for name in prompts}
    batch = {str(i): prompts[str(i % len(prompts))] for i in range(32)}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        log(f"round {r + 1} of {rounds}: {new_tokens} tokens of 1 and of 32 streams, a prompt's first token")
        for scheme, stage in stages.items():
            for streams, seqs in ((1, {"0": prompts["0"]}), (32, batch)):
                _, seconds = Decoder(stage).greedy(seqs, new_tokens)
                times.setdefault((scheme, streams), []).append(streams * (new_tokens - 1) / seconds)
            start = time.perf_counter()
            Decoder(stage).step({"text": text_ids})
            times.setdefault((scheme, 0), []).append(1000 * (time.perf_counter() - start))
    result = QuantizeBench(model=checkpoint.name, threads=threads, new_tokens=new_tokens, rounds=rounds, cpu=cpu_name())
    for scheme, stage in stages.items():
        agree, total = agreement(stage, held)
        by_token, _ = agreement(stage, held, by_token=True)
        result.schemes.append(
            SchemeFigures(
                quantize=scheme,
                weights_bytes=weights_bytes(stage),
                weights_bytes_one_copy=weights_bytes(stage, packed=False),
                decode_tok_s_1=statistics.median(times[(scheme, 1)]),
                decode_tok_s_32=statistics.median(times[(scheme, 32)]),
                prefill_ms=statistics.median(times[(scheme, 0)]),
                agreement=agree / total,
                positions=total,
                agreement_by_token=by_token / total,
                perplexity=perplexity(stage, text_ids),
            )
        )
    base = result.schemes[0]
    for figures in result.schemes[1:]:
        for name in (
            "weights_bytes",
            "weights_bytes_one_copy",
            "decode_tok_s_1",
            "decode_tok_s_32",
            "prefill_ms",
            "perplexity",
        ):
            result.ratios[f"{figures.quantize} {name} vs none"] = getattr(figures, name) / getattr(base, name)
    return result
