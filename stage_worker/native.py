"""The stage's compiled CPU kernels: C shipped in kernels/, compiled once per machine, called via ctypes.

One library: a decode batch's attention off the paged pools (`PagedAttentionKernel` called), its
rotary with the new keys and values written to the pools (`rotate_and_store`), RMSNorm (`rms_norm`)
and the MLP's SiLU of the gate times the up (`silu_mul`), of kernels/paged_attention.c; bfloat16
products on AMX tiles (tiles.c, tiles.py); float32, bfloat16 and the LM head's int8 screen on FMAs (blocks.c,
head_screen.py), a step's layers on them in one call (layers.c, layer_stack.py); a few rows' (rows.c, int4.c);
each row's argmax of the logits (argmax.c, sampler.py).

Owns finding a C compiler ($CC, else `cc`, else `gcc`), compiling the SOURCES for the CPU it runs
on (`-O3 -march=native -fopenmp`, without `-march=native` where refused) into the cache
($LAYERLINE_HOME/kernels, this user's and writable by nobody else; each build named by a hash of the
source, the flags, the compiler's version and the CPU, so unlike machines sharing a cache never hand
one another's code), loading it, and calling it with checked arguments: the C trusts every shape and index.

The library is loaded after torch, so its `libgomp.so.1` is the copy torch loaded where torch's
wheel ships it under that name (the CPU wheels do): its parallel loops run on the OpenMP team torch's
kernels use on the same thread, not a second team competing for the cores, which cost the numba
kernel tried before its gain (docs/performance.md). `load` refuses a library with a second runtime.

`LAYERLINE_KERNELS=torch` turns it off. Where it is off, no compiler is found, compiling or loading
fails, the cache directory is not this user's alone, or a second OpenMP runtime came, `load` raises
KernelUnavailable with the reason and the stage keeps torch's path (the callers check each kernel
against torch before they trust it). Knows nothing of layouts, models or steps: tensors in and out.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from layerline.model_store.store import cache_root

from .kernel_args import DecodeBatch, WriteSlots

log = logging.getLogger(__name__)

_NAMES = "paged_attention tiles rows int4 blocks layers argmax"
SOURCES = tuple(Path(__file__).parent / f"kernels/{n}.c" for n in _NAMES.split())
ENV = "LAYERLINE_KERNELS"  # "auto" (the default): compile and use the kernel; "torch": torch's path only
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
FLAG_SETS = (("-march=native", *FLAGS), FLAGS)  # tried in order
COMPILE_TIMEOUT_S = 120.0
MAPS = "/proc/self/maps"  # where `load` looks for a second OpenMP runtime
POOL_DTYPES = (torch.float32, torch.bfloat16)  # the pools the kernel reads

_P, _I, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# the kernels' functions (each `layerline_` and the name): argument and result types
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_attention": ([_P, _INT, _P, _P, _INT, _P, _P, _I, _I, _I, _I, _I, _I, _FLOAT, _INT, _P], _INT),
    "rotate_and_store": ([_P, _P, _P, _P, _INT, _I, _I, _I, _I, _INT, _P, _P, _P], None),
    "rms_norm": ([_P, _P, _INT, _I, _I, _FLOAT, _INT, _P], None),
    "add_rms_norm": ([_P, _P, _P, _INT, _I, _I, _FLOAT, _INT, _P, _P], None),
    "silu_mul": ([_P, _INT, _I, _I, _INT, _P], None),
    "tiles_ready": ([], _INT),
    "tile_linear": ([_P, _P, _P, _I, _I, _I, _INT, _P], _INT),
    "rows_vectorized": ([], _INT),
    "row_columns": ([_P, _P, _P, _P, _I, _I, _I, _I, _I, _INT, _P], None),
    "row_rows": ([_P, _P, _P, _P, _I, _I, _INT, _P], None),
    "rows_bf16": ([], _INT),
    "row_rows_bf16": ([_P, _P, _P, _P, _I, _I, _INT, _P], None),
    "blocks": ([], _INT),
    "blocks_f32_linear": ([_P, _P, _P, _I, _I, _I, _INT, _P], _INT),
    "blocks_bf16_linear": ([_P, _P, _P, _I, _I, _I, _INT, _P], _INT),
    "blocks_i8_linear": ([_P, _P, _P, _I, _I, _I, _INT, _P], _INT),
    "blocks_screened_argmax": ([_P, _P, _P, _P, _I, _I, _INT], _I),
    "blocks_layers": ([_I, _P, _P, _P, _P, _INT, _FLOAT, _FLOAT, _INT, _INT, _P, _P, _P, _P], _INT),
    "rows_i8_vectorized": ([], _INT),
    "rows_i8": ([_P, _P, _P, _P, _P, _I, _I, _I, _INT, _P], None),
    "rows_i4_vectorized": ([], _INT),
    "rows_i4": ([_P, _P, _P, _P, _P, _I, _I, _I, _I, _INT, _P], None),
    "argmax_vectorized": ([], _INT),
    "argmax_rows": ([_P, _I, _I, _I, _INT, _P], None),
}


class KernelUnavailable(Exception):
    """Why the kernel is not used (turned off, no compiler, a compile error)."""


def _plain(t: torch.Tensor) -> bool:
    """What `rms_norm` and `silu_mul` read: a contiguous float32 or bfloat16 CPU tensor, no gradient to keep."""
    grad = torch.is_grad_enabled() and t.requires_grad
    return t.dtype in POOL_DTYPES and t.device.type == "cpu" and t.is_contiguous() and not grad


class PagedAttentionKernel:
    """The compiled kernels of the SOURCES, loaded from `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        library = ctypes.CDLL(str(path))
        # The C functions by name, unchecked: the methods below check their arguments (step_kernels.py a step's)
        self.unchecked: dict[str, Any] = {name: getattr(library, f"layerline_{name}") for name in SIGNATURES}
        for name, (argtypes, restype) in SIGNATURES.items():
            self.unchecked[name].argtypes, self.unchecked[name].restype = argtypes, restype
        self._fn, self._store = self.unchecked["paged_attention"], self.unchecked["rotate_and_store"]
        self._norm, self._silu = self.unchecked["rms_norm"], self.unchecked["silu_mul"]

    @staticmethod
    def takes_silu(gate_up: torch.Tensor) -> bool:
        """Whether `silu_mul` takes `gate_up`: a contiguous float32 or bfloat16 CPU tensor whose halves
        are a multiple of 32 wide (torch's vectorized loop covers them whole: no element on its
        scalar path, which takes e^x from another function), and nothing to differentiate."""
        width = gate_up.shape[-1] // 2 if gate_up.dim() else 0
        return width > 0 and width % 32 == 0 and gate_up.shape[-1] == 2 * width and _plain(gate_up)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`F.silu(gate) * up` of gate_up [..., 2 w] (its halves gate | up): [..., w], the numbers
        torch gives, in one call. ValueError unless `takes_silu`."""
        if not self.takes_silu(gate_up):
            raise ValueError(f"SiLU of {gate_up.dtype} {tuple(gate_up.shape)}: not taken")
        width = gate_up.shape[-1] // 2
        out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype)
        bf16 = gate_up.dtype == torch.bfloat16
        rows = gate_up.numel() // (2 * width)
        self._silu(gate_up.data_ptr(), bf16, rows, width, torch.get_num_threads(), out.data_ptr())
        return out

    @staticmethod
    def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` takes these: contiguous CPU tensors of one dtype (float32 or bfloat16), a
        weight [n] for rows of n >= 8 (torch sums shorter rows another way), and nothing to differentiate."""
        n = x.shape[-1] if x.dim() else 0
        return n >= 8 and weight.shape == (n,) and x.dtype == weight.dtype and _plain(x) and _plain(weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of x [..., n] with weight [n], the numbers llama.py's
        `rms_norm` gets from torch (float32; bfloat16 normalized in float32, cast, then scaled), in
        one call. ValueError unless `takes_norm`."""
        if not self.takes_norm(x, weight):
            raise ValueError(
                f"RMSNorm of {x.dtype} {tuple(x.shape)} by {weight.dtype} {tuple(weight.shape)}: not taken"
            )
        out = torch.empty_like(x)
        n = x.shape[-1]
        rows = x.numel() // n
        bf16 = x.dtype == torch.bfloat16
        self._norm(x.data_ptr(), weight.data_ptr(), bf16, rows, n, eps, torch.get_num_threads(), out.data_ptr())
        return out

    def rotate_and_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        slots: WriteSlots,
        *,
        heads: int,
    ) -> torch.Tensor:
        """Rotary on a step's queries and keys, qkv [n, heads + 2 kvh, d] (rows q | k | v), with
        cos and the signed sin [n, 1, d]; the rotated keys and the values written to pool rows
        `slots` of the [slots, kvh, d] pools. Returns the rotated queries [n, heads, d]. All one
        dtype (float32 or bfloat16), on the CPU, contiguous; the same numbers as torch's
        `qk * cos + swap_halves(qk) * sin` and `index_copy_`."""
        n, rows, d = qkv.shape
        pool_slots, kvh, pool_d = k_pool.shape
        if rows != heads + 2 * kvh or pool_d != d or d % 2 or v_pool.shape != k_pool.shape:
            raise ValueError(f"qkv {tuple(qkv.shape)} with {heads} heads and pools {tuple(k_pool.shape)} do not fit")
        if cos.shape != (n, 1, d) or sin.shape != cos.shape or slots.slots.shape != (n,):
            shapes = f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
            raise ValueError(f"{shapes} and {slots.slots.numel()} slots for {n} rows")
        if slots.pool_slots != pool_slots:
            raise ValueError(f"write slots checked against {slots.pool_slots} pool rows, not {pool_slots}")
        for t in (qkv, cos, sin, k_pool, v_pool):
            if t.dtype != qkv.dtype or t.dtype not in POOL_DTYPES or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("rotary takes contiguous float32 or bfloat16 CPU tensors, all of one dtype")
        q = torch.empty(n, heads, d, dtype=qkv.dtype)
        tensors = qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.slots.data_ptr()
        bf16, threads = qkv.dtype == torch.bfloat16, torch.get_num_threads()
        self._store(*tensors, bf16, n, heads, kvh, d, threads, q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr())
        return q

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        """Attention of one new token per sequence: q [n, h, d] over the [slots, kvh, d] pools
        (float32 or bfloat16, both alike), each sequence over its first `lens` positions, computed
        in float32. Returns [n, h * d] in q's dtype."""
        n, h, d = q.shape
        slots, kvh, pool_d = k_pool.shape
        if v_pool.shape != k_pool.shape or pool_d != d or slots != batch.slots or h % kvh:
            raise ValueError(f"q {tuple(q.shape)} and pools {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not fit")
        if n != batch.tables.shape[0]:
            raise ValueError(f"{n} queries for {batch.tables.shape[0]} sequences")
        for index in (batch.tables, batch.lens):
            if index.dtype != torch.int64 or index.device.type != "cpu" or not index.is_contiguous():
                raise ValueError("a batch's block tables and lengths must be contiguous int64 CPU tensors")
        for t in (q, k_pool, v_pool):
            if t.dtype not in POOL_DTYPES or t.device.type != "cpu":
                raise ValueError(f"the kernel takes float32 or bfloat16 CPU tensors, not {t.dtype} on {t.device}")
        if v_pool.dtype != k_pool.dtype:
            raise ValueError(f"key and value pools of unlike dtypes ({k_pool.dtype}, {v_pool.dtype})")
        if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            raise ValueError("the KV pools must be contiguous")
        q = q.contiguous()
        out = torch.empty(n, h * d, dtype=q.dtype)
        failed = self._fn(
            q.data_ptr(),
            q.dtype == torch.bfloat16,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            k_pool.dtype == torch.bfloat16,
            batch.tables.data_ptr(),
            batch.lens.data_ptr(),
            n,
            batch.tables.shape[1],
            batch.block,
            h,
            kvh,
            d,
            d**-0.5,
            torch.get_num_threads(),
            out.data_ptr(),
        )
        if failed:
            raise MemoryError(f"the attention kernel had no memory for {h} heads x {int(batch.lens.max())} scores")
        return out


