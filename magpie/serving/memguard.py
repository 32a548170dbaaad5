#!/usr/bin/env python3
"""Stop one server before the host runs out of memory, and only that server.

On a GB10 the CPU and the GPU share 121 GB: a vLLM server that over-allocates does not get a clean
out-of-memory error, it wedges the whole box, and owners saw that happen while MemAvailable still
showed ~22 GiB. So the guard watches what precedes a wedge, not MemAvailable alone:

  MemAvailable   under --min-available (/proc/meminfo)                          -> stop
  driver errors  NV_ERR_NO_MEMORY, cudaErrorMemoryAllocation, CUDA_ERROR_OUT_OF_MEMORY,
                 "CUDA out of memory", NVRM Xid, in the server log (--server-log) and the
                 kernel log (--kernel-log: /dev/kmsg when readable)                 -> stop
  PSI            "full avg10" of /proc/pressure/memory at or over --max-psi-full    -> stop
                 "some avg10" at or over --warn-psi-some                            -> warning
  swap           swap in use grown by --max-swap-growth since the guard started     -> stop
  GPU memory     as the driver reports it (NVML, else nvidia-smi), where it does:
                 free under --min-gpu-free (off by default)                         -> stop;
                 a GB10 reports no framebuffer figures, and the guard says so
  page cache     Cached falls by --cache-drop-min within --cache-drop-window s
                 (`echo 3 > /proc/sys/vm/drop_caches`): the n-gram table is read
                 from disk again                                                    -> warning

Stopping is by PID (magpie/serving/pgroup.py holds the one stop sequence): SIGTERM (and SIGCONT,
so a stopped process can act on it) to the server's process group (vLLM forks an engine core and
workers into it), a grace period, then SIGKILL. It never looks processes up by name, and it exits
as soon as its server exits.

    python3 magpie memguard watch --pid 12345 --min-available 6GiB --log server.log --server-log server.log
    python3 magpie memguard run --min-available 6GiB -- ray start --address=HEAD:6379 --block

`run` is the supervisor of one server (magpie/serving/supervisor.py; serve.sh runs vLLM under
it): it starts the command in a session of its own, writes its PID (--pid-file), guards it (or
not: --no-guard), starts the liveness watchdog on it (--watchdog stop|restart|report), stops its
process group on SIGINT or SIGTERM (SIGKILL after --grace; what is left of the group after the
server exited gets the same), reads the server's output for an engine death (vLLM's API server
exits 0 after one), starts it again after a watchdog stop or an engine death under `--watchdog
restart` (at most --restarts times; an engine death only once the server had served), and exits
with its status:

    python3 magpie memguard run --pid-file server.pid --output server.log --log server.log \
        --server-log server.log --watchdog restart --watchdog-url http://127.0.0.1:8100 -- vllm serve ...

Polling can be too slow for a start-up spike (vLLM's profiling run at start-up can wedge a GB10
even at 0.70 GPU memory utilization). Where the kernel allows it (cgroup v2 with the memory
controller available to us), `exec` starts a command under a hard memory limit instead
(magpie/serving/cgroup.py):

    python3 magpie memguard exec --max 110GiB -- vllm serve ...

(A cgroup limit bounds what the kernel accounts to the cgroup; owners saw GPU-side allocations on
a GB10 escape it, so it complements the guard and does not replace it.)

Exit codes of `watch`: 0 the server exited by itself; 3 the guard stopped it; 2 usage error
(no such process, the PID is the guard's own process group, a threshold out of its range:
magpie/serving/bounds.py); 6 this user may not signal the server (one line; no stop is claimed);
1 a file it reads or writes fails. `run`: the command's exit status (128 + N for a signal N), 3
when the guard stopped it, 4 when the watchdog stopped it (and no restart was left), 5 when its
engine died (the reason is printed), 7 when the watchdog died while the server ran (the server is
stopped), 2 when it could not be started or refused to start (its options, the watchdog's
--watchdog-args, a --pid-file that is not ours: magpie/serving/pidfile.py; `run --check` checks
these and starts nothing).
`exec` replaces itself with the command; it exits 2 without running anything when no hard
limit can be set (the message says why).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import ctypes.util
import errno
import io
import os
import re
import shutil
import subprocess
import sys
import time

from magpie import cli
from magpie.serving import bounds, cgroup, pgroup, status, supervisor
from magpie.serving.logs import OWN_LINES, Log, LogFollower, open_log

# Lines of the NVIDIA driver, the CUDA runtime and PyTorch that report the GPU side running out of
# memory, or the driver reporting a fault (Xid).
DRIVER_ERRORS = re.compile(
    r"NV_ERR_NO_MEMORY|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUDA out of memory|NVRM: Xid\b"
)
XID_PID = re.compile(r"NVRM: Xid\b.*?\bpid=(?P<pid>\d+)")


def read_meminfo(meminfo: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values = {}
    with open(meminfo) as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields:
                values[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return values


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """MemAvailable in bytes (the kernel's estimate of memory usable without swapping)."""
    values = read_meminfo(meminfo)
    if "MemAvailable" not in values:
        raise RuntimeError(f"{meminfo} has no MemAvailable line (Linux 3.14 or later is needed)")
    return values["MemAvailable"]


def read_psi(path: str) -> dict[str, float]:
    """{'some': avg10, 'full': avg10} from a pressure file (percent of time stalled, last 10 s)."""
    values = {}
    with open(path) as f:
        for line in f:
            kind, *fields = line.split()
            for field in fields:
                name, _, value = field.partition("=")
                if name == "avg10":
                    values[kind] = float(value)
    return values


# --------------------------------------------------------------------------------------------
# Sources the guard reads besides /proc/meminfo


class KmsgFollower:
    """New records of the kernel log through /dev/kmsg (each read returns one record)."""

    def __init__(self, path: str = "/dev/kmsg"):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)  # only what happens from now on
        self.path = path

    def lines(self) -> list[str]:
        out = []
        while True:
            try:
                record = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno == errno.EPIPE:  # records were overwritten before we read them
                    continue
                return out
            out.append(record.partition(";")[2].rstrip("\n"))


