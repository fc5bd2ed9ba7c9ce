"""The supervisor on real OS processes (small Python commands): backoff, crash loops, stopping."""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from layerline.supervisor import Command, CrashLoop, RestartPolicy, Supervisor, exit_status

pytestmark = pytest.mark.cluster


def _command(tmp_path: Path, name: str, code: str) -> Command:
    return Command(name, (sys.executable, "-c", code), env=dict(os.environ), log=tmp_path / f"{name}.log")


def _poll_until(supervisor: Supervisor, done, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        supervisor.poll()
        time.sleep(0.01)


def test_exit_status_names_the_signal() -> None:
    assert exit_status(0) == "0"
    assert exit_status(3) == "3"
    assert exit_status(-9) == "-9 (SIGKILL)"
    assert exit_status(-15) == "-15 (SIGTERM)"


@pytest.mark.timeout(60)
def test_a_crash_loop_backs_off_then_gives_up_naming_the_process_and_why(tmp_path: Path) -> None:
    said: list[str] = []
    policy = RestartPolicy(max_restarts=4, first_delay=0.05, max_delay=0.2)
    supervisor = Supervisor(policy, report=said.append)
    supervisor.start(_command(tmp_path, "broken", "import sys; print('no such layer', flush=True); sys.exit(3)"))
    starts = [time.monotonic()]
    with pytest.raises(CrashLoop) as caught:
        while True:
            before = supervisor.processes["broken"]
            supervisor.poll()
            if supervisor.processes["broken"] is not before:
                starts.append(time.monotonic())
            time.sleep(0.005)
    exits = [line for line in said if "exited" in line]
    assert exits == [f"broken exited with status 3; restarting in {delay}s" for delay in ("0.05", "0.1", "0.2", "0.2")]
    assert [line.split(" (pid")[0] for line in said if "restarted" in line] == ["broken restarted"] * 4
    # Each restart waited at least its delay after the exit (the exit itself follows the start).
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert all(gap >= delay for gap, delay in zip(gaps, (0.05, 0.1, 0.2, 0.2))), gaps
    loop = caught.value
    assert (loop.name, loop.exits, loop.status) == ("broken", 5, 3)
    message = str(loop)
    assert message.startswith("broken exited 5 times within 120s, the last time with status 3: a crash loop")
    assert "restarted at most 4 times" in message
    assert message.count("no such layer") == 5  # the end of its log, with every start's output
    log = (tmp_path / "broken.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("---")] == [
        f"--- layerline up: restart {n} of broken after exit status 3 ---" for n in range(1, 5)
    ]
    supervisor.stop()


@pytest.mark.timeout(60)
def test_a_process_that_stayed_up_long_enough_is_restarted_after_the_first_delay_again(tmp_path: Path) -> None:
    said: list[str] = []
    policy = RestartPolicy(max_restarts=10, first_delay=0.05, max_delay=5, stable_after=0.3)
    supervisor = Supervisor(policy, report=said.append)
    supervisor.start(_command(tmp_path, "slow", "import time; time.sleep(0.5)"))
    _poll_until(supervisor, lambda: sum("restarted" in line for line in said) == 3)
    supervisor.stop()
    assert [line for line in said if "exited" in line] == ["slow exited with status 0; restarting in 0.05s"] * 3


@pytest.mark.timeout(60)
def test_stop_ends_the_current_process_of_each_name_and_nothing_restarts_after_it(tmp_path: Path) -> None:
    said: list[str] = []
    supervisor = Supervisor(RestartPolicy(first_delay=0.2), report=said.append)
    first = supervisor.start(_command(tmp_path, "server", "import time; time.sleep(60)"))
    other = supervisor.start(_command(tmp_path, "other", "import time; time.sleep(60)"))
    first.send_signal(signal.SIGKILL)
    _poll_until(supervisor, lambda: supervisor.processes["server"] is not first)
    second = supervisor.processes["server"]
    other.send_signal(signal.SIGKILL)
    _poll_until(supervisor, lambda: len(said) == 3)  # `other` waits for its restart now
    assert said == [
        "server exited with status -9 (SIGKILL); restarting in 0.2s",
        f"server restarted (pid {second.pid}, restart 1)",
        "other exited with status -9 (SIGKILL); restarting in 0.2s",
    ]
    supervisor.stop(grace=5)  # during `other`'s delay
    assert (first.returncode, second.returncode, other.returncode) == (
        -signal.SIGKILL,
        -signal.SIGTERM,
        -signal.SIGKILL,
    )
    time.sleep(0.3)
    supervisor.poll()  # nothing is due any more
    assert supervisor.processes == {"server": second, "other": other}
    assert len(said) == 3


def test_a_policy_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-restarts -1 must be 0 or more"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="restart delays"):
        RestartPolicy(first_delay=2, max_delay=1)


@pytest.mark.timeout(60)
def test_a_process_that_ignores_sigterm_leaves_its_stacks_in_its_log_before_sigkill(tmp_path: Path) -> None:
    said: list[str] = []
    supervisor = Supervisor(RestartPolicy(), report=said.append)
    hung = (
        "import signal, sys, time\n"
        "from shared.settings import configure_logging\n"
        "configure_logging()\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "def stuck_in_shutdown():\n"
        "    print('up', flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "stuck_in_shutdown()\n"
    )
    proc = supervisor.start(_command(tmp_path, "hung", hung))
    log = tmp_path / "hung.log"
    deadline = time.monotonic() + 30
    while "up" not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.05)
    supervisor.stop(grace=0.5)
    assert proc.returncode == -signal.SIGKILL
    assert said == ["hung did not exit within 0.5s of SIGTERM: its stacks go to its log"]
    stacks = log.read_text()
    assert 'File "<string>", line 8 in stuck_in_shutdown' in stacks, stacks