def load() -> PagedAttentionKernel:
    """The kernel, compiled first if this machine's build is not in the cache; KernelUnavailable
    says why not. A `LAYERLINE_KERNELS` other than auto or torch is a ValueError: a stage refuses
    to start on it."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"{ENV}={choice!r}: must be 'auto' (compile the attention kernel) or 'torch'")
    if choice == "torch":
        raise KernelUnavailable(f"{ENV}=torch")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise KernelUnavailable("no C compiler (cc or gcc on PATH, or $CC)")
    try:
        version = _version(compiler)
        source = b"\0".join(path.read_bytes() for path in SOURCES)
        directory = _directory()
        errors: list[str] = []
        for flags in FLAG_SETS:
            key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu()])).hexdigest()
            path = directory / f"paged_attention-{key[:16]}.so"
            if not path.exists():
                error = _compile(compiler, flags, path)
                if error:
                    errors.append(f"{compiler} {' '.join(flags)}: {error}")
                    continue
                names = ", ".join(file.name for file in SOURCES)
                log.info("compiled %s with %s %s into %s", names, compiler, " ".join(flags), path)
            _own(path)
            kernel = PagedAttentionKernel(path)
            _one_openmp_runtime()
            return kernel
    except OSError as e:
        raise KernelUnavailable(str(e)) from e
    raise KernelUnavailable("compiling failed: " + "; ".join(errors))


def _version(compiler: str) -> str:
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{compiler} --version: {e}") from e
    if done.returncode != 0:
        raise KernelUnavailable(f"{compiler} --version exited with {done.returncode}")
    return done.stdout.strip()


def _cpu() -> bytes:
    """What a `-march=native` build depends on: the machine, and on Linux the CPU's model and flags."""
    described = [platform.machine()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                    described.append(line.strip())
                if not line.strip():
                    break  # the first CPU is enough: they are alike
    except OSError:
        pass
    return "\n".join(described).encode()


def _directory() -> Path:
    """$LAYERLINE_HOME/kernels, made if missing. Code is loaded from it, so it must be this user's
    and writable by nobody else (KernelUnavailable otherwise)."""
    directory = cache_root() / "kernels"
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    _own(directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise KernelUnavailable(f"{directory} cannot be written")
    return directory


def _own(path: Path) -> None:
    """KernelUnavailable unless `path` belongs to this process's user and only it may write it."""
    st = path.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise KernelUnavailable(f"{path} belongs to uid {st.st_uid} or others may write it: not loaded")


def _one_openmp_runtime() -> None:
    """KernelUnavailable if the process now maps two OpenMP runtimes: the kernel brought its own
    libgomp (torch's wheel names its copy otherwise), whose team would compete with torch's."""
    try:
        with open(MAPS, encoding="utf-8", errors="replace") as f:
            runtimes = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
    except OSError:
        return  # not Linux: nothing to check against
    if len(runtimes) > 1:
        raise KernelUnavailable(f"two OpenMP runtimes in the process ({', '.join(sorted(runtimes))})")


def _compile(compiler: str, flags: tuple[str, ...], path: Path) -> str | None:
    """Compile the SOURCES into `path` (written whole or not at all); the compiler's complaint if it fails.
    The compiler runs in a session of its own, so that a timeout kills its linker too."""
    fd, partial = tempfile.mkstemp(prefix=path.stem + "-", suffix=".so.partial", dir=path.parent)
    os.close(fd)
    try:
        with subprocess.Popen(
            [compiler, *flags, "-o", partial, *map(str, SOURCES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as process:
            try:
                out, err = process.communicate(timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                return f"no result after {COMPILE_TIMEOUT_S:.0f} s"
        if process.returncode != 0:
            lines = (err or out).strip().splitlines()
            return lines[-1] if lines else f"exit status {process.returncode}"
        os.replace(partial, path)  # concurrent stages each write their own file; the last rename wins, whole
        return None
    except OSError as e:
        return str(e)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