def open_kernel_log(spec: str) -> tuple[object | None, str]:
    """A follower for --kernel-log and a line saying what is watched."""
    if spec == "none":
        return None, "kernel log: not watched (--kernel-log none)"
    if spec == "auto":
        try:
            return KmsgFollower(), "kernel log: /dev/kmsg"
        except OSError as e:
            return None, (
                f"kernel log: not readable (/dev/kmsg: {e.strerror}); driver errors are seen in the server log "
                "only (run the guard as root, or with CAP_SYSLOG, or pass --kernel-log FILE)"
            )
    return LogFollower(spec, from_start=False), f"kernel log: {spec}"


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class GpuMemory:
    """GPU memory as the driver reports it: NVML (libnvidia-ml.so.1) or nvidia-smi; `source` says
    which, `why_not` why none (no driver here, or a GB10 that reports no framebuffer figures)."""

    def __init__(self, mode: str):
        self.source: str | None = None
        self.why_not = ""
        self.nvml = None
        reasons = []
        if mode in ("auto", "nvml"):
            try:
                nvml = ctypes.CDLL("libnvidia-ml.so.1")
                if nvml.nvmlInit_v2() != 0:
                    raise OSError("nvmlInit_v2 failed")
                self.nvml = nvml
                if self._nvml_read() is not None:
                    self.source = "NVML"
                else:
                    reasons.append("NVML reports no memory figures for this GPU (unified memory: a GB10)")
            except OSError as e:
                reasons.append(f"NVML unavailable ({e})")
        if self.source is None and mode in ("auto", "nvidia-smi"):
            smi = shutil.which("nvidia-smi")
            if smi is None:
                reasons.append("no nvidia-smi on PATH")
            else:
                self.smi = smi
                figures, text = self._smi_read()
                if figures is not None:
                    self.source = "nvidia-smi"
                else:
                    reasons.append(f"nvidia-smi reports no memory figures ({text.strip() or 'no output'})")
        if mode == "none":
            reasons.append("--gpu-memory none")
        self.why_not = "; ".join(reasons)

    def _nvml_read(self) -> list[tuple[int, int]] | None:
        count = ctypes.c_uint()
        if self.nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return None
        figures = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            memory = _NvmlMemory()
            if self.nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                return None
            if self.nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:  # NOT_SUPPORTED on a GB10
                return None
            figures.append((memory.free, memory.total))
        return figures

    def _smi_read(self) -> tuple[list[tuple[int, int]] | None, str]:
        try:
            proc = subprocess.run(
                [self.smi, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, str(e)
        figures = []
        for line in proc.stdout.strip().splitlines():
            try:
                free, total = (int(float(x)) << 20 for x in line.split(","))  # MiB
            except ValueError:
                return None, line  # "[N/A], [N/A]" or "[Not Supported]"
            figures.append((free, total))
        return (figures or None), proc.stdout + proc.stderr

    def read(self) -> list[tuple[int, int]] | None:
        """[(free, total)] per GPU in bytes, or None."""
        if self.source == "NVML":
            return self._nvml_read()
        if self.source == "nvidia-smi":
            return self._smi_read()[0]
        return None


# --------------------------------------------------------------------------------------------
# The checks: each says what it watches (`lines`) and `check()` returns a reason to stop, or None


class MemoryCheck:
    """MemAvailable under the threshold, swap in use grown; warns when the page cache is dropped."""

    def __init__(self, opts: argparse.Namespace, min_available: int, log: Log, meminfo: dict[str, int]):
        self.opts, self.min_available, self.log = opts, min_available, log
        self.swap_at_start = meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)
        self.cached_history: collections.deque = collections.deque()
        self.lines = [
            f"swap: stop when swap in use grows by {cli.format_size(opts.max_swap_growth)} "
            f"(now {cli.format_size(self.swap_at_start)})"
            if opts.max_swap_growth
            else "swap: not watched"
        ]

    def check(self) -> str | None:
        meminfo = read_meminfo(self.opts.meminfo)
        available = meminfo["MemAvailable"]
        if available < self.min_available:
            return f"MemAvailable {cli.format_size(available)} < threshold {cli.format_size(self.min_available)}"
        opts = self.opts
        swap_used = meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)
        if opts.max_swap_growth and swap_used - self.swap_at_start >= opts.max_swap_growth:
            return (
                f"swap in use grew by {cli.format_size(swap_used - self.swap_at_start)} to "
                f"{cli.format_size(swap_used)} "
                f"(limit {cli.format_size(opts.max_swap_growth)} of growth): memory is being paged out"
            )
        self.check_page_cache(meminfo.get("Cached", 0))
        return None

    def check_page_cache(self, cached: int) -> None:
        opts = self.opts
        now = time.monotonic()
        self.cached_history.append((now, cached))
        while self.cached_history and now - self.cached_history[0][0] > opts.cache_drop_window:
            self.cached_history.popleft()
        peak = max(value for _, value in self.cached_history)
        drop = peak - cached
        if opts.cache_drop_min and drop >= opts.cache_drop_min and drop >= opts.cache_drop_fraction * peak:
            self.log(
                f"warning: page cache dropped: Cached {cli.format_size(peak)} -> {cli.format_size(cached)} within "
                f"{opts.cache_drop_window:g} s (drop_caches?). The n-gram table is read from disk again until its "
                "pages are back: expect slow first requests; `python3 magpie ple-warmup warm MODEL` refills them"
            )
            self.cached_history.clear()
            self.cached_history.append((now, cached))


