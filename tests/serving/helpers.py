"""Helpers for the Flash-Next tool tests: paths, running a tool, a real server launched by serve.sh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
PACKAGE = REPO / "magpie"  # `python3 PACKAGE TOOL` runs a tool as users do
TOOLS = PACKAGE / "serving"  # serve.sh, profiles/
MEASURE = PACKAGE / "measure"  # run_suite.sh, schemas/
FIXTURES = Path(__file__).resolve().parent / "fixtures"

from magpie.demo.overlay import vllm_env  # noqa: E402
from magpie.serving.process import free_port, wait_healthy  # noqa: E402

PYTHON = sys.executable  # the test venv's interpreter, which has the CPU build of vLLM


def tool(name: str) -> list[str]:
    """The command of magpie's tool NAME (e.g. "memguard"), as a user runs it from any folder."""
    return [PYTHON, str(PACKAGE), name]


def run_tool(name: str, *args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run magpie's tool NAME (e.g. "log-check") the way a user does, in a subprocess."""
    return subprocess.run([*tool(name), *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


class ServeSh:
    """serve.sh LOG [args] in its own session; waits for /health; stops it with SIGTERM like a user."""

    def __init__(self, log_path: Path, model: Path, overlay: Path | None, settings: dict[str, str], extra_args=()):
        self.log_path = Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid_file = Path(str(log_path) + ".pid")
        self.env = vllm_env(
            overlay,
            MODEL=str(model),
            VLLM_PYTHON=PYTHON,
            PORT=str(self.port),
            MAX_MODEL_LEN="2048",
            PLE="0",
            **settings,
        )
        self.cmd = ["bash", str(TOOLS / "serve.sh"), str(self.log_path), *extra_args]
        self.proc: subprocess.Popen | None = None
        self.started_server_pid: int | None = None
        self.stderr_path = self.log_path.with_suffix(".serve-sh.err")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def server_pid(self) -> int:
        return int(self.pid_file.read_text())

    def start(self, timeout: float = 600) -> ServeSh:
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=err, stderr=err, start_new_session=True)
        try:
            wait_healthy(
                self.url,
                self.proc,
                timeout,
                lambda: f"serve.sh stderr: {self.stderr_path.read_text()}\nlog {self.log_path}:\n{self.log_tail()}",
            )
        except TimeoutError:
            self.stop()
            raise
        self.started_server_pid = self.server_pid
        return self

    def stop(self, grace: float = 60) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # serve.sh forwards it to the server's process group
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left (a failed test may leave a stuck server): by the PIDs we started, never by name.
        for pgid in (self.started_server_pid, self.proc.pid):
            if pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        return self.proc.returncode
