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

Stopping is by PID: SIGTERM (and SIGCONT, so a stopped process can act on it) to the server's
process group (vLLM forks an engine core and workers into it), a grace period, then SIGKILL. It
never looks processes up by name, and it exits as soon as its server exits.

    python3 magpie memguard watch --pid 12345 --min-available 6GiB --log server.log --server-log server.log
    python3 magpie memguard run --min-available 6GiB -- ray start --address=HEAD:6379 --block

`run` is the supervisor of one server (serve.sh runs vLLM under it): it starts the command in a
session of its own, writes its PID (--pid-file), guards it (or not: --no-guard), starts the
liveness watchdog on it (--watchdog stop|restart|report), stops its process group on SIGINT or
SIGTERM (SIGKILL after --grace; what is left of the group after the server exited gets the same),
reads the server's output for an engine death (vLLM's API server exits 0 after one), starts it
again after a watchdog stop or an engine death under `--watchdog restart` (at most --restarts
times; an engine death only once the server had served), and exits with its status:

    python3 magpie memguard run --pid-file server.pid --output server.log --log server.log \
        --server-log server.log --watchdog restart --watchdog-url http://127.0.0.1:8100 -- vllm serve ...

Polling can be too slow for a start-up spike (vLLM's profiling run at start-up can wedge a GB10
even at 0.70 GPU memory utilization). Where the kernel allows it (cgroup v2 with the memory
controller available to us), `exec` starts a command under a hard memory limit instead:

    python3 magpie memguard exec --max 110GiB -- vllm serve ...

(A cgroup limit bounds what the kernel accounts to the cgroup; owners saw GPU-side allocations on
a GB10 escape it, so it complements the guard and does not replace it.)

Exit codes of `watch`: 0 the server exited by itself; 3 the guard stopped it; 2 usage error
(no such process, the PID is the guard's own process group). `run`: the command's exit status
(128 + N for a signal N), 3 when the guard stopped it, 4 when the watchdog stopped it (and no
restart was left), 5 when its engine died (the reason is printed), 2 when it could not be started.
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
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from magpie import cli, files, tool_command

# Lines of the NVIDIA driver, the CUDA runtime and PyTorch that report the GPU side running out of
# memory, or the driver reporting a fault (Xid).
DRIVER_ERRORS = re.compile(
    r"NV_ERR_NO_MEMORY|cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUDA out of memory|NVRM: Xid\b"
)
# serve.sh's header (it explains the GB10 settings by the errors they avoid), the guard's and the
# watchdog's own lines: never evidence of a driver error.
OWN_LINES = ("# ", "[memguard", "[watchdog")
XID_PID = re.compile(r"NVRM: Xid\b.*?\bpid=(?P<pid>\d+)")
# vLLM's lines for an engine core that died (0.29: core.py logs the first when the engine's loop
# fails, async_llm / the API server the second when a request meets the dead engine, core_client's
# monitor the others when the process vanished: "MPClient: engine core exited unexpectedly" after a
# kill -9 of the engine core, seen here). vLLM's API server then shuts down with status 0.
ENGINE_DEATH = re.compile(
    r"EngineCore encountered a fatal error|EngineDeadError|Engine core proc \S+ died unexpectedly|"
    r"Engine core process \S+ died unexpectedly|engine core exited unexpectedly|Engine core initialization failed"
)
# uvicorn's line once the API server serves (vLLM logs it after the engine is up).
SERVING_LINE = "Application startup complete."
ENGINE_DIED = 5  # `run`'s status when the engine died (the API server's own status is 0)


parse_size = cli.parse_size  # one size rule for every tool (magpie/cli.py)


def format_size(size: float) -> str:
    return f"{size / 1024**3:.2f} GiB"


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


def group_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[2])


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# --------------------------------------------------------------------------------------------
# Sources the guard reads besides /proc/meminfo


class LogFollower:
    """New lines of a growing text file (the server log, or a kernel log a test writes)."""

    def __init__(self, path: str, from_start: bool):
        self.path = path
        self.offset = 0 if from_start else (os.path.getsize(path) if os.path.exists(path) else 0)
        self.partial = ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read(8 << 20)
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        data = self.partial + data
        lines = data.split("\n")
        self.partial = lines.pop()
        return lines


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
# The guard


