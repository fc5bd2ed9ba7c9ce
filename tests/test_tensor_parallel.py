"""Tensor parallelism on CPU with gloo: tp 2 and 3 ranks as real processes, against tp 1."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os

import pytest
import torch

from layerline.shared.model_config import ConfigError, LayerRange, ModelConfig
from layerline.stage_worker.parallel import TensorParallel
from layerline.stage_worker.sharding import shards_for
from layerline.stage_worker.weights import CheckpointReader, load_stage

from .pipeline import LocalPipeline
from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint

PROMPTS = {"a": [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55], "b": [1, 7, 7, 200], "c": [9]}


def _rank(path: str, rank: int, size: int, port: int, out: mp.Queue, device: str = "cpu") -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        tp = TensorParallel(rank=rank, size=size, group=dist.group.WORLD)
        reader = CheckpointReader(path)
        stage = load_stage(
            path, LayerRange(0, 4), tp=tp, reader=reader, device=f"{device}:{rank}" if device == "cuda" else "cpu"
        )
        pipe = LocalPipeline([stage])
        logits = pipe.step({"x": PROMPTS["a"]}, all_logits=True)
        tokens = LocalPipeline([stage]).greedy(PROMPTS, 16)
        out.put((rank, logits.tolist(), tokens, reader.slices))
        dist.barrier()  # no rank leaves while another is still in its last collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: leave without tearing gloo down. Its teardown races its own threads now and then
    # ("terminate called without an active exception", SIGABRT in one CI run of a few hundred),
    # after the results were already delivered; _exit skips it once the results are flushed.
    out.close()
    out.join_thread()
    os._exit(0)


def run_tp(path, size: int, device: str = "cpu") -> dict[int, tuple]:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(str(path), r, size, port, out, device)) for r in range(size)]
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
            assert results[rank][1][name] == ref[0, len(ids) :].tolist(), (name, rank)
    for rank in range(size):
        torch.testing.assert_close(torch.tensor(results[rank][0]), reference, atol=1e-4, rtol=0)
    # Each rank read only its own slices: the q rows of its heads, never a whole sharded tensor.
    config = ModelConfig.from_checkpoint(tmp_path)
    for rank in range(size):
        shards = shards_for(config, TensorParallel(rank=rank, size=size))
        q_slices = [s for s in results[rank][2] if s[0] == "model.layers.0.self_attn.q_proj.weight"]
        d = config.head_dim
        assert q_slices == [
            (
                "model.layers.0.self_attn.q_proj.weight",
                0,
                shards.head_start * d,
                (shards.head_start + shards.num_heads) * d,
            )
        ]
        per_rank = -(-211 // size)
        vocab = [s[1:] for s in results[rank][2] if s[0] == "model.embed_tokens.weight"]
        assert vocab == [(0, rank * per_rank, min((rank + 1) * per_rank, 211))]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL")
def test_nccl_tp_2_on_cuda_matches_tp1(tmp_path):
    make_tiny_checkpoint("tp_mqa", tmp_path)
    reference = LocalPipeline([load_stage(tmp_path, LayerRange(0, 4))]).step({"x": PROMPTS["a"]}, all_logits=True)
    results = run_tp(tmp_path, 2, device="cuda")
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(results[rank][0]), reference, atol=1e-4, rtol=0)


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


def _children(pid: int) -> list[int]:
    import subprocess

    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def _alive(pid: int) -> bool:
    from pathlib import Path

    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


_JOIN_AND_SUM = """
import os, sys, torch, torch.distributed as dist
from layerline.stage_worker.tp_group import join_group
rank = int(sys.argv[1])
tp = join_group(rank=rank, size=2, master=sys.argv[2], timeout_s=1, device="cpu")
t = torch.tensor([rank + 1.0])
dist.all_reduce(t, group=tp.group)
dist.barrier()
print(t.item(), flush=True)
os._exit(0)  # past gloo's teardown, which can abort (see _rank)
"""


@pytest.mark.cluster
def test_a_rank_slower_to_start_than_the_collective_timeout_still_joins() -> None:
    """Rank 1 reaches the rendezvous 3 s after rank 0, whose collectives time out after 1 s:
    torch's rendezvous alone gave up on it after those 1 s (the bench on a loaded machine)."""
    import subprocess
    import sys
    import time

    master = f"127.0.0.1:{free_port()}"
    run = [sys.executable, "-c", _JOIN_AND_SUM]
    procs = [subprocess.Popen([*run, "0", master], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        time.sleep(3)
        procs.append(subprocess.Popen([*run, "1", master], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    first, second = procs
    assert [p.returncode for p in (first, second)] == [0, 0], [err[-2000:] for _, err in outs]
    assert [out.split() for out, _ in outs] == [["3.0"], ["3.0"]]


def test_a_rank_that_exits_or_never_comes_fails_the_join_with_a_reason() -> None:
    from layerline.stage_worker.tp_group import join_group

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of this tensor-parallel stage exited before joining"):
        join_group(rank=0, size=2, master=f"127.0.0.1:{free_port()}", timeout_s=1, device="cpu", gone=lambda: [1])
    with pytest.raises(
        TimeoutError, match=r"rank\(s\) \[1\] of this tensor-parallel stage did not join its group within 0\.5"
    ):
        join_group(rank=0, size=2, master=f"127.0.0.1:{free_port()}", timeout_s=1, device="cpu", join_timeout_s=0.5)


@pytest.mark.cluster
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_rank_that_dies_or_hangs_fails_the_whole_stage(tmp_path, fault):
    import os
    import signal
    import time

    from .stage_client import StageProcess

    make_tiny_checkpoint("tp_mqa", tmp_path / "ckpt")
    stage = StageProcess(tmp_path / "ckpt", "0:4", "--tp", "3", "--tp-timeout", "3", log_dir=tmp_path)
    try:
        stage.wait_serving()
        assert stage.info().tp_size == 3
        followers = _children(stage.proc.pid)
        assert len(followers) == 2
        os.kill(followers[0], getattr(signal, fault))
        start = time.monotonic()
        stage.proc.wait(15)
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        code = stage.stop()
    assert elapsed < 10, elapsed  # fail-stop within seconds, not gloo's default of half an hour
    assert code == 1
    assert "tensor-parallel stage fails stop" in stage.log()
    assert not any(_alive(p) for p in followers)  # no rank is left behind


def _generate_through_the_sdk(model_dir, tmp_path, prompts: list[str], n: int, **plan):  # type: ignore[no-untyped-def]
    """(token ids of each prompt, the cluster status when it was ready)."""
    import asyncio

    from layerline.client import AsyncClient
    from layerline.launcher import ClusterPlan, LocalCluster

    cluster = LocalCluster(
        ClusterPlan(model=str(model_dir), port=free_port(), log_dir=tmp_path / "logs", kv_memory="32M", **plan),
        model_dir,
    )
    cluster.start()
    try:
        status = cluster.wait_ready(timeout=180)
        assert all(w.tp == plan["tp"] for w in status.workers)

        async def run() -> list[list[int]]:
            async with AsyncClient(cluster.address) as client:
                done = await asyncio.gather(*(client.generate(p, max_tokens=n, temperature=0.0) for p in prompts))
            return [d.token_ids for d in done]

        return asyncio.run(run()), status
    finally:
        cluster.stop()


@pytest.mark.cluster
@pytest.mark.real_model
def test_smollm2_at_tp_3_through_the_sdk_equals_transformers(real_model_dir, tmp_path, hf_greedy):
    prompts = ["Once upon a time", "The three primary colors are"]
    got, status = _generate_through_the_sdk(
        real_model_dir, tmp_path, prompts, 16, stages=1, tp=3, stage_args=("--weight-layout", "packed")
    )
    assert got == [hf_greedy(p, 16) for p in prompts]
    # Each rank holds a third of every sharded tensor: 54,298,944 float32 parameters, not 162.8M
    # (with the packed layout alone, a weight is held once).
    assert [w.weights_bytes for w in status.workers] == [54_298_944 * 4]


@pytest.mark.cluster
@pytest.mark.real_model
def test_two_stages_of_tp_2_through_the_sdk_equal_transformers(real_model_dir, tmp_path):
    """A tiny model that tp 2 can cut (SmolLM2's 9 heads cannot be), with SmolLM2's tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path / "tiny"
    hf = make_tiny_checkpoint("tp_mqa", path, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, path / name)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = ["Once upon a time", "def fibonacci(n):", "Water boils at"]
    got, _ = _generate_through_the_sdk(path, tmp_path, prompts, 12, stages=2, tp=2)
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        ids = tok(p)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(ids) :].tolist())
    # The random model may emit an end-of-sequence id (2) before 12 tokens: the cluster stops there.
    assert got == [e[: e.index(2) + 1] if 2 in e else e for e in expected]
