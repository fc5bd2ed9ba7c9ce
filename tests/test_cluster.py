"""A real local cluster (coordinator + 2 stage workers, separate processes) through the SDK."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from layerline.client import AsyncClient, Client
from layerline.launcher import ClusterPlan, LocalCluster, split_layers
from layerline.protos.v1 import stage_pb2, stage_pb2_grpc
from layerline.shared.model_config import ModelConfig

from .stage_client import free_port

pytestmark = pytest.mark.real_model

PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "Water boils at"]


@pytest.fixture(scope="module")
def cluster(real_model_dir, tmp_path_factory):
    plan = ClusterPlan(
        model=str(real_model_dir),
        stages=2,
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("cluster-logs"),
        kv_memory="64M",
    )
    local = LocalCluster(plan, real_model_dir)
    local.start()
    try:
        local.wait_ready(timeout=180)
        yield local
    finally:
        local.stop()
    assert [p.returncode for _, p in local.procs] == [0, 0, 0]


def test_split_layers_balances_the_work_and_is_half_open(real_model_dir):
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 15), (15, 23), (23, 30)]
    # SmolLM2's LM head (49152 x 576) weighs 8 of its layers: the last stage takes 8 fewer.
    weight = ModelConfig.from_checkpoint(real_model_dir).head_weight
    assert round(weight, 2) == 8.0
    assert split_layers(30, 2, head_weight=weight) == [(0, 19), (19, 30)]
    assert split_layers(30, 3, head_weight=weight) == [(0, 13), (13, 25), (25, 30)]
    assert split_layers(4, 3, head_weight=100) == [(0, 2), (2, 3), (3, 4)]  # every stage keeps a layer
    with pytest.raises(ValueError, match="--stages 31"):
        split_layers(30, 31)


@pytest.mark.cluster
def test_generate_equals_transformers_greedy(cluster, hf_real, hf_greedy):
    tok, _ = hf_real
    with Client(cluster.address) as client:
        r = client.generate(PROMPTS[0], max_tokens=24, temperature=0.0)
    assert r.token_ids == hf_greedy(PROMPTS[0], 24)
    assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    assert r.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok(PROMPTS[0])["input_ids"]), 24)


@pytest.mark.cluster
def test_logprobs_come_with_each_token(cluster):
    with Client(cluster.address) as client:
        r = client.generate(PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=3)
        plain = client.generate(PROMPTS[0], max_tokens=6, temperature=0.0)
    assert plain.logprobs is None and r.token_ids == plain.token_ids
    assert len(r.logprobs) == 6
    for token, lp in zip(r.token_ids, r.logprobs):
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy takes the most likely token
        assert lp.logprob == lp.top[0][1] and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.mark.cluster
def test_stream_deltas_concatenate_to_the_completion(cluster):
    with Client(cluster.address) as client:
        chunks = list(client.stream(PROMPTS[1], max_tokens=20, temperature=0.0))
        whole = client.generate(PROMPTS[1], max_tokens=20, temperature=0.0)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


@pytest.mark.cluster
def test_concurrent_streams_each_equal_transformers(cluster, hf_greedy):
    async def run() -> list[list[int]]:
        async with AsyncClient(cluster.address) as client:
            done = await asyncio.gather(*(client.generate(p, max_tokens=16, temperature=0.0) for p in PROMPTS))
        return [d.token_ids for d in done]

    got = asyncio.run(run())
    assert got == [hf_greedy(p, 16) for p in PROMPTS]


@pytest.mark.cluster
def test_chat_answers_paris(cluster):
    with Client(cluster.address) as client:
        r = client.chat([{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0.0)
    assert "Paris" in r.text
    assert r.finish_reason == "stop"  # the model ends its turn with <|im_end|>


@pytest.mark.cluster
def test_stop_strings_end_the_answer_without_the_stop_text(cluster):
    with Client(cluster.address) as client:
        full = client.generate(PROMPTS[0], max_tokens=24, temperature=0.0).text
        word = full.split()[3]
        cut = client.generate(PROMPTS[0], max_tokens=24, temperature=0.0, stop=[word])
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(word)]


@pytest.mark.parametrize(
    "params,field",
    [
        (dict(temperature=-1.0), "temperature = -1.0 must be in [0, 100]"),
        (dict(top_p=1.5), "top_p = 1.5 must be in (0, 1]"),
        (dict(max_tokens=0), "max_tokens = 0 must be >= 1"),
        (dict(logprobs=50), "logprobs = 50 must be in [0, 20]"),
        (dict(max_tokens=8192), "plus max_tokens = 8192 exceeds the context length of 8192 tokens"),
    ],
)
@pytest.mark.cluster
def test_bad_sampling_parameters_are_refused_by_the_server(cluster, params, field):
    """Straight to the service (the SDK checks these too): INVALID_ARGUMENT naming the field."""
    import grpc

    from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(**params))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
    with Client(cluster.address) as client:  # and the cluster still serves
        assert len(client.generate("hi", max_tokens=2, temperature=0.0).token_ids) == 2


@pytest.mark.cluster
def test_empty_prompt_and_unknown_model_are_refused(cluster):
    import grpc

    from layerline.protos.v1 import coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        for request, message in [
            (coordinator_pb2.GenerateRequest(prompt=""), "prompt must not be empty"),
            (coordinator_pb2.GenerateRequest(prompt="hi", model="llama-70b"), "model 'llama-70b' is not served here"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()


@pytest.mark.cluster
def test_same_seed_same_tokens_different_seeds_differ(cluster):
    with Client(cluster.address) as client:
        runs = [client.generate(PROMPTS[2], max_tokens=24, temperature=1.0, seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.cluster
def test_a_cancelled_stream_releases_its_kv_on_every_stage(cluster):
    import time

    import grpc

    from layerline.protos.v1 import stage_pb2, stage_pb2_grpc

    def kv() -> dict[str, tuple[int, int]]:
        """(free, total less the prefix cache's) KV blocks of each stage, read from the stage itself."""
        cached = {w.address: w.load.kv_blocks_cached for w in client.cluster().workers}
        out = {}
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                info = stage_pb2_grpc.StageWorkerStub(channel).Info(stage_pb2.InfoRequest(), timeout=10).worker
                out[address] = (info.kv_blocks_free, info.kv_blocks_total - cached[address])
        return out

    def wait_all_free() -> dict[str, tuple[int, int]]:
        """Every block not kept by the cache of finished requests is free again."""
        deadline = time.monotonic() + 15
        now = kv()
        while any(f != t for f, t in now.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            now = kv()
        return now

    with Client(cluster.address) as client:
        addresses = [w.address for w in client.cluster().workers]
        before = wait_all_free()  # releases of earlier tests' requests land asynchronously
        assert all(f == t for f, t in before.values()), before
        cached_before = client.cluster().chains[0].cached_prefix_tokens
        other = client.stream(PROMPTS[3], max_tokens=12, temperature=0.0)
        stream = iter(client.stream(PROMPTS[0] * 20, max_tokens=200, temperature=0.0))
        first = [next(stream) for _ in range(3)]
        assert all(c.finish_reason is None for c in first)
        during = kv()
        assert all(during[a][0] < before[a][0] for a in addresses), during  # the long prompt holds blocks
        stream.close()  # the client goes away mid-generation
        rest = list(other)  # another request is unaffected
        after = wait_all_free()
        cached_after = client.cluster().chains[0].cached_prefix_tokens
    assert rest[-1].finish_reason == "length" and sum(len(c.token_ids) for c in rest) == 12
    assert all(f == t for f, t in after.values()), after
    # Only `other`, which ended normally, may have joined the cache (its prompt and 11 of its
    # tokens); the cancelled request's 80-odd tokens did not.
    assert cached_after - cached_before <= rest[-1].usage.prompt_tokens + 11


@pytest.mark.cluster
def test_a_finished_requests_kv_serves_a_later_prompt_that_starts_the_same(cluster, hf_real, hf_greedy):
    tok, _ = hf_real
    base = "In a land far away, beyond the mountains of ice and the rivers of fire, a young"
    longer = base + " painter named Ilsa"
    with Client(cluster.address) as client:
        a = client.generate(base, max_tokens=6, temperature=0.0)
        before = client.cluster()
        b = client.generate(longer, max_tokens=12, temperature=0.0)
        after = client.cluster()
    assert a.token_ids == hf_greedy(base, 6)
    assert b.token_ids == hf_greedy(longer, 12)
    a_fed = tok(base)["input_ids"] + a.token_ids[:-1]  # the last token's KV was never computed
    b_ids = tok(longer)["input_ids"]
    shared = next(i for i, (x, y) in enumerate(zip([*a_fed, -1], b_ids)) if x != y)
    assert shared >= len(tok(base)["input_ids"]) - 1
    assert after.shared_prefix_tokens - before.shared_prefix_tokens == shared
    assert before.chains[0].cached_prefixes >= 1


@pytest.mark.cluster
def test_a_shared_prompt_prefix_is_copied_and_changes_no_token(cluster, hf_real, hf_greedy):
    """B's prompt starts with A's: while A is live, B copies A's KV for those tokens."""
    tok, _ = hf_real
    base = "Once upon a time, in a quiet village by the sea, there lived"
    longer = base + " zebras, quokkas and"
    a_ids, b_ids = tok(base)["input_ids"], tok(longer)["input_ids"]
    shared = next(i for i, (x, y) in enumerate(zip(a_ids + hf_greedy(base, 40), b_ids)) if x != y)
    assert shared >= len(a_ids) - 1 and shared < len(b_ids) - 1
    with Client(cluster.address) as client:
        a = iter(client.stream(base, max_tokens=40, temperature=0.0))
        a_tokens = list(next(a).token_ids)  # A's prompt is in the chain's KV (some of it maybe copied)
        before = client.cluster().shared_prefix_tokens
        b = client.generate(longer, max_tokens=16, temperature=0.0)
        a_tokens += [t for c in a for t in c.token_ids]
        after = client.cluster().shared_prefix_tokens
    assert b.token_ids == hf_greedy(longer, 16)
    assert a_tokens == hf_greedy(base, 40)
    assert after - before == shared


@pytest.mark.cluster
def test_cluster_status_lists_workers_and_the_chain(cluster):
    with Client(cluster.address) as client:
        status = client.cluster()
        assert client.health() == "SERVING"
        models = client.models()
    assert sorted(w.layers for w in status.workers) == cluster.ranges  # as measured: the last stage has fewer
    assert cluster.ranges[0][1] > 15 and cluster.split_note.startswith("measured on 1 thread(s)")
    assert all(w.state == "SERVING" and w.replica == 0 for w in status.workers)
    assert len(status.chains) == 1 and len(status.chains[0].addresses) == 2
    assert [(m.num_layers, m.ready_replicas) for m in models] == [(30, 1)]
    chain = status.chains[0]  # earlier tests' requests ended normally: the cache keeps some of them
    assert chain.cached_prefixes >= 1
    for w in status.workers:  # blocks of 16 tokens, each cached sequence's last one partly filled
        least = chain.cached_prefix_tokens / 16
        assert least <= w.load.kv_blocks_cached < least + chain.cached_prefixes


@pytest.mark.cluster
def test_cluster_status_counts_the_steps_each_worker_computed(cluster):
    ahead: list[tuple[int, int]] = []

    def counts(addresses: list[str]) -> list[tuple[int, float]]:  # asked of each stage itself: fresh
        out = []
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                w = stage_pb2_grpc.StageWorkerStub(channel).Info(stage_pb2.InfoRequest(), timeout=10).worker
            out.append((w.steps_computed, w.compute_seconds))
            ahead.append((w.steps_run_ahead, w.steps_run_ahead_dropped))
        return out

    with Client(cluster.address) as client:
        addresses = client.cluster().chains[0].addresses
        # Both stages run each of a request's steps: its prompt's and three decodes, the first stage each
        # decode as a guess run ahead once the last stage's acknowledgement of the step before told it the
        # token; none after the last token. A readiness probe between two steps drops the guess, and the
        # step is computed again; a header that overtook the acknowledgement finds no guess. On a busy
        # machine a request's three headers can all overtake theirs: a few requests, until one takes one.
        for _ in range(5):
            ahead.clear()
            with grpc.insecure_channel(addresses[0]) as channel:  # drops an earlier guess (counts no step)
                stage_pb2_grpc.StageWorkerStub(channel).Info(stage_pb2.InfoRequest(probe=True), timeout=30)
            before = counts(addresses)
            client.generate("Count the steps.", max_tokens=4, temperature=0.0)
            after = counts(addresses)
            (used, dropped), last = (ahead[2][0] - ahead[0][0], ahead[2][1] - ahead[0][1]), ahead[3]
            assert used + dropped <= 3 and last == (0, 0)
            assert [a[0] - b[0] for a, b in zip(after, before)] == [4 + dropped, 4]
            assert all(a[1] > b[1] for a, b in zip(after, before))
            if used >= 1:
                break
        assert used >= 1
        deadline = time.monotonic() + 10
        while True:  # the coordinator has the counts from each worker's heartbeat, once a second
            by_address = {w.address: w.load for w in client.cluster().workers}
            reported = [(by_address[a].steps_computed, by_address[a].compute_seconds) for a in addresses]
            if reported == after or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert reported == after


@pytest.mark.cluster
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a stage binds its OpenMP threads only with two or more")
def test_each_stage_of_a_local_chain_binds_its_openmp_threads_to_cores(cluster):
    """The chain's stages take turns on this machine's cores, so each binds its OpenMP threads
    (LocalCluster.stage_env): its threads run on narrower CPU sets than the machine's, at least
    two different ones (the compute thread's, its OpenMP worker's)."""
    everything = set(range(os.cpu_count() or 1))
    for name, proc in cluster.procs:
        if not name.startswith("stage-"):
            continue
        masks = set()
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            masks.add(frozenset(os.sched_getaffinity(int(tid))))
        assert len(masks) >= 2 and all(mask < everything for mask in masks), (name, masks)
