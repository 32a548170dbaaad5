"""The liveness watchdog against a real vLLM CPU server with MTP on, made to stall.

The stall is real: the engine-core process (a child in the server's own process group) is stopped
with SIGSTOP while a request runs, so the API server keeps answering /health and /metrics while no
token is generated, which is what a wedged engine looks like from outside; or the API server
itself is stopped. MTP is on (as in every shipped profile): the watchdog's probe must be a request
the served configuration can take (a one-token prompt crashes vLLM 0.29.0's CPU build under MTP).
The model has random weights, so drafts are mostly rejected and a long request lasts as long as
without MTP.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from magpie.demo.demo_overlay import vllm_env
from magpie.serving.metrics import MetricsSnapshot
from magpie.serving.process import VllmServer, group_members
from tests.conftest import EAGER
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


MTP = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 2})]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_random_model):
    folder = tmp_path_factory.mktemp("watchdog")
    # The longest context the tiny model allows, so that one request outlasts the test's pauses; MTP
    # on CPU needs prefix caching off. Eager: what is watched (counters, /health, /metrics, the
    # engine core's process) is the same compiled or not, and the start is ~30 s shorter.
    server = VllmServer(
        tiny_random_model,
        ["--no-enable-prefix-caching", *MTP, *EAGER],
        env=vllm_env(),
        log_path=folder / "server.log",
        max_model_len=4096,
    )
    server.launch()
    # A watchdog from the server's start on (test_watchdog_judges_a_server_frozen_right_after_it_served
    # reads it), held with SIGSTOP once it watches, so that it cannot see a healthy /health.
    early_log = folder / "early-watchdog.log"
    early = start_watchdog(
        server,
        early_log,
        *("--server-log", str(server.log_path), "--stall-after", "5", "--metrics-timeout", "2"),
        *("--on-stall", "report"),
    )
    server.early_watchdog = (early, early_log)
    try:
        wait_for(early_log, "watching server PID", 60)
        os.kill(early.pid, signal.SIGSTOP)
        server.wait_until_ready(600)
    except BaseException:
        server.stop()
        raise
    yield server
    for pid in [*group_members(server.pid), early.pid]:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if early.poll() is None:
        early.kill()
        early.wait()
    server.stop()


# A streamed request far longer than the pauses below need (about 2 s of decoding between them) on
# any machine; the test closes it once the engine is seen moving again, so how fast this machine
# decodes (40+ tokens/s on an idle 2-core VM, under 10 on a busy one) sets no test's length.
LONG_TOKENS = 4000


def running(server: VllmServer) -> float:
    return MetricsSnapshot.fetch(server.url).sum("vllm:num_requests_running") or 0.0


class LongRequest:
    """One streamed completion in a thread: `chunks` counts the text chunks received so far;
    close() drops the connection, which makes vLLM abort the request."""

    def __init__(self, server: VllmServer):
        host, port = server.url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=600)
        self.chunks = 0
        self.finished = False
        self.error: Exception | None = None
        self.closed = False
        body = {"model": "tiny", "prompt": "5 6 7", "max_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
        self.conn.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while running(server) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(server) >= 1

    def _read(self) -> None:
        try:
            resp = self.conn.getresponse()
            assert resp.status == 200, resp.status
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    self.finished = True
                elif line.startswith(b"data: "):
                    self.chunks += len(json.loads(line[6:])["choices"][0]["text"]) > 0
        except Exception as e:  # noqa: BLE001 - reported by the test, unless the test closed it
            if not self.closed:
                self.error = e

    def wait_for_more(self, count: int, timeout: float) -> None:
        """Wait until COUNT more chunks have arrived than now."""
        target, deadline = self.chunks + count, time.monotonic() + timeout
        while self.chunks < target and self.error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.chunks >= target and self.error is None, (self.chunks, target, self.error)

    def close(self) -> None:
        self.closed = True
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.thread.join(timeout=30)


def start_watchdog(server: VllmServer, log: Path, *options: str) -> subprocess.Popen:
    cmd = [*tool("watchdog"), "watch", "--pid", str(server.pid), "--url", server.url]
    cmd += ["--interval", "0.5", "--grace", "20", "--log", str(log), *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_watchdog_judges_a_server_frozen_right_after_it_served(server):
    # The watchdog never saw a healthy /health (it was held until now); the API server freezes.
    # Before, it waited for a first healthy /health forever; vLLM's own line in the log starts the
    # judging, and /metrics not answering is the stall.
    early, log = server.early_watchdog
    os.kill(server.pid, signal.SIGSTOP)
    try:
        os.kill(early.pid, signal.SIGCONT)
        text = wait_for(log, "/metrics has not answered for", 60)
        assert f"the server log {server.log_path} says the server serves" in text
        assert "(policy report: left running)" in text and early.poll() is None
    finally:
        os.kill(server.pid, signal.SIGCONT)
        early.terminate()
    assert early.wait(timeout=30) == 0
    deadline = time.monotonic() + 60
    while not server.ready() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.ready(), "the server answers again once continued"


def wait_for(path: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in {path} after {timeout} s:\n{text}")


@pytest.mark.slow
def test_watchdog_reports_a_frozen_generation_counter_while_health_stays_green(server, tmp_path):
    engine = engine_core_pid(server)
    log = tmp_path / "watchdog.log"
    request = None
    watchdog = start_watchdog(server, log, "--stall-after", "4", "--on-stall", "report")
    try:
        wait_for(log, "server healthy; watching its counters", 30)
        # The request starts once the watchdog watches, so that all of its decoding time is left
        # for the pauses below (a fast machine decodes it in seconds).
        request = LongRequest(server)
        # A pause shorter than --stall-after is not a stall.
        os.kill(engine, signal.SIGSTOP)
        time.sleep(2)
        os.kill(engine, signal.SIGCONT)
        time.sleep(1)
        assert "stalled engine" not in log.read_text()
        assert running(server) >= 1 and not request.finished, "the request should still run (raise LONG_TOKENS)"

        os.kill(engine, signal.SIGSTOP)
        started = time.monotonic()
        text = wait_for(log, "stalled engine: generation_tokens_total frozen at", 30)
        detected_s = time.monotonic() - started
        assert "while 1 request(s) run" in text and "(policy report: left running)" in text
        with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
            assert resp.status == 200, "/health reports a stalled engine as healthy: that is why the watchdog exists"
        assert watchdog.poll() is None and server.alive()
        frozen = request.chunks
        time.sleep(1)
        assert request.chunks == frozen, "no token while the engine is stopped"
        os.kill(engine, signal.SIGCONT)
        wait_for(log, "engine moving again", 30)
        # Left running, the same request goes on: its stream brings new tokens.
        request.wait_for_more(5, 120)
        assert not request.finished, "the request should still run (raise LONG_TOKENS)"
        print(f"stall detected {detected_s:.1f} s after SIGSTOP with --stall-after 4 --interval 0.5")
    finally:
        os.kill(engine, signal.SIGCONT)
        if request is not None:
            request.close()  # vLLM aborts the request its client left
        watchdog.terminate()
        assert watchdog.wait(timeout=30) == 0
    deadline = time.monotonic() + 60
    while running(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(server) == 0, "vLLM aborts a streamed request whose client has gone"


@pytest.mark.slow
def test_watchdog_default_probe_finds_a_stopped_idle_engine_and_stops_only_its_server(server, tmp_path):
    # Last test of the module: it stops the server. The probe is on by default: a watchdog given no
    # --probe-interval says it probes an idle engine after 60 s (its running/waiting counts, which
    # come from the engine, read 0 once it is stopped). The watchdog that then probes is the same
    # one with a 3 s interval instead of waiting out the default 60 s twice.
    engine = engine_core_pid(server)
    default_log = tmp_path / "default-watchdog.log"
    default = start_watchdog(server, default_log, "--stall-after", "600", "--probe-timeout", "5", "--on-stall", "stop")
    try:
        said = wait_for(default_log, "watching server PID", 60)
        assert "or a probe after 60 idle s gets no answer within 5 s; policy stop" in said, said
    finally:
        default.terminate()
    assert default.wait(timeout=30) == 0
    bystander = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(300)"], start_new_session=True)
    log = tmp_path / "watchdog.log"
    assert running(server) == 0
    watchdog = start_watchdog(
        server, log, *("--stall-after", "600", "--probe-interval", "3", "--probe-timeout", "5", "--on-stall", "stop")
    )
    try:
        wait_for(log, "server healthy; watching its counters", 30)
        # The probe is a request this configuration (MTP on) can take: answered, and the engine lives.
        wait_for(log, "first probe answered in", 150)
        assert "probe got HTTP" not in log.read_text() and server.ready() and watchdog.poll() is None
        os.kill(engine, signal.SIGSTOP)
        assert watchdog.wait(timeout=200) == 4, log.read_text()
        text = log.read_text()
        assert "stalled engine: the probe got no answer within 5 s" in text and "no counter moved" in text
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