class Guard:
    def __init__(self, pid: int, min_available: int, grace: float, interval: float, log, options=None):
        self.pid = pid
        self.min_available = min_available
        self.grace = grace
        self.interval = interval
        self.log_file = log
        self.options = options if options is not None else default_options()
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
        self.stop_reason: str | None = None
        self.who = "the memory guard"

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

    def ours(self, pid: int) -> bool:
        return pid == self.pid or (self.group is not None and group_of(pid) == self.group)

    def stop(self, reason: str) -> None:
        self.log(
            f"{reason}: stopping {self.target()} (server PID {self.pid}, RSS {format_size(rss_bytes(self.pid))}) "
            "with SIGTERM"
        )
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a stopped (SIGSTOP, traced) process acts on SIGTERM only once continued
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
        self.log(f"server PID {self.pid} stopped by {self.who}")

    # ---- the checks; each returns a reason to stop, or None
    def check_memory(self, meminfo: dict[str, int]) -> str | None:
        available = meminfo["MemAvailable"]
        if available < self.min_available:
            return f"MemAvailable {format_size(available)} < threshold {format_size(self.min_available)}"
        opts = self.options
        swap_used = meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)
        if opts.max_swap_growth and swap_used - self.swap_at_start >= opts.max_swap_growth:
            return (
                f"swap in use grew by {format_size(swap_used - self.swap_at_start)} to {format_size(swap_used)} "
                f"(limit {format_size(opts.max_swap_growth)} of growth): memory is being paged out"
            )
        self.check_page_cache(meminfo.get("Cached", 0))
        return None

    def check_page_cache(self, cached: int) -> None:
        opts = self.options
        now = time.monotonic()
        self.cached_history.append((now, cached))
        while self.cached_history and now - self.cached_history[0][0] > opts.cache_drop_window:
            self.cached_history.popleft()
        peak = max(value for _, value in self.cached_history)
        drop = peak - cached
        if opts.cache_drop_min and drop >= opts.cache_drop_min and drop >= opts.cache_drop_fraction * peak:
            self.log(
                f"warning: page cache dropped: Cached {format_size(peak)} -> {format_size(cached)} within "
                f"{opts.cache_drop_window:g} s (drop_caches?). The n-gram table is read from disk again until its "
                "pages are back: expect slow first requests; `python3 magpie ple-warmup warm MODEL` refills them"
            )
            self.cached_history.clear()
            self.cached_history.append((now, cached))

    def check_psi(self) -> str | None:
        if self.psi_path is None:
            return None
        try:
            psi = read_psi(self.psi_path)
        except OSError as e:
            self.log(f"PSI: {self.psi_path} no longer readable ({e.strerror}); not watched any more")
            self.psi_path = None
            return None
        opts = self.options
        full, some = psi.get("full", 0.0), psi.get("some", 0.0)
        if opts.max_psi_full and full >= opts.max_psi_full:
            return (
                f"memory pressure: PSI full avg10 {full:.2f} % >= {opts.max_psi_full:g} % ({self.psi_path}): every "
                "runnable task stalled on memory for that share of the last 10 s"
            )
        if opts.warn_psi_some and some >= opts.warn_psi_some and not self.psi_warned:
            self.log(f"warning: memory pressure rising: PSI some avg10 {some:.2f} % >= {opts.warn_psi_some:g} %")
            self.psi_warned = True
        elif some < (opts.warn_psi_some or 0) / 2:
            self.psi_warned = False
        return None

    def check_driver_logs(self) -> str | None:
        for name, follower in self.followers:
            for line in follower.lines():
                if line.startswith(OWN_LINES) or not DRIVER_ERRORS.search(line):
                    continue
                xid = XID_PID.search(line)
                if xid and not self.ours(int(xid.group("pid"))):
                    self.log(
                        f"warning: driver error of another process (PID {xid.group('pid')}) in {name}: {line.strip()}"
                    )
                    continue
                if self.options.on_driver_error == "warn":
                    self.log(f"warning: driver error in {name}: {line.strip()}")
                    continue
                return f"driver error in {name}: {line.strip()[:300]}"
        return None

    def check_gpu(self) -> str | None:
        if self.gpu is None or self.gpu.source is None or not self.options.min_gpu_free:
            return None
        now = time.monotonic()
        if now - self.gpu_checked < self.options.gpu_interval:
            return None
        self.gpu_checked = now
        figures = self.gpu.read() or []
        for index, (free, total) in enumerate(figures):
            if free < self.options.min_gpu_free:
                return (
                    f"GPU {index} free memory {format_size(free)} of {format_size(total)} < threshold "
                    f"{format_size(self.options.min_gpu_free)} ({self.gpu.source})"
                )
        return None

    def run(self) -> int:
        opts = self.options
        meminfo = read_meminfo(opts.meminfo)
        self.swap_at_start = meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0)
        self.cached_history: collections.deque = collections.deque()
        self.psi_warned = False
        self.gpu_checked = 0.0
        self.followers = []
        if opts.server_log:
            self.followers.append((f"server log {opts.server_log}", LogFollower(opts.server_log, from_start=True)))
        kernel, kernel_line = open_kernel_log(opts.kernel_log)
        if kernel is not None:
            self.followers.append(("kernel log", kernel))
        self.psi_path = None if opts.psi_file == "none" else opts.psi_file
        if self.psi_path is not None and not os.path.exists(self.psi_path):
            psi_line = f"PSI: not available ({self.psi_path} missing: a kernel without CONFIG_PSI, or psi=0)"
            self.psi_path = None
        elif self.psi_path is None:
            psi_line = "PSI: not watched (--psi-file none)"
        else:
            psi_line = (
                f"PSI: {self.psi_path} (stop at full avg10 >= {opts.max_psi_full:g} %, warn at some avg10 >= "
                f"{opts.warn_psi_some:g} %)"
            )
        self.gpu = GpuMemory(opts.gpu_memory)
        gpu_line = (
            f"GPU memory: {self.gpu.source}"
            + (
                f", stop under {format_size(opts.min_gpu_free)} free"
                if opts.min_gpu_free
                else " (reported, no threshold)"
            )
            if self.gpu.source
            else f"GPU memory: not available ({self.gpu.why_not}); MemAvailable, PSI and driver errors stand in"
        )
        self.log(
            f"guarding server PID {self.pid} ({self.target()}): stop it when MemAvailable < "
            f"{format_size(self.min_available)}; now {format_size(meminfo['MemAvailable'])}"
        )
        swap_line = (
            f"swap: stop when swap in use grows by {format_size(opts.max_swap_growth)} "
            f"(now {format_size(self.swap_at_start)})"
            if opts.max_swap_growth
            else "swap: not watched"
        )
        driver_line = (
            f"driver errors: {'stop' if opts.on_driver_error == 'stop' else 'warn'} on "
            f"{', '.join(name for name, _ in self.followers) or 'no log (none given)'}"
        )
        for line in (driver_line, kernel_line, psi_line, swap_line, gpu_line):
            self.log(line)
        if self.gpu.source:
            figures = self.gpu.read() or []
            self.log(
                "GPU memory now: "
                + ", ".join(
                    f"GPU {i} {format_size(free)} free of {format_size(total)}"
                    for i, (free, total) in enumerate(figures)
                )
            )
        while True:
            if not self.alive():
                self.log(f"server PID {self.pid} exited; the guard exits")
                return 0
            reason = (
                self.check_memory(read_meminfo(opts.meminfo))
                or self.check_psi()
                or self.check_driver_logs()
                or self.check_gpu()
            )
            if reason:
                self.stop_reason = reason
                self.stop(reason)
                return 3
            time.sleep(self.interval)


