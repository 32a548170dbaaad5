"""The liveness watchdog against a real vLLM CPU server made to stall.

The stall is real: the engine-core process (a child in the server's own process group) is stopped
with SIGSTOP while a request runs, so the API server keeps answering /health and /metrics while no
token is generated, which is what a wedged engine looks like from outside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from magpie.demo.overlay import vllm_env
from magpie.serving.metrics import MetricsSnapshot
from magpie.serving.process import VllmServer, group_members
from tests.serving.helpers import PYTHON, tool


def engine_core_pid(server: VllmServer) -> int:
    """The engine core among the processes of our own server's group (never looked up elsewhere)."""
    found = []
    for pid in group_members(server.pid):
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if pid != server.pid and "EngineCor" in comm:
            found.append(pid)
    assert len(found) == 1, {pid: Path(f"/proc/{pid}/comm").read_text().strip() for pid in group_members(server.pid)}
    return found[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_mtp_model):
    log = tmp_path_factory.mktemp("watchdog") / "server.log"
    # The longest context the tiny model allows, so that one request outlasts the test's pauses.
    server = VllmServer(
        tiny_mtp_model, ["--no-enable-prefix-caching"], env=vllm_env(), log_path=log, max_model_len=4096
    )
    server.start()
    yield server
    for pid in group_members(server.pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    server.stop()


LONG_TOKENS = 4000  # a few seconds of decoding on an idle CPU: longer than the pauses below


def running(server: VllmServer) -> float:
    return MetricsSnapshot.fetch(server.url).sum("vllm:num_requests_running") or 0.0


def long_request(server: VllmServer, result: dict) -> threading.Thread:
    def run():
        try:
            body = {"model": "tiny", "prompt": "5 6 7", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
            result["response"] = server.post("/v1/completions", body, timeout=600)
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while running(server) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(server) >= 1
    return thread


def start_watchdog(server: VllmServer, log: Path, *options: str) -> subprocess.Popen:
    cmd = [*tool("watchdog"), "watch", "--pid", str(server.pid), "--url", server.url]
    cmd += ["--interval", "0.5", "--grace", "20", "--log", str(log), *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in {path} after {timeout} s:\n{text}")


def test_watchdog_reports_a_frozen_generation_counter_while_health_stays_green(server, tmp_path):
    engine = engine_core_pid(server)
    log = tmp_path / "watchdog.log"
    result: dict = {}
    watchdog = start_watchdog(server, log, "--stall-after", "4", "--on-stall", "report")
    try:
        wait_for(log, "server healthy; watching its counters", 30)
        # The request starts once the watchdog watches, so that all of its decoding time is left
        # for the pauses below (a fast machine decodes it in seconds).
        thread = long_request(server, result)
        # A pause shorter than --stall-after is not a stall.
        os.kill(engine, signal.SIGSTOP)
        time.sleep(2)
        os.kill(engine, signal.SIGCONT)
        time.sleep(1)
        assert "stalled engine" not in log.read_text()
        assert running(server) >= 1, "the request should still be running (make max_tokens larger)"

        os.kill(engine, signal.SIGSTOP)
        started = time.monotonic()
        text = wait_for(log, "stalled engine: generation_tokens_total frozen at", 30)
        detected_s = time.monotonic() - started
        assert "while 1 request(s) run" in text and "(policy report: left running)" in text
        with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
            assert resp.status == 200, "/health reports a stalled engine as healthy: that is why the watchdog exists"
        assert watchdog.poll() is None and server.alive()
        os.kill(engine, signal.SIGCONT)
        wait_for(log, "engine moving again", 30)
        thread.join(timeout=300)
        assert "error" not in result and result["response"]["usage"]["completion_tokens"] == LONG_TOKENS
        print(f"stall detected {detected_s:.1f} s after SIGSTOP with --stall-after 4 --interval 0.5")
    finally:
        os.kill(engine, signal.SIGCONT)
        watchdog.terminate()
        assert watchdog.wait(timeout=30) == 0


def test_watchdog_probe_finds_an_idle_stalled_engine_and_stops_only_its_server(server, tmp_path):
    # Last test of the module: it stops the server.
    engine = engine_core_pid(server)
    bystander = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(300)"], start_new_session=True)
    log = tmp_path / "watchdog.log"
    assert running(server) == 0
    watchdog = start_watchdog(
        server, log, "--stall-after", "600", "--probe-interval", "2", "--probe-timeout", "5", "--on-stall", "stop"
    )
    try:
        wait_for(log, "server healthy; watching its counters", 30)
        time.sleep(3)  # at least one probe answered while the engine runs
        assert watchdog.poll() is None
        os.kill(engine, signal.SIGSTOP)
        assert watchdog.wait(timeout=90) == 4, log.read_text()
        text = log.read_text()
        assert "stalled engine: the one-token probe got no answer within 5 s" in text
        assert f"stopping process group {server.pid}" in text and "stopped by the watchdog" in text
        assert server.proc.wait(timeout=30) is not None
        deadline = time.monotonic() + 30
        while group_members(server.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert group_members(server.pid) == [], "the stopped engine core was left behind"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        if watchdog.poll() is None:
            watchdog.kill()
            watchdog.wait()


def test_watchdog_metric_sums_read_every_engine():
    from magpie.serving import watchdog

    page = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 40.0\n'
        "vllm:generation_tokens_created 1.7e9\n"
    )
    sums = watchdog.metric_sums(page, ("vllm:num_requests_running", "vllm:generation_tokens_total"))
    assert sums == {"vllm:num_requests_running": 3.0, "vllm:generation_tokens_total": 40.0}
