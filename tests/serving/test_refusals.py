"""Issue 28, the serving tools: bad inputs refused with one line and a non-zero exit, through the
real entry points (serve.sh, `python3 magpie TOOL`), against real processes. No vLLM server is
needed: where a tool wants a server's PID, a dummy long-running process stands in (started here in
a session of its own, stopped here by its PID).

Each class of the issue has a test that fails on the code before the fix:
- pid files we did not create are never written or removed, nor named for a kill;
- asked-for protection that cannot start (WATCHDOG_ARGS) refuses the start; a watchdog that dies
  later stops the server;
- a guard that may not signal its server exits 6 without claiming a stop;
- every threshold has a range, refused outside it with the flag named;
- serve.sh refuses bad PORT / MEMGUARD_ARGS / MEM_HARD_LIMIT before writing LOG;
- cluster check waits a bounded time at the address given; ple-warmup bounds a safetensors header;
  install-service writes no injected directive and no unit outside its folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

from magpie.serving import pgroup
from magpie.serving.process import SERVE_SH, free_port
from tests.serving.helpers import PYTHON, tool

SETPRIV = shutil.which("setpriv")


def run(cmd, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The refusal's last line; no traceback anywhere."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, f"no message (exit {proc.returncode})"
    return lines[-1]


def start_dummy(*argv: str) -> subprocess.Popen:
    """A long-running stand-in for a server, leading a process group of its own."""
    return subprocess.Popen(list(argv) or ["sleep", "300"], start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        pgroup.signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def dummy():
    """The module's one process of its own; `before` holds the test session's children that were
    already running when the module started (the session's shared server pool), not the module's."""
    before = set(_children())
    proc = start_dummy()
    proc.before = before
    yield proc
    stop(proc)


def _children() -> list[int]:
    """The live child processes of this test process."""
    me = os.getpid()
    return [
        pid
        for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if _ppid(pid) == me and pgroup.start_time(pid) is not None
    ]


def serve_sh(tmp_path: Path, **settings: str) -> tuple[subprocess.CompletedProcess, Path]:
    """serve.sh LOG with the test venv's Python and an empty MODEL folder; returns (result, LOG)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    log = tmp_path / "serve.log"
    env = dict(os.environ, MODEL=str(model), VLLM_PYTHON=PYTHON, **settings)
    return run(["bash", str(SERVE_SH), str(log)], timeout=300, env=env, cwd=tmp_path), log


def assert_nothing_written(log: Path) -> None:
    assert not log.exists(), f"{log} was written before the refusal"
    assert not Path(f"{log}.launch.json").exists(), "LOG.launch.json was written before the refusal"


# --------------------------------------------------------------------------------------------
# pid files


def test_a_users_file_as_pid_file_is_neither_written_nor_removed(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    marker = tmp_path / "started"
    proc = run([*tool("memguard"), "run", "--no-guard", "--pid-file", str(mine), "--", "touch", str(marker)])
    assert proc.returncode == 2, proc.stderr
    assert "notes.txt holds something other than a PID" in one_line_error(proc)
    assert mine.read_text() == "my notes\n" and not marker.exists()
    # serve.sh: the same, refused before LOG is written
    result, log = serve_sh(tmp_path, PID_FILE=str(mine))
    assert result.returncode == 1 and "PID_FILE" in one_line_error(result), result.stderr
    assert mine.read_text() == "my notes\n"
    assert_nothing_written(log)


def test_a_stale_pid_file_naming_another_process_is_not_named_for_a_kill(tmp_path, dummy):
    pid_file = tmp_path / "serve.log.pid"
    pid_file.write_text(f"{dummy.pid}\n")
    os.utime(pid_file, (time.time() - 86400, time.time() - 86400))  # written long before that process started
    result, log = serve_sh(tmp_path, PID_FILE=str(pid_file))
    line = one_line_error(result)
    assert result.returncode == 1 and f"PID {dummy.pid}" in line, result.stderr
    assert "kill" not in result.stderr and "not a server started with this pid file" in line
    assert pid_file.read_text() == f"{dummy.pid}\n" and dummy.poll() is None
    assert_nothing_written(log)


def test_a_running_server_of_ours_is_named_and_its_pid_file_kept_then_removed_by_its_supervisor(tmp_path):
    pid_file = tmp_path / "server.pid"
    # A dummy whose command line is a server's (the check reads the command line, start time and owner).
    first = subprocess.Popen(
        [*tool("memguard"), "run", "--no-guard", "--pid-file", str(pid_file), "--"]
        + [PYTHON, "-c", "import time; time.sleep(60)", "vllm"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        server = int(pid_file.read_text())
        second = run([*tool("memguard"), "run", "--no-guard", "--pid-file", str(pid_file), "--", "true"])
        assert second.returncode == 2
        assert f"a server runs as PID {server}" in one_line_error(second)
        assert f"kill -TERM -- -{server}" in second.stderr
        assert pid_file.read_text() == f"{server}\n"
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=60)
    assert not pid_file.exists(), "the supervisor left the pid file it wrote"


# --------------------------------------------------------------------------------------------
# the watchdog asked for


def test_watchdog_args_it_cannot_start_with_refuse_the_start(tmp_path):
    marker = tmp_path / "started"
    cmd = [*tool("memguard"), "run", "--no-guard", "--watchdog", "stop", "--watchdog-args=--stall-after banana"]
    proc = run([*cmd, "--", "sh", "-c", f"touch {marker}; sleep 3"])
    assert proc.returncode == 2 and "--stall-after" in one_line_error(proc), proc.stderr
    assert not marker.exists(), "the server started without its watchdog"
    result, log = serve_sh(tmp_path, WATCHDOG="stop", WATCHDOG_ARGS="--stall-after banana")
    assert result.returncode == 1 and "--stall-after" in one_line_error(result), result.stderr
    assert_nothing_written(log)


def test_a_watchdog_that_dies_stops_the_server(tmp_path):
    log = tmp_path / "run.log"
    server = None
    supervisor = subprocess.Popen(
        [*tool("memguard"), "run", "--no-guard", "--grace", "5", "--log", str(log), "--watchdog", "stop"]
        + ["--watchdog-url", f"http://127.0.0.1:{free_port()}", "--", "sleep", "300"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        watchdog = server = None
        while (watchdog is None or server is None) and time.monotonic() < deadline:
            time.sleep(0.2)
            for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == supervisor.pid and argv[2:4] == [b"watchdog", b"watch"]:
                    watchdog = pid
                elif ppid == supervisor.pid and argv[:1] == [b"sleep"]:
                    server = pid
        assert watchdog and server, "the supervisor did not start the server and its watchdog"
        os.kill(watchdog, signal.SIGKILL)
        status = supervisor.wait(timeout=60)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if server:  # on a failure, the server the supervisor left (its own session)
            pgroup.signal_group(server, signal.SIGKILL)
    assert status == 7, supervisor.stderr.read()
    assert pgroup.start_time(server) is None, "the server runs on without its watchdog"
    assert "the watchdog exited with status -9" in log.read_text()


def test_a_memory_guard_that_fails_stops_the_server(tmp_path):
    # The guard reads --meminfo every interval: a file that vanishes under it (here, deleted) ended
    # the guard's thread with a traceback while the server ran on unguarded.
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(Path("/proc/meminfo").read_text())
    log = tmp_path / "run.log"
    server = None
    supervisor = subprocess.Popen(
        [*tool("memguard"), "run", "--meminfo", str(meminfo), "--kernel-log", "none", "--grace", "5"]
        + ["--interval", "0.2", "--log", str(log), "--", "sleep", "300"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "guarding server PID" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.2)
        server = int(log.read_text().split("guarding server PID ")[1].split()[0])
        meminfo.unlink()
        status = supervisor.wait(timeout=60)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if server:  # on a failure, the server the supervisor left (its own session)
            pgroup.signal_group(server, signal.SIGKILL)
    assert status == 7, supervisor.stderr.read()
    assert pgroup.start_time(server) is None, "the server runs on without its memory guard"
    assert "the memory guard failed (FileNotFoundError" in log.read_text()


# --------------------------------------------------------------------------------------------
# a guard that may not signal its server


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to act as another user")
def test_a_guard_that_cannot_signal_its_server_says_so_and_exits_6(dummy):
    # The guard runs as nobody; the server (the dummy) is root's. A threshold just under MemTotal
    # would have the guard stop the server at once, were it able to.
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    proc = run(
        [SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", *tool("memguard"), "watch"]
        + ["--pid", str(dummy.pid), "--min-available", str(total - (1 << 20)), "--kernel-log", "none"],
        env=dict(os.environ, HOME="/"),
    )
    line = one_line_error(proc)
    assert proc.returncode == 6, proc.stderr
    assert "may not signal" in line and len(proc.stderr.strip().splitlines()) == 1
    assert "stopped by" not in proc.stderr
    assert dummy.poll() is None


# --------------------------------------------------------------------------------------------
# thresholds


@pytest.mark.parametrize(
    ("tool_name", "flag", "value"),
    [
        ("watchdog", "--probe-timeout", "0"),
        ("watchdog", "--stall-after", "0"),
        ("watchdog", "--interval", "0"),
        ("watchdog", "--interval", "-1"),
        ("watchdog", "--grace", "-1"),
        ("watchdog", "--pid", "1"),
        ("watchdog", "--url", "127.0.0.1:8100"),
        ("memguard", "--max-psi-full", "-5"),
        ("memguard", "--min-available", "100000GiB"),
        ("memguard", "--interval", "0"),
        ("memguard", "--interval", "-1"),
        ("memguard", "--grace", "-1"),
        ("memguard", "--pid", "1"),
    ],
)
def test_thresholds_out_of_range_are_refused_naming_the_flag(dummy, tool_name, flag, value):
    args = ["--pid", str(dummy.pid)] if flag != "--pid" else []
    if tool_name == "watchdog":
        args += ["--url", f"http://127.0.0.1:{free_port()}"] if flag != "--url" else []
    proc = run([*tool(tool_name), "watch", *args, flag, value], timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}: " in one_line_error(proc)
    assert dummy.poll() is None


def test_ordinary_mistakes_are_one_line_errors(tmp_path, dummy):
    proc = run([*tool("memguard"), "watch", "--pid", str(dummy.pid), "--log", str(tmp_path)])
    assert proc.returncode == 2 and "is a folder" in one_line_error(proc)
    proc = run([*tool("watchdog"), "watch", "--pid", str(dummy.pid), "--log", str(tmp_path)])
    assert proc.returncode == 2 and "is a folder" in one_line_error(proc)
    missing = tmp_path / "no-meminfo"
    proc = run([*tool("memguard"), "watch", "--pid", str(dummy.pid), "--meminfo", str(missing)])
    assert proc.returncode == 1 and str(missing) in one_line_error(proc)
    assert dummy.poll() is None


# --------------------------------------------------------------------------------------------
# serve.sh refuses before it writes anything


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"PORT": "99999"}, "PORT=99999"),
        ({"PORT": "0"}, "PORT=0"),
        ({"MEMGUARD_ARGS": "--no-such-option"}, "--no-such-option"),
        ({"MEMGUARD_ARGS": "--max-psi-full -5"}, "--max-psi-full"),
        ({"MEM_HARD_LIMIT": "lots"}, "MEM_HARD_LIMIT=lots"),
        ({"STOP_GRACE": "99999999"}, "STOP_GRACE"),
    ],
)
def test_serve_sh_refuses_before_writing_log(tmp_path, settings, named):
    result, log = serve_sh(tmp_path, **settings)
    assert result.returncode == 1, result.stderr
    line = one_line_error(result)
    assert line.startswith("serve.sh: refusing to start:") and named in line
    assert_nothing_written(log)


# --------------------------------------------------------------------------------------------
# cluster check, ple-warmup, install-service


def test_cluster_check_with_no_cluster_answers_in_one_line_within_its_timeout(tmp_path):
    port = free_port()
    proc = run([*tool("cluster"), "check", "--head", f"127.0.0.1:{port}", "--connect-timeout", "5"], timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"no Ray cluster at 127.0.0.1:{port}" in one_line_error(proc)
    assert len(proc.stderr.strip().splitlines()) == 1
    # Something listens there, but no Ray: Ray's connect retries; the wait is bounded all the same.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        proc = run([*tool("cluster"), "check", "--head", address, "--connect-timeout", "10"], timeout=120)
        took = time.monotonic() - started
    assert proc.returncode == 1 and f"no Ray cluster at {address}" in one_line_error(proc), proc.stderr
    assert took < 60, f"cluster check waited {took:.0f} s with --connect-timeout 10"


def safetensors(path: Path, header_len: int | None = None) -> None:
    """A one-tensor safetensors file of the table's name (4 pages of data), or a file whose
    header length says HEADER_LEN."""
    header = json.dumps(
        {"ngram_embedding.shard_0.weight": {"dtype": "U8", "shape": [16384], "data_offsets": [0, 16384]}}
    ).encode()
    length = len(header) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + header + bytes(16384))


def test_ple_warmup_refuses_a_huge_header_and_a_zero_chunk(tmp_path):
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    safetensors(hostile / "model.safetensors", header_len=1 << 40)
    proc = run([*tool("ple-warmup"), "status", str(hostile)])
    assert proc.returncode == 1 and "MemoryError" not in proc.stderr
    assert "header claims 1099511627776 bytes" in one_line_error(proc)
    model = tmp_path / "model"
    model.mkdir()
    safetensors(model / "model.safetensors")
    assert run([*tool("ple-warmup"), "warm", str(model), "--budget", "1MiB", "--quiet"]).returncode == 0
    proc = run([*tool("ple-warmup"), "warm", str(model), "--budget", "1MiB", "--chunk", "0"])
    assert proc.returncode == 2 and "argument --chunk" in one_line_error(proc)


def install_service(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return run([*tool("install-service"), "--model", str(model), "--python", PYTHON, *args])


def test_install_service_refuses_injection_paths_and_values_serve_sh_refuses(tmp_path):
    units = tmp_path / "units"
    proc = install_service(tmp_path, "--print", "--env", "MTP=3\nExecStartPre=/bin/touch /tmp/owned")
    assert proc.returncode == 1 and "ExecStartPre" not in proc.stdout
    assert "control character" in one_line_error(proc) and len(proc.stderr.strip().splitlines()) == 1
    proc = install_service(tmp_path, "--name", "../x", "--unit-dir", str(units))
    assert proc.returncode == 1 and "--name" in one_line_error(proc)
    assert not (tmp_path / "x.service").exists() and not units.exists()
    for args, named in [
        (("--env", "STOP_GRACE=-5"), "STOP_GRACE=-5"),
        (("--port", "0"), "PORT=0"),
        (("--env", "PORT=99999"), "PORT=99999"),
        (("--env", "WATCHDOG=sometimes"), "WATCHDOG=sometimes"),
    ]:
        proc = install_service(tmp_path, "--print", *args)
        assert proc.returncode == 1 and named in one_line_error(proc), (args, proc.stderr)
    # A value systemd would read differently is quoted so that it reads back as given.
    proc = install_service(tmp_path, "--print", "--env", 'SERVED_MODEL_NAME=a $b 100% "c"')
    assert proc.returncode == 0, proc.stderr
    assert 'Environment="SERVED_MODEL_NAME=a $b 100%% \\"c\\""' in proc.stdout.splitlines()
    if shutil.which("systemd-analyze"):
        unit = tmp_path / "magpie-serve.service"
        unit.write_text(proc.stdout)
        verify = run(["systemd-analyze", "verify", str(unit)])
        assert verify.returncode == 0 and verify.stderr == "", verify.stderr


def test_nothing_is_left_running(dummy):
    """The module's dummy is its only process; a refusal started none of its own (the session's
    pooled servers, running before the module began, are not the module's)."""
    assert dummy.poll() is None
    children = [pid for pid in _children() if pid != dummy.pid and pid not in dummy.before]
    assert children == [], children


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
