"""A command under a hard memory limit: a cgroup v2 of its own with memory.max (`memguard exec`).
Standard library only.

Polling can be too slow for a start-up spike (vLLM's profiling run at start-up can wedge a GB10
even at 0.70 GPU memory utilization). Where the kernel allows it (cgroup v2 with the memory
controller available to us), the command runs in a child cgroup `magpie-<PID>` of our own with
memory.max set and swap off; on a systemd host whose cgroup cannot get one, in a systemd scope with
MemoryMax. (A cgroup limit bounds what the kernel accounts to the cgroup; owners saw GPU-side
allocations on a GB10 escape it, so it complements the memory guard and does not replace it.)
"""

from __future__ import annotations

import os
import shutil
import sys

from magpie import cli

__all__ = ["cgroup2_mount", "exec_limited", "hard_limit_cgroup", "own_cgroup2_path"]


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
    child = os.path.join(parent, f"magpie-{os.getpid()}")
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


def exec_limited(limit: int, cmd: list[str]) -> int:
    """Replace this process with CMD under memory.max = LIMIT; 2 (and nothing run) when no hard
    limit can be set, the message says why."""
    try:
        child = hard_limit_cgroup(limit)
    except RuntimeError as e:
        # On a systemd host our cgroup is a leaf with processes in it, so no child cgroup can get
        # the memory controller; systemd creates a scope with the limit for us instead.
        if os.path.isdir("/run/systemd/system") and shutil.which("systemd-run"):
            scope = ["systemd-run", "--scope", "--quiet", "--collect", f"--property=MemoryMax={limit}"]
            scope += ["--property=MemorySwapMax=0"] + (["--user"] if os.geteuid() != 0 else [])
            print(f"memguard: {e}; using a systemd scope with MemoryMax={limit}", file=sys.stderr)
            os.execvp(scope[0], scope + ["--", *cmd])
        print(f"memguard: error: no hard memory limit possible: {e}; and no systemd to ask", file=sys.stderr)
        return 2
    print(f"memguard: {cmd[0]} runs in {child} with memory.max {cli.format_size(limit)}", file=sys.stderr)
    os.execvp(cmd[0], cmd)