class PsiCheck:
    """Memory pressure: PSI full avg10 over its limit stops, some avg10 over its own warns."""

    def __init__(self, opts: argparse.Namespace, log: Log):
        self.opts, self.log = opts, log
        self.warned = False
        self.path = None if opts.psi_file == "none" else opts.psi_file
        if self.path is not None and not os.path.exists(self.path):
            line = f"PSI: not available ({self.path} missing: a kernel without CONFIG_PSI, or psi=0)"
            self.path = None
        elif self.path is None:
            line = "PSI: not watched (--psi-file none)"
        else:
            line = (
                f"PSI: {self.path} (stop at full avg10 >= {opts.max_psi_full:g} %, warn at some avg10 >= "
                f"{opts.warn_psi_some:g} %)"
            )
        self.lines = [line]

    def check(self) -> str | None:
        if self.path is None:
            return None
        try:
            psi = read_psi(self.path)
        except OSError as e:
            self.log(f"PSI: {self.path} no longer readable ({e.strerror}); not watched any more")
            self.path = None
            return None
        opts = self.opts
        full, some = psi.get("full", 0.0), psi.get("some", 0.0)
        if opts.max_psi_full and full >= opts.max_psi_full:
            return (
                f"memory pressure: PSI full avg10 {full:.2f} % >= {opts.max_psi_full:g} % ({self.path}): every "
                "runnable task stalled on memory for that share of the last 10 s"
            )
        if opts.warn_psi_some and some >= opts.warn_psi_some and not self.warned:
            self.log(f"warning: memory pressure rising: PSI some avg10 {some:.2f} % >= {opts.warn_psi_some:g} %")
            self.warned = True
        elif some < (opts.warn_psi_some or 0) / 2:
            self.warned = False
        return None


