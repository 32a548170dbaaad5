"""A server process and its process group, named by PID: who it is, what belongs to it, and the one
way to stop it. Standard library only.

A PID names a process only while it lives (the kernel hands it out again later): (PID, start time)
names one process for good, and `Server` compares both before it signals anything. A server
started in a session of its own leads a process group (vLLM forks its engine core and workers into
it), and a stop then reaches that whole group and nothing else:

    server = Server(pid)                     # ProcessLookupError: no such process
    server.alive()                           # the same process, still running
    server.stop(reason, grace, log, "the watchdog")

The stop sequence, here once (`stop_sequence`) for the memory guard, the watchdog, the supervisor
(`memguard run`) and `ServerProcess`: SIGTERM and SIGCONT (a stopped or traced process acts on
SIGTERM only once it is continued), up to `grace` seconds for it to end, SIGKILL to what is left of
the group, and up to 30 s for the group to empty. `stop_group` runs it on a process group,
`Server.stop` on a server named by PID; nothing else in magpie/serving sends SIGKILL
(tests/serving/test_one_stop_sequence.py holds that).

- `start_time(pid)`, `group_of(pid)`, `group_members(pgid)`, `rss_bytes(pid)`: read from /proc.
- `signal_group(pgid, *signals)`: signals to a group that may be gone already.
- `watch(tool, make)`: the end of a watcher's main (the memory guard's, the watchdog's).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable

from magpie.cli import format_size, run_until_stopped

__all__ = [
    "CANNOT_SIGNAL",
    "KILL_WAIT_S",
    "CannotSignal",
    "Server",
    "group_members",
    "group_of",
    "rss_bytes",
    "signal_group",
    "start_time",
    "stop_group",
    "stop_sequence",
    "watch",
]

CANNOT_SIGNAL = 6  # a watcher's status when it may not signal its server (another user's process)
KILL_WAIT_S = 30  # how long a group may take to empty after SIGKILL (the kernel frees big mappings slowly)


def _stat(pid: int) -> list[str] | None:
    """Fields 3... of /proc/PID/stat (state, ppid, pgrp, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it does not exist or has exited
    (a zombie lacks only its parent's wait())."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return None
    return int(fields[19])


def group_of(pid: int) -> int | None:
    """The process group of PID, or None when there is no such process."""
    fields = _stat(pid)
    return None if fields is None else int(fields[2])


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes in process group PGID."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class CannotSignal(Exception):
    """This process may not signal the server (it belongs to another user): a stop would do nothing."""


def _may_signal(pid: int) -> None:
    """CannotSignal unless this process may send signals to PID (kill(2) with signal 0 checks it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    except PermissionError:
        try:
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            owner = "?"
        raise CannotSignal(
            f"PID {pid} belongs to uid {owner} and this user (uid {os.getuid()}) may not signal it: run the "
            "watcher as that user or as root"
        ) from None


def signal_group(pgid: int, *signums: int) -> None:
    """Send each signal to process group PGID; a group that is gone (or no longer ours) is no error."""
    for signum in signums:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)


def wait_until(done: Callable[[], bool], deadline: float, poll: float = 0.1) -> bool:
    """Poll DONE until it is true (True) or time.monotonic() passes DEADLINE (False)."""
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)
    return True


def stop_sequence(
    send: Callable[[int], None],
    running: Callable[[], bool],
    left: Callable[[], list[int]],
    grace: float,
    *,
    since: float | None = None,
    first: int | None = signal.SIGTERM,
    on_kill: Callable[[list[int]], None] | None = None,
) -> bool:
    """The one stop sequence: FIRST (SIGTERM; SIGINT where a Ctrl-C is passed on; None when the
    caller sent its own first signal) and SIGCONT through SEND, up to GRACE seconds from SINCE
    (default: now) for RUNNING() to turn false, then, where LEFT() still names processes,
    ON_KILL(them), SIGKILL through SEND and up to KILL_WAIT_S for LEFT() to empty. Returns whether
    SIGKILL was sent. Every stop of a server goes through here (`Server.stop`, `stop_group`, the
    supervisor, `ServerProcess.stop`)."""
    since = time.monotonic() if since is None else since
    if first is not None:
        send(first)
        send(signal.SIGCONT)
    wait_until(lambda: not running(), since + grace)
    remaining = left()
    if not remaining:
        return False
    if on_kill is not None:
        on_kill(remaining)
    send(signal.SIGKILL)
    wait_until(lambda: not left(), time.monotonic() + KILL_WAIT_S)
    return True


def stop_group(
    pgid: int,
    grace: float,
    *,
    running: Callable[[], bool] | None = None,
    since: float | None = None,
    first: int | None = signal.SIGTERM,
    on_kill: Callable[[list[int]], None] | None = None,
) -> bool:
    """Stop process group PGID: `stop_sequence` on the group, waiting for RUNNING() (default: the
    group has a live member) to turn false. Returns whether SIGKILL was needed."""

    def members() -> list[int]:
        return group_members(pgid)

    def send(signum: int) -> None:
        signal_group(pgid, signum)

    return stop_sequence(
        send, running or (lambda: bool(members())), members, grace, since=since, first=first, on_kill=on_kill
    )


def watch(tool: str, make: Callable[[], object]) -> int:
    """A watcher's `main` once its options are read: MAKE() the watcher of one server (the memory
    guard, the watchdog) and run it until it returns or is stopped (cli.run_until_stopped); 2 with
    one line when the PID names no process or one in this process's group, CANNOT_SIGNAL (6) when
    this user may not signal the server (at the start, or when a stop was due: never a "stopped"
    line for a server that runs on), 1 when a file it reads or writes fails."""
    try:
        watcher = make()
        return run_until_stopped(watcher.run)
    except CannotSignal as e:
        print(f"{tool}: error: cannot stop the server: {e}", file=sys.stderr)
        return CANNOT_SIGNAL
    except OSError as e:
        if e.filename:  # a file it reads or writes: --log, --meminfo, --server-log, ...
            print(f"{tool}: error: {e.filename}: {e.strerror}", file=sys.stderr)
            return 1
        if isinstance(e, (ProcessLookupError, PermissionError)):  # no such PID, or one of our own group
            print(f"{tool}: error: {e}", file=sys.stderr)
            return 2
        raise


class Server:
    """One server process, by PID and start time, and what a stop of it signals: its process group
    when it leads one (then the group is the server's own), else the process alone."""

    def __init__(self, pid: int, own_group: int | None = None):
        """OWN_GROUP: the caller's process group (default: this process's), which the server must not
        share: a stop of the server would stop its caller too (PermissionError then)."""
        self.pid = pid
        self.started = start_time(pid)
        if self.started is None:
            raise ProcessLookupError(f"--pid {pid}: no such process")
        _may_signal(pid)
        own_group = os.getpgrp() if own_group is None else own_group
        pgid = os.getpgid(pid)
        deadline = time.monotonic() + 5
        while pgid == own_group and time.monotonic() < deadline:
            time.sleep(0.05)  # a launcher may start us before its `setsid` child has run setsid()
            pgid = os.getpgid(pid)
        if pgid == own_group:
            raise PermissionError(
                f"--pid {pid} is in this process's own process group {pgid}: start the server in its own "
                "session (setsid) so that stopping it cannot stop this process and its caller"
            )
        self.group = pgid if pgid == pid else None

    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def signal(self, signum: int) -> None:
        """SIGNUM to the server's group, or to the server alone; nothing once the server is gone (its
        PID may name another process by then) unless it leads a group with members left."""
        try:
            if self.group is not None:
                if self.alive() or group_members(self.group):
                    os.killpg(self.group, signum)
            elif self.alive():
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            _may_signal(self.pid)
            raise CannotSignal(f"{self.target()}: a member may not be signalled by this user") from None

    def target(self) -> str:
        return f"process group {self.group}" if self.group is not None else f"process {self.pid}"

    def ours(self, pid: int) -> bool:
        """Whether PID is the server or a process of its group."""
        return pid == self.pid or (self.group is not None and group_of(pid) == self.group)

    def members(self) -> list[int]:
        """The live processes a stop must end: the group's, or the server alone."""
        if self.group is not None:
            return group_members(self.group)
        return [self.pid] if self.alive() else []

    def stop(self, reason: str, grace: float, log: Callable[[str], None], who: str) -> None:
        """Stop the server for REASON (the stop sequence), saying so through LOG as WHO."""
        log(
            f"{reason}: stopping {self.target()} (server PID {self.pid}, RSS {format_size(rss_bytes(self.pid))}) "
            "with SIGTERM"
        )

        def on_kill(_left: list[int]) -> None:
            if self.alive():  # else only workers the server forked linger in its group
                log(f"server PID {self.pid} still alive after {grace:g} s: SIGKILL to {self.target()}")

        try:
            stop_sequence(self.signal, self.alive, self.members, grace, on_kill=on_kill)
        except CannotSignal as e:
            log(f"{who} could NOT stop server PID {self.pid}: {e}; it still runs")
            raise
        log(f"server PID {self.pid} stopped by {who}")
