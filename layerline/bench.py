"""`layerline bench`: the performance figures of DESIGN.md, measured in one run, as ratios.

Owns the measurement plan: transformers' `generate` as the baseline (single stream and a batch
of 32, at the same dtype and thread count), then local clusters of 1 and 2 stages started as
real processes, each measured through the client SDK: time to first token and decode
tokens/s of a single stream, and aggregate tokens/s at 1, 8 and 32 concurrent streams. Only
one thing runs at a time, so the figures share the machine fairly. transformers is needed here
only, as the baseline.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerline.client import AsyncClient, Client
from layerline.launcher import ClusterPlan, LocalCluster

PROMPT = "Write a long story about a dragon who learns to paint. Once upon a time"
BUDGETS = {
    "single_stream_1_stage_vs_transformers": 1.3,
    "single_stream_2_stages_vs_1_stage": 0.9,
    "concurrent_32_vs_transformers_batch_32": 1.0,
}


@dataclass
class StreamFigures:
    ttft_s: float  # time to first token
    decode_tokens_per_s: float  # after the first token
    tokens: int


@dataclass
class BenchResult:
    model: str
    dtype: str
    threads: int
    new_tokens: int
    transformers_single: StreamFigures | None = None
    transformers_batch32_tokens_per_s: float = 0.0
    clusters: dict[str, dict[str, object]] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    within_budget: dict[str, bool] = field(default_factory=dict)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def transformers_baseline(checkpoint: Path, *, dtype: str, threads: int, new_tokens: int) -> tuple[StreamFigures, float]:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise RuntimeError(f"the baseline needs transformers ({err}); pip install 'layerline[test]'") from None
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    kwargs = dict(do_sample=False, pad_token_id=2)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kwargs)  # warm up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - start
        single = StreamFigures(ttft, (new_tokens - 1) / max(total - ttft, 1e-9), new_tokens)
        batch = ids.repeat(32, 1)
        start = time.perf_counter()
        model.generate(batch, max_new_tokens=new_tokens, **kwargs)
        batch_rate = 32 * new_tokens / (time.perf_counter() - start)
    del model
    return single, batch_rate


def _single_stream(address: str, new_tokens: int) -> StreamFigures:
    with Client(address) as client:
        client.generate(PROMPT, max_tokens=4, temperature=0.0)  # warm up
        start = time.perf_counter()
        first = last = 0.0
        count = 0
        for chunk in client.stream(PROMPT, max_tokens=new_tokens, temperature=0.0):
            now = time.perf_counter()
            if chunk.token_ids and not first:
                first = now
            count += len(chunk.token_ids)
            last = now
    return StreamFigures(first - start, (count - 1) / max(last - first, 1e-9), count)


def _concurrent(address: str, streams: int, new_tokens: int) -> float:
    async def run() -> float:
        async with AsyncClient(address) as client:
            start = time.perf_counter()
            done = await asyncio.gather(
                *(client.generate(PROMPT, max_tokens=new_tokens, temperature=0.0) for _ in range(streams))
            )
            return sum(len(d.token_ids) for d in done) / (time.perf_counter() - start)

    return asyncio.run(run())


def measure_cluster(checkpoint: Path, *, stages: int, dtype: str, new_tokens: int, concurrency: tuple[int, ...],
                    port: int) -> dict[str, object]:
    plan = ClusterPlan(model=str(checkpoint), stages=stages, dtype=dtype, port=port, kv_memory="256M")
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        cluster.wait_ready()
        single = _single_stream(cluster.address, new_tokens)
        _log(f"{stages} stage(s): single stream {single.decode_tokens_per_s:.1f} tok/s, ttft {single.ttft_s * 1000:.0f} ms")
        aggregate: dict[str, float] = {}
        for n in concurrency:
            aggregate[str(n)] = _concurrent(cluster.address, n, new_tokens)
            _log(f"{stages} stage(s): {n} concurrent streams {aggregate[str(n)]:.1f} tok/s")
    finally:
        cluster.stop()
    return {"single": asdict(single), "concurrent_tokens_per_s": aggregate}


def run_bench(checkpoint: Path, *, dtype: str = "float32", new_tokens: int = 64, port: int = 7179,
              json_path: Path | None = None) -> BenchResult:
    threads = os.cpu_count() or 1
    result = BenchResult(model=checkpoint.name, dtype=dtype, threads=threads, new_tokens=new_tokens)
    _log("transformers generate: single stream and batch 32 ...")
    result.transformers_single, result.transformers_batch32_tokens_per_s = transformers_baseline(
        checkpoint, dtype=dtype, threads=threads, new_tokens=new_tokens
    )
    _log(f"transformers: single {result.transformers_single.decode_tokens_per_s:.1f} tok/s, "
         f"batch 32 {result.transformers_batch32_tokens_per_s:.1f} tok/s")
    one = measure_cluster(checkpoint, stages=1, dtype=dtype, new_tokens=new_tokens, concurrency=(), port=port)
    two = measure_cluster(checkpoint, stages=2, dtype=dtype, new_tokens=new_tokens, concurrency=(1, 8, 32),
                          port=port)
    result.clusters = {"1_stage": one, "2_stages": two}
    s1 = one["single"]["decode_tokens_per_s"]  # type: ignore[index]
    s2 = two["single"]["decode_tokens_per_s"]  # type: ignore[index]
    c32 = two["concurrent_tokens_per_s"]["32"]  # type: ignore[index]
    result.ratios = {
        "single_stream_1_stage_vs_transformers": s1 / result.transformers_single.decode_tokens_per_s,
        "single_stream_2_stages_vs_1_stage": s2 / s1,
        "concurrent_32_vs_transformers_batch_32": c32 / result.transformers_batch32_tokens_per_s,
        "added_ms_per_extra_hop_per_token": 1000.0 * (1 / s2 - 1 / s1),
    }
    result.within_budget = {k: result.ratios[k] >= v for k, v in BUDGETS.items()}
    result.within_budget["added_ms_per_extra_hop_per_token"] = result.ratios["added_ms_per_extra_hop_per_token"] <= 1.0
    text = json.dumps(asdict(result), indent=2)
    if json_path is not None:
        json_path.write_text(text + "\n")
    print(text)
    return result
