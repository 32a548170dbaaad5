"""A real vLLM OpenAI-compatible server on 127.0.0.1, started and stopped by PID.

server = VllmServer(model_dir, ["--speculative-config", '{"method": "mtp", ...}'], env=vllm_env())
server.start()          # waits for /health; raises with the log tail if the process dies
... server.url ...
server.stop()           # SIGTERM to its process group, then SIGKILL after a grace period
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes in process group `pgid`, read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(entry))
    return members


class ServerDied(RuntimeError):
    pass


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, describe) -> None:
    """Poll `url`/health until it answers 200. Raise ServerDied if `proc` exits first and
    TimeoutError after `timeout` s; `describe()` supplies the log excerpt for the message."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise ServerDied(f"server process exited with {proc.returncode} during start-up; {describe()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy after {timeout} s; {describe()}")


class VllmServer:
    def __init__(
        self,
        model: str | os.PathLike,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        python: str = sys.executable,
        served_name: str = "tiny",
        max_model_len: int = 2048,
    ):
        self.model = str(model)
        self.extra_args = list(extra_args or [])
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name
        self.log_path = Path(log_path) if log_path else Path(self.model).parent / f"server-{self.port}.log"
        self.cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(max_model_len),
            *self.extra_args,
        ]
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 600) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        start = time.monotonic()
        # Own process group: stop() reaches the engine core and workers vLLM forks.
        self.proc = subprocess.Popen(
            self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        try:
            wait_healthy(self.url, self.proc, timeout, lambda: f"log {self.log_path}:\n{self.log_tail()}")
        except TimeoutError:
            self.stop()
            raise
        self.startup_s = time.monotonic() - start
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # Children that outlived the leader (same group): make sure none is left running.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    # Small HTTP helpers for tests.
    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.load(resp)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_values(metrics_text: str, name: str) -> dict[str, float]:
    """Prometheus samples of `name` (labels string -> value) from a /metrics page."""
    values: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            rest = key[len(name) :]
            if rest and not rest.startswith("{"):
                continue  # another metric sharing the prefix
            values[rest] = float(value)
    return values
