"""`magpie install-service`: the unit it writes, checked by systemd's own verifier (Debian's
systemd 252 `systemd-analyze verify`), its policy lines, the refusal to overwrite, and its
command run as systemd would run it (the unit's Environment= and ExecStartPre=/ExecStart=, in an
otherwise empty environment) reaching serve.sh's launch plan with the chosen profile.

A real start / kill / restart needs a running systemd manager; the last test does it where one
runs and says why it cannot where none does (this sandbox: not booted with systemd).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from magpie.serving.process import free_port
from tests.serving.helpers import PYTHON, run_tool

ANALYZE = shutil.which("systemd-analyze")


def unit(tmp_path: Path, *args: str) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    proc = run_tool("install-service", "--model", str(model), "--python", PYTHON, "--print", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key, []).append(value)
    return found


def unquote(value: str) -> list[str]:
    """systemd's word splitting for the quoting install-service emits (double quotes, \\, %%, $$)."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(value)]


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)")
def test_the_printed_unit_passes_systemd_analyze_verify(tmp_path):
    path = tmp_path / "magpie-serve.service"
    path.write_text(unit(tmp_path, "--env", "MTP=3", "--", "--served-model-name", "tiny 100%"))
    proc = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    # The verifier is live here: the same unit with a command that does not exist fails it.
    broken = tmp_path / "broken.service"
    broken.write_text(path.read_text().replace("ExecStart=/", "ExecStart=/nonexistent/"))
    proc = subprocess.run([ANALYZE, "verify", str(broken)], capture_output=True, text=True)
    assert proc.returncode != 0 and "is not executable" in proc.stderr


def test_the_unit_restarts_on_failure_but_not_after_the_guard_and_stops_with_the_grace(tmp_path):
    found = settings(unit(tmp_path, "--stop-grace", "20", "--profile", "hopper", "--run-as", "nobody"))
    assert found["Restart"] == ["on-failure"] and found["RestartPreventExitStatus"] == ["3 4"]
    assert found["SuccessExitStatus"] == ["143"] and found["KillMode"] == ["mixed"]
    assert found["TimeoutStopSec"] == ["35"]  # STOP_GRACE 20 + 15
    assert found["StandardOutput"] == ["journal"] and found["StandardError"] == ["journal"]
    env = dict(v.split("=", 1) for v in found["Environment"])
    assert env["STOP_GRACE"] == "20" and env["PROFILE"] == "hopper" and env["WATCHDOG"] == "restart"
    assert found["User"] == ["nobody"] and found["WantedBy"] == ["multi-user.target"]
    user = settings(unit(tmp_path, "--user"))
    assert "User" not in user and user["WantedBy"] == ["default.target"]


def test_install_writes_the_unit_and_refuses_to_replace_it_without_force(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    args = ["--model", str(model), "--python", PYTHON, "--unit-dir", str(tmp_path / "units"), "--user"]
    args += ["--log", str(tmp_path / "serve.log")]
    proc = run_tool("install-service", *args)
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "units" / "magpie-serve.service"
    assert "systemctl --user daemon-reload" in proc.stdout and path.read_text().startswith("# Written by")
    path.write_text("# the owner's own unit\n")
    proc = run_tool("install-service", *args, "--port", "8200")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: {path} exists; pass --force to replace it (or --name for another unit)"
    assert path.read_text() == "# the owner's own unit\n"
    proc = run_tool("install-service", *args, "--port", "8200", "--force")
    assert proc.returncode == 0 and "Environment=PORT=8200" in path.read_text()


def test_bad_inputs_are_refused_with_one_line(tmp_path):
    proc = run_tool("install-service", "--model", str(tmp_path / "absent"), "--print")
    assert proc.returncode == 1 and proc.stderr.strip().endswith("no such folder (the checkpoint the service serves)")
    proc = run_tool("install-service", "--model", str(tmp_path), "--profile", "nope", "--print")
    assert proc.returncode == 1 and "PROFILE=nope: no such profile" in proc.stderr
    proc = run_tool("install-service", "--model", str(tmp_path), "--env", "MTP", "--print")
    assert proc.returncode == 1 and "--env 'MTP': expected NAME=VALUE" in proc.stderr


def test_the_units_command_reaches_serve_sh_with_its_profile_and_keeps_the_last_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("the previous run\n")
    found = settings(unit(tmp_path, "--log", str(log)))
    env = {"PATH": "/usr/bin:/bin"} | dict(v.split("=", 1) for v in found["Environment"])
    pre = unquote(found["ExecStartPre"][0].removeprefix("-"))
    assert subprocess.run(pre, env=env).returncode == 0
    proc = subprocess.run(unquote(found["ExecStart"][0]), env=env, capture_output=True, text=True, timeout=300)
    # seed-gb10 asks for the n-gram table on disk (PLE=1), which the stock vLLM here lacks: the
    # launch plan refuses before vLLM starts, naming the patch; exit 1 (a failure: restarted).
    assert proc.returncode == 1, proc.stderr
    assert "serve.sh: refusing to start: PLE=1" in proc.stderr and "ple_ssd" in proc.stderr
    assert (tmp_path / "serve.log.1").read_text() == "the previous run\n"


def systemd_manager() -> str | None:
    """Why no systemd manager can run units here, or None when one can."""
    if not os.path.isdir("/run/systemd/system"):
        with open("/proc/1/comm") as f:
            init = f.read().strip()
        return (
            f"no systemd manager: the system was not booted with systemd (PID 1 is {init!r}, no "
            "/run/systemd/system), and `systemd --user` refuses to start for that reason"
        )
    if os.geteuid() != 0:
        return "a system unit needs root"
    return None


@pytest.mark.slow
@pytest.mark.skipif(systemd_manager() is not None, reason=str(systemd_manager()))
def test_systemd_restarts_the_server_after_its_engine_is_killed(tmp_path, tiny_mtp_model):
    name = f"magpie-test-{os.getpid()}"
    log = tmp_path / "serve.log"
    args = ["--model", str(tiny_mtp_model), "--python", PYTHON, "--unit-dir", "/run/systemd/system"]
    args += ["--name", name, "--log", str(log), "--port", str(free_port()), "--profile", "hopper", "--restart-sec", "1"]
    args += ["--env", "PLE=0", "--env", "MAX_MODEL_LEN=2048", "--env", "MEMGUARD=0", "--", "--max-num-seqs", "1"]
    assert run_tool("install-service", *args, "--run-as", "root").returncode == 0
    ctl = ["systemctl"]
    try:
        subprocess.run([*ctl, "daemon-reload"], check=True)
        subprocess.run([*ctl, "start", name], check=True)

        def server_pid(previous: int | None = None) -> int:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                pid_file = Path(f"{log}.pid")
                if pid_file.exists() and (pid := int(pid_file.read_text() or 0)) and pid != previous:
                    return pid
                time.sleep(1)
            raise AssertionError(f"no server PID in {log}.pid")

        first = server_pid()
        os.killpg(first, 9)  # the engine dies: a failure, so systemd starts the unit again
        second = server_pid(first)
        assert second != first
        shown = subprocess.run([*ctl, "show", name, "-p", "NRestarts"], capture_output=True, text=True).stdout
        assert shown.strip() == "NRestarts=1"
    finally:
        subprocess.run([*ctl, "stop", name])
        Path(f"/run/systemd/system/{name}.service").unlink(missing_ok=True)
        subprocess.run([*ctl, "daemon-reload"])
