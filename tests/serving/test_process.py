"""The server lifecycle (magpie.serving.process) on real processes: a small HTTP server on 127.0.0.1
that forks a worker, as vLLM's API server forks its engine core, and a supervisor script that
starts it in a session of its own, as serve.sh does. (The real vLLM server is tests/test_vllm_server.py;
serve.sh itself is tests/serving/test_serve_sh_liveness.py and test_serving_tools.py.)"""

from __future__ import annotations

import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from magpie.serving.process import ServerDied, ServerProcess, ServeShServer, free_port, group_members

SERVER = textwrap.dedent(
    """
    import http.server, os, signal, sys, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:  # a worker in the server's process group (SIGTERM ends it unless ignored)
        while True:
            time.sleep(1)
    if mode == "die":
        print("fatal: the model folder has no config.json", flush=True)
        sys.exit(3)


    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" and mode != "never-healthy" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass


    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    """
)

# A supervisor that starts the server in a session of its own and writes its PID (like serve.sh),
# but exits on SIGTERM without stopping it: the stop must still leave no server behind.
FORGETFUL_SUPERVISOR = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    set -euo pipefail
    setsid "$PY" "$SERVER" "$PORT" serve >>"$1" 2>&1 </dev/null &
    echo "$!" >"$PID_FILE"
    echo "supervisor: server PID $!"
    trap 'exit 0' TERM
    wait
    """
)


def server(tmp_path: Path, mode: str, grace: float = 30) -> ServerProcess:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    cmd = [sys.executable, script, str(port), mode]
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", grace=grace)


def test_start_waits_for_health_and_stop_leaves_no_process_of_the_group(tmp_path):
    srv = server(tmp_path, "serve").start(timeout=60)
    assert srv.alive() and srv.startup_s > 0
    assert len(group_members(srv.pid)) == 2  # the server and its worker, in the server's own group
    assert srv.ready() and srv.get("/health") == ""
    assert srv.stop() == -signal.SIGTERM
    assert group_members(srv.pid) == [] and not srv.alive()
    assert srv.stop() == -signal.SIGTERM  # a second stop is harmless


def test_a_server_that_exits_during_start_up_raises_with_its_log_tail(tmp_path):
    srv = server(tmp_path, "die")
    with pytest.raises(ServerDied) as info:
        srv.start(timeout=60)
    assert "exited with 3 during start-up" in str(info.value)
    assert "fatal: the model folder has no config.json" in str(info.value)
    assert str(srv.log_path) in str(info.value)
    assert group_members(srv.pid) == []  # the worker it left behind was stopped too


def test_a_server_never_healthy_times_out_and_is_stopped(tmp_path):
    srv = server(tmp_path, "never-healthy")
    with pytest.raises(TimeoutError) as info:
        srv.start(timeout=3)
    assert "not healthy after 3 s" in str(info.value) and "listening" in str(info.value)
    assert not srv.alive() and group_members(srv.pid) == []


def test_a_server_that_ignores_sigterm_gets_sigkill_after_the_grace(tmp_path):
    srv = server(tmp_path, "ignore-term", grace=2).start(timeout=60)
    started = time.monotonic()
    assert srv.stop() == -signal.SIGKILL
    assert time.monotonic() - started >= 2
    assert group_members(srv.pid) == []


def test_serve_sh_server_stops_the_server_its_supervisor_left_behind(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    supervisor = tmp_path / "supervisor.sh"
    supervisor.write_text(FORGETFUL_SUPERVISOR)
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable, "SERVER": str(tmp_path / "server.py")}
    srv = ServeShServer(tmp_path / "server.log", env, serve_sh=supervisor, grace=5).start(timeout=60)
    server_pid = srv.server_pid
    assert server_pid != srv.pid and len(group_members(server_pid)) == 2  # a session of its own
    assert f"supervisor: server PID {server_pid}" in srv.output_path.read_text()
    assert srv.stop() == 0  # the supervisor exited on SIGTERM at once ...
    assert group_members(server_pid) == []  # ... and the server it forgot is gone all the same
    assert "listening" in srv.log_path.read_text()