class DriverLogCheck:
    """Driver out-of-memory and fault lines in the server log and the kernel log; an Xid of a
    process outside the server's group only warns."""

    def __init__(self, opts: argparse.Namespace, log: Log, server: pgroup.Server):
        self.opts, self.log, self.server = opts, log, server
        self.followers = []
        if opts.server_log:
            self.followers.append((f"server log {opts.server_log}", LogFollower(opts.server_log, from_start=True)))
        kernel, kernel_line = open_kernel_log(opts.kernel_log)
        if kernel is not None:
            self.followers.append(("kernel log", kernel))
        self.lines = [
            f"driver errors: {'stop' if opts.on_driver_error == 'stop' else 'warn'} on "
            f"{', '.join(name for name, _ in self.followers) or 'no log (none given)'}",
            kernel_line,
        ]

    def check(self) -> str | None:
        for name, follower in self.followers:
            for line in follower.lines():
                if line.startswith(OWN_LINES) or not DRIVER_ERRORS.search(line):
                    continue
                xid = XID_PID.search(line)
                if xid and not self.server.ours(int(xid.group("pid"))):
                    self.log(
                        f"warning: driver error of another process (PID {xid.group('pid')}) in {name}: {line.strip()}"
                    )
                    continue
                if self.opts.on_driver_error == "warn":
                    self.log(f"warning: driver error in {name}: {line.strip()}")
                    continue
                return f"driver error in {name}: {line.strip()[:300]}"
        return None


