"""What a layout would do: memory per device, decode speed of one stream and of many, first token.

Owns the cost model. A step of `b` rows on one rank of a stage costs its matmuls (the weights it
streams, at the matmul rate for `b` rows) plus a fixed time per layer (norms, rotary, attention,
cache writes: measured, not modelled), plus two all-reduces per layer under tensor parallelism. A
token's round trip adds the coordinator's per-step time and each pipeline hop. With many streams,
a chain keeps one micro-batch per stage in flight, and a round is bounded by the longest of: one
micro-batch's trip, the busiest stage's share, and the cores (or the devices) the work must share;
on one CPU host a chain runs one micro-batch at a time, as `layerline up` does.

On this machine (`cpu`) every figure comes from the measured profile, and the processes of a local
cluster share its cores as `layerline up` shares them (launcher.py: threads per worker; the stage
engine: a step alone on its chain on the chain's threads). For catalog GPUs the figures are the datasheet's,
at the achievable fractions below, since a device that is not here cannot be measured.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from layerline.shared.model_config import ModelConfig

from .hardware import CATALOG, CPU, Device, Link
from .profile import MachineProfile
from .shapes import (
    DTYPE_BYTES,
    PREFILL_CHUNK_TOKENS,
    Memory,
    Placement,
    flops_per_token,
    hidden_bytes_per_token,
    kv_bytes_per_token,
    memory_per_rank,
    streamed_params_per_token,
)

# Assumptions for devices that are not here to measure (stated, not tuned to any run):
GPU_BANDWIDTH_EFFICIENCY = 0.8  # of the datasheet's memory bandwidth that a decode step's reads reach
GPU_MATMUL_EFFICIENCY = 0.6  # of the datasheet's dense rate that large matmuls reach
GPU_LAYER_OVERHEAD_S = 40e-6  # kernel launches of one decoder layer (about a dozen, a few us each)
GPU_RUNTIME_BYTES = 2 * 1024**3  # CUDA context, cuBLAS workspace and allocator slack per device
GPU_STEP_OVERHEAD_S = 2e-3  # the coordinator's part of a step, when no profile of this host says otherwise
GPU_HOP_S = 1e-3  # a hop's software cost (device to host, gRPC, host to device), likewise


@dataclass(frozen=True)
class Layout:
    tp: int  # tensor-parallel ranks per stage
    pp: int  # pipeline stages per chain
    dp: int  # chains side by side
    layers: tuple[tuple[int, int], ...]  # each stage's half-open layer range

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def stages(self, num_layers: int) -> list[Placement]:
        return [Placement(s, e, self.tp, s == 0, e == num_layers) for s, e in self.layers]


@dataclass(frozen=True)
class Workload:
    dtype: str
    context: int  # tokens of each sequence the KV cache must hold (prompt and answer)
    concurrency: int  # sequences at once, over all chains
    prompt_tokens: int  # the prompt whose first token is predicted


@dataclass
class Prediction:
    layout: Layout
    memory: Memory  # of the fullest device
    fits: bool
    decode_tok_s: float  # one stream alone
    aggregate_tok_s: float  # all streams of `concurrency` together
    ttft_ms: float  # first token of a `prompt_tokens` prompt, alone
    bubble: float  # share of a stage's time it waits, for one stream
    link_bytes_per_token: dict[str, int] = field(default_factory=dict)  # per link kind, per token of a stream
    inter_node_hops: int = 0  # link crossings of a chain's round trip between nodes
    kv_per_rank: int = 0  # the largest KV cache one stage rank needs (its --kv-memory)


@dataclass(frozen=True)
class Machine:
    """Where a layout runs: nodes of one device kind, the links, and this host's profile (if any)."""

    device: str  # catalog key or CPU
    nodes: int
    per_node: int  # devices per node (CPU: 1)
    intra: Link | None  # between devices of a node (None: this machine's measured local hop)
    inter: Link  # between nodes
    profile: MachineProfile | None
    # The CPU nodes are network namespaces of this one machine (netlab's test hosts, which
    # `plan --check` runs across links): they share its cores and memory, as `up`'s processes do.
    shared_cores: bool = False

    @property
    def core_hosts(self) -> int:
        """How many machines' cores the nodes have between them."""
        return 1 if self.shared_cores else self.nodes

    @property
    def is_cpu(self) -> bool:
        return self.device == CPU

    @property
    def spec(self) -> Device:
        return CATALOG[self.device]


