"""`layerline up` supervises: the command itself, as a user runs it, on a tiny model.

A stage worker or the coordinator SIGKILLed under `up` comes back on its port while the cluster
keeps serving; a process that crash-loops stops `up`, which says which and why; SIGTERM during
a restart's delay stops everything.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from layerline.client import AsyncClient, Client, ClusterStatus, LayerlineError

from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.cluster

PROMPTS = [f"Chapter {i + 1}. Once upon a time, in a village by the sea," for i in range(8)]
TOKENS = 32


class Up:
    """`python -m layerline up ...` as a user starts it; its run directory (logs) under `tmp`."""

    def __init__(self, tmp: Path, model: Path, *flags: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.out, self.err = tmp / "up.out", tmp / "up.err"
        self.seen: set[int] = set()  # every process `up` was seen to run
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layerline", "up", "--model", str(model), "--port", str(self.port), *flags],
                stdout=out,
                stderr=err,
                env={**os.environ, "TMPDIR": str(tmp)},  # where `up` puts its run directory
            )

    def said(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_for(self, what: Callable[[], object], timeout: float, why: str) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := what():
                return found
            time.sleep(0.1)
        raise AssertionError(f"{why}: not within {timeout:.0f}s; up said:\n{self.said()[-3000:]}")

    def wait_ready(self) -> None:
        self.wait_for(
            lambda: "layerline ready on" in self.out.read_text() or self.proc.poll() is not None, 180, "ready"
        )
        assert self.proc.poll() is None, self.said()

    @property
    def log_dir(self) -> Path:
        found = re.search(r"logs in (\S+)\)", self.said())
        assert found is not None
        return Path(found.group(1))

    def children(self) -> dict[int, str]:
        """pid -> command line of each process `up` runs now."""
        pids = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        found = {}
        for pid in map(int, pids):
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except FileNotFoundError:
                pass
        self.seen |= found.keys()
        return found

    def status(self) -> ClusterStatus | None:
        try:
            with Client(self.address) as client:
                return client.cluster(timeout=2)
        except LayerlineError:
            return None

    def whole(self, workers: int, chains: int) -> ClusterStatus | None:
        """The status when `workers` workers serve and `chains` chains are complete, else None."""
        status = self.status()
        if status is None or len(status.chains) != chains:
            return None
        serving = [w for w in status.workers if w.state == "SERVING"]
        return status if len(serving) == len(status.workers) == workers else None

    def stop(self) -> int:
        """SIGTERM, as a user's Ctrl-C or a service manager; `up`'s exit code. Nothing it ran is left."""
        self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        left = [pid for pid in self.seen if _alive(pid)]
        for pid in left:
            os.killpg(pid, signal.SIGKILL)
        assert not left, f"up left {left} running"
        return code


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tiny(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Callable[[str], list[int]]]:
    """A tiny random SmolLM2-shaped checkpoint with SmolLM2's tokenizer, and transformers' greedy on it."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny") / "model"
    hf = make_tiny_checkpoint("smollm2", path, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, path / name)
    tok = AutoTokenizer.from_pretrained(path)

    def greedy(prompt: str) -> list[int]:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
        got = out[0, len(ids) :].tolist()
        return got[: got.index(2) + 1] if 2 in got else got  # the cluster ends at the end-of-sequence id

    return path, greedy


