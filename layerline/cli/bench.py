"""`layerline bench`, `bench links` and `bench chaos`: speed as ratios in one run, what a link does,
and whether a cluster under `up` keeps every request while its workers die."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .cluster import add_model_flags
from .support import HelpFormatter, Subcommands, reported_as_errors


def _numbers(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _run_bench_links(args: argparse.Namespace) -> int:
    from layerline.bench.links import run_links
    from layerline.model_store import ModelStoreError, resolve_model

    with reported_as_errors(ModelStoreError, RuntimeError):
        points = run_links(
            resolve_model(args.model),
            args.out,
            delays_ms=args.delays,
            rates_mbit=args.rates,
            tokens=args.new_tokens,
            rounds=args.rounds,
            dtype=args.dtype,
            log=lambda m: print(f"[links] {m}", file=sys.stderr, flush=True),
        )
    from layerline.bench.links import table

    print(table(points), end="")
    print(f"[links] wrote {args.out / 'links.md'} and {args.out / 'links.png'}", file=sys.stderr)
    return 0


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return value

    return parse


def _run_bench_chaos(args: argparse.Namespace) -> int:
    import json
    import os
    import tempfile

    from layerline.bench.chaos import ChaosPlan, run_chaos
    from layerline.model_store import ModelStoreError, resolve_model

    run_dir = args.out or Path(tempfile.mkdtemp(prefix="layerline-chaos-"))
    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        report = run_chaos(
            ChaosPlan(
                model=str(resolve_model(args.model)),
                port=args.port,
                run_dir=run_dir,
                duration=args.duration,
                streams=args.streams,
                new_tokens=args.new_tokens,
                kills=args.kills,
                stop_seconds=args.stop_seconds,
                seed=args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little"),
                log=lambda m: print(f"[chaos] {m}", file=sys.stderr, flush=True),
            )
        )
    print("\n".join(report.lines()))
    (run_dir / "chaos.json").write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    print(f"[chaos] logs and chaos.json in {run_dir}", file=sys.stderr)
    return 0 if report.passed() else 1


def _run_bench_routing(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from dataclasses import asdict

    from layerline.bench.routing import measure, table
    from layerline.model_store import ModelStoreError, resolve_model

    log_dir = Path(tempfile.mkdtemp(prefix="layerline-routing-"))
    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        checkpoint = resolve_model(args.model)
        figures = [
            measure(
                checkpoint,
                routing,
                port=args.port,
                log_dir=log_dir,
                per_prompt=args.per_prompt,
                concurrency=args.concurrency,
                log=lambda m: print(f"[routing] {m}", file=sys.stderr, flush=True),
            )
            for routing in ("load", "cache")
        ]
    print(table(figures), end="")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2) + "\n")
    return 0


def _run_bench_speculate(args: argparse.Namespace) -> int:
    import json
    import tempfile
    from dataclasses import asdict

    from layerline.bench.speculate import measure, table
    from layerline.model_store import ModelStoreError, resolve_model

    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        figures = measure(
            resolve_model(args.model),
            port=args.port,
            log_dir=Path(tempfile.mkdtemp(prefix="layerline-speculate-")),
            speculate=args.speculate,
            stages=args.stages,
            dtype=args.dtype,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
            log=lambda m: print(f"[speculate] {m}", file=sys.stderr, flush=True),
        )
    print(table(figures), end="")
    print(json.dumps(asdict(figures), indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(figures), indent=2) + "\n")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from layerline.bench.run import run_bench
    from layerline.model_store import ModelStoreError, resolve_model

    with reported_as_errors(ModelStoreError, RuntimeError, TimeoutError):
        result = run_bench(
            resolve_model(args.model),
            dtype=args.dtype,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
            port=args.port,
            json_path=args.json,
            tls=args.tls,
        )
    missed = [name for name, ok in result.within_budget.items() if not ok]
    if missed:
        print(f"[bench] outside budget: {', '.join(missed)}", file=sys.stderr)
    return 0


def add_bench_commands(commands: Subcommands) -> None:
    """`layerline bench [links]`."""
    bench = commands.add_parser(
        "bench",
        help="measure decode speed against transformers, as ratios, and print JSON",
        description="Measure, in one run on this machine: transformers' generate (single stream "
        "and batch 32) as the baseline, and local clusters of 1 and 2 stages and "
        "of 1 stage at tp 3: time "
        "to first token and decode tokens/s of one stream, and aggregate tokens/s at "
        "1, 8, 16 and 32 concurrent streams; the 2-stage cluster's single stream and 16 "
        "streams also through its OpenAI-compatible HTTP API (the openai client) beside the "
        "gRPC SDK. Measurements are interleaved in rounds, odd rounds in reverse order, and "
        "the medians kept; each budgeted ratio is also printed round by round. Beside the "
        "single streams, this process's memory read bandwidth, once a round: a lone token "
        "reads every weight once, so the weights' bytes over it is the floor under the "
        "single-stream figure. Then the "
        "same extra hop through a bare gRPC relay of the "
        "model's matmuls, as this machine's floor for that figure (its lone row on a ring: the "
        "last stage feeds the first, as a lone stream runs ahead; 2 stages against 1 the floor "
        "under a lone stream's), and the same relays at 32 "
        "rows a step, 2 stages against 1, as the floor under 32 streams on 2 stages against 1 "
        "(the relays take turns every few steps). Prints the figures, "
        "the ratios and whether each is within DESIGN.md's budget. Needs transformers "
        "and openai (the test extra).",
        formatter_class=HelpFormatter,
    )
    add_model_flags(bench)
    bench.add_argument("--new-tokens", type=int, default=64, metavar="N", help="tokens per stream (default: 64)")
    bench.add_argument(
        "--rounds",
        type=int,
        default=5,
        metavar="N",
        help="interleaved rounds; the median of each figure is kept (default: 5)",
    )
    bench.add_argument(
        "--port",
        type=int,
        default=7179,
        metavar="P",
        help="the clusters' coordinators use P+1 to P+3, the 2-stage cluster's HTTP API P+5, "
        "the bare relay P+10 to P+12 (default: 7179)",
    )
    bench.add_argument("--json", type=Path, metavar="FILE", help="also write the figures to FILE")
    bench.add_argument(
        "--tls",
        action="store_true",
        help="also a 2-stage cluster with TLS everywhere (port P+4), measured beside the plaintext one: "
        "single-stream decode with TLS against without (budget >= 0.95x)",
    )
    bench.set_defaults(handler=_run_bench)
    studies = bench.add_subparsers(dest="study", metavar="STUDY")
    links = studies.add_parser(
        "links",
        help="a 2-stage chain across two hosts at several link delays and rates (needs root)",
        description="Run a 2-stage chain across two test hosts (network namespaces joined by a bridge; "
        "needs root, ip and tc): host A the coordinator and layers 0:19, host B layers 19:30, the link "
        "shaped to each rate (tbf) and delayed by each one-way delay (a relay that holds each "
        "direction's bytes). Measures single-stream decode tokens/s, 8-stream aggregate tokens/s and "
        "the first token of a 512-token prompt, and the whole model on one host; writes links.md "
        "(a table), links.png (tokens/s against delay) and links.json to --out.",
        formatter_class=HelpFormatter,
    )
    add_model_flags(links)
    links.add_argument(
        "--delays",
        type=_numbers,
        default=[0, 1, 5, 20],
        metavar="MS,...",
        help="one-way delays, ms (default: 0,1,5,20)",
    )
    links.add_argument(
        "--rates", type=_numbers, default=[100, 1000], metavar="MBIT,...", help="link rates, Mbit/s (default: 100,1000)"
    )
    links.add_argument("--new-tokens", type=int, default=32, metavar="N", help="tokens per stream (default: 32)")
    links.add_argument("--rounds", type=int, default=3, metavar="N", help="medians of N rounds (default: 3)")
    links.add_argument(
        "--out",
        type=Path,
        default=Path("bench-links"),
        metavar="DIR",
        help="where the table and the plot go (default: bench-links)",
    )
    links.set_defaults(handler=_run_bench_links)
    _add_chaos(studies)
    _add_quantize(studies)
    routing = studies.add_parser(
        "routing",
        help="cache-aware routing against load-only: prefix-cache hit rate and median first token",
        description="Run two clusters of 2 replicas of 1 stage, one after the other, routing new "
        "sequences by load only (--routing load) and by cache (--routing cache), each serving the same "
        "requests: --per-prompt for each of 4 system prompts of about 300 tokens, shuffled, --concurrency "
        "at a time. Prints each one's prefix-cache hit rate (prompt tokens found in the chain's KV over "
        "those looked up) and median time to the first token.",
        formatter_class=HelpFormatter,
    )
    add_model_flags(routing)
    routing.add_argument("--port", type=int, default=7470, metavar="P", help="the coordinators' port (default: 7470)")
    routing.add_argument(
        "--per-prompt", type=_positive(int), default=12, metavar="N", help="requests per system prompt (default: 12)"
    )
    routing.add_argument(
        "--concurrency", type=_positive(int), default=4, metavar="N", help="requests at once (default: 4)"
    )
    routing.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures here")
    routing.set_defaults(handler=_run_bench_routing)
    _add_speculate(studies)


def _add_speculate(studies: Subcommands) -> None:
    spec = studies.add_parser(
        "speculate",
        help="speculative decoding by prompt lookup against plain decoding, on quoting and ordinary prompts",
        description="Start one cluster whose coordinator runs with --speculate K and send each prompt of two "
        "workloads, one request at a time, with speculate=0 and with K in turn (alternating which goes first): "
        "4 prompts whose answers quote and edit them (code with a name changed, a paragraph copied) and 4 "
        "ordinary ones. Prints, for each workload, the decode rate of both (tokens after the first over the time "
        "after the first token), their ratio (budgets: >= 1.8x quoting, >= 0.95x ordinary) and the share of "
        "drafted tokens accepted, as a table and as JSON; raises if speculation changed a greedy answer.",
        formatter_class=HelpFormatter,
    )
    add_model_flags(spec)
    spec.add_argument("--port", type=int, default=7570, metavar="P", help="the coordinator's port (default: 7570)")
    spec.add_argument(
        "--speculate", type=_positive(int), default=8, metavar="K", help="tokens drafted per step at most (default: 8)"
    )
    spec.add_argument("--stages", type=_positive(int), default=1, metavar="P", help="pipeline stages (default: 1)")
    spec.add_argument(
        "--new-tokens", type=_positive(int), default=64, metavar="N", help="tokens per request (default: 64)"
    )
    spec.add_argument(
        "--rounds", type=_positive(int), default=2, metavar="N", help="rounds of each prompt (default: 2)"
    )
    spec.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures here")
    spec.set_defaults(handler=_run_bench_speculate)


def _run_bench_quantize(args: argparse.Namespace) -> int:
    import json

    from layerline.bench.quantize import run_quantize_bench
    from layerline.model_store import ModelStoreError, resolve_model

    with reported_as_errors(ModelStoreError):
        checkpoint = resolve_model(args.model)
    result = run_quantize_bench(
        checkpoint,
        threads=args.threads,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        log=lambda m: print(f"[quantize] {m}", file=sys.stderr, flush=True),
    )
    text = json.dumps(result.to_dict(), indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


def _add_quantize(studies: Subcommands) -> None:
    quantize = studies.add_parser(
        "quantize",
        help="float32 against --quantize int8 and int4: weight bytes, decode speed, accuracy",
        description="Load the model as one stage three times (float32, int8, int4) in this process and "
        "measure, in interleaved rounds: the bytes of the weights each holds, decode tokens/s of one "
        "stream and of 32 streams (the model's forward with its KV cache, no gRPC), the share of "
        "positions where each one's argmax agrees with float32's greedy token (8 held prompts x 32 "
        "tokens, teacher-forced: all at once, and one token a step as a lone stream decodes) and the "
        "perplexity of a held paragraph. Prints JSON with the ratios "
        "to float32.",
        formatter_class=HelpFormatter,
    )
    quantize.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        metavar="M",
        help="checkpoint directory or known name (default: smollm2-135m-instruct)",
    )
    quantize.add_argument(
        "--threads", type=_positive(int), default=1, metavar="N", help="torch CPU threads (default: 1)"
    )
    quantize.add_argument(
        "--new-tokens", type=_positive(int), default=32, metavar="N", help="tokens per stream (default: 32)"
    )
    quantize.add_argument(
        "--rounds", type=_positive(int), default=3, metavar="N", help="medians of N rounds (default: 3)"
    )
    quantize.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the figures here")
    quantize.set_defaults(handler=_run_bench_quantize)


def _add_chaos(studies: Subcommands) -> None:
    chaos = studies.add_parser(
        "chaos",
        help="a 2x2 cluster under `up` keeps every request while its workers are killed and stopped",
        description="Start `layerline up --replicas 2 --stages 2`, run a fixed set of greedy and seeded "
        "requests once without faults for their reference tokens, then keep --streams of them running "
        "for --duration seconds while a driver SIGKILLs a random stage worker --kills times and "
        "SIGSTOPs one for --stop-seconds (one fault at a time, each once the cluster is whole again). "
        "Prints the requests completed, the tokens lost (must be 0: a token that differs from the "
        "reference, is missing or is extra), the longest gap a client saw, and the workers SERVING at "
        "the end; exits 1 unless every request came back exact and all 4 workers serve again.",
        formatter_class=HelpFormatter,
    )
    add_model_flags(chaos)
    chaos.add_argument("--port", type=int, default=7370, metavar="P", help="the coordinator's port (default: 7370)")
    chaos.add_argument(
        "--duration", type=_positive(float), default=60.0, metavar="S", help="seconds under faults (default: 60)"
    )
    chaos.add_argument(
        "--streams", type=_positive(int), default=24, metavar="N", help="requests in flight at once (default: 24)"
    )
    chaos.add_argument(
        "--new-tokens", type=_positive(int), default=32, metavar="N", help="tokens per request (default: 32)"
    )
    chaos.add_argument("--kills", type=int, default=3, metavar="N", help="SIGKILLs of a random stage (default: 3)")
    chaos.add_argument(
        "--stop-seconds",
        type=float,
        default=10.0,
        metavar="S",
        help="one stage SIGSTOPped this long (default: 10; 0: none)",
    )
    chaos.add_argument("--seed", type=int, default=None, metavar="N", help="the driver's choices (default: random)")
    chaos.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="up's logs and chaos.json (default: a temp folder)"
    )
    chaos.set_defaults(handler=_run_bench_chaos)
