"""`layerline plan --check` across real links: a 2-stage chain split over two test hosts.

Owns the link rows of the check. In a `netlab` (network namespaces as hosts, so it needs root),
host A runs the coordinator and the first stage, host B the second; B is dialled through the
lab's relay, which holds each direction's bytes for the link's one-way delay, and both hosts'
links are shaped to 1 Gbit/s, as `layerline bench links` does. It measures the same three
figures as the local rows (one stream's decode tokens/s, `concurrency` streams' aggregate, the
first token of the long prompt) at 1 ms and 5 ms each way, and predicts them for two hosts with
that link between them which share this machine's cores (`Machine.shared_cores`): the lab's
hosts are namespaces of one machine, each stage decoding on its share of the cores.

Where the lab cannot run (not root, no iproute2), the rows are left out and the reason said.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from layerline.bench import links
from layerline.bench.netlab import Host, NetLab, unavailable
from layerline.shared.model_config import ModelConfig

from .hardware import CPU, Link
from .predict import Layout, Machine, Workload, predict
from .profile import MachineProfile
from .recommend import layouts

RATE_BITS_S = 1e9  # the links' rate, as `bench links` shapes them
DELAYS_MS = {"2 stages, 1 ms link": 1.0, "2 stages, 5 ms link": 5.0}  # row name -> one-way delay


def lab_machine(profile: MachineProfile, delay_ms: float) -> Machine:
    """Two hosts sharing this machine's cores, joined by a 1 Gbit/s link of `delay_ms` each way."""
    link = Link(f"1gbit:{delay_ms:g}ms", RATE_BITS_S / 8, delay_ms / 1000)
    return Machine(CPU, 2, 1, None, link, profile, shared_cores=True)


def split(config: ModelConfig, profile: MachineProfile) -> tuple[tuple[int, int], ...]:
    """The 2-stage cut the planner predicts for (the same cut as the local 2-stage row)."""
    (layout,) = [lay for lay in layouts(config, lab_machine(profile, 1.0)) if (lay.tp, lay.pp, lay.dp) == (1, 2, 1)]
    return layout.layers


def figures(
    config: ModelConfig,
    layout: Layout,
    machine: Machine,
    *,
    short: int,
    long: int,
    new_tokens: int,
    concurrency: int,
    dtype: str,
) -> dict[str, float]:
    """The check's three figures predicted for one layout (check.py's rows use it too); `short`
    and `long` are the prompts' token counts."""
    streams = predict(config, layout, machine, Workload(dtype, short + new_tokens, concurrency, concurrency * short))
    first = predict(config, layout, machine, Workload(dtype, long, 1, long))
    # The measured aggregate times the streams' prompts (one step of all of them) and then their tokens.
    seconds = streams.ttft_ms / 1000 + (new_tokens - 1) * concurrency / streams.aggregate_tok_s
    return {
        "decode_tok_s": streams.decode_tok_s,
        "aggregate_tok_s": concurrency * new_tokens / seconds,
        "ttft_ms": first.ttft_ms,
    }


def link_predictions(
    config: ModelConfig,
    profile: MachineProfile,
    *,
    short: int,
    long: int,
    new_tokens: int,
    concurrency: int,
    dtype: str,
) -> dict[str, dict[str, float]]:
    """The rows' predicted figures; `short` and `long` are the prompts' token counts."""
    out = {}
    for name, delay in DELAYS_MS.items():
        machine = lab_machine(profile, delay)
        (layout,) = [lay for lay in layouts(config, machine) if (lay.tp, lay.pp, lay.dp) == (1, 2, 1)]
        out[name] = figures(
            config,
            layout,
            machine,
            short=short,
            long=long,
            new_tokens=new_tokens,
            concurrency=concurrency,
            dtype=dtype,
        )
    return out


