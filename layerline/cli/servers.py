"""`layerline stage` and `layerline coordinator`: the two long-running server processes."""

from __future__ import annotations

import argparse
import os

from .support import (
    HelpFormatter,
    Subcommands,
    add_telemetry_flags,
    configure_logging,
    reported_as_errors,
    telemetry_settings,
)

# --- layerline stage ... -------------------------------------------------------------------


def _run_stage(args: argparse.Namespace) -> int:
    # torch's allocator then asks for transparent huge pages for its large blocks (the weights, the
    # KV pool): fewer TLB misses while a decode step streams every weight. Read once, at torch's
    # first allocation, so set before torch is imported; an explicit THP_MEM_ALLOC_ENABLE wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from layerline.shared.rpc import parse_size

    configure_logging()
    with reported_as_errors(ValueError):
        kv_memory = parse_size(args.kv_memory)
        max_message = parse_size(args.max_message_size)
    from layerline.model_store import ModelStoreError
    from layerline.shared.model_config import ConfigError
    from layerline.stage_worker.server import StageSettings, run_stage
    from layerline.stage_worker.weights import CheckpointError

    settings = StageSettings(
        model=args.model,
        layers=args.layers,
        host=args.host,
        port=args.port,
        advertise=args.advertise,
        coordinator=args.coordinator,
        dtype=args.dtype,
        device=args.device,
        kv_memory_bytes=kv_memory,
        kv_block_size=args.kv_block_size,
        weight_layout=args.weight_layout,
        max_message_bytes=max_message,
        threads=args.threads,
        prefill_threads=args.prefill_threads,
        tp=args.tp,
        tp_timeout=args.tp_timeout,
        tp_rank=args.tp_rank,
        tp_master=args.tp_master,
        stage_args=_follower_args(args),
        telemetry=telemetry_settings(args, host=args.host),
    )
    with reported_as_errors(ConfigError, CheckpointError, ModelStoreError, ValueError, OSError):
        return run_stage(settings)


