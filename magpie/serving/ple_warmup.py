#!/usr/bin/env python3
"""Warm, measure or evict the page cache that serves Qwen3.8-Flash-Next's n-gram (PLE) table.

With the ple_ssd patch the 102 GB table stays in the checkpoint files and every decode step reads
16 rows per token at random addresses through the page cache: right after a start (or after
`echo 3 > /proc/sys/vm/drop_caches`) those reads go to the NVMe. `warm` reads the table's bytes
(found from the safetensors headers: only the table's tensors, nothing else) into the page cache
up to a memory budget, with progress; the server's mappings then find them there. It stops early
when MemAvailable falls under `--min-available`. Page cache is reclaimable: under pressure the
kernel drops it again, before anything the server allocated. The budget bounds the bytes read
(readahead is turned off for them); the kernel may still fill large folios around the last read
(seen on the development machine: up to 14 MiB more than a 33 MiB budget).

    python3 magpie ple-warmup status /models/Qwen3.8-Flash-Next-NVFP4
    python3 magpie ple-warmup warm /models/Qwen3.8-Flash-Next-NVFP4 --budget 16GiB
    python3 magpie ple-warmup evict /models/Qwen3.8-Flash-Next-NVFP4   # cold-start measurements

`status` measures residency with mincore(2) over read-only mappings of the table's byte ranges.
`--json` prints the summary as JSON (schema magpie/ple-warmup/1) on stdout.
Standard library only. Exit status: 0 done; 1 no table found or a file unreadable; 3 `warm`
stopped by --min-available.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import glob
import json
import mmap
import os
import re
import struct
import sys
import time

from magpie import cli, files

SCHEMA = files.schema("ple-warmup", 1)  # of the --json summary

DEFAULT_PATTERN = r"ngram_embedding\.shard_\d+\.weight$"
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def gib(size: float) -> str:
    return f"{size / 1024**3:.2f} GiB"


# The safetensors format's own bound on a header (its reference reader refuses larger ones): a
# header length is read from the file's first 8 bytes, so without a bound a damaged or hostile file
# asks for any amount of memory (1 TiB: a MemoryError).
MAX_HEADER = 100_000_000


def _fail(message: str) -> SystemExit:
    return SystemExit(f"ple_warmup.py: error: {message}")


def read_header(path: str) -> tuple[dict, int]:
    """A safetensors file's header (a JSON object) and where its data starts; SystemExit with one
    line for a file that is not one (too short, a header length over MAX_HEADER or the file, not
    JSON)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _fail(f"{path}: {size} bytes, too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER or 8 + header_len > size:
                raise _fail(
                    f"{path}: its header claims {header_len} bytes (the file has {size}; safetensors allows at most "
                    f"{MAX_HEADER}): not a valid safetensors file"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise _fail(f"{path}: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(f"{path}: its header is not JSON ({e}): not a valid safetensors file") from None
    if not isinstance(header, dict):
        raise _fail(f"{path}: its header is not a JSON object: not a valid safetensors file")
    return header, 8 + header_len


def table_ranges(model: str, pattern: str) -> list[tuple[str, str, int, int]]:
    """(file, tensor, start, end) byte ranges of the table's tensors, from the safetensors headers."""
    if not os.path.isdir(model):
        raise _fail(f"{model}: no such folder (give the checkpoint folder)")
    files = sorted(glob.glob(os.path.join(glob.escape(model), "*.safetensors")))
    if not files:
        raise _fail(f"no *.safetensors file in {model}")
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise _fail(f"--pattern {pattern!r}: not a regular expression ({e})") from None
    ranges = []
    for path in files:
        header, data_start = read_header(path)
        size = os.path.getsize(path)
        for name, info in header.items():
            if name != "__metadata__" and regex.search(name):
                offsets = info.get("data_offsets") if isinstance(info, dict) else None
                if (
                    not isinstance(offsets, list)
                    or len(offsets) != 2
                    or not all(isinstance(x, int) for x in offsets)
                    or not 0 <= offsets[0] <= offsets[1]
                    or data_start + offsets[1] > size
                ):
                    raise _fail(f"{path}: tensor {name}: data_offsets {offsets!r} do not lie within the file")
                begin, end = offsets
                ranges.append((path, name, data_start + begin, data_start + end))
    if not ranges:
        raise SystemExit(f"ple_warmup.py: error: no tensor of {model} matches --pattern {pattern!r}")
    return sorted(ranges, key=lambda r: (r[0], r[2]))


def resident_bytes(path: str, start: int, end: int) -> int:
    """Bytes of [start, end) of the file in the page cache (mincore over a read-only mapping)."""
    first = start - start % PAGE
    length = end - first
    if length <= 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (length + PAGE - 1) // PAGE
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, length, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on {path} failed")
            resident = sum(byte & 1 for byte in bytes(vector))
        finally:
            _libc.munmap(address, length)
    finally:
        os.close(fd)
    return min(resident * PAGE, end - start)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def status(ranges) -> dict:
    total = sum(end - start for _, _, start, end in ranges)
    resident = sum(resident_bytes(path, start, end) for path, _, start, end in ranges)
    return {"table_bytes": total, "resident_bytes": resident, "resident_fraction": resident / total if total else 0.0}


class Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet, self.done = total, quiet, 0
        self.started = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self, size: int) -> None:
        self.done += size
        now = time.monotonic()
        if self.quiet or (now - self.last < (0.2 if self.tty else 5.0) and self.done < self.total):
            return
        self.last = now
        rate = self.done / max(now - self.started, 1e-9)
        line = (
            f"ple_warmup: {gib(self.done)} of {gib(self.total)} ({self.done / self.total:.0%}), "
            f"{rate / 1024**2:.0f} MiB/s"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def warm(ranges, budget: int, min_available: int, chunk: int, quiet: bool) -> dict:
    plan, left = [], budget
    for path, name, start, end in ranges:
        if left <= 0:
            break
        size = min(end - start, left)
        plan.append((path, name, start, start + size))
        left -= size
    total = sum(end - start for _, _, start, end in plan)
    progress = Progress(total, quiet)
    began = time.monotonic()
    stopped = None
    buffer = bytearray(chunk)
    for path, _name, start, end in plan:
        fd = os.open(path, os.O_RDONLY)
        try:
            # No readahead past the range (the kernel's window can be megabytes): the budget is a bound.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)  # start the reads ahead of us
            offset = start
            while offset < end:
                if mem_available() < min_available:
                    stopped = f"MemAvailable {gib(mem_available())} < --min-available {gib(min_available)}"
                    break
                view = memoryview(buffer)[: min(chunk, end - offset)]
                count = os.preadv(fd, [view], offset)
                if count <= 0:
                    break
                offset += count
                progress.add(count)
        finally:
            os.close(fd)
        if stopped:
            break
    progress.close()
    return {
        "budget_bytes": budget,
        "planned_bytes": total,
        "read_bytes": progress.done,
        "seconds": round(time.monotonic() - began, 3),
        "stopped": stopped,
    }


def spans(ranges) -> list[tuple[str, int, int]]:
    """Adjacent ranges of one file merged (the table's shards usually sit back to back)."""
    merged: list[list] = []
    for path, _name, start, end in ranges:
        if merged and merged[-1][0] == path and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([path, start, end])
    return [tuple(span) for span in merged]


def evict(ranges) -> None:
    for path, start, end in spans(ranges):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) cannot be dropped before they are on disk
            # Only pages (and large folios) wholly inside the range are dropped: one span per run of
            # adjacent tensors, rounded out to pages, leaves the fewest straddling the edges.
            first, last = start - start % PAGE, -(-end // PAGE) * PAGE
            os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _at_least(low: int, high: int | None = None):
    """A size (cli.parse_size) of at least LOW bytes (and at most HIGH): `--chunk 0` reads nothing."""

    def parse(text: str) -> int:
        value = cli.parse_size(text)
        if value < low or (high is not None and value > high):
            bound = f"from {low} bytes to {cli.format_size(high)}" if high is not None else f"at least {low} byte(s)"
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {bound}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("magpie ple-warmup", __doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helps = {
        "status": "how much of the table is in the page cache",
        "warm": "read the table into the page cache, up to --budget",
        "evict": "drop the table's pages from the page cache (posix_fadvise DONTNEED; mapped pages stay)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("model", help="the checkpoint folder (its *.safetensors files)")
        p.add_argument("--pattern", default=DEFAULT_PATTERN, help="regular expression for the table's tensor names")
        p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
        if name == "warm":
            p.add_argument("--budget", type=_at_least(1), required=True, help="at most this many bytes of the table")
            p.add_argument(
                "--min-available", type=cli.parse_size, default="8GiB", help="stop when MemAvailable falls under this"
            )
            p.add_argument("--chunk", type=_at_least(PAGE, 1 << 30), default="16MiB", help="bytes per read")
            p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    ranges = table_ranges(args.model, args.pattern)
    result: dict = {"schema": SCHEMA, "model": os.path.abspath(args.model), "tensors": len(ranges)}
    try:
        if args.command == "warm":
            result["before"] = status(ranges)
            result["warm"] = warm(ranges, args.budget, args.min_available, args.chunk, args.quiet)
        elif args.command == "evict":
            result["before"] = status(ranges)
            evict(ranges)
        result["after"] = status(ranges)
    except OSError as e:
        print(f"ple_warmup.py: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        after = result["after"]
        print(
            f"{result['tensors']} table tensors, {gib(after['table_bytes'])}; in the page cache: "
            f"{gib(after['resident_bytes'])} ({after['resident_fraction']:.1%})"
            + (
                f"; read {gib(result['warm']['read_bytes'])} in {result['warm']['seconds']:.1f} s"
                if "warm" in result
                else ""
            )
        )
    stopped = result.get("warm", {}).get("stopped")
    if stopped:
        warmed = result["warm"]
        print(
            f"ple_warmup.py: stopped early: {stopped}; read {gib(warmed['read_bytes'])} of the "
            f"{gib(warmed['planned_bytes'])} planned (free memory, or lower --min-available)",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
