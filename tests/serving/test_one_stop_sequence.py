"""Every stop of a server goes through one function, pgroup.stop_sequence: SIGTERM and SIGCONT, a
grace period, SIGKILL to what is left. Each caller (`Server.stop` for the memory guard and the
watchdog, `memguard run`'s supervisor, `ServerProcess.stop`) is run here on real processes that
ignore SIGTERM, with stop_sequence wrapped so that the test sees it was the one that stopped
them; and no other file of magpie/serving names SIGKILL. A few seconds in all, no vLLM."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from magpie.serving import pgroup
from magpie.serving.process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
SERVING = REPO / "magpie" / "serving"

# A leader that ignores SIGTERM and SIGINT and forks a worker that ignores them too (as vLLM's engine core may),
# writing the worker's PID to the file named by its first argument, then both wait.
STUBBORN = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = os.fork()
    if worker == 0:
        time.sleep(120)
        os._exit(0)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(worker))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(120)
    """
)


def _wait_for_file(path: Path, timeout: float = 30) -> str:
    """PATH's text, once it exists and says something."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def _spy(monkeypatch) -> list[float]:
    """Wrap pgroup.stop_sequence; the list gets the grace of each call."""
    calls: list[float] = []
    real = pgroup.stop_sequence

    def spy(send, running, left, grace, **kwargs):
        calls.append(grace)
        return real(send, running, left, grace, **kwargs)

    monkeypatch.setattr(pgroup, "stop_sequence", spy)
    return calls


def _stubborn(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    marker = tmp_path / "worker.pid"
    proc = subprocess.Popen([sys.executable, str(script), str(marker)], start_new_session=True)
    return proc, int(_wait_for_file(marker))


def test_no_file_of_magpie_serving_but_pgroup_names_sigkill():
    """The stop sequence is written once: SIGKILL is sent from pgroup.py alone."""
    named = []
    for path in sorted(SERVING.glob("*.py")):
        if path.name == "pgroup.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "SIGKILL") or (
                isinstance(node, ast.Name) and node.id == "SIGKILL"
            ):
                named.append(f"{path.name}:{node.lineno}")
    for path in sorted(SERVING.glob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bkill\s+-(9|KILL|s\s+KILL)\b", line):
                named.append(f"{path.name}:{number}")
    assert named == [], f"SIGKILL outside pgroup.stop_sequence: {named}"


def test_server_stop_of_the_guard_and_the_watchdog_is_the_stop_sequence(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    proc, worker = _stubborn(tmp_path)
    lines: list[str] = []
    try:
        started = time.monotonic()
        pgroup.Server(proc.pid).stop("a test", 1, lines.append, "the test")
        took = time.monotonic() - started
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert calls == [1] and 1 <= took < 10, (calls, took)
        assert pgroup.group_members(proc.pid) == [] and pgroup.start_time(worker) is None
        assert any("still alive after 1 s: SIGKILL to process group" in line for line in lines), lines
    finally:
        pgroup.signal_group(proc.pid, signal.SIGKILL)


def test_server_process_stop_is_the_stop_sequence(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    marker = tmp_path / "worker.pid"
    srv = ServerProcess([sys.executable, script, marker], "http://127.0.0.1:9", tmp_path / "out.log", grace=1)
    srv.launch()
    try:
        worker = int(_wait_for_file(marker))
        started = time.monotonic()
        assert srv.stop() == -signal.SIGKILL
        took = time.monotonic() - started
        assert calls == [1] and 1 <= took < 10, (calls, took)
        assert pgroup.group_members(srv.pid) == [] and pgroup.start_time(worker) is None
    finally:
        pgroup.signal_group(srv.pid, signal.SIGKILL)


# `memguard run` in a process of its own (it takes SIGTERM), with stop_sequence wrapped to say so.
SUPERVISOR = textwrap.dedent(
    """
    import sys
    from magpie.serving import memguard, pgroup
    real = pgroup.stop_sequence
    def spy(*args, **kwargs):
        print("memguard run: stop_sequence called", file=sys.stderr, flush=True)
        return real(*args, **kwargs)
    pgroup.stop_sequence = spy
    sys.exit(memguard.main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_memguard_run_stops_its_server_through_the_stop_sequence(tmp_path, signum):
    driver = tmp_path / "driver.py"
    driver.write_text(SUPERVISOR)
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    marker, pid_file, log = tmp_path / "worker.pid", tmp_path / "server.pid", tmp_path / "run.log"
    cmd = [sys.executable, str(driver), "run", "--no-guard", "--grace", "1", "--pid-file", str(pid_file)]
    cmd += ["--log", str(log), "--", sys.executable, str(script), str(marker)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    run = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        worker = int(_wait_for_file(marker))
        server = int(_wait_for_file(pid_file))  # the supervisor writes it once its child has started
        started = time.monotonic()
        run.send_signal(signum)
        _, err = run.communicate(timeout=60)
        took = time.monotonic() - started
        assert run.returncode == 128 + signal.SIGKILL, err
        assert "stop_sequence called" in err, err
        assert 1 <= took < 20, took
        assert pgroup.group_members(server) == [] and pgroup.start_time(worker) is None
        assert f"server PID {server} still running 1 s after SIGTERM: SIGKILL to its group" in log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if server is not None:
            pgroup.signal_group(server, signal.SIGKILL)