def _follower_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The arguments rank 0 starts its other tensor-parallel ranks with."""
    out = [
        "--model",
        args.model,
        "--layers",
        args.layers,
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--kv-memory",
        args.kv_memory,
        "--kv-block-size",
        str(args.kv_block_size),
        "--tp",
        str(args.tp),
        "--weight-layout",
        args.weight_layout,
        "--tp-timeout",
        str(args.tp_timeout),
    ]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.prefill_threads:
        out += ["--prefill-threads", str(args.prefill_threads)]
    return tuple(out)


def add_stage_commands(commands: Subcommands) -> None:
    """`layerline stage`: one stage worker process."""
    stage = commands.add_parser(
        "stage",
        help="serve a layer range of a model as a stage worker",
        description="Serve the half-open layer range [START, END) of a model over gRPC: the "
        "StageWorker service (long-lived Step streams, Release, Info) and the "
        "standard grpc.health.v1 service, SERVING once the weights are loaded and a "
        "one-token forward has run. The stage with START 0 holds the embedding; the "
        "one with END = the number of layers holds the final norm, LM head and "
        "sampler. SIGTERM stops it cleanly.",
        formatter_class=HelpFormatter,
    )
    stage.add_argument(
        "--model", required=True, metavar="M", help="checkpoint directory, or a known model name (fetched on first use)"
    )
    stage.add_argument("--layers", required=True, metavar="START:END", help="half-open layer range, e.g. 0:15")
    stage.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    stage.add_argument(
        "--port", type=int, default=0, metavar="P", help="port to listen on (default: 0, a free port, logged at start)"
    )
    stage.add_argument(
        "--advertise", metavar="HOST:PORT", help="address peers reach this stage at (default: HOST:PORT)"
    )
    stage.add_argument("--coordinator", metavar="ADDR", help="coordinator to register with")
    stage.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="dtype of weights and activations (default: float32)",
    )
    stage.add_argument("--device", default="cpu", metavar="D", help="torch device (default: cpu)")
    stage.add_argument(
        "--kv-memory", default="256M", metavar="SIZE", help="memory preallocated for the paged KV cache (default: 256M)"
    )
    stage.add_argument("--kv-block-size", type=int, default=16, metavar="N", help="tokens per KV block (default: 16)")
    stage.add_argument(
        "--weight-layout",
        default="both",
        choices=("both", "packed", "plain"),
        help="float32 on CPU: keep the linear weights both plain (fastest for one row, "
        "a lone stream's token) and packed for oneDNN (1.5-2.5x faster for several "
        "rows), at twice their memory; or only 'packed' (one copy, single rows "
        "5-15%% slower); or only 'plain' (default: both)",
    )
    stage.add_argument(
        "--max-message-size",
        default="64M",
        metavar="SIZE",
        help="gRPC message limit; larger hidden states travel in chunks (default: 64M)",
    )
    stage.add_argument("--threads", type=int, metavar="N", help="torch CPU threads per rank (default: all cores)")
    stage.add_argument(
        "--prefill-threads",
        type=int,
        metavar="N",
        help="torch CPU threads for a step of 64 tokens or more (a prompt's chunk) sent "
        "while no other step of its chain was in flight: the chain's other stages "
        "wait meanwhile, so `layerline up` gives it the cores of a whole chain "
        "(default: --threads)",
    )
    stage.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel ranks on this node, one process each; NCCL on CUDA, gloo on CPU (default: 1)",
    )
    stage.add_argument(
        "--tp-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="a rank that dies or hangs fails the whole stage within about S seconds (default: 10)",
    )
    add_telemetry_flags(
        stage,
        metrics_port_help="serve Prometheus metrics (step time, hop bytes and transfer "
        "time, KV blocks, pipeline bubble) at http://HOST:P/metrics "
        "(default: 0, no metrics)",
    )
    stage.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    stage.add_argument("--tp-master", help=argparse.SUPPRESS)
    stage.set_defaults(handler=_run_stage)


# --- layerline coordinator ----------------------------------------------------------------


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction from 0 up to (not including) 1")
    return value


def _run_coordinator(args: argparse.Namespace) -> int:
    configure_logging()
    from layerline.coordinator.server import CoordinatorSettings, run_coordinator
    from layerline.model_store import ModelStoreError

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
        depth=args.depth,
        telemetry=telemetry_settings(args, host=args.host),
    )
    with reported_as_errors(ModelStoreError, ValueError, OSError):
        return run_coordinator(settings)


def add_coordinator_commands(commands: Subcommands) -> None:
    """`layerline coordinator`: the process clients talk to."""
    from layerline.model_store import DEFAULT_MODEL

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
        default=DEFAULT_MODEL,
        metavar="M",
        help=f"checkpoint directory or known name, for the tokenizer (default: {DEFAULT_MODEL})",
    )
    c.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    c.add_argument("--port", type=int, default=7070, metavar="P", help="port to listen on (default: 7070)")
    c.add_argument(
        "--default-max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="max_tokens when a request does not say (default: 256)",
    )
    c.add_argument(
        "--max-active", type=int, default=256, metavar="N", help="sequences generating at once (default: 256)"
    )
    c.add_argument(
        "--max-queued",
        type=int,
        default=512,
        metavar="N",
        help="requests waiting for a slot before RESOURCE_EXHAUSTED (default: 512)",
    )
    c.add_argument(
        "--rate-limit", type=float, default=1000.0, metavar="R", help="new requests admitted per second (default: 1000)"
    )
    c.add_argument(
        "--token-budget",
        type=int,
        default=512,
        metavar="N",
        help="tokens per micro-batch step; longer prompts are prefilled in chunks (default: 512)",
    )
    c.add_argument(
        "--no-prefix-sharing",
        action="store_true",
        help="compute every prompt in full; by default a new sequence whose first tokens "
        "(4 or more) match those of a live or cached sequence on its chain copies "
        "their KV instead",
    )
    c.add_argument(
        "--prefix-cache",
        type=_fraction,
        default=0.25,
        metavar="F",
        help="share of each chain's KV memory (that of its smallest stage) in which requests "
        "that ended keep their KV, least recently used out first, for later prompts "
        "that start the same way: a system prompt, the turns of a chat; 0 frees every "
        "request's KV when it ends (default: 0.25)",
    )
    c.add_argument(
        "--depth", type=int, metavar="N", help="micro-batches in flight per chain (default: the chain's length)"
    )
    add_telemetry_flags(
        c,
        metrics_port_help="serve Prometheus metrics (latency histograms, requests running "
        "and waiting, failovers) at http://HOST:P/metrics (default: 0, "
        "no metrics)",
    )
    c.set_defaults(handler=_run_coordinator)