@pytest.fixture(scope="module")
def up(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`up --stages 2 --replicas 2` on the tiny model; stopped (and checked to exit 0) at the end."""
    cluster = Up(tmp_path_factory.mktemp("up"), tiny[0], "--stages", "2", "--replicas", "2", "--kv-memory", "32M")
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        code = cluster.stop()
    assert code == 0, cluster.said()[-3000:]


async def _streams(address: str, *, on_token: Callable[[int], None], prompts: list[str] = PROMPTS) -> list[list[int]]:
    async with AsyncClient(address) as client:

        async def one(prompt: str) -> list[int]:
            ids: list[int] = []
            async for chunk in client.stream(prompt, max_tokens=TOKENS, temperature=0.0):
                ids += chunk.token_ids
                on_token(len(ids))
            return ids

        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.timeout(300)
def test_a_stage_worker_killed_under_up_comes_back_while_the_cluster_keeps_serving(up: Up, tiny) -> None:
    _, greedy = tiny
    before = up.wait_for(lambda: up.whole(4, 2), 60, "4 workers, 2 chains")
    assert isinstance(before, ClusterStatus)
    victim_address = before.chains[0].addresses[-1]  # a last stage: the one that samples
    victim = next(w for w in before.workers if w.address == victim_address)
    killed: list[float] = []

    def kill_once(tokens: int) -> None:
        if not killed and tokens >= 4:  # mid-stream, streams of both chains running
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    got = asyncio.run(_streams(up.address, on_token=kill_once))
    assert killed
    assert got == [greedy(p) for p in PROMPTS]  # every stream completes, no token lost or repeated

    # `up` said what happened, and the worker is back on its address, in a chain, serving.
    said = up.wait_for(lambda: re.search(r"(stage-r\d-\d+-\d+) restarted \(pid (\d+), restart 1\)", up.said()), 30, "")
    assert isinstance(said, re.Match)
    name, pid = said.group(1), int(said.group(2))
    assert f"{name} exited with status -9 (SIGKILL); restarting in 0.5s" in up.said()
    after = up.wait_for(lambda: up.whole(4, 2), 60, "the worker back: 4 workers, 2 chains")
    assert isinstance(after, ClusterStatus)
    back = next(w for w in after.workers if w.address == victim_address)
    assert back.pid == pid != victim.pid
    assert victim_address in [a for chain in after.chains for a in chain.addresses]
    assert after.failovers >= 1
    log = (up.log_dir / f"{name}.log").read_text()
    assert f"--- layerline up: restart 1 of {name} after exit status -9 (SIGKILL) ---" in log
    assert f"serving on {victim_address}" in log.split("--- layerline up: restart 1")[1]

    # It is routed to again: new streams go to both chains, and the restarted worker computes their steps.
    # (New prompts, each with its own first token: the answers to the first ones stay cached on the
    # chain that served them, and routing by cache would send prompts sharing a prefix to one chain.)
    fresh = [f"{i + 1} winds came down from the hills" for i in range(len(PROMPTS))]
    assert asyncio.run(_streams(up.address, on_token=lambda tokens: None, prompts=fresh)) == [greedy(p) for p in fresh]

    def steps_since_back() -> int:  # as of the worker's last heartbeat (one a second)
        status = up.status()
        worker = next((w for w in status.workers if w.address == victim_address), None) if status else None
        return worker.load.steps_computed - back.load.steps_computed if worker else 0

    up.wait_for(lambda: steps_since_back() >= 10, 10, "the restarted worker's steps")  # more than its probes


@pytest.mark.timeout(300)
def test_the_coordinator_killed_under_up_comes_back_and_every_worker_registers_again(up: Up, tiny) -> None:
    _, greedy = tiny
    up.wait_for(lambda: up.whole(4, 2), 60, "4 workers, 2 chains")
    coordinator = next(pid for pid, cmd in up.children().items() if " coordinator " in cmd)
    os.kill(coordinator, signal.SIGKILL)
    killed = time.monotonic()
    said = up.wait_for(lambda: re.search(r"coordinator restarted \(pid (\d+)", up.said()), 30, "restarted")
    assert isinstance(said, re.Match)
    assert "coordinator exited with status -9 (SIGKILL); restarting in 0.5s" in up.said()
    assert int(said.group(1)) in up.children()
    # On the same port, with every stage worker registered again by itself.
    status = up.wait_for(lambda: up.whole(4, 2), 60, "every worker registered again")
    assert isinstance(status, ClusterStatus)
    print(f"the coordinator served again, with its 4 workers, {time.monotonic() - killed:.1f}s after the kill")
    with Client(up.address) as client:
        assert client.generate(PROMPTS[0], max_tokens=TOKENS, temperature=0.0).token_ids == greedy(PROMPTS[0])


def _crash_loop(tmp_path: Path, tiny, *flags: str) -> tuple[Up, str]:  # type: ignore[no-untyped-def]
    """`up` of one stage worker whose restarts all fail: the checkpoint is gone when it is killed.

    Returns `up` and the name of the stage, once `up` said that it will restart it a third time."""
    model = tmp_path / "model"
    shutil.copytree(tiny[0], model)
    up = Up(tmp_path, model, "--stages", "1", "--kv-memory", "32M", *flags)
    try:
        up.wait_ready()
        stage = next(pid for pid, cmd in up.children().items() if " stage " in cmd)
        model.rename(tmp_path / "gone")
        os.kill(stage, signal.SIGKILL)
        up.wait_for(lambda: "restarting in 2s" in up.said() or up.proc.poll() is not None, 60, "a third exit")
    except BaseException:
        up.stop()
        raise
    return up, "stage-r0-0-4"


@pytest.mark.timeout(300)
def test_up_gives_up_on_a_crash_loop_and_says_which_process_and_why(tmp_path: Path, tiny) -> None:
    up, name = _crash_loop(tmp_path, tiny, "--max-restarts", "3")
    try:
        code = up.proc.wait(60)
    finally:
        up.stop()
    said = up.said()
    assert code == 2, said
    assert [line for line in said.splitlines() if line.startswith(f"layerline up: {name} exited")] == [
        f"layerline up: {name} exited with status -9 (SIGKILL); restarting in 0.5s",
        f"layerline up: {name} exited with status 2; restarting in 1s",
        f"layerline up: {name} exited with status 2; restarting in 2s",
    ]
    error = said[said.index("error: ") :]
    assert error.startswith(
        f"error: {name} exited 4 times within 120s, the last time with status 2: a crash loop "
        "(a process is restarted at most 3 times within 120s); the end of its log "
    )
    assert "is neither a checkpoint directory" in error  # why its restarts fail
    assert "stopping ..." in said[: said.index("error: ")]
    assert "coordinator exited" not in said  # the coordinator was stopped, never restarted


@pytest.mark.timeout(300)
def test_sigterm_while_up_starts_stops_every_process_it_started(tmp_path: Path, tiny) -> None:
    up = Up(tmp_path, tiny[0], "--stages", "2", "--replicas", "2", "--kv-memory", "8M")
    up.wait_for(lambda: len(up.children()) == 5, 60, "5 processes started")
    assert "layerline ready on" not in up.out.read_text()
    code = up.stop()  # asserts that nothing it ran is left
    assert code != 0 and "Traceback" not in up.said(), up.said()


def test_sigterm_during_a_restart_delay_stops_everything_at_once(tmp_path: Path, tiny) -> None:
    up, name = _crash_loop(tmp_path, tiny)  # --max-restarts 5: a fourth start is due in 2 s
    start = time.monotonic()
    code = up.stop()
    elapsed = time.monotonic() - start
    said = up.said()
    assert code == 0, said
    assert elapsed < 10
    assert f"{name} restarted (pid" in said and "restart 3)" not in said
    assert said.rstrip().endswith("stopping ...")


def test_up_runs_one_micro_batch_at_a_time_on_its_shared_cores_unless_told(up: Up, tiny, capsys) -> None:
    """`up`'s chains share this machine's cores: its coordinator runs --depth 1 (see ClusterPlan.depth),
    `up --depth N` says otherwise, and a depth below 1 is refused before anything starts."""
    from layerline.cli import main

    coordinators = [c for c in up.children().values() if " coordinator " in c]
    assert len(coordinators) == 1 and " --depth 1 " in coordinators[0] + " "
    assert main(["up", "--model", str(tiny[0]), "--depth", "0"]) == 2
    assert "--depth 0: micro-batches in flight per chain must be at least 1" in capsys.readouterr().err


def test_up_passes_its_prefix_flags_to_the_coordinator(up: Up, tiny, capsys) -> None:
    """`up` and `run` take the coordinator's --no-prefix-sharing and --prefix-cache and hand them to
    the coordinator they start (the default: sharing on, the coordinator's cache share); a share
    that is no fraction is refused before anything starts."""
    from layerline.cli import build_parser, main
    from layerline.cli.cluster import _coordinator_args
    from layerline.coordinator.settings import CoordinatorSettings

    coordinators = [c for c in up.children().values() if " coordinator " in c]
    assert len(coordinators) == 1
    assert f" --prefix-cache {CoordinatorSettings.prefix_cache} " in coordinators[0] + " "
    assert "--no-prefix-sharing" not in coordinators[0]
    for command in ("up", "run"):
        given = [command, "--no-prefix-sharing", "--prefix-cache", "0", *(["hi"] if command == "run" else [])]
        args = _coordinator_args(build_parser().parse_args(given))
        assert args == ("--speculate", "0", "--prefix-cache", "0.0", "--no-prefix-sharing"), command
    with pytest.raises(SystemExit) as refused:
        main(["up", "--model", str(tiny[0]), "--prefix-cache", "1"])
    assert refused.value.code == 2
    assert "--prefix-cache: '1' is not a fraction from 0 up to (not including) 1" in capsys.readouterr().err


def test_a_chain_whose_stages_take_turns_on_the_cores_binds_their_openmp_threads(tiny, monkeypatch) -> None:
    """One replica, no tensor parallelism, one micro-batch at a time, two threads or more: each
    stage worker starts with its OpenMP threads bound to cores in order (LocalCluster.stage_env);
    not where stages compute at once or alone on one thread, and never over the user's own."""
    from layerline.launcher import ClusterPlan, LocalCluster

    monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    monkeypatch.delenv("OMP_PLACES", raising=False)

    def env(**plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
        return LocalCluster(ClusterPlan(model=str(tiny[0]), **{"threads": 2, **plan}), tiny[0]).stage_env()

    bound = {"OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    assert env() == bound
    for unbound in ({"replicas": 2}, {"depth": 2}, {"tp": 3}, {"threads": 1}):
        assert env(**unbound) == {"OMP_NUM_THREADS": str(unbound.get("threads", 2))}, unbound
    monkeypatch.setenv("OMP_PROC_BIND", "false")  # the user's: the stage inherits it as it is
    assert env() == {"OMP_NUM_THREADS": "2"}
