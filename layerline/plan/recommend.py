"""Which layout to run: every feasible tp x pp x dp, predicted, and one recommended with its reason.

Owns the enumeration (tensor parallelism within a node and only where the model's tensors can be cut;
stages as `layerline up` splits them, the last one lighter by the LM head's weight; chains side by
side on the devices left), the choice and the plain-language reason, and the JSON of a plan. A
layout that does not fit its devices' memory is listed, marked so, and never recommended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerline.launcher import split_layers
from layerline.shared.model_config import ModelConfig

from .predict import Layout, Machine, Prediction, Workload, predict
from .shapes import GIB, can_split

MAX_CPU_PROCESSES = 6  # on CPU hosts, layouts of up to this many stage processes per host
MAX_CPU_TP = 4


@dataclass(frozen=True)
class Target:
    latency_ms: float | None = None  # per token of one stream
    throughput_tok_s: float | None = None  # all streams together

    def met(self, p: Prediction) -> bool:
        if self.latency_ms is not None and 1000.0 / p.decode_tok_s > self.latency_ms:
            return False
        return self.throughput_tok_s is None or p.aggregate_tok_s >= self.throughput_tok_s

    def describe(self) -> str:
        if self.latency_ms is not None:
            return f"{self.latency_ms:g} ms per token"
        if self.throughput_tok_s is not None:
            return f"{self.throughput_tok_s:g} tokens/s in all"
        return "no target"


@dataclass
class Plan:
    model: str
    predictions: list[Prediction]
    recommended: Prediction | None
    reason: str


def layouts(config: ModelConfig, machine: Machine) -> list[Layout]:
    """Every layout the devices can hold a whole chain of, smallest first."""
    found = []
    if machine.is_cpu:
        tps = [t for t in range(1, MAX_CPU_TP + 1) if can_split(config, t)]
        for tp in tps:
            for pp in range(1, min(config.num_layers, MAX_CPU_PROCESSES) + 1):
                for dp in range(1, MAX_CPU_PROCESSES * machine.nodes // pp + 1):
                    found.append((tp, pp, dp))
    else:
        total = machine.nodes * machine.per_node
        tps = [t for t in range(1, machine.per_node + 1) if machine.per_node % t == 0 and can_split(config, t)]
        for tp in tps:
            for pp in range(1, min(config.num_layers, total // tp) + 1):
                for dp in range(1, total // (tp * pp) + 1):
                    found.append((tp, pp, dp))
    return [
        Layout(tp, pp, dp, tuple(split_layers(config.num_layers, pp, head_weight=config.head_weight)))
        for tp, pp, dp in sorted(found, key=lambda k: (k[0] * k[1] * k[2], k[1], k[0], k[2]))
    ]


def make_plan(model: str, config: ModelConfig, machine: Machine, work: Workload, target: Target) -> Plan:
    predictions = [predict(config, layout, machine, work) for layout in layouts(config, machine)]
    chosen, reason = choose(predictions, target, machine)
    return Plan(model, predictions, chosen, reason)


def _key(target: Target) -> Callable[[Prediction], float]:
    if target.throughput_tok_s is not None:
        return lambda p: p.aggregate_tok_s
    return lambda p: p.decode_tok_s


def choose(predictions: list[Prediction], target: Target, machine: Machine) -> tuple[Prediction | None, str]:
    fitting = [p for p in predictions if p.fits]
    unit = "processes" if machine.is_cpu else "devices"
    if not fitting:
        least = min(predictions, key=lambda p: p.memory.total, default=None)
        need = f"; the leanest layout needs {least.memory.total / GIB:.1f} GiB per device" if least else ""
        return None, f"no layout fits: the model, its KV cache and activations exceed every device's memory{need}"
    score = _key(target)
    meeting = [p for p in fitting if target.met(p)]
    if not meeting:
        best = max(fitting, key=score)
        return best, (f"no layout meets the target ({target.describe()}); this one comes closest: {_figures(best)}")
    # The fewest devices that meet the target; among those, the best figure.
    fewest = min(p.layout.ranks for p in meeting)
    best = max((p for p in meeting if p.layout.ranks == fewest), key=score)
    lay = best.layout
    if lay.ranks == 1:
        where = "one process" if machine.is_cpu else "one device"
        goal = f"meets the target ({target.describe()})" if target != Target() else "needs nothing more"
        return best, (
            f"do not distribute: it fits on {where} ({best.memory.total / GIB:.1f} GiB) and {goal}: {_figures(best)}"
        )
    why = []
    if lay.tp > 1:
        why.append(f"tp {lay.tp} splits each layer's weights so every token reads 1/{lay.tp} per device")
    if lay.pp > 1:
        why.append(
            f"{lay.pp} stages split the layers" + (" because fewer do not fit" if not _fits_fewer(fitting, lay) else "")
        )
    if lay.dp > 1:
        why.append(f"{lay.dp} replicas serve the streams side by side")
    goal = (
        f"the fewest {unit} ({lay.ranks}) that meet {target.describe()}"
        if target != Target()
        else (f"the fewest {unit} ({lay.ranks}) that fit")
    )
    return best, f"{goal}: {'; '.join(why)}; {_figures(best)}"


def _fits_fewer(fitting: list[Prediction], chosen: Layout) -> bool:
    return any(p.layout.pp < chosen.pp and p.layout.tp == chosen.tp for p in fitting)


def _figures(p: Prediction) -> str:
    return (
        f"{p.decode_tok_s:.1f} tokens/s for one stream, {p.aggregate_tok_s:.1f} in all, "
        f"first token in {p.ttft_ms:.0f} ms, {p.memory.total / GIB:.1f} GiB per device"
    )


def prediction_json(p: Prediction) -> dict[str, Any]:
    lay = p.layout
    return {
        "tp": lay.tp,
        "pp": lay.pp,
        "dp": lay.dp,
        "layers": [list(r) for r in lay.layers],
        "memory_per_device_bytes": p.memory.total,
        "memory": {
            "weights": p.memory.weights,
            "kv_cache": p.memory.kv_cache,
            "activations": p.memory.activations,
            "runtime": p.memory.runtime,
        },
        "decode_tok_s": round(p.decode_tok_s, 3),
        "aggregate_tok_s": round(p.aggregate_tok_s, 3),
        "ttft_ms": round(p.ttft_ms, 3),
        "bubble": round(p.bubble, 4),
        "link_bytes_per_token": p.link_bytes_per_token,
        "fits": p.fits,
    }


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "model": plan.model,
        "layouts": [prediction_json(p) for p in plan.predictions],
        "recommended": prediction_json(plan.recommended) if plan.recommended else None,
        "reason": plan.reason,
    }


def plan_table(plan: Plan) -> str:
    rows = [
        f"{'tp':>3} {'pp':>3} {'dp':>3}  {'layers':<24} {'GiB/dev':>8} {'fits':>4} "
        f"{'decode tok/s':>12} {'aggregate':>10} {'ttft ms':>9} {'bubble':>6}"
    ]
    for p in plan.predictions:
        lay = p.layout
        ranges = " ".join(f"{s}:{e}" for s, e in lay.layers)
        ranges = ranges if len(ranges) <= 24 else ranges[:21] + "..."
        mark = "*" if p is plan.recommended else " "
        rows.append(
            f"{lay.tp:>3} {lay.pp:>3} {lay.dp:>3}{mark} {ranges:<24} {p.memory.total / GIB:>8.1f} "
            f"{'yes' if p.fits else 'no':>4} {p.decode_tok_s:>12.1f} {p.aggregate_tok_s:>10.1f} "
            f"{p.ttft_ms:>9.1f} {p.bubble:>6.2f}"
        )
    rows.append(f"recommended (*): {plan.reason}")
    return "\n".join(rows) + "\n"
