"""Tensor parallelism on CPU with gloo: tp 2 and 3 ranks as real processes, against tp 1."""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest
import torch

from layerline.stage_worker.model_config import ConfigError, LayerRange, ModelConfig
from layerline.stage_worker.parallel import TensorParallel, shards_for
from layerline.stage_worker.weights import CheckpointReader, load_stage

from .pipeline import LocalPipeline
from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint

PROMPTS = {"a": [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55], "b": [1, 7, 7, 200], "c": [9]}


def _rank(path: str, rank: int, size: int, port: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tp = TensorParallel(rank=rank, size=size, group=dist.group.WORLD)
        reader = CheckpointReader(path)
        stage = load_stage(path, LayerRange(0, 4), tp=tp, reader=reader)
        pipe = LocalPipeline([stage])
        logits = pipe.step({"x": PROMPTS["a"]}, all_logits=True)
        tokens = LocalPipeline([stage]).greedy(PROMPTS, 16)
        out.put((rank, logits.tolist(), tokens, reader.slices))
    finally:
        dist.destroy_process_group()


def run_tp(path, size: int) -> dict[int, tuple]:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(str(path), r, size, port, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get(timeout=120)
        results[rank] = rest
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("family,size", [("tp_mqa", 2), ("tp_mqa", 3), ("tp_gqa", 3)])
def test_tp_ranks_match_tp1_and_transformers(tmp_path, family, size):
    hf = make_tiny_checkpoint(family, tmp_path)  # vocabulary 211: divisible by neither 2 nor 3
    whole = load_stage(tmp_path, LayerRange(0, 4))
    reference = LocalPipeline([whole]).step({"x": PROMPTS["a"]}, all_logits=True)
    results = run_tp(tmp_path, size)
    hf.generation_config.eos_token_id = None
    for name, ids in PROMPTS.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0)
        for rank in range(size):
            assert results[rank][1][name] == ref[0, len(ids):].tolist(), (name, rank)
    for rank in range(size):
        torch.testing.assert_close(torch.tensor(results[rank][0]), reference, atol=1e-4, rtol=0)
    # Each rank read only its own slices: the q rows of its heads, never a whole sharded tensor.
    config = ModelConfig.from_checkpoint(tmp_path)
    for rank in range(size):
        shards = shards_for(config, TensorParallel(rank=rank, size=size))
        q_slices = [s for s in results[rank][2] if s[0] == "model.layers.0.self_attn.q_proj.weight"]
        d = config.head_dim
        assert q_slices == [("model.layers.0.self_attn.q_proj.weight", 0, shards.head_start * d,
                             (shards.head_start + shards.num_heads) * d)]
        per_rank = -(-211 // size)
        vocab = [s[1:] for s in results[rank][2] if s[0] == "model.embed_tokens.weight"]
        assert vocab == [(0, rank * per_rank, min((rank + 1) * per_rank, 211))]


def test_cuts_that_do_not_divide_are_refused(tmp_path):
    make_tiny_checkpoint("tp_gqa", tmp_path)  # 6 heads, 3 KV heads, intermediate 96
    config = ModelConfig.from_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="--tp 2 and num_key_value_heads = 3: one must divide the other"):
        shards_for(config, TensorParallel(rank=0, size=2))
    with pytest.raises(ConfigError, match="--tp 4 does not divide num_attention_heads = 6"):
        shards_for(config, TensorParallel(rank=0, size=4))
    shards = shards_for(config, TensorParallel(rank=2, size=3))
    assert (shards.num_heads, shards.head_start, shards.num_kv_heads, shards.kv_head_start) == (2, 4, 1, 2)
    assert (shards.intermediate, shards.vocab_start, shards.vocab_per_rank) == (32, 142, 71)