# --------------------------------------------------------------------------------------------
# Supervision: `run`


class Supervisor:
    """`run`: the one supervisor of a server (serve.sh's, a Ray node's). It starts the command in a
    session of its own (so its PID leads the group vLLM forks its engine core and workers into),
    writes that PID to --pid-file, guards it in this process (unless --no-guard), starts the
    liveness watchdog on it in a process of its own (--watchdog: an HTTP call that hangs must not
    hold the guard), stops the group on SIGINT/SIGTERM (SIGKILL after --grace), and under
    `--watchdog restart` starts the command again after a watchdog stop, at most --restarts times."""

    def __init__(self, args: argparse.Namespace, cmd: list[str], log) -> None:
        self.args = args
        self.cmd = cmd
        self.log_file = log
        self.child: subprocess.Popen | None = None
        self.stopping = False
        self.killer: threading.Timer | None = None
        self.term_sent_at: float | None = None
        self.engine_death: str | None = None
        self.served = False

    log = Guard.log  # the guard's "[memguard <time>]" lines, to the same file

    def say(self, message: str) -> None:
        print(f"memguard run: {message}", file=sys.stderr, flush=True)

    def on_signal(self, signum: int, _frame) -> None:
        self.stopping = True  # no restart after a stop that was asked for
        child = self.child
        if child is None or child.poll() is not None:
            return
        for number in (signum, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, number)
        if self.term_sent_at is None:
            self.term_sent_at = time.monotonic()
        if self.killer is None:
            # vLLM can hang in its own shutdown (seen when a stop came while the engine was
            # starting): a stop must end, so the group gets SIGKILL once the grace time has passed.
            self.killer = threading.Timer(self.args.grace, self.kill_late, (child,))
            self.killer.daemon = True
            self.killer.start()

    def kill_late(self, child: subprocess.Popen) -> None:
        if child.poll() is None:
            self.log(f"server PID {child.pid} still running {self.args.grace:g} s after SIGTERM: SIGKILL to its group")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)

    def show_tail(self) -> None:
        if self.args.output:
            with open(self.args.output, errors="replace") as f:
                tail = collections.deque(f, 20)
            sys.stderr.write(f"last lines of {self.args.output}:\n" + "".join(tail))

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
            files.atomic_write_text(self.args.pid_file, f"{child.pid}\n")
        where = f", PID file {self.args.pid_file}" if self.args.pid_file else ""
        self.say(f"server PID {child.pid}{where}" + (f", output {self.args.output}" if self.args.output else ""))
        return child

    def watchdog(self, pid: int) -> subprocess.Popen | None:
        if self.args.watchdog == "off":
            return None
        policy = "report" if self.args.watchdog == "report" else "stop"
        cmd = tool_command(sys.executable, "magpie.serving.watchdog", "watch", "--pid", str(pid))
        cmd += ["--url", self.args.watchdog_url, "--on-stall", policy, "--grace", f"{self.args.grace:g}"]
        cmd += ["--log", self.args.log] if self.args.log else []
        output = self.args.output or self.args.server_log
        cmd += (["--server-log", output] if output else []) + shlex.split(self.args.watchdog_args)
        return subprocess.Popen(cmd)

    def group_left(self, pgid: int, since: float) -> None:
        """After the server (the group's leader) exited: SIGTERM to what is left of its group (vLLM's
        engine core and workers outlive a killed API server), SIGKILL once --grace seconds have passed
        since SINCE (the first SIGTERM of a stop, or the leader's exit)."""
        from magpie.serving.process import group_members

        if not group_members(pgid):
            return
        for number in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, number)
        deadline = since + self.args.grace
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = group_members(pgid)
        if left:
            self.log(
                f"{len(left)} process(es) of the server's group {pgid} (PIDs {' '.join(map(str, left))}) still "
                f"running {self.args.grace:g} s after the server stopped: SIGKILL to the group"
            )
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)

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
        self.engine_death, self.served = None, False
        child = self.child = self.start()
        guard_status: list[int] = []
        guard_thread = guard = None
        if not self.args.no_guard:
            try:
                guard = Guard(
                    child.pid, self.args.min_available, self.args.grace, self.args.interval, self.log_file, self.args
                )
            except ProcessLookupError:  # it has already ended (and been reaped)
                guard = None
        if guard is not None:
            guard_thread = threading.Thread(target=lambda: guard_status.append(guard.run()), daemon=True)
            guard_thread.start()
        watchdog = self.watchdog(child.pid)
        while True:
            try:
                status = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                self.read_output(follower)
        exited = time.monotonic()
        self.group_left(child.pid, self.term_sent_at if self.term_sent_at is not None else exited)
        self.read_output(follower)
        if guard_thread is not None:
            guard_thread.join()
        watchdog_status = watchdog.wait() if watchdog is not None else 0
        return (status if status >= 0 else 128 - status), (guard_status or [0])[0], watchdog_status

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.on_signal)
        restarts = 0
        try:
            while True:
                if self.stopping:  # a stop came before the (first or next) start
                    return 128 + signal.SIGTERM
                try:
                    status, guard_status, watchdog_status = self.once()
                except OSError as e:
                    self.say(f"error: cannot run {self.cmd[0]}: {e.strerror}")
                    return 2
                where = f"; its reason is in {self.args.log}" if self.args.log else ""
                if guard_status == 3:
                    self.say(f"the memory guard stopped the server{where} ([memguard] lines)")
                    return 3
                if watchdog_status == 4:
                    self.say(f"the watchdog stopped a stalled server{where} ([watchdog] lines)")
                    if self.args.watchdog == "restart" and restarts < self.args.restarts and not self.stopping:
                        restarts += 1
                        self.log(f"restart {restarts} of {self.args.restarts} after a stall")
                        continue
                    return 4
                if self.stopping:
                    return status
                if self.engine_death is not None:
                    self.say(f"the server's engine died (the server exited with status {status}): {self.engine_death}")
                    if self.args.watchdog == "restart" and restarts < self.args.restarts and self.served:
                        restarts += 1
                        self.log(f"restart {restarts} of {self.args.restarts} after the engine died")
                        continue
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
        finally:
            if self.killer is not None:
                self.killer.cancel()
            if self.args.pid_file and self.child is not None:
                with contextlib.suppress(OSError):
                    if open(self.args.pid_file).read().strip() == str(self.child.pid):
                        os.unlink(self.args.pid_file)


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
    parser.add_argument("--max-psi-full", type=float, default=20.0, help="stop at this PSI full avg10 (%%); 0 = off")
    parser.add_argument("--warn-psi-some", type=float, default=10.0, help="warn at this PSI some avg10 (%%); 0 = off")
    parser.add_argument(
        "--max-swap-growth", type=parse_size, default="4GiB", help="stop when swap in use grows this much; 0 = off"
    )
    parser.add_argument(
        "--gpu-memory", choices=("auto", "nvml", "nvidia-smi", "none"), default="auto", help="where GPU memory is read"
    )
    parser.add_argument(
        "--min-gpu-free", type=parse_size, default="0", help="stop when a GPU reports less free memory; 0 = report only"
    )
    parser.add_argument("--gpu-interval", type=float, default=5.0, help="seconds between two GPU memory readings")
    parser.add_argument(
        "--cache-drop-min", type=parse_size, default="2GiB", help="warn when Cached falls this much at once; 0 = off"
    )
    parser.add_argument(
        "--cache-drop-fraction", type=float, default=0.5, help="... and by at least this fraction of its recent peak"
    )
    parser.add_argument("--cache-drop-window", type=float, default=10.0, help="seconds the drop must happen within")
    parser.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)  # tests give a file of their own