class GpuCheck:
    """GPU memory as the driver reports it: reported at start, free under --min-gpu-free stops."""

    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.gpu = GpuMemory(opts.gpu_memory)
        self.checked = 0.0
        if not self.gpu.source:
            self.lines = [
                f"GPU memory: not available ({self.gpu.why_not}); MemAvailable, PSI and driver errors stand in"
            ]
            return
        threshold = (
            f", stop under {cli.format_size(opts.min_gpu_free)} free"
            if opts.min_gpu_free
            else " (reported, no threshold)"
        )
        figures = self.gpu.read() or []
        self.lines = [
            f"GPU memory: {self.gpu.source}{threshold}",
            "GPU memory now: "
            + ", ".join(
                f"GPU {i} {cli.format_size(free)} free of {cli.format_size(total)}"
                for i, (free, total) in enumerate(figures)
            ),
        ]

    def check(self) -> str | None:
        if self.gpu.source is None or not self.opts.min_gpu_free:
            return None
        now = time.monotonic()
        if now - self.checked < self.opts.gpu_interval:
            return None
        self.checked = now
        for index, (free, total) in enumerate(self.gpu.read() or []):
            if free < self.opts.min_gpu_free:
                return (
                    f"GPU {index} free memory {cli.format_size(free)} of {cli.format_size(total)} < threshold "
                    f"{cli.format_size(self.opts.min_gpu_free)} ({self.gpu.source})"
                )
        return None


# --------------------------------------------------------------------------------------------
# The guard


class Guard:
    """The guard of one server (PID): `run()` runs the checks every INTERVAL seconds and stops the
    server (the stop sequence, SIGKILL after GRACE) at the first reason; OPTIONS are
    add_watch_options' (default: their defaults)."""

    def __init__(self, pid: int, min_available: int, grace: float, interval: float, log, options=None):
        self.server = pgroup.Server(pid)
        self.pid = pid
        self.min_available = min_available
        self.grace = grace
        self.interval = interval
        self.log = Log(log, "memguard")
        self.options = options if options is not None else default_options()
        self.stop_reason: str | None = None

    def alive(self) -> bool:
        return self.server.alive()

    def stop(self, reason: str) -> None:
        self.server.stop(reason, self.grace, self.log, "the memory guard")

    def run(self) -> int:
        opts = self.options
        meminfo = read_meminfo(opts.meminfo)
        memory = MemoryCheck(opts, self.min_available, self.log, meminfo)
        driver, psi, gpu = DriverLogCheck(opts, self.log, self.server), PsiCheck(opts, self.log), GpuCheck(opts)
        self.log(
            f"guarding server PID {self.pid} ({self.server.target()}): stop it when MemAvailable < "
            f"{cli.format_size(self.min_available)}; now {cli.format_size(meminfo['MemAvailable'])}"
        )
        for check in (driver, psi, memory, gpu):
            for line in check.lines:
                self.log(line)
        checks = (memory, psi, driver, gpu)  # the order they are asked in
        while True:
            if not self.alive():
                self.log(f"server PID {self.pid} exited; the guard exits")
                return 0
            reason = None
            for check in checks:
                reason = check.check()
                if reason:
                    break
            if reason:
                self.stop_reason = reason
                self.stop(reason)
                return status.GUARD_STOPPED
            time.sleep(self.interval)


def add_watch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server-log", help="scan this file for driver out-of-memory errors (serve.sh: the server log)"
    )
    parser.add_argument(
        "--kernel-log", default="auto", help="auto (/dev/kmsg when readable), a file to follow, or none"
    )
    parser.add_argument(
        "--on-driver-error",
        choices=("stop", "warn"),
        default="stop",
        help="what a driver error line makes the guard do",
    )
    parser.add_argument("--psi-file", default="/proc/pressure/memory", help="the memory pressure file, or none")
    parser.add_argument(
        "--max-psi-full",
        type=bounds.number(float, 1, 100, zero=True, what=" %"),
        default=20.0,
        help="stop at this PSI full avg10 (%%); 0 = off",
    )
    parser.add_argument(
        "--warn-psi-some",
        type=bounds.number(float, 1, 100, zero=True, what=" %"),
        default=10.0,
        help="warn at this PSI some avg10 (%%); 0 = off",
    )
    parser.add_argument(
        "--max-swap-growth", type=cli.parse_size, default="4GiB", help="stop when swap in use grows this much; 0 = off"
    )
    parser.add_argument(
        "--gpu-memory", choices=("auto", "nvml", "nvidia-smi", "none"), default="auto", help="where GPU memory is read"
    )
    parser.add_argument(
        "--min-gpu-free",
        type=cli.parse_size,
        default="0",
        help="stop when a GPU reports less free memory; 0 = report only",
    )
    parser.add_argument(
        "--gpu-interval", type=bounds.seconds(0.1), default=5.0, help="seconds between two GPU memory readings"
    )
    parser.add_argument(
        "--cache-drop-min",
        type=cli.parse_size,
        default="2GiB",
        help="warn when Cached falls this much at once; 0 = off",
    )
    parser.add_argument(
        "--cache-drop-fraction",
        type=bounds.number(float, 0, 1),
        default=0.5,
        help="... and by at least this fraction of its recent peak",
    )
    parser.add_argument(
        "--cache-drop-window", type=bounds.seconds(1), default=10.0, help="seconds the drop must happen within"
    )
    parser.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)  # tests give a file of their own


