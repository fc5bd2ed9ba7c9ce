"""This machine as `layerline plan --calibrate` measured it: the figures a CPU prediction is made of.

Owns the profile's fields, their JSON file (written and read back field by field, every value
checked: a profile is plain numbers, never code), and reading a matmul rate at a row count between
the measured ones. Measuring is `calibrate.py`'s; using the figures is `predict.py`'s.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from layerline.model_store import cache_root

PROFILE_VERSION = 8  # 8: the LM head's int8 screen (head_screen), its memory counted
MATMUL_ROWS = (1, 4, 8, 16, 64, 256)  # the row counts measured: decode steps up to prompt chunks
# The hidden sizes whose layers the matmul rates are measured on: the embedded model's, and a wide
# model's whose steps are nearly all streaming weights. A model between them is read in between.
SMALL_HIDDEN = 576
WIDE_HIDDEN = 2560
ALLREDUCE_BYTES = 4096 * 4  # the all-reduce `allreduce_s` times: a token's hidden state of 4096 float32


class ProfileError(ValueError):
    """A profile file that is missing, unreadable, or holds a value that is not what it should be."""


def default_profile_path() -> Path:
    return cache_root() / "plan-profile.json"


@dataclass(frozen=True)
class MachineProfile:
    cpu: str  # the CPU's model name
    cores: int  # logical CPUs torch may use
    memory_bytes: int  # RAM
    torch_version: str  # the torch that was measured
    bandwidth_bytes_s: float  # reading a large tensor, one thread
    # dtype -> threads ("1", and the core count) -> rows -> multiply-adds x2 per second of the
    # linear layers of a WIDE_HIDDEN model, weights larger than the caches
    matmul_flops: dict[str, dict[str, dict[str, float]]]
    # the same for layers of SMALL_HIDDEN (smaller matrices make less of the memory: at one row
    # 9 against 13 GFLOP/s on two threads of an AMD EPYC), a layer's fixed time taken out
    small_matmul_flops: dict[str, dict[str, dict[str, float]]]
    layer_overhead_s: dict[str, float]  # dtype -> a decoder layer's step time that is not its weights (1 token)
    stage_step_s: dict[str, float]  # dtype -> a stage step's fixed compute besides its layers (1 token)
    step_overhead_s: float  # a step's time on layerline's path that is not compute: coordinator and 1 hop
    hop_s: float  # what one more pipeline hop adds to a step on this machine
    allreduce_s: dict[str, float]  # tp -> one all-reduce of a token's hidden state among tp ranks (gloo)
    # tp -> bytes/s that a larger all-reduce (a prompt chunk's hidden states) adds beyond a token's
    allreduce_bytes_s: dict[str, float]
    # a stage's compute in a local cluster over what the rates above predict for it (one process,
    # steps back to back): layerline's own engine between pauses, measured on the embedded model
    cluster_compute_factor: float
    runtime_bytes: int  # a stage process's memory besides weights, KV and activations
    # dtype -> "1" (one rank) or "2" (a tensor-parallel rank) -> the copies of each weight matrix a
    # stage keeps here under --weight-layout both (layouts.weight_copies); a dtype not named: 1
    weight_copies: dict[str, dict[str, int]]
    # dtype -> whether a last stage of one rank keeps the LM head's int8 screen here (its memory
    # counted: stage_worker/layouts.py's `keeps_head_screen`); a dtype not named: no
    head_screen: dict[str, bool]
    version: int = PROFILE_VERSION

    def copies(self, dtype: str, tp: int) -> int:
        """The copies of each weight matrix a stage of `dtype` on `tp` ranks keeps on this machine."""
        return self.weight_copies.get(dtype, {}).get("1" if tp == 1 else "2", 1)

    def matmul_rate(self, dtype: str, threads: int, rows: float, *, hidden: int = WIDE_HIDDEN) -> float:
        """Multiply-adds x2 per second at `rows` on `threads`, for layers of width `hidden`:
        interpolated in log space between the measured row counts and widths, linearly between the
        measured thread counts (each clamped to what was measured)."""
        if dtype not in self.matmul_flops:
            raise ProfileError(
                f"the profile has no matmul rates for dtype {dtype} (measured: {', '.join(sorted(self.matmul_flops))}; "
                "bfloat16 only where the CPU has bfloat16 instructions): plan another --dtype, or run "
                "`layerline plan --calibrate` on a machine that has them"
            )
        wide = _by_threads(self.matmul_flops[dtype], threads, rows)
        small = _by_threads(self.small_matmul_flops.get(dtype, self.matmul_flops[dtype]), threads, rows)
        w = min(max(math.log(hidden / SMALL_HIDDEN) / math.log(WIDE_HIDDEN / SMALL_HIDDEN), 0.0), 1.0)
        return math.exp((1 - w) * math.log(small) + w * math.log(wide))

    def allreduce(self, tp: int, nbytes: int = ALLREDUCE_BYTES) -> float:
        """One all-reduce of `nbytes` among `tp` ranks: a token's time, and beyond a token's bytes
        what each further byte adds."""
        if tp == 1:
            return 0.0
        extra = max(0, nbytes - ALLREDUCE_BYTES)
        if str(tp) in self.allreduce_s:
            return self.allreduce_s[str(tp)] + extra / self.allreduce_bytes_s[str(tp)]
        largest = max(int(t) for t in self.allreduce_s)  # a ring's latency and traffic grow with its length
        scale = (tp - 1) / (largest - 1)
        return scale * (self.allreduce_s[str(largest)] + extra / self.allreduce_bytes_s[str(largest)])

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> MachineProfile:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProfileError(f"no machine profile at {path}: run `layerline plan --calibrate` first") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ProfileError(f"machine profile {path} is not readable JSON: {err}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "profile") -> MachineProfile:
        if not isinstance(raw, dict):
            raise ProfileError(f"{source}: a profile is a JSON object")
        if raw.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"{source}: version {raw.get('version')!r}, this layerline reads {PROFILE_VERSION}: calibrate again"
            )
        names = {f.name for f in fields(cls)}
        missing, extra = names - raw.keys(), raw.keys() - names
        if missing or extra:
            raise ProfileError(f"{source}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")
        for name in ("cores", "memory_bytes", "runtime_bytes"):
            _positive(raw[name], f"{source}: {name}", integer=True)
        for name in ("bandwidth_bytes_s", "step_overhead_s", "cluster_compute_factor"):
            _positive(raw[name], f"{source}: {name}")
        _positive(raw["hop_s"], f"{source}: hop_s", zero=True)
        _table(raw["matmul_flops"], f"{source}: matmul_flops", depth=3)
        _table(raw["small_matmul_flops"], f"{source}: small_matmul_flops", depth=3)
        _table(raw["layer_overhead_s"], f"{source}: layer_overhead_s", depth=1)
        _table(raw["stage_step_s"], f"{source}: stage_step_s", depth=1)
        _table(raw["allreduce_s"], f"{source}: allreduce_s", depth=1, allow_empty=True)
        _table(raw["allreduce_bytes_s"], f"{source}: allreduce_bytes_s", depth=1, allow_empty=True)
        _copies(raw["weight_copies"], f"{source}: weight_copies")
        screens = raw["head_screen"]
        if not isinstance(screens, dict) or not all(isinstance(v, bool) for v in screens.values()):
            raise ProfileError(f"{source}: head_screen must map each dtype to true or false")
        if raw["allreduce_s"].keys() != raw["allreduce_bytes_s"].keys():
            raise ProfileError(f"{source}: allreduce_s and allreduce_bytes_s must name the same tp sizes")
        for name in ("cpu", "torch_version"):
            if not isinstance(raw[name], str):
                raise ProfileError(f"{source}: {name} must be a string")
        return cls(**raw)


def _by_threads(table: dict[str, dict[str, float]], threads: int, rows: float) -> float:
    by_threads = {int(t): {int(r): v for r, v in inner.items()} for t, inner in table.items()}
    measured = sorted(by_threads)
    below = max([t for t in measured if t <= threads] or measured[:1])
    above = min([t for t in measured if t >= threads] or measured[-1:])
    low, high = _by_rows(by_threads[below], rows), _by_rows(by_threads[above], rows)
    if above == below:
        return low
    return low + (high - low) * (threads - below) / (above - below)


def _by_rows(table: dict[int, float], rows: float) -> float:
    xs = sorted(table)
    rows = min(max(rows, xs[0]), xs[-1])
    for lo, hi in itertools.pairwise(xs):
        if lo <= rows <= hi:
            w = (math.log(rows) - math.log(lo)) / (math.log(hi) - math.log(lo))
            return math.exp((1 - w) * math.log(table[lo]) + w * math.log(table[hi]))
    return table[xs[0]]


def _positive(value: Any, where: str, *, integer: bool = False, zero: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        raise ProfileError(f"{where} = {value!r} must be a {'positive integer' if integer else 'positive number'}")


def _table(value: Any, where: str, *, depth: int, allow_empty: bool = False) -> None:
    if not isinstance(value, dict) or (not value and not allow_empty):
        raise ProfileError(f"{where} must be a non-empty JSON object")
    for key, inner in value.items():
        if depth == 1:
            _positive(inner, f"{where}[{key!r}]")
        else:
            _table(inner, f"{where}[{key!r}]", depth=depth - 1)


def _copies(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a JSON object")
    for dtype, by_tp in value.items():
        if not isinstance(by_tp, dict) or not set(by_tp) <= {"1", "2"}:
            raise ProfileError(f'{where}[{dtype!r}] must be a JSON object of "1" and "2" (tp ranks)')
        for tp, n in by_tp.items():
            if n not in (1, 2) or isinstance(n, bool):
                raise ProfileError(f"{where}[{dtype!r}][{tp!r}] = {n!r} must be 1 or 2")
