"""`layerline up | run | generate | chat | status`: a local cluster and its clients."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from layerline.client import Client, LayerlineError
from layerline.client.retry import DEFAULT_RETRIES
from layerline.coordinator.settings import CoordinatorSettings
from layerline.launcher import SPLITS, ClusterPlan, LocalCluster
from layerline.shared.settings import DTYPES
from layerline.supervisor import CrashLoop, RestartPolicy

from .servers import add_quantize_flag
from .support import (
    CA_VARIABLE,
    TOKEN_VARIABLE,
    HelpFormatter,
    Subcommands,
    add_client_flags,
    add_telemetry_flags,
    client_credentials,
    http_port_flag,
    prefix_flags,
    reported_as_errors,
    speculate_flag,
    telemetry_settings,
)

DEFAULT_TARGET = f"127.0.0.1:{CoordinatorSettings.port}"  # where the client commands find a coordinator


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=CoordinatorSettings.model,
        metavar="M",
        help=f"checkpoint directory or known name (default: {CoordinatorSettings.model})",
    )
    p.add_argument(
        "--dtype",
        default=ClusterPlan.dtype,
        choices=DTYPES,
        help=f"dtype of weights and activations (default: {ClusterPlan.dtype})",
    )


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_quantize_flag(p)
    http_port_flag(p)
    speculate_flag(p)
    prefix_flags(p, cache_default=CoordinatorSettings.prefix_cache)
    plan = ClusterPlan
    p.add_argument(
        "--stages",
        type=int,
        default=plan.stages,
        metavar="P",
        help=f"pipeline stages per chain (default: {plan.stages})",
    )
    p.add_argument(
        "--split",
        default=plan.split,
        choices=SPLITS,
        help="where the stages' layers are cut: 'measured' times a decode step's layer and LM head on "
        "this machine first (a few seconds) and gives every stage equal work; 'weights' weighs the head "
        f"by the bytes of its weight (default: {plan.split})",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=plan.replicas,
        metavar="R",
        help=f"chains side by side (default: {plan.replicas})",
    )
    p.add_argument(
        "--tp", type=int, default=plan.tp, metavar="T", help=f"tensor-parallel ranks per stage (default: {plan.tp})"
    )
    p.add_argument(
        "--depth",
        type=int,
        default=plan.depth,
        metavar="N",
        help="micro-batches in flight per chain: 1 computes each step on all the cores its chain's stages "
        "share on this machine, which measured faster than one micro-batch per stage at every load; more "
        f"pipelines them, which pays where stages have cores of their own (default: {plan.depth})",
    )
    p.add_argument("--port", type=int, default=plan.port, metavar="P", help=f"coordinator port (default: {plan.port})")
    p.add_argument(
        "--kv-memory",
        default=plan.kv_memory,
        metavar="SIZE",
        help=f"KV pool per stage worker (default: {plan.kv_memory})",
    )
    p.add_argument(
        "--cluster-port",
        type=int,
        metavar="P",
        help="the coordinator's port for its stage workers (the Registry) (default: --port + 1)",
    )
    add_telemetry_flags(
        p,
        metrics_port_help="serve Prometheus metrics from every process: the coordinator "
        "on port P, the stage workers on P+1, P+2, ... (printed at start) "
        "(default: 0, no metrics)",
    )
    security = p.add_argument_group("security")
    security.add_argument(
        "--tls",
        action="store_true",
        help="TLS everywhere: a throwaway CA and a certificate per role in the run directory; the members "
        "talk mutual TLS, clients connect with --ca-cert RUN_DIR/tls/ca.crt (printed at start)",
    )
    security.add_argument(
        "--api-tokens", metavar="FILE", help="bearer tokens clients must send, one per line (default: none needed)"
    )
    security.add_argument(
        "--admin-tokens",
        metavar="FILE",
        help="tokens that may also call ClusterStatus (default: with --api-tokens, one made in the run directory)",
    )


def _coordinator_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The coordinator's own flags among `up`'s and `run`'s."""
    sharing = ("--no-prefix-sharing",) if args.no_prefix_sharing else ()
    return ("--speculate", str(args.speculate), "--prefix-cache", str(args.prefix_cache), *sharing)