def default_options() -> argparse.Namespace:
    parser = cli.Parser()
    add_watch_options(parser)
    return parser.parse_args([])


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("magpie memguard", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_watch = sub.add_parser("watch", help="stop the server with PID when memory runs short (see the signals above)")
    p_watch.add_argument(
        "--pid", type=bounds.pid, required=True, help="the server's PID (its process group if it leads one)"
    )
    p_run = sub.add_parser("run", help="start a command in its own session and guard it")
    for sub_parser in (p_watch, p_run):
        sub_parser.add_argument(
            "--min-available",
            type=bounds.size(cli.parse_size, below_mem_total=True),
            default="6GiB",
            help="stop the server under this MemAvailable (under this machine's MemTotal)",
        )
        sub_parser.add_argument(
            "--grace", type=bounds.seconds(0), default=30.0, help="seconds between SIGTERM and SIGKILL"
        )
        sub_parser.add_argument(
            "--interval", type=bounds.seconds(0.05, 3600), default=0.5, help="seconds between two readings"
        )
        sub_parser.add_argument("--log", type=bounds.log_file, help="append messages to this file (default: stderr)")
        add_watch_options(sub_parser)
    supervisor.add_run_options(p_run)
    p_exec = sub.add_parser("exec", help="run a command under a cgroup v2 hard memory limit")
    p_exec.add_argument("--max", type=cli.parse_size, required=True, help="memory.max of the new cgroup, e.g. 110GiB")
    p_exec.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    return parser


def check_run_options(options: list[str]) -> None:
    """What `memguard run --check OPTIONS -- true` checks (the options, the watchdog's, the pid
    file), in this process: `launch plan` runs it for serve.sh. supervisor.RunRefused with one line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(["run", *options, "--", "true"])
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise supervisor.RunRefused(lines[-1].split("error: ", 1)[-1] if lines else "not accepted") from None
    supervisor.check_run(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    cmd = args.cmd[1:] if getattr(args, "cmd", [])[:1] == ["--"] else getattr(args, "cmd", [])
    if args.command in ("run", "exec") and not cmd:
        parser.error(f"{args.command}: give the command after --")
    if args.command == "exec":
        return cgroup.exec_limited(args.max, cmd)
    if args.command == "run":  # before --log is opened: a refused start writes nothing
        try:
            supervisor.check_run(args)
        except supervisor.RunRefused as e:
            print(f"memguard run: error: {e}", file=sys.stderr)
            return status.REFUSED
        if args.check:
            return 0
    try:
        log = open_log(args.log)
    except OSError as e:
        print(f"memguard: error: --log {args.log}: {e.strerror}", file=sys.stderr)
        return 1
    if args.command == "run":

        def guard(pid: int) -> Guard:
            return Guard(pid, args.min_available, args.grace, args.interval, log, args)

        return supervisor.Supervisor(args, cmd, log, None if args.no_guard else guard).run()
    return pgroup.watch("memguard", lambda: Guard(args.pid, args.min_available, args.grace, args.interval, log, args))


if __name__ == "__main__":
    sys.exit(main())
