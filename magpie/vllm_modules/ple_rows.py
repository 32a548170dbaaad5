# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gather n-gram table rows from the checkpoint files through file mappings.

The row I/O of every ple_ssd series: page size and madvise, the process's file
mappings (which file holds a tensor, the pages of a file's other tensors to
release), major-fault counts, mincore residency, torch threads raised for one
call, and DLPack views of mapped memory, used by ``ple_mmap`` (vLLM 0.29 and
0.33, shipped beside it); and ``RowGather``, the gather of vLLM 0.34's
Engram disk_offload_gather.

Engram disk_offload_gather (magpie-vllm-plugins ple_ssd): each shard of a
table plane (the rows, or NVFP4's block scales) is mapped read-only where the
checkpoint stores it, and a step's rows are copied by one `torch.index_select`
per shard on a tensor viewing the mapping, instead of one `os.preadv` call per
row (torch's thread count raised for that call only when the step is large).
When the pages of the step's rows are not resident (a `mincore` sample
decides), every read the step needs is queued before the gather (per page
run: `posix_fadvise(WILLNEED)`, or `MADV_POPULATE_READ` spread over threads),
so the gather's page faults wait on reads already in flight instead of
issuing them one at a time. A cold step of fewer than 4,096 rows is then read
with one `os.preadv` per row rather than through the mapping: faulting pages
in cost more than the reads at those sizes (H200 host, docs/ple_ssd.md). A
small step (up to 64 rows: a decode step) is checked and sampled on Python
ints (4 rows sampled) and copied by one memmove per row, whose fixed cost is
lower than a dozen tensor ops. Standalone: no vLLM import.
"""

import contextlib
import ctypes
import mmap
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.utils.dlpack

# Plane dtypes served as stored: BF16 rows, FP8 rows, NVFP4 packed E2M1 bytes
# (uint8) with their FP8 block-scale plane.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.uint8)
PREFETCH_MODES = ("fadvise", "populate")

_MADV_POPULATE_READ = 22  # Linux 5.14
# Rows sampled with mincore to tell a warm step from a cold one.
_SAMPLE_ROWS = 16
# Up to this many rows (a decode step) the bookkeeping runs on Python ints and
# each row is one memmove: a dozen tensor ops cost more than the copy itself.
_SMALL_STEP_ROWS = 64
# Rows sampled in such a step: one mincore call costs ~2 us on a 2-CPU VM, as
# much as copying a few rows, and a table evicted in whole shows in any row.
_SMALL_SAMPLE_ROWS = 4
# A cold step of fewer rows than this is read with one preadv per row after its
# reads are queued: faulting the pages in through the mapping was 1.1-1.35x
# slower than upstream's preads from 16 to 512 rows, and even at 4,096 (H200
# host, bench_rows, 2026-12-03).
_COLD_PREAD_ROWS = 4096
# From this many bytes (512 rows of 320 B) a step's gather runs on several torch
# threads: on an H200 host they paid from 512 rows on (docs/ple_ssd.md).
_PARALLEL_BYTES = 160 << 10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_mincore = _libc.mincore
_memmove = ctypes.memmove

MADV_RANDOM = 1  # <sys/mman.h> on Linux
MADV_DONTNEED = 4
# The kernel's page size, read at run time: 4 KiB on most x86-64 kernels, 16 or
# 64 KiB on some arm64 ones (GB10 kernels may use 64 KiB). Never assume 4 KiB.
PAGE_SIZE = mmap.PAGESIZE
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _page_range(tensor: torch.Tensor, page: int = PAGE_SIZE) -> tuple[int, int]:
    """Page-aligned [start, end) of the bytes a tensor covers."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    start -= start % page
    end += -end % page
    return start, end


def madvise_range(start: int, end: int, advice: int) -> None:
    """madvise(2) over [start, end) (page-aligned)."""
    if end <= start:
        return
    if _libc.madvise(start, end - start, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(
            err, f"madvise({advice}) on {end - start} bytes failed: {os.strerror(err)}"
        )


def madvise(tensor: torch.Tensor, advice: int) -> None:
    """Advise the kernel (madvise(2)) on the pages a tensor covers (shared edge
    pages included)."""
    madvise_range(*_page_range(tensor), advice)


def file_mappings(paths: set[str]) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of the given files."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            path = fields[5].strip().removesuffix(" (deleted)")
            if path in paths:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high, path))
    return found


