"""`layerline coordinator`: the long-running process that tokenizes, schedules and routes."""

from __future__ import annotations

import argparse

from layerline.coordinator.settings import CoordinatorSettings
from layerline.shared.settings import format_size, parse_size

from .support import (
    HelpFormatter,
    Subcommands,
    add_telemetry_flags,
    add_tls_flags,
    configure_logging,
    health_port_flag,
    http_port_flag,
    prefix_flags,
    reported_as_errors,
    speculate_flag,
    telemetry_settings,
    tls_settings,
)


def _run_coordinator(args: argparse.Namespace) -> int:
    configure_logging()
    with reported_as_errors(ValueError):
        settings = CoordinatorSettings(
            model=args.model,
            host=args.host,
            port=args.port,
            default_max_tokens=args.default_max_tokens,
            max_active=args.max_active,
            max_queued=args.max_queued,
            rate_limit=args.rate_limit,
            token_budget=args.token_budget,
            share_prefixes=not args.no_prefix_sharing,
            prefix_cache=args.prefix_cache,
            routing=args.routing,
            speculate=args.speculate,
            depth=args.depth,
            probe_interval=args.probe_interval,
            max_prompt_bytes=parse_size(args.max_prompt_bytes),
            max_prompt_tokens=args.max_prompt_tokens,
            max_chat_messages=args.max_chat_messages,
            telemetry=telemetry_settings(args, host=args.host),
            cluster_port=args.cluster_port,
            tls=tls_settings(args),
            api_tokens=args.api_tokens,
            admin_tokens=args.admin_tokens,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            health_port=args.health_port,
            http_port=args.http_port,
        )
    from layerline.coordinator.server import run_coordinator
    from layerline.model_store import ModelStoreError

    with reported_as_errors(ModelStoreError, ValueError, OSError):
        return run_coordinator(settings)


def add_coordinator_commands(commands: Subcommands) -> None:
    """`layerline coordinator`: the process clients talk to."""
    C = CoordinatorSettings
    c = commands.add_parser(
        "coordinator",
        help="run the coordinator that clients call and stage workers join",
        description="Run the coordinator: tokenizes requests, builds chains of registered stage "
        "workers that cover every layer, schedules micro-batches over them and "
        "streams text back. Serves layerline.v1.Coordinator, layerline.v1.Registry "
        "and grpc.health.v1. SIGTERM stops admitting and finishes in-flight requests.",
        formatter_class=HelpFormatter,
    )
    c.add_argument(
        "--model",
        default=C.model,
        metavar="M",
        help=f"checkpoint directory or known name, for the tokenizer (default: {C.model})",
    )
    c.add_argument("--host", default=C.host, help=f"interface to listen on (default: {C.host})")
    c.add_argument("--port", type=int, default=C.port, metavar="P", help=f"port to listen on (default: {C.port})")
    c.add_argument(
        "--default-max-tokens",
        type=int,
        default=C.default_max_tokens,
        metavar="N",
        help=f"max_tokens when a request does not say (default: {C.default_max_tokens})",
    )
    c.add_argument(
        "--max-active",
        type=int,
        default=C.max_active,
        metavar="N",
        help=f"sequences generating at once (default: {C.max_active})",
    )
    c.add_argument(
        "--max-queued",
        type=int,
        default=C.max_queued,
        metavar="N",
        help=f"requests waiting for a slot before RESOURCE_EXHAUSTED (default: {C.max_queued})",
    )
    c.add_argument(
        "--rate-limit",
        type=float,
        default=C.rate_limit,
        metavar="R",
        help=f"new requests admitted per second (default: {C.rate_limit:g})",
    )
    c.add_argument(
        "--token-budget",
        type=int,
        default=C.token_budget,
        metavar="N",
        help=f"tokens per micro-batch step; longer prompts are prefilled in chunks (default: {C.token_budget})",
    )
    prefix_flags(c, cache_default=C.prefix_cache)
    c.add_argument(
        "--depth", type=int, metavar="N", help="micro-batches in flight per chain (default: the chain's length)"
    )
    c.add_argument(
        "--probe-interval",
        type=float,
        default=C.probe_interval,
        metavar="S",
        help="seconds between readiness probes of each worker, a real one-token forward through its layers: "
        "a worker joins routing once one passes and leaves it when one fails (default: %(default)g)",
    )
    max_prompt = format_size(C.max_prompt_bytes)
    c.add_argument(
        "--max-prompt-bytes",
        default=max_prompt,
        metavar="SIZE",
        help="UTF-8 bytes of a prompt, of a chat's contents together and of its rendering; checked before "
        f"anything else is done with it, past it INVALID_ARGUMENT (default: {max_prompt})",
    )
    c.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="tokens of a prompt or a rendered chat, past it INVALID_ARGUMENT (default: the model's context length)",
    )
    c.add_argument(
        "--max-chat-messages",
        type=int,
        default=C.max_chat_messages,
        metavar="N",
        help=f"messages of one chat, past it INVALID_ARGUMENT (default: {C.max_chat_messages})",
    )
    add_telemetry_flags(
        c,
        metrics_port_help="serve Prometheus metrics (latency histograms, requests running "
        "and waiting, failovers) at http://HOST:P/metrics (default: 0, "
        "no metrics)",
    )
    c.add_argument(
        "--cluster-port",
        type=int,
        default=C.cluster_port,
        metavar="P",
        help=f"the Registry's port, where stage workers register, apart from clients' (default: {C.cluster_port})",
    )
    c.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=C.max_concurrent_rpcs,
        metavar="N",
        help=f"calls served at once on each port; past it new calls are refused (default: {C.max_concurrent_rpcs})",
    )
    c.add_argument(
        "--routing",
        choices=("cache", "load"),
        default=C.routing,
        help="where a new sequence goes when there are several chains: cache, to the chain whose live or "
        "cached sequences hold the longest prefix of its prompt unless that chain runs 8 more sequences "
        "than the least loaded one; load, always to the least loaded (default: %(default)s)",
    )
    speculate_flag(c, default=C.speculate)
    health_port_flag(c)
    http_port_flag(c)
    add_tls_flags(c, who="the Registry (the cluster port)")
    tokens = c.add_argument_group(
        "clients",
        "With --tls-cert and --tls-key the client port serves TLS too (clients trust --tls-ca, or the CA that "
        "signed the certificate). With tokens, every call but health needs `authorization: Bearer TOKEN`.",
    )
    tokens.add_argument(
        "--api-tokens",
        metavar="FILE",
        help="bearer tokens clients must send, one per line (# comments); also $LAYERLINE_API_TOKENS, "
        "comma-separated (default: none needed)",
    )
    tokens.add_argument("--admin-tokens", metavar="FILE", help="tokens that may also call ClusterStatus")
    c.set_defaults(handler=_run_coordinator)
