"""The memory guard (`memguard watch`, `memguard run`, `memguard exec`) on real processes: MemAvailable,
driver errors, PSI, swap, GPU memory, the page cache. No vLLM server is started here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from magpie import cli
from magpie.serving import cgroup, memguard
from magpie.serving.process import group_members
from tests.serving.helpers import run_tool, tool
from tests.serving.test_serve_sh_refusals import _path_without

# --------------------------------------------------------------------------------------------
# Memory guard, on real processes

HOG = textwrap.dedent(
    """
    import os, sys, time
    if os.environ.get("MEMGUARD_TEST_ROLE") == "hungry":
        hold = []
        for _ in range(64):  # up to 4 GiB, 64 MiB at a time, every page written
            hold.append(bytearray(b"\\x01") * (64 << 20))
            time.sleep(0.05)
    time.sleep(120)
    """
)


def _spawn(script: Path, role: str) -> subprocess.Popen:
    env = dict(os.environ, MEMGUARD_TEST_ROLE=role)
    # Identical command lines: the guard must tell them apart by PID, not by name.
    proc = subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True)
    # Right after fork the child may not have exec'd yet (its cmdline reads empty or as ours).
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 30
    while str(script).encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_memguard_stops_the_hungry_process_and_leaves_a_same_named_sibling(tmp_path):
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    sibling = _spawn(script, "idle")
    hungry = _spawn(script, "hungry")
    log = tmp_path / "guard.log"
    try:
        assert Path(f"/proc/{sibling.pid}/cmdline").read_bytes() == Path(f"/proc/{hungry.pid}/cmdline").read_bytes()
        threshold = memguard.mem_available() - (512 << 20)  # just above the current usage
        guard = subprocess.run(
            [*tool("memguard"), "watch", "--pid", str(hungry.pid), "--min-available", str(threshold)]
            + ["--interval", "0.05", "--grace", "10", "--log", str(log)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert guard.returncode == 3, guard.stderr + log.read_text()
        assert hungry.wait(timeout=30) == -signal.SIGTERM
        assert sibling.poll() is None, "the same-named sibling was stopped"
        text = log.read_text()
        assert f"stopping process group {hungry.pid}" in text and "SIGTERM" in text
        assert "stopped by the memory guard" in text
    finally:
        for proc in (hungry, sibling):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_memguard_exits_when_its_server_exits(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], start_new_session=True)
    log = tmp_path / "guard.log"
    guard = subprocess.run(
        [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
        + ["--interval", "0.1", "--log", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    server.wait()
    assert guard.returncode == 0
    assert f"server PID {server.pid} exited; the guard exits" in log.read_text()


def test_memguard_run_guards_the_command_it_starts_and_returns_its_status(tmp_path):
    proc = run_tool("memguard", "run", "--min-available", "1MiB", "--", sys.executable, "-c", "exit(7)")
    assert proc.returncode == 7, proc.stderr
    script = tmp_path / "hog.py"
    script.write_text(HOG)
    threshold = memguard.mem_available() - (512 << 20)
    env = dict(os.environ, MEMGUARD_TEST_ROLE="hungry")
    cmd = ["memguard", "run", "--min-available", str(threshold), "--interval", "0.05", "--grace", "10"]
    proc = run_tool(*cmd, "--", sys.executable, str(script), env=env, timeout=120)
    assert proc.returncode == 3 and "stopped by the memory guard" in proc.stderr


# A server whose worker outlives it: the leader forks a child that ignores SIGTERM (as vLLM's engine
# core took 12 s to go after a kill -9 of its API server), writes the child's PID, and waits.
LEADER_WITH_STUBBORN_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(300)
        os._exit(0)
    with open(sys.argv[1], "w") as f:
        f.write(str(child))
    time.sleep(300)
    """
)