def default_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_watch_options(parser)
    return parser.parse_args([])


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
    parser = cli.parser("magpie memguard", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p_watch = sub.add_parser("watch", help="stop the server with PID when memory runs short (see the signals above)")
    p_watch.add_argument("--pid", type=int, required=True, help="the server's PID (its process group if it leads one)")
    p_run = sub.add_parser("run", help="start a command in its own session and guard it")
    for sub_parser in (p_watch, p_run):
        sub_parser.add_argument(
            "--min-available", type=parse_size, default="6GiB", help="stop the server under this MemAvailable"
        )
        sub_parser.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
        sub_parser.add_argument("--interval", type=float, default=0.5, help="seconds between two readings")
        sub_parser.add_argument("--log", help="append messages to this file (default: stderr)")
        add_watch_options(sub_parser)
    p_run.add_argument("--pid-file", help="write the command's PID here (removed when it ends, if still ours)")
    p_run.add_argument("--output", help="append the command's stdout and stderr to this file (default: ours)")
    p_run.add_argument("--no-guard", action="store_true", help="supervise only: no memory checks")
    p_run.add_argument(
        "--watchdog",
        choices=("off", "stop", "restart", "report"),
        default="off",
        help="the liveness watchdog on the command (magpie watchdog) and its policy; restart = stop, then "
        "start the command again",
    )
    p_run.add_argument("--watchdog-url", default="http://127.0.0.1:8100", help="the server the watchdog reads")
    p_run.add_argument(
        "--watchdog-args", default="", help="more `watchdog watch` options, one string (--watchdog-args='--interval 2')"
    )
    p_run.add_argument("--restarts", type=int, default=3, help="at most this many restarts under --watchdog restart")
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
        return Supervisor(args, cmd, log).run()
    try:
        guard = Guard(args.pid, args.min_available, args.grace, args.interval, log, args)
    except (ProcessLookupError, PermissionError) as e:
        print(f"memguard: error: {e}", file=sys.stderr)
        return 2
    return cli.run_until_stopped(guard.run)


if __name__ == "__main__":
    sys.exit(main())
