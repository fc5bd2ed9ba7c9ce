"""`layerline bench links`: what a real link between two hosts does to a 2-stage chain.

Owns the link study. In a `netlab` (network namespaces as hosts, so it runs as root), host A
runs the coordinator and stage [0, 19), host B stage [19, 30); B is dialled through the lab's
relay, which holds each direction's bytes for the link's one-way delay, and both hosts' links are
shaped to the rate (`tbf`). For each rate and delay it measures, from a client on host A:
single-stream decode tokens/s, aggregate tokens/s of 8 concurrent streams, and the time to the
first token of a 512-token prompt; and the same model whole on one host (no link), as
the line to beat. It writes `links.md` (a table) and `links.png` (tokens/s against delay).

Why the curve bends where it does: at decode a step carries one token's hidden state per
sequence across the hop (a few KB), so each token pays the delay twice (stage A to B, B's result
back to the coordinator) and bandwidth hardly matters; several streams keep several micro-batches
in flight and hide part of it. A prompt's first step carries every prompt token's hidden state
(about 1.2 MB for 512 tokens of SmolLM2 in float32), so there bandwidth dominates.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from layerline.client import Client
from layerline.shared.model_config import ModelConfig

from .netlab import Host, NetLab, unavailable

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PROMPT = "Write a long story about a dragon who learns to paint. Once upon a time"
# 512 tokens of SmolLM2's tokenizer (the study's figures name the count the coordinator reported).
LONG_PROMPT = (
    " ".join(f"Rule {i}: answer briefly and name the price of bread number {i}." for i in range(29))
    + " Now tell me the price of bread number seven."
)


@dataclass(frozen=True)
class Point:
    rate_mbit: float | None  # None: one host, no link
    delay_ms: float
    single_tokens_per_s: float
    aggregate_8_tokens_per_s: float
    long_prompt_ttft_s: float
    long_prompt_tokens: int
    # What the long prompt's hidden states take on the link at its rate alone (no framing, no
    # delay): the least a hop can add to its first token. None on one host.
    prompt_wire_ms: float | None = None


def run_links(
    checkpoint: Path,
    out: Path,
    *,
    delays_ms: Sequence[float] = (0, 1, 5, 20),
    rates_mbit: Sequence[float] = (100, 1000),
    tokens: int = 32,
    rounds: int = 3,
    dtype: str = "float32",
    log: Callable[[str], None] = lambda _: None,
) -> list[Point]:
    """Measure every (rate, delay), and one host; write out/links.md and out/links.png."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"the link study needs test hosts: {reason}")
    out.mkdir(parents=True, exist_ok=True)
    width = ModelConfig.from_checkpoint(checkpoint).hidden_size * DTYPE_BYTES[dtype]  # bytes a token
    points: list[Point] = []
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        spawn = spawner(lab, logs, ["--model", str(checkpoint)])
        registry, target = f"{a.address}:7071", f"{a.address}:7070"
        ports = ["--port", "7070", "--cluster-port", "7071", "--prefix-cache", "0"]
        spawn(a, "coordinator", ["coordinator", "--host", a.address, *ports])

        # The two hosts share this machine's cores: each stage decodes on its share, and takes all
        # of them for a prompt's chunk, when the other stage waits for it (as `layerline up` does).
        cores = os.cpu_count() or 1

        def stage(host: Host, layers: str, port: int, threads: int, *extra: str) -> subprocess.Popen[bytes]:
            argv = ["stage", "--layers", layers, "--host", host.address, "--port", str(port), "--dtype", dtype]
            argv += ["--coordinator", registry, "--threads", str(threads), "--prefill-threads", str(cores), *extra]
            return spawn(host, f"stage-{host.name}", argv)

        log(f"one host: the whole model on host A ({cores} threads) ...")
        whole = stage(a, "0:30", 7090, cores)
        points.append(_measure(lab, a, target, None, 0.0, tokens=tokens, rounds=rounds))
        stop_all([whole])
        for rate in rates_mbit:
            for host in (a, b):
                lab.shape(host, rate)
            for delay in delays_ms:
                (via,) = lab.relay([(b, 7100, delay)])
                log(f"{rate:g} Mbit/s, {delay:g} ms each way ...")
                share = max(1, cores // 2)
                pair = [stage(a, "0:19", 7100, share), stage(b, "19:30", 7100, share, "--advertise", via)]
                point = _measure(lab, a, target, rate, delay, tokens=tokens, rounds=rounds)
                wire_ms = 1000 * point.long_prompt_tokens * width * 8 / (rate * 1e6)
                points.append(replace(point, prompt_wire_ms=wire_ms))
                stop_all(pair)  # each deregisters as it drains, so the next pair starts on a clean slate
    (out / "links.md").write_text(table(points))
    (out / "links.json").write_text(json.dumps([asdict(p) for p in points], indent=2) + "\n")
    plot(points, out / "links.png")
    return points


def spawner(lab: NetLab, logs: Path, model: list[str]) -> Callable[[Host, str, list[str]], subprocess.Popen[bytes]]:
    def spawn(host: Host, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (logs / f"{name}.log").open("ab")
        command = [sys.executable, "-m", "layerline", *argv, *model]
        return lab.popen(host, command, stdout=log, stderr=subprocess.STDOUT)

    return spawn


def stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(30)


def _measure(
    lab: NetLab, host: Host, target: str, rate: float | None, delay: float, *, tokens: int, rounds: int
) -> Point:
    args = json.dumps({"target": target, "tokens": tokens, "rounds": rounds})
    done = lab.run(host, [sys.executable, "-m", "layerline.bench.links", "--probe", args], timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed at {rate} Mbit/s, {delay} ms: {done.stderr[-2000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return Point(rate, delay, **figures)


def wait_for_a_chain(client: Client, *, timeout: float = 300.0) -> None:
    """Until the coordinator reports a complete chain, then one short answer to warm it up."""
    from layerline.client import LayerlineError

    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.cluster(timeout=5).chains:
                client.generate(PROMPT, max_tokens=4, temperature=0.0)
                return
        except LayerlineError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def probe(target: str, *, tokens: int, rounds: int) -> dict[str, float]:
    """Run inside host A: wait for the chain, warm up, then the medians of `rounds` measurements."""
    from layerline.client import AsyncClient, Client

    with Client(target) as client:
        wait_for_a_chain(client)
        singles, longs = [], []
        prompt_tokens = 0
        for _ in range(rounds):
            arrivals = []
            for chunk in client.stream(PROMPT, max_tokens=tokens, temperature=0.0):
                arrivals += [time.perf_counter()] * len(chunk.token_ids)
            singles.append((len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-9))
            for _ in range(2):  # the first token of a long prompt varies most: take two a round
                start = time.perf_counter()
                answer = client.generate(LONG_PROMPT, max_tokens=1, temperature=0.0)
                longs.append(time.perf_counter() - start)
                prompt_tokens = answer.usage.prompt_tokens

    async def eight() -> float:
        async with AsyncClient(target) as aclient:
            start = time.perf_counter()
            done = await asyncio.gather(
                *(aclient.generate(PROMPT, max_tokens=tokens, temperature=0.0) for _ in range(8))
            )
            return sum(len(d.token_ids) for d in done) / (time.perf_counter() - start)

    aggregates = [asyncio.run(eight()) for _ in range(rounds)]
    return {
        "single_tokens_per_s": statistics.median(singles),
        "aggregate_8_tokens_per_s": statistics.median(aggregates),
        "long_prompt_ttft_s": statistics.median(longs),
        "long_prompt_tokens": prompt_tokens,
    }


def table(points: Sequence[Point]) -> str:
    lines = [
        "| link | one-way delay | single stream tok/s | 8 streams tok/s | first token, "
        f"{points[0].long_prompt_tokens}-token prompt | its hidden states at the link's rate |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        link = "one host (whole model)" if p.rate_mbit is None else f"{p.rate_mbit:g} Mbit/s"
        wire = "-" if p.prompt_wire_ms is None else f"{p.prompt_wire_ms:.0f} ms"
        lines.append(
            f"| {link} | {p.delay_ms:g} ms | {p.single_tokens_per_s:.1f} | {p.aggregate_8_tokens_per_s:.1f} "
            f"| {1000 * p.long_prompt_ttft_s:.0f} ms | {wire} |"
        )
    return "\n".join(lines) + "\n"


def plot(points: Sequence[Point], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'layerline[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (decode, prefill) = plt.subplots(1, 2, figsize=(11, 4.2))
    one = next((p for p in points if p.rate_mbit is None), None)
    for rate in sorted({p.rate_mbit for p in points if p.rate_mbit is not None}):
        series = sorted((p for p in points if p.rate_mbit == rate), key=lambda p: p.delay_ms)
        delays = [p.delay_ms for p in series]
        decode.plot(delays, [p.single_tokens_per_s for p in series], "o-", label=f"1 stream, {rate:g} Mbit/s")
        decode.plot(delays, [p.aggregate_8_tokens_per_s for p in series], "s--", label=f"8 streams, {rate:g} Mbit/s")
        prefill.plot(delays, [1000 * p.long_prompt_ttft_s for p in series], "o-", label=f"{rate:g} Mbit/s")
    if one is not None:
        decode.axhline(one.single_tokens_per_s, color="grey", label="1 stream, one host")
        decode.axhline(one.aggregate_8_tokens_per_s, color="grey", linestyle="--", label="8 streams, one host")
        prefill.axhline(1000 * one.long_prompt_ttft_s, color="grey", label="one host")
    decode.set(xlabel="one-way delay (ms)", ylabel="decode tokens/s", title="2 stages across a link: decode")
    prefill.set(xlabel="one-way delay (ms)", ylabel="ms", title="first token of a long prompt")
    for axes in (decode, prefill):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "--probe":
        options = json.loads(args[1])
        figures = probe(options["target"], tokens=options["tokens"], rounds=options["rounds"])
        print(json.dumps(figures))
        return 0
    print("usage: python -m layerline.bench.links --probe JSON (run by `layerline bench links`)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
