"""The output policy of every magpie tool, and the names of a run folder's files.

- Writes are atomic: the data goes to a temporary file in the destination's folder, is flushed
  and fsync'ed, then `os.replace`d over the destination. A reader sees the old file or the new
  one, never half of one; an error (or Ctrl-C) leaves the old file as it was and no temporary
  file behind.
- An existing output is refused unless the user passed `--force` (`check_output`), before any
  work is done, with a message that names the file and the flag.
- Inputs are checked before the work (`check_input`, `check_distinct`), and JSON is read by
  `read_json`, which names the file and what it should have held: an `InputError`, which
  magpie.cli.run_tool prints as one line (exit 1).
- The names of a run folder's files (`RUN_FILES`: what `magpie/measure/run_suite.sh` writes into
  its OUTDIR; `PROFILE_*`; `SWEEP_*`: sweep.py's run folder), spelled once for the Python tools
  that read or write them (tests/test_cli_files.py holds run_suite.sh's spelling equal to these).

Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "BENCH_C1",
    "BENCH_C4",
    "GSM8K",
    "LOG_CHECK",
    "METRICS_AFTER",
    "METRICS_BEFORE",
    "PROFILE_CAPTURE",
    "PROFILE_DIR",
    "PROFILE_SPLIT",
    "RUN_FILES",
    "SUITE",
    "SUITE_LOG",
    "SUMMARY",
    "SWEEP_PLAN",
    "SWEEP_POINTS_CSV",
    "SWEEP_RESULTS",
    "SWEEP_RESULTS_CSV",
    "InputError",
    "OutputExists",
    "atomic_open",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "bench_file",
    "check_distinct",
    "check_input",
    "check_output",
    "check_output_place",
    "read_json",
    "schema",
    "schema_of",
]

# --------------------------------------------------------------------------------------------
# The `schema` field of every JSON file a magpie tool writes: "magpie/<tool>/<version>"

SCHEMA_PREFIX = "magpie/"
# Prefixes of files written before the one prefix (still read: committed measurements use them),
# each with what its names became ("gpu-harness/results/1" is "magpie/gpu-harness-results/1").
LEGACY_SCHEMA_PREFIXES = {
    "flash-next/": "",
    "mtp_pruning/": "",
    "mtp-pruning/": "",
    "gpu-harness/": "gpu-harness-",
}


def schema(name: str, version: int) -> str:
    """The schema string a tool writes: schema("bench-decode", 3) -> "magpie/bench-decode/3"."""
    return f"{SCHEMA_PREFIX}{name}/{version}"


def schema_of(value: object) -> tuple[str, int] | None:
    """(name, version) of a schema string, read under the one prefix or a legacy one
    ("flash-next/bench-decode/2" -> ("bench-decode", 2)); None for anything else."""
    if not isinstance(value, str):
        return None
    for prefix, renamed in ((SCHEMA_PREFIX, ""), *LEGACY_SCHEMA_PREFIXES.items()):
        if value.startswith(prefix):
            name, _, version = value[len(prefix) :].rpartition("/")
            if name and "/" not in name and version.isdigit():
                return renamed + name, int(version)
    return None


# --------------------------------------------------------------------------------------------
# A run folder (run_suite.sh's OUTDIR): its files, by name

SUITE = "suite.json"  # what ran where: label, URL, server log, host
BENCH_C1 = "bench-c1.json"  # bench_decode at concurrency 1
BENCH_C4 = "bench-c4.json"  # bench_decode at concurrency 4
GSM8K = "gsm8k.json"  # gsm8k
LOG_CHECK = "log_check.json"  # log_check of the server's log
METRICS_BEFORE = "metrics-before.prom"  # the server's /metrics page before the requests
METRICS_AFTER = "metrics-after.prom"  # ... and after them
SUITE_LOG = "suite.log"  # every step's output
SUMMARY = "summary.txt"  # report --summary of the folder
PROFILE_DIR = "profile"  # profile_capture --out, when a profile was taken: profile/<window>/
PROFILE_SPLIT = "split.json"  # trace_split's result in each profile/<window>/

RUN_FILES = (SUITE, BENCH_C1, BENCH_C4, GSM8K, LOG_CHECK, METRICS_BEFORE, METRICS_AFTER, SUITE_LOG, SUMMARY)
"""The files run_suite.sh writes at the top of its OUTDIR."""

PROFILE_CAPTURE = "capture.json"  # profile_capture's summary of its windows, at the top of --out

# A sweep run folder (sweep.py's RUN_DIR)
SWEEP_PLAN = "sweep.json"  # the plan the sweep runs (and resumes from)
SWEEP_RESULTS = "results.json"  # every point's summary (magpie/sweep/2)
SWEEP_RESULTS_CSV = "results.csv"  # the same as a table
SWEEP_POINTS_CSV = "points.csv"  # one row per measured point


def bench_file(concurrency: int) -> str:
    """The run folder's decode bench result at this concurrency (1 and 4 are the suite's)."""
    return {1: BENCH_C1, 4: BENCH_C4}.get(concurrency, f"bench-c{concurrency}.json")


# --------------------------------------------------------------------------------------------
# The overwrite rule


class OutputExists(SystemExit):
    """An output that exists and was not allowed to be replaced. A SystemExit, so that a tool's
    `main` needs no handler: the message goes to stderr and the exit status is 1."""

    def __init__(self, path: str | os.PathLike, flag: str = "--force", what: str = "--output") -> None:
        self.path = os.fspath(path)
        super().__init__(f"error: {self.path} exists; pass {flag} to replace it, or choose another {what}")


def check_output(path: str | os.PathLike | None, force: bool, flag: str = "--force", what: str = "--output") -> None:
    """Refuse an existing output unless `force`: call before any work. `path` None (no output
    asked for) or '-' (stdout) passes. `flag` is the option that allows replacing; `what` names
    the option that gave the path, for the message."""
    if path is None or os.fspath(path) in ("", "-"):
        return
    check_output_place(path, what)
    if force:
        return
    if os.path.lexists(path):
        raise OutputExists(path, flag, what)


def check_output_place(path: str | os.PathLike, what: str = "--output") -> None:
    """Refuse (InputError) an output that cannot be written where it is asked for, before any
    work: a folder in its place, a file where one of its folders should be, a folder that is not
    writable."""
    name = os.path.abspath(os.fspath(path))
    if os.path.isdir(name):
        raise InputError(f"{what} {os.fspath(path)}: is a folder; give a file name")
    parent = os.path.dirname(name)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"{what} {os.fspath(path)}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{what} {os.fspath(path)}: the folder {parent} is not writable; choose another path")


def check_distinct(outputs: list[tuple[str, str | os.PathLike | None]], inputs=()) -> None:
    """Refuse (InputError, before any work) two outputs that are one file, and an output that is
    one of the inputs: `outputs` and `inputs` are (option, path) pairs ("--summary", "s.json");
    None and '-' (stdout) are skipped. One file: the same path once made absolute and symbolic
    links resolved, or the same inode for files that exist (a hard link)."""

    def key(path):
        return os.path.realpath(os.path.abspath(os.fspath(path)))

    def same(a, b) -> bool:
        if key(a) == key(b):
            return True
        try:
            return os.path.samefile(a, b)
        except OSError:
            return False

    seen: list[tuple[str, str | os.PathLike]] = []
    for option, path in outputs:
        if path is None or os.fspath(path) in ("", "-"):
            continue
        for other_option, other in seen:
            if same(path, other):
                raise InputError(
                    f"{other_option} and {option} are both {os.fspath(path)}: one would overwrite the other; "
                    "give them different files"
                )
        for in_option, in_path in inputs:
            if in_path is not None and os.fspath(in_path) not in ("", "-") and same(path, in_path):
                raise InputError(
                    f"{option} {os.fspath(path)} is also the input {in_option}: writing it would destroy the "
                    "input; give another output file"
                )
        seen.append((option, path))


# --------------------------------------------------------------------------------------------
# Inputs


class InputError(ValueError):
    """An input the tool cannot use; the message names it and the fix (magpie.cli.run_tool
    prints it as one line, exit 1)."""


def check_input(path: str | os.PathLike | None, what: str = "input", kind: str = "file") -> None:
    """Refuse (InputError) an input that is missing, unreadable or not of `kind` ("file": a
    regular file, or a FIFO / character device such as /dev/stdin; "dir": a folder), before any
    work. `what` names it for the message: the option (--keepset) or the argument's role."""
    if path is None:
        return
    name = os.fspath(path)
    if not os.path.exists(name):
        raise InputError(f"{what} {name}: no such {'folder' if kind == 'dir' else 'file'}; check the path")
    if kind == "dir" and not os.path.isdir(name):
        raise InputError(f"{what} {name}: not a folder; give the folder")
    if kind == "file" and os.path.isdir(name):
        raise InputError(f"{what} {name}: is a folder; give a file")
    if not os.access(name, os.R_OK | (os.X_OK if kind == "dir" else 0)):
        raise InputError(f"{what} {name}: permission denied; check its permissions")