def _start_cluster(args: argparse.Namespace, *, restarts: RestartPolicy = ClusterPlan.restarts) -> LocalCluster:
    from layerline.model_store import ModelStoreError, resolve_model

    telemetry_settings(args, host="127.0.0.1")  # a bad flag fails here, before any process starts
    with reported_as_errors(ModelStoreError, ValueError, RuntimeError, subprocess.TimeoutExpired):
        checkpoint = resolve_model(args.model)
        plan = ClusterPlan(
            model=str(checkpoint),
            stages=args.stages,
            replicas=args.replicas,
            tp=args.tp,
            dtype=args.dtype,
            quantize=args.quantize,
            port=args.port,
            kv_memory=args.kv_memory,
            trace=args.trace,
            otlp_endpoint=args.otlp_endpoint,
            metrics_port=args.metrics_port,
            cluster_port=args.cluster_port or (args.port + 1 if args.port else None),
            tls=args.tls,
            api_tokens=args.api_tokens,
            admin_tokens=args.admin_tokens,
            restarts=restarts,
            http_port=args.http_port,
            split=args.split,
            depth=args.depth,
            coordinator_args=_coordinator_args(args),
        )
        cluster = LocalCluster(plan, checkpoint)  # checks (and with --split measured, measures) the split first
    print(
        f"starting {args.replicas} x {args.stages} stage workers of {args.tp} rank(s) and a coordinator "
        f"(logs in {cluster.log_dir}) ...",
        file=sys.stderr,
        flush=True,
    )
    if cluster.split_note:
        print(f"  layers {', '.join(f'{a}:{b}' for a, b in cluster.ranges)}: {cluster.split_note}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _interrupted)  # while starting, SIGTERM stops what started, as Ctrl-C does
    try:
        cluster.start()
        with reported_as_errors(RuntimeError, TimeoutError):
            status = cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    for chain in status.chains:
        print(f"  chain {chain.replica}: {' -> '.join(chain.addresses)}", file=sys.stderr)
    for name, port in cluster.metrics_ports.items():
        print(f"  metrics of {name}: http://{cluster.plan.host}:{port}/metrics", file=sys.stderr)
    if args.trace != "off":
        where = (
            "each process's log"
            if args.trace == "console"
            else args.otlp_endpoint or "the OTEL_EXPORTER_OTLP_* endpoint"
        )
        print(f"  traces: {args.trace}, to {where}", file=sys.stderr)
    print(f"  stage workers register at {cluster.cluster_address}", file=sys.stderr)
    if cluster.http_url is not None:
        print(f"  OpenAI-compatible HTTP API: {cluster.http_url}", file=sys.stderr)
    if cluster.ca_cert is not None:
        print(f"  TLS: clients trust {cluster.ca_cert} (export {CA_VARIABLE}={cluster.ca_cert})", file=sys.stderr)
    if cluster.admin_tokens is not None:
        print(
            f"  tokens: clients send one (--token or ${TOKEN_VARIABLE}); admin tokens in {cluster.admin_tokens}",
            file=sys.stderr,
        )
    return cluster


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_up(args: argparse.Namespace) -> int:
    with reported_as_errors(ValueError):
        restarts = RestartPolicy(max_restarts=args.max_restarts)
    cluster = _start_cluster(args, restarts=restarts)
    print(f"layerline ready on {cluster.address} (Ctrl-C stops every process)", flush=True)
    try:
        with reported_as_errors(CrashLoop):
            cluster.supervise()
    finally:
        print("stopping ...", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def _client(args: argparse.Namespace) -> Client:
    """The client the flags describe (`--target`, `--token`, `--ca-cert`, or their variables)."""
    token, ca_cert = client_credentials(args)
    with reported_as_errors(ValueError):
        return Client(args.target, token=token, ca_cert=ca_cert)


def _stream_answer(client: Client, args: argparse.Namespace, prompt: str, *, chat: bool = False) -> int:
    """Stream the answer to `prompt` (a chat message when `chat`) to stdout; usage to stderr at the end."""
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "retries": args.retries,
    }
    with client, reported_as_errors(LayerlineError, ValueError):  # ValueError: a flag the SDK refuses
        if chat:
            chunks = client.chat_stream([{"role": "user", "content": prompt}], **params)
        else:
            chunks = client.stream(prompt, **params)
        for chunk in chunks:
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason and chunk.usage is not None:
                print(
                    f"\n[{chunk.finish_reason}: {chunk.usage.prompt_tokens} prompt + "
                    f"{chunk.usage.completion_tokens} completion tokens]",
                    file=sys.stderr,
                )
    print()
    return 0


def _request_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    p.add_argument("--seed", type=int, metavar="S", help="makes sampling reproducible")
    p.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        metavar="N",
        help="times a request is sent again when the coordinator is unavailable or full before the first "
        f"token; never after it (default: {DEFAULT_RETRIES})",
    )


def _run_run(args: argparse.Namespace) -> int:
    cluster = _start_cluster(args)
    try:
        return _stream_answer(cluster.client(), args, args.prompt, chat=args.chat)
    finally:
        cluster.stop()


def _run_generate(args: argparse.Namespace) -> int:
    return _stream_answer(_client(args), args, args.prompt)


def _run_chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = []
    with _client(args) as client, reported_as_errors(LayerlineError, ValueError):
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = ""
            for chunk in client.chat_stream(
                history, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, retries=args.retries
            ):
                print(chunk.text, end="", flush=True)
                reply += chunk.text
            print()
            history.append({"role": "assistant", "content": reply})


