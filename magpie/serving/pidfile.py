"""The pid file of a supervised server (`memguard run --pid-file`, serve.sh's PID_FILE): which
files it may write and remove, and whether the PID in one still names our server. Standard library
only.

A pid file holds one line, the server's PID. The supervisor writes one only where there is none,
or where the one there is stale (its PID names no live process); it removes it at the end only if
it still holds the PID it wrote. Anything else at that path is not ours and is never written or
removed: a file that holds more than a PID (a user's file given as PID_FILE by mistake), a folder,
a link, or a PID file whose PID runs a process that is not a server of ours.

A PID is reused once its process is gone, so a live PID proves nothing by itself: the process is
taken for our server only when it runs as this user, it started before the pid file was last
written (the supervisor writes the file right after the start), and its command line is one the
supervisor starts (vLLM's, `launch exec`'s, or `memguard exec`'s). Only then does a refusal name it
for a stop.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat

__all__ = ["PidFileRefused", "State", "claim", "inspect", "remove_if_ours"]

_PID_LINE = re.compile(rb"\s*([0-9]{1,9})\s*")
# Words of a command line the supervisor starts (serve.sh: `launch exec` execs vLLM, or `memguard
# exec` that execs vLLM; cluster.py: `ray start`).
_OUR_COMMANDS = ("vllm", "magpie", "launch", "memguard", "ray")
_SLACK_S = 2.0  # start time (clock ticks) against the file's mtime: both are rounded


class PidFileRefused(Exception):
    """The pid file may not be written: the message is one line, naming the file."""


@dataclasses.dataclass
class State:
    """What is at a pid file's path: `kind` is absent, stale (replaceable), running (our server,
    `pid`) or foreign (not ours: never written or removed); `why` says it in words."""

    kind: str
    why: str
    pid: int | None = None


def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _started_at(pid: int) -> float | None:
    """The process's start as a Unix time, None when it does not exist (or is a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    boot = _boot_time()
    if fields[0] == "Z" or boot is None:
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def inspect(path: str) -> State:
    """What PATH holds, as a pid file of ours (see the module's text)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return State("absent", f"{path}: no such file")
    except OSError as e:
        return State("foreign", f"{path}: cannot be read ({e.strerror})")
    if not stat.S_ISREG(info.st_mode):
        return State("foreign", f"{path} is not a regular file (a folder, a link or a device)")
    try:
        with open(path, "rb") as f:
            data = f.read(64)
    except OSError as e:
        return State("foreign", f"{path}: cannot be read ({e.strerror})")
    if not data.strip():
        return State("stale", f"{path} is empty")
    match = _PID_LINE.fullmatch(data)
    if match is None:
        return State("foreign", f"{path} holds something other than a PID (a file of yours?)")
    pid = int(match.group(1))
    started = _started_at(pid) if pid > 1 else None
    if started is None:
        return State("stale", f"{path} names PID {pid}, which no longer runs", pid)
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return State("stale", f"{path} names PID {pid}, which no longer runs", pid)
    command = _command(pid)
    ours = (
        owner == os.getuid() and started <= info.st_mtime + _SLACK_S and any(word in command for word in _OUR_COMMANDS)
    )
    if not ours:
        return State(
            "foreign",
            f"{path} names PID {pid}, now a process that is not a server started with this pid file "
            f"({command[:80] or 'unknown command'}, uid {owner}): the PID was reused, or the file is not ours",
            pid,
        )
    return State("running", f"{path} says a server runs as PID {pid} ({command[:80]})", pid)


def claim(path: str) -> None:
    """PidFileRefused (one line) unless a supervisor may write PATH: absent, or stale."""
    state = inspect(path)
    if state.kind == "running":
        raise PidFileRefused(
            f"{state.why}; stop it first (kill -TERM -- -{state.pid}) or choose another pid file (PID_FILE)"
        )
    if state.kind == "foreign":
        raise PidFileRefused(
            f"{state.why}; it is left as it is: choose another pid file (PID_FILE, --pid-file), or remove it "
            "yourself if it is a stale one"
        )


def remove_if_ours(path: str, pid: int) -> None:
    """Remove PATH if it still holds PID (the line the supervisor wrote) and is a regular file."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return
        with open(path, "rb") as f:
            match = _PID_LINE.fullmatch(f.read(64))
        if match is not None and int(match.group(1)) == pid:
            os.unlink(path)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """`python3 pidfile.py check PATH`: exit 0 when PATH may be written, else 1 and one line."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "check":
        print("usage: pidfile.py check PATH", file=sys.stderr)
        return 2
    try:
        claim(args[1])
    except PidFileRefused as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
