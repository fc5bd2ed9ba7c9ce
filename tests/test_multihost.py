"""Members on separate hosts: network namespaces joined by a bridge, 2 ms links, mutual TLS.

Each test host is a network namespace of its own (`layerline.bench.netlab`), the coordinator and
every stage on its own host, every member dialled through the lab's relay (2 ms each way) and
advertising the relay's address while binding its host's. Runs as root (CI does); elsewhere the
module skips and says why.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerline.bench.lab_cluster import LabCluster
from layerline.bench.netlab import NetLab, unavailable

REASON = unavailable()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.real_model,
    pytest.mark.skipif(REASON is not None, reason=f"no test hosts on this machine: {REASON}"),
]

CLIENT = Path(__file__).with_name("netlab_client.py")
PROMPTS = [f"Chapter {i + 1}. Once upon a time, in a village by the sea," for i in range(8)]
DELAY_MS = 2.0


@pytest.fixture
def lab() -> Iterator[NetLab]:
    with NetLab() as made:
        yield made


def _answers(process: subprocess.Popen[str], cluster: LabCluster, *, timeout: float = 300) -> list[list[int]]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:] + cluster.logs()
    return json.loads(out.strip().splitlines()[-1])


def test_three_hosts_over_mutual_tls_answer_as_transformers(lab, real_model_dir, hf_greedy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """8 concurrent greedy prompts, each stage binding one address (its host's) and advertising
    another reachable one (the relay's), which its peers and the coordinator dial."""
    coordinator, first, last = lab.host("coord"), lab.host("s0"), lab.host("s1")
    cluster = LabCluster(
        lab, real_model_dir, coordinator, [[(first, "0:19"), (last, "19:30")]], delay_ms=DELAY_MS, log_dir=tmp_path
    )
    cluster.start()
    got = _answers(cluster.client(PROMPTS, max_tokens=12, script=CLIENT), cluster)
    assert got == [hf_greedy(p, 12) for p in PROMPTS]
    # Each stage served on its host's address and registered the relay's, which its peers dialled.
    registered = (tmp_path / "coordinator.log").read_text()
    for host in (first, last):
        assert cluster.advertised[host.name].startswith(lab.hosts["relay"].address + ":")
        served = f"serving on {host.address}:7100, advertised as {cluster.advertised[host.name]}"
        assert served in (tmp_path / f"stage-{host.name}.log").read_text()
        assert f"worker {cluster.advertised[host.name]} registered" in registered


def test_two_replicas_on_five_hosts_survive_a_cut_link(lab, real_model_dir, hf_greedy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Greedy answers equal transformers; then a stage host's link is cut mid-generation and
    every stream completes, identical, through the other replica."""
    coordinator = lab.host("coord")
    hosts = [lab.host(f"s{i}") for i in range(4)]
    chains = [[(hosts[0], "0:19"), (hosts[1], "19:30")], [(hosts[2], "0:19"), (hosts[3], "19:30")]]
    cluster = LabCluster(lab, real_model_dir, coordinator, chains, delay_ms=DELAY_MS, log_dir=tmp_path)
    cluster.start()
    reference = _answers(cluster.client(PROMPTS, max_tokens=24, script=CLIENT), cluster)
    assert reference == [hf_greedy(p, 24) for p in PROMPTS]

    client = cluster.client(PROMPTS, max_tokens=24, script=CLIENT)
    assert client.stdout is not None and client.stderr is not None
    cut_at = None
    lines = []
    for line in client.stdout:  # to its end, cutting the link on the way
        lines.append(line)
        if cut_at is None and line.startswith("progress") and int(line.split()[1]) >= 6:
            lab.cut(hosts[1])  # the last stage of replica 0
            cut_at = time.monotonic()
    client.wait(timeout=60)
    assert client.returncode == 0, client.stderr.read()[-3000:] + cluster.logs()
    assert cut_at is not None, "the stream never reached 6 tokens"
    answers = json.loads(lines[-1])
    assert answers == reference
    assert time.monotonic() - cut_at < 120
    moved = (tmp_path / "coordinator.log").read_text().count("moved to chain 0")
    assert moved >= 1, cluster.logs()  # the cut chain's streams did go over to the other one


def test_one_point_of_the_link_study_runs(real_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`layerline bench links`, shortened to one delay and one rate: a benchmark, kept working."""
    from layerline.bench.links import run_links

    points = run_links(real_model_dir, tmp_path, delays_ms=(1,), rates_mbit=(1000,), tokens=8, rounds=1)
    assert [(p.rate_mbit, p.delay_ms) for p in points] == [(None, 0.0), (1000, 1)]
    assert all(p.single_tokens_per_s > 0 and p.aggregate_8_tokens_per_s > 0 for p in points)
    assert all(p.long_prompt_tokens == 512 for p in points)
    table = (tmp_path / "links.md").read_text().splitlines()
    assert len(table) == 2 + len(points) and table[2].startswith("| one host")
    assert (tmp_path / "links.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