def _run_status(args: argparse.Namespace) -> int:
    with _client(args) as client, reported_as_errors(LayerlineError):
        status = client.cluster()
    print(
        f"{len(status.chains)} chain(s), {status.active_requests} active, {status.queued_requests} queued, "
        f"{status.failovers} failover(s) (gap last {status.last_failover_gap_seconds:.2f}s, "
        f"max {status.max_failover_gap_seconds:.2f}s), {status.shared_prefix_tokens} prompt token(s) "
        f"copied from another sequence's KV (of {status.prefix_cache_queries} looked up), "
        f"{status.preemptions} preemption(s), {status.stalls} stalled chain(s), "
        f"{status.spec_decode_accepted_tokens} of {status.spec_decode_draft_tokens} drafted token(s) accepted"
    )
    for chain in status.chains:
        print(
            f"  chain {chain.replica}: {' -> '.join(chain.addresses)} ({chain.active_sequences} sequences; "
            f"{chain.cached_prefixes} finished kept as a prefix cache, {chain.cached_prefix_tokens} tokens)"
        )
    print(
        f"{'address':22} {'layers':>9} {'replica':>7} {'tp':>3} {'state':12} {'pid':>7} {'kv free':>13} "
        f"{'cached':>7} {'steps':>8} {'ms/step':>8} {'ahead':>13}"
    )
    for w in status.workers:
        layers = f"{w.layers[0]}:{w.layers[1]}"
        replica = "-" if w.replica is None else str(w.replica)
        kv = f"{w.load.kv_blocks_free}/{w.load.kv_blocks_total}"
        per_step = f"{1000 * w.load.compute_seconds / w.load.steps_computed:.1f}" if w.load.steps_computed else "-"
        guessed = w.load.steps_run_ahead + w.load.steps_run_ahead_dropped
        ahead = f"{w.load.steps_run_ahead}/{guessed}" if w.layers[0] == 0 else "-"
        print(
            f"{w.address:22} {layers:>9} {replica:>7} {w.tp:>3} {w.state:12} {w.pid:>7} {kv:>13} "
            f"{w.load.kv_blocks_cached:>7} {w.load.steps_computed:>8} {per_step:>8} {ahead:>13}"
        )
    return 0


def add_cluster_commands(commands: Subcommands) -> None:
    """`layerline up | run | generate | chat | status`."""
    restarts = ClusterPlan.restarts
    up = commands.add_parser(
        "up",
        help="start a whole cluster on this machine",
        description="Start a coordinator and stages x replicas stage workers, each its own OS "
        "process, layers split into ranges of about equal work (the last stage, which also "
        "runs the LM head, takes fewer); print the address when every chain is ready. Then "
        "supervise: a process that exits is started again with the same layers and ports, after "
        f"{restarts.first_delay:g}s, doubling with each quick exit up to {restarts.max_delay:g}s "
        f"(back to {restarts.first_delay:g}s once it ran {restarts.stable_after:g}s), each exit and "
        "restart said on stderr and in the process's log. Meanwhile the coordinator moves the "
        "sequences to the other chains; a restarted stage worker serves again once its readiness "
        "probe passes, and a restarted coordinator gets every stage worker back as they register "
        "again. Stop every process on Ctrl-C or SIGTERM, or when one exits more often than "
        "--max-restarts allows (then exit non-zero, naming it, its last exit status and the end "
        "of its log).",
        formatter_class=HelpFormatter,
    )
    _cluster_flags(up)
    up.add_argument(
        "--max-restarts",
        type=int,
        default=restarts.max_restarts,
        metavar="N",
        help=f"restart a process at most N times within {restarts.window:g}s; one more exit stops the "
        f"cluster (0: the first exit stops it) (default: {restarts.max_restarts})",
    )
    up.set_defaults(handler=_run_up)
    run = commands.add_parser(
        "run",
        help="start a cluster, stream one answer, stop",
        description="Like `up`, then stream the answer to PROMPT and stop every process.",
        formatter_class=HelpFormatter,
    )
    _cluster_flags(run)
    _request_flags(run)
    run.add_argument("--chat", action="store_true", help="send PROMPT as a chat message (chat template)")
    run.add_argument("prompt", metavar="PROMPT")
    run.set_defaults(handler=_run_run)
    gen = commands.add_parser("generate", help="stream a completion from a running cluster")
    add_client_flags(gen, default_target=DEFAULT_TARGET)
    _request_flags(gen)
    gen.add_argument("prompt", metavar="PROMPT")
    gen.set_defaults(handler=_run_generate)
    chat = commands.add_parser("chat", help="chat with a running cluster (Ctrl-D ends)")
    add_client_flags(chat, default_target=DEFAULT_TARGET)
    _request_flags(chat)
    chat.set_defaults(handler=_run_chat)
    status = commands.add_parser("status", help="show the workers and chains of a running cluster")
    add_client_flags(status, default_target=DEFAULT_TARGET)
    status.set_defaults(handler=_run_status)
