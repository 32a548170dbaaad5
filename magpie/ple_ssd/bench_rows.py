"""Time one step's PLE row reads from a checkpoint file: vLLM 0.34.0's disk_offload read loop
(`_read_rows`: posix_fadvise(WILLNEED) per page run, then one os.preadv per row; reimplemented
here from its description) against magpie's mapped gather (magpie/vllm_modules/ple_rows.py,
what `disk_offload_gather` patches in), warm (pages resident) and cold (the file evicted with
posix_fadvise(DONTNEED) before each repeat), for several row counts.

Standalone, CPU only: it writes a safetensors file holding a table split into shards (real
safetensors library), draws sorted distinct row ids as `stage_rows` passes them, checks that
both readers return the same bytes, and prints upstream's and ours side by side (median
[min-max] over the repeats). Cold rows also time the disk's floor: each row's pages read with
O_DIRECT preads, 16 in flight (--floor-threads), the bytes checked alike.

  python -m magpie.ple_ssd.bench_rows --table-mib 512 --repeats 5 --dir /path/on/the/ssd
  python -m magpie.ple_ssd.bench_rows --rows 16 64 512 4096 --states warm --conditions server

"server" runs with torch limited to 1 thread (as in a vLLM worker); "ideal" with torch's
default thread count. The cold rows need a file system whose pages DONTNEED can drop (not
tmpfs): the file is fsynced first, and a cold repeat whose pages were not dropped is an error.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save_file

from magpie.vllm_modules import ple_rows

ROW_COUNTS = (16, 64, 512, 4096, 32768)
# The disk's floor as the reads of the page cache cannot go under it: O_DIRECT preads on threads.
FLOOR = "floor(O_DIRECT)"


def write_table(folder: Path, table_mib: int, row_bytes: int, shards: int) -> tuple[Path, dict, int, int]:
    """A safetensors file of `shards` uint8 shards; returns (path, {i: (path, offset, rows)},
    shard rows, total rows)."""
    total = table_mib * (1 << 20) // row_bytes
    shard_rows = -(-total // shards)
    gen = torch.Generator().manual_seed(0)
    tensors = {"filler": torch.zeros(7, dtype=torch.int16)}
    for i in range(shards):
        n = min(shard_rows, total - i * shard_rows)
        tensors[f"ngram_embedding.shard_{i}.weight"] = torch.randint(
            0, 256, (n, row_bytes), generator=gen, dtype=torch.uint8
        )
    path = folder / "ple-bench.safetensors"
    save_file(tensors, str(path))
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    layout = {}
    for i in range(shards):
        meta = header[f"ngram_embedding.shard_{i}.weight"]
        start, end = meta["data_offsets"]
        layout[i] = (str(path), 8 + size + start, (end - start) // row_bytes)
    return path, layout, shard_rows, total


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class UpstreamReader:
    """0.34.0's `_read_rows` loop: WILLNEED per page run, then one os.preadv per row."""

    def __init__(self, layout: dict, row_bytes: int):
        self.row_bytes = row_bytes
        paths = sorted({p for p, _, _ in layout.values()})
        self.fds = {p: os.open(p, os.O_RDONLY) for p in paths}
        self.fd = torch.tensor([self.fds[layout[i][0]] for i in sorted(layout)])
        self.base = torch.tensor([layout[i][1] for i in sorted(layout)])

    def close(self):
        for fd in self.fds.values():
            os.close(fd)

    def read_rows(self, shard: torch.Tensor, local: torch.Tensor, out: torch.Tensor) -> None:
        page, row_bytes = mmap.PAGESIZE, self.row_bytes
        start = self.base[shard] + local * row_bytes
        first, last = start // page, (start + row_bytes - 1) // page
        new = torch.ones_like(first, dtype=torch.bool)
        new[1:] = (first[1:] > last[:-1] + 1) | (shard[1:] != shard[:-1])
        ends = torch.cat([new[1:], new.new_ones(1)])
        for fd, lo, hi in zip(self.fd[shard[new]].tolist(), first[new].tolist(), last[ends].tolist(), strict=True):
            os.posix_fadvise(fd, lo * page, (hi - lo + 1) * page, os.POSIX_FADV_WILLNEED)
        for row, fd, offset in zip(out.numpy(), self.fd[shard].tolist(), start.tolist(), strict=True):
            if os.preadv(fd, [row], offset) != row_bytes:
                raise ValueError(f"short read at {offset}")


