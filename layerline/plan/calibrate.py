"""`layerline plan --calibrate`: measure this machine for the planner and save its profile.

Owns the measurements, each a median of repeats, and nothing about how they are used:
- memory bandwidth: one thread summing a tensor far larger than the caches;
- matmul rates per dtype (float32, and bfloat16 where the CPU has its instructions) at the row
  counts of a decode step up to a prompt chunk, on one thread and on every core, on the layers of
  two random models larger than the caches: one of the embedded model's width (a layer's fixed
  time taken out) and a wide one;
- a decoder layer's time besides its weights, and a stage step's fixed time: layerline's own
  stage engine, one thread, on narrow random models of two depths (the slope and the intercept);
- an all-reduce of a token's hidden state among 2 and 3 gloo ranks on this machine, between
  computations of each rank as a tensor-parallel stage runs them (what it adds to them);
- layerline's own path: single streams through 1- and 2-stage local clusters of the embedded model,
  whose stages report their compute. The rest of a 1-stage token's time is a step's overhead; its
  compute over what the rates above predict is the factor by which a cluster's stages compute
  slower than steps back to back; what the 2-stage chain takes beyond that is what a hop adds
  (its messages, and its stages' steps starting after a pause);
- a stage process's memory besides its tensors.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from layerline.shared.cpu import cpu_name
from layerline.shared.model_config import LayerRange, ModelConfig

from .path import PATH_TOKENS, measure_path, predicted_compute
from .profile import ALLREDUCE_BYTES, MATMUL_ROWS, SMALL_HIDDEN, WIDE_HIDDEN, MachineProfile

DTYPES = ("float32", "bfloat16")


def measured_dtypes() -> tuple[str, ...]:
    """The dtypes calibrated here: bfloat16 only on a CPU with bfloat16 instructions, where torch
    runs it in oneDNN. Elsewhere its matmuls fall back to code so slow that measuring them took
    longer than a quarter of an hour (AMD EPYC, AVX2), and no layout would choose it."""
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return DTYPES if bf16 else ("float32",)


WIDE: dict[
    str, int | str
] = {  # a model whose steps are mostly its weights' matmuls: 2 layers of 69M parameters, 556 MB in float32
    "model_type": "llama",
    "hidden_size": WIDE_HIDDEN,
    "intermediate_size": 6912,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
WIDE_LAYERS = 2
SMALL: dict[str, int | str] = {  # the embedded model's layers (SmolLM2-135M): its matrices, its rates
    "model_type": "llama",
    "hidden_size": SMALL_HIDDEN,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}
SMALL_LAYERS = 12  # 170 MB of float32: more than the caches
BANDWIDTH_ELEMENTS = 1 << 28  # 1 GiB of float32
ALLREDUCE_ROUNDS = 300
# Times of a token's all-reduce and a chunk's, taken in turn; the medians count. With one pair the
# rate beyond a token's came out at 0.85, 5.6 and 2.6 GB/s in three calibrations (tp 2).
ALLREDUCE_PAIRS = 3
# A prompt chunk's hidden states, all-reduced as a tensor-parallel prefill does: 64 tokens of 4096
# float32 (1 MiB), between 8 times a decode step's compute (a prompt chunk's share of a layer: the
# longer each rank computes, the longer one that the cores left waiting holds the others). Timed only
# for one token's, tp 3's prefill on 2 cores came out 1.4-1.7x the predicted time.
ALLREDUCE_CHUNK_ROWS = 64
# Rows of compute each rank runs between two all-reduces, about a SmolLM2 layer's share at tp 3:
# an all-reduce between computations is what a tensor-parallel step pays. Back to back, 3 ranks
# on 2 cores all-reduced in 0.74 ms a round (median); between computations each cost 3.3 ms more
# than the computations alone (AMD EPYC), since a rank that the cores left waiting holds the rest.
ALLREDUCE_COMPUTE_ROWS = 64
NARROW: dict[str, int | str] = {  # a model whose weights are negligible: what remains is a layer's fixed time
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def _median_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth() -> float:
    torch.set_num_threads(1)
    data = torch.ones(BANDWIDTH_ELEMENTS, dtype=torch.float32)
    seconds = _median_time(data.sum, 5)
    return data.numel() * data.element_size() / seconds


class _Engine:
    """layerline's own stage engine on a random model of `shape`, all of its layers, for timing steps."""

    def __init__(self, shape: dict[str, int | str], layers: int, dtype: str, threads: int) -> None:
        from layerline.stage_worker.engine import StageEngine
        from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
        from layerline.stage_worker.layouts import apply_layouts
        from layerline.stage_worker.llama import StageModel

        torch.set_num_threads(threads)
        self.config = ModelConfig.from_dict({**shape, "num_hidden_layers": layers})
        span = LayerRange(0, layers)
        torch.manual_seed(0)
        model = StageModel(self.config, span).to(getattr(torch, dtype)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        self.params = sum(p.numel() for p in model.parameters())
        apply_layouts(model, weight_layout="both", dtype=getattr(torch, dtype), device="cpu")
        kv = CacheShape(160, 16, self.config.num_kv_heads, self.config.head_dim)
        cache = PagedKVCache(kv, layer_ids=span, dtype=getattr(torch, dtype))
        self.engine = StageEngine(model, cache, max_threads=threads, prefill_threads=threads)
        self._fresh = 0

    def decode(self, rows: int, repeats: int) -> float:
        """Median time of a step that advances `rows` sequences (8 tokens each held) by a token."""
        from layerline.stage_worker.engine import SequenceStep

        names = [f"d{rows}-{i}" for i in range(rows)]
        self.engine.run([SequenceStep(n, tuple(range(8)), tuple(range(1, 9))) for n in names])
        positions = iter(range(8, 10_000))

        def step() -> None:
            at = next(positions)
            self.engine.run([SequenceStep(n, (at,), (3,)) for n in names])

        seconds = _median_time(step, repeats)
        for n in names:
            self.engine.release(n)
        return seconds

    def prefill(self, rows: int, repeats: int) -> float:
        """Median time of a step of one new sequence's first `rows` tokens."""
        from layerline.stage_worker.engine import SequenceStep

        def step() -> None:
            self._fresh += 1
            name = f"p{self._fresh}"
            self.engine.run([SequenceStep(name, tuple(range(rows)), (5,) * rows)])
            self.engine.release(name)

        return _median_time(step, repeats)


def measure_matmul(
    cores: int,
    log: Callable[[str], None],
    *,
    shape: dict[str, int | str] = WIDE,
    layers: int = WIDE_LAYERS,
    overhead: tuple[dict[str, float], dict[str, float]] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """dtype -> threads -> rows -> the rate of layerline's linear layers on a random model of `shape`:
    its steps' time (less `overhead`'s fixed time of its layers and step, where given) over the
    multiply-adds of its weights."""
    rates: dict[str, dict[str, dict[str, float]]] = {}
    counts = sorted({1, cores})
    for name in measured_dtypes():
        engine = _Engine(shape, layers, name, 1)
        fixed = overhead[0][name] * layers + overhead[1][name] if overhead is not None else 0.0
        samples: dict[int, dict[int, list[float]]] = {t: {} for t in counts}
        for rows in MATMUL_ROWS:
            for _ in range(2):
                for threads in counts:
                    engine.engine.max_threads = engine.engine.prefill_threads = threads
                    seconds = engine.decode(rows, 5) if rows <= 16 else engine.prefill(rows, 2)
                    samples[threads].setdefault(rows, []).append(max(seconds - fixed, 0.25 * seconds))
        rates[name] = {
            str(t): {str(r): 2.0 * engine.params * r / statistics.median(v) for r, v in by_rows.items()}
            for t, by_rows in samples.items()
        }
        del engine
        for t, by_rows in rates[name].items():
            shown = ", ".join(f"{r} rows {v / 1e9:.1f}" for r, v in by_rows.items())
            log(f"layerline's matmuls, hidden {shape['hidden_size']}, {name}, {t} thread(s): {shown} GFLOP/s")
    return rates


def measure_layer_overhead() -> tuple[dict[str, float], dict[str, float]]:
    """Per dtype: a layer's fixed time (slope over depth) and a stage step's (intercept), one token."""
    per_layer, per_step = {}, {}
    for dtype in measured_dtypes():
        shallow = _Engine(NARROW, 4, dtype, 1).decode(1, 40)
        deep = _Engine(NARROW, 24, dtype, 1).decode(1, 40)
        per_layer[dtype] = max((deep - shallow) / 20, 1e-7)
        per_step[dtype] = max(shallow - 4 * per_layer[dtype], 1e-7)
    return per_layer, per_step


def _allreduce_rank(rank: int, size: int, port: int, queue: multiprocessing.Queue) -> None:
    """One rank of `measure_allreduce`: a layer's share of compute, then the all-reduce, in turn;
    of a token's hidden state, then of a prompt chunk's."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    weight = torch.randn(576, 576)
    token_rows = torch.randn(ALLREDUCE_COMPUTE_ROWS, 576)  # a decode step's share of a layer
    chunk_rows = torch.randn(ALLREDUCE_COMPUTE_ROWS * ALLREDUCE_CHUNK_ROWS // 8, 576)  # a prompt chunk's

    def added(t: torch.Tensor, rows: torch.Tensor, rounds: int) -> float:
        """Seconds an all-reduce of `t` adds to the computation between two of them."""

        def compute() -> None:
            torch.mm(rows, weight)

        for _ in range(10):
            compute()
            dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(rounds):
            compute()
        alone = (time.perf_counter() - start) / rounds
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            compute()
            dist.all_reduce(t)
        return max((time.perf_counter() - start) / rounds - alone, 1e-6)

    tokens, beyond = [], []
    for _ in range(ALLREDUCE_PAIRS):  # a token's and a chunk's in turn: the drift falls on both
        tokens.append(added(torch.ones(1, ALLREDUCE_BYTES // 4), token_rows, ALLREDUCE_ROUNDS))
        chunk = added(torch.ones(ALLREDUCE_CHUNK_ROWS, ALLREDUCE_BYTES // 4), chunk_rows, ALLREDUCE_ROUNDS // 10)
        beyond.append(chunk - tokens[-1])
    if rank == 0:
        queue.put((statistics.median(tokens), statistics.median(beyond)))
    dist.destroy_process_group()


def beyond_rate(beyond_s: float, *, ceiling_bytes_s: float) -> float:
    """Bytes/s of a prompt chunk's all-reduce beyond a token's, from the `beyond_s` seconds it added
    more than a token's did: no more than `ceiling_bytes_s`, even where noise made `beyond_s` zero or less."""
    extra_bytes = (ALLREDUCE_CHUNK_ROWS - 1) * ALLREDUCE_BYTES
    return extra_bytes / max(beyond_s, extra_bytes / ceiling_bytes_s)


def measure_allreduce(size: int, *, ceiling_bytes_s: float) -> tuple[float, float]:
    """Among `size` gloo ranks on this machine: (seconds an all-reduce of a token's hidden state adds
    between computations, bytes/s of what a larger one adds beyond it).

    The second is the larger one's further bytes over the difference of two noisy times, which can
    come out near zero (once 1.03e12 B/s); it is held to `ceiling_bytes_s`, what one thread reads
    (`measure_bandwidth`): each rank moves those bytes through memory at least once."""
    from layerline.shared.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, size, port, queue)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        token, beyond_s = queue.get(timeout=180)
        return float(token), beyond_rate(float(beyond_s), ceiling_bytes_s=ceiling_bytes_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def measure_runtime_bytes() -> int:
    """Resident memory of a fresh process that has loaded a stage worker's code (torch and all)."""
    code = (
        "import layerline.stage_worker.server, torch; torch.ones(1) @ torch.ones(1);"
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"measuring a stage process's memory failed: {done.stderr[-500:]}")
    return int(done.stdout.split()[-1]) * 1024


def kept_copies() -> dict[str, dict[str, int]]:
    """dtype -> "1" (one rank) / "2" (a tensor-parallel rank) -> the copies of each weight matrix a
    stage keeps on this machine under the default --weight-layout (its kernels compiled and checked)."""
    from layerline.stage_worker.layouts import weight_copies
    from layerline.stage_worker.settings import StageSettings

    layout = StageSettings.weight_layout
    return {
        dtype: {
            "1": weight_copies(layout, getattr(torch, dtype), "cpu", 1),
            "2": weight_copies(layout, getattr(torch, dtype), "cpu", 2),
        }
        for dtype in DTYPES
    }


def kept_screens() -> dict[str, bool]:
    """dtype -> whether a last stage of one rank keeps the LM head's int8 screen on this machine."""
    from layerline.stage_worker.layouts import keeps_head_screen

    return {dtype: keeps_head_screen(getattr(torch, dtype)) for dtype in DTYPES}


def _copies_line(copies: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{d} {c['1']} on one rank, {c['2']} on a tensor-parallel one" for d, c in copies.items())


def calibrate(checkpoint: Path, *, port: int = 7580, log: Callable[[str], None] = print) -> MachineProfile:
    cores = os.cpu_count() or 1
    log(f"CPU: {cpu_name()}, {cores} cores")
    bandwidth = measure_bandwidth()
    log(f"memory bandwidth, one thread: {bandwidth / 1e9:.1f} GB/s")
    per_layer, per_step = measure_layer_overhead()
    log("a layer's fixed time: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in per_layer.items()))
    matmul = measure_matmul(cores, log)
    small = measure_matmul(cores, log, shape=SMALL, layers=SMALL_LAYERS, overhead=(per_layer, per_step))
    if "bfloat16" not in matmul:
        log("bfloat16: not measured, this CPU has no bfloat16 instructions (plans for it here need --dtype float32)")
    allreduce = {str(size): measure_allreduce(size, ceiling_bytes_s=bandwidth) for size in (2, 3)}
    log(
        "all-reduce between computations: "
        + ", ".join(f"tp {k} {t * 1e6:.0f} us a token, {b / 1e9:.2f} GB/s beyond" for k, (t, b) in allreduce.items())
    )
    runtime = measure_runtime_bytes()
    log(f"a stage process besides its tensors: {runtime / 2**20:.0f} MiB")
    copies = kept_copies()
    log("copies of each weight matrix a stage keeps under the default --weight-layout: " + _copies_line(copies))
    screens = kept_screens()
    log(
        "the LM head's int8 screen for a few greedy rows: "
        + ", ".join(f"{d} {'yes' if v else 'no'}" for d, v in screens.items())
    )
    path = measure_path(checkpoint, port=port, tokens=PATH_TOKENS, rounds=3, log=log)
    profile = MachineProfile(
        cpu=cpu_name(),
        cores=cores,
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        torch_version=torch.__version__,
        bandwidth_bytes_s=bandwidth,
        matmul_flops=matmul,
        small_matmul_flops=small,
        layer_overhead_s=per_layer,
        stage_step_s=per_step,
        step_overhead_s=max(path.other_s[1], 1e-6),
        hop_s=0.0,
        allreduce_s={k: t for k, (t, _) in allreduce.items()},
        allreduce_bytes_s={k: b for k, (_, b) in allreduce.items()},
        runtime_bytes=runtime,
        cluster_compute_factor=1.0,
        weight_copies=copies,
        head_screen=screens,
    )
    # A cluster's stages compute slower than the engine's steps back to back (the rates above), and
    # a chain of 2 slower still than 1 (each stage starts its step after a pause): the first is a
    # factor on every stage's compute, the second part of what a hop costs.
    n = ModelConfig.from_checkpoint(checkpoint).num_layers
    one = predicted_compute(checkpoint, profile, ((0, n),), tokens=PATH_TOKENS)
    two = predicted_compute(checkpoint, profile, path.ranges, tokens=PATH_TOKENS)
    factor = path.compute_s[1] / one
    hop = max(0.0, path.compute_s[2] + path.other_s[2] - path.compute_s[1] - path.other_s[1] - factor * (two - one))
    log(
        f"layerline's path: {path.other_s[1] * 1e3:.2f} ms a step besides compute; a stage's compute in a "
        f"cluster {factor:.2f}x what the rates predict ({path.compute_s[1] * 1e3:.1f} against {one * 1e3:.1f} ms "
        f"a token); one more hop {hop * 1e3:.2f} ms"
    )
    return replace(profile, cluster_compute_factor=factor, hop_s=hop)
