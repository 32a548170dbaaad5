"""serve.sh's supervision against a real vLLM CPU server: WATCHDOG=restart after a stall and after
an engine death.

serve.sh runs the server under `memguard run` (the supervisor: guard in-process, the watchdog
beside it). A stall: the engine core is stopped with SIGSTOP; the watchdog's probe times out, it
stops the server's process group, and the supervisor launches the same plan again (a second
start-up). A death: the engine core gets SIGKILL; vLLM's API server then shuts down with status 0,
and the supervisor must tell that from a clean stop.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import pytest

from magpie.serving.process import group_members
from tests.conftest import EAGER
from tests.serving.helpers import ServeSh

pytestmark = pytest.mark.slow  # each test starts its own server through serve.sh

# The servers run eager (EAGER, serve.sh's extra arguments, which a restart passes again): the
# subject is the supervision of a stall or a death, not torch.compile, and each of the two starts
# per test is ~30 s shorter.
ARGS = ["--served-model-name", "tiny", *EAGER]


def wait_until(condition, timeout: float, what: str, describe=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen after {timeout} s\n{describe()}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def engine_core(server_pid: int) -> int:
    """The engine core among the processes of our server's group (never looked up elsewhere)."""
    found = [p for p in group_members(server_pid) if p != server_pid and "EngineCor" in open(f"/proc/{p}/comm").read()]
    assert len(found) == 1, found
    return found[0]


def test_serve_sh_exits_5_with_the_reason_when_the_engine_dies_and_restarts_it_by_policy(tmp_path, tiny_mtp_model):
    settings = {
        "MTP": "0",
        "WATCHDOG": "restart",
        "WATCHDOG_RESTARTS": "1",
        "STOP_GRACE": "10",
        "MEMGUARD_MIN_AVAILABLE": "512MiB",  # a shared test machine: the engine's death is the only stop here
    }
    server = ServeSh(tmp_path / "server.log", tiny_mtp_model, None, settings, ARGS)
    server.start()
    try:
        first = server.server_pid
        os.kill(engine_core(first), signal.SIGKILL)  # as the kernel's OOM killer would
        restart = re.compile(r"^\[memguard [^\]]*\] restart 1 of 1 after the engine died$", re.M)
        wait_until(lambda: restart.search(server.log_path.read_text()), 120, "the restart", server.describe)
        wait_until(lambda: server.pid_file.exists() and server.server_pid != first, 60, "a new server PID")
        second = server.server_pid
        wait_until(lambda: healthy(server.url), 600, "the restarted server's /health", server.log_tail)
        assert group_members(first) == []

        os.kill(engine_core(second), signal.SIGKILL)  # no restart left: serve.sh ends, non-zero, saying why
        status = server.proc.wait(timeout=120)
        said = server.output_path.read_text()
        assert status == 5, said
        assert "memguard run: the server's engine died (the server exited with status 0)" in said, said
        assert "engine core exited unexpectedly" in said and "no restart: 1 restart(s) done" in said, said
        assert group_members(second) == []
    finally:
        server.stop()
    assert not server.pid_file.exists()


def test_serve_sh_restarts_a_stalled_server_under_watchdog_restart(tmp_path, tiny_mtp_model):
    settings = {
        "MEMGUARD_MIN_AVAILABLE": "512MiB",
        "MTP": "0",
        "WATCHDOG": "restart",
        "WATCHDOG_RESTARTS": "1",
        "WATCHDOG_ARGS": "--interval 0.5 --probe-interval 2 --probe-timeout 5 --grace 20",
    }
    server = ServeSh(tmp_path / "server.log", tiny_mtp_model, None, settings, ARGS)
    server.start()
    try:
        first = server.server_pid
        engines = [p for p in group_members(first) if p != first and "EngineCor" in open(f"/proc/{p}/comm").read()]
        assert len(engines) == 1
        wait_until(lambda: "server healthy; watching its counters" in server.log_path.read_text(), 60, "watchdog ready")
        stalled_at = time.monotonic()
        os.kill(engines[0], signal.SIGSTOP)
        wait_until(
            lambda: f"stopping process group {first}" in server.log_path.read_text(), 90, "the stop", server.log_tail
        )
        detected_s = time.monotonic() - stalled_at
        restart = re.compile(r"^\[memguard [^\]]*\] restart 1 of 1 after a stall$", re.M)  # memguard run's line
        wait_until(lambda: restart.search(server.log_path.read_text()), 60, "restart")
        wait_until(lambda: server.pid_file.exists() and server.server_pid != first, 60, "a new server PID")
        second = server.server_pid
        wait_until(lambda: healthy(server.url), 600, "the restarted server's /health", server.log_tail)
        restarted_s = time.monotonic() - stalled_at
        assert group_members(first) == [], "the stalled server's group (engine core included) is gone"
        text = server.log_path.read_text()
        assert re.search(rf"\[memguard [^\]]*\] guarding server PID {second} ", text)
        assert re.search(rf"\[watchdog [^\]]*\] watching server PID {second} ", text)
        print(f"stall found {detected_s:.1f} s after SIGSTOP; restarted server healthy {restarted_s:.0f} s after it")
    finally:
        status = server.stop()
    assert status is not None and not server.pid_file.exists()
