# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# Over 800 lines: MmapNGramTable's loading, gathers, staging and staged-step
# checks share its buffers and counters; its row I/O is in ple_rows.py and its
# hashing in ple_hash.py.
"""Qwen4Exp n-gram (PLE/Engram) table served from the checkpoint's file mappings.

With ``--hf-overrides '{"ple_mmap": true}'`` (vLLM 0.29) or ``--engram-config
'{"offload_storage": "mmap"}'`` (vLLM 0.30 on) the n-gram table is never
copied into memory. vLLM's default safetensors loader yields zero-copy views of
the checkpoint files (``...ngram_embedding.shard_<i>.weight``); ``MmapNGramTable``
keeps those views, marks their pages ``MADV_RANDOM`` (a miss reads one page, of
the size the kernel reports at run time, instead of a readahead window),
releases the mapped pages of every other tensor of those files once loading is
done, and serves each step's rows in one of three ways:

* looked up: ``lookup(ngram_ids)``, the step's ids already on the device
  (computed by the model's own hashing), copied through the page cache into a
  pinned staging buffer, then to the device in one copy. Used from a custom op
  outside CUDA graphs (vLLM 0.29's ple_ssd 0001 alone).
* staged (any GPU, and the CPU): ``stage(input_ids, query_start_loc,
  ngram_context)``, called by ``Qwen4ExpModelState.prepare_inputs`` before the
  forward, hashes the step's n-grams (``NGramHasher``, bit-identical to the
  model's hashing), copies the rows through the page cache into a pinned
  staging buffer and from there into a static device buffer; the forward reads
  ``staged(num_tokens)`` after ``check_staged()``, so it can be captured in a
  full CUDA graph. Each stage bumps a step counter on the host and in a device
  scalar; ``check_staged()`` refuses rows that no stage wrote since the last
  read, on the host when Python runs the forward and in a device-side assert
  under CUDA-graph replay.
* direct (a GPU that reads pageable host memory through the host's page tables,
  ``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` = 1: systems with ATS
  such as GB10 and GH200): ``lookup_direct(ids, out)`` reads the rows on the
  device straight from the mappings (one ``index_select`` over a device view
  of the mapped address range), with no host work, so it runs inside captured
  graphs and inside the model's own prefetch one decoder layer ahead (the
  Engram storage mode picks it or staging with ``choose_lookup``).

A decode step (up to ``direct_copy_max_rows`` ids) is staged with as few
calls as possible, since their fixed cost, not the rows, is what it pays: its
device inputs go to the host (token ids and n-gram context: one copy each into
persistent pinned buffers, one blocking event wait; ``query_start_loc`` comes
from the runner's host copy), are hashed with numpy (``NGramHasher.ids_numpy``)
and its rows gathered in token order, repeats included, straight into the
pinned buffer that is uploaded to the static device buffer. A large step (a
prefill chunk) is sorted on the device, its sorted offsets copied to the host
(no implicit synchronisation: no ``torch.unique``), the unique rows gathered,
uploaded and expanded on the device with the inverse index.

Every gather reads a byte-addressed view of the shard mappings in calls that
release the GIL, page faults included. It runs in the calling thread, its first
rows a probe: when they took a major page fault (a read from the disk, counted
by ``getrusage``; time is not used, so a descheduled thread is not mistaken for
a disk wait) the rest go over the module's own thread pool (numpy indexing) so
that the reads overlap. Warm, the rest is copied in the calling thread: numpy
indexing up to ``index_select_min_rows`` rows, one ``torch.index_select`` above
(the fastest of the three with one torch thread, as vLLM serves: on an H200
host 2.5 ms for 32,768 rows, against 3.8 ms with numpy and 4.1 ms over the
pool, whose Python threads queue on the GIL). That ``index_select`` runs with
torch's intra-op thread count raised to ``index_select_threads`` (default: the
CPUs this process may run on, at most 8) for the one call and set back after
it: a serving worker keeps its single thread for everything else (H200 host:
32,768 rows 3.44 ms at one thread, 0.69 ms at 8; the two switches cost
microseconds). ``pool_min_rows`` (off by default) sends every gather of that
many rows to the pool.

Its row I/O (page size, madvise, the process's file mappings, mincore
residency, torch threads scoped to one call, DLPack views of mapped memory)
comes from ``ple_rows``, shipped beside it, which the vLLM 0.34 gather uses
too; ``NGramHasher`` comes from ``ple_hash``, also beside it. The three import
only torch, numpy (a dependency of vLLM) and the standard library: they run on
their own on a CPU or a GPU, which is how they are tested.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from .ple_hash import NGramHasher
from .ple_rows import (
    MADV_DONTNEED,
    MADV_RANDOM,
    PAGE_SIZE,
    _page_range,
    default_gather_threads,
    default_index_select_threads,
    file_mappings,
    madvise,
    madvise_range,
    major_faults,
    mapped_file,
    tensor_at,
    torch_threads_at_least,
    unused_ranges,
)

# How this module names itself in its messages: the switch that turned it on
# differs between the vLLM releases it ships for.
# [release 0.29.0]
LOG_NAME = "ple_mmap"
SWITCH = "ple_mmap"
WITHOUT_IT = "drop ple_mmap"
THREAD_PREFIX = "ple_mmap"
# [release 0.33.0]
LOG_NAME = "engram mmap"
SWITCH = "Engram offload_storage='mmap'"
WITHOUT_IT = "use Engram offload_storage='pinned'"
THREAD_PREFIX = "engram_mmap"
# [release end]

# stage_dummy(): rows of a dummy batch (profiling, CUDA-graph warm-up and
# capture), readable any number of times.
DUMMY_EPOCH = -1

# CUDA driver attributes (cuda.h, CUdevice_attribute; the runtime's
# cudaDevAttr* enum has the same values).
CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88
CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES = 100


def pageable_access_uses_host_page_tables(device_index: int = 0) -> int | None:
    """``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` of a CUDA device.

    1 where the GPU reads pageable host memory (a file mapping included)
    through the host's page tables (ATS: GB10, GH200), 0 where it cannot,
    None where there is no CUDA driver or device to ask (a CPU build, no GPU).
    Asked through the driver API (libcuda), which every CUDA process loads.
    """
    try:
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()
        libcuda = ctypes.CDLL("libcuda.so.1")
    except (OSError, RuntimeError, AssertionError):
        return None
    device = ctypes.c_int()
    value = ctypes.c_int()
    if libcuda.cuInit(0) != 0:
        return None
    if libcuda.cuDeviceGet(ctypes.byref(device), int(device_index)) != 0:
        return None
    attribute = CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES
    if libcuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
        return None
    return int(value.value)


def choose_lookup(device_type: str, uses_host_page_tables: int | None) -> str:
    """How a mapped table is read: "direct" (the GPU reads the mappings) or
    "staged" (rows copied by the host into a device buffer before the forward).

    Direct only on a CUDA device that reads pageable memory through the host's
    page tables; a device without that would fault on a mapping's address.
    """
    if device_type == "cuda" and uses_host_page_tables == 1:
        return "direct"
    return "staged"


class MmapNGramTable(nn.Module):
    """An embedding table ``[num_rows, row_width]`` read from checkpoint shard mappings.

    Shard ``i`` holds rows ``[i * shard_size, (i + 1) * shard_size)``, shard_size =
    ceil(num_rows / num_shards). With tensor parallelism a rank serves the rows
    in ``row_range`` and zeros elsewhere, like ``VocabParallelEmbedding`` before its
    all-reduce; it needs only the shards overlapping its range.

    Every gather indexes ``rows_np``, a numpy view of ``row_bytes``-wide items
    whose item ``r`` starts at byte ``r`` of the address range holding the shards:
    one indexing call reads rows at any byte offsets, across shards and files.
    Only offsets of rows inside the shards are ever formed.
    """

    PROBE_ROWS = 8

    def __init__(
        self,
        *,
        num_rows: int,
        row_width: int,
        dtype: torch.dtype,
        num_shards: int,
        max_tokens: int,
        heads: int,
        row_range: tuple[int, int] | None = None,
        hasher: NGramHasher | None = None,
        static_output: bool = False,
        num_threads: int | None = None,
        direct_copy_max_rows: int = 1024,
        host_hash_max_tokens: int = 256,
        rows_per_task: int = 256,
        pool_min_rows: int | None = None,
        index_select_min_rows: int = 1024,
        index_select_threads: int | None = None,
        blocking_wait: bool = True,
        name: str = "ngram_embedding",
    ) -> None:
        super().__init__()
        if num_shards <= 0 or num_rows <= 0:
            raise ValueError("num_rows and num_shards must be positive")
        self.name = name
        self.num_rows = int(num_rows)
        self.row_width = int(row_width)
        self.dtype = dtype
        self.num_shards = int(num_shards)
        self.shard_size = -(-self.num_rows // self.num_shards)
        self.row_bytes = self.row_width * dtype.itemsize
        self.row_item = np.dtype((np.void, self.row_bytes))
        self.row_start, self.row_end = (
            row_range if row_range is not None else (0, self.num_rows)
        )
        self.partial = (self.row_start, self.row_end) != (0, self.num_rows)
        self.heads = int(heads)
        self.max_ids = int(max_tokens) * self.heads
        self.hasher = hasher
        # Steps above direct_copy_max_rows ids are deduplicated on the device;
        # steps up to host_hash_max_tokens tokens are hashed on the host.
        self.direct_copy_max_rows = int(direct_copy_max_rows)
        self.host_hash_max_tokens = int(host_hash_max_tokens)
        self._init_gather_settings(
            num_threads,
            rows_per_task,
            pool_min_rows,
            index_select_min_rows,
            index_select_threads,
        )
        self.stats = {
            "gathers": 0,
            "pool_gathers": 0,
            "disk_waits": 0,
            "index_selects": 0,
        }
        self.required_shards = [
            index
            for index in range(self.num_shards)
            if self.shard_rows(index) > 0
            and index * self.shard_size < self.row_end
            and (index + 1) * self.shard_size > self.row_start
        ]
        self.shards: dict[int, torch.Tensor] = {}
        self.files: dict[int, str] = {}
        self.released_bytes = 0
        self.ready = False
        self._init_device_buffers(static_output)
        self._init_host_buffers(blocking_wait)

    def _init_gather_settings(
        self,
        num_threads: int | None,
        rows_per_task: int,
        pool_min_rows: int | None,
        index_select_min_rows: int,
        index_select_threads: int | None,
    ) -> None:
        # After a disk wait a gather is split over num_threads threads (numpy
        # indexing, GIL released), whatever torch's thread count; each indexing
        # call copies at most rows_per_task rows (its scratch stays small enough
        # to be reused by the allocator, not faulted in afresh). pool_min_rows
        # (None: off) sends every gather of that many rows to the pool; a warm
        # one of index_select_min_rows rows or more is one index_select.
        self.num_threads = (
            default_gather_threads() if num_threads is None else int(num_threads)
        )
        self.rows_per_task = max(1, int(rows_per_task))
        self.pool_min_rows = None if pool_min_rows is None else int(pool_min_rows)
        self.index_select_min_rows = int(index_select_min_rows)
        # torch's intra-op threads for that one index_select only (vLLM serves
        # with one; it is set back right after the call).
        self.index_select_threads = max(
            1,
            default_index_select_threads()
            if index_select_threads is None
            else int(index_select_threads),
        )

    def _init_device_buffers(self, static_output: bool) -> None:
        # Device side (created on the current default device, like the stock
        # table): unique rows of a large step and, with ``static_output``, the
        # buffer a CUDA-graph-captured forward reads.
        self.register_buffer(
            "device_rows",
            torch.zeros(self.max_ids, self.row_bytes, dtype=torch.uint8),
            False,
        )
        if static_output:
            self.register_buffer(
                "staged_rows",
                torch.zeros(self.max_ids, self.row_bytes, dtype=torch.uint8),
                False,
            )
        else:
            self.staged_rows = None
        # Step counters of stage() and of the forward's reads (check_staged):
        # on the host, and on the device for reads inside CUDA graphs. 0 = never
        # staged; DUMMY_EPOCH = a dummy batch's rows.
        self.register_buffer("staged_epoch", torch.zeros(1, dtype=torch.long), False)
        self.register_buffer("read_epoch", torch.zeros(1, dtype=torch.long), False)
        self._epoch = 0
        self._host_staged = 0
        self._host_read = 0
        self.device = self.device_rows.device
        self.on_cuda = self.device.type == "cuda"

    def _init_host_buffers(self, blocking_wait: bool) -> None:
        # Host side: pinned where CUDA exists, so uploads are asynchronous.
        self.pin = torch.cuda.is_available()
        self.host_rows = torch.empty(
            self.max_ids,
            self.row_bytes,
            dtype=torch.uint8,
            device="cpu",
            pin_memory=self.pin,
        )
        self.host_rows_np = self.host_rows.numpy().view(self.row_item).reshape(-1)
        self._host_buffers: dict[torch.dtype, torch.Tensor] = {}
        self._shard_base: dict[torch.device, torch.Tensor] = {}
        # Blocking events: a wait for the device sleeps instead of spinning a
        # core (cudaEventBlockingSync).
        self._copies_done = (
            torch.cuda.Event(blocking=blocking_wait) if self.on_cuda else None
        )
        self._fetched = (
            torch.cuda.Event(blocking=blocking_wait) if self.on_cuda else None
        )
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Small steps (``stage`` up to direct_copy_max_rows ids): persistent pinned
        # inputs and per-size views, so a step allocates nothing but numpy scratch.
        self._host_inputs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._step_views: dict[int, tuple[np.ndarray, torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ loading
    def shard_rows(self, index: int) -> int:
        return max(0, min(self.shard_size, self.num_rows - index * self.shard_size))

    def add_shard(
        self, index: int, weight: torch.Tensor, name: str | None = None
    ) -> bool:
        """Keep a shard's zero-copy view; False if this rank does not need it."""
        label = name or f"{self.name}.shard_{index}.weight"
        if self.ready:
            raise ValueError(
                f"{LOG_NAME}: {label}: the n-gram table was loaded already and is "
                "served in place from the checkpoint's mappings; reloading "
                "weights (reload_weights, or waking up from sleep level 2) is not "
                f"supported with {SWITCH}. Restart the server to load other "
                "weights, or use sleep level 1, which keeps them."
            )
        if not 0 <= index < self.num_shards:
            raise ValueError(
                f"{LOG_NAME}: {label}: shard index {index} is outside "
                f"[0, {self.num_shards})"
            )
        expected = (self.shard_rows(index), self.row_width)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"{LOG_NAME}: {label}: shape {tuple(weight.shape)}, expected {expected}"
            )
        if weight.dtype != self.dtype:
            raise ValueError(
                f"{LOG_NAME}: {label}: dtype {weight.dtype}, expected {self.dtype}; "
                "the table is read in place and cannot be converted without "
                "loading it into memory"
            )
        if index in self.shards:
            raise ValueError(
                f"{LOG_NAME}: {label}: shard {index} appears twice in the checkpoint"
            )
        if index not in self.required_shards:
            return False
        path = mapped_file(weight) if weight.is_contiguous() else None
        if path is None:
            raise ValueError(
                f"{LOG_NAME}: {label} is not a zero-copy view of a checkpoint file "
                f"(device {weight.device}, contiguous={weight.is_contiguous()}): "
                "the table would be held in memory. Load with vLLM's default "
                "safetensors loader (no --safetensors-load-strategy eager, no "
                f"--load-format dummy) or {WITHOUT_IT}."
            )
        madvise(weight, MADV_RANDOM)
        self.shards[index] = weight
        self.files[index] = path
        return True

    def missing_shards(self) -> list[int]:
        return [index for index in self.required_shards if index not in self.shards]

    def finish_loading(self, release: bool = True) -> None:
        """Check that every needed shard was mapped and build the gather view.

        ``release``: drop this process's mapped pages of everything else in the
        shards' files (the other tensors the loader read), see release_unused_pages.
        """
        missing = self.missing_shards()
        if missing:
            raise ValueError(
                f"{LOG_NAME}: {self.name}: checkpoint shards {missing} (of "
                f"{self.num_shards}) were not found while loading; this rank needs "
                f"shards {self.required_shards[0]}..{self.required_shards[-1]}. "
                "Refusing to serve zero rows: check the checkpoint files."
            )
        pointers = {i: self.shards[i].data_ptr() for i in self.required_shards}
        base = min(pointers.values())
        end = max(p + self.shard_rows(i) * self.row_bytes for i, p in pointers.items())
        # Byte offset of row ``r`` of shard ``s`` = shard_base[s] + r * row_bytes.
        self.shard_base = [0] * self.num_shards
        for index, pointer in pointers.items():
            shard_start = index * self.shard_size * self.row_bytes
            self.shard_base[index] = pointer - base - shard_start
        # Item r of rows_np: the row_bytes bytes from byte r of the span, so one
        # fancy-indexing call reads rows at any offsets (it releases the GIL).
        span = (ctypes.c_uint8 * (end - base)).from_address(base)
        self.rows_np = np.ndarray(
            (end - base - self.row_bytes + 1,),
            dtype=self.row_item,
            buffer=span,
            strides=(1,),
        )
        self.rows_np.flags.writeable = False
        # The same bytes as [position, row_bytes] for torch.index_select.
        self.rows_at = torch.frombuffer(span, dtype=torch.uint8).as_strided(
            (end - base - self.row_bytes + 1, self.row_bytes), (1, 1)
        )
        self.shard_base_np = np.array(self.shard_base, dtype=np.int64)
        # Uploaded now, not on the first step: a blocking copy then would be a
        # synchronisation in the serving loop (VLLM_GPU_SYNC_CHECK).
        self._shard_base = {
            self.device: torch.tensor(
                self.shard_base, dtype=torch.long, device=self.device
            )
        }
        if release:
            self.released_bytes = self.release_unused_pages()
        self.ready = True

    def enable_direct(self, device: torch.device) -> None:
        """Let ``lookup_direct`` read the mappings from ``device`` (a CUDA device
        that reads pageable host memory, or the CPU). After finish_loading."""
        if not self.ready:
            raise RuntimeError(
                f"{LOG_NAME}: {self.name}: finish_loading() was not called"
            )
        pointers = [self.shards[i].data_ptr() for i in self.required_shards]
        base = min(pointers)
        # The widest integer that every shard start and the row width divide.
        word = next(
            w
            for w in (8, 4, 2, 1)
            if self.row_bytes % w == 0 and all(p % w == 0 for p in pointers)
        )
        span_bytes = self.rows_np.shape[0] + self.row_bytes - 1
        span = tensor_at(base, span_bytes // word, word, device)
        base_words = torch.tensor(
            [b // word for b in self.shard_base], dtype=torch.long, device=device
        )
        columns = torch.arange(self.row_bytes // word, device=device)
        self._direct = (device, word, span, base_words, columns)

    def lookup_direct(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of flat int64 ``ids`` into ``out`` ([n, row_bytes] uint8), read
        on the ids' device from the mappings: device ops only (no host work, no
        synchronisation), so this can be captured in a CUDA graph."""
        direct = getattr(self, "_direct", None)
        if direct is None or direct[0] != ids.device:
            raise RuntimeError(
                f"{LOG_NAME}: {self.name}: enable_direct({ids.device}) was not called"
            )
        _, word, span, base_words, columns = direct
        shard = torch.div(ids, self.shard_size, rounding_mode="floor")
        ours = None
        if self.partial:
            ours = (ids >= self.row_start) & (ids < self.row_end)
            shard = torch.where(ours, shard, 0)
        first = base_words[shard] + ids * (self.row_bytes // word)
        if ours is not None:
            first = torch.where(ours, first, 0)
        index = (first.unsqueeze(1) + columns).reshape(-1)
        rows = torch.index_select(span, 0, index).view(ids.numel(), -1)
        if ours is not None:
            rows = rows.masked_fill(~ours.unsqueeze(1), 0)
        out.view(span.dtype).view(ids.numel(), -1).copy_(rows)

    def release_unused_pages(self, page: int = PAGE_SIZE) -> int:
        """madvise(MADV_DONTNEED) the pages of the shards' file mappings outside
        the shards (page-aligned; edge pages shared with a shard are kept).

        The kept shard views hold each file's whole mapping; every other tensor
        of those files that the loader read would otherwise stay mapped in this
        process (RssFile). The pages stay in the page cache (reclaimable) and a
        later access reads them back correctly: nothing is lost. Returns the
        bytes of address range released.
        """
        mappings = file_mappings(set(self.files.values()))
        keep = [_page_range(shard, page) for shard in self.shards.values()]
        released = 0
        for start, end in unused_ranges([(lo, hi) for lo, hi, _ in mappings], keep):
            madvise_range(start, end, MADV_DONTNEED)
            released += end - start
        return released

    @property
    def mapped_bytes(self) -> int:
        return sum(self.shard_rows(i) * self.row_bytes for i in self.shards)

    def describe(self) -> str:
        return (
            f"{len(self.shards)} shards in {len(set(self.files.values()))} files, "
            f"{self.mapped_bytes / 2**30:.2f} GiB mapped, "
            f"rows [{self.row_start}, {self.row_end}) of {self.num_rows}, "
            f"{self.dtype}; "
            f"{self.released_bytes / 2**30:.2f} GiB of other tensors' pages released; "
            f"page size {PAGE_SIZE // 1024} KiB; gather pool of {self.num_threads} "
            "threads after a disk wait"
            + (
                f" and from {self.pool_min_rows} rows"
                if self.pool_min_rows is not None
                else ""
            )
            + f"; warm gathers of {self.index_select_min_rows}+ rows: one index_select "
            f"on {self.index_select_threads} torch threads"
        )

    # ------------------------------------------------------------------ gathers
    def offsets(self, ids: torch.Tensor) -> torch.Tensor:
        """Byte offsets in ``rows_np`` of rows ``ids`` (any device); -1: not ours."""
        shard_base = self._shard_base.get(ids.device)
        if shard_base is None:
            shard_base = torch.tensor(
                self.shard_base, dtype=torch.long, device=ids.device
            )
            self._shard_base[ids.device] = shard_base
        shard = torch.div(ids, self.shard_size, rounding_mode="floor")
        offsets = shard_base[shard].add_(ids * self.row_bytes)
        if self.partial:
            ours = (ids >= self.row_start) & (ids < self.row_end)
            offsets = torch.where(ours, offsets, -1)
        return offsets

    def gather_offsets(self, offsets: np.ndarray, out: np.ndarray) -> None:
        """Rows at byte ``offsets`` (int64; -1: zeros) into ``out[:len(offsets)]``.

        ``out`` holds ``row_item`` items (the pinned buffer's numpy view).
        Gathers run in the calling thread, their first rows as a probe of the
        page cache; one whose probe waited for the disk (or, with pool_min_rows
        set, one of that many rows) is split over the thread pool. A warm one
        of index_select_min_rows rows or more is one torch.index_select (one
        thread in a serving vLLM worker, torch's threads elsewhere).
        """
        count = offsets.size
        foreign = None
        if self.partial:
            foreign = offsets < 0
            if foreign.any():
                offsets = np.where(foreign, 0, offsets)
            else:
                foreign = None
        self.stats["gathers"] += 1
        by_size = self.pool_min_rows is not None and count >= self.pool_min_rows
        if by_size and self.num_threads > 1:
            self._gather_parallel(offsets, 0, count, out)
        else:
            first = min(count, self.PROBE_ROWS)
            faults = major_faults()
            out[:first] = self.rows_np[offsets[:first]]
            if count > first:
                if self.num_threads > 1 and major_faults() != faults:
                    # A read of the probe waited for the disk: overlap the rest.
                    self.stats["disk_waits"] += 1
                    self._gather_parallel(offsets, first, count, out)
                elif count - first >= self.index_select_min_rows:
                    self.stats["index_selects"] += 1
                    self._index_select_rows(offsets, first, count, out)
                else:
                    self._copy_rows(offsets, first, count, out)
        if foreign is not None:
            out[:count].view(np.uint8).reshape(count, -1)[foreign] = 0

    def _index_select_rows(
        self, offsets: np.ndarray, start: int, end: int, out: np.ndarray
    ) -> None:
        """Rows [start, end) by one torch.index_select into ``out``'s bytes."""
        dest = out[start:end].view(np.uint8).reshape(end - start, self.row_bytes)
        index = torch.from_numpy(np.ascontiguousarray(offsets[start:end]))
        with torch_threads_at_least(self.index_select_threads):
            torch.index_select(self.rows_at, 0, index, out=torch.from_numpy(dest))

    def _copy_rows(self, offsets: np.ndarray, start: int, end: int, out) -> None:
        step = self.rows_per_task
        rows = self.rows_np
        for chunk in range(start, end, step):
            stop = min(end, chunk + step)
            out[chunk:stop] = rows[offsets[chunk:stop]]

    def _gather_parallel(
        self, offsets: np.ndarray, start: int, end: int, out: np.ndarray
    ) -> None:
        """Rows [start, end) over the pool: contiguous parts, the last one here."""
        self.stats["pool_gathers"] += 1
        parts = min(self.num_threads, -(-(end - start) // self.rows_per_task))
        per_part = -(-(end - start) // parts)
        bounds = [(a, min(end, a + per_part)) for a in range(start, end, per_part)]
        pool = self._pool_executor()
        futures = [
            pool.submit(self._copy_rows, offsets, a, b, out) for a, b in bounds[:-1]
        ]
        self._copy_rows(offsets, *bounds[-1], out)
        for future in futures:
            future.result()

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max(1, self.num_threads - 1), thread_name_prefix=THREAD_PREFIX
                )
            return self._pool

    def gather(self, offsets: torch.Tensor, out: torch.Tensor) -> None:
        """Rows at byte ``offsets`` (CPU int64 tensor) into ``out`` (CPU uint8 rows)."""
        out_np = out.numpy().view(self.row_item).reshape(-1)
        self.gather_offsets(offsets.numpy(), out_np)

    def _wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def _fill(self, ids: torch.Tensor, out: torch.Tensor, dedup: bool) -> None:
        """Rows of token-major ``ids`` (any device) into ``out`` ([n, row_bytes] uint8).

        ``dedup``: sort the ids' offsets where they are (the device), send the
        sorted offsets and their first-occurrence marks to the host (one wait),
        gather the unique rows, upload, and expand with the inverse index on the
        device. No op here synchronises implicitly (``torch.unique`` would, to
        size its output). Otherwise rows are gathered in token order and
        uploaded straight to ``out``.
        """
        if not self.ready:
            raise RuntimeError(
                f"{LOG_NAME}: {self.name}: finish_loading() was not called"
            )
        count = ids.numel()
        if count > self.max_ids:
            raise ValueError(
                f"{LOG_NAME}: {self.name}: {count} ids exceed the workspace "
                f"of {self.max_ids}"
            )
        # The host buffer is reused: the last step's upload must have left.
        self._wait(self._copies_done)
        if dedup:
            flat = self.offsets(ids.reshape(-1))
            ordered, order = torch.sort(flat)
            first = torch.ones_like(ordered, dtype=torch.bool)
            torch.ne(ordered[1:], ordered[:-1], out=first[1:])
            slot = torch.cumsum(first, 0).sub_(1)
            inverse = torch.empty_like(slot).index_copy_(0, order, slot)
            host_ordered, host_first = self._host_arrays(ordered, first)
            unique = host_ordered[host_first]
            staging = self.host_rows[: unique.size]
            self.gather_offsets(unique, self.host_rows_np)
            rows = staging
            if self.on_cuda:
                rows = self.device_rows[: unique.size]
                rows.copy_(staging, non_blocking=True)
            torch.index_select(rows, 0, inverse, out=out)
        else:
            host_ids = self.fetch(ids.reshape(-1))[0]
            self.gather_offsets(self.offsets(host_ids).numpy(), self.host_rows_np)
            out.copy_(self.host_rows[:count], non_blocking=True)
        if self._copies_done is not None:
            self._copies_done.record()

    def fetch(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host copies of small tensors; device ones in one pinned copy, one wait."""
        if all(t.device.type == "cpu" for t in tensors):
            return list(tensors)
        device = next(t.device for t in tensors if t.device.type != "cpu")
        tensors = tuple(t.to(device) for t in tensors)
        if len({t.dtype for t in tensors}) > 1:
            tensors = tuple(t.long() for t in tensors)
        flat = (
            torch.cat([t.reshape(-1) for t in tensors])
            if len(tensors) > 1
            else tensors[0].reshape(-1)
        )
        buffer = self._host_buffers.get(flat.dtype)
        if buffer is None or buffer.numel() < flat.numel():
            buffer = torch.empty(
                max(flat.numel(), 1 << 16),
                dtype=flat.dtype,
                device="cpu",
                pin_memory=True,
            )
            self._host_buffers[flat.dtype] = buffer
        host = buffer[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        self._fetched.record()
        self._fetched.synchronize()
        parts = host.split([t.numel() for t in tensors])
        return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]

    def lookup(
        self, ngram_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of ``[num_tokens, heads]`` ids: ``[num_tokens, heads * row_width]``."""
        num_tokens = ngram_ids.shape[0]
        if out is None:
            out = torch.empty(
                num_tokens,
                self.heads * self.row_width,
                dtype=self.dtype,
                device=self.device,
            )
        rows = out.view(torch.uint8).view(-1, self.row_bytes)
        self._fill(ngram_ids, rows, dedup=ngram_ids.numel() > self.direct_copy_max_rows)
        return out

    def stage(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor,
        ngram_context: torch.Tensor,
        query_start_loc_host: np.ndarray | None = None,
    ) -> int:
        """Hash one step's tokens, stage their rows for ``staged()``; count staged.

        The inputs are what the forward would see (device tensors in vLLM).
        ``query_start_loc_host``: the runner's host copy of ``query_start_loc``;
        a decode step then copies back only its token ids and context. A small
        step is copied to the host and hashed there; a large step is hashed on
        its device and deduplicated there.
        """
        if self.hasher is None or self.staged_rows is None:
            raise RuntimeError(
                f"{LOG_NAME}: {self.name} was built without a hasher and a "
                "static output"
            )
        num_tokens = input_ids.numel()
        if (
            num_tokens * self.heads <= self.direct_copy_max_rows
            and num_tokens <= self.host_hash_max_tokens
        ):
            qsl = (
                query_start_loc
                if query_start_loc_host is None
                else query_start_loc_host
            )
            self._stage_direct(input_ids, qsl, ngram_context, num_tokens)
            self._mark_staged()
            return num_tokens
        out = self.staged_rows[: num_tokens * self.heads]
        on_host = input_ids.device.type == "cpu"
        if not on_host:
            ids = self.hasher.ids_tensor(input_ids, query_start_loc, ngram_context)
            self._fill(ids, out, dedup=True)
            self._mark_staged()
            return num_tokens
        query_start_loc = query_start_loc.cpu()
        ngram_context = ngram_context.cpu()
        if num_tokens <= self.host_hash_max_tokens:
            ids = self.hasher.ids_host(
                input_ids.tolist(), query_start_loc.tolist(), ngram_context.tolist()
            )
        else:
            ids = self.hasher.ids_tensor(input_ids, query_start_loc, ngram_context)
        self._fill(ids, out, dedup=False)
        self._mark_staged()
        return num_tokens

    def _mark_staged(self) -> None:
        self._epoch += 1
        self._host_staged = self._epoch
        self.staged_epoch.fill_(self._epoch)

    def stage_dummy(self) -> None:
        """Mark the static buffer as a dummy batch's rows (profiling, CUDA-graph
        warm-up and capture: whatever it holds), readable any number of times
        until the next ``stage()``."""
        self._host_staged = DUMMY_EPOCH
        self.staged_epoch.fill_(DUMMY_EPOCH)

    def check_staged(self) -> None:
        """Refuse rows that no ``stage()`` wrote since the forward last read them.

        On the host (whenever Python runs the forward: eager steps, compilation,
        CUDA-graph capture) a clear error; on the device, for replays of
        captured graphs, an asynchronous assert that compares the two step
        counters: no host synchronisation, a few tiny kernels in the graph.
        """
        self.check_staged_host()
        self.check_staged_device()

    def check_staged_host(self) -> None:
        if self._host_staged != DUMMY_EPOCH and self._host_staged == self._host_read:
            what = (
                "no step was ever staged"
                if self._host_staged == 0
                else f"step {self._host_staged} was read already"
            )
            raise RuntimeError(
                f"{LOG_NAME}: {self.name}: the forward reads PLE rows that were not "
                f"staged for it ({what}): Qwen4ExpModelState.prepare_inputs must "
                "stage every forward's rows; a runner path that skips it would "
                "serve stale rows."
            )
        self._host_read = self._host_staged

    def check_staged_device(self) -> None:
        fresh = (self.staged_epoch < 0) | (self.staged_epoch != self.read_epoch)
        torch._assert_async(
            fresh.squeeze(0),
            f"{LOG_NAME}: {self.name}: PLE rows were not staged for this forward",
        )
        self.read_epoch.copy_(self.staged_epoch)

    def _stage_direct(
        self,
        input_ids: torch.Tensor,
        query_start_loc: torch.Tensor | np.ndarray,
        ngram_context: torch.Tensor,
        num_tokens: int,
    ) -> None:
        """A decode step: ids to the host, numpy hashing and gather, one upload.

        No deduplication (a few hundred rows; repeats cost less than sorting),
        no inverse index: the rows are gathered in token order straight into
        the pinned buffer and copied to the static device buffer as they are.
        """
        if not self.ready:
            raise RuntimeError(
                f"{LOG_NAME}: {self.name}: finish_loading() was not called"
            )
        count = num_tokens * self.heads
        if count > self.max_ids:
            raise ValueError(
                f"{LOG_NAME}: {self.name}: {count} ids exceed the workspace "
                f"of {self.max_ids}"
            )
        tokens, qsl, context = self._host_arrays(
            input_ids, query_start_loc, ngram_context
        )
        ids = self.hasher.ids_numpy(tokens, qsl, context).reshape(-1)
        host, out = self.gather_host(ids)
        if self.on_cuda:
            out.copy_(host, non_blocking=True)
            self._copies_done.record()
        else:
            out.copy_(host)

    def gather_host(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of flat int64 ``ids`` into the pinned buffer, in their order.

        Returns that buffer's ``[len(ids), row_bytes]`` slice and the matching
        slice of the static device buffer (``staged_rows``) it is uploaded to.
        """
        count = ids.size
        views = self._step_views.get(count)
        if views is None:
            host = self.host_rows[:count]
            views = (self.host_rows_np[:count], host, self.staged_rows[:count])
            self._step_views[count] = views
        host_np, host, out = views
        offsets = self.shard_base_np[ids // self.shard_size]
        offsets += ids * self.row_bytes
        if self.partial:
            offsets[(ids < self.row_start) | (ids >= self.row_end)] = -1
        # The host buffer is reused: the last step's upload must have left.
        self._wait(self._copies_done)
        self.gather_offsets(offsets, host_np)
        return host, out

    def _host_arrays(self, *tensors: torch.Tensor | np.ndarray) -> list[np.ndarray]:
        """Numpy views of small tensors on the host: device ones are copied into
        persistent pinned buffers (one copy each, one blocking wait for all);
        host tensors and numpy arrays are used as they are."""
        views = []
        device = False
        for position, tensor in enumerate(tensors):
            if isinstance(tensor, np.ndarray):
                views.append(tensor)
                continue
            if tensor.device.type == "cpu":
                views.append(tensor.numpy())
                continue
            key = (position, tensor.dtype)
            buffer = self._host_inputs.get(key)
            if buffer is None or buffer.numel() < tensor.numel():
                buffer = torch.empty(
                    max(tensor.numel(), 1 << 12),
                    dtype=tensor.dtype,
                    device="cpu",
                    pin_memory=True,
                )
                self._host_inputs[key] = buffer
            host = buffer[: tensor.numel()].view(tensor.shape)
            host.copy_(tensor, non_blocking=True)
            views.append(host.numpy())
            device = True
        if device:
            self._fetched.record()
            self._fetched.synchronize()
        return views

    def staged(self, num_tokens: int) -> torch.Tensor:
        """Staged rows of the first ``num_tokens`` tokens, ``[num_tokens, -1]``."""
        return (
            self.staged_rows[: num_tokens * self.heads]
            .view(self.dtype)
            .view(num_tokens, -1)
        )

    def extra_repr(self) -> str:
        return (
            f"num_rows={self.num_rows}, row_width={self.row_width}, "
            f"dtype={self.dtype}, shards={self.num_shards}"
        )
