"""Keeping a set of OS processes running: what makes `layerline up` a supervisor.

Owns starting each process from a command fixed at its first start (argv, environment, log
file), noticing when one exits, starting it again from the same command after an exponential
backoff (its log appended to, with a line that says which restart and why), giving up on a
process that exits too often (`CrashLoop` names it, its last exit status and the end of its
log), and stopping them all (SIGTERM, then, after a grace period, SIGUSR1 for the stacks of a
process still running and SIGKILL). Knows nothing of what the processes are: the launcher says
what to run. One thread polls and stops; no locking.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Command", "CrashLoop", "RestartPolicy", "Supervisor", "exit_status"]

STACKS_WAIT = 1.0  # seconds a process that outlived its grace gets to write its stacks before SIGKILL


@dataclass(frozen=True)
class Command:
    name: str  # how the events and the log name the process
    argv: tuple[str, ...]  # the whole command line, the same at every restart (ports included)
    env: dict[str, str]  # the whole environment
    log: Path  # stdout and stderr; the first start truncates it, a restart appends


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # exits of one process allowed within `window`; one more is a crash loop (0: none)
    window: float = 120.0  # seconds over which exits are counted
    first_delay: float = 0.5  # seconds before the first restart; doubled after each quick exit
    max_delay: float = 15.0  # the delay's cap, in seconds
    stable_after: float = 60.0  # a process that ran this long (seconds) is restarted after `first_delay` again

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts} must be 0 or more")
        if not 0 < self.first_delay <= self.max_delay:
            raise ValueError(f"restart delays: need 0 < first ({self.first_delay}) <= max ({self.max_delay})")


def exit_status(code: int) -> str:
    """An exit status as a person reads it: `1`, or `-9 (SIGKILL)` for a process a signal ended."""
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return str(code)


class CrashLoop(Exception):
    """A process exited more often than its policy allows: the supervisor gave up on it."""

    def __init__(self, name: str, *, exits: int, policy: RestartPolicy, status: int, log: Path) -> None:
        self.name, self.exits, self.status, self.log = name, exits, status, log
        lines = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        super().__init__(
            f"{name} exited {_times(exits)} within {policy.window:g}s, the last time with status "
            f"{exit_status(status)}: a crash loop (a process is restarted at most {_times(policy.max_restarts)} "
            f"within {policy.window:g}s); the end of its log {log}:\n" + "\n".join(line[-300:] for line in lines)
        )


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


@dataclass
class _Child:
    command: Command
    proc: subprocess.Popen[bytes]
    started: float  # monotonic seconds
    delay: float  # before its next restart
    exits: deque[float] = field(default_factory=deque)  # when it exited, within the policy's window
    restarts: int = 0
    due: float | None = None  # while waiting to be restarted: when (monotonic seconds)


def _report(message: str) -> None:
    print(f"layerline up: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, policy: RestartPolicy, *, report: Callable[[str], None] = _report) -> None:
        self.policy = policy
        self.report = report  # says each exit and restart
        self._children: dict[str, _Child] = {}
        self._stopping = False

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Each process's current OS process, in start order (one waiting to restart: the one that exited)."""
        return {name: child.proc for name, child in self._children.items()}

    def start(self, command: Command) -> subprocess.Popen[bytes]:
        """Start `command` for the first time (its name must be new)."""
        assert command.name not in self._children, command.name
        child = _Child(command, self._popen(command, "wb", None), time.monotonic(), self.policy.first_delay)
        self._children[command.name] = child
        return child.proc

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start process `name` again now, from the same command; its current process must have exited."""
        child = self._children[name]
        status = child.proc.wait(0)  # TimeoutExpired if it still runs
        child.restarts += 1
        note = f"restart {child.restarts} of {name} after exit status {exit_status(status)}"
        child.proc, child.started, child.due = self._popen(child.command, "ab", note), time.monotonic(), None
        return child.proc

    def poll(self) -> None:
        """Note the processes that exited (each to restart after its delay) and restart those due.

        Raises `CrashLoop` for a process that exited more than the policy allows."""
        now = time.monotonic()
        for name, child in self._children.items():
            if self._stopping:
                return
            if child.due is None and child.proc.poll() is not None:
                self._exited(child, now)
            if child.due is not None and now >= child.due:
                proc = self.restart(name)
                self.report(f"{name} restarted (pid {proc.pid}, restart {child.restarts})")

    def _exited(self, child: _Child, now: float) -> None:
        policy, status = self.policy, child.proc.returncode
        _kill_group(child.proc.pid)  # what it left behind (a tensor-parallel stage's other ranks)
        child.exits.append(now)
        while child.exits[0] < now - policy.window:
            child.exits.popleft()
        if len(child.exits) > policy.max_restarts:
            raise CrashLoop(
                child.command.name, exits=len(child.exits), policy=policy, status=status, log=child.command.log
            )
        if now - child.started >= policy.stable_after:
            child.delay = policy.first_delay
        child.due = now + child.delay
        self.report(f"{child.command.name} exited with status {exit_status(status)}; restarting in {child.delay:g}s")
        child.delay = min(2 * child.delay, policy.max_delay)

    def stop(self, grace: float = 15.0) -> None:
        """Stop every process, the last started first: SIGTERM, then SIGKILL after `grace` seconds.

        Nothing is restarted afterwards, neither what exits now nor what waited for its delay."""
        self._stopping = True
        children = list(self._children.values())
        for child in reversed(children):
            child.due = None
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.report(f"{child.command.name} did not exit within {grace:g}s of SIGTERM: its stacks go to its log")
                child.proc.send_signal(signal.SIGUSR1)  # every thread's stack (see configure_logging)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(STACKS_WAIT)
                child.proc.kill()
                child.proc.wait()

    @staticmethod
    def _popen(command: Command, mode: str, note: str | None) -> subprocess.Popen[bytes]:
        with command.log.open(mode) as log:  # the child keeps its own descriptor
            if note is not None:
                log.write(f"--- layerline up: {note} ---\n".encode())
                log.flush()
            return subprocess.Popen(
                command.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=command.env,
                start_new_session=True,  # its own process group: Ctrl-C in a terminal reaches only `up`
            )


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the process group of a process that exited (started in a session of its own)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone with its leader
        pass
