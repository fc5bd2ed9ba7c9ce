"""`layerline up`: a whole cluster on this machine, each worker and the coordinator its own process.

Owns splitting the layers into stages of equal work (the LM head's share measured on this
machine by stage_worker/step_cost.py, in a process of its own), dividing the CPU cores between
co-located workers, the command line of the coordinator and of every stage worker (the same telemetry
flags for all, a metrics port each; ports fixed at the first start, so that a restart serves
where its predecessor did), waiting until the coordinator reports every chain complete, and
keeping the processes running until a signal. Starting, restarting and stopping them is the
supervisor's (`layerline.supervisor`). Imports neither torch nor the model code.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerline.client import Client, ClusterStatus, LayerlineError
from layerline.coordinator.settings import CoordinatorSettings
from layerline.model_store import cache_root
from layerline.shared.certs import CertFiles, write_cluster_certs
from layerline.shared.cpu import cpu_name
from layerline.shared.model_config import ModelConfig
from layerline.shared.ports import free_port, reserve
from layerline.shared.settings import format_size
from layerline.stage_worker.settings import StageSettings
from layerline.supervisor import Command, RestartPolicy, Supervisor

SPLITS = ("measured", "weights")  # how `up` splits the layers without --layers (ClusterPlan.split)
MEASURE_TIMEOUT_S = 300.0  # measuring a step's cost (a few seconds) never holds a start longer
STEP_COSTS = "step-costs.json"  # in the cache directory: what a step costs, per model shape and machine
STEP_COST_METHOD = 4  # step_cost.py's way of measuring, or the engine's (4: the layer stack); a new one measures anew


@dataclass(frozen=True)
class ClusterPlan:
    model: str  # checkpoint directory or known model name
    stages: int = 2  # pipeline stages per chain
    replicas: int = 1  # chains side by side
    tp: int = 1  # tensor-parallel ranks per stage
    dtype: str = StageSettings.dtype  # every stage worker's --dtype
    quantize: str = StageSettings.quantize  # every stage worker's --quantize
    port: int = CoordinatorSettings.port  # coordinator port
    host: str = "127.0.0.1"
    kv_memory: str = format_size(StageSettings.kv_memory_bytes)  # per stage worker
    log_dir: Path | None = None  # where each process's log goes; default: a temp folder
    layer_ranges: tuple[tuple[int, int], ...] | None = None  # explicit (uneven) split; default: by `split`
    split: str = "measured"  # without layer_ranges: "measured" (step_cost.py) or "weights" (bytes of the head)
    # Micro-batches in flight per chain (the coordinator's --depth). A local chain's stages share
    # this machine's cores, and a step alone on its chain computes on all of them: one micro-batch
    # at a time beat one per stage at every load measured (AMD EPYC, 2 cores, 2 stages: 4, 8 and
    # 32 streams at 57, 94 and 206 tok/s against 42, 69 and 170; one stage 60, 100 and 220).
    # Pipelining pays where stages have cores of their own, or links whose delay it hides.
    depth: int = 1
    coordinator_args: tuple[str, ...] = ()  # extra `layerline coordinator` flags
    stage_args: tuple[str, ...] = ()  # extra `layerline stage` flags, for every stage worker
    threads: int | None = None  # torch threads per stage worker; default: the cores shared out
    trace: str = "off"  # every process's --trace: off, console or otlp
    otlp_endpoint: str | None = None  # every process's --otlp-endpoint
    metrics_port: int = 0  # the coordinator's --metrics-port; stage workers take the next ones; 0: none
    health_ports: bool = False  # every process also serves plaintext health on a free --health-port
    cluster_port: int | None = None  # the coordinator's --cluster-port (stages register there); None: a free one
    http_port: int | None = None  # the coordinator's --http-port (the OpenAI-compatible API); None: off
    tls: bool = False  # TLS everywhere: a throwaway CA and certificates in the run directory's tls/
    api_tokens: str | None = None  # the coordinator's --api-tokens file
    admin_tokens: str | None = None  # its --admin-tokens file; with tokens but none, the run directory gets one
    restarts: RestartPolicy = RestartPolicy()  # how `supervise` restarts a process that exits, and when it gives up


def split_layers(num_layers: int, stages: int, *, head_weight: float = 0.0) -> list[tuple[int, int]]:
    """Half-open ranges of about equal work.

    The last stage also runs the LM head, which costs as much as `head_weight` layers, so it
    takes that many layers fewer; with no head weight the split is even. A chain runs at the
    pace of its slowest stage, so equal work is what keeps every stage busy.
    """
    if not 1 <= stages <= num_layers:
        raise ValueError(f"--stages {stages} must be between 1 and the model's {num_layers} layers")
    share = (num_layers + head_weight) / stages
    bounds = [0]
    for i in range(1, stages):
        cut = int(i * share + 0.5)
        bounds.append(max(bounds[-1] + 1, min(cut, num_layers - (stages - i))))
    bounds.append(num_layers)
    return list(itertools.pairwise(bounds))


def measured_step_cost(
    checkpoint: Path, *, threads: int, dtype: str, quantize: str = "none", cache: Path | None = None
) -> dict[str, Any]:
    """What a decode step's layer and LM head cost on this machine (stage_worker/step_cost.py's
    StepCost as a dict, with when it was measured), measured in a process of its own: the launcher
    never imports torch. It is measured once per model shape, thread count, dtype, quantization and
    machine (CPU model and count) and kept in `STEP_COSTS` in the cache directory, so that only a
    machine's first `up` of a model waits the 5-10 s it takes; remove that file to measure again."""
    key = _step_cost_key(checkpoint, threads=threads, dtype=dtype, quantize=quantize)
    path = (cache or cache_root()) / STEP_COSTS
    known = _read_costs(path)
    if key in known:
        return known[key]
    argv = [sys.executable, "-m", "layerline.stage_worker.step_cost", "--model", str(checkpoint)]
    argv += ["--threads", str(threads), "--dtype", dtype, "--quantize", quantize]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring a step's cost failed: {done.stderr.strip()[-2000:]}")
    cost = json.loads(done.stdout) | {"measured_at": datetime.datetime.now().isoformat(timespec="seconds")}
    known = _read_costs(path) | {key: cost}  # another process may have added its own meanwhile
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    partial.replace(path)  # whole or not at all, for a reader in another process
    return cost


