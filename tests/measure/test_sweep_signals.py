"""A stopped sweep stops the server it launched: on SIGTERM, and on Ctrl-C under `2>&1 | tee`.

The sweep launches a real vLLM server of the tiny model through serve.sh (in a session of its
own, so neither signal reaches it; eager, as what is checked is the sweep's stop, not compiled
serving) and is stopped in the middle of its first bench run (not earlier: a Ctrl-C there is
caught by the bench, a path of its own):
- SIGTERM to the sweep alone (what a job runner or `kill` sends; Python's default ends the
  process at once, leaving the server running);
- SIGINT to the whole job of `( sweep ) 2>&1 | tee LOG`, as a terminal's Ctrl-C does: tee dies
  with it, so every print of the sweep goes to a dead pipe (a print before the stop used to
  raise and skip it).
Either way, when the sweep has exited no process of serve.sh's or of the server's process
group is left, and the exit status says which signal stopped it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from magpie.serving.process import group_members
from tests.conftest import EAGER
from tests.serving.helpers import PYTHON, tool, vllm_env

pytestmark = pytest.mark.slow

# Enough work that the sweep is still in its first bench run when it is stopped.
GRID = ["--input-lens", "64,96", "--concurrency", "1", "--repeats", "2", "--output-len", "200"]
GRID += ["--prompts-per-point", "4", "--min-free", "1GiB", "--start-timeout", "600"]
GRID += [f"--serve-arg={arg}" for arg in EAGER]


def sweep_args(run_dir: Path, model: Path) -> list[str]:
    return [*tool("sweep"), str(run_dir), "--config", "off:mtp=0", "--model", str(model), *GRID]


def sweep_env() -> dict[str, str]:
    return vllm_env(None, VLLM_PYTHON=PYTHON, MAX_MODEL_LEN="2048", PLE="0")


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.5)


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class LaunchedServer:
    """The process groups of the server the sweep launched: the server's (its PID, from
    serve.sh's own output) and serve.sh's (found up the server's parents while it runs)."""

    def __init__(self, run_dir: Path):
        err = next((run_dir / "servers").glob("off-*.log.serve-sh.err"))
        self.server_pid = int(re.search(r"server PID (\d+)", err.read_text()).group(1))
        pid = self.server_pid
        while b"serve.sh" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            pid = parent(pid)
        self.serve_sh_pid = pid
        self.groups = [self.serve_sh_pid, self.server_pid]

    def left(self) -> list[int]:
        return [pid for group in self.groups for pid in group_members(group)]

    def kill_left(self) -> None:
        """Clean up after a failure: SIGKILL to the groups this test's sweep started, by PGID."""
        for group in self.groups:
            if group_members(group):
                os.killpg(group, signal.SIGKILL)


def started_measuring(log: Path) -> bool:
    return "sweep: [1/" in read(log)


def test_sigterm_to_the_sweep_stops_its_server(tiny_mtp_model, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "sweep.err"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            sweep_args(run_dir, tiny_mtp_model), stdout=subprocess.DEVNULL, stderr=err, env=sweep_env()
        )
    server = None
    try:
        wait_until(lambda: started_measuring(log) or proc.poll() is not None, 900, "the sweep's first run")
        assert proc.poll() is None, read(log)
        server = LaunchedServer(run_dir)
        time.sleep(2)  # inside the bench's requests
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        assert server.left() == [], f"the sweep exited ({code}) and left its server running"
        assert code == 128 + signal.SIGTERM, read(log)
        text = read(log)
        assert "sweep: off: its server stopped" in text and "sweep: stopped by SIGTERM" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.kill_left()


def test_ctrl_c_under_tee_stops_the_server_although_the_pipe_is_dead(tiny_mtp_model, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "sweep.log"
    status = tmp_path / "status"
    # What a user types: `magpie sweep ... 2>&1 | tee sweep.log`; the subshell records the
    # sweep's own exit status. A session of its own: the job's process group, as in a terminal.
    script = f'( "$@"; echo $? > "{status}" ) 2>&1 | tee "{log}"'
    job = subprocess.Popen(
        ["bash", "-c", script, "bash", *sweep_args(run_dir, tiny_mtp_model)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=sweep_env(),
        start_new_session=True,
    )
    server = None
    try:
        wait_until(lambda: started_measuring(log) or job.poll() is not None, 900, "the sweep's first run")
        assert job.poll() is None, read(log)
        server = LaunchedServer(run_dir)
        time.sleep(2)
        os.killpg(job.pid, signal.SIGINT)  # the terminal's Ctrl-C: to every process of the job
        wait_until(lambda: read(status).strip() != "", 120, "the sweep's exit")
        assert server.left() == [], f"the sweep exited ({read(status).strip()}) and left its server running"
        assert read(status).strip() == "130", read(log)
        job.wait(timeout=60)
    finally:
        if group_members(job.pid):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        if server is not None:
            server.kill_left()