def measure_links(
    checkpoint: Path,
    layers: tuple[tuple[int, int], ...],
    *,
    dtype: str,
    new_tokens: int,
    concurrency: int,
    rounds: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, float]] | str:
    """The rows' measured figures, or why they cannot be measured here."""
    reason = unavailable()
    if reason is not None:
        return reason
    cores = os.cpu_count() or 1
    logs = Path(tempfile.mkdtemp(prefix="layerline-plan-check-links-"))
    (_, first_end), (_, last_end) = layers
    out: dict[str, dict[str, float]] = {}
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        spawn = links.spawner(lab, logs, ["--model", str(checkpoint)])
        registry, target = f"{a.address}:7071", f"{a.address}:7070"
        ports = ["--port", "7070", "--cluster-port", "7071", "--prefix-cache", "0"]
        spawn(a, "coordinator", ["coordinator", "--host", a.address, *ports])
        for host in (a, b):
            lab.shape(host, RATE_BITS_S / 1e6)
        share = max(1, cores // 2)  # the hosts share the cores, as `up`'s stages do

        def stage(host: Host, layers: str, *extra: str) -> subprocess.Popen[bytes]:
            argv = ["stage", "--layers", layers, "--host", host.address, "--port", "7100", "--dtype", dtype]
            argv += ["--coordinator", registry, "--threads", str(share), "--prefill-threads", str(cores)]
            return spawn(host, f"stage-{host.name}", [*argv, *extra])

        for name, delay in DELAYS_MS.items():
            (via,) = lab.relay([(b, 7100, delay)])
            log(f"{name}: stages 0:{first_end} on host A, {first_end}:{last_end} on host B ...")
            pair = [stage(a, f"0:{first_end}"), stage(b, f"{first_end}:{last_end}", "--advertise", via)]
            try:
                out[name] = _probe(lab, a, target, new_tokens=new_tokens, concurrency=concurrency, rounds=rounds)
            finally:
                links.stop_all(pair)
            log(
                f"{name}: {out[name]['decode_tok_s']:.1f} tok/s alone, {out[name]['aggregate_tok_s']:.1f} in all, "
                f"first token {out[name]['ttft_ms']:.0f} ms"
            )
    return out


def _probe(lab: NetLab, host: Host, target: str, *, new_tokens: int, concurrency: int, rounds: int) -> dict[str, float]:
    """The check's three figures, measured by a client on `host` (this module, run there)."""
    args = json.dumps({"target": target, "tokens": new_tokens, "streams": concurrency, "rounds": rounds})
    done = lab.run(host, [sys.executable, "-m", "layerline.plan.check_links", args], timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the check's client failed across the link: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _client(target: str, *, tokens: int, streams: int, rounds: int) -> dict[str, float]:
    """Inside host A: the local rows' measurements (bench/clusters.py's), against the chain across the link."""
    from layerline.bench.clusters import cluster_aggregate, cluster_long_ttft, cluster_single
    from layerline.client import Client

    class Remote:  # what bench/clusters.py's measurements ask of a cluster
        address, token, ca_cert, certs = target, None, None, None

        def client(self) -> Client:
            return Client(target)

    remote = Remote()
    with Client(target) as client:
        links.wait_for_a_chain(client)
    samples: dict[str, list[float]] = {"decode_tok_s": [], "aggregate_tok_s": [], "ttft_ms": []}
    for _ in range(rounds):
        samples["decode_tok_s"].append(cluster_single(remote, tokens).decode_tokens_per_s)  # type: ignore[arg-type]
        samples["aggregate_tok_s"].append(cluster_aggregate(remote, streams, tokens))  # type: ignore[arg-type]
        samples["ttft_ms"].append(1000 * cluster_long_ttft(remote))  # type: ignore[arg-type]
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m layerline.plan.check_links JSON (run by `layerline plan --check`)", file=sys.stderr)
        return 2
    options = json.loads(args[0])
    figures = _client(options["target"], tokens=options["tokens"], streams=options["streams"], rounds=options["rounds"])
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