def _step_cost_key(checkpoint: Path, *, threads: int, dtype: str, quantize: str) -> str:
    """What a step's cost depends on: the model's shapes (its config, not its weights), the
    stages' threads, dtype and quantization, and the machine."""
    machine = [platform.machine(), os.cpu_count(), cpu_name()]
    parts = [STEP_COST_METHOD, (checkpoint / "config.json").read_text(), threads, dtype, quantize, machine]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def _read_costs(path: Path) -> dict[str, dict[str, Any]]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and written anew
    return known if isinstance(known, dict) else {}


def _first_token(path: str) -> str:
    """The first token of a tokens file (one per line; # starts a comment)."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return next(line for line in lines if line and not line.startswith("#"))


def _free_port(host: str) -> int:
    return free_port(host)


class LocalCluster:
    def __init__(self, plan: ClusterPlan, checkpoint: Path) -> None:
        self.plan = plan
        self.checkpoint = checkpoint
        self.address = f"{plan.host}:{plan.port}"
        # The ports the user gave (here and the metrics ports below) are not free for the ports
        # chosen after them: their processes bind later.
        reserve(plan.port, plan.http_port or 0, plan.cluster_port or 0)
        config = ModelConfig.from_checkpoint(checkpoint)
        if plan.split not in SPLITS:
            raise ValueError(f"split {plan.split!r} is not one of {', '.join(SPLITS)}")
        if plan.depth < 1:
            raise ValueError(f"--depth {plan.depth}: micro-batches in flight per chain must be at least 1")
        workers = (len(plan.layer_ranges) if plan.layer_ranges else plan.stages) * plan.replicas
        self.threads = plan.threads or max(1, (os.cpu_count() or 1) // (workers * plan.tp))
        # A chain's stages take turns on a lone stream or a single prompt: a step alone on its
        # chain gets the cores of a chain.
        self.chain_threads = plan.threads or max(self.threads, (os.cpu_count() or 1) // (plan.replicas * plan.tp))
        self.head_weight = config.head_weight  # in layers, by the bytes of its weight, unless measured
        self.split_note = ""  # how the split was chosen, for `up` to print
        if plan.layer_ranges:
            self.ranges = list(plan.layer_ranges)
        else:
            if plan.split == "measured" and 1 < plan.stages and config.num_layers >= 3:
                cost = measured_step_cost(checkpoint, threads=self.threads, dtype=plan.dtype, quantize=plan.quantize)
                self.head_weight = cost["head_weight"]
                self.split_note = (
                    f"measured on {cost['threads']} thread(s), {cost['rows']} sequences a step: a layer "
                    f"{cost['layer_ms']:.2f} ms, the LM head and sampling {self.head_weight:.1f} layers' worth "
                    f"(at {cost.get('measured_at', 'an unknown time')}; kept in {cache_root() / STEP_COSTS})"
                )
            self.ranges = split_layers(config.num_layers, plan.stages, head_weight=self.head_weight)
        if plan.metrics_port and plan.metrics_port + workers > 65535:
            raise ValueError(
                f"--metrics-port {plan.metrics_port}: the {workers} stage workers need the ports "
                f"up to {plan.metrics_port + workers}, past 65535"
            )
        if plan.metrics_port:  # the coordinator's and then each stage worker's
            reserve(*range(plan.metrics_port, plan.metrics_port + workers + 1))
        # The OpenAI-compatible API's port (0: a free one) and base URL, with --http-port.
        self.http_port = None if plan.http_port is None else plan.http_port or _free_port(plan.host)
        scheme = "https" if plan.tls else "http"
        self.http_url = f"{scheme}://{plan.host}:{self.http_port}/v1" if self.http_port is not None else None
        self.supervisor = Supervisor(plan.restarts)
        self.metrics_ports: dict[str, int] = {}  # process name -> its Prometheus port, when metrics are on
        self.health_ports: dict[str, int] = {}  # process name -> its plaintext health port, with health_ports
        self.log_dir = plan.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"layerline-{os.getpid()}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cluster_address = f"{plan.host}:{plan.cluster_port or _free_port(plan.host)}"
        self.certs: CertFiles | None = None  # with `tls`, made at start
        self.admin_tokens = plan.admin_tokens
        if plan.api_tokens and not plan.admin_tokens:  # `up` itself needs ClusterStatus
            self.admin_tokens = str(self.log_dir / "admin-tokens")
            Path(self.admin_tokens).write_text(secrets.token_urlsafe(24) + "\n")
            os.chmod(self.admin_tokens, 0o600)
        # What a client of this cluster needs: an admin token (when tokens are on) and the CA.
        self.token = _first_token(self.admin_tokens) if self.admin_tokens else None

    @property
    def ca_cert(self) -> Path | None:
        """The CA a client trusts to reach this cluster over TLS (None: plaintext)."""
        return self.certs.ca if self.certs is not None else None

    def client(self) -> Client:
        """A client of this cluster's coordinator, with its CA and an admin token as needed."""
        return Client(self.address, token=self.token, ca_cert=self.ca_cert)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """Each process's name and its current OS process (after a restart, the new one)."""
        return list(self.supervisor.processes.items())

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.supervisor.start(
            Command(
                name,
                (sys.executable, "-m", "layerline", *args),
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                log=self.log_dir / f"{name}.log",
            )
        )

    def start(self) -> None:
        p = self.plan
        if p.tls:
            self.certs = write_cluster_certs(self.log_dir / "tls", [p.host], force=True)
        threads, prefill_threads = self.threads, self.chain_threads
        self._spawn(
            "coordinator",
            [
                "coordinator",
                "--model",
                str(self.checkpoint),
                "--host",
                p.host,
                "--port",
                str(p.port),
                "--cluster-port",
                self.cluster_address.rpartition(":")[2],
                *(["--http-port", str(self.http_port)] if self.http_port is not None else []),
                *self._tls_args("coordinator"),
                *self._token_args(),
                "--depth",
                str(p.depth),
                *p.coordinator_args,
                *self._telemetry_args("coordinator"),
            ],
            {},
        )
        for r in range(p.replicas):
            for start, end in self.ranges:
                name = f"stage-r{r}-{start}-{end}"
                args = [
                    "stage",
                    "--model",
                    str(self.checkpoint),
                    "--layers",
                    f"{start}:{end}",
                    "--host",
                    p.host,
                    "--port",
                    str(_free_port(p.host)),
                    "--coordinator",
                    self.cluster_address,
                    *self._tls_args("stage"),
                    "--dtype",
                    p.dtype,
                    "--quantize",
                    p.quantize,
                    "--threads",
                    str(threads),
                    "--prefill-threads",
                    str(prefill_threads),
                    "--kv-memory",
                    p.kv_memory,
                    *p.stage_args,
                    *self._telemetry_args(name),
                ]
                if p.tp > 1:
                    args += ["--tp", str(p.tp)]
                self._spawn(name, args, self.stage_env())

    def stage_env(self) -> dict[str, str]:
        """The environment a stage worker starts with, beside this process's.

        Its threads; and, where one chain's stages take turns on the same cores (one replica, no
        tensor parallelism, one micro-batch at a time) with two threads or more, its OpenMP
        threads bound to cores in order (`OMP_PROC_BIND=close`, `OMP_PLACES=cores`), unless this
        environment sets either. Unbound, a worker that slept between two steps was woken onto
        the core its team's first thread spins on and waited there: on 2 cores of an Intel Xeon (a
        Firecracker VM) one parallel product took 741-831 us after a pause of 3-20 ms, and 86-152 us
        bound; a lone stream on 2 stages decoded at 31.6-32.4 tok/s unbound and 32.6-33.1 bound (1
        stage: 34.0-35.2 both), 32 streams at 342-350 and 351-354 tok/s (1 stage: 364-365 and
        374-375). Every stage of the chain binds to the same cores: they compute in turn. Not
        where stages compute at once."""
        p = self.plan
        env = {"OMP_NUM_THREADS": str(self.threads)}
        takes_turns = p.replicas == 1 and p.tp == 1 and p.depth == 1 and self.chain_threads >= 2
        if takes_turns and not {"OMP_PROC_BIND", "OMP_PLACES"} & os.environ.keys():
            env |= {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
        return env

    def _tls_args(self, role: str) -> list[str]:
        return self.certs.flags(role) if self.certs is not None else []

    def _token_args(self) -> list[str]:
        args = ["--api-tokens", self.plan.api_tokens] if self.plan.api_tokens else []
        return args + (["--admin-tokens", self.admin_tokens] if self.admin_tokens else [])

    def _telemetry_args(self, name: str) -> list[str]:
        """The telemetry flags of process `name`: with metrics, each process takes the next port;
        with health ports, a free one."""
        p = self.plan
        args = ["--trace", p.trace]
        if p.otlp_endpoint:
            args += ["--otlp-endpoint", p.otlp_endpoint]
        if p.metrics_port:
            self.metrics_ports[name] = p.metrics_port + len(self.metrics_ports)
            args += ["--metrics-port", str(self.metrics_ports[name])]
        if p.health_ports:
            self.health_ports[name] = _free_port(p.host)
            args += ["--health-port", str(self.health_ports[name])]
        return args

    def wait_ready(self, timeout: float = 300.0) -> ClusterStatus:
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                for name, proc in self.procs:
                    if proc.poll() is not None:
                        tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail}")
                try:
                    status = client.cluster(timeout=2)
                    if len(status.chains) >= self.plan.replicas:
                        return status
                except LayerlineError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"the cluster was not ready after {timeout:.0f}s; logs in {self.log_dir}")

    def stop(self, grace: float = 15.0) -> None:
        """Stop every process (the current one of each name): SIGTERM, then SIGKILL after `grace` s."""
        self.supervisor.stop(grace)

    def supervise(self, *, every: float = 0.2) -> None:
        """Keep every process running until SIGTERM or SIGINT arrives.

        A process that exits is started again from the same command line (same layers, same
        ports) after a backoff; the plan's `restarts` says how. Raises `CrashLoop` for a process
        that exits too often; the caller stops the others."""
        stop = {"now": False}

        def on_signal(signum: int, frame: object) -> None:
            stop["now"] = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop["now"]:
            self.supervisor.poll()
            time.sleep(every)