def read_json(path: str | os.PathLike, expect: type | tuple[type, ...] = dict, what: str = "a JSON file") -> Any:
    """The JSON value in `path`, refused (InputError naming the file) when it is missing, a
    folder, unreadable, not UTF-8, not JSON (truncated?) or not of type `expect` (dict: an
    object, list: an array). `what` says what the file should be, e.g. "a bench-decode result"."""
    name = os.fspath(path)
    check_input(name, what)
    try:
        with open(name, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError:
        raise InputError(f"{name}: not UTF-8 text; give {what}") from None
    except json.JSONDecodeError as e:
        raise InputError(
            f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; truncated?); give {what}"
        ) from None
    if not isinstance(value, expect):
        kinds = expect if isinstance(expect, tuple) else (expect,)
        names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
        wanted = " or ".join(names.get(k, k.__name__) for k in kinds)
        found = names.get(type(value), "null" if value is None else type(value).__name__)
        raise InputError(f"{name}: holds JSON {found}, not {wanted}; give {what}")
    return value


# --------------------------------------------------------------------------------------------
# Atomic writes


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform or file system that cannot open a folder: the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in `path`'s folder (same suffix, for libraries that pick a format
    by it, e.g. numpy's `.npy`) for the caller to write by name; on a clean exit it is fsync'ed
    and replaces `path`; on an error it is removed and `path` is left as it was. The folder is
    created if missing. The new file gets the mode a plain `open` would give it (0666 & ~umask)."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_dir(str(directory))


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """`open(path, mode)` that writes all or nothing: mode 'w' (text) or 'wb' (binary)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', not {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` atomically."""
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int | None = 1) -> None:
    """Write `data` as JSON (and a final newline) to `path` atomically. Serialised before the
    file is opened, so an object JSON cannot hold leaves nothing, not even a temporary file."""
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n")