class FloorReader:
    """The disk's floor for a step's rows: each row's pages read with O_DIRECT preads (the page
    cache bypassed, so every read goes to the disk) on `threads` threads at once, which keeps as
    many reads in flight; what no reader of the page cache can beat cold."""

    def __init__(self, layout: dict, row_bytes: int, threads: int):
        self.row_bytes = row_bytes
        self.threads = threads
        self.fd = {i: os.open(p, os.O_RDONLY | os.O_DIRECT) for i, (p, _, _) in layout.items()}
        self.base = {i: offset for i, (_, offset, _) in layout.items()}
        self.pool = ThreadPoolExecutor(threads, "floor")
        self.last_cold = True

    def close(self):
        self.pool.shutdown()
        for fd in self.fd.values():
            os.close(fd)

    def read_rows(self, shard: torch.Tensor, local: torch.Tensor, out: torch.Tensor) -> None:
        page, row_bytes = mmap.PAGESIZE, self.row_bytes
        reads = [
            (i, self.fd[s], self.base[s] + r * row_bytes)
            for i, (s, r) in enumerate(zip(shard.tolist(), local.tolist(), strict=True))
        ]
        dest = out.numpy()

        def read(part):
            # An anonymous mapping is page-aligned, as O_DIRECT needs.
            buf = mmap.mmap(-1, 2 * page + -(-row_bytes // page) * page)
            view = memoryview(buf)
            try:
                for i, fd, offset in part:
                    lo = offset - offset % page
                    size = -(-(offset + row_bytes - lo) // page) * page
                    if os.preadv(fd, [view[:size]], lo) < offset + row_bytes - lo:
                        raise ValueError(f"short O_DIRECT read at {lo}")
                    dest[i] = view[offset - lo : offset - lo + row_bytes]
            finally:
                view.release()
                buf.close()

        parts = [reads[k :: self.threads] for k in range(self.threads)]
        for future in [self.pool.submit(read, part) for part in parts if part]:
            future.result()


def measure(args) -> list[dict]:
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ple-bench-", dir="/var/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    path, layout, shard_rows, total = write_table(folder, args.table_mib, args.row_bytes, args.shards)
    results = []
    default_threads = torch.get_num_threads()
    readers = {}
    try:
        upstream = UpstreamReader(layout, args.row_bytes)
        ours = {
            mode: ple_rows.RowGather(layout, args.row_bytes, shard_rows, prefetch=mode, threads=args.threads)
            for mode in ("fadvise", "populate")
        }
        readers = {"upstream": upstream, "ours(fadvise)": ours["fadvise"], "ours(populate)": ours["populate"]}
        if args.floor_threads:
            readers[FLOOR] = FloorReader(layout, args.row_bytes, args.floor_threads)
        gen = torch.Generator().manual_seed(1)
        conditions = {"server": 1, "ideal": default_threads}
        for condition in args.conditions:
            threads = conditions[condition]
            torch.set_num_threads(threads)
            for rows in args.rows:
                for state in args.states:
                    for name, reader in readers.items():
                        if state == "warm" and name in ("ours(populate)", FLOOR):
                            continue  # the same gather as ours(fadvise) / the disk, when warm
                        times = []
                        for _ in range(args.repeats):
                            ids = torch.randperm(total, generator=gen)[:rows].sort().values
                            shard, local = ids // shard_rows, ids % shard_rows
                            out = torch.empty(rows, args.row_bytes, dtype=torch.uint8)
                            if state == "cold":
                                for gather in ours.values():
                                    gather.unmap_pages()
                                evict(path)
                            else:
                                reader.read_rows(shard, local, out)
                            t0 = time.perf_counter()
                            reader.read_rows(shard, local, out)
                            times.append((time.perf_counter() - t0) * 1e3)
                            if name.startswith("ours") and reader.last_cold != (state == "cold"):
                                raise SystemExit(
                                    f"bench_rows: a {state} repeat found the pages "
                                    f"{'resident' if state == 'cold' else 'evicted'}: {path} is on a file "
                                    "system where DONTNEED does not drop pages; pass --dir on a disk"
                                )
                            if not torch.equal(
                                out,
                                torch.frombuffer(
                                    bytearray(_direct(path, layout, shard, local, args.row_bytes)), dtype=torch.uint8
                                ).view(rows, args.row_bytes),
                            ):
                                raise SystemExit(f"bench_rows: {name} returned other bytes than the file holds")
                        results.append(
                            {
                                "condition": condition,
                                "torch_threads": threads,
                                "rows": rows,
                                "state": state,
                                "reader": name,
                                "median_ms": statistics.median(times),
                                "min_ms": min(times),
                                "max_ms": max(times),
                                "repeats": len(times),
                            }
                        )
    finally:
        torch.set_num_threads(default_threads)
        upstream.close()
        for reader in ours.values():
            reader.close()
        if FLOOR in readers:
            readers[FLOOR].close()
        if not args.keep:
            path.unlink()
    return results


def _direct(path, layout, shard, local, row_bytes) -> bytes:
    chunks = []
    with open(path, "rb") as f:
        for s, r in zip(shard.tolist(), local.tolist(), strict=True):
            f.seek(layout[s][1] + r * row_bytes)
            chunks.append(f.read(row_bytes))
    return b"".join(chunks)


def side_by_side(results: list[dict]) -> str:
    """Upstream's loop and ours in one line per (condition, state, rows): median [min-max]."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in results:
        cells.setdefault((r["condition"], r["state"], r["rows"]), {})[r["reader"]] = r

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        return f"{r['median_ms']:.3f} [{r['min_ms']:.3f}-{r['max_ms']:.3f}]"

    heads = ("upstream ms", "ours(fadvise) ms", "ours(populate) ms", "O_DIRECT floor ms")
    lines = [f"{'condition':<9} {'state':<5} {'rows':>6} " + " ".join(f"{h:>24}" for h in heads)]
    for (condition, state, rows), readers in cells.items():
        lines.append(
            f"{condition:<9} {state:<5} {rows:>6} {cell(readers.get('upstream')):>24} "
            f"{cell(readers.get('ours(fadvise)')):>24} {cell(readers.get('ours(populate)')):>24} "
            f"{cell(readers.get(FLOOR)):>24}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="folder for the table file (on the disk to measure; default /var/tmp)")
    parser.add_argument("--table-mib", type=int, default=256, help="size of the table file written (MiB; default 256)")
    parser.add_argument("--row-bytes", type=int, default=320, help="320: a BF16 row of 160 values")
    parser.add_argument("--shards", type=int, default=4, help="shards the table is split into (default 4)")
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=list(ROW_COUNTS),
        help="distinct rows per step, one timing row each (default: 16 64 512 4096 32768; 32,768 is a "
        "2,048-token prefill chunk x 16 heads)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="steps timed per cell, each on new random rows (default 5, at least 3)"
    )
    parser.add_argument(
        "--states", nargs="+", choices=("warm", "cold"), default=["warm", "cold"], help="page cache states to time"
    )
    parser.add_argument(
        "--conditions",
        nargs="+",
        choices=("server", "ideal"),
        default=["server", "ideal"],
        help="server: torch at 1 thread outside the gather (a vLLM worker); ideal: torch's default",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="ple_rows' torch threads for a large gather (default: CPUs less one, at most 8)",
    )
    parser.add_argument(
        "--floor-threads",
        type=int,
        default=16,
        help="threads of the disk-floor reader timed beside the cold reads: O_DIRECT preads of each "
        "row's pages, that many in flight (default 16; 0: leave it out). A floor only where the CPUs "
        "can run them: on a 2-CPU VM the threads cost more than the reads they overlap",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the table file")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (median, min, max)")
    total = args.table_mib * (1 << 20) // args.row_bytes
    if max(args.rows) > total:
        parser.error(f"--rows {max(args.rows)} exceeds the table's {total} rows: raise --table-mib")
    results = measure(args)
    print(side_by_side(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