def unused_ranges(
    mappings: list[tuple[int, int]], keep: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of ``mappings`` outside every ``keep`` range (both page-aligned)."""
    keep = sorted(keep)
    free = []
    for low, high in sorted(mappings):
        cursor = low
        for start, end in keep:
            if end <= cursor or start >= high:
                continue
            if start > cursor:
                free.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < high:
            free.append((cursor, high))
    return free


def major_faults() -> int:
    """Major page faults (reads that waited for the disk) of the calling thread."""
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt


def default_gather_threads() -> int:
    """Threads of the gather pool: the CPUs this process may run on, at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def default_index_select_threads() -> int:
    """The torch threads of one large warm gather: the CPUs we may use, at most 8."""
    return min(8, default_gather_threads())


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose memory mapping holds all of the tensor's bytes, or None.

    None means the bytes live in anonymous memory (a copy, a read into RAM, a
    device), so serving from them would keep the whole table resident.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    path = None
    covered = start
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if high <= covered or low > covered:
                if low >= end:
                    break
                continue
            name = fields[5].strip() if len(fields) == 6 else ""
            if fields[4] == "0" or not name or name.startswith("["):
                return None
            name = name.removesuffix(" (deleted)")
            if path is not None and name != path:
                return None
            path = name
            covered = high
            if covered >= end:
                return path
    return None


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_DL_CPU, _DL_CUDA = 1, 2
_DL_WORDS = {1: (1, torch.uint8), 2: (0, torch.int16), 4: (0, torch.int32)}
_DL_WORDS[8] = (0, torch.int64)
# The structures of every view made (a view lives as long as the table).
_DL_KEEP: list = []


def tensor_at(
    address: int, count: int, word: int, device: torch.device
) -> torch.Tensor:
    """A 1-D tensor of ``count`` ``word``-byte integers at ``address``, on
    ``device``, owning nothing (DLPack, no deleter). On a CUDA device the
    address is a host virtual address: only valid where the GPU reads pageable
    host memory (``choose_lookup`` returns "direct")."""
    code, dtype = _DL_WORDS[word]
    shape = (ctypes.c_int64 * 1)(count)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = address
    managed.dl_tensor.device = _DLDevice(
        _DL_CUDA if device.type == "cuda" else _DL_CPU,
        (device.index or 0) if device.type == "cuda" else 0,
    )
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(code, word * 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.strides = None
    managed.dl_tensor.byte_offset = 0
    _DL_KEEP.append((managed, shape))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    capsule = new_capsule(ctypes.addressof(managed), b"dltensor", None)
    tensor = torch.utils.dlpack.from_dlpack(capsule)
    assert tensor.dtype == dtype and tensor.data_ptr() == address
    return tensor


@contextlib.contextmanager
def torch_threads_at_least(threads: int):
    """Raise torch's intra-op thread count to ``threads`` for the block only (a
    serving worker keeps one thread for everything else); never lowered."""
    before = torch.get_num_threads()
    raised = threads > before
    if raised:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if raised:
            torch.set_num_threads(before)


def page_resident(address: int, vec=None) -> bool:
    """Whether the page holding ``address`` (in a mapping) is in the page cache."""
    vec = (ctypes.c_ubyte * 1)() if vec is None else vec
    if _mincore(address - address % PAGE_SIZE, PAGE_SIZE, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore at {address:#x}: {os.strerror(err)}")
    return bool(vec[0] & 1)


def resident_fraction(addresses) -> float:
    """The fraction of the pages holding these mapped addresses that are resident."""
    vec = (ctypes.c_ubyte * 1)()
    addresses = list(addresses)
    hits = sum(page_resident(address, vec) for address in addresses)
    return hits / max(1, len(addresses))


def check_plane_dtype(name: str, dtype: torch.dtype) -> None:
    """Refuse a plane dtype the gather does not serve."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"Engram disk_offload_gather serves BF16, FP8 and NVFP4 tables; "
            f"plane {name} is {dtype}: set disk_offload_gather=false"
        )


def _fadvise_runs(reads: list[tuple[int, int]], row_bytes: int) -> None:
    """posix_fadvise(WILLNEED) once per run of pages holding these rows, given as
    (fd, file offset) sorted by offset within each fd."""
    runs: list[list[int]] = []
    for fd, offset in reads:
        first, last = offset // PAGE_SIZE, (offset + row_bytes - 1) // PAGE_SIZE
        if runs and runs[-1][0] == fd and first <= runs[-1][2] + 1:
            runs[-1][2] = max(last, runs[-1][2])
        else:
            runs.append([fd, first, last])
    for fd, first, last in runs:
        size = (last - first + 1) * PAGE_SIZE
        os.posix_fadvise(fd, first * PAGE_SIZE, size, os.POSIX_FADV_WILLNEED)


class MappedShard:
    """One shard's rows, mapped read-only from its checkpoint file."""

    def __init__(self, path: str, offset: int, num_rows: int, row_bytes: int):
        self.path = path
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        nbytes = num_rows * row_bytes
        if os.path.getsize(path) < offset + nbytes:
            raise ValueError(
                f"PLE shard file {path} is truncated: {nbytes} bytes expected "
                f"at offset {offset}"
            )
        self._vec = (ctypes.c_ubyte * 1)()
        self.fd = os.open(path, os.O_RDONLY)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        self.delta = offset - base
        self.file_base = base
        # ACCESS_COPY: a private mapping, writable for torch.frombuffer; it is
        # only ever read, so its pages stay the page cache's.
        self.map = mmap.mmap(
            self.fd, self.delta + nbytes, access=mmap.ACCESS_COPY, offset=base
        )
        self.map.madvise(mmap.MADV_RANDOM)
        flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.address = flat.data_ptr()
        self.rows = flat[self.delta : self.delta + nbytes].view(num_rows, row_bytes)

    def close(self) -> None:
        self.rows = None
        # A tensor may still view the mapping; it is then released with it.
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)

    def resident(self, local: torch.Tensor) -> bool:
        """Whether the first page of each of these rows is in the page cache."""
        first = self.address + self.delta
        rows = local.tolist()
        return self.resident_at([first + row * self.row_bytes for row in rows])

    def resident_at(self, addresses: list[int]) -> bool:
        """Whether the pages holding these addresses (in the mapping) are resident."""
        vec = self._vec
        return all(page_resident(address, vec) for address in addresses)

    def page_runs(self, local: torch.Tensor) -> list[tuple[int, int]]:
        """(first page, page count) of each run of pages holding sorted rows,
        counted from the start of the mapping."""
        start = self.delta + local * self.row_bytes
        first = start // PAGE_SIZE
        last = (start + self.row_bytes - 1) // PAGE_SIZE
        new = torch.ones_like(first, dtype=torch.bool)
        new[1:] = first[1:] > last[:-1] + 1
        ends = torch.cat([new[1:], new.new_ones(1)])
        return list(zip(first[new].tolist(), (last[ends] - first[new] + 1).tolist()))


class RowGather:
    """One table plane's shards and the reads of a step's rows from them."""

    def __init__(
        self,
        shards: dict[int, tuple[str, int, int]],
        row_bytes: int,
        shard_size: int,
        prefetch: str = "fadvise",
        threads: int | None = None,
    ) -> None:
        """`shards`: index -> (file path, byte offset, rows) for each shard.
        `threads`: torch threads of a large gather, and MADV_POPULATE_READ threads
        (default: the CPUs this process may use less one, at most 8)."""
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"prefetch must be one of {PREFETCH_MODES}: {prefetch}")
        if sorted(shards) != list(range(len(shards))):
            raise ValueError(f"PLE shards {sorted(shards)} are not 0..n-1")
        self.row_bytes = row_bytes
        self.shard_size = shard_size
        self.prefetch = prefetch
        if threads is None:
            # One CPU left to the rest of the server: on a 2-CPU VM under load,
            # two threads made a 32,768-row gather 30-100x slower than one.
            threads = min(8, len(os.sched_getaffinity(0)) - 1)
        self.threads = max(1, threads)
        self.shards = [
            MappedShard(path, offset, rows, row_bytes)
            for _, (path, offset, rows) in sorted(shards.items())
        ]
        self._rows_per_shard = torch.tensor([m.num_rows for m in self.shards])
        # Per shard, precomputed for small steps: its rows and row 0's address.
        self._num_rows = [m.num_rows for m in self.shards]
        self._row0 = [m.address + m.delta for m in self.shards]
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.last_cold = False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        for shard in self.shards:
            shard.close()

    def unmap_pages(self) -> None:
        """Drop this process's mappings of the shards' pages (the page cache keeps
        them), so that posix_fadvise(DONTNEED) can evict them; for benchmarks."""
        for shard in self.shards:
            shard.map.madvise(mmap.MADV_DONTNEED)

    def _map(self, fn, items: list) -> None:
        if self.threads == 1 or len(items) == 1:
            for item in items:
                fn(item)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, "ple_rows")
        for future in [self._pool.submit(fn, item) for item in items]:
            future.result()

    def _spans(self, shard: torch.Tensor) -> list[tuple[int, int, int]]:
        """(shard, begin, end) of each shard's stretch of non-decreasing ids."""
        if shard.numel() == 0:
            return []
        if bool((shard == shard[0]).all()):
            return [(int(shard[0]), 0, shard.numel())]
        cut = (shard[1:] != shard[:-1]).nonzero().flatten() + 1
        bounds = [0, *cut.tolist(), shard.numel()]
        which = shard[bounds[:-1]].tolist()
        if len(set(which)) != len(which):
            raise ValueError("PLE row ids must be sorted by shard")
        return [(s, b, e) for s, b, e in zip(which, bounds[:-1], bounds[1:])]

    def read_rows(
        self, shard: torch.Tensor, local: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Copy rows `local` of shards `shard` (sorted by shard) into `out`,
        a contiguous uint8 (rows, row_bytes) host tensor."""
        if out.dtype != torch.uint8 or out.shape != (local.numel(), self.row_bytes):
            raise ValueError(
                f"out must be uint8 {(local.numel(), self.row_bytes)}, got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        if local.numel() <= _SMALL_STEP_ROWS and out.is_contiguous():
            self._read_small(shard, local, out)
            return
        if bool((local >= self._rows_per_shard[shard]).any()):
            raise IndexError(
                f"PLE row out of range for the shards' rows "
                f"{self._rows_per_shard.tolist()}"
            )
        spans = self._spans(shard)
        self.last_cold = not all(self._sample_resident(spans, local))
        if self.last_cold and local.numel() < _COLD_PREAD_ROWS and out.is_contiguous():
            reads = []
            for s, begin, end in spans:
                mapped = self.shards[s]
                base = mapped.file_base + mapped.delta
                offsets = (local[begin:end] * self.row_bytes + base).tolist()
                reads.extend((mapped.fd, offset) for offset in offsets)
            if self.prefetch == "fadvise":
                _fadvise_runs(reads, self.row_bytes)
            else:
                self._queue_reads(spans, local)
            self._pread(reads, out)
            return
        if self.last_cold:
            self._queue_reads(spans, local)
        self._gather(spans, local, out)

    def _read_small(
        self, shard: torch.Tensor, local: torch.Tensor, out: torch.Tensor
    ) -> None:
        """A small step on Python ints: the same checks, sample and bytes as the
        tensor path, one memmove per row (ctypes releases the GIL for it)."""
        shards, rows = shard.tolist(), local.tolist()
        num_rows, row0, row_bytes = self._num_rows, self._row0, self.row_bytes
        addresses = []
        seen = []
        for s, row in zip(shards, rows):
            if not seen or seen[-1] != s:
                if s in seen:
                    raise ValueError("PLE row ids must be sorted by shard")
                seen.append(s)
            if not 0 <= s < len(num_rows) or not 0 <= row < num_rows[s]:
                raise IndexError(
                    f"PLE row out of range for the shards' rows {num_rows}"
                )
            addresses.append(row0[s] + row * row_bytes)
        # At most _SMALL_SAMPLE_ROWS rows, spread over the step.
        step = max(1, -(-len(rows) // _SMALL_SAMPLE_ROWS))
        cold = False
        for pick in range(0, len(rows), step):
            if not self.shards[shards[pick]].resident_at([addresses[pick]]):
                cold = True
                break
        self.last_cold = cold
        if cold:
            base = [m.file_base + m.delta for m in self.shards]
            fds = [m.fd for m in self.shards]
            reads = [
                (fds[s], base[s] + row * row_bytes) for s, row in zip(shards, rows)
            ]
            if self.prefetch == "fadvise":
                # The page runs on Python ints: the tensor path's page_runs cost
                # ~0.3 ms here, as much as the reads of 16 rows.
                _fadvise_runs(reads, row_bytes)
            else:
                self._queue_reads(self._spans(shard), local)
            self._pread(reads, out)
            return
        dest, move = out.data_ptr(), _memmove
        for address in addresses:
            move(dest, address, row_bytes)
            dest += row_bytes

    def _pread(self, reads: list[tuple[int, int]], out: torch.Tensor) -> None:
        """Read one row per (fd, file offset) into the rows of `out`, in order."""
        row_bytes = self.row_bytes
        view = memoryview(
            (ctypes.c_ubyte * (len(reads) * row_bytes)).from_address(out.data_ptr())
        ).cast("B")
        at = 0
        for fd, offset in reads:
            got = os.preadv(fd, [view[at : at + row_bytes]], offset)
            if got != row_bytes:
                raise OSError(
                    f"PLE row read at byte {offset}: {got} of {row_bytes} bytes "
                    "(the checkpoint file changed while it was served?)"
                )
            at += row_bytes

    def _sample_resident(self, spans, local):
        total = local.numel()
        step = max(1, total // _SAMPLE_ROWS)
        for s, begin, end in spans:
            picks = local[begin:end:step] if end - begin > step else local[begin:end]
            yield self.shards[s].resident(picks[:_SAMPLE_ROWS])

    def _queue_reads(self, spans, local) -> None:
        runs = [
            (self.shards[s], first, count)
            for s, begin, end in spans
            for first, count in self.shards[s].page_runs(local[begin:end])
        ]
        if self.prefetch == "fadvise":
            for mapped, first, count in runs:
                os.posix_fadvise(
                    mapped.fd,
                    mapped.file_base + first * PAGE_SIZE,
                    count * PAGE_SIZE,
                    os.POSIX_FADV_WILLNEED,
                )
            return

        def populate(part):
            for mapped, first, count in part:
                address = mapped.address + first * PAGE_SIZE
                if _libc.madvise(address, count * PAGE_SIZE, _MADV_POPULATE_READ):
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"MADV_POPULATE_READ on {mapped.path}")

        parts = [runs[i :: self.threads] for i in range(self.threads)]
        self._map(populate, [part for part in parts if part])

    def _gather(self, spans, local, out) -> None:
        # One index_select per shard; a large step runs it with torch's thread count
        # raised for this call only (the server keeps one thread for the rest).
        large = local.numel() * self.row_bytes >= _PARALLEL_BYTES
        with torch_threads_at_least(self.threads if large else 1):
            for s, begin, end in spans:
                torch.index_select(
                    self.shards[s].rows, 0, local[begin:end], out=out[begin:end]
                )
