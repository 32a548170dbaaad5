#!/usr/bin/env python3
"""Stop one server before the host runs out of memory, and only that server.

On a GB10 the CPU and the GPU share 121 GB: a vLLM server that over-allocates does not get an
out-of-memory error, it wedges the whole box. This guard watches MemAvailable and, when it falls
under a threshold, stops the server it was given, by PID: SIGTERM to the server's process group
(vLLM forks an engine core and workers into it), a grace period, then SIGKILL. It never looks
processes up by name, and it exits as soon as its server exits.

    scripts/flash_next/memguard.py watch --pid 12345 --min-available 6GiB --log server.log
    scripts/flash_next/memguard.py run --min-available 6GiB -- ray start --address=HEAD:6379 --block

`run` starts the command in a session of its own and guards it; it forwards SIGINT and SIGTERM
to it and exits with its status.

Polling can be too slow for a start-up spike (vLLM's profiling run at start-up can wedge a GB10
even at 0.70 GPU memory utilization). Where the kernel allows it (cgroup v2 with the memory
controller available to us), `exec` starts a command under a hard memory limit instead:

    scripts/flash_next/memguard.py exec --max 110GiB -- vllm serve ...

Exit codes of `watch`: 0 the server exited by itself; 3 the guard stopped it; 2 usage error
(no such process, the PID is the guard's own process group). `run`: the command's exit status,
or 3 when the guard stopped it.
`exec` replaces itself with the command; it exits 2 without running anything when no hard
limit can be set (the message says why).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_UNITS.update({"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4})


def parse_size(text: str) -> int:
    """'6GiB' -> 6442450944, '512MiB', '110G' (decimal), '1048576' (bytes)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 6GiB, 512MiB, 110G, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(size: float) -> str:
    return f"{size / 1024**3:.2f} GiB"


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes (the kernel's estimate of memory usable without swapping)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable line (Linux 3.14 or later is needed)")


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it does not exist.

    A PID can be reused once its process is gone; (pid, start time) names one process for good.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":  # a zombie has exited; only its parent's wait() is missing
        return None
    return int(fields[19])


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Guard:
    def __init__(self, pid: int, min_available: int, grace: float, interval: float, log):
        self.pid = pid
        self.min_available = min_available
        self.grace = grace
        self.interval = interval
        self.log_file = log
        self.started = start_time(pid)
        if self.started is None:
            raise ProcessLookupError(f"--pid {pid}: no such process")
        pgid = os.getpgid(pid)
        deadline = time.monotonic() + 5
        while pgid == os.getpgrp() and time.monotonic() < deadline:
            time.sleep(0.05)  # a launcher may start us before its `setsid` child has run setsid()
            pgid = os.getpgid(pid)
        if pgid == os.getpgrp():
            raise PermissionError(
                f"--pid {pid} is in the guard's own process group {pgid}: start the server in its own "
                "session (setsid) so that stopping it cannot stop the guard and its caller"
            )
        # Signal the whole group only when the server leads it (then the group is the server's own).
        self.group = pgid if pgid == pid else None

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[memguard {stamp}] {message}", file=self.log_file, flush=True)

    def alive(self) -> bool:
        return start_time(self.pid) == self.started

    def signal(self, signum: int) -> None:
        if not self.alive():
            return
        try:
            if self.group is not None:
                os.killpg(self.group, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def target(self) -> str:
        return f"process group {self.group}" if self.group is not None else f"process {self.pid}"

    def stop(self, available: int) -> None:
        self.log(
            f"MemAvailable {format_size(available)} < threshold {format_size(self.min_available)}: "
            f"stopping {self.target()} (server PID {self.pid}, RSS {format_size(rss_bytes(self.pid))}) with SIGTERM"
        )
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        if self.alive():
            self.log(f"server PID {self.pid} still alive after {self.grace:g} s: SIGKILL to {self.target()}")
            self.signal(signal.SIGKILL)
        elif self.group is not None:
            # The leader is gone; workers it forked may linger in the group for a moment.
            try:
                os.killpg(self.group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log(f"server PID {self.pid} stopped by the memory guard")

    def run(self) -> int:
        self.log(
            f"guarding server PID {self.pid} ({self.target()}): stop it when MemAvailable < "
            f"{format_size(self.min_available)}; now {format_size(mem_available())}"
        )
        while True:
            if not self.alive():
                self.log(f"server PID {self.pid} exited; the guard exits")
                return 0
            available = mem_available()
            if available < self.min_available:
                self.stop(available)
                return 3
            time.sleep(self.interval)


# --------------------------------------------------------------------------------------------
# Hard limit through cgroup v2


def cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> str | None:
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return left.split()[4]
    return None


def own_cgroup2_path(cgroup_file: str = "/proc/self/cgroup") -> str | None:
    with open(cgroup_file) as f:
        for line in f:
            hierarchy, _, rest = line.rstrip("\n").partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                return path
    return None


def hard_limit_cgroup(limit: int) -> str:
    """Create a child cgroup of our own with memory.max = limit, and move this process into it.

    Raises RuntimeError saying why when the host does not allow it.
    """
    mount = cgroup2_mount()
    own = own_cgroup2_path()
    if mount is None or own is None:
        raise RuntimeError("no cgroup v2 hierarchy is mounted (this host uses cgroup v1 only)")
    parent = os.path.join(mount, own.lstrip("/"))
    controllers_file = os.path.join(parent, "cgroup.controllers")
    try:
        with open(controllers_file) as f:
            controllers = f.read().split()
    except OSError as e:
        raise RuntimeError(f"cannot read {controllers_file}: {e.strerror}") from e
    if "memory" not in controllers:
        raise RuntimeError(
            f"the memory controller is not available in cgroup v2 at {parent} (controllers: "
            f"{' '.join(controllers) or 'none'}); it is bound to a cgroup v1 hierarchy or not delegated"
        )
    child = os.path.join(parent, f"flash-next-{os.getpid()}")
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
        if "memory" not in enabled:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        os.mkdir(child)
        with open(os.path.join(child, "memory.max"), "w") as f:
            f.write(str(limit))
        if os.path.exists(os.path.join(child, "memory.swap.max")):
            with open(os.path.join(child, "memory.swap.max"), "w") as f:
                f.write("0")
        with open(os.path.join(child, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        raise RuntimeError(
            f"cannot set up a memory-limited cgroup under {parent}: {e.strerror} ({e.filename}); "
            "run as a user that owns a delegated cgroup, or wrap the launch in "
            "`systemd-run --user --scope -p MemoryMax=...`"
        ) from e
    return child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="memguard.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_watch = sub.add_parser(
        "watch",
        help="stop the server with PID when MemAvailable falls under a threshold",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_watch.add_argument("--pid", type=int, required=True, help="the server's PID (its process group if it leads one)")
    p_watch.add_argument(
        "--min-available", type=parse_size, default="6GiB", help="stop the server under this MemAvailable"
    )
    p_watch.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p_watch.add_argument("--interval", type=float, default=0.5, help="seconds between two MemAvailable readings")
    p_watch.add_argument("--log", help="append messages to this file (default: stderr)")
    p_run = sub.add_parser(
        "run",
        help="start a command in its own session and guard it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p_run.add_argument(
        "--min-available", type=parse_size, default="6GiB", help="stop the command under this MemAvailable"
    )
    p_run.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p_run.add_argument("--interval", type=float, default=0.5, help="seconds between two MemAvailable readings")
    p_run.add_argument("--log", help="append messages to this file (default: stderr)")
    p_run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    p_exec = sub.add_parser("exec", help="run a command under a cgroup v2 hard memory limit")
    p_exec.add_argument("--max", type=parse_size, required=True, help="memory.max of the new cgroup, e.g. 110GiB")
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    args = parser.parse_args(argv)

    if args.command == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("exec: give the command after --")
        try:
            child = hard_limit_cgroup(args.max)
        except RuntimeError as e:
            # On a systemd host our cgroup is a leaf with processes in it, so no child cgroup can get
            # the memory controller; systemd creates a scope with the limit for us instead.
            if os.path.isdir("/run/systemd/system") and shutil.which("systemd-run"):
                scope = ["systemd-run", "--scope", "--quiet", "--collect", f"--property=MemoryMax={args.max}"]
                scope += ["--property=MemorySwapMax=0"] + (["--user"] if os.geteuid() != 0 else [])
                print(f"memguard: {e}; using a systemd scope with MemoryMax={args.max}", file=sys.stderr)
                os.execvp(scope[0], scope + ["--", *cmd])
            print(f"memguard: error: no hard memory limit possible: {e}; and no systemd to ask", file=sys.stderr)
            return 2
        print(f"memguard: {cmd[0]} runs in {child} with memory.max {format_size(args.max)}", file=sys.stderr)
        os.execvp(cmd[0], cmd)

    log = open(args.log, "a") if args.log else sys.stderr
    if args.command == "run":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            parser.error("run: give the command after --")
        try:
            child = subprocess.Popen(cmd, start_new_session=True)
        except OSError as e:
            print(f"memguard: error: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
            return 2
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda number, _frame: os.killpg(child.pid, number))
        guard = Guard(child.pid, args.min_available, args.grace, args.interval, log)
        stopped = guard.run() == 3
        status = child.wait()
        return 3 if stopped else (status if status >= 0 else 128 - status)
    try:
        guard = Guard(args.pid, args.min_available, args.grace, args.interval, log)
    except (ProcessLookupError, PermissionError) as e:
        print(f"memguard: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return guard.run()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
