"""Starting and stopping the ranks of a tensor-parallel stage on one node.

Owns the process side of tensor parallelism: rank 0 (the process the user started) spawns one
process per other rank and hands it the stage's settings as JSON, every rank joins one `torch.distributed`
process group (NCCL on CUDA, gloo on CPU) with a short collective timeout, and a rank whose
leader dies is killed with it (Linux parent-death signal). Fail-stop decisions are the
caller's: this module only says which ranks are gone.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import torch.distributed as dist

from .parallel import TensorParallel

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def spawn_followers(settings_json: str, *, size: int, master: str) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1 .. size-1 as processes that follow rank 0 (`stage_worker.follower`); each
    reads the stage's settings, `settings_json`, on its standard input."""
    followers = []
    for rank in range(1, size):
        proc = subprocess.Popen(
            [sys.executable, "-m", "layerline.stage_worker.follower", "--rank", str(rank), "--master", master],
            stdin=subprocess.PIPE,
        )
        assert proc.stdin is not None
        proc.stdin.write(settings_json.encode())
        proc.stdin.close()
        followers.append(proc)
    return followers


def join_group(*, rank: int, size: int, master: str, timeout_s: float, device: str) -> TensorParallel:
    """Join the stage's process group; a collective that waits longer than `timeout_s` raises."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank=rank, size=size, group=dist.group.WORLD)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        log.warning("cannot ask to die with rank 0 on this system; relying on the collective timeout")
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def gone(followers: Sequence[subprocess.Popen[bytes]]) -> list[int]:
    """Ranks (1-based positions) whose process has exited."""
    return [i + 1 for i, p in enumerate(followers) if p.poll() is not None]


def stop_followers(followers: Sequence[subprocess.Popen[bytes]], *, grace: float) -> None:
    for p in followers:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
