"""`layerline stage`: the long-running stage worker process (`layerline coordinator` is in coordinator_server)."""

from __future__ import annotations

import argparse
import os

from layerline.shared.settings import DTYPES, format_size, parse_size
from layerline.stage_worker.settings import QUANTIZE, WEIGHT_LAYOUTS, StageSettings, openmp_defaults

from .support import (
    HelpFormatter,
    Subcommands,
    add_telemetry_flags,
    add_tls_flags,
    configure_logging,
    health_port_flag,
    reported_as_errors,
    telemetry_settings,
    tls_settings,
)

# --- layerline stage ... -------------------------------------------------------------------


def _run_stage(args: argparse.Namespace) -> int:
    # torch's allocator then asks for transparent huge pages for its large blocks (the weights, the
    # KV pool): fewer TLB misses while a decode step streams every weight. Read once, at torch's
    # first allocation, so set before torch is imported; an explicit THP_MEM_ALLOC_ENABLE wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    openmp_defaults(os.environ)
    configure_logging()
    with reported_as_errors(ValueError):
        settings = StageSettings(
            model=args.model,
            layers=args.layers,
            host=args.host,
            port=args.port,
            advertise=args.advertise,
            coordinator=args.coordinator,
            dtype=args.dtype,
            device=args.device,
            kv_memory_bytes=parse_size(args.kv_memory),
            kv_block_size=args.kv_block_size,
            weight_layout=args.weight_layout,
            quantize=args.quantize,
            max_message_bytes=parse_size(args.max_message_size),
            threads=args.threads,
            prefill_threads=args.prefill_threads,
            tp=args.tp,
            tp_timeout=args.tp_timeout,
            telemetry=telemetry_settings(args, host=args.host),
            tls=tls_settings(args),
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            health_port=args.health_port,
            orphan_ttl=args.orphan_ttl,
        )
    from layerline.model_store import ModelStoreError
    from layerline.shared.model_config import ConfigError
    from layerline.stage_worker.server import run_stage
    from layerline.stage_worker.weights import CheckpointError

    with reported_as_errors(ConfigError, CheckpointError, ModelStoreError, ValueError, OSError):
        return run_stage(settings)


def add_quantize_flag(p: argparse.ArgumentParser) -> None:
    """`--quantize`, the same for `layerline stage` and for the stage workers of `up` and `run`."""
    p.add_argument(
        "--quantize",
        default=StageSettings.quantize,
        choices=QUANTIZE,
        help="store the weights quantized at load: the linear layers 'int8' (one scale per output "
        "channel) or 'int4' (a scale and offset per 32 inputs), the LM head and token embedding int8 "
        "under both; about 1/4 or 1/5 of float32's bytes. The norms stay in --dtype, and "
        "--weight-layout has no effect. Activations enter torch's kernels in bfloat16; on CPU a "
        "float32 model's few rows (a lone stream's token, small decode batches) go through layerline's "
        "compiled int8 kernel (AVX2 or AVX-512) or int4 kernel (AVX-512) in float32 where it builds. "
        "One row runs faster, many rows slower than float32 "
        "(README: Quantized weights) "
        f"(default: {StageSettings.quantize})",
    )


