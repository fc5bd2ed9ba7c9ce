"""Starting and stopping the ranks of a tensor-parallel stage on one node.

Owns the process side of tensor parallelism: rank 0 (the process the user started) spawns one
process per other rank and hands it the stage's settings as JSON; every rank joins one
`torch.distributed` process group (NCCL on CUDA, gloo on CPU), with a generous wait for the
ranks to start and a short collective timeout after; and a rank whose leader dies is killed
with it (Linux parent-death signal). Fail-stop decisions are the caller's: this module only
says which ranks are gone.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from .parallel import TensorParallel

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
JOIN_TIMEOUT_S = 120.0  # how long the ranks of a stage may take to start and meet (join_group)
_JOINED = "layerline/joined/"  # + a rank: that rank reached the store


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


def join_group(
    *,
    rank: int,
    size: int,
    master: str,
    timeout_s: float,
    device: str,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    gone: Callable[[], list[int]] = list,
) -> TensorParallel:
    """Join the stage's process group: first wait, up to `join_timeout_s`, until every rank has
    reached rank 0's store at `master` (`gone`: the ranks whose process exited meanwhile, which
    fail the join at once); from then on a collective that waits longer than `timeout_s` raises.

    Starting a rank is starting a Python process that imports torch: on a loaded machine (the
    bench starting four clusters at once) that took longer than the collectives' 10 s, and
    torch's own rendezvous waits for the other ranks no longer than the collectives' timeout."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    host, port = master.rsplit(":", 1)
    wait = datetime.timedelta(seconds=join_timeout_s)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=wait, wait_for_workers=False)
    store.set(f"{_JOINED}{rank}", "1")
    deadline = time.monotonic() + join_timeout_s
    while missing := [r for r in range(size) if not store.check([f"{_JOINED}{r}"])]:
        if exited := gone():
            raise RuntimeError(f"rank(s) {exited} of this tensor-parallel stage exited before joining its group")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank(s) {missing} of this tensor-parallel stage did not join its group within {join_timeout_s:g} s"
            )
        time.sleep(0.05)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))  # what torch sets on a store it makes itself
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
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