def _crossings(layout: Layout, machine: Machine) -> int:
    """Link crossings between nodes on a chain's round trip (the coordinator sits with the first stage).
    On CPU hosts a chain's stages spread over the hosts; GPU chains fill a node's devices first."""
    if machine.nodes == 1:
        return 0
    if machine.is_cpu:
        nodes = [min(i * machine.nodes // layout.pp, machine.nodes - 1) for i in range(layout.pp)]
    else:
        nodes = [(i * layout.tp) // machine.per_node for i in range(layout.pp)]
    hops = sum(a != b for a, b in itertools.pairwise(nodes))
    return hops + (nodes[-1] != nodes[0])


def waves(threads: int, cores: int) -> int:
    """How many times longer a step of tensor-parallel ranks with `threads` threads in all takes on
    `cores` cores than on a core each: the ranks meet at every all-reduce, and with more threads than
    cores the last of them computes after the others are done (3 ranks on 2 cores: 2, where sharing
    the cores evenly would give 1.5; tp 3's prompt on 2 cores measured 1.5-1.7x what 1.5 predicted)."""
    return max(1, math.ceil(threads / cores))


class CostModel:
    """Seconds for a step of `rows` tokens on one stage, on this machine or a catalog device."""

    def __init__(self, config: ModelConfig, machine: Machine, workload: Workload, layout: Layout) -> None:
        self.config, self.machine, self.work, self.layout = config, machine, workload, layout
        self.profile = machine.profile
        ranks_per_host = layout.ranks if machine.is_cpu else 1
        if machine.is_cpu:
            assert self.profile is not None
            hosts = machine.core_hosts
            self.cores = self.profile.cores
            workers = max(1, math.ceil(layout.pp * layout.dp / hosts))
            self.threads = max(1, self.cores // (workers * layout.tp))  # launcher.py's share
            self.prefill_threads = max(self.threads, self.cores // (max(1, layout.dp // hosts) * layout.tp))
            self.ranks_per_host = max(1, math.ceil(ranks_per_host / hosts))

    def step_overhead(self) -> float:
        return self.profile.step_overhead_s if self.profile else GPU_STEP_OVERHEAD_S

    def hop(self, *, crossing: bool) -> float:
        """One hop of a token's hidden state to the next stage (or its token back to the coordinator)."""
        software = self.profile.hop_s if self.profile else GPU_HOP_S
        nbytes = hidden_bytes_per_token(self.config, self.work.dtype)
        if crossing:
            return software + self.machine.inter.latency_s + nbytes / self.machine.inter.bytes_per_s
        intra = self.machine.intra
        return software + (intra.latency_s + nbytes / intra.bytes_per_s if intra else 0.0)

    def stage(self, stage: Placement, rows: int, *, context: int, prefill: bool = False, alone: bool = False) -> float:
        """One step of `rows` tokens (each attending over about `context`) through `stage` on one rank;
        `alone`: no other step of its chain in flight (a lone stream, a prompt's chunk)."""
        layers = stage.end - stage.start
        per_row = flops_per_token(self.config, stage, context=context)
        head = 0.0
        if stage.last and prefill:  # a prompt chunk computes the head for its last row only
            table = -(-self.config.vocab_size // stage.tp) * self.config.hidden_size
            per_row -= 2.0 * table
            head = 2.0 * table
        if self.machine.is_cpu:
            return self._cpu_stage(stage, layers, rows, per_row, head, alone=alone)
        spec, eff_bw = self.machine.spec, self.machine.spec.bandwidth_bytes_s * GPU_BANDWIDTH_EFFICIENCY
        weights = streamed_params_per_token(self.config, stage) * DTYPE_BYTES[self.work.dtype]
        kv = kv_bytes_per_token(self.config, stage, self.work.dtype) * context * rows
        flops = per_row * rows + head
        compute = max(weights / eff_bw, flops / (spec.flops[self.work.dtype] * GPU_MATMUL_EFFICIENCY))
        comm = 0.0
        if stage.tp > 1:
            link = self.machine.intra
            assert link is not None
            ring = 2 * (stage.tp - 1) / stage.tp * rows * hidden_bytes_per_token(self.config, self.work.dtype)
            comm = (2 * layers + stage.last) * (2 * (stage.tp - 1) * link.latency_s + ring / link.bytes_per_s)
        return compute + kv / eff_bw + layers * GPU_LAYER_OVERHEAD_S + comm

    def cpu_threads(self, *, alone: bool) -> int:
        """The threads a stage worker computes a step on (the stage engine's rule): its share of the
        cores, and a chain's share when the step is alone on its chain."""
        return self.prefill_threads if alone else self.threads

    def _cpu_stage(
        self, stage: Placement, layers: int, rows: int, per_row: float, head: float, *, alone: bool
    ) -> float:
        p = self.profile
        assert p is not None
        dtype = self.work.dtype
        threads = self.cpu_threads(alone=alone)
        hidden = self.config.hidden_size
        seconds = per_row * rows / p.matmul_rate(dtype, threads, rows, hidden=hidden)
        seconds += head / p.matmul_rate(dtype, threads, 1, hidden=hidden)
        seconds += layers * p.layer_overhead_s.get(dtype, max(p.layer_overhead_s.values()))
        seconds += p.stage_step_s.get(dtype, max(p.stage_step_s.values()))
        seconds *= waves(stage.tp * threads, self.cores)
        # Between steps a cluster's other processes run: its stages compute slower than steps back to back.
        seconds *= p.cluster_compute_factor
        # Two all-reduces a layer of each row's hidden state (and the head's gather on the last stage).
        nbytes = rows * hidden_bytes_per_token(self.config, dtype)
        return seconds + (2 * layers + stage.last) * p.allreduce(stage.tp, nbytes)


def predict(config: ModelConfig, layout: Layout, machine: Machine, work: Workload) -> Prediction:
    stages = layout.stages(config.num_layers)
    cost = CostModel(config, machine, work, layout)
    runtime = machine.profile.runtime_bytes if machine.is_cpu and machine.profile else GPU_RUNTIME_BYTES
    per_chain = max(1, math.ceil(work.concurrency / layout.dp))
    memories = [
        memory_per_rank(
            config,
            s,
            work.dtype,
            context=work.context,
            concurrency=per_chain,
            runtime_bytes=runtime,
            copies=machine.profile.copies(work.dtype, s.tp) if machine.is_cpu and machine.profile else 1,
            screened=bool(machine.is_cpu and machine.profile and machine.profile.head_screen.get(work.dtype)),
        )
        for s in stages
    ]
    if machine.is_cpu:  # every rank on a host shares its RAM
        assert machine.profile is not None
        per_host = max(1, math.ceil(layout.dp * layout.pp / machine.core_hosts))
        ranks = [
            Memory(*(layout.tp * getattr(m, f) for f in ("weights", "kv_cache", "activations", "runtime")))
            for m in memories
        ]
        fullest = max(ranks, key=lambda m: m.total)
        host = Memory(*(per_host * getattr(fullest, f) for f in ("weights", "kv_cache", "activations", "runtime")))
        memory, capacity = host, machine.profile.memory_bytes
    else:
        memory, capacity = max(memories, key=lambda m: m.total), machine.spec.memory_bytes
    crossings = _crossings(layout, machine)
    hops = [cost.hop(crossing=False)] * (layout.pp - 1)
    # The crossings replace local hops: each costs the link on top of the software hop.
    hop_time = sum(hops) + crossings * (cost.hop(crossing=True) - cost.hop(crossing=False))
    overhead = cost.step_overhead() + hop_time
    context = work.context
    single = [cost.stage(s, 1, context=context, alone=True) for s in stages]
    single_round = sum(single) + overhead
    # Many streams: a chain's sequences split over one micro-batch per stage, where its stages have
    # devices or hosts of their own; `up` on this one host runs one at a time on all the cores its
    # stages share (launcher.py, ClusterPlan.depth).
    micro = 1 if machine.is_cpu and machine.nodes == 1 else min(layout.pp, per_chain)
    rows = math.ceil(per_chain / micro)
    many = [cost.stage(s, rows, context=context, alone=micro == 1) for s in stages]  # one micro-batch: alone
    bounds = [sum(many) + overhead, micro * max(many)]
    if machine.is_cpu:  # a host's cores are shared by the ranks of every stage of every chain on it
        threads = cost.cpu_threads(alone=micro == 1)
        core_seconds = layout.dp * micro * sum(many) * layout.tp * threads / waves(layout.tp * threads, cost.cores)
        bounds.append(core_seconds / (cost.cores * machine.core_hosts))
    rounds = max(bounds)
    chunks = [
        min(PREFILL_CHUNK_TOKENS, work.prompt_tokens - i) for i in range(0, work.prompt_tokens, PREFILL_CHUNK_TOKENS)
    ]
    ttft = sum(sum(cost.stage(s, n, context=n, prefill=True, alone=True) for s in stages) + overhead for n in chunks)
    busy = sum(single) / layout.pp
    link_bytes = {"between stages": (layout.pp - 1) * hidden_bytes_per_token(config, work.dtype)}
    if layout.tp > 1:
        ring = 2 * (layout.tp - 1) / layout.tp * hidden_bytes_per_token(config, work.dtype)
        link_bytes["tensor-parallel, per rank"] = int((2 * config.num_layers + 1) * ring)
    if crossings:
        link_bytes["between nodes"] = crossings * hidden_bytes_per_token(config, work.dtype)
    return Prediction(
        layout=layout,
        memory=memory,
        fits=memory.total <= capacity,
        decode_tok_s=1.0 / single_round,
        aggregate_tok_s=work.concurrency / rounds,
        ttft_ms=1000.0 * ttft,
        bubble=1.0 - busy / single_round,
        link_bytes_per_token=link_bytes,
        inter_node_hops=crossings,
        kv_per_rank=max(m.kv_cache for m in memories),
    )