def add_stage_commands(commands: Subcommands) -> None:
    """`layerline stage`: one stage worker process."""
    S = StageSettings
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
    stage.add_argument("--host", default=S.host, help=f"interface to listen on (default: {S.host})")
    stage.add_argument(
        "--port",
        type=int,
        default=S.port,
        metavar="P",
        help=f"port to listen on (default: {S.port}, a free port, logged at start)",
    )
    stage.add_argument(
        "--advertise", metavar="HOST:PORT", help="address peers reach this stage at (default: HOST:PORT)"
    )
    stage.add_argument("--coordinator", metavar="ADDR", help="coordinator to register with")
    stage.add_argument(
        "--dtype", default=S.dtype, choices=DTYPES, help=f"dtype of weights and activations (default: {S.dtype})"
    )
    stage.add_argument("--device", default=S.device, metavar="D", help=f"torch device (default: {S.device})")
    kv_memory = format_size(S.kv_memory_bytes)
    stage.add_argument(
        "--kv-memory",
        default=kv_memory,
        metavar="SIZE",
        help=f"memory preallocated for the paged KV cache (default: {kv_memory})",
    )
    stage.add_argument(
        "--kv-block-size",
        type=int,
        default=S.kv_block_size,
        metavar="N",
        help=f"tokens per KV block (default: {S.kv_block_size})",
    )
    stage.add_argument(
        "--weight-layout",
        default=S.weight_layout,
        choices=WEIGHT_LAYOUTS,
        help="float32 on CPU: keep the linear weights both plain (fastest for one row, "
        "a lone stream's token) and packed for oneDNN (1.5-2.5x faster for several "
        "rows), at twice their memory; or only 'packed' (one copy, single rows "
        f"5-15%% slower); or only 'plain'. bfloat16 on CPU: 'both' also keeps the [out, in] weights "
        "beside the packed ones where the compiled bfloat16 row kernel serves (AVX512_BF16, a CPU "
        "not Intel's, one rank: a lone stream about 10%% faster, twice the weights' memory); 'packed' "
        "keeps one copy. Where layerline's FMA block kernel serves (a C compiler, AVX-512, an Intel "
        "CPU without AMX: float32 and bfloat16) 'both' and 'packed' keep one copy in its blocks, "
        "faster than either from 1 to 128 rows (a long float32 prompt about 8%% slower) "
        f"(default: {S.weight_layout})",
    )
    add_quantize_flag(stage)
    max_message = format_size(S.max_message_bytes)
    stage.add_argument(
        "--max-message-size",
        default=max_message,
        metavar="SIZE",
        help=f"gRPC message limit; larger hidden states travel in chunks (default: {max_message})",
    )
    stage.add_argument("--threads", type=int, metavar="N", help="torch CPU threads per rank (default: all cores)")
    stage.add_argument(
        "--prefill-threads",
        type=int,
        metavar="N",
        help="torch CPU threads for a step sent while no other step of its chain was in flight "
        "(a lone stream's token, or a prompt's chunk): the chain's other stages wait meanwhile, "
        "so `layerline up` gives it the cores of a whole chain (default: --threads)",
    )
    stage.add_argument(
        "--tp",
        type=int,
        default=S.tp,
        metavar="T",
        help=f"tensor-parallel ranks on this node, one process each; NCCL on CUDA, gloo on CPU (default: {S.tp})",
    )
    stage.add_argument(
        "--tp-timeout",
        type=float,
        default=S.tp_timeout,
        metavar="S",
        help=f"a rank that dies or hangs fails the whole stage within about S seconds (default: {S.tp_timeout:g})",
    )
    stage.add_argument(
        "--orphan-ttl",
        type=float,
        default=S.orphan_ttl,
        metavar="S",
        help="free the KV of a sequence that no step has touched (as a sequence of the step, or as the "
        "lender of a copied prefix) for S seconds: what a coordinator that crashed left here. A live "
        "coordinator steps each sequence it generates for every few seconds at most; the default leaves a "
        "wide margin and still gives the memory back within minutes. S is reported to the coordinator: its "
        "cached prefixes that no request copied for S seconds are gone here. Checked every min(S/4, 5) "
        "seconds. 0: never; such KV is then freed only when this stage registers with a coordinator that "
        f"did not know it (default: {S.orphan_ttl:g})",
    )
    add_telemetry_flags(
        stage,
        metrics_port_help="serve Prometheus metrics (step time, hop bytes and transfer "
        "time, KV blocks, pipeline bubble) at http://HOST:P/metrics "
        "(default: 0, no metrics)",
    )
    stage.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=S.max_concurrent_rpcs,
        metavar="N",
        help=f"calls served at once; past it new calls are refused (default: {S.max_concurrent_rpcs})",
    )
    health_port_flag(stage)
    add_tls_flags(stage, who="this stage")
    stage.set_defaults(handler=_run_stage)
