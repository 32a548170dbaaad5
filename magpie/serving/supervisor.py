"""The supervisor of one server (`memguard run`; serve.sh runs vLLM under it, cluster.py a Ray node).
Standard library only.

It starts the command in a session of its own (its PID then leads the process group vLLM forks its
engine core and workers into), writes that PID (--pid-file), has the memory guard watch it in this
process (unless --no-guard), starts the liveness watchdog on it in a process of its own (--watchdog:
an HTTP call that hangs must not hold the guard), stops its group on SIGINT or SIGTERM (SIGKILL
after --grace; what is left of the group after the server exited gets the same), reads the server's
output for an engine death (vLLM's API server exits 0 after one), and under `--watchdog restart`
starts it again after a watchdog stop or an engine death (at most --restarts times; an engine death
only once the server had served). Its exit status is `run`'s (magpie/serving/memguard.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from magpie import cli, files, tool_command
from magpie.serving import bounds, pgroup, pidfile
from magpie.serving import watchdog as watchdog_tool
from magpie.serving.logs import OWN_LINES, SERVING_LINE, Log, LogFollower
from magpie.serving.status import ENGINE_DIED, GUARD_STOPPED, REFUSED, WATCHDOG_DIED, WATCHDOG_STOPPED

__all__ = ["ENGINE_DEATH", "ENGINE_DIED", "GUARD_STOPPED", "WATCHDOG_STOPPED", "Supervisor", "add_run_options"]

# vLLM's lines for an engine core that died (0.29: core.py logs the first when the engine's loop
# fails, async_llm / the API server the second when a request meets the dead engine, core_client's
# monitor the others when the process vanished: "MPClient: engine core exited unexpectedly" after a
# kill -9 of the engine core, seen here). vLLM's API server then shuts down with status 0.
ENGINE_DEATH = re.compile(
    r"EngineCore encountered a fatal error|EngineDeadError|Engine core proc \S+ died unexpectedly|"
    r"Engine core process \S+ died unexpectedly|engine core exited unexpectedly|Engine core initialization failed"
)


class RunRefused(Exception):
    """`run` will not start the command: one line saying which option and why."""


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """`memguard run`'s own options (the guard's are memguard.add_watch_options)."""
    parser.add_argument("--pid-file", help="write the command's PID here (removed when it ends, if still ours)")
    parser.add_argument("--output", help="append the command's stdout and stderr to this file (default: ours)")
    parser.add_argument("--no-guard", action="store_true", help="supervise only: no memory checks")
    parser.add_argument(
        "--watchdog",
        choices=("off", "stop", "restart", "report"),
        default="off",
        help="the liveness watchdog on the command (magpie watchdog) and its policy; restart = stop, then "
        "start the command again",
    )
    parser.add_argument("--watchdog-url", default=cli.DEFAULT_URL, help="the server the watchdog reads")
    parser.add_argument(
        "--watchdog-args", default="", help="more `watchdog watch` options, one string (--watchdog-args='--interval 2')"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the options (the watchdog's too) and the pid file, start nothing (serve.sh does this "
        "before it writes LOG)",
    )
    parser.add_argument(
        "--restarts",
        type=bounds.number(int, 0, 100),
        default=3,
        help="at most this many restarts under --watchdog restart",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")


class Supervisor:
    """`run` with ARGS (its options and the guard's) on CMD; LOG the file of its "[memguard" lines.
    GUARD(pid) makes the memory guard of a started server (an object whose run() returns its status,
    GUARD_STOPPED after a stop; ProcessLookupError when the server is gone already), None for none."""

    def __init__(self, args: argparse.Namespace, cmd: list[str], log, guard: Callable[[int], object] | None) -> None:
        self.args = args
        self.cmd = cmd
        self.log = Log(log, "memguard")  # the guard's tag: both speak for `memguard run`
        self.guard = guard
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.stopper: threading.Thread | None = None  # the stop sequence of a stop under way
        self.engine_death: str | None = None
        self.served = False
        self.helper_died: str | None = None  # the watchdog or the memory guard died while the server ran

    def say(self, message: str) -> None:
        print(f"memguard run: {message}", file=sys.stderr, flush=True)

    # -- a stop that was asked for

    def on_signal(self, signum: int, _frame) -> None:
        self.stopping = True  # no restart after a stop that was asked for
        child = self.child
        if child is None or child.poll() is not None:
            return
        if self.stopper is not None:  # a stop runs already: pass the signal on, its timing holds
            pgroup.signal_group(child.pid, signum, signal.SIGCONT)
            return
        # vLLM can hang in its own shutdown (seen when a stop came while the engine was starting): a
        # stop must end, so the stop sequence runs in a thread of its own, SIGKILL once --grace passed.
        self.stopper = threading.Thread(target=self.stop_server, args=(child, signum, time.monotonic()), daemon=True)
        self.stopper.start()

    def stop_server(self, child: subprocess.Popen, signum: int, since: float) -> None:
        """The stop sequence on the server's group (SIGNUM, the signal this supervisor got, first):
        until the whole group is gone, SIGKILL to what is left --grace seconds after SINCE."""
        grace = self.args.grace

        def on_kill(left: list[int]) -> None:
            if pgroup.start_time(child.pid) is not None and child.returncode is None:
                self.log(f"server PID {child.pid} still running {grace:g} s after SIGTERM: SIGKILL to its group")
            else:
                self.group_left_message(child.pid, left)

        pgroup.stop_group(child.pid, grace, since=since, first=signum, on_kill=on_kill)

    def group_left_message(self, pgid: int, left: list[int]) -> None:
        self.log(
            f"{len(left)} process(es) of the server's group {pgid} (PIDs {' '.join(map(str, left))}) still "
            f"running {self.args.grace:g} s after the server stopped: SIGKILL to the group"
        )

    def group_left(self, pgid: int, since: float) -> None:
        """After the server (the group's leader) exited: the stop sequence for what is left of its
        group (vLLM's engine core and workers outlive a killed API server), SIGKILL once --grace
        seconds have passed since SINCE (the leader's exit). A stop already under way (`stop_server`)
        finishes it instead."""
        if self.stopper is not None:
            self.stopper.join()
            return
        if pgroup.group_members(pgid):
            pgroup.stop_group(
                pgid, self.args.grace, since=since, on_kill=lambda left: self.group_left_message(pgid, left)
            )

    # -- one start

    def start(self) -> subprocess.Popen:
        out = open(self.args.output, "ab") if self.args.output else None  # the child's, closed once it has it
        try:
            child = subprocess.Popen(
                self.cmd,
                start_new_session=True,
                stdin=subprocess.DEVNULL if out else None,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
            )
        finally:
            if out:
                out.close()
        if self.args.pid_file:
            files.atomic_write_text(self.args.pid_file, f"{child.pid}\n")  # claimed by check_run (run())
        where = f", PID file {self.args.pid_file}" if self.args.pid_file else ""
        self.say(f"server PID {child.pid}{where}" + (f", output {self.args.output}" if self.args.output else ""))
        return child

    def start_guard(self, pid: int) -> tuple[threading.Thread | None, list[int]]:
        """The memory guard on PID in a thread of this process, and the list its status lands in."""
        status: list[int] = []
        if self.guard is None:
            return None, status
        try:
            guard = self.guard(pid)
        except ProcessLookupError:  # it has already ended (and been reaped)
            return None, status

        def guard_run() -> None:
            try:
                status.append(guard.run())
            except Exception as e:  # noqa: BLE001 - any failure: the server must not run on unguarded
                self.helper_died = f"the memory guard failed ({type(e).__name__}: {e})"
                self.log(f"{self.helper_died} while server PID {pid} runs: stopping the server")
                self.on_signal(signal.SIGTERM, None)
                self.stopping = False  # not a stop asked for: outcome() reports it

        thread = threading.Thread(target=guard_run, daemon=True)
        thread.start()
        return thread, status

    def watchdog(self, pid: int) -> subprocess.Popen | None:
        if self.args.watchdog == "off":
            return None
        policy = "report" if self.args.watchdog == "report" else "stop"
        cmd = tool_command(sys.executable, "magpie.serving.watchdog", "watch", "--pid", str(pid))
        cmd += ["--url", self.args.watchdog_url, "--on-stall", policy, "--grace", f"{self.args.grace:g}"]
        cmd += ["--log", self.args.log] if self.args.log else []
        output = self.args.output or self.args.server_log
        cmd += (["--server-log", output] if output else []) + watchdog_options(self.args)
        return subprocess.Popen(cmd)

    def read_output(self, follower: LogFollower | None) -> None:
        """Note what the server's output says of its engine: serving, or dead (the first such line)."""
        for line in follower.lines() if follower is not None else ():
            if line.startswith(OWN_LINES):
                continue
            if SERVING_LINE in line:
                self.served = True
            if self.engine_death is None and ENGINE_DEATH.search(line):
                self.engine_death = line.strip()[:300]

    def once(self) -> tuple[int, int, int]:
        """One start of the command: its status, the guard's and the watchdog's; `engine_death` and
        `served` say what its output said."""
        output = self.args.output or self.args.server_log
        follower = LogFollower(output, from_start=False) if output else None
        self.engine_death, self.served, self.helper_died = None, False, None
        self.stopper = None
        child = self.child = self.start()
        guard_thread, guard_status = self.start_guard(child.pid)
        watchdog = self.watchdog(child.pid)
        watchdog_died = None
        while True:
            try:
                status = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                self.read_output(follower)
            code = watchdog.poll() if watchdog is not None else None
            if code is not None and code not in (0, WATCHDOG_STOPPED) and watchdog_died is None and not self.stopping:
                # The protection asked for is gone: the server does not serve on without it.
                watchdog_died = code
                self.log(
                    f"the watchdog exited with status {code} while server PID {child.pid} runs: stopping the "
                    "server (a server is not left running without the watchdog asked for)"
                )
                self.on_signal(signal.SIGTERM, None)
                self.stopping = False  # not a stop asked for: outcome() reports it
        if watchdog_died is not None:
            self.helper_died = f"the watchdog died (status {watchdog_died})"
        self.group_left(child.pid, time.monotonic())
        self.read_output(follower)
        if guard_thread is not None:
            guard_thread.join()
        watchdog_status = watchdog.wait() if watchdog is not None else 0
        return (status if status >= 0 else 128 - status), (guard_status or [0])[0], watchdog_status

    # -- the whole run

    def show_tail(self) -> None:
        if self.args.output:
            with open(self.args.output, errors="replace") as f:
                tail = collections.deque(f, 20)
            sys.stderr.write(f"last lines of {self.args.output}:\n" + "".join(tail))

    def restart(self, restarts: int, after: str) -> bool:
        """Whether `--watchdog restart` has a restart left (and says so in the log)."""
        if self.args.watchdog != "restart" or restarts >= self.args.restarts or self.stopping:
            return False
        self.log(f"restart {restarts + 1} of {self.args.restarts} after {after}")
        return True

    def outcome(self, status: int, guard_status: int, watchdog_status: int, restarts: int) -> int | None:
        """`run`'s status after one start of the command, or None for a restart."""
        where = f"; its reason is in {self.args.log}" if self.args.log else ""
        if self.helper_died is not None:
            self.say(f"{self.helper_died}; the server was stopped{where}")
            return WATCHDOG_DIED
        if guard_status == GUARD_STOPPED:
            self.say(f"the memory guard stopped the server{where} ([memguard] lines)")
            return GUARD_STOPPED
        if watchdog_status == WATCHDOG_STOPPED:
            self.say(f"the watchdog stopped a stalled server{where} ([watchdog] lines)")
            return None if self.restart(restarts, "a stall") else WATCHDOG_STOPPED
        if self.stopping:
            return status
        if self.engine_death is not None:
            self.say(f"the server's engine died (the server exited with status {status}): {self.engine_death}")
            if self.served and self.restart(restarts, "the engine died"):
                return None
            if self.args.watchdog == "restart":
                why = "it died before it served" if not self.served else f"{self.args.restarts} restart(s) done"
                self.say(f"no restart: {why}")
            self.show_tail()
            return ENGINE_DIED
        if status != 0:
            self.say(f"the server exited with status {status}")
            self.show_tail()
        elif self.child is not None:
            self.say(
                f"the server (PID {self.child.pid}) exited with status 0 without a stop from this supervisor "
                "(a signal from elsewhere?) and no engine error in its output"
            )
        return status

    def run(self) -> int:
        try:
            check_run(self.args)  # memguard's main did it before opening --log; again for other callers
        except RunRefused as e:
            self.say(f"error: {e}")
            return REFUSED
        if getattr(self.args, "check", False):
            return 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.on_signal)
        restarts = 0
        try:
            while True:
                if self.stopping:  # a stop came before the (first or next) start
                    return 128 + signal.SIGTERM
                try:
                    statuses = self.once()
                except OSError as e:
                    self.say(f"error: cannot run {self.cmd[0]}: {e.strerror}")
                    return 2
                status = self.outcome(*statuses, restarts)
                if status is not None:
                    return status
                restarts += 1
        finally:
            if self.args.pid_file and self.child is not None:
                pidfile.remove_if_ours(self.args.pid_file, self.child.pid)


def watchdog_options(args: argparse.Namespace) -> list[str]:
    """--watchdog-args as words; RunRefused when `watchdog watch` would not start with them."""
    try:
        words = shlex.split(args.watchdog_args)
    except ValueError as e:
        raise RunRefused(f"--watchdog-args {args.watchdog_args!r}: {e}") from None
    if args.watchdog == "off":
        return words
    probe = ["watch", "--pid", str(bounds.PID_MIN), "--url", args.watchdog_url, *words]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            watchdog_tool.build_parser().parse_args(probe)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        why = lines[-1].split("error: ", 1)[-1] if lines else "not accepted"
        raise RunRefused(
            f"--watchdog-args {args.watchdog_args!r} (serve.sh: WATCHDOG_ARGS): the watchdog would not start: {why}"
        ) from None
    return words


def check_run(args: argparse.Namespace) -> None:
    """Everything `run` can refuse before it starts anything; RunRefused with one line."""
    watchdog_options(args)
    if args.pid_file:
        try:
            pidfile.claim(args.pid_file)
        except pidfile.PidFileRefused as e:
            raise RunRefused(f"--pid-file (serve.sh: PID_FILE): {e}") from None
        folder = os.path.dirname(os.path.abspath(args.pid_file))
        if not os.access(folder, os.W_OK):
            raise RunRefused(f"--pid-file {args.pid_file}: cannot write in {folder}")
    if not getattr(args, "no_guard", True):
        try:
            with open(args.meminfo) as f:
                f.read(1)
        except OSError as e:
            raise RunRefused(f"{args.meminfo}: {e.strerror} (the memory guard reads it)") from None
    if args.output and os.path.isdir(args.output):
        raise RunRefused(f"--output {args.output} is a folder; give the file the command's output goes to")