def test_memguard_run_kills_what_outlives_a_killed_server_after_the_grace(tmp_path):
    script = tmp_path / "leader.py"
    script.write_text(LEADER_WITH_STUBBORN_WORKER)
    worker_file, pid_file, log = tmp_path / "worker.pid", tmp_path / "server.pid", tmp_path / "run.log"
    cmd = [*tool("memguard"), "run", "--no-guard", "--grace", "2", "--pid-file", str(pid_file), "--log", str(log)]
    supervisor = subprocess.Popen([*cmd, "--", sys.executable, str(script), str(worker_file)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (worker_file.exists() and worker_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        leader, worker = int(pid_file.read_text()), int(worker_file.read_text())
        os.kill(leader, signal.SIGKILL)
        killed = time.monotonic()
        assert supervisor.wait(timeout=30) == 128 + signal.SIGKILL
        waited = time.monotonic() - killed
        assert group_members(leader) == [], "the worker outlived its server and the grace"  # gone, or a zombie
        assert 2 <= waited < 10, f"the worker got SIGKILL {waited:.1f} s after its server died (--grace 2)"
        text = log.read_text()
        assert f"process(es) of the server's group {leader} (PIDs {worker}) still running 2 s" in text, text
        assert "the server exited with status 137" in supervisor.stderr.read().decode()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(int(worker_file.read_text()), signal.SIGKILL)


def test_memguard_run_says_when_its_server_exits_0_without_a_stop(tmp_path):
    proc = run_tool("memguard", "run", "--no-guard", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 0
    assert "exited with status 0 without a stop from this supervisor" in proc.stderr, proc.stderr


def test_memguard_refuses_a_pid_in_its_own_process_group(tmp_path):
    # Stopping this group would stop the guard and its caller too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        proc = run_tool("memguard", "watch", "--pid", str(child.pid), timeout=60)
        assert proc.returncode == 2
        assert "own process group" in proc.stderr
    finally:
        child.kill()
        child.wait()


def _cgroup2_memory_available() -> bool:
    mount, own = cgroup.cgroup2_mount(), cgroup.own_cgroup2_path()
    if mount is None or own is None:
        return False
    try:
        return "memory" in Path(mount, own.lstrip("/"), "cgroup.controllers").read_text().split()
    except OSError:
        return False


def test_memguard_hard_limit_runs_the_command_under_memory_max_or_says_why_not(tmp_path):
    out = tmp_path / "cgroup.txt"
    cmd = [
        sys.executable,
        "-c",
        f"import pathlib; pathlib.Path({str(out)!r}).write_text(open('/proc/self/cgroup').read())",
    ]
    proc = run_tool("memguard", "exec", "--max", "2GiB", "--", *cmd, timeout=60)
    if _cgroup2_memory_available() or os.path.isdir("/run/systemd/system"):
        assert proc.returncode == 0, proc.stderr
        assert "magpie-" in out.read_text() or "scope" in proc.stderr
    else:
        # This host (cgroup v1 memory controller, no systemd): a clear refusal, and the command never ran.
        assert proc.returncode == 2
        assert "no hard memory limit possible" in proc.stderr
        assert not out.exists()


def test_memguard_parses_sizes():
    assert cli.parse_size("6GiB") == 6 << 30
    assert cli.parse_size("512MiB") == 512 << 20
    assert cli.parse_size("110G") == 110 * 10**9
    assert cli.parse_size("1048576") == 1 << 20
    with pytest.raises(Exception, match="not a size"):
        cli.parse_size("six gigs")


# --------------------------------------------------------------------------------------------
# Memory guard: the signals besides MemAvailable, on real processes


def _idle_server() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def _watch(pid: int, log: Path, *options: str, timeout: float = 60) -> subprocess.Popen:
    cmd = [*tool("memguard"), "watch", "--pid", str(pid), "--min-available", "1MiB"]
    cmd += ["--interval", "0.1", "--grace", "5", "--log", str(log), "--kernel-log", "none", *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _replace(path: Path, text: str) -> None:
    """Write a file the guard polls in one step, as the kernel presents /proc files (never half-written)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _wait_for(path: Path, needle: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in {path} after {timeout} s:\n{text}")


@pytest.mark.parametrize(
    "source, line",
    [
        ("server", "RuntimeError: CUDA error: cudaErrorMemoryAllocation: out of memory"),
        ("server", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("kernel", "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)"),
    ],
)
def test_memguard_stops_its_server_on_a_driver_out_of_memory_line(tmp_path, source, line):
    server, sibling = _idle_server(), _idle_server()
    server_log, kernel_log, guard_log = tmp_path / "server.log", tmp_path / "kern.log", tmp_path / "guard.log"
    # serve.sh's header explains the GB10 settings by the very errors they avoid: not evidence.
    server_log.write_text(
        "# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (... NV_ERR_NO_MEMORY ...)\nINFO start\n"
    )
    kernel_log.write_text("an old line: NVRM: Xid (PCI:0000:01:00): 31, pid=1, name=x\n")  # history: not acted on
    try:
        guard = _watch(server.pid, guard_log, "--server-log", str(server_log), "--kernel-log", str(kernel_log))
        _wait_for(guard_log, "driver errors: stop on server log")
        time.sleep(0.5)
        assert guard.poll() is None, "a line from before the guard started stopped the server"
        with open(server_log if source == "server" else kernel_log, "a") as f:
            f.write(line + "\n")
        assert guard.wait(timeout=30) == 3, guard_log.read_text()
        assert server.wait(timeout=10) == -signal.SIGTERM
        assert sibling.poll() is None
        text = guard_log.read_text()
        assert f"driver error in {'server log ' + str(server_log) if source == 'server' else 'kernel log'}" in text
        assert line[:40] in text and f"stopping process group {server.pid}" in text
        # log_check reads the guard's stop line back, whatever the signal was (not only MemAvailable).
        check = run_tool("log-check", str(guard_log), "--expect", "memguard=stopped the server", timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        for proc in (server, sibling):
            proc.kill()
            proc.wait()


def test_memguard_leaves_its_server_on_an_xid_of_another_process(tmp_path):
    server = _idle_server()
    kernel_log, guard_log = tmp_path / "kern.log", tmp_path / "guard.log"
    kernel_log.write_text("")
    try:
        guard = _watch(server.pid, guard_log, "--kernel-log", str(kernel_log))
        _wait_for(guard_log, "kernel log: ")
        other = os.getpid()  # not in the server's process group
        with open(kernel_log, "a") as f:
            f.write(f"NVRM: Xid (PCI:0000:01:00): 13, pid={other}, name=python3, Graphics Exception\n")
        _wait_for(guard_log, f"driver error of another process (PID {other})")
        assert guard.poll() is None and server.poll() is None
        with open(kernel_log, "a") as f:
            f.write(f"NVRM: Xid (PCI:0000:01:00): 31, pid={server.pid}, name=python3, MMU Fault\n")
        assert guard.wait(timeout=30) == 3
    finally:
        server.kill()
        server.wait()


def test_memguard_stops_on_psi_full_pressure_and_warns_on_some(tmp_path):
    server = _idle_server()
    psi, guard_log = tmp_path / "memory.pressure", tmp_path / "guard.log"
    _replace(psi, "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    try:
        guard = _watch(server.pid, guard_log, "--psi-file", str(psi), "--max-psi-full", "20", "--warn-psi-some", "10")
        _wait_for(guard_log, f"PSI: {psi}")
        _replace(psi, "some avg10=15.00 avg60=3.00 avg300=1.00 total=9\nfull avg10=4.00 avg60=1.0 avg300=0.2 total=5\n")
        _wait_for(guard_log, "warning: memory pressure rising: PSI some avg10 15.00 %")
        assert guard.poll() is None
        _replace(psi, "some avg10=60.00 avg60=9.00 avg300=1.00 total=99\nfull avg10=35.50 avg60=6 avg300=1 total=50\n")
        assert guard.wait(timeout=30) == 3
        assert "memory pressure: PSI full avg10 35.50 % >= 20 %" in guard_log.read_text()
        assert server.wait(timeout=10) == -signal.SIGTERM
    finally:
        server.kill()
        server.wait()


def test_memguard_says_when_psi_is_missing_and_keeps_guarding(tmp_path):
    server = _idle_server()
    guard_log = tmp_path / "guard.log"
    try:
        guard = _watch(server.pid, guard_log, "--psi-file", str(tmp_path / "absent"))
        text = _wait_for(guard_log, "GPU memory: ")
        assert f"PSI: not available ({tmp_path / 'absent'} missing" in text
        assert guard.poll() is None
    finally:
        server.kill()
        server.wait()
    assert guard.wait(timeout=30) == 0


def test_memguard_stops_when_swap_in_use_grows(tmp_path):
    # Swap cannot be filled on purpose on a shared machine: a meminfo file in /proc's format stands in.
    real = Path("/proc/meminfo").read_text()

    def meminfo(swap_free_kib: int) -> str:
        lines = [line for line in real.splitlines() if not line.startswith(("SwapTotal:", "SwapFree:"))]
        return "\n".join(lines + ["SwapTotal:       8388608 kB", f"SwapFree:        {swap_free_kib} kB"]) + "\n"

    fake = tmp_path / "meminfo"
    _replace(fake, meminfo(8388608))
    server, guard_log = _idle_server(), tmp_path / "guard.log"
    try:
        guard = _watch(server.pid, guard_log, "--meminfo", str(fake), "--max-swap-growth", "1GiB")
        _wait_for(guard_log, "swap: stop when swap in use grows by 1.00 GiB (now 0.00 GiB)")
        _replace(fake, meminfo(8388608 - 512 * 1024))  # 0.5 GiB: under the limit
        time.sleep(0.5)
        assert guard.poll() is None
        _replace(fake, meminfo(8388608 - 1536 * 1024))
        assert guard.wait(timeout=30) == 3
        assert "swap in use grew by 1.50 GiB to 1.50 GiB" in guard_log.read_text()
    finally:
        server.kill()
        server.wait()


def test_memguard_reports_gpu_memory_where_the_driver_gives_it_and_says_why_not(tmp_path):
    # No NVIDIA driver here: the guard must say so and keep guarding. Then a stand-in nvidia-smi that
    # prints what the real one prints for `--query-gpu=memory.free,memory.total --format=csv,noheader,nounits`:
    # "[N/A], [N/A]" on a GB10 (unified memory), MiB figures on a discrete GPU.
    server = _idle_server()
    try:
        log = tmp_path / "none.log"
        env = dict(os.environ, PATH=_path_without(tmp_path / "a", "nvidia-smi"))
        guard = subprocess.Popen(
            [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
            + ["--kernel-log", "none", "--log", str(log)],
            env=env,
        )
        text = _wait_for(log, "GPU memory: ")
        if "libnvidia-ml" not in text and "NVML unavailable" not in text:
            pytest.skip("this host has an NVIDIA driver")
        assert "GPU memory: not available (NVML unavailable" in text and "no nvidia-smi on PATH" in text
        guard.terminate()
        guard.wait(timeout=10)
        for name, output, needle, stops in (
            ("gb10", "[N/A], [N/A]", "nvidia-smi reports no memory figures ([N/A], [N/A])", False),
            ("h200", "1024, 143771", "GPU 0 free memory 1.00 GiB of 140.40 GiB < threshold 4.00 GiB", True),
        ):
            bin_dir = tmp_path / name
            bin_dir.mkdir()
            smi = bin_dir / "nvidia-smi"
            smi.write_text(f"#!/bin/sh\necho '{output}'\n")
            smi.chmod(0o755)
            log = tmp_path / f"{name}.log"
            guard = subprocess.Popen(
                [*tool("memguard"), "watch", "--pid", str(server.pid), "--min-available", "1MiB"]
                + ["--kernel-log", "none", "--log", str(log), "--gpu-memory", "nvidia-smi", "--min-gpu-free", "4GiB"]
                + ["--interval", "0.1", "--gpu-interval", "0.1"],
                env=dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"),
            )
            if stops:
                assert guard.wait(timeout=30) == 3
                assert needle in log.read_text()
                server = _idle_server()
            else:
                assert needle in _wait_for(log, "GPU memory: ")
                time.sleep(0.5)
                assert guard.poll() is None
                guard.terminate()
                guard.wait(timeout=10)
    finally:
        server.kill()
        server.wait()


def test_memguard_warns_when_the_page_cache_is_dropped(tmp_path):
    # drop_caches would slow every session on this shared machine; evicting one file of our own
    # (posix_fadvise DONTNEED) makes the same kind of sudden Cached drop for the kernel's counters.
    data = tmp_path / "table.bin"
    with open(data, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(64 << 20))  # 768 MiB
        f.flush()
        os.fsync(f.fileno())
    with open(data, "rb") as f:
        while f.read(64 << 20):
            pass
    server, guard_log = _idle_server(), tmp_path / "guard.log"
    try:
        guard = _watch(
            server.pid,
            guard_log,
            "--cache-drop-min",
            "600MiB",
            "--cache-drop-fraction",
            "0",
            "--cache-drop-window",
            "3",
        )
        _wait_for(guard_log, "GPU memory: ")
        time.sleep(1)
        assert "page cache dropped" not in guard_log.read_text()
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        text = _wait_for(guard_log, "warning: page cache dropped: Cached", timeout=10)
        assert "magpie ple-warmup warm" in text
        assert guard.poll() is None, "a dropped page cache is a warning, not a reason to stop"
    finally:
        server.kill()
        server.wait()
