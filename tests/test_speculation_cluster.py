"""Speculative decoding on the real model: a cluster of 2 stages with --speculate 8, through the SDK."""

from __future__ import annotations

import time

import grpc
import pytest

from layerline.client import Client
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

from .stage_client import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.cluster]

# An answer that quotes its prompt: the function again, with one name changed.
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
QUOTING = (
    f"{CODE}\n# The same function with `subtotal` renamed to `net`:\ndef total_price(items, tax_rate):\n    net = 0\n"
)


@pytest.fixture(scope="module")
def cluster(real_model_dir, tmp_path_factory):
    plan = ClusterPlan(
        model=str(real_model_dir),
        stages=2,
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("speculation-logs"),
        kv_memory="64M",
        coordinator_args=("--speculate", "8", "--prefix-cache", "0"),
    )
    local = LocalCluster(plan, real_model_dir)
    local.start()
    try:
        local.wait_ready(timeout=180)
        yield local
    finally:
        local.stop()


def all_kv_free(client: Client) -> bool:
    """Every stage's KV blocks free again (the prefix cache is off), waiting for heartbeats to tell."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        workers = client.cluster().workers
        if all(w.load.kv_blocks_free == w.load.kv_blocks_total for w in workers):
            return True
        time.sleep(0.2)
    return False


def test_greedy_quoting_answer_is_the_same_with_and_without_speculation(cluster, hf_greedy):
    with Client(cluster.address) as client:
        before = client.cluster()
        spec = client.generate(QUOTING, max_tokens=64, temperature=0.0)  # the coordinator's --speculate 8
        plain = client.generate(QUOTING, max_tokens=64, temperature=0.0, speculate=0)
        after = client.cluster()
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason and len(spec.token_ids) >= 32  # the function, then its end
        assert spec.token_ids == hf_greedy(QUOTING, 64)[: len(spec.token_ids)]
        drafted = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
        accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
        assert 24 <= accepted < drafted  # quoted lines were drafted and accepted, some drafts were wrong
        assert all_kv_free(client)


def test_seeded_sampling_is_the_same_with_and_without_speculation(cluster):
    with Client(cluster.address) as client:
        runs = [
            client.generate(QUOTING, max_tokens=32, temperature=0.7, seed=seed, speculate=k, logprobs=1)
            for seed, k in ((3, 0), (3, 8), (3, 2), (4, 8))
        ]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids != runs[3].token_ids
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_a_cancelled_speculating_stream_frees_its_kv(cluster):
    with Client(cluster.address) as client:
        chunks = 0
        for _ in client.stream(QUOTING, max_tokens=200, temperature=0.0, speculate=8):
            chunks += 1
            if chunks == 3:
                break  # the client goes away mid-answer
        assert all_kv_free(client)
        assert len(client.generate("The sky is", max_tokens=4, temperature=0.0).token_ids) == 4


@pytest.mark.parametrize("value", [17, 4096])
def test_a_bad_speculate_is_refused_naming_the_field(cluster, value):
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(speculate=value))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"speculate = {value} must be in [0, 16] (0: off)"
    with Client(cluster.address) as client, pytest.raises(ValueError, match="speculate"):
        client.generate("hi", speculate=-1)


def test_the_bench_workloads_run_and_quoting_drafts_are_accepted(cluster):
    from layerline.bench.speculate import ORDINARY, QUOTING, run_workload

    with Client(cluster.address) as client:
        quoting = run_workload(client, "quoting", QUOTING[1:2], tokens=32, speculate=8, rounds=1)
        ordinary = run_workload(client, "ordinary", ORDINARY[:1], tokens=16, speculate=8, rounds=1)
    assert quoting.tokens == 32 and quoting.acceptance > 0.5  # the class is copied with one name changed
    assert quoting.plain_tok_s > 0 and quoting.speculative_tok_s > 0
    assert ordinary.tokens == 16 and 0 <= ordinary.acceptance < 0.5
